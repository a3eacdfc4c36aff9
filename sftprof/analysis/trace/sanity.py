"""Is one trace's record of the profiled step sound? Faults of the recording, per stream and per step, counted and
set right before any figure is computed (:func:`inspect`, called by
:meth:`sftprof.analysis.time.trace_summary.KernelTraceAnalyzer.summary`).

Kinds (the keys of :class:`sftprof.analysis.trace.schema.TraceSanity`; each counted with up to three examples and the
population it is counted among):

* ``duplicates``: events recorded twice (the same category, name, thread or stream, start and duration; a CUDA API
  call: the same correlation, thread and start), a known torch profiler fault. The copies are left out of every
  figure (the views keep the recording as it is).
* ``overlapping``: a GPU activity (kernel, memcpy, memset) that runs past the start of the next activity of its
  stream (compared in integer ns). Work on one stream runs in order, so the record is wrong (CUPTI's overlong
  kernel); the activity's end is cut at that start, the longest it can have run.
* ``untimed``: GPU activities with ``ts`` or ``dur`` 0 (CUPTI collected no timing): left out of every figure and
  view (:data:`sftprof.analysis.trace.check.UNTIMED`, also counted with the invalid events); the GPU times are lower
  bounds.
* ``launches_without_activity``: kernel launch calls
  (:data:`~sftprof.analysis.trace.op_collector.KERNEL_LAUNCHES`) whose kernel is not in the trace (the profiler
  dropped its record): nothing to attribute; the GPU times are lower bounds and the GPU idle time holds the time those
  kernels ran.
* ``activities_without_launch``: GPU activities whose launch call is not in the trace: counted in the step by their
  start, their model part and the host wait before them unknown.
* ``other_steps``: GPU activities and CPU ops of another ``ProfilerStep#M`` than the profiled step's (launched, or
  started, inside the other step's slice): left out of every figure; the step window is the profiled step's.

The recording's edges are not faults: the GPU activities of a stream that ran before the stream's first activity
whose launch is in the trace were launched before the recording began, and the launches after the last launch whose
activity is in the trace ran after it stopped (``recording_edges`` counts both).

A trace where ``overlapping``, ``untimed``, ``launches_without_activity`` or ``activities_without_launch`` make up
more than :data:`DOMINANT_SHARE` of their population is that file's error (:func:`sanity_error`); duplicates and
other steps are set right exactly, so never are.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Literal, Optional

import numpy as np

from sftprof.analysis.time.gpu_activity import ActivityTable, Span
from sftprof.analysis.trace.intervals import repeated_rows
from sftprof.analysis.trace.op_collector import OpCollector
from sftprof.analysis.trace.schema import SanityCount, TraceSanity

__all__ = ["inspect", "fault_messages", "sanity_error", "profiler_step_spans", "DOMINANT_SHARE"]

DOMINANT_SHARE = 0.5  # a fault kind above this share of its population makes the trace that file's error
_EXAMPLES = 3
_NOUNS = {  # kind -> what its count counts, for the messages
    "overlapping": "GPU activities", "untimed": "GPU activities", "launches_without_activity": "kernel launches",
    "activities_without_launch": "GPU activities", "duplicates": "events", "other_steps": "GPU activities and CPU ops"}
_Dominating = Literal["untimed", "overlapping", "launches_without_activity", "activities_without_launch"]
_DOMINATING: tuple[_Dominating, ...] = ("untimed", "overlapping", "launches_without_activity",
                                        "activities_without_launch")


def _count(n: int, of: int, examples: Optional[list[str]] = None) -> SanityCount:
    return {"count": int(n), "of": int(of), "examples": (examples or [])[:_EXAMPLES]}


def _short(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def profiler_step_spans(profiler_steps: list[Span]) -> dict[int, tuple[float, float]]:
    """``{N: (start us, end us)}`` of the ``ProfilerStep#N`` slices (slices of one step joined)."""
    out: dict[int, tuple[float, float]] = {}
    for name, lo, hi in profiler_steps:
        tail = name[len("ProfilerStep#"):]
        if name.startswith("ProfilerStep#") and tail.isdigit():
            a, b = out.get(int(tail), (lo, hi))
            out[int(tail)] = (min(a, lo), max(b, hi))
    return out


def _in_spans(t: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    out = np.zeros(t.size, dtype=bool)
    for lo, hi in spans:
        out |= (t >= lo) & (t <= hi)
    return out


def _overlaps(t: ActivityTable) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(dur, cut, examples)``: the durations with each activity that runs past the start of the next activity of
    its stream cut at that start, the bool mask of those cut, and examples of them."""
    dur = t.dur.copy()
    cut = np.zeros(t.n, dtype=bool)
    if t.n < 2:
        return dur, cut, []
    start_ns = np.round(t.ts * 1000).astype(np.int64)
    end_ns = start_ns + np.round(t.dur * 1000).astype(np.int64)
    order = np.lexsort((start_ns, t.stream, t.dev))
    a, b = order[:-1], order[1:]
    over = (t.dev[a] == t.dev[b]) & (t.stream[a] == t.stream[b]) & (end_ns[a] > start_ns[b])
    a, b = a[over], b[over]
    cut[a] = True
    dur[a] = t.ts[b] - t.ts[a]
    worst = np.argsort(-(t.end[a] - t.ts[b]), kind="stable")[:_EXAMPLES]
    examples = [f"{_short(t.names[t.name_idx[i]])} (GPU {t.dev[i]} stream {t.stream[i]}) ran "
                f"{(t.end[i] - t.ts[j]) / 1e3:.3f} ms past the start of {_short(t.names[t.name_idx[j]])}; cut to "
                f"{(t.ts[j] - t.ts[i]) / 1e3:.3f} ms" for i, j in zip(a[worst].tolist(), b[worst].tolist())]
    return dur, cut, examples


def _without_launch(t: ActivityTable) -> tuple[np.ndarray, np.ndarray]:
    """``(missing, at_start)``: bool masks of the activities without a launch record, split into those that ran
    before their stream's first activity whose launch is in the trace (queued before the recording began) and the
    others."""
    no_launch = np.isnan(t.launch)
    at_start = np.zeros(t.n, dtype=bool)
    for dev, stream in {(int(d), int(s)) for d, s in zip(t.dev[no_launch].tolist(), t.stream[no_launch].tolist())}:
        on = (t.dev == dev) & (t.stream == stream)
        launched = on & ~no_launch
        first = float(t.ts[launched].min()) if launched.any() else np.inf
        at_start |= on & no_launch & (t.ts < first)
    return no_launch & ~at_start, at_start


def _launches_without_activity(t: ActivityTable, ops: OpCollector, invalid_corr: list[int]
                               ) -> tuple[int, int, int, list[str]]:
    """``(missing, at_end, launches, examples)`` of the kernel launch calls: those whose kernel is not in the trace
    (``invalid_corr``: the correlation ids of activities left out as invalid, which are), those launched after the
    last launch whose activity is (their kernels ran after the recording stopped), and the number of launches (each
    correlation once)."""
    launch_corr, launch_ts = ops.kernel_launches
    corr, ts = np.frombuffer(launch_corr, dtype=np.int64), np.frombuffer(launch_ts, dtype=np.float64)
    if not corr.size:
        return 0, 0, 0, []
    corr, first = np.unique(corr, return_index=True)
    ts = ts[first]
    del first
    known = np.concatenate((t.corr, np.asarray(invalid_corr, dtype=np.int64)))  # np.isin, in half its memory
    known.sort()
    at = np.searchsorted(known, corr)
    np.minimum(at, known.size - 1, out=at)
    has = known[at] == corr if known.size else np.zeros(corr.size, dtype=bool)
    del known, at
    last = float(ts[has].max()) if has.any() else -np.inf
    at_end = ~has & (ts > last) if has.any() else np.zeros(corr.size, dtype=bool)
    missing = ~has & ~at_end
    examples = [f"launch at {x:.3f} us (correlation {c}) without its kernel"
                for c, x in zip(corr[missing][:_EXAMPLES].tolist(), ts[missing][:_EXAMPLES].tolist())]
    return int(missing.sum()), int(at_end.sum()), int(corr.size), examples


def inspect(t: ActivityTable, ops: OpCollector, *, profiler_steps: list[Span], step: Optional[int], untimed: int,
            invalid_corr: list[int], repeated_annotations: int, n_events: int
            ) -> tuple[ActivityTable, TraceSanity, list[tuple[float, float]]]:
    """The faults of one trace's record (module docstring), and the record set right.

    Args:
        t: the trace's GPU activities as collected (:meth:`~sftprof.analysis.time.trace_summary.KernelTraceAnalyzer.
            activity_table`).
        ops: the trace's CPU side; its CPU ops recorded twice, and those of other steps, are dropped here.
        profiler_steps: the ``ProfilerStep#N`` slices, without repeats.
        step: the profiled step (None: not known; then no step is left out).
        untimed: GPU activity events left out as :data:`~sftprof.analysis.trace.check.UNTIMED`.
        invalid_corr: the correlation ids of the GPU activity events left out as invalid (untimed ones too; -1 where
            an event has none): their launches are not launches without a kernel.
        repeated_annotations: user annotations (``sftprof/*`` regions, step slices, host collectives, garbage-collection
            ranges) recorded twice,
            already dropped by the caller.
        n_events: the trace's usable events, copies included (what ``duplicates`` is counted among).

    Returns:
        ``(table, sanity, other_spans)``: the activities without repeats and other steps' activities, overlapping
        ones cut; :class:`~sftprof.analysis.trace.schema.TraceSanity`; the ``(start, end)`` us of the other steps'
        slices, whose annotations the caller leaves out.
    """
    dup = repeated_rows(t.ts, t.dev, t.stream, t.dur, t.name_idx.astype(np.int64), t.kind)  # ts: most selective
    dup_ops, op_examples = ops.cpu_ops.drop_repeated(_EXAMPLES)
    by_cat = {"cpu_op": dup_ops, "user_annotation": repeated_annotations,
              "cuda_runtime/cuda_driver": ops.repeated_api_calls}
    for k, cat in enumerate(("kernel", "gpu_memcpy", "gpu_memset")):
        by_cat[cat] = int((dup & (t.kind == k)).sum())
    dup_examples = [f"{_short(t.names[t.name_idx[i]])} at {t.ts[i]:.3f} us" for i in np.flatnonzero(dup)[:_EXAMPLES]]
    dup_examples += [f"{_short(ops.op_name_list[k])} at {start:.3f} us" for k, start in op_examples]
    t = t.subset(~dup)
    n_missing, at_end, n_launches, launch_examples = _launches_without_activity(t, ops, invalid_corr)

    spans = profiler_step_spans(profiler_steps)
    other_spans = [span for n, span in sorted(spans.items()) if n != step] if step in spans else []
    when = np.where(np.isnan(t.launch), t.ts, t.launch)
    other = _in_spans(when, other_spans) & ~_in_spans(when, [spans[step]] if step in spans else [])
    of_other = t.n + len(ops.cpu_ops)
    n_other = int(other.sum()) + ops.cpu_ops.drop_where(lambda start: _in_spans(start, other_spans))
    t = t.subset(~other)

    dur, cut, over_examples = _overlaps(t)
    t = replace(t, dur=dur, end=t.ts + dur)
    missing_launch, at_start = _without_launch(t)
    sanity: TraceSanity = {
        "duplicates": _count(sum(by_cat.values()), n_events, dup_examples),
        "duplicates_by_category": {k: v for k, v in sorted(by_cat.items()) if v},
        "overlapping": _count(cut.sum(), t.n, over_examples),
        "untimed": _count(untimed, t.n + untimed),
        "launches_without_activity": _count(n_missing, n_launches, launch_examples),
        "activities_without_launch": _count(missing_launch.sum(), t.n, [
            f"{_short(t.names[t.name_idx[i]])} (GPU {t.dev[i]} stream {t.stream[i]}) at {t.ts[i]:.3f} us"
            for i in np.flatnonzero(missing_launch)[:_EXAMPLES]]),
        "other_steps": _count(n_other, of_other, [f"ProfilerStep#{n}" for n in sorted(spans) if n != step]
                              if other_spans else []),
        "recording_edges": {"activities_before_first_launch": int(at_start.sum()),
                            "launches_after_last_activity": at_end},
    }
    return t, sanity, other_spans


def sanity_error(sanity: TraceSanity) -> Optional[str]:
    """The error of a trace one fault kind dominates (more than :data:`DOMINANT_SHARE` of its population), else
    None: ``"1530 of 2044 GPU activities run past ...; the trace is not usable"``."""
    for kind in _DOMINATING:
        c = sanity[kind]
        if c["count"] and c["count"] > DOMINANT_SHARE * c["of"]:
            return f"{_message(kind, c, sanity)}; the trace is not usable"
    return None


def _message(kind: str, c: SanityCount, sanity: TraceSanity, with_examples: bool = True) -> str:
    head = f"{c['count']} of {c['of']} {_NOUNS[kind]}"
    examples = f" (e.g. {'; '.join(c['examples'])})" if c["examples"] and with_examples else ""
    if kind == "duplicates":
        cats = ", ".join(f"{k} {v}" for k, v in sanity["duplicates_by_category"].items())
        return (f"{c['count']} events recorded twice ({cats}): the copies are left out of every figure (the views keep "
                "them)")
    if kind == "overlapping":
        return (f"{head} run past the start of the next activity of their stream, which cannot be (CUPTI's overlong "
                f"record){examples}: each is cut at that start, the longest it can have run")
    if kind == "untimed":
        return (f"{head} have no timing (ts 0 or dur 0: CUPTI collected none): left out of every figure and view, so "
                "the GPU busy and GPU times are lower bounds")
    if kind == "launches_without_activity":
        return (f"{head} have no kernel in the trace (records dropped by the profiler){examples}: those kernels ran "
                "but are in no figure, so the GPU busy and GPU times are lower bounds and the GPU idle time holds "
                "their run time")
    if kind == "activities_without_launch":
        return (f"{head} have no launch record in the trace{examples}: counted in the step by their start; their "
                "model part, efficiency and the host wait before them are unknown")
    steps = ", ".join(c["examples"])
    return (f"the trace holds more profiler steps than the one postprocessed ({steps} besides it): {head} of those "
            "steps are left out of every figure, and the step window is the postprocessed step's own")


def fault_messages(sanity: TraceSanity, examples: bool = True) -> list[str]:
    """One sentence per fault kind found (:func:`inspect`), in the order of the module docstring: what it is, how
    many, (``examples``: with up to three examples,) and what was done about it: the summary's warnings, and without
    examples the findings' caveats."""
    return [_message(kind, sanity[kind], sanity, examples) for kind in
            ("duplicates", "overlapping", "untimed", "launches_without_activity", "activities_without_launch",
             "other_steps") if sanity[kind]["count"]]
