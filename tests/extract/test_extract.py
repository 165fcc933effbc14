"""`torchrun -m extract` on tiny Llama and DeepseekV3 (MLA + MoE) targets built here, on CPU."""
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.shards import MANIFEST, ShardDataset, ShardError
from launch.demo_target import DEEPSEEK_V3_SGLANG_FIELDS, make_conversations

ROOT = Path(__file__).resolve().parents[2]
# SGLang serves DeepseekV3 targets only ids starting with 1 (data.target.sglang_captured_outputs); id L-1 never
LAYERS = {"llama": [0, 1, 2], "deepseek_v3": [1, 2, 3]}


def build_deepseek(out: Path, tok) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=5, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                           max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           **DEEPSEEK_V3_SGLANG_FIELDS)
    DeepseekV3ForCausalLM(cfg).save_pretrained(str(out))
    tok.save_pretrained(str(out))


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def prepared(request, tiny_target, make_tokenizer, tmp_path_factory):
    """A run dir whose data stage is done, for each target architecture."""
    base = tmp_path_factory.mktemp(request.param)
    target = tiny_target
    if request.param == "deepseek_v3":
        target = base / "target"
        build_deepseek(target, make_tokenizer("llama3"))
    convs = base / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(48, seed=5)))
    cfg = {"run_dir": str(base / "run"), "target": {"path": str(target), "aux_layer_ids": LAYERS[request.param]},
           "data": {"inputs": [str(convs)], "max_length": 128, "draft_vocab_size": 64},
           "extract": {"samples_per_shard": 5}}
    path = base / "run.yaml"
    path.write_text(json.dumps(cfg))
    subprocess.run([sys.executable, "-m", "data", "--config", str(path)], check=True, capture_output=True)
    return path, base / "run", target


def torchrun(config: Path, *overrides: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "extract", "--config", str(config), *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def extract_here(config: Path, *overrides: str) -> dict:
    """One rank, in this process (no torchrun, as a single-process run may be): for the tests about what is
    extracted rather than how ranks share it, without an interpreter start and a rendezvous per run."""
    from data.config import load_config
    from extract.job import run
    return run(load_config(config, list(overrides)))


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker (workers run in sessions of their own)."""
    import psutil
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in reversed(procs):
        p.send_signal(signal.SIGKILL)
    proc.communicate()


def snapshot(directory: Path) -> list:
    ds = ShardDataset(directory, verify=True)
    return [(s.sample_id, s.input_ids.clone(), s.aux_hidden.clone(), s.final_hidden.clone())
            for s in (ds[i] for i in range(len(ds)))]


def test_two_ranks_match_a_direct_forward_bit_exactly(prepared):
    config, run, target = prepared
    out = finish(torchrun(config, "--extract.max_batch_tokens", "1"))  # one sample per forward
    assert "[extract] rank 1/2" in out and "tokens_per_s" in out
    manifest = json.loads((run / "features" / MANIFEST).read_text())
    samples = ShardDataset(run / "data" / "samples")
    assert manifest["totals"]["rows"] == len(samples) and len(manifest["shards"]) == -(-len(samples) // 5)
    model_type = json.loads((target / "config.json").read_text())["model_type"]
    assert manifest["meta"]["aux_layer_ids"] == LAYERS[model_type] and manifest["meta"]["final_hidden"] == "post_norm"
    assert {r["rank"] for r in manifest["ranks"]} == {0, 1} and all(r["samples"] > 0 for r in manifest["ranks"])
    # the disk budget printed before extraction is what the shards then took (Arrow framing aside)
    budget = re.search(r"disk budget: ([\d,]+) tokens left x ([\d,]+) bytes/token", out)
    planned = int(budget[1].replace(",", "")) * int(budget[2].replace(",", ""))
    assert int(budget[1].replace(",", "")) == manifest["totals"]["tokens"]
    assert planned <= manifest["totals"]["bytes"] < planned * 1.05, (planned, manifest["totals"]["bytes"])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    features = ShardDataset(run / "features")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torchrun runs workers with OMP_NUM_THREADS=1; CPU reductions depend on it
    try:
        check_against_direct_forward(model, samples, features)
    finally:
        torch.set_num_threads(threads)


def check_against_direct_forward(model, samples, features):
    by_id = {samples[i].sample_id: samples[i] for i in range(len(samples))}
    assert sorted(features[i].sample_id for i in range(len(features))) == sorted(by_id)
    for i in range(0, len(features), 7):
        f = features[i]
        assert torch.equal(f.input_ids, by_id[f.sample_id].input_ids)
        with torch.no_grad():
            hs = model(f.input_ids.long()[None], output_hidden_states=True).hidden_states
        # SGLang id k = output of layer k
        expected = torch.cat([hs[k + 1][0] for k in LAYERS[model.config.model_type]], dim=-1)
        assert torch.equal(f.aux_hidden, expected), f.sample_id
        assert torch.equal(f.final_hidden, hs[-1][0])  # post-norm, as transformers returns the last entry


def forwards(target: Path, features: ShardDataset, every: int):
    """(sample, aux states, final state) of a direct fp32 forward for every `every`-th extracted sample."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for i in range(0, len(features), every):
        f = features[i]
        with torch.no_grad():
            hs = model(f.input_ids.long()[None], output_hidden_states=True).hidden_states
        yield f, torch.cat([hs[k + 1][0] for k in LAYERS[model.config.model_type]], -1), hs[-1][0]


def test_batched_forward_matches_closely_and_fp8_within_e4m3_precision_in_fewer_bytes(prepared):
    config, run, target = prepared
    shutil.rmtree(run / "features", ignore_errors=True)
    extract_here(config, "--extract.max_batch_tokens", "2048")
    raw_bytes = json.loads((run / "features" / MANIFEST).read_text())["totals"]["bytes"]
    for f, aux, _ in forwards(target, ShardDataset(run / "features"), 5):
        torch.testing.assert_close(f.aux_hidden, aux, atol=1e-5, rtol=1e-5)
    shutil.rmtree(run / "features")
    extract_here(config, "--extract.max_batch_tokens", "2048", "--extract.aux_encoding", "fp8_e4m3_rowscale")
    manifest = json.loads((run / "features" / MANIFEST).read_text())
    assert manifest["meta"]["aux_encoding"] == "fp8_e4m3_rowscale"
    # fp32 on CPU: 3 aux layers x 4 bytes per value become 1 byte + a 4-byte scale per layer and token
    assert manifest["totals"]["bytes"] < 0.5 * raw_bytes
    for f, aux, final in forwards(target, ShardDataset(run / "features"), 5):
        assert ((f.aux_hidden - aux).abs() <= aux.abs() * 2 ** -4 + 1e-3).all(), f.sample_id
        torch.testing.assert_close(f.final_hidden, final, atol=1e-5, rtol=1e-5)  # stays raw
    shutil.rmtree(run / "features")


# Resuming (shards, manifest, each rank's progress) does not depend on the target: one architecture here; the
# DeepseekV3 target's extraction is checked by the tests above (two ranks bit-exact, bf16 parity, fp8)
@pytest.mark.parametrize("prepared", ["llama"], indirect=True)
def test_kill_and_resume_equals_uninterrupted_and_a_truncated_shard_is_redone(prepared, tmp_path):
    config, run, _ = prepared
    one_per_shard = ("--extract.max_batch_tokens", "1", "--extract.samples_per_shard", "1")  # many kill points
    shutil.rmtree(run / "features", ignore_errors=True)
    finish(torchrun(config, *one_per_shard))
    reference = snapshot(run / "features")
    n_shards = len(json.loads((run / "features" / MANIFEST).read_text())["shards"])
    shutil.rmtree(run / "features")

    proc = torchrun(config, *one_per_shard)
    deadline = time.time() + 120
    while len(list((run / "features").glob(".shard-*.json"))) < 3 and time.time() < deadline:
        time.sleep(0.002)
    kill_tree(proc)
    done = len(list((run / "features").glob(".shard-*.json")))
    assert 0 < done < n_shards, "the kill must land mid-run"
    assert not (run / "features" / MANIFEST).exists()

    out = finish(torchrun(config, *one_per_shard))
    assert "already complete" in out
    resumed = snapshot(run / "features")
    assert [r[0] for r in resumed] == [r[0] for r in reference]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(resumed, reference) for k in (1, 2, 3))

    # a shard cut short on disk after its run completed: the reader refuses it, a re-run (here one rank of its
    # own, where two made it) extracts that shard again and only that one
    shard = run / "features" / "shard-00002.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ShardError, match="shard-00002.arrow"):
        ShardDataset(run / "features")
    untouched = {p.name: p.stat().st_mtime_ns for p in (run / "features").glob("shard-*.arrow") if p != shard}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's workers (OMP_NUM_THREADS=1): CPU reductions depend on it
    try:
        extract_here(config, *one_per_shard)
    finally:
        torch.set_num_threads(threads)
    assert {p.name: p.stat().st_mtime_ns for p in (run / "features").glob("shard-*.arrow") if p != shard} == untouched
    redone = snapshot(run / "features")
    assert [r[0] for r in redone] == [r[0] for r in reference]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(redone, reference) for k in (1, 2, 3))
    shutil.rmtree(run / "features")


def test_parity_between_fp32_and_bf16_features(prepared, tmp_path):
    config, run, _ = prepared
    from extract.parity import compare
    shutil.rmtree(run / "features", ignore_errors=True)
    extract_here(config, "--extract.dtype", "float32")
    shutil.copytree(run / "features", tmp_path / "fp32")
    shutil.rmtree(run / "features")
    extract_here(config, "--extract.dtype", "bfloat16")
    out = subprocess.run([sys.executable, "-m", "extract.parity", str(tmp_path / "fp32"), str(run / "features")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    rows = len(ShardDataset(tmp_path / "fp32"))  # the conversations less the duplicates the data stage dropped
    assert result["samples"] == rows > 40 and result["dtypes"] == ["float32", "bfloat16"]
    assert (result["a"], result["b"]) == (str(tmp_path / "fp32"), str(run / "features"))  # what was compared
    for name, r in result["layers"].items():  # bf16 rounding: close, but not equal
        assert 0.99 < r["cosine_min"] < 1.0 and 0 < r["max_abs_diff"] < 0.5, (name, r)
    same = compare(ShardDataset(tmp_path / "fp32"), ShardDataset(tmp_path / "fp32"))
    assert all(r["max_abs_diff"] == 0 for r in same["layers"].values())
    shutil.rmtree(run / "features")


def test_extraction_is_refused_when_the_disk_cannot_hold_the_features(tmp_path, capsys):
    from data.shards import ShardMeta
    from extract.job import bytes_per_token, check_disk_budget
    meta = ShardMeta(aux_layer_ids=[1, 29, 57], hidden_size=7168, dtype="bfloat16")  # Kimi-K2.5 / DeepSeek-V3
    assert bytes_per_token(meta) == 4 * 7168 * 2 + 5  # 57,349 bytes: 10K samples x 4K tokens = 2.3 TB
    check_disk_budget(tmp_path, 1000, bytes_per_token(meta), announce=True)  # 57 MB fits
    assert "disk budget: 1,000 tokens left x 57,349 bytes/token" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="refused: .* GB free, the features need"):
        check_disk_budget(tmp_path, 10 ** 12, bytes_per_token(meta), announce=False)


def test_non_finite_samples_are_skipped_counted_and_never_written(prepared, tmp_path, survival):
    """A target whose embedding of one token is NaN: every sample containing it is skipped and counted."""
    from data.config import load_config
    from extract.job import run
    config, run_dir, target = prepared
    samples = ShardDataset(run_dir / "data" / "samples")
    counts = torch.zeros(100_000, dtype=torch.long)
    for s in samples:
        counts[s.input_ids.long().unique()] += 1
    poisoned = int(((counts > 0) & (counts < len(samples) // 2)).nonzero()[0])  # in some samples, not most
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[poisoned] = float("nan")
    model.save_pretrained(str(tmp_path / "target"))
    shutil.copy(target / "config.json", tmp_path / "target" / "config.json")  # the same target config, other weights
    shutil.rmtree(run_dir / "features", ignore_errors=True)
    manifest = run(load_config(config, ["--target.path", str(tmp_path / "target"), "--extract.max_batch_tokens",
                                        "512"]))  # batches mix poisoned and clean samples
    hit = {s.sample_id for s in samples if poisoned in s.input_ids.tolist()}
    assert 0 < len(hit) < len(samples)
    assert manifest["skipped"] == {"non_finite": len(hit)} and manifest["totals"]["rows"] == len(samples) - len(hit)
    features = ShardDataset(run_dir / "features", verify=True)
    assert {f.sample_id for f in features} == {s.sample_id for s in samples} - hit
    assert all(torch.isfinite(f.aux_hidden).all() and torch.isfinite(f.final_hidden).all() for f in features)
    shutil.rmtree(run_dir / "features")
    survival(f"bad input: NaN hidden states ({run_dir.parent.name} target; skipped and counted)", 1, 1)


def test_a_killed_writers_temporaries_are_removed_by_the_owner_only(tmp_path):
    from extract.job import remove_stale_temporaries
    names = [".shard-00000.arrow.tmp-99999", "..shard-00000.json.tmp-99999", ".shard-00001.arrow.tmp-1", "shard-00000.arrow"]
    for name in names:
        (tmp_path / name).write_text("x")
    remove_stale_temporaries(tmp_path, {"shard-00000.arrow", ".shard-00000.json"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shard-00001.arrow.tmp-1", "shard-00000.arrow"]
