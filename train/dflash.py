"""The DFlash block drafter, computed as SGLang's `DFlashDraftModel` computes it and named the way its loader reads,
so an export is a copy of the state dict:

    fc.weight [H, K·H]   hidden_norm.weight   norm.weight
    layers.{i}.{input_layernorm, post_attention_layernorm}.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight   layers.{i}.self_attn.{q,k}_norm.weight [head_dim]
    layers.{i}.mlp.{gate,up,down}_proj.weight

It has no embedding and no head: a block's tokens are embedded by the target's embedding and its drafts read by
the target's head, so its hidden size is the target's. One forward drafts a whole block: the block's first
token is the last one the target emitted, the others are the mask token, at consecutive positions. The context
is the target's K aux states (ids: output of decoder layer i; SGLang captures them at layer i + 1's input on
every architecture) of the positions before the block, projected once (fc, then hidden_norm) and, in each layer,
turned into keys and values only (k_proj → k_norm → RoPE, v_proj): the context never passes through the layers.
Each layer (Qwen3-style: RMSNorm on each head's queries and keys) lets the block attend, without a causal mask,
to its context and to itself; the final norm gives the hidden states the target's head reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from . import ttt
from .fused import RMSNorm, SwiGLUMLP, frozen_head_cross_entropy
from .teacher import Teacher

SGLANG_CLASS = "DFlashDraftModel"


class DFlashAttention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, H] → keys (normed per head, rotated) and values [B, kv_heads, T, head_dim]: what SGLang writes to
        the draft KV cache for context tokens (kv_proj_only, apply_k_norm, apply_k_rope)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context: tuple[torch.Tensor, torch.Tensor],
                visible: torch.Tensor | SparseVisibility | None) -> torch.Tensor:
        """x [B, Tb, H] the block's (normed) hidden; `context` its keys/values [B, kv_heads, Tc, d]; `visible`
        [B, Tb, Tc + Tb] which context and block positions each block position attends to (None: all), or the
        same as a SparseVisibility (flex attention)."""
        B, T, _ = x.shape
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(B, T, self.heads, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        if isinstance(visible, SparseVisibility):
            out = visible.attend(q, context, (k, v))
        else:
            k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if visible is None else visible[:, None],
                                                 enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, rope, context, visible) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, context, visible)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        features = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._inv_freq32 = self.rotary_emb.inv_freq.detach().clone().float()  # kept out of a bf16 cast's reach

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_emb.inv_freq.dtype != torch.float32:
            self.rotary_emb.inv_freq = self._inv_freq32.to(positions.device)
        return self.rotary_emb(positions.new_empty((), dtype=dtype), positions)

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, context_features: torch.Tensor,
                context_positions: torch.Tensor, visible: torch.Tensor | SparseVisibility | None = None
                ) -> torch.Tensor:
        """The block's final hidden states [B, Tb, H] (the target's head turns them into drafts).
        block_embeds [B, Tb, H]: the target's embedding of the block's tokens (the last emitted one, then mask
        tokens); context_features [B, Tc, K·H]: the target's aux states at `context_positions`; `visible`:
        see DFlashAttention (None: every block position sees the whole context and the whole block)."""
        context = self.hidden_norm(self.fc(context_features))
        context_rope = self.rope(context_positions, context.dtype)
        rope = self.rope(block_positions, block_embeds.dtype)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, rope, layer.self_attn.keys_values(context, *context_rope), visible)
        return self.norm(h)


def dflash_config(target, num_layers: int, layer_ids: list[int], block_size: int, mask_token_id: int,
                  num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                  head_dim: int | None = None, intermediate_size: int | None = None,
                  rms_norm_eps: float | None = None) -> PretrainedConfig:
    """The drafter's config (a TargetInfo gives the target's): hidden size, RoPE and, unless set, the attention and
    MLP shape are the target's; `dflash_config` holds what SGLang's DFlash reads (target_layer_ids, block_size,
    mask_token_id) and `num_target_layers` the target's depth."""
    from transformers import LlamaConfig
    t = target.text_config
    heads = num_attention_heads or int(t["num_attention_heads"])
    rope = {"rope_parameters": t["rope_parameters"]} if t.get("rope_parameters") else \
        {"rope_theta": t.get("rope_theta", 10000.0), "rope_scaling": t.get("rope_scaling")}
    # an MLA target's head_dim describes its latent attention, not this layer's
    target_head_dim = t.get("head_dim") if "kv_lora_rank" not in t else None
    return LlamaConfig(
        architectures=[SGLANG_CLASS], hidden_size=target.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=num_key_value_heads or int(t.get("num_key_value_heads") or heads),
        head_dim=head_dim or target_head_dim or target.hidden_size // heads,
        intermediate_size=intermediate_size or int(t.get("intermediate_size") or 4 * target.hidden_size),
        rms_norm_eps=rms_norm_eps or float(t.get("rms_norm_eps", 1e-6)), hidden_act="silu", attention_bias=False,
        vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings,
        tie_word_embeddings=False, num_target_layers=target.num_layers, dtype=target.dtype,
        dflash_config={"target_layer_ids": list(layer_ids), "block_size": block_size, "mask_token_id": mask_token_id},
        **rope)


# --- Training objective -------------------------------------------------------------------------------------
# The recipe (SpecForge 0.2.0's OnlineDFlashModel and the DFlash paper, read for this): blocks anchored at
# sampled positions of each sample's loss span, all of a sample's blocks in one forward (each sees its own block
# and the context strictly before its anchor, as in serving: the anchor's own target state does not exist yet),
# block position k >= 1 labelled with the sample's token at anchor + k (self-generated data: the target's own
# tokens), weighted by that token's loss mask and by exp(-(k - 1) / gamma) when gamma is set (later positions
# are accepted only after the earlier ones). Choices: hard labels (the target's tokens), not the teacher's
# distribution over the full vocabulary by default (train.dflash.labels: teacher for soft labels: on self-distilled
# greedy data the tokens are the teacher's argmax, the distribution adds how sure it was, at one full-vocabulary
# softmax per drafted position); anchors where the anchor and the next token both carry loss (what a block starts
# from in serving: a token the target emitted).


@dataclass
class BlockResult:
    loss: torch.Tensor               # weighted mean cross-entropy over the drafted positions
    correct: torch.Tensor            # [block_size] drafts equal to the label, per block position (0: the anchor)
    counted: torch.Tensor            # [block_size] labelled positions
    accepted: torch.Tensor           # drafts accepted in a row from position 1, summed over blocks
    blocks: torch.Tensor             # blocks drafted

    @property
    def accept_length(self) -> float:
        """Tokens per verify step a chain of these blocks would emit: 1 + drafts accepted in a row (greedy)."""
        return 1.0 + float(self.accepted) / max(float(self.blocks), 1.0)


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, per_sample: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N] anchor positions (sorted) and which of them are real: up to `per_sample` positions a < length - 1
    where tokens a and a + 1 carry loss, drawn without replacement."""
    B, T = loss_mask.shape
    valid = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
    valid[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    valid &= torch.arange(T, device=loss_mask.device)[None] < (lengths[:, None] - 1)
    width = max(1, min(per_sample, int(valid.sum(1).max())))
    noise = torch.rand(B, T, generator=generator, device="cpu").to(loss_mask.device).masked_fill(~valid, 2.0)
    chosen = noise.topk(width, dim=1, largest=False)
    keep = chosen.values < 2.0
    anchors = torch.where(keep, chosen.indices, T)  # T sorts last
    anchors, order = anchors.sort(dim=1)
    keep = keep.gather(1, order)
    return torch.where(keep, anchors, 0), keep


def block_visibility(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[B, N·bs, T + N·bs]: block n's positions see context positions < its anchor and their own block (a padding
    block, keep False, only its own: it is never scored)."""
    B, N = anchors.shape
    q_block = torch.arange(N * block_size, device=anchors.device) // block_size            # [Q]
    kv = torch.arange(context_len + N * block_size, device=anchors.device)                 # [KV]
    anchor_of_q = anchors.repeat_interleave(block_size, dim=1)                             # [B, Q]
    context = (kv[None, None] < context_len) & (kv[None, None] < anchor_of_q[..., None])
    own_block = (kv[None, None] >= context_len) & ((kv - context_len) // block_size == q_block[:, None])[None]
    # a padding block (keep False) sees only itself: no row is fully masked (NaN on some attention kernels)
    return (context & keep.repeat_interleave(block_size, dim=1)[..., None]) | own_block


class SparseVisibility:
    """block_visibility's mask as a flex-attention BlockMask, over the keys laid out [the blocks' own | context]
    (each part padded to ttt.flex_length, so one kernel serves every length of a bucket): the kernel skips every
    128 x 128 tile no query of it sees. A block sees its own bs keys and the context before its anchor (anchors
    sorted: a triangle), so most tiles of the dense [N·bs, T + N·bs] rectangle are skipped: at T = 2k with 512
    blocks of 16, all of the block part's but its diagonal (1 in 64) and about half of the context's.
    The default on CUDA (train.attention: auto): there its loss and gradients equal the dense mask's
    (tests/gpu/test_dflash_loss.py) and bench_train.py's eyrie-dflash-flex times it; on the CPU, where flex has
    no backward, its forward equals the dense mask's (tests/train/test_dflash.py)."""

    def __init__(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int):
        from torch.nn.attention.flex_attention import create_block_mask
        B, N = anchors.shape
        self.queries, self.q_len, self.context_len = N * block_size, ttt.flex_length(N * block_size), \
            ttt.flex_length(context_len)
        more = -(-self.q_len // block_size) - N  # the padded query rows' blocks: only their own keys
        block_anchor, block_kept = anchors.new_zeros(B, N + more), keep.new_zeros(B, N + more)
        block_anchor[:, :N], block_kept[:, :N] = anchors, keep
        q_len = self.q_len

        def sees(b, h, q, kv):
            n = q // block_size
            own = (kv < q_len) & (kv // block_size == n)
            return own | ((kv >= q_len) & (kv - q_len < block_anchor[b, n]) & block_kept[b, n])
        self.mask = create_block_mask(sees, B, None, q_len, q_len + self.context_len, device=anchors.device,
                                      _compile=anchors.is_cuda)

    def attend(self, q: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
               block: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [B, heads, N·bs, d]; context and block keys/values [B, kv_heads, Tc | N·bs, d]
        → [B, heads, N·bs, d]."""
        def padded(t: torch.Tensor, length: int) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, length - t.shape[2]))
        q = padded(q, self.q_len)
        k, v = (torch.cat([padded(b, self.q_len), padded(c, self.context_len)], dim=2) for b, c in zip(block, context))
        out = ttt.bucketed_flex_attention(q, k, v, self.mask)
        return out[:, :, :self.queries]


def dflash_objective(drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor, input_ids: torch.Tensor,
                     aux_hidden: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, blocks_per_sample: int,
                     gamma: float | None = None, generator: torch.Generator | None = None,
                     teacher: Teacher | None = None, final_hidden: torch.Tensor | None = None,
                     attention: str = "dense") -> BlockResult:
    """One right-padded batch: every sample's sampled blocks drafted in one forward, scored against its tokens
    (or, with `teacher`, against the target's distribution for each of them: `teacher` over the full vocabulary
    and `final_hidden` [B, T, H] the shards' final states, position p's giving the token at p + 1).
    `drafter`: the model or its DeepSpeed engine (whose forward gathers ZeRO-3 partitions); embed [V, H] and
    lm_head [V, H] are the target's (frozen); aux_hidden [B, T, K·H] the shards' aux states. `attention`: dense
    (block_visibility's mask through SDPA, any device) or flex (SparseVisibility: CUDA's block-sparse kernel,
    the same loss and gradients in fewer tiles)."""
    cfg = getattr(drafter, "module", drafter).config  # the drafter or its DeepSpeed engine
    bs, mask_id = cfg.dflash_config["block_size"], cfg.dflash_config["mask_token_id"]
    B, T = input_ids.shape
    device = input_ids.device
    anchors, keep = sample_anchors(loss_mask, lengths, blocks_per_sample, generator)
    N = anchors.shape[1]
    offsets = torch.arange(bs, device=device)
    positions = (anchors[..., None] + offsets).reshape(B, N * bs)                  # [B, N·bs]
    tokens = torch.full((B, N, bs), mask_id, dtype=torch.long, device=device)
    tokens[..., 0] = input_ids.gather(1, anchors)                                  # the anchor token, then masks
    visible = SparseVisibility(anchors, keep, T, bs) if attention == "flex" else block_visibility(anchors, keep, T, bs)
    hidden = drafter(F.embedding(tokens.reshape(B, N * bs), embed).to(aux_hidden.dtype), positions, aux_hidden,
                     torch.arange(T, device=device)[None].expand(B, T), visible)
    at = positions.clamp(max=T - 1)
    labels = input_ids.gather(1, at).view(B, N, bs)
    weight = (keep[..., None] & (offsets > 0) & (positions.view(B, N, bs) < lengths[:, None, None])).float() \
        * loss_mask.gather(1, at).view(B, N, bs).float()
    if gamma:
        weight = weight * torch.exp(-(offsets - 1).clamp(min=0).float() / gamma)
    if teacher is None:
        target = labels.flatten()
    else:  # block position k's token follows position anchor + k - 1, whose final state the teacher reads
        before = (positions - 1).clamp(min=0, max=T - 1)
        states = final_hidden.gather(1, before[..., None].expand(-1, -1, final_hidden.shape[-1]))
        target = teacher(states).probs.flatten(0, 1)
    # the head is the target's and frozen: the loss is chunked and no [blocks x bs, vocab] logits are kept
    loss, argmax = frozen_head_cross_entropy(hidden.flatten(0, 1), lm_head.to(hidden.dtype), target,
                                             (weight / weight.sum().clamp(min=1e-6)).flatten())
    with torch.no_grad():
        scored = weight > 0
        hit = (argmax.view(B, N, bs) == labels) & scored
        run = (hit | ~scored)[..., 1:].long().cumprod(-1) * scored[..., 1:]         # accepted in a row
        return BlockResult(loss, hit.sum((0, 1)), scored.sum((0, 1)), run.sum(), keep.sum())
