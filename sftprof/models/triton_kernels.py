"""Triton kernels of the model's fused ops (CUDA; imported lazily by their modules; CPU tensors only under Triton's
interpreter, ``TRITON_INTERPRET=1``, in tests).

- :func:`swiglu_forward` / :func:`swiglu_backward` for :func:`sftprof.models.swiglu.swiglu_with_probs`: one
  program per row of ``fc1`` ``[M, 2F]``, streaming the ``F`` gate and up columns in ``BLOCK``-wide steps.
- :func:`gather_sum` for :func:`sftprof.models.moe_permute.gather_sum`: one program per (token, ``BLOCK_H``
  columns), its ``topk`` rows added in fp32 in ``k`` order (negative indices are padding: skipped).
- :func:`rope_apply` for :func:`sftprof.models.rope.fused_apply_rotary_pos_emb`: one program per ``(s, b)`` row
  of ``t`` ``[S, B, H, D]``, all heads in ``[BLOCK_H, half]`` tiles, the row's cos/sin computed once.
- :func:`router_topk` for :mod:`sftprof.models.router`: one program per ``BLOCK_T`` rows of the router logits
  ``[T, E]`` (a ``[BLOCK_T, next_pow2(E)]`` tile), the top-k picked by ``k`` row-max passes, the dense
  ``[T, E]`` probabilities, routing map and softmax scores written directly (no zeros + scatter).
- :func:`rms_norm_forward` / :func:`rms_norm_backward` for :mod:`sftprof.models.norm`: ``[BLOCK_ROWS, BLOCK_D]``
  tiles of rows (many rows per program when ``D`` is small), rows addressed by a row stride (no copy of a strided
  view); the backward runs a fixed grid of programs that loop over the row tiles and write fp32 partial weight
  gradients ``[programs, D]``, summed by torch (no atomics: deterministic).

fp32 arithmetic, one rounding per stored element. The math is in each op's module.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Triton's interpreter (TRITON_INTERPRET=1: kernels on CPU tensors, the CPU tests) runs no libdevice call; its tl.exp
# is numpy's. On the GPU tl.exp of fp32 is ex2.approx (relative error ~|x| * 1e-7): libdevice's expf there instead.
INTERPRET = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else \
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")  # Triton < 3.4


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


@triton.jit
def _router_topk_kernel(x_ptr, probs_ptr, map_ptr, scores_ptr, n_rows, n_experts, scale, K: tl.constexpr,
                        PRE_SOFTMAX: tl.constexpr, ROW_SOFTMAX: tl.constexpr, WRITE_PROBS: tl.constexpr,
                        WRITE_SCORES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        LIBDEVICE_EXP: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    cm = cols[None, :] < n_experts
    m = (rows[:, None] < n_rows) & cm
    off = rows[:, None] * n_experts + cols[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    x = tl.where(cm, x, float("-inf"))  # padding columns: never picked, exp() = 0
    key = tl.where(x != x, float("inf"), x)  # NaN ranks first, as in torch.topk
    taken = (rows[:, None] < 0) & (cols[None, :] < 0)  # [BLOCK_T, BLOCK_E], all false (a loop keeps its shape)
    for _ in range(K):  # the row's largest key not yet taken; among equal keys the lowest column
        avail = cm & (taken == 0)
        kv = tl.where(avail, key, float("-inf"))
        best = tl.max(kv, axis=1)
        pick = tl.min(tl.where(avail & (kv == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        taken = taken | (cols[None, :] == pick[:, None])
    if ROW_SOFTMAX:  # softmax over the whole row (PRE_SOFTMAX or WRITE_SCORES)
        if LIBDEVICE_EXP:
            e = libdevice.exp(x - tl.max(x, axis=1)[:, None])
        else:
            e = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
        if WRITE_SCORES:
            tl.store(scores_ptr + off, s, mask=m)
    if WRITE_PROBS:
        if PRE_SOFTMAX:  # the top-k of the row's softmax
            p = tl.where(taken, s, 0.0)
        else:  # softmax over the top-k logits only
            xt = tl.where(taken, x, float("-inf"))
            if LIBDEVICE_EXP:
                et = libdevice.exp(xt - tl.max(xt, axis=1)[:, None])
            else:
                et = tl.exp(xt - tl.max(xt, axis=1)[:, None])
            p = et / tl.sum(et, axis=1)[:, None]
        tl.store(probs_ptr + off, p * scale, mask=m)
    tl.store(map_ptr + off, taken.to(tl.uint8), mask=m)


def router_topk(logits: torch.Tensor, topk: int, pre_softmax: bool, scale: float, write_probs: bool,
                write_scores: bool) -> tuple:
    """Top-k routing of contiguous fp32 ``logits`` ``[T, E]`` (``1 <= topk <= E``; E up to
    :data:`sftprof.models.router.MAX_EXPERTS`: one ``[BLOCK_T, next_pow2(E)]`` fp32 tile per program).

    Returns ``(probs [T, E] fp32 or None, routing_map [T, E] bool, scores [T, E] fp32 or None)``: ``routing_map``
    marks each row's ``topk`` largest logits (ties: lower index); ``probs`` (``write_probs``) holds, at those
    positions and zeros elsewhere, ``scale *`` the softmax over the row (``pre_softmax``) or over the ``topk``
    selected logits; ``scores`` (``write_scores``) is the softmax over the row.
    """
    t, e = logits.shape
    probs = torch.empty_like(logits) if write_probs else None
    scores = torch.empty_like(logits) if write_scores else None
    routing_map = torch.empty(t, e, dtype=torch.bool, device=logits.device)
    if t:
        block_e = triton.next_power_of_2(e)
        block_t = max(1, 1024 // block_e)  # 8 logits per thread: ~70 registers at E = 128 and 512 (ptxas, sm_90a)
        _router_topk_kernel[(triton.cdiv(t, block_t),)](
            logits, probs if write_probs else logits, routing_map.view(torch.uint8),
            scores if write_scores else logits, t, e, float(scale), K=topk, PRE_SOFTMAX=pre_softmax,
            ROW_SOFTMAX=pre_softmax or write_scores, WRITE_PROBS=write_probs, WRITE_SCORES=write_scores,
            BLOCK_T=block_t, BLOCK_E=block_e, LIBDEVICE_EXP=not INTERPRET, num_warps=4)
    return probs, routing_map, scores
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
    ``weight`` ``[D]`` (any stride) in its own dtype; ``D <= sftprof.models.norm.FUSED_MAX_D`` (a row per tile)."""
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
