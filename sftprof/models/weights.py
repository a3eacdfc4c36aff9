"""Which Hugging Face tensors a model reads from a checkpoint, and the check that a checkpoint holds exactly them.

The weight-mapping module of each model family (:data:`MAPPINGS`) holds its rules (megatron parameter -> Hugging
Face tensors) and, next to them, ``required_tensors(hf_config, names)``: every tensor those rules read for the
model of ``hf_config`` (cut to ``actor.num_layers``). The fsdp backend's Hugging Face model reads the same tensors
(transformers' names are the checkpoint's), so one check serves both backends: :func:`check_checkpoint`, before
launch (:func:`sftprof.models.hf.check_weights_present`) and again when the megatron backend loads.
"""
from __future__ import annotations

import re
from typing import Set

import torch

from sftprof.models import qwen3_5_moe_weights, qwen3_moe_weights
from sftprof.models.checkpoint import CheckpointError, SafetensorsCheckpoint, name_list

MAPPINGS = {"qwen3_moe": qwen3_moe_weights, "qwen3_5_moe": qwen3_5_moe_weights,
            "qwen3_5_moe_text": qwen3_5_moe_weights}

_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def mapping_for(hf_config):
    """The weight-mapping module of ``hf_config.model_type``.

    Raises:
        CheckpointError: no mapping for that model type (names the accepted ones).
    """
    module = MAPPINGS.get(hf_config.model_type)
    if module is None:
        raise CheckpointError(f"loading Hugging Face weights is implemented for {sorted(MAPPINGS)}, not model_type "
                              f"{hf_config.model_type!r}; set actor.init_from_scratch=true to profile it with random "
                              "weights")
    return module


def not_loaded(name: str, n_layers: int) -> bool:
    """Whether checkpoint tensor ``name`` lies outside the profiled model: a layer ``>= n_layers`` (cut by
    ``actor.num_layers``), or the vision tower or MTP block of a multimodal Qwen3.5 checkpoint
    (:data:`sftprof.models.qwen3_5_moe_weights.NOT_LOADED_PREFIXES`)."""
    m = _LAYER.match(name)
    return bool(m and int(m.group(1)) >= n_layers) or name.startswith(qwen3_5_moe_weights.NOT_LOADED_PREFIXES)


_TIED_BLOCK_ROWS = 4096  # vocabulary rows compared at a time (bounded memory for a large vocabulary)


def _tied_head_copy(ckpt: SafetensorsCheckpoint, needed: Set[str]) -> Set[str]:
    """``{lm_head name}`` when the model ties its output layer to the embedding (the tensors it reads hold an
    ``embed_tokens.weight`` and no ``lm_head.weight``) and the checkpoint holds, beside the embedding, an
    ``lm_head.weight`` equal to it (a redundant copy, as Qwen1.5-0.5B ships): left unread. Empty otherwise. Reads
    both tensors once (in row blocks); they are not counted as read.

    Raises:
        CheckpointError: the copy differs from the embedding (names both tensors and the first differing row).
    """
    embed = next((n for n in needed if n.endswith("embed_tokens.weight")), None)
    head = next((n for n in ckpt.names - needed if n.endswith("lm_head.weight")), None)
    if embed is None or head is None or any(n.endswith("lm_head.weight") for n in needed):
        return set()
    consumed, bytes_read = set(ckpt.consumed), ckpt.bytes_read
    try:
        if ckpt.shape(head) != ckpt.shape(embed):
            raise CheckpointError(f"{ckpt.listing}: {head} {ckpt.shape(head)} beside {embed} {ckpt.shape(embed)}, "
                                  "though the config ties them (tie_word_embeddings=true); accepted: no "
                                  "lm_head.weight, or one equal to the embedding")
        for lo in range(0, ckpt.shape(embed)[0], _TIED_BLOCK_ROWS):
            rows = slice(lo, lo + _TIED_BLOCK_ROWS)
            a, b = ckpt.read(head, rows), ckpt.read(embed, rows)
            if not torch.equal(a, b):
                first = lo + int((a != b).flatten(1).any(dim=1).nonzero()[0, 0])
                raise CheckpointError(f"{ckpt.listing}: {head} differs from {embed} (first in row {first}), though the "
                                      "config ties them (tie_word_embeddings=true); accepted: no lm_head.weight, or "
                                      "one equal to the embedding")
    finally:
        ckpt.consumed, ckpt.bytes_read = consumed, bytes_read
    return {head}


def check_checkpoint(ckpt: SafetensorsCheckpoint, hf_config) -> Set[str]:
    """Match the checkpoint whole against the model of ``hf_config`` (file headers only, but for a tied model's
    redundant ``lm_head.weight``, compared with its embedding).

    Every tensor the index names is in its shard and every shard tensor is in the index
    (:meth:`~sftprof.models.checkpoint.SafetensorsCheckpoint.check_shards`); every tensor the family's rules read for
    the model is in the checkpoint (``required_tensors`` of :func:`mapping_for`), and every checkpoint tensor is read
    by the model or lies outside it (:func:`not_loaded`), or is a tied model's ``lm_head.weight`` equal to its
    embedding (:func:`_tied_head_copy`: left unread).

    Args:
        ckpt: the checkpoint.
        hf_config: the (text) config, cut to ``actor.num_layers``.
    Returns:
        The checkpoint's tensors outside the profiled model (left unread).
    Raises:
        CheckpointError: the first of: a damaged shard or an index that does not match its shards (names each
            shard and tensor); tensors the model reads that the checkpoint lacks, or checkpoint tensors it does not
            read (names the listing file, the count and the tensors); a tied model's ``lm_head.weight`` that differs
            from its embedding.
    """
    ckpt.check_shards()
    needed = set(mapping_for(hf_config).required_tensors(hf_config, ckpt.names))
    outside = {n for n in ckpt.names if not_loaded(n, hf_config.num_hidden_layers)} | _tied_head_copy(ckpt, needed)
    model = f"the {hf_config.model_type} model of {hf_config.num_hidden_layers} layer(s)"
    problems = []
    if needed - ckpt.names:
        problems.append(f"{len(needed - ckpt.names)} tensor(s) that {model} reads are not in the checkpoint: "
                        f"{name_list(needed - ckpt.names)}")
    if ckpt.names - needed - outside:
        problems.append(f"{len(ckpt.names - needed - outside)} checkpoint tensor(s) are not read by {model}: "
                        f"{name_list(ckpt.names - needed - outside)}")
    if problems:
        raise CheckpointError(f"{ckpt.listing}: " + "; ".join(problems) + "; accepted: a checkpoint holding every "
                              "tensor of the model (actor.num_layers cuts its layers) and nothing else, or "
                              "actor.init_from_scratch=true (random weights)")
    return outside
