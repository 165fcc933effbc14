"""The drafter against an independent EAGLE-3 reference, the teacher, the loader, and a one-batch overfit."""
import functools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from data.config import DrafterConfig, load_config
from data.target import load_target_info
from data.vocab import load_draft_vocab
from train import ttt
from train.drafter import Eagle3Drafter, drafter_config, eagle31_options
from data.split import heldout_ids, read_split
from train.loader import FeatureData
from data.target import load_target_tensors
from train.teacher import Teacher


def reference_unroll(w: dict, cfg, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """EAGLE-3 written out for one sequence, from the weights alone: full score matrices, explicit loops."""
    T = len(input_ids)
    H, Hkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [T, heads, d], rotate-half convention, theta from the config
        theta = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos[:, None].double() * inv[None]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float(), torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    options = eagle31_options(cfg)
    if options["fc_norm"]:  # EAGLE-3.1: each of the three aux states normalised with its own weight
        aux = torch.cat([rms(a, w[f"fc_norm.{i}.weight"]) for i, a in enumerate(aux.chunk(3, -1))], -1)
    h = aux @ w["fc.weight"].T
    keys, values, logits = [], [], []
    for j in range(steps):
        tokens = torch.zeros(T, dtype=torch.long)
        tokens[:T - j - 1] = input_ids[j + 1:]
        x = torch.cat([rms(w["embed_tokens.weight"][tokens], w["midlayer.input_layernorm.weight"]),
                       rms(h, w["midlayer.hidden_norm.weight"])], -1)
        pos = torch.arange(T) + j
        q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, H, d), pos)
        keys.append(rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, Hkv, d), pos))
        values.append((x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, Hkv, d))
        heads = []
        for hq in range(H):
            g = hq // (H // Hkv)
            causal = (q[:, hq] @ keys[0][:, g].T) / math.sqrt(d)
            causal = causal.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            own = [(q[:, hq] * keys[i][:, g]).sum(-1, keepdim=True) / math.sqrt(d) for i in range(1, j + 1)]
            p = torch.softmax(torch.cat([causal, *own], -1), -1)
            out = p[:, :T] @ values[0][:, g]
            for i in range(1, j + 1):
                out = out + p[:, T + i - 1:T + i] * values[i][:, g]
            heads.append(out)
        r = h + torch.cat(heads, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        y = rms(r, w["midlayer.post_attention_layernorm.weight"])
        m = r + (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)) \
            @ w["midlayer.mlp.down_proj.weight"].T
        logits.append(rms(m, w["norm.weight"]) @ w["lm_head.weight"].T)
        h = rms(m, w["norm.weight"]) if options["norm_output"] else m  # EAGLE-3.1 norm_output: the post-norm state
    return logits


def make_drafter(features_run, **options) -> Eagle3Drafter:
    cfg = load_config(features_run[0])
    d2t, t2d = load_draft_vocab(cfg.layout.draft_vocab)
    torch.manual_seed(0)
    config = drafter_config(load_target_info(cfg.target.path), DrafterConfig(**options), len(d2t), [0, 1, 2])
    model = Eagle3Drafter(config, d2t, t2d)
    for p in model.parameters():  # norms away from 1 so the test sees them
        torch.nn.init.normal_(p, std=0.3) if p.dim() == 1 else None
    return model


@pytest.fixture(scope="module")
def drafter(features_run):
    return make_drafter(features_run)


@pytest.fixture(scope="module", params=["eagle3", "eagle3.1"])
def drafter_of_each_kind(request, features_run):
    """Plain EAGLE-3, and with both EAGLE-3.1 options SGLang serves (fc_norm, norm_output)."""
    return make_drafter(features_run, **({"fc_norm": True, "norm_output": True} if request.param == "eagle3.1"
                                         else {}))


def test_names_are_sglangs(drafter):
    names = set(drafter.state_dict())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
            "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.mlp.down_proj.weight"} <= names
    assert drafter.midlayer.self_attn.q_proj.weight.shape[1] == 2 * drafter.config.hidden_size
    assert drafter.fc.weight.shape == (drafter.config.hidden_size, 3 * drafter.config.target_hidden_size)
    assert drafter.config.num_key_value_heads < drafter.config.num_attention_heads  # GQA exercised below


@pytest.mark.parametrize("block", [None, 5])  # 5: several query blocks, recomputed in backward
def test_ttt_unroll_matches_reference(drafter_of_each_kind, features_run, monkeypatch, block):
    drafter = drafter_of_each_kind
    if block:
        monkeypatch.setattr(ttt, "BLOCK_ELEMENTS", block * drafter.config.num_attention_heads * 40)
    torch.manual_seed(1)
    T, steps = 40, 4
    ids = torch.randint(0, drafter.config.vocab_size, (2, T))
    aux = torch.randn(2, T, 3 * drafter.config.target_hidden_size)
    hidden, past, ours = aux, [], []
    positions = torch.arange(T)[None].expand(2, T)
    for j in range(steps):
        out = drafter(ttt._shift(ids, j + 1), hidden, positions + j, past)
        hidden, past = out.hidden, past + [(out.key, out.value)]
        ours.append(out.logits)
    w = {k: v.detach() for k, v in drafter.state_dict().items()}
    for b in range(2):
        ref = reference_unroll(w, drafter.config, ids[b], aux[b], steps)
        for j in range(steps):
            torch.testing.assert_close(ours[j][b], ref[j], atol=2e-5, rtol=2e-4)
    # gradients through the blockwise (recomputing) attention equal those of plain autograd on the reference
    weights = torch.randn_like(ours[-1])
    (ours[-1] * weights).sum().backward()
    g_ours = drafter.midlayer.self_attn.q_proj.weight.grad.clone()
    if drafter.fc_norm is not None:  # the options' own weights are trained
        assert all(n.weight.grad is not None and n.weight.grad.abs().sum() > 0 for n in drafter.fc_norm)
    drafter.zero_grad()
    wq = w["midlayer.self_attn.q_proj.weight"].clone().requires_grad_()
    ref_last = [reference_unroll(w | {"midlayer.self_attn.q_proj.weight": wq}, drafter.config, ids[b], aux[b],
                                 steps)[-1] for b in range(2)]
    (torch.stack(ref_last) * weights).sum().backward()
    torch.testing.assert_close(g_ours, wq.grad, atol=1e-4, rtol=1e-3)
    drafter.zero_grad()


def test_eagle31_options_change_what_the_drafter_computes(features_run):
    """Same weights, options on and off: fc_norm makes the first step blind to each aux state's scale, and
    norm_output hands the next step exactly the post-norm state."""
    plain, options = make_drafter(features_run), make_drafter(features_run, fc_norm=True, norm_output=True)
    options.load_state_dict(plain.state_dict(), strict=False)  # all but fc_norm's own weights
    assert {f"fc_norm.{i}.weight" for i in range(3)} == set(options.state_dict()) - set(plain.state_dict())
    torch.manual_seed(3)
    T = 12
    ids, positions = torch.randint(0, plain.config.vocab_size, (1, T)), torch.arange(T)[None]
    aux = torch.randn(1, T, 3 * plain.config.target_hidden_size)
    scaled = aux * torch.tensor([10.0, 0.1, 3.0]).repeat_interleave(plain.config.target_hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(options(ids, scaled, positions).logits, options(ids, aux, positions).logits,
                                   atol=1e-4, rtol=1e-4)
        assert not torch.allclose(plain(ids, scaled, positions).logits, plain(ids, aux, positions).logits, atol=1e-2)
        pre = plain(ids, aux, positions).hidden
        options.fc_norm = None  # the same first step, so that only norm_output differs
        torch.testing.assert_close(options(ids, aux, positions).hidden, plain.norm(pre))


def test_blockwise_memory_is_linear_in_length(monkeypatch):
    """The bytes autograd keeps for the TTT attention grow ~linearly with T (T x T scores: 16x per 4x)."""
    monkeypatch.setattr(ttt, "BLOCK_ELEMENTS", 64 * 4 * 2048)  # query blocks of 64 rows at T = 2048

    def saved_bytes(T):
        q = torch.randn(1, 4, T, 16, requires_grad=True)
        ks = [torch.randn(1, 4, T, 16, requires_grad=True) for _ in range(3)]
        vs = [torch.randn(1, 4, T, 16, requires_grad=True) for _ in range(3)]
        storages = {}

        def pack(t):  # per-block inputs are views: count each storage once
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ttt.ttt_attention(q, ks, vs, 0.25, "blockwise")
        return sum(storages.values())
    small, large = saved_bytes(512), saved_bytes(2048)
    assert large / small < 5, (small, large)  # 4x the length: ~4x, not 16x


def test_flex_and_blockwise_ttt_attention_agree(monkeypatch):
    """flex's log-sum-exp (the merge with the diagonal keys relies on it) against blockwise's, with grouped-query
    heads. Uncompiled flex on the CPU (no backward there): tests/gpu/test_flex_ttt.py checks gradients on CUDA."""
    from torch.nn.attention.flex_attention import flex_attention
    monkeypatch.setattr(ttt, "_compiled_flex", lambda: flex_attention)
    monkeypatch.setattr(ttt, "_causal_block_mask", ttt._causal_block_mask.__wrapped__)
    monkeypatch.setattr(ttt, "_FLEX_FAILED", [])
    torch.manual_seed(0)
    q, *kv = [torch.randn(2, 4, 24, 8)] + [torch.randn(2, 2, 24, 8) for _ in range(6)]
    with torch.no_grad():
        flex = ttt.ttt_attention(q, kv[:3], kv[3:], 0.3, "flex")
        blockwise = ttt.ttt_attention(q, kv[:3], kv[3:], 0.3, "blockwise")
    assert not ttt._FLEX_FAILED
    torch.testing.assert_close(flex, blockwise, atol=1e-5, rtol=1e-4)
    assert [ttt.flex_length(T) for T in (24, 128, 129, 1024, 1025, 4096, 5000)] == \
        [128, 128, 256, 1024, 2048, 4096, 5120]


def test_flex_compiles_once_per_length_bucket_whatever_the_batch_size(monkeypatch):
    """Token-budget batches hold max_batch_tokens // T sequences, so batch sizes vary from step to step; flex
    must not compile a kernel per size (on the H200 each compile takes seconds; the mission run's first 40
    steps took 7.6 min). aot_eager stands in for Inductor, which compiles no flex backward on the CPU; what
    decides a recompile (dynamo's guards on the inputs' shapes) is the same."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(ttt, "_compiled_flex", functools.partial(ttt._compiled_flex.__wrapped__, "aot_eager"))
    monkeypatch.setattr(ttt, "_FLEX_FAILED", [])
    torch._dynamo.reset()

    def graphs_after(B: int, T: int) -> int:
        # [B, T, H, D] projections viewed as [B, H, T, D], as the drafter passes them: a length already at its
        # bucket (128 below) is not padded, and its strides once made dynamo compile the kernel again
        q, k, v = (torch.randn(B, T, h, 16).transpose(1, 2) for h in (4, 2, 2))
        with torch.no_grad():
            out, lse = ttt.flex_causal_attention(q, k, v, 0.25)
        assert out.shape == (B, 4, T, 16) and lse.shape == (B, 4, T)
        return counters["stats"]["unique_graphs"]

    graphs_after(3, 100), graphs_after(3, 100)  # first compile (and one for torch's once-only warnings)
    start = counters["stats"]["unique_graphs"]
    same_bucket = [graphs_after(B, T) - start for B, T in [(5, 120), (7, 128), (12, 90), (2, 128), (9, 65)]]
    assert same_bucket == [0] * 5, same_bucket  # before the batch dim was marked dynamic: [1, 2, 3, 4, 5]
    assert graphs_after(4, 200) - start == 2    # the next bucket (256) compiles its block mask and kernel...
    assert graphs_after(6, 256) - start == 2    # ...once for every batch size
    assert not ttt._FLEX_FAILED


def test_a_length_at_its_flex_bucket_compiles_no_new_merge(monkeypatch):
    """flex's output feeds the merge of the later unroll steps' keys (compiled for dynamic shapes, guarded on
    strides): a length exactly at its bucket (no padding) must hand it the same layout as a padded one. Before:
    one graph more at T = 128 here (forward; with backward on the H100, 2 at T = 2048)."""
    from torch._dynamo.utils import counters

    from train import fused
    monkeypatch.setattr(fused, "CPU_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(ttt, "_compiled_flex", functools.partial(ttt._compiled_flex.__wrapped__, "aot_eager"))
    monkeypatch.setattr(ttt, "_FLEX_FAILED", [])
    torch._dynamo.reset()

    def graphs_after(B: int, T: int) -> int:
        q = torch.randn(B, T, 4, 16).transpose(1, 2)
        keys = [torch.randn(B, T, 2, 16).transpose(1, 2) for _ in range(3)]
        values = [torch.randn(B, T, 2, 16).transpose(1, 2) for _ in range(3)]
        with torch.no_grad():  # flex has no backward on the CPU
            assert ttt.ttt_attention(q, keys, values, 0.25, "flex").shape == (B, 4, T, 16)
        return counters["stats"]["unique_graphs"]
    graphs_after(2, 100), graphs_after(3, 110)  # first compiles
    start = counters["stats"]["unique_graphs"]
    assert [graphs_after(B, T) - start for B, T in [(5, 90), (4, 128), (2, 120), (6, 128)]] == [0] * 4
    assert not ttt._FLEX_FAILED


def test_training_compiles_a_fixed_set_of_graphs_whatever_the_batch(drafter, monkeypatch):
    """Every graph dynamo makes is an Inductor compile of seconds on the GPU: the mission run's first 20 steps
    took 4 min 56 s (a graph per unroll step for the merge, per requires_grad/stride/batch-size-equals-heads
    pattern for the fused functions). The fused functions compiled on the CPU too (aot_eager standing in for
    Inductor, the guards are the same): after the first batch, new batch sizes and lengths add no graph, and
    evaluation adds its no-grad variants once."""
    from torch._dynamo.utils import counters
    from train import fused
    monkeypatch.setattr(fused, "CPU_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = drafter.config
    teacher = Teacher(torch.randn(cfg.vocab_size, cfg.target_hidden_size), drafter.t2d)

    def graphs_after(B: int, T: int, train: bool = True) -> int:
        ids = torch.randint(0, cfg.vocab_size, (B, T))
        lengths = torch.randint(T // 2, T + 1, (B,))
        lengths[0] = T
        with torch.set_grad_enabled(train):
            out = ttt.ttt_unroll(drafter, ids, torch.randn(B, T, 3 * cfg.target_hidden_size), torch.ones(B, T),
                                 lengths, teacher(torch.randn(B, T, cfg.target_hidden_size)), 5, 0.8)
            if train:
                out.loss.backward()
        assert torch.isfinite(out.loss)
        return counters["stats"]["unique_graphs"]

    heads = cfg.num_attention_heads  # a first batch as large as the head count made dynamo assume B == H
    first = graphs_after(heads, 40)
    assert first <= 8, first         # with the merge's keys in a list: 10 (one graph per unroll step)
    later = [graphs_after(B, T) - first for B, T in [(heads + 1, 23), (heads + 3, 40), (2, 64), (heads, 9)]]
    assert later == [0] * 4, later   # with duck sizing: [3, 3, 3, 3]
    evaluated = graphs_after(heads + 2, 30, train=False) - first
    assert 0 < evaluated <= 3, evaluated  # the merge's keys in a list: 5
    assert graphs_after(6, 50, train=False) - first == evaluated
    # dynamo specialises a size of 1: a one-sequence batch (longer than half the token budget) adds its set once
    one = graphs_after(1, 17) - first - evaluated
    assert graphs_after(1, 33) - first - evaluated == one
    drafter.zero_grad()  # the fixture is shared


def test_teacher_finds_prefixed_tensors_and_masks_out_of_vocab(tmp_path):
    torch.manual_seed(0)
    lm_head, embed = torch.randn(10, 4), torch.randn(10, 4)
    save_file({"language_model.lm_head.weight": lm_head, "language_model.model.embed_tokens.weight": embed,
               "language_model.model.layers.3.embed_tokens.weight": torch.zeros(10, 4)},
              str(tmp_path / "model.safetensors"))
    found = load_target_tensors(tmp_path, ["lm_head", "embed"])
    assert torch.equal(found["lm_head"], lm_head) and torch.equal(found["embed"], embed)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 3, 4, 8]] = True
    teacher = Teacher(lm_head, t2d, chunk_tokens=3)
    final = torch.randn(2, 5, 4)
    out = teacher(final)
    full = final @ lm_head.T
    assert torch.equal(out.target_ids, full.argmax(-1))
    assert torch.equal(out.in_vocab, t2d[full.argmax(-1)])
    torch.testing.assert_close(out.probs, torch.softmax(full[..., t2d], -1))


def test_loader_groups_lengths_resumes_and_splits_ranks(features_run):
    cfg = load_config(features_run[0])
    heldout = heldout_ids(read_split(cfg.layout.split))
    one = FeatureData(cfg.layout.features, heldout, 1024, seed=0, rank=0, world=1)
    assert one.padding_fraction(one.epoch_plan(0)) < 0.10
    assert one.epoch_plan(1) == FeatureData(cfg.layout.features, heldout, 1024, seed=0, rank=0, world=1).epoch_plan(1)
    assert one.epoch_plan(0) != one.epoch_plan(1)
    ranks = [FeatureData(cfg.layout.features, heldout, 1024, seed=0, rank=r, world=2) for r in range(2)]
    seen = [i for r in ranks for b in r.epoch_plan(0) for i in b]
    assert len(seen) == len(set(seen)) and len(ranks[0].epoch_plan(0)) == len(ranks[1].epoch_plan(0))
    assert not set(seen) & set(one.eval_idx.tolist())
    ids = [one.ds[int(i)].sample_id for i in one.eval_idx]
    assert ids and set(ids) == heldout
    mixed = [int(i) for i in np.argsort(one.lengths)[[0, len(one.lengths) // 2, -1]]]  # three lengths: padding
    batch = one.collate(mixed)
    assert batch.lengths.tolist() == [int(one.lengths[i]) for i in mixed] and len(set(batch.lengths.tolist())) > 1
    for r, i in enumerate(mixed):
        s, n = one.ds[i], int(one.lengths[i])
        for got, want in ((batch.input_ids, s.input_ids), (batch.loss_mask, s.loss_mask.bool()),
                          (batch.aux_hidden, s.aux_hidden), (batch.final_hidden, s.final_hidden)):
            assert torch.equal(got[r, :n], want.to(got.dtype)) and not got[r, n:].any()


def test_overfits_one_batch(drafter, features_run):
    """On one small batch the drafter learns the target's argmax: > 95% step-0 accuracy on the positions it
    trains on (target argmax in the draft vocab; elsewhere no draft can match)."""
    cfg = load_config(features_run[0])
    data = FeatureData(cfg.layout.features, heldout_ids(read_split(cfg.layout.split)), 512, seed=0, rank=0, world=1)
    b = data.collate(data.epoch_plan(0)[0][:8])
    info = load_target_info(cfg.target.path)
    teacher = Teacher.from_target(cfg.target.path, info.text_config, "post_norm", drafter.t2d, torch.device("cpu"),
                                  torch.float32)(b.final_hidden)
    torch.manual_seed(0)
    model = Eagle3Drafter(drafter.config, drafter.d2t, drafter.t2d)
    model.embed_tokens.weight.data.copy_(load_target_tensors(cfg.target.path, ["embed"])["embed"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        r = ttt.ttt_unroll(model, b.input_ids, b.aux_hidden, b.loss_mask, b.lengths, teacher, 2, 0.8)
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    trained = ttt._shift(b.loss_mask, 2, False) & ttt._shift(teacher.in_vocab, 1, False)
    assert int(trained.sum()) > 40
    assert float(r.correct[0]) / int(trained.sum()) > 0.95
    assert int(r.counted[0]) > int(trained.sum())  # acceptance counts the out-of-vocab positions as misses


def test_activation_checkpointing_gives_the_same_gradients(drafter):
    torch.manual_seed(2)
    ids = torch.randint(0, drafter.config.vocab_size, (2, 24))
    aux = torch.randn(2, 24, 3 * drafter.config.target_hidden_size)
    grads = []
    for flag in (False, True):
        drafter.activation_checkpointing = flag
        hidden, past, total = aux, [], 0
        for j in range(3):
            out = drafter(ttt._shift(ids, j + 1), hidden, torch.arange(24)[None] + j, past)
            hidden, past = out.hidden, past + [(out.key, out.value)]
            total = total + out.logits.square().mean()
        total.backward()
        grads.append(drafter.fc.weight.grad.clone())
        drafter.zero_grad()
    drafter.activation_checkpointing = False
    torch.testing.assert_close(grads[0], grads[1])


class _Float32HeadSized(TorchDispatchMode):
    """Counts the new tensors (not in-place results) of the head's weight size ([draft vocab, H]) in float32."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)]
        self.count += (isinstance(out, torch.Tensor) and out.shape == self.shape and out.dtype == torch.float32
                       and not any(out.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in inputs))
        return out


@pytest.mark.parametrize("chunk_rows", [7, None], ids=["several chunks", "one chunk"])
def test_recomputed_logits_give_the_same_loss_and_gradients_and_keep_nothing_vocab_sized(drafter, monkeypatch,
                                                                                         chunk_rows):
    """train.recompute_logits: the head scores its logits without keeping their gradient, which is 28% of what a
    llama3-8b unroll keeps (tests/benchmarks/saved_activations.py); loss and every gradient are unchanged. Its
    backward makes the head's gradient in the weight's dtype: a float32 [vocab, H] sum only over several chunks
    (three such temporaries per step were 1.47 GiB of a llama3-8b backward's peak: step_memory.py)."""
    from train import fused
    if chunk_rows:
        monkeypatch.setattr(fused, "CHUNK_ELEMENTS", chunk_rows * drafter.config.draft_vocab_size)
    bf16_head = drafter.lm_head.to(torch.bfloat16)  # in the training dtype: the weight's dtype is not float32
    x = torch.randn(20, drafter.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.softmax(torch.randn(1, 20, drafter.config.draft_vocab_size), -1).bfloat16()
    bf16_grads, float32_head_sized_made = [], {}
    for recompute in (False, True):
        bf16_head.recompute_logits = recompute
        loss, _ = bf16_head(x[None], probs, torch.ones(1, 20, dtype=torch.bool), 0)
        with _Float32HeadSized(bf16_head.weight.shape) as float32_head_sized:
            (0.3 * loss).backward()  # a loss scale, as the TTT decay and DeepSpeed's accumulation apply
        float32_head_sized_made[recompute] = float32_head_sized.count
        bf16_grads.append((x.grad, bf16_head.weight.grad))
        x.grad = bf16_head.weight.grad = None
    bf16_head.recompute_logits = False
    drafter.lm_head.float()
    assert float32_head_sized_made[True] == (1 if chunk_rows else 0)  # the chunks' sum; none for one chunk
    for default, recomputed in zip(*bf16_grads):
        torch.testing.assert_close(recomputed, default, atol=1e-3, rtol=2e-2)  # bf16 roundings differ
    torch.manual_seed(3)
    cfg, B, T = drafter.config, 3, 20
    teacher = Teacher(torch.randn(cfg.vocab_size, cfg.target_hidden_size), drafter.t2d)(
        torch.randn(B, T, cfg.target_hidden_size))
    ids, aux = torch.randint(0, cfg.vocab_size, (B, T)), torch.randn(B, T, 3 * cfg.target_hidden_size)
    lengths, loss_mask = torch.tensor([T, 13, 7]), torch.rand(B, T) > 0.2
    runs = []
    for recompute in (False, True):
        drafter.lm_head.recompute_logits = recompute
        shared = {drafter.lm_head.weight.untyped_storage().data_ptr(), teacher.probs.untyped_storage().data_ptr()}
        vocab_sized = set()  # storages kept for backward per step, beyond the head's weight and the teacher's probs

        def pack(t):
            if t.dim() and t.shape[-1] == cfg.draft_vocab_size and t.untyped_storage().data_ptr() not in shared:
                vocab_sized.add(t.untyped_storage().data_ptr())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ttt.ttt_unroll(drafter, ids, aux, loss_mask, lengths, teacher, 5, 0.8)
        out.loss.backward()
        runs.append((out.loss.detach(), out.correct, {n: p.grad.clone() for n, p in drafter.named_parameters()
                                                      if p.grad is not None}, len(vocab_sized)))
        drafter.zero_grad()
    drafter.lm_head.recompute_logits = False  # the fixture is shared
    (loss, correct, grads, kept), (loss_r, correct_r, grads_r, kept_r) = runs
    torch.testing.assert_close(loss_r, loss)
    assert torch.equal(correct_r, correct)  # the same logits reach the accuracy counts
    assert grads.keys() == grads_r.keys() and "lm_head.weight" in grads
    for name in grads:
        torch.testing.assert_close(grads_r[name], grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert kept == 5 and kept_r == 0  # the default keeps a logits gradient per step; recomputing keeps none


def test_warm_start_from_an_exported_drafter(drafter, features_run, tmp_path):
    from train.engine import warm_start
    target = load_config(features_run[0]).target.path
    exported = {k: v.clone() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    save_file(exported, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}))
    fresh = Eagle3Drafter(drafter.config, drafter.d2t, drafter.t2d)
    loaded = warm_start(fresh, tmp_path, target)
    assert "midlayer.self_attn.q_proj.weight" in loaded and "embed_tokens.weight" not in loaded
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in exported.items())
    save_file(exported | {"d2t": torch.roll(drafter.d2t, 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t differs"):
        warm_start(fresh, tmp_path, target)
    save_file(exported | {"midlayer.extra.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="midlayer.extra.weight"):
        warm_start(fresh, tmp_path, target)
    save_file(exported, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}))
    with pytest.raises(ValueError, match=r"ids \[3\] outside 0..3|last layer's output"):
        warm_start(fresh, tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 1]}}))
    with pytest.raises(ValueError, match=r"do not name the layers this run's shards hold, \[0, 1, 2\]"):
        warm_start(fresh, tmp_path, target)


def test_a_warm_start_keeps_the_drafters_rope_and_norm_settings(drafter, tmp_path):
    """A published drafter trained at rope_theta 1e6 with YaRN and eps 1e-6, warm-started for a target at 50000
    and 1e-5: its own settings are kept (they are what its weights compute with), each change stated; a configured
    train.drafter.rms_norm_eps decides the epsilon."""
    from transformers import LlamaConfig

    from train.engine import warm_start_config
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps({"rope_theta": 1e6, "rope_scaling": yarn, "rms_norm_eps": 1e-6}))
    config = LlamaConfig(**drafter.config.to_dict() | {"rope_parameters": {"rope_type": "default",
                                                                          "rope_theta": 50000.0}, "rms_norm_eps": 1e-5})
    notes = warm_start_config(config, tmp_path, rms_norm_eps=None)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == 4.0 and config.rms_norm_eps == 1e-6
    assert len(notes) == 2 and "the target's is" in notes[0] and notes[1].startswith("rms_norm_eps 1e-06")
    Eagle3Drafter(config, drafter.d2t, drafter.t2d)  # the drafter builds with them
    configured = LlamaConfig(**drafter.config.to_dict() | {"rms_norm_eps": 2e-6})
    notes = warm_start_config(configured, tmp_path, rms_norm_eps=2e-6)
    assert configured.rms_norm_eps == 2e-6 and "train.drafter.rms_norm_eps" in notes[-1]
    assert warm_start_config(config, tmp_path, rms_norm_eps=None) == []  # already the drafter's: nothing to say


def test_a_warm_start_keeps_the_drafters_eagle31_options(drafter, tmp_path):
    """A drafter published with fc_norm (under its legacy name) and norm_output continues with them; an option
    the run's config adds is kept and said."""
    from transformers import LlamaConfig

    from train.engine import warm_start_config
    (tmp_path / "config.json").write_text(json.dumps({"use_aux_norm": True, "norm_output": True}))
    config = LlamaConfig(**drafter.config.to_dict())
    notes = warm_start_config(config, tmp_path, rms_norm_eps=None)
    assert eagle31_options(config) == {"fc_norm": True, "norm_output": True} and len(notes) == 2, notes
    assert Eagle3Drafter(config, drafter.d2t, drafter.t2d).fc_norm is not None
    (tmp_path / "config.json").write_text(json.dumps({}))
    added = LlamaConfig(**drafter.config.to_dict() | {"fc_norm": True})
    assert warm_start_config(added, tmp_path, rms_norm_eps=None) == [
        "fc_norm added (train.drafter.fc_norm; the drafter had none; its norms start at weight 1)"]
    assert eagle31_options(added)["fc_norm"]
