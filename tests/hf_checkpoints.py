"""Tiny Hugging Face checkpoints written by transformers' ``save_pretrained`` for loader and parity tests."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_QWEN3_MOE = dict(vocab_size=250, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, max_position_embeddings=512, router_aux_loss_coef=0.0,
                      tie_word_embeddings=False, rope_theta=10000.0)


def write_qwen3_moe(path: Path, seed: int = 0, dtype=torch.float32, max_shard_size: str = "100KB",
                    device: str = "cpu", **overrides) -> Path:
    """Write a random ``Qwen3MoeForCausalLM`` (``TINY_QWEN3_MOE`` with ``overrides``) as a sharded safetensors
    checkpoint in ``path`` and return ``path``. The same seed gives the same weights.

    ``router_aux_loss_coef`` is 0 by default: the reference (transformers) loss has no auxiliary term, so
    gradients compare one to one with the megatron model's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(dtype)
    # Random init leaves the RMSNorm weights at 1: perturb them so the mapping of every norm is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return path
