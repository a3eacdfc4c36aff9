"""Markdown rendering of a profile summary (``profile_summary.md``) and the table helpers shared with
:mod:`sftprof.analysis.compare`.

:func:`render_markdown` joins the sections of :data:`SECTIONS` in order; each section is a function of the
summary dict (:func:`sftprof.analysis.summary.postprocess_trial`) returning its Markdown lines (none when
the summary has nothing for it). Numbers are printed as the summary holds them (floats with 3 decimals).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from sftprof.analysis import findings as fnd
from sftprof.analysis.failure import failure_cause, headline
from sftprof.analysis.kernel_names import short_kernel_name
from sftprof.analysis.memory_summary import peak_where
from sftprof.analysis.step_breakdown import LAUNCH_GAP_US, PHASES, exposed_groups
from sftprof.analysis.trace_summary import invalid_events_message
from sftprof.analysis.views import VIEWS

__all__ = ["render_markdown", "SECTIONS", "RANK_COLUMNS", "fmt", "table", "short", "GPU_ONLY"]

# What a trace without GPU activity leaves empty: said where such a trace is summarised.
GPU_ONLY = ("only a GPU run fills the GPU sections: top kernels and time by category, kernel efficiency (FLOP/s, "
            "bandwidth), communication by process group and its wait/transfer split, GPU idle and the host waits "
            "behind it, and the memory snapshots (CUDA allocator)")

# Columns of the rank table (:func:`sftprof.analysis.summary.rank_table`), in display order; the summary
# reports the max/min imbalance of each.
RANK_COLUMNS = ("step_ms", "stats_peak_allocated_gb", "snapshot_peak_allocated_gib", "snapshot_peak_reserved_gib",
                "comm_ms", "exposed_comm_ms", "host_comm_ms")


# -- shared table helpers ------------------------------------------------------------------------------------
def fmt(v: Any, nd: int = 3) -> str:
    """A table cell: ``–`` for None, floats with ``nd`` decimals, anything else as ``str``."""
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _cell(x: Any) -> str:
    return fmt(x).replace("|", "\\|")


def table(headers: list[str], rows: Iterable[list], cell: Callable[[Any], str] = _cell) -> str:
    """A Markdown table (ending in a newline); each value goes through ``cell`` (default: :func:`fmt`, ``|`` escaped)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def short(name: str, n: int) -> str:
    """``name`` cut to ``n`` characters (the last one ``…``) when longer."""
    return name if len(name) <= n else name[: n - 1] + "…"


def _with_rank(value, rank, prefix: str = "r") -> str:
    """``"45.485 (r0)"``: a value and where it was found (``prefix`` ``"L"``: a layer); ``–`` for None."""
    return "–" if value is None else f"{fmt(value)} ({prefix}{rank})"


def _parts_table(rows: list[dict]) -> str:
    return table(["part"] + [f"{p} ms" for p in PHASES] + ["total ms", "share %"],
                 [[r["label"]] + [r[f"{p}_ms"] for p in PHASES] + [r["total_ms"], r["share_pct"]] for r in rows])


# -- trial-level sections ------------------------------------------------------------------------------------
def _header(s: dict) -> list[str]:
    c = s["completion"]
    cause = failure_cause(s)  # the Failure section's first failure, else the completion record's error
    return [f"# Profile summary: {s['trial']}\n",
            f"- kind: **{s['profile_kind']}**, step **{s['profile_step']}**",
            f"- trial status: **{s['status']}**" + (f" — {cause[0]}: `{cause[1]}`" if cause else ""),
            f"- steps done: {fmt(c['steps_done'])}, world size: {fmt(c['world_size'])}, "
            f"backend: {fmt(c['backend'])}, device: {fmt(c['device'])}",
            "- counts: " + ", ".join(f"{k} {v}" for k, v in s["counts"].items()),
            f"- log dir: `{s['paths']['log_dir']}`", f"- run dir: `{s['paths']['run_dir']}`", ""]


def _findings(s: dict) -> list[str]:
    out = []
    if s.get("findings"):
        out.append("## Findings\n")
        out += [f"{i + 1}. {f['text']} ([details]({f['section']}))" for i, f in enumerate(s["findings"])]
        out.append("")
    if s.get("what_if"):
        out.append("## What if\n")
        out += [f"- {w['text']}. Assumes: {w['assumption']}." for w in s["what_if"]]
        out.append("")
    return out


def _problems(s: dict) -> list[str]:
    out = []
    for key, title, col, field in (("errors", "Errors", "error", "error"), ("warnings", "Warnings", "warning", "warning"),
                                   ("skipped", "Skipped files", "why", "reason")):
        if s.get(key):
            out.append(f"## {title}\n")
            out.append(table(["file", col], [[e["file"], e[field]] for e in s[key]]))
    return out


def _failure(s: dict) -> list[str]:
    fail = s.get("failure")
    if not fail:
        return []
    first_line = (fail["traceback"].splitlines() or [""])[0]
    if fail.get("node") is not None:
        out = ["## Failure\n", f"- first failure: **{headline(fail)}** (host {fmt(fail['host'])}): {first_line}"]
    else:
        out = ["## Failure\n", f"- first failing rank: **{fail['rank']}** ({fail['how']}, host {fmt(fail['host'])}): "
                               f"`{first_line}`"]
    if fail["others"]:
        out.append("- then: " + ", ".join(f"rank {o['rank']} {o['how']}" for o in fail["others"]))
    for n in fail.get("nodes") or []:
        out.append(f"- also: {headline(n)} (host {fmt(n['host'])}): {n['detail']}")
    tail = fail["log_tail"] + (fail["traceback"].splitlines()[1:] if "\n" in fail["traceback"] else [])
    if tail:
        out.append(f"\nRank {fail['rank']}'s log (tail):\n\n```\n" + "\n".join(tail) + "\n```")
    out.append("")
    return out


def _log_tail(s: dict) -> list[str]:
    if not s.get("trainer_log_tail"):
        return []
    return [f"## Log tail: {s['log_tail_source']}\n\n```\n" + "\n".join(s["trainer_log_tail"]) + "\n```\n"]


def _steps(s: dict) -> list[str]:
    st = s["stats"]
    if not st["steps"]:
        return []
    moe = any(x.get("moe") for x in st["steps"])
    out = ["## Steps (stats.jsonl)\n",
           "Recompute TFLOP/s/GPU: FLOPs re-run by activation recompute per second of step time (work the "
           "GPU does on top of the model FLOPs; not in MFU)."
           + (" MoE routing, over the layers, summed over all ranks (first-pass forwards): the busiest expert's "
              "tokens over the mean per expert, and the busiest EP rank's over the mean per EP rank (1.0 = "
              "balanced), each at its worst layer (L)." if moe else "") + "\n"]
    out.append(table(["step", "step time s", "tokens/s", "peak alloc GiB (rank)", "peak reserved GiB (rank)",
                      "over ranks", "MFU", "recompute TFLOP/s/GPU"]
                     + (["expert max/mean (L)", "EP rank max/mean (L)"] if moe else []) + ["profiled"],
                     [[x["step"], x["step_time_s"], x["tokens_per_s"],
                       _with_rank(x["mem_peak_allocated_gb"], x["mem_peak_allocated_rank"]),
                       _with_rank(x["mem_peak_reserved_gb"], x["mem_peak_reserved_rank"]),
                       "max of all" if x["n_ranks"] > 1 else "rank 0 only", x["mfu"],
                       x.get("recompute_tflops_per_gpu")]
                      + (_moe_cells(x.get("moe")) if moe else []) + [x["profiled"]]
                      for x in st["steps"]]))
    return out


def _moe_cells(m: dict | None) -> list:
    """The two routing cells of a Steps row: ``"16.000 (L3)"`` and the EP rank's (``–`` without data)."""
    if not m:
        return [None, None]
    return [_with_rank(m["max_over_mean"], m["worst_layer"], "L"),
            _with_rank(m["ep_max_over_mean"], m["ep_worst_layer"], "L")]


def _nvidia_smi(s: dict) -> list[str]:
    smi = s["nvidia_smi"]
    if not smi["available"]:
        return []
    out = [f"## nvidia-smi ({smi['samples']} samples)\n",
           table(["GPU", "peak used MiB", "total MiB", "peak util %", "mean util % (whole trial)"],
                 [[g["index"], g["peak_memory_used_mib"], g["memory_total_mib"], g["peak_utilization_pct"],
                   g["mean_utilization_pct"]] for g in smi["gpus"]])]
    ps = smi.get("profiled_step")
    if ps:
        out.append("\nInside the profiled step's window (from the trace; nvidia-smi timestamps read as local time). "
                   "utilization.gpu is the share of time any kernel ran, like GPU busy %, not SM or tensor-core "
                   "use; the whole-trial mean includes start-up, checkpoint loading and idle time:\n")
        out.append(table(["GPU", "samples", "mean util %", "peak util %", "peak used MiB"],
                         [[g["index"], g["samples"], g["mean_utilization_pct"], g["peak_utilization_pct"],
                           g["peak_memory_used_mib"]] for g in ps["gpus"]]
                         or [["–", 0, None, None, None]]))
    return out


def _work_spread(w: dict | None) -> list[str]:
    """The Ranks section's table of the model parts whose compute time differs most between ranks."""
    if not w:
        return []
    total = ", ".join(f"rank {r} {ms:.1f}" for r, ms in w["compared_ms"].items())
    out = [f"\nWhere the ranks' own GPU work differs: compute kernel time (NCCL kernels left out, their time includes "
           f"waiting) per model part, layer and phase, on the fastest and slowest rank that ran it. A rank whose work "
           f"between two collectives runs longer arrives late at the second and the others wait there: with the same "
           f"shapes on every rank (attention under CP, dense layers) a spread is device speed (clocks under the power "
           f"cap), with data-dependent shapes (routed experts: see the routing in Steps) it is the load. Compute time "
           f"in the cells compared (ms): {total}.\n"]
    if not w["rows"]:
        return out + [f"No cell differs by {w['min_spread_ms']:g} ms or more.\n"]
    out.append(table(["part", "layer", "phase", "min ms (rank)", "max ms (rank)", "spread ms"],
                     [[r["label"], "–" if r["layer"] is None else r["layer"], r["phase"],
                       _with_rank(r["min_ms"], r["min_rank"]), _with_rank(r["max_ms"], r["max_rank"]), r["spread_ms"]]
                      for r in w["rows"]]))
    return out


def _ranks(s: dict) -> list[str]:
    rows = s["ranks"]["rows"]
    if not rows:
        return []
    cols = [c for c in RANK_COLUMNS + ("gpu_busy_pct",) if any(c in r for r in rows)]
    out = ["## Ranks\n", table(["rank", "coords"] + cols,
                               [[r["rank"], " ".join(f"{k}{v}" for k, v in (r["coords"] or {}).items())]
                                + [r.get(c) for c in cols] for r in rows])]
    imb = s["ranks"]["imbalance"]
    if len(rows) > 1 and imb:
        out.append("\nImbalance (max/min):\n")
        out.append(table(["metric", "max (rank)", "min (rank)", "max/min"],
                         [[k, f"{fmt(v['max'])} (r{v['max_rank']})", f"{fmt(v['min'])} (r{v['min_rank']})",
                           v["max_over_min"]] for k, v in imb.items()]))
    out += _work_spread(s["ranks"].get("work_spread"))
    ex = s["ranks"].get("exposed_by_group")
    if ex and ex["groups"]:
        out.append("\nExposed communication by process group and rank (ms):\n")
        out.append(table(["group"] + [f"rank {r}" for r in ex["ranks"]],
                         [[g["group"]] + [g["ms"][r] for r in ex["ranks"]] for g in ex["groups"]]))
        if ex["extra_ms"] > 0:
            parts = ", ".join(f"{g} {ms:+.1f}" for g, ms in ex["extra_by_group"] if abs(ms) >= fnd.EXPOSED_GAP_MIN_MS)
            by_group = (f"by group (ms; groups that overlap each other each count, so they need not add up to it): "
                        f"{parts}" if parts else
                        f"no process group's exposed time differs between them by {fnd.EXPOSED_GAP_MIN_MS} ms or "
                        "more, so the difference is not attributed to a group")
            out.append(f"\nRank {ex['max_rank']} has {ex['extra_ms']:.1f} ms more exposed communication than rank "
                       f"{ex['min_rank']}; {by_group}. A "
                       "collective's kernel runs from its own rank's launch until every rank has joined, so a rank that "
                       "arrives first shows the others' lateness as exposed time: where the bytes are the same on both "
                       "ranks, the extra is load imbalance before the collective, not transfer.\n")
    return out + _comm_wait(s.get("comm_wait"))


def _waited_for(rows: list[dict], key: str) -> str:
    return ", ".join(f"r{x['rank']} {x[key]:.1f}" for x in rows) or "–"


def _comm_wait(cw: dict | None) -> list[str]:
    """The Ranks section's split of communication into waiting for the last rank and transfer
    (:func:`sftprof.analysis.comm_wait.split`)."""
    if not cw:
        return []
    out = []
    if cw["groups"]:
        out.append("\nCommunication split into waiting for the last rank to arrive and transfer, matched call by call "
                   "across the ranks' traces (ms; wait = the part of a rank's NCCL kernel time before the last member "
                   "rank launched the same call, the rest is transfer; exposed = not overlapped by computation):\n")
        out.append(table(["group", "rank", "calls", "NCCL", "wait", "transfer", "exposed", "exposed wait",
                          "exposed transfer", "arrived last (calls)", "waited for (rank ms)"],
                         [[g["label"], r["rank"], r["calls"], r["comm_ms"], r["wait_ms"], r["transfer_ms"], r["exposed_ms"],
                           r["exposed_wait_ms"], r["exposed_transfer_ms"], r["last_arrivals"],
                           _waited_for(r["waited_for"], "wait_ms")] for g in cw["groups"] for r in g["ranks"]]))
        out.append("")
        for g in cw["groups"]:
            st = g["straggler"]
            if st["others_wait_ms"] > 0:
                out.append(f"- {g['label']}: the other ranks waited longest for rank {st['rank']}: "
                           f"{st['others_wait_ms']:.1f} ms ({st['others_exposed_wait_ms']:.1f} ms exposed); it arrived "
                           f"last in {st['last_arrivals']} of {g['calls']} calls")
        for r in cw["ranks"]:
            if r["exposed_ms"]:
                out.append(f"- rank {r['rank']}: exposed communication in the split groups {r['exposed_ms']:.1f} ms: "
                           f"{r['exposed_wait_ms']:.1f} ms waiting (for {_waited_for(r['waited_for'], 'exposed_wait_ms')}) "
                           f"and {r['exposed_transfer_ms']:.1f} ms transfer (groups that overlap each other count once)")
        out.append("- clocks: " + "; ".join(
            f"ranks {o['ranks'][0]} and {o['ranks'][1]}: matched calls end {o['median_end_difference_us']:+.1f} µs "
            f"apart (median of {o['calls']})" for o in cw["clock_offsets"])
            + f"; a pair beyond ±{cw['clock_tolerance_us']:g} µs (clocks of different hosts) is not split")
    if cw["not_split"]:
        out.append(f"\nNot split ({len(cw['not_split'])} process group{'s' if len(cw['not_split']) > 1 else ''}):\n")
        out += [f"- {g['label']} (process group {g['group']}): {g['reason']}" for g in cw["not_split"]]
    if cw["unnamed_kernels"]:
        out.append("- NCCL kernels without a process group, left out: "
                   + ", ".join(f"rank {u['rank']} {u['kernels']}" for u in cw["unnamed_kernels"]))
    out.append("")
    return out


# -- one kernel trace ------------------------------------------------------------------------------------------
def _kernel_overview(t: dict) -> list[str]:
    k = t["summary"]
    out = []
    if k["invalid_events"]["total"]:
        out.append(f"- {invalid_events_message(k['invalid_events'])}")
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


def _kernel_tables(k: dict) -> list[str]:
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


def _parts(t: dict) -> list[str]:
    k, rank = t["summary"], t["rank"]
    parts = k["parts"]
    plot = f" Plot: `{t['parts_plot']}`." if t.get("parts_plot") else ""
    if not parts["total_ms"] and k.get("cpu_parts"):  # a CPU run: its ops' time by model part
        parts = k["cpu_parts"]
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


def _heaviest_op(op: dict | None) -> list[str]:
    """A CPU run's heaviest op (:func:`sftprof.analysis.cpu_parts.heaviest_op`) in one line."""
    if not op:
        return []
    where = f", in {op['label']}" if op.get("label") else ""
    back = f"; its backward node {op['backward']} {fmt(op['backward_ms'])} ms" if op.get("backward") else ""
    return [f"Heaviest op: **{op['name']}**, {fmt(op['inclusive_ms'])} ms with the ops it calls ({op['calls']} "
            f"call(s){where}){back}.\n"]


def _efficiency(k: dict, rank: int) -> list[str]:
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


def _collectives_by_group(k: dict, rank: int) -> list[str]:
    coll = k["collectives"]
    if not coll["rows"]:
        return []
    return [f"\n### Communication by process group, rank {rank}\n",
            table(["group", "collective", "calls", "GiB", "GPU ms", "group size", "algbw GB/s", "busbw GB/s"],
                  [[r["group"], r["collective"], r["calls"], r["gib"], r["gpu_ms"], r["group_size"],
                    r["algbw_gb_per_s"], r["busbw_gb_per_s"]] for r in coll["rows"]]),
            table(["group", "exposed ms"], [[g, v] for g, v in exposed_groups(coll).items()]),
            f"{coll['note']}.\n"]


def _host_wait_places(places: dict | None) -> list[str]:
    """The host wait by place (:func:`sftprof.analysis.step_breakdown._host_wait_places`); none in older summaries."""
    if not places or not places["rows"]:
        return []
    rows = [[r["label"], r["phase"], r["launched_under"], r["idle_ms"], r["gaps"], r["mean_gap_us"], r["activities"],
             r["mean_activity_us"], r["after_blocking_pct"], r["kind"]] for r in places["rows"]]
    if places.get("rest"):
        rest = places["rest"]
        rows.append([f"{rest['places']} other places", None, None, rest["idle_ms"], rest["gaps"], None, None, None, None,
                     None])
    blocked = places.get("after_blocking_by_op") or {}
    return ["GPU idle waiting for the host, by the place of the work that ended each gap (its model part and phase, "
            "and the named op, autograd Function or node, it was launched under); GPU activities: that place's "
            "kernels, copies and fills in the step, with their mean duration; after blocking call: the share of the "
            "idle that follows a blocking CUDA call (the host waited for the GPU to drain, then launched late); "
            f"kind: after blocking calls (half the idle or more), launch-bound (the other gaps and the place's GPU "
            f"activities both under {LAUNCH_GAP_US:.0f} µs on average: short kernels, each costing the host more to "
            "launch than it runs) or host busy (longer gaps, or gaps after longer activities: the host did other work "
            "between launches):\n",
            table(["part", "phase", "launched under", "idle ms", "gaps", "mean gap µs", "GPU activities", "mean µs",
                   "after blocking call %", "kind"], rows),
            f"Idle after blocking CUDA calls: {fmt(places['after_blocking_ms'])} ms"
            + (" (" + ", ".join(f"{k} {fmt(v)} ms" for k, v in blocked.items()) + ")" if blocked else "") + ".\n"]


def _host(k: dict, rank: int) -> list[str]:
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


def _regions(k: dict) -> list[str]:
    if not k["regions"]:
        return []
    return ["\n### Annotated regions\n",
            table(["region", "start ms", "CPU ms", "GPU ms"],
                  [[r["name"], r["start_ms"], r["cpu_ms"], r["gpu_ms"]] for r in k["regions"]])]


def _kernel_trace(t: dict) -> list[str]:
    out = [f"## Kernel trace rank {t['rank']} (`{t['source']}`)\n"]
    if "error" in t:
        return out + [f"**error:** {t['error']}\n"]
    k, rank = t["summary"], t["rank"]
    out += _kernel_overview(t) + _kernel_tables(k)
    out += _parts(t) + _efficiency(k, rank) + _collectives_by_group(k, rank) + _host(k, rank)
    return out + _regions(k) + [""]


def _kernel_traces(s: dict) -> list[str]:
    return [line for t in s.get("kernel_traces") or [] for line in _kernel_trace(t)]


# -- one memory snapshot ---------------------------------------------------------------------------------------
def _estimate(m: dict) -> list[str]:
    """The theoretical estimate of one snapshot's rank against what the snapshot measured."""
    x, est = m["summary"], m.get("estimate")
    if not est:
        return [f"\n{m['estimate_note']}\n"] if m.get("estimate_note") else []
    cmp_rows = fnd.explain_estimate(x, est) or []
    return [f"\nTheoretical estimate ({est['params_dense'] + est['params_expert']:,} parameters on this rank: "
            f"{est['params_dense']:,} dense, {est['params_expert']:,} expert; "
            + "; ".join(est["assumptions"]) + "):\n",
            table(["category", "estimated GiB", "formula"],
                  [[r["category"], r["gib"], r["formula"]] for r in est["rows"]]),
            table(["category", "measured GiB", "estimated GiB", "measured - estimated GiB"],
                  [[r["category"], round(r["measured_bytes"] / 2**30, 4), round(r["estimated_bytes"] / 2**30, 4),
                    round(r["difference_bytes"] / 2**30, 4)] for r in cmp_rows]),
            "Differences: the activation estimate is a lower bound (the working set of the layer in "
            "backward is not counted); blocks allocated before the recorded window carry no stack and are "
            "set against parameters, gradients and optimizer state together." + _step_copy_note(cmp_rows, est) + "\n"]


def _step_copy_note(cmp_rows: list[dict], est: dict) -> str:
    """Says so when the measured optimizer state is the estimate without the fp32 gradient copy (within 1 %)."""
    copy = next((r.get("step_copy_bytes") or 0 for r in est["rows"] if r["category"] == "optimizer"), 0)
    opt = next((r for r in cmp_rows if r["category"] == "optimizer"), None)
    if not copy or not opt or abs(-opt["difference_bytes"] - copy) > 0.01 * copy:
        return ""
    return (f" Optimizer: the measured state is the estimate less the fp32 gradient copy ({copy / 2**30:.2f} GiB), "
            "which megatron-core's optimizers make in the optimizer step (`_copy_model_grads_to_main_grads`): "
            "this peak is outside it.")


def _memory_peaks(x: dict) -> list[str]:
    """The peak lines of one snapshot summary (:func:`sftprof.analysis.memory_summary.analyze_snapshot`): the
    headline peak, named the profiled step's or the recorded window's, with its place in words
    (:func:`peak_where`), and the whole window's peak beside it (where it lies and what was alive then when it is
    outside the step)."""
    if x.get("peak_scope") == "profiled_step":
        w = x["step_window"]
        out = [f"- peak allocated in the profiled step **{fmt(x['peak_allocated_gib'])} GiB** at "
               f"{fmt(x['peak_time_ms'])} ms, {peak_where(x)} (step {fmt(w['start_ms'])}–{fmt(w['end_ms'])} ms, from "
               f"`{w['source']}`, of a {fmt(x['window_ms'])} ms recorded window; times from its first event)",
               f"- peak reserved in the profiled step {fmt(x['peak_reserved_gib'])} GiB; reserved − allocated at "
               f"the peak {fmt(x['reserved_minus_allocated_at_peak_gib'])} GiB"]
        if x["window_peak_position"] == "in_step":
            out.append(f"- the whole recorded window peaks in the profiled step too (reserved peak "
                       f"{fmt(x['window_peak_reserved_gib'])} GiB)")
        else:
            alive = ", ".join(f"`{short(y['site'], 80)}` {fmt(y['gib'])} GiB" for y in x["window_top_sites"][:3])
            out.append(f"- **the recorded window peaks higher, outside the profiled step:** "
                       f"{fmt(x['window_peak_allocated_gib'])} GiB allocated at {fmt(x['window_peak_time_ms'])} ms, "
                       f"{peak_where(x, 'window')}; reserved peak {fmt(x['window_peak_reserved_gib'])} GiB; "
                       f"alive then: {alive}. The figures below are the profiled step's peak")
        return out
    return [f"- peak allocated **{fmt(x['peak_allocated_gib'])} GiB** at {fmt(x['peak_time_ms'])} ms of the "
            f"{fmt(x['window_ms'])} ms recorded window (from its first event); no phases recorded, so neither its "
            "phase nor the profiled step's own peak is known",
            f"- peak reserved {fmt(x['peak_reserved_gib'])} GiB; reserved − allocated at the peak "
            f"{fmt(x['reserved_minus_allocated_at_peak_gib'])} GiB"]


def _memory_snapshot(m: dict) -> list[str]:
    out = [f"## Memory snapshot rank {m['rank']} (`{m['file']}`)\n"]
    if "error" in m:
        kept = ", ".join(f"`{f}`" for f in m.get("kept_files") or [])
        return out + [f"**error:** {m['error']}\n"] + (
            [f"Kept from an earlier postprocess (not from this snapshot): {kept}\n"] if kept else [])
    x = m["summary"]
    out += _memory_peaks(x)
    if x["history"]["truncated"]:
        out.append(f"- **truncated window:** {x['history']['message']}")
    out.append(f"- plot: `{m['plot']}`\n")
    out.append(f"### {fnd.memory_heading(m['rank'])}\n")
    out.append(table(["category", "GiB", "blocks", "share % of allocated"],
                     [[r["label"], r["gib"], r["blocks"], r["share_pct"]] for r in x["categories_at_peak"]]))
    out += _estimate(m)
    if x.get("transient_spikes"):
        scope = "the profiled step" if x.get("peak_scope") == "profiled_step" else "the window"
        out.append(f"\nTransient spikes (largest blocks allocated inside {scope} and freed inside the window):\n")
        out.append(table(["GiB", "lifetime ms", "site"],
                         [[r["gib"], r["lifetime_ms"], short(r["site"], 140)] for r in x["transient_spikes"]]))
    out += ["", "### Alive at the peak, by allocation site\n",
            table(["site", "GiB", "blocks", "share %"],
                  [[short(y["site"], 140), y["gib"], y["blocks"], y["share_pct"]] for y in x["top_sites"]]), ""]
    return out


def _memory_snapshots(s: dict) -> list[str]:
    return [line for m in s.get("memory_snapshots") or [] for line in _memory_snapshot(m)]


SECTIONS: tuple[Callable[[dict], list[str]], ...] = (
    _header, _findings, _problems, _failure, _log_tail, _steps, _nvidia_smi, _ranks, _kernel_traces, _memory_snapshots)


def render_markdown(s: dict) -> str:
    """Markdown rendering of a profile summary dict (the ``profile_summary.md`` file): the :data:`SECTIONS` in order.

    Raises:
        KeyError, TypeError: a summary without the members :func:`sftprof.analysis.summary.postprocess_trial` writes.
    """
    return "\n".join(line for section in SECTIONS for line in section(s)) + "\n"
