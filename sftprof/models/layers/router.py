"""Fused top-k of megatron-core's MoE router without Transformer Engine (softmax score function).

megatron-core 0.16.1's ``TopKRouter.routing`` (``megatron/core/transformer/moe/router.py``) calls two functions of
``megatron/core/transformer/moe/moe_utils.py`` on the router logits ``[T, E]``:
``topk_routing_with_score_function`` (the probabilities and routing map the dispatcher uses) and, with an
auxiliary loss, ``compute_routing_scores_for_aux_loss`` (the full softmax and the routing map the load-balancing
loss counts). Unfused, each runs a ``torch.topk`` over ``[T, E]`` (~1 ms each at 131072 x 128 fp32 on an H200,
issue 18), softmaxes, and zeros + ``scatter`` into ``[T, E]``; ``moe_router_fusion`` replaces them with TE's
kernels and raises without TE. :func:`topk_routing_with_score_function` and
:func:`compute_routing_scores_for_aux_loss` have megatron's signatures; where :func:`fused_router_applies` they run
one Triton kernel each (:func:`sftprof.models.layers.router_kernels.router_topk`), otherwise megatron's own function.
:func:`install_in_megatron` binds them in ``megatron.core.transformer.moe.router`` (where ``TopKRouter`` looks them
up) when TE is missing; :func:`sftprof.models.megatron_config.training_config_kwargs` calls it
(``actor.megatron.moe_fused_router``).

Math, as megatron's unfused code defines it (``x``: a row of fp32 logits, ``I``: its top-k positions, ``s``: the
``scaling_factor``, 1 when unset):

- ``use_pre_softmax=False``: ``probs[I] = s * softmax(x[I])``; gradient ``d x[I] = p * (g - sum(p * g))`` with
  ``p = softmax(x[I])``, ``g = s * d probs[I]``, and 0 elsewhere;
- ``use_pre_softmax=True``: ``probs[I] = s * softmax(x)[I]``; gradient the softmax backward of ``y = softmax(x)``
  with ``g = s * d probs`` on ``I`` and 0 elsewhere: ``d x = y * (g - sum(y * g))``;
- aux-loss scores: ``softmax(x)`` over the row, gradient ``y * (d y - sum(y * d y))``.

The backward passes are torch's softmax backward (``torch._softmax_backward_data``: one kernel) on the dense
``[T, E]`` tensors; for ``use_pre_softmax=False`` the dense ``p`` is zero off ``I``, so the sum runs over ``I``.

Which experts (the kernel's choice, documented because ``torch.topk``'s order among equal values is unspecified):
the ``k`` largest logits of the row; among equal logits the lower expert index first; NaN counts as the largest.
The top-k of the softmax is picked on the logits too: the softmax is monotone, so this is a top-k of the scores as
well, and where fp32 rounding makes two scores equal the larger logit wins (then the lower index).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["MAX_EXPERTS", "fused_router_applies", "topk_routing_with_score_function",
           "compute_routing_scores_for_aux_loss", "install_in_megatron"]

MAX_EXPERTS = 512  # the largest E the tests run (a row is one tile of next_pow2(E) fp32 across 128 threads)


def _kernel_runs_on(t: torch.Tensor) -> bool:
    """CUDA tensors; CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    if t.is_cuda:
        return True
    if t.device.type != "cpu":
        return False
    try:
        from sftprof.models.layers import router_kernels
    except ImportError:  # no triton (CPU installs)
        return False
    return router_kernels.INTERPRET


def fused_router_applies(logits, topk, score_function: str = "softmax", fused: bool = False) -> bool:
    """True when the Triton path computes what megatron's unfused function would, for the arguments both
    megatron functions share: ``logits`` a 2-D fp32 tensor ``[T, E]`` on CUDA (or on the CPU under Triton's
    interpreter), ``1 <= topk <= E <= MAX_EXPERTS``, ``score_function == "softmax"``, ``fused`` False (that is
    TE's path), and ``torch.are_deterministic_algorithms_enabled()`` False.
    :func:`topk_routing_with_score_function` further needs no expert groups, no expert bias and no router replay.
    """
    return (isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.dtype == torch.float32
            and isinstance(topk, int) and 1 <= topk <= logits.shape[1] <= MAX_EXPERTS
            and score_function == "softmax" and not fused and not torch.are_deterministic_algorithms_enabled()
            and _kernel_runs_on(logits))


class _TopkRouting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, pre_softmax, scale):
        from sftprof.models.layers import router_kernels

        probs, routing_map, _ = router_kernels.router_topk(logits.contiguous(), topk, pre_softmax, scale,
                                                           write_probs=True, write_scores=False)
        ctx.mark_non_differentiable(routing_map)
        ctx.pre_softmax, ctx.scale = pre_softmax, scale
        ctx.save_for_backward(logits if pre_softmax else probs, routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, d_probs, _):
        saved, routing_map = ctx.saved_tensors
        g = d_probs if ctx.scale == 1.0 else d_probs * ctx.scale
        if ctx.pre_softmax:  # saved: the logits; y = the row softmax, g only on the top-k
            y = torch.softmax(saved, dim=-1)
            g = torch.where(routing_map, g, 0.0)
        else:  # saved: the probs, s * softmax over the top-k, zeros elsewhere
            y = saved if ctx.scale == 1.0 else saved / ctx.scale
        return torch._softmax_backward_data(g, y, -1, torch.float32), None, None, None


class _AuxScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk):
        from sftprof.models.layers import router_kernels

        _, routing_map, scores = router_kernels.router_topk(logits.contiguous(), topk, True, 1.0,
                                                            write_probs=False, write_scores=True)
        ctx.mark_non_differentiable(routing_map)
        ctx.save_for_backward(scores)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _, d_scores):
        (scores,) = ctx.saved_tensors
        return torch._softmax_backward_data(d_scores, scores, -1, torch.float32), None


def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                                     scaling_factor: Optional[float] = None, score_function: str = "softmax",
                                     expert_bias: Optional[torch.Tensor] = None, fused: bool = False,
                                     router_replay=None, dense_output: bool = False,
                                     precomputed_indices: Optional[torch.Tensor] = None
                                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's ``moe_utils.topk_routing_with_score_function`` (same arguments and results), one Triton
    kernel forward where :func:`fused_router_applies` and ``num_groups``, ``group_topk``, ``expert_bias``,
    ``router_replay``, ``dense_output`` and ``precomputed_indices`` are all unset; megatron's own function otherwise
    (its errors included; the last two are arguments of megatron-core >= 0.17 and 0.19, passed on only when set).

    Args:
        logits: ``[T, E]`` router logits (fp32 for the fused path).
        topk: experts per token.
        use_pre_softmax: softmax over the row before the top-k (else softmax over the top-k logits).
        scaling_factor: multiplies the probabilities when truthy (megatron's ``if scaling_factor``).
        num_groups, group_topk, score_function, expert_bias, fused, router_replay, dense_output,
            precomputed_indices: megatron's.
    Returns:
        ``(routing_probs [T, E] in logits' dtype, routing_map [T, E] bool)``: the top-k probabilities at the
        selected experts (zeros elsewhere; differentiable in ``logits``, see the module's math) and the selection.
    """
    newer = {k: v for k, v in (("dense_output", dense_output), ("precomputed_indices", precomputed_indices))
             if v is not None and v is not False}
    if (num_groups or group_topk or expert_bias is not None or router_replay is not None or newer
            or not fused_router_applies(logits, topk, score_function, fused)):
        from megatron.core.transformer.moe import moe_utils

        return moe_utils.topk_routing_with_score_function(
            logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
            scaling_factor=scaling_factor, score_function=score_function, expert_bias=expert_bias, fused=fused,
            router_replay=router_replay, **newer)
    return _TopkRouting.apply(logits, topk, bool(use_pre_softmax), float(scaling_factor) if scaling_factor else 1.0)


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str, fused: bool = False,
                                        padding_mask: Optional[torch.Tensor] = None
                                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's ``moe_utils.compute_routing_scores_for_aux_loss`` (same arguments and results), one Triton
    kernel forward where :func:`fused_router_applies`; megatron's own function otherwise (its errors included).

    Args:
        logits: ``[T, E]`` router logits (fp32 for the fused path).
        topk: experts per token counted by the load-balancing loss.
        score_function, fused: megatron's.
        padding_mask: optional ``[T]`` bool, True at padding tokens (megatron-core's use: their map rows and scores
            are zeroed, as in its unfused code).
    Returns:
        ``(routing_map [T, E] bool, scores [T, E] fp32)``: the top-k of the softmax scores, and the softmax over
        each row (differentiable in ``logits``).
    """
    if not fused_router_applies(logits, topk, score_function, fused):
        from megatron.core.transformer.moe import moe_utils

        return moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=fused,
                                                             padding_mask=padding_mask)
    routing_map, scores = _AuxScores.apply(logits, topk)
    if padding_mask is not None:  # megatron's own masking of its unfused path
        valid = (~padding_mask).unsqueeze(-1)
        routing_map, scores = routing_map * valid, scores * valid
    return routing_map, scores


def install_in_megatron(enable: bool = True) -> bool:
    """Bind :func:`topk_routing_with_score_function` and :func:`compute_routing_scores_for_aux_loss` as the names
    ``TopKRouter`` calls in ``megatron.core.transformer.moe.router``, when ``enable`` and Transformer Engine is
    missing (with TE, megatron-core's ``moe_router_fusion`` is the fused path); otherwise bind megatron's own
    ``moe_utils`` functions there again. Idempotent. Returns True when the fused router is bound.
    """
    from megatron.core.transformer.moe import moe_utils, router

    on = bool(enable) and not moe_utils.HAVE_TE
    router.topk_routing_with_score_function = (
        topk_routing_with_score_function if on else moe_utils.topk_routing_with_score_function)
    router.compute_routing_scores_for_aux_loss = (
        compute_routing_scores_for_aux_loss if on else moe_utils.compute_routing_scores_for_aux_loss)
    return on
