"""A simulated rank's collectives on torch's fake process group (sftprof.simulated_comm), on CPU tensors: every
receive and output is filled by the stated rule, NaN-initialised buffers come back finite; on CUDA (gpu marker) the
fills are ordered before a stream that waits on the op's work. Each case runs in a fresh process (one default process
group per process)."""
import subprocess
import sys
import textwrap

import pytest

SETUP = """
import math, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from sftprof import simulated_comm
simulated_comm.install()
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
nan = lambda *shape: torch.full(shape, math.nan)
"""


def _run(body: str) -> None:
    out = subprocess.run([sys.executable, "-c", SETUP + textwrap.dedent(body)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_receive_takes_what_this_rank_sends():
    _run("""
    kv = torch.arange(6.).view(2, 3)
    # send first, then receive (TE's CP ring on an even CP rank)
    reqs = [dist.isend(kv, 2), dist.irecv(got := nan(2, 3), 0)]
    [r.wait() for r in reqs]
    assert torch.equal(got, kv)
    # receive first, then send (an odd CP rank): zeros until the send, then the send's copy
    first = nan(2, 3)
    reqs = [dist.irecv(first, 0)]
    assert torch.equal(first, torch.zeros(2, 3))
    reqs.append(dist.isend(kv + 1, 2))
    assert torch.equal(first, kv + 1)
    # batched (TE with NVTE_BATCH_MHA_P2P_COMM, megatron's pipeline), and a receive no send matches: zeros
    ops = [dist.P2POp(dist.isend, kv * 2, 2), dist.P2POp(dist.irecv, batched := nan(2, 3), 0),
           dist.P2POp(dist.irecv, alone := nan(5), 0)]
    [r.wait() for r in dist.batch_isend_irecv(ops)]
    assert torch.equal(batched, kv * 2) and torch.equal(alone, torch.zeros(5))
    dist.recv(blocking := nan(4), 0)
    assert torch.equal(blocking, torch.zeros(4))
    """)


def test_all_to_all_repeats_this_ranks_own_slot():
    _run("""
    x = torch.arange(8.).view(4, 2)  # equal splits: this rank (1) sends itself row 1
    out = nan(4, 2)
    dist.all_to_all_single(out, x)
    assert torch.equal(out, x[1].repeat(4, 1))
    # MoE dispatch: splits decided by the routing; this rank's own slot is rows 1..2, each peer's slot repeats it
    x = torch.arange(12.).view(6, 2)
    out = nan(7, 2)
    dist.all_to_all_single(out, x, output_split_sizes=[2, 3, 1, 1], input_split_sizes=[1, 2, 0, 3])
    own = x[1:3]
    assert torch.equal(out, torch.cat([own, own, own[:1], own[:1], own[:1]]))
    # megatron-core 0.19's dispatcher passes the splits as numpy arrays
    import numpy as np
    out = nan(7, 2)
    dist.all_to_all_single(out, x, output_split_sizes=np.array([2, 3, 1, 1]), input_split_sizes=np.array([1, 2, 0, 3]))
    assert torch.equal(out, torch.cat([own, own, own[:1], own[:1], own[:1]]))
    # an empty own slot: the whole input repeated (an empty input with a non-empty output: torch 2.13 refuses it)
    out = nan(3, 2)
    dist.all_to_all_single(out, x, output_split_sizes=[3, 0, 0, 0], input_split_sizes=[3, 0, 3, 0])
    assert torch.equal(out, x[:3])
    simulated_comm.fill_rows(out, torch.empty(0, 2))
    assert torch.equal(out, torch.zeros(3, 2))
    outs = [nan(2) for _ in range(4)]
    dist.all_to_all(outs, [torch.full((2,), float(i)) for i in range(4)])
    assert all(torch.equal(o, torch.ones(2)) for o in outs)
    """)


def test_reduce_scatter_is_this_ranks_slice_and_all_gather_repeats():
    _run("""
    grads = torch.arange(8.)
    out = nan(2)
    dist.reduce_scatter_tensor(out, grads)
    assert torch.equal(out, torch.tensor([2., 3.]))
    outs = [nan(2), nan(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o in outs:
            dist.reduce_scatter_tensor(o, grads)
    cm.wait()
    assert all(torch.equal(o, torch.tensor([2., 3.])) for o in outs)
    dist.reduce_scatter(listed := nan(2), [torch.full((2,), float(i)) for i in range(4)])
    assert torch.equal(listed, torch.ones(2))
    in_place = torch.arange(8.)
    dist.reduce_scatter_tensor(in_place[2:4], in_place)
    assert torch.equal(in_place, torch.arange(8.))
    gathered = nan(8)
    dist.all_gather_into_tensor(gathered, torch.tensor([5., 6.]))
    assert torch.equal(gathered, torch.tensor([5., 6.]).repeat(4))
    """)



@pytest.mark.gpu
def test_cuda_fills_are_ordered_before_the_waiting_stream():
    """On CUDA the fill runs on the calling stream; ``wait()`` of the op's work, on another stream (TE's CP ring waits
    on the stream that computes the next step), orders that stream after it, as NCCL's work does."""
    _run("""
    kv = torch.randn(4096, 1024, device="cuda")
    side = torch.cuda.Stream()
    got = torch.full_like(kv, math.nan)
    reqs = [dist.isend(kv, 2), dist.irecv(got, 0)]
    with torch.cuda.stream(side):
        [r.wait() for r in reqs]
        seen = got.clone()
    out = torch.full((8192, 1024), math.nan, device="cuda")
    work = dist.all_to_all_single(out, kv, output_split_sizes=[2048] * 4, input_split_sizes=[1024] * 4,
                                  async_op=True)
    with torch.cuda.stream(side):
        work.wait()
        seen_a2a = out.clone()
    torch.cuda.synchronize()
    assert torch.equal(seen, kv)
    assert torch.equal(seen_a2a, kv[1024:2048].repeat(8, 1))
    """)
