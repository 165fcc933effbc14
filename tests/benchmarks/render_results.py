"""Render tests/benchmarks/RESULTS.md from the results files in tests/benchmarks/results/ (one JSON per measurement:
commands, commit, device, versions, every repeat). Edit the JSON (or rerun the benchmark), never RESULTS.md: a test
(tests/test_results.py) fails when the file differs from what this renders.

    python tests/benchmarks/render_results.py           # rewrites RESULTS.md
    python tests/benchmarks/render_results.py --check   # exit 1 when RESULTS.md is stale

A figure is a median with its min-max over the repeats; a speedup is median over median, its range pairing the
extremes, and "no measurable difference" when that range holds 1.0. Each kind of results file has a renderer below
(RENDERERS); a new benchmark is a recorder writing its JSON plus a renderer here.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))  # run as a script: the repository root, for serve.timing
from serve.timing import NO_DIFFERENCE, ratio, spread, verdict  # noqa: E402  the smoke test's own rule for a speedup
RESULTS, OUT = HERE / "results", HERE / "RESULTS.md"
HEADER = """# Benchmark results

Rendered by `python tests/benchmarks/render_results.py` from the JSON files in `tests/benchmarks/results/` (each holds
the commands, the commit, the device, the library versions and every repeat); do not edit by hand. Figures are
medians with their min-max over the repeats; a speedup is the median over the baseline's median, its range pairing
the repeats' extremes, and a range that holds 1.0 reads "no measurable difference". Ratios are taken within one
run on one machine. Measurements recorded before results files existed are in this file's git history (up to commit
9919528); nothing quotes them.
"""


def fmt(s: dict, digits: int = 1) -> str:
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"


def speedup(eagle: list[float], base: list[float]) -> str:
    return verdict(ratio(spread(eagle), spread(base)))


def provenance(record: dict) -> list[str]:
    env = record["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    lines = [f"Recorded {record['date']} from `tests/benchmarks/results/{record['name']}.json`; commit "
             f"`{record['commit'][:10]}`; device: {'; '.join(env['device'])} ({env['cpu_count']} CPU cores); "
             f"Python {env['python']}, {versions}.", "", "Commands:"]
    lines += [f"- `{c}`" for c in record["commands"]]
    lines += [""] + [f"Note: {n}" for n in record.get("notes", [])]
    lines += [f"Not to be quoted: `{k}`: {why}." for k, why in record.get("invalid", {}).items()]
    return lines + [""]


def render_mission(record: dict) -> list[str]:
    r = record["results"]
    split, prompts, target = r["split"], r["prompts"], r["target"]
    out = [f"## Mission-scale run ({record['date']})", ""] + provenance(record)
    out += ["### Data and split", "",
            f"- Target (`launch/mission_target.py`): {target['parameters']:,} parameters, {target['step']:,} steps, "
            f"{target['tokens']:,} tokens, final loss {target['final_loss']}, {target['tokens_per_s_this_run']:,} "
            f"tokens/s ({target['model_tflops_this_run']} model TFLOP/s, compiled: {target['compiled']}); trained on "
            f"{target['dialogues']:,} dialogues and the stdlib sources ({target['corpus_tokens']:,} tokens).",
            f"- Drafter prompts: {prompts['drafter_rows']:,} rows, {prompts['drafter_distinct_prompts']:,} distinct "
            f"({prompts['rows_by_group']}); occurring in the target's own dialogues: "
            f"{prompts['drafter_prompts_in_target_dialogues']}. Rule: {prompts['rule']}.",
            f"- Split (`data/split.py`, fraction {split['fraction']}): {split['conversations_read']:,} read, "
            f"{split['distinct_conversations']:,} distinct, excluded {split['excluded'] or 'none'}; "
            f"{split['training_samples']:,} training / {split['heldout_samples']} held-out samples "
            f"({split['heldout_prompts']} distinct held-out prompts; groups {split['groups']}); "
            f"**held-out overlap with training: {split['heldout_overlap_with_training']}**. Rule: {split['rule']}.",
            f"- Data: {r['data']['rows']:,} samples, {r['data']['tokens']:,} tokens ({r['data']['loss_tokens']:,} "
            f"with loss); training {r['train']['steps']} steps, {r['train']['tokens']:,} tokens.",
            "- Stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items()) + ".", ""]
    out += [f"### Accept length by held-out group ({r['chain']})", "",
            "Tokens per target verify step (SGLang's `spec_accept_length`): completion tokens / verify steps over the "
            "group's first prompts (64 new tokens each; deterministic counts of one greedy pass, so no repeats). "
            "Offline (same prompts): their stored answers decoded on their features; offline tau: mean over every "
            "held-out position of the group.", "",
            "| group | prompts (tokens) | SGLang | reference decoder | offline, same prompts | offline tau, all "
            "positions | untrained drafter (reference) | output = plain server | = reference decoder |",
            "|---|---|---|---|---|---|---|---|---|"]
    for group, a in r["accept_length"].items():
        out.append(f"| {group} ({a['heldout_samples']} held-out samples) | {a['prompts']} ({a['completion_tokens']}) | "
                   f"**{a['sglang']:.3f}** | {a['reference_decoder']:.3f} | {a['offline_same_prompts']:.3f} | "
                   f"{a['offline_tau']:.3f} | {a['reference_decoder_untrained']:.3f} | "
                   f"{a['parity_with_plain_server']:.0%} | {a['token_parity_with_reference_decoder']:.0%} |")
    return out + throughput_lines(record)


def throughput_lines(record: dict) -> list[str]:
    """The plain-vs-EAGLE3 table and the measured step costs of a smoke test's results."""
    r, t = record["results"], record["results"]["timing"]
    out = ["", f"### Throughput, plain vs EAGLE3 ({r['chain']})", "",
           f"Tokens/s, {len(next(iter(r['throughput'].values()))['baseline'])} passes of at least "
           f"{t['pass_seconds']:g} s per server and concurrency (c clients, each sending the '{t['prompts']}' "
           f"prompts in turn, {t['max_new_tokens']} new tokens at most, greedy):", "",
           "| concurrency | plain | EAGLE3 | speedup |", "|---|---|---|---|"]
    for c, v in r["throughput"].items():
        out.append(f"| {c} | {fmt(spread(v['baseline']))} | {fmt(spread(v['eagle3']))} | "
                   f"{speedup(v['eagle3'], v['baseline'])} |")
    costs = "step_costs" in record.get("invalid", {})
    if costs:
        return out + ["", "Plain decode step and speculative cycle: not measured by this run (see above).", ""]
    step, cycle = r["step_costs"]["plain_step_ms"], r["step_costs"]["cycle_ms"]
    even = ratio(cycle, step)  # a cycle pays for itself once it emits as many tokens as the steps it costs
    accepts = ", ".join(f"{g} {a['sglang']:.3f}" for g, a in r["accept_length"].items())
    return out + ["", f"Plain decode step and speculative cycle, each timed on a request streamed alone "
                      f"({len(cycle['repeats'])} repeats): step {fmt(step, 3)} ms, cycle {fmt(cycle, 3)} ms; a cycle "
                      f"costs {fmt(even, 2)} plain steps, the break-even accept length (accept length above: {accepts}).",
                  ""]


def accept_cells(group: str, a: dict) -> str:
    """One held-out group's accept-length cells of a served drafter: prompts (tokens), SGLang's accept length, the
    reference decoder's where it ran, and output parity with the plain server and with the reference decoder."""
    reference = f"{a['reference_decoder']:.3f}" if "reference_decoder" in a else ""
    same = f"{a['token_parity_with_reference_decoder']:.0%}" if "reference_decoder" in a else ""
    return (f"{group} | {a['prompts']} ({a['completion_tokens']}) | **{a['sglang']:.3f}** | {reference} | "
            f"{a['parity_with_plain_server']:.0%} | {same}")


def render_smoke(record: dict) -> list[str]:
    """One EAGLE-3 drafter beside the plain server: the files record_smoke.py wrote before it wrote kind `served`."""
    r = record["results"]
    out = [f"## SGLang smoke test: {r['target']} with {r['drafter']} ({record['date']})", ""] + provenance(record)
    out += [f"### Accept length ({r['chain']})", "",
            "Tokens per target verify step (SGLang's `spec_accept_length`): completion tokens / verify steps over "
            "each group's prompts, one greedy pass.", "",
            "| group | prompts (tokens) | SGLang | reference decoder | output = plain server | = reference decoder |",
            "|---|---|---|---|---|---|"]
    out += [f"| {accept_cells(group, a)} |" for group, a in r["accept_length"].items()]
    return out + throughput_lines(record)


def render_served(record: dict) -> list[str]:
    """Drafters served by SGLang on one target, each beside the same plain server (tests/benchmarks/record_smoke.py)."""
    r, t = record["results"], record["results"]["timing"]
    rows, base = r["drafters"], r["baseline"]
    out = [f"## SGLang serving on {r['target']}: " + ", ".join(d["label"] for d in rows) + f" ({record['date']})", ""]
    out += provenance(record) + [
        "### Accept length by held-out group", "",
        "Tokens per target verify step (SGLang's `spec_accept_length`): completion tokens / verify steps over each "
        "group's prompts, one greedy pass (deterministic counts, so no repeats).", "",
        "| drafter | served as | group | prompts (tokens) | SGLang | reference decoder | output = plain server | "
        "= reference decoder |", "|---|---|---|---|---|---|---|---|"]
    out += [f"| {d['label']} | {d['chain']} | {accept_cells(group, a)} |"
            for d in rows for group, a in d["accept_length"].items()]
    passes = len(next(iter(base["throughput"].values())))
    out += ["", "### Throughput", "",
            f"Tokens/s, {passes} passes of at least {t['pass_seconds']:g} s per server and concurrency (c clients, "
            f"each sending the '{t['prompts']}' prompts in turn, {t['max_new_tokens']} new tokens at most, greedy); "
            "every drafter's speedup is over the same plain server's passes:", "",
            "| concurrency | plain | " + " | ".join(f"{d['label']} | speedup" for d in rows) + " |",
            "|---|---|" + "---|---|" * len(rows)]
    for c, plain in base["throughput"].items():
        cells = [f"{fmt(spread(d['throughput'][c]))} | {speedup(d['throughput'][c], plain)}" for d in rows]
        out.append(f"| {c} | {fmt(spread(plain))} | " + " | ".join(cells) + " |")
    step = base["step_ms"]
    out += ["", f"Plain decode step and speculative cycle, {step['n']} repeats ({r['costs_how']}): plain step "
                f"{fmt(step, 3)} ms."]
    for d in rows:
        even = d["break_even_accept_length"]
        accepts = ", ".join(f"{a['sglang']:.3f}" for a in d["accept_length"].values())
        out.append(f"- {d['label']}: cycle {fmt(d['cycle_ms'], 3)} ms = {fmt(even, 2)} plain steps, the break-even "
                   f"accept length (measured: {accepts}); {d['limited_by']}.")
    other = [d for d in rows if d["target_match"].get("same_target") is False]
    if other:  # serve.smoke's flag: the drafter learned another copy's states than the target it was served on
        out += ["", "Served on another copy of the target than the one whose features trained it:"]
        out += [f"- {d['label']}: {d['target_match']['note']}." for d in other]
    if "feature_parity" in r:
        f = r["feature_parity"]
        out += ["", f"### Features: `{f['a']}` against `{f['b']}`", "",
                f"`python -m extract.parity` over {f['samples']} samples ({' vs '.join(f['dtypes'])}): per token, the "
                "cosine similarity of the two hidden states (mean and minimum over tokens) and the largest absolute "
                "difference of any element.", "", "| state | cosine mean | cosine min | max abs difference |",
                "|---|---|---|---|"]
        out += [f"| {name} | {v['cosine_mean']:.5f} | {v['cosine_min']:.4f} | {v['max_abs_diff']:.3g} |"
                for name, v in f["layers"].items()]
    return out + [""]


def render_train_step(record: dict) -> list[str]:
    r = record["results"]
    shapes = ", ".join(dict.fromkeys(row["shape"] for row in r["rows"]))
    dflash = any(row["peer"].endswith("-dflash") for row in r["rows"])
    family = "DFlash drafter" if dflash else "Drafter"
    out = [f"## {family} training step, side by side with SpecForge: {shapes} ({record['date']}, "
           f"{record['commit'][:7]})", ""]
    out += provenance(record)
    if dflash:
        settings = {(row["block_size"], row["anchors"]) for row in r["rows"] if "block_size" in row}
        blocks = "; ".join(f"blocks of {size} at {anchors} anchors" for size, anchors in sorted(settings))
        out += [f"DFlash steps: {blocks or 'block settings not recorded'}, tokens/s counting the T context tokens "
                "(tests/benchmarks/dflash_peers.py says what each peer runs).", ""]
    out += [f"One GPU; each peer in a process of its own on the same random inputs; {r['steps']} timed steps per row "
            "after an untimed one: tokens/s median (min-max over the steps), the ratio to Eyrie's (Eyrie / peer, "
            "median over median, range pairing the extremes). Peak: max allocated over the timed steps, weights and "
            "optimizer state included. MFU: useful FLOPs / step time against the bf16 matmul rate measured in the "
            f"row's process and against the dense bf16 peak ({r['dense_bf16_peak_tflops']:g} TFLOP/s).", "",
            "Peak / SpecForge's lower: the row's peak over the lower of SpecForge's peaks at that shape and "
            "length (default and compact_teacher where both ran), the figure the memory goal is judged by.", "",
            "| shape | T | peer | tokens/s | Eyrie / peer | peak GiB | peak / SpecForge's lower | resident GiB | "
            "MFU (measured rate) | MFU (dense peak) |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [row for row in r["rows"] if "error" not in row]
    shapes, peers = list(dict.fromkeys(row["shape"] for row in rows)), list(dict.fromkeys(row["peer"] for row in rows))
    rows.sort(key=lambda row: (shapes.index(row["shape"]), row["T"], not row["peer"].startswith("eyrie"),
                               peers.index(row["peer"])))
    for row in rows:
        same = [e for e in rows if e["shape"] == row["shape"] and e["T"] == row["T"]]
        eyrie = same[0] if same[0]["peer"].startswith("eyrie") else None  # the first Eyrie step the command ran
        versus = "" if eyrie is None or row is eyrie else \
            speedup([row["T"] / t for t in eyrie["step_seconds"]], [row["T"] / t for t in row["step_seconds"]])
        specforge_peaks = [e["peak_gib"] for e in same if e["peer"].startswith("specforge")]
        memory = f"{row['peak_gib'] / min(specforge_peaks):.2f}" if specforge_peaks else ""
        out.append(f"| {row['shape']} | {row['T']:,} | {row['peer']} | {row['tokens_per_s']:,} "
                   f"({row['tokens_per_s_min']:,}-{row['tokens_per_s_max']:,}) | {versus} | {row['peak_gib']} | "
                   f"{memory} | {row['resident_gib']} | {row['mfu']:.1%} of {row['peak_bf16_matmul_tflops']:g} | "
                   f"{row['mfu_of_dense_peak']:.1%} |")
    out += [f"- {row['peer']} {row['shape']} T={row.get('T', '-')}: {row['error']}" for row in r["rows"]
            if "error" in row]
    return out + [""]


def render_drafter_options(record: dict) -> list[str]:
    """Accept lengths of one drafter trained with and without options (tests/benchmarks/compare_options.py). A
    run whose evaluate stage did not finish (or was not asked for) has only its training evaluation: its other
    cells read "not run", and a comparison where no run was evaluated shows the training evaluation alone."""
    r = record["results"]
    variants = r["variants"]
    base_name = next(iter(variants))
    base = {run["seed"]: run for run in variants[base_name]["runs"]}
    first = base[r["seeds"][0]]
    every_run = [run for v in variants.values() for run in v["runs"]]
    evaluated = next((run for run in every_run if run["groups"]), None)  # names the groups and the formula
    columns, how = [], []
    if evaluated:
        group = next(iter(evaluated["groups"]))
        tokens = evaluated["groups"][group]["heldout_tokens"]
        if "offline_tau_by_steps" in evaluated["groups"][group]:  # an EAGLE-3 drafter: tau at the longest chain
            offline_name = "offline tau"
            offline_value = lambda run: run["groups"][group]["offline_tau_by_steps"][-1]
            offline_how = (f"Offline tau: over every position of the '{group}' held-out group ({tokens:,} tokens), "
                           f"{len(evaluated['groups'][group]['offline_tau_by_steps'])} steps.")
        else:  # a DFlash drafter: its block accept length on the stored samples
            offline_name = "offline block accept length"
            offline_value = lambda run: run["groups"][group]["offline_blocks"]
            offline_how = (f"Offline block accept length: 1 + drafts of a block equal to the sample's tokens in a "
                           f"row, over blocks anchored in the '{group}' held-out group's samples ({tokens:,} tokens).")
        columns += [("accept length, reference decoder", lambda run: run["accept_length"]),
                    (offline_name, lambda run: offline_value(run) if run.get("groups") else None)]
        how += [f"Reference decoder: {evaluated['formula']}.", offline_how]
    training = next((run["training_heldout"] for run in every_run if run.get("training_heldout")), None)
    if training:  # every held-out sample of every group, as training scored them
        columns.append((f"held-out accept length, training evaluation ({training['steps']} steps)",
                        lambda run: (run.get("training_heldout") or {}).get("accept_length")))
        how.append(f"Training evaluation: {training['formula']}, over {training['chains']:,.0f} positions "
                   f"({training['tokens']:,.0f} tokens) of every held-out group.")
    title = f"Drafters compared on `{r['target']}`" if "target" in r else "Drafter options compared"
    out = [f"## {title}: `{r['config']}` ({record['date']})", ""] + provenance(record)
    every = f" with `{' '.join(r['extra_arguments'])}`" if r["extra_arguments"] else ""
    trained = r.get("trained") or (f"Each variant trained once per seed ({', '.join(map(str, r['seeds']))}){every} "
                                   "on the same data and features")  # record_evaluate.py's variants say their own
    out += [f"{trained}, for the same steps ({first['train_steps']}), held-out overlap with training "
            f"{max(run['heldout_overlap_with_training'] for run in every_run)}. {' '.join(how)} Medians (min-max) "
            f"over the seeds; the difference to `{base_name}` is paired by seed, and a range that holds 0 reads "
            f"\"no measurable difference\"."
            + (" One seed: no spread, so no difference here is established." if len(r["seeds"]) == 1 else ""), "",
            "| variant | overrides | " + " | ".join(f"{name} | difference" for name, _ in columns) + " |",
            "|---|---|" + "---|---|" * len(columns)]

    def paired(runs: list[dict], value) -> tuple[str, str]:
        measured = [run for run in runs if value(run) is not None]
        if not measured:
            return "not run", ""
        values = spread([value(run) for run in measured])
        shown = fmt(values, 3) if len(measured) > 1 else f"{values['median']:.3f} (one seed)"
        if runs is variants[base_name]["runs"]:
            return shown, ""
        pairs = [value(run) - value(base[run["seed"]]) for run in measured if value(base[run["seed"]]) is not None]
        if not pairs:
            return shown, ""
        diffs = spread(pairs)
        if len(pairs) == 1:
            return shown, f"{diffs['median']:+.3f} (one seed: no spread)"
        held = diffs["min"] <= 0 <= diffs["max"]
        return shown, (f"{NO_DIFFERENCE}: " if held else "") + f"{diffs['median']:+.3f} " \
            f"({diffs['min']:+.3f} to {diffs['max']:+.3f})"
    for name, v in variants.items():
        cells = [cell for _, value in columns for cell in paired(v["runs"], value)]
        out.append(f"| {name} | `{' '.join(v['overrides']) or '-'}` | " + " | ".join(cells) + " |")
    return out + [""]


RENDERERS = {"mission": render_mission, "served": render_served, "smoke": render_smoke,
             "train_step": render_train_step, "drafter_options": render_drafter_options}


def render(results: Path = RESULTS) -> str:
    records = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    lines = [HEADER]
    for kind in RENDERERS:  # a section per kind, newest first
        for record in sorted((r for r in records if r["kind"] == kind), key=lambda r: r["date"], reverse=True):
            lines += RENDERERS[kind](record)
    unknown = {r["kind"] for r in records} - set(RENDERERS)
    if unknown:
        raise SystemExit(f"no renderer for results of kind {sorted(unknown)}: add one to RENDERERS")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when RESULTS.md differs from the rendering")
    a = p.parse_args(argv)
    text = render()
    if a.check:
        stale = not OUT.exists() or OUT.read_text() != text
        print(f"{OUT}: {'stale: run python tests/benchmarks/render_results.py' if stale else 'up to date'}")
        return int(stale)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
