"""The training-engine interface both backends implement (``fsdp`` and ``megatron``).

The trainer (:mod:`sftprof.trainer`) only talks to an :class:`Engine`:

1. ``engine = build_engine(cfg, layout, hf_config, device)`` (:mod:`sftprof.engine.factory`) after
   the default process group is up (one process per rank, ``torchrun``). The engine builds its model
   (random init unless ``actor.init_from_scratch=false`` and the model directory holds weights), its
   optimizer and any parallel groups it needs.
2. Once per step: ``result = engine.train_step(micro_batches, global_loss_tokens)`` with the
   micro-batches of this rank's DP rank (:func:`sftprof.data.step_micro_batches`; ranks that
   share a DP rank, i.e. CP/TP/PP peers, get the same full-length micro-batches and slice them
   themselves, e.g. with :func:`sftprof.data.cp_shard`).

Contract of ``train_step`` (every backend):

- Loss = sum over the global batch of ``-logprob(label) * loss_mask`` divided by
  ``global_loss_tokens`` (the loss tokens of the whole global batch, all DP ranks), i.e. the
  token-mean SFT loss; gradients are those of that loss whatever the DP size and micro-batch
  count (gradient accumulation over micro-batches, then one optimizer step with gradient-norm
  clipping at ``actor.optimizer.gradient_clipping``).
- Annotations (:func:`sftprof.capture.regions.region`, names from :mod:`sftprof.artifacts`): the
  forward of micro-batch ``i`` runs inside ``region(forward(i))``, its backward inside ``region(backward(i))``, the optimizer step
  (clipping included) inside ``region(OPTIMIZER_STEP)``. The trainer wraps the whole step in
  ``region(STEP)``. Pipeline schedules that interleave micro-batches annotate each micro-batch's
  forward/backward where it runs.
- Returns a :class:`StepResult` with identical values on every rank (reduced over ranks).
- Does not synchronise the device at the end: the trainer does that for timing.

``Engine.rank_coords`` is this rank's ``{"pp", "dp", "cp", "tp", "ep", "etp"}`` (as
``Layout.rank_coords``), used for snapshot file names and logs.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import List, Optional

from sftprof.data import MicroBatch


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step, the same on every rank.

    Attributes:
        loss: global token-mean of ``-logprob`` over the loss tokens of the step (nats).
        grad_norm: total L2 norm of the gradients before clipping (all parameters, all ranks).
        model_flops: model FLOPs of the step summed over all ranks (forward + backward, no
            recompute; :func:`sftprof.flops.train_step_flops`), or None when the backend cannot
            count them. The trainer divides by step time and world size for TFLOP/s per GPU and MFU.
        recompute_flops: FLOPs re-run by activation recompute in the step (all ranks), reported
            separately and never added to ``model_flops``; None when not counted.
        moe_load: routing load of the step summed over all ranks
            (:meth:`sftprof.models.layers.routing.RoutingLoadMeter.step_record`), or None when not measured.
    """

    loss: float
    grad_norm: float
    model_flops: Optional[float]
    recompute_flops: Optional[float] = None
    moe_load: Optional[dict] = None


class Engine(abc.ABC):
    """A model + optimizer on this rank that can run one SFT training step (module docstring)."""

    @property
    @abc.abstractmethod
    def rank_coords(self) -> dict:
        """This rank's ``{"pp", "dp", "cp", "tp", "ep", "etp"}`` coordinates."""

    @abc.abstractmethod
    def train_step(self, micro_batches: List[MicroBatch], global_loss_tokens: int) -> StepResult:
        """Forward + backward over ``micro_batches``, then one optimizer step.

        Args:
            micro_batches: this DP rank's micro-batches for the step (CPU tensors ``[n, L]``).
            global_loss_tokens: loss tokens of the global batch (all DP ranks), > 0.

        Returns:
            :class:`StepResult`, identical on every rank.
        """

