"""What an extraction backend is: the one interface the job loop (extract/job.py) knows.

A backend is built once per rank from a `BackendSpec` and then called per batch:

    capture(input_ids [B, T] int64, attention_mask [B, T] {0,1}, right-padded, on the CPU)
        -> (aux [N, n_aux * H], final [N, H]) on the backend's device, N = attention_mask.sum():
           each row's real tokens, row after row (packed). aux concatenates the outputs of the decoder layers
           `aux_layer_ids` names (id i = output of 0-based layer i, in that order); final is the last hidden
           state after the target's final norm ("post_norm", FINAL_HIDDEN).
    max_forward_tokens: the most tokens (sum of rows) one capture may hold, or None for no limit.

Adding a backend: one module with a class that builds from a `BackendSpec` and implements the protocol, plus an
entry in `extract.BACKENDS` (extract/__init__.py) and in the config's `extract.backend` choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

FINAL_HIDDEN = "post_norm"  # what `final` holds: recorded in the shards, read by the trainer's teacher


@dataclass(frozen=True)
class BackendSpec:
    """What a rank's backend is built from."""
    target_path: str
    aux_layer_ids: list[int]
    dtype: torch.dtype
    device: torch.device
    trust_remote_code: bool = False
    tp_rank: int = 0          # tensor parallelism (backends that support it): this rank within its group
    tp_size: int = 1
    nccl_port: int | None = None


class Backend(Protocol):
    max_forward_tokens: int | None

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...
