"""Load a Hugging Face safetensors checkpoint into this rank's megatron-core ``GPTModel``.

Each rank matches the checkpoint whole against the model first (:func:`sftprof.models.weights.check_checkpoint`,
headers only), builds its own parameters from the checkpoint slices it needs (memory-mapped reads, see
:mod:`sftprof.models.checkpoint`) with the mapping module of the model family (``qwen3_moe``:
:mod:`sftprof.models.qwen3_moe_weights`), then all ranks prove together that every checkpoint tensor
was loaded somewhere. Call it after ``GPTModel(...)`` and before megatron's ``DistributedDataParallel``
and optimizer are built: DDP copies the parameters into its buffers and the optimizer takes its fp32
main copies from them.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from sftprof.models import qwen3_moe_weights
from sftprof.models.checkpoint import CheckpointError, SafetensorsCheckpoint, check_all_consumed
from sftprof.models.weights import check_checkpoint, mapping_for

log = logging.getLogger(__name__)


def shard_context(gpt, hf_config) -> qwen3_moe_weights.ShardContext:
    """This rank's :class:`~sftprof.models.qwen3_moe_weights.ShardContext` from megatron's ``parallel_state``
    and the layers ``gpt`` holds (global layer index = ``layer_number - 1``)."""
    from megatron.core import parallel_state as ps

    heads = hf_config.num_attention_heads
    return qwen3_moe_weights.ShardContext(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        num_heads=heads, num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        num_experts=getattr(hf_config, "num_experts", None) or hf_config.num_local_experts,
        vocab_size=hf_config.vocab_size, tied=qwen3_moe_weights.tied_embeddings(hf_config),
        layer_numbers=tuple(layer.layer_number - 1 for layer in gpt.decoder.layers),
        **{k: getattr(hf_config, k, 0) or 0 for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                       "linear_key_head_dim", "linear_value_head_dim")})


def load_hf_checkpoint(gpt: torch.nn.Module, model_dir: str | Path, hf_config) -> dict:
    """Copy this rank's shard of every parameter of ``gpt`` from the checkpoint in ``model_dir``.

    Collective over the default process group (every rank must call it).

    Args:
        gpt: the unwrapped megatron-core ``GPTModel`` of this rank (parameters in any dtype; the
            checkpoint's values are cast to it).
        model_dir: Hugging Face model directory with safetensors weights.
        hf_config: its (text) config, cut to ``actor.num_layers`` if the model is cut (the checkpoint's
            other layers are then expected to stay unread), vision-tower and MTP tensors of a multimodal
            Qwen3.5 checkpoint (:func:`sftprof.models.weights.not_loaded`) are not part of the profiled text
            model: both are counted in the log, not loaded.
    Returns:
        ``{"tensors_read": int, "bytes_read": int}`` for this rank (bytes as stored in the checkpoint).
    Raises:
        CheckpointError: unknown model family, missing/damaged files, a checkpoint that does not match the model
            (:func:`sftprof.models.weights.check_checkpoint`), a parameter whose shape
            differs from the mapped checkpoint slice, or checkpoint tensors no rank loaded.
    """
    mapping = mapping_for(hf_config)
    ckpt = SafetensorsCheckpoint(model_dir)
    not_loaded = check_checkpoint(ckpt, hf_config)
    ctx = shard_context(gpt, hf_config)
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            value = mapping.local_tensor(name, ckpt, ctx)
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(f"{model_dir}: megatron parameter {name} has shape {tuple(param.shape)} on this "
                                      f"rank, the mapped checkpoint slice {tuple(value.shape)}")
            param.copy_(value)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(ckpt.consumed))
    check_all_consumed(ckpt.names - not_loaded, gathered, str(model_dir))
    log.info("megatron: loaded %d checkpoint tensors (%.3f GB read on this rank) from %s; %d tensors not part of the "
             "profiled model (layers beyond actor.num_layers, vision tower, MTP) left unread", len(ckpt.consumed),
             ckpt.bytes_read / 1e9, model_dir, len(not_loaded))
    return {"tensors_read": len(ckpt.consumed), "bytes_read": ckpt.bytes_read, "not_loaded": len(not_loaded)}
