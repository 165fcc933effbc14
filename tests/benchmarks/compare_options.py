"""Train one drafter with and without options on the same data and seeds, and compare its held-out accept lengths
(e.g. EAGLE-3.1's fc_norm / norm_output against plain EAGLE-3). Writes one results file of kind `drafter_options`.

    python tests/benchmarks/compare_options.py --config launch/configs/demo.yaml --run-dir runs/options \\
        --variant plain= --variant fc_norm=--train.drafter.fc_norm=true --seeds 0,1,2 \\
        --record eagle31-demo-DATE [--stages data,extract,train] [--note "..."] [-- extra pipeline arguments]

DFlash drafters alike, e.g. `--variant tokens= --variant teacher=--train.dflash.labels=teacher ... --
--train.drafter.family=dflash` (their offline figure is the block accept length instead of tau).

Each (variant, seed) is one pipeline invocation (data,extract,train,export,evaluate) on the same run directory:
data and extract run once, since their inputs do not change; train, export and evaluate run again for each (the
pipeline sets the previous drafter run aside as RUN/train.prev-N: delete those where disk is short). With
`--stages data,extract,train` each drafter is scored by its training evaluation alone (every held-out sample, in
the unroll it trains with; an EAGLE-3 drafter's figure): on the mission target the export and evaluate stages it
skips are a third of a variant's time (57 + 114 s of 484 on an H100), the figures they give read "not run". Each
report is kept as RUN/options/VARIANT-seedS.json, and an invocation whose report exists is not run again (a
comparison cut off by a time limit resumes, and a variant added later runs alone). Every variant of a seed runs
before the next seed, and the record is rewritten after each seed, so one cut off by a time limit holds whole
pairs. A variant's difference to the first variant is paired by seed: same data, same initialisation seed, same
steps.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from data.config import load_config  # noqa: E402
from data.environment import environment  # noqa: E402
from record_mission import RESULTS, write_record  # noqa: E402  (this script's folder is on sys.path)

STAGES = "data,extract,train,export,evaluate"


def run_variant(config: str, run_dir: Path, overrides: list[str], seed: int, extra: list[str], stages: str) -> dict:
    command = [sys.executable, "-m", "launch.pipeline", "--config", config, "--run_dir", str(run_dir),
               "--stages", stages, "--seed", str(seed), *overrides, *extra]
    print(f"[options] {shlex.join(command)}", flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    return json.loads((run_dir / "report.json").read_text())


def summary(report: dict) -> dict:
    """What one drafter scored: the reference decoder's accept length on the primary group's prompts and, per
    group, the offline figure over every held-out position: an EAGLE-3 drafter's tau by chain length, a DFlash
    drafter's block accept length. A run whose evaluate stage did not run has its training evaluation alone: the
    other figures are None (the table's "not run")."""
    def offline(group: str, v: dict) -> dict:
        if "offline_tau_by_steps" in v:
            return {k: v[k] for k in ("offline_tau_by_steps", "heldout_tokens")}
        return {"offline_blocks": v["offline_blocks"], "heldout_tokens": report["heldout"]["groups"][group]["tokens"]}
    trained = {"commit": report["commit"], "train_steps": report["train"]["steps"],
               "heldout_overlap_with_training": report["split"]["heldout_overlap_with_training"],
               "training_heldout": training_heldout(report["train"])}
    if "accept_length" not in report:
        return trained | {"accept_length": None, "offline_accept_length": None, "formula": None, "lossless": None,
                          "groups": {}}
    return trained | {
        "accept_length": report["accept_length"], "offline_accept_length": report["offline_accept_length"],
        "formula": report["accept_length_formula"], "lossless": report["lossless"],
        "groups": {g: {k: v[k] for k in ("prompts", "completion_tokens", "reference_decoder", "heldout_samples")}
                   | offline(g, v) for g, v in report["accept_length_by_group"].items()}}


def training_heldout(train_summary: dict) -> dict | None:
    """The training run's last evaluation (train/summary.json's `eval`): every held-out sample of every group,
    scored by the TTT unroll the drafter trains with. It exists once training ends, so a variant whose evaluate
    stage was cut off still has this figure."""
    ev = train_summary.get("eval")
    if not ev or "chains" not in ev:  # a DFlash drafter's evaluation counts blocks, not chains
        return None
    steps = sum(k.startswith("p_accepted_through_step") for k in ev)
    return {"accept_length": ev["accept_length"], "chains": ev["chains"], "tokens": ev["tokens"], "steps": steps,
            "acc_step0": ev["acc_step0"],
            "formula": f"1 + sum over k < {steps} of P(drafts 0..k all equal the target's argmax), per held-out "
                       "position, in the unroll the drafter trains with (train/ttt.py's accept_length)"}


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--variant", action="append", required=True, metavar="NAME=OVERRIDES",
                   help="a name and its pipeline overrides (space-separated; empty for the baseline); the first "
                        "variant is the one the others are compared with")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--stages", default=STAGES, choices=[STAGES, "data,extract,train"],
                   help="data,extract,train: score each drafter by its training evaluation alone (EAGLE-3)")
    p.add_argument("--record", required=True, help="the results file's name")
    p.add_argument("--note", action="append", default=[], help="what a reader must know (repeat)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    variants = dict((v.split("=", 1)[0], v.split("=", 1)[1].split()) for v in a.variant)
    seeds = [int(s) for s in a.seeds.split(",")]
    for name, overrides in variants.items():  # before any training: a figure this comparison could not give
        family = load_config(a.config, [*overrides, *extra]).train.drafter.family
        if "evaluate" not in a.stages and family != "eagle3":
            p.error(f"variant {name}: a {family} drafter's training evaluation counts blocks, not the chains this "
                    "table compares: run it with the evaluate stage (the default --stages)")
    measured_at = environment()  # now: the commit that trains, not whatever HEAD is when the last run ends
    run_dir = Path(a.run_dir)
    kept = run_dir / "options"
    kept.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", str(Path(__file__).relative_to(ROOT)), *argv])
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for done, seed in enumerate(seeds, start=1):
        for name, overrides in variants.items():
            path = kept / f"{name}-seed{seed}.json"
            if not path.exists():  # kept with the commit that trained it: a resumed comparison may span commits
                report = run_variant(a.config, run_dir, overrides, seed, extra, a.stages)
                path.write_text(json.dumps(report | {"commit": measured_at["commit"]}, indent=1))
            runs[name].append({"seed": seed} | summary(json.loads(path.read_text())))
        # what a comparison cut off later measured is a record too; its seeds say how far it came
        out = write_record({"name": a.record, "kind": "drafter_options", "date": date.today().isoformat(),
                            "commands": [command], "commit": measured_at["commit"], "environment": measured_at,
                            "notes": a.note, "invalid": {},
                            "results": {"config": a.config, "extra_arguments": extra, "seeds": seeds[:done],
                                        "variants": {name: {"overrides": variants[name], "runs": runs[name]}
                                                     for name in variants}}}, a.out)
    return out


if __name__ == "__main__":
    main()
