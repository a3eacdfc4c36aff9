"""The errors and warnings of a trial's summary: per file ``{"file", "error"}`` / ``{"file", "warning"}``.

Errors: a trace or snapshot that could not be processed (or is not the trial's), a plot that could not be drawn, a
damaged ``rank_coords.json`` or ``config.yaml``, an ``ok`` trial without its artifacts. Warnings: what a summary goes
without or should not be read without: a truncated allocator history, a snapshot whose history cannot give the
profiled step's peak, invalid trace events left out, faults of a trace's record
(:mod:`sftprof.analysis.trace.sanity`), files of an earlier postprocess kept beside those of this one (an all-ranks
view not rebuilt: :func:`kept_merged_view`; the views of a rank without a trace this time: :func:`stale_rank_views`),
a damaged or missing ``stats.jsonl``, optional inputs that are missing, MoE routing that collapsed
(:func:`routing_warnings`), a GPU shared with processes not of the trial (:func:`shared_gpu_warnings`), ranks
``perf_tracer.ranks`` profiles whose trace is missing (:func:`missing_traces`).
"""
from __future__ import annotations

import os
import re

from sftprof import artifacts
from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.trial.inputs import ROUTING_COLLAPSE_SHARE
from sftprof.analysis.memory.snapshot import other_devices_message
from sftprof.analysis.trial.traces import MODEL_PARTS_DIR
from sftprof.analysis.trial.schema import (FileError, FileWarning, NvidiaSmi, SnapshotEntry, Stats, TraceEntry,
                                           TrialRecord)
from sftprof.analysis.trace.check import CATEGORY_ALIAS_NOTE
from sftprof.analysis.trace.sanity import fault_messages
from sftprof.analysis.time.trace_summary import BEGIN_END_NOTE, UNPAIRED_NOTE, invalid_events_message
from sftprof.analysis.views.merged import merged_files
from sftprof.artifacts import KERNEL_TRACES, trace_name
from sftprof.ranks import resolve_ranks
from typing import Any, Mapping, Sequence, TypedDict

__all__ = ["problems", "missing_traces", "missing_trace_warnings", "kept_merged_view", "stale_rank_views",
           "routing_warnings",
           "shared_gpu_warnings", "optional_input_warnings"]

_PLOT_RE = re.compile(r"^rank(\d+)\.png$")  # a rank's model-part plot in MODEL_PARTS_DIR (analysis.trial.traces)
MISSING_TRACE = "no trace in the log dir, though perf_tracer.ranks="  # the warning of :func:`missing_trace_warnings`


def missing_traces(cfg: Mapping[str, Any] | None, items: Sequence[TraceEntry]) -> list[int]:
    """The ranks that the trial's ``perf_tracer.ranks`` profiles (:func:`sftprof.ranks.resolve_ranks` on
    ``actor.backend``'s layout) but whose trace is not in the log dir (deleted, never written): the summary's figures
    leave them out (a warning names each). Empty when the config is absent or does not resolve (nothing is
    assumed)."""
    if cfg is None:
        return []
    try:
        expected = resolve_ranks(cfg["perf_tracer"].get("ranks"), parse_allocation_mode(cfg["actor"]["backend"]))
    except Exception:  # no config, another schema, a spec that does not resolve: no expectation to check
        return []
    have = {it["rank"] for it in items}
    return [r for r in expected if r not in have]


def missing_trace_warnings(cfg: Mapping[str, Any] | None, ranks: list[int]) -> list[FileWarning]:
    """A warning per rank of :func:`missing_traces`, naming the ``perf_tracer.ranks`` that profiles it (none without
    a config: then there are no such ranks)."""
    if cfg is None:
        return []
    return [{"file": os.path.join(artifacts.PERF_TRACER, trace_name(r)),
             "warning": f"rank {r}: {MISSING_TRACE}{cfg['perf_tracer'].get('ranks')!r} profiles it; this summary "
                        "leaves that rank out"} for r in ranks]


def kept_merged_view(record: TrialRecord, run_dir: str) -> list[FileWarning]:
    """The warning (one, or none) that the all-ranks view in ``run_dir`` is an earlier postprocess's: a kernel trial
    whose postprocess wrote fewer than two ranks' views leaves it as it was, not rebuilt
    (:func:`sftprof.analysis.views.merged.merge_trial`; ``record["merged_view"]`` None)."""
    if record["profile_kind"] != "kernel" or record.get("merged_view") is not None:
        return []
    kept = merged_files(os.path.join(run_dir, KERNEL_TRACES))
    if not kept:
        return []
    n = sum("views" in t for t in record.get("kernel_traces") or [])
    return [{"file": ", ".join(os.path.relpath(p, run_dir) for p in kept),
             "warning": f"an earlier postprocess's all-ranks view, left in place: not rebuilt this time, as this "
                        f"postprocess wrote the views of {n} rank(s) only (it merges two or more); it may not match "
                        "this summary's traces"}]


def stale_rank_views(record: TrialRecord, run_dir: str) -> list[FileWarning]:
    """A warning per rank whose views (``RUN_DIR/kernel_traces/<view>/rank<r>.pt.trace.json[.gz]``) or model-part plot
    an earlier postprocess wrote, but which has no trace entry in this summary (its trace absent from the log dir this
    time): they are left in place (nothing written is deleted), named, and are not this summary's figures. A rank
    whose trace failed is its entry's ``kept_views`` instead (:func:`_kept_warnings`)."""
    if record["profile_kind"] != "kernel":
        return []
    have = {t["rank"] for t in record.get("kernel_traces") or []}
    stale: dict[int, list[str]] = {}
    views = os.path.join(run_dir, KERNEL_TRACES)
    for folder in os.listdir(views) if os.path.isdir(views) else []:  # each view (and time-window) folder
        for name in os.listdir(os.path.join(views, folder)) if os.path.isdir(os.path.join(views, folder)) else []:
            rank = artifacts.raw_trace_rank(name)  # a view's file has its rank's trace name
            if rank is not None and rank not in have:
                stale.setdefault(rank, []).append(os.path.join(KERNEL_TRACES, folder, name))
    plots = os.path.join(run_dir, MODEL_PARTS_DIR)
    for name in os.listdir(plots) if os.path.isdir(plots) else []:
        m = _PLOT_RE.match(name)
        if m and int(m.group(1)) not in have:
            stale.setdefault(int(m.group(1)), []).append(os.path.join(MODEL_PARTS_DIR, name))
    return [{"file": ", ".join(sorted(paths)),
             "warning": f"rank {r}: {len(paths)} file(s) of an earlier postprocess kept (views, model-part plot): "
                        "no trace of this rank in the log dir this time, so they are not this summary's figures and "
                        "may not match them"} for r, paths in sorted(stale.items())]


def _kept_warnings(it: TraceEntry | SnapshotEntry, file: str, what: str, kept_views: list[str]) -> list[FileWarning]:
    """The warnings of a trace or snapshot (``what``; ``file``: its file, log-dir relative for a trace) that failed
    while files an earlier postprocess wrote from it stay in the run dir: its entry's ``kept_views`` (a trace's
    views, counted) and ``kept_files`` (a snapshot's archive, plot and phases sidecar; a trace's model-part plot:
    named). They are not from this file."""
    who = f"rank {it['rank']}: " if it["rank"] is not None else ""
    out: list[FileWarning] = []
    if kept_views:
        out.append({"file": file, "warning": f"{who}{len(kept_views)} view file(s) of an earlier "
                                             f"postprocess are kept in {KERNEL_TRACES}/ (not from this trace, "
                                             "which failed)"})
    kept = it.get("kept_files")
    if kept:
        out.append({"file": file,
                    "warning": f"{who}{len(kept)} file(s) of an earlier postprocess are kept in "
                               f"{os.path.dirname(kept[0])}/ (not from this {what}, which failed): "
                               + ", ".join(os.path.basename(p) for p in kept)})
    return out


def _trace_warnings(it: TraceEntry) -> list[FileWarning]:
    """The warnings of one trace: files an earlier postprocess kept, invalid events, the views' repairs, faults of
    its record, a trace read under the profiler's temporary name, a step that cannot be confirmed."""
    what = "model-part plot" if "parts_plot_error" in it else "trace"  # the trace's plot failed, or the trace
    out = _kept_warnings(it, it["source"], what, it.get("kept_views") or [])
    s = None if "error" in it else it.get("summary")  # a trace with an error: only its files and name are said
    inv = s.get("invalid_events") if s else None
    if inv and inv.get("total"):
        out.append({"file": it["source"], "warning": invalid_events_message(inv)})
    notes = (s.get("view_repairs") if s else None) or {}
    if notes.get(CATEGORY_ALIAS_NOTE):
        out.append({"file": it["source"], "warning": f"{notes[CATEGORY_ALIAS_NOTE]} events with "
                    f"{CATEGORY_ALIAS_NOTE}: their figures are kept; the views keep the trace's own spelling"})
    out += [{"file": it["source"], "warning": f"{notes[k]} {k}"} for k in (BEGIN_END_NOTE, UNPAIRED_NOTE)
            if notes.get(k)]
    if s and s.get("sanity"):  # faults of the trace's record and what was done about them
        out += [{"file": it["source"], "warning": m} for m in fault_messages(s["sanity"])]
    if artifacts.unrenamed_trace_rank(os.path.basename(it["source"])) is not None:
        out.append({"file": it["source"], "warning": f"rank {it['rank']}: the trace was left under the "
                    "profiler's temporary name (its rename failed), and is read from there" + (
                        "" if "error" in it else " as the rank's trace: it is complete")})
    if it.get("warning"):  # a trace whose step cannot be confirmed (identity_problems)
        out.append({"file": it["source"], "warning": it["warning"]})
    return out


def _snapshot_warnings(it: SnapshotEntry) -> list[FileWarning]:
    """The warnings of one snapshot: a truncated allocator history, files an earlier postprocess kept, a step peak
    the history cannot give (or only as a lower bound), other devices in the snapshot."""
    s = it.get("summary")
    out: list[FileWarning] = []
    history = s.get("history") if s else None
    if history and history.get("truncated"):
        out.append({"file": it["file"], "warning": history["message"]})
    out += _kept_warnings(it, it["file"], "memory plot" if "plot_error" in it else "snapshot", [])
    unknown, lower_bound = (s.get("step_peak_unknown"), s.get("step_peak_lower_bound")) if s else (None, None)
    if unknown:
        out.append({"file": it["file"], "warning": unknown})
    if lower_bound:
        out.append({"file": it["file"], "warning": lower_bound})
    if s and len(s.get("devices") or []) > 1:
        out.append({"file": it["file"], "warning": other_devices_message(s)})
    return out


def problems(summary: TrialRecord, complete: Mapping[str, Any], input_errors: Sequence[FileError],
             missing_log_dir: str | None) -> tuple[list[FileError], list[FileWarning]]:
    """``(errors, warnings)`` of the trial: per file ``{"file", "error"}`` / ``{"file", "warning"}``, those of its
    kind's files (a kernel trial's traces, a memory trial's snapshots) first (``complete``: its completion record;
    ``input_errors``: those of ``rank_coords.json`` / ``config.yaml``; ``missing_log_dir``: the log dir when it
    does not exist, first error, or a warning for a trial the driver interrupted)."""
    kind, step = summary["profile_kind"], summary["profile_step"]
    traces = summary.get("kernel_traces") or [] if kind == "kernel" else []
    snapshots = summary.get("memory_snapshots") or [] if kind == "memory" else []
    errors: list[FileError] = [{"file": t["source"], "error": t["error"]} for t in traces if "error" in t]
    errors += [{"file": t["source"], "error": t["parts_plot_error"]} for t in traces if "parts_plot_error" in t]
    errors += [{"file": m["file"], "error": m["error"]} for m in snapshots if "error" in m]
    errors += [{"file": m["file"], "error": m["plot_error"]} for m in snapshots if "plot_error" in m]
    errors += input_errors
    warnings: list[FileWarning] = []  # a kind or step the trial did not profile is refused before this
    if missing_log_dir and summary["status"] == "interrupted":  # stopped before the trainer wrote anything
        warnings.append({"file": "--log-dir", "warning": f"{missing_log_dir} does not exist: the driver stopped the "
                                                         "trial before the trainer wrote its log dir"})
    elif missing_log_dir:
        errors.insert(0, {"file": "--log-dir", "error": f"{missing_log_dir} does not exist"})
    for t in traces:
        warnings += _trace_warnings(t)
    for m in snapshots:
        warnings += _snapshot_warnings(m)
    stats = summary["stats"]
    if stats["bad_lines"]:
        warnings.append({"file": "stats.jsonl", "warning": f"{stats['bad_lines']} unparsable lines skipped (not a "
                         "JSON object of a known type, or a step record whose step is not a non-negative integer)"})
    status = "see the Failure section" if summary.get("failure") else "trial status unknown"
    if not stats.get("available") and not missing_log_dir:
        warnings.append({"file": "stats.jsonl", "warning": "not found in the log dir: no step records and no "
                         "completion record (" + ("the trainer never wrote it: " if summary.get("failure") else "")
                         + status + ")"})
    elif stats.get("available") and not stats["steps"] and stats.get("complete") is None:
        warnings.append({"file": "stats.jsonl", "warning": ("empty" if not stats["bad_lines"] else "no valid line")
                         + ": no step records and no completion record (" + status + ")"})
    if summary["status"] in ("ok", "unknown") and not traces and not snapshots and not missing_log_dir:
        where = "perf_tracer/rank<rank>.pt.trace.json" if kind == "kernel" else \
            f"memory_snapshots/step_{step}/snapshot_rank*.pickle"
        if kind == "memory" and complete.get("device") == "cpu":
            warnings.append({"file": where, "warning": "no allocator snapshots: the trial ran on CPU "
                                                       "(CUDA caching-allocator snapshots need CUDA)"})
        else:
            errors.append({"file": where, "error": f"trial status {summary['status']} but no artifacts found in the "
                                                   "log dir"})
    return errors, warnings


def routing_warnings(stats: Stats, profile_step: int | None, cfg: Mapping[str, Any] | None) -> list[FileWarning]:
    """Per step whose ``moe_load`` held values that cannot be true, a warning that they were left out
    (:func:`sftprof.analysis.trial.inputs.moe_load`); and a warning when one expert received at least
    :data:`ROUTING_COLLAPSE_SHARE` of the tokens of a MoE layer in the profiled step (the last step record when the
    profiled one is absent): the profile's expert, dispatch and EP-wait figures are those of that routing, unlike a
    trained router's (balanced top-``k``: ``k / E`` of the tokens per expert, 6.25 % for Qwen3-30B-A3B's 8 of 128). What it says follows the trial's config ``cfg``:
    random or loaded weights (``actor.init_from_scratch``), balanced routing already on, and what the backend
    (``actor.backend``) accepts."""
    out: list[FileWarning] = [
        {"file": "stats.jsonl", "warning": f"step {x['step']}: {moe['invalid']} MoE layer(s) left out of the "
                                           "routing figures: a value that cannot be true (a busiest expert or EP "
                                           "rank below the mean, one expert with more tokens than the step, a "
                                           "negative count)"}
        for x in stats["steps"] if (moe := x.get("moe")) and moe.get("invalid")]
    rows = [x for x in stats["steps"] if x.get("moe")]
    row = next((x for x in rows if x["step"] == profile_step), rows[-1] if rows else None)
    m = row.get("moe") if row else None
    top = m.get("top_share") if m else None
    if row is None or m is None or top is None or top < ROUTING_COLLAPSE_SHARE:
        return out
    ep_ratio = m.get("ep_max_over_mean")
    ep = (f"; the busiest EP rank got {ep_ratio:.2f}x the mean per EP rank (layer {m['ep_worst_layer']})"
          if ep_ratio is not None and ep_ratio > 1.0 else "")
    actor = (cfg or {}).get("actor") or {}
    megatron = str(actor.get("backend") or "").startswith("megatron")
    knob = "actor.megatron.moe_router_force_load_balancing"
    if (actor.get("megatron") or {}).get("moe_router_force_load_balancing"):  # random logits do not collapse so
        why = f" although {knob}=true (random router logits) was set: check the routing counts"
    elif actor.get("init_from_scratch") is False:
        why = (". The trial loaded the checkpoint (actor.init_from_scratch=false): this is how its router routes the "
               "repeated fake sample, which a real dataset need not reproduce"
               + (f"; {knob}=true (random router logits, balanced load) profiles balanced routing" if megatron else ""))
    else:
        why = (". A randomly initialised router does this on the repeated fake sample, a trained one spreads the "
               "tokens: with random weights, this profile's expert GEMM, dispatch and EP waiting figures are not the "
               "trained model's. Load the checkpoint (MODEL_PATH, i.e. actor.path, with actor.init_from_scratch=false)"
               + (f", or set {knob}=true (random router logits, balanced load) to profile balanced routing" if megatron
                  else f" (the megatron backend also offers balanced routing for profiling, {knob}; the fsdp backend "
                       "does not)"))
    return out + [{"file": "stats.jsonl", "warning": (
        f"step {row['step']}: MoE routing collapsed: one expert received {100 * top:.2f} % of the "
        f"tokens in layer {m['top_share_layer']} (busiest expert {m['max_over_mean']:.2f}x the mean){ep}" + why)}]


SHARED_GPU_LISTED = 8  # PIDs and ranks named in the shared-GPU warning; the rest are counted


class _SharedGpu(TypedDict):
    """What one rank's GPU held besides the trial, over the steps (:func:`shared_gpu_warnings`)."""
    pids: set[int]
    mib: float  # the most memory they held, MiB (0.0: none known)
    unknown: bool  # some step's memory was unknown
    steps: set[int]


def shared_gpu_warnings(stats: Stats) -> list[FileWarning]:
    """One warning when a rank's GPU held processes not of the trial after some step (``stats.steps[].gpu_others``,
    :mod:`sftprof.capture.gpu_sharing`): per rank (the first :data:`SHARED_GPU_LISTED`) its PIDs (as many), the
    most memory they held and the steps, as ranges."""
    seen: dict[int, _SharedGpu] = {}  # rank -> what its GPU held
    for row in stats["steps"]:
        for g in row.get("gpu_others") or []:
            r = seen.setdefault(g["rank"], {"pids": set(), "mib": 0.0, "unknown": False, "steps": set()})
            r["pids"].update(g["pids"])
            r["unknown"] |= g["mib"] is None
            r["mib"] = max(r["mib"], g["mib"] or 0.0)
            r["steps"].add(row["step"])
    if not seen:
        return []

    def listed(items: list[int] | list[str], what: str) -> str:
        more = len(items) - SHARED_GPU_LISTED
        return ", ".join(map(str, items[:SHARED_GPU_LISTED])) + (f" and {more} more {what}" if more > 0 else "")

    def rank_text(rank: int, r: _SharedGpu) -> str:
        if r["unknown"] and not r["mib"]:
            memory = "memory unknown"
        else:
            memory = f"up to {r['mib'] / 1024:.2f} GiB" + (" (some unknown)" if r["unknown"] else "")
        return f"rank {rank}: PID {listed(sorted(r['pids']), 'PIDs')}, {memory}, step(s) {_ranges(sorted(r['steps']))}"

    ranks = listed([rank_text(rank, r) for rank, r in sorted(seen.items())], "ranks")
    return [{"file": "stats.jsonl", "warning": (
        f"GPU shared: processes not of this trial ran on the GPU of {len(seen)} rank(s) ({ranks}; as nvidia-smi "
        "listed them after each step). Their kernels share the GPU with the trial's, so step and kernel times can be "
        "longer than the trial's own, and memory they hold is memory the trial lacks; profile on a GPU of its own")}]


def _ranges(steps: list[int]) -> str:
    """``0, 2-5, 9`` of sorted distinct integers."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def optional_input_warnings(trainer_log: str | None, nvidia_smi_csv: str | None, smi: NvidiaSmi) -> list[FileWarning]:
    """A warning per input file given by option (``--trainer-log``, ``--nvidia-smi-csv``) that is not a file, or
    (nvidia-smi) holds no sample: the summary goes without it."""
    out: list[FileWarning] = [{"file": path, "warning": f"{option}: not found; the summary goes without it"}
           for option, path in (("--trainer-log", trainer_log), ("--nvidia-smi-csv", nvidia_smi_csv))
           if path and not os.path.isfile(path)]
    if nvidia_smi_csv and os.path.isfile(nvidia_smi_csv) and not smi["samples"]:
        out.append({"file": nvidia_smi_csv, "warning": "--nvidia-smi-csv: no sample read (no header naming index and "
                                                       "memory.used, or no row under it); the summary goes without it"})
    return out
