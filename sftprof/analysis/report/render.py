"""Markdown rendering of a profile summary (``profile_summary.md``).

:func:`render_markdown` joins the sections of :data:`SECTIONS` in order; each section is a function of the
summary (:class:`sftprof.analysis.schema.ProfileSummary`) returning its Markdown lines (none when the summary has
nothing for it): the trial-level sections here, one kernel trace's in :mod:`sftprof.analysis.report.trace`, one
memory snapshot's in :mod:`sftprof.analysis.report.memory`. Rendering computes nothing: it prints what the summary
holds (floats with 3 decimals, :mod:`sftprof.analysis.report.markdown`).
"""
from __future__ import annotations

import re
from typing import Callable, Literal

from sftprof.analysis.report import findings as fnd
from sftprof.artifacts import ENVIRONMENT, VERSIONS, compare_report_name
from sftprof.analysis.trial.failure import failure_cause, headline
from sftprof.analysis.report.markdown import fmt, table, with_rank
from sftprof.analysis.report.schema import Finding
from sftprof.analysis.time.projection import real_rank_text
from sftprof.analysis.time.rank_table import RANK_COLUMNS
from sftprof.analysis.trial.wall_time import PHASES
from sftprof.analysis.report.memory import memory_snapshots
from sftprof.analysis.report.trace import kernel_traces
from sftprof.analysis.schema import ProfileSummary
from sftprof.analysis.time.schema import CommWait, WaitedFor, WorkSpread
from sftprof.analysis.trial.schema import MoeRouting
from sftprof.analysis.views.schema import MergedView

__all__ = ["render_markdown", "SECTIONS"]


def _projection(s: ProfileSummary) -> list[str]:
    """A simulated rank's projected step (``simulation.projection``): per collective, the totals, the memory."""
    sim = s.get("simulation")
    if not sim:
        return []
    p = sim["projection"]
    if p is None:
        return ["## Projected step (simulated rank)\n", f"No projection: {sim['projection_error']}", ""]
    mem = p["memory"]
    rows = [[r["group"], r["collective"], r["interconnect"], r["calls"], fmt(r["mib_per_call"]), fmt(r["gbps"]),
             fmt(r["ms"]), fmt(r["exposed_ms"]), r["overlap"]] for r in p["rows"]]
    return ["## Projected step (simulated rank)\n",
            f"compute {fmt(p['compute_ms'])} ms (measured) + exposed communication {fmt(p['exposed_ms'])} ms "
            f"(computed) = **{fmt(p['projected_step_ms'])} ms** (serial bound {fmt(p['serial_step_ms'])} ms)"
            + (f", MFU {fmt(100 * p['mfu'])} %" if p["mfu"] is not None else "") + "; memory: measured peak "
            f"{fmt(mem['measured_peak_gib'])} GiB + NCCL buffers {fmt(mem['nccl_buffers_gib'])} GiB (estimated) = "
            f"{fmt(mem['projected_peak_gib'])} GiB; {real_rank_text(mem)}\n",
            table(["group", "collective", "link", "calls", "MiB/call", "GB/s", "ms", "exposed ms", "overlap"], rows),
            "", "Assumptions:", *[f"- {a}" for a in p["assumptions"]], ""]


# -- trial-level sections ------------------------------------------------------------------------------------
def _header(s: ProfileSummary) -> list[str]:
    c = s["completion"]
    cause = failure_cause(s)  # the Failure section's first failure, else the completion record's error
    sim = s.get("simulation")
    title = (f"# Profile summary: {s['trial']} — SIMULATED rank {sim['rank']} of {sim['world_size']}, alone on one "
             f"device; not run: {sim['not_run']}; assumed: {sim['assumed']}\n" if sim else
             f"# Profile summary: {s['trial']}\n")
    return [title,
            f"- kind: **{s['profile_kind']}**, step **{s['profile_step']}**",
            f"- trial status: **{s['status']}**" + _unread_files(s)
            + (f" — {cause[0]}: `{cause[1]}`" if cause else ""),
            f"- steps done: {fmt(c['steps_done'])}, world size: {fmt(c['world_size'])}, "
            f"backend: {fmt(c['backend'])}, device: {fmt(c['device'])}",
            "- counts: " + ", ".join(f"{k} {v}" for k, v in s["counts"].items()),
            *_environment_line(s), *_versions_line(s),
            f"- log dir: `{s['paths']['log_dir']}`", f"- run dir: `{s['paths']['run_dir']}`", ""]


def _unread_files(s: ProfileSummary) -> str:
    """The status line's tail when traces (kernel trial) or snapshots (memory trial) failed to read: the status is
    the training's, e.g. `` (training); traces: 0 of 1 read, 1 error``; "" when every one was read."""
    noun, items = (("traces", s.get("kernel_traces") or []) if s["profile_kind"] == "kernel"
                   else ("snapshots", s.get("memory_snapshots") or []))
    failed = sum(1 for it in items if "error" in it)
    if not failed:
        return ""
    return (f" (training); {noun}: {len(items) - failed} of {len(items)} read, {failed} "
            f"error{'s' if failed > 1 else ''}")


def _environment_line(s: ProfileSummary) -> list[str]:
    """The header's line of the recorded environment variables (none for a summary of an earlier schema)."""
    if "environment" not in s:
        return []
    env = s["environment"]
    if not isinstance(env, dict):
        return [f"- environment: not recorded (no readable {ENVIRONMENT})"]
    return ["- environment (recorded variables): " + (", ".join(_code(f"{k}={v}") for k, v in sorted(env.items()))
                                                  or "none set")]


def _versions_line(s: ProfileSummary) -> list[str]:
    """The header's line of the trial's recorded software versions (none for a summary of an earlier schema)."""
    if "versions" not in s:
        return []
    versions = s["versions"]
    if versions is None:
        return [f"- versions: not recorded (no readable {VERSIONS})"]
    return ["- versions: " + ", ".join(f"{k} {v or 'absent'}" for k, v in versions.items())]


def _code(text: str) -> str:
    """``text`` as one inline code span on one line: line breaks escaped, a fence longer than any backtick run."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}" if len(fence) > 1 else f"`{text}`"


def _next_step_lines(findings: list[Finding]) -> list[str]:
    """Each finding's next-step line ("" without one): a next step an earlier finding already gave word for word is
    "as finding N's" (N the first that gave it, 1-based); the JSON keeps every finding's full text."""
    first: dict[str, int] = {}
    out = []
    for i, f in enumerate(findings):
        step = f.get("next_step")
        if step:
            out.append(f"\n   - next step: as finding {first[step]}'s" if step in first
                       else f"\n   - next step: {step}")
            first.setdefault(step, i + 1)
        else:
            out.append("")
    return out


def _findings(s: ProfileSummary) -> list[str]:
    out = []
    if s.get("findings"):
        out.append("## Findings\n")
        out += [f"{i + 1}. {f['text']} ([details]({f['section']}))" + step
                + "".join(f"\n   - caveat: {c}" for c in f.get("caveats") or [])
                for i, (f, step) in enumerate(zip(s["findings"], _next_step_lines(s["findings"])))]
        out.append("")
    if s.get("what_if") or s.get("what_if_skipped"):
        out.append("## What if\n")
        out += [f"- {w['text']}. Assumes: {w['assumption']}." for w in s.get("what_if") or []]
        out += [f"- not proposed, {w['label']}" + (f" (rank {w['rank']})" if w["rank"] is not None else "")
                + f": {w['reason']}." for w in s.get("what_if_skipped") or []]
        out.append("")
    return out


def _tried_what_if(s: ProfileSummary) -> list[str]:
    """A what-if trial's record: the trial it varies, the setting applied, the prediction (its outcome: compare)."""
    tried = s.get("tried_what_if")
    if not tried:
        return []
    w = tried["what_if"]
    return ["## What-if trial\n",
            f"This trial tries a what-if of `{tried['source_trial']}` (same kind and step): {w['text']}. "
            f"Assumes: {w['assumption']}.",
            f"Prediction against outcome: `{compare_report_name(tried['source_run_dir'])}` in this run dir "
            "(`postprocess_profile.py compare SOURCE_RUN_DIR THIS_RUN_DIR`).", ""]


def _problems(s: ProfileSummary) -> list[str]:
    out = []
    for title, col, rows in (("Errors", "error", [[e["file"], e["error"]] for e in s.get("errors") or []]),
                             ("Warnings", "warning", [[w["file"], w["warning"]] for w in s.get("warnings") or []]),
                             ("Skipped files", "why", [[k["file"], k["reason"]] for k in s.get("skipped") or []])):
        if rows:
            out.append(f"## {title}\n")
            out.append(table(["file", col], rows))
    return out


def _failure(s: ProfileSummary) -> list[str]:
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


def _oom(s: ProfileSummary) -> list[str]:
    t = s.get("oom")
    if not t:
        return []
    g = float(2**30)

    def gib(b: float | None) -> str:
        return "unknown" if b is None else f"{b / g:.2f}"

    out = ["## Out of memory\n",
           f"- rank **{t['rank']}**, snapshot `memory_snapshots/oom/{t['snapshot']}`"
           + (f" (ranks {', '.join(map(str, t['other_ranks']))} also left one)" if t["other_ranks"] else ""),
           f"- requested {gib(t['requested_bytes'])} GiB of a {gib(t['capacity_bytes'])} GiB GPU: allocated "
           f"{gib(t['allocated_bytes'])}, reserved and not allocated {gib(t['reserved_unallocated_bytes'])}, outside "
           f"PyTorch {gib(t['outside_pytorch_bytes'])}, free {gib(t['free_bytes'])} GiB",
           f"- phase {fmt(t['phase'])}, site {fmt(t['site'])}"]
    p = t["predicted"]
    pred = {r["category"]: r["bytes"] for r in (p.get("rows") if p else None) or []}
    rows = [[r["category"], gib(r["bytes"])] for r in t["live"]]
    out += ["", table(["alive at the failure", "GiB"], rows)]
    if p:
        out += ["", f"Predicted peak {gib(p['peak_bytes'])} GiB in the {p['phase']}"
                + (f"; the failing phase ({p['failing_phase']}) {gib(p['failing_phase_bytes'])} GiB"
                   if p["failing_phase"] else "") + ":", "", table(["category", "predicted GiB"],
                                                                  [[k, gib(v)] for k, v in pred.items()])]
    if t["fits"]:
        out += ["", table(["settings that fit (smallest first)", "predicted peak GiB", "needed GiB"],
                          [[" ".join(f"`{k}={v}`" for k, v in c["settings"].items()), gib(c["peak_bytes"]),
                            gib(c["need_bytes"])] for c in t["fits"]])]
    out += [f"- {e}" for e in t["errors"]] + [""]
    return out


def _log_tail(s: ProfileSummary) -> list[str]:
    tail = s.get("trainer_log_tail")
    if not tail:
        return []
    return [f"## Log tail: {s['log_tail_source']}\n\n```\n" + "\n".join(tail) + "\n```\n"]


def _steps(s: ProfileSummary) -> list[str]:
    st = s["stats"]
    if not st["steps"]:
        return []
    moe = any(x.get("moe") for x in st["steps"])
    sim = s.get("simulation")
    one = f"rank {sim['rank']} only (simulated)" if sim else "rank 0 only"
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
                       with_rank(x["mem_peak_allocated_gb"], x["mem_peak_allocated_rank"]),
                       with_rank(x["mem_peak_reserved_gb"], x["mem_peak_reserved_rank"]),
                       "max of all" if x["n_ranks"] > 1 else one, x["mfu"],
                       x.get("recompute_tflops_per_gpu")]
                      + (_moe_cells(x.get("moe")) if moe else []) + [x["profiled"]]
                      for x in st["steps"]]))
    return out


def _wall_time(s: ProfileSummary) -> list[str]:
    w = s.get("wall_time")
    if not w:
        return []
    total = (f"{w['elapsed_s']:.1f} s" if w["elapsed_s"] is not None
             else "time (no trial_times.json: launch and exit unknown)")
    out = ["## Wall time\n",
           f"Where the trial's {total} went, from torchrun's launch to its exit (the launcher's clock in "
           "trial_times.json, rank 0's in stats.jsonl). Postprocessing, which wrote this summary, is timed in "
           "trial_times.json and the driver's end table.\n",
           table(["phase", "s", "what"], [[p["phase"], fmt(p["seconds"]), PHASES.get(p["phase"], "")]
                                           for p in w["phases"]])]
    barrier = w.get("barrier_s")
    teardown = next((p["seconds"] for p in w["phases"] if p["phase"] == "teardown"), None)
    if barrier is not None and teardown is not None:
        out.append(f"- teardown: {barrier:.3f} s to the ranks' barrier passed (rank 0 waiting for the slowest rank), "
                   f"{teardown - barrier:.3f} s tearing the process groups down")
    c = w.get("cold_start")
    if c and c.get("not_measurable"):
        out.append(f"- cold start: not measurable: step 0 took {c['step0_s']:.3f} s against {c['warm_step_s']:.3f} s "
                   f"for a warm step (median of step(s) {', '.join(map(str, c['warm_steps']))}): "
                   f"{c['not_measurable']}")
    elif c:
        out.append(f"- cold start: step 0 took {c['step0_s']:.3f} s against {c['warm_step_s']:.3f} s for a warm "
                   f"step (median of step(s) {', '.join(map(str, c['warm_steps']))}"
                   + (", profiled: the profiler's cost in it" if c["reference_profiled"] else "")
                   + f"): **{c['cold_start_s']:.3f} s** "
                   "of one-time cost in step 0 (compilation, Triton autotuning, cuDNN/cuBLAS heuristics, the "
                   "allocator's first growth, communicators' set-up), in its step time and in the wall time above")
    out.append("")
    return out


def _moe_cells(m: MoeRouting | None) -> list[str | None]:
    """The two routing cells of a Steps row: ``"16.000 (L3)"`` and the EP rank's (``–`` without data)."""
    if not m:
        return [None, None]
    return [with_rank(m["max_over_mean"], m["worst_layer"], "L"),
            with_rank(m["ep_max_over_mean"], m["ep_worst_layer"], "L")]


def _nvidia_smi(s: ProfileSummary) -> list[str]:
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


def _work_spread(w: WorkSpread | None) -> list[str]:
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
                       with_rank(r["min_ms"], r["min_rank"]), with_rank(r["max_ms"], r["max_rank"]), r["spread_ms"]]
                      for r in w["rows"]]))
    return out


def _ranks(s: ProfileSummary) -> list[str]:
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
        cells = [[g["group"], *[g["ms"][r] for r in ex["ranks"]]] for g in ex["groups"]]
        out.append(table(["group"] + [f"rank {r}" for r in ex["ranks"]], cells))
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
    return out + _comm_wait(s.get("comm_wait")) + _merged_view(s.get("merged_view"))


def _merged_view(m: MergedView | None) -> list[str]:
    """Where the all-ranks timeline is and how each rank's clock was aligned (:mod:`sftprof.analysis.views.merged`)."""
    if not m:
        return []
    if "error" in m:
        return [f"- all ranks on one timeline: {m['error']}\n"]
    how = {"reference": "the reference clock", "trace clock": "its trace clock (no collective in common: unaligned "
           "across hosts)"}
    ranks = "; ".join(f"rank {r['rank']} " + (
        f"{r['shift_us']:+.3f} µs (collective ends, ±{max(p['end_difference_mad_us'] for p in r['path']):.1f} µs)"
        if r["aligned_by"] == "collective ends" else how[r["aligned_by"]]) for r in m["ranks"])
    return ["- all ranks on one timeline (one process per rank; open in Perfetto): "
            + ", ".join(f"`{f}`" for f in m["files"]) + f"; clocks: {ranks}\n"]


def _waited_for(rows: list[WaitedFor], key: Literal["wait_ms", "exposed_wait_ms"]) -> str:
    return ", ".join(f"r{x['rank']} {x[key]:.1f}" for x in rows) or "–"


def _comm_wait(cw: CommWait | None) -> list[str]:
    """The Ranks section's split of communication into waiting for the last rank and transfer
    (:func:`sftprof.analysis.time.comm_wait.split`)."""
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


SECTIONS: tuple[Callable[[ProfileSummary], list[str]], ...] = (
    _header, _tried_what_if, _findings, _problems, _failure, _oom, _log_tail, _steps, _wall_time, _projection,
    _nvidia_smi, _ranks,
    kernel_traces, memory_snapshots)


def render_markdown(s: ProfileSummary) -> str:
    """Markdown rendering of a profile summary dict (the ``profile_summary.md`` file): the :data:`SECTIONS` in order.

    Raises:
        KeyError, TypeError: a summary without the members :func:`sftprof.analysis.summary.postprocess_trial` writes.
    """
    return "\n".join(line for section in SECTIONS for line in section(s)) + "\n"
