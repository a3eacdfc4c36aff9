"""Split one rank's Chrome trace into the five views users open in Perfetto.

One streaming pass over a rank's raw trace writes, side by side (file layout:
:mod:`sftprof.artifacts`, ``<out_dir>/<view>/rank<rank>.pt.trace.json``):

============================  ==================================================================
``chrome``                    the whole trace, normalised (top-level members first, one event a
                              line, flows and metadata events last)
``split_clean.chrome``        host CPU ops, CUDA runtime/driver API calls, user annotations and GPU
                              work on separate, named tracks; CPU->GPU flow arrows (``ac2g``) kept,
                              both ends bound on the tracks their slices moved to; profiler
                              overhead dropped
``gpu_only.chrome``           kernels, memcpy, memset, GPU user annotations, CUDA sync events + GPU
                              track metadata, and the profiler's step slice(s) (below)
``cpu_only.chrome``           cpu_op, user_annotation, python_function events (+ fwd/bwd flows)
``cuda_api_only.chrome``      cuda_runtime and cuda_driver events, and the profiler's step slice(s)
============================  ==================================================================

Every view satisfies the Trace Event Format rules of ``sftprof/analysis/trace/check.py`` (what
Perfetto's JSON importer needs), so each view differs from the raw trace in these ways:

- events :func:`~sftprof.analysis.trace.check.event_problem` rejects (no time, negative or
  non-finite ``dur``, ...) are left out of every view and reported through ``on_invalid``; non-finite
  numbers elsewhere in an event (``NaN`` in ``args``) become ``null``;
- profiler bookkeeping without a 32-bit integer ``pid``/``tid`` (the ``Spans``/``Traces``
  pseudo-processes, overhead events of pid -1) is left out;
- flow events whose partner is missing are left out (flows are written after the other events);
- user annotations (``record_function`` ranges such as ``sftprof/backward/mb0``) can open inside
  one op and close after it on the same thread, which does not nest; in the views with CPU ops they
  sit on their own track per thread (``Annotations: thread N``), next to the thread's ops;
- CUDA sync events (category ``cuda_sync``, recorded with ``enable_cuda_sync_events``: ``Stream Sync``,
  ``Stream Wait Event``, ``Event Sync``, ``Context Sync``) span the wait, so on a stream they overlap the
  kernels they wait for without nesting; in the views with GPU work they sit on their own track per
  stream (``CUDA sync: <stream's name>``), and the ``ac2g`` arrow that ends at one moves with it. HTA
  reads the stream from the event's ``args``, so its analyses see them unchanged;
- the profiler's step slices (the user annotations ``ProfilerStep#<n>``) are also in ``gpu_only`` and
  ``cuda_api_only`` (also when those select nothing else), on their annotation track: HTA and TensorBoard's
  profiler plugin find the profiled step there (without it HTA warns ``ProfilerStep not found`` and the
  plugin's overview shows a step 0 of negative length);
- one ``process_name`` per process and one ``thread_name`` per track (a thread renamed during the
  trace gets both names: ``thread 3658 (python, pt_autograd_0)``).

Tracks made up by the views (CUDA API calls and annotations of host thread ``t``) get thread ids
counting down from ``2**31 - 1`` that no real thread of the process uses.

A view that selects nothing (``gpu_only`` of a CPU run) holds one metadata record saying so
(:func:`_empty_view_event`), beside the step slices where it gets them. A view that would be byte for byte an
earlier view of the list (``cpu_only`` of a CPU run is ``chrome``: a trace without GPU work or CUDA API calls) is
written as a relative symbolic link to that view's file instead of a second copy (:func:`view_links` lists them;
the summary names them), so every view's path opens as before without the disk holding it twice. A view larger
than ``max_view_bytes`` is written in time windows in ``<view>.part<k>/`` folders (each with all the metadata,
:mod:`sftprof.analysis.views.windows`) so that every file opens in Perfetto's web UI: for a trace whose text could
make one (more than :data:`~sftprof.analysis.views.windows.WINDOW_DECIDE` of the limit, or a compressed trace of
more than a 64th of it), a first look at a few thousand of its events (:func:`_window_plan`) estimates each view's
bytes over time, and a view estimated above that share of the limit is written straight into windows of equal
estimated bytes (at most :data:`~sftprof.analysis.views.windows.WINDOW_FILL` of the limit) in the one pass; a view
found above the limit only once written is rewritten into windows after the pass (two more passes over it).

Above 500 lines for a reason: the one streaming pass writes the five views at once, and its made-up tracks, flow
pairing and track names share that pass's state; apart, each piece would take most of it as arguments.
"""
from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import math
import os
import re
import tempfile
from array import array
from bisect import bisect_right
from collections import defaultdict
from typing import IO, Any, Callable, Iterator, Optional, TextIO, TypeGuard, TypeVar, Union

import numpy as np

from sftprof.analysis.trace.check import CATEGORY_ALIAS_NOTE, CATEGORY_ALIASES, MAX_TID, event_problem, finite_json
from sftprof.analysis.trace.io import Progress, TraceReader, TraceWriter
from sftprof.analysis.views.windows import (FLOW_PHASES, WINDOW_DECIDE, WindowedView, sample_events, split_into_windows,
                                            window_cuts)
from sftprof.artifacts import view_path

__all__ = ["VIEWS", "MAX_VIEW_BYTES", "view_path", "split_trace", "read_for_summary", "view_links"]

VIEWS = ("chrome", "split_clean.chrome", "gpu_only.chrome", "cpu_only.chrome", "cuda_api_only.chrome")
MAX_VIEW_BYTES = 1_500_000_000  # Perfetto's web UI struggles with single JSON files beyond ~1.5-2 GB
_GZ_RATIO = 64  # the most a compressed trace is taken to expand (whether the first look may be needed)

_CPU_CATS = frozenset({"cpu_op", "user_annotation", "python_function", "cpu_instant_event"})
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
_API_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_SYNC_CAT = "cuda_sync"
_COMPACT = (",", ":")
_SYNTHETIC_FLOOR = MAX_TID - 2**20  # made-up tids stay above this
_TID_FIELD = re.compile(r'"tid"\s*:\s*(\d+)')
_THREAD_LABEL = re.compile(r"^thread \d+ \((.*)\)$")
_CHROME, _CLEAN, _GPU, _CPU, _API = VIEWS
_Raw = TypeVar("_Raw", str, Optional[str])  # an event's text, None where the reader left it out


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> str:
    return json.dumps({"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}, separators=_COMPACT)


def _empty_view_event(view: str, step_pids: set[int]) -> str:
    """The record saying that a view selected nothing (e.g. ``gpu_only`` of a CPU run).

    A ``process_name`` metadata record of a process id no event of the view uses (0 unless a step slice is
    on pid 0). ``step_pids``: the processes of the profiler's step slices (``ProfilerStep#<n>``) written into
    the view all the same (``gpu_only`` and ``cuda_api_only``), empty if none: TensorBoard's profiler plugin
    (torch-tb-profiler 0.4.3) needs that slice, and reports a step total of -18446744073709551615 µs in a
    trace without it. The record carries ``ts``, ``dur`` and ``cat`` (``__metadata``, as Chrome writes for
    metadata) because HolisticTraceAnalysis 0.5.0 cannot load a trace whose events lack those columns
    (``KeyError: 'ts'``).
    """
    pid = next(p for p in range(len(step_pids) + 1) if p not in step_pids)
    what = "no events in this trace" + (" but the profiler step" if step_pids else "")
    return json.dumps({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0, "dur": 0, "cat": "__metadata",
                       "args": {"name": f"{view.removesuffix('.chrome')}: {what}"}}, separators=_COMPACT)


def _track_id(v: object) -> TypeGuard[int]:
    return type(v) is int and 0 <= v <= MAX_TID


class _SyntheticTids:
    """Thread ids for made-up tracks: per process, counting down from ``2**31 - 1``, skipping every
    tid a real event of that process used so far and every tid in ``avoid``.

    Only real tids above :data:`_SYNTHETIC_FLOOR` can collide with made-up ones (a process would need
    2**20 made-up tracks to reach it), so only those are recorded in :attr:`real`.
    """

    def __init__(self, avoid: dict[int, set[int]]):
        self.avoid = avoid
        self.real: dict[int, set[int]] = defaultdict(set)
        self.assigned: dict[tuple[int, str, int], int] = {}  # (pid, kind, host tid) -> synthetic tid
        self._next: dict[int, int] = {}
        self.owner: dict[tuple[int, int], tuple[str, int]] = {}  # (pid, synthetic tid) -> (kind, host tid)

    def get(self, pid: int, kind: str, tid: int) -> int:
        key = (pid, kind, tid)
        out = self.assigned.get(key)
        if out is None:
            out = self._next.get(pid, MAX_TID)
            avoid = self.avoid.get(pid, ())
            while out in self.real[pid] or out in avoid:
                out -= 1
            if out <= _SYNTHETIC_FLOOR:
                raise ValueError(f"pid {pid}: no free thread id above {_SYNTHETIC_FLOOR} for a made-up track")
            self._next[pid] = out - 1
            self.assigned[key] = out
            self.owner[(pid, out)] = (kind, tid)
        return out

    def collisions(self) -> bool:
        """Whether a real tid seen after its assignment equals a synthetic one."""
        return any(t in self.real[p] for (p, t) in self.owner)


def _moved(raw: str, ev: dict[str, Any] | None, old: int, tid: int) -> str:
    """Event text with its ``tid`` (``old``) set to ``tid``: the text is edited in place when the field is
    plain, else the event (``ev``, or ``raw`` parsed) is re-encoded. ``ev['tid']`` is updated too."""
    if ev is not None:
        ev["tid"] = tid
    m = _TID_FIELD.search(raw)
    if m is not None and int(m.group(1)) == old and raw.count('"tid"') == 1:
        return f"{raw[:m.start(1)]}{tid}{raw[m.end(1):]}"
    ev = dict(json.loads(raw) if ev is None else ev, tid=tid)
    return json.dumps(ev, separators=_COMPACT)


def _thread_label(names: list[str], tid: int) -> str:
    """One label from a thread's ``thread_name`` records: ``thread 3658 (python, pt_autograd_0)``."""
    inner = []
    for n in names:
        m = _THREAD_LABEL.match(n)
        n = m.group(1) if m else n
        if n not in inner:
            inner.append(n)
    return f"thread {tid} ({', '.join(inner)})" if inner else f"thread {tid}"


def split_trace(src: str, out_dir: str, rank: int, *, compress: bool = False,
                max_view_bytes: int = MAX_VIEW_BYTES,
                on_header: Callable[[dict[str, Any]], None] | None = None,
                on_event: Callable[[dict[str, Any]], None] | None = None,
                on_invalid: Callable[[str, str], None] | None = None,
                on_note: Callable[[str, int], None] | None = None,
                progress: bool = True, _avoid: dict[int, set[int]] | None = None) -> dict[str, list[str]]:
    """Write the five views of one rank's trace in a single streaming pass.

    Args:
        src: ``traces-r<rank>.chrome.json`` or ``.json.gz`` (torch.profiler ``export_chrome_trace``).
        out_dir: destination directory (created).
        rank: global rank, used in the output names.
        compress: write ``.json.gz`` instead of ``.json``.
        max_view_bytes: views with more event bytes than this are split into time windows.
        on_header: called once, after the last event, with all top-level members except ``traceEvents``
            (non-finite numbers replaced by None).
        on_event: called with every usable event dict (e.g. ``KernelTraceAnalyzer.add``).
        on_invalid: called as ``on_invalid(kind, raw_text)`` for every event left out because
            :func:`~sftprof.analysis.trace.check.event_problem` rejects it (``kind`` is its answer).
        on_note: called as ``on_note(what, count)`` at the end for repairs that keep every figure
            intact: ``"non-finite numbers written as null"``, ``"profiler bookkeeping events left out"``,
            ``"unpaired flow events left out"``, :data:`~sftprof.analysis.trace.check.CATEGORY_ALIAS_NOTE` (events
            whose category another kineto version spelled, read as today's: ``Kernel`` as ``kernel``; only non-zero
            counts).
        progress: print progress lines to stderr.

    Returns:
        ``{view: [file paths]}`` (one path, or the ``part<k>`` paths of a windowed view).

    Raises:
        TraceFormatError: truncated or malformed trace; partially written views are deleted.
    """
    os.makedirs(out_dir, exist_ok=True)
    reader = TraceReader(src, Progress(os.path.basename(src), os.path.getsize(src)) if progress else None)
    writers: dict[str, _ViewWriter] = {}
    metadata: list[dict[str, Any]] = []
    tracks: dict[str, set[tuple[int, int]]] = {"cpu": set(), "api": set(), "gpu": set(), "ann": set(), "sync": set(),
                                               "step": set()}
    # (pid, tid, correlation) of the CUDA sync events: their ac2g arrows' ends
    sync_ends: set[tuple[int, int, Any]] = set()
    step_slices: list[tuple[float, str]] = []  # (ts, text) of ProfilerStep#<n> slices, for gpu_only and cuda_api_only
    tids = _SyntheticTids(_avoid or {})
    notes: dict[str, int] = defaultdict(int)
    flow_file = tempfile.TemporaryFile("w+", encoding="utf-8", dir=out_dir)  # flows wait for their partners here
    flow_lines: list[str] = []
    flow_pairs = _FlowPairs()
    header: dict[str, Any] = {}
    try:
        events = _usable_events(reader, reader.events(), on_invalid, notes)
        first = next(events, None)
        header, n_bad = finite_json(dict(reader.header))
        notes["non-finite numbers written as null"] += n_bad
        header.setdefault("displayTimeUnit", "ms")
        plan = _window_plan(src, max_view_bytes)
        for view in VIEWS:
            path = view_path(out_dir, rank, view, compress)
            if plan[view]:
                writers[view] = WindowedView(path, header, plan[view])
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                writers[view] = TraceWriter(path, header)
        # Slot k: the events from cuts[k - 1] to cuts[k], every windowed view's boundaries (none: one slot); each
        # view's writer of that slot, in VIEWS order.
        cuts = sorted({t for view_cuts in plan.values() for t in view_cuts})
        slots = [tuple(_writer_at(writers[v], t) for v in VIEWS) for t in [-math.inf] + cuts]
        routes = [tuple(w.pending.append for w in ws) for ws in slots]
        # Hot loop: append to the writers' pending lists, flush every FLUSH_EVENTS events.
        full, clean, gpu_w, cpu_w, api_w = routes[0]
        real = tids.real
        cpu_tracks, gpu_tracks, api_tracks = tracks["cpu"], tracks["gpu"], tracks["api"]
        flush_every = TraceWriter.FLUSH_EVENTS
        countdown = flush_every
        for raw, ev in itertools.chain([first] if first is not None else [], events):
            countdown -= 1
            if not countdown:
                countdown = flush_every
                for w in writers.values():
                    w.flush()
            if on_event is not None:
                on_event(ev)
            ph = ev["ph"]
            pid, tid = ev.get("pid"), ev.get("tid")
            if ph == "M":
                if _track_id(pid):
                    metadata.append(ev)
                    if _track_id(tid) and tid > _SYNTHETIC_FLOOR:
                        real[pid].add(tid)
                else:
                    notes["profiler bookkeeping events left out"] += 1
                continue
            if not (type(pid) is int and type(tid) is int and 0 <= pid <= MAX_TID and 0 <= tid <= MAX_TID):
                notes["profiler bookkeeping events left out"] += 1
                continue
            if tid > _SYNTHETIC_FLOOR:
                real[pid].add(tid)
            cat = ev.get("cat")
            if ph in FLOW_PHASES:
                if cat in ("ac2g", "fwdbwd") and ph != "t" and "id" in ev:
                    fid, slot = ev["id"], bisect_right(cuts, ev["ts"])
                    flow_pairs.add(cat, fid, ph, slot)
                    # One line per event: line breaks in JSON text are only whitespace between tokens.
                    flow_lines.append(f"{cat}\t{fid if type(fid) is int else json.dumps(fid)}\t{ph}\t{pid}\t{tid}\t"
                                      f"{slot}\t{raw.replace(chr(10), ' ').replace(chr(13), ' ')}\n")
                    if len(flow_lines) >= flush_every:
                        flow_file.writelines(flow_lines)
                        flow_lines.clear()
                else:
                    notes["unpaired flow events left out"] += 1
                continue
            if cuts:  # a view in time windows: the writers of this event's slot
                full, clean, gpu_w, cpu_w, api_w = routes[bisect_right(cuts, ev["ts"])]
            if cat == "user_annotation":  # own track: annotations need not nest with the thread's ops
                tracks["ann"].add((pid, tid))
                raw = _moved(raw, ev, tid, tids.get(pid, "ann", tid))
                full(raw)
                cpu_w(raw)
                clean(raw)
                if str(ev.get("name")).startswith("ProfilerStep#"):  # the step, for HTA and TensorBoard
                    tracks["step"].add((pid, tid))
                    step_slices.append((ev["ts"], raw))
                continue
            if cat == _SYNC_CAT:  # own track: a sync spans the kernels it waits for on the same stream
                tracks["sync"].add((pid, tid))
                args = ev.get("args")
                if isinstance(args, dict) and "correlation" in args:
                    sync_ends.add((pid, tid, args["correlation"]))
                raw = _moved(raw, ev, tid, tids.get(pid, "sync", tid))
                full(raw)
                clean(raw)
                gpu_w(raw)
                continue
            full(raw)
            if cat in _CPU_CATS:
                cpu_tracks.add((pid, tid))
                cpu_w(raw)
                clean(raw)
            elif cat in _GPU_CATS:
                gpu_tracks.add((pid, tid))
                clean(raw)
                gpu_w(raw)
            elif cat in _API_CATS:
                api_tracks.add((pid, tid))
                api_w(raw)
                clean(_moved(raw, ev, tid, tids.get(pid, "api", tid)))
        flow_file.writelines(flow_lines)
        selected_nothing = {v for v, w in writers.items()
                            if isinstance(w, TraceWriter) and not (w.n_events or w.pending)}
        step_views = {_GPU, _API} if step_slices else set()
        for v in step_views:
            for ts, raw in step_slices:
                _writer_at(writers[v], ts).write(raw)
        _write_flows(flow_file, flow_pairs, slots, tracks, tids, notes, sync_ends)
        _write_metadata(metadata, writers, tracks, tids, step_views)
        step_pids = {p for p, _ in tracks["step"]}
        for view in sorted(selected_nothing):
            writers[view].write(_empty_view_event(view, step_pids if view in step_views else set()))
    except BaseException:
        flow_file.close()
        for w in writers.values():
            w.abort()
            if isinstance(w, TraceWriter):
                with contextlib.suppress(OSError):  # the view folder, unless other ranks' views are in it
                    os.rmdir(os.path.dirname(w.path))
        raise
    flow_file.close()
    if tids.collisions():  # a real tid appeared after a synthetic one was handed out: redo, avoiding them all
        for w in writers.values():
            w.abort()
        avoid = {p: set(t) | set((_avoid or {}).get(p, ())) for p, t in tids.real.items()}
        # on_event / on_invalid already saw every event of this trace once.
        return split_trace(src, out_dir, rank, compress=compress, max_view_bytes=max_view_bytes,
                           on_header=on_header, on_note=on_note, progress=progress, _avoid=avoid)
    if on_header is not None:
        on_header(finite_json(dict(reader.header))[0])
    if on_note is not None:
        for what, n in sorted(notes.items()):
            if n:
                on_note(what, n)
    trailer = {k: v for k, v in finite_json(reader.header)[0].items() if k not in header}
    result: dict[str, list[str]] = {}
    for view, w in writers.items():
        if isinstance(w, WindowedView):
            result[view] = w.close(trailer)
            continue
        w.close(trailer)  # flushes; w.chars is final afterwards
        same = next((o for v, o in writers.items() if v in result and isinstance(o, TraceWriter)
                     and o.chars == w.chars <= max_view_bytes and not os.path.islink(o.path)
                     and _same_content(o.path, w.path)), None)
        if same is not None:  # byte for byte an earlier view (chrome and cpu_only of a CPU run): a link to it
            os.remove(w.path)
            os.symlink(os.path.relpath(same.path, os.path.dirname(w.path)), w.path)
        result[view] = ([w.path] if w.chars <= max_view_bytes
                        else split_into_windows(w.path, max_view_bytes, progress=progress))
    return result


_ViewWriter = Union[TraceWriter, WindowedView]


def _writer_at(w: _ViewWriter, ts: float) -> TraceWriter:
    """The file of a view that an event starting at ``ts`` goes to."""
    return w.at(ts) if isinstance(w, WindowedView) else w


def _views_of(ev: dict[str, Any]) -> tuple[str, ...]:
    """The views an event goes to, as the pass sends it, but for flows left out as unpaired and events
    :func:`~sftprof.analysis.trace.check.event_problem` rejects: what the first look (:func:`_window_plan`) counts."""
    ph, pid, tid = ev.get("ph"), ev.get("pid"), ev.get("tid")
    if ph == "M" or not (_track_id(pid) and _track_id(tid)):
        return ()
    cat = ev.get("cat")
    cat = CATEGORY_ALIASES.get(cat, cat) if type(cat) is str else cat
    if ph in FLOW_PHASES:
        return (_CHROME, _CLEAN, _CPU) if cat == "fwdbwd" else (_CHROME, _CLEAN) if cat == "ac2g" else ()
    if cat == "user_annotation":
        return (_CHROME, _CLEAN, _CPU) + ((_GPU, _API) if str(ev.get("name")).startswith("ProfilerStep#") else ())
    return ((_CHROME, _CLEAN, _CPU) if cat in _CPU_CATS else (_CHROME, _CLEAN, _GPU) if cat in _GPU_CATS or
            cat == _SYNC_CAT else (_CHROME, _CLEAN, _API) if cat in _API_CATS else (_CHROME,))


def _window_plan(src: str, max_view_bytes: int) -> dict[str, list[float]]:
    """Each view's window boundaries (:func:`~sftprof.analysis.views.windows.window_cuts`; ``[]``: one file), from
    the first look at a trace whose text may hold a view above
    :data:`~sftprof.analysis.views.windows.WINDOW_DECIDE` of ``max_view_bytes``
    (:func:`~sftprof.analysis.views.windows.sample_events`); ``[]`` for every view of a smaller trace, which is not
    looked at."""
    size = os.path.getsize(src) * (_GZ_RATIO if src.endswith(".gz") else 1)
    if size <= WINDOW_DECIDE * max_view_bytes:
        return {view: [] for view in VIEWS}
    sampled: list[Optional[tuple[Any, tuple[str, ...]]]]  # (ts, views) per sampled event
    stride, sampled = sample_events(src, lambda ev: (ev.get("ts"), _views_of(ev)))
    times: dict[str, list[float]] = {view: [] for view in VIEWS}
    for entry in sampled:
        if entry is not None and type(entry[0]) in (int, float) and math.isfinite(entry[0]):
            for view in entry[1]:
                times[view].append(entry[0])
    return {view: window_cuts(sorted(ts), stride, max_view_bytes) for view, ts in times.items()}


def _usable_events(reader: TraceReader, events: Iterator[tuple[_Raw, dict[str, Any]]],
                   on_invalid: Callable[[str, str], None] | None, notes: dict[str, int]
                   ) -> Iterator[tuple[_Raw, dict[str, Any]]]:
    """``(raw, event)`` of each event of ``reader`` that :func:`~sftprof.analysis.trace.check.event_problem` accepts
    (the others go to ``on_invalid(kind, raw)``), non-finite numbers written as null (counted in ``notes``), another
    kineto version's category spellings read as today's (:data:`~sftprof.analysis.trace.check.CATEGORY_ALIASES`,
    counted; ``raw``, which the views write, keeps the trace's own spelling). ``events``: ``reader.events()``, or
    ``reader.events_without_text()`` (``raw`` None for most events; an invalid one's text is still found for
    ``on_invalid``)."""
    for raw, ev in events:
        cat = ev.get("cat")
        if type(cat) is str and cat in CATEGORY_ALIASES:
            ev["cat"] = CATEGORY_ALIASES[cat]
            notes[CATEGORY_ALIAS_NOTE] += 1
        problem = event_problem(ev)
        if problem is not None:
            if on_invalid is not None:
                on_invalid(problem, reader.last_raw(ev) if raw is None else raw)
            continue
        if raw is not None and reader.nonfinite_text and ("NaN" in raw or "Infinity" in raw):  # None: orjson read it
            ev, n_bad = finite_json(ev)
            if n_bad:
                notes["non-finite numbers written as null"] += n_bad
                raw = json.dumps(ev, separators=_COMPACT)
        yield raw, ev


def read_for_summary(src: str, on_header: Callable[[dict[str, Any]], None], on_event: Callable[[dict[str, Any]], None],
                     on_invalid: Callable[[str, str], None]) -> None:
    """Hand one trace's events to a summary as :func:`split_trace` does (the same ``on_*`` calls, in the same order),
    without writing the views: the pass that runs beside a :func:`split_trace` without callbacks, in another process,
    so that the two share the trace's parsing time between two cores.

    Raises:
        TraceFormatError: truncated or malformed trace.
    """
    reader = TraceReader(src)
    for _, ev in _usable_events(reader, reader.events_without_text(), on_invalid, defaultdict(int)):
        on_event(ev)
    on_header(finite_json(dict(reader.header))[0])


def _same_content(a: str, b: str) -> bool:
    """Whether two view files hold the same text (``.json.gz`` compared uncompressed: gzip headers differ)."""
    def read(path: str) -> TextIO:
        return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")

    with read(a) as fa, read(b) as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def view_links(views: dict[str, list[str]]) -> dict[str, str]:
    """``{view: the view it links to}`` for the views :func:`split_trace` wrote as a link (module docstring)."""
    folders = {os.path.basename(os.path.dirname(paths[0])): v for v, paths in views.items() if len(paths) == 1}
    return {v: folders[os.path.basename(os.path.dirname(os.readlink(paths[0])))]
            for v, paths in views.items() if len(paths) == 1 and os.path.islink(paths[0])}


class _FlowPairs:
    """Which flows ``(cat, id)`` have exactly one start (``s``) and one end (``f``), and the slots (time ranges of
    the windowed views, :func:`split_trace`) of the two ends of those whose ends lie in different slots, in 16 bytes
    per flow event.

    Integer ids (all of torch.profiler's) are kept in ``array('q')`` per (cat, phase), with the slots beside them,
    and matched with numpy once, at the end: then one byte per flow event says whether it is paired, asked in the
    order the events were added (:meth:`paired`; a set of the paired ids took about 75 bytes a pair, the worker's
    peak memory on a 10 GiB trace); other ids in a dict.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], array[int]] = defaultdict(lambda: array("q"))
        self._slots: dict[tuple[str, str], array[int]] = defaultdict(lambda: array("q"))
        # (cat, id as JSON text) -> count s, count f, slot s, slot f
        self._other: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        # (cat, id as kept: _key) -> slots of its start and end, when they differ
        self._apart: dict[tuple[str, int | str], tuple[int, int]] = {}
        self._paired: dict[tuple[str, str], bytes] = {}  # (cat, phase) -> per event added, in order: 1 if paired
        self._asked: dict[tuple[str, str], int] = defaultdict(int)  # (cat, phase) -> events asked so far

    @staticmethod
    def _key(fid: Any) -> int | str:
        """An id as kept: an int of 64 bits as it is, any other id as its JSON text."""
        return fid if type(fid) is int and -2**63 <= fid < 2**63 else json.dumps(fid)

    def add(self, cat: str, fid: Any, ph: str, slot: int) -> None:
        if type(fid) is int and -2**63 <= fid < 2**63:
            self._ids[(cat, ph)].append(fid)
            self._slots[(cat, ph)].append(slot)
        else:
            entry = self._other[(cat, json.dumps(fid))]
            entry[ph == "f"] += 1
            entry[2 + (ph == "f")] = slot

    def finish(self) -> None:
        """Match starts and ends (call once, after the last :meth:`add`)."""
        for cat in {c for c, _ in self._ids}:
            once: list[np.ndarray] = []  # per phase: the ids seen once
            slot: list[np.ndarray] = []  # ... and their slots
            for ph in ("s", "f"):
                ids = np.frombuffer(self._ids.get((cat, ph), array("q")), dtype=np.int64)
                uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
                once.append(uniq[counts == 1])
                slot.append(np.frombuffer(self._slots.get((cat, ph), array("q")), dtype=np.int64)[first[counts == 1]])
            paired, at_s, at_f = np.intersect1d(once[0], once[1], assume_unique=True, return_indices=True)
            apart = np.flatnonzero(slot[0][at_s] != slot[1][at_f])
            self._apart.update({(cat, int(paired[i])): (int(slot[0][at_s[i]]), int(slot[1][at_f[i]])) for i in apart})
            del once, slot, at_s, at_f
            for ph in ("s", "f"):  # an event is paired when its id is (seen once in each phase)
                ids = np.frombuffer(self._ids.get((cat, ph), array("q")), dtype=np.int64)
                at = np.minimum(np.searchsorted(paired, ids), max(paired.size - 1, 0))
                self._paired[(cat, ph)] = (paired[at] == ids if paired.size else np.zeros(ids.size, bool)).tobytes()
        self._ids.clear()
        self._slots.clear()
        self._apart.update({key: (e[2], e[3]) for key, e in self._other.items() if e[:2] == [1, 1] and e[2] != e[3]})

    def paired(self, cat: str, fid: Any, ph: str) -> bool:
        """Whether the next flow event of ``(cat, ph)`` (asked in the order they were added, each once, after
        :meth:`finish`), of id ``fid``, is paired."""
        if type(fid) is int and -2**63 <= fid < 2**63:
            k = self._asked[(cat, ph)]
            self._asked[(cat, ph)] = k + 1
            return self._paired[(cat, ph)][k] == 1
        return self._other.get((cat, json.dumps(fid)), [0, 0])[:2] == [1, 1]

    def apart(self, cat: str, fid: Any) -> tuple[int, int] | None:
        """The slots of a paired flow's start and end when they differ, else None."""
        return self._apart.get((cat, self._key(fid))) if self._apart else None


def _left_out(raw: str) -> None:
    """Where a flow event goes in a view whose windows part its two ends (:func:`_write_flows`): nowhere."""


def _write_flows(flow_file: IO[str], flow_pairs: _FlowPairs, slots: list[tuple[TraceWriter, ...]],
                 tracks: dict[str, set[tuple[int, int]]], tids: _SyntheticTids, notes: dict[str, int],
                 sync_ends: set[tuple[int, int, Any]]) -> None:
    """Append the flow events whose ``(cat, id)`` has exactly one start and one end to the views.

    ``slots``: each slot's writer of every view, in :data:`VIEWS` order (:func:`split_trace`); a flow whose two ends
    lie in different windows of a view is left out of that view (each window keeps the rules of
    ``sftprof/analysis/trace/check.py``). ``ac2g`` ends on a host thread with CUDA API calls sit at such a call (the
    launch, or a synchronising call): in ``split_clean`` they move with it to the thread's API track. An ``ac2g``
    end (``f``) whose ``(pid, tid, id)`` is a CUDA sync event's ``(pid, tid, correlation)`` (``sync_ends``)
    moves with that event to its sync track, in every view.
    """
    flow_pairs.finish()
    flow_file.seek(0)
    api_threads = tracks["api"]
    views = [VIEWS.index(v) for v in (_CHROME, _CLEAN, _CPU)]
    together = [tuple(here[i].write for i in views) for here in slots]  # per slot, for a flow whose ends it holds
    for line in flow_file:
        cat, fid_text, ph, pid_text, tid_text, slot, raw = line.rstrip("\n").split("\t", 6)
        fid = int(fid_text) if fid_text.isdigit() else json.loads(fid_text)
        if not flow_pairs.paired(cat, fid, ph):
            notes["unpaired flow events left out"] += 1
            continue
        ends = flow_pairs.apart(cat, fid)
        if ends is None:
            full, clean, cpu_w = together[int(slot)]
        else:
            here = slots[int(slot)]
            full, clean, cpu_w = (here[i].write if slots[ends[0]][i] is slots[ends[1]][i] else _left_out for i in views)
        pid, tid = int(pid_text), int(tid_text)
        if cat == "ac2g" and ph == "f" and type(fid) is int and (pid, tid, fid) in sync_ends:
            raw = _moved(raw, None, tid, tids.get(pid, "sync", tid))
            full(raw)
            clean(raw)
            continue
        full(raw)
        if cat == "fwdbwd":
            clean(raw)
            cpu_w(raw)
        elif (pid, tid) in api_threads:
            clean(_moved(raw, None, tid, tids.get(pid, "api", tid)))
        else:
            clean(raw)


def _write_metadata(metadata: list[dict[str, Any]], writers: dict[str, _ViewWriter],
                    tracks: dict[str, set[tuple[int, int]]], tids: _SyntheticTids, step_views: set[str]) -> None:
    """One ``process_name`` per process and one ``thread_name`` per track in each view; fresh names in split_clean.

    ``step_views``: the views among ``gpu_only`` and ``cuda_api_only`` that hold the step slices
    (``tracks["step"]``), whose process and annotation track they name too.
    """
    proc: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)  # pid -> metadata name -> last record
    thread_names: dict[tuple[int, int], list[str]] = defaultdict(list)
    thread_other: dict[tuple[int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for ev in metadata:
        name, pid, tid = ev.get("name"), ev["pid"], ev.get("tid")
        if not isinstance(name, str) or not isinstance(ev.get("args"), dict):
            continue
        if name == "thread_name" and _track_id(tid) and isinstance(ev["args"].get("name"), str):
            thread_names[(pid, tid)].append(ev["args"]["name"])
        elif name == "thread_sort_index" and _track_id(tid) and type(ev["args"].get("sort_index")) is int:
            thread_other[(pid, tid)][name] = ev
        elif name == "process_name" and isinstance(ev["args"].get("name"), str) or \
                name == "process_labels" and isinstance(ev["args"].get("labels"), str) or \
                name == "process_sort_index" and type(ev["args"].get("sort_index")) is int:
            proc[pid][name] = ev
    host_tracks = tracks["cpu"] | tracks["api"] | tracks["ann"]
    gpu_pids = {p for p, _ in tracks["gpu"] | tracks["sync"]}
    step_pids = {v: {p for p, _ in tracks["step"]} if v in step_views else set() for v in (_GPU, _API)}
    # view -> the processes and tracks it names (None: all)
    per_view: dict[str, tuple[Optional[set[int]], Optional[set[tuple[int, int]]]]] = {
        _CHROME: (None, None), _GPU: (gpu_pids | step_pids[_GPU], tracks["gpu"]),
        _CPU: ({p for p, _ in tracks["cpu"] | tracks["ann"]}, tracks["cpu"] | tracks["ann"]),
        _API: ({p for p, _ in tracks["api"]} | step_pids[_API], tracks["api"])}
    for view, (pids, view_tracks) in per_view.items():
        w = writers[view]
        for pid in sorted(proc):
            if pids is None or pid in pids:
                for ev in proc[pid].values():
                    w.write(json.dumps(ev, separators=_COMPACT))
        for track in sorted(set(thread_names) | set(thread_other)):
            if view_tracks is not None and track not in view_tracks:
                continue
            if track in thread_names:
                w.write(_meta("thread_name", *track, {"name": _thread_label(thread_names[track], track[1])}))
            for ev in thread_other[track].values():
                w.write(json.dumps(ev, separators=_COMPACT))
        if view in (_CHROME, _CPU):  # the made-up annotation tracks
            _annotation_names(w, tracks["ann"], tids, thread_names)
        elif view in step_views:  # the annotation tracks of the step slices
            _annotation_names(w, tracks["step"], tids, thread_names)
        if view in (_CHROME, _GPU):  # the made-up CUDA sync tracks
            for pid, tid in sorted(tracks["sync"]):
                w.write(_meta("thread_name", pid, tids.get(pid, "sync", tid),
                              {"name": _sync_label(thread_names, pid, tid)}))
    clean = writers[_CLEAN]
    host_pids = sorted({p for p, _ in host_tracks})
    for order, pid in enumerate(host_pids):
        clean.write(_meta("process_name", pid, 0, {"name": f"Host process {pid}"}))
        clean.write(_meta("process_sort_index", pid, 0, {"sort_index": order}))
    for order, (pid, tid) in enumerate(sorted(host_tracks)):
        label = _thread_label(thread_names.get((pid, tid), []), tid)
        for k, (kind, title) in enumerate((("cpu", "CPU ops"), ("ann", "Annotations"),
                                           ("api", "CUDA API (runtime/driver)"))):
            if (pid, tid) not in tracks[kind]:
                continue
            t = tid if kind == "cpu" else tids.get(pid, kind, tid)
            clean.write(_meta("thread_name", pid, t, {"name": f"{title}: {label}"}))
            clean.write(_meta("thread_sort_index", pid, t, {"sort_index": 3 * order + k}))
    for order, dev in enumerate(sorted(gpu_pids)):
        clean.write(_meta("process_name", dev, 0, {"name": f"GPU {dev}"}))
        clean.write(_meta("process_sort_index", dev, 0, {"sort_index": 1_000_000 + order}))
    for pid, tid in sorted(tracks["gpu"]):
        clean.write(_meta("thread_name", pid, tid, {"name": f"GPU {pid} stream {tid}"}))
        clean.write(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
    for pid, tid in sorted(tracks["sync"]):
        t = tids.get(pid, "sync", tid)
        clean.write(_meta("thread_name", pid, t, {"name": f"GPU {pid} {_sync_label(thread_names, pid, tid)}"}))
        clean.write(_meta("thread_sort_index", pid, t, {"sort_index": tid}))


def _sync_label(thread_names: dict[tuple[int, int], list[str]], pid: int, tid: int) -> str:
    """``CUDA sync: stream 7`` for the sync track of GPU track ``(pid, tid)`` (its names, else its tid)."""
    names = list(dict.fromkeys(n.strip() for n in thread_names.get((pid, tid), []) if n.strip()))
    return f"CUDA sync: {', '.join(names) if names else f'thread {tid}'}"


def _annotation_names(w: _ViewWriter, ann_tracks: set[tuple[int, int]], tids: _SyntheticTids,
                      thread_names: dict[tuple[int, int], list[str]]) -> None:
    for pid, tid in sorted(ann_tracks):
        w.write(_meta("thread_name", pid, tids.get(pid, "ann", tid),
                      {"name": f"Annotations: {_thread_label(thread_names.get((pid, tid), []), tid)}"}))

