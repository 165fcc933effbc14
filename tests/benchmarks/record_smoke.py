"""Turn a serve.smoke report (RUN/smoke/report.json, or --out DIR/report.json) into one results file.

    python tests/benchmarks/record_smoke.py REPORT --name NAME --date YYYY-MM-DD --command "..." [--command "..."]
                                            [--note "..."] [--invalid KEY=WHY] [--out tests/benchmarks/results]

The file keeps the commands, the commit the machine ran (the report's environment), its device and library
versions, and every repeat: each timed pass and each streamed request's cost; RESULTS.md is rendered from it
(tests/benchmarks/render_results.py).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from record_mission import RESULTS, write_record  # noqa: E402  (this script's folder is on sys.path)


def smoke_results(report: dict) -> dict:
    eagle3 = report["eagle3"]
    throughput = {c: {"baseline": [p["tokens_per_s"] for p in report["baseline"]["passes"][c]],
                      "eagle3": [p["tokens_per_s"] for p in eagle3["passes"][c]],
                      "baseline_passes": report["baseline"]["passes"][c], "eagle3_passes": eagle3["passes"][c]}
                 for c in eagle3["passes"]}
    accept = {group: {"prompts": served["prompts"], "completion_tokens": served["completion_tokens"],
                      "sglang": served["accept_length"], "parity_with_plain_server": eagle3["parity"][group]}
              | ({"reference_decoder": report["reference"][group]["accept_length"]["reference_decoder"]["value"],
                  "token_parity_with_reference_decoder":
                      report["reference"][group]["token_parity_with_reference_decoder"]}
                 if group in report.get("reference", {}) else {})
              for group, served in eagle3["groups"].items()}
    return {"target": report["target"], "drafter": report["drafter"], "chain": eagle3["chain"] + ", greedy",
            "accept_length": accept, "timing": report["timing"], "throughput": throughput,
            "step_costs": {"plain_step_ms": report["baseline"]["step_ms"], "cycle_ms": eagle3["step_ms"],
                           "how": eagle3["costs"]["how"]}}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report")
    p.add_argument("--name", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--command", action="append", required=True, help="each device command, in order")
    p.add_argument("--note", action="append", default=[], help="what a reader must know (repeat)")
    p.add_argument("--invalid", action="append", default=[], metavar="KEY=WHY",
                   help="a measurement in the file that must not be quoted, and why")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    report = json.loads(Path(a.report).read_text())
    environment = report["environment"]
    record = {"name": a.name, "kind": "smoke", "date": a.date, "commands": a.command,
              "commit": environment["commit"], "environment": environment, "notes": a.note,
              "invalid": dict(item.split("=", 1) for item in a.invalid), "results": smoke_results(report)}
    return write_record(record, a.out)


if __name__ == "__main__":
    main()
