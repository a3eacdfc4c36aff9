"""How the launcher takes SIGINT (Ctrl-C), SIGTERM, SIGHUP (its terminal closed) and SIGPIPE (the reader of its
output went away: ``... | head``): each stops the whole run, in one of two ways. (A SIGHUP used to kill the
launcher, and a closed pipe to end it in a ``BrokenPipeError``, leaving torchrun, in its own process group, and its
workers running.) Output to a console that is gone (a closed pipe, a hung-up terminal) is dropped from then on
(:func:`say`, the launcher's ``Console``); the trials' logs and the run's summary are written as after SIGTERM.

- While it plans, a signal raises :class:`PlanInterrupted` wherever the plan is (:func:`plan_handlers`); the
  launcher removes what the plan wrote (:func:`sftprof.launch.folders.remove_plan`), says so in one line and exits
  128 + the signal. Blocks that must run whole (a probe folder made and removed, the plan's files written) hold
  the signals (:func:`signals_held`): one that arrives inside is delivered when the block ends.
- While trials run, a signal is recorded (:class:`RunStop`) and handed on: the running torchrun (in its own process
  group, so that a terminal's Ctrl-C reaches the launcher alone) gets SIGTERM, stops its workers and exits; the
  trial is recorded as interrupted and the trials after it as not run. A second signal kills torchrun's group and
  its workers (SIGKILL). Postprocessing runs in the launcher's process group: a Ctrl-C of the terminal stops it
  too, a signal to the launcher alone lets it finish.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Callable, Iterator

from sftprof.cli import to_devnull

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)


class PlanInterrupted(BaseException):
    """One of :data:`SIGNALS` arrived while the launcher planned (``signum``: its number). A BaseException, as
    KeyboardInterrupt, so that no ``except Exception`` of the plan takes it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold :data:`SIGNALS` for the ``with`` block: one that arrives inside is delivered when the block ends, so
    the block runs whole (what it creates is all made and recorded, or not begun)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _on_plan_signal(signum: int, frame: FrameType | None) -> None:
    for sig in SIGNALS:  # once: removing what the plan wrote is not interrupted by a second signal
        signal.signal(sig, signal.SIG_IGN)
    raise PlanInterrupted(signum)


def plan_handlers() -> None:
    """From now on one of :data:`SIGNALS` raises :class:`PlanInterrupted` (the first thing the launcher does)."""
    for sig in SIGNALS:
        signal.signal(sig, _on_plan_signal)


@dataclass
class RunStop:
    """The signal that stopped the run (None: none yet) and what the launcher does on one.

    ``on_first(signum)`` runs at the first signal (say so, mute the children's output on the console, SIGTERM the
    running torchrun), ``on_again(signum)`` at each later one (kill torchrun and its workers).
    """

    on_first: Callable[[int], None]
    on_again: Callable[[int], None]
    signum: int | None = None

    @property
    def status(self) -> int:
        """The exit status of a stopped run: 128 + the signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP, 141 SIGPIPE)."""
        return 128 + (self.signum or 0)

    def stopped(self, signum: int, *, by_driver: bool = True) -> None:
        """Record ``signum`` as what stops the run (``by_driver`` False: a child got it, not the launcher)."""
        if self.signum is None:
            self.signum = signum
            if by_driver:
                self.on_first(signum)
        elif by_driver:
            self.on_again(signum)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.stopped(signum)

    def install(self) -> None:
        """Handle :data:`SIGNALS` from now on (also a SIGINT ignored on entry, as by a script's ``&``: a Ctrl-C of
        the terminal stops the run, as it always did)."""
        for sig in SIGNALS:
            signal.signal(sig, self.handle)


def ignore_signals() -> None:
    """The run's end (not-run rows, the end table) is written in any case: no signal interrupts it."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def name(signum: int) -> str:
    """``SIGINT`` for 2, ``signal 77`` for a number that names none."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def say(line: str) -> None:
    """One line to stderr, prefixed ``sftprof: `` (flushed: it may come from a signal handler); once stderr is gone
    (a closed pipe, a hung-up terminal) it points at ``/dev/null`` and the line is dropped."""
    try:
        sys.stderr.write(f"sftprof: {line}\n")
        sys.stderr.flush()
    except OSError:
        to_devnull(sys.stderr)


def kill_group(pid: int, sig: int) -> None:
    """``sig`` to process group ``pid`` (a child started as a group leader); gone already: nothing to do."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
