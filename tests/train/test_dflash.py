"""The DFlash block drafter against an independent written-out reference, and its export against SGLang's own
`DFlashDraftModel` loader."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from data.target import load_target_info
from serve import dflash_dir
from serve.drafter_dir import DrafterDirError
from tests.serve.test_export import needs_sglang
from train.dflash import DFlashDrafter, dflash_config


@pytest.fixture(scope="module")
def drafter(tiny_target):
    config = dflash_config(load_target_info(tiny_target), num_layers=2, layer_ids=[0, 1, 2], block_size=4,
                           mask_token_id=5, num_key_value_heads=2)
    torch.manual_seed(0)
    model = DFlashDrafter(config)
    for p in model.parameters():  # norms away from 1 so the test sees them
        torch.nn.init.normal_(p, mean=1.0, std=0.3) if p.dim() == 1 else None
    return model


def reference_block(w: dict, cfg, block: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                    ctx_pos: torch.Tensor) -> torch.Tensor:
    """One sequence's block written out from the weights: explicit heads, full score matrices, no masks."""
    d, heads, kv_heads, eps = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # [T, heads, d], rotate-half
        inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos[:, None].double() * inv[None]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float()
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    c = rms(ctx @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = block
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])

        def keys(t, pos):
            k = (t @ w[p + "self_attn.k_proj.weight"].T).view(len(t), kv_heads, d)
            return rope(rms(k, w[p + "self_attn.k_norm.weight"]), pos)
        q = rope(rms((x @ w[p + "self_attn.q_proj.weight"].T).view(len(x), heads, d), w[p + "self_attn.q_norm.weight"]),
                 block_pos)
        k = torch.cat([keys(c, ctx_pos), keys(x, block_pos)])  # the context never passes through the layer
        v = torch.cat([c, x]) @ w[p + "self_attn.v_proj.weight"].T
        v = v.view(len(k), kv_heads, d)
        out = torch.cat([torch.softmax(q[:, j] @ k[:, j // (heads // kv_heads)].T / d ** 0.5, -1)
                         @ v[:, j // (heads // kv_heads)] for j in range(heads)], -1)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        y = rms(h, w[p + "post_attention_layernorm.weight"])
        h = h + (torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"])


def test_a_block_matches_the_written_out_reference(drafter):
    """A block of 4 at positions 9..12 over the 9 context positions before it, batch 2; and with a mask that hides
    part of the context from one sequence, its output is the reference's over the visible part only."""
    cfg, H = drafter.config, drafter.config.hidden_size
    torch.manual_seed(1)
    block, ctx = torch.randn(2, 4, H), torch.randn(2, 9, 3 * H)
    block_pos, ctx_pos = torch.arange(9, 13)[None].expand(2, 4), torch.arange(9)[None].expand(2, 9)
    w = {k: v.detach() for k, v in drafter.state_dict().items()}
    with torch.no_grad():
        ours = drafter(block, block_pos, ctx, ctx_pos)
        for b in range(2):
            torch.testing.assert_close(ours[b], reference_block(w, cfg, block[b], block_pos[b], ctx[b], ctx_pos[b]),
                                       atol=2e-5, rtol=2e-4)
        visible = torch.ones(2, 4, 9 + 4, dtype=torch.bool)
        visible[1, :, 5:9] = False  # sequence 1's block sees context positions 0..4 only
        masked = drafter(block, block_pos, ctx, ctx_pos, visible)
        torch.testing.assert_close(masked[0], ours[0])
        torch.testing.assert_close(masked[1], reference_block(w, cfg, block[1], block_pos[1], ctx[1, :5], ctx_pos[1, :5]),
                                   atol=2e-5, rtol=2e-4)


def export(drafter, out):
    dflash_dir.write(out, drafter.config, {k: v for k, v in drafter.state_dict().items()}, "test")


def test_the_export_holds_exactly_sglangs_keys_and_names(drafter, tmp_path):
    export(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"target_layer_ids": [0, 1, 2], "block_size": 4, "mask_token_id": 5}
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert set(tensors) == set(dflash_dir.expected_shapes(drafter.config))
    assert "layers.1.self_attn.k_norm.weight" in tensors and not any("embed" in k or "lm_head" in k for k in tensors)
    with pytest.raises(DrafterDirError, match="unexpected tensor lm_head.weight"):
        dflash_dir.validate(drafter.config, tensors | {"lm_head.weight": torch.zeros(1)}, "d")
    del tensors["layers.0.self_attn.q_norm.weight"]
    with pytest.raises(DrafterDirError, match="missing tensor layers.0.self_attn.q_norm.weight"):
        dflash_dir.validate(drafter.config, tensors, "d")


@needs_sglang
def test_sglangs_own_dflash_class_loads_the_export(drafter, tmp_path):
    """SGLang's DFlashDraftModel on the CPU: every parameter written (NaN-filled first), every tensor read, and
    the block size and context width it built are the config's; a misnamed tensor is caught by its check."""
    from serve.sglang_check import check_in_subprocess
    export(drafter, tmp_path / "good")
    export(drafter, tmp_path / "bad")
    tensors = load_file(str(tmp_path / "bad" / "model.safetensors"))
    tensors["layers.0.mlp.up_projection.weight"] = tensors.pop("layers.0.mlp.up_proj.weight")
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    good, bad = check_in_subprocess(tmp_path / "good", tmp_path / "bad", raise_on_problem=False)
    assert good["ok"] and good["architecture"] == "DFlashDraftModel", good
    assert good["dflash"] == {"block_size": 4, "context_features": 3} and good["tensors_in_file"] == 25, good
    assert not bad["ok"] and "not written" in " ".join(bad["problems"]), bad


def test_anchors_are_positions_where_a_block_can_start_in_serving():
    """Anchor a needs tokens a and a + 1 in the loss (a token the target emitted, then one to draft) and a + 1
    inside the sample; at most `per_sample`, sorted, the rest marked as padding."""
    from train.dflash import sample_anchors
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    lengths = torch.tensor([10, 5])
    anchors, keep = sample_anchors(loss_mask, lengths, per_sample=8, generator=torch.Generator().manual_seed(0))
    assert anchors[0][keep[0]].tolist() == [2, 3, 6] and anchors[1][keep[1]].tolist() == [1, 2, 3]
    few, keep_few = sample_anchors(loss_mask, lengths, per_sample=2, generator=torch.Generator().manual_seed(0))
    assert few.shape == (2, 2) and keep_few.all() and set(few[0].tolist()) <= {2, 3, 6} and few[0, 0] < few[0, 1]


def test_each_block_sees_its_own_block_and_the_context_before_its_anchor():
    from train.dflash import block_visibility
    visible = block_visibility(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), context_len=5, block_size=2)
    assert visible.shape == (1, 4, 9)
    assert visible[0].int().tolist() == [[1, 0, 0, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 1, 1, 0, 0],
                                         [1, 1, 1, 0, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 1, 1]]
    padded = block_visibility(torch.tensor([[1, 0]]), torch.tensor([[True, False]]), 5, 2)[0, 2:]
    assert padded.int().tolist() == [[0, 0, 0, 0, 0, 0, 0, 1, 1]] * 2  # a padding block sees only itself


def test_flex_attention_gives_the_dense_masks_loss(drafter, monkeypatch):
    """attention: flex (train.attention: flex) against the dense mask through SDPA (the default), on a batch of
    three samples of different lengths and loss spans (one with fewer anchors than blocks: padding blocks) and
    grouped-query heads: the same loss and accept counts. Forward only: flex has no backward on the CPU
    (tests/gpu/test_dflash_loss.py compares gradients with Inductor's kernel on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    from train import ttt
    from train.dflash import dflash_objective
    monkeypatch.setattr(ttt, "_compiled_flex", lambda: flex_attention)
    cfg = drafter.config
    g = torch.Generator().manual_seed(0)
    V, H, K, B, T = 40, cfg.hidden_size, len(cfg.dflash_config["target_layer_ids"]), 3, 37
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    ids, aux = torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, K * H, generator=g)
    lengths = torch.tensor([37, 30, 9])
    loss_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    loss_mask[1, :12] = 0  # a prompt: no anchor before it

    def run(attention: str, blocks_seed: int = 1):
        with torch.no_grad():
            return dflash_objective(drafter, embed, head, ids, aux, loss_mask, lengths, blocks_per_sample=10,
                                    gamma=7.0, generator=torch.Generator().manual_seed(blocks_seed),
                                    attention=attention)
    flex, dense = run("flex"), run("dense")
    assert int(flex.blocks) == 10 + 10 + 8 == int(dense.blocks)  # sample 2 has 8 anchors: 2 padding blocks
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-5, atol=1e-6)
    assert flex.correct.tolist() == dense.correct.tolist() and int(flex.accepted) == int(dense.accepted)
    other = run("flex", blocks_seed=2).loss  # other blocks, another loss: the comparison above is not vacuous
    assert abs(other.item() - flex.loss.item()) > 1e-4


def test_flex_visibility_skips_the_tiles_no_query_sees():
    """At a training shape (64 blocks of 16 over a 2k context), the block mask flex runs leaves most 128 x 128
    tiles out, where the dense mask makes SDPA score all of them: the kernel's work follows what is visible."""
    from train.dflash import SparseVisibility, block_visibility, sample_anchors
    T, N, bs = 2048, 64, 16
    anchors, keep = sample_anchors(torch.ones(1, T, dtype=torch.long), torch.tensor([T]), N,
                                   torch.Generator().manual_seed(0))
    sparse = SparseVisibility(anchors, keep, T, bs)
    visible = block_visibility(anchors, keep, T, bs).float().mean().item()  # the share of (query, key) pairs seen
    computed = 100 - sparse.mask.sparsity()  # % of tiles the kernel runs (here 41%; 33% of the pairs are seen)
    assert visible < 0.35 and computed < 45, (visible, computed)


def test_the_objective_learns_a_batch(features_run):
    """On one small batch of the test run's features (three aux layers, the tiny target's embedding and head),
    block drafting learns the sample's next tokens: position 1 of the blocks > 90% right, and the greedy accept
    length of a block of 4 goes from 1 to over 3.5."""
    from data.config import load_config
    from data.split import heldout_ids, read_split
    from data.target import load_target_tensors
    from train.dflash import dflash_objective
    from train.loader import FeatureData
    cfg = load_config(features_run[0])
    data = FeatureData(cfg.layout.features, heldout_ids(read_split(cfg.layout.split)), 512, seed=0, rank=0, world=1)
    b = data.collate(data.epoch_plan(0)[0][:8])
    target = load_target_tensors(cfg.target.path, ["embed", "lm_head"])
    config = dflash_config(load_target_info(cfg.target.path), num_layers=1, layer_ids=[0, 1, 2], block_size=4,
                           mask_token_id=3)
    torch.manual_seed(0)
    model = DFlashDrafter(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    first = None
    for _ in range(200):
        r = dflash_objective(model, target["embed"], target["lm_head"], b.input_ids, b.aux_hidden, b.loss_mask,
                             b.lengths, blocks_per_sample=16, gamma=7.0, generator=gen)
        first = first or r.accept_length
        opt.zero_grad()
        r.loss.backward()
        opt.step()
    assert int(r.counted[1]) > 50 and int(r.counted[0]) == 0  # the anchor itself is never scored
    assert float(r.correct[1]) / int(r.counted[1]) > 0.9, r
    assert first < 1.3 and r.accept_length > 3.5, (first, r.accept_length)  # 1.0 → 3.90 of at most 4 here


def test_teacher_labels_are_the_targets_next_token_distribution(features_run):
    """train.dflash.labels: teacher. With a teacher sharpened to one-hot (its head x 1000), soft labels give the
    loss hard labels give on a sample whose tokens are the teacher's argmax; with the target's own teacher the loss
    differs and trains the drafter. Read through the family builder, as train/main.py does."""
    from data.config import load_config
    from data.split import heldout_ids, read_split
    from data.target import load_embedding_and_head
    from train.dflash import dflash_objective
    from train.families import dflash as dflash_family
    from train.loader import FeatureData
    from train.teacher import Teacher
    cfg = load_config(features_run[0], ["--train.drafter.family", "dflash", "--train.dflash.labels", "teacher",
                                        "--train.dflash.block_size", "4", "--target.aux_layer_ids", "[0, 1, 2]"])
    data = FeatureData(cfg.layout.features, heldout_ids(read_split(cfg.layout.split)), 512, seed=0, rank=0, world=1)
    b = data.collate(data.epoch_plan(0)[0][:4])
    torch.manual_seed(0)
    family = dflash_family(cfg, data, torch.device("cpu"), torch.float32)
    r = family.step(family.model, b)
    r.loss.backward()
    assert torch.isfinite(r.loss) and all(p.grad is not None for p in family.model.fc.parameters())
    embed, head = (t.float() for t in load_embedding_and_head(cfg.target.path))
    vocab = torch.ones(head.shape[0], dtype=torch.bool)
    sharp = Teacher(head * 1000, vocab)  # one-hot at the target's argmax
    following = sharp(b.final_hidden).target_ids
    ids = torch.cat([b.input_ids[:, :1], following[:, :-1]], 1)  # each token the teacher's choice after the last

    def loss(**teacher):
        return dflash_objective(family.model, embed, head, ids, b.aux_hidden, b.loss_mask, b.lengths, 8, 7.0,
                                torch.Generator().manual_seed(1), **teacher).loss.item()
    hard = loss()
    assert loss(teacher=sharp, final_hidden=b.final_hidden) == pytest.approx(hard, rel=1e-4)
    assert abs(loss(teacher=Teacher(head, vocab), final_hidden=b.final_hidden) - hard) > 1e-3


def test_a_dflash_drafter_trains_with_deepspeed_and_exports_for_sglang(features_run, tmp_path):
    """train.drafter.family: dflash through train/main.py on two gloo ranks (DeepSpeed ZeRO-2, the same
    checkpoints and logs as EAGLE-3), then serve.export: the held-out block loss falls (the same blocks at every
    evaluation), and the export is what SGLang's DFlashDraftModel loads (when installed)."""
    from serve.export import export as export_run
    from tests.serve.test_export import HAVE_SGLANG
    from tests.train_runs import finish, launch, with_run_dir
    run = tmp_path / "run"
    finish(launch(with_run_dir(features_run, run), "--train.drafter.family", "dflash", "--train.dflash.block_size",
                  "4", "--train.dflash.mask_token_id", "3", "--train.dflash.blocks_per_sample", "16"))
    rows = [json.loads(line) for line in (run / "train" / "log.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "eval"]
    assert len(evals) == 3 and evals[-1]["loss"] < 0.95 * evals[0]["loss"], evals  # 5.71 → 5.29 in 12 steps
    assert {"acc_pos1", "acc_pos3", "blocks"} <= set(evals[-1])
    report = export_run(run, "latest", tmp_path / "drafter", check_with_sglang=HAVE_SGLANG)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [0, 1, 2] and config["dflash_config"]["mask_token_id"] == 3
    if HAVE_SGLANG:
        assert report["sglang_check"]["ok"] and report["sglang_check"]["dflash"]["block_size"] == 4, report
    from serve.drafter_dir import DrafterDirError
    from serve.export import untrained_like
    with pytest.raises(DrafterDirError, match="EAGLE-3 drafters only"):  # export --untrained-out on a DFlash run
        untrained_like(tmp_path / "drafter", tmp_path / "twin")
    # the reference decoder drafts by blocks and stays lossless: every output is the target's own greedy one
    from serve.decode import run as decode
    prompts = [[{"role": "user", "content": text}] for text in ("Count to five.", "Name a bird.", "Add 2 and 3.")]
    decoded = decode(json.loads((run / "train" / "summary.json").read_text())["config"]["target"]["path"],
                     str(tmp_path / "drafter"), prompts, max_new=24, device="cpu")
    assert decoded["identical_to_greedy"] and decoded["chain"] == "reference decoder, DFlash blocks of 4 (3 drafts)"
    assert 1.0 <= decoded["accept_length"] <= 4.0 and decoded["verify_calls"] <= decoded["completion_tokens"]


def test_flex_attention_for_dflash_off_cuda_is_refused_by_its_key(features_run):
    """train.attention: flex has no backward off CUDA: the family refuses it before any step, naming the key."""
    from data.config import load_config
    from data.split import heldout_ids, read_split
    from train.families import dflash as dflash_family
    from train.loader import FeatureData
    cfg = load_config(features_run[0], ["--train.drafter.family", "dflash", "--train.attention", "flex",
                                        "--train.dflash.block_size", "4", "--target.aux_layer_ids", "[0, 1, 2]"])
    data = FeatureData(cfg.layout.features, heldout_ids(read_split(cfg.layout.split)), 512, seed=0, rank=0, world=1)
    with pytest.raises(ValueError, match="train.attention: flex needs CUDA"):
        dflash_family(cfg, data, torch.device("cpu"), torch.float32)
