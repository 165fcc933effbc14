"""Metrics: sums reduced across ranks, TensorBoard scalars and a JSONL log (rank 0), the progress bar."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from .dflash import BlockResult
from .loader import Batch
from .ttt import TTTResult, accept_length, ttt_unroll


def summed_across_ranks(sums: torch.Tensor) -> torch.Tensor:
    """A copy of `sums` added up over every rank (the statistics' accumulators)."""
    sums = sums.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        sums = sums.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(sums)
        sums = sums.cpu()
    return sums


class BlockStats:
    """Sums of DFlash block results over micro-batches; `reduce()` adds them up across ranks."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        # [correct_k..., counted_k..., loss sum, accepted, blocks, micro-batches, tokens, padded tokens]
        self.sums = torch.zeros(2 * block_size + 6, dtype=torch.float64)

    def add(self, r: BlockResult, tokens: int, padded: int) -> None:
        self.sums += torch.cat([r.correct.double().cpu(), r.counted.double().cpu(), torch.tensor(
            [float(r.loss.detach()), float(r.accepted), float(r.blocks), 1.0, tokens, padded], dtype=torch.float64)])

    def reduce(self) -> dict:
        sums = summed_across_ranks(self.sums)
        k = self.block_size
        loss, accepted, blocks, micro_batches, tokens, padded = (float(x) for x in sums[2 * k:])
        acc = sums[:k] / sums[k:2 * k].clamp(min=1)
        return {"loss": loss / max(micro_batches, 1.0), "accept_length": 1.0 + accepted / max(blocks, 1.0),
                "blocks": blocks, "tokens": tokens, "padding_fraction": 1 - tokens / max(padded, 1.0)} | \
            {f"acc_pos{j}": float(acc[j]) for j in range(1, k)}


class TTTStats:
    """Sums of TTT results over micro-batches; `reduce()` adds them up across ranks."""

    def __init__(self, steps: int, decay: float):
        self.steps, self.decay = steps, decay
        # [loss_j..., correct_j..., counted_j..., alive_j..., chains, micro-batches, tokens, padded tokens]
        self.sums = torch.zeros(4 * steps + 4, dtype=torch.float64)

    def add(self, r: TTTResult, tokens: int, padded: int) -> None:
        self.sums += torch.cat([r.step_loss.double().cpu(), r.correct.double().cpu(), r.counted.double().cpu(),
                                r.alive.double().cpu(),
                                torch.tensor([float(r.chains), 1.0, tokens, padded], dtype=torch.float64)])

    def reduce(self) -> dict:
        sums = summed_across_ranks(self.sums)
        k = self.steps
        chains, micro_batches, tokens, padded = (float(x) for x in sums[4 * k:])
        step_loss = sums[:k] / max(micro_batches, 1.0)  # mean over micro-batches (all ranks)
        acc = sums[k:2 * k] / sums[2 * k:3 * k].clamp(min=1)
        out = {f"loss_step{j}": float(step_loss[j]) for j in range(k)}
        out |= {f"acc_step{j}": float(acc[j]) for j in range(k)}
        out["accept_length"] = accept_length(float(sums[3 * k:4 * k].sum()), chains)
        out["loss"] = float(sum(step_loss[j] * self.decay ** j for j in range(k)))
        out["tokens"] = tokens
        out["padding_fraction"] = 1 - tokens / max(padded, 1.0)
        out["chains"] = chains
        out |= {f"p_accepted_through_step{j}": float(sums[3 * k + j]) / max(chains, 1.0)  # P(drafts 0..j accepted)
                for j in range(k)}
        return out


@torch.no_grad()
def score(model, data, batches: list[list[int]], teacher, steps: int, decay: float, device: torch.device,
          dtype: torch.dtype, visit: Callable[[list[int], Batch, TTTResult], None] | None = None) -> TTTStats:
    """The TTT unroll over some batches without training: eval during training and offline evaluation (which
    `visit`s each batch's per-position results)."""
    stats = TTTStats(steps, decay)
    for indices in batches:
        b = data.collate(indices).to(device, dtype)
        r = ttt_unroll(model, b.input_ids, b.aux_hidden, b.loss_mask, b.lengths, teacher(b.final_hidden), steps,
                       decay)
        stats.add(r, b.tokens, b.padded)
        if visit:
            visit(indices, b, r)
    return stats


class Logger:
    def __init__(self, directory: Path, tensorboard: Path, total_steps: int, start_step: int, enabled: bool):
        self.enabled = enabled
        self.writer = self.bar = self.jsonl = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            directory.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(tensorboard), purge_step=start_step + 1)
            self.jsonl = open(directory / "log.jsonl", "a")
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, scalars: dict, prefix: str) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, step)
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **scalars}) + "\n")
        self.jsonl.flush()

    def progress(self, step: int, postfix: dict) -> None:
        if self.enabled:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=True)

    def message(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.writer.close()
            self.jsonl.close()
