"""Training-time test (TTT): the drafter unrolled over k steps, its attention rule, and its loss.

Step j (0-based) at position t feeds token x[t+j+1] and, for j > 0, the drafter's own output of step j-1 at
t, at RoPE position t+j; it predicts x[t+j+2] against the teacher's distribution at position t+j+1. So
each position t plays one whole k-step chain draft, as SGLang runs it after the target verified x[..t+1].

Attention (the EAGLE-3 rule): a query of step j at t sees the first step's keys causally (positions <= t,
conditioned on the target's states) plus the keys of steps 1..j at the same position t only. It is computed in
two parts: plain causal attention over the first step's keys, returning its log-sum-exp, and the j diagonal
scores q_t · k_i[t], merged by their softmax weights. Nothing is spent on masked-out blocks and no step's keys
are copied. The causal part is `flex` (one fused kernel, CUDA) or `blockwise` (exact, one query block at a
time, recomputed in backward; any device); both keep memory linear in T.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .fused import on_cuda_compiled

BLOCK_ELEMENTS = 1 << 25  # score elements per query block (x4 bytes in fp32): bounds blockwise's peak memory


_FLEX_FAILED: list[str] = []


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                  backend: str) -> torch.Tensor:
    """q [B, Hq, T, D]; keys/values: one [B, Hkv, T, D] per step so far, keys[0] the first (causal) step."""
    out, lse = causal_attention(q, keys[0], values[0], scale, backend)
    if len(keys) == 1:
        return out
    # stacked, not a list: dynamo guards a list's length, and each of the unroll's steps would compile its own
    # forward and backward graph (an Inductor compile of seconds each). The copies autograd keeps, 21 keys and
    # values per batch at TTT 7, are small beside the logits' gradients (one draft-vocab row per token and step).
    return _merge_diagonal(out, lse, q, torch.stack(keys[1:]), torch.stack(values[1:]), scale)


@on_cuda_compiled
def _merge_diagonal(out, lse, q, keys, values, scale: float) -> torch.Tensor:
    """The causal part's output and log-sum-exp merged with the scores of the same position's later keys:
    keys/values [j, B, Hkv, T, D] (j later steps)."""
    B, H, T, D = q.shape
    groups = keys.shape[2]  # grouped-query attention: each kv head serves H // groups query heads
    qg = q.view(1, B, groups, H // groups, T, D)
    diagonal = (qg * keys[:, :, :, None]).sum(-1).float().view(-1, B, H, T) * scale           # [j, B, H, T]
    weights = torch.softmax(torch.cat([lse[None], diagonal]), dim=0).to(out.dtype)             # [1 + j, B, H, T]
    mixed = (weights[1:].view(-1, B, groups, H // groups, T, 1) * values[:, :, :, None]).sum(0)
    return out * weights[0, ..., None] + mixed.view(B, H, T, values.shape[-1])


def causal_attention(q, k, v, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and its log-sum-exp [B, Hq, T] (fp32, natural log)."""
    if backend == "flex" and not _FLEX_FAILED:
        try:
            return flex_causal_attention(q, k, v, scale)
        except Exception as e:  # e.g. Inductor has no kernel for a tiny head_dim: same math, blockwise
            _FLEX_FAILED.append(f"{type(e).__name__}: {str(e)[:200]}")
            warnings.warn(f"flex attention unavailable for this drafter ({_FLEX_FAILED[0]}); using blockwise")
    return blockwise_causal_attention(q, k, v, scale)


def _attend_block(q, k, v, start: int, scale: float):
    scores = (q @ k.transpose(-1, -2)).float() * scale                       # [B, H, blk, end]
    rows = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
    cols = torch.arange(k.shape[2], device=q.device)[None, :]
    scores = scores.masked_fill(cols > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]).to(q.dtype) @ v), lse


def blockwise_causal_attention(q, k, v, scale, block: int | None = None):
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    block = block or max(16, BLOCK_ELEMENTS // max(B * H * T, 1))
    recompute = torch.is_grad_enabled() and T > block
    outs, lses = [], []
    for start in range(0, T, block):
        end = min(start + block, T)
        args = (q[:, :, start:end], k[:, :, :end], v[:, :, :end])
        fn = functools.partial(_attend_block, start=start, scale=scale)
        out, lse = checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


@functools.lru_cache(maxsize=64)
def _causal_block_mask(T: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, T, T, device=device,
                             _compile=True)


@functools.cache
def _compiled_flex(backend: str = "inductor"):
    from torch.nn.attention.flex_attention import flex_attention
    # room for every length bucket a run meets: past the limit torch.compile falls back to the unfused
    # flex path, which materialises the T x T scores
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    # static lengths (bucketed by flex_length, each with its block mask); the batch size is marked dynamic
    # per call in bucketed_flex_attention
    return torch.compile(flex_attention, dynamic=False, backend=backend)


def bucketed_flex_attention(q, k, v, block_mask, **kwargs):
    """flex_attention through the compiled kernel of the inputs' lengths (already padded to their flex_length
    buckets), whatever the batch size, grouped-query when k has fewer heads than q: TTT's causal attention and
    DFlash's block mask both call it."""
    # Token-budget batches hold max_batch_tokens // T sequences: every length bucket meets dozens of batch
    # sizes. Specialised on each, flex compiled a forward and backward kernel for every new (batch size,
    # bucket) (the mission run on the H200: 40 steps in 7.6 min). One kernel per bucket:
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1], **kwargs)


def flex_length(T: int) -> int:
    """The length flex runs at: T rounded up to a power of two up to 1024, then to a multiple of 1024. The
    kernel is compiled per length (seconds each) and batches come in every length; causal masking makes the
    zero padding at the end invisible to the real queries."""
    return max(128, 1 << (T - 1).bit_length()) if T <= 1024 else -(-T // 1024) * 1024


def flex_causal_attention(q, k, v, scale):
    T = q.shape[2]
    L = flex_length(T)
    # Padded or not, the kernel sees contiguous [B, H, L, D] tensors: a length already at its bucket used to pass
    # its (transposed) views straight through, and the stride guards compiled it again (found on the H200 by
    # tests/gpu/test_flex_ttt.py; recompiles counted on the CPU with flex's eager backend)
    q, k, v = (F.pad(t, (0, 0, 0, L - T)) if L != T else t.contiguous() for t in (q, k, v))
    out, lse = bucketed_flex_attention(q, k, v, _causal_block_mask(L, str(q.device)), scale=scale, return_lse=True)
    # Contiguous whether cut back to T or not: a view with the padded length's strides made the merge (compiled
    # for dynamic shapes, guarded on strides) compile again for every length exactly at its bucket
    # (tests/gpu/test_flex_ttt.py on the H100: 2 graphs more at T = 2048)
    return out[:, :, :T].contiguous(), lse[:, :, :T].float().contiguous()


def _shifts(x: torch.Tensor, upto: int, fill=0) -> list[torch.Tensor]:
    """[x shifted by n for n in 0..upto]: x[:, t + n] at t, `fill` past the end. Views of one padded copy: the
    unroll's shifts cost no kernel launches per step (the host, not the GPU, paced a 2k-token step)."""
    B, T = x.shape[:2]
    padded = torch.cat([x, x.new_full((B, upto, *x.shape[2:]), fill)], dim=1)
    return [padded[:, n:n + T] for n in range(upto + 1)]


def _shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at t, `fill` past the end."""
    return _shifts(x, n, fill)[n]


@dataclass
class TTTResult:
    loss: torch.Tensor           # Σ_j decay^j · loss_j, differentiable
    step_loss: torch.Tensor      # [k] soft cross-entropy per step (detached)
    correct: torch.Tensor        # [k] positions where the draft argmax (mapped via d2t) == the target's argmax
    counted: torch.Tensor        # [k] positions scored per step (target argmax outside the draft vocab included:
                                 #     the draft is rejected there, as in serving)
    alive: torch.Tensor          # [k] chains whose drafts 0..j were all accepted (a chain starts at every
                                 #     position scored at step 0)
    chains: torch.Tensor         # number of chains
    depth: torch.Tensor          # [B, T] drafts accepted in a row by the chain at each position (offline decoding walks)

    @property
    def accepted(self) -> torch.Tensor:
        return self.alive.sum()


def ttt_unroll(model, input_ids: torch.Tensor, aux_hidden: torch.Tensor, loss_mask: torch.Tensor,
               lengths: torch.Tensor, teacher, steps: int, decay: float) -> TTTResult:
    """Run the k-step unroll on a right-padded batch. `model` is the drafter (or its DeepSpeed engine);
    `teacher` the target's distribution over the draft vocab at every position (see teacher.py)."""
    B, T = input_ids.shape
    device = input_ids.device
    positions = torch.arange(T, device=device)[None].expand(B, T)
    valid = positions < lengths[:, None]
    loss_mask = loss_mask.bool() & valid
    drafter = model.module if hasattr(model, "module") else model  # unwrap a DeepSpeed engine
    hidden, past = aux_hidden, []
    total = aux_hidden.new_zeros((), dtype=torch.float32)
    step_loss, correct, counted, alive = [], [], [], []
    chain = first = None
    depth = torch.zeros(B, T, dtype=torch.int8, device=device)
    scored_at, in_vocab_at = _shifts(loss_mask, steps + 1, False), _shifts(teacher.in_vocab, steps, False)
    ids_at, target_ids_at = _shifts(input_ids, steps), _shifts(teacher.target_ids, steps)
    # RoPE at every position an unroll step uses, once; step j reads positions t + j
    cos, sin = drafter.rope(torch.arange(T + steps, device=device)[None], drafter.fc.weight.dtype)
    for j in range(steps):
        # Step j at t predicts x[t+j+2]: scored where that token carries loss; trained only where the target's
        # own choice at t+j+1 is in the draft vocab (EAGLE-3 masks the rest: no draft could match it).
        scored = scored_at[j + 2]
        mask = scored & in_vocab_at[j + 1]
        n = mask.sum()
        # the loss against the teacher's distribution at t+j+1 is computed in the drafter's head (see DraftHead)
        out = model(ids_at[j + 1], hidden, positions + j, past, target=(teacher.probs, mask, j + 1),
                    rope=(cos[:, j:j + T], sin[:, j:j + T]))
        hidden, past = out.hidden, past + [(out.key, out.value)]
        loss_j = out.loss / n.clamp(min=1)
        total = total + decay ** j * loss_j
        with torch.no_grad():
            draft = out.logits.argmax(-1)
            hit = (drafter.to_target_ids(draft) == target_ids_at[j + 1]) & scored
            first = scored if first is None else first
            chain = hit if chain is None else chain & hit
            depth += chain
            step_loss.append(loss_j.detach())
            correct.append(hit.sum())
            counted.append(scored.sum())
            alive.append(chain.sum())
    return TTTResult(total, torch.stack(step_loss), torch.stack(correct), torch.stack(counted),
                     torch.stack(alive), first.sum(), depth)


def accept_length(accepted: float, chains: float) -> float:
    """Simulated accept length (SGLang's spec_accept_length: tokens emitted per target verify step) for
    chain drafting with k steps: 1 (the target's own token) + mean over positions of the drafts accepted
    in a row, each draft scored against the target's argmax under teacher forcing."""
    return 1.0 + accepted / max(chains, 1.0)
