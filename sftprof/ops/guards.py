"""Guards for tensors that an autograd function keeps from forward to backward and reuses in place.

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

__all__ = ["StaleBufferError", "SavedBuffer"]


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
