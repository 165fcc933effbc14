"""The extraction job: rank slice → backend → shards, resumable, with rank 0 writing the manifest.

The prepared samples are cut into chunks of `extract.samples_per_shard` consecutive samples; chunk c
becomes shard c and belongs to rank c % world_size. A chunk is done when its shard and its record
(`.shard-c.json`, written after the shard is renamed into place) agree and, with `verify_resume`, the
checksum matches. So a killed job re-run redoes exactly the unfinished chunks, and the dataset does not
depend on how many ranks produced it.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import threading
import time
from collections import Counter
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from data.config import EyrieConfig
from data.batching import length_grouped_batches
from data import aux_codec
from data.files import atomic_write_json, file_checksum
from data.layout import write_scalars
from data.shards import ShardDataset, ShardMeta, ShardWriteError, ShardWriter, write_manifest
from data.target import configured_aux_layer_ids, load_target_info

from . import build
from .backend import FINAL_HIDDEN, Backend, BackendSpec
from .sglang import MAX_FORWARD_TOKENS
from .sglang import available as sglang_available


def _record_path(out: Path, chunk: int) -> Path:
    return out / f".shard-{chunk:05d}.json"


def chunk_done(out: Path, chunk: int, config_hash: str, verify: bool) -> dict | None:
    try:
        record = json.loads(_record_path(out, chunk).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    shard = out / record["shard"]["file"]
    if record.get("config_hash") != config_hash or not shard.exists() \
            or shard.stat().st_size != record["shard"]["bytes"]:
        return None
    if verify and file_checksum(shard) != record["shard"]["xxh3_128"]:
        print(f"[extract] {shard}: checksum mismatch, extracting it again", flush=True)
        return None
    return record


class AsyncShardWriter:
    """Writes on a thread so the next forward overlaps the device→host copy and the disk write."""

    def __init__(self, depth: int = 4):
        self.q: queue.Queue = queue.Queue(maxsize=depth)  # bounds host memory held by pending batches
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                write, event = item
                if event is not None:
                    event.synchronize()
                if self.error is None:
                    write()
            except BaseException as e:  # surfaced to the main thread by put()/flush()
                self.error = e
            finally:
                self.q.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, write: Callable[[], None], event) -> None:
        """Run `write` on the thread once `event` (the device→host copies it reads) has completed."""
        self._raise()
        self.q.put((write, event))

    def flush(self) -> None:
        """Wait until everything queued so far is written."""
        self.q.join()
        self._raise()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        self._raise()

    def then(self, other: "AsyncShardWriter", work: Callable[[], None]) -> None:
        """Hand `work` to `other`'s thread once everything queued here so far is written (a shard's seal after
        its rows), so this thread goes on with what comes next."""
        self.put(partial(other.put, work, None), None)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def write_rows(writer: ShardWriter, rows: list, sizes: list[int], finite: list[bool], aux: torch.Tensor,
               final: torch.Tensor) -> None:
    """One batch's samples (states packed row after row) into the shard, leaving out the non-finite ones."""
    if all(finite):
        writer.write_packed([r.sample_id for r in rows], [r.input_ids.numpy() for r in rows],
                            [r.loss_mask.numpy() for r in rows], aux, final)
        return
    start = 0
    for r, n, ok in zip(rows, sizes, finite):
        if ok:
            writer.write(r.sample_id, r.input_ids.numpy(), r.loss_mask.numpy(), aux[start:start + n],
                         final[start:start + n])
        start += n


def extract_chunk(backend: Backend, samples: ShardDataset, lengths, indices: list[int],
                  writer: ShardWriter | None, io: AsyncShardWriter, max_tokens: int, vocab_size: int, skipped: Counter,
                  bar: tqdm) -> None:
    """Forward the chunk's samples in length-grouped batches and queue their rows for `writer` (None: a
    tensor-parallel follower, which runs the forwards with its group and writes nothing)."""
    for batch in length_grouped_batches(lengths, np.asarray(indices), max_tokens, None):
        rows = [samples[i] for i in batch]
        sizes = [int(lengths[i]) for i in batch]
        ids = torch.zeros(len(rows), max(sizes), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(rows):
            ids[b, :sizes[b]] = r.input_ids.long()
            mask[b, :sizes[b]] = 1
        if int(ids.max()) >= vocab_size:
            bad = next(r.sample_id for r in rows if int(r.input_ids.max()) >= vocab_size)
            raise ValueError(f"sample {bad}: token id {int(ids.max())} >= the target's vocab size {vocab_size}: the "
                             "samples were tokenized with another tokenizer than this target's (run the data stage "
                             "again with the target's tokenizer)")
        aux, final = backend.capture(ids, mask)  # packed: [sum(sizes), ...]
        bar.update(sum(sizes))
        if writer is None:
            continue
        finite_tokens = (torch.isfinite(aux).all(-1) & torch.isfinite(final).all(-1)).cpu().numpy()
        finite = np.logical_and.reduceat(finite_tokens, np.cumsum([0, *sizes[:-1]])).tolist()
        if not all(finite):  # a zero count would print as a skip reason
            skipped["non_finite"] += finite.count(False)
        if writer.meta.aux_encoding != "raw":  # on the device: the copy carries the small form
            aux = aux_codec.encode_fp8(aux, len(writer.meta.aux_layer_ids))
        aux_h, final_h = _to_host(aux), _to_host(final)
        event = None
        if aux.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        io.put(partial(write_rows, writer, rows, sizes, finite, aux_h, final_h), event)  # binds this batch's values


def bytes_per_token(meta: ShardMeta) -> int:
    """On-disk bytes per token of a features shard: aux [3H] states in `aux_encoding`, final [H] in `dtype`, id
    and mask."""
    dtype = getattr(torch, meta.dtype)
    aux = aux_codec.row_bytes(meta.aux_encoding, len(meta.aux_layer_ids), meta.hidden_size, dtype)
    return aux + meta.hidden_size * dtype.itemsize + 4 + 1


def check_disk_budget(out: Path, tokens_left: int, per_token: int, announce: bool, margin: float = 1.05) -> None:
    """Print bytes/token x tokens before extraction starts; refuse when the disk under `out` cannot hold it."""
    need, free = tokens_left * per_token, shutil.disk_usage(out).free
    if announce:
        print(f"[extract] disk budget: {tokens_left:,} tokens left x {per_token:,} bytes/token = {need / 1e9:.2f} GB; "
              f"{free / 1e9:.2f} GB free under {out}", flush=True)
    if need * margin > free:
        raise SystemExit(f"[extract] refused: {out} has {free / 1e9:.2f} GB free, the features need "
                         f"{need / 1e9:.2f} GB (+5% margin); point run_dir at a larger disk or extract fewer samples")


def wait_for_all_ranks(rank: int, world: int) -> None:
    """Rank 0 returns once every rank has called this; the others return at once. Through the launcher's
    key-value store, not a process group: the sglang backend's runner owns this process's default group."""
    if world == 1:
        return
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts a store at MASTER_PORT
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timedelta(hours=48))
    key = f"eyrie/extract/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"
    store.add(key, 1)
    while rank == 0 and store.add(key, 0) < world:
        time.sleep(0.2)  # a store read is cheap; a 1 s poll kept rank 0 waiting half a second on average


def remove_stale_temporaries(out: Path, names: set[str]) -> None:
    """What a killed run left half-written for these outputs (`.NAME.tmp-PID`, from the writer's temporary name
    or atomic_write_json). Each output has one writer, this rank, so any such file is a dead process's."""
    for tmp in out.glob(".*.tmp-*"):
        if tmp.name[1:].rsplit(".tmp-", 1)[0] in names:
            tmp.unlink(missing_ok=True)


def tp_layout(rank: int, world: int, local_world: int, tp: int) -> tuple[int, int, int]:
    """(data-parallel group, number of groups, rank within the group) for groups of `tp` consecutive ranks.
    A group is one copy of the target: its ranks run every forward together; its rank 0 writes the shards."""
    if world % tp or local_world % tp:
        raise ValueError(f"extract.tp_size {tp} must divide the ranks per node ({local_world}) and in all ({world}): "
                         "a tensor-parallel group lives on one node")
    return rank // tp, world // tp, rank % tp


def resolve_device(cfg: EyrieConfig, local_rank: int) -> torch.device:
    if cfg.extract.device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.extract.device)


def resolve_backend(cfg: EyrieConfig, device: torch.device) -> tuple[str, str]:
    """(backend, dtype) this run uses; `auto` is sglang where a GPU and a tested sglang are present."""
    ec = cfg.extract
    backend = ec.backend if ec.backend != "auto" else "sglang" if sglang_available() else "hf"
    if backend == "hf":
        if ec.tp_size > 1:
            raise ValueError("extract.tp_size > 1 is for the sglang backend; the hf backend runs one target copy per "
                             "rank (data parallel)")
        return backend, ec.dtype if ec.dtype != "auto" else "bfloat16" if device.type == "cuda" else "float32"
    if ec.dtype == "float32":
        raise ValueError("extract.backend sglang runs bfloat16 (SGLang's kernels have no float32 RMSNorm); "
                         "set extract.dtype auto or bfloat16, or use extract.backend hf")
    if cfg.data.max_length > MAX_FORWARD_TOKENS:
        raise ValueError(f"extract.backend sglang: data.max_length {cfg.data.max_length} is above the "
                         f"{MAX_FORWARD_TOKENS} tokens it runs in one forward; use extract.backend hf")
    return backend, "bfloat16"


def run(cfg: EyrieConfig) -> dict | None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ec = cfg.extract
    device = resolve_device(cfg, local_rank)
    backend_name, dtype_name = resolve_backend(cfg, device)
    samples = ShardDataset(cfg.layout.samples)
    info = load_target_info(cfg.target.path)
    prepared_for = samples.meta.get("target_config_hash")
    if prepared_for and prepared_for != info.config_hash:  # tokenized with another target's tokenizer, probably
        raise ValueError(f"{cfg.layout.samples}: the samples were prepared for target {samples.meta.get('target_id')} "
                         f"(config hash {prepared_for}), not {cfg.target.path} ({info.config_hash}): run the data "
                         "stage again with this target")
    layer_ids = configured_aux_layer_ids(info, cfg)
    meta = ShardMeta(kind="features", target_id=cfg.target.path, target_config_hash=info.config_hash,
                     target_quantization=info.quantization, aux_layer_ids=layer_ids, hidden_size=info.hidden_size,
                     dtype=dtype_name, aux_encoding=ec.aux_encoding, final_hidden=FINAL_HIDDEN,
                     extra={"backend": backend_name})
    # What the shards' content depends on; a completed shard from another config is extracted again.
    config_hash = f"{cfg.section_hash('target', 'data')}-{backend_name}-{dtype_name}-{ec.samples_per_shard}" + \
        f"-{'.'.join(map(str, layer_ids))}" + \
        ("" if ec.aux_encoding == "raw" else f"-{ec.aux_encoding}")
    out = cfg.layout.features
    out.mkdir(parents=True, exist_ok=True)

    S = ec.samples_per_shard
    n_chunks = -(-len(samples) // S)
    lengths = samples.lengths()

    def tokens_of(chunks: list[int]) -> int:
        return int(sum(lengths[c * S:(c + 1) * S].sum() for c in chunks))

    tp = ec.tp_size if backend_name == "sglang" else 1
    group, groups, tp_rank = tp_layout(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), tp)
    writes = tp_rank == 0  # one rank of each tensor-parallel group writes its shards
    mine = [c for c in range(n_chunks) if c % groups == group]
    left = [c for c in range(n_chunks) if chunk_done(out, c, config_hash, verify=False) is None]
    check_disk_budget(out, tokens_of(left), bytes_per_token(meta), announce=rank == 0)
    todo = [c for c in mine if chunk_done(out, c, config_hash, ec.verify_resume) is None]
    # this rank's outputs: its stats, rank 0's manifest, the shards and records of the chunks it writes
    own = {f".rank-{rank}.json"} | ({"manifest.json"} if rank == 0 else set())
    if writes:
        own |= {name for c in todo for name in (f"shard-{c:05d}.arrow", _record_path(out, c).name)}
    remove_stale_temporaries(out, own)
    print(f"[extract] rank {rank}/{world}: {len(mine)} shards, {len(mine) - len(todo)} already complete, "
          f"{backend_name} backend, device {device}, {dtype_name}, aux layers {layer_ids}"
          + (f", tensor-parallel rank {tp_rank}/{tp} of group {group}" if tp > 1 else ""), flush=True)
    stats = {"rank": rank, "samples": 0, "tokens": 0, "bytes": 0, "seconds": 0.0, "skipped": Counter()}
    if todo:
        # a tensor-parallel group's ranks meet on a port of its own next to torchrun's
        port = int(os.environ.get("MASTER_PORT", 29500)) + 1 + group if tp > 1 else None
        backend = build(backend_name, BackendSpec(cfg.target.path, layer_ids, getattr(torch, dtype_name), device,
                                                  cfg.target.trust_remote_code, tp_rank, tp, port))
        max_tokens = min(ec.max_batch_tokens, backend.max_forward_tokens or ec.max_batch_tokens)
        bar = tqdm(total=tokens_of(todo), desc=f"extract rank {rank}", unit="tok", unit_scale=True, position=group,
                   disable=not writes)
        io = AsyncShardWriter()
        # A shard's seal (its fsync: the disk's speed) on a thread of its own, while the next
        # shard's rows go into the page cache: one thread doing both wrote 1.5x slower (tests/benchmarks/RESULTS.md).
        sealer = AsyncShardWriter(depth=1)
        unsealed: dict[int, ShardWriter] = {}

        def seal(c: int, writer: ShardWriter, skipped: Counter) -> None:
            """On the sealing thread, after the shard's rows: fsync, rename, then the shard's record (the checksum was
            hashed as the rows were written)."""
            shard = writer.close()
            del unsealed[c]
            atomic_write_json(_record_path(out, c), {"shard": shard, "skipped": dict(skipped), "rank": rank,
                                                     "config_hash": config_hash})
            stats["samples"] += shard["rows"]
            stats["tokens"] += shard["tokens"]
            stats["bytes"] += shard["bytes"]
            stats["skipped"] += skipped

        start = time.time()
        try:
            for c in todo:
                skipped: Counter = Counter()
                writer = ShardWriter(out / f"shard-{c:05d}.arrow", meta) if writes else None
                if writer is not None:
                    unsealed[c] = writer
                extract_chunk(backend, samples, lengths, list(range(c * S, min((c + 1) * S, len(samples)))), writer,
                              io, max_tokens, info.vocab_size, skipped, bar)
                if writer is not None:  # handed to the sealer once the writer thread has written its rows
                    io.then(sealer, partial(seal, c, writer, skipped))
            io.close()
            sealer.close()
        except BaseException as e:
            for thread in (io, sealer):  # shards already complete are sealed; both threads are done after this
                with contextlib.suppress(BaseException):
                    thread.close()
            for writer in unsealed.values():
                writer.abort()
            if isinstance(e, (ShardWriteError, OSError)):
                left = [c for c in todo if chunk_done(out, c, config_hash, verify=False) is None]
                need = tokens_of(left) * bytes_per_token(meta)
                raise SystemExit(f"[extract] rank {rank}: {e}. The {len(left)} shards left need {need:,} bytes "
                                 f"({need / 1e9:.2f} GB), {shutil.disk_usage(out).free:,} bytes are free under {out}. "
                                 "Completed shards are kept: free space and run the same command again.") from e
            raise
        bar.close()
        stats["seconds"] = round(time.time() - start, 2)
    stats["tokens_per_s"] = round(stats["tokens"] / stats["seconds"], 1) if stats["seconds"] else None
    stats["skipped"] = dict(stats["skipped"])
    print(f"[extract] rank {rank}: {json.dumps(stats)}", flush=True)
    atomic_write_json(out / f".rank-{rank}.json", stats)
    wait_for_all_ranks(rank, world)
    if rank != 0:
        return None
    return _merge(cfg, out, meta, n_chunks, range(0, world, tp), config_hash)


def _merge(cfg: EyrieConfig, out: Path, meta: ShardMeta, n_chunks: int, writing_ranks: range, config_hash: str) -> dict:
    records = []
    for c in range(n_chunks):
        record = chunk_done(out, c, config_hash, verify=False)
        if record is None:
            raise RuntimeError(f"{out}: shard {c} is missing after all ranks finished")
        records.append(record)
    skipped: Counter = Counter()
    for r in records:
        skipped.update(r["skipped"])
    ranks = [json.loads((out / f".rank-{r}.json").read_text()) for r in writing_ranks]
    manifest = write_manifest(out, meta, [r["shard"] for r in records], skipped=dict(skipped), ranks=ranks,
                              config=cfg.model_dump(mode="json"), config_hash=config_hash)
    t = manifest["totals"]
    write_scalars(cfg.run_dir, "extract", {0: {
        "samples": t["rows"], "tokens": t["tokens"], "skipped": sum(skipped.values()),
        "bytes_per_token": t["bytes_per_token"], **{f"tokens_per_s_rank{r['rank']}": r["tokens_per_s"] or 0
                                                    for r in ranks}}})
    print(f"[extract] {t['rows']} samples, {t['tokens']} tokens, {t['bytes'] / 1e6:.1f} MB, "
          f"{t['bytes_per_token']:.0f} bytes/token, skipped {dict(skipped) or 'none'} → {out}", flush=True)
    return manifest
