"""Drafter training step on one GPU, Eyrie's product path side by side with SpecForge's, each peer in a fresh
process of its own on the same inputs (not collected by pytest).

    python tests/benchmarks/bench_train.py --shapes llama3-8b,kimi-k2.5 --lengths 2048,8192,16384 \
        --peers eyrie,specforge,specforge-compact [--steps 20] [--record NAME [--append]] [--json out.json] \
        [--loader-samples 64] [--profile] [--memory-profile] [--same-process]

Each (peer, shape) runs in its own Python process (`--same-process` to run them in this one): run after Eyrie in
one process, SpecForge's llama3-8b 2k step ran 10% slower than alone (Eyrie sets global compile options), which
moved the same-process ratio between 1.22x and 1.32x with the order. Every row times `--steps` steps one by one
(each ends in loss.item(), so a step's time is the wall time between them) after one untimed step: tokens/s is the
median with its min-max, and every step's time is kept. `--record NAME` writes tests/benchmarks/results/NAME.json
(commands, commit, device, versions, every row and step), which tests/benchmarks/render_results.py renders;
`--append` adds a command's rows to it (same commit and device), for a table that needs several 10-minute commands.

eyrie: the DeepSpeed engine as train/main.py builds it (ZeRO-2, bf16, the generated config), the teacher from
the final hidden state, `ttt_unroll`, `engine.backward`, `engine.step`; eyrie-recompute-logits: the same with
`train.recompute_logits` (the draft logits computed again in backward; its useful FLOPs are counted as eyrie's,
so its MFU is lower by the recompute); eyrie-lean: with `train.activation_checkpointing` too (the
kimi-k2.5 config's setting). specforge (0.2.0, when importable;
`pip download specforge==0.2.0 --no-deps -d .whl` puts its wheel in the carried `.whl/`, gpu-env.sh installs
it): `OnlineEagle3Model` over its `LlamaForCausalLMEagle3` with its default flex-attention backend, the offline
`TargetHead` + `Eagle3TrainStrategy`, its `BF16Optimizer`; by default its teacher materialises the full-vocabulary
logits in fp32; specforge-compact: the same with `compact_teacher=True` (its `training.compact_teacher`, the memory
option for large vocabularies: the teacher projected in exact vocabulary chunks), its best setting for memory.
Eyrie's teacher computes the head's logits in bf16 2,048 tokens at a time and keeps the draft-vocabulary
distribution in bf16 (softmax in fp32). Same random inputs: one sequence of T tokens, all
in the loss, TTT 7, decay 0.8. tokens/s from steps timed end to end (no synchronisation inside a step; the
phase split comes from one more, synchronised step). Peak memory = torch's max allocated over the timed steps,
weights and optimizer state included; resident = allocated between steps (weights, gradients, optimizer state).

Useful FLOPs per token (the same count for both): 7 steps x 3 x 2P, P = 2H(nh + 2 kvh) hd + nh hd H + 3 H I +
H Vd; causal attention 4 nh hd x 3 per (query, key) pair, (T + 1) / 2 + j pairs at step j; fc 2 x 2 x 3 Ht H;
the teacher's head 2 Ht Vt. MFU is shown twice: against the bf16 matmul rate measured in the same process, and
against the card's dense bf16 peak (989 TFLOP/s for the H100 SXM and the H200).

--profile runs one step at the first T under torch's profiler (host and GPU): top kernels, the host ops that took
the most launching time, kernels launched and how long the GPU was busy (row key profile; the trace, gzipped, in
$PROFILE_DIR). Every row's split_host_ms says how long the host took to launch each phase (close to split_ms:
the GPU waited for the host). --memory-profile adds `live_at_peak` to the first T's rows: the step's allocations
alive at its peak memory, by the code that made them.

eyrie-dflash, eyrie-dflash-flex, specforge-dflash: the DFlash training steps (blocks of 16 at 512 anchors;
tests/benchmarks/dflash_peers.py says what each runs and how its FLOPs are counted); tokens/s counts the T context
tokens.

--loader-samples N (with --peers "" to run it alone) writes N samples of the first shape through data/'s shard
writer and streams them through the trainer's loader (FeatureData.stream: collate + pin on a thread) while
eyrie steps: read GB/s and stall.
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_extract import matmul_tflops  # noqa: E402  (this script's folder is on sys.path)
from record_mission import RESULTS, write_record  # noqa: E402

SHAPES = {  # target hidden / vocab; drafter hidden, heads, kv heads, head_dim, intermediate; draft vocab
    "llama3-8b": dict(Ht=4096, Vt=128256, H=4096, nh=32, kvh=8, hd=128, I=14336, Vd=32000),
    "kimi-k2.5": dict(Ht=7168, Vt=163840, H=7168, nh=64, kvh=64, hd=128, I=18432, Vd=32000),
    "kimi-k2.5-kv8": dict(Ht=7168, Vt=163840, H=7168, nh=64, kvh=8, hd=128, I=18432, Vd=32000),
}
STEPS, DECAY = 7, 0.8
DENSE_BF16_PEAK_TFLOPS = 989.0  # H100 SXM and H200: NVIDIA's dense (no sparsity) bf16 tensor-core figure
# eyrie's variants: (train.activation_checkpointing, train.recompute_logits)
EYRIE_PEERS = {"eyrie": (False, False), "eyrie-recompute-logits": (False, True), "eyrie-lean": (True, True)}


def useful_flops(s: dict, T: int) -> float:
    P = 2 * s["H"] * (s["nh"] + 2 * s["kvh"]) * s["hd"] + s["nh"] * s["hd"] * s["H"] + 3 * s["H"] * s["I"] \
        + s["H"] * s["Vd"]
    pairs = sum((T + 1) / 2 + j for j in range(STEPS))
    per_token = STEPS * 3 * 2 * P + 4 * s["nh"] * s["hd"] * 3 * pairs + 2 * 2 * 3 * s["Ht"] * s["H"] \
        + 2 * s["Ht"] * s["Vt"]
    return per_token * T


def llama_config(s: dict):
    from transformers import LlamaConfig
    return LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=s["H"], num_attention_heads=s["nh"],
                       num_key_value_heads=s["kvh"], head_dim=s["hd"], intermediate_size=s["I"], rms_norm_eps=1e-5,
                       vocab_size=s["Vt"], max_position_embeddings=131072, rope_theta=500000.0, num_hidden_layers=1,
                       draft_vocab_size=s["Vd"], target_hidden_size=s["Ht"], tie_word_embeddings=False)


def vocab(s: dict):
    d2t = torch.zeros(s["Vd"], dtype=torch.int64)
    t2d = torch.zeros(s["Vt"], dtype=torch.bool)
    t2d[:s["Vd"]] = True
    return d2t, t2d


def bf16_cpu_drafter(s: dict, activation_checkpointing: bool, recompute_logits: bool):
    """The product's drafter and a random teacher head at a benchmark shape, bf16, blockwise attention: what the
    CPU bookkeeping scripts (saved_activations.py, step_memory.py) measure."""
    from train.drafter import Eagle3Drafter
    from train.teacher import Teacher
    torch.manual_seed(0)
    d2t, t2d = vocab(s)
    model = Eagle3Drafter(llama_config(s), d2t, t2d).to(torch.bfloat16)
    model.set_attention("blockwise")
    model.activation_checkpointing = activation_checkpointing
    model.lm_head.recompute_logits = recompute_logits
    return model, Teacher(torch.randn(s["Vt"], s["Ht"], dtype=torch.bfloat16) * 0.02, t2d)


@dataclass
class Inputs:
    ids: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor


def make_inputs(s: dict, T: int) -> Inputs:
    g = torch.Generator().manual_seed(T)
    return Inputs(torch.randint(0, s["Vd"], (1, T), generator=g),
                  torch.randn(1, T, 3 * s["Ht"], generator=g).bfloat16().pin_memory(),
                  torch.randn(1, T, s["Ht"], generator=g).bfloat16().pin_memory())


class Eyrie:
    """The product's training step: train/main.py's pieces, on synthetic inputs."""

    def __init__(self, s: dict, activation_checkpointing: bool, recompute_logits: bool = False):
        from data.config import TrainConfig
        from train.drafter import Eagle3Drafter
        from train.engine import deepspeed_config, init_engine
        from train.teacher import Teacher
        d2t, t2d = vocab(s)
        model = Eagle3Drafter(llama_config(s), d2t, t2d)
        model.set_attention("flex")
        model.activation_checkpointing = activation_checkpointing
        model.lm_head.recompute_logits = recompute_logits
        self.engine = init_engine(model, deepspeed_config(TrainConfig(), 1000, bf16=True))
        self.teacher = Teacher(torch.randn(s["Vt"], s["Ht"], device="cuda", dtype=torch.bfloat16) * 0.02,
                               t2d.cuda())

    def step(self, x: Inputs, timer) -> float:
        loss = self.loss(x, timer)
        with timer("backward"):
            self.engine.backward(loss)
        with timer("optimizer"):
            self.engine.step()
        return loss.item()

    def loss(self, x: Inputs, timer) -> torch.Tensor:
        """The data, teacher and forward phases of a step (a subclass trains another objective)."""
        from train.ttt import ttt_unroll
        with timer("data"):
            ids, aux, final = (t.cuda(non_blocking=True) for t in (x.ids, x.aux, x.final))
            mask, lengths = torch.ones_like(ids, dtype=torch.bool), torch.tensor([ids.shape[1]], device="cuda")
        with timer("teacher"):
            teacher = self.teacher(final)
        with timer("forward"):
            return ttt_unroll(self.engine, ids, aux, mask, lengths, teacher, STEPS, DECAY).loss

    def close(self):
        self.engine.destroy()


class SpecForge:
    """SpecForge 0.2.0's offline EAGLE-3 step as its trainer runs it on one GPU (no FSDP wrapper); with
    `compact_teacher`, its chunked exact teacher projection (training.compact_teacher)."""

    def __init__(self, s: dict, activation_checkpointing: bool, compact_teacher: bool = False):
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.auto import AutoDraftModel
        from specforge.modeling.target.target_head import TargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.training.strategies.base import Eagle3TrainStrategy
        config = llama_config(s)
        draft = AutoDraftModel.from_config(config, attention_backend="flex_attention", torch_dtype=torch.bfloat16)
        draft.d2t.copy_(vocab(s)[0])
        draft.t2d.copy_(vocab(s)[1])
        draft.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen (as its trainer does)
        self.model = OnlineEagle3Model(draft, length=STEPS, attention_backend="flex_attention").cuda()
        with tempfile.TemporaryDirectory() as d:
            config.save_pretrained(d)  # TargetHead reads hidden/vocab sizes from a model directory
            head = TargetHead(d)
        head.fc.weight.data.normal_(0, 0.02)
        head.freeze_weights()
        head = head.eval().to("cuda", torch.bfloat16)
        self.strategy = Eagle3TrainStrategy(self.model, target_head=head, ploss_decay=DECAY,
                                            **({"compact_teacher": True} if compact_teacher else {}))
        self.optimizer = BF16Optimizer(self.model, lr=1e-4, total_steps=1000)

    def step(self, x: Inputs, timer) -> float:
        from specforge.runtime.contracts import TrainBatch
        with timer("data"):
            ids = x.ids.cuda(non_blocking=True)
            tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
                       "hidden_state": x.aux.cuda(non_blocking=True), "target": x.final.cuda(non_blocking=True)}
        with timer("forward"):  # its teacher (full-vocabulary logits) runs inside forward_loss
            out = self.strategy.forward_loss(TrainBatch(["0"], "eagle3", tensors, {"target_repr": "hidden_state"}))
        with timer("backward"):
            out.loss.backward()
        with timer("optimizer"):
            self.optimizer.step()
        return out.loss.item()

    def close(self):
        self.model = self.strategy = self.optimizer = None  # let its memory go before the next peer


class Timer:
    """Per-phase wall time. The phases' synchronisations stall the host's kernel launches ahead of the GPU, so
    tokens/s come from steps run with `sync=False` (no per-phase timing, as a training loop runs) and the split
    from one more step with it."""

    def __init__(self, sync: bool = True):
        self.seconds: dict[str, float] = {}
        self.host: dict[str, float] = {}  # the host's share: launching the phase's work, before waiting for the GPU
        self.sync = sync

    def __call__(self, name: str):
        timer = self

        class Phase:
            def __enter__(self):
                if timer.sync:
                    torch.cuda.synchronize()
                    self.t = time.perf_counter()

            def __exit__(self, *exc):
                if timer.sync:
                    launched = time.perf_counter()
                    torch.cuda.synchronize()
                    timer.host[name] = timer.host.get(name, 0.0) + launched - self.t
                    timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t
        return Phase()


def memory_at_peak(step, top: int = 12) -> dict:
    """What one step's peak allocation is made of: the memory allocated before the step (weights, optimizer
    state, kept gradients) and the step's own allocations alive at its peak, summed by the first frame in
    Eyrie's, DeepSpeed's or SpecForge's code that made them (torch's allocator history, Python stacks)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        step()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in trace:  # replay: allocations made in the step, and frees (of those, or of memory from before it)
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e["frames"])
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            total -= e["size"]
    owners: dict[str, list] = {}
    for size, frames in at_peak.values():
        ours = [f for f in frames if any(k in f["filename"] for k in ("/train/", "/data/", "deepspeed", "specforge"))
                and "benchmarks" not in f["filename"]]
        f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
        key = f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"
        owners.setdefault(key, [0, 0])
        owners[key][0] += size
        owners[key][1] += 1
    ranked = sorted(owners.items(), key=lambda kv: -kv[1][0])[:top]
    return {"before_step_gib": round(before / 2 ** 30, 2), "step_peak_above_before_gib": round(peak / 2 ** 30, 2),
            "by_owner_gib": {k: [round(v[0] / 2 ** 30, 3), v[1]] for k, v in ranked}}


def host_syncs(step) -> dict[str, int]:
    """Where one step makes the host wait for the GPU (torch's sync debug mode), by the innermost line of
    Eyrie's, DeepSpeed's or SpecForge's code: a wait inside a phase stalls the launches queued behind it."""
    import traceback
    import warnings
    found: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(k in f.filename for k in ("/train/", "/data/", "deepspeed", "specforge"))]
        where = f"{'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno}" if frames else "?"
        key = f"{where} {str(message)[:60]}"
        found[key] = found.get(key, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def profile_step(step, name: str) -> dict:
    """One step under torch's profiler (host and GPU): the top kernels, the host ops that cost the most
    launching time, and how much of the step the GPU was busy (a launch-bound step leaves it idle). The trace
    is written gzipped to $PROFILE_DIR (default: the working directory)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    syncs = host_syncs(step)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=80), flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80), flush=True)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6  # device_time in us; overlap between streams is rare here
    trace = Path(os.environ.get("PROFILE_DIR", ".")) / f"trace-{name}.json"
    prof.export_chrome_trace(str(trace))
    subprocess.run(["gzip", "-f", str(trace)], check=False)
    return {"host_syncs": syncs, "wall_ms": round(wall * 1e3, 1), "kernels": len(kernels),
            "kernel_busy_ms": round(busy * 1e3, 1),
            "cuda_launches": sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                                       "cuLaunchKernel", "cuLaunchKernelEx"))}


SPECFORGE_PEERS = {"specforge": False, "specforge-compact": True}  # peer: compact_teacher


def run_peer(peer: str, shape: str, lengths: list[int], iters: int, peak_tflops: float, ckpt: bool,
             profile: bool = False, memory_profile: bool = False) -> list[dict]:
    s = SHAPES[shape]
    rows = []
    # Memory an earlier peer left allocated after its own clean-up below (a run of SpecForge first left its 7.6 GiB):
    # subtracted below, so each row's peak and resident are the peer's own.
    before = torch.cuda.memory_allocated()
    import dflash_peers  # imported here, not at the top: it subclasses this module's Eyrie
    flops, inputs, settings = useful_flops, make_inputs, {}
    try:
        own_ckpt, recompute = EYRIE_PEERS.get(peer, (False, False))
        if peer in dflash_peers.PEERS:
            runner = dflash_peers.PEERS[peer](s, ckpt)
            flops, inputs = dflash_peers.useful_flops, dflash_peers.make_inputs
            settings = dflash_peers.SETTINGS  # every row says which blocks it trained
        elif peer in SPECFORGE_PEERS:
            runner = SpecForge(s, ckpt, SPECFORGE_PEERS[peer])
        else:
            runner = Eyrie(s, ckpt or own_ckpt, recompute)
    except ImportError as e:
        return [{"peer": peer, "shape": shape, "error": f"not importable: {e}"}]
    for T in lengths:
        row = {"peer": peer + ("+ckpt" if ckpt and not own_ckpt else ""), "shape": shape, "T": T} | settings
        x = inputs(s, T)
        gc.collect()
        torch.cuda.empty_cache()
        try:
            runner.step(x, Timer())  # compiles flex for this length, allocates optimizer state
            torch.cuda.reset_peak_memory_stats()
            losses, step_seconds = [], []
            torch.cuda.synchronize()
            for _ in range(iters):  # step() ends in loss.item(): each step's wall time is its own
                t0 = time.perf_counter()
                losses.append(runner.step(x, Timer(sync=False)))
                step_seconds.append(time.perf_counter() - t0)
            sec = statistics.median(step_seconds)
            timer = Timer()
            runner.step(x, timer)
            resident = torch.cuda.memory_allocated()  # between steps: weights, gradients, optimizer state
        except torch.OutOfMemoryError:
            rows.append(row | {"error": "out of memory"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        if profile and T == lengths[0]:
            row["profile"] = profile_step(lambda: runner.step(x, Timer(sync=False)), f"{peer}-{shape}-{T}")
        if memory_profile and T == lengths[0]:
            row["live_at_peak"] = memory_at_peak(lambda: runner.step(x, Timer(sync=False)))
        row |= {"seconds": round(sec, 4), "tokens_per_s": round(T / sec),
                "tokens_per_s_min": round(T / max(step_seconds)), "tokens_per_s_max": round(T / min(step_seconds)),
                "step_seconds": [round(t, 5) for t in step_seconds],
                "peak_gib": round((torch.cuda.max_memory_allocated() - before) / 2 ** 30, 2),
                "resident_gib": round((resident - before) / 2 ** 30, 2),
                "mfu": round(flops(s, T) / sec / 1e12 / peak_tflops, 3),
                "mfu_of_dense_peak": round(flops(s, T) / sec / 1e12 / DENSE_BF16_PEAK_TFLOPS, 3),
                "split_ms": {k: round(v * 1e3, 1) for k, v in timer.seconds.items()},
                # host time close to a phase's time: the GPU waited for launches (CUDA graphs, fewer kernels)
                "split_host_ms": {k: round(v * 1e3, 1) for k, v in timer.host.items()},
                "split_total_ms": round(sum(timer.seconds.values()) * 1e3, 1),
                "loss": round(losses[-1], 3)} | ({"left_by_earlier_peers_gib": round(before / 2 ** 30, 2)}
                                                 if before > 2 ** 26 else {})
        rows.append(row)
        print(json.dumps(row), flush=True)
    runner.close()
    runner = None  # its memory goes before the next peer
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def loader_stall(shape: str, T: int, samples: int) -> dict:
    """Shards written with data/'s writer, read by the trainer's loader while the eyrie step runs."""
    from data.shards import ShardMeta, ShardWriter, write_manifest
    from train.loader import FeatureData
    s = SHAPES[shape]
    d = Path(tempfile.mkdtemp(prefix="eyrie-loader-"))
    meta = ShardMeta(kind="features", target_id="bench", aux_layer_ids=[1, 15, 28], hidden_size=s["Ht"],
                     dtype="bfloat16", final_hidden="post_norm")
    x = make_inputs(s, T)
    infos = []
    for shard in range(0, samples, 16):
        with ShardWriter(d / f"shard-{shard // 16:05d}.arrow", meta) as w:
            for i in range(shard, min(shard + 16, samples)):
                w.write(f"s{i}", x.ids[0].tolist(), [1] * T, x.aux[0], x.final[0])
            infos.append(w.close())
    write_manifest(d, meta, infos)
    nbytes = sum(i["bytes"] for i in infos)
    dropped = os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null") == 0
    data = FeatureData(d, set(), T, 0, 0, 1)
    t0 = time.perf_counter()
    for _ in data.stream(0, 0, 1, pin=True):
        pass
    read_s = time.perf_counter() - t0
    runner, timer, waited = Eyrie(s, False), Timer(), 0.0
    stream = data.stream(0, 0, 1, pin=True)
    first = True
    for _, _, batch, wait in stream:
        if first:  # compile + warm-up step outside the measurement
            runner.step(Inputs(batch.input_ids, batch.aux_hidden, batch.final_hidden), Timer())
            first, t0 = False, time.perf_counter()
            continue
        waited += wait
        runner.step(Inputs(batch.input_ids, batch.aux_hidden, batch.final_hidden), timer)
    total = time.perf_counter() - t0
    runner.close()
    shutil.rmtree(d)
    return {"shape": shape, "T": T, "samples": samples, "bytes": nbytes, "page_cache_dropped": dropped,
            "loader_read_gb_per_s": round(nbytes / read_s / 1e9, 2), "steps": samples - 1,
            "loader_stall_fraction": round(waited / total, 4), "step_seconds": round(total / (samples - 1), 4)}


def child_rows(peer: str, shape: str, a: argparse.Namespace) -> list[dict]:
    """One (peer, shape) in a fresh interpreter: no compile settings, allocator state or caches of another peer."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.json"
        cmd = [sys.executable, __file__, "--child", "--peers", peer, "--shapes", shape, "--lengths", a.lengths,
               "--steps", str(a.steps), "--json", str(out)] + (["--activation-checkpointing"]
                                                               if a.activation_checkpointing else []) \
            + (["--profile"] if a.profile else []) + (["--memory-profile"] if a.memory_profile else [])
        done = subprocess.run(cmd)
        if done.returncode != 0 or not out.exists():
            return [{"peer": peer, "shape": shape, "error": f"child process exited with {done.returncode}"}]
        return json.loads(out.read_text())["rows"]


def earlier_record(name: str, env: dict, results: Path = RESULTS) -> dict | None:
    """For --append: NAME.json as recorded so far, refused unless it was measured at this commit on this device
    (ratios are taken within one machine and one tree), or None where there is none yet."""
    path = results / f"{name}.json"
    if not path.exists():
        return None
    earlier = json.loads(path.read_text())
    if (earlier["commit"], earlier["environment"]["device"]) != (env["commit"], env["device"]):
        raise SystemExit(f"--append: {path} was measured at {earlier['commit'][:10]} on "
                         f"{earlier['environment']['device']}, this run is at {str(env['commit'])[:10]} on "
                         f"{env['device']}: record it under another name")
    return earlier


def record(name: str, argv: list[str], out: dict, append: bool = False, results: Path = RESULTS) -> Path:
    """results/NAME.json: what render_results.py renders into RESULTS.md. With `append`, this run's rows join
    those NAME.json holds from the same commit and device (a row of the same peer, shape and T is replaced), so
    that one table can come from consecutive commands on one machine, each within its time limit."""
    from data.environment import environment
    env = environment()
    command = " ".join(["python", "tests/benchmarks/bench_train.py", *argv])
    earlier = earlier_record(name, env, results) if append else None
    commands = [command]
    if earlier:  # written again after each peer: the same command is listed once
        commands = earlier["commands"] + ([command] if earlier["commands"][-1] != command else [])
        def measured(row: dict) -> tuple:
            return row["peer"], row["shape"], row.get("T")  # an error row has no T
        ours = {measured(row) for row in out["rows"]}
        out = out | {"rows": [row for row in earlier["results"]["rows"] if measured(row) not in ours] + out["rows"]}
    return write_record({"name": name, "kind": "train_step", "date": time.strftime("%Y-%m-%d"), "commands": commands,
                         "commit": env["commit"], "environment": env, "notes": earlier["notes"] if earlier else [],
                         "invalid": {}, "results": out}, results)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="llama3-8b,kimi-k2.5")
    p.add_argument("--lengths", default="2048,8192,16384")
    p.add_argument("--peers", default="eyrie,specforge")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row (after one untimed step)")
    p.add_argument("--same-process", action="store_true", help="every peer in this process (not comparable)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--record", default=None, metavar="NAME", help="write tests/benchmarks/results/NAME.json")
    p.add_argument("--append", action="store_true",
                   help="--record: add the rows to NAME.json's (same commit and device: one table, several commands)")
    p.add_argument("--activation-checkpointing", action="store_true", help="eyrie: recompute the layer per step")
    p.add_argument("--loader-samples", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true",
                   help="at the first T: one step under the profiler (kernels, host ops; trace to $PROFILE_DIR)")
    p.add_argument("--memory-profile", action="store_true",
                   help="at the first T: what one step's peak memory is made of (row key live_at_peak)")
    a = p.parse_args()
    lengths = [int(t) for t in a.lengths.split(",")]
    peers = [p for p in a.peers.split(",") if p]  # --peers "" with --loader-samples: the loader alone
    from dflash_peers import PEERS as DFLASH_PEERS
    known = {*EYRIE_PEERS, *SPECFORGE_PEERS, *DFLASH_PEERS}
    if set(peers) - known:  # before any GPU work
        raise SystemExit(f"--peers: unknown {sorted(set(peers) - known)} ({', '.join(sorted(known))})")
    if a.append and a.record and not a.child:  # refused now, not after minutes of measuring
        from data.environment import environment
        earlier_record(a.record, environment())
    out = {"dense_bf16_peak_tflops": DENSE_BF16_PEAK_TFLOPS, "torch": torch.__version__, "steps": a.steps,
           "isolated": not (a.same_process or a.child), "rows": []}
    if out["isolated"]:  # this process starts no CUDA context: each child measures its own matmul rate
        for shape in a.shapes.split(","):
            for peer in peers:
                out["rows"] += child_rows(peer, shape, a)
                if a.record:  # after each peer: a run cut short by a time limit keeps the rows it measured
                    record(a.record, sys.argv[1:], out, a.append)
    else:
        from train.main import setup_distributed
        setup_distributed()
        out["peak_bf16_matmul_tflops"] = peak = round(matmul_tflops(), 1)
        print(json.dumps(out), flush=True)
        for shape in a.shapes.split(","):
            for peer in peers:
                ckpt = a.activation_checkpointing and peer.startswith("eyrie")
                rows = run_peer(peer, shape, lengths, a.steps, peak, ckpt, a.profile, a.memory_profile)
                out["rows"] += [r | {"peak_bf16_matmul_tflops": peak} for r in rows]
    if a.loader_samples:
        out["loader"] = loader_stall(a.shapes.split(",")[0], 2048, a.loader_samples)
        print(json.dumps(out["loader"]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if a.record:
        record(a.record, sys.argv[1:], out, a.append)  # prints where it wrote


if __name__ == "__main__":
    main()
