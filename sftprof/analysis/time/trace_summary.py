"""Kernel summary of one rank's torch.profiler Chrome trace, computed in a single streaming pass.

Feed every usable event to :meth:`KernelTraceAnalyzer.add` and every invalid one (no time,
negative or non-finite ``dur``, ...) to :meth:`KernelTraceAnalyzer.add_invalid`
(``sftprof.analysis.views.split.split_trace`` does both while it writes the views), then call
:meth:`KernelTraceAnalyzer.summary`. Memory is O(number of GPU activities + CUDA API calls + flow events + CPU ops),
kept in arrays, never the events themselves: 73 bytes a GPU activity, 25 a CUDA API call and 24 a flow event until
the pass ends; the CPU ops, most of a trace's events, on disk with 1 byte an op in memory
(:mod:`sftprof.analysis.trace.op_store`), read back one time bucket at a time (bench/NOTES.md, "bounded memory of the
summary half").

The analyzer collects; each question is answered in its own module, and :meth:`KernelTraceAnalyzer.summary` puts
the answers together: the GPU activities alone (:mod:`sftprof.analysis.time.gpu_activity`: step window, GPU busy, top
kernels, categories, communication overlap, regions), time by model part (:mod:`sftprof.analysis.time.model_parts`),
host time and waits (:mod:`sftprof.analysis.time.host_time`), kernel efficiency
(:mod:`sftprof.analysis.time.efficiency`) and collectives by process group (:mod:`sftprof.analysis.time.collectives`),
the last four from where each activity was launched (:mod:`sftprof.analysis.trace.op_collector`).
"""
from __future__ import annotations

import json
import re
from array import array
from collections import defaultdict
from typing import Any

import numpy as np

from sftprof import artifacts
from sftprof.analysis.time.collectives import collectives
from sftprof.analysis.time.efficiency import kernel_efficiency
from sftprof.analysis.time.gpu_activity import (GPU_ACTIVITY_CATS, ActivityTable, Labels, Span, communication,
                                                gpu_time, region_times, step_window, time_by_category, top_kernels)
from sftprof.analysis.time.host_time import heaviest_op, host_time, top_cpu_ops
from sftprof.analysis.trace.kernel_names import (COMM_PREFIX, HOST_COLLECTIVE_PREFIXES, collective_group_label,
                                                  kernel_category)
from sftprof.analysis.time.model_parts import cpu_parts, gpu_parts
from sftprof.analysis.trace.op_collector import OpCollector
from sftprof.analysis.time.schema import KernelSummary
from sftprof.analysis.trace.schema import Identity, InvalidEvents
from sftprof.analysis.trace.check import UNTIMED
from sftprof.analysis.trace.sanity import inspect

__all__ = ["KernelTraceAnalyzer", "invalid_events_error", "invalid_events_message", "INVALID_SHARE_LIMIT",
           "BEGIN_END_NOTE", "UNPAIRED_NOTE",
           "identity_problems"]

INVALID_SHARE_LIMIT = 0.5  # a trace whose invalid events exceed this share of its events is an error
_INVALID_EXAMPLES = 3
REGION_PREFIX = artifacts.REGION_PREFIX
OPTIMIZER_REGION = artifacts.OPTIMIZER_STEP
_PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)$")
_CORRELATION = re.compile(r'"correlation"\s*:\s*(\d+)')
BEGIN_END_NOTE = "sftprof/* and ProfilerStep annotations written as B/E pairs, read as spans"
UNPAIRED_NOTE = "annotations written as B/E events without their pair, left out"
_GPU_CATEGORY = re.compile(r'"cat"\s*:\s*"(?:kernel|gpu_memcpy|gpu_memset|Kernel|Memcpy|Memset)"')


def _int_id(v: Any) -> int:
    """A correlation / External id as an int; -1 when absent, not an integer or outside int64."""
    return v if isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63 else -1


def _rank_list(v: Any) -> bool:
    """Whether ``v`` is a non-empty list of distinct global ranks (ints >= 0)."""
    return (isinstance(v, list) and bool(v)
            and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in v) and len(set(v)) == len(v))


def invalid_events_error(invalid: InvalidEvents) -> str | None:
    """The error of a trace whose invalid events dominate it (more than :data:`INVALID_SHARE_LIMIT`), else None."""
    total, events = invalid["total"], invalid["total"] + invalid["valid_events"]
    if total and total > INVALID_SHARE_LIMIT * events:
        return (f"{total} of {events} events are invalid ({invalid_events_message(invalid)}); "
                "the trace is not usable")
    return None


def identity_problems(identity: Identity, rank: int, step: int) -> tuple[str | None, str | None]:
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


def invalid_events_message(invalid: InvalidEvents) -> str:
    """``"3 invalid events left out of every figure and view: negative dur 2, missing ts 1"``."""
    kinds = ", ".join(f"{k} {n}" for k, n in invalid["by_kind"].items())
    return f"{invalid['total']} invalid events left out of every figure and view: {kinds}"


class KernelTraceAnalyzer:
    """Accumulates what the kernel summary needs from a stream of Chrome-trace events.

    Args:
        header: the trace's top-level members (``distributedInfo.pg_config`` maps process-group
            names to descriptions such as ``TENSOR_MODEL_PARALLEL_GROUP``); may also be given later
            via :meth:`set_header`, any time before :meth:`summary`.
        step: the profiled step: its ``ProfilerStep#<step>`` slice is the step window, and the activities and CPU
            ops of other steps' slices are left out (:mod:`sftprof.analysis.trace.sanity`); None: not known (the
            longest step annotation is the window, no step is left out).
    """

    def __init__(self, header: dict[str, Any] | None = None, step: int | None = None):
        self._step = step
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        # per GPU activity (parallel arrays: 73 bytes an activity)
        self._a_name = array("i")
        self._a_kind = array("b")  # index into GPU_ACTIVITY_CATS
        self._a_ts = array("d")
        self._a_dur = array("d")
        self._a_dev = array("q")
        self._a_stream = array("q")
        self._a_corr = array("q")
        self._a_ext = array("q")
        self._a_pg = array("i")  # index into _pg_refs: process-group (desc, name) from the kernel's own args; -1: none
        self._pg_refs: dict[tuple[str | None, str | None], int] = {}
        # External id -> process group (desc, name) of a collective op
        self._comm_ops: dict[int, tuple[str | None, str | None] | None] = {}
        self._host_comm: list[tuple[str, float, float]] = []  # gloo:/nccl: collective annotations on the host
        self._host_comm_ops: list[tuple[str, float, float]] = []  # ... and CPU ops
        self._regions: list[tuple[str, float, float]] = []  # sftprof/* user annotations
        self._profiler_steps: list[tuple[str, float, float]] = []
        # (pid, tid) -> B events not yet ended
        self._open_annotations: dict[tuple[Any, Any], list[tuple[str, float]]] = {}
        self._t_min = float("inf")
        self._t_max = float("-inf")
        self.n_events = 0
        self.n_metadata = 0  # of n_events: metadata (ph M: process and thread names)
        self._pg_desc: dict[str, str | None] = {}
        self._pg_ranks: dict[str, Any] = {}  # process-group name -> its members as an event's args give them
        self._pg_header_ranks: dict[str, list[int]] = {}  # ... as the header's pg_config gives them
        self._invalid: dict[str, int] = defaultdict(int)
        self._invalid_examples: list[str] = []
        self._untimed = 0  # GPU activities without timing (left out, counted with the invalid events)
        self._invalid_corr: list[int] = []  # correlation ids of the GPU activities left out as invalid
        self._notes: dict[str, int] = {}
        self._a_bytes = array("d")  # bytes of memcpy/memset activities (0 when not given)
        self._ops = OpCollector()
        self._device_name: str | None = None
        self._base_ns: int | None = None  # trace ts (us) + base_ns / 1000 = unix us
        self._recorded_rank: int | None = None  # the header's distributedInfo.rank
        if header:
            self.set_header(header)

    def set_header(self, header: dict[str, Any]) -> None:
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
        if not isinstance(info, dict):
            info = {}
        rank = info.get("rank")
        self._recorded_rank = rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None
        pgs = info.get("pg_config")
        for pg in pgs if isinstance(pgs, list) else ():
            if isinstance(pg, dict) and "pg_name" in pg:
                desc = pg.get("pg_desc")
                self._pg_desc[str(pg["pg_name"])] = desc if isinstance(desc, str) else None
                ranks: Any = pg.get("ranks")
                size = pg.get("pg_size", pg.get("group_size"))
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
    def no_events_error(self) -> str | None:
        """After the pass: the error of a trace that holds no events but metadata (``ph: M``), none left out as
        invalid either (``{"traceEvents": []}``): nothing to summarise or view (views of it would replace an earlier
        postprocess's with empty ones); None otherwise."""
        if self.n_events > self.n_metadata or any(self._invalid.values()):
            return None
        if not self.n_events:
            return "the trace holds no events (its traceEvents array is empty)"
        return f"the trace holds no events, only {self.n_metadata} metadata events (ph M)"

    def add_invalid(self, kind: str, raw: str) -> None:
        """Count one event left out of every figure (``kind`` from ``trace_check.event_problem``)."""
        self._invalid[kind] += 1
        self._untimed += kind == UNTIMED
        if _GPU_CATEGORY.search(raw):  # a GPU activity left out: its launch is not one without a kernel
            corr = _CORRELATION.search(raw)
            self._invalid_corr.append(int(corr.group(1)) if corr else -1)
        if len(self._invalid_examples) < _INVALID_EXAMPLES:
            self._invalid_examples.append(f"{kind}: {' '.join(raw.split())[:200]}")

    def add_note(self, what: str, count: int) -> None:
        """Record a repair of the views that changes no figure (e.g. non-finite numbers written as null)."""
        self._notes[what] = count

    @staticmethod
    def _pg_ref(args: dict[str, Any]) -> tuple[str | None, str | None] | None:
        """(description, name) of the process group named in an event's args, if any."""
        name, desc = args.get("Process Group Name"), args.get("Process Group Description")
        if name is None and desc is None:
            return None
        return desc if isinstance(desc, str) else None, None if name is None else str(name)

    def _pg_label(self, ref: tuple[str | None, str | None] | None) -> str | None:
        if ref is None:
            return None
        desc, name = ref
        return collective_group_label(desc or (self._pg_desc.get(name) if name is not None else None), name)

    def add(self, ev: dict[str, Any]) -> None:
        """Consume one usable trace event (any phase/category; irrelevant ones are ignored cheaply).

        Events that ``sftprof.analysis.trace.check.event_problem`` rejects go to :meth:`add_invalid`
        instead (``split_trace`` does this), so that no figure includes them.
        """
        self.n_events += 1
        ph = ev.get("ph")
        cat = ev.get("cat")
        if ph != "X":
            if ph in ("s", "f") and cat == "fwdbwd" and isinstance(ev.get("ts"), (int, float)):
                self._ops.add(ev, cat, ev["ts"], 0.0)
            elif ph in ("B", "E") and cat == "user_annotation":
                self._begin_end(ev, ph)
            elif ph == "M":
                self.n_metadata += 1
            return
        ts = ev.get("ts")
        dur = ev.get("dur")
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            return
        if ts < self._t_min:
            self._t_min = ts
        if ts + dur > self._t_max:
            self._t_max = ts + dur
        if cat == "cpu_op":  # most events: the collector's hot path, each member read once
            tid, name, args = ev.get("tid"), ev.get("name") or "", ev.get("args")
            self._ops.add_cpu_op(tid if type(tid) is int else -1, name, args, ts, dur)
            if name.startswith(HOST_COLLECTIVE_PREFIXES):
                self._host_comm_ops.append((name, ts, ts + dur))
            if args and ("Process Group Name" in args or "Process Group Description" in args):
                ext = _int_id(args.get("External id"))
                if ext != -1:
                    self._comm_ops[ext] = self._pg_ref(args)
                if "Process Group Ranks" in args and "Process Group Name" in args:
                    self._pg_ranks.setdefault(str(args["Process Group Name"]), args["Process Group Ranks"])
            return
        self._ops.add(ev, cat, ts, dur)
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
            dev, stream = ev.get("pid"), ev.get("tid")
            self._a_dev.append(dev if isinstance(dev, int) else -1)
            self._a_stream.append(stream if isinstance(stream, int) else -1)
            self._a_corr.append(_int_id(args.get("correlation")))
            self._a_ext.append(_int_id(args.get("External id")))
            ref = self._pg_ref(args)
            self._a_pg.append(-1 if ref is None else self._pg_refs.setdefault(ref, len(self._pg_refs)))
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

    def _begin_end(self, ev: dict[str, Any], ph: str) -> None:
        """An annotation written as a ``B``/``E`` pair (its thread's last open ``B`` ends at an ``E``): a
        ``sftprof/*`` region or ``ProfilerStep#<N>`` read as the span it is, counted in the summary's notes
        (:data:`BEGIN_END_NOTE`); an ``E`` without its ``B``, or a ``B`` never ended, is counted as left out
        (:data:`UNPAIRED_NOTE`)."""
        stack = self._open_annotations.setdefault((ev.get("pid"), ev.get("tid")), [])
        if ph == "B":
            stack.append((ev.get("name") or "", ev["ts"]))
            return
        if not stack:
            self._notes[UNPAIRED_NOTE] = self._notes.get(UNPAIRED_NOTE, 0) + 1
            return
        name, ts = stack.pop()
        spans = (self._regions if name.startswith(REGION_PREFIX) else
                 self._profiler_steps if name.startswith("ProfilerStep#") else None)
        if spans is not None:
            spans.append((name, ts, ev["ts"]))
            self._notes[BEGIN_END_NOTE] = self._notes.get(BEGIN_END_NOTE, 0) + 1

    def activity_table(self, regions: list[Span]) -> ActivityTable:
        """The collected GPU activities as an :class:`ActivityTable` (``regions``: the sorted ``sftprof/*`` spans)."""
        n = len(self._a_ts)
        kinds = np.frombuffer(self._a_kind, dtype=np.int8)
        corr = np.frombuffer(self._a_corr, dtype=np.int64)
        launch_tid, launch = self._ops.launch_points(corr)
        # Category per activity: by name (once per name and kind met), then the optimizer-region override.
        width = len(GPU_ACTIVITY_CATS)
        key = np.frombuffer(self._a_name, dtype=np.int32).astype(np.intp) * width
        key += kinds
        cat_index: dict[str, int] = {}
        lut = np.zeros(len(self._name_list) * width, dtype=np.int32)
        for k in np.flatnonzero(np.bincount(key, minlength=lut.size)).tolist():
            lut[k] = cat_index.setdefault(kernel_category(self._name_list[k // width], GPU_ACTIVITY_CATS[k % width]),
                                          len(cat_index))
        cats = lut[key]
        del key, lut
        is_comm = np.array([c.startswith(COMM_PREFIX) for c in cat_index], dtype=bool)[cats]
        opt = [r for r in regions if r[0] == OPTIMIZER_REGION]
        if opt and n:
            in_opt = np.zeros(n, dtype=bool)
            for _, lo, hi in opt:
                in_opt |= (launch >= lo) & (launch <= hi)
            in_opt &= ~is_comm & (kinds == 0)
            if in_opt.any():
                cats[in_opt] = cat_index.setdefault("optimizer", len(cat_index))
        # Process group per activity: its own args', else (an NCCL kernel) its External id's collective op's.
        group_index: dict[str, int] = {}
        name_index: dict[str, int] = {}

        def codes(ref: tuple[str | None, str | None] | None) -> tuple[int, int]:
            label, name = self._pg_label(ref), ref[1] if ref is not None else None
            return (-1 if label is None else group_index.setdefault(label, len(group_index)),
                    -1 if name is None else name_index.setdefault(name, len(name_index)))

        by_ref = np.array([codes(ref) for ref in self._pg_refs] + [(-1, -1)], dtype=np.int32).T  # last: no ref
        pg = np.frombuffer(self._a_pg, dtype=np.int32)
        groups, pg_names = by_ref[0][pg], by_ref[1][pg]
        by_op = np.flatnonzero((pg < 0) & is_comm)
        for i, ext in zip(by_op.tolist(), np.frombuffer(self._a_ext, dtype=np.int64)[by_op].tolist()):
            groups[i], pg_names[i] = codes(self._comm_ops.get(ext))
        ts = np.frombuffer(self._a_ts, dtype=np.float64)
        dur = np.frombuffer(self._a_dur, dtype=np.float64)
        return ActivityTable(names=self._name_list, name_idx=np.frombuffer(self._a_name, dtype=np.int32), kind=kinds,
                             ts=ts, dur=dur, end=ts + dur, dev=np.frombuffer(self._a_dev, dtype=np.int64),
                             stream=np.frombuffer(self._a_stream, dtype=np.int64), corr=corr,
                             ext=np.frombuffer(self._a_ext, dtype=np.int64),
                             launch_tid=launch_tid, launch=launch, category=Labels(list(cat_index), cats),
                             is_comm=is_comm, group=Labels(list(group_index), groups),
                             pg_name=Labels(list(name_index), pg_names),
                             nbytes=np.frombuffer(self._a_bytes, dtype=np.float64))

    def summary(self) -> KernelSummary:
        """Kernel summary (:class:`sftprof.analysis.time.schema.KernelSummary`; times in ms, shares in percent).

        Call it once (it sets the collected record right in place and frees the launch table once read). Keys:
        ``n_events``, ``invalid_events``, ``sanity`` (what is wrong with the trace's record and what was done about it,
        before any figure: :func:`sftprof.analysis.trace.sanity.inspect`), ``view_repairs``, ``identity`` (what the
        trace says of itself: ``{"profiler_steps": [N, ...], "recorded_rank": r}``, the sorted steps of its
        ``ProfilerStep#N`` slices and its header's ``distributedInfo.rank``, None without one; :func:`identity_problems`
        checks them against the file name's rank and the step postprocessed), ``step_window``, ``gpu``, ``top_kernels``,
        ``categories``, ``communication``, ``regions`` (:mod:`sftprof.analysis.time.gpu_activity`), ``parts`` and, in a
        trace without GPU activity, ``cpu_parts`` (:mod:`sftprof.analysis.time.model_parts`; None otherwise), ``host``,
        ``top_cpu_ops`` and, without GPU activity, ``heaviest_op`` (:mod:`sftprof.analysis.time.host_time`),
        ``efficiency`` (:mod:`sftprof.analysis.time.efficiency`) and ``collectives``
        (:mod:`sftprof.analysis.time.collectives`; its ``calls``, this rank's call timeline per process group, is
        matched across ranks by the trial summary and left out of ``profile_summary.json``).
        """
        self._ops.end_pass()
        never_ended = sum(len(v) for v in self._open_annotations.values())
        if never_ended:
            self._notes[UNPAIRED_NOTE] = self._notes.get(UNPAIRED_NOTE, 0) + never_ended
        # annotations recorded twice count once; those of other profiler steps are left out with their activities
        regions, profiler_steps = list(dict.fromkeys(self._regions)), list(dict.fromkeys(self._profiler_steps))
        host_comm, gc_spans = list(dict.fromkeys(self._host_comm)), list(dict.fromkeys(self._ops.gc_spans))
        repeated = (len(self._regions) + len(self._profiler_steps) + len(self._host_comm) + len(self._ops.gc_spans)
                    - len(regions) - len(profiler_steps) - len(host_comm) - len(gc_spans))
        self._ops.gc_spans = gc_spans
        host_comm += dict.fromkeys(self._host_comm_ops)  # CPU ops recorded twice are counted with the CPU ops
        regions.sort(key=lambda r: (r[1], r[0]))
        t, sanity, other_spans = inspect(self.activity_table(regions), self._ops, profiler_steps=profiler_steps,
                                         step=self._step, untimed=self._untimed, invalid_corr=self._invalid_corr,
                                         repeated_annotations=repeated, n_events=self.n_events)
        self._ops.drop_launches()  # read by the activity table and the sanity check: not kept through the questions
        regions = [r for r in regions if not any(a <= r[1] <= b for a, b in other_spans)]
        host_comm = [h for h in host_comm if not any(a <= h[1] <= b for a, b in other_spans)]
        window = step_window(t, regions, profiler_steps, (self._t_min, self._t_max), self._base_ns, self._step)
        lo, hi = window["start_us"], window["end_us"]
        optimizer_windows = [(a, b) for name, a, b in regions if name == OPTIMIZER_REGION]
        pts = t.launch
        if lo is None:
            inside = np.zeros(t.n, dtype=bool)
        else:  # launched in the window; without a launch record (cut off): started in it
            inside = np.where(np.isnan(pts), (t.ts >= lo) & (t.ts <= hi), (pts >= lo) & (pts <= hi))
        in_opt = np.zeros(t.n, dtype=bool)
        for a, b in optimizer_windows:
            in_opt |= (pts >= a) & (pts <= b)
        ops = self._ops
        place = ops.attribute(t.launch_tid, pts, t.category, in_opt, t.is_comm)
        cpu_run = not t.n  # no GPU activity: the CPU ops are the work
        # host time, which reads the CPU ops back bucket by bucket, goes last: the heap its blocks leave behind is
        # not reused by the later questions' per-activity arrays (bench/NOTES.md, twenty-seventh session)
        efficiency = kernel_efficiency(ops, place, tids=t.launch_tid, pts=pts, dur=t.dur, inside=inside, kinds=t.kind,
                                       names=t.names, name_idx=t.name_idx, nbytes=t.nbytes,
                                       device_name=self._device_name)
        coll = collectives(ops, ts=t.ts, dur=t.dur, devs=t.dev, inside=inside, is_comm=t.is_comm, groups=t.group,
                           ext=t.ext, pg_names=t.pg_name, pg_members=self.pg_members())
        return {
            "n_events": self.n_events,
            "invalid_events": {"total": sum(self._invalid.values()), "valid_events": self.n_events,
                               "by_kind": dict(sorted(self._invalid.items(), key=lambda kv: (-kv[1], kv[0]))),
                               "examples": list(self._invalid_examples)},
            "sanity": sanity,
            "view_repairs": dict(sorted(self._notes.items())),
            "identity": {"profiler_steps": sorted({int(m.group(1)) for name, _, _ in profiler_steps
                                                   if (m := _PROFILER_STEP.match(name))}),
                         "recorded_rank": self._recorded_rank},
            "step_window": window,
            "gpu": gpu_time(t, lo, hi),
            "top_kernels": top_kernels(t),
            "top_cpu_ops": top_cpu_ops(ops),
            "categories": time_by_category(t),
            "communication": communication(t, host_comm),
            "regions": region_times(t, regions, lo),
            "parts": gpu_parts(place, t.dur, inside, t.is_comm),
            "cpu_parts": cpu_parts(ops, (lo, hi), optimizer_windows) if cpu_run else None,
            "heaviest_op": heaviest_op(ops, (lo, hi)) if cpu_run else None,
            "host": host_time(ops, place, ts=t.ts, dur=t.dur, tids=t.launch_tid, pts=pts, inside=inside,
                              window=(lo, hi)),
            "efficiency": efficiency,
            "collectives": coll,
        }
