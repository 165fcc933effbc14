"""Which speculative configuration to serve: `serve.smoke --sweep` measures chains (1-7 steps, top-k 1) and trees
(top-k > 1) on the same prompts beside the plain server, and this module picks, per concurrency, the fastest one
that is measurably faster than plain (its speedup's whole min-max range above 1.0), as the exact SGLang flags. A
concurrency where none is measurably faster recommends the plain server: a user never turns on a configuration
that was not shown to pay.
"""
from __future__ import annotations

from typing import NamedTuple

DEFAULT_TREES = ("3/2/6", "3/4/8", "4/8/16")  # STEPS/TOPK/DRAFT_TOKENS, as SGLang's flags name them


class Spec(NamedTuple):
    """One EAGLE-3 configuration: SGLang's --speculative-num-steps, --speculative-eagle-topk and
    --speculative-num-draft-tokens."""
    steps: int
    topk: int
    tokens: int

    def check(self) -> None:
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"{self}: steps and top-k are at least 1")
        if self.topk == 1 and self.tokens != self.steps + 1:
            raise ValueError(f"{self}: a chain (top-k 1) verifies steps + 1 = {self.steps + 1} draft tokens")
        if not 1 < self.tokens <= 1 + self.steps * self.topk:
            raise ValueError(f"{self}: a tree of {self.steps} steps x top-k {self.topk} holds 2 to "
                             f"{1 + self.steps * self.topk} draft tokens")

    def label(self) -> str:
        return f"SGLang EAGLE3, {self.steps} steps / top-k {self.topk} / {self.tokens} draft tokens"

    def flags(self, drafter: str) -> list[str]:
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
                "--speculative-num-steps", str(self.steps), "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-draft-tokens", str(self.tokens)]


class Block(NamedTuple):
    """A DFlash drafter's configuration: blocks of its own size (its config's dflash_config.block_size), one forward
    per block; SGLang's --speculative-num-draft-tokens is the block size."""
    block_size: int

    @property
    def tokens(self) -> int:  # the most a verify step emits
        return self.block_size

    def check(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"{self}: a block holds at least 2 tokens")

    def label(self) -> str:
        return f"SGLang DFLASH, blocks of {self.block_size} ({self.block_size - 1} drafts)"

    def flags(self, drafter: str) -> list[str]:
        return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter,
                "--speculative-num-draft-tokens", str(self.block_size)]


def spec_names(configs: list[Spec | Block]) -> list[str]:
    """Report keys: `eagle3` (or `dflash`) for the first configuration (compared with the run's reference decoder),
    `eagle3_stepsN` for other chains, `eagle3_stepsS_topkK_tokensT` for trees."""
    for spec in configs:
        spec.check()
    return ["dflash" if isinstance(configs[0], Block) else "eagle3"] + [f"eagle3_steps{s.steps}" if s.topk == 1 else
                         f"eagle3_steps{s.steps}_topk{s.topk}_tokens{s.tokens}" for s in configs[1:]]


def recommend(report: dict, names: list[str], concurrency: list[int]) -> dict:
    """Per concurrency: the configuration with the highest median speedup among those measurably faster than the
    plain server (else none), every configuration's speedup beside it, and the concurrency from which none pays."""
    by_concurrency, does_not_pay_from = {}, None
    for c in map(str, sorted(concurrency)):
        rows = {n: report[n]["speedup"][c] for n in names
                if "speedup" in report.get(n, {}) and c in report[n]["speedup"]}
        faster = {n: r for n, r in rows.items() if r["min"] > 1.0}
        if faster:
            best = max(faster, key=lambda n: faster[n]["median"])
            choice = {"config": best, "chain": report[best]["chain"], "flags": report[best]["flags"],
                      "speedup": faster[best], "parity": report[best]["parity"]["all"]}
        else:
            closest = max(rows, key=lambda n: rows[n]["median"]) if rows else None
            choice = {"config": None, "flags": [], "why": "no configuration is measurably faster than the plain "
                      "server" + (f" (closest: {closest}, {rows[closest]['median']:.2f}x, "
                                  f"{rows[closest]['min']:.2f}-{rows[closest]['max']:.2f})" if closest else "")}
            does_not_pay_from = does_not_pay_from or int(c)
        by_concurrency[c] = choice | {"all": rows}
    paying = [int(c) for c, r in by_concurrency.items() if r["config"] and
              (does_not_pay_from is None or int(c) < does_not_pay_from)]
    return {"by_concurrency": by_concurrency, "pays_up_to_concurrency": max(paying) if paying else None,
            "does_not_pay_from_concurrency": does_not_pay_from,
            "rule": "the highest median speedup among configurations whose min-max range lies above 1.0; none "
                    "such: serve the plain server"}


def print_recommendations(rec: dict) -> None:
    print("recommended (" + rec["rule"] + "):")
    for c, r in rec["by_concurrency"].items():
        if r["config"]:
            s = r["speedup"]
            print(f"  concurrency {c:>4}: {r['chain']}, {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}), "
                  f"parity {r['parity']:.0%}: {' '.join(r['flags'])}")
        else:
            print(f"  concurrency {c:>4}: plain server; {r['why']}")
    if rec["does_not_pay_from_concurrency"] is not None:
        print(f"  speculation does not pay from concurrency {rec['does_not_pay_from_concurrency']} "
              f"(measured: {', '.join(rec['by_concurrency'])})")
