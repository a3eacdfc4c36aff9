"""The fused MoE router top-k (:mod:`sftprof.models.layers.router`) against megatron-core 0.16.1's unfused
``topk_routing_with_score_function`` / ``compute_routing_scores_for_aux_loss``.

The Triton kernel runs on CUDA, or on CPU tensors under Triton's interpreter: ``PYTHONPATH=<numpy 2>:<triton 3.5>:.
TRITON_INTERPRET=1 python -m pytest -q tests/test_router.py``; those tests skip where Triton is missing or the
interpreter is off without CUDA. The fallback to megatron's functions, the binding into megatron-core and a
``TopKRouter`` forward and backward with and without the binding run everywhere (on CPU under the interpreter that
router runs the kernel). GPU (``gpu`` mark): 32768 x 128 logits, fused against unfused.
"""
from __future__ import annotations

import importlib.util
import re
from unittest import mock

import pytest
import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as mrouter

from sftprof.models.layers import router
from sftprof.models.layers.router import compute_routing_scores_for_aux_loss, install_in_megatron, \
    topk_routing_with_score_function


DEVICE = "cuda" if torch.cuda.is_available() and importlib.util.find_spec("triton") else \
    "cpu" if router._kernel_runs_on(torch.empty(0)) else None
needs_kernel = pytest.mark.skipif(DEVICE is None, reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with triton "
                                                         "installed (see the module docstring)")


def _separated_logits(t, e, seed, device="cpu", gap=0.1):
    """``[T, E]`` fp32 logits whose values in a row are a shuffled ladder ``gap`` apart (+ jitter < gap / 10): the
    top-k of the logits and of their softmax is unique and far from any rounding."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.argsort(torch.rand(t, e, generator=g), dim=1).float()
    jitter = torch.rand(t, e, generator=g) * gap / 10
    return (ranks * gap - e * gap / 2 + jitter).to(device)


def _grad_of(fn, logits, probe):
    x = logits.clone().requires_grad_(True)
    out = fn(x)
    (out * probe).sum().backward()
    return out.detach(), x.grad


def _close(got, want, rtol):
    """``|got - want| <= rtol * max|want|`` elementwise: fp32 rounding of sums over a row of values <= 1."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item(), err


SHAPES = [(70, 128, 8), (37, 60, 4), (9, 512, 2), (5, 16, 16)]  # hot case; odd sizes; E at the limit; k = E


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pre_softmax", [False, True])
@pytest.mark.parametrize("scaling_factor", [None, 2.5])
def test_topk_routing_matches_megatron(shape, pre_softmax, scaling_factor):
    """Same routing map exactly; probs within fp32 rounding; gradients w.r.t. the logits as megatron's autograd
    gives them, for an upstream gradient on every ``[T, E]`` entry (off-map entries must contribute nothing)."""
    t, e, k = shape
    logits = _separated_logits(t, e, seed=t + e, device=DEVICE)
    probe = torch.randn(t, e, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kw = dict(use_pre_softmax=pre_softmax, scaling_factor=scaling_factor)
    with mock.patch.object(router._TopkRouting, "apply", wraps=router._TopkRouting.apply) as fused:
        p, m = topk_routing_with_score_function(logits, k, **kw)
        probs, d_logits = _grad_of(lambda x: topk_routing_with_score_function(x, k, **kw)[0], logits, probe)
    assert fused.call_count == 2
    p0, m0 = moe_utils.topk_routing_with_score_function(logits, k, **kw)
    probs0, d_logits0 = _grad_of(lambda x: moe_utils.topk_routing_with_score_function(x, k, **kw)[0], logits, probe)
    assert m.dtype == torch.bool and torch.equal(m, m0) and int(m.sum()) == t * k
    assert torch.equal(p, probs) and bool((p[~m] == 0).all())
    _close(p, p0, 2e-6)
    _close(d_logits, d_logits0, 2e-6)
    assert bool((d_logits[~m] == 0).all()) or pre_softmax  # pre-softmax: every logit moves the row's softmax


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padding", [False, True])
def test_aux_loss_scores_match_megatron(shape, padding):
    """Same routing map exactly; the full softmax and its gradient within fp32 rounding; padding tokens zeroed
    as megatron does."""
    t, e, k = shape
    logits = _separated_logits(t, e, seed=2 * t + e, device=DEVICE)
    probe = torch.randn(t, e, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    pad = (torch.arange(t) % 3 == 1).to(DEVICE) if padding else None
    with mock.patch.object(router._AuxScores, "apply", wraps=router._AuxScores.apply) as fused:
        m, s = compute_routing_scores_for_aux_loss(logits, k, "softmax", padding_mask=pad)
        scores, d_logits = _grad_of(
            lambda x: compute_routing_scores_for_aux_loss(x, k, "softmax", padding_mask=pad)[1], logits, probe)
    assert fused.call_count == 2
    m0, s0 = moe_utils.compute_routing_scores_for_aux_loss(logits, k, "softmax", padding_mask=pad)
    _, d_logits0 = _grad_of(
        lambda x: moe_utils.compute_routing_scores_for_aux_loss(x, k, "softmax", padding_mask=pad)[1], logits, probe)
    assert m.dtype == torch.bool and torch.equal(m, m0)
    assert int(m.sum()) == k * (t - (int(pad.sum()) if padding else 0))
    assert s.dtype == torch.float32 and torch.equal(s, scores)
    _close(s, s0, 2e-6)
    _close(d_logits, d_logits0, 2e-6)


@needs_kernel
def test_gradient_against_fp64_reference():
    """The fused gradients against the same math in fp64 (torch.topk of fp64 logits, fp64 softmaxes): both
    variants and the aux scores, relative to the largest gradient, within fp32 rounding."""
    t, e, k = 33, 128, 8
    logits = _separated_logits(t, e, seed=5, device=DEVICE)
    probe = torch.randn(t, e, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x64, probe64 = logits.double().cpu(), probe.double().cpu()

    def ref_routing(x, pre_softmax):
        scores = torch.softmax(x, dim=-1) if pre_softmax else x
        vals, idx = scores.topk(k, dim=1)
        probs = vals if pre_softmax else torch.softmax(vals, dim=-1)
        return torch.zeros_like(x).scatter(1, idx, probs)

    for pre_softmax in (False, True):
        _, got = _grad_of(lambda x: topk_routing_with_score_function(x, k, use_pre_softmax=pre_softmax)[0],
                          logits, probe)
        _, want = _grad_of(lambda x: ref_routing(x, pre_softmax), x64, probe64)
        assert (got.double().cpu() - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    _, got = _grad_of(lambda x: compute_routing_scores_for_aux_loss(x, k, "softmax")[1], logits, probe)
    _, want = _grad_of(lambda x: torch.softmax(x, dim=-1), x64, probe64)
    assert (got.double().cpu() - want).abs().max().item() <= 1e-6 * want.abs().max().item()


@needs_kernel
def test_ties_pick_the_lower_expert_index():
    """Equal logits: the lower expert index first (torch.topk's order among equal values is unspecified);
    a row of equal logits routes to experts 0..k-1 with probability 1/k each."""
    logits = torch.zeros(3, 16)
    logits[1, [3, 9, 12]] = 1.0  # three winners, then 13 equal logits for the fourth place: expert 0
    logits[2, 5] = float("-inf")  # -inf is a value like any other (picked last)
    logits = logits.to(DEVICE)
    probs, m = topk_routing_with_score_function(logits, 4)
    assert m.cpu().nonzero().tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 3], [1, 9], [1, 12],
                                          [2, 0], [2, 1], [2, 2], [2, 3]]
    assert probs[0].cpu()[:4].tolist() == [0.25] * 4
    _, m16 = topk_routing_with_score_function(logits, 16)
    assert bool(m16.all())
    m_aux, _ = compute_routing_scores_for_aux_loss(logits, 4, "softmax")
    assert torch.equal(m_aux, m)


@needs_kernel
def test_no_tokens():
    """A rank with no tokens: empty outputs of the right shapes and dtypes, and an empty gradient."""
    x = torch.zeros(0, 128, device=DEVICE, requires_grad=True)
    probs, m = topk_routing_with_score_function(x, 8)
    m_aux, scores = compute_routing_scores_for_aux_loss(x, 8, "softmax")
    assert (probs.shape, m.dtype, m_aux.shape, scores.dtype) == ((0, 128), torch.bool, (0, 128), torch.float32)
    (probs.sum() + scores.sum()).backward()
    assert x.grad.shape == (0, 128)


def _fallback_cases():
    """``(name, call)`` where the wrapper must run megatron's own function: ``call(fn)`` applies ``fn``."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 16, generator=g)
    bias = torch.randn(16, generator=g)
    wide = torch.randn(3, router.MAX_EXPERTS + 1, generator=g)
    return [
        ("sigmoid", lambda fn: fn(x, 4, score_function="sigmoid")),
        ("groups", lambda fn: fn(x, 4, num_groups=4, group_topk=2)),
        ("expert_bias", lambda fn: fn(x, 4, score_function="sigmoid", expert_bias=bias)),
        ("bf16 logits", lambda fn: fn(x.bfloat16(), 4)),
        ("fp64 logits", lambda fn: fn(x.double(), 4, use_pre_softmax=True)),
        ("E over the kernel's limit", lambda fn: fn(wide, 2)),
        ("1-D logits", lambda fn: fn(x[0], 4)),
    ]


@pytest.mark.parametrize("case", range(len(_fallback_cases())))
def test_unsupported_cases_run_megatron_exactly(case):
    """Where the kernel does not apply, the wrapper's results are megatron's exactly (or its error)."""
    name, call = _fallback_cases()[case]
    with mock.patch.object(router._TopkRouting, "apply") as fused:
        try:
            want = call(moe_utils.topk_routing_with_score_function)
        except (AssertionError, ValueError, RuntimeError) as err:
            with pytest.raises(type(err), match=re.escape(str(err))):
                call(topk_routing_with_score_function)
        else:
            got = call(topk_routing_with_score_function)
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want)), name
    assert fused.call_count == 0


def test_deterministic_mode_and_te_flag_run_megatron(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` and ``fused=True`` (TE's path: without TE megatron raises)
    both go to megatron's functions; the sigmoid aux-loss scores too."""
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(8))
    with mock.patch.object(router._TopkRouting, "apply") as fused, \
            mock.patch.object(router._AuxScores, "apply") as fused_aux:
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        for got, want in ((topk_routing_with_score_function(x, 4), moe_utils.topk_routing_with_score_function(x, 4)),
                          (compute_routing_scores_for_aux_loss(x, 4, "softmax"),
                           moe_utils.compute_routing_scores_for_aux_loss(x, 4, "softmax"))):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        monkeypatch.undo()
        got = compute_routing_scores_for_aux_loss(x, 4, "sigmoid")
        assert all(torch.equal(a, b) for a, b in zip(got, moe_utils.compute_routing_scores_for_aux_loss(
            x, 4, "sigmoid")))
        if not moe_utils.HAVE_TE:
            with pytest.raises(ValueError, match="fused_topk_with_score_function is not available"):
                topk_routing_with_score_function(x, 4, fused=True)
            with pytest.raises(ValueError, match="fused_compute_score_for_moe_aux_loss is not available"):
                compute_routing_scores_for_aux_loss(x, 4, "softmax", fused=True)
    assert fused.call_count == 0 and fused_aux.call_count == 0


@pytest.fixture
def restore_megatron_router():
    yield
    mrouter.topk_routing_with_score_function = moe_utils.topk_routing_with_score_function
    mrouter.compute_routing_scores_for_aux_loss = moe_utils.compute_routing_scores_for_aux_loss


def test_install_binds_idempotently_and_not_over_te(restore_megatron_router, monkeypatch):
    """Bound into ``megatron.core.transformer.moe.router`` (twice: the same), unbound with ``enable=False``, and
    with TE present megatron's names stay (its ``moe_router_fusion`` is the fused path there)."""
    monkeypatch.setattr(moe_utils, "HAVE_TE", False)
    for _ in range(2):
        assert install_in_megatron() is True
        assert mrouter.topk_routing_with_score_function is topk_routing_with_score_function
        assert mrouter.compute_routing_scores_for_aux_loss is compute_routing_scores_for_aux_loss
    assert install_in_megatron(enable=False) is False
    assert mrouter.topk_routing_with_score_function is moe_utils.topk_routing_with_score_function
    assert mrouter.compute_routing_scores_for_aux_loss is moe_utils.compute_routing_scores_for_aux_loss
    monkeypatch.setattr(moe_utils, "HAVE_TE", True)
    assert install_in_megatron() is False
    assert mrouter.topk_routing_with_score_function is moe_utils.topk_routing_with_score_function


def test_training_config_kwargs_binds_per_setting(restore_megatron_router, monkeypatch):
    """``actor.megatron.moe_fused_router`` decides the binding each time the config is built (no TE here)."""
    from sftprof.config import load_config
    from sftprof.models import megatron_config as mc

    monkeypatch.setattr(moe_utils, "HAVE_TE", False)
    no_pao = ["actor.megatron.use_precision_aware_optimizer=false", "actor.megatron.main_grads_dtype=float32"]
    mc.training_config_kwargs(load_config("qwen3_30b_a3b_sft_profile.yaml", no_pao), have_te=False)
    assert mrouter.topk_routing_with_score_function is topk_routing_with_score_function
    mc.training_config_kwargs(load_config("qwen3_30b_a3b_sft_profile.yaml",
                                          no_pao + ["actor.megatron.moe_fused_router=false"]), have_te=False)
    assert mrouter.topk_routing_with_score_function is moe_utils.topk_routing_with_score_function
    mc.training_config_kwargs(load_config("qwen3_30b_a3b_sft_profile.yaml", no_pao), have_te=True)
    assert mrouter.compute_routing_scores_for_aux_loss is moe_utils.compute_routing_scores_for_aux_loss


# ----------------------------------------------------------------------------------------------------------------
# megatron-core's TopKRouter with and without the binding (CPU, one gloo rank)


@pytest.fixture(scope="module")
def mcore_cpu(tmp_path_factory):
    from fixtures.megatron_cpu import megatron_cpu

    with megatron_cpu(tmp_path_factory.mktemp("store") / "filestore"):
        yield


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_topk_router_same_results_with_and_without_install(mcore_cpu, restore_megatron_router, monkeypatch,
                                                           pre_softmax):
    """A ``TopKRouter`` (64 experts, top-6, fp32 router, aux loss and z-loss on) gives the same probs, routing map
    and gradients (input and router weight; the aux loss's included) bound and unbound. The bound functions run
    (two calls per forward); under Triton's interpreter they run the kernel, elsewhere megatron's code."""
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    monkeypatch.setattr(moe_utils, "HAVE_TE", False)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16, num_moe_experts=64,
        moe_router_topk=6, moe_router_pre_softmax=pre_softmax, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(11, 3, 32, generator=g)
    probe = torch.randn(33, 64, generator=g)
    results = {}
    for on in (True, False):
        install_in_megatron(enable=on)
        torch.manual_seed(3)
        r = TopKRouter(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        r.set_layer_number(1)
        xi = x.clone().requires_grad_(True)
        with mock.patch.object(router, "fused_router_applies", wraps=router.fused_router_applies) as applies, \
                mock.patch.object(router._TopkRouting, "apply", wraps=router._TopkRouting.apply) as fused:
            probs, routing_map = r(xi)
            (probs * probe).sum().backward()
        results[on] = (applies.call_count, fused.call_count, probs.detach(), routing_map, xi.grad, r.weight.grad)
    assert results[False][:2] == (0, 0)
    assert results[True][:2] == (2, 1 if DEVICE == "cpu" else 0)
    (*_, p_on, m_on, dx_on, dw_on), (*_, p_off, m_off, dx_off, dw_off) = results[True], results[False]
    assert torch.equal(m_on, m_off) and int(m_on.sum()) == 33 * 6
    for got, want in ((p_on, p_off), (dx_on, dx_off), (dw_on, dw_off)):
        _close(got, want, 2e-6)


# ----------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_fused_router_on_gpu_matches_megatron_at_scale():
    """32768 x 128 fp32 logits of a trained-router scale (randn * 2), top-8: same routing maps (on the rows where
    the top-k is unique), probs within 1e-6 relative, scores and gradients within fp32 rounding, both pre-softmax
    settings and the aux scores."""
    t, e, k = 131072 // 4, 128, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(t, e, generator=g, device="cuda") * 2
    probe = torch.randn(t, e, generator=g, device="cuda")
    # rows whose k-th and (k+1)-th logits are apart by more than fp32 rounding of their softmax can tell (all but
    # a few of the 32768): there the routing is unique; elsewhere torch.topk's order among equal scores decides
    top = logits.topk(k + 1, dim=1).values
    clear = (top[:, k - 1] - top[:, k]) > 1e-5
    assert int(clear.sum()) >= t - 16
    for pre_softmax in (False, True):
        kw = dict(use_pre_softmax=pre_softmax)
        probs, d = _grad_of(lambda x: topk_routing_with_score_function(x, k, **kw)[0], logits, probe)
        probs0, d0 = _grad_of(lambda x: moe_utils.topk_routing_with_score_function(x, k, **kw)[0], logits, probe)
        m = topk_routing_with_score_function(logits, k, **kw)[1]
        m0 = moe_utils.topk_routing_with_score_function(logits, k, **kw)[1]
        assert torch.equal(m[clear], m0[clear]) and int(m.sum()) == t * k
        on = (probs0 > 0) & clear[:, None]
        assert ((probs - probs0).abs()[on] / probs0[on]).max().item() <= 1e-6
        _close(d[clear], d0[clear], 1e-5)
    scores, d = _grad_of(lambda x: compute_routing_scores_for_aux_loss(x, k, "softmax")[1], logits, probe)
    scores0, d0 = _grad_of(lambda x: moe_utils.compute_routing_scores_for_aux_loss(x, k, "softmax")[1], logits, probe)
    assert torch.equal(compute_routing_scores_for_aux_loss(logits, k, "softmax")[0][clear],
                       moe_utils.compute_routing_scores_for_aux_loss(logits, k, "softmax")[0][clear])
    _close(scores, scores0, 1e-6)
    _close(d, d0, 1e-5)

