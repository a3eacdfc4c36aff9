"""The GPU activities of one trace (:class:`ActivityTable`) and one function per question over them alone.

Definitions (all times in ms, from the trace's microsecond ``ts``/``dur``):

* GPU activity: events of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset``.
* Step window: the profiled step's ``ProfilerStep#N`` slice, or the ``sftprof/step`` user annotation inside it
  (a trace without that slice: the longest ``sftprof/step``, else the longest ``ProfilerStep#N``, else the span of all
  GPU activity), extended to the end of the last GPU activity launched inside it (kernels run asynchronously after
  the CPU leaves the region). Another step's slice is never the window, however long.
* GPU busy share: length of the union of GPU activity intervals (all streams) inside the step
  window, divided by the window length; idle share = 1 - busy share.
* Category time: sum of activity durations per category; shares are relative to the total GPU
  activity time, so they sum to 100 %. Kernels launched inside ``sftprof/optimizer_step`` count
  as ``optimizer`` (except collectives); other kernels are classified by name.
* Communication hidden / exposed: with C the union of NCCL kernel intervals and K the union of
  all other GPU activity intervals on the same device, hidden = |C ∩ K| and exposed = |C| - hidden
  (the usual overlap definition, e.g. Holistic Trace Analysis' comm/comp overlap). Host-side
  collective ops (``gloo:*``/``nccl:*`` annotations or cpu_ops; the only communication of CPU runs) are reported
  separately as ``communication.host_ops`` (wall time = union of their intervals).
* Region time: per ``sftprof/...`` user annotation, its CPU wall time and the GPU time of the
  activities whose launching CUDA API call (matched by ``correlation`` id) lies inside it.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Iterable, Iterator, Optional, SupportsIndex, TypeVar, overload

import numpy as np

from sftprof import artifacts
from sftprof.analysis.trace.intervals import clip, intersection_length, length, union
from sftprof.analysis.trace.kernel_names import COMM_PREFIX
from sftprof.analysis.schema import ms
from sftprof.analysis.time.schema import CategoryRow, Communication, GpuTime, KernelRow, RegionRow, StepWindow

__all__ = ["ActivityTable", "Labels", "column_rows", "Span", "step_window", "gpu_time", "top_kernels",
           "time_by_category", "communication", "region_times", "GPU_ACTIVITY_CATS", "TOP_KERNELS", "ROWS"]

TOP_KERNELS = 20
GPU_ACTIVITY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_REGION = artifacts.STEP
Span = tuple[str, float, float]  # (annotation name, start us, end us) on the trace clock


T = TypeVar("T")
ROWS = 1 << 16  # rows of Python values made at a time (:func:`column_rows`)


def column_rows(*columns: np.ndarray) -> Iterator[tuple[Any, ...]]:
    """The rows of equal-length columns as tuples of Python values, in order, made :data:`ROWS` rows at a time (one
    Python object per value of a whole column of GPU activities is 30-40 bytes an activity more at the summary's
    peak memory)."""
    for first in range(0, columns[0].size if columns else 0, ROWS):
        yield from zip(*(c[first:first + ROWS].tolist() for c in columns))


class Labels(Sequence[Optional[T]], Generic[T]):
    """A value (or None) per row kept as an index into the distinct values: 1-2 bytes a row, not an 8-byte pointer,
    for the activity table's category and process-group columns and the placements' part, layer and phase
    (:class:`sftprof.analysis.trace.op_collector.Placement`).

    Args:
        names: the distinct values (strings, or a placement's layers).
        codes: per row, an index into ``names`` (any signed int dtype, kept in the smallest that holds them; -1:
            None).
    """

    def __init__(self, names: list[T], codes: np.ndarray) -> None:
        self.names = names
        self.codes = codes.astype(np.min_scalar_type(-max(len(names), 1)), copy=False)  # int8 to 128 names

    @classmethod
    def of(cls, values: Iterable[Optional[T]]) -> "Labels[T]":
        """The labels of a list of values (or None)."""
        index: dict[T, int] = {}
        codes = [-1 if v is None else index.setdefault(v, len(index)) for v in values]
        return cls(list(index), np.array(codes, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.codes.size)

    @overload
    def __getitem__(self, i: SupportsIndex) -> Optional[T]: ...

    @overload
    def __getitem__(self, i: slice) -> list[Optional[T]]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> Optional[T] | list[Optional[T]]:
        if isinstance(i, slice):
            return [self.names[c] if c >= 0 else None for c in self.codes[i].tolist()]
        c = int(self.codes[i])
        return self.names[c] if c >= 0 else None

    def __iter__(self) -> Iterator[Optional[T]]:
        for first in range(0, self.codes.size, ROWS):
            yield from self[first:first + ROWS]

    def at(self, i: SupportsIndex) -> T:
        """The value of row ``i``, which is not None (else ValueError)."""
        c = int(self.codes[i])
        if c < 0:
            raise ValueError(f"row {int(i)} holds None")
        return self.names[c]

    def subset(self, keep: np.ndarray) -> "Labels[T]":
        """The rows where ``keep`` (bool) is True."""
        return Labels(self.names, self.codes[keep])


@dataclass
class ActivityTable:
    """The GPU activities of one trace, one row per activity (kernel, memcpy, memset), in trace order.

    Built once by :meth:`sftprof.analysis.time.trace_summary.KernelTraceAnalyzer.activity_table`; every question
    function of this module reads it. Arrays have length ``n`` (times in us on the trace clock).

    Attributes:
        names: unique activity names; ``name_idx[i]`` indexes it.
        name_idx: int32, per activity, index into ``names``.
        kind: int8, index into :data:`GPU_ACTIVITY_CATS`.
        ts, dur, end: float64 start, duration and end (us).
        dev: int64 device (trace ``pid``), -1 when absent.
        stream: int64 stream (trace ``tid``), -1 when absent.
        corr, ext: int64 ``correlation`` and ``External id`` per activity (-1 when absent).
        launch_tid: int64 thread of the launching CUDA API call, -1 when not in the trace.
        launch: float64 start (us) of the launching CUDA API call, NaN when not in the trace.
        category: :func:`~sftprof.analysis.trace.kernel_names.kernel_category`, ``optimizer`` for non-collective
            kernels launched inside ``sftprof/optimizer_step`` (:class:`Labels`, as are the next two).
        is_comm: bool, NCCL kernel.
        group: parallelism label of a collective's process group (None when unknown or not a collective).
        pg_name: the process group's name as the trace records it (``Process Group Name``; the same on every
            member rank, so it identifies the group across the ranks' traces), None when unknown.
        nbytes: float64 bytes of memcpy/memset activities (0 when not given).
    """

    names: list[str]
    name_idx: np.ndarray
    kind: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    end: np.ndarray
    dev: np.ndarray
    stream: np.ndarray
    corr: np.ndarray
    ext: np.ndarray
    launch_tid: np.ndarray
    launch: np.ndarray
    category: Labels[str]
    is_comm: np.ndarray
    group: Labels[str]
    pg_name: Labels[str]
    nbytes: np.ndarray

    @property
    def n(self) -> int:
        """Number of activities."""
        return len(self.name_idx)

    def subset(self, keep: np.ndarray) -> "ActivityTable":
        """The activities where ``keep`` (bool, one per activity) is True, in the same order."""
        if keep.all():
            return self
        return ActivityTable(names=self.names, name_idx=self.name_idx[keep], kind=self.kind[keep], ts=self.ts[keep],
                             dur=self.dur[keep], end=self.end[keep], dev=self.dev[keep], stream=self.stream[keep],
                             corr=self.corr[keep], ext=self.ext[keep], launch_tid=self.launch_tid[keep],
                             launch=self.launch[keep], category=self.category.subset(keep), is_comm=self.is_comm[keep],
                             group=self.group.subset(keep), pg_name=self.pg_name.subset(keep),
                             nbytes=self.nbytes[keep])


# -- one function per question over the activity table -----------------------------------------------------
def step_window(table: ActivityTable, regions: list[Span], profiler_steps: list[Span],
                trace_span: tuple[float, float], base_ns: int | None, step: int | None = None) -> StepWindow:
    """The step window of step ``step`` (module docstring): ``{source, start_us, end_us, wall_ms, unix_start_s,
    unix_end_s}``.

    ``source`` is ``sftprof/step``, ``ProfilerStep``, ``gpu_activity_span``, ``trace_span`` or ``none``
    (then the times are None); a step annotation's window is extended to the end of the last activity
    launched inside it. ``unix_*_s`` use the header's ``baseTimeNanoseconds`` (None without it).
    """
    source, lo, hi = "none", None, None
    own = [r for r in profiler_steps if r[0] == f"ProfilerStep#{step}"] if step is not None else []
    if own:  # the profiled step's slice, and the sftprof/step region that starts inside it
        lo, hi = min(r[1] for r in own), max(r[2] for r in own)
        source = "ProfilerStep"
        steps = [r for r in regions if r[0] == STEP_REGION and lo <= r[1] <= hi]
    else:
        steps = [r for r in regions if r[0] == STEP_REGION]
    if steps:
        _, lo, hi = max(steps, key=lambda r: r[2] - r[1])
        source = STEP_REGION
    elif own:
        pass
    elif profiler_steps:
        _, lo, hi = max(profiler_steps, key=lambda r: r[2] - r[1])
        source = "ProfilerStep"
    elif table.n:
        lo, hi = float(table.ts.min()), float(table.end.max())
        source = "gpu_activity_span"
    elif trace_span[0] < trace_span[1]:
        lo, hi = trace_span
        source = "trace_span"
    if lo is None or hi is None:
        return {"source": source, "start_us": None, "end_us": None, "wall_ms": None, "unix_start_s": None,
                "unix_end_s": None}
    if source in (STEP_REGION, "ProfilerStep") and table.n:
        launched = (table.launch >= lo) & (table.launch <= hi)
        if launched.any():
            hi = max(hi, float(table.end[launched].max()))
    return {"source": source, "start_us": lo, "end_us": hi, "wall_ms": ms(hi - lo),
            "unix_start_s": (lo + base_ns / 1e3) / 1e6 if base_ns else None,
            "unix_end_s": (hi + base_ns / 1e3) / 1e6 if base_ns else None}


def gpu_time(table: ActivityTable, lo: float | None, hi: float | None) -> GpuTime:
    """GPU time in the window ``[lo, hi]`` (us): ``{activities, total_ms, busy_ms, busy_share_pct, idle_share_pct}``.

    Busy = length of the union of all activity intervals (all streams) inside the window; the shares are
    None without a window.
    """
    busy_ms, busy_pct, idle_pct = 0.0, None, None
    if table.n and lo is not None and hi is not None and hi > lo:
        busy = length(*clip(union(table.ts, table.end), lo, hi))
        busy_ms, busy_pct, idle_pct = ms(busy), round(100 * busy / (hi - lo), 3), round(100 - 100 * busy / (hi - lo), 3)
    return {"activities": table.n, "total_ms": ms(float(table.dur.sum())), "busy_ms": busy_ms,
            "busy_share_pct": busy_pct, "idle_share_pct": idle_pct}


def top_kernels(table: ActivityTable, limit: int = TOP_KERNELS) -> list[KernelRow]:
    """The ``limit`` kernels (trace category ``kernel``) with the most GPU time: ``{name, calls, total_ms, share_pct}``.

    Shares are of the total GPU activity time (all activities); ties are ordered by name.
    """
    total_us = float(table.dur.sum())
    kernels = table.kind == 0
    name = table.name_idx[kernels].astype(np.intp)
    us = np.zeros(len(table.names))
    np.add.at(us, name, table.dur[kernels])  # in trace order
    k_tot, k_calls = us.tolist(), np.bincount(name, minlength=len(table.names)).tolist()
    top = sorted(np.flatnonzero(k_calls).tolist(), key=lambda k: (-k_tot[k], table.names[k]))[:limit]
    return [{"name": table.names[k], "calls": k_calls[k], "total_ms": ms(k_tot[k]),
             "share_pct": round(100 * k_tot[k] / total_us, 3) if total_us else 0.0} for k in top]


def time_by_category(table: ActivityTable) -> list[CategoryRow]:
    """GPU time per category, collectives with their group (``NCCL AllReduce [TP]``): ``{category, calls, total_ms,
    share_pct}``, sums to 100 %."""
    total_us = float(table.dur.sum())
    index: dict[str, int] = {}  # label -> its index
    cat, group = table.category, table.group
    width = len(group.names) + 1  # a (category, group, NCCL kernel) as one number; group -1: None
    key = cat.codes.astype(np.intp) * width
    key += group.codes
    key += 1
    key *= 2
    key += table.is_comm
    lut = np.zeros(len(cat.names) * width * 2, dtype=np.intp)  # its label's index
    for k in np.flatnonzero(np.bincount(key, minlength=lut.size)).tolist():
        c, g = cat.names[k // 2 // width], group.names[(k // 2) % width - 1] if (k // 2) % width else None
        lut[k] = index.setdefault(f"{c} [{g}]" if k % 2 and g else c, len(index))
    label = lut[key]
    del key
    us = np.zeros(len(index))
    np.add.at(us, label, table.dur)  # in trace order
    c_tot, c_calls = us.tolist(), np.bincount(label, minlength=len(index)).tolist()
    return [{"category": c, "calls": c_calls[k], "total_ms": ms(c_tot[k]),
             "share_pct": round(100 * c_tot[k] / total_us, 3) if total_us else 0.0}
            for c, k in sorted(index.items(), key=lambda kv: (-c_tot[kv[1]], kv[0]))]


def communication(table: ActivityTable, host_comm: list[Span]) -> Communication:
    """NCCL kernel time and its overlap with computation, plus host-side collective ops (module docstring).

    Returns:
        ``{kernels, total_ms, hidden_ms, exposed_ms, by_type_ms, by_group_ms, host_ops}``; per device,
        total = |C| and hidden = |C ∩ K| with C the union of NCCL kernel intervals and K the union of the
        other activities; ``host_ops`` = ``{ops, wall_ms (union of their intervals), by_op_ms}``.
    """
    ts, end, devs, is_comm = table.ts, table.end, table.dev, table.is_comm
    total = hidden = 0.0
    for dev in np.unique(devs):
        on = devs == dev
        comm = union(ts[on & is_comm], end[on & is_comm])
        comp = union(ts[on & ~is_comm], end[on & ~is_comm])
        total += length(*comm)
        hidden += intersection_length(comm, comp)
    by_type: dict[str, float] = defaultdict(float)
    by_group: dict[str, float] = defaultdict(float)
    cats = table.category
    for i in np.flatnonzero(is_comm):
        d = float(end[i] - ts[i])
        by_type[cats.names[cats.codes[i]][len(COMM_PREFIX):]] += d  # an NCCL kernel's category is a name
        by_group[table.group[i] or "unknown"] += d
    host_s = np.array([h[1] for h in host_comm], dtype=np.float64)
    host_e = np.array([h[2] for h in host_comm], dtype=np.float64)
    by_op: dict[str, float] = defaultdict(float)
    for name, h_lo, h_hi in host_comm:
        by_op[name] += h_hi - h_lo
    return {
        "kernels": int(is_comm.sum()),
        "total_ms": ms(total),
        "hidden_ms": ms(hidden),
        "exposed_ms": ms(total - hidden),
        "by_type_ms": {k: ms(v) for k, v in sorted(by_type.items())},
        "by_group_ms": {k: ms(v) for k, v in sorted(by_group.items())},
        "host_ops": {"ops": len(host_comm), "wall_ms": ms(length(*union(host_s, host_e))),
                     "by_op_ms": {k: ms(v) for k, v in sorted(by_op.items())}},
    }


def region_times(table: ActivityTable, regions: list[Span], lo: float | None) -> list[RegionRow]:
    """Per ``sftprof/*`` region: ``{name, start_ms (from the window start lo), cpu_ms, gpu_ms, gpu_activities}``.

    GPU time is the sum of the durations of the activities whose launching call lies inside the region
    (None when the trace has no GPU activity).
    """
    rows: list[RegionRow] = []
    for name, r_lo, r_hi in regions:
        inside = (table.launch >= r_lo) & (table.launch <= r_hi)
        rows.append({
            "name": name,
            "start_ms": ms(r_lo - lo) if lo is not None else None,
            "cpu_ms": ms(r_hi - r_lo),
            "gpu_ms": ms(float(table.dur[inside].sum())) if table.n else None,
            "gpu_activities": int(inside.sum()),
        })
    return rows
