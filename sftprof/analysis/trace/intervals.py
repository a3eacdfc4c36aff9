"""Interval arithmetic over time intervals in trace microseconds: disjoint sets, and nested per-thread intervals.

One interval set is a pair ``(starts, ends)`` of 1-D float64 arrays of equal length with
``starts[i] <= ends[i]``; :func:`union` turns any set into its sorted, disjoint form, which
:func:`intersection_length` and :func:`clip` expect. Used by the GPU activities' questions
(:mod:`sftprof.analysis.time.gpu_activity`: GPU busy time, hidden/exposed communication), the collectives
(:mod:`sftprof.analysis.time.collectives`: exposed time per process group) and the cross-rank split of
communication into waiting and transfer (:mod:`sftprof.analysis.time.comm_wait`: a collective's exposed pieces).

:class:`ThreadIntervals` holds the intervals of a trace's threads that nest on each thread (CPU ops, model-part
ranges, autograd backward nodes) and finds the innermost one around given points
(:class:`sftprof.analysis.trace.op_collector.OpCollector`).
"""
from __future__ import annotations

from array import array
from typing import Any

import numpy as np

__all__ = ["union", "length", "intersection_length", "clip", "difference", "repeated_rows", "ThreadIntervals",
           "Intervals"]

Intervals = tuple[np.ndarray, np.ndarray]
_POINTS = 1 << 18  # points of one thread looked up at a time (ThreadIntervals.innermost): about 10 MB of temporaries


def union(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """Merge intervals ``[starts[i], ends[i])`` into sorted disjoint intervals (touching ones merge too)."""
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, run_end = starts[order], ends[order]
    del order  # each temporary freed as soon as read: a union of every GPU activity is the summary's peak memory
    np.maximum.accumulate(run_end, out=run_end)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    np.greater(s[1:], run_end[:-1], out=new[1:])
    idx = np.flatnonzero(new)
    del new
    out_s = s[idx]
    del s
    idx[:-1] = idx[1:] - 1  # the last of each merged run
    idx[-1] = run_end.size - 1
    return out_s, run_end[idx]


def length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of a disjoint interval set (0.0 when empty); same unit as the inputs."""
    return float(np.sum(ends - starts)) if starts.size else 0.0


def covered_lengths(b: Intervals, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per interval ``[starts[i], ends[i])`` (any order, may overlap), the length of it that the disjoint, sorted
    interval set ``b`` (an output of :func:`union`) covers."""
    b_s, b_e = b
    starts, ends = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    if b_s.size == 0:
        return np.zeros(starts.shape)
    # Prefix lengths of b; the covered length of b in [x, y) is cov(y) - cov(x).
    prefix = np.concatenate(([0.0], np.cumsum(b_e - b_s)))

    def covered_upto(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(b_s, x, side="right")  # intervals starting at or before x
        full = prefix[np.maximum(i - 1, 0)]
        partial = np.where(i > 0, np.clip(x - b_s[np.maximum(i - 1, 0)], 0, None), 0.0)
        partial = np.minimum(partial, np.where(i > 0, b_e[np.maximum(i - 1, 0)] - b_s[np.maximum(i - 1, 0)], 0.0))
        out: np.ndarray = full + partial
        return out

    covered: np.ndarray = covered_upto(ends) - covered_upto(starts)
    return covered


def intersection_length(a: Intervals, b: Intervals) -> float:
    """Total length of the intersection of two disjoint, sorted interval sets (outputs of :func:`union`)."""
    if a[0].size == 0 or b[0].size == 0:
        return 0.0
    return float(np.sum(covered_lengths(b, *a)))


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
    """Bool per row: equal in every column to an earlier row (the first of equal rows is not repeated). The first
    column should be the most selective (a start time): only rows that share its value are compared further."""
    n = columns[0].size if columns else 0
    out = np.zeros(n, dtype=bool)
    if n < 2:
        return out
    by_first = np.argsort(columns[0], kind="stable")
    first = columns[0][by_first]
    tied = np.flatnonzero(first[1:] == first[:-1])
    if not tied.size:
        return out
    rows = np.unique(by_first[np.concatenate((tied, tied + 1))])  # the rows that share a first value with another
    order = rows[np.lexsort([c[rows] for c in columns[::-1]])]  # stable: equal rows keep their order
    same = np.ones(order.size - 1, dtype=bool)
    for c in columns:
        c = c[order]
        same &= c[1:] == c[:-1]
    out[order[1:][same]] = True
    return out


def previous_open(tid: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For intervals sorted by thread, then start, then end descending: per interval ``i`` the last interval ``j < i``
    of its thread still open at its start (``end[j] > start[i]``), -1 if none; for nested intervals, its parent.

    Pointer jumping, vectorised: a candidate that ended by ``start[i]`` is skipped together with every interval its
    own pointer skipped (those ended by its start, which is not after ``start[i]``), so each round halves the chains.
    """
    n = start.size
    q = np.arange(-1, n - 1, dtype=np.int64)
    if n:
        q[1:][tid[1:] != tid[:-1]] = -1
    todo = np.flatnonzero(q >= 0)
    while todo.size:
        todo = todo[end[q[todo]] <= start[todo]]  # not open at i's start: skip it and what it skipped
        q[todo] = q[q[todo]]
        todo = todo[q[todo] >= 0]
    return q


class ThreadIntervals:
    """Per-thread intervals (start, end, payload) with an innermost-containment query."""

    def __init__(self) -> None:
        self.tid = array("q")
        self.start = array("d")
        self.end = array("d")
        self.payload = array("q")
        self._index: tuple[Any, ...] | None = None  # (size it was built for, order, threads, start, end, parent)

    def add(self, tid: int, start: float, end: float, payload: int) -> None:
        self.tid.append(tid)
        self.start.append(start)
        self.end.append(end)
        self.payload.append(payload)

    @classmethod
    def from_arrays(cls, tid: np.ndarray, start: np.ndarray, end: np.ndarray, payload: np.ndarray) -> "ThreadIntervals":
        out = cls()
        out.tid, out.start = array("q", tid.astype(np.int64).tobytes()), array("d", start.astype(np.float64).tobytes())
        out.end = array("d", end.astype(np.float64).tobytes())
        out.payload = array("q", payload.astype(np.int64).tobytes())
        return out

    def __len__(self) -> int:
        return len(self.start)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(tid, start, end, payload)`` as numpy views (int64, float64, float64, int64) of the stored intervals."""
        return (np.frombuffer(self.tid, dtype=np.int64), np.frombuffer(self.start, dtype=np.float64),
                np.frombuffer(self.end, dtype=np.float64), np.frombuffer(self.payload, dtype=np.int64))

    def nesting(self) -> tuple[Any, ...]:
        """``(order, threads, start, end, parent)``: the intervals sorted by thread, start and end descending
        (``order`` indexes the collection), each thread's run in that order (``threads``: its sorted thread ids and
        the position its run begins at, with the size appended), and :func:`previous_open` of each (a position in
        that order, -1: none); built once per size of the collection and kept (24 bytes an interval: ``order``
        and ``parent`` are int32 below 2**31 intervals)."""
        if self._index is None or self._index[0] != len(self.start):
            tid, st, en, _ = self.arrays()
            index = np.int32 if len(self.start) < 2**31 else np.int64
            order = np.lexsort((-en, st, tid)).astype(index)
            s_tid = tid[order]
            s_st, s_en = st[order], en[order]
            parent = previous_open(s_tid, s_st, s_en).astype(index)
            begins = np.flatnonzero(np.append(True, s_tid[1:] != s_tid[:-1])) if order.size else np.zeros(0, np.int64)
            threads = s_tid[begins]
            del s_tid
            self._index = (len(self.start), order, (threads, np.append(begins, order.size)), s_st, s_en, parent)
        return self._index[1:]

    def innermost(self, tids: np.ndarray, points: np.ndarray) -> np.ndarray:
        """Index (into this collection) of the innermost interval containing each point (``start <= x <= end``),
        -1 if none: the one latest in the order of start, then end descending, among those of the point's thread
        that contain it (for nested intervals, the innermost; ties at equal starts put the longer interval outside).

        The last interval starting at or before the point, else the nearest of its open ancestors
        (:func:`previous_open`) that has not ended before the point: every interval later in that order contains it
        not, nor does any the chain skips.
        """
        out = np.full(points.size, -1, dtype=np.int64)
        if not len(self.start) or not points.size:
            return out
        order, (threads, begins), s_st, s_en, parent = self.nesting()
        for t in np.unique(tids):
            k = int(np.searchsorted(threads, t))
            if k == threads.size or threads[k] != t:
                continue
            lo, hi = int(begins[k]), int(begins[k + 1])
            on_thread = np.flatnonzero(tids == t)
            for first in range(0, on_thread.size, _POINTS):  # a block of points at a time: bounded temporaries
                sel = on_thread[first:first + _POINTS]
                x = points[sel]
                c = lo + np.searchsorted(s_st[lo:hi], x, side="right") - 1
                c[c < lo] = -1
                todo = np.flatnonzero(c >= 0)
                while todo.size:
                    todo = todo[s_en[c[todo]] < x[todo]]  # ended before the point: on to the open ancestor
                    c[todo] = parent[c[todo]]
                    todo = todo[c[todo] >= 0]
                out[sel] = np.where(c >= 0, order[np.maximum(c, 0)], -1)
        return out
