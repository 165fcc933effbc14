"""No pickles run, no remote code unless asked, servers on localhost, file names never taken from data."""
import json
import pickle
import re
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("data", "extract", "train", "serve", "launch")


class Payload:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def plant(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(Payload(marker)))
    return path


def test_the_code_never_unpickles(survival):
    risky = re.compile(r"\bimport pickle\b|\bpickle\.loads?\(|\bdill\b|allow_pickle=True|weights_only=False|"
                       r"torch\.load\((?![^)]*weights_only=True)")
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))
            for n, line in enumerate(f.read_text().splitlines(), 1) if risky.search(line)]
    assert hits == []
    survival("security: no pickle loading in the code (grep)", 1, 1)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickles_where_weights_are_expected_are_refused_unrun(tmp_path, survival):
    from serve.drafter_dir import DrafterDirError, read_tensors
    from train.engine import WeightsOnlyCheckpointEngine
    from data.target import load_target_tensors
    marker = tmp_path / "pwned"
    with pytest.raises(DrafterDirError, match="no safetensors"):  # a drafter dir holding only a pickle
        read_tensors(plant(tmp_path / "drafter" / "pytorch_model.bin", marker).parent)
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):  # a target for the teacher, likewise
        load_target_tensors(plant(tmp_path / "target" / "pytorch_model.bin", marker).parent, ["lm_head"])
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):  # a planted DeepSpeed checkpoint
        WeightsOnlyCheckpointEngine(None).load(str(plant(tmp_path / "ckpt" / "mp_rank_00_model_states.pt", marker)))
    assert not marker.exists()
    survival("security: malicious pickles (drafter, target, checkpoint) refused unrun", 3, 3)


def test_remote_code_runs_only_when_asked(tmp_path, survival):
    from data.config import load_config
    from extract.backend import BackendSpec
    from extract.hf import HFBackend
    marker = tmp_path / "pwned"
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "eyrie_evil", "architectures": ["EvilForCausalLM"],
                                                    "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                                 "AutoModelForCausalLM": "evil.EvilForCausalLM"}}))
    (target / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    assert load_config(None, ["--target.path=t", "--data.inputs=[x]"]).target.trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        HFBackend(BackendSpec(str(target), [0], None, "cpu"))
    assert not marker.exists()
    survival("security: checkpoint code not run without trust_remote_code", 1, 1)


def test_smoke_servers_bind_localhost_and_refuse_a_busy_port(tmp_path, survival):
    from serve.sglang_server import Server, server_command
    cmd = server_command(30000, ["--model-path", "m"])
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} is in use"):
            Server(["--model-path", "m"], port, tmp_path / "log", timeout=1)
    survival("security: smoke servers on 127.0.0.1, busy port refused", 2, 2)


def test_file_names_never_come_from_sample_ids(tiny_target, tmp_path, survival):
    from data.config import load_config
    from data.prepare import prepare
    hostile = ["../../escape", "/abs/path", "a/b", "con\x00nul", "..", "x" * 300]
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello there"}]}) + "\n"
                             for i in hostile))
    before = {p for p in tmp_path.parent.rglob("*")}
    cfg = load_config(None, [f"--run_dir={tmp_path / 'run'}", f"--target.path={tiny_target}", f"--data.inputs=[{convs}]",
                             "--data.draft_vocab_size=16"])
    prepare(cfg)
    created = {p for p in tmp_path.parent.rglob("*")} - before
    assert all(p.is_relative_to(tmp_path / "run") or p == tmp_path / "run" for p in created), sorted(created)
    names = {p.name for p in created}
    assert not any(i.split("/")[-1] in names for i in hostile if i.split("/")[-1])
    survival("security: file names never derived from sample ids", 1, 1)
