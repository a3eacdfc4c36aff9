"""The Markdown of one rank's kernel trace (``## Kernel trace rank <r>``): overview, top kernels and categories,
time by model part (GPU time, or a CPU run's CPU op time and its heaviest op), kernel efficiency, communication by
process group, host time and waits, annotated regions. Each function renders what the summary holds."""
from __future__ import annotations

from typing import Any, Mapping

from sftprof.analysis.report import findings as fnd
from sftprof.analysis.time.collectives import exposed_groups
from sftprof.analysis.time.host_time import LAUNCH_GAP_US
from sftprof.analysis.trace.kernel_names import short_kernel_name
from sftprof.analysis.report.markdown import fmt, table
from sftprof.analysis.time.model_parts import PHASES
from sftprof.analysis.time.schema import HeaviestOp, HostWaitPlaces, KernelSummary, PartRow
from sftprof.analysis.trial.schema import TraceEntry
from sftprof.analysis.trace.sanity import fault_messages
from sftprof.analysis.time.trace_summary import invalid_events_message
from sftprof.analysis.views.split import VIEWS

__all__ = ["kernel_traces", "GPU_ONLY"]

# What a trace without GPU activity leaves empty: said where such a trace is summarised.
GPU_ONLY = ("only a GPU run fills the GPU sections: top kernels and time by category, kernel efficiency (FLOP/s, "
            "bandwidth), communication by process group and its wait/transfer split, GPU idle and the host waits "
            "behind it, and the memory snapshots (CUDA allocator)")


def _parts_table(rows: list[PartRow]) -> str:
    by_key: list[Mapping[str, Any]] = list(rows)  # a phase's column is read by its "<phase>_ms" key
    return table(["part"] + [f"{p} ms" for p in PHASES] + ["total ms", "share %"],
                 [[r["label"]] + [r[f"{p}_ms"] for p in PHASES] + [r["total_ms"], r["share_pct"]] for r in by_key])


# -- one kernel trace ------------------------------------------------------------------------------------------
def _kernel_overview(t: TraceEntry) -> list[str]:
    k = t["summary"]
    out = []
    if k["invalid_events"]["total"]:
        out.append(f"- {invalid_events_message(k['invalid_events'])}")
    out += [f"- **trace record:** {m}" for m in fault_messages(k["sanity"])] if k.get("sanity") else []
    g, c = k["gpu"], k["communication"]
    out.append(f"- step wall time: {fmt(k['step_window']['wall_ms'])} ms (window: {k['step_window']['source']})")
    if g["activities"]:
        out.append(f"- GPU busy {fmt(g['busy_share_pct'])} % / idle {fmt(g['idle_share_pct'])} %; "
                   f"GPU activity total {fmt(g['total_ms'])} ms in {g['activities']} kernels/memcpy/memset")
        out.append(f"- communication {fmt(c['total_ms'])} ms: hidden under compute {fmt(c['hidden_ms'])} ms, "
                   f"exposed {fmt(c['exposed_ms'])} ms")
    else:
        out.append("- no GPU activity in this trace (CPU-only run): " + GPU_ONLY)
    if c["host_ops"]["ops"]:
        out.append(f"- host-side collective ops (gloo:/nccl:): {c['host_ops']['ops']} ops, "
                   f"{fmt(c['host_ops']['wall_ms'])} ms wall: " +
                   ", ".join(f"{name} {fmt(v)} ms" for name, v in c["host_ops"]["by_op_ms"].items()))
    links = t.get("view_links") or {}
    out.append("- views: " + ", ".join(f"`{p}`" for v in VIEWS for p in t["views"][v])
               + "".join(f"; `{t['views'][v][0]}` is a link to `{t['views'][to][0]}` (the same bytes, stored once)"
                         for v, to in links.items()) + "\n")
    return out


def _kernel_tables(k: KernelSummary) -> list[str]:
    """Top kernels, time by category, top CPU ops and collectives of one rank."""
    out = []
    if k["gpu"]["activities"]:
        out.append("### Top kernels\n")
        out.append(table(["#", "kernel", "calls", "total ms", "share %"],
                         [[i + 1, short_kernel_name(x["name"]), x["calls"], x["total_ms"], x["share_pct"]]
                          for i, x in enumerate(k["top_kernels"])]))
        out.append("\n### Time by category\n")
        out.append(table(["category", "calls", "total ms", "share %"],
                         [[x["category"], x["calls"], x["total_ms"], x["share_pct"]] for x in k["categories"]]))
    if k.get("top_cpu_ops"):
        out.append("\n### Top CPU ops (inclusive: nested ops count in their parents too)\n")
        out.append(table(["op", "calls", "inclusive ms"],
                         [[x["name"], x["calls"], x["inclusive_ms"]] for x in k["top_cpu_ops"]]))
    c = k["communication"]
    if c["kernels"]:
        out.append("\n### Collectives\n")
        out.append(table(["by type", "ms"], [[a, b] for a, b in c["by_type_ms"].items()]))
        out.append(table(["by process group", "ms"], [[a, b] for a, b in c["by_group_ms"].items()]))
    return out


def _parts(t: TraceEntry) -> list[str]:
    k, rank = t["summary"], t["rank"]
    parts = k["parts"]
    plot = f" Plot: `{t['parts_plot']}`." if t.get("parts_plot") else ""
    cpu_parts = k.get("cpu_parts")
    if not parts["total_ms"] and cpu_parts:  # a CPU run: its ops' time by model part
        parts = cpu_parts
        out = [f"\n### {fnd.parts_heading(rank)}\n",
               f"CPU time of the ops that started in the step window: {fmt(parts['total_ms'])} ms of self time (each "
               "op's own time, less the ops it calls; all threads summed; Python time between ops is in none), placed "
               "by the model-part ranges of the trainer's module hooks, backward by the autograd link to its forward "
               f"op; {parts['outside_window']} ops that started outside the window left out.{plot}\n"]
        out += _heaviest_op(k.get("heaviest_op"))
    elif parts["total_ms"]:
        how = ("model-part ranges placed by the trainer's module hooks" if parts["source"] == "module_regions" else
               "**no model-part ranges in this trace**: split by kernel name only")
        out = [f"\n### {fnd.parts_heading(rank)}\n",
               f"GPU time of the activities launched in the step window: {fmt(parts['total_ms'])} ms ({how}; "
               f"{parts['outside_window']} activities launched outside the window, or without a launch record "
               f"starting outside it, left out).{plot}\n"]
    else:
        return []
    out += ["Summed over layers:\n", _parts_table(parts["summed"])]
    for layer in parts["layers"]:
        out.append(f"\nLayer {layer['layer']}:\n")
        out.append(_parts_table(layer["rows"]))
    if parts["outside_layers"] and parts["layers"]:
        out.append("\nOutside the decoder layers:\n")
        out.append(_parts_table(parts["outside_layers"]))
    return out


def _heaviest_op(op: HeaviestOp | None) -> list[str]:
    """A CPU run's heaviest op (:func:`sftprof.analysis.time.host_time.heaviest_op`) in one line."""
    if not op:
        return []
    where = f", in {op['label']}" if op.get("label") else ""
    back = f"; its backward node {op['backward']} {fmt(op['backward_ms'])} ms" if op.get("backward") else ""
    return [f"Heaviest op: **{op['name']}**, {fmt(op['inclusive_ms'])} ms with the ops it calls ({op['calls']} "
            f"call(s){where}){back}.\n"]


def _efficiency(k: KernelSummary, rank: int) -> list[str]:
    eff = k["efficiency"]
    if not (eff["rows"] or eff["memory_bound"]):
        return []
    peak = eff["peak"]
    out = [f"\n### Kernel efficiency, rank {rank}\n",
           f"Device {fmt(peak['device'])}: dense bf16 peak "
           f"{fmt(peak['bf16_flops'] / 1e12 if peak['bf16_flops'] else None, 1)} TFLOP/s, HBM "
           f"{fmt(peak['hbm_bytes_per_s'] / 1e12 if peak['hbm_bytes_per_s'] else None, 2)} TB/s. {eff['note']}.\n",
           table(["kind", "part", "phase", "dtype", "ops", "TFLOP", "GPU ms", "TFLOP/s", "% of peak"],
                 [[r["kind"], r["part"], r["phase"], r["dtype"], r["calls"], r["tflop"], r["gpu_ms"],
                   r["tflops_per_s"], r["pct_of_peak"]] for r in eff["rows"]])]
    if eff["memory_bound"]:
        out.append(table(["copy / fill", "calls", "GiB", "GPU ms", "GB/s", "% of HBM"],
                         [[r["name"], r["calls"], r["gib"], r["gpu_ms"], r["gb_per_s"], r["pct_of_hbm"]]
                          for r in eff["memory_bound"]]))
    return out


def _collectives_by_group(k: KernelSummary, rank: int) -> list[str]:
    coll = k["collectives"]
    if not coll["rows"]:
        return []
    return [f"\n### Communication by process group, rank {rank}\n",
            table(["group", "collective", "calls", "GiB", "GPU ms", "group size", "algbw GB/s", "busbw GB/s"],
                  [[r["group"], r["collective"], r["calls"], r["gib"], r["gpu_ms"], r["group_size"],
                    r["algbw_gb_per_s"], r["busbw_gb_per_s"]] for r in coll["rows"]]),
            table(["group", "exposed ms"], [[g, v] for g, v in exposed_groups(coll).items()]),
            f"{coll['note']}.\n"]


def _host_wait_places(places: HostWaitPlaces | None) -> list[str]:
    """The host wait by place (:func:`sftprof.analysis.time.host_time._host_wait_places`); none in older summaries."""
    if not places or not places["rows"]:
        return []
    rows = [[r["label"], r["phase"], r["launched_under"], r["idle_ms"], r["gaps"], r["mean_gap_us"],
             r.get("longest_gap_us"), r["activities"], r["mean_activity_us"], r["after_blocking_pct"], r["kind"]]
            for r in places["rows"]]
    rest = places.get("rest")
    if rest:
        rows.append([f"{rest['places']} other places", None, None, rest["idle_ms"], rest["gaps"], None, None, None,
                     None, None, None])
    blocked = places.get("after_blocking_by_op") or {}
    return ["GPU idle waiting for the host, by the place of the work that ended each gap (its model part and phase, "
            "and the named op, autograd Function or node, it was launched under); GPU activities: that place's "
            "kernels, copies and fills in the step, with their mean duration; after blocking call: the share of the "
            "idle that follows a blocking CUDA call (the host waited for the GPU to drain, then launched late); "
            f"kind: after blocking calls (half the idle or more), launch-bound (the other gaps and the place's GPU "
            f"activities both under {LAUNCH_GAP_US:.0f} µs on average: short kernels, each costing the host more to "
            "launch than it runs) or host busy (longer gaps, or gaps after longer activities: the host did other work "
            "between launches):\n",
            table(["part", "phase", "launched under", "idle ms", "gaps", "mean gap µs", "longest gap µs",
                   "GPU activities", "mean µs", "after blocking call %", "kind"], rows),
            f"Idle after blocking CUDA calls: {fmt(places['after_blocking_ms'])} ms"
            + (" (" + ", ".join(f"{k} {fmt(v)} ms" for k, v in blocked.items()) + ")" if blocked else "") + ".\n"]


def _host(k: KernelSummary, rank: int) -> list[str]:
    host = k["host"]
    if not host["top_self"]:
        return []
    out = [f"\n### Host, rank {rank}\n"]
    if not (k.get("gpu") or {}).get("activities"):  # a CPU run: no device to wait for
        out.append("No GPU activity in this trace: no device waits or GPU idle time to report.\n")
    else:
        out.append(f"Blocking CUDA calls in the step window: {fmt(host['sync']['total_ms'])} ms host wait ("
                   + ", ".join(f"{c} {v['calls']}x {fmt(v['ms'])} ms" for c, v in host["sync"]["by_call"].items())
                   + "). An op with sync wait spends that time waiting for the GPU, not working.\n")
    comp = host.get("compile") or {}
    if comp.get("ms"):
        out.append(f"torch.compile in the step window: {fmt(comp['ms'])} ms of host time compiling (dynamo's "
                   "`dynamo` and `(dynamo_timed)` ops, nested ones counted once"
                   + (f"; compile ids {', '.join(comp['compile_ids'])}" if comp.get("compile_ids") else "")
                   + "): this step includes compilation and is not steady state.\n")
    gc_time = host.get("gc")
    if gc_time and gc_time["collections"]:
        gens = ", ".join(f"gen {g} {n}x" for g, n in gc_time["by_generation"].items())
        gpu_idle = host.get("gpu_idle")
        during = gpu_idle.get("host_wait_gc_ms") if gpu_idle else None
        out.append(f"Python garbage collection in the step window: {gc_time['collections']} collection(s)"
                   + (f" ({gens})" if gens else "") + f", {fmt(gc_time['ms'])} ms of host time"
                   + (f"; {fmt(during)} ms of the GPU's host wait fell in a collection" if during else "")
                   + ". A collection stops every Python thread.\n")
    idle = host.get("gpu_idle") if (k.get("gpu") or {}).get("activities") else None
    if idle:
        out.append(f"GPU idle in the step window {fmt(idle['idle_ms'])} ms: host wait (next work launched after "
                   f"the GPU went idle) {fmt(idle['host_wait_ms'])} ms, kernel wait (work queued, waiting on a "
                   f"dependency) {fmt(idle['kernel_wait_ms'])} ms, after the last activity "
                   f"{fmt(idle.get('after_last_activity_ms'))} ms.\n")
        out += _host_wait_places(idle.get("host_wait_by_place"))
    out.append(table(["op", "calls", "self ms", "inclusive ms", "sync wait ms"],
                     [[r["name"], r["calls"], r["self_ms"], r["inclusive_ms"], r["sync_wait_ms"]]
                      for r in host["top_self"]]))
    return out


def _regions(k: KernelSummary) -> list[str]:
    if not k["regions"]:
        return []
    return ["\n### Annotated regions\n",
            table(["region", "start ms", "CPU ms", "GPU ms"],
                  [[r["name"], r["start_ms"], r["cpu_ms"], r["gpu_ms"]] for r in k["regions"]])]


def _kernel_trace(t: TraceEntry) -> list[str]:
    out = [f"## Kernel trace rank {t['rank']} (`{t['source']}`)\n"]
    if "error" in t:
        return out + [f"**error:** {t['error']}\n"]
    k, rank = t["summary"], t["rank"]
    out += _kernel_overview(t) + _kernel_tables(k)
    out += _parts(t) + _efficiency(k, rank) + _collectives_by_group(k, rank) + _host(k, rank)
    return out + _regions(k) + [""]


def kernel_traces(s: Mapping[str, Any]) -> list[str]:
    """The section of each kernel trace of the summary ``s`` (a ProfileSummary)."""
    return [line for t in s.get("kernel_traces") or [] for line in _kernel_trace(t)]
