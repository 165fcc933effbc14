"""DFlash training steps for bench_train.py: Eyrie's (train/dflash.py under the DeepSpeed engine train/main.py
builds) and SpecForge 0.2.0's (`OnlineDFlashModel` over its `DFlashDraftModel`, flex attention, its
`BF16Optimizer`), on the same random inputs: one sequence of T target tokens, all in the loss, the target's aux
states of the draft layers' target layers ([T, K x Ht]), blocks of BLOCK_SIZE anchored at ANCHORS sampled
positions, the target's embedding and head (full vocabulary, frozen), loss decay gamma 7 for both (Eyrie's
default; SpecForge's is none).

Choices that differ and are kept, as each project ships them: Eyrie drafts every block in one forward under a
visibility mask (eyrie-dflash: dense, through SDPA, train.attention: blockwise; eyrie-dflash-flex: the
flex-attention block mask over [own blocks | context], train.attention: flex, auto's choice on CUDA) and takes the
loss through the frozen head in chunks that keep no logits; SpecForge builds a flex-attention block mask and
reduces the objective over chunks of 128 blocks under activation checkpointing. SpecForge's layer is Qwen3's (q/k
norms), Eyrie's is SGLang's DFlashDraftModel's.

Useful FLOPs (the same count for both; an estimate, stated): the draft layers over the N x bs block positions
(3 x forward: forward and backward), their K/V over the T context positions, fc over T, attention over the
visible (query, key) pairs, N x bs x (T/2 + bs) on average; the frozen head 2 x forward (forward and the input
gradient), over the full target vocabulary.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from bench_train import Eyrie, Inputs  # this script's folder is on sys.path

BLOCK_SIZE, ANCHORS, GAMMA, DRAFT_LAYERS = 16, 512, 7.0, 1
SETTINGS = {"block_size": BLOCK_SIZE, "anchors": ANCHORS, "loss_decay_gamma": GAMMA, "draft_layers": DRAFT_LAYERS}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def target_layer_ids(num_target_layers: int = 32, draft_layers: int = DRAFT_LAYERS) -> list[int]:
    """SGLang's and SpecForge's default DFlash target layers (the middle one for one draft layer)."""
    from data.target import dflash_default_layer_ids
    return dflash_default_layer_ids(num_target_layers, draft_layers)


def make_inputs(s: dict, T: int) -> Inputs:
    g = torch.Generator().manual_seed(T)
    k = len(target_layer_ids())
    pin = torch.cuda.is_available()
    aux = torch.randn(1, T, k * s["Ht"], generator=g).bfloat16()
    return Inputs(torch.randint(0, s["Vt"], (1, T), generator=g), aux.pin_memory() if pin else aux, None)


def useful_flops(s: dict, T: int) -> float:
    q = ANCHORS * BLOCK_SIZE
    kv = 2 * s["H"] * 2 * s["kvh"] * s["hd"]  # K and V projections per position
    per_query = 2 * s["H"] * s["nh"] * s["hd"] * 2 + 3 * 2 * s["H"] * s["I"]  # q, o; gate, up, down
    layers = DRAFT_LAYERS * (q * (per_query + kv) + T * kv)
    attention = DRAFT_LAYERS * 4 * s["nh"] * s["hd"] * q * (T / 2 + BLOCK_SIZE)
    fc = 2 * T * len(target_layer_ids()) * s["Ht"] * s["H"]
    head = 2 * q * s["H"] * s["Vt"]
    return 3 * (layers + attention + fc) + 2 * head


def drafter_config(s: dict):
    """Eyrie's DFlash drafter config at a benchmark shape (a Llama-3-style target of 32 layers)."""
    from train.dflash import dflash_config
    target = SimpleNamespace(  # what dflash_config reads of a TargetInfo
        text_config={"num_attention_heads": s["nh"], "num_key_value_heads": s["kvh"], "head_dim": s["hd"],
                     "intermediate_size": s["I"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
        hidden_size=s["Ht"], vocab_size=s["Vt"], max_position_embeddings=131072, num_layers=32, dtype="bfloat16")
    return dflash_config(target, DRAFT_LAYERS, target_layer_ids(), BLOCK_SIZE, mask_token_id=s["Vt"] - 1)


def _weights(s: dict):
    g = torch.Generator().manual_seed(0)
    embed = (torch.randn(s["Vt"], s["Ht"], generator=g) * 0.02).bfloat16()
    return embed, (torch.randn(s["Vt"], s["Ht"], generator=g) * 0.02).bfloat16()


class EyrieDFlash(Eyrie):
    """The product's DFlash step: train/families.py's objective, on synthetic inputs; backward and optimizer as
    Eyrie's EAGLE-3 step runs them."""

    attention = "dense"  # train.attention: blockwise (auto on a CPU)

    def __init__(self, s: dict, activation_checkpointing: bool):
        from data.config import TrainConfig
        from train.dflash import DFlashDrafter
        from train.engine import deepspeed_config, init_engine
        self.engine = init_engine(DFlashDrafter(drafter_config(s)), deepspeed_config(TrainConfig(), 1000,
                                                                                      bf16=DEVICE == "cuda"))
        self.dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # as the trainer runs on each
        self.embed, self.head = (t.to(DEVICE, self.dtype) for t in _weights(s))
        self.generator = torch.Generator().manual_seed(0)

    def loss(self, x: Inputs, timer) -> torch.Tensor:
        from train.dflash import dflash_objective
        with timer("data"):
            ids, aux = x.ids.to(DEVICE, non_blocking=True), x.aux.to(DEVICE, self.dtype, non_blocking=True)
            mask, lengths = torch.ones_like(ids), torch.tensor([ids.shape[1]], device=DEVICE)
        with timer("forward"):
            return dflash_objective(self.engine, self.embed, self.head, ids, aux, mask, lengths, ANCHORS, GAMMA,
                                    self.generator, attention=self.attention).loss


class SpecForgeDFlash:
    """SpecForge 0.2.0's DFlash step as its trainer builds it on one GPU (specforge/algorithms/model_providers.py:
    build_dflash_draft, _build_dflash_family_model; DFlashTrainStrategy calls the model as below)."""

    def __init__(self, s: dict, activation_checkpointing: bool):
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.auto import AutoDraftModel
        from specforge.optimizer import BF16Optimizer
        from transformers import Qwen3Config
        ids = target_layer_ids()
        config = Qwen3Config(
            architectures=["DFlashDraftModel"], hidden_size=s["H"], num_attention_heads=s["nh"],
            num_key_value_heads=s["kvh"], head_dim=s["hd"], intermediate_size=s["I"], rms_norm_eps=1e-5,
            vocab_size=s["Vt"], max_position_embeddings=131072, rope_theta=500000.0, num_hidden_layers=DRAFT_LAYERS,
            num_target_layers=32, block_size=BLOCK_SIZE, layer_types=["full_attention"] * DRAFT_LAYERS,
            sliding_window=None, use_sliding_window=False,
            dflash_config={"target_layer_ids": ids, "mask_token_id": s["Vt"] - 1}, tie_word_embeddings=False)
        backend = "flex_attention" if DEVICE == "cuda" else "sdpa"
        config._attn_implementation = backend
        draft = AutoDraftModel.from_config(config, torch_dtype=torch.bfloat16)
        embed_w, head_w = _weights(s)
        embed = torch.nn.Embedding.from_pretrained(embed_w, freeze=True)
        head = torch.nn.Linear(s["Ht"], s["Vt"], bias=False)
        head.weight = torch.nn.Parameter(head_w, requires_grad=False)
        self.model = OnlineDFlashModel(draft, head, embed, mask_token_id=s["Vt"] - 1, block_size=BLOCK_SIZE,
                                       attention_backend=backend, num_anchors=ANCHORS, loss_decay_gamma=GAMMA,
                                       objective_chunk_blocks=128).to(DEVICE, torch.bfloat16)
        self.optimizer = BF16Optimizer(self.model, lr=1e-4, total_steps=1000)

    def step(self, x, timer) -> float:
        with timer("data"):
            ids, aux = x.ids.to(DEVICE, non_blocking=True), x.aux.to(DEVICE, non_blocking=True)
        with timer("forward"):
            loss, _, _ = self.model(input_ids=ids, hidden_states=aux, loss_mask=torch.ones_like(ids))
        with timer("backward"):
            loss.backward()
        with timer("optimizer"):
            self.optimizer.step()
        return loss.item()

    def close(self):
        self.model = self.optimizer = None


class EyrieDFlashFlex(EyrieDFlash):
    """The same step with train.attention: flex (the block-sparse kernel; auto on CUDA)."""
    attention = "flex"


PEERS = {"eyrie-dflash": EyrieDFlash, "eyrie-dflash-flex": EyrieDFlashFlex, "specforge-dflash": SpecForgeDFlash}
