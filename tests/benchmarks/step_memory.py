"""What one training step of the product allocates above the memory held between steps, at its peak and at each
phase's peak, summed by the line of Eyrie's or DeepSpeed's code that allocated it. The step is train/main.py's:
the DeepSpeed engine from the generated config (bf16), the teacher, `ttt_unroll`, `engine.backward`,
`engine.step`, here on the CPU: which tensors DeepSpeed and the trainer allocate, and when they free them, does
not depend on the device (attention does: blockwise here, flex on a GPU), so this explains a GPU peak without a
GPU. On the GPU, bench_train.py --memory-profile reads the same from torch's allocator history.

    python tests/benchmarks/step_memory.py --shape llama3-8b --T 128 [--zero 2] [--activation-checkpointing]
        [--recompute-logits] [--zero-extra '{"sub_group_size": 100000000}'] [--family dflash --anchors 512]

--family dflash measures the DFlash step instead (bench_train.py's eyrie-dflash: dflash_peers.py's drafter,
frozen target embedding and head, `dflash_objective`), its blocks of 16 at --anchors sampled positions.

Every new tensor storage an operator returns (views and in-place results share their inputs' storage and are
not counted) is recorded, from the model's construction on, with the innermost train/, data/, deepspeed/ (or, for
the frozen tensors the benchmarks make, benchmarks/) frame of the Python stack; a finalizer on the storage records
its release. Reported: what is alive between steps (after a first step has made the optimizer state), the second
step's peak above that, and the bytes its optimizer step's operators read and write (tensor inputs, new outputs,
inputs written in place; on a GPU that step is bound by memory bandwidth). One process (gloo).
"""
import argparse
import gc
import json
import os
import sys
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).parent))
import bench_train  # noqa: E402  (the shapes and drafter config the GPU benchmark uses)

OWNERS = ("/train/", "/data/", "deepspeed/", "benchmarks/")  # the last: the frozen tensors made there


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages created while active and not yet released; the set alive at the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[tuple[int, int], tuple[int, str]] = {}
        self.total = self.peak = 0
        self.at_peak: dict = {}
        self.phase = "?"
        self.phase_peak: dict[str, tuple[int, dict]] = {}
        self.optimizer_moved: dict[str, int] = {}  # bytes read and written by the optimizer step's operators

    def _release(self, key) -> None:
        self.total -= self.live.pop(key)[0]

    def _record(self, storage: torch.UntypedStorage) -> None:
        key = (storage.data_ptr(), id(storage))
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = (storage.nbytes(), f"{self.phase}: {_owner()}")
        self.total += storage.nbytes()
        weakref.finalize(storage, self._release, key)
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.live)
        if self.total > self.phase_peak.get(self.phase, (0, {}))[0]:
            self.phase_peak[self.phase] = (self.total, dict(self.live))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        new = [t for t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in inputs]
        for t in new:
            self._record(t.untyped_storage())
        if self.phase == "optimizer":
            # read: the tensor inputs; written: new outputs and the inputs the schema marks as written in place
            written = [a for arg, a in zip(func._schema.arguments, args) if arg.alias_info and arg.alias_info.is_write]
            if new or written:  # else a view: nothing moves
                key = f"{func} {_owner()}"
                self.optimizer_moved[key] = self.optimizer_moved.get(key, 0) + _nbytes((args, kwargs, new, written))
        return out


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _owner() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if any(k in f.filename for k in OWNERS)]
    return f"{'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"


def by_owner(live: dict, top: int) -> dict:
    owners: dict[str, int] = {}
    for nbytes, owner in live.values():
        owners[owner] = owners.get(owner, 0) + nbytes
    return {k: round(v / 2 ** 30, 3) for k, v in sorted(owners.items(), key=lambda kv: -kv[1])[:top]
            if v >= 2 ** 20}


def eagle3_cpu_step(s: dict, T: int, activation_checkpointing: bool, recompute_logits: bool):
    """The EAGLE-3 drafter (bf16), its teacher and TTT unroll as train/main.py runs them, on random inputs: the
    model and forward(engine, tracker) -> the unroll's result."""
    from train.ttt import ttt_unroll
    model, teacher = bench_train.bf16_cpu_drafter(s, activation_checkpointing, recompute_logits)
    ids = torch.randint(0, s["Vd"], (1, T))
    aux, final = torch.randn(1, T, 3 * s["Ht"]).bfloat16(), torch.randn(1, T, s["Ht"]).bfloat16()
    mask, lengths = torch.ones_like(ids, dtype=torch.bool), torch.tensor([T])

    def forward(engine, tracker: LiveStorages):
        tracker.phase = "teacher"
        probs = teacher(final)
        tracker.phase = "forward"
        return ttt_unroll(engine, ids, aux, mask, lengths, probs, bench_train.STEPS, bench_train.DECAY)
    return model, forward


def dflash_cpu_step(s: dict, T: int, anchors: int):
    """The DFlash drafter (bf16) and its loss as bench_train.py's eyrie-dflash runs them, on its inputs: the model
    and forward(engine, tracker) -> the objective's result."""
    import dflash_peers
    from train.dflash import DFlashDrafter, dflash_objective
    model = DFlashDrafter(dflash_peers.drafter_config(s)).to(torch.bfloat16)
    embed, head = dflash_peers._weights(s)
    x = dflash_peers.make_inputs(s, T)
    mask, lengths, generator = torch.ones_like(x.ids), torch.tensor([T]), torch.Generator().manual_seed(0)

    def forward(engine, tracker: LiveStorages):
        tracker.phase = "forward"
        return dflash_objective(engine, embed, head, x.ids, x.aux, mask, lengths, anchors, dflash_peers.GAMMA,
                                generator)
    return model, forward


def step_memory(shape: str, T: int, zero: int, activation_checkpointing: bool, recompute_logits: bool,
                zero_extra: dict, family: str = "eagle3", anchors: int = 512) -> dict:
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    from data.config import TrainConfig
    from train.engine import deepspeed_config, init_engine
    from train.main import setup_distributed
    setup_distributed()
    s = bench_train.SHAPES[shape]
    tracker = LiveStorages()  # from the start: what stays between steps is measured too
    tracker.phase = "setup"
    with tracker:
        model, forward = dflash_cpu_step(s, T, anchors) if family == "dflash" else \
            eagle3_cpu_step(s, T, activation_checkpointing, recompute_logits)
        config = TrainConfig()
        config.optim.zero_stage = zero
        ds = deepspeed_config(config, 1000, bf16=True)
        ds["zero_optimization"].update(zero_extra)
        engine = init_engine(model, ds)

        def step():
            r = forward(engine, tracker)
            tracker.phase = "backward"
            engine.backward(r.loss)
            tracker.phase = "optimizer"
            engine.step()

        step()  # the first step allocates the optimizer state: measure the second
        gc.collect()
        between = dict(tracker.live)
        resident = tracker.total
        tracker.peak, tracker.phase_peak, tracker.optimizer_moved = resident, {}, {}
        step()
    above = lambda live: {k: v for k, v in live.items() if k not in between}  # noqa: E731
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad)
    moved = sum(tracker.optimizer_moved.values())
    engine.destroy()
    return {"family": family, "shape": shape, "T": T} | ({"anchors": anchors} if family == "dflash" else {}) | {
            "zero_stage": zero, "gradient_clipping": ds["gradient_clipping"],
            "activation_checkpointing": activation_checkpointing, "recompute_logits": recompute_logits,
            "trainable_params_m": round(trainable / 1e6, 1),
            "between_steps_gib": round(resident / 2 ** 30, 3), "between_steps_by_owner_gib": by_owner(between, 8),
            "step_peak_above_between_steps_gib": round((tracker.peak - resident) / 2 ** 30, 3),
            "at_peak_by_owner_gib": by_owner(above(tracker.at_peak), 8),
            "optimizer_step_moved_gb": round(moved / 1e9, 2),
            "optimizer_step_moved_bytes_per_trainable_param": round(moved / trainable, 1),
            "optimizer_step_moved_by_op_gb": {k: round(v / 1e9, 2) for k, v in sorted(
                tracker.optimizer_moved.items(), key=lambda kv: -kv[1])[:8]},
            "phase_peaks_above_between_steps_gib": {
                name: {"total": round((total - resident) / 2 ** 30, 3), "by_owner": by_owner(above(live), 6)}
                for name, (total, live) in tracker.phase_peak.items()}}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(bench_train.SHAPES))
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--recompute-logits", action="store_true")
    p.add_argument("--zero-extra", default="{}", help='more zero_optimization keys, JSON')
    p.add_argument("--family", default="eagle3", choices=("eagle3", "dflash"))
    p.add_argument("--anchors", type=int, default=512, help="dflash: blocks per sample")
    a = p.parse_args()
    print(json.dumps(step_memory(a.shape, a.T, a.zero, a.activation_checkpointing, a.recompute_logits,
                                 json.loads(a.zero_extra), a.family, a.anchors), indent=1))
