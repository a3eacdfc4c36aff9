"""Processes that are not this trial's on a rank's GPU, from ``nvidia-smi --query-compute-apps``.

A profile taken while another process runs on the same GPU reads like a solo one: its kernels take longer and its
memory peak has less room, and nothing in the trace says so. The trainer asks after each step
(:func:`other_processes`); ``stats.jsonl`` keeps the answer per rank and the summary warns.

The rank's GPU is the one torch names by UUID, else the one nvidia-smi lists this process on (no device index is
mapped through ``CUDA_VISIBLE_DEVICES``). A process on it is the trial's when its environment holds this process's
``SFTPROF_TRIAL_ID`` (:data:`sftprof.artifacts.TRIAL_MARKER`, read from Linux ``/proc``); any other is another's.
Under MIG, processes of other instances of the same GPU may be listed too (not checked).
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess

import torch

from sftprof.artifacts import TRIAL_MARKER

__all__ = ["other_processes", "classify"]

QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]


def other_processes(device: torch.device | None = None, timeout_s: float = 10.0) -> dict | None:
    """The processes not of this trial on this process's GPU.

    Args:
        device: the rank's CUDA device (its UUID picks the GPU in nvidia-smi's listing); None, or a UUID not in
            the listing: the GPUs that list this process.
        timeout_s: how long to wait for nvidia-smi; a hung one is killed and not waited for.

    Returns ``{"pids": [int, ...], "mib": float | None}`` (their PIDs, sorted, and the GPU memory nvidia-smi gives
    them, MiB; None when it gives some as ``[N/A]``; ``[]`` and 0.0 when there are none), or None when it cannot
    tell: no nvidia-smi, nvidia-smi failed or hung, no ``SFTPROF_TRIAL_ID`` in this environment, a process on the
    GPU without a PID, or nvidia-smi does not list this process (another PID namespace: a container that does not
    see the host's PIDs). Never raises: it only diagnoses.
    """
    marker = os.environ.get(TRIAL_MARKER)
    if not marker or shutil.which(QUERY[0]) is None:
        return None
    try:
        proc = subprocess.Popen(QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # not waited for: an nvidia-smi stuck in the driver cannot be killed
            return None
        if proc.returncode != 0:
            return None
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None) if device is not None else None
        return classify(out.decode(errors="replace"), os.getpid(), marker, str(uuid) if uuid else None)
    except Exception:  # noqa: BLE001 - a diagnosis must never stop the training it watches
        return None


def classify(csv_text: str, own_pid: int, marker: str, device_uuid: str | None = None) -> dict | None:
    """:func:`other_processes` on nvidia-smi's output (``gpu_uuid, pid, used_memory`` lines): the GPU named
    ``device_uuid`` (else those that list ``own_pid``), and its processes whose environment lacks ``marker``; a
    process listed twice counts once."""
    rows: dict[tuple, float | None] = {}
    for line in csv_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0]:
            continue
        pid = _number(parts[1], int)
        mib = _number(parts[2], float)
        rows[(_uuid(parts[0]), pid)] = mib if mib is not None and math.isfinite(mib) and mib >= 0 else None
    gpus = {uuid for uuid, pid in rows if pid == own_pid}
    if device_uuid and _uuid(device_uuid) in gpus:
        gpus = {_uuid(device_uuid)}
    if not gpus:
        return None
    others = {pid: mib for (uuid, pid), mib in rows.items() if uuid in gpus and pid != own_pid}
    if any(pid is None or pid <= 0 for pid in others):
        return None
    entry = f"{TRIAL_MARKER}={marker}".encode()
    others = {pid: mib for pid, mib in others.items() if entry not in _environ(pid)}
    mibs = list(others.values())
    return {"pids": sorted(others), "mib": None if None in mibs else float(sum(mibs))}


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:  # [N/A], [Insufficient Permissions], ...
        return None


def _uuid(text: str) -> str:
    return text.strip().lower().removeprefix("gpu-")


def _environ(pid: int) -> list[bytes]:
    """The environment of ``pid`` (empty when it is gone, another user's, or not in this PID namespace)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []
