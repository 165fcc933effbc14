"""Training (two DeepSpeed ranks, ZeRO-2) under kill -9 at random steps and during a checkpoint save, under
SIGINT, and under a disk that refuses the checkpoint's writes: the resumed loss curve equals the uninterrupted
one. A run cut off inside its final evaluation evaluates its last checkpoint when rerun."""
import json
import os
import random
import re
import shutil
import signal
import time

import pytest

from tests.train_runs import finish, launch, losses, with_run_dir
from train.engine import BEST_FILE

from .faults import file_size_limit, kill_points

STEPS = 12


def kill_group(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks share its session
    proc.communicate()


def steps_off(run, reference: dict, resumed_from: int) -> int:
    """Steps missing from the log or whose loss differs from the uninterrupted run's by more than 1e-4."""
    curve = losses(run)
    missing = sum(1 for s in range(1, STEPS + 1) if s not in curve)
    return missing + sum(1 for s in range(resumed_from + 1, STEPS + 1)
                         if s in curve and abs(curve[s] - reference[s]) >= 1e-4)


def resume_and_compare(config, run, reference) -> int:
    latest = run / "train" / "checkpoints" / "latest"
    tag = latest.read_text().strip() if latest.exists() else None
    if tag is not None:  # `latest` names a complete checkpoint: DeepSpeed's files and our state
        assert (run / "train" / "checkpoints" / tag / "trainer_state.json").exists()
    out = finish(launch(config))
    resumed_from = int(tag[4:]) if tag else 0
    if tag:
        assert f"resumed at step {resumed_from}" in out
    return steps_off(run, reference, resumed_from)


def saving(ckpt, tag: str) -> bool:
    """`tag`'s directory exists (rank 0 made it for the save) but `latest` does not name it yet."""
    latest = ckpt / "latest"
    return (ckpt / tag).exists() and (not latest.exists() or latest.read_text().strip() != tag)


def last_logged_step(run) -> int:
    try:
        return max(losses(run), default=0)
    except (FileNotFoundError, ValueError):  # not there yet, or a line half-written at this instant
        return 0


def test_kill_9_at_random_steps_and_mid_save_resumes_on_the_same_curve(zero2_run, features_run, tmp_path, survival):
    reference = losses(zero2_run[0])
    rng = random.Random(1)
    n = kill_points(full=6, ci=1)  # CI: the mid-save kill; all 6 on request
    survived, lost, mid_save = 0, 0, 0
    for point in range(n):
        run = tmp_path / f"run{point}"
        config = with_run_dir(features_run, run)
        ckpt = run / "train" / "checkpoints"
        proc = launch(config)
        deadline = time.time() + 300
        if point % 2 == 0:  # during the save of step 4 or 8
            tag = f"step{rng.choice([4, 8])}"
            while proc.poll() is None and time.time() < deadline and not saving(ckpt, tag):
                time.sleep(0.002)
        else:  # at a random step
            stop = rng.randint(2, STEPS - 1)
            while proc.poll() is None and time.time() < deadline and last_logged_step(run) < stop:
                time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the kill"
        kill_group(proc)
        mid_save += point % 2 == 0 and saving(ckpt, tag)
        off = resume_and_compare(config, run, reference)
        survived += off == 0
        lost += off
    survival("training: kill -9 (2 ranks) at random steps and mid checkpoint save", n, survived,
             f"{lost} steps ({mid_save} kills landed mid-save)")
    assert survived == n and mid_save >= 1


def test_disk_refusing_a_checkpoint_is_a_clear_error_and_a_rerun_resumes(zero2_run, features_run, tmp_path, survival):
    reference = losses(zero2_run[0])
    run = tmp_path / "run"
    config = with_run_dir(features_run, run)
    proc = launch(config, preexec_fn=file_size_limit(64 * 1024))  # logs fit, a checkpoint's files do not
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "saving checkpoint" in out and "step4 failed" in out and "No complete checkpoint exists yet" in out, out[-3000:]
    assert not (run / "train" / "checkpoints" / "latest").exists()  # nothing half-written looks complete
    off = resume_and_compare(config, run, reference)  # space freed: the same command runs to the end
    survival("training: disk refuses a checkpoint write (EFBIG), then re-run", 1, int(off == 0), f"{off} steps")
    assert off == 0


def test_sigint_saves_at_the_step_it_stopped_and_the_rerun_resumes_there(zero2_run, features_run, tmp_path, survival):
    """Ctrl-C or a time limit's `timeout -s INT` (the mission script's) reaches the launchers and both ranks:
    the ranks agree on a step, checkpoint it and exit non-zero; nothing since the last save_every is lost."""
    reference = losses(zero2_run[0])
    run = tmp_path / "run"
    config = with_run_dir(features_run, run)
    proc = launch(config)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and last_logged_step(run) < 5:  # past step4's save
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal"
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)  # the ranks hold the pipe open until they have saved and exited
    assert proc.returncode != 0
    stopped = re.search(r"stopped by signal \d+ at step (\d+)/12, saved step(\d+)", out)
    assert stopped and stopped.group(1) == stopped.group(2), out[-3000:]
    at = int(stopped.group(1))
    assert 5 <= at < STEPS and (run / "train" / "checkpoints" / "latest").read_text() == f"step{at}"
    assert not (run / "train" / "summary.json").exists()  # a stopped run is not a finished one
    off = resume_and_compare(config, run, reference)  # resumes at step `at`, on the uninterrupted curve
    survival("training: SIGINT (2 ranks), then re-run", 1, int(off == 0), f"{off} steps")
    assert off == 0


def test_a_run_cut_off_in_its_final_evaluation_evaluates_its_last_checkpoint_on_rerun(zero2_run, features_run,
                                                                                      tmp_path):
    """A time limit that kills training after the last step's checkpoint but inside its evaluation leaves no
    summary and no evaluation of that checkpoint: the rerun resumes at the last step and evaluates it there,
    instead of writing a summary without an evaluation (the mission run lost a drafter's figure so)."""
    finished, _ = zero2_run
    run = tmp_path / "run"
    shutil.copytree(finished / "train", run / "train")
    (run / "train" / "summary.json").unlink()  # as killed mid-evaluation: no summary, no best mark
    (run / "train" / "checkpoints" / BEST_FILE).unlink(missing_ok=True)
    out = finish(launch(with_run_dir(features_run, run)))
    assert f"resumed at step {STEPS}" in out
    summary = json.loads((run / "train" / "summary.json").read_text())
    original = json.loads((finished / "train" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["eval"] is not None
    assert summary["eval"]["accept_length"] == pytest.approx(original["eval"]["accept_length"], abs=1e-6)
    assert summary["best"] == {"tag": f"step{STEPS}", "step": STEPS, "accept_length": summary["eval"]["accept_length"]}
    assert max(losses(run)) == STEPS  # no step trained again
