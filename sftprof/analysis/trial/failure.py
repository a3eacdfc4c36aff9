"""Which rank (or node) of a failed trial failed first, and how, from torchrun's failure report and the node records.

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

A multi-node trial also has one end record per node (``LOG_DIR/nodes/node<k>.json``, written by each node's
launcher: :func:`sftprof.launch.nodes.write_node_record`). A node that wrote none never joined the trial (node 0's
torchrun then reports its static rendezvous timing out: ``Timed out after N seconds waiting for clients.
1/2 clients joined.``) or died before its driver could write it; either way its ranks are the root cause,
so such a node is the first failure, ahead of node 0's torchrun report (whose ranks lost their peers). So is a
node whose torchrun was killed outright (SIGKILL: it printed no report): its record names the signal and the
ranks whose workers the launcher found still running and stopped (a one-node trial has a record only then).
"""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from sftprof import artifacts
from sftprof.analysis.trial.schema import FailedRank, Failure, NodeFailure, TrialRecord

__all__ = ["TorchrunFailure", "config_errors", "failure_cause", "first_failure", "headline", "node_failures",
           "parse_torchrun_failures", "traceback_errors"]

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
# the trainer refusing its configuration (sftprof/trainer.py ``_exit_config_error``, sftprof/config/loading.py
# ``load_config_or_exit``): printed to stderr before the ``[rank N]`` logging exists, so without a rank prefix (every
# rank reads the same config and prints the same line), then exit status 2
_CONFIG_ERROR_MARK = "sftprof: configuration error: "
_CONFIG_ERROR_EXIT = 2
# A Python traceback in the launcher log (a worker's uncaught exception on stderr, or torchrun's own): it starts with
# _TRACEBACK, its frames are indented, and its exception line is a (dotted) exception class name, then ": message"
_TRACEBACK = "Traceback (most recent call last):"
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?::.*)?$")
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")
# a frame of torchrun itself (torch/distributed/run.py): the traceback is torchrun's, not a worker's
_TORCHRUN_FRAME = re.compile(r"""^\s*File ".*torch[/\\]distributed[/\\]run\.py", line""")
_TORCHRUN_REPORT_ERROR = "ChildFailedError"  # the exception torchrun raises to print its failure report
# what the Failure section says where torchrun's field is only its docs pointer and no error text was found
NO_ERROR_TEXT = ("no error text found: the rank wrote no torchrun error file and left no traceback, `trial failed` or "
                 "configuration error line in launcher.log (or rank 0's trainer.log)")
# torchrun's static rendezvous giving up on node 0 (torch.distributed's TCPStore: one client per node)
_RDZV_TIMEOUT = re.compile(r"Timed out after \d+ seconds waiting for clients\. (\d+)/(\d+) clients joined")


class TorchrunFailure(TypedDict):
    """One failure of torchrun's report (:func:`parse_torchrun_failures`); ``how`` is added by :func:`first_failure`."""
    rank: int | None
    local_rank: int | None
    exitcode: int | None
    signal: str | None  # "SIGKILL"; None: no signal
    host: str | None
    time: str | None
    error_file: str | None  # None for ``<N/A>``
    traceback: str
    root_cause: bool
    how: NotRequired[str]


def _signal_name(code: int) -> str | None:
    try:
        return signal.Signals(-code).name if code < 0 else None
    except ValueError:
        return None


def _report_start(lines: list[str]) -> int:
    """The index of the ``Failures:`` line of torchrun's last failure report in ``lines``; ``len(lines)`` if none."""
    return max((i for i, line in enumerate(lines) if line.startswith("Failures:")), default=len(lines))


def parse_torchrun_failures(lines: list[str]) -> list[TorchrunFailure]:
    """Failures of torchrun's last ``ChildFailedError`` report in ``lines``, root cause first.

    Returns:
        ``[{"rank", "local_rank" (ints or None), "exitcode" (int or None), "signal" ("SIGKILL" or None),
        "host", "time", "error_file" (None for ``<N/A>``), "traceback" (str), "root_cause" (bool)}]``;
        empty when the log holds no report.
    """
    start = _report_start(lines)
    if start == len(lines):
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
        field = _FIELD.match(line)
        if field:
            key, value = field.groups()
            current[key] = value.strip()
        elif line.startswith(("---", "===")):
            current = None
        elif current.get("traceback") is not None and line.strip():
            current["traceback"] += "\n" + line.strip()  # a multi-line traceback from an error file
    result: list[TorchrunFailure] = []
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


def config_errors(lines: list[str]) -> list[str]:
    """The trainer's ``sftprof: configuration error: ...`` messages in ``lines``, in order, one per message even where
    two ranks' messages share a line (written as text then newline, one rank's text could land before another's
    newline: ``...family)sftprof: configuration error: ...``)."""
    out: list[str] = []
    for line in lines:
        if _CONFIG_ERROR_MARK in line:
            out += [p.strip() for p in line.split(_CONFIG_ERROR_MARK)[1:] if p.strip()]
    return [_CONFIG_ERROR_MARK + p for p in out]


def traceback_errors(lines: list[str]) -> list[tuple[str, bool]]:
    """The error of each Python traceback in ``lines``: ``[(exception line, torchrun's own)]`` in order.

    A chain of tracebacks (``During handling of the above exception, ...``) counts once, with its last exception
    line, the one that ended the process. Lines of other processes between a traceback's frames (several ranks
    write to one launcher log) are passed over. A traceback is torchrun's own when a frame is in
    ``torch/distributed/run.py`` (a worker's traceback runs in its own process, under ``train_sft_profile.py``).
    """
    out: list[tuple[str, bool]] = []
    inside, torchrun, chained = False, False, False
    for line in lines:
        text = line.rstrip()
        if text.startswith(_TRACEBACK):
            if not chained:
                torchrun = False
            inside, chained = True, False
            continue
        if text in _CHAINED and out:
            out.pop()  # the chain goes on: its last exception ends it
            chained = True
            continue
        if not inside:
            continue
        if _TORCHRUN_FRAME.match(text):
            torchrun = True
        elif _EXCEPTION_LINE.match(text):
            out.append((text, torchrun))
            inside = False
    return out


def _rank_error(first: TorchrunFailure, lines: list[str], report: int, tail: list[str], log_dir: str | None) -> str:
    """The error to quote for ``first``, whose torchrun traceback field is only torchrun's docs pointer (the rank
    wrote no error file): the error the trainer logged for that rank; for exit status 2, the trainer's configuration
    error; the first worker traceback's exception in the launcher log above torchrun's report (the first failing
    rank fails first: later tracebacks are the others being stopped); for rank 0, the same from ``trainer.log``;
    else :data:`NO_ERROR_TEXT`."""
    found = [m.group(1) for m in map(_TRAINER_ERROR.search, tail) if m]
    if not found and first["exitcode"] == _CONFIG_ERROR_EXIT:  # refused its configuration before logging began
        found = config_errors(lines[:report])[-1:]
    if not found:
        found = [e for e, torchrun in traceback_errors(lines[:report])
                 if not torchrun and _TORCHRUN_REPORT_ERROR not in e][:1]
    trainer_log = os.path.join(log_dir, artifacts.TRAINER_LOG) if log_dir else None
    if not found and first["rank"] == 0 and trainer_log and os.path.isfile(trainer_log):
        with open(trainer_log, encoding="utf-8", errors="replace") as fh:
            own = fh.read().splitlines()
        found = [m.group(1) for m in map(_TRAINER_ERROR.search, own) if m][-1:] or \
            [e for e, _ in traceback_errors(own)][:1]
    return found[-1] if found else NO_ERROR_TEXT


def _torchrun_crash(lines: list[str], nodes: list[NodeFailure], layout: tuple[int | None, int | None],
                    ) -> Failure | None:
    """torchrun's own failure on this node (node 0: its launcher log is the one postprocessed) when it printed no
    failure report: its traceback's exception (``OverflowError: ...`` from a rendezvous timeout it cannot take);
    None when the log holds no traceback of torchrun's."""
    crash = [e for e, torchrun in traceback_errors(lines) if torchrun]
    if not crash:
        return None
    workers = any(re.search(r"\[rank \d+\]", line) for line in lines) or \
        any(not torchrun for _, torchrun in traceback_errors(lines))
    nproc = layout[1]
    return {"node": 0, "ranks": artifacts.node_ranks(0, nproc) if nproc else None, "rank": None, "exitcode": None,
            "signal": None, "how": "failed without a failure report" if workers else
            "failed before any worker logged a line", "host": None, "error_file": None, "traceback": crash[-1],
            "log_tail": [], "others": [], "nodes": [n for n in nodes if n["node"] != 0], "torchrun": True}


def _stopped_by_torchrun(f: TorchrunFailure) -> bool:
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


def _ranks_text(ranks: list[int] | None) -> str:
    if not ranks:
        return "ranks unknown"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def node_failures(log_dir: str | None, launcher_lines: list[str],
                  layout: tuple[int | None, int | None] = (None, None)) -> list[NodeFailure]:
    """The nodes of a multi-node trial that failed, from their end records in ``LOG_DIR/nodes/``.

    Args:
        log_dir: the trial's log dir (None, or no ``nodes/`` folder: a one-node trial, no node fails).
        launcher_lines: node 0's ``launcher.log`` lines (a rendezvous timeout there tells that a node without
            a record never joined).
        layout: ``(n_nodes, nproc_per_node)`` from the trial's config, used where no record carries them
            (records of earlier releases).

    Returns:
        ``[{"node", "ranks" (list of global ranks, None when the layout is unknown), "host" (None when unknown),
        "how" (one phrase: ``never joined the trial``, ``wrote no end record``, ``unreadable end record``,
        ``torchrun killed by <signal> (status <rc>)``, ``torchrun exited with status <rc>``), "detail" (what that
        means and where to look)}]``, nodes without a record first (the root cause), then by node rank. Nodes without a record are known only when a
        record or the config gives ``n_nodes``.
    """
    folder = Path(log_dir) / artifacts.NODES if log_dir else None
    if folder is None or not folder.is_dir():
        return []
    records: dict[int, dict[str, Any]] = {}  # node rank -> its record (artifacts.read_node_record), or its error
    out: list[NodeFailure] = []
    for path in sorted(folder.iterdir()):
        m = artifacts.NODE_RECORD_RE.match(path.name)
        if not m:
            continue
        try:
            records[int(m.group(1))] = artifacts.read_node_record(path)
        except (OSError, ValueError) as err:
            records[int(m.group(1))] = {"error": f"{type(err).__name__}: {err}", "host": None}
    n_nodes, nproc = layout
    for rec in records.values():
        n_nodes, nproc = rec.get("n_nodes") or n_nodes, rec.get("nproc_per_node") or nproc
    joined = [tuple(map(int, m.groups())) for m in map(_RDZV_TIMEOUT.search, launcher_lines) if m]
    for k in range(n_nodes or 0):
        if k in records:
            continue
        rel = str(artifacts.node_record_path("", k))
        if joined:
            how, detail = "never joined the trial", (
                f"torchrun's rendezvous on node 0 timed out with {joined[-1][0]}/{joined[-1][1]} nodes joined "
                f"(NODE_TIMEOUT), and node {k} wrote no end record ({rel})")
        else:
            how, detail = "wrote no end record", (
                f"no {rel} in the log dir: node {k} never started the trial or died before its driver wrote the "
                "record (see that node's launcher.log)")
        out.append({"node": k, "ranks": artifacts.node_ranks(k, nproc) if nproc else None, "host": None,
                    "how": how, "detail": detail})
    for k, rec in sorted(records.items()):
        ranks = artifacts.node_ranks(k, nproc) if nproc else None
        if "error" in rec:
            out.append({"node": k, "ranks": ranks, "host": None, "how": "unreadable end record",
                        "detail": f"{artifacts.node_record_path('', k)}: {rec['error']}"})
        elif rec["torchrun_signal"]:  # torchrun itself killed: it printed no report, its workers may have lived on
            stopped = rec["ranks_stopped"] or []
            died = [r for r in ranks or [] if r not in stopped]
            listed = {True: "rank {}", False: "ranks {}"}
            out.append({"node": k, "ranks": ranks, "host": rec["host"], "how": f"torchrun killed by "
                        f"{rec['torchrun_signal']} (status {rec['torchrun_rc']})", "detail": (
                            "the launcher stopped the workers it left running ("
                            + listed[len(stopped) == 1].format(", ".join(map(str, stopped))) + ")" if stopped
                            else "no worker was left running") + (
                            "; " + listed[len(died) == 1].format(", ".join(map(str, died))) + " had already ended"
                            if stopped and died else "")})
        elif rec["torchrun_rc"] != 0:
            out.append({"node": k, "ranks": ranks, "host": rec["host"], "how": f"torchrun exited with status "
                        f"{rec['torchrun_rc']}", "detail": "see launcher.log in this run dir" if k == 0 else
                        f"see node {k}'s launcher.log (in its RUN_ROOT)"})
    return out


def headline(fail: Failure | NodeFailure) -> str:
    """The first failure of :func:`first_failure` in one line: ``node 1 (rank 1) never joined the trial``,
    ``torchrun on node 0 failed before any worker logged a line`` or ``rank 1 killed by SIGKILL (exit code -9)``."""
    if fail.get("torchrun"):
        return f"torchrun on node {fail['node']} {fail['how']}"
    if fail.get("node") is not None:
        return f"node {fail['node']} ({_ranks_text(fail['ranks'])}) {fail['how']}"
    return f"rank {fail.get('rank')} {fail['how']}"  # a Failure: "rank" is always there


def failure_cause(summary: TrialRecord) -> tuple[str, str] | None:
    """A trial's cause of failure in one line, for the places that name it beside its status (the summary's header,
    compare): ``("first failure", "rank 1 killed by SIGKILL (exit code -9): Signal 9 (SIGKILL) received by PID
    7899")`` from its Failure section (``summary["failure"]``: :func:`headline` and the first line of its error
    text), so a rank that torchrun stopped (its completion record's ``_Terminated: terminated by SIGTERM ...``) is
    never named as the cause; else ``("error", <the completion record's error>)``; None when there is neither. A
    trial the driver interrupted: ``("interrupted", "the driver got SIGINT and stopped its torchrun")``."""
    if summary.get("interrupted"):
        return "interrupted", summary["interrupted"].removeprefix(artifacts.INTERRUPTED_PREFIX)
    fail = summary.get("failure")
    if fail:
        first = ((fail.get("traceback") or "").splitlines() or [""])[0].strip()
        return "first failure", headline(fail) + (f": {first}" if first else "")
    error = (summary.get("completion") or {}).get("error")
    return ("error", error) if error else None


def _stall(log_dir: str | None, lines: list[str]) -> Failure | None:
    """The first failure when the launcher's watchdog ended the trial (``LOG_DIR/stall.json``,
    :mod:`sftprof.launch.watchdog`): the rank that stopped making progress, its phase and step; the others are the
    ranks the record holds, with their last phase. None without a readable record."""
    try:
        with open(os.path.join(log_dir or "", artifacts.STALL_JSON), encoding="utf-8") as f:
            rec = json.load(f)
        rank, detail = int(rec["rank"]), str(rec["detail"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    where = f" in phase '{rec.get('phase')}'" if rec.get("phase") is not None else " before its first progress record"
    step = f" of step {rec['step']}" if rec.get("step") is not None else ""
    others: list[FailedRank] = [{"rank": x.get("rank"), "exitcode": None, "signal": None,
               "how": f"last progress {x.get('phase') or 'none'} ({x.get('idle_s')} s before)"}
              for x in rec.get("ranks") or [] if isinstance(x, dict) and x.get("rank") != rank]
    prefix = f"[rank {rank}]"
    return {"node": None, "ranks": None, "rank": rank, "exitcode": None, "signal": None,
            "how": f"stopped making progress{where}{step}", "host": None, "error_file": None, "traceback": detail,
            "log_tail": [line for line in lines if prefix in line][-_TAIL_LINES:], "others": others, "nodes": []}


def first_failure(launcher_log: str, log_dir: str | None = None,
                  layout: tuple[int | None, int | None] = (None, None), simulated_rank: int = -1,
                  ) -> Failure | None:
    """The first failure of a trial: the rank the launcher's watchdog found stalled (``stall.json``), else a node that
    never joined (or wrote no end record), else torchrun itself when it died without a failure report, else torchrun's
    first failing rank; how it ended, its log tail, and how the other
    ranks and nodes ended.

    Args:
        launcher_log: the trial's ``launcher.log`` (torchrun's output as the driver tees it).
        log_dir: the trial's log dir, whose ``nodes/`` end records name failed nodes (:func:`node_failures`).
        layout: ``(n_nodes, nproc_per_node)`` of the trial's config, where the records lack them.
        simulated_rank: the rank a simulated trial ran (``actor.simulate.rank``; torchrun calls its one process
            rank 0), -1 for a trial of every rank.

    Returns:
        None when no node failed and the log is absent or holds neither a torchrun failure report nor a traceback
        of torchrun's own, else ``{"node" (the failed node when the first failure is a node's or its torchrun's,
        else None), "ranks" (that node's global ranks), "rank", "exitcode", "signal", "how" (e.g. ``"killed by
        SIGKILL (exit code -9)"``, ``"never joined the trial"``, or for torchrun ``"failed before any worker logged
        a line"``), "host", "error_file", "traceback" (torchrun's; never its pointer to its docs, which it prints
        where the rank wrote no error file: then the error the trainer logged for that rank, or, for a rank that
        exited with status 2 before its log began, the trainer's ``sftprof: configuration error: ...`` message
        (the last one above torchrun's report; every rank prints the same), or the exception line of the first
        worker traceback above the report (an uncaught error before the trainer's logging began), or rank 0's
        ``trainer.log``'s, else :data:`NO_ERROR_TEXT`; for torchrun's own failure, its exception line; for a node,
        what its failure means), "log_tail" (the rank's last ``[rank N]`` lines, or its error file's message;
        empty for a node), "others": [{"rank", "exitcode", "signal", "how"}] (torchrun's other failed ranks),
        "nodes": [the other failed nodes, as :func:`node_failures`]}``, and ``"torchrun": True`` for torchrun's own
        failure.
    """
    lines: list[str] = []
    if os.path.isfile(launcher_log):
        with open(launcher_log, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    stalled = _stall(log_dir, lines)
    if stalled:
        return stalled
    failures = parse_torchrun_failures(lines)
    for f in failures if simulated_rank >= 0 else ():
        f["rank"] = simulated_rank
    report = _report_start(lines)
    nodes = node_failures(log_dir, lines, layout)
    for f in failures:
        code, sig = f["exitcode"], f["signal"]
        f["how"] = (f"killed by {sig} (exit code {code})" if sig else
                    f"exit code {code}" if code is not None else "unknown")
    others: list[FailedRank] = [{"rank": f["rank"], "exitcode": f["exitcode"], "signal": f["signal"], "how": f["how"]}
                                for f in failures]
    # a node that never joined, or whose torchrun was killed, is the root cause: the others' failures follow from it
    missing = bool(nodes) and (nodes[0]["how"] in ("never joined the trial", "wrote no end record")
                               or nodes[0]["how"].startswith("torchrun killed by"))
    crash = None if failures or missing else _torchrun_crash(lines, nodes, layout)
    if crash:
        return crash
    if nodes and (not failures or missing):
        n = nodes[0]
        return {"node": n["node"], "ranks": n["ranks"], "rank": None, "exitcode": None, "signal": None,
                "how": n["how"], "host": n["host"], "error_file": None, "traceback": n["detail"], "log_tail": [],
                "others": others, "nodes": nodes[1:]}
    if not failures:
        return None
    own = [f for f in failures if not _stopped_by_torchrun(f)]
    first = own[0] if own else failures[0]
    prefix = f"[rank {first['rank']}]"
    tail = [line for line in lines if prefix in line][-_TAIL_LINES:]
    message = _error_file_message(first["error_file"])
    if message:
        tail += message.splitlines()[-_TAIL_LINES:]
    traceback = first["traceback"]
    if not message and traceback.startswith(_NO_ERROR_FILE):  # no error file: never quote torchrun's pointer
        traceback = _rank_error(first, lines, report, tail, log_dir)
    return {"node": None, "ranks": None, "rank": first["rank"], "exitcode": first["exitcode"],
            "signal": first["signal"], "how": first["how"], "host": first["host"], "error_file": first["error_file"],
            "traceback": traceback, "log_tail": tail,
            "others": [o for o, f in zip(others, failures) if f is not first], "nodes": nodes}
