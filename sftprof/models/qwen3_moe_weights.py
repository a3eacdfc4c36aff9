"""Hugging Face ``qwen3_moe`` tensors -> this rank's megatron-core parameters (local or Transformer Engine spec).

One table, :data:`RULES`, maps each megatron parameter name of this project's ``GPTModel`` (both specs of
:mod:`sftprof.models.specs`) to the Hugging Face tensors it is built from and how:

=====================================================  =================================================  ==========================
megatron-core (``GPTModel``)                            Hugging Face (``Qwen3MoeForCausalLM``)            transform on this rank
=====================================================  =================================================  ==========================
embedding.word_embeddings.weight  [V'/tp, H]           model.embed_tokens.weight [V, H]                  vocab rows of TP rank (padded)
decoder.layers.i.input_layernorm.weight [H]            model.layers.g.input_layernorm.weight             copy
decoder.layers.i.self_attention.linear_qkv.weight      model.layers.g.self_attn.{q,k,v}_proj.weight      fused per query group
  [(G/tp) * (heads/G + 2) * d, H]                                                                         [q_g; k_g; v_g], TP rank's groups
decoder.layers.i.self_attention.q_layernorm.weight [d] model.layers.g.self_attn.q_norm.weight            copy
decoder.layers.i.self_attention.k_layernorm.weight [d] model.layers.g.self_attn.k_norm.weight            copy
decoder.layers.i.self_attention.linear_proj.weight     model.layers.g.self_attn.o_proj.weight [H, heads*d] columns of TP rank
decoder.layers.i.pre_mlp_layernorm.weight [H]          model.layers.g.post_attention_layernorm.weight    copy
decoder.layers.i.mlp.router.weight [E, H]              model.layers.g.mlp.gate.weight                    copy
decoder.layers.i.mlp.experts.local_experts.j.          model.layers.g.mlp.experts.e.{gate,up}_proj.weight [gate_t; up_t]: ETP rank's
  linear_fc1.weight [2F/etp, H]                                                                           rows of each, e = EP offset + j
decoder.layers.i.mlp.experts.local_experts.j.          model.layers.g.mlp.experts.e.down_proj.weight     columns of ETP rank
  linear_fc2.weight [H, F/etp]
decoder.layers.i.mlp.experts.weight1 [E/ep, H, 2F/etp] (grouped GEMM) the fc1 rule per local expert, transposed, stacked
decoder.layers.i.mlp.experts.weight2 [E/ep, F/etp, H]  (grouped GEMM) the fc2 rule per local expert, transposed, stacked
decoder.final_layernorm.weight [H]                     model.norm.weight                                 copy
output_layer.weight [V'/tp, H]                         lm_head.weight (embed_tokens when tied)           vocab rows of TP rank (padded)
Transformer Engine spec (megatron-core's ``get_gpt_layer_with_transformer_engine_spec``):
decoder.layers.i.self_attention.linear_qkv.            model.layers.g.input_layernorm.weight             copy (TE's LayerNormLinear holds
  layer_norm_weight [H]                                                                                   the input norm; no input_layernorm)
decoder.layers.i.mlp.experts.linear_fc1.weightj        as local_experts.j.linear_fc1.weight              (TE GroupedLinear: one weight per
  [2F/etp, H]                                                                                             local expert j)
decoder.layers.i.mlp.experts.linear_fc2.weightj        as local_experts.j.linear_fc2.weight
  [H, F/etp]
=====================================================  =================================================  ==========================

``i`` is the layer's index on this pipeline stage and ``g = layer.layer_number - 1`` its global index;
``G`` = ``num_key_value_heads``, ``d`` = ``head_dim``, ``F`` = ``moe_intermediate_size``, ``E`` =
``num_experts``. The fused QKV order is megatron-core's (``SelfAttention.get_query_key_value_tensors``
splits each query group's rows as ``[heads/G * d, d, d]``); the fc1 order is megatron-core's SwiGLU
(``MLP``: ``chunk(2)`` of the local fc1 output gives gate then up). ``V'`` is the vocabulary padded to a
multiple of TP (:func:`padded_vocab_size`); padding rows are zero and their logits are masked by the
engine. Experts stored fused (``mlp.experts.gate_up_proj [E, 2F, H]`` and ``mlp.experts.down_proj
[E, H, F]``, transformers 5's in-memory layout) are read too.

The same rules map any tensors with Hugging Face names (a :class:`sftprof.models.checkpoint.DictSource`
of a reference model's gradients, say) onto this rank's shard, which is how the parity tests compare
gradients layout by layout.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch

from sftprof.models.checkpoint import CheckpointError, TensorSource


@dataclass(frozen=True)
class ShardContext:
    """Where this rank sits and the model's shape, as the rules need them.

    Attributes:
        tp_rank, tp_size: attention tensor-parallel rank / size (embedding, QKV, output projection, LM head).
        etp_rank, etp_size: expert tensor-parallel rank / size (expert fc1 rows, fc2 columns).
        ep_rank, ep_size: expert-parallel rank / size (which experts are local).
        num_heads, num_query_groups, head_dim: attention shape.
        num_experts: experts per MoE layer (all ranks).
        vocab_size: the Hugging Face vocabulary size ``V``.
        tied: ``tie_word_embeddings`` (the output layer reads ``model.embed_tokens.weight``).
        layer_numbers: global index ``g`` of each local layer ``i`` (``layer_number - 1``).
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim: the gated
            delta-net shape of Qwen3.5 (0 for models without linear attention;
            :mod:`sftprof.models.qwen3_5_moe_weights`).
    """

    tp_rank: int
    tp_size: int
    etp_rank: int
    etp_size: int
    ep_rank: int
    ep_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    num_experts: int
    vocab_size: int
    tied: bool
    layer_numbers: Tuple[int, ...]
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0

    def __post_init__(self) -> None:
        for kind in ("tp", "etp", "ep"):
            rank, size = getattr(self, kind + "_rank"), getattr(self, kind + "_size")
            if not 0 <= rank < size:
                raise ValueError(f"ShardContext: {kind}_rank={rank} outside [0, {kind}_size={size})")


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest multiple of ``tp_size`` >= ``vocab_size`` (megatron-core's vocab-parallel embedding and
    output layer split the vocabulary into ``tp_size`` equal row blocks)."""
    return -(-vocab_size // tp_size) * tp_size


def _vocab_rows(src: TensorSource, name: str, ctx: ShardContext) -> torch.Tensor:
    v, h = src.shape(name)
    per = padded_vocab_size(v, ctx.tp_size) // ctx.tp_size
    lo, hi = ctx.tp_rank * per, (ctx.tp_rank + 1) * per
    rows = src.read(name, (slice(lo, min(hi, v)), slice(None)))
    if hi > v:  # zero padding rows (their logits are masked to -inf by the engine)
        rows = torch.cat([rows, rows.new_zeros(hi - max(lo, v), h)])
    return rows


def rank_slice(size: int, parts: int, rank: int, what: str) -> slice:
    """Rank ``rank``'s contiguous share of ``size`` items split over ``parts`` ranks.

    Raises:
        CheckpointError: ``size`` is not divisible by ``parts`` (names ``what``).
    """
    if size % parts:
        raise CheckpointError(f"{what}: size {size} is not divisible by {parts} parallel ranks")
    per = size // parts
    return slice(rank * per, (rank + 1) * per)


def _qkv(src: TensorSource, g: int, ctx: ShardContext) -> torch.Tensor:
    p = f"model.layers.{g}.self_attn."
    groups = rank_slice(ctx.num_query_groups, ctx.tp_size, ctx.tp_rank, "num_key_value_heads")
    n_local = groups.stop - groups.start
    per_group = ctx.num_heads // ctx.num_query_groups * ctx.head_dim
    d = ctx.head_dim
    q = src.read(p + "q_proj.weight", (slice(groups.start * per_group, groups.stop * per_group), slice(None)))
    k = src.read(p + "k_proj.weight", (slice(groups.start * d, groups.stop * d), slice(None)))
    v = src.read(p + "v_proj.weight", (slice(groups.start * d, groups.stop * d), slice(None)))
    h = q.shape[-1]
    fused = torch.cat([q.reshape(n_local, per_group, h), k.reshape(n_local, d, h), v.reshape(n_local, d, h)], dim=1)
    return fused.reshape(-1, h)


def _expert(src: TensorSource, g: int, e: int, ctx: ShardContext, fc: int) -> torch.Tensor:
    """Global expert ``e`` of layer ``g`` on this ETP rank: ``fc=1`` -> fc1 ``[2F/etp, H]`` (gate rows then up
    rows), ``fc=2`` -> fc2 ``[H, F/etp]``."""
    p = f"model.layers.{g}.mlp.experts."
    if p + f"{e}.gate_proj.weight" in src or p + "gate_up_proj" not in src:
        f = src.shape(p + f"{e}.down_proj.weight")[1]
        rows = rank_slice(f, ctx.etp_size, ctx.etp_rank, "moe_intermediate_size")
        if fc == 2:
            return src.read(p + f"{e}.down_proj.weight", (slice(None), rows))
        return torch.cat([src.read(p + f"{e}.gate_proj.weight", (rows, slice(None))),
                          src.read(p + f"{e}.up_proj.weight", (rows, slice(None)))])
    # fused layout: gate_up_proj [E, 2F, H] (gate rows then up rows), down_proj [E, H, F]
    f = src.shape(p + "down_proj")[2]
    rows = rank_slice(f, ctx.etp_size, ctx.etp_rank, "moe_intermediate_size")
    if fc == 2:
        return src.read(p + "down_proj", (e, slice(None), rows))
    return torch.cat([src.read(p + "gate_up_proj", (e, rows, slice(None))),
                      src.read(p + "gate_up_proj", (e, slice(f + rows.start, f + rows.stop), slice(None)))])


def _global_expert(ctx: ShardContext, j: int) -> int:
    return ctx.ep_rank * (ctx.num_experts // ctx.ep_size) + j


def _grouped(src: TensorSource, g: int, ctx: ShardContext, fc: int) -> torch.Tensor:
    local = ctx.num_experts // ctx.ep_size
    return torch.stack([_expert(src, g, _global_expert(ctx, j), ctx, fc).t() for j in range(local)])


Builder = Callable[[TensorSource, ShardContext, int, int], torch.Tensor]  # (src, ctx, g, j) -> local tensor

# Megatron parameter names of decoder layer i (group 1: the local layer index).
LAYER_PATTERN = r"decoder\.layers\.(\d+)\."
# Rules every Qwen MoE family shares (Qwen3-MoE, Qwen3.5-MoE): embeddings, norms, output projection, router, experts.
COMMON_RULES: List[Tuple[str, Builder]] = [
    (r"embedding\.word_embeddings\.weight", lambda s, c, g, j: _vocab_rows(s, "model.embed_tokens.weight", c)),
    (r"output_layer\.weight", lambda s, c, g, j: _vocab_rows(
        s, "model.embed_tokens.weight" if c.tied else "lm_head.weight", c)),
    (r"decoder\.final_layernorm\.weight", lambda s, c, g, j: s.read("model.norm.weight")),
    (LAYER_PATTERN + r"input_layernorm\.weight", lambda s, c, g, j: s.read(f"model.layers.{g}.input_layernorm.weight")),
    (LAYER_PATTERN + r"self_attention\.q_layernorm\.weight", lambda s, c, g, j: s.read(f"model.layers.{g}.self_attn.q_norm.weight")),
    (LAYER_PATTERN + r"self_attention\.k_layernorm\.weight", lambda s, c, g, j: s.read(f"model.layers.{g}.self_attn.k_norm.weight")),
    (LAYER_PATTERN + r"self_attention\.linear_proj\.weight", lambda s, c, g, j: s.read(
        f"model.layers.{g}.self_attn.o_proj.weight",
        (slice(None), rank_slice(c.num_heads * c.head_dim, c.tp_size, c.tp_rank, "num_attention_heads * head_dim")))),
    (LAYER_PATTERN + r"pre_mlp_layernorm\.weight", lambda s, c, g, j: s.read(f"model.layers.{g}.post_attention_layernorm.weight")),
    (LAYER_PATTERN + r"mlp\.router\.weight", lambda s, c, g, j: s.read(f"model.layers.{g}.mlp.gate.weight")),
    (LAYER_PATTERN + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight",
     lambda s, c, g, j: _expert(s, g, _global_expert(c, j), c, 1)),
    (LAYER_PATTERN + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight",
     lambda s, c, g, j: _expert(s, g, _global_expert(c, j), c, 2)),
    (LAYER_PATTERN + r"mlp\.experts\.weight1", lambda s, c, g, j: _grouped(s, g, c, 1)),
    (LAYER_PATTERN + r"mlp\.experts\.weight2", lambda s, c, g, j: _grouped(s, g, c, 2)),
    # Transformer Engine spec: the input norm fused into the first linear of the token mixer, grouped-GEMM experts
    (LAYER_PATTERN + r"self_attention\.(?:linear_qkv|in_proj)\.layer_norm_weight",
     lambda s, c, g, j: s.read(f"model.layers.{g}.input_layernorm.weight")),
    (LAYER_PATTERN + r"mlp\.experts\.linear_fc1\.weight(\d+)", lambda s, c, g, j: _expert(s, g, _global_expert(c, j), c, 1)),
    (LAYER_PATTERN + r"mlp\.experts\.linear_fc2\.weight(\d+)", lambda s, c, g, j: _expert(s, g, _global_expert(c, j), c, 2)),
]
RULES: List[Tuple[str, Builder]] = COMMON_RULES + [
    (LAYER_PATTERN + r"self_attention\.linear_qkv\.weight", lambda s, c, g, j: _qkv(s, g, c)),
]


def compile_rules(rules: List[Tuple[str, Builder]]) -> List[Tuple[re.Pattern, Builder]]:
    """``rules`` with their name patterns compiled (anchored at the end)."""
    return [(re.compile(pattern + r"$"), build) for pattern, build in rules]


def apply_rules(name: str, src: TensorSource, ctx: ShardContext, compiled, family: str) -> torch.Tensor:
    """The first rule of ``compiled`` whose pattern matches ``name`` builds its local tensor (see :func:`local_tensor`).

    Raises:
        CheckpointError: no rule matches ``name`` (names ``family``).
    """
    for pattern, build in compiled:
        m = pattern.match(name)
        if m:
            groups = m.groups()
            g = ctx.layer_numbers[int(groups[0])] if groups else -1
            j = int(groups[1]) if len(groups) > 1 else -1
            return build(src, ctx, g, j)
    raise CheckpointError(f"megatron parameter {name!r} has no {family} mapping rule (sftprof.models.{family}_weights)")


_COMPILED = compile_rules(RULES)


def local_tensor(name: str, src: TensorSource, ctx: ShardContext) -> torch.Tensor:
    """This rank's value of megatron parameter ``name``, built from ``src`` by :data:`RULES`.

    Args:
        name: a parameter name of the (unwrapped) ``GPTModel``, e.g.
            ``decoder.layers.0.self_attention.linear_qkv.weight`` (``i`` is the local layer index).
        src: Hugging Face-named tensors (checkpoint or dict).
        ctx: this rank's :class:`ShardContext`.
    Returns:
        The local tensor in the source's dtype, shaped like the megatron parameter.
    Raises:
        CheckpointError: no rule for ``name`` (the model has a parameter this mapping does not know), a
            source tensor is missing, or a dimension does not split evenly over the parallel ranks.
    """
    return apply_rules(name, src, ctx, _COMPILED, "qwen3_moe")
