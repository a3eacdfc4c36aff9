"""SwiGLU with the router's probabilities, fused: ``out = silu(gate) * up * p`` in one pass each way.

The grouped-GEMM experts (:mod:`sftprof.models.layers.experts`) apply megatron-core's per-token routing probability
between the two expert GEMMs. Unfused, ``silu(gate) * up * probs[:, None]`` is four elementwise kernels over
``[tokens * topk, ffn]`` (fp32 after the multiply by fp32 probs, then a cast back), and autograd keeps their
intermediates; at 131072 tokens x topk 8 x ffn 768 each pass moves several GiB. Fused, the forward reads ``fc1``
once and writes ``out`` once; the backward reads ``fc1`` and ``d out`` once and writes ``d fc1`` and
``d probs``; only ``fc1`` and ``probs`` are saved.

Math (``g`` gate, ``u`` up, ``p`` probability, ``s = sigmoid(g)``; fp32 throughout (fp64 for fp64 inputs on CPU),
one rounding at the store):
``out = g s u p``; ``d g = d_out u p s (1 + g (1 - s))``; ``d u = d_out g s p``; ``d p = sum_f d_out g s u``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sftprof.models.layers.op_inputs import FLOAT_DTYPES, check_tensor

__all__ = ["swiglu_with_probs"]


def _compute_dtype(fc1: torch.Tensor) -> torch.dtype:
    return torch.promote_types(fc1.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def _forward_torch(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    ct = _compute_dtype(fc1)
    gate, up = fc1.to(ct).chunk(2, dim=-1)
    return (F.silu(gate) * up * probs.to(ct).unsqueeze(-1)).to(fc1.dtype)


class _SwiGLUWithProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1, probs):
        ctx.save_for_backward(fc1, probs)
        if fc1.is_cuda:
            from sftprof.models.layers import swiglu_kernels

            return swiglu_kernels.swiglu_forward(fc1, probs)
        return _forward_torch(fc1, probs)

    @staticmethod
    def backward(ctx, d_out):
        fc1, probs = ctx.saved_tensors
        if fc1.is_cuda:
            from sftprof.models.layers import swiglu_kernels

            d_fc1, d_probs = swiglu_kernels.swiglu_backward(fc1, probs, d_out.contiguous())
        else:
            ct = _compute_dtype(fc1)
            g, u = fc1.to(ct).chunk(2, dim=-1)
            p, d = probs.to(ct).unsqueeze(-1), d_out.to(ct)
            s = torch.sigmoid(g)
            d_fc1 = torch.cat([d * u * p * s * (1 + g * (1 - s)), d * g * s * p], dim=-1).to(fc1.dtype)
            d_probs = (d * g * s * u).sum(-1)
        return d_fc1, d_probs.to(probs.dtype)


def swiglu_with_probs(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * probs[:, None]`` of ``fc1 = [gate | up]``, computed in fp32, rounded once.

    Args:
        fc1: ``[M, 2F]`` bf16/fp16/fp32, or fp64 on CPU (the first expert GEMM's output: gate columns, then up
            columns); must be contiguous.
        probs: ``[M]`` routing probabilities (bf16/fp16/fp32, or fp64 on CPU; megatron's are fp32), one per
            permuted token, on ``fc1``'s device.
    Returns:
        ``[M, F]`` in ``fc1``'s dtype. Differentiable in ``fc1`` and ``probs`` (``d probs`` in ``probs``' dtype).
        On CUDA both directions run in Triton kernels (:mod:`sftprof.models.layers.swiglu_kernels`); elsewhere in torch.
    Raises:
        ValueError: ``fc1`` or ``probs`` not a tensor of an accepted dtype, ``probs`` on another device
            (:func:`sftprof.models.layers.op_inputs.check_tensor`); ``fc1`` not 2-D contiguous with an even column count,
            or ``probs`` not ``[M]``.
    """
    check_tensor("swiglu_with_probs", "fc1", fc1, FLOAT_DTYPES, cpu_dtypes=(torch.float64,))
    check_tensor("swiglu_with_probs", "probs", probs, FLOAT_DTYPES, device=fc1.device, cpu_dtypes=(torch.float64,))
    if fc1.dim() != 2 or fc1.shape[1] % 2 or not fc1.is_contiguous():
        raise ValueError(f"fc1 must be a contiguous [M, 2F] tensor, got shape {tuple(fc1.shape)} "
                         f"stride {fc1.stride()}")
    if probs.shape != (fc1.shape[0],):
        raise ValueError(f"probs must be [{fc1.shape[0]}], got {tuple(probs.shape)}")
    return _SwiGLUWithProbs.apply(fc1, probs)
