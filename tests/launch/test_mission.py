"""The mission-scale run's CPU-checkable parts: its target builder (trains, resumes bit-identically, writes the
prompts) and the pipeline's refusal to serve a target where SGLang cannot run. The run itself is GPU-only
(tests/benchmarks/mission.sh)."""
import json

import pytest
from safetensors.torch import load_file

from launch import mission_target, pipeline

ARGS = ["--size", "tiny", "--batch", "4", "--prompts", "40", "--corpus-mb", "0.2", "--minutes", "5"]


def test_target_trains_resumes_identically_and_writes_prompts(tmp_path):
    straight = mission_target.main(["--out", str(tmp_path / "a"), "--steps", "24", *ARGS])
    cut = mission_target.main(["--out", str(tmp_path / "b"), "--steps", "24", "--stop-at", "16", *ARGS])
    assert cut["step"] == 16 and not cut["finished"]  # as when a command's time runs out
    resumed = mission_target.main(["--out", str(tmp_path / "b"), "--steps", "24", *ARGS])
    assert straight["step"] == resumed["step"] == 24 and straight["finished"]
    a = load_file(str(tmp_path / "a" / "target" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "target" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # the schedule, batches and AdamW state
    assert straight["losses"][-1][1] < straight["losses"][0][1]
    convs = [json.loads(line) for line in open(tmp_path / "a" / "conversations.jsonl")]
    assert len(convs) == 40 and len({c["id"] for c in convs}) == 40
    assert any("```python" in c["messages"][-1]["content"] for c in convs)  # code tasks from the stdlib
    again = mission_target.main(["--out", str(tmp_path / "a"), "--steps", "24", *ARGS])  # done: nothing re-run
    assert again["step"] == 24


def test_launch_server_is_refused_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(pipeline.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--config", "launch/configs/mission.yaml", "--stages", "regenerate"])
    assert e.value.code == 2 and "launch_server start SGLang servers" in capsys.readouterr().err


def test_sigint_ends_training_between_steps_and_saves(tmp_path):
    """mission.sh ends a command's share of the target training with SIGINT: the step reached is saved and
    the next invocation starts from it."""
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "m"
    proc = subprocess.Popen([sys.executable, "-m", "launch.mission_target", "--out", str(out), "--steps", "100000",
                             *ARGS], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while "train mission target" not in (proc.stderr.readline() or "") and time.time() < deadline:
        pass
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    saved = json.loads((out / "checkpoint" / "state.json").read_text())
    partial = json.loads((out / "target" / "training-partial.json").read_text())
    assert 0 < saved["step"] == partial["step"] < 100000 and not partial["finished"]
