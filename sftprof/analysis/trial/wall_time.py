"""Where a trial's wall time went: its phases from torchrun's launch to its exit, and step 0's cold-start cost.

The boundaries are clocks already recorded (seconds since the Unix epoch, node 0): the launcher's in
``RUN_DIR/trial_times.json`` (:class:`sftprof.artifacts.TrialTimes`: torchrun launched, ended) and rank 0's in
``stats.jsonl`` (:class:`sftprof.stats_log.CompletionRecord`: process start, imports done, engine build started,
record written; :class:`sftprof.stats_log.StepRecord`: each step's start and its time in the profilers;
:class:`sftprof.stats_log.TeardownRecord`: the ranks' barrier passed, the process group torn down;
:class:`sftprof.stats_log.ExitRecord`: the process's atexit handlers run). Each phase
runs from one boundary to the next, so the phases sum to the launcher's elapsed time; a boundary not recorded (a
trial that failed or was stopped before it, a log of an earlier release) leaves the phases on either side of it
None. A step's phase runs from its start to the next step's (the last: to the completion record), less its time in
the profilers, which is the ``profiler`` phase; in a failed trial the last recorded step's phase holds the step that
failed. Without the teardown record (a log of an earlier release, a trial killed in its teardown) ``teardown`` is
None and ``exit`` runs from the completion record, the teardown in it; without the exit record (a log of an earlier
release, a trial killed in its exit) ``atexit`` is None and ``exit`` runs from the teardown record, the atexit
handlers in it.
"""
from __future__ import annotations

import statistics
from typing import Any, Optional

from sftprof.artifacts import TrialTimes
from sftprof.analysis.trial.schema import ColdStart, Stats, WallPhase, WallTime

__all__ = ["PHASES", "wall_time", "cold_start"]

# phase -> what it holds, in the order they follow each other
PHASES = {
    "start_up": "torchrun started and the ranks spawned (the launcher's launch to rank 0's first line)",
    "imports": "rank 0's Python imports (torch, sftprof and what they import)",
    "setup": "config and model checks, the fake sample, the process group, the log dir",
    "engine_build": "the model, its weights and the optimizer built",
    "step_0": "step 0 when it is not profiled (its cold-start cost is below)",
    "warm_steps": "the other steps not profiled (the profiler's warm-up step among them)",
    "profiled_steps": "the profiled step(s)",
    "profiler": "the profilers around the steps: torch's profiler started and stepped, its trace exported; the "
                "allocator snapshot dumped",
    "teardown": "after the last step: the completion record, the ranks' barrier, the process groups torn down "
                "(Megatron's among them) with their communicators",
    "atexit": "rank 0's process after its main: non-daemon threads joined, the atexit handlers registered since "
              "main began run (torch's compile workers shut down among them)",
    "exit": "the processes' exit (the atexit handlers registered at import: multiprocessing's children joined, "
            "weakref finalizers, logging's shutdown; Python's finalisation: modules and tensors freed, the CUDA "
            "context destroyed; a rank slower to exit than rank 0) and torchrun's noticing it",
}


def _span(start: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if start is None or end is None else end - start


def _rounded(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def wall_time(stats: Stats, times: TrialTimes | None) -> WallTime:
    """The trial's :class:`~sftprof.analysis.trial.schema.WallTime` (module docstring): seconds, rounded to 3
    decimals. ``stats``: ``stats.jsonl`` as :func:`sftprof.analysis.trial.inputs.read_stats` gives it; ``times``:
    the launcher's record (None: none, the launcher's phases and ``elapsed_s`` are None). ``barrier_s``: the part of
    ``teardown`` up to the ranks' barrier passed (None: no barrier ran, a failed trial, or no teardown record)."""
    complete = stats.get("complete") or {}
    launched = times.launched_unix_s if times else None
    ended = times.torchrun_ended_unix_s if times else None
    proc, main, build, written = (_number(complete.get(k)) for k in (
        "trainer_started_unix_s", "imports_done_unix_s", "engine_build_started_unix_s", "ended_unix_s"))
    teardown = stats.get("teardown")
    barrier, destroyed = ((_number(teardown.get("barrier_done_unix_s")),
                           _number(teardown.get("process_group_destroyed_unix_s"))) if teardown else (None, None))
    exited = stats.get("exit") if teardown else None
    atexit_done = _number(exited.get("atexit_done_unix_s")) if exited else None
    if exited:  # the exit phase starts at rank 0's last record
        exit_from = atexit_done
    elif teardown:
        exit_from = destroyed
    else:
        exit_from = written
    steps = sorted(stats["steps"], key=lambda s: s["step"])
    starts = [_number(s.get("started_unix_s")) for s in steps]
    seconds: dict[str, Optional[float]] = {
        "start_up": _span(launched, proc), "imports": _span(proc, main), "setup": _span(main, build),
        "engine_build": _span(build, starts[0] if steps else written),
        "step_0": 0.0, "warm_steps": 0.0, "profiled_steps": 0.0, "profiler": 0.0,
        "teardown": _span(written, destroyed) if teardown else None,
        "atexit": _span(destroyed, atexit_done) if exited else None,
        "exit": _span(exit_from, ended)}
    for i, row in enumerate(steps):
        span = _span(starts[i], starts[i + 1] if i + 1 < len(steps) else written)
        inside = _number(row.get("profiler_s"))
        phase = "profiled_steps" if row.get("profiled") else "step_0" if row["step"] == 0 else "warm_steps"
        for name, value in ((phase, None if span is None or inside is None else span - inside),
                            ("profiler", inside)):
            so_far = seconds[name]
            seconds[name] = None if value is None or so_far is None else so_far + value
    phases: list[WallPhase] = [{"phase": name, "seconds": _rounded(seconds[name])} for name in PHASES]
    return {"phases": phases, "elapsed_s": _rounded(_span(launched, ended)), "cold_start": cold_start(stats),
            "barrier_s": _rounded(_span(written, barrier))}


def cold_start(stats: Stats) -> ColdStart | None:
    """Step 0's ``step_time_s`` less the median of a warm step's: the steps after 0 that were not profiled, else the
    profiled ones (their profiler's cost included); None without step 0 or a later step. A negative difference, or
    one below the spread (max - min) of the reference steps, is no cost to stand behind: ``not_measurable`` says why
    (the profiler's cost in the reference, or the steps' spread, exceeds it)."""
    times: dict[int, tuple[float, bool]] = {}
    for s in stats["steps"]:
        dt = _number(s["step_time_s"])
        if dt is not None:
            times[s["step"]] = (dt, bool(s.get("profiled")))
    if 0 not in times:
        return None
    later = [k for k in sorted(times) if k > 0]
    warm = [k for k in later if not times[k][1]] or later
    if not warm:
        return None
    step0, reference = times[0][0], statistics.median(times[k][0] for k in warm)
    profiled = times[warm[0]][1]
    spread = max(times[k][0] for k in warm) - min(times[k][0] for k in warm)
    out: ColdStart = {"step0_s": round(step0, 3), "warm_step_s": round(reference, 3), "warm_steps": warm,
                      "reference_profiled": profiled, "cold_start_s": round(step0 - reference, 3)}
    if 0 <= step0 - reference < spread:
        out["not_measurable"] = (f"step 0 was {step0 - reference:.3f} s slower than the reference, less than its "
                                 f"steps' spread ({spread:.3f} s)")
    elif out["cold_start_s"] < 0:
        out["not_measurable"] = (
            f"step 0 was {reference - step0:.3f} s faster than the reference, "
            + ("a profiled step whose profiler cost exceeds step 0's one-time cost (an unprofiled step after 0, "
               "TOTAL_STEPS past the profiled step, measures it)" if profiled
               else "whose steps vary by more than step 0's one-time cost"))
    return out
