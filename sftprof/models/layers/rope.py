"""Rotary position embedding in one pass each way: the stand-in for Transformer Engine's fused RoPE.

megatron-core applies RoPE to the query and key of every attention layer. With ``apply_rope_fusion`` it calls
TE's ``fused_apply_rotary_pos_emb``; without TE it runs ``_apply_rotary_pos_emb_bshd``: six elementwise kernels
per call (split, two multiplies, a negation, two concatenations) and their saved intermediates. At 131072 tokens,
32 query heads of 128 that is ~10 ms per layer and pass on an H200 (bench/NOTES.md, ninth session).
:func:`fused_apply_rotary_pos_emb` has TE's signature for the case megatron-core sends it (``sbhd`` layout,
non-interleaved); :func:`install_in_megatron` binds it in ``megatron.core.models.common.embeddings.rope_utils``
when TE is missing, called by :func:`sftprof.models.megatron_config.training_config_kwargs`, which turns
``apply_rope_fusion`` on.

Math (RoFormer, Su et al. 2021; the ``rotate_half`` convention of megatron-core and Hugging Face): for each head
with the first ``R`` of its ``D`` channels rotated (``R`` even; the rest pass through), halves ``x1, x2`` of
``R / 2`` channels, angles ``f = [f1 | f2]`` (``R``): ``out = [x1 cos f1 - x2 sin f1 | x2 cos f2 + x1 sin f2]``.
The gradient is the transposed map: ``d x = [d1 cos f1 + d2 sin f2 | d2 cos f2 - d1 sin f1]``. cos and sin are
taken in fp32 from the fp32 angles (as TE does; the unfused path rounds them to the activation dtype first), the
products are summed in fp32 and rounded once.
"""
from __future__ import annotations

import torch

from sftprof.models.layers.op_inputs import FLOAT_DTYPES, check_tensor

__all__ = ["fused_apply_rotary_pos_emb"]


def _rotate(t: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    if t.is_cuda:
        from sftprof.models.layers import rope_kernels

        return rope_kernels.rope_apply(t, freqs, backward)
    ct = torch.promote_types(t.dtype, torch.float32)
    half = freqs.shape[-1] // 2
    f = freqs.to(ct)
    c1, c2, s1, s2 = f[..., :half].cos(), f[..., half:].cos(), f[..., :half].sin(), f[..., half:].sin()
    x1, x2, rest = t[..., :half].to(ct), t[..., half:2 * half].to(ct), t[..., 2 * half:]
    if backward:
        o1, o2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        o1, o2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    return torch.cat([o1.to(t.dtype), o2.to(t.dtype), rest], dim=-1)


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return _rotate(t, freqs, backward=False)

    @staticmethod
    def backward(ctx, d_out):
        (freqs,) = ctx.saved_tensors
        return _rotate(d_out.contiguous(), freqs, backward=True), None


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """RoPE on ``t`` ``[S, B, H, D]`` (megatron-core's ``sbhd``) with angles ``freqs`` ``[S, 1 or B, 1, R]``.

    Args:
        t: query or key, bf16/fp16/fp32, or fp64 on CPU (made contiguous if it is not: one copy).
        freqs: rotation angles in radians (fp32 from megatron-core's ``RotaryEmbedding``; bf16/fp16/fp32, or fp64
            on CPU) on ``t``'s device, ``R`` even, ``R <= D``; not differentiated.
        transpose_output_memory: accepted for TE's signature; must be False.
        interleaved: accepted for TE's signature; must be False (megatron-core's ``rotary_interleaved``).
    Returns:
        ``[S, B, H, D]`` in ``t``'s dtype, differentiable in ``t``. Triton on CUDA
        (:func:`sftprof.models.layers.rope_kernels.rope_apply`), torch elsewhere.
    Raises:
        ValueError: interleaved or transposed output asked for; ``t`` or ``freqs`` not a tensor of an accepted dtype,
            ``freqs`` on another device (:func:`sftprof.models.layers.op_inputs.check_tensor`); or shapes that do not match
            (named in the message).
    """
    check_tensor("fused_apply_rotary_pos_emb", "t", t, FLOAT_DTYPES, cpu_dtypes=(torch.float64,))
    check_tensor("fused_apply_rotary_pos_emb", "freqs", freqs, FLOAT_DTYPES, device=t.device,
                 cpu_dtypes=(torch.float64,))
    if interleaved or transpose_output_memory:
        raise ValueError("fused_apply_rotary_pos_emb supports interleaved=False and transpose_output_memory=False "
                         f"only, got interleaved={interleaved} transpose_output_memory={transpose_output_memory}")
    if t.dim() != 4 or freqs.dim() != 4 or freqs.shape[0] != t.shape[0] or freqs.shape[1] not in (1, t.shape[1]) \
            or freqs.shape[2] != 1 or freqs.shape[3] % 2 or freqs.shape[3] > t.shape[3]:
        raise ValueError(f"t must be [S, B, H, D] and freqs [S, 1 or B, 1, R] with R even and <= D, got t "
                         f"{tuple(t.shape)} freqs {tuple(freqs.shape)}")
    return _FusedRoPE.apply(t.contiguous(), freqs.contiguous())


def install_in_megatron() -> bool:
    """Bind :func:`fused_apply_rotary_pos_emb` as megatron-core's ``fused_apply_rotary_pos_emb`` in
    ``megatron.core.models.common.embeddings.rope_utils`` where Transformer Engine left it ``None``. Idempotent;
    TE's own kernel, when present, stays. Returns True (a fused RoPE is then available to ``apply_rope_fusion``)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    return True
