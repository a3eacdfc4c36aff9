"""The kernel summary's compact records (issue 49 item 1): the CPU ops on disk, read one time bucket at a time, the
CUDA API calls and fwdbwd flows kept in arrays, give what the earlier ops in memory, per-event dicts and per-window
sort gave, bit for bit."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from fixtures import FIXTURE_DIR
from fixtures.faults import duplicate, full_disk_on_append, kernel_summary, with_second_step
from sftprof.analysis.time import trace_summary
from sftprof.analysis.trace.intervals import ThreadIntervals, previous_open, repeated_rows
from sftprof.analysis.trace.op_collector import OpCollector
from sftprof.analysis.trace import op_store
from sftprof.analysis.trace.op_store import BUCKET_OPS, CpuOpStore


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


@pytest.mark.parametrize("bucket_ops", [BUCKET_OPS, 5, 13])
def test_self_time_by_time_bucket_equals_the_windows_own_nesting(bucket_ops):
    """Windows and buckets that cut through nested ops: each op's self time as the window's own nesting gives it."""
    rng = np.random.default_rng(7)
    ops = _nested_ops(rng, n_threads=3, depth=4)
    collector = OpCollector(bucket_ops)
    for tid, a, b in ops:
        collector.add_cpu_op(tid, "aten::op", None, a, b - a)
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


def _store(ops: list[tuple[int, float, float]], names: list[int], bucket_ops: int) -> CpuOpStore:
    store = CpuOpStore(bucket_ops)
    for (tid, a, b), k in zip(ops, names):
        store.add(tid, a, b - a, k)
    return store


@pytest.mark.parametrize("bucket_ops", [4, 9, 64])
def test_ops_by_time_bucket_answer_as_all_ops_in_memory(bucket_ops):
    """The innermost op around points (all ops, and the ops of some names), the ops recorded twice and the sums per
    name, one bucket at a time, equal those of all the ops in memory (overlapping, not nested ops included)."""
    rng = np.random.default_rng(11)
    ops = _nested_ops(rng, n_threads=2, depth=3)
    ops += [(100, a, a + float(rng.uniform(1, 300))) for a in rng.uniform(0, 600, size=15).tolist()]  # overlapping
    ops += [ops[i] for i in rng.integers(0, len(ops), size=10).tolist()]  # recorded twice
    names = rng.integers(0, 4, size=len(ops)).tolist()
    names[-10:] = [names[ops.index(o)] for o in ops[-10:]]
    store = _store(ops, names, bucket_ops)
    tid = np.array([o[0] for o in ops], dtype=np.int64)
    st = np.array([o[1] for o in ops])
    en = np.array([o[2] for o in ops])
    name = np.array(names, dtype=np.int64)
    dup = repeated_rows(st, tid, en, name)
    count, examples = store.drop_repeated(3)
    assert count == int(dup.sum()) > 0 and store.kept.tolist() == (~dup).tolist()
    assert examples == [(int(name[i]), float(st[i])) for i in np.flatnonzero(dup)[:3]]
    keep = ~dup
    memory = ThreadIntervals.from_arrays(tid[keep], st[keep], en[keep], name[keep])
    at = np.flatnonzero(keep)
    p_tid = rng.choice([100, 101, 102, 7], size=400).astype(np.int64)
    p_x = rng.uniform(-10, 900, size=400)
    p_x[::50] = np.nan
    p_x[1::50] = st[rng.integers(0, st.size, size=8)]  # on an op's start
    want = memory.innermost(p_tid, np.where(np.isnan(p_x), -np.inf, p_x))
    got_idx, got_name = store.innermost(p_tid, p_x)
    assert got_idx.tolist() == np.where(want >= 0, at[want], -1).tolist()
    assert got_name.tolist() == np.where(want >= 0, name[keep][want], -1).tolist()
    named = np.array([True, False, True, False])
    sub = named[name[keep]]
    memory = ThreadIntervals.from_arrays(tid[keep][sub], st[keep][sub], en[keep][sub], name[keep][sub])
    want = memory.innermost(p_tid, np.where(np.isnan(p_x), -np.inf, p_x))
    assert store.innermost(p_tid, p_x, named)[0].tolist() == np.where(want >= 0, at[sub][want], -1).tolist()
    assert store.drop_where(lambda start: start > 300.0) == int((keep & (st > 300.0)).sum())
    keep &= st <= 300.0
    calls, us = store.name_totals(4)
    dur = np.array([b - a for _, a, b in ops])
    assert calls.tolist() == np.bincount(name[keep], minlength=4).tolist()
    assert us.tolist() == np.bincount(name[keep], weights=dur[keep], minlength=4).tolist()  # bit for bit


def test_the_summary_by_small_time_buckets_is_the_summary_of_one_bucket(monkeypatch):
    """A real trace with a second profiler step and every CPU op recorded twice, summarised with 1000 CPU ops a time
    bucket (about 70 buckets) and with one bucket (all ops in memory at once, as before): the same summary."""
    te = json.loads(gzip.decompress((FIXTURE_DIR / "h200_te_kernel.trace.json.gz").read_bytes()))
    two = with_second_step(te, 3, longer_us=1e6)
    duplicate(two, [e for e in two["traceEvents"] if e.get("cat") == "cpu_op"])
    whole = kernel_summary(two, 2)
    assert whole["sanity"]["duplicates"]["count"] and whole["sanity"]["other_steps"]["count"]
    assert whole["host"]["top_self"] and whole["host"]["sync"]["by_call"]
    monkeypatch.setattr(trace_summary, "OpCollector", lambda: OpCollector(1000))
    assert kernel_summary(two, 2) == whole


def test_ops_added_after_a_question_are_in_the_next_one():
    store = CpuOpStore(4)
    for i in range(6):
        store.add(1, float(i), 0.5, 0)
    assert len(store) == 6
    for i in range(6, 10):  # a whole block, written by add itself
        store.add(1, float(i), 0.5, 1)
    assert len(store) == 10 and store.name_totals(2)[0].tolist() == [6, 4]
    assert store.innermost(np.array([1]), np.array([9.25]))[0].tolist() == [9]


def _dead_pid() -> int:
    """The pid of a process that has ended (a child, waited for)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_new_store_removes_the_folders_of_dead_processes_only(tmp_path, monkeypatch):
    """A folder named after a process that is gone (killed before its store was removed) is removed by the next
    store in the same temporary folder; one of a live process (here the test's own), and other names, are left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, live = tmp_path / f"sftprof_cpu_ops_{_dead_pid()}_x1y2", tmp_path / f"sftprof_cpu_ops_{os.getpid()}_a3b4"
    other = tmp_path / "sftprof_cpu_ops_notapid"
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "ops").write_bytes(b"\0" * 28)
    store = CpuOpStore(4)
    mine = [p.name for p in tmp_path.iterdir() if p not in (live, other)]
    assert not dead.exists() and live.is_dir() and (live / "ops").is_file() and other.is_dir()
    assert len(mine) == 1 and mine[0].startswith(f"sftprof_cpu_ops_{os.getpid()}_")
    del store
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_a_failed_write_to_the_temporary_folder_names_it_and_the_space_needed(tmp_path, monkeypatch):
    """A full TMPDIR (ENOSPC when the first block of ops is written) raises TempSpaceError naming the folder and
    its free space; its message for a trace adds the space needed (0.26 GB per GiB of trace text)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(op_store, "free_space", lambda folder: f"12.0 KiB free in {folder}")
    full_disk_on_append(monkeypatch, op_store)
    store = CpuOpStore(4)
    with pytest.raises(op_store.TempSpaceError) as err:
        for i in range(4):
            store.add(1, float(i), 0.5, 0)
    assert err.value.strerror == (f"temporary CPU-op file in {tmp_path} (TMPDIR): No space left on device "
                                  f"(12.0 KiB free in {tmp_path})")
    trace = tmp_path / "rank0.pt.trace.json"
    with open(trace, "wb") as f:
        f.truncate(3 * 2**30)  # sparse: 3 GiB of text
    assert err.value.message(str(trace)) == (f"{err.value.strerror}; it needs about 0.8 GB for this trace (set TMPDIR "
                                             "to a folder with room)")
    assert err.value.message(str(trace) + ".gz").endswith("; it needs about 0.26 GB per GiB of the trace's "
                                                          "uncompressed text (set TMPDIR to a folder with room)")
