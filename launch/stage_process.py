"""A stage's command as the pipeline runs it: its output streamed to the console as it comes (progress bars
included), and, when it fails, one line that says why, taken from that output, instead of the pipeline's own
traceback stacked on torchrun's.

Commands run with PYTHONSAFEPATH=1 and Eyrie's root on PYTHONPATH: `python -m extract` then imports Eyrie's
packages (installed or not), never a `data.py` or `train.py` in the user's working directory.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL_BYTES = 64 * 1024
# "ValueError: target.aux_layer_ids: ...", "error: ...", "[extract] refused: ..."; launchers' own wrappers are not
# the cause (torchrun's ChildFailedError, a CalledProcessError of deepspeed's runner)
CAUSE = re.compile(r"^(?:[\w.]*(?:Error|Exception|Exit)(?<!ChildFailedError)(?<!CalledProcessError): .+|error: .+|"
                   r"\[\w+\] (?:refused|rank \d+|error): .+)$")
RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")  # torchrun's per-rank prefix


class StageFailed(SystemExit):
    pass


def failure_cause(output: str) -> str:
    """The line of a failed command's output that names the cause: the last error line (a worker's, not its
    launcher's), else the last line."""
    lines = [RANK_PREFIX.sub("", line).strip() for line in output.replace("\r", "\n").splitlines() if line.strip()]
    causes = [line for line in lines if CAUSE.match(line)]
    return (causes or lines or ["(no output)"])[-1]


def run(stage: str, cmd: list[str]) -> None:
    """Run `cmd`, teeing its output; raise StageFailed with one explanatory line when it exits non-zero."""
    # Eyrie's own root first on the path (an uninstalled checkout works too), the working directory never
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = os.environ | {"PYTHONSAFEPATH": "1", "PYTHONPATH": path}
    tail: deque[bytes] = deque()
    size = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as proc:
        out = sys.stdout.buffer
        while chunk := os.read(proc.stdout.fileno(), 8192):
            out.write(chunk)
            out.flush()
            tail.append(chunk)
            size += len(chunk)
            while size - len(tail[0]) > TAIL_BYTES:
                size -= len(tail.popleft())
        code = proc.wait()
    if code != 0:
        cause = failure_cause(b"".join(tail).decode(errors="replace"))
        raise StageFailed(f"[pipeline] {stage} failed (exit {code}): {cause}\n"
                          f"[pipeline] the stage's output is above; to run it alone: {shlex.join(cmd)}")
