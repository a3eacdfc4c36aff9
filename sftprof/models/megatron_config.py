"""Hugging Face config + trial settings -> megatron-core ``TransformerConfig``, ``GPTModel`` and parallel arguments.

Field mapping (as Megatron-Bridge and mbridge map Qwen3-MoE; see ``shared/MODEL_FACTS.md``):

=============================  =======================================================
HF ``qwen3_moe``               megatron-core
=============================  =======================================================
num_hidden_layers              num_layers
hidden_size                    hidden_size
intermediate_size              ffn_hidden_size
num_attention_heads            num_attention_heads
num_key_value_heads            num_query_groups
head_dim                       kv_channels
moe_intermediate_size          moe_ffn_hidden_size
num_experts / num_local_experts num_moe_experts
num_experts_per_tok            moe_router_topk
norm_topk_prob=true            moe_router_score_function="softmax", moe_router_pre_softmax=False
                               (top-k of the logits, then softmax over those k = softmax over all
                               experts then top-k renormalised to sum 1; ``norm_topk_prob=false``
                               maps to pre_softmax=True: softmax over all experts, no renormalisation)
router_aux_loss_coef           moe_aux_loss_coeff (moe_router_load_balancing_type="aux_loss")
rms_norm_eps                   layernorm_epsilon (normalization="RMSNorm")
(Qwen3 q_norm / k_norm)        qk_layernorm=True
attention_bias                 add_qkv_bias; add_bias_linear=False
hidden_act="silu"              gated_linear_unit=True, activation_func=F.silu (SwiGLU)
rope_theta                     GPTModel(rotary_base=...), position_embedding_type="rope"
max_position_embeddings        GPTModel(max_sequence_length=...)
tie_word_embeddings            GPTModel(share_embeddings_and_output_weights=...)
initializer_range              init_method_std
=============================  =======================================================

``qwen3_5_moe`` (Qwen3.5 text part) adds: full_attention_interval -> linear_attention_freq,
``linear_*`` head settings, experimental_attention_variant="gated_delta_net",
shared_expert_intermediate_size -> moe_shared_expert_intermediate_size (+ moe_shared_expert_gate),
attn_output_gate -> attention_output_gate, layernorm_zero_centered_gamma=True and
partial_rotary_factor -> rotary_percent. Its text-only positions make the interleaved M-RoPE equal to
plain RoPE on the rotary dims. Multi-token prediction layers (``mtp_num_hidden_layers``) are not
built or trained (SFT profile; ``mtp_num_layers`` stays unset and the log says so). Building such a
model needs the gated delta-net kernels of flash-linear-attention and CP = 1; see
:func:`sftprof.models.checks.check_linear_attention_layout`.

Nothing here constructs CUDA state, so the mapping is testable on CPU. ``megatron.core`` is imported
inside the functions that need it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sftprof.allocation import Layout
from sftprof.config import PRECISION_FIELDS, ConfigError, MegatronSettings, SFTProfileConfig
from sftprof.models.hf import MODEL_TYPES, hf_value
from sftprof.models.layers.rope import install_in_megatron
from sftprof.models.layers.router import install_in_megatron as install_router
from sftprof.models.qwen3_moe_weights import padded_vocab_size

SUPPORTED_MODEL_TYPES = MODEL_TYPES
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}
_ROUTER_DTYPES = {"fp32": "fp32", "fp64": "fp64", "none": None}

log = logging.getLogger(__name__)


def rope_theta(hf: Any) -> float:
    """RoPE base of an HF config: ``rope_theta`` or ``rope_parameters["rope_theta"]`` (transformers 5.x).

    Raises:
        ValueError: neither is present.
    """
    value = getattr(hf, "rope_theta", None)
    params = getattr(hf, "rope_parameters", None) or {}
    if value is None and isinstance(params, dict):
        value = params.get("rope_theta")
    if value is None:
        raise ValueError(f"HF config of model_type {hf.model_type!r} has neither rope_theta nor rope_parameters.rope_theta")
    return float(value)


def _partial_rotary_factor(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    value = getattr(hf, "partial_rotary_factor", None)
    if value is None and isinstance(params, dict):
        value = params.get("partial_rotary_factor")
    return float(value) if value is not None else 1.0


def _check_hf(hf: Any) -> None:
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"HF model_type {hf.model_type!r} is not supported by the megatron backend; "
                         f"accepted: {list(SUPPORTED_MODEL_TYPES)}")
    if hf_value(hf, "hidden_act", default="silu") != "silu":
        raise ValueError(f"HF hidden_act={hf.hidden_act!r}: the megatron mapping supports 'silu' (SwiGLU) only")
    if getattr(hf, "mlp_only_layers", None) or hf_value(hf, "decoder_sparse_step", default=1) != 1:
        raise ValueError("HF mlp_only_layers / decoder_sparse_step != 1 (dense layers between MoE layers) "
                         "are not supported by the megatron mapping; every layer must be an MoE layer")


def hf_to_transformer_kwargs(hf: Any) -> dict:
    """Model-shape ``TransformerConfig`` keyword arguments of an HF ``qwen3_moe`` / ``qwen3_5_moe`` config.

    Args:
        hf: a (text) ``PretrainedConfig`` from :func:`sftprof.models.hf.load_hf_config`.
    Returns:
        dict of ``TransformerConfig`` field -> value (see the module docstring for the table).
    Raises:
        ValueError: unsupported ``model_type``, activation or dense/MoE layer pattern.
    """
    import torch.nn.functional as F

    _check_hf(hf)
    heads = hf.num_attention_heads
    norm_topk = bool(hf_value(hf, "norm_topk_prob", default=True))
    kw = dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf_value(hf, "intermediate_size", "moe_intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=hf_value(hf, "num_key_value_heads", default=heads),
        kv_channels=hf_value(hf, "head_dim", default=hf.hidden_size // heads),
        num_moe_experts=hf_value(hf, "num_experts", "num_local_experts"),
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not norm_topk,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf_value(hf, "router_aux_loss_coef", default=0.0)),
        layernorm_epsilon=float(hf.rms_norm_eps),
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf_value(hf, "attention_bias", default=False)),
        attention_dropout=float(hf_value(hf, "attention_dropout", default=0.0)),
        hidden_dropout=0.0,
        init_method_std=float(hf_value(hf, "initializer_range", default=0.02)),
    )
    if hf.model_type.startswith("qwen3_5_moe"):
        kw.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=hf_value(hf, "full_attention_interval", default=4),
            linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
            linear_key_head_dim=hf.linear_key_head_dim,
            linear_value_head_dim=hf.linear_value_head_dim,
            linear_num_key_heads=hf.linear_num_key_heads,
            linear_num_value_heads=hf.linear_num_value_heads,
            moe_shared_expert_intermediate_size=hf_value(hf, "shared_expert_intermediate_size"),
            moe_shared_expert_gate=hf_value(hf, "shared_expert_intermediate_size") is not None,
            attention_output_gate=bool(hf_value(hf, "attn_output_gate", default=True)),
            layernorm_zero_centered_gamma=True,
        )
    if hf_value(hf, "mtp_num_hidden_layers", default=0):
        log.info("megatron mapping: the model's multi-token-prediction block (%d layer(s)) is not built or trained",
                 hf.mtp_num_hidden_layers)
    return kw


def gpt_model_kwargs(hf: Any, tp_size: int = 1) -> dict:
    """``GPTModel`` keyword arguments besides config and layer spec.

    Args:
        hf: the (text) HF config.
        tp_size: tensor-parallel size; the vocabulary is padded to a multiple of it
            (:func:`sftprof.models.qwen3_moe_weights.padded_vocab_size`; the engine masks the padding's logits).
    Returns:
        ``vocab_size`` (padded), ``max_sequence_length``, ``position_embedding_type="rope"``, ``rotary_base``
        (float RoPE theta), ``rotary_percent``, ``share_embeddings_and_output_weights``,
        ``parallel_output=True`` (vocab-parallel logits: the loss runs on each rank's vocabulary shard).
    """
    return dict(
        vocab_size=padded_vocab_size(hf.vocab_size, tp_size),
        max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
        rotary_percent=_partial_rotary_factor(hf),
        share_embeddings_and_output_weights=bool(hf_value(hf, "tie_word_embeddings", default=False)),
        parallel_output=True,
    )


def _parallel_sizes(layout: Layout) -> dict:
    return dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.etp)


def parallel_state_kwargs(layout: Layout) -> dict:
    """``megatron.core.parallel_state.initialize_model_parallel`` arguments of a megatron layout.

    ``order="tp-cp-ep-dp-pp"`` is megatron-core's default and the order :meth:`Layout.rank_coords` uses.

    Raises:
        ConfigError: the layout is not a megatron layout.
    """
    if layout.backend != "megatron":
        raise ConfigError(f"actor.backend: layout backend {layout.backend!r} is not 'megatron'")
    return dict(_parallel_sizes(layout), order="tp-cp-ep-dp-pp")


def parallel_config_kwargs(layout: Layout) -> dict:
    """Parallel ``TransformerConfig`` fields: sizes, sequence parallel when TP > 1 (MoE needs it)."""
    return dict(_parallel_sizes(layout), sequence_parallel=layout.tp > 1)


def training_config_kwargs(cfg: SFTProfileConfig, have_te: bool) -> dict:
    """Precision, recompute, routing and fusion ``TransformerConfig`` fields from the trial settings.

    - ``actor.dtype`` -> ``bf16``/``fp16``/``params_dtype``/``pipeline_dtype``;
    - ``actor.megatron.recompute_*`` (``none`` -> no recompute; ``method``/``num_layers`` only for ``full``,
      ``recompute_modules`` only for ``selective``);
      recompute is on only when ``actor.gradient_checkpointing`` is true;
    - ``use_deterministic_algorithms`` -> ``deterministic_mode``;
    - ``moe_router_dtype`` (``none`` -> router in the model dtype), ``moe_token_dispatcher_type``,
      ``moe_router_bias_update_rate``, ``moe_router_force_load_balancing``;
    - ``calculate_per_token_loss=True``: the loss function returns the local loss sum and its token
      count and Megatron divides the DP x CP-summed gradients by the global token count;
    - fusions that need Transformer Engine or Apex (gradient-accumulation fusion, permute fusion, grouped GEMM
      of TE) are on only when ``have_te``, and so is megatron-core's fused (probability-weighted) SwiGLU,
      ``bias_activation_fusion``, on by default in Megatron-LM: TE's grouped MLP runs SwiGLU and the router-probability
      multiply unfused without it (without TE the local experts fuse them in sftprof's Triton kernel);
      RoPE fusion is always on: TE's kernel, or without TE
      :func:`sftprof.models.layers.rope.fused_apply_rotary_pos_emb`, bound into megatron-core here
      (:func:`sftprof.models.layers.rope.install_in_megatron`);
    - ``moe_fused_router``: without TE, the MoE router's Triton top-k bound into megatron-core here, or megatron's
      unfused functions bound back (:func:`sftprof.models.layers.router.install_in_megatron`; no ``TransformerConfig``
      field: with TE megatron-core's own ``moe_router_fusion`` is left off as before).
    """
    a, m = cfg.actor, cfg.actor.megatron
    dtype = _DTYPES[a.dtype]
    install_router(enable=m.moe_fused_router and not have_te)
    kw = dict(
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        deterministic_mode=bool(m.use_deterministic_algorithms),
        moe_router_dtype=_ROUTER_DTYPES[m.moe_router_dtype],
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_router_bias_update_rate=float(m.moe_router_bias_update_rate),
        # a simulated rank routes at random: its peers' token counts are its own (fake process group), balanced
        moe_router_force_load_balancing=bool(m.moe_router_force_load_balancing) or cfg.actor.simulate.rank >= 0,
        calculate_per_token_loss=True,
        gradient_accumulation_fusion=have_te,
        apply_rope_fusion=have_te or install_in_megatron(),
        moe_permute_fusion=have_te,
        moe_grouped_gemm=have_te,
        masked_softmax_fusion=False,
        bias_activation_fusion=have_te,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
    )
    if a.gradient_checkpointing and m.recompute_granularity != "none":
        kw["recompute_granularity"] = m.recompute_granularity
        if m.recompute_granularity == "full":
            kw["recompute_method"] = m.recompute_method
            kw["recompute_num_layers"] = m.recompute_num_layers
        else:
            kw["recompute_modules"] = list(m.recompute_modules)
    return kw


def build_transformer_config(hf: Any, cfg: SFTProfileConfig, layout: Layout, have_te: bool):
    """The megatron-core ``TransformerConfig`` of this trial (model shape + parallel + training fields).

    Raises:
        ValueError: unsupported HF config (:func:`hf_to_transformer_kwargs`).
        ConfigError: a non-megatron layout.
        AssertionError/ValueError from megatron-core's own validation (e.g. heads not divisible by TP).
    """
    from megatron.core.transformer import TransformerConfig

    if layout.backend != "megatron":
        raise ConfigError(f"actor.backend: layout backend {layout.backend!r} is not 'megatron'")
    kw = hf_to_transformer_kwargs(hf)
    kw.update(parallel_config_kwargs(layout))
    kw.update(training_config_kwargs(cfg, have_te))
    return TransformerConfig(**kw)


@dataclass(frozen=True)
class OptimizerPrecision:
    """Precision fields for megatron-core's ``OptimizerConfig`` (torch dtypes)."""

    use_precision_aware_optimizer: bool
    main_grads_dtype: torch.dtype
    main_params_dtype: torch.dtype
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype


def optimizer_precision(m: MegatronSettings, have_te: bool) -> OptimizerPrecision:
    """Validate and translate ``actor.megatron`` precision settings before Megatron validates its config.

    Megatron's precision-aware optimizer keeps main params/grads and Adam moments in the given dtypes
    inside Transformer Engine's ``FusedAdam``. Without TE megatron-core silently falls back to torch
    Adam, so this refuses the combination instead.

    Raises:
        ConfigError: ``use_precision_aware_optimizer=true`` without ``transformer_engine`` (message names
            ``USE_PRECISION_AWARE_OPTIMIZER`` and the settings to use instead); a non-fp32 dtype without
            the precision-aware optimizer; precision-aware without the distributed optimizer
            (:meth:`sftprof.config.MegatronSettings.check_optimizer_precision`).
    """
    if m.use_precision_aware_optimizer and not have_te:
        raise ConfigError(
            "actor.megatron.use_precision_aware_optimizer=True (USE_PRECISION_AWARE_OPTIMIZER=true): needs "
            "Transformer Engine's FusedAdam, but transformer_engine does not import here. Set "
            "USE_PRECISION_AWARE_OPTIMIZER=false MAIN_GRADS_DTYPE=float32 (actor.megatron."
            "use_precision_aware_optimizer=false actor.megatron.main_grads_dtype=float32) or install transformer-engine")
    m.check_optimizer_precision()  # the dtype rules, shared with config validation
    return OptimizerPrecision(m.use_precision_aware_optimizer, *(_DTYPES[getattr(m, n)] for n in PRECISION_FIELDS))


def use_fused_torch_adam(optimizer: Any) -> int:
    """Switch the torch ``Adam``/``AdamW`` inside a megatron-core optimizer to torch's fused kernel (one pass over
    params, grads and both moments per step instead of ``foreach``'s ~10); returns how many param groups switched.

    megatron-core 0.16.1 without TE or Apex falls back to ``torch.optim.AdamW`` with its default ``foreach``
    implementation (``megatron/core/optimizer/__init__.py``), where TE/Apex would give their fused Adam. The
    ``fused`` flag is a param-group option of torch's optimizers, read at every step; it is set only before the
    first step (no optimizer state yet) and only on groups whose params are all floating-point tensors on one
    device type that torch's fused Adam supports (CUDA or CPU). ``optimizer`` is a megatron-core
    ``ChainedOptimizer`` (``chained_optimizers``) or a single megatron optimizer (``.optimizer``); other
    inner optimizers (TE's or Apex's fused Adam, SGD) are left alone.
    """
    n = 0
    for wrapper in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.state:
            continue
        for group in inner.param_groups:
            kinds = {p.device.type for p in group["params"]}
            if kinds <= {"cuda", "cpu"} and len(kinds) == 1 and all(p.is_floating_point() for p in group["params"]) \
                    and not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False
                n += 1
    return n


def optimizer_config_kwargs(cfg: SFTProfileConfig, have_te: bool) -> dict:
    """megatron-core ``OptimizerConfig`` keyword arguments (Adam, clipping, precision fields).

    ``gradient_clipping=0`` turns clipping off (``clip_grad=0.0``).

    Raises:
        ConfigError: see :func:`optimizer_precision`.
    """
    a, o = cfg.actor, cfg.actor.optimizer
    prec = optimizer_precision(a.megatron, have_te)
    dtype = _DTYPES[a.dtype]
    return dict(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=o.gradient_clipping,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=a.megatron.ddp.use_distributed_optimizer,
        use_precision_aware_optimizer=prec.use_precision_aware_optimizer,
        main_grads_dtype=prec.main_grads_dtype,
        main_params_dtype=prec.main_params_dtype,
        exp_avg_dtype=prec.exp_avg_dtype,
        exp_avg_sq_dtype=prec.exp_avg_sq_dtype,
    )


def ddp_config_kwargs(cfg: SFTProfileConfig) -> dict:
    """megatron-core ``DistributedDataParallelConfig`` keyword arguments from ``actor.megatron.ddp``."""
    d = cfg.actor.megatron.ddp
    return dict(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32,
        overlap_grad_reduce=d.overlap_grad_reduce,
        overlap_param_gather=d.overlap_param_gather and d.use_distributed_optimizer,
        use_distributed_optimizer=d.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
