"""Memory summary of one CUDA caching-allocator snapshot (``torch.cuda.memory._dump_snapshot``).

The snapshot holds the allocator state at dump time (``segments`` with their ``blocks``) and
the last ``max_entries`` allocator events per device (``device_traces``: ``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``/``segment_free``,
``segment_map``/``segment_unmap`` for expandable segments, each with ``addr``, ``size`` in
bytes, ``time_us`` on the ``time.time()`` clock and the stack ``frames``, innermost first).

Allocated bytes over the recorded window are replayed backwards from the final state
(allocated = sum of active blocks; ``alloc`` adds a block, ``free_completed`` removes it);
reserved bytes likewise from segment sizes and the segment events. This is the same
bookkeeping PyTorch's memory_viz uses for its "Active Memory Timeline". The blocks alive at
the allocated peak are found by walking from the final state back to the peak; they are
grouped by their innermost project-or-library Python frame (``file:line function``; PyTorch's
own frames and the standard library are skipped, C++ frames only name autograd nodes).

Device: a snapshot holds every device's segments the process touched (a ``torch.load`` without ``map_location``
puts tensors on cuda:0 from every rank); the summary is the rank's own device's, the others counted in ``devices``.

Phase attribution uses the ``phases_rank<r>.json`` sidecar written by the trainer
(``{"clock": "unix_us", "phases": [{"name", "start_us", "end_us"}]}``); a peak belongs to the
innermost (shortest) phase containing its time.

Which peak is "the peak": the allocator history is recorded from before the model is built
(``sftprof/capture/memory.py``), so the recorded window can hold model setup and the steps before
the profiled one, and its highest point may lie there. With a sidecar holding phases the summary's
headline peak (``peak_*``, ``top_sites``, ``categories_at_peak``, ...; ``peak_scope="profiled_step"``)
is the profiled step's own: the highest allocated level inside the step's window (``sftprof/step``,
else the span of the recorded phases), counting the level the step starts from. The highest point
of the whole recorded window is kept as ``window_peak_*`` with ``window_peak_position`` (``in_step``,
``before_step``, ``after_step``). Without a sidecar (or with no phases in it) the headline is the
window's peak (``peak_scope="recorded_window"``). :func:`peak_where` says where a peak lies in words.

When the history cannot give the profiled step's peak, the summary says why (``step_peak_unknown``, :func:`_history_
problem`) and reports what it can, never the level at dump time as a step's peak: a snapshot without allocator history
(segments, no trace entries) has only its level at dump time and its segments (``peak_scope="dump_time"``, no times);
one whose entries lack ``time_us`` has the recorded window's peak by the events' order, but no times
(``recorded_window``, the ``*_ms`` times None); one whose profiled step (from the phases sidecar) lies outside its
recorded history (another clock, or a history that does not reach the step) has the recorded window's peak, not
placed against the step. One whose history starts after the profiled step's start (cleared or re-enabled during
the step) has the step's peak as a lower bound, and says so (``step_peak_lower_bound``).

Above 500 lines for a reason: one snapshot's replay (levels, the blocks alive at a peak, the step's window and the
checks of its history and devices) works on one set of arrays built once.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Optional, TypedDict

import numpy as np

from sftprof import artifacts
from sftprof.analysis.memory.categories import allocation_site, categories
from sftprof.analysis.memory.schema import (AllocationRow, History, MemorySummary, MemoryStepWindow, SiteRow,
                                            SnapshotDevice, SpikeRow, WithoutLargestBlock)
from sftprof.analysis.trace.check import is_finite_number

__all__ = ["analyze_snapshot", "check_snapshot", "history_status", "other_devices_message", "peak_where", "TOP_SITES",
           "PEAK_SCOPES", "WINDOW_PEAK_POSITIONS"]

TOP_SITES = 20
TOP_ALLOCATIONS = 10
_GIB = float(2**30)
_ALLOCATED_STATES = ("active_allocated", "active_pending_free")
# A snapshot as torch.cuda.memory._snapshot() writes it (checked by check_snapshot): its events, blocks and frames are
# the unpickled dicts themselves
Event = dict[str, Any]
Frames = list[dict[str, Any]]


class _AliveAt(TypedDict):
    """What is allocated right after an event (:func:`_alive_at`)."""
    live_bytes: int
    top_sites: list[SiteRow]
    top_allocations: list[AllocationRow]
    categories: list[dict[str, Any]]  # sftprof.analysis.memory.categories.categories


def _spikes(trace: list[Event], lo_us: float, hi_us: float, limit: int = 5) -> list[SpikeRow]:
    """Largest short-lived allocations: blocks allocated at ``lo_us <= time_us <= hi_us`` and freed within the
    recorded window, by size. A block's ``lifetime_ms`` is its free minus alloc time.
    """
    born: dict[int, tuple[int, float, Frames]] = {}
    out: list[tuple[int, float, float, Frames]] = []  # bytes, lifetime us, alloc time us, frames
    for e in trace:
        a = e.get("action")
        if a == "alloc":
            born[e["addr"]] = (int(e.get("size", 0)), float(e.get("time_us", 0)), e.get("frames") or [])
        elif a == "free_completed" and e["addr"] in born:
            size, t0, frames = born.pop(e["addr"])
            if lo_us <= t0 <= hi_us:
                out.append((size, float(e.get("time_us", 0)) - t0, t0, frames))
    out.sort(key=lambda x: (-x[0], x[2]))
    return [{"bytes": size, "gib": round(size / _GIB, 4), "lifetime_ms": round(life / 1e3, 3),
             "site": allocation_site(frames)} for size, life, _, frames in out[:limit]]


def _devices(snapshot: dict[str, Any], own: int | None) -> list[SnapshotDevice]:
    """Per device the snapshot holds segments or allocator events of: ``{"device", "reserved_bytes",
    "allocated_bytes"}`` (at the dump) and ``trace_entries``; ``own`` (the rank's device; None: the one with the most
    reserved bytes, then events) first, even when the snapshot holds nothing of it, then the others by index."""
    traces = snapshot.get("device_traces") or []
    rows: dict[int, SnapshotDevice] = {}

    def row(d: int) -> SnapshotDevice:
        return rows.setdefault(d, {"device": d, "reserved_bytes": 0, "allocated_bytes": 0,
                                   "trace_entries": len(traces[d]) if d < len(traces) else 0})
    for seg in snapshot.get("segments") or []:
        r = row(seg.get("device", 0))
        r["reserved_bytes"] += seg.get("total_size", 0)
        r["allocated_bytes"] += sum(b["size"] for b in seg.get("blocks", []) if b.get("state") in _ALLOCATED_STATES)
    for d, t in enumerate(traces):
        if t:
            row(d)
    if own is None:
        own = max(sorted(rows), key=lambda d: (rows[d]["reserved_bytes"], rows[d]["trace_entries"])) if rows else 0
    first = row(own)
    return [first] + [rows[d] for d in sorted(rows) if d != own]


def _history_start_problem(times: np.ndarray, step: tuple[float, float, str], unrecorded: tuple[int, int]) -> str:
    """Why the profiled step's peak is a lower bound when the allocator history (``times``, unix us) starts after the
    step's start (``step``, :func:`_step_window`); ``unrecorded``: the blocks alive at the dump with no stack and no
    alloc event in the history, ``(count, bytes)``."""
    blocks = (f"; {unrecorded[0]} block(s) alive at the dump ({unrecorded[1] / _GIB:.3f} GiB) have no stack and no "
              "alloc event in it" if unrecorded[0] else "")
    return (f"the allocator history starts {(times[0] - step[0]) / 1e3:.3f} ms after the profiled step's start "
            f"({step[2]} at {step[0]:.0f} us in the phases sidecar, first recorded event at {times[0]:.0f} us)"
            f"{blocks}: "
            "the step's allocations before it were not recorded (the history cleared or re-enabled during the step, "
            "or a ring buffer that overflowed), so the step's peak is a lower bound: the highest level of the "
            "recorded part of the step")


def _innermost_phase(phases: list[dict[str, Any]], t_us: float) -> str | None:
    inside = [p for p in phases if p.get("start_us", np.inf) <= t_us <= p.get("end_us", -np.inf)]
    if not inside:
        return None
    name: str = min(inside, key=lambda p: (p["end_us"] - p["start_us"], p.get("name", "")))["name"]  # checked: a str
    return name


def _step_window(phases: list[dict[str, Any]]) -> tuple[float, float, str] | None:
    """``(start_us, end_us, source)`` of the profiled step: the ``sftprof/step`` phase(s) (``source`` that name),
    else the span of all recorded phases (``source`` ``"span of the recorded phases"``); None without phases."""
    if not phases:
        return None
    step = [p for p in phases if p["name"] == artifacts.STEP] or phases
    return (float(min(p["start_us"] for p in step)), float(max(p["end_us"] for p in step)),
            artifacts.STEP if step is not phases else "span of the recorded phases")


def _history_problem(times: np.ndarray, step: tuple[float, float, str] | None) -> str | None:
    """Why the allocator history (its events' ``times``, unix us, NaN where an event has none) cannot give the
    profiled step's peak (``step``: its window from the phases sidecar, :func:`_step_window`), or None when it can
    (or when no phases were recorded: then the summary is the recorded window's, as documented)."""
    n = times.size
    if not n:
        return ("the snapshot holds no allocator history: its segments (the allocator's state at dump time) but no "
                "trace entries (recorded without torch.cuda.memory._record_memory_history, or with max_entries=0), so "
                "no peak can be found: the figures are the level at the snapshot's dump")
    untimed = int(np.isnan(times).sum())
    if untimed:
        return (f"{untimed} of {n} allocator events have no time_us: the recorded window's peak is known from the "
                "events' order but not when it was, and the profiled step cannot be placed among the events, so its "
                "own peak is unknown")
    if step is not None and (step[1] < times[0] or step[0] > times[-1]):
        return (f"the profiled step ({step[2]}, {step[0]:.0f}-{step[1]:.0f} us in the phases sidecar) lies outside the "
                f"recorded allocator history ({times[0]:.0f}-{times[-1]:.0f} us): the sidecar's clock is not the "
                "history's, or the history does not reach the step; the profiled step's own peak is unknown, the "
                "figures are the recorded window's")
    return None


def _alive_at(trace: list[Event], final_blocks: dict[int, tuple[int, Frames]], peak_i: int,
              reserved_at: int) -> _AliveAt:
    """What is allocated right after event ``peak_i`` of ``trace`` (-1: before the first recorded event), walked
    back from the final state ``final_blocks`` (addr -> (bytes, frames)): ``live_bytes``, ``top_sites``,
    ``top_allocations`` and ``categories`` (with the slack against ``reserved_at`` bytes reserved then)."""
    live: dict[int, tuple[int, Optional[Frames]]] = dict(final_blocks)  # addr -> (size, frames or None)
    touched: set[int] = set()
    for e in reversed(trace[peak_i + 1:]):
        a = e.get("action")
        if a == "alloc":
            live.pop(e["addr"], None)
            touched.add(e["addr"])
        elif a == "free_completed":
            live[e["addr"]] = (int(e["size"]), None)
            touched.add(e["addr"])
    alloc_frames: dict[int, Frames] = {}  # blocks allocated inside the window and not yet freed
    for e in trace[:peak_i + 1]:
        a = e.get("action")
        if a == "alloc":
            alloc_frames[e["addr"]] = e.get("frames") or []
        elif a == "free_completed":
            alloc_frames.pop(e["addr"], None)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    allocations: list[tuple[int, str, int]] = []  # bytes, site, address
    for addr, (size, frames) in live.items():
        if addr in alloc_frames:
            frames = alloc_frames[addr]
        elif addr in touched or not frames:
            frames = None  # allocated before the first recorded event: its stack is unknown
        site = allocation_site(frames) if frames is not None else "<allocated before the recorded window>"
        by_site[site][0] += size
        by_site[site][1] += 1
        allocations.append((size, site, addr))
    live_total = sum(v[0] for v in by_site.values())
    top_sites: list[SiteRow] = [{"site": s, "bytes": b, "gib": round(b / _GIB, 4), "blocks": c,
                  "share_pct": round(100 * b / live_total, 3) if live_total else 0.0}
                 for s, (b, c) in sorted(by_site.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_SITES]]
    top_allocs: list[AllocationRow] = [{"bytes": s, "gib": round(s / _GIB, 4), "site": site}
                  for s, site, _ in sorted(allocations, key=lambda x: (-x[0], x[1], x[2]))[:TOP_ALLOCATIONS]]
    return {"live_bytes": live_total, "top_sites": top_sites, "top_allocations": top_allocs,
            "categories": categories(by_site, live_total, reserved_at)}


def _without_largest_block(trace: list[Event], allocated: np.ndarray, peak_i: int, lo: int, hi: int,
                           at_ms: Callable[[float], Optional[float]],
                           phase: Callable[[float], Optional[str]]) -> WithoutLargestBlock | None:
    """The highest allocated level after events ``lo..hi-1`` (the profiled step, or the whole window) with the
    largest block that was allocated in the recorded history and is alive after event ``peak_i`` taken out of its
    lifetime: the peak if that block were never allocated and the rest allocated as it did. None when no block
    allocated in the history is alive at the peak. Bytes; time in ms as :func:`analyze_snapshot`."""
    live: dict[int, tuple[int, int]] = {}  # addr -> (event index of its alloc, bytes)
    for i, e in enumerate(trace[:peak_i + 1]):
        if e.get("action") == "alloc":
            live[e["addr"]] = (i, int(e["size"]))
        elif e.get("action") == "free_completed":
            live.pop(e["addr"], None)  # check_snapshot: a free_completed event has its addr
    if not live:
        return None
    addr, (start, size) = max(live.items(), key=lambda kv: (kv[1][1], -kv[1][0]))
    end = next((j for j in range(peak_i + 1, len(trace))
                if trace[j].get("addr") == addr and trace[j].get("action") == "free_completed"), len(trace))
    without = allocated.copy()
    without[start:end] -= size
    idx = np.arange(max(lo, 0), hi)
    k = int(idx[np.argmax(without[idx])]) if idx.size else start
    t_us = float(trace[k].get("time_us", np.nan))
    return {"block_bytes": size, "block_gib": round(size / _GIB, 4),
            "block_site": allocation_site(trace[start].get("frames") or []),
            "peak_allocated_bytes": int(without[k]), "peak_allocated_gib": round(int(without[k]) / _GIB, 4),
            "peak_time_ms": at_ms(t_us) if np.isfinite(t_us) else None, "peak_phase": phase(t_us)}


PEAK_SCOPES = {"profiled_step": "the profiled step's peak", "recorded_window": "the recorded window's peak",
               "dump_time": "the level at the snapshot's dump (no allocator history, no peak)"}
WINDOW_PEAK_POSITIONS = {
    "in_step": None,  # worded by its phase
    "before_step": "before the profiled step (model setup or earlier steps in the recorded history)",
    "after_step": "after the profiled step (before the snapshot was taken)",
}
_IN_STEP_NO_PHASE = "in the profiled step, outside its recorded phases"
_NO_PHASES = "in the recorded window, with no phases recorded"
_AT_DUMP = "at the snapshot's dump: no allocator history, so no peak is known"
_STEP_UNKNOWN = "in the recorded window; the profiled step's own peak is unknown"


def peak_where(summary: Mapping[str, Any], which: str = "peak") -> str:
    """Where a peak of :func:`analyze_snapshot`'s summary lies, in words (never ``None`` or ``?``).

    Args:
        summary: an :func:`analyze_snapshot` output (also one of an older sftprof, without ``peak_scope``).
        which: ``"peak"`` (the headline peak) or ``"window"`` (the whole recorded window's peak).

    Returns:
        ``"in <phase>"``; ``"in the profiled step, outside its recorded phases"``; for the window's peak
        :data:`WINDOW_PEAK_POSITIONS`' words when it lies outside the profiled step; without phases
        ``"in the recorded window, with no phases recorded"``; for a summary of an older sftprof whose peak has no
        phase, ``"with no phase recorded"``; for a snapshot without history, that the level is the dump's and no
        peak is known; when the step's peak is unknown (``step_peak_unknown``), that it is the recorded window's.

    Raises:
        ValueError: ``which`` is neither ``"peak"`` nor ``"window"``.
    """
    if which not in ("peak", "window"):
        raise ValueError(f"which={which!r}: expected 'peak' or 'window'")
    scope = summary.get("peak_scope")
    if scope == "dump_time":
        return _AT_DUMP
    if summary.get("step_peak_unknown"):
        return _STEP_UNKNOWN
    if which == "window" and scope is not None:
        pos, phase = summary.get("window_peak_position"), summary.get("window_peak_phase")
        outside = WINDOW_PEAK_POSITIONS[pos] if pos in ("before_step", "after_step") else None
        if outside:
            return outside
    else:  # the headline peak; an older summary's only peak is its window's
        phase = summary.get("peak_phase")
        pos = "in_step" if scope == "profiled_step" else None
    if phase:
        return f"in {phase}"
    if pos == "in_step":
        return _IN_STEP_NO_PHASE
    return _NO_PHASES if scope is not None else "with no phase recorded"


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(where: str, rec: object, fields: Mapping[str, tuple[Callable[[Any], object], str]]) -> None:
    if not isinstance(rec, dict):
        raise ValueError(f"{where} is {type(rec).__name__}, expected a dict")
    for key, (check, what) in fields.items():
        if key in rec and not check(rec[key]):
            raise ValueError(f"{where}['{key}'] is {rec[key]!r:.60}, expected {what}")


_NONNEG_INT = (lambda v: _int(v) and v >= 0, "an int >= 0")
_SEGMENT_FIELDS = {"device": _NONNEG_INT, "total_size": _NONNEG_INT, "blocks": (lambda v: isinstance(v, list), "a list")}
_BLOCK_FIELDS = {"address": (_int, "an int"), "size": _NONNEG_INT, "frames": (lambda v: isinstance(v, list), "a list")}
_EVENT_FIELDS = {"action": (lambda v: isinstance(v, str), "a str"), "addr": (_int, "an int"), "size": _NONNEG_INT,
                 "time_us": (is_finite_number, "a finite number"),
                 "frames": (lambda v: isinstance(v, list), "a list")}


def check_snapshot(snapshot: object) -> None:
    """Check the structure :func:`analyze_snapshot` relies on; the message says where it breaks.

    Expected (``torch.cuda.memory._snapshot()``): a dict with ``segments``, a list of dicts
    (``device``, ``total_size`` ints >= 0, ``blocks`` a list of dicts with int ``address``, int
    ``size`` >= 0, ``state`` str, ``frames`` list) and ``device_traces``, a list (per device) of
    lists of dicts (``action`` str, ``addr`` int, ``size`` int >= 0, finite ``time_us``, ``frames`` list).

    Raises:
        ValueError: e.g. ``"segments[0] is int, expected a dict"`` or
            ``"device_traces[0][12]['size'] is -5, expected an int >= 0"``.
    """
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError("not a CUDA allocator snapshot: expected a dict with 'segments' and 'device_traces'")
    segments, traces = snapshot["segments"], snapshot.get("device_traces", [])
    for name, value in (("segments", segments), ("device_traces", traces)):
        if not isinstance(value, list):
            raise ValueError(f"'{name}' is {type(value).__name__}, expected a list")
    for i, seg in enumerate(segments):
        _check_fields(f"segments[{i}]", seg, _SEGMENT_FIELDS)
        for j, block in enumerate(seg.get("blocks", [])):
            _check_fields(f"segments[{i}]['blocks'][{j}]", block, _BLOCK_FIELDS)
            if block.get("state") in _ALLOCATED_STATES and not ("address" in block and "size" in block):
                raise ValueError(f"segments[{i}]['blocks'][{j}] is allocated but has no 'address'/'size'")
    for d, trace in enumerate(traces):
        if not isinstance(trace, list):
            raise ValueError(f"device_traces[{d}] is {type(trace).__name__}, expected a list")
        for k, event in enumerate(trace):
            _check_fields(f"device_traces[{d}][{k}]", event, _EVENT_FIELDS)
            if event.get("action") in ("alloc", "free_completed") and "addr" not in event:
                raise ValueError(f"device_traces[{d}][{k}] is an {event['action']} without 'addr'")


def other_devices_message(s: MemorySummary) -> str:
    """The warning of a snapshot (its summary ``s``) that holds other devices' blocks beside the rank's own."""
    own, others = s["devices"][0], s["devices"][1:]
    seen = "; ".join(f"cuda:{d['device']} {d['reserved_bytes'] / _GIB:.3f} GiB reserved, "
                     f"{d['allocated_bytes'] / _GIB:.3f} GiB allocated at the dump, {d['trace_entries']} events"
                     for d in others)
    whose = (f"the rank's own (from the {s['device_from']})" if s.get("device_from") else
             "the device with the most reserved memory (the rank's own is unknown: no device in the phases sidecar, "
             "no cluster.n_gpus_per_node in config.yaml)")
    return (f"the snapshot also holds other devices' memory ({seen}): left out of every figure, which are those of "
            f"cuda:{own['device']}, {whose}, {own['reserved_bytes'] / _GIB:.3f} GiB reserved at the dump; this "
            "rank's process allocated on another GPU (e.g. torch.load without map_location)")


def history_status(summary: Mapping[str, Any], max_entries: int | None) -> History:
    """Whether the allocator history ring buffer overflowed, so the recorded window is truncated.

    ``torch.cuda.memory._record_memory_history(max_entries=N)`` keeps only the newest ``N`` events
    (``sftprof/capture/memory.py``); a trace holding ``N`` entries has lost its earliest events, so
    the peak and its time are those of the kept window only.

    Args:
        summary: output of :func:`analyze_snapshot` (``trace_entries``, ``window_start_us``, ``peak_time_ms``).
        max_entries: the trial's ``memory_profiler.max_entries`` (``MEMORY_MAX_ENTRIES``), None if unknown.

    Returns:
        ``{"max_entries", "entries", "truncated"}`` (``truncated`` None when ``max_entries`` is unknown)
        plus, when truncated, ``message`` and ``window_start_us`` (unix us of the first kept event; absent when the
        events have no times).
    """
    n = summary["trace_entries"]
    out: History = {"max_entries": max_entries, "entries": n,
                           "truncated": None if max_entries is None else n >= max_entries}
    if out["truncated"]:
        first = ("" if summary["window_start_us"] is None else
                 f" (unix time {summary['window_start_us']:.0f} us, {summary['peak_time_ms']:.3f} ms before the "
                 "reported peak)")
        if summary["window_start_us"] is not None:
            out["window_start_us"] = summary["window_start_us"]
        out["message"] = (f"the allocator history holds max_entries={max_entries} entries: the ring buffer "
                          f"overflowed, events before the first kept one{first} are lost, so the peak and its "
                          "time are those of the truncated window only; raise MEMORY_MAX_ENTRIES "
                          "(memory_profiler.max_entries)")
    return out


def analyze_snapshot(snapshot: dict[str, Any], phases: dict[str, Any] | None = None,
                     device: int | None = None) -> dict[str, Any]:
    """Memory summary of one snapshot: the profiled step's peak when ``phases`` holds phases, else the recorded
    window's (module docstring), and the whole window's peak beside it.

    Args:
        snapshot: the unpickled snapshot (see :func:`sftprof.analysis.memory.safe_pickle.safe_load_file`). Its events
            are taken to be in time order (the allocator appends them as they happen).
        phases: the ``phases_rank<r>.json`` sidecar content, or None.
        device: the rank's own CUDA device index, whose segments and events are summarised (a snapshot can hold
            another GPU's blocks: a ``torch.load`` without ``map_location``); None: the device with the most
            reserved bytes.

    Returns:
        JSON-serialisable dict (bytes are ints; ``*_gib`` floats are GiB = 2**30 bytes; ``*_ms`` from the first
        recorded event):

        - ``device`` (the one summarised), ``devices`` (per device the snapshot holds: ``device``,
          ``reserved_bytes``, ``allocated_bytes`` at the dump, ``trace_entries``; ``device``'s first),
          ``trace_entries``, ``window_ms``, ``window_start_us`` (unix us; both None without events or
          when the events have no times);
        - ``peak_scope``: ``"profiled_step"`` (sidecar with phases), ``"recorded_window"`` or ``"dump_time"`` (no
          history: the peak figures are the level at dump time) (:data:`PEAK_SCOPES`); ``step_peak_unknown``: why
          the history cannot give the profiled step's peak (:func:`_history_problem`; module docstring), None when
          it can or no phases were recorded; ``step_peak_lower_bound``: why the step's peak is a lower bound (its
          history starts after the step's start: :func:`_history_start_problem`), else None;
          ``step_window``: ``{"source": "sftprof/step" | "span of the recorded
          phases", "start_ms", "end_ms"}``, None without phases or when the step's peak is unknown;
        - the headline peak, of that scope: ``peak_allocated_bytes``/``_gib`` (highest allocated level; in the
          step, the level it starts from counts), ``peak_time_ms`` (the step's start when that starting level is
          the peak; None without times), ``peak_phase`` (innermost phase at that time, None outside every phase and without phases),
          ``peak_reserved_bytes``/``_gib`` (highest reserved level of the scope), ``reserved_at_peak_bytes``,
          ``reserved_minus_allocated_at_peak_bytes``/``_gib``, ``live_at_peak_bytes``, ``top_sites`` (site, bytes,
          blocks, share_pct of allocated-at-peak), ``top_allocations`` (bytes, site), ``categories_at_peak``
          (:data:`sftprof.analysis.memory.categories.MEMORY_CATEGORIES` rows whose bytes sum to the allocated
          bytes at the peak, then the allocator slack row), ``transient_spikes`` (largest blocks allocated inside the scope and freed inside the
          window: bytes, lifetime_ms, site); ``without_largest_block``: the scope's peak had the largest block
          alive at the peak (and allocated in the history) never been allocated (:func:`_without_largest_block`;
          None when there is none): what a change that removes that block alone would leave;
        - the whole recorded window's peak: ``window_peak_allocated_bytes``/``_gib``, ``window_peak_time_ms``,
          ``window_peak_phase``, ``window_peak_reserved_bytes``/``_gib``, ``window_top_sites`` (as ``top_sites``)
          and ``window_peak_position``: ``"in_step"`` (the step reaches the window's highest level; then the
          window's peak is the step's), ``"before_step"`` or ``"after_step"`` (higher than anything in the step),
          None without phases (then it is the headline peak);
        - ``end_allocated_bytes``, ``end_reserved_bytes``;
        - ``series`` (internal: numpy arrays for :func:`sftprof.analysis.memory.plot.plot_memory`, removed by the
          caller before JSON).

    Raises:
        ValueError: the object is not a well-formed allocator snapshot (see :func:`check_snapshot`), or the
            sidecar is not ``{'phases': [{'name': str, 'start_us': number, 'end_us': number}]}``.
    """
    check_snapshot(snapshot)
    if phases is not None and not (isinstance(phases, dict) and isinstance(phases.get("phases", []), list)
                                   and all(isinstance(p, dict) and isinstance(p.get("name"), str)
                                           and is_finite_number(p.get("start_us")) and is_finite_number(p.get("end_us"))
                                           for p in phases.get("phases", []))):
        raise ValueError("phases sidecar: expected {'phases': [{'name': str, 'start_us': number, 'end_us': number}]}")
    devices = _devices(snapshot, device)
    dev = devices[0]["device"]
    traces = snapshot.get("device_traces") or []
    trace = traces[dev] if dev < len(traces) else []
    segments = [s for s in snapshot["segments"] if s.get("device", 0) == dev]
    final_blocks: dict[int, tuple[int, Frames]] = {}
    for seg in segments:
        for b in seg.get("blocks", []):
            if b.get("state") in _ALLOCATED_STATES:
                final_blocks[b["address"]] = (b["size"], b.get("frames") or [])
    end_alloc = sum(size for size, _ in final_blocks.values())
    end_reserved = sum(s.get("total_size", 0) for s in segments)

    n = len(trace)
    d_alloc = np.zeros(n, dtype=np.int64)
    d_res = np.zeros(n, dtype=np.int64)
    times = np.zeros(n, dtype=np.float64)
    for i, e in enumerate(trace):
        a, size = e.get("action"), int(e.get("size", 0))
        times[i] = e.get("time_us", np.nan)  # NaN: no time (an older torch's snapshot, or damaged)
        if a == "alloc":
            d_alloc[i] = size
        elif a == "free_completed":
            d_alloc[i] = -size
        elif a in ("segment_alloc", "segment_map"):
            d_res[i] = size
        elif a in ("segment_free", "segment_unmap"):
            d_res[i] = -size
    start_alloc = end_alloc - int(d_alloc.sum())
    start_res = end_reserved - int(d_res.sum())
    allocated = start_alloc + np.cumsum(d_alloc)
    reserved = start_res + np.cumsum(d_res)

    def alloc_after(i: int) -> int:  # allocated right after event i (-1: before the first)
        return int(allocated[i]) if i >= 0 else start_alloc

    def res_after(i: int) -> int:
        return int(reserved[i]) if i >= 0 else start_res

    def highest(lo: int, hi: int) -> tuple[int, int, int]:
        """(event index, level) of the highest allocated level right after events lo..hi-1 (the first event
        reaching it; event lo only when no later one does), and the highest reserved level there."""
        idx = np.arange(lo + 1, hi)
        best_i, best, res = lo, alloc_after(lo), res_after(lo)
        if idx.size:
            k = int(np.argmax(allocated[idx]))
            if int(allocated[idx[k]]) >= best:
                best_i, best = int(idx[k]), int(allocated[idx[k]])
            res = max(res, int(reserved[idx].max()))
        return best_i, best, res

    phase_list = (phases or {}).get("phases") or []
    step = _step_window(phase_list)
    problem = _history_problem(times, step)
    timed = bool(n) and not np.isnan(times).any()
    lower_bound = None
    if step is not None and problem is None and times[0] > step[0]:
        allocs = {e["addr"] for e in trace if e.get("action") == "alloc"}
        unrecorded = [size for addr, (size, frames) in final_blocks.items() if not frames and addr not in allocs]
        lower_bound = _history_start_problem(times, step, (len(unrecorded), sum(unrecorded)))
    t0 = float(times[0]) if timed else 0.0
    # The whole recorded window: the level before the first event, then after each event.
    win_i, win_alloc, win_res = highest(-1, n)
    win_t = float(times[win_i]) if win_i >= 0 else t0
    if step is not None and problem is None:
        s_us, e_us, source = step
        # first event at or after the step's start, one past the last event at or before its end (by position)
        started, ended = times >= s_us, times <= e_us
        first_in = int(np.argmax(started)) if started.any() else n
        after = n - int(np.argmax(ended[::-1])) if ended.any() else 0
        # The level the step starts from (after the last event before it), then after each event inside it.
        lo, hi = first_in - 1, max(after, first_in)
        peak_i, peak_alloc, peak_res = highest(lo, hi)
        # the starting level is known from the step's start (or the first recorded event, if later)
        peak_t = float(times[peak_i]) if peak_i >= first_in else (max(s_us, t0) if n else t0)
        if peak_alloc == win_alloc:  # the step reaches the window's highest level: that is the window's peak
            win_i, win_t, position = peak_i, peak_t, "in_step"
        else:
            position = "before_step" if win_t < s_us else "after_step" if win_t > e_us else "in_step"
        step_window: Optional[MemoryStepWindow] = {"source": source,
                                                   "start_ms": round((s_us - t0) / 1e3, 3) if n else None,
                                                   "end_ms": round((e_us - t0) / 1e3, 3) if n else None}
        scope = "profiled_step"
    else:
        peak_i, peak_alloc, peak_res, peak_t, position, step_window = win_i, win_alloc, win_res, win_t, None, None
        lo, hi = -1, n
        s_us, e_us = -np.inf, np.inf
        scope = "recorded_window" if n else "dump_time"

    def at_ms(t_us: float) -> float | None:  # ms from the first recorded event; None when the events have no times
        return round((t_us - t0) / 1e3, 3) if timed else None

    def phase(t_us: float) -> str | None:
        return _innermost_phase(phase_list, t_us) if phase_list and timed else None

    res_at_peak = res_after(peak_i)
    at_peak = _alive_at(trace, final_blocks, peak_i, res_at_peak)
    at_win = at_peak if win_i == peak_i else _alive_at(trace, final_blocks, win_i, res_after(win_i))
    return {
        "device": dev,
        "devices": devices,
        "trace_entries": n,
        "window_ms": at_ms(float(times[-1])) if n else None,
        "window_start_us": t0 if timed else None,
        "peak_scope": scope,
        "step_peak_unknown": problem,
        "step_peak_lower_bound": lower_bound,
        "step_window": step_window,
        "peak_allocated_bytes": peak_alloc,
        "peak_allocated_gib": round(peak_alloc / _GIB, 4),
        "peak_reserved_bytes": peak_res,
        "peak_reserved_gib": round(peak_res / _GIB, 4),
        "reserved_at_peak_bytes": res_at_peak,
        "reserved_minus_allocated_at_peak_bytes": res_at_peak - peak_alloc,
        "reserved_minus_allocated_at_peak_gib": round((res_at_peak - peak_alloc) / _GIB, 4),
        "peak_time_ms": at_ms(peak_t) if n else None,
        "peak_phase": phase(peak_t),
        "live_at_peak_bytes": at_peak["live_bytes"],
        "window_peak_allocated_bytes": win_alloc,
        "window_peak_allocated_gib": round(win_alloc / _GIB, 4),
        "window_peak_reserved_bytes": win_res,
        "window_peak_reserved_gib": round(win_res / _GIB, 4),
        "window_peak_time_ms": at_ms(win_t) if n else None,
        "window_peak_phase": phase(win_t),
        "window_peak_position": position,
        "end_allocated_bytes": end_alloc,
        "end_reserved_bytes": end_reserved,
        "top_sites": at_peak["top_sites"],
        "top_allocations": at_peak["top_allocations"],
        "without_largest_block": _without_largest_block(trace, allocated, peak_i, lo, hi, at_ms, phase)
        if n and peak_i >= 0 else None,
        "categories_at_peak": at_peak["categories"],
        "transient_spikes": _spikes(trace, s_us, e_us) if timed else [],  # a lifetime needs times
        "window_top_sites": at_win["top_sites"],
        "series": {"t_us": times, "allocated": allocated, "reserved": reserved, "peak_index": peak_i,
                   "window_peak_index": win_i, "start_allocated": start_alloc, "start_reserved": start_res,
                   "phases": phase_list},
    }
