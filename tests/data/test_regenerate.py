"""Regeneration against a real HTTP server running a real (tiny) model, and against local generate."""
import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.config import RegenerateConfig
from data.conversations import Conversation
from data.regenerate import LocalGenerator, OpenAIChatGenerator, regenerate
from tests.openai_server import ChatServer


def convs(n, poison=()):
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"What is {i} plus {i}?" + (" POISON" if i in poison else "")},
                {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": "Count from 1 to 3."},
                {"role": "assistant", "content": "old answer"}]
        out.append(Conversation(f"c{i}", msgs))
    out.append(Conversation("tool", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                     {"role": "tool", "content": "z"}, {"role": "assistant", "content": "w"}]))
    return out


@pytest.fixture(scope="module")
def model_and_tok(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target), AutoTokenizer.from_pretrained(tiny_target)


def test_openai_endpoint_retries_counts_and_resumes(model_and_tok, tiny_target, tmp_path):
    model, tok = model_and_tok
    cfg = RegenerateConfig(enabled=True, max_new_tokens=6, concurrency=4, max_retries=3)
    out = tmp_path / "regen.jsonl"
    with ChatServer(model, tok, fail_first=2) as server:
        cfg.endpoint = server.url
        report = regenerate(convs(6, poison={2, 4}), OpenAIChatGenerator(cfg, sleep=lambda s: None), out, cfg)
    assert report["input"] == 7 and report["succeeded"] == 4 and report["errors"] == 2 and report["skipped"] == 1
    assert report["skipped_reasons"] == {"unsupported_role:tool": 1}
    assert any("HTTP 400" in e for e in report["error_examples"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["c0", "c1", "c3", "c5"]  # input order
    local = LocalGenerator(str(tiny_target), cfg)
    for row in rows:
        assistant = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(assistant) == 2 and all(m["content"] != "old answer" for m in assistant)
        # The server's answer is the model's own greedy answer to the same history.
        assert assistant[0]["content"] == local(row["messages"][:1])["content"]
    assert json.loads((tmp_path / "regen.jsonl.report.json").read_text()) == report

    # Re-run with the poison gone: done conversations are resumed, the failed ones retried.
    with ChatServer(model, tok) as server:
        cfg.endpoint = server.url
        again = regenerate(convs(6), OpenAIChatGenerator(cfg), out, cfg)
        assert server.requests == 2 * 2  # two conversations x two assistant turns
    assert again["resumed"] == 4 and again["succeeded"] == 6 and again["errors"] == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"c{i}" for i in range(6)]


def test_unreachable_endpoint_is_an_error_per_conversation(tmp_path):
    cfg = RegenerateConfig(endpoint="http://127.0.0.1:9/v1", max_retries=1, timeout_s=2)
    report = regenerate(convs(2), OpenAIChatGenerator(cfg, sleep=lambda s: None), tmp_path / "o.jsonl", cfg)
    assert report["errors"] == 2 and report["succeeded"] == 0 and report["skipped"] == 1
    assert "ConnectionError" in report["error_examples"][0]


def test_local_batches_answer_each_conversation_as_it_is_answered_alone(tiny_target, tmp_path):
    """`concurrency` conversations per left-padded generate batch, one batch per turn: each conversation gets
    the greedy answers the target gives it alone, and the batches are as few as that allows."""
    cfg = RegenerateConfig(enabled=True, backend="local", max_new_tokens=8, concurrency=3)
    local = LocalGenerator(str(tiny_target), cfg)
    batches = []
    generate_batch = local.generate_batch
    local.generate_batch = lambda histories, tools: batches.append(len(histories)) or generate_batch(histories, tools)
    conversations = [Conversation(f"c{i}", [
        {"role": "user", "content": "What is 2 plus 2?" + " Answer briefly, please." * i},  # lengths differ: padding
        {"role": "assistant", "content": "old"}, {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "old"}]) for i in range(5)]
    report = regenerate(conversations, local, tmp_path / "r.jsonl", cfg)
    assert report["succeeded"] == 5 and report["errors"] == 0
    assert batches == [3, 3, 2, 2]  # two chunks of at most 3, two turns each
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(5)]
    answered = 0
    for row in rows:
        history = []
        for m in row["messages"]:
            if m["role"] == "assistant":
                assert m["content"] == local(history)["content"] and m["content"] != "old"
                answered += 1
            history.append(m)
    assert answered == 10


def test_tools_and_template_switches_reach_the_target_and_the_regenerated_rows(model_and_tok, tiny_target, tmp_path):
    """A row's tool declarations and data.chat_template_kwargs go to the endpoint with every request (the stand-in
    server renders them as SGLang's does) and the regenerated row keeps the tools for the data stage."""
    model, tok = model_and_tok
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4, concurrency=2)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    conversation = Conversation("t", [{"role": "user", "content": "Find it."}, {"role": "assistant", "content": "old"}],
                                tools=tools)
    with ChatServer(model, tok) as server:
        cfg.endpoint = server.url
        generator = OpenAIChatGenerator(cfg, template_kwargs={"enable_thinking": False})
        report = regenerate([conversation], generator, tmp_path / "r.jsonl", cfg)
    assert report["succeeded"] == 1
    assert server.bodies[0]["tools"] == tools and server.bodies[0]["chat_template_kwargs"] == {"enable_thinking": False}
    row = json.loads((tmp_path / "r.jsonl").read_text())
    assert row["tools"] == tools and row["messages"][1]["content"] != "old"


def test_tools_the_template_leaves_out_of_the_prompts_are_counted(make_tokenizer, tiny_target, tmp_path):
    """The regenerate stage counts, per reason and with the template's name, the conversations whose declared
    tools the target's chat template leaves out of the prompt (the target answers without seeing them)."""
    import copy

    from data.config import EyrieConfig
    from data.regenerate import unrendered_in_prompts
    tools = [{"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}]
    convs = [Conversation("t", [{"role": "user", "content": "Rain?"}, {"role": "assistant", "content": "old"}],
                          tools=tools),
             Conversation("p", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"}])]

    def counted(tokenizer_dir) -> dict:
        cfg = EyrieConfig(run_dir=str(tmp_path / "run"), target={"path": str(tiny_target),
                                                                  "tokenizer": str(tokenizer_dir)},
                          data={"inputs": ["unused.jsonl"], "regenerate": {"enabled": True}})
        return unrendered_in_prompts(convs, cfg)
    plain = counted(tiny_target)  # the llama3 test template: no tools block
    assert list(plain.values()) == [1] and next(iter(plain)).startswith("tools (the chat template of")
    tok = copy.deepcopy(make_tokenizer("llama3"))
    tok.chat_template = "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}" + tok.chat_template
    tok.save_pretrained(str(tmp_path / "with-tools"))
    assert counted(tmp_path / "with-tools") == {}
