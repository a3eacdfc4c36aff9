"""Model FLOP count of an SFT step of a Qwen3-MoE or Qwen3.5-MoE decoder (MoE experts, causal attention, gated
delta-net linear attention, LM head).

Counting rules (one multiply-add = 2 FLOPs; a GEMM ``[m, k] x [k, n]`` costs ``2 m k n``), for a sequence
of ``s`` tokens, hidden size ``h``, ``n_q`` query heads and ``n_kv`` key/value heads of size ``d``,
``E`` routed experts of which ``k`` are active per token with expert FFN size ``f``, shared-expert FFN
size ``f_s`` (0 if none), vocabulary ``V``. Forward, per full-attention layer:

- attention projections: ``2 s h (g n_q d + 2 n_kv d)`` (QKV; ``g = 2`` when ``q_proj`` also emits the output
  gate, Qwen3.5's ``attn_output_gate``, else 1) ``+ 2 s (n_q d) h`` (output);
- causal attention core: ``Q K^T`` and ``P V`` over the ``s (s + 1) / 2`` query-key pairs with
  ``key <= query``: ``2 * 2 n_q d * s (s + 1) / 2 = 2 n_q d s (s + 1)`` (a causal mask does half
  the work of full attention, PaLM appendix B counts the full ``s^2``; we count only the causal half).
  Partial RoPE and the gate's sigmoid are elementwise;

per gated delta-net (GDN, linear-attention) layer, with ``n_k`` key heads of size ``d_k``, ``n_v`` value heads of
size ``d_v`` and a causal convolution of width ``w`` (megatron-core 0.16.1's ``GatedDeltaNet``, Hugging Face's
``Qwen3_5MoeGatedDeltaNet``):

- projections: ``in_proj`` ``2 s h (2 n_k d_k + 2 n_v d_v + 2 n_v)`` (q, k, v, the output gate z, beta, alpha)
  ``+ out_proj`` ``2 s (n_v d_v) h``;
- the depthwise causal conv1d over q, k, v: ``2 w s (2 n_k d_k + n_v d_v)``;
- the chunked gated delta rule (:func:`delta_rule_flops`), per value head (q and k are repeated to the value
  heads before it, as both implementations do);

and per layer (every layer is an MoE layer):

- router: ``2 s h E``;
- routed experts (SwiGLU: fc1 ``h -> 2f``, fc2 ``f -> h``) for the ``k`` chosen experts only:
  ``k * 6 s h f``;
- shared experts: ``6 s h f_s`` plus ``2 s h`` for a shared-expert gate;

and once per sequence the LM head ``2 s h V``. Norms (the GDN's gated RMSNorm too), RoPE, softmax, activations,
the delta rule's gates and decays, and the loss are elementwise (``O(s h)``) and left out, as is the embedding
lookup (no FLOPs). Qwen3.5's multi-token-prediction layer is not counted: neither backend builds it.

A training step costs 3x the forward (forward + backward for activations + backward for weights;
Kaplan et al. 2020, Narayanan et al. 2021). Recompute re-runs forward work and is reported
separately, never added to the model FLOPs: full recompute re-runs the forward of every recomputed
decoder layer (``uniform``: all layers; ``block``: the first ``recompute_num_layers`` of each of the ``pp``
pipeline stages' equal shares of the layers), selective recompute of ``core_attn`` re-runs the attention core
of the full-attention layers.

MFU = model FLOPs / (step time * GPUs * peak), against the dense bf16 peak of the GPU
(:data:`PEAK_BF16_FLOPS`, dense, no sparsity).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

# Dense (no 2:4 sparsity) bf16 tensor-core peak in FLOP/s, from NVIDIA's H100/H200 SXM datasheets.
# Checked in order: the PCIe and NVL parts before the plain (SXM) names.
PEAK_BF16_FLOPS = {"H100 PCIe": 756.5e12, "H100 NVL": 835.5e12, "H100": 989.4e12, "H200": 989.4e12,
                   "A100": 312e12}
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"  # Hugging Face's layer_types values
DELTA_RULE_CHUNK = 64  # fla's chunk_gated_delta_rule default chunk size (tokens), as both backends run it


def delta_rule_flops(seq_len: int, key_dim: int, value_dim: int, chunk: int = DELTA_RULE_CHUNK) -> float:
    """Forward FLOPs of the chunked gated delta rule over one sequence of ``seq_len`` tokens, one head.

    The chunkwise (WY) form of the delta rule (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta
    Rule over Sequence Length", section 3) with the gate of Gated DeltaNet (Yang, Kautz and Hatamizadeh 2025,
    "Gated Delta Networks"), as flash-linear-attention 0.6.0's ``chunk_gated_delta_rule`` computes it. Its matmuls
    per chunk of ``C = chunk`` tokens, keys of size ``d_k = key_dim``, values of size ``d_v = value_dim``, with
    whole ``C x C`` tiles inside a chunk (the kernels compute whole tiles and mask them):

    - ``A = strict_lower(beta K K^T * decay)``: ``2 C^2 d_k`` (``fla/ops/gated_delta_rule/chunk_fwd.py``; its
      fused kernel at ``C = 64`` skips the six 16 x 16 blocks above the diagonal: ``1.25 C^2 d_k``, 3.4 % less
      than this count at ``d_k = d_v = 128``);
    - ``T = (I + A)^-1``, unit lower-triangular: ``C^3 / 3`` (column ``j`` is a forward substitution over the
      ``C - j`` rows below the diagonal: ``sum (C - j)^2``);
    - ``W = T (beta e^g K)`` ``2 C^2 d_k`` and ``U = T (beta V)`` ``2 C^2 d_v`` (``wy_fast.recompute_w_u_fwd``);
    - the state pass, ``V' = U - W S`` and ``S <- e^g S + K^T V'``: ``4 C d_k d_v``
      (``fla/ops/common/chunk_delta_h.py``);
    - the output ``O = (Q e^g) S + (Q K^T * decay) V'``: ``2 C d_k d_v + 2 C^2 d_k + 2 C^2 d_v``
      (``fla/ops/common/chunk_o.py``).

    Sum per chunk ``6 C d_k d_v + 6 C^2 d_k + 4 C^2 d_v + C^3 / 3``, over ``ceil(seq_len / C)`` chunks (the last
    one padded). Its backward is counted as 2x this (the module docstring's rule); fla's backward kernels also
    recompute ``W``, ``U`` and the chunk states and do about 2.8x (``d_k = d_v = 128``, ``C = 64``).
    Hugging Face's pure-torch ``torch_chunk_gated_delta_rule`` runs the same matmuls, with ``T`` formed by
    elementwise forward substitution (``tests/test_flops.py`` counts them with torch's FlopCounterMode).
    """
    c = chunk
    per_chunk = 6 * c * key_dim * value_dim + 6 * c * c * key_dim + 4 * c * c * value_dim + c ** 3 / 3
    return math.ceil(seq_len / c) * per_chunk


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """Sizes of a gated delta-net layer (Hugging Face's ``linear_*`` config fields)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class ModelShape:
    """Sizes that determine the FLOP count (see the module docstring for the symbols).

    ``layer_types``: Hugging Face's ``full_attention`` / ``linear_attention`` per layer (empty: every layer full
    attention); ``gdn``: the linear-attention layers' sizes (needed when one is listed).
    """

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    topk: int
    moe_ffn: int
    vocab: int
    shared_ffn: int = 0
    shared_gate: bool = False
    attn_output_gate: bool = False
    layer_types: tuple[str, ...] = ()
    gdn: Optional[GatedDeltaNetShape] = None

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL_ATTENTION

    @property
    def num_linear_layers(self) -> int:
        return sum(t == LINEAR_ATTENTION for t in self.layer_types)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelShape":
        """Shape of an HF ``qwen3_moe`` or ``qwen3_5_moe(_text)`` config (``num_experts`` or ``num_local_experts``).

        Raises:
            NotImplementedError: configs with layer types other than full and linear (gated delta-net) attention,
                or with dense layers between MoE layers, whose FLOPs this module does not count.
        """
        types = tuple(getattr(hf, "layer_types", None) or ())
        other = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if other:
            raise NotImplementedError(f"FLOP count of layer types {other} is not implemented (counted: "
                                      f"{FULL_ATTENTION!r}, {LINEAR_ATTENTION!r})")
        if getattr(hf, "mlp_only_layers", None) or (getattr(hf, "decoder_sparse_step", 1) or 1) != 1:
            raise NotImplementedError("FLOP count of dense layers between MoE layers (mlp_only_layers, "
                                      "decoder_sparse_step != 1) is not implemented")
        gdn = None
        if LINEAR_ATTENTION in types:
            gdn = GatedDeltaNetShape(num_key_heads=hf.linear_num_key_heads, num_value_heads=hf.linear_num_value_heads,
                                     key_head_dim=hf.linear_key_head_dim, value_head_dim=hf.linear_value_head_dim,
                                     conv_kernel=hf.linear_conv_kernel_dim)
        shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
        experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
        return cls(num_layers=hf.num_hidden_layers, hidden=hf.hidden_size, num_heads=hf.num_attention_heads,
                   num_kv_heads=hf.num_key_value_heads,
                   head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                   num_experts=experts, topk=hf.num_experts_per_tok, moe_ffn=hf.moe_intermediate_size,
                   vocab=hf.vocab_size, shared_ffn=shared, shared_gate=bool(shared),
                   attn_output_gate=bool(getattr(hf, "attn_output_gate", False)), layer_types=types, gdn=gdn)


def countable_shape(hf: Any) -> Optional[ModelShape]:
    """:meth:`ModelShape.from_hf`, or ``None`` (logged once at INFO with the reason) for a model whose FLOPs
    this module does not count: its steps report no model FLOPs or MFU rather than a wrong number."""
    try:
        return ModelShape.from_hf(hf)
    except NotImplementedError as err:
        log.info("model FLOPs, TFLOP/s and MFU are not reported: %s", err)
        return None


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of a batch, by component (all layers summed; ``lm_head`` once per token).

    ``attn_*``: the full-attention layers; ``gdn_*``: the gated delta-net layers (projections, causal conv1d,
    chunked delta rule).
    """

    attn_linear: float = 0.0
    attn_core: float = 0.0
    gdn_proj: float = 0.0
    gdn_conv: float = 0.0
    gdn_core: float = 0.0
    router: float = 0.0
    routed_experts: float = 0.0
    shared_experts: float = 0.0
    lm_head: float = 0.0

    @property
    def decoder(self) -> float:
        """FLOPs of the decoder layers (everything but the LM head)."""
        return (self.attn_linear + self.attn_core + self.gdn_proj + self.gdn_conv + self.gdn_core + self.router
                + self.routed_experts + self.shared_experts)

    @property
    def total(self) -> float:
        return self.decoder + self.lm_head


def per_layer_flops(shape: ModelShape, seq_lens: Sequence[int]) -> dict[str, ForwardFlops]:
    """Forward FLOPs of one layer of each type (``full_attention``, ``linear_attention``; the second only when
    ``shape.gdn`` is set) over ``seq_lens`` (tokens per sequence); ``lm_head`` 0."""
    m, g = shape, shape.gdn
    tokens = float(sum(seq_lens))
    moe = ForwardFlops(router=tokens * 2 * m.hidden * m.num_experts,
                       routed_experts=tokens * m.topk * 6 * m.hidden * m.moe_ffn,
                       shared_experts=tokens * (6 * m.hidden * m.shared_ffn + (2 * m.hidden if m.shared_gate else 0)))
    q_dim, kv_dim = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    q_out = q_dim * (2 if m.attn_output_gate else 1)  # q_proj emits the output gate too
    pairs = float(sum(s * (s + 1) // 2 for s in seq_lens))
    out = {FULL_ATTENTION: replace(moe, attn_core=4 * q_dim * pairs,
                                   attn_linear=tokens * (2 * m.hidden * (q_out + 2 * kv_dim) + 2 * q_dim * m.hidden))}
    if g is not None:
        qk, v = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
        core = sum(delta_rule_flops(s, g.key_head_dim, g.value_head_dim) for s in seq_lens)
        out[LINEAR_ATTENTION] = replace(
            moe, gdn_proj=tokens * (2 * m.hidden * (2 * qk + 2 * v + 2 * g.num_value_heads) + 2 * v * m.hidden),
            gdn_conv=tokens * 2 * g.conv_kernel * (2 * qk + v), gdn_core=g.num_value_heads * core)
    return out


def _sum(parts: Sequence[ForwardFlops], lm_head: float) -> ForwardFlops:
    """The layers' FLOPs added up, with ``lm_head`` as the LM head's."""
    total = {k: sum(getattr(p, k) for p in parts) for k in ForwardFlops.__dataclass_fields__}
    return ForwardFlops(**{**total, "lm_head": lm_head})


def forward_flops(shape: ModelShape, seq_lens: Sequence[int]) -> ForwardFlops:
    """Forward FLOPs of sequences of the given lengths (tokens), per the module docstring's rules.

    Raises:
        ValueError: ``shape`` lists a linear-attention layer but has no ``gdn`` sizes.
    """
    if shape.num_linear_layers and shape.gdn is None:
        raise ValueError("ModelShape.layer_types lists linear_attention layers but ModelShape.gdn is None")
    per = per_layer_flops(shape, seq_lens)
    layers = [per[shape.layer_type(i)] for i in range(shape.num_layers)]
    return _sum(layers, float(sum(seq_lens)) * 2 * shape.hidden * shape.vocab)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step: ``model`` (3x forward) and ``recompute`` (extra forward work)."""

    model: float
    recompute: float


def train_step_flops(shape: ModelShape, seq_lens: Sequence[int], recompute_granularity: Optional[str] = None,
                     recompute_method: str = "uniform", recompute_num_layers: int = 1, pp: int = 1,
                     recompute_modules: Sequence[str] = ("core_attn",)) -> StepFlops:
    """Model and recompute FLOPs of one step over ``seq_lens`` (every sequence of the global batch).

    Args:
        recompute_granularity: ``"full"``, ``"selective"`` or ``None``/``"none"``.
        recompute_method, recompute_num_layers, pp: which layers full recompute covers (docstring; ``pp``
            divides the number of layers, as megatron-core requires).
        recompute_modules: selective recompute modules; only ``core_attn`` is counted.
    Raises:
        ValueError: unknown granularity or method.
    """
    fwd = forward_flops(shape, seq_lens)
    if recompute_granularity in (None, "none"):
        extra = 0.0
    elif recompute_granularity == "full":
        if recompute_method == "uniform":
            extra = fwd.decoder
        elif recompute_method == "block":
            per, stage = per_layer_flops(shape, seq_lens), shape.num_layers // pp
            layers = [p * stage + i for p in range(pp) for i in range(min(recompute_num_layers, stage))]
            extra = _sum([per[shape.layer_type(i)] for i in layers], 0.0).decoder
        else:
            raise ValueError(f"recompute_method={recompute_method!r}; accepted: 'uniform', 'block'")
    elif recompute_granularity == "selective":
        extra = fwd.attn_core if "core_attn" in recompute_modules else 0.0
    else:
        raise ValueError(f"recompute_granularity={recompute_granularity!r}; accepted: 'full', 'selective', 'none'")
    return StepFlops(model=3 * fwd.total, recompute=extra)


def gpu_peak_bf16_flops(device_name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s of a GPU by name (``torch.cuda.get_device_name()``), ``None`` if unknown."""
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return peak
    return None


def mfu(model_flops: float, step_time_s: float, n_gpus: int, peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOP utilisation in [0, 1]: ``model_flops / (step_time_s * n_gpus * peak_flops)``; ``None``
    when the peak is unknown or the time is not positive."""
    if not peak_flops or step_time_s <= 0:
        return None
    return model_flops / (step_time_s * n_gpus * peak_flops)
