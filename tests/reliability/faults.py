"""Faults tried for real (kill -9, a disk that refuses writes, bad inputs) and a score table at the end.

Every case records, through the `survival` fixture (tests/conftest.py), what was tried, how many times the
run survived (finished correctly after the fault, or refused the input clearly) and how many samples or steps
were lost or corrupted; pytest prints the table after the run. CI runs 3 extraction kills and 1 training kill (mid-save);
EYRIE_RELIABILITY_FULL=1 runs all of them.
"""
from __future__ import annotations

import os
import resource
import signal

FULL = os.environ.get("EYRIE_RELIABILITY_FULL") == "1"


def kill_points(full: int, ci: int) -> int:
    return full if FULL else ci


def file_size_limit(nbytes: int):
    """preexec_fn: the child and its children cannot write any file past `nbytes` (EFBIG, as a full disk
    refuses a write: the kernel, not a mock, fails the write call)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    return apply
