"""Triton kernel of :func:`sftprof.models.layers.moe_permute.gather_sum` (CUDA; imported only for CUDA tensors).

:func:`gather_sum`: one program per (token, ``BLOCK_H`` columns), its ``topk`` rows added in fp32 in ``k`` order
(negative indices are padding: skipped), one rounding per stored element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_sum_kernel(x_ptr, idx_ptr, out_ptr, n_cols, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):  # the torch path's order: k = 0, 1, ... in fp32
        row = tl.load(idx_ptr + t * TOPK + k).to(tl.int64)  # < 0: padding, adds nothing
        acc += tl.load(x_ptr + row * n_cols + cols, mask=mask & (row >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * n_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_sum(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out [T, H] = sum_k x[inverse[t, k]]`` over ``inverse[t, k] >= 0`` (negative: padding) for contiguous ``x``
    ``[N, H]`` and ``inverse`` ``[T, topk]``."""
    t, topk = inverse.shape
    h = x.shape[1]
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(h))
    _gather_sum_kernel[(t, triton.cdiv(h, block))](x, inverse, out, h, TOPK=topk, BLOCK_H=block, num_warps=4)
    return out
