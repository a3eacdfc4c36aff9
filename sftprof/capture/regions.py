"""Annotated regions of a training step, shared by both backends and both profile kinds.

Every region is a ``torch.profiler.record_function`` (it shows in kernel traces as a
``user_annotation`` and on the GPU track as ``gpu_user_annotation``) and, while a
:class:`PhaseRecorder` is active, is also recorded with Unix-epoch microsecond timestamps so
memory-snapshot analysis can say which phase held the peak (the allocator trace's ``time_us``
uses the same clock).

Region names (owned by :mod:`sftprof.artifacts`, re-exported here for the engines): ``sftprof/step``,
``sftprof/forward/mb<i>``, ``sftprof/backward/mb<i>``, ``sftprof/optimizer_step``.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from sftprof.artifacts import OPTIMIZER_STEP, STEP, backward, forward
from sftprof.progress import RankProgress, StepProgress

__all__ = ["STEP", "OPTIMIZER_STEP", "forward", "backward", "PhaseRecorder", "region", "open_regions"]

_OPEN: list[str] = []  # the regions entered and not left, outermost first (this process's one training thread)


def open_regions() -> list[str]:
    """The regions open now, outermost first (``["sftprof/step", "sftprof/backward/mb0"]``)."""
    return list(_OPEN)


class PhaseRecorder:
    """Collects ``{"name", "start_us", "end_us"}`` for every region entered while it is active.

    On CUDA the timestamps are taken after a device synchronisation so that they bracket the
    allocations of the region's kernels as the caching allocator records them.
    """

    _active: Optional["PhaseRecorder"] = None

    def __init__(self, sync_cuda: bool) -> None:
        self.sync_cuda = sync_cuda
        self.phases: list[dict] = []

    def __enter__(self) -> "PhaseRecorder":
        PhaseRecorder._active = self
        return self

    def __exit__(self, *exc) -> None:
        PhaseRecorder._active = None

    def now_us(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.time() * 1e6

    def write(self, path: Path, device: int | None = None) -> None:
        """Write ``{"clock": "unix_us", "device": <the rank's CUDA device index>, "phases": [...]}`` to ``path``
        (JSON; ``device`` only when given: the snapshot's device whose figures are the rank's)."""
        record = {"clock": "unix_us", **({"device": device} if device is not None else {}), "phases": self.phases}
        path.write_text(json.dumps(record, indent=1))


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Annotate a region: ``record_function(name)``, a phase record when a :class:`PhaseRecorder` is
    active, progress lines when a :class:`sftprof.progress.StepProgress` is active (rank 0), and the rank's progress
    record when a :class:`sftprof.progress.RankProgress` is (every rank)."""
    rec = PhaseRecorder._active
    progress, mine = StepProgress._active, RankProgress._active
    start = rec.now_us() if rec else None
    if progress is not None:
        progress.enter(name)
    _OPEN.append(name)
    if mine is not None:
        mine.mark(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:  # also when the region dies (CUDA OOM): the snapshot's peak still gets its phase
        _OPEN.pop()
        if rec is not None:
            rec.phases.append({"name": name, "start_us": start, "end_us": rec.now_us()})
        if progress is not None:
            progress.exit(name)
        if mine is not None:
            mine.mark(f"after {name}")
