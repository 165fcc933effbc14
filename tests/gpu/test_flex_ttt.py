"""On CUDA: the fused (flex) TTT attention equals the blockwise one in values and gradients (bf16)."""
import pytest
import torch

from train import ttt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: flex attention's backward (compiled kernels) was not run")


@pytest.mark.parametrize("T", [256, 1000])  # 1000: not a multiple of flex's 128-wide blocks
def test_flex_matches_blockwise_with_gradients(T):
    torch.manual_seed(0)
    leaves = [torch.randn(1, 8, T, 64, device="cuda", dtype=torch.bfloat16)] + \
        [torch.randn(1, 2, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    results = []
    for backend in ("flex", "blockwise"):
        q, *kv = [t.clone().requires_grad_() for t in leaves]
        out = ttt.ttt_attention(q, kv[:4], kv[4:], 0.125, backend)
        out.float().pow(2).sum().backward()
        results.append([out] + [t.grad for t in (q, *kv)])
    assert not ttt._FLEX_FAILED
    for name, a, b in zip(["out", "q", "k0", "k1", "k2", "k3", "v0", "v1", "v2", "v3"], *results):
        error = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert error < 1e-2, (name, error)  # bf16: both round the probabilities to 8 bits
