"""Model FLOP count of an SFT step of a Qwen3-MoE-style decoder (MoE experts, causal attention, LM head).

Counting rules (one multiply-add = 2 FLOPs; a GEMM ``[m, k] x [k, n]`` costs ``2 m k n``), for a sequence
of ``s`` tokens, hidden size ``h``, ``n_q`` query heads and ``n_kv`` key/value heads of size ``d``,
``E`` routed experts of which ``k`` are active per token with expert FFN size ``f``, shared-expert FFN
size ``f_s`` (0 if none), vocabulary ``V`` and ``L`` decoder layers. Forward, per layer:

- attention projections: ``2 s h (n_q d + 2 n_kv d)`` (QKV) ``+ 2 s (n_q d) h`` (output);
- causal attention core: ``Q K^T`` and ``P V`` over the ``s (s + 1) / 2`` query-key pairs with
  ``key <= query``: ``2 * 2 n_q d * s (s + 1) / 2 = 2 n_q d s (s + 1)`` (a causal mask does half
  the work of full attention, PaLM appendix B counts the full ``s^2``; we count only the causal half);
- router: ``2 s h E``;
- routed experts (SwiGLU: fc1 ``h -> 2f``, fc2 ``f -> h``) for the ``k`` chosen experts only:
  ``k * 6 s h f``;
- shared experts: ``6 s h f_s`` plus ``2 s h`` for a shared-expert gate;

and once per sequence the LM head ``2 s h V``. Norms, RoPE, softmax, activations and the loss are
elementwise (``O(s h)``) and left out, as is the embedding lookup (no FLOPs).

A training step costs 3x the forward (forward + backward for activations + backward for weights;
Kaplan et al. 2020, Narayanan et al. 2021). Recompute re-runs forward work and is reported
separately, never added to the model FLOPs: full recompute re-runs the forward of every recomputed
decoder layer (``uniform``: all layers; ``block``: ``recompute_num_layers`` per pipeline stage),
selective recompute of ``core_attn`` re-runs the attention core.

MFU = model FLOPs / (step time * GPUs * peak), against the dense bf16 peak of the GPU
(:data:`PEAK_BF16_FLOPS`, dense, no sparsity).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

# Dense (no 2:4 sparsity) bf16 tensor-core peak in FLOP/s, from NVIDIA's H100/H200 SXM datasheets.
# Checked in order: the PCIe and NVL parts before the plain (SXM) names.
PEAK_BF16_FLOPS = {"H100 PCIe": 756.5e12, "H100 NVL": 835.5e12, "H100": 989.4e12, "H200": 989.4e12,
                   "A100": 312e12}


@dataclass(frozen=True)
class ModelShape:
    """Sizes that determine the FLOP count (see the module docstring for the symbols)."""

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

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelShape":
        """Shape of an HF ``qwen3_moe`` config (``num_experts`` or ``num_local_experts``).

        Raises:
            NotImplementedError: configs with linear-attention layers (Qwen3.5 gated delta-net) or dense
                layers between MoE layers, whose FLOPs this module does not count.
        """
        if any(t != "full_attention" for t in (getattr(hf, "layer_types", None) or [])):
            raise NotImplementedError("FLOP count of linear-attention (gated delta-net) layers is not implemented")
        if getattr(hf, "mlp_only_layers", None) or (getattr(hf, "decoder_sparse_step", 1) or 1) != 1:
            raise NotImplementedError("FLOP count of dense layers between MoE layers (mlp_only_layers, "
                                      "decoder_sparse_step != 1) is not implemented")
        shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
        experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
        return cls(num_layers=hf.num_hidden_layers, hidden=hf.hidden_size, num_heads=hf.num_attention_heads,
                   num_kv_heads=hf.num_key_value_heads,
                   head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                   num_experts=experts, topk=hf.num_experts_per_tok, moe_ffn=hf.moe_intermediate_size,
                   vocab=hf.vocab_size, shared_ffn=shared, shared_gate=bool(shared))


def countable_shape(hf: Any) -> Optional[ModelShape]:
    """:meth:`ModelShape.from_hf`, or ``None`` (logged once at INFO with the reason) for a model whose FLOPs
    this module does not count, such as Qwen3.5's gated delta-net layers: its steps report no model FLOPs
    or MFU rather than a wrong number."""
    try:
        return ModelShape.from_hf(hf)
    except NotImplementedError as err:
        log.info("model FLOPs, TFLOP/s and MFU are not reported: %s", err)
        return None


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of a batch, by component (all layers summed; ``lm_head`` once per token)."""

    attn_linear: float
    attn_core: float
    router: float
    routed_experts: float
    shared_experts: float
    lm_head: float

    @property
    def decoder(self) -> float:
        """FLOPs of the decoder layers (everything but the LM head)."""
        return self.attn_linear + self.attn_core + self.router + self.routed_experts + self.shared_experts

    @property
    def total(self) -> float:
        return self.decoder + self.lm_head


def forward_flops(shape: ModelShape, seq_lens: Sequence[int]) -> ForwardFlops:
    """Forward FLOPs of sequences of the given lengths (tokens), per the module docstring's rules."""
    m = shape
    tokens = float(sum(seq_lens))
    q_dim, kv_dim = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    pairs = float(sum(s * (s + 1) // 2 for s in seq_lens))
    L = m.num_layers
    return ForwardFlops(
        attn_linear=L * tokens * (2 * m.hidden * (q_dim + 2 * kv_dim) + 2 * q_dim * m.hidden),
        attn_core=L * 4 * q_dim * pairs,
        router=L * tokens * 2 * m.hidden * m.num_experts,
        routed_experts=L * tokens * m.topk * 6 * m.hidden * m.moe_ffn,
        shared_experts=L * tokens * (6 * m.hidden * m.shared_ffn + (2 * m.hidden if m.shared_gate else 0)),
        lm_head=tokens * 2 * m.hidden * m.vocab,
    )


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
        recompute_method, recompute_num_layers, pp: which layers full recompute covers (docstring).
        recompute_modules: selective recompute modules; only ``core_attn`` is counted.
    Raises:
        ValueError: unknown granularity or method.
    """
    fwd = forward_flops(shape, seq_lens)
    if recompute_granularity in (None, "none"):
        extra = 0.0
    elif recompute_granularity == "full":
        if recompute_method == "uniform":
            layers = shape.num_layers
        elif recompute_method == "block":
            layers = min(shape.num_layers, recompute_num_layers * pp)
        else:
            raise ValueError(f"recompute_method={recompute_method!r}; accepted: 'uniform', 'block'")
        extra = fwd.decoder * layers / shape.num_layers
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
