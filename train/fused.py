"""Memory-light autograd functions for the largest activations of a TTT step (the loss, SwiGLU, RMSNorm) and of a
DFlash step (its loss through the frozen target head).

Autograd's default graph for `-(p · log_softmax(logits.float())).sum(-1)` keeps, per TTT step, the fp32 logits,
their fp32 log-softmax and an fp32 copy of the teacher's distribution: ~14 bytes per draft-vocab entry per
token (a 32K draft vocab: 450 KB per token per step). SwiGLU keeps gate, up, silu(gate) and their product.
RMSNorm keeps an fp32 copy of its input and the normalised tensor. The functions below keep only what backward
cannot cheaply recompute, and compute the same values.

Their elementwise math runs as eager PyTorch on the CPU and through torch.compile on CUDA (`on_cuda_compiled`):
eager, each of those ops is a kernel reading and writing whole tensors, which cost a TTT step on an H200 ~40% of
its time; compiled, each function is one or two fused kernels. dynamic=True: one compile serves every length.
RMSNorm on CUDA is torch's own fused kernel instead (RMSNorm.forward); `_RMSNorm` serves the CPU.
"""
from __future__ import annotations

import functools

import torch
import torch.fx.experimental._config
import torch.nn.functional as F
from torch import nn

CHUNK_ELEMENTS = 1 << 26  # fp32 temporaries of the loss are bounded to chunk x vocab <= 64M values (256 MB)


CPU_COMPILE_BACKEND: str | None = None  # None: eager on the CPU; tests set "aot_eager" to count dynamo graphs


def on_cuda_compiled(fn):
    """fn itself for CPU tensors; torch.compile(fn, dynamic=True) for CUDA ones (compiled on first use).

    Every graph dynamo makes is an Inductor compile of seconds on the GPU (forward and backward apart), so
    the inputs must not vary in what dynamo guards: callers pass detached tensors where autograd does not
    run through fn (requires_grad is guarded), and duck sizing is off (else two sizes equal on the first
    call, e.g. batch size and head count, are assumed equal forever and recompile when they are not). Duck
    sizing is switched off for the process, once: a config patch around each call cost ~40 us of host time, and
    a TTT step on an H200 makes ~100 of these calls while its GPU waits for the host (RESULTS.md)."""
    compiled = functools.cache(lambda backend: torch.compile(fn, dynamic=True, backend=backend))

    @functools.wraps(fn)
    def wrapper(x, *args):
        backend = "inductor" if x.is_cuda else CPU_COMPILE_BACKEND
        if backend is None:
            return fn(x, *args)
        torch.fx.experimental._config.use_duck_shape = False
        return compiled(backend)(x, *args)
    return wrapper


@on_cuda_compiled
def _soft_ce_chunk(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(x.float(), dim=-1)
    p = p.float()
    loss = (-(p * log_probs).sum(-1) * w).sum()
    return loss, ((log_probs.exp() - p) * w[:, None]).to(x.dtype)


@on_cuda_compiled
def _hard_ce_chunk(x: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_soft_ce_chunk with a one-hot target: the labels' ids instead of a [rows, vocab] distribution."""
    log_probs = torch.log_softmax(x.float(), dim=-1)
    loss = (-log_probs.gather(1, labels[:, None]).squeeze(1) * w).sum()
    grad = log_probs.exp_()  # in place: eager (the CPU) keeps one fp32 [rows, vocab] temporary, not four
    grad[torch.arange(len(labels), device=x.device), labels] -= 1
    return loss, grad.mul_(w[:, None]).to(x.dtype)


def _chunks(rows: int, vocab: int) -> list[tuple[int, int]]:
    """(start, end) row ranges whose fp32 [rows, vocab] temporaries stay within CHUNK_ELEMENTS."""
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    return [(s, min(s + chunk, rows)) for s in range(0, rows, chunk)]


class SoftCrossEntropy(torch.autograd.Function):
    """Per-token -Σ_v p_v · log softmax(logits)_v, weighted and summed: Σ_t weight_t · CE_t.

    The gradient w.r.t. the logits, weight_t · (softmax - p), is computed in forward (in fp32, chunked over
    tokens) and kept in the logits' dtype: 2 bytes per entry in bf16 instead of ~14, and backward is one
    multiply. The teacher's distribution is not kept."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_p: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        V = logits.shape[-1]
        flat, p, w = logits.detach().reshape(-1, V), target_p.reshape(-1, V), weight.reshape(-1).float()
        chunks = _chunks(flat.shape[0], V)
        # one chunk (up to 2,097 rows at a 32K vocab): its gradient is kept as made, not copied into a buffer
        grad = torch.empty_like(flat) if ctx.needs_input_grad[0] and len(chunks) != 1 else None
        total = flat.new_zeros((), dtype=torch.float32)
        for s, e in chunks:
            loss, g = _soft_ce_chunk(flat[s:e], p[s:e], w[s:e])
            total += loss
            if len(chunks) == 1:
                grad = g if ctx.needs_input_grad[0] else None
            elif grad is not None:
                grad[s:e] = g
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype)).view(ctx.shape), None, None


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Σ_t weight_t · (-Σ_v target_p[t, v] · log_softmax(logits[t])_v), fp32; gradient for `logits` only."""
    return SoftCrossEntropy.apply(logits, target_p, weight)


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """soft_cross_entropy(x @ weight.T, p, w) over the rows of p, keeping no [tokens, vocab] tensor: the logits
    are computed again in backward, chunk by chunk, from x (which the head's weight gradient needs anyway).
    Costs a second [tokens, H] x [H, vocab] matmul per step; saves the logits' gradient, the largest
    activation a TTT step keeps (tests/benchmarks/RESULTS.md). x: [N, H]; p, w: the first len(p) <= N rows'
    targets and weights. Returns the loss and the [N, vocab] logits (not differentiable: for argmax)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, w: torch.Tensor):
        logits = F.linear(x.detach(), weight.detach())
        total = logits.new_zeros((), dtype=torch.float32)
        for s, e in _chunks(len(p), weight.shape[0]):
            total += _soft_ce_chunk(logits[s:e], p[s:e], w[s:e])[0]
        ctx.save_for_backward(x, weight, p, w)
        ctx.mark_non_differentiable(logits)
        return total, logits

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_logits):
        x, weight, p, w = (t.detach() for t in ctx.saved_tensors)
        w = w * grad_total.float()  # the gradient is linear in the weights: scaled here, no pass over it later
        grad_x = torch.zeros_like(x)
        chunks = _chunks(len(p), weight.shape[0])
        grad_w = None
        for s, e in chunks:
            g = _soft_ce_chunk(F.linear(x[s:e], weight), p[s:e], w[s:e])[1]
            grad_x[s:e] = g @ weight
            # the head's gradient as the default path's backward makes it: one matmul (fp32 accumulation inside)
            # in the weight's dtype, summed in fp32 only over several chunks. fp32 [vocab, H] temporaries here
            # were 1.47 GiB of a llama3-8b backward's peak (tests/benchmarks/step_memory.py)
            part = g.T @ x[s:e]
            if len(chunks) == 1:
                grad_w = part
            elif grad_w is None:
                grad_w = part.float()
            else:
                grad_w.add_(part)
        if grad_w is None:  # no scored rows
            grad_w = torch.zeros_like(weight)
        return grad_x, grad_w.to(weight.dtype), None, None


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """Σ_t w_t · CE(x_t @ head.T, target_t) for a head that does not train (the target's, which a DFlash drafter's
    blocks are read by), chunked over rows: the gradient w.r.t. x, (softmax - target) · w @ head, is made in
    forward chunk by chunk and kept ([rows, H]), so no [rows, vocab] tensor outlives its chunk. Autograd's plain
    graph made the bf16 logits, their fp32 copy, the fp32 log-softmax and the fp32 gradient: with it a llama3-8b
    DFlash step at 512 blocks of 16 peaked 13 GiB above its resident 5 GiB on an H100 (the results file at
    eafca3b), with this 2.2 GiB above on an H200 (tests/benchmarks/RESULTS.md; `step_memory.py --family dflash`
    shows what is alive at the peak). Same matmuls.
    target: labels [rows] (long) or a distribution [rows, vocab]. Returns the loss and each row's argmax."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, head: torch.Tensor, target: torch.Tensor, w: torch.Tensor):
        x, head, w = x.detach(), head.detach(), w.float()
        grad = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        argmax = torch.empty(len(x), dtype=torch.long, device=x.device)
        total = x.new_zeros((), dtype=torch.float32)
        chunk_loss = _hard_ce_chunk if target.dtype == torch.long else _soft_ce_chunk
        for s, e in _chunks(len(x), head.shape[0]):
            logits = F.linear(x[s:e], head)
            argmax[s:e] = logits.argmax(-1)
            loss, g = chunk_loss(logits, target[s:e], w[s:e])
            total += loss
            if grad is not None:
                grad[s:e] = g @ head
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_argmax):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None


def frozen_head_cross_entropy(x: torch.Tensor, head: torch.Tensor, target: torch.Tensor,
                              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t weight_t · CE(x[t] @ head.T, target[t]) in fp32, argmax of each row's logits); x [N, H], head [V, H]
    (gets no gradient), target: labels [N] or a distribution [N, V]; weight [N]."""
    return _FrozenHeadCrossEntropy.apply(x, head, target, weight)


class DraftHead(nn.Linear):
    """The drafter's lm_head (an nn.Linear: same parameter, same export name) that can also score its logits
    against the teacher inside its own forward, where ZeRO-3 has gathered the weight. `recompute_logits` picks
    the memory-light loss above over keeping the logits' gradient (one matmul per step faster)."""

    recompute_logits = False

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                shift: int = 0):
        """logits; with the teacher's probs [B, T, vocab] and a mask [B, T] also the loss: Σ over masked t of
        the soft cross-entropy of position t against probs[:, t + shift] (t >= T - shift count 0): (loss, logits).
        Rows are flattened, so row r's target is probs' flat row r + shift: a view, nothing copied per step
        (near the end of a sequence that is the next sequence's row, where the mask is 0)."""
        if probs is None:
            return super().forward(x)
        B, T, H = x.shape
        V = self.weight.shape[0]
        w = mask.float()
        w[:, max(T - shift, 0):] = 0
        rows = max(B * T - shift, 0)
        p, w = probs.reshape(B * T, V)[shift:], w.reshape(B * T)[:rows]
        if self.recompute_logits and torch.is_grad_enabled():
            loss, logits = _LinearSoftCrossEntropy.apply(x.reshape(B * T, H), self.weight, p, w)
            return loss, logits.view(B, T, V)
        logits = super().forward(x)
        return soft_cross_entropy(logits.reshape(B * T, V)[:rows], p, w), logits


@on_cuda_compiled
def _swiglu_grads(grad_act: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    silu = F.silu(gate)
    return torch.ops.aten.silu_backward(grad_act * up, gate), grad_act * silu, silu * up


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) * up), keeping only gate and up: silu and the product are recomputed in backward
    (elementwise, cheap), which saves two [T, intermediate] tensors per step."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, down_weight)
        return F.linear(F.silu(gate) * up, down_weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up, w = ctx.saved_tensors
        grad_gate, grad_up, act = _swiglu_grads(grad_out @ w, gate.detach(), up.detach())
        grad_w = grad_out.flatten(0, -2).T @ act.flatten(0, -2) if ctx.needs_input_grad[2] else None
        return grad_gate, grad_up, grad_w


def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd


def _rms_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    xhat = x.float() * rstd
    grad_weight = (grad_out * xhat.to(x.dtype)).float().flatten(0, -2).sum(0).to(weight.dtype)
    g = (grad_out * weight).float()
    return (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype), grad_weight


class _RMSNorm(torch.autograd.Function):
    """LlamaRMSNorm's value (fp32 statistics, weight applied in the input dtype), keeping the input and one
    fp32 scalar per token instead of an fp32 copy of the input and the normalised tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _rms_forward(x.detach(), weight.detach(), eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = (t.detach() for t in ctx.saved_tensors)
        # the input layernorm's gradient is a strided slice of the concatenation's: strides are guarded too
        grad_x, grad_weight = _rms_backward(grad_out.contiguous(), x, weight, rstd)
        return grad_x, grad_weight if ctx.needs_input_grad[1] else None, None


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (same parameter, same value) with _RMSNorm when training on the CPU; torch's
    fused RMSNorm on CUDA."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # torch's fused kernel, one launch each way, keeping what _RMSNorm keeps (the input, fp32 rstd). _RMSNorm
            # cost ~300 us of host time per call on the H200 (an autograd.Function around a compiled function),
            # 28 calls a step while the GPU waited. It rounds once, (x * rstd * weight) in fp32, as SGLang's
            # RMSNorm kernel does; LlamaRMSNorm (and _RMSNorm) round x * rstd first: < 1 bf16 ulp apart.
            return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], self.weight, self.variance_epsilon)[0]
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNorm.apply(x, self.weight, self.variance_epsilon)
        return _rms_forward(x, self.weight.detach(), self.variance_epsilon)[0]


class SwiGLUMLP(nn.Module):
    """transformers' LlamaMLP (same parameter names, same math) with _SwiGLUDown when training."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled():
            return _SwiGLUDown.apply(gate, up, self.down_proj.weight)
        return self.down_proj(F.silu(gate) * up)
