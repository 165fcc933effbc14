"""`deepspeed --num_gpus 2 train/main.py` for real (gloo on CPU): ZeRO-2 and ZeRO-3, TensorBoard, checkpoints,
eval. Killed and disk-full runs that resume onto the same loss curve: tests/reliability/."""
import json
import re
from pathlib import Path

import pytest

from data.config import ConfigError, TrainConfig
from tests.train_runs import finish, launch, losses, with_run_dir
from train.engine import deepspeed_config


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_train(stage, zero2_run, zero3_run):
    run, out = zero2_run if stage == 2 else zero3_run
    curve = losses(run)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.5, curve  # the loss falls (12 steps from scratch)
    if stage == 3:  # partitioning (and recomputing the logits) changes where the numbers live, not the math
        reference = losses(zero2_run[0])
        assert all(abs(curve[s] - reference[s]) < 1e-3 for s in curve), (curve, reference)
    assert "2 ranks" in out and out.count("resolved config:") == 1  # rank 0 alone prints
    assert "zero_stage: %d" % stage in (run / "config" / "train.yaml").read_text()
    # no shared-memory allreduce on CPU: DeepSpeed's leaks a /dev/shm buffer per rank per run
    port = re.search(r"--master_port[= ](\d+)", out).group(1)
    assert "shm_comm" not in out and not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logdirs = list((run / "tensorboard" / "train").iterdir())  # one per command: a rerun writes beside it
    assert len(logdirs) == 1
    events = EventAccumulator(str(logdirs[0]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/loss_step0", "train/acc_step2", "train/accept_length", "train/lr",
            "train/grad_norm", "train/tokens_per_s", "train/padding_fraction", "train/loader_wait_fraction",
            "eval/loss", "eval/accept_length"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))

    ckpt = run / "train" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step12"
    assert sorted(p.name for p in ckpt.glob("step*")) >= ["step12", "step8"]  # keep_last 2 (+ the best)
    assert not (ckpt / "step4").exists() or json.loads((ckpt / "best.json").read_text())["tag"] == "step4"
    assert json.loads((ckpt / "step12" / "trainer_state.json").read_text())["step"] == 12
    summary = json.loads((run / "train" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["world_size"] == 2 and summary["aux_layer_ids"] == [0, 1, 2]
    assert summary["eval"]["accept_length"] >= 1.0 and summary["best"]["tag"].startswith("step")


def test_deepspeed_json_is_the_single_source_when_given(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                              "scheduler": {"type": "WarmupCosineLR",
                                            "params": {"total_num_steps": "auto", "warmup_num_steps": 5}},
                              "zero_optimization": {"stage": 3}}))
    made = deepspeed_config(TrainConfig(), 123, False, str(ds))
    assert made["scheduler"]["params"]["total_num_steps"] == 123 and made["train_micro_batch_size_per_gpu"] == 1
    with pytest.raises(ConfigError, match="train.optim.lr"):
        deepspeed_config(TrainConfig.model_validate({"optim": {"lr": 0.1}}), 123, False, str(ds))
    generated = deepspeed_config(TrainConfig.model_validate({"optim": {"zero_stage": 1, "grad_accum": 4}}), 50, True)
    assert generated["zero_optimization"]["stage"] == 1 and generated["gradient_accumulation_steps"] == 4
    assert generated["bf16"]["enabled"] and generated["scheduler"]["params"]["total_num_steps"] == 50


def test_a_hugging_face_style_deepspeed_json_is_filled_from_the_config_or_refused_by_key(tmp_path):
    """The `"auto"` values a transformers Trainer JSON carries: filled from train.optim / the step count / the
    dtype, dropped where DeepSpeed derives them, refused by key otherwise (once a raw TypeError)."""
    ds = tmp_path / "ds.json"
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}}
    ds.write_text(json.dumps(hf))
    made = deepspeed_config(TrainConfig(), 321, False, str(ds))
    assert made["train_micro_batch_size_per_gpu"] == 1 and "train_batch_size" not in made
    assert made["gradient_accumulation_steps"] == 1 and made["gradient_clipping"] == 0.5
    assert made["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    assert made["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 50,
                                           "total_num_steps": 321}
    assert made["bf16"] == {"enabled": False} and made["fp16"] == {"enabled": False}
    assert made["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 50_000_000, "overlap_comm": True}
    ds.write_text(json.dumps(hf | {"activation_checkpointing": {"number_checkpoints": "auto"}}))
    with pytest.raises(ConfigError, match='activation_checkpointing.number_checkpoints is "auto"'):
        deepspeed_config(TrainConfig(), 321, False, str(ds))


def test_zero1_with_gradient_accumulation(zero2_run, features_run, tmp_path):
    """ZeRO-1 and 2 micro-batches per optimizer step: 6 steps consume exactly the 12 batches ZeRO-2 took."""
    run = tmp_path / "run"
    finish(launch(with_run_dir(features_run, run, max_steps=6, eval_every=6, save_every=6,
                               optim={"lr": 1e-2, "warmup_steps": 2, "zero_stage": 1, "grad_accum": 2})))
    rows = [json.loads(line) for line in (run / "train" / "log.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (zero2_run[0] / "train" / "log.jsonl").read_text().splitlines()]
    train, ref_train = [r for r in rows if r["split"] == "train"], [r for r in ref if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert sum(r["tokens"] for r in train) == sum(r["tokens"] for r in ref_train)
    assert train[-1]["loss"] < train[0]["loss"]
    state = json.loads((run / "train" / "checkpoints" / "step6" / "trainer_state.json").read_text())
    assert state["step"] == 6


def test_optimizer_groups_are_no_larger_than_the_largest_tensor():
    """DeepSpeed's ZeRO-1/2 step copies one group's gradients to fp32 at a time: the groups bound that copy."""
    import torch

    from train.engine import param_groups
    # llama3-8b drafter shapes (lm_head, MLP, fc, attention, norms), on the meta device: no memory
    shapes = [(32000, 4096), (4096, 12288), (6144, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
              (4096, 14336), (4096,), (8192,), (4096,)]
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    groups = param_groups(params)
    largest = 32000 * 4096
    assert [p for g in groups for p in g["params"]] == params  # all of them, in order
    assert all(sum(p.numel() for p in g["params"]) <= largest for g in groups)
    assert len(groups) == 4  # lm_head alone; fc + q/kv/o; gate + up; down + norms
    assert sum(p.numel() for p in params) > 3 * largest
    small = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in [(256, 64), (64, 192), (256, 64), (64,)]]
    assert param_groups(small) == [{"params": small}]  # a small drafter: one group (each costs collectives)
