"""Load conversations from JSONL, Parquet or a `datasets` directory, in OpenAI or ShareGPT shape.

Every row either becomes a normalised `Conversation` or is reported: by default the first malformed
row stops the run with an error naming file and line; with `skip_malformed` it is skipped and counted.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool",
}


class MalformedSample(ValueError):
    def __init__(self, where: str, reason: str, kind: str = "malformed"):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.kind = where, reason, kind


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, Any]]  # role, content, optional reasoning_content / tool_calls / name
    heldout: str | None = None      # a held-out group named by the row: evaluated, never trained on (data/split.py)
    tools: list[dict] | None = None  # the row's tool declarations (OpenAI `tools`): the template renders them


@dataclass
class SkipReport:
    """Counts of what was read and what was skipped, by reason; written into manifests."""
    read: int = 0
    truncated: int = 0  # kept, but cut to the length budget
    skipped: Counter = field(default_factory=Counter)
    unrendered: Counter = field(default_factory=Counter)  # kept, but the chat template left this out of the text
    examples: list[str] = field(default_factory=list)  # the first few skipped rows, file:line: reason

    @property
    def kept(self) -> int:
        return self.read - sum(self.skipped.values())

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))

    def to_json(self) -> dict:
        return {"read": self.read, "kept": self.kept, "truncated": self.truncated,
                "skipped": dict(sorted(self.skipped.items())),
                "unrendered_by_template": dict(sorted(self.unrendered.items())), "examples": self.examples}

    def summary(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        unrendered = ", ".join(f"{k}={v}" for k, v in sorted(self.unrendered.items()))
        return f"{self.read} read, {self.kept} kept ({self.truncated} truncated), skipped: {skipped}" + \
            (f"; left out by the chat template (kept, not trained): {unrendered}" if unrendered else "")


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MalformedSample(where, f"unsupported content part {kind!r} (text only)", "non_text_content")
            texts.append(part["text"])
        return "".join(texts)
    raise MalformedSample(where, f"content must be a string, got {type(content).__name__}", "bad_content")


def _message(raw: Any, where: str, sharegpt: bool) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise MalformedSample(where, f"a message must be an object, got {type(raw).__name__}", "bad_message")
    if sharegpt:
        role = SHAREGPT_ROLES.get(str(raw.get("from", "")).lower())
        content = raw.get("value")
        if role is None:
            raise MalformedSample(where, f"unknown ShareGPT speaker {raw.get('from')!r}", "unknown_role")
    else:
        role, content = raw.get("role"), raw.get("content")
        if role not in ROLES:
            raise MalformedSample(where, f"unknown role {role!r}", "unknown_role")
    msg: dict[str, Any] = {"role": role, "content": _text(content, where)}
    reasoning = raw.get("reasoning_content", raw.get("reasoning"))
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise MalformedSample(where, "reasoning_content must be a string", "bad_content")
        msg["reasoning_content"] = reasoning
    if raw.get("tool_calls"):
        msg["tool_calls"] = raw["tool_calls"]
    if raw.get("name") is not None:
        msg["name"] = raw["name"]
    if msg["content"] is None:
        if role != "assistant" or "tool_calls" not in msg:
            raise MalformedSample(where, f"{role} message without content", "bad_content")
        msg["content"] = ""
    return msg


def normalize(row: Any, where: str) -> Conversation:
    """One row in OpenAI (`messages`) or ShareGPT (`conversations`) shape → Conversation."""
    if not isinstance(row, dict):
        raise MalformedSample(where, f"a row must be an object, got {type(row).__name__}", "bad_row")
    if row.get("messages") is not None:
        raws, sharegpt = row["messages"], False
    elif row.get("conversations") is not None:
        raws, sharegpt = row["conversations"], True
    else:
        raise MalformedSample(where, "no 'messages' or 'conversations' field", "bad_row")
    if not isinstance(raws, list) or not raws:
        raise MalformedSample(where, "the message list is empty or not a list", "bad_row")
    messages = [_message(m, where, sharegpt) for m in raws]
    if isinstance(row.get("system"), str) and row["system"] and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": row["system"]})
    if any(m["role"] == "system" for m in messages[1:]):
        raise MalformedSample(where, "a system message after the first position", "misplaced_system")
    if not any(m["role"] == "user" for m in messages):
        raise MalformedSample(where, "no user turn", "no_user_turn")
    if not any(m["role"] == "assistant" for m in messages):
        raise MalformedSample(where, "no assistant turn", "no_assistant_turn")
    tools = row.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise MalformedSample(where, "'tools' must be a list of tool declarations (objects)", "bad_row")
    heldout = row.get("heldout")
    if heldout is not None and (not isinstance(heldout, str) or not heldout):
        raise MalformedSample(where, "'heldout' must be a non-empty group name", "bad_row")
    sample_id = row.get("id", row.get("sample_id"))
    return Conversation(id=str(sample_id) if sample_id is not None else where, messages=messages, heldout=heldout,
                        tools=tools)


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) pairs; `where` is file:line for JSONL, file:row for the others (1-based)."""
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        import datasets
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise MalformedSample(str(path), f"a DatasetDict; name one split directory ({', '.join(ds)})")
        for i, row in enumerate(ds, 1):
            yield f"{path}:row {i}", row
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise FileNotFoundError(f"{path}: no .jsonl or .parquet files")
        for f in files:
            yield from _rows(f)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq
        row_no = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                row_no += 1
                yield f"{path}:row {row_no}", row
    elif path.suffix in (".jsonl", ".json"):
        with open(path, "rb") as fh:  # decoded per line, so a bad byte names its line
            for line_no, raw in enumerate(fh, 1):
                where = f"{path}:{line_no}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield where, MalformedSample(where, f"not valid UTF-8 (byte {e.start})", "invalid_utf8")
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    yield where, MalformedSample(where, f"invalid JSON: {e.msg} at column {e.colno}", "invalid_json")
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    else:
        raise ValueError(f"{path}: unsupported file type (expected .jsonl, .parquet or a datasets directory)")


def load_conversations(paths: Iterable[str | Path], report: SkipReport,
                       skip_malformed: bool = False) -> Iterator[Conversation]:
    """Yield normalised conversations; malformed rows raise (naming file:line) or are skipped and counted."""
    seen: set[str] = set()
    for path in paths:
        for where, row in _rows(Path(path)):
            report.read += 1
            try:
                if isinstance(row, MalformedSample):
                    raise row
                conv = normalize(row, where)
                if conv.id in seen:
                    raise MalformedSample(where, f"duplicate sample id {conv.id!r}", "duplicate_id")
            except MalformedSample as e:
                if not skip_malformed:
                    raise
                report.skip(e.kind, where, e.reason)
                continue
            seen.add(conv.id)
            yield conv
