"""Kernel-trace and memory-snapshot capture switches (rank/step selection, file names, CUDA paths)."""
import json
import logging
import pickle

import pytest
import torch

from sftprof.allocation import parse_allocation_mode
from sftprof.config import load_config
from torch.profiler import ProfilerAction

from sftprof.artifacts import raw_trace_path as trace_path
from sftprof.artifacts import snapshot_dir, snapshot_name
from sftprof.capture.kernel import KernelProfiler, profile_schedule
from sftprof.capture.memory import MemoryProfileOOM, MemoryProfiler
from sftprof.capture.regions import forward, region

LAYOUT = parse_allocation_mode("megatron:d2t2p2")   # pp_rank0 -> ranks [0, 4]


def _cfg(*overrides):
    # the tests below run steps 0-3: profile steps up to 3 are steps the trial runs (sftprof.config.validate)
    return load_config("tiny_cpu", ["total_train_steps=4", *overrides])


def _work():
    with region(forward(0)):
        torch.ones(64, 64) @ torch.ones(64, 64)


def test_snapshot_name_and_dir(tmp_path):
    coords = LAYOUT.rank_coords(5)
    assert snapshot_name(5, coords) == "snapshot_rank5_pp1_dp0_cp0_tp1_ep0.pickle"
    assert snapshot_dir(tmp_path, 3) == tmp_path / "memory_snapshots" / "step_3"
    assert trace_path(tmp_path, 4) == tmp_path / "perf_tracer" / "rank4.pt.trace.json"


def test_schedule_matches_torch_schedule_for_one_step():
    ours = profile_schedule([3])
    theirs = torch.profiler.schedule(skip_first=2, wait=0, warmup=1, active=1, repeat=1)
    assert [ours(n) for n in range(8)] == [theirs(n) for n in range(8)]
    assert [ours(n) for n in range(5)] == [ProfilerAction.NONE] * 2 + [ProfilerAction.WARMUP,
                                                                       ProfilerAction.RECORD_AND_SAVE, ProfilerAction.NONE]
    both = profile_schedule([0, 1])
    assert [both(n) for n in range(3)] == [ProfilerAction.RECORD_AND_SAVE] * 2 + [ProfilerAction.NONE]


def _slice_of(events, name):
    found = [e for e in events if e.get("name") == name and e.get("ph") == "X"]
    assert len(found) == 1, (name, len(found))
    return found[0]


@pytest.mark.parametrize("rank,written", [(4, True), (1, False)])
def test_kernel_profiler_records_profiler_step_with_our_regions(tmp_path, rank, written):
    prof = KernelProfiler(_cfg("perf_tracer.enabled=true", "perf_tracer.profile_steps=[2]"), LAYOUT, rank, tmp_path)
    assert prof.ranks == [0, 4] and prof.is_profiled(2) and not prof.is_profiled(1)
    for step in range(4):
        with prof.step(step), region(f"sftprof/step{step}"):
            _work()
    path = trace_path(tmp_path, rank)
    assert path.exists() is written and prof.traces_written == int(written)
    if written:
        events = json.loads(path.read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        # Only the profiled step is in the trace: not the warm-up step 1, nor steps 0 and 3.
        assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#2"}
        assert {n for n in names if n.startswith("sftprof/step")} == {"sftprof/step2"}
        outer, inner = _slice_of(events, "ProfilerStep#2"), _slice_of(events, "sftprof/forward/mb0")
        assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
        assert any(e.get("name") == "aten::mm" and "Input Dims" in e.get("args", {}) for e in events)  # record_shapes


def test_garbage_collections_of_the_recorded_step_become_ranges_and_the_summary_counts_them(tmp_path):
    """A real CPU trace: ``gc.collect()`` in the recorded step 1 (none in step 0) gives one ``sftprof.gc/gen2`` range
    around the collection (``gc.callbacks`` is as before afterwards); the analyzer counts it in ``host.gc``."""
    import gc

    from sftprof.analysis.schema import ms
    from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer

    prof = KernelProfiler(_cfg("perf_tracer.enabled=true", "perf_tracer.profile_steps=[1]"), LAYOUT, 0, tmp_path)
    callbacks = list(gc.callbacks)
    gc.disable()  # only the collection below runs in the step
    try:
        for step in range(2):
            with prof.step(step), region("sftprof/step"):
                _work()
                if step == 1:
                    gc.collect()
    finally:
        gc.enable()
    assert gc.callbacks == callbacks
    data = json.loads(trace_path(tmp_path, 0).read_text())
    ranges = [e for e in data["traceEvents"] if e.get("name", "").startswith("sftprof.gc/")]
    assert [(e["name"], e["cat"], e["ph"]) for e in ranges] == [("sftprof.gc/gen2", "user_annotation", "X")]
    a = KernelTraceAnalyzer({k: v for k, v in data.items() if k != "traceEvents"})
    for ev in data["traceEvents"]:
        a.add(ev)
    host = a.summary()["host"]
    assert host["gc"] == {"collections": 1, "ms": ms(ranges[0]["dur"]), "by_generation": {"2": 1}}


def test_a_collection_inside_a_compiled_function_is_recorded_and_compiles_nothing():
    """A collection in a torch.compile'd function's eager part (after a graph break) ran the callback under dynamo,
    which compiled it as new frames and dropped its range; the callback now runs outside dynamo."""
    import gc

    from torch._dynamo.utils import counters

    from sftprof.capture import python_gc

    @torch.compile(backend="eager")
    def f(x):
        x = x * 2
        torch._dynamo.graph_break()
        gc.collect()
        return x + 1

    f(torch.ones(4))  # compiles
    frames = counters["frames"]["total"]
    with torch.profiler.profile() as prof, python_gc.recording():
        f(torch.ones(4))
    assert counters["frames"]["total"] == frames
    assert [e.name for e in prof.events() if e.name.startswith("sftprof.gc/")].count("sftprof.gc/gen2") == 1


def test_gc_recording_ends_cleanly_when_the_block_raises_or_clears_gc_callbacks():
    import gc

    from sftprof.capture import python_gc

    saved = list(gc.callbacks)
    try:
        with pytest.raises(RuntimeError, match="step failed"), python_gc.recording():
            raise RuntimeError("step failed")
        assert gc.callbacks == saved
        with python_gc.recording():
            gc.callbacks.clear()  # what a user's code may do; leaving the block must not raise
        assert gc.callbacks == [] and python_gc._OPEN == []
    finally:
        gc.callbacks[:] = saved


def test_kernel_trace_log_names_the_step_each_export_holds(tmp_path, caplog):
    """The config refuses several kernel steps (one trace file per rank); a profiler built around that check still
    logs the step each export holds: the export of step 0 runs inside prof.step() of step 1 (the reviewer's log said
    "kernel trace of step 1 written" twice)."""
    cfg = _cfg("perf_tracer.enabled=true", "perf_tracer.profile_steps=[0]")
    cfg.perf_tracer.profile_steps = [0, 1]  # past sftprof.config.validate
    prof = KernelProfiler(cfg, LAYOUT, 0, tmp_path)
    with caplog.at_level(logging.INFO, logger="sftprof.capture.kernel"):
        for step in range(3):
            with prof.step(step):
                _work()
    written = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel trace of step")]
    assert written == [f"kernel trace of step {s} written to {trace_path(tmp_path, 0)}" for s in (0, 1)]
    assert prof.traces_written == 2


def test_kernel_profiler_exports_nothing_when_the_step_fails(tmp_path):
    prof = KernelProfiler(_cfg("perf_tracer.enabled=true", "perf_tracer.profile_steps=[1]"), LAYOUT, 0, tmp_path)
    with prof.step(0):
        _work()
    with pytest.raises(RuntimeError, match="boom"):
        with prof.step(1):
            raise RuntimeError("boom")
    assert prof.traces_written == 0 and not (tmp_path / "perf_tracer").exists()
    with prof.step(2):  # after a failure the profiler is off
        _work()
    other = KernelProfiler(_cfg("perf_tracer.enabled=true", "perf_tracer.profile_steps=[3]"), LAYOUT, 0, tmp_path)
    with other.step(0):
        pass
    with pytest.raises(ValueError, match="expected step 1, got 2"):
        with other.step(2):
            pass


def test_kernel_profiler_needs_enabled(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        prof = KernelProfiler(_cfg("perf_tracer.profile_steps=[0]"), LAYOUT, 0, tmp_path)
    assert "perf_tracer.enabled=false" in caplog.text and not prof.is_profiled(0)
    with prof.step(0):
        _work()
    assert not (tmp_path / "perf_tracer").exists()


def test_memory_profiler_on_cpu_logs_and_writes_nothing(tmp_path, caplog):
    cfg = _cfg("memory_profiler.profile_steps=[0]", "memory_profiler.ranks=0-1")
    prof = MemoryProfiler(cfg, LAYOUT, 1, LAYOUT.rank_coords(1), tmp_path, torch.device("cpu"))
    assert prof.ranks == [0, 1]
    with caplog.at_level(logging.WARNING):
        with prof.step(0):
            _work()
    assert "allocator snapshots need CUDA" in caplog.text
    assert prof.snapshots_written == 0 and not (tmp_path / "memory_snapshots").exists()


@pytest.mark.gpu
def test_kernel_profiler_records_cuda_kernels_and_sync_events(tmp_path):
    prof = KernelProfiler(_cfg("perf_tracer.enabled=true", "perf_tracer.profile_steps=[1]"), LAYOUT, 0, tmp_path)
    for step in range(2):
        with prof.step(step), region(forward(0)):
            torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")
            torch.cuda.synchronize()
    events = json.loads(trace_path(tmp_path, 0).read_text())["traceEvents"]
    cats = {e.get("cat") for e in events}
    assert "kernel" in cats and "gpu_user_annotation" in cats
    # enable_cuda_sync_events: the torch.cuda.synchronize() above shows as a CUDA sync event.
    assert any(e.get("cat") == "cuda_sync" for e in events), sorted(c for c in cats if c)
    assert [e["name"] for e in events if e["name"].startswith("ProfilerStep#") and e.get("ph") == "X"] == ["ProfilerStep#1"]


@pytest.mark.gpu
def test_memory_profiler_cuda_snapshot_and_oom(tmp_path):
    cfg = _cfg("memory_profiler.profile_steps=[2,3]", "memory_profiler.max_entries=5000")
    coords = LAYOUT.rank_coords(0)
    prof = MemoryProfiler(cfg, LAYOUT, 0, coords, tmp_path, torch.device("cuda"))
    weights = torch.empty(3 << 20, device="cuda")  # allocated before the profiled step, like model weights
    with prof.step(2):
        with region(forward(0)):
            x = torch.empty(1 << 20, device="cuda")
    snap = snapshot_dir(tmp_path, 2) / snapshot_name(0, coords)
    data = pickle.loads(snap.read_bytes())
    traces = [e for dev in data["device_traces"] for e in dev]
    assert any(e["action"] == "alloc" and e["size"] >= x.numel() * 4 for e in traces)
    # History starts when the profiler is built: blocks allocated before the step keep their stack.
    blocks = [b for seg in data["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert any(b["size"] >= weights.numel() * 4 and any("test_profiling_capture" in f["filename"] for f in b["frames"])
               for b in blocks)
    phases = json.loads((snapshot_dir(tmp_path, 2) / "phases_rank0.json").read_text())
    assert phases["clock"] == "unix_us" and [p["name"] for p in phases["phases"]] == ["sftprof/forward/mb0"]
    assert phases["device"] == torch.cuda.current_device()  # the rank's own device among the snapshot's (issue 48)
    alloc_us = [e["time_us"] for e in traces if e["action"] == "alloc" and e["size"] >= x.numel() * 4]
    assert phases["phases"][0]["start_us"] <= alloc_us[-1] <= phases["phases"][0]["end_us"]
    # An out-of-memory error inside the step still leaves a snapshot and names it.
    with pytest.raises(MemoryProfileOOM, match="snapshot written to .*step_3"):
        with prof.step(3):
            raise torch.OutOfMemoryError("simulated")
    assert (snapshot_dir(tmp_path, 3) / snapshot_name(0, coords)).exists()
    assert prof.snapshots_written == 2


def test_region_records_its_phase_when_it_dies():
    from sftprof.capture.regions import PhaseRecorder

    with PhaseRecorder(sync_cuda=False) as rec:
        with pytest.raises(RuntimeError, match="simulated OOM"):
            with region("sftprof/step"), region(forward(0)):
                raise RuntimeError("simulated OOM")
    assert [p["name"] for p in rec.phases] == ["sftprof/forward/mb0", "sftprof/step"]
    assert all(p["start_us"] <= p["end_us"] for p in rec.phases)
