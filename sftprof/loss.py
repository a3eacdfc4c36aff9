"""The SFT token loss of both engines: ``sum(-logprob(label) * loss_weight)``, its path chosen once.

:class:`SFTLoss` is built once per engine from ``actor.loss`` (:class:`sftprof.config.LossSettings`)
and holds the resolved path; each engine calls it from the module that owns the LM-head weight,
:class:`LMHeadLoss` (the FSDP engine shards it so FSDP2 unshards the weight inside its forward; the megatron
engine registers it inside ``GPTModel``, where DDP's forward pre-hook waits for the weight's all-gather), or
megatron's own output layer on the logits paths. Paths:

- ``lm_head``: :func:`sftprof.ops.linear_sft_loss` on the final hidden states, ``lm_head_loss_chunk_size``
  tokens per chunk; the full ``[N, V]`` logits never exist and ``hidden`` is consumed (its storage
  takes ``d loss / d hidden``).
- ``logprobs``: full logits, then :func:`sftprof.ops.vocab_parallel_logprobs`, ``logprobs_chunk_size``
  tokens per chunk on CPU (0 = all at once; on CUDA always all at once); the backward writes the gradient over
  the logits.
- ``reference``: full logits, ``log_softmax`` in fp32 and a gather (:func:`reference_logprobs`): the
  textbook computation, one fp32 ``[N, V]`` copy and its gradient; the baseline of the GPU parity test
  and of ``bench/megatron_logits_memory.py``. TP = 1 only (it sees one vocabulary shard; the config's validation
  refuses it with TP > 1).

All paths return an fp32 scalar; the loss weights carry the mask and any normalisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sftprof.ops import linear_logprobs, linear_sft_loss, vocab_parallel_logprobs

__all__ = ["LMHeadLoss", "SFTLoss", "reference_logprobs"]


def reference_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N]`` log-probs of ``labels`` ``[N]`` (int64) under ``logits`` ``[N, V]`` (whole vocabulary):
    ``log_softmax(logits.float())`` then gather. Memory: an fp32 ``[N, V]`` copy (and its gradient)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class SFTLoss:
    """The loss path of a trial (module docstring) and its chunk sizes.

    Attributes:
        path: ``lm_head``, ``logprobs`` or ``reference``.
        logprobs_chunk_size: tokens per chunk of the ``logprobs`` path on CPU (0 = all at once; CUDA: all at once).
        lm_head_loss_chunk_size: tokens per chunk of the ``lm_head`` path (> 0 there, else 0).
        vocab_size: the model's full (padded) vocabulary, when known: the ops then check that the TP ranks'
            shards add up to it (:func:`sftprof.ops.guards.check_vocab_shards`; full-vocabulary logits on every
            rank would otherwise give log-probs ``ln tp`` too low without an error).
    """

    path: str
    logprobs_chunk_size: int
    lm_head_loss_chunk_size: int
    vocab_size: int | None = None

    @classmethod
    def from_config(cls, cfg, vocab_size: int | None = None) -> "SFTLoss":
        """The loss of ``cfg.actor.loss`` (``path: auto`` resolved; :meth:`sftprof.config.LossSettings.resolved_path`),
        checking shards against ``vocab_size`` (the full padded vocabulary) when given."""
        s = cfg.actor.loss
        return cls(s.resolved_path(), s.logprobs_chunk_size, s.lm_head_loss_chunk_size, vocab_size)

    @property
    def uses_logits(self) -> bool:
        """True when the model must produce full (vocab-parallel) logits: every path but ``lm_head``."""
        return self.path != "lm_head"

    def describe(self, cuda: bool = False) -> str:
        """One line for logs naming the driver variables of the chunk sizes it reports, e.g. ``lm_head
        (linear_sft_loss, chunks of LM_HEAD_LOSS_CHUNK_SIZE=2048 tokens)``; ``cuda``: the loss runs on CUDA, where
        :func:`sftprof.ops.vocab_parallel_logprobs` takes all tokens at once whatever its chunk size."""
        if self.path == "lm_head":
            return f"lm_head (linear_sft_loss, chunks of LM_HEAD_LOSS_CHUNK_SIZE={self.lm_head_loss_chunk_size} tokens)"
        if self.path == "logprobs":
            chunk = self.logprobs_chunk_size
            how = ("unchunked (LOGPROBS_CHUNK_SIZE=0)" if not chunk else
                   f"all tokens at once on CUDA (LOGPROBS_CHUNK_SIZE={chunk} applies on CPU)" if cuda else
                   f"chunks of LOGPROBS_CHUNK_SIZE={chunk} tokens")
            return f"logprobs (full logits, LM_HEAD_LOSS_CHUNK_SIZE=0; vocab_parallel_logprobs, {how})"
        return "reference (logits + fp32 log_softmax + gather)"

    def from_hidden(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    loss_weight: torch.Tensor, *, tp_group: dist.ProcessGroup | None = None,
                    sequence_parallel: bool = False) -> torch.Tensor:
        """fp32 scalar loss from the final hidden states and the LM-head weight (the LM head included).

        Args:
            hidden: ``[N (/tp under sequence parallelism), H]`` final (normed) hidden states, model dtype;
                fed to nothing else: the ``lm_head`` path writes ``d loss / d hidden`` over it.
            weight: ``[V/tp, H]`` LM-head weight (vocab-parallel rows; ``tp_group`` None: whole vocabulary).
            labels: ``[N]`` int64 next-token ids (all TP ranks' tokens under sequence parallelism).
            loss_weight: ``[N]`` fp32 (the 0/1 loss mask, or weights).
            tp_group: the tensor-parallel group the vocabulary is split over (None: unsplit).
            sequence_parallel: ``hidden`` holds this TP rank's share of the tokens (``lm_head`` path only).
        Raises:
            ValueError: ``sequence_parallel`` on a logits path, or see :meth:`from_logits` and
                :func:`sftprof.ops.linear_sft_loss`.
        """
        if self.path == "lm_head":
            return linear_sft_loss(hidden, weight, labels, loss_weight, tp_group=tp_group,
                                   chunk_size=self.lm_head_loss_chunk_size, sequence_parallel=sequence_parallel,
                                   grad_in_hidden=True, vocab_size=self.vocab_size)
        if sequence_parallel:
            raise ValueError(f"actor.loss.path={self.path}: from_hidden with sequence-parallel hidden states needs the "
                             "lm_head path; the logits paths take the output layer's logits (from_logits)")
        return self.from_logits(torch.nn.functional.linear(hidden, weight), labels, loss_weight, tp_group=tp_group)

    def token_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                       tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """fp32 ``[N]`` log-probs of ``labels`` from the final hidden states ``[N, H]`` and the LM-head weight
        ``[V/tp, H]`` by this path: ``lm_head`` -> :func:`sftprof.ops.linear_logprobs` (chunked, logits
        recomputed in the backward), ``logprobs`` -> full logits + :func:`sftprof.ops.vocab_parallel_logprobs`,
        ``reference`` -> :func:`reference_logprobs` (TP = 1)."""
        if self.path == "lm_head":
            return linear_logprobs(hidden, weight, labels, tp_group=tp_group, chunk_size=self.lm_head_loss_chunk_size,
                                   vocab_size=self.vocab_size).float()
        logits = torch.nn.functional.linear(hidden, weight)
        if self.path == "logprobs":
            return vocab_parallel_logprobs(logits, labels, tp_group=tp_group, chunk_size=self.logprobs_chunk_size,
                                           vocab_size=self.vocab_size).float()
        return reference_logprobs(logits, labels)

    def from_logits(self, logits: torch.Tensor, labels: torch.Tensor, loss_weight: torch.Tensor, *,
                    tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """fp32 scalar loss from logits (``logprobs`` and ``reference`` paths).

        Args:
            logits: ``[N, V/tp]`` (vocab-parallel shard of this TP rank; padded vocabulary columns already
                set to ``-inf``), any float dtype, last dim contiguous. The ``logprobs`` path overwrites it with
                its gradient in the backward.
            labels: ``[N]`` int64 global vocabulary ids.
            loss_weight: ``[N]`` float weights (0 masks a token).
            tp_group: the group the vocabulary is split over (None: unsplit).
        Raises:
            ValueError: the ``lm_head`` path (it never forms logits).
        """
        if self.path == "logprobs":
            logprobs = vocab_parallel_logprobs(logits, labels, tp_group=tp_group, chunk_size=self.logprobs_chunk_size,
                                               vocab_size=self.vocab_size)
        elif self.path == "reference":  # TP = 1: sftprof.config.validate refuses it with TP > 1
            logprobs = reference_logprobs(logits, labels)
        else:
            raise ValueError(f"actor.loss.path={self.path}: the chunked LM-head loss takes hidden states (from_hidden), "
                             "not logits")
        return -(logprobs * loss_weight.to(logprobs.dtype)).sum()


class LMHeadLoss(nn.Module):
    """The LM head and the token loss as one module that holds the head weight, for both engines.

    Where the loss runs is not free (docs/ARCHITECTURE.md, "The loss seam"): FSDP2 unshards a sharded module's
    parameters only inside that module's forward, and megatron-core's DDP with ``overlap_param_gather`` waits for a
    parameter's all-gather in a forward pre-hook of the module that holds it. The loss reads the weight without
    calling the output layer, so it runs in the forward of this module, which registers the same ``Parameter``:
    the FSDP engine shards it as the model's ``lm_head`` (so the parameter keeps the Hugging Face name
    ``lm_head.weight``); the megatron engine adds it to ``GPTModel`` sharing ``output_layer``'s weight (or the
    embedding's when tied).

    Args:
        weight: the LM-head weight ``[V/tp, H]`` (vocab-parallel rows; the whole vocabulary when ``tp_group`` is
            None).
        loss: the trial's loss (:class:`SFTLoss`).
        tp_group: the tensor-parallel group the vocabulary is split over (None: unsplit).
        sequence_parallel: the hidden states are this TP rank's share of the tokens (megatron, TP > 1).
    """

    def __init__(self, weight: nn.Parameter, loss: SFTLoss, tp_group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.loss, self.tp_group, self.sequence_parallel = loss, tp_group, sequence_parallel

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, loss_weight: torch.Tensor) -> torch.Tensor:
        """fp32 scalar ``sum(-logprob(labels) * loss_weight)`` (:meth:`SFTLoss.from_hidden`).

        Args:
            hidden: ``[..., H]`` final (normed) hidden states (``[T, H]``, or megatron's ``[s_local (/tp under
                SP), b, H]``), model dtype, fed only to the LM head: the ``lm_head`` path consumes it (afterwards
                it holds ``d loss / d hidden``).
            labels: ``[N]`` int64 next-token ids in ``hidden``'s token order (all TP ranks' tokens under SP).
            loss_weight: ``[N]`` fp32 (0/1 loss mask).
        """
        return self.loss.from_hidden(hidden.reshape(-1, hidden.shape[-1]), self.weight, labels, loss_weight,
                                     tp_group=self.tp_group, sequence_parallel=self.sequence_parallel)

    def logprobs(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N]`` log-probs of ``labels`` (``[N]`` int64) from ``hidden`` (``[..., H]``) by the trial's loss
        path (:meth:`SFTLoss.token_logprobs`). Call it where the weight is whole (FSDP2 unshards it only around
        ``forward``)."""
        return self.loss.token_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.weight, labels,
                                        tp_group=self.tp_group)
