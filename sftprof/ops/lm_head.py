"""LM head (``hidden @ weight.T``) fused with token log-probs, chunked over tokens.

Two entries share the chunk loop: :func:`linear_logprobs` (general log-probs + entropy, logits recomputed
in the backward: 4 GEMMs) and :func:`linear_sft_loss` (loss linear in the log-probs, so the gradients are
formed in the forward: 3 GEMMs, nothing recomputed). Neither ever holds more than ``chunk_size x V_local``
logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from sftprof.ops.guards import SavedBuffer, StaleBufferError, check_vocab_shards
from sftprof.ops.vocab_softmax import (check_labels_and_temperature, chunk_bounds, chunk_stats, defers_normalisation,
                                       grad_coefficients, scale_rows_, sft_chunk_, shard_local_labels, tp_rank_and_size,
                                       write_softmax_grad_)

__all__ = ["linear_logprobs", "linear_sft_loss"]


def _check_linear_inputs(hidden, weight, labels, tp_group, temperature, sequence_parallel, grad_in_hidden,
                         vocab_size) -> int:
    """Validate and return ``N``, the number of tokens of the full (gathered) sequence."""
    if grad_in_hidden and not _reuses_gathered_copy(tp_group, sequence_parallel) and not hidden.is_contiguous():
        raise ValueError(f"grad_in_hidden=True needs a contiguous hidden, got strides {hidden.stride()}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V_local, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    _, tp = tp_rank_and_size(tp_group)
    check_vocab_shards(weight.shape[0], tp_group, weight.device, "weight", vocab_size)
    n = hidden.shape[0] * (tp if sequence_parallel else 1)
    check_labels_and_temperature(labels, n, weight.shape[0] * tp, temperature)
    return n


def _gather_tokens(hidden: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """Sequence parallel: all-gather the ``[N/tp, H]`` shards along tokens into ``[N, H]``."""
    _, tp = tp_rank_and_size(tp_group)
    if not sequence_parallel or tp == 1:
        return hidden
    full = hidden.new_empty(hidden.shape[0] * tp, hidden.shape[1])
    dist.all_gather_into_tensor(full, hidden.contiguous(), group=tp_group)
    return full


def _reuses_gathered_copy(tp_group, sequence_parallel: bool) -> bool:
    """Sequence parallel with tp > 1: ``d/dhidden`` goes into our own all-gathered copy of the hidden states,
    so ``grad_in_hidden`` does not apply."""
    return sequence_parallel and tp_rank_and_size(tp_group)[1] > 1


def _grad_hidden_buffer(hidden: torch.Tensor, h_full: torch.Tensor, tp_group, sequence_parallel: bool,
                        grad_in_hidden: bool) -> tuple[torch.Tensor, bool]:
    """Where ``d/dhidden`` ``[N, H]`` is written, and whether that is the caller's ``hidden``: the
    all-gathered copy (sequence parallel, tp > 1: ours to reuse), ``hidden``'s own storage
    (``grad_in_hidden``: an alias sharing its autograd version counter, so the writes bump it), or a new
    buffer. Chunk ``c``'s rows are overwritten with ``d/dhidden`` only after the chunk's ``d/dweight`` GEMM has
    read them (the SFT loss's deferred normalisation first scales them in place, as that GEMM's operand)."""
    if _reuses_gathered_copy(tp_group, sequence_parallel):
        return h_full, False
    return (hidden.detach(), True) if grad_in_hidden else (torch.empty_like(h_full), False)


def _reduce_grad_hidden(grad: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """Sum this vocab shard's partial ``d/dhidden`` over TP ranks: reduce-scatter along tokens
    (sequence parallel) or all-reduce (hidden replicated on the TP ranks, as after Megatron's
    copy-to-tensor-parallel-region)."""
    _, tp = tp_rank_and_size(tp_group)
    if tp == 1:
        return grad
    if sequence_parallel:
        out = grad.new_empty(grad.shape[0] // tp, grad.shape[1])
        dist.reduce_scatter_tensor(out, grad, group=tp_group)
        return out
    dist.all_reduce(grad, group=tp_group)
    return grad


class _WeightGrad:
    """Accumulates ``sum_chunks grad_logits_c.T @ hidden_c`` for the ``[V_local, H]`` LM-head weight.

    Megatron style: if ``weight.main_grad`` exists, accumulation goes straight into it (its dtype, fp32
    in practice; bf16 x bf16 -> fp32 through cuBLAS on CUDA). The autograd gradient is then ``None``, or,
    when ``weight.grad_added_to_main_grad`` exists (Megatron DDP parameters), an uninitialised placeholder
    with that flag set to ``True`` so that DDP's gradient hook fires and discards it. Otherwise a
    gradient of ``weight.dtype`` is accumulated chunk by chunk (cuBLAS beta=1, fp32 inside each GEMM): for a
    bf16 weight each chunk's sum is rounded to bf16, so the error grows with the number of chunks (CPU,
    N = 8192, max error relative to fp64: 2.7e-3 for plain bf16 autograd, 3.3e-3 at chunk 4096, 4.6e-3 at
    1024, 1.1e-2 at 256); ``main_grad`` (fp32) avoids it, as the megatron engine does.
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.main_grad = getattr(weight, "main_grad", None)
        self.acc = self.main_grad
        self.first = self.main_grad is None

    def add(self, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
        a = grad_logits.t()
        if self.first:
            self.acc = torch.mm(a, hidden)
            self.first = False
        elif self.acc.dtype == a.dtype:
            self.acc.addmm_(a, hidden)
        elif self.acc.is_cuda:
            torch.addmm(self.acc, a, hidden, out_dtype=self.acc.dtype, out=self.acc)
        else:
            self.acc.addmm_(a.to(self.acc.dtype), hidden.to(self.acc.dtype))

    def result(self, scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """The autograd gradient (``None`` or a placeholder in main_grad mode), multiplied by ``scale`` if given
        (``None``: an incoming gradient of 1).

        Raises:
            ValueError: in main_grad mode when ``scale`` is given (the contribution was already added).
        """
        if self.main_grad is not None:
            if scale is not None:
                raise ValueError(
                    "linear_sft_loss added the LM-head weight gradient to weight.main_grad during the forward, so "
                    f"the loss must be back-propagated with gradient 1 (got {float(scale)}); fold loss scaling "
                    "(1/num_microbatches, 1/num_tokens) into loss_weight instead")
            if not hasattr(self.weight, "grad_added_to_main_grad"):
                return None
            # Megatron DDP: its gradient hook on the weight's grad accumulator only fires for a non-None
            # gradient (with overlap_grad_reduce it marks the bucket ready); grad_added_to_main_grad tells
            # it to drop this placeholder instead of adding it (as megatron-core's own linear layers do).
            self.weight.grad_added_to_main_grad = True
            if getattr(self.weight, "zero_out_wgrad", False):
                return torch.zeros_like(self.weight)
            return torch.empty_like(self.weight)
        acc, self.acc = self.acc, None
        if acc is None:  # zero tokens
            return torch.zeros_like(self.weight)
        return acc if scale is None else acc.mul_(scale)


def _chunk_loop(h_full, weight, bounds, on_chunk):
    """Run ``on_chunk(start, end, logits_chunk)`` over token chunks, reusing one ``[chunk, V_local]``
    logits buffer of ``hidden.dtype``."""
    if not bounds:
        return
    buf = h_full.new_empty(bounds[0][1] - bounds[0][0], weight.shape[0])
    for s, e in bounds:
        lg = buf[: e - s]
        torch.mm(h_full[s:e], weight.t(), out=lg)
        on_chunk(s, e, lg)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, tp_group, chunk_size, temperature, sequence_parallel, grad_in_hidden):
        rank, _ = tp_rank_and_size(tp_group)
        h_full = _gather_tokens(hidden, tp_group, sequence_parallel)
        n, v_local = h_full.shape[0], weight.shape[0]
        local = shard_local_labels(labels, rank * v_local, v_local)
        logprob, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        bounds = chunk_bounds(n, chunk_size)

        def on_chunk(s, e, lg):
            st = chunk_stats(lg, local[s:e], 1.0 / temperature, tp_group)
            logprob[s:e], entropy[s:e], lse[s:e] = st.logprob, st.entropy, st.lse

        _chunk_loop(h_full, weight, bounds, on_chunk)
        ctx.hidden, ctx.weight = SavedBuffer(hidden, "hidden"), SavedBuffer(weight, "weight")
        ctx.save_for_backward(local, entropy, lse)
        ctx.cfg = (tp_group, bounds, 1.0 / temperature, sequence_parallel, grad_in_hidden)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        tp_group, bounds, inv_t, sequence_parallel, grad_in_hidden = ctx.cfg
        hidden, weight = ctx.hidden.get(), ctx.weight.get()
        ctx.hidden.release()
        ctx.weight.release()
        local, entropy, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        h_full = _gather_tokens(hidden, tp_group, sequence_parallel)
        grad_h = _grad_hidden_buffer(hidden, h_full, tp_group, sequence_parallel, grad_in_hidden)[0] if need_h else None
        wgrad = _WeightGrad(weight) if need_w else None

        def on_chunk(s, e, lg):
            coef = grad_coefficients(None if grad_logprob is None else grad_logprob[s:e],
                                     None if grad_entropy is None else grad_entropy[s:e],
                                     entropy[s:e], inv_t, e - s, lg.device)
            write_softmax_grad_(lg, local[s:e], lse[s:e], coef, inv_t)
            if need_w:  # before d/dhidden, which may overwrite these hidden rows
                wgrad.add(lg, h_full[s:e])
            if need_h:
                torch.mm(lg, weight, out=grad_h[s:e])

        _chunk_loop(h_full, weight, bounds, on_chunk)
        if need_h:
            grad_h = _reduce_grad_hidden(grad_h, tp_group, sequence_parallel)
        return grad_h, (wgrad.result() if need_w else None), None, None, None, None, None, None


class _LinearSFTLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_weight, tp_group, chunk_size, temperature, sequence_parallel,
                need_h, need_w, grad_in_hidden):
        rank, _ = tp_rank_and_size(tp_group)
        h_full = _gather_tokens(hidden, tp_group, sequence_parallel)
        n, v_local = h_full.shape[0], weight.shape[0]
        local = shard_local_labels(labels, rank * v_local, v_local)
        w = loss_weight.to(device=hidden.device, dtype=torch.float32)
        inv_t = 1.0 / temperature
        grad_h, aliased = (_grad_hidden_buffer(hidden, h_full, tp_group, sequence_parallel, grad_in_hidden) if need_h
                           else (None, False))
        wgrad = _WeightGrad(weight) if need_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # d loss / d loss_weight = -logprob: kept (fp32 [N]) only if loss_weight requires grad.
        logprob = torch.empty(n, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[3] else None

        bounds = chunk_bounds(n, chunk_size)
        # d/dweight's operand on the deferred path (see sft_chunk_): the chunk's hidden rows times the row scale,
        # written by the chunk's finisher in place over rows that d/dhidden overwrites next anyway
        # (grad_in_hidden), else into a [chunk, H] scratch buffer.
        deferred = need_w and defers_normalisation(h_full.dtype, tp_group)
        scratch = None
        if deferred and not aliased and bounds:
            scratch = h_full.new_empty(bounds[0][1] - bounds[0][0], h_full.shape[1])

        def on_chunk(s, e, lg):
            if not (need_h or need_w):
                lp = chunk_stats(lg, local[s:e], inv_t, tp_group).logprob
            else:
                rows = (h_full[s:e], grad_h[s:e] if aliased else scratch[: e - s]) if deferred else None
                lp, scale = sft_chunk_(lg, local[s:e], w[s:e], inv_t, tp_group, rows)
                if need_w:  # before d/dhidden, which may overwrite these hidden rows
                    wgrad.add(lg, h_full[s:e] if rows is None else rows[1])
                if need_h:
                    torch.mm(lg, weight, out=grad_h[s:e])
                    if scale is not None:
                        scale_rows_(grad_h[s:e], scale)
            loss.sub_(torch.dot(lp, w[s:e]))
            if logprob is not None:
                logprob[s:e] = lp

        _chunk_loop(h_full, weight, bounds, on_chunk)
        grad_h = _reduce_grad_hidden(grad_h, tp_group, sequence_parallel) if need_h else None
        # Guard the stored d/dhidden: with grad_in_hidden it lives in the caller's hidden until the backward.
        ctx.grad_h = None if grad_h is None else SavedBuffer(
            grad_h, "hidden (it holds d loss / d hidden since the forward, grad_in_hidden=True)" if aliased
            else "d loss / d hidden")
        ctx.wgrad, ctx.logprob, ctx.lw_dtype, ctx.backward_done = wgrad, logprob, loss_weight.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done:
            raise StaleBufferError("linear_sft_loss: backward ran already; its gradients were formed in the forward "
                                   "and handed out once (retain_graph / a second backward is not supported)")
        ctx.backward_done = True
        grad_h = ctx.grad_h.get() if ctx.grad_h is not None else None
        wgrad, logprob = ctx.wgrad, ctx.logprob
        # Drop ctx's references so that autograd can adopt the buffers as .grad.
        ctx.grad_h = ctx.wgrad = ctx.logprob = None
        # One host sync to skip two passes over N x H + V x H elements in the usual case (incoming gradient 1).
        scale = grad_loss if bool(grad_loss != 1) else None
        grad_w = wgrad.result(scale) if wgrad is not None else None  # raises first in main_grad mode if scale
        if grad_h is not None and scale is not None:
            grad_h.mul_(scale)
        grad_lw = None if logprob is None else (-logprob * grad_loss).to(ctx.lw_dtype)
        return grad_h, grad_w, None, grad_lw, None, None, None, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                    tp_group: dist.ProcessGroup | None = None, chunk_size: int, temperature: float = 1.0,
                    return_entropy: bool = False, sequence_parallel: bool = False, grad_in_hidden: bool = False,
                    vocab_size: int | None = None):
    """Token log-probs (and entropy) of ``hidden @ weight.T`` without materialising more than
    ``chunk_size x V_local`` logits; the backward recomputes the logits chunk by chunk.

    Per chunk: one GEMM for the logits (``hidden.dtype`` output), fp32 softmax statistics (one all-reduce set
    across ``tp_group``), and in the backward the recompute GEMM, the softmax gradient written in place of
    the recomputed logits, and two GEMMs for ``d/dhidden`` and ``d/dweight``.

    Args:
        hidden: ``[N, H]`` (or this rank's ``[N/tp, H]`` token shard with ``sequence_parallel``), bf16 or fp32.
        weight: this rank's vocabulary shard ``[V_local, H]`` of the LM-head weight, same dtype as ``hidden``.
            Rank ``r`` holds ids ``[r * V_local, (r + 1) * V_local)``. Weight gradient: see ``_WeightGrad``
            (into ``weight.main_grad`` when it exists, otherwise a ``weight.dtype`` gradient).
        labels: ``[N]`` int64 global ids for the full (gathered) sequence.
        tp_group: tensor-parallel group (``None``: no split).
        chunk_size: tokens per chunk (0: all at once). Extra memory ~ ``chunk_size * V_local * bytes(dtype)``.
        temperature: logits are divided by it (> 0).
        return_entropy: also return the (differentiable) entropy.
        sequence_parallel: ``hidden`` is a token shard; all-gather in forward/backward, reduce-scatter of
            ``d/dhidden`` inside (into the gathered copy's storage: no extra ``[N, H]`` buffer).
        grad_in_hidden: in the backward, write ``d/dhidden`` over ``hidden``'s storage chunk by chunk (after the
            chunk's recompute and ``d/dweight`` GEMM) and hand that storage on as the gradient: saves ``N x H``
            elements. ``hidden`` is consumed by the backward; see :func:`linear_sft_loss` for the version-counter
            safety net. Requires a contiguous ``hidden``; ignored under sequence parallelism with tp > 1.
        vocab_size: the full (padded) vocabulary size, when known; the TP group's weight shards must sum to it
            (catches the full LM-head weight passed on every rank).
    Returns:
        fp32 ``[N]`` log-probs, or ``(logprobs, entropy)``; identical on all TP ranks.
    Raises:
        ValueError: bad shapes/dtypes/labels/temperature/chunk_size; ``grad_in_hidden`` with a non-contiguous
            ``hidden``; weight shards of unequal width across ``tp_group`` or not summing to ``vocab_size``
            (:func:`sftprof.ops.guards.check_vocab_shards`; one all-gather of one int per call).
        sftprof.ops.guards.StaleBufferError: ``hidden``/``weight`` modified or swapped before the backward.
    """
    _check_linear_inputs(hidden, weight, labels, tp_group, temperature, sequence_parallel, grad_in_hidden, vocab_size)
    logprobs, entropy = _LinearLogprobs.apply(hidden, weight, labels, tp_group, chunk_size, float(temperature),
                                              sequence_parallel, grad_in_hidden)
    return (logprobs, entropy) if return_entropy else logprobs


def linear_sft_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_weight: torch.Tensor, *,
                    tp_group: dist.ProcessGroup | None = None, chunk_size: int, temperature: float = 1.0,
                    sequence_parallel: bool = False, grad_in_hidden: bool = False,
                    vocab_size: int | None = None) -> torch.Tensor:
    """``sum_i -logprob_i * loss_weight_i`` of ``hidden @ weight.T`` with gradients formed in the forward.

    Because the loss is linear in the log-probs, ``d loss / d logits`` of each chunk is known as soon as its
    softmax statistics are: the forward writes it in place of the chunk's logits and runs the ``d/dweight``
    and ``d/dhidden`` GEMMs right away (3 GEMMs in all, no recompute). Without a TP split it writes the
    gradient up to a per-row factor (``exp(x - x_y - ln V) - S [j == y]``, one read and one write of the chunk; see
    :func:`sftprof.ops.vocab_softmax.sft_chunk_`) and applies the factor to the ``[chunk, H]`` operands:
    ``d/dweight`` from the scaled hidden rows (in place with ``grad_in_hidden``, else in a ``[chunk, H]``
    scratch buffer), ``d/dhidden`` scaled after its GEMM. The backward only scales the stored gradients by
    the incoming gradient. Extra memory: one ``[chunk_size, V_local]`` logits buffer of
    ``hidden.dtype`` plus the gradients themselves; with ``grad_in_hidden`` (or sequence parallelism, where
    the all-gathered copy is reused) ``d/dhidden`` takes no memory of its own. Small extras: fp32 block sums
    (``4 x chunk_size x ceil(V_local / 1024)`` bytes) and, without ``grad_in_hidden``, the ``[chunk_size, H]``
    scratch buffer; on CUDA the first call also autotunes the elementwise kernel on a copy of one chunk.

    Args:
        hidden, weight, labels, tp_group, chunk_size, temperature, sequence_parallel, vocab_size: as in
            :func:`linear_logprobs`.
        loss_weight: ``[N]`` per-token weights (any float dtype; 0 masks a token). Put normalisation
            (1/num_tokens, 1/num_microbatches) here. If it requires grad it gets ``-logprob`` (times the
            incoming gradient).
        grad_in_hidden: write ``d loss / d hidden`` over ``hidden``'s storage, chunk by chunk once the chunk's
            ``d/dweight`` GEMM has read it, and return that storage as the gradient (saves ``N x H`` elements:
            0.5 GiB at 131072 x 2048 bf16). ``hidden`` is consumed: after the call it holds the gradient, so
            nothing may read it afterwards. Safety nets: the writes bump ``hidden``'s autograd version
            counter, so a node that saved ``hidden`` with ``save_for_backward`` before this call raises
            "modified by an inplace operation" in its backward; and this op's backward raises
            :class:`StaleBufferError` if ``hidden`` was modified in place or swapped after the call. Not
            caught: reads of ``hidden`` after the call, nodes that keep it outside ``save_for_backward`` or
            through saved-tensor hooks. For the final-norm output fed only to the LM head (the trainer's
            case) none of these happen. Requires a contiguous ``hidden``. Ignored under sequence parallelism
            with tp > 1 (the gathered copy is reused instead, and ``hidden`` is left untouched).
    Returns:
        fp32 scalar loss, identical on all TP ranks.
    Raises:
        ValueError: bad inputs (``grad_in_hidden`` with a non-contiguous ``hidden``, weight shards inconsistent
            with ``tp_group`` as in :func:`linear_logprobs`); or, when
            ``weight.main_grad`` exists (its gradient is added there during the forward), a backward with an
            incoming gradient other than 1.
        sftprof.ops.guards.StaleBufferError: in the backward, if the stored d/dhidden (``hidden`` itself with
            ``grad_in_hidden``) was modified or swapped after the forward, or on a second backward.
    Note:
        In ``main_grad`` mode the weight gradient lands in ``weight.main_grad`` during this call, so call it
        with gradients enabled only when a backward will follow.
    """
    n = _check_linear_inputs(hidden, weight, labels, tp_group, temperature, sequence_parallel, grad_in_hidden,
                             vocab_size)
    if loss_weight.shape != (n,) or not loss_weight.is_floating_point():
        raise ValueError(f"loss_weight must be a float tensor of shape ({n},), got {loss_weight.dtype} "
                         f"{tuple(loss_weight.shape)}")
    grad_on = torch.is_grad_enabled()
    return _LinearSFTLoss.apply(hidden, weight, labels, loss_weight, tp_group, chunk_size, float(temperature),
                                sequence_parallel, grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
                                grad_in_hidden)
