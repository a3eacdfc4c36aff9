"""A view too large for Perfetto's web UI, in consecutive time windows (``<view>.part<k>/`` folders), each a valid
trace with all the metadata.

:func:`sftprof.analysis.views.split.split_trace` writes a large view straight into its windows in its one pass
(:class:`WindowedView`): before that pass, a first look at the raw trace (:func:`sample_events`: the events at a few
thousand evenly spaced byte offsets, read without parsing the trace) estimates each view's bytes over time, and
:func:`window_cuts` places the windows' boundaries from that estimate. A file found too large only after it was
written (a view the estimate put under the limit; the merged view of all ranks) is rewritten by
:func:`split_into_windows`, two more passes over it."""
from __future__ import annotations

import gzip
import io
import itertools
import json
import math
import os
from array import array
from bisect import bisect_right
from collections import defaultdict
from typing import Any, Callable, Optional, TypeVar

import numpy as np
import orjson

from sftprof.analysis.trace.io import Progress, TraceReader, TraceWriter
from sftprof.artifacts import window_path

__all__ = ["split_into_windows", "FLOW_PHASES", "SAMPLES", "WINDOW_DECIDE", "WINDOW_FILL", "sample_events",
           "window_cuts", "WindowedView"]

FLOW_PHASES = frozenset("stf")  # the phases of flow events (start, step, finish)
SAMPLES = 4096  # byte offsets the first look reads (sample_events)
WINDOW_DECIDE = 0.95  # a view estimated above this share of the limit is written in windows (a margin for the
# estimate's error: a view it puts just under the limit but found above it costs two more passes)
WINDOW_FILL = 0.9  # windows placed by the estimate hold this share of the limit, a margin for its error
_NEAR = 1 << 14  # bytes read on each side of a sampled offset: a longer event is not sampled
_WHOLE = 64 << 20  # a plain trace up to this size is read whole by the first look (else one read per offset)
_READ = 8 << 20  # bytes of a compressed trace decompressed per read by the first look
T = TypeVar("T")


def _event_at(buf: bytes, r: int, sep: bytes) -> Optional[dict[str, Any]]:
    """The event of ``buf`` whose text holds byte ``r`` (or the separator before it), cut at ``sep``; None when no
    whole event there (the first or last event, one longer than ``buf`` holds) or orjson refuses its text."""
    i = buf.rfind(sep, 0, r + len(sep))
    j = buf.find(sep, i + 1) if i >= 0 else -1
    if j < 0:
        return None
    try:
        ev = orjson.loads(buf[i + len(sep) - 1:j + 1])
    except orjson.JSONDecodeError:
        return None
    return ev if type(ev) is dict else None


def sample_events(path: str, classify: Callable[[dict[str, Any]], Optional[T]],
                  n: int = SAMPLES) -> tuple[float, list[Optional[T]]]:
    """The first look at a large trace: ``classify`` of the event that holds each of about ``n`` evenly spaced byte
    offsets of its text (plain or ``.json.gz``), found by the text between two events (:attr:`TraceReader.separator`)
    and read with orjson, without parsing the rest of the trace.

    An event is drawn in proportion to its size, so each entry stands for ``stride`` bytes of the trace: the
    bytes of any kind of event in any time range are estimated as ``stride`` times the entries of that kind and
    range. A compressed trace is decompressed once, start to end; a plain one larger than 64 MiB is read only around
    each offset.

    Returns:
        ``(stride, entries)``: bytes per entry, and one entry per offset in file order (None where no event was
        found whole: the header, the first and last event, an event longer than 16 KiB).
    """
    reader = TraceReader(path)
    for _ in itertools.islice(reader.events(), 2):
        pass
    sep = reader.separator.encode()
    reader.close()
    if not sep:
        return 1.0, []
    if path.endswith(".gz"):
        with open(path, "rb") as f:  # the gzip trailer's size (modulo 4 GiB): the stride to start from
            f.seek(-4, os.SEEK_END)
            size = int.from_bytes(f.read(4), "little")
        with gzip.open(path, "rb") as f:
            return _sample_stream(f, size, sep, classify, n)
    size = os.path.getsize(path)
    if size <= _WHOLE:
        with open(path, "rb") as f:
            return _sample_stream(f, size, sep, classify, n)
    stride = size / n
    out: list[Optional[T]] = []
    with open(path, "rb") as f:
        for k in range(n):
            lo = max(0, int(k * stride) - _NEAR)
            f.seek(lo)
            ev = _event_at(f.read(2 * _NEAR), int(k * stride) - lo, sep)
            out.append(None if ev is None else classify(ev))
    return stride, out


def _sample_stream(f: io.BufferedIOBase, size: int, sep: bytes,
                   classify: Callable[[dict[str, Any]], Optional[T]], n: int) -> tuple[float, list[Optional[T]]]:
    """:func:`sample_events` over a stream read start to end (``size``: its length, or a guess): whenever the
    entries reach ``2 n``, every other one is dropped and the stride doubles, so at most ``2 n`` are kept."""
    stride = max(size / n, 1.0)
    buf, base, eof = b"", 0, False
    out: list[Optional[T]] = []
    while not eof:
        data = f.read(_READ)
        eof = not data
        buf += data
        while (k := len(out)) * stride < base + len(buf) and (eof or k * stride + _NEAR <= base + len(buf)):
            ev = _event_at(buf, int(k * stride) - base, sep)
            out.append(None if ev is None else classify(ev))
            if len(out) >= 2 * n:
                out, stride = out[::2], 2 * stride
        drop = max(0, min(int(len(out) * stride) - _NEAR - base, len(buf)))
        buf, base = buf[drop:], base + drop
    return stride, out


def window_cuts(ts: list[float], stride: float, max_bytes: int) -> list[float]:
    """The boundaries of a view's time windows from the first look: ``ts``, the sorted start times of the view's
    sampled events (:func:`sample_events`), each standing for ``stride`` bytes. ``[]`` (one file) when the estimate,
    ``stride * len(ts)``, is within :data:`WINDOW_DECIDE` of ``max_bytes``; else ``k - 1`` start times splitting the
    samples into ``k`` equal shares, each estimated at most :data:`WINDOW_FILL` of ``max_bytes`` (window ``j`` holds
    the events with ``cuts[j - 1] <= ts < cuts[j]``)."""
    total = stride * len(ts)
    if total <= WINDOW_DECIDE * max_bytes:
        return []
    k = math.ceil(total / (WINDOW_FILL * max_bytes))
    cuts: list[float] = []
    for j in range(1, k):
        t = ts[math.ceil(j * len(ts) / k)]
        if not cuts or t > cuts[-1]:
            cuts.append(t)
    return cuts


class WindowedView:
    """One view written straight into its time windows (``cuts``: :func:`window_cuts`; ``path``: the view's path,
    each window at :func:`sftprof.artifacts.window_path`). Events go to the window of their start
    (:meth:`at`); :meth:`write` gives one (metadata) to every window.

    Raises:
        WriteError: a window cannot be written (:class:`TraceWriter`).
    """

    def __init__(self, path: str, header: dict[str, Any], cuts: list[float]):
        self.cuts = cuts
        self.parts: list[TraceWriter] = []
        for k in range(len(cuts) + 1):
            os.makedirs(os.path.dirname(window_path(path, k)), exist_ok=True)
            self.parts.append(TraceWriter(window_path(path, k), header))

    def at(self, ts: float) -> TraceWriter:
        """The window of an event starting at ``ts``."""
        return self.parts[bisect_right(self.cuts, ts)]

    def write(self, raw: str) -> None:
        for w in self.parts:
            w.write(raw)

    def flush(self) -> None:
        for w in self.parts:
            w.flush()

    def close(self, trailer: dict[str, Any] | None = None) -> list[str]:
        """Close every window (:meth:`TraceWriter.close`); their paths in time order."""
        for w in self.parts:
            w.close(trailer)
        return [w.path for w in self.parts]

    def abort(self) -> None:
        """Delete the windows written so far and their folders (when empty)."""
        for w in self.parts:
            w.abort()
            try:
                os.rmdir(os.path.dirname(w.path))
            except OSError:  # another rank's window is in it
                pass


def _flow_key(ev: dict[str, Any]) -> tuple[Any, Any]:
    """``(cat, id)`` of a flow event (an id that is neither int nor str is keyed by its JSON text)."""
    fid = ev.get("id")
    return ev.get("cat"), fid if type(fid) in (int, str) else json.dumps(fid)


def split_into_windows(path: str, max_bytes: int, *, progress: bool = True) -> list[str]:
    """Rewrite one written view into consecutive time windows of at most ~``max_bytes`` of events each.

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
    flow_ts: dict[tuple[Any, Any], list[float]] = defaultdict(list)
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
