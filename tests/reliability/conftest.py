"""Faults tried for real (kill -9, a disk that refuses writes, bad inputs) and a score table at the end.

Every case records what was tried, how many times the run survived (finished correctly after the fault)
and how many samples or steps were lost or corrupted; pytest prints the table after the run, and writes it
as Markdown to $EYRIE_RELIABILITY_TABLE when that is set. CI runs a few kill points per loop;
EYRIE_RELIABILITY_FULL=1 runs all of them.
"""
from __future__ import annotations

import os
import resource
import signal

import pytest

FULL = os.environ.get("EYRIE_RELIABILITY_FULL") == "1"
ROWS: list[dict] = []


def kill_points(full: int, ci: int) -> int:
    return full if FULL else ci


@pytest.fixture
def survival():
    """record(case, tried, survived, lost): one row of the table."""
    def record(case: str, tried: int, survived: int, lost: int | str = 0) -> None:
        ROWS.append({"case": case, "tried": tried, "survived": survived, "lost": lost})
    return record


def file_size_limit(nbytes: int):
    """preexec_fn: the child and its children cannot write any file past `nbytes` (EFBIG, as a full disk
    refuses a write: the kernel, not a mock, fails the write call)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    return apply


def table() -> str:
    lines = ["| case | tried | survived | data lost |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['tried']} | {r['survived']} | {r['lost']} |" for r in ROWS]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    terminalreporter.write_sep("=", "reliability: faults tried and survived")
    terminalreporter.write_line(table())
    if os.environ.get("EYRIE_RELIABILITY_TABLE"):
        with open(os.environ["EYRIE_RELIABILITY_TABLE"], "w") as fh:
            fh.write(table() + "\n")
