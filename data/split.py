"""Held out by content: which conversations the drafter never trains on, decided by what they say, not by ids.

The rule (SPLIT_RULE, written into RUN_DIR/data/split.json and every report that quotes a held-out figure):
- text is normalised (Unicode NFKC, case-folded, whitespace runs collapsed to one space, trimmed);
- conversations whose messages are identical after normalisation are one conversation: the first is kept, the
  others are dropped and counted (`duplicate_content`);
- a conversation is held out when the xxh64 hash of its normalised prompt (first user turn) is below
  fraction x 2^64, or when its row names a held-out group (`"heldout": "NAME"`: prompts kept for evaluation
  only, such as task families the training data lacks). Conversations sharing a prompt, verbatim or up to case
  and spacing, therefore always land on the same side;
- a training conversation that has any message equal to a user turn of a held-out conversation is dropped from
  training and counted (`contains_heldout_prompt`), so no evaluation prompt occurs as content in training data.
The overlap figure (`heldout_overlap_with_training`) is counted afterwards from what the data stage wrote: held-out
user turns equal to a message of a written training sample. It is 0 by this rule; the evaluate stage refuses to
report an accept length when it is not.
"""
from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import xxhash

from .conversations import Conversation
from .files import atomic_write_json, read_json

SAMPLED_GROUP = "sampled"  # held out by the prompt hash; other group names come from the rows themselves
SPLIT_RULE = ("held out when xxh64(normalised first user turn) < fraction x 2^64 or the row names a held-out group; "
              "normalised = NFKC, case-folded, whitespace collapsed; conversations with identical normalised "
              "messages are deduplicated (first kept); training conversations with a message equal to a held-out "
              "user turn are dropped")
_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_key(text: str) -> int:
    return xxhash.xxh64_intdigest(normalise(text).encode())


def message_text(message: dict) -> str:
    """What the model sees of a message: its content, reasoning and tool calls."""
    parts = [message.get("content") or "", message.get("reasoning_content") or ""]
    if message.get("tool_calls"):
        parts.append(json.dumps(message["tool_calls"], sort_keys=True))
    return "\n".join(p for p in parts if p)


def content_key(conv: Conversation) -> int:
    """Identity of a conversation's content: the normalised role and text of every message."""
    h = xxhash.xxh64()
    for m in conv.messages:
        h.update(f"{m['role']}\x00{normalise(message_text(m))}\x01".encode())
    return h.intdigest()


def prompt_of(messages: list[dict]) -> str:
    """The prompt a conversation is held out by: its first user turn."""
    return next(m["content"] for m in messages if m["role"] == "user")


def held_out_group(conv: Conversation, fraction: float) -> str | None:
    """The held-out group a conversation belongs to, or None when it is training data."""
    if conv.heldout:
        return conv.heldout
    return SAMPLED_GROUP if text_key(prompt_of(conv.messages)) < fraction * 2 ** 64 else None


def user_turn_keys(conv: Conversation) -> set[int]:
    return {text_key(m["content"]) for m in conv.messages if m["role"] == "user"}


def message_keys(conv: Conversation) -> set[int]:
    return {text_key(message_text(m)) for m in conv.messages}


@dataclass
class SplitPlan:
    """What the first pass over the conversations decided; the data stage applies it while tokenizing."""
    fraction: float
    duplicates: set[str] = field(default_factory=set)        # ids of conversations dropped as duplicates
    heldout_user_turns: set[int] = field(default_factory=set)  # keys of every user turn of a held-out conversation
    read: int = 0

    def exclusion(self, conv: Conversation) -> str | None:
        """Why this conversation is left out of the data, or None."""
        if conv.id in self.duplicates:
            return "duplicate_content"
        if held_out_group(conv, self.fraction) is None and message_keys(conv) & self.heldout_user_turns:
            return "contains_heldout_prompt"
        return None


def plan_split(conversations: Iterable[Conversation], fraction: float) -> SplitPlan:
    plan, seen = SplitPlan(fraction), set()
    for conv in conversations:
        plan.read += 1
        key = content_key(conv)
        if key in seen:
            plan.duplicates.add(conv.id)
            continue
        seen.add(key)
        if held_out_group(conv, fraction) is not None:
            plan.heldout_user_turns |= user_turn_keys(conv)
    return plan


class SplitRecord:
    """The split of the samples the data stage wrote, and the overlap counted from them."""

    def __init__(self, plan: SplitPlan):
        self.plan = plan
        self.heldout: list[dict] = []  # {"id", "group", "prompt"}: the prompt as messages up to the first user turn
        self.training_samples = 0
        self.training_message_keys: set[int] = set()
        self.excluded: Counter = Counter()

    def add(self, conv: Conversation) -> None:
        group = held_out_group(conv, self.plan.fraction)
        if group is None:
            self.training_samples += 1
            self.training_message_keys |= message_keys(conv)
        else:
            row = {"id": conv.id, "group": group, "prompt": first_turn(conv.messages),
                   "user_turns": sorted(user_turn_keys(conv))}
            self.heldout.append(row | ({"tools": conv.tools} if conv.tools else {}))

    def to_json(self) -> dict:
        groups: dict[str, dict] = {}
        for row in self.heldout:
            g = groups.setdefault(row["group"], {"samples": 0, "prompts": set()})
            g["samples"] += 1
            g["prompts"].add(text_key(prompt_of(row["prompt"])))
        return {"rule": SPLIT_RULE, "fraction": self.plan.fraction, "conversations_read": self.plan.read,
                "distinct_conversations": self.plan.read - len(self.plan.duplicates),
                "excluded": dict(sorted(self.excluded.items())),  # duplicate_content, contains_heldout_prompt
                "training_samples": self.training_samples,
                "heldout_samples": len(self.heldout),
                "heldout_prompts": len(set().union(*(g["prompts"] for g in groups.values()))),
                "groups": {k: {"samples": v["samples"], "prompts": len(v["prompts"])}
                           for k, v in sorted(groups.items())},
                "heldout_overlap_with_training": overlap(self.heldout, self.training_message_keys),
                "heldout": [{k: r[k] for k in ("id", "group", "prompt", "tools") if k in r} for r in self.heldout]}


def split_line(split: dict) -> str:
    groups = {g: v["samples"] for g, v in split["groups"].items()}
    return (f"{split['training_samples']} training / {split['heldout_samples']} held-out samples "
            f"({split['heldout_prompts']} distinct held-out prompts, by group {groups}); "
            f"{split['distinct_conversations']} distinct conversations of {split['conversations_read']}, excluded "
            f"{split['excluded'] or 'none'}; held-out overlap with training {split['heldout_overlap_with_training']}")


def overlap(heldout: list[dict], training_message_keys: set[int]) -> int:
    """Held-out samples with a user turn equal (normalised) to a message of some training sample."""
    return sum(bool(set(r["user_turns"]) & training_message_keys) for r in heldout)


def first_turn(messages: list[dict]) -> list[dict]:
    """The conversation up to and including its first user message (system prompt kept): what is decoded."""
    out = []
    for m in messages:
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            break
    return out


def write_split(path: Path, record: SplitRecord) -> dict:
    split = record.to_json()
    atomic_write_json(path, split)
    return split


class HeldOutLeak(RuntimeError):
    pass


def read_split(path: str | Path) -> dict:
    """RUN_DIR/data/split.json, as the data stage wrote it."""
    split = read_json(path)
    if split is None:
        raise FileNotFoundError(f"{path}: no split record; run the data stage again (it decides the held-out split)")
    return split


def primary_group(groups) -> str:
    """The group figures are quoted and timed on: the in-distribution held-out prompts where there are any."""
    return SAMPLED_GROUP if SAMPLED_GROUP in groups else next(iter(groups))


def heldout_ids(split: dict) -> set[str]:
    return {r["id"] for r in split["heldout"]}


def split_digest(split: dict) -> str:
    """Identity of a split: the held-out ids. The train stage records it; evaluate checks it was trained with it."""
    return xxhash.xxh3_64_hexdigest("\n".join(sorted(heldout_ids(split))).encode())


def check_no_overlap(split: dict, where: str) -> None:
    if split["heldout_overlap_with_training"]:
        raise HeldOutLeak(f"{where}: {split['heldout_overlap_with_training']} held-out samples have a prompt that "
                          f"occurs in the training data; no held-out figure is reported (split rule: {split['rule']})")
