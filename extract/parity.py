"""`python -m extract.parity A_FEATURES B_FEATURES [--max-samples N]`

Compares two feature datasets of the same samples (two backends, engines or dtypes): per aux layer and
for the final state, the mean and minimum cosine similarity per token and the max absolute difference.
So a user can see whether features from one engine match the engine that will serve. The last line printed is
the result as JSON (tests/benchmarks/record_smoke.py --feature-parity reads it).
"""
from __future__ import annotations

import argparse
import json

import torch

from data.shards import ShardDataset


def compare(a: ShardDataset, b: ShardDataset, max_samples: int | None = None) -> dict:
    if a.meta["aux_layer_ids"] != b.meta["aux_layer_ids"] or a.meta["hidden_size"] != b.meta["hidden_size"]:
        raise ValueError(f"layer ids / hidden size differ: {a.meta['aux_layer_ids']} vs {b.meta['aux_layer_ids']}")
    h, layers = a.meta["hidden_size"], a.meta["aux_layer_ids"]
    b_index = {b[i].sample_id: i for i in range(len(b))}
    names = [f"layer {i}" for i in layers] + ["final"]
    cos: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    max_abs = dict.fromkeys(names, 0.0)
    compared = 0
    for i in range(len(a)):
        sa = a[i]
        if sa.sample_id not in b_index:
            continue
        sb = b[b_index[sa.sample_id]]
        if not torch.equal(sa.input_ids, sb.input_ids):
            raise ValueError(f"sample {sa.sample_id}: token ids differ between the datasets")
        pairs = [(sa.aux_hidden[:, k * h:(k + 1) * h], sb.aux_hidden[:, k * h:(k + 1) * h]) for k in range(len(layers))]
        pairs.append((sa.final_hidden, sb.final_hidden))
        for name, (x, y) in zip(names, pairs):
            x, y = x.float(), y.float()
            cos[name].append(torch.nn.functional.cosine_similarity(x, y, dim=-1))
            max_abs[name] = max(max_abs[name], float((x - y).abs().max()))
        compared += 1
        if max_samples and compared >= max_samples:
            break
    if not compared:
        raise ValueError("no sample id is in both datasets")
    return {"samples": compared, "dtypes": [a.meta["dtype"], b.meta["dtype"]],
            "layers": {n: {"cosine_mean": float(torch.cat(cos[n]).mean()), "cosine_min": float(torch.cat(cos[n]).min()),
                           "max_abs_diff": max_abs[n]} for n in names}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--max-samples", type=int)
    args = p.parse_args(argv)
    result = {"a": args.a, "b": args.b} | compare(ShardDataset(args.a), ShardDataset(args.b), args.max_samples)
    print(f"{'':10} {'cos mean':>10} {'cos min':>10} {'max |diff|':>11}   ({result['samples']} samples, "
          f"{' vs '.join(result['dtypes'])})")
    for name, r in result["layers"].items():
        print(f"{name:10} {r['cosine_mean']:10.6f} {r['cosine_min']:10.6f} {r['max_abs_diff']:11.3g}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
