"""The evaluate stage reports held-out figures only for a split that holds: no held-out prompt in the training data,
and a drafter trained with this very split."""
import json

import pytest

from data.layout import RunLayout
from data.split import HeldOutLeak, read_split, split_digest
from serve.evaluate import heldout_prompts, heldout_record


def write_run(tmp_path, overlap: int, trained_digest: str | None) -> RunLayout:
    layout = RunLayout(tmp_path)
    layout.data.mkdir(parents=True)
    prompt = [{"role": "user", "content": "What is 9 minus 4?"}]
    split = {"rule": "by prompt", "heldout_overlap_with_training": overlap,
             "groups": {"sampled": {"samples": 3, "prompts": 2}},
             "heldout": [{"id": "a", "group": "sampled", "prompt": prompt},
                         {"id": "b", "group": "sampled", "prompt": prompt},  # the same prompt, another answer
                         {"id": "c", "group": "sampled", "prompt": [{"role": "user", "content": "Spell cat."}]}]}
    layout.split.write_text(json.dumps(split))
    if trained_digest is not None:
        layout.train.mkdir()
        layout.train_summary.write_text(json.dumps({"split": {"digest": trained_digest}}))
    return layout


def test_a_leak_or_another_split_is_refused_and_prompts_are_distinct(tmp_path):
    layout = write_run(tmp_path / "ok", 0, None)
    digest = split_digest(json.loads(layout.split.read_text()))
    layout.train.mkdir()
    layout.train_summary.write_text(json.dumps({"split": {"digest": digest}}))
    assert heldout_record(layout)["heldout_overlap_with_training"] == 0
    assert [p.id for p in heldout_prompts(read_split(layout.split), "sampled", 5)] == ["a", "c"]  # each prompt once
    with pytest.raises(HeldOutLeak, match="1 held-out samples have a prompt that occurs in the training data"):
        heldout_record(write_run(tmp_path / "leak", 1, digest))
    with pytest.raises(HeldOutLeak, match="trained with another held-out split"):
        heldout_record(write_run(tmp_path / "other", 0, "0123"))


def test_a_heldout_prompt_keeps_its_tools_for_the_decoders(tmp_path):
    """The reference decoder and the smoke test render a held-out prompt as training did: with its tools."""
    from data.conversations import Conversation
    from data.split import SplitRecord, plan_split
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    conv = Conversation("t", [{"role": "user", "content": "Find it."}, {"role": "assistant", "content": "ok"}],
                        "unseen", tools)
    record = SplitRecord(plan_split([conv], 0.0))
    record.add(conv)
    layout = RunLayout(tmp_path)
    layout.data.mkdir(parents=True)
    layout.split.write_text(json.dumps(record.to_json()))
    [prompt] = heldout_prompts(read_split(layout.split), "unseen", 4)
    assert prompt.tools == tools and prompt.messages == [{"role": "user", "content": "Find it."}]
