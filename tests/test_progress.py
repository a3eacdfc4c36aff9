"""Rank-0 progress lines: a line per finished phase and a heartbeat naming the open region."""
import logging
import re

import pytest

from sftprof.capture.regions import STEP, backward, forward, region
from sftprof.progress import StepProgress


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
    assert re.fullmatch(r"step 3 \| sftprof/forward/mb0 done in \d+\.\d s \(step at \d+\.\d s\)", lines[0])
    assert lines[1].startswith("step 3 | sftprof/backward/mb0 done in ")
    assert StepProgress._active is None
    with region(forward(1)):  # no active reporter: no lines
        pass
    assert len(caplog.records) == 2


def test_heartbeat_interval_must_be_positive():
    with pytest.raises(ValueError, match="heartbeat_s=0: must be > 0"):
        StepProgress(heartbeat_s=0)
