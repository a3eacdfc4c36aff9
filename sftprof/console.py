"""What a trial's console shows: third-party messages that say nothing to the user are kept off it, written to
``trainer.log`` (rank 0) and counted there.

Two kinds: Python warnings raised outside sftprof (transformers' ``FutureWarning`` that
``gradient_checkpointing_enable`` is deprecated, torch's profiler ``UserWarning``\\ s), routed through
:func:`capture_warnings`; and the profiler's native ``USDT: ... profiler_start`` / ``profiler_stop`` lines that
Kineto writes to the process's standard error around each profiler start and stop, held back by
:func:`native_stderr_filtered` (any other native line is passed on unchanged). Warnings raised in sftprof's own
code still reach the console. The trainer logs the count at the end of the trial (:func:`summary_line`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

# Records of this logger go to trainer.log only: the console handler drops them (ConsoleFilter).
THIRD_PARTY = logging.getLogger("sftprof.third_party")
PACKAGE_DIR = str(Path(__file__).resolve().parent)
# Kineto's USDT-level log lines (its marks for tracing tools): "USDT:<date> <pid>:<tid> <file>:<line>] profiler_start"
NATIVE_NOISE = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")
_kept_off = 0


class ConsoleFilter(logging.Filter):
    """For the console handler: drops the records of :data:`THIRD_PARTY`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(THIRD_PARTY.name)


def _keep_off(text: str) -> None:
    global _kept_off
    _kept_off += 1
    THIRD_PARTY.info("%s", text)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    if os.path.abspath(filename).startswith(PACKAGE_DIR + os.sep):
        logging.getLogger("sftprof").warning("%s", text)
    else:
        _keep_off(text)


def capture_warnings() -> None:
    """Route Python warnings: sftprof's own to the ``sftprof`` logger (console and file), everyone else's to
    :data:`THIRD_PARTY` (file only, counted)."""
    warnings.showwarning = _show_warning


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Hold back the lines native code writes to file descriptor 2 inside the block: those of
    :data:`NATIVE_NOISE` go to :data:`THIRD_PARTY` (counted), every other line is written to the real standard error
    when the block ends, in order. For short calls only (a profiler's start or stop): what a process killed inside
    the block wrote there is lost."""
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for raw in held.read().splitlines(keepends=True):
                text = raw.decode(errors="replace").rstrip("\n")
                if NATIVE_NOISE.match(text):
                    _keep_off(text)
                else:
                    os.write(2, raw)


def kept_off() -> int:
    """How many third-party messages this process kept off the console."""
    return _kept_off


def summary_line() -> str | None:
    """The line the trainer logs at the end (file only), None when nothing was kept off."""
    if not _kept_off:
        return None
    return (f"{_kept_off} third-party message(s) (warnings of other packages, Kineto's USDT lines) were kept off the "
            "console; they are above in this log")
