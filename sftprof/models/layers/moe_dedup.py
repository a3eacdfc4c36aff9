"""A deduplicating all-to-all MoE token dispatcher: each token goes once to each EP rank that holds >= 1 of its experts.

megatron-core 0.16.1's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/token_dispatcher.py``)
sends one row per (token, selected expert): with ``topk`` of ``E`` experts spread over ``EP`` ranks a token
reaches another rank about ``topk / EP`` times (Qwen3-30B-A3B, topk 8 of 128, EP = 2: ~4 copies), and its
combine all-to-all brings as many rows back. :class:`DedupAlltoAllTokenDispatcher` implements the same six
dispatcher methods (``dispatch_preprocess`` .. ``combine_postprocess``, called by megatron-core's ``MoELayer``)
with one row per (token, destination EP rank):

- ``dispatch_preprocess``: for each EP rank ``r`` (local experts ``[r L, (r + 1) L)``, ``L = E / EP``) the
  tokens with >= 1 selected expert there: ``N_send`` rows of ``H``, ordered by (token chunk, rank, ascending
  token); with each row its routing sub-map ``[L]`` (uint8) and router-probability sub-row ``[L]`` (router
  dtype, differentiable). The per-(chunk, rank) counts of rows and of (row, local expert) pairs go to every rank
  in one small all-to-all; one host sync reads both directions' counts (the all-to-alls' splits and sizes).
- ``token_dispatch``: starts each chunk's all-to-all of the hidden rows, probability sub-rows and sub-maps.
- ``dispatch_postprocess`` (per chunk): waits for the chunk; its received rows permuted by local expert
  (expert-major, ascending received-row index: the order of megatron-core's chunk sort, so the experts see the
  same rows in the same order); ``tokens_per_expert`` ``[L]`` int64 on the rows' device; no host sync (the
  number of pairs came with the counts).
- ``combine_preprocess`` (per chunk): each received row's expert outputs summed (the experts applied the
  probabilities): ``[N_recv_c, H]``; starts its all-to-all back (splits reversed).
- ``token_combine``: waits for every chunk's all-to-all back: ``[N_send, H]``.
- ``combine_postprocess``: each token's sum over the ranks it went to, reshaped to the input's shape.

Pipelining (``actor.megatron.moe_alltoall_chunks`` = ``K``, :class:`DedupAlltoAllMoELayer`): the tokens of the
micro-batch are cut into ``K`` contiguous chunks (some empty when there are fewer than ``K`` tokens: every rank
of the EP group makes the same collectives whatever its token count), and every all-to-all is asynchronous (``async_op=True``; on
CUDA the compute stream, not the host, waits). Forward: all ``K`` dispatches start at once; chunk ``c``'s
experts run as soon as its rows arrive, while chunk ``c + 1``'s are still in flight and chunk ``c - 1``'s
outputs go back. Backward, in the order autograd runs the nodes (the last created first): every chunk's
output-gradient all-to-all starts at once; chunk ``c``'s experts' backward runs when its gradient has arrived,
and its input-gradient all-to-all starts right after, while chunk ``c - 1``'s experts' backward runs. So about
``1 / K`` of the transfer stays exposed; waiting for a slower rank (unequal expert load) does not shrink, since
each rank's expert work is the same in total. Gradients land in place in one buffer (no concatenation). The
rows of an expert are split across chunks; each row's result is the same (a row of a GEMM does not depend on
the others), so the layer's output and gradients do not depend on ``K`` beyond the GEMMs' rounding.

Bytes per direction and rank: ``N_send * H * b`` hidden (``b`` bytes per element: 2 in bf16) plus
``N_send * L * (1 + p)`` for the sub-maps and probabilities (``p`` bytes of the router dtype, dispatch only,
and its gradient back), instead of megatron-core's ``T * topk_r * H * b`` (``topk_r``: a token's selected
experts on other ranks). At EP = 2 with topk 8 of 128 experts, ``H = 2048``, bf16 and fp32 router
probabilities the hidden rows shrink ~4x and the sub-rows add ``64 * 5 = 320`` bytes per 4096-byte row.

The index maps live on the dispatcher (and a chunk's on its :class:`_Chunk`) from the method that makes them to
the one that last needs them, then are dropped (autograd keeps its own references for the backward): no per-layer state outlives the layer's forward.

Every gather has an atomic-free backward and every sum accumulates in fp32 with one rounding
(:func:`sftprof.models.layers.moe_permute.gather_rows` / :func:`~sftprof.models.layers.moe_permute.gather_sum_rows` through
-1-padded inverse maps ``[T, EP]`` and ``[N_recv, min(topk, L)]``). The all-to-alls are ``torch.distributed.all_to_all_single``
inside this module's autograd functions (:class:`_DispatchStart` / :class:`_DispatchWait`,
:class:`_CombineStart` / :class:`_CombineWait`).

:class:`DedupAlltoAllMoELayer` is megatron-core's ``MoELayer`` built with this dispatcher;
:func:`sftprof.models.specs.local_layer_spec` picks it when :func:`dedup_alltoall_applies` and
``actor.megatron.moe_dedup_alltoall`` is on.
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

import torch
from megatron.core import utils
from megatron.core.transformer.moe import moe_layer, token_dispatcher
from torch.distributed import all_to_all_single

from sftprof.models.layers.moe_permute import bound, gather_rows, gather_sum_rows, sorted_permute_applies


def dedup_alltoall_applies(config) -> bool:
    """True when the deduplicating dispatcher can stand in for megatron-core's alltoall dispatcher: EP > 1,
    experts without tensor parallelism (``expert_tensor_parallel_size`` 1, or unset with TP 1), dropless
    unfused routing (:func:`sftprof.models.layers.moe_permute.sorted_permute_applies`: alltoall dispatcher, no
    ``moe_permute_fusion``, no capacity factor or padding, no padding for quantization), and none of the
    features that reach into megatron's dispatcher state: ``moe_shared_expert_overlap``,
    ``overlap_moe_expert_parallel_comm``, CUDA graphs (``cuda_graph_impl``), ``moe_latent_size``.

    Args:
        config: the megatron ``TransformerConfig``.
    """
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    return (sorted_permute_applies(config) and config.expert_model_parallel_size > 1 and etp == 1
            and not config.moe_shared_expert_overlap and not config.overlap_moe_expert_parallel_comm
            and config.cuda_graph_impl == "none" and not config.moe_latent_size)


def _inverse(slots: torch.Tensor, n_rows: int, width: int) -> torch.Tensor:
    """``[n_rows, width]`` int64, -1 padded: entry ``slots[j]`` (a flat ``row * width + k`` position) holds ``j``."""
    inverse = torch.full((n_rows * width,), -1, dtype=torch.int64, device=slots.device)
    inverse.index_copy_(0, slots, torch.arange(slots.numel(), device=slots.device))
    return inverse.view(n_rows, width)


class _Exchange:
    """One chunked all-to-all over ``group``: chunk ``c`` sends ``send_splits[c][r]`` rows to rank ``r`` and
    receives ``recv_splits[c][r]`` rows from it. Holds the in-flight ``Work`` handles of the forward and of the
    backward (the gradients go the other way), and the buffers they fill, between the autograd functions below."""

    def __init__(self, group, send_splits: List[List[int]], recv_splits: List[List[int]]) -> None:
        self.group, self.send_splits, self.recv_splits = group, send_splits, recv_splits
        self.send_offsets = [0, *itertools.accumulate(map(sum, send_splits))]  # chunk c: rows [off[c], off[c + 1])
        self.recv_offsets = [0, *itertools.accumulate(map(sum, recv_splits))]
        self.works: List[list] = [[] for _ in send_splits]
        self.grad_works: List[list] = [[] for _ in send_splits]
        self.metas: list = []  # (shape, dtype, device, floating) of each tensor a dispatch sends
        self.out: Optional[torch.Tensor] = None
        self.grads: Optional[List[torch.Tensor]] = None

    def launch(self, chunk: int, outs, ins, reverse: bool = False) -> list:
        """Start chunk ``chunk``'s all-to-all of each ``ins[i]`` into ``outs[i]`` (``reverse``: the gradient
        direction, splits swapped); returns the ``Work`` handles."""
        send, recv = self.send_splits[chunk], self.recv_splits[chunk]
        if reverse:
            send, recv = recv, send
        return [all_to_all_single(o, i.contiguous(), recv, send, group=self.group, async_op=True)
                for o, i in zip(outs, ins)]


def _wait(works: list) -> None:
    for work in works:
        work.wait()  # on CUDA: the current stream waits for the transfer, the host does not
    works.clear()


class _DispatchStart(torch.autograd.Function):
    """Forward: start every chunk's all-to-all of each tensor in ``ins`` (``[N_send, ...]``, chunk-major rows)
    and return the per-chunk receive buffers (``[N_recv_c, ...]``, filled in flight) plus one empty token per chunk
    for :class:`_DispatchWait`. Backward: wait for the gradient all-to-alls that the chunks' waits started, and
    return the gradients ``[N_send, ...]`` (filled in place: no concatenation)."""

    @staticmethod
    def forward(ctx, ex: _Exchange, *ins):
        ctx.ex = ex
        ctx.set_materialize_grads(False)
        ex.metas = [(t.shape, t.dtype, t.device, t.is_floating_point()) for t in ins]
        outs = []
        for c in range(len(ex.send_splits)):
            chunk_outs = [t.new_empty((ex.recv_offsets[c + 1] - ex.recv_offsets[c],) + tuple(t.shape[1:])) for t in ins]
            chunk_ins = [t[ex.send_offsets[c]:ex.send_offsets[c + 1]] for t in ins]
            ex.works[c] = ex.launch(c, chunk_outs, chunk_ins)
            outs.extend(chunk_outs)
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        tokens = [ins[0].new_empty(0) for _ in ex.send_splits]
        return (*outs, *tokens)

    @staticmethod
    def backward(ctx, *grads):
        ex = ctx.ex
        if ex.grads is None:
            raise RuntimeError("DedupAlltoAllTokenDispatcher: a dispatch all-to-all's backward ran before its chunks' "
                               "waits started the gradients' all-to-alls")
        for works in ex.grad_works:
            _wait(works)
        result, ex.grads = ex.grads, None
        return (None, *result)


class _DispatchWait(torch.autograd.Function):
    """Forward: wait for chunk ``chunk``'s all-to-all and pass its buffers on. Backward: start the all-to-all of
    their gradients back to the senders, into chunk ``chunk``'s rows of the full gradient buffers, and return
    the token's (empty) gradient so that :class:`_DispatchStart`'s backward runs after every chunk's."""

    @staticmethod
    def forward(ctx, ex: _Exchange, chunk: int, token, *outs):
        ctx.ex, ctx.chunk = ex, chunk
        ctx.set_materialize_grads(False)
        _wait(ex.works[chunk])
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        ex, c = ctx.ex, ctx.chunk
        if ex.grads is None:
            ex.grads = [torch.empty(shape, dtype=dtype, device=device) if floating else None
                        for shape, dtype, device, floating in ex.metas]
        lo, hi = ex.send_offsets[c], ex.send_offsets[c + 1]
        n_recv = ex.recv_offsets[c + 1] - ex.recv_offsets[c]
        outs, ins = [], []
        for full, grad in zip(ex.grads, grads):
            if full is None:  # not floating (the routing sub-maps): no gradient, no exchange, on every rank
                continue
            # A gradient missing on this rank only (its experts did not use the tensor) still takes part as zeros:
            # every rank of the EP group makes the same collectives, and the rows this rank sent get the other
            # ranks' gradients.
            outs.append(full[lo:hi])
            ins.append(grad if grad is not None else full.new_zeros((n_recv,) + tuple(full.shape[1:])))
        ex.grad_works[c] = ex.launch(c, outs, ins, reverse=True)
        _, dtype, device, _ = ex.metas[0]  # the token is an empty tensor like the first (hidden) input
        return (None, None, torch.zeros(0, dtype=dtype, device=device), *([None] * len(grads)))


class _CombineStart(torch.autograd.Function):
    """Forward: start chunk ``chunk``'s all-to-all of ``x`` (``[N_c, H]``) into its rows of the exchange's full
    output (``[sum of received rows, H]``, allocated by chunk 0); return an empty token for :class:`_CombineWait`.
    Backward: wait for the gradient all-to-all that :class:`_CombineWait`'s backward started; return it."""

    @staticmethod
    def forward(ctx, ex: _Exchange, chunk: int, x):
        ctx.ex, ctx.chunk = ex, chunk
        ctx.set_materialize_grads(False)
        if ex.out is None:
            ex.out = x.new_empty((ex.recv_offsets[-1],) + tuple(x.shape[1:]))
        ex.works[chunk] = ex.launch(chunk, [ex.out[ex.recv_offsets[chunk]:ex.recv_offsets[chunk + 1]]], [x])
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        ex, c = ctx.ex, ctx.chunk
        _wait(ex.grad_works[c])
        grad, ex.grads[c] = ex.grads[c], None
        return None, None, grad


class _CombineWait(torch.autograd.Function):
    """Forward: wait for every chunk's all-to-all; return the full output. Backward: start every chunk's
    all-to-all of its rows of the gradient back to the senders; return the tokens' (empty) gradients."""

    @staticmethod
    def forward(ctx, ex: _Exchange, *tokens):
        ctx.ex = ex
        for works in ex.works:
            _wait(works)
        out, ex.out = ex.out, None
        return out

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        ex.grads = []
        for c in range(len(ex.send_splits)):
            g = grad.new_empty((ex.send_offsets[c + 1] - ex.send_offsets[c],) + tuple(grad.shape[1:]))
            ex.grad_works[c] = ex.launch(c, [g], [grad[ex.recv_offsets[c]:ex.recv_offsets[c + 1]]], reverse=True)
            ex.grads.append(g)
        return (None, *[grad.new_zeros(0) for _ in ex.send_splits])


class _Chunk:
    """One chunk of a layer's dispatch between the dispatcher's methods: its received rows, probability
    sub-rows and sub-map until :meth:`DedupAlltoAllTokenDispatcher.dispatch_postprocess`, then its index maps
    until :meth:`~DedupAlltoAllTokenDispatcher.combine_preprocess`, then the token of its all-to-all back."""

    def __init__(self, index: int, received: tuple) -> None:
        self.index, self.received = index, received
        self.rows = self.inverse = self.token = None


class DedupAlltoAllTokenDispatcher(token_dispatcher.MoETokenDispatcher):
    """The deduplicating all-to-all dispatcher (module docstring); constructor arguments of megatron-core's
    ``MoEAlltoAllTokenDispatcher``; :attr:`chunks` (``actor.megatron.moe_alltoall_chunks``, set by
    :class:`DedupAlltoAllMoELayer`) pipelines each all-to-all in that many token chunks.

    Shapes below: ``T`` tokens on this rank, ``H`` hidden size, ``EP`` ranks in ``pg_collection.ep``, ``L``
    local experts, ``N_send`` / ``N_recv`` rows sent / received, ``S`` (row, local expert) pairs received; a
    suffix ``_c`` for one chunk's share.

    Raises:
        ValueError: EP < 2, expert TP > 1, or local experts other than ``[ep_rank L, (ep_rank + 1) L)``
            (use megatron-core's dispatcher: :func:`dedup_alltoall_applies`).
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        ep_rank = utils.get_pg_rank(self.ep_group)
        expected = list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))
        if (self.ep_size < 2 or self.tp_size != 1 or self.local_expert_indices != expected
                or config.num_moe_experts != num_local_experts * self.ep_size):
            raise ValueError(f"actor.megatron.moe_dedup_alltoall: needs EP > 1 (got {self.ep_size}), expert TP 1 (got "
                             f"{self.tp_size}) and local experts {expected[0]}..{expected[-1]} of "
                             f"{config.num_moe_experts} (got {self.local_expert_indices}); set it false for this layout")
        self.max_local_experts = min(config.moe_router_topk, num_local_experts)
        self.chunks = 1

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Select the rows to send and exchange the counts (module docstring).

        Args:
            hidden_states: ``[..., H]`` (``[s, b, H]`` from the MoE layer; ``T`` = product of the leading dims).
            routing_map: ``[T, E]`` bool; probs: ``[T, E]`` router probabilities (zero off the map).
        Returns:
            ``(rows [N_send, H] in hidden_states' dtype, probability sub-rows [N_send, L] in probs' dtype)``,
            ordered by (token chunk, destination rank, token).
        Raises:
            ValueError: ``routing_map`` / ``probs`` not ``[T, E]``, or ``routing_map`` not bool.
        """
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        n_tokens, ep, n_local, n_chunks = x.shape[0], self.ep_size, self.num_local_experts, self.chunks
        shape = (n_tokens, ep * n_local)
        if tuple(routing_map.shape) != shape or tuple(probs.shape) != shape or routing_map.dtype != torch.bool:
            raise ValueError(f"DedupAlltoAllTokenDispatcher: needs a bool routing_map and probs of [T, E] = {shape}, "
                             f"got {routing_map.dtype} {tuple(routing_map.shape)} and {tuple(probs.shape)}")
        per_rank = routing_map.view(n_tokens, ep, n_local)
        to_rank = per_rank.any(dim=2)  # [T, EP]
        bounds = [n_tokens * c // n_chunks for c in range(n_chunks + 1)]
        # [K, EP, 2]: rows and (row, local expert) pairs of each token chunk for each destination
        per_token = torch.stack((to_rank.long(), per_rank.sum(dim=2)), dim=2)
        counts = torch.stack([per_token[lo:hi].sum(dim=0) for lo, hi in zip(bounds, bounds[1:])])
        send = counts.transpose(0, 1).contiguous()  # [EP, K, 2], destination-major
        recv = torch.empty_like(send)  # [EP, K, 2], source-major
        all_to_all_single(recv, send, group=self.ep_group)
        sent, received = torch.stack((send, recv)).tolist()  # the host sync of the dispatch
        self.send_splits = [[sent[r][c][0] for r in range(ep)] for c in range(n_chunks)]
        self.recv_splits = [[received[r][c][0] for r in range(ep)] for c in range(n_chunks)]
        self.recv_pairs = [sum(received[r][c][1] for r in range(ep)) for c in range(n_chunks)]
        ranks, tokens = [], []
        for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            # an empty chunk (fewer tokens than chunks) still takes part in the exchanges, with no rows
            flat = torch.nonzero_static(to_rank[lo:hi].T.reshape(-1), size=sum(self.send_splits[c])).squeeze(1)
            ranks.append(flat // (hi - lo))
            tokens.append(flat % (hi - lo) + lo)
        rank, token = torch.cat(ranks), torch.cat(tokens)
        sub_rows = token * ep + rank  # rows of the [T * EP, L] views; flat positions of [T, EP]
        self.send_tokens = token
        # [T, EP]: the sent row of (token, rank), -1 where the token does not go to that rank
        self.send_inverse = _inverse(sub_rows, n_tokens, ep)
        self.send_map = per_rank.reshape(-1, n_local).index_select(0, sub_rows).to(torch.uint8)
        send_probs = probs.reshape(-1, n_local).index_select(0, sub_rows)
        return gather_rows(x, token, self.send_inverse), send_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Tuple[List[_Chunk], None]:
        """Start every chunk's all-to-all of the rows, probability sub-rows and routing sub-maps (asynchronous:
        :meth:`dispatch_postprocess` waits for each chunk).

        Args:
            hidden_states: ``[N_send, H]``; probs: ``[N_send, L]`` (from :meth:`dispatch_preprocess`).
        Returns:
            ``(chunks, None)``: one :class:`_Chunk` per token chunk (rows source-rank-major within it).
        """
        ex = _Exchange(self.ep_group, self.send_splits, self.recv_splits)
        ins = (hidden_states, probs, self.send_map)
        self.send_map = None
        out = _DispatchStart.apply(ex, *ins)
        n, tokens = len(ins), out[len(ins) * self.chunks:]
        self.combine_exchange = _Exchange(self.ep_group, self.recv_splits, self.send_splits)
        return [_Chunk(c, (ex, c, tokens[c], *out[n * c:n * (c + 1)])) for c in range(self.chunks)], None

    def dispatch_postprocess(self, chunk: _Chunk) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Wait for one chunk's rows and permute them by local expert.

        Args:
            chunk: from :meth:`token_dispatch` (its rows ``[N_recv_c, H]``, probabilities ``[N_recv_c, L]``).
        Returns:
            ``(expert input [S_c, H], tokens_per_expert [L] int64 on the rows' device, probabilities [S_c])``:
            expert-major, ascending received row within an expert.
        Raises:
            RuntimeError: (CPU at once; CUDA as a device-side assert) a received row with more than
                ``min(topk, L)`` local experts.
        """
        hidden_states, probs, recv_map = _DispatchWait.apply(*chunk.received)
        chunk.received = None
        n_recv, n_local = recv_map.shape
        width = self.max_local_experts
        local = recv_map.bool()
        torch._assert_async((local.sum(dim=1) <= width).all(),
                            f"DedupAlltoAllTokenDispatcher: a received row has more than min(topk, L)={width} experts")
        tokens_per_expert = local.sum(dim=0)
        # e * N_recv + row, expert-major; the size came with the counts (no host sync)
        flat = torch.nonzero_static(local.T.reshape(-1), size=self.recv_pairs[chunk.index]).squeeze(1)
        expert, row = flat // n_recv, flat % n_recv
        cell = row * n_local + expert
        k = (local.cumsum(dim=1, dtype=torch.int32).reshape(-1).index_select(0, cell) - 1).long()
        chunk.rows = row
        chunk.inverse = _inverse(row * width + k, n_recv, width)  # [N_recv_c, width], k-th local expert's slot
        permuted_probs = probs.reshape(-1).index_select(0, cell)
        return gather_rows(hidden_states, row, chunk.inverse), tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor, chunk: _Chunk) -> None:
        """Sum each received row's expert outputs (``[S_c, H] -> [N_recv_c, H]``, fp32 accumulation, one
        rounding) and start their all-to-all back to the senders (asynchronous: :meth:`token_combine` waits)."""
        out = gather_sum_rows(hidden_states, chunk.rows, chunk.inverse)
        chunk.rows = chunk.inverse = None
        chunk.token = _CombineStart.apply(self.combine_exchange, chunk.index, out)

    def token_combine(self, chunks: List[_Chunk]) -> torch.Tensor:
        """Wait for every chunk's all-to-all back: ``[N_send, H]`` in the order of :meth:`dispatch_preprocess`."""
        ex, self.combine_exchange = self.combine_exchange, None
        return _CombineWait.apply(ex, *[chunk.token for chunk in chunks])

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum each token's rows over the ranks it went to: ``[N_send, H]`` -> the input's shape ``[..., H]``
        (a token routed nowhere gets zeros)."""
        out = gather_sum_rows(hidden_states, self.send_tokens, self.send_inverse)
        self.send_tokens = self.send_inverse = None
        return out.view(self.hidden_shape)


class DedupAlltoAllMoELayer(moe_layer.MoELayer):
    """megatron-core's ``MoELayer`` whose alltoall token dispatcher is :class:`DedupAlltoAllTokenDispatcher`
    (constructor arguments of ``MoELayer``, plus ``alltoall_chunks``: ``actor.megatron.moe_alltoall_chunks``; keywords
    of later megatron-core releases, ``is_mtp_layer`` and ``name``, are passed on to ``MoELayer``),
    with the routed experts run chunk by chunk: chunk ``c``'s experts run while chunk ``c + 1``'s rows and
    chunk ``c - 1``'s outputs are in flight (module docstring).

    Raises:
        ValueError: :func:`dedup_alltoall_applies` is False for ``config`` (the spec must pick another layer), or
            ``alltoall_chunks`` is not an integer >= 1.
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None, pg_collection=None,
                 alltoall_chunks: int = 1, **megatron_kwargs) -> None:
        if not dedup_alltoall_applies(config):
            raise ValueError("actor.megatron.moe_dedup_alltoall: DedupAlltoAllMoELayer needs EP > 1, expert TP 1, "
                             "moe_token_dispatcher_type='alltoall', moe_permute_fusion=False, no capacity factor or "
                             "padding, no moe_shared_expert_overlap / overlap_moe_expert_parallel_comm / CUDA graphs "
                             "(use megatron-core's MoELayer otherwise)")
        if not isinstance(alltoall_chunks, int) or isinstance(alltoall_chunks, bool) or alltoall_chunks < 1:
            raise ValueError(f"actor.megatron.moe_alltoall_chunks={alltoall_chunks!r}: must be an integer >= 1")
        with bound(moe_layer, MoEAlltoAllTokenDispatcher=DedupAlltoAllTokenDispatcher):
            super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                             **megatron_kwargs)
        self.token_dispatcher.chunks = alltoall_chunks

    def routed_experts_compute(self, hidden_states: List[_Chunk], probs: None) -> Tuple[List[_Chunk], None]:
        """For each chunk from :meth:`DedupAlltoAllTokenDispatcher.token_dispatch`: wait for its rows, run the
        local experts on them and start their all-to-all back (megatron-core's ``MoELayer`` calls this between
        ``dispatch`` and ``combine``).

        Args:
            hidden_states: the chunks; probs: None (each chunk carries its probabilities).
        Returns:
            ``(the chunks, None)`` for ``combine`` (no expert bias).
        """
        dispatcher = self.token_dispatcher
        for chunk in hidden_states:
            rows, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(chunk)
            expert_output, mlp_bias = self.experts(rows, tokens_per_expert, permuted_probs)
            assert mlp_bias is None, "DedupAlltoAllMoELayer: experts with a bias are not supported"
            dispatcher.combine_preprocess(expert_output, chunk)
        return hidden_states, None
