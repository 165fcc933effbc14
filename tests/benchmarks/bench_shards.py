"""Shard write/read throughput and bytes per token (not collected by pytest).

    python tests/benchmarks/bench_shards.py [--hidden 4096] [--tokens 262144] [--dir /tmp/eyrie-bench]
                                           [--extract-writer-shards 4 --batches-per-shard 8 --repeat 3
                                           --sealers own,writer --writeback-mb 256,0]
Reports MB/s for writing (incl. fsync + checksum), cold-ish and warm reads that touch every tensor, and
bytes/token. Reads are O(1) memory-mapped views, so "read" means summing every value to force the pages in.

--extract-writer-shards N: the extraction job's writing alone (extract/job.py's threads, no forwards): N shards of
batches of 4 x --seq tokens written with write_packed on the writer thread, each shard sealed (fsync, rename)
either on its own thread (the job's way) or on the writer thread (the job before), alternating (--sealers), for
each --writeback-mb value (data.files.WRITEBACK_BYTES: how much is written before its disk write is started).
Reports GB/s and the tail: from the last row written to the last shard sealed.
"""
import argparse
import os
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

import data.files
from data.shards import ShardDataset, ShardMeta, ShardWriter, write_manifest
from extract.job import AsyncShardWriter


def extract_writer_gb_per_s(d: Path, meta: ShardMeta, seq: int, shards: int, batches: int,
                            own_sealer: bool) -> tuple[float, float]:
    rows = 4
    aux, fin = torch.randn(rows * seq, 3 * meta.hidden_size).bfloat16(), torch.randn(rows * seq, meta.hidden_size).bfloat16()
    ids, masks = [np.arange(seq, dtype=np.int32)] * rows, [np.ones(seq, dtype=np.uint8)] * rows
    d.mkdir(parents=True)
    os.sync()
    io, sealer = AsyncShardWriter(), AsyncShardWriter(depth=1)
    t0 = time.perf_counter()
    for c in range(shards):
        w = ShardWriter(d / f"shard-{c:05d}.arrow", meta)
        for b in range(batches):
            io.put(partial(w.write_packed, [f"{c}-{b}-{i}" for i in range(rows)], ids, masks, aux, fin), None)
        if own_sealer:
            io.then(sealer, w.close)
        else:
            io.put(w.close, None)
    io.flush()  # the rows are written, the last seal is queued
    rows_done = time.perf_counter()
    io.close()
    sealer.close()
    end = time.perf_counter()
    nbytes = sum(f.stat().st_size for f in d.iterdir())
    shutil.rmtree(d)
    return nbytes / (end - t0) / 1e9, end - rows_done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1 << 18)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dir", default="/tmp/eyrie-bench-shards")
    p.add_argument("--extract-writer-shards", type=int, default=0)
    p.add_argument("--batches-per-shard", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sealers", default="own,writer", help="own: a thread of its own (the job's way); writer")
    p.add_argument("--writeback-mb", default=str(data.files.WRITEBACK_BYTES >> 20))
    a = p.parse_args()
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    meta = ShardMeta(kind="features", target_id="bench", aux_layer_ids=[1, 2, 3], hidden_size=a.hidden,
                     dtype="bfloat16", final_hidden="post_norm")
    if a.extract_writer_shards:
        extract_writer_gb_per_s(d, meta, a.seq, 1, a.batches_per_shard, True)  # untimed: the first run was 3x slower
        for _ in range(a.repeat):
            for mb in (int(x) for x in a.writeback_mb.split(",")):
                data.files.WRITEBACK_BYTES = mb << 20
                for sealer in a.sealers.split(","):
                    rate, tail = extract_writer_gb_per_s(d, meta, a.seq, a.extract_writer_shards, a.batches_per_shard,
                                                         own_sealer=sealer == "own")
                    print(f"extraction writer, writeback every {mb} MB, seal on "
                          f"{'its own thread' if sealer == 'own' else 'the writer thread'}: {rate:.2f} GB/s, "
                          f"tail {tail:.2f} s", flush=True)
        return
    d.mkdir(parents=True)
    n = a.tokens // a.seq
    aux = torch.randn(a.seq, 3 * a.hidden).bfloat16()
    fin = torch.randn(a.seq, a.hidden).bfloat16()
    ids = list(range(a.seq))
    t0 = time.perf_counter()
    with ShardWriter(d / "shard-00000.arrow", meta) as w:
        for i in range(n):
            w.write(str(i), ids, [1] * a.seq, aux, fin)
        info = w.close()
    t_write = time.perf_counter() - t0
    write_manifest(d, meta, [info])
    mb = info["bytes"] / 1e6
    t0 = time.perf_counter()
    ds = ShardDataset(d)
    t_open = time.perf_counter() - t0
    for label in ("read (first pass)", "read (warm)"):
        t0 = time.perf_counter()
        total = 0.0
        for i in range(len(ds)):
            s = ds[i]
            total += float(s.aux_hidden.float().sum()) + float(s.final_hidden.float().sum())
        t = time.perf_counter() - t0
        print(f"{label}: {mb / t:.0f} MB/s ({len(ds)} samples, {t:.2f} s, incl. bf16->fp32 sum)")
    t0 = time.perf_counter()
    for i in range(len(ds)):
        ds[i]
    t_idx = (time.perf_counter() - t0) / len(ds)
    print(f"hidden {a.hidden}, {info['tokens']} tokens, {mb:.0f} MB: write {mb / t_write:.0f} MB/s "
          f"(fsync + xxh3 checksum included), open {t_open * 1e3:.1f} ms, "
          f"O(1) sample access {t_idx * 1e6:.1f} us, {info['bytes'] / info['tokens']:.1f} bytes/token")
    shutil.rmtree(d)


if __name__ == "__main__":
    main()
