"""GPU tests of sftprof.ops (Triton kernels + cuBLAS): parity vs fp64, more than 2**31 logits, TP=2 over NCCL.

Tolerances are those stated in tests/test_ops.py (``check_all``); the large case states its own below.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sftprof.launch import free_port
from sftprof.ops import linear_sft_loss, vocab_parallel_logprobs
from test_ops import (check_all, check_flat_row_shift_offset, check_minus_inf_logits, check_sft_far_targets,
                      fresh_seed)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_cuda(dtype):
    # V not a multiple of the kernels' blocks, several chunks with a ragged tail.
    check_all(0, 1, None, fresh_seed(), dtype, n=1000, h=256, v=30011, device="cuda", chunk_size=384)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sft_loss_far_targets_cuda(dtype):
    # Triton path: rows shifted by their target + ln V and rows rewritten by the finisher (some with both raw and
    # transformed blocks), V not a multiple of the blocks, ragged last chunk.
    check_sft_far_targets(fresh_seed(), dtype, n=1000, h=64, v=30011, device="cuda", chunk_size=384,
                          grad_in_hidden=dtype == torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sft_loss_strided_hidden_cuda(dtype):
    # A hidden whose columns are not contiguous (a transposed view): the finisher and the row scaling take
    # both strides.
    check_sft_far_targets(fresh_seed(), dtype, n=1000, h=64, v=30011, device="cuda", chunk_size=384,
                          strided_hidden=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_minus_inf_logits_give_no_nan_cuda(dtype):
    # Triton kernels: masked (-inf) vocabulary entries; -inf targets (the raw-block test must catch NaN sums).
    check_minus_inf_logits(fresh_seed(), dtype, "cuda", n=300, v=30011)


def test_flat_row_shift_offset_cuda():
    # Triton path: the elementwise pass and the finisher shift by the target logit + ln V (V = 30011: a ragged
    # last column block).
    check_flat_row_shift_offset("cuda", v=30011)


def test_logprobs_take_all_rows_in_one_launch_cuda():
    """On CUDA ``chunk_size`` adds no launches: one row-statistics and one gradient kernel for 1000 rows at
    chunk_size=128 (per-chunk launches left the GPU idle over ~400 ms of a 131072-token step; bench/NOTES.md),
    and the result equals the chunk_size=0 call bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(fresh_seed())
    base = torch.randn(1000, 30011, device="cuda", dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, 30011, (1000,), device="cuda", generator=g)
    grads = {}
    for chunk in (0, 128):
        logits = base.clone().requires_grad_()
        vocab_parallel_logprobs(logits, labels, chunk_size=chunk).sum().backward()  # warm the autotuner
        logits = base.clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            lp = vocab_parallel_logprobs(logits, labels, chunk_size=chunk)
            lp.sum().backward()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert names.count("_row_stats_kernel") == 1 and names.count("_softmax_grad_kernel") == 1, chunk
        grads[chunk] = (lp, logits.grad)
    assert torch.equal(grads[0][0], grads[128][0]) and torch.equal(grads[0][1], grads[128][1])



def test_autotuning_in_place_kernels_clones_a_bounded_copy():
    """A cold autotuner key on a chunk of more than ``_TUNE_ROWS`` rows: the in-place kernels tune on a copy of its
    first rows, so the peak adds far less than the chunk (``restore_value`` cloned the whole chunk: 37 GiB at
    131072 x 151936 bf16; bench/NOTES.md), and the tuned call writes what a call with the cached choice writes."""
    from sftprof.ops import triton_kernels
    from sftprof.ops.vocab_softmax import SHIFT_MARGIN, shift_offset

    n, v = 32768, 50021  # a width no other test tunes: a cold key; the chunk is 3.28 GB of bf16
    g = torch.Generator(device="cuda").manual_seed(fresh_seed())
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    lse = logits.float().logsumexp(-1)
    coef = torch.rand(3, n, device="cuda", generator=g)
    weights = torch.rand(n, device="cuda", generator=g)
    calls = {"softmax_grad_": lambda x: triton_kernels.softmax_grad_(x, labels, lse, coef, 1.0),
             "sft_shifted_exp_": lambda x: triton_kernels.sft_shifted_exp_(x, labels, weights, 1.0, SHIFT_MARGIN,
                                                                           shift_offset(v))}
    chunk = logits.numel() * logits.element_size()
    for name, call in calls.items():
        tuned = logits.clone()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call(tuned)
        # the copy and its clone (2 x 2048 rows: 0.41 GB) and do_bench's 256 MB flush buffer, not the chunk
        assert torch.cuda.max_memory_allocated() - before < chunk / 2, name
        cached = logits.clone()
        call(cached)
        assert torch.equal(tuned, cached), name

def _reference_rows(logits_rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """fp64 log-probs and d(sum -w*logprob)/dlogits for a few rows."""
    z = logits_rows.double()
    lp = z.log_softmax(-1)
    g = lp.exp() * weights.double()[:, None]
    g[torch.arange(len(labels)), labels] -= weights.double()
    return lp.gather(1, labels[:, None]).squeeze(1), g


def test_more_than_2_pow_31_logits():
    """N x V = 16384 x 151936 = 2.49e9 > 2**31 elements in one chunk (int32 offsets would wrap)."""
    n, h, v = 16384, 128, 151936
    assert n * v > 2 ** 31
    g = torch.Generator(device="cuda").manual_seed(fresh_seed())
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.2)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    lw = torch.rand(n, device="cuda", generator=g)
    tail = torch.arange(n - 64, n, device="cuda")  # rows whose offsets exceed 2**31

    logits = (hidden @ weight.t()).requires_grad_()
    lp = vocab_parallel_logprobs(logits, labels, chunk_size=0)
    ref_lp, ref_g = _reference_rows(logits[tail].detach(), labels[tail], lw[tail])
    torch.testing.assert_close(lp[tail].double(), ref_lp, rtol=0, atol=2e-5)
    (-(lp * lw).sum()).backward()
    # bf16 gradient: rtol 2**-7, atol 2**-7 * max|ref| (one bf16 rounding of each element).
    tol = dict(rtol=2 ** -7, atol=2 ** -7 * float(ref_g.abs().max()))
    torch.testing.assert_close(logits.grad[tail].double(), ref_g, **tol)
    del logits, lp

    hq, wq = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_sft_loss(hq, wq, labels, lw, chunk_size=0)
    loss.backward()
    # d/dhidden of the tail rows from the fp64 reference gradient of the (bf16) logits.
    ref_logits = (hidden[tail].double() @ weight.double().t()).to(torch.bfloat16)
    _, ref_g = _reference_rows(ref_logits, labels[tail], lw[tail])
    ref_gh = ref_g @ weight.double()
    torch.testing.assert_close(hq.grad[tail].double(), ref_gh, rtol=2 ** -6, atol=2 ** -6 * float(ref_gh.abs().max()))
    # Weight gradient column sums: sum_i d/dW = grad_logits^T @ hidden; check a few vocab rows incl. the last.
    vrows = torch.tensor([0, 1, v // 2, v - 1], device="cuda")
    ref_gw = torch.zeros(len(vrows), h, dtype=torch.float64, device="cuda")
    for s in range(0, n, 2048):
        z = (hidden[s:s + 2048].double() @ weight.double().t()).to(torch.bfloat16)
        _, gz = _reference_rows(z, labels[s:s + 2048], lw[s:s + 2048])
        ref_gw += gz[:, vrows].t() @ hidden[s:s + 2048].double()
    torch.testing.assert_close(wq.grad[vrows].double(), ref_gw, rtol=2 ** -5, atol=2 ** -5 * float(ref_gw.abs().max()))


def _nccl_worker(rank, world, port, seed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        for dtype in (torch.float32, torch.bfloat16):
            check_all(rank, world, dist.group.WORLD, seed, dtype, n=512, h=128, v=32768, device=f"cuda:{rank}",
                      chunk_size=200)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for TP=2 over NCCL")
def test_parity_tp2_nccl():
    mp.spawn(_nccl_worker, args=(2, free_port(), fresh_seed()), nprocs=2, join=True)
