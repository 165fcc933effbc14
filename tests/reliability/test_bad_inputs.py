"""Bad inputs: each one a clear error naming its place (file:line, sample, shard, key), or a counted skip
where the user asked for skipping; and property-based tests of the conversation parser and loss masks."""
import copy
import json

import pytest
import torch

from data.chat import ChatTokenizer
from data.config import ConfigError, load_config
from data.conversations import Conversation, MalformedSample, SkipReport, load_conversations
from data.shards import ShardDataset, ShardError, ShardMeta, ShardWriter, write_manifest
from tests.data.test_shards import make_dataset

GOOD = {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
ROWS = {  # bad line 2 of a JSONL file: (raw bytes, skip reason, what the error says)
    "malformed JSON line": (b"{not json", "invalid_json", "c.jsonl:2: invalid JSON"),
    "wrong role name": (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "unknown_role",
                        "c.jsonl:2: unknown role 'wizard'"),
    "empty conversation": (b'{"messages": []}', "bad_row", "c.jsonl:2: the message list is empty"),
    "conversation without an assistant turn": (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                                               "no_assistant_turn", "c.jsonl:2: no assistant turn"),
    "non-UTF-8 bytes": (b'{"messages": "\xff\xfe"}', "invalid_utf8", r"c.jsonl:2: not valid UTF-8 \(byte 14\)"),
}


@pytest.mark.parametrize("case", sorted(ROWS))
def test_bad_conversation_rows_name_file_and_line_or_are_counted(case, tmp_path, survival):
    raw, reason, message = ROWS[case]
    path = tmp_path / "c.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + raw + b"\n" + json.dumps(GOOD | {"id": "ok2"}).encode() + b"\n")
    with pytest.raises(MalformedSample, match=message):
        list(load_conversations([path], SkipReport()))
    report = SkipReport()
    kept = [c.id for c in load_conversations([path], report, skip_malformed=True)]
    assert kept == ["ok", "ok2"] and dict(report.skipped) == {reason: 1} and report.read == 3
    survival(f"bad input: {case}", 1, 1)


def shard_dir(directory, **meta_kw):
    make_dataset(directory, **meta_kw)
    return directory


def _truncated(tmp_path):
    d = shard_dir(tmp_path / "a")
    shard = d / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    ShardDataset(d)


def _bit_flipped(tmp_path):
    d = shard_dir(tmp_path / "a")
    shard = d / "shard-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    ShardDataset(d, verify=True)


def _outside_path(tmp_path):
    d = shard_dir(tmp_path / "a")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["shards"][0]["file"] = "../../etc/passwd"
    (d / "manifest.json").write_text(json.dumps(manifest))
    ShardDataset(d)


def _template_raises(shared_tokenizer):
    tokenizer = copy.deepcopy(shared_tokenizer)  # the session's tokenizer keeps its template
    tokenizer.chat_template = ("{% for m in messages %}{% if m['content'] == 'boom' %}"
                               "{{ raise_exception('boom is not allowed') }}{% endif %}{% endfor %}"
                               + tokenizer.chat_template)
    ChatTokenizer(tokenizer)(Conversation("s7", [{"role": "user", "content": "boom"},
                                                 {"role": "assistant", "content": "x"}]))


def _drafter(tiny_target, how: str):
    from data.config import DrafterConfig
    from data.target import load_target_info
    from serve.drafter_dir import expected_shapes, validate
    from train.drafter import drafter_config
    config = drafter_config(load_target_info(tiny_target), DrafterConfig(), 16, [0, 1, 2])
    tensors = {k: torch.zeros(s) for k, s in expected_shapes(config).items()}
    tensors["d2t"], tensors["t2d"] = torch.zeros(16, dtype=torch.int64), torch.zeros(config.vocab_size, dtype=torch.bool)
    tensors["t2d"][:16] = True
    validate(config, dict(tensors), "ok")  # the unbroken one passes
    if how == "missing":
        del tensors["midlayer.mlp.up_proj.weight"]
    elif how == "extra":
        tensors["midlayer.self_attn.rotary.inv_freq"] = torch.zeros(4)
    elif how == "shape":
        tensors["fc.weight"] = torch.zeros(3, 3)
    else:
        del tensors["d2t"]
    validate(config, tensors, "drafter-dir")


CASES = {  # name: (what raises, the error it raises, the words that name the place)
    "over-long sample (overflow: drop)": None,  # a counted skip, below
    "chat template that raises": (lambda f: _template_raises(f["tok"]), MalformedSample,
                                  "sample s7: chat template: boom is not allowed"),
    "truncated shard": (lambda f: _truncated(f["tmp"]), ShardError, r"shard-00000.arrow: .*truncated"),
    "bit-flipped shard": (lambda f: _bit_flipped(f["tmp"]), ShardError, "shard-00000.arrow: checksum mismatch"),
    "shards of another target": (lambda f: ShardDataset(shard_dir(f["tmp"] / "a"), shard_dir(
        f["tmp"] / "b", target_config_hash="other")), ShardError, "b/manifest.json: target_config_hash"),
    "shards of another layer set": (lambda f: ShardDataset(shard_dir(f["tmp"] / "a"), shard_dir(
        f["tmp"] / "b", aux_layer_ids=[2, 4, 6])), ShardError, "b/manifest.json: aux_layer_ids"),
    "manifest naming a path outside the dataset": (lambda f: _outside_path(f["tmp"]), ShardError,
                                                   "shard path '../../etc/passwd' is not a file name inside"),
    "unknown config key": (lambda f: load_config(None, ["--train.nope=1"]), ConfigError, "train.nope"),
    "aux layer id >= number of layers": (lambda f: __import__("data.target").target.load_target_info(
        f["target"]).aux_layer_ids([0, 1, 9]), ValueError, r"target.aux_layer_ids: \[9\] outside 0..3"),
    "draft vocab > target vocab": (lambda f: __import__("data.vocab").vocab.build_draft_vocab(
        torch.ones(100), 101), ValueError, "draft_vocab_size 101 must be in 1..100"),
    "TTT length 0": (lambda f: load_config(None, ["--train.ttt_steps=0"]), ConfigError, "train.ttt_steps"),
    "drafter dir: missing tensor": (lambda f: _drafter(f["target"], "missing"), ValueError,
                                    "(?s)drafter-dir: .*missing tensor midlayer.mlp.up_proj.weight"),
    "drafter dir: extra tensor": (lambda f: _drafter(f["target"], "extra"), ValueError,
                                  "unexpected tensor midlayer.self_attn.rotary.inv_freq"),
    "drafter dir: mis-shaped tensor": (lambda f: _drafter(f["target"], "shape"), ValueError,
                                       r"fc.weight has shape \[3, 3\]"),
    "drafter dir: no d2t": (lambda f: _drafter(f["target"], "no d2t"), ValueError, "missing tensor d2t"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_inputs_are_clear_errors_naming_the_place(case, tmp_path, tiny_target, make_tokenizer, survival):
    if CASES[case] is None:
        tok = make_tokenizer("chatml")
        chat, report = ChatTokenizer(tok, max_length=8, overflow="drop"), SkipReport()
        sample = chat(Conversation("long", [{"role": "user", "content": "tell me " * 20},
                                            {"role": "assistant", "content": "ok " * 20}]))
        assert chat.fit(sample, report) is None and dict(report.skipped) == {"too_long": 1}
    else:
        fn, error, words = CASES[case]
        with pytest.raises(error, match=words):
            fn({"tmp": tmp_path, "target": tiny_target, "tok": make_tokenizer("chatml")})
    survival(f"bad input: {case}", 1, 1)


@pytest.mark.parametrize("case", ["token ids beyond the vocab", "another target's config"])
def test_samples_of_another_tokenizer_are_refused_by_extraction(case, tiny_target, tmp_path, survival):
    from extract.job import run
    meta = ShardMeta(kind="tokens", target_id="other",
                     target_config_hash="0123456789abcdef" if case == "another target's config" else "")
    samples = tmp_path / "run" / "data" / "samples"
    samples.mkdir(parents=True)
    with ShardWriter(samples / "shard-00000.arrow", meta) as w:
        w.write("s0", [1, 2, 3], [0, 1, 1])
        w.write("s1", [1, 5000, 3], [0, 1, 1])  # beyond the tiny target's vocab
        info = w.close()
    write_manifest(samples, meta, [info])
    cfg = load_config(None, [f"--run_dir={tmp_path / 'run'}", f"--target.path={tiny_target}", "--data.inputs=[x]",
                             "--target.aux_layer_ids=[0,1,2]"])
    words = "sample s1: token id 5000 >= the target's vocab size .* another tokenizer" \
        if case == "token ids beyond the vocab" else "samples were prepared for target other .*run the data stage again"
    with pytest.raises(ValueError, match=words):
        run(cfg)
    assert not list((tmp_path / "run" / "features").glob("*.arrow"))
    survival(f"bad input: samples tokenized for another target ({case})", 1, 1)
