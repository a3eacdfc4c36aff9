"""Multi-node: each node's driver writes its end record of a trial, and node 0 waits for the others' before it
postprocesses every rank from the shared ``FILEROOT``.

The record (``LOG_DIR/nodes/node<k>.json``, :func:`sftprof.artifacts.read_node_record`) says how torchrun ended on
that node; :mod:`sftprof.analysis.trial.failure` names from it the node that failed first. A one-node trial has a record
only when torchrun itself was killed (its output cannot tell that).
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from sftprof import artifacts


def write_node_record(log_dir: Path, node_rank: int, torchrun_rc: int, elapsed_s: int, n_nodes: int,
                      nproc_per_node: int, torchrun_signal: str | None = None,
                      ranks_stopped: list[int] | None = None) -> Path:
    """Write ``LOG_DIR/nodes/node<k>.json``: ``{"node_rank", "host", "torchrun_rc", "elapsed_s" (seconds), "n_nodes",
    "nproc_per_node", "torchrun_signal", "ranks_stopped"}`` (read back by :func:`sftprof.artifacts.read_node_record`;
    the layout lets postprocessing name the ranks of a node that wrote no record). ``torchrun_signal``: the signal
    that killed torchrun itself (``SIGKILL``), None when it exited; ``ranks_stopped``: the ranks the launcher found
    still running after torchrun had died, and stopped (the node's other ranks had ended before)."""
    path = artifacts.node_record_path(log_dir, node_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"node_rank": node_rank, "host": socket.gethostname(), "torchrun_rc": torchrun_rc,
                               "elapsed_s": elapsed_s, "n_nodes": n_nodes, "nproc_per_node": nproc_per_node,
                               "torchrun_signal": torchrun_signal, "ranks_stopped": ranks_stopped}) + "\n")
    tmp.replace(path)  # readers never see half a record
    return path


def wait_for_nodes(log_dir: Path, n_nodes: int, timeout_s: float, poll_s: float = 1.0) -> list[str]:
    """Wait up to ``timeout_s`` seconds for the end records of nodes 1..n_nodes-1; one line per node that failed.

    A node is reported by its rank (and host, when its record names it): a non-zero torchrun exit
    status, or no record within the timeout (it never started, or died before writing it). An
    unreadable record is reported as such. Returns an empty list when every node ended with 0.
    """
    deadline = time.monotonic() + timeout_s
    pending = set(range(1, n_nodes))
    problems: dict[int, str] = {}
    while True:
        for k in sorted(pending):
            path = artifacts.node_record_path(log_dir, k)
            if not path.is_file():
                continue
            pending.discard(k)
            try:
                rec = artifacts.read_node_record(path)
            except (OSError, ValueError) as err:
                problems[k] = f"node {k}: unreadable end record {path}: {err}"
                continue
            if rec["torchrun_rc"] != 0:
                problems[k] = (f"node {k} ({rec['host'] or '?'}): torchrun exited with status {rec['torchrun_rc']} "
                               "(see its launcher.log)")
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    for k in sorted(pending):
        problems[k] = (f"node {k}: no end record after {timeout_s:g} s (NODE_TIMEOUT): it never started this trial "
                       f"or died before finishing it ({Path(log_dir) / artifacts.NODES} holds the records that came)")
    return [problems[k] for k in sorted(problems)]
