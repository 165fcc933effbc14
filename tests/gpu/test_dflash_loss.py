"""On CUDA: DFlash's loss through the frozen target head (train.fused.frozen_head_cross_entropy, its chunks
compiled by Inductor) equals autograd's plain graph in bf16 at a llama3-sized vocabulary, and its peak memory
stays far below the plain graph's [rows, vocab] fp32 tensors."""
import pytest
import torch
import torch.nn.functional as F

from train import fused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the loss's compiled (Inductor) chunks were not run")]


def peak_above_start(fn):
    """(fn's result, the peak bytes allocated while it ran above what was allocated when it started)."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - start


@pytest.mark.parametrize("soft", [False, True])
def test_frozen_head_loss_on_cuda_matches_autograd_and_keeps_no_vocab_sized_tensor(soft):
    torch.manual_seed(0)
    rows, H, V = 4096, 1024, 128_256  # 4096 block positions, llama3's vocabulary: 8 chunks of <= 523 rows
    head = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    target = torch.softmax(torch.randn(rows, V, device="cuda") * 3, -1).to(torch.bfloat16) if soft else \
        torch.randint(0, V, (rows,), device="cuda")
    weight = torch.rand(rows, device="cuda") * (torch.rand(rows, device="cuda") > 0.3)

    ref_x = x.clone().requires_grad_()
    logits = (ref_x @ head.T).float()
    ce = -(target.float() * F.log_softmax(logits, -1)).sum(-1) if soft else \
        F.cross_entropy(logits, target, reduction="none")
    ((ce * weight).sum() * 0.5).backward()

    ours_x = x.clone().requires_grad_()
    fused.frozen_head_cross_entropy(ours_x, head, target, weight)  # compiles the chunk for these shapes
    ours_x.grad = None
    (loss, argmax), peak = peak_above_start(lambda: fused.frozen_head_cross_entropy(ours_x, head, target, weight))
    (loss * 0.5).backward()

    torch.testing.assert_close(loss, (ce * weight).sum().detach(), rtol=2e-3, atol=1e-2)
    error = ((ours_x.grad.float() - ref_x.grad.float()).norm() / ref_x.grad.float().norm()).item()
    assert error < 1e-2, error  # bf16 gradients, fp32 softmax in both
    assert (argmax == logits.argmax(-1)).float().mean() > 0.99  # ties in bf16 logits may break either way
    # a chunk's temporaries (its bf16 logits, a few fp32 [523, vocab] tensors of 256 MB) and the kept x-sized
    # gradient; the plain graph's fp32 logits alone are 2 GiB here, its log-softmax 2 GiB more
    assert peak < 1.6 * 2 ** 30, peak / 2 ** 30
