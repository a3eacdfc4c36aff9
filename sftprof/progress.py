"""Progress while a trial runs: rank 0's lines (each phase's end with its time, and a heartbeat), and every rank's
last progress in a file (:class:`RankProgress`) for the launcher's watchdog (:mod:`sftprof.launch.watchdog`).

The trainer activates one :class:`StepProgress` on rank 0. Every region of
:mod:`sftprof.capture.regions` (names from :mod:`sftprof.artifacts`: ``sftprof/forward/mb<i>``,
``sftprof/backward/mb<i>``, ``sftprof/optimizer_step``) logs a line when it ends, with its host wall time and the
time since the step began (:func:`duration_text`: 3 significant digits, ms below a second); while a step runs, a
background thread logs a heartbeat each time another ``heartbeat_s`` seconds of that step have passed (at 20,
40, ... s of a step with the trainer's 20 s), naming the innermost region open at that moment: a step shorter than
``heartbeat_s`` logs none. Times are host wall clock (``time.monotonic``): on CUDA a region's kernels may still run
after its line.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional

from pathlib import Path

from sftprof.artifacts import STEP, write_progress

log = logging.getLogger("sftprof")


def duration_text(seconds: float) -> str:
    """A duration for a console line, 3 significant digits: seconds from 1 s (``17.3 s``, ``1234 s``: whole seconds
    from 100 s), milliseconds below (``412 ms``, ``4.12 ms``)."""
    value, unit = (seconds, "s") if seconds >= 1 else (seconds * 1e3, "ms")
    value = float(f"{value:.3g}") if value < 100 else value  # 9.999 -> 10.0, not 10.00
    decimals = 0 if value <= 0 else max(0, 2 - math.floor(math.log10(value)))
    return f"{value:.{decimals}f} {unit}"


class StepProgress:
    """Rank-0 progress reporter, active between :meth:`start` and :meth:`stop`.

    Args:
        heartbeat_s: seconds of a step between its heartbeat lines (> 0): the k-th line comes once the step has
            run ``k * heartbeat_s`` seconds.
        clock: the time source in seconds (``time.monotonic``; tests pass their own).
        poll_s: seconds between the heartbeat thread's looks at the clock (> 0), so a line comes at most that
            late; at most ``heartbeat_s``.

    Raises:
        ValueError: ``heartbeat_s`` or ``poll_s`` is not positive.
    """

    _active: Optional["StepProgress"] = None

    def __init__(self, heartbeat_s: float = 20.0, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = 1.0) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s={heartbeat_s}: must be > 0")
        if poll_s <= 0:
            raise ValueError(f"poll_s={poll_s}: must be > 0")
        self.heartbeat_s = heartbeat_s
        self.poll_s = min(poll_s, heartbeat_s)
        self._clock = clock
        self._step: Optional[tuple[int, float]] = None   # (step, start) while a step runs
        self._beats: tuple[float, int] = (0.0, 0)         # (start of the step, its heartbeat lines so far)
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
        self._step = (step, self._clock())
        self._open = []

    def end_step(self) -> None:
        """Mark the end of the current step (no heartbeat until the next one begins)."""
        self._step = None

    def enter(self, name: str) -> None:
        """A region opened (called by :func:`sftprof.capture.regions.region`)."""
        self._open = self._open + [(name, self._clock())]

    def exit(self, name: str) -> None:
        """A region closed: log ``step N | <name> done in 412 ms (step at 1.23 s)`` unless it is the whole step."""
        now = self._clock()
        start = next((t for n, t in reversed(self._open) if n == name), None)
        self._open = [(n, t) for n, t in self._open if n != name]
        if start is None or self._step is None or name == STEP:
            return
        step, step_start = self._step
        log.info("step %d | %s done in %s (step at %s)", step, name, duration_text(now - start),
                 duration_text(now - step_start))

    def heartbeat_line(self) -> Optional[str]:
        """``step N | still running after X s; in <innermost region> for Y s``, or None between steps."""
        current, open_regions = self._step, self._open
        if current is None:
            return None
        step, step_start = current
        now = self._clock()
        inner = next((r for r in reversed(open_regions) if r[0] != STEP), None)
        where = f"; in {inner[0]} for {now - inner[1]:.0f} s" if inner else ""
        return f"step {step} | still running after {now - step_start:.0f} s{where}"

    def due_heartbeat(self) -> Optional[str]:
        """:meth:`heartbeat_line` when the current step has run another ``heartbeat_s`` seconds since its last
        heartbeat (the k-th once it has run ``k * heartbeat_s`` s; one line however late the look), else None."""
        current = self._step
        if current is None:
            return None
        start, beats = self._beats
        beats = beats if start == current[1] else 0   # a new step: no line yet
        ran = self._clock() - current[1]
        if ran < (beats + 1) * self.heartbeat_s:
            return None
        self._beats = (current[1], int(ran // self.heartbeat_s))
        return self.heartbeat_line()

    def _beat(self) -> None:
        while not self._stop.wait(self.poll_s):
            line = self.due_heartbeat()
            if line is not None:
                log.info("%s", line)


class RankProgress:
    """One rank's last progress, rewritten into ``path`` (:func:`sftprof.artifacts.write_progress`) each time the rank
    begins or ends a region (:func:`sftprof.capture.regions.region`) or a trainer stage (:meth:`mark`), while it is
    the active one (:meth:`start` to :meth:`stop`). A record that cannot be written is logged once and the trial goes
    on (the watchdog then sees no progress from this rank)."""

    _active: Optional["RankProgress"] = None

    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, rank
        self.step: Optional[int] = None
        self.seq = 0
        self._failed = False

    def start(self, phase: str) -> None:
        """Become the active recorder and record ``phase``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        RankProgress._active = self
        self.mark(phase)

    def stop(self, phase: str) -> None:
        """Record ``phase`` (``finished``) and stop recording."""
        self.mark(phase)
        if RankProgress._active is self:
            RankProgress._active = None

    def mark(self, phase: str, step: Optional[int] = None) -> None:
        """Record ``phase`` (of trainer step ``step`` when given, else of the current one)."""
        self.step = self.step if step is None else step
        try:
            write_progress(self.path, self.rank, self.step, phase, self.seq)
            self.seq += 1
        except OSError as exc:
            if not self._failed:
                log.warning("rank %d: progress record %s not written (%s); the watchdog cannot see this rank's "
                            "progress", self.rank, self.path, exc)
            self._failed = True
