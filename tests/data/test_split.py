"""The held-out split is by content: duplicates and near-duplicates never straddle it, no held-out prompt occurs in
training data, and the overlap figure counts a planted leak."""
import json

import pytest

from data.conversations import Conversation, normalize
from data.split import (SAMPLED_GROUP, HeldOutLeak, SplitRecord, check_no_overlap, held_out_group, normalise,
                        plan_split, text_key)


def conv(i: int, prompt: str, answer: str = "ok.", heldout: str | None = None, system: bool = False) -> Conversation:
    messages = ([{"role": "system", "content": "Be brief."}] if system else []) + \
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return Conversation(f"c{i}", messages, heldout)


def applied(convs: list[Conversation], fraction: float) -> tuple[SplitRecord, dict[str, str]]:
    """What the data stage does: plan, then keep or exclude each conversation; {id: 'train'|group|reason}."""
    plan = plan_split(convs, fraction)
    record, fate = SplitRecord(plan), {}
    for c in convs:
        reason = plan.exclusion(c)
        if reason:
            record.excluded[reason] += 1
            fate[c.id] = reason
        else:
            record.add(c)
            fate[c.id] = held_out_group(c, fraction) or "train"
    return record, fate


def test_normalised_text_ignores_case_spacing_and_unicode_forms():
    assert normalise("  What IS\t17 plus\n\n25? ") == "what is 17 plus 25?"
    assert text_key("ﬁle") == text_key("FILE")  # NFKC folds the ligature, casefold the case


def test_duplicates_and_near_duplicates_never_straddle_the_split():
    prompts = [f"What is {a} plus {b}?" for a in range(12) for b in range(12)]
    convs = []
    for i, p in enumerate(prompts):
        convs += [conv(3 * i, p), conv(3 * i + 1, p),  # verbatim duplicate: dropped
                  conv(3 * i + 2, "  " + p.upper().replace(" ", "   "), answer="Another answer.", system=True)]
    record, fate = applied(convs, 0.25)
    split = record.to_json()
    assert split["distinct_conversations"] == 2 * len(prompts)
    assert split["excluded"]["duplicate_content"] == len(prompts)
    sides = {}
    for c in convs:
        if fate[c.id] == "duplicate_content":
            continue
        sides.setdefault(text_key(c.messages[-2]["content"]), set()).add(fate[c.id])
    assert all(len(s) == 1 for s in sides.values())  # each prompt, however written, on one side
    held = sum(s == {SAMPLED_GROUP} for s in sides.values())
    assert 0.1 < held / len(prompts) < 0.4  # about the fraction, by prompt
    assert split["heldout_prompts"] == held and split["heldout_overlap_with_training"] == 0
    assert split["training_samples"] + split["heldout_samples"] == len(convs) - len(prompts)


def test_a_training_conversation_holding_a_heldout_prompt_is_excluded():
    fraction = 0.5
    prompts = [f"Spell the word {w}." for w in ("harbor", "falcon", "stone", "river", "tiger", "apple", "cloud")]
    held = next(p for p in prompts if held_out_group(conv(0, p), fraction))
    trained = next(p for p in prompts if not held_out_group(conv(0, p), fraction))
    leaking = Conversation("leak", [{"role": "user", "content": trained}, {"role": "assistant", "content": "h-a"},
                                    {"role": "user", "content": held.lower()}, {"role": "assistant", "content": "x"}])
    record, fate = applied([conv(1, held), conv(2, trained), leaking], fraction)
    assert fate == {"c1": SAMPLED_GROUP, "c2": "train", "leak": "contains_heldout_prompt"}
    assert record.to_json()["excluded"] == {"contains_heldout_prompt": 1}


def test_overlap_counts_a_planted_leak_and_evaluation_refuses_it():
    fraction = 0.5
    prompts = [f"Count from 1 to {n}." for n in range(2, 20)]
    held = next(p for p in prompts if held_out_group(conv(0, p), fraction))
    # planted: the held-out prompt also sits in a training sample, past the exclusion rule (as a bug would put it)
    record = SplitRecord(plan_split([conv(1, held)], fraction))
    record.add(conv(1, held))
    record.add(Conversation("planted", [{"role": "user", "content": "Hello."},
                                        {"role": "assistant", "content": held}]))
    split = record.to_json()
    assert split["heldout_overlap_with_training"] == 1
    with pytest.raises(HeldOutLeak, match="1 held-out samples have a prompt that occurs in the training data"):
        check_no_overlap(split, "split.json")
    clean = SplitRecord(plan_split([conv(1, held)], fraction))
    clean.add(conv(1, held))
    assert clean.to_json()["heldout_overlap_with_training"] == 0


def test_rows_name_their_own_heldout_group():
    row = {"id": "ood-1", "heldout": "unseen-families",
           "messages": [{"role": "user", "content": "What is 9 minus 4?"}, {"role": "assistant", "content": "5"}]}
    c = normalize(row, "f.jsonl:1")
    assert held_out_group(c, 0.0) == "unseen-families"
    record, _ = applied([c, conv(2, "What is 1 plus 1?")], 0.0)
    split = record.to_json()
    assert split["groups"] == {"unseen-families": {"samples": 1, "prompts": 1}}
    assert split["heldout"] == [{"id": "ood-1", "group": "unseen-families",
                                 "prompt": [{"role": "user", "content": "What is 9 minus 4?"}]}]
    json.dumps(split)  # what the data stage writes
    with pytest.raises(ValueError, match="'heldout' must be a non-empty group name"):
        normalize(row | {"heldout": 3}, "f.jsonl:2")
