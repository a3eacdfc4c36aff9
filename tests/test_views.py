"""Trace views on real traces: the H200 reference trace(s) and CPU traces profiled in the test."""
import bisect
import collections
import gzip
import json
import os

import pytest

from fixtures import gpu_trace_fixtures, in_windows, make_cpu_trace, two_gpu_sync_traces
from sftprof.analysis.trace import io as trace_io
from sftprof.analysis.trace.io import TraceFormatError, TraceReader
from sftprof.analysis.trace.check import MAX_TID, validate_trace
from sftprof.analysis.views import split as split_module, windows
from sftprof.analysis.views.windows import sample_events, split_into_windows
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer
from sftprof.analysis.trial import traces
from sftprof.analysis.trial.traces import _process_trace
from sftprof.analysis.views.split import MAX_VIEW_BYTES, VIEWS, _empty_view_event, split_trace, view_path

GPU_TRACES = gpu_trace_fixtures() + two_gpu_sync_traces()


def _load(path):
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=GPU_TRACES, ids=lambda p: p.name)
def gpu_split(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("views")
    paths = split_trace(str(request.param), str(out), 0, progress=False)
    return _load(request.param), {v: _load(p[0]) for v, p in paths.items()}, paths, request.param


def test_reader_matches_json_load(tmp_path, monkeypatch):
    src = GPU_TRACES[0]
    ref = _load(src)
    reader = TraceReader(src)
    events = [ev for _, ev in reader.events()]
    assert events == ref["traceEvents"]
    assert reader.header == {k: v for k, v in ref.items() if k != "traceEvents"}
    # Tiny chunks force every event and number across a chunk boundary.
    cpu = make_cpu_trace(tmp_path / "cpu.json")
    monkeypatch.setattr(trace_io, "_CHUNK_CHARS", 37)
    raws = list(TraceReader(cpu).events())
    assert [ev for _, ev in raws] == _load(cpu)["traceEvents"]
    assert all(json.loads(raw) == ev for raw, ev in raws)
    # Chunks just above the fast path's margin: the reader refills before each chunk's end, many times over.
    monkeypatch.setattr(trace_io, "_CHUNK_CHARS", 70_000)
    raws = list(TraceReader(src).events())
    assert [ev for _, ev in raws] == ref["traceEvents"]
    assert all(json.loads(raw) == ev for raw, ev in raws)


def test_views_and_summary_side_by_side_are_those_of_one_pass(tmp_path):
    """The views written by a worker while the summary reads the trace again (``beside``) are byte for byte, and
    the summary is member for member, those of the one pass; on a real trace given a non-finite number, an invalid
    event, an untimed kernel and an unpaired flow, so that every callback of the pass has something to say."""
    trace = _load(GPU_TRACES[0])
    events = trace["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    kernels[3]["args"]["grid"] = [float("nan"), 1, 1]
    kernels[5]["ts"], kernels[5]["dur"] = 0, 0
    next(e for e in events if e.get("cat") == "cpu_op")["dur"] = -1.0
    events.append({"ph": "s", "cat": "ac2g", "id": 987654321, "pid": 0, "tid": 0, "ts": events[-1].get("ts", 0),
                   "name": "ac2g"})
    src = tmp_path / "rank0.pt.trace.json"
    src.write_text(json.dumps(trace))  # NaN written as the profiler writes it
    step = next((int(e["name"].split("#")[1]) for e in events if str(e.get("name")).startswith("ProfilerStep#")), 0)
    out = {}
    for beside in (False, True):
        folder = tmp_path / f"beside_{beside}" / "kernel_traces"
        out[beside] = _process_trace(str(src), str(folder), 0, False, MAX_VIEW_BYTES, step, (None, "unknown"),
                                     beside=beside)
    one, two = out[False], out[True]
    repairs = one["summary"]["view_repairs"]
    assert "error" not in one and repairs == two["summary"]["view_repairs"]
    assert repairs["non-finite numbers written as null"] == 1 and set(repairs) == {
        "non-finite numbers written as null", "unpaired flow events left out", "profiler bookkeeping events left out"}
    assert one["summary"]["invalid_events"]["total"] == two["summary"]["invalid_events"]["total"] == 2
    assert one["summary"] == two["summary"] and one["calls"] == two["calls"]
    for view in VIEWS:
        (a,), (b,) = one["views"][view], two["views"][view]
        assert open(a, "rb").read() == open(b, "rb").read()


def test_views_error_comes_first_when_both_halves_fail(tmp_path, monkeypatch):
    """A trace whose views and summary both fail is reported with the views' error in both paths (side by side, the
    summary's questions are answered while the views are written: their error must not hide the views')."""
    src = tmp_path / "rank0.pt.trace.json"
    src.write_text(json.dumps(_load(GPU_TRACES[0])))

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def questions_fail(self):
        raise RuntimeError("the summary's questions failed")

    monkeypatch.setattr(traces, "split_trace", no_space)  # the worker is forked: it sees the patch too
    monkeypatch.setattr(KernelTraceAnalyzer, "summary", questions_fail)
    for beside in (False, True):
        out = _process_trace(str(src), str(tmp_path / f"beside_{beside}" / "kernel_traces"), 0, False,
                             MAX_VIEW_BYTES, 0, (None, "unknown"), beside=beside)
        assert "No space left on device" in out["error"] and "questions" not in out["error"], (beside, out["error"])


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_traces_raise_naming_the_file(tmp_path, cut):
    data = gzip.decompress(GPU_TRACES[0].read_bytes())
    plain = tmp_path / "traces-r3.chrome.json"
    plain.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(TraceFormatError, match="traces-r3.chrome.json"):
        for _ in TraceReader(plain).events():
            pass
    gz = tmp_path / "traces-r4.chrome.json.gz"
    gz.write_bytes(GPU_TRACES[0].read_bytes()[: int(GPU_TRACES[0].stat().st_size * cut)])
    with pytest.raises(TraceFormatError, match="traces-r4.chrome.json.gz"):
        for _ in TraceReader(gz).events():
            pass


def test_failed_split_leaves_no_partial_views(tmp_path):
    data = gzip.decompress(GPU_TRACES[0].read_bytes())
    src = tmp_path / "t.json"
    src.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError):
        split_trace(str(src), str(tmp_path / "out"), 0, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def _counts(events):
    return collections.Counter((e.get("ph"), e.get("cat")) for e in events)


def _tracked(e):
    return isinstance(e.get("pid"), int) and 0 <= e["pid"] < 2**31 and isinstance(e.get("tid"), int)


def _paired_flows(events):
    ends = collections.defaultdict(list)
    for e in events:
        if e.get("ph") in ("s", "f") and e.get("cat") in ("ac2g", "fwdbwd") and _tracked(e):
            ends[(e["cat"], e["id"])].append(e["ph"])
    return {k for k, v in ends.items() if sorted(v) == ["f", "s"]}


def _sync_ends(events):
    """``(pid, tid, correlation)`` of the CUDA sync events: where their ac2g arrows end."""
    return {(e["pid"], e["tid"], e["args"]["correlation"]) for e in events if e.get("cat") == "cuda_sync"}


def _is_sync_end(e, sync_ends):
    return e.get("cat") == "ac2g" and e.get("ph") == "f" and (e["pid"], e["tid"], e["id"]) in sync_ends


def test_every_view_passes_the_trace_event_format_rules(gpu_split):
    _, _, paths, _ = gpu_split
    for v in VIEWS:
        assert validate_trace(paths[v][0]) == [], v


def test_views_content(gpu_split):
    src, views, _, _ = gpu_split
    ev = src["traceEvents"]
    full = views["chrome"]["traceEvents"]
    # Everything but profiler bookkeeping and unpaired flow ends, unchanged except the track of
    # annotations, CUDA sync events and the ac2g arrow ends at those syncs.
    paired = _paired_flows(ev)
    sync_ends = _sync_ends(ev)
    keep = [e for e in ev if _tracked(e) and e["ph"] not in ("M", "s", "f", "t")]
    flows = [e for e in ev if e.get("ph") in ("s", "f") and (e.get("cat"), e.get("id")) in paired]
    assert len(flows) == 2 * len(paired) > 0

    sync_ids = {c for _, _, c in sync_ends}

    def moved(e):  # (the moved events' tids differ: compare arrow ends by id)
        return e.get("cat") in ("user_annotation", "cuda_sync") or \
            (e.get("cat") == "ac2g" and e["ph"] == "f" and e["id"] in sync_ids)

    def no_tid(e):
        return json.dumps({k: v for k, v in e.items() if k != "tid" or not moved(e)}, sort_keys=True)

    assert sorted(map(no_tid, [e for e in full if e["ph"] != "M"])) == sorted(map(no_tid, keep + flows))
    for cat in ("user_annotation", "cuda_sync"):
        got = [e for e in full if e.get("cat") == cat]
        assert len(got) == _counts(ev)[("X", cat)] and all(e["tid"] > MAX_TID - 16 for e in got), cat
    assert {k: v for k, v in views["chrome"].items() if k != "traceEvents"} == \
        {k: v for k, v in src.items() if k != "traceEvents"}
    src_counts = _counts(ev)
    # The profiler's step slices are in every view (HTA and TensorBoard look for them).
    steps = sorted(e["name"] for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    for v in VIEWS:
        assert sorted(e["name"] for e in views[v]["traceEvents"] if e.get("cat") == "user_annotation"
                      and e["name"].startswith("ProfilerStep#")) == steps, v
    gpu = views["gpu_only.chrome"]["traceEvents"]
    assert [e["name"] for e in gpu if e.get("cat") == "user_annotation"] == steps
    assert {c for _, c in _counts(gpu) if c} <= {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_sync",
                                                 "user_annotation"}
    for cat in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_sync"):
        assert _counts(gpu)[("X", cat)] == src_counts[("X", cat)]
    gpu_pids = {e["pid"] for e in gpu if e["ph"] != "M"}
    assert {e["pid"] for e in gpu if e["ph"] == "M"} <= gpu_pids  # only GPU track metadata
    cpu = views["cpu_only.chrome"]["traceEvents"]
    assert not any(e.get("cat") in ("kernel", "cuda_runtime", "cuda_driver", "ac2g") for e in cpu)
    assert _counts(cpu)[("X", "cpu_op")] == src_counts[("X", "cpu_op")]
    api = [e for e in views["cuda_api_only.chrome"]["traceEvents"] if e.get("cat") != "user_annotation"]
    assert {e.get("cat") for e in api if e["ph"] != "M"} == {"cuda_runtime", "cuda_driver"}
    assert len([e for e in api if e["ph"] != "M"]) == src_counts[("X", "cuda_runtime")] + src_counts[("X", "cuda_driver")]


def test_thread_renamed_during_the_trace_gets_one_label(gpu_split):
    src, views, _, _ = gpu_split
    renamed = collections.defaultdict(list)
    for e in src["traceEvents"]:
        if e.get("name") == "thread_name":
            renamed[(e["pid"], e["tid"])].append(e["args"]["name"])
    (track, names), = [(t, n) for t, n in renamed.items() if len(n) > 1]  # both fixtures: the autograd thread
    inner = ", ".join(n.split("(", 1)[1].rstrip(")") for n in names)
    for v in ("chrome", "cpu_only.chrome", "cuda_api_only.chrome"):
        labels = [e["args"]["name"] for e in views[v]["traceEvents"]
                  if e.get("name") == "thread_name" and (e["pid"], e["tid"]) == track]
        assert labels == [f"thread {track[1]} ({inner})"], v
    clean = [e["args"]["name"] for e in views["split_clean.chrome"]["traceEvents"]
             if e.get("name") == "thread_name" and e["pid"] == track[0]]
    assert f"CPU ops: thread {track[1]} ({inner})" in clean
    assert f"CUDA API (runtime/driver): thread {track[1]} ({inner})" in clean


def test_split_clean_tracks_and_flows(gpu_split):
    src, views, _, _ = gpu_split
    clean = views["split_clean.chrome"]["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in clean if e.get("name") == "thread_name"}
    tracks = collections.defaultdict(set)
    for e in clean:
        if e["ph"] == "X":
            tracks[e["cat"]].add((e["pid"], e["tid"]))
    api = tracks["cuda_runtime"] | tracks["cuda_driver"]
    gpu = tracks["kernel"] | tracks["gpu_memcpy"] | tracks["gpu_memset"]
    ann = tracks["user_annotation"]
    sync = tracks["cuda_sync"]
    assert api and gpu and tracks["cpu_op"] and len(ann) == len({(e["pid"], e["tid"]) for e in src["traceEvents"]
                                                                 if e.get("cat") == "user_annotation"})
    groups = (api, gpu, ann, tracks["cpu_op"], sync)
    assert all(not a & b for i, a in enumerate(groups) for b in groups[i + 1:])
    assert all(names[t].startswith("CUDA API") for t in api)
    assert all(names[t].startswith("CPU ops") for t in tracks["cpu_op"])
    assert all(names[t].startswith("Annotations: thread ") for t in ann)
    assert all(names[t].startswith("GPU ") for t in gpu)
    src_sync = {(e["pid"], e["tid"]) for e in src["traceEvents"] if e.get("cat") == "cuda_sync"}
    assert len(sync) == len(src_sync) and all(names[t].startswith(f"GPU {t[0]} CUDA sync: ") for t in sync)
    # Made-up tracks: 32-bit, counting down from 2**31 - 1, no real tid of the process reused.
    real = {(e["pid"], e["tid"]) for e in src["traceEvents"] if _tracked(e)}
    made_up = api | ann | sync
    assert all(MAX_TID - len(made_up) < t <= MAX_TID for _, t in made_up) and not made_up & real
    # Every paired ac2g flow: start inside a CUDA API call on its own track, end on a GPU activity, a CUDA
    # sync event (at its start, on the sync's track) or an API call.
    calls = collections.defaultdict(list)
    gpu_starts = set()
    sync_starts = {(e["pid"], e["tid"], e["ts"]) for e in clean if e.get("cat") == "cuda_sync"}
    for e in clean:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            calls[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu_starts.add((e["pid"], e["tid"], e["ts"]))
    for c in calls.values():
        c.sort()

    def in_call(e):  # API calls of one thread do not overlap: the last one starting at or before ts
        c = calls[(e["pid"], e["tid"])]
        i = bisect.bisect_right(c, (e["ts"], float("inf"))) - 1
        return i >= 0 and c[i][0] <= e["ts"] <= c[i][1]

    starts = [e for e in clean if e.get("cat") == "ac2g" and e["ph"] == "s"]
    ends = [e for e in clean if e.get("cat") == "ac2g" and e["ph"] == "f"]
    assert len(starts) == len(ends) == len([k for k in _paired_flows(src["traceEvents"]) if k[0] == "ac2g"]) > 0
    assert all(in_call(s) for s in starts)
    on_gpu = [f for f in ends if (f["pid"], f["tid"], f["ts"]) in gpu_starts]
    on_sync = [f for f in ends if (f["pid"], f["tid"], f["ts"]) in sync_starts]
    on_api = [f for f in ends if in_call(f)]
    assert on_gpu and len(on_gpu) + len(on_sync) + len(on_api) == len(ends)
    src_sync_ends, src_paired = _sync_ends(src["traceEvents"]), _paired_flows(src["traceEvents"])
    assert len(on_sync) == len([e for e in src["traceEvents"] if _is_sync_end(e, src_sync_ends)
                                and (e["cat"], e["id"]) in src_paired])


def test_compressed_views_equal_plain(gpu_split, tmp_path):
    _, _, plain, src = gpu_split
    paths = split_trace(str(src), str(tmp_path), 0, compress=True, progress=False)
    for v in VIEWS:
        assert paths[v] == [view_path(str(tmp_path), 0, v, compress=True)]
        with open(plain[v][0], "rb") as f:
            assert gzip.decompress(open(paths[v][0], "rb").read()) == f.read()


def test_large_view_is_split_into_time_windows(gpu_split, tmp_path):
    _, views, paths, _ = gpu_split
    limit = os.path.getsize(paths["gpu_only.chrome"][0]) // 4
    copy = tmp_path / "gpu_only" / "rank0.pt.trace.json"
    copy.parent.mkdir()
    copy.write_bytes(open(paths["gpu_only.chrome"][0], "rb").read())
    parts = split_into_windows(str(copy), limit, progress=False)
    assert parts == [str(tmp_path / f"gpu_only.part{k}" / "rank0.pt.trace.json") for k in range(len(parts))]
    assert len(parts) >= 3
    assert not copy.exists()
    whole = views["gpu_only.chrome"]["traceEvents"]
    meta = sorted(json.dumps(e) for e in whole if e["ph"] == "M")
    got, last_end = [], float("-inf")
    for p in parts:
        ev = _load(p)["traceEvents"]
        body = [e for e in ev if e["ph"] != "M"]
        assert sorted(json.dumps(e) for e in ev if e["ph"] == "M") == meta
        assert sum(len(json.dumps(e)) for e in body) <= 1.2 * limit
        assert min(e["ts"] for e in body) >= last_end
        last_end = max(e["ts"] for e in body)
        got += body
    assert sorted(map(json.dumps, got)) == sorted(json.dumps(e) for e in whole if e["ph"] != "M")
    assert all(validate_trace(p) == [] for p in parts)


def test_large_views_written_in_windows_in_the_one_pass(gpu_split, tmp_path, monkeypatch):
    """A limit under the sizes of chrome, split_clean and cpu_only (a third of the trace's text): those three are
    written straight into time windows by the one pass (the two-pass rewrite is never called), each window holding,
    text for text and in order, what the one-file view holds in its time range (metadata in every window, flows whose
    ends fall in two windows in none), each under the limit; the other views stay one file, byte for byte as
    without a limit."""
    _, _, paths, src = gpu_split
    limit = os.path.getsize(paths["chrome"][0]) // 3
    monkeypatch.setattr(split_module, "split_into_windows", lambda *a, **k: pytest.fail("two more passes"))
    plan = split_module._window_plan(str(src), limit)
    assert {v for v, cuts in plan.items() if cuts} == {"chrome", "split_clean.chrome", "cpu_only.chrome"}
    got = split_trace(str(src), str(tmp_path), 0, max_view_bytes=limit, progress=False)
    cut_flows = 0
    for view in VIEWS:
        if not plan[view]:
            assert got[view] == [view_path(str(tmp_path), 0, view)]
            assert open(got[view][0], "rb").read() == open(paths[view][0], "rb").read()
            continue
        assert got[view] == [windows.window_path(view_path(str(tmp_path), 0, view), k)
                             for k in range(len(plan[view]) + 1)]
        expected = in_windows(paths[view][0], plan[view])
        whole = TraceReader(paths[view][0])
        n_whole = sum(1 for _ in whole.events())
        for part, want in zip(got[view], expected):
            reader = TraceReader(part)
            texts = [raw for raw, _ in reader.events()]
            assert texts == want and reader.header == whole.header
            assert sum(len(t) + 2 for t in texts if json.loads(t)["ph"] != "M") <= limit
            assert validate_trace(part) == []
        cut_flows += n_whole - sum(len(w) for w in expected) + (len(expected) - 1) * sum(
            1 for raw in expected[0] if json.loads(raw)["ph"] == "M")
    assert cut_flows > 0  # the test crosses flows over window boundaries


def test_view_found_large_after_the_pass_is_windowed_then(gpu_split, tmp_path, monkeypatch):
    """A view the first look puts under the limit (here: a plan of no windows) but written above it is rewritten into
    windows after the pass, as before the first look existed."""
    _, _, paths, src = gpu_split
    limit = os.path.getsize(paths["gpu_only.chrome"][0]) // 2
    monkeypatch.setattr(split_module, "_window_plan", lambda src, limit: {v: [] for v in VIEWS})
    got = split_trace(str(src), str(tmp_path), 0, max_view_bytes=limit, progress=False)
    windowed = {v for v, p in got.items() if len(p) > 1}
    assert {"chrome", "gpu_only.chrome"} <= windowed <= {v for v in VIEWS if os.path.getsize(paths[v][0]) > limit}
    assert all(validate_trace(p) == [] for p in got["gpu_only.chrome"])


def test_first_look_samples(gpu_split, tmp_path, monkeypatch):
    """sample_events reads the same events from a compressed trace (streamed), its plain text read whole, and read
    around each offset; a stream whose size is guessed 8x too small keeps at most 2n entries, those of the final
    stride; the estimate of each view's bytes is the view's size within the sampling error."""
    _, _, paths, src = gpu_split
    plain = tmp_path / "trace.json"
    plain.write_bytes(gzip.decompress(src.read_bytes()))
    entry = lambda ev: (ev.get("ts"), split_module._views_of(ev))  # noqa: E731
    stride, gz = sample_events(str(src), entry)
    assert (stride, gz) == sample_events(str(plain), entry)
    monkeypatch.setattr(windows, "_WHOLE", 0)
    assert (stride, gz) == sample_events(str(plain), entry)
    assert len(gz) == windows.SAMPLES and stride == plain.stat().st_size / windows.SAMPLES
    assert sum(e is None for e in gz) < 0.01 * len(gz)
    sep = b"},\n  {"
    with open(plain, "rb") as f:
        small_stride, small = windows._sample_stream(f, plain.stat().st_size // 8, sep, entry, 512)
    with open(plain, "rb") as f:
        assert (small_stride, small) == windows._sample_stream(f, int(small_stride * 512), sep, entry, 512)
    assert 512 <= len(small) < 1024 and small_stride == plain.stat().st_size // 8 / 512 * 8
    for view in VIEWS:  # within 4 standard deviations of the count, and 1 % for the metadata the views add
        count = sum(1 for e in gz if e is not None and view in e[1])
        assert abs(stride * count - os.path.getsize(paths[view][0])) <= 4 * stride * count ** 0.5 + \
            0.01 * os.path.getsize(paths[view][0])


def test_cpu_trace_views(tmp_path):
    src = make_cpu_trace(tmp_path / "cpu.json")
    paths = split_trace(str(src), str(tmp_path / "out"), 1, progress=False)
    ref = _load(src)["traceEvents"]
    cpu = _load(paths["cpu_only.chrome"][0])["traceEvents"]
    assert _counts(cpu)[("X", "user_annotation")] == _counts(ref)[("X", "user_annotation")] == 8
    # Nothing selected: the one record saying so (HTA loads it). With a profiler step slice (a kernel trial on
    # CPU) the views keep that slice, its process's records and its track's name beside the record, so that
    # TensorBoard's profiler plugin finds the step (without it, its overview's step total is -2**64 + 1 us).
    stepped = split_trace(str(make_cpu_trace(tmp_path / "cpu_step.json", profiler_step=True)), str(tmp_path / "step"), 1,
                          progress=False)
    cpu_step = _load(stepped["cpu_only.chrome"][0])["traceEvents"]
    (step,) = [e for e in cpu_step if e["name"].startswith("ProfilerStep#")]
    assert step["name"] == "ProfilerStep#0" and step["cat"] == "user_annotation"
    step_meta = [e for e in cpu_step if e["ph"] == "M" and e["pid"] == step["pid"] and
                 (e["name"].startswith("process_") or e["tid"] == step["tid"])]
    assert [(e["name"], e["args"]) for e in step_meta] == [
        ("process_name", {"name": "python"}), ("process_labels", {"labels": "CPU"}),
        ("process_sort_index", {"sort_index": step["pid"]}),
        ("thread_name", {"name": f"Annotations: thread {step['pid']} (python)"})]
    for view in ("gpu_only", "cuda_api_only"):
        assert _load(paths[f"{view}.chrome"][0])["traceEvents"] == [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0, "dur": 0, "cat": "__metadata",
             "args": {"name": f"{view}: no events in this trace"}}]
        assert _load(stepped[f"{view}.chrome"][0])["traceEvents"] == [step] + step_meta + [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0, "dur": 0, "cat": "__metadata",
             "args": {"name": f"{view}: no events in this trace but the profiler step"}}]
    assert all(validate_trace(p[v][0]) == [] for p in (paths, stepped) for v in VIEWS)
    assert json.loads(_empty_view_event("gpu_only.chrome", {0, 2}))["pid"] == 1  # a pid the step slices do not use
    # split_trace windows any view above the limit, and only those.
    small = split_trace(str(src), str(tmp_path / "win"), 1, max_view_bytes=20_000, progress=False)
    assert len(small["cpu_only.chrome"]) > 1 and len(small["gpu_only.chrome"]) == 1
    got = [e for p in small["cpu_only.chrome"] for e in _load(p)["traceEvents"] if e["ph"] != "M"]
    flows = [e for e in cpu if e["ph"] in ("s", "f")]
    cut = {e["id"] for e in flows} - {e["id"] for e in got if e["ph"] in ("s", "f")}
    assert sorted(map(json.dumps, got)) == sorted(json.dumps(e) for e in cpu if e["ph"] != "M" and
                                                  not (e["ph"] in ("s", "f") and e["id"] in cut))
    assert all(validate_trace(p) == [] for v in VIEWS for p in small[v])  # windows leave out the flows they cut


@pytest.mark.parametrize("text,events,header", [
    ('{"traceEvents": [], "traceName": "x"}', [], {"traceName": "x"}),
    ('[{"ph": "X", "ts": 1, "dur": 2e0}, {"ph": "i", "ts": 12345678901234567890}]',
     [{"ph": "X", "ts": 1, "dur": 2.0}, {"ph": "i", "ts": 12345678901234567890}], {}),
    ('{"a": {"b": [1, "]"]}, "traceEvents": [{"name": "\\u00e9\\"]"}]}', [{"name": "é\"]"}], {"a": {"b": [1, "]"]}}),
])
def test_reader_formats(tmp_path, text, events, header):
    p = tmp_path / "t.json"
    p.write_text(text)
    reader = TraceReader(p)
    assert [ev for _, ev in reader.events()] == events
    assert reader.header == header


@pytest.mark.parametrize("text,msg", [
    ('{"traceEvents": [{"ph": "X"}] } trailing', "trailing data"),
    ('{"schemaVersion": 1}', "no 'traceEvents'"),
    ('{"traceEvents": [1, 2]}', "not a JSON object"),
    ('{"traceEvents": [{"ph": "X"}', "truncated"),
])
def test_reader_rejects_malformed(tmp_path, text, msg):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(TraceFormatError, match=msg):
        list(TraceReader(p).events())


def test_flow_pairs_answer_each_event_in_the_order_added_as_a_set_of_paired_ids_did():
    """A flow event is paired when its (cat, id) has exactly one start and one end: asked in the order the events
    were added (one byte an event, not a set of the paired ids), int ids and others, repeated and lone ends."""
    events = [("ac2g", 1, "s", 0), ("ac2g", 2, "s", 0), ("fwdbwd", 1, "s", 0), ("ac2g", 2, "s", 1),
              ("ac2g", 1, "f", 2), ("ac2g", 3, "f", 0), ("fwdbwd", 1, "f", 0), ("ac2g", 2, "f", 1),
              ("ac2g", "x", "s", 0), ("ac2g", "x", "f", 1), ("fwdbwd", -4, "f", 0), ("fwdbwd", -4, "s", 0),
              ("ac2g", 2**70, "s", 0), ("ac2g", 2**70, "f", 0)]
    pairs = split_module._FlowPairs()
    for cat, fid, ph, slot in events:
        pairs.add(cat, fid, ph, slot)
    pairs.finish()
    counts = collections.Counter((cat, json.dumps(fid), ph) for cat, fid, ph, _ in events)
    want = [counts[(cat, json.dumps(fid), "s")] == 1 and counts[(cat, json.dumps(fid), "f")] == 1
            for cat, fid, _, _ in events]
    assert [pairs.paired(cat, fid, ph) for cat, fid, ph, _ in events] == want
    assert want == [True, False, True, False, True, False, True, False, True, True, True, True, True, True]
    assert pairs.apart("ac2g", 1) == (0, 2) and pairs.apart("ac2g", "x") == (0, 1) and pairs.apart("fwdbwd", 1) is None
