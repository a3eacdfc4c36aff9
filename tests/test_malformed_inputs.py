"""Issue 14: postprocessing survives every malformed input and never reports a wrong number quietly.

Inputs are derived from the real H200 fixtures (a cut of the project's kernel trace, a cut of its memory
snapshot) and from a real torchrun failure log; each test asserts exact counts, messages and exit codes.
"""
import copy
import gzip
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import FIXTURE_DIR, faults
from sftprof.artifacts import view_path
from sftprof.analysis.memory.snapshot import other_devices_message
from sftprof.analysis.memory.safe_pickle import safe_load_file
from sftprof.analysis.schema import check
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.trace.check import CATEGORY_ALIAS_NOTE, MAX_TID, validate_trace
from sftprof.analysis.views.split import VIEWS

REPO = Path(__file__).resolve().parents[1]
KERNEL_TRACE = FIXTURE_DIR / "h200_sftprof_kernel.trace.json.gz"
SNAPSHOT = FIXTURE_DIR / "h200_sftprof_memory.snapshot.pickle.gz"
SNAP_NAME = "snapshot_rank{r}_pp0_dp0_cp0_tp0_ep0.pickle"


def _cli(*args):
    return subprocess.run([sys.executable, str(REPO / "postprocess_profile.py"), *map(str, args)],
                          cwd=REPO, capture_output=True, text=True)


def _strict(text):
    def refuse(token):
        raise ValueError(f"non-finite {token}")
    return json.loads(text, parse_constant=refuse)


def _trace_text(trace: dict) -> str:
    """Chrome-trace text laid out as torch.profiler writes it (one event per line)."""
    head = "".join(f"{json.dumps(k)}: {json.dumps(v)},\n" for k, v in trace.items() if k != "traceEvents")
    return "{\n" + head + '"traceEvents": [\n' + ",\n".join(json.dumps(e) for e in trace["traceEvents"]) + "\n]}\n"


@pytest.fixture(scope="module")
def full_trace():
    return json.loads(gzip.decompress(KERNEL_TRACE.read_bytes()))


@pytest.fixture(scope="module")
def small_trace(full_trace):
    """The real kernel trace cut to the first 3 ms of the forward (330 events: CPU ops, CUDA API calls,
    33 kernels, flows, annotations) + its metadata, less the header's ``distributedInfo.rank`` (0), so that the
    tests may place it as any rank's trace (a trace that records another rank than its name is that file's error)."""
    ev = full_trace["traceEvents"]
    t0 = next(e["ts"] for e in ev if e.get("name") == "sftprof/forward/mb0")
    keep = [e for e in ev if e.get("ph") == "M" or t0 <= e.get("ts", -1) < t0 + 3000]
    info = {k: v for k, v in full_trace["distributedInfo"].items() if k != "rank"}
    return {**{k: v for k, v in full_trace.items() if k != "traceEvents"}, "distributedInfo": info, "traceEvents": keep}


@pytest.fixture(scope="module")
def small_snapshot():
    """The real memory snapshot with its newest 300 allocator events (the ring buffer keeps the newest)."""
    snap = safe_load_file(SNAPSHOT)
    snap["device_traces"] = [t[-300:] for t in snap["device_traces"]]
    return snap


WORLD_SIZE = 32  # the trials' world size: room for every rank the tests place (the fuzz tests' _BATCH)
# The real kernel trace is of an earlier release, which profiled step 1 without a schedule: no ProfilerStep#1 slice
NO_PROFILER_STEP = ("the trace holds no ProfilerStep#<N> slice (a trace of an earlier release, or not recorded with "
                    "the trainer's profiler schedule): that it is step 1 cannot be confirmed; summarised as step 1")


def _log_dir(root: Path, kind="kernel", status="ok", ranks=None) -> Path:
    log = root / "log"
    log.mkdir(parents=True)
    ranks = ranks or [{"rank": 0, "step_time_s": 0.2, "mem_peak_allocated_gb": 21.0, "mem_peak_reserved_gb": 22.0}]
    recs = [{"type": "step", "step": 1, "step_time_s": 0.2, "tokens": 4096, "tokens_per_s": 20480.0,
             "mem_peak_allocated_gb": ranks[0]["mem_peak_allocated_gb"],
             "mem_peak_reserved_gb": ranks[0]["mem_peak_reserved_gb"], "profiled": True, "ranks": ranks},
            {"type": "complete", "status": status, "error": None if status == "ok" else "ChildFailedError",
             "steps_done": 2, "world_size": WORLD_SIZE, "backend": "megatron", "device": "cuda",
             "profile_kind": kind, "profile_step": 1}]
    (log / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return log


def _put_trace(log: Path, rank: int, text: str | bytes) -> Path:
    d = log / "perf_tracer"
    d.mkdir(exist_ok=True)
    p = d / f"traces-r{rank}.chrome.json"
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return p


def _put_snapshot(log: Path, name: str, data: bytes) -> Path:
    d = log / "memory_snapshots" / "step_1"
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)
    return d / name


# ---------------------------------------------------------------------------------------------------------
# Rule 1: one odd file is that file's error; every other file is processed; the summary is written; exit 1
# ---------------------------------------------------------------------------------------------------------
def test_odd_snapshot_is_its_own_error(tmp_path, small_snapshot):
    log = _log_dir(tmp_path, kind="memory")
    _put_snapshot(log, SNAP_NAME.format(r=0), pickle.dumps({"segments": [1, 2], "device_traces": []}))
    _put_snapshot(log, SNAP_NAME.format(r=1), pickle.dumps(small_snapshot, protocol=4))
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "run", "--profile-kind", "memory", "--profile-step", 1)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    s = json.load(open(tmp_path / "run" / "profile_summary.json"))
    src = log / "memory_snapshots" / "step_1" / SNAP_NAME.format(r=0)
    assert s["errors"] == [{"file": f"memory_snapshots/step_1/{SNAP_NAME.format(r=0)}",
                            "error": f"{src}: ValueError: segments[0] is int, expected a dict (not archived)"}]
    assert [m["rank"] for m in s["memory_snapshots"] if "summary" in m] == [1]


def test_empty_files_are_named_empty(tmp_path, small_snapshot):
    """A 0-byte trace or snapshot is that file's error, and its message says the file is empty."""
    log = _log_dir(tmp_path / "mem", kind="memory")
    src = _put_snapshot(log, SNAP_NAME.format(r=0), b"")
    _put_snapshot(log, SNAP_NAME.format(r=1), pickle.dumps(small_snapshot, protocol=4))
    assert _cli("--log-dir", log, "--run-dir", tmp_path / "mem" / "run", "--profile-kind", "memory",
                "--profile-step", 1).returncode == 1
    s = json.load(open(tmp_path / "mem" / "run" / "profile_summary.json"))
    assert s["errors"] == [{"file": f"memory_snapshots/step_1/{SNAP_NAME.format(r=0)}",
                            "error": f"{src}: empty file (0 bytes) (not archived)"}]
    # the status is the training's: the header says so and how many files were read
    md = (tmp_path / "mem" / "run" / "profile_summary.md").read_text().splitlines()
    assert md[3] == "- trial status: **ok** (training); snapshots: 1 of 2 read, 1 error"
    log = _log_dir(tmp_path / "kernel")
    src = _put_trace(log, 0, b"")
    assert _cli("--log-dir", log, "--run-dir", tmp_path / "kernel" / "run", "--profile-kind", "kernel",
                "--profile-step", 1).returncode == 1
    s = json.load(open(tmp_path / "kernel" / "run" / "profile_summary.json"))
    assert [e["error"] for e in s["errors"]] == [f"{src}: empty file (0 bytes)"]
    md = (tmp_path / "kernel" / "run" / "profile_summary.md").read_text().splitlines()
    assert md[3] == "- trial status: **ok** (training); traces: 0 of 1 read, 1 error"


def test_trace_with_damaged_header_and_args_is_processed(tmp_path, small_trace):
    """distributedInfo as a string, kernel args as a string: the worker pool (2 traces) survives both."""
    log = _log_dir(tmp_path)
    bad = json.loads(json.dumps(small_trace))
    bad["distributedInfo"] = "rank 0"
    kernels = [e for e in bad["traceEvents"] if e.get("cat") == "kernel"]
    kernels[0]["args"] = "grid [1, 1, 1]"
    _put_trace(log, 0, _trace_text(bad))
    _put_trace(log, 1, _trace_text(small_trace))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=2)
    assert code == 0 and summary["errors"] == []
    inv = summary["kernel_traces"][0]["summary"]["invalid_events"]
    assert (inv["total"], inv["by_kind"]) == (1, {"args not an object": 1})
    assert summary["warnings"] == [{"file": "perf_tracer/traces-r0.chrome.json", "warning":
                                    "1 invalid events left out of every figure and view: args not an object 1"},
                                   {"file": "perf_tracer/traces-r0.chrome.json", "warning": NO_PROFILER_STEP},
                                   {"file": "perf_tracer/traces-r1.chrome.json", "warning": NO_PROFILER_STEP}]
    ok = summary["kernel_traces"][1]["summary"]["gpu"]
    assert summary["kernel_traces"][0]["summary"]["gpu"]["activities"] == ok["activities"] - 1


def test_any_exception_in_one_trace_is_that_trace_error(tmp_path, small_trace, monkeypatch):
    """An exception type nobody expected (raised here inside the analysis of rank 1 only)."""
    from sftprof.analysis.time import trace_summary

    log = _log_dir(tmp_path)
    _put_trace(log, 0, _trace_text(small_trace))
    marked = json.loads(json.dumps(small_trace))
    marked["traceName"] = "boom"
    _put_trace(log, 1, _trace_text(marked))
    real = trace_summary.KernelTraceAnalyzer.set_header

    def explode(self, header):
        if header.get("traceName") == "boom":
            raise LookupError("unexpected")
        real(self, header)

    monkeypatch.setattr(trace_summary.KernelTraceAnalyzer, "set_header", explode)
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert code == 1
    assert summary["errors"] == [{"file": "perf_tracer/traces-r1.chrome.json",
                                  "error": f"{log / 'perf_tracer' / 'traces-r1.chrome.json'}: LookupError: unexpected"}]
    assert "summary" in summary["kernel_traces"][0]
    views = tmp_path / "run" / "kernel_traces"
    assert sorted(str(p.relative_to(views)) for p in views.rglob("*.json")) == \
        sorted(os.path.relpath(view_path(str(views), 0, v), views) for v in VIEWS)  # no half-written views of rank 1
    assert (tmp_path / "run" / "profile_summary.json").exists()


# ---------------------------------------------------------------------------------------------------------
# Rule 2: invalid events are counted, excluded from every figure, named; dominating them is an error
# ---------------------------------------------------------------------------------------------------------
def test_impossible_times_are_counted_and_excluded(tmp_path, full_trace):
    bad = json.loads(json.dumps(full_trace))
    ev = bad["traceEvents"]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    for e in kernels[:100]:
        e["dur"] = -e["dur"]
    for e in kernels[100:103]:
        e["dur"] = float("nan")
    cpu = [e for e in ev if e.get("cat") == "cpu_op"]
    for e in cpu[:5]:
        del e["ts"]
    ok_kernels = kernels[103:]
    expect_ms = sum(e["dur"] for e in ev if e.get("cat") in ("gpu_memcpy", "gpu_memset")) + \
        sum(e["dur"] for e in ok_kernels)
    log = _log_dir(tmp_path)
    _put_trace(log, 0, _trace_text(bad))  # json.dumps writes the nan durations as NaN
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "run", "--profile-kind", "kernel", "--profile-step", 1)
    assert res.returncode == 0, res.stderr
    s = json.load(open(tmp_path / "run" / "profile_summary.json"))
    k = s["kernel_traces"][0]["summary"]
    assert k["invalid_events"]["total"] == 108
    assert k["invalid_events"]["by_kind"] == {"negative dur": 100, "missing ts": 5, "non-finite dur": 3}
    assert len(k["invalid_events"]["examples"]) == 3  # the first ones in file order, each with its kind
    assert all(x.split(": ", 1)[0] in ("negative dur", "missing ts", "non-finite dur") for x in
               k["invalid_events"]["examples"])
    assert k["gpu"]["activities"] == len(ok_kernels) + 180 + 48
    assert k["gpu"]["total_ms"] == pytest.approx(expect_ms / 1e3, abs=1e-3)
    assert 0 < k["gpu"]["busy_share_pct"] <= 100
    assert s["warnings"] == [{"file": "perf_tracer/traces-r0.chrome.json", "warning":
                              "108 invalid events left out of every figure and view: negative dur 100, "
                              "missing ts 5, non-finite dur 3"},
                             {"file": "perf_tracer/traces-r0.chrome.json", "warning": NO_PROFILER_STEP}]
    views = str(tmp_path / "run" / "kernel_traces")
    chrome = _strict(open(view_path(views, 0, "chrome")).read())["traceEvents"]
    assert sum(e.get("cat") == "kernel" for e in chrome) == len(ok_kernels)
    assert "108 invalid events" in (tmp_path / "run" / "profile_summary.md").read_text()


def test_trace_dominated_by_invalid_events_is_an_error(tmp_path, small_trace):
    bad = json.loads(json.dumps(small_trace))
    timed = [e for e in bad["traceEvents"] if e.get("ph") == "X"]
    for e in timed:
        e["dur"] = -1.0
    n_all = sum(1 for e in bad["traceEvents"])
    log = _log_dir(tmp_path)
    _put_trace(log, 0, _trace_text(bad))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert code == 1
    assert summary["errors"] == [{"file": "perf_tracer/traces-r0.chrome.json", "error":
                                  f"{log / 'perf_tracer' / 'traces-r0.chrome.json'}: {len(timed)} of {n_all} events "
                                  f"are invalid ({len(timed)} invalid events left out of every figure and view: "
                                  f"negative dur {len(timed)}); the trace is not usable"}]
    assert summary["ranks"]["rows"] == []  # no figure of that trace in the rank table


# ---------------------------------------------------------------------------------------------------------
# Rule 3: every view is strict JSON; non-finite numbers become null and are counted
# ---------------------------------------------------------------------------------------------------------
def test_views_are_strict_json(tmp_path, small_trace):
    bad = json.loads(json.dumps(small_trace))
    bad["deviceProperties"][0]["clockRateNaN"] = float("inf")
    cpu = [e for e in bad["traceEvents"] if e.get("cat") == "cpu_op"]
    for e in cpu[:4]:
        e["args"]["Input Dims"] = [[float("nan")], float("-inf")]
    log = _log_dir(tmp_path)
    text = _trace_text(bad)
    assert text.count("NaN") == 5 and text.count("-Infinity") == 4
    _put_trace(log, 0, text)
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert code == 0 and summary["errors"] == []
    k = summary["kernel_traces"][0]["summary"]
    assert k["view_repairs"]["non-finite numbers written as null"] == 9  # 1 in the header + 2 x 4 in args
    assert k["invalid_events"]["total"] == 0
    for v in VIEWS:
        path = view_path(str(tmp_path / "run" / "kernel_traces"), 0, v)
        _strict(open(path).read())
        assert validate_trace(str(path)) == [], v
    chrome = _strict(open(view_path(str(tmp_path / "run" / "kernel_traces"), 0, "chrome")).read())
    assert chrome["deviceProperties"][0]["clockRateNaN"] is None
    assert sum(e.get("args", {}).get("Input Dims") == [[None], None] for e in chrome["traceEvents"]) == 4
    _strict((tmp_path / "run" / "profile_summary.json").read_text())


# ---------------------------------------------------------------------------------------------------------
# Rule 6: headline peaks are the max over ranks, rank named; compare shows every rank of stats.jsonl
# ---------------------------------------------------------------------------------------------------------
def _ranks(peak3):
    return [{"rank": r, "step_time_s": 0.2 + 0.01 * r, "mem_peak_allocated_gb": 21.0 if r != 3 else peak3,
             "mem_peak_reserved_gb": 22.0 + r} for r in range(4)]


def test_peak_of_another_rank_shows_in_summary_and_compare(tmp_path, small_snapshot):
    runs = {}
    for side, peak3 in (("A", 21.0), ("B", 26.0)):
        log = _log_dir(tmp_path / side, kind="memory", ranks=_ranks(peak3))
        _put_snapshot(log, SNAP_NAME.format(r=0), pickle.dumps(small_snapshot, protocol=4))
        runs[side] = tmp_path / f"root{side}" / "memory_step1"
        summary, code = postprocess_trial(str(log), str(runs[side]), "memory", 1)
        assert code == 0, summary["errors"]
    st = summary["stats"]
    assert (st["mem_peak_allocated_gb"], st["mem_peak_allocated_rank"], st["n_ranks"]) == (26.0, 3, 4)
    assert (st["mem_peak_reserved_gb"], st["mem_peak_reserved_rank"]) == (25.0, 3)
    assert st["per_rank"]["3"] == {"step_time_s": 0.23, "mem_peak_allocated_gb": 26.0, "mem_peak_reserved_gb": 25.0}
    md = (runs["B"] / "profile_summary.md").read_text()
    assert "| 1 | 0.200 | 20480.000 | 26.000 (r3) | 25.000 (r3) | max of all | – | – | True |" in md
    res = _cli("compare", runs["A"], runs["B"], "--out", tmp_path / "cmp.md")
    assert res.returncode == 0, res.stderr
    cmp = (tmp_path / "cmp.md").read_text()
    assert ("| peak allocated GiB (stats.jsonl, profiled step, max over ranks: A r0, B r3) | 21.000 | 26.000 | "
            "+5.000 | +23.8% |") in cmp
    assert "| rank 3 peak allocated GiB | 21.000 | 26.000 | +5.000 | +23.8% |" in cmp
    assert "| rank 2 peak allocated GiB | 21.000 | 21.000 | +0.000 | +0.0% |" in cmp  # ranks without a snapshot too


# ---------------------------------------------------------------------------------------------------------
# Rule 7: the failure section names the first failing rank, how it ended, and its log tail
# ---------------------------------------------------------------------------------------------------------
def test_first_failing_rank_from_torchrun_report(tmp_path):
    log = _log_dir(tmp_path, status="failed")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE_DIR / "torchrun_sigkill_launcher.log", run / "launcher.log")
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1)
    assert res.returncode == 0, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    assert s["failure"] == {
        "node": None, "ranks": None, "nodes": [], "rank": 1, "exitcode": -9, "signal": "SIGKILL", "how": "killed by SIGKILL (exit code -9)", "host": "localhost",
        "error_file": None, "traceback": "Signal 9 (SIGKILL) received by PID 7899",
        "log_tail": ["2026-11-30 08:56:04,771 [rank 1] INFO hello from rank 1",
                     "2026-11-30 08:56:04,771 [rank 1] INFO rank 1 about to die"],
        "others": [{"rank": 0, "exitcode": -15, "signal": "SIGTERM", "how": "killed by SIGTERM (exit code -15)"}]}
    md = (run / "profile_summary.md").read_text()
    assert ("- first failing rank: **1** (killed by SIGKILL (exit code -9), host localhost): "
            "`Signal 9 (SIGKILL) received by PID 7899`\n- then: rank 0 killed by SIGTERM (exit code -15)") in md
    assert md.index("## Failure") < md.index("## Log tail: launcher.log")


def test_a_failure_without_its_rank_line_is_named_and_conforms_to_the_schema(tmp_path):
    """A torchrun report entry without its ``rank`` line (a damaged launcher.log) reads as rank None: the summary's
    schema (FailedRank.rank) takes it, where it used to declare an int and refuse the summary in strict mode."""
    from sftprof.analysis.trial.failure import first_failure
    from sftprof.analysis.trial.schema import Failure
    text = (FIXTURE_DIR / "torchrun_sigkill_launcher.log").read_text()
    (tmp_path / "launcher.log").write_text(text.replace("  rank      : 0 (local_rank: 0)\n", ""))
    fail = first_failure(str(tmp_path / "launcher.log"))
    assert fail is not None and fail["rank"] == 1
    assert fail["others"] == [{"rank": None, "exitcode": -15, "signal": "SIGTERM",
                               "how": "killed by SIGTERM (exit code -15)"}]
    assert check(fail, Failure, "failure") == []


def test_failed_trials_header_and_compare_name_the_first_failure_not_the_stopped_rank(tmp_path):
    """Rank 1 SIGKILLed (a real torchrun launcher.log), rank 0 then stopped by torchrun: rank 0's completion record
    says `_Terminated: terminated by SIGTERM ...`, but the summary's header and compare name the first failure, as
    the Failure section does (they used to repeat rank 0's _Terminated); without a Failure section (no launcher.log)
    the completion record's error is the cause."""
    log = _log_dir(tmp_path, status="failed")
    recs = [json.loads(line) for line in (log / "stats.jsonl").read_text().splitlines()]
    recs[-1]["error"] = "_Terminated: terminated by SIGTERM (another rank failed or the launcher stopped the trial)"
    (log / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    runs = [tmp_path / "A" / "trial_A", tmp_path / "B" / "trial_B"]
    for run in runs:
        run.mkdir(parents=True)
        shutil.copy(FIXTURE_DIR / "torchrun_sigkill_launcher.log", run / "launcher.log")
        res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1)
        assert res.returncode == 0, res.stderr
    md = (runs[1] / "profile_summary.md").read_text().splitlines()
    assert md[3] == ("- trial status: **failed** — first failure: `rank 1 killed by SIGKILL (exit code -9): Signal 9 "
                     "(SIGKILL) received by PID 7899`")
    assert "_Terminated" not in "\n".join(md)
    assert ("- first failing rank: **1** (killed by SIGKILL (exit code -9), host localhost): "
            "`Signal 9 (SIGKILL) received by PID 7899`") in md
    res = _cli("compare", runs[0], runs[1], "--out", tmp_path / "cmp.md")
    assert res.returncode == 0, res.stderr
    cmp = (tmp_path / "cmp.md").read_text().splitlines()
    for side in "AB":
        assert (f"**Trial {side} status: failed** (first failure: rank 1 killed by SIGKILL (exit code -9): Signal 9 "
                "(SIGKILL) received by PID 7899): its figures are missing below, not zero.") in cmp
    assert not any("_Terminated" in line for line in cmp)
    # no launcher.log, so no Failure section: the completion record's error is all there is
    run = tmp_path / "C" / "trial_C"
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1)
    assert res.returncode == 0, res.stderr
    md = (run / "profile_summary.md").read_text()
    assert "## Failure" not in md
    assert md.splitlines()[3] == ("- trial status: **failed** — error: `_Terminated: terminated by SIGTERM (another "
                                  "rank failed or the launcher stopped the trial)`")
    res = _cli("compare", runs[0], run, "--out", tmp_path / "cmp2.md")
    assert res.returncode == 0, res.stderr
    assert ("**Trial B status: failed** (_Terminated: terminated by SIGTERM (another rank failed or the launcher "
            "stopped the trial)): its figures are missing below, not zero.") in (tmp_path / "cmp2.md").read_text()


def test_failure_without_error_file_quotes_the_error_the_trainer_logged(tmp_path):
    """A rank that exits with an exception writes no torchrun error file: torchrun's traceback field is then only a
    pointer to its docs, so the Failure line quotes the error the trainer logged for that rank instead (the
    reviewer's case: a damaged safetensors file quoted as torchrun's docs link)."""
    from sftprof.analysis.trial.failure import first_failure
    text = (FIXTURE_DIR / "torchrun_sigkill_launcher.log").read_text()
    text = text.replace("2026-11-30 08:56:04,771 [rank 1] INFO rank 1 about to die",
                        "2026-11-30 08:56:04,771 [rank 1] ERROR trial failed after 0 completed step(s): SafetensorError: "
                        "Error while deserializing header: header too large\nTraceback (most recent call last):")
    text = text.replace("exitcode  : -9 (pid: 7899)  (SIGKILL)", "exitcode  : 1 (pid: 7899)")
    text = text.replace("traceback : Signal 9 (SIGKILL) received by PID 7899",
                        "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    (tmp_path / "launcher.log").write_text(text)
    fail = first_failure(str(tmp_path / "launcher.log"))
    assert (fail["rank"], fail["how"], fail["traceback"]) == (
        1, "exit code 1", "SafetensorError: Error while deserializing header: header too large")
    # a rank that logged no such line, and left no traceback: never torchrun's docs pointer, but what is missing
    (tmp_path / "launcher.log").write_text(text.replace("ERROR trial failed after 0 completed step(s)", "ERROR other"))
    assert first_failure(str(tmp_path / "launcher.log"))["traceback"] == (
        "no error text found: the rank wrote no torchrun error file and left no traceback, `trial failed` or "
        "configuration error line in launcher.log (or rank 0's trainer.log)")


def test_failure_before_the_log_dir_quotes_the_trainers_configuration_error(tmp_path):
    """A trial whose trainer refused its configuration (here a model dir with a damaged tokenizer.json, the
    reviewer's case) exits with status 2 before its log dir or its [rank N] logging exist: the Failure line quotes
    the trainer's 'sftprof: configuration error: ...' line from launcher.log (a real one), not torchrun's docs
    pointer."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE_DIR / "torchrun_config_error_launcher.log", run / "launcher.log")
    res = _cli("--log-dir", tmp_path / "never_created", "--run-dir", run, "--profile-kind", "kernel",
               "--profile-step", 0)
    assert res.returncode == 2
    error = ("sftprof: configuration error: /tmp/pp14b_repro/D: cannot load its Hugging Face tokenizer "
             "(JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); accepted: a directory with "
             "readable tokenizer files (tokenizer.json, tokenizer.model, vocab.json, tokenizer_config.json), or none "
             "of them (the bundled Qwen BPE of the model's family)")
    s = json.load(open(run / "profile_summary.json"))
    assert (s["status"], s["failure"]["rank"], s["failure"]["how"], s["failure"]["traceback"]) == (
        "failed", 1, "exit code 2", error)
    assert (f"- first failing rank: **1** (exit code 2, host localhost): `{error}`\n"
            "- then: rank 0 killed by SIGTERM (exit code -15)") in (run / "profile_summary.md").read_text()
    # another exit status is not the trainer's configuration error (and torchrun's docs pointer is never quoted)
    from sftprof.analysis.trial.failure import NO_ERROR_TEXT, first_failure
    text = (run / "launcher.log").read_text()
    (run / "launcher.log").write_text(text.replace("exitcode  : 2 (pid: 15763)", "exitcode  : 1 (pid: 15763)"))
    assert first_failure(str(run / "launcher.log"))["traceback"] == NO_ERROR_TEXT
    # two ranks' messages glued on one line (each rank wrote its text and its newline separately, seen in 1 of 5
    # runs): one message is quoted, not both
    lines = text.splitlines(keepends=True)
    (run / "launcher.log").write_text(lines[0].rstrip("\n") + lines[1] + "\n" + "".join(lines[2:]))
    assert first_failure(str(run / "launcher.log"))["traceback"] == error


def test_failure_before_logging_quotes_the_workers_exception_not_torchruns_docs_link(tmp_path):
    """A rank that died of an uncaught exception before the trainer's logging began (a real launcher.log: every
    rank's MemoryError in make_fake_sample with profile.fake_seq_len=99999999999999999999, before the config bounded
    it) gets its traceback's exception line in the Failure section, not torchrun's pointer to its docs."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE_DIR / "torchrun_memory_error_launcher.log", run / "launcher.log")
    res = _cli("--log-dir", tmp_path / "never_created", "--run-dir", run, "--profile-kind", "kernel",
               "--profile-step", 0)
    assert res.returncode == 2
    s = json.load(open(run / "profile_summary.json"))
    assert (s["status"], s["failure"]["rank"], s["failure"]["how"], s["failure"]["traceback"]) == (
        "failed", 1, "exit code 1", "MemoryError")
    md = (run / "profile_summary.md").read_text()
    assert ("- first failing rank: **1** (exit code 1, host localhost): `MemoryError`\n"
            "- then: rank 0 killed by SIGTERM (exit code -15)\n") in md
    assert "To enable traceback" not in md[md.index("## Failure"):md.index("## Log tail")]


def test_torchrun_crash_before_any_worker_gets_a_failure_section(tmp_path):
    """torchrun itself died before starting a worker (a real launcher.log: OverflowError in its static rendezvous for
    NODE_TIMEOUT=99999999999999999999999, before the driver bounded it): no failure report, no log dir. The summary
    had no Failure section and the end table said '1 unreadable artifact(s)'; now torchrun's exception is the first
    failure."""
    from sftprof.launch import top_finding

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE_DIR / "torchrun_crash_launcher.log", run / "launcher.log")
    res = _cli("--log-dir", tmp_path / "never_created", "--run-dir", run, "--profile-kind", "kernel",
               "--profile-step", 0)
    assert res.returncode == 2
    s = json.load(open(run / "profile_summary.json"))
    assert s["status"] == "failed"
    assert s["failure"] == {
        "node": 0, "ranks": None, "rank": None, "exitcode": None, "signal": None,
        "how": "failed before any worker logged a line", "host": None, "error_file": None,
        "traceback": "OverflowError: Python int too large to convert to C int", "log_tail": [], "others": [],
        "nodes": [], "torchrun": True}
    assert ("## Failure\n\n- first failure: **torchrun on node 0 failed before any worker logged a line** (host –): "
            "OverflowError: Python int too large to convert to C int\n") in (run / "profile_summary.md").read_text()
    assert top_finding(s) == ("first failure: torchrun on node 0 failed before any worker logged a line (see "
                              "profile_summary.md)")
    # two nodes, both records written: node 0's torchrun crash leads (its own record is that crash), node 1 follows;
    # a node without a record would still come first
    from sftprof import launch
    from sftprof.analysis.trial.failure import first_failure
    logs = tmp_path / "logs"
    launch.write_node_record(logs, 0, 1, 3, 2, 2)
    launch.write_node_record(logs, 1, 1, 600, 2, 2)
    fail = first_failure(str(run / "launcher.log"), str(logs), (2, 2))
    assert (fail["node"], fail["ranks"], fail["traceback"], [(n["node"], n["how"]) for n in fail["nodes"]]) == (
        0, [0, 1], "OverflowError: Python int too large to convert to C int", [(1, "torchrun exited with status 1")])
    (logs / "nodes" / "node1.json").unlink()
    assert (first_failure(str(run / "launcher.log"), str(logs), (2, 2))["how"]) == "wrote no end record"


def test_traceback_errors_take_a_chain_once_and_skip_other_processes_lines():
    from sftprof.analysis.trial.failure import traceback_errors
    lines = ["Traceback (most recent call last):", '  File "/x/train_sft_profile.py", line 17, in <module>',
             "[rank 1] INFO another process's line", "    main()", "KeyError: 'a'", "",
             "During handling of the above exception, another exception occurred:", "",
             "Traceback (most recent call last):", '  File "/x/sftprof/trainer.py", line 3, in main',
             "RuntimeError: selected index k out of range",
             "Traceback (most recent call last):",
             '  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>',
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
    assert traceback_errors(lines) == [("RuntimeError: selected index k out of range", False),
                                       ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", True)]


# ---------------------------------------------------------------------------------------------------------
# Rule 8: a full allocator history is flagged with its window start and the setting to raise
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_entries,truncated", [(300, True), (20000, False)])
def test_full_allocator_history_is_flagged(tmp_path, small_snapshot, max_entries, truncated):
    log = _log_dir(tmp_path, kind="memory")
    (log / "config.yaml").write_text(f"memory_profiler:\n  max_entries: {max_entries}\n")
    _put_snapshot(log, SNAP_NAME.format(r=0), pickle.dumps(small_snapshot, protocol=4))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 1)
    x = summary["memory_snapshots"][0]["summary"]
    assert code == 0 and x["trace_entries"] == 300 and x["history"]["truncated"] is truncated
    t0 = small_snapshot["device_traces"][0][0]["time_us"]
    if truncated:
        msg = (f"the allocator history holds max_entries=300 entries: the ring buffer overflowed, events before the "
               f"first kept one (unix time {t0:.0f} us, {x['peak_time_ms']:.3f} ms before the reported peak) are "
               "lost, so the peak and its time are those of the truncated window only; raise MEMORY_MAX_ENTRIES "
               "(memory_profiler.max_entries)")
        assert summary["warnings"] == [{"file": f"memory_snapshots/step_1/{SNAP_NAME.format(r=0)}", "warning": msg}]
        assert f"**truncated window:** {msg}" in (tmp_path / "run" / "profile_summary.md").read_text()
    else:
        assert summary["warnings"] == []


# ---------------------------------------------------------------------------------------------------------
# Rule 9: compare's input errors exit 2 naming the file
# ---------------------------------------------------------------------------------------------------------
def test_compare_input_errors_exit_2(tmp_path, small_snapshot):
    log = _log_dir(tmp_path, kind="memory")
    _put_snapshot(log, SNAP_NAME.format(r=0), pickle.dumps(small_snapshot, protocol=4))
    good = tmp_path / "good"
    assert postprocess_trial(str(log), str(good), "memory", 1)[1] == 0
    text = (good / "profile_summary.json").read_text()
    cut, nokind = tmp_path / "cut", tmp_path / "nokind"
    cut.mkdir()
    nokind.mkdir()
    (cut / "profile_summary.json").write_text(text[: len(text) // 2])
    s = json.loads(text)
    del s["profile_kind"]
    (nokind / "profile_summary.json").write_text(json.dumps(s))
    res = _cli("compare", good, cut)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"error: {cut / 'profile_summary.json'}: not valid JSON (" in res.stderr
    res = _cli("compare", nokind, good)
    assert res.returncode == 2 and (f"error: {nokind / 'profile_summary.json'}: not a profile summary of this "
                                    "version: missing profile_kind; rerun postprocess_profile.py") in res.stderr
    # a run against itself (the same folder, under any name) is refused before anything is read or written
    listing = sorted(p.relative_to(good) for p in good.rglob("*"))
    (tmp_path / "link").symlink_to(good)
    for b in (good, tmp_path / "nokind" / ".." / "good", f"{good}/", tmp_path / "link"):
        res = _cli("compare", good, b)
        assert res.returncode == 2 and res.stdout == "" and res.stderr.splitlines()[-1] == (
            f"postprocess_profile.py compare: error: RUN_A {good} and RUN_B {b} are the same folder: compare sets two "
            "runs side by side (run the driver again for a repeat, whose deltas show run-to-run noise)")
    assert sorted(p.relative_to(good) for p in good.rglob("*")) == listing
    other = tmp_path / "other"  # a second run: a copy of the first
    shutil.copytree(good, other, symlinks=True)
    res = _cli("compare", good, other, "--out", tmp_path / "no" / "such" / "cmp.md")
    assert res.returncode == 2 and (f"error: --out {tmp_path / 'no' / 'such' / 'cmp.md'}: directory "
                                    f"{tmp_path / 'no' / 'such'} does not exist") in res.stderr
    # an existing --out is never overwritten, even an earlier report, and refused before the inputs are read
    summary_md = good / "profile_summary.md"
    before = summary_md.read_bytes()
    res = _cli("compare", good, other, "--out", summary_md)
    assert res.returncode == 2 and res.stdout == "" and (
        f"error: --out {summary_md}: exists; never overwritten: name a new file") in res.stderr
    assert summary_md.read_bytes() == before
    report = tmp_path / "cmp.md"
    assert _cli("compare", good, other, "--out", report).returncode == 0
    report.write_text(report.read_text() + "earlier line\n")
    earlier = report.read_bytes()
    res = _cli("compare", tmp_path / "missing", good, "--out", report)
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py compare: error: --out {report}: exists; never overwritten: name a new file")
    assert report.read_bytes() == earlier
    # the default path keeps an earlier report as .prev<N>.md
    default = other / f"compare_vs_{good.name}.md"
    assert _cli("compare", good, other).returncode == 0
    first = default.read_bytes()
    os.utime(default, (1, 1))  # a rerun that wrote it again would move its modification time
    res = _cli("compare", good, other)  # the same report again: nothing kept, nothing said to be kept or written
    assert res.returncode == 0 and res.stderr.splitlines() == [
        f"[postprocess] {default} unchanged (it already holds this report: same inputs), left as it is"]
    assert default.stat().st_mtime == 1
    assert default.read_bytes() == first and sorted(p.name for p in other.glob("compare_vs_*")) == [default.name]
    default.write_bytes(first + b"earlier line\n")  # an earlier report that differs is kept
    res = _cli("compare", good, other)
    assert res.returncode == 0 and res.stderr.splitlines() == [
        f"[postprocess] kept the earlier report {default} as {other / f'compare_vs_{good.name}.prev1.md'}",
        f"[postprocess] wrote {default}"]
    assert (other / f"compare_vs_{good.name}.prev1.md").read_bytes() == first + b"earlier line\n"
    assert default.read_bytes() == first
    assert sorted(p.name for p in other.glob("compare_vs_*")) == [f"compare_vs_{good.name}.md",
                                                                 f"compare_vs_{good.name}.prev1.md"]


# ---------------------------------------------------------------------------------------------------------
# Rule 10: unrecognised files are listed as skipped; snapshots named any reasonable way are analysed
# ---------------------------------------------------------------------------------------------------------
def test_snapshot_names_and_skipped_files(tmp_path, small_snapshot, small_trace):
    log = _log_dir(tmp_path, kind="memory")
    data = pickle.dumps(small_snapshot, protocol=4)
    _put_snapshot(log, "snapshot_rank2.pickle", data)
    _put_snapshot(log, "from_other_tool.pickle.gz", gzip.compress(data))
    _put_snapshot(log, "notes.txt", b"hello")
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "run", "--profile-kind", "memory", "--profile-step", 1)
    assert res.returncode == 0, res.stderr
    s = json.load(open(tmp_path / "run" / "profile_summary.json"))
    got = [(m["rank"], m["file"], m["coords_from_name"], "summary" in m) for m in s["memory_snapshots"]]
    assert got == [(None, "memory_snapshots/step_1/from_other_tool.pickle.gz", None, True),
                   (2, "memory_snapshots/step_1/snapshot_rank2.pickle", None, True)]
    assert s["skipped"] == [{"file": "memory_snapshots/step_1/notes.txt",
                             "reason": "not a snapshot (*.pickle, *.pickle.gz) or a phases_rank<r>.json sidecar"}]
    assert "[postprocess] skipped memory_snapshots/step_1/notes.txt: not a snapshot" in res.stderr
    assert [r["rank"] for r in s["ranks"]["rows"]] == [2]
    klog = _log_dir(tmp_path / "k")
    _put_trace(klog, 0, _trace_text(small_trace))
    (klog / "perf_tracer" / "notes.json").write_text("{}")
    summary, code = postprocess_trial(str(klog), str(tmp_path / "krun"), "kernel", 1, jobs=1)
    assert code == 0 and summary["skipped"] == [{"file": "perf_tracer/notes.json", "reason":
                                                 "not a trace name the trainer writes (rank<r>.pt.trace.json[.gz], "
                                                 "or the earlier traces-r<r>.chrome.json[.gz])"}]


# ---------------------------------------------------------------------------------------------------------
# Rule 11 (+ issue 15 item 4): made-up tracks use 32-bit tids that no real thread of the process uses
# ---------------------------------------------------------------------------------------------------------
def test_made_up_tids_never_collide_with_real_ones(tmp_path, small_trace):
    bad = json.loads(json.dumps(small_trace))
    host_pid = next(e["pid"] for e in bad["traceEvents"] if e.get("cat") == "cuda_runtime")
    t_end = max(e.get("ts", 0) for e in bad["traceEvents"])
    # A real thread with tid 2**31 - 1, listed after the CUDA API calls (so after the first made-up tid).
    bad["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": host_pid, "tid": MAX_TID,
                               "ts": t_end, "dur": 1.0, "args": {}})
    log = _log_dir(tmp_path)
    _put_trace(log, 0, _trace_text(bad))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert code == 0
    path = view_path(str(tmp_path / "run" / "kernel_traces"), 0, "split_clean.chrome")
    assert validate_trace(str(path)) == []
    clean = json.load(open(path))["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in clean if e.get("name") == "thread_name" and e["pid"] == host_pid}
    assert names[MAX_TID] == f"CPU ops: thread {MAX_TID}"
    made_up = {t for t, n in names.items() if n.startswith(("CUDA API", "Annotations"))}
    assert made_up and all(MAX_TID - 8 < t < MAX_TID for t in made_up)
    assert {e["tid"] for e in clean if e.get("cat") == "cuda_runtime"} <= made_up
    assert summary["kernel_traces"][0]["summary"]["n_events"] == len(bad["traceEvents"])  # counted once, not twice


# ---------------------------------------------------------------------------------------------------------
# Fuzz: seeded truncations and single-byte changes of the real (cut) fixtures
# ---------------------------------------------------------------------------------------------------------
_FUZZ_PER_KIND = 300  # inputs per fixture kind (half truncations, half single-byte changes)
_BATCH = 30  # damaged files per postprocessed trial (one rank each)


def _mutations(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for k in range(_FUZZ_PER_KIND):
        if k % 2 == 0:
            out.append(data[: rng.randrange(len(data))])
        else:
            i = rng.randrange(len(data))
            out.append(data[:i] + bytes([(data[i] + rng.randrange(1, 256)) % 256]) + data[i + 1:])
    return out


def _check_fuzz_summary(summary, code, run, files):
    assert code in (0, 1)
    _strict((run / "profile_summary.json").read_text())
    errors = {e["file"]: e["error"] for e in summary["errors"]}
    for f in files:
        if f in errors:
            assert Path(f).name in errors[f]  # the damaged file is named in its own error
    return errors


def test_fuzz_traces(tmp_path, small_trace):
    """Every fifth damaged trace is left under the profiler's temporary name (issue 48): read from there all the same,
    each trace is summarised or is its own error, never "no artifacts"."""
    data = _trace_text(small_trace).encode()
    inputs = _mutations(data, seed=14)
    n_errors = 0
    for b in range(0, len(inputs), _BATCH):
        log = _log_dir(tmp_path / f"b{b}")
        files = []
        for r, blob in enumerate(inputs[b:b + _BATCH]):
            path = _put_trace(log, r, blob)
            if r % 5 == 0:
                path = path.rename(path.with_name(path.name + ".tmp"))
            files.append(f"perf_tracer/{path.name}")
        run = tmp_path / f"run{b}"
        summary, code = postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)
        assert sorted(t["source"] for t in summary["kernel_traces"]) == sorted(files)
        n_errors += len(_check_fuzz_summary(summary, code, run, files))
        for t in summary["kernel_traces"]:
            for paths in (t.get("views") or {}).values():
                for p in paths:
                    _strict((run / p).read_text())
    assert 0 < n_errors < len(inputs)  # truncations fail, most single-byte changes do not


def test_fuzz_snapshots(tmp_path, small_snapshot):
    data = pickle.dumps(small_snapshot, protocol=4)
    inputs = _mutations(data, seed=15)
    n_errors = 0
    for b in range(0, len(inputs), _BATCH):
        log = _log_dir(tmp_path / f"b{b}", kind="memory")
        for r, blob in enumerate(inputs[b:b + _BATCH]):
            _put_snapshot(log, SNAP_NAME.format(r=r), blob)
        run = tmp_path / f"run{b}"
        summary, code = postprocess_trial(str(log), str(run), "memory", 1)
        files = [f"memory_snapshots/step_1/{SNAP_NAME.format(r=r)}" for r in range(len(inputs[b:b + _BATCH]))]
        n_errors += len(_check_fuzz_summary(summary, code, run, files))
    assert 0 < n_errors < len(inputs)


def _record_faults(trace: dict, rng: random.Random) -> tuple[dict, dict, bool]:
    """A copy of the (cut) trace with a random set of the profiler's faults of its record (issue 35), the counts of
    each kind in the summary they must give, and whether overlapping activities dominate it (its error).

    The trace gets a ``ProfilerStep#1`` slice around it first (a trace of the trainer's schedule), then maybe a
    copy as step 2; the faults go to disjoint thirds of the original's compute stream (its first two kernels ran
    before their launches were recorded, its last ones stay, so that every fault is inside the recording)."""
    t = copy.deepcopy(trace)
    ts = [e["ts"] for e in t["traceEvents"] if "ts" in e]
    host = next(e for e in t["traceEvents"] if e.get("cat") == "cpu_op")
    t["traceEvents"].append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": host["pid"],
                             "tid": host["tid"], "ts": min(ts), "dur": max(ts) - min(ts) + 100.0, "args": {}})
    n_gpu = sum(e.get("cat") in faults.GPU for e in t["traceEvents"])
    n_ops = sum(e.get("cat") == "cpu_op" for e in t["traceEvents"])
    want = {"duplicates": 0, "overlapping": 0, "untimed": 0, "launches_without_activity": 0,
            "activities_without_launch": 0, "other_steps": 0}
    if rng.random() < 0.5:
        t = faults.with_second_step(t, 2, longer_us=rng.choice([0.0, 1e3, 1e6]))
        want["other_steps"] = n_gpu + n_ops
    kernels = faults.stream_activities(trace)[(0, 7)]  # GPU activities of the compute stream
    third = len(kernels) // 3
    ids = [(e["ts"], e["args"]["correlation"]) for e in kernels]
    pick = {(e["ts"], e["args"].get("correlation")): e for e in t["traceEvents"] if e.get("cat") in faults.GPU}
    mine = [pick[i] for i in ids]
    dominated = rng.random() < 0.1
    if dominated:  # more than half of the activities run over their next one
        faults.overrun(mine, list(range(n_gpu // 2 + 1)), 1e6)
        return t, {"overlapping": n_gpu // 2 + 1}, True
    if rng.random() < 0.5:  # from 10 ns (one tick of the trace's clock) to 1 s past the next one's start
        k = rng.randrange(1, third - 2)  # each one's next activity is in the first third too, kept as it is
        faults.overrun(mine, rng.sample(range(2, third - 1), k), rng.choice([0.01, 5.0, 1e6]))
        want["overlapping"] = k
    middle = rng.sample(mine[third:2 * third], third)
    if rng.random() < 0.5:
        k = rng.randrange(1, third // 2)
        faults.untime(middle[:k])
        want["untimed"] = k
    if rng.random() < 0.5:
        k = rng.randrange(1, third // 2)
        faults.drop(t, middle[third // 2:third // 2 + k])
        want["launches_without_activity"] = k
    if rng.random() < 0.5:
        ops = [e for e in t["traceEvents"] if e.get("cat") == "cpu_op" and e["ts"] < max(ts)]  # the original's
        k = rng.randrange(1, len(ops))
        faults.duplicate(t, rng.sample(ops, k) + mine[-3:])
        want["duplicates"] = k + 3
    return t, want, False


_OLD_SPELLING = {"kernel": "Kernel", "gpu_memcpy": "Memcpy", "gpu_memset": "Memset", "cuda_runtime": "Runtime"}


def test_fuzz_record_faults(tmp_path, small_trace):
    """Seeded sets of the profiler's faults of its record (sftprof/analysis/trace/sanity.py) on the real cut trace,
    30 ranks per trial, some with another kineto version's category spellings (issue 48): each trace's summary counts
    exactly what was done to it and names it in a warning; one that
    overlapping activities dominate is that trace's error; the others are summarised; exit 0 or 1, strict JSON."""
    from sftprof.analysis.trace.sanity import fault_messages

    rng = random.Random(35)
    n_old = 0
    seen = {k: 0 for k in ("duplicates", "overlapping", "untimed", "launches_without_activity", "other_steps")}
    n_errors = 0
    for b in range(2):
        log = _log_dir(tmp_path / f"b{b}")
        wanted = []
        for r in range(_BATCH):
            trace, want, dominated = _record_faults(small_trace, rng)
            old = rng.random() < 0.3  # issue 48: the categories as another kineto version spells them
            if old:
                for e in trace["traceEvents"]:
                    e["cat"] = _OLD_SPELLING.get(e.get("cat"), e.get("cat"))
            _put_trace(log, r, _trace_text(trace))
            wanted.append((want, dominated, old))
        run = tmp_path / f"run{b}"
        summary, code = postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)
        _check_fuzz_summary(summary, code, run, [])
        for t, (want, dominated, old) in zip(summary["kernel_traces"], wanted):
            n_old += old
            src = log / "perf_tracer" / f"traces-r{t['rank']}.chrome.json"
            got = {k: v["count"] for k, v in t["summary"]["sanity"].items() if isinstance(v, dict) and "count" in v}
            if dominated:
                n_errors += 1
                assert got["overlapping"] == want["overlapping"]
                assert t["error"].startswith(f"{src}: {want['overlapping']} of ") and t["error"].endswith(
                    "; the trace is not usable")
                continue
            assert "error" not in t and got == want, t["rank"]
            mine = [w["warning"] for w in summary["warnings"] if w["file"] == t["source"]]
            assert [m for m in mine if m in fault_messages(t["summary"]["sanity"])] == fault_messages(
                t["summary"]["sanity"])
            assert len(fault_messages(t["summary"]["sanity"])) == sum(1 for v in want.values() if v)
            assert any(CATEGORY_ALIAS_NOTE in m for m in mine) == old
            seen.update({k: seen[k] + 1 for k, v in want.items() if v and k in seen})
        assert code == (1 if any(d for _, d, _ in wanted) else 0)
    assert n_errors and n_old and all(seen.values()), seen  # every kind was tried, and the dominated case


def test_fuzz_snapshot_history_faults(tmp_path, small_snapshot):
    """Seeded snapshot faults (issue 35 rule 2, issue 48) on the real snapshot's newest 300 events, each with a phases
    sidecar around its history: no history, events without time_us, a sidecar on another clock, another GPU's memory
    beside the rank's own, a history starting after the step's start, or none of these; each gives the step peak
    only when its history can (a lower bound said so; the rank's own device's), and says why not."""
    rng = random.Random(36)
    log = _log_dir(tmp_path, kind="memory")
    wanted = []
    for r in range(_BATCH):
        snap = copy.deepcopy(small_snapshot)
        trace = snap["device_traces"][0]
        t0, t1 = trace[0]["time_us"], trace[-1]["time_us"]
        phases = {"clock": "unix_us", "phases": [{"name": "sftprof/step", "start_us": t0, "end_us": t1 + 1}]}
        kind = rng.choice(["none", "no_history", "untimed", "other_clock", "other_device", "mid_step"])
        if kind == "other_device":  # issue 48: the same memory on cuda:1 beside the rank's own cuda:0
            other = copy.deepcopy(snap["segments"])
            for seg in other:
                seg["device"] = 1
            snap["segments"] += other
            snap["device_traces"].append(copy.deepcopy(trace))
            phases["device"] = 0
        elif kind == "mid_step":  # issue 48: the history starts after the step's start
            phases["phases"][0]["start_us"] = t0 - rng.choice([1.0, 1e3, 1e6])
        elif kind == "no_history":
            snap["device_traces"] = [[]]
        elif kind == "untimed":
            for e in rng.sample(trace, rng.randrange(1, len(trace) + 1)):
                del e["time_us"]
        elif kind == "other_clock":
            shift = rng.choice([-1, 1]) * rng.choice([3600e6, 1e3 * (t1 - t0 + 1)])
            phases["phases"][0] = {"name": "sftprof/step", "start_us": t0 + shift, "end_us": t1 + 1 + shift}
        _put_snapshot(log, SNAP_NAME.format(r=r), pickle.dumps(snap, protocol=4))
        (log / "memory_snapshots" / "step_1" / f"phases_rank{r}.json").write_text(json.dumps(phases))
        wanted.append(kind)
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 1)
    assert code == 0 and summary["errors"] == []
    scopes = {"none": "profiled_step", "no_history": "dump_time", "untimed": "recorded_window",
              "other_clock": "recorded_window", "other_device": "profiled_step", "mid_step": "profiled_step"}
    starts = {"no_history": "the snapshot holds no allocator history",
              "untimed": " allocator events have no time_us", "other_clock": "the profiled step (sftprof/step, "}
    plain = next(m["summary"] for m in summary["memory_snapshots"] if wanted[m["rank"]] == "none")
    for m in summary["memory_snapshots"]:
        kind, x = wanted[m["rank"]], m["summary"]
        assert x["peak_scope"] == scopes[kind], (m["rank"], kind)
        reason = x["step_peak_unknown"]
        assert (starts[kind] in reason) if kind in starts else (reason is None), (m["rank"], kind, reason)
        assert (x["window_peak_position"] is None) == (kind in starts)
        low = x["step_peak_lower_bound"]
        assert (low is not None) == (kind == "mid_step")
        assert [d["device"] for d in x["devices"]] == ([0, 1] if kind == "other_device" else [0])
        if kind == "other_device":
            assert x["peak_allocated_bytes"] == plain["peak_allocated_bytes"]
        mine = [w["warning"] for w in summary["warnings"] if w["file"] == m["file"]]
        assert mine == [w for w in (reason, low, other_devices_message(x) if kind == "other_device" else None) if w]
    assert set(wanted) == set(scopes)


def test_fuzz_through_the_cli(tmp_path, small_trace, small_snapshot):
    """A few damaged inputs through the command line: exit 0 or 1, never a traceback."""
    for kind, data, put, name in (("kernel", _trace_text(small_trace).encode(), _put_trace, None),
                                  ("memory", pickle.dumps(small_snapshot, protocol=4), _put_snapshot, SNAP_NAME)):
        log = _log_dir(tmp_path / kind, kind=kind)
        for r, blob in enumerate(_mutations(data, seed=16)[:6]):
            put(log, r, blob) if name is None else put(log, name.format(r=r), blob)
        res = _cli("--log-dir", log, "--run-dir", tmp_path / f"run_{kind}", "--profile-kind", kind,
                   "--profile-step", 1)
        assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr
        assert (tmp_path / f"run_{kind}" / "profile_summary.json").exists()


@pytest.mark.parametrize("event,kind", [
    ({"ph": "X", "ts": 1, "dur": -1}, "negative dur"), ({"ph": "X", "ts": 1}, "missing dur"),
    ({"ph": "X", "ts": float("nan"), "dur": 1}, "non-finite ts"), ({"ph": "X", "ts": True, "dur": 1}, "non-numeric ts"),
    ({"ph": "X", "ts": 1, "dur": float("inf")}, "non-finite dur"), ({"ph": "X", "ts": 1, "dur": "2"}, "non-numeric dur"),
    ({"ts": 1}, "no phase"), ({"ph": 5, "ts": 1}, "no phase"), ({"ph": "i"}, "missing ts"),
    ({"ph": "X", "ts": 1, "dur": 2, "args": "x"}, "args not an object"), ({"ph": "M", "name": 3}, "non-string name"),
    ({"ph": "f", "ts": 1, "cat": ["ac2g"]}, "non-string cat"),
    ({"ph": "X", "ts": 1, "dur": 0}, None), ({"ph": "M", "name": "thread_name", "args": {}}, None),
])
def test_event_problem_kinds(event, kind):
    from sftprof.analysis.trace.check import event_problem

    assert event_problem(event) == kind


def test_empty_log_dir_is_an_error_not_a_silent_pass(tmp_path):
    """A log dir with neither stats.jsonl nor traces: exit 1, an error for the missing traces and a warning for the
    missing step records, instead of a summary that reads as 'nothing to report'."""
    (tmp_path / "log").mkdir()
    res = _cli("--log-dir", tmp_path / "log", "--run-dir", tmp_path / "run", "--profile-kind", "kernel",
               "--profile-step", "1")
    assert res.returncode == 1, res.stderr
    s = json.loads((tmp_path / "run" / "profile_summary.json").read_text())
    assert s["status"] == "unknown"
    assert s["errors"] == [{"file": "perf_tracer/rank<rank>.pt.trace.json",
                            "error": "trial status unknown but no artifacts found in the log dir"}]
    assert s["warnings"] == [{"file": "stats.jsonl", "warning": "not found in the log dir: no step records and no "
                                                                "completion record (trial status unknown)"}]


def test_run_dir_that_cannot_be_written_exits_2_before_reading(tmp_path):
    """A --run-dir under a regular file: exit 2 naming the option and the reason, no traceback."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "log").mkdir()
    res = _cli("--log-dir", tmp_path / "log", "--run-dir", tmp_path / "file" / "run")
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1] == (f"postprocess_profile.py: error: --run-dir {tmp_path / 'file' / 'run'}: "
                                           "cannot be written (Not a directory)")


# ---------------------------------------------------------------------------------------------------------
# Reviewer's defects (session 13): damaged config.yaml, missing optional inputs, a missing log dir without
# kind/step, run-root trials without a summary, no matching trials
# ---------------------------------------------------------------------------------------------------------
def _memory_trial(root: Path, small_snapshot) -> Path:
    log = _log_dir(root, kind="memory")
    _put_snapshot(log, SNAP_NAME.format(r=0), pickle.dumps(small_snapshot, protocol=4))
    return log


def test_damaged_config_yaml_is_its_own_error_and_compare_says_settings_unknown(tmp_path, small_snapshot):
    good_log = _memory_trial(tmp_path / "g", small_snapshot)
    (good_log / "config.yaml").write_text("trial_name: g\nactor:\n  num_layers: 2\n")
    good = tmp_path / "good"
    assert postprocess_trial(str(good_log), str(good), "memory", 1)[1] == 0
    log = _memory_trial(tmp_path / "b", small_snapshot)
    (log / "config.yaml").write_text(": : :\n")
    bad = tmp_path / "bad"
    res = _cli("--log-dir", log, "--run-dir", bad)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    s = json.loads((bad / "profile_summary.json").read_text())
    message = (f"{log / 'config.yaml'}: unreadable (ParserError: while parsing a block mapping expected <block end>, "
               f"but found ':' in \"{log / 'config.yaml'}\", line 1, column 1)")
    assert s["config"] is None and s["errors"] == [{"file": "config.yaml", "error": message}]
    assert f"[postprocess] ERROR config.yaml: {message}\n" in res.stderr
    assert s["counts"]["snapshots"] == 1 and "summary" in s["memory_snapshots"][0]  # the rest is processed
    res = _cli("compare", good, bad, "--out", tmp_path / "cmp.md")
    assert res.returncode == 0 and "Traceback" not in res.stderr
    assert f"Settings unknown (the trial's config.yaml, B: {message}); cannot tell what differs." in (
        tmp_path / "cmp.md").read_text().splitlines()


def test_damaged_environment_json_is_its_own_error_and_compare_does_not_compare_variables(tmp_path, small_snapshot):
    good_log = _memory_trial(tmp_path / "g", small_snapshot)
    (good_log / "config.yaml").write_text("actor:\n  num_layers: 2\n")
    (good_log / "environment.json").write_text('{"NCCL_ALGO": "Ring"}\n')
    good = tmp_path / "good"
    assert postprocess_trial(str(good_log), str(good), "memory", 1)[1] == 0
    assert json.loads((good / "profile_summary.json").read_text())["environment"] == {"NCCL_ALGO": "Ring"}
    assert "- environment (recorded variables): `NCCL_ALGO=Ring`" in (good / "profile_summary.md").read_text().splitlines()
    for name, text, why in (("trunc", '{"NCCL_ALGO": "Ri', "unreadable (JSONDecodeError: Unterminated string starting "
                                                          "at: line 1 column 15 (char 14))"),
                            ("list", '["NCCL_ALGO"]', "not a JSON object of texts"),
                            ("number", '{"NCCL_ALGO": 1}', "not a JSON object of texts"),
                            ("null", "null", "not a JSON object of texts"),
                            ("surrogate", '{"NCCL_ALGO": "\\udcff"}', "not a JSON object of texts"),  # no UTF-8
                            ("folder", None, "not a file")):
        log = _memory_trial(tmp_path / name, small_snapshot)
        (log / "config.yaml").write_text("actor:\n  num_layers: 2\n")
        if text is None:
            (log / "environment.json").mkdir()
        else:
            (log / "environment.json").write_text(text)
        run = tmp_path / f"run_{name}"
        res = _cli("--log-dir", log, "--run-dir", run)
        assert res.returncode == 1 and "Traceback" not in res.stderr
        s = json.loads((run / "profile_summary.json").read_text())
        message = f"{log / 'environment.json'}: {why}"
        assert s["environment"] is None and s["errors"] == [{"file": "environment.json", "error": message}]
        assert "- environment: not recorded (no readable environment.json)" in (run / "profile_summary.md").read_text()
        assert s["counts"]["snapshots"] == 1 and "summary" in s["memory_snapshots"][0]  # the rest is processed
    res = _cli("compare", good, tmp_path / "run_list", "--out", tmp_path / "cmp.md")
    assert res.returncode == 0 and "Traceback" not in res.stderr
    lines = (tmp_path / "cmp.md").read_text().splitlines()
    assert "Settings: the configs are identical." in lines
    assert f"Environment variables not compared (B: {tmp_path / 'list' / 'log' / 'environment.json'}: not a JSON " \
           "object of texts)." in lines
    shutil.rmtree(tmp_path / "list")  # the summary's own error is the reason, also without the log dir
    res = _cli("compare", good, tmp_path / "run_list", "--out", tmp_path / "cmp2.md")
    assert res.returncode == 0 and lines == (tmp_path / "cmp2.md").read_text().splitlines()


def test_a_trial_without_versions_json_postprocesses_and_a_damaged_one_is_its_own_error(tmp_path, small_snapshot):
    """A trial of an earlier release (these fixtures) has no ``versions.json``: ``versions`` is null, no error and the
    header says so; a damaged file is its own error (like ``environment.json``) and the rest is processed."""
    log = _memory_trial(tmp_path / "none", small_snapshot)
    summary, code = postprocess_trial(str(log), str(tmp_path / "run_none"), "memory", 1)
    assert code == 0 and summary["versions"] is None and summary["errors"] == []
    assert "- versions: not recorded (no readable versions.json)" in (
        tmp_path / "run_none" / "profile_summary.md").read_text().splitlines()
    # a versions.json of release 3.7's trainer (no sftprof, no nccl): both None, the summary valid
    log = _memory_trial(tmp_path / "old", small_snapshot)
    old = {"python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "megatron_core": "0.19.2",
           "transformer_engine": None, "transformers": "5.17.0", "triton": "3.6.0", "flash_linear_attention": None}
    (log / "versions.json").write_text(json.dumps(old))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run_old"), "memory", 1)
    assert code == 0 and summary["errors"] == [] and summary["versions"] == {**old, "sftprof": None, "nccl": None}
    assert check(json.loads((tmp_path / "run_old" / "profile_summary.json").read_text())) == []
    assert ("- versions: sftprof absent, python 3.12.3, torch 2.11.0+cu130, torch_cuda 13.0, nccl absent, megatron_core "
            "0.19.2, transformer_engine absent, transformers 5.17.0, triton 3.6.0, flash_linear_attention absent") in (
        tmp_path / "run_old" / "profile_summary.md").read_text().splitlines()
    for name, text, why in (("list", '["0.16.1"]', "not a JSON object of texts and nulls"),
                            ("number", '{"torch": 2.11}', "not a JSON object of texts and nulls"),
                            ("empty", "{}", "lacks flash_linear_attention, megatron_core, python, torch, torch_cuda, "
                                            "transformer_engine, transformers, triton"),
                            ("trunc", '{"torch": "2.', "unreadable (JSONDecodeError: Unterminated string starting at: "
                                                       "line 1 column 11 (char 10))"),
                            ("folder", None, "not a file")):
        log = _memory_trial(tmp_path / name, small_snapshot)
        if text is None:
            (log / "versions.json").mkdir()
        else:
            (log / "versions.json").write_text(text)
        summary, code = postprocess_trial(str(log), str(tmp_path / f"run_{name}"), "memory", 1)
        assert code == 1 and summary["versions"] is None
        assert summary["errors"] == [{"file": "versions.json", "error": f"{log / 'versions.json'}: {why}"}]
        assert summary["counts"]["snapshots"] == 1 and "summary" in summary["memory_snapshots"][0]


def test_missing_or_empty_optional_inputs_are_warnings(tmp_path, small_snapshot):
    log = _memory_trial(tmp_path, small_snapshot)
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "run", "--nvidia-smi-csv", tmp_path / "none.csv",
               "--trainer-log", tmp_path / "none.log")
    assert res.returncode == 0, res.stderr
    s = json.loads((tmp_path / "run" / "profile_summary.json").read_text())
    assert s["errors"] == [] and s["warnings"] == [
        {"file": str(tmp_path / "none.log"), "warning": "--trainer-log: not found; the summary goes without it"},
        {"file": str(tmp_path / "none.csv"), "warning": "--nvidia-smi-csv: not found; the summary goes without it"}]
    assert res.stderr.count("[postprocess] WARNING") == 2
    assert f"[postprocess] WARNING {tmp_path / 'none.csv'}: --nvidia-smi-csv: not found" in res.stderr
    (tmp_path / "x.csv").write_text("x\n")
    summary, code = postprocess_trial(str(log), str(tmp_path / "run2"), nvidia_smi_csv=str(tmp_path / "x.csv"))
    assert code == 0 and summary["warnings"] == [
        {"file": str(tmp_path / "x.csv"), "warning": "--nvidia-smi-csv: no sample read (no header naming index and "
                                                     "memory.used, or no row under it); the summary goes without it"}]


def test_missing_log_dir_without_kind_creates_nothing(tmp_path):
    run = tmp_path / "x" / "run"
    res = _cli("--log-dir", tmp_path / "nonexistent", "--run-dir", run)
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py: error: --log-dir {tmp_path / 'nonexistent'} does not exist, so --profile-kind and "
        "--profile-step cannot be read from its stats.jsonl; nothing was written (given both, the trial's summary "
        "is written, as failed)")
    assert sorted(tmp_path.iterdir()) == []


def test_compare_lists_trials_without_summary_and_fails_when_nothing_matches(tmp_path, small_snapshot):
    good = tmp_path / "rootA" / "mem_step1"
    assert postprocess_trial(str(_memory_trial(tmp_path, small_snapshot)), str(good), "memory", 1)[1] == 0
    root_b = tmp_path / "rootB"
    shutil.copytree(good.parent, root_b)
    (root_b / "mem_step2").mkdir()  # planned, never run (STOP_ON_FAILURE) or not postprocessed
    res = _cli("compare", good.parent, root_b, "--out", tmp_path / "cmp.md")
    assert res.returncode == 0, res.stderr
    assert ("- not compared: `mem_step2` in B has no profile_summary.json (a trial not run, e.g. after "
            "STOP_ON_FAILURE, or not postprocessed)") in (tmp_path / "cmp.md").read_text().splitlines()
    (root_b / "mem_step1" / "profile_summary.json").unlink()  # now nothing in B has a summary
    res = _cli("compare", good.parent, root_b, "--out", tmp_path / "cmp2.md")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py compare: error: {root_b}: no profile_summary.json in it or in its sub-directories; "
        "run postprocess first")
    # a folder of run roots is not guessed at: the message names them
    multi = tmp_path / "multi"
    shutil.copytree(good.parent, multi / "rootA")
    res = _cli("compare", good.parent, multi, "--out", tmp_path / "cmp_multi.md")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py compare: error: {multi}: not a trial run dir or a RUN_ROOT: it holds a run root "
        f"(rootA) whose trials have profile_summary.json; pass it (e.g. {multi / 'rootA'}): compare takes one trial "
        "run dir or RUN_ROOT per side")
    shutil.copytree(good.parent, multi / "rootC")
    (multi / "notes").mkdir()
    res = _cli("compare", good.parent, multi, "--out", tmp_path / "cmp_multi.md")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py compare: error: {multi}: not a trial run dir or a RUN_ROOT: it holds run roots "
        f"(rootA, rootC) whose trials have profile_summary.json; pass one of them (e.g. {multi / 'rootA'}): compare "
        "takes one trial run dir or RUN_ROOT per side")
    assert not (tmp_path / "cmp_multi.md").exists()
    # No trial matches (memory trials match by step): the report is written and printed, exit 1
    s = json.loads((good / "profile_summary.json").read_text())
    s["profile_step"] = 2
    (root_b / "mem_step2" / "profile_summary.json").write_text(json.dumps(s))
    res = _cli("compare", good.parent, root_b, "--out", tmp_path / "cmp3.md")
    report = (tmp_path / "cmp3.md").read_text()
    no_match = ("No trials match (kernel trials after step 0 pool together; kernel step 0 and memory trials match by "
                "step).")
    assert res.returncode == 1 and report.splitlines()[-1] == no_match
    assert "- unmatched: memory step 2 only in B (`mem_step2`)" in report and res.stdout == report + "\n"
    assert res.stderr.splitlines()[-1] == f"[postprocess] ERROR: {no_match} Nothing was compared."


def test_empty_stats_and_a_step_record_without_a_step_index_are_warned(tmp_path, small_trace):
    """An empty stats.jsonl is a warning (not a silent 'status unknown'); a step record whose step is not a
    non-negative integer is an unparsable line: counted, left out of the Steps table, warned."""
    log = _log_dir(tmp_path)
    _put_trace(log, 0, _trace_text(small_trace))
    good = (log / "stats.jsonl").read_text()
    (log / "stats.jsonl").write_text("")
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "run", "--profile-kind", "kernel", "--profile-step", "1")
    s = json.loads((tmp_path / "run" / "profile_summary.json").read_text())
    assert res.returncode == 0 and s["status"] == "unknown" and s["errors"] == [], res.stderr
    assert s["warnings"] == [{"file": "perf_tracer/traces-r0.chrome.json", "warning": NO_PROFILER_STEP},
                             {"file": "stats.jsonl", "warning": "empty: no step records and no completion record "
                                                                "(trial status unknown)"}]
    assert ("[postprocess] WARNING stats.jsonl: empty: no step records and no completion record (trial status "
            "unknown)") in res.stderr.splitlines()
    (log / "stats.jsonl").write_text("garbage\n" + json.dumps({"type": "step", "step": "x"}) + "\n" + good)
    s, code = postprocess_trial(str(log), str(tmp_path / "run2"), "kernel", 1, jobs=1)
    assert code == 0 and s["status"] == "ok" and [x["step"] for x in s["stats"]["steps"]] == [1]
    assert s["warnings"] == [{"file": "perf_tracer/traces-r0.chrome.json", "warning": NO_PROFILER_STEP},
                             {"file": "stats.jsonl", "warning": "2 unparsable lines skipped (not a JSON object of a "
                              "known type, or a step record whose step is not a non-negative integer)"}]
    md = (tmp_path / "run2" / "profile_summary.md").read_text()
    assert "| 1 |" in md and "| x |" not in md
    (log / "stats.jsonl").write_text("garbage\n")  # nothing valid in it
    s, code = postprocess_trial(str(log), str(tmp_path / "run3"), "kernel", 1, jobs=1)
    assert code == 0 and s["warnings"] == [
        {"file": "perf_tracer/traces-r0.chrome.json", "warning": NO_PROFILER_STEP},
        {"file": "stats.jsonl", "warning": "1 unparsable lines skipped (not a JSON object of a known type, or a step "
                                           "record whose step is not a non-negative integer)"},
        {"file": "stats.jsonl", "warning": "no valid line: no step records and no completion record (trial status "
                                           "unknown)"}]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_postprocess_removes_its_temporary_folder(tmp_path, sig):
    """SIGTERM (or SIGHUP) while the summary's CPU ops are on disk ends postprocess_profile.py as an exit does: its
    temporary folder (sftprof_cpu_ops_<pid>_*, in TMPDIR) is removed and the status is 128 + the signal."""
    log = _log_dir(tmp_path)
    (log / "perf_tracer").mkdir()
    shutil.copy(KERNEL_TRACE, log / "perf_tracer" / "traces-r0.chrome.json.gz")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    def stores():  # (other temporary files of the libraries may come and go in TMPDIR)
        return [n for n in os.listdir(tmp) if n.startswith("sftprof_cpu_ops_")]

    for _ in range(5):  # a run that ends before it is caught with its store (a loaded machine) is run again
        proc = subprocess.Popen([sys.executable, str(REPO / "postprocess_profile.py"), "--log-dir", str(log),
                                 "--run-dir", str(tmp_path / "run")], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))  # not ignored, as under nohup
        while not stores() and proc.poll() is None:  # the store's folder, made before the trace is read
            time.sleep(0.002)
        proc.send_signal(signal.SIGSTOP)  # held still: the signal below is handled while the store is there
        made = stores()
        if made and proc.poll() is None:
            break
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=120)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    err = proc.communicate(timeout=120)[1]
    assert len(made) == 1 and made[0].startswith(f"sftprof_cpu_ops_{proc.pid}_")
    assert proc.returncode == 128 + sig and "Traceback" not in err
    assert stores() == []


def test_a_hangup_ignored_on_entry_stays_ignored():
    """Under nohup (SIGHUP ignored on entry) a hang-up does not stop the postprocess; SIGTERM still does."""
    code = ("import os, signal, sys\nfrom sftprof.cli import run_main\n"
            "def main():\n    os.kill(os.getpid(), signal.SIGHUP)\n    print('after SIGHUP', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n    print('after SIGTERM')\n"
            "run_main(main, stop_signals=True)\n")
    res = subprocess.run(["nohup", sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (res.returncode, res.stdout) == (143, "after SIGHUP\n")
