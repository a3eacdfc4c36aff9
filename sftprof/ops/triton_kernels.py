"""Triton kernels for :mod:`sftprof.ops.vocab_softmax` (CUDA only; imported lazily).

All kernels stream one chunk of logits ``[n, V_local]`` (bf16/fp16/fp32, row stride arbitrary,
column stride 1; the ``[n, H]`` hidden-state rows that the SFT path scales may have any strides) and
compute in fp32. Row offsets are formed in int64, so chunks with more than 2**31 elements are addressed
correctly.

- ``row_stats``: one program per row, a block-wise online max / sum-exp / sum-exp-times-shifted-logit
  over the row (the one-pass softmax normaliser of Milakov & Gimelshein, "Online normalizer
  calculation for softmax", 2018, extended with the entropy accumulator), plus the target logit.
- ``sft_shifted_exp_``: for an unsplit vocabulary, the SFT loss with deferred normalisation (see
  :func:`sftprof.ops.vocab_softmax.sft_chunk_`): a gather of the target logits, an elementwise pass over
  ``(row, column block)`` that overwrites the logits with ``exp(x - x_y - offset)`` and stores per-block fp32 sums
  (-1 for a block left raw because its sum exceeds ``e^margin`` or is not finite; one read + one write of the
  chunk), then a per-row finisher that combines the block sums, patches the label column, rewrites rows with a
  raw block using the largest logit of those blocks as the shift, and optionally scales a row of the
  ``[n, H]`` hidden states by the row's gradient scale (the ``d/dweight`` GEMM's operand).
- ``scale_rows_``: in-place ``[n, H]`` row scaling (the ``d/dhidden`` rows of the SFT loss).
- ``softmax_grad_``: elementwise over ``(row, column block)``, overwrites the logits with
  ``a [j == y] - p_j (b + c log p_j)`` (see :mod:`sftprof.ops.vocab_softmax`).

Launch configurations (``BLOCK``, ``num_warps``) are chosen with ``triton.autotune`` from a small list
(``row_stats``: BLOCK 4096/8192/16384 x 8/16/32 warps; the elementwise pass of ``sft_shifted_exp_``: one row x
1024-4096 columns with 2/4 warps, and its finisher uses the BLOCK chosen there; gradient kernel: BLOCK
1024/2048/4096 x 4/8 warps; measurements in bench/NOTES.md), keyed
on the number of columns and the row stride (the autotuner adds the tensor dtypes), so each kernel is
tuned once per vocabulary-shard size and dtype, on its first call in the process; the
chosen config is cached in memory for the rest of the process. Different configs only change the
order of the fp32 reductions, so results may differ in the last bits between processes.

Autotuning launches a kernel many times on the caller's real arguments. The elementwise pass of
``sft_shifted_exp_`` and ``softmax_grad_`` overwrite their input logits in place, so a second timing launch would read
gradients instead of logits; they therefore declare ``restore_value=["x_ptr"]``: the autotuner
clones its argument before each timing launch and copies it back after it. So that the clone is not the whole
chunk (37 GiB at 131072 x 151936 bf16, an OOM on an 80 GB GPU), the first call per key with more than
``_TUNE_ROWS`` rows tunes on a copy of its first ``_TUNE_ROWS`` rows (same row stride, dtypes and column count:
the same key, so the real launch finds the choice cached): 2 x ``_TUNE_ROWS x stride_row`` elements during tuning
(1.16 GiB at 151936 bf16), whatever the chunk. The elementwise kernels' grids cover ``_TUNE_ROWS`` x 38-149 column
blocks there, many waves of every config, so the ranking is that of the full chunk. No kernel accumulates into an
output (every output element is written exactly once per launch), so no ``reset_to_zero`` is needed.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Statistics row kernel: one program per row streams the whole row in BLOCK-wide steps.
_ROW_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (4096, 8192, 16384) for w in (8, 16, 32)]
# Elementwise gradient kernel: one program per (row, BLOCK columns).
_GRAD_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]
# Tune once per vocabulary-shard width / row stride (the autotuner also keys on the tensor dtypes).
_KEY = ["n_cols", "stride_row"]
# Rows an in-place kernel is tuned on (a copy), the chunk size its configs were measured at (bench/NOTES.md).
_TUNE_ROWS = 2048
_tuned: set[tuple] = set()  # (kernel, n_cols, stride_row, dtype) tuned in this process


def _tune_on_copy(kernel, logits: torch.Tensor, launch) -> None:
    """On the first call per key of the in-place autotuned ``kernel`` with more than ``_TUNE_ROWS`` rows of
    ``logits`` ``[n, V]``, run ``launch(x, rows)`` on a copy of the first ``_TUNE_ROWS`` rows with the same row
    stride: the autotuner's ``restore_value`` clones that copy, not the chunk, and caches its choice for the key."""
    n, v = logits.shape
    key = (kernel, v, logits.stride(0), logits.dtype)
    if key in _tuned:
        return
    if n > _TUNE_ROWS:
        copy = logits.new_empty(_TUNE_ROWS, logits.stride(0))[:, :v]
        launch(copy.copy_(logits[:_TUNE_ROWS]), _TUNE_ROWS)
    _tuned.add(key)


@triton.jit
def _online_row_stats(base, n_cols, inv_temp, BLOCK: tl.constexpr):
    """(max, sum exp(x - max), sum exp(x - max)(x - max)) of one row, x = logits * inv_temp, fp32.
    Block-wise online update: one exp per element plus one scalar rescale per block."""
    offs = tl.arange(0, BLOCK)
    m = -1.0e30
    s = 0.0
    a = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        # e > 0: a -inf logit (masked vocabulary entry) adds nothing (not 0 * -inf = NaN).
        a = scale * (a + (m - m_new) * s) + tl.sum(tl.where(e > 0, e * (x - m_new), 0.0), axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    return m, s, a


@triton.jit
def _target_logit(base, lab_ptr, row, inv_temp):
    idx = tl.load(lab_ptr + row)
    t = tl.load(base + tl.maximum(idx, 0)).to(tl.float32) * inv_temp
    return idx, tl.where(idx >= 0, t, 0.0)


@triton.autotune(configs=_ROW_CONFIGS, key=_KEY)
@triton.jit
def _row_stats_kernel(x_ptr, stride_row, n_cols, lab_ptr, m_ptr, s_ptr, a_ptr, t_ptr, inv_temp,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    m, s, a = _online_row_stats(base, n_cols, inv_temp, BLOCK)
    _, t = _target_logit(base, lab_ptr, row, inv_temp)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(a_ptr + row, a)
    tl.store(t_ptr + row, t)


# SFT loss, unsplit vocabulary, deferred normalisation (see sftprof.ops.vocab_softmax.sft_chunk_):
# _target_kernel gathers the target logits; _shifted_exp_kernel overwrites each (row, column block) of the logits
# with exp(x - t - offset) and stores the block's fp32 sum, or, if that sum exceeds e^margin or is not finite,
# leaves the block raw and stores -1; then _sft_finish_kernel, per row. Tiles measured at chunk 1760 x 151936 bf16
# on an H200 (bench/NOTES.md): 1 row x 1024-4096 columns with 2-4 warps are within 1 % of each other; 8 warps or
# 2-row tiles are 3-4 % slower.
_EXP_CONFIGS = [triton.Config({"ROWS": r, "BLOCK": b}, num_warps=w)
                for r, b, w in ((1, 1024, 2), (1, 2048, 2), (1, 2048, 4), (1, 4096, 4))]
_EXP_MIN_BLOCK = 1024


@triton.jit
def _target_kernel(x_ptr, stride_row, n_rows, lab_ptr, out_ptr, BLOCK: tl.constexpr):
    """out[i] = logits[i, labels[i]] as fp32, BLOCK rows per program (labels are in range: unsplit vocabulary)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    idx = tl.load(lab_ptr + rows, mask=mask, other=0)
    v = tl.load(x_ptr + rows.to(tl.int64) * stride_row + idx, mask=mask, other=0.0)
    tl.store(out_ptr + rows, v.to(tl.float32), mask=mask)


# In place: restore the logits between the autotuner's timing launches.
@triton.autotune(configs=_EXP_CONFIGS, key=_KEY, restore_value=["x_ptr"])
@triton.jit
def _shifted_exp_kernel(x_ptr, stride_row, n_rows, n_cols, tgt_ptr, psum_ptr, stride_p, inv_temp, offset, keep_above,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (ROWS rows, column block): x = logits * inv_temp, shift s = t + offset with t = target logit *
    inv_temp (``tgt_ptr``: the raw target logits as fp32, gathered before the launch since this pass overwrites
    them). A block whose sum of exp(x - s) exceeds ``keep_above`` (e^margin), or is inf or NaN (overflow; a -inf
    target logit), is written back unchanged (a select, not a branch, so every row streams); a block that
    passes holds no element above e^margin."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    ptrs = x_ptr + rows[:, None] * stride_row + cols[None, :]
    raw = tl.load(ptrs, mask=mask, other=float("-inf"))
    t = tl.load(tgt_ptr + rows, mask=rows < n_rows, other=0.0) * inv_temp + offset
    e = tl.exp(raw.to(tl.float32) * inv_temp - t[:, None])
    total = tl.sum(e, axis=1)
    keep = ~(total <= keep_above)  # NaN (a -inf target logit: exp(-inf + inf)) counts as raw too
    tl.store(ptrs, tl.where(keep[:, None], raw, e.to(x_ptr.dtype.element_ty)), mask=mask)
    tl.store(psum_ptr + rows * stride_p + blk, tl.where(keep, -1.0, total), mask=rows < n_rows)


@triton.jit
def _sft_finish_kernel(x_ptr, stride_row, n_cols, lab_ptr, tgt_ptr, w_ptr, psum_ptr, stride_p, n_blocks,
                       lp_ptr, scale_ptr, inv_temp, offset, src_ptr, src_row, src_col, dst_ptr, dst_row, dst_col,
                       n_hidden, BLOCK: tl.constexpr, PB: tl.constexpr, SCALE_ROWS: tl.constexpr,
                       HBLOCK: tl.constexpr):
    """Program per row, after _shifted_exp_kernel with column blocks of width BLOCK and the same ``offset``.
    Shift s = s0 = t + offset, or, if some block was left raw, the largest value m in the raw blocks: raw
    blocks -> exp(x - m), the others rescaled by exp(s0 - m), all rewritten but the label column, which is
    stored once, at the end. A raw block's sum exceeds e^margin, so m >= s0 + margin - ln(BLOCK), while the
    other blocks hold no x above s0 + margin: every rewritten value is at most BLOCK.
    S = sum_j exp(x_j - s) from the fp32 block sums (the raw blocks' summed here); logprob = t - s - log S;
    the label column gets exp(t - s) - S; scale = w * inv_temp / S. With SCALE_ROWS also
    dst[row, :n_hidden] = scale * src[row, :n_hidden] (dst may be src: each program reads its row first)."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    prow = psum_ptr + row * stride_p
    y = tl.load(lab_ptr + row)
    t = tl.load(tgt_ptr + row) * inv_temp
    s0 = t + offset
    bo = tl.arange(0, PB)
    psum = tl.load(prow + bo, mask=bo < n_blocks, other=0.0)
    if tl.min(psum, axis=0) < 0:
        offs = tl.arange(0, BLOCK)
        m = float("-inf")
        for b in range(n_blocks):
            if tl.load(prow + b) < 0:
                cols = b * BLOCK + offs
                v = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                m = tl.maximum(m, tl.max(v * inv_temp, axis=0))
        rescale = tl.exp(s0 - m)
        total = 0.0
        for b in range(n_blocks):
            cols = b * BLOCK + offs
            mask = cols < n_cols
            v = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            part = tl.load(prow + b)
            if part < 0:
                e = tl.where(mask, tl.exp(v * inv_temp - m), 0.0)
                total += tl.sum(e, axis=0)
            else:
                e = v * rescale
                total += part * rescale
            # Not the label column: it is written once, below (two unordered stores to it would race).
            tl.store(base + cols, e.to(x_ptr.dtype.element_ty), mask=mask & (cols != y))
        s = m
    else:
        s = s0
        total = tl.sum(psum, axis=0)
    scale = tl.load(w_ptr + row) * inv_temp / total
    tl.store(lp_ptr + row, t - s - tl.log(total))
    tl.store(base + y, (tl.exp(t - s) - total).to(x_ptr.dtype.element_ty))
    tl.store(scale_ptr + row, scale)
    if SCALE_ROWS:
        for start in range(0, n_hidden, HBLOCK):
            hc = start + tl.arange(0, HBLOCK)
            hm = hc < n_hidden
            hc64 = hc.to(tl.int64)
            hv = tl.load(src_ptr + row * src_row + hc64 * src_col, mask=hm, other=0.0).to(tl.float32)
            tl.store(dst_ptr + row * dst_row + hc64 * dst_col, (hv * scale).to(dst_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _scale_rows_kernel(x_ptr, stride_row, stride_col, n_cols, scale_ptr, BLOCK: tl.constexpr):
    """In place: x[row, block] *= scale[row] (fp32 math), one program per (row, column block)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = x_ptr + row * stride_row + cols.to(tl.int64) * stride_col
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr + row)
    tl.store(ptrs, v.to(x_ptr.dtype.element_ty), mask=mask)


# In place: restore the logits between the autotuner's timing launches.
@triton.autotune(configs=_GRAD_CONFIGS, key=_KEY, restore_value=["x_ptr"])
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
    g = tl.where(logp > float("-inf"), -tl.exp(logp) * (cb + cc * logp), 0.0)  # p = 0: no gradient, not NaN
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
                                out[2], out[3], inv_temp)
    return out.unbind(0)


def softmax_grad_(logits: torch.Tensor, local_labels: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                  inv_temp: float) -> None:
    """In-place ``logits <- dL/dlogits`` (see :func:`sftprof.ops.vocab_softmax.write_softmax_grad_`)."""
    _check(logits)
    n, v = logits.shape
    if n:
        def launch(x, rows):
            def grid(meta):
                return (rows, triton.cdiv(v, meta["BLOCK"]))

            _softmax_grad_kernel[grid](x, x.stride(0), v, rows, local_labels[:rows].contiguous(),
                                       lse[:rows].contiguous(), coef[:, :rows].contiguous(), inv_temp)

        _tune_on_copy(_softmax_grad_kernel, logits, launch)
        launch(logits, n)


def _rows_block(n_cols: int) -> int:
    return min(triton.next_power_of_2(max(n_cols, 1)), 2048)


def scale_rows_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """In place ``x[i, :] *= scale[i]`` for ``x`` ``[n, H]`` (bf16/fp16/fp32, any strides) and fp32 ``scale``
    ``[n]``; the product is formed in fp32 and rounded to ``x.dtype`` once. Returns ``x``."""
    n, h = x.shape
    if n and h:
        block = _rows_block(h)
        _scale_rows_kernel[(n, triton.cdiv(h, block))](x, x.stride(0), x.stride(1), h, scale.contiguous(),
                                                       BLOCK=block, num_warps=4)
    return x


def sft_shifted_exp_(logits: torch.Tensor, local_labels: torch.Tensor, weights: torch.Tensor, inv_temp: float,
                     margin: float, offset: float, rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                     config: triton.Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsplit vocabulary, in place: ``logits <- exp(x - s) - S [j == y]`` with the per-row shift (target logit
    + ``offset``, or the row's largest logit, see below) and sum of
    :func:`sftprof.ops.vocab_softmax.sft_chunk_`; returns fp32 ``[n]`` log-probs and row scales. ``rows``: an
    optional ``(src, dst)`` pair of ``[n, H]`` tensors (any strides; ``dst`` may be ``src``): the finisher
    also writes ``dst <- scale[:, None] * src``. Launches: the target gather, the elementwise pass over
    ``(row, block)`` (one read + one write of the chunk; a block whose ``sum exp(x - t - offset)`` exceeds
    ``e^margin`` is left raw, and its row is read and rewritten again by the finisher) and the per-row
    finisher; ``4 x n x ceil(V / 1024)`` bytes of fp32 block sums on the side. ``config``: one of
    ``_EXP_CONFIGS`` to launch the elementwise pass with instead of the autotuned choice (benchmarks)."""
    _check(logits)
    n, v = logits.shape
    if not n:
        return torch.empty(0, device=logits.device), torch.empty(0, device=logits.device)
    labels = local_labels.contiguous()
    # Raw target logits first: the elementwise pass overwrites them.
    target = torch.empty(n, dtype=torch.float32, device=logits.device)
    _target_kernel[(triton.cdiv(n, 1024),)](logits, logits.stride(0), n, labels, target, BLOCK=1024, num_warps=4)
    psum = torch.empty(n, triton.cdiv(v, _EXP_MIN_BLOCK), dtype=torch.float32, device=logits.device)

    def launch(x, rows, **fixed):
        def grid(meta):
            return (triton.cdiv(rows, meta["ROWS"]), triton.cdiv(v, meta["BLOCK"]))

        args = (x, x.stride(0), rows, v, target[:rows], psum[:rows], psum.stride(0), inv_temp, offset,
                math.exp(margin))
        if fixed:
            _shifted_exp_kernel.fn[grid(fixed)](*args, **fixed)
        else:
            _shifted_exp_kernel[grid](*args)

    if config is None:
        _tune_on_copy(_shifted_exp_kernel, logits, launch)
        launch(logits, n)
        config = _shifted_exp_kernel.best_config
    else:
        launch(logits, n, **config.kwargs, num_warps=config.num_warps)
    block = config.kwargs["BLOCK"]
    out = torch.empty(2, n, dtype=torch.float32, device=logits.device)
    nb = triton.cdiv(v, block)
    src, dst = (out, out) if rows is None else rows  # out: unused, SCALE_ROWS is off
    hidden = 0 if rows is None else src.shape[1]
    _sft_finish_kernel[(n,)](logits, logits.stride(0), v, labels, target, weights.contiguous(), psum, psum.stride(0),
                             nb, out[0], out[1], inv_temp, offset, src, *src.stride(), dst, *dst.stride(), hidden,
                             BLOCK=block, PB=triton.next_power_of_2(nb), SCALE_ROWS=rows is not None,
                             HBLOCK=_rows_block(hidden), num_warps=4)
    return out[0], out[1]
