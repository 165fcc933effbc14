"""On CUDA: the fused (flex) TTT attention equals the blockwise one in values and gradients (bf16)."""
import pytest
import torch

from train import ttt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: flex attention's backward (compiled kernels) was not run")]


@pytest.mark.parametrize("T", [256, 1000])  # 1000: not a multiple of flex's 128-wide blocks
def test_flex_matches_blockwise_with_gradients(T):
    torch.manual_seed(0)
    leaves = [torch.randn(1, 8, T, 64, device="cuda", dtype=torch.bfloat16)] + \
        [torch.randn(1, 2, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    results = []
    for backend in ("flex", "blockwise"):
        q, *kv = [t.clone().requires_grad_() for t in leaves]
        out = ttt.ttt_attention(q, kv[:4], kv[4:], 0.125, backend)
        out.float().pow(2).sum().backward()
        results.append([out] + [t.grad for t in (q, *kv)])
    assert not ttt._FLEX_FAILED
    for name, a, b in zip(["out", "q", "k0", "k1", "k2", "k3", "v0", "v1", "v2", "v3"], *results):
        error = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert error < 1e-2, (name, error)  # bf16: both round the probabilities to 8 bits


def test_new_lengths_do_not_recompile_every_time():
    """Batches come in many lengths and batch sizes: flex runs at bucketed lengths (ttt.flex_length) with a
    dynamic batch dim and the fused functions are compiled for dynamic shapes, so new shapes in a bucket
    compile nothing new (each compile costs seconds)."""
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig

    from train.drafter import Eagle3Drafter
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=512, vocab_size=1000, draft_vocab_size=300, target_hidden_size=256,
                         num_hidden_layers=1, max_position_embeddings=4096)
    model = Eagle3Drafter(config, torch.zeros(300, dtype=torch.int64), torch.ones(1000, dtype=torch.bool))
    model = model.to("cuda", torch.bfloat16)
    model.set_attention("flex")
    graphs = []
    for B, T in ((2, 1100), (3, 1300), (5, 1700), (2, 1900), (4, 2048)):  # one flex bucket: 2048
        ids = torch.randint(0, 300, (B, T), device="cuda")
        hidden, past = torch.randn(B, T, 768, device="cuda", dtype=torch.bfloat16), []
        loss = 0
        for j in range(3):
            out = model(ids, hidden, torch.arange(T, device="cuda")[None].expand(B, T) + j, past)
            hidden, past = out.hidden, past + [(out.key, out.value)]
            loss = loss + out.logits.float().pow(2).mean()
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    print("compiled graphs after each shape:", graphs)
    assert not ttt._FLEX_FAILED
    assert graphs[-1] == graphs[1], graphs
