import json
from pathlib import Path

import pytest

from launch.demo_target import build_tiny_llama, make_conversations


@pytest.fixture(scope="session")
def features_run(make_tokenizer, tmp_path_factory):
    """A run directory with prepared samples and extracted features of a tiny target whose distributions are
    peaked (large init), so the teacher has argmaxes worth learning. Returns (config path, raw config dict)."""
    from data.config import load_config
    from data.prepare import prepare
    from extract.job import run as extract

    root = tmp_path_factory.mktemp("train-run")
    tok = make_tokenizer("llama3")
    target = root / "target"
    tok.save_pretrained(str(target))
    build_tiny_llama(target, vocab_size=len(tok), hidden=32, layers=4, heads=4, seed=1, initializer_range=0.3,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    convs = root / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(160, seed=3)))
    raw = {"run_dir": str(root / "run"), "seed": 0,
           "target": {"path": str(target), "aux_layer_ids": [0, 1, 2]},
           "data": {"inputs": [str(convs)], "max_length": 128, "draft_vocab_size": 128, "samples_per_shard": 50},
           "extract": {"samples_per_shard": 50},
           "train": {"ttt_steps": 3, "max_batch_tokens": 1024, "eval_fraction": 0.1, "log_every": 1,
                     "eval_every": 4, "save_every": 4, "keep_last": 2, "max_steps": 12,
                     "optim": {"lr": 1e-2, "warmup_steps": 2}}}
    config = root / "run.yaml"
    config.write_text(json.dumps(raw))
    cfg = load_config(config)
    prepare(cfg)
    extract(cfg)
    return config, raw


def with_run_dir(features_run, run_dir: Path, **train) -> Path:
    """A config like features_run's whose run_dir is `run_dir`, sharing its data and features (symlinks)."""
    config, raw = features_run
    src = Path(raw["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("data", "features"):
        if not (run_dir / name).exists():
            (run_dir / name).symlink_to(src / name)
    new = json.loads(json.dumps(raw))
    new["run_dir"] = str(run_dir)
    new["train"] |= train
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(json.dumps(new))
    return path
