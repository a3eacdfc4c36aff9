"""A kernel trial's traces: each rank's trace found in the log dir, split into views and summarised in one pass
(:func:`_process_trace`, in worker processes; given a spare core per trace, its views are written by a worker while
the trace is read again for the summary), its model-part plot drawn, and the cross-rank products made from all
of them (:func:`trace_part`).

A rank's views and plot replace an earlier postprocess's only when its trace splits without error: the views are
written to a staging folder next to ``RUN_DIR/kernel_traces`` and moved into place when complete; a trace that fails
(or is not this trial's: another step's or rank's, a rank outside the world size) leaves what was there, named in
its entry (``kept_views``, ``kept_files``). So does a trace that holds no events but metadata (``{"traceEvents":
[]}``: :meth:`~sftprof.analysis.time.trace_summary.KernelTraceAnalyzer.no_events_error`), and one whose summary's
temporary CPU-op folder cannot be written (a full ``TMPDIR``: :class:`~sftprof.analysis.trace.op_store.TempSpaceError`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import NotRequired, TypedDict

from sftprof import artifacts
from sftprof.analysis.time import comm_wait
from sftprof.analysis.views import merged as merged_view
from sftprof.analysis.trial.inputs import World, file_error, outside_world
from sftprof.analysis.time.model_parts import plot_parts
from sftprof.analysis.time.schema import CallRecords, KernelSummary
from sftprof.analysis.trial.schema import Files, SkippedFile, TraceEntry
from sftprof.analysis.trace.op_store import TempSpaceError
from sftprof.analysis.trace.sanity import sanity_error
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer, identity_problems, invalid_events_error
from sftprof.analysis.views.split import VIEWS, read_for_summary, split_trace, view_links
from sftprof.artifacts import KERNEL_TRACES, raw_trace_rank, trace_name, unrenamed_trace_rank
from sftprof.atomic import atomic_path, write_failed

__all__ = ["trace_part", "MODEL_PARTS_DIR"]

MODEL_PARTS_DIR = "model_parts"  # RUN_DIR/model_parts/rank<r>.png: stacked bars of time by part and layer


class _Processed(TypedDict):
    """What :func:`_process_trace` returns for one rank's trace: its error alone (with the views an earlier
    postprocess left, absolute paths), or its views (absolute paths), summary and collective calls."""
    rank: int
    error: NotRequired[str]
    warning: NotRequired[str]
    kept_views: NotRequired[list[str]]
    views: NotRequired[dict[str, list[str]]]
    view_links: NotRequired[dict[str, str]]
    summary: NotRequired[KernelSummary]
    calls: NotRequired[CallRecords]  # sftprof.analysis.time.comm_wait.call_records, not written


def _rank_views(out_dir: str, rank: int) -> list[str]:
    """Paths of rank ``rank``'s files in every view (and time-window) folder under ``out_dir``, sorted (a view written
    as a link to another view counts, also when what it linked to is gone)."""
    folders = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(path for folder in folders if os.path.isdir(os.path.join(out_dir, folder))
                  for name in (trace_name(rank), trace_name(rank, compress=True))
                  if os.path.lexists(path := os.path.join(out_dir, folder, name)))


def _failed_trace(out_dir: str, rank: int, error: str) -> _Processed:
    """The result of a trace that is not summarised (``error``), with the rank's views an earlier postprocess left."""
    out: _Processed = {"rank": rank, "error": error}
    kept = _rank_views(out_dir, rank)
    if kept:
        out["kept_views"] = kept
    return out


def _split_views(src: str, stage: str, rank: int, compress: bool,
                 max_view_bytes: int) -> tuple[dict[str, list[str]], dict[str, int]] | tuple[None, str]:
    """:func:`~sftprof.analysis.views.split.split_trace` alone, for a worker process: ``(views, {note: count})``, or
    ``(None, error)`` when the split failed (the error as :func:`~sftprof.analysis.trial.inputs.file_error` words it)."""
    notes: dict[str, int] = {}
    try:
        return split_trace(src, stage, rank, compress=compress, max_view_bytes=max_view_bytes,
                           on_note=notes.__setitem__), notes
    except Exception as exc:  # returned as text: an OSError's file name does not survive pickling
        return None, file_error(src, exc)


def _process_trace(src: str, out_dir: str, rank: int, compress: bool, max_view_bytes: int, step: int,
                   world: World, beside: bool = False) -> _Processed:
    """Split one rank's trace into ``out_dir`` and summarise it as rank ``rank``'s trace of step ``step``. The views
    are written to a staging folder next to ``out_dir`` and replace the rank's earlier views (other compression,
    other windows) only when the split succeeded: a trace that fails leaves what an earlier postprocess wrote. So
    does one that is not this trial's: a rank outside its world size ``world`` (not read), or a trace whose own
    steps and rank say it is another step's or another rank's
    (:func:`sftprof.analysis.time.trace_summary.identity_problems`). A trace whose invalid events, or one fault of its
    record (:func:`sftprof.analysis.trace.sanity.sanity_error`), dominate it is split and summarised, with that
    error. ``beside``: the views are written by a worker process while this one reads the trace again for the
    summary (:func:`sftprof.analysis.views.split.read_for_summary`): the same files and summary, each half on its own core
    (the parsing is paid twice), the summary's figures worked out while the views are still being written."""
    outside = outside_world(rank, world)
    if outside:
        return _failed_trace(out_dir, rank, f"{src}: {outside}; the trace was not read")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".staging_rank{rank}_", dir=parent)
    try:
        try:
            analyzer = KernelTraceAnalyzer(step=step)  # its CPU-op store's folder may fail: TempSpaceError
            if beside:
                with ProcessPoolExecutor(max_workers=1) as pool:
                    views_run = pool.submit(_split_views, src, stage, rank, compress, max_view_bytes)
                    read_for_summary(src, analyzer.set_header, analyzer.add, analyzer.add_invalid)
                    empty = analyzer.no_events_error()
                    failed: Exception | None = None
                    try:  # while the views are still being written (the longer half): the summary's questions
                        summary = None if empty else analyzer.summary()
                    except Exception as exc:  # raised after the views' error, as in the one pass
                        failed = exc
                    split = views_run.result()
                if split[0] is None:  # the views' error (for a malformed trace the same as the summary's pass gives)
                    return _failed_trace(out_dir, rank, split[1])
                if failed is not None:
                    raise failed
                staged, notes = split
                if summary is not None:  # the views' repairs, which change no figure
                    summary["view_repairs"] = dict(sorted({**summary["view_repairs"], **notes}.items()))
            else:
                staged = split_trace(src, stage, rank, compress=compress, max_view_bytes=max_view_bytes,
                                     on_header=analyzer.set_header, on_event=analyzer.add,
                                     on_invalid=analyzer.add_invalid, on_note=analyzer.add_note)
                empty = analyzer.no_events_error()
                summary = None if empty else analyzer.summary()
            if summary is None:  # views of nothing would replace an earlier postprocess's
                return _failed_trace(out_dir, rank, f"{src}: {empty}")
            calls = summary["collectives"].pop("calls")  # matched across ranks by trace_part, not written
            error = invalid_events_error(summary["invalid_events"]) or sanity_error(summary["sanity"])
            wrong, unconfirmed = identity_problems(summary["identity"], rank, step)
        except TempSpaceError as exc:  # a full TMPDIR: this trace's error, naming the folder and the space needed
            return _failed_trace(out_dir, rank, f"{src}: {exc.message(src)}")
        except Exception as exc:  # whatever one trace raises is that trace's error, never the whole run's
            return _failed_trace(out_dir, rank, file_error(src, exc))
        if wrong:  # another step's or rank's trace: its views and figures would stand for what they are not
            return _failed_trace(out_dir, rank, f"{src}: {wrong}")
        links = view_links(staged)
        moves = {view: [(path, os.path.join(out_dir, os.path.relpath(path, stage))) for path in paths]
                 for view, paths in staged.items()}
        for folder in sorted({os.path.dirname(dst) for pairs in moves.values() for _, dst in pairs}):
            try:  # before an earlier postprocess's views go: a file in a folder's place fails here, nothing lost
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                return _failed_trace(out_dir, rank, f"{src}: {write_failed(folder, exc)} (views not written)")
        for path in _rank_views(out_dir, rank):  # an earlier postprocess's (other compression, other windows)
            os.remove(path)
        views: dict[str, list[str]] = {}
        for view, pairs in moves.items():
            views[view] = []
            for path, dst in pairs:
                os.replace(path, dst)
                views[view].append(dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    out: _Processed = {"rank": rank, "views": views, "view_links": links, "summary": summary, "calls": calls}
    if error:
        out["error"] = f"{src}: {error}"
    elif unconfirmed:
        out["warning"] = unconfirmed
    return out


def _find_traces(log_dir: str) -> tuple[list[tuple[int, str]], list[TraceEntry], list[SkippedFile]]:
    """``(found, duplicates, skipped)`` in ``LOG_DIR/perf_tracer``: ``(rank, path)`` of the first trace of each
    rank (sorted), an error entry per further trace of a rank, and the files that are not trace names. A trace the
    profiler left under its temporary name (``*.tmp``, :data:`sftprof.artifacts.UNRENAMED_TRACE_RE`) is the rank's
    trace when the rank has no other (a warning says so, :mod:`sftprof.analysis.trial.problems`), else skipped."""
    trace_dir = os.path.join(log_dir, artifacts.PERF_TRACER)
    found: list[tuple[int, str]] = []
    duplicates: list[TraceEntry] = []
    skipped: list[SkippedFile] = []
    if os.path.isdir(trace_dir):
        # "x.json" sorts before "x.json.gz", and rank<r>.pt.trace.json before the legacy traces-r<r>.chrome.json
        names = sorted(os.listdir(trace_dir))
        complete = {raw_trace_rank(n) for n in names} - {None}
        for name in names:
            rank = raw_trace_rank(name)
            unrenamed = unrenamed_trace_rank(name)
            if unrenamed is not None and unrenamed in complete:
                skipped.append({"file": os.path.join(artifacts.PERF_TRACER, name),
                                "reason": f"a temporary file of the profiler beside rank {unrenamed}'s trace"})
                continue
            rank = unrenamed if rank is None else rank  # a trace left under its temporary name is read from there
            if rank is None:
                skipped.append({"file": os.path.join(artifacts.PERF_TRACER, name),
                                "reason": "not a trace name the trainer writes (rank<r>.pt.trace.json[.gz], or the "
                                          "earlier traces-r<r>.chrome.json[.gz])"})
                continue
            src = os.path.join(trace_dir, name)
            first = next((s for r, s in found if r == rank), None)
            if first is not None:
                duplicates.append({"rank": rank, "source": os.path.relpath(src, log_dir),
                                   "error": f"{src}: a second trace for rank {rank}; only "
                                            f"{os.path.basename(first)} was processed"})
            else:
                found.append((rank, src))
    return sorted(found), duplicates, skipped


def _process_traces(found: list[tuple[int, str]], out_dir: str, compress: bool, max_view_bytes: int,
                    jobs: int, step: int, world: World) -> list[_Processed]:
    """:func:`_process_trace` of each found trace, in ``jobs`` worker processes when more than one."""
    beside = jobs >= 2 * len(found)  # a core to spare for each trace: its views and summary side by side
    args = [(src, out_dir, rank, compress, max_view_bytes, step, world, beside) for rank, src in found]
    if jobs <= 1 or len(args) <= 1:
        return [_process_trace(*a) for a in args]
    with ProcessPoolExecutor(max_workers=min(jobs, len(args))) as pool:
        futures = [pool.submit(_process_trace, *a) for a in args]
        results: list[_Processed] = []
        for (src, _, rank, *_), fut in zip(args, futures):
            try:
                results.append(fut.result())
            except Exception as exc:  # a worker that died (killed, out of memory) fails its trace only
                results.append({"rank": rank, "error": file_error(src, exc)})
    return results


def _trace_entry(log_dir: str, run_dir: str, rank: int, src: str, res: _Processed) -> TraceEntry:
    """The summary entry of one processed trace (paths relative to the dirs); plots its model-part breakdown. A trace
    that failed to split keeps an earlier postprocess's model-part plot of its rank, listed in ``kept_files``. A plot
    that cannot be drawn or written (whatever matplotlib raises, a full disk, a file in the place of
    ``RUN_DIR/model_parts``) is the entry's ``parts_plot_error``: the trace's views and summary stand, and an earlier
    plot of the rank stays, listed in ``kept_files``."""
    entry: TraceEntry = {"rank": rank, "source": os.path.relpath(src, log_dir)}
    if "error" in res:
        entry["error"] = res["error"]
    if "warning" in res:
        entry["warning"] = res["warning"]
    if "kept_views" in res:
        entry["kept_views"] = [os.path.relpath(p, run_dir) for p in res["kept_views"]]
    png = os.path.join(run_dir, MODEL_PARTS_DIR, f"rank{rank}.png")
    if "views" not in res and os.path.isfile(png):  # an earlier postprocess's, left as it is: said so
        entry["kept_files"] = [os.path.relpath(png, run_dir)]
    if "views" in res:  # then also its view links and summary (_process_trace)
        summary = res["summary"]
        entry["views"] = {v: [os.path.relpath(p, run_dir) for p in res["views"][v]] for v in VIEWS}
        entry["view_links"] = res["view_links"]
        entry["summary"] = summary
        parts, clock = summary["parts"], "GPU time"
        cpu_parts = summary["cpu_parts"]
        if not parts["total_ms"] and cpu_parts:  # a CPU run
            parts, clock = cpu_parts, "CPU op time"
        if parts["total_ms"]:
            try:
                os.makedirs(os.path.dirname(png), exist_ok=True)  # FileExistsError: a file in the folder's place
                with atomic_path(png) as tmp:
                    plot_parts(parts, f"{clock} by model part, rank {rank} ({os.path.basename(src)})", tmp, clock)
            except Exception as exc:  # matplotlib's (a backend it refuses), a full disk: the plot's error alone
                what = "written" if isinstance(exc, OSError) else "drawn"
                entry["parts_plot_error"] = f"{file_error(png, exc)} (model-part plot not {what})"
                if os.path.isfile(png):  # an earlier postprocess's, left as it is: said so
                    entry["kept_files"] = [os.path.relpath(png, run_dir)]
            else:
                entry["parts_plot"] = os.path.relpath(png, run_dir)
    return entry


def trace_part(log_dir: str, run_dir: str, compress: bool, max_view_bytes: int, jobs: int, step: int,
                 world: World) -> Files:
    """``{"kernel_traces": [...], "skipped": [...], "comm_wait": ..., "merged_view": ...}``: every rank's trace split
    into views and summarised as step ``step`` (:func:`_process_trace`: a trace of another step, of another rank or of
    a rank outside the trial's world size ``world`` is that trace's error), the communication of the traces without
    errors split into waiting for the last rank and transfer (:func:`sftprof.analysis.time.comm_wait.split`; None when
    no trace has a collective), and the ranks' views as one timeline (:func:`sftprof.analysis.views.merged.merge_trial`;
    None with fewer than two ranks)."""
    found, traces, skipped = _find_traces(log_dir)
    out_dir = os.path.join(run_dir, KERNEL_TRACES)
    results = _process_traces(found, out_dir, compress, max_view_bytes, jobs, step, world)
    if os.path.isdir(out_dir):  # time-window folders of an earlier postprocess that no rank's views are in now
        for folder in os.listdir(out_dir):
            if os.path.isdir(os.path.join(out_dir, folder)) and not os.listdir(os.path.join(out_dir, folder)):
                os.rmdir(os.path.join(out_dir, folder))
    traces += [_trace_entry(log_dir, run_dir, rank, src, res) for (rank, src), res in zip(found, results)]
    # Products across the ranks' traces are made here, from the per-rank results: the wait/transfer split of their
    # communication (each trace's call timelines, which are not written), and the ranks' views on one timeline.
    records = {rank: res["calls"] for (rank, _), res in zip(found, results) if "calls" in res and "error" not in res}
    cw = comm_wait.split(records)
    merged = merged_view.merge_trial(
        {rank: res["views"]["chrome"] for (rank, _), res in zip(found, results) if "views" in res}, out_dir,
        cw and cw["clock_offsets"], compress=compress, max_view_bytes=max_view_bytes, jobs=jobs, rel_to=run_dir)
    return {"kernel_traces": sorted(traces, key=lambda t: (t["rank"], t["source"])), "skipped": skipped,
            "comm_wait": cw, "merged_view": merged}
