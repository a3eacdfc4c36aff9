"""Padded ``[batch, seq]`` (BSHD) inputs for models that do not take packed sequences.

The LM-head and log-prob paths (:mod:`sftprof.ops`) work on *packed* tokens: ``[T, ...]`` with the
tokens of sequence 0, then sequence 1, ..., ``T = sum(lengths)``. A model that runs on padded
``[B, L_max]`` inputs instead (Hugging Face's Qwen3.5 with its gated delta-net layers, for example)
gets its sequences right-padded with :func:`pad_sequences`; its outputs and the labels / loss weights
are brought back to the packed order with :func:`repack`, which drops the padding positions. So padding
never reaches the loss, and the chunked LM-head and log-prob functions see exactly the tokens, in the
order, that a packed run gives them.

Right padding keeps every real token at its unpadded position (RoPE positions ``0 .. len - 1``) and,
with causal attention and causal linear attention, out of reach of the padding that follows it.
"""
from __future__ import annotations

from typing import Sequence

import torch


def pad_sequences(seqs: Sequence[torch.Tensor], pad_value: int | float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D (or ``[len, ...]``) tensors into ``[B, L_max, ...]``.

    Args:
        seqs: ``B >= 1`` tensors of shapes ``[len_i, ...]`` (same trailing shape and dtype), ``len_i >= 1``.
        pad_value: value of the padding positions.
    Returns:
        ``(padded [B, L_max, ...], mask [B, L_max] bool)``; ``mask[i, j]`` is True iff ``j < len_i``.
    Raises:
        ValueError: no sequences, or an empty one.
    """
    if not seqs or any(s.shape[0] == 0 for s in seqs):
        raise ValueError(f"pad_sequences: needs >= 1 sequence, each >= 1 token; got lengths {[s.shape[0] for s in seqs]}")
    lengths = torch.tensor([s.shape[0] for s in seqs])
    padded = seqs[0].new_full((len(seqs), int(lengths.max())) + tuple(seqs[0].shape[1:]), pad_value)
    for i, s in enumerate(seqs):
        padded[i, :s.shape[0]] = s
    mask = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return padded, mask.to(padded.device)


def repack(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Packed token order of a padded tensor: ``[B, L, ...]`` -> ``[T, ...]`` (sequence 0's tokens first).

    Args:
        padded: model outputs, labels or loss weights ``[B, L, ...]``.
        mask: ``[B, L]`` bool, True at real tokens, each row a prefix (right padding, :func:`pad_sequences`).
    Returns:
        A new tensor ``[T, ...]``, ``T = mask.sum()``; differentiable in ``padded``.
    Raises:
        ValueError: shapes differ, or a row's real tokens do not form a prefix (left or inner padding).
    """
    if mask.shape != padded.shape[:2] or mask.dtype != torch.bool:
        raise ValueError(f"repack: mask must be bool {tuple(padded.shape[:2])}, got {mask.dtype} {tuple(mask.shape)}")
    lengths = mask.sum(1, keepdim=True)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) < lengths):
        raise ValueError("repack: each row of the mask must be a prefix of True (right padding)")
    return padded[mask]
