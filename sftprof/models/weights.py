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


def check_checkpoint(ckpt: SafetensorsCheckpoint, hf_config) -> Set[str]:
    """Match the checkpoint whole against the model of ``hf_config`` (only file headers are read).

    Every tensor the index names is in its shard and every shard tensor is in the index
    (:meth:`~sftprof.models.checkpoint.SafetensorsCheckpoint.check_shards`); every tensor the family's rules read for
    the model is in the checkpoint (``required_tensors`` of :func:`mapping_for`), and every checkpoint tensor is read
    by the model or lies outside it (:func:`not_loaded`).

    Args:
        ckpt: the checkpoint.
        hf_config: the (text) config, cut to ``actor.num_layers``.
    Returns:
        The checkpoint's tensors outside the profiled model (left unread).
    Raises:
        CheckpointError: the first of: a damaged shard or an index that does not match its shards (names each
            shard and tensor); tensors the model reads that the checkpoint lacks, or checkpoint tensors it does not
            read (names the listing file, the count and the tensors).
    """
    ckpt.check_shards()
    needed = set(mapping_for(hf_config).required_tensors(hf_config, ckpt.names))
    outside = {n for n in ckpt.names if not_loaded(n, hf_config.num_hidden_layers)}
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
