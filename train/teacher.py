"""The teacher: the target's next-token distribution from the stored final hidden states.

Its tensors come straight from the target's safetensors (data.target.load_target_tensors): the LM head (or the
tied embedding) and the final norm when the shards hold pre-norm states. Nothing here is trained.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from data.target import load_target_tensors

@dataclass
class TeacherOutput:
    probs: torch.Tensor       # [B, T, draft_vocab] target distribution restricted to the draft vocab
    target_ids: torch.Tensor  # [B, T] the target's argmax over its full vocab
    in_vocab: torch.Tensor    # [B, T] whether that argmax is in the draft vocab


class Teacher:
    def __init__(self, lm_head: torch.Tensor, t2d: torch.Tensor, norm: torch.Tensor | None = None,
                 eps: float = 1e-6, chunk_tokens: int = 2048):
        self.lm_head, self.norm, self.eps, self.chunk = lm_head, norm, eps, chunk_tokens
        self.t2d = t2d.to(lm_head.device)
        self.draft_to_target = torch.nonzero(self.t2d).flatten()

    @classmethod
    def from_target(cls, target: str | Path, text_config: dict, final_hidden: str, t2d: torch.Tensor,
                    device: torch.device, dtype: torch.dtype) -> "Teacher":
        if final_hidden not in ("post_norm", "pre_norm"):
            raise ValueError(f"shards describe their final hidden state as {final_hidden!r}; "
                             "expected post_norm or pre_norm")
        tied = bool(text_config.get("tie_word_embeddings"))  # read the (large) embedding only when it is the head
        wanted = ["embed" if tied else "lm_head"] + (["norm"] if final_hidden == "pre_norm" else [])
        tensors = load_target_tensors(target, wanted)
        lm_head = tensors.get("lm_head", tensors.get("embed"))
        if lm_head is None:
            raise ValueError(f"{target}: no lm_head.weight in the checkpoint (and embeddings are not tied)")
        if final_hidden == "pre_norm" and "norm" not in tensors:
            raise ValueError(f"{target}: shards hold pre-norm states but the checkpoint has no final norm")
        norm = tensors["norm"].to(device, dtype) if "norm" in tensors and final_hidden == "pre_norm" else None
        return cls(lm_head.to(device, dtype), t2d, norm, float(text_config.get("rms_norm_eps", 1e-6)))

    @torch.no_grad()
    def __call__(self, final_hidden: torch.Tensor) -> TeacherOutput:
        B, T, H = final_hidden.shape
        flat = final_hidden.reshape(-1, H).to(self.lm_head.dtype)
        probs, ids = [], []
        for start in range(0, len(flat), self.chunk):  # [chunk, vocab] logits at a time: the vocab can be 160K
            x = flat[start:start + self.chunk]
            if self.norm is not None:
                x32 = x.float()
                x = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.norm
            logits = x @ self.lm_head.T
            ids.append(logits.argmax(-1))
            probs.append(torch.softmax(logits[:, self.draft_to_target].float(), dim=-1).to(final_hidden.dtype))
        target_ids = torch.cat(ids).view(B, T)
        return TeacherOutput(torch.cat(probs).view(B, T, -1), target_ids, self.t2d[target_ids])
