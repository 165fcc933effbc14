"""`python -m launch.pipeline --config run.yaml [--stages data] [--section.key value ...]`

Runs the stages in order as the commands a user could type, printing each one, and skips a stage whose
output records the same config sections as the current config (a dataset's manifest, the trainer's
summary). Stages: data, extract, train, export (RUN_DIR/drafter, the best checkpoint), evaluate (offline acceptance
and the reference speculative decoder on held-out prompts); the SGLang smoke test runs on a GPU machine
(serve.smoke). Writes RUN_DIR/report.json.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from data.config import ConfigError, EyrieConfig, load_config
from data.prepare import samples_dir
from data.shards import ShardError, atomic_write_json, read_manifest
from extract.job import features_dir

ROOT = Path(__file__).resolve().parents[1]


def _manifest(directory) -> dict | None:
    try:
        return read_manifest(directory)
    except ShardError:
        return None


def _json(*parts: str):
    """Reader of a JSON completion record below RUN_DIR (None while it does not exist)."""
    def read(cfg: EyrieConfig) -> dict | None:
        path = Path(cfg.run_dir).joinpath(*parts)
        return json.loads(path.read_text()) if path.exists() else None
    return read


_train_summary = _json("train", "summary.json")


ALL = ("seed", "target", "data", "extract", "train")
# stage -> (its completion record: a dict with the config it was made with, the config parts it depends on)
STAGES = {
    "data": (lambda cfg: _manifest(samples_dir(cfg)), ("target", "data")),
    "extract": (lambda cfg: _manifest(features_dir(cfg)), ("target", "data", "extract")),
    "train": (_train_summary, ALL),
    "export": (_json("pipeline", "export.json"), ALL),  # the pipeline's own record: no manifest there
    "evaluate": (_json("pipeline", "evaluate.json"), ALL),
}


def stage_done(cfg: EyrieConfig, stage: str) -> dict | None:
    """The stage's completion record if it is complete for this config, else None."""
    record_of, sections = STAGES[stage]
    record = record_of(cfg)
    if record is None:
        return None
    current = cfg.model_dump(mode="json")
    return record if all(record.get("config", {}).get(s) == current[s] for s in sections) else None


def _move_aside(path: Path) -> Path:
    n = 1
    while path.with_name(f"{path.name}.prev-{n}").exists():
        n += 1
    return path.rename(path.with_name(f"{path.name}.prev-{n}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_command(cfg: EyrieConfig, stage: str, config: str, overrides: list[str]) -> list[str]:
    if stage == "extract":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(cfg.extract.nproc_per_node), "-m", "extract", "--config", config, *overrides]
    if stage == "export":
        return [sys.executable, "-m", "serve.export", "--checkpoint", cfg.run_dir, "--tag", "best",
                "--out", str(Path(cfg.run_dir) / "drafter")]
    if stage == "evaluate":
        return [sys.executable, "-m", "serve.evaluate", "--drafter", str(Path(cfg.run_dir) / "drafter"),
                "--run", cfg.run_dir, "--steps", str(cfg.train.ttt_steps), "--decode", "16"]
    if stage == "train":
        found = Path(sys.executable).parent / "deepspeed"
        launcher = [str(found)] if found.exists() else [shutil.which("deepspeed")] if shutil.which("deepspeed") \
            else [sys.executable, "-m", "deepspeed.launcher.runner"]
        return [*launcher, "--num_gpus", str(cfg.train.nproc_per_node),
                "--master_port", str(free_port()), str(ROOT / "train" / "main.py"), "--config", config, *overrides]
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
        if stage == "train" and _train_summary(cfg):  # a finished run for another config: keep it, start anew
            moved = _move_aside(run_dir / "train")
            print(f"[pipeline] train: {run_dir / 'train'} was trained for another config; moved to {moved}",
                  flush=True)
        cmd = stage_command(cfg, stage, args.config, overrides)
        print(f"[pipeline] {stage}: {shlex.join(cmd)}", flush=True)
        start = time.time()
        subprocess.run(cmd, check=True)
        report["stage_seconds"][stage] = round(time.time() - start, 2)
        if stage in ("export", "evaluate"):
            (run_dir / "pipeline").mkdir(exist_ok=True)
            atomic_write_json(run_dir / "pipeline" / f"{stage}.json", {"config": cfg.model_dump(mode="json")})
    manifest = stage_done(cfg, "data")
    if manifest:
        report |= {"samples": manifest["totals"]["rows"], "tokens": manifest["totals"]["tokens"],
                   "loss_tokens": manifest["totals"]["loss_tokens"], "draft_vocab": manifest["vocab"]}
    features = stage_done(cfg, "extract")
    if features:
        report["features"] = {"dir": str(features_dir(cfg)), **features["totals"],
                              "skipped": features["skipped"],
                              "tokens_per_s_by_rank": [r["tokens_per_s"] for r in features["ranks"]]}
    trained = stage_done(cfg, "train")
    if trained:
        report["train"] = {k: trained[k] for k in ("steps", "tokens", "world_size", "latest", "best", "eval")}
    evaluated = run_dir / "evaluate" / "evaluate.json"
    if stage_done(cfg, "evaluate") and evaluated.exists():
        ev = json.loads(evaluated.read_text())
        offline = next(iter(ev["drafters"].values()))
        decoded = next(iter(ev.get("decode", {}).values()), {})
        report["drafter"] = {
            "dir": str(run_dir / "drafter"),
            "offline_accept_length_by_steps": [round(x, 3) for x in offline["accept_length_by_steps"]],
            "offline_alpha_by_position": [round(x, 3) for x in offline["alpha_by_position"]],
            "reference_decoder": {k: decoded.get(k) for k in ("steps", "accept_length", "identical_to_greedy",
                                                             "speedup_wall_clock", "completion_tokens",
                                                             "verify_calls")},
            "accept_length_formula": "tokens emitted per target verify step (SGLang's spec_accept_length)"}
    atomic_write_json(report_path, report)
    print(f"[pipeline] report: {report_path}\n{json.dumps(report, indent=1)}")
    return report


if __name__ == "__main__":
    main()
