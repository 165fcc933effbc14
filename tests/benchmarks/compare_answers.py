"""Two regenerate stages' answers to the same prompts, compared: how many conversations got identical answers.

    python tests/benchmarks/compare_answers.py A/data/regenerated.jsonl B/data/regenerated.jsonl  > answers.json

For the widened target (launch/widen_target.py), which must answer as the target it was widened from: equal on at
least 99% of the prompts, the rest bf16 near-ties (the widened model sums in another order).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def answers(path: str | Path) -> dict[str, list[str]]:
    rows = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows}


def compare(a: str | Path, b: str | Path) -> dict:
    first, second = answers(a), answers(b)
    both = sorted(first.keys() & second.keys())
    same = [i for i in both if first[i] == second[i]]
    return {"a": str(a), "b": str(b), "conversations": len(both), "only_in_a": len(first.keys() - second.keys()),
            "only_in_b": len(second.keys() - first.keys()), "identical_answers": len(same),
            "identical_fraction": len(same) / len(both) if both else None,
            "first_differing": [{"id": i, "a": first[i][-1][:300], "b": second[i][-1][:300]}
                                for i in both if first[i] != second[i]][:5]}


if __name__ == "__main__":
    print(json.dumps(compare(*sys.argv[1:3]), indent=1))
