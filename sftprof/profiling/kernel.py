"""Kernel trials: a ``torch.profiler`` trace of the chosen steps on the chosen ranks.

The profiler runs only around a profiled step (``perf_tracer.enabled=true`` and the step in
``perf_tracer.profile_steps``) and only on the ranks of ``perf_tracer.ranks``
(:func:`sftprof.ranks.resolve_ranks`). It records CPU activity, plus CUDA activity when CUDA is
available, with ``record_shapes=True``; the regions of :mod:`sftprof.profiling.regions` show as
``user_annotation`` events. Each profiled step is exported with ``export_chrome_trace`` to
``LOG_DIR/perf_tracer/traces-r<rank>.chrome.json`` (a later profiled step of the same trial
overwrites it: profile one step per trial, as the driver does).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch

from sftprof.ranks import resolve_ranks

log = logging.getLogger(__name__)


def trace_path(log_dir: Path, rank: int) -> Path:
    """``LOG_DIR/perf_tracer/traces-r<rank>.chrome.json``."""
    return Path(log_dir) / "perf_tracer" / f"traces-r{rank}.chrome.json"


class KernelProfiler:
    """Per-rank switch that wraps a training step in ``torch.profiler.profile`` when selected.

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

    def is_profiled(self, step: int) -> bool:
        """True when ``step`` is a kernel-profile step on some rank."""
        return step in self.steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Profile the enclosed block if ``step`` is profiled and this rank is selected.

        The trace is exported when the block ends normally (not when it raises).
        """
        if step not in self.steps or self.rank not in self.ranks:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            yield
        path = trace_path(self.log_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        self.traces_written += 1
        log.info("kernel trace of step %d written to %s", step, path)
