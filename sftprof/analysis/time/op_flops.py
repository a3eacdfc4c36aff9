"""FLOP rules of recorded ops (``record_shapes``): which ops have a FLOP count, and how many FLOPs.

Counting rules: a GEMM ``[m, k] x [k, n]`` costs ``2 m k n`` (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``,
``_grouped_mm``); scaled-dot-product attention forward costs ``4 b h d P`` with ``P`` the query-key
pairs computed (:func:`attention_pairs`; causal top-left as torch's ``is_causal``, lower-right for the
flash kernels and ``custom_mask_type=2``, which context-parallel chunks use), as in ``sftprof/flops.py``; its
backward is counted as 2x the forward (the model-FLOPs convention of ``sftprof/flops.py``; the fused kernels also
recompute ``Q K^T``, 2.5x in hardware work). Masked attention (an explicit ``attn_mask``) has no FLOP count here.
Transformer Engine's autograd Functions (:data:`TE_FORWARD`) are counted from their forward op's input dims.
flash-linear-attention's chunked gated delta rule (kind ``linear attention``) launches its Triton kernels inside the
autograd Function ``ChunkGatedDeltaRuleFunction``, whose forward op is recorded with its inputs (fla 0.6.0's 20
arguments: q ``[b, t, h, d_k]``, v ``[b, t, h_v, d_v]``, ..., the chunk size last): ``b h_v`` times
:func:`sftprof.flops.delta_rule_flops` of ``t`` tokens (none for variable-length calls, ``cu_seqlens`` given, whose
chunks per sequence the shapes do not say). The backward ops of these Functions (:data:`FLOW_BACKWARD`) record only
the output gradient, so each gets 2x the FLOPs of the forward op the profiler's ``fwdbwd`` flow links it to
(:meth:`sftprof.analysis.trace.op_collector.OpCollector.flop_op_of`).

An activity's op is the innermost op with a known FLOP count around its launch point; :mod:`sftprof.analysis.time.efficiency`
turns FLOPs and GPU time into rates.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from sftprof.flops import delta_rule_flops

__all__ = ["op_flops", "attention_pairs", "FLOP_OPS", "TE_FORWARD", "FLOW_FORWARD", "FLOW_BACKWARD", "CORE_PART"]

_GEMMS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
          "aten::_grouped_mm": (0, 1)}

# attention op -> (index of q, index of k, index in Concrete Inputs of the causal flag, index of an explicit
# mask/bias or None, backward?, layout of q/k, what the causal flag means). Layouts: "bhsd" = [b, h, s, d],
# "bshd" = [b, s, h, d]. Causal kinds: "top_left" (torch's is_causal), "lower_right" (the flash kernels'
# causal, which CausalBias(LOWER_RIGHT) uses for context-parallel chunks), "mask_type" (xformers-style
# custom_mask_type: 0 none, 1 top-left, 2 lower-right).
_ATTENTION = {
    "aten::scaled_dot_product_attention": (0, 1, 5, 3, False, "bhsd", "top_left"),
    "aten::_scaled_dot_product_flash_attention": (0, 1, 4, None, False, "bhsd", "lower_right"),
    "aten::_scaled_dot_product_efficient_attention": (0, 1, 6, 3, False, "bhsd", "top_left"),
    "aten::_scaled_dot_product_cudnn_attention": (0, 1, 6, 3, False, "bhsd", "top_left"),
    "aten::_efficient_attention_forward": (0, 1, 9, 3, False, "bshd", "mask_type"),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 2, 11, None, True, "bhsd", "lower_right"),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 2, 11, 4, True, "bhsd", "top_left"),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 2, 14, 8, True, "bhsd", "top_left"),
    "aten::_efficient_attention_backward": (1, 2, 14, 4, True, "bshd", "mask_type"),
}

# Transformer Engine's autograd Functions (TE 2.x): their forward ops carry the input dims; their backward nodes
# (``<name>Backward``) only the output gradient's, so a backward node's FLOPs are 2x those of the forward op the
# profiler's fwdbwd flow links it to. ``FusedAttnFunc`` is TE's fused attention without context parallelism, q/k in
# megatron-core's ``sbhd`` layout ([s, b, h, d]), causal (megatron-core's GPT attention mask).
TE_FORWARD = ("FusedAttnFunc", "_Linear", "_LayerNormLinear", "_GroupedLinear", "RouterGatingLinearFunction")
# flash-linear-attention's gated delta rule (module docstring)
_DELTA_RULE = "ChunkGatedDeltaRuleFunction"
# autograd Functions whose backward op gets 2x the FLOPs of the forward op its fwdbwd flow starts at
FLOW_FORWARD = (*TE_FORWARD, _DELTA_RULE)
FLOW_BACKWARD = frozenset(f"{n}Backward" for n in FLOW_FORWARD)
# kinds of op_flops whose backward op is a kind of its own, and the model part of their core when the trace has
# no model-part ranges
CORE_PART = {"attention": "attn_core", "linear attention": "linear_attn"}
FLOP_OPS = frozenset(_GEMMS) | frozenset(_ATTENTION) | frozenset(FLOW_FORWARD)  # the ops op_flops counts


def attention_pairs(sq: int, sk: int, causal: bool, lower_right: bool = False) -> int:
    """Query-key pairs one head computes: ``sq * sk``; causal top-left (query ``i`` sees keys ``j <= i``):
    ``sum_i min(i + 1, sk)``; causal lower-right (``j <= i + sk - sq``): ``sum_i clamp(i + 1 + sk - sq, 0, sk)``."""
    if not causal:
        return sq * sk
    shift = sk - sq if lower_right else 0
    # sum over i in [0, sq) of clamp(i + 1 + shift, 0, sk), in closed form per linear piece
    lo = max(0, -shift)  # first query that sees any key: i + 1 + shift >= 1
    hi = min(sq, max(sk - shift, 0))  # queries with i + 1 + shift <= sk see a prefix
    total = 0
    if hi > lo:
        a, b = lo + 1 + shift, hi + shift  # arithmetic series a..b
        total += (a + b) * (hi - lo) // 2
    total += max(sq - max(hi, lo), 0) * sk
    return total


def _te_linear_flops(name: str, dims: list[Any]) -> Optional[float]:
    """FLOPs of a Transformer Engine linear's forward op (:data:`TE_FORWARD`) from its recorded input dims:
    ``2 M K N`` with the input ``[..., K]`` (``M`` its other dims) and each weight ``[N, K]`` (a grouped linear's
    ``N`` is the same for every expert and its ``M`` the tokens of all experts)."""
    inp, weights = (dims[1], dims[:1]) if name == "_Linear" else (dims[0], dims[1:])
    if not isinstance(inp, list) or len(inp) < 2:
        return None
    k, m = inp[-1], float(np.prod(inp[:-1]))
    shapes = {tuple(w) for w in weights if isinstance(w, list) and len(w) == 2 and w[1] == k}
    if len(shapes) != 1:
        return None
    return float(2.0 * m * k * next(iter(shapes))[0])


def op_flops(name: str, args: dict[str, Any]) -> Optional[tuple[str, float, str]]:
    """``(kind, FLOPs, dtype)`` of one recorded op (``record_shapes``), or None when unknown.

    ``kind`` is ``GEMM``, ``attention``, ``attention backward`` or ``linear attention``; rules in the module
    docstring.
    """
    dims, types = args.get("Input Dims"), args.get("Input type") or []
    if not isinstance(dims, list):
        return None
    dtype = next((t for t in types if isinstance(t, str) and t and t not in ("Scalar", "ScalarList", "")), "?")
    dtype = dtype.replace("c10::", "")
    try:
        if name in TE_FORWARD:
            if name == "FusedAttnFunc":
                q, k = dims[0], dims[1]
                if len(q) != 4 or len(k) != 4:
                    return None  # thd (packed sequences): the pairs need cu_seqlens
                sq, b, h, d = q
                return "attention", 4.0 * b * h * d * attention_pairs(sq, k[0], causal=True), dtype
            f = _te_linear_flops(name, dims)
            return ("GEMM", f, dtype) if f else None
        if name in _GEMMS:
            ia, ib = _GEMMS[name]
            a, b = dims[ia], dims[ib]
            if name == "aten::_grouped_mm":
                if len(a) == 2 and len(b) == 3:  # [M, K] x [G, K, N]
                    return "GEMM", 2.0 * a[0] * a[1] * b[2], dtype
                if len(a) == 2 and len(b) == 2:  # [K, M] x [M, N] grouped over M (weight gradients)
                    return "GEMM", 2.0 * a[0] * a[1] * b[1], dtype
                if len(a) == 3 and len(b) == 3:  # batched [G, M, K] x [G, K, N]
                    return "GEMM", 2.0 * a[0] * a[1] * a[2] * b[2], dtype
                return None
            if len(a) == 2 and len(b) == 2:
                return "GEMM", 2.0 * a[0] * a[1] * b[1], dtype
            if len(a) == 3 and len(b) == 3:
                return "GEMM", 2.0 * a[0] * a[1] * a[2] * b[2], dtype
            return None
        if name in _ATTENTION:
            iq, ik, ic, im, bwd, layout, kind = _ATTENTION[name]
            q, k = dims[iq], dims[ik]
            concrete = args.get("Concrete Inputs") or []
            if im is not None and im < len(dims) and dims[im]:
                return None  # explicit mask or bias: pairs unknown
            if len(q) != 4 or len(k) != 4 or ic >= len(concrete):
                return None
            flag = concrete[ic]
            if kind == "mask_type":
                if flag not in ("0", "1", "2"):
                    return None
                causal, lower_right = flag != "0", flag == "2"
            elif flag in ("True", "False"):
                causal, lower_right = flag == "True", kind == "lower_right"
            else:
                return None
            if layout == "bhsd":
                b, h, sq, d = q
                sk = k[2]
            else:
                b, sq, h, d = q
                sk = k[1]
            fwd = 4.0 * b * h * d * attention_pairs(sq, sk, causal, lower_right)
            return ("attention backward", 2 * fwd, dtype) if bwd else ("attention", fwd, dtype)
        if name == _DELTA_RULE:
            concrete = args.get("Concrete Inputs") or []
            if len(dims) != 20 or len(concrete) != 20 or dims[9] or not str(concrete[19]).isdigit():
                return None  # another fla version's arguments, or variable-length sequences (cu_seqlens)
            (b, t, _, dk), (_, _, hv, dv) = dims[0], dims[2]
            return "linear attention", float(b * hv * delta_rule_flops(t, dk, dv, int(concrete[19]))), dtype
    except (TypeError, IndexError, ValueError):
        return None
    return None
