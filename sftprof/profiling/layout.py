"""Kernel-trace artifact names, re-exported from :mod:`sftprof.artifacts` (which owns them).

Kept so the analysis modules that import it (``views``, ``summary``) run unchanged until they import
:mod:`sftprof.artifacts` directly. Why the names are what they are:

- Raw traces: ``LOG_DIR/perf_tracer/rank<r>.pt.trace.json``. ``<worker>.pt.trace.json[.gz]`` is the name
  TensorBoard's profiler plugin (``torch-tb-profiler``) lists, a folder of such files is one of its runs,
  and ``rank<r>`` is the worker.
- Views: ``RUN_DIR/kernel_traces/<view>/rank<r>.pt.trace.json[.gz]``, one folder per view, so each folder
  holds one trace per rank: what HolisticTraceAnalysis's ``TraceAnalysis(trace_dir=...)`` expects (it keys
  files by ``distributedInfo.rank`` and keeps one per rank), and one TensorBoard run per view. A view split
  into time windows goes to ``<view>.part<k>/`` folders.
"""
from sftprof.artifacts import KERNEL_TRACES, RAW_TRACE_RE, raw_trace_rank, trace_name, view_dir, view_path, window_path

__all__ = ["RAW_TRACE_RE", "KERNEL_TRACES", "raw_trace_rank", "trace_name", "view_dir", "view_path", "window_path"]
