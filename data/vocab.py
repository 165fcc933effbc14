"""The drafter's output vocabulary: the top-N target tokens by frequency over loss-masked positions.

Stored as SGLang expects: `d2t[i]` = target id of draft id i minus i (int64 offsets, so
`target_id = draft_id + d2t[draft_id]`), `t2d` = bool over the target vocab marking the kept tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from .files import load_safetensors


class TokenCounter:
    def __init__(self, target_vocab_size: int):
        self.counts = torch.zeros(target_vocab_size, dtype=torch.int64)

    def add(self, input_ids: Iterable[int], loss_mask: Iterable[int]) -> None:
        ids = torch.as_tensor(list(input_ids), dtype=torch.int64)
        mask = torch.as_tensor(list(loss_mask), dtype=torch.bool)
        ids = ids[mask]
        if len(ids) and int(ids.max()) >= len(self.counts):
            raise ValueError(f"token id {int(ids.max())} >= target vocab size {len(self.counts)}")
        self.counts += torch.bincount(ids, minlength=len(self.counts))


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from per-token counts. Ties break towards the lower token id, so it is deterministic."""
    vocab = len(counts)
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab} (the target vocab size)")
    # Stable sort on descending count keeps ascending id order within equal counts.
    order = torch.sort(-counts, stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """d2t and t2d must describe the same increasing token set."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    target_ids = torch.arange(len(d2t)) + d2t
    if int(t2d.sum()) != len(d2t) or not torch.equal(target_ids, torch.nonzero(t2d).flatten()):
        raise ValueError("d2t and t2d disagree: draft id + d2t must list exactly the t2d tokens in order")


def save_draft_vocab(path: str | Path, counts: torch.Tensor, draft_vocab_size: int) -> dict:
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    masked_total = int(counts.sum())
    coverage = float(counts[t2d].sum()) / max(masked_total, 1)
    save_file({"d2t": d2t, "t2d": t2d, "token_counts": counts.to(torch.int64)}, str(path),
              metadata={"draft_vocab_size": str(draft_vocab_size), "coverage": f"{coverage:.6f}"})
    return {"draft_vocab_size": draft_vocab_size, "target_vocab_size": len(counts),
            "loss_tokens_counted": masked_total, "coverage": coverage}


def load_draft_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_safetensors(path, "the data stage (python -m data)")
    check_draft_vocab(tensors["d2t"], tensors["t2d"])
    return tensors["d2t"], tensors["t2d"]
