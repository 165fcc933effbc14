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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _sglang_ready(),
                    reason="not run: the sglang extraction backend needs a GPU and sglang 0.5.14 (SGLang's kernels); "
                           "run on the GPU machine with `source .sgl/sglang-env.sh`")
def test_sglang_features_match_hf_features(make_tokenizer, tmp_path):
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
    for backend in ("hf", "sglang"):
        run = tmp_path / backend
        args = [*base, "--run_dir", str(run), "--extract.backend", backend, "--extract.dtype", "bfloat16"]
        # extraction under torchrun, as the pipeline runs it (SGLang's own process group must form inside it)
        for module in (["-m", "data"], ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                                        "-m", "extract"]):
            out = subprocess.run([sys.executable, *module, "--config", str(ROOT / "launch/configs/demo.yaml"),
                                  "--data.regenerate.enabled", "false", *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=600)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[backend] = run / "features"
    manifest = json.loads((runs["sglang"] / "manifest.json").read_text())
    assert manifest["meta"]["extra"]["backend"] == "sglang" and manifest["totals"]["rows"] == 24
    from data.shards import ShardDataset
    from extract.parity import compare
    report = compare(ShardDataset(runs["hf"]), ShardDataset(runs["sglang"]))
    print(json.dumps(report, indent=1))
    assert report["samples"] == 24
    assert all(layer["cosine_min"] > 0.999 for layer in report["layers"].values()), report
