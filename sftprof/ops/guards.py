"""Guards of the ops' inputs: vocabulary shards consistent with the TP group, and tensors that an
autograd function keeps from forward to backward and reuses in place.

Vocabulary shards: rank ``r`` of the TP group must hold vocabulary ids ``[r * V_local, (r + 1) * V_local)``
with the same ``V_local`` on every rank. Shards of unequal width, or a full-vocabulary tensor passed on
every rank (each rank then adds the whole vocabulary's probability mass, so log-probs come out exactly
``ln tp`` too low), give wrong numbers without any error downstream; :func:`check_vocab_shards` catches
both with one all-gather of one integer per rank.

Saved tensors:

The ops in this package keep references to inputs (logits, hidden states, LM-head weight) and,
in :func:`sftprof.ops.vocab_parallel_logprobs`, overwrite the stored logits with their gradient.
That is only correct if the tensor still holds the values seen in forward. Two ways it can go
wrong are detected:

- the tensor was modified in place after the forward (its autograd version counter moved);
- the tensor's data was swapped (``t.data = ...``, ``t.set_(...)``) or its storage freed/resized, so
  it no longer lives in the storage that was saved. This is checked through a weak reference to the
  storage object (plus its size), not by comparing raw addresses: the caching allocator hands the
  same address to new tensors, so an address compare can pass on a different buffer.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

__all__ = ["StaleBufferError", "SavedBuffer", "check_vocab_shards"]


def check_vocab_shards(width: int, tp_group: dist.ProcessGroup | None, device: torch.device, what: str,
                       vocab_size: int | None = None) -> None:
    """Check that this rank's vocabulary shard is consistent with the rest of the TP group.

    All-gathers the shard width (one int64 per rank, on ``device``: CUDA for NCCL, CPU for gloo) once per
    call, so every rank sees the same widths and raises the same error (no rank is left waiting in a later
    collective).

    Args:
        width: this rank's vocabulary shard width ``V_local`` (logits' last dim or LM-head weight's rows).
        tp_group: the tensor-parallel group (``None``: no split; only ``vocab_size`` is checked).
        device: device of the op's tensors.
        what: name of the tensor in messages (e.g. ``"logits"``).
        vocab_size: the full (padded) vocabulary size, when known: the widths must sum to it.

    Raises:
        ValueError: widths differ across the group (``"logits: the TP group's vocabulary shards have widths
            [5, 6] (ranks 0..1); every rank must hold V/tp columns"``), or they do not sum to ``vocab_size``.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        widths = [width]
    else:
        mine = torch.tensor([width], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(gathered, mine, group=tp_group)
        widths = [int(t.item()) for t in gathered]
    if len(set(widths)) > 1:
        raise ValueError(f"{what}: the TP group's vocabulary shards have widths {widths} (ranks 0..{len(widths) - 1}); "
                         "every rank must hold V/tp columns")
    if vocab_size is not None and sum(widths) != vocab_size:
        raise ValueError(f"{what}: the TP group's vocabulary shards have widths {widths}, summing to {sum(widths)}, "
                         f"not vocab_size={vocab_size}; pass each rank its own V/tp shard "
                         "(full-vocabulary tensors on every rank make every log-prob ln(tp) too low)")


class StaleBufferError(RuntimeError):
    """A tensor saved for backward was modified or replaced between forward and backward."""


class SavedBuffer:
    """A strong reference to ``tensor`` plus what identifies the data it held at save time.

    Args:
        tensor: the tensor to keep (any dtype/device).
        name: human-readable name used in error messages (e.g. ``"logits"``).
    """

    __slots__ = ("_tensor", "_name", "_version", "_storage_ref", "_nbytes")

    def __init__(self, tensor: torch.Tensor, name: str):
        self._tensor = tensor
        self._name = name
        self._version = tensor._version
        storage = tensor.untyped_storage()
        self._storage_ref = weakref.ref(storage)
        self._nbytes = storage.nbytes()

    def get(self) -> torch.Tensor:
        """Return the saved tensor after checking it is unchanged.

        Raises:
            StaleBufferError: if the version counter moved or the storage is not the saved one.
        """
        t = self._tensor
        if t is None:
            raise StaleBufferError(f"saved '{self._name}' was already released (backward called twice?)")
        if t._version != self._version:
            raise StaleBufferError(
                f"'{self._name}' was modified in place after the forward (autograd version {self._version} -> "
                f"{t._version}); its saved values are needed for the backward. Clone it before modifying it.")
        storage = t.untyped_storage()
        if self._storage_ref() is not storage or storage.nbytes() != self._nbytes:
            raise StaleBufferError(
                f"'{self._name}' no longer lives in the storage saved by the forward (data swapped via .data/"
                f".set_() or storage freed/resized); refusing to compute gradients from a different buffer.")
        return t

    def release(self) -> None:
        """Drop the strong reference (call once the backward no longer needs the tensor)."""
        self._tensor = None
