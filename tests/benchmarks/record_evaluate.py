"""serve.evaluate's report of several drafters on one run's held-out prompts and target, grouped into variants (one
drafter per seed), as one results file of kind `drafter_options`, rendered as compare_options.py's are. For drafters
that differ in what compare_options.py cannot vary within one run directory: the target whose features trained
them, say (a drafter trained on an INT4 target's features and one on its bf16 original's, both evaluated on the
INT4 target; launch/configs/demo-int4.yaml says how they are made):

    python -m serve.evaluate --drafter A_SEED0 --drafter A_SEED1 ... --drafter B_SEED0 ... --run RUN \\
        --decode 16 --decode-steps 3 --out DIR
    python tests/benchmarks/record_evaluate.py DIR/evaluate.json --variant "A=A_SEED0,A_SEED1,A_SEED2" \\
        --variant "B=B_SEED0,B_SEED1,B_SEED2" --seeds 0,1,2 --how "B=what B's training changed" \\
        --trained "how every variant was trained" --config CONFIG --record NAME-DATE --command "..." [--note "..."]

A variant's difference to the first is paired by seed. The reference decoder's figures are those serve.evaluate's
`--decode` measured (its chain, on the first group's prompts); each drafter's training steps come from its run's
report (DRAFTER/../report.json).
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from data.environment import environment  # noqa: E402
from data.split import primary_group  # noqa: E402
from launch.pipeline import eagle3_group_figures  # noqa: E402
from record_mission import RESULTS, write_record  # noqa: E402  (this script's folder is on sys.path)


def drafter_run(report: dict, drafter: str, seed: int) -> dict:
    """One drafter's figures in compare_options.py's shape (what render_results.render_drafter_options reads), each
    group's as the pipeline's report gives them."""
    decoded = report["decode"][drafter]
    steps = next(iter(decoded.values()))["steps"]
    groups = {g: eagle3_group_figures(report, drafter, g, steps) for g in report["groups"] if g in decoded}
    group = primary_group(groups)
    trained = json.loads((Path(drafter).parent / "report.json").read_text())["train"]
    return {"seed": seed, "drafter": drafter, "accept_length": groups[group]["reference_decoder"],
            "offline_accept_length": groups[group]["offline_same_prompts"],
            "formula": f"{decoded[group]['accept_length_formula']}, {decoded[group]['chain']}, greedy, on the "
                       f"'{group}' held-out group's first prompts, served by {report['target']}",
            "heldout_overlap_with_training": report["heldout_overlap_with_training"],
            "train_steps": trained["steps"], "lossless": all(d["identical_to_greedy"] for d in decoded.values()),
            "groups": groups}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", help="serve.evaluate's evaluate.json, run with --decode")
    p.add_argument("--variant", action="append", required=True, metavar="NAME=DRAFTER,DRAFTER,...",
                   help="a variant and its drafters, one per seed in --seeds order; the first variant is the one "
                        "the others are compared with")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--how", action="append", default=[], metavar="NAME=TEXT", help="what a variant's training changed")
    p.add_argument("--trained", required=True, help="how every variant was trained (the table's first sentence)")
    p.add_argument("--config", required=True, help="the configuration the drafters were trained from")
    p.add_argument("--record", required=True, help="the results file's name")
    p.add_argument("--command", action="append", required=True, help="each command that made the drafters and report")
    p.add_argument("--note", action="append", default=[], help="what a reader must know (repeat)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    report = json.loads(Path(a.report).read_text())
    seeds = [int(s) for s in a.seeds.split(",")]
    how = dict(item.split("=", 1) for item in a.how)
    variants = {}
    for spec in a.variant:
        name, drafters = spec.split("=", 1)
        drafters = drafters.split(",")
        if len(drafters) != len(seeds):
            p.error(f"{name}: {len(drafters)} drafters for {len(seeds)} seeds: one per seed")
        missing = [d for d in drafters if d not in report["decode"]]
        if missing:
            p.error(f"{name}: {missing} not decoded in {a.report} (run serve.evaluate with --decode and every drafter)")
        variants[name] = {"overrides": [how[name]] if name in how else [],
                          "runs": [drafter_run(report, d, s) for d, s in zip(drafters, seeds)]}
    steps = {run["train_steps"] for v in variants.values() for run in v["runs"]}
    if len(steps) != 1:
        p.error(f"the drafters trained for different numbers of steps ({sorted(steps)}): not a paired comparison")
    measured_at = environment()
    record = {"name": a.record, "kind": "drafter_options", "date": date.today().isoformat(), "commands": a.command,
              "commit": measured_at["commit"], "environment": measured_at, "notes": a.note, "invalid": {},
              "results": {"config": a.config, "extra_arguments": [], "seeds": seeds, "trained": a.trained,
                          "target": report["target"], "variants": variants}}
    return write_record(record, a.out)


if __name__ == "__main__":
    main()
