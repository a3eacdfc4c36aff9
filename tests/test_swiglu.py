"""sftprof.models.layers.swiglu: the fused SwiGLU-with-probabilities op of the grouped-GEMM experts.

CPU: the torch path against fp64 autograd of the unfused expression (gradcheck), bf16 rounding bounds, bad
inputs. GPU (``gpu`` mark): the Triton kernels against the same fp64 reference at the experts' real shape.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sftprof.models.layers.swiglu import swiglu_with_probs


def _unfused64(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    gate, up = fc1.double().chunk(2, dim=-1)
    return F.silu(gate) * up * probs.double().unsqueeze(-1)


def _problem(m: int, f: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    fc1 = (torch.randn(m, 2 * f, generator=g, device=device) * 2).to(dtype)
    probs = torch.rand(m, generator=g, device=device)
    d_out = torch.randn(m, f, generator=g, device=device).to(dtype)
    return fc1, probs, d_out


def _check_against_fp64(fc1, probs, d_out):
    """Output, d fc1 and d probs of the op against fp64 autograd of the unfused expression on the same
    (rounded) inputs; bound: one rounding to ``fc1``'s dtype of each stored element (fp32 math inside)."""
    a, p = fc1.clone().requires_grad_(), probs.clone().requires_grad_()
    out = swiglu_with_probs(a, p)
    out.backward(d_out)
    a64, p64 = fc1.double().requires_grad_(), probs.double().requires_grad_()
    ref = _unfused64(a64, p64)
    ref.backward(d_out.double())
    eps = {torch.bfloat16: 2 ** -8, torch.float32: 2 ** -20}[fc1.dtype]
    assert out.dtype == fc1.dtype and a.grad.dtype == fc1.dtype and p.grad.dtype == probs.dtype
    for got, want in ((out, ref), (a.grad, a64.grad)):
        err = (got.double() - want).abs()
        assert bool((err <= eps * want.abs() + 1e-6 * float(want.abs().max())).all()), float(err.max())
    # d probs is a fp32 sum over F terms: relative to the sum of the terms' magnitudes
    gate, up = fc1.double().chunk(2, dim=-1)
    scale = (d_out.double() * F.silu(gate) * up).abs().sum(-1)
    assert bool(((p.grad.double() - p64.grad).abs() <= 2 ** -20 * scale + 1e-12).all())


def test_cpu_path_gradcheck_fp64():
    fc1, probs, _ = _problem(7, 5, torch.float64)
    assert torch.autograd.gradcheck(swiglu_with_probs, (fc1.requires_grad_(), probs.double().requires_grad_()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_fp64(dtype):
    _check_against_fp64(*_problem(64, 48, dtype))


@pytest.mark.parametrize("fc1_shape, probs_shape, match", [
    ((4, 7), (4,), "contiguous \\[M, 2F\\] tensor, got shape \\(4, 7\\)"),
    ((4, 6, 1), (4,), "contiguous \\[M, 2F\\] tensor, got shape \\(4, 6, 1\\)"),
    ((4, 6), (4, 1), "probs must be \\[4\\], got \\(4, 1\\)"),
])
def test_bad_inputs_raise(fc1_shape, probs_shape, match):
    with pytest.raises(ValueError, match=match):
        swiglu_with_probs(torch.zeros(fc1_shape), torch.zeros(probs_shape))


def test_non_contiguous_fc1_raises():
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_with_probs(torch.zeros(6, 4).t(), torch.zeros(4))


@pytest.mark.parametrize("fc1, probs, match", [
    (torch.ones(4, 6, dtype=torch.int32), torch.ones(4), "fc1 must be a torch.Tensor of torch.bfloat16 or torch.float16 or torch.float32 \\(also torch.float64 on cpu\\), got torch.int32 on cpu"),
    (torch.ones(4, 6), torch.ones(4, dtype=torch.int64),
     "probs must be a torch.Tensor of torch.bfloat16 or torch.float16 or torch.float32 \\(also torch.float64 on cpu\\) on cpu, got torch.int64 on cpu"),
    (torch.ones(4, 6), torch.ones(4, device="meta"), "probs must be .* on cpu, got torch.float32 on meta"),
    (torch.ones(4, 6), [1.0] * 4, "probs must be .* on cpu, got list"),
])
def test_wrong_dtype_device_or_type_raise_before_any_kernel(fc1, probs, match):
    """An integer fc1 used to come back as silently truncated integers; a probs on another device reached the
    Triton kernel on CUDA."""
    with pytest.raises(ValueError, match="swiglu_with_probs: " + match):
        swiglu_with_probs(fc1, probs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_fp64(dtype):
    # the experts' shape per ETP rank (ffn 768) and a ragged width (not a power of two, below one block)
    _check_against_fp64(*_problem(8192, 768, dtype, "cuda", seed=1))
    _check_against_fp64(*_problem(300, 100, dtype, "cuda", seed=2))
