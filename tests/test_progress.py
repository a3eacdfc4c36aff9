"""Rank-0 progress lines: a line per finished phase and a heartbeat naming the open region."""
import logging
import re

import pytest

from sftprof.capture.regions import STEP, backward, forward, region
from sftprof.progress import StepProgress, duration_text


def test_phase_lines_and_heartbeat(caplog):
    progress = StepProgress(heartbeat_s=3600)  # the thread stays quiet; lines are asked for directly
    assert progress.heartbeat_line() is None
    with caplog.at_level(logging.INFO, logger="sftprof"):
        progress.start()
        try:
            progress.begin_step(3)
            with region(STEP):
                with region(forward(0)):
                    beat = progress.heartbeat_line()
                with region(backward(0)):
                    pass
            progress.end_step()
            assert progress.heartbeat_line() is None
        finally:
            progress.stop()
    assert re.fullmatch(r"step 3 \| still running after \d+ s; in sftprof/forward/mb0 for \d+ s", beat)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    duration = r"(\d+ ms|\d+\.\d+ ms|\d\.\d\d s|\d\d\.\d s|\d+ s)"   # 3 significant digits, ms below a second
    assert re.fullmatch(rf"step 3 \| sftprof/forward/mb0 done in {duration} \(step at {duration}\)", lines[0])
    assert lines[1].startswith("step 3 | sftprof/backward/mb0 done in ")
    assert StepProgress._active is None
    with region(forward(1)):  # no active reporter: no lines
        pass
    assert len(caplog.records) == 2


def test_durations_carry_three_significant_digits():
    """Console durations: seconds from 1 s, milliseconds below, 3 significant digits (whole seconds from 100 s)."""
    assert [duration_text(s) for s in (17.345, 9.999, 1.0, 0.4123, 0.0041234, 123.4, 1234.5, 0.0)] == [
        "17.3 s", "10.0 s", "1.00 s", "412 ms", "4.12 ms", "123 s", "1234 s", "0 ms"]


def test_heartbeat_interval_must_be_positive():
    with pytest.raises(ValueError, match="heartbeat_s=0: must be > 0"):
        StepProgress(heartbeat_s=0)


class _Clock:
    """A hand-moved clock (seconds) for StepProgress, so no test waits on the wall clock."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_heartbeat_every_interval_of_a_long_step_and_none_in_short_steps():
    clock = _Clock()
    progress = StepProgress(heartbeat_s=20, clock=clock)  # never started: the lines are asked for directly
    assert progress.poll_s == 1.0
    progress.begin_step(0)
    clock.t += 15
    assert progress.due_heartbeat() is None      # a 15 s step: no heartbeat
    progress.end_step()
    clock.t += 10
    assert progress.due_heartbeat() is None      # between steps
    progress.begin_step(1)
    beats = []
    for dt in (5, 3, 8, 3.5, 0.5, 1, 18, 2, 30, 1):   # 4 looks at 5, 8, 16, 19.5 s: too early
        clock.t += dt
        if dt == 18:
            progress.enter(forward(0))   # a region opened at 39 s
        beats.append(progress.due_heartbeat())
    progress.end_step()
    assert beats == [None, None, None, None,
                     "step 1 | still running after 20 s",                                      # 20 s
                     None,                                                                     # 21 s
                     None,                                                                     # 39 s
                     "step 1 | still running after 41 s; in sftprof/forward/mb0 for 2 s",      # 41 s
                     "step 1 | still running after 71 s; in sftprof/forward/mb0 for 32 s",     # 71 s: one line for 60
                     None]                                                                     # 72 s
    progress.begin_step(2)   # a new step counts from its own start
    clock.t += 19
    assert progress.due_heartbeat() is None
    clock.t += 1
    assert progress.due_heartbeat() == "step 2 | still running after 20 s"


def test_heartbeat_poll_is_at_most_the_interval():
    assert StepProgress(heartbeat_s=0.5).poll_s == 0.5
    with pytest.raises(ValueError, match="poll_s=0: must be > 0"):
        StepProgress(poll_s=0)
