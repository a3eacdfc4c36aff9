"""The Markdown of one memory snapshot (``## Memory snapshot rank <r>``): its peaks and where they lie, memory at
the peak by category, the theoretical estimate against what was measured, transient spikes and the allocation
sites alive at the peak. Each function renders what the summary holds."""
from __future__ import annotations

from typing import Any, Mapping

from sftprof.analysis.report import findings as fnd
from sftprof.analysis.report.markdown import fmt, short, table
from sftprof.analysis.memory.snapshot import other_devices_message, peak_where

__all__ = ["memory_snapshots"]


# -- one memory snapshot ---------------------------------------------------------------------------------------
def _estimate(m: dict[str, Any]) -> list[str]:
    """The theoretical estimate of one snapshot's rank against what the snapshot measured."""
    est = m.get("estimate")
    if not est:
        return [f"\n{m['estimate_note']}\n"] if m.get("estimate_note") else []
    cmp_rows = m.get("estimate_vs_measured") or []
    return [f"\nTheoretical estimate ({est['params_dense'] + est['params_expert']:,} parameters on this rank: "
            f"{est['params_dense']:,} dense, {est['params_expert']:,} expert; "
            + "; ".join(est["assumptions"]) + "):\n",
            table(["category", "estimated GiB", "formula"],
                  [[r["category"], r["gib"], r["formula"]] for r in est["rows"]]),
            table(["category", "measured GiB", "estimated GiB", "measured - estimated GiB"],
                  [[r["category"], round(r["measured_bytes"] / 2**30, 4), round(r["estimated_bytes"] / 2**30, 4),
                    round(r["difference_bytes"] / 2**30, 4)] for r in cmp_rows]),
            "Differences: the activation estimate is a lower bound (the working set of the layer in "
            "backward is not counted); blocks allocated before the recorded window carry no stack and are "
            "set against parameters, gradients and optimizer state together." + _step_copy_note(cmp_rows, est) + "\n"]


def _step_copy_note(cmp_rows: list[dict[str, Any]], est: dict[str, Any]) -> str:
    """Says so when the measured optimizer state is the estimate without the fp32 gradient copy (within 1 %)."""
    copy = next((r.get("step_copy_bytes") or 0 for r in est["rows"] if r["category"] == "optimizer"), 0)
    opt = next((r for r in cmp_rows if r["category"] == "optimizer"), None)
    if not copy or not opt or abs(-opt["difference_bytes"] - copy) > 0.01 * copy:
        return ""
    return (f" Optimizer: the measured state is the estimate less the fp32 gradient copy ({copy / 2**30:.2f} GiB), "
            "which megatron-core's optimizers make in the optimizer step (`_copy_model_grads_to_main_grads`): "
            "this peak is outside it.")


def _memory_peaks(x: dict[str, Any]) -> list[str]:
    """The peak lines of one snapshot summary (:func:`sftprof.analysis.memory.snapshot.analyze_snapshot`): the
    headline peak, named the profiled step's or the recorded window's, with its place in words
    (:func:`peak_where`), and the whole window's peak beside it (where it lies and what was alive then when it is
    outside the step); a snapshot whose history cannot give the step's peak says why, and one without history gives
    the level at its dump."""
    if x.get("peak_scope") == "profiled_step":
        w = x["step_window"]
        low = " at least" if x.get("step_peak_lower_bound") else ""
        out = [f"- peak allocated in the profiled step{low} **{fmt(x['peak_allocated_gib'])} GiB** at "
               f"{fmt(x['peak_time_ms'])} ms, {peak_where(x)} (step {fmt(w['start_ms'])}–{fmt(w['end_ms'])} ms, from "
               f"`{w['source']}`, of a {fmt(x['window_ms'])} ms recorded window; times from its first event)",
               f"- peak reserved in the profiled step {fmt(x['peak_reserved_gib'])} GiB; reserved − allocated at "
               f"the peak {fmt(x['reserved_minus_allocated_at_peak_gib'])} GiB"]
        if x["window_peak_position"] == "in_step":
            out.append(f"- the whole recorded window peaks in the profiled step too (reserved peak "
                       f"{fmt(x['window_peak_reserved_gib'])} GiB)")
        else:
            alive = ", ".join(f"`{short(y['site'], 80)}` {fmt(y['gib'])} GiB" for y in x["window_top_sites"][:3])
            out.append(f"- **the recorded window peaks higher, outside the profiled step:** "
                       f"{fmt(x['window_peak_allocated_gib'])} GiB allocated at {fmt(x['window_peak_time_ms'])} ms, "
                       f"{peak_where(x, 'window')}; reserved peak {fmt(x['window_peak_reserved_gib'])} GiB; "
                       f"alive then: {alive}. The figures below are the profiled step's peak")
        return out
    if x.get("peak_scope") == "dump_time":
        return [f"- **no peak:** allocated at the snapshot's dump {fmt(x['peak_allocated_gib'])} GiB, reserved "
                f"{fmt(x['peak_reserved_gib'])} GiB; {x['step_peak_unknown']}"]
    if x.get("step_peak_unknown"):
        when = (f" at {fmt(x['peak_time_ms'])} ms of the {fmt(x['window_ms'])} ms recorded window (from its first event)"
                if x["peak_time_ms"] is not None else " (when, unknown)")
        return [f"- peak allocated of the recorded window **{fmt(x['peak_allocated_gib'])} GiB**{when}; "
                f"**no step peak:** {x['step_peak_unknown']}",
                f"- peak reserved {fmt(x['peak_reserved_gib'])} GiB; reserved − allocated at the peak "
                f"{fmt(x['reserved_minus_allocated_at_peak_gib'])} GiB"]
    return [f"- peak allocated **{fmt(x['peak_allocated_gib'])} GiB** at {fmt(x['peak_time_ms'])} ms of the "
            f"{fmt(x['window_ms'])} ms recorded window (from its first event); no phases recorded, so neither its "
            "phase nor the profiled step's own peak is known",
            f"- peak reserved {fmt(x['peak_reserved_gib'])} GiB; reserved − allocated at the peak "
            f"{fmt(x['reserved_minus_allocated_at_peak_gib'])} GiB"]


def _memory_snapshot(m: dict[str, Any]) -> list[str]:
    out = [f"## Memory snapshot rank {m['rank']} (`{m['file']}`)\n"]
    if "error" in m:
        kept = ", ".join(f"`{f}`" for f in m.get("kept_files") or [])
        return out + [f"**error:** {m['error']}\n"] + (
            [f"Kept from an earlier postprocess (not from this snapshot): {kept}\n"] if kept else [])
    x = m["summary"]
    out += _memory_peaks(x)
    if x["history"]["truncated"]:
        out.append(f"- **truncated window:** {x['history']['message']}")
    if x.get("step_peak_lower_bound"):
        out.append(f"- **step peak is a lower bound:** {x['step_peak_lower_bound']}")
    if len(x.get("devices") or []) > 1:
        out.append(f"- **other devices left out:** {other_devices_message(x)}")
    out.append(f"- plot: `{m['plot']}`\n" if "plot" in m else "- plot: none (its error is under Errors)\n")
    out.append(f"### {fnd.memory_heading(m['rank'])}\n")
    out.append(table(["category", "GiB", "blocks", "share % of allocated"],
                     [[r["label"], r["gib"], r["blocks"], r["share_pct"]] for r in x["categories_at_peak"]]))
    out += _estimate(m)
    if x.get("transient_spikes"):
        scope = "the profiled step" if x.get("peak_scope") == "profiled_step" else "the window"
        out.append(f"\nTransient spikes (largest blocks allocated inside {scope} and freed inside the window):\n")
        out.append(table(["GiB", "lifetime ms", "site"],
                         [[r["gib"], r["lifetime_ms"], short(r["site"], 140)] for r in x["transient_spikes"]]))
    out += ["", "### Alive at the peak, by allocation site\n",
            table(["site", "GiB", "blocks", "share %"],
                  [[short(y["site"], 140), y["gib"], y["blocks"], y["share_pct"]] for y in x["top_sites"]]), ""]
    return out


def memory_snapshots(s: Mapping[str, Any]) -> list[str]:
    """The section of each memory snapshot of the summary ``s`` (a ProfileSummary)."""
    return [line for m in s.get("memory_snapshots") or [] for line in _memory_snapshot(m)]
