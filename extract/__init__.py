"""The extract stage: target hidden states into Arrow shards (`torchrun -m extract`, extract/job.py).

Its backends, by `extract.backend` name; each implements extract/backend.py's protocol and is imported only when
used, so the hf path never imports sglang."""
from __future__ import annotations

from typing import Callable

from .backend import Backend, BackendSpec


def _hf(spec: BackendSpec) -> Backend:
    from .hf import HFBackend
    return HFBackend(spec)


def _sglang(spec: BackendSpec) -> Backend:
    from .sglang import SGLangBackend
    return SGLangBackend(spec)


BACKENDS: dict[str, Callable[[BackendSpec], Backend]] = {"hf": _hf, "sglang": _sglang}


def build(name: str, spec: BackendSpec) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"extract.backend {name!r}: known backends are {', '.join(BACKENDS)}")
    return BACKENDS[name](spec)
