import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.conversations import MalformedSample, SkipReport, load_conversations

OPENAI = {"id": "a", "messages": [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "hello", "reasoning_content": "greet"}]}
SHAREGPT = {"id": "b", "system": "sys", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                                          {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}
PARTS = {"id": "c", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                                 {"role": "assistant", "content": "z"}]}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_shapes_normalise_to_messages(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [OPENAI, SHAREGPT, PARTS])
    report = SkipReport()
    convs = list(load_conversations([path], report))
    assert [c.id for c in convs] == ["a", "b", "c"]
    assert convs[0].messages[1] == {"role": "assistant", "content": "hello", "reasoning_content": "greet"}
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert convs[1].messages[0]["content"] == "sys"
    assert convs[2].messages[0]["content"] == "xy"
    assert report.read == 3 and report.kept == 3


def test_parquet_and_datasets_dir(tmp_path):
    import datasets
    rows = [{"id": str(i), "messages": OPENAI["messages"]} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for src in (tmp_path / "c.parquet", tmp_path / "ds"):
        report = SkipReport()
        convs = list(load_conversations([src], report))
        assert [c.id for c in convs] == [str(i) for i in range(5)] and report.kept == 5


BAD_ROWS = [
    ("{not json", "invalid_json", "invalid JSON"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role", "unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant_turn", "no assistant turn"),
    ({"text": "plain"}, "bad_row", "no 'messages' or 'conversations' field"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "x"}]},
     "non_text_content", "unsupported content part 'image_url'"),
]


@pytest.mark.parametrize("row,kind,message", BAD_ROWS)
def test_malformed_row_error_names_file_and_line(tmp_path, row, kind, message):
    path = write_jsonl(tmp_path / "c.jsonl", [OPENAI, row])
    with pytest.raises(MalformedSample, match=f"c.jsonl:2: {message}"):
        list(load_conversations([path], SkipReport()))


def test_skip_malformed_counts_every_reason(tmp_path):
    rows = [OPENAI] + [r for r, _, _ in BAD_ROWS] + [OPENAI]  # the last repeats id "a"
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    report = SkipReport()
    convs = list(load_conversations([path], report, skip_malformed=True))
    assert [c.id for c in convs] == ["a"]
    expected = {kind: 1 for _, kind, _ in BAD_ROWS} | {"duplicate_id": 1}
    assert dict(report.skipped) == expected
    assert report.read == len(rows) == report.kept + sum(report.skipped.values())
    assert report.examples[0].startswith(f"{path}:2: invalid_json")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(load_conversations([tmp_path / "nope.jsonl"], SkipReport()))
