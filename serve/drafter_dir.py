"""SGLang's EAGLE-3 drafter directory: what SGLang's class for the drafter's architecture (train/drafters/:
`LlamaForCausalLMEagle3`, `Eagle3DeepseekV2ForCausalLM`; each names its attention tensors, the rest is alike)
loads, and its validation. With the EAGLE-3.1 option `fc_norm` (or its legacy `use_aux_norm`) it also holds
fc_norm.{0,1,2}.weight; `norm_output` is a config key only.

A directory holds `config.json` (architectures = that class, `num_hidden_layers: 1`, `vocab_size`
= the target's, `draft_vocab_size`, `target_hidden_size`, `tie_word_embeddings: false`, RoPE in both the
transformers-5 and the legacy form, `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with
exactly the drafter's tensors: SGLang silently skips unknown names and a missing `d2t`, so every check that
matters happens here, before a server ever sees the directory.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig

from data.files import read_json, safetensors_reader
from data.target import declared_dtype, load_target_info, load_target_tensors
from data.vocab import check_draft_vocab
from train.drafter import Eagle3Drafter, eagle31_options
from train.drafters import arch_of


class DrafterDirError(ValueError):
    pass


LEGACY_FC_NORM = {"aux_norm_low": 0, "aux_norm_mid": 1, "aux_norm_high": 2}  # EAGLE-3.1's fc_norm, older names


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    H, I = config.hidden_size, config.intermediate_size
    shapes = {
        "fc.weight": (H, 3 * config.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        **{f"midlayer.self_attn.{k}.weight": v for k, v in arch_of(config).attention_shapes(config).items()},
        "midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (config.draft_vocab_size, H),
        "d2t": (config.draft_vocab_size,), "t2d": (config.vocab_size,),
    }
    if eagle31_options(config)["fc_norm"]:
        shapes |= {f"fc_norm.{i}.weight": (config.target_hidden_size,) for i in range(3)}
    if config.hidden_size != config.target_hidden_size:  # the target's embedding does not fit: ship our own
        shapes["embed_tokens.weight"] = (config.vocab_size, H)
    return shapes


def dtype_and_rope_fields(out: dict) -> dict:
    """The declared dtype under both keys (transformers 4 and 5 readers; the target's: train.drafter.drafter_config)
    and the legacy RoPE fields older readers use, from a config's transformers-5 dict."""
    rope = dict(out.get("rope_parameters") or {})
    dtype = declared_dtype(out) or "bfloat16"
    return {"dtype": dtype, "torch_dtype": dtype, "rope_theta": rope.get("rope_theta", 10000.0),
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else
            {k: v for k, v in rope.items() if k != "rope_theta"}}


def sglang_config(config: LlamaConfig) -> dict:
    """config.json for SGLang: the transformers-5 dict plus the legacy RoPE fields older readers use."""
    out = config.to_dict()
    arch = arch_of(config)
    out |= {"architectures": [arch.sglang_class], "model_type": arch.model_type, "num_hidden_layers": 1,
            "tie_word_embeddings": False} | dtype_and_rope_fields(out)
    out["eagle_config"] = dict(out["eagle_config"]) | {"use_aux_hidden_state": True}
    return out


def write_whole(out: Path, tensors: dict[str, torch.Tensor], config_json: dict, card: str) -> None:
    """A drafter directory (model.safetensors, config.json, README.md), written whole or not at all."""
    import shutil

    from safetensors.torch import save_file

    from data.files import atomic_write_json
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    atomic_write_json(tmp / "config.json", config_json)
    (tmp / "README.md").write_text(card)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def read_config(directory: str | Path, default_layer_ids: list[int] | None = None) -> LlamaConfig:
    """A drafter's config.json. Its aux layer ids are read, never assumed: a config that names none takes
    `default_layer_ids` only when the caller passes them (SGLang's default for the target it will serve on)."""
    path = Path(directory) / "config.json"
    raw = read_json(path)
    if raw is None:
        raise DrafterDirError(f"{path}: missing")
    missing = [k for k in ("hidden_size", "vocab_size", "draft_vocab_size") if raw.get(k) is None]
    if missing:
        raise DrafterDirError(f"{path}: no {', '.join(missing)}")
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids and default_layer_ids:
        raw["eagle_config"] = dict(raw.get("eagle_config") or {}) | {"eagle_aux_hidden_state_layer_ids":
                                                                     list(default_layer_ids)}
    elif not ids:
        raise DrafterDirError(f"{path}: no eagle_config.eagle_aux_hidden_state_layer_ids; an imported drafter's "
                              "layer ids are read, never assumed (import with --target TARGET to take the ids "
                              "SGLang uses for that target when a drafter names none)")
    if raw.get("norm_before_fc"):
        raise DrafterDirError(f"{path}: norm_before_fc is set, and SGLang 0.5.14 reads no such key: it would serve "
                              "this drafter without the norm it was trained with")
    raw.setdefault("target_hidden_size", raw["hidden_size"])
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")})
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    try:
        arch_of(config)
    except ValueError as e:
        raise DrafterDirError(f"{path}: {e}") from None
    return config


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise DrafterDirError(f"{directory}: no safetensors")
    tensors = {}
    for f in files:
        with safetensors_reader(f, "serve.export (or the drafter's publisher, for an imported one)") as fh:
            for k in fh.keys():
                # some publishers prefix the names with "model.", or name the layer "layers.0." (SGLang's MLA
                # drafter loader reads both as midlayer.)
                name = k[len("model."):] if k.startswith("model.") else k
                name = "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
                for legacy, i in LEGACY_FC_NORM.items():  # SGLang's Llama loader maps these names too
                    name = name.replace(legacy, f"fc_norm.{i}")
                tensors[name] = fh.get_tensor(k)
    return tensors


def validate(config: LlamaConfig, tensors: dict[str, torch.Tensor], where: str,
             layer_ids: list[int] | None = None) -> None:
    """Exact key set and shapes against the config, d2t consistent with t2d, layer ids as expected."""
    problems = []
    if config.num_hidden_layers != 1:
        problems.append(f"num_hidden_layers is {config.num_hidden_layers}, this format has one layer")
    if getattr(config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings must be false (the lm_head is over the draft vocab)")
    want = expected_shapes(config)
    for name in sorted(set(want) - set(tensors)):
        problems.append(f"missing tensor {name}")
    for name in sorted(set(tensors) - set(want)):
        problems.append(f"unexpected tensor {name} (SGLang would skip it silently)")
    for name in sorted(set(want) & set(tensors)):
        if tuple(tensors[name].shape) != want[name]:
            problems.append(f"{name} has shape {list(tensors[name].shape)}, the config implies {list(want[name])}")
    if "d2t" in tensors and "t2d" in tensors and not problems:
        try:
            check_draft_vocab(tensors["d2t"], tensors["t2d"])
        except ValueError as e:
            problems.append(str(e))
    ids = config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    if layer_ids is not None and list(ids) != list(layer_ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids {ids} differ from the training shards' {layer_ids}")
    if problems:
        raise DrafterDirError(f"{where}: not a valid SGLang EAGLE-3 drafter:\n  " + "\n  ".join(problems))


def served_layer_ids(config: LlamaConfig, target: str | Path, directory: str | Path) -> list[int]:
    written = list(config.eagle_config["eagle_aux_hidden_state_layer_ids"])
    try:
        return load_target_info(target).drafter_layer_ids(written)
    except ValueError as e:
        raise DrafterDirError(f"{directory}: eagle_aux_hidden_state_layer_ids {written}: {e}") from None


def load_drafter(directory: str | Path, target: str | Path, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """An exported (SGLang-format) drafter as a module; the embedding is the target's unless it ships one. Its
    config's layer ids become the layer outputs SGLang would feed it on this target (the same ids, except on
    DeepseekV2-family targets for ids not starting with 1: data.target.sglang_captured_outputs)."""
    config, tensors = read_config(directory), read_tensors(directory)
    validate(config, tensors, str(directory))
    config.eagle_config["eagle_aux_hidden_state_layer_ids"] = served_layer_ids(config, target, directory)
    model = Eagle3Drafter(config, tensors.pop("d2t"), tensors.pop("t2d"))
    if "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = load_target_tensors(target, ["embed"])["embed"]
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return model.to(device, dtype).eval()


TRAINED_ON = "trained_on.json"  # beside config.json: which target's features the drafter learned (SGLang ignores it)


def write_trained_on(out: str | Path, features_meta: dict) -> None:
    """Record the target the drafter's features came from, so a drafter served on another copy of the target (an
    INT4 deployment of a bf16 original, say) is said to be, not silently trusted."""
    from data.files import atomic_write_json
    atomic_write_json(Path(out) / TRAINED_ON, {
        "target": features_meta.get("target_id"), "target_config_hash": features_meta.get("target_config_hash"),
        "target_quantization": features_meta.get("target_quantization", ""),
        "backend": (features_meta.get("extra") or {}).get("backend")})


def target_match(drafter: str | Path, target: str | Path) -> dict:
    """The drafter's training target against the one it is evaluated or served on: {trained_on, served_on,
    same_target, note}. A drafter without the record (imported, or exported before it existed) is 'unknown'."""
    info = load_target_info(target)
    served = {"target": str(target), "target_config_hash": info.config_hash, "target_quantization": info.quantization}
    trained = read_json(Path(drafter) / TRAINED_ON)
    if trained is None:
        return {"trained_on": None, "served_on": served, "same_target": None,
                "note": f"{drafter} does not record which target's features it was trained on"}
    same = trained["target_config_hash"] == info.config_hash
    note = "" if same else (
        f"trained on features of {trained['target']} "
        f"({trained['target_quantization'] or 'full precision'}), served on {target} "
        f"({info.quantization or 'full precision'})" + (
            ": a quantized target's states differ from its original's, so accept lengths measured here are those "
            "of a drafter trained on another model's states" if trained["target_quantization"] != info.quantization
            else ": another config.json than the one the features came from"))
    return {"trained_on": trained, "served_on": served, "same_target": same, "note": note}
