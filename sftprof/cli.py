"""What the command-line entry points share: a quiet exit when the reader of their output goes away.

``postprocess_profile.py compare A B | head -3`` closes the pipe after three lines; the next write to it raises
``BrokenPipeError``, which Python would print as a traceback (and again, as "Exception ignored", when it flushes
standard output at exit). :func:`run_main` follows Python's documented recipe (the ``signal`` module's note on
SIGPIPE): catch it at the entry point, point standard output (and error) at ``/dev/null`` so that nothing else
can raise, and exit with the status a shell gives a command stopped by a closed pipe.

With ``stop_signals``, SIGTERM and SIGHUP (a terminal closed) end ``main`` as an exception does, with the status a
shell gives a command stopped by the signal (143, 129): ``finally`` blocks, ``atexit`` and ``weakref.finalize`` run,
so the temporary files of ``postprocess_profile.py`` (:mod:`sftprof.analysis.trace.op_store`) go with it; the default
action of either signal ends the process at once and left them behind. SIGINT (Ctrl-C) does so already
(``KeyboardInterrupt``); with ``stop_signals`` it ends with one line and status 130 instead of a traceback. The launcher handles its signals itself (:mod:`sftprof.launch.signals`).

The trainer (``train_sft_profile.py``, one process per rank) logs to standard output through ``logging``, which
does not raise but printed a "--- Logging error ---" traceback for every record once the pipe was closed
(``torchrun ... | head``); its :class:`PipeSafeStreamHandler` drops them quietly instead and the step goes on (its
records still reach ``trainer.log``).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType
from typing import Callable, NoReturn, Optional, TextIO

__all__ = ["run_main", "PipeSafeStreamHandler", "BROKEN_PIPE_STATUS", "INTERRUPT_STATUS", "STOP_SIGNALS", "to_devnull"]

BROKEN_PIPE_STATUS = 141  # 128 + SIGPIPE (13): what a shell reports for a command stopped by a closed pipe
INTERRUPT_STATUS = 130  # 128 + SIGINT (2): a command stopped by Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # made an exit by run_main(stop_signals=True)


def _stop(signum: int, frame: FrameType | None) -> None:
    """Exit with 128 + ``signum``; later signals are ignored, so that the cleanups this starts run whole."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def run_main(main: Callable[[], Optional[int]], *, stop_signals: bool = False) -> NoReturn:
    """Exit with ``main()``'s status (None counts as 0; a ``SystemExit`` it raises, such as argparse's exit 2,
    passes through), or quietly with :data:`BROKEN_PIPE_STATUS` when standard output or error is a pipe whose
    reader has closed it; ``stop_signals``: with 128 + the signal on one of :data:`STOP_SIGNALS`, after the
    cleanups of a normal exit (module docstring; worker processes forked later inherit the handler); a signal
    ignored on entry (``nohup``) stays ignored.

    What ``main`` wrote to files before the pipe broke is kept; what it had still to print is dropped (no
    traceback, no message).
    """
    if stop_signals:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored on entry (nohup, a parent's choice): it stays so
                signal.signal(sig, _stop)
    try:
        code = main()
        sys.stdout.flush()  # a pipe closed after main's last print breaks here, inside the try, not at exit
    except BrokenPipeError:
        to_devnull(sys.stdout, sys.stderr)  # the interpreter flushes both at exit: neither may raise again
        code = BROKEN_PIPE_STATUS
    except KeyboardInterrupt:
        if not stop_signals:
            raise
        print(f"{os.path.basename(sys.argv[0])}: interrupted (Ctrl-C); the files written before it are kept",
              file=sys.stderr)
        code = INTERRUPT_STATUS
    sys.exit(code)


class PipeSafeStreamHandler(logging.StreamHandler):
    """A ``logging.StreamHandler`` whose stream may be a pipe its reader closes: from the first write that finds it
    closed on, its records are dropped quietly (the stream points at ``/dev/null``) instead of a "--- Logging
    error ---" traceback each; the process goes on, and other handlers still get every record."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            to_devnull(self.stream)
            return
        super().handleError(record)


def to_devnull(*streams: TextIO) -> None:
    """Point the file descriptors of ``streams`` at ``/dev/null``: what is still buffered or written later goes
    nowhere, without an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in streams:
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError, AttributeError):  # a replaced or closed stream: nothing to write to it
                pass
    finally:
        os.close(devnull)
