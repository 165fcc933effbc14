"""The pipeline runs the stages as commands, skips completed ones, and re-runs exactly what a change affects."""
import json
import subprocess
import sys
from pathlib import Path

from launch.demo_target import make_conversations

ROOT = Path(__file__).resolve().parents[2]


def pipeline(config, *args):
    out = subprocess.run([sys.executable, "-m", "launch.pipeline", "--config", str(config),
                          "--stages", "data,extract,train", *args], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_stages_skip_when_done_and_rerun_when_their_config_changes(tiny_target, tmp_path):
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(30, seed=2)))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "run_dir": str(tmp_path / "run"), "target": {"path": str(tiny_target), "aux_layer_ids": [0, 1, 2]},
        "data": {"inputs": [str(convs)], "max_length": 128, "draft_vocab_size": 64},
        "extract": {"nproc_per_node": 2, "samples_per_shard": 8},
        "train": {"max_steps": 3, "max_batch_tokens": 1024, "ttt_steps": 2, "eval_fraction": 0.2}}))
    first = pipeline(config)
    assert "[pipeline] data: " in first and "-m data --config" in first
    assert "torch.distributed.run --standalone --nproc-per-node 2 -m extract" in first
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["samples"] == 30 and report["features"]["rows"] == 30 and len(report["features"]["tokens_per_s_by_rank"]) == 2
    assert "deepspeed --num_gpus 1 --master_port" in first and report["train"]["steps"] == 3

    again = pipeline(config)
    assert "data: complete for this config, skipped" in again and "extract: complete for this config, skipped" in again
    assert "train: complete for this config, skipped" in again

    changed = pipeline(config, "--extract.dtype", "bfloat16")
    assert "data: complete for this config, skipped" in changed and "-m extract" in changed
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    features = json.loads((tmp_path / "run" / "features" / "manifest.json").read_text())
    assert features["meta"]["dtype"] == "bfloat16" and report["features"]["rows"] == 30
    # new features: the old drafter run is kept aside and a new one trains on them
    assert "was trained for another config; moved to" in changed and (tmp_path / "run" / "train.prev-1").is_dir()
    assert report["train"]["steps"] == 3 and "resumed" not in changed
