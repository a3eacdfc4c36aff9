"""Decoder layer specs for megatron-core ``GPTModel``: Transformer Engine when it imports, else local modules.

- TE present: megatron-core's ``get_gpt_layer_with_transformer_engine_spec`` (TE linear/norm/attention,
  TE grouped-GEMM experts); Qwen3.5 (gated delta-net) through megatron-core's experimental block spec.
- TE absent (the lent H200s): megatron-core's local linear layers plus this project's modules:
  :class:`sftprof.models.norm.RMSNorm` (sequence parallel, zero-centred gamma),
  :class:`sftprof.models.attention.SDPACoreAttention` (SDPA, GQA, context parallel) and
  :class:`sftprof.models.experts.GroupedGemmExperts` (``torch._grouped_mm``; ``SequentialMLP`` where
  grouped GEMM is not available). The final norm of the block is the same RMSNorm.
"""
from __future__ import annotations

import importlib.util
from typing import Any


def have_transformer_engine() -> bool:
    """True when ``transformer_engine.pytorch`` imports."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install behaves as no TE
        return False
    return True


def check_model_supported(config, have_te: bool) -> None:
    """Refuse model variants this environment cannot build, naming what is missing.

    Qwen3.5 (``experimental_attention_variant="gated_delta_net"``): megatron-core 0.16.1 builds its
    gated delta-net layers only with Transformer Engine specs (``experimental_attention_variant_module_
    specs._get_backend_spec_provider`` asserts ``transformer_impl == "transformer_engine"``) and runs them
    with flash-linear-attention (``fla``) kernels.

    Raises:
        NotImplementedError: gated delta-net without TE or without ``fla``.
    """
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
        missing = []
        if not have_te:
            missing.append("transformer_engine (megatron-core 0.16.1 builds gated delta-net layers only from TE specs)")
        if importlib.util.find_spec("fla") is None:
            missing.append("flash-linear-attention (package 'fla', gated delta-rule kernels)")
        if missing:
            raise NotImplementedError("qwen3_5_moe (gated delta-net linear attention) cannot be built with "
                                      "megatron-core 0.16.1 here; missing: " + "; ".join(missing))


def _moe_spec(config) -> Any:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from sftprof.models.experts import GroupedGemmExperts, grouped_mm_supported

    linear = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if grouped_mm_supported(config):
        experts = ModuleSpec(module=GroupedGemmExperts)
    else:
        experts = ModuleSpec(module=SequentialMLP, submodules=linear)
    shared = ModuleSpec(module=SharedExpertMLP, submodules=linear) if config.moe_shared_expert_intermediate_size else None
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared))


def local_layer_spec(config) -> Any:
    """Decoder layer ``ModuleSpec`` without Transformer Engine (see module docstring)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from sftprof.models.attention import SDPACoreAttention
    from sftprof.models.norm import RMSNorm

    qk_norm = RMSNorm if config.qk_layernorm else IdentityOp
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=SDPACoreAttention,
                                           linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm, mlp=_moe_spec(config), mlp_bda=get_bias_dropout_add),
    )


def decoder_block_spec(config, have_te: bool, vp_stage=None) -> Any:
    """The ``transformer_layer_spec`` argument of ``GPTModel`` for this rank's pipeline stage.

    Args:
        config: the megatron ``TransformerConfig`` (MoE, RMSNorm, qk-layernorm).
        have_te: :func:`have_transformer_engine`.
    Returns:
        A ``ModuleSpec`` (TE) or ``TransformerBlockSubmodules`` (local: layer specs for this stage's
        layers plus the final RMSNorm).
    Raises:
        NotImplementedError: see :func:`check_model_supported`.
    """
    check_model_supported(config, have_te)
    if have_te:
        if getattr(config, "experimental_attention_variant", None):
            from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
                get_transformer_block_with_experimental_attention_variant_spec,
            )
            return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=True, qk_layernorm=config.qk_layernorm)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from sftprof.models.norm import RMSNorm

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[local_layer_spec(config)] * n, layer_norm=RMSNorm)
