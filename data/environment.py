"""What produced a result: the code's commit, the machine, the library versions. Written into every report that
carries a measurement (serve.smoke, the benchmarks' results files), so that a figure can be traced and compared
only with figures of the same device."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "deepspeed", "sglang", "datasets", "safetensors", "pyarrow")
ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> str | None:
    """The command's output, or None where it failed or does not exist."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    # a copy of the tree sent to another machine names its commit in EYRIE_COMMIT: its .git, where it has one, can
    # be older than the tree (the GPU machine's reported a stale HEAD with uncommitted changes)
    named = os.environ.get("EYRIE_COMMIT")
    return {"commit": named or _run(["git", "rev-parse", "HEAD"]),
            "uncommitted_changes": None if named or dirty is None else bool(dirty),
            "device": gpus.splitlines() if gpus else [f"cpu: {platform.processor() or platform.machine()}"],
            "cpu_count": _cpu_count(), "python": platform.python_version(), "versions": versions}


def _cpu_count() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
