"""Property-based tests (hypothesis) of the conversation parser and the assistant loss-mask builder."""
import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.chat import ChatTokenizer, split_inline_reasoning
from data.conversations import MalformedSample, normalize

TEXT = st.text(alphabet=string.ascii_letters + string.digits + " .,!?'-éü中", min_size=1, max_size=24) \
    .map(str.strip).filter(bool)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def dialogues(draw) -> tuple[str | None, list[tuple[str, str]]]:
    """An optional system prompt and 1-4 (user, assistant) exchanges."""
    system = draw(st.none() | TEXT)
    return system, draw(st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4))


@SETTINGS
@given(dialogues(), st.booleans())
def test_openai_and_sharegpt_rows_normalise_to_the_same_messages(dialogue, sharegpt):
    system, turns = dialogue
    expected = ([{"role": "system", "content": system}] if system else []) + [
        {"role": role, "content": text} for u, a in turns for role, text in (("user", u), ("assistant", a))]
    if sharegpt:
        row = {"id": "x", "conversations": [{"from": {"user": "human", "assistant": "gpt", "system": "system"}[m["role"]],
                                             "value": m["content"]} for m in expected]}
    else:
        row = {"id": "x", "messages": expected}
    conv = normalize(json.loads(json.dumps(row)), "c.jsonl:1")
    assert [(m["role"], m["content"]) for m in conv.messages] == [(m["role"], m["content"]) for m in expected]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["id", "messages", "conversations", "role", "content", "from", "value", "x"]),
                        inner, max_size=4), max_leaves=12)


@SETTINGS
@given(JSON)
def test_any_json_row_is_a_conversation_or_a_named_malformed_sample(row):
    try:
        conv = normalize(row, "c.jsonl:7")
    except MalformedSample as e:
        assert str(e).startswith("c.jsonl:7: ") and e.kind
    else:
        assert any(m["role"] == "assistant" for m in conv.messages)


@SETTINGS
@given(dialogues())
def test_loss_mask_covers_every_assistant_reply_and_no_user_text(make_tokenizer, dialogue):
    system, turns = dialogue
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": role, "content": text} for u, a in turns for role, text in (("user", u), ("assistant", a))]
    tok = make_tokenizer("chatml")
    sample = ChatTokenizer(tok, max_length=10_000)(normalize({"id": "p", "messages": messages}, "p"))
    text = tok.apply_chat_template(messages, tokenize=False)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(sample.input_ids) == len(sample.loss_mask)
    covered = [False] * len(text)  # characters inside a token that carries loss
    for (a, b), m in zip(offsets, sample.loss_mask):
        for i in range(a, b):
            covered[i] = covered[i] or bool(m)
    cursor = 0
    for msg in messages:  # located independently: each message's content after its ChatML header, in order
        header = f"<|im_start|>{msg['role']}\n"
        at = text.index(header + msg["content"], cursor) + len(header)
        cursor = at + len(msg["content"])
        span = covered[at:cursor]
        if msg["role"] == "assistant":
            assert all(span), (msg, text)
        else:
            assert not any(span), (msg, text)


NAMES = st.sampled_from(["get_weather", "search_docs", "run_sql"])


@st.composite
def tool_dialogues(draw) -> list[dict]:
    """1-3 user turns, each answered directly or through a tool round: a call (content or none), its result, an
    answer. Contents carry a role prefix, so a content is never found inside a template's tags."""
    messages = []
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": "U: " + draw(TEXT)})
        if draw(st.booleans()):
            call = {"type": "function", "function": {"name": draw(NAMES), "arguments": "{}"}}
            messages += [{"role": "assistant", "content": draw(st.just("") | TEXT.map("A: ".__add__)),
                          "tool_calls": [call]},
                         {"role": "tool", "content": "T: " + draw(TEXT)}]
        answer = {"role": "assistant", "content": "A: " + draw(TEXT)}
        if draw(st.booleans()):
            answer["reasoning_content"] = "R: " + draw(TEXT)
        messages.append(answer)
    return messages


@SETTINGS
@given(tool_dialogues(), st.sampled_from(["glm", "deepseek", "kimi"]))
def test_tool_rounds_train_every_assistant_token_and_no_user_or_tool_text(make_tokenizer, messages, style):
    """Templates without an end-of-turn token (GLM-style), with header-less answers after tool results
    (DeepSeek-V3-style), and rendering reasoning only after the last user turn (Kimi-K2-style): every assistant
    content, tool call and rendered reasoning carries loss, no user or tool text does."""
    import copy

    from tests.templates import DEEPSEEK_STYLE, GLM_STYLE
    tok = copy.deepcopy(make_tokenizer("kimi" if style == "kimi" else "llama3"))  # the shared one keeps its template
    if style != "kimi":
        tok.chat_template = {"glm": GLM_STYLE, "deepseek": DEEPSEEK_STYLE}[style]
    chat = ChatTokenizer(tok, max_length=10_000)
    sample = chat(normalize({"id": "p", "messages": messages}, "p"))
    text = chat.render([split_inline_reasoning(m) for m in messages] if chat.renders_reasoning else messages)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    covered = [False] * len(text)
    for (a, b), m in zip(offsets, sample.loss_mask):
        for i in range(a, b):
            covered[i] = covered[i] or bool(m)
    cursor = 0
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for i, msg in enumerate(messages):
        # Kimi-style templates drop the reasoning of turns before the last user turn
        reasoning = msg.get("reasoning_content", "") if style != "kimi" or i > last_user else ""
        for piece in [reasoning if style == "kimi" else "", msg["content"]] + \
                [t["function"]["name"] for t in msg.get("tool_calls", [])]:
            if not piece:
                continue
            at = text.index(piece, cursor)
            cursor = at + len(piece)
            assert all(covered[at:cursor]) if msg["role"] == "assistant" else not any(covered[at:cursor]), \
                (style, msg, text)
