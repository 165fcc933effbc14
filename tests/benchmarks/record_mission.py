"""Turn what a mission run brought back (tests/benchmarks/mission.sh: results.tar.gz unpacked) into one results file.

    python tests/benchmarks/record_mission.py UNPACKED_DIR --commit SHA --command "..." [--command "..."]
                                              [--note "..."] [--out tests/benchmarks/results]

UNPACKED_DIR holds runs/mission/... as the archive stores it. The file keeps the commands, the commit the machine ran,
its device and library versions (the smoke report's), and every repeat; RESULTS.md is rendered from it
(tests/benchmarks/render_results.py).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def mission_results(root: Path) -> dict:
    run = root / "runs" / "mission"
    smoke, evaluate = load(run / "smoke" / "report.json"), load(run / "evaluate" / "evaluate.json")
    split = {k: v for k, v in load(run / "data" / "split.json").items() if k != "heldout"}
    target = load(run / "assets" / "target" / "training.json")
    samples = load(run / "data" / "samples" / "manifest.json")["totals"]
    summary = load(run / "train" / "summary.json")
    trained, untrained = str(Path("runs/mission/drafter")), str(Path("runs/mission/drafter-untrained"))
    steps = smoke["steps"][0]
    accept = {}
    for group in evaluate["groups"]:
        decoded, offline = evaluate["decode"][trained][group], evaluate["drafters"][trained][group]
        served = smoke["eagle3"]["groups"][group]
        accept[group] = {
            "prompts": served["prompts"], "completion_tokens": served["completion_tokens"],
            "sglang": served["accept_length"], "reference_decoder": decoded["accept_length"],
            "offline_same_prompts": offline["prompts"]["decoded_accept_length_by_steps"][steps - 1],
            "offline_tau": offline["accept_length_by_steps"][steps - 1],
            "reference_decoder_untrained": evaluate["decode"][untrained][group]["accept_length"],
            "heldout_samples": evaluate["groups"][group]["samples"],
            "heldout_tokens": evaluate["groups"][group]["tokens"],
            "parity_with_plain_server": smoke["eagle3"]["parity"][group],
            "token_parity_with_reference_decoder": smoke["reference"][group]["token_parity_with_reference_decoder"],
            "reference_decoder_identical_to_greedy": decoded["identical_to_greedy"]}
    throughput = {c: {"baseline": [p["tokens_per_s"] for p in smoke["baseline"]["passes"][c]],
                      "eagle3": [p["tokens_per_s"] for p in smoke["eagle3"]["passes"][c]],
                      "baseline_passes": smoke["baseline"]["passes"][c], "eagle3_passes": smoke["eagle3"]["passes"][c]}
                  for c in smoke["eagle3"]["passes"]}
    return {"chain": f"{steps} steps / top-k 1 / {steps + 1} draft tokens, greedy",
            "target": {k: target[k] for k in ("parameters", "step", "tokens", "tokens_per_s_this_run",
                                              "model_tflops_this_run", "compiled", "corpus_tokens", "dialogues")}
            | {"final_loss": target["losses"][-1][1]},
            "prompts": load(run / "assets" / "prompts.json"), "split": split,
            "data": {k: samples[k] for k in ("rows", "tokens", "loss_tokens")},
            "stage_seconds": {s: load(run / "pipeline" / f"{s}.json")["seconds"]
                              for s in ("regenerate", "data", "extract", "train", "export", "evaluate", "smoke")},
            "train": {"steps": summary["steps"], "tokens": summary["tokens"]},
            "accept_length": accept, "timing": smoke["timing"], "throughput": throughput,
            "step_costs": {"plain_step_ms": smoke["baseline"]["step_ms"], "cycle_ms": smoke["eagle3"]["step_ms"]}}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("unpacked")
    p.add_argument("--commit", required=True, help="the commit the machine's tree was (EYRIE_COMMIT)")
    p.add_argument("--command", action="append", required=True, help="each device command, in order")
    p.add_argument("--date", required=True)
    p.add_argument("--note", action="append", default=[], help="what a reader must know (repeat)")
    p.add_argument("--invalid", action="append", default=[], metavar="KEY=WHY",
                   help="a measurement in the file that must not be quoted, and why")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    root = Path(a.unpacked)
    environment = load(root / "runs" / "mission" / "smoke" / "report.json")["environment"]
    record = {"name": f"mission-{a.date}", "kind": "mission", "date": a.date, "commands": a.command,
              "commit": a.commit, "environment": environment | {"commit": a.commit}, "notes": a.note,
              "invalid": dict(item.split("=", 1) for item in a.invalid), "results": mission_results(root)}
    return write_record(record, a.out)


def write_record(record: dict, directory: str | Path) -> Path:
    """OUT/NAME.json, what render_results.py renders (record: name, kind, date, commands, commit, environment,
    notes, invalid, results)."""
    out = Path(directory) / f"{record['name']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
