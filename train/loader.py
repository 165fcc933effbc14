"""Batches over the feature shards: the data stage's held-out split (data/split.py), length-grouped token-budget
batches, a seeded order that depends only on (seed, epoch) so a resumed run sees the same batches, and a prefetch
thread.

Every rank builds the same plan and takes every world-th batch (the tail that does not divide evenly is
dropped), so ranks step in lockstep. The position in the plan is (epoch, micro-batch index): the whole
data state a checkpoint needs.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from data.batching import length_grouped_batches
from data.shards import ShardDataset


@dataclass
class Batch:
    input_ids: torch.Tensor    # [B, T] int64, right-padded
    loss_mask: torch.Tensor    # [B, T] bool
    aux_hidden: torch.Tensor   # [B, T, n_aux * H]
    final_hidden: torch.Tensor  # [B, T, H]
    lengths: torch.Tensor      # [B]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device, dtype: torch.dtype) -> "Batch":
        nb = device.type == "cuda"
        return Batch(self.input_ids.to(device, non_blocking=nb), self.loss_mask.to(device, non_blocking=nb),
                     self.aux_hidden.to(device, non_blocking=nb).to(dtype),
                     self.final_hidden.to(device, non_blocking=nb).to(dtype), self.lengths.to(device))


class FeatureData:
    def __init__(self, directory, heldout_ids: set[str], max_tokens: int, seed: int, rank: int, world: int):
        """`heldout_ids`: the samples the data stage held out (RUN_DIR/data/split.json), never trained on."""
        self.ds = ShardDataset(directory)
        self.meta = self.ds.meta
        self.lengths = self.ds.lengths()
        self.sample_ids = [self.ds[i].sample_id for i in range(len(self.ds))]
        is_eval = np.array([s in heldout_ids for s in self.sample_ids], dtype=bool)
        self.train_idx, self.eval_idx = np.nonzero(~is_eval)[0], np.nonzero(is_eval)[0]
        self.max_tokens, self.seed, self.rank, self.world = max_tokens, seed, rank, world
        if self.micro_batches_per_epoch() == 0:
            raise ValueError(f"{directory}: {len(self.train_idx)} training samples make fewer batches than the "
                             f"{world} ranks (lower train.max_batch_tokens or add data)")

    def _rank_slice(self, batches: list[list[int]]) -> list[list[int]]:
        usable = len(batches) - len(batches) % self.world
        return batches[self.rank:usable:self.world]

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        return self._rank_slice(length_grouped_batches(self.lengths, self.train_idx, self.max_tokens, rng))

    def eval_plan(self) -> list[list[int]]:
        batches = length_grouped_batches(self.lengths, self.eval_idx, self.max_tokens, None)
        if len(batches) < self.world:  # a small eval set: one sample per batch so every rank gets some
            batches = [[i] for b in batches for i in b]
        return self._rank_slice(batches)

    def micro_batches_per_epoch(self) -> int:
        return len(self.epoch_plan(0))

    def padding_fraction(self, plan: list[list[int]]) -> float:
        real = sum(int(self.lengths[b].sum()) for b in plan)
        padded = sum(len(b) * int(self.lengths[b].max()) for b in plan)
        return 1 - real / max(padded, 1)

    def collate(self, indices: list[int], pin: bool = False) -> Batch:
        """One right-padded batch. With `pin` the rows are copied straight into page-locked buffers (one pass
        over the bytes: a llama3-8b sample of 2,048 tokens is 67 MB), so the host→device copy can overlap the step."""
        samples = [self.ds[i] for i in indices]
        T = max(len(s.input_ids) for s in samples)
        B = len(samples)
        aux_w, fin_w = samples[0].aux_hidden.shape[1], samples[0].final_hidden.shape[1]
        dtype = samples[0].aux_hidden.dtype
        batch = Batch(*(torch.empty(shape, dtype=dt, pin_memory=pin) for shape, dt in (
            ((B, T), torch.int64), ((B, T), torch.bool), ((B, T, aux_w), dtype), ((B, T, fin_w), dtype),
            ((B,), torch.int64))))
        for r, s in enumerate(samples):
            n = len(s.input_ids)
            batch.lengths[r] = n
            for dst, src in ((batch.input_ids, s.input_ids), (batch.loss_mask, s.loss_mask.bool()),
                             (batch.aux_hidden, s.aux_hidden), (batch.final_hidden, s.final_hidden)):
                dst[r, :n] = src
                dst[r, n:] = 0  # the padding
        return batch

    def stream(self, epoch: int, micro: int, epochs: int, pin: bool = False
               ) -> Iterator[tuple[int, int, Batch, float]]:
        """(epoch, micro index, batch, seconds the consumer waited for it) from (epoch, micro) on; a thread
        collates ahead so the step rarely waits."""
        q: queue.Queue = queue.Queue(maxsize=4)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def produce():
            try:
                for e in range(epoch, epochs):
                    plan = self.epoch_plan(e)
                    for m in range(micro if e == epoch else 0, len(plan)):
                        if not put((e, m, self.collate(plan[m], pin))):
                            return
                put(None)
            except BaseException as err:  # surfaces in the consumer instead of hanging it
                put(err)

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                waited = time.perf_counter() - t0
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield (*item, waited)
        finally:  # the consumer stopped early (max_steps) or failed: end the thread before the process exits
            stop.set()
            thread.join()
