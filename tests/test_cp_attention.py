"""CPU tests of the context-parallel attention chunking (sftprof.models.attention), fp64 references.

A single process simulates every CP rank: each rank's load-balanced query chunks (sftprof.data.cp_shard)
attend to the full K/V with cp_causal_attention; outputs and the summed K/V gradients must equal full
causal attention.
"""
import pytest
import torch

from sftprof.data import cp_chunk_ids, cp_shard
from sftprof.models.attention import cp_causal_attention, natural_to_rank_order, rank_order_to_natural


def _reference(q, k, v):
    # explicit fp64 causal attention with GQA expansion (independent of SDPA)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def test_chunk_ids_and_orders():
    assert [cp_chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = torch.arange(16)
    gathered = torch.cat([cp_shard(x[None], 4, r, dim=1)[0] for r in range(4)])
    assert gathered.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert torch.equal(rank_order_to_natural(gathered, 4), x)
    assert torch.equal(natural_to_rank_order(x, 4), gathered)
    with pytest.raises(ValueError, match="cp_rank 4"):
        cp_chunk_ids(4, 4)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_cp_causal_attention_matches_full_fp64(cp_size, heads, kv_heads):
    torch.manual_seed(cp_size * 10 + kv_heads)
    b, s, d = 2, 48, 16
    q = torch.randn(b, heads, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, heads, s, d, dtype=torch.float64)
    ref = _reference(q, k, v)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), dout)

    q_grad = torch.zeros_like(q)
    k_grad, v_grad = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp_size):
        q_loc = cp_shard(q.detach(), cp_size, r, dim=2).requires_grad_()
        k_full, v_full = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        out = cp_causal_attention(q_loc, k_full, v_full, cp_size=cp_size, cp_rank=r)
        torch.testing.assert_close(out, cp_shard(ref.detach(), cp_size, r, dim=2), rtol=1e-10, atol=1e-10)
        dq, dk, dv = torch.autograd.grad(out, (q_loc, k_full, v_full), cp_shard(dout, cp_size, r, dim=2))
        # scatter this rank's query grads back to their natural positions; K/V grads sum over ranks
        idx = cp_shard(torch.arange(s)[None], cp_size, r, dim=1)[0]
        q_grad[:, :, idx] = dq
        k_grad += dk
        v_grad += dv
    torch.testing.assert_close(q_grad, gq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(k_grad, gk, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(v_grad, gv, rtol=1e-10, atol=1e-10)


def test_cp_causal_attention_rejects_bad_shapes():
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="must equal keys"):
        cp_causal_attention(q, k, k, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="as many queries as keys"):
        cp_causal_attention(q, k, k, cp_size=1, cp_rank=0)
