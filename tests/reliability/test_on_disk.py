"""What is broken on disk reads as what it is: a `latest` naming a missing or incomplete checkpoint resumes from the
newest complete one (or says there is none), and a truncated safetensors file names itself and what writes it."""
import json

import pytest
import torch
from safetensors.torch import save_file

from data.files import UnreadableFile
from train.engine import STATE_FILE, Checkpoints


def checkpoint(root, tag: str, complete: bool = True) -> None:
    d = root / tag
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"step": int(tag[4:])}))
    (d / "mp_rank_00_model_states.pt").write_bytes(b"weights" if complete else b"")


def test_latest_naming_a_missing_or_incomplete_tag_resumes_from_the_newest_complete_one(tmp_path, capsys):
    ckpts = Checkpoints(tmp_path, keep_last=2)
    assert ckpts.resume_tag() is None  # nothing saved: a fresh start
    checkpoint(tmp_path, "step8")
    checkpoint(tmp_path, "step16")
    (tmp_path / "latest").write_text("step16")
    assert ckpts.resume_tag() == "step16"
    (tmp_path / "latest").write_text("step24")  # the tag was deleted, or never copied
    assert ckpts.resume_tag() == "step16"
    assert "names step24, which is missing; resuming from step16, the newest complete" in capsys.readouterr().out
    checkpoint(tmp_path, "step24", complete=False)  # a copy cut short: an empty model-states file
    assert ckpts.resume_tag() == "step16" and "step24, which is incomplete" in capsys.readouterr().out
    for tag in ("step8", "step16"):
        (tmp_path / tag / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(RuntimeError, match=r"names step24, which is incomplete .* holds no complete checkpoint"):
        ckpts.resume_tag()


def test_a_truncated_safetensors_file_names_itself_and_what_writes_it(tmp_path):
    from data.target import load_target_tensors
    from data.vocab import load_draft_vocab
    from serve.drafter_dir import read_tensors
    save_file({"d2t": torch.zeros(4, dtype=torch.int64), "t2d": torch.ones(4, dtype=torch.bool)},
              str(tmp_path / "full.safetensors"))
    data = (tmp_path / "full.safetensors").read_bytes()
    for d in ("vocab", "target", "drafter"):
        (tmp_path / d).mkdir()
    for path in (tmp_path / "vocab" / "draft_vocab.safetensors", tmp_path / "target" / "model.safetensors",
                 tmp_path / "drafter" / "model.safetensors"):
        path.write_bytes(data[:len(data) // 2])
    with pytest.raises(UnreadableFile, match=r"draft_vocab.safetensors: not a readable safetensors file \(Error while deserializing"
                                             r".*bytes on disk\)\. It is written by the data stage"):
        load_draft_vocab(tmp_path / "vocab" / "draft_vocab.safetensors")
    with pytest.raises(UnreadableFile, match="target/model.safetensors: .* the target's publisher"):
        load_target_tensors(tmp_path / "target", ["embed"])
    with pytest.raises(UnreadableFile, match="drafter/model.safetensors: .* serve.export"):
        read_tensors(tmp_path / "drafter")
