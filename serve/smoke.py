"""The SGLang serving smoke test: the target served plain, then with the drafter, on the same prompts.

    python -m serve.smoke --target TARGET --drafter DRAFTER_DIR [--tp 8] [--prompts FILE | --run RUN_DIR]
                          [--out DIR] [--concurrency 1,8,64] [--steps 3[,5]] [--trees 3/4/8,...] [--sweep]
                          [--repeats 3] [--pass-seconds 10] [--server-arg=--attention-backend=triton ...]

Checks first that SGLang will serve the drafter and the target in one dtype (each model's `--dtype auto` comes from
its own config.json). Starts `python -m sglang.launch_server` on 127.0.0.1 for the baseline, then once per chain
length with `--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFTER --speculative-num-steps S
--speculative-eagle-topk 1 --speculative-num-draft-tokens S+1` (plus `--speculative-draft-attention-backend` for
MLA targets, and `--max-running-requests` above the highest concurrency: SGLang caps running requests at 48 in
speculative mode otherwise; decode CUDA graphs for the concurrencies' batch sizes only), waits for readiness with a
timeout (large targets take minutes). On each server, at temperature 0:
- outputs: each prompt group once, single-stream (`max_new_tokens`, 64 as the reference decoder): parity with the
  baseline per group, and the accept length = completion tokens / target verify steps (SGLang's spec_accept_length);
- step costs, measured: `--repeats` requests of `--timing-max-new-tokens` tokens, each streamed alone: its decode
  time (first chunk to last) over its plain decode steps or its speculative cycles (draft + verify, SGLang's verify
  count) is one step's or cycle's cost (serve/timing.py); the break-even accept length is their ratio;
- tokens/s: `--repeats` passes of at least `--pass-seconds` at each concurrency on the first group's prompts
  (serve/timing.py); the speedup is median over median with the range of the repeats, and a range that straddles
  1.0 reads "no measurable difference".
Servers are stopped by process group; the port and the GPU memory are checked released. Report keys: `eagle3` for
the first chain length, `eagle3_stepsN` for the others; a DFlash drafter (serve/dflash_dir.py) is served with
`--speculative-algorithm DFLASH --speculative-num-draft-tokens BLOCK_SIZE`, key `dflash`. Server logs, each
server's measurements (server-NAME.json, reused by a rerun with the same command, prompts and drafter: a run cut
off by a time limit resumes at the next server) and report.json go to --out. `--trees S/K/N,...` adds trees (top-k
K > 1, N draft tokens; keys `eagle3_stepsS_topkK_tokensN`); `--sweep` measures chains of 1-7 steps and
serve/sweep.py's default trees; with more than one configuration the report recommends, per concurrency, the
fastest one measurably faster than the plain server as its exact flags, or the plain server (`recommended`); a
configuration whose server fails is reported with its error, not the end of the sweep. `--deterministic-parity`
adds a plain and an EAGLE3 server with SGLang's batch-invariant kernels, single-stream: parity there, where the
default kernels let a bf16 near-tie differ between a 1-token decode and a k-token verify, tells such ties from a
bug.

With --run RUN_DIR (a pipeline run whose evaluate stage ran the reference decoder), the prompts are that run's
held-out prompts by group (RUN_DIR/data/split.json), the ones serve.evaluate decoded, and the report puts SGLang's
accept length next to the reference decoder's and the offline evaluator's for each group (serve/smoke_reference.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data.environment import environment
from data.files import file_checksum
from data.layout import RunLayout
from data.split import primary_group, read_split
from data.target import declared_dtype, load_target_info

from .drafter_dir import target_match
from .sglang_server import Server, decode_graph_args, gpu_memory_used_mib, server_command, serving
from .smoke_reference import compare_with_run, print_reference, reference_decoding
from .sweep import DEFAULT_TREES, Block, Spec, print_recommendations, recommend, spec_names
from .timing import decode_ms, ratio, spread, timed_pass, verdict

DEFAULT_PROMPTS = ["Count from 1 to 8.", "What is 17 plus 25?", "Sort these words: tiger, apple, river, stone.",
                   "Write a short note from Ada about a falcon.", "Spell the word harbor."]


def accept_length(metas: list[dict]) -> float | None:
    """Tokens per target verify step over all requests: completion_tokens / spec_verify_ct (what SGLang's
    spec_accept_length is per request); None when the server did not speculate."""
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    return sum(m["completion_tokens"] for m in metas) / verify if verify else None


def cycle_costs(step_ms: dict, cycle_ms: dict, accept: float | None, steps: int) -> dict:
    """Why speculation pays or not single-stream, from the measured costs: a verify cycle (the drafts plus one
    target verify) against a plain decode step. Speculation pays once the accept length exceeds cycle / step (the
    break-even accept length); a break-even above steps + 1, the most one cycle emits, means no drafter pays at
    this chain length: overhead, not drafter quality. The range pairs the repeats' extremes."""
    break_even = ratio(cycle_ms, step_ms)
    limited_by = ("nothing: the accept length is above break-even" if accept and accept > break_even["max"] else
                  "overhead: a cycle costs more decode steps than it can emit" if break_even["min"] > steps + 1 else
                  "drafter quality: a higher accept length would pay" if accept and accept < break_even["min"] else
                  "undecided: the accept length is within the break-even's range")
    return {"plain_step_ms": step_ms, "cycle_ms": cycle_ms, "break_even_accept_length": break_even,
            "accept_length": accept, "most_tokens_per_cycle": steps + 1, "limited_by": limited_by,
            "how": "one request streamed alone per repeat: the time from its first chunk (prefill) to its last over "
                   "the plain decode steps or speculative cycles (SGLang's verify count) in between; break-even = "
                   "cycle / step"}


def sglang_auto_dtype(declared: str | None) -> str:
    """The dtype SGLang's `--dtype auto` serves a model in, from what its config.json declares (its
    `_get_and_verify_dtype`, Gemma aside): float32 or nothing declared → float16."""
    return "float16" if declared in (None, "float32") else declared


# SGLang 0.5.14 casts every batch of input embeddings to bfloat16 (ModelRunner._extend_forward_kwargs), and the
# DFlash draft forward passes its block's embeddings that way: a DFlash drafter served in float16 fails at its
# first block ("expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != c10::Half", on an H100).
DFLASH_DTYPE = "bfloat16"


def explicit_dtype(server_args: list[str]) -> str | None:
    """The value of a `--dtype X` or `--dtype=X` among the server arguments (the last one wins, as in argparse)."""
    found = None
    for i, arg in enumerate(server_args):
        if arg.startswith("--dtype="):
            found = arg.split("=", 1)[1]
        elif arg == "--dtype" and i + 1 < len(server_args):
            found = server_args[i + 1]
    return found


def served_dtype_args(target: str, drafter: str, server_args: list[str]) -> list[str]:
    """The `--dtype` every server needs, added to the user's server arguments; checked before any server starts.
    A DFlash drafter is served in bfloat16 (above), the plain server too so that both compute alike. Otherwise each
    model's `--dtype auto` comes from its own config.json, and where SGLang would serve the drafter and the target
    in different dtypes the draft layer gets mixed inputs and the EAGLE3 server dies capturing its CUDA graphs
    ("expected mat1 and mat2 to have the same dtype"): refused here. An Eyrie export declares its target's dtype."""
    from .dflash_dir import is_dflash_dir
    explicit = explicit_dtype(server_args)
    if is_dflash_dir(drafter):
        if explicit is None:
            print(f"[smoke] {drafter} is a DFlash drafter: serving with --dtype {DFLASH_DTYPE} (SGLang 0.5.14 feeds "
                  "its blocks' embeddings in bfloat16), the plain server too", flush=True)
            return ["--dtype", DFLASH_DTYPE]
        if explicit not in (DFLASH_DTYPE, "bf16"):
            raise SystemExit(f"--dtype {explicit}: SGLang 0.5.14 serves a DFlash drafter in {DFLASH_DTYPE} only (its "
                             "model runner casts the block embeddings to bfloat16, and the drafter's float16 weights "
                             f"then fail); pass --server-arg=--dtype={DFLASH_DTYPE} or leave --dtype out")
        return []
    if explicit is not None:
        return []
    declared = {"target": load_target_info(target).dtype,
                "drafter": declared_dtype(json.loads((Path(drafter) / "config.json").read_text()))}
    served = {k: sglang_auto_dtype(v) for k, v in declared.items()}
    if served["target"] != served["drafter"]:
        raise SystemExit(f"{drafter}/config.json declares {declared['drafter']} and {target}/config.json "
                         f"{declared['target']}: SGLang would serve the drafter in {served['drafter']} and the target "
                         f"in {served['target']}, and the EAGLE3 server fails on the mixed dtypes. Pass "
                         f"--server-arg=--dtype={served['drafter']} (or re-export the drafter for this target)")
    return []


def server_key(command: list[str], groups: dict[str, list[list[int]]], settings: list, concurrency: list[int],
               drafter: str | None) -> str:
    """What a server's measurements depend on: its command, the prompts, how it is timed and, for EAGLE3, the
    drafter's files."""
    drafter_files = [(f.name, file_checksum(f)) for f in sorted(Path(drafter).iterdir()) if f.is_file()] \
        if drafter else []
    return hashlib.sha256(json.dumps([command, groups, settings, concurrency, drafter_files]).encode()).hexdigest()


def measured_once(path: Path, key: str, serve_and_measure) -> dict:
    """One server's measurements, kept in `path`: a smoke test cut off by a time limit (tests/benchmarks/mission.sh)
    resumes at the next server instead of starting every server again. Reused only under the same key."""
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            print(f"[smoke] {path.stem}: measured by an earlier run with the same command, prompts and drafter: {path}")
            return saved["result"]
    result = serve_and_measure()
    path.write_text(json.dumps({"key": key, "result": result}))
    return result


def outputs(server: Server, prompts: list[list[int]], max_new: int) -> dict:
    """Each prompt once, single-stream: the texts (parity) and the accept length over all of them."""
    results = [server.generate(p, max_new) for p in prompts]
    metas = [r["meta_info"] for r in results]
    return {"texts": [r["text"] for r in results], "output_ids": [r.get("output_ids") for r in results],
            "prompts": len(prompts), "completion_tokens": sum(m["completion_tokens"] for m in metas),
            "verify_steps": sum(m.get("spec_verify_ct", 0) for m in metas), "accept_length": accept_length(metas),
            "per_prompt": [{"completion_tokens": m["completion_tokens"], "verify_steps": m.get("spec_verify_ct", 0)}
                           for m in metas],
            "spec_accept_length_mean": (sum(m["spec_accept_length"] for m in metas) / len(metas)
                                        if all("spec_accept_length" in m for m in metas) else None)}


def measure(server: Server, groups: dict[str, list[list[int]]], a: argparse.Namespace, concurrency: list[int],
            speculative: bool) -> dict:
    timing_prompts = groups[primary_group(groups)]
    server.generate(timing_prompts[0], 8)  # untimed warm-up
    out = {"groups": {g: outputs(server, prompts, a.max_new_tokens) for g, prompts in groups.items()}}
    per_request, streams = [], []
    for r in range(a.repeats):
        chunks = server.stream(timing_prompts[r % len(timing_prompts)], a.timing_max_new_tokens)
        ms = decode_ms(chunks, speculative)
        if ms is None:
            raise RuntimeError(f"{server.log.stem}: a streamed request of {a.timing_max_new_tokens} tokens came back "
                               "in one chunk or without a verify count; no step could be timed")
        per_request.append(ms)
        # kept raw (arrival s from the request's first chunk, tokens, verify count): a cost can be timed again
        streams.append([(round(t - chunks[0][0], 6), tokens, verify) for t, tokens, verify in chunks])
    out["step_ms"] = {k: v for k, v in spread(per_request).items() if k != "values"} | {"repeats": per_request}
    out["streams"] = streams
    out["tokens_per_s"], out["passes"] = {}, {}
    for c in concurrency:
        with ThreadPoolExecutor(c) as pool:  # untimed warm-up: kernels built for this batch size are not timed
            list(pool.map(lambda p: server.generate(p, 8), (timing_prompts * c)[:c]))
        passes = [timed_pass(server.generate, timing_prompts, a.timing_max_new_tokens, c, a.pass_seconds)
                  for _ in range(a.repeats)]
        out["passes"][str(c)] = passes
        out["tokens_per_s"][str(c)] = spread([p["tokens_per_s"] for p in passes])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompts", help="JSONL of conversations; each first user turn becomes a prompt")
    p.add_argument("--run", help="pipeline run dir: its held-out prompts, compared with its evaluate stage")
    p.add_argument("--limit", type=int, default=16, help="prompts per group")
    p.add_argument("--max-new-tokens", type=int, default=64, help="outputs and accept length; 64: what the reference "
                   "decoder uses")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per concurrency, and streamed step timings")
    p.add_argument("--pass-seconds", type=float, default=10.0, help="each timed pass runs at least this long")
    p.add_argument("--timing-max-new-tokens", type=int, default=256, help="tokens per request when timing")
    p.add_argument("--steps", default=None, help="chain lengths, comma-separated; the first is compared with the run "
                   "(default 3; with --sweep 3,1,2,4,5,6,7)")
    p.add_argument("--trees", default=None, help="trees as STEPS/TOPK/DRAFT_TOKENS, comma-separated (default none; "
                   f"with --sweep {','.join(DEFAULT_TREES)})")
    p.add_argument("--sweep", action="store_true", help="measure every chain length 1-7 and the default trees, and "
                   "recommend the fastest configuration per concurrency (serve/sweep.py)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for each server")
    p.add_argument("--server-arg", action="append", default=[], help="extra launch_server argument (repeat)")
    p.add_argument("--deterministic-parity", action="store_true",
                   help="also serve plain and EAGLE3 (first chain length) with --enable-deterministic-inference, "
                        "single-stream, and report their parity: a bf16 near-tie or a speculation bug")
    p.add_argument("--out", default="smoke")
    a = p.parse_args(argv)
    a.steps = [int(n) for n in (a.steps or ("3,1,2,4,5,6,7" if a.sweep else "3")).split(",")]
    trees = a.trees if a.trees is not None else ",".join(DEFAULT_TREES) if a.sweep else ""
    a.configs = [Spec(n, 1, n + 1) for n in a.steps] + [Spec(*map(int, t.split("/"))) for t in trees.split(",") if t]
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    from .dflash_dir import is_dflash_dir
    if is_dflash_dir(a.drafter):  # blocks of the drafter's own size: one configuration
        if a.sweep or a.trees or a.steps != [3]:
            p.error(f"{a.drafter} is a DFlash drafter: it drafts blocks of its own size (dflash_config.block_size); "
                    "--steps, --trees and --sweep choose EAGLE-3 configurations")
        block = json.loads((Path(a.drafter) / "config.json").read_text())["dflash_config"]["block_size"]
        a.configs, a.steps = [Block(block)], [block - 1]  # steps: drafts per verify, as the reference decoder counts
    try:
        spec_names(a.configs)
    except ValueError as e:
        p.error(str(e))
    return a


def prompt_groups(a: argparse.Namespace) -> dict[str, list[list[int]]]:
    """The prompts as token ids by group, tokenized as the reference decoder does, so both see the very same
    prompts: a run's held-out groups, a file's prompts, or a few defaults."""
    from transformers import AutoTokenizer

    from .decode import read_prompts
    if a.run:
        from .evaluate import heldout_prompts
        reference_decoding(a.run, a.drafter, a.steps[0])  # fail now, not after minutes of server start-up
        record = read_split(RunLayout(a.run).split)
        convs = {g: [(p.messages, p.tools) for p in heldout_prompts(record, g, a.limit)] for g in record["groups"]}
    elif a.prompts:
        convs = {"prompts": [(m, None) for m in read_prompts(a.prompts)[:a.limit]]}
    else:
        convs = {"default": [([{"role": "user", "content": q}], None) for q in DEFAULT_PROMPTS]}
    tok = AutoTokenizer.from_pretrained(a.target)
    return {g: [tok.apply_chat_template(m, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
                for m, tools in ms] for g, ms in convs.items() if ms}


def server_plan(a: argparse.Namespace) -> list[tuple[str, list[str], list[int]]]:
    """(name, launch_server args, concurrencies) of each server to measure, the plain baseline first."""
    mla = load_target_info(a.target).is_mla
    # the user's own graph sizes, if any, come last: they win
    common = ["--model-path", a.target, "--tp", str(a.tp), "--max-running-requests", str(max(a.concurrency) * 2),
              *decode_graph_args(a.concurrency), *a.server_arg]

    def eagle(spec: Spec) -> list[str]:
        return spec.flags(a.drafter) + \
            (["--speculative-draft-attention-backend", "triton"] if mla else [])  # the Llama drafter: not MLA's
    servers = [("baseline", common, a.concurrency)] + \
        [(name, common + eagle(spec), a.concurrency) for name, spec in zip(spec_names(a.configs), a.configs)]
    if a.deterministic_parity:  # batch-invariant kernels: a 4-token verify computes what a 1-token decode does
        deterministic = ["--enable-deterministic-inference"]
        servers += [("baseline_deterministic", common + deterministic, []),  # outputs only, not timed
                    (f"{spec_names(a.configs)[0]}_deterministic", common + eagle(a.configs[0]) + deterministic, [])]
    return servers


def run_servers(a: argparse.Namespace, groups: dict[str, list[list[int]]], out: Path) -> dict:
    """Each planned server started, measured and stopped in turn (or its saved measurements reused)."""
    report = {}
    settings = [a.max_new_tokens, a.repeats, a.pass_seconds, a.timing_max_new_tokens]
    for name, args, levels in server_plan(a):
        speculative = a.drafter in args
        key = server_key(server_command(a.port, args), groups, settings, levels, a.drafter if speculative else None)

        def serve_and_measure() -> dict:
            stopped: dict = {}
            with serving(args, a.port, out / f"server-{name}.log", a.timeout, stopped) as server:
                result = {"command": " ".join(server.cmd), "ready_s": server.ready_s,
                          "measured": measure(server, groups, a, levels, speculative)}
            return result | {"stopped": stopped}
        try:
            result = measured_once(out / f"server-{name}.json", key, serve_and_measure)
        except (RuntimeError, TimeoutError) as e:
            if name in ("baseline", "eagle3", "dflash"):  # the measurement itself
                raise
            # an extra configuration or check: the report keeps what the other servers measured, and why not this
            if name.endswith("_deterministic"):
                report.setdefault("deterministic", {"error": f"{name}: {str(e)[-2000:]}"})
            else:
                report[name] = {"error": str(e)[-2000:]}
            continue
        report |= {f"{name}_ready_s": result["ready_s"], name: result["measured"],
                   f"{name}_stopped": result["stopped"], f"{name}_command": result["command"]}
    return report


def parity(run: dict, baseline: dict) -> dict[str, float]:
    """Share of each group's prompts whose output equals the baseline's, and over all groups ('all')."""
    same = {g: [x == y for x, y in zip(baseline["groups"][g]["texts"], r["texts"])] for g, r in run["groups"].items()}
    every = [v for s in same.values() for v in s]
    return {g: sum(s) / len(s) for g, s in same.items()} | {"all": sum(every) / len(every)}


def compare(report: dict, a: argparse.Namespace) -> dict:
    """Parity with the plain server, speedups and verdicts per concurrency, and the cycle costs, per configuration;
    with several configurations, the fastest per concurrency (serve/sweep.py)."""
    base = report["baseline"]
    for name, spec in zip(spec_names(a.configs), a.configs):
        measured = report[name]
        if "error" in measured:
            continue
        timed = primary_group(measured["groups"])
        speedup = {c: ratio(measured["tokens_per_s"][c], base["tokens_per_s"][c]) for c in measured["tokens_per_s"]}
        measured |= {"chain": spec.label(), "flags": spec.flags(a.drafter), "parity": parity(measured, base),
                     "accept_length_by_group": {g: r["accept_length"] for g, r in measured["groups"].items()},
                     "speedup": speedup, "verdict": {c: verdict(r) for c, r in speedup.items()},
                     "costs": cycle_costs(base["step_ms"], measured["step_ms"],
                                          measured["groups"][timed]["accept_length"], spec.tokens - 1)}
    primary = spec_names(a.configs)[0]
    report["parity"] = report[primary]["parity"]["all"]
    report["verdict"] = report[primary]["verdict"]
    if len(a.configs) > 1:
        report["recommended"] = recommend(report, spec_names(a.configs), a.concurrency)
    if a.deterministic_parity and "deterministic" not in report:
        det = report[f"{primary}_deterministic"]
        report["deterministic"] = {
            "parity": parity(det, report["baseline_deterministic"])["all"],
            "accept_length": {g: r["accept_length"] for g, r in det["groups"].items()},
            "baseline_parity_with_default_kernels": parity(report["baseline_deterministic"], base)["all"]}
    report["accept_length_formula"] = "completion tokens / target verify steps (SGLang's spec_accept_length)"
    report["speedup_formula"] = ("median tokens/s over the repeats / the baseline's median; range: min/max and max/min "
                                 "of the repeats; a range that straddles 1.0 is no measurable difference")
    if a.run:
        report["reference"] = compare_with_run(a.run, a.drafter, a.steps[0], report[primary])
    return report


def print_report(report: dict, a: argparse.Namespace) -> None:
    base = report["baseline"]
    print(f"timing: {a.repeats} passes of >= {a.pass_seconds:g} s per concurrency, {a.timing_max_new_tokens} new "
          f"tokens a request; {report['speedup_formula']}")
    for name, spec in zip(spec_names(a.configs), a.configs):
        m = report[name]
        if "error" in m:
            print(f"{spec.label()}: not measured, the server failed: {m['error'][-300:]}")
            continue
        print(f"{m['chain']}: parity with the plain server " + ", ".join(f"{g} {v:.0%}" for g, v in m["parity"].items())
              + "; accept length " + ", ".join(f"{g} {v:.3f} ({m['groups'][g]['prompts']} prompts, "
                                                f"{m['groups'][g]['completion_tokens']} tokens)"
                                                for g, v in m["accept_length_by_group"].items() if v is not None))
        for c, tps in m["tokens_per_s"].items():
            b = base["tokens_per_s"][c]
            print(f"  concurrency {c:>4}: plain {b['median']:9.1f} tok/s ({b['min']:.1f}-{b['max']:.1f}), {name} "
                  f"{tps['median']:9.1f} ({tps['min']:.1f}-{tps['max']:.1f}) → {m['verdict'][c]}")
        costs = m["costs"]
        be = costs["break_even_accept_length"]
        print(f"  requests streamed alone: plain decode step {costs['plain_step_ms']['median']:.3f} ms, cycle "
              f"{costs['cycle_ms']['median']:.3f} ms (medians over {costs['cycle_ms']['n']} requests) → break-even "
              f"accept length {be['median']:.2f} ({be['min']:.2f}-{be['max']:.2f}), at most {spec.tokens}; limited by "
              f"{costs['limited_by']}")
    if "error" in report.get("deterministic", {}):
        print(f"--enable-deterministic-inference: no parity check, {report['deterministic']['error'][:300]}")
    elif "deterministic" in report:
        det = report["deterministic"]
        print(f"--enable-deterministic-inference, {a.configs[0].label()}: parity with its plain server "
              f"{det['parity']:.0%}; its plain output = the default plain output on "
              f"{det['baseline_parity_with_default_kernels']:.0%}")
    print_reference(report.get("reference", {}))
    if "recommended" in report:
        print_recommendations(report["recommended"])


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    a.server_arg += served_dtype_args(a.target, a.drafter, a.server_arg)  # now, not after server start-up
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    groups = prompt_groups(a)
    report = {"target": a.target, "drafter": a.drafter, "tp": a.tp, "steps": a.steps,
              "prompts": {g: len(p) for g, p in groups.items()}, "max_new_tokens": a.max_new_tokens,
              "timing": {"repeats": a.repeats, "pass_seconds": a.pass_seconds,
                         "max_new_tokens": a.timing_max_new_tokens, "prompts": primary_group(groups)},
              "environment": environment(), "gpu_memory_before_mib": gpu_memory_used_mib(),
              "target_match": target_match(a.drafter, a.target)}
    if report["target_match"]["same_target"] is False:
        print(f"[smoke] note: {a.drafter}: {report['target_match']['note']}", flush=True)
    report = compare(report | run_servers(a, groups, out), a)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print_report(report, a)
    print(f"report: {out / 'report.json'}")
    return report


if __name__ == "__main__":
    main()
