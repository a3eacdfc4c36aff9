"""Host time of a step: the CPU ops with the most self time, blocking CUDA calls, torch.compile time, the GPU idle
time split by why the GPU waited and where it waited for the host, and, in a CPU run, the heaviest op.

GPU idle waiting for the host (:func:`_idle_split`, :func:`_host_wait_places`): each host-wait gap goes to the
place of the activity that ends it, its (part, layer summed, phase) from the attribution of
:meth:`sftprof.analysis.trace.op_collector.OpCollector.attribute` and the innermost named op around its launch (an
autograd Function's forward or a backward node, :meth:`~sftprof.analysis.trace.op_collector.OpCollector.launch_sites`),
and counts as after a blocking call when a blocking CUDA call ended inside it before that launch.

The heaviest op (:func:`heaviest_op`, a trace without GPU activity) is the op with the most inclusive time in the
step window (its calls' time with what they call, nested calls of the same op counted once; an autograd Function,
``<name>``, together with its backward node, ``<name>Backward``) that is neither an autograd engine wrapper nor a
container of model parts (an op around a model-part range, such as a checkpoint wrapper, holds parts, not work of
its own).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import numpy as np

from sftprof.analysis.time.gpu_activity import Labels, column_rows
from sftprof.analysis.trace.kernel_names import cpu_op_category
from sftprof.analysis.time.model_parts import part_label
from sftprof.analysis.trace.op_collector import BWD_NODE, OpCollector, Placement
from sftprof.analysis.schema import ms
from sftprof.analysis.time.schema import CpuOpRow, GpuIdle, HeaviestOp, Host, HostWaitPlaces, HostWaitRow

__all__ = ["host_time", "heaviest_op", "top_cpu_ops", "LAUNCH_GAP_US", "TOP_IDLE_PLACES"]

Window = tuple[Optional[float], Optional[float]]
TOP_HOST_OPS = 15
TOP_CPU_OPS = 15


def host_time(ops: OpCollector, place: Placement, *, ts: np.ndarray, dur: np.ndarray, tids: np.ndarray,
              pts: np.ndarray, inside: np.ndarray, window: Window) -> Host:
    """Host time in the step window ``(lo, hi)`` (us; None: no window): ``top_self`` (:meth:`OpCollector.self_times`),
    ``sync`` (blocking CUDA calls), ``compile`` (torch.compile), ``gpu_idle`` (:func:`_idle_split` with the host
    wait by place, :func:`_host_wait_places`, and ``host_wait_gc_ms``; None without a window) and ``gc`` (Python
    garbage collections, :meth:`OpCollector.gc_time`); the garbage-collection members only when the trace has
    :mod:`sftprof.capture.python_gc` ranges.

    Args:
        place: each GPU activity's part, layer and phase; ts, dur: each activity's start and duration (us);
        tids, pts: its launch thread and time (NaN: unknown); inside: launched in the step window.
    """
    lo, hi = window
    if lo is None or hi is None:
        return {"top_self": [], "sync": {"total_ms": 0.0, "by_call": {}}, "compile": {"ms": 0.0, "compile_ids": []},
                "gpu_idle": None}
    idle, host_gaps = _idle_split(ts, dur, pts, lo, hi)
    gc_us = None
    if ops.gc_spans:  # the trace has garbage-collection ranges: how much of each host-wait gap they cover
        gc_us = ops.gc_overlap_us(host_gaps[1], host_gaps[2])
        idle["host_wait_gc_ms"] = ms(float(gc_us.sum()))
    idle["host_wait_by_place"] = _host_wait_places(
        ops, host_gaps, launch=pts, sites=ops.launch_sites(tids, pts), parts=place.parts, phases=place.phases,
        dur=dur, inside=inside, gc_us=gc_us)
    out: Host = {"top_self": ops.self_times(lo, hi, TOP_HOST_OPS), "sync": ops.host_sync_ms(lo, hi),
                 "compile": ops.compile_ms(lo, hi), "gpu_idle": idle}
    gc_time = ops.gc_time(lo, hi)
    if gc_time is not None:
        out["gc"] = gc_time
    return out


Gaps = tuple[np.ndarray, np.ndarray, np.ndarray]  # per host-wait gap: activity index (int64), start, end (us)


def _idle_split(ts: np.ndarray, dur: np.ndarray, launch: np.ndarray, lo: float, hi: float
                ) -> tuple[GpuIdle, Gaps]:
    """GPU idle time in ``[lo, hi]`` split by why the GPU waited (in the spirit of HTA's idle time breakdown).

    Idle gaps are the gaps of the union of all activity intervals. A gap before an activity whose launch
    call started after the gap began is ``host_wait`` (the host had not launched the next work yet);
    otherwise ``kernel_wait`` (the work was queued but waited on a dependency: another stream, an event,
    a collective's peer; also when the launch is not in the trace). Idle time before the first activity is
    ``host_wait``. Every activity running in the window counts, so idle + GPU busy = the window.

    Returns:
        ``({idle_ms, host_wait_ms, kernel_wait_ms, after_last_activity_ms}, host_gaps)``; ``host_gaps`` holds
        the host-wait gaps in time order as three arrays: the index of the activity that ends each (into ``ts``),
        its start and its end (us); the gaps' lengths sum to ``host_wait_ms``.
    """
    # every activity that runs in the window, as the busy share counts them, by start (one column at a time: the
    # temporaries of a whole-trace question are the summary's peak memory)
    idx = np.flatnonzero((ts + dur > lo) & (ts < hi))
    t = ts[idx]
    order = np.argsort(t, kind="stable")
    idx, t = idx[order], t[order]
    del order
    np.clip(t, lo, hi, out=t)
    e = ts[idx]
    e += dur[idx]
    np.clip(e, lo, hi, out=e)
    ln = launch[idx]
    if not t.size:
        return {"idle_ms": ms(hi - lo), "host_wait_ms": ms(hi - lo), "kernel_wait_ms": 0.0,
                "after_last_activity_ms": 0.0}, (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0))
    run_end = np.maximum.accumulate(e)
    host = max(t[0] - lo, 0.0)
    kernel = 0.0
    gaps = np.flatnonzero(t[1:] > run_end[:-1]) + 1
    by_host = ln[gaps] > run_end[gaps - 1]
    for gap, waited in column_rows(t[gaps] - run_end[gaps - 1], by_host):  # summed in time order
        if waited:
            host += gap
        else:
            kernel += gap
    first = [0] if t[0] - lo > 0 else []
    host_gaps = (np.concatenate((idx[first], idx[gaps[by_host]])),
                 np.concatenate((np.full(len(first), lo, dtype=np.float64), run_end[gaps[by_host] - 1])),
                 np.concatenate((t[first], t[gaps[by_host]])))
    tail = max(hi - run_end[-1], 0.0)
    return ({"idle_ms": ms(host + kernel + tail), "host_wait_ms": ms(host), "kernel_wait_ms": ms(kernel),
             "after_last_activity_ms": ms(tail)}, host_gaps)


TOP_IDLE_PLACES = 10

# A place whose host-wait gaps (those not after a blocking call) and GPU activities both average under this (us) is
# launch-bound: short kernels, each costing the host (CUDA runtime, PyTorch dispatcher, Python) more than it runs.
# Short gaps after long activities, or long gaps, mean the host did other work between launches. On the
# 131072-token 1x H200 trace the chunked loss loop's gaps averaged 25 us, its kernels 4 us.
LAUNCH_GAP_US = 100.0


def _host_wait_places(ops: OpCollector, host_gaps: Gaps, *, launch: np.ndarray,
                      sites: tuple[list[str], np.ndarray], parts: Labels[str], phases: Labels[str], dur: np.ndarray,
                      inside: np.ndarray, gc_us: Optional[np.ndarray] = None) -> HostWaitPlaces:
    """Where and why the GPU waited for the host: the host-wait gaps of :func:`_idle_split` by place.

    A gap's place is that of the activity that ends it: its (part, phase) from :meth:`OpCollector.attribute`
    and the named op it was launched under (:meth:`OpCollector.launch_sites`). A gap is *after a blocking
    call* when a blocking CUDA call (``cudaStreamSynchronize`` ...; :meth:`OpCollector.blocking_calls`) ended
    between the gap's start and the launch of the activity that ends it: the host waited for the GPU's queue
    to drain, then took the gap's time to launch more work. In the other gaps the host launched the next work
    only after the GPU had finished the previous: a place is *launch-bound* when those gaps and the place's GPU
    activities both average under :data:`LAUNCH_GAP_US` (short kernels whose per-launch host cost exceeds their
    run time), else *host busy* (the host did other work between launches: long gaps, or gaps after long
    activities, which a launch alone cannot explain).

    Returns:
        ``{"rows": [...], "rest": {...} or None, "after_blocking_ms", "after_blocking_by_op": {op: ms}}``;
        rows (at most :data:`TOP_IDLE_PLACES`, most idle first) have ``part``, ``label``, ``phase``,
        ``launched_under`` (None when no named op), ``idle_ms``, ``gaps``, ``activities`` (the GPU activities of
        that place launched in the step window: kernels, copies, fills; the gaps end at all three kinds),
        ``mean_activity_us`` (their mean duration), ``mean_gap_us``, ``longest_gap_us``, ``after_blocking_ms``,
        ``after_blocking_pct`` (of the row's idle), ``kind`` (``after blocking calls`` when at least half the
        row's idle follows one, else ``launch-bound`` or ``host busy`` as above; ``mean_gap_us`` is over all the
        row's gaps) and, given ``gc_us`` (per host gap, the time Python's garbage collector ran in it), ``gc_ms``;
        ``rest`` sums the rows left out (``places``,
        ``idle_ms``, ``gaps``). The rows' and rest's ``idle_ms`` sum to ``host_wait_ms``.
    """
    sync_end, sync_op = ops.blocking_calls()
    # per (part, phase, site): idle us, gaps, after-blocking us and gaps, the longest gap (us), garbage collection
    # inside the gaps (us)
    rows: dict[tuple[str, str, Optional[str]], list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0, 0.0, 0.0])
    by_op: dict[str, float] = defaultdict(float)
    # the first blocking call to end at or after each gap's start, and whether it ended before the launch closing it
    gap_at, gap_start, gap_end = host_gaps
    first = np.searchsorted(sync_end, gap_start, side="left")
    in_gc = gc_us if gc_us is not None else np.zeros(gap_at.size)
    labels, site_of = sites
    for i, g0, g1, j, gap_gc, k, part, phase in column_rows(gap_at, gap_start, gap_end, first, in_gc,
                                                            site_of[gap_at], parts.codes[gap_at], phases.codes[gap_at]):
        key = (parts.names[part], phases.names[phase], labels[k] if k >= 0 else None)
        r = rows[key]
        r[0] += g1 - g0
        r[1] += 1
        r[4] = max(r[4], g1 - g0)
        r[5] += gap_gc
        upto = g1 if np.isnan(launch[i]) else min(launch[i], g1)
        if j < sync_end.size and sync_end[j] <= upto:
            r[2] += g1 - g0
            r[3] += 1
            by_op[sync_op[j]] += g1 - g0
    count: dict[tuple[str, str, Optional[str]], list[float]] = defaultdict(lambda: [0, 0.0])
    for i, k, part, phase in column_rows(np.flatnonzero(inside), site_of[inside], parts.codes[inside],
                                         phases.codes[inside]):
        key = (parts.names[part], phases.names[phase], labels[k] if k >= 0 else None)
        if key in rows:
            count[key][0] += 1
            count[key][1] += dur[i]
    ordered = sorted(rows.items(), key=lambda kv: (-kv[1][0], kv[0][0], kv[0][1], kv[0][2] or ""))
    out: list[HostWaitRow] = []
    for (part, phase, site), (us, n, blocked, n_blocked, longest, row_gc) in ordered[:TOP_IDLE_PLACES]:
        k, kus = count.get((part, phase, site), (0, 0.0))
        if 2 * blocked >= us:  # also every gap after a blocking call (none left for a mean gap)
            kind = "after blocking calls"
        elif (us - blocked) / (n - n_blocked) < LAUNCH_GAP_US and k and kus / k < LAUNCH_GAP_US:
            kind = "launch-bound"
        else:
            kind = "host busy"
        row: HostWaitRow = {
            "part": part, "label": part_label(part), "phase": phase, "launched_under": site, "idle_ms": ms(us),
            "gaps": int(n), "activities": int(k), "mean_activity_us": round(float(kus) / k, 3) if k else None,
            "mean_gap_us": round(us / n, 3), "longest_gap_us": round(longest, 3), "after_blocking_ms": ms(blocked),
            "after_blocking_pct": round(100 * blocked / us, 3) if us else 0.0, "kind": kind}
        if gc_us is not None:
            row["gc_ms"] = ms(row_gc)
        out.append(row)
    left = ordered[TOP_IDLE_PLACES:]
    return {"rows": out,
            "rest": {"places": len(left), "idle_ms": ms(sum(v[0] for _, v in left)),
                     "gaps": int(sum(v[1] for _, v in left))} if left else None,
            "after_blocking_ms": ms(sum(by_op.values())),
            "after_blocking_by_op": {k: ms(v) for k, v in sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0]))}}


def _union_us(spans: list[tuple[int, float, float]]) -> float:
    """Length (us) of the union of ``(tid, start, end)`` spans per thread (nested calls counted once)."""
    total = 0.0
    for tid in {t for t, _, _ in spans}:
        end = -np.inf
        for _, a, b in sorted(s for s in spans if s[0] == tid):
            if b > end:
                total += b - max(a, end)
                end = b
    return total


def heaviest_op(ops: OpCollector, window: Window) -> Optional[HeaviestOp]:
    """The heaviest op of the step window (module docstring); None without a window or CPU ops in it."""
    lo, hi = window
    if lo is None or hi is None or not len(ops.cpu_ops):
        return None
    tid, st, en, name = ops.cpu_ops.arrays()
    calls: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for i in np.flatnonzero((st >= lo) & (st <= hi)).tolist():
        calls[int(name[i])].append((int(tid[i]), float(st[i]), float(en[i])))
    r_tid = np.frombuffer(ops.regions.tid, dtype=np.int64)
    r_st = np.frombuffer(ops.regions.start, dtype=np.float64)

    def holds_parts(spans: list[tuple[int, float, float]]) -> bool:
        return any(bool(np.any((r_tid == t) & (r_st >= a) & (r_st < b))) for t, a, b in spans)

    own = {k: _union_us(v) for k, v in calls.items()}
    backward = {k: b for k in calls if (b := ops.op_index(ops.op_name_list[k] + "Backward")) is not None and b in calls}
    of_forward = set(backward.values())  # an autograd Function's backward node counts with its forward
    ranked = sorted((own[k] + (own[backward[k]] if k in backward else 0.0), k) for k in calls if k not in of_forward)
    for _, k in sorted(ranked, key=lambda x: (-x[0], ops.op_name_list[x[1]])):
        label = ops.op_name_list[k]
        if label.startswith(BWD_NODE) or holds_parts(calls[k]):
            continue
        first = min(calls[k], key=lambda s: s[1])
        parts, _, _, _ = ops.attribute(np.array([first[0]], dtype=np.int64), np.array([first[1]]),
                                       [cpu_op_category(label)], np.zeros(1, dtype=bool), np.zeros(1, dtype=bool))
        back = backward.get(k)
        part = parts.at(0)
        has_part = ops.has_regions and part not in ("outside_parts", "comm_outside", "optimizer")
        return {"name": label, "calls": len(calls[k]), "inclusive_ms": ms(own[k]),
                "backward": ops.op_name_list[back] if back is not None else None,
                "backward_ms": ms(own[back]) if back is not None else None,
                "part": part if has_part else None, "label": part_label(part) if has_part else None}
    return None


def top_cpu_ops(ops: OpCollector, limit: int = TOP_CPU_OPS) -> list[CpuOpRow]:
    """The ``limit`` CPU ops with the most inclusive time (own time plus nested ops, every CPU op of the trace the
    collector holds): ``{name, calls, inclusive_ms}``."""
    n = len(ops.op_name_list)
    calls, us = (column.tolist() for column in ops.cpu_ops.name_totals(n))
    rows = sorted((k for k in range(n) if calls[k]), key=lambda k: (-us[k], ops.op_name_list[k]))[:limit]
    return [{"name": ops.op_name_list[k], "calls": calls[k], "inclusive_ms": ms(us[k])} for k in rows]
