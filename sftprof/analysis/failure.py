"""Which rank of a failed trial died first, and how, from torchrun's failure report.

When a worker fails, ``torch.distributed.run`` (torchrun) stops the others with SIGTERM and prints
a ``ChildFailedError`` report into the launcher log (the driver tees torchrun's output into
``RUN_DIR/launcher.log``)::

    Failures:
    [1]:
      ...
      rank      : 0 (local_rank: 0)
      exitcode  : -15 (pid: 7898)  (SIGTERM)
      error_file: <N/A>
      traceback : Signal 15 (SIGTERM) received by PID 7898
    ------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 7899)  (SIGKILL)
      ...

(format: ``_FAILURE_FORMAT_TEMPLATE`` in ``torch/distributed/elastic/multiprocessing/errors``;
``tests/fixtures/torchrun_sigkill_launcher.log`` is a real one). torchrun orders failures by the
time it observed them, and ranks it stopped itself show up as SIGTERM; so the first failing rank is
torchrun's root cause unless that is a SIGTERM while another rank failed otherwise. The rank's own
log lines are those of the trainer's ``[rank N]`` log prefix (``sftprof/trainer.py``).
"""
from __future__ import annotations

import json
import os
import re
import signal
from typing import Any

__all__ = ["first_failure", "parse_torchrun_failures"]

_ENTRY = re.compile(r"^\[(\d+)\]:\s*$")
_FIELD = re.compile(r"^  (time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")
_RANK = re.compile(r"^(\d+)")
_EXITCODE = re.compile(r"^(-?\d+)")
_TAIL_LINES = 20
# torchrun's traceback field when the rank wrote no error file: a pointer to its docs, not the error
_NO_ERROR_FILE = "To enable traceback see:"
# the trainer's log line when a trial fails (sftprof/trainer.py): "... [rank N] ERROR trial failed after K completed
# step(s): SomeError: message"
_TRAINER_ERROR = re.compile(r"trial failed after \d+ completed step\(s\): (.+)$")


def _signal_name(code: int) -> str | None:
    try:
        return signal.Signals(-code).name if code < 0 else None
    except ValueError:
        return None


def parse_torchrun_failures(lines: list[str]) -> list[dict[str, Any]]:
    """Failures of torchrun's last ``ChildFailedError`` report in ``lines``, root cause first.

    Returns:
        ``[{"rank", "local_rank" (ints or None), "exitcode" (int or None), "signal" ("SIGKILL" or None),
        "host", "time", "error_file" (None for ``<N/A>``), "traceback" (str), "root_cause" (bool)}]``;
        empty when the log holds no report.
    """
    start = max((i for i, line in enumerate(lines) if line.startswith("Failures:")), default=None)
    if start is None:
        return []
    out: list[dict[str, Any]] = []
    root = False
    current: dict[str, Any] | None = None
    for line in lines[start + 1:]:
        line = line.rstrip("\n")
        if line.startswith("Root Cause"):
            root = True
            continue
        m = _ENTRY.match(line)
        if m:
            current = {"root_cause": root, "traceback": ""}
            out.append(current)
            continue
        if current is None:
            continue
        f = _FIELD.match(line)
        if f:
            key, value = f.groups()
            current[key] = value.strip()
        elif line.startswith(("---", "===")):
            current = None
        elif current.get("traceback") is not None and line.strip():
            current["traceback"] += "\n" + line.strip()  # a multi-line traceback from an error file
    result = []
    for f in out:
        rank = _RANK.match(f.get("rank", ""))
        local = re.search(r"local_rank:\s*(\d+)", f.get("rank", ""))
        code = _EXITCODE.match(f.get("exitcode", ""))
        exitcode = int(code.group(1)) if code else None
        result.append({"rank": int(rank.group(1)) if rank else None,
                       "local_rank": int(local.group(1)) if local else None,
                       "exitcode": exitcode, "signal": _signal_name(exitcode) if exitcode is not None else None,
                       "host": f.get("host"), "time": f.get("time"),
                       "error_file": None if f.get("error_file") in (None, "<N/A>") else f["error_file"],
                       "traceback": f.get("traceback", "").strip(), "root_cause": f["root_cause"]})
    return sorted(result, key=lambda f: not f["root_cause"])


def _stopped_by_torchrun(f: dict) -> bool:
    return f["signal"] == "SIGTERM" or "SIGTERM" in f["traceback"]


def _error_file_message(path: str | None) -> str | None:
    """The message of a torchrun error file (``{"message": {"message": ...}}`` or ``{"message": str}``)."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            msg = json.load(fh).get("message")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(msg, dict):
        msg = msg.get("message")
    return msg if isinstance(msg, str) else None


def first_failure(launcher_log: str) -> dict[str, Any] | None:
    """The first failing rank of a trial, how it ended, its log tail, and the other ranks' ends.

    Args:
        launcher_log: the trial's ``launcher.log`` (torchrun's output as the driver tees it).

    Returns:
        None when the log is absent or holds no torchrun failure report, else ``{"rank", "exitcode",
        "signal", "how" (e.g. ``"killed by SIGKILL (exit code -9)"``), "host", "error_file",
        "traceback" (torchrun's; where it is only torchrun's pointer to its docs, the rank wrote no error file,
        the error the trainer logged for that rank), "log_tail" (the rank's last ``[rank N]`` lines, or its
        error file's message),
        "others": [{"rank", "exitcode", "signal", "how"}]}``.
    """
    if not os.path.isfile(launcher_log):
        return None
    with open(launcher_log, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()
    failures = parse_torchrun_failures(lines)
    if not failures:
        return None
    own = [f for f in failures if not _stopped_by_torchrun(f)]
    first = own[0] if own else failures[0]
    for f in failures:
        code, sig = f["exitcode"], f["signal"]
        f["how"] = (f"killed by {sig} (exit code {code})" if sig else
                    f"exit code {code}" if code is not None else "unknown")
    prefix = f"[rank {first['rank']}]"
    tail = [line for line in lines if prefix in line][-_TAIL_LINES:]
    message = _error_file_message(first["error_file"])
    if message:
        tail += message.splitlines()[-_TAIL_LINES:]
    keep = ("rank", "exitcode", "signal", "how", "host", "error_file", "traceback")
    out = {k: first[k] for k in keep}
    if not message and out["traceback"].startswith(_NO_ERROR_FILE):  # no error file: the error the trainer logged
        found = [m.group(1) for m in map(_TRAINER_ERROR.search, tail) if m]
        out["traceback"] = found[-1] if found else out["traceback"]
    return {**out, "log_tail": tail,
            "others": [{k: f[k] for k in ("rank", "exitcode", "signal", "how")} for f in failures if f is not first]}
