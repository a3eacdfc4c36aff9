"""Memory summary on real CUDA allocator snapshots."""
import pytest
from torch.cuda import _memory_viz

from fixtures import gpu_snapshot_fixtures
from sftprof.analysis.report.findings import memory_findings
from sftprof.analysis.memory.categories import allocation_site
from sftprof.analysis.memory.plot import plot_memory
from sftprof.analysis.memory.snapshot import analyze_snapshot, peak_where
from sftprof.analysis.report.memory import _memory_peaks
from sftprof.analysis.memory.safe_pickle import safe_load_file

SNAPSHOTS = gpu_snapshot_fixtures()


@pytest.fixture(scope="module", params=SNAPSHOTS, ids=lambda p: p.name)
def snap(request):
    return safe_load_file(request.param)


def _plain_replay(snap, dev):
    """Allocated bytes after each trace event by a plain loop (end state from torch's calc_active)."""
    end = sum(_memory_viz.calc_active(s) for s in snap["segments"] if s["device"] == dev)
    end += sum(b["size"] for s in snap["segments"] if s["device"] == dev
               for b in s["blocks"] if b["state"] == "active_pending_free")
    trace = snap["device_traces"][dev]
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in trace
              if e["action"] in ("alloc", "free_completed"))
    cur, series = end - net, []
    for e in trace:
        if e["action"] == "alloc":
            cur += e["size"]
        elif e["action"] == "free_completed":
            cur -= e["size"]
        series.append((cur, e["time_us"]))
    return end - net, series


def test_peak_matches_plain_replay_and_live_blocks(snap):
    s = analyze_snapshot(snap)
    start, series = _plain_replay(snap, s["device"])
    peak, t_peak = max(series, key=lambda x: x[0])
    assert s["peak_allocated_bytes"] == max(peak, start)
    assert s["peak_time_ms"] == pytest.approx((t_peak - series[0][1]) / 1e3, abs=1e-3)
    # The blocks reconstructed as alive at the peak add up to the replayed peak.
    assert s["live_at_peak_bytes"] == s["peak_allocated_bytes"]
    site_bytes = sum(x["bytes"] for x in s["top_sites"])
    assert site_bytes == s["live_at_peak_bytes"] if len(s["top_sites"]) < 20 else site_bytes <= s["live_at_peak_bytes"]
    assert s["reserved_minus_allocated_at_peak_bytes"] == s["reserved_at_peak_bytes"] - s["peak_allocated_bytes"] >= 0
    assert s["end_reserved_bytes"] == sum(x["total_size"] for x in snap["segments"] if x["device"] == s["device"])


@pytest.mark.parametrize("path", [p for p in SNAPSHOTS if "qwen3moe_4l_8k" in p.name], ids=lambda p: p.name)
def test_reference_snapshot_largest_block_is_the_fp32_logits(path):
    """Reference run: 8192 tokens, vocab 151936 (README); the largest live block at the peak is the
    fp32 logits-sized gradient (tokens x vocab x 4 bytes) of the mean loss' backward."""
    s = analyze_snapshot(safe_load_file(path))
    top = s["top_allocations"][0]
    assert top["bytes"] == 8192 * 151936 * 4
    assert top["site"] == "MeanBackward0 (autograd)"
    assert any(x["site"].startswith("megatron/core/") for x in s["top_sites"])


def test_peak_phase_from_sidecar(snap, tmp_path):
    s = analyze_snapshot(snap)
    trace = snap["device_traces"][s["device"]]
    t0, t1 = trace[0]["time_us"], trace[-1]["time_us"]
    t_peak = t0 + s["peak_time_ms"] * 1e3
    phases = {"clock": "unix_us", "phases": [
        {"name": "sftprof/step", "start_us": t0 - 1, "end_us": t1 + 1},
        {"name": "sftprof/forward/mb0", "start_us": t0 - 1, "end_us": t_peak - 1},
        {"name": "sftprof/backward/mb0", "start_us": t_peak - 1, "end_us": t1 + 1},
    ]}
    assert analyze_snapshot(snap, phases)["peak_phase"] == "sftprof/backward/mb0"
    phases["phases"][1]["end_us"] = t_peak + 1
    phases["phases"][2]["start_us"] = t_peak + 1
    with_sidecar = analyze_snapshot(snap, phases)
    assert with_sidecar["peak_phase"] == "sftprof/forward/mb0"
    assert analyze_snapshot(snap, {"phases": []})["peak_phase"] is None
    png = tmp_path / "m.png"
    plot_memory(with_sidecar, "snapshot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_memory_plot_y_axis_starts_at_zero(snap, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)  # keep the figure to read its axes
    s = analyze_snapshot(snap)
    plot_memory(s, "snapshot", str(tmp_path / "m.png"))
    (ax,) = closed[0].axes
    low, high = ax.get_ylim()
    assert low == 0 and high >= s["peak_reserved_gib"] > 0


def test_allocation_site_rules():
    frames = [
        {"name": "malloc", "filename": "CUDACachingAllocator.cpp", "line": 0},
        {"name": "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)", "filename": "??", "line": 0},
        {"name": "backward", "filename": "/usr/lib/python3.11/site-packages/torch/autograd/__init__.py", "line": 353},
        {"name": "wrapper", "filename": "/usr/lib/python3.11/contextlib.py", "line": 81},
        {"name": "train_step", "filename": "/work/main/sftprof/engine/fsdp.py", "line": 120},
    ]
    assert allocation_site(frames) == "MmBackward0 (autograd) via sftprof/engine/fsdp.py:120 train_step"
    assert allocation_site(frames[2:3]) == "torch/autograd/__init__.py:353 backward"
    assert allocation_site(frames[:1]) == "<no Python frame>"


# ---------------------------------------------------------------------------------------------------------
# The profiled step's peak vs the recorded window's (history recorded from before the model is built)
# ---------------------------------------------------------------------------------------------------------
G = 2**30
_INIT = [{"name": "__init__", "filename": "/w/sftprof/models/qwen.py", "line": 20}]
_FWD = [{"name": "forward_step", "filename": "/w/sftprof/engine/megatron.py", "line": 50}]
_LOGITS = [{"name": "logits", "filename": "/w/sftprof/loss.py", "line": 30}]
_BWD = [{"name": "backward_step", "filename": "/w/sftprof/engine/megatron.py", "line": 80}]
BEFORE = "before the profiled step (model setup or earlier steps in the recorded history)"


def _synthetic():
    """Weights (4 GiB) from before the window; an earlier step peaking at 12 GiB (1000-4000 us); the profiled step
    (5000-9000 us) peaking at 9 GiB at 6000 us in its forward; 16 GiB reserved throughout."""
    def ev(t, action, addr, size, frames=()):
        return {"action": action, "addr": addr, "size": size * G, "time_us": t, "frames": list(frames)}
    trace = [ev(1000, "alloc", 0x200, 6, _FWD), ev(2000, "alloc", 0x300, 2, _LOGITS),
             ev(3000, "free_completed", 0x200, 6), ev(4000, "free_completed", 0x300, 2),
             ev(5500, "alloc", 0x400, 3, _FWD), ev(6000, "alloc", 0x500, 2, _LOGITS),
             ev(7500, "free_completed", 0x500, 2), ev(8000, "alloc", 0x600, 1, _BWD),
             ev(8500, "free_completed", 0x400, 3)]
    blocks = [{"address": 0x100, "size": 4 * G, "state": "active_allocated", "frames": _INIT},
              {"address": 0x600, "size": 1 * G, "state": "active_allocated", "frames": _BWD},
              {"address": 0x700, "size": 11 * G, "state": "inactive", "frames": []}]
    return {"segments": [{"device": 0, "total_size": 16 * G, "blocks": blocks}], "device_traces": [trace]}


STEP_PHASES = {"clock": "unix_us", "phases": [
    {"name": "sftprof/forward/mb0", "start_us": 5000, "end_us": 7000},
    {"name": "sftprof/backward/mb0", "start_us": 7000, "end_us": 9000},
    {"name": "sftprof/step", "start_us": 5000, "end_us": 9000}]}


def _site(site, gib, blocks, share):
    return {"site": site, "bytes": gib * G, "gib": float(gib), "blocks": blocks, "share_pct": share}


def _top_finding(s):
    from sftprof.launch import top_finding
    return top_finding({"memory_snapshots": [{"rank": 0, "summary": s}]})


def test_step_peak_is_the_headline_and_an_earlier_higher_peak_is_the_windows():
    s = analyze_snapshot(_synthetic(), STEP_PHASES)
    series = s.pop("series")
    assert (series["peak_index"], series["window_peak_index"]) == (5, 1)
    cats = {r["category"]: (r["bytes"], r["blocks"]) for r in s["categories_at_peak"]}
    assert cats == {"parameters": (4 * G, 1), "gradients": (0, 0), "optimizer": (0, 0), "workspaces": (0, 0), "activations": (5 * G, 2),
                    "before_window": (0, 0), "allocator_slack": (7 * G, None)}
    assert {k: v for k, v in s.items() if k != "categories_at_peak"} == {
        "device": 0, "trace_entries": 9, "window_ms": 7.5, "window_start_us": 1000.0,
        "devices": [{"device": 0, "reserved_bytes": 16 * G, "allocated_bytes": 5 * G, "trace_entries": 9}],
        "peak_scope": "profiled_step", "step_peak_unknown": None, "step_peak_lower_bound": None,
        "step_window": {"source": "sftprof/step", "start_ms": 4.0, "end_ms": 8.0},
        "peak_allocated_bytes": 9 * G, "peak_allocated_gib": 9.0, "peak_reserved_bytes": 16 * G,
        "peak_reserved_gib": 16.0, "reserved_at_peak_bytes": 16 * G, "reserved_minus_allocated_at_peak_bytes": 7 * G,
        "reserved_minus_allocated_at_peak_gib": 7.0, "peak_time_ms": 5.0, "peak_phase": "sftprof/forward/mb0",
        "live_at_peak_bytes": 9 * G,
        "window_peak_allocated_bytes": 12 * G, "window_peak_allocated_gib": 12.0,
        "window_peak_reserved_bytes": 16 * G, "window_peak_reserved_gib": 16.0, "window_peak_time_ms": 1.0,
        "window_peak_phase": None, "window_peak_position": "before_step",
        "end_allocated_bytes": 5 * G, "end_reserved_bytes": 16 * G,
        "top_sites": [_site("sftprof/models/qwen.py:20 __init__", 4, 1, 44.444),
                      _site("sftprof/engine/megatron.py:50 forward_step", 3, 1, 33.333),
                      _site("sftprof/loss.py:30 logits", 2, 1, 22.222)],
        "top_allocations": [{"bytes": 4 * G, "gib": 4.0, "site": "sftprof/models/qwen.py:20 __init__"},
                            {"bytes": 3 * G, "gib": 3.0, "site": "sftprof/engine/megatron.py:50 forward_step"},
                            {"bytes": 2 * G, "gib": 2.0, "site": "sftprof/loss.py:30 logits"}],
        # without the 3 GiB block (5500-8500 us) the step's highest point is 6 GiB at 6000 us (weights + logits)
        "without_largest_block": {"block_bytes": 3 * G, "block_gib": 3.0,
                                  "block_site": "sftprof/engine/megatron.py:50 forward_step",
                                  "peak_allocated_bytes": 6 * G, "peak_allocated_gib": 6.0, "peak_time_ms": 5.0,
                                  "peak_phase": "sftprof/forward/mb0"},
        "transient_spikes": [  # allocated inside the step only: the earlier step's 6 and 2 GiB blocks are not
            {"bytes": 3 * G, "gib": 3.0, "lifetime_ms": 3.0, "site": "sftprof/engine/megatron.py:50 forward_step"},
            {"bytes": 2 * G, "gib": 2.0, "lifetime_ms": 1.5, "site": "sftprof/loss.py:30 logits"}],
        "window_top_sites": [_site("sftprof/engine/megatron.py:50 forward_step", 6, 1, 50.0),
                             _site("sftprof/models/qwen.py:20 __init__", 4, 1, 33.333),
                             _site("sftprof/loss.py:30 logits", 2, 1, 16.667)]}
    assert (peak_where(s), peak_where(s, "window")) == ("in sftprof/forward/mb0", BEFORE)
    assert _top_finding(s) == ("step peak 9.00 GiB in sftprof/forward/mb0; top site sftprof/models/qwen.py:20 "
                               f"__init__ 4.00 GiB; higher peak 12.00 GiB {BEFORE} (rank 0)")
    found = memory_findings(0, s)
    assert [(f["text"], round(f["weight"], 4), f["key"]) for f in found] == [
        ("rank 0: allocator slack (reserved - allocated) 7.0 GiB of the 9.0 GiB step peak in sftprof/forward/mb0",
         0.7778, "memory allocator_slack"),
        ("rank 0: activations and autograd temporaries 5.0 GiB of the 9.0 GiB step peak in sftprof/forward/mb0",
         0.5556, "memory activations"),
        ("rank 0: parameters (model weights, param buffers) 4.0 GiB of the 9.0 GiB step peak in "
         "sftprof/forward/mb0", 0.4444, "memory parameters"),
        (f"rank 0: the recorded allocator history peaks higher, 12.00 GiB {BEFORE}, than the profiled step "
         "(9.00 GiB in sftprof/forward/mb0); the figures at the peak are the step's", 0.3333, "memory window peak"),
        ("rank 0: largest transient block 3.00 GiB for 3.0 ms at sftprof/engine/megatron.py:50 forward_step",
         0.3333, "transient")]
    assert _memory_peaks(s) == [
        "- peak allocated in the profiled step **9.000 GiB** at 5.000 ms, in sftprof/forward/mb0 (step "
        "4.000–8.000 ms, from `sftprof/step`, of a 7.500 ms recorded window; times from its first event)",
        "- peak reserved in the profiled step 16.000 GiB; reserved − allocated at the peak 7.000 GiB",
        "- **the recorded window peaks higher, outside the profiled step:** 12.000 GiB allocated at 1.000 ms, "
        f"{BEFORE}; reserved peak 16.000 GiB; alive then: `sftprof/engine/megatron.py:50 forward_step` 6.000 GiB, "
        "`sftprof/models/qwen.py:20 __init__` 4.000 GiB, `sftprof/loss.py:30 logits` 2.000 GiB. The figures below "
        "are the profiled step's peak"]


def test_without_sidecar_the_headline_is_the_windows_peak_and_says_so():
    s = analyze_snapshot(_synthetic())
    s.pop("series")
    assert (s["peak_scope"], s["step_window"], s["peak_allocated_bytes"], s["peak_time_ms"], s["peak_phase"]) == (
        "recorded_window", None, 12 * G, 1.0, None)
    assert (s["window_peak_allocated_bytes"], s["window_peak_time_ms"], s["window_peak_position"]) == (12 * G, 1.0, None)
    assert s["window_top_sites"] == s["top_sites"] and s["top_sites"][0] == _site(
        "sftprof/engine/megatron.py:50 forward_step", 6, 1, 50.0)
    assert [x["bytes"] for x in s["transient_spikes"]] == [6 * G, 3 * G, 2 * G, 2 * G]  # the whole window's
    assert peak_where(s) == peak_where(s, "window") == "in the recorded window, with no phases recorded"
    assert _top_finding(s) == ("peak 12.00 GiB in the recorded window, with no phases recorded; top site "
                               "sftprof/engine/megatron.py:50 forward_st 6.00 GiB (rank 0)")
    assert _memory_peaks(s)[0] == ("- peak allocated **12.000 GiB** at 1.000 ms of the 7.500 ms recorded window (from "
                                   "its first event); no phases recorded, so neither its phase nor the profiled "
                                   "step's own peak is known")
    assert analyze_snapshot(_synthetic(), {"phases": []})["peak_scope"] == "recorded_window"
    assert memory_findings(0, s)[0]["text"] == (
        "rank 0: activations and autograd temporaries 8.0 GiB of the 12.0 GiB peak in the recorded window, with no "
        "phases recorded")


@pytest.mark.parametrize("phases,want", [
    # the step covers the earlier peak too: one peak, in the step
    ([{"name": "sftprof/step", "start_us": 500, "end_us": 9000},
      {"name": "sftprof/forward/mb0", "start_us": 1500, "end_us": 2500}],
     (12 * G, 1.0, "sftprof/forward/mb0", 12 * G, 1.0, "in_step",
      "step peak 12.00 GiB in sftprof/forward/mb0; top site sftprof/engine/megatron.py:50 forward_st 6.00 GiB "
      "(rank 0)")),
    # the window peaks after the step: the step's peak is its first event (10 GiB), from 4 GiB at its start
    ([{"name": "sftprof/step", "start_us": 500, "end_us": 1500}],
     (10 * G, 0.0, "sftprof/step", 12 * G, 1.0, "after_step",
      "step peak 10.00 GiB in sftprof/step; top site sftprof/engine/megatron.py:50 forward_st 6.00 GiB; higher "
      "peak 12.00 GiB after the profiled step (before the snapshot was taken) (rank 0)")),
    # no event inside the step (span of its phases, no sftprof/step): its peak is the level it starts from, at its start
    ([{"name": "sftprof/optimizer", "start_us": 2500, "end_us": 2900}],
     (12 * G, 1.5, "sftprof/optimizer", 12 * G, 1.5, "in_step",
      "step peak 12.00 GiB in sftprof/optimizer; top site sftprof/engine/megatron.py:50 forward_st 6.00 GiB "
      "(rank 0)")),
    # the step's peak between its recorded phases: said in words, never '?' or None
    ([{"name": "sftprof/forward/mb0", "start_us": 5000, "end_us": 5800},
      {"name": "sftprof/backward/mb0", "start_us": 7000, "end_us": 9000}],
     (9 * G, 5.0, None, 12 * G, 1.0, "before_step",
      "step peak 9.00 GiB in the profiled step, outside its recorded phases; top site sftprof/models/qwen.py:20 "
      f"__init__ 4.00 GiB; higher peak 12.00 GiB {BEFORE} (rank 0)")),
], ids=["window_peak_in_step", "window_peak_after_step", "step_starts_at_its_peak", "peak_between_phases"])
def test_step_peak_cases(phases, want):
    s = analyze_snapshot(_synthetic(), {"clock": "unix_us", "phases": phases})
    s.pop("series")
    assert (s["peak_allocated_bytes"], s["peak_time_ms"], s["peak_phase"], s["window_peak_allocated_bytes"],
            s["window_peak_time_ms"], s["window_peak_position"], _top_finding(s)) == want
    assert s["live_at_peak_bytes"] == s["peak_allocated_bytes"]
    assert sum(r["bytes"] for r in s["categories_at_peak"][:-1]) == s["peak_allocated_bytes"]


H200_MEMORY = next(p for p in SNAPSHOTS if p.name == "h200_sftprof_memory.snapshot.pickle.gz")


def test_h200_snapshot_with_a_sidecar_whose_step_starts_after_the_windows_peak():
    """The real H200 snapshot (150.778 ms of history, highest at 101.646 ms and again at 103.945 ms), with a
    synthetic sidecar whose step starts at 103.947 ms, after a 1.16 GiB block was freed: the step's peak is
    lower and later; the window's is reported beside it, before the step."""
    snap = safe_load_file(H200_MEMORY)
    trace = snap["device_traces"][0]
    t0, t1 = trace[0]["time_us"], trace[-1]["time_us"]
    start = t0 + 103_947
    phases = {"clock": "unix_us", "phases": [
        {"name": "sftprof/step", "start_us": start, "end_us": t1 + 1},
        {"name": "sftprof/forward/mb0", "start_us": start, "end_us": start + 20_000},
        {"name": "sftprof/backward/mb0", "start_us": start + 20_000, "end_us": t1 + 1}]}
    s = analyze_snapshot(snap, phases)
    whole = analyze_snapshot(snap)
    # the step's peak by a plain loop: the level it starts from, then after each of its events
    level, _ = _plain_replay(snap, 0)
    carried, inside = level, []
    for e in trace:
        level += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        if e["time_us"] < start:
            carried = level
        else:
            inside.append((level, e["time_us"]))
    top, t_top = max(inside, key=lambda x: x[0])  # the first event inside reaching it
    assert top == carried  # the level the step starts from, reached again by an event inside it
    assert (s["peak_allocated_bytes"], s["peak_time_ms"]) == (top, round((t_top - t0) / 1e3, 3)) == (
        43_750_580_232, 103.951)
    assert (s["peak_scope"], s["peak_phase"], s["step_window"]) == (
        "profiled_step", "sftprof/forward/mb0", {"source": "sftprof/step", "start_ms": 103.947, "end_ms": 150.779})
    assert (s["window_peak_allocated_bytes"], s["window_peak_time_ms"], s["window_peak_phase"],
            s["window_peak_position"]) == (whole["peak_allocated_bytes"], whole["peak_time_ms"], None,
                                           "before_step") == (44_995_239_944, 101.646, None, "before_step")
    assert s["window_top_sites"] == whole["top_sites"]
    assert s["live_at_peak_bytes"] == s["peak_allocated_bytes"]
    assert [(x["site"], x["bytes"]) for x in s["top_sites"][:3]] == [
        ("<allocated before the recorded window>", 29_971_621_888),
        ("megatron/core/optimizer/distrib_optimizer.py:2419 copy_group_grads", 7_476_389_888),
        ("megatron/core/optimizer/optimizer.py:569 step_with_ready_grads", 6_229_590_016)]  # 1 block (1.16 GiB) less
    assert _top_finding(s) == ("step peak 40.75 GiB in sftprof/forward/mb0; top site <allocated before the recorded "
                               f"window> 27.91 GiB; higher peak 41.91 GiB {BEFORE} (rank 0)")
    # a step from the first event on holds the window's peak: one peak, in the step
    phases["phases"][0]["start_us"] = phases["phases"][1]["start_us"] = t0
    s = analyze_snapshot(snap, phases)
    assert (s["peak_allocated_bytes"], s["peak_time_ms"], s["window_peak_position"], s["peak_phase"]) == (
        44_995_239_944, 101.646, "in_step", "sftprof/forward/mb0")
    assert _top_finding(s) == ("step peak 41.91 GiB in sftprof/forward/mb0; top site <allocated before the recorded "
                               "window> 27.91 GiB (rank 0)")


def test_compare_names_each_runs_peak_scope():
    from sftprof.analysis.compare.runs import _memory_tables
    new = analyze_snapshot(_synthetic(), STEP_PHASES)
    old = {k: v for k, v in analyze_snapshot(_synthetic()).items() if not k.startswith(("window_", "peak_scope",
                                                                                         "step_window"))}
    out = "\n".join(_memory_tables(0, old, new))
    assert "| peak allocated, whole recorded window | 12.000 | 12.000 | +0.000 | +0.0% |" in out
    assert ("Peak: A the recorded window's peak, with no phase recorded; B the profiled step's peak, in "
            "sftprof/forward/mb0\n") in out
    assert "The two peaks are not of the same scope" in out
    assert f"Run B's recorded window peaks higher, 12.000 GiB {BEFORE}.\n" in out
    assert "?" not in out and "None" not in out
