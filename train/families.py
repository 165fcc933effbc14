"""Drafter families: what train/main.py trains, one entry each (train.drafter.family).

A family builds its model from the run's config and the feature shards, and gives the trainer a `step` (one
micro-batch through the engine: a result with `.loss`), a fresh `stats()` accumulator (add / reduce across
ranks, with `loss`, `accept_length` and `tokens`) and the progress bar's fields. `eagle3`: the EAGLE-3 layer
unrolled k steps (train/drafter.py, train/ttt.py); `dflash`: a block drafter trained on sampled blocks
(train/dflash.py). A new family is one more builder in FAMILIES.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from data.config import EyrieConfig
from data.target import TargetInfo, load_embedding_and_head, load_target_info, load_target_tensors
from data.vocab import load_draft_vocab

from .dflash import BlockResult, DFlashDrafter, dflash_config, dflash_objective
from .drafter import Eagle3Drafter, drafter_config
from .engine import warm_start, warm_start_config
from .loader import Batch, FeatureData
from .metrics import BlockStats, TTTStats
from .teacher import Teacher
from .ttt import ttt_unroll


@dataclass
class Family:
    model: nn.Module
    step: Callable[[Any, Batch], Any]        # (engine or model, batch on the device) → result with .loss
    eval_step: Callable[[Any, Batch], Any]   # the same, deterministic: held-out figures comparable across evals
    stats: Callable[[], Any]                 # a fresh accumulator: add(result, tokens, padded), reduce() → dict
    progress: Callable[[dict], dict]         # the progress bar's fields from reduced scalars


def checked_layer_ids(cfg: EyrieConfig, data: FeatureData, target: TargetInfo) -> list[int]:
    meta = data.meta
    if meta["target_config_hash"] != target.config_hash:
        raise ValueError(f"{cfg.layout.features} was extracted from a target whose config differs from "
                         f"{cfg.target.path} ({meta['target_config_hash']} vs {target.config_hash})")
    ids = meta["aux_layer_ids"]  # the shards' layer ids are the truth; a configured list must agree
    if cfg.target.aux_layer_ids is not None and list(cfg.target.aux_layer_ids) != ids:
        raise ValueError(f"target.aux_layer_ids {cfg.target.aux_layer_ids} but the shards hold layers {ids}")
    return ids


def eagle3(cfg: EyrieConfig, data: FeatureData, device: torch.device, dtype: torch.dtype) -> Family:
    target = load_target_info(cfg.target.path)
    ids = checked_layer_ids(cfg, data, target)
    d2t, t2d = load_draft_vocab(cfg.layout.draft_vocab)
    config = drafter_config(target, cfg.train.drafter, len(d2t), ids)
    if cfg.train.warm_start:  # the drafter continues as it was trained: its RoPE and norm epsilon
        for note in warm_start_config(config, cfg.train.warm_start, cfg.train.drafter.rms_norm_eps):
            print(f"[train] warm start from {cfg.train.warm_start}: keeping {note}", flush=True)
    model = Eagle3Drafter(config, d2t, t2d)
    embed = load_target_tensors(cfg.target.path, ["embed"]).get("embed")
    if embed is None:
        raise ValueError(f"{cfg.target.path}: no embed_tokens.weight in the target's checkpoint")
    if embed.shape == model.embed_tokens.weight.shape:
        model.embed_tokens.weight.data.copy_(embed)
    else:  # a drafter narrower than the target learns its own embedding (exported with it)
        model.embed_tokens.weight.requires_grad_(True)
    if cfg.train.warm_start:
        warm_start(model, cfg.train.warm_start, cfg.target.path)
    model.set_attention(cfg.train.attention if cfg.train.attention != "auto" else
                        "flex" if device.type == "cuda" else "blockwise")
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.lm_head.recompute_logits = cfg.train.recompute_logits
    teacher = Teacher.from_target(cfg.target.path, target.text_config, data.meta["final_hidden"], t2d, device, dtype)
    tc = cfg.train

    def step(engine, b: Batch):
        return ttt_unroll(engine, b.input_ids, b.aux_hidden, b.loss_mask, b.lengths, teacher(b.final_hidden),
                          tc.ttt_steps, tc.ttt_decay)
    return Family(model, step, step, lambda: TTTStats(tc.ttt_steps, tc.ttt_decay), lambda s: {
        "loss": f"{s['loss']:.3f}", "acc0": f"{s['acc_step0']:.2f}", f"accept{tc.ttt_steps}_ttt":
        f"{s['accept_length']:.2f}"})


def mask_token_id(cfg: EyrieConfig, vocab_size: int) -> int:
    """train.dflash.mask_token_id, else what SGLang resolves: the tokenizer's <|MASK|>, else the id the token gets
    when SGLang adds it to the tokenizer (its length), which the target's embedding must hold; else the pad token.
    The id is written into the drafter's config, so SGLang serves with the same one."""
    if cfg.train.dflash.mask_token_id is not None:
        return cfg.train.dflash.mask_token_id
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.target.tokenizer_path, trust_remote_code=cfg.target.trust_remote_code)
    found = tok.get_vocab().get("<|MASK|>")
    if found is not None:
        return int(found)
    if len(tok) < vocab_size:
        return len(tok)
    if tok.pad_token_id is not None and tok.pad_token_id not in (tok.eos_token_id, tok.bos_token_id):
        return int(tok.pad_token_id)  # a token the model never emits
    raise ValueError(f"train.dflash.mask_token_id: the tokenizer has no <|MASK|> or pad token and the target's "
                     f"embedding has no row past its {len(tok)} tokens for SGLang to add one; set it to a reserved "
                     "token's id")


def dflash(cfg: EyrieConfig, data: FeatureData, device: torch.device, dtype: torch.dtype) -> Family:
    target = load_target_info(cfg.target.path)
    ids, dc = checked_layer_ids(cfg, data, target), cfg.train.dflash
    if cfg.train.warm_start:
        raise ValueError("train.warm_start: DFlash drafters start from scratch for now")
    embed, head = load_embedding_and_head(cfg.target.path)
    shape = cfg.train.drafter
    config = dflash_config(target, dc.num_layers, ids, dc.block_size, mask_token_id(cfg, target.vocab_size),
                           shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim,
                           shape.intermediate_size, shape.rms_norm_eps)
    model = DFlashDrafter(config)
    embed, lm_head = embed.to(device, dtype), head.to(device, dtype)  # the target's, frozen
    generator = torch.Generator().manual_seed(cfg.seed + (dist.get_rank() if dist.is_initialized() else 0))

    teacher = Teacher.from_target(cfg.target.path, target.text_config, data.meta["final_hidden"],
                                  torch.ones(target.vocab_size, dtype=torch.bool), device, dtype) \
        if dc.labels == "teacher" else None  # the full vocabulary: a DFlash drafter drafts with the target's head

    # auto: the block-sparse kernel on CUDA (H100: 1.32-1.34x SpecForge's DFlash step, results/train-step-dflash-flex-*)
    attention = {"auto": "flex" if device.type == "cuda" else "dense", "flex": "flex",
                 "blockwise": "dense"}[cfg.train.attention]
    if attention == "flex" and device.type != "cuda":
        raise ValueError(f"train.attention: flex needs CUDA for a DFlash drafter (flex attention has no backward on "
                         f"{device.type}); use auto or blockwise")

    def step(engine, b: Batch, blocks_from: torch.Generator = generator) -> BlockResult:
        return dflash_objective(engine, embed, lm_head, b.input_ids, b.aux_hidden, b.loss_mask, b.lengths,
                                dc.blocks_per_sample, dc.loss_decay_gamma, blocks_from, teacher, b.final_hidden,
                                attention)

    def eval_step(engine, b: Batch) -> BlockResult:  # the same blocks of a batch at every evaluation
        return step(engine, b, torch.Generator().manual_seed(cfg.seed * 1_000_003 + int(b.lengths.sum())))
    return Family(model, step, eval_step, lambda: BlockStats(dc.block_size), lambda s: {
        "loss": f"{s['loss']:.3f}", "acc1": f"{s['acc_pos1']:.2f}", "accept_block": f"{s['accept_length']:.2f}"})


FAMILIES = {"eagle3": eagle3, "dflash": dflash}
