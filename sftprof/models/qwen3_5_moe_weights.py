"""Hugging Face ``qwen3_5_moe`` (text) tensors -> this rank's megatron-core parameters (local hybrid spec).

Embeddings, norms, router, routed experts and the output projection follow
:data:`sftprof.models.qwen3_moe_weights.COMMON_RULES`. Qwen3.5 adds (``g`` the global layer index; TP rank
``t`` of ``tp``):

=====================================================  =================================================  ================================
megatron-core (``GPTModel``, this project's spec)       Hugging Face (``Qwen3_5MoeForCausalLM``)          transform on TP rank ``t``
=====================================================  =================================================  ================================
linear-attention layer (megatron-core ``GatedDeltaNet``)
``self_attention.in_proj.weight``                      ``linear_attn.in_proj_qkv`` (rows q, k, v),        ``[q_t; k_t; v_t; z_t; b_t; a_t]``: q, k split
                                                       ``in_proj_z``, ``in_proj_b``, ``in_proj_a``        by key heads, v, z, b, a by value heads
``self_attention.conv1d.weight`` ``[C_t, 1, K]``       ``linear_attn.conv1d.weight`` (channels q, k, v)   ``[q_t; k_t; v_t]`` channels
``self_attention.A_log``, ``self_attention.dt_bias``   ``linear_attn.A_log``, ``linear_attn.dt_bias``     value heads of rank ``t``
``self_attention.out_norm.weight``                     ``linear_attn.norm.weight``                        ``weight - 1``: HF's gated norm scales by
                                                                                                          ``weight``, megatron's is zero-centred
``self_attention.out_proj.weight``                     ``linear_attn.out_proj.weight``                    columns of rank ``t``'s value heads
full-attention layer (output gate)
``self_attention.linear_qkv.weight``                   ``self_attn.q_proj`` (rows per head: query ``d``,   per query group of rank ``t``: its heads'
                                                       gate ``d``), ``k_proj``, ``v_proj``                queries, their gates, ``k_g``, ``v_g``
every layer: shared expert with gate
``mlp.shared_experts.linear_fc1.weight``               ``mlp.shared_expert.{gate,up}_proj.weight``        ``[gate_t; up_t]`` rows
``mlp.shared_experts.linear_fc2.weight``               ``mlp.shared_expert.down_proj.weight``             columns of rank ``t``
``mlp.shared_experts.gate_weight``                     ``mlp.shared_expert_gate.weight``                  copy
=====================================================  =================================================  ================================

The gated-attention order is megatron-core's (``SelfAttention.get_query_key_value_tensors`` with
``attention_output_gate``: per query group ``[queries, gates, key, value]``); the in_proj order is megatron-core's
``GatedDeltaNet`` split (``q, k, v, z, b, a`` per TP rank; the same from 0.16.1 to 0.19.x). The multimodal
checkpoint's text tensors (``model.language_model.*``) are read through :class:`TextPrefixSource`; vision-tower and
MTP tensors are not part of the profiled text model.
"""
from __future__ import annotations

from typing import Collection, List, Tuple

import torch

from sftprof.models.checkpoint import TensorSource
from sftprof.models.qwen3_moe_weights import (
    LAYER_PATTERN,
    COMMON_RULES,
    Builder,
    ShardContext,
    rank_slice,
    apply_rules,
    attention_tensors,
    compile_rules,
    model_tensors,
)

# Checkpoint tensors outside the profiled text model (not loaded; reported as skipped).
NOT_LOADED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
# Where a multimodal (Qwen3_5MoeForConditionalGeneration) checkpoint keeps the text model's ``model.*`` tensors.
TEXT_PREFIX = "model.language_model."


class TextPrefixSource:
    """A :class:`TensorSource` that serves ``model.<x>`` from ``model.language_model.<x>`` (the text part of a
    ``Qwen3_5MoeForConditionalGeneration`` checkpoint); other names pass through."""

    def __init__(self, src: TensorSource) -> None:
        self.src = src

    def _name(self, name: str) -> str:
        alt = TEXT_PREFIX + name[len("model."):]
        return alt if name.startswith("model.") and name not in self.src and alt in self.src else name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.src

    def shape(self, name: str):
        return self.src.shape(self._name(name))

    def read(self, name: str, index=...) -> torch.Tensor:
        return self.src.read(self._name(name), index)


def _heads(n_heads: int, head_dim: int, ctx: ShardContext, what: str) -> slice:
    """Rows (or columns) of TP rank ``ctx.tp_rank``'s heads in a ``[n_heads * head_dim, ...]`` projection."""
    h = rank_slice(n_heads, ctx.tp_size, ctx.tp_rank, what)
    return slice(h.start * head_dim, h.stop * head_dim)


def _gdn_in_proj(src: TensorSource, g: int, ctx: ShardContext) -> torch.Tensor:
    p = f"model.layers.{g}.linear_attn."
    key_dim = ctx.linear_num_key_heads * ctx.linear_key_head_dim
    kh = _heads(ctx.linear_num_key_heads, ctx.linear_key_head_dim, ctx, "linear_num_key_heads")
    vh = _heads(ctx.linear_num_value_heads, ctx.linear_value_head_dim, ctx, "linear_num_value_heads")
    heads = _heads(ctx.linear_num_value_heads, 1, ctx, "linear_num_value_heads")
    rows = slice(None)
    return torch.cat([
        src.read(p + "in_proj_qkv.weight", (slice(kh.start, kh.stop), rows)),
        src.read(p + "in_proj_qkv.weight", (slice(key_dim + kh.start, key_dim + kh.stop), rows)),
        src.read(p + "in_proj_qkv.weight", (slice(2 * key_dim + vh.start, 2 * key_dim + vh.stop), rows)),
        src.read(p + "in_proj_z.weight", (vh, rows)),
        src.read(p + "in_proj_b.weight", (heads, rows)),
        src.read(p + "in_proj_a.weight", (heads, rows)),
    ])


def _gdn_conv(src: TensorSource, g: int, ctx: ShardContext) -> torch.Tensor:
    name = f"model.layers.{g}.linear_attn.conv1d.weight"
    key_dim = ctx.linear_num_key_heads * ctx.linear_key_head_dim
    kh = _heads(ctx.linear_num_key_heads, ctx.linear_key_head_dim, ctx, "linear_num_key_heads")
    vh = _heads(ctx.linear_num_value_heads, ctx.linear_value_head_dim, ctx, "linear_num_value_heads")
    return torch.cat([src.read(name, (slice(off + r.start, off + r.stop),))
                      for off, r in ((0, kh), (key_dim, kh), (2 * key_dim, vh))])


def _gated_qkv(src: TensorSource, g: int, ctx: ShardContext) -> torch.Tensor:
    """Per query group of this TP rank: its heads' queries, their gates, then key and value."""
    p = f"model.layers.{g}.self_attn."
    d, h = ctx.head_dim, src.shape(p + "k_proj.weight")[1]
    groups = rank_slice(ctx.num_query_groups, ctx.tp_size, ctx.tp_rank, "num_key_value_heads")
    per_group = ctx.num_heads // ctx.num_query_groups
    q = src.read(p + "q_proj.weight", (slice(groups.start * per_group * 2 * d, groups.stop * per_group * 2 * d),))
    q = q.view(groups.stop - groups.start, per_group, 2, d, h)  # [group, head, (query, gate), d, H]
    k = src.read(p + "k_proj.weight", (slice(groups.start * d, groups.stop * d),)).view(-1, d, h)
    v = src.read(p + "v_proj.weight", (slice(groups.start * d, groups.stop * d),)).view(-1, d, h)
    rows = [torch.cat([q[i, :, 0].reshape(-1, h), q[i, :, 1].reshape(-1, h), k[i], v[i]]) for i in range(len(k))]
    return torch.cat(rows)


def _shared_fc(src: TensorSource, g: int, ctx: ShardContext, fc: int) -> torch.Tensor:
    p = f"model.layers.{g}.mlp.shared_expert."
    f = src.shape(p + "down_proj.weight")[1]
    rows = rank_slice(f, ctx.tp_size, ctx.tp_rank, "shared_expert_intermediate_size")
    if fc == 2:
        return src.read(p + "down_proj.weight", (slice(None), rows))
    return torch.cat([src.read(p + "gate_proj.weight", (rows,)), src.read(p + "up_proj.weight", (rows,))])


_SA = LAYER_PATTERN + r"self_attention\."
RULES: List[Tuple[str, Builder]] = COMMON_RULES + [
    (_SA + r"in_proj\.weight", lambda s, c, g, j: _gdn_in_proj(s, g, c)),
    (_SA + r"conv1d\.weight", lambda s, c, g, j: _gdn_conv(s, g, c)),
    (_SA + r"A_log", lambda s, c, g, j: s.read(f"model.layers.{g}.linear_attn.A_log", (
        _heads(c.linear_num_value_heads, 1, c, "linear_num_value_heads"),))),
    (_SA + r"dt_bias", lambda s, c, g, j: s.read(f"model.layers.{g}.linear_attn.dt_bias", (
        _heads(c.linear_num_value_heads, 1, c, "linear_num_value_heads"),))),
    (_SA + r"out_norm\.weight", lambda s, c, g, j: s.read(f"model.layers.{g}.linear_attn.norm.weight") - 1),
    (_SA + r"out_proj\.weight", lambda s, c, g, j: s.read(f"model.layers.{g}.linear_attn.out_proj.weight", (
        slice(None), _heads(c.linear_num_value_heads, c.linear_value_head_dim, c, "linear_num_value_heads")))),
    (_SA + r"linear_qkv\.weight", lambda s, c, g, j: _gated_qkv(s, g, c)),
    (LAYER_PATTERN + r"mlp\.shared_experts\.linear_fc1\.weight", lambda s, c, g, j: _shared_fc(s, g, c, 1)),
    (LAYER_PATTERN + r"mlp\.shared_experts\.linear_fc2\.weight", lambda s, c, g, j: _shared_fc(s, g, c, 2)),
    (LAYER_PATTERN + r"mlp\.shared_experts\.gate_weight", lambda s, c, g, j: s.read(f"model.layers.{g}.mlp.shared_expert_gate.weight")),
]
_COMPILED = compile_rules(RULES)
LINEAR_ATTENTION_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                            "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")


def required_tensors(hf_config, names: Collection[str]) -> List[str]:
    """Every Hugging Face tensor :data:`RULES` read to build the model of ``hf_config`` (its layers cut to
    ``actor.num_layers``; on any spec and layout) from a checkpoint holding ``names``: the common tensors
    (:func:`sftprof.models.qwen3_moe_weights.model_tensors`), per layer its gated delta-net
    (:data:`LINEAR_ATTENTION_TENSORS` of ``linear_attn``) or gated attention (by ``layer_types``), the shared expert
    and its gate. A multimodal checkpoint's names (``model.language_model.*``: :data:`TEXT_PREFIX`) are given as it
    spells them."""
    prefix = TEXT_PREFIX if any(n.startswith(TEXT_PREFIX) for n in names) else "model."
    text_names = {"model." + n[len(prefix):] if n.startswith(prefix) else n for n in names}

    def layer(g: int) -> List[str]:
        p = f"model.layers.{g}."
        mixer = ([p + "linear_attn." + n for n in LINEAR_ATTENTION_TENSORS]
                 if hf_config.layer_types[g] == "linear_attention" else attention_tensors(g))
        return mixer + [p + f"mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")] + [
            p + "mlp.shared_expert_gate.weight"]

    return [prefix + n[len("model."):] if n.startswith("model.") else n
            for n in model_tensors(hf_config, text_names, layer)]


def local_tensor(name: str, src: TensorSource, ctx: ShardContext) -> torch.Tensor:
    """This rank's value of megatron parameter ``name`` from Hugging Face Qwen3.5 tensors (:data:`RULES`);
    a multimodal checkpoint's ``model.language_model.*`` names are accepted.

    Raises:
        CheckpointError: as :func:`sftprof.models.qwen3_moe_weights.local_tensor`.
    """
    return apply_rules(name, TextPrefixSource(src), ctx, _COMPILED, "qwen3_5_moe")
