"""Python garbage collections in kernel traces: a ``record_function`` range ``sftprof.gc/gen<generation>``
(:data:`sftprof.artifacts.GC_REGION_PREFIX`) around each collection while a kernel profiler records a step
(:func:`recording`, entered by :class:`sftprof.capture.kernel.KernelProfiler`). A collection holds the GIL, so every
Python thread stops while it runs; a full (generation 2) collection of a large heap takes hundreds of ms. With the
ranges, a host stall in the trace says whether the collector ran (``host.gc`` and each host-wait place's ``gc_ms``
in the summary). Outside recorded steps no callback is installed. Only threads the profiler follows (the training
thread, autograd's) record a range: a collection started on another Python thread stops the training thread too, but
leaves no range.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

from sftprof.artifacts import GC_REGION_PREFIX

__all__ = ["recording"]

_OPEN: list = []  # the open range (collections do not nest: the collector runs one at a time)


@torch.compiler.disable  # a collection inside a compiled function's eager part would have dynamo compile the callback
def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        rf = torch.profiler.record_function(f"{GC_REGION_PREFIX}{info['generation']}")
        rf.__enter__()
        _OPEN.append(rf)
    elif _OPEN:
        _OPEN.pop().__exit__(None, None, None)


@contextlib.contextmanager
def recording(enabled: bool = True) -> Iterator[None]:
    """Put a range around each garbage collection for the duration of the block (a recorded profiler step)."""
    if not enabled:
        yield
        return
    gc.callbacks.append(_callback)
    try:
        yield
    finally:
        while _OPEN:
            _OPEN.pop().__exit__(None, None, None)
        with contextlib.suppress(ValueError):  # the block cleared gc.callbacks itself
            gc.callbacks.remove(_callback)
