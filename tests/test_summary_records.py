"""The kernel summary's compact records (issue 49 item 1): the CPU ops on disk, read one time bucket at a time, the
CUDA API calls and fwdbwd flows kept in arrays, the GPU activities' strings as indexes, give what the earlier ops in
memory, per-event dicts, per-window sort and per-activity strings gave, bit for bit."""
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
from sftprof.analysis.schema import ms
from sftprof.analysis.time import gpu_activity, trace_summary
from sftprof.analysis.time.gpu_activity import GPU_ACTIVITY_CATS, Labels, time_by_category
from sftprof.analysis.trace.check import event_problem
from sftprof.analysis.trace.kernel_names import COMM_PREFIX, kernel_category
from sftprof.analysis.trace import intervals
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


def test_a_stop_right_after_the_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """A stop signal becomes SystemExit at any bytecode; one raised the moment the store's folder exists (here: by
    os.mkdir itself, after making it) still removes the folder, since its removal was registered first (the window
    a fresh install's run of test_a_stopped_postprocess_removes_its_temporary_folder most likely hit once)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = []

    def mkdir_then_stop(path, mode=0o777):
        real_mkdir(path, mode)
        made.append(path)
        raise SystemExit(143)

    real_mkdir = os.mkdir
    monkeypatch.setattr(os, "mkdir", mkdir_then_stop)
    with pytest.raises(SystemExit):
        CpuOpStore(4)
    monkeypatch.undo()
    assert len(made) == 1 and os.path.basename(made[0]).startswith(f"sftprof_cpu_ops_{os.getpid()}_")
    assert list(tmp_path.iterdir()) == []


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


def _fed(trace: dict, step: int) -> trace_summary.KernelTraceAnalyzer:
    """An analyzer fed ``trace`` as :func:`fixtures.faults.kernel_summary` feeds it, its pass ended."""
    a = trace_summary.KernelTraceAnalyzer({k: v for k, v in trace.items() if k != "traceEvents"}, step=step)
    for e in trace["traceEvents"]:
        if not event_problem(e):
            a.add(e)
    a._ops.end_pass()
    return a


@pytest.mark.parametrize("fixture", ["h200_te_kernel.trace.json.gz", "h200_2gpu_sync/rank0.pt.trace.json.gz"])
def test_the_activity_tables_indexed_columns_are_each_activitys_strings(fixture):
    """Category, process-group label and name are kept as indexes into their distinct strings (1 byte an activity,
    was an 8-byte pointer): per activity the string worked out one activity at a time, the optimizer step's kernels
    (TE trace) and the NCCL kernels' groups (2-GPU trace) included."""
    a = _fed(json.loads(gzip.decompress((FIXTURE_DIR / fixture).read_bytes())), 2)
    regions = sorted(dict.fromkeys(a._regions), key=lambda r: (r[1], r[0]))
    t = a.activity_table(regions)
    opt = [(lo, hi) for name, lo, hi in regions if name == trace_summary.OPTIMIZER_REGION]
    cats, groups, pgs = [], [], []
    refs = list(a._pg_refs)
    for k, kind, pg, ext, launch in zip(a._a_name, a._a_kind, a._a_pg, a._a_ext, t.launch.tolist()):
        c = kernel_category(a._name_list[k], GPU_ACTIVITY_CATS[kind])
        comm = c.startswith(COMM_PREFIX)
        cats.append("optimizer" if kind == 0 and not comm and any(lo <= launch <= hi for lo, hi in opt) else c)
        ref = refs[pg] if pg >= 0 else a._comm_ops.get(ext) if comm else None
        groups.append(a._pg_label(ref))
        pgs.append(ref[1] if ref is not None else None)
    assert list(t.category) == cats and list(t.group) == groups and list(t.pg_name) == pgs
    assert t.is_comm.tolist() == [c.startswith(COMM_PREFIX) for c in cats]
    assert t.category.codes.dtype == np.int8 and t.group.codes.dtype == np.int8
    if fixture.startswith("h200_te"):
        assert cats.count("optimizer") > 100 and not any(groups)
    else:
        assert {g for g, comm in zip(groups, t.is_comm.tolist()) if comm} == {"EP", "ETP-EP"}
        assert set(pgs) == {"22", "25", None}
    keep = np.arange(t.n) % 3 == 1
    sub = t.subset(keep)
    assert list(sub.category) == [c for c, k in zip(cats, keep.tolist()) if k] and sub.group[0] == groups[1]


def test_labels_give_each_rows_string_and_none_for_minus_one():
    labels = Labels(["a", "b"], np.array([1, -1, 0, 1], dtype=np.int64))
    assert labels.codes.dtype == np.int8 and len(labels) == 4
    assert list(labels) == ["b", None, "a", "b"] and labels[1] is None and labels[2] == "a"
    assert labels[1:3] == [None, "a"] and list(labels.subset(np.array([True, False, False, True]))) == ["b", "b"]
    assert Labels([str(i) for i in range(300)], np.array([299])).codes.dtype == np.int16


def test_categories_and_host_wait_summed_a_few_rows_at_a_time_are_those_of_whole_columns(monkeypatch):
    """The host-wait places, GPU idle split and kernel efficiency, read 5 rows at a time
    (:func:`gpu_activity.column_rows`, 65536 by default) and the innermost ranges, nodes and FLOP-known ops looked up
    7 launch points at a time (262144 by default), equal those of one chunk; the categories (summed by label index)
    are those summed one activity at a time."""
    te = json.loads(gzip.decompress((FIXTURE_DIR / "h200_te_kernel.trace.json.gz").read_bytes()))
    whole = kernel_summary(te, 2)
    places = whole["host"]["gpu_idle"]["host_wait_by_place"]
    assert places["rows"] and sum(r["gaps"] for r in places["rows"]) > 100 and whole["efficiency"]["rows"]
    monkeypatch.setattr(gpu_activity, "ROWS", 5)
    monkeypatch.setattr(intervals, "_POINTS", 7)
    assert kernel_summary(te, 2) == whole
    a = _fed(te, 2)
    t = a.activity_table(sorted(dict.fromkeys(a._regions), key=lambda r: (r[1], r[0])))
    us: dict[str, float] = {}
    for c, g, comm, d in zip(t.category, t.group, t.is_comm.tolist(), t.dur.tolist()):
        label = f"{c} [{g}]" if comm and g else c
        us[label] = us.get(label, 0.0) + d
    assert {r["category"]: r["total_ms"] for r in time_by_category(t)} == {k: ms(v) for k, v in us.items()}


def test_the_launch_table_is_dropped_after_the_sanity_check():
    """The summary frees the launch table and kernel launches once read (about 40 bytes a GPU activity): asking
    them afterwards raises; the blocking calls and repeated calls stay."""
    te = json.loads(gzip.decompress((FIXTURE_DIR / "h200_te_kernel.trace.json.gz").read_bytes()))
    a = _fed(te, 2)
    calls, repeated = list(a._ops.sync_calls), a._ops.repeated_api_calls
    assert a._ops.kernel_launches[0] and calls
    a.summary()
    with pytest.raises(RuntimeError, match="dropped"):
        a._ops.launch_points(np.array([1], dtype=np.int64))
    with pytest.raises(RuntimeError, match="dropped"):
        a._ops.kernel_launches
    assert a._ops.sync_calls == calls and a._ops.repeated_api_calls == repeated
    with pytest.raises(RuntimeError, match="after the pass"):
        OpCollector(4).drop_launches()
