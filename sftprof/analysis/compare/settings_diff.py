"""The settings that differ between two trials, the first lines of each group of a comparison
(:mod:`sftprof.analysis.compare.runs`): the resolved config and the recorded environment variables (``env.<NAME>``) of
each trial's summary, read from its log dir for summaries of earlier releases, and the recorded software versions
(``version.<name>``, when both summaries hold them); a note when a difference cannot act (``cp_attention`` without CP)
or changes the problem size.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.trial import inputs
from sftprof.artifacts import ENVIRONMENT, VERSIONS

__all__ = ["settings_diff"]

# differ between any two trials, or between the trials a group pools (the section title names their steps); where the
# logs went (the driver's default FILEROOT is RUN_ROOT/fileroot, one per run) changes nothing the deltas measure
_SAME_BY_DESIGN = ("trial_name", "perf_tracer.profile_steps", "memory_profiler.profile_steps", "cluster.fileroot")
_SIZE_KEYS = ("profile.fake_seq_len", "train_dataset.batch_size", "actor.backend", "actor.num_layers", "actor.path")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _settings(summary: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The trial's resolved config, flattened: the copy in the summary (``config``), else ``LOG_DIR/config.yaml``
    written by the trainer (summaries of earlier releases, or a config.yaml that postprocess could not read), and
    why it is unknown (``(None, reason)`` when neither is there or the file is unreadable; ``""`` when known)."""
    if isinstance(summary.get("config"), dict):
        return _flat(summary["config"]), ""
    cfg, error = inputs.trial_config((summary.get("paths") or {}).get("log_dir") or "")
    if error:
        return None, error
    return (None, "not available") if cfg is None else (_flat(cfg), "")


def _recorded(summary: dict[str, Any], member: str, name: str,
              read: Callable[[str], tuple[Any, Optional[str]]]) -> tuple[dict[str, Any] | None, str]:
    """What the trial recorded in ``LOG_DIR/<name>`` (its environment variables, its software versions): the copy in
    the summary (``member``), else the log dir's file (``read``: :mod:`sftprof.analysis.trial.inputs`); and why it
    is unknown (``(None, reason)``; ``""`` when known)."""
    if member in summary:  # a summary of a schema that has the member: its postprocess read the file
        if isinstance(summary[member], dict):
            return summary[member], ""
        errors = [str(e.get("error")) for e in summary.get("errors") or []
                  if isinstance(e, dict) and e.get("file") == name]
        return None, errors[0] if errors else f"no {name} in the trial's log dir when it was postprocessed"
    log_dir = (summary.get("paths") or {}).get("log_dir")
    found, error = read(log_dir) if isinstance(log_dir, str) and log_dir else (None, None)
    if error:
        return None, error
    return (None, f"no {name}: trials of earlier releases did not write it") if found is None else (found, "")


_CP_ATTENTION = "actor.megatron.cp_attention"


def _uses_cp_attention(flat_cfg: dict[str, Any]) -> bool:
    """Whether ``actor.megatron.cp_attention`` can act in a trial: the megatron backend with CP > 1 (True when the
    backend does not parse: not known to be without effect)."""
    try:
        layout = parse_allocation_mode(str(flat_cfg.get("actor.backend")))
    except ValueError:
        return True
    return layout.backend == "megatron" and layout.cp > 1


# settings whose empty value has a meaning of its own (sftprof/config/schema.py: PerfTracerConfig, MemoryProfilerConfig)
_EMPTY_MEANS = {"perf_tracer.ranks": "all ranks", "memory_profiler.ranks": "all ranks"}


def _setting_cell(key: str, flat_cfg: dict[str, Any]) -> str:
    """One trial's value of a setting in the settings table: ``–`` when the trial's config has no such key, ``""``
    for an empty text (with its meaning where it has one: ``"" (all ranks)`` for ``perf_tracer.ranks``), else the
    value; a layout's ``|`` and line breaks are escaped, so that the row keeps its three cells on one line."""
    if key not in flat_cfg:
        return "–"
    value = flat_cfg[key]
    if value == "":
        return f'"" ({_EMPTY_MEANS[key]})' if key in _EMPTY_MEANS else '""'
    return str(value).replace("\r", "\\r").replace("\n", "\\n").replace("|", "\\|")


def settings_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What was changed between the two trials (the experiment), and a warning when sizes differ; a note for the
    environment variables and software versions that could not be compared (a side that did not record them)."""
    (ca, why_a), (cb, why_b) = _settings(a), _settings(b)
    if ca is None or cb is None:
        why = "; ".join(f"{side}: {why}" for side, c, why in (("A", ca, why_a), ("B", cb, why_b)) if c is None)
        return [f"Settings unknown (the trial's config.yaml, {why}); cannot tell what differs.", ""]
    (ea, why_ea), (eb, why_eb) = (_recorded(t, "environment", ENVIRONMENT, inputs.trial_environment) for t in (a, b))
    if ea is not None and eb is not None:  # an unset variable is "–" on its side
        ca = {**ca, **{f"env.{k}": v for k, v in ea.items()}}
        cb = {**cb, **{f"env.{k}": v for k, v in eb.items()}}
        notes = []
    else:
        why = "; ".join(f"{side}: {w}" for side, e, w in (("A", ea, why_ea), ("B", eb, why_eb)) if e is None)
        notes = [f"Environment variables not compared ({why}).", ""]
    (va, why_va), (vb, why_vb) = (_recorded(t, "versions", VERSIONS, inputs.trial_versions) for t in (a, b))
    if va is not None and vb is not None:  # a package not installed is "–" on its side
        ca = {**ca, **{f"version.{k}": v for k, v in va.items() if v is not None}}
        cb = {**cb, **{f"version.{k}": v for k, v in vb.items() if v is not None}}
    else:
        why = "; ".join(f"{side}: {w}" for side, v, w in (("A", va, why_va), ("B", vb, why_vb)) if v is None)
        notes += [f"Software versions not compared ({why}).", ""]
    keys = sorted(k for k in set(ca) | set(cb) if k not in _SAME_BY_DESIGN and ca.get(k) != cb.get(k))
    if not keys and notes:
        return ["Settings: the configs are identical.", ""] + notes
    if not keys:
        return ["Settings: identical (a repeat run: deltas show run-to-run noise).", ""]
    out = ["Settings that differ:", "", "| setting | A | B |", "|---|---|---|"]
    out += [f"| `{k}` | " + " | ".join(_setting_cell(k, c) for c in (ca, cb)) + " |" for k in keys]
    if _CP_ATTENTION in keys and not any(_uses_cp_attention(c) for c in (ca, cb)):
        out += ["", f"`{_CP_ATTENTION}` has no effect in either trial (it applies to the megatron backend with CP > 1): "
                    "its difference is not what the deltas measure."]
    sized = [k for k in keys if k in _SIZE_KEYS]
    if sized:
        out += ["", f"**Warning:** the runs differ in {', '.join(sized)}: time and memory deltas mix the "
                "change under test with a different problem size."]
    return out + [""] + notes
