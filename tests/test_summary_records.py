"""The kernel summary's compact records (issue 49 item 1): the CPU ops' self time from the kept nesting index, and the
CUDA API calls and fwdbwd flows kept in arrays, give what the earlier per-event dicts and per-window sort gave."""
from __future__ import annotations

import numpy as np

from sftprof.analysis.trace.intervals import previous_open
from sftprof.analysis.trace.op_collector import OpCollector


def _nested_ops(rng: np.random.Generator, n_threads: int, depth: int) -> list[tuple[int, float, float]]:
    """Randomly nested ``(tid, start, end)`` intervals (children inside parents, siblings apart), shuffled."""
    out: list[tuple[int, float, float]] = []

    def grow(tid: int, lo: float, hi: float, level: int) -> None:
        out.append((tid, lo, hi))
        if level == depth:
            return
        cuts = np.sort(rng.uniform(lo, hi, size=2 * int(rng.integers(0, 4))))
        for a, b in zip(cuts[::2].tolist(), cuts[1::2].tolist()):
            grow(tid, a, b, level + 1)

    for tid in range(n_threads):
        t = 0.0
        for _ in range(6):
            width = float(rng.uniform(50, 200))
            grow(100 + tid, t, t + width, 0)
            t += width + float(rng.uniform(0, 30))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def _self_us_of_window(ops: list[tuple[int, float, float]], lo: float, hi: float) -> dict[int, float]:
    """Self time of each op starting in [lo, hi], the parents found among those ops alone (the earlier way)."""
    tid = np.array([o[0] for o in ops], dtype=np.int64)
    st = np.array([o[1] for o in ops])
    en = np.array([o[2] for o in ops])
    keep = np.flatnonzero((st >= lo) & (st <= hi))
    order = keep[np.lexsort((-en[keep], st[keep], tid[keep]))]
    parent = previous_open(tid[order], st[order], en[order])
    child = np.zeros(st.size)
    nested = parent >= 0
    child[order] = np.bincount(parent[nested], weights=(en - st)[order][nested], minlength=order.size)
    return {int(i): float(max(en[i] - st[i] - child[i], 0.0)) for i in keep}


def test_self_time_from_the_kept_nesting_index_equals_the_windows_own_nesting():
    rng = np.random.default_rng(7)
    ops = _nested_ops(rng, n_threads=3, depth=4)
    collector = OpCollector()
    for tid, a, b in ops:
        collector.add_cpu_op(tid, "aten::op", None, a, b - a)
    collector.cpu_ops.nesting()  # built once, as the blocking calls' lookup does before the self times
    ends = sorted(b for _, _, b in ops)
    # windows that cut through parents (their children start inside), the whole trace, and an empty one
    for lo, hi in ((ends[5], ends[-20]), (-1.0, 1e9), (ends[40] + 0.25, ends[41] - 0.25), (2e9, 3e9)):
        keep, own = collector.op_self_us(lo, hi)
        expected = _self_us_of_window([(t, a, a + (b - a)) for t, a, b in ops], lo, hi)
        assert keep.tolist() == sorted(expected)
        assert own[keep].tolist() == [expected[i] for i in keep.tolist()]  # bit for bit
        assert not own[np.setdiff1d(np.arange(own.size), keep)].any()  # zero outside the window


def test_repeated_and_reused_correlations_give_the_last_call_as_the_launch():
    ops = OpCollector()
    calls = [  # (correlation, tid, ts, name)
        (1, 5, 10.0, "cudaLaunchKernel"), (1, 5, 10.0, "cudaLaunchKernel"),  # recorded twice: one repeat
        (2, 5, 20.0, "cudaMemcpy"), (2, 5, 20.0, "cudaMemcpy"),  # a blocking call recorded twice: listed once
        (3, 6, 30.0, "cudaLaunchKernel"), (3, 7, 31.0, "cudaLaunchKernel"),  # reused id: the last call is the launch
        (3, 6, 30.0, "cudaLaunchKernel"),  # equal to an earlier but not to the previous call of 3: not a repeat
    ]
    for corr, tid, ts, name in calls:
        ops.add({"ph": "X", "tid": tid, "name": name, "args": {"correlation": corr}}, "cuda_runtime", ts, 1.0)
    ops.add({"ph": "X", "tid": 5, "name": "cudaDeviceSynchronize", "args": {}}, "cuda_runtime", 40.0, 2.0)
    assert ops.repeated_api_calls == 2
    assert list(ops.kernel_launches[0]) == [1, 3, 3, 3] and list(ops.kernel_launches[1]) == [10.0, 30.0, 31.0, 30.0]
    assert ops.sync_calls == [("cudaMemcpy", 20.0, 21.0, 5), ("cudaDeviceSynchronize", 40.0, 42.0, 5)]
    tids, pts = ops.launch_points(np.array([3, 1, 4, -1], dtype=np.int64))
    assert tids.tolist() == [6, 5, -1, -1]
    assert pts[:2].tolist() == [30.0, 10.0] and np.isnan(pts[2:]).all()


def test_flows_keep_the_last_start_of_an_id_and_the_last_id_ending_at_an_op():
    ops = OpCollector()
    ops.add({"ph": "s", "cat": "fwdbwd", "id": 1, "tid": 1}, "fwdbwd", 5.0, 0.0)
    ops.add({"ph": "s", "cat": "fwdbwd", "id": 1, "tid": 1}, "fwdbwd", 6.0, 0.0)  # the later start of id 1 counts
    ops.add({"ph": "f", "cat": "fwdbwd", "id": 9, "tid": 2}, "fwdbwd", 50.0, 0.0)
    ops.add({"ph": "f", "cat": "fwdbwd", "id": 1, "tid": 2}, "fwdbwd", 50.0, 0.0)  # the same op: the last id counts
    ops.add({"ph": "f", "cat": "fwdbwd", "id": "x", "tid": 2}, "fwdbwd", 40.0, 0.0)
    s_id, s_tid, s_ts, e_tid, e_ts, e_id = ops._flows()
    assert s_id.tolist() == [hash(1)] and s_tid.tolist() == [1] and s_ts.tolist() == [6.0]
    assert list(zip(e_tid.tolist(), e_ts.tolist(), e_id.tolist())) == [(2, 50.0, hash(1)), (2, 40.0, hash("x"))]
