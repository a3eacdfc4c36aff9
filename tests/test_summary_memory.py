"""Memory summary on real CUDA allocator snapshots."""
import pytest
from torch.cuda import _memory_viz

from fixtures import gpu_snapshot_fixtures
from sftprof.analysis.memory_summary import allocation_site, analyze_snapshot, plot_memory
from sftprof.analysis.safe_pickle import safe_load_file

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
