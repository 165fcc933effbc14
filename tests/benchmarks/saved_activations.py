"""What autograd keeps for backward in one TTT unroll of the product's drafter, per token, grouped by the saved
tensors' last dimension (which names them: the draft vocab = the loss's logits gradient, the intermediate size =
SwiGLU's gate and up, the hidden size, head_dim = attention). Device-independent bookkeeping, so it runs on the
CPU (blockwise attention; flex keeps less on a GPU); peak memory itself is measured by bench_train.py on the GPU.

    python tests/benchmarks/saved_activations.py --shape llama3-8b --T 128 [--activation-checkpointing]
        [--recompute-logits]
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_train  # noqa: E402  (the shapes and the drafter config the GPU benchmark uses)

from train.ttt import ttt_unroll  # noqa: E402


def saved_bytes(shape: str, T: int, activation_checkpointing: bool, recompute_logits: bool) -> dict:
    s = bench_train.SHAPES[shape]
    model, teacher = bench_train.bf16_cpu_drafter(s, activation_checkpointing, recompute_logits)
    ids = torch.randint(0, s["Vd"], (1, T))
    aux, final = torch.randn(1, T, 3 * s["Ht"]).bfloat16(), torch.randn(1, T, s["Ht"]).bfloat16()
    probs = teacher(final)
    # weights and the teacher's probs are held whatever autograd keeps
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), probs.probs]}
    saved: dict[int, tuple[int, int, str]] = {}  # storage → (bytes, last dim, dtype); views of one storage once

    def pack(x):
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in weights:
                saved.setdefault(storage.data_ptr(), (storage.nbytes(), x.shape[-1] if x.dim() else 0, str(x.dtype)))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ttt_unroll(model, ids, aux, torch.ones_like(ids, dtype=torch.bool), torch.tensor([T]), probs,
                   bench_train.STEPS, bench_train.DECAY)
    groups = collections.Counter()
    for nbytes, last, dtype in saved.values():
        groups[f"last dim {last} {dtype.removeprefix('torch.')}"] += nbytes
    return {"shape": shape, "T": T, "activation_checkpointing": activation_checkpointing,
            "recompute_logits": recompute_logits,
            "kib_per_token": round(sum(groups.values()) / T / 1024, 1),
            "by_group_kib_per_token": {k: round(v / T / 1024, 1) for k, v in groups.most_common()
                                       if v / T / 1024 >= 0.05}}  # not the per-step loss weights


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(bench_train.SHAPES))
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--recompute-logits", action="store_true")
    a = p.parse_args()
    import json
    print(json.dumps(saved_bytes(a.shape, a.T, a.activation_checkpointing, a.recompute_logits), indent=1))
