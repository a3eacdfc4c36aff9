"""Triton kernel of the MoE router's top-k (:mod:`sftprof.models.layers.router`; CUDA, and CPU tensors under
Triton's interpreter, ``TRITON_INTERPRET=1``, in tests; imported only where it runs).

:func:`router_topk`: one program per ``BLOCK_T`` rows of the router logits ``[T, E]`` (a ``[BLOCK_T,
next_pow2(E)]`` tile), the top-k picked by ``k`` row-max passes, the dense ``[T, E]`` probabilities, routing map and
softmax scores written directly (no zeros + scatter). fp32 arithmetic, one rounding per stored element; the math is
in :mod:`sftprof.models.layers.router`.
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
    :data:`sftprof.models.layers.router.MAX_EXPERTS`: one ``[BLOCK_T, next_pow2(E)]`` fp32 tile per program).

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
