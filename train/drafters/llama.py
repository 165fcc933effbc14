"""The Llama drafter layer's attention: grouped-query attention over EAGLE-3's 2H-wide input, as SGLang's
`LlamaForCausalLMEagle3` computes it (sglang/srt/models/llama_eagle3.py): q/k/v projections of [embeds, hidden],
RoPE on whole heads (rotate-half), softmax scale head_dim^-0.5."""
from __future__ import annotations

from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..fused import on_cuda_compiled
from .base import DrafterArch

_rope = on_cuda_compiled(apply_rotary_pos_emb)


class Eagle3Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        width = 2 * config.hidden_size  # [embeds, hidden] concatenated
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, k, cos, sin)
        return q, k, v


def attention_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    H, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q_proj": (q, 2 * H), "k_proj": (kv, 2 * H), "v_proj": (kv, 2 * H), "o_proj": (H, q)}


ARCH = DrafterArch(name="llama", sglang_class="LlamaForCausalLMEagle3", model_type="llama",
                   attention=Eagle3Attention, attention_shapes=attention_shapes)
