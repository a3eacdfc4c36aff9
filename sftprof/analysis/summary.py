"""Postprocess one profiled trial, in steps: trace views, archived snapshots, ``profile_summary.{json,md}``.

Inputs are the trial's log dir (``LOG_DIR``: ``stats.jsonl``, ``rank_coords.json``, ``config.yaml``,
``perf_tracer/rank<rank>.pt.trace.json[.gz]``, ``memory_snapshots/step_<N>/...``) and optionally the driver's
``nvidia_smi.csv`` and the trainer log. Outputs go to the trial's run dir (``RUN_DIR``). The summary is a pure
function of the inputs (no wall-clock timestamps), so rerunning reproduces it byte for byte.

This module runs the steps (:func:`postprocess_trial`) and checks the kind and step asked for; each step is a
module of its own: the inputs (:mod:`sftprof.analysis.trial.inputs`), the traces (:mod:`sftprof.analysis.trial.traces`)
or snapshots (:mod:`sftprof.analysis.trial.snapshots`), the failure (:mod:`sftprof.analysis.trial.failure`), errors and
warnings (:mod:`sftprof.analysis.trial.problems`), the ranks table (:mod:`sftprof.analysis.time.rank_table`), findings and
what-ifs (:mod:`sftprof.analysis.report.findings`, :mod:`sftprof.analysis.what_if.changes`) and the files
(:mod:`sftprof.analysis.report.summary_file`).
"""
from __future__ import annotations

import os
from typing import Any

from sftprof import artifacts
from sftprof.analysis import schema
from sftprof.analysis.trial import inputs
from sftprof.analysis.trial.failure import first_failure
from sftprof.analysis.report.findings import trial_findings
from sftprof.analysis.memory.oom import oom_finding, oom_triage, oom_what_if
from sftprof.analysis.what_if.recompute_plan import recompute_what_if
from sftprof.analysis.what_if.next_steps import with_next_steps
from sftprof.analysis.trial.problems import (missing_trace_warnings, missing_traces, optional_input_warnings, problems,
                                             routing_warnings, shared_gpu_warnings)
from sftprof.analysis.time.projection import simulation_summary
from sftprof.analysis.time.rank_table import rank_table
from sftprof.analysis.schema import ProfileSummary
from sftprof.analysis.trial.schema import Counts
from sftprof.analysis.report.summary_file import write_summary
from sftprof.analysis.trial.snapshots import snapshot_part
from sftprof.analysis.trial.traces import trace_part
from sftprof.analysis.views.split import MAX_VIEW_BYTES
from sftprof.analysis.what_if.changes import trial_what_if

__all__ = ["PROFILE_KINDS", "postprocess_trial", "resolve_profile", "check_profiled_step", "check_recorded_kind",
           "SUMMARY_JSON", "SUMMARY_MD"]

PROFILE_KINDS = ("kernel", "memory")
SUMMARY_JSON = artifacts.SUMMARY_JSON
SUMMARY_MD = artifacts.SUMMARY_MD


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def postprocess_trial(log_dir: str, run_dir: str, profile_kind: str | None = None, profile_step: int | None = None, *,
                      trainer_log: str | None = None, nvidia_smi_csv: str | None = None,
                      compress: bool = False, max_view_bytes: int = MAX_VIEW_BYTES,
                      jobs: int | None = None) -> tuple[ProfileSummary, int]:
    """Produce views/snapshot archive and write ``RUN_DIR/profile_summary.{json,md}`` (an earlier summary that is
    the same is left as it is, one that differs kept as ``profile_summary.prev<N>.{json,md}``:
    :func:`sftprof.analysis.report.summary_file.write_summary`).
    A rank's views and model-part plot, and a snapshot's archived copy, plot and phases sidecar, are replaced only by
    those of a file processed without error; a snapshot that fails is not archived, and what an earlier postprocess
    wrote for a failed file stays, named in a warning (:mod:`sftprof.analysis.trial.problems`). ``counts["plots"]``: the
    PNGs this postprocess wrote (memory and model-part plots).

    Kernel trials' summaries hold, besides each trace's ``kernel_traces[i].summary``
    (:meth:`sftprof.analysis.time.trace_summary.KernelTraceAnalyzer.summary`) and the ``ranks`` table
    (:func:`sftprof.analysis.time.rank_table.rank_table`), ``comm_wait``: the
    traced ranks' communication split into waiting for the last rank and transfer
    (:func:`sftprof.analysis.time.comm_wait.split`, None when no trace has a collective).

    Args:
        log_dir: trial log dir written by the trainer.
        run_dir: trial run dir (created).
        profile_kind: ``kernel`` or ``memory``; None: the one the trial's completion record names
            (:func:`sftprof.analysis.trial.inputs.recorded_profile`). Given, it is a check: a different recorded kind is an
            error.
        profile_step: the profiled training step; None: the recorded one (as ``profile_kind``). Given, a check:
            a step the trial did not profile (:func:`profiled_steps`) is an error.
        trainer_log: trainer log (its tail is kept in the summary when the trial failed).
        nvidia_smi_csv: the driver's nvidia-smi log (optional).
        compress: write trace views as ``.json.gz``.
        max_view_bytes: views larger than this are split into time windows.
        jobs: parallel trace conversions (default: CPU count).

    Returns:
        ``(summary, exit_code)``: exit code 2 when ``log_dir`` does not exist (the summary is still
        written: a trial that died before the trainer's first write is reported as failed, with the
        launcher log's tail), unless the driver interrupted the trial (status ``interrupted``: its launcher.log
        holds :data:`sftprof.artifacts.INTERRUPTED_LINE`, the missing log dir a warning); 1 when any trace/snapshot (or ``rank_coords.json``, ``config.yaml``) could not be
        processed, a trace's invalid events dominate it, a trace or snapshot is not the trial's (a trace of another
        step or rank, :func:`sftprof.analysis.time.trace_summary.identity_problems`; a rank in its name at or above the
        trial's world size, :func:`sftprof.analysis.trial.inputs.world_size`: not summarised), or an ``ok`` trial lacks
        its artifacts; else 0. Whatever one file raises is that file's error; every other file is still processed.
        Failed trials may lack artifacts; memory trials on CPU (completion record ``device: "cpu"``) have none: a
        warning.

    Raises:
        ValueError: unknown ``profile_kind``, one other than the trial recorded, negative ``profile_step`` or one
            the trial did not profile, or either not given while the trial recorded none (it died before its
            completion record; the message says so when ``log_dir`` does not exist).
        WriteError: a summary, plot or copy cannot be written (a full disk: :mod:`sftprof.atomic`); what an
            earlier postprocess wrote stays in place.
    """
    profile_kind, profile_step = resolve_profile(log_dir, profile_kind, profile_step)
    os.makedirs(run_dir, exist_ok=True)
    coords, coords_error = inputs.read_rank_coords(log_dir)
    cfg, cfg_error = inputs.trial_config(log_dir)
    env, env_error = inputs.trial_environment(log_dir)
    tried, tried_error = inputs.read_tried_what_if(run_dir)
    input_errors = [{"file": name, "error": err} for name, err in ((artifacts.RANK_COORDS, coords_error),
                                                                  (artifacts.CONFIG_YAML, cfg_error),
                                                                  (artifacts.ENVIRONMENT, env_error),
                                                                  (artifacts.WHAT_IF_JSON, tried_error)) if err]
    stats = inputs.read_stats(os.path.join(log_dir, artifacts.STATS), profile_step)
    log_dir_missing = not os.path.isdir(log_dir)
    complete = _completion(log_dir, stats, log_dir_missing)
    summary = _trial_header(log_dir, run_dir, profile_kind, profile_step, complete, trainer_log, nvidia_smi_csv)
    # the resolved config and the recorded environment travel with the summary, so that a run root copied off the
    # training machine still tells what differs between two runs (compare); None when absent or unreadable (an error)
    summary.update(stats=stats, nvidia_smi=inputs.read_nvidia_smi(nvidia_smi_csv), config=cfg, environment=env,
                   rank_coords={str(k): v for k, v in sorted(coords.items())},
                   transformer_engine=inputs.transformer_engine(cfg, trainer_log))
    if tried:
        summary["tried_what_if"] = tried
    interrupted = inputs.driver_interrupt(run_dir)
    if interrupted:  # the driver stopped it (Ctrl-C, SIGTERM): not a failure, no first failing rank to name
        summary.update(status="interrupted", interrupted=interrupted)
    elif summary["status"] != "ok":
        summary.update(_failure_part(run_dir, log_dir, trainer_log, cfg))
        if summary["failure"] and summary["status"] == "unknown":  # no completion record, but a known failure
            summary["status"] = "failed"
        summary["oom"] = oom_triage(log_dir, cfg, (summary["failure"] or {}).get("rank"),
                                    (env or {}).get("PYTORCH_CUDA_ALLOC_CONF"))
    items = _artifacts_part(summary, log_dir, run_dir, compress, max_view_bytes, jobs or os.cpu_count() or 1)
    if cfg and ((cfg.get("actor") or {}).get("simulate") or {}).get("rank", -1) >= 0:
        traces = [t["summary"] for t in summary.get("kernel_traces", []) if t.get("summary")]
        summary["simulation"] = simulation_summary(log_dir, cfg, profile_step, summary["transformer_engine"],
                                                   traces[0]["regions"] if traces else None)
    summary["nvidia_smi"].pop("timed_samples", None)
    errors, warnings = problems(summary, items, complete, input_errors, log_dir if log_dir_missing else None)
    warnings += optional_input_warnings(trainer_log, nvidia_smi_csv, summary["nvidia_smi"])
    warnings += routing_warnings(stats, profile_step, cfg) + shared_gpu_warnings(stats)
    if profile_kind == "kernel":
        summary["missing_traces"] = missing_traces(cfg, items) if items else []
        warnings += missing_trace_warnings(cfg, summary["missing_traces"])
    leftovers = sorted(n for n in os.listdir(run_dir) if n.startswith(".staging_rank"))
    if leftovers:
        warnings.append({"file": ", ".join(leftovers), "warning": "staging folders of an interrupted (or concurrent) "
                         "postprocess: partial views or snapshot copies, not part of this summary; safe to delete "
                         "when no postprocess runs"})
    summary["errors"] = errors
    summary["warnings"] = warnings
    summary["counts"] = _counts(items, profile_kind, errors, summary["skipped"])
    summary["ranks"] = rank_table(summary)
    summary["what_if"], summary["what_if_skipped"] = trial_what_if(summary, cfg)
    if profile_kind == "kernel" and summary["status"] == "ok":  # the recompute that fits at the least time
        summary["what_if"] = sorted(summary["what_if"] + recompute_what_if(summary, cfg, (env or {}).get(
            "PYTORCH_CUDA_ALLOC_CONF")), key=lambda w: -w["weight"])
    if summary.get("oom"):  # why it ran out of memory comes first, and its change that fits is a what-if
        summary["what_if"] = oom_what_if(summary["oom"]) + summary["what_if"]
    findings = ([oom_finding(summary["oom"])] if summary.get("oom") else []) + trial_findings(summary)
    summary["findings"] = with_next_steps(findings, summary["what_if"], summary["what_if_skipped"], summary, cfg)
    write_summary(summary, run_dir)
    return summary, 2 if log_dir_missing and not interrupted else (1 if errors else 0)


def resolve_profile(log_dir: str, kind: str | None, step: int | None) -> tuple[str, int]:
    """The kind and step to process: as given, else the trial's recorded ones (``stats.jsonl``'s completion record).

    Raises:
        ValueError: as :func:`postprocess_trial` (the message names the setting).
    """
    if (kind is None or step is None) and not os.path.isdir(log_dir):
        raise ValueError(f"--log-dir {log_dir} does not exist, so --profile-kind and --profile-step cannot be read "
                         "from its stats.jsonl; nothing was written (given both, the trial's summary is written, "
                         "as failed)")
    recorded_kind, recorded_step = inputs.recorded_profile(log_dir)
    if kind is None:
        kind = recorded_kind
        if kind is None:
            raise ValueError(f"--profile-kind: not given, and {os.path.join(log_dir, artifacts.STATS)} has no completion "
                             f"record naming it; pass one of {PROFILE_KINDS}")
    if step is None:
        step = recorded_step
        if step is None:
            raise ValueError(f"--profile-step: not given, and {os.path.join(log_dir, artifacts.STATS)} has no "
                             "completion record naming it; pass the profiled step (an integer >= 0)")
    if kind not in PROFILE_KINDS:
        raise ValueError(f"--profile-kind must be one of {PROFILE_KINDS}, got {kind!r}")
    check_recorded_kind(log_dir, kind)
    if step < 0:
        raise ValueError(f"--profile-step must be >= 0, got {step}")
    check_profiled_step(log_dir, kind, step)
    return kind, step


def profiled_steps(log_dir: str, kind: str) -> tuple[list[int], str]:
    """The steps the trial profiled for ``kind`` and where that is written: ``<section>.profile_steps`` of the trial's
    ``config.yaml`` (``perf_tracer`` for kernel, ``memory_profiler`` for memory), else the step of its completion
    record in ``stats.jsonl``; ``([], "")`` when neither can be read (a trial that died early)."""
    section = "perf_tracer" if kind == "kernel" else "memory_profiler"
    cfg, _ = inputs.trial_config(log_dir)
    steps = ((cfg or {}).get(section) or {}).get("profile_steps") if isinstance(cfg, dict) else None
    if isinstance(steps, list) and steps and all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        return sorted(set(steps)), f"{section}.profile_steps in {os.path.join(log_dir, artifacts.CONFIG_YAML)}"
    _, recorded = inputs.recorded_profile(log_dir)
    if recorded is not None:
        return [recorded], f"the completion record in {os.path.join(log_dir, artifacts.STATS)}"
    return [], ""


def check_profiled_step(log_dir: str, kind: str, step: int) -> None:
    """Refuse a profile step the trial did not profile: its summary would label another step's trace (or no
    artifact at all) with it. Nothing known of the trial's steps (it died before writing them): nothing to check.

    Raises:
        ValueError: ``--profile-step S: the trial profiled step(s) [..] (<where>); pass one of them or leave it
            out; nothing was written``.
    """
    steps, where = profiled_steps(log_dir, kind)
    if steps and step not in steps:
        raise ValueError(f"--profile-step {step}: the trial profiled step(s) {steps} ({where}); pass one of them or "
                         "leave it out; nothing was written")


def check_recorded_kind(log_dir: str, kind: str) -> None:
    """Refuse a profile kind other than the one the trial's completion record names (a trial profiles one kind,
    :func:`sftprof.config.validate`; processed as the other, its summary would describe what it is not). No record
    (a trial that died before writing it): nothing to check.

    Raises:
        ValueError: ``--profile-kind K: the trial recorded profile_kind='R' in LOG_DIR/stats.jsonl; ...``.
    """
    recorded_kind, _ = inputs.recorded_profile(log_dir)
    if recorded_kind is not None and kind != recorded_kind:
        raise ValueError(f"--profile-kind {kind}: the trial recorded profile_kind={recorded_kind!r} in "
                         f"{os.path.join(log_dir, artifacts.STATS)}; pass --profile-kind {recorded_kind} or leave it "
                         "out; nothing was written")


def _completion(log_dir: str, stats: dict, log_dir_missing: bool) -> dict:
    """The trial's completion record; a failed one naming the cause when the log dir does not exist."""
    if log_dir_missing:  # torchrun or the trainer died before the trainer's first write
        return {"status": "failed", "error": f"log dir {log_dir} does not exist: the trial failed before the "
                                             "trainer wrote anything (see launcher.log in the run dir)"}
    return stats.get("complete") if isinstance(stats.get("complete"), dict) else {}


def _trial_header(log_dir: str, run_dir: str, kind: str, step: int, complete: dict, trainer_log: str | None,
                  nvidia_smi_csv: str | None) -> dict[str, Any]:
    """The summary's first members: schema, trial, kind, step, status, completion and the input paths."""
    return {
        "schema": schema.SCHEMA_NAME,
        "schema_version": schema.SCHEMA_VERSION,
        "trial": os.path.basename(os.path.normpath(run_dir)),
        "profile_kind": kind,
        "profile_step": step,
        "status": complete.get("status", "unknown"),
        "completion": {k: complete.get(k) for k in ("error", "steps_done", "world_size", "backend", "device")},
        "paths": {"log_dir": os.path.abspath(log_dir), "run_dir": os.path.abspath(run_dir),
                  "trainer_log": os.path.abspath(trainer_log) if trainer_log else None,
                  "nvidia_smi_csv": os.path.abspath(nvidia_smi_csv) if nvidia_smi_csv else None},
    }


def _failure_part(run_dir: str, log_dir: str, trainer_log: str | None, cfg: dict | None) -> dict[str, Any]:
    """First failure (launcher log and the log dir's node records; the config's node layout where a record lacks
    it) and a log tail: the trainer log's, else the launcher log's."""
    launcher_log = os.path.join(run_dir, "launcher.log")
    cluster = (cfg or {}).get("cluster") if isinstance((cfg or {}).get("cluster"), dict) else {}
    layout = tuple(v if isinstance(v, int) else None for v in (cluster.get("n_nodes"), cluster.get("n_gpus_per_node")))
    tail = inputs.trainer_log_tail(trainer_log)
    simulated = ((cfg or {}).get("actor") or {}).get("simulate") or {}
    return {"failure": first_failure(launcher_log, log_dir, layout, simulated.get("rank", -1)),
            "trainer_log_tail": tail or inputs.trainer_log_tail(launcher_log),
            "log_tail_source": "trainer.log (rank 0)" if tail else "launcher.log"}


def _artifacts_part(summary: dict, log_dir: str, run_dir: str, compress: bool, max_view_bytes: int,
                    jobs: int) -> list[dict]:
    """Add the kernel traces (with the nvidia-smi samples of their step window) or the memory snapshots to
    ``summary``; returns their entries."""
    world = inputs.world_size(log_dir)
    if summary["profile_kind"] == "memory":
        summary.update(snapshot_part(log_dir, run_dir, summary["profile_step"], world))
        return summary["memory_snapshots"]
    summary.update(trace_part(log_dir, run_dir, compress, max_view_bytes, jobs, summary["profile_step"], world))
    items = summary["kernel_traces"]
    windows = [t["summary"]["step_window"] for t in items if "summary" in t]
    windows = [w for w in windows if w.get("unix_start_s") is not None]
    if windows and summary["nvidia_smi"]["available"]:
        summary["nvidia_smi"]["profiled_step"] = inputs.smi_in_window(
            summary["nvidia_smi"], min(w["unix_start_s"] for w in windows), max(w["unix_end_s"] for w in windows))
    return items


def _counts(items: list[dict], kind: str, errors: list[dict], skipped: list[dict]) -> Counts:
    """Numbers of traces (processed, ok), views, snapshots, plots, errors and skipped files. ``plots``: the PNGs this
    postprocess wrote (a snapshot's memory plot, a trace's model-part plot ``model_parts/rank<r>.png``), not those
    an earlier postprocess left."""
    return {
        "traces": sum(1 for it in items if kind == "kernel"),
        "traces_ok": sum(1 for it in items if kind == "kernel" and "error" not in it),
        "views": sum(len(p) for it in items if kind == "kernel" for p in (it.get("views") or {}).values()),
        "snapshots": sum(1 for it in items if kind == "memory"),
        "plots": sum(("plot" in it) + ("parts_plot" in it) for it in items),
        "errors": len(errors),
        "skipped": len(skipped),
    }
