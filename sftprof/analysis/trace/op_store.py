"""Every CPU op of one trace, kept on disk during the kernel summary's pass and read back one time bucket at a time.

The CPU ops are most of a kineto trace's events (about 2 M per GiB); held in memory they made the summary's peak
memory grow with the trace. :class:`CpuOpStore` writes them to a file of a temporary folder (``TMPDIR``; about
:data:`TEMP_GB_PER_TRACE_GIB` GB per GiB of a kineto trace with the copies below, removed with the store) in blocks of
``bucket_ops`` ops
(28 bytes an op on disk: start and duration float64 us, thread int64, name index int32) and keeps 1 byte an op in
memory (whether the op is kept: :mod:`sftprof.analysis.trace.sanity` drops ops recorded twice and ops of other
profiler steps). After the pass the ops are split by their start into time buckets of about ``bucket_ops`` ops each
(36 bytes an op on disk, with the op's index); a bucket is read with the ops of earlier buckets still open at its
start (:meth:`CpuOpStore.buckets`), which are all the ops that can contain a point of the bucket or be the parent of
an op starting in it. Every question (innermost op around a point, self times) is answered one bucket at a time with
:class:`~sftprof.analysis.trace.intervals.ThreadIntervals`, so memory holds one bucket's ops, not the trace's.

Sums per op name run in the order of the ops in the trace (a sum's last bits depend on its order), as a sum over the
whole collection in memory did: :meth:`CpuOpStore.self_us` gives its records back in that order through a second
split, by index.

The folder, ``sftprof_cpu_ops_<pid>_<random>``, goes with the store (on a normal exit too); one whose process was
killed (SIGKILL, or a signal its program does not handle) is removed by the next store made in the same temporary
folder (:func:`remove_orphans`; never a live process's). A write to it that fails (a full ``TMPDIR``, a quota) raises
:class:`TempSpaceError`, which names the folder, not the trace.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import weakref
from array import array
from typing import Any, Callable, Iterator, Optional

import numpy as np

from sftprof.analysis.trace.intervals import ThreadIntervals, repeated_rows
from sftprof.atomic import SPACE_ERRNOS, free_space

__all__ = ["CpuOpStore", "BUCKET_OPS", "TempSpaceError", "TEMP_GB_PER_TRACE_GIB", "remove_orphans"]

BUCKET_OPS = 1 << 17  # ops per block of the pass and per time bucket: about 35 MB of a bucket's working memory
TEMP_GB_PER_TRACE_GIB = 0.26  # the temporary folder's size per GiB of kineto trace text (measured)
_PREFIX = "sftprof_cpu_ops_"
_FOLDER_RE = re.compile(re.escape(_PREFIX) + r"(\d+)_")  # sftprof_cpu_ops_<pid>_<random>

_OP = np.dtype([("start", "f8"), ("dur", "f8"), ("tid", "i8"), ("name", "i4")])  # one op as written in the pass
_ROW = np.dtype([("idx", "i8"), ("start", "f8"), ("dur", "f8"), ("tid", "i8"), ("name", "i4")])  # ... in a bucket
_SELF = np.dtype([("idx", "i8"), ("name", "i4"), ("own", "f8"), ("incl", "f8")])  # one op's self and inclusive us

Bucket = tuple[float, float, ThreadIntervals, np.ndarray, np.ndarray]


class TempSpaceError(OSError):
    """A write to the store's temporary folder failed (``strerror``: ``"temporary CPU-op file in <folder> (TMPDIR):
    <reason> (<free space>)"``); :meth:`message` adds what a trace of a given size needs."""

    def __init__(self, folder: str, exc: OSError) -> None:
        reason = exc.strerror or str(exc) or type(exc).__name__
        super().__init__(exc.errno, f"temporary CPU-op file in {folder} (TMPDIR): {reason} ({free_space(folder)})")

    def message(self, trace: str) -> str:
        """The error for the trace ``trace`` (a path): for want of space, the space it needs, from its size
        (:data:`TEMP_GB_PER_TRACE_GIB`; per GiB of text for a ``.gz`` trace, whose text size is not known)."""
        if self.errno not in SPACE_ERRNOS:
            return f"{self.strerror}; set TMPDIR to a folder it can write"
        if trace.endswith(".gz"):
            need = f"about {TEMP_GB_PER_TRACE_GIB} GB per GiB of the trace's uncompressed text"
        else:
            gb = os.path.getsize(trace) / 2**30 * TEMP_GB_PER_TRACE_GIB
            need = f"about {gb:.1f} GB for this trace" if gb >= 0.1 else f"about {gb * 1000:.1f} MB for this trace"
        return f"{self.strerror}; it needs {need} (set TMPDIR to a folder with room)"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def remove_orphans(folder: str) -> list[str]:
    """Remove the stores' folders in ``folder`` whose process (the pid in their name) is gone; returns their
    paths, sorted. A folder that cannot be listed or removed is left."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        m = _FOLDER_RE.match(name)
        path = os.path.join(folder, name)
        if m and not _pid_alive(int(m.group(1))) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _make_folder(owner: object, tmp: str) -> str:
    """Make the store's folder ``sftprof_cpu_ops_<pid>_<random>`` in ``tmp``, removed when ``owner`` goes (or at
    exit). Its removal is registered before the folder is made, so a stop signal between the two (turned into an exit
    by ``sftprof.cli.run_main``) cannot leave it behind. Raises TempSpaceError: the folder cannot be made."""
    while True:
        path = os.path.join(tmp, f"{_PREFIX}{os.getpid()}_{secrets.token_hex(6)}")
        weakref.finalize(owner, shutil.rmtree, path, True)
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise TempSpaceError(tmp, exc) from exc


class _Spill:
    """Rows of one structured dtype appended to a file, read back whole or in blocks; a failed write raises
    :class:`TempSpaceError`."""

    def __init__(self, path: str, dtype: np.dtype) -> None:
        self.path, self.dtype, self.rows = path, dtype, 0
        try:
            open(path, "wb").close()
        except OSError as exc:
            raise TempSpaceError(os.path.dirname(os.path.dirname(path)), exc) from exc

    def append(self, rows: np.ndarray) -> None:
        try:
            with open(self.path, "ab") as f:
                f.write(np.ascontiguousarray(rows).data)
        except OSError as exc:
            raise TempSpaceError(os.path.dirname(os.path.dirname(self.path)), exc) from exc
        self.rows += rows.size

    def read(self, first: int = 0, count: int = -1) -> np.ndarray:
        """Rows ``first`` to ``first + count`` (all from ``first`` when ``count`` is -1)."""
        return np.fromfile(self.path, dtype=self.dtype, count=count, offset=first * self.dtype.itemsize)

    def blocks(self, size: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, rows)`` of ``size`` rows at a time, in order."""
        for first in range(0, self.rows, size):
            yield first, self.read(first, size)


def _route(rows: np.ndarray, which: np.ndarray, spills: list[_Spill]) -> None:
    """Append each row to ``spills[which[row]]``, keeping the rows' order."""
    order = np.argsort(which, kind="stable")
    cuts = np.searchsorted(which[order], np.arange(len(spills) + 1))
    for k, spill in enumerate(spills):
        if cuts[k] < cuts[k + 1]:
            spill.append(rows[order[cuts[k]:cuts[k + 1]]])


class CpuOpStore:
    """The CPU ops of one trace (module docstring), numbered in the order they were added (their index).

    Args:
        bucket_ops: ops per block written in the pass and per time bucket (:data:`BUCKET_OPS`; the tests use a few
            to cut nested ops across buckets).

    Raises:
        TempSpaceError: the temporary folder cannot be made or written (here or when ops are added or read).
    """

    def __init__(self, bucket_ops: int = BUCKET_OPS) -> None:
        self._bucket_ops = bucket_ops
        tmp = tempfile.gettempdir()
        remove_orphans(tmp)
        self._dir = _make_folder(self, tmp)
        self._ops = _Spill(os.path.join(self._dir, "ops"), _OP)
        # the ops not yet written (the first _n): start, dur (us), thread, name index; allocated once, as the block
        # they are written from (no large buffer allocated and freed per block)
        self._buf: tuple[array[Any], ...] = tuple(array(code, [0]) * bucket_ops for code in "ddqi")
        self._n = 0
        self._block = np.empty(bucket_ops, dtype=_OP)
        self._kept = np.ones(0, dtype=bool)  # per op: not dropped (1 byte an op)
        self._bounds: Optional[np.ndarray] = None  # the time buckets' boundaries (us), for the ops written
        self._buckets: list[_Spill] = []

    def add(self, tid: int, start: float, dur: float, name: int) -> None:
        """One op: thread ``tid``, ``start`` and ``dur`` us, ``name`` an index into the caller's op names."""
        b, n = self._buf, self._n
        b[0][n] = start
        b[1][n] = dur
        b[2][n] = tid
        b[3][n] = name
        self._n = n + 1
        if self._n == self._bucket_ops:
            self._flush()

    def _flush(self) -> None:
        """Write the buffered ops to the file."""
        rows = self._block[:self._n]
        for field, column in zip(("start", "dur", "tid", "name"), self._buf):
            rows[field] = np.frombuffer(column, dtype=np.dtype(column.typecode), count=self._n)
        self._ops.append(rows)
        self._n = 0
        self._bounds = None  # the buckets hold the ops written before

    def __len__(self) -> int:
        """The ops kept (added and not dropped)."""
        self._settle()
        return int(np.count_nonzero(self._kept))

    def _settle(self) -> None:
        """After the last op: write the buffer and split the ops into time buckets (again after more ops)."""
        if self._n:
            self._flush()
        if self._bounds is not None:
            return
        n, size = self._ops.rows, self._bucket_ops
        self._kept = np.concatenate((self._kept, np.ones(n - self._kept.size, dtype=bool)))
        step = max(1, size // 64)  # a sample of the starts (1 in step) places the boundaries
        sample = np.sort(np.concatenate([np.sort(rows["start"])[::step] for _, rows in self._ops.blocks(size)]
                                        or [np.zeros(0)]))
        self._bounds = np.unique(sample[size // step::size // step])
        self._buckets = [_Spill(os.path.join(self._dir, f"bucket{k}"), _ROW)
                         for k in range(self._bounds.size + 1)]
        for first, ops in self._ops.blocks(size):
            rows = np.empty(ops.size, dtype=_ROW)
            rows["idx"] = np.arange(first, first + ops.size)
            for field in _OP.names or ():
                rows[field] = ops[field]
            _route(rows, np.searchsorted(self._bounds, ops["start"], side="right"), self._buckets)

    def drop_repeated(self, examples: int) -> tuple[int, list[tuple[int, float]]]:
        """Drop the ops equal in thread, start, end and name to an earlier op (a record written twice); returns
        their number and ``(name index, start us)`` of the first ``examples`` of them (in the order of the ops)."""
        self._settle()
        count, first = 0, list[tuple[int, int, float]]()
        for spill in self._buckets:  # equal ops start together: in one bucket
            rows = spill.read()
            dup = repeated_rows(rows["start"], rows["tid"], rows["start"] + rows["dur"], rows["name"].astype(np.int64))
            self._kept[rows["idx"][dup]] = False
            count += int(np.count_nonzero(dup))
            first += zip(*(rows[f][dup][:examples].tolist() for f in ("idx", "name", "start")))
        return count, [(k, s) for _, k, s in sorted(first)[:examples]]

    def drop_where(self, starting: Callable[[np.ndarray], np.ndarray]) -> int:
        """Drop the kept ops whose start (float64 us) ``starting`` marks (bool); returns their number."""
        self._settle()
        count = 0
        for first, ops in self._ops.blocks(self._bucket_ops):
            kept = self._kept[first:first + ops.size]
            drop = kept & starting(ops["start"])
            kept &= ~drop
            count += int(np.count_nonzero(drop))
        return count

    def name_totals(self, n_names: int) -> tuple[np.ndarray, np.ndarray]:
        """``(calls, us)`` per name index (int64, float64; ``n_names`` long): the kept ops' count and recorded
        durations summed in the order of the ops."""
        self._settle()
        calls, us = np.zeros(n_names, dtype=np.int64), np.zeros(n_names)
        for first, ops in self._ops.blocks(self._bucket_ops):
            ops = ops[self._kept[first:first + ops.size]]
            name = ops["name"].astype(np.intp)  # ufunc.at is fast on contiguous columns
            calls += np.bincount(name, minlength=n_names)
            np.add.at(us, name, np.ascontiguousarray(ops["dur"]))
        return calls, us

    @property
    def kept(self) -> np.ndarray:
        """Bool per op added: not dropped."""
        self._settle()
        return self._kept

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(tid, start, end, name)`` of every kept op in memory (int64, float64, float64, int64), in their order:
        for the CPU runs' questions (:func:`sftprof.analysis.time.model_parts.cpu_parts`,
        :func:`sftprof.analysis.time.host_time.heaviest_op`), whose traces are small."""
        self._settle()
        ops = self._ops.read()[self._kept]
        return ops["tid"].copy(), ops["start"].copy(), ops["start"] + ops["dur"], ops["name"].astype(np.int64)

    def buckets(self) -> Iterator[Bucket]:
        """Per time bucket, in time order: ``(t0, t1, ops, idx, started)``: the bucket's span ``[t0, t1)`` (us; the
        first from -inf, the last to inf), the kept ops starting in it and those of earlier buckets still open at
        ``t0`` (ending at or after it) as :class:`ThreadIntervals` in the order of the ops (payload: name index),
        their indexes and whether each started in the bucket."""
        self._settle()
        assert self._bounds is not None
        edges = np.concatenate(([-np.inf], self._bounds, [np.inf]))
        carried = np.zeros(0, dtype=_ROW)
        for k, spill in enumerate(self._buckets):
            rows = spill.read()
            rows = np.concatenate((carried, rows[self._kept[rows["idx"]]]))
            started = np.arange(rows.size) >= carried.size
            by_idx = np.argsort(rows["idx"], kind="stable")
            rows, started = rows[by_idx], started[by_idx]
            end = rows["start"] + rows["dur"]
            ops = ThreadIntervals.from_arrays(rows["tid"], rows["start"], end, rows["name"])
            yield float(edges[k]), float(edges[k + 1]), ops, rows["idx"], started
            carried = rows[end >= edges[k + 1]]

    def innermost(self, tids: np.ndarray, points: np.ndarray, named: Optional[np.ndarray] = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """``(idx, name)`` (int64, -1: none) of the innermost kept op around each point (thread ``tids``, ``points``
        us, NaN: none), as :meth:`ThreadIntervals.innermost` finds it among all the ops; ``named`` (bool per name
        index): among the ops of those names alone."""
        idx, name = np.full(points.size, -1, dtype=np.int64), np.full(points.size, -1, dtype=np.int64)
        if not points.size:
            return idx, name
        self._settle()
        assert self._bounds is not None
        which = np.where(np.isnan(points), -1, np.searchsorted(self._bounds, points, side="right"))
        by_bucket = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[by_bucket], np.arange(self._bounds.size + 2))
        for k, (_, _, ops, op_idx, _) in enumerate(self.buckets()):
            sel = by_bucket[cuts[k]:cuts[k + 1]]
            if not sel.size:
                continue
            if named is not None:
                _, _, _, pay = ops.arrays()
                keep = named[pay]
                ops, op_idx = ThreadIntervals.from_arrays(*(c[keep] for c in ops.arrays())), op_idx[keep]
            at = ops.innermost(tids[sel], points[sel])
            hit = at >= 0
            idx[sel[hit]] = op_idx[at[hit]]
            name[sel[hit]] = ops.arrays()[3][at[hit]]
        return idx, name

    def spans(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(start, end)`` us of the ops ``idx`` (a few: each is read from the file)."""
        self._settle()
        rows = [self._ops.read(int(i), 1)[0] for i in idx.tolist()]
        start = np.array([r["start"] for r in rows], dtype=np.float64)
        return start, start + np.array([r["dur"] for r in rows], dtype=np.float64)

    def self_us(self, lo: float, hi: float) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """The kept ops starting in ``[lo, hi]`` (us) in their order, in blocks of columns ``(idx, name, own,
        incl)``: the op's index (int64), name index (intp), self time (its end - start minus that of the ops starting
        in the window nested directly in it on its thread, :func:`~sftprof.analysis.trace.intervals.previous_open`'s
        parent, summed in the order of the nesting; at least 0) and inclusive time (end - start), us (float64)."""
        self._settle()
        size = self._bucket_ops
        parts = [_Spill(os.path.join(self._dir, f"self{k}"), _SELF) for k in range(-(-self._ops.rows // size))]
        carried_idx, carried_child = np.zeros(0, dtype=np.int64), np.zeros(0)  # ops open past a bucket: child us
        for _, t1, ops, idx, started in self.buckets():
            order, _, s_st, s_en, parent = ops.nesting()
            child = np.zeros(order.size)
            if carried_idx.size:
                position = np.empty(order.size, dtype=np.int64)
                position[order] = np.arange(order.size)
                child[position[np.searchsorted(idx, carried_idx)]] = carried_child
            inside = (s_st >= lo) & (s_st <= hi)
            nested = inside & (parent >= 0) & started[order]  # an op's own bucket adds it to its parent
            nested[nested] = inside[parent[nested]]
            weights = s_en[nested]
            weights -= s_st[nested]
            np.add.at(child, parent[nested], weights)  # in the order of the nesting, across buckets
            done = s_en < t1
            at = np.flatnonzero(inside & done)
            out = np.empty(at.size, dtype=_SELF)
            out["idx"], out["name"] = idx[order[at]], ops.arrays()[3][order[at]]
            out["incl"] = s_en[at] - s_st[at]
            out["own"] = np.maximum(out["incl"] - child[at], 0.0)
            out = out[np.argsort(out["idx"], kind="stable")]
            _route(out, out["idx"] // size, parts)
            carried_idx, carried_child = idx[order[~done]], child[~done]
        for part in parts:
            rows = part.read()
            rows = rows[np.argsort(rows["idx"], kind="stable")]
            yield rows["idx"], rows["name"].astype(np.intp), rows["own"].copy(), rows["incl"].copy()
