"""`python -m launch.widen_target --source DIR --out DIR [--shape llama3-8b] [--dtype bfloat16] [--fill random]`

A trained Llama target widened to a larger model's shape without changing what it computes, so that a
speculative cycle is served at the real model's cost while the target keeps the small model's answers (a 100M
target's decode step is mostly scheduler overhead; an 8B's is weights and attention). How each part keeps the
function (h, L, d: the source's hidden size, layers, head dim; H, L', D: the wider ones):
- hidden: the extra dimensions of the residual stream stay exactly zero: the embedding's extra columns and every
  output projection's extra rows (o_proj, down_proj) are zero. RMSNorm over H of a vector that is zero beyond h
  is sqrt(H/h) x RMSNorm over h when its epsilon is eps x h/H: the config's `rms_norm_eps` becomes eps x h/H
  and every norm weight w becomes w x sqrt(h/H).
- heads: real KV head b stays b; real query head a = g*b + r (g query heads per KV head) moves to G*b + r, so it
  keeps its KV head under the wider grouping G; the extra heads' o_proj columns are zero.
- head dim: the rotary pair i (dims i and i + d/2, frequency theta^(-2i/d)) moves to pair k*i of the wider head
  (k = D/d, dims k*i and D/2 + k*i), whose frequency theta^(-2ki/D) is the same, so rope_theta (and any RoPE
  scaling, which acts per frequency) stays; the real heads' other dimensions are zero in q and k, and q is
  scaled by sqrt(D/d) so that q.k / sqrt(D) is the source's q.k / sqrt(d).
- MLP: extra units' down_proj columns are zero.
- layers: the extra layers are identities (o_proj and down_proj zero). The real layers are placed so that the
  wider model's default aux ids ([1, L'/2-1, L'-4]) are the real layers the source's default ids name (and the
  last real layer is the last layer): its default features are the source's.
Weights whose output is multiplied by zero (extra heads' q/k/v, extra units' gate/up, the extra layers'
inputs) are random (--fill random), so kernels see ordinary data, or zero (--fill zero).

Writes OUT/config.json, safetensors shards of at most --shard-gb with model.safetensors.index.json, the source's
tokenizer and chat template files, and OUT/widen.json (source, shape, where each real layer went).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from data.files import atomic_write_json, load_safetensors


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config["num_attention_heads"]
        return cls(config["hidden_size"], config["num_hidden_layers"], heads,
                   config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads, config["intermediate_size"])


SHAPES = {"llama3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336)}
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json")


def shape_problems(src: Shape, dst: Shape, config: dict) -> list[str]:
    """Why `src` cannot be widened to `dst` exactly, or []."""
    found = [f"{name} {getattr(dst, name)} < the source's {getattr(src, name)}"
             for name in ("hidden", "layers", "kv_heads", "intermediate") if getattr(dst, name) < getattr(src, name)]
    if config.get("model_type") != "llama":
        found.append(f"model_type {config.get('model_type')!r}: only Llama targets are widened")
    if config.get("attention_bias") or config.get("mlp_bias"):
        found.append("attention or MLP biases: not widened")
    if src.heads % src.kv_heads or dst.heads % dst.kv_heads or dst.heads // dst.kv_heads < src.heads // src.kv_heads:
        found.append(f"query heads per KV head: {dst.heads}/{dst.kv_heads} must hold the source's "
                     f"{src.heads}/{src.kv_heads}")
    if dst.hidden % dst.heads:
        found.append(f"hidden {dst.hidden} is not a multiple of {dst.heads} heads (transformers refuses the config)")
    if dst.head_dim % src.head_dim or src.head_dim % 2:
        found.append(f"head dim {dst.head_dim} must be a multiple of the source's {src.head_dim} (even)")
    return found


def layer_positions(src_layers: int, dst_layers: int) -> list[int]:
    """Where each source layer goes: anchored at 0, at the default aux ids of both (when the source's are
    distinct) and at the last layer; evenly spread in between."""
    def default(n: int) -> list[int]:
        return [1, n // 2 - 1, n - 4]
    anchors = {0: 0, src_layers - 1: dst_layers - 1}
    ids = default(src_layers)
    if len(set(ids)) == 3 and ids == sorted(ids) and ids[0] > 0 and ids[-1] < src_layers - 1:
        anchors |= dict(zip(ids, default(dst_layers)))
    points = sorted(anchors.items())
    positions = []
    for (s0, d0), (s1, d1) in zip(points, points[1:]):
        step = (d1 - d0) / (s1 - s0)  # >= 1: consecutive layers land on distinct positions
        positions += [round(d0 + (s - s0) * step) for s in range(s0, s1)]
    positions.append(dst_layers - 1)
    if positions != sorted(set(positions)) or len(positions) != src_layers:
        raise ValueError(f"cannot place {src_layers} layers in {dst_layers} keeping the default aux ids")
    return positions


class Widener:
    """The wider tensors, one at a time: `real` blocks copied (and rescaled) in, `free` blocks filled."""

    def __init__(self, src: Shape, dst: Shape, dtype: torch.dtype, fill: str, seed: int):
        self.src, self.dst, self.dtype, self.fill = src, dst, dtype, fill
        self.generator = torch.Generator().manual_seed(seed)
        self.norm_scale = math.sqrt(src.hidden / dst.hidden)
        k = dst.head_dim // src.head_dim
        half, dst_half = src.head_dim // 2, dst.head_dim // 2
        # rotary pair i -> pair k*i: same frequency under the same rope_theta
        self.rotary_slot = torch.tensor([k * i if i < half else dst_half + k * (i - half)
                                         for i in range(src.head_dim)])
        group, dst_group = src.heads // src.kv_heads, dst.heads // dst.kv_heads
        self.query_head = [dst_group * (a // group) + a % group for a in range(src.heads)]

    def free(self, *size: int) -> torch.Tensor:
        if self.fill == "zero":
            return torch.zeros(size, dtype=self.dtype)
        return (torch.randn(size, generator=self.generator) * 0.02).to(self.dtype)

    def zeros(self, *size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=self.dtype)

    def rows(self, weight: torch.Tensor, heads: list[int], slots: torch.Tensor, n_heads: int,
             scale: float = 1.0) -> torch.Tensor:
        """A [n_heads * D, H] projection with source head a's rows at head heads[a], dims slots; the rows of those
        heads outside `slots` zero, other heads free."""
        src, dst = self.src, self.dst
        out = self.free(n_heads * dst.head_dim, dst.hidden)
        for a, head in enumerate(heads):
            block = self.zeros(dst.head_dim, dst.hidden)
            block[slots, :src.hidden] = (weight[a * src.head_dim:(a + 1) * src.head_dim].float() * scale).to(self.dtype)
            out[head * dst.head_dim:(head + 1) * dst.head_dim] = block
        return out

    def layer(self, w: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """One decoder layer's tensors (names after `model.layers.N.`); None: an identity layer."""
        src, dst = self.src, self.dst
        kv_heads = list(range(src.kv_heads))
        identity = torch.arange(src.head_dim)
        if w is None:
            out = {f"self_attn.{p}_proj.weight": self.free(n * dst.head_dim, dst.hidden)
                   for p, n in (("q", dst.heads), ("k", dst.kv_heads), ("v", dst.kv_heads))}
            out |= {f"mlp.{p}_proj.weight": self.free(dst.intermediate, dst.hidden) for p in ("gate", "up")}
            out |= {f"{n}.weight": torch.ones(dst.hidden, dtype=self.dtype)
                    for n in ("input_layernorm", "post_attention_layernorm")}
            return out | {"self_attn.o_proj.weight": self.zeros(dst.hidden, dst.heads * dst.head_dim),
                          "mlp.down_proj.weight": self.zeros(dst.hidden, dst.intermediate)}
        out = {"self_attn.q_proj.weight": self.rows(w["self_attn.q_proj.weight"], self.query_head, self.rotary_slot,
                                                    dst.heads, scale=math.sqrt(dst.head_dim / src.head_dim)),
               "self_attn.k_proj.weight": self.rows(w["self_attn.k_proj.weight"], kv_heads, self.rotary_slot,
                                                    dst.kv_heads),
               "self_attn.v_proj.weight": self.rows(w["self_attn.v_proj.weight"], kv_heads, identity, dst.kv_heads)}
        o = self.zeros(dst.hidden, dst.heads * dst.head_dim)
        for a, head in enumerate(self.query_head):
            o[:src.hidden, head * dst.head_dim:head * dst.head_dim + src.head_dim] = \
                w["self_attn.o_proj.weight"][:, a * src.head_dim:(a + 1) * src.head_dim]
        out["self_attn.o_proj.weight"] = o
        for p in ("gate", "up"):
            t = self.free(dst.intermediate, dst.hidden)
            t[:src.intermediate] = 0
            t[:src.intermediate, :src.hidden] = w[f"mlp.{p}_proj.weight"]
            out[f"mlp.{p}_proj.weight"] = t
        down = self.zeros(dst.hidden, dst.intermediate)
        down[:src.hidden, :src.intermediate] = w["mlp.down_proj.weight"]
        out["mlp.down_proj.weight"] = down
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{n}.weight"] = self.norm(w[f"{n}.weight"])
        return out

    def norm(self, weight: torch.Tensor) -> torch.Tensor:
        out = self.zeros(self.dst.hidden)
        out[:self.src.hidden] = (weight.float() * self.norm_scale).to(self.dtype)
        return out

    def columns(self, weight: torch.Tensor) -> torch.Tensor:
        """Embedding or head [V, h] -> [V, H], the extra columns zero."""
        out = self.zeros(weight.shape[0], self.dst.hidden)
        out[:, :self.src.hidden] = weight
        return out


class ShardWriter:
    """Safetensors shards of at most `shard_gb`, each written when full (an 8B model never sits in memory
    twice), and the index transformers and SGLang read."""

    def __init__(self, out: Path, shard_gb: float):
        self.out, self.limit, self.pending, self.weight_map = out, shard_gb * 2 ** 30, {}, {}
        self.total_bytes = self.parameters = 0

    def put(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending and sum(t.nbytes for t in self.pending.values()) + tensor.nbytes > self.limit:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.total_bytes += tensor.nbytes
        self.parameters += tensor.numel()

    def flush(self) -> None:
        name = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        save_file(self.pending, str(self.out / name), metadata={"format": "pt"})
        self.weight_map |= dict.fromkeys(self.pending, name)
        self.pending = {}

    def close(self) -> None:
        if self.pending:
            self.flush()
        atomic_write_json(self.out / "model.safetensors.index.json",
                          {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map})


def widen(source: str | Path, out: str | Path, dst: Shape, dtype: str | None = None, fill: str = "random",
          seed: int = 0, shard_gb: float = 4.0) -> dict:
    """Write the widened target to `out`; returns widen.json's content."""
    source, out = Path(source), Path(out)
    config = json.loads((source / "config.json").read_text())
    src = Shape.of(config)
    problems = shape_problems(src, dst, config)
    if problems:
        raise ValueError(f"{source} cannot be widened to {dst}: " + "; ".join(problems))
    dtype = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    weights = {}
    for f in sorted(source.glob("*.safetensors")):
        weights |= load_safetensors(f, "the source target's trainer")
    positions = layer_positions(src.layers, dst.layers)
    widener = Widener(src, dst, getattr(torch, dtype), fill, seed)

    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():  # tokenizer, chat template, generation config: the source's
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    shards = ShardWriter(out, shard_gb)
    shards.put("model.embed_tokens.weight", widener.columns(weights["model.embed_tokens.weight"]))
    source_of = {p: i for i, p in enumerate(positions)}
    for position in tqdm(range(dst.layers), desc="widen layers"):
        i = source_of.get(position)
        prefix = f"model.layers.{i}."
        layer = None if i is None else {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        for name, tensor in widener.layer(layer).items():
            shards.put(f"model.layers.{position}.{name}", tensor)
    shards.put("model.norm.weight", widener.norm(weights["model.norm.weight"]))
    if "lm_head.weight" in weights:
        shards.put("lm_head.weight", widener.columns(weights["lm_head.weight"]))
    shards.close()
    wide = {k: v for k, v in config.items() if k not in ("torch_dtype",)} | {
        "hidden_size": dst.hidden, "num_hidden_layers": dst.layers, "num_attention_heads": dst.heads,
        "num_key_value_heads": dst.kv_heads, "head_dim": dst.head_dim, "intermediate_size": dst.intermediate,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6) * src.hidden / dst.hidden, "dtype": dtype}
    atomic_write_json(out / "config.json", wide)
    record = {"source": str(source), "source_shape": asdict(src), "shape": asdict(dst), "dtype": dtype,
              "fill": fill, "seed": seed, "layer_positions": positions,
              "parameters": shards.parameters}
    atomic_write_json(out / "widen.json", record)
    return record


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="a trained Llama target directory")
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="default: the source's declared dtype")
    p.add_argument("--fill", default="random", choices=["random", "zero"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=4.0)
    a = p.parse_args(argv)
    record = widen(a.source, a.out, SHAPES[a.shape], a.dtype, a.fill, a.seed, a.shard_gb)
    print(f"[widen] {a.source} -> {a.out}: {record['parameters'] / 1e9:.2f}B parameters, real layers at "
          f"{record['layer_positions']}", flush=True)
    return record


if __name__ == "__main__":
    main()
