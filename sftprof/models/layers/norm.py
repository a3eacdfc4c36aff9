"""RMSNorm for megatron-core layer specs without Transformer Engine, fused in Triton on CUDA.

megatron-core's torch norm wrapper (``WrappedTorchNorm``) refuses sequence parallelism, which MoE
training with TP > 1 requires, and zero-centred gamma, which Qwen3.5 uses. This module supports both.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; Qwen3's ``Qwen3MoeRMSNorm``):
``y = x * r * g`` with ``r = 1 / sqrt(mean(x**2, -1) + eps)`` and ``g = weight`` or, zero-centred,
``g = 1 + weight`` (weight initialised to 0; Qwen3-Next/Qwen3.5 ``RMSNorm``). Gradients, with ``c = mean(g dy x, -1)``
per row: ``dx = r (g dy - x r**2 c)``; ``dweight = sum over rows of dy x r`` (the same for zero-centred gamma, since
``dg / dweight = 1``).

Two paths, one contract (output ``[..., D]`` in ``x``'s dtype, ``dweight`` in the weight's dtype):

- CUDA, ``D <= FUSED_MAX_D``, bf16/fp16/fp32 ``x`` and weight: :func:`sftprof.models.layers.norm_kernels.rms_norm_forward` / ``rms_norm_backward``. torch's
  ``F.rms_norm`` runs one CUDA block per row, which for the per-head q/k norms (rows of 128) costs ~7x the memory
  floor (3.37 ms per layer for the query ``[131072, 1, 32, 128]`` bf16 on an H200, whose 2 GiB of reads and writes
  take ~0.45 ms); the Triton kernels take ``[BLOCK_ROWS, BLOCK_D]`` tiles of rows. A strided view whose rows have one
  row stride (the key, a slice of the fused QKV projection's output) is read in place, not copied. Statistics and
  products in fp32, one rounding per stored element: ``y = (x r) g`` in fp32 as torch's CUDA kernel orders it, with
  the weight read in its own dtype and ``1 + weight`` formed in fp32. torch's path below rounds ``g`` to ``x``'s
  dtype first (``gamma.to(x.dtype)``, and ``1 + weight`` to the weight's dtype): with the weight in ``x``'s dtype and
  not zero-centred both compute the same fp32 expression and differ only by the order of the fp32 sum of squares
  (``tests/test_norm.py`` checks one bf16 ulp at most on the GPU); otherwise the fused path is the more exact (one
  rounding fewer). The backward recomputes ``r`` rather than saving it: it reads the whole row of ``x`` for ``c``
  anyway, so the recompute moves no extra bytes, while a saved fp32 ``r`` is 4 bytes per row written and read again
  and held from forward to backward (16 MiB per query norm call at 131072 tokens). ``dweight``: fp32 partial sums
  per program, summed by torch, rounded once to the weight's dtype (deterministic on a given GPU model: no atomics,
  a grid fixed by the SM count). Memory: the saved ``x`` of a strided view is the view, which keeps its base alive
  to the backward (for the key: the whole QKV projection output, which the value, another view of it, also holds
  until the attention's backward when the attention saves it as given).
- CPU, other devices, wider rows, and a dtype the kernels do not take (fp64 ``x`` or weight, on any device; see
  :func:`fused_path`): ``torch.nn.functional.rms_norm(x, (D,), g.to(x.dtype), eps)`` (statistics in fp32: torch
  upcasts bf16 internally; fp64 in fp64).

Under sequence parallelism each TP rank normalises a different slice of the tokens, so the weight's
gradient is partial per rank: the weight carries ``sequence_parallel = config.sequence_parallel``, the
attribute megatron-core's ``finalize_model_grads`` uses to all-reduce such gradients across the TP group.
The same holds for the per-head q/k norms, whose heads are split over the TP ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sftprof.models.layers.op_inputs import FLOAT_DTYPES, check_tensor

__all__ = ["FUSED_MAX_D", "RMSNorm", "fused_path", "rms_norm"]

FUSED_MAX_D = 8192  # widest row (last dim) the Triton kernels take in one tile (16384 spills registers on sm_90)
_DTYPES = FLOAT_DTYPES + (torch.float64,)  # fp64: the torch path, on any device


def fused_path(device: torch.device, x_dtype: torch.dtype, weight_dtype: torch.dtype, d: int) -> bool:
    """Whether :func:`rms_norm` runs the Triton kernels for an ``x`` ``[..., d]`` of ``x_dtype`` and a weight of
    ``weight_dtype`` on ``device``: CUDA, ``d <= FUSED_MAX_D``, both dtypes bf16/fp16/fp32
    (:data:`sftprof.models.layers.op_inputs.FLOAT_DTYPES`, what the kernels load and store). Otherwise (fp64 included) the
    unfused torch computation, with the same semantics."""
    return (device.type == "cuda" and d <= FUSED_MAX_D and x_dtype in FLOAT_DTYPES
            and weight_dtype in FLOAT_DTYPES)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[M, D]`` rows: a view when the leading dims collapse into one row stride (with the last dim
    contiguous), else one contiguous copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims that no single row stride addresses (e.g. a transposed [S, H] pair)
        return t.reshape(-1, t.shape[-1])


class _FusedRMSNorm(torch.autograd.Function):
    """The Triton path (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); inputs checked by the caller."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered):
        from sftprof.models.layers import norm_kernels

        rows = _rows(x)
        ctx.save_for_backward(rows, weight)
        ctx.eps, ctx.zero_centered = eps, zero_centered
        return norm_kernels.rms_norm_forward(rows, weight, eps, zero_centered).view(x.shape)

    @staticmethod
    def backward(ctx, d_y):
        from sftprof.models.layers import norm_kernels

        rows, weight = ctx.saved_tensors
        d_x, d_w = norm_kernels.rms_norm_backward(rows, weight, _rows(d_y), ctx.eps, ctx.zero_centered)
        return d_x.view(d_y.shape), d_w.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim: ``x / sqrt(mean(x**2, -1) + eps) * g``, ``g = weight`` or ``1 + weight``.

    Args:
        x: ``[..., D]`` bf16/fp16/fp32/fp64; any strides (see the module docstring for which are read in place on
            CUDA).
        weight: ``[D]`` bf16/fp16/fp32/fp64 on ``x``'s device (megatron's params dtype; it may differ from ``x``'s).
        eps: added to the mean square.
        zero_centered_gamma: ``g = 1 + weight``.
    Returns:
        ``[..., D]`` in ``x``'s dtype, differentiable in ``x`` and ``weight`` (``dweight`` in ``weight``'s dtype).
        Triton kernels where :func:`fused_path` says so (CUDA, ``D <= FUSED_MAX_D``, no fp64);
        ``torch.nn.functional.rms_norm`` otherwise (the module docstring gives how their roundings differ).
    Raises:
        ValueError: ``x`` or ``weight`` not a tensor of an accepted dtype, ``weight`` on another device
            (:func:`sftprof.models.layers.op_inputs.check_tensor`); ``x`` without dimensions or ``weight`` not ``[D]``
            with ``D = x.shape[-1] >= 1``.
    """
    check_tensor("rms_norm", "x", x, _DTYPES)
    check_tensor("rms_norm", "weight", weight, _DTYPES, device=x.device)
    if x.dim() < 1 or x.shape[-1] < 1 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm: x must be [..., D] and weight [D] with D >= 1, got x {tuple(x.shape)} "
                         f"weight {tuple(weight.shape)}")
    if fused_path(x.device, x.dtype, weight.dtype, x.shape[-1]):
        return _FusedRMSNorm.apply(x, weight, float(eps), bool(zero_centered_gamma))
    gamma = weight + 1 if zero_centered_gamma else weight
    return F.rms_norm(x, (x.shape[-1],), gamma.to(x.dtype), eps)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with sequence-parallel marking and optional zero-centred gamma.

    Constructor arguments follow megatron-core's norm modules (``build_module(spec, config=,
    hidden_size=, eps=)``).

    Args:
        config: megatron ``TransformerConfig`` (``normalization``, ``sequence_parallel``,
            ``layernorm_zero_centered_gamma``, ``params_dtype``, ``use_cpu_initialization``).
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square.
        zero_centered_gamma: force zero-centred gamma (else from the config).
    Shapes:
        input ``[..., hidden_size]`` (e.g. ``[s, b, h]`` or ``[s, b, heads, head_dim]``), output the same
        shape and dtype.
    Raises:
        ValueError: ``config.normalization`` is not ``"RMSNorm"``; in ``forward``, what :func:`rms_norm` raises.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"sftprof RMSNorm: config.normalization={config.normalization!r}; accepted: 'RMSNorm'")
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = bool(zero_centered_gamma or config.layernorm_zero_centered_gamma)
        use_cuda = torch.cuda.is_available() and not config.use_cpu_initialization
        device = torch.cuda.current_device() if use_cuda else "cpu"
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        # Partial gradients per TP rank under sequence parallelism: all-reduced by finalize_model_grads.
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden_size]`` -> the same shape in ``x``'s dtype, by :func:`rms_norm` (Triton on CUDA)."""
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)
