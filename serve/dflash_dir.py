"""SGLang's DFlash drafter directory: what `DFlashDraftModel` loads (train/dflash.py), and its validation.

A directory holds `config.json` (architectures = ["DFlashDraftModel"], the layer's shape, RoPE in both the
transformers-5 and the legacy form, `num_target_layers`, and `dflash_config` with `target_layer_ids`,
`block_size` and `mask_token_id`) and safetensors with exactly the drafter's tensors: no embedding, no head and
no draft vocab (the target's are used). SGLang ignores names it does not know, so the key set is checked here.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig

from train.dflash import SGLANG_CLASS  # noqa: F401  (the class a directory's config names)

from .drafter_dir import DrafterDirError, dtype_and_rope_fields, write_whole


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    H, I, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"fc.weight": (H, len(config.dflash_config["target_layer_ids"]) * H), "hidden_norm.weight": (H,),
              "norm.weight": (H,)}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                   p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I)}
    return shapes


def validate(config: LlamaConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    want, problems = expected_shapes(config), []
    problems += [f"missing tensor {n}" for n in sorted(set(want) - set(tensors))]
    problems += [f"unexpected tensor {n} (SGLang would skip it silently)" for n in sorted(set(tensors) - set(want))]
    problems += [f"{n} has shape {list(tensors[n].shape)}, the config implies {list(want[n])}"
                 for n in sorted(set(want) & set(tensors)) if tuple(tensors[n].shape) != want[n]]
    dflash = getattr(config, "dflash_config", None) or {}
    problems += [f"dflash_config has no {k}" for k in ("target_layer_ids", "block_size", "mask_token_id")
                 if dflash.get(k) is None]
    if problems:
        raise DrafterDirError(f"{where}: not a valid SGLang DFlash drafter:\n  " + "\n  ".join(problems))


def sglang_config(config: LlamaConfig) -> dict:
    """config.json for SGLang: the transformers-5 dict plus the legacy RoPE fields older readers use."""
    out = config.to_dict()
    return out | dtype_and_rope_fields(out)


def write(out: str | Path, config: LlamaConfig, tensors: dict[str, torch.Tensor], card: str,
          weights_dtype: torch.dtype = torch.bfloat16) -> None:
    """The directory, validated first; floating tensors in `weights_dtype`."""
    tensors = {k: v.to(weights_dtype).contiguous() for k, v in tensors.items()}
    validate(config, tensors, str(out))
    write_whole(Path(out), tensors, sglang_config(config), card)


def load(directory: str | Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """An exported DFlash drafter as a module (train.dflash.DFlashDrafter), validated first."""
    from data.files import read_json, safetensors_reader
    from train.dflash import DFlashDrafter
    path = Path(directory)
    raw = read_json(path / "config.json")
    if raw is None:
        raise DrafterDirError(f"{path / 'config.json'}: missing")
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")})
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safetensors_reader(f, "serve.export (or the drafter's publisher)") as fh:
            tensors |= {k: fh.get_tensor(k) for k in fh.keys()}
    validate(config, tensors, str(path))
    model = DFlashDrafter(config)
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model.to(device, dtype).eval()


def is_dflash_dir(directory: str | Path) -> bool:
    from data.files import read_json
    return (read_json(Path(directory) / "config.json") or {}).get("architectures") == [SGLANG_CLASS]
