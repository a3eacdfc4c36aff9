"""Postprocess one profiled trial: trace views, archived snapshots, ``profile_summary.{json,md}``.

Inputs are the trial's log dir (``LOG_DIR``: ``stats.jsonl``, ``rank_coords.json``,
``perf_tracer/rank<rank>.pt.trace.json[.gz]``, ``memory_snapshots/step_<N>/...``) and
optionally the driver's ``nvidia_smi.csv`` and the trainer log. Outputs go to the trial's run
dir (``RUN_DIR``). The summary is a pure function of the inputs (no wall-clock timestamps), so
rerunning reproduces it byte for byte.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import yaml

from sftprof.analysis import findings as fnd
from sftprof.analysis.failure import first_failure
from sftprof.analysis.memory_summary import analyze_snapshot, history_status, plot_memory
from sftprof.analysis.safe_pickle import safe_load_file
from sftprof.analysis.step_breakdown import PHASES, plot_parts
from sftprof.analysis.trace_check import finite_json, is_finite_number
from sftprof import artifacts
from sftprof.artifacts import KERNEL_TRACES, raw_trace_rank, trace_name
from sftprof.analysis.kernel_names import short_kernel_name
from sftprof.analysis.trace_summary import KernelTraceAnalyzer, invalid_events_error, invalid_events_message
from sftprof.analysis.views import MAX_VIEW_BYTES, VIEWS, split_trace

__all__ = ["PROFILE_KINDS", "postprocess_trial", "read_stats", "read_nvidia_smi", "smi_in_window", "render_markdown",
           "rank_table", "SUMMARY_JSON", "SUMMARY_MD"]

PROFILE_KINDS = ("kernel", "memory")
MODEL_PARTS_DIR = "model_parts"  # RUN_DIR/model_parts/rank<r>.png: stacked bars of GPU time by part and layer
SUMMARY_JSON = artifacts.SUMMARY_JSON
SUMMARY_MD = artifacts.SUMMARY_MD
_SNAP_SUFFIXES = (".pickle", ".pickle.gz")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_PROFILE_STEP_FIELDS = ("step_time_s", "tokens", "tokens_per_s", "tflops_per_gpu", "mfu",
                        "mem_peak_allocated_gb", "mem_peak_allocated_rank", "mem_peak_reserved_gb",
                        "mem_peak_reserved_rank", "n_ranks")
_RANK_STAT_FIELDS = ("step_time_s", "mem_peak_allocated_gb", "mem_peak_reserved_gb")
_RANK_COLUMNS = ("step_ms", "stats_peak_allocated_gb", "snapshot_peak_allocated_gib", "snapshot_peak_reserved_gib",
                 "comm_ms", "exposed_comm_ms", "host_comm_ms")


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def _finite(v) -> float | int | None:
    """``v`` when it is a finite int/float (not a bool), else None."""
    return v if is_finite_number(v) else None


def _per_rank(rec: dict) -> dict[int, dict]:
    """``{rank: {step_time_s, mem_peak_allocated_gb, mem_peak_reserved_gb}}`` of one step record.

    From the record's ``ranks`` list (every rank, as the trainer all-gathers it); a record without it
    holds global rank 0's figures at top level (the trainer writes ``stats.jsonl`` on rank 0).
    """
    ranks = rec.get("ranks")
    rows = [r for r in ranks if isinstance(r, dict) and type(r.get("rank")) is int] \
        if isinstance(ranks, list) else []
    if not rows:
        rows = [dict(rec, rank=0)]
    return {int(r["rank"]): {k: _finite(r.get(k)) for k in _RANK_STAT_FIELDS} for r in rows}


def _max_over_ranks(per_rank: dict[int, dict], key: str) -> tuple[float | None, int | None]:
    vals = [(v[key], r) for r, v in per_rank.items() if v[key] is not None]
    if not vals:
        return None, None
    value, rank = max(vals, key=lambda x: (x[0], -x[1]))
    return value, rank


def read_stats(path: str, profile_step: int | None) -> dict[str, Any]:
    """Step records and the completion record of ``stats.jsonl``.

    Returns ``{"available", "bad_lines", "steps": [...], "profile_step_record", "per_rank", "complete",
    "max_mem_peak_allocated_gb", "max_mem_peak_allocated_rank", "max_mem_peak_reserved_gb",
    "max_mem_peak_reserved_rank"}`` plus the profiled step's ``step_time_s``, ``tokens``, ``tokens_per_s``,
    ``tflops_per_gpu``, ``mfu`` and ``mem_peak_{allocated,reserved}_{gb,rank}`` at top level (None when
    absent; ``*_gb`` are GiB as the trainer writes them).

    Memory peaks are the maximum over the ranks of the step record's ``ranks`` list, with the rank that
    holds it (``*_rank``) and ``n_ranks``, the number of ranks the figure is taken over (1 when the record
    has no per-rank list: then it is rank 0's alone). ``per_rank`` maps every rank of the profiled step's
    record, profiled or not, to its ``step_time_s`` and peaks. Non-finite or non-numeric values count as
    absent. A missing file gives ``available: False``; unparsable lines are counted in ``bad_lines``.
    """
    out: dict[str, Any] = {"available": os.path.isfile(path), "bad_lines": 0, "steps": [],
                           "profile_step_record": None, "per_rank": {}, "complete": None}
    out.update(dict.fromkeys(_PROFILE_STEP_FIELDS))
    if not out["available"]:
        return out
    log = artifacts.read_stats(path)
    out["bad_lines"] = log.bad_lines
    for step_record in log.steps:
        rec = step_record.to_json()
        row = {k: rec.get(k) for k in ("step", "step_time_s", "tokens", "tokens_per_s", "tflops_per_gpu", "mfu",
                                       "recompute_tflops_per_gpu", "profiled")}
        per_rank = _per_rank(rec)
        for key in ("mem_peak_allocated", "mem_peak_reserved"):
            row[f"{key}_gb"], row[f"{key}_rank"] = _max_over_ranks(per_rank, f"{key}_gb")
        row["n_ranks"] = len(per_rank)
        out["steps"].append(row)
        if profile_step is not None and rec.get("step") == profile_step:
            out["profile_step_record"] = rec
            out["per_rank"] = {str(r): v for r, v in sorted(per_rank.items())}
            out.update({k: v for k, v in row.items() if k.startswith("mem_peak_") or k == "n_ranks"})
    if log.completion is not None:
        out["complete"] = log.completion.to_json()
    for k in _PROFILE_STEP_FIELDS:
        if not k.startswith("mem_peak_") and k != "n_ranks":
            out[k] = (out["profile_step_record"] or {}).get(k)
    for key in ("mem_peak_allocated", "mem_peak_reserved"):
        vals = [(s[f"{key}_gb"], s[f"{key}_rank"]) for s in out["steps"] if s[f"{key}_gb"] is not None]
        best = max(vals, key=lambda x: x[0]) if vals else (None, None)
        out[f"max_{key}_gb"], out[f"max_{key}_rank"] = best
    return out


def _number(text: str) -> float | None:
    m = re.match(r"\s*(-?\d+(?:\.\d+)?)", text or "")
    return float(m.group(1)) if m else None


def read_nvidia_smi(path: str | None) -> dict[str, Any]:
    """Peaks from an ``nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total
    --format=csv[,nounits]`` log.

    Returns ``{"available", "samples", "gpus": [{"index", "peak_memory_used_mib", "memory_total_mib",
    "peak_utilization_pct", "mean_utilization_pct"}], "peak_memory_used_mib", "peak_utilization_pct",
    "timed_samples"}``; ``timed_samples`` lists ``(unix s, GPU index, util %, memory MiB)`` of the rows whose
    timestamp parses (:func:`smi_in_window` reads it; the summary drops it before writing JSON).
    Absent or empty files and ``[N/A]`` values are tolerated; units in values (``MiB``, ``%``) are stripped.
    """
    out: dict[str, Any] = {"available": False, "samples": 0, "gpus": [],
                           "peak_memory_used_mib": None, "peak_utilization_pct": None}
    if not path or not os.path.isfile(path):
        return out
    per: dict[int, dict[str, list[float]]] = {}
    timed: list[tuple] = []
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rows = csv.reader(f)
        header = None
        for row in rows:
            if not row:
                continue
            names = [re.sub(r"\s*\[.*?\]\s*$", "", c.strip()) for c in row]
            if "index" in names and "memory.used" in names:
                header = names  # (repeated headers from restarted loggers are fine)
                continue
            if header is None or len(row) != len(header):
                continue
            rec = dict(zip(header, row))
            idx = _number(rec.get("index", ""))
            if idx is None:
                continue
            d = per.setdefault(int(idx), {"mem": [], "total": [], "util": []})
            for key, col in (("mem", "memory.used"), ("total", "memory.total"), ("util", "utilization.gpu")):
                v = _number(rec.get(col, ""))
                if v is not None:
                    d[key].append(v)
            t = _smi_time(rec.get("timestamp", ""))
            if t is not None:
                timed.append((t, int(idx), _number(rec.get("utilization.gpu", "")), _number(rec.get("memory.used", ""))))
            out["samples"] += 1
    out["available"] = out["samples"] > 0
    for idx in sorted(per):
        d = per[idx]
        out["gpus"].append({
            "index": idx,
            "peak_memory_used_mib": max(d["mem"]) if d["mem"] else None,
            "memory_total_mib": max(d["total"]) if d["total"] else None,
            "peak_utilization_pct": max(d["util"]) if d["util"] else None,
            "mean_utilization_pct": round(sum(d["util"]) / len(d["util"]), 2) if d["util"] else None,
        })
    mems = [g["peak_memory_used_mib"] for g in out["gpus"] if g["peak_memory_used_mib"] is not None]
    utils = [g["peak_utilization_pct"] for g in out["gpus"] if g["peak_utilization_pct"] is not None]
    out["peak_memory_used_mib"] = max(mems) if mems else None
    out["peak_utilization_pct"] = max(utils) if utils else None
    out["timed_samples"] = timed  # (unix s, GPU index, util %, memory MiB); dropped before JSON
    return out


def _smi_time(text: str) -> float | None:
    """Unix seconds of an nvidia-smi ``timestamp`` (``2026/11/30 09:45:39.123``, local time of this machine)."""
    try:
        return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def smi_in_window(smi: dict, lo_s: float, hi_s: float) -> dict[str, Any]:
    """nvidia-smi samples inside ``[lo_s, hi_s]`` (unix seconds): per GPU the sample count, mean and peak
    ``utilization.gpu`` and peak ``memory.used`` (MiB).

    ``utilization.gpu`` is the share of nvidia-smi's sample period in which at least one kernel ran on
    the GPU: a busy-ness figure like the trace's GPU busy %, not SM occupancy or tensor-core use.
    Timestamps are read as local time of the machine that postprocesses (the driver runs it where
    nvidia-smi ran).
    """
    per: dict[int, list] = {}
    for t, idx, util, mem in smi.get("timed_samples") or []:
        if lo_s <= t <= hi_s:
            per.setdefault(idx, []).append((util, mem))
    gpus = []
    for idx in sorted(per):
        u = [x for x, _ in per[idx] if x is not None]
        m = [y for _, y in per[idx] if y is not None]
        gpus.append({"index": idx, "samples": len(per[idx]),
                     "mean_utilization_pct": round(sum(u) / len(u), 2) if u else None,
                     "peak_utilization_pct": max(u) if u else None, "peak_memory_used_mib": max(m) if m else None})
    return {"window_unix_s": [lo_s, hi_s], "gpus": gpus}


def _read_rank_coords(log_dir: str) -> tuple[dict[int, dict], str | None]:
    """Rank -> coordinates from ``rank_coords.json`` and an error message if it is unreadable."""
    path = os.path.join(log_dir, artifacts.RANK_COORDS)
    if not os.path.isfile(path):
        return {}, None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return {int(r): c for r, c in (data.get("ranks") or {}).items()}, None
    except (ValueError, AttributeError, TypeError) as exc:
        return {}, f"{path}: unreadable ({type(exc).__name__}: {exc})"


def _trainer_log_tail(path: str | None, lines: int = 30) -> list[str] | None:
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        tail = f.readlines()[-lines:]
    return [t.rstrip("\n") for t in tail]


# --------------------------------------------------------------------------------------------
# Kernel traces
# --------------------------------------------------------------------------------------------
def _file_error(path: str, exc: BaseException) -> str:
    """``"<path>: <Type>: <message>"`` (the path once, even when the message already names it)."""
    msg = f"{type(exc).__name__}: {exc}"
    return msg if path in msg else f"{path}: {msg}"


def _remove_rank_views(out_dir: str, rank: int) -> None:
    """Remove rank ``rank``'s files from every view (and time-window) folder under ``out_dir``."""
    if os.path.isdir(out_dir):
        for folder in os.listdir(out_dir):
            for name in (trace_name(rank), trace_name(rank, compress=True)):
                if os.path.isfile(os.path.join(out_dir, folder, name)):
                    os.remove(os.path.join(out_dir, folder, name))


def _process_trace(src: str, out_dir: str, rank: int, compress: bool, max_view_bytes: int) -> dict:
    _remove_rank_views(out_dir, rank)  # views of an earlier run (other compression, other windows) would go stale
    analyzer = KernelTraceAnalyzer()
    try:
        views = split_trace(src, out_dir, rank, compress=compress, max_view_bytes=max_view_bytes,
                            on_header=analyzer.set_header, on_event=analyzer.add,
                            on_invalid=analyzer.add_invalid, on_note=analyzer.add_note)
        summary = analyzer.summary()
        error = invalid_events_error(summary["invalid_events"])
    except Exception as exc:  # whatever one trace raises is that trace's error, never the whole run's
        _remove_rank_views(out_dir, rank)  # no half-valid views of a trace that failed
        return {"rank": rank, "error": _file_error(src, exc)}
    out = {"rank": rank, "views": views, "summary": summary}
    if error:
        out["error"] = f"{src}: {error}"
    return out


def _kernel_part(log_dir: str, run_dir: str, compress: bool, max_view_bytes: int, jobs: int) -> dict:
    trace_dir = os.path.join(log_dir, artifacts.PERF_TRACER)
    out_dir = os.path.join(run_dir, KERNEL_TRACES)
    found, traces, skipped = [], [], []
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
                traces.append({"rank": rank, "source": os.path.relpath(src, log_dir),
                               "error": f"{src}: a second trace for rank {rank}; only "
                                        f"{os.path.basename(first)} was processed"})
            else:
                found.append((rank, src))
    found.sort()
    args = [(src, out_dir, rank, compress, max_view_bytes) for rank, src in found]
    if jobs > 1 and len(args) > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, len(args))) as pool:
            futures = [pool.submit(_process_trace, *a) for a in args]
            results = []
            for (src, _, rank, _, _), fut in zip(args, futures):
                try:
                    results.append(fut.result())
                except Exception as exc:  # a worker that died (killed, out of memory) fails its trace only
                    results.append({"rank": rank, "error": _file_error(src, exc)})
    else:
        results = [_process_trace(*a) for a in args]
    for (rank, src), res in zip(found, results):
        entry = {"rank": rank, "source": os.path.relpath(src, log_dir)}
        if "error" in res:
            entry["error"] = res["error"]
        if "views" in res:
            entry["views"] = {v: [os.path.relpath(p, run_dir) for p in res["views"][v]] for v in VIEWS}
            entry["summary"] = res["summary"]
            if res["summary"]["parts"]["total_ms"]:
                png = os.path.join(run_dir, MODEL_PARTS_DIR, f"rank{rank}.png")
                os.makedirs(os.path.dirname(png), exist_ok=True)
                plot_parts(res["summary"]["parts"], f"GPU time by model part, rank {rank} ({os.path.basename(src)})", png)
                entry["parts_plot"] = os.path.relpath(png, run_dir)
        traces.append(entry)
    return {"kernel_traces": sorted(traces, key=lambda t: (t["rank"], t["source"])), "skipped": skipped}


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


def _max_entries(log_dir: str) -> int | None:
    """``memory_profiler.max_entries`` of the trial (``LOG_DIR/config.yaml``), None when unknown."""
    path = os.path.join(log_dir, artifacts.CONFIG_YAML)
    try:
        with open(path, encoding="utf-8") as f:
            value = (yaml.safe_load(f) or {}).get("memory_profiler", {}).get("max_entries")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _trial_config(log_dir: str) -> dict | None:
    """The trial's resolved config (``LOG_DIR/config.yaml``) as a dict, None when absent or unreadable."""
    try:
        with open(os.path.join(log_dir, artifacts.CONFIG_YAML), encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _estimate(log_dir: str, rank: int | None, coords: dict | None) -> tuple[dict | None, str | None]:
    """Theoretical memory of ``rank`` (:func:`sftprof.analysis.memory_estimate.estimate_memory`) and why not."""
    cfg = _trial_config(log_dir)
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


def _memory_part(log_dir: str, run_dir: str, step: int) -> dict:
    src_dir = str(artifacts.snapshot_dir(log_dir, step))
    dst_dir = str(artifacts.snapshot_dir(run_dir, step))
    snapshots, skipped = [], []
    if not os.path.isdir(src_dir):
        return {"memory_snapshots": snapshots, "skipped": skipped}
    os.makedirs(dst_dir, exist_ok=True)
    names = sorted(os.listdir(src_dir))
    for name in names:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    max_entries = _max_entries(log_dir)
    for name in names:
        if not name.endswith(_SNAP_SUFFIXES) or not os.path.isfile(os.path.join(src_dir, name)):
            if not artifacts.PHASES_RE.match(name):
                skipped.append({"file": os.path.relpath(os.path.join(src_dir, name), log_dir),
                                "reason": "not a snapshot (*.pickle, *.pickle.gz) or a phases_rank<r>.json sidecar"})
            continue
        rank, coords = _snapshot_rank(name)
        entry: dict[str, Any] = {"rank": rank, "file": os.path.relpath(os.path.join(dst_dir, name), run_dir),
                                 "coords_from_name": coords}
        src = os.path.join(src_dir, name)
        phases_path = os.path.join(src_dir, artifacts.phases_name(rank))
        try:
            phases = None
            if rank is not None and os.path.isfile(phases_path):
                with open(phases_path, encoding="utf-8") as f:
                    phases = json.load(f)
                entry["phases_file"] = os.path.relpath(os.path.join(dst_dir, artifacts.phases_name(rank)), run_dir)
            print(f"[postprocess] analysing {name}", file=sys.stderr, flush=True)
            summary = analyze_snapshot(safe_load_file(src), phases)
            png = os.path.join(dst_dir, re.sub(r"\.pickle(\.gz)?$", ".png", name))
            plot_memory(summary, f"{name} (step {step})", png)
            summary.pop("series")
            entry["plot"] = os.path.relpath(png, run_dir)
            summary["history"] = history_status(summary, max_entries)
            entry["summary"] = summary
            entry["estimate"], entry["estimate_note"] = _estimate(log_dir, rank, coords)
        except Exception as exc:  # whatever one snapshot raises is that snapshot's error
            entry["error"] = _file_error(src, exc)
        snapshots.append(entry)
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
    imbalance = {}
    for col in _RANK_COLUMNS:
        vals = [(row[col], row["rank"]) for row in ordered if isinstance(row.get(col), (int, float))]
        if not vals:
            continue
        hi, lo = max(vals), min(vals)
        imbalance[col] = {"max": hi[0], "max_rank": hi[1], "min": lo[0], "min_rank": lo[1],
                          "max_over_min": round(hi[0] / lo[0], 4) if len(vals) > 1 and lo[0] > 0 else None}
    return {"rows": ordered, "imbalance": imbalance}


def _findings(summary: dict, cfg: dict | None) -> tuple[list[dict], list[dict]]:
    """Top findings over all profiled ranks (:mod:`sftprof.analysis.findings`) and the what-if lines."""
    found, what = [], []
    traces = [t for t in summary.get("kernel_traces") or [] if "summary" in t and "error" not in t]
    for t in traces:
        f, w = fnd.kernel_findings(t["rank"], t["summary"], cfg)
        found += f
        what += w
    if len(traces) > 1:
        exp = {t["rank"]: t["summary"]["communication"]["exposed_ms"] for t in traces}
        hi, lo = max(exp, key=exp.get), min(exp, key=exp.get)
        g_hi = next(t for t in traces if t["rank"] == hi)["summary"]["collectives"]["exposed_by_group_ms"]
        g_lo = next(t for t in traces if t["rank"] == lo)["summary"]["collectives"]["exposed_by_group_ms"]
        diff = {g: g_hi.get(g, 0.0) - g_lo.get(g, 0.0) for g in set(g_hi) | set(g_lo)}
        if diff and exp[hi] > exp[lo]:
            g = max(diff, key=diff.get)
            total = max(t["summary"]["parts"]["total_ms"] or 0.0 for t in traces) or 1.0
            found.append({"text": f"rank {hi} has {exp[hi] - exp[lo]:.1f} ms more exposed communication than rank {lo} "
                                  f"({exp[hi]:.1f} vs {exp[lo]:.1f} ms); group {g} explains {diff[g]:.1f} ms of it",
                          "section": "#ranks", "weight": (exp[hi] - exp[lo]) / total})
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
def recorded_profile(log_dir: str) -> tuple[str | None, int | None]:
    """``(profile_kind, profile_step)`` of the trial's completion record in ``stats.jsonl`` (what the trainer
    profiled), ``(None, None)`` when the file or the record is missing."""
    path = os.path.join(log_dir, artifacts.STATS)
    if not os.path.isfile(path):
        return None, None
    try:
        done = artifacts.read_stats(path).completion
    except OSError:
        return None, None
    return (done.profile_kind, done.profile_step) if done is not None else (None, None)


def postprocess_trial(log_dir: str, run_dir: str, profile_kind: str | None = None, profile_step: int | None = None, *,
                      trainer_log: str | None = None, nvidia_smi_csv: str | None = None,
                      compress: bool = False, max_view_bytes: int = MAX_VIEW_BYTES,
                      jobs: int | None = None) -> tuple[dict, int]:
    """Produce views/snapshot archive and write ``RUN_DIR/profile_summary.{json,md}``.

    Args:
        log_dir: trial log dir written by the trainer.
        run_dir: trial run dir (created).
        profile_kind: ``kernel`` or ``memory``; None: the one the trial's completion record names
            (:func:`recorded_profile`). Given, it is a check: a different recorded kind is a warning.
        profile_step: the profiled training step; None: the recorded one (as ``profile_kind``).
        trainer_log: trainer log (its tail is kept in the summary when the trial failed).
        nvidia_smi_csv: the driver's nvidia-smi log (optional).
        compress: write trace views as ``.json.gz``.
        max_view_bytes: views larger than this are split into time windows.
        jobs: parallel trace conversions (default: CPU count).

    Returns:
        ``(summary, exit_code)``: exit code 2 when ``log_dir`` does not exist (the summary is still
        written: a trial that died before the trainer's first write is reported as failed, with the
        launcher log's tail); 1 when any trace/snapshot (or ``rank_coords.json``) could not be processed,
        a trace's invalid events dominate it, or an ``ok`` trial lacks its artifacts; else 0. Whatever
        one file raises is that file's error; every other file is still processed. Failed trials may
        lack artifacts; memory trials on CPU (completion record ``device: "cpu"``) have none: a warning.

    Raises:
        ValueError: unknown ``profile_kind`` or negative ``profile_step``, or either not given while the trial
            recorded none (it died before its completion record).
    """
    recorded_kind, recorded_step = recorded_profile(log_dir)
    if profile_kind is None:
        profile_kind = recorded_kind
        if profile_kind is None:
            raise ValueError(f"--profile-kind: not given, and {os.path.join(log_dir, artifacts.STATS)} has no completion "
                             f"record naming it; pass one of {PROFILE_KINDS}")
    if profile_step is None:
        profile_step = recorded_step
        if profile_step is None:
            raise ValueError(f"--profile-step: not given, and {os.path.join(log_dir, artifacts.STATS)} has no "
                             "completion record naming it; pass the profiled step (an integer >= 0)")
    if profile_kind not in PROFILE_KINDS:
        raise ValueError(f"--profile-kind must be one of {PROFILE_KINDS}, got {profile_kind!r}")
    if profile_step < 0:
        raise ValueError(f"--profile-step must be >= 0, got {profile_step}")
    os.makedirs(run_dir, exist_ok=True)
    coords, coords_error = _read_rank_coords(log_dir)
    stats = read_stats(os.path.join(log_dir, artifacts.STATS), profile_step)
    complete = stats.get("complete") if isinstance(stats.get("complete"), dict) else {}
    log_dir_missing = not os.path.isdir(log_dir)
    if log_dir_missing:  # torchrun or the trainer died before the trainer's first write
        complete = {"status": "failed", "error": f"log dir {log_dir} does not exist: the trial failed before the "
                                                 "trainer wrote anything (see launcher.log in the run dir)"}
    status = complete.get("status", "unknown")
    device = complete.get("device")
    summary: dict[str, Any] = {
        "schema": "sftprof.profile_summary/1",
        "trial": os.path.basename(os.path.normpath(run_dir)),
        "profile_kind": profile_kind,
        "profile_step": profile_step,
        "status": status,
        "completion": {k: complete.get(k) for k in ("error", "steps_done", "world_size", "backend", "device")},
        "paths": {"log_dir": os.path.abspath(log_dir), "run_dir": os.path.abspath(run_dir),
                  "trainer_log": os.path.abspath(trainer_log) if trainer_log else None,
                  "nvidia_smi_csv": os.path.abspath(nvidia_smi_csv) if nvidia_smi_csv else None},
        "stats": stats,
        "nvidia_smi": read_nvidia_smi(nvidia_smi_csv),
        "rank_coords": {str(k): v for k, v in sorted(coords.items())},
    }
    if status != "ok":
        launcher_log = os.path.join(run_dir, "launcher.log")
        summary["failure"] = first_failure(launcher_log)
        tail = _trainer_log_tail(trainer_log)
        summary["trainer_log_tail"] = tail or _trainer_log_tail(launcher_log)
        summary["log_tail_source"] = "trainer.log (rank 0)" if tail else "launcher.log"
    if profile_kind == "kernel":
        summary.update(_kernel_part(log_dir, run_dir, compress, max_view_bytes, jobs or os.cpu_count() or 1))
        items = summary["kernel_traces"]
        windows = [t["summary"]["step_window"] for t in items if "summary" in t]
        windows = [w for w in windows if w.get("unix_start_s") is not None]
        if windows and summary["nvidia_smi"]["available"]:
            summary["nvidia_smi"]["profiled_step"] = smi_in_window(
                summary["nvidia_smi"], min(w["unix_start_s"] for w in windows), max(w["unix_end_s"] for w in windows))
    else:
        summary.update(_memory_part(log_dir, run_dir, profile_step))
        items = summary["memory_snapshots"]
    summary["nvidia_smi"].pop("timed_samples", None)
    errors = [{"file": it.get("source") or it.get("file"), "error": it["error"]} for it in items if "error" in it]
    if coords_error:
        errors.append({"file": "rank_coords.json", "error": coords_error})
    if log_dir_missing:
        errors.insert(0, {"file": "--log-dir", "error": f"{log_dir} does not exist"})
    warnings = []
    for key, asked in (("profile_kind", profile_kind), ("profile_step", profile_step)):
        recorded = complete.get(key)
        if recorded is not None and recorded != asked:
            warnings.append({"file": "stats.jsonl", "warning": f"the trial profiled {key}={recorded!r}, "
                                                               f"not the requested {asked!r}"})
    for it in items:
        s = it.get("summary") or {}
        if (s.get("history") or {}).get("truncated"):
            warnings.append({"file": it["file"], "warning": s["history"]["message"]})
        inv = s.get("invalid_events") or {}
        if inv.get("total") and "error" not in it:
            warnings.append({"file": it["source"], "warning": invalid_events_message(inv)})
    if stats["bad_lines"]:
        warnings.append({"file": "stats.jsonl", "warning": f"{stats['bad_lines']} unparsable lines skipped"})
    if status == "ok" and not items:
        where = "perf_tracer/rank<rank>.pt.trace.json" if profile_kind == "kernel" else \
            f"memory_snapshots/step_{profile_step}/snapshot_rank*.pickle"
        if profile_kind == "memory" and device == "cpu":
            warnings.append({"file": where, "warning": "no allocator snapshots: the trial ran on CPU "
                                                       "(CUDA caching-allocator snapshots need CUDA)"})
        else:
            errors.append({"file": where, "error": "trial status ok but no artifacts found in the log dir"})
    summary["errors"] = errors
    summary["warnings"] = warnings
    summary["counts"] = {
        "traces": sum(1 for it in items if profile_kind == "kernel"),
        "traces_ok": sum(1 for it in items if profile_kind == "kernel" and "error" not in it),
        "views": sum(len(p) for it in items if profile_kind == "kernel" for p in (it.get("views") or {}).values()),
        "snapshots": sum(1 for it in items if profile_kind == "memory"),
        "plots": sum(1 for it in items if "plot" in it),
        "errors": len(errors),
        "skipped": len(summary["skipped"]),
    }
    summary["ranks"] = rank_table(summary)
    summary["findings"], summary["what_if"] = _findings(summary, _trial_config(log_dir))
    with open(os.path.join(run_dir, SUMMARY_JSON), "w", encoding="utf-8") as f:
        json.dump(finite_json(summary)[0], f, indent=1, sort_keys=True, allow_nan=False)  # strict JSON
        f.write("\n")
    with open(os.path.join(run_dir, SUMMARY_MD), "w", encoding="utf-8") as f:
        f.write(render_markdown(summary))
    return summary, 2 if log_dir_missing else (1 if errors else 0)


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------
def _fmt(v, nd=3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _with_rank(value, rank) -> str:
    return "–" if value is None else f"{_fmt(value)} (r{rank})"


def _table(headers: list[str], rows: list[list]) -> str:
    def cell(x):
        return _fmt(x).replace("|", "\\|")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _short(name: str, n: int = 110) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def _parts_table(rows: list[dict]) -> str:
    return _table(["part"] + [f"{p} ms" for p in PHASES] + ["total ms", "share %"],
                  [[r["label"]] + [r[f"{p}_ms"] for p in PHASES] + [r["total_ms"], r["share_pct"]] for r in rows])


def _kernel_details(t: dict) -> list[str]:
    """Markdown of one rank's model-part breakdown, kernel efficiency, collectives and host sections."""
    k, rank = t["summary"], t["rank"]
    parts, out = k["parts"], []
    if parts["total_ms"]:
        out.append(f"\n### {fnd.parts_heading(rank)}\n")
        how = ("model-part ranges placed by the trainer's module hooks" if parts["source"] == "module_regions" else
               "**no model-part ranges in this trace**: split by kernel name only")
        out.append(f"GPU time of the activities launched in the step window: {_fmt(parts['total_ms'])} ms ({how}; "
                   f"{parts['outside_window']} activities launched outside the window left out)."
                   + (f" Plot: `{t['parts_plot']}`." if t.get("parts_plot") else "") + "\n")
        out.append("Summed over layers:\n")
        out.append(_parts_table(parts["summed"]))
        for layer in parts["layers"]:
            out.append(f"\nLayer {layer['layer']}:\n")
            out.append(_parts_table(layer["rows"]))
        if parts["outside_layers"] and parts["layers"]:
            out.append("\nOutside the decoder layers:\n")
            out.append(_parts_table(parts["outside_layers"]))
    eff = k["efficiency"]
    if eff["rows"] or eff["memory_bound"]:
        peak = eff["peak"]
        out.append(f"\n### Kernel efficiency, rank {rank}\n")
        out.append(f"Device {_fmt(peak['device'])}: dense bf16 peak "
                   f"{_fmt(peak['bf16_flops'] / 1e12 if peak['bf16_flops'] else None, 1)} TFLOP/s, HBM "
                   f"{_fmt(peak['hbm_bytes_per_s'] / 1e12 if peak['hbm_bytes_per_s'] else None, 2)} TB/s. {eff['note']}.\n")
        out.append(_table(["kind", "part", "phase", "dtype", "ops", "TFLOP", "GPU ms", "TFLOP/s", "% of peak"],
                          [[r["kind"], r["part"], r["phase"], r["dtype"], r["calls"], r["tflop"], r["gpu_ms"],
                            r["tflops_per_s"], r["pct_of_peak"]] for r in eff["rows"]]))
        if eff["memory_bound"]:
            out.append(_table(["copy / fill", "calls", "GiB", "GPU ms", "GB/s", "% of HBM"],
                              [[r["name"], r["calls"], r["gib"], r["gpu_ms"], r["gb_per_s"], r["pct_of_hbm"]]
                               for r in eff["memory_bound"]]))
    coll = k["collectives"]
    if coll["rows"]:
        out.append(f"\n### Communication by process group, rank {rank}\n")
        out.append(_table(["group", "collective", "calls", "GiB", "GPU ms", "group size", "algbw GB/s", "busbw GB/s"],
                          [[r["group"], r["collective"], r["calls"], r["gib"], r["gpu_ms"], r["group_size"],
                            r["algbw_gb_per_s"], r["busbw_gb_per_s"]] for r in coll["rows"]]))
        out.append(_table(["group", "exposed ms"], [[g, v] for g, v in coll["exposed_by_group_ms"].items()]))
        out.append(f"{coll['note']}.\n")
    host = k["host"]
    if host["top_self"]:
        out.append(f"\n### Host, rank {rank}\n")
        out.append(f"Blocking CUDA calls in the step window: {_fmt(host['sync']['total_ms'])} ms host wait ("
                   + ", ".join(f"{c} {v['calls']}x {_fmt(v['ms'])} ms" for c, v in host["sync"]["by_call"].items())
                   + "). An op with sync wait spends that time waiting for the GPU, not working.\n")
        idle = host.get("gpu_idle")
        if idle:
            out.append(f"GPU idle in the step window {_fmt(idle['idle_ms'])} ms: host wait (next work launched after "
                       f"the GPU went idle) {_fmt(idle['host_wait_ms'])} ms, kernel wait (work queued, waiting on a "
                       f"dependency) {_fmt(idle['kernel_wait_ms'])} ms, after the last activity "
                       f"{_fmt(idle.get('after_last_activity_ms'))} ms.\n")
        out.append(_table(["op", "calls", "self ms", "inclusive ms", "sync wait ms"],
                          [[r["name"], r["calls"], r["self_ms"], r["inclusive_ms"], r["sync_wait_ms"]]
                           for r in host["top_self"]]))
    return out


def _memory_details(m: dict) -> list[str]:
    """Markdown of one snapshot's categories at the peak, theoretical estimate and transient spikes."""
    x, rank, out = m["summary"], m["rank"], []
    out.append(f"### {fnd.memory_heading(rank)}\n")
    out.append(_table(["category", "GiB", "blocks", "share % of allocated"],
                      [[r["label"], r["gib"], r["blocks"], r["share_pct"]] for r in x["categories_at_peak"]]))
    est = m.get("estimate")
    if est:
        cmp_rows = fnd.explain_estimate(x, est) or []
        out.append(f"\nTheoretical estimate ({est['params_dense'] + est['params_expert']:,} parameters on this rank: "
                   f"{est['params_dense']:,} dense, {est['params_expert']:,} expert; "
                   + "; ".join(est["assumptions"]) + "):\n")
        out.append(_table(["category", "estimated GiB", "formula"],
                          [[r["category"], r["gib"], r["formula"]] for r in est["rows"]]))
        out.append(_table(["category", "measured GiB", "estimated GiB", "measured - estimated GiB"],
                          [[r["category"], round(r["measured_bytes"] / 2**30, 4), round(r["estimated_bytes"] / 2**30, 4),
                            round(r["difference_bytes"] / 2**30, 4)] for r in cmp_rows]))
        out.append("Differences: the activation estimate is a lower bound (the working set of the layer in "
                   "backward is not counted); blocks allocated before the recorded window carry no stack and are "
                   "set against parameters, gradients and optimizer state together.\n")
    elif m.get("estimate_note"):
        out.append(f"\n{m['estimate_note']}\n")
    if x.get("transient_spikes"):
        out.append("\nTransient spikes (largest blocks allocated and freed inside the window):\n")
        out.append(_table(["GiB", "lifetime ms", "site"],
                          [[r["gib"], r["lifetime_ms"], _short(r["site"], 140)] for r in x["transient_spikes"]]))
    out.append("")
    return out


def render_markdown(s: dict) -> str:
    """Markdown rendering of a profile summary dict (the ``profile_summary.md`` file)."""
    out = [f"# Profile summary: {s['trial']}\n",
           f"- kind: **{s['profile_kind']}**, step **{s['profile_step']}**",
           f"- trial status: **{s['status']}**" + (f" — error: `{s['completion']['error']}`"
                                                 if s["completion"].get("error") else ""),
           f"- steps done: {_fmt(s['completion']['steps_done'])}, world size: {_fmt(s['completion']['world_size'])}, "
           f"backend: {_fmt(s['completion']['backend'])}, device: {_fmt(s['completion']['device'])}",
           "- counts: " + ", ".join(f"{k} {v}" for k, v in s["counts"].items()),
           f"- log dir: `{s['paths']['log_dir']}`", f"- run dir: `{s['paths']['run_dir']}`", ""]
    if s.get("findings"):
        out.append("## Findings\n")
        out += [f"{i + 1}. {f['text']} ([details]({f['section']}))" for i, f in enumerate(s["findings"])]
        out.append("")
    if s.get("what_if"):
        out.append("## What if\n")
        out += [f"- {w['text']}. Assumes: {w['assumption']}." for w in s["what_if"]]
        out.append("")
    if s["errors"]:
        out.append("## Errors\n")
        out.append(_table(["file", "error"], [[e["file"], e["error"]] for e in s["errors"]]))
    if s["warnings"]:
        out.append("## Warnings\n")
        out.append(_table(["file", "warning"], [[e["file"], e["warning"]] for e in s["warnings"]]))
    if s.get("skipped"):
        out.append("## Skipped files\n")
        out.append(_table(["file", "why"], [[e["file"], e["reason"]] for e in s["skipped"]]))
    fail = s.get("failure")
    if fail:
        out.append("## Failure\n")
        first_line = (fail["traceback"].splitlines() or [""])[0]
        out.append(f"- first failing rank: **{fail['rank']}** ({fail['how']}, host {_fmt(fail['host'])}): "
                   f"`{first_line}`")
        if fail["others"]:
            out.append("- then: " + ", ".join(f"rank {o['rank']} {o['how']}" for o in fail["others"]))
        tail = fail["log_tail"] + (fail["traceback"].splitlines()[1:] if "\n" in fail["traceback"] else [])
        if tail:
            out.append(f"\nRank {fail['rank']}'s log (tail):\n\n```\n" + "\n".join(tail) + "\n```")
        out.append("")
    if s.get("trainer_log_tail"):
        out.append(f"## Log tail: {s['log_tail_source']}\n\n```\n" + "\n".join(s["trainer_log_tail"]) + "\n```\n")
    st = s["stats"]
    if st["steps"]:
        out.append("## Steps (stats.jsonl)\n")
        out.append("Recompute TFLOP/s/GPU: FLOPs re-run by activation recompute per second of step time (work the "
                   "GPU does on top of the model FLOPs; not in MFU).\n")
        out.append(_table(["step", "step time s", "tokens/s", "peak alloc GiB (rank)", "peak reserved GiB (rank)",
                           "over ranks", "MFU", "recompute TFLOP/s/GPU", "profiled"],
                          [[x["step"], x["step_time_s"], x["tokens_per_s"],
                            _with_rank(x["mem_peak_allocated_gb"], x["mem_peak_allocated_rank"]),
                            _with_rank(x["mem_peak_reserved_gb"], x["mem_peak_reserved_rank"]),
                            "max of all" if x["n_ranks"] > 1 else "rank 0 only", x["mfu"],
                            x.get("recompute_tflops_per_gpu"), x["profiled"]]
                           for x in st["steps"]]))
    smi = s["nvidia_smi"]
    if smi["available"]:
        out.append(f"## nvidia-smi ({smi['samples']} samples)\n")
        out.append(_table(["GPU", "peak used MiB", "total MiB", "peak util %", "mean util % (whole trial)"],
                          [[g["index"], g["peak_memory_used_mib"], g["memory_total_mib"], g["peak_utilization_pct"],
                            g["mean_utilization_pct"]] for g in smi["gpus"]]))
        ps = smi.get("profiled_step")
        if ps:
            out.append("\nInside the profiled step's window (from the trace; nvidia-smi timestamps read as local time). "
                       "utilization.gpu is the share of time any kernel ran, like GPU busy %, not SM or tensor-core "
                       "use; the whole-trial mean includes start-up, checkpoint loading and idle time:\n")
            out.append(_table(["GPU", "samples", "mean util %", "peak util %", "peak used MiB"],
                              [[g["index"], g["samples"], g["mean_utilization_pct"], g["peak_utilization_pct"],
                                g["peak_memory_used_mib"]] for g in ps["gpus"]]
                              or [["–", 0, None, None, None]]))
    rows = s["ranks"]["rows"]
    if rows:
        out.append("## Ranks\n")
        cols = [c for c in _RANK_COLUMNS + ("gpu_busy_pct",) if any(c in r for r in rows)]
        out.append(_table(["rank", "coords"] + cols,
                          [[r["rank"], " ".join(f"{k}{v}" for k, v in (r["coords"] or {}).items())]
                           + [r.get(c) for c in cols] for r in rows]))
        imb = s["ranks"]["imbalance"]
        if len(rows) > 1 and imb:
            out.append("\nImbalance (max/min):\n")
            out.append(_table(["metric", "max (rank)", "min (rank)", "max/min"],
                              [[k, f"{_fmt(v['max'])} (r{v['max_rank']})", f"{_fmt(v['min'])} (r{v['min_rank']})",
                                v["max_over_min"]] for k, v in imb.items()]))
    for t in s.get("kernel_traces") or []:
        out.append(f"## Kernel trace rank {t['rank']} (`{t['source']}`)\n")
        if "error" in t:
            out.append(f"**error:** {t['error']}\n")
            continue
        k = t["summary"]
        if k["invalid_events"]["total"]:
            out.append(f"- {invalid_events_message(k['invalid_events'])}")
        g, c = k["gpu"], k["communication"]
        out.append(f"- step wall time: {_fmt(k['step_window']['wall_ms'])} ms (window: {k['step_window']['source']})")
        if g["activities"]:
            out.append(f"- GPU busy {_fmt(g['busy_share_pct'])} % / idle {_fmt(g['idle_share_pct'])} %; "
                       f"GPU activity total {_fmt(g['total_ms'])} ms in {g['activities']} kernels/memcpy/memset")
            out.append(f"- communication {_fmt(c['total_ms'])} ms: hidden under compute {_fmt(c['hidden_ms'])} ms, "
                       f"exposed {_fmt(c['exposed_ms'])} ms")
        else:
            out.append("- no GPU activity in this trace (CPU-only run)")
        if c["host_ops"]["ops"]:
            out.append(f"- host-side collective ops (gloo:/nccl:): {c['host_ops']['ops']} ops, "
                       f"{_fmt(c['host_ops']['wall_ms'])} ms wall: " +
                       ", ".join(f"{k} {_fmt(v)} ms" for k, v in c["host_ops"]["by_op_ms"].items()))
        out.append("- views: " + ", ".join(f"`{p}`" for v in VIEWS for p in t["views"][v]) + "\n")
        if g["activities"]:
            out.append("### Top kernels\n")
            out.append(_table(["#", "kernel", "calls", "total ms", "share %"],
                              [[i + 1, short_kernel_name(x["name"]), x["calls"], x["total_ms"], x["share_pct"]]
                               for i, x in enumerate(k["top_kernels"])]))
            out.append("\n### Time by category\n")
            out.append(_table(["category", "calls", "total ms", "share %"],
                              [[x["category"], x["calls"], x["total_ms"], x["share_pct"]] for x in k["categories"]]))
        if k.get("top_cpu_ops"):
            out.append("\n### Top CPU ops (inclusive: nested ops count in their parents too)\n")
            out.append(_table(["op", "calls", "inclusive ms"],
                              [[x["name"], x["calls"], x["inclusive_ms"]] for x in k["top_cpu_ops"]]))
        if c["kernels"]:
            out.append("\n### Collectives\n")
            out.append(_table(["by type", "ms"], [[a, b] for a, b in c["by_type_ms"].items()]))
            out.append(_table(["by process group", "ms"], [[a, b] for a, b in c["by_group_ms"].items()]))
        out += _kernel_details(t)
        if k["regions"]:
            out.append("\n### Annotated regions\n")
            out.append(_table(["region", "start ms", "CPU ms", "GPU ms"],
                              [[r["name"], r["start_ms"], r["cpu_ms"], r["gpu_ms"]] for r in k["regions"]]))
        out.append("")
    for m in s.get("memory_snapshots") or []:
        out.append(f"## Memory snapshot rank {m['rank']} (`{m['file']}`)\n")
        if "error" in m:
            out.append(f"**error:** {m['error']}\n")
            continue
        x = m["summary"]
        out.append(f"- peak allocated **{_fmt(x['peak_allocated_gib'])} GiB** at {_fmt(x['peak_time_ms'])} ms "
                   f"of a {_fmt(x['window_ms'])} ms window, phase: {_fmt(x['peak_phase'])}")
        out.append(f"- peak reserved {_fmt(x['peak_reserved_gib'])} GiB; reserved − allocated at the peak "
                   f"{_fmt(x['reserved_minus_allocated_at_peak_gib'])} GiB")
        if x["history"]["truncated"]:
            out.append(f"- **truncated window:** {x['history']['message']}")
        out.append(f"- plot: `{m['plot']}`\n")
        out += _memory_details(m)
        out.append("### Alive at the peak, by allocation site\n")
        out.append(_table(["site", "GiB", "blocks", "share %"],
                          [[_short(y["site"], 140), y["gib"], y["blocks"], y["share_pct"]] for y in x["top_sites"]]))
        out.append("")
    return "\n".join(out) + "\n"
