"""Timing a served model the way a figure must be reported: repeated passes long enough to time, medians with their
min-max, ratios taken within one run, and per-step costs measured from a streamed request, not derived.

- `timed_pass`: c clients send the prompts in a fixed cycle, each starting a new request as its last one returns,
  until `min_seconds` have passed; tokens/s = completion tokens / the pass's wall time (the requests in flight at
  the deadline finish and count).
- `decode_ms`: one request streamed alone (stream interval 1): the time from its first chunk (the prefill's token)
  to its last, over the plain decode steps (tokens) or the speculative cycles (draft + verify: the verify count
  SGLang reports when the request finishes) in between, is one step's (cycle's) cost as a client sees it. Per-chunk
  gaps cannot be attributed: SGLang 0.5.14 streams `spec_verify_ct` only in the finished chunk, and a client that
  falls behind gets several steps' events at once.
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


def decode_ms(chunks: list[tuple[float, int, int]], speculative: bool) -> float | None:
    """Milliseconds per plain decode step or per speculative cycle of one streamed request, from its chunks (arrival
    time, cumulative completion tokens, cumulative verify count: 0 until the finished chunk). None when nothing
    after the first chunk can be counted (one chunk, or a server that reports no verify count)."""
    if len(chunks) < 2:
        return None
    (t0, tokens0, verify0), (t1, tokens1, verify1) = chunks[0], chunks[-1]
    # the first chunk is the prefill's token (no verify): every cycle counted by the finished chunk came after it
    steps = verify1 - verify0 if speculative else tokens1 - tokens0
    return 1000 * (t1 - t0) / steps if steps > 0 else None
