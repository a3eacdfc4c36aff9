"""The training-engine interface both backends implement (``fsdp`` and ``megatron``).

The trainer (:mod:`sftprof.trainer`) only talks to an :class:`Engine`:

1. ``engine = build_engine(cfg, layout, hf_config, device)`` after the default process group
   is up (one process per rank, ``torchrun``). The engine builds its model (random init unless
   ``actor.init_from_scratch=false`` and the model directory holds weights), its optimizer and
   any parallel groups it needs.
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
- Annotations (:mod:`sftprof.profiling.regions`): the forward of micro-batch ``i`` runs inside
  ``region(forward(i))``, its backward inside ``region(backward(i))``, the optimizer step
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

import torch

from sftprof.data import MicroBatch


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step, the same on every rank.

    Attributes:
        loss: global token-mean of ``-logprob`` over the loss tokens of the step (nats).
        grad_norm: total L2 norm of the gradients before clipping (all parameters, all ranks).
        model_flops: model FLOPs of the step summed over all ranks (forward + backward, no
            recompute), or None when the backend cannot count them. The trainer divides by step
            time and world size for TFLOP/s per GPU and MFU.
    """

    loss: float
    grad_norm: float
    model_flops: Optional[float]


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


def build_engine(cfg, layout, hf_config, device: torch.device) -> Engine:
    """Build the engine of ``layout.backend`` (``fsdp`` or ``megatron``; megatron imported lazily).

    Args:
        cfg: the trial's :class:`sftprof.config.SFTProfileConfig`.
        layout: :class:`sftprof.allocation.Layout` parsed from ``actor.backend``.
        hf_config: the Hugging Face (text) config from :func:`sftprof.models.hf.load_hf_config`.
        device: this rank's device (``cuda:<local_rank>`` or ``cpu``).

    Raises:
        ValueError: unknown backend.
    """
    if layout.backend == "fsdp":
        from sftprof.engine.fsdp import FSDPEngine
        return FSDPEngine(cfg, layout, hf_config, device)
    if layout.backend == "megatron":
        from sftprof.engine.megatron import MegatronEngine
        return MegatronEngine(cfg, layout, hf_config, device)
    raise ValueError(f"actor.backend={cfg.actor.backend!r}: unknown backend {layout.backend!r}; accepted fsdp, megatron")


def qwen3_moe_model_flops(hf_config, seq_len: int, n_seqs: int) -> float:
    """Model FLOPs of forward + backward for ``n_seqs`` sequences of ``seq_len`` tokens.

    Counts 2 FLOPs per multiply-add of every matrix product (attention projections, causal
    attention scores and values, router, the ``num_experts_per_tok`` active experts' SwiGLU
    GEMMs, LM head) and 3x the forward for forward + backward; recompute is not counted (the
    usual MFU convention, as in the PaLM paper's appendix B and Megatron-LM's FLOPs estimate).
    Causal attention counts half of the full ``seq_len x seq_len`` score matrix.

    Args:
        hf_config: a ``qwen3_moe`` Hugging Face config (hidden_size, num_attention_heads,
            num_key_value_heads, head_dim, num_experts, num_experts_per_tok,
            moe_intermediate_size, num_hidden_layers, vocab_size; ``mlp_only_layers`` and
            ``decoder_sparse_step`` honoured, dense layers use ``intermediate_size``).
        seq_len: tokens per sequence.
        n_seqs: number of sequences.

    Returns:
        FLOPs (float).
    """
    c = hf_config
    h = c.hidden_size
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    attn_proj = 2 * h * (q + 2 * kv) + 2 * q * h                    # per token
    attn_core = 2 * 2 * q * seq_len / 2                              # QK^T and AV, causal half
    sparse_step = getattr(c, "decoder_sparse_step", 1) or 1
    mlp_only = set(getattr(c, "mlp_only_layers", []) or [])
    per_token = 0.0
    for layer in range(c.num_hidden_layers):
        per_token += attn_proj + attn_core
        sparse = c.num_experts > 0 and layer not in mlp_only and (layer + 1) % sparse_step == 0
        if sparse:
            per_token += 2 * h * c.num_experts + c.num_experts_per_tok * 2 * 3 * h * c.moe_intermediate_size
        else:
            per_token += 2 * 3 * h * c.intermediate_size
    per_token += 2 * h * c.vocab_size
    return 3.0 * per_token * seq_len * n_seqs
