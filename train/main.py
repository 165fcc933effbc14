"""Train a drafter (EAGLE-3 or DFlash: train.drafter.family, train/families.py) on extracted features:

    deepspeed [--num_gpus N | --hostfile H] train/main.py --config run.yaml [--deepspeed_config ds.json] [--train.key v]

config → data → the family's model and objective → DeepSpeed engine (resumes from `latest`) → training loop
with eval and checkpoints → summary. Reads RUN_DIR/features and RUN_DIR/data/draft_vocab.safetensors, writes RUN_DIR/train.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `deepspeed train/main.py` runs this as a script: import the project's packages
    ROOT = str(Path(__file__).resolve().parents[1])  # (not train/, nor the working directory: PYTHONSAFEPATH)
    sys.path[:] = [ROOT] + [p for p in sys.path if p not in (ROOT, str(Path(__file__).resolve().parent))]

import deepspeed
import torch
import torch.distributed as dist

from data.config import EyrieConfig, cli_config, stage_errors
from data.files import atomic_write_json
from data.split import heldout_ids, read_split, split_digest
from train.engine import Checkpoints, StopSignal, deepspeed_config, init_engine
from train.families import FAMILIES, Family
from train.loader import FeatureData
from train.metrics import Logger


def resume_key(cfg: EyrieConfig) -> dict:
    """What a checkpoint must share with the config to be resumed: all but the run's length and cadence."""
    train = cfg.train.model_dump(mode="json", exclude={"max_steps", "epochs", "eval_every", "save_every",
                                                       "log_every", "keep_last", "activation_checkpointing",
                                                       "recompute_logits"})
    return {"seed": cfg.seed, "train": train} | {s: getattr(cfg, s).model_dump(mode="json")
                                                 for s in ("target", "data", "extract")}


def setup_distributed() -> torch.device:
    """Rank/world from the deepspeed (or torchrun) launcher; a plain `python train/main.py` is one rank."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29511"}.items():
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce (a minute of C++ on a small machine) and
        # never unlinks its 64 MiB /dev/shm buffer per rank: every CPU run, killed or not, leaked RAM until the
        # tmpfs filled. CPU runs are tests and demos; gloo's allreduce is enough for them.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # Ranks on one CPU share its cores, and each would take them all: deepspeed's launcher (unlike torchrun)
        # sets no OMP_NUM_THREADS, and so two ranks on 2 cores trained the demo's DFlash drafter in 51.6 s, not 25.0.
        if "OMP_NUM_THREADS" not in os.environ:
            ranks_here = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    if dist.get_rank() != 0:  # clean logs: other ranks speak only through errors
        deepspeed.utils.logger.setLevel("WARNING")
    return device


@torch.no_grad()
def evaluate(engine, family: Family, data: FeatureData, device, dtype) -> dict | None:
    """The family's objective over the held-out samples, without training (the same blocks every time)."""
    plan = data.eval_plan()
    if not plan:
        return None
    engine.eval()
    stats = family.stats()
    for indices in plan:
        b = data.collate(indices).to(device, dtype)
        stats.add(family.eval_step(engine, b), b.tokens, b.padded)
    engine.train()
    return stats.reduce()


def main(argv: list[str] | None = None) -> None:
    cfg, args = cli_config("train", "Train a drafter (EAGLE-3 or DFlash) with DeepSpeed.", argv, {
        "--deepspeed_config": {"default": None, "help": "a DeepSpeed JSON to use instead of train.optim"},
        "--local_rank": {"type": int, "default": None, "help": "set by the deepspeed launcher"}})
    device = setup_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    layout = cfg.layout
    tc = cfg.train

    split = read_split(layout.split)  # the data stage's held-out samples: evaluated here, never trained on
    data = FeatureData(layout.features, heldout_ids(split), tc.max_batch_tokens, cfg.seed, rank, world)
    bf16 = device.type == "cuda" and tc.dtype != "float32"
    dtype = torch.bfloat16 if bf16 else torch.float32
    family = FAMILIES[tc.drafter.family](cfg, data, device, dtype)
    model = family.model

    provisional = deepspeed_config(tc, 1, bf16, args.deepspeed_config)
    steps_per_epoch = max(1, data.micro_batches_per_epoch() // provisional.get("gradient_accumulation_steps", 1))
    total = tc.max_steps or steps_per_epoch * tc.epochs
    engine = init_engine(model, deepspeed_config(tc, total, bf16, args.deepspeed_config))
    checkpoints = Checkpoints(layout.checkpoints, tc.keep_last)
    state = checkpoints.resume(engine) or {"step": 0, "epoch": 0, "micro": 0, "tokens": 0,
                                            "resume_key": resume_key(cfg)}
    if state["resume_key"] != resume_key(cfg):
        changed = sorted(k for k in state["resume_key"] if state["resume_key"][k] != resume_key(cfg).get(k))
        raise SystemExit(f"{layout.checkpoints} was trained with other settings ({', '.join(changed)}); "
                         "use another run_dir or remove it")
    best = (checkpoints.best() or {}).get("accept_length", 0.0)
    if rank == 0:
        layout.train.mkdir(parents=True, exist_ok=True)
        atomic_write_json(layout.drafter_config, model.config.to_dict())
    log = Logger(layout.train, layout.tensorboard("train"), total, state["step"], enabled=rank == 0)
    log.message(f"[train] {len(data.train_idx)} train / {len(data.eval_idx)} eval samples, {world} ranks, "
                f"{steps_per_epoch} steps per epoch, {total} steps, padding "
                f"{data.padding_fraction(data.epoch_plan(0)):.1%}" + (f", resumed at step {state['step']}"
                                                                      if state["step"] else ""))

    def evaluate_and_keep_best(step: int, tag: str | None) -> dict | None:
        nonlocal best
        metrics = evaluate(engine, family, data, device, dtype)
        if metrics:
            log.log(step, metrics, "eval")
            if metrics["accept_length"] > best:
                best = metrics["accept_length"]
                tag = tag or checkpoints.save(engine, step, state)
                checkpoints.mark_best(tag, {"step": step, "accept_length": best})
        return metrics

    stats, waited, t0 = family.stats(), 0.0, time.perf_counter()
    resumed_at = step = state["step"]
    eval_metrics, stop, stopped = None, StopSignal(), 0
    epochs_needed = math.ceil(total / steps_per_epoch) + 1
    stream = data.stream(state["epoch"], state["micro"], epochs_needed, pin=device.type == "cuda")
    for epoch, micro, batch, wait in stream:
        if step >= total:
            break
        b = batch.to(device, dtype)
        result = family.step(engine, b)
        engine.backward(result.loss)
        engine.step()
        stats.add(result, b.tokens, b.padded)
        waited += wait
        state |= {"epoch": epoch, "micro": micro + 1}
        if engine.global_steps == step:
            continue  # gradient accumulation: no optimizer step yet
        step = state["step"] = engine.global_steps
        if step % tc.log_every == 0 or step == total:
            elapsed = time.perf_counter() - t0
            scalars = stats.reduce()
            state["tokens"] += int(scalars["tokens"])  # all ranks
            grad_norm = engine.get_global_grad_norm()
            scalars |= {"lr": engine.get_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                        "tokens_per_s": scalars["tokens"] / elapsed, "loader_wait_fraction": waited / elapsed}
            if device.type == "cuda":
                scalars["gpu_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
            log.log(step, scalars, "train")
            log.progress(step, family.progress(scalars))
            stats, waited, t0 = family.stats(), 0.0, time.perf_counter()
        # the periodic save comes before the evaluation: the mission run's first eval compiled its no-grad kernels
        # for over a minute on the H200, was stopped there and lost its step's save
        stopped = stop.agreed() if step < total else 0
        tag = checkpoints.save(engine, step, state) if step % tc.save_every == 0 or step == total or stopped else None
        if (step % tc.eval_every == 0 or step == total) and not stopped:
            eval_metrics = evaluate_and_keep_best(step, tag)
        if stopped:
            log.message(f"[train] stopped by signal {stopped} at step {step}/{total}, saved {tag}; "
                        "run again to resume from it")
            break
        if step >= total:
            break
    stream.close()
    if resumed_at >= total:
        # resumed at the last step: its checkpoint was saved, but its evaluation (and so the summary) was cut off,
        # as a time limit did once on the H100 while the final evaluation compiled: evaluate the checkpoint now
        eval_metrics = evaluate_and_keep_best(step, Checkpoints.tag(step))
    log.close()
    if rank == 0 and not stopped:
        atomic_write_json(layout.train_summary, {
            "steps": step, "tokens": state["tokens"], "world_size": world,
            "latest": (layout.checkpoints / "latest").read_text().strip(), "best": checkpoints.best(),
            "eval": eval_metrics, "aux_layer_ids": data.meta["aux_layer_ids"],
            "split": {"digest": split_digest(split), "heldout_samples": len(data.eval_idx),
                      "training_samples": len(data.train_idx),
                      "heldout_overlap_with_training": split["heldout_overlap_with_training"], "rule": split["rule"]},
            "config": cfg.model_dump(mode="json")})
    dist.barrier()
    dist.destroy_process_group()
    if stopped:
        raise SystemExit(128 + stopped)  # not finished: the pipeline must not record the stage as done


if __name__ == "__main__":
    with stage_errors("train"):
        main()
