"""DeepSpeed: its config (generated from `train.optim`, or the user's JSON), the engine, checkpoints.

Checkpoints are DeepSpeed's own (`save_checkpoint`/`load_checkpoint`, any ZeRO stage, `latest` pointer)
under RUN_DIR/train/checkpoints/stepN, without the frozen embedding (it is the target's). Next to DeepSpeed's
files each tag holds `trainer_state.json`: step, data position (epoch, micro-batch) and counters. Nothing
else is random (no dropout, data order is a function of seed and epoch), so that restores the run exactly.
"""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from data.config import ConfigError, TrainConfig
from data.files import atomic_write_json, load_safetensors
from data.target import load_target_info

from .drafter import eagle31_options

STATE_FILE = "trainer_state.json"
BEST_FILE = "best.json"


def _scheduler(o, total_steps: int) -> dict:
    warmup = max(1, o.warmup_steps)
    if o.schedule == "cosine":
        return {"type": "WarmupCosineLR", "params": {"total_num_steps": total_steps, "warmup_num_steps": warmup,
                                                     "warmup_min_ratio": 0.0, "cos_min_ratio": o.min_lr_ratio,
                                                     "warmup_type": "linear"}}
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": o.lr, "warmup_num_steps": warmup, "warmup_type": "linear"}
    if o.schedule == "linear":
        return {"type": "WarmupDecayLR", "params": {**params, "total_num_steps": total_steps}}
    return {"type": "WarmupLR", "params": params}


REDUCE_BUCKET_ELEMENTS = 50_000_000


def deepspeed_config(train: TrainConfig, total_steps: int, bf16: bool, user_json: str | None = None) -> dict:
    """The DeepSpeed config. A micro-batch is one token-budget batch, hence train_micro_batch_size_per_gpu 1."""
    if user_json:
        if train.optim.model_fields_set:
            keys = ", ".join(f"train.optim.{k}" for k in sorted(train.optim.model_fields_set))
            raise ConfigError(f"{keys} set in the config but --deepspeed_config {user_json} is given: "
                              "set them in one place")
        try:
            ds = json.loads(Path(user_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--deepspeed_config {user_json}: {e}") from None
        ds = fill_auto(ds, train, total_steps, bf16, user_json)
        if ds.setdefault("train_micro_batch_size_per_gpu", 1) != 1:
            raise ConfigError(f"{user_json}: train_micro_batch_size_per_gpu must be 1 (a micro-batch is one "
                              "token-budget batch; size it with train.max_batch_tokens)")
        ds.pop("train_batch_size", None)  # derived by DeepSpeed from micro x accumulation x world
        if bool(ds.get("bf16", {}).get("enabled")) != bf16:
            raise ConfigError(f"{user_json}: bf16.enabled must be {str(bf16).lower()} to match train.dtype "
                              "(auto = bfloat16 on GPU, float32 on CPU)")
        return ds
    o = train.optim
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": o.grad_accum,
        "gradient_clipping": o.clip_grad,
        # torch's fused AdamW (one kernel per step over the flat ZeRO partition): no JIT-built op needed, and
        # the same optimizer on CPU and GPU.
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": 1e-8,
                                                  "weight_decay": o.weight_decay, "torch_adam": True,
                                                  "fused": True}},
        "scheduler": _scheduler(o, total_steps),
        # DeepSpeed allocates its gradient-reduction bucket at full size whatever the model: 5e8 elements (0.93 GiB
        # in bf16) by default, more than a llama3-8b drafter's whole gradient. 5e7 (93 MiB): larger gradients
        # bypass it; the step's CPU memory profile peaked lower with it (tests/benchmarks/RESULTS.md) than with
        # the default or with a bucket the size of the largest tensor.
        "zero_optimization": {"stage": o.zero_stage, "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10 ** 9,
    }


# "auto" values of a Hugging Face-style DeepSpeed JSON that DeepSpeed derives or defaults itself: dropped
AUTO_DROPPED = {"train_batch_size", *(f"zero_optimization.{k}" for k in (
    "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "sub_group_size",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save"))}


def fill_auto(ds: dict, train: TrainConfig, total_steps: int, bf16: bool, source: str) -> dict:
    """A DeepSpeed JSON written the Hugging Face way: each "auto" value is filled from the config (train.optim,
    the step count, the dtype), dropped where DeepSpeed derives it, or refused naming its key."""
    o = train.optim
    derived = {"scheduler.params.warmup_max_lr": o.lr, "scheduler.params.warmup_min_lr": 0.0,
               "scheduler.params.warmup_num_steps": max(1, o.warmup_steps),
               "scheduler.params.total_num_steps": total_steps, "fp16.enabled": False, "bf16.enabled": bf16}
    generated = deepspeed_config(train, total_steps, bf16)

    def at(path: str):
        node = generated
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def walk(node: dict, prefix: str) -> dict:
        out = {}
        for key, value in node.items():
            path = prefix + key
            if isinstance(value, dict):
                out[key] = walk(value, path + ".")
            elif value != "auto":
                out[key] = value
            elif path in derived or at(path) is not None:
                out[key] = derived[path] if path in derived else at(path)
            elif path not in AUTO_DROPPED:
                raise ConfigError(f"--deepspeed_config {source}: {path} is \"auto\" and Eyrie has no value for "
                                  "it: write the value")
        return out
    return walk(ds, "")


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's checkpoint files read with `torch.load(weights_only=True)` (DeepSpeed's own engine unpickles
    them unrestricted): tensors, containers and the DeepSpeed classes its optimizer state holds,
    allow-listed by name; anything else is refused instead of run."""
    SAFE_GLOBALS = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(self.SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)


MIN_GROUP_ELEMENTS = 100_000_000


def param_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Consecutive parameters in groups no larger than the largest tensor or MIN_GROUP_ELEMENTS, whichever is
    larger. DeepSpeed's ZeRO-1/2 step flattens a group's gradients and makes an fp32 copy of them one group at a
    time (bf16 + fp32: 6 bytes per element), so with one group that transient is 6 bytes per drafter parameter on
    top of the optimizer state (2.4 GiB at llama3-8b), with these groups 6 bytes per element of the largest one.
    The floor keeps small drafters in one group: each group costs the step its own collectives and launches (the
    tests' tiny drafters, split by their largest tensor, trained up to 2x slower on two CPU ranks)."""
    limit = max(MIN_GROUP_ELEMENTS, max(p.numel() for p in params))
    groups: list[list[torch.nn.Parameter]] = [[]]
    for p in params:
        if groups[-1] and sum(q.numel() for q in groups[-1]) + p.numel() > limit:
            groups.append([])
        groups[-1].append(p)
    return [{"params": g} for g in groups]


def init_engine(model: torch.nn.Module, ds_config: dict):
    trainable = param_groups([p for p in model.parameters() if p.requires_grad])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)
    return engine


def warm_start_config(config, drafter_dir: str | Path, rms_norm_eps: float | None) -> list[str]:
    """A warm start continues the drafter it starts from: its RoPE settings, its norm epsilon and its EAGLE-3.1
    options (an option the config adds is added: fc_norm's weights start at 1) replace the ones `config` took
    from the target (a drafter trained at rope_theta 1e6 with YaRN, or eps 1e-6, computes something
    else under the target's), unless `train.drafter.rms_norm_eps` (`rms_norm_eps`) sets the epsilon. Changes
    `config` in place; returns what changed, for the log."""
    from transformers import LlamaConfig
    raw = json.loads((Path(drafter_dir) / "config.json").read_text())
    rope_keys = {k: raw[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if raw.get(k) is not None}
    notes = []
    if rope_keys:
        theirs = LlamaConfig(**rope_keys).rope_parameters  # transformers normalises the legacy fields too
        if theirs != config.rope_parameters:
            notes.append(f"RoPE {theirs} (the drafter's; the target's is {config.rope_parameters})")
            config.rope_parameters = theirs
    theirs = eagle31_options(SimpleNamespace(**raw))
    for option, on in eagle31_options(config).items():
        if theirs[option] and not on:
            notes.append(f"{option} (the drafter's EAGLE-3.1 option)")
            setattr(config, option, True)
        elif on and not theirs[option]:
            notes.append(f"{option} added (train.drafter.{option}; the drafter had none"
                         + ("; its norms start at weight 1)" if option == "fc_norm" else ")"))
    eps = raw.get("rms_norm_eps")
    if eps is not None and eps != config.rms_norm_eps:
        if rms_norm_eps is None:
            notes.append(f"rms_norm_eps {eps} (the drafter's; the target's is {config.rms_norm_eps})")
            config.rms_norm_eps = eps
        else:
            notes.append(f"rms_norm_eps {rms_norm_eps} (train.drafter.rms_norm_eps; the drafter had {eps})")
    return notes


def warm_start(model: torch.nn.Module, drafter_dir: str | Path, target: str | Path) -> list[str]:
    """Copy an exported (SGLang-format) drafter's weights into `model`; its draft vocab must be ours and the
    layers SGLang feeds it on `target` the ones our shards hold."""
    path = Path(drafter_dir)
    written = (json.loads((path / "config.json").read_text()).get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    own = model.config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    if written is None or load_target_info(target).drafter_layer_ids(written) != list(own):
        raise ValueError(f"{path}: its eagle_aux_hidden_state_layer_ids {written} do not name the layers this "
                         f"run's shards hold, {own} (data.target.sglang_captured_outputs says what they mean)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no safetensors in the warm-start drafter directory")
    written_by = "serve.export (or the drafter's publisher)"
    tensors = {k: v for f in files for k, v in load_safetensors(f, written_by).items()}
    own = model.state_dict()
    for name in ("d2t", "t2d"):
        if name in tensors and not torch.equal(tensors[name].to(own[name].dtype), own[name]):
            raise ValueError(f"{path}: its {name} differs from this run's draft vocab (train with the drafter's "
                             "vocab, or start from scratch)")
    unknown = sorted(set(tensors) - set(own))
    if unknown:
        raise ValueError(f"{path}: tensors the drafter does not have: {unknown}")
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise ValueError(f"{path}: {name} has shape {list(t.shape)}, the drafter {list(own[name].shape)}")
    model.load_state_dict(tensors, strict=False)
    return sorted(tensors)


class Checkpoints:
    PREFIX = "step"  # a checkpoint's tag is PREFIX + its step: `tag` writes it, `_tags` reads it back

    def __init__(self, directory: Path, keep_last: int):
        self.dir, self.keep_last = directory, keep_last

    @classmethod
    def tag(cls, step: int) -> str:
        return f"{cls.PREFIX}{step}"

    def save(self, engine, step: int, state: dict) -> str:
        tag = self.tag(step)
        if dist.get_rank() == 0:
            (self.dir / tag).mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.dir / tag / STATE_FILE, state)
        # DeepSpeed writes `latest` after its own files, so `latest` never names a half-written tag.
        try:
            engine.save_checkpoint(str(self.dir), tag=tag, exclude_frozen_parameters=True)
        except (OSError, RuntimeError) as e:  # torch.save reports a refused write as RuntimeError
            raise RuntimeError(self._save_failed(tag, e)) from e
        dist.barrier()
        if dist.get_rank() == 0:
            self._prune()
        return tag

    def _save_failed(self, tag: str, error: BaseException) -> str:
        latest = self.dir / "latest"
        previous = latest.read_text().strip() if latest.exists() else None
        size = sum(f.stat().st_size for f in (self.dir / previous).rglob("*") if f.is_file()) if previous else 0
        return (f"saving checkpoint {self.dir / tag} failed on rank {dist.get_rank()}: {error}. "
                + (f"The last complete one, {previous}, took {size:,} bytes and stays `latest`; "
                   if previous else "No complete checkpoint exists yet; ")
                + f"{shutil.disk_usage(self.dir).free:,} bytes are free. Free space and run again to resume.")

    def mark_best(self, tag: str, metrics: dict) -> None:
        if dist.get_rank() == 0:
            atomic_write_json(self.dir / BEST_FILE, {"tag": tag, **metrics})

    def best(self) -> dict | None:
        path = self.dir / BEST_FILE
        return json.loads(path.read_text()) if path.exists() else None

    def _tags(self) -> list[str]:
        """The saved tags, oldest first."""
        def step(name: str) -> str:
            return name.removeprefix(self.PREFIX)
        return sorted((p.name for p in self.dir.glob(f"{self.PREFIX}*") if p.is_dir() and step(p.name).isdigit()),
                      key=lambda name: int(step(name)))

    def _prune(self) -> None:
        best = (self.best() or {}).get("tag")
        for old in self._tags()[:-self.keep_last]:
            if old != best:
                shutil.rmtree(self.dir / old, ignore_errors=True)

    def complete(self, tag: str) -> bool:
        """A tag with the trainer state, DeepSpeed's model states and no empty file (a copy cut short)."""
        d = self.dir / tag
        return d.is_dir() and (d / STATE_FILE).is_file() and any(d.glob("*model_states.pt")) and \
            all(f.stat().st_size > 0 for f in d.iterdir() if f.is_file())

    def newest_complete(self, other_than: str | None = None) -> str | None:
        return next((t for t in reversed(self._tags()) if t != other_than and self.complete(t)), None)

    def resume_tag(self) -> str | None:
        """The checkpoint to resume from: `latest`, or, when it names a missing or incomplete tag, the newest
        complete one (with a warning naming both); None for a fresh start."""
        latest = self.dir / "latest"
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
        if self.complete(tag):
            return tag
        what = "missing" if not (self.dir / tag).is_dir() else \
            "incomplete (no trainer state or DeepSpeed model states, or an empty file)"
        fallback = self.newest_complete(other_than=tag)
        if fallback is None:
            raise RuntimeError(f"{latest} names {tag}, which is {what}, and {self.dir} holds no complete checkpoint: "
                               f"restore {tag}, or remove {self.dir} to train from the start")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[train] warning: {latest} names {tag}, which is {what}; resuming from {fallback}, the newest "
                  "complete checkpoint", flush=True)
        return fallback

    def resume(self, engine) -> dict | None:
        """Load the resume tag into the engine; the trainer state saved with it, or None for a fresh start."""
        tag = self.resume_tag()
        if tag is None:
            return None
        error = ""
        try:
            path, _ = engine.load_checkpoint(str(self.dir), tag=tag, load_module_strict=False)
        except (AssertionError, RuntimeError, OSError, KeyError, ValueError) as e:
            path, error = None, f" ({type(e).__name__}: {e})"
        if path is None:
            raise RuntimeError(f"{self.dir / tag}: DeepSpeed could not load this checkpoint{error}; the newest other "
                               f"complete one is {self.newest_complete(other_than=tag) or 'none'}")
        return json.loads((self.dir / tag / STATE_FILE).read_text())


class StopSignal:
    """SIGINT or SIGTERM (Ctrl-C, a time limit's `timeout -s INT`, the deepspeed launcher's SIGTERM to its ranks)
    ends training at the next optimizer step with a checkpoint there, so a rerun resumes where it stopped
    instead of at the last save_every. Ranks may see the signal at different steps: they agree through an
    all-reduce on a CPU (gloo) group, which puts no GPU synchronisation into the step. SIGTERM is caught too
    because the launcher answers a SIGINT with it (and SIGKILL 30 s later); the cost: a rank stuck in a
    collective with a crashed peer now leaves at that SIGKILL, not at the SIGTERM."""

    def __init__(self):
        self.signum = 0
        self.group = dist.new_group(backend="gloo") if dist.get_world_size() > 1 else None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def agreed(self) -> int:
        """A signal number when any rank got one, else 0. A collective: every rank calls it at every step."""
        if self.group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())
