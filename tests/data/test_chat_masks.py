"""Assistant loss masks, checked token by token for three real-world template styles."""
import copy

import pytest

from data.chat import ChatTokenizer
from data.conversations import Conversation, MalformedSample, SkipReport
from tests.templates import DEEPSEEK_STYLE, GLM_STYLE


def masked_runs(tok, sample) -> list[str]:
    """Decode each contiguous run of loss-masked tokens."""
    runs, cur = [], []
    for tid, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            cur.append(tid)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "The sum of 2 and 3 is 5.", "reasoning_content": "add them"},
    {"role": "user", "content": "Count from 1 to 3."},
    {"role": "assistant", "content": "Counting: 1, 2, 3.", "reasoning_content": "think about it"},
]


def expected(style: str, messages: list[dict]) -> list[str]:
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        r, c = m.get("reasoning_content"), m["content"]
        if style == "llama3":
            out.append(c.strip() + "<|eot_id|>")
        elif style == "chatml":
            think = f"<think>\n{r}\n</think>\n\n" if i > last_user and r else ""
            out.append(think + c + "<|im_end|>")
        else:
            think = f"<think>{r or ''}</think>" if i > last_user else "<think></think>"
            calls = ""
            if m.get("tool_calls"):
                calls = "<|tool_calls_section_begin|>" + "".join(
                    f"<|tool_call_begin|>{t['function']['name']}<|tool_call_argument_begin|>"
                    f"{t['function']['arguments']}<|tool_call_end|>" for t in m["tool_calls"]) + \
                    "<|tool_calls_section_end|>"
            out.append(think + c + calls + "<|im_end|>")
    return out


@pytest.mark.parametrize("style", ["llama3", "chatml", "kimi"])
def test_multi_turn_masks_match_template(make_tokenizer, style):
    tok = make_tokenizer(style)
    sample = ChatTokenizer(tok)(Conversation("c1", MULTI))
    assert sample.input_ids == tok.apply_chat_template(MULTI, tokenize=True, return_dict=True)["input_ids"]
    assert masked_runs(tok, sample) == expected(style, MULTI)


@pytest.mark.parametrize("style", ["llama3", "chatml", "kimi"])
def test_last_turn_only(make_tokenizer, style):
    tok = make_tokenizer(style)
    sample = ChatTokenizer(tok, loss_on="last")(Conversation("c1", MULTI))
    assert masked_runs(tok, sample) == expected(style, MULTI)[-1:]


def test_kimi_drops_earlier_reasoning_and_trains_tool_calls(make_tokenizer):
    tok = make_tokenizer("kimi")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Spell the word tiger."},
        {"role": "assistant", "content": "The word tiger is spelled T-I-G-E-R.", "reasoning_content": "letters"},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "The weather in Paris is sunny.", "reasoning_content": "tool said so"},
    ]
    sample = ChatTokenizer(tok)(Conversation("k", messages))
    runs = masked_runs(tok, sample)
    assert runs == expected("kimi", messages)
    assert "letters" not in tok.decode(sample.input_ids)  # the earlier turn's reasoning is not in the text at all
    assert runs[0].startswith("<think></think>") and runs[1].startswith("<think>use the tool</think>")


def test_truncate_and_drop_are_counted(make_tokenizer):
    tok = make_tokenizer("llama3")
    conv = Conversation("long", MULTI)
    full = ChatTokenizer(tok)(conv)
    report = SkipReport(read=2)
    cut = ChatTokenizer(tok, max_length=len(full.input_ids) - 3, overflow="truncate")
    kept = cut.fit(full, report)
    assert len(kept.input_ids) == len(full.input_ids) - 3 and kept.loss_mask == full.loss_mask[:-3]
    assert report.truncated == 1
    dropper = ChatTokenizer(tok, max_length=len(full.input_ids) - 3, overflow="drop")
    assert dropper.fit(full, report) is None
    assert report.skipped["too_long"] == 1 and report.kept == 1
    # Truncated to before the first assistant token: no loss left, dropped and counted.
    tiny = ChatTokenizer(tok, max_length=8, overflow="truncate")
    assert tiny.fit(full, report) is None and report.skipped["no_loss_tokens"] == 1


def test_a_template_that_ignores_add_generation_prompt_is_refused_at_load(make_tokenizer):
    """Written in the style of published Llama-3 copies that always append the assistant header: refused once,
    with the reason and the key that helps, not sample after sample with "'' is not in the render"."""
    tok = copy.deepcopy(make_tokenizer("llama3"))
    tok.chat_template = tok.chat_template.replace("{% if add_generation_prompt %}", "{% if true %}")
    with pytest.raises(ValueError, match="it ignores add_generation_prompt .* target.tokenizer"):
        ChatTokenizer(tok)


def test_template_that_rewrites_content_is_a_named_error(make_tokenizer, tmp_path):
    tok = make_tokenizer("llama3")
    tok = copy.deepcopy(tok)
    tok.chat_template = tok.chat_template.replace("{{ m.content | trim }}", "{{ m.content | upper }}")
    with pytest.raises(MalformedSample, match="sample bad: chat template: message 1: the assistant content"):
        ChatTokenizer(tok)(Conversation("bad", MULTI[1:3]))


TOOLS = [{"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}]


def test_tools_and_template_switches_reach_the_render_and_what_is_left_out_is_counted(make_tokenizer):
    """A row's tools and data.chat_template_kwargs reach every render (the tool block is context, not trained); a
    template that renders neither tools nor reasoning has them counted, with its name, instead of dropped silently."""
    tok = copy.deepcopy(make_tokenizer("llama3"))
    tok.chat_template = (  # the llama3 test template, plus a tools block and a thinking switch, as published ones have
        "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools: {{ tools | tojson }}<|eot_id|>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}" + tok.chat_template)
    conv = Conversation("t", MULTI[1:3], tools=TOOLS)
    report = SkipReport()
    chat = ChatTokenizer(tok, template_kwargs={"enable_thinking": False})
    sample = chat(conv, report)
    text = tok.decode(sample.input_ids)
    assert "lookup_weather" in text and "/no_think" in text
    assert masked_runs(tok, sample) == expected("llama3", MULTI[1:3])  # the tools block carries no loss
    assert report.unrendered == {f"reasoning_content ({chat.template_name})": 1}  # this template drops it
    plain = ChatTokenizer(make_tokenizer("llama3"))  # renders no tools: counted, the sample kept
    plain(conv, report)
    assert report.unrendered[f"tools ({plain.template_name})"] == 1
    assert "left out by the chat template (kept, not trained): reasoning_content" in report.summary()


CALL = [{"type": "function", "function": {"name": "lookup_weather", "arguments": "{\"city\": \"Oslo\"}"}}]
TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": CALL},             # a tool call with empty content
    {"role": "tool", "content": "rain, 4 degrees"},
    {"role": "assistant", "content": "It rains in Oslo, 4 degrees."},       # the answer after the tool result
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": CALL},  # content and a tool call
]


@pytest.mark.parametrize("style,trained", [
    ("glm", ["<tool_call>lookup_weather\n{\"city\": \"Oslo\"}</tool_call>", "It rains in Oslo, 4 degrees.",
             "Let me check.<tool_call>lookup_weather\n{\"city\": \"Oslo\"}</tool_call>"]),
    ("deepseek", ["<|tool_call|>lookup_weather:{\"city\": \"Oslo\"}<|end_of_sentence|>",
                  "It rains in Oslo, 4 degrees.<|end_of_sentence|>",
                  "Let me check.<|tool_call|>lookup_weather:{\"city\": \"Oslo\"}<|end_of_sentence|>"]),
])
def test_tool_call_turns_and_answers_after_tool_results_are_trained(style, trained, make_tokenizer):
    """Every assistant token is trained whatever the template's shape: with no end-of-turn token (GLM) the span runs
    to the next turn's tag, tool-call blocks and empty-content tool-call turns included; an answer the template
    writes with no header after a tool result (DeepSeek-V3) starts where the tool output ends."""
    tok = copy.deepcopy(make_tokenizer("llama3"))
    tok.chat_template = {"glm": GLM_STYLE, "deepseek": DEEPSEEK_STYLE}[style]
    chat = ChatTokenizer(tok)
    text, spans = chat.assistant_spans(TOOL_TURNS)
    assert [text[a:b] for a, b in spans] == trained
    sample = chat(Conversation("t", TOOL_TURNS))
    masked = "".join(masked_runs(tok, sample))
    assert all(t in masked for t in trained) and "What is the weather" not in masked and "rain, 4" not in masked


def test_inline_think_is_split_into_reasoning_for_templates_that_render_it(make_tokenizer):
    """Reasoning written inline (`<think>…</think>` at the start of content) reaches a template that renders
    reasoning_content (Kimi style) as reasoning, trained as the same turn written with reasoning_content; a template
    that renders no reasoning (Llama-3 style) keeps the content as written."""
    inline = [MULTI[1], {"role": "assistant", "content": "<think>add them</think>The sum of 2 and 3 is 5."}]
    split = [MULTI[1], {"role": "assistant", "content": "The sum of 2 and 3 is 5.", "reasoning_content": "add them"}]
    kimi = ChatTokenizer(make_tokenizer("kimi"))
    assert kimi.renders_reasoning
    a, b = kimi(Conversation("inline", inline)), kimi(Conversation("split", split))
    assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
    assert masked_runs(kimi.tokenizer, a) == ["<think>add them</think>The sum of 2 and 3 is 5.<|im_end|>"]
    llama = ChatTokenizer(make_tokenizer("llama3"))
    assert not llama.renders_reasoning
    assert masked_runs(llama.tokenizer, llama(Conversation("inline", inline))) == \
        ["<think>add them</think>The sum of 2 and 3 is 5.<|eot_id|>"]


def test_json_string_tool_arguments_become_a_mapping_for_templates_that_encode_them(make_tokenizer):
    """OpenAI rows carry tool arguments as a JSON string; a template that JSON-encodes them itself (Qwen style,
    `arguments | tojson`) gets the mapping, so it writes {"city": "Oslo"} as the model does, not an escaped string;
    a template that writes them as given (Kimi style) keeps the string."""
    tok = copy.deepcopy(make_tokenizer("chatml"))
    tok.chat_template = tok.chat_template.replace(
        "{{ m.content + '<|im_end|>\\n' }}",
        "{{ m.content }}{% for t in m.tool_calls or [] %}<tool_call>{{ {'name': t.function.name, "
        "'arguments': t.function.arguments} | tojson }}</tool_call>{% endfor %}{{ '<|im_end|>\\n' }}")
    call = [{"type": "function", "function": {"name": "lookup_weather", "arguments": "{\"city\": \"Oslo\"}"}}]
    turns = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": call}]
    qwen = ChatTokenizer(tok)
    assert qwen.tool_arguments_as_mapping
    assert masked_runs(tok, qwen(Conversation("q", turns))) == \
        ['<tool_call>{"name": "lookup_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>']
    kimi = ChatTokenizer(make_tokenizer("kimi"))
    assert not kimi.tool_arguments_as_mapping
    text, _ = kimi.assistant_spans(turns)
    assert '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>' in text


def test_a_template_without_end_token_trains_the_tag_the_model_stops_on(make_tokenizer, tmp_path):
    """GLM-4 writes no end-of-turn token; the model ends a turn by emitting the next turn's tag (<|user|> or
    <|observation|>, eos ids in its generation_config). That tag is trained where the render shows it; the
    turn that ends the conversation has none to train."""
    import json

    from data.target import stop_token_ids
    tok = copy.deepcopy(make_tokenizer("llama3"))
    tok.chat_template = GLM_STYLE
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|observation|>", "<|assistant|>"]})
    ids = tok.convert_tokens_to_ids(["<|user|>", "<|observation|>"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, *ids]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    assert stop_token_ids(tmp_path) == [tok.eos_token_id, *ids]  # generation_config's list wins
    chat = ChatTokenizer(tok, stop_tokens=tok.convert_ids_to_tokens(stop_token_ids(tmp_path)))
    text, spans = chat.assistant_spans(TOOL_TURNS)
    assert [text[a:b] for a, b in spans] == [
        "<tool_call>lookup_weather\n{\"city\": \"Oslo\"}</tool_call><|observation|>",
        "It rains in Oslo, 4 degrees.<|user|>",
        "Let me check.<tool_call>lookup_weather\n{\"city\": \"Oslo\"}</tool_call>"]  # the end: no tag shown
    sample = chat(Conversation("t", TOOL_TURNS))
    masked = masked_runs(tok, sample)
    assert masked[0].endswith("</tool_call><|observation|>") and masked[1] == "It rains in Oslo, 4 degrees.<|user|>"
    assert not ChatTokenizer(make_tokenizer("llama3"), stop_tokens=["<|eot_id|>"]).stop_tokens  # it has an end marker
