"""CPU tests of sftprof.ops against an fp64 reference (tp = 1 in-process, tp = 2, 4 over gloo); the parity
helpers here are reused by tests/test_ops_gpu.py on CUDA/NCCL.

Every rank builds the same full problem from ``seed``; rank ``r`` of a TP group of size ``tp`` keeps
vocabulary rows ``[r V/tp, (r+1) V/tp)`` of the weight/logits and, with sequence parallelism, tokens
``[r N/tp, (r+1) N/tp)`` of the hidden states. The reference is the plain fp64 formula on the full,
unsplit problem (same dtype-rounded inputs).

Tolerances (stated here, used by all checks):
- fp32 inputs: log-probs/entropy ``atol 2e-5``; gradients ``rtol 1e-4`` and ``atol 1e-4 * max|ref|``.
- bf16 inputs: the LM-head paths round logits to bf16 (as Megatron's output layer does). The reference
  rounds its fp64 logits to bf16 too (straight-through gradient), so it is the exact gradient at the logits
  the op works from; without that, the rounding moves softmax probabilities by up to ``|logit| * 2**-9``
  relative and a rare seed exceeded the gradient tolerance. A bf16 GEMM can still round a logit one ulp
  the other way, so log-probs and entropy get ``atol 2**-7 * max|logit|``; from bf16 logits given as input
  they are exact up to fp32 (``atol 2e-5``). Gradients are bf16: ``rtol 2**-6`` and ``atol 2**-6 * max|ref|``.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sftprof.launch import free_port
from sftprof.ops import StaleBufferError, linear_logprobs, linear_sft_loss, vocab_parallel_logprobs
from sftprof.ops.vocab_softmax import SHIFT_MARGIN, sft_chunk_, shift_offset


def make_problem(seed: int, n: int, h: int, v: int, tp: int, device="cpu"):
    """Full-size fp64 problem: hidden [n,h], weight [v,h], labels [n] (incl. vocab-shard edges), upstream
    grads for log-probs and entropy (non-uniform, non-contiguous), per-token loss weights."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h ** 0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    vl = v // tp
    edges = sorted({0, v - 1} | {r * vl for r in range(1, tp)} | {r * vl - 1 for r in range(1, tp)})
    labels[: len(edges)] = torch.tensor(edges)
    g_lp = torch.randn(n, 3, generator=g, dtype=torch.float64)[:, 1]  # stride 3: non-contiguous
    g_ent = torch.randn(2 * n, generator=g, dtype=torch.float64)[::2]
    loss_weight = torch.rand(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) > 0.2)
    to = dict(device=device)
    return (hidden.to(**to), weight.to(**to), labels.to(**to), g_lp.to(**to), g_ent.to(**to),
            loss_weight.to(**to))


def reference(hidden, weight, labels, temperature, logits_dtype=None):
    """fp64 log-probs, entropy and logits of ``hidden @ weight.T / temperature`` (autograd-ready).

    ``logits_dtype``: round the logits to it, as the LM-head paths do (Megatron's output layer emits logits
    in the model dtype), with a straight-through gradient, so that the reference gradient is the exact
    gradient at the logits the op works from."""
    logits = hidden @ weight.t()
    if logits_dtype is not None:
        logits = logits + (logits.detach().to(logits_dtype).double() - logits.detach())
    logp_all = (logits / temperature).log_softmax(-1)
    logprob = logp_all.gather(1, labels[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprob, entropy, logits


def _tol(dtype, ref: torch.Tensor, logits_max: float | None = None, kind: str = "grad"):
    if kind == "value":
        if dtype == torch.bfloat16 and logits_max is not None:
            return dict(rtol=0, atol=2 ** -7 * max(logits_max, 1.0))
        return dict(rtol=0, atol=2e-5)
    scale = float(ref.abs().max()) or 1.0
    if dtype == torch.bfloat16:
        return dict(rtol=2 ** -6, atol=2 ** -6 * scale)
    return dict(rtol=1e-4, atol=1e-4 * scale)


def _close(actual, expected, what, **tol):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), msg=lambda m: f"{what}: {m}", **tol)


def check_all(rank: int, tp: int, group, seed: int, dtype: torch.dtype, *, n=240, h=32, v=2048, device="cpu",
              chunk_size=37, temperature=0.8, sequence_parallel_cases=(False, True)):
    """Run every op against the fp64 reference on this rank; raises AssertionError on mismatch."""
    hidden64, weight64, labels, g_lp, g_ent, lw = make_problem(seed, n, h, v, tp, device)
    hq, wq = hidden64.to(dtype), weight64.to(dtype)  # the inputs as the op sees them
    vl, nl = v // tp, n // tp
    rows, toks = slice(rank * vl, (rank + 1) * vl), slice(rank * nl, (rank + 1) * nl)

    # fp64 reference on the dtype-rounded inputs, gradients via autograd.
    rh, rw = hq.double().requires_grad_(), wq.double().requires_grad_()
    ref_lp, ref_ent, ref_logits = reference(rh, rw, labels, temperature, dtype)
    ref_gh, ref_gw = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (rh, rw))
    logits_max = float(ref_logits.detach().abs().max()) / temperature

    # 1) logits path: this rank's vocab shard of the logits, exact bf16/fp32 logits as input.
    logits_in = ref_logits.detach().to(dtype)
    z = logits_in.double().requires_grad_()
    zl = (z / temperature).log_softmax(-1)
    zlp, zent = zl.gather(1, labels[:, None]).squeeze(1), -(zl.exp() * zl).sum(-1)
    (ref_gz,) = torch.autograd.grad((zlp * g_lp).sum() + (zent * g_ent).sum(), z)
    shard = logits_in[:, rows].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(shard, labels, tp_group=group, chunk_size=chunk_size,
                                      temperature=temperature, return_entropy=True)
    _close(lp, zlp.detach(), "vocab_parallel_logprobs logprob", **_tol(dtype, zlp, kind="value"))
    _close(ent, zent.detach(), "vocab_parallel_logprobs entropy", **_tol(dtype, zent, kind="value"))
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    _close(shard.grad, ref_gz[:, rows], "vocab_parallel_logprobs d/dlogits", **_tol(dtype, ref_gz))

    for sp in sequence_parallel_cases if tp > 1 else (False,):
        tag = f"[sp={sp}]"
        h_in = (hq[toks] if sp else hq).clone().requires_grad_()
        w_in = wq[rows].clone().requires_grad_()
        ref_gh_mine = ref_gh[toks] if sp else ref_gh

        # 2) linear_logprobs (recompute path), log-prob + differentiable entropy.
        lp, ent = linear_logprobs(h_in, w_in, labels, tp_group=group, chunk_size=chunk_size,
                                  temperature=temperature, return_entropy=True, sequence_parallel=sp)
        _close(lp, ref_lp.detach(), f"linear_logprobs logprob {tag}", **_tol(dtype, ref_lp, logits_max, "value"))
        _close(ent, ref_ent.detach(), f"linear_logprobs entropy {tag}", **_tol(dtype, ref_ent, logits_max, "value"))
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        _close(h_in.grad, ref_gh_mine, f"linear_logprobs d/dhidden {tag}", **_tol(dtype, ref_gh))
        _close(w_in.grad, ref_gw[rows], f"linear_logprobs d/dweight {tag}", **_tol(dtype, ref_gw))

        # 2b) linear_logprobs with grad_in_hidden: the backward writes d/dhidden over a non-leaf hidden (as the
        # final norm's output is) and hands it on; under SP the gathered copy is reused, the shard left alone.
        src = (hq[toks] if sp else hq).clone().requires_grad_()
        h_nl = src * 1
        lp, ent = linear_logprobs(h_nl, w_in.detach(), labels, tp_group=group, chunk_size=chunk_size,
                                  temperature=temperature, return_entropy=True, sequence_parallel=sp,
                                  grad_in_hidden=True)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        _close(src.grad, ref_gh_mine, f"linear_logprobs grad_in_hidden d/dhidden {tag}", **_tol(dtype, ref_gh))
        if sp:
            assert torch.equal(h_nl.detach(), src.detach()), "SP: the caller's hidden shard must stay untouched"
        else:
            _close(h_nl.detach(), ref_gh_mine, f"linear_logprobs grad_in_hidden storage {tag}", **_tol(dtype, ref_gh))

        # 3) linear_sft_loss (gradients formed in forward), temperature 1, upstream scale != 1.
        rh2, rw2 = hq.double().requires_grad_(), wq.double().requires_grad_()
        sft_lp, _, _ = reference(rh2, rw2, labels, 1.0, dtype)
        ref_loss = -(sft_lp * lw).sum()
        ref_gh2, ref_gw2 = torch.autograd.grad(ref_loss * 1.7, (rh2, rw2))
        h_in.grad = w_in.grad = None
        loss = linear_sft_loss(h_in, w_in, labels, lw.to(dtype), tp_group=group, chunk_size=chunk_size,
                               sequence_parallel=sp)
        _close(loss, (-(sft_lp * lw.to(dtype).double()).sum()).detach(), f"linear_sft_loss value {tag}",
               rtol=0, atol=(2e-5 if dtype == torch.float32 else 2 ** -7 * max(logits_max * temperature, 1.0)) * n)
        (loss * 1.7).backward()
        _close(h_in.grad, ref_gh2[toks] if sp else ref_gh2, f"linear_sft_loss d/dhidden {tag}", **_tol(dtype, ref_gh2))
        _close(w_in.grad, ref_gw2[rows], f"linear_sft_loss d/dweight {tag}", **_tol(dtype, ref_gw2))

        # 3b) grad_in_hidden: d/dhidden written over a non-leaf hidden (as the final norm's output is) and handed
        # on as its gradient; under SP the gathered copy is reused and the caller's shard is left untouched.
        src = (hq[toks] if sp else hq).clone().requires_grad_()
        h_nl = src * 1
        loss = linear_sft_loss(h_nl, w_in.detach(), labels, (lw * 1.7).to(dtype), tp_group=group,
                               chunk_size=chunk_size, sequence_parallel=sp, grad_in_hidden=True)
        loss.backward()  # incoming gradient 1: the stored gradient is handed on unscaled
        ref_mine = ref_gh2[toks] if sp else ref_gh2
        _close(src.grad, ref_mine, f"linear_sft_loss grad_in_hidden d/dhidden {tag}", **_tol(dtype, ref_gh2))
        if sp:
            assert torch.equal(h_nl.detach(), src.detach()), "SP: the caller's hidden shard must stay untouched"
        else:
            _close(h_nl.detach(), ref_mine, f"linear_sft_loss grad_in_hidden storage {tag}", **_tol(dtype, ref_gh2))

        # 4) Megatron main_grad mode: fp32 accumulation into weight.main_grad. A Megatron DDP parameter
        # (grad_added_to_main_grad present) gets a placeholder gradient so that DDP's grad hook fires; a
        # plain parameter with only main_grad gets none.
        for megatron_param in (True, False):
            w_mg = wq[rows].clone().requires_grad_()
            prior = torch.randn(w_mg.shape, dtype=torch.float32, device=device)
            w_mg.main_grad = prior.clone()
            if megatron_param:
                w_mg.grad_added_to_main_grad = False
            fired = []
            w_mg.register_post_accumulate_grad_hook(lambda p: fired.append(None if p.grad is None else p.grad.shape))
            linear_sft_loss(h_in.detach(), w_mg, labels, lw * 1.7, tp_group=group, chunk_size=chunk_size,
                            sequence_parallel=sp).backward()
            if megatron_param:
                assert w_mg.grad_added_to_main_grad and fired == [w_mg.shape]
            else:
                assert w_mg.grad is None and fired in ([], [None])
            _close(w_mg.main_grad - prior, ref_gw2[rows], f"linear_sft_loss main_grad {tag}", **_tol(dtype, ref_gw2))


def fresh_seed() -> int:
    """A new seed every run (printed on failure through the assertion messages' test id)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_tp1(dtype):
    check_all(0, 1, None, fresh_seed(), dtype)


def test_parity_tp1_single_chunk_and_temperature_one():
    check_all(0, 1, None, fresh_seed(), torch.float32, chunk_size=0, temperature=1.0)


def check_sft_far_targets(seed: int, dtype: torch.dtype, *, n=96, h=16, v=700, device="cpu", chunk_size=40,
                          grad_in_hidden=False, strided_hidden=False):
    """linear_sft_loss where many targets lie more than SHIFT_MARGIN + shift_offset(v) nats below their row's
    maximum (the deferred-normalisation shift falls back to the row maximum there) and the rest do not: loss,
    d/dhidden and d/dweight against the fp64 reference with the tolerances of check_all.
    ``strided_hidden``: pass hidden as a transposed view (column stride n, not 1)."""
    hidden64, weight64, labels, _, _, lw = make_problem(seed, n, h, v, 1, device)
    temperature = 0.05  # x / T spans hundreds of nats
    hq, wq = hidden64.to(dtype), weight64.to(dtype)
    x = (hq.double() @ wq.double().t()).to(dtype).double() / temperature
    labels[::3] = x[::3].argmax(dim=1)  # a third of the rows: the target is the maximum (shift = target + ln V)
    gap = x.max(dim=1).values - x.gather(1, labels[:, None]).squeeze(1)
    far = int((gap > SHIFT_MARGIN + shift_offset(v)).sum())
    assert 0 < far < n, f"want both kinds of rows, got {far} of {n} beyond the margin"
    rh, rw = hq.double().requires_grad_(), wq.double().requires_grad_()
    ref_lp, _, _ = reference(rh, rw, labels, temperature, dtype)
    ref_loss = -(ref_lp * lw.to(dtype).double()).sum()
    ref_gh, ref_gw = torch.autograd.grad(ref_loss, (rh, rw))
    src = (hq.t().contiguous().t() if strided_hidden else hq.clone()).requires_grad_()
    assert (src.stride(1) != 1) == strided_hidden
    h_in = src * 1 if grad_in_hidden else src
    w_in = wq.clone().requires_grad_()
    loss = linear_sft_loss(h_in, w_in, labels, lw.to(dtype), chunk_size=chunk_size, temperature=temperature,
                           grad_in_hidden=grad_in_hidden)
    # fp32 sums of |log-prob| up to ~1e3 per token: relative 1e-6 (fp32 rounding of the sum); bf16: check_all's.
    value_tol = (dict(rtol=1e-6, atol=2e-5) if dtype == torch.float32
                 else _tol(dtype, ref_lp, float(x.abs().max()) * float(lw.sum()), "value"))
    _close(loss, ref_loss.detach(), "linear_sft_loss far targets: loss", **value_tol)
    loss.backward()
    _close(src.grad, ref_gh, "linear_sft_loss far targets: d/dhidden", **_tol(dtype, ref_gh))
    _close(w_in.grad, ref_gw, "linear_sft_loss far targets: d/dweight", **_tol(dtype, ref_gw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sft_loss_targets_far_below_the_row_max(dtype):
    check_sft_far_targets(fresh_seed(), dtype, grad_in_hidden=dtype == torch.bfloat16)


def check_minus_inf_logits(seed: int, dtype: torch.dtype, device="cpu", *, n=64, v=5000, h=48):
    """-inf logits (masked vocabulary entries) give p = 0 and no NaN.

    1. ``vocab_parallel_logprobs`` with about 10 % of the entries at -inf (never a label): log-probs, entropy
       and d/dlogits against fp64 (log_softmax; entropy with 0 log 0 = 0).
    2. ``sft_chunk_`` (the SFT loss's chunk step, both its paths: deferred for bf16/fp32, general for fp16)
       with some *targets* at -inf: log-prob -inf there, finite elsewhere; the gradient
       ``w / T (p - [j == y])`` and the ``[n, h]`` scaled rows finite and equal to fp64."""
    g = torch.Generator().manual_seed(seed)
    x64 = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, v, (n,), generator=g)
    masked = torch.rand(n, v, generator=g) < 0.1
    masked[torch.arange(n), labels] = False
    x64 = x64.masked_fill(masked, float("-inf")).to(dtype).double()  # the values the op sees
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    ref = x64.clone().requires_grad_()
    logp = (ref / 0.9).log_softmax(-1)
    ref_lp = logp.gather(1, labels[:, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp.masked_fill(masked, 0.0)).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), ref)
    logits = x64.to(dtype).to(device).requires_grad_()
    lp, ent = vocab_parallel_logprobs(logits, labels.to(device), chunk_size=24, temperature=0.9, return_entropy=True)
    (lp * g_lp.to(device) + ent * g_ent.to(device)).sum().backward()
    vtol = dict(rtol=0, atol=2 ** -7 * 4) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    _close(lp, ref_lp.detach(), f"{dtype} masked entries: log-probs", **vtol)
    _close(ent, ref_ent.detach(), f"{dtype} masked entries: entropy", **vtol)
    gtol = torch.bfloat16 if dtype == torch.float16 else dtype  # fp16 gradients: bf16's tolerance, as elsewhere
    _close(logits.grad, ref_grad, f"{dtype} masked entries: d/dlogits", **_tol(gtol, ref_grad))

    far = torch.arange(0, n, 7)  # targets at -inf
    x = x64.clone()
    x[far, labels[far]] = float("-inf")
    w = torch.rand(n, generator=g, dtype=torch.float64)
    p = (x / 0.9).softmax(-1)
    ref_g = (p - torch.nn.functional.one_hot(labels, v)) * (w / 0.9)[:, None]
    ref_lp = (x / 0.9).log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    src = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    lg, dst = x.to(dtype).to(device), torch.empty(n, h, dtype=dtype, device=device)
    lp, scale = sft_chunk_(lg, labels.to(device), w.float().to(device), 1 / 0.9, None, (src.to(device), dst))
    grad = lg.double() if scale is None else lg.double() * scale.double()[:, None]
    finite = torch.ones(n, dtype=torch.bool)
    finite[far] = False
    assert torch.isneginf(lp[far.to(device)]).all(), f"{dtype}: log-probs of -inf targets {lp[far.to(device)]}"
    _close(lp[finite.to(device)], ref_lp[finite], f"{dtype} -inf targets: other log-probs", **vtol)
    _close(grad, ref_g, f"{dtype} -inf targets: d/dlogits", **_tol(gtol, ref_g))
    if scale is not None:
        _close(dst, src.double() * scale.double().cpu()[:, None], f"{dtype} -inf targets: scaled rows",
               **_tol(dtype, src.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_minus_inf_logits_give_no_nan(dtype):
    check_minus_inf_logits(fresh_seed(), dtype)


def check_flat_row_shift_offset(device="cpu", v=1000):
    """The deferred path shifts by the target logit + ln V: for all-equal rows of V fp32 logits every written
    ``E_j`` is 1/V (the label column 1/V - S), ``S`` = 1 and the row scale is ``w / T`` (with shift ``t``
    alone they would be 1, V and ``w / (T V)``); the log-prob stays -ln V."""
    temperature = 2.0
    assert shift_offset(v) == pytest.approx(math.log(v), rel=1e-15)
    logits = torch.full((2, v), 3.0, device=device)
    w = torch.tensor([1.0, 0.5], device=device)
    lp, scale = sft_chunk_(logits, torch.tensor([0, 7], device=device), w, 1 / temperature, None)
    expect = torch.full((2, v), 1 / v)
    expect[0, 0] = expect[1, 7] = 1 / v - 1
    torch.testing.assert_close(logits.cpu(), expect, rtol=1e-6, atol=0)
    torch.testing.assert_close(scale, w / temperature, rtol=1e-6, atol=0)
    torch.testing.assert_close(lp.cpu(), torch.full((2,), -math.log(v)), rtol=1e-6, atol=0)


def test_sft_chunk_shift_offset_puts_a_flat_row_at_probability_scale():
    check_flat_row_shift_offset()


def test_sft_loss_fp16_stays_finite_and_exact():
    """fp16 cannot hold the deferred-normalisation values (up to e^30), so it takes the general path."""
    h = torch.tensor([[1.0]], dtype=torch.float16, requires_grad=True)
    w = torch.tensor([[0.0], [12.0]], dtype=torch.float16, requires_grad=True)
    linear_sft_loss(h, w, torch.tensor([0]), torch.ones(1, dtype=torch.float16), chunk_size=4096).backward()
    # p = softmax([0, 12]), label 0: d/dlogits = [p_0 - 1, p_1] = [-p_1, p_1]; d/dh = 12 p_1, d/dw = that * h.
    p1 = 1 / (1 + math.exp(-12.0))
    torch.testing.assert_close(h.grad.double(), torch.tensor([[12 * p1]], dtype=torch.float64), rtol=2 ** -10, atol=0)
    torch.testing.assert_close(w.grad.double(), torch.tensor([[-p1], [p1]], dtype=torch.float64), rtol=2 ** -10,
                               atol=0)
    hidden, weight, labels, _, _, lw = make_problem(fresh_seed(), 64, 16, 3000, 1)
    hq, wq = hidden.half().requires_grad_(), weight.half().requires_grad_()
    rh, rw = hq.double().requires_grad_(), wq.double().requires_grad_()
    ref_lp, _, _ = reference(rh, rw, labels, 1.0, torch.float16)
    ref_gh, ref_gw = torch.autograd.grad(-(ref_lp * lw.half().double()).sum(), (rh, rw))
    linear_sft_loss(hq, wq, labels, lw.half(), chunk_size=20).backward()
    _close(hq.grad, ref_gh, "fp16 d/dhidden", **_tol(torch.bfloat16, ref_gh))
    _close(wq.grad, ref_gw, "fp16 d/dweight", **_tol(torch.bfloat16, ref_gw))


def _gloo_worker(rank, world, port, seed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            check_all(rank, world, dist.group.WORLD, seed, dtype)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4])
def test_parity_tensor_parallel_gloo(tp):
    """tp ranks over gloo: vocab-parallel logits path, linear paths with and without sequence parallel."""
    mp.spawn(_gloo_worker, args=(tp, free_port(), fresh_seed()), nprocs=tp, join=True)


def _small(dtype=torch.float32, requires_grad=True):
    hidden, weight, labels, g_lp, g_ent, lw = make_problem(fresh_seed(), 64, 16, 300, 1)
    h, w = hidden.to(dtype).requires_grad_(requires_grad), weight.to(dtype).requires_grad_(requires_grad)
    return h, w, labels, g_lp, lw


def test_logits_backward_reuses_logits_storage():
    h, w, labels, g_lp, _ = _small()
    logits = (h @ w.t()).detach().requires_grad_()
    ptr = logits.data_ptr()
    (vocab_parallel_logprobs(logits, labels, chunk_size=16) * g_lp.float()).sum().backward()
    assert logits.grad.data_ptr() == ptr  # gradient written in place of the saved logits


def test_guard_in_place_modification_raises():
    h, w, labels, _, _ = _small()
    logits = (h @ w.t()).detach().requires_grad_()
    lp = vocab_parallel_logprobs(logits, labels, chunk_size=0)
    with torch.no_grad():
        logits.mul_(2.0)  # version counter moves
    with pytest.raises(StaleBufferError, match="modified in place"):
        lp.sum().backward()

    lp = linear_logprobs(h, w, labels, chunk_size=16)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(StaleBufferError, match="'weight' was modified in place"):
        lp.sum().backward()


def test_guard_storage_swap_raises():
    h, w, labels, _, _ = _small()
    logits = (h @ w.t()).detach().requires_grad_()
    lp = vocab_parallel_logprobs(logits, labels, chunk_size=0)
    logits.data = torch.zeros_like(logits)  # same tensor object, other storage, version unchanged
    with pytest.raises(StaleBufferError, match="no longer lives in the storage"):
        lp.sum().backward()

    lp = linear_logprobs(h, w, labels, chunk_size=16)
    h.untyped_storage().resize_(0)  # storage freed in place (as FSDP-style resharding does)
    with pytest.raises(StaleBufferError, match="'hidden' no longer lives in the storage"):
        lp.sum().backward()


@pytest.mark.parametrize("op", ["linear_sft_loss", "linear_logprobs"])
def test_grad_in_hidden_raises_when_another_node_saved_hidden(op):
    h, w, labels, _, lw = _small()
    x = h.detach().clone().requires_grad_()
    hidden = x.tanh()  # TanhBackward saves its output: a later in-place write must be caught, not used
    if op == "linear_sft_loss":
        loss = linear_sft_loss(hidden, w, labels, lw, chunk_size=16, grad_in_hidden=True)
    else:
        loss = linear_logprobs(hidden, w, labels, chunk_size=16, grad_in_hidden=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_sft_loss_second_backward_and_modified_gradient_storage_raise():
    h, w, labels, _, lw = _small()
    loss = linear_sft_loss(h, w, labels, lw, chunk_size=16)
    loss.backward(retain_graph=True)
    with pytest.raises(StaleBufferError, match="backward ran already"):
        loss.backward()
    x = h.detach().clone().requires_grad_()
    hidden = x * 1
    loss = linear_sft_loss(hidden, w, labels, lw, chunk_size=16, grad_in_hidden=True)
    with torch.no_grad():
        hidden.zero_()  # would silently zero the stored gradient
    with pytest.raises(StaleBufferError, match=r"'hidden \(it holds d loss / d hidden"):
        loss.backward()


def test_sft_loss_weight_gradient_is_minus_logprob():
    h, w, labels, _, lw = _small()
    lw = lw.clone().requires_grad_()
    (linear_sft_loss(h, w, labels, lw, chunk_size=10) * 2.5).backward()
    ref_lp, _, _ = reference(h.detach(), w.detach(), labels, 1.0)
    assert lw.grad.dtype == lw.dtype
    torch.testing.assert_close(lw.grad, (-2.5 * ref_lp).to(lw.dtype), rtol=1e-5, atol=1e-5)


def test_grad_in_hidden_needs_contiguous_hidden():
    h, w, labels, _, lw = _small()
    wide = torch.zeros(h.shape[0], 2 * h.shape[1], dtype=h.dtype, requires_grad=True)
    for fn in (lambda: linear_sft_loss(wide[:, : h.shape[1]], w, labels, lw, grad_in_hidden=True, chunk_size=4096),
               lambda: linear_logprobs(wide[:, : h.shape[1]], w, labels, grad_in_hidden=True, chunk_size=4096)):
        with pytest.raises(ValueError, match="grad_in_hidden=True needs a contiguous hidden"):
            fn()


def test_sft_loss_without_grad_matches_and_skips_gradients():
    h, w, labels, _, lw = _small()
    with torch.no_grad():
        loss = linear_sft_loss(h, w, labels, lw, chunk_size=10)
    ref_lp, _, _ = reference(h.detach(), w.detach(), labels, 1.0)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss.double(), -(ref_lp * lw).sum(), rtol=0, atol=2e-5 * 64)


def test_main_grad_requires_unit_upstream_gradient():
    h, w, labels, _, lw = _small()
    w.main_grad = torch.zeros_like(w)
    loss = linear_sft_loss(h, w, labels, lw, chunk_size=4096)
    with pytest.raises(ValueError, match="fold loss scaling"):
        (loss * 0.5).backward()
    # The refused backward leaves the gradient stored in hidden (grad_in_hidden) unscaled.
    x = h.detach().clone().requires_grad_()
    hidden = x * 1
    w.main_grad.zero_()
    loss = linear_sft_loss(hidden, w, labels, lw, grad_in_hidden=True, chunk_size=4096)
    stored = hidden.detach().clone()
    with pytest.raises(ValueError, match="fold loss scaling"):
        (loss * 0.5).backward()
    assert torch.equal(hidden.detach(), stored)


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=-1), "chunk_size must be >= 0"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(labels_shift=300), "labels must be global vocabulary ids"),
    (dict(labels_dtype=torch.int32), "labels must be int64"),
])
def test_bad_inputs_raise(kwargs, match):
    h, w, labels, _, lw = _small()
    labels = (labels + kwargs.pop("labels_shift", 0)).to(kwargs.pop("labels_dtype", torch.int64))
    kwargs = {"chunk_size": 0, **kwargs}  # the ops have no chunk size of their own
    for fn in (lambda: linear_logprobs(h, w, labels, **kwargs),
               lambda: linear_sft_loss(h, w, labels, lw, **kwargs),
               lambda: vocab_parallel_logprobs((h @ w.t()).detach(), labels, **kwargs)):
        with pytest.raises(ValueError, match=match):
            fn()


def test_mismatched_shapes_raise():
    h, w, labels, _, lw = _small()
    with pytest.raises(ValueError, match="share a dtype"):
        linear_logprobs(h, w.detach().bfloat16(), labels, chunk_size=4096)
    with pytest.raises(ValueError, match=r"loss_weight must be a float tensor of shape \(64,\)"):
        linear_sft_loss(h, w, labels, lw[:10], chunk_size=4096)
    with pytest.raises(ValueError, match="contiguous last dim"):
        vocab_parallel_logprobs((h @ w.t()).detach().t(), labels, chunk_size=0)


def _value_error(fn, *args, **kwargs) -> str | None:
    """The message of the ValueError ``fn`` raises (None if none; chunk size 0 unless given); keeps no traceback, whose
    frames would hold tensors and the process group past ``destroy_process_group`` (gloo then aborts at exit)."""
    try:
        fn(*args, **{"chunk_size": 0, **kwargs})
    except ValueError as exc:
        return str(exc)
    return None


def _shard_check_worker(rank, world, port, seed):
    """Rule: inconsistent vocabulary shards across the TP group raise on every rank, naming the widths."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = dist.group.WORLD
        hidden, weight, labels, _, _, lw = make_problem(seed, 8, 16, 300, 1)  # V = 300, identical on both ranks
        hidden, weight, lw = hidden.float(), weight.float(), lw.float()
        logits = (hidden.double() @ weight.double().t()).float()
        # Full-vocabulary logits on every rank: without vocab_size this is silently ln 2 too low (the fault) ...
        lp = vocab_parallel_logprobs(logits.clone(), labels, tp_group=g, chunk_size=0)
        ref = torch.log_softmax(logits.double(), -1).gather(1, labels[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), ref - math.log(2), rtol=0, atol=1e-5)
        # ... and with the vocabulary size the op refuses it, on every rank alike.
        full = ("the TP group's vocabulary shards have widths [300, 300], summing to 600, not vocab_size=300; "
                "pass each rank its own V/tp shard (full-vocabulary tensors on every rank make every log-prob "
                "ln(tp) too low)")
        assert _value_error(vocab_parallel_logprobs, logits.clone(), labels, tp_group=g, vocab_size=300) == \
            "logits: " + full
        for fn, args in ((linear_logprobs, ()), (linear_sft_loss, (lw,))):
            assert _value_error(fn, hidden.clone(), weight.clone(), labels, *args, tp_group=g, vocab_size=300) == \
                "weight: " + full
        # Shards of unequal width (151 and 149 columns): refused even without vocab_size.
        width = 151 if rank == 0 else 149
        uneven = ("the TP group's vocabulary shards have widths [151, 149] (ranks 0..1); "
                  "every rank must hold V/tp columns")
        assert _value_error(vocab_parallel_logprobs, logits[:, :width].contiguous(), labels % 298, tp_group=g) == \
            "logits: " + uneven
        assert _value_error(linear_sft_loss, hidden.clone(), weight[:width].clone(), labels % 298, lw, tp_group=g) == \
            "weight: " + uneven
        # Consistent shards with the right vocab_size pass and match the fp64 reference.
        shard = logits[:, rank * 150:(rank + 1) * 150].contiguous()
        lp = vocab_parallel_logprobs(shard, labels, tp_group=g, vocab_size=300, chunk_size=0)
        torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_inconsistent_vocab_shards_are_refused_gloo():
    mp.spawn(_shard_check_worker, args=(2, free_port(), fresh_seed()), nprocs=2, join=True)
