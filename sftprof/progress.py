"""Progress lines while a trial runs (rank 0): each phase's end with its time, and a heartbeat.

The trainer activates one :class:`StepProgress` on rank 0. Every region of
:mod:`sftprof.capture.regions` (names from :mod:`sftprof.artifacts`: ``sftprof/forward/mb<i>``,
``sftprof/backward/mb<i>``, ``sftprof/optimizer_step``) logs a line when it ends, with its host wall time in seconds and the
time since the step began; while a step runs, a background thread logs a heartbeat every
``heartbeat_s`` seconds naming the innermost region open at that moment. Times are host wall
clock (``time.monotonic``): on CUDA a region's kernels may still run after its line.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from sftprof.artifacts import STEP

log = logging.getLogger("sftprof")


class StepProgress:
    """Rank-0 progress reporter, active between :meth:`start` and :meth:`stop`.

    Args:
        heartbeat_s: seconds between heartbeat lines while a step runs (> 0).

    Raises:
        ValueError: ``heartbeat_s`` is not positive.
    """

    _active: Optional["StepProgress"] = None

    def __init__(self, heartbeat_s: float = 20.0) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s={heartbeat_s}: must be > 0")
        self.heartbeat_s = heartbeat_s
        self._step: Optional[tuple[int, float]] = None   # (step, start) while a step runs
        self._open: list[tuple[str, float]] = []          # regions open now, outermost first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="sftprof-heartbeat", daemon=True)

    def start(self) -> None:
        """Become the active reporter and start the heartbeat thread."""
        StepProgress._active = self
        self._thread.start()

    def stop(self) -> None:
        """Stop reporting (idempotent; a reporter that never started stays stopped)."""
        if StepProgress._active is self:
            StepProgress._active = None
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()

    def begin_step(self, step: int) -> None:
        """Mark the start of trainer step ``step``."""
        self._step = (step, time.monotonic())
        self._open = []

    def end_step(self) -> None:
        """Mark the end of the current step (no heartbeat until the next one begins)."""
        self._step = None

    def enter(self, name: str) -> None:
        """A region opened (called by :func:`sftprof.capture.regions.region`)."""
        self._open = self._open + [(name, time.monotonic())]

    def exit(self, name: str) -> None:
        """A region closed: log ``step N | <name> done in X s (step at Y s)`` unless it is the whole step."""
        now = time.monotonic()
        start = next((t for n, t in reversed(self._open) if n == name), None)
        self._open = [(n, t) for n, t in self._open if n != name]
        if start is None or self._step is None or name == STEP:
            return
        step, step_start = self._step
        log.info("step %d | %s done in %.1f s (step at %.1f s)", step, name, now - start, now - step_start)

    def heartbeat_line(self) -> Optional[str]:
        """``step N | still running after X s; in <innermost region> for Y s``, or None between steps."""
        current, open_regions = self._step, self._open
        if current is None:
            return None
        step, step_start = current
        now = time.monotonic()
        inner = next((r for r in reversed(open_regions) if r[0] != STEP), None)
        where = f"; in {inner[0]} for {now - inner[1]:.0f} s" if inner else ""
        return f"step {step} | still running after {now - step_start:.0f} s{where}"

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            line = self.heartbeat_line()
            if line is not None:
                log.info("%s", line)
