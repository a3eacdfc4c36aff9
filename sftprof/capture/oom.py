"""What a rank's allocator held when it ran out of CUDA memory, in any trial (kernel or memory).

:func:`watch` attaches torch's out-of-memory observer (``torch._C._cuda_attach_out_of_memory_observer``), which
the caching allocator calls when a request fails, before the error unwinds the stack. At the first such failure of
the process it writes, into ``LOG_DIR/memory_snapshots/oom/`` (:func:`sftprof.artifacts.oom_dir`):

- the allocator's snapshot (``torch.cuda.memory._snapshot()``, named as a memory trial's,
  :func:`sftprof.artifacts.snapshot_name`): its segments and blocks as they are at the failure. In a memory trial
  the allocator history is on (:mod:`sftprof.capture.memory`): blocks carry their stacks and the trace ends with
  the ``oom`` entry. In a kernel trial it is off, and stays off: the history would cost the traced step host time
  per allocation, so the snapshot holds the state alone (sizes, no stacks);
- ``oom_rank<r>.json`` (:func:`sftprof.artifacts.oom_record_name`): ``requested_bytes`` (the failed request),
  ``reserved_bytes`` and ``free_bytes`` (the allocator's figures at the failure), ``capacity_bytes``
  (``torch.cuda.mem_get_info``'s total), ``allocated_bytes``, ``regions`` (the open ``sftprof/*`` regions, outermost
  first), ``stack`` (the Python frames of the failing allocation, innermost last, ``file:line function``) and
  ``history`` (whether the allocator history was on).

Cost: nothing until a request fails; then one snapshot dump (seconds with a long history: bench/snapshot_cost.py
measures it). The error itself is raised by torch as before; a failure to write is logged, never raised.
"""
from __future__ import annotations

import json
import logging
import pickle
import traceback
from pathlib import Path

import torch

from sftprof.artifacts import oom_dir, oom_record_name, snapshot_name
from sftprof.capture.regions import open_regions

log = logging.getLogger(__name__)

MAX_FRAMES = 40  # innermost frames of the failing allocation's Python stack kept in the record


class OOMWatch:
    """Writes the snapshot and record of the first out-of-memory failure of this process (module docstring)."""

    def __init__(self, rank: int, coords: dict, log_dir: Path, device: torch.device) -> None:
        self.rank, self.coords, self.log_dir, self.device = rank, coords, Path(log_dir), device
        self.written = False

    def observed(self, device: int, requested: int, reserved: int, free: int) -> None:
        """The allocator's observer: called with the failed request's bytes and the allocator's reserved and the
        device's free bytes."""
        if self.written:
            return
        self.written = True
        out = oom_dir(self.log_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
            snapshot = torch.cuda.memory._snapshot()
            with open(out / snapshot_name(self.rank, self.coords), "wb") as f:
                pickle.dump(snapshot, f)
            frames = traceback.extract_stack()[:-1][-MAX_FRAMES:]
            record = {"rank": self.rank, "device": device, "requested_bytes": int(requested),
                      "reserved_bytes": int(reserved), "free_bytes": int(free),
                      "capacity_bytes": int(torch.cuda.mem_get_info(self.device)[1]),
                      "allocated_bytes": int(torch.cuda.memory_allocated(self.device)), "regions": open_regions(),
                      "stack": [f"{f.filename}:{f.lineno} {f.name}" for f in frames],
                      "history": any(snapshot.get("device_traces") or [])}
            (out / oom_record_name(self.rank)).write_text(json.dumps(record, indent=1) + "\n")
            log.error("CUDA out of memory on rank %d: %.2f GiB requested; allocator snapshot and record written to %s",
                      self.rank, requested / 2**30, out)
        except Exception as err:  # the OOM error is what the trial reports; a failed dump must not replace it
            log.error("out-of-memory snapshot of rank %d not written: %s: %s", self.rank, type(err).__name__, err)


def watch(rank: int, coords: dict, log_dir: Path, device: torch.device) -> OOMWatch | None:
    """Attach an :class:`OOMWatch` for this rank (CUDA only; None on CPU)."""
    if device.type != "cuda":
        return None
    w = OOMWatch(rank, coords, log_dir, device)
    torch._C._cuda_attach_out_of_memory_observer(w.observed)
    return w
