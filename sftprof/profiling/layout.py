"""Names and folders of kernel-trace artifacts, chosen so that peer tools open them as they are.

- Raw traces (the trainer): ``LOG_DIR/perf_tracer/rank<r>.pt.trace.json``. ``<worker>.pt.trace.json[.gz]``
  is the name TensorBoard's profiler plugin (``torch-tb-profiler``) lists, a folder of such files is
  one of its runs, and ``rank<r>`` is the worker.
- Views (postprocessing): ``RUN_DIR/kernel_traces/<view>/rank<r>.pt.trace.json[.gz]``, one folder
  per view (``chrome``, ``split_clean``, ``gpu_only``, ``cpu_only``, ``cuda_api_only``), so each
  folder holds one trace per rank: what HolisticTraceAnalysis's ``TraceAnalysis(trace_dir=...)``
  expects (it keys files by ``distributedInfo.rank`` and keeps one per rank), and one TensorBoard run
  per view. A view split into time windows goes to ``<view>.part<k>/`` folders.
- Earlier releases wrote ``perf_tracer/traces-r<r>.chrome.json[.gz]`` and
  ``kernel_traces/master/traces-r<r>.<view>.json``; :data:`RAW_TRACE_RE` still reads the old raw name.
"""
from __future__ import annotations

import os
import re

__all__ = ["RAW_TRACE_RE", "KERNEL_TRACES", "raw_trace_rank", "trace_name", "view_dir", "view_path", "window_path"]

KERNEL_TRACES = "kernel_traces"
# Group 1: the rank; the legacy name (traces-r<r>.chrome.json) first, then rank<r>.pt.trace.json.
RAW_TRACE_RE = re.compile(r"^(?:traces-r(\d+)\.chrome|rank(\d+)\.pt\.trace)\.json(\.gz)?$")


def trace_name(rank: int, compress: bool = False) -> str:
    """``rank<rank>.pt.trace.json`` (``.gz`` appended when ``compress``)."""
    return f"rank{rank}.pt.trace.json" + (".gz" if compress else "")


def raw_trace_rank(name: str) -> int | None:
    """The rank in a raw trace file name (new or legacy form), or None when ``name`` is not one."""
    m = RAW_TRACE_RE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def view_dir(out_dir: str, view: str) -> str:
    """``<out_dir>/<view>`` with the ``.chrome`` suffix of the view id dropped (``split_clean.chrome`` -> ``split_clean``)."""
    return os.path.join(out_dir, view.removesuffix(".chrome"))


def view_path(out_dir: str, rank: int, view: str, compress: bool = False) -> str:
    """Path of one view file: ``<out_dir>/<view>/rank<rank>.pt.trace.json[.gz]``."""
    return os.path.join(view_dir(out_dir, view), trace_name(rank, compress))


def window_path(path: str, k: int) -> str:
    """Time window ``k`` of the view file ``path``: ``<view folder>.part<k>/<same file name>``."""
    folder, name = os.path.split(path)
    return os.path.join(f"{folder}.part{k}", name)
