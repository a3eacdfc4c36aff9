"""The one check of the profile kind and step a trial is postprocessed as (:func:`resolve_profile`): used by
``postprocess_profile.py`` before it creates anything (the driver runs that script on each trial, so the driver and a
standalone run share it) and by :func:`sftprof.analysis.summary.postprocess_trial` for a caller of its own."""
from __future__ import annotations

import os

from sftprof import artifacts
from sftprof.analysis.trial import inputs
from sftprof.artifacts import PROFILE_KINDS

__all__ = ["PROFILE_KINDS", "NotRecorded", "resolve_profile", "profiled_steps"]


class NotRecorded(ValueError):
    """The kind or step was not given and the trial recorded none (it died before its completion record)."""


def resolve_profile(log_dir: str, kind: str | None, step: int | None) -> tuple[str, int]:
    """The kind and step to process: as given, else the trial's recorded ones (``stats.jsonl``'s completion record).
    Given, each is a check: a kind other than the recorded one, or a step the trial did not profile
    (:func:`profiled_steps`), would label what the trial is not. A trial with no record (it died before writing it)
    has nothing to check a given kind or step against. Reads only; writes nothing.

    Raises:
        ValueError: in this order, each message naming the setting and ending in what is accepted:
            ``kind`` not one of :data:`PROFILE_KINDS`; ``step`` < 0; ``log_dir`` missing while ``kind`` or ``step``
            is None; ``kind`` or ``step`` None and not recorded (:class:`NotRecorded`); ``kind`` other than the
            recorded one; ``step`` not one the trial profiled.
    """
    if kind is not None and kind not in PROFILE_KINDS:
        raise ValueError(f"--profile-kind must be one of {PROFILE_KINDS}, got {kind!r}")
    if step is not None and step < 0:
        raise ValueError(f"--profile-step must be >= 0, got {step}")
    if (kind is None or step is None) and not os.path.isdir(log_dir):
        raise ValueError(f"--log-dir {log_dir} does not exist, so --profile-kind and --profile-step cannot be read "
                         "from its stats.jsonl; nothing was written (given both, the trial's summary is written, "
                         "as failed)")
    stats = os.path.join(log_dir, artifacts.STATS)
    recorded_kind, recorded_step = inputs.recorded_profile(log_dir)
    if kind is None:
        if recorded_kind is None:
            raise NotRecorded(f"--profile-kind: not given, and {stats} has no completion record naming it; pass one "
                             f"of {PROFILE_KINDS}")
        kind = recorded_kind
    if step is None:
        if recorded_step is None:
            raise NotRecorded(f"--profile-step: not given, and {stats} has no completion record naming it; pass the "
                             "profiled step (an integer >= 0)")
        step = recorded_step
    if recorded_kind is not None and kind != recorded_kind:
        raise ValueError(f"--profile-kind {kind}: the trial recorded profile_kind={recorded_kind!r} in {stats}; pass "
                         f"--profile-kind {recorded_kind} or leave it out; nothing was written")
    steps, where = profiled_steps(log_dir, kind)
    if steps and step not in steps:
        raise ValueError(f"--profile-step {step}: the trial profiled step(s) {steps} ({where}); pass one of them or "
                         "leave it out; nothing was written")
    return kind, step


def profiled_steps(log_dir: str, kind: str) -> tuple[list[int], str]:
    """The steps the trial profiled for ``kind`` and where that is written: ``<section>.profile_steps`` of the trial's
    ``config.yaml`` (``perf_tracer`` for kernel, ``memory_profiler`` for memory), else the step of its completion
    record in ``stats.jsonl``; ``([], "")`` when neither can be read (a trial that died early)."""
    section = "perf_tracer" if kind == "kernel" else "memory_profiler"
    cfg, _ = inputs.trial_config(log_dir)
    part = cfg.get(section) if isinstance(cfg, dict) else None
    steps = part.get("profile_steps") if isinstance(part, dict) else None
    if isinstance(steps, list) and steps and all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        return sorted(set(steps)), f"{section}.profile_steps in {os.path.join(log_dir, artifacts.CONFIG_YAML)}"
    _, recorded = inputs.recorded_profile(log_dir)
    if recorded is not None:
        return [recorded], f"the completion record in {os.path.join(log_dir, artifacts.STATS)}"
    return [], ""
