"""The PNG of one memory snapshot: allocated and reserved memory over its recorded allocator history, with the
peaks of :func:`sftprof.analysis.memory.snapshot.analyze_snapshot` marked."""
from __future__ import annotations

from typing import Any

import numpy as np

from sftprof import artifacts
from sftprof.analysis.memory.snapshot import peak_where
from sftprof.analysis.report.pyplot import pyplot

__all__ = ["plot_memory"]


def plot_memory(summary: dict[str, Any], title: str, out_png: str) -> None:
    """PNG of allocated (solid) and reserved (dashed) GiB over the recorded window (y from 0): the headline peak
    marked (red dot), the profiled step's window by dotted lines and, when higher and outside the step, the
    window's peak (open diamond).

    Args:
        summary: output of :func:`analyze_snapshot` (needs its ``series``).
        title: plot title (e.g. the snapshot file name).
        out_png: destination path.
    """
    plt = pyplot()

    s = summary["series"]
    t = s["t_us"]
    timed = summary["window_ms"] is not None  # else by event: the history has no times (or no events)
    t0 = float(t[0]) if timed else 0.0
    x = np.concatenate(([0.0], (t - t0) / 1e3)) if timed else np.arange(t.size + 1, dtype=np.float64)
    alloc = np.concatenate(([s["start_allocated"]], s["allocated"])) / 2**30
    res = np.concatenate(([s["start_reserved"]], s["reserved"])) / 2**30
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=100)
    for k, ph in enumerate(sorted(s["phases"] if timed else [], key=lambda p: p["start_us"])):
        lo, hi = (ph["start_us"] - t0) / 1e3, (ph["end_us"] - t0) / 1e3
        if hi < x[0] or lo > x[-1] or ph["name"] == artifacts.STEP:
            continue
        ax.axvspan(lo, hi, color=f"C{2 + k % 6}", alpha=0.12, lw=0)
        ax.text((lo + hi) / 2, 0.01, ph["name"].replace(artifacts.REGION_PREFIX, ""), rotation=90, fontsize=7,
                ha="center", va="bottom", transform=ax.get_xaxis_transform())
    ax.step(x, alloc, where="post", lw=1.0, color="C0", label="allocated")
    ax.step(x, res, where="post", lw=1.0, ls="--", color="C1", label="reserved")
    step = summary.get("step_window")
    if step and step["start_ms"] is not None:
        for edge in (step["start_ms"], step["end_ms"]):
            ax.axvline(edge, color="0.4", lw=0.8, ls=":")
    noun = "step peak" if summary.get("peak_scope") == "profiled_step" else "peak"
    ax.plot([summary["peak_time_ms"] if timed else s["peak_index"] + 1], [summary["peak_allocated_gib"]], "o",
            color="red", ms=6,
            label=f"{noun} {summary['peak_allocated_gib']:.2f} GiB {peak_where(summary)}")
    if summary.get("window_peak_position") in ("before_step", "after_step"):
        ax.plot([summary["window_peak_time_ms"]], [summary["window_peak_allocated_gib"]], "D", color="C3",
                ms=5, mfc="none", label=f"window peak {summary['window_peak_allocated_gib']:.2f} GiB, "
                                        f"{summary['window_peak_position'].replace('_', ' ')}")
    ax.set_xlabel("time since first recorded allocator event [ms]" if timed else
                  "allocator event (the history holds no times)")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)  # from 0, so the height of the curve reads as the memory it is
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, format="png", metadata={"Software": None})
    plt.close(fig)
