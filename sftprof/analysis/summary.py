"""Postprocess one profiled trial, in steps: trace views, archived snapshots, ``profile_summary.{json,md}``.

Inputs are the trial's log dir (``LOG_DIR``: ``stats.jsonl``, ``rank_coords.json``, ``config.yaml``,
``perf_tracer/rank<rank>.pt.trace.json[.gz]``, ``memory_snapshots/step_<N>/...``) and optionally the driver's
``nvidia_smi.csv`` and the trainer log. Outputs go to the trial's run dir (``RUN_DIR``). The summary is a pure
function of the inputs (no wall-clock timestamps), so rerunning reproduces it byte for byte.

This module runs the steps (:func:`postprocess_trial`), for the kind and step that
:func:`sftprof.analysis.trial.profile_check.resolve_profile` checks. The summary is put
together from typed parts (:mod:`sftprof.analysis.schema`), each the return value of one step: what the trial's files
say (:class:`sftprof.analysis.trial.schema.TrialRecord`: header, inputs, failure, traces or snapshots), then what is
judged from it (problems, ranks table, what-ifs, findings, a simulated rank's projection). Each step is a module of
its own: the inputs (:mod:`sftprof.analysis.trial.inputs`), the traces (:mod:`sftprof.analysis.trial.traces`)
or snapshots (:mod:`sftprof.analysis.trial.snapshots`), the failure (:mod:`sftprof.analysis.trial.failure`), errors and
warnings (:mod:`sftprof.analysis.trial.problems`), the ranks table (:mod:`sftprof.analysis.time.rank_table`), findings and
what-ifs (:mod:`sftprof.analysis.report.findings`, :mod:`sftprof.analysis.what_if.changes`) and the files
(:mod:`sftprof.analysis.report.summary_file`).
"""
from __future__ import annotations

import os
from typing import Any, cast

from sftprof import artifacts
from sftprof.analysis import schema
from sftprof.analysis.memory.fit import alloc_conf_of, smi_capacity_bytes
from sftprof.analysis.memory.oom import oom_finding, oom_triage, oom_what_if
from sftprof.analysis.report.findings import trial_findings
from sftprof.analysis.report.summary_file import write_summary
from sftprof.analysis.schema import ProfileSummary
from sftprof.analysis.time.projection import simulation_summary
from sftprof.analysis.time.rank_table import rank_table
from sftprof.analysis.time.schema import Simulation, SimulationPart
from sftprof.analysis.trial import inputs
from sftprof.analysis.trial.failure import first_failure
from sftprof.analysis.trial.problems import (kept_merged_view, missing_trace_warnings, missing_traces,
                                             optional_input_warnings, problems, routing_warnings, shared_gpu_warnings,
                                             stale_rank_views)
from sftprof.analysis.trial.profile_check import resolve_profile
from sftprof.analysis.trial.schema import (Counts, FailurePart, FileError, Files, Header, Inputs, NvidiaSmi, Problems,
                                           Stats, TrialRecord, Versions, WallTime)
from sftprof.analysis.trial.snapshots import snapshot_part
from sftprof.analysis.trial.traces import trace_part
from sftprof.analysis.trial.wall_time import wall_time
from sftprof.analysis.views.split import MAX_VIEW_BYTES
from sftprof.analysis.what_if.changes import trial_what_if
from sftprof.analysis.what_if.next_steps import with_next_steps
from sftprof.analysis.what_if.recompute_plan import recompute_what_if
from sftprof.analysis.what_if.schema import WhatIf, WhatIfSkipped

__all__ = ["postprocess_trial", "summarise_trial", "SUMMARY_JSON", "SUMMARY_MD"]

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
            error (:func:`sftprof.analysis.trial.profile_check.resolve_profile`, the one check of both).
        profile_step: the profiled training step; None: the recorded one (as ``profile_kind``). Given, a check:
            a step the trial did not profile is an error.
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
        ValueError: the kind or step refused by :func:`~sftprof.analysis.trial.profile_check.resolve_profile`
            (unknown, other than the trial recorded or profiled, or not given while the trial recorded none); a
            ``run_dir`` of another trial (:func:`sftprof.analysis.trial.inputs.other_trial`).
        WriteError: a summary, plot or copy cannot be written (a full disk: :mod:`sftprof.atomic`); what an
            earlier postprocess wrote stays in place.
    """
    mismatch = inputs.other_trial(log_dir, run_dir)  # checked first, as postprocess_profile.py does
    if mismatch:
        raise ValueError(mismatch)
    kind, step = resolve_profile(log_dir, profile_kind, profile_step)
    return summarise_trial(log_dir, run_dir, kind, step, trainer_log=trainer_log, nvidia_smi_csv=nvidia_smi_csv,
                           compress=compress, max_view_bytes=max_view_bytes, jobs=jobs)


def summarise_trial(log_dir: str, run_dir: str, profile_kind: str, profile_step: int, *,
                    trainer_log: str | None = None, nvidia_smi_csv: str | None = None,
                    compress: bool = False, max_view_bytes: int = MAX_VIEW_BYTES,
                    jobs: int | None = None) -> tuple[ProfileSummary, int]:
    """:func:`postprocess_trial` for the kind and step that :func:`resolve_profile` returned (``postprocess_profile.py``
    checks them before it creates the run dir); the same arguments, return value and errors but ValueError."""
    os.makedirs(run_dir, exist_ok=True)
    trial_inputs, input_errors, smi_samples = _inputs_part(log_dir, run_dir, profile_step, trainer_log, nvidia_smi_csv)
    cfg, env = trial_inputs["config"], trial_inputs.get("environment") or {}
    model = inputs.TrialModel(cfg)  # loaded once, at its first use
    log_dir_missing = not os.path.isdir(log_dir)
    complete = _completion(log_dir, trial_inputs["stats"], log_dir_missing)
    interrupted = inputs.driver_interrupt(run_dir)  # the driver stopped it (Ctrl-C, SIGTERM): not a failure
    failed: FailurePart = {}
    if not interrupted and complete.get("status", "unknown") != "ok":
        failed = _failure_part(run_dir, log_dir, trainer_log, cfg, model, alloc_conf_of(env),
                               trial_inputs.get("versions"))
    files = _files_part(profile_kind, profile_step, log_dir, run_dir, model, compress, max_view_bytes,
                        jobs or os.cpu_count() or 1)
    record: TrialRecord = {
        **_trial_header(log_dir, run_dir, profile_kind, profile_step, complete, interrupted, failed, trainer_log,
                        nvidia_smi_csv),
        **trial_inputs, "nvidia_smi": _nvidia_smi(trial_inputs["nvidia_smi"], smi_samples, files),
        **failed, **files, "wall_time": _wall_time_part(trial_inputs["stats"], run_dir)}
    found = _problems_part(record, complete, input_errors, log_dir if log_dir_missing else None, trainer_log,
                           nvidia_smi_csv, run_dir)
    ranks = rank_table(record)
    what_if, what_if_skipped = _what_if_part(record, model, alloc_conf_of(env)[1])
    oom = record.get("oom")  # why it ran out of memory comes first
    findings = ([oom_finding(oom)] if oom else []) + trial_findings({**record, "ranks": ranks})
    summary: ProfileSummary = {
        **record, **found, "ranks": ranks, "what_if": what_if, "what_if_skipped": what_if_skipped,
        "findings": with_next_steps(findings, what_if, what_if_skipped, record, cfg),
        **_simulation_part(record, log_dir, cfg, model)}
    write_summary(summary, run_dir)
    return summary, 2 if log_dir_missing and not interrupted else (1 if found["errors"] else 0)


def _inputs_part(log_dir: str, run_dir: str, step: int, trainer_log: str | None, nvidia_smi_csv: str | None,
                 ) -> tuple[Inputs, list[FileError], list[Any]]:
    """The trial's input files as read, the errors of those that could not be, and nvidia-smi's timed samples (for
    the step window's, :func:`_nvidia_smi`). The resolved config and the recorded environment travel with the
    summary, so that a run root copied off the training machine still tells what differs between two runs
    (compare); None when absent or unreadable (an error)."""
    coords, coords_error = inputs.read_rank_coords(log_dir)
    cfg, cfg_error = inputs.trial_config(log_dir)
    env, env_error = inputs.trial_environment(log_dir)
    versions, versions_error = inputs.trial_versions(log_dir)
    tried, tried_error = inputs.read_tried_what_if(run_dir)
    errors: list[FileError] = [{"file": name, "error": err} for name, err in (
        (artifacts.RANK_COORDS, coords_error), (artifacts.CONFIG_YAML, cfg_error), (artifacts.ENVIRONMENT, env_error),
        (artifacts.VERSIONS, versions_error), (artifacts.WHAT_IF_JSON, tried_error)) if err]
    smi = inputs.read_nvidia_smi(nvidia_smi_csv)
    part: Inputs = {"stats": inputs.read_stats(os.path.join(log_dir, artifacts.STATS), step),
                    "nvidia_smi": {"available": smi["available"], "samples": smi["samples"], "gpus": smi["gpus"],
                                   "peak_memory_used_mib": smi["peak_memory_used_mib"],
                                   "peak_utilization_pct": smi["peak_utilization_pct"]},
                    "config": cfg, "environment": env, "versions": versions,
                    "rank_coords": {str(k): v for k, v in sorted(coords.items())},
                    "transformer_engine": inputs.transformer_engine(cfg, trainer_log)}
    if tried:
        part["tried_what_if"] = tried
    return part, errors, smi.get("timed_samples") or []


def _completion(log_dir: str, stats: Stats, log_dir_missing: bool) -> dict[str, Any]:
    """The trial's completion record; a failed one naming the cause when the log dir does not exist."""
    if log_dir_missing:  # torchrun or the trainer died before the trainer's first write
        return {"status": "failed", "error": f"log dir {log_dir} does not exist: the trial failed before the "
                                             "trainer wrote anything (see launcher.log in the run dir)"}
    complete = stats.get("complete")
    return complete if isinstance(complete, dict) else {}


def _trial_header(log_dir: str, run_dir: str, kind: str, step: int,
                  complete: dict[str, Any], interrupted: str | None, failed: FailurePart, trainer_log: str | None,
                  nvidia_smi_csv: str | None) -> Header:
    """The summary's first members: schema, trial, kind, step, status, completion and the input paths. The status is
    the completion record's; ``interrupted`` when the driver stopped the trial; ``failed`` for a trial without a
    completion record whose failure is known."""
    status = complete.get("status", "unknown")
    if interrupted:
        status = "interrupted"
    elif status == "unknown" and failed.get("failure"):
        status = "failed"
    header: Header = {
        "schema": schema.SCHEMA_NAME,
        "schema_version": schema.SCHEMA_VERSION,
        "trial": os.path.basename(os.path.normpath(run_dir)),
        "profile_kind": "kernel" if kind == "kernel" else "memory",  # resolve_profile checked it
        "profile_step": step,
        "status": status,
        "completion": {"error": complete.get("error"), "steps_done": complete.get("steps_done"),
                       "world_size": complete.get("world_size"), "backend": complete.get("backend"),
                       "device": complete.get("device")},
        "paths": {"log_dir": os.path.abspath(log_dir), "run_dir": os.path.abspath(run_dir),
                  "trainer_log": os.path.abspath(trainer_log) if trainer_log else None,
                  "nvidia_smi_csv": os.path.abspath(nvidia_smi_csv) if nvidia_smi_csv else None},
    }
    if interrupted:
        header["interrupted"] = interrupted
    return header


def _failure_part(run_dir: str, log_dir: str, trainer_log: str | None, cfg: dict[str, Any] | None,
                  model: inputs.TrialModel, alloc_conf: tuple[str, str | None],
                  versions: Versions | None) -> FailurePart:
    """First failure (launcher log and the log dir's node records; the config's node layout where a record lacks
    it), a log tail (the trainer log's, else the launcher log's) and the out-of-memory triage of the failed rank
    (``alloc_conf``: the allocator settings' variable and value, :func:`sftprof.analysis.memory.fit.alloc_conf_of`;
    ``versions``: the trial's recorded ones, None: not recorded)."""
    launcher_log = os.path.join(run_dir, "launcher.log")
    given = (cfg or {}).get("cluster")
    cluster: dict[str, Any] = given if isinstance(given, dict) else {}
    layout = (_int_or_none(cluster.get("n_nodes")), _int_or_none(cluster.get("n_gpus_per_node")))
    tail = inputs.trainer_log_tail(trainer_log)
    simulated = ((cfg or {}).get("actor") or {}).get("simulate") or {}
    failure = first_failure(launcher_log, log_dir, layout, simulated.get("rank", -1))
    return {"failure": failure,
            "trainer_log_tail": tail or inputs.trainer_log_tail(launcher_log),
            "log_tail_source": "trainer.log (rank 0)" if tail else "launcher.log",
            "oom": oom_triage(log_dir, cfg, model, failure["rank"] if failure else None, alloc_conf[1], versions,
                              conf_var=alloc_conf[0])}


def _wall_time_part(stats: Stats, run_dir: str) -> WallTime:
    """Where the trial's wall time went (:func:`sftprof.analysis.trial.wall_time.wall_time`), with the launcher's
    ``trial_times.json``; one that cannot be read is named in ``trial_times_error`` (and a warning)."""
    path = os.path.join(run_dir, artifacts.TRIAL_TIMES)
    try:
        times, error = artifacts.read_trial_times(run_dir), None
    except (OSError, ValueError) as exc:
        times, error = None, f"{path}: {exc}"
    part = wall_time(stats, times)
    if error:
        part["trial_times_error"] = error
    return part


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _files_part(kind: str, step: int, log_dir: str, run_dir: str, model: inputs.TrialModel, compress: bool,
                max_view_bytes: int, jobs: int) -> Files:
    """The kernel traces (with what is made across them) or the memory snapshots."""
    world = inputs.world_size(log_dir)
    if kind == "memory":
        return snapshot_part(log_dir, run_dir, step, world, model)
    return trace_part(log_dir, run_dir, compress, max_view_bytes, jobs, step, world)


def _nvidia_smi(smi: NvidiaSmi, samples: list[Any], files: Files) -> NvidiaSmi:
    """The nvidia-smi figures, with those of the traces' step window (``profiled_step``) when the traces have one."""
    windows = [(t["summary"]["step_window"]["unix_start_s"], t["summary"]["step_window"]["unix_end_s"])
               for t in files.get("kernel_traces", []) if "summary" in t]
    spans = [(start, end) for start, end in windows if start is not None and end is not None]
    if not spans or not smi["available"]:
        return smi
    return {**smi, "profiled_step": inputs.smi_in_window({**smi, "timed_samples": samples},
                                                         min(s for s, _ in spans), max(e for _, e in spans))}


def _problems_part(record: TrialRecord, complete: dict[str, Any], input_errors: list[FileError],
                   missing_log_dir: str | None, trainer_log: str | None, nvidia_smi_csv: str | None,
                   run_dir: str) -> Problems:
    """Errors and warnings of every file (:mod:`sftprof.analysis.trial.problems`), the ranks whose trace is missing
    and the counts."""
    kind, cfg, stats = record["profile_kind"], record["config"], record["stats"]
    traces = record.get("kernel_traces") or [] if kind == "kernel" else []
    items = record.get("memory_snapshots") or [] if kind == "memory" else traces
    errors, warnings = problems(record, complete, input_errors, missing_log_dir)
    if record["wall_time"].get("trial_times_error"):
        warnings.append({"file": artifacts.TRIAL_TIMES, "warning": f"{record['wall_time']['trial_times_error']}; the "
                         "wall-time phases of the launcher's clock are left out"})
    warnings += optional_input_warnings(trainer_log, nvidia_smi_csv, record["nvidia_smi"])
    warnings += routing_warnings(stats, record["profile_step"], cfg) + shared_gpu_warnings(stats)
    part: Problems = {"errors": errors, "warnings": warnings,
                      "counts": _counts(items, kind, len(errors), len(record["skipped"]))}
    if kind == "kernel":
        part["missing_traces"] = missing_traces(cfg, traces) if traces else []
        warnings += (missing_trace_warnings(cfg, part["missing_traces"]) + stale_rank_views(record, run_dir)
                     + kept_merged_view(record, run_dir))
    leftovers = sorted(n for n in os.listdir(run_dir) if n.startswith(".staging_rank"))
    if leftovers:
        warnings.append({"file": ", ".join(leftovers), "warning": "staging folders of an interrupted (or concurrent) "
                         "postprocess: partial views or snapshot copies, not part of this summary; safe to delete "
                         "when no postprocess runs"})
    return part


def _what_if_part(record: TrialRecord, model: inputs.TrialModel,
                  alloc_conf: str | None) -> tuple[list[WhatIf], list[WhatIfSkipped]]:
    """The what-ifs, largest weight first (a failed trial's change that fits its memory first), and those skipped."""
    what_if, skipped = trial_what_if(record, record["config"], model)
    if record["profile_kind"] == "kernel" and record["status"] == "ok":  # the recompute that fits at the least time
        what_if = sorted(what_if + recompute_what_if(record, record["config"], model, alloc_conf),
                         key=lambda w: -w["weight"])
    oom = record.get("oom")
    return (oom_what_if(oom) if oom else []) + what_if, skipped


def _simulation_part(record: TrialRecord, log_dir: str, cfg: dict[str, Any] | None,
                     model: inputs.TrialModel) -> SimulationPart:
    """A simulated rank's trial: its projected step, from the first trace's regions, the real rank's memory need
    against the GPU's capacity (nvidia-smi); nothing for another trial."""
    if not cfg or ((cfg.get("actor") or {}).get("simulate") or {}).get("rank", -1) < 0:
        return {}
    traces = [t["summary"] for t in record.get("kernel_traces", []) if t.get("summary")]
    capacity = smi_capacity_bytes(record["nvidia_smi"]["gpus"])
    # simulation_summary builds the Simulation member as a plain dict (time/projection.py is not typed strictly)
    return {"simulation": cast(Simulation, simulation_summary(log_dir, cfg, model, record["profile_step"],
                                                              record.get("transformer_engine"),
                                                              traces[0]["regions"] if traces else None, capacity))}


def _counts(items: list[Any], kind: str, errors: int, skipped: int) -> Counts:
    """Numbers of traces (processed, ok), views, snapshots, plots, errors and skipped files. ``plots``: the PNGs this
    postprocess wrote (a snapshot's memory plot, a trace's model-part plot ``model_parts/rank<r>.png``), not those
    an earlier postprocess left."""
    return {
        "traces": sum(1 for it in items if kind == "kernel"),
        "traces_ok": sum(1 for it in items if kind == "kernel" and "error" not in it),
        "views": sum(len(p) for it in items if kind == "kernel" for p in (it.get("views") or {}).values()),
        "snapshots": sum(1 for it in items if kind == "memory"),
        "plots": sum(("plot" in it) + ("parts_plot" in it) for it in items),
        "errors": errors,
        "skipped": skipped,
    }
