"""The all-ranks view (sftprof.analysis.views.merged) against the per-rank views it merges: the real 2x H200 traces
(tests/fixtures/h200_2gpu_sync) and two real CPU traces."""
import collections
import gzip
import json
import os
import shutil

import pytest

from fixtures import in_windows, make_cpu_trace, two_gpu_sync_log_dir, two_gpu_sync_traces
from sftprof.analysis.time import comm_wait
from sftprof.analysis.trace.io import TraceReader
from sftprof.analysis.views import merged as merged_module
from sftprof.analysis.views.merged import clock_shifts, write_merged_view
from sftprof.analysis.views.windows import window_cuts
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.trace.check import validate_trace
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer
from sftprof.analysis.views.split import split_trace


def _load(path):
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        return json.load(f)


def _timed(events):
    return [e for e in events if e["ph"] != "M"]


def _views(paths, out):
    """Each trace split into views as rank r, with the kernel summary's collective calls: ({rank: chrome paths},
    {rank: call records})."""
    views, calls = {}, {}
    for r, src in enumerate(paths):
        a = KernelTraceAnalyzer()
        views[r] = split_trace(str(src), str(out / "views"), r, on_header=a.set_header, on_event=a.add,
                               progress=False)["chrome"]
        calls[r] = a.summary()["collectives"].pop("calls")
    return views, calls


def _check_against_views(merged_paths, views, shifts, windows=False):
    """Every event of every rank's view is in the merged file(s) once, on its rank's process, at its time moved by the
    rank's shift; the merged file keeps the trace rules (strict JSON, nesting, flows, names). ``windows``: the file
    is cut into time windows, which leave out the flow arrows whose two ends fall into different windows."""
    merged = []
    for p in merged_paths:
        assert validate_trace(str(p)) == []
        data = _load(p)
        merged += _timed(data["traceEvents"])
    base_us = (data["baseTimeNanoseconds"] - _load(views[0][0])["baseTimeNanoseconds"]) / 1000
    for r, paths in views.items():
        want = collections.Counter()
        for p in paths:
            for e in _timed(_load(p)["traceEvents"]):
                want[(e["ph"], e.get("cat"), e.get("name"), e.get("dur"),
                      round(e["ts"] - base_us + shifts[r]["shift_us"], 3))] += 1
        got = collections.Counter((e["ph"], e.get("cat"), e.get("name"), e.get("dur"), e["ts"])
                                  for e in merged if e["pid"] == r)
        if windows:
            assert not got - want and {k: n for k, n in (want - got).items() if k[0] not in "sf"} == {}
        else:
            assert got == want
        assert sum(want.values()) > 0
    assert {e["pid"] for e in merged} == set(views)
    return merged


def test_two_h200_ranks_merge_onto_one_clock(tmp_path):
    views, calls = _views(two_gpu_sync_traces(), tmp_path)
    offsets = comm_wait.split(calls)["clock_offsets"]
    assert offsets == [{"ranks": [0, 1], "median_end_difference_us": -0.372, "end_difference_mad_us": 4.577,
                        "calls": 3}]
    paths, shifts = write_merged_view(views, str(tmp_path / "all.json"), offsets, progress=False)
    assert shifts == {0: {"shift_us": 0.0, "aligned_by": "reference"},
                      1: {"shift_us": 0.372, "aligned_by": "collective ends", "path": offsets}}
    merged = _check_against_views(paths, views, shifts)
    # the ranks rewritten in worker processes give the same file
    (in_workers,), _ = write_merged_view(views, str(tmp_path / "all2.json"), offsets, jobs=2, progress=False)
    assert open(in_workers).read() == open(paths[0]).read()
    data = _load(paths[0])
    names = {(e["pid"], e["name"]): e["args"] for e in data["traceEvents"] if e["ph"] == "M" and e["tid"] == 0}
    assert names[(0, "process_name")] == {"name": "rank 0"} and names[(1, "process_name")] == {"name": "rank 1"}
    tracks = [e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"
              and e["pid"] == 1]
    assert tracks == ["host 1644: Annotations: thread 1644 (python3)",
                      "host 1644: thread 1844 (python3, pt_autograd_1)",
                      "host 1644: Annotations: thread 1844 (python3, pt_autograd_1)",
                      "GPU 1: CUDA sync: Device 1", "GPU 1: stream 7", "GPU 1: CUDA sync: stream 7", "GPU 1: stream 89"]
    # no tid of one rank is another's (tools that key threads by tid alone would nest one rank's ops in another's):
    # the j-th track of the k-th of 2 ranks is tid 2j + k
    tids = {r: sorted({e["tid"] for e in data["traceEvents"] if e["pid"] == r and e["tid"]}) for r in (0, 1)}
    assert not set(tids[0]) & set(tids[1])
    assert tids == {r: [2 * j + r for j in range(1, len(tids[r]) + 1)] for r in (0, 1)} and len(tids[1]) == len(tracks)
    # flow arrows stay within their rank: both ends of each on one process
    ends = collections.defaultdict(set)
    for e in merged:
        if e["ph"] in "sf":
            ends[(e["cat"], e["id"])].add(e["pid"])
    assert ends and all(len(p) == 1 for p in ends.values())


def test_a_rank_on_another_clock_is_aligned_by_its_collectives(tmp_path):
    """Rank 1's trace moved 5 ms ahead (a host whose clock is off): the merged view brings its NCCL kernels back to
    where rank 0's end, within the spread of single calls."""
    src = _load(two_gpu_sync_traces()[1])
    for e in src["traceEvents"]:
        if "ts" in e:
            e["ts"] += 5000.0
    skewed = tmp_path / "rank1.json"
    skewed.write_text(json.dumps(src))
    views, calls = _views([two_gpu_sync_traces()[0], skewed], tmp_path)
    offsets = comm_wait.split(calls)["clock_offsets"]
    assert offsets[0]["median_end_difference_us"] == pytest.approx(5000 - 0.372, abs=1e-3)
    paths, shifts = write_merged_view(views, str(tmp_path / "all.json.gz"), offsets, progress=False)
    assert shifts[1]["shift_us"] == pytest.approx(-5000 + 0.372, abs=1e-3)
    _check_against_views(paths, views, shifts)  # every event moved by its rank's shift
    # the calls comm_wait matched end on one clock again: their median end difference is the unskewed traces' -0.372
    g0, g1 = calls[0]["groups"], calls[1]["groups"]
    ends = [c1[1][-1][1] + shifts[1]["shift_us"] - c0[1][-1][1] for n in g0 if n in g1
            and len(g0[n]["calls"]) == len(g1[n]["calls"]) for c0, c1 in zip(g0[n]["calls"], g1[n]["calls"])]
    assert len(ends) == 3 and sorted(ends)[1] == pytest.approx(0.0, abs=1e-3)


def test_cpu_ranks_without_collective_kernels_keep_their_trace_clock(tmp_path):
    traces = [make_cpu_trace(tmp_path / f"r{r}.json", n_mbs=2 + r, seed=r) for r in (0, 1)]
    views, calls = _views(traces, tmp_path)
    assert comm_wait.split(calls) is None
    # a window far smaller than the file: cut into time windows, each a valid trace, all events once
    paths, shifts = write_merged_view(views, str(tmp_path / "all.json"), None, max_view_bytes=20_000, progress=False)
    assert shifts[1] == {"shift_us": 0.0, "aligned_by": "trace clock"} and len(paths) > 1
    _check_against_views(paths, views, shifts, windows=True)


def test_large_merged_view_written_in_windows_in_the_one_pass(tmp_path, monkeypatch):
    """The two H200 ranks merged under a limit of a third of their merged file: written straight into time windows
    (the two-pass rewrite is never called), each window holding, text for text and in order, what the one merged
    file holds in its time range (metadata in every window, flows whose ends fall in two windows in none), each
    under the limit."""
    views, calls = _views(two_gpu_sync_traces(), tmp_path)
    offsets = comm_wait.split(calls)["clock_offsets"]
    (whole,), _ = write_merged_view(views, str(tmp_path / "whole.json"), offsets, progress=False)
    limit = os.path.getsize(whole) // 3
    placed = []
    monkeypatch.setattr(merged_module, "window_cuts", lambda *a: placed.append(window_cuts(*a)) or placed[-1])
    monkeypatch.setattr(merged_module, "split_into_windows", lambda *a, **k: pytest.fail("two more passes"))
    paths, _ = write_merged_view(views, str(tmp_path / "all.json"), offsets, max_view_bytes=limit, jobs=2,
                                 progress=False)
    (cuts,) = placed
    expected = in_windows(whole, cuts)
    one = TraceReader(whole)
    n_whole = sum(1 for _ in one.events())
    n_meta = sum(1 for raw in expected[0] if json.loads(raw)["ph"] == "M")
    assert len(paths) == len(cuts) + 1 >= 3
    assert sum(map(len, expected)) < n_whole + (len(paths) - 1) * n_meta  # flows cross the windows' boundaries
    for part, want in zip(paths, expected):
        reader = TraceReader(part)
        texts = [raw for raw, _ in reader.events()]
        assert texts == want and reader.header == one.header
        assert sum(len(t) + 2 for t in texts if json.loads(t)["ph"] != "M") <= limit
        assert validate_trace(part) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".rank")]  # the converted ranks are gone


def test_shifts_chain_through_groups_and_name_unaligned_ranks():
    offsets = [{"ranks": [0, 2], "median_end_difference_us": 10.0, "end_difference_mad_us": 1.0, "calls": 4},
               {"ranks": [2, 3], "median_end_difference_us": -4.0, "end_difference_mad_us": 2.0, "calls": 5}]
    got = clock_shifts([0, 1, 2, 3], offsets, {0: 1000, 1: 3000, 2: 1000, 3: 1000})
    assert got[2] == {"shift_us": -10.0, "aligned_by": "collective ends", "path": offsets[:1]}
    assert got[3] == {"shift_us": -6.0, "aligned_by": "collective ends", "path": offsets}
    assert got[1] == {"shift_us": 2.0, "aligned_by": "trace clock"}  # its trace counts from 2000 ns later


def test_postprocess_writes_it_and_a_rerun_replaces_it(tmp_path):
    log = two_gpu_sync_log_dir(tmp_path)
    run = tmp_path / "run"
    s, rc = postprocess_trial(str(log), str(run), "kernel", 2, jobs=1)
    assert rc == 0 and s["merged_view"]["files"] == ["kernel_traces/all_ranks/all_ranks.trace.json"]
    assert [r["aligned_by"] for r in s["merged_view"]["ranks"]] == ["reference", "collective ends"]
    views = {t["rank"]: [str(run / p) for p in t["views"]["chrome"]] for t in s["kernel_traces"]}
    _check_against_views([run / s["merged_view"]["files"][0]], views, {r["rank"]: r for r in s["merged_view"]["ranks"]})
    assert "kernel_traces/all_ranks/all_ranks.trace.json" in (run / "profile_summary.md").read_text()
    s, rc = postprocess_trial(str(log), str(run), "kernel", 2, jobs=1, compress=True)
    assert rc == 0 and s["merged_view"]["files"] == ["kernel_traces/all_ranks/all_ranks.trace.json.gz"]
    assert sorted(p.name for p in (run / "kernel_traces" / "all_ranks").iterdir()) == ["all_ranks.trace.json.gz"]
    assert not [p for p in run.iterdir() if p.name.startswith(".staging")]
    # one rank's trace only: nothing to merge, the earlier all-ranks file is left as it is
    shutil.rmtree(log / "perf_tracer")
    (log / "perf_tracer").mkdir()
    shutil.copy(two_gpu_sync_traces()[0], log / "perf_tracer")
    s, rc = postprocess_trial(str(log), str(run), "kernel", 2, jobs=1)
    assert s["merged_view"] is None and (run / "kernel_traces" / "all_ranks" / "all_ranks.trace.json.gz").exists()
    # ... and said to be an earlier postprocess's, in one warning (it used to stand beside the new views unnamed)
    assert [w for w in s["warnings"] if "all_ranks" in w["file"]] == [
        {"file": "kernel_traces/all_ranks/all_ranks.trace.json.gz", "warning": "an earlier postprocess's all-ranks "
         "view, left in place: not rebuilt this time, as this postprocess wrote the views of 1 rank(s) only (it merges "
         "two or more); it may not match this summary's traces"}]
