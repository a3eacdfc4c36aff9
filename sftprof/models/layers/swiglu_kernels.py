"""Triton kernels of :func:`sftprof.models.layers.swiglu.swiglu_with_probs` (CUDA; imported only for CUDA tensors).

:func:`swiglu_forward` / :func:`swiglu_backward`: one program per row of ``fc1`` ``[M, 2F]``, streaming the ``F``
gate and up columns in ``BLOCK``-wide steps. fp32 arithmetic, one rounding per stored element; the math is in
:mod:`sftprof.models.layers.swiglu`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(fc1_ptr, probs_ptr, out_ptr, n_ffn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(probs_ptr + row).to(tl.float32)
    base = fc1_ptr + row * 2 * n_ffn
    for start in range(0, n_ffn, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_ffn
        g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u * p
        tl.store(out_ptr + row * n_ffn + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(fc1_ptr, probs_ptr, dout_ptr, dfc1_ptr, dprobs_ptr, n_ffn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(probs_ptr + row).to(tl.float32)
    base = fc1_ptr + row * 2 * n_ffn
    dbase = dfc1_ptr + row * 2 * n_ffn
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_ffn, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_ffn
        g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dout_ptr + row * n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        dg = d * u * p * s * (1.0 + g * (1.0 - s))
        tl.store(dbase + cols, dg.to(dfc1_ptr.dtype.element_ty), mask=mask)
        tl.store(dbase + n_ffn + cols, (d * silu * p).to(dfc1_ptr.dtype.element_ty), mask=mask)
        acc += d * silu * u
    tl.store(dprobs_ptr + row, tl.sum(acc, axis=0))


def _block(n_ffn: int) -> int:
    return min(triton.next_power_of_2(max(n_ffn, 16)), 2048)


def swiglu_forward(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``[M, F]`` output in ``fc1``'s dtype from contiguous ``fc1`` ``[M, 2F]`` and ``probs`` ``[M]``."""
    m, f = fc1.shape[0], fc1.shape[1] // 2
    out = torch.empty(m, f, dtype=fc1.dtype, device=fc1.device)
    if m:
        _swiglu_fwd_kernel[(m,)](fc1, probs.contiguous(), out, f, BLOCK=_block(f), num_warps=4)
    return out


def swiglu_backward(fc1: torch.Tensor, probs: torch.Tensor, d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d fc1 [M, 2F] in fc1's dtype, d probs [M] fp32)`` from contiguous ``d_out`` ``[M, F]``."""
    m, f = fc1.shape[0], fc1.shape[1] // 2
    d_fc1 = torch.empty_like(fc1)
    d_probs = torch.empty(m, dtype=torch.float32, device=fc1.device)
    if m:
        _swiglu_bwd_kernel[(m,)](fc1, probs.contiguous(), d_out, d_fc1, d_probs, f, BLOCK=_block(f), num_warps=4)
    return d_fc1, d_probs
