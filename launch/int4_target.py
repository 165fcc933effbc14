"""`python -m launch.int4_target --source DIR --out DIR [--quantize routed-experts|mlp] [--group-size 32]`

A target quantized the way Kimi-K2.5 ships: compressed-tensors `pack-quantized` W4A16, 4-bit symmetric integer
weights with one scale per group of --group-size inputs, on the routed experts (`--quantize routed-experts`, the
MoE targets) or on every MLP projection (`--quantize mlp`, a Llama); attention, shared experts, dense MLPs, the
router, embedding and head stay in --dtype (bf16). The scales come from compressed-tensors' `calculate_qparams`
and the packing from its `PackedQuantizationCompressor` (the library's own writer, not hand-packed bytes);
`config.json` gets the `quantization_config` its `ModelCompressor` writes, with targets ["Linear"] and the
unquantized modules in `ignore` (Kimi-K2.5's layout, which SGLang's compressed_tensors_wNa16_moe scheme serves).
The quantized model is a stand-in for a published INT4 checkpoint in tests and measurements: it answers how
features captured from the deployed INT4 target differ from its bf16 original's.
"""
from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from data.files import atomic_write_json, load_safetensors, read_json

# what is quantized (a module name pattern) and what compressed-tensors is told to leave alone
QUANTIZED = {"routed-experts": re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj"),
             "mlp": re.compile(r".*\.mlp\.(gate|up|down)_proj")}
# `ignore` is Kimi-K2.5's own list for the MoE targets. Its `gate_up` matters: SGLang checks a fused layer's own
# name (model.layers.0.mlp.gate_up_proj) against `ignore` where the model class declares no fused mapping for it
# (DeepseekV2 declares none), so without it SGLang builds the dense first layer's MLP quantized and fails to load
# its bf16 weights (KeyError: model.layers.0.mlp.gate_up_proj.weight, seen with SGLang 0.5.14 on the GPU machine)
IGNORED = {"routed-experts": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*",
                              r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
           "mlp": ["lm_head", r"re:.*self_attn.*"]}


def quantize_target(source: str | Path, out: str | Path, quantize: str = "routed-experts", group_size: int = 32,
                    dtype: str = "bfloat16") -> dict:
    """Write the quantized copy of `source` to `out`; returns {quantized: n tensors, kept: n tensors}."""
    from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus)
    from compressed_tensors.quantization.utils import calculate_qparams

    source, out = Path(source), Path(out)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    pattern, float_dtype = QUANTIZED[quantize], getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():  # tokenizer, chat template, generation config: the source's
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    counts, weight_map = {"quantized": 0, "kept": 0}, {}
    for f in tqdm(sorted(source.glob("*.safetensors")), desc="quantize shards"):
        written = {}
        for name, tensor in load_safetensors(f, "the source target's trainer").items():
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and pattern.fullmatch(module)):
                written[name] = tensor.to(float_dtype) if tensor.is_floating_point() else tensor
                counts["kept"] += 1
                continue
            rows, cols = tensor.shape
            if cols % group_size:
                raise ValueError(f"{f}: {name} has {cols} inputs, not a multiple of the group size {group_size}")
            weight = tensor.to(float_dtype)
            groups = weight.float().reshape(rows, cols // group_size, group_size)
            scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            packed = PackedQuantizationCompressor.compress(
                {"weight": weight, "weight_scale": scale.to(float_dtype), "weight_zero_point": zero_point}, scheme)
            written |= {f"{module}.{k}": v.contiguous() for k, v in packed.items()}
            counts["quantized"] += 1
        save_file(written, str(out / f.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(written, f.name)
    if not counts["quantized"]:
        raise ValueError(f"{source}: no tensor matches {pattern.pattern} (--quantize {quantize})")
    if (source / "model.safetensors.index.json").exists():  # the tensor names changed: index the written ones
        atomic_write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status=QuantizationStatus.COMPRESSED, ignore=IGNORED[quantize])
    ModelCompressor(quantization_config=config).update_config(str(out))
    _declare_dtype(out / "config.json", dtype)
    return counts


def _declare_dtype(path: Path, dtype: str) -> None:
    """What is not quantized is in `dtype` (transformers 5 reads `dtype`; the older `torch_dtype` goes)."""
    config = read_json(path)
    config.pop("torch_dtype", None)
    atomic_write_json(path, config | {"dtype": dtype})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="a target directory in full precision")
    p.add_argument("--out", required=True)
    p.add_argument("--quantize", default="routed-experts", choices=sorted(QUANTIZED))
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", help="the dtype of everything left unquantized")
    a = p.parse_args(argv)
    counts = quantize_target(a.source, a.out, a.quantize, a.group_size, a.dtype)
    print(f"[int4] {a.source} -> {a.out}: {counts['quantized']} weights quantized, {counts['kept']} kept", flush=True)
    return counts


if __name__ == "__main__":
    main()
