"""The out-of-memory observer on a real GPU (issue 46): a request larger than the GPU leaves the snapshot and record
of sftprof/capture/oom.py, and the triage reads them back; with the allocator history on, its ``oom`` entry too.

Run in a process of its own (the observer stays attached and the history is process-wide):
``pytest -m gpu -n 0 tests/test_oom_gpu.py``.
"""
from __future__ import annotations

import json

import pytest
import torch

from sftprof import artifacts
from sftprof.analysis.memory.oom import oom_triage
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.capture.oom import watch
from sftprof.capture.regions import region

pytestmark = pytest.mark.gpu


def test_a_failed_request_leaves_its_snapshot_record_and_triage(tmp_path):
    device = torch.device("cuda", 0)
    torch.cuda.memory._record_memory_history(max_entries=1000, stacks="python")
    try:
        held = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # 256 MiB alive at the failure
        w = watch(0, {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0}, tmp_path, device)
        too_much = torch.cuda.mem_get_info(device)[1] + 2**30
        with pytest.raises(torch.OutOfMemoryError), region("sftprof/step"), region("sftprof/forward/mb0"):
            torch.empty(too_much, dtype=torch.uint8, device=device)
        assert w.written
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out = artifacts.oom_dir(tmp_path)
    record = json.loads((out / artifacts.oom_record_name(0)).read_text())
    assert record["requested_bytes"] >= too_much and record["regions"] == ["sftprof/step", "sftprof/forward/mb0"]
    assert record["capacity_bytes"] == torch.cuda.mem_get_info(device)[1] and record["history"]
    assert record["allocated_bytes"] >= held.numel()
    assert any("test_oom_gpu.py" in line for line in record["stack"])
    t = oom_triage(str(tmp_path), None, TrialModel(None), 0, None)
    assert t["requested_bytes"] == record["requested_bytes"] and t["phase"] == "sftprof/forward/mb0"
    assert t["site"].startswith("tests/test_oom_gpu.py:") or "test_oom_gpu.py" in t["site"]
    assert t["outside_pytorch_bytes"] == record["capacity_bytes"] - record["free_bytes"] - (
        t["allocated_bytes"] + t["reserved_unallocated_bytes"])
