"""Trace views on real traces: the H200 reference trace(s) and CPU traces profiled in the test."""
import collections
import gzip
import json
import os

import pytest

from fixtures import gpu_trace_fixtures, make_cpu_trace
from sftprof.profiling import trace_io
from sftprof.profiling.trace_io import TraceFormatError, TraceReader
from sftprof.profiling.views import API_TID_OFFSET, VIEWS, split_into_windows, split_trace, view_path

GPU_TRACES = gpu_trace_fixtures()


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


def test_views_content(gpu_split):
    src, views, _, _ = gpu_split
    ev = src["traceEvents"]
    full = views["chrome"]["traceEvents"]
    assert sorted(map(json.dumps, full)) == sorted(map(json.dumps, ev))  # same events, only reordered
    assert {k: v for k, v in views["chrome"].items() if k != "traceEvents"} == \
        {k: v for k, v in src.items() if k != "traceEvents"}
    src_counts = _counts(ev)
    gpu = views["gpu_only.chrome"]["traceEvents"]
    assert {c for _, c in _counts(gpu) if c} <= {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
    for cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        assert _counts(gpu)[("X", cat)] == src_counts[("X", cat)]
    gpu_pids = {e["pid"] for e in gpu if e["ph"] != "M"}
    assert {e["pid"] for e in gpu if e["ph"] == "M"} <= gpu_pids  # only GPU track metadata
    cpu = views["cpu_only.chrome"]["traceEvents"]
    assert not any(e.get("cat") in ("kernel", "cuda_runtime", "cuda_driver", "ac2g") for e in cpu)
    assert _counts(cpu)[("X", "cpu_op")] == src_counts[("X", "cpu_op")]
    api = views["cuda_api_only.chrome"]["traceEvents"]
    assert {e.get("cat") for e in api if e["ph"] != "M"} == {"cuda_runtime", "cuda_driver"}
    assert len([e for e in api if e["ph"] != "M"]) == src_counts[("X", "cuda_runtime")] + src_counts[("X", "cuda_driver")]


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
    assert api and gpu and tracks["cpu_op"]
    assert not api & tracks["cpu_op"] and not gpu & tracks["cpu_op"] and not api & gpu
    assert all(names[t].startswith("CUDA API") for t in api)
    assert all(names[t].startswith("CPU ops") for t in tracks["cpu_op"])
    assert all(names[t].startswith("GPU ") for t in gpu)
    assert all(t[1] >= API_TID_OFFSET for t in api)
    # Every ac2g flow start still lies inside a CUDA API call on its own track, every end on a GPU activity.
    calls = collections.defaultdict(list)
    gpu_starts = set()
    for e in clean:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            calls[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu_starts.add((e["pid"], e["tid"], e["ts"]))
    starts = [e for e in clean if e.get("cat") == "ac2g" and e["ph"] == "s"]
    ends = [e for e in clean if e.get("cat") == "ac2g" and e["ph"] == "f"]
    assert len(starts) == _counts(src["traceEvents"])[("s", "ac2g")] > 0
    for s in starts:
        assert any(lo <= s["ts"] <= hi for lo, hi in calls[(s["pid"], s["tid"])]), s
    start_ids = {s["id"] for s in starts}
    matched = [f for f in ends if f["id"] in start_ids]
    assert matched and all((f["pid"], f["tid"], f["ts"]) in gpu_starts for f in matched)


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


def test_cpu_trace_views(tmp_path):
    src = make_cpu_trace(tmp_path / "cpu.json")
    paths = split_trace(str(src), str(tmp_path / "out"), 1, progress=False)
    ref = _load(src)["traceEvents"]
    cpu = _load(paths["cpu_only.chrome"][0])["traceEvents"]
    assert _counts(cpu)[("X", "user_annotation")] == _counts(ref)[("X", "user_annotation")] == 8
    for view in ("gpu_only", "cuda_api_only"):  # nothing selected: the one record saying so (HTA loads it)
        assert _load(paths[f"{view}.chrome"][0])["traceEvents"] == [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0, "dur": 0, "cat": "__metadata",
             "args": {"name": f"{view}: no events in this trace"}}]
    # split_trace windows any view above the limit, and only those.
    small = split_trace(str(src), str(tmp_path / "win"), 1, max_view_bytes=20_000, progress=False)
    assert len(small["cpu_only.chrome"]) > 1 and len(small["gpu_only.chrome"]) == 1
    got = [e for p in small["cpu_only.chrome"] for e in _load(p)["traceEvents"] if e["ph"] != "M"]
    assert sorted(map(json.dumps, got)) == sorted(json.dumps(e) for e in cpu if e["ph"] != "M")


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
