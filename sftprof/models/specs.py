"""Decoder layer specs for megatron-core ``GPTModel``: Transformer Engine when it imports, else local modules.

- TE present: megatron-core's ``get_gpt_layer_with_transformer_engine_spec`` (TE linear/norm/attention,
  TE grouped-GEMM experts); Qwen3.5 (gated delta-net) through megatron-core's experimental block spec.
- TE absent (the lent H200s): megatron-core's local linear layers plus this project's modules:
  :class:`sftprof.models.layers.norm.RMSNorm` (sequence parallel, zero-centred gamma),
  :class:`sftprof.models.layers.attention.SDPACoreAttention` (SDPA, GQA, context parallel) and
  :class:`sftprof.models.layers.experts.GroupedGemmExperts` (``torch._grouped_mm``; ``SequentialMLP`` where
  grouped GEMM is not available); a shared expert (``SharedExpertMLP``, its sigmoid gate when
  ``moe_shared_expert_gate``) when the config has one; the MoE layer is
  :class:`sftprof.models.layers.moe_dedup.DedupAlltoAllMoELayer` (one all-to-all row per token and destination EP
  rank) where it applies (EP > 1, expert TP 1, dropless alltoall) and ``actor.megatron.moe_dedup_alltoall`` is
  on; else :class:`sftprof.models.layers.moe_permute.SortedPermuteMoELayer` (sync-free, atomic-free token permutation
  of the alltoall dispatcher) where it applies and ``actor.megatron.moe_sorted_permute`` is on; else
  megatron-core's ``MoELayer``. The final norm of the block is the same RMSNorm.
- Qwen3.5 without TE: the layer pattern of megatron-core's ``get_linear_attention_pattern``; gated
  delta-net layers are megatron-core's ``GatedDeltaNet`` (flash-linear-attention kernels) with local
  column/row-parallel linears and :class:`RMSNorm` as its per-head output norm; the full-attention layers
  are the self-attention above with ``attention_output_gate`` (megatron-core's sigmoid output gate) and
  partial RoPE (``GPTModel(rotary_percent=...)``). Sequence parallelism works as for the other layers:
  ``in_proj`` all-gathers the sequence, ``out_proj`` reduce-scatters it.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

from sftprof.compat import gated_delta_net_kernels, narrow_fla_hopper_guard
from sftprof.models.checks import FLA_PACKAGES
from sftprof.models.layers.attention import SDPACoreAttention
from sftprof.models.layers.experts import GroupedGemmExperts, grouped_mm_supported
from sftprof.models.layers.norm import RMSNorm

log = logging.getLogger(__name__)


def have_transformer_engine() -> bool:
    """True when ``transformer_engine.pytorch`` imports."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install behaves as no TE
        return False
    return True


def check_model_supported(config) -> None:
    """Last guard before a gated delta-net model is built (after
    :func:`sftprof.models.checks.check_linear_attention_layout`; CP > 1 before megatron-core 0.18 is also refused
    by its ``TransformerConfig`` validation).

    Raises:
        NotImplementedError: ``experimental_attention_variant="gated_delta_net"`` and megatron-core's
            ``gated_delta_net`` module could not import ``fla``'s kernels.
        ConfigError: fla's Hopper/Triton guard applies at this model's key block width
            (:func:`sftprof.compat.narrow_fla_hopper_guard`, which lifts it otherwise and logs so).
    """
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
        return
    if not gated_delta_net_kernels().HAVE_FLA:
        raise NotImplementedError(f"gated delta-net layers need flash-linear-attention kernels: install {FLA_PACKAGES}")
    note = narrow_fla_hopper_guard(config.linear_key_head_dim)
    if note:
        log.warning(note)


def _moe_spec(config, sorted_permute: bool = True, dedup_alltoall: bool = True, alltoall_chunks: int = 1) -> Any:
    """The MoE layer's ``ModuleSpec`` (module docstring); ``sorted_permute``: ``actor.megatron.moe_sorted_permute``,
    ``dedup_alltoall``: ``actor.megatron.moe_dedup_alltoall``, ``alltoall_chunks``:
    ``actor.megatron.moe_alltoall_chunks`` (for the dedup layer)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    # imported here: both import megatron-core at module level
    from sftprof.models.layers.moe_dedup import DedupAlltoAllMoELayer, dedup_alltoall_applies
    from sftprof.models.layers.moe_permute import SortedPermuteMoELayer, sorted_permute_applies

    linear = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if grouped_mm_supported(config):
        experts = ModuleSpec(module=GroupedGemmExperts)
    else:
        experts = ModuleSpec(module=SequentialMLP, submodules=linear)
    shared = ModuleSpec(module=SharedExpertMLP, submodules=linear) if config.moe_shared_expert_intermediate_size else None
    params = {}
    if dedup_alltoall and dedup_alltoall_applies(config):
        layer, params = DedupAlltoAllMoELayer, {"alltoall_chunks": alltoall_chunks}
    elif sorted_permute and sorted_permute_applies(config):
        layer = SortedPermuteMoELayer
    else:
        layer = MoELayer
    return ModuleSpec(module=layer, params=params, submodules=MoESubmodules(experts=experts, shared_experts=shared))


def _gated_delta_net_spec() -> Any:
    """megatron-core's ``GatedDeltaNet`` with local linears: ``in_proj`` (column parallel, gathers the sequence
    under sequence parallelism), ``out_norm`` (:class:`RMSNorm` over each value head), ``out_proj`` (row parallel)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear))


def local_layer_spec(config, linear_attention: bool = False, cp_attention: str = "blocks",
                     moe_sorted_permute: bool = True, moe_dedup_alltoall: bool = True,
                     attention_forward_chunks: int = 1, cp_comm_overlap: bool = True, moe_alltoall_chunks: int = 1) -> Any:
    """Decoder layer ``ModuleSpec`` without Transformer Engine (see module docstring).

    Args:
        config: the megatron ``TransformerConfig``.
        linear_attention: a gated delta-net layer (:func:`_gated_delta_net_spec`) instead of self-attention
            (SDPA core attention; ``config.attention_output_gate`` adds the sigmoid output gate).
        cp_attention: ``actor.megatron.cp_attention``, passed to :class:`SDPACoreAttention` (used with CP > 1).
        moe_sorted_permute: ``actor.megatron.moe_sorted_permute`` (see the module docstring).
        moe_dedup_alltoall: ``actor.megatron.moe_dedup_alltoall`` (see the module docstring).
        attention_forward_chunks: ``actor.megatron.attention_forward_chunks``, passed to :class:`SDPACoreAttention`
            (used with CP = 1).
        cp_comm_overlap: ``actor.megatron.cp_comm_overlap``, passed to :class:`SDPACoreAttention` (used with CP > 1
            and ``blocks``).
        moe_alltoall_chunks: ``actor.megatron.moe_alltoall_chunks``, passed to the dedup MoE layer.
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    if linear_attention:
        attention = _gated_delta_net_spec()
    else:
        qk_norm = RMSNorm if config.qk_layernorm else IdentityOp
        attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            # megatron-core calls core_attention as a builder (keyword arguments), so a partial carries the setting
            submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                               core_attention=functools.partial(
                                                   SDPACoreAttention, cp_attention=cp_attention,
                                                   forward_chunks=attention_forward_chunks,
                                                   cp_comm_overlap=cp_comm_overlap),
                                               linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm),
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm, mlp=_moe_spec(config, moe_sorted_permute, moe_dedup_alltoall, moe_alltoall_chunks),
            mlp_bda=get_bias_dropout_add),
    )


def decoder_block_spec(config, have_te: bool, vp_stage=None, cp_attention: str = "blocks",
                       moe_sorted_permute: bool = True, moe_dedup_alltoall: bool = True,
                       attention_forward_chunks: int = 1, cp_comm_overlap: bool = True,
                       moe_alltoall_chunks: int = 1) -> Any:
    """The ``transformer_layer_spec`` argument of ``GPTModel`` for this rank's pipeline stage.

    Without TE, a gated delta-net model (Qwen3.5) gets per-layer specs from megatron-core's
    ``get_linear_attention_pattern`` (``linear_attention_freq=4``: layers 1-3 of every 4 are gated
    delta-net, the 4th full attention), cut to this stage's layers.

    Args:
        config: the megatron ``TransformerConfig`` (MoE, RMSNorm, qk-layernorm).
        have_te: :func:`have_transformer_engine`.
        cp_attention: ``actor.megatron.cp_attention`` for the local spec's attention (TE has its own CP).
        moe_sorted_permute: ``actor.megatron.moe_sorted_permute`` for the local spec's MoE layers (with TE,
            megatron-core's ``moe_permute_fusion`` is the fused permutation).
        moe_dedup_alltoall: ``actor.megatron.moe_dedup_alltoall`` for the local spec's MoE layers (not with TE).
        attention_forward_chunks: ``actor.megatron.attention_forward_chunks`` for the local spec's attention.
        cp_comm_overlap: ``actor.megatron.cp_comm_overlap`` for the local spec's attention.
        moe_alltoall_chunks: ``actor.megatron.moe_alltoall_chunks`` for the local spec's dedup MoE layers.
    Returns:
        A ``ModuleSpec`` (TE, Qwen3-MoE) or ``TransformerBlockSubmodules`` (TE gated delta-net, or local:
        layer specs for this stage's layers plus the final RMSNorm).
    Raises:
        NotImplementedError: see :func:`check_model_supported`.
    """
    check_model_supported(config)
    variant = getattr(config, "experimental_attention_variant", None)
    if have_te:
        if variant:
            from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
                get_transformer_block_with_experimental_attention_variant_spec,
            )
            return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=True, qk_layernorm=config.qk_layernorm)
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = get_linear_attention_pattern(config) if variant == "gated_delta_net" else [0] * config.num_layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    specs = {flag: local_layer_spec(config, linear_attention=bool(flag), cp_attention=cp_attention,
                                    moe_sorted_permute=moe_sorted_permute, moe_dedup_alltoall=moe_dedup_alltoall,
                                    attention_forward_chunks=attention_forward_chunks,
                                    cp_comm_overlap=cp_comm_overlap, moe_alltoall_chunks=moe_alltoall_chunks)
             for flag in set(pattern[offset:offset + n])}
    return TransformerBlockSubmodules(layer_specs=[specs[flag] for flag in pattern[offset:offset + n]], layer_norm=RMSNorm)
