"""Shard write/read throughput and bytes per token (not collected by pytest).

    python tests/benchmarks/bench_shards.py [--hidden 4096] [--tokens 262144] [--dir /tmp/eyrie-bench]
Reports MB/s for writing (incl. fsync + checksum), cold-ish and warm reads that touch every tensor, and
bytes/token. Reads are O(1) memory-mapped views, so "read" means summing every value to force the pages in.
"""
import argparse
import shutil
import time
from pathlib import Path

import torch

from data.shards import ShardDataset, ShardMeta, ShardWriter, write_manifest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1 << 18)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dir", default="/tmp/eyrie-bench-shards")
    a = p.parse_args()
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    meta = ShardMeta(kind="features", target_id="bench", aux_layer_ids=[1, 2, 3], hidden_size=a.hidden,
                     dtype="bfloat16", final_hidden="post_norm")
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
