"""sftprof.data: fake sample layout, micro-batch split, cp_shard indices."""
import pytest
import torch

from sftprof.config import load_config
from sftprof.data import (FAKE_CONVERSATION, PAD_LABEL, cp_shard, dp_rank_sample_ids,
                          global_loss_tokens, loss_start, make_fake_sample, n_micro_batches,
                          split_micro_batches, step_micro_batches)
from sftprof.tokenizer import load_tokenizer

V = 151936


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("", "tiny_qwen3_moe", "qwen3_moe")


def test_conversation_is_chatml_code_repair(qwen3):
    ids = qwen3.encode(FAKE_CONVERSATION)
    assert ids[0] == 151644                       # <|im_start|>
    assert ids.count(151644) == ids.count(151645) == 5
    for special in (151657, 151658, 151665, 151666):  # tool call + tool response markers
        assert ids.count(special) == 1
    assert "```python" in FAKE_CONVERSATION


@pytest.mark.parametrize("seq_len,ratio", [(2, 0.0), (2, 0.9), (3, 0.5), (415, 0.5), (1000, 0.25), (4097, 0.999)])
def test_fake_sample_lengths_labels_and_mask(qwen3, seq_len, ratio):
    ids = qwen3.encode(FAKE_CONVERSATION)
    s = make_fake_sample(qwen3, seq_len, ratio, V)
    assert s.input_ids.shape == s.labels.shape == s.loss_mask.shape == (seq_len,)
    assert s.input_ids.dtype == s.labels.dtype == torch.int64 and s.loss_mask.dtype == torch.bool
    assert s.input_ids.tolist() == [ids[k % len(ids)] for k in range(seq_len)]
    assert s.labels[:-1].tolist() == s.input_ids[1:].tolist() and int(s.labels[-1]) == PAD_LABEL
    b = min(max(int(seq_len * ratio), 1), seq_len - 1)
    assert loss_start(seq_len, ratio) == b
    # Token t >= b is a target; position i predicts token i + 1.
    expected = [b <= i + 1 <= seq_len - 1 for i in range(seq_len)]
    assert s.loss_mask.tolist() == expected
    assert int(s.loss_mask.sum()) == seq_len - b >= 1
    assert not bool(s.loss_mask[-1])


def test_fake_sample_is_deterministic_and_checks_vocab(qwen3):
    a, b = make_fake_sample(qwen3, 700, 0.5, V), make_fake_sample(qwen3, 700, 0.5, V)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    with pytest.raises(ValueError, match="vocab_size"):
        make_fake_sample(qwen3, 64, 0.5, 1000)
    with pytest.raises(ValueError, match="fake_seq_len"):
        make_fake_sample(qwen3, 1, 0.5, V)


def test_dp_rank_sample_ids():
    # Global batch 8, dp 2: step 1 covers samples 8..15 (mod dataset size 12).
    assert dp_rank_sample_ids(1, 8, 2, 0, 12) == [8, 9, 10, 11]
    assert dp_rank_sample_ids(1, 8, 2, 1, 12) == [0, 1, 2, 3]
    assert dp_rank_sample_ids(0, 4, 4, 3, 8) == [3]
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        dp_rank_sample_ids(0, 6, 4, 0, 8)


def test_n_micro_batches():
    assert n_micro_batches(4, 100, 2, 1, 0) == 2
    assert n_micro_batches(4, 100, 1, 1, 200) == 2        # 2 sequences fit in 200 tokens
    with pytest.raises(ValueError, match="n_mbs_divisor=2: 6 micro-batches needed, but a data-parallel rank has only 5"):
        n_micro_batches(5, 100, 1, 2, 100)                 # 5 needed, divisor 2 -> 6 > 5 sequences
    assert n_micro_batches(6, 100, 1, 4, 0) == 4          # rounded up to the divisor
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        n_micro_batches(2, 100, 1, 1, 50)
    with pytest.raises(ValueError, match="n_mbs"):
        n_micro_batches(2, 100, 3, 1, 0)


def test_split_micro_batches(qwen3):
    s = make_fake_sample(qwen3, 32, 0.5, V)
    mbs = split_micro_batches(s, [5, 6, 7, 0, 1], 2)
    assert [mb.sample_ids for mb in mbs] == [(5, 6, 7), (0, 1)]
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(3, 32), (2, 32)]
    assert mbs[1].n_tokens == 64
    for mb in mbs:
        assert all(torch.equal(row, s.input_ids) for row in mb.input_ids)
        assert all(torch.equal(row, s.loss_mask) for row in mb.loss_mask)


def test_step_micro_batches_from_config(qwen3):
    cfg = load_config("tiny_cpu", ["train_dataset.batch_size=8", "actor.mb_spec.n_mbs=2", "profile.fake_seq_len=64",
                                   "profile.fake_dataset_size=6",
                                   "actor.mb_spec.max_tokens_per_mb=128"])
    s = make_fake_sample(qwen3, 64, 0.5, V)
    mbs = step_micro_batches(cfg, s, step=1, dp=2, dp_rank=1)
    assert [mb.sample_ids for mb in mbs] == [(0, 1), (2, 3)]   # samples 12..15 mod 6
    # The preset's max_tokens_per_mb = fake_seq_len allows one sequence per micro-batch.
    cfg.actor.mb_spec.max_tokens_per_mb = 64
    assert [mb.sample_ids for mb in step_micro_batches(cfg, s, 1, 2, 1)] == [(0,), (1,), (2,), (3,)]
    assert global_loss_tokens(s, 8) == 8 * (64 - 32)


def test_cp_shard_exact_indices():
    t = torch.arange(16).view(1, 16)
    assert cp_shard(t, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert cp_shard(t, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert cp_shard(t, 4, 0).tolist() == [[0, 1, 14, 15]]
    assert cp_shard(t, 4, 3).tolist() == [[6, 7, 8, 9]]
    assert cp_shard(t, 1, 0) is t
    # Another dim, and every position appears exactly once over the CP ranks.
    x = torch.arange(24).view(24, 1)
    parts = [cp_shard(x, 3, r, dim=0) for r in range(3)]
    assert parts[1].flatten().tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert sorted(torch.cat(parts).flatten().tolist()) == list(range(24))
    with pytest.raises(ValueError, match="divisible by 2"):
        cp_shard(torch.arange(10).view(1, 10), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_shard(t, 2, 2)
