"""The launcher's watchdog: a rank that stops making progress ends its trial, named.

Each rank rewrites ``LOG_DIR/progress/rank<r>.json`` when it begins or ends a phase
(:class:`sftprof.progress.RankProgress`). While a
trial's torchrun runs, :class:`Watchdog` looks at this node's ranks' records every :data:`POLL_S` seconds; once a
rank's record has not changed for ``STALL_TIMEOUT`` seconds (default
:data:`sftprof.launch.variables.DEFAULT_STALL_TIMEOUT_S`; 0: no watchdog) the trial has stalled. The ranks that wait
for the stalled one in a collective stop too, but at or past its place: the rank with the least progress (no record at
all, else the smallest ``seq``; of equals, the record unchanged longest) is the one named. Two ranks stopped in the
same phase cannot be told apart this way (then the longest unchanged is named, and the record lists both). The
launcher then writes ``LOG_DIR/stall.json`` (:func:`write_stall`: the rank, its phase and step, how long it went
without progress, every rank's last record), ends the trial (SIGTERM to torchrun's process group) and postprocesses
it; the summary's Failure section names the rank (:func:`sftprof.analysis.trial.failure.first_failure`). Times are the
launcher's clock (``time.monotonic``) at which a record was seen to change, so a rank's clock does not matter.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from sftprof import artifacts

__all__ = ["POLL_S", "Watchdog", "stall_message", "write_stall"]

POLL_S = 5.0  # seconds between two looks at the progress records


class Watchdog:
    """Stall detection over the progress records of ``ranks`` in ``log_dir`` (module docstring).

    Args:
        log_dir: the trial's LOG_DIR.
        ranks: the global ranks of this node.
        limit_s: seconds without a changed record that make a rank stalled (> 0).
        clock: the time source in seconds (``time.monotonic``; tests pass their own).
    """

    def __init__(self, log_dir: Path, ranks: list[int], limit_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log_dir, self.ranks, self.limit_s, self._clock = Path(log_dir), list(ranks), limit_s, clock
        start = clock()
        self._seen: dict[int, tuple[dict[str, Any] | None, float]] = {r: (None, start) for r in self.ranks}

    def check(self) -> dict[str, Any] | None:
        """Look at the records once: None while no rank has gone ``limit_s`` without progress, else the stall:
        ``{"rank", "step" (None before the first step), "phase" (None: the rank wrote no record), "seq" (-1: no
        record), "idle_s", "limit_s", "ranks": [{"rank", "step", "phase", "seq", "idle_s"}, ...]}`` (every rank of the
        node, least progress first). A rank whose record says ``finished`` or ``failed`` has ended and is never the
        stalled one."""
        now = self._clock()
        for r in self.ranks:
            rec = artifacts.read_progress(artifacts.progress_path(self.log_dir, r))
            last, since = self._seen[r]
            if rec is not None and (last is None or rec != last):
                self._seen[r] = (rec, now)
        rows = sorted(({"rank": r, "step": (rec or {}).get("step"), "phase": (rec or {}).get("phase"),
                        "seq": (rec or {}).get("seq", -1), "idle_s": round(now - since, 1)}
                       for r, (rec, since) in self._seen.items()),
                      key=lambda x: (x["seq"] if isinstance(x["seq"], int) else -1, -x["idle_s"], x["rank"]))
        live = [x for x in rows if x["phase"] not in ("finished", "failed")]
        if not live or max(x["idle_s"] for x in live) < self.limit_s:
            return None
        return {**live[0], "limit_s": self.limit_s, "ranks": rows}


def _detail(stall: dict[str, Any]) -> str:
    return (f"no progress for {stall['idle_s']:.0f} s (STALL_TIMEOUT={stall['limit_s']:g} s); the watchdog ended "
            "the trial")


def stall_message(stall: dict[str, Any]) -> str:
    """One line naming the stalled rank, its phase and step, and the limit (``STALL_TIMEOUT``)."""
    where = (f"in phase '{stall['phase']}'" if stall["phase"] is not None else "before writing any progress record")
    step = f" of step {stall['step']}" if stall.get("step") is not None else ""
    return f"rank {stall['rank']} stopped making progress {where}{step}: {_detail(stall)}"


def write_stall(log_dir: Path, stall: dict[str, Any]) -> Path:
    """Write the stall (:meth:`Watchdog.check`) to ``LOG_DIR/stall.json`` with its ``message``
    (:func:`stall_message`) and ``detail`` (the message less the rank, phase and step); returns the path."""
    path = Path(log_dir) / artifacts.STALL_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**stall, "message": stall_message(stall), "detail": _detail(stall)}, indent=1) + "\n")
    return path
