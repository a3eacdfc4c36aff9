"""Communication time split into waiting for the last rank to arrive and transfer, from every rank's trace.

A collective's NCCL kernel starts when its own rank reaches it and cannot move data until every member rank
of the process group has launched it too; it ends on all members at nearly the same time. So on a rank that
arrives early the kernel's time is mostly waiting for the others (load imbalance before the collective),
not transfer. With the traces of all member ranks on one clock this is measured call by call:

1. Per trace (:func:`call_records`, inside the one-trace kernel summary): for each process group (keyed by
   its name, the same on every member rank), the group's calls launched in the step window, in the order
   their first kernels start (NCCL runs one group's calls in issue order), one call per launching op (a
   coalesced call may launch several kernels), each with its kernel intervals and its exposed pieces (the
   kernel time not overlapped by non-communication GPU work on the same device, as
   :func:`sftprof.analysis.time.collectives.collectives` counts exposed time).
2. Across ranks (:func:`split`): call ``k`` of a group on one member rank is call ``k`` on every other, once
   the group has the same number of calls and the same collective at every ordinal on each member (else it is
   not split, and the summary says why). With ``s_r`` the call's first kernel start on rank ``r`` and
   ``L = max_r s_r`` the last rank's arrival: rank ``r`` waits for the part of its kernel time inside
   ``[s_r, L]`` (``clip(L - s_r, 0, dur_r)`` for one kernel) and transfers for the rest; its exposed wait is
   the part of its exposed pieces inside ``[s_r, L]``. The wait is owed to the rank that arrived last.

Groups with a member rank whose trace is not in the run (``perf_tracer.ranks`` profiles only some
ranks, or its trace failed) are not split. Nor are groups whose ranks' clocks disagree: kernel times are
on each rank's host clock, and a collective ends on every member at nearly the same moment, so the median
over all matched calls of two ranks of the difference of their calls' end times is the offset between
their clocks. On one host it is a few microseconds (2x H200: median -3 us over 90 calls, single calls up to
105 us apart); the waits split here are 0.1-10 ms. A median beyond :data:`CLOCK_TOLERANCE_US` (ranks on
different hosts with unsynchronised clocks) would shift every wait by about that much, so those groups are
refused with the measured offset rather than split wrong. torch's trace header names no host, so the clocks
themselves are checked.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Optional

import numpy as np

from sftprof.analysis.trace import intervals
from sftprof.analysis.schema import ms
from sftprof.analysis.time.schema import (CallRecords, ClockOffset, CommWait, GroupCalls, NotSplit, WaitGroup,
                                          WaitRank, WaitRankRow)

__all__ = ["call_records", "split", "CLOCK_TOLERANCE_US"]

CLOCK_TOLERANCE_US = 50.0  # largest |median end-time difference| of two ranks' matched calls (module docstring)

Call = tuple[str, list[list[float]], list[list[float]]]  # collective, kernel intervals, exposed pieces (us)
Pieces = list[list[float]]  # [start_us, end_us] pieces


def call_records(*, ts: np.ndarray, end: np.ndarray, devs: np.ndarray, sel: np.ndarray, ext: np.ndarray,
                 pg_names: Sequence[Optional[str]], labels: Sequence[Optional[str]], collectives: dict[int, str],
                 members: dict[str, list[int]], comp_by_dev: dict[int, intervals.Intervals]) -> CallRecords:
    """One rank's collectives per process group, in the order they ran, for :func:`split`.

    Args:
        ts, end: float64 start and end (us, trace clock) per GPU activity.
        devs: int64 device per activity.
        sel: int64 indexes of the NCCL kernels launched in the step window.
        ext: int64 ``External id`` per activity (-1 when absent: the kernel is a call of its own).
        pg_names: process-group name per activity (None: unknown; those kernels are left out).
        labels: parallelism label per activity (``EP``, ``CP``, ...).
        collectives: collective name of each activity of ``sel`` (``all_to_allv``, ...), by its index.
        members: process-group name -> global ranks (:meth:`KernelTraceAnalyzer.pg_members`).
        comp_by_dev: device -> disjoint sorted intervals of its non-communication GPU activity in the window.

    Returns:
        ``{"groups": {pg name: {"label", "members" (list of ranks or None), "calls": [(collective, kernels,
        exposed), ...]}}, "unnamed_kernels": n}``, ``kernels`` and ``exposed`` lists of ``[start_us, end_us]``
        (disjoint, sorted), calls ordered by their first kernel start; ``n`` counts the NCCL kernels without a
        process-group name (left out).
    """
    ops: dict[tuple[str, int], list[int]] = defaultdict(list)
    unnamed = 0
    for k, (i, x) in enumerate(zip(sel.tolist(), ext[sel].tolist())):
        name = pg_names[i]
        if name is None:
            unnamed += 1
            continue
        ops[(name, x if x != -1 else -2 - k)].append(i)  # no External id: a call of its own
    out: dict[str, GroupCalls] = {}
    for (name, _), idx in ops.items():
        g = out.setdefault(name, {"label": labels[idx[0]], "members": members.get(name), "calls": []})
        k_iv = intervals.union(ts[idx], end[idx])
        comp = comp_by_dev.get(int(devs[idx[0]]))
        e_iv = intervals.difference(k_iv, comp) if comp is not None else k_iv
        g["calls"].append((collectives[idx[0]], np.column_stack(k_iv).tolist(), np.column_stack(e_iv).tolist()))
    for g in out.values():
        g["calls"].sort(key=lambda c: c[1][0][0])
    return {"groups": out, "unnamed_kernels": unnamed}


def _within(pieces: Pieces, lo: float, hi: float) -> float:
    """Length (us) of the disjoint ``[start, end]`` pieces inside ``[lo, hi]``."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in pieces)


def _length(pieces: Pieces) -> float:
    return sum(e - s for s, e in pieces)


def _pair_or_reason(recs: dict[int, GroupCalls], traced: set[int]) -> list[int] | str:
    """The sorted member ranks of a group when its calls can be paired across them, else why not."""
    recorded = next((g["members"] for g in recs.values() if g.get("members")), None)
    if not recorded:
        return ("its member ranks are not recorded in the traces (no Process Group Ranks, no pg_config "
                      "entry; torch shortens long lists)")
    members = sorted(recorded)
    missing = [r for r in members if r not in traced]
    if missing:
        return (f"no trace of rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} in this "
                      "run (perf_tracer.ranks profiles only some ranks, or the trace failed)")
    counts = {r: len(recs[r]["calls"]) if r in recs else 0 for r in members}
    if len(set(counts.values())) > 1:
        return ("the member ranks ran different numbers of its calls in the step window ("
                      + ", ".join(f"rank {r}: {n}" for r, n in counts.items()) + "), so they cannot be paired")
    ref = members[0]
    for r in members[1:]:
        for k, (a, b) in enumerate(zip(recs[ref]["calls"], recs[r]["calls"])):
            if a[0] != b[0]:
                return (f"call {k} is {a[0]} on rank {ref} but {b[0]} on rank {r}, so the calls cannot be "
                              "paired")
    return members


def split(records: dict[int, CallRecords], tolerance_us: float = CLOCK_TOLERANCE_US) -> Optional[CommWait]:
    """Each rank's NCCL time (and exposed part) per process group, split into waiting and transfer (module
    docstring), from the :func:`call_records` of every rank whose trace is in the run.

    Args:
        records: rank -> its :func:`call_records`.
        tolerance_us: largest accepted |median end-time difference| between two ranks' matched calls (us).

    Returns:
        None when no trace has a collective; else ``{"clock_tolerance_us", "clock_offsets": [{"ranks": [a, b],
        "median_end_difference_us", "end_difference_mad_us" (median absolute deviation of the calls' differences),
        "calls"}], "groups": [...], "not_split": [{"group", "label", "reason"}],
        "unnamed_kernels": [{"rank", "kernels"}] (NCCL kernels without a process group, left out), "ranks": [...]}``.
        A group row: ``{"group" (process-group name), "label",
        "members", "calls", "ranks": [{"rank", "calls", "comm_ms", "wait_ms", "transfer_ms", "exposed_ms",
        "exposed_wait_ms", "exposed_transfer_ms", "last_arrivals", "waited_for": [{"rank", "wait_ms",
        "exposed_wait_ms"}]}], "straggler": {"rank", "last_arrivals", "others_wait_ms", "others_exposed_wait_ms"}}``
        (``straggler``: the rank the others waited for longest, ties to the one that arrived last most often; a rank
        that arrives last in more calls but by less is not it),
        most exposed first.
        A rank row (every rank that is a member of a split group, over its split groups): ``{"rank", "exposed_ms", "exposed_wait_ms",
        "exposed_transfer_ms", "waited_for": [{"rank", "exposed_wait_ms"}]}``, with ``exposed_ms`` the union of
        the split groups' exposed pieces (groups that overlap each other count once), ``exposed_wait_ms`` the
        union of their parts spent waiting, and ``waited_for`` that union per rank waited for. Times in ms.
    """
    calls_by_rank = {r: v["groups"] for r, v in records.items()}
    if not any(calls_by_rank.values()):
        return None
    traced = set(calls_by_rank)
    names = sorted({n for recs in calls_by_rank.values() for n in recs}, key=lambda n: (len(n), n))
    paired: dict[str, list[int]] = {}
    not_split: list[NotSplit] = []
    for name in names:
        recs = {r: v[name] for r, v in calls_by_rank.items() if name in v}
        label = next(g["label"] for g in recs.values())
        members_or_reason = _pair_or_reason(recs, traced)
        if isinstance(members_or_reason, str):
            not_split.append({"group": name, "label": label, "reason": members_or_reason})
        else:
            paired[name] = members_or_reason
    # clock offsets per rank pair, pooled over every paired group holding both
    diffs: dict[tuple[int, int], list[float]] = defaultdict(list)
    for name, members in paired.items():
        ref = members[0]
        for r in members[1:]:
            for a, b in zip(calls_by_rank[ref][name]["calls"], calls_by_rank[r][name]["calls"]):
                diffs[(ref, r)].append(b[1][-1][1] - a[1][-1][1])
    offsets: list[ClockOffset] = [{"ranks": list(p), "median_end_difference_us": round(float(np.median(d)), 3),
                "end_difference_mad_us": round(float(np.median(np.abs(np.asarray(d) - np.median(d)))), 3),
                "calls": len(d)} for p, d in sorted(diffs.items())]
    bad = {(o["ranks"][0], o["ranks"][1]): o for o in offsets if abs(o["median_end_difference_us"]) > tolerance_us}
    groups: list[WaitGroup] = []
    rank_wait: dict[int, Pieces] = defaultdict(list)
    rank_exposed: dict[int, Pieces] = defaultdict(list)
    rank_for: dict[int, dict[int, Pieces]] = defaultdict(lambda: defaultdict(list))
    for name, members in paired.items():
        label = calls_by_rank[members[0]][name]["label"]
        off = next((bad[(members[0], r)] for r in members[1:] if (members[0], r) in bad), None)
        if off:
            ra, rb = off["ranks"]
            not_split.append({"group": name, "label": label, "reason": (
                f"the clocks of ranks {ra} and {rb} disagree: their matched calls end "
                f"{off['median_end_difference_us']:+.1f} µs apart (median over {off['calls']} calls; tolerance "
                f"{tolerance_us:g} µs), as on different hosts; a wait measured across them would be off by as much")})
            continue
        groups.append(_group_split(name, label, members, {r: calls_by_rank[r][name]["calls"] for r in members},
                                   rank_wait, rank_exposed, rank_for))
    ranks: list[WaitRank] = []
    for r in sorted({r for g in groups for r in g["members"]}):  # a rank in no split group has no row
        exp = intervals.union(*_arrays(rank_exposed[r]))
        wait = intervals.union(*_arrays(rank_wait[r]))
        e_ms, w_ms = ms(intervals.length(*exp)), ms(intervals.length(*wait))
        late = {s: intervals.length(*intervals.union(*_arrays(p))) for s, p in rank_for[r].items()}
        ranks.append({"rank": r, "exposed_ms": e_ms, "exposed_wait_ms": w_ms,
                      "exposed_transfer_ms": round(e_ms - w_ms, 4),
                      "waited_for": [{"rank": s, "exposed_wait_ms": ms(us)}
                                     for s, us in sorted(late.items(), key=lambda kv: (-kv[1], kv[0]))]})
    groups.sort(key=lambda g: (-max(r["exposed_ms"] for r in g["ranks"]), len(g["group"]), g["group"]))
    return {"clock_tolerance_us": tolerance_us, "clock_offsets": offsets, "groups": groups,
            "not_split": sorted(not_split, key=lambda g: (len(g["group"]), g["group"])),
            "unnamed_kernels": [{"rank": r, "kernels": v["unnamed_kernels"]} for r, v in sorted(records.items())
                                if v["unnamed_kernels"]],
            "ranks": ranks}


def _arrays(pieces: Pieces) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(pieces, dtype=np.float64).reshape(-1, 2)
    return a[:, 0].copy(), a[:, 1].copy()


def _group_split(name: str, label: Optional[str], members: list[int], calls: dict[int, list[Call]],
                 rank_wait: dict[int, Pieces], rank_exposed: dict[int, Pieces],
                 rank_for: dict[int, dict[int, Pieces]]) -> WaitGroup:
    """One paired group's split (a group row of :func:`split`); adds each rank's exposed pieces, exposed-wait
    pieces and exposed-wait pieces per late rank to ``rank_exposed``, ``rank_wait`` and ``rank_for``."""
    acc: dict[int, dict[str, float]] = {r: defaultdict(float) for r in members}
    # rank -> late rank -> [wait, exposed wait] us
    owed: dict[int, dict[int, list[float]]] = {r: defaultdict(lambda: [0.0, 0.0]) for r in members}
    for k in range(len(calls[members[0]])):
        starts = {r: calls[r][k][1][0][0] for r in members}
        last = max(members, key=lambda r: (starts[r], -r))
        lo_last = starts[last]
        acc[last]["last"] += 1
        for r in members:
            _, kern, exp = calls[r][k]
            w = _within(kern, starts[r], lo_last)
            ew = _within(exp, starts[r], lo_last)
            a = acc[r]
            a["comm"] += _length(kern)
            a["wait"] += w
            a["exposed"] += _length(exp)
            a["exposed_wait"] += ew
            rank_exposed[r].extend(exp)
            if r != last:
                owed[r][last][0] += w
                owed[r][last][1] += ew
                pieces = [[max(s, starts[r]), min(e, lo_last)] for s, e in exp if min(e, lo_last) > max(s, starts[r])]
                rank_wait[r].extend(pieces)
                rank_for[r][last].extend(pieces)
    rows: list[WaitRankRow] = []
    for r in members:
        a = acc[r]
        rows.append({"rank": r, "calls": len(calls[r]), "comm_ms": ms(a["comm"]), "wait_ms": ms(a["wait"]),
                     "transfer_ms": ms(a["comm"] - a["wait"]), "exposed_ms": ms(a["exposed"]),
                     "exposed_wait_ms": ms(a["exposed_wait"]),
                     "exposed_transfer_ms": ms(a["exposed"] - a["exposed_wait"]), "last_arrivals": int(a["last"]),
                     "waited_for": [{"rank": s, "wait_ms": ms(v[0]), "exposed_wait_ms": ms(v[1])}
                                    for s, v in sorted(owed[r].items(), key=lambda kv: (-kv[1][0], kv[0]))]})
    caused = {s: [sum(owed[r][s][i] for r in members if s in owed[r]) for i in (0, 1)] for s in members}
    strag = max(members, key=lambda s: (caused[s][0], acc[s]["last"], -s))
    return {"group": name, "label": label, "members": members, "calls": len(calls[members[0]]), "ranks": rows,
            "straggler": {"rank": strag, "last_arrivals": int(acc[strag]["last"]),
                          "others_wait_ms": ms(caused[strag][0]), "others_exposed_wait_ms": ms(caused[strag][1])}}
