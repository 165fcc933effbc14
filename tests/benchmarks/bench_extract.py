"""hf-backend extraction throughput on a GPU, writing included (not collected by pytest).

    python tests/benchmarks/bench_extract.py --out /tmp/bx [--hidden 2048 --layers 24 --samples 64 --seq 2048]
Builds a random Llama of the given shape (bf16), writes random-token samples through data/'s writer, runs
the extraction job in-process and reports tokens/s (forward + device→host copy + shard write + checksum)
and MFU against --peak-tflops (794 = bf16 matmul rate measured on the H200).
"""
import argparse
import json
import shutil
from pathlib import Path

import torch

from data.config import EyrieConfig
from data.shards import ShardMeta, ShardWriter, write_manifest
from extract.job import run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--peak-tflops", type=float, default=794.0)
    a = p.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=a.hidden * 4,
                         num_hidden_layers=a.layers, num_attention_heads=a.hidden // 128, num_key_value_heads=8,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out / "target"))
    n_params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    del model
    samples = out / "run" / "data" / "samples"
    samples.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    meta = ShardMeta(kind="tokens", target_id=str(out / "target"))
    with ShardWriter(samples / "shard-00000.arrow", meta) as w:
        for i in range(a.samples):
            w.write(str(i), torch.randint(0, 32000, (a.seq,), generator=g).tolist(), [1] * a.seq)
        info = w.close()
    write_manifest(samples, meta, [info])
    ids = [1, a.layers // 2 - 1, a.layers - 4]
    cfg = EyrieConfig.model_validate({
        "run_dir": str(out / "run"), "target": {"path": str(out / "target"), "aux_layer_ids": ids},
        "data": {"inputs": ["-"]}, "extract": {"samples_per_shard": 16, "max_batch_tokens": a.max_batch_tokens}})
    run(cfg)  # warm-up pass (kernels, allocator), then the timed one
    shutil.rmtree(out / "run" / "features")
    manifest = run(cfg)
    rank = manifest["ranks"][0]
    # matmul FLOPs per token (2 x non-embedding params) + causal attention (2 x 2 x T/2 x H per layer)
    flops_per_token = 2 * n_params + 2 * a.layers * a.seq * a.hidden
    mfu = rank["tokens_per_s"] * flops_per_token / (a.peak_tflops * 1e12)
    result = {"gpu": torch.cuda.get_device_name(), "params_non_embedding": n_params, "layers": a.layers,
              "hidden": a.hidden, "dtype": "bfloat16", "samples": a.samples, "seq": a.seq,
              "tokens_per_s_incl_writing": rank["tokens_per_s"], "mfu_incl_writing": round(mfu, 3),
              "bytes_per_token": manifest["totals"]["bytes_per_token"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
