"""The fused flex-attention TTT kernel equals the blockwise one, forward and backward (CUDA only)."""
import pytest
import torch

from train import ttt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="not run: flex attention's backward needs CUDA; the blockwise TTT attention is tested on CPU")]


@pytest.mark.parametrize("T,steps", [(256, 1), (300, 4), (1024, 7)])
def test_flex_equals_blockwise(T, steps):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    q = torch.randn(2, 8, T, 64, device=dev, requires_grad=True)
    ks = [torch.randn(2, 2, T, 64, device=dev, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(2, 2, T, 64, device=dev, requires_grad=True) for _ in range(steps)]
    grads = []
    for backend in ("flex", "blockwise"):
        out = ttt.ttt_attention(q, ks, vs, 0.125, backend)
        g = torch.autograd.grad((out * torch.linspace(-1, 1, 64, device=dev)).sum(), [q, *ks, *vs])
        grads.append((out.detach(), g))
    (o1, g1), (o2, g2) = grads
    torch.testing.assert_close(o1, o2, atol=2e-3, rtol=2e-3)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=5e-3)
