"""The data stage end to end: `python -m data` on files with good and bad rows, and with regeneration."""
import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.config import load_config
from data.prepare import prepare
from data.shards import ShardDataset, read_manifest
from data.vocab import load_draft_vocab
from launch.demo_target import make_conversations
from tests.openai_server import ChatServer


def write_inputs(tmp_path, n=40):
    rows = [json.dumps(c) for c in make_conversations(n, seed=3)]
    rows.insert(5, "{broken")
    rows.insert(9, json.dumps({"messages": [{"role": "user", "content": "no answer"}]}))
    path = tmp_path / "convs.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def write_config(tmp_path, target, inputs, **data):
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"path": str(target)},
           "data": {"inputs": [str(inputs)], "max_length": 64, "draft_vocab_size": 100, "samples_per_shard": 16,
                    **data}}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    return path


def test_cli_skips_counts_and_writes_samples_and_vocab(tiny_target, tmp_path):
    inputs = write_inputs(tmp_path)
    cfg_path = write_config(tmp_path, tiny_target, inputs)
    fail = subprocess.run([sys.executable, "-m", "data", "--config", str(cfg_path)], capture_output=True, text=True)
    assert fail.returncode != 0 and f"{inputs}:6: invalid JSON" in fail.stderr

    out = subprocess.run([sys.executable, "-m", "data", "--config", str(cfg_path), "--data.skip_malformed", "true",
                          "--data.overflow", "drop"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # the console gets one line about the config; the resolved config (defaults filled in) goes to a file
    assert "resolved config: " in out.stdout and "skip_malformed" not in out.stdout
    assert "skip_malformed: true" in (tmp_path / "run" / "config" / "data.yaml").read_text()
    manifest = read_manifest(tmp_path / "run/data/samples")
    report = manifest["report"]
    assert report["read"] == 42 and report["skipped"]["invalid_json"] == 1 and report["skipped"]["no_assistant_turn"] == 1
    assert report["kept"] == manifest["totals"]["rows"] == report["read"] - sum(report["skipped"].values())
    assert report["skipped"].get("too_long", 0) > 0  # 64 tokens drop some two-turn samples
    ds = ShardDataset(tmp_path / "run/data/samples", verify=True)
    assert len(ds) == report["kept"] and len(manifest["shards"]) == -(-len(ds) // 16)
    assert all(len(ds[i].input_ids) <= 64 and ds[i].loss_mask.sum() > 0 for i in range(len(ds)))
    d2t, t2d = load_draft_vocab(tmp_path / "run/data/draft_vocab.safetensors")
    assert len(d2t) == 100 and len(t2d) == json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    # Every loss token is in the draft vocab when the vocab is larger than the tokens used.
    used = torch.cat([ds[i].input_ids[ds[i].loss_mask.bool()] for i in range(len(ds))]).long().unique()
    assert manifest["vocab"]["coverage"] == 1.0 if len(used) <= 100 else manifest["vocab"]["coverage"] < 1.0
    assert t2d[used].sum() == min(len(used), 100)


def test_prepare_with_regeneration_through_an_endpoint(tiny_target, tmp_path):
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_target), AutoTokenizer.from_pretrained(tiny_target)
    inputs = tmp_path / "c.jsonl"
    inputs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(6, seed=1)))
    with ChatServer(model, tok) as server:
        cfg = load_config(write_config(tmp_path, tiny_target, inputs),
                          ["--data.regenerate.enabled", "true", "--data.regenerate.endpoint", server.url,
                           "--data.regenerate.max_new_tokens", "5", "--data.max_length", "512"])
        manifest = prepare(cfg)
    regen = manifest["regenerate"]
    assert regen["input"] == 6 and regen["succeeded"] == 6 and regen["source"]["kept"] == 6
    rows = [json.loads(line) for line in (tmp_path / "run/data/regenerated.jsonl").read_text().splitlines()]
    originals = {c["id"]: c for c in make_conversations(6, seed=1)}
    for row in rows:  # user turns kept, assistant turns replaced by the model's own text
        orig = originals[row["id"]]["messages"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == \
            [m["content"] for m in orig if m["role"] == "user"]
        assert all(m["content"] != o["content"] for m, o in zip(row["messages"], orig) if m["role"] == "assistant")
    assert manifest["totals"]["rows"] == 6


def test_a_template_that_cannot_be_followed_stops_the_data_stage_naming_the_keys_that_help(tiny_target, tmp_path):
    """A sample the template renders in a way no span can be found in (here: it rewrites the assistant's content)
    stops the run naming the sample, the template's behaviour and the keys that help; with data.skip_malformed it
    is counted instead."""
    import shutil

    import pytest

    from data.conversations import MalformedSample
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = tok.chat_template.replace("{{ m.content | trim }}", "{{ m.content | upper }}")
    tok.save_pretrained(target)
    inputs = tmp_path / "c.jsonl"
    inputs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(4, seed=2)))
    with pytest.raises(MalformedSample, match=r"the assistant content is not in the render after its prompt "
                                              r"\(data.skip_malformed: true .* target.tokenizer"):
        prepare(load_config(write_config(tmp_path, target, inputs)))
    with pytest.raises(RuntimeError, match="0 kept .* skipped: template_error=4"):  # every sample counted
        prepare(load_config(write_config(tmp_path, target, inputs, skip_malformed=True)))
