"""Property-based tests (hypothesis) of the conversation parser and the assistant loss-mask builder."""
import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.chat import ChatTokenizer
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
