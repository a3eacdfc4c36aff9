"""What the end table reads of each trial's ``profile_summary.json``: the step time, the peak memory, the device, the
top finding and the wall-time phases. The one place the launcher reads a summary (its nested keys); the table itself is
:mod:`sftprof.launch.report`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from sftprof import artifacts
from sftprof.analysis import schema
from sftprof.analysis.trial.failure import headline
from sftprof.analysis.memory.oom import settings_text


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The trial's ``profile_summary.json`` (:func:`sftprof.analysis.schema.read_summary`); ``{}`` when it is
    missing, unreadable or of a newer sftprof (its row then shows ``-``)."""
    try:
        return dict(schema.read_summary(Path(run_dir) / artifacts.SUMMARY_JSON))
    except schema.SummaryReadError:
        return {}


def table_figures(summary: dict[str, Any]) -> tuple[float | None, float | None, str | None]:
    """``(step_time_s, peak_allocated_gib, device)`` of a summary: the slowest rank's profiled step (seconds), rank 0's
    allocator peak (GiB; None on CPU) and the trial's device (``cuda``, ``cpu``; None when unknown)."""
    stats = summary.get("stats") or {}
    device = (summary.get("completion") or {}).get("device")
    return stats.get("step_time_s"), stats.get("mem_peak_allocated_gb"), device


def summary_errors(summary: dict[str, Any]) -> str:
    """What the end table adds to the status of a trial whose summary has errors (``errors``,
    :mod:`sftprof.analysis.trial.problems`: one per file that could not be read or processed, and one per plot that
    could not be drawn, whose entry holds it as ``kernel_traces[].parts_plot_error`` or
    ``memory_snapshots[].plot_error``): ``" (summary: N file(s) not read, M plot(s) not drawn, see its Errors)"``,
    each part only when not 0; ``""`` for a summary without errors (or none)."""
    plots = (sum("parts_plot_error" in t for t in summary.get("kernel_traces") or [])
             + sum("plot_error" in m for m in summary.get("memory_snapshots") or []))
    files = len(summary.get("errors") or []) - plots
    said = [f"{n} {what}{'s' if n > 1 else ''} not {done}"
            for n, what, done in ((files, "file", "read"), (plots, "plot", "drawn")) if n > 0]
    return f" (summary: {', '.join(said)}, see its Errors)" if said else ""


def wall_phases(summary: dict[str, Any]) -> tuple[dict[str, float | None], float | None, str | None]:
    """``({phase: seconds}, elapsed_s, cold start)`` of a summary's ``wall_time``
    (:func:`sftprof.analysis.trial.wall_time.wall_time`), the cold start as the end table shows it (``"0.7 s"``, or
    ``"not measurable"`` with why for a difference below 0 or within the reference steps' spread); ``({}, None, None)`` for a summary without one (of an
    earlier release, or none)."""
    w = summary.get("wall_time") or {}
    cold = w.get("cold_start") or {}
    cold_s = cold.get("cold_start_s")
    if cold_s is None:
        text = None
    elif cold_s < 0:
        text = ("not measurable (step 0 faster than its " + ("profiled " if cold.get("reference_profiled") else "")
                + "reference: see its summary)")
    elif cold.get("not_measurable"):
        text = "not measurable (within its reference steps' spread: see its summary)"
    else:
        text = f"{cold_s:.1f} s"
    return {p["phase"]: p["seconds"] for p in w.get("phases") or []}, w.get("elapsed_s"), text


def top_finding(summary: dict[str, Any]) -> str:
    """One line on where a trial's time or memory went, from its ``profile_summary.json`` (first rank listed).

    Kernel trials with GPU work: the largest kernel category's share of GPU time and the GPU idle share;
    without GPU work (CPU runs): the model part with the most CPU op time (``cpu_parts``), else the region with the
    most CPU time. Memory trials: the peak (the profiled
    step's, ``step peak``, when the phases sidecar had phases; else the recorded window's), where it lies in
    words (:func:`sftprof.analysis.memory.snapshot.peak_where`) and the allocation site holding most memory at it;
    then, when the recorded window peaks higher outside the step, that peak and where it lies. The rank is named:
    it is one rank's figure.
    A failed trial without those: its first failure (:func:`sftprof.analysis.trial.failure.headline`). A trial that ran out
    of CUDA memory: that, first (the request, where, and the smallest change that fits: ``oom``).
    """
    t = summary.get("oom")
    if t:
        fits = t.get("fits") or []
        return (f"out of memory: {(t['requested_bytes'] or 0) / 2**30:.2f} GiB requested in {t['phase'] or '?'} "
                f"(rank {t['rank']})" + (f"; fits with {settings_text(fits[0]['settings'])}" if fits
                                         else "; no change of one GPU's settings fits"))
    for t in summary.get("kernel_traces") or []:
        if "summary" not in t:
            continue
        k, r = t["summary"], t["rank"]
        if k["gpu"]["activities"] and k["categories"]:
            c = k["categories"][0]
            return (f"{c['category']} {c['share_pct']:.0f}% of GPU time, GPU idle {k['gpu']['idle_share_pct']:.0f}% "
                    f"(rank {r})")
        parts = (k.get("cpu_parts") or {}).get("summed")
        if parts:
            p = max(parts, key=lambda x: x["total_ms"])
            return f"{p['label']} {p['share_pct']:.0f}% of CPU op time (rank {r})"
        regions = [x for x in k.get("regions") or [] if x["name"] != artifacts.STEP and x.get("cpu_ms") is not None]
        if regions:
            x = max(regions, key=lambda x: x["cpu_ms"])
            return f"slowest region {x['name']} {x['cpu_ms'] / 1e3:.1f} s CPU (rank {r})"
    for m in summary.get("memory_snapshots") or []:
        if "summary" not in m:
            continue
        from sftprof.analysis.memory.snapshot import peak_where  # numpy: only when a memory summary is read

        x, r = m["summary"], m["rank"]
        site = (x.get("top_sites") or [{}])[0]
        noun = "step peak" if x.get("peak_scope") == "profiled_step" else "peak"
        higher = ""
        if x.get("window_peak_position") in ("before_step", "after_step"):
            higher = f"; higher peak {x['window_peak_allocated_gib']:.2f} GiB {peak_where(x, 'window')}"
        return (f"{noun} {x['peak_allocated_gib']:.2f} GiB {peak_where(x)}" +
                (f"; top site {site['site'][:40]} {site['gib']:.2f} GiB" if site else "") + higher + f" (rank {r})")
    if summary.get("failure"):
        return f"first failure: {headline(summary['failure'])} (see {artifacts.SUMMARY_MD})"
    if summary.get("errors"):
        return f"{len(summary['errors'])} unreadable artifact(s): see {artifacts.SUMMARY_MD}"
    if summary.get("status") not in (None, "ok"):
        return f"trial failed: see {artifacts.SUMMARY_MD} and {artifacts.LAUNCHER_LOG}"
    if summary.get("profile_kind") == "memory" and (summary.get("completion") or {}).get("device") == "cpu":
        return "allocator snapshots need CUDA"
    return "-"


def what_if_lines(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """Lines on a what-if trial (``summary``, in ``run_dir``): what it tried on which trial, and its prediction
    against the outcome with the verdict on the assumption (:func:`sftprof.analysis.compare.runs.what_if_result`), or why
    there is none, and the compare report's path."""
    tried = summary.get("tried_what_if")
    if not tried:
        return ["(no what_if record in its summary: not postprocessed?)"]
    from sftprof.analysis.compare.runs import what_if_result  # numpy: only when a what-if trial is reported
    from sftprof.analysis.what_if.changes import METRICS, setting_text
    from sftprof.analysis.what_if.outcome import outcome_text

    w = tried["what_if"]
    head = f"{w['label']} ({', '.join(setting_text(s) for s in w['settings'])}) on {tried['source_trial']}"
    source = read_summary(Path(tried["source_run_dir"]))
    if not source or summary.get("status") != "ok":
        return [head, "no outcome: " + ("the source trial's summary is unreadable" if not source else
                                        f"this trial's status is {summary.get('status')}")]
    o = what_if_result(source, summary)
    report = Path(run_dir) / artifacts.compare_report_name(tried["source_run_dir"])
    return [head, f"{METRICS[w['effect']['metric']][1]}: {outcome_text(o, w['effect']['unit'])}; assumption: "
                  f"{o.verdict}", str(report)]
