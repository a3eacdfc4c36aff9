"""Issue 35, rules 1 and 2: a damaged trace or snapshot gives no silent wrong figure.

Every input is a real H200 fixture edited the way a profiler fault damages it (sftprof/analysis/trace/sanity.py,
sftprof/analysis/memory/snapshot.py): one kernel stretched over its successors (CUPTI's overlong record), kernels with
ts 0 and dur 0 (no timing collected), kernel records dropped while their launches stay, every CPU op (or the whole
trace) recorded twice, a second profiler step; a snapshot without allocator history, without event times, or whose
phases sidecar is on another clock. Each test asserts the exact counts, the warning and the caveat, what is left out,
and that the figures equal those of the clean trace where the fault is set right.
"""
import copy
import gzip
import json
import pickle

import pytest

from fixtures import FIXTURE_DIR
from fixtures.faults import (GPU, before_step, drop, duplicate, kernel_summary, stream_activities, stretch, untime,
                             with_second_step)
from sftprof.analysis.report.findings import memory_findings
from sftprof.analysis.memory.snapshot import analyze_snapshot, peak_where
from sftprof.analysis.report.memory import _memory_peaks
from sftprof.analysis.memory.safe_pickle import safe_load_file
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.trace.check import UNTIMED, validate_trace
from sftprof.analysis.trace.sanity import fault_messages, sanity_error
from sftprof.artifacts import view_path

TE_TRACE = FIXTURE_DIR / "h200_te_kernel.trace.json.gz"  # ProfilerStep#2, 6 streams, TE kernels
SFTPROF_TRACE = FIXTURE_DIR / "h200_sftprof_kernel.trace.json.gz"  # an earlier release's: no ProfilerStep slice
SNAPSHOT = FIXTURE_DIR / "h200_sftprof_memory.snapshot.pickle.gz"
# what a summary holds besides the record's faults: the figures
NOT_FIGURES = ("n_events", "invalid_events", "sanity", "view_repairs")


@pytest.fixture(scope="module")
def te():
    return json.loads(gzip.decompress(TE_TRACE.read_bytes()))


@pytest.fixture(scope="module")
def te_clean(te):
    return kernel_summary(te, 2)


def _figures(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in NOT_FIGURES}


def _kernels(trace: dict) -> list[dict]:
    """The trace's kernels on stream 7 (the compute stream), in time order."""
    return [e for e in stream_activities(trace)[(0, 7)] if e["cat"] == "kernel"]


def _trial(root, trace: dict, step: int) -> tuple[dict, int, object]:
    """Postprocess ``trace`` as rank 0's trace of a kernel trial that profiled ``step``."""
    log = root / "log"
    (log / "perf_tracer").mkdir(parents=True)
    (log / "perf_tracer" / "rank0.pt.trace.json").write_text(json.dumps(trace))
    (log / "stats.jsonl").write_text(json.dumps(
        {"type": "complete", "status": "ok", "error": None, "steps_done": step + 1, "world_size": 1,
         "backend": "megatron", "device": "cuda", "profile_kind": "kernel", "profile_step": step}) + "\n")
    run = root / "run"
    summary, code = postprocess_trial(str(log), str(run), "kernel", step, jobs=1)
    return summary, code, run


def _sanity_counts(s: dict) -> dict:
    return {k: (v["count"], v["of"]) for k, v in s["sanity"].items() if isinstance(v, dict) and "count" in v}


NO_FAULT = {"duplicates": 0, "overlapping": 0, "untimed": 0, "launches_without_activity": 0,
            "activities_without_launch": 0, "other_steps": 0}


def test_clean_fixtures_have_no_fault(te_clean):
    """The real traces: no fault of any kind; the 2-GPU excerpts' cut edges are recording edges, not faults."""
    from fixtures import two_gpu_sync_traces
    assert {k: c for k, (c, _) in _sanity_counts(te_clean).items()} == NO_FAULT
    assert te_clean["sanity"]["recording_edges"] == {"activities_before_first_launch": 0,
                                                     "launches_after_last_activity": 0}
    edges = [kernel_summary(json.loads(gzip.decompress(p.read_bytes())), 2)["sanity"] for p in two_gpu_sync_traces()]
    assert [{k: c for k, (c, _) in _sanity_counts({"sanity": x}).items()} for x in edges] == [NO_FAULT, NO_FAULT]
    # the excerpt keeps the 14 ms of slices inside its window: kernels queued before it, launches whose kernel ran
    # after it
    assert [x["recording_edges"] for x in edges] == [
        {"activities_before_first_launch": 27, "launches_after_last_activity": 19},
        {"activities_before_first_launch": 55, "launches_after_last_activity": 25}]


def test_overlong_kernel_is_cut_at_the_next_kernel_of_its_stream(tmp_path, te, te_clean):
    """One kernel whose duration runs over every later kernel of its stream and 1.5 s past the step (main: a
    1687.2 ms step at 91.6 % GPU busy, against 324.6 ms at 28.6 %): it is cut at the next kernel's start; every figure
    equals the clean trace's with that kernel that long."""
    bad = copy.deepcopy(te)
    ks = _kernels(bad)
    k, nxt = ks[300], ks[301]
    stretch([k], 1.5e6)
    s = kernel_summary(bad, 2)
    cut = nxt["ts"] - k["ts"]
    assert _sanity_counts(s)["overlapping"] == (1, te_clean["gpu"]["activities"])
    expect = copy.deepcopy(te)
    _kernels(expect)[300]["dur"] = cut
    assert _figures(s) == _figures(kernel_summary(expect, 2))
    assert s["step_window"] == te_clean["step_window"]  # the step does not grow by the overlong record
    assert abs(s["gpu"]["busy_ms"] - te_clean["gpu"]["busy_ms"]) <= (cut - _kernels(te)[300]["dur"]) / 1e3 + 2e-4
    example = (f"{k['name'][:77]}... (GPU 0 stream 7) ran {(k['ts'] + k['dur'] - nxt['ts']) / 1e3:.3f} ms past the "
               f"start of {nxt['name'][:77]}...; cut to {cut / 1e3:.3f} ms")
    assert s["sanity"]["overlapping"]["examples"] == [example]
    message = (f"1 of {te_clean['gpu']['activities']} GPU activities run past the start of the next activity of "
               f"their stream, which cannot be (CUPTI's overlong record) (e.g. {example}): each is cut at that start, "
               "the longest it can have run")
    assert fault_messages(s["sanity"]) == [message] and sanity_error(s["sanity"]) is None
    summary, code, run = _trial(tmp_path, bad, 2)
    assert code == 0 and summary["warnings"] == [{"file": "perf_tracer/rank0.pt.trace.json", "warning": message}]
    caveat = message.replace(f" (e.g. {example})", "")
    assert summary["findings"] and all(f["caveats"] == [caveat] for f in summary["findings"])
    md = (run / "profile_summary.md").read_text()
    assert f"   - caveat: {caveat}" in md and f"- **trace record:** {message}" in md


def test_overlapping_kernels_that_dominate_a_trace_are_its_error(tmp_path, te):
    bad = copy.deepcopy(te)
    streams = stream_activities(bad)
    n = sum(len(v) for v in streams.values())
    stretched = n // 2 + 1  # each runs 1 s over the next activity of its stream (not the last of a stream)
    stretch([e for v in streams.values() for e in v[:-1]][:stretched], 1e6)
    summary, code, _ = _trial(tmp_path, bad, 2)
    src = tmp_path / "log" / "perf_tracer" / "rank0.pt.trace.json"
    assert code == 1 and len(summary["errors"]) == 1
    assert summary["errors"][0]["error"].startswith(f"{src}: {stretched} of {n} GPU activities run past the start of "
                                                    "the next activity of their stream")
    assert summary["errors"][0]["error"].endswith("the longest it can have run; the trace is not usable")
    assert summary["ranks"]["rows"] == [] and summary["findings"] == []


def test_kernels_without_timing_are_counted_as_invalid_and_left_out(tmp_path, te, te_clean):
    """40 kernels with ts 0 and dur 0 (CUPTI's 'no timing collected'): counted with the invalid events (main: 0,
    the 40 counted as GPU activities), left out of every figure and view; the figures are the clean trace's without
    those kernels."""
    bad, expect = copy.deepcopy(te), copy.deepcopy(te)
    untime(_kernels(bad)[200:240])
    drop(expect, _kernels(expect)[200:240])
    s = kernel_summary(bad, 2)
    n = te_clean["gpu"]["activities"]
    assert s["invalid_events"]["by_kind"] == {UNTIMED: 40} and s["invalid_events"]["total"] == 40
    assert _sanity_counts(s)["untimed"] == (40, n)
    assert _sanity_counts(s)["launches_without_activity"] == (0, 2152)  # their launches had a kernel
    assert _figures(s) == _figures(kernel_summary(expect, 2))
    assert s["gpu"]["activities"] == n - 40 and s["gpu"]["busy_ms"] < te_clean["gpu"]["busy_ms"]
    summary, code, run = _trial(tmp_path, bad, 2)
    untimed = (f"40 of {n} GPU activities have no timing (ts 0 or dur 0: CUPTI collected none): left out of every "
               "figure and view, so the GPU busy and GPU times are lower bounds")
    assert code == 0 and summary["warnings"] == [
        {"file": "perf_tracer/rank0.pt.trace.json", "warning": f"40 invalid events left out of every figure and view: "
                                                               f"{UNTIMED} 40"},
        {"file": "perf_tracer/rank0.pt.trace.json", "warning": untimed}]
    assert all(f["caveats"] == [untimed] for f in summary["findings"])
    chrome = view_path(str(run / "kernel_traces"), 0, "chrome")
    assert validate_trace(chrome) == []
    assert sum(e.get("cat") == "kernel" for e in json.load(open(chrome))["traceEvents"]) == 2152 - 40


def test_dropped_kernel_records_make_the_gpu_figures_lower_bounds(tmp_path, te, te_clean):
    """600 kernel records dropped, their launches kept (GPU busy falls, idle time that never was): counted, named,
    each GPU figure that of the trace without those kernels; dropping more than half is the trace's error."""
    bad = copy.deepcopy(te)
    drop(bad, _kernels(bad)[100:700])
    s = kernel_summary(bad, 2)
    assert _sanity_counts(s) == {**{k: (0, of) for k, (_, of) in _sanity_counts(s).items()},
                                 "launches_without_activity": (600, 2152)}
    assert s["gpu"]["busy_share_pct"] < te_clean["gpu"]["busy_share_pct"]
    launches = {e["args"]["correlation"]: e["ts"] for e in te["traceEvents"] if e.get("cat") in ("cuda_runtime",
                                                                                                  "cuda_driver")}
    first = sorted(launches[e["args"]["correlation"]] for e in _kernels(te)[100:700])[:3]
    assert [x.split(" (")[0] for x in s["sanity"]["launches_without_activity"]["examples"]] == [
        f"launch at {t:.3f} us" for t in first]
    message = fault_messages(s["sanity"])[0]
    assert message.startswith("600 of 2152 kernel launches have no kernel in the trace (records dropped by the "
                              "profiler) (e.g. launch at ") and message.endswith(
        "those kernels ran but are in no figure, so the GPU busy and GPU times are lower bounds and the GPU idle "
        "time holds their run time")
    summary, code, _ = _trial(tmp_path / "a", bad, 2)
    assert code == 0 and summary["warnings"] == [{"file": "perf_tracer/rank0.pt.trace.json", "warning": message}]
    assert any("GPU idle" in f["text"] for f in summary["findings"])
    assert all(len(f["caveats"]) == 1 and f["caveats"][0].startswith("600 of 2152 kernel launches have no kernel "
                                                                      "in the trace (records dropped by the profiler): ")
               for f in summary["findings"])
    worse = copy.deepcopy(te)
    drop(worse, [e for e in worse["traceEvents"] if e.get("cat") == "kernel"][:1077])
    summary, code, _ = _trial(tmp_path / "b", worse, 2)
    assert code == 1 and summary["errors"][0]["error"].split(": ", 1)[1].startswith(
        "1077 of 2152 kernel launches have no kernel in the trace")
    assert summary["errors"][0]["error"].endswith("; the trace is not usable")


def test_every_cpu_op_recorded_twice_changes_no_figure(tmp_path, te, te_clean):
    """Every CPU op twice (a torch profiler fault: host times and call counts doubled): the copies are counted and
    left out; the figures equal the clean trace's, the views keep the recording."""
    bad = copy.deepcopy(te)
    ops = [e for e in bad["traceEvents"] if e.get("cat") == "cpu_op"]
    duplicate(bad, ops)
    s = kernel_summary(bad, 2)
    assert _figures(s) == _figures(te_clean)
    assert s["top_cpu_ops"][0]["calls"] == te_clean["top_cpu_ops"][0]["calls"] == 2
    assert _sanity_counts(s)["duplicates"] == (len(ops), te_clean["n_events"] + len(ops))
    assert s["sanity"]["duplicates_by_category"] == {"cpu_op": len(ops)}
    message = (f"{len(ops)} events recorded twice (cpu_op {len(ops)}): the copies are left out of every figure (the "
               "views keep them)")
    assert fault_messages(s["sanity"]) == [message] and sanity_error(s["sanity"]) is None
    summary, code, run = _trial(tmp_path, bad, 2)
    assert code == 0 and summary["warnings"] == [{"file": "perf_tracer/rank0.pt.trace.json", "warning": message}]
    assert all(f["caveats"] == [message] for f in summary["findings"])
    cpu_view = json.load(open(view_path(str(run / "kernel_traces"), 0, "cpu_only.chrome")))["traceEvents"]
    assert sum(e.get("cat") == "cpu_op" for e in cpu_view) == 2 * len(ops)


def test_a_wholly_duplicated_trace_does_not_double_the_kernel_totals(te, te_clean):
    bad = copy.deepcopy(te)
    duplicate(bad, te["traceEvents"])
    s = kernel_summary(bad, 2)
    assert _figures(s) == _figures(te_clean)
    counts = {}
    for e in te["traceEvents"]:
        cat = e.get("cat")
        key = "cuda_runtime/cuda_driver" if cat in ("cuda_runtime", "cuda_driver") else cat
        if cat in ("cpu_op", "user_annotation", *GPU) or key == "cuda_runtime/cuda_driver" and "correlation" in (
                e.get("args") or {}):
            counts[key] = counts.get(key, 0) + 1
    # annotations counted are the sftprof/* regions, the step slice and host collectives (the model-part ranges are
    # user annotations too, kept by their own collector, which a copy does not mislead)
    counts["user_annotation"] = sum(1 for e in te["traceEvents"] if e.get("cat") == "user_annotation" and (
        e["name"].startswith(("sftprof/", "ProfilerStep#", "gloo:", "nccl:"))))
    assert s["sanity"]["duplicates_by_category"] == dict(sorted(counts.items()))
    assert s["sanity"]["duplicates"]["count"] == sum(counts.values())


def test_the_step_window_is_the_profiled_steps_never_the_longest(tmp_path, te, te_clean):
    """A trace holding ProfilerStep#2 and a longer ProfilerStep#3: summarised as step 2 it is the clean trace's step
    (main: every figure over both steps, GPU time 188.5 ms against 94.3); summarised as step 3, the copy's."""
    two = with_second_step(te, 3, longer_us=1e6)
    s2 = kernel_summary(two, 2)
    assert {**_figures(s2), "identity": None} == {**_figures(te_clean), "identity": None}
    assert s2["identity"]["profiler_steps"] == [2, 3]
    # the copy's activities and CPU ops from its step's start on are step 3's (its slice is 1 s longer: the copy's
    # tail too), those before it are of no step
    n = te_clean["gpu"]["activities"] + sum(e.get("cat") == "cpu_op" for e in te["traceEvents"])
    other = n - before_step(te)
    assert _sanity_counts(s2)["other_steps"] == (other, 2 * n)
    message = (f"the trace holds more profiler steps than the one postprocessed (ProfilerStep#3 besides it): "
               f"{other} of {2 * n} GPU activities and CPU ops of those steps are left out of every figure, and the "
               "step window is the postprocessed step's own")
    assert fault_messages(s2["sanity"]) == [message]
    s3 = kernel_summary(two, 3)
    shift = s3["step_window"]["start_us"] - te_clean["step_window"]["start_us"]
    assert shift > 0 and s3["step_window"]["wall_ms"] == te_clean["step_window"]["wall_ms"]
    for key in ("gpu", "top_kernels", "categories", "communication", "parts", "efficiency", "top_cpu_ops"):
        assert s3[key] == te_clean[key], key
    summary, code, _ = _trial(tmp_path, two, 2)
    assert code == 0 and summary["warnings"] == [{"file": "perf_tracer/rank0.pt.trace.json", "warning": message}]
    assert summary["kernel_traces"][0]["summary"]["step_window"]["start_us"] == te_clean["step_window"]["start_us"]


# ---------------------------------------------------------------------------------------------------------
# Rule 2: a snapshot whose history cannot give the profiled step's peak says so, and what it can
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def snap():
    return safe_load_file(SNAPSHOT)


def _step_phases(snap) -> dict:
    """A sidecar whose step spans the whole recorded history (so the step's peak is the window's, 41.91 GiB)."""
    trace = snap["device_traces"][0]
    t0, t1 = trace[0]["time_us"], trace[-1]["time_us"]
    return {"clock": "unix_us", "phases": [{"name": "sftprof/step", "start_us": t0, "end_us": t1 + 1},
                                           {"name": "sftprof/forward/mb0", "start_us": t0, "end_us": t1 + 1}]}


def test_snapshot_without_history_gives_the_level_at_dump_not_a_step_peak(snap):
    """Segments but no trace entries: was 'the profiled step's peak' = the level at dump (34.94 GiB, 17 % below the
    41.91 GiB the full history shows); now the level at dump, said to be no peak."""
    clean = analyze_snapshot(snap, _step_phases(snap))
    assert (clean["peak_scope"], clean["peak_allocated_bytes"]) == ("profiled_step", 44_995_239_944)
    bare = dict(snap, device_traces=[[]])
    s = analyze_snapshot(bare, _step_phases(snap))
    s.pop("series")
    assert (s["peak_scope"], s["peak_allocated_bytes"], s["end_allocated_bytes"]) == (
        "dump_time", clean["end_allocated_bytes"], clean["end_allocated_bytes"])
    assert s["end_allocated_bytes"] == 37_520_887_808 < 0.84 * clean["peak_allocated_bytes"]
    assert (s["window_ms"], s["peak_time_ms"], s["window_peak_time_ms"], s["step_window"], s["window_peak_position"],
            s["peak_phase"], s["transient_spikes"]) == (None, None, None, None, None, None, [])
    reason = ("the snapshot holds no allocator history: its segments (the allocator's state at dump time) but no trace "
              "entries (recorded without torch.cuda.memory._record_memory_history, or with max_entries=0), so no peak "
              "can be found: the figures are the level at the snapshot's dump")
    assert s["step_peak_unknown"] == reason
    # what the segments say: the blocks alive at the dump, by the sites their frames name
    assert sum(x["bytes"] for x in s["top_sites"]) <= s["live_at_peak_bytes"] == s["end_allocated_bytes"]
    assert peak_where(s) == "at the snapshot's dump: no allocator history, so no peak is known"
    found = memory_findings(0, s)
    assert found and all(f["caveats"] == [reason] for f in found)
    assert all("step peak" not in f["text"] and "before the profiled step" not in f["text"] for f in found)
    assert found[0]["text"].endswith(" GiB level at the snapshot's dump: no allocator history, so no peak is known")
    assert _memory_peaks(s) == [f"- **no peak:** allocated at the snapshot's dump 34.944 GiB, reserved "
                                f"{s['peak_reserved_gib']:.3f} GiB; {reason}"]


@pytest.mark.parametrize("untimed", [5, None], ids=["5_events", "all_events"])
def test_snapshot_events_without_times_give_the_windows_peak_by_order(snap, untimed):
    """Entries without time_us: the recorded window's peak is known from the order of the events (41.91 GiB, as
    with times), when it was and the step's peak are not."""
    clean = analyze_snapshot(snap)
    bad = copy.deepcopy(snap)
    trace = bad["device_traces"][0]
    for e in trace[:untimed] if untimed else trace:
        del e["time_us"]
    s = analyze_snapshot(bad, _step_phases(snap))
    s.pop("series")
    assert (s["peak_scope"], s["peak_allocated_bytes"], s["window_peak_allocated_bytes"], s["top_sites"]) == (
        "recorded_window", clean["peak_allocated_bytes"], clean["peak_allocated_bytes"], clean["top_sites"])
    assert (s["window_ms"], s["window_start_us"], s["peak_time_ms"], s["step_window"], s["peak_phase"],
            s["window_peak_position"], s["transient_spikes"]) == (None, None, None, None, None, None, [])
    n = len(trace)
    assert s["step_peak_unknown"] == (
        f"{untimed or n} of {n} allocator events have no time_us: the recorded window's peak is known from the "
        "events' order but not when it was, and the profiled step cannot be placed among the events, so its own "
        "peak is unknown")
    assert peak_where(s) == "in the recorded window; the profiled step's own peak is unknown"
    assert _memory_peaks(s)[0] == (f"- peak allocated of the recorded window **41.905 GiB** (when, unknown); **no step "
                                   f"peak:** {s['step_peak_unknown']}")


def test_snapshot_whose_phases_are_on_another_clock_gives_no_step_peak(tmp_path, snap):
    """A sidecar one hour off the history's clock (local time against UTC): the step lies outside the recorded
    history, so no step peak (was a 'step peak' of 34.94 GiB, the level before the first recorded event, with the
    window's 41.91 GiB 'after the profiled step'); the window's peak with its time; through the postprocess: a warning
    and the findings' caveat."""
    phases = _step_phases(snap)
    for p in phases["phases"]:
        p["start_us"] -= 3600e6
        p["end_us"] -= 3600e6
    s = analyze_snapshot(snap, phases)
    s.pop("series")
    clean = analyze_snapshot(snap)
    assert (s["peak_scope"], s["peak_allocated_bytes"], s["peak_time_ms"], s["window_ms"]) == (
        "recorded_window", 44_995_239_944, clean["peak_time_ms"], clean["window_ms"]) == (
        "recorded_window", 44_995_239_944, 101.646, 150.778)
    assert (s["step_window"], s["window_peak_position"], s["peak_phase"]) == (None, None, None)
    trace = snap["device_traces"][0]
    step = phases["phases"][0]
    reason = (f"the profiled step (sftprof/step, {step['start_us']:.0f}-{step['end_us']:.0f} us in the phases sidecar) "
              f"lies outside the recorded allocator history ({trace[0]['time_us']:.0f}-{trace[-1]['time_us']:.0f} us): "
              "the sidecar's clock is not the history's, or the history does not reach the step; the profiled step's "
              "own peak is unknown, the figures are the recorded window's")
    assert s["step_peak_unknown"] == reason
    log = tmp_path / "log"
    snaps = log / "memory_snapshots" / "step_1"
    snaps.mkdir(parents=True)
    name = "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle"
    (snaps / name).write_bytes(pickle.dumps(snap, protocol=4))
    (snaps / "phases_rank0.json").write_text(json.dumps(phases))
    (log / "stats.jsonl").write_text(json.dumps(
        {"type": "complete", "status": "ok", "error": None, "steps_done": 2, "world_size": 1, "backend": "megatron",
         "device": "cuda", "profile_kind": "memory", "profile_step": 1}) + "\n")
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 1)
    assert code == 0 and summary["warnings"] == [{"file": f"memory_snapshots/step_1/{name}", "warning": reason}]
    assert summary["findings"] and all(f["caveats"] == [reason] for f in summary["findings"])
    md = (tmp_path / "run" / "profile_summary.md").read_text()
    assert "before the profiled step" not in md and "step peak 41" not in md and "**no step peak:**" in md
