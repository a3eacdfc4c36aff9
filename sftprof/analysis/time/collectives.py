"""Collectives of a step per process group: calls, bytes, GPU time, bus bandwidth and exposed time.

Bus bandwidth of a collective follows NCCL's performance notes (nccl-tests ``PERFORMANCE.md``):
``algbw = S / t`` with ``S`` the larger of the input and output message sizes, ``busbw = algbw * f``
with ``f = 2 (n - 1) / n`` for all-reduce, ``(n - 1) / n`` for all-gather, reduce-scatter and
all-to-all, 1 otherwise, ``n`` the process-group size.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, TypedDict

import numpy as np

from sftprof.analysis.time import comm_wait
from sftprof.analysis.time.gpu_activity import Labels
from sftprof.analysis.trace import intervals
from sftprof.analysis.trace.op_collector import OpCollector
from sftprof.analysis.schema import ms
from sftprof.analysis.time.schema import CollectiveRow, Collectives

__all__ = ["collectives", "bus_factor", "exposed_groups", "OUTSIDE_WINDOW"]


class _Acc(TypedDict):
    """One (process group, collective)'s sums over the step window's NCCL kernels."""
    group: str
    collective: str
    calls: int
    bytes: int
    bytes_known: bool
    us: float
    group_size: Optional[int]


def bus_factor(collective: str, n: int) -> float:
    """NCCL bus-bandwidth factor of a collective over ``n`` ranks (module docstring)."""
    c = collective.lower()
    if n <= 1:
        return 0.0
    if "all_reduce" in c or "allreduce" in c:
        return 2.0 * (n - 1) / n
    if any(x in c for x in ("all_gather", "allgather", "reduce_scatter", "reducescatter", "all_to_all", "alltoall")):
        return (n - 1) / n
    return 1.0


def collectives(ops: OpCollector, *, ts: np.ndarray, dur: np.ndarray, devs: np.ndarray, inside: np.ndarray,
                is_comm: np.ndarray, groups: Labels[str], ext: np.ndarray, pg_names: Labels[str],
                pg_members: dict[str, list[int]]) -> Collectives:
    """Per (process group, collective): calls, bytes, GPU time, bus bandwidth; exposed time per group and of the
    NCCL kernels outside the step window; the calls' timeline per process group
    (:func:`sftprof.analysis.time.comm_wait.call_records`).

    Exposed time is counted as ``communication.exposed_ms`` counts it (:func:`sftprof.analysis.time.trace_summary.
    communication`): NCCL kernel time not overlapped by any non-communication GPU activity of the trace on the same
    device. So ``exposed_outside_window_ms`` (that total minus the exposed time of the union of the NCCL kernels in
    the window) and the groups' rows together cover every NCCL kernel of the trace.
    """
    end = ts + dur
    rows: dict[tuple[str, str], _Acc] = {}
    seen_ops: set[int] = set()
    launched = np.flatnonzero(inside & is_comm)  # the NCCL kernels launched in the window
    for i, x in zip(launched.tolist(), ext[launched].tolist()):
        info = ops.comm_ops.get(x) or {}
        key = (groups[i] or "unknown", info.get("collective") or "?")
        r = rows.setdefault(key, {"group": key[0], "collective": key[1], "calls": 0, "bytes": 0, "bytes_known": True,
                                  "us": 0.0, "group_size": info.get("group_size")})
        r["us"] += dur[i]
        if x not in seen_ops:  # one call per launching op (a coalesced call may launch several kernels)
            seen_ops.add(x)
            r["calls"] += 1
            if info.get("bytes") is None:
                r["bytes_known"] = False
            else:
                r["bytes"] += info["bytes"]
    out_rows: list[CollectiveRow] = []
    for r in sorted(rows.values(), key=lambda r: (-r["us"], r["group"], r["collective"])):
        t = r["us"] * 1e-6
        alg = r["bytes"] / t / 1e9 if r["bytes_known"] and t > 0 and r["bytes"] else None
        n = r["group_size"]
        out_rows.append({"group": r["group"], "collective": r["collective"], "calls": r["calls"],
                         "gib": round(r["bytes"] / 2**30, 4) if r["bytes_known"] else None, "gpu_ms": ms(r["us"]),
                         "group_size": n, "algbw_gb_per_s": round(alg, 2) if alg else None,
                         "busbw_gb_per_s": round(alg * bus_factor(r["collective"], n), 2) if alg and n else None})
    exposed: dict[str, float] = defaultdict(float)
    outside = 0.0  # exposed time of all NCCL kernels minus that of the window's (union per device)
    comp_by_dev = {}
    names = list(dict.fromkeys([g or "unknown" for g in groups.names] + ["unknown"]))  # a group's row: its label
    row = np.array([names.index(g or "unknown") for g in groups.names] + [names.index("unknown")], dtype=np.int32)
    labels = row[groups.codes]  # groups.codes -1 (None): the last, "unknown"
    for dev in np.unique(devs):
        on = devs == dev
        comp = comp_by_dev[int(dev)] = intervals.union(ts[on & ~is_comm], end[on & ~is_comm])
        for g in sorted(np.unique(labels[on & is_comm & inside]).tolist(), key=names.__getitem__):
            sel = on & is_comm & inside & (labels == g)
            c = intervals.union(ts[sel], end[sel])
            exposed[names[g]] += intervals.length(*c) - intervals.intersection_length(c, comp)
        c_all = intervals.union(ts[on & is_comm], end[on & is_comm])
        c_in = intervals.union(ts[on & is_comm & inside], end[on & is_comm & inside])
        outside += (intervals.length(*c_all) - intervals.intersection_length(c_all, comp)
                    - intervals.length(*c_in) + intervals.intersection_length(c_in, comp))
    coll = {i: (ops.comm_ops.get(x) or {}).get("collective") or "?"
            for i, x in zip(launched.tolist(), ext[launched].tolist())}
    calls = comm_wait.call_records(ts=ts, end=end, devs=devs, sel=launched, ext=ext,
                                   pg_names=pg_names, labels=groups, collectives=coll, members=pg_members,
                                   comp_by_dev=comp_by_dev)
    return {"rows": out_rows, "exposed_by_group_ms": {g: ms(v) for g, v in sorted(exposed.items())},
            "exposed_outside_window_ms": ms(max(outside, 0.0)), "calls": calls,
            "note": "exposed = the group's NCCL kernel time not overlapped by non-communication GPU work on "
                    "the same device; groups that overlap each other each count their own exposed time; a row "
                    f"'{OUTSIDE_WINDOW}' (when there is any) holds the exposed time of the NCCL kernels outside the "
                    "step window, so the rows cover every kernel of the rank's exposed communication"}


OUTSIDE_WINDOW = "outside the step window"  # the row of exposed_groups for NCCL kernels not in the step window


def exposed_groups(collectives: Collectives) -> dict[str, float]:
    """One rank's exposed NCCL kernel time (ms) per process-group label (``unknown``: kernels without a group),
    plus a row :data:`OUTSIDE_WINDOW` for the NCCL kernels outside the step window when they have exposed time
    (``collectives["exposed_outside_window_ms"]``; summaries written before it have no such row).

    Together the rows cover every NCCL kernel that ``communication.exposed_ms`` counts; groups that overlap each
    other each count their own exposed time, so the rows need not add up to it.

    Args:
        collectives: the ``collectives`` member of a kernel summary (:func:`collectives`).
    """
    out = dict(collectives.get("exposed_by_group_ms") or {})
    rest = collectives.get("exposed_outside_window_ms") or 0.0
    if rest > 0:
        out[OUTSIDE_WINDOW] = rest
    return out
