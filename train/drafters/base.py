"""What a drafter architecture is (train/drafters/__init__.py has the table)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn
from transformers import LlamaConfig


@dataclass(frozen=True)
class DrafterArch:
    name: str          # train.drafter.arch
    sglang_class: str  # the export's architectures[0]: the SGLang model class that loads it
    model_type: str    # the export's model_type: a transformers config class that parses its keys
    # the attention module over EAGLE-3's 2H-wide input: qkv(x, cos, sin) -> q, k, v with RoPE applied; o_proj; scale
    attention: Callable[[LlamaConfig], nn.Module]
    # {name under midlayer.self_attn.: weight shape} exactly as SGLang's load_weights maps them
    attention_shapes: Callable[[LlamaConfig], dict[str, tuple[int, ...]]]
    # config keys this architecture adds or overrides, from (target text config, drafter shape, hidden, heads)
    config_fields: Callable[[dict, object, int, int], dict] = lambda target, shape, hidden, heads: {}
    # the RoPE dims per head (the rotary embedding is built for these)
    rotary_dim: Callable[[LlamaConfig], int] = lambda config: config.head_dim
    # why SGLang's loader cannot check this export on a CPU, or None
    cpu_check_problem: Callable[[LlamaConfig], str | None] = lambda config: None
    shape_fields: tuple[str, ...] = field(default=())  # DrafterConfig fields only this architecture reads
