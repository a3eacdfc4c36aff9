"""RMSNorm for megatron-core layer specs without Transformer Engine.

megatron-core's torch norm wrapper (``WrappedTorchNorm``) refuses sequence parallelism, which MoE
training with TP > 1 requires, and zero-centred gamma, which Qwen3.5 uses. This module supports both.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; Qwen3's ``Qwen3MoeRMSNorm``):
``y = x / sqrt(mean(x**2, -1) + eps) * g`` with ``g = weight`` or, zero-centred,
``g = 1 + weight`` (weight initialised to 0; Qwen3-Next/Qwen3.5 ``RMSNorm``). The statistics are
computed in fp32 (``torch.nn.functional.rms_norm`` upcasts bf16 internally).

Under sequence parallelism each TP rank normalises a different slice of the tokens, so the weight's
gradient is partial per rank: the weight carries ``sequence_parallel = config.sequence_parallel``, the
attribute megatron-core's ``finalize_model_grads`` uses to all-reduce such gradients across the TP group.
The same holds for the per-head q/k norms, whose heads are split over the TP ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
        ValueError: ``config.normalization`` is not ``"RMSNorm"``.
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
        gamma = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.rms_norm(x, (self.hidden_size,), gamma.to(x.dtype), self.eps)
