"""The `eyrie` command, and what a stage's failure looks like through the pipeline."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.stage_process import failure_cause

EYRIE = str(Path(sys.executable).parent / "eyrie")
SHADOWS = {"data.py": "raise SystemExit('the user data.py was imported')\n",
           "train.py": "raise SystemExit('the user train.py was imported')\n",
           "extract.py": "raise SystemExit('the user extract.py was imported')\n"}


@pytest.fixture
def users_directory(tmp_path):
    """A working directory holding the user's own data.py, train.py and extract.py."""
    for name, text in SHADOWS.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_eyrie_lists_its_commands_from_a_directory_with_a_users_data_and_train_py(users_directory):
    out = subprocess.run([EYRIE, "--help"], cwd=users_directory, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in ("demo", "run", "check", "data", "extract", "train", "export", "evaluate", "decode", "smoke", "parity"):
        assert f"\n  {name} " in out.stdout
    out = subprocess.run([EYRIE, "train", "--help"], cwd=users_directory, capture_output=True, text=True)
    assert out.returncode == 0 and "usage: eyrie train" in out.stdout, out.stderr
    bad = subprocess.run([EYRIE, "trian"], cwd=users_directory, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'trian'" in bad.stderr


def test_a_stage_and_the_pipeline_run_from_a_users_directory(tiny_target, users_directory):
    conversations = users_directory / "chats.jsonl"
    conversations.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} said"}]}) + "\n"
        for i in range(8)))
    (users_directory / "run.yaml").write_text(
        f"run_dir: run\ntarget: {{path: {tiny_target}, aux_layer_ids: [0, 1, 2]}}\n"
        f"data: {{inputs: [chats.jsonl], draft_vocab_size: 16}}\nextract: {{samples_per_shard: 4}}\n")
    out = subprocess.run([EYRIE, "data", "--config", "run.yaml"], cwd=users_directory, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (users_directory / "run" / "data" / "samples" / "manifest.json").exists()
    # the pipeline's own commands (python -m extract under torchrun) do not import the user's files either
    out = subprocess.run([EYRIE, "run", "--config", "run.yaml", "--stages", "data,extract"], cwd=users_directory,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "user" not in out.stdout + out.stderr and (users_directory / "run" / "features" / "manifest.json").exists()


def test_check_names_every_problem_with_its_key_before_any_work(tiny_target, tmp_path):
    (tmp_path / "run.yaml").write_text(
        f"run_dir: {tmp_path / 'run'}\ntarget: {{path: {tiny_target}}}\n"
        f"data: {{inputs: [{tmp_path / 'missing.jsonl'}], draft_vocab_size: 32000}}\n")
    out = subprocess.run([EYRIE, "check", "--config", str(tmp_path / "run.yaml")], capture_output=True, text=True)
    assert out.returncode == 1
    # the default ids [1, 1, 0] of a 4-layer target, a draft vocab above the target's 400, a missing input file
    assert "target.aux_layer_ids: [1, 1, 0] repeat a layer (the default for a 4-layer target): set distinct ids" \
        in out.stderr
    assert "data.draft_vocab_size: 32000 is larger than the target's vocabulary (400)" in out.stderr
    assert f"data.inputs: {tmp_path / 'missing.jsonl'} does not exist" in out.stderr
    # the pipeline runs the same check first, and nothing else
    run = subprocess.run([EYRIE, "run", "--config", str(tmp_path / "run.yaml")], capture_output=True, text=True)
    assert run.returncode == 2 and "3 problems, nothing was run" in run.stderr
    assert not (tmp_path / "run" / "data").exists()


def test_a_stage_that_stops_says_why_in_one_line_above_its_traceback(tmp_path):
    (tmp_path / "run.yaml").write_text("run_dir: run\ntarget: {path: /nowhere}\ndata: {inputs: [x.jsonl]}\n")
    out = subprocess.run([sys.executable, "-m", "extract", "--config", "run.yaml"], cwd=tmp_path, capture_output=True,
                         text=True)
    line = "[extract] error: run/data/samples/manifest.json: no manifest (the dataset was never completed, or this " \
           "is not a dataset)"
    assert out.returncode == 1 and line in out.stderr
    assert out.stderr.index(line) < out.stderr.index("Traceback")


def test_the_pipeline_ends_a_failed_stage_with_its_cause_and_no_traceback_of_its_own(tiny_target, tmp_path):
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "hello"}]}))
    (tmp_path / "run.yaml").write_text(f"run_dir: run\ntarget: {{path: {tiny_target}, aux_layer_ids: [0, 1, 2]}}\n"
                                       "data: {inputs: [chats.jsonl], draft_vocab_size: 16}\n")
    out = subprocess.run([EYRIE, "run", "--config", "run.yaml", "--stages", "extract"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    tail = (out.stdout + out.stderr).strip().splitlines()[-2:]
    assert out.returncode == 1 and tail[0] == (
        "[pipeline] extract failed (exit 1): data.shards.ShardError: run/data/samples/manifest.json: no manifest "
        "(the dataset was never completed, or this is not a dataset)"), tail
    assert tail[1].startswith("[pipeline] the stage's output is above; to run it alone: ") and "-m extract" in tail[1]
    assert "launch/pipeline.py" not in out.stderr  # no pipeline traceback on top of the stage's


def test_a_failed_stage_is_one_line_naming_the_cause_not_the_launchers_traceback():
    torchrun = """[rank0]: Traceback (most recent call last):
[rank0]:   File "extract/job.py", line 10, in run
[rank0]: ValueError: sample s7: token id 512 >= the target's vocab size 400: run the data stage again
E1206 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1)
Traceback (most recent call last):
  File "torch/distributed/run.py", line 9, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
extract FAILED
"""
    assert failure_cause(torchrun) == \
        "ValueError: sample s7: token id 512 >= the target's vocab size 400: run the data stage again"
    assert failure_cause("progress 10%\rprogress 20%\n[extract] refused: runs has 1.00 GB free\n") == \
        "[extract] refused: runs has 1.00 GB free"
    assert failure_cause("something odd\n") == "something odd"
