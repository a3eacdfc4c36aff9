"""Interval arithmetic over time intervals in trace microseconds: disjoint sets, and nested per-thread intervals.

One interval set is a pair ``(starts, ends)`` of 1-D float64 arrays of equal length with
``starts[i] <= ends[i]``; :func:`union` turns any set into its sorted, disjoint form, which
:func:`intersection_length` and :func:`clip` expect. Used by the GPU activities' questions
(:mod:`sftprof.analysis.gpu_activity`: GPU busy time, hidden/exposed communication), the collectives
(:mod:`sftprof.analysis.collectives`: exposed time per process group) and the cross-rank split of
communication into waiting and transfer (:mod:`sftprof.analysis.comm_wait`: a collective's exposed pieces).

:class:`ThreadIntervals` holds the intervals of a trace's threads that nest on each thread (CPU ops, model-part
ranges, autograd backward nodes) and finds the innermost one around given points
(:class:`sftprof.analysis.op_collector.OpCollector`).
"""
from __future__ import annotations

from array import array

import numpy as np

__all__ = ["union", "length", "intersection_length", "clip", "difference", "repeated_rows", "ThreadIntervals",
           "Intervals"]

Intervals = tuple[np.ndarray, np.ndarray]


def union(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """Merge intervals ``[starts[i], ends[i])`` into sorted disjoint intervals (touching ones merge too)."""
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.append(run_end[idx[1:] - 1], run_end[-1])


def length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of a disjoint interval set (0.0 when empty); same unit as the inputs."""
    return float(np.sum(ends - starts)) if starts.size else 0.0


def intersection_length(a: Intervals, b: Intervals) -> float:
    """Total length of the intersection of two disjoint, sorted interval sets (outputs of :func:`union`)."""
    (a_s, a_e), (b_s, b_e) = a, b
    if a_s.size == 0 or b_s.size == 0:
        return 0.0
    # Prefix lengths of b; the covered length of b in [x, y) is cov(y) - cov(x).
    prefix = np.concatenate(([0.0], np.cumsum(b_e - b_s)))

    def covered_upto(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(b_s, x, side="right")  # intervals starting at or before x
        full = prefix[np.maximum(i - 1, 0)]
        partial = np.where(i > 0, np.clip(x - b_s[np.maximum(i - 1, 0)], 0, None), 0.0)
        partial = np.minimum(partial, np.where(i > 0, b_e[np.maximum(i - 1, 0)] - b_s[np.maximum(i - 1, 0)], 0.0))
        return full + partial

    return float(np.sum(covered_upto(a_e) - covered_upto(a_s)))


def clip(iv: Intervals, lo: float, hi: float) -> Intervals:
    """The parts of a disjoint interval set inside ``[lo, hi]`` (empty pieces dropped)."""
    s, e = np.clip(iv[0], lo, hi), np.clip(iv[1], lo, hi)
    keep = e > s
    return s[keep], e[keep]


def difference(a: Intervals, b: Intervals) -> Intervals:
    """The parts of ``a`` not covered by ``b``; both disjoint and sorted (outputs of :func:`union`), and so is the
    result (empty pieces dropped)."""
    (a_s, a_e), (b_s, b_e) = a, b
    out_s: list[float] = []
    out_e: list[float] = []
    for s, e in zip(a_s.tolist(), a_e.tolist()):
        i = int(np.searchsorted(b_e, s, side="right"))  # first interval of b that ends after s
        cur = s
        while i < b_s.size and b_s[i] < e:
            if b_s[i] > cur:
                out_s.append(cur)
                out_e.append(float(b_s[i]))
            cur = max(cur, float(b_e[i]))
            i += 1
        if cur < e:
            out_s.append(cur)
            out_e.append(e)
    return np.asarray(out_s, dtype=np.float64), np.asarray(out_e, dtype=np.float64)


def repeated_rows(*columns: np.ndarray) -> np.ndarray:
    """Bool per row: equal in every column to an earlier row (the first of equal rows is not repeated)."""
    n = columns[0].size if columns else 0
    out = np.zeros(n, dtype=bool)
    if n < 2:
        return out
    order = np.lexsort(columns[::-1])  # stable: equal rows keep their order, so the first stays unmarked
    same = np.ones(n - 1, dtype=bool)
    for c in columns:
        c = c[order]
        same &= c[1:] == c[:-1]
    out[order[1:][same]] = True
    return out


class ThreadIntervals:
    """Per-thread intervals (start, end, payload) with an innermost-containment query."""

    def __init__(self) -> None:
        self.tid = array("q")
        self.start = array("d")
        self.end = array("d")
        self.payload = array("q")

    def add(self, tid: int, start: float, end: float, payload: int) -> None:
        self.tid.append(tid)
        self.start.append(start)
        self.end.append(end)
        self.payload.append(payload)

    def __len__(self) -> int:
        return len(self.start)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(tid, start, end, payload)`` as numpy views (int64, float64, float64, int64) of the stored intervals."""
        return (np.frombuffer(self.tid, dtype=np.int64), np.frombuffer(self.start, dtype=np.float64),
                np.frombuffer(self.end, dtype=np.float64), np.frombuffer(self.payload, dtype=np.int64))

    def repeated(self) -> np.ndarray:
        """Bool per interval: the same ``(tid, start, end, payload)`` as an earlier one (a record written twice)."""
        return repeated_rows(*self.arrays())

    def keep(self, mask: np.ndarray) -> None:
        """Drop the intervals where ``mask`` (bool, one per interval) is False."""
        for name, code in (("tid", "q"), ("start", "d"), ("end", "d"), ("payload", "q")):
            values = np.frombuffer(getattr(self, name), dtype=np.int64 if code == "q" else np.float64)[mask]
            setattr(self, name, array(code, values.tobytes()))

    def innermost(self, tids: np.ndarray, points: np.ndarray) -> np.ndarray:
        """Index (into this collection) of the innermost interval containing each point, -1 if none.

        Intervals on one thread nest (ranges and ops of one thread do); ties at equal starts put the
        longer interval outside.
        """
        out = np.full(points.size, -1, dtype=np.int64)
        if not len(self.start) or not points.size:
            return out
        itid = np.frombuffer(self.tid, dtype=np.int64)
        ist, ien = np.frombuffer(self.start, dtype=np.float64), np.frombuffer(self.end, dtype=np.float64)
        for t in np.unique(tids):
            sel = np.flatnonzero(itid == t)
            if not sel.size:
                continue
            order = sel[np.lexsort((-ien[sel], ist[sel]))]
            pts = np.flatnonzero(tids == t)
            pts = pts[np.argsort(points[pts], kind="stable")]
            stack: list[int] = []
            j = 0
            for p in pts:
                x = points[p]
                while j < order.size and ist[order[j]] <= x:
                    while stack and ien[stack[-1]] < ist[order[j]]:
                        stack.pop()
                    stack.append(int(order[j]))
                    j += 1
                while stack and ien[stack[-1]] < x:
                    stack.pop()
                if stack:
                    out[p] = stack[-1]
        return out
