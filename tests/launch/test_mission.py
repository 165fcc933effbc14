"""The mission-scale run's CPU-checkable parts: its target builder (trains, resumes bit-identically, writes the
prompts) and the pipeline's refusal to serve a target where SGLang cannot run. The run itself is GPU-only
(tests/benchmarks/mission.sh)."""
import json

import pytest
from safetensors.torch import load_file

from launch import mission_target, pipeline

ARGS = ["--size", "tiny", "--batch", "4", "--prompts", "40", "--unseen-prompts", "6", "--corpus-mb", "0.2",
        "--minutes", "5"]


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
    assert len(convs) == 46 and len({c["id"] for c in convs}) == 46
    assert any("```python" in c["messages"][-1]["content"] for c in convs)  # code tasks from the stdlib
    assert sum(c.get("heldout") == "unseen-families" for c in convs) == 6
    prompts = json.loads((tmp_path / "a" / "prompts.json").read_text())
    assert prompts["drafter_distinct_prompts"] == 46 and prompts["drafter_prompts_in_target_dialogues"] == 0
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


def test_drafter_prompts_never_occur_in_the_target_dialogues():
    """The two prompt pools are disjoint by item: a stdlib function's every wording, a task's question."""
    functions = [("m", f"f{i}", f"def f{i}(): pass") for i in range(40)]
    target = mission_target.make_dialogues(600, functions, 1, side="target")
    drafter = mission_target.make_dialogues(300, functions, 2, side="drafter", distinct=True)
    questions = {m["content"].lower() for c in target for m in c["messages"] if m["role"] == "user"}
    asked = [m["content"].lower() for c in drafter for m in c["messages"] if m["role"] == "user"]
    assert len(asked) == len(set(asked)) == 300 and not set(asked) & questions
    code_functions = {c["messages"][-1]["content"].split("`")[1] for c in target if "```" in c["messages"][-1]["content"]}
    drafter_functions = {c["messages"][-1]["content"].split("`")[1] for c in drafter if "```" in c["messages"][-1]["content"]}
    assert code_functions and drafter_functions and not code_functions & drafter_functions
