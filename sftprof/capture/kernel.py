"""Kernel trials: a ``torch.profiler`` trace of the chosen steps on the chosen ranks.

On the ranks of ``perf_tracer.ranks`` (:func:`sftprof.ranks.resolve_ranks`), when
``perf_tracer.enabled=true`` and ``perf_tracer.profile_steps`` is not empty, one
``torch.profiler.profile`` runs across the training loop from step 0 with a schedule
(:func:`profile_schedule`): nothing is collected before a profiled step's warm-up step, the step
before it warms the profiler up (as torchtitan's schedule does; step 0 has no warm-up), and the
profiled step is recorded and saved. The profiler's step counter is the trainer's step, so the
profiled step shows as ``ProfilerStep#<step>`` in the trace (what HolisticTraceAnalysis and
TensorBoard's profiler plugin split steps by) with the regions of
:mod:`sftprof.capture.regions` (``user_annotation`` events) inside it, and, while the profiled step
runs, the model-part ranges of :mod:`sftprof.capture.module_regions` (engines register their model) and
the garbage-collection ranges of :mod:`sftprof.capture.python_gc`.

Activities: CPU, plus CUDA when CUDA is available, with ``record_shapes=True``; on CUDA also CUDA
synchronisation events (``_ExperimentalConfig(enable_cuda_sync_events=True)``, used by HTA's
critical-path analysis) where this torch accepts that option. Each profiled step is exported with
``export_chrome_trace`` to ``LOG_DIR/perf_tracer/rank<rank>.pt.trace.json`` (:func:`sftprof.artifacts.raw_trace_path`; the
``<worker>.pt.trace.json`` name TensorBoard's profiler plugin looks for). That name holds one step, so a trial
profiles one kernel step: :func:`sftprof.config.validate` refuses more than one ``perf_tracer.profile_steps``
entry (the driver runs one trial per step of ``PROFILE_STEPS``). A profiler built from an unvalidated config with
several steps records each of them, and each export replaces the file (the log names the step each export holds).
A trace the profiler could not rename from its temporary name (``<name>*.tmp``) is renamed here, or, if that fails
too, left there and logged as such (postprocessing reads it); "written to" is logged only for a file that is there.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch.profiler import ProfilerAction

from sftprof.artifacts import raw_trace_path, unrenamed_traces
from sftprof.capture import module_regions, python_gc
from sftprof.console import native_stderr_filtered
from sftprof.ranks import resolve_ranks

log = logging.getLogger(__name__)


def profile_schedule(steps: Iterable[int]) -> Callable[[int], ProfilerAction]:
    """Profiler schedule over trainer step numbers: record each step of ``steps``, warm up the one before.

    ``action(n)`` is ``RECORD_AND_SAVE`` for ``n`` in ``steps``, ``WARMUP`` for ``n + 1`` in
    ``steps`` (a one-step warm-up), ``NONE`` otherwise. For one step ``s >= 1`` this is
    ``torch.profiler.schedule(skip_first=s - 1, wait=0, warmup=1, active=1, repeat=1)``; it also
    covers several (even adjacent) steps.
    """
    chosen = frozenset(steps)

    def action(n: int) -> ProfilerAction:
        if n in chosen:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.WARMUP if n + 1 in chosen else ProfilerAction.NONE

    return action


def _experimental_config(cuda: bool):
    """``_ExperimentalConfig(enable_cuda_sync_events=True)`` on CUDA where torch has it, else None."""
    if not cuda:
        return None
    try:
        return torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)
    except (AttributeError, TypeError):
        log.info("this torch records no CUDA sync events (no enable_cuda_sync_events); traces have none")
        return None


class KernelProfiler:
    """Per-rank profiler over the training loop that records the chosen steps (module docstring).

    Call :meth:`step` for every trainer step in order from 0; it is a no-op on ranks and trials
    that profile nothing.

    Args:
        cfg: trial config (``perf_tracer.{enabled, profile_steps, ranks}``).
        layout: the allocation layout (for rank-spec resolution).
        rank: this global rank.
        log_dir: the trial's LOG_DIR.

    Raises:
        sftprof.ranks.RankSpecError: ``perf_tracer.ranks`` names ranks outside the world size.
    """

    def __init__(self, cfg, layout, rank: int, log_dir: Path) -> None:
        pt = cfg.perf_tracer
        self.steps = set(pt.profile_steps) if pt.enabled else set()
        if pt.profile_steps and not pt.enabled:
            log.warning("perf_tracer.profile_steps=%s ignored: perf_tracer.enabled=false", list(pt.profile_steps))
        self.ranks = resolve_ranks(pt.ranks, layout)
        self.rank = rank
        self.log_dir = Path(log_dir)
        self.traces_written = 0
        self._prof: torch.profiler.profile | None = None
        self._failed = False
        self._recording: int | None = None  # the profiled step being recorded (what the next export holds)

    def is_profiled(self, step: int) -> bool:
        """True when ``step`` is a kernel-profile step on some rank."""
        return step in self.steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run trainer step ``step`` (0, 1, 2, ... in order) under the profiler when this rank profiles.

        The profiler starts with step 0 and stops after the last profiled step. A profiled step's
        trace is exported when its block ends normally; when a block raises, the profiler stops and
        nothing more is exported.

        Raises:
            ValueError: steps are not entered in order 0, 1, 2, ... on a profiling rank.
        """
        if not self.steps or self.rank not in self.ranks or self._failed or step > max(self.steps):
            yield
            return
        if self._prof is None:
            if step != 0:
                raise ValueError(f"KernelProfiler.step: the first step must be 0, got {step}")
            if 0 in self.steps:
                log.info("kernel profile of step 0 has no warm-up step (the first step is profiled)")
            cuda = torch.cuda.is_available()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities, schedule=profile_schedule(self.steps), record_shapes=True,
                on_trace_ready=self._export, experimental_config=_experimental_config(cuda))
            with native_stderr_filtered():  # Kineto's "USDT: ... profiler_start" line: off the console
                self._prof.start()
        else:
            if step != self._prof.step_num + 1:
                expected = self._prof.step_num + 1
                self._failed = True
                self._stop()
                raise ValueError(f"KernelProfiler.step: expected step {expected}, got {step}")
            with native_stderr_filtered():
                self._prof.step()  # closes ProfilerStep#<step - 1>, opens ProfilerStep#<step>
        if step in self.steps:
            # set after prof.step(): that call exports the previous profiled step (torch has already counted on)
            self._recording = step
        try:
            with module_regions.recording(step in self.steps), python_gc.recording(step in self.steps):
                yield
        except BaseException:
            self._failed = True
            self._stop()
            raise
        if step == max(self.steps):
            self._stop()  # saves the last profiled step (RECORD_AND_SAVE -> stop)

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            with native_stderr_filtered():
                prof.stop()

    def _export(self, prof: torch.profiler.profile) -> None:
        if self._failed:
            return
        path = raw_trace_path(self.log_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        # not prof.step_num: an export made by prof.step() runs after torch has counted on to the next step
        step = self._recording
        left = unrenamed_traces(path)
        if not path.is_file() and left:  # kineto wrote it under its temporary name and could not rename it
            tmp = max(left, key=lambda p: p.stat().st_mtime)
            try:
                os.replace(tmp, path)
            except OSError as exc:
                self.traces_written += 1
                log.warning("kernel trace of step %d left as %s: the profiler could not rename it to %s, nor could "
                            "sftprof (%s); postprocessing reads it from there", step, tmp, path, exc)
                return
            log.warning("kernel trace of step %d: the profiler left it as %s (its rename failed); renamed to %s",
                        step, tmp, path)
        if not path.is_file():
            log.error("kernel trace of step %d: the profiler wrote no file at %s", step, path)
            return
        self.traces_written += 1
        log.info("kernel trace of step %d written to %s", step, path)
