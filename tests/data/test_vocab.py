import pytest
import torch

from data.vocab import TokenCounter, build_draft_vocab, check_draft_vocab, load_draft_vocab, save_draft_vocab


def test_counts_only_loss_masked_tokens():
    c = TokenCounter(10)
    c.add([1, 2, 2, 3, 9], [0, 1, 1, 0, 1])
    assert c.counts.tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="token id 12 >= target vocab size 10"):
        c.add([12], [1])


def test_top_n_with_deterministic_ties_and_mapping_invariants():
    counts = torch.tensor([5, 0, 7, 5, 5, 1, 0, 9])
    d2t, t2d = build_draft_vocab(counts, 4)
    kept = torch.arange(4) + d2t
    # 9 (id 7), 7 (id 2), then the tie among ids 0, 3, 4 at count 5 goes to the lowest id 0.
    assert kept.tolist() == [0, 2, 3, 7]
    assert t2d.tolist() == [True, False, True, True, False, False, False, True]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    check_draft_vocab(d2t, t2d)
    assert torch.equal(build_draft_vocab(counts, 4)[0], d2t)  # deterministic


def test_random_vocab_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (1000,), generator=g)
    info = save_draft_vocab(tmp_path / "v.safetensors", counts, 100)
    d2t, t2d = load_draft_vocab(tmp_path / "v.safetensors")
    target_ids = torch.arange(100) + d2t
    assert torch.all(target_ids[1:] > target_ids[:-1]) and t2d[target_ids].all() and int(t2d.sum()) == 100
    # every kept token is at least as frequent as every dropped one
    assert counts[t2d].min() >= counts[~t2d].max()
    assert 0 < info["coverage"] <= 1 and info["loss_tokens_counted"] == int(counts.sum())


def test_inconsistent_mapping_is_refused():
    d2t, t2d = build_draft_vocab(torch.arange(10), 3)
    t2d[0] = True
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        check_draft_vocab(d2t, t2d)
    with pytest.raises(ValueError, match="draft_vocab_size 11"):
        build_draft_vocab(torch.arange(10), 11)
