"""Split one rank's Chrome trace into the five views users open in Perfetto.

One streaming pass over a rank's raw trace writes, side by side (file layout:
:mod:`sftprof.profiling.layout`, ``<out_dir>/<view>/rank<rank>.pt.trace.json``):

============================  ==================================================================
``chrome``                    the whole trace, normalised (top-level members first, one event a
                              line, metadata events last)
``split_clean.chrome``        host CPU ops, CUDA runtime/driver API calls and GPU work on separate,
                              named tracks; CPU->GPU flow arrows (``ac2g``) kept and re-anchored on
                              the API track; profiler bookkeeping (overhead, string-pid spans) dropped
``gpu_only.chrome``           kernels, memcpy, memset, GPU user annotations + GPU track metadata
``cpu_only.chrome``           cpu_op, user_annotation, python_function events (+ fwd/bwd flows)
``cuda_api_only.chrome``      cuda_runtime and cuda_driver events
============================  ==================================================================

Metadata events (``ph == "M"``) are buffered (there are few) and written at the end of each
view, filtered to the processes/threads that view contains. A view larger than
``max_view_bytes`` is rewritten into time windows in ``<view>.part<k>/`` folders (each with all the
metadata) so that every file opens in Perfetto's web UI.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from array import array
from bisect import bisect_right
from typing import Callable

import numpy as np

from sftprof.profiling.layout import view_path, window_path
from sftprof.profiling.trace_io import Progress, TraceReader, TraceWriter

__all__ = ["VIEWS", "MAX_VIEW_BYTES", "API_TID_OFFSET", "view_path", "split_trace", "split_into_windows"]

VIEWS = ("chrome", "split_clean.chrome", "gpu_only.chrome", "cpu_only.chrome", "cuda_api_only.chrome")
MAX_VIEW_BYTES = 1_500_000_000  # Perfetto's web UI struggles with single JSON files beyond ~1.5-2 GB
API_TID_OFFSET = 1_000_000_000  # split_clean: CUDA API track of host thread t is tid t + offset

_CPU_CATS = frozenset({"cpu_op", "user_annotation", "python_function", "cpu_instant_event"})
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
_API_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_COMPACT = (",", ":")


def _meta(name: str, pid, tid, args: dict) -> str:
    return json.dumps({"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}, separators=_COMPACT)


def _empty_view_event(view: str) -> str:
    """The one event of a view that selected nothing (e.g. ``gpu_only`` of a CPU run).

    A ``process_name`` metadata record that says so; it carries ``ts``, ``dur`` and ``cat``
    (``__metadata``, as Chrome writes for metadata) because HolisticTraceAnalysis 0.5.0 cannot load
    a trace whose events lack those columns (``KeyError: 'ts'``).
    """
    return json.dumps({"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0, "dur": 0, "cat": "__metadata",
                       "args": {"name": f"{view.removesuffix('.chrome')}: no events in this trace"}},
                      separators=_COMPACT)


def _split_clean_metadata(cpu_tracks, api_tracks, gpu_tracks, thread_names: dict) -> list[str]:
    """Fresh process/thread names and sort order for the split_clean view."""
    out = []
    host_pids = sorted({p for p, _ in cpu_tracks} | {p for p, _ in api_tracks})
    for order, pid in enumerate(host_pids):
        out.append(_meta("process_name", pid, 0, {"name": f"Host process {pid}"}))
        out.append(_meta("process_sort_index", pid, 0, {"sort_index": order}))
    host_tids = sorted(set(cpu_tracks) | {(p, t - API_TID_OFFSET) for p, t in api_tracks})
    for order, (pid, tid) in enumerate(host_tids):
        orig = thread_names.get((pid, tid))
        suffix = f" ({orig})" if orig else ""
        if (pid, tid) in cpu_tracks:
            out.append(_meta("thread_name", pid, tid, {"name": f"CPU ops: thread {tid}{suffix}"}))
            out.append(_meta("thread_sort_index", pid, tid, {"sort_index": 2 * order}))
        if (pid, tid + API_TID_OFFSET) in api_tracks:
            out.append(_meta("thread_name", pid, tid + API_TID_OFFSET,
                             {"name": f"CUDA API (runtime/driver): thread {tid}"}))
            out.append(_meta("thread_sort_index", pid, tid + API_TID_OFFSET, {"sort_index": 2 * order + 1}))
    for order, dev in enumerate(sorted({p for p, _ in gpu_tracks})):
        out.append(_meta("process_name", dev, 0, {"name": f"GPU {dev}"}))
        out.append(_meta("process_sort_index", dev, 0, {"sort_index": 1_000_000 + order}))
    for pid, tid in sorted(gpu_tracks):
        out.append(_meta("thread_name", pid, tid, {"name": f"GPU {pid} stream {tid}"}))
        out.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
    return out


def split_trace(src: str, out_dir: str, rank: int, *, compress: bool = False,
                max_view_bytes: int = MAX_VIEW_BYTES,
                on_header: Callable[[dict], None] | None = None,
                on_event: Callable[[dict], None] | None = None,
                progress: bool = True) -> dict[str, list[str]]:
    """Write the five views of one rank's trace in a single streaming pass.

    Args:
        src: ``traces-r<rank>.chrome.json`` or ``.json.gz`` (torch.profiler ``export_chrome_trace``).
        out_dir: destination directory (created).
        rank: global rank, used in the output names.
        compress: write ``.json.gz`` instead of ``.json``.
        max_view_bytes: views with more event bytes than this are split into time windows.
        on_header: called once, after the last event, with all top-level members except ``traceEvents``.
        on_event: called with every parsed event dict (e.g. ``KernelTraceAnalyzer.add``).
        progress: print progress lines to stderr.

    Returns:
        ``{view: [file paths]}`` (one path, or the ``part<k>`` paths of a windowed view).

    Raises:
        TraceFormatError: truncated or malformed trace; partially written views are deleted.
    """
    os.makedirs(out_dir, exist_ok=True)
    reader = TraceReader(src, Progress(os.path.basename(src), os.path.getsize(src)) if progress else None)
    writers: dict[str, TraceWriter] = {}
    metadata: list[tuple[str, dict]] = []
    cpu_tracks: set = set()
    api_tracks: set = set()
    gpu_tracks: set = set()
    thread_names: dict = {}
    try:
        events = reader.events()
        first = next(events, None)
        header = dict(reader.header)
        header.setdefault("displayTimeUnit", "ms")
        for view in VIEWS:
            path = view_path(out_dir, rank, view, compress)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            writers[view] = TraceWriter(path, header)
        # Hot loop: append to the writers' pending lists, flush every FLUSH_EVENTS events.
        full, clean = writers["chrome"].pending.append, writers["split_clean.chrome"].pending.append
        gpu_w, cpu_w = writers["gpu_only.chrome"].pending.append, writers["cpu_only.chrome"].pending.append
        api_w = writers["cuda_api_only.chrome"].pending.append
        flush_every = TraceWriter.FLUSH_EVENTS
        countdown = flush_every
        for raw, ev in _chain([first] if first is not None else [], events):
            countdown -= 1
            if not countdown:
                countdown = flush_every
                for w in writers.values():
                    w.flush()
            if on_event is not None:
                on_event(ev)
            ph = ev.get("ph")
            if ph == "M":
                metadata.append((raw, ev))
                if ev.get("name") == "thread_name":
                    thread_names.setdefault((ev.get("pid"), ev.get("tid")), (ev.get("args") or {}).get("name"))
                continue
            full(raw)
            cat = ev.get("cat")
            pid = ev.get("pid")
            if type(pid) is not int:
                continue  # profiler bookkeeping ("Spans", "Traces" pseudo-processes): full view only
            if cat in _CPU_CATS:
                cpu_tracks.add((pid, ev.get("tid")))
                clean(raw)
                cpu_w(raw)
            elif cat in _GPU_CATS:
                gpu_tracks.add((pid, ev.get("tid")))
                clean(raw)
                gpu_w(raw)
            elif cat in _API_CATS:
                api_w(raw)
                clean(_move_to_api_track(raw, ev))
                if type(ev.get("tid")) is int:
                    api_tracks.add((pid, ev["tid"]))
            elif cat == "ac2g":
                # The launch side (ph "s") sits on the host thread: it follows its API call.
                clean(_move_to_api_track(raw, ev) if ph == "s" else raw)
            elif cat == "fwdbwd":
                clean(raw)
                cpu_w(raw)
        # Metadata at the end, filtered per view.
        cpu_pids = {p for p, _ in cpu_tracks}
        gpu_pids = {p for p, _ in gpu_tracks}
        api_pids = {p for p, _ in api_tracks}
        api_host_tracks = {(p, t - API_TID_OFFSET) for p, t in api_tracks}
        for raw, ev in metadata:
            full(raw)
            pid, tid = ev.get("pid"), ev.get("tid")
            thread_level = ev.get("name", "").startswith("thread_")
            for view, pids, tracks in (("gpu_only.chrome", gpu_pids, gpu_tracks),
                                       ("cpu_only.chrome", cpu_pids, cpu_tracks),
                                       ("cuda_api_only.chrome", api_pids, api_host_tracks)):
                if (pid, tid) in tracks if thread_level else pid in pids:
                    writers[view].write(raw)
        for raw in _split_clean_metadata(cpu_tracks, api_tracks, gpu_tracks, thread_names):
            clean(raw)
        for view, w in writers.items():
            if not (w.n_events or w.pending):
                w.write(_empty_view_event(view))
    except BaseException:
        for w in writers.values():
            w.abort()
            with contextlib.suppress(OSError):  # the view folder, unless other ranks' views are in it
                os.rmdir(os.path.dirname(w.path))
        raise
    if on_header is not None:
        on_header(dict(reader.header))
    trailer = {k: v for k, v in reader.header.items() if k not in header}
    result = {}
    for view, w in writers.items():
        w.close(trailer)  # flushes; w.chars is final afterwards
        result[view] = ([w.path] if w.chars <= max_view_bytes
                        else split_into_windows(w.path, max_view_bytes, progress=progress))
    return result


_TID_FIELD = re.compile(r'"tid"\s*:\s*(\d+)')


def _move_to_api_track(raw: str, ev: dict) -> str:
    """Event text with ``tid`` moved by :data:`API_TID_OFFSET` (``ev['tid']`` updated too).

    Edits the first ``"tid": <int>`` of the source text (cheaper than re-encoding); falls back to
    ``json.dumps`` when that field does not hold the event's tid.
    """
    tid = ev.get("tid")
    if type(tid) is not int:
        return raw  # not a host thread id: leave the event where it is
    ev["tid"] = tid + API_TID_OFFSET
    m = _TID_FIELD.search(raw)
    if m is not None and int(m.group(1)) == tid:
        return f"{raw[:m.start(1)]}{tid + API_TID_OFFSET}{raw[m.end(1):]}"
    return json.dumps(ev, separators=_COMPACT)


def _chain(first: list, rest):
    yield from first
    yield from rest


def split_into_windows(path: str, max_bytes: int, *, progress: bool = True) -> list[str]:
    """Rewrite one view into consecutive time windows of at most ~``max_bytes`` of events each.

    Two streaming passes: the first records each event's ``ts`` and size, the second writes the
    parts to ``<view>.part<k>/`` folders (:func:`sftprof.profiling.layout.window_path`); every part
    carries the header and all metadata events. The original file is removed. Flow arrows whose ends fall into different windows are cut.

    Args:
        path: a view written by :func:`split_trace` (``.json`` or ``.json.gz``).
        max_bytes: target upper bound of event bytes per part (metadata bytes come on top).

    Returns:
        The part paths in time order.
    """
    ts_list = array("d")
    sizes = array("q")
    reader = TraceReader(path, Progress(f"{os.path.basename(path)} (windows, pass 1)",
                                        os.path.getsize(path)) if progress else None)
    for raw, ev in reader.events():
        ts = ev.get("ts")
        if ev.get("ph") != "M" and isinstance(ts, (int, float)):
            ts_list.append(float(ts))
            sizes.append(len(raw) + 2)
    header = reader.header
    ts_arr = np.frombuffer(ts_list, dtype=np.float64)
    order = np.argsort(ts_arr, kind="stable")
    ts_sorted, size_sorted = ts_arr[order], np.frombuffer(sizes, dtype=np.int64)[order]
    del order, ts_arr
    cuts: list[float] = []  # start ts of windows 1..k-1; greedy fill up to max_bytes per window
    acc = 0
    for ts, size in zip(ts_sorted.tolist(), size_sorted.tolist()):
        if acc + size > max_bytes and acc > 0 and (not cuts or ts > cuts[-1]):
            cuts.append(ts)
            acc = 0
        acc += size
    del ts_sorted, size_sorted, ts_list, sizes
    for k in range(len(cuts) + 1):
        os.makedirs(os.path.dirname(window_path(path, k)), exist_ok=True)
    parts = [TraceWriter(window_path(path, k), header) for k in range(len(cuts) + 1)]
    metadata = []
    reader = TraceReader(path, Progress(f"{os.path.basename(path)} (windows, pass 2)",
                                        os.path.getsize(path)) if progress else None)
    try:
        for raw, ev in reader.events():
            ts = ev.get("ts")
            if ev.get("ph") == "M" or not isinstance(ts, (int, float)):
                metadata.append(raw)
            else:
                parts[bisect_right(cuts, ts)].write(raw)
        for w in parts:
            for raw in metadata:
                w.write(raw)
    except BaseException:
        for w in parts:
            w.abort()
        raise
    for w in parts:
        w.close()
    os.remove(path)
    return [w.path for w in parts]
