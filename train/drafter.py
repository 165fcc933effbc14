"""The EAGLE-3 drafter, computed as SGLang's `LlamaForCausalLMEagle3` computes it and named the way its
loader reads, so an export is a copy of the state dict:

    embed_tokens.weight (the target's, frozen)   fc.weight [H, 3·H_target]
    midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]   midlayer.self_attn.o_proj.weight
    midlayer.mlp.{gate,up,down}_proj.weight   norm.weight   lm_head.weight [draft_vocab, H]   d2t, t2d (buffers)

One step at positions p: h = fc(aux) on the first step (the target's aux states), else the previous step's
output; x = [input_layernorm(embed(tokens)), hidden_norm(h)] (2H) → attention (RoPE at p) → + h →
post_attention_layernorm → SwiGLU MLP → + residual = the step's output hidden (pre-norm; SGLang feeds this
to the next draft step) → norm → lm_head over the draft vocabulary.

EAGLE-3.1 options (config keys SGLang reads for both classes): `fc_norm` normalises each of the three aux states
(fc_norm.{0,1,2}.weight) before fc; `norm_output` feeds the next draft step the post-norm hidden state.

The attention is the architecture's (train/drafters/: `llama`, or `mla`, DeepSeek-style latent attention
exported as SGLang's `Eagle3DeepseekV2ForCausalLM`); everything else is the same layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from data.config import DrafterConfig
from data.target import TargetInfo

from .drafters import DRAFTERS, arch_named, arch_of
from .fused import DraftHead, RMSNorm, SwiGLUMLP
from .ttt import ttt_attention

# EAGLE-3.1 options SGLang 0.5.14 reads from a drafter's config for both classes (data.config.DrafterConfig)
EAGLE31_OPTIONS = ("fc_norm", "norm_output")


def eagle31_options(config: LlamaConfig) -> dict[str, bool]:
    """The options as SGLang reads them: `fc_norm`, or its legacy name `use_aux_norm`; `norm_output`."""
    return {"fc_norm": bool(getattr(config, "fc_norm", None) or getattr(config, "use_aux_norm", False)),
            "norm_output": bool(getattr(config, "norm_output", False))}


def drafter_config(target: TargetInfo, shape: DrafterConfig, draft_vocab_size: int,
                   aux_layer_ids: list[int]) -> LlamaConfig:
    """The drafter's LlamaConfig: unset shape fields and the RoPE settings (default, llama3, yarn, ...)
    come from the target's config; the EAGLE-3 fields SGLang reads ride along as extra attributes."""
    t = target.text_config
    hidden = shape.hidden_size or target.hidden_size
    heads = shape.num_attention_heads or int(t["num_attention_heads"])
    kv_heads = shape.num_key_value_heads or int(t.get("num_key_value_heads") or heads)
    # An MLA target's head_dim describes its latent attention, not a Llama layer: derive ours instead.
    target_head_dim = t.get("head_dim") if "kv_lora_rank" not in t and hidden == target.hidden_size else None
    head_dim = shape.head_dim or target_head_dim or hidden // heads
    if heads % kv_heads:
        raise ValueError(f"drafter: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    rope = {"rope_parameters": t["rope_parameters"]} if t.get("rope_parameters") else \
        {"rope_theta": t.get("rope_theta", 10000.0), "rope_scaling": t.get("rope_scaling")}
    arch = arch_named(shape.arch)
    foreign = [k for other in DRAFTERS.values() for k in other.shape_fields
               if k not in arch.shape_fields and getattr(shape, k)]
    if foreign:
        raise ValueError(f"drafter: {', '.join(foreign)} set, but arch is {arch.name}")
    attention = {"num_key_value_heads": kv_heads, "head_dim": head_dim} | arch.config_fields(t, shape, hidden, heads)
    return LlamaConfig(
        architectures=[arch.sglang_class], hidden_size=hidden, num_attention_heads=heads, **attention,
        intermediate_size=shape.intermediate_size or int(t.get("intermediate_size") or 4 * hidden),
        rms_norm_eps=shape.rms_norm_eps or float(t.get("rms_norm_eps", 1e-6)), hidden_act="silu",
        num_hidden_layers=1, vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        draft_vocab_size=draft_vocab_size, target_hidden_size=target.hidden_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
        **{k: True for k in EAGLE31_OPTIONS if getattr(shape, k)},  # written only when on: SGLang's keys
        # SGLang resolves the drafter's dtype from its own config, the target's from the target's: declaring the
        # same one keeps them equal (else the draft layer gets mixed-dtype inputs and graph capture fails)
        dtype=target.dtype, **rope)


class KVCache:
    """The drafter's keys/values for decoding ([1, kv_heads, L, head_dim]); `crop` drops rejected drafts."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


@dataclass
class StepOutput:
    hidden: torch.Tensor   # [B, T, H] the next step's hidden input: the pre-norm output (post-norm: norm_output)
    logits: torch.Tensor   # [B, T, draft_vocab]
    key: torch.Tensor      # [B, kv_heads, T, head_dim] this step's keys and values, which later steps attend to
    value: torch.Tensor
    loss: torch.Tensor | None = None  # with a teacher target: the summed masked soft cross-entropy (DraftHead)


def attend(q, k, v, past: list[tuple[torch.Tensor, torch.Tensor]], cache: "KVCache | None", scale: float,
           backend: str) -> torch.Tensor:
    """q [B, Hq, T, D]; k/v this step's [B, Hkv, T, D(v)]. Training: the TTT rule over the unroll's steps;
    decoding (`cache`): plain causal attention over the cache (drafts are cache entries too)."""
    if cache is None:
        return ttt_attention(q, [*(p[0] for p in past), k], [*(p[1] for p in past), v], scale, backend)
    keys, values = cache.append(k, v)
    L, T = keys.shape[2], q.shape[2]
    mask = torch.arange(L, device=q.device)[None] <= torch.arange(L - T, L, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=keys.shape[1] != q.shape[1])


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = arch_of(config).attention(config)
        self.attention_backend = "blockwise"
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, embeds, hidden, cos, sin, *past_flat, cache: "KVCache | None" = None):
        past = list(zip(past_flat[0::2], past_flat[1::2]))
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.self_attn.qkv(x, cos, sin)
        out = attend(q, k, v, past, cache, self.self_attn.scale, self.attention_backend)
        h = hidden + self.self_attn.o_proj(out.transpose(1, 2).flatten(2))
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class Eagle3Drafter(nn.Module):
    def __init__(self, config: LlamaConfig, d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__()
        self.config = config
        if len(d2t) != config.draft_vocab_size or len(t2d) != config.vocab_size:
            raise ValueError(f"draft vocab: d2t has {len(d2t)} entries, t2d {len(t2d)}; the config says "
                             f"{config.draft_vocab_size} and {config.vocab_size}")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, loaded by the trainer
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        options = eagle31_options(config)
        # EAGLE-3.1: each aux state normalised before fc (its own RMSNorm, the target's width, the drafter's eps)
        self.fc_norm = nn.ModuleList([RMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
                                      for _ in range(3)]) if options["fc_norm"] else None
        self.norm_output = options["norm_output"]
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = DraftHead(config.hidden_size, config.draft_vocab_size, bias=False)
        # built for the dims the architecture rotates (MLA: only qk_rope_head_dim of each head)
        rotary_dim = arch_of(config).rotary_dim(config)
        self.rotary_emb = LlamaRotaryEmbedding(config if rotary_dim == config.head_dim else
                                               LlamaConfig(**(config.to_dict() | {"head_dim": rotary_dim})))
        # DeepSpeed's bf16 cast also casts float buffers; RoPE frequencies must stay fp32 (SGLang keeps them
        # so), else angles drift by radians at positions in the thousands. Kept here, out of the cast's reach.
        self._inv_freq32 = self.rotary_emb.inv_freq.detach().clone().float()
        self.register_buffer("d2t", d2t.to(torch.int64))
        self.register_buffer("t2d", t2d.to(torch.bool))
        self.activation_checkpointing = False

    def set_attention(self, backend: str) -> None:
        self.midlayer.attention_backend = backend

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                past: list[tuple[torch.Tensor, torch.Tensor]] = (), cache: "KVCache | None" = None,
                target: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepOutput:
        """One draft step over a whole sequence. `hidden` is the target's aux states [B, T, 3·H_target] on
        the first step (projected by fc, as in SGLang) and the previous step's output after that; `past`
        holds the keys/values of the earlier steps of this unroll. With `cache` (decoding) the new positions
        attend causally to everything cached instead. With `target` (the teacher's probs [B, T, draft_vocab],
        a mask [B, T], a shift) the head also scores position t against probs[:, t + shift] (`loss`). `rope`:
        `self.rope(position_ids, dtype)` when the caller has it already (the unroll computes it once for all steps)."""
        embeds = self.embed_tokens(input_ids)
        if hidden.shape[-1] != embeds.shape[-1]:
            if self.fc_norm is not None:
                hidden = torch.cat([norm(a) for norm, a in zip(self.fc_norm, hidden.chunk(3, dim=-1))], dim=-1)
            hidden = self.fc(hidden)
        cos, sin = rope or self.rope(position_ids, hidden.dtype)
        flat = [t for kv in past for t in kv]
        if self.activation_checkpointing and torch.is_grad_enabled():
            h, k, v = checkpoint(self.midlayer, embeds, hidden, cos, sin, *flat, use_reentrant=False)
        else:
            h, k, v = self.midlayer(embeds, hidden, cos, sin, *flat, cache=cache)
        normed = self.norm(h)
        carried = normed if self.norm_output else h  # what the next draft step reads (SGLang: its aux output)
        if target is None:
            return StepOutput(carried, self.lm_head(normed), k, v)
        probs, mask, shift = target
        loss, logits = self.lm_head(normed, probs, mask, shift)
        return StepOutput(carried, logits, k, v, loss)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin [B, T, rotary dims] at the positions (angles in fp32), in `dtype`."""
        if self.rotary_emb.inv_freq.dtype != torch.float32:
            self.rotary_emb.inv_freq = self._inv_freq32.to(position_ids.device)
        return self.rotary_emb(position_ids.new_empty((), dtype=dtype), position_ids)  # reads x's device, dtype

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
