"""`python -m launch.pipeline --config run.yaml [--stages data] [--section.key value ...]`

Runs the stages in order as the commands a user could type, printing each one, and skips a stage whose
output manifest records the same config hash. Stages so far: data (extract, train, export, evaluate
and smoke join as they land). Writes RUN_DIR/report.json.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from data.config import ConfigError, EyrieConfig, load_config
from data.shards import ShardError, atomic_write_json, read_manifest

STAGES = ("data",)


def stage_done(cfg: EyrieConfig, stage: str) -> dict | None:
    """The stage's manifest if it is complete for this config, else None."""
    if stage == "data":
        try:
            manifest = read_manifest(Path(cfg.run_dir) / "data" / "samples")
        except ShardError:
            return None
        return manifest if manifest.get("config_hash") == cfg.section_hash("target", "data") else None
    raise ValueError(f"unknown stage {stage!r}")


def stage_command(stage: str, config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", stage, "--config", config, *overrides]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        p.exit(2, f"error: {e}\n")
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.exit(2, f"error: unknown stages {sorted(unknown)}; known: {', '.join(STAGES)}\n")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report.setdefault("stage_seconds", {})
    for stage in stages:
        if stage_done(cfg, stage):
            print(f"[pipeline] {stage}: complete for this config, skipped", flush=True)
            continue
        cmd = stage_command(stage, args.config, overrides)
        print(f"[pipeline] {stage}: {shlex.join(cmd)}", flush=True)
        start = time.time()
        subprocess.run(cmd, check=True)
        report["stage_seconds"][stage] = round(time.time() - start, 2)
    manifest = stage_done(cfg, "data")
    if manifest:
        report |= {"samples": manifest["totals"]["rows"], "tokens": manifest["totals"]["tokens"],
                   "loss_tokens": manifest["totals"]["loss_tokens"], "draft_vocab": manifest["vocab"]}
    atomic_write_json(report_path, report)
    print(f"[pipeline] report: {report_path}\n{json.dumps(report, indent=1)}")
    return report


if __name__ == "__main__":
    main()
