"""`python -m launch.pipeline --config run.yaml [--stages data] [--section.key value ...]`

Runs the stages in order as the commands a user could type, printing each one, and skips a stage whose
output manifest records the same config sections as the current config. Stages so far: data, extract (train, export, evaluate
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
from data.prepare import samples_dir
from data.shards import ShardError, atomic_write_json, read_manifest
from extract.job import features_dir

# stage -> (the directory whose manifest marks it complete, the config sections its output depends on)
STAGES = {
    "data": (samples_dir, ("target", "data")),
    "extract": (features_dir, ("target", "data", "extract")),
}


def stage_done(cfg: EyrieConfig, stage: str) -> dict | None:
    """The stage's manifest if it is complete for this config, else None."""
    directory, sections = STAGES[stage]
    try:
        manifest = read_manifest(directory(cfg))
    except ShardError:
        return None
    current = cfg.model_dump(mode="json")
    same = all(manifest.get("config", {}).get(s) == current[s] for s in sections)
    return manifest if same else None


def stage_command(cfg: EyrieConfig, stage: str, config: str, overrides: list[str]) -> list[str]:
    if stage == "extract":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(cfg.extract.nproc_per_node), "-m", "extract", "--config", config, *overrides]
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
        cmd = stage_command(cfg, stage, args.config, overrides)
        print(f"[pipeline] {stage}: {shlex.join(cmd)}", flush=True)
        start = time.time()
        subprocess.run(cmd, check=True)
        report["stage_seconds"][stage] = round(time.time() - start, 2)
    manifest = stage_done(cfg, "data")
    if manifest:
        report |= {"samples": manifest["totals"]["rows"], "tokens": manifest["totals"]["tokens"],
                   "loss_tokens": manifest["totals"]["loss_tokens"], "draft_vocab": manifest["vocab"]}
    features = stage_done(cfg, "extract")
    if features:
        report["features"] = {"dir": str(features_dir(cfg)), **features["totals"],
                              "skipped": features["skipped"],
                              "tokens_per_s_by_rank": [r["tokens_per_s"] for r in features["ranks"]]}
    atomic_write_json(report_path, report)
    print(f"[pipeline] report: {report_path}\n{json.dumps(report, indent=1)}")
    return report


if __name__ == "__main__":
    main()
