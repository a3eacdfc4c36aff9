"""Readers of a trial's inputs: ``stats.jsonl`` (through :mod:`sftprof.artifacts`), ``rank_coords.json``,
``config.yaml``, ``environment.json``, ``versions.json``, the driver's ``nvidia_smi.csv`` and the tail of the trainer
log; and the trial's model, its Hugging Face config loaded once for every part of the analysis that needs it
(:class:`TrialModel`).

Each reader tolerates a missing or damaged file (it says so in what it returns) so that one bad input
never stops the postprocessing of the others (:func:`sftprof.analysis.summary.postprocess_trial`).
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import re
from typing import IO, Any, Callable, Mapping, Optional, cast

import yaml

from sftprof import artifacts, stats_log
from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.trace.check import is_finite_number
from sftprof.analysis.trial.schema import GpuOthers, MoeRouting, SmiWindow, SmiWindowGpu, Stats, Versions
from sftprof.analysis.what_if.schema import TriedWhatIf
from sftprof.models.hf import load_hf_config

__all__ = ["read_stats", "moe_load", "recorded_profile", "read_nvidia_smi", "smi_in_window", "read_rank_coords",
           "trainer_log_tail", "trial_config", "max_entries", "world_size", "World", "outside_world", "file_error",
           "transformer_engine", "read_tried_what_if", "planned_trial_name", "summarised_trial_name", "log_dir_trial",
           "run_dir_trial", "other_trial", "ROUTING_COLLAPSE_SHARE", "TrialModel"]

_PROFILE_STEP_FIELDS = ("step_time_s", "tokens", "tokens_per_s", "tflops_per_gpu", "mfu",
                        "mem_peak_allocated_gb", "mem_peak_allocated_rank", "mem_peak_reserved_gb",
                        "mem_peak_reserved_rank", "n_ranks")
_RANK_STAT_FIELDS = ("step_time_s", "mem_peak_allocated_gb", "mem_peak_reserved_gb")


def _finite(v: Any) -> float | int | None:
    """``v`` when it is a finite int/float (not a bool), else None."""
    return v if is_finite_number(v) else None


def _per_rank(rec: dict[str, Any]) -> dict[int, dict[str, float | int | None]]:
    """``{rank: {step_time_s, mem_peak_allocated_gb, mem_peak_reserved_gb}}`` of one step record.

    From the record's ``ranks`` list (every rank, as the trainer all-gathers it); a record without it
    holds global rank 0's figures at top level (the trainer writes ``stats.jsonl`` on rank 0).
    """
    ranks = rec.get("ranks")
    rows = [r for r in ranks if isinstance(r, dict) and type(r.get("rank")) is int] \
        if isinstance(ranks, list) else []
    if not rows:
        rows = [dict(rec, rank=0)]
    return {int(r["rank"]): {k: _finite(r.get(k)) for k in _RANK_STAT_FIELDS} for r in rows}


def _gpu_others(rec: dict[str, Any]) -> list[GpuOthers]:
    """``[{rank, pids, mib}]``: the ranks of one step record whose GPU held processes not of the trial (the
    record's ``ranks[].gpu_others``, :mod:`sftprof.capture.gpu_sharing`; ``mib`` None: unknown). An entry without
    PIDs, with a rank below 0, a PID below 1 or a negative or non-finite memory is left out, as is a rank given twice."""
    ranks = rec.get("ranks")
    out: dict[int, GpuOthers] = {}
    for r in ranks if isinstance(ranks, list) else []:
        g = r.get("gpu_others") if isinstance(r, dict) else None
        if not isinstance(g, dict) or type(r.get("rank")) is not int or r["rank"] < 0 or r["rank"] in out:
            continue
        pids, mib = g.get("pids"), g.get("mib")
        if (isinstance(pids, list) and pids and all(type(p) is int and p > 0 for p in pids)
                and (mib is None or (_finite(mib) is not None and mib >= 0))):
            out[r["rank"]] = {"rank": r["rank"], "pids": sorted(set(pids)), "mib": None if mib is None else float(mib)}
    return list(out.values())


def _max_over_ranks(per_rank: dict[int, dict[str, float | int | None]], key: str) -> tuple[float | None, int | None]:
    vals = [(x, r) for r, v in per_rank.items() if (x := v[key]) is not None]
    if not vals:
        return None, None
    value, rank = max(vals, key=lambda x: (x[0], -x[1]))
    return value, rank


def read_stats(path: str, profile_step: int | None) -> Stats:
    """Step records, the completion record, the teardown record and the exit record of ``stats.jsonl``.

    Returns ``{"available", "bad_lines", "steps": [...], "profile_step_record", "per_rank", "complete", "teardown",
    "exit",
    "max_mem_peak_allocated_gb", "max_mem_peak_allocated_rank", "max_mem_peak_reserved_gb",
    "max_mem_peak_reserved_rank"}`` plus the profiled step's ``step_time_s``, ``tokens``, ``tokens_per_s``,
    ``tflops_per_gpu``, ``mfu`` and ``mem_peak_{allocated,reserved}_{gb,rank}`` at top level (None when
    absent; ``*_gb`` are GiB as the trainer writes them).

    Memory peaks are the maximum over the ranks of the step record's ``ranks`` list, with the rank that
    holds it (``*_rank``) and ``n_ranks``, the number of ranks the figure is taken over (1 when the record
    has no per-rank list: then it is rank 0's alone). ``per_rank`` maps every rank of the profiled step's
    record, profiled or not, to its ``step_time_s`` and peaks. Each step row's ``moe`` holds its routing figures
    (:func:`moe_load`; None for a model without MoE layers), its ``gpu_others`` the ranks whose GPU held processes
    not of the trial after the step (:func:`_gpu_others`). Non-finite or non-numeric values count as
    absent. A missing file gives ``available: False``; unparsable lines are counted in ``bad_lines``.
    """
    out: dict[str, Any] = {"available": os.path.isfile(path), "bad_lines": 0, "steps": [],
                           "profile_step_record": None, "per_rank": {}, "complete": None, "teardown": None,
                           "exit": None}
    out.update(dict.fromkeys(_PROFILE_STEP_FIELDS))
    out.update(dict.fromkeys(f"max_{key}_{unit}" for key in ("mem_peak_allocated", "mem_peak_reserved")
                             for unit in ("gb", "rank")))
    if not out["available"]:
        return cast(Stats, out)  # every member of Stats, as absent
    log = stats_log.read_stats(path)
    out["bad_lines"] = log.bad_lines
    for step_record in log.steps:
        rec = step_record.to_json()
        row = {k: rec.get(k) for k in ("step", "step_time_s", "tokens", "tokens_per_s", "tflops_per_gpu", "mfu",
                                       "recompute_tflops_per_gpu", "profiled")}
        row.update({k: _finite(rec.get(k)) for k in ("started_unix_s", "profiler_s")})
        per_rank = _per_rank(rec)
        for key in ("mem_peak_allocated", "mem_peak_reserved"):
            row[f"{key}_gb"], row[f"{key}_rank"] = _max_over_ranks(per_rank, f"{key}_gb")
        row["n_ranks"] = len(per_rank)
        row["moe"] = moe_load(rec.get("moe_load"), rec.get("tokens"))
        row["gpu_others"] = _gpu_others(rec)
        out["steps"].append(row)
        if profile_step is not None and rec.get("step") == profile_step:
            out["profile_step_record"] = rec
            out["per_rank"] = {str(r): v for r, v in sorted(per_rank.items())}
            out.update({k: v for k, v in row.items() if k.startswith("mem_peak_") or k == "n_ranks"})
    if log.completion is not None:
        out["complete"] = log.completion.to_json()
    if log.teardown is not None:
        out["teardown"] = log.teardown.to_json()
    if log.exit is not None:
        out["exit"] = log.exit.to_json()
    for k in _PROFILE_STEP_FIELDS:
        if not k.startswith("mem_peak_") and k != "n_ranks":
            out[k] = (out["profile_step_record"] or {}).get(k)
    for key in ("mem_peak_allocated", "mem_peak_reserved"):
        vals = [(s[f"{key}_gb"], s[f"{key}_rank"]) for s in out["steps"] if s[f"{key}_gb"] is not None]
        best = max(vals, key=lambda x: x[0]) if vals else (None, None)
        out[f"max_{key}_gb"], out[f"max_{key}_rank"] = best
    return cast(Stats, out)  # built member by member above: every member of Stats (steps: StepRows)


ROUTING_COLLAPSE_SHARE = 0.5  # a busiest expert receiving at least this share of a step's tokens: collapsed routing


def moe_load(load: Any, tokens: Any) -> MoeRouting | None:
    """The routing figures of one step record's ``moe_load`` (:meth:`sftprof.models.layers.routing.RoutingLoadMeter.step_record`).

    Args:
        load: the record's ``moe_load`` (per-layer lists ``tokens_per_expert_max``, ``max_over_mean``,
            ``ep_max_over_mean``); anything else gives None.
        tokens: the step's tokens (the record's ``tokens``, all ranks): the tokens every MoE layer routed once.

    Returns:
        None without a usable record; else ``{"max_over_mean", "worst_layer"}`` (the busiest expert's tokens
        over the mean per expert, at the layer where that is largest), ``{"ep_max_over_mean", "ep_worst_layer"}``
        (the busiest EP rank's over the mean per EP rank) and ``{"top_share", "top_share_layer"}`` (the busiest
        expert's tokens as a share of the step's tokens, 0..1, at its largest layer; None without ``tokens``), and
        ``invalid``: the number of layers left out whole because one of their values cannot be true (a busiest
        expert or EP rank below the mean, more tokens for one expert than the step had, or a negative count).
        Missing, null and non-finite values are left out too, without counting (a layer without MoE routing has
        none).
    """
    if not isinstance(load, dict):
        return None
    scale = float(tokens) if _finite(tokens) and tokens > 0 else None
    checks: dict[str, Callable[[float], bool]] = {
        "max_over_mean": lambda r: r >= 1.0 - 1e-9,  # a maximum is never below the mean
        "ep_max_over_mean": lambda r: r >= 1.0 - 1e-9,
        "tokens_per_expert_max": lambda n: n >= 0 and (scale is None or n <= scale)}
    lists: dict[str, list[Any]] = {k: (v if isinstance(v := load.get(k), list) else []) for k in checks}
    layers = max(map(len, lists.values()))
    value = {k: [_finite(v[i]) if i < len(v) else None for i in range(layers)] for k, v in lists.items()}
    bad = {i for i in range(layers) if any((x := value[k][i]) is not None and not ok(x)
                                          for k, ok in checks.items())}

    def worst(key: str, div: float = 1.0) -> tuple[float | None, int | None]:
        vals = [(v / div, i) for i, v in enumerate(value[key]) if v is not None and i not in bad]
        return max(vals, key=lambda x: (x[0], -x[1])) if vals else (None, None)

    ratio, layer = worst("max_over_mean")
    if ratio is None and not bad:
        return None
    ep, ep_layer = worst("ep_max_over_mean")
    share, share_layer = worst("tokens_per_expert_max", scale) if scale else (None, None)
    return {"max_over_mean": ratio, "worst_layer": layer, "ep_max_over_mean": ep, "ep_worst_layer": ep_layer,
            "top_share": share, "top_share_layer": share_layer, "invalid": len(bad)}


def _number(text: str) -> float | None:
    m = re.match(r"\s*(-?\d+(?:\.\d+)?)", text or "")
    return float(m.group(1)) if m else None


def read_nvidia_smi(path: str | None) -> dict[str, Any]:
    """Peaks from an ``nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total
    --format=csv[,nounits]`` log.

    Returns ``{"available", "samples", "gpus": [{"index", "peak_memory_used_mib", "memory_total_mib",
    "peak_utilization_pct", "mean_utilization_pct"}], "peak_memory_used_mib", "peak_utilization_pct",
    "timed_samples"}``; ``timed_samples`` lists ``(unix s, GPU index, util %, memory MiB)`` of the rows whose
    timestamp parses (:func:`smi_in_window` reads it; the summary drops it before writing JSON).
    Absent or empty files and ``[N/A]`` values are tolerated; units in values (``MiB``, ``%``) are stripped.
    """
    out: dict[str, Any] = {"available": False, "samples": 0, "gpus": [],
                           "peak_memory_used_mib": None, "peak_utilization_pct": None}
    if not path or not os.path.isfile(path):
        return out
    per: dict[int, dict[str, list[float]]] = {}
    timed: list[tuple[float, int, float | None, float | None]] = []
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rows = csv.reader(f)
        header = None
        for row in rows:
            if not row:
                continue
            names = [re.sub(r"\s*\[.*?\]\s*$", "", c.strip()) for c in row]
            if "index" in names and "memory.used" in names:
                header = names  # (repeated headers from restarted loggers are fine)
                continue
            if header is None or len(row) != len(header):
                continue
            rec = dict(zip(header, row))
            idx = _number(rec.get("index", ""))
            if idx is None:
                continue
            d = per.setdefault(int(idx), {"mem": [], "total": [], "util": []})
            for key, col in (("mem", "memory.used"), ("total", "memory.total"), ("util", "utilization.gpu")):
                v = _number(rec.get(col, ""))
                if v is not None:
                    d[key].append(v)
            t = _smi_time(rec.get("timestamp", ""))
            if t is not None:
                timed.append((t, int(idx), _number(rec.get("utilization.gpu", "")), _number(rec.get("memory.used", ""))))
            out["samples"] += 1
    out["available"] = out["samples"] > 0
    for idx in sorted(per):
        d = per[idx]
        out["gpus"].append({
            "index": idx,
            "peak_memory_used_mib": max(d["mem"]) if d["mem"] else None,
            "memory_total_mib": max(d["total"]) if d["total"] else None,
            "peak_utilization_pct": max(d["util"]) if d["util"] else None,
            "mean_utilization_pct": round(sum(d["util"]) / len(d["util"]), 2) if d["util"] else None,
        })
    mems = [g["peak_memory_used_mib"] for g in out["gpus"] if g["peak_memory_used_mib"] is not None]
    utils = [g["peak_utilization_pct"] for g in out["gpus"] if g["peak_utilization_pct"] is not None]
    out["peak_memory_used_mib"] = max(mems) if mems else None
    out["peak_utilization_pct"] = max(utils) if utils else None
    out["timed_samples"] = timed  # (unix s, GPU index, util %, memory MiB); dropped before JSON
    return out


def _smi_time(text: str) -> float | None:
    """Unix seconds of an nvidia-smi ``timestamp`` (``2026/11/30 09:45:39.123``, local time of this machine)."""
    try:
        return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def smi_in_window(smi: Mapping[str, Any], lo_s: float, hi_s: float) -> SmiWindow:
    """nvidia-smi samples inside ``[lo_s, hi_s]`` (unix seconds): per GPU the sample count, mean and peak
    ``utilization.gpu`` and peak ``memory.used`` (MiB).

    ``utilization.gpu`` is the share of nvidia-smi's sample period in which at least one kernel ran on
    the GPU: a busy-ness figure like the trace's GPU busy %, not SM occupancy or tensor-core use.
    Timestamps are read as local time of the machine that postprocesses (the driver runs it where
    nvidia-smi ran).
    """
    per: dict[int, list[tuple[float | None, float | None]]] = {}
    for t, idx, util, mem in smi.get("timed_samples") or []:
        if lo_s <= t <= hi_s:
            per.setdefault(idx, []).append((util, mem))
    gpus: list[SmiWindowGpu] = []
    for idx in sorted(per):
        u = [x for x, _ in per[idx] if x is not None]
        m = [y for _, y in per[idx] if y is not None]
        gpus.append({"index": idx, "samples": len(per[idx]),
                     "mean_utilization_pct": round(sum(u) / len(u), 2) if u else None,
                     "peak_utilization_pct": max(u) if u else None, "peak_memory_used_mib": max(m) if m else None})
    return {"window_unix_s": [lo_s, hi_s], "gpus": gpus}


def read_rank_coords(log_dir: str) -> tuple[dict[int, dict[str, Any]], str | None]:
    """Rank -> coordinates (``{"pp": 0, "dp": 1, ...}``) from ``LOG_DIR/rank_coords.json``, and an error message
    naming the file when it is unreadable (``({}, None)`` when it is absent)."""
    path = os.path.join(log_dir, artifacts.RANK_COORDS)
    if not os.path.isfile(path):
        return {}, None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return {int(r): c for r, c in (data.get("ranks") or {}).items()}, None
    except (ValueError, AttributeError, TypeError) as exc:
        return {}, f"{path}: unreadable ({type(exc).__name__}: {exc})"


def trainer_log_tail(path: str | None, lines: int = 30) -> list[str] | None:
    """The last ``lines`` lines of a log file (newlines stripped), None when ``path`` is not given or not a file."""
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        tail = f.readlines()[-lines:]
    return [t.rstrip("\n") for t in tail]


def driver_interrupt(run_dir: str) -> str | None:
    """The driver's line in the trial's ``launcher.log`` saying that a signal stopped its torchrun
    (:data:`sftprof.artifacts.INTERRUPTED_LINE`), None when there is none (or no readable log)."""
    try:
        with open(os.path.join(run_dir, artifacts.LAUNCHER_LOG), encoding="utf-8", errors="replace") as f:
            return next((line.rstrip("\n") for line in f if line.startswith(artifacts.INTERRUPTED_PREFIX)), None)
    except OSError:
        return None


_TE_IN_LOG = re.compile(r"\btransformer_engine=(True|False)\b")


def transformer_engine(cfg: dict[str, Any] | None, trainer_log: str | None) -> bool | None:
    """Whether Transformer Engine ran in the trial: ``actor.megatron.transformer_impl`` of its config when ``transformer_engine``
    or ``local``; with ``auto``, the megatron engine's line in ``trainer_log`` (``... transformer_engine=True; ...``, its
    first such line); False for the fsdp backend (it never uses TE). None: no config, or ``auto`` and no such line
    (no trainer log, or a trial that ended before building its engine)."""
    actor = (cfg or {}).get("actor") if isinstance(cfg, dict) else None
    if not isinstance(actor, dict):
        return None
    if not str(actor.get("backend") or "").startswith("megatron"):
        return False
    mode = str(((actor.get("megatron") or {}).get("transformer_impl")) or "auto")
    if mode in ("transformer_engine", "local"):
        return mode == "transformer_engine"
    if not trainer_log or not os.path.isfile(trainer_log):
        return None
    with open(trainer_log, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _TE_IN_LOG.search(line)
            if m:
                return m.group(1) == "True"
    return None


def read_tried_what_if(run_dir: str) -> tuple[TriedWhatIf | None, str | None]:
    """``RUN_DIR/what_if.json`` (:data:`sftprof.artifacts.WHAT_IF_JSON`: the driver's record of the what-if a trial
    tries, :class:`sftprof.analysis.what_if.schema.TriedWhatIf`) and an error naming the file when it is unreadable or not
    such a record (``(None, None)`` when absent: the trial is no what-if trial)."""
    path = os.path.join(run_dir, artifacts.WHAT_IF_JSON)
    data, error = _read(path, json.load, ValueError)
    if data is None:
        return None, error
    if not (isinstance(data, dict) and isinstance(data.get("what_if"), dict) and isinstance(data.get("source_trial"), str)
            and isinstance(data.get("source_run_dir"), str)):
        return None, f"{path}: not a what-if record (source_trial, source_run_dir, what_if)"
    return cast(TriedWhatIf, data), None  # JSON read here, its members checked above


def _name(value: Any) -> str | None:
    """``value`` when it is a trial name (a non-empty text), else None."""
    return value if isinstance(value, str) and value else None


def planned_trial_name(run_dir: str) -> str | None:
    """The ``trial_name=`` argument (its last, as the trainer reads it) of the driver's ``RUN_DIR/train_args.txt``;
    None when that file is absent, unreadable or names none (a run dir the driver did not plan)."""
    try:
        with open(os.path.join(run_dir, artifacts.TRAIN_ARGS), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    names = [value.strip() for key, _, value in (line.partition("=") for line in lines) if key.strip() == "trial_name"]
    return _name(names[-1]) if names else None


def summarised_trial_name(run_dir: str) -> str | None:
    """``config.trial_name`` of ``RUN_DIR/profile_summary.json``: the trial whose log dir an earlier postprocess
    summarised there (the summary's ``trial`` member is the run dir's folder name, not a trial name). None when the
    file is absent, unreadable or names none (a summary of a log dir without a readable config.yaml)."""
    summary, _ = _read(os.path.join(run_dir, artifacts.SUMMARY_JSON), json.load, ValueError)
    cfg = summary.get("config") if isinstance(summary, dict) else None
    return _name(cfg.get("trial_name")) if isinstance(cfg, dict) else None


def log_dir_trial(log_dir: str) -> tuple[str, str] | None:
    """The trial of ``log_dir`` and what says so: the ``trial_name`` of ``LOG_DIR/config.yaml``; without one (the file
    absent, damaged or naming none), the log dir's folder name, which the trainer names after the trial
    (:func:`sftprof.config.trial_log_dir`), when it has the shape of the driver's trial names
    (:data:`sftprof.artifacts.TRIAL_NAME_RE`: a folder a user renamed says nothing) and it exists; else None."""
    path = os.path.join(log_dir, artifacts.CONFIG_YAML)
    cfg, error = trial_config(log_dir)
    name = _name(cfg.get("trial_name")) if cfg is not None else None
    if name is not None:
        return name, f"trial_name={name!r} in {path}"
    folder = os.path.basename(os.path.abspath(log_dir))
    if not os.path.isdir(log_dir) or not artifacts.TRIAL_NAME_RE.match(folder):  # a mistyped path: its own error
        return None
    why = error or (f"{path} names no trial_name" if os.path.isfile(path) else f"no {path}")
    return folder, f"the folder name {folder!r} of {log_dir} ({why})"


def run_dir_trial(run_dir: str) -> tuple[str, str] | None:
    """The trial of ``run_dir`` and what says so: the ``trial_name`` of the driver's ``RUN_DIR/train_args.txt``
    (:func:`planned_trial_name`); without one, the ``config.trial_name`` of an earlier summary there
    (:func:`summarised_trial_name`); without one, the run dir's folder name when it has the shape of the driver's
    trial names (:data:`sftprof.artifacts.TRIAL_NAME_RE`); None otherwise (a fresh run dir of one's own)."""
    planned = planned_trial_name(run_dir)
    if planned is not None:
        return planned, f"trial_name={planned!r} in {os.path.join(run_dir, artifacts.TRAIN_ARGS)}"
    summarised = summarised_trial_name(run_dir)  # read only when needed: a summary may be megabytes
    if summarised is not None:
        return summarised, f"config.trial_name={summarised!r} in {os.path.join(run_dir, artifacts.SUMMARY_JSON)}"
    folder = os.path.basename(os.path.abspath(run_dir))
    if artifacts.TRIAL_NAME_RE.match(folder):  # the driver names each trial's run dir after it
        return folder, f"the folder name {folder!r} of {run_dir}"
    return None


def other_trial(log_dir: str, run_dir: str) -> str | None:
    """The error message when ``log_dir`` and ``run_dir`` are not one trial's, naming both trials and what said so;
    None when they are, or when either side's trial is unknown. Reads only; a missing or damaged file is no error.

    Compared: the log dir's trial (:func:`log_dir_trial`: ``trial_name`` in ``config.yaml``, else the log dir's folder
    name when it has a trial name's shape) with the run dir's (:func:`run_dir_trial`: ``trial_name`` in
    ``train_args.txt``, else ``config.trial_name`` in ``profile_summary.json``, else its folder name when it has a trial
    name's shape), each side's first that can be read."""
    logged = log_dir_trial(log_dir)
    found = run_dir_trial(run_dir) if logged is not None else None
    if logged is None or found is None or found[0] == logged[0]:
        return None
    (log_trial, said_log), (run_trial, said_run) = logged, found
    return (f"--log-dir {log_dir} and --run-dir {run_dir} are not one trial's: {said_log}, {said_run}; "
            f"nothing was written: pass the run dir of trial {log_trial} with this log dir, or the log dir of trial "
            f"{run_trial} with this run dir (RUN_ROOT/{artifacts.TRIALS_TSV} lists each trial's log dir and run dir)")


def recorded_profile(log_dir: str) -> tuple[str | None, int | None]:
    """``(profile_kind, profile_step)`` of the trial's completion record in ``stats.jsonl`` (what the trainer
    profiled), ``(None, None)`` when the file or the record is missing."""
    path = os.path.join(log_dir, artifacts.STATS)
    if not os.path.isfile(path):
        return None, None
    try:
        done = stats_log.read_stats(path).completion
    except OSError:
        return None, None
    return (done.profile_kind, done.profile_step) if done is not None else (None, None)


def world_size(log_dir: str) -> tuple[int | None, str]:
    """The trial's number of ranks and where it is read: the completion record's ``world_size`` in ``stats.jsonl``,
    else ``rank_coords.json``'s ``world_size``, else the layout of ``actor.backend`` in ``config.yaml``
    (:func:`sftprof.allocation.parse_allocation_mode`); ``(None, "")`` when none of them holds one (a missing,
    damaged or other file; then no file's rank can be checked against it)."""
    def count(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    try:
        done = stats_log.read_stats(os.path.join(log_dir, artifacts.STATS)).completion
    except OSError:
        done = None
    if done is not None and count(done.world_size):
        return done.world_size, f"the completion record in {artifacts.STATS}"
    try:
        with open(os.path.join(log_dir, artifacts.RANK_COORDS), encoding="utf-8") as f:
            n = count(json.load(f).get("world_size"))
    except (OSError, ValueError, AttributeError):
        n = None
    if n:
        return n, artifacts.RANK_COORDS
    cfg, _ = trial_config(log_dir)
    if cfg is None:
        return None, ""
    try:
        backend = cfg["actor"]["backend"]
        return parse_allocation_mode(backend).world_size, f"actor.backend={backend!r} in {artifacts.CONFIG_YAML}"
    except Exception:  # no config, another schema, a layout that does not parse: the world size is unknown
        return None, ""


def max_entries(log_dir: str) -> int | None:
    """``memory_profiler.max_entries`` of the trial (``LOG_DIR/config.yaml``), None when unknown."""
    path = os.path.join(log_dir, artifacts.CONFIG_YAML)
    try:
        with open(path, encoding="utf-8") as f:
            value = (yaml.safe_load(f) or {}).get("memory_profiler", {}).get("max_entries")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _read(path: str, load: Callable[[IO[str]], Any], error: type[Exception]) -> tuple[Any, str | None]:
    """``load`` of the text file at ``path`` and an error naming the file when it cannot be read or ``load`` raises
    ``error`` on it (or RecursionError: text nested deeper than the parser recurses); ``(None, None)`` when it is
    absent."""
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            return load(f), None
    except (OSError, UnicodeDecodeError, RecursionError, error) as exc:
        return None, f"{path}: unreadable ({type(exc).__name__}: {' '.join(str(exc).split())})"


def trial_config(log_dir: str) -> tuple[dict[str, Any] | None, str | None]:
    """The trial's resolved config (``LOG_DIR/config.yaml``) as a dict, and an error message naming the file when
    it is unreadable or not a YAML mapping (``(None, None)`` when it is absent)."""
    path = os.path.join(log_dir, artifacts.CONFIG_YAML)
    cfg, error = _read(path, yaml.safe_load, yaml.YAMLError)
    if error:
        return None, error
    if cfg is not None and not isinstance(cfg, dict):
        return None, f"{path}: not a YAML mapping (a {type(cfg).__name__})"
    return cfg, None


class TrialModel:
    """The trial's model: the Hugging Face config of its ``actor.path`` cut to ``actor.num_layers``
    (:func:`sftprof.models.hf.load_hf_config`), loaded at the first use and kept, as is the error of a load that
    failed (a model path not on this machine: each user says what it leaves out)."""

    def __init__(self, cfg: Mapping[str, Any] | None) -> None:
        """``cfg``: the trial's resolved config (:func:`trial_config`); None: no model (every use raises)."""
        actor = (cfg or {}).get("actor")
        self._actor: Mapping[str, Any] = actor if isinstance(actor, Mapping) else {}
        self._loaded: tuple[Any, Exception | None] | None = None

    def config(self) -> Any:
        """The model's (text) config, e.g. ``Qwen3MoeConfig``, loaded once.

        Raises:
            Exception: what loading it raised (KeyError: no ``actor.path``; ModelPathError, ValueError: see
                :func:`sftprof.models.hf.load_hf_config`), the same exception at every call.
        """
        if self._loaded is None:
            try:
                self._loaded = self.cut(int(self._actor.get("num_layers") or 0)), None
            except Exception as exc:  # noqa: BLE001 - kept, and raised to each user, which says what it leaves out
                self._loaded = None, exc
        hf, err = self._loaded
        if err is not None:
            raise err
        return hf

    def cut(self, num_layers: int) -> Any:
        """The model's config cut to ``num_layers`` layers (0: all of them), loaded anew (the fit of other layer
        counts: :func:`sftprof.analysis.memory.fit.fitting_changes`). Raises as :meth:`config`."""
        return load_hf_config(self._actor["path"], num_layers)


def _recorded_object(log_dir: str, name: str, valid: Callable[[str, Any], bool],
                     expected: str) -> tuple[dict[str, Any] | None, str | None]:
    """``LOG_DIR/<name>`` as a JSON object whose every ``(key, value)`` ``valid`` accepts, and an error message naming
    the file when it is not a file, unreadable or not such an object (``"not a JSON object of <expected>"``);
    ``(None, None)`` when it is absent: a trial of an earlier release, or one that died before writing it."""
    path = os.path.join(log_dir, name)
    if not os.path.lexists(path):
        return None, None
    if not os.path.isfile(path):
        return None, f"{path}: not a file"
    found, error = _read(path, json.load, ValueError)
    if error:
        return None, error
    if not (isinstance(found, dict) and all(valid(k, v) for k, v in found.items())):
        return None, f"{path}: not a JSON object of {expected}"
    return found, None


def trial_environment(log_dir: str) -> tuple[dict[str, str] | None, str | None]:
    """The environment variables the trial recorded (``LOG_DIR/environment.json``, name -> value), and an error
    message naming the file when it is unreadable or not a JSON object of texts (``(None, None)`` when it is absent:
    a trial of an earlier release, or one that died before writing it)."""
    return _recorded_object(log_dir, artifacts.ENVIRONMENT, lambda k, v: isinstance(v, str) and _utf8(k + v), "texts")


def trial_versions(log_dir: str) -> tuple[Versions | None, str | None]:
    """The versions the trial ran with (``LOG_DIR/versions.json``: :class:`~sftprof.analysis.trial.schema.Versions`;
    ``sftprof`` and ``nccl``, which earlier releases did not record, None when the file lacks them), and an error
    message naming the file when it is unreadable, not a JSON object of texts and nulls, or lacks a package every
    release records (a null there says "not installed", so a missing one is not read as that); ``(None, None)`` when
    it is absent: a trial of an earlier release, or one that died before."""
    found, error = _recorded_object(log_dir, artifacts.VERSIONS,
                                    lambda k, v: v is None or isinstance(v, str) and _utf8(v), "texts and nulls")
    if found is None:
        return None, error
    missing = [key for key in Versions.__required_keys__ if key not in found]
    if missing:
        return None, f"{os.path.join(log_dir, artifacts.VERSIONS)}: lacks {', '.join(sorted(missing))}"
    return cast(Versions, {key: found.get(key) for key in Versions.__annotations__}), None  # each a text or None


def _utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (JSON's ``\\udcff`` escapes decode to lone surrogates, which cannot)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# --------------------------------------------------------------------------------------------
# Kernel traces
# --------------------------------------------------------------------------------------------
def file_error(path: str, exc: BaseException) -> str:
    """``"<path>: <Type>: <message>"`` (the path once, even when the message already names it); ``"<path>: empty
    file (0 bytes)"`` for an empty file, whatever its reader raised."""
    try:
        if os.path.getsize(path) == 0:
            return f"{path}: empty file (0 bytes)"
    except OSError:  # gone or unreadable: the reader's own error says so
        pass
    msg = f"{type(exc).__name__}: {exc}"
    return msg if path in msg else f"{path}: {msg}"


World = tuple[Optional[int], str]  # the trial's number of ranks and where it is read (inputs.world_size)



def outside_world(rank: int | None, world: World) -> str | None:
    """The error of a trace or snapshot whose file name's rank is not a rank of the trial (``rank >= world size``:
    a file of another trial), None when it is one or either is unknown."""
    n, where = world
    if rank is None or n is None or rank < n:
        return None
    return f"rank {rank} in the file name is not a rank of the trial: its world size is {n} ({where})"
