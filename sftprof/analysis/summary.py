"""Postprocess one profiled trial: trace views, archived snapshots, ``profile_summary.{json,md}``.

Inputs are the trial's log dir (``LOG_DIR``: ``stats.jsonl``, ``rank_coords.json``,
``perf_tracer/rank<rank>.pt.trace.json[.gz]``, ``memory_snapshots/step_<N>/...``) and
optionally the driver's ``nvidia_smi.csv`` and the trainer log. Outputs go to the trial's run
dir (``RUN_DIR``). The summary is a pure function of the inputs (no wall-clock timestamps), so
rerunning reproduces it byte for byte.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Optional

from sftprof import artifacts
from sftprof.analysis import comm_wait
from sftprof.analysis import findings as fnd
from sftprof.analysis import inputs, schema
from sftprof.analysis.failure import first_failure
from sftprof.analysis.memory_summary import analyze_snapshot, history_status, plot_memory
from sftprof.analysis.report import RANK_COLUMNS, render_markdown
from sftprof.analysis.safe_pickle import UnsafePickleError, safe_load_file
from sftprof.analysis.step_breakdown import OUTSIDE_WINDOW, exposed_groups, part_label, plot_parts
from sftprof.analysis.trace_summary import (KernelTraceAnalyzer, identity_problems, invalid_events_error,
                                            invalid_events_message)
from sftprof.analysis.views import MAX_VIEW_BYTES, VIEWS, split_trace, view_links
from sftprof.artifacts import KERNEL_TRACES, keep_previous, previous_index, raw_trace_rank, trace_name
from sftprof.atomic import atomic_path, copy_file, put_text, write_failed

__all__ = ["PROFILE_KINDS", "postprocess_trial", "resolve_profile", "rank_table", "summary_left_unchanged",
           "SUMMARY_JSON", "SUMMARY_MD"]

PROFILE_KINDS = ("kernel", "memory")
MODEL_PARTS_DIR = "model_parts"  # RUN_DIR/model_parts/rank<r>.png: stacked bars of GPU time by part and layer
SUMMARY_JSON = artifacts.SUMMARY_JSON
SUMMARY_MD = artifacts.SUMMARY_MD
_SNAP_SUFFIXES = (".pickle", ".pickle.gz")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)



# --------------------------------------------------------------------------------------------
# Kernel traces
# --------------------------------------------------------------------------------------------
def _file_error(path: str, exc: BaseException) -> str:
    """``"<path>: <Type>: <message>"`` (the path once, even when the message already names it)."""
    msg = f"{type(exc).__name__}: {exc}"
    return msg if path in msg else f"{path}: {msg}"


World = tuple[Optional[int], str]  # the trial's number of ranks and where it is read (inputs.world_size)


def _outside_world(rank: int | None, world: World) -> str | None:
    """The error of a trace or snapshot whose file name's rank is not a rank of the trial (``rank >= world size``:
    a file of another trial), None when it is one or either is unknown."""
    n, where = world
    if rank is None or n is None or rank < n:
        return None
    return f"rank {rank} in the file name is not a rank of the trial: its world size is {n} ({where})"


def _rank_views(out_dir: str, rank: int) -> list[str]:
    """Paths of rank ``rank``'s files in every view (and time-window) folder under ``out_dir``, sorted."""
    folders = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(os.path.join(out_dir, folder, name) for folder in folders
                  for name in (trace_name(rank), trace_name(rank, compress=True))
                  if os.path.isfile(os.path.join(out_dir, folder, name)))


def _failed_trace(out_dir: str, rank: int, error: str) -> dict:
    """The result of a trace that is not summarised (``error``), with the rank's views an earlier postprocess left."""
    kept = _rank_views(out_dir, rank)
    return {"rank": rank, "error": error, **({"kept_views": kept} if kept else {})}


def _process_trace(src: str, out_dir: str, rank: int, compress: bool, max_view_bytes: int, step: int,
                   world: World) -> dict:
    """Split one rank's trace into ``out_dir`` and summarise it as rank ``rank``'s trace of step ``step``. The views
    are written to a staging folder next to ``out_dir`` and replace the rank's earlier views (other compression,
    other windows) only when the split succeeded: a trace that fails leaves what an earlier postprocess wrote. So
    does one that is not this trial's: a rank outside its world size ``world`` (not read), or a trace whose own
    steps and rank say it is another step's or another rank's (:func:`identity_problems`)."""
    outside = _outside_world(rank, world)
    if outside:
        return _failed_trace(out_dir, rank, f"{src}: {outside}; the trace was not read")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".staging_rank{rank}_", dir=parent)
    analyzer = KernelTraceAnalyzer()
    try:
        try:
            staged = split_trace(src, stage, rank, compress=compress, max_view_bytes=max_view_bytes,
                                 on_header=analyzer.set_header, on_event=analyzer.add,
                                 on_invalid=analyzer.add_invalid, on_note=analyzer.add_note)
            summary = analyzer.summary()
            calls = summary["collectives"].pop("calls")  # matched across ranks by _kernel_part, not written
            error = invalid_events_error(summary["invalid_events"])
            wrong, unconfirmed = identity_problems(summary["identity"], rank, step)
        except Exception as exc:  # whatever one trace raises is that trace's error, never the whole run's
            return _failed_trace(out_dir, rank, _file_error(src, exc))
        if wrong:  # another step's or rank's trace: its views and figures would stand for what they are not
            return _failed_trace(out_dir, rank, f"{src}: {wrong}")
        links = view_links(staged)
        for path in _rank_views(out_dir, rank):  # an earlier postprocess's (other compression, other windows)
            os.remove(path)
        views = {}
        for view, paths in staged.items():
            views[view] = []
            for path in paths:
                dst = os.path.join(out_dir, os.path.relpath(path, stage))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(path, dst)
                views[view].append(dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    out = {"rank": rank, "views": views, "view_links": links, "summary": summary, "calls": calls}
    if error:
        out["error"] = f"{src}: {error}"
    elif unconfirmed:
        out["warning"] = unconfirmed
    return out


def _find_traces(log_dir: str) -> tuple[list[tuple[int, str]], list[dict], list[dict]]:
    """``(found, duplicates, skipped)`` in ``LOG_DIR/perf_tracer``: ``(rank, path)`` of the first trace of each
    rank (sorted), an error entry per further trace of a rank, and the files that are not trace names."""
    trace_dir = os.path.join(log_dir, artifacts.PERF_TRACER)
    found, duplicates, skipped = [], [], []
    if os.path.isdir(trace_dir):
        # "x.json" sorts before "x.json.gz", and rank<r>.pt.trace.json before the legacy traces-r<r>.chrome.json
        for name in sorted(os.listdir(trace_dir)):
            rank = raw_trace_rank(name)
            if rank is None:
                skipped.append({"file": os.path.join(artifacts.PERF_TRACER, name),
                                "reason": "not a trace name the trainer writes (rank<r>.pt.trace.json[.gz], or the "
                                          "earlier traces-r<r>.chrome.json[.gz])"})
                continue
            src = os.path.join(trace_dir, name)
            first = next((s for r, s in found if r == rank), None)
            if first is not None:
                duplicates.append({"rank": rank, "source": os.path.relpath(src, log_dir),
                                   "error": f"{src}: a second trace for rank {rank}; only "
                                            f"{os.path.basename(first)} was processed"})
            else:
                found.append((rank, src))
    return sorted(found), duplicates, skipped


def _process_traces(found: list[tuple[int, str]], out_dir: str, compress: bool, max_view_bytes: int,
                    jobs: int, step: int, world: World) -> list[dict]:
    """:func:`_process_trace` of each found trace, in ``jobs`` worker processes when more than one."""
    args = [(src, out_dir, rank, compress, max_view_bytes, step, world) for rank, src in found]
    if jobs <= 1 or len(args) <= 1:
        return [_process_trace(*a) for a in args]
    with ProcessPoolExecutor(max_workers=min(jobs, len(args))) as pool:
        futures = [pool.submit(_process_trace, *a) for a in args]
        results = []
        for (src, _, rank, *_), fut in zip(args, futures):
            try:
                results.append(fut.result())
            except Exception as exc:  # a worker that died (killed, out of memory) fails its trace only
                results.append({"rank": rank, "error": _file_error(src, exc)})
    return results


def _trace_entry(log_dir: str, run_dir: str, rank: int, src: str, res: dict) -> dict:
    """The summary entry of one processed trace (paths relative to the dirs); plots its model-part breakdown. A trace
    that failed to split keeps an earlier postprocess's model-part plot of its rank, listed in ``kept_files``."""
    entry = {"rank": rank, "source": os.path.relpath(src, log_dir)}
    for key in ("error", "warning"):
        if key in res:
            entry[key] = res[key]
    if "kept_views" in res:
        entry["kept_views"] = [os.path.relpath(p, run_dir) for p in res["kept_views"]]
    png = os.path.join(run_dir, MODEL_PARTS_DIR, f"rank{rank}.png")
    if "views" not in res and os.path.isfile(png):  # an earlier postprocess's, left as it is: said so
        entry["kept_files"] = [os.path.relpath(png, run_dir)]
    if "views" in res:
        entry["views"] = {v: [os.path.relpath(p, run_dir) for p in res["views"][v]] for v in VIEWS}
        entry["view_links"] = res["view_links"]
        entry["summary"] = res["summary"]
        parts, clock = res["summary"]["parts"], "GPU time"
        if not parts["total_ms"] and res["summary"]["cpu_parts"]:  # a CPU run
            parts, clock = res["summary"]["cpu_parts"], "CPU op time"
        if parts["total_ms"]:
            os.makedirs(os.path.dirname(png), exist_ok=True)
            with atomic_path(png) as tmp:
                plot_parts(parts, f"{clock} by model part, rank {rank} ({os.path.basename(src)})", tmp, clock)
            entry["parts_plot"] = os.path.relpath(png, run_dir)
    return entry


def _kernel_part(log_dir: str, run_dir: str, compress: bool, max_view_bytes: int, jobs: int, step: int,
                 world: World) -> dict:
    """``{"kernel_traces": [...], "skipped": [...], "comm_wait": ...}``: every rank's trace split into views and
    summarised as step ``step`` (:func:`_process_trace`: a trace of another step, of another rank or of a rank
    outside the trial's world size ``world`` is that trace's error), and the communication of the traces without
    errors split into waiting for the last rank and transfer (:func:`sftprof.analysis.comm_wait.split`; None when
    no trace has a collective)."""
    found, traces, skipped = _find_traces(log_dir)
    out_dir = os.path.join(run_dir, KERNEL_TRACES)
    results = _process_traces(found, out_dir, compress, max_view_bytes, jobs, step, world)
    if os.path.isdir(out_dir):  # time-window folders of an earlier postprocess that no rank's views are in now
        for folder in os.listdir(out_dir):
            if os.path.isdir(os.path.join(out_dir, folder)) and not os.listdir(os.path.join(out_dir, folder)):
                os.rmdir(os.path.join(out_dir, folder))
    traces += [_trace_entry(log_dir, run_dir, rank, src, res) for (rank, src), res in zip(found, results)]
    records = {rank: res["calls"] for (rank, _), res in zip(found, results) if "calls" in res and "error" not in res}
    return {"kernel_traces": sorted(traces, key=lambda t: (t["rank"], t["source"])), "skipped": skipped,
            "comm_wait": comm_wait.split(records)}


# --------------------------------------------------------------------------------------------
# Memory snapshots
# --------------------------------------------------------------------------------------------
def _snapshot_rank(name: str) -> tuple[int | None, dict | None]:
    """Rank (and coordinates) read from a snapshot file name; ``(None, None)`` when it names no rank.

    The trainer's ``snapshot_rank<r>_pp<a>_dp<b>_cp<c>_tp<d>_ep<e>.pickle`` gives both; other names give
    the rank when they hold ``rank<r>`` or ``rank_<r>`` / ``rank-<r>`` (``snapshot_rank0.pickle``).
    """
    parsed = artifacts.parse_snapshot_name(name)
    if parsed:
        return parsed
    m = _RANK_IN_NAME.search(name)
    return (int(m.group(1)), None) if m else (None, None)


def _estimate(log_dir: str, rank: int | None, coords: dict | None) -> tuple[dict | None, str | None]:
    """Theoretical memory of ``rank`` (:func:`sftprof.analysis.memory_estimate.estimate_memory`) and why not."""
    cfg, _ = inputs.trial_config(log_dir)  # (an unreadable one is the summary's error: postprocess_trial)
    if cfg is None or rank is None:
        return None, "no config.yaml in the log dir or no rank in the snapshot name: no theoretical estimate"
    try:
        from sftprof.allocation import parse_allocation_mode
        from sftprof.models.hf import load_hf_config
        from sftprof.analysis.memory_estimate import estimate_memory

        a = cfg["actor"]
        layout = parse_allocation_mode(a["backend"])
        hf = load_hf_config(a["path"], a.get("num_layers"))
        return estimate_memory(cfg, hf, layout, layout.rank_coords(rank), int(cfg["profile"]["fake_seq_len"])), None
    except Exception as exc:  # an estimate that cannot be made is a note, never the trial's error
        return None, f"no theoretical estimate: {type(exc).__name__}: {exc}"


def _snapshot_entry(log_dir: str, run_dir: str, src_dir: str, dst_dir: str, name: str, step: int,
                    max_entries: int | None, written: set[str], world: World) -> dict:
    """The summary entry of one snapshot: analysis (with its ``phases_rank<r>.json``), plot, estimate, or its error.

    The snapshot is read, analysed and plotted from the log dir; only then are the snapshot, its plot and its rank's
    phases sidecar moved into ``dst_dir`` (from a staging folder ``RUN_DIR/.staging_rank<r>_*``), replacing the
    files of an earlier postprocess. A snapshot that fails (whatever it raises) is that snapshot's error and is not
    archived (``"archived": false``, the error ends in ``(not archived...)``): no copy of it is written, and the
    archived snapshot, plot and sidecar of an earlier postprocess under the same names stay as they are, listed in
    ``kept_files`` (run-dir relative; a warning names them, :func:`_kept_warning`). ``written``: names this
    postprocess wrote to ``dst_dir`` (updated; a sidecar another snapshot of the rank wrote is not 'earlier').
    A rank in its name outside the trial's world size ``world`` is an error too (snapshots hold no rank of their
    own, so the name's rank is checked only against the world size): not analysed, not archived.
    """
    rank, coords = _snapshot_rank(name)
    entry: dict[str, Any] = {"rank": rank, "file": os.path.relpath(os.path.join(dst_dir, name), run_dir),
                             "coords_from_name": coords}
    src = os.path.join(src_dir, name)
    outside = _outside_world(rank, world)
    if outside:
        entry["error"] = f"{src}: {outside}; not analysed (not archived)"
        entry["archived"] = False
        return entry
    png_name = re.sub(r"\.pickle(\.gz)?$", ".png", name)
    phases_name = artifacts.phases_name(rank) if rank is not None else None
    stage = tempfile.mkdtemp(prefix=f".staging_rank{'' if rank is None else rank}_", dir=run_dir)
    try:
        try:
            copies = {}  # name in dst_dir -> the log dir's file to copy there as it is
            phases = None
            if phases_name and os.path.isfile(os.path.join(src_dir, phases_name)):
                with open(os.path.join(src_dir, phases_name), encoding="utf-8") as f:
                    phases = json.load(f)
                copies[phases_name] = os.path.join(src_dir, phases_name)
            print(f"[postprocess] analysing {name}", file=sys.stderr, flush=True)
            summary = analyze_snapshot(safe_load_file(src), phases)
            plot_memory(summary, f"{name} (step {step})", os.path.join(stage, png_name))
            summary.pop("series")
            summary["history"] = history_status(summary, max_entries)
            copies[name] = src
            for n, path in copies.items():  # the inputs, copied as they are
                try:
                    shutil.copyfile(path, os.path.join(stage, n))
                except OSError as exc:  # a full disk: named by the archive file it was to become
                    raise write_failed(os.path.join(dst_dir, n), exc) from exc
        except Exception as exc:  # whatever one snapshot raises is that snapshot's error, never the whole run's
            why = (": opening it with pickle would run that global" if isinstance(exc, UnsafePickleError) else "")
            # The archive copy of an unsafe one would be run by whoever opens it with plain pickle
            # (torch.cuda._memory_viz does); a damaged one would look like a snapshot there. Neither is archived.
            entry["error"] = _file_error(src, exc) + f" (not archived{why})"
            entry["archived"] = False
            kept = sorted(os.path.relpath(os.path.join(dst_dir, n), run_dir) for n in {name, png_name, phases_name}
                          if n and n not in written and os.path.isfile(os.path.join(dst_dir, n)))
            if kept:
                entry["kept_files"] = kept
            return entry
        for n in sorted(os.listdir(stage)):
            os.replace(os.path.join(stage, n), os.path.join(dst_dir, n))
            written.add(n)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if phases_name in copies:
        entry["phases_file"] = os.path.relpath(os.path.join(dst_dir, phases_name), run_dir)
    entry["plot"] = os.path.relpath(os.path.join(dst_dir, png_name), run_dir)
    entry["summary"] = summary
    entry["estimate"], entry["estimate_note"] = _estimate(log_dir, rank, coords)
    return entry


def _memory_part(log_dir: str, run_dir: str, step: int, world: World) -> dict:
    """``{"memory_snapshots": [...], "skipped": [...]}``: each snapshot of the step's snapshot dir analysed and, when
    that succeeded, archived to the run dir as is with its plot and phases sidecar (:func:`_snapshot_entry`: a
    snapshot that fails is not archived, and an earlier postprocess's archive and plot of it stay). The folder's
    other files (skipped ones, sidecars of ranks without a snapshot there) are copied as they are."""
    src_dir = str(artifacts.snapshot_dir(log_dir, step))
    dst_dir = str(artifacts.snapshot_dir(run_dir, step))
    snapshots, skipped = [], []
    if not os.path.isdir(src_dir):
        return {"memory_snapshots": snapshots, "skipped": skipped}
    os.makedirs(dst_dir, exist_ok=True)
    names = sorted(os.listdir(src_dir))
    snaps = [n for n in names if n.endswith(_SNAP_SUFFIXES) and os.path.isfile(os.path.join(src_dir, n))]
    sidecars = {artifacts.phases_name(r) for r in (_snapshot_rank(n)[0] for n in snaps) if r is not None}
    max_entries = inputs.max_entries(log_dir)
    written: set[str] = set()
    for name in names:
        if name in snaps:
            snapshots.append(_snapshot_entry(log_dir, run_dir, src_dir, dst_dir, name, step, max_entries, written,
                                             world))
            continue
        if not artifacts.PHASES_RE.match(name):
            skipped.append({"file": os.path.relpath(os.path.join(src_dir, name), log_dir),
                            "reason": "not a snapshot (*.pickle, *.pickle.gz) or a phases_rank<r>.json sidecar"})
        if name not in sidecars and os.path.isfile(os.path.join(src_dir, name)):
            copy_file(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return {"memory_snapshots": snapshots, "skipped": skipped}


# --------------------------------------------------------------------------------------------
# Ranks table
# --------------------------------------------------------------------------------------------
def rank_table(summary: dict) -> dict[str, Any]:
    """Per-rank rows (coordinates, step time, peak memory, communication) and max/min imbalance.

    Step time: kernel trials use the trace's step window (ms), memory trials the per-rank
    ``step_time_s`` of the profiled step in ``stats.jsonl``; peak memory: ``mem_peak_allocated_gb``
    of the profiled step in ``stats.jsonl`` (units as the trainer writes them) and, for memory
    trials, the snapshot's peak allocated/reserved GiB;
    communication: NCCL kernel time (``comm_ms``, ``exposed_comm_ms``) and host-side collective op
    time (``host_comm_ms``, gloo/nccl cpu_ops) from the trace (kernel trials only).
    Imbalance of a column = max / min over ranks (None with fewer than 2 values or a zero min).
    """
    rec = (summary.get("stats") or {}).get("profile_step_record") or {}
    stats_ranks = {r.get("rank"): r for r in rec.get("ranks") or [] if isinstance(r, dict)}
    coords = {int(k): v for k, v in (summary.get("rank_coords") or {}).items()}
    rows: dict[int, dict] = {}
    for t in summary.get("kernel_traces") or []:
        s = t.get("summary")
        if s is None or "error" in t:
            continue
        sr = stats_ranks.get(t["rank"], {})
        rows[t["rank"]] = {
            "rank": t["rank"],
            "step_ms": s["step_window"]["wall_ms"],
            "stats_peak_allocated_gb": _num(sr.get("mem_peak_allocated_gb")),
            "comm_ms": s["communication"]["total_ms"],
            "host_comm_ms": s["communication"]["host_ops"]["wall_ms"],
            "exposed_comm_ms": s["communication"]["exposed_ms"],
            "gpu_busy_pct": s["gpu"]["busy_share_pct"],
        }
    for snap in summary.get("memory_snapshots") or []:
        s = snap.get("summary")
        if s is None or snap["rank"] is None:
            continue
        sr = stats_ranks.get(snap["rank"], {})
        step_s = sr.get("step_time_s")
        rows[snap["rank"]] = {
            "rank": snap["rank"],
            "step_ms": round(step_s * 1e3, 3) if isinstance(step_s, (int, float)) else None,
            "stats_peak_allocated_gb": _num(sr.get("mem_peak_allocated_gb")),
            "snapshot_peak_allocated_gib": s["peak_allocated_gib"],
            "snapshot_peak_reserved_gib": s["peak_reserved_gib"],
        }
        if snap["coords_from_name"]:
            coords.setdefault(snap["rank"], snap["coords_from_name"])
    for r, row in rows.items():
        row["coords"] = coords.get(r)
    ordered = [rows[r] for r in sorted(rows)]
    traced = [t for t in summary.get("kernel_traces") or [] if t.get("summary") is not None and "error" not in t]
    exposed = {t["rank"]: exposed_groups(t["summary"].get("collectives") or {}) for t in traced}
    exposed_total = {t["rank"]: t["summary"]["communication"]["exposed_ms"] for t in traced}
    imbalance = {}
    for col in RANK_COLUMNS:
        vals = [(row[col], row["rank"]) for row in ordered if isinstance(row.get(col), (int, float))]
        if not vals:
            continue
        hi, lo = max(vals), min(vals)
        imbalance[col] = {"max": hi[0], "max_rank": hi[1], "min": lo[0], "min_rank": lo[1],
                          "max_over_min": round(hi[0] / lo[0], 4) if len(vals) > 1 and lo[0] > 0 else None}
    return {"rows": ordered, "imbalance": imbalance, "exposed_by_group": exposed_by_group(exposed, exposed_total),
            "work_spread": work_spread({t["rank"]: t["summary"]["parts"].get("compute_cells") for t in traced})}


WORK_SPREAD_ROWS = 8  # cells a work-spread table shows at most
WORK_SPREAD_MIN_MS = 0.5  # ... each differing by at least this much between ranks


def work_spread(cells: dict[int, Optional[list]]) -> Optional[dict[str, Any]]:
    """Where the profiled ranks' own GPU work differs: per (model part, layer, phase) the compute kernel time
    (NCCL kernels left out, whose time includes waiting for the other ranks) on the slowest and fastest rank.

    A rank whose work between two collectives takes longer arrives late at the second, and the others wait there
    (:mod:`sftprof.analysis.comm_wait`); this says which work made it late. Only ranks that ran a cell are compared
    (pipeline stages hold other layers).

    Args:
        cells: rank -> its ``parts["compute_cells"]`` (``[part, layer, phase, ms]``; None for a trace without them).

    Returns:
        None with fewer than two ranks with cells; else ``{"ranks": [...], "compared_ms": {rank: ms}, "min_spread_ms",
        "rows": [{"part", "label", "layer", "phase", "min_ms", "min_rank", "max_ms", "max_rank", "spread_ms"}]}``:
        at most :data:`WORK_SPREAD_ROWS` cells whose spread (max - min over the ranks that ran them, ms) is at least
        :data:`WORK_SPREAD_MIN_MS`, largest first; ``compared_ms``: each rank's compute time in the cells that at
        least two ranks ran.
    """
    have = {r: c for r, c in cells.items() if c}
    if len(have) < 2:
        return None
    by_cell: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r, rows in have.items():
        for part, layer, phase, ms in rows:
            by_cell[(part, layer, phase)][r] = ms
    shared = {k: v for k, v in by_cell.items() if len(v) > 1}
    out = []
    for (part, layer, phase), vals in shared.items():
        hi = max(vals, key=lambda r: (vals[r], -r))
        lo = min(vals, key=lambda r: (vals[r], r))
        spread = round(vals[hi] - vals[lo], 4)
        if spread >= WORK_SPREAD_MIN_MS:
            out.append({"part": part, "label": part_label(part), "layer": layer, "phase": phase, "min_ms": vals[lo],
                        "min_rank": lo, "max_ms": vals[hi], "max_rank": hi, "spread_ms": spread})
    out.sort(key=lambda x: (-x["spread_ms"], x["layer"] is None, x["layer"] or 0, x["part"], x["phase"]))
    return {"ranks": sorted(have), "rows": out[:WORK_SPREAD_ROWS], "min_spread_ms": WORK_SPREAD_MIN_MS,
            "compared_ms": {r: round(sum(v[r] for v in shared.values() if r in v), 3) for r in sorted(have)}}


def exposed_by_group(exposed: dict[int, dict[str, float]], totals: dict[int, float]) -> Optional[dict[str, Any]]:
    """Which process groups explain the difference in exposed communication between ranks.

    Args:
        exposed: rank -> {process group -> exposed NCCL kernel ms} (each rank's
            :func:`sftprof.analysis.step_breakdown.exposed_groups`: every group of its step window, and a row
            ``outside the step window`` for its other NCCL kernels, so that the rows cover every kernel its total
            counts).
        totals: rank -> the rank's exposed NCCL kernel ms (``communication.exposed_ms``; groups that overlap
            each other count once there, once each in ``exposed``).

    Returns:
        None with fewer than 2 ranks; else ``{"ranks": [...], "groups": [{"group", "ms": {rank: ms}}, ...],
        "max_rank", "min_rank", "totals", "extra_ms", "extra_by_group": [(group, ms), ...]}``: the rank with the most
        exposed communication against the one with the least (``extra_ms``: the difference of their totals),
        and per group its ms minus theirs, largest first (the ``outside the step window`` row last among equals).
    """
    if len(exposed) < 2:
        return None
    hi = max(totals, key=lambda r: (totals[r], -r))
    lo = min(totals, key=lambda r: (totals[r], r))
    names = sorted({g for v in exposed.values() for g in v}, key=lambda g: (g == OUTSIDE_WINDOW, g))
    extra = sorted(((g, round(exposed[hi].get(g, 0.0) - exposed[lo].get(g, 0.0), 3)) for g in names),
                   key=lambda kv: -kv[1])
    return {"ranks": sorted(exposed), "groups": [{"group": g, "ms": {r: exposed[r].get(g, 0.0) for r in sorted(exposed)}}
                                                  for g in names],
            "max_rank": hi, "min_rank": lo, "totals": dict(totals), "extra_ms": round(totals[hi] - totals[lo], 3),
            "extra_by_group": extra}


def _findings(summary: dict, cfg: dict | None) -> tuple[list[dict], list[dict]]:
    """Top findings over all profiled ranks (:mod:`sftprof.analysis.findings`) and the what-if lines."""
    found, what = [], []
    traces = [t for t in summary.get("kernel_traces") or [] if "summary" in t and "error" not in t]
    waits = {w["rank"]: w for w in (summary.get("comm_wait") or {}).get("ranks") or []}
    for t in traces:
        f, w = fnd.kernel_findings(t["rank"], t["summary"], cfg, waits.get(t["rank"]))
        found += f
        what += w
    ex = (summary.get("ranks") or {}).get("exposed_by_group")
    if ex and ex["extra_ms"] > 0:
        total = max(t["summary"]["parts"]["total_ms"] or 0.0 for t in traces) or 1.0
        hi, lo, tot = ex["max_rank"], ex["min_rank"], ex["totals"]
        cause, threshold = fnd.exposed_gap_cause(ex)
        if cause is None:  # never a ~0 ms group named as the cause of a larger gap
            said = (f"no process group accounts for it (none differs by {threshold:.2f} ms or more), so it is not "
                    "attributed to a group")
        elif cause[0] == OUTSIDE_WINDOW:
            said = (f"the largest difference, +{cause[1]:.1f} ms, is in NCCL kernels outside the step window, not "
                    "attributed to a group")
        else:
            said = f"the largest per-group difference is {cause[0]}, +{cause[1]:.1f} ms"
        # the rank with the least exposed communication is the one the others wait for: name its longest extra work
        spread = [w for w in ((summary.get("ranks") or {}).get("work_spread") or {}).get("rows") or []
                  if w["max_rank"] == lo]
        why = ""
        if spread:
            w = spread[0]
            where = f"layer {w['layer']} " if w["layer"] is not None else ""
            why = (f"; rank {lo}'s own work runs longest against another rank in {w['label']}, {where}{w['phase']}: "
                   f"{w['spread_ms']:.1f} ms more than rank {w['min_rank']}")
        found.append({"text": f"rank {hi} has {ex['extra_ms']:.1f} ms more exposed communication than rank {lo} "
                              f"({tot[hi]:.1f} vs {tot[lo]:.1f} ms); {said}{why}",
                      "section": "#ranks", "weight": ex["extra_ms"] / total, "key": "exposed imbalance"})
    for m in summary.get("memory_snapshots") or []:
        if "summary" in m and "error" not in m and m["rank"] is not None:
            f, w = fnd.memory_findings(m["rank"], m["summary"], m.get("estimate"), cfg)
            found += f
            what += w
    return fnd.top(found), what


def _num(v) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def postprocess_trial(log_dir: str, run_dir: str, profile_kind: str | None = None, profile_step: int | None = None, *,
                      trainer_log: str | None = None, nvidia_smi_csv: str | None = None,
                      compress: bool = False, max_view_bytes: int = MAX_VIEW_BYTES,
                      jobs: int | None = None) -> tuple[dict, int]:
    """Produce views/snapshot archive and write ``RUN_DIR/profile_summary.{json,md}`` (an earlier summary that is
    the same is left as it is, one that differs kept as ``profile_summary.prev<N>.{json,md}``: :func:`_write`).
    A rank's views and model-part plot, and a snapshot's archived copy, plot and phases sidecar, are replaced only by
    those of a file processed without error; a snapshot that fails is not archived, and what an earlier postprocess
    wrote for a failed file stays, named in a warning (:func:`_kept_warnings`). ``counts["plots"]``: the PNGs this
    postprocess wrote (memory and model-part plots).

    Kernel trials' summaries hold, besides each trace's ``kernel_traces[i].summary``
    (:meth:`KernelTraceAnalyzer.summary`) and the ``ranks`` table (:func:`rank_table`), ``comm_wait``: the
    traced ranks' communication split into waiting for the last rank and transfer
    (:func:`sftprof.analysis.comm_wait.split`, None when no trace has a collective).

    Args:
        log_dir: trial log dir written by the trainer.
        run_dir: trial run dir (created).
        profile_kind: ``kernel`` or ``memory``; None: the one the trial's completion record names
            (:func:`recorded_profile`). Given, it is a check: a different recorded kind is an error.
        profile_step: the profiled training step; None: the recorded one (as ``profile_kind``). Given, a check:
            a step the trial did not profile (:func:`profiled_steps`) is an error.
        trainer_log: trainer log (its tail is kept in the summary when the trial failed).
        nvidia_smi_csv: the driver's nvidia-smi log (optional).
        compress: write trace views as ``.json.gz``.
        max_view_bytes: views larger than this are split into time windows.
        jobs: parallel trace conversions (default: CPU count).

    Returns:
        ``(summary, exit_code)``: exit code 2 when ``log_dir`` does not exist (the summary is still
        written: a trial that died before the trainer's first write is reported as failed, with the
        launcher log's tail); 1 when any trace/snapshot (or ``rank_coords.json``, ``config.yaml``) could not be
        processed, a trace's invalid events dominate it, a trace or snapshot is not the trial's (a trace of another
        step or rank, :func:`sftprof.analysis.trace_summary.identity_problems`; a rank in its name at or above the
        trial's world size, :func:`sftprof.analysis.inputs.world_size`: not summarised), or an ``ok`` trial lacks
        its artifacts; else 0. Whatever one file raises is that file's error; every other file is still processed.
        Failed trials may lack artifacts; memory trials on CPU (completion record ``device: "cpu"``) have none: a
        warning.

    Raises:
        ValueError: unknown ``profile_kind``, one other than the trial recorded, negative ``profile_step`` or one
            the trial did not profile, or
            either not given while the trial recorded none (it died before its completion record; the message says so when ``log_dir`` does
            not exist).
    """
    profile_kind, profile_step = resolve_profile(log_dir, profile_kind, profile_step)
    os.makedirs(run_dir, exist_ok=True)
    coords, coords_error = inputs.read_rank_coords(log_dir)
    cfg, cfg_error = inputs.trial_config(log_dir)
    input_errors = [{"file": name, "error": err} for name, err in ((artifacts.RANK_COORDS, coords_error),
                                                                  (artifacts.CONFIG_YAML, cfg_error)) if err]
    stats = inputs.read_stats(os.path.join(log_dir, artifacts.STATS), profile_step)
    log_dir_missing = not os.path.isdir(log_dir)
    complete = _completion(log_dir, stats, log_dir_missing)
    summary = _trial_header(log_dir, run_dir, profile_kind, profile_step, complete, trainer_log, nvidia_smi_csv)
    # the resolved config travels with the summary, so that a run root copied off the training machine still
    # tells what differs between two runs (compare); None when config.yaml is absent or unreadable (an error)
    summary.update(stats=stats, nvidia_smi=inputs.read_nvidia_smi(nvidia_smi_csv), config=cfg,
                   rank_coords={str(k): v for k, v in sorted(coords.items())})
    if summary["status"] != "ok":
        summary.update(_failure_part(run_dir, log_dir, trainer_log, cfg))
        if summary["failure"] and summary["status"] == "unknown":  # no completion record, but a known failure
            summary["status"] = "failed"
    items = _artifacts_part(summary, log_dir, run_dir, compress, max_view_bytes, jobs or os.cpu_count() or 1)
    summary["nvidia_smi"].pop("timed_samples", None)
    errors, warnings = _problems(summary, items, complete, input_errors, log_dir if log_dir_missing else None)
    warnings += _optional_input_warnings(trainer_log, nvidia_smi_csv, summary["nvidia_smi"])
    warnings += _routing_warnings(stats, profile_step, cfg)
    if profile_kind == "kernel":
        summary["missing_traces"] = _missing_traces(cfg, items) if items else []
        warnings += [{"file": os.path.join(artifacts.PERF_TRACER, trace_name(r)),
                      "warning": f"rank {r}: {MISSING_TRACE}{cfg['perf_tracer'].get('ranks')!r} profiles it; this "
                                 "summary leaves that rank out"} for r in summary["missing_traces"]]
    leftovers = sorted(n for n in os.listdir(run_dir) if n.startswith(".staging_rank"))
    if leftovers:
        warnings.append({"file": ", ".join(leftovers), "warning": "staging folders of an interrupted (or concurrent) "
                         "postprocess: partial views or snapshot copies, not part of this summary; safe to delete "
                         "when no postprocess runs"})
    summary["errors"] = errors
    summary["warnings"] = warnings
    summary["counts"] = _counts(items, profile_kind, errors, summary["skipped"])
    summary["ranks"] = rank_table(summary)
    summary["findings"], summary["what_if"] = _findings(summary, cfg)
    _write(summary, run_dir)
    return summary, 2 if log_dir_missing else (1 if errors else 0)


def resolve_profile(log_dir: str, kind: str | None, step: int | None) -> tuple[str, int]:
    """The kind and step to process: as given, else the trial's recorded ones (``stats.jsonl``'s completion record).

    Raises:
        ValueError: as :func:`postprocess_trial` (the message names the setting).
    """
    if (kind is None or step is None) and not os.path.isdir(log_dir):
        raise ValueError(f"--log-dir {log_dir} does not exist, so --profile-kind and --profile-step cannot be read "
                         "from its stats.jsonl; nothing was written (given both, the trial's summary is written, "
                         "as failed)")
    recorded_kind, recorded_step = inputs.recorded_profile(log_dir)
    if kind is None:
        kind = recorded_kind
        if kind is None:
            raise ValueError(f"--profile-kind: not given, and {os.path.join(log_dir, artifacts.STATS)} has no completion "
                             f"record naming it; pass one of {PROFILE_KINDS}")
    if step is None:
        step = recorded_step
        if step is None:
            raise ValueError(f"--profile-step: not given, and {os.path.join(log_dir, artifacts.STATS)} has no "
                             "completion record naming it; pass the profiled step (an integer >= 0)")
    if kind not in PROFILE_KINDS:
        raise ValueError(f"--profile-kind must be one of {PROFILE_KINDS}, got {kind!r}")
    check_recorded_kind(log_dir, kind)
    if step < 0:
        raise ValueError(f"--profile-step must be >= 0, got {step}")
    check_profiled_step(log_dir, kind, step)
    return kind, step


def profiled_steps(log_dir: str, kind: str) -> tuple[list[int], str]:
    """The steps the trial profiled for ``kind`` and where that is written: ``<section>.profile_steps`` of the trial's
    ``config.yaml`` (``perf_tracer`` for kernel, ``memory_profiler`` for memory), else the step of its completion
    record in ``stats.jsonl``; ``([], "")`` when neither can be read (a trial that died early)."""
    section = "perf_tracer" if kind == "kernel" else "memory_profiler"
    cfg, _ = inputs.trial_config(log_dir)
    steps = ((cfg or {}).get(section) or {}).get("profile_steps") if isinstance(cfg, dict) else None
    if isinstance(steps, list) and steps and all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        return sorted(set(steps)), f"{section}.profile_steps in {os.path.join(log_dir, artifacts.CONFIG_YAML)}"
    _, recorded = inputs.recorded_profile(log_dir)
    if recorded is not None:
        return [recorded], f"the completion record in {os.path.join(log_dir, artifacts.STATS)}"
    return [], ""


def check_profiled_step(log_dir: str, kind: str, step: int) -> None:
    """Refuse a profile step the trial did not profile: its summary would label another step's trace (or no
    artifact at all) with it. Nothing known of the trial's steps (it died before writing them): nothing to check.

    Raises:
        ValueError: ``--profile-step S: the trial profiled step(s) [..] (<where>); pass one of them or leave it
            out; nothing was written``.
    """
    steps, where = profiled_steps(log_dir, kind)
    if steps and step not in steps:
        raise ValueError(f"--profile-step {step}: the trial profiled step(s) {steps} ({where}); pass one of them or "
                         "leave it out; nothing was written")


def check_recorded_kind(log_dir: str, kind: str) -> None:
    """Refuse a profile kind other than the one the trial's completion record names (a trial profiles one kind,
    :func:`sftprof.config.validate`; processed as the other, its summary would describe what it is not). No record
    (a trial that died before writing it): nothing to check.

    Raises:
        ValueError: ``--profile-kind K: the trial recorded profile_kind='R' in LOG_DIR/stats.jsonl; ...``.
    """
    recorded_kind, _ = inputs.recorded_profile(log_dir)
    if recorded_kind is not None and kind != recorded_kind:
        raise ValueError(f"--profile-kind {kind}: the trial recorded profile_kind={recorded_kind!r} in "
                         f"{os.path.join(log_dir, artifacts.STATS)}; pass --profile-kind {recorded_kind} or leave it "
                         "out; nothing was written")


def _completion(log_dir: str, stats: dict, log_dir_missing: bool) -> dict:
    """The trial's completion record; a failed one naming the cause when the log dir does not exist."""
    if log_dir_missing:  # torchrun or the trainer died before the trainer's first write
        return {"status": "failed", "error": f"log dir {log_dir} does not exist: the trial failed before the "
                                             "trainer wrote anything (see launcher.log in the run dir)"}
    return stats.get("complete") if isinstance(stats.get("complete"), dict) else {}


def _trial_header(log_dir: str, run_dir: str, kind: str, step: int, complete: dict, trainer_log: str | None,
                  nvidia_smi_csv: str | None) -> dict[str, Any]:
    """The summary's first members: schema, trial, kind, step, status, completion and the input paths."""
    return {
        "schema": schema.SCHEMA_NAME,
        "schema_version": schema.SCHEMA_VERSION,
        "trial": os.path.basename(os.path.normpath(run_dir)),
        "profile_kind": kind,
        "profile_step": step,
        "status": complete.get("status", "unknown"),
        "completion": {k: complete.get(k) for k in ("error", "steps_done", "world_size", "backend", "device")},
        "paths": {"log_dir": os.path.abspath(log_dir), "run_dir": os.path.abspath(run_dir),
                  "trainer_log": os.path.abspath(trainer_log) if trainer_log else None,
                  "nvidia_smi_csv": os.path.abspath(nvidia_smi_csv) if nvidia_smi_csv else None},
    }


def _failure_part(run_dir: str, log_dir: str, trainer_log: str | None, cfg: dict | None) -> dict[str, Any]:
    """First failure (launcher log and the log dir's node records; the config's node layout where a record lacks
    it) and a log tail: the trainer log's, else the launcher log's."""
    launcher_log = os.path.join(run_dir, "launcher.log")
    cluster = (cfg or {}).get("cluster") if isinstance((cfg or {}).get("cluster"), dict) else {}
    layout = tuple(v if isinstance(v, int) else None for v in (cluster.get("n_nodes"), cluster.get("n_gpus_per_node")))
    tail = inputs.trainer_log_tail(trainer_log)
    return {"failure": first_failure(launcher_log, log_dir, layout),
            "trainer_log_tail": tail or inputs.trainer_log_tail(launcher_log),
            "log_tail_source": "trainer.log (rank 0)" if tail else "launcher.log"}


def _artifacts_part(summary: dict, log_dir: str, run_dir: str, compress: bool, max_view_bytes: int,
                    jobs: int) -> list[dict]:
    """Add the kernel traces (with the nvidia-smi samples of their step window) or the memory snapshots to
    ``summary``; returns their entries."""
    world = inputs.world_size(log_dir)
    if summary["profile_kind"] == "memory":
        summary.update(_memory_part(log_dir, run_dir, summary["profile_step"], world))
        return summary["memory_snapshots"]
    summary.update(_kernel_part(log_dir, run_dir, compress, max_view_bytes, jobs, summary["profile_step"], world))
    items = summary["kernel_traces"]
    windows = [t["summary"]["step_window"] for t in items if "summary" in t]
    windows = [w for w in windows if w.get("unix_start_s") is not None]
    if windows and summary["nvidia_smi"]["available"]:
        summary["nvidia_smi"]["profiled_step"] = inputs.smi_in_window(
            summary["nvidia_smi"], min(w["unix_start_s"] for w in windows), max(w["unix_end_s"] for w in windows))
    return items


MISSING_TRACE = "no trace in the log dir, though perf_tracer.ranks="  # the warning of :func:`_missing_traces`


def _missing_traces(cfg: dict | None, items: list[dict]) -> list[int]:
    """The ranks that the trial's ``perf_tracer.ranks`` profiles (:func:`sftprof.ranks.resolve_ranks` on
    ``actor.backend``'s layout) but whose trace is not in the log dir (deleted, never written): the summary's figures
    leave them out (a warning names each). Empty when the config is absent or does not resolve (nothing is
    assumed)."""
    from sftprof.allocation import parse_allocation_mode
    from sftprof.ranks import resolve_ranks

    try:
        expected = resolve_ranks(cfg["perf_tracer"].get("ranks"), parse_allocation_mode(cfg["actor"]["backend"]))
    except Exception:  # no config, another schema, a spec that does not resolve: no expectation to check
        return []
    have = {it["rank"] for it in items}
    return [r for r in expected if r not in have]


def _kept_warnings(it: dict) -> list[dict]:
    """The warnings of a trace or snapshot that failed while files an earlier postprocess wrote from it stay in the
    run dir: its entry's ``kept_views`` (a trace's views, counted) and ``kept_files`` (a snapshot's archive, plot
    and phases sidecar; a trace's model-part plot: named). They are not from this file."""
    who = f"rank {it['rank']}: " if it["rank"] is not None else ""
    what = "trace" if "source" in it else "snapshot"
    out = []
    if it.get("kept_views"):
        out.append({"file": it["source"], "warning": f"{who}{len(it['kept_views'])} view file(s) of an earlier "
                                                     f"postprocess are kept in {KERNEL_TRACES}/ (not from this trace, "
                                                     "which failed)"})
    if it.get("kept_files"):
        kept = it["kept_files"]
        out.append({"file": it.get("source") or it["file"],
                    "warning": f"{who}{len(kept)} file(s) of an earlier postprocess are kept in "
                               f"{os.path.dirname(kept[0])}/ (not from this {what}, which failed): "
                               + ", ".join(os.path.basename(p) for p in kept)})
    return out


def _problems(summary: dict, items: list[dict], complete: dict, input_errors: list[dict],
              missing_log_dir: str | None) -> tuple[list[dict], list[dict]]:
    """``(errors, warnings)`` of the trial: per file ``{"file", "error"}`` / ``{"file", "warning"}``
    (``input_errors``: those of ``rank_coords.json`` / ``config.yaml``; ``missing_log_dir``: the log dir when it
    does not exist, first error)."""
    kind, step = summary["profile_kind"], summary["profile_step"]
    errors = [{"file": it.get("source") or it.get("file"), "error": it["error"]} for it in items if "error" in it]
    errors += input_errors
    if missing_log_dir:
        errors.insert(0, {"file": "--log-dir", "error": f"{missing_log_dir} does not exist"})
    warnings = []  # a kind or step the trial did not profile is refused before this (resolve_profile)
    for it in items:
        s = it.get("summary") or {}
        if (s.get("history") or {}).get("truncated"):
            warnings.append({"file": it["file"], "warning": s["history"]["message"]})
        warnings += _kept_warnings(it)
        inv = s.get("invalid_events") or {}
        if inv.get("total") and "error" not in it:
            warnings.append({"file": it["source"], "warning": invalid_events_message(inv)})
        if it.get("warning"):  # a trace whose step cannot be confirmed (identity_problems)
            warnings.append({"file": it["source"], "warning": it["warning"]})
    stats = summary["stats"]
    if stats["bad_lines"]:
        warnings.append({"file": "stats.jsonl", "warning": f"{stats['bad_lines']} unparsable lines skipped (not a "
                         "JSON object of a known type, or a step record whose step is not a non-negative integer)"})
    status = "see the Failure section" if summary.get("failure") else "trial status unknown"
    if not stats.get("available") and not missing_log_dir:
        warnings.append({"file": "stats.jsonl", "warning": "not found in the log dir: no step records and no "
                         "completion record (" + ("the trainer never wrote it: " if summary.get("failure") else "")
                         + status + ")"})
    elif stats.get("available") and not stats["steps"] and stats.get("complete") is None:
        warnings.append({"file": "stats.jsonl", "warning": ("empty" if not stats["bad_lines"] else "no valid line")
                         + ": no step records and no completion record (" + status + ")"})
    if summary["status"] in ("ok", "unknown") and not items and not missing_log_dir:
        where = "perf_tracer/rank<rank>.pt.trace.json" if kind == "kernel" else \
            f"memory_snapshots/step_{step}/snapshot_rank*.pickle"
        if kind == "memory" and complete.get("device") == "cpu":
            warnings.append({"file": where, "warning": "no allocator snapshots: the trial ran on CPU "
                                                       "(CUDA caching-allocator snapshots need CUDA)"})
        else:
            errors.append({"file": where, "error": f"trial status {summary['status']} but no artifacts found in the "
                                                   "log dir"})
    return errors, warnings


ROUTING_COLLAPSE_SHARE = 0.5  # a busiest expert receiving at least this share of a step's tokens: collapsed routing


def _routing_warnings(stats: dict, profile_step: int | None, cfg: dict | None) -> list[dict]:
    """Per step whose ``moe_load`` held values that cannot be true, a warning that they were left out
    (:func:`sftprof.analysis.inputs.moe_load`); and a warning when one expert received at least :data:`ROUTING_COLLAPSE_SHARE` of the tokens of a MoE layer in
    the profiled step (the last step record when the profiled one is absent): the profile's expert, dispatch and
    EP-wait figures are those of that routing, unlike a trained router's (balanced top-``k``: ``k / E`` of the
    tokens per expert, 6.25 % for Qwen3-30B-A3B's 8 of 128). What it says follows the trial's config ``cfg``:
    random or loaded weights (``actor.init_from_scratch``), balanced routing already on, and what the backend
    (``actor.backend``) accepts."""
    out = [{"file": "stats.jsonl", "warning": f"step {x['step']}: {x['moe']['invalid']} MoE layer(s) left out of the "
                                              "routing figures: a value that cannot be true (a busiest expert or EP "
                                              "rank below the mean, one expert with more tokens than the step, a "
                                              "negative count)"}
           for x in stats["steps"] if (x.get("moe") or {}).get("invalid")]
    rows = [x for x in stats["steps"] if x.get("moe")]
    row = next((x for x in rows if x["step"] == profile_step), rows[-1] if rows else None)
    m = (row or {}).get("moe") or {}
    if m.get("top_share") is None or m["top_share"] < ROUTING_COLLAPSE_SHARE:
        return out
    ep = (f"; the busiest EP rank got {m['ep_max_over_mean']:.2f}x the mean per EP rank (layer {m['ep_worst_layer']})"
          if m.get("ep_max_over_mean") is not None and m["ep_max_over_mean"] > 1.0 else "")
    actor = (cfg or {}).get("actor") or {}
    megatron = str(actor.get("backend") or "").startswith("megatron")
    knob = "actor.megatron.moe_router_force_load_balancing"
    if (actor.get("megatron") or {}).get("moe_router_force_load_balancing"):  # random logits do not collapse so
        why = f" although {knob}=true (random router logits) was set: check the routing counts"
    elif actor.get("init_from_scratch") is False:
        why = (". The trial loaded the checkpoint (actor.init_from_scratch=false): this is how its router routes the "
               "repeated fake sample, which a real dataset need not reproduce"
               + (f"; {knob}=true (random router logits, balanced load) profiles balanced routing" if megatron else ""))
    else:
        why = (". A randomly initialised router does this on the repeated fake sample, a trained one spreads the "
               "tokens: with random weights, this profile's expert GEMM, dispatch and EP waiting figures are not the "
               "trained model's. Load the checkpoint (MODEL_PATH, i.e. actor.path, with actor.init_from_scratch=false)"
               + (f", or set {knob}=true (random router logits, balanced load) to profile balanced routing" if megatron
                  else f" (the megatron backend also offers balanced routing for profiling, {knob}; the fsdp backend "
                       "does not)"))
    return out + [{"file": "stats.jsonl", "warning": (
        f"step {row['step']}: MoE routing collapsed: one expert received {100 * m['top_share']:.2f} % of the "
        f"tokens in layer {m['top_share_layer']} (busiest expert {m['max_over_mean']:.2f}x the mean){ep}" + why)}]


def _optional_input_warnings(trainer_log: str | None, nvidia_smi_csv: str | None, smi: dict) -> list[dict]:
    """A warning per input file given by option (``--trainer-log``, ``--nvidia-smi-csv``) that is not a file, or
    (nvidia-smi) holds no sample: the summary goes without it."""
    out = [{"file": path, "warning": f"{option}: not found; the summary goes without it"}
           for option, path in (("--trainer-log", trainer_log), ("--nvidia-smi-csv", nvidia_smi_csv))
           if path and not os.path.isfile(path)]
    if nvidia_smi_csv and os.path.isfile(nvidia_smi_csv) and not smi["samples"]:
        out.append({"file": nvidia_smi_csv, "warning": "--nvidia-smi-csv: no sample read (no header naming index and "
                                                       "memory.used, or no row under it); the summary goes without it"})
    return out


def _counts(items: list[dict], kind: str, errors: list[dict], skipped: list[dict]) -> dict[str, int]:
    """Numbers of traces (processed, ok), views, snapshots, plots, errors and skipped files. ``plots``: the PNGs this
    postprocess wrote (a snapshot's memory plot, a trace's model-part plot ``model_parts/rank<r>.png``), not those
    an earlier postprocess left."""
    return {
        "traces": sum(1 for it in items if kind == "kernel"),
        "traces_ok": sum(1 for it in items if kind == "kernel" and "error" not in it),
        "views": sum(len(p) for it in items if kind == "kernel" for p in (it.get("views") or {}).values()),
        "snapshots": sum(1 for it in items if kind == "memory"),
        "plots": sum(("plot" in it) + ("parts_plot" in it) for it in items),
        "errors": len(errors),
        "skipped": len(skipped),
    }


_KEPT_NOTE = "this run dir had a summary from an earlier postprocess: kept as "


def _split_kept_note(text: str | None) -> tuple[str | None, list[dict]]:
    """An earlier summary's JSON text (None: unreadable) re-rendered without the warning :func:`_write` added about
    the summary before it (None if the text is not a JSON object), and that warning (so a later rerun on the same
    inputs is recognised as the same and keeps it)."""
    try:
        earlier = json.loads(text)
        warnings = earlier.get("warnings") or []
        notes = [w for w in warnings if str(w.get("warning", "")).startswith(_KEPT_NOTE)]
        earlier["warnings"] = [w for w in warnings if w not in notes]
        return schema.json_text(earlier), notes
    except (ValueError, AttributeError, TypeError):
        return None, []


_UNCHANGED_NOTE = "the summary is unchanged since the last postprocess (same inputs), left as it is"


def _unchanged_note(notes: list[dict]) -> dict:
    """The warning of a rerun that left a summary as it was (same inputs); where that summary noted that an
    earlier postprocess kept the one before it (``notes``), it names that file: nothing is kept now, so it does not
    say 'kept'."""
    kept = "".join(f"; {n['warning'][len(_KEPT_NOTE):]} holds the one before it" for n in notes)
    return {"file": SUMMARY_JSON, "warning": _UNCHANGED_NOTE + kept}


def summary_left_unchanged(summary: dict) -> bool:
    """Whether :func:`postprocess_trial` left the run dir's summary as it was (a rerun on the same inputs: the
    summary's warnings say so) rather than writing it."""
    return any(w.get("file") == SUMMARY_JSON and str(w.get("warning", "")).startswith(_UNCHANGED_NOTE)
               for w in summary.get("warnings") or [])


def _read_text(path: str) -> str | None:
    """The text of ``path`` (UTF-8, undecodable bytes replaced), None when it is not a readable file."""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            return f.read()
    except OSError:
        return None


def _write(summary: dict, run_dir: str) -> None:
    """Write ``profile_summary.json`` (:func:`sftprof.analysis.schema.summary_json`) and ``profile_summary.md`` to
    ``run_dir``, each atomically (:mod:`sftprof.atomic`: both are written in full under temporary names before either
    replaces anything).

    A summary already there from an earlier postprocess is left as it is, file for file, when the new one is the
    same (a rerun on the same inputs: both files would read the same, apart from that summary's note that an
    earlier summary was kept as ``.prev<N>``); the returned summary's warnings then say that it is unchanged (and
    where the one before it is: :func:`summary_left_unchanged`). Else the earlier one is kept as
    ``profile_summary.prev<N>.{json,md}`` and the new summary says so in its warnings: a rerun on damaged or other
    inputs loses nothing.

    Raises:
        WriteError: a file cannot be written (a full disk: the message names it and the free space); the earlier
            summary is then left as it was, under its own name.
    """
    def render(s: dict) -> tuple[str, str]:
        return schema.summary_json(s), render_markdown(s)

    text, md = render(summary)
    old, old_md = os.path.join(run_dir, SUMMARY_JSON), os.path.join(run_dir, SUMMARY_MD)
    earlier = os.path.isfile(old)
    if earlier:
        text_before = _read_text(old)  # None when unreadable: kept as .prev<N>, as a summary that differs
        stripped, notes = _split_kept_note(text_before) if text_before != text else (text, [])
        if stripped == text and _read_text(old_md) == render({**summary,
                                                               "warnings": summary["warnings"] + notes})[1]:
            summary["warnings"].append(_unchanged_note(notes))  # the same inputs as the postprocess that wrote it
            return
        n = previous_index([old, old_md])
        summary["warnings"].append({"file": SUMMARY_JSON,
                                    "warning": f"{_KEPT_NOTE}{SUMMARY_JSON[: -len('.json')]}.prev{n}.json"})
        text, md = render(summary)
    with atomic_path(old) as tmp_json, atomic_path(old_md) as tmp_md:
        put_text(tmp_json, text)
        put_text(tmp_md, md)
        if earlier:
            keep_previous([old, old_md])
