"""Grouped-GEMM MoE experts on ``torch._grouped_mm`` (no Transformer Engine, no grouped_gemm package).

megatron-core without TE runs local experts as ``SequentialMLP``, a Python loop with one small GEMM
per expert and step. :class:`GroupedGemmExperts` runs all local experts of a layer in two grouped
GEMMs (fc1 and fc2), measured on an H200 at ~737 TFLOP/s for 128 experts x 2048 tokens x
[2048 -> 1536] (``shared/device/README.md``). ``SequentialMLP`` stays the fallback
(:func:`grouped_mm_supported`).

Per expert ``e`` with tokens ``x_e`` (rows ``offs[e-1]:offs[e]`` of the permuted input) and router
probabilities ``p_e``: ``y_e = (silu(x_e W1g_e) * (x_e W1u_e) * p_e) W2_e`` (SwiGLU; Shazeer 2020,
"GLU Variants Improve Transformer"), the same computation as megatron-core's experts with
``gated_linear_unit=True`` and probabilities applied after the activation. With ``silu`` the activation and
the multiply by ``p_e`` are one fused op (:func:`sftprof.models.layers.swiglu.swiglu_with_probs`).

Weights: ``weight1 [E_local, hidden, 2 * ffn / ETP]`` (gate half then up half of this ETP rank's
shard) and ``weight2 [E_local, ffn / ETP, hidden]``; bf16. The expert-TP partial sums of fc2 are
reduced by the token dispatcher, as for megatron-core's own grouped experts.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sftprof.models.layers.swiglu import swiglu_with_probs


def grouped_mm_supported(config) -> bool:
    """True when :class:`GroupedGemmExperts` can run: ``torch._grouped_mm`` exists, a CUDA device of compute
    capability >= 9.0 (Hopper) is present, bf16 params, SwiGLU or no GLU with silu/gelu, no expert bias."""
    if not hasattr(torch, "_grouped_mm") or not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability()
    return (major >= 9 and config.bf16 and not config.add_bias_linear
            and config.activation_func in (F.silu, F.gelu) and not config.moe_apply_probs_on_input)


class GroupedGemmExperts(torch.nn.Module):
    """All local experts of one MoE layer as two ``torch._grouped_mm`` calls.

    Constructor arguments follow megatron-core's experts (``build_module(spec, num_local_experts, config,
    pg_collection=...)``; ``name``, the module's path that megatron-core >= 0.18 passes, is not used).

    Forward:
        permuted_local_hidden_states ``[T, hidden]`` bf16, tokens sorted by local expert;
        tokens_per_expert ``[E_local]`` int (CPU or CUDA); permuted_probs ``[T]`` router weights.
        Returns ``([T, hidden] bf16, None)`` (no bias).
    Raises:
        ValueError: at construction, for settings this module does not implement (see
            :func:`grouped_mm_supported`).
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: Optional[str] = None) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu

        if not grouped_mm_supported(config):
            raise ValueError("GroupedGemmExperts needs torch._grouped_mm on a CUDA device of compute capability "
                             ">= 9.0, bf16, no linear bias, silu/gelu and moe_apply_probs_on_input=False; "
                             "use SequentialMLP otherwise (sftprof.models.specs picks it automatically)")
        self.config = config
        self.num_local_experts = num_local_experts
        etp = pg_collection.expt_tp.size() if pg_collection is not None else config.expert_tensor_parallel_size
        if config.moe_ffn_hidden_size % etp:
            raise ValueError(f"moe_ffn_hidden_size {config.moe_ffn_hidden_size} not divisible by expert TP {etp}")
        ffn = config.moe_ffn_hidden_size // etp
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        dev = torch.cuda.current_device()
        h = config.hidden_size
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, h, fc1_out, device=dev, dtype=config.params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, ffn, h, device=dev, dtype=config.params_dtype))
        if config.perform_initialization:
            _initialize_affine_weight_gpu(self.weight1, config.init_method, partition_dim=2, is_expert=True)
            _initialize_affine_weight_gpu(self.weight2, config.output_layer_init_method, partition_dim=1,
                                          is_expert=True)
        # Megatron DDP reduces params with allreduce=False over the expert-data-parallel group.
        expert_parallel = config.expert_model_parallel_size > 1
        for w in (self.weight1, self.weight2):
            setattr(w, "allreduce", not expert_parallel)

    def _activation(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        act = self.config.activation_func
        if self.config.gated_linear_unit and act is F.silu:
            return swiglu_with_probs(fc1, probs)  # one fused pass each way (sftprof.models.layers.swiglu)
        if self.config.gated_linear_unit:
            gate, up = fc1.chunk(2, dim=-1)
            out = act(gate) * up
        else:
            out = act(fc1)
        return (out * probs.unsqueeze(-1)).to(fc1.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if x.shape[0] == 0:
            # No token for the local experts: keep the weights in the graph so their grads exist (zeros).
            h = self._activation(x @ self.weight1[0], permuted_probs)
            return h @ self.weight2[0], None
        offs = torch.cumsum(tokens_per_expert.to(device=x.device), dim=0, dtype=torch.int32)
        fc1 = torch._grouped_mm(x, self.weight1, offs=offs)
        inter = self._activation(fc1, permuted_probs)
        return torch._grouped_mm(inter, self.weight2, offs=offs), None

    def backward_dw(self) -> None:
        """No deferred weight-gradient computation (interface of megatron-core experts)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """Not implemented: distributed checkpointing of these experts is not needed for profiling.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("GroupedGemmExperts does not support megatron distributed checkpoints")
