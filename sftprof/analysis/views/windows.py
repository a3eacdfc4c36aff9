"""A view too large for Perfetto's web UI, rewritten into consecutive time windows (``<view>.part<k>/`` folders),
each a valid trace with all the metadata (:func:`split_into_windows`; :func:`sftprof.analysis.views.split.split_trace` calls
it for every view above its ``max_view_bytes``)."""
from __future__ import annotations

import json
import os
from array import array
from bisect import bisect_right
from collections import defaultdict

import numpy as np

from sftprof.analysis.trace.io import Progress, TraceReader, TraceWriter
from sftprof.artifacts import window_path

__all__ = ["split_into_windows", "FLOW_PHASES"]

FLOW_PHASES = frozenset("stf")  # the phases of flow events (start, step, finish)


def _flow_key(ev: dict) -> tuple:
    """``(cat, id)`` of a flow event (an id that is neither int nor str is keyed by its JSON text)."""
    fid = ev.get("id")
    return ev.get("cat"), fid if type(fid) in (int, str) else json.dumps(fid)


def split_into_windows(path: str, max_bytes: int, *, progress: bool = True) -> list[str]:
    """Rewrite one view into consecutive time windows of at most ~``max_bytes`` of events each.

    Two streaming passes: the first records each event's ``ts`` and size, the second writes the
    parts to ``<view>.part<k>/`` folders (:func:`sftprof.artifacts.window_path`); every part
    carries the header and all metadata events. The original file is removed. Flow arrows whose ends fall
    into different windows are left out (each part keeps the rules of ``sftprof/analysis/trace/check.py``).

    Args:
        path: a view written by :func:`sftprof.analysis.views.split.split_trace` (``.json`` or ``.json.gz``).
        max_bytes: target upper bound of event bytes per part (metadata bytes come on top).

    Returns:
        The part paths in time order.
    """
    ts_list = array("d")
    sizes = array("q")
    flow_ts: dict[tuple, list[float]] = defaultdict(list)
    reader = TraceReader(path, Progress(f"{os.path.basename(path)} (windows, pass 1)",
                                        os.path.getsize(path)) if progress else None)
    for raw, ev in reader.events():
        ts = ev.get("ts")
        if ev.get("ph") != "M" and isinstance(ts, (int, float)):
            ts_list.append(float(ts))
            sizes.append(len(raw) + 2)
            if ev["ph"] in FLOW_PHASES:
                flow_ts[_flow_key(ev)].append(float(ts))
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
    cut_flows = {k for k, tss in flow_ts.items() if len({bisect_right(cuts, t) for t in tss}) > 1}
    del flow_ts
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
            elif ev["ph"] not in FLOW_PHASES or _flow_key(ev) not in cut_flows:
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
