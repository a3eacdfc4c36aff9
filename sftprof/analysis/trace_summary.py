"""Kernel summary of one rank's torch.profiler Chrome trace, computed in a single streaming pass.

Feed every usable event to :meth:`KernelTraceAnalyzer.add` and every invalid one (no time,
negative or non-finite ``dur``, ...) to :meth:`KernelTraceAnalyzer.add_invalid`
(``sftprof.analysis.views.split_trace`` does both while it writes the views), then call
:meth:`KernelTraceAnalyzer.summary`. Memory is O(number of GPU activities + CUDA launches + CPU ops), a few dozen bytes each, never O(trace bytes).

Definitions (all times in ms, from the trace's microsecond ``ts``/``dur``):

* GPU activity: events of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset``.
* Step window: the ``sftprof/step`` user annotation (else the longest ``ProfilerStep#N``,
  else the span of all GPU activity), extended to the end of the last GPU activity launched
  inside it (kernels run asynchronously after the CPU leaves the region).
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

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from sftprof import artifacts
from sftprof.analysis import step_breakdown
from sftprof.analysis.intervals import clip, intersection_length, length, union
from sftprof.analysis.cpu_parts import cpu_parts, heaviest_op
from sftprof.analysis.schema import KernelSummary
from sftprof.analysis.kernel_names import COMM_PREFIX, HOST_COLLECTIVE_PREFIXES, collective_group_label, kernel_category

__all__ = ["KernelTraceAnalyzer", "ActivityTable", "step_window", "gpu_time", "top_kernels", "time_by_category",
           "communication", "region_times", "top_cpu_ops", "TOP_KERNELS", "invalid_events_error",
           "invalid_events_message", "INVALID_SHARE_LIMIT", "identity_problems"]

TOP_KERNELS = 20
INVALID_SHARE_LIMIT = 0.5  # a trace whose invalid events exceed this share of its events is an error
_INVALID_EXAMPLES = 3
TOP_CPU_OPS = 15
GPU_ACTIVITY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
REGION_PREFIX = artifacts.REGION_PREFIX
OPTIMIZER_REGION = artifacts.OPTIMIZER_STEP
STEP_REGION = artifacts.STEP
_PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)$")

def _int_id(v) -> int:
    """A correlation / External id as an int; -1 when absent or not an integer."""
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _rank_list(v) -> bool:
    """Whether ``v`` is a non-empty list of distinct global ranks (ints >= 0)."""
    return (isinstance(v, list) and bool(v) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in v)
            and len(set(v)) == len(v))


def invalid_events_error(invalid: dict) -> str | None:
    """The error of a trace whose invalid events dominate it (more than :data:`INVALID_SHARE_LIMIT`), else None."""
    total, events = invalid["total"], invalid["total"] + invalid["valid_events"]
    if total and total > INVALID_SHARE_LIMIT * events:
        return (f"{total} of {events} events are invalid ({invalid_events_message(invalid)}); "
                "the trace is not usable")
    return None


def identity_problems(identity: dict, rank: int, step: int) -> tuple[str | None, str | None]:
    """``(error, warning)`` of a trace whose own record of its step and rank (``identity``, the summary's: sorted
    ``profiler_steps`` and ``recorded_rank``) is checked against the rank in its file name and the step postprocessed.

    The error (None when both agree) says the trace is another's: it holds ``ProfilerStep#N`` slices but none of
    ``step`` (another step's trace, e.g. copied from another trial), or its header's ``distributedInfo.rank``
    differs from ``rank`` (another rank's trace under this rank's name); it is then not summarised. The trainer's
    kernel trials always record the profiled step as ``ProfilerStep#<step>`` (:mod:`sftprof.capture.kernel`) and run
    under torch.distributed, whose rank the profiler writes to the header. A trace without any ``ProfilerStep``
    slice (traces of earlier releases, which profiled without a schedule, such as the legacy
    ``traces-r<r>.chrome.json``; traces recorded without a profiler schedule) gets the warning (None otherwise) that
    its step cannot be confirmed, and is summarised as ``step``; one without ``distributedInfo.rank`` (not recorded
    under torch.distributed) is taken for the rank its name says, without a warning.
    """
    steps, recorded = identity["profiler_steps"], identity["recorded_rank"]
    wrong = []
    if steps and step not in steps:
        held = ", ".join(f"ProfilerStep#{s}" for s in steps)
        wrong.append(f"the trace holds step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} ({held}), "
                     f"not step {step}, the step postprocessed: another step's trace, not summarised as step {step}")
    if recorded is not None and recorded != rank:
        wrong.append(f"the trace records distributedInfo.rank {recorded} but its file name says rank {rank}: "
                     f"another rank's trace, not summarised as rank {rank}")
    warning = None if steps else (f"the trace holds no ProfilerStep#<N> slice (a trace of an earlier release, or not "
                                  f"recorded with the trainer's profiler schedule): that it is step {step} cannot be "
                                  f"confirmed; summarised as step {step}")
    return "; ".join(wrong) or None, warning


def invalid_events_message(invalid: dict) -> str:
    """``"3 invalid events left out of every figure and view: negative dur 2, missing ts 1"``."""
    kinds = ", ".join(f"{k} {n}" for k, n in invalid["by_kind"].items())
    return f"{invalid['total']} invalid events left out of every figure and view: {kinds}"


def _ms(us: float) -> float:
    return round(us / 1000.0, 4)


Span = tuple[str, float, float]  # (annotation name, start us, end us) on the trace clock


@dataclass
class ActivityTable:
    """The GPU activities of one trace, one row per activity (kernel, memcpy, memset), in trace order.

    Built once by :meth:`KernelTraceAnalyzer.activity_table`; every question function of this module
    reads it. Arrays have length ``n`` (times in us on the trace clock).

    Attributes:
        names: unique activity names; ``name_idx[i]`` indexes it.
        name_idx: per activity, index into ``names``.
        kind: int64, index into :data:`GPU_ACTIVITY_CATS`.
        ts, dur, end: float64 start, duration and end (us).
        dev: int64 device (trace ``pid``), -1 when absent.
        corr, ext: ``correlation`` and ``External id`` per activity (-1 when absent).
        launch: float64 start (us) of the launching CUDA API call, NaN when not in the trace.
        category: :func:`~sftprof.analysis.kernel_names.kernel_category`, ``optimizer`` for non-collective
            kernels launched inside ``sftprof/optimizer_step``.
        is_comm: bool, NCCL kernel.
        group: parallelism label of a collective's process group (None when unknown or not a collective).
        pg_name: the process group's name as the trace records it (``Process Group Name``; the same on every
            member rank, so it identifies the group across the ranks' traces), None when unknown.
        nbytes: float64 bytes of memcpy/memset activities (0 when not given).
    """

    names: list[str]
    name_idx: list[int]
    kind: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    end: np.ndarray
    dev: np.ndarray
    corr: list[int]
    ext: list[int]
    launch: np.ndarray
    category: list[str]
    is_comm: np.ndarray
    group: list[str | None]
    pg_name: list[str | None]
    nbytes: np.ndarray

    @property
    def n(self) -> int:
        """Number of activities."""
        return len(self.name_idx)

    def labels(self) -> list[str]:
        """Category per activity, collectives with their group: ``NCCL AllReduce [TP]``."""
        return [f"{c} [{g}]" if self.is_comm[i] and g else c for i, (c, g) in enumerate(zip(self.category, self.group))]


class KernelTraceAnalyzer:
    """Accumulates what the kernel summary needs from a stream of Chrome-trace events.

    Args:
        header: the trace's top-level members (``distributedInfo.pg_config`` maps process-group
            names to descriptions such as ``TENSOR_MODEL_PARALLEL_GROUP``); may also be given later
            via :meth:`set_header`, any time before :meth:`summary`.
    """

    def __init__(self, header: dict | None = None):
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        # per GPU activity (parallel lists)
        self._a_name: list[int] = []
        self._a_kind: list[int] = []  # index into GPU_ACTIVITY_CATS
        self._a_ts: list[float] = []
        self._a_dur: list[float] = []
        self._a_dev: list[int] = []
        self._a_corr: list[int] = []
        self._a_ext: list[int] = []
        self._a_pg: list = []  # process-group (desc, name) from the kernel's own args
        self._comm_ops: dict[int, tuple] = {}  # External id -> process group (desc, name) of a collective op
        self._host_comm: list[tuple[str, float, float]] = []  # gloo:/nccl: collective ops on the host
        self._regions: list[tuple[str, float, float]] = []  # sftprof/* user annotations
        self._profiler_steps: list[tuple[str, float, float]] = []
        self._t_min = float("inf")
        self._t_max = float("-inf")
        self.n_events = 0
        self._pg_desc: dict[str, str] = {}
        self._pg_ranks: dict[str, Any] = {}  # process-group name -> its members as an event's args give them
        self._pg_header_ranks: dict[str, list[int]] = {}  # ... as the header's pg_config gives them
        self._cpu_us: dict[str, float] = defaultdict(float)  # cpu_op name -> inclusive time (us)
        self._cpu_calls: dict[str, int] = defaultdict(int)
        self._invalid: dict[str, int] = defaultdict(int)
        self._invalid_examples: list[str] = []
        self._notes: dict[str, int] = {}
        self._a_bytes: list[int] = []  # bytes of memcpy/memset activities (0 when not given)
        self._ops = step_breakdown.OpCollector()
        self._device_name: str | None = None
        self._base_ns: int | None = None  # trace ts (us) + base_ns / 1000 = unix us
        self._recorded_rank: int | None = None  # the header's distributedInfo.rank
        if header:
            self.set_header(header)

    def set_header(self, header: dict) -> None:
        """Read process-group descriptions and members from ``header['distributedInfo']['pg_config']``, and the
        rank that wrote the trace from ``header['distributedInfo']['rank']``.

        A ``distributedInfo`` or ``pg_config`` of another type (a damaged header) is ignored: collectives
        are then labelled by the process-group names their own events carry.
        """
        base = header.get("baseTimeNanoseconds") if isinstance(header, dict) else None
        if isinstance(base, int) and not isinstance(base, bool):
            self._base_ns = base
        props = header.get("deviceProperties") if isinstance(header, dict) else None
        if isinstance(props, list) and props and isinstance(props[0], dict) and isinstance(props[0].get("name"), str):
            self._device_name = props[0]["name"]
        info = header.get("distributedInfo") if isinstance(header, dict) else None
        rank = info.get("rank") if isinstance(info, dict) else None
        self._recorded_rank = rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None
        pgs = info.get("pg_config") if isinstance(info, dict) else None
        for pg in pgs if isinstance(pgs, list) else ():
            if isinstance(pg, dict) and "pg_name" in pg:
                desc = pg.get("pg_desc")
                self._pg_desc[str(pg["pg_name"])] = desc if isinstance(desc, str) else None
                ranks, size = pg.get("ranks"), pg.get("pg_size", pg.get("group_size"))
                world = info.get("world_size")
                if ranks == [] and isinstance(size, int) and size == world:  # torch writes [] for "every rank"
                    ranks = list(range(world))
                if _rank_list(ranks):
                    self._pg_header_ranks[str(pg["pg_name"])] = ranks

    def pg_members(self) -> dict[str, list[int]]:
        """Global ranks of each process group, by name: the ``Process Group Ranks`` its events carry (a JSON list
        such as ``"[0, 1]"``), else the header's ``pg_config``; a group whose list is cut short or unreadable
        (torch shortens long lists) is left out."""
        out = dict(self._pg_header_ranks)
        for name, raw in self._pg_ranks.items():
            try:
                ranks = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                continue
            if _rank_list(ranks):
                out[name] = ranks
        return out
    def add_invalid(self, kind: str, raw: str) -> None:
        """Count one event left out of every figure (``kind`` from ``trace_check.event_problem``)."""
        self._invalid[kind] += 1
        if len(self._invalid_examples) < _INVALID_EXAMPLES:
            self._invalid_examples.append(f"{kind}: {' '.join(raw.split())[:200]}")

    def add_note(self, what: str, count: int) -> None:
        """Record a repair of the views that changes no figure (e.g. non-finite numbers written as null)."""
        self._notes[what] = count

    @staticmethod
    def _pg_ref(args: dict) -> tuple[str | None, str | None] | None:
        """(description, name) of the process group named in an event's args, if any."""
        name, desc = args.get("Process Group Name"), args.get("Process Group Description")
        if name is None and desc is None:
            return None
        return desc if isinstance(desc, str) else None, None if name is None else str(name)

    def _pg_label(self, ref: tuple[str | None, str | None] | None) -> str | None:
        if ref is None:
            return None
        desc, name = ref
        return collective_group_label(desc or self._pg_desc.get(name), name)

    def add(self, ev: dict) -> None:
        """Consume one usable trace event (any phase/category; irrelevant ones are ignored cheaply).

        Events that ``sftprof.analysis.trace_check.event_problem`` rejects go to :meth:`add_invalid`
        instead (``split_trace`` does this), so that no figure includes them.
        """
        self.n_events += 1
        ph = ev.get("ph")
        if ph != "X":
            if ph in ("s", "f") and ev.get("cat") == "fwdbwd" and isinstance(ev.get("ts"), (int, float)):
                self._ops.add(ev, ev["ts"], 0.0)
            return
        ts = ev.get("ts")
        dur = ev.get("dur")
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            return
        self._ops.add(ev, ts, dur)
        if ts < self._t_min:
            self._t_min = ts
        if ts + dur > self._t_max:
            self._t_max = ts + dur
        cat = ev.get("cat")
        if cat in GPU_ACTIVITY_CATS:
            name = ev.get("name") or ""
            idx = self._names.get(name)
            if idx is None:
                idx = self._names[name] = len(self._name_list)
                self._name_list.append(name)
            args = ev.get("args") or {}
            self._a_name.append(idx)
            self._a_kind.append(GPU_ACTIVITY_CATS.index(cat))
            self._a_ts.append(ts)
            self._a_dur.append(dur)
            dev = ev.get("pid")
            self._a_dev.append(dev if isinstance(dev, int) else -1)
            self._a_corr.append(_int_id(args.get("correlation")))
            self._a_ext.append(_int_id(args.get("External id")))
            self._a_pg.append(self._pg_ref(args))
            if "Process Group Ranks" in args and "Process Group Name" in args:
                self._pg_ranks.setdefault(str(args["Process Group Name"]), args["Process Group Ranks"])
            nb = args.get("bytes")
            self._a_bytes.append(nb if isinstance(nb, int) and not isinstance(nb, bool) and nb > 0 else 0)
        elif cat == "user_annotation":
            name = ev.get("name") or ""
            if name.startswith(REGION_PREFIX):
                self._regions.append((name, ts, ts + dur))
            elif name.startswith("ProfilerStep#"):
                self._profiler_steps.append((name, ts, ts + dur))
            elif name.startswith(HOST_COLLECTIVE_PREFIXES):
                self._host_comm.append((name, ts, ts + dur))
        elif cat == "cpu_op":
            name = ev.get("name") or ""
            self._cpu_us[name] += dur
            self._cpu_calls[name] += 1
            if name.startswith(HOST_COLLECTIVE_PREFIXES):
                self._host_comm.append((name, ts, ts + dur))
            args = ev.get("args")
            if args and ("Process Group Name" in args or "Process Group Description" in args):
                ext = _int_id(args.get("External id"))
                if ext != -1:
                    self._comm_ops[ext] = self._pg_ref(args)
                if "Process Group Ranks" in args and "Process Group Name" in args:
                    self._pg_ranks.setdefault(str(args["Process Group Name"]), args["Process Group Ranks"])

    def activity_table(self, regions: list[Span]) -> ActivityTable:
        """The collected GPU activities as an :class:`ActivityTable` (``regions``: the sorted ``sftprof/*`` spans)."""
        n = len(self._a_ts)
        kinds = np.asarray(self._a_kind, dtype=np.int64)
        launch = self._ops.launch_points(self._a_corr)[1]
        # Category per activity: by name (cached per unique name/kind), then optimizer-region override.
        cat_cache: dict[tuple[int, int], str] = {}
        cats: list[str] = []
        for i in range(n):
            key = (self._a_name[i], self._a_kind[i])
            c = cat_cache.get(key)
            if c is None:
                c = cat_cache[key] = kernel_category(self._name_list[key[0]], GPU_ACTIVITY_CATS[key[1]])
            cats.append(c)
        is_comm = np.array([c.startswith(COMM_PREFIX) for c in cats], dtype=bool)
        opt = [r for r in regions if r[0] == OPTIMIZER_REGION]
        if opt and n:
            in_opt = np.zeros(n, dtype=bool)
            for _, lo, hi in opt:
                in_opt |= (launch >= lo) & (launch <= hi)
            for i in np.flatnonzero(in_opt & ~is_comm & (kinds == 0)):
                cats[i] = "optimizer"
        groups: list[str | None] = []
        pg_names: list[str | None] = []
        for i in range(n):
            ref = self._a_pg[i]
            if ref is None and is_comm[i]:
                ref = self._comm_ops.get(self._a_ext[i])
            groups.append(self._pg_label(ref))
            pg_names.append(ref[1] if ref is not None else None)
        ts = np.asarray(self._a_ts, dtype=np.float64)
        dur = np.asarray(self._a_dur, dtype=np.float64)
        return ActivityTable(names=self._name_list, name_idx=self._a_name, kind=kinds, ts=ts, dur=dur, end=ts + dur,
                             dev=np.asarray(self._a_dev, dtype=np.int64), corr=self._a_corr, ext=self._a_ext,
                             launch=launch, category=cats, is_comm=is_comm, group=groups, pg_name=pg_names,
                             nbytes=np.asarray(self._a_bytes, dtype=np.float64))

    def summary(self) -> KernelSummary:
        """Kernel summary (:class:`sftprof.analysis.schema.KernelSummary`; times in ms, shares in percent).

        Keys: ``n_events``, ``invalid_events``, ``view_repairs``, ``identity`` (what the trace says of itself:
        ``{"profiler_steps": [N, ...], "recorded_rank": r}``, the sorted steps of its ``ProfilerStep#N`` slices and
        its header's ``distributedInfo.rank``, None without one; :func:`identity_problems` checks them against
        the file name's rank and the step postprocessed), ``step_window`` (:func:`step_window`),
        ``gpu`` (:func:`gpu_time`), ``top_kernels`` (:func:`top_kernels`), ``top_cpu_ops``
        (:func:`top_cpu_ops`), ``categories`` (:func:`time_by_category`), ``communication``
        (:func:`communication`), ``regions`` (:func:`region_times`), in a trace without GPU activity ``cpu_parts``
        and ``heaviest_op`` (:mod:`sftprof.analysis.cpu_parts`; None otherwise), and the step breakdown's ``parts``,
        ``host``, ``efficiency``, ``collectives`` (:func:`sftprof.analysis.step_breakdown.analyze`).
        """
        regions = sorted(self._regions, key=lambda r: (r[1], r[0]))
        table = self.activity_table(regions)
        window = step_window(table, regions, self._profiler_steps, (self._t_min, self._t_max), self._base_ns)
        lo, hi = window["start_us"], window["end_us"]
        optimizer_windows = [(a, b) for name, a, b in regions if name == OPTIMIZER_REGION]
        details = step_breakdown.analyze(
            self._ops, ts=table.ts, dur=table.dur, devs=table.dev, corr=table.corr, ext=table.ext,
            cats=table.category, is_comm=table.is_comm, groups=table.group, pg_names=table.pg_name,
            pg_members=self.pg_members(),
            names=[table.names[k] for k in table.name_idx], kinds=table.kind, nbytes=table.nbytes, window=(lo, hi),
            optimizer_windows=optimizer_windows, device_name=self._device_name)
        cpu_run = not table.n  # no GPU activity: the CPU ops are the work
        return {
            "n_events": self.n_events,
            "invalid_events": {"total": sum(self._invalid.values()), "valid_events": self.n_events,
                               "by_kind": dict(sorted(self._invalid.items(), key=lambda kv: (-kv[1], kv[0]))),
                               "examples": list(self._invalid_examples)},
            "view_repairs": dict(sorted(self._notes.items())),
            "identity": {"profiler_steps": sorted({int(m.group(1)) for name, _, _ in self._profiler_steps
                                                   if (m := _PROFILER_STEP.match(name))}),
                         "recorded_rank": self._recorded_rank},
            "step_window": window,
            "gpu": gpu_time(table, lo, hi),
            "top_kernels": top_kernels(table),
            "top_cpu_ops": top_cpu_ops(self._cpu_us, self._cpu_calls),
            "categories": time_by_category(table),
            "communication": communication(table, self._host_comm),
            "regions": region_times(table, regions, lo),
            "cpu_parts": cpu_parts(self._ops, (lo, hi), optimizer_windows) if cpu_run else None,
            "heaviest_op": heaviest_op(self._ops, (lo, hi)) if cpu_run else None,
            **details,
        }


# -- one function per question over the activity table -----------------------------------------------------
def step_window(table: ActivityTable, regions: list[Span], profiler_steps: list[Span],
                trace_span: tuple[float, float], base_ns: int | None) -> dict[str, Any]:
    """The step window (module docstring): ``{source, start_us, end_us, wall_ms, unix_start_s, unix_end_s}``.

    ``source`` is ``sftprof/step``, ``ProfilerStep``, ``gpu_activity_span``, ``trace_span`` or ``none``
    (then the times are None); a step annotation's window is extended to the end of the last activity
    launched inside it. ``unix_*_s`` use the header's ``baseTimeNanoseconds`` (None without it).
    """
    source, lo, hi = "none", None, None
    steps = [r for r in regions if r[0] == STEP_REGION]
    if steps:
        _, lo, hi = max(steps, key=lambda r: r[2] - r[1])
        source = STEP_REGION
    elif profiler_steps:
        _, lo, hi = max(profiler_steps, key=lambda r: r[2] - r[1])
        source = "ProfilerStep"
    elif table.n:
        lo, hi = float(table.ts.min()), float(table.end.max())
        source = "gpu_activity_span"
    elif trace_span[0] < trace_span[1]:
        lo, hi = trace_span
        source = "trace_span"
    if lo is not None and source in (STEP_REGION, "ProfilerStep") and table.n:
        launched = (table.launch >= lo) & (table.launch <= hi)
        if launched.any():
            hi = max(hi, float(table.end[launched].max()))
    unix = lo is not None and base_ns
    return {"source": source, "start_us": lo, "end_us": hi, "wall_ms": _ms(hi - lo) if lo is not None else None,
            "unix_start_s": (lo + base_ns / 1e3) / 1e6 if unix else None,
            "unix_end_s": (hi + base_ns / 1e3) / 1e6 if unix else None}


def gpu_time(table: ActivityTable, lo: float | None, hi: float | None) -> dict[str, Any]:
    """GPU time in the window ``[lo, hi]`` (us): ``{activities, total_ms, busy_ms, busy_share_pct, idle_share_pct}``.

    Busy = length of the union of all activity intervals (all streams) inside the window; the shares are
    None without a window.
    """
    gpu: dict[str, Any] = {"activities": table.n, "total_ms": _ms(float(table.dur.sum()))}
    if table.n and lo is not None and hi > lo:
        busy = length(*clip(union(table.ts, table.end), lo, hi))
        gpu.update(busy_ms=_ms(busy), busy_share_pct=round(100 * busy / (hi - lo), 3),
                   idle_share_pct=round(100 - 100 * busy / (hi - lo), 3))
    else:
        gpu.update(busy_ms=0.0, busy_share_pct=None, idle_share_pct=None)
    return gpu


def top_kernels(table: ActivityTable, limit: int = TOP_KERNELS) -> list[dict]:
    """The ``limit`` kernels (trace category ``kernel``) with the most GPU time: ``{name, calls, total_ms, share_pct}``.

    Shares are of the total GPU activity time (all activities); ties are ordered by name.
    """
    total_us = float(table.dur.sum())
    durs = table.dur.tolist()
    k_tot: dict[int, float] = defaultdict(float)
    k_calls: dict[int, int] = defaultdict(int)
    for i in np.flatnonzero(table.kind == 0):
        k_tot[table.name_idx[i]] += durs[i]
        k_calls[table.name_idx[i]] += 1
    top = sorted(k_tot.items(), key=lambda kv: (-kv[1], table.names[kv[0]]))[:limit]
    return [{"name": table.names[k], "calls": k_calls[k], "total_ms": _ms(t),
             "share_pct": round(100 * t / total_us, 3) if total_us else 0.0} for k, t in top]


def time_by_category(table: ActivityTable) -> list[dict]:
    """GPU time per category (:meth:`ActivityTable.labels`): ``{category, calls, total_ms, share_pct}``, sums to 100 %."""
    total_us = float(table.dur.sum())
    c_tot: dict[str, float] = defaultdict(float)
    c_calls: dict[str, int] = defaultdict(int)
    for lab, d in zip(table.labels(), table.dur.tolist()):
        c_tot[lab] += d
        c_calls[lab] += 1
    return [{"category": c, "calls": c_calls[c], "total_ms": _ms(t),
             "share_pct": round(100 * t / total_us, 3) if total_us else 0.0}
            for c, t in sorted(c_tot.items(), key=lambda kv: (-kv[1], kv[0]))]


def communication(table: ActivityTable, host_comm: list[Span]) -> dict[str, Any]:
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
    for i in np.flatnonzero(is_comm):
        d = float(end[i] - ts[i])
        by_type[table.category[i][len(COMM_PREFIX):]] += d
        by_group[table.group[i] or "unknown"] += d
    host_s = np.array([h[1] for h in host_comm], dtype=np.float64)
    host_e = np.array([h[2] for h in host_comm], dtype=np.float64)
    by_op: dict[str, float] = defaultdict(float)
    for name, h_lo, h_hi in host_comm:
        by_op[name] += h_hi - h_lo
    return {
        "kernels": int(is_comm.sum()),
        "total_ms": _ms(total),
        "hidden_ms": _ms(hidden),
        "exposed_ms": _ms(total - hidden),
        "by_type_ms": {k: _ms(v) for k, v in sorted(by_type.items())},
        "by_group_ms": {k: _ms(v) for k, v in sorted(by_group.items())},
        "host_ops": {"ops": len(host_comm), "wall_ms": _ms(length(*union(host_s, host_e))),
                     "by_op_ms": {k: _ms(v) for k, v in sorted(by_op.items())}},
    }


def region_times(table: ActivityTable, regions: list[Span], lo: float | None) -> list[dict]:
    """Per ``sftprof/*`` region: ``{name, start_ms (from the window start lo), cpu_ms, gpu_ms, gpu_activities}``.

    GPU time is the sum of the durations of the activities whose launching call lies inside the region
    (None when the trace has no GPU activity).
    """
    rows = []
    for name, r_lo, r_hi in regions:
        inside = (table.launch >= r_lo) & (table.launch <= r_hi)
        rows.append({
            "name": name,
            "start_ms": _ms(r_lo - lo) if lo is not None else None,
            "cpu_ms": _ms(r_hi - r_lo),
            "gpu_ms": _ms(float(table.dur[inside].sum())) if table.n else None,
            "gpu_activities": int(inside.sum()),
        })
    return rows


def top_cpu_ops(cpu_us: dict[str, float], cpu_calls: dict[str, int], limit: int = TOP_CPU_OPS) -> list[dict]:
    """The ``limit`` CPU ops with the most inclusive time (own time plus nested ops, whole trace, us in):
    ``{name, calls, inclusive_ms}``."""
    return [{"name": k, "calls": cpu_calls[k], "inclusive_ms": _ms(t)} for k, t in
            sorted(cpu_us.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]]
