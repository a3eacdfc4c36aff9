"""Row-wise softmax statistics and in-place softmax gradients over a vocabulary shard.

These are the building blocks shared by :func:`sftprof.ops.vocab_parallel_logprobs`,
:func:`sftprof.ops.linear_logprobs` and :func:`sftprof.ops.linear_sft_loss`. Each works on one
chunk of rows ``[n, V_local]`` of this rank's vocabulary shard. On CUDA tensors the work runs in the
Triton kernels of :mod:`sftprof.ops.triton_kernels` (imported lazily); elsewhere in plain torch
(fp32 temporaries of the chunk's size).

Math (``x = logits / T`` for temperature ``T``, ``p = softmax(x)`` over the full vocabulary, ``y`` the
label): ``logprob = x_y - lse`` and ``entropy = -sum_j p_j log p_j = log S - A / S`` with
``M = max_j x_j``, ``S = sum_j exp(x_j - M)``, ``A = sum_j exp(x_j - M) (x_j - M)`` and
``lse = M + log S``. Across a tensor-parallel group each rank holds a slice of the vocabulary: the
per-rank maxima are combined with one MAX all-reduce, the rescaled ``S``, ``A`` and target logit with
one SUM all-reduce (the "all-reduce set" of a chunk).

Gradient of ``L = sum_i g_lp[i] * logprob[i] + g_ent[i] * entropy[i]`` w.r.t. the raw logits
(standard softmax calculus; d entropy / dx_j = -p_j (log p_j + entropy)):
``dL/dlogits_j = (a * [j == y] - p_j * (b + c * log p_j))`` with per-row coefficients
``a = g_lp / T``, ``b = (g_lp + g_ent * entropy) / T``, ``c = g_ent / T``.

The SFT loss without a TP split (:func:`sft_chunk_`) defers the normalisation instead: shifting by the
target logit (plus ``ln V``) rather than the row maximum, ``exp(x - shift)`` can be written while the row is
read, and ``1 / S`` becomes a per-row factor on the small GEMM operands, so the chunk is read and written once.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["RowStats", "SHIFT_MARGIN", "shift_offset", "tp_rank_and_size", "shard_local_labels", "chunk_bounds",
           "check_labels_and_temperature", "chunk_stats", "grad_coefficients", "write_softmax_grad_",
           "defers_normalisation", "sft_chunk_", "scale_rows_"]


class RowStats:
    """Global (all-vocabulary) per-row softmax statistics of one chunk, all fp32 ``[n]``.

    ``lse``: log-sum-exp of ``x = logits / T``; ``logprob``: ``x_y - lse``; ``entropy``: softmax entropy (nats).
    """

    __slots__ = ("lse", "logprob", "entropy")

    def __init__(self, lse: torch.Tensor, logprob: torch.Tensor, entropy: torch.Tensor):
        self.lse, self.logprob, self.entropy = lse, logprob, entropy


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def tp_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world size)`` of this process in ``tp_group``; ``(0, 1)`` for ``None``."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def chunk_bounds(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """Row ranges ``[(start, end), ...]`` covering ``n`` rows, ``chunk_size`` at a time (0: one chunk).

    Raises:
        ValueError: if ``chunk_size`` is negative.
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = all tokens at once), got {chunk_size}")
    step = chunk_size or max(n, 1)
    return [(s, min(s + step, n)) for s in range(0, n, step)]


def check_labels_and_temperature(labels: torch.Tensor, n: int, vocab_size: int, temperature: float) -> None:
    """Validate ``labels`` (int64 ``[n]``, global ids in ``[0, vocab_size)``) and ``temperature`` (> 0).

    Raises:
        ValueError: naming the argument, the value seen and what is accepted.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if labels.dtype != torch.int64 or labels.shape != (n,):
        raise ValueError(f"labels must be int64 of shape ({n},), got {labels.dtype} {tuple(labels.shape)}")
    if n and (int(labels.min()) < 0 or int(labels.max()) >= vocab_size):
        raise ValueError(f"labels must be global vocabulary ids in [0, {vocab_size}), got min {int(labels.min())} "
                         f"max {int(labels.max())} (mask ignored tokens with loss weights, not with -100)")


def shard_local_labels(labels: torch.Tensor, vocab_start: int, vocab_local: int) -> torch.Tensor:
    """Map global label ids ``[n]`` (int64) to this shard's column index, ``-1`` where the label lies
    in another rank's shard. Returns int64 ``[n]``."""
    local = labels - vocab_start
    return torch.where((local >= 0) & (local < vocab_local), local, torch.full_like(local, -1))


def _local_stats_torch(logits: torch.Tensor, local_labels: torch.Tensor, inv_temp: float):
    x = logits.float() * inv_temp
    m = x.max(dim=1).values
    d = x - m[:, None]
    e = d.exp()
    s = e.sum(dim=1)
    a = torch.where(e > 0, e * d, 0.0).sum(dim=1)  # a -inf logit adds nothing (not 0 * -inf = NaN)
    idx = local_labels.clamp(min=0)[:, None]
    t = torch.where(local_labels >= 0, x.gather(1, idx).squeeze(1), torch.zeros_like(m))
    return m, s, a, t


def chunk_stats(logits: torch.Tensor, local_labels: torch.Tensor, inv_temp: float,
                tp_group: dist.ProcessGroup | None) -> RowStats:
    """Softmax statistics of a chunk of this rank's vocabulary shard, combined across ``tp_group``.

    Args:
        logits: ``[n, V_local]`` bf16/fp16/fp32, last dim contiguous (stride 1).
        local_labels: ``[n]`` int64 from :func:`shard_local_labels`.
        inv_temp: ``1 / temperature``.
        tp_group: tensor-parallel group over which the vocabulary is split (``None``: no split).
    Returns:
        :class:`RowStats` with fp32 ``[n]`` tensors, identical on every rank of ``tp_group``.
    """
    if _use_triton(logits):
        import sftprof.ops.triton_kernels as triton_kernels

        m, s, a, t = triton_kernels.row_stats(logits, local_labels, inv_temp)
    else:
        m, s, a, t = _local_stats_torch(logits, local_labels, inv_temp)
    if tp_rank_and_size(tp_group)[1] > 1:
        gmax = m.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp_group)
        scale = (m - gmax).exp()
        # Re-express this rank's partial sums relative to the global max, then sum over ranks.
        packed = torch.stack([s * scale, scale * (a + (m - gmax) * s), t])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
        m, (s, a, t) = gmax, packed.unbind(0)
    log_s = s.log()
    lse = m + log_s
    return RowStats(lse=lse, logprob=t - lse, entropy=log_s - a / s)


def grad_coefficients(grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                      entropy: torch.Tensor, inv_temp: float, n: int, device) -> torch.Tensor:
    """Per-row coefficients ``[3, n]`` fp32 (``a``, ``b``, ``c`` of the module docstring) for
    :func:`write_softmax_grad_`; a ``None`` upstream gradient counts as zero."""
    zeros = torch.zeros(n, dtype=torch.float32, device=device)
    g_lp = zeros if grad_logprob is None else grad_logprob.float()
    g_ent = zeros if grad_entropy is None else grad_entropy.float()
    return torch.stack([g_lp, g_lp + g_ent * entropy, g_ent]) * inv_temp


def write_softmax_grad_(logits: torch.Tensor, local_labels: torch.Tensor, lse: torch.Tensor,
                        coef: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """Overwrite ``logits`` ``[n, V_local]`` with ``dL/dlogits`` (same dtype), in place.

    ``lse`` ``[n]`` fp32 is the global log-sum-exp from :func:`chunk_stats`; ``coef`` ``[3, n]`` fp32
    from :func:`grad_coefficients` (fold any per-token loss weight in there). Returns ``logits``.
    Bumps the autograd version counter of ``logits`` so stale saved references fail loudly.
    """
    if _use_triton(logits):
        import sftprof.ops.triton_kernels as triton_kernels

        triton_kernels.softmax_grad_(logits, local_labels, lse, coef, inv_temp)
        torch.autograd.graph.increment_version(logits)
        return logits
    a, b, c = coef.unbind(0)
    logp = logits.float() * inv_temp - lse[:, None]
    g = torch.where(logp > float("-inf"), -logp.exp() * (b[:, None] + c[:, None] * logp), 0.0)
    rows = torch.nonzero(local_labels >= 0).squeeze(1)
    g[rows, local_labels[rows]] += a[rows]
    with torch.no_grad():
        logits.copy_(g)
    return logits


# Deferred-normalisation shift: the target logit plus shift_offset(V_local), unless exp(x - shift) could exceed
# e^SHIFT_MARGIN ~ 1e13 (then the row uses its maximum instead).
SHIFT_MARGIN = 30.0


def shift_offset(n_cols: int) -> float:
    """``ln(n_cols)``, in nats: the deferred-normalisation shift is the target logit plus this.

    The offset changes no result beyond rounding (``S`` and the row scale absorb it; exponentials underflow
    ``ln V`` nats earlier, below ~1e-35 of the row's gradient), only where the written exponentials and the
    scaled hidden rows sit in the floating-point range: for a flat row ``S`` is ~1 and the exponentials are
    ~``1/V``, like softmax probabilities, and the scaled hidden rows are ~``w * hidden / T``, instead of
    exponentials ~1 and ``w * hidden / (T V)``.
    This matters for speed: under the H200's 700 W cap the two gradient GEMMs run at a clock set by their
    power, which depends on the operands' bits (``bf16`` values straddling 1.0 flip all exponent bits);
    measured in bench/NOTES.md (fifth session).
    """
    return math.log(max(n_cols, 1))


def defers_normalisation(dtype: torch.dtype, tp_group: dist.ProcessGroup | None) -> bool:
    """Whether :func:`sft_chunk_` takes the deferred-normalisation path (and returns a row scale) for logits of
    ``dtype``: bf16 or fp32 without a TP split."""
    return tp_rank_and_size(tp_group)[1] == 1 and dtype in (torch.bfloat16, torch.float32)


def scale_rows_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """In place ``x[i, :] *= scale[i]`` for ``x`` ``[n, H]`` (any strides) and fp32 ``scale`` ``[n]``, the
    product formed in fp32 and rounded to ``x.dtype`` once. Returns ``x``."""
    if _use_triton(x):
        import sftprof.ops.triton_kernels as triton_kernels

        return triton_kernels.scale_rows_(x, scale)
    return x.mul_(scale[:, None])


def sft_chunk_(logits: torch.Tensor, local_labels: torch.Tensor, weights: torch.Tensor, inv_temp: float,
               tp_group: dist.ProcessGroup | None, rows: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of a chunk, and ``d(-sum_i w_i logprob_i)/dlogits`` written in place, up to a per-row scale.

    Args:
        logits: ``[n, V_local]`` bf16/fp16/fp32, overwritten.
        local_labels: ``[n]`` int64 from :func:`shard_local_labels`.
        weights: fp32 ``[n]`` per-token loss weights ``w``.
        inv_temp: ``1 / temperature``.
        rows: optional ``(src, dst)`` pair of ``[n, H]`` tensors (any strides; ``dst`` may be ``src``):
            on the deferred path ``dst <- row_scale[:, None] * src`` is written too (fused into the per-row
            finisher on CUDA), the operand the caller's ``d/dweight`` GEMM needs; untouched otherwise.
    Returns:
        ``(logprob, row_scale)``: fp32 ``[n]`` log-probs, and ``row_scale`` such that the gradient is
        ``row_scale[:, None] * logits`` after the call (``None``: ``logits`` holds the gradient itself).

    Deferred normalisation (:func:`defers_normalisation`: bf16/fp32 without a TP split; ``row_scale`` fp32 ``[n]``):
    with ``x = logits / T``, target ``t = x_y`` and a per-row shift ``s``, ``S = sum_j exp(x_j - s)``,
    ``logprob = t - s - log S`` and ``d(-w logprob)/dx_j = (w / S) (exp(x_j - s) - S [j == y])``. The logits
    are overwritten with ``E_j = exp(x_j - s) - S [j == y]`` and ``row_scale = w / (T S)``, so the chunk needs
    one read and one write (no statistics pass): the scale is folded into the GEMMs' small operands by the
    caller (``d/dweight = E^T (row_scale * hidden)``, ``d/dhidden = row_scale * (E @ W)``). The shift is
    ``s0 = t + shift_offset(V_local)`` unless that lets ``exp(x_j - s0)`` exceed ``e^SHIFT_MARGIN``. On CUDA a
    column block whose ``sum exp(x - s0)`` exceeds ``e^SHIFT_MARGIN`` (or is inf/NaN) is left raw, and the
    finisher rewrites its row shifted by the largest logit of its raw blocks (every shifted exponential then
    stays at most the block width; 2-3 extra passes over such rows only); on CPU rows whose maximum exceeds
    ``s0`` by more than :data:`SHIFT_MARGIN` are shifted by that maximum. The exponentials reach
    ``e^SHIFT_MARGIN``, and ``S`` (so the label column's ``-S``) ``V e^SHIFT_MARGIN``, beyond fp16's range, so
    fp16 takes the general path, as does a TP split (its global statistics come first: :func:`chunk_stats`,
    one all-reduce set): the gradient itself is written (:func:`write_softmax_grad_`) and ``row_scale`` is
    ``None``.
    """
    if not defers_normalisation(logits.dtype, tp_group):
        st = chunk_stats(logits, local_labels, inv_temp, tp_group)
        coef = grad_coefficients(-weights, None, st.entropy, inv_temp, logits.shape[0], logits.device)
        write_softmax_grad_(logits, local_labels, st.lse, coef, inv_temp)
        return st.logprob, None
    if _use_triton(logits):
        import sftprof.ops.triton_kernels as triton_kernels

        logprob, scale = triton_kernels.sft_shifted_exp_(logits, local_labels, weights, inv_temp, SHIFT_MARGIN,
                                                         shift_offset(logits.shape[1]), rows)
    else:
        x = logits.float() * inv_temp
        idx = torch.arange(x.shape[0], device=x.device)
        t = x[idx, local_labels]
        m = x.max(dim=1).values
        s0 = t + shift_offset(x.shape[1])
        s = torch.where(m - s0 > SHIFT_MARGIN, m, s0)
        e = (x - s[:, None]).exp()
        total = e.sum(dim=1)
        e[idx, local_labels] = (t - s).exp() - total
        with torch.no_grad():
            logits.copy_(e)
        logprob, scale = t - s - total.log(), weights * inv_temp / total
        if rows is not None:
            torch.mul(rows[0], scale[:, None], out=rows[1])
    torch.autograd.graph.increment_version(logits)
    return logprob, scale
