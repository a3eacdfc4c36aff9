"""Triton kernels for :mod:`sftprof.ops.vocab_softmax` (CUDA only; imported lazily).

All kernels stream one chunk of logits ``[n, V_local]`` (bf16/fp16/fp32, row stride arbitrary,
column stride 1) and compute in fp32. Row offsets are formed in int64, so chunks with more than
2**31 elements are addressed correctly.

- ``row_stats``: one program per row, a block-wise online max / sum-exp / sum-exp-times-shifted-logit
  over the row (the one-pass softmax normaliser of Milakov & Gimelshein, "Online normalizer
  calculation for softmax", 2018, extended with the entropy accumulator), plus the target logit.
- ``sft_rows_``: for an unsplit vocabulary, the online max / sum-exp and, in a second pass over the
  row, the gradient of ``-w * logprob`` written in place (one launch per chunk for the SFT loss); the
  loads carry L2 eviction hints (keep the row for the second pass, then stream it out).
- ``softmax_grad_``: elementwise over ``(row, column block)``, overwrites the logits with
  ``a [j == y] - p_j (b + c log p_j)`` (see :mod:`sftprof.ops.vocab_softmax`).

Launch configurations (``BLOCK``, ``num_warps``) are chosen with ``triton.autotune`` from a small list
(``row_stats``: BLOCK 4096/8192/16384 x 8/16/32 warps; ``sft_rows_``: BLOCK 8192/16384/32768 x 16/32
warps; elementwise kernel: BLOCK 1024/2048/4096 x 4/8 warps; measurements in bench/NOTES.md), keyed
on the number of columns and the row stride (the autotuner adds the tensor dtypes), so each kernel is
tuned once per vocabulary-shard size and dtype, on its first call in the process; the
chosen config is cached in memory for the rest of the process. Different configs only change the
order of the fp32 reductions, so results may differ in the last bits between processes.

Autotuning launches a kernel many times on the caller's real arguments. ``sft_rows_`` and
``softmax_grad_`` overwrite their input logits in place, so a second timing launch would read
gradients instead of logits; they therefore declare ``restore_value=["x_ptr"]``: the autotuner
clones the logits before each timing launch and copies them back after it, and the final launch
with the chosen config runs on the original logits. This costs one extra ``[n, V_local]`` buffer
(and the copies) during tuning only. No kernel accumulates into an output (every output element is
written exactly once per launch), so no ``reset_to_zero`` is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Statistics row kernel: one program per row streams the whole row in BLOCK-wide steps.
_ROW_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (4096, 8192, 16384) for w in (8, 16, 32)]
# Elementwise gradient kernel: one program per (row, BLOCK columns).
_GRAD_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]
# Tune once per vocabulary-shard width / row stride (the autotuner also keys on the tensor dtypes).
_KEY = ["n_cols", "stride_row"]


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
        a = scale * (a + (m - m_new) * s) + tl.sum(tl.where(mask, e * (x - m_new), 0.0), axis=0)
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


# Fused SFT row kernel (one program per row): BLOCK up to 32768 as Liger-Kernel's cross-entropy kernel uses.
_SFT_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (8192, 16384, 32768) for w in (16, 32)]


# In place: restore the logits between the autotuner's timing launches.
@triton.autotune(configs=_SFT_CONFIGS, key=_KEY, restore_value=["x_ptr"])
@triton.jit
def _sft_rows_kernel(x_ptr, stride_row, n_cols, lab_ptr, w_ptr, lp_ptr, inv_temp, BLOCK: tl.constexpr):
    """Whole-vocabulary rows (no TP split): log-prob of the label, then the row overwritten with
    d(-w * logprob)/dlogits = w / T * (softmax - onehot). Two passes over the row: online max / sum-exp
    with loads that ask L2 to keep the row (evict_last), then the gradient with loads and stores that
    stream it out (evict_first). On an H200 the hints made it 1-3 % faster, though the second read still
    mostly comes from HBM (bench/NOTES.md)."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    m = -1.0e30
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf"),
                    eviction_policy="evict_last").to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    idx, t = _target_logit(base, lab_ptr, row, inv_temp)
    lse = m + tl.log(s)
    tl.store(lp_ptr + row, t - lse)
    coef = tl.load(w_ptr + row) * inv_temp
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * inv_temp
        g = coef * (tl.exp(x - lse) - tl.where(cols == idx, 1.0, 0.0))
        tl.store(base + cols, g.to(x_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first")


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
                                out[2], out[3], inv_temp)
    return out.unbind(0)


def softmax_grad_(logits: torch.Tensor, local_labels: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
                  inv_temp: float) -> None:
    """In-place ``logits <- dL/dlogits`` (see :func:`sftprof.ops.vocab_softmax.write_softmax_grad_`)."""
    _check(logits)
    n, v = logits.shape
    if n:
        def grid(meta):
            return (n, triton.cdiv(v, meta["BLOCK"]))

        _softmax_grad_kernel[grid](logits, logits.stride(0), v, n, local_labels.contiguous(), lse.contiguous(),
                                   coef.contiguous(), inv_temp)


def sft_rows_(logits: torch.Tensor, local_labels: torch.Tensor, weights: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """Unsplit vocabulary: fp32 ``[n]`` log-probs of the labels; ``logits`` is overwritten with
    ``d(-sum w * logprob)/dlogits`` (``weights`` fp32 ``[n]``)."""
    _check(logits)
    n, v = logits.shape
    logprob = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _sft_rows_kernel[(n,)](logits, logits.stride(0), v, local_labels.contiguous(), weights.contiguous(), logprob,
                               inv_temp)
    return logprob
