"""Turn serve.smoke reports (RUN/smoke/report.json, or --out DIR/report.json) into one results file.

    python tests/benchmarks/record_smoke.py REPORT [REPORT ...] --name NAME --date YYYY-MM-DD --command "..."
                                            [--command "..."] [--label "..." ...] [--note "..."]
                                            [--invalid KEY=WHY] [--feature-parity PARITY_LOG]
                                            [--out tests/benchmarks/results]
    python tests/benchmarks/record_smoke.py --into RESULTS_FILE --feature-parity PARITY_LOG --command "..."

The second form adds extract.parity's figures, measured by a later command, to a served results file.

Several reports are several drafters on one target against one plain server (serve.smoke runs with one --out
reuse the plain server's measurements): each speculative server of each report becomes a row beside that server
(`--label`, one per report: what to call its drafter; default its path). Reports whose plain-server passes differ
are refused: their speedups would not share a baseline. The file keeps the commands, the commit the machine ran
(the first report's environment), its device and library versions, and every repeat: each timed pass and each
streamed request's cost; RESULTS.md is rendered from it (tests/benchmarks/render_results.py, kind "served").
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from record_mission import RESULTS, write_record  # noqa: E402  (this script's folder is on sys.path)


def speculative_servers(report: dict) -> list[str]:
    """The report keys of the speculative servers it started and measured, in its order (eagle3, dflash, ...)."""
    started = [k.removesuffix("_command") for k in report if k.endswith("_command") and k != "baseline_command"]
    return [name for name in started if "passes" in report.get(name, {})]


def drafter_rows(report: dict, label: str) -> list[dict]:
    rows = []
    for name in speculative_servers(report):
        m = report[name]
        reference = report.get("reference", {}) if name in ("eagle3", "dflash") else {}  # the first configuration's
        accept = {group: {"prompts": served["prompts"], "completion_tokens": served["completion_tokens"],
                          "sglang": served["accept_length"], "parity_with_plain_server": m["parity"][group]}
                  | ({"reference_decoder": reference[group]["accept_length"]["reference_decoder"]["value"],
                      "token_parity_with_reference_decoder": reference[group]["token_parity_with_reference_decoder"]}
                     if group in reference else {})
                  for group, served in m["groups"].items()}
        rows.append({"label": label, "drafter": report["drafter"], "server": name, "chain": m["chain"] + ", greedy",
                     "flags": m["flags"], "target_match": report.get("target_match", {}), "accept_length": accept,
                     "throughput": {c: [p["tokens_per_s"] for p in passes] for c, passes in m["passes"].items()},
                     "passes": m["passes"], "cycle_ms": m["step_ms"],
                     "break_even_accept_length": m["costs"]["break_even_accept_length"],
                     "limited_by": m["costs"]["limited_by"]})
    return rows


def served_results(reports: list[dict], labels: list[str]) -> dict:
    first = reports[0]
    for report in reports[1:]:
        if report["target"] != first["target"] or report["baseline"]["passes"] != first["baseline"]["passes"]:
            raise SystemExit(f"{report['drafter']}: not measured against the same plain server as {first['drafter']} "
                             f"(target or plain passes differ): run serve.smoke with one --out for every drafter")
    base = first["baseline"]
    return {"target": first["target"], "timing": first["timing"],
            "baseline": {"throughput": {c: [p["tokens_per_s"] for p in passes] for c, passes in base["passes"].items()},
                         "passes": base["passes"], "step_ms": base["step_ms"]},
            "drafters": [row for report, label in zip(reports, labels) for row in drafter_rows(report, label)],
            "costs_how": next(report[name]["costs"]["how"] for report in reports
                              for name in speculative_servers(report))}


def feature_parity(log: str) -> dict:
    """extract.parity's figures: its output's last line (JSON; a table precedes it)."""
    return json.loads(Path(log).read_text().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="*", metavar="REPORT")
    p.add_argument("--into", metavar="RESULTS_FILE", help="add --feature-parity (and --command, --note) to this file")
    p.add_argument("--name")
    p.add_argument("--date")
    p.add_argument("--command", action="append", required=True, help="each device command, in order")
    p.add_argument("--label", action="append", default=[], help="each report's drafter, as the table names it")
    p.add_argument("--note", action="append", default=[], help="what a reader must know (repeat)")
    p.add_argument("--invalid", action="append", default=[], metavar="KEY=WHY",
                   help="a measurement in the file that must not be quoted, and why")
    p.add_argument("--feature-parity", metavar="FILE",
                   help="extract.parity's output (its last line, JSON): the served target's features against another "
                        "copy's, e.g. the INT4 target's against its bf16 original's")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    if a.into:
        if a.reports or not a.feature_parity:
            p.error("--into takes --feature-parity and no reports")
        record = json.loads(Path(a.into).read_text())
        record["commands"] += a.command
        record["notes"] += a.note
        record["results"]["feature_parity"] = feature_parity(a.feature_parity)
        return write_record(record, Path(a.into).parent)
    if not (a.reports and a.name and a.date):
        p.error("REPORT, --name and --date are required (or --into)")
    reports = [json.loads(Path(r).read_text()) for r in a.reports]
    if a.label and len(a.label) != len(reports):
        p.error(f"{len(a.label)} --label for {len(reports)} reports: one each, or none")
    environment = reports[0]["environment"]
    record = {"name": a.name, "kind": "served", "date": a.date, "commands": a.command,
              "commit": environment["commit"], "environment": environment, "notes": a.note,
              "invalid": dict(item.split("=", 1) for item in a.invalid),
              "results": served_results(reports, a.label or [r["drafter"] for r in reports])}
    if a.feature_parity:
        record["results"]["feature_parity"] = feature_parity(a.feature_parity)
    return write_record(record, a.out)


if __name__ == "__main__":
    main()
