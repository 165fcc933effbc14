"""Shared by the train and serve tests: a run directory with features, and real DeepSpeed launches."""
import json
import os
import subprocess
import sys
from pathlib import Path

from launch.pipeline import free_port

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
TRAIN = {"ttt_steps": 3, "max_batch_tokens": 1024, "eval_fraction": 0.1, "log_every": 1, "eval_every": 4,
         "save_every": 4, "keep_last": 2, "max_steps": 12, "optim": {"lr": 1e-2, "warmup_steps": 2}}


def with_run_dir(features_run, run_dir: Path, **train) -> Path:
    """A config like features_run's whose run_dir is `run_dir`, sharing its data and features (symlinks)."""
    config, raw = features_run
    src = Path(raw["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("data", "features"):
        if not (run_dir / name).exists():
            (run_dir / name).symlink_to(src / name)
    new = json.loads(json.dumps(raw))
    new["run_dir"] = str(run_dir)
    new["train"] |= train
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(json.dumps(new))
    return path


def launch(config: Path, *overrides: str, preexec_fn=None) -> subprocess.Popen:
    """`deepspeed --num_gpus 2 train/main.py` (two gloo ranks on CPU), in a session of its own."""
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "train/main.py", "--config",
           str(config), *overrides]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=preexec_fn)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    return out


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step training loss from the JSONL log (the last record of a step wins: a resumed run re-logs)."""
    rows = [json.loads(line) for line in (run_dir / "train" / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}
