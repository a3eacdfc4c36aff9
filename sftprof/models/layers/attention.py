"""Causal core attention on ``torch.nn.functional.scaled_dot_product_attention`` with context parallelism.

megatron-core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` score matrix and
refuses context parallelism. :class:`SDPACoreAttention` is a drop-in ``core_attention`` submodule for
the local layer spec: SDPA (flash backend on CUDA for bf16, head_dim 128), causal, GQA without
expanding K/V (``enable_gqa=True``), and context parallelism (CP).

Context-parallel layout (the one megatron-core's RoPE and TE use; ``sftprof.data.cp_shard``): the
sequence of length ``S`` is cut into ``2 * CP`` chunks of ``L = S / (2 * CP)`` tokens; CP rank ``r``
holds chunks ``r`` and ``2 * CP - 1 - r``, so every rank has the same causal work. Here:

1. K and V (``[S/CP, b, g, d]`` per rank) are all-gathered across the CP group and put back in natural
   order (``[S, b, g, d]``). The backward reduce-scatters their gradients (sum over the ranks whose
   queries used them) back to the owning rank, so gradients are exact. With ``blocks`` and
   ``actor.megatron.cp_comm_overlap`` (default true) both collectives are asynchronous and overlap the
   diagonal blocks, which need only the rank's own K/V
   (:func:`sftprof.models.layers.block_attention.overlapped_cp_attention`).
2. Each local query chunk with global index ``c`` attends to keys ``[0, (c + 1) * L)`` under the causal
   mask; that is exactly the full causal mask restricted to those rows, so the result equals
   single-device causal attention. Two methods (``actor.megatron.cp_attention``,
   :data:`sftprof.config.CP_ATTENTION_METHODS`):

   - ``masked``: one SDPA call per chunk with the mask aligned to the bottom-right corner
     (``torch.nn.attention.bias.causal_lower_right``): query ``j`` of the chunk (global position
     ``c * L + j``) sees keys ``<= c * L + j``. On an H200 SDPA runs this on its FA2 (``pytorch_flash``)
     kernels.
   - ``blocks``: a causal diagonal block plus one unmasked off-diagonal block per chunk, merged by
     log-sum-exp (:mod:`sftprof.models.layers.block_attention`), so each block is a shape the cuDNN kernels of
     the single-GPU ``is_causal`` call take.

Without context parallelism (CP = 1) the attention is one causal call each way, or, with
``actor.megatron.attention_forward_chunks`` > 1 (default 2), the forward as that many query chunks of diagonal
causal blocks plus unmasked off-diagonal blocks merged by log-sum-exp and the backward as one causal call given the
merged output (:func:`sftprof.models.layers.block_attention.chunked_causal_attention`): on an H200 the cuDNN forward of
unmasked blocks is faster than its causal call (bench/NOTES.md, tenth session).

Layout: the ``[s, b, heads, d]`` tensors are handed over as permuted ``[b, heads, s, d]`` views, not copies. SDPA's
CUDA kernels and the block kernels read such views in place (:mod:`sftprof.models.layers.block_attention`, "Layouts").
At CP = 1 the output (one SDPA call's, or the chunked path's) is allocated in the query's layout, so the final
flatten to ``[s, b, heads * d]`` is a view, and megatron's output gradient, which comes in that flattened layout,
is already in the output's strides, as the cuDNN backward wants it.

Memory per rank beyond the local Q/K/V: the gathered K and V (``S * b * g * d`` elements each; small
with GQA) and SDPA's own workspace.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sftprof.config import CP_ATTENTION_METHODS
from sftprof.data import cp_chunk_ids
from sftprof.models.layers.block_attention import (blockwise_cp_attention, check_cp_lengths, chunked_causal_attention,
                                            default_block_kernel, overlapped_cp_attention)

log = logging.getLogger(__name__)
_forward_chunks_skip_logged = False  # one log line per process when attention_forward_chunks > 1 does not apply


def rank_order_to_natural(x: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Reorder an all-gathered tensor (rank 0's two chunks, then rank 1's, ...) into sequence order.

    ``x`` has ``2 * cp_size`` equal chunks along ``dim``; returns a new tensor in natural order.
    """
    chunks = x.chunk(2 * cp_size, dim=dim)
    natural: list[Optional[torch.Tensor]] = [None] * (2 * cp_size)
    for r in range(cp_size):
        first, second = cp_chunk_ids(cp_size, r)
        natural[first], natural[second] = chunks[2 * r], chunks[2 * r + 1]
    return torch.cat(natural, dim=dim)


def natural_to_rank_order(x: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`rank_order_to_natural`."""
    chunks = x.chunk(2 * cp_size, dim=dim)
    out = []
    for r in range(cp_size):
        first, second = cp_chunk_ids(cp_size, r)
        out += [chunks[first], chunks[second]]
    return torch.cat(out, dim=dim)


class _GatherSequenceCP(torch.autograd.Function):
    """All-gather ``[s_local, ...]`` across the CP group into natural order ``[S, ...]``;
    backward: reduce-scatter (sum) of the gradient back to each rank's two chunks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        x = x.contiguous()
        gathered = x.new_empty((x.shape[0] * cp,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x, group=group)
        return rank_order_to_natural(gathered, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        ordered = natural_to_rank_order(grad, cp).contiguous()
        out = grad.new_empty((grad.shape[0] // cp,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, ordered, group=ctx.group)
        return out, None


def gather_sequence_cp(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather a CP-sharded ``[S/CP, ...]`` tensor into the natural-order ``[S, ...]`` (autograd-aware).

    Returns ``x`` itself when ``group`` is ``None`` or has one rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequenceCP.apply(x, group)


def cp_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_size: int, cp_rank: int,
                        scale: Optional[float] = None, dropout_p: float = 0.0, method: str = "blocks",
                        forward_chunks: int = 1) -> torch.Tensor:
    """Exact causal attention of this CP rank's load-balanced query chunks against the full K/V.

    Args:
        q: ``[b, h, S/cp_size, d]``: query chunks ``r`` then ``2*cp_size-1-r`` (see module docstring).
        k, v: ``[b, g, S, d]`` in natural sequence order (``h`` a multiple of ``g``: GQA).
        cp_size, cp_rank: CP group size and rank (``cp_size=1``: plain causal attention, ``S/1 == S``).
        scale: softmax scale (default ``1/sqrt(d)``).
        dropout_p: attention dropout probability (``blocks``: 0 only).
        method: one of :data:`sftprof.config.CP_ATTENTION_METHODS` (see the module docstring), for ``cp_size > 1``.
        forward_chunks: ``cp_size=1`` only: > 1 runs :func:`sftprof.models.layers.block_attention.chunked_causal_attention`
            with that many query chunks where it was measured to pay: the cuDNN block kernels (bf16/fp16 CUDA
            tensors, SDPA's cuDNN backend on), head_dim <= 128, no dropout, the sequence length a multiple of the
            count; else one plain ``is_causal`` SDPA call (on CPU the block kernel would be the fp32 math kernel,
            whose score matrices SDPA's CPU kernel does not keep; head_dim 256, Qwen3.5's, is not measured), and
            the first such call of the process logs why (:func:`forward_chunks_skip_reason`).
    Returns:
        ``[b, h, S/cp_size, d]``, rows in the order of ``q``.
    Raises:
        ValueError: shapes inconsistent with the layout, an unknown method, or dropout with ``blocks``.
    """
    check_cp_attention(method, dropout_p, cp_size)
    gqa = q.shape[1] != k.shape[1]
    if cp_size == 1:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"cp_size=1 needs as many queries as keys, got {q.shape[2]} and {k.shape[2]}")
        if forward_chunks > 1:
            skip = forward_chunks_skip_reason(q, forward_chunks, dropout_p)
            if skip is None:
                return chunked_causal_attention(q, k, v, chunks=forward_chunks, scale=scale)
            _log_forward_chunks_skip(forward_chunks, skip)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=gqa)
    s_local = check_cp_lengths(q.shape[2], k.shape[2], cp_size)
    if method == "blocks":
        return blockwise_cp_attention(q, k, v, cp_size=cp_size, cp_rank=cp_rank, scale=scale)
    length = s_local // 2
    outs = []
    for j, c in enumerate(cp_chunk_ids(cp_size, cp_rank)):
        kv_len = (c + 1) * length
        outs.append(F.scaled_dot_product_attention(
            q[:, :, j * length:(j + 1) * length], k[:, :, :kv_len], v[:, :, :kv_len],
            attn_mask=causal_lower_right(length, kv_len), scale=scale, dropout_p=dropout_p, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def forward_chunks_skip_reason(q: torch.Tensor, forward_chunks: int, dropout_p: float) -> Optional[str]:
    """Why ``actor.megatron.attention_forward_chunks`` = ``forward_chunks`` (> 1) does not apply at CP = 1 to the
    query ``q`` (``[b, h, S, d]``), or ``None`` when :func:`cp_causal_attention` runs the chunked forward.

    The chunked forward is used only where it was measured to pay (bench/NOTES.md, tenth session): the cuDNN block
    kernels (:func:`sftprof.models.layers.block_attention.default_block_kernel`: bf16/fp16 CUDA tensors, SDPA's cuDNN
    backend on), head_dim <= 128, attention dropout 0, ``S`` a multiple of ``forward_chunks``. Every reason that
    holds is named, joined by ``"; "``.
    """
    reasons = []
    kernel = default_block_kernel(q)
    if not kernel.startswith("cudnn"):
        if q.device.type != "cuda":
            reasons.append(f"{q.device.type} tensors (the cuDNN SDPA kernels need CUDA)")
        elif kernel.startswith("flash"):
            reasons.append("SDPA's cuDNN backend is off or cuDNN is unavailable")
        else:
            reasons.append(f"dtype {str(q.dtype).removeprefix('torch.')} (the cuDNN SDPA kernels take bf16/fp16)")
    if q.shape[-1] > 128:
        reasons.append(f"head_dim {q.shape[-1]} > 128 (not measured; Qwen3.5's is 256)")
    if dropout_p > 0:
        reasons.append(f"attention dropout {dropout_p} > 0")
    if q.shape[2] % forward_chunks:
        reasons.append(f"sequence length {q.shape[2]} not a multiple of {forward_chunks}")
    return "; ".join(reasons) or None


def _log_forward_chunks_skip(forward_chunks: int, reason: str) -> None:
    """Logs (INFO) that ``attention_forward_chunks`` falls back to one causal call, the first time only."""
    global _forward_chunks_skip_logged
    if not _forward_chunks_skip_logged:
        _forward_chunks_skip_logged = True
        log.info("actor.megatron.attention_forward_chunks=%d has no effect at CP = 1 here: %s; the attention runs "
                 "as one causal SDPA call each way (logged once per process)", forward_chunks, reason)


def check_cp_attention(method: str, dropout_p: float, cp_size: int) -> None:
    """Raises ValueError naming ``actor.megatron.cp_attention``: a method not in
    :data:`sftprof.config.CP_ATTENTION_METHODS`, or ``blocks`` with CP > 1 and attention dropout > 0 (the
    blocks share no random stream)."""
    if method not in CP_ATTENTION_METHODS:
        raise ValueError(f"actor.megatron.cp_attention={method!r}: must be one of {list(CP_ATTENTION_METHODS)}")
    if method == "blocks" and cp_size > 1 and dropout_p > 0:
        raise ValueError(f"actor.megatron.cp_attention='blocks' needs attention dropout 0, got {dropout_p}; "
                         "use cp_attention=masked")


class SDPACoreAttention(torch.nn.Module):
    """megatron-core ``core_attention`` module on SDPA: causal, GQA, context parallel.

    Constructor arguments follow megatron-core's ``DotProductAttention`` (built by ``SelfAttention``), plus
    ``cp_attention`` (one of :data:`sftprof.config.CP_ATTENTION_METHODS`, from ``actor.megatron.cp_attention`` through the
    layer spec's params; used only with CP > 1), ``forward_chunks`` (``actor.megatron.attention_forward_chunks``;
    used only with CP = 1, see :func:`cp_causal_attention`) and ``cp_comm_overlap``
    (``actor.megatron.cp_comm_overlap``; with ``blocks`` and CP > 1 the K/V all-gather and the gradient
    reduce-scatter run during the diagonal blocks: :func:`sftprof.models.layers.block_attention.overlapped_cp_attention`;
    false: the all-gather, then :func:`cp_causal_attention`).

    Forward:
        query ``[sq, b, np, hn]``, key/value ``[sq, b, ng, hn]`` (this rank's TP heads and CP tokens);
        returns ``[sq, b, np * hn]``.
    Raises:
        ValueError: a mask type other than causal, packed sequences, an attention bias, or an explicit
            attention mask (padding masks are not supported); at construction, see :func:`check_cp_attention`.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, cp_attention: str = "blocks",
                 forward_chunks: int = 1, cp_comm_overlap: bool = True) -> None:
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal attention only, got {attn_mask_type}")
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        check_cp_attention(cp_attention, self.dropout_p, config.context_parallel_size)
        self.cp_attention = cp_attention
        self.forward_chunks = forward_chunks
        self.cp_comm_overlap = cp_comm_overlap
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None and config.context_parallel_size > 1:
            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention: packed sequences and attention bias are not supported")
        if attention_mask is not None:
            raise ValueError("SDPACoreAttention: explicit attention masks are not supported (causal only)")
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        cp_rank = dist.get_rank(self.cp_group) if cp_size > 1 else 0
        sq, b = query.shape[0], query.shape[1]
        if cp_size > 1 and self.cp_attention == "blocks" and self.cp_comm_overlap:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = overlapped_cp_attention(q, k, v, group=self.cp_group, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
        key = gather_sequence_cp(key, self.cp_group)
        value = gather_sequence_cp(value, self.cp_group)
        # [s, b, heads, d] -> [b, heads, s, d] (views; head_dim stays contiguous)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = cp_causal_attention(q, k, v, cp_size=cp_size, cp_rank=cp_rank, scale=self.softmax_scale,
                                  dropout_p=self.dropout_p if self.training else 0.0, method=self.cp_attention,
                                  forward_chunks=self.forward_chunks)
        # a view when out is in [s, b, heads, d] order: at CP = 1 it is allocated like the query view
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
