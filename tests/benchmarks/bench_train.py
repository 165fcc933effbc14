"""Drafter training step on a GPU: peak memory vs sequence length and throughput/MFU, per TTT attention backend
(not collected by pytest).

    python tests/benchmarks/bench_train.py [--lengths 2048,4096,8192,16384] [--backends flex,blockwise]

A Llama-3-8B-shaped drafter (hidden 4096, 32/8 heads, MLP 14336, target vocab 128256, draft vocab 32000),
bf16, 7-step TTT forward + backward (the teacher's LM head included) on random inputs of one sequence of
length T. MFU counts 6 x trainable params per token per step (fc once) + attention + the teacher's LM head,
against a bf16 matmul rate measured in the same run.
"""
import argparse
import json
import time

import torch

from train import ttt
from train.drafter import Eagle3Drafter
from train.teacher import Teacher


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - t) / 1e12


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="2048,4096,8192,16384")
    p.add_argument("--backends", default="flex,blockwise")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--iters", type=int, default=3)
    a = p.parse_args()
    from transformers import LlamaConfig
    H, V, Vd = 4096, 128256, 32000
    config = LlamaConfig(hidden_size=H, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, rms_norm_eps=1e-5, vocab_size=V, max_position_embeddings=131072,
                         rope_theta=500000.0, draft_vocab_size=Vd, target_hidden_size=H, num_hidden_layers=1)
    d2t = torch.zeros(Vd, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True
    dev = torch.device("cuda")
    model = Eagle3Drafter(config, d2t, t2d).to(dev, torch.bfloat16)
    teacher = Teacher(torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.02, t2d)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fc = model.fc.weight.numel()
    peak_tflops = matmul_tflops()
    results = {"peak_bf16_matmul_tflops": round(peak_tflops, 1), "trainable_params": trainable, "runs": []}
    for backend in a.backends.split(","):
        model.set_attention(backend)
        for T in map(int, a.lengths.split(",")):
            ids = torch.randint(0, Vd, (1, T), device=dev)
            aux = torch.randn(1, T, 3 * H, device=dev, dtype=torch.bfloat16)
            final = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
            mask, lengths = torch.ones(1, T, dtype=torch.bool, device=dev), torch.tensor([T], device=dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            times = []
            try:
                for it in range(a.iters + 1):  # the first iteration compiles (flex) and warms up
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    r = ttt.ttt_unroll(model, ids, aux, mask, lengths, teacher(final), a.steps, 0.8)
                    r.loss.backward()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                    model.zero_grad(set_to_none=True)
            except torch.OutOfMemoryError:
                results["runs"].append({"backend": backend, "T": T, "error": "out of memory"})
                print(json.dumps(results["runs"][-1]), flush=True)
                continue
            sec = sum(times[1:]) / len(times[1:])
            attn = 4 * 32 * 128 * (T / 2 + a.steps) * 3  # per token per step, fwd + bwd (QK and PV), causal
            flops = T * (a.steps * (6 * (trainable - fc) + attn) + 6 * fc + 2 * V * H)
            run = {"backend": backend, "T": T, "steps": a.steps, "seconds": round(sec, 4),
                   "tokens_per_s": round(T / sec), "peak_memory_gb": round((torch.cuda.max_memory_allocated() - base)
                                                                            / 2 ** 30, 2),
                   "mfu_vs_measured_matmul": round(flops / sec / 1e12 / peak_tflops, 3)}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
