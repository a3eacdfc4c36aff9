"""Time by model part, layer and phase: of the GPU activities of a step (:func:`gpu_parts`), or, in a trace without
GPU activity (a CPU run), of its CPU ops (:func:`cpu_parts`); the tables and the plot.

Every activity launched in the step window lands in exactly one (part, layer, phase) cell
(:meth:`sftprof.analysis.trace.op_collector.OpCollector.attribute`), so the cells sum to the step's GPU time (sum of
activity durations, all streams; overlapping streams count twice, as in the category table).

A CPU run has no kernels to attribute, but its trace carries the same CPU ops, model-part ranges
(``sftprof.module/<part>/L<layer>[/recompute]``, :mod:`sftprof.capture.module_regions`) and forward->backward flows
as a GPU run's. Each CPU op that starts in the step window is placed as a GPU activity is placed by its launch, at its
own start on its own thread: the innermost model-part range or autograd backward node around it gives its part,
layer and phase (a backward node takes the part of the forward op that created it). Its *self* time (its duration
less that of the ops nested directly in it) goes to that cell, so the cells add up to the CPU ops' self time in the
window, every thread summed, and no op's time counts twice. Python time between ops is in no op and is left out (on
the tiny CPU preset the ops cover 95 % of the step's wall time). Without model-part ranges there is nothing to place
ops by: no table.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import numpy as np

from sftprof.analysis.trace.kernel_names import cpu_op_category
from sftprof.analysis.trace.op_collector import PHASES, OpCollector, Placement
from sftprof.analysis.schema import ms
from sftprof.analysis.report.pyplot import pyplot
from sftprof.analysis.time.schema import PartRow, Parts
from sftprof.artifacts import MODEL_PART_LABELS, MODEL_PARTS

__all__ = ["gpu_parts", "cpu_parts", "parts_tables", "part_label", "plot_parts", "PHASES"]

Window = tuple[Optional[float], Optional[float]]
Cells = dict[tuple[str, Optional[int], str], float]  # (part, layer, phase) -> us

_OUTSIDE_LABELS = {"optimizer": "optimizer", "comm_outside": "communication outside model parts",
                   "outside_parts": "outside model parts (loss, glue, unlinked backward)"}


def part_label(part: str) -> str:
    """Table label of a part key (model part, ``optimizer``, ``kernel:<category>`` ...)."""
    if part.startswith("kernel:"):
        return f"{part[7:]} (by kernel name)"
    return MODEL_PART_LABELS.get(part) or _OUTSIDE_LABELS.get(part, part)


def gpu_parts(place: Placement, dur: np.ndarray, inside: np.ndarray, is_comm: np.ndarray) -> Parts:
    """GPU time of the activities launched in the step window by model part, layer and phase (module docstring).

    Args:
        place: each activity's part, layer and phase (:meth:`OpCollector.attribute`).
        dur: float64 duration of each activity (us).
        inside: bool, launched in the step window (without a launch record: started in it).
        is_comm: bool, NCCL kernel.

    Returns:
        The tables of :func:`parts_tables` with ``total_ms``, ``outside_window`` (activities left out) and
        ``compute_cells``: ``[part, layer, phase, ms]`` per cell without its NCCL kernels (layer None: outside the
        decoder layers), the rank's own work, which the trial summary compares across ranks
        (:func:`sftprof.analysis.time.rank_table.work_spread`; NCCL time includes waiting for the other ranks).
    """
    cells = _cells(place, dur, np.flatnonzero(inside))
    compute = _cells(place, dur, np.flatnonzero(inside & ~is_comm))
    total = float(dur[inside].sum())
    out = parts_tables(cells, total, place.source, int((~inside).sum()))
    out["compute_cells"] = [[part, layer, phase, ms(us)] for (part, layer, phase), us in
                            sorted(compute.items(), key=lambda kv: (kv[0][1] is None, kv[0][1] or 0, kv[0][0],
                                                                    kv[0][2]))]
    return out


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
    if lo is None or hi is None or not ops.has_regions:
        return None
    keep, own = ops.op_self_us(lo, hi)
    tid, start, _, name = ops.cpu_ops.arrays()
    tids, starts, names = tid[keep], start[keep], name[keep]
    cats = [cpu_op_category(ops.op_name_list[k]) for k in names.tolist()]
    in_opt = np.zeros(keep.size, dtype=bool)
    for a, b in optimizer_windows:
        in_opt |= (starts >= a) & (starts <= b)
    is_comm = np.array([cat == "communication" for cat in cats], dtype=bool)
    place = ops.attribute(tids, starts, cats, in_opt, is_comm)
    total = float(own[keep].sum())
    return parts_tables(_cells(place, own[keep], np.arange(keep.size)), total, place.source,
                        int(tid.size - keep.size))


def _cells(place: Placement, us: np.ndarray, rows: np.ndarray) -> Cells:
    """``us`` (float64 per item) of the items ``rows`` (int indexes into ``place``) summed per (part, layer, phase)
    cell in the order of ``rows``, the cells in the order they first appear (the tables' sums over cells follow it)."""
    parts, layers, phases = place.parts, place.layers, place.phases
    n_layers, n_phases = len(layers.names) + 1, len(phases.names)  # layer code -1 (None) as 0
    key = parts.codes[rows].astype(np.int64) * n_layers
    key += layers.codes[rows]
    key += 1
    key *= n_phases
    key += phases.codes[rows]
    met, first, cell = np.unique(key, return_index=True, return_inverse=True)
    sums = np.zeros(met.size)
    np.add.at(sums, cell.reshape(-1), us[rows])  # in the order of the items
    out: Cells = {}
    for k in np.argsort(first, kind="stable").tolist():
        m = int(met[k])
        layer = m // n_phases % n_layers - 1
        out[(parts.names[m // n_phases // n_layers], layers.names[layer] if layer >= 0 else None,
             phases.names[m % n_phases])] = float(sums[k])
    return out


def parts_tables(cells: Cells, total: float, source: str, outside_window: int) -> Parts:
    """The part tables of ``cells`` (``(part, layer, phase) -> us``; ``total`` us): per decoder layer, outside the
    layers, and summed over layers, each row a part by phase with its share of ``total``; with ``total_ms`` and
    ``outside_window`` (the items left out, passed through)."""
    by_layer: dict[Optional[int], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for (part, layer, phase), us in cells.items():
        by_layer[layer][part][phase] += us

    def rows(table: dict[str, dict[str, float]]) -> list[PartRow]:
        order = {p: i for i, p in enumerate(MODEL_PARTS + ("optimizer", "comm_outside", "outside_parts"))}
        out: list[PartRow] = []
        for part in sorted(table, key=lambda p: (order.get(p, len(order)), p)):
            ph = table[part]
            t = sum(ph.values())
            out.append({"part": part, "label": part_label(part), "forward_ms": ms(ph.get("forward", 0.0)),
                        "recompute_ms": ms(ph.get("recompute", 0.0)), "backward_ms": ms(ph.get("backward", 0.0)),
                        "optimizer_ms": ms(ph.get("optimizer", 0.0)), "other_ms": ms(ph.get("other", 0.0)),
                        "total_ms": ms(t), "share_pct": round(100 * t / total, 3) if total else 0.0})
        return out

    summed: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for layer, table in by_layer.items():
        for part, ph in table.items():
            for k, v in ph.items():
                summed[part][k] += v
    return {"source": source,
            "layers": [{"layer": layer, "rows": rows(by_layer[layer])} for layer in sorted(l for l in by_layer if l is not None)],
            "outside_layers": rows(by_layer[None]) if None in by_layer else [],
            "summed": rows(summed), "total_ms": ms(total), "outside_window": outside_window}


def plot_parts(parts: Parts, title: str, out_png: str, clock: str = "GPU time") -> None:
    """Stacked-bar PNG of time (ms) per decoder layer (one bar per layer, then one for the parts
    outside the layers), a colour per part; each segment is the part's forward + recompute + backward
    (+ optimizer, other) time, the split by phase is in the tables.

    Args:
        parts: the ``parts`` member of a kernel summary (:func:`gpu_parts`), or its ``cpu_parts``.
        title: plot title; out_png: destination path; clock: what the time is (the y axis' label).
    """
    plt = pyplot()

    bars = [(f"L{x['layer']}", x["rows"]) for x in parts["layers"]]
    if parts["outside_layers"]:
        bars.append(("outside\nlayers", parts["outside_layers"]))
    labels = []
    for _, rows in bars:
        for r in rows:
            if r["label"] not in labels:
                labels.append(r["label"])
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(bars) + 4), 5), dpi=100)
    bottom = np.zeros(len(bars))
    cmap = plt.get_cmap("tab20")
    for k, label in enumerate(labels):
        vals = np.array([next((r["total_ms"] for r in rows if r["label"] == label), 0.0) for _, rows in bars])
        ax.bar(range(len(bars)), vals, bottom=bottom, color=cmap(k % 20), label=label, width=0.7)
        bottom += vals
    ax.set_xticks(range(len(bars)), [b for b, _ in bars], fontsize=8)
    ax.set_ylabel(f"{clock} [ms] (all phases)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, format="png", metadata={"Software": None})
    plt.close(fig)
