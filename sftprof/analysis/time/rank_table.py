"""The ranks table of a trial: per profiled rank its step time, peak memory and communication, the imbalance of
each column, which process groups explain the gap in exposed communication between ranks (:func:`exposed_by_group`)
and where the ranks' own GPU work differs (:func:`work_spread`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal, Optional, get_args

from sftprof.analysis.time.collectives import OUTSIDE_WINDOW, exposed_groups
from sftprof.analysis.time.model_parts import part_label
from sftprof.analysis.schema import processed_traces
from sftprof.analysis.time.schema import ExposedByGroup, Imbalance, RankRow, RankTable, WorkSpread, WorkSpreadRow
from sftprof.analysis.trial.schema import TrialRecord

__all__ = ["rank_table", "work_spread", "exposed_by_group", "RANK_COLUMNS"]

# Columns of the rank table (:func:`rank_table`), in display order; the summary reports the max/min imbalance of each.
RankColumn = Literal["step_ms", "stats_peak_allocated_gb", "snapshot_peak_allocated_gib", "snapshot_peak_reserved_gib",
                     "comm_ms", "exposed_comm_ms", "host_comm_ms"]
RANK_COLUMNS: tuple[RankColumn, ...] = get_args(RankColumn)


# --------------------------------------------------------------------------------------------
# Ranks table
# --------------------------------------------------------------------------------------------
def rank_table(summary: TrialRecord) -> RankTable:
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
    rows: dict[int, RankRow] = {}
    for t in summary.get("kernel_traces") or []:
        s = t.get("summary")
        if s is None or "error" in t:
            continue
        sr = stats_ranks.get(t["rank"], {})
        rows[t["rank"]] = {
            "rank": t["rank"],
            "coords": None,  # below
            "step_ms": s["step_window"]["wall_ms"],
            "stats_peak_allocated_gb": _num(sr.get("mem_peak_allocated_gb")),
            "comm_ms": s["communication"]["total_ms"],
            "host_comm_ms": s["communication"]["host_ops"]["wall_ms"],
            "exposed_comm_ms": s["communication"]["exposed_ms"],
            "gpu_busy_pct": s["gpu"]["busy_share_pct"],
        }
    for snap in summary.get("memory_snapshots") or []:
        m = snap.get("summary")
        if m is None or snap["rank"] is None:
            continue
        sr = stats_ranks.get(snap["rank"], {})
        step_s = sr.get("step_time_s")
        rows[snap["rank"]] = {
            "rank": snap["rank"],
            "coords": None,  # below
            "step_ms": round(step_s * 1e3, 3) if isinstance(step_s, (int, float)) else None,
            "stats_peak_allocated_gb": _num(sr.get("mem_peak_allocated_gb")),
            "snapshot_peak_allocated_gib": m["peak_allocated_gib"],
            "snapshot_peak_reserved_gib": m["peak_reserved_gib"],
        }
        if snap["coords_from_name"]:
            coords.setdefault(snap["rank"], snap["coords_from_name"])
    for r, row in rows.items():
        row["coords"] = coords.get(r)
    ordered = [rows[r] for r in sorted(rows)]
    traced = processed_traces(summary)
    exposed = {t["rank"]: exposed_groups(c) if (c := t["summary"].get("collectives")) else {} for t in traced}
    exposed_total = {t["rank"]: t["summary"]["communication"]["exposed_ms"] for t in traced}
    imbalance: dict[str, Imbalance] = {}
    for col in RANK_COLUMNS:
        vals = [(v, row["rank"]) for row in ordered if isinstance(v := row.get(col), (int, float))]
        if not vals:
            continue
        hi, lo = max(vals), min(vals)
        imbalance[col] = {"max": hi[0], "max_rank": hi[1], "min": lo[0], "min_rank": lo[1],
                          "max_over_min": round(hi[0] / lo[0], 4) if len(vals) > 1 and lo[0] > 0 else None}
    return {"rows": ordered, "imbalance": imbalance, "exposed_by_group": exposed_by_group(exposed, exposed_total),
            "work_spread": work_spread({t["rank"]: t["summary"]["parts"].get("compute_cells") for t in traced})}


WORK_SPREAD_ROWS = 8  # cells a work-spread table shows at most
WORK_SPREAD_MIN_MS = 0.5  # ... each differing by at least this much between ranks


def work_spread(cells: dict[int, Optional[list[list[Any]]]]) -> Optional[WorkSpread]:
    """Where the profiled ranks' own GPU work differs: per (model part, layer, phase) the compute kernel time
    (NCCL kernels left out, whose time includes waiting for the other ranks) on the slowest and fastest rank.

    A rank whose work between two collectives takes longer arrives late at the second, and the others wait there
    (:mod:`sftprof.analysis.time.comm_wait`); this says which work made it late. Only ranks that ran a cell are compared
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
    by_cell: dict[tuple[str, Optional[int], str], dict[int, float]] = defaultdict(dict)
    for r, rows in have.items():
        for part, layer, phase, ms in rows:
            by_cell[(part, layer, phase)][r] = ms
    shared = {k: v for k, v in by_cell.items() if len(v) > 1}
    out: list[WorkSpreadRow] = []
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


def exposed_by_group(exposed: dict[int, dict[str, float]], totals: dict[int, float]) -> Optional[ExposedByGroup]:
    """Which process groups explain the difference in exposed communication between ranks.

    Args:
        exposed: rank -> {process group -> exposed NCCL kernel ms} (each rank's
            :func:`sftprof.analysis.time.collectives.exposed_groups`: every group of its step window, and a row
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


def _num(v: object) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
