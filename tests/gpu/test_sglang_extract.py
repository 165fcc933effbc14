"""The sglang extraction backend against the hf backend on the same samples (GPU machine with SGLang 0.5.14)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _sglang_ready() -> bool:
    from extract.sglang import available
    return available()


NEEDS_SGLANG = pytest.mark.skipif(
    not torch.cuda.is_available() or not _sglang_ready(),
    reason="not run: the sglang extraction backend needs a GPU and sglang 0.5.14 (SGLang's kernels); "
           "run on the GPU machine with `source .sgl/sglang-env.sh`")


def extract_both_ways(tmp_path: Path, make_tokenizer, sglang_ranks: int, tp_size: int) -> dict:
    """The data and extract stages on 24 demo conversations, once with the hf backend (one rank) and once with
    the sglang backend (`sglang_ranks` torchrun ranks in groups of `tp_size`); returns extract.parity's report."""
    from launch.demo_target import build_tiny_llama, make_conversations
    tok = make_tokenizer("llama3")
    target = tmp_path / "target"  # head_dim 16: SGLang's triton attention kernels need at least 16
    tok.save_pretrained(str(target))
    build_tiny_llama(target, vocab_size=len(tok), hidden=64, layers=4, heads=4, seed=0,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(24, seed=3)))
    base = ["--target.path", str(target), "--target.aux_layer_ids", "[0, 1, 2]", "--data.inputs",
            f"[{convs}]", "--data.max_length", "256", "--data.draft_vocab_size", "64"]
    runs = {}
    for backend, ranks, tp in (("hf", 1, 1), ("sglang", sglang_ranks, tp_size)):
        run = tmp_path / backend
        args = [*base, "--run_dir", str(run), "--extract.backend", backend, "--extract.dtype", "bfloat16",
                "--extract.tp_size", str(tp), "--extract.samples_per_shard", "6"]
        # extraction under torchrun, as the pipeline runs it (SGLang's own process group must form inside it)
        for module in (["-m", "data"], ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                        str(ranks), "-m", "extract"]):
            out = subprocess.run([sys.executable, *module, "--config", str(ROOT / "launch/configs/demo.yaml"),
                                  "--data.regenerate.enabled", "false", *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=600)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[backend] = run / "features"
    manifest = json.loads((runs["sglang"] / "manifest.json").read_text())
    samples = json.loads((runs["sglang"].parent / "data" / "samples" / "manifest.json").read_text())["totals"]["rows"]
    assert manifest["meta"]["extra"]["backend"] == "sglang" and manifest["totals"]["rows"] == samples > 16
    from data.shards import ShardDataset
    from extract.parity import compare
    report = compare(ShardDataset(runs["hf"]), ShardDataset(runs["sglang"]))
    print(json.dumps(report, indent=1))
    assert report["samples"] == samples  # the demo's conversations less the duplicates the data stage dropped
    return report


@pytest.mark.gpu
@NEEDS_SGLANG
def test_sglang_features_match_hf_features(make_tokenizer, tmp_path):
    report = extract_both_ways(tmp_path, make_tokenizer, sglang_ranks=1, tp_size=1)
    assert all(layer["cosine_min"] > 0.999 for layer in report["layers"].values()), report


@pytest.mark.gpu
@NEEDS_SGLANG
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="not run: tensor-parallel extraction needs 2 GPUs (the nvidia-h200-x2 machine)")
def test_sglang_tensor_parallel_features_match_hf_features(make_tokenizer, tmp_path):
    """Two ranks, one on each GPU, form one tensor-parallel copy of the target, whose rank 0 writes all four
    shards; its features are the hf backend's, up to bf16 and the all-reduce's summation order."""
    report = extract_both_ways(tmp_path, make_tokenizer, sglang_ranks=2, tp_size=2)
    assert all(layer["cosine_min"] > 0.999 for layer in report["layers"].values()), report
