"""One timeline for all ranks: the ranks' ``chrome`` views of a trial merged into one Chrome trace for Perfetto.

Layout. Each rank is one process (``pid`` = the rank, named ``rank <r>``, sorted by rank); its tracks are the tracks
of its ``chrome`` view (host threads, their annotation and CUDA API tracks, GPU streams, CUDA sync tracks), numbered
``j * n + k`` for the ``j``-th track (from 1) of the ``k``-th of ``n`` ranks, so that no two ranks share a ``tid``
(tools that key threads by ``tid`` alone, as TensorBoard's profiler plugin does, would nest one rank's ops in
another's), and named ``<its process>: <its track>`` (``host 1643: thread 1643 (python3)``, ``GPU 0: stream 7``),
host tracks first. The file is ``all_ranks.trace.json``, no ``*.pt.trace.json`` name: not one rank's trace
(TensorBoard's plugin lists those as workers; docs/peer_tools.md says what each tool sees). Every event of every
rank's view is in the file once, with its ``pid``/``tid`` replaced and its ``ts`` moved onto the common clock
(below); flow ids (``ac2g``, ``fwdbwd``) become ``id * n + k`` for the ``k``-th of ``n`` ranks, so that arrows stay
within their rank; metadata are written afresh. So the merged file keeps the rules of
``sftprof/analysis/trace/check.py`` that each view keeps.

Clocks. A rank's timestamps are on its host's clock (CUDA activity converted to it by CUPTI), relative to its
trace's ``baseTimeNanoseconds``. Ranks are aligned on the end of collectives: an NCCL collective ends on every
member rank at nearly the same moment (it completes when the last rank's data has arrived), whatever the time each
rank reached it, so the end times of the same call on two ranks differ by their clock offset only. The offsets are
those :func:`sftprof.analysis.time.comm_wait.split` measures, the median over the matched calls of a process group of
the end-time difference (pairs of ranks, chained from the lowest rank through the groups, pair by pair). The
profiler step's start (``ProfilerStep#<n>``) would not do: each rank's host enters the step when it is done with
its own work, so aligning on it would erase the skew between ranks that this view is meant to show. Precision:
single calls' end differences scatter around the median by the spread each offset states (median absolute
deviation, ``mad_us``; on one host a few microseconds: comm_wait's module docstring), the median of ``n`` calls
less; a chain adds the errors of its pairs. A rank with no collective in common with the others' chain keeps its
trace clock (its base time only) and says so: on one host, one clock; across hosts, unaligned.

Timestamps are rewritten as ``round(ts - base - offset, 3)`` microseconds, ``base`` a whole second one hour before
the lowest rank's first event (``baseTimeNanoseconds`` moves by as much): with values that small float64 holds every
nanosecond exactly, so slices that nest in the views still nest.

Windows. A merged file larger than ``max_view_bytes`` is written in time windows like any view
(:mod:`sftprof.analysis.views.windows`), in the same pass: the ranks' conversions record the time of the event at
every ``stride`` bytes of their text (``stride``: the views' bytes over
:data:`~sftprof.analysis.views.windows.SAMPLES`), from which :func:`~sftprof.analysis.views.windows.window_cuts`
places the windows, and the time and flow of each converted line, by which the copy sends it to its window (a flow
whose ends fall in two windows to none). A file the estimate put under the limit but written above it is rewritten
into windows after (:func:`~sftprof.analysis.views.windows.split_into_windows`).
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil
import tempfile
from array import array
from collections import defaultdict, deque
from concurrent.futures import ProcessPoolExecutor
from itertools import islice
from typing import Any, Iterator, Optional, Union

import numpy as np

from sftprof.artifacts import MERGED_VIEW, merged_view_path
from sftprof.analysis.time.schema import ClockOffset
from sftprof.analysis.trace.io import TraceReader, TraceWriter
from sftprof.analysis.views.schema import ClockShift, MergedView
from sftprof.analysis.views.split import MAX_VIEW_BYTES
from sftprof.analysis.views.windows import SAMPLES, WindowedView, split_into_windows, window_cuts

__all__ = ["clock_shifts", "write_merged_view", "merge_trial", "merged_files"]

_COMPACT = (",", ":")
_FLOWS = frozenset("stf")
_MARGIN_US = 3_600_000_000  # the merged clock starts an hour before the lowest rank's first event
_WRAPPED = re.compile(r"^thread \d+ \((.*)\)$")  # views' label of a renamed thread: "thread 7 (stream 7 )"
_NUMBER = re.compile(r"(?:thread|stream|Device) (\d+)")
# torch's order of the fields the merge rewrites: ["id": N, ]"pid": N, "tid": N, "ts": T
_PID_TID_TS = re.compile(r'"pid":\s*(?P<pid>\d+),\s*"tid":\s*(?P<tid>\d+),\s*'
                         r'"ts":\s*(?P<ts>-?[0-9.]+(?:[eE][-+]?\d+)?)')
_ID_PID_TID_TS = re.compile(r'"id":\s*(?P<id>\d+),\s*' + _PID_TID_TS.pattern)
_NO_FLOW = -1  # the flow key of a line that is not a flow event (_convert_rank)
_COPY_LINES = 1 << 20  # converted lines sent to their windows per round (_copy_rank)


def clock_shifts(ranks: list[int], offsets: Optional[list[ClockOffset]],
                 base_ns: dict[int, int]) -> dict[int, ClockShift]:
    """How each rank's timestamps move onto the lowest rank's clock.

    Args:
        ranks: the merged ranks (sorted; the first is the reference).
        offsets: :func:`sftprof.analysis.time.comm_wait.split`'s ``clock_offsets`` (``ranks [a, b]``,
            ``median_end_difference_us`` = median of ``end_b - end_a``, ``end_difference_mad_us``, ``calls``), or None.
        base_ns: each rank's ``baseTimeNanoseconds`` (its timestamps count from it).

    Returns:
        rank -> ``{"shift_us"}`` (added to the rank's timestamps), ``"aligned_by"`` (``"collective ends"``,
        ``"reference"`` or ``"trace clock"``) and, when aligned by collectives, ``"path"``: the offsets chained from
        the reference to it.
    """
    ref = ranks[0]
    edges: dict[int, list[tuple[int, float, ClockOffset]]] = defaultdict(list)
    for o in offsets or []:
        a, b = o["ranks"]
        edges[a].append((b, o["median_end_difference_us"], o))
        edges[b].append((a, -o["median_end_difference_us"], o))
    # d[r]: rank r's clock minus the reference's, from the base times, then refined by the collectives
    found: dict[int, tuple[float, list[ClockOffset]]] = {ref: (0.0, [])}
    todo = deque([ref])
    while todo:
        a = todo.popleft()
        for b, diff, o in sorted(edges[a], key=lambda e: e[0]):
            if b not in found and b in ranks:
                found[b] = (found[a][0] + diff, found[a][1] + [o])
                todo.append(b)
    out: dict[int, ClockShift] = {}
    for r in ranks:
        base_shift = (base_ns[r] - base_ns[ref]) / 1000.0  # the rank's ts on the reference's base
        if r == ref:
            out[r] = {"shift_us": 0.0, "aligned_by": "reference"}
        elif r in found:
            d, path = found[r]
            out[r] = {"shift_us": round(-d, 3), "aligned_by": "collective ends", "path": path}
        else:
            out[r] = {"shift_us": round(base_shift, 3), "aligned_by": "trace clock"}
    return out


def _events(paths: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(raw, event)`` of one rank's view files in order (the parts of a windowed view one after another)."""
    for path in paths:
        yield from TraceReader(path).events()


def _track_label(proc: dict[str, str], thread: Optional[str], pid: int,
                 tid: int) -> tuple[str, tuple[bool, int, bool, str]]:
    """``<process>: <track>`` of a track of a rank's view from its metadata names, and its sort key: host tracks
    first, each thread's or stream's own track before the tracks made for it (annotations, CUDA sync)."""
    labels = proc.get("process_labels", "")
    gpu = labels.startswith("GPU")
    name = (thread or "").strip() or f"thread {tid}"
    m = _WRAPPED.match(name)
    if gpu and m:  # "thread 7 (stream 7 )" -> "stream 7"
        name = m.group(1).strip()
    num = _NUMBER.search(name)
    made = name.startswith(("Annotations:", "CUDA sync:"))
    return f"{labels if gpu else f'host {pid}'}: {name}", (gpu, int(num.group(1)) if num else tid, made, name)


def write_merged_view(views: dict[int, list[str]], out_path: str, offsets: Optional[list[ClockOffset]], *,
                      max_view_bytes: int = MAX_VIEW_BYTES, jobs: int = 1,
                      progress: bool = True) -> tuple[list[str], dict[int, ClockShift]]:
    """Write the ranks' ``chrome`` views as one trace (module docstring).

    Each rank's events are rewritten in a worker process of their own (``jobs`` at a time) into a temporary file next
    to ``out_path``, which are then copied one after another into the merged file.

    Args:
        views: rank -> the paths of its ``chrome`` view (one file, or its time windows in order).
        out_path: the merged file (``.json`` or ``.json.gz``); its folder is created.
        offsets: :func:`sftprof.analysis.time.comm_wait.split`'s ``clock_offsets`` (None: no collective was matched).
        max_view_bytes: a larger merged file is cut into time windows.
        jobs: worker processes.

    Returns:
        The merged file's path (or its windows' paths) and each rank's :func:`clock_shifts`.

    Raises:
        TraceFormatError: a view cannot be read (the partly written files are deleted).
    """
    ranks = sorted(views)
    first: dict[int, Optional[float]] = {}  # the rank's first timed event's ts (us)
    headers: dict[int, dict[str, Any]] = {}
    for r in ranks:
        reader = TraceReader(views[r][0])
        ev = next((e for _, e in reader.events() if e.get("ph") != "M" and isinstance(e.get("ts"), (int, float))),
                  None)
        headers[r] = reader.header  # the members before the events
        first[r] = None if ev is None else ev["ts"]
    shifts = clock_shifts(ranks, offsets, {r: int(headers[r].get("baseTimeNanoseconds") or 0) for r in ranks})
    starts = [f + shifts[r]["shift_us"] for r in ranks if (f := first[r]) is not None]
    base_us = math.floor(min(starts) / 1e6) * 1_000_000 - _MARGIN_US if starts else 0
    header = {"schemaVersion": headers[ranks[0]].get("schemaVersion", 1), "displayTimeUnit": "ms",
              "baseTimeNanoseconds": int(headers[ranks[0]].get("baseTimeNanoseconds") or 0) + base_us * 1000,
              "traceName": "all ranks: " + ", ".join(f"rank {r}" for r in ranks),
              "sftprof_ranks": [{"rank": r, **shifts[r]} for r in ranks]}
    folder = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(folder, exist_ok=True)
    parts = {r: os.path.join(folder, f".rank{r}.events") for r in ranks}
    stride = max(sum(os.path.getsize(p) for r in ranks for p in views[r]) / SAMPLES, 1.0)
    args = [(views[r], parts[r], r, k, len(ranks), base_us, shifts[r]["shift_us"], stride)
            for k, r in enumerate(ranks)]
    writer: Union[TraceWriter, WindowedView, None] = None
    try:
        if jobs <= 1:
            converted = [_convert_rank(*a) for a in args]
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, len(args))) as pool:
                converted = list(pool.map(_convert_rank, *zip(*args)))
        cuts = window_cuts(sorted(t for _, sampled in converted for t in sampled), stride, max_view_bytes)
        writer = WindowedView(out_path, header, cuts) if cuts else TraceWriter(out_path, header)
        for r in ranks:
            _copy_rank(parts[r], writer)
        for lines, _ in converted:
            for raw in lines:
                writer.write(raw)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        for path in parts.values():
            for name in (path, path + ".side"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(name)
    if isinstance(writer, WindowedView):
        return writer.close(), shifts
    writer.close()
    if writer.chars > max_view_bytes:
        return split_into_windows(out_path, max_view_bytes, progress=progress), shifts
    return [out_path], shifts


def _copy_rank(path: str, writer: Union[TraceWriter, WindowedView]) -> None:
    """Copy one rank's converted events (:func:`_convert_rank`'s ``out``, one a line) to the merged file, or to its
    windows: each line to the window of its time, a flow whose two ends fall in different windows to none."""
    with open(path, encoding="utf-8") as f:
        if isinstance(writer, TraceWriter):
            for line in f:
                writer.write(line.rstrip("\n"))
            return
        n = os.path.getsize(path + ".side") // 16
        ts = np.fromfile(path + ".side", dtype=np.float64, count=n)
        key = np.fromfile(path + ".side", dtype=np.int64, count=n, offset=8 * n)
        slot = np.searchsorted(np.asarray(writer.cuts, dtype=np.float64), ts, side="right")
        flows = np.flatnonzero(key != _NO_FLOW)
        by_flow = np.lexsort((slot[flows], key[flows]))
        fkey, fslot = key[flows][by_flow], slot[flows][by_flow]
        starts = np.flatnonzero(np.r_[True, fkey[1:] != fkey[:-1]]) if fkey.size else np.zeros(0, dtype=np.int64)
        apart = fkey[starts][np.minimum.reduceat(fslot, starts) != np.maximum.reduceat(fslot, starts)] \
            if starts.size else fkey[:0]
        drop = np.isin(key, apart)
        del ts, key, flows, by_flow, fkey, fslot
        for lo in range(0, n, _COPY_LINES):
            for line, k, left_out in zip(islice(f, _COPY_LINES), slot[lo:lo + _COPY_LINES].tolist(),
                                         drop[lo:lo + _COPY_LINES].tolist()):
                if not left_out:
                    writer.parts[k].write(line.rstrip("\n"))


def _convert_rank(paths: list[str], out: str, rank: int, k: int, n: int, base_us: int, shift_us: float,
                  stride: float) -> tuple[list[str], list[float]]:
    """Write rank ``rank``'s events (the ``k``-th of ``n`` ranks; its view's ``paths``) to ``out``, one a line, on its
    process, with times ``ts - base_us + shift_us``, and beside it (``out + ".side"``) each line's time (float64) and
    flow key (int64: the flow's category and new id, :data:`_NO_FLOW` for other events), all times then all keys.

    Returns:
        The metadata of its process and tracks, and the time of the event at every ``stride`` bytes of ``out``.
    """
    tracks: dict[tuple[Any, Any], int] = {}  # (view pid, view tid) -> tid in the rank's process
    proc: dict[Any, dict[str, str]] = defaultdict(dict)  # view pid -> process_name, process_labels
    thread: dict[tuple[Any, Any], str] = {}
    times, keys = array("d"), array("q")
    # (cat, id) of flows whose id is no int of 62 bits -> its own negative key
    other_ids: dict[tuple[Any, str], int] = {}
    sampled: list[float] = []
    done, mark = 0, 0.0
    with open(out, "w", encoding="utf-8", buffering=1 << 20) as f:
        write = f.write
        for raw, ev in _events(paths):
            pid, tid, ph = ev.get("pid"), ev.get("tid"), ev.get("ph")
            if ph == "M":
                args = ev.get("args") or {}
                name = ev.get("name")
                if name in ("process_name", "process_labels"):
                    proc[pid][name] = str(args.get("name", args.get("labels", "")))
                elif name == "thread_name":
                    thread[(pid, tid)] = str(args.get("name", ""))
                continue
            track = tracks.get((pid, tid))
            if track is None:  # the j-th track of the k-th rank: tid j * n + k, distinct across the ranks
                track = tracks[(pid, tid)] = (len(tracks) + 1) * n + k
            ts = round(ev["ts"] - base_us + shift_us, 3)  # ts - base_us is exact in float64 (module docstring)
            fid = ev.get("id") if ph in _FLOWS else None
            new_id = None if fid is None else fid * n + k if type(fid) is int else f"rank{rank}:{fid}"
            # the fields in place where torch wrote them side by side (the first such run, holding the event's own
            # values: torch writes args last); else the event re-encoded
            m = (_PID_TID_TS if fid is None else _ID_PID_TID_TS).search(raw)
            if (m is not None and int(m.group("pid")) == pid and int(m.group("tid")) == tid
                    and float(m.group("ts")) == ev["ts"] and (fid is None or m.group("id") == str(fid))):
                ident = "" if fid is None else f'"id":{new_id},'
                text = f'{raw[:m.start()]}{ident}"pid":{rank},"tid":{track},"ts":{ts!r}{raw[m.end():]}'
            else:
                ev["pid"], ev["tid"], ev["ts"] = rank, track, ts
                if fid is not None:
                    ev["id"] = new_id
                text = json.dumps(ev, separators=_COMPACT)
            if "\n" in text or "\r" in text:  # line breaks in JSON text are whitespace between tokens
                text = text.replace("\n", " ").replace("\r", " ")
            write(text + "\n")
            times.append(ts)
            if new_id is None:
                keys.append(_NO_FLOW)
            elif type(new_id) is int and 0 <= new_id < 2**62:
                keys.append(2 * new_id + (ev.get("cat") == "fwdbwd"))
            else:  # another id: a negative key of its own
                keys.append(-2 - other_ids.setdefault((ev.get("cat"), str(new_id)), len(other_ids)))
            done += len(text) + 1
            while done > mark:
                sampled.append(ts)
                mark += stride
    with open(out + ".side", "wb") as f:
        times.tofile(f)
        keys.tofile(f)
    labels = {key: _track_label(proc.get(key[0], {}), thread.get(key), *key) for key in tracks}
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    for i, key in enumerate(sorted(tracks, key=lambda key: labels[key][1])):
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tracks[key],
                     "args": {"name": labels[key][0]}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tracks[key],
                     "args": {"sort_index": i}})
    return [json.dumps(m, separators=_COMPACT) for m in meta], sampled


def merged_files(out_dir: str) -> list[str]:
    """Paths of the all-ranks view's files under ``out_dir`` (a trial's ``kernel_traces``; one file, or its time
    windows, of either compression; also an earlier release's ``all_ranks.pt.trace.json``), sorted; none when there
    is no such view."""
    return sorted(glob.glob(os.path.join(out_dir, MERGED_VIEW + "*", MERGED_VIEW + ".*trace.json*")))


def merge_trial(views: dict[int, list[str]], out_dir: str, offsets: Optional[list[ClockOffset]], *, compress: bool,
                max_view_bytes: int = MAX_VIEW_BYTES, jobs: int = 1, rel_to: str) -> Optional[MergedView]:
    """The all-ranks view of a trial's kernel traces (``<out_dir>/all_ranks/``:
    :func:`sftprof.artifacts.merged_view_path`).

    Written to a staging folder next to ``out_dir`` (``.staging_ranks_all_*``), then replacing an earlier postprocess's
    all-ranks files only when it is complete; fewer than two ranks' views leave everything as it is (an earlier
    all-ranks view then stays, named in the summary's warnings:
    :func:`sftprof.analysis.trial.problems.kept_merged_view`).

    Args:
        views: rank -> the paths of its ``chrome`` view written by this postprocess.
        out_dir: the trial's ``kernel_traces`` folder.
        offsets: :func:`sftprof.analysis.time.comm_wait.split`'s ``clock_offsets`` (None: no collective was matched).
        jobs: worker processes (:func:`write_merged_view`).
        rel_to: the folder the returned paths are relative to.

    Returns:
        None with fewer than two ranks; else ``{"files": [...], "ranks": [{"rank", "shift_us", "aligned_by",
        "path"?}]}``, or ``{"error": ...}`` when it could not be written (earlier files kept).
    """
    if len(views) < 2:
        return None
    stage = tempfile.mkdtemp(prefix=".staging_ranks_all_", dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        staged, shifts = write_merged_view(views, merged_view_path(stage, compress), offsets,
                                           max_view_bytes=max_view_bytes, jobs=jobs, progress=False)
        for old in merged_files(out_dir):
            os.remove(old)  # an earlier postprocess's (other compression, other windows)
            if not os.listdir(os.path.dirname(old)):
                os.rmdir(os.path.dirname(old))
        files = []
        for path in staged:
            dst = os.path.join(out_dir, os.path.relpath(path, stage))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(path, dst)
            files.append(os.path.relpath(dst, rel_to))
    except Exception as exc:  # the per-rank views and the summary stand without it
        return {"error": f"the all-ranks view was not written: {type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"files": files, "ranks": [{"rank": r, **shifts[r]} for r in sorted(views)]}
