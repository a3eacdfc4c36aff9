"""CPU: processes not of the trial on a rank's GPU (``sftprof.capture.gpu_sharing``), from nvidia-smi's listing
to the summary's warning. Real processes stand for the trial's and another's (their environments are read from
/proc); a stand-in ``nvidia-smi`` on PATH prints the listing."""
import json
import os
import subprocess
import sys

import pytest

from sftprof.analysis.inputs import read_stats
from sftprof.analysis.problems import shared_gpu_warnings
from sftprof.capture import gpu_sharing

MARKER = "trial-under-test"
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process environments from Linux /proc")


@pytest.fixture
def processes():
    """(a process of the trial, a process of another job), both alive for the test."""
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleep, env={**os.environ, "SFTPROF_TRIAL_ID": MARKER})
    other = subprocess.Popen(sleep, env={k: v for k, v in os.environ.items() if k != "SFTPROF_TRIAL_ID"})
    yield ours.pid, other.pid
    for p in (ours, other):
        p.kill()
        p.wait()


def test_other_processes_on_this_processes_gpu_are_named_with_their_memory(processes):
    ours, other = processes
    listing = (f"GPU-aaa, {os.getpid()}, 80000\nGPU-aaa, {ours}, 70000\nGPU-aaa, {other}, 1536\n"
               f"GPU-aaa, 999999999, [N/A]\nGPU-bbb, 4242, 9000\n")
    assert gpu_sharing.classify(listing, os.getpid(), MARKER) == {"pids": [other, 999999999], "mib": 1536.0}
    alone = f"GPU-aaa, {os.getpid()}, 80000\nGPU-aaa, {ours}, 70000\nGPU-bbb, {other}, 9000\n"
    assert gpu_sharing.classify(alone, os.getpid(), MARKER) == {"pids": [], "mib": 0.0}
    # nvidia-smi does not list this process (another PID namespace): it cannot tell
    assert gpu_sharing.classify(f"GPU-aaa, {other}, 1536\n", os.getpid(), MARKER) is None


def test_other_processes_asks_nvidia_smi_and_needs_the_trial_marker(processes, tmp_path, monkeypatch):
    _, other = processes
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "GPU-aaa, $PPID, 80000"\necho "GPU-aaa, {other}, 2048"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SFTPROF_TRIAL_ID", MARKER)
    assert gpu_sharing.other_processes() == {"pids": [other], "mib": 2048.0}
    monkeypatch.delenv("SFTPROF_TRIAL_ID")
    assert gpu_sharing.other_processes() is None
    monkeypatch.setenv("SFTPROF_TRIAL_ID", MARKER)
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert gpu_sharing.other_processes() is None


def test_shared_gpu_warning_from_stats(tmp_path):
    def step(n, others):
        ranks = [{"rank": r, "step_time_s": 1.0, "mem_peak_allocated_gb": 1.0, "mem_peak_reserved_gb": 2.0,
                  "gpu_others": g} for r, g in enumerate(others)]
        return {"type": "step", "step": n, "loss": 1.0, "step_time_s": 1.0, "tokens": 8, "tokens_per_s": 8.0,
                "ranks": ranks}
    lines = [step(0, [None, {"pids": [], "mib": 0.0}]),
             step(1, [{"pids": [5199, 8085], "mib": 16384.0}, {"pids": [], "mib": 0.0}]),
             step(2, [{"pids": [5199], "mib": 8192.0}, {"pids": ["x"], "mib": 5.0}])]
    path = tmp_path / "stats.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    stats = read_stats(str(path), 2)
    assert [s["gpu_others"] for s in stats["steps"]] == [
        [], [{"rank": 0, "pids": [5199, 8085], "mib": 16384.0}], [{"rank": 0, "pids": [5199], "mib": 8192.0}]]
    assert shared_gpu_warnings(stats) == [{"file": "stats.jsonl", "warning": (
        "GPU shared: processes not of this trial ran on the GPU of 1 rank(s) (rank 0: PID 5199, 8085, up to 16.00 "
        "GiB, step(s) 1, 2). Their kernels share the GPU with the trial's, so step and kernel times can be longer "
        "than the trial's own, and memory they hold is memory the trial lacks; profile on a GPU of its own")}]
    path.write_text(json.dumps(step(0, [None, {"pids": [], "mib": 0.0}])) + "\n")
    assert shared_gpu_warnings(read_stats(str(path), 0)) == []
