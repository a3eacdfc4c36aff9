"""Where a trace without GPU activity (a CPU run) spent its step: CPU time by model part, and the heaviest op.

A CPU run has no kernels to attribute, but its trace carries the same CPU ops, model-part ranges
(``sftprof.module/<part>/L<layer>[/recompute]``, :mod:`sftprof.capture.module_regions`) and forward->backward flows
as a GPU run's. Each CPU op that starts in the step window is placed as a GPU activity is placed by its launch
(:meth:`sftprof.analysis.step_breakdown.OpCollector.attribute`), at its own start on its own thread: the innermost
model-part range or autograd backward node around it gives its part, layer and phase (a backward node takes the part
of the forward op that created it). Its *self* time (its duration less that of the ops nested directly in it) goes
to that cell, so the cells add up to the CPU ops' self time in the window, every thread summed, and no op's time
counts twice. Python time between ops is in no op and is left out (on the tiny CPU preset the ops cover 95 % of the
step's wall time). Without model-part ranges there is nothing to place ops by: no table.

The heaviest op (:func:`heaviest_op`) is the op with the most inclusive time in the window (its calls' time with what
they call, nested calls of the same op counted once; an autograd Function, ``<name>``, together with its backward
node, ``<name>Backward``) that is neither an autograd engine wrapper nor a container of model parts (an op around a
model-part range, such as a checkpoint wrapper, holds parts, not work of its own).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import numpy as np

from sftprof.analysis.kernel_names import cpu_op_category
from sftprof.analysis.schema import HeaviestOp, Parts, ms
from sftprof.analysis.step_breakdown import BWD_NODE, OpCollector, part_label, parts_tables

__all__ = ["cpu_parts", "heaviest_op"]

Window = tuple[Optional[float], Optional[float]]


def cpu_parts(ops: OpCollector, window: Window, optimizer_windows: list[tuple[float, float]]) -> Optional[Parts]:
    """CPU op self time of the step window by model part, layer and phase (module docstring).

    Args:
        ops: the trace's CPU side (every ``cpu_op``, the model-part ranges, backward nodes and flows).
        window: the step window ``(lo, hi)`` in us on the trace clock (None: no window).
        optimizer_windows: the ``sftprof/optimizer_step`` spans (us): ops starting in one are ``optimizer``.

    Returns:
        None without model-part ranges or a window; else the tables of :func:`parts_tables` with ``total_ms`` (the
        ops' self time) and ``outside_window`` (CPU ops that started outside the window, left out).
    """
    lo, hi = window
    if lo is None or not ops.has_regions:
        return None
    keep, own = ops.op_self_us(lo, hi)
    c = ops.cpu_ops
    tids = np.frombuffer(c.tid, dtype=np.int64)[keep]
    starts = np.frombuffer(c.start, dtype=np.float64)[keep]
    names = np.frombuffer(c.payload, dtype=np.int64)[keep]
    cats = [cpu_op_category(ops.op_name_list[k]) for k in names.tolist()]
    in_opt = np.zeros(keep.size, dtype=bool)
    for a, b in optimizer_windows:
        in_opt |= (starts >= a) & (starts <= b)
    is_comm = np.array([cat == "communication" for cat in cats], dtype=bool)
    parts, layers, phases, source = ops.attribute(tids, starts, cats, in_opt, is_comm)
    cells: dict[tuple[str, Optional[int], str], float] = defaultdict(float)
    for i, us in enumerate(own[keep].tolist()):
        cells[(parts[i], layers[i], phases[i])] += us
    total = float(own[keep].sum())
    out = parts_tables(cells, total, source)
    out["total_ms"] = ms(total)
    out["outside_window"] = int(len(c.start) - keep.size)
    return out


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
    if lo is None or not len(ops.cpu_ops.start):
        return None
    c = ops.cpu_ops
    tid = np.frombuffer(c.tid, dtype=np.int64)
    st, en = np.frombuffer(c.start, dtype=np.float64), np.frombuffer(c.end, dtype=np.float64)
    name = np.frombuffer(c.payload, dtype=np.int64)
    calls: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for i in np.flatnonzero((st >= lo) & (st <= hi)).tolist():
        calls[int(name[i])].append((int(tid[i]), float(st[i]), float(en[i])))
    r_tid = np.frombuffer(ops.regions.tid, dtype=np.int64)
    r_st = np.frombuffer(ops.regions.start, dtype=np.float64)

    def holds_parts(spans: list[tuple[int, float, float]]) -> bool:
        return any(bool(np.any((r_tid == t) & (r_st >= a) & (r_st < b))) for t, a, b in spans)

    own = {k: _union_us(v) for k, v in calls.items()}
    backward = {k: b for k in calls if (b := ops.op_index(ops.op_name_list[k] + "Backward")) in calls}
    of_forward = set(backward.values())  # an autograd Function's backward node counts with its forward
    ranked = sorted((own[k] + own.get(backward.get(k), 0.0), k) for k in calls if k not in of_forward)
    for _, k in sorted(ranked, key=lambda x: (-x[0], ops.op_name_list[x[1]])):
        label = ops.op_name_list[k]
        if label.startswith(BWD_NODE) or holds_parts(calls[k]):
            continue
        first = min(calls[k], key=lambda s: s[1])
        parts, _, _, _ = ops.attribute(np.array([first[0]], dtype=np.int64), np.array([first[1]]),
                                       [cpu_op_category(label)], np.zeros(1, dtype=bool), np.zeros(1, dtype=bool))
        back = backward.get(k)
        has_part = ops.has_regions and parts[0] not in ("outside_parts", "comm_outside", "optimizer")
        return {"name": label, "calls": len(calls[k]), "inclusive_ms": ms(own[k]),
                "backward": ops.op_name_list[back] if back is not None else None,
                "backward_ms": ms(own[back]) if back is not None else None,
                "part": parts[0] if has_part else None, "label": part_label(parts[0]) if has_part else None}
    return None
