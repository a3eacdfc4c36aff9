"""sftprof.models.layers.rope: the fused RoPE that stands in for Transformer Engine's in megatron-core.

CPU: the torch path against megatron-core's unfused ``_apply_rotary_pos_emb_bshd`` in fp64 (values and, via
autograd, gradients), partial rotary, per-batch angles, bad inputs, and megatron-core's ``apply_rotary_pos_emb``
routing to it with ``apply_rope_fusion``. GPU (``gpu`` mark): the Triton kernel against the same fp64 reference.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from sftprof.models.layers.rope import fused_apply_rotary_pos_emb, install_in_megatron

CASES = [  # (S, B, H, D, R, freqs batch): full rotary; partial rotary (Qwen3.5's 0.25 of 256 = 64); per-batch angles
    (33, 1, 4, 16, 16, 1), (17, 2, 3, 32, 8, 1), (9, 2, 5, 20, 6, 2)]


def _problem(s, b, h, d, r, fb, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(s, b, h, d, generator=g, device=device).to(dtype)
    freqs = torch.rand(s, fb, 1, r, generator=g, device=device) * 60.0  # angles of many turns, as at 128K tokens
    d_out = torch.randn(s, b, h, d, generator=g, device=device).to(dtype)
    return t, freqs, d_out


def _check(t, freqs, d_out):
    """Values and d t against megatron-core's unfused RoPE run in fp64 on the same (rounded) inputs; bound: one
    rounding to ``t``'s dtype (fp32 math inside) plus fp32 cos/sin of angles up to 60 rad."""
    x = t.clone().requires_grad_()
    out = fused_apply_rotary_pos_emb(x, freqs)
    out.backward(d_out)
    x64 = t.double().requires_grad_()
    ref = rope_utils._apply_rotary_pos_emb_bshd(x64, freqs.double())
    ref.backward(d_out.double())
    eps = {torch.bfloat16: 2 ** -8, torch.float32: 2 ** -18, torch.float64: 1e-12}[t.dtype]
    for got, want in ((out, ref), (x.grad, x64.grad)):
        assert got.dtype == t.dtype and got.shape == t.shape
        err = (got.double() - want).abs()
        assert bool((err <= eps * (want.abs() + 1.0)).all()), float(err.max())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_path_matches_megatron_unfused(case, dtype):
    _check(*_problem(*case, dtype))


def test_partial_rotary_passes_the_rest_through_exactly():
    t, freqs, d_out = _problem(5, 1, 2, 12, 4, 1, torch.bfloat16)
    x = t.clone().requires_grad_()
    fused_apply_rotary_pos_emb(x, freqs).backward(d_out)
    assert torch.equal(fused_apply_rotary_pos_emb(t, freqs)[..., 4:], t[..., 4:])
    assert torch.equal(x.grad[..., 4:], d_out[..., 4:])


@pytest.mark.parametrize("kwargs, match", [
    (dict(t=(4, 1, 2, 8), freqs=(4, 1, 1, 7)), "R even and <= D"),
    (dict(t=(4, 1, 2, 8), freqs=(4, 1, 1, 10)), "R even and <= D"),
    (dict(t=(4, 1, 2, 8), freqs=(3, 1, 1, 8)), "got t \\(4, 1, 2, 8\\) freqs \\(3, 1, 1, 8\\)"),
    (dict(t=(4, 8), freqs=(4, 1, 1, 8)), "must be \\[S, B, H, D\\]"),
    (dict(t=(4, 1, 2, 8), freqs=(4, 1, 1, 8), interleaved=True), "interleaved=False"),
])
def test_bad_inputs_raise(kwargs, match):
    t, f = torch.zeros(kwargs.pop("t")), torch.zeros(kwargs.pop("freqs"))
    with pytest.raises(ValueError, match=match):
        fused_apply_rotary_pos_emb(t, f, **kwargs)


@pytest.mark.parametrize("t, freqs, match", [
    (torch.ones(4, 1, 2, 8, dtype=torch.int32), torch.zeros(4, 1, 1, 8),
     "t must be a torch.Tensor of torch.bfloat16 or torch.float16 or torch.float32 \\(also torch.float64 on cpu\\), got torch.int32 on cpu"),
    (torch.ones(4, 1, 2, 8), torch.zeros(4, 1, 1, 8, dtype=torch.int64),
     "freqs must be a torch.Tensor of torch.bfloat16 or torch.float16 or torch.float32 \\(also torch.float64 on cpu\\) on cpu, got torch.int64 on cpu"),
    (torch.ones(4, 1, 2, 8), torch.zeros(4, 1, 1, 8, device="meta"), "freqs must be .* on cpu, got torch.float32 on meta"),
])
def test_wrong_dtype_or_device_raise_before_any_kernel(t, freqs, match):
    """An integer t used to come back rotated and truncated to integers, silently."""
    with pytest.raises(ValueError, match="fused_apply_rotary_pos_emb: " + match):
        fused_apply_rotary_pos_emb(t, freqs)


def test_megatron_apply_rotary_pos_emb_routes_to_it(monkeypatch):
    install_in_megatron()
    calls = []

    def counting(t, freqs, interleaved=False):
        calls.append(tuple(t.shape))
        return fused_apply_rotary_pos_emb(t, freqs, interleaved=interleaved)

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", counting)
    t, freqs, _ = _problem(*CASES[1], torch.float32)
    cfg = SimpleNamespace(apply_rope_fusion=True, mrope_section=None, rotary_interleaved=False,
                          multi_latent_attention=False)
    out = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cp_group=SimpleNamespace())
    assert calls == [tuple(t.shape)]
    ref = rope_utils._apply_rotary_pos_emb_bshd(t.double(), freqs.double())
    assert float((out.double() - ref).abs().max()) <= 2 ** -18 * (float(ref.abs().max()) + 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_megatron_unfused(dtype):
    # Qwen3-30B-A3B's query (32 heads of 128) at 4096 tokens, and the small cases (partial rotary, per-batch angles)
    _check(*_problem(4096, 1, 32, 128, 128, 1, dtype, "cuda", seed=1))
    for case in CASES:
        _check(*_problem(*case, dtype, "cuda", seed=2))
