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
        """SGLang convention (id i = output of 0-based decoder layer i); default [1, L//2-1, L-4]."""
        ids = list(configured) if configured is not None else \
            [1, self.num_layers // 2 - 1, self.num_layers - 4]
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside 0..{self.num_layers - 1} for {self.path}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids {ids} repeat a layer (small targets need explicit, distinct ids)")
        return ids


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
