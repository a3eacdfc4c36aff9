"""Issue 48: six more fault kinds (and three smaller ones) get a right figure, a warning saying what was seen and
left out, or a refusal naming the file and the fault; never a quiet wrong figure.

Inputs are built from the real H200 fixtures (the cut kernel trace and memory snapshot of
``tests/test_malformed_inputs.py``) and the tiny CPU preset; each test asserts exact values.
"""
import copy
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from test_malformed_inputs import (SNAP_NAME, _OLD_SPELLING, _log_dir, _put_snapshot,  # noqa: F401 (fixtures)
                                   _put_trace, _trace_text, full_trace, small_snapshot, small_trace)
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.trace.check import CATEGORY_ALIAS_NOTE



# ---------------------------------------------------------------------------------------------------------
# Kind 6: category spellings of other kineto versions
# ---------------------------------------------------------------------------------------------------------

def _two_ranks_postprocessed(tmp_path, rank0: dict, rank1: dict) -> dict:
    """The summary of a kernel trial (step 1) whose ranks 0 and 1 left the traces ``rank0`` and ``rank1``; the
    postprocess exits 0 with no error."""
    log = _log_dir(tmp_path)
    _put_trace(log, 0, _trace_text(rank0))
    _put_trace(log, 1, _trace_text(rank1))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert code == 0 and summary["errors"] == []
    return summary

def test_old_kineto_category_spellings_keep_every_gpu_figure(tmp_path, small_trace):
    """The same trace with kineto's older spellings (Kernel, Memcpy, Memset, Runtime) gives the same GPU figures
    as with today's, and one warning counts the events read so."""
    old = copy.deepcopy(small_trace)
    n = 0
    for e in old["traceEvents"]:
        if e.get("cat") in _OLD_SPELLING:
            e["cat"] = _OLD_SPELLING[e["cat"]]
            n += 1
    assert n > 30
    summary = _two_ranks_postprocessed(tmp_path, small_trace, old)
    today, other = (t["summary"] for t in summary["kernel_traces"])
    assert other["gpu"]["activities"] > 30
    assert {k: v for k, v in other.items() if k != "view_repairs"} == \
        {k: v for k, v in today.items() if k != "view_repairs"}  # every figure, GPU and host, the same
    assert other["view_repairs"] == {**today["view_repairs"], CATEGORY_ALIAS_NOTE: n}
    mine = [w["warning"] for w in summary["warnings"] if w["file"] == "perf_tracer/traces-r1.chrome.json"]
    assert f"{n} events with {CATEGORY_ALIAS_NOTE}: their figures are kept; the views keep the trace's own " \
           "spelling" in mine
    assert not any(CATEGORY_ALIAS_NOTE in w["warning"] for w in summary["warnings"]
                   if w["file"] == "perf_tracer/traces-r0.chrome.json")


# ---------------------------------------------------------------------------------------------------------
# Kind 1: a rank's snapshot that also holds another GPU's blocks
# ---------------------------------------------------------------------------------------------------------
G = 2**30


def _on_device(snapshot: dict, device: int) -> dict:
    """A copy of ``snapshot`` (one device's) as device ``device``'s."""
    snap = copy.deepcopy(snapshot)
    for seg in snap["segments"]:
        seg["device"] = device
    snap["device_traces"] = [[] for _ in range(device)] + snap["device_traces"]
    return snap


def _with_foreign_blocks(snapshot: dict, own: int, foreign: int) -> dict:
    """``snapshot`` as device ``own``'s, plus every one of its segments and events once more on device ``foreign``
    and one more 2 GiB segment there: more memory on the other GPU than on the rank's own."""
    snap = _on_device(snapshot, own)
    other = _on_device(snapshot, foreign)
    extra = {"device": foreign, "total_size": 2 * G, "blocks": [
        {"address": 2**45, "size": 2 * G, "state": "active_allocated", "frames": []}]}
    snap["segments"] += other["segments"] + [extra]
    traces = [[] for _ in range(max(own, foreign) + 1)]
    traces[own], traces[foreign] = snap["device_traces"][own], other["device_traces"][foreign]
    snap["device_traces"] = traces
    return snap


def _phases(snapshot: dict, own: int, extra: dict) -> dict:
    """A phases sidecar (with ``extra`` members) whose step spans the history of device ``own``."""
    trace = snapshot["device_traces"][own]
    return {"clock": "unix_us", **extra, "phases": [{"name": "sftprof/step", "start_us": trace[0]["time_us"],
                                                       "end_us": trace[-1]["time_us"] + 1}]}


def test_snapshot_with_another_gpus_blocks_is_summarised_as_the_ranks_own_device(tmp_path, small_snapshot):
    """Rank 0: the plain snapshot (cuda:0). Rank 1 (device from its phases sidecar) and rank 3 (no device in the
    sidecar: local rank 3 % 2 = 1 from config.yaml) hold the same memory on cuda:1 and more on cuda:0: each is
    summarised as cuda:1, with rank 0's figures, and warned; rank 2 (cuda:0 own, cuda:1 foreign) likewise."""
    log = _log_dir(tmp_path, kind="memory")
    (log / "config.yaml").write_text("cluster:\n  n_gpus_per_node: 2\n")
    d = log / "memory_snapshots" / "step_1"
    cases = {0: (small_snapshot, 0, {}), 1: (_with_foreign_blocks(small_snapshot, 1, 0), 1, {"device": 1}),
             2: (_with_foreign_blocks(small_snapshot, 0, 1), 0, {"device": 0}),
             3: (_with_foreign_blocks(small_snapshot, 1, 0), 1, {})}
    for r, (snap, own, extra) in cases.items():
        _put_snapshot(log, SNAP_NAME.format(r=r), pickle.dumps(snap, protocol=4))
        (d / f"phases_rank{r}.json").write_text(json.dumps(_phases(snap, own, extra)))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 1)
    assert code == 0 and summary["errors"] == []
    by_rank = {m["rank"]: m["summary"] for m in summary["memory_snapshots"]}
    plain = {k: v for k, v in by_rank[0].items() if k not in ("device", "devices", "device_from")}
    reserved = sum(s["total_size"] for s in small_snapshot["segments"])
    allocated = sum(b["size"] for s in small_snapshot["segments"] for b in s["blocks"]
                    if b["state"] in ("active_allocated", "active_pending_free"))
    n = len(small_snapshot["device_traces"][0])
    assert by_rank[0]["devices"] == [{"device": 0, "reserved_bytes": reserved, "allocated_bytes": allocated,
                                      "trace_entries": n}]
    for r, own, other, source in ((1, 1, 0, "phases sidecar"), (2, 0, 1, "phases sidecar"),
                                  (3, 1, 0, "local rank (rank % cluster.n_gpus_per_node)")):
        s = by_rank[r]
        assert (s["device"], s["device_from"]) == (own, source)
        assert {k: v for k, v in s.items() if k not in ("device", "devices", "device_from")} == plain
        assert s["devices"] == [{"device": own, "reserved_bytes": reserved, "allocated_bytes": allocated,
                                 "trace_entries": n},
                                {"device": other, "reserved_bytes": reserved + 2 * G,
                                 "allocated_bytes": allocated + 2 * G, "trace_entries": n}]
        warning = (f"the snapshot also holds other devices' memory (cuda:{other} {(reserved + 2 * G) / G:.3f} GiB "
                   f"reserved, {(allocated + 2 * G) / G:.3f} GiB allocated at the dump, {n} events): left out of "
                   f"every figure, which are those of cuda:{own}, the rank's own (from the {source}), "
                   f"{reserved / G:.3f} GiB reserved at the dump; this rank's process allocated on another GPU (e.g. "
                   "torch.load without map_location)")
        assert [w["warning"] for w in summary["warnings"] if w["file"] == f"memory_snapshots/step_1/"
                f"{SNAP_NAME.format(r=r)}"] == [warning]
    md = (tmp_path / "run" / "profile_summary.md").read_text()
    assert md.count("**other devices left out:**") == 3


# ---------------------------------------------------------------------------------------------------------
# Kind 2: allocator history that starts mid-step
# ---------------------------------------------------------------------------------------------------------
def test_history_started_mid_step_gives_a_lower_bound_said_so(tmp_path):
    """The real snapshot's full history, its step spanning it (rank 0), and the same snapshot whose history was
    cleared after the step's peak (rank 1: the events up to the first free after the peak dropped): rank 1's step peak
    is lower and flagged as a lower bound, with the times and the blocks without stack."""
    from test_malformed_inputs import SNAPSHOT
    from sftprof.analysis.memory.safe_pickle import safe_load_file

    snap = safe_load_file(SNAPSHOT)
    trace = snap["device_traces"][0]
    log = _log_dir(tmp_path, kind="memory")
    d = log / "memory_snapshots" / "step_1"
    phases = _phases(snap, 0, {})
    _put_snapshot(log, SNAP_NAME.format(r=0), pickle.dumps(snap, protocol=4))
    (d / "phases_rank0.json").write_text(json.dumps(phases))
    full, _ = postprocess_trial(str(log), str(tmp_path / "run0"), "memory", 1)
    peak_ms = full["memory_snapshots"][0]["summary"]["peak_time_ms"]
    t_peak = trace[0]["time_us"] + peak_ms * 1e3
    cut = copy.deepcopy(snap)
    k = next(i for i, e in enumerate(trace) if e["time_us"] > t_peak and e["action"] == "free_completed")
    cut["device_traces"][0] = trace[k + 1:]
    _put_snapshot(log, SNAP_NAME.format(r=1), pickle.dumps(cut, protocol=4))
    (d / "phases_rank1.json").write_text(json.dumps(phases))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 1)
    assert code == 0 and summary["errors"] == []
    whole, part = (m["summary"] for m in summary["memory_snapshots"])
    assert whole["step_peak_lower_bound"] is None and whole["peak_scope"] == "profiled_step"
    assert part["peak_scope"] == "profiled_step" and part["peak_allocated_bytes"] < whole["peak_allocated_bytes"]
    first = cut["device_traces"][0][0]["time_us"]
    allocs = {e["addr"] for e in cut["device_traces"][0] if e["action"] == "alloc"}
    unrecorded = [b["size"] for s in snap["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated" and not b.get("frames") and b["address"] not in allocs]
    assert len(unrecorded) == 72
    reason = (f"the allocator history starts {(first - trace[0]['time_us']) / 1e3:.3f} ms after the profiled step's "
              f"start (sftprof/step at {trace[0]['time_us']:.0f} us in the phases sidecar, first recorded event at "
              f"{first:.0f} us); 72 block(s) alive at the dump ({sum(unrecorded) / G:.3f} GiB) have no stack and no "
              "alloc event in it: the step's allocations before it were not recorded (the history cleared or "
              "re-enabled during the step, or a ring buffer that overflowed), so the step's peak is a lower bound: "
              "the highest level of the recorded part of the step")
    assert part["step_peak_lower_bound"] == reason
    assert [w["warning"] for w in summary["warnings"]] == [reason]
    md = (tmp_path / "run" / "profile_summary.md").read_text()
    assert md.count("peak allocated in the profiled step at least **") == 1
    assert f"- **step peak is a lower bound:** {reason}" in md


# ---------------------------------------------------------------------------------------------------------
# Kind 5: a trace the profiler could not rename from its temporary name
# ---------------------------------------------------------------------------------------------------------
def _unrenamed_exports(monkeypatch):
    """torch's profiler exporting each trace (really) to ``<path>.tmp`` and stopping there, as kineto does when its
    rename fails (pytorch/pytorch#60187)."""
    import torch

    real = torch.profiler.profile.export_chrome_trace

    def export(self, path, *args, **kwargs):
        return real(self, path + ".tmp", *args, **kwargs)
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)


def _profile_one_step(tmp_path):
    from test_profiling_capture import LAYOUT, _cfg, _work
    from sftprof.capture.kernel import KernelProfiler

    prof = KernelProfiler(_cfg("perf_tracer.enabled=true", "perf_tracer.profile_steps=[1]"), LAYOUT, 0, tmp_path)
    for step in range(2):
        with prof.step(step):
            _work()
    return prof


def test_trace_left_under_the_profilers_temporary_name_is_renamed_and_logged(tmp_path, monkeypatch, caplog):
    import logging
    from sftprof.artifacts import raw_trace_path

    _unrenamed_exports(monkeypatch)
    path = raw_trace_path(tmp_path, 0)
    with caplog.at_level(logging.INFO, logger="sftprof.capture.kernel"):
        prof = _profile_one_step(tmp_path)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel trace of step")]
    assert said == [f"kernel trace of step 1: the profiler left it as {path}.tmp (its rename failed); renamed to "
                    f"{path}", f"kernel trace of step 1 written to {path}"]
    assert prof.traces_written == 1 and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert any(e.get("name") == "ProfilerStep#1" for e in json.load(open(path))["traceEvents"])


def test_trace_that_stays_under_its_temporary_name_is_never_said_written_and_is_postprocessed(tmp_path, monkeypatch,
                                                                                             caplog):
    """The rename fails for sftprof too: the log says where the trace is (no "written to"); postprocessing reads
    it from there with a warning, never "no artifacts found"; beside a complete trace, a .tmp file is skipped."""
    import logging
    from sftprof.artifacts import raw_trace_path
    from sftprof.capture import kernel

    _unrenamed_exports(monkeypatch)

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(kernel.os, "replace", refuse)
    path = raw_trace_path(tmp_path / "log", 0)
    with caplog.at_level(logging.INFO, logger="sftprof.capture.kernel"):
        prof = _profile_one_step(tmp_path / "log")
    monkeypatch.undo()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel trace of step")]
    assert said == [f"kernel trace of step 1 left as {path}.tmp: the profiler could not rename it to {path}, nor "
                    "could sftprof ([Errno 13] Permission denied); postprocessing reads it from there"]
    assert prof.traces_written == 1 and not path.exists()
    log = tmp_path / "log"
    recs = [{"type": "complete", "status": "ok", "error": None, "steps_done": 2, "world_size": 1, "backend": "fsdp",
             "device": "cpu", "profile_kind": "kernel", "profile_step": 1}]
    (log / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert code == 0 and summary["errors"] == [] and summary["status"] == "ok"
    (t,) = summary["kernel_traces"]
    assert (t["rank"], t["source"]) == (0, "perf_tracer/rank0.pt.trace.json.tmp") and "summary" in t
    assert {"file": "perf_tracer/rank0.pt.trace.json.tmp", "warning": "rank 0: the trace was left under the "
            "profiler's temporary name (its rename failed), and is read from there as the rank's trace: it is "
            "complete"} in summary["warnings"]
    # a truncated one is its own error, named
    text = (log / "perf_tracer" / "rank0.pt.trace.json.tmp").read_text()
    (log / "perf_tracer" / "rank1.pt.trace.json.tmp").write_text(text[: len(text) // 2])
    summary, code = postprocess_trial(str(log), str(tmp_path / "run1"), "kernel", 1, jobs=1)
    assert code == 1 and [e["file"] for e in summary["errors"]] == ["perf_tracer/rank1.pt.trace.json.tmp"]
    assert summary["errors"][0]["error"].startswith(f"{log / 'perf_tracer' / 'rank1.pt.trace.json.tmp'}: ")
    # beside the rank's complete trace, the temporary file is skipped
    (log / "perf_tracer" / "rank1.pt.trace.json.tmp").unlink()
    (log / "perf_tracer" / "rank0.pt.trace.json").write_text(text)
    summary, code = postprocess_trial(str(log), str(tmp_path / "run2"), "kernel", 1, jobs=1)
    assert code == 0 and [t["source"] for t in summary["kernel_traces"]] == ["perf_tracer/rank0.pt.trace.json"]
    assert {"file": "perf_tracer/rank0.pt.trace.json.tmp",
            "reason": "a temporary file of the profiler beside rank 0's trace"} in summary["skipped"]


# ---------------------------------------------------------------------------------------------------------
# Kind 4: a rank that stops making progress
# ---------------------------------------------------------------------------------------------------------
def test_watchdog_names_the_rank_with_the_least_progress(tmp_path):
    """Progress records written as the trainer writes them, a clock the test moves: no stall before the limit; then
    the rank with the least progress (rank 2: no record at all, then rank 1 behind rank 0), whatever their times;
    a finished rank is never the one."""
    from sftprof.artifacts import progress_path, write_progress
    from sftprof.launch.watchdog import Watchdog, stall_message

    now = [100.0]
    dog = Watchdog(tmp_path, [0, 1, 2], limit_s=60, clock=lambda: now[0])
    progress_path(tmp_path, 0).parent.mkdir()
    for r in (0, 1):
        write_progress(progress_path(tmp_path, r), r, None, "setup", 0)
    assert dog.check() is None
    now[0] = 130.0
    write_progress(progress_path(tmp_path, 1), 1, 0, "after sftprof/backward/mb0", 7)
    write_progress(progress_path(tmp_path, 0), 0, 0, "sftprof/optimizer_step", 8)
    assert dog.check() is None
    now[0] = 160.0
    stall = dog.check()  # rank 2 wrote nothing for 60 s
    assert (stall["rank"], stall["phase"], stall["step"], stall["idle_s"]) == (2, None, None, 60.0)
    write_progress(progress_path(tmp_path, 2), 2, 0, "sftprof/optimizer_step", 8)
    now[0] = 185.0
    assert dog.check() is None  # every rank moved within the last 60 s
    now[0] = 230.0
    stall = dog.check()
    assert (stall["rank"], stall["phase"], stall["step"], stall["idle_s"]) == (1, "after sftprof/backward/mb0", 0,
                                                                                100.0)
    assert [(x["rank"], x["seq"]) for x in stall["ranks"]] == [(1, 7), (0, 8), (2, 8)]
    assert stall_message(stall) == ("rank 1 stopped making progress in phase 'after sftprof/backward/mb0' of step 0: "
                                    "no progress for 100 s (STALL_TIMEOUT=60 s); the watchdog ended the trial")
    write_progress(progress_path(tmp_path, 1), 1, 0, "finished", 8)
    write_progress(progress_path(tmp_path, 0), 0, 0, "finished", 9)
    write_progress(progress_path(tmp_path, 2), 2, 0, "finished", 9)
    now[0] = 1000.0
    assert dog.check() is None


_HANG = '''
import os, sys
if os.environ.get("RANK") == "1" and sys.argv[0].endswith("train_sft_profile.py"):
    import contextlib, time
    from sftprof.capture import regions
    real = regions.region

    @contextlib.contextmanager
    def region(name):
        if name == regions.OPTIMIZER_STEP:
            time.sleep(3600)  # rank 1 stops between its backward and its optimizer step
        with real(name):
            yield
    regions.region = region
'''


def test_a_rank_that_stops_is_named_and_its_trial_ended_with_logs_and_summary(tmp_path):
    """The tiny CPU preset on 2 ranks, rank 1 stopping before its optimizer step of step 0 (a sitecustomize in its
    process): the watchdog (STALL_TIMEOUT=40) names rank 1, its phase and step, ends the trial; the trial's logs and
    summary stay, and the summary's Failure section names the rank."""
    from test_driver import run_driver

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_HANG)
    repo = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join([str(shim), repo]), "STALL_TIMEOUT": "40", "PROFILE_STEPS": "0",
           "PROFILE_KINDS": "kernel"}
    proc = run_driver(env, tmp_path, timeout=400)
    (trial,) = [p for p in (tmp_path / "run").iterdir() if p.is_dir()]
    assert proc.returncode == 1 and (trial / "profile_summary.json").is_file(), proc.stderr[-3000:]
    summary = json.loads((trial / "profile_summary.json").read_text())
    fail = summary["failure"]
    assert (fail["rank"], fail["how"]) == (1, "stopped making progress in phase 'after sftprof/backward/mb0' of "
                                              "step 0")
    assert fail["traceback"].startswith("no progress for ")
    assert fail["traceback"].endswith(" s (STALL_TIMEOUT=40 s); the watchdog ended the trial")
    assert fail["others"][0]["rank"] == 0 and "sftprof/optimizer_step" in fail["others"][0]["how"]
    stall = json.loads((Path(summary["paths"]["log_dir"]) / "stall.json").read_text())
    assert (stall["rank"], stall["step"], stall["limit_s"]) == (1, 0, 40)
    line = f"rank 1 stopped making progress in phase 'after sftprof/backward/mb0' of step 0: {fail['traceback']}"
    assert stall["message"] == line and f"sftprof: {line}\n" in (trial / "launcher.log").read_text()
    assert f"sftprof: {line}\n" in proc.stderr
    assert "rank 1 stopped making progress" in (trial / "profile_summary.md").read_text()
    assert (Path(summary["paths"]["log_dir"]) / "trainer.log").is_file()


# ---------------------------------------------------------------------------------------------------------
# Kind 3: a config file edited while a run is in progress
# ---------------------------------------------------------------------------------------------------------
def test_config_edited_during_the_run_changes_no_trial(tmp_path):
    """The tiny CPU preset as a CONFIG file, two trials; after the first trial's postprocessing the file is edited
    (fake_seq_len 1024 -> 512): the second trial runs the plan (its config.yaml says 1024), loaded from the plan's
    read-only copy, and the driver says once that the file changed."""
    import shlex
    from test_driver import run_driver
    from sftprof.config.loading import PRESET_DIR

    config = tmp_path / "my.yaml"
    config.write_text((PRESET_DIR / "tiny_cpu.yaml").read_text())
    edited = config.read_text().replace("fake_seq_len: 1024", "fake_seq_len: 512")
    (tmp_path / "edited.yaml").write_text(edited)
    wrapper = tmp_path / "python_wrapper"
    wrapper.write_text(f'#!/bin/bash\n{shlex.quote(sys.executable)} "$@"; rc=$?\n'
                       f'if [[ "$1" == */postprocess_profile.py ]]; then cp {tmp_path / "edited.yaml"} {config}; fi\n'
                       'exit $rc\n')
    wrapper.chmod(0o755)
    proc = run_driver({"CONFIG": str(config), "PYTHON": str(wrapper), "PROFILE_STEPS": "0,1", "PROFILE_KINDS": "kernel",
                       "STOP_ON_FAILURE": "0"}, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert config.read_text() == edited
    copy = tmp_path / "run" / "plan_config.yaml"
    assert copy.read_text() == (PRESET_DIR / "tiny_cpu.yaml").read_text() and copy.stat().st_mode & 0o777 == 0o444
    trials = sorted(p for p in (tmp_path / "run").iterdir() if p.is_dir())
    assert len(trials) == 2
    for t in trials:
        assert (t / "train_args.txt").read_text().splitlines()[:2] == ["--config", str(copy)]
        summary = json.loads((t / "profile_summary.json").read_text())
        assert summary["config"]["profile"]["fake_seq_len"] == 1024
    assert proc.stderr.count(f"sftprof: CONFIG file {config.resolve()} changed (or went) since the plan: the trials "
                             f"run the plan's copy, {copy}\n") == 1
    assert f"# config: {copy}, the copy of {config.resolve()} every trial loads (sha256 " in \
        (tmp_path / "run" / "profile_settings.log").read_text()


def test_trial_whose_plan_config_copy_changed_is_not_run(tmp_path):
    """The plan's copy edited after the plan: the trial is refused before torchrun, with the reason in its
    launcher.log and summary.tsv's status `config changed`."""
    from sftprof.launch.folders import write_plan
    from sftprof.launch.planning import plan
    from sftprof.launch.trials import TrialRunner

    env = {"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fileroot"), "RUN_ROOT": str(tmp_path / "run"),
           "PROFILE_STEPS": "0", "PROFILE_KINDS": "kernel"}
    trials, settings, info = plan(env, [], gpus=0)
    write_plan(trials, settings, info)
    copy = Path(info.config.copy)
    runner = TrialRunner(sys.executable, dict(os.environ))
    runner.trials, runner.plan = trials, info
    assert runner._config_changed(trials[0]) is None
    copy.chmod(0o644)
    copy.write_text(copy.read_text().replace("fake_seq_len: 1024", "fake_seq_len: 512"))
    (runner.run_root / "summary.tsv").write_text("")
    assert runner._trial(1, trials[0], 0.0) == 2
    digest = hashlib.sha256(copy.read_bytes()).hexdigest()
    reason = (f"the plan's config {copy} changed since the plan (sha256 {digest}, planned {info.config.sha256}): "
              "the trial would not run the plan")
    assert (trials[0].run_dir / "launcher.log").read_text() == f"sftprof: {reason}\n"
    assert (runner.run_root / "summary.tsv").read_text().split("\t")[:4] == [trials[0].name, "kernel", "0",
                                                                             "config changed"]
    assert not trials[0].log_dir.exists()  # nothing launched



def test_trainer_refuses_a_plan_config_copy_edited_after_its_trial_launched(tmp_path):
    """The copy edited in the seconds between the driver's check and the trainer's load (root ignores its read-only
    mode): the trainer of that trial, which the plan gave the copy's sha256, exits 2 before anything runs."""
    from sftprof.launch.planning import plan

    env = {"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fileroot"), "RUN_ROOT": str(tmp_path / "run"),
           "PROFILE_STEPS": "0", "PROFILE_KINDS": "kernel"}
    trials, _, info = plan(env, [], gpus=0)
    want = info.config.sha256
    assert trials[0].env == {"SFTPROF_PLAN_CONFIG_SHA256": want}
    edited = tmp_path / "plan_config.yaml"
    edited.write_bytes(info.config.text.replace(b"fake_seq_len: 1024", b"fake_seq_len: 512"))
    args = [sys.executable, str(Path(__file__).resolve().parents[1] / "train_sft_profile.py"), "--config", str(edited),
            *trials[0].args[trials[0].args.index("--config") + 2:]]
    out = subprocess.run(args, env={**os.environ, **trials[0].env}, capture_output=True, text=True, timeout=120)
    got = hashlib.sha256(edited.read_bytes()).hexdigest()
    assert (out.returncode, out.stderr) == (2, f"sftprof: configuration error: --config {edited}: changed since the "
                                               f"driver planned this run (sha256 {got[:12]}, planned {want[:12]}); "
                                               "nothing was run: run the driver again for other settings\n")
    assert not trials[0].log_dir.exists()

# ---------------------------------------------------------------------------------------------------------
# sftprof/* annotations written as B/E pairs
# ---------------------------------------------------------------------------------------------------------
def test_annotations_written_as_begin_end_pairs_are_read_as_spans(tmp_path, small_trace):
    """The cut trace with each sftprof/* annotation written as a B/E pair (and one E without its B): the same
    figures as with X events, and warnings counting the pairs read and the event left out."""
    from sftprof.analysis.time.trace_summary import BEGIN_END_NOTE, UNPAIRED_NOTE

    pairs = copy.deepcopy(small_trace)
    events, n = [], 0
    for e in pairs["traceEvents"]:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X" and e["name"].startswith("sftprof/"):
            b = {k: v for k, v in e.items() if k != "dur"}
            events += [{**b, "ph": "B"}, {"ph": "E", "cat": e["cat"], "pid": e["pid"], "tid": e["tid"],
                                          "ts": e["ts"] + e["dur"]}]
            n += 1
        else:
            events.append(e)
    lone = next(e for e in events if e.get("ph") == "E")
    events.insert(0, {**lone, "ts": lone["ts"] - 10**6})
    pairs["traceEvents"] = events
    assert n >= 1
    summary = _two_ranks_postprocessed(tmp_path, small_trace, pairs)
    xs, be = (t["summary"] for t in summary["kernel_traces"])
    assert xs["regions"] and be["regions"] == xs["regions"]
    same = ("gpu", "parts", "step_window", "regions", "categories", "communication", "host")
    assert {k: be[k] for k in same} == {k: xs[k] for k in same}
    assert be["view_repairs"] == {**xs["view_repairs"], BEGIN_END_NOTE: n, UNPAIRED_NOTE: 1}
    mine = [w["warning"] for w in summary["warnings"] if w["file"] == "perf_tracer/traces-r1.chrome.json"]
    assert f"{n} {BEGIN_END_NOTE}" in mine and f"1 {UNPAIRED_NOTE}" in mine
