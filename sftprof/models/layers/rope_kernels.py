"""Triton kernel of :func:`sftprof.models.layers.rope.fused_apply_rotary_pos_emb` (CUDA; imported only for CUDA
tensors).

:func:`rope_apply`: one program per ``(s, b)`` row of ``t`` ``[S, B, H, D]``, all heads in ``[BLOCK_H, half]``
tiles, the row's cos/sin computed once. fp32 arithmetic, one rounding per stored element; the math is in
:mod:`sftprof.models.layers.rope`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, f_ptr, out_ptr, n_b, n_heads, head_dim, half, stride_fs, stride_fb,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_idx = row // n_b
    b_idx = row % n_b
    cols = tl.arange(0, BLOCK_D)
    cm = cols < half
    fbase = f_ptr + s_idx * stride_fs + b_idx * stride_fb
    f1 = tl.load(fbase + cols, mask=cm, other=0.0).to(tl.float32)
    f2 = tl.load(fbase + half + cols, mask=cm, other=0.0).to(tl.float32)
    c1, s1, c2, s2 = tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)
    base = row * n_heads * head_dim
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        hm = heads < n_heads
        m = hm[:, None] & cm[None, :]
        off = base + heads[:, None] * head_dim + cols[None, :]
        x1 = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + off + half, mask=m, other=0.0).to(tl.float32)
        if BACKWARD:  # transpose of the rotation: d1 c1 + d2 s2 | d2 c2 - d1 s1
            o1 = x1 * c1[None, :] + x2 * s2[None, :]
            o2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:  # x1 c1 - x2 s1 | x2 c2 + x1 s2
            o1 = x1 * c1[None, :] - x2 * s1[None, :]
            o2 = x2 * c2[None, :] + x1 * s2[None, :]
        tl.store(out_ptr + off, o1.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(out_ptr + off + half, o2.to(out_ptr.dtype.element_ty), mask=m)
        if BLOCK_T > 0:  # columns past the rotary dim pass through (partial rotary)
            tcols = 2 * half + tl.arange(0, BLOCK_T)
            tm = tcols < head_dim
            toff = base + heads[:, None] * head_dim + tcols[None, :]
            tmask = hm[:, None] & tm[None, :]
            tl.store(out_ptr + toff, tl.load(x_ptr + toff, mask=tmask, other=0.0), mask=tmask)


def rope_apply(t: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    """Rotate contiguous ``t`` ``[S, B, H, D]`` by angles ``freqs`` ``[S, 1 or B, 1, R]`` (R even, <= D); with
    ``backward`` apply the transposed rotation (the gradient). Returns a new tensor like ``t``."""
    n_s, n_b, n_heads, head_dim = t.shape
    half = freqs.shape[-1] // 2
    out = torch.empty_like(t)
    if t.numel():
        block_d = triton.next_power_of_2(max(half, 1))
        tail = head_dim - 2 * half
        _rope_kernel[(n_s * n_b,)](t, freqs, out, n_b, n_heads, head_dim, half, freqs.stride(0),
                                   freqs.stride(1) if freqs.shape[1] > 1 else 0, BACKWARD=backward,
                                   BLOCK_H=max(1, min(triton.next_power_of_2(n_heads), 4096 // block_d)),
                                   BLOCK_D=block_d, BLOCK_T=triton.next_power_of_2(tail) if tail else 0,
                                   num_warps=4)
    return out
