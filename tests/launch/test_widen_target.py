"""launch.widen_target: a trained Llama widened to a larger shape computes what it computed (fp32), greedy answers
included, and SGLang's own loader builds the wider model from the files."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from launch.widen_target import SHAPES, Shape, layer_positions, shape_problems, widen

# 8 layers, hidden 64, 4 query / 2 KV heads of 16, MLP 192 -> 20 layers, hidden 192, 12 / 4 heads of 32, MLP 400:
# every part grows (the query group from 2 to 3, the head dim twice), at a size a CPU checks in seconds
WIDE = Shape(hidden=192, layers=20, heads=12, kv_heads=4, head_dim=32, intermediate=400)


@pytest.fixture(scope="module")
def trained_and_widened(make_tokenizer, tmp_path_factory):
    from launch.demo_target import build_tiny_llama, make_conversations, train_target
    tok = make_tokenizer("llama3")
    source, wide = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wide") / "target"
    tok.save_pretrained(str(source))
    model = build_tiny_llama(source, vocab_size=len(tok), hidden=64, layers=8, heads=4, seed=0,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    train_target(model, tok, make_conversations(200, seed=3), steps=40, seq_len=128, batch=8)
    model.save_pretrained(str(source))
    record = widen(source, wide, WIDE, dtype="float32", shard_gb=0.0005)  # tiny shards: the index is exercised
    return tok, source, wide, record


def load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_the_widened_model_computes_the_sources_logits_and_hidden_states(trained_and_widened):
    _, source, wide, record = trained_and_widened
    small, big = load(source), load(wide)
    assert sum(p.numel() for p in big.parameters()) == record["parameters"] > 4 * small.num_parameters()
    ids = torch.randint(0, small.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(ids, output_hidden_states=True), big(ids, output_hidden_states=True)
    assert (b.logits - a.logits).abs().max() <= 1e-4 * a.logits.abs().max()
    for i, position in enumerate(record["layer_positions"]):  # each real layer's output, at its new place
        mine, theirs = b.hidden_states[position + 1], a.hidden_states[i + 1]
        assert (mine[..., 64:] == 0).all(), "the extra hidden dimensions must stay exactly zero"
        assert torch.allclose(mine[..., :64], theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())
    # the wider model's default aux ids [1, L/2-1, L-4] read the layers the source's default ids read
    assert [record["layer_positions"][i] for i in (1, 3, 4)] == [1, 9, 16]
    config = json.loads((wide / "config.json").read_text())
    assert config["rms_norm_eps"] == pytest.approx(small.config.rms_norm_eps * 64 / 192)
    assert config["rope_theta" if "rope_theta" in config else "rope_parameters"] == \
        json.loads((source / "config.json").read_text())["rope_theta" if "rope_theta" in config else
                                                           "rope_parameters"]


def test_greedy_answers_are_the_sources(trained_and_widened):
    from launch.demo_target import make_conversations
    tok, source, wide, _ = trained_and_widened
    small, big = load(source), load(wide)
    prompts = [c["messages"][:1] for c in make_conversations(6, seed=11)]
    for messages in prompts:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        a = small.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
        b = big.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
        assert a.shape[1] > ids["input_ids"].shape[1] and torch.equal(a, b)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_sglangs_loader_builds_the_widened_target_from_every_tensor(trained_and_widened):
    from serve.sglang_check import check_in_subprocess
    [report] = check_in_subprocess(trained_and_widened[2])
    assert report["ok"], report["problems"]
    assert report["architecture"] == "LlamaForCausalLM"
    assert report["target"] == {"layers": 20, "heads": 12, "kv_heads": 4, "head_dim": 32}


def test_the_mission_target_keeps_its_default_aux_layers_at_8b_shape():
    positions = layer_positions(12, 32)  # the 110m mission target: default ids [1, 5, 8]; at 32 layers [1, 15, 28]
    assert [positions[i] for i in (0, 1, 5, 8, 11)] == [0, 1, 15, 28, 31]
    assert positions == sorted(set(positions)) and len(positions) == 12
    assert layer_positions(4, 32)[0] == 0 and layer_positions(4, 32)[-1] == 31  # no distinct default ids: ends


def test_shapes_that_cannot_hold_the_source_are_refused_with_the_reason():
    llama = {"model_type": "llama"}
    src = Shape(hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, intermediate=192)
    assert shape_problems(src, SHAPES["llama3-8b"], llama) == []
    assert shape_problems(src, Shape(64, 8, 8, 4, 24, 192), llama) == [
        "head dim 24 must be a multiple of the source's 16 (even)"]
    assert shape_problems(src, Shape(160, 8, 12, 4, 32, 192), llama) == [
        "hidden 160 is not a multiple of 12 heads (transformers refuses the config)"]
    assert shape_problems(src, Shape(64, 8, 4, 4, 16, 192), llama) == [
        "query heads per KV head: 4/4 must hold the source's 4/2"]
    assert shape_problems(src, Shape(32, 8, 4, 2, 16, 192), {"model_type": "qwen2", "attention_bias": True}) == [
        "hidden 32 < the source's 64", "model_type 'qwen2': only Llama targets are widened",
        "attention or MLP biases: not widened"]


def test_answers_are_compared_per_conversation(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from compare_answers import compare

    def rows(answers):
        return "".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "q"},
                                                              {"role": "assistant", "content": a}]}) + "\n"
                       for i, a in enumerate(answers))
    (tmp_path / "a.jsonl").write_text(rows(["x", "y", "z", "w"]))
    (tmp_path / "b.jsonl").write_text(rows(["x", "y", "Z"]))
    result = compare(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    assert (result["conversations"], result["identical_answers"], result["only_in_a"]) == (3, 2, 1)
    assert result["identical_fraction"] == pytest.approx(2 / 3) and result["first_differing"][0]["b"] == "Z"
