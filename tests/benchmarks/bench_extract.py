"""Extraction throughput on a GPU, per backend, with and without writing (not collected by pytest).

    python tests/benchmarks/bench_extract.py --out /tmp/bx --backend hf       [--shape 8b --samples 128 --seq 2048]
    python tests/benchmarks/bench_extract.py --out /tmp/bx --backend sglang --phases job   (reuses the target)
    python tests/benchmarks/bench_extract.py --out /tmp/bx --backend sglang --phases forward
    python tests/benchmarks/bench_extract.py --out /tmp/bx --backend hf --phases job --aux-encoding fp8_e4m3_rowscale
(SGLang's runner owns its process's parallel state, so one SGLang backend per process: one phase per call.)
Builds a random Llama of the given shape (bf16) once under OUT/target, writes random-token samples through
data/'s writer, and measures in one process, on the same samples and batches:
  forward       the backend's capture alone (states left on the GPU)
  forward+copy  plus the device→host copies of the packed states into pinned memory
  job           extract.job.run: forward, copies, Arrow shard writes, fsync and checksums (hf: its second pass;
                sglang: after an 8-sample job in a process of its own has filled the kernel caches on disk)
Each as tokens/s and MFU of the target forward (2 x non-embedding params + causal attention per token) against
the bf16 matmul rate measured in the same process. Prints one JSON line.
"""
import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from data.config import EyrieConfig
import data.files
from data.shards import ShardMeta, ShardWriter, write_manifest
from extract.job import _to_host, run

SHAPES = {  # hidden, layers, intermediate, vocab
    "1.5b": (2048, 24, 8192, 32000),
    "8b": (4096, 32, 14336, 128256),  # Llama-3-8B
}


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (time.perf_counter() - t) / 1e12


def build_target(path: Path, shape: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers, inter, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=8, max_position_embeddings=8192,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(path))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--backend", choices=["hf", "sglang"], default="hf")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--phases", default="job,forward", help="job and/or forward (forward, forward+copy)")
    p.add_argument("--aux-encoding", default="raw", choices=["raw", "fp8_e4m3_rowscale"],
                   help="extract.aux_encoding of the job phase")
    p.add_argument("--no-warmup", action="store_true", help="sglang job: skip the warm-up process")
    p.add_argument("--writeback-mb", default=str(data.files.WRITEBACK_BYTES >> 20),
                   help="job phase: one job per value, in order (e.g. 256,0,256,0): MB a shard writer lets "
                        "accumulate before it starts the disk write (data.files.WRITEBACK_BYTES; 0 = at the fsync)")
    a = p.parse_args()
    if a.backend == "sglang" and "job" in a.phases.split(",") and not a.no_warmup:
        import subprocess
        import sys  # one SGLang runner per process: warm the kernel caches (triton, JIT) in another one
        subprocess.run([sys.executable, __file__, "--out", a.out, "--backend", "sglang", "--shape", a.shape,
                        "--samples", "8", "--seq", str(a.seq), "--max-batch-tokens", str(a.max_batch_tokens),
                        "--phases", "job", "--aux-encoding", a.aux_encoding, "--no-warmup"],
                       check=True, stdout=subprocess.DEVNULL)
    out = Path(a.out)
    target = out / "target"
    if not (target / "config.json").exists():
        build_target(target, a.shape)
    from transformers import AutoConfig
    tc = AutoConfig.from_pretrained(target)
    hidden, layers = tc.hidden_size, tc.num_hidden_layers
    kv = tc.num_key_value_heads * hidden // tc.num_attention_heads
    n_params = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * tc.intermediate_size)
    flops_per_token = 2 * n_params + 2 * layers * a.seq * hidden  # matmuls + causal attention (QK and PV, T/2 keys)

    run_dir = out / f"run-{a.backend}"
    shutil.rmtree(run_dir, ignore_errors=True)
    samples = run_dir / "data" / "samples"
    samples.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    meta = ShardMeta(kind="tokens", target_id=str(target))
    with ShardWriter(samples / "shard-00000.arrow", meta) as w:
        for i in range(a.samples):
            w.write(str(i), torch.randint(0, tc.vocab_size, (a.seq,), generator=g).tolist(), [1] * a.seq)
        info = w.close()
    write_manifest(samples, meta, [info])
    ids = [1, layers // 2 - 1, layers - 4]
    cfg = EyrieConfig.model_validate({
        "run_dir": str(run_dir), "target": {"path": str(target), "aux_layer_ids": ids},
        "data": {"inputs": ["-"], "max_length": a.seq}, "extract": {"samples_per_shard": 32, "backend": a.backend,
                                                                   "max_batch_tokens": a.max_batch_tokens,
                                                                   "aux_encoding": a.aux_encoding}})
    peak = matmul_tflops()
    result = {"gpu": torch.cuda.get_device_name(), "backend": a.backend, "target": f"Llama {a.shape}",
              "params_non_embedding": n_params, "layers": layers, "hidden": hidden, "dtype": "bfloat16",
              "samples": a.samples, "seq": a.seq, "aux_layer_ids": ids, "aux_encoding": a.aux_encoding,
              "matmul_tflops": round(peak, 1)}

    phases = a.phases.split(",")
    if "job" in phases:
        for i, mb in enumerate(int(x) for x in a.writeback_mb.split(",")):
            data.files.WRITEBACK_BYTES = mb << 20
            result["writeback_mb"] = mb
            job(cfg, result, flops_per_token, peak, run_dir, warm=i > 0)
    if "forward" in phases:
        forward(cfg, result, flops_per_token, peak, a, target, ids, tc.vocab_size)


def job(cfg, result, flops_per_token, peak, run_dir, warm: bool) -> None:
    if cfg.extract.backend == "hf" and not warm:  # warm-up pass (kernels, allocator, page cache); SGLang: main()
        run(cfg)
    shutil.rmtree(run_dir / "features", ignore_errors=True)
    t = time.perf_counter()
    manifest = run(cfg)
    job_s = time.perf_counter() - t
    tokens = manifest["totals"]["tokens"]
    result["job"] = {"tokens_per_s": round(tokens / job_s), "mfu": round(tokens / job_s * flops_per_token / peak / 1e12, 3),
                     "seconds_incl_load": round(job_s, 1), "tokens_per_s_after_load": manifest["ranks"][0]["tokens_per_s"],
                     "bytes_per_token": round(manifest["totals"]["bytes_per_token"])}
    result["job"]["mfu_after_load"] = round(result["job"]["tokens_per_s_after_load"] * flops_per_token / peak / 1e12, 3)
    print("BENCH " + json.dumps(result), flush=True)


def forward(cfg, result, flops_per_token, peak, a, target, ids, vocab) -> None:
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    if a.backend == "hf":
        from extract.backend import BackendSpec
        from extract.hf import HFBackend
        backend = HFBackend(BackendSpec(str(target), ids, torch.bfloat16, torch.device("cuda")))
    else:
        from extract.sglang import SGLangBackend
        backend = SGLangBackend(BackendSpec(str(target), ids, torch.bfloat16, torch.device("cuda", 0)))
    batch_tokens = min(a.max_batch_tokens, getattr(backend, "max_forward_tokens", a.max_batch_tokens))
    bs = max(1, batch_tokens // a.seq)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (bs, a.seq), generator=g)
    mask = torch.ones_like(x)
    n_batches = max(1, a.samples // bs)
    for copy in (False, True):
        backend.capture(x, mask)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n_batches):
            aux, final = backend.capture(x, mask)
            if copy:
                _to_host(aux), _to_host(final)
        torch.cuda.synchronize()
        tps = n_batches * bs * a.seq / (time.perf_counter() - t)
        result["forward_copy" if copy else "forward"] = {"tokens_per_s": round(tps),
                                                         "mfu": round(tps * flops_per_token / peak / 1e12, 3)}
    print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
