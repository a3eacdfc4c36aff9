"""Token log-probs / entropy from vocab-parallel logits, chunked over tokens on CPU, backward in place."""
from __future__ import annotations

import torch
import torch.distributed as dist

from sftprof.ops.guards import SavedBuffer, check_vocab_shards
from sftprof.ops.vocab_softmax import (check_labels_and_temperature, chunk_bounds, chunk_stats, grad_coefficients,
                                       shard_local_labels, tp_rank_and_size, write_softmax_grad_)

__all__ = ["vocab_parallel_logprobs"]


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp_group, chunk_size, temperature):
        n, v_local = logits.shape
        rank, _ = tp_rank_and_size(tp_group)
        inv_t = 1.0 / temperature
        local = shard_local_labels(labels, rank * v_local, v_local)
        logprob, entropy, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
        # The Triton kernels keep no [chunk, V] temporaries: on CUDA, chunks would only add launches (a 131072-token
        # sequence in chunks of 128 is ~15000 kernels of a few us each, and the GPU idles between them).
        bounds = chunk_bounds(n, chunk_size)  # validates chunk_size on every device
        if logits.is_cuda:
            bounds = chunk_bounds(n, 0)
        for s, e in bounds:
            st = chunk_stats(logits[s:e], local[s:e], inv_t, tp_group)
            logprob[s:e], entropy[s:e], lse[s:e] = st.logprob, st.entropy, st.lse
        ctx.logits = SavedBuffer(logits, "logits")
        ctx.save_for_backward(local, entropy, lse)
        ctx.bounds, ctx.inv_t = bounds, inv_t
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits = ctx.logits.get()
        ctx.logits.release()
        local, entropy, lse = ctx.saved_tensors
        for s, e in ctx.bounds:
            coef = grad_coefficients(None if grad_logprob is None else grad_logprob[s:e],
                                     None if grad_entropy is None else grad_entropy[s:e],
                                     entropy[s:e], ctx.inv_t, e - s, logits.device)
            write_softmax_grad_(logits[s:e], local[s:e], lse[s:e], coef, ctx.inv_t)
        return logits.detach(), None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, tp_group: dist.ProcessGroup | None = None,
                            chunk_size: int, temperature: float = 1.0, return_entropy: bool = False,
                            vocab_size: int | None = None):
    """Log-probabilities of ``labels`` (and softmax entropy) from this rank's vocabulary shard of the logits.

    Computed in fp32, with one all-reduce set (a MAX, then one SUM of three ``[chunk]`` fp32 vectors) per chunk
    across ``tp_group``; on CPU ``chunk_size`` tokens at a time, on CUDA all ``N`` rows at once whatever
    ``chunk_size`` is (the Triton kernels stream each row and keep only ``[N]`` fp32 statistics, so there is
    nothing for a chunk to bound, and per-chunk launches would leave the GPU idle). Rank ``r`` of ``tp_group`` holds
    vocabulary ids ``[r * V_local, (r + 1) * V_local)`` (Megatron's vocab-parallel layout).

    The backward writes ``d loss / d logits`` into the storage of ``logits`` itself (no new ``[N, V_local]``
    buffer) and hands that tensor to the producer's backward (e.g. the LM-head matmul), so **after the
    backward ``logits`` holds its gradient**. ``logits`` must therefore not be modified between forward and
    backward, nor needed afterwards: a modification or data swap is detected and raises
    :class:`sftprof.ops.guards.StaleBufferError`; other autograd users of ``logits`` whose backward runs later
    see its version counter move and raise autograd's in-place error.

    Args:
        logits: ``[N, V_local]`` bf16/fp16/fp32, last dim contiguous. Pass fp32 logits to get an fp32 gradient
            ("fp32 logprob storage"); bf16 logits get a bf16 gradient.
        labels: ``[N]`` int64 global vocabulary ids in ``[0, V_local * tp)``.
        tp_group: tensor-parallel group the vocabulary is split over (``None``: unsplit).
        chunk_size: tokens per chunk on CPU (0: all ``N`` at once), where it bounds the fp32 ``[chunk, V_local]``
            temporaries; ignored on CUDA (see above). Still validated (>= 0) on both.
        temperature: logits are divided by it before the softmax (> 0).
        return_entropy: also return the entropy; it is differentiable (detach it when the trainer's
            ``entropy_requires_grad`` is false).
        vocab_size: the full (padded) vocabulary size, when known; the TP group's shard widths must sum to
            it (catches full-vocabulary logits passed on every rank).
    Returns:
        fp32 ``[N]`` log-probs, or ``(logprobs, entropy)`` fp32 ``[N]`` each (nats), identical on all TP ranks.
    Raises:
        ValueError: bad shapes/dtypes, labels out of range, ``chunk_size < 0`` or ``temperature <= 0``;
            vocabulary shards of unequal width across ``tp_group`` or not summing to ``vocab_size``
            (:func:`sftprof.ops.guards.check_vocab_shards`; one all-gather of one int per call).
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [N, V_local] with a contiguous last dim, got shape {tuple(logits.shape)} "
                         f"stride {logits.stride()}")
    _, tp = tp_rank_and_size(tp_group)
    check_vocab_shards(logits.shape[1], tp_group, logits.device, "logits", vocab_size)
    check_labels_and_temperature(labels, logits.shape[0], logits.shape[1] * tp, temperature)
    logprobs, entropy = _VocabParallelLogprobs.apply(logits, labels, tp_group, chunk_size, float(temperature))
    return (logprobs, entropy) if return_entropy else logprobs
