#!/bin/sh
# SGLang's model classes on a CPU machine, for serve.sglang_check (SGLang cannot serve on CPU; its loader runs).
# sglang's own requirements pull CUDA builds, so it goes in without them, followed by what its import path needs
# (measured with sglang 0.5.23; transformers 5.19 is the version that loader check was validated with).
set -e
pip install -q --no-deps "sglang==0.5.23"
pip install -q "transformers==5.19.0" "triton==3.9.0" orjson psutil pybase64 requests pillow starlette msgspec \
    pyzmq ipython aiohttp dill apache-tvm-ffi sentencepiece compressed-tensors gguf openai partial-json-parser einops
