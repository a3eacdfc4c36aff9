"""sftprof.artifacts: names round-trip through their parsers; stats.jsonl records are written and read back."""
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from sftprof import artifacts as a


def test_region_names_and_parser():
    assert (a.STEP, a.OPTIMIZER_STEP, a.forward(3), a.backward(12)) == (
        "sftprof/step", "sftprof/optimizer_step", "sftprof/forward/mb3", "sftprof/backward/mb12")
    assert [a.parse_region(n) for n in (a.STEP, a.OPTIMIZER_STEP, a.forward(3), a.backward(12))] == [
        ("step", None), ("optimizer_step", None), ("forward", 3), ("backward", 12)]
    assert [a.parse_region(n) for n in ("sftprof/forward", "ProfilerStep#1", "sftprof/step/x")] == [None, None, None]


def test_file_names_round_trip(tmp_path):
    coords = {"pp": 1, "dp": 0, "cp": 2, "tp": 1, "ep": 3, "etp": 0}
    name = a.snapshot_name(5, coords)
    assert name == "snapshot_rank5_pp1_dp0_cp2_tp1_ep3.pickle"
    assert a.parse_snapshot_name(name) == (5, {"pp": 1, "dp": 0, "cp": 2, "tp": 1, "ep": 3})
    assert a.parse_snapshot_name(name + ".gz")[0] == 5 and a.parse_snapshot_name("phases_rank5.json") is None
    assert a.raw_trace_path(tmp_path, 4) == tmp_path / "perf_tracer" / "rank4.pt.trace.json"
    assert [a.raw_trace_rank(n) for n in ("rank4.pt.trace.json", "traces-r7.chrome.json.gz", "rank4.json")] == [4, 7, None]
    assert a.node_record_path(tmp_path, 2) == tmp_path / "nodes" / "node2.json"
    assert a.view_path("out", 3, "split_clean.chrome", compress=True) == "out/split_clean/rank3.pt.trace.json.gz"
    assert a.window_path("out/gpu_only/rank3.pt.trace.json", 1) == "out/gpu_only.part1/rank3.pt.trace.json"


def test_stats_written_and_read_back(tmp_path):
    path = tmp_path / "stats.jsonl"
    w = a.StatsWriter(path)
    step = a.StepRecord(step=0, loss=2.5, grad_norm=None, step_time_s=2.0, tokens=2048, tokens_per_s=1024.0,
                        ranks=[{"rank": 0, "step_time_s": 2.0, "mem_peak_allocated_gb": None,
                                "mem_peak_reserved_gb": None}], profiled=True)
    w.write(step)
    assert json.loads(path.read_text()) == step.to_json()  # flushed at once
    w.write(a.CompletionRecord(status="ok", steps_done=2, world_size=2, backend="fsdp", device="cpu",
                               profile_kind="kernel", profile_step=0))
    w.close()
    lines = path.read_text().splitlines()
    with open(path, "a") as f:  # damaged lines and a step record of an earlier release (no grad_norm, ...)
        f.write("not json\n[1, 2]\n" + json.dumps({"type": "step", "step": 1, "loss": 2.0}) + "\n")
        # step records whose step is not a non-negative integer: invalid lines, counted and left out
        for bad in ("x", True, -1, 1.0, None):
            f.write(json.dumps({"type": "step", "step": bad, "loss": 2.0}) + "\n")
    assert list(json.loads(lines[0])) == [
        "type", "step", "loss", "grad_norm", "step_time_s", "tokens", "tokens_per_s", "mem_allocated_gb",
        "mem_reserved_gb", "mem_peak_allocated_gb", "mem_peak_reserved_gb", "ranks", "tflops_per_gpu", "mfu",
        "recompute_tflops_per_gpu", "moe_load", "profiled", "started_unix_s", "profiler_s"]
    assert json.loads(lines[1]) == {"type": "complete", "status": "ok", "error": None, "steps_done": 2, "world_size": 2,
                                     "backend": "fsdp", "device": "cpu", "profile_kind": "kernel", "profile_step": 0,
                                     "trainer_started_unix_s": None, "imports_done_unix_s": None,
                                     "engine_build_started_unix_s": None, "ended_unix_s": None}
    log = a.read_stats(path)
    assert log.bad_lines == 7 and len(log.steps) == 2 and log.steps[0] == step
    assert (log.steps[1].step, log.steps[1].loss, log.steps[1].grad_norm, log.steps[1].profiled) == (1, 2.0, None, False)
    assert log.completion.status == "ok" and log.completion.profile_step == 0
    assert a.field_units()["step_time_s"].startswith("s: ") and a.field_units()["mem_peak_allocated_gb"].startswith("GiB")
    with pytest.raises(OSError):
        a.read_stats(tmp_path / "missing.jsonl")


def test_recorded_versions_name_sftprof_with_its_commit_and_nccl_as_given(tmp_path, monkeypatch):
    """``sftprof``: the installed version with this checkout's short commit (``0.1.0+g<HEAD>``, ``.dirty`` after it
    while a tracked file has uncommitted changes); ``nccl`` and ``torch_cuda`` as the trainer gives them (None: this
    CPU machine's torch). Without git, or with the package in a folder that is not the top of its own checkout (an
    installed copy inside another project's checkout), or in none, just the version."""
    root = Path(a.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    edited = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, check=True).stdout.strip() != ""
    version = metadata.version("sftprof")
    recorded = a.recorded_versions(None, None)
    assert list(recorded)[:5] == ["sftprof", "python", "torch", "torch_cuda", "nccl"]
    assert recorded["sftprof"] == f"{version}+g{head}" + (".dirty" if edited else "") and len(head) >= 7
    assert (recorded["python"], recorded["torch_cuda"], recorded["nccl"]) == (platform.python_version(), None, None)
    assert a.recorded_versions("13.0", "2.28.9")["nccl"] == "2.28.9"
    project = tmp_path / "project"
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    project.mkdir()
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "other project"], check=True)
    for package in (project / "lib" / "sftprof", tmp_path / "no_checkout" / "sftprof"):
        package.mkdir(parents=True)
        monkeypatch.setattr(a, "__file__", str(package / "artifacts.py"))
        assert a.sftprof_version() == version
    (project / "sftprof").mkdir()
    (project / "sftprof" / "artifacts.py").write_text("a = 1\n")
    (project / "README.md").write_text("tracked\n")
    subprocess.run(git + ["add", "sftprof", "README.md"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "sftprof in it"], check=True)
    monkeypatch.setattr(a, "__file__", str(project / "sftprof" / "artifacts.py"))  # the top of a checkout
    other = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert a.sftprof_version() == f"{version}+g{other}" and other != head
    (project / "notes.txt").write_text("untracked\n")  # an untracked file is no local edit of sftprof
    assert a.sftprof_version() == f"{version}+g{other}"
    (project / "README.md").write_text("edited\n")  # a tracked file edited, anywhere in the checkout
    assert a.sftprof_version() == f"{version}+g{other}.dirty"
    subprocess.run(git + ["add", "README.md"], check=True)  # staged, not committed: still a local edit
    assert a.sftprof_version() == f"{version}+g{other}.dirty"
    monkeypatch.setenv("PATH", str(tmp_path / "no_bin"))  # no git
    assert a.sftprof_version() == version
    # not installed (a checkout on PYTHONPATH): the version of sftprof's pyproject.toml beside the package
    installed = a._installed
    monkeypatch.setattr(a, "_installed", lambda name: None if name == "sftprof" else installed(name))
    assert a.sftprof_version() is None  # no pyproject.toml
    (project / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "1.0"\n')
    assert a.sftprof_version() is None  # another project's
    (project / "pyproject.toml").write_text("[project\n")  # damaged
    assert a.sftprof_version() is None
    (project / "pyproject.toml").write_text('[project]\nname = "sftprof"\nversion = "9.9.9"\n')
    assert a.sftprof_version() == "9.9.9"  # no git: the version alone
    monkeypatch.undo()  # git back
    monkeypatch.setattr(a, "__file__", str(project / "sftprof" / "artifacts.py"))
    monkeypatch.setattr(a, "_installed", lambda name: None if name == "sftprof" else installed(name))
    assert a.sftprof_version() == f"9.9.9+g{other}.dirty"  # with the checkout's commit (README.md staged)
    monkeypatch.setattr(a, "_installed", installed)  # another copy installed: the checkout's own version wins
    assert a.sftprof_version() == f"9.9.9+g{other}.dirty"
