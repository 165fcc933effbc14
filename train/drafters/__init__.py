"""Drafter architectures: the extension point for a new drafter layer.

An architecture is one module here holding its attention (the part that differs), the tensor names and shapes
SGLang's class for it loads, the config keys it adds, and a `DrafterArch` entry; `DRAFTERS` maps the config's
`train.drafter.arch` to it. Training (train/drafter.py), export and import (serve/drafter_dir.py) look the
architecture up here instead of branching on it. To add one: write `train/drafters/NAME.py` with its attention
and `ARCH = DrafterArch(...)`, add it to `DRAFTERS`, and add NAME to `DrafterConfig.arch` (data/config.py).
"""
from __future__ import annotations

from . import llama, mla
from .base import DrafterArch

DRAFTERS: dict[str, DrafterArch] = {a.name: a for a in (llama.ARCH, mla.ARCH)}


def arch_named(name: str) -> DrafterArch:
    if name not in DRAFTERS:
        raise ValueError(f"train.drafter.arch {name!r}: known architectures are {', '.join(DRAFTERS)}")
    return DRAFTERS[name]


def arch_of(config) -> DrafterArch:
    """The architecture a drafter config (ours or a published one) declares by its SGLang class; a config that
    names none (a bare LlamaConfig) is the Llama drafter."""
    declared = (getattr(config, "architectures", None) or [DRAFTERS["llama"].sglang_class])[0]
    for arch in DRAFTERS.values():
        if arch.sglang_class == declared:
            return arch
    raise ValueError(f"architectures {declared!r}: not an EAGLE-3 drafter class Eyrie knows "
                     f"({', '.join(a.sglang_class for a in DRAFTERS.values())})")
