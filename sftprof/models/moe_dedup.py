"""A deduplicating all-to-all MoE token dispatcher: each token goes once to each EP rank that holds >= 1 of its experts.

megatron-core 0.16.1's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/token_dispatcher.py``)
sends one row per (token, selected expert): with ``topk`` of ``E`` experts spread over ``EP`` ranks a token
reaches another rank about ``topk / EP`` times (Qwen3-30B-A3B, topk 8 of 128, EP = 2: ~4 copies), and its
combine all-to-all brings as many rows back. :class:`DedupAlltoAllTokenDispatcher` implements the same six
dispatcher methods (``dispatch_preprocess`` .. ``combine_postprocess``, called by megatron-core's ``MoELayer``)
with one row per (token, destination EP rank):

- ``dispatch_preprocess``: for each EP rank ``r`` (local experts ``[r L, (r + 1) L)``, ``L = E / EP``) the
  tokens with >= 1 selected expert there, rank-major, ascending token: ``N_send`` rows of ``H``; with each row
  its routing sub-map ``[L]`` (uint8) and router-probability sub-row ``[L]`` (router dtype, differentiable).
  One host sync (the per-rank counts: the all-to-all's ``input_splits``).
- ``token_dispatch``: an all-to-all of the int64 ``[EP]`` counts (``output_splits``, one host sync), then of
  the hidden rows, the probability sub-rows and the sub-maps.
- ``dispatch_postprocess``: the received rows permuted by local expert (expert-major, ascending received-row
  index: the order of megatron-core's chunk sort, so the experts see the same rows in the same order), one
  ``nonzero`` (a host sync); ``tokens_per_expert`` ``[L]`` int64 on the rows' device.
- ``combine_preprocess``: each received row's expert outputs summed (the experts applied the probabilities):
  ``[N_recv, H]``.
- ``token_combine``: the all-to-all back (splits reversed): ``[N_send, H]``.
- ``combine_postprocess``: each token's sum over the ranks it went to, reshaped to the input's shape.

Bytes per direction and rank: ``N_send * H * b`` hidden (``b`` bytes per element: 2 in bf16) plus
``N_send * L * (1 + p)`` for the sub-maps and probabilities (``p`` bytes of the router dtype, dispatch only,
and its gradient back), instead of megatron-core's ``T * topk_r * H * b`` (``topk_r``: a token's selected
experts on other ranks). At EP = 2 with topk 8 of 128 experts, ``H = 2048``, bf16 and fp32 router
probabilities the hidden rows shrink ~4x and the sub-rows add ``64 * 5 = 320`` bytes per 4096-byte row.

The index maps live on the dispatcher from ``dispatch_preprocess`` to the method that last needs them, then are
dropped (autograd keeps its own references for the backward): no per-layer state outlives the layer's forward.

Every gather has an atomic-free backward and every sum accumulates in fp32 with one rounding
(:func:`sftprof.models.moe_permute.gather_rows` / :func:`~sftprof.models.moe_permute.gather_sum_rows` through
-1-padded inverse maps ``[T, EP]`` and ``[N_recv, min(topk, L)]``). The all-to-alls are megatron-core's autograd
``tensor_parallel.mappings.all_to_all``.

:class:`DedupAlltoAllMoELayer` is megatron-core's ``MoELayer`` built with this dispatcher;
:func:`sftprof.models.specs.local_layer_spec` picks it when :func:`dedup_alltoall_applies` and
``actor.megatron.moe_dedup_alltoall`` is on.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from megatron.core import utils
from megatron.core.tensor_parallel.mappings import all_to_all
from megatron.core.transformer.moe import moe_layer, token_dispatcher

from sftprof.models.moe_permute import bound, gather_rows, gather_sum_rows, sorted_permute_applies


def dedup_alltoall_applies(config) -> bool:
    """True when the deduplicating dispatcher can stand in for megatron-core's alltoall dispatcher: EP > 1,
    experts without tensor parallelism (``expert_tensor_parallel_size`` 1, or unset with TP 1), dropless
    unfused routing (:func:`sftprof.models.moe_permute.sorted_permute_applies`: alltoall dispatcher, no
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


class DedupAlltoAllTokenDispatcher(token_dispatcher.MoETokenDispatcher):
    """The deduplicating all-to-all dispatcher (module docstring); constructor arguments of megatron-core's
    ``MoEAlltoAllTokenDispatcher``.

    Shapes below: ``T`` tokens on this rank, ``H`` hidden size, ``EP`` ranks in ``pg_collection.ep``, ``L``
    local experts, ``N_send`` / ``N_recv`` rows sent / received, ``S`` (row, local expert) pairs received.

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

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Select the rows to send (module docstring).

        Args:
            hidden_states: ``[..., H]`` (``[s, b, H]`` from the MoE layer; ``T`` = product of the leading dims).
            routing_map: ``[T, E]`` bool; probs: ``[T, E]`` router probabilities (zero off the map).
        Returns:
            ``(rows [N_send, H] in hidden_states' dtype, probability sub-rows [N_send, L] in probs' dtype)``.
        Raises:
            ValueError: ``routing_map`` / ``probs`` not ``[T, E]``, or ``routing_map`` not bool.
        """
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        n_tokens, ep, n_local = x.shape[0], self.ep_size, self.num_local_experts
        shape = (n_tokens, ep * n_local)
        if tuple(routing_map.shape) != shape or tuple(probs.shape) != shape or routing_map.dtype != torch.bool:
            raise ValueError(f"DedupAlltoAllTokenDispatcher: needs a bool routing_map and probs of [T, E] = {shape}, "
                             f"got {routing_map.dtype} {tuple(routing_map.shape)} and {tuple(probs.shape)}")
        per_rank = routing_map.view(n_tokens, ep, n_local)
        to_rank = per_rank.any(dim=2)  # [T, EP]
        self.send_counts = to_rank.sum(dim=0)  # [EP] int64
        self.input_splits = self.send_counts.tolist()  # the host sync of the dispatch
        flat = torch.nonzero_static(to_rank.T.reshape(-1), size=sum(self.input_splits)).squeeze(1)  # r * T + t
        rank, token = flat // n_tokens, flat % n_tokens
        sub_rows = token * ep + rank  # rows of the [T * EP, L] views; flat positions of [T, EP]
        self.send_tokens = token
        # [T, EP]: the sent row of (token, rank), -1 where the token does not go to that rank
        self.send_inverse = _inverse(sub_rows, n_tokens, ep)
        self.send_map = per_rank.reshape(-1, n_local).index_select(0, sub_rows).to(torch.uint8)
        send_probs = probs.reshape(-1, n_local).index_select(0, sub_rows)
        return gather_rows(x, token, self.send_inverse), send_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Exchange the row counts, then the rows, probability sub-rows and routing sub-maps.

        Args:
            hidden_states: ``[N_send, H]``; probs: ``[N_send, L]`` (from :meth:`dispatch_preprocess`).
        Returns:
            ``(rows [N_recv, H], probability sub-rows [N_recv, L])``, source-rank-major.
        """
        self.output_splits = all_to_all(self.ep_group, self.send_counts).tolist()  # one count to each rank
        received = all_to_all(self.ep_group, hidden_states, self.output_splits, self.input_splits)
        received_probs = all_to_all(self.ep_group, probs, self.output_splits, self.input_splits)
        self.recv_map = all_to_all(self.ep_group, self.send_map, self.output_splits, self.input_splits)
        self.send_map = None
        return received, received_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor,
                             probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Permute the received rows by local expert.

        Args:
            hidden_states: ``[N_recv, H]``; probs: ``[N_recv, L]`` (from :meth:`token_dispatch`).
        Returns:
            ``(expert input [S, H], tokens_per_expert [L] int64 on the rows' device, probabilities [S])``:
            expert-major, ascending received row within an expert.
        Raises:
            RuntimeError: (CPU at once; CUDA as a device-side assert) a received row with more than
                ``min(topk, L)`` local experts.
        """
        n_recv, n_local = self.recv_map.shape
        width = self.max_local_experts
        local, self.recv_map = self.recv_map.bool(), None
        torch._assert_async((local.sum(dim=1) <= width).all(),
                            f"DedupAlltoAllTokenDispatcher: a received row has more than min(topk, L)={width} experts")
        tokens_per_expert = local.sum(dim=0)
        flat = local.T.reshape(-1).nonzero().squeeze(1)  # e * N_recv + row, expert-major: a host sync
        expert, row = flat // n_recv, flat % n_recv
        cell = row * n_local + expert
        k = (local.cumsum(dim=1, dtype=torch.int32).reshape(-1).index_select(0, cell) - 1).long()
        self.recv_rows = row
        self.recv_inverse = _inverse(row * width + k, n_recv, width)  # [N_recv, width], k-th local expert's slot
        permuted_probs = probs.reshape(-1).index_select(0, cell)
        return gather_rows(hidden_states, row, self.recv_inverse), tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum each received row's expert outputs: ``[S, H] -> [N_recv, H]`` (fp32 accumulation, one rounding)."""
        out = gather_sum_rows(hidden_states, self.recv_rows, self.recv_inverse)
        self.recv_rows = self.recv_inverse = None
        return out

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The all-to-all back to the sending ranks: ``[N_recv, H] -> [N_send, H]``."""
        return all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum each token's rows over the ranks it went to: ``[N_send, H]`` -> the input's shape ``[..., H]``
        (a token routed nowhere gets zeros)."""
        out = gather_sum_rows(hidden_states, self.send_tokens, self.send_inverse)
        self.send_tokens = self.send_inverse = None
        return out.view(self.hidden_shape)


class DedupAlltoAllMoELayer(moe_layer.MoELayer):
    """megatron-core's ``MoELayer`` whose alltoall token dispatcher is :class:`DedupAlltoAllTokenDispatcher`
    (constructor arguments of ``MoELayer``).

    Raises:
        ValueError: :func:`dedup_alltoall_applies` is False for ``config`` (the spec must pick another layer).
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None, pg_collection=None) -> None:
        if not dedup_alltoall_applies(config):
            raise ValueError("actor.megatron.moe_dedup_alltoall: DedupAlltoAllMoELayer needs EP > 1, expert TP 1, "
                             "moe_token_dispatcher_type='alltoall', moe_permute_fusion=False, no capacity factor or "
                             "padding, no moe_shared_expert_overlap / overlap_moe_expert_parallel_comm / CUDA graphs "
                             "(use megatron-core's MoELayer otherwise)")
        with bound(moe_layer, MoEAlltoAllTokenDispatcher=DedupAlltoAllTokenDispatcher):
            super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
