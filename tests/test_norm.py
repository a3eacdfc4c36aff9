"""sftprof.models.layers.norm: the RMSNorm of the local megatron specs and its fused Triton path.

CPU: the module's torch path is unchanged (bit-identical to ``F.rms_norm`` with ``g`` rounded to ``x``'s dtype), the
torch path against fp64, sequence-parallel marking, which inputs are read in place, bad inputs. Triton CPU interpreter
(run with ``TRITON_INTERPRET=1`` and triton importable; skipped otherwise, e.g. in CI): the Triton kernels against
fp64 autograd, fp32 only (the interpreter truncates instead of rounding when it stores bf16). GPU (``gpu`` mark): the
Triton kernels in bf16 and fp32 against fp64 at the query/key norms' and the hidden norms' shapes.
"""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sftprof.models.layers.norm import FUSED_MAX_D, RMSNorm, _FusedRMSNorm, _rows, fused_path, rms_norm

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="Triton CPU interpreter: needs triton importable and TRITON_INTERPRET=1")

# one rounding of a stored element to the dtype, with margin (half an ulp: 2^-9 bf16, 2^-12 fp16, 2^-24 fp32), plus
# fp32 rsqrt and products for fp32 outputs
REL = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -19, torch.float64: 1e-12}


def _config(**kw):
    base = dict(normalization="RMSNorm", sequence_parallel=False, layernorm_zero_centered_gamma=False,
                params_dtype=torch.float32, use_cpu_initialization=True)
    return SimpleNamespace(**{**base, **kw})


def _problem(shape, x_dtype, w_dtype, zero_centered, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=device) * 3).to(x_dtype)
    w = torch.randn(shape[-1], generator=g, device=device) * (0.1 if zero_centered else 1.0)
    dy = torch.randn(shape, generator=g, device=device).to(x_dtype)
    return x, w.to(w_dtype), dy


def _check(fn, x, w, dy, eps, zero_centered):
    """y, dx, dweight of ``fn(x, w, eps, zero_centered)`` against fp64 autograd on the same (rounded) inputs. Bounds:
    y one rounding (relative); dx one rounding plus fp32 error relative to the magnitudes of its two terms,
    ``r |g dy| + |x| r^3 mean|g dy x|``; dweight one rounding to the weight's dtype plus fp32 error relative to the
    sum of the magnitudes ``sum_rows |dy x r|``."""
    a, b = x.detach().requires_grad_(), w.detach().clone().requires_grad_()  # detach: keeps x's strides
    y = fn(a, b, eps, zero_centered)
    y.backward(dy)
    a64, b64, d64 = x.double().requires_grad_(), w.double().requires_grad_(), dy.double()
    g = 1 + b64 if zero_centered else b64
    r = torch.rsqrt(a64.pow(2).mean(-1, keepdim=True) + eps)
    y64 = a64 * r * g
    y64.backward(d64)
    x64, r, g = a64.detach(), r.detach(), g.detach()
    assert y.dtype == x.dtype and y.shape == x.shape and a.grad.dtype == x.dtype and b.grad.dtype == w.dtype
    gdx = (g * d64 * x64).abs().mean(-1, keepdim=True)
    dw_terms = (d64 * x64 * r).abs().reshape(-1, x.shape[-1]).sum(0)
    terms = {"y": (y, y64, REL[x.dtype], 0.0),
             "dx": (a.grad, a64.grad, REL[x.dtype], 2 ** -19 * (r * (g * d64).abs() + x64.abs() * r ** 3 * gdx)),
             "dweight": (b.grad, b64.grad, REL[w.dtype], 2 ** -19 * dw_terms)}
    for name, (got, want, rel, atol) in terms.items():
        err = (got.double() - want).abs()
        assert bool((err <= rel * want.abs() + atol).all()), (name, float(err.max()))


def _kv_slice(s, b, groups, head_dim, device="cpu", dtype=torch.float32):
    """The key as megatron-core splits it from the QKV projection: ``[s, b, groups, head_dim]``, a strided view of
    ``[s, b, groups, (8 + 2) head_dim]`` (8 query heads per group, then the key, then the value)."""
    qkv = torch.randn(s, b, groups, 10 * head_dim, device=device).to(dtype)
    return qkv[..., 8 * head_dim:9 * head_dim]


# --- torch path (CPU) ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("x_dtype, params_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.float32)])
def test_module_cpu_path_is_the_torch_expression(zero_centered, x_dtype, params_dtype):
    """The CPU forward and gradients are exactly those of the expression the module ran before the fused path."""
    norm = RMSNorm(_config(params_dtype=params_dtype), 96, eps=1e-6, zero_centered_gamma=zero_centered)
    with torch.no_grad():
        norm.weight.add_(torch.randn(96) * 0.1)
    x, _, dy = _problem((5, 3, 96), x_dtype, params_dtype, zero_centered)
    a = x.clone().requires_grad_()
    y = norm(a)
    y.backward(dy)
    w = norm.weight.detach().clone().requires_grad_()
    a2 = x.clone().requires_grad_()
    want = F.rms_norm(a2, (96,), (w + 1 if zero_centered else w).to(x_dtype), 1e-6)
    want.backward(dy)
    assert y.dtype == x_dtype and torch.equal(y, want)
    assert torch.equal(a.grad, a2.grad) and torch.equal(norm.weight.grad, w.grad)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_module_weight_init_and_sequence_parallel_mark(sequence_parallel, zero_centered):
    norm = RMSNorm(_config(sequence_parallel=sequence_parallel, layernorm_zero_centered_gamma=zero_centered,
                           params_dtype=torch.bfloat16), 8)
    assert norm.weight.sequence_parallel is sequence_parallel and norm.zero_centered_gamma is zero_centered
    init = torch.full((8,), 0.0 if zero_centered else 1.0, dtype=torch.bfloat16)
    assert norm.weight.dtype == torch.bfloat16 and torch.equal(norm.weight, init)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                               (torch.float32, torch.float64)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_torch_path_matches_fp64(x_dtype, w_dtype, zero_centered):
    """The unfused path (CPU, and on CUDA every input with fp64, see test_fused_path_decision) against fp64. (An fp64
    ``x`` with a narrower zero-centred weight carries the rounding of ``1 + weight`` to the weight's dtype, as this
    path always has: not an fp64 result.)"""
    _check(rms_norm, *_problem((37, 96), x_dtype, w_dtype, zero_centered), 1e-6, zero_centered)


def test_fused_path_decision():
    """The Triton kernels on CUDA for bf16/fp16/fp32 rows up to FUSED_MAX_D wide; fp64 x or weight (which the kernels
    do not load), wider rows and other devices take the torch path."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    assert [fused_path(cuda, d, d, 128) for d in dtypes] == [True, True, True, False]
    assert [fused_path(cuda, torch.bfloat16, d, 128) for d in dtypes] == [True, True, True, False]
    assert [fused_path(cuda, d, torch.float32, 128) for d in dtypes] == [True, True, True, False]
    assert fused_path(cuda, torch.bfloat16, torch.float32, FUSED_MAX_D)
    assert not fused_path(cuda, torch.bfloat16, torch.float32, FUSED_MAX_D + 1)
    assert [fused_path(cpu, d, d, 128) for d in dtypes] == [False] * 4


def test_rows_reads_a_key_slice_in_place_and_copies_only_when_it_must():
    k = _kv_slice(3, 2, 4, 16)
    rows = _rows(k)
    assert rows.data_ptr() == k.data_ptr() and rows.shape == (24, 16) and rows.stride() == (160, 1)
    q = torch.randn(3, 4, 2, 16).transpose(1, 2)  # [s, b, h, d] with b and h swapped in memory: no single row stride
    rows = _rows(q)
    assert rows.is_contiguous() and rows.data_ptr() != q.data_ptr() and torch.equal(rows, q.reshape(-1, 16))
    t = torch.randn(16, 6).t()  # last dim not contiguous
    rows = _rows(t)
    assert rows.stride() == (16, 1) and torch.equal(rows, t)


@pytest.mark.parametrize("x, w, match", [
    (torch.ones(4, 8, dtype=torch.int32), torch.ones(8),
     "rms_norm: x must be a torch.Tensor of torch.bfloat16 or torch.float16 or torch.float32 or torch.float64, "
     "got torch.int32 on cpu"),
    (torch.ones(4, 8), torch.ones(8, device="meta"), "rms_norm: weight must be .* on cpu, got torch.float32 on meta"),
    (torch.ones(4, 8), [1.0] * 8, "rms_norm: weight must be .* on cpu, got list"),
    (torch.ones(4, 8), torch.ones(7),
     "rms_norm: x must be \\[..., D\\] and weight \\[D\\] with D >= 1, got x \\(4, 8\\) weight \\(7,\\)"),
    (torch.ones(4, 0), torch.ones(0), "got x \\(4, 0\\) weight \\(0,\\)"),
    (torch.tensor(1.0), torch.ones(1), "got x \\(\\) weight \\(1,\\)"),
])
def test_bad_inputs_raise_before_any_kernel(x, w, match):
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, 1e-6)


def test_module_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="rms_norm: x must be \\[..., D\\] and weight \\[D\\] with D >= 1, "
                                         "got x \\(2, 5\\) weight \\(4,\\)"):
        RMSNorm(_config(), 4)(torch.ones(2, 5))


# --- Triton kernels under the CPU interpreter (fp32) ---------------------------------------------------------------

@interpreter
@pytest.mark.parametrize("shape, zero_centered, eps", [
    ((37, 128), False, 1e-6),  # rows of 128 (q/k norms): 8-row tiles forward, 4-row backward; 37 not a multiple
    ((5, 7, 128), True, 0.0),  # eps 0: the padding rows of the last tile must add nothing (no inf * 0)
    ((37, 2048), True, 1e-6),  # the hidden norms' width: 37 one-row tiles over the backward's 4 programs
    ((70, 96), False, 1e-5),  # widths that are not a power of 2
    ((9, 1000), True, 1e-6),
])
def test_triton_kernels_match_fp64(shape, zero_centered, eps):
    _check(_FusedRMSNorm.apply, *_problem(shape, torch.float32, torch.float32, zero_centered), eps, zero_centered)


@interpreter
def test_triton_kernels_bf16_weight_fp32_input():
    """megatron's weight in the params dtype (bf16) read as it is; dweight rounded once to bf16."""
    _check(_FusedRMSNorm.apply, *_problem((40, 128), torch.float32, torch.bfloat16, False), 1e-6, False)


@interpreter
def test_triton_kernels_strided_key_and_gradient():
    k = _kv_slice(5, 2, 4, 32)
    dy = torch.randn(5, 2, 4, 48)[..., 16:]  # a gradient read in place with its own row stride
    w = torch.randn(64)[::2]  # a strided weight
    _check(_FusedRMSNorm.apply, k, w, dy, 1e-6, False)


@interpreter
def test_triton_kernels_no_rows():
    a, b = torch.zeros(0, 3, 128, requires_grad=True), torch.ones(128, requires_grad=True)
    y = _FusedRMSNorm.apply(a, b, 1e-6, False)
    y.backward(torch.zeros(0, 3, 128))
    assert y.shape == (0, 3, 128) and a.grad.shape == (0, 3, 128) and torch.equal(b.grad, torch.zeros(128))


# --- GPU -----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_fp64_on_gpu(dtype):
    # Qwen3-30B-A3B at 8192 tokens: the query norm (32 heads of 128), the key norm as megatron hands it over (a strided
    # slice of the QKV output), the hidden norms (2048); zero-centred gamma (Qwen3.5); a ragged width
    for shape, zero_centered in (((8192, 32, 128), False), ((8192, 2048), False), ((8192, 2048), True),
                                 ((1000, 3, 1000), True)):
        _check(rms_norm, *_problem(shape, dtype, dtype, zero_centered, "cuda", seed=1), 1e-6, zero_centered)
    k = _kv_slice(8192, 1, 4, 128, "cuda", dtype)
    _check(rms_norm, k, torch.randn(128, device="cuda").to(dtype), torch.randn_like(k), 1e-6, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float64)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_fp64_on_gpu_takes_the_torch_path(x_dtype, w_dtype, zero_centered):
    """fp64 on CUDA (which the Triton kernels do not load) runs the unfused torch computation, against fp64."""
    x, w, dy = _problem((1000, 3, 128), x_dtype, w_dtype, zero_centered, "cuda", seed=2)
    assert type(rms_norm(x, w, 1e-6, zero_centered).grad_fn).__name__ != "_FusedRMSNormBackward"
    _check(rms_norm, x, w.requires_grad_(), dy, 1e-6, zero_centered)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_module_on_gpu_uses_the_fused_path_within_one_ulp_of_torch():
    """bf16 input and weight, not zero-centred: same formula and rounding order as torch's CUDA kernel; only the fp32
    sum of squares is ordered differently, so an output differs from torch's by at most one bf16 ulp."""
    norm = RMSNorm(_config(params_dtype=torch.bfloat16, use_cpu_initialization=False), 128)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(128, device="cuda"))
    x = torch.randn(4096, 32, 128, device="cuda").to(torch.bfloat16)
    got = norm(x)
    want = F.rms_norm(x, (128,), norm.weight, 1e-6)
    assert got.grad_fn is not None and type(got.grad_fn).__name__ == "_FusedRMSNormBackward"
    assert bool(((got.double() - want.double()).abs() <= 2 ** -7 * want.double().abs()).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("zero_centered", [False, True])
def test_fused_path_inside_torch_compile_matches_fp64(zero_centered):
    """Inside a ``torch.compile``'d function (megatron-core compiles parts of Qwen3.5's gated delta-net layers)
    Inductor hands ``eps`` to the Triton kernels as an fp64 scalar; the kernels keep their statistics in fp32, so they
    compile and stay within the fused path's bounds against fp64 (the eleventh session's kernels failed to compile
    there: "Loop-carried variable acc ... re-assigned to fp64")."""
    x, w, dy = _problem((4096, 2048), torch.bfloat16, torch.bfloat16, zero_centered, "cuda", seed=3)
    _check(torch.compile(rms_norm), x, w, dy, 1e-6, zero_centered)
