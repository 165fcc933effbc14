"""The memory-light loss and MLP compute what autograd's plain graph computes, and keep less for backward."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from train import fused


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while running fn()."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


@pytest.mark.parametrize("chunk_rows", [3, 14], ids=["several chunks, the last one short", "one chunk"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_soft_cross_entropy_matches_autograd(monkeypatch, dtype, tol, chunk_rows):
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", chunk_rows * 50)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 7, 50, generator=g) * 3).to(dtype).requires_grad_()
    p = torch.softmax(torch.randn(2, 7, 50, generator=g) * 2, -1).to(dtype)
    weight = torch.rand(2, 7, generator=g) > 0.3
    ref_logits = logits.detach().clone().requires_grad_()
    ref = (-(p.float() * F.log_softmax(ref_logits.float(), -1)).sum(-1) * weight).sum()
    (ref * 0.7).backward()
    ours_bytes, ours = saved_bytes(lambda: fused.soft_cross_entropy(logits, p, weight))
    (ours * 0.7).backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), rtol=tol, atol=tol * 0.05)
    assert ours_bytes == logits.numel() * logits.element_size()  # one gradient-sized tensor, nothing else
    assert (logits.grad.view(14, 50)[~weight.flatten()] == 0).all()  # unweighted tokens get no gradient


@pytest.mark.parametrize("soft", [False, True], ids=["labels", "distribution"])
@pytest.mark.parametrize("chunk_rows", [3, 14], ids=["several chunks, the last one short", "one chunk"])
def test_frozen_head_cross_entropy_matches_autograd(monkeypatch, soft, chunk_rows):
    """DFlash's loss through the target's head: the same loss, x-gradient and argmax as autograd's plain graph,
    keeping only an x-sized gradient (the plain graph keeps [rows, vocab] fp32 tensors)."""
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", chunk_rows * 50)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(14, 16, generator=g).requires_grad_()
    head = torch.randn(50, 16, generator=g)
    target = torch.softmax(torch.randn(14, 50, generator=g) * 2, -1) if soft else \
        torch.randint(0, 50, (14,), generator=g)
    weight = torch.rand(14, generator=g) * (torch.rand(14, generator=g) > 0.3)
    ref_x = x.detach().clone().requires_grad_()
    logits = ref_x @ head.T
    ce = -(target * F.log_softmax(logits, -1)).sum(-1) if soft else F.cross_entropy(logits, target, reduction="none")
    ((ce * weight).sum() * 0.7).backward()
    ours_bytes, (ours, argmax) = saved_bytes(lambda: fused.frozen_head_cross_entropy(x, head, target, weight))
    (ours * 0.7).backward()
    torch.testing.assert_close(ours, (ce * weight).sum().detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(argmax, logits.argmax(-1)) and ref_x.grad.abs().sum() > 0
    assert ours_bytes == x.numel() * x.element_size()  # the x-sized gradient, nothing vocabulary-sized
    assert (x.grad[weight == 0] == 0).all()


def test_swiglu_mlp_matches_llama_mlp():
    config = LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=2, hidden_act="silu", mlp_bias=False)
    ref, ours = LlamaMLP(config), fused.SwiGLUMLP(16, 40)
    ours.load_state_dict(ref.state_dict())  # same parameter names: exports and checkpoints are unchanged
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref_bytes, y_ref = saved_bytes(lambda: ref(x_ref))
    ours_bytes, y = saved_bytes(lambda: ours(x))
    torch.testing.assert_close(y, y_ref)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert ours_bytes < ref_bytes - 2 * 15 * 40 * 4 + 1  # silu(gate) and the product are not kept
    with torch.no_grad():
        torch.testing.assert_close(ours(x), y_ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_llama_rms_norm(dtype, tol):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    ref, ours = LlamaRMSNorm(32, eps=1e-5).to(dtype), fused.RMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.normal_()
    ours.load_state_dict(ref.state_dict())
    x = (torch.randn(3, 5, 32) * 4).to(dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    ref_bytes, y_ref = saved_bytes(lambda: ref(x_ref))
    ours_bytes, y = saved_bytes(lambda: ours(x))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same value, bit for bit
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    for a, b in ((x.grad, x_ref.grad), (ours.weight.grad, ref.weight.grad)):
        assert (a.float() - b.float()).norm() <= tol * b.float().norm()
    assert ours_bytes <= x.numel() * x.element_size() + 32 * x.element_size() + 15 * 4  # input, weight, 1/rms
    assert ours_bytes < ref_bytes
