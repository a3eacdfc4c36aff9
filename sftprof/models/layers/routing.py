"""MoE routing load per step: tokens routed to each expert, per layer, summed over all ranks.

With trained weights routing is skewed, and the busiest expert (and the EP rank holding it) sets the
MoE time and the dispatch buffers' size. :class:`RoutingLoadMeter` hooks every MoE router, adds up the
tokens each expert receives in the step's first-pass forwards (activation recompute re-runs the router
inside backward: those calls are not counted), and at the end of the step sums the counts over all
ranks (every rank routes a different slice of tokens: DP ranks other samples, CP and sequence-parallel
TP ranks other positions; pipeline stages other layers).

Record per step (:meth:`RoutingLoadMeter.step_record`), over the layers of the whole model:

- ``max_over_mean``: per layer, the busiest expert's tokens divided by the mean tokens per expert
  (1.0 = perfectly balanced; ``top_k * tokens / num_experts`` is the mean);
- ``ep_max_over_mean``: per layer, the busiest EP rank's tokens (sum over its experts) over the mean per
  EP rank (equal to 1.0 with EP = 1);
- ``worst_layer``, ``max_over_mean_max``, ``ep_max_over_mean_max``: the worst of those.

Router outputs understood: megatron-core ``TopKRouter`` returns ``(probs, routing_map [tokens, E] bool)``;
Hugging Face ``Qwen3MoeTopKRouter`` returns ``(logits, scores, indices [tokens, top_k])``.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist


def _in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (activation recompute happens there)."""
    return torch._C._current_graph_task_id() != -1


class RoutingLoadMeter:
    """Per-step tokens-per-expert counts of the MoE routers of this rank's layers.

    Args:
        routers: ``(global_layer_index, router_module)`` of the layers on this rank.
        num_layers: layers of the whole model (all pipeline stages).
        num_experts: experts per MoE layer.
        ep_size: expert-parallel size (experts ``[r * E/ep, (r + 1) * E/ep)`` live on EP rank ``r``).
        device: where the counts accumulate (the model's device; no host sync until :meth:`step_record`).
    """

    def __init__(self, routers: Iterable[Tuple[int, torch.nn.Module]], num_layers: int, num_experts: int,
                 ep_size: int, device: torch.device) -> None:
        self.num_experts, self.ep_size = num_experts, ep_size
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        for g, router in routers:
            router.register_forward_hook(self._hook(g))

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if _in_backward():
                return
            if len(output) == 2:  # megatron: (probs, routing_map [tokens, E])
                per_expert = output[1].sum(dim=0)
            else:  # Hugging Face: (logits, scores, indices [tokens, k])
                per_expert = torch.bincount(output[2].reshape(-1), minlength=self.num_experts)
            self.counts[layer] += per_expert.to(self.counts.dtype)
        return hook

    def step_record(self, group: Optional[dist.ProcessGroup] = None) -> dict:
        """Sum the step's counts over ``group`` (default: all ranks), reset them, and return the record.

        Collective: every rank of ``group`` must call it once per step.

        Returns:
            ``{"tokens_per_expert_max", "tokens_per_expert_mean", "max_over_mean", "ep_max_over_mean"}``
            (lists over layers; tokens as counted routing slots, i.e. ``top_k`` per token) plus
            ``worst_layer``, ``max_over_mean_max`` and ``ep_max_over_mean_max``. Layers that routed no
            token report ``None``.
        """
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        counts = counts.cpu()
        per_rank = counts.reshape(counts.shape[0], self.ep_size, -1).sum(dim=2)
        mean = counts.mean(dim=1)
        ratio: List[Optional[float]] = []
        ep_ratio: List[Optional[float]] = []
        for layer in range(counts.shape[0]):
            m = float(mean[layer])
            ratio.append(float(counts[layer].max()) / m if m > 0 else None)
            ep_ratio.append(float(per_rank[layer].max() / per_rank[layer].mean()) if m > 0 else None)
        valid = [(r, i) for i, r in enumerate(ratio) if r is not None]
        worst = max(valid)[1] if valid else None
        return {"tokens_per_expert_max": [float(x) for x in counts.max(dim=1).values],
                "tokens_per_expert_mean": [float(x) for x in mean],
                "max_over_mean": ratio, "ep_max_over_mean": ep_ratio, "worst_layer": worst,
                "max_over_mean_max": ratio[worst] if worst is not None else None,
                "ep_max_over_mean_max": max((r for r in ep_ratio if r is not None), default=None)}
