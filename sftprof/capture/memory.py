"""Memory trials: CUDA caching-allocator history and snapshot of the chosen steps and ranks.

On CUDA, on a rank of ``memory_profiler.ranks``, allocator history is recorded
(``torch.cuda.memory._record_memory_history`` with ``max_entries=memory_profiler.max_entries``
trace entries, ``stacks=memory_profiler.stacks``) from the moment the profiler is built, which the trainer does before the model, so
that weights, gradient buffers and optimizer states carry the Python stack that allocated them in
the snapshot (the trace ring buffer keeps only the newest ``max_entries`` events; a block's stack
stays with the block). At the end of each step in ``memory_profiler.profile_steps`` the snapshot
is dumped (``torch.cuda.memory._dump_snapshot``) at its end to
``LOG_DIR/memory_snapshots/step_<N>/snapshot_rank<r>_pp<a>_dp<b>_cp<c>_tp<d>_ep<e>.pickle``
(:func:`sftprof.artifacts.snapshot_dir`, :func:`sftprof.artifacts.snapshot_name`), with the phase
sidecar ``phases_rank<r>.json`` (:class:`sftprof.capture.regions.PhaseRecorder`,
Unix-epoch microseconds, the clock of the snapshot's ``time_us``; with the rank's device index, as a snapshot can
hold other devices' blocks). When the step dies of CUDA
out-of-memory the snapshot and sidecar are still written and :class:`MemoryProfileOOM` is
raised naming them. On CPU there is no allocator to snapshot: a log line says so and no file
is written.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch

from sftprof.artifacts import phases_name, snapshot_dir, snapshot_name
from sftprof.capture.regions import PhaseRecorder
from sftprof.ranks import resolve_ranks

log = logging.getLogger(__name__)


class MemoryProfileOOM(RuntimeError):
    """A memory-profiled step ran out of CUDA memory (snapshot written; message says where)."""


class MemoryProfiler:
    """Per-rank switch that records allocator history around a selected training step.

    Args:
        cfg: trial config (``memory_profiler.{profile_steps, max_entries, ranks}``).
        layout: the allocation layout (for rank-spec resolution).
        rank: this global rank; ``coords`` its ``Layout.rank_coords``.
        log_dir: the trial's LOG_DIR.
        device: this rank's device; snapshots only on ``cuda``.

    Raises:
        sftprof.ranks.RankSpecError: ``memory_profiler.ranks`` names ranks outside the world.
    """

    def __init__(self, cfg, layout, rank: int, coords: dict, log_dir: Path, device: torch.device) -> None:
        mp = cfg.memory_profiler
        self.steps = set(mp.profile_steps)
        self.max_entries = mp.max_entries
        self.stacks = mp.stacks
        self.ranks = resolve_ranks(mp.ranks, layout)
        self.rank = rank
        self.coords = coords
        self.log_dir = Path(log_dir)
        self.cuda = device.type == "cuda"
        self.device_index = None  # the rank's CUDA device index, recorded in the phases sidecar
        if self.cuda:
            self.device_index = torch.cuda.current_device() if device.index is None else device.index
        self.snapshots_written = 0
        if self.cuda and self.steps and rank in self.ranks:
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks=self.stacks)

    def is_profiled(self, step: int) -> bool:
        """True when ``step`` is a memory-profile step on some rank."""
        return step in self.steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Record allocator history through the enclosed block if selected (module docstring).

        Raises:
            MemoryProfileOOM: the block raised ``torch.OutOfMemoryError`` (snapshot written).
        """
        if step not in self.steps or self.rank not in self.ranks:
            yield
            return
        if not self.cuda:
            log.warning("memory profile of step %d on rank %d skipped: allocator snapshots need CUDA "
                        "(running on CPU); 0 snapshots written", step, self.rank)
            yield
            return
        out = snapshot_dir(self.log_dir, step)
        out.mkdir(parents=True, exist_ok=True)
        snap = out / snapshot_name(self.rank, self.coords)
        phases = out / phases_name(self.rank)
        try:
            with PhaseRecorder(sync_cuda=True) as rec:
                try:
                    yield
                except torch.OutOfMemoryError as err:
                    self._dump(snap, rec, phases)
                    raise MemoryProfileOOM(f"CUDA out of memory in memory-profiled step {step} on rank {self.rank}; "
                                           f"allocator snapshot written to {snap}: {err}") from err
            torch.cuda.synchronize()
            self._dump(snap, rec, phases)
        finally:
            if step == max(self.steps):
                torch.cuda.memory._record_memory_history(enabled=None)

    def _dump(self, snap: Path, rec: PhaseRecorder, phases: Path) -> None:
        torch.cuda.memory._dump_snapshot(str(snap))
        rec.write(phases, self.device_index)
        self.snapshots_written += 1
        log.info("memory snapshot written to %s (phases %s)", snap, phases)
