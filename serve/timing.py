"""Timing a served model the way a figure must be reported: repeated passes long enough to time, medians with their
min-max, ratios taken within one run, and per-step costs measured from a streamed request, not derived.

- `timed_pass`: c clients send the prompts in a fixed cycle, each starting a new request as its last one returns,
  until `min_seconds` have passed; tokens/s = completion tokens / the pass's wall time (the requests in flight at
  the deadline finish and count).
- `step_times`: one request streamed with stream interval 1: SGLang sends a chunk after every decode step (plain) or
  verify cycle (speculative), with the cumulative completion tokens and verify count in its meta_info, so the time
  between chunks divided by the steps (or cycles) it covers is one step's (cycle's) cost, as seen by a client.
- `spread` / `ratio`: median with min-max; a ratio's range pairs the extremes, and a range that straddles 1.0 is
  "no measurable difference".
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

NO_DIFFERENCE = "no measurable difference"


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": values}


def ratio(numerator: dict, denominator: dict) -> dict:
    """numerator / denominator of two spreads: median over median, and the range the repeats allow."""
    return {"median": numerator["median"] / denominator["median"],
            "min": numerator["min"] / denominator["max"], "max": numerator["max"] / denominator["min"]}


def verdict(speedup: dict) -> str:
    if speedup["min"] > 1.0:
        return f"faster: {speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f})"
    if speedup["max"] < 1.0:
        return f"slower: {speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f})"
    return f"{NO_DIFFERENCE}: {speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f})"


def timed_pass(generate: Callable[[list[int], int], dict], prompts: list[list[int]], max_new: int, concurrency: int,
               min_seconds: float) -> dict:
    lock, counter = threading.Lock(), iter(range(10 ** 9))
    done = {"requests": 0, "completion_tokens": 0}
    start = time.perf_counter()
    deadline = start + min_seconds

    def client() -> None:
        while time.perf_counter() < deadline:
            with lock:
                i = next(counter)
            tokens = generate(prompts[i % len(prompts)], max_new)["meta_info"]["completion_tokens"]
            with lock:
                done["requests"] += 1
                done["completion_tokens"] += tokens
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    seconds = time.perf_counter() - start
    return done | {"seconds": seconds, "tokens_per_s": done["completion_tokens"] / seconds}


def step_times(chunks: list[tuple[float, int, int]], speculative: bool) -> list[float]:
    """Milliseconds per decode step (plain) or verify cycle (speculative) from a streamed request's chunks
    (arrival time, cumulative completion tokens, cumulative verify count). The first chunk (prefill) is skipped; a
    chunk that covers several steps (the client fell behind and SGLang merged them) counts as that many, each
    at the chunk's time divided by them."""
    out = []
    counted = speculative and chunks and chunks[-1][2] > 0  # a server that streams no verify count: a chunk a cycle
    for (t0, tok0, ver0), (t1, tok1, ver1) in zip(chunks, chunks[1:]):
        steps = (ver1 - ver0 if counted else 1) if speculative else (tok1 - tok0)
        if steps > 0:
            out += [1000 * (t1 - t0) / steps] * steps
    return out
