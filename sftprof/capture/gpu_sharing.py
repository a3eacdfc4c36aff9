"""Processes that are not this trial's on a rank's GPU, from ``nvidia-smi --query-compute-apps``.

A profile taken while another process runs on the same GPU reads like a solo one: its kernels take longer and its
memory peak has less room, and nothing in the trace says so. The trainer asks after each step
(:func:`other_processes`); ``stats.jsonl`` keeps the answer per rank and the summary warns.

The rank's GPU is the one nvidia-smi lists this process on, so no device index has to be mapped
(``CUDA_VISIBLE_DEVICES``). A process on it is the trial's when its environment holds this process's
``SFTPROF_TRIAL_ID`` (:data:`sftprof.artifacts.TRIAL_MARKER`, read from Linux ``/proc``); any other is another's.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from sftprof.artifacts import TRIAL_MARKER

__all__ = ["other_processes", "classify"]

QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]


def other_processes(timeout_s: float = 10.0) -> dict | None:
    """The processes not of this trial on this process's GPU.

    Returns ``{"pids": [int, ...], "mib": float}`` (their PIDs, sorted, and the GPU memory nvidia-smi gives them,
    MiB; ``[]`` and 0.0 when there are none), or None when it cannot tell: no nvidia-smi, nvidia-smi failed or
    took over ``timeout_s`` seconds, no ``SFTPROF_TRIAL_ID`` in this environment, or nvidia-smi does not list this
    process (another PID namespace: a container that does not see the host's PIDs).
    """
    marker = os.environ.get(TRIAL_MARKER)
    if not marker or shutil.which(QUERY[0]) is None:
        return None
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return classify(out, os.getpid(), marker)


def classify(csv_text: str, own_pid: int, marker: str) -> dict | None:
    """:func:`other_processes` on nvidia-smi's output (``gpu_uuid, pid, used_memory`` lines; ``[N/A]`` memory
    counts as 0): the GPU that lists ``own_pid``, and its processes whose environment lacks ``marker``."""
    rows = []
    for line in csv_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit():
            mib = float(parts[2]) if parts[2].replace(".", "", 1).isdigit() else 0.0
            rows.append((parts[0], int(parts[1]), mib))
    gpus = {uuid for uuid, pid, _ in rows if pid == own_pid}
    if not gpus:
        return None
    entry = f"{TRIAL_MARKER}={marker}".encode()
    others = [(pid, mib) for uuid, pid, mib in rows if uuid in gpus and pid != own_pid and entry not in _environ(pid)]
    return {"pids": sorted({pid for pid, _ in others}), "mib": sum(mib for _, mib in others)}


def _environ(pid: int) -> list[bytes]:
    """The environment of ``pid`` (empty when it is gone, another user's, or not in this PID namespace)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []
