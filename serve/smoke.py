"""The SGLang serving smoke test: the target served plain, then with the drafter, on the same prompts.

    python -m serve.smoke --target TARGET --drafter DRAFTER_DIR [--tp 8] [--prompts FILE | --run RUN_DIR]
                          [--out DIR] [--concurrency 1,8,64] [--steps 3[,5]] [--server-arg=--attention-backend=triton ...]

Checks first that SGLang will serve the drafter and the target in one dtype (each model's `--dtype auto` comes from
its own config.json). Starts `python -m sglang.launch_server` twice on 127.0.0.1 (baseline, then
`--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFTER --speculative-num-steps S
--speculative-eagle-topk 1 --speculative-num-draft-tokens S+1`, plus `--speculative-draft-attention-backend` for
MLA targets, and `--max-running-requests` set above the highest concurrency: SGLang caps running requests at 48 in
speculative mode otherwise; decode CUDA graphs for the concurrencies' batch sizes only), waits for readiness with a
timeout (large targets take minutes), sends the prompts at temperature 0 and reports output parity with the
baseline, the accept length from `meta_info` (`spec_accept_length`, or completion_tokens / spec_verify_ct on older
versions), tokens/s single-stream and at each concurrency, a verdict per concurrency, and single-stream the
break-even accept length (a verify cycle's cost in plain decode steps) that tells overhead from drafter quality.
Servers are stopped by process group; the port and the GPU memory are checked released. `--steps 3,5` starts one
EAGLE3 server per chain length (report keys `eagle3` for the first, `eagle3_steps5` for the others). Server logs,
each server's measurements (server-NAME.json, reused by a rerun with the same command, prompts and drafter: a run
cut off by a time limit resumes at the next server) and report.json go to --out. `--deterministic-parity` adds a
plain and an EAGLE3 server with SGLang's batch-invariant kernels, single-stream: parity there, where the default
kernels let a bf16 near-tie differ between a 1-token decode and a k-token verify, tells such ties from a bug.

With --run RUN_DIR (a pipeline run whose evaluate stage ran the reference decoder), the prompts are that run's
held-out first turns, the ones serve.evaluate decoded, and the report puts SGLang's accept length and output
tokens next to the reference decoder's and the offline evaluator's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data.files import file_checksum
from data.layout import RunLayout
from data.target import declared_dtype, load_target_info

from .sglang_server import Server, decode_graph_args, gpu_memory_used_mib, server_command, serving

DEFAULT_PROMPTS = ["Count from 1 to 8.", "What is 17 plus 25?", "Sort these words: tiger, apple, river, stone.",
                   "Write a short note from Ada about a falcon.", "Spell the word harbor."]


def accept_length(metas: list[dict]) -> float | None:
    """Tokens per target verify step over all requests: completion_tokens / spec_verify_ct (what SGLang's
    spec_accept_length is per request); None when the server did not speculate."""
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    return sum(m["completion_tokens"] for m in metas) / verify if verify else None


def verdict(baseline: dict[int, float], speculative: dict[int, float], margin: float = 0.05) -> dict[int, str]:
    out = {}
    for c, base in baseline.items():
        ratio = speculative[c] / base if base else 0.0
        out[c] = f"pays ({ratio:.2f}x)" if ratio > 1 + margin else \
            f"does not pay ({ratio:.2f}x)" if ratio < 1 - margin else f"neutral ({ratio:.2f}x)"
    return out


def single_stream_costs(baseline_tokens_per_s: float, spec_tokens_per_s: float, accept: float, steps: int) -> dict:
    """Why speculation pays or not single-stream, from measured throughputs: a verify cycle (the drafts plus one
    target verify) costs accept / spec_tokens_per_s, a plain decode step 1 / baseline_tokens_per_s, so speculation
    pays once the accept length exceeds their ratio (the break-even accept length). A break-even above steps + 1,
    the most one cycle emits, means no drafter pays at this chain length: overhead, not drafter quality. Measured
    end to end per request, so HTTP and prefill are in both."""
    step_ms, cycle_ms = 1000 / baseline_tokens_per_s, 1000 * accept / spec_tokens_per_s
    break_even = cycle_ms / step_ms
    limited_by = ("nothing: the accept length is above break-even" if accept > break_even else
                  "overhead: a cycle costs more decode steps than it can emit" if break_even > steps + 1 else
                  "drafter quality: a higher accept length would pay")
    return {"baseline_ms_per_token": round(step_ms, 3), "verify_cycle_ms": round(cycle_ms, 3),
            "break_even_accept_length": round(break_even, 3), "accept_length": accept,
            "most_tokens_per_cycle": steps + 1, "limited_by": limited_by}


def sglang_auto_dtype(declared: str | None) -> str:
    """The dtype SGLang's `--dtype auto` serves a model in, from what its config.json declares (its
    `_get_and_verify_dtype`, Gemma aside): float32 or nothing declared → float16."""
    return "float16" if declared in (None, "float32") else declared


def check_served_dtypes(target: str, drafter: str, server_args: list[str]) -> None:
    """Fail before any server starts where SGLang would serve the drafter and the target in different dtypes: the
    draft layer then gets mixed inputs and the EAGLE3 server dies capturing its CUDA graphs ("expected mat1 and
    mat2 to have the same dtype"). An explicit --dtype sets both; an Eyrie export declares its target's dtype."""
    if any(arg == "--dtype" or arg.startswith("--dtype=") for arg in server_args):
        return
    declared = {"target": load_target_info(target).dtype,
                "drafter": declared_dtype(json.loads((Path(drafter) / "config.json").read_text()))}
    served = {k: sglang_auto_dtype(v) for k, v in declared.items()}
    if served["target"] != served["drafter"]:
        raise SystemExit(f"{drafter}/config.json declares {declared['drafter']} and {target}/config.json "
                         f"{declared['target']}: SGLang would serve the drafter in {served['drafter']} and the target "
                         f"in {served['target']}, and the EAGLE3 server fails on the mixed dtypes. Pass "
                         f"--server-arg=--dtype={served['drafter']} (or re-export the drafter for this target)")


def server_key(command: list[str], prompts: list[list[int]], max_new: int, concurrency: list[int],
               drafter: str | None) -> str:
    """What a server's measurements depend on: its command, the prompts and, for EAGLE3, the drafter's files."""
    drafter_files = [(f.name, file_checksum(f)) for f in sorted(Path(drafter).iterdir()) if f.is_file()] \
        if drafter else []
    return hashlib.sha256(json.dumps([command, prompts, max_new, concurrency, drafter_files]).encode()).hexdigest()


def measured_once(path: Path, key: str, serve_and_measure) -> dict:
    """One server's measurements, kept in `path`: a smoke test cut off by a time limit (tests/benchmarks/mission.sh)
    resumes at the next server instead of starting every server again. Reused only under the same key."""
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            print(f"[smoke] {path.stem}: measured by an earlier run with the same command, prompts and drafter: {path}")
            measured = saved["result"]["measured"]
            measured["tokens_per_s"] = {int(c): v for c, v in measured["tokens_per_s"].items()}  # JSON keys are str
            return saved["result"]
    result = serve_and_measure()
    path.write_text(json.dumps({"key": key, "result": result}))
    return result


SINGLE_STREAM_PASSES = 3


def measure(server: Server, prompts: list[list[int]], max_new: int, concurrency: list[int]) -> dict:
    server.generate(prompts[0], 8)  # untimed warm-up
    # single-stream tokens/s: the median of a few passes over the prompts (one pass of a 100M target is ~1 s, and
    # one pass's verify cycle once timed 17% dearer with 3 draft steps than with 5); the first pass is reported
    single, rates = None, []
    for _ in range(SINGLE_STREAM_PASSES):
        t0 = time.time()
        results = [server.generate(p, max_new) for p in prompts]
        rates.append(sum(r["meta_info"]["completion_tokens"] for r in results) / (time.time() - t0))
        single = single or results
    metas = [r["meta_info"] for r in single]
    out = {"texts": [r["text"] for r in single], "output_ids": [r.get("output_ids") for r in single],
           "completion_tokens": sum(m["completion_tokens"] for m in metas),
           "verify_steps": sum(m.get("spec_verify_ct", 0) for m in metas), "accept_length": accept_length(metas),
           "per_prompt": [{"completion_tokens": m["completion_tokens"], "verify_steps": m.get("spec_verify_ct", 0)}
                          for m in metas],
           "spec_accept_length_mean": (sum(m["spec_accept_length"] for m in metas) / len(metas)
                                       if all("spec_accept_length" in m for m in metas) else None),
           "tokens_per_s": {1: statistics.median(rates)}, "single_stream_passes_tokens_per_s": rates}
    for c in concurrency:
        if c == 1:
            continue
        # 4c requests, at least 4 per prompt: at 2c the mission's c=8 windows were 0.2-0.6 s, too short to time
        n = max(4 * c, 4 * len(prompts))
        batch = (prompts * (n // len(prompts) + 1))[:n]
        with ThreadPoolExecutor(c) as pool:  # untimed warm-up: kernels built for this batch size are not timed
            list(pool.map(lambda p: server.generate(p, 8), batch[:c]))
            t0 = time.time()
            results = list(pool.map(lambda p: server.generate(p, max_new), batch))
        out["tokens_per_s"][c] = sum(r["meta_info"]["completion_tokens"] for r in results) / (time.time() - t0)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompts", help="JSONL of conversations; each first user turn becomes a prompt")
    p.add_argument("--run", help="pipeline run dir: its held-out prompts, compared with its evaluate stage")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64, help="64: what the reference decoder uses")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--steps", default="3", help="chain lengths, comma-separated; the first is compared with the run")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for each server")
    p.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeat)")
    p.add_argument("--deterministic-parity", action="store_true",
                   help="also serve plain and EAGLE3 (first chain length) with --enable-deterministic-inference, "
                        "single-stream, and report their parity: a bf16 near-tie or a speculation bug")
    p.add_argument("--out", default="smoke")
    a = p.parse_args(argv)
    a.steps = [int(n) for n in a.steps.split(",")]
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    return a


def prompt_ids(a: argparse.Namespace) -> list[list[int]]:
    """The prompts as token ids, tokenized as the reference decoder does, so both see the very same prompt."""
    from transformers import AutoTokenizer

    from .decode import read_prompts
    if a.run:
        from .evaluate import held_out_prompts
        reference_decoding(a.run, a.drafter, a.steps[0])  # fail now, not after minutes of server start-up
        convs = held_out_prompts(a.run, a.limit)
    elif a.prompts:
        convs = read_prompts(a.prompts)
    else:
        convs = [[{"role": "user", "content": q}] for q in DEFAULT_PROMPTS]
    tok = AutoTokenizer.from_pretrained(a.target)
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for m in convs[:a.limit]]


def server_plan(a: argparse.Namespace) -> list[tuple[str, list[str], list[int]]]:
    """(name, launch_server args, concurrencies) of each server to measure, the plain baseline first."""
    mla = load_target_info(a.target).is_mla
    common = ["--model-path", a.target, "--tp", str(a.tp), "--max-running-requests", str(max(a.concurrency) * 2),
              *decode_graph_args(a.concurrency), *a.server_arg]  # the user's own graph sizes, if any, come last: they win

    def eagle(n: int) -> list[str]:
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", a.drafter,
                "--speculative-num-steps", str(n), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(n + 1)] + \
            (["--speculative-draft-attention-backend", "triton"] if mla else [])  # the Llama drafter: not MLA's
    servers = [("baseline", common, a.concurrency)] + \
        [(name, common + eagle(n), a.concurrency) for name, n in zip(spec_names(a.steps), a.steps)]
    if a.deterministic_parity:  # batch-invariant kernels: a 4-token verify computes what a 1-token decode does
        deterministic = ["--enable-deterministic-inference"]
        servers += [("baseline_deterministic", common + deterministic, [1]),
                    ("eagle3_deterministic", common + eagle(a.steps[0]) + deterministic, [1])]
    return servers


def spec_names(steps: list[int]) -> list[str]:
    return ["eagle3"] + [f"eagle3_steps{n}" for n in steps[1:]]


def run_servers(a: argparse.Namespace, prompts: list[list[int]], out: Path) -> dict:
    """Each planned server started, measured and stopped in turn (or its saved measurements reused)."""
    report = {}
    for name, args, levels in server_plan(a):
        key = server_key(server_command(a.port, args), prompts, a.max_new_tokens, levels,
                         a.drafter if a.drafter in args else None)

        def serve_and_measure() -> dict:
            stopped: dict = {}
            with serving(args, a.port, out / f"server-{name}.log", a.timeout, stopped) as server:
                result = {"command": " ".join(server.cmd), "ready_s": server.ready_s,
                          "measured": measure(server, prompts, a.max_new_tokens, levels)}
            return result | {"stopped": stopped}
        try:
            result = measured_once(out / f"server-{name}.json", key, serve_and_measure)
        except (RuntimeError, TimeoutError) as e:
            if not name.endswith("_deterministic"):
                raise
            # an extra check, not the measurement: the report keeps what the other servers measured
            report.setdefault("deterministic", {"error": f"{name}: {str(e)[-2000:]}"})
            continue
        report |= {f"{name}_ready_s": result["ready_s"], name: result["measured"],
                   f"{name}_stopped": result["stopped"], f"{name}_command": result["command"]}
    return report


def compare(report: dict, a: argparse.Namespace, prompts: int) -> dict:
    """Parity with the plain server, verdicts per concurrency and single-stream costs, from the measurements."""
    base, spec = report["baseline"], report["eagle3"]

    def parity(run: dict, baseline: dict = base) -> float:  # share of prompts whose output equals the baseline's
        return sum(x == y for x, y in zip(baseline["texts"], run["texts"])) / prompts
    report["parity"] = parity(spec)
    if a.deterministic_parity and "deterministic" not in report:
        det = report["eagle3_deterministic"]
        report["deterministic"] = {"parity": parity(det, report["baseline_deterministic"]),
                                   "accept_length": det["accept_length"],
                                   "baseline_parity_with_default_kernels": parity(report["baseline_deterministic"])}
    report["verdict"] = verdict(base["tokens_per_s"], spec["tokens_per_s"])
    for name, n in zip(spec_names(a.steps), a.steps):
        measured = report[name]
        measured["single_stream"] = single_stream_costs(base["tokens_per_s"][1], measured["tokens_per_s"][1],
                                                        measured["accept_length"], n)
        if name != "eagle3":
            measured |= {"parity": parity(measured), "verdict": verdict(base["tokens_per_s"], measured["tokens_per_s"])}
    report["accept_length_formula"] = "completion tokens / target verify steps (SGLang's spec_accept_length)"
    if a.run:
        report["reference"] = compare_with_run(a.run, a.drafter, a.steps[0], spec)
    return report


def print_report(report: dict, a: argparse.Namespace) -> None:
    base, spec = report["baseline"], report["eagle3"]
    print(f"parity with baseline: {report['parity']:.0%}; accept length {spec['accept_length']} "
          f"(spec_accept_length mean {spec['spec_accept_length_mean']})")
    for c in a.concurrency:
        print(f"concurrency {c:>4}: baseline {base['tokens_per_s'][c]:9.1f} tok/s, eagle3 "
              f"{spec['tokens_per_s'][c]:9.1f} tok/s → {report['verdict'][c]}")
    for name, n in zip(spec_names(a.steps), a.steps):
        costs = report[name]["single_stream"]
        print(f"{n} steps single-stream: decode step {costs['baseline_ms_per_token']:.2f} ms, verify cycle "
              f"{costs['verify_cycle_ms']:.2f} ms → break-even accept length {costs['break_even_accept_length']:.2f} "
              f"(measured {costs['accept_length']:.2f}, at most {n + 1}); limited by {costs['limited_by']}")
    if "error" in report.get("deterministic", {}):
        print(f"--enable-deterministic-inference: no parity check, {report['deterministic']['error'][:300]}")
    elif "deterministic" in report:
        det = report["deterministic"]
        print(f"--enable-deterministic-inference, {a.steps[0]} steps: parity with its plain server "
              f"{det['parity']:.0%}, accept length {det['accept_length']:.3f}; its plain output = the default plain "
              f"output on {det['baseline_parity_with_default_kernels']:.0%}")
    for n in a.steps[1:]:
        deeper = report[f"eagle3_steps{n}"]
        print(f"{n} steps: accept length {deeper['accept_length']}, parity {deeper['parity']:.0%}, "
              + ", ".join(f"c={c} {deeper['tokens_per_s'][c] / base['tokens_per_s'][c]:.2f}x" for c in a.concurrency))
    print_reference(report.get("reference", {}))


def print_reference(reference: dict) -> None:
    for name, r in reference.get("accept_length", {}).items():
        print(f"{name:>28}: accept length {r['value']:.3f} ({r['relative_to_sglang']:+.1%} vs SGLang)")
    if reference:
        print(f"SGLang EAGLE3 output tokens equal to the reference decoder's: "
              f"{reference['token_parity_with_reference_decoder']:.0%}")
    if "same_output_prompts" in reference:
        same = reference["same_output_prompts"]
        print(f"on the {same['prompts']} prompts with equal outputs: SGLang {same['sglang']:.3f}, reference decoder "
              f"{same['reference_decoder']:.3f} ({same['relative_to_sglang']:+.1%}); equal verify steps on "
              f"{same['prompts_with_equal_verify_steps']}")


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    check_served_dtypes(a.target, a.drafter, a.server_arg)  # now, not after minutes of server start-up
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = prompt_ids(a)
    report = {"target": a.target, "drafter": a.drafter, "tp": a.tp, "steps": a.steps, "prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "gpu_memory_before_mib": gpu_memory_used_mib()}
    report = compare(report | run_servers(a, prompts, out), a, len(prompts))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print_report(report, a)
    print(f"report: {out / 'report.json'}")
    return report

def reference_decoding(run: str, drafter: str, steps: int) -> dict:
    """The run's serve.evaluate report, which must hold a reference-decoder run of this drafter and chain."""
    report = json.loads(RunLayout(run).evaluate_report.read_text())
    if report.get("decode", {}).get(drafter, {}).get("steps") != steps:
        raise SystemExit(f"{run}/evaluate/evaluate.json has no reference-decoder run of {drafter} with {steps} steps")
    return report


def compare_with_run(run: str, drafter: str, steps: int, spec: dict) -> dict:
    """SGLang's accept length beside the reference decoder's and the offline evaluator's of the same run."""
    report = reference_decoding(run, drafter, steps)
    decoded, offline = report["decode"][drafter], report["drafters"][drafter]
    sglang = spec["accept_length"]
    values = {"sglang": sglang, "reference_decoder": decoded["accept_length"],
              f"offline_evaluator_{report['split']}": offline["accept_length_by_steps"][steps - 1]}
    if "prompts" in offline:  # the same prompts' stored answers, decoded on their features
        values["offline_evaluator_prompts"] = offline["prompts"]["decoded_accept_length_by_steps"][steps - 1]
    ref_ids = [r["output_ids"] for r in decoded["prompts"]]
    same = [a == b for a, b in zip(spec["output_ids"], ref_ids)]
    out = {"accept_length": {k: {"value": v, "relative_to_sglang": v / sglang - 1} for k, v in values.items()},
           "token_parity_with_reference_decoder": sum(same) / max(len(same), 1),
           "reference_decoder_device": decoded["device"], "prompts_compared": len(same)}
    if "per_prompt" in spec and any(same):  # measurements saved before per-prompt counts were kept lack it
        out["same_output_prompts"] = same_output_accept_lengths(spec["per_prompt"], decoded["prompts"], same)
    return out


def same_output_accept_lengths(sglang: list[dict], reference: list[dict], same: list[bool]) -> dict:
    """Both decoders' accept lengths over only the prompts where they emitted the same tokens. A greedy output that
    flips at a near-tie (bf16 kernels differ between a 1-token decode and a k-token verify) continues as different
    text with its own acceptance, so the all-prompt totals can differ while the drafting itself agrees."""
    def tau(tokens: int, verify: int) -> float:
        return tokens / verify if verify else float("nan")
    pairs = [(s, r) for s, r, ok in zip(sglang, reference, same) if ok]
    s_tok, s_ver = sum(s["completion_tokens"] for s, _ in pairs), sum(s["verify_steps"] for s, _ in pairs)
    r_tok, r_ver = sum(r["tokens"] for _, r in pairs), sum(r["verify_calls"] for _, r in pairs)
    sglang_tau, reference_tau = tau(s_tok, s_ver), tau(r_tok, r_ver)
    return {"prompts": len(pairs), "sglang": sglang_tau, "reference_decoder": reference_tau,
            "relative_to_sglang": reference_tau / sglang_tau - 1,
            "prompts_with_equal_verify_steps": sum(s["verify_steps"] == r["verify_calls"] for s, r in pairs)}


if __name__ == "__main__":
    main()
