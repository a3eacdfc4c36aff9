"""Triton kernels for :mod:`sftprof.ops.vocab_softmax` (CUDA only; imported lazily).

Both kernels stream one chunk of logits ``[n, V_local]`` (bf16/fp16/fp32, row stride arbitrary,
column stride 1) and compute in fp32. Row offsets are formed in int64, so chunks with more than
2**31 elements are addressed correctly.

- ``row_stats``: one program per row, a per-lane online max / sum-exp / sum-exp-times-shifted-logit
  over the row (the one-pass softmax normaliser of Milakov & Gimelshein, "Online normalizer
  calculation for softmax", 2018, extended with the entropy accumulator), plus the target logit.
- ``softmax_grad_``: elementwise over ``(row, column block)``, overwrites the logits with
  ``a [j == y] - p_j (b + c log p_j)`` (see :mod:`sftprof.ops.vocab_softmax`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_STATS_BLOCK = 4096
_GRAD_BLOCK = 2048


@triton.jit
def _row_stats_kernel(x_ptr, stride_row, n_cols, lab_ptr, m_ptr, s_ptr, a_ptr, t_ptr, inv_temp,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1.0e30, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    a = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, x)
        scale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        a = scale * (a + (m - m_new) * s) + tl.where(mask, e * (x - m_new), 0.0)
        s = s * scale + e
        m = m_new
    gm = tl.max(m, axis=0)
    w = tl.exp(m - gm)
    gs = tl.sum(s * w, axis=0)
    ga = tl.sum(w * (a + (m - gm) * s), axis=0)
    idx = tl.load(lab_ptr + row)
    t = tl.load(base + tl.maximum(idx, 0)).to(tl.float32) * inv_temp
    t = tl.where(idx >= 0, t, 0.0)
    tl.store(m_ptr + row, gm)
    tl.store(s_ptr + row, gs)
    tl.store(a_ptr + row, ga)
    tl.store(t_ptr + row, t)


@triton.jit
def _softmax_grad_kernel(x_ptr, stride_row, n_cols, n_rows, lab_ptr, lse_ptr, coef_ptr, inv_temp,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = x_ptr + row * stride_row + cols
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * inv_temp
    lse = tl.load(lse_ptr + row)
    ca = tl.load(coef_ptr + row)
    cb = tl.load(coef_ptr + n_rows + row)
    cc = tl.load(coef_ptr + 2 * n_rows + row)
    idx = tl.load(lab_ptr + row)
    logp = x - lse
    g = -tl.exp(logp) * (cb + cc * logp)
    g = tl.where(cols == idx, g + ca, g)
    tl.store(ptrs, g.to(x_ptr.dtype.element_ty), mask=mask)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits chunk must be 2-D with contiguous columns, got shape {tuple(logits.shape)} "
                         f"stride {logits.stride()}")


def row_stats(logits: torch.Tensor, local_labels: torch.Tensor, inv_temp: float):
    """Per-row local (this shard) max ``m``, ``S = sum exp(x - m)``, ``A = sum exp(x - m)(x - m)`` and
    target logit ``x_y`` (0 where the label is in another shard); four fp32 ``[n]`` tensors."""
    _check(logits)
    n, v = logits.shape
    out = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    if n:
        _row_stats_kernel[(n,)](logits, logits.stride(0), v, local_labels.contiguous(), out[0], out[1],
                                out[2], out[3], inv_temp, BLOCK=_STATS_BLOCK, num_warps=8)
    return out.unbind(0)


def softmax_grad_(logits: torch.Tensor, local_labels: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                  inv_temp: float) -> None:
    """In-place ``logits <- dL/dlogits`` (see :func:`sftprof.ops.vocab_softmax.write_softmax_grad_`)."""
    _check(logits)
    n, v = logits.shape
    if n:
        grid = (n, triton.cdiv(v, _GRAD_BLOCK))
        _softmax_grad_kernel[grid](logits, logits.stride(0), v, n, local_labels.contiguous(), lse.contiguous(),
                                   coef.contiguous(), inv_temp, BLOCK=_GRAD_BLOCK, num_warps=4)
