"""CPU: processes not of the trial on a rank's GPU (``sftprof.capture.gpu_sharing``), from nvidia-smi's listing
to the summary's warning. Real processes stand for the trial's and another's (their environments are read from
/proc); a stand-in ``nvidia-smi`` on PATH prints the listing."""
import json
import os
import subprocess
import sys

import pytest

from sftprof.analysis.trial.inputs import read_stats
from sftprof.analysis.trial.problems import shared_gpu_warnings
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
    me = os.getpid()
    listing = (f"GPU-aaa, {me}, 80000\nGPU-aaa, {ours}, 70000\nGPU-aaa, {other}, 1536\nGPU-aaa, {other}, 1536\n"
               f"\nGPU-bbb, 4242, 9000\n")
    # listed twice, counted once; GPU-bbb is not this process's
    assert gpu_sharing.classify(listing, me, MARKER) == {"pids": [other], "mib": 1536.0}
    alone = f"GPU-aaa, {me}, 80000\nGPU-aaa, {ours}, 70000\nGPU-bbb, {other}, 9000\n"
    assert gpu_sharing.classify(alone, me, MARKER) == {"pids": [], "mib": 0.0}
    unknown_memory = f"GPU-aaa, {me}, 80000\nGPU-aaa, {other}, [N/A]\nGPU-aaa, 999999999, {'9' * 400}\n"
    assert gpu_sharing.classify(unknown_memory, me, MARKER) == {"pids": [other, 999999999], "mib": None}
    # a stray context of this process on GPU-bbb: torch's UUID of the rank's device decides
    stray = f"GPU-aaa, {me}, 80000\nGPU-bbb, {me}, 300\nGPU-bbb, {other}, 70000\n"
    assert gpu_sharing.classify(stray, me, MARKER, device_uuid="AAA") == {"pids": [], "mib": 0.0}
    assert gpu_sharing.classify(stray, me, MARKER) == {"pids": [other], "mib": 70000.0}
    # it cannot tell: nvidia-smi does not list this process (another PID namespace), or a process has no PID
    assert gpu_sharing.classify(f"GPU-aaa, {other}, 1536\n", me, MARKER) is None
    assert gpu_sharing.classify(f"GPU-aaa, {me}, 1\nGPU-aaa, [Insufficient Permissions], 50\n", me, MARKER) is None
    assert gpu_sharing.classify(f"GPU-aaa, {me}, 1\nGPU-aaa, \u00b2, 50\n", me, MARKER) is None


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
    smi.write_bytes(b'#!/bin/sh\nprintf "GPU-\\377\\376, $PPID, 5\\n"\n')  # not UTF-8: read, never raised
    assert gpu_sharing.other_processes() == {"pids": [], "mib": 0.0}
    smi.write_text("#!/bin/sh\nsleep 30\n")  # hung: given up after the timeout
    assert gpu_sharing.other_processes(timeout_s=0.5) is None


def _stats(tmp_path, steps: list[list]) -> dict:
    """``read_stats`` of a stats.jsonl whose step ``n`` gives rank ``r`` the ``gpu_others`` ``steps[n][r]``."""
    def step(n, others):
        ranks = [{"rank": r, "step_time_s": 1.0, "mem_peak_allocated_gb": 1.0, "mem_peak_reserved_gb": 2.0,
                  "gpu_others": g} for r, g in enumerate(others)]
        return {"type": "step", "step": n, "loss": 1.0, "step_time_s": 1.0, "tokens": 8, "tokens_per_s": 8.0,
                "ranks": ranks}
    path = tmp_path / "stats.jsonl"
    path.write_text("".join(json.dumps(step(n, others)) + "\n" for n, others in enumerate(steps)))
    return read_stats(str(path), len(steps) - 1)


def test_shared_gpu_warning_from_stats(tmp_path):
    none = {"pids": [], "mib": 0.0}
    stats = _stats(tmp_path, [[None, none],
                              [{"pids": [8085, 5199], "mib": 16384.0}, none],
                              [{"pids": [5199], "mib": 8192.0}, {"pids": ["x"], "mib": 5.0}],
                              [none, {"pids": [77], "mib": None}]])
    assert [s["gpu_others"] for s in stats["steps"]] == [
        [], [{"rank": 0, "pids": [5199, 8085], "mib": 16384.0}], [{"rank": 0, "pids": [5199], "mib": 8192.0}],
        [{"rank": 1, "pids": [77], "mib": None}]]
    assert shared_gpu_warnings(stats) == [{"file": "stats.jsonl", "warning": (
        "GPU shared: processes not of this trial ran on the GPU of 2 rank(s) (rank 0: PID 5199, 8085, up to 16.00 "
        "GiB, step(s) 1-2, rank 1: PID 77, memory unknown, step(s) 3; as nvidia-smi listed them after each step). "
        "Their kernels share the GPU with the trial's, so step and kernel times can be longer than the trial's own, "
        "and memory they hold is memory the trial lacks; profile on a GPU of its own")}]
    assert shared_gpu_warnings(_stats(tmp_path, [[None, none]])) == []


def test_shared_gpu_values_that_cannot_be_true_are_left_out_and_long_lists_cut(tmp_path):
    bad = [{"pids": [-5], "mib": 1.0}, {"pids": [0], "mib": 1.0}, {"pids": [5], "mib": -4096.0},
           {"pids": [5], "mib": float("inf")}, {"pids": [True], "mib": 1.0}, {"pids": 5, "mib": 1.0}, "shared"]
    assert all(s["gpu_others"] == [] for s in _stats(tmp_path, [[g] for g in bad])["steps"])
    many = [[{"pids": list(range(100, 120)), "mib": 1024.0}] * 10 for _ in range(2000)]
    (warning,) = shared_gpu_warnings(_stats(tmp_path, many))
    assert warning["warning"].startswith(
        "GPU shared: processes not of this trial ran on the GPU of 10 rank(s) (rank 0: PID 100, 101, 102, 103, 104, "
        "105, 106, 107 and 12 more PIDs, up to 1.00 GiB, step(s) 0-1999, rank 1: PID 100, ")
    assert "rank 7: PID" in warning["warning"] and "and 2 more ranks;" in warning["warning"]
    assert len(warning["warning"]) < 1500
