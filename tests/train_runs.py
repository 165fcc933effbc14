"""Shared by the tests: a run directory with features, real DeepSpeed launches, pipeline runs of the demo configs."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.demo import demo_ranks
from launch.pipeline import free_port

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
TRAIN = {"ttt_steps": 3, "max_batch_tokens": 1024, "log_every": 1, "eval_every": 4,
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


def demo_config(name: str, assets: Path, run_dir: Path) -> dict:
    """launch/configs/NAME pointed at demo assets built by launch.demo_target and at `run_dir`, evaluating on
    a tenth of the samples."""
    config = yaml.safe_load((ROOT / "launch" / "configs" / name).read_text())
    config["run_dir"] = str(run_dir)
    config["target"]["path"] = str(assets / "target")
    config["data"]["inputs"] = [str(assets / "conversations.jsonl")]
    config["data"] |= {"heldout_fraction": 0.1}
    for stage in ("extract", "train"):  # two gloo ranks on a CPU; one per GPU on a machine with fewer GPUs
        config[stage]["nproc_per_node"] = demo_ranks()
    return config


def run_pipeline(config: Path | dict, *args: str, path: Path | None = None, timeout: float = 600) -> str:
    """`python -m launch.pipeline --config CONFIG ARGS` (a dict is written to `path` first); what it printed. A
    failure shows its output; a hang fails with it too (its whole process group is killed)."""
    if isinstance(config, dict):
        path.write_text(yaml.safe_dump(config))
        config = path
    proc = subprocess.Popen([sys.executable, "-m", "launch.pipeline", "--config", str(config), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the pipeline hung for {timeout:.0f} s; it printed:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out
