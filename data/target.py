"""The target, in one place: what every stage needs to know about it from its config.json without loading it
(architecture, layers, hidden size, vocab, dtype, aux layer ids as Eyrie and as SGLang read them), the few
tensors read straight from its safetensors (embedding, LM head, final norm) and the transformers model itself."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import aux_count_problem
from .files import read_json, safetensors_reader


@dataclass(frozen=True)
class TargetInfo:
    path: str
    config_hash: str       # sha256 of config.json's canonical JSON: shards record it, readers compare it
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    text_config: dict      # the language model's config (a multimodal wrapper's `text_config`)
    dtype: str = "float32"  # the declared weight dtype; SGLang's `--dtype auto` reads it (absent = float32)
    quantization: str = ""  # quantized weights, described (quantization_label); "" = all weights in `dtype`

    @property
    def is_mla(self) -> bool:
        """DeepSeek-style latent attention (DeepSeek-V3, Kimi-K2.5): SGLang serves it with MLA kernels."""
        return "kv_lora_rank" in self.text_config

    def aux_layer_ids(self, configured: list[int] | None = None, family: str = "eagle3",
                      dflash_layers: int = 1) -> list[int]:
        """SGLang convention (id i = output of 0-based decoder layer i); default [1, L//2-1, L-4] for EAGLE-3,
        SGLang's DFlash default for `dflash_layers` draft layers. Ids SGLang would serve on other layers than the
        drafter trains on are refused here, before any extraction."""
        default = dflash_default_layer_ids(self.num_layers, dflash_layers) if family == "dflash" else \
            [1, self.num_layers // 2 - 1, self.num_layers - 4]
        ids = list(configured) if configured is not None else default
        problem = aux_count_problem(ids, family)
        if problem:
            raise ValueError(f"target.aux_layer_ids: {problem}")
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target.aux_layer_ids: {bad} outside 0..{self.num_layers - 1} for {self.path} "
                             f"({self.num_layers} layers)" + ("" if configured else "; the default "
                             "[1, L//2-1, L-4] does not fit a target this small: set target.aux_layer_ids"))
        if len(set(ids)) != len(ids):
            raise ValueError(f"target.aux_layer_ids: {ids} repeat a layer" + ("" if configured else
                             f" (the default for a {self.num_layers}-layer target): set distinct ids"))
        problem = sglang_serving_problem(self.architecture, self.num_layers, ids, family)
        if problem:
            raise ValueError(f"target.aux_layer_ids: {ids} for {self.path}: {problem}")
        return ids

    def check_draft_vocab_size(self, size: int) -> None:
        if size > self.vocab_size:
            raise ValueError(f"data.draft_vocab_size: {size} is larger than the target's vocabulary "
                             f"({self.vocab_size}); set it to at most {self.vocab_size}")

    def drafter_layer_ids(self, written: list[int]) -> list[int]:
        """The layer outputs SGLang feeds a drafter whose config names `written` (an imported drafter's ids
        mean what SGLang does with them on this target), checked as aux_layer_ids checks."""
        return self.aux_layer_ids(sglang_captured_outputs(self.architecture, written))


# SGLang's DeepseekV2ForCausalLM and the models built on it (sglang/srt/models/deepseek_v2.py,
# kimi_k25.py, mistral_large_3.py, glm4_moe.py, glm4_moe_lite.py; 0.5.14 to 0.5.23 at least) add 1 to
# eagle_aux_hidden_state_layer_ids only when the first id is 1, and otherwise capture at layer `id` itself
# (the input of layer id = the output of layer id - 1; id 0 = the embedding). So on these targets a published
# drafter's [2, 30, 58] means the outputs of layers [1, 29, 57], and [0, 1, 2] is served one layer early.
SGLANG_FIRST_ID_ONE_ARCHITECTURES = {
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "MistralLarge3ForCausalLM", "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM"}


def sglang_captured_outputs(architecture: str, written: list[int]) -> list[int]:
    """Which decoder layers' outputs SGLang captures for a drafter config naming `written` (-1: the embedding)."""
    if architecture in SGLANG_FIRST_ID_ONE_ARCHITECTURES and written and written[0] != 1:
        return [i - 1 for i in written]
    return list(written)


def dflash_default_layer_ids(num_layers: int, draft_layers: int) -> list[int]:
    """SGLang's default DFlash target layers (dflash_utils.build_target_layer_ids): the middle layer for one draft
    layer, else `draft_layers` ids spread evenly over 1..L-3."""
    if draft_layers == 1:
        return [num_layers // 2]
    span = num_layers - 3 - 1
    return [int(round(1 + i * span / (draft_layers - 1))) for i in range(draft_layers)]


def sglang_serving_problem(architecture: str, num_layers: int, ids: list[int], family: str = "eagle3") -> str | None:
    """Why SGLang would feed a drafter trained on layer outputs `ids` other states, or None. DFlash's capture
    hooks add 1 to every id on every architecture (set_dflash_layers_to_capture): only the last layer is out."""
    if num_layers - 1 in ids:
        # every SGLang model captures a layer's output at the next layer's input, inside the layer loop
        return (f"SGLang captures layer i's output at the input of layer i + 1, so the last layer's output "
                f"(id {num_layers - 1}) never reaches a drafter; use ids up to {num_layers - 2}")
    served = ids if family == "dflash" else sglang_captured_outputs(architecture, ids)
    if served != ids:
        return (f"SGLang's {architecture} reads ids whose first is not 1 as layer inputs "
                f"(set_eagle3_layers_to_capture), so it would serve this drafter the outputs of layers {served} "
                f"(-1 = the embedding); ids starting with 1 mean the same to SGLang and to Eyrie")
    return None


def configured_aux_layer_ids(info: TargetInfo, cfg) -> list[int]:
    """The aux layer ids a run's config gives (an EyrieConfig: target.aux_layer_ids, the drafter family's default)."""
    return info.aux_layer_ids(cfg.target.aux_layer_ids, cfg.train.drafter.family, cfg.train.dflash.num_layers)


def declared_dtype(config: dict) -> str | None:
    """The weight dtype a config.json declares: `dtype` (transformers 5) or the older `torch_dtype`."""
    return config.get("dtype") or config.get("torch_dtype")


def stop_token_ids(path: str | Path) -> list[int]:
    """The token ids the target stops generating on: its generation_config's eos_token_id (one or a list; GLM-4
    lists its <|user|> and <|observation|> tags there), else its config's."""
    path = Path(path)
    for name in ("generation_config.json", "config.json"):
        eos = (read_json(path / name) or {}).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(i) for i in eos]
    return []


def load_target_info(path: str | Path) -> TargetInfo:
    cfg_path = Path(path) / "config.json"
    config = read_json(cfg_path)
    if config is None:
        raise FileNotFoundError(f"{cfg_path}: the target directory has no config.json")
    text = config.get("text_config") or config
    try:
        return TargetInfo(
            path=str(path),
            config_hash=hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
            architecture=(config.get("architectures") or [config.get("model_type", "?")])[0],
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text.get("max_position_embeddings", 0)),
            text_config=text,
            dtype=str(declared_dtype(text) or declared_dtype(config) or "float32"),
            quantization=declared_quantization(config),
        )
    except KeyError as e:
        raise ValueError(f"{cfg_path}: missing {e.args[0]!r} (looked in text_config too)") from None


class AuxCapture:
    """Forward hooks on the decoder layers named by SGLang-convention ids (id i = output of layer i); `take()`
    returns the captured outputs concatenated [..., n_aux * H]. Extraction and the reference decoder share it."""

    def __init__(self, layers, aux_layer_ids: list[int]):
        self.aux_layer_ids = aux_layer_ids
        self._captured: dict[int, torch.Tensor] = {}
        for i in aux_layer_ids:
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self) -> torch.Tensor:
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)
        self._captured.clear()
        return aux


def declared_quantization(config: dict) -> str:
    """quantization_label of a config.json's `quantization_config` (or its text_config's)."""
    return quantization_label(config.get("quantization_config")
                              or (config.get("text_config") or {}).get("quantization_config"))


def quantization_label(qc: dict | None) -> str:
    """What a config's `quantization_config` quantizes, in words ("" for none): for compressed-tensors, each
    group's weight bits, type and group size and the format, e.g. "compressed-tensors pack-quantized: W4A16 int
    group 32 on Linear (ignoring lm_head, re:.*self_attn.*)"; other methods by name."""
    if not qc:
        return ""
    method = qc.get("quant_method", "?")
    if method != "compressed-tensors":
        return f"{method} ({', '.join(f'{k}={v}' for k, v in sorted(qc.items()) if k != 'quant_method')})"
    groups = []
    for group in (qc.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations")
        bits = f"W{w.get('num_bits', '?')}A{a.get('num_bits', '?') if a else 16}"
        size = f" group {w['group_size']}" if w.get("group_size") else ""
        groups.append(f"{bits} {w.get('type', '?')}{size} on {', '.join(group.get('targets') or ['?'])}")
    ignored = f" (ignoring {', '.join(qc['ignore'])})" if qc.get("ignore") else ""
    return f"compressed-tensors {qc.get('format', '?')}: {'; '.join(groups)}{ignored}"


def load_causal_lm(path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu",
                   trust_remote_code: bool = False):
    """The target as a transformers model, in eval mode on `device` (extraction, local regeneration, the
    reference decoder). A compressed-tensors target is decompressed on load (its quantized weights become their
    dequantized values in `dtype`: what the quantized model computes, up to kernel rounding)."""
    from transformers import AutoModelForCausalLM
    quantization = declared_quantization(read_json(Path(path) / "config.json") or {})
    if quantization.startswith("compressed-tensors"):
        import importlib.util
        if importlib.util.find_spec("compressed_tensors") is None:
            raise RuntimeError(f"{path} is quantized ({quantization}): transformers needs the compressed-tensors "
                               "package to decompress it (pip install compressed-tensors), or extract with "
                               "extract.backend: sglang, which serves it with its own INT4 kernels")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as e:
        if not quantization:
            raise
        raise RuntimeError(f"{path} is quantized ({quantization}) and transformers could not load it "
                           f"({type(e).__name__}: {e}); extract with extract.backend: sglang, which serves it "
                           "with its own kernels") from e
    return model.to(device).eval()


# Tensor name patterns; `(?:.*\.)?` admits wrapper prefixes but not a decoder layer's own copies
# (DeepSeek-V3's MTP layers carry `model.layers.61.embed_tokens.weight`).
PATTERNS = {
    "embed": re.compile(r"^(?:.*\.)?(?:model|language_model)\.embed_tokens\.weight$"),
    "lm_head": re.compile(r"^(?:.*\.)?lm_head\.weight$"),
    "norm": re.compile(r"^(?:.*\.)?(?:model|language_model)\.norm\.weight$"),
}


def _weight_files(target: Path) -> dict[str, Path]:
    index = target / "model.safetensors.index.json"
    if index.exists():
        return {k: target / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target}: no safetensors weights (the trainer reads the target's LM head and "
                                "embedding from them)")
    names = {}
    for f in files:
        with safetensors_reader(f, "the target's publisher or conversion (Eyrie only reads it)") as fh:
            names.update({k: f for k in fh.keys()})
    return names


def load_embedding_and_head(target: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output head (its lm_head; with tied embeddings the embedding itself)."""
    tensors = load_target_tensors(target, ["embed", "lm_head"])
    if "embed" not in tensors:
        raise ValueError(f"{target}: no embed_tokens.weight in the target's checkpoint")
    return tensors["embed"], tensors.get("lm_head", tensors["embed"])


def load_target_tensors(target: str | Path, wanted: list[str]) -> dict[str, torch.Tensor]:
    """{'embed' | 'lm_head' | 'norm': tensor} for the wanted ones present in the target's checkpoint."""
    target = Path(target)
    files = _weight_files(target)
    out = {}
    for what in wanted:
        hits = [k for k in files if PATTERNS[what].match(k) and ".layers." not in k and "vision" not in k]
        if len(hits) > 1:
            raise ValueError(f"{target}: several tensors could be the {what}: {hits}")
        if not hits:  # a quantized copy (weight_packed / weight_scale) is no full-precision tensor to read
            quantized = [k for k in files if PATTERNS[what].match(k.rsplit(".", 1)[0] + ".weight")
                         and not k.endswith(".weight") and ".layers." not in k]
            if quantized:
                raise ValueError(f"{target}: the {what} is quantized ({', '.join(sorted(quantized))}); the teacher "
                                 f"and the drafter read it in full precision: keep it out of the quantized "
                                 f"modules (compressed-tensors `ignore`)")
        if hits:
            with safetensors_reader(files[hits[0]], "the target's publisher or conversion (Eyrie only reads it)") \
                    as fh:
                out[what] = fh.get_tensor(hits[0])
    return out
