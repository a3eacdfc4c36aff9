"""Triton kernels of :func:`sftprof.models.layers.norm.rms_norm` (CUDA; CPU tensors only under Triton's interpreter,
``TRITON_INTERPRET=1``, in tests; imported only where they run).

:func:`rms_norm_forward` / :func:`rms_norm_backward`: ``[BLOCK_ROWS, BLOCK_D]`` tiles of rows (many rows per program
when ``D`` is small), rows addressed by a row stride (no copy of a strided view); the backward runs a fixed grid of
programs that loop over the row tiles and write fp32 partial weight gradients ``[programs, D]``, summed by torch (no
atomics: deterministic). fp32 arithmetic, one rounding per stored element; the math is in
:mod:`sftprof.models.layers.norm`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# Elements per [BLOCK_ROWS, BLOCK_D] tile (BLOCK_ROWS = 1 for wider rows), 8 per thread (one 16-byte bf16 vector).
# Compiled for sm_90 with Triton 3.5 (ptxas register counts of the cubin), these give no spills and, for every
# power-of-2 D from 128 to 8192 in bf16 and fp32, 48-64 resident warps per SM forward and 28-32 backward (the
# backward holds x, dy and the weight-gradient accumulator).
_NORM_FWD_TILE = 1024
_NORM_BWD_TILE = 512
_NORM_PARTIAL_BYTES = 16 << 20  # backward: cap of the fp32 weight-gradient partials [programs, D] (at least 4 per SM)


def _norm_config(n_cols: int, tile: int) -> tuple[int, int, int]:
    """``(BLOCK_ROWS, BLOCK_D, num_warps)`` for rows of ``n_cols`` and ``tile`` elements per program."""
    block_d = triton.next_power_of_2(n_cols)
    block_rows = max(1, tile // block_d)
    return block_rows, block_d, max(1, min(32, block_rows * block_d // 256))


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, stride_x, eps, ZERO_CENTERED: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < n_cols
    m = (rows < n_rows)[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        g = g + 1.0
    # fp32 whatever eps's type: Inductor passes a Python float to a user kernel as fp64 (torch.compile'd callers)
    rstd = tl.rsqrt((tl.sum(x * x, axis=1) / n_cols + eps).to(tl.float32))
    y = (x * rstd[:, None]) * g[None, :]  # torch's order: gamma * (rstd * x)
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, n_rows, n_cols, stride_x, stride_dy, eps,
                         ZERO_CENTERED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < n_cols
    g = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        g = g + 1.0
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = tl.arange(0, BLOCK_ROWS).to(tl.int64) + tile * BLOCK_ROWS  # tile * BLOCK_ROWS < n_rows + BLOCK_ROWS
        rm = rows < n_rows
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        # rstd recomputed from the row in registers (0 on padding rows: no inf * 0 when eps = 0)
        # (fp32 whatever eps's type: Inductor passes a Python float to a user kernel as fp64)
        rstd = tl.where(rm, tl.rsqrt((tl.sum(x * x, axis=1) / n_cols + eps).to(tl.float32)), 0.0)
        gdy = dy * g[None, :]
        c = tl.sum(gdy * x, axis=1) / n_cols * rstd * rstd
        dx = (gdy - x * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        acc += dy * (x * rstd[:, None])
    tl.store(dw_ptr + pid * n_cols + cols, tl.sum(acc, axis=0), mask=cm)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``y [M, D]`` (contiguous, ``x``'s dtype) of rows ``x`` ``[M, D]`` (last dim contiguous, any row stride),
    ``weight`` ``[D]`` (any stride) in its own dtype; ``D <= sftprof.models.layers.norm.FUSED_MAX_D`` (a row per tile)."""
    n_rows, n_cols = x.shape
    y = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    if n_rows:
        block_rows, block_d, warps = _norm_config(n_cols, _NORM_FWD_TILE)
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
            x, weight.contiguous(), y, n_rows, n_cols, x.stride(0), eps, ZERO_CENTERED=zero_centered,
            BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps)
    return y


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, d_y: torch.Tensor, eps: float,
                      zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d x [M, D] contiguous in x's dtype, d weight [D] fp32)`` from rows ``x`` and ``d_y`` ``[M, D]`` (last dims
    contiguous, any row strides).

    Each program loops over every ``programs``-th row tile and sums its share of ``d weight`` in fp32; torch sums the
    ``[programs, D]`` partials. ``programs``: as many as ``_NORM_PARTIAL_BYTES`` of partials hold, at least 4 per SM
    (several waves of equal programs at any occupancy: 32768 for ``D = 128``, 2048 for ``D = 2048``, 528 for
    ``D = 8192`` on 132 SMs), at most one per row tile; 4 on the Triton CPU interpreter (so that its tests run the
    loop).
    """
    n_rows, n_cols = x.shape
    d_x = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    block_rows, block_d, warps = _norm_config(n_cols, _NORM_BWD_TILE)
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = max(4 * sms, _NORM_PARTIAL_BYTES // (4 * n_cols))
    else:
        programs = 4
    programs = max(1, min(programs, triton.cdiv(n_rows, block_rows)))
    # every launched program stores its row of partials; no launch without rows
    partial = (torch.empty if n_rows else torch.zeros)(programs, n_cols, dtype=torch.float32, device=x.device)
    if n_rows:
        _rms_norm_bwd_kernel[(programs,)](
            x, weight.contiguous(), d_y, d_x, partial, n_rows, n_cols, x.stride(0), d_y.stride(0), eps,
            ZERO_CENTERED=zero_centered, BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=warps)
    return d_x, partial.sum(0)
