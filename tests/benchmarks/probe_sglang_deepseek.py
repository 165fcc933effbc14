"""Which tiny DeepseekV3 (MLA + MoE) targets SGLang serves (GPU machine; not collected by pytest).

    source .whl/gpu-env.sh; source .sgl/sglang-env.sh; python3 tests/benchmarks/probe_sglang_deepseek.py

The demo's tiny DeepseekV3 target with kv_lora 16 / rope 16 crashed SGLang 0.5.14's plain server at its first
prefill with an illegal memory access (reported at silu_and_mul, which is only where it surfaced). Each variant
runs in its own process with CUDA_LAUNCH_BLOCKING=1 so a failing kernel names itself, through the offline Engine
(triton attention, no CUDA graphs, as serve.smoke launches it). Results: tests/benchmarks/RESULTS.md.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from launch.demo_target import SGLANG_MLA_DIMS, build_tiny_deepseek  # noqa: E402

VARIANTS = {  # name: (build_tiny_deepseek keyword arguments, engine keyword arguments)
    "demo": (SGLANG_MLA_DIMS, {}),  # the demo's DeepseekV3 target now (hidden 64)
    "kv16-rope16": ({}, {}),  # build_tiny_deepseek's defaults, the demo's target before
    "kv16-rope16-dense": ({"first_k_dense_replace": 4}, {}),
    "kv16-rope16-flashinfer": ({}, {"attention_backend": "flashinfer"}),
    "kv64-rope64": ({"hidden": 256, "kv_lora_rank": 64, "q_lora_rank": 128}, {}),
    "hidden256-heads2": (SGLANG_MLA_DIMS | {"hidden": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
                                            "q_lora_rank": 128}, {}),
}


def child(target: str, engine_args: dict) -> None:
    import sglang
    args = dict(model_path=target, skip_tokenizer_init=True, attention_backend="triton", sampling_backend="pytorch",
                grammar_backend="none", disable_cuda_graph=True, mem_fraction_static=0.3, dtype="bfloat16",
                log_level="error") | engine_args
    engine = sglang.Engine(**args)
    out = engine.generate(input_ids=[[5, 6, 7, 8, 9, 10, 11, 12]] * 4,
                          sampling_params={"max_new_tokens": 16, "temperature": 0})
    print("PROBE-OK", json.dumps([o["output_ids"] for o in out][:2]), flush=True)
    engine.shutdown()


def main() -> None:
    names = sys.argv[1:] or list(VARIANTS)
    root = Path(tempfile.mkdtemp(prefix="probe-dsv3-"))
    for name in names:
        build_args, engine_args = VARIANTS[name]
        target = root / name
        build_tiny_deepseek(target, vocab_size=512, **build_args)
        env = os.environ | {"CUDA_LAUNCH_BLOCKING": "1"}
        try:
            p = subprocess.run([sys.executable, __file__, "--child", str(target), json.dumps(engine_args)], env=env,
                               capture_output=True, text=True, timeout=int(os.environ.get("PROBE_TIMEOUT", "100")))
            log, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            log, rc = (e.stdout or b"").decode() + (e.stderr or b"").decode(), "timeout"
        lines = log.splitlines()
        ok = any(line.startswith("PROBE-OK") for line in lines)
        where = [line.strip() for line in lines if "sglang/srt/layers" in line or "sglang/jit_kernel" in line
                 or "sgl_kernel" in line or "Error" in line][-8:]
        print(json.dumps({"variant": name, "ok": ok, "rc": rc, "where": [] if ok else where}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
