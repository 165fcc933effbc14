"""The MLA drafter's attention: DeepSeek-style multi-head latent attention over EAGLE-3's 2H-wide input,
computed as SGLang's `Eagle3DeepseekV2ForCausalLM` (sglang/srt/models/kimi_k25_eagle3.py) computes it:

    q = q_b_proj(q_a_layernorm(q_a_proj(x)))                 [heads, qk_nope + qk_rope]
    [latent, k_rope] = kv_a_proj_with_mqa(x)                  kv_lora_rank + qk_rope (one RoPE key for all heads)
    [k_nope, v] = kv_b_proj(kv_a_layernorm(latent))           [heads, qk_nope + v_head]
RoPE on the rope parts only, interleaved pairs (SGLang's `is_neox_style = not rope_interleave`, default true);
softmax scale (qk_nope + qk_rope)^-0.5, times mscale² under YaRN with `mscale_all_dim` (as DeepSeek-V3).
Served, the cache holds the latent and the RoPE key (kv_lora_rank + qk_rope values per token, for all heads
together) instead of 2 x kv_heads x head_dim: the reason to choose it for an MLA target.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .base import DrafterArch

FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def config_fields(target_text_config: dict, shape, hidden: int, heads: int) -> dict:
    """The five MLA dims (set in the config, else the target's when it is an MLA target, else derived from the
    shape), interleaved RoPE, and the per-head widths a Llama config would otherwise derive."""
    dims = mla_fields(target_text_config, shape, hidden, heads)
    return dims | {"rope_interleave": True, "num_key_value_heads": heads,
                   "head_dim": dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]}


def mla_fields(target_text_config: dict, shape, hidden: int, heads: int) -> dict:
    """The five MLA dims: set in the config, else the target's (an MLA target), else derived from the shape."""
    t = target_text_config if "kv_lora_rank" in target_text_config else {}
    derived = {"q_lora_rank": max(8, hidden // 2), "kv_lora_rank": max(8, hidden // 4),
               "qk_nope_head_dim": max(2, hidden // heads), "qk_rope_head_dim": max(2, hidden // heads // 2),
               "v_head_dim": max(2, hidden // heads)}
    out = {k: getattr(shape, k) or t.get(k) or derived[k] for k in FIELDS}
    if out["qk_rope_head_dim"] % 2:
        raise ValueError(f"drafter: qk_rope_head_dim {out['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    return out


def softmax_scale(config: LlamaConfig) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("mscale_all_dim"):
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0
        scale *= mscale * mscale
    return scale


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (x[2i], x[2i+1]) with frequency i (GPT-J style); cos/sin as LlamaRotaryEmbedding gives
    them ([B, T, d], the d/2 frequencies twice)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)  # [B, 1, T, d/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)


class Eagle3MLAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        H, width, eps = config.hidden_size, 2 * config.hidden_size, config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.q_a_proj = nn.Linear(width, config.q_lora_rank, bias=False)
        self.q_a_layernorm = LlamaRMSNorm(config.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = LlamaRMSNorm(self.kv_lora, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, H, bias=False)
        self.scale = softmax_scale(config)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Per-head q [B, heads, T, nope+rope], k (same), v [B, heads, T, v_head], RoPE applied."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.heads, -1).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = rope_interleaved(q_rope, cos, sin)
        k_rope = rope_interleaved(k_rope.view(B, 1, T, self.rope), cos, sin).expand(B, self.heads, T, self.rope)
        return torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope], dim=-1), v


def attention_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    c, H, heads = config, config.hidden_size, config.num_attention_heads
    qk, rope = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_rope_head_dim
    return {"q_a_proj": (c.q_lora_rank, 2 * H), "q_a_layernorm": (c.q_lora_rank,),
            "q_b_proj": (heads * qk, c.q_lora_rank), "kv_a_proj_with_mqa": (c.kv_lora_rank + rope, 2 * H),
            "kv_a_layernorm": (c.kv_lora_rank,), "kv_b_proj": (heads * (c.qk_nope_head_dim + c.v_head_dim),
                                                              c.kv_lora_rank),
            "o_proj": (H, heads * c.v_head_dim)}


def cpu_check_problem(config: LlamaConfig) -> str | None:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") == "default" and not torch.cuda.is_available():
        return ("SGLang builds an MLA drafter's RoPE on CPU only for DeepSeek YaRN (get_rope_cpu); this drafter has "
                "plain RoPE, so its loader check needs a GPU machine")
    return None


ARCH = DrafterArch(name="mla", sglang_class="Eagle3DeepseekV2ForCausalLM",
                   model_type="deepseek_v3",  # transformers' deepseek_v3 config knows the MLA dims
                   attention=Eagle3MLAttention, attention_shapes=attention_shapes, config_fields=config_fields,
                   rotary_dim=lambda config: config.qk_rope_head_dim, cpu_check_problem=cpu_check_problem,
                   shape_fields=FIELDS)
