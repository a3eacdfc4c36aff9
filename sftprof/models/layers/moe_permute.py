"""Sync-free, atomic-free token permutation for megatron-core's alltoall MoE token dispatcher (no TE).

megatron-core's unfused ``permute`` / ``unpermute`` (``megatron/core/transformer/moe/moe_utils.py``) find each
expert's tokens with ``masked_select`` (0.16: ``aten::nonzero``, a device-to-host sync per call; from 0.17 a stable
argsort of the whole ``[T, E]`` map, no sync) and move gradients back with bf16 atomics: the backward of
``tokens.index_select(0, sorted_indices)`` is an ``index_add_``, and ``unpermute`` is a ``scatter_add_`` into zeros.
Its fused alternative needs Transformer Engine. When routing drops no token and pads nothing, every row of the
routing map has exactly ``topk`` true entries, and the same layout comes from sorts and gathers only:

- ``expert_idx [T, topk]``: each token's experts in ascending order (``topk`` of the int8 routing map,
  then a sort along the row; no host sync);
- a stable sort of the ``T * topk`` expert ids (flattened token-major), i.e. of the keys
  ``expert * T + token``: slot ``j`` of the permuted tensor holds token ``sorted_indices[j]``; the order is
  megatron's (expert-major, ascending token index within an expert);
- the inverse map ``inverse [T, topk]``: the slots of token ``t``, ascending (``inverse[t, k]`` is the slot of
  its ``k``-th smallest expert).

Then permute is a row gather whose backward is, per token, the sum of its ``topk`` rows' gradients (a
gather-sum through ``inverse``), and unpermute is that gather-sum (fp32 accumulation, one rounding) whose
backward is a row gather: no atomics on ``[*, H]`` rows. (The permuted probs are a gather of ``T * topk`` fp32
scalars; their backward is torch's scatter into ``[T, E]``, each position written once.) On CUDA the gather-sum
is a small Triton kernel (no ``[T, topk, H]`` temporary); on CPU the same sum in torch, one ``[T, H]`` fp32
accumulator.

The hook (:class:`SortedPermuteMoELayer`, picked by :func:`sftprof.models.specs.local_layer_spec` when
:func:`sorted_permute_applies`) runs megatron-core's own ``MoEAlltoAllTokenDispatcher`` code with its
module-level ``permute`` / ``unpermute`` names bound to :func:`sorted_permute` / :func:`sorted_unpermute`
for the duration of ``dispatch_preprocess`` / ``combine_postprocess``, and ``sort_chunks_by_idxs`` (the
reorder by local expert) to :func:`sort_chunks_unless_identity` in ``dispatch_postprocess`` /
``combine_preprocess``: megatron's own function except where the reorder is the identity (TP = EP = 1).
The rest of the dispatcher (splits from ``tokens_per_expert``, the all-to-all) is unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch
from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher

from sftprof.compat import PERMUTE_PADDING_OUTPUTS, megatron_at_least
from sftprof.models.layers.op_inputs import check_tensor


def sorted_permute_applies(config) -> bool:
    """True when every routing-map row of megatron-core's alltoall dispatcher has exactly ``moe_router_topk``
    true entries and megatron's unfused permutation would run: ``moe_token_dispatcher_type="alltoall"``,
    ``moe_permute_fusion`` off (TE's fused permute), ``moe_expert_capacity_factor`` None (no token drop, no
    padding to capacity) and ``moe_router_padding_for_quantization`` off.

    Args:
        config: the megatron ``TransformerConfig``.
    """
    return (config.moe_token_dispatcher_type == "alltoall" and not config.moe_permute_fusion
            and config.moe_expert_capacity_factor is None and not config.moe_pad_expert_input_to_capacity
            and not config.moe_router_padding_for_quantization)


def _gather_sum_torch(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    acc = x.new_zeros(inverse.shape[0], x.shape[1], dtype=torch.promote_types(x.dtype, torch.float32))
    for k in range(inverse.shape[1]):  # 0 + a == a exactly: the same bits as starting from row k = 0
        idx = inverse[:, k]
        valid = (idx >= 0).unsqueeze(1)
        acc += torch.where(valid, x.index_select(0, idx.clamp(min=0)), 0)
    return acc.to(x.dtype)


_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def gather_sum(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k x[inverse[t, k]]`` over the entries ``inverse[t, k] >= 0`` (a negative entry is padding
    and adds nothing; a row of padding gives zeros), with fp32 accumulation (fp64 for fp64 ``x``; k ascending,
    from 0) and one rounding to ``x``'s dtype.

    CUDA, bf16/fp16/fp32: one Triton kernel (:func:`sftprof.models.layers.moe_permute_kernels.gather_sum`), no ``[T, topk, H]``
    temporary; otherwise torch with one ``[T, H]`` accumulator. Both add in the same order, so they give the same
    bits. The entries are checked to lie in ``[-1, N)`` without a host sync (``torch._assert_async``: on CPU a
    failure raises at once; on CUDA it is a device-side assert at a later launch, never a read out of bounds).
    :func:`sorted_permute` / :func:`sorted_unpermute` build their indices in range and call the unchecked sum.

    Args:
        x: ``[N, H]`` rows, bf16/fp16/fp32/fp64.
        inverse: ``[T, topk]`` int64 row indices into ``x`` (``-1``: padding), ``topk >= 1``, on ``x``'s device.
    Returns:
        ``[T, H]``, ``x``'s dtype and device.
    Raises:
        ValueError: ``x`` or ``inverse`` not a tensor of an accepted dtype, ``inverse`` on another device; ``x`` is
            not 2-D, or ``inverse`` is not ``[T, topk]`` with ``topk >= 1``.
        RuntimeError: (CPU) an index outside ``[0, N)``.
    """
    check_tensor("gather_sum", "x", x, _FLOATS)
    check_tensor("gather_sum", "inverse", inverse, (torch.int64,), device=x.device)
    if x.dim() != 2 or inverse.dim() != 2 or inverse.shape[1] < 1:
        raise ValueError(f"gather_sum: needs x [N, H] and inverse [T, topk >= 1], got {tuple(x.shape)} and "
                         f"{tuple(inverse.shape)}")
    torch._assert_async(((inverse >= -1) & (inverse < x.shape[0])).all(),
                        f"gather_sum: inverse holds an entry outside [-1, {x.shape[0]}) (x has {x.shape[0]} rows; "
                        "-1 is padding)")
    return _gather_sum(x, inverse)


def _gather_sum(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """:func:`gather_sum` without the checks (for indices built in range here)."""
    x, inverse = x.contiguous(), inverse.contiguous()
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or inverse.shape[0] == 0 \
            or x.shape[1] == 0:
        return _gather_sum_torch(x, inverse)
    from sftprof.models.layers import moe_permute_kernels

    return moe_permute_kernels.gather_sum(x, inverse)


class _GatherRows(torch.autograd.Function):
    """Forward ``x[sorted_indices]``; backward the gather-sum of the gradient through ``inverse``."""

    @staticmethod
    def forward(ctx, x, sorted_indices, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _gather_sum(grad, inverse), None, None


class _GatherSumRows(torch.autograd.Function):
    """Forward the gather-sum through ``inverse``; backward ``grad[sorted_indices]``."""

    @staticmethod
    def forward(ctx, x, sorted_indices, inverse):
        ctx.save_for_backward(sorted_indices)
        return _gather_sum(x, inverse)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, sorted_indices), None, None


def gather_rows(x: torch.Tensor, indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` (differentiable in ``x``) whose backward is the atomic-free :func:`gather_sum` of the
    gradient through ``inverse`` instead of torch's ``index_add_``.

    Args:
        x: ``[T, H]`` rows (any float dtype).
        indices: ``[N]`` int64 rows of ``x``.
        inverse: ``[T, K]`` int64, -1 padded: the positions ``j`` with ``indices[j] == t`` in row ``t`` (each
            ``j`` exactly once in the whole map; not checked).
    Returns:
        ``[N, H]`` in ``x``'s dtype.
    """
    return _GatherRows.apply(x, indices, inverse)


def gather_sum_rows(x: torch.Tensor, indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """:func:`gather_sum` of ``x`` through ``inverse`` (differentiable in ``x``) whose backward is the row gather
    ``grad[indices]``: the transpose of :func:`gather_rows`.

    Args:
        x: ``[N, H]`` rows (any float dtype).
        indices: ``[N]`` int64: the output row of each row of ``x``.
        inverse: ``[T, K]`` int64, -1 padded, consistent with ``indices`` as in :func:`gather_rows`.
    Returns:
        ``[T, H]`` in ``x``'s dtype.
    """
    return _GatherSumRows.apply(x, indices, inverse)


def _refuse(name: str, fused: bool, drop_and_pad: bool, padded: bool = False) -> None:
    if fused or drop_and_pad or padded:
        raise ValueError(f"{name}: fused={fused}, drop_and_pad={drop_and_pad}, padding for quantization={padded}: only "
                         "the unfused dropless path without padding is implemented (see sorted_permute_applies)")


def sorted_permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
                   num_out_tokens: Optional[int] = None, fused: bool = False, drop_and_pad: bool = False,
                   tokens_per_expert: Optional[torch.Tensor] = None, align_size: int = 0) -> tuple:
    """megatron-core's ``moe_utils.permute`` (same arguments, same outputs in the same order) for routing maps
    with exactly ``topk = num_out_tokens / T`` true entries per row; see the module docstring. From megatron-core
    0.17 (:data:`sftprof.compat.PERMUTE_PADDING_OUTPUTS`) the outputs end with ``pad_offsets`` (None: no padding)
    and ``tokens_per_expert`` (passed through), as megatron's do.

    No host sync. The "exactly topk per row" assumption is checked with ``torch._assert_async`` on the row
    counts: on CPU a failure raises at once; on CUDA it is a device-side assert that surfaces at a later
    kernel launch (and leaves the CUDA context unusable), never a wrong result.

    Args:
        tokens: ``[T, H]`` hidden states (any float dtype).
        routing_map: ``[T, E]`` bool, ``topk`` true entries per row.
        probs: optional ``[T, E]`` router probabilities (fp32 with ``moe_router_dtype=fp32``).
        num_out_tokens: ``T * topk`` (an int, as the dispatcher passes it for dropless routing).
        fused, drop_and_pad: must be False.
        tokens_per_expert: returned as it came (megatron-core >= 0.17); align_size: must be 0 (no padding).
    Returns:
        ``(permuted_tokens [T * topk, H], permuted_probs [T * topk] or None, sorted_indices [T * topk] int64)``:
        expert-major, ascending token index within an expert; ``permuted_probs[j] = probs[sorted_indices[j],
        e(j)]``, the order of megatron's ``probs.T.masked_select(routing_map.T)``; then ``(None,
        tokens_per_expert)`` from megatron-core 0.17.
    Raises:
        ValueError: ``fused``, ``drop_and_pad`` or ``align_size``; ``tokens`` not a float tensor, ``routing_map``
            not a bool tensor, ``probs`` not a float tensor, or one on another device than ``tokens``;
            ``num_out_tokens`` not an int multiple of ``T``; shapes that do not match (``probs`` must have
            ``routing_map``'s shape).
        RuntimeError: (CPU) a routing-map row without exactly ``topk`` true entries.
    """
    _refuse("sorted_permute", fused, drop_and_pad, bool(align_size))
    check_tensor("sorted_permute", "tokens", tokens, _FLOATS)
    check_tensor("sorted_permute", "routing_map", routing_map, (torch.bool,), device=tokens.device)
    if probs is not None:
        check_tensor("sorted_permute", "probs", probs, _FLOATS, device=tokens.device)
    if tokens.dim() != 2 or routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0] \
            or (probs is not None and probs.shape != routing_map.shape):
        raise ValueError(f"sorted_permute: needs tokens [T, H], routing_map [T, E] and probs None or [T, E], got "
                         f"{tuple(tokens.shape)}, {tuple(routing_map.shape)} and "
                         f"{None if probs is None else tuple(probs.shape)}")
    n_tokens = tokens.shape[0]
    if not (isinstance(num_out_tokens, int) and num_out_tokens >= 0
            and (num_out_tokens % n_tokens == 0 if n_tokens else num_out_tokens == 0)):
        raise ValueError(f"sorted_permute: num_out_tokens={num_out_tokens!r} must be T * topk (T={n_tokens}) for "
                         "dropless routing")
    topk = num_out_tokens // n_tokens if n_tokens else 0
    torch._assert_async((routing_map.sum(dim=1) == topk).all(),
                        f"sorted_permute: a routing-map row does not have exactly topk={topk} true entries")
    expert_idx = routing_map.to(torch.int8).topk(topk, dim=1, sorted=False).indices.sort(dim=1).values
    order = torch.sort(expert_idx.reshape(-1), stable=True).indices  # slot -> flat (token, k) position
    sorted_indices = order // max(topk, 1)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    inverse = inverse.view(n_tokens, topk)
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.gather(1, expert_idx).reshape(-1).index_select(0, order)
    if topk == 0:  # no token: an empty gather, nothing to sum in backward
        permuted = tokens.index_select(0, sorted_indices)
    else:
        permuted = gather_rows(tokens, sorted_indices, inverse)
    if megatron_at_least(PERMUTE_PADDING_OUTPUTS):
        return permuted, permuted_probs, sorted_indices, None, tokens_per_expert
    return permuted, permuted_probs, sorted_indices


def sorted_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
                     probs: Optional[torch.Tensor] = None, routing_map: Optional[torch.Tensor] = None,
                     fused: bool = False, drop_and_pad: bool = False,
                     pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """megatron-core's ``moe_utils.unpermute`` without ``probs`` (as the alltoall dispatcher calls it) for a
    permutation from :func:`sorted_permute`: ``out[t] = sum of the rows of token t``, fp32 accumulation and one
    rounding (megatron adds in the tokens' dtype with atomics). The inverse map is a stable argsort of
    ``sorted_indices`` (each token appears exactly ``topk`` times, which :func:`sorted_permute` checked).

    That each token ``0 .. T - 1`` appears exactly ``topk`` times in ``sorted_indices`` is checked without a host
    sync (``torch._assert_async`` on the sorted indices, which the inverse map's sort yields anyway): on CPU a
    failure raises at once; on CUDA it is a device-side assert at a later launch, never a wrong sum.

    Args:
        permuted_tokens: ``[T * topk, H]`` expert outputs in permuted order, bf16/fp16/fp32/fp64.
        sorted_indices: ``[T * topk]`` int64, from :func:`sorted_permute`, on ``permuted_tokens``' device.
        restore_shape: ``(T, H)``.
        probs: must be None; routing_map: unused (megatron uses it only with ``probs``).
        fused, drop_and_pad: must be False; pad_offsets (megatron-core >= 0.17): must be None (no padding).
    Returns:
        ``[T, H]`` in ``permuted_tokens``' dtype.
    Raises:
        ValueError: ``probs`` or ``pad_offsets`` given, ``fused`` or ``drop_and_pad``; ``permuted_tokens`` not a
            float tensor, ``sorted_indices`` not a 1-D int64 tensor on its device; ``restore_shape`` not ``(T, H)``,
            or ``sorted_indices`` not ``T * topk`` long.
        RuntimeError: (CPU) ``sorted_indices`` does not hold each token exactly ``topk`` times.
    """
    _refuse("sorted_unpermute", fused, drop_and_pad, pad_offsets is not None)
    if probs is not None:
        raise ValueError("sorted_unpermute: probs must be None (the alltoall dispatcher applies them in the experts)")
    check_tensor("sorted_unpermute", "permuted_tokens", permuted_tokens, _FLOATS)
    check_tensor("sorted_unpermute", "sorted_indices", sorted_indices, (torch.int64,), device=permuted_tokens.device)
    if sorted_indices.dim() != 1 or len(restore_shape) != 2:
        raise ValueError(f"sorted_unpermute: needs sorted_indices [T * topk] and restore_shape (T, H), got "
                         f"{tuple(sorted_indices.shape)} and {tuple(restore_shape)}")
    n_tokens, hidden = restore_shape
    n = sorted_indices.numel()
    if (n_tokens == 0) != (n == 0) or (n_tokens and n % n_tokens) or permuted_tokens.shape != (n, hidden):
        raise ValueError(f"sorted_unpermute: {n} sorted indices and permuted tokens {tuple(permuted_tokens.shape)} "
                         f"do not fit restore_shape {tuple(restore_shape)} (needs T * topk rows of H)")
    if n == 0:
        return permuted_tokens.new_zeros(restore_shape)
    topk = n // n_tokens
    tokens_sorted, inverse = torch.sort(sorted_indices, stable=True)
    torch._assert_async((tokens_sorted.view(n_tokens, topk)
                         == torch.arange(n_tokens, device=sorted_indices.device).unsqueeze(1)).all(),
                        f"sorted_unpermute: sorted_indices must hold each token 0..{n_tokens - 1} exactly topk={topk} "
                        "times (as sorted_permute returns them)")
    return gather_sum_rows(permuted_tokens, sorted_indices, inverse.view(n_tokens, topk))


def sort_chunks_unless_identity(input: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor,
                                probs: Optional[torch.Tensor] = None,
                                fused: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """megatron-core's ``moe_utils.sort_chunks_by_idxs`` (same arguments and results), returning ``input`` and
    ``probs`` themselves when ``sorted_idxs`` is the identity ``0, 1, ..., n - 1``.

    The alltoall dispatcher reorders its per-(rank, local expert) chunks with this function whenever a rank has
    more than one local expert; with TP = EP = 1 the order is the identity and megatron's split + cat is a copy
    of the whole permuted tensor (``[T * topk, H]``) per call, forward and backward.

    Args:
        input: ``[N, H]`` rows in chunks of ``split_sizes``; split_sizes: ``[n]`` int64 (host);
        sorted_idxs: ``[n]`` int64 (host, as the unfused dispatcher keeps it); probs: optional ``[N]``.
        fused: passed on (TE's fused sort).
    """
    n = sorted_idxs.numel()
    if not sorted_idxs.is_cuda and torch.equal(sorted_idxs, torch.arange(n, dtype=sorted_idxs.dtype)):
        return input, probs
    return moe_utils.sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=probs, fused=fused)


@contextlib.contextmanager
def bound(module, **names) -> Iterator[None]:
    """Bind ``module.<name>`` to the given objects for the duration of the block, then restore them."""
    saved = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


class SortedPermuteAlltoAllTokenDispatcher(token_dispatcher.MoEAlltoAllTokenDispatcher):
    """megatron-core's ``MoEAlltoAllTokenDispatcher`` with :func:`sorted_permute` / :func:`sorted_unpermute` as
    its permutation 1 and unpermutation 1, and :func:`sort_chunks_unless_identity` as its permutation 2 and
    unpermutation 2 (same arguments and return values as the base class methods).

    Only valid when :func:`sorted_permute_applies` to the config (:class:`SortedPermuteMoELayer` checks).
    """

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """The base method with ``permute`` bound to :func:`sorted_permute`."""
        with bound(token_dispatcher, permute=sorted_permute):
            return super().dispatch_preprocess(hidden_states, routing_map, probs)

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        """The base method with ``sort_chunks_by_idxs`` bound to :func:`sort_chunks_unless_identity`."""
        with bound(token_dispatcher, sort_chunks_by_idxs=sort_chunks_unless_identity):
            return super().dispatch_postprocess(global_input_tokens, global_probs)

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """The base method with ``sort_chunks_by_idxs`` bound to :func:`sort_chunks_unless_identity`."""
        with bound(token_dispatcher, sort_chunks_by_idxs=sort_chunks_unless_identity):
            return super().combine_preprocess(hidden_states)

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor):
        """The base method with ``unpermute`` bound to :func:`sorted_unpermute`."""
        with bound(token_dispatcher, unpermute=sorted_unpermute):
            return super().combine_postprocess(permutated_local_input_tokens)


class SortedPermuteMoELayer(moe_layer.MoELayer):
    """megatron-core's ``MoELayer`` whose alltoall token dispatcher is
    :class:`SortedPermuteAlltoAllTokenDispatcher` (constructor arguments of ``MoELayer``; keywords of later
    megatron-core releases, ``is_mtp_layer`` and ``name``, are passed on to it).

    Raises:
        ValueError: :func:`sorted_permute_applies` is False for ``config`` (the spec must pick ``MoELayer``).
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None, pg_collection=None,
                 **megatron_kwargs) -> None:
        if not sorted_permute_applies(config):
            raise ValueError("SortedPermuteMoELayer: needs moe_token_dispatcher_type='alltoall', "
                             "moe_permute_fusion=False, moe_expert_capacity_factor=None and no router padding "
                             "for quantization (use megatron-core's MoELayer otherwise)")
        with bound(moe_layer, MoEAlltoAllTokenDispatcher=SortedPermuteAlltoAllTokenDispatcher):
            super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                             **megatron_kwargs)
