"""On CUDA: DFlash's loss through the frozen target head (train.fused.frozen_head_cross_entropy, its chunks
compiled by Inductor) equals autograd's plain graph in bf16 at a llama3-sized vocabulary, and its peak memory
stays far below the plain graph's [rows, vocab] fp32 tensors; its block-sparse flex attention gives the dense
mask's loss and gradients."""
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


def test_flex_block_attention_on_cuda_gives_the_dense_masks_loss_and_gradients():
    """The DFlash objective with train.attention: flex (Inductor's block-sparse kernel) against the dense
    visibility mask through SDPA (the default): the same loss and parameter gradients (fp32, TF32 off), on two
    samples of different lengths with grouped-query heads and 40 blocks of 16 per sample."""
    from types import SimpleNamespace

    from train.dflash import DFlashDrafter, dflash_config, dflash_objective
    target = SimpleNamespace(text_config={"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                                          "intermediate_size": 1024, "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
                             hidden_size=512, vocab_size=1000, max_position_embeddings=4096, num_layers=8,
                             dtype="float32")
    torch.manual_seed(0)
    drafter = DFlashDrafter(dflash_config(target, 2, [1, 4, 6], 16, mask_token_id=999)).cuda()
    B, T, V, H = 2, 1000, 1000, 512
    embed, head = torch.randn(V, H, device="cuda"), torch.randn(V, H, device="cuda") * H ** -0.5
    ids, aux = torch.randint(0, V, (B, T), device="cuda"), torch.randn(B, T, 3 * H, device="cuda")
    lengths = torch.tensor([1000, 700], device="cuda")
    loss_mask = (torch.arange(T, device="cuda")[None] < lengths[:, None]).long()

    def run(attention: str):
        drafter.zero_grad()
        r = dflash_objective(drafter, embed, head, ids, aux, loss_mask, lengths, 40, 7.0,
                             torch.Generator().manual_seed(1), attention=attention)
        r.loss.backward()
        return r.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        (flex, flex_grads), (dense, dense_grads) = run("flex"), run("dense")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)
    for name, grad in dense_grads.items():
        error = ((flex_grads[name] - grad).norm() / grad.norm().clamp(min=1e-12)).item()
        assert error < 1e-3, (name, error)
