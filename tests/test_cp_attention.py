"""CPU tests of the context-parallel attention chunking (sftprof.models.layers.attention), fp64 references.

A single process simulates every CP rank: each rank's load-balanced query chunks (sftprof.data.cp_shard)
attend to the full K/V with cp_causal_attention, by both methods ("masked": one SDPA call per chunk;
"blocks": diagonal + off-diagonal blocks merged by log-sum-exp, sftprof.models.layers.block_attention with its
math kernel); outputs, query gradients and the K/V gradients summed over ranks must equal full causal
attention.
"""
import pytest
import torch

from sftprof.data import cp_chunk_ids, cp_shard
from sftprof.config import PRESET_DIR, ConfigError, load_config
from sftprof.models.layers import attention, block_attention
from sftprof.models.layers.attention import (SDPACoreAttention, check_cp_attention, cp_causal_attention,
                                      forward_chunks_skip_reason, natural_to_rank_order, rank_order_to_natural)
from sftprof.models.layers.block_attention import (BLOCK_KERNELS, blockwise_cp_attention, chunk_blocks,
                                            chunked_causal_attention, kernel_input, merge_partials,
                                            with_output_layout)


def _fp64_inputs(seed: int, b: int, heads: int, kv_heads: int, s: int, d: int):
    """``(q [b, heads, s, d], k, v [b, kv_heads, s, d] requiring grad, dout [b, heads, s, d])``, fp64, seeded."""
    torch.manual_seed(seed)
    q = torch.randn(b, heads, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, dtype=torch.float64, requires_grad=True)
    return q, k, v, torch.randn(b, heads, s, d, dtype=torch.float64)


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


@pytest.mark.parametrize("method", ["masked", "blocks"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_cp_causal_attention_matches_full_fp64(cp_size, heads, kv_heads, method):
    b, s, d = 2, 48, 16
    q, k, v, dout = _fp64_inputs(cp_size * 10 + kv_heads, b, heads, kv_heads, s, d)
    ref = _reference(q, k, v)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), dout)

    q_grad = torch.zeros_like(q)
    k_grad, v_grad = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp_size):
        q_loc = cp_shard(q.detach(), cp_size, r, dim=2).requires_grad_()
        k_full, v_full = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        out = cp_causal_attention(q_loc, k_full, v_full, cp_size=cp_size, cp_rank=r, method=method)
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


def test_chunk_blocks():
    assert chunk_blocks(0, 8) == [(0, 8, True)]  # chunk 0: the diagonal block only
    assert chunk_blocks(3, 8) == [(24, 32, True), (0, 24, False)]
    with pytest.raises(ValueError, match="chunk -1 must be >= 0"):
        chunk_blocks(-1, 8)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_blocks_math_kernel_fp32_close_to_fp64(cp_size):
    # fp32 inputs through the math kernel (as on CPU in a run): each rank's output and grads vs the fp64 reference
    torch.manual_seed(5)
    b, h, g, s, d = 1, 4, 2, 32, 8
    q, k, v, dout = (torch.randn(b, n, s, d, dtype=torch.float64) for n in (h, g, g, h))
    ref = _reference(q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), dout)
    k_grad, v_grad = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp_size):
        q_loc = cp_shard(q.detach(), cp_size, r, dim=2).float().requires_grad_()
        k32, v32 = k.detach().float().requires_grad_(), v.detach().float().requires_grad_()
        out = blockwise_cp_attention(q_loc, k32, v32, cp_size=cp_size, cp_rank=r, kernel="math")
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), cp_shard(ref.detach(), cp_size, r, dim=2), rtol=1e-5, atol=1e-5)
        dq, dk, dv = torch.autograd.grad(out, (q_loc, k32, v32), cp_shard(dout, cp_size, r, dim=2).float())
        torch.testing.assert_close(dq.double(), cp_shard(gq, cp_size, r, dim=2), rtol=1e-5, atol=1e-5)
        k_grad += dk.double()
        v_grad += dv.double()
    torch.testing.assert_close(k_grad, gk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_grad, gv, rtol=1e-5, atol=1e-5)


def test_merge_with_absent_or_empty_off_diagonal_block():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    fwd = BLOCK_KERNELS["math"].forward
    diag_out, diag_lse, _ = fwd(q, k, v, True, 0.5)
    # chunk 0: one block, returned as it is
    out, lse = merge_partials([(diag_out, diag_lse)])
    assert out is diag_out and lse is diag_lse
    # an empty key set: lse = -inf, output zeros; merging it changes nothing
    empty_out, empty_lse, _ = fwd(q, k[:, :, :0], v[:, :, :0], False, 0.5)
    assert torch.equal(empty_out, torch.zeros_like(q)) and bool((empty_lse == float("-inf")).all())
    out, lse = merge_partials([(diag_out, diag_lse), (empty_out, empty_lse)])
    assert torch.equal(lse, diag_lse)
    torch.testing.assert_close(out, diag_out, rtol=0, atol=0)
    # two disjoint key sets merge to attention over their union
    a_out, a_lse, _ = fwd(q, k[:, :, :3], v[:, :, :3], False, 0.5)
    b_out, b_lse, _ = fwd(q, k[:, :, 3:], v[:, :, 3:], False, 0.5)
    full_out, full_lse, _ = fwd(q, k, v, False, 0.5)
    out, lse = merge_partials([(a_out, a_lse), (b_out, b_lse)])
    torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)
    # into a given strided output (rows of a [s, b, h, d]-ordered buffer), converted to its dtype
    dest = torch.zeros(8, 1, 2, 4, dtype=torch.float32).permute(1, 2, 0, 3)[:, :, 1:7]
    got, got_lse = merge_partials([(a_out, a_lse), (b_out, b_lse)], out=dest)
    assert got is dest and torch.equal(got_lse, lse)
    torch.testing.assert_close(dest, full_out.float(), rtol=1e-6, atol=1e-6)
    got, _ = merge_partials([(diag_out, diag_lse)], out=dest)
    assert got is dest and torch.equal(dest, diag_out.float())
    with pytest.raises(ValueError, match="no blocks to merge"):
        merge_partials([])


def test_math_kernel_backward_is_exact():
    # the hand-written backward equals autograd through the same forward (fp64, causal and full blocks)
    torch.manual_seed(4)
    q, k, v, dout = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(4))
    kern = BLOCK_KERNELS["math"]
    for causal in (True, False):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse, aux = kern.forward(qq, kk, vv, causal, 0.3)
        want = torch.autograd.grad(out, (qq, kk, vv), dout)
        got = kern.backward(dout, q, k, v, out.detach(), lse.detach(), aux, causal, 0.3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunks", [1, 2, 3, 6])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_chunked_forward_attention_matches_full_fp64(chunks, heads, kv_heads):
    """chunked_causal_attention (blocks forward, one-call backward) equals causal attention and its gradients in
    fp64 (math kernel), through cp_causal_attention's CP = 1 path; and the module uses it for forward_chunks > 1."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    b, s, d = 2, 48, 16
    q, k, v, dout = _fp64_inputs(chunks * 10 + kv_heads, b, heads, kv_heads, s, d)
    ref = _reference(q, k, v)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    out = chunked_causal_attention(q, k, v, chunks=chunks, kernel="math")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, w in zip(torch.autograd.grad(out, (q, k, v), dout), want):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-10)
    out = cp_causal_attention(q, k, v, cp_size=1, cp_rank=0, forward_chunks=chunks)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # the module: [s, b, heads, d] in, [s, b, heads * d] out, the same numbers
    mod = SDPACoreAttention(SimpleNamespace(attention_dropout=0.0, context_parallel_size=1), 1, AttnMaskType.causal,
                            "self", pg_collection=SimpleNamespace(cp=None), forward_chunks=chunks)
    got = mod(*(t.detach().permute(2, 0, 1, 3) for t in (q, k, v)), None)
    torch.testing.assert_close(got, ref.detach().permute(2, 0, 1, 3).reshape(s, b, -1), rtol=1e-10, atol=1e-10)


def test_forward_chunks_skip_reason_and_one_log_line(monkeypatch, caplog):
    """attention_forward_chunks > 1 that does not apply at CP = 1 names every reason, and is logged once per
    process however many calls fall back."""
    import logging

    q = torch.randn(1, 2, 10, 256)
    assert forward_chunks_skip_reason(q, 3, 0.1) == (
        "cpu tensors (the cuDNN SDPA kernels need CUDA); head_dim 256 > 128 (not measured; Qwen3.5's is 256); "
        "attention dropout 0.1 > 0; sequence length 10 not a multiple of 3")
    assert forward_chunks_skip_reason(q[..., :128], 2, 0.0) == "cpu tensors (the cuDNN SDPA kernels need CUDA)"
    monkeypatch.setattr(attention, "_forward_chunks_skip_logged", False)
    with caplog.at_level(logging.INFO, logger="sftprof.models.layers.attention"):
        for s in (10, 12):  # two calls, two layers' worth: one line
            x = torch.randn(1, 2, s, 8)
            torch.testing.assert_close(cp_causal_attention(x, x, x, cp_size=1, cp_rank=0, forward_chunks=3),
                                       _reference(x, x, x))
        cp_causal_attention(x, x, x, cp_size=1, cp_rank=0, forward_chunks=1)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(
        "INFO", "actor.megatron.attention_forward_chunks=3 has no effect at CP = 1 here: cpu tensors (the cuDNN SDPA "
        "kernels need CUDA); sequence length 10 not a multiple of 3; the attention runs as one causal SDPA call each "
        "way (logged once per process)")]
        # a view when out is in [s, b, heads, d] order: at CP = 1 it is allocated like the query view


def _megatron_layout(seed: int, b: int, s: int = 24, heads: int = 4, kv_heads: int = 2, d: int = 8):
    """fp64 leaves as megatron-core hands them to the core attention: q ``[s, b, heads, d]``, k/v the two halves
    of one ``[s, b, kv_heads, 2 d]`` tensor (a split of a fused projection: strided views), dout ``[s, b, heads * d]``."""
    torch.manual_seed(seed)
    q = torch.randn(s, b, heads, d, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(s, b, kv_heads, 2 * d, dtype=torch.float64, requires_grad=True)
    return q, kv, kv[..., :d], kv[..., d:], torch.randn(s, b, heads * d, dtype=torch.float64)


@pytest.mark.parametrize("b", [1, 2])
def test_chunked_forward_megatron_layout_fp64(b):
    """The chunked path on megatron's layout (permuted [s, b, heads, d] views, dout [s, b, heads * d]): output and
    Q/K/V gradients equal the fp64 reference, the output is allocated in [s, b, heads, d] order so that the module's
    final flatten is a view, and the module (CP = 1, forward_chunks 2) gives the same numbers."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    q, kv, k, v, dout = _megatron_layout(40 + b, b)
    s = q.shape[0]
    qc, kc, vc = (t.detach().permute(1, 2, 0, 3).contiguous().requires_grad_() for t in (q, k, v))
    ref = _reference(qc, kc, vc)
    want = torch.autograd.grad(ref, (qc, kc, vc), dout.view(s, b, -1, q.shape[-1]).permute(1, 2, 0, 3))
    want = [w.permute(2, 0, 1, 3) for w in want]  # back to [s, b, heads, d]
    ref = ref.detach().permute(2, 0, 1, 3).reshape(s, b, -1)

    views = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    assert not views[0].is_contiguous() and not views[1].is_contiguous()
    out = chunked_causal_attention(*views, chunks=2, kernel="math")
    assert out.stride() == views[0].stride()  # [s, b, heads, d] order, like q
    flat = out.permute(2, 0, 1, 3).reshape(s, b, -1)
    assert flat._base is out and flat.data_ptr() == out.data_ptr()  # the module's flatten copies nothing
    torch.testing.assert_close(flat, ref, rtol=1e-10, atol=1e-10)
    for got, w in zip(torch.autograd.grad(flat, (q, k, v), dout), want):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-10)

    mod = SDPACoreAttention(SimpleNamespace(attention_dropout=0.0, context_parallel_size=1), 1, AttnMaskType.causal,
                            "self", pg_collection=SimpleNamespace(cp=None), forward_chunks=2)
    got = mod(q, k, v, None)
    assert got.shape == (s, b, q.shape[2] * q.shape[3])
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_block_kernel_layout_helpers():
    """kernel_input passes unit-last-stride, 16-byte-aligned views through and copies the rest; with_output_layout
    gives a tensor the strides of one allocated like q (q's when q is dense, else contiguous), copying only then."""
    x = torch.randn(6, 2, 4, 8).permute(1, 2, 0, 3)  # megatron's permuted view
    assert kernel_input(x) is x
    rows = x[:, :, 2:4]
    assert kernel_input(rows) is rows
    fused = torch.randn(6, 2, 2, 16)[..., 8:].permute(1, 2, 0, 3)  # half of a fused projection: strided, not dense
    assert kernel_input(fused) is fused
    transposed = torch.randn(2, 4, 8, 6).transpose(-1, -2)  # last dimension strided
    got = kernel_input(transposed)
    assert got.is_contiguous() and torch.equal(got, transposed)
    misaligned = torch.randn(1 + 6 * 2 * 4 * 8)[1:].view(6, 2, 4, 8).permute(1, 2, 0, 3)  # pointer off by 4 bytes
    got = kernel_input(misaligned)
    assert got.is_contiguous() and got.data_ptr() != misaligned.data_ptr() and torch.equal(got, misaligned)
    broadcast = torch.randn(1, 4, 6, 8).expand(2, 4, 6, 8)  # a stride-0 batch dimension
    got = kernel_input(broadcast)
    assert got.is_contiguous() and torch.equal(got, broadcast)

    o = torch.randn(2, 4, 6, 8)  # contiguous [b, h, s, d] for a q in [s, b, h, d] order: copied into q's strides
    got = with_output_layout(o, x)
    assert got.stride() == x.stride() and torch.equal(got, o)
    assert with_output_layout(got, x) is got
    q1 = torch.randn(6, 1, 4, 8).permute(1, 2, 0, 3)  # b = 1: the stride of the size-1 dimension counts too
    dout = torch.randn(6, 1, 4, 8).as_strided((6, 1, 4, 8), (32, 7, 8, 1)).permute(1, 2, 0, 3)
    got = with_output_layout(dout, q1)
    assert dout.stride() == (7, 8, 32, 1) and got.stride() == q1.stride() == (32, 8, 32, 1) and torch.equal(got, dout)
    same = torch.randn(6, 1, 4, 8).permute(1, 2, 0, 3)
    assert with_output_layout(same, q1) is same
    # q's strides but a storage offset of one element (4 bytes): copied to an aligned tensor
    shifted = torch.randn(1 + 6 * 4 * 8)[1:].view(6, 1, 4, 8).permute(1, 2, 0, 3)
    got = with_output_layout(shifted, q1)
    assert shifted.stride() == q1.stride() and shifted.data_ptr() % 16 == 4
    assert got.stride() == q1.stride() and got.data_ptr() % 16 == 0 and torch.equal(got, shifted)
    lse = torch.randn(1, 1, 12)[:, :, 3:9]  # contiguous, 12 bytes past an aligned start: the op gets an aligned copy
    got = block_attention._native_lse(lse, torch.Size((1, 1, 6, 1)))
    assert lse.is_contiguous() and lse.data_ptr() % 16 == 12
    assert got.shape == (1, 1, 6, 1) and got.is_contiguous() and got.data_ptr() % 16 == 0
    assert torch.equal(got.flatten(), lse.flatten())
    q_rows = torch.randn(2, 4, 12, 8)[:, :, 2:8]  # a row slice of [b, h, S, d]: not dense, so contiguous
    got = with_output_layout(torch.randn(2, 4, 12, 8)[:, :, 4:10], q_rows)
    assert got.is_contiguous() and got.shape == q_rows.shape


def test_chunked_forward_attention_errors():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"actor.megatron.attention_forward_chunks=3: must be an integer >= 1 "
                                         r"dividing the sequence length 8"):
        chunked_causal_attention(q, q, q, chunks=3, kernel="math")
    with pytest.raises(ValueError, match=r"actor.megatron.attention_forward_chunks=0"):
        chunked_causal_attention(q, q, q, chunks=0, kernel="math")
    with pytest.raises(ValueError, match=r"kernel='fa3': must be one of"):
        chunked_causal_attention(q, q, q, chunks=2, kernel="fa3")
    with pytest.raises(ValueError, match=r"need equal lengths"):
        chunked_causal_attention(q, q[:, :, :4], q[:, :, :4], chunks=2, kernel="math")
    # not dividing the length, or dropout: one plain SDPA call (same result as the reference)
    torch.testing.assert_close(cp_causal_attention(q, q, q, cp_size=1, cp_rank=0, forward_chunks=3),
                               _reference(q, q, q))
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=rf"actor.megatron.attention_forward_chunks={bad}: must be an integer >= 1"):
            load_config(PRESET_DIR / "tiny_cpu.yaml", [f"actor.megatron.attention_forward_chunks={bad}"])
    for bad in ("1.5", "true", "two"):
        with pytest.raises(ConfigError, match=r"actor.megatron.attention_forward_chunks: Value .* could not be "
                                              r"converted to Integer"):
            load_config(PRESET_DIR / "tiny_cpu.yaml", [f"actor.megatron.attention_forward_chunks={bad}"])
    assert load_config(PRESET_DIR / "tiny_cpu.yaml",
                       ["actor.megatron.attention_forward_chunks=4"]).actor.megatron.attention_forward_chunks == 4


def test_cp_attention_setting_errors():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"actor.megatron.cp_attention='ring': must be one of \['masked', 'blocks'\]"):
        cp_causal_attention(q, q, q, cp_size=1, cp_rank=0, method="ring")
    with pytest.raises(ValueError, match="actor.megatron.cp_attention='blocks' needs attention dropout 0, got 0.1"):
        check_cp_attention("blocks", 0.1, 2)
    check_cp_attention("blocks", 0.1, 1)  # CP=1 never uses the blocks
    with pytest.raises(ValueError, match=r"kernel='fa3': must be one of \['cudnn', 'flash', 'cudnn_gqa', 'flash_gqa', 'math'\]"):
        blockwise_cp_attention(q, q[:, :, :4], q[:, :, :4], cp_size=2, cp_rank=0, kernel="fa3")
    with pytest.raises(ValueError, match="3 query heads must be a multiple of the K/V heads"):
        blockwise_cp_attention(torch.randn(1, 3, 4, 4), q, q, cp_size=2, cp_rank=0, kernel="math")


def test_cp_attention_config_key():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from sftprof.config import PRESET_DIR
    cfg = load_config(PRESET_DIR / "tiny_cpu.yaml", [])
    assert cfg.actor.megatron.cp_attention == "blocks"
    assert load_config(PRESET_DIR / "tiny_cpu.yaml", ["actor.megatron.cp_attention=masked"]).actor.megatron.cp_attention == "masked"
    with pytest.raises(ConfigError, match=r"actor.megatron.cp_attention='ring': must be one of \['masked', 'blocks'\]"):
        load_config(PRESET_DIR / "tiny_cpu.yaml", ["actor.megatron.cp_attention=ring"])
    with pytest.raises(ValueError, match="needs attention dropout 0"):
        SDPACoreAttention(SimpleNamespace(attention_dropout=0.1, context_parallel_size=2), 1, AttnMaskType.causal,
                          "self", pg_collection=SimpleNamespace(cp=None), cp_attention="blocks")


def _load_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "cp_attention.py"
    spec = importlib.util.spec_from_file_location("bench_cp_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_bench_causal_pairs_and_no_cuda_exit():
    import subprocess
    import sys

    bench, path = _load_bench()
    # CP=2, S=8, L=2: rank 0 holds chunks 0 and 3 (3 + 3*4 + 3 pairs), rank 1 chunks 1 and 2 (4 + 3 + 8 + 3)
    assert [bench.causal_pairs(8, 2, r) for r in range(2)] == [18, 18]
    assert bench.causal_pairs(8) == 36
    assert [bench.causal_pairs(64, 4, r) for r in range(4)] == [520, 520, 520, 520] and bench.causal_pairs(64) == 2080
    # 131072 tokens, 32 heads x 128: 3.5 x 4 x 4096 x 8,590,000,128 pairs
    assert bench.fwd_bwd_flops(bench.causal_pairs(131072), 32, 128) == 3.5 * 4 * 4096 * 8_590_000_128
    with pytest.raises(ValueError, match="--seq 12 must be a multiple of 2 x CP = 8"):
        bench.causal_pairs(12, 4, 0)
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == ("bench/cp_attention.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                                   "nothing was measured")


def test_bench_exactness_reports_refusals_and_stops_on_a_device_fault():
    """bench/cp_attention.py's exactness check: a candidate's RuntimeError (an op refusing the inputs) is its entry
    and the others are still checked; a device fault (``torch.AcceleratorError``) stops the check with the group and
    the candidate named."""
    bench, _ = _load_bench()
    g = torch.Generator().manual_seed(0)
    tensors = tuple(torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    tensors += (torch.randn(2, 3, generator=g, dtype=torch.float64),)

    def reference(q, k, v):
        return q * k + v

    def refuses(q, k, v):
        raise RuntimeError("No available kernel.\nsecond line")

    def faults(q, k, v):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    diffs = bench._exactness(reference, {"refuses": refuses, "same": lambda q, k, v: k * q + v}, tensors, "CP=2 rank 1")
    out_scale = float((tensors[0] * tensors[1] + tensors[2]).detach().float().abs().max())  # the bench reads fp32
    assert diffs == {"refuses": {"error": "RuntimeError: No available kernel."},
                     "same": {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "out_scale": out_scale}}
    assert all(t.grad is None for t in tensors[:3])
    with pytest.raises(RuntimeError) as exc:
        bench._exactness(reference, {"same": reference, "blocks (cudnn)": faults}, tensors, "CP=2 rank 1")
    assert str(exc.value) == ("exactness check of CP=2 rank 1, blocks (cudnn): AcceleratorError: CUDA error: an illegal "
                              "memory access was encountered")


# ----------------------------------------------------------------------------------------------------------------
# SDPACoreAttention with a real CP process group (gloo ranks), against the single-process fp64 reference


def _gloo_cp_worker(rank: int, cp: int, store: str, results: str) -> None:
    from types import SimpleNamespace
    from unittest import mock

    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    from sftprof.models.layers import block_attention

    dist.init_process_group("gloo", store=dist.FileStore(store, cp), rank=rank, world_size=cp)
    b, h, g, d, s = 2, 4, 2, 8, 16 * cp
    q, k, v, dout = _fp64_inputs(7, b, h, g, s, d)
    ref = _reference(q, k, v)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), dout)
    # megatron's layout: [s, b, heads, d]; V a strided view as megatron's QKV split gives it
    to_sbhd = lambda t: t.detach().permute(2, 0, 1, 3)  # noqa: E731
    mixed = torch.cat((to_sbhd(k), to_sbhd(v)), dim=-1)  # [s, b, g, 2d]
    errs = {}
    for method, overlap in (("blocks", True), ("blocks", False), ("masked", True)):
        mod = SDPACoreAttention(SimpleNamespace(attention_dropout=0.0, context_parallel_size=cp), 1,
                                AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=dist.group.WORLD),
                                cp_attention=method, cp_comm_overlap=overlap)
        lq = cp_shard(to_sbhd(q), cp, rank, dim=0).clone().requires_grad_()
        lk = cp_shard(mixed[..., :d], cp, rank, dim=0).clone().requires_grad_()
        lmixed = cp_shard(mixed, cp, rank, dim=0).clone().requires_grad_()
        lv = lmixed[..., d:]  # non-contiguous
        with mock.patch.object(block_attention, "_OverlappedCPBlocks",
                               wraps=block_attention._OverlappedCPBlocks) as overlapped:
            out = mod(lq, lk, lv, None)  # [s/cp, b, h * d]
        out.backward(cp_shard(to_sbhd(dout).reshape(s, b, h * d), cp, rank, dim=0))
        want_out = cp_shard(to_sbhd(ref).reshape(s, b, h * d), cp, rank, dim=0)
        errs[f"{method}-{overlap}"] = {
            "overlapped": overlapped.apply.call_count,
            "flatten_is_view": out._base is not None,  # the attention output was allocated in [s, b, h, d] order
            "out": float((out - want_out).abs().max()),
            "dq": float((lq.grad - cp_shard(to_sbhd(gq), cp, rank, dim=0)).abs().max()),
            "dk": float((lk.grad - cp_shard(to_sbhd(gk), cp, rank, dim=0)).abs().max()),
            "dv": float((lmixed.grad[..., d:] - cp_shard(to_sbhd(gv), cp, rank, dim=0)).abs().max()),
        }
    torch.save(errs, f"{results}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_sdpa_core_attention_with_a_gloo_cp_group_matches_full_fp64(tmp_path, cp):
    """SDPACoreAttention on ``cp`` gloo ranks (megatron's ``[s, b, heads, d]`` layout, GQA 4/2 heads, V a strided
    view): every rank's output and Q/K/V gradients equal the single-process fp64 causal attention's rows to
    1e-10, for ``blocks`` with the communication overlapped (the overlapped path ran once per rank, and its
    output is allocated in megatron's order, so the module's flatten is a view) and not (it did not run), and for
    ``masked``."""
    import torch.multiprocessing as mp

    results = str(tmp_path / "errs")
    mp.spawn(_gloo_cp_worker, args=(cp, str(tmp_path / "store"), results), nprocs=cp, join=True)
    for rank in range(cp):
        errs = torch.load(f"{results}.{rank}")
        assert [errs[c]["overlapped"] for c in ("blocks-True", "blocks-False", "masked-True")] == [1, 0, 0]
        assert [errs[c]["flatten_is_view"] for c in ("blocks-True", "blocks-False", "masked-True")] == [True, False,
                                                                                                      False]
        for case, e in errs.items():
            for name in ("out", "dq", "dk", "dv"):
                assert e[name] < 1e-10, (rank, case, name, e)


def _overlapped_direct_worker(rank: int, cp: int, store: str, results: str) -> None:
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from sftprof.models.layers.block_attention import overlapped_cp_attention

    dist.init_process_group("gloo", store=dist.FileStore(store, cp), rank=rank, world_size=cp)
    own = [dist.new_group([r]) for r in range(cp)][rank]  # every rank creates every group, uses its own
    b, h, d, s = 1, 2, 8, 8 * cp
    q, k, v, dout = _fp64_inputs(11, b, h, h, s, d)  # MHA: as many K/V heads as query heads
    ref = _reference(q, k, v)
    want = [ref.detach()] + list(torch.autograd.grad(ref, (q, k, v), dout))
    local = lambda t: cp_shard(t.detach(), cp, rank, dim=2)  # noqa: E731

    def run(dtype, wrap=None):
        lq, lk, lv = (local(t).to(dtype).requires_grad_() for t in (q, k, v))
        fn = lambda a, b_, c: overlapped_cp_attention(a, b_, c, group=dist.group.WORLD, kernel="math")  # noqa: E731
        out = fn(lq, lk, lv) if wrap is None else wrap(fn, lq, lk, lv)
        out.backward(local(dout).to(dtype))
        return [out.detach(), lq.grad, lk.grad, lv.grad]

    def err(got):
        return max(float((g.double() - local(w)).abs().max()) for g, w in zip(got, want))

    errs = {"fp64": err(run(torch.float64)), "fp32": err(run(torch.float32)),
            "checkpoint": err(run(torch.float64, lambda f, *a: checkpoint(f, *a, use_reentrant=False))),
            "checkpoint_reentrant": err(run(torch.float64, lambda f, *a: checkpoint(f, *a, use_reentrant=True)))}
    with torch.no_grad():
        out = overlapped_cp_attention(*(local(t).requires_grad_() for t in (q, k, v)), group=dist.group.WORLD,
                                      kernel="math")
    errs["no_grad"] = float((out - local(ref)).abs().max())
    errs["no_grad_fn"] = out.grad_fn is None
    # a process group of one rank: this rank holds the whole sequence as chunks 0 and 1
    fq, fk, fv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = overlapped_cp_attention(fq, fk, fv, group=own, kernel="math")
    out.backward(dout)
    errs["group_of_one"] = max(float((g - w).abs().max()) for g, w in zip((out.detach(), fq.grad, fk.grad, fv.grad),
                                                                           want))
    torch.save(errs, f"{results}.{rank}")
    dist.destroy_process_group()


def test_overlapped_cp_attention_direct_calls_mha_fp32_checkpoint_no_grad_and_a_group_of_one(tmp_path):
    """overlapped_cp_attention called directly on 2 gloo ranks with as many K/V heads as query heads (MHA): fp64
    and fp32 inputs, under torch.utils.checkpoint (both forms: the forward and its collective run again in the
    backward), under no_grad (same output, no graph), and on a process group of one rank (the whole sequence):
    outputs and Q/K/V gradients equal the fp64 reference (fp32: to 1e-5)."""
    import torch.multiprocessing as mp

    results = str(tmp_path / "errs")
    mp.spawn(_overlapped_direct_worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    for rank in range(2):
        errs = torch.load(f"{results}.{rank}")
        assert errs.pop("no_grad_fn") is True
        assert errs.pop("fp32") < 1e-5, (rank, errs)
        assert sorted(errs) == ["checkpoint", "checkpoint_reentrant", "fp64", "group_of_one", "no_grad"]
        for case, e in errs.items():
            assert e < 1e-10, (rank, case, e)
