"""The what-if trials of a run (``TRY_WHAT_IFS``): after the planned trials, the N heaviest what-ifs their summaries
propose (:mod:`sftprof.analysis.what_if.changes`), or with ``TRY_WHAT_IFS=<key>,<key>`` the heaviest of each what-if
key listed (a key no summary proposed is named with why: a summary's ``what_if_skipped`` reason, else that no rule
proposed it; a key whose settings were merged into a heavier what-if of another key matches that one, tried once),
each tried once as one more trial of the same kind and step with its settings applied, then compared
with the trial it varies (prediction against outcome: :mod:`sftprof.analysis.what_if.outcome`).

Which: every what-if of the planned trials that ran and were postprocessed (``profile_summary.json``; of a failed
trial, the ``fit_oom`` what-if of its out-of-memory triage alone, :mod:`sftprof.analysis.memory.oom`: tried when
``STOP_ON_FAILURE=0`` lets the run reach its what-ifs), one per
distinct set of settings (the same setting proposed by several trials or ranks is tried once, on the trial where it
weighs most; a tie goes to the later step, past the warm-up), heaviest first (``weight``: the predicted effect's
share of its baseline).

A what-if trial is named ``<source trial>_whatif_<lever>``; its arguments are the source trial's with the what-if's
config settings last (and its own ``trial_name``), its environment the driver's with the what-if's environment
settings; ``RUN_DIR/what_if.json`` (:data:`sftprof.artifacts.WHAT_IF_JSON`) records the source and the what-if, which
postprocessing copies into its summary (``tried_what_if``) and compare reads. One that its config refuses, or whose
folder names do not fit, is not tried (a line says why).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from sftprof import artifacts
from sftprof.analysis.what_if.changes import setting_text
from sftprof.config import ConfigError, last_value_per_key, load_config, trial_log_dir
from sftprof.atomic import write_text
from sftprof.launch.folders import check_path_fits, write_train_args
from sftprof.launch.plan_types import Trial
from sftprof.launch.summaries import read_summary
from sftprof.launch.variables import DriverError, what_ifs_text

__all__ = ["choose", "what_if_trial", "write_what_if_plan", "settings_of"]


def settings_of(what_if: Mapping[str, Any]) -> str:
    """The what-if's settings as one field of ``summary.tsv``: ``key=value`` separated by spaces."""
    return " ".join(setting_text(s) for s in what_if["settings"])


def choose(trials: list[Trial], what_ifs: int | list[str]) -> tuple[list[tuple[Trial, dict[str, Any]]], list[str]]:
    """The what-ifs of the summaries of ``trials`` to try (module docstring): the ``what_ifs`` heaviest (a count), or
    the heaviest of each key ``what_ifs`` lists, in its order; as ``(source trial, what-if record)``, and lines for
    the user (what was proposed, what is left out, each listed key no summary proposed and why, each listed key tried
    as a what-if of another key with the same settings)."""
    best: dict[tuple[tuple[str, str, str], ...], tuple[Trial, dict[str, Any]]] = {}
    heaviest: dict[str, tuple[float, int, tuple[tuple[str, str, str], ...]]] = {}  # of each key: weight, step, settings
    skipped: list[dict[str, Any]] = []
    of_failed: set[str] = set()  # keys a failed trial proposed, other than fit_oom: not tried from it
    for t in trials:
        summary = read_summary(t.run_dir)
        ok = summary.get("status") == "ok"
        skipped += summary.get("what_if_skipped") or []
        for w in summary.get("what_if") or []:
            if not ok and w["key"] != "fit_oom":  # a failed trial's one what-if: the change that fits its OOM
                of_failed.add(w["key"])
                continue
            key = tuple(sorted((s["kind"], s["key"], json.dumps(s["value"])) for s in w["settings"]))
            heaviest[w["key"]] = max(heaviest.get(w["key"], (w["weight"], t.step, key)), (w["weight"], t.step, key))
            held = best.get(key)
            if held is None or (w["weight"], t.step) > (held[1]["weight"], held[0].step):
                best[key] = (t, w)
    ranked_keys = sorted(best, key=lambda k: -best[k][1]["weight"])
    ranked = [best[k] for k in ranked_keys]
    # each listed key proposed: the what-if its heaviest proposal was merged into (maybe held by another key's)
    listed = what_ifs if isinstance(what_ifs, list) else []
    match = {k: ranked_keys.index(heaviest[k][2]) for k in listed if k in heaviest}
    picked = (list(range(min(what_ifs, len(ranked)))) if isinstance(what_ifs, int)
              else list(dict.fromkeys(match.values())))  # in the listed order, each what-if once
    chosen = [ranked[i] for i in picked]
    why_none = (f"{len(skipped)} lever(s) not proposed, each with its reason in its summary's What if section"
                if skipped else "no rule found a lever: they read kernel trials' GPU time by model part and memory "
                                "trials' allocator snapshots")
    lines = [f"TRY_WHAT_IFS={what_ifs_text(what_ifs)}: {len(ranked)} what-if(s) proposed" + (
        f", none to try ({why_none})" if not ranked else ", none to try" if not chosen else
        f"; trying {len(chosen)}: " + "; ".join(
            f"{w['label']} ({settings_of(w)}) of the {t.kind} trial of step {t.step}" for t, w in chosen))]
    if len(ranked) > len(chosen):
        lines.append("not tried (TRY_WHAT_IFS): " + "; ".join(
            f"{w['label']} ({settings_of(w)})" for i, (_, w) in enumerate(ranked) if i not in picked))
    for k in listed:
        if k in match and ranked[match[k]][1]["key"] != k:
            lines.append(f"{k}: the same settings as {ranked[match[k]][1]['label']}, tried once")
        elif k not in match:
            why = "; ".join(dict.fromkeys(s["reason"] for s in skipped if s["key"] == k))  # each distinct one once
            if not why:
                why = ("proposed by a failed trial alone, whose one what-if tried is fit_oom" if k in of_failed
                       else "no rule proposed it")
            lines.append(f"not proposed: {k} ({why})")
    return chosen, lines


def what_if_trial(source: Trial, what_if: dict[str, Any]) -> Trial:
    """The trial that tries ``what_if`` on ``source`` (same kind and step; its config loaded, and so validated).

    Raises:
        DriverError: the config refuses the setting, or a folder name would not fit (the message names both).
    """
    name = f"{source.name}_whatif_{what_if['key']}"
    config = source.args[1]  # the trainer's arguments start with --config <path>
    settings = [setting_text(s) for s in what_if["settings"] if s["kind"] == "config"]
    overrides = last_value_per_key(source.args[2:] + settings + [f"trial_name={name}"])
    try:
        cfg = load_config(config, overrides)
    except ConfigError as err:
        raise DriverError(f"{what_if['label']} ({settings_of(what_if)}) on {source.name}: {err}") from None
    run_dir, log_dir = source.run_dir.parent / name, trial_log_dir(cfg)
    check_path_fits("PROFILE_STAMP", run_dir, "the what-if trial's run dir")
    check_path_fits("PROFILE_STAMP", log_dir, "the what-if trial's log dir")
    if log_dir.exists() or run_dir.exists():
        raise DriverError(f"{what_if['label']} on {source.name}: {run_dir if run_dir.exists() else log_dir} exists")
    return replace(source, name=name, run_dir=run_dir, log_dir=log_dir, args=["--config", config, *overrides],
                   env={s["key"]: str(s["value"]) for s in what_if["settings"] if s["kind"] == "env"},
                   what_if=settings_of(what_if))


def write_what_if_plan(run_root: Path, trial: Trial, source: Trial, what_if: dict[str, Any]) -> None:
    """Write the what-if trial's folder (``train_args.txt``, ``what_if.json``) and its row of ``trials.tsv``."""
    trial.run_dir.mkdir(parents=True)
    row = write_train_args(trial)
    record = {"source_trial": source.name, "source_run_dir": str(source.run_dir), "what_if": what_if}
    write_text(trial.run_dir / artifacts.WHAT_IF_JSON, json.dumps(record, indent=1, sort_keys=True) + "\n")
    with open(run_root / artifacts.TRIALS_TSV, "a", encoding="utf-8") as f:
        f.write(row + "\n")
