"""Trace folders open in the tools users already have: HTA (traceinsight 0.6.1; HolisticTraceAnalysis 0.5.0 earlier) and TensorBoard's profiler plugin.

Both are optional test extras (``pip install -e ".[test,peer-tools]"``); their tests skip when absent.
The inputs are a real H200 kernel trace of this project (``tests/fixtures``) and a real CPU trace,
laid out as postprocessing lays them out: the raw trace as ``raw/rank0.pt.trace.json[.gz]`` and the
views in ``kernel_traces/<view>/rank0.pt.trace.json``.
"""
import gzip
import json
import logging
import shutil

import pytest

from fixtures import gpu_trace_fixtures, make_cpu_trace, two_gpu_sync_log_dir, two_gpu_sync_traces
from sftprof.analysis.summary import postprocess_trial
from sftprof.artifacts import raw_trace_rank, trace_name, view_dir
from sftprof.analysis.views.split import VIEWS, split_trace

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


@pytest.fixture(scope="module", params=["h200_trace", "cpu_trace"])
def folders(request, tmp_path_factory):
    """``{folder name: path}`` of the raw folder and the five view folders, plus the GPU activity count."""
    base = tmp_path_factory.mktemp(f"peer_{request.param}")
    if request.param == "h200_trace":
        src = gpu_trace_fixtures()[0]
        raw = base / "raw" / trace_name(0, compress=True)
    else:
        src = make_cpu_trace(base / "cpu.json")
        raw = base / "raw" / trace_name(0)
    raw.parent.mkdir()
    shutil.copy(src, raw)
    split_trace(str(raw), str(base / "kernel_traces"), 0, progress=False)
    opener = gzip.open if str(raw).endswith(".gz") else open
    with opener(raw, "rt") as f:
        n_gpu = sum(1 for e in json.load(f)["traceEvents"] if e.get("cat") in GPU_CATS)
    out = {"raw": base / "raw"}
    out.update({v.removesuffix(".chrome"): base / "kernel_traces" / v.removesuffix(".chrome") for v in VIEWS})
    assert [view_dir(str(base / "kernel_traces"), v) for v in VIEWS] == [str(out[k]) for k in list(out)[1:]]
    return request.param, out, n_gpu


def test_hta_loads_every_folder_and_breaks_down_gpu_time(folders, caplog):
    pytest.importorskip("hta", reason="HTA (traceinsight) is an optional test extra")
    from hta.trace_analysis import TraceAnalysis

    kind, dirs, n_gpu = folders
    assert (n_gpu > 0) is (kind == "h200_trace")
    breakdowns = {}
    with caplog.at_level(logging.ERROR):
        for name, path in dirs.items():
            analysis = TraceAnalysis(trace_dir=str(path))
            assert sorted(analysis.t.traces) == [0], name  # one trace for rank 0: nothing dropped or mixed
            df = analysis.t.get_trace(0)
            with_gpu = name in ("raw", "chrome", "split_clean", "gpu_only")
            assert int((df["stream"] >= 0).sum()) == (n_gpu if with_gpu else 0), name
            if with_gpu and n_gpu:
                row = analysis.get_temporal_breakdown(visualize=False).to_dict("records")
                assert len(row) == 1 and row[0]["rank"] == 0 and row[0]["kernel_time(us)"] > 0
                breakdowns[name] = row[0]
    # HTA's temporal breakdown (0.5.0 and 0.6.1) needs at least one GPU kernel (it fails with IndexError without):
    # every folder with GPU work gives the same breakdown as the raw trace.
    if kind == "h200_trace":
        assert list(breakdowns) == ["raw", "chrome", "split_clean", "gpu_only"]
        assert all(b == breakdowns["raw"] for b in breakdowns.values())
    else:
        assert breakdowns == {}


def test_hta_two_ranks_with_cuda_sync_events_same_figures_in_every_gpu_folder(tmp_path, caplog):
    """The 2-GPU H200 excerpt: every folder docs/peer_tools.md names for HTA gives both ranks, the same GPU events
    (kernels, memcpy, memset and the stream-bound CUDA sync events) and the same figures as the raw folder."""
    pytest.importorskip("hta", reason="HTA (traceinsight) is an optional test extra")
    from hta.trace_analysis import TraceAnalysis

    raw = tmp_path / "raw"
    raw.mkdir()
    n_gpu = {}
    for rank, src in enumerate(two_gpu_sync_traces()):
        shutil.copy(src, raw / src.name)
        split_trace(str(src), str(tmp_path / "kernel_traces"), rank, progress=False)
        with gzip.open(src, "rt") as f:
            n_gpu[rank] = sum(1 for e in json.load(f)["traceEvents"] if e.get("cat") in GPU_CATS or
                              e.get("cat") == "cuda_sync" and e["args"]["stream"] >= 0)
    assert n_gpu == {0: 56, 1: 84}
    figures = {}
    for name in ("raw", "chrome", "split_clean", "gpu_only"):
        path = raw if name == "raw" else tmp_path / "kernel_traces" / name
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hta"):
            analysis = TraceAnalysis(trace_dir=str(path))
        assert "ProfilerStep not found" not in caplog.text, name  # the step slice is in gpu_only too
        assert sorted(analysis.t.traces) == [0, 1], name
        assert {r: int((analysis.t.get_trace(r)["stream"] >= 0).sum()) for r in (0, 1)} == n_gpu, name
        figures[name] = (analysis.get_temporal_breakdown(visualize=False).to_dict("records"),
                         analysis.get_comm_comp_overlap(visualize=False).to_dict("records"))
    breakdown, overlap = figures["raw"]
    assert [(b["rank"], b["kernel_time(us)"], b["idle_time(us)"]) for b in breakdown] == \
        [(0, 9651.0, 2628.0), (1, 12414.0, 2737.0)]
    assert all(f == figures["raw"] for f in figures.values())


def test_tensorboard_plugin_overview_finds_the_profiled_step_in_every_view(tmp_path):
    """TensorBoard's profiler plugin, through its own parser and run generator, on the 2-GPU H200 excerpt:
    every view of each rank is step 2 lasting ``ProfilerStep#2``'s duration, and the views with GPU work
    agree on the GPU figures."""
    pytest.importorskip("torch_tb_profiler", reason="TensorBoard's profiler plugin is an optional test extra")
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    step_us = {}
    for rank, src in enumerate(two_gpu_sync_traces()):
        split_trace(str(src), str(tmp_path / "kernel_traces"), rank, progress=False)
        with gzip.open(src, "rt") as f:
            (step,) = [e for e in json.load(f)["traceEvents"] if e.get("name") == "ProfilerStep#2"]
        step_us[rank] = round(step["dur"])
    assert step_us == {0: 3409121, 1: 3409727}
    for rank in (0, 1):
        gpu = {}
        for view in VIEWS:
            name = view.removesuffix(".chrome")
            data = RunProfileData.parse(f"rank{rank}", None, str(tmp_path / "kernel_traces" / name / trace_name(rank)),
                                        str(tmp_path))
            overview = RunGenerator(f"rank{rank}", None, data).generate_run_profile().overview
            assert [row[0] for row in overview["steps"]["rows"]] == ["2"], (name, rank)
            times = {c["name"]: c["value"] for c in overview["performance"][0]["children"]}
            assert overview["performance"][0]["value"] == step_us[rank], (name, rank)
            if name in ("chrome", "split_clean", "gpu_only"):
                gpu[name] = (times["Kernel"], times["Memcpy"], times["Memset"])
        assert len(set(gpu.values())) == 1 and gpu["chrome"][0] > 0, gpu


def test_tensorboard_plugin_reads_the_profiled_step_in_the_empty_views_of_a_cpu_trial(tmp_path):
    """A kernel trial on CPU: ``gpu_only`` and ``cuda_api_only`` select nothing but keep the profiler step slice,
    so the plugin's overview shows step 0 lasting ``ProfilerStep#0``'s duration, all of it "Other" (it showed a
    step total of -18446744073709551615 us when those views held only the record saying they are empty)."""
    pytest.importorskip("torch_tb_profiler", reason="TensorBoard's profiler plugin is an optional test extra")
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    src = make_cpu_trace(tmp_path / "cpu.json", profiler_step=True)
    split_trace(str(src), str(tmp_path / "kernel_traces"), 0, progress=False)
    (step,) = [e for e in json.loads(src.read_text())["traceEvents"] if e.get("name") == "ProfilerStep#0"]
    for name in ("gpu_only", "cuda_api_only"):
        data = RunProfileData.parse("rank0", None, str(tmp_path / "kernel_traces" / name / trace_name(0)), str(tmp_path))
        overview = RunGenerator("rank0", None, data).generate_run_profile().overview
        assert [row[0] for row in overview["steps"]["rows"]] == ["0"], name
        assert overview["performance"][0]["value"] == round(step["dur"]) > 0, name
        assert {c["name"]: c["value"] for c in overview["performance"][0]["children"]} == {
            "DataLoader": 0, "CPU Exec": 0, "Other": round(step["dur"])}, name


def test_tensorboard_plugin_pattern_lists_every_folder_as_a_run(folders):
    pytest.importorskip("torch_tb_profiler", reason="TensorBoard's profiler plugin is an optional test extra")
    from torch_tb_profiler import utils
    from torch_tb_profiler.consts import WORKER_PATTERN

    _, dirs, _ = folders
    for name, path in dirs.items():
        files = sorted(p.name for p in path.iterdir())
        assert len(files) == 1 and utils.is_chrome_trace_file(files[0]), (name, files)  # the plugin's run test
        assert WORKER_PATTERN.match(files[0]).group(1) == "rank0"
    # The names of earlier releases matched no run.
    assert not utils.is_chrome_trace_file("traces-r0.chrome.json")
    assert not utils.is_chrome_trace_file("traces-r0.split_clean.chrome.json")


def test_tensorboard_plugin_lists_no_all_ranks_run_and_reads_it_without_intersecting_ranges(tmp_path, caplog):
    """The 2x H200 excerpt postprocessed: ``--logdir RUN_DIR/kernel_traces`` lists one run per per-rank view and none
    for ``all_ranks`` (its file is no ``*.pt.trace.json``, so it is not taken for one worker's trace); read anyway,
    its ranks' threads do not share a ``tid`` (the plugin keys threads by ``tid`` alone: it logged hundreds of
    "ranges on the same thread should not intersect" errors when both ranks' tracks were numbered from 1)."""
    pytest.importorskip("torch_tb_profiler", reason="TensorBoard's profiler plugin is an optional test extra")
    from torch_tb_profiler import utils
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    s, rc = postprocess_trial(str(two_gpu_sync_log_dir(tmp_path)), str(tmp_path / "run"), "kernel", 2, jobs=1)
    assert rc == 0 and s["merged_view"]["files"] == ["kernel_traces/all_ranks/all_ranks.trace.json"]
    traces = tmp_path / "run" / "kernel_traces"
    listed = {p.parent.name for p in traces.rglob("*") if p.is_file() and utils.is_chrome_trace_file(p.name)}
    assert listed == {v.removesuffix(".chrome") for v in VIEWS}
    with caplog.at_level(logging.ERROR):
        data = RunProfileData.parse("all_ranks", None, str(traces / "all_ranks" / "all_ranks.trace.json"),
                                    str(tmp_path))
        RunGenerator("all_ranks", None, data).generate_run_profile()
    assert not [r for r in caplog.records if "should not intersect" in r.getMessage()]


def test_raw_trace_names_new_and_legacy():
    assert trace_name(3) == "rank3.pt.trace.json" and trace_name(3, compress=True) == "rank3.pt.trace.json.gz"
    assert [raw_trace_rank(n) for n in ("rank12.pt.trace.json.gz", "traces-r7.chrome.json", "rank1.pt.trace.json.tmp",
                                        "traces-r0.gpu_only.chrome.json", "rankx.pt.trace.json")] == [12, 7, None, None, None]
