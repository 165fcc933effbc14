"""The teacher: the target's next-token distribution from the stored final hidden states.

Tensors come straight from the target's safetensors (only the few needed, by name, whatever prefix the
checkpoint uses, e.g. `language_model.`): the LM head (or the tied embedding), the final norm when the
shards hold pre-norm states, and the input embedding the drafter shares. Nothing here is trained.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# Tensor name patterns; `(?:.*\.)?` admits wrapper prefixes but not a decoder layer's own copies
# (DeepSeek-V3's MTP layers carry `model.layers.61.embed_tokens.weight`).
PATTERNS = {
    "embed": re.compile(r"^(?:.*\.)?(?:model|language_model)\.embed_tokens\.weight$"),
    "lm_head": re.compile(r"^(?:.*\.)?lm_head\.weight$"),
    "norm": re.compile(r"^(?:.*\.)?(?:model|language_model)\.norm\.weight$"),
}


def _weight_files(target: Path) -> dict[str, Path]:
    index = target / "model.safetensors.index.json"
    if index.exists():
        return {k: target / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target}: no safetensors weights (the trainer reads the target's LM head and "
                                "embedding from them)")
    names = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            names.update({k: f for k in fh.keys()})
    return names


def load_target_tensors(target: str | Path, wanted: list[str]) -> dict[str, torch.Tensor]:
    """{'embed' | 'lm_head' | 'norm': tensor} for the wanted ones present in the target's checkpoint."""
    target = Path(target)
    files = _weight_files(target)
    out = {}
    for what in wanted:
        hits = [k for k in files if PATTERNS[what].match(k) and ".layers." not in k and "vision" not in k]
        if len(hits) > 1:
            raise ValueError(f"{target}: several tensors could be the {what}: {hits}")
        if hits:
            with safe_open(str(files[hits[0]]), "pt") as fh:
                out[what] = fh.get_tensor(hits[0])
    return out


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
