"""How aux hidden states are stored in a features shard (`ShardMeta.aux_encoding`).

- "raw": the states' own dtype, bytes as they are (lossless; bf16 on GPU = 2 bytes per value).
- "fp8_e4m3_rowscale": per token and aux layer, the H values divided by (their absmax / 448) in float8 e4m3, then
  the n_aux float32 scales: n_aux * H + 4 * n_aux bytes per token, ~0.5x bf16 and ~0.25x fp32. e4m3 keeps 3
  mantissa bits (a relative error up to 2^-4) for values down to the row's absmax / 28,672, so a massive
  activation in a row does not flatten the rest of it as an integer code would. The final hidden state (the
  teacher's input) stays raw.

Extraction encodes on the device, before the device→host copy, so the copy and the disk both carry the small form.
"""
from __future__ import annotations

import torch

ENCODINGS = ("raw", "fp8_e4m3_rowscale")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def row_bytes(encoding: str, n_aux: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes one token's aux states take in `encoding`."""
    if encoding == "raw":
        return n_aux * hidden * dtype.itemsize
    if encoding == "fp8_e4m3_rowscale":
        return n_aux * hidden + 4 * n_aux
    raise ValueError(f"unknown aux encoding {encoding!r} (known: {', '.join(ENCODINGS)})")


def encode_fp8(aux: torch.Tensor, n_aux: int) -> torch.Tensor:
    """[T, n_aux * H] floats → [T, n_aux * H + 4 * n_aux] uint8 (codes, then the scales' bytes)."""
    T = aux.shape[0]
    x = aux.float().view(T, n_aux, -1)
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    codes = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(T, -1)
    return torch.cat([codes, scale.view(T, n_aux).view(torch.uint8)], dim=1)


def decode_fp8(raw: torch.Tensor, n_aux: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `encode_fp8`: uint8 [T, n_aux * H + 4 * n_aux] → [T, n_aux * H] in `dtype` (a new tensor)."""
    T, width = raw.shape[0], n_aux * hidden
    codes = raw[:, :width].view(torch.float8_e4m3fn).float().view(T, n_aux, hidden)
    scales = raw[:, width:].contiguous().view(torch.float32).view(T, n_aux, 1)
    return (codes * scales).to(dtype).view(T, width)
