"""What every stage needs to know about the target from its config.json, without loading the model."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


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

    def aux_layer_ids(self, configured: list[int] | None = None) -> list[int]:
        """SGLang convention (id i = output of 0-based decoder layer i); default [1, L//2-1, L-4]. Ids SGLang
        would serve on other layers than the drafter trains on are refused here, before any extraction."""
        ids = list(configured) if configured is not None else \
            [1, self.num_layers // 2 - 1, self.num_layers - 4]
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside 0..{self.num_layers - 1} for {self.path}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids {ids} repeat a layer (small targets need explicit, distinct ids)")
        problem = sglang_serving_problem(self.architecture, self.num_layers, ids)
        if problem:
            raise ValueError(f"aux layer ids {ids} for {self.path}: {problem}")
        return ids

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


def sglang_serving_problem(architecture: str, num_layers: int, ids: list[int]) -> str | None:
    """Why SGLang would feed a drafter trained on layer outputs `ids` other states, or None."""
    if num_layers - 1 in ids:
        # every SGLang model captures a layer's output at the next layer's input, inside the layer loop
        return (f"SGLang captures layer i's output at the input of layer i + 1, so the last layer's output "
                f"(id {num_layers - 1}) never reaches a drafter; use ids up to {num_layers - 2}")
    served = sglang_captured_outputs(architecture, ids)
    if served != ids:
        return (f"SGLang's {architecture} reads ids whose first is not 1 as layer inputs "
                f"(set_eagle3_layers_to_capture), so it would serve this drafter the outputs of layers {served} "
                f"(-1 = the embedding); ids starting with 1 mean the same to SGLang and to Eyrie")
    return None


def declared_dtype(config: dict) -> str | None:
    """The weight dtype a config.json declares: `dtype` (transformers 5) or the older `torch_dtype`."""
    return config.get("dtype") or config.get("torch_dtype")


def load_target_info(path: str | Path) -> TargetInfo:
    cfg_path = Path(path) / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_path}: the target directory has no config.json") from None
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
        )
    except KeyError as e:
        raise ValueError(f"{cfg_path}: missing {e.args[0]!r} (looked in text_config too)") from None
