"""postprocess_profile.py end to end on real traces (CPU, profiled here) and the real H200 snapshot."""
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fixtures import gpu_snapshot_fixtures, make_cpu_trace, two_gpu_sync_traces
from fixtures.faults import full_disk_on_append
from sftprof.analysis.memory.snapshot import analyze_snapshot
from sftprof.analysis.memory.safe_pickle import safe_load_file
from sftprof.artifacts import TRIAL_NAME_RE, view_path
from sftprof.launch import folders
from sftprof.analysis.compare import stats
from sftprof.analysis.compare.runs import compare_runs
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.trial.inputs import other_trial, read_nvidia_smi
from sftprof.analysis.trace.check import validate_trace

REPO = Path(__file__).resolve().parents[1]
VIEWS = ("chrome", "split_clean.chrome", "gpu_only.chrome", "cpu_only.chrome", "cuda_api_only.chrome")
COORDS = {"0": {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0, "etp": 0},
          "1": {"pp": 0, "dp": 1, "cp": 0, "tp": 0, "ep": 1, "etp": 0}}


def _cli(*args, env=None, stdin=None):
    return subprocess.run([sys.executable, str(REPO / "postprocess_profile.py"), *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, env=env, input=stdin)


def _stats(path, status="ok", step=1, step_time=2.0, error=None, kind="kernel", device="cuda", world_size=2):
    recs = []
    for s in range(step + 1 if status == "ok" else step):
        t = step_time + 0.5 * (s != step)
        recs.append({"type": "step", "step": s, "loss": 2.0, "step_time_s": t, "tokens": 4096, "tokens_per_s": 4096 / t,
                     "mem_allocated_gb": 1.0, "mem_reserved_gb": 2.0, "mem_peak_allocated_gb": 3.0 + s,
                     "mem_peak_reserved_gb": 4.0 + s, "tflops_per_gpu": None, "mfu": None, "profiled": s == step,
                     "ranks": [{"rank": 0, "step_time_s": t, "mem_peak_allocated_gb": 3.0 + s, "mem_peak_reserved_gb": 4.0},
                               {"rank": 1, "step_time_s": t * 1.1, "mem_peak_allocated_gb": 2.5 + s,
                                "mem_peak_reserved_gb": 4.0}]})
    recs.append({"type": "complete", "status": status, "error": error, "steps_done": len(recs),
                 "world_size": world_size,
                 "backend": "fsdp", "device": device, "profile_kind": kind, "profile_step": step})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.fixture(scope="module")
def cpu_traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu_traces")
    # step 1 of the trials below, recorded as the trainer records it (ProfilerStep#1)
    return [make_cpu_trace(d / "r0.json", n_mbs=2, profiler_step=True, step=1),
            make_cpu_trace(d / "r1.json", n_mbs=3, seed=1, profiler_step=True, step=1)]


def _kernel_log_dir(root, traces, step_time=2.0, world_size=2):
    log = root / "log"
    (log / "perf_tracer").mkdir(parents=True)
    for r, t in enumerate(traces):
        # rank 1 keeps the name of earlier releases (traces-r<r>.chrome.json): both are read
        shutil.copy(t, log / "perf_tracer" / (f"rank{r}.pt.trace.json" if r == 0 else f"traces-r{r}.chrome.json"))
    _stats(log / "stats.jsonl", step_time=step_time, world_size=world_size)
    (log / "rank_coords.json").write_text(json.dumps(
        {"world_size": world_size, "allocation_mode": f"fsdp:d{world_size}", "backend": "fsdp", "ranks": COORDS}))
    return log


def test_kernel_trial_end_to_end_and_rerun_is_identical(tmp_path, cpu_traces):
    log = _kernel_log_dir(tmp_path, cpu_traces)
    smi = tmp_path / "nvidia_smi.csv"
    smi.write_text("timestamp, index, utilization.gpu [%], memory.used [MiB], memory.total [MiB]\n"
                   "2026/11/29 22:00:00.000, 0, 12, 1000, 143771\n2026/11/29 22:00:01.000, 0, 97, 90000, 143771\n"
                   "2026/11/29 22:00:01.000, 1, 50, 80000, 143771\n")
    run = tmp_path / "runs" / "tiny_fake256_kernel_step1_x"
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1,
               "--nvidia-smi-csv", smi)
    assert res.returncode == 0, res.stderr
    assert "[postprocess]" in res.stderr
    for r in (0, 1):
        for v in VIEWS:
            json.load(open(view_path(str(run / "kernel_traces"), r, v)))
    s = json.load(open(run / "profile_summary.json"))
    assert s["counts"] == {"traces": 2, "traces_ok": 2, "views": 10, "snapshots": 0, "plots": 0, "errors": 0,
                           "skipped": 0}
    assert s["status"] == "ok" and s["errors"] == [] and s["completion"]["device"] == "cuda"
    # both ranks on one timeline: gloo's collectives run on the host, so no kernel end aligns them (one host, one clock)
    merged = s["merged_view"]
    assert merged["files"] == ["kernel_traces/all_ranks/all_ranks.trace.json"]
    assert [(r["rank"], r["aligned_by"]) for r in merged["ranks"]] == [(0, "reference"), (1, "trace clock")]
    assert validate_trace(str(run / merged["files"][0])) == []
    events = json.load(open(run / merged["files"][0]))["traceEvents"]
    for r in (0, 1):
        view = json.load(open(view_path(str(run / "kernel_traces"), r, "chrome")))["traceEvents"]
        assert sum(e["ph"] != "M" for e in events if e["pid"] == r) == sum(e["ph"] != "M" for e in view) > 0
    md = (run / "profile_summary.md").read_text()  # CPU traces: no GPU wording about waits that cannot exist
    assert md.count("No GPU activity in this trace: no device waits or GPU idle time to report.") == 2
    assert "GPU idle in the step window" not in md and "Blocking CUDA calls" not in md
    assert "Where the ranks' own GPU work differs" not in md and s["ranks"]["work_spread"] is None  # docs/summary.md
    assert s["stats"]["step_time_s"] == s["stats"]["profile_step_record"]["step_time_s"] == 2.0
    assert s["stats"]["max_mem_peak_allocated_gb"] == 4.0
    assert s["nvidia_smi"]["peak_memory_used_mib"] == 90000 and s["nvidia_smi"]["peak_utilization_pct"] == 97
    rows = s["ranks"]["rows"]
    assert [r["coords"] for r in rows] == [COORDS["0"], COORDS["1"]]
    regions = [[x["name"] for x in t["summary"]["regions"]] for t in s["kernel_traces"]]
    assert regions[1] == ["sftprof/step"] + [f"sftprof/{p}/mb{i}" for i in range(3) for p in ("forward", "backward")] \
        + ["sftprof/optimizer_step"]
    steps = [r["step_ms"] for r in rows]
    assert steps == [t["summary"]["step_window"]["wall_ms"] for t in s["kernel_traces"]]
    assert s["ranks"]["imbalance"]["step_ms"]["max_over_min"] == pytest.approx(max(steps) / min(steps), abs=1e-4)
    assert s["ranks"]["imbalance"]["stats_peak_allocated_gb"]["max_over_min"] == pytest.approx(4.0 / 3.5, abs=1e-4)
    md = (run / "profile_summary.md").read_text()
    assert "## Ranks" in md and "sftprof/backward/mb2" in md
    before = ((run / "profile_summary.json").read_bytes(), md)
    counts = "{'traces': 2, 'traces_ok': 2, 'views': 10, 'snapshots': 0, 'plots': 0, 'errors': 0, 'skipped': 0}"
    assert res.stderr.splitlines()[-1] == f"[postprocess] wrote {run / 'profile_summary.json'} (trial status ok, {counts})"
    for name in ("profile_summary.json", "profile_summary.md"):
        os.utime(run / name, (1, 1))  # a rerun that wrote them again would move their modification time
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1,
               "--nvidia-smi-csv", smi)
    assert res.returncode == 0 and "wrote" not in res.stderr and "kept" not in res.stderr
    assert res.stderr.splitlines()[-2:] == [  # the same inputs: left as it is, and said so (docs/postprocessing.md)
        "[postprocess] WARNING profile_summary.json: the summary is unchanged since the last postprocess (same "
        "inputs), left as it is",
        f"[postprocess] {run / 'profile_summary.json'} unchanged (same inputs), left as it is (trial status ok, {counts})"]
    assert ((run / "profile_summary.json").read_bytes(), (run / "profile_summary.md").read_text()) == before
    assert [(run / n).stat().st_mtime for n in ("profile_summary.json", "profile_summary.md")] == [1, 1]
    assert sorted(n for n in os.listdir(run) if n.startswith("profile_summary")) == [
        "profile_summary.json", "profile_summary.md"]


def test_corrupt_trace_is_reported_and_others_processed(tmp_path, cpu_traces):
    log = _kernel_log_dir(tmp_path, cpu_traces, world_size=3)  # rank 2 is one of the trial's
    data = Path(cpu_traces[0]).read_bytes()
    (log / "perf_tracer" / "rank2.pt.trace.json.gz").write_bytes(gzip.compress(data)[:-100])
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 1
    # Rerun with --compress: the plain views of the first run are replaced, not left stale.
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1, "--compress")
    assert res.returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert [e["file"] for e in s["errors"]] == ["perf_tracer/rank2.pt.trace.json.gz"]
    assert s["errors"][0]["error"] == (f"TraceFormatError: {log / 'perf_tracer' / 'rank2.pt.trace.json.gz'}: corrupt "
                                       "compressed stream (Compressed file ended before the end-of-stream marker was "
                                       "reached) near character 0") and "rank2.pt.trace" in res.stderr
    assert s["counts"]["traces"] == 3 and s["counts"]["traces_ok"] == 2 and s["counts"]["views"] == 10
    # One folder per view, one trace per rank in each (what HTA's TraceAnalysis(trace_dir=...) needs).
    folders = ["chrome", "split_clean", "gpu_only", "cpu_only", "cuda_api_only"]
    assert sorted(os.listdir(run / "kernel_traces")) == sorted(folders + ["all_ranks"])  # all_ranks: both ranks in one
    for folder in folders:
        assert sorted(os.listdir(run / "kernel_traces" / folder)) == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]


def test_rerun_on_a_damaged_trace_loses_nothing(tmp_path, cpu_traces):
    """Postprocessing a run dir again after its trace got damaged keeps the rank's earlier views and the earlier
    summary (as profile_summary.prev1.{json,md}); the new summary reports the error and where the old one is."""
    log = _kernel_log_dir(tmp_path, cpu_traces)
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 0
    views = {f: (run / "kernel_traces" / f / "rank0.pt.trace.json").read_bytes() for f in ("chrome", "gpu_only")}
    first = ((run / "profile_summary.json").read_bytes(), (run / "profile_summary.md").read_bytes())
    raw = log / "perf_tracer" / "rank0.pt.trace.json"
    raw.write_bytes(raw.read_bytes()[: len(raw.read_bytes()) // 2])  # truncated
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 1
    assert {f: (run / "kernel_traces" / f / "rank0.pt.trace.json").read_bytes() for f in views} == views
    assert ((run / "profile_summary.prev1.json").read_bytes(), (run / "profile_summary.prev1.md").read_bytes()) == first
    s = json.load(open(run / "profile_summary.json"))
    assert [e["file"] for e in s["errors"]] == ["perf_tracer/rank0.pt.trace.json"]
    assert {"file": "profile_summary.json", "warning": "this run dir had a summary from an earlier postprocess: kept as "
            "profile_summary.prev1.json"} in s["warnings"]
    assert {"file": "perf_tracer/rank0.pt.trace.json", "warning": "rank 0: 5 view file(s) of an earlier postprocess are "
            "kept in kernel_traces/ (not from this trace, which failed)"} in s["warnings"]
    assert {"file": "kernel_traces/all_ranks/all_ranks.trace.json", "warning": "an earlier postprocess's "
            "all-ranks view, left in place: not rebuilt this time, as this postprocess wrote the views of 1 rank(s) "
            "only (it merges two or more); it may not match this summary's traces"} in s["warnings"]
    assert s["kernel_traces"][0]["kept_views"] == sorted(f"kernel_traces/{v}/rank0.pt.trace.json" for v in
                                                          ("chrome", "cpu_only", "cuda_api_only", "gpu_only", "split_clean"))
    assert not [n for n in os.listdir(run) if n.startswith(".staging")]
    second = (run / "profile_summary.json").read_bytes()  # the same damaged inputs again: nothing new to keep
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1)
    assert res.returncode == 1 and "kept as" not in res.stderr
    assert res.stderr.splitlines()[-2:] == [
        "[postprocess] WARNING profile_summary.json: the summary is unchanged since the last postprocess (same "
        "inputs), left as it is; profile_summary.prev1.json holds the one before it",
        f"[postprocess] {run / 'profile_summary.json'} unchanged (same inputs), left as it is (trial status ok, "
        "{'traces': 2, 'traces_ok': 1, 'views': 5, 'snapshots': 0, 'plots': 0, 'errors': 1, 'skipped': 0})"]
    assert (run / "profile_summary.json").read_bytes() == second and not (run / "profile_summary.prev2.json").exists()


def test_end_table_says_how_many_files_a_trials_summary_could_not_read(tmp_path, cpu_traces):
    """Rank 0's trace damaged after the driver recorded its trial ok (summary.tsv status 0), then postprocessed
    standalone; and a trial whose first postprocess, the driver's, met the damaged trace (status 1: train 0,
    postprocess 1). Both rows of the end table say that the summary could not read 1 file (it used to show the first
    as plain ``ok``); summary.tsv, the driver's record of the training, is not rewritten."""
    from sftprof.launch import report
    from sftprof.launch.summaries import top_finding

    log = _kernel_log_dir(tmp_path, cpu_traces)
    root = tmp_path / "run_root"
    rerun, first = root / "kernel_step1_rerun", root / "kernel_step1_first"
    assert _cli("--log-dir", log, "--run-dir", rerun, "--profile-kind", "kernel", "--profile-step", 1).returncode == 0
    raw = log / "perf_tracer" / "rank0.pt.trace.json"
    raw.write_bytes(raw.read_bytes()[: len(raw.read_bytes()) // 2])  # truncated
    tsv = ("trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\trun_dir\tlog_dir\n"
           f"rerun\tkernel\t1\t0\t0\t0\t9\t{rerun}\t{log}\nfirst\tkernel\t1\t1\t0\t1\t9\t{first}\t{log}\n")
    (root / "summary.tsv").write_text(tsv)
    for run in (rerun, first):
        assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 1
    summaries = [json.load(open(run / "profile_summary.json")) for run in (rerun, first)]
    for s in summaries:
        assert s["errors"] == [{"file": "perf_tracer/rank0.pt.trace.json", "error": s["errors"][0]["error"]}]
        assert s["kernel_traces"][1]["summary"] and top_finding(s).endswith("(rank 1)")  # its figures stay
    # the rerun left the first postprocess's all-ranks view, named in its warnings; the first postprocess wrote none
    assert [w["file"] for w in summaries[0]["warnings"] if "all_ranks" in w["file"]] == [
        "kernel_traces/all_ranks/all_ranks.trace.json"]
    assert not (first / "kernel_traces" / "all_ranks").exists()
    assert not [w for w in summaries[1]["warnings"] if "all_ranks" in w["file"]]
    lines = report(root).splitlines()
    assert lines[:3] == [
        "trial          status                                                 step time  peak mem  top finding",
        "kernel step 1  ok (summary: 1 file not read, see its Errors)          2.00 s     4.00 GiB  "
        + top_finding(summaries[0]),
        "kernel step 1  FAILED (1) (summary: 1 file not read, see its Errors)  2.00 s     4.00 GiB  "
        + top_finding(summaries[1])]
    assert (root / "summary.tsv").read_text() == tsv


def test_rerun_without_time_windows_leaves_no_empty_window_folders(tmp_path, cpu_traces):
    """Views split into time windows (small max_view_bytes), then a rerun with the default: the kernel_traces
    folder holds the five view folders only, one trace per rank in each, and the all-ranks view in one file."""
    from sftprof.analysis.summary import postprocess_trial

    log = _kernel_log_dir(tmp_path, cpu_traces)
    run = tmp_path / "run"
    assert postprocess_trial(str(log), str(run), "kernel", 1, max_view_bytes=20000, jobs=1)[1] == 0
    assert {"chrome.part1", "all_ranks.part1"} <= set(os.listdir(run / "kernel_traces"))
    assert postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)[1] == 0
    folders = ["chrome", "cpu_only", "cuda_api_only", "gpu_only", "split_clean"]
    assert sorted(os.listdir(run / "kernel_traces")) == ["all_ranks"] + folders
    assert os.listdir(run / "kernel_traces" / "all_ranks") == ["all_ranks.trace.json"]
    for folder in folders:
        assert sorted(os.listdir(run / "kernel_traces" / folder)) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]


def test_identical_rerun_after_a_changed_one_keeps_no_further_summary(tmp_path, cpu_traces):
    """Plain, then --compress twice: the second --compress rerun leaves the summary (with its "kept as prev1"
    warning) byte for byte and keeps no profile_summary.prev2."""
    from sftprof.analysis.summary import postprocess_trial

    log = _kernel_log_dir(tmp_path, cpu_traces)
    run = tmp_path / "run"
    assert postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)[1] == 0
    s, rc = postprocess_trial(str(log), str(run), "kernel", 1, compress=True, jobs=1)
    kept = {"file": "profile_summary.json", "warning": "this run dir had a summary from an earlier postprocess: "
            "kept as profile_summary.prev1.json"}
    assert rc == 0 and s["warnings"] == [kept]
    after = ((run / "profile_summary.json").read_bytes(), (run / "profile_summary.md").read_bytes())
    s, rc = postprocess_trial(str(log), str(run), "kernel", 1, compress=True, jobs=1)
    assert rc == 0 and s["warnings"] == [{"file": "profile_summary.json", "warning": "the summary is unchanged since "
                                          "the last postprocess (same inputs), left as it is; profile_summary.prev1.json "
                                          "holds the one before it"}]  # nothing was kept now: it does not say 'kept'
    assert ((run / "profile_summary.json").read_bytes(), (run / "profile_summary.md").read_bytes()) == after
    assert sorted(n for n in os.listdir(run) if n.startswith("profile_summary")) == [
        "profile_summary.json", "profile_summary.md", "profile_summary.prev1.json", "profile_summary.prev1.md"]


def test_reruns_keep_one_previous_summary_the_latest(tmp_path, cpu_traces):
    """Plain, --compress, plain again: each rerun differs from the summary before it, which is kept as
    profile_summary.prev1.* (replacing the older copy): one previous copy, never the one just replaced lost."""
    from sftprof.analysis.summary import postprocess_trial

    log = _kernel_log_dir(tmp_path, cpu_traces)
    run = tmp_path / "run"
    written = []
    for compress in (False, True, False):
        assert postprocess_trial(str(log), str(run), "kernel", 1, compress=compress, jobs=1)[1] == 0
        written.append(((run / "profile_summary.json").read_bytes(), (run / "profile_summary.md").read_bytes()))
    assert written[2] != written[1] != written[0]
    assert ((run / "profile_summary.prev1.json").read_bytes(), (run / "profile_summary.prev1.md").read_bytes()) == \
        written[1]
    assert sorted(n for n in os.listdir(run) if n.startswith("profile_summary")) == [
        "profile_summary.json", "profile_summary.md", "profile_summary.prev1.json", "profile_summary.prev1.md"]
    assert {"file": "profile_summary.json", "warning": "this run dir had a summary from an earlier postprocess: "
            "kept as profile_summary.prev1.json"} in json.loads(written[2][0])["warnings"]


def test_leftover_staging_folder_is_reported_not_used(tmp_path, cpu_traces):
    """A staging folder left by an interrupted postprocess is named in a warning and left alone."""
    log = _kernel_log_dir(tmp_path, cpu_traces)
    run = tmp_path / "run"
    (run / ".staging_rank0_zzz" / "chrome").mkdir(parents=True)
    (run / ".staging_rank0_zzz" / "chrome" / "rank0.pt.trace.json").write_text("{}")
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 0
    s = json.load(open(run / "profile_summary.json"))
    assert s["warnings"] == [{"file": ".staging_rank0_zzz", "warning": "staging folders of an interrupted (or concurrent) "
                              "postprocess: partial views or snapshot copies, not part of this summary; safe to delete "
                              "when no postprocess runs"}]
    assert (run / ".staging_rank0_zzz" / "chrome" / "rank0.pt.trace.json").read_text() == "{}"


def test_second_trace_of_a_rank_is_reported(tmp_path, cpu_traces):
    log = _kernel_log_dir(tmp_path, cpu_traces)
    shutil.copy(cpu_traces[0], log / "perf_tracer" / "traces-r0.chrome.json")  # legacy name next to the new one
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"] == [{"file": "perf_tracer/traces-r0.chrome.json", "error": f"{log}/perf_tracer/traces-r0.chrome.json: "
                            "a second trace for rank 0; only rank0.pt.trace.json was processed"}]


def test_a_trace_of_another_step_is_that_files_error(tmp_path, cpu_traces):
    """A step-0 trace copied into a step-1 trial is its file's error, named with the steps it holds; a trace without
    any ProfilerStep slice (earlier releases) is summarised with a warning that its step cannot be confirmed."""
    log = _kernel_log_dir(tmp_path, cpu_traces)
    step0 = make_cpu_trace(tmp_path / "step0.json", profiler_step=True)  # ProfilerStep#0
    shutil.copy(step0, log / "perf_tracer" / "rank0.pt.trace.json")
    make_cpu_trace(log / "perf_tracer" / "traces-r1.chrome.json", n_mbs=3, seed=1)  # no ProfilerStep at all
    run = tmp_path / "run"
    res = _cli("--log-dir", log, "--run-dir", run)  # the step from the trial's record: 1
    assert res.returncode == 1
    src = log / "perf_tracer" / "rank0.pt.trace.json"
    assert (f"[postprocess] ERROR perf_tracer/rank0.pt.trace.json: {src}: the trace holds step 0 (ProfilerStep#0), "
            "not step 1, the step postprocessed: another step's trace, not summarised as step 1"
            ) in res.stderr.splitlines()
    s = json.load(open(run / "profile_summary.json"))
    assert s["profile_step"] == 1 and s["errors"] == [{"file": "perf_tracer/rank0.pt.trace.json", "error": (
        f"{src}: the trace holds step 0 (ProfilerStep#0), not step 1, the step postprocessed: another step's trace, "
        "not summarised as step 1")}]
    assert s["warnings"] == [{"file": "perf_tracer/traces-r1.chrome.json", "warning": (
        "the trace holds no ProfilerStep#<N> slice (a trace of an earlier release, or not recorded with the trainer's "
        "profiler schedule): that it is step 1 cannot be confirmed; summarised as step 1")}]
    assert s["counts"]["traces"] == 2 and s["counts"]["traces_ok"] == 1 and s["counts"]["views"] == 5
    assert "summary" not in s["kernel_traces"][0] and [r["rank"] for r in s["ranks"]["rows"]] == [1]
    assert s["kernel_traces"][1]["summary"]["identity"] == {"profiler_steps": [], "recorded_rank": None}
    assert os.listdir(run / "kernel_traces" / "chrome") == ["rank1.pt.trace.json"]
    # the trial's own step-1 trace: summarised, and its identity recorded
    shutil.copy(cpu_traces[0], src)
    assert _cli("--log-dir", log, "--run-dir", run).returncode == 0
    s = json.load(open(run / "profile_summary.json"))
    assert s["kernel_traces"][0]["summary"]["identity"] == {"profiler_steps": [1], "recorded_rank": None}
    assert [r["rank"] for r in s["ranks"]["rows"]] == [0, 1]


def test_a_rank_outside_the_world_size_is_that_files_error(tmp_path, cpu_traces):
    """rank0's trace renamed rank5 in a world of 2: its file's error, not read, no row in the Ranks table."""
    log = _kernel_log_dir(tmp_path, cpu_traces)
    os.rename(log / "perf_tracer" / "rank0.pt.trace.json", log / "perf_tracer" / "rank5.pt.trace.json")
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run).returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"] == [{"file": "perf_tracer/rank5.pt.trace.json", "error": (
        f"{log}/perf_tracer/rank5.pt.trace.json: rank 5 in the file name is not a rank of the trial: its world size is "
        "2 (the completion record in stats.jsonl); the trace was not read")}]
    assert [r["rank"] for r in s["ranks"]["rows"]] == [1] and s["ranks"]["imbalance"]["step_ms"]["max_over_min"] is None
    assert sorted(os.listdir(run / "kernel_traces" / "chrome")) == ["rank1.pt.trace.json"]
    # without a completion record, the world size comes from rank_coords.json, then from config.yaml's layout
    (log / "stats.jsonl").unlink()
    assert _cli("--log-dir", log, "--run-dir", tmp_path / "run2", "--profile-kind", "kernel",
                "--profile-step", 1).returncode == 1
    s = json.load(open(tmp_path / "run2" / "profile_summary.json"))
    assert s["errors"][0]["error"].endswith("its world size is 2 (rank_coords.json); the trace was not read")
    (log / "rank_coords.json").unlink()
    (log / "config.yaml").write_text("actor:\n  backend: fsdp:d4\n")
    assert _cli("--log-dir", log, "--run-dir", tmp_path / "run3", "--profile-kind", "kernel",
                "--profile-step", 1).returncode == 1
    s = json.load(open(tmp_path / "run3" / "profile_summary.json"))
    assert s["errors"][0]["error"].endswith("its world size is 4 (actor.backend='fsdp:d4' in config.yaml); the trace "
                                            "was not read")


def test_a_copy_of_another_ranks_trace_is_that_files_error(tmp_path):
    """The real 2-GPU traces (distributedInfo.rank 0 and 1, ProfilerStep#2): rank 0's copied as rank 1's is rank
    1's error, and the summary has no imbalance built on identical figures; the real pair passes."""
    rank0, rank1 = two_gpu_sync_traces()
    log = tmp_path / "log"
    (log / "perf_tracer").mkdir(parents=True)
    _stats(log / "stats.jsonl", step=2)
    shutil.copy(rank0, log / "perf_tracer" / "rank0.pt.trace.json.gz")
    shutil.copy(rank0, log / "perf_tracer" / "rank1.pt.trace.json.gz")
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run).returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"] == [{"file": "perf_tracer/rank1.pt.trace.json.gz", "error": (
        f"{log}/perf_tracer/rank1.pt.trace.json.gz: the trace records distributedInfo.rank 0 but its file name says "
        "rank 1: another rank's trace, not summarised as rank 1")}]
    assert s["warnings"] == [] and [r["rank"] for r in s["ranks"]["rows"]] == [0]
    assert s["ranks"]["imbalance"]["step_ms"]["max_over_min"] is None and s["ranks"]["exposed_by_group"] is None
    shutil.copy(rank1, log / "perf_tracer" / "rank1.pt.trace.json.gz")
    assert _cli("--log-dir", log, "--run-dir", run).returncode == 0
    s = json.load(open(run / "profile_summary.json"))
    assert [t["summary"]["identity"] for t in s["kernel_traces"]] == [
        {"profiler_steps": [2], "recorded_rank": 0}, {"profiler_steps": [2], "recorded_rank": 1}]
    assert s["errors"] == [] and [r["rank"] for r in s["ranks"]["rows"]] == [0, 1]


def test_failed_trial_still_gets_a_summary(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    _stats(log / "stats.jsonl", status="failed", error="torch.OutOfMemoryError: CUDA out of memory")
    tlog = tmp_path / "trainer.log"
    tlog.write_text("step 0 ok\nTraceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory\n")
    run = tmp_path / "run"
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1,
               "--trainer-log", tlog, "--nvidia-smi-csv", tmp_path / "absent.csv")
    assert res.returncode == 0, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    assert s["status"] == "failed" and "out of memory" in s["completion"]["error"]
    assert s["trainer_log_tail"][-1] == "torch.OutOfMemoryError: CUDA out of memory"
    assert s["counts"]["traces"] == 0 and s["nvidia_smi"]["available"] is False
    assert "**failed**" in (run / "profile_summary.md").read_text()


def test_standalone_rerun_after_the_driver_reads_the_same_trainer_log_and_leaves_the_summary(tmp_path):
    """The driver passes --trainer-log LOG_DIR/trainer.log; a standalone run without it takes that file by default
    (docs/postprocessing.md), so rerunning it on a trial the driver postprocessed leaves the summary as it is (it used to write a new
    one, keeping the driver's as profile_summary.prev1.*, with trainer_log None its only change), and a failed trial
    postprocessed standalone gets the log's tail."""
    log = tmp_path / "log"
    log.mkdir()
    _stats(log / "stats.jsonl", status="failed", error="torch.OutOfMemoryError: CUDA out of memory")
    (log / "trainer.log").write_text("step 0 ok\nTraceback (most recent call last):\n"
                                     "torch.OutOfMemoryError: CUDA out of memory\n")
    run = tmp_path / "run"
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-step", 1, "--profile-kind", "kernel",
               "--trainer-log", log / "trainer.log")   # as the driver runs it
    assert res.returncode == 0, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    assert s["paths"]["trainer_log"] == str(log / "trainer.log")
    assert s["trainer_log_tail"] == ["step 0 ok", "Traceback (most recent call last):",
                                     "torch.OutOfMemoryError: CUDA out of memory"]
    before = {n: (run / n).read_bytes() for n in ("profile_summary.json", "profile_summary.md")}
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-step", 1, "--profile-kind", "kernel")   # standalone
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[-1].startswith(
        f"[postprocess] {run / 'profile_summary.json'} unchanged (same inputs), left as it is (trial status failed, ")
    assert "kept" not in res.stderr and "wrote" not in res.stderr
    assert {n: (run / n).read_bytes() for n in before} == before
    assert sorted(n for n in os.listdir(run) if n.startswith("profile_summary")) == [
        "profile_summary.json", "profile_summary.md"]
    # standalone from the start (another run dir): the same tail, the same trainer log path
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "run2", "--profile-step", 1, "--profile-kind", "kernel")
    assert res.returncode == 0, res.stderr
    s2 = json.load(open(tmp_path / "run2" / "profile_summary.json"))
    assert (s2["paths"]["trainer_log"], s2["trainer_log_tail"]) == (s["paths"]["trainer_log"], s["trainer_log_tail"])


def test_bad_arguments_are_rejected(tmp_path):
    res = _cli("--log-dir", tmp_path, "--run-dir", tmp_path / "r", "--profile-kind", "cpu", "--profile-step", 1)
    assert res.returncode == 2 and "invalid choice: 'cpu'" in res.stderr and "kernel" in res.stderr


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("snapshot", gpu_snapshot_fixtures()[:1], ids=lambda p: p.name)
def test_memory_trial(tmp_path, snapshot):
    src = tmp_path / "log" / "memory_snapshots" / "step_1"
    src.mkdir(parents=True)
    name = "snapshot_rank0_pp0_dp0_cp1_tp0_ep0.pickle"
    raw = gzip.decompress(snapshot.read_bytes()) if snapshot.suffix == ".gz" else snapshot.read_bytes()
    (src / name).write_bytes(raw)
    snap = pickle.loads(raw)
    trace = snap["device_traces"][0] or snap["device_traces"][1]
    mid = (trace[0]["time_us"] + trace[-1]["time_us"]) / 2
    (src / "phases_rank0.json").write_text(json.dumps({"clock": "unix_us", "phases": [
        {"name": "sftprof/forward/mb0", "start_us": trace[0]["time_us"] - 1, "end_us": mid},
        {"name": "sftprof/backward/mb0", "start_us": mid, "end_us": trace[-1]["time_us"] + 1}]}))
    marker = tmp_path / "pwned"
    (src / "snapshot_rank1_pp0_dp1_cp0_tp0_ep0.pickle").write_bytes(pickle.dumps({"segments": [_Evil(marker)]}))
    _stats(tmp_path / "log" / "stats.jsonl", kind="memory")
    run = tmp_path / "run"
    res = _cli("--log-dir", tmp_path / "log", "--run-dir", run, "--profile-kind", "memory", "--profile-step", 1)
    assert res.returncode == 1 and not marker.exists()
    s = json.load(open(run / "profile_summary.json"))
    assert [e["file"] for e in s["errors"]] == ["memory_snapshots/step_1/snapshot_rank1_pp0_dp1_cp0_tp0_ep0.pickle"]
    assert "refusing to unpickle global" in s["errors"][0]["error"]
    dst = run / "memory_snapshots" / "step_1"
    assert (dst / name).read_bytes() == raw  # archived untouched ...
    # ... and the refused one is not archived: memory_viz would unpickle it with plain pickle and run its global
    assert not (dst / "snapshot_rank1_pp0_dp1_cp0_tp0_ep0.pickle").exists()
    assert s["errors"][0]["error"].endswith("(not archived: opening it with pickle would run that global)")
    from torch.cuda import _memory_viz
    assert len(_memory_viz.trace_plot(pickle.loads((dst / name).read_bytes()))) > 1000  # ... and memory_viz loads it
    assert (dst / "snapshot_rank0_pp0_dp0_cp1_tp0_ep0.png").read_bytes()[:4] == b"\x89PNG"
    m = s["memory_snapshots"][0]
    ref = analyze_snapshot(safe_load_file(src / name), json.load(open(src / "phases_rank0.json")))
    assert m["summary"]["peak_allocated_bytes"] == ref["peak_allocated_bytes"]
    t_peak = trace[0]["time_us"] + ref["peak_time_ms"] * 1e3
    assert m["summary"]["peak_phase"] == ("sftprof/forward/mb0" if t_peak <= mid else "sftprof/backward/mb0")
    row = s["ranks"]["rows"][0]
    assert row["coords"] == {"pp": 0, "dp": 0, "cp": 1, "tp": 0, "ep": 0}
    assert row["snapshot_peak_allocated_gib"] == round(ref["peak_allocated_bytes"] / 2**30, 4)
    assert row["step_ms"] == 2000.0


H200_SNAPSHOT = REPO / "tests" / "fixtures" / "h200_sftprof_memory.snapshot.pickle.gz"
SNAP1 = "snapshot_rank1_pp0_dp1_cp0_tp0_ep0.pickle"
PNG1 = "snapshot_rank1_pp0_dp1_cp0_tp0_ep0.png"


def _memory_log_dir(root, snapshot):
    """The H200 snapshot as rank 0 (.pickle.gz, as checked in) and rank 1 (plain pickle, with a phases sidecar)."""
    src = root / "log" / "memory_snapshots" / "step_1"
    src.mkdir(parents=True)
    (src / "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle.gz").write_bytes(snapshot.read_bytes())
    (src / SNAP1).write_bytes(gzip.decompress(snapshot.read_bytes()))
    (src / "phases_rank1.json").write_text(json.dumps({"clock": "unix_us", "phases": []}))
    _stats(root / "log" / "stats.jsonl", kind="memory")
    return root / "log", src


def test_rerun_on_a_damaged_snapshot_keeps_the_earlier_archive_and_plot(tmp_path, snapshot=H200_SNAPSHOT):
    """A rerun after rank 1's snapshot got truncated: its error, and the archived snapshot, plot and phases sidecar
    of the earlier postprocess stay byte for byte, named in a warning; a rerun on a good snapshot replaces them."""
    log, src = _memory_log_dir(tmp_path, snapshot)
    run = tmp_path / "run"
    dst = run / "memory_snapshots" / "step_1"
    res = _cli("--log-dir", log, "--run-dir", run)
    assert res.returncode == 0, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    assert s["counts"] == {"traces": 0, "traces_ok": 0, "views": 0, "snapshots": 2, "plots": 2, "errors": 0,
                           "skipped": 0}
    assert [m["plot"] for m in s["memory_snapshots"]] == [
        "memory_snapshots/step_1/snapshot_rank0_pp0_dp0_cp0_tp0_ep0.png", f"memory_snapshots/step_1/{PNG1}"]
    earlier = {n: (dst / n).read_bytes() for n in (SNAP1, PNG1, "phases_rank1.json")}
    assert len(earlier[SNAP1]) == 1_009_092 and earlier[PNG1][:4] == b"\x89PNG"

    (src / SNAP1).write_bytes((src / SNAP1).read_bytes()[:50_000])  # head -c 50000
    (src / "phases_rank1.json").write_text(json.dumps({"clock": "unix_us", "phases": [
        {"name": "sftprof/step", "start_us": 0, "end_us": 1}]}))
    res = _cli("--log-dir", log, "--run-dir", run)
    assert res.returncode == 1
    assert {n: (dst / n).read_bytes() for n in earlier} == earlier  # the earlier archive, byte for byte
    s = json.load(open(run / "profile_summary.json"))
    error = (f"ValueError: {src / SNAP1}: not a readable snapshot pickle (UnpicklingError: pickle data was truncated) "
             "(not archived)")
    assert s["errors"] == [{"file": f"memory_snapshots/step_1/{SNAP1}", "error": error}]
    kept = (f"rank 1: 3 file(s) of an earlier postprocess are kept in memory_snapshots/step_1/ (not from this "
            f"snapshot, which failed): phases_rank1.json, {SNAP1}, {PNG1}")
    assert s["warnings"] == [
        {"file": f"memory_snapshots/step_1/{SNAP1}", "warning": kept},
        {"file": "profile_summary.json", "warning": "this run dir had a summary from an earlier postprocess: kept as "
                                                    "profile_summary.prev1.json"}]
    assert f"[postprocess] WARNING memory_snapshots/step_1/{SNAP1}: {kept}" in res.stderr.splitlines()
    m = s["memory_snapshots"][1]
    assert m["archived"] is False and "plot" not in m and m["kept_files"] == [
        f"memory_snapshots/step_1/{n}" for n in ("phases_rank1.json", SNAP1, PNG1)]
    assert s["counts"]["plots"] == 1  # rank 0's, written now; rank 1's is the earlier one
    md = (run / "profile_summary.md").read_text()
    assert (f"Kept from an earlier postprocess (not from this snapshot): `memory_snapshots/step_1/phases_rank1.json`, "
            f"`memory_snapshots/step_1/{SNAP1}`, `memory_snapshots/step_1/{PNG1}`") in md
    assert sorted(os.listdir(run)) == ["memory_snapshots", "profile_summary.json", "profile_summary.md",
                                       "profile_summary.prev1.json", "profile_summary.prev1.md"]  # no staging left

    snap = safe_load_file(snapshot)  # a good, different snapshot (the newest 300 events): replaces all three
    snap["device_traces"] = [t[-300:] for t in snap["device_traces"]]
    good = pickle.dumps(snap, protocol=4)
    (src / SNAP1).write_bytes(good)
    res = _cli("--log-dir", log, "--run-dir", run)
    assert res.returncode == 0, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    # the sidecar's step (0-1 us) lies outside the snapshot's history: no step peak, and a warning says why
    assert s["errors"] == [] and [w["file"] for w in s["warnings"]] == [f"memory_snapshots/step_1/{SNAP1}",
                                                                        "profile_summary.json"]
    assert s["warnings"][0]["warning"].startswith("the profiled step (sftprof/step, 0-1 us in the phases sidecar) lies "
                                                  "outside the recorded allocator history (")
    assert s["memory_snapshots"][1]["summary"]["peak_scope"] == "recorded_window"
    assert s["counts"]["plots"] == 2 and "kept_files" not in s["memory_snapshots"][1]
    assert (dst / SNAP1).read_bytes() == good
    assert (dst / "phases_rank1.json").read_text() == (src / "phases_rank1.json").read_text()
    assert (dst / PNG1).read_bytes()[:4] == b"\x89PNG" and (dst / PNG1).read_bytes() != earlier[PNG1]


def test_first_postprocess_of_a_damaged_snapshot_archives_none_of_it(tmp_path, snapshot=H200_SNAPSHOT):
    """No earlier archive: the truncated snapshot, its sidecar and a plot are not written to the run dir."""
    log, src = _memory_log_dir(tmp_path, snapshot)
    (src / SNAP1).write_bytes((src / SNAP1).read_bytes()[:50_000])
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run).returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"][0]["error"].endswith("(UnpicklingError: pickle data was truncated) (not archived)")
    assert s["warnings"] == [] and "kept_files" not in s["memory_snapshots"][1]
    assert sorted(os.listdir(run / "memory_snapshots" / "step_1")) == [
        "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle.gz", "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.png"]
    assert s["counts"]["plots"] == 1


def test_plots_count_includes_the_model_part_plot(tmp_path):
    """The H200 kernel trace: its model-part plot is written, linked and counted; a rerun on the trace truncated
    keeps that plot and the views, says so, and counts no plot."""
    log = tmp_path / "L_gpu"
    (log / "perf_tracer").mkdir(parents=True)
    trace = log / "perf_tracer" / "rank0.pt.trace.json.gz"
    shutil.copy(REPO / "tests" / "fixtures" / "h200_sftprof_kernel.trace.json.gz", trace)
    run = tmp_path / "R_gpu"
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1)
    assert res.returncode == 0, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    assert s["kernel_traces"][0]["parts_plot"] == "model_parts/rank0.png"
    assert os.listdir(run / "model_parts") == ["rank0.png"]
    assert s["counts"] == {"traces": 1, "traces_ok": 1, "views": 5, "snapshots": 0, "plots": 1, "errors": 0,
                           "skipped": 0}
    assert "- counts: traces 1, traces_ok 1, views 5, snapshots 0, plots 1, errors 0, skipped 0" in (
        run / "profile_summary.md").read_text().splitlines()
    plot = (run / "model_parts" / "rank0.png").read_bytes()
    trace.write_bytes(trace.read_bytes()[:100_000])
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert s["counts"]["plots"] == 0 and (run / "model_parts" / "rank0.png").read_bytes() == plot
    assert s["kernel_traces"][0]["kept_files"] == ["model_parts/rank0.png"]
    assert s["warnings"][:3] == [
        {"file": "perf_tracer/rank0.pt.trace.json.gz", "warning": "rank 0: 5 view file(s) of an earlier postprocess are "
                                                                  "kept in kernel_traces/ (not from this trace, which failed)"},
        {"file": "perf_tracer/rank0.pt.trace.json.gz", "warning": "rank 0: 1 file(s) of an earlier postprocess are kept "
                                                                  "in model_parts/ (not from this trace, which failed): "
                                                                  "rank0.png"},
        {"file": "stats.jsonl", "warning": "not found in the log dir: no step records and no completion record (trial "
                                           "status unknown)"}]


BOGUS_BACKEND = {**os.environ, "MPLBACKEND": "bogus"}  # a backend matplotlib refuses: every plot fails


def _bogus_backend_error(png):
    """The start of the plot error a postprocess under :data:`BOGUS_BACKEND` records for ``png``: matplotlib's refusal
    (its list of the backends it knows follows)."""
    return f"{png}: ValueError: Key backend: 'bogus' is not a valid value for backend; supported values are ["


def _without_run_dir(summary):
    """``summary`` (a profile_summary.json, read) without the members that name its run dir (and trial, its name)."""
    summary["paths"].pop("run_dir"), summary.pop("trial")
    return summary


def test_a_model_part_plot_matplotlib_cannot_draw_is_that_plots_error(tmp_path):
    """Under ``MPLBACKEND=bogus`` the H200 kernel trace's model-part plot cannot be drawn: that is the trace's one
    error (exit 1, as for a trace's error), its views and summary are written, byte for byte as a normal run's, and
    every other figure of the summary is the normal run's; ``--after-trial`` (whose preload fails too) writes the same
    summary. A rerun under it over a normal run's dir keeps the earlier plot, byte for byte, and says so."""
    log = tmp_path / "L"
    (log / "perf_tracer").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "fixtures" / "h200_sftprof_kernel.trace.json.gz",
                log / "perf_tracer" / "rank0.pt.trace.json.gz")
    trial = ("--log-dir", log, "--profile-kind", "kernel", "--profile-step", 1)
    assert _cli(*trial, "--run-dir", tmp_path / "ok").returncode == 0
    res = _cli(*trial, "--run-dir", tmp_path / "bogus", env=BOGUS_BACKEND)
    assert res.returncode == 1, res.stderr
    ok, bogus = (json.load(open(tmp_path / d / "profile_summary.json")) for d in ("ok", "bogus"))
    png = tmp_path / "bogus" / "model_parts" / "rank0.png"
    [error] = bogus.pop("errors")
    assert error["file"] == "perf_tracer/rank0.pt.trace.json.gz"
    assert error["error"].startswith(_bogus_backend_error(png)) and error["error"].endswith(
        "] (model-part plot not drawn)")
    assert f"[postprocess] ERROR perf_tracer/rank0.pt.trace.json.gz: {error['error']}" in res.stderr.splitlines()
    assert not png.exists() and ok["kernel_traces"][0].pop("parts_plot") == "model_parts/rank0.png"
    assert bogus["kernel_traces"][0].pop("parts_plot_error") == error["error"]
    assert (bogus["counts"], ok["counts"]) == ({"traces": 1, "traces_ok": 1, "views": 5, "snapshots": 0, "plots": 0,
                                                "errors": 1, "skipped": 0},
                                               {"traces": 1, "traces_ok": 1, "views": 5, "snapshots": 0, "plots": 1,
                                                "errors": 0, "skipped": 0})
    assert ok.pop("errors") == [] and bogus.pop("counts") and ok.pop("counts")
    assert _without_run_dir(bogus) == _without_run_dir(ok)  # every other figure, finding and warning
    for view in bogus["kernel_traces"][0]["views"].values():
        assert [(tmp_path / "bogus" / p).read_bytes() for p in view] == [
            (tmp_path / "ok" / p).read_bytes() for p in view]
    assert (tmp_path / "bogus" / "profile_summary.md").is_file()
    res = _cli(*trial, "--run-dir", tmp_path / "waited", "--after-trial", 0, env=BOGUS_BACKEND, stdin="[]\n")
    assert res.returncode == 1, res.stderr
    waited = json.load(open(tmp_path / "waited" / "profile_summary.json"))
    assert waited["errors"][0]["error"].startswith(
        _bogus_backend_error(tmp_path / "waited" / "model_parts" / "rank0.png"))
    waited.pop("errors"), waited.pop("counts"), waited["kernel_traces"][0].pop("parts_plot_error")
    assert _without_run_dir(waited) == bogus

    plot = (tmp_path / "ok" / "model_parts" / "rank0.png").read_bytes()
    assert _cli(*trial, "--run-dir", tmp_path / "ok", env=BOGUS_BACKEND).returncode == 1
    again = json.load(open(tmp_path / "ok" / "profile_summary.json"))
    assert (tmp_path / "ok" / "model_parts" / "rank0.png").read_bytes() == plot
    assert again["kernel_traces"][0]["kept_files"] == ["model_parts/rank0.png"]
    assert again["warnings"][0] == {"file": "perf_tracer/rank0.pt.trace.json.gz", "warning": (
        "rank 0: 1 file(s) of an earlier postprocess are kept in model_parts/ (not from this model-part plot, which "
        "failed): rank0.png")}


def test_a_memory_plot_matplotlib_cannot_draw_is_that_plots_error(tmp_path, snapshot=H200_SNAPSHOT):
    """Under ``MPLBACKEND=bogus`` each snapshot's plot is its error (exit 1); the snapshots are still analysed and
    archived, with their sidecar, and every figure of the summary is a normal run's."""
    log, src = _memory_log_dir(tmp_path, snapshot)
    assert _cli("--log-dir", log, "--run-dir", tmp_path / "ok").returncode == 0
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "bogus", env=BOGUS_BACKEND)
    assert res.returncode == 1, res.stderr
    ok, bogus = (json.load(open(tmp_path / d / "profile_summary.json")) for d in ("ok", "bogus"))
    names = ["snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle.gz", SNAP1]
    dst = tmp_path / "bogus" / "memory_snapshots" / "step_1"
    errors = bogus.pop("errors")
    assert [e["file"] for e in errors] == [f"memory_snapshots/step_1/{n}" for n in names]
    for e, png in zip(errors, ("snapshot_rank0_pp0_dp0_cp0_tp0_ep0.png", PNG1)):
        assert e["error"].startswith(_bogus_backend_error(dst / png)) and e["error"].endswith(
            "] (memory plot not drawn)")
    assert sorted(os.listdir(dst)) == sorted(names + ["phases_rank1.json"])  # archived, no plot
    for m, e, n in zip(bogus["memory_snapshots"], errors, names):
        assert m.pop("plot_error") == e["error"] and "plot" not in m and (dst / n).read_bytes() == (
            tmp_path / "ok" / "memory_snapshots" / "step_1" / n).read_bytes()
    for m in ok["memory_snapshots"]:
        m.pop("plot")
    assert (bogus.pop("counts"), ok.pop("counts")) == (
        {"traces": 0, "traces_ok": 0, "views": 0, "snapshots": 2, "plots": 0, "errors": 2, "skipped": 0},
        {"traces": 0, "traces_ok": 0, "views": 0, "snapshots": 2, "plots": 2, "errors": 0, "skipped": 0})
    assert ok.pop("errors") == [] and _without_run_dir(bogus) == _without_run_dir(ok)


def _write_failed_text(path, reason, errno):
    """The :class:`sftprof.atomic.WriteError` text that a write of ``path`` failing with ``reason`` gives (no free
    space: ``errno`` is not for want of space)."""
    return (f"WriteError: [Errno {errno}] cannot write {path}: {reason}; what was there before is left as it was: "
            f"'{path}'")


SNAP0, PNG0 = "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle.gz", "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.png"


def test_an_archive_file_that_cannot_be_moved_into_place_is_its_plots_or_its_snapshots_error(
        tmp_path, snapshot=H200_SNAPSHOT):
    """Reruns with a folder in the place of an archived file (``rm``, ``mkdir``), each writing its summary (exit 1,
    no traceback): rank 0's plot is that plot's error, its snapshot and rank 1's archived as usual; rank 1's sidecar,
    then its snapshot, fail the snapshot before anything of it is moved (the earlier archive and plot kept)."""
    log, src = _memory_log_dir(tmp_path, snapshot)
    run = tmp_path / "run"
    dst = run / "memory_snapshots" / "step_1"
    assert _cli("--log-dir", log, "--run-dir", run).returncode == 0
    earlier = {n: (dst / n).read_bytes() for n in (SNAP1, PNG1)}
    (dst / PNG0).unlink()
    (dst / PNG0).mkdir()
    res = _cli("--log-dir", log, "--run-dir", run)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    [error] = s["errors"]
    assert error["file"] == f"memory_snapshots/step_1/{SNAP0}"
    assert error["error"] == _write_failed_text(dst / PNG0, "Is a directory", 21) + " (memory plot not written)"
    m0, m1 = s["memory_snapshots"]
    assert m0["plot_error"] == error["error"] and "plot" not in m0 and "kept_files" not in m0
    assert "archived" not in m0 and m0["summary"]["peak_allocated_gib"] == m1["summary"]["peak_allocated_gib"]
    assert m1["plot"] == f"memory_snapshots/step_1/{PNG1}" and s["counts"]["plots"] == 1
    assert sorted(os.listdir(dst)) == sorted([SNAP0, PNG0, "phases_rank1.json", SNAP1, PNG1])
    assert os.listdir(dst / PNG0) == [] and (dst / SNAP0).read_bytes() == (src / SNAP0).read_bytes()
    assert sorted(os.listdir(run)) == ["memory_snapshots", "profile_summary.json", "profile_summary.md",
                                       "profile_summary.prev1.json", "profile_summary.prev1.md"]  # no staging left

    (dst / PNG0).rmdir()
    (dst / "phases_rank1.json").unlink()
    (dst / "phases_rank1.json").mkdir()
    snap = safe_load_file(snapshot)  # a good, different snapshot (the newest 300 events)
    snap["device_traces"] = [t[-300:] for t in snap["device_traces"]]
    (src / SNAP1).write_bytes(pickle.dumps(snap, protocol=4))
    res = _cli("--log-dir", log, "--run-dir", run)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    [error] = s["errors"]
    assert error["file"] == f"memory_snapshots/step_1/{SNAP1}"
    assert error["error"] == f"{src / SNAP1}: {_write_failed_text(dst / 'phases_rank1.json', 'Is a directory', 21)} " \
                             "(not archived)"
    m1 = s["memory_snapshots"][1]
    assert m1["archived"] is False and "phases_file" not in m1 and m1["kept_files"] == [
        f"memory_snapshots/step_1/{n}" for n in (SNAP1, PNG1)]
    assert {n: (dst / n).read_bytes() for n in earlier} == earlier and os.listdir(dst / "phases_rank1.json") == []
    assert s["memory_snapshots"][0]["plot"] == f"memory_snapshots/step_1/{PNG0}" and (dst / PNG0).is_file()

    (dst / "phases_rank1.json").rmdir()
    (dst / SNAP1).unlink()
    (dst / SNAP1).mkdir()
    res = _cli("--log-dir", log, "--run-dir", run)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    [error] = s["errors"]
    assert error["error"] == f"{src / SNAP1}: {_write_failed_text(dst / SNAP1, 'Is a directory', 21)} (not archived)"
    m1 = s["memory_snapshots"][1]
    assert m1["archived"] is False and "phases_file" not in m1  # checked before anything moved: the sidecar not
    assert m1["kept_files"] == [f"memory_snapshots/step_1/{PNG1}"] and (dst / PNG1).read_bytes() == earlier[PNG1]
    assert not (dst / "phases_rank1.json").exists() and os.listdir(dst / SNAP1) == []
    assert s["warnings"][0] == {"file": f"memory_snapshots/step_1/{SNAP1}", "warning": (
        f"rank 1: 1 file(s) of an earlier postprocess are kept in memory_snapshots/step_1/ (not from this snapshot, "
        f"which failed): {PNG1}")}


def test_a_file_in_the_place_of_model_parts_is_the_plots_error_and_the_end_table_says_so(tmp_path):
    """``RUN_DIR/model_parts`` a file (``echo hi > model_parts``): rank 0's model-part plot is its error (exit 1, no
    traceback), its views and summary written, the file left as it was. The end table of a run root holding that
    trial, and one whose rank 1 trace is truncated as well, says what its summary lacks: a plot not drawn, a file not
    read."""
    from sftprof.launch import report

    log = tmp_path / "L"
    (log / "perf_tracer").mkdir(parents=True)
    trace = REPO / "tests" / "fixtures" / "h200_sftprof_kernel.trace.json.gz"
    shutil.copy(trace, log / "perf_tracer" / "rank0.pt.trace.json.gz")
    root = tmp_path / "run_root"
    plot_only, both = root / "kernel_step1_plot", root / "kernel_step1_both"
    for run in (plot_only, both):
        run.mkdir(parents=True)
        (run / "model_parts").write_text("hi\n")
    trial = ("--log-dir", log, "--profile-kind", "kernel", "--profile-step", 1)
    res = _cli(*trial, "--run-dir", plot_only)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    s = json.load(open(plot_only / "profile_summary.json"))
    error = (f"{plot_only / 'model_parts' / 'rank0.png'}: FileExistsError: [Errno 17] File exists: "
             f"'{plot_only / 'model_parts'}' (model-part plot not written)")
    assert s["errors"] == [{"file": "perf_tracer/rank0.pt.trace.json.gz", "error": error}]
    t = s["kernel_traces"][0]
    assert t["parts_plot_error"] == error and "parts_plot" not in t and "kept_files" not in t and t["summary"]
    assert sorted(t["views"]) == sorted(VIEWS) and all((plot_only / p).is_file() for v in t["views"].values()
                                                       for p in v)
    assert (plot_only / "model_parts").read_text() == "hi\n" and (plot_only / "profile_summary.md").is_file()
    assert s["counts"] == {"traces": 1, "traces_ok": 1, "views": 5, "snapshots": 0, "plots": 0, "errors": 1,
                           "skipped": 0}

    (log / "perf_tracer" / "rank1.pt.trace.json.gz").write_bytes(trace.read_bytes()[:100_000])
    assert _cli(*trial, "--run-dir", both).returncode == 1
    assert [e["file"] for e in json.load(open(both / "profile_summary.json"))["errors"]] == [
        "perf_tracer/rank1.pt.trace.json.gz", "perf_tracer/rank0.pt.trace.json.gz"]
    (root / "summary.tsv").write_text(
        "trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\trun_dir\tlog_dir\n"
        f"plot\tkernel\t1\t1\t0\t1\t9\t{plot_only}\t{log}\nboth\tkernel\t1\t1\t0\t1\t9\t{both}\t{log}\n")
    status = [line.split("  ")[1].strip() for line in report(root).splitlines()[1:3]]
    assert status == ["FAILED (1) (summary: 1 plot not drawn, see its Errors)",
                      "FAILED (1) (summary: 1 file not read, 1 plot not drawn, see its Errors)"]


@pytest.mark.parametrize("snapshot", gpu_snapshot_fixtures()[:1], ids=lambda p: p.name)
def test_snapshots_of_ranks_outside_the_world_size_are_their_files_errors(tmp_path, snapshot):
    """Copies of rank 0's snapshot named rank8 / rank10 in a world of 2: not analysed, not archived, in no table or
    finding (snapshots hold no rank of their own: their names are checked)."""
    src = tmp_path / "log" / "memory_snapshots" / "step_1"
    src.mkdir(parents=True)
    raw = gzip.decompress(snapshot.read_bytes())
    names = ["snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle", "snapshot_rank10.pickle",
             "snapshot_rank8_pp0_dp0_cp0_tp0_ep0.pickle"]
    for name in names:
        (src / name).write_bytes(raw)
    _stats(tmp_path / "log" / "stats.jsonl", kind="memory")
    run = tmp_path / "run"
    assert _cli("--log-dir", tmp_path / "log", "--run-dir", run).returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"] == [{"file": f"memory_snapshots/step_1/{name}", "error": (
        f"{src / name}: rank {r} in the file name is not a rank of the trial: its world size is 2 (the completion "
        "record in stats.jsonl); not analysed (not archived)")} for name, r in zip(names[1:], (10, 8))]
    assert [r["rank"] for r in s["ranks"]["rows"]] == [0] and s["counts"]["plots"] == 1
    assert s["findings"] and not any("also on" in f["text"] for f in s["findings"])
    assert sorted(os.listdir(run / "memory_snapshots" / "step_1")) == [
        "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle", "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.png"]


EP0, EP1 = "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle", "snapshot_rank0_pp0_dp0_cp0_tp0_ep1.pickle"


def test_a_snapshot_named_for_a_rank_summarised_already_or_at_other_coordinates_is_its_files_error(
        tmp_path, snapshot=H200_SNAPSHOT):
    """Rank 0's snapshot also named ..._ep1 (rank_coords.json records rank 0 at ep0): that file's error, naming both
    coordinates; without rank_coords.json, the second snapshot of rank 0. Either way rank 0 is summarised once (one
    row, one what-if, no "also on rank 0") and an earlier archive and plot of the refused name stay, named."""
    src = tmp_path / "log" / "memory_snapshots" / "step_1"
    src.mkdir(parents=True)
    for name in (EP0, EP1):
        (src / name).write_bytes(gzip.decompress(snapshot.read_bytes()))
    _stats(tmp_path / "log" / "stats.jsonl", kind="memory")
    (tmp_path / "log" / "rank_coords.json").write_text(json.dumps(
        {"world_size": 2, "allocation_mode": "fsdp:d2", "backend": "fsdp", "ranks": COORDS}))
    run = tmp_path / "run"
    dst = run / "memory_snapshots" / "step_1"
    dst.mkdir(parents=True)
    earlier = {EP1: b"an earlier postprocess's archive", EP1.replace(".pickle", ".png"): b"its plot"}
    for name, data in earlier.items():
        (dst / name).write_bytes(data)
    kept = {"file": f"memory_snapshots/step_1/{EP1}", "warning": (
        "rank 0: 2 file(s) of an earlier postprocess are kept in memory_snapshots/step_1/ (not from this snapshot, "
        f"which failed): {EP1}, {EP1.replace('.pickle', '.png')}")}
    coords_error = ("the file name says rank 0 is at pp0 dp0 cp0 tp0 ep1, but rank_coords.json records rank 0 at pp0 "
                    "dp0 cp0 tp0 ep0: not this trial's rank 0 (a snapshot is summarised as rank 0 only under the "
                    "coordinates recorded for it)")
    for recorded, why in ((True, coords_error),
                          (False, f"a second snapshot of rank 0; only {EP0} is summarised as rank 0 (one snapshot a "
                                  "rank)")):
        if not recorded:
            (tmp_path / "log" / "rank_coords.json").unlink()
        res = _cli("--log-dir", tmp_path / "log", "--run-dir", run)
        assert res.returncode == 1, res.stderr
        s = json.load(open(run / "profile_summary.json"))
        error = f"{src / EP1}: {why}; not analysed (not archived)"
        assert s["errors"] == [{"file": f"memory_snapshots/step_1/{EP1}", "error": error}]
        assert f"[postprocess] ERROR memory_snapshots/step_1/{EP1}: {error}" in res.stderr.splitlines()
        assert s["counts"] == {"traces": 0, "traces_ok": 0, "views": 0, "snapshots": 2, "plots": 1, "errors": 1,
                               "skipped": 0}
        assert s["warnings"][0] == kept and s["memory_snapshots"][1]["archived"] is False
        assert [r["rank"] for r in s["ranks"]["rows"]] == [0] and [w["rank"] for w in s["what_if"]] == [0]
        assert s["findings"] and not any("also on" in f["text"] for f in s["findings"])
        md = (run / "profile_summary.md").read_text()
        assert md.count("## Memory snapshot rank 0 (") == 2 and md.count("- peak allocated ") == 1
        assert f"## Memory snapshot rank 0 (`memory_snapshots/step_1/{EP1}`)\n\n**error:** {error}\n" in md
        assert {n: (dst / n).read_bytes() for n in earlier} == earlier
        assert (dst / EP0.replace(".pickle", ".png")).read_bytes()[:4] == b"\x89PNG"


def test_a_damaged_snapshot_does_not_take_its_rank_from_a_readable_one(tmp_path, snapshot=H200_SNAPSHOT):
    """Rank 0's .pickle truncated beside its good .pickle.gz: the first is its error, the second is rank 0's
    snapshot; the plot and phases sidecar the second wrote are not named as kept from an earlier postprocess."""
    src = tmp_path / "log" / "memory_snapshots" / "step_1"
    src.mkdir(parents=True)
    (src / f"{EP0}.gz").write_bytes(snapshot.read_bytes())
    (src / "phases_rank0.json").write_text(json.dumps({"clock": "unix_us", "phases": []}))
    _stats(tmp_path / "log" / "stats.jsonl", kind="memory")
    run = tmp_path / "run"
    assert _cli("--log-dir", tmp_path / "log", "--run-dir", run).returncode == 0  # the earlier archive
    (src / EP0).write_bytes(gzip.decompress(snapshot.read_bytes())[:50_000])
    assert _cli("--log-dir", tmp_path / "log", "--run-dir", run).returncode == 1
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"] == [{"file": f"memory_snapshots/step_1/{EP0}", "error": (
        f"ValueError: {src / EP0}: not a readable snapshot pickle (UnpicklingError: pickle data was truncated) "
        "(not archived)")}]
    assert s["counts"] == {"traces": 0, "traces_ok": 0, "views": 0, "snapshots": 2, "plots": 1, "errors": 1,
                           "skipped": 0}
    assert [m.get("plot") for m in s["memory_snapshots"]] == [None, "memory_snapshots/step_1/" + EP0[:-7] + ".png"]
    assert "kept_files" not in s["memory_snapshots"][0]
    assert [w["file"] for w in s["warnings"]] == ["profile_summary.json"]  # the earlier summary kept, nothing else
    assert [r["rank"] for r in s["ranks"]["rows"]] == [0]


def test_nvidia_smi_variants(tmp_path):
    units = tmp_path / "u.csv"
    units.write_text("timestamp, index, utilization.gpu [%], memory.used [MiB], memory.total [MiB]\n"
                     "t, 0, 35 %, 1024 MiB, 143771 MiB\nt, 0, 70 %, 2048 MiB, 143771 MiB\nt, 1, [N/A], [N/A], 143771 MiB\n")
    got = read_nvidia_smi(str(units))
    assert got["gpus"][0] == {"index": 0, "peak_memory_used_mib": 2048, "memory_total_mib": 143771,
                              "peak_utilization_pct": 70, "mean_utilization_pct": 52.5}
    assert got["gpus"][1]["peak_memory_used_mib"] is None and got["samples"] == 3
    assert read_nvidia_smi(str(tmp_path / "none.csv"))["available"] is False
    (tmp_path / "empty.csv").write_text("")
    assert read_nvidia_smi(str(tmp_path / "empty.csv"))["available"] is False


def _cell(md, row_prefix, col):
    line = next(l for l in md.splitlines() if l.startswith(f"| {row_prefix}"))
    return line.split("|")[col].strip()


def test_compare_runs(tmp_path, cpu_traces):
    summaries = {}
    for side, step_time, traces, chunk in (("A", 2.0, cpu_traces, 0), ("B", 1.5, cpu_traces[::-1], 128)):
        log = _kernel_log_dir(tmp_path / side, traces, step_time=step_time)
        (log / "config.yaml").write_text(  # the trainer's resolved config, as in a real log dir
            f"trial_name: t{side}\nactor:\n  logprobs_chunk_size: {chunk}\nprofile:\n  fake_seq_len: 4096\n")
        run = tmp_path / f"root{side}" / f"tiny_kernel_step1_{side}"
        assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 0
        summaries[side] = json.load(open(run / "profile_summary.json"))
        # the summary carries the config; the log dirs are moved away (a run root copied off the GPU machine)
        assert summaries[side]["config"] == {"trial_name": f"t{side}", "actor": {"logprobs_chunk_size": chunk},
                                             "profile": {"fake_seq_len": 4096}}
        log.rename(log.with_name(log.name + "_moved"))
    out = tmp_path / "cmp.md"
    res = _cli("compare", tmp_path / "rootA", tmp_path / "rootB", "--out", out, "--all-rows")
    assert res.returncode == 0, res.stderr
    md = out.read_text()
    assert "| `actor.logprobs_chunk_size` | 0 | 128 |" in md and "trial_name" not in md and "**Warning:**" not in md
    assert _cell(md, "sftprof/forward/mb0", 1) not in ("", "–")
    # rank 0's CPU-op table: the union of both runs' top ops, the largest (in either run) first, 15 rows at most,
    # each run's own inclusive ms or – (rebuilt from the summaries: which ops lead depends on the CPU's timing)
    ops = [{o["name"]: o["inclusive_ms"] for o in summaries[side]["kernel_traces"][0]["summary"]["top_cpu_ops"]}
           for side in "AB"]
    names = sorted(set(ops[0]) | set(ops[1]), key=lambda n: (-max(ops[0].get(n, 0.0), ops[1].get(n, 0.0)), n))[:15]
    lines = md.splitlines()
    first = lines.index("| CPU op, inclusive (– = not in that run's top 15) | A ms | B ms | Δ (B−A) | Δ % | 95 % CI of Δ "
                        "| samples A/B | verdict |") + 2
    rows = [line.split(" | ") for line in lines[first:first + len(names) + 1]]
    assert [r[0][2:] for r in rows[:len(names)]] == names and rows[len(names)] == [""]
    for name, (_, a_ms, b_ms, *_) in zip(names, rows):
        for cell, side in ((a_ms, ops[0]), (b_ms, ops[1])):
            assert cell == "–" if name not in side else float(cell) == pytest.approx(side[name], abs=1e-3)
    assert md == res.stdout.rstrip("\n") + "\n"
    assert "## kernel step 1: `tiny_kernel_step1_A` (A) vs `tiny_kernel_step1_B` (B)" in md
    assert _cell(md, "step time s (stats.jsonl", 4) == "-0.500" and _cell(md, "step time s (stats.jsonl", 5) == "-25.0%"
    a0 = summaries["A"]["ranks"]["rows"][0]["step_ms"]
    b0 = summaries["B"]["ranks"]["rows"][0]["step_ms"]
    assert float(_cell(md, "rank 0 step_ms", 4)) == pytest.approx(b0 - a0, abs=1e-3)
    # Trial dirs work too, and the default output lands in RUN_B.
    res = _cli("compare", tmp_path / "rootA" / "tiny_kernel_step1_A", tmp_path / "rootB" / "tiny_kernel_step1_B",
               "--all-rows")
    assert res.returncode == 0
    assert (tmp_path / "rootB" / "tiny_kernel_step1_B" / "compare_vs_tiny_kernel_step1_A.md").read_text() == md.replace(
        str(tmp_path / "rootA"), str(tmp_path / "rootA" / "tiny_kernel_step1_A")).replace(
        str(tmp_path / "rootB"), str(tmp_path / "rootB" / "tiny_kernel_step1_B"))
    res = _cli("compare", tmp_path / "rootA", tmp_path / "nothing")
    assert res.returncode == 2 and "not a directory" in res.stderr
    assert "status" not in md  # both trials ok: no status line
    # A failed trial B is said to be failed before any table (its figures are missing, not equal).
    log = tmp_path / "F" / "log"
    log.mkdir(parents=True)
    _stats(log / "stats.jsonl", status="failed", error="RuntimeError: boom")
    run_f = tmp_path / "rootF" / "tiny_kernel_step1_F"
    _cli("--log-dir", log, "--run-dir", run_f, "--profile-kind", "kernel", "--profile-step", 1)
    res = _cli("compare", tmp_path / "rootA", tmp_path / "rootF", "--out", tmp_path / "cmpF.md")
    assert res.returncode == 0, res.stderr
    assert ("**Trial B status: failed** (RuntimeError: boom): its figures are missing below, not zero."
            in (tmp_path / "cmpF.md").read_text())
    # both ranks were profiled in B too: the report says why B has no trace of them (its trial failed)
    assert ("Rank(s) 0, 1: a trace only in run A; not compared below (run B's trial failed (status failed) and left "
            "no trace of that rank).") in (tmp_path / "cmpF.md").read_text().splitlines()


def test_compare_gives_every_row_a_verdict_with_its_interval(tmp_path, cpu_traces):
    """Three runs of one kernel trial (step 1) with 5 unprofiled steps after it: the step time's row has the
    Hodges-Lehmann shift, its exact 95 % interval and a verdict; the profiled step's figures and the trace's are one
    sample a run (no verdict); memory rows are compared exactly."""
    a_times = (2.0, 2.1, 2.05, 2.15, 2.02)
    runs = {}
    for side, later in (("A", a_times), ("B", [t + 0.5 for t in a_times]), ("C", a_times[::-1])):
        log = _kernel_log_dir(tmp_path / side, cpu_traces)
        with open(log / "stats.jsonl", "a") as f:  # steps 2-6, unprofiled: the step time's samples
            for step, t in enumerate(later, start=2):
                f.write(json.dumps({"type": "step", "step": step, "step_time_s": t, "profiled": False}) + "\n")
        runs[side] = tmp_path / f"run{side}"
        assert _cli("--log-dir", log, "--run-dir", runs[side], "--profile-kind", "kernel", "--profile-step", 1,
                    ).returncode == 0
    out = tmp_path / "cmp.md"
    assert _cli("compare", runs["A"], runs["B"], "--out", out, "--all-rows").returncode == 0
    md = out.read_text()
    assert ("- Δ (B−A): the Hodges-Lehmann shift B − A (the median of all pairwise differences) with its exact 95 % "
            "confidence interval from the Mann-Whitney rank test (distribution-free; no resampling, no seed); with one "
            "sample a side, B − A. 95 % CI of Δ: that interval.") in md.splitlines()
    assert "- A: 5 steps (`runA` steps 2, 3, 4, 5, 6)" in md.splitlines()  # step 0 (warm-up) and 1 (profiled) left out
    # B = A + 0.5 s: the 25 differences are 0.5 + (a_j - a_i), median 0.5; the 3rd smallest and largest (k = 3 for
    # 5 v 5) are 0.5 -/+ 0.10
    assert ("| step time s (slowest rank) | 2.050 | 2.550 | +0.500 | +24.4% | [+0.400, +0.600] | 5/5 | slower |"
            in md)
    assert [_cell(md, "step time s (stats.jsonl", c) for c in range(2, 9)] == [
        "2.000", "2.000", "+0.000", "+0.0%", "–", "1/1", stats.ONE_SAMPLE]
    assert [_cell(md, "rank 1 step time s", c) for c in (7, 8)] == ["1/1", stats.ONE_SAMPLE]
    assert [_cell(md, "peak allocated GiB (stats.jsonl", c) for c in range(2, 9)] == [
        "4.000", "4.000", "+0.000", "+0.0%", "exact", "1/1", "equal (exact)"]
    assert _cell(md, "rank 1 peak allocated GiB", 8) == "equal (exact)"
    verdicts = [line.split("|")[8].strip() for line in md.splitlines() if line.startswith("| step wall |")]
    assert verdicts == [stats.ONE_SAMPLE] * 2 and _cell(md, "rank 0 step_ms", 4) == "+0.000"
    header = ("| CPU op, inclusive (– = not in that run's top 15) | A ms | B ms | Δ (B−A) | Δ % | 95 % CI of Δ | "
              "samples A/B | verdict |")
    assert md.count(header) == 2
    # C holds A's times in another order: no detectable difference, the interval -/+ the 3rd largest spread
    assert _cli("compare", runs["A"], runs["C"], "--out", tmp_path / "cmpC.md").returncode == 0
    assert ("| step time s (slowest rank) | 2.050 | 2.050 | +0.000 | +0.0% | [-0.100, +0.100] | 5/5 | "
            "no detectable difference |") in (tmp_path / "cmpC.md").read_text()
    # by default the report opens with the settings and the rows that have a verdict; the rows of one sample a side
    # are one line under their table
    res = _cli("compare", runs["A"], runs["B"], "--out", tmp_path / "short.md")
    short = (tmp_path / "short.md").read_text()
    assert res.returncode == 0 and short.index("## Settings") < short.index("## Verdicts") < short.index("## Step time")
    verdicts = short[short.index("## Verdicts"):short.index("How to read")]
    assert ("| Step time | step time s (slowest rank) | 2.050 | 2.550 | +0.500 | +24.4% | [+0.400, +0.600] | 5/5 | "
            "slower |") in verdicts.splitlines()
    assert "| step wall |" not in short and stats.ONE_SAMPLE not in short.split("How to read")[1].replace(
        f"`{stats.ONE_SAMPLE}`", "")
    assert ("4 row(s) of one sample a side (no verdict) not shown (step wall, GPU busy, communication, exposed "
            "communication): `compare --all-rows` shows them; more `PROFILE_STEPS` give repeats.") in short.splitlines()
    # the gate: B slower on step time is exit status 3, its row named; the same peak passes
    res = _cli("compare", runs["A"], runs["B"], "--out", tmp_path / "gate.md", "--fail-on", "step_time,peak_allocated")
    assert res.returncode == 3 and res.stderr.splitlines()[-1] == (
        "[postprocess] REGRESSION step_time: Step time, step time s (slowest rank): slower, Δ +0.500 (+24.4%), 95 % CI "
        "[+0.400, +0.600], samples 5/5")
    res = _cli("compare", runs["B"], runs["A"], "--out", tmp_path / "gate2.md", "--fail-on", "step_time,peak_allocated")
    assert res.returncode == 0 and res.stderr.splitlines()[-1] == (
        "[postprocess] --fail-on step_time,peak_allocated: no regression")
    res = _cli("compare", runs["A"], runs["B"], "--fail-on", "speed")
    assert res.returncode == 2 and ("--fail-on 'speed': accepted: a comma-separated list of step_time, peak_allocated, "
                                    "peak_reserved") in res.stderr


def test_compare_pools_the_kernel_trials_after_step_0(tmp_path, cpu_traces):
    """Kernel trials of steps 1-4 are 4 samples a run of each trace figure (step 0, the warm-up, is compared on its
    own): B's step 40 % longer in every trial is `slower`; a region that only jitters is no detectable
    difference; a memory row whose samples differ within a run gets the rank test; one equal in every trial is
    exact."""
    log = _kernel_log_dir(tmp_path / "log", cpu_traces)
    assert _cli("--log-dir", log, "--run-dir", tmp_path / "base", "--profile-kind", "kernel", "--profile-step", 1,
                ).returncode == 0
    base = json.loads((tmp_path / "base" / "profile_summary.json").read_text())
    jitter = (1.0, 1.01, 0.99, 1.02, 0.98)
    for side, slow in (("A", 1.0), ("B", 1.4)):
        for step in range(5):
            s = json.loads(json.dumps(base))
            s["profile_step"] = step
            k = s["kernel_traces"][0]["summary"]
            k["step_window"]["wall_ms"] = 1000.0 * slow * jitter[step if side == "A" else (5 - step) % 5]
            forward = next(r for r in k["regions"] if r["name"] == "sftprof/forward/mb0")
            forward["cpu_ms"] = 100.0 * jitter[(step + (side == "B")) % 5]
            for row in s["ranks"]["rows"]:
                row["step_ms"] = 900.0 + step  # the same in both runs: the rank test sees ties across them
            s["stats"]["per_rank"]["0"]["mem_peak_allocated_gb"] = 3.0 + (0.1 * step if side == "B" else 0.0)
            trial = tmp_path / f"root{side}" / f"kernel_step{step}"
            trial.mkdir(parents=True)
            (trial / "profile_summary.json").write_text(json.dumps(s))
    md = compare_runs(str(tmp_path / "rootA"), str(tmp_path / "rootB"), all_rows=True)
    assert "## kernel step 0: `kernel_step0` (A) vs `kernel_step0` (B)" in md
    assert ("## kernel trials after step 0, pooled: A `kernel_step1` (step 1), `kernel_step2` (step 2), `kernel_step3` "
            "(step 3), `kernel_step4` (step 4) vs B `kernel_step1` (step 1), `kernel_step2` (step 2), `kernel_step3` "
            "(step 3), `kernel_step4` (step 4)") in md
    pooled = md[md.index("## kernel trials after step 0, pooled"):]
    # A 1010, 990, 1020, 980 ms (median 1000); B 1372, 1428, 1386, 1414 (median 1400); 4 v 4 reaches 95 % only with
    # the extreme differences (k = 1): [1372 - 1020, 1428 - 980]
    assert _cell(pooled, "step wall", 2) == "1000.000" and _cell(pooled, "step wall", 3) == "1400.000"
    assert [_cell(pooled, "step wall", c) for c in (6, 7)] == ["[+352.000, +448.000]", "4/4"]
    assert _cell(pooled, "step wall", 8) == "slower"
    # A 101, 99, 102, 98 ms; B 99, 102, 98, 100: the extreme differences -4 and +4 hold 0
    assert [_cell(pooled, "sftprof/forward/mb0 |", c) for c in (6, 7, 8)] == ["[-4.000, +4.000]", "4/4",
                                                                             stats.NO_DIFFERENCE]
    assert [_cell(pooled, "rank 0 step_ms", c) for c in (4, 6, 8)] == ["+0.000", "[-3.000, +3.000]",
                                                                       stats.NO_DIFFERENCE]
    # B's peak 3.1-3.4 GiB against A's 3.0 in every trial: not one value, so the rank test: higher
    assert [_cell(pooled, "rank 0 peak allocated GiB", c) for c in (2, 3, 7, 8)] == ["3.000", "3.250", "4/4", "higher"]
    assert [_cell(pooled, "rank 1 peak allocated GiB", c) for c in (7, 8)] == ["4/4", "equal (exact)"]
    step0 = md[md.index("## kernel step 0"):md.index("## kernel trials after step 0")]
    assert _cell(step0, "step wall", 8) == stats.ONE_SAMPLE


def test_ok_trial_without_artifacts(tmp_path):
    """CPU memory trials write no allocator snapshots (a warning, exit 0); on CUDA that is an error."""
    log = tmp_path / "log"
    log.mkdir()
    _stats(log / "stats.jsonl", kind="memory", device="cpu")
    run = tmp_path / "run"
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "memory", "--profile-step", 1)
    assert res.returncode == 0, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"] == [] and s["warnings"][0]["file"] == "memory_snapshots/step_1/snapshot_rank*.pickle"
    assert "need CUDA" in s["warnings"][0]["warning"]
    assert "## Warnings" in (run / "profile_summary.md").read_text()
    _stats(log / "stats.jsonl", kind="memory", device="cuda")
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "memory", "--profile-step", 1)
    assert res.returncode == 1
    assert json.load(open(run / "profile_summary.json"))["errors"][0]["file"].startswith("memory_snapshots/step_1/")


def test_trial_that_died_before_logging_still_gets_a_summary(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "launcher.log").write_text("torchrun: ChildFailedError\nsftprof: configuration error: boom\n")
    res = _cli("--log-dir", tmp_path / "never_written", "--run-dir", run, "--profile-kind", "kernel",
               "--profile-step", 0)
    # A missing log dir is bad input (exit 2, naming it); the failed trial's summary is still written.
    assert res.returncode == 2, res.stderr
    assert f"[postprocess] ERROR --log-dir: {tmp_path / 'never_written'} does not exist\n" in res.stderr
    s = json.load(open(run / "profile_summary.json"))
    assert s["status"] == "failed" and "does not exist" in s["completion"]["error"]
    assert s["trainer_log_tail"] == ["torchrun: ChildFailedError", "sftprof: configuration error: boom"]
    assert s["errors"] == [{"file": "--log-dir", "error": f"{tmp_path / 'never_written'} does not exist"}]
    assert s["counts"]["traces"] == 0 and s["failure"] is None
    # a mistyped --log-dir later does not replace a summary that is already written
    before = {name: (run / name).read_bytes() for name in ("profile_summary.json", "profile_summary.md")}
    res = _cli("--log-dir", tmp_path / "typo", "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 0)
    assert res.returncode == 2 and res.stderr.endswith(
        f"error: --log-dir {tmp_path / 'typo'} does not exist and {run / 'profile_summary.json'} is already written; "
        "nothing was overwritten (a failed trial's summary is written only into a run dir without one)\n")
    assert {name: (run / name).read_bytes() for name in before} == before


def test_kind_or_step_other_than_the_trial_profiled_is_an_error(tmp_path):
    """A trial profiles one kind, so another --profile-kind would process it as what it is not: exit 2, naming the
    setting, the given and the recorded kind, nothing written. A step the trial did not profile would label another
    step's artifacts (or none) with it: exit 2 too, naming the steps the trial's config.yaml lists (a direct trainer
    run may profile several, each postprocessed on its own), else the one its completion record names."""
    (tmp_path / "log").mkdir()
    _stats(tmp_path / "log" / "stats.jsonl", kind="memory")
    res = _cli("--log-dir", tmp_path / "log", "--run-dir", tmp_path / "run", "--profile-kind", "kernel",
               "--profile-step", 1)
    assert res.returncode == 2 and res.stderr.endswith(
        f"error: --profile-kind kernel: the trial recorded profile_kind='memory' in {tmp_path / 'log' / 'stats.jsonl'}; "
        "pass --profile-kind memory or leave it out; nothing was written\n")
    assert not (tmp_path / "run").exists()
    res = _cli("--log-dir", tmp_path / "log", "--run-dir", tmp_path / "run", "--profile-kind", "memory",
               "--profile-step", 7)
    assert res.returncode == 2 and res.stderr.endswith(
        f"error: --profile-step 7: the trial profiled step(s) [1] (the completion record in "
        f"{tmp_path / 'log' / 'stats.jsonl'}); pass one of them or leave it out; nothing was written\n")
    assert not (tmp_path / "run").exists()
    # the trial's config lists every profiled step of its kind: each of them is accepted, others are not
    (tmp_path / "log" / "config.yaml").write_text("memory_profiler:\n  profile_steps: [3, 1]\n"
                                                  "perf_tracer:\n  profile_steps: [7]\n")
    res = _cli("--log-dir", tmp_path / "log", "--run-dir", tmp_path / "run", "--profile-step", 7)
    assert res.returncode == 2 and res.stderr.endswith(
        f"error: --profile-step 7: the trial profiled step(s) [1, 3] (memory_profiler.profile_steps in "
        f"{tmp_path / 'log' / 'config.yaml'}); pass one of them or leave it out; nothing was written\n")
    assert not (tmp_path / "run").exists()
    res = _cli("--log-dir", tmp_path / "log", "--run-dir", tmp_path / "run", "--profile-step", 3)
    assert res.returncode == 1 and "no artifacts found" in res.stderr  # CUDA trial: step 3 has no snapshot here
    s = json.load(open(tmp_path / "run" / "profile_summary.json"))
    assert s["profile_step"] == 3 and not any("requested" in w["warning"] for w in s["warnings"]), s["warnings"]


def test_kind_and_step_come_from_the_trials_own_record(tmp_path, cpu_traces):
    log = _kernel_log_dir(tmp_path, cpu_traces)
    res = _cli("--log-dir", log, "--run-dir", tmp_path / "run")  # no --profile-kind / --profile-step
    assert res.returncode == 0, res.stderr
    s = json.load(open(tmp_path / "run" / "profile_summary.json"))
    assert (s["profile_kind"], s["profile_step"], s["warnings"]) == ("kernel", 1, [])
    assert s["counts"]["traces"] == 2
    (tmp_path / "bare").mkdir()
    res = _cli("--log-dir", tmp_path / "bare", "--run-dir", tmp_path / "run2")
    assert res.returncode == 2
    assert (f"--profile-kind: not given, and {tmp_path / 'bare' / 'stats.jsonl'} has no completion record naming "
            "it; pass one of ('kernel', 'memory')") in res.stderr


def test_compare_says_when_cp_attention_cannot_act(tmp_path):
    """The settings diff of two trials that differ in ``actor.megatron.cp_attention`` says the setting had no effect
    when neither trial runs megatron with CP > 1 (bench/NOTES.md's one-GPU rows: masked before the default changed,
    blocks after), and says nothing more when one of them has CP = 2."""
    from sftprof.analysis.compare.settings_diff import settings_diff

    def summary(name, backend, method):
        log = tmp_path / name
        log.mkdir()
        (log / "config.yaml").write_text(f"actor:\n  backend: {backend}\n  megatron:\n    cp_attention: {method}\n")
        (log / "environment.json").write_text("{}\n")
        (log / "versions.json").write_text(json.dumps(VERSIONS_RECORD))
        return {"paths": {"log_dir": str(log)}}

    d1_masked, d1_blocks = summary("a", "megatron:d1", "masked"), summary("b", "megatron:d1", "blocks")
    assert settings_diff(d1_masked, d1_blocks) == [
        "Settings that differ:", "", "| setting | A | B |", "|---|---|---|",
        "| `actor.megatron.cp_attention` | masked | blocks |", "",
        "`actor.megatron.cp_attention` has no effect in either trial (it applies to the megatron backend with CP > 1): "
        "its difference is not what the deltas measure.", ""]
    cp2 = summary("c", "megatron:(attn:c2|ffn:e2)", "masked")
    assert settings_diff(d1_blocks, cp2) == [
        "Settings that differ:", "", "| setting | A | B |", "|---|---|---|",
        "| `actor.backend` | megatron:d1 | megatron:(attn:c2\\|ffn:e2) |",  # "|" escaped: still three cells
        "| `actor.megatron.cp_attention` | blocks | masked |", "",
        "**Warning:** the runs differ in actor.backend: time and memory deltas mix the change under test with a "
        "different problem size.", ""]


# moe_load of steps 0 and 2 of the 2x H200 run of the shipped YAML at (attn:c2|ffn:e2), random weights
# (bench/NOTES.md, fourteenth session): one expert takes almost every token of layers 1-3
_COLLAPSED = {"tokens_per_expert_max": [118123.0, 130964.0, 131064.0, 131058.0],
              "tokens_per_expert_mean": [8192.0] * 4,
              "max_over_mean": [14.4193115234375, 15.98681640625, 15.9990234375, 15.998291015625],
              "ep_max_over_mean": [1.2751617431640625, 1.5141429901123047, 1.6437015533447266, 1.4988269805908203],
              "worst_layer": 2, "max_over_mean_max": 15.9990234375, "ep_max_over_mean_max": 1.6437015533447266}
_BALANCED = {"tokens_per_expert_max": [9000.0, 8800.0, None, 9500.0], "tokens_per_expert_mean": [8192.0] * 4,
             "max_over_mean": [1.0986328125, 1.07421875, None, 1.1596679688],
             "ep_max_over_mean": [1.01, 1.02, None, 1.005], "worst_layer": 3, "max_over_mean_max": 1.1596679688,
             "ep_max_over_mean_max": 1.02}


_ADVICE = {
    "megatron:(attn:c2|ffn:e2)": ", or set actor.megatron.moe_router_force_load_balancing=true (random router logits, "
                                 "balanced load) to profile balanced routing",
    "fsdp:d2": " (the megatron backend also offers balanced routing for profiling, "
               "actor.megatron.moe_router_force_load_balancing; the fsdp backend does not)"}


@pytest.mark.parametrize("profiled_load, backend", [(_COLLAPSED, "megatron:(attn:c2|ffn:e2)"), (_COLLAPSED, "fsdp:d2"),
                                                    (_BALANCED, "megatron:(attn:c2|ffn:e2)")])
def test_routing_of_each_step_and_a_collapse_warning(tmp_path, profiled_load, backend):
    """The Steps table shows each step's busiest expert and EP rank over the mean, at their worst layers; when one
    expert took >= half of a layer's tokens in the profiled step the summary warns that the routing collapsed, with
    the advice the trial's backend accepts."""
    warned = profiled_load is _COLLAPSED
    log = tmp_path / "log"
    log.mkdir()
    _stats(log / "stats.jsonl", kind="memory", device="cpu")
    (log / "config.yaml").write_text(f"actor:\n  backend: '{backend}'\n")
    recs = [json.loads(line) for line in (log / "stats.jsonl").read_text().splitlines()]
    recs[0].update(moe_load=_BALANCED if warned else _COLLAPSED, tokens=131072)
    recs[1].update(moe_load=profiled_load, tokens=131072)
    (log / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = tmp_path / "run"
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "memory", "--profile-step", 1)
    assert res.returncode == 0, res.stderr
    md = (run / "profile_summary.md").read_text()
    rows = {"collapsed": "| 15.999 (L2) | 1.644 (L2) |", "balanced": "| 1.160 (L3) | 1.020 (L1) |"}
    step0, step1 = (rows["balanced"], rows["collapsed"]) if warned else (rows["collapsed"], rows["balanced"])
    lines = md.splitlines()
    assert lines[lines.index("| step | step time s | tokens/s | peak alloc GiB (rank) | peak reserved GiB (rank) | "
                             "over ranks | MFU | recompute TFLOP/s/GPU | expert max/mean (L) | EP rank max/mean (L) | "
                             "profiled |") + 2].endswith(step0 + " False |")
    assert step1 + " True |" in md
    s = json.load(open(run / "profile_summary.json"))
    assert s["stats"]["steps"][1]["moe"] == (
        {"max_over_mean": 15.9990234375, "worst_layer": 2, "ep_max_over_mean": 1.6437015533447266,
         "ep_worst_layer": 2, "top_share": 131064.0 / 131072, "top_share_layer": 2, "invalid": 0} if warned else
        {"max_over_mean": 1.1596679688, "worst_layer": 3, "ep_max_over_mean": 1.02, "ep_worst_layer": 1,
         "top_share": 9500.0 / 131072, "top_share_layer": 3, "invalid": 0})
    collapse = [w["warning"] for w in s["warnings"] if "routing" in w["warning"]]
    assert collapse == ([
        "step 1: MoE routing collapsed: one expert received 99.99 % of the tokens in layer 2 (busiest expert 16.00x "
        "the mean); the busiest EP rank got 1.64x the mean per EP rank (layer 2). A randomly initialised router does "
        "this on the repeated fake sample, a trained one spreads the tokens: with random weights, this profile's "
        "expert GEMM, dispatch and EP waiting figures are not the trained model's. Load the checkpoint (MODEL_PATH, "
        "i.e. actor.path, with actor.init_from_scratch=false)" + _ADVICE[backend]] if warned else [])


def test_routing_values_that_cannot_be_true_are_left_out_and_counted(tmp_path):
    """A damaged ``moe_load``: a layer with a value that cannot be true (a busiest expert below the mean, more tokens
    for one expert than the step had, an EP rank below the mean) is left out whole, counted and warned; the valid
    layer is shown and no collapse is claimed from the left-out layers."""
    log = tmp_path / "log"
    log.mkdir()
    _stats(log / "stats.jsonl", kind="memory", device="cpu")
    recs = [json.loads(line) for line in (log / "stats.jsonl").read_text().splitlines()]
    recs[1].update(tokens=2048, moe_load={"tokens_per_expert_max": [5000.0, 600.0, 5000.0],
                                          "max_over_mean": [-3.0, 2.34375, 9.77], "ep_max_over_mean": [0.5, None, 1.1]})
    (log / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "memory", "--profile-step", 1).returncode == 0
    s = json.load(open(run / "profile_summary.json"))
    assert s["stats"]["steps"][1]["moe"] == {"max_over_mean": 2.34375, "worst_layer": 1, "ep_max_over_mean": None,
                                             "ep_worst_layer": None, "top_share": 600.0 / 2048, "top_share_layer": 1,
                                             "invalid": 2}
    assert [w["warning"] for w in s["warnings"] if "routing" in w["warning"]] == [
        "step 1: 2 MoE layer(s) left out of the routing figures: a value that cannot be true (a busiest expert or EP "
        "rank below the mean, one expert with more tokens than the step, a negative count)"]
    assert "| 2.344 (L1) | – | True |" in (run / "profile_summary.md").read_text()


@pytest.mark.parametrize("actor_yaml, tail", [
    ("  backend: 'megatron:d1'\n  init_from_scratch: false\n",
     ". The trial loaded the checkpoint (actor.init_from_scratch=false): this is how its router routes the repeated "
     "fake sample, which a real dataset need not reproduce; actor.megatron.moe_router_force_load_balancing=true (random "
     "router logits, balanced load) profiles balanced routing"),
    ("  backend: 'fsdp:d2'\n  init_from_scratch: false\n",
     ". The trial loaded the checkpoint (actor.init_from_scratch=false): this is how its router routes the repeated "
     "fake sample, which a real dataset need not reproduce"),
    ("  backend: 'megatron:d1'\n  megatron:\n    moe_router_force_load_balancing: true\n",
     " although actor.megatron.moe_router_force_load_balancing=true (random router logits) was set: check the "
     "routing counts")])
def test_collapse_warning_follows_the_trials_weights_and_routing_settings(tmp_path, actor_yaml, tail):
    """With the checkpoint loaded the warning does not blame random weights nor advise loading it; with balanced
    routing already on it does not advise setting it."""
    log = tmp_path / "log"
    log.mkdir()
    _stats(log / "stats.jsonl", kind="memory", device="cpu")
    (log / "config.yaml").write_text("actor:\n" + actor_yaml)
    recs = [json.loads(line) for line in (log / "stats.jsonl").read_text().splitlines()]
    recs[1].update(moe_load=_COLLAPSED, tokens=131072)
    (log / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "memory", "--profile-step", 1).returncode == 0
    s = json.load(open(run / "profile_summary.json"))
    assert [w["warning"] for w in s["warnings"] if "routing" in w["warning"]] == [
        "step 1: MoE routing collapsed: one expert received 99.99 % of the tokens in layer 2 (busiest expert 16.00x "
        "the mean); the busiest EP rank got 1.64x the mean per EP rank (layer 2)" + tail]


def test_compare_sets_the_recorded_environment_beside_the_config(tmp_path):
    """Two runs that differ only in an environment variable (a TE setting) were reported as identical, "a repeat run";
    the recorded variables are now settings (``env.<NAME>``, ``–`` where unset), and a trial without
    ``environment.json`` says that they were not compared."""
    from sftprof.analysis.compare.settings_diff import settings_diff

    cfg = {"actor": {"backend": "megatron:d1"}}
    a = {"config": cfg, "environment": {"OMP_NUM_THREADS": "1"}, "versions": VERSIONS_RECORD}
    b = {"config": cfg, "environment": {"OMP_NUM_THREADS": "1", "NVTE_USE_CUTLASS_GROUPED_GEMM": "1"},
         "versions": VERSIONS_RECORD}
    assert settings_diff(a, b) == [
        "Settings that differ:", "", "| setting | A | B |", "|---|---|---|",
        "| `env.NVTE_USE_CUTLASS_GROUPED_GEMM` | – | 1 |", ""]
    assert settings_diff(a, a) == ["Settings: identical (a repeat run: deltas show run-to-run noise).", ""]
    log = tmp_path / "log"  # an older summary without the member: the log dir's file
    log.mkdir()
    (log / "environment.json").write_text('{"NVTE_USE_CUTLASS_GROUPED_GEMM": "1", "OMP_NUM_THREADS": "1"}')
    (log / "versions.json").write_text(json.dumps(VERSIONS_RECORD))
    assert settings_diff(a, {"config": cfg, "paths": {"log_dir": str(log)}})[4:6] == [
        "| `env.NVTE_USE_CUTLASS_GROUPED_GEMM` | – | 1 |", ""]
    assert settings_diff({"config": cfg, "versions": VERSIONS_RECORD}, a) == [
        "Settings: the configs are identical.", "",
        "Environment variables not compared (A: no environment.json: trials of earlier releases did not write it).", ""]
    assert settings_diff(a, {"config": cfg, "environment": None, "versions": VERSIONS_RECORD})[2] == (
        "Environment variables not compared (B: no environment.json in the trial's log dir when it was postprocessed).")
    # a value keeps its row on one line and its three cells
    assert settings_diff(a, {"config": cfg, "environment": {"OMP_NUM_THREADS": "1", "NCCL_X": "l1\nl2|x"},
                             "versions": VERSIONS_RECORD})[4] == "| `env.NCCL_X` | – | l1\\nl2\\|x |"


# a trial's versions.json as the GPU machine wrote it (release 3.7's keys: no sftprof, no nccl)
VERSIONS_RECORD = {"python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "megatron_core": "0.16.1",
                   "transformer_engine": None, "transformers": "5.17.0", "triton": "3.6.0",
                   "flash_linear_attention": None}


def test_compare_names_a_change_of_software_versions():
    """Two runs of one config on different software (megatron-core 0.16.1 against 0.19.2, TE added): each version that
    differs is a setting (``version.<name>``, ``–`` for a package not installed); a run without recorded versions (an
    earlier release's, or a damaged versions.json) compares none and the report says why."""
    from sftprof.analysis.compare.settings_diff import settings_diff

    cfg = {"actor": {"backend": "megatron:d1"}}
    v = VERSIONS_RECORD
    a = {"config": cfg, "environment": {}, "versions": v}
    b = {"config": cfg, "environment": {}, "versions": {**v, "megatron_core": "0.19.2", "transformer_engine": "2.20.2"}}
    assert settings_diff(a, b) == [
        "Settings that differ:", "", "| setting | A | B |", "|---|---|---|",
        "| `version.megatron_core` | 0.16.1 | 0.19.2 |", "| `version.transformer_engine` | – | 2.20.2 |", ""]
    assert settings_diff(a, a) == ["Settings: identical (a repeat run: deltas show run-to-run noise).", ""]
    # a side whose versions are unknown: not a repeat run as far as anyone can tell, and said so
    assert settings_diff(a, {**b, "versions": None}) == [
        "Settings: the configs are identical.", "",
        "Software versions not compared (B: no versions.json in the trial's log dir when it was postprocessed).", ""]
    damaged = {**b, "versions": None, "errors": [{"file": "versions.json", "error": "/l/versions.json: lacks torch"}]}
    assert settings_diff(damaged, a)[2] == "Software versions not compared (A: /l/versions.json: lacks torch)."
    assert settings_diff({"config": cfg, "environment": {}}, a)[2] == (
        "Software versions not compared (A: no versions.json: trials of earlier releases did not write it).")
    # two runs of one sftprof version on different commits, and of one torch on different NCCL builds
    c = {"config": cfg, "environment": {}, "versions": {**v, "sftprof": "0.1.0+g85c64d7", "nccl": "2.27.3"}}
    assert settings_diff(c, {**c, "versions": {**c["versions"], "sftprof": "0.1.0+g67895c6"}}) == [
        "Settings that differ:", "", "| setting | A | B |", "|---|---|---|",
        "| `version.sftprof` | 0.1.0+g85c64d7 | 0.1.0+g67895c6 |", ""]
    assert settings_diff(c, {**c, "versions": {**c["versions"], "nccl": "2.28.9"}})[4:6] == [
        "| `version.nccl` | 2.27.3 | 2.28.9 |", ""]
    # against a run that recorded neither (an earlier release's versions.json: both None), each is named, "–" there
    assert settings_diff(a, c)[4:7] == ["| `version.nccl` | – | 2.27.3 |", "| `version.sftprof` | – | 0.1.0+g85c64d7 |",
                                        ""]


def test_compare_settings_table_shows_empty_values():
    """An empty text is shown as ``""`` (with its meaning where it has one: ``perf_tracer.ranks=''`` profiles every
    rank), not as an empty cell; a key only one trial's config has is ``–`` on the other side."""
    from sftprof.analysis.compare.settings_diff import settings_diff

    a = {"config": {"perf_tracer": {"ranks": ""}, "memory_profiler": {"ranks": "0"}, "tokenizer_path": "",
                    "actor": {"loss": {"path": "auto"}}}, "environment": {}, "versions": VERSIONS_RECORD}
    b = {"config": {"perf_tracer": {"ranks": "pp_rank0"}, "memory_profiler": {"ranks": ""}, "tokenizer_path": "/tok",
                    "actor": {}}, "environment": {}, "versions": VERSIONS_RECORD}
    assert settings_diff(a, b) == [
        "Settings that differ:", "", "| setting | A | B |", "|---|---|---|",
        "| `actor.loss.path` | auto | – |",
        '| `memory_profiler.ranks` | 0 | "" (all ranks) |',
        '| `perf_tracer.ranks` | "" (all ranks) | pp_rank0 |',
        '| `tokenizer_path` | "" | /tok |', ""]


def test_a_run_root_or_experiment_folder_where_one_trial_goes_says_what_to_pass(tmp_path):
    """Issue 50: a RUN_ROOT passed with --log-dir, a trial run dir without --log-dir, or the experiment folder of the
    log dirs as --log-dir stop with exit 2 and say what to pass (the experiment folder gave an error about
    --profile-kind); nothing is written."""
    root = tmp_path / "run"
    (root / "t0").mkdir(parents=True)
    logs = tmp_path / "fileroot" / "logs" / "u" / "exp"
    for name in ("t0", "t1"):
        (logs / name).mkdir(parents=True)
        _stats(logs / name / "stats.jsonl")
    (root / "trials.tsv").write_text(f"t0\tkernel\t1\t{root / 't0'}\t{logs / 't0'}\t{root / 't0' / 'train_args.txt'}\n")
    res = _cli("--run-dir", root, "--log-dir", logs / "t0")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py: error: --run-dir {root} is a RUN_ROOT (it holds trials.tsv), which takes no "
        "--log-dir: pass it alone to postprocess every trial it lists, or pass one trial's --log-dir and --run-dir "
        "(trials.tsv lists both)")
    res = _cli("--run-dir", root / "t0")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py: error: --log-dir is required with a trial run dir ({root / 't0'} holds no "
        "trials.tsv, so it is not a RUN_ROOT); the driver printed each trial's log dir, and RUN_ROOT/trials.tsv lists "
        "them")
    for missing, what in ((tmp_path / "nope", "does not exist"), (root / "trials.tsv", "is not a folder")):
        res = _cli("--run-dir", missing)  # a mistyped RUN_ROOT is said to be missing, not to lack --log-dir
        assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
            f"postprocess_profile.py: error: --run-dir {missing} {what}: pass a RUN_ROOT (it holds trials.tsv) alone, "
            "or a trial's run dir with its --log-dir")
    res = _cli("--log-dir", logs, "--run-dir", root / "t0")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py: error: --log-dir {logs} holds the log dirs of 2 trials (t0, t1), not one: pass one "
        "of them with its trial's --run-dir, or pass the RUN_ROOT alone as --run-dir to postprocess every trial")
    res = _cli("--log-dir", root, "--run-dir", root / "t0")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py: error: --log-dir {root} is a RUN_ROOT (it holds trials.tsv), not a trial's log dir: "
        "pass it alone as --run-dir to postprocess every trial it lists")
    for above in (tmp_path / "fileroot", tmp_path / "fileroot" / "logs"):  # FILEROOT, or a folder of it, as --log-dir
        res = _cli("--log-dir", above, "--run-dir", root / "t0")
        trials = ", ".join(str((logs / t).relative_to(above)) for t in ("t0", "t1"))
        assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
            f"postprocess_profile.py: error: --log-dir {above} holds the log dirs of 2 trials ({trials}), not one: "
            "pass one of them with its trial's --run-dir, or pass the RUN_ROOT alone as --run-dir to postprocess every "
            "trial")
    assert sorted(p.name for p in root.rglob("*")) == ["t0", "trials.tsv"]


def _planned_trials(tmp_path):
    """Two trials as the driver leaves them: memory trials on CPU (no artifacts to process), each log dir's
    config.yaml and run dir's train_args.txt naming the trial, the step-0 trial postprocessed."""
    logs, runs = {}, {}
    for step in (0, 1):
        name = f"m_fake1k_memory_step{step}_s"
        logs[step], runs[step] = tmp_path / "fileroot" / "logs" / "u" / "e" / name, tmp_path / "run" / name
        logs[step].mkdir(parents=True)
        runs[step].mkdir(parents=True)
        _stats(logs[step] / "stats.jsonl", step=step, kind="memory", device="cpu")
        (logs[step] / "config.yaml").write_text(f"trial_name: {name}\nmemory_profiler:\n  profile_steps:\n  - {step}\n")
        (runs[step] / "train_args.txt").write_text(
            f"--config\n{tmp_path / 'run' / 'plan_config.yaml'}\ntrial_name={name}\ntotal_train_steps={step + 1}\n")
    (runs[0] / "profile_summary.json").write_text('{"trial": "step 0"}\n')
    (runs[0] / "profile_summary.md").write_text("# step 0\n")
    return logs, runs


def test_a_log_dir_and_run_dir_of_two_trials_are_refused_before_anything_is_moved(tmp_path):
    """A trial's log dir postprocessed into another trial's run dir (their trial_name differs) stops with exit 2,
    naming both paths and both names, with or without --profile-kind/--profile-step; the other trial's summary is
    not pushed aside (it was moved to profile_summary.prev1.* and replaced by a mix of the two trials)."""
    logs, runs = _planned_trials(tmp_path)
    before = {p.name: p.read_bytes() for p in runs[0].iterdir()}
    message = (f"postprocess_profile.py: error: --log-dir {logs[1]} and --run-dir {runs[0]} are not one trial's: "
               f"trial_name='m_fake1k_memory_step1_s' in {logs[1] / 'config.yaml'}, "
               f"trial_name='m_fake1k_memory_step0_s' in {runs[0] / 'train_args.txt'}; nothing was written: pass the "
               "run dir of trial m_fake1k_memory_step1_s with this log dir, or the log dir of trial "
               "m_fake1k_memory_step0_s with this run dir (RUN_ROOT/trials.tsv lists each trial's log dir and run dir)")
    for given in ([], ["--profile-kind", "memory", "--profile-step", 1]):
        res = _cli("--log-dir", logs[1], "--run-dir", runs[0], *given)
        assert (res.returncode, res.stderr.splitlines()[-1]) == (2, message)
        assert {p.name: p.read_bytes() for p in runs[0].iterdir()} == before  # no .prev1, nothing new
    with pytest.raises(ValueError) as err:  # the library's entry point makes the same check
        postprocess_trial(str(logs[1]), str(runs[0]))
    assert "postprocess_profile.py: error: " + str(err.value) == message
    assert {p.name: p.read_bytes() for p in runs[0].iterdir()} == before
    assert sorted(p.name for p in logs[1].iterdir()) == ["config.yaml", "stats.jsonl"]


def test_a_run_dir_without_its_trial_name_is_not_checked(tmp_path):
    """The check needs the run dir's trial: a run dir without train_args.txt (not planned by the driver), or one naming
    no trial_name, and without a summary naming one (none, a damaged one, one without config), is postprocessed as
    before; the same name on both sides too."""
    logs, runs = _planned_trials(tmp_path)
    assert other_trial(str(logs[1]), str(runs[1])) is None
    (runs[0] / "train_args.txt").write_text("--config\nplan_config.yaml\ntotal_train_steps=1\n")
    said = other_trial(str(logs[1]), str(runs[0]))  # its summary holds no config: the folder's trial-shaped name
    assert said is not None and f"the folder name 'm_fake1k_memory_step0_s' of {runs[0]};" in said, said
    mine = runs[0].rename(tmp_path / "mine")  # a run dir of a name of one's own says nothing
    assert other_trial(str(logs[1]), str(mine)) is None
    (mine / "train_args.txt").unlink()
    for summary in (b"{not json", b"\xff\xfe", b"[]", b'{"config": null}', b'{"config": {"trial_name": 7}}'):
        (mine / "profile_summary.json").write_bytes(summary)
        assert other_trial(str(logs[1]), str(mine)) is None
    fresh = tmp_path / "fresh"  # a run dir of one's own for a trial's log dir: no train_args.txt
    for _ in range(2):  # the rerun reads the summary of the first: the same trial (its "trial" is the folder's name)
        res = _cli("--log-dir", logs[1], "--run-dir", fresh)
        assert res.returncode == 0, res.stderr
        assert json.loads((fresh / "profile_summary.json").read_text())["trial"] == "fresh"
    res = _cli("--log-dir", logs[1], "--run-dir", runs[1])  # its own run dir: train_args.txt names the same trial
    assert res.returncode == 0, res.stderr
    assert json.loads((runs[1] / "profile_summary.json").read_text())["profile_step"] == 1


def _files(folder):
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_dir_without_train_args_is_known_by_its_summary(tmp_path):
    """A run dir without train_args.txt whose profile_summary.json summarises another trial (its config.trial_name)
    is refused with exit 2, naming both trials and the files that said so; nothing in it changes (the summary was
    moved to profile_summary.prev1.* and replaced by a mix of the two trials)."""
    logs, runs = _planned_trials(tmp_path)
    res = _cli("--log-dir", logs[0], "--run-dir", runs[0])
    assert res.returncode == 0, res.stderr
    (runs[0] / "train_args.txt").unlink()
    before = _files(runs[0])
    message = (f"postprocess_profile.py: error: --log-dir {logs[1]} and --run-dir {runs[0]} are not one trial's: "
               f"trial_name='m_fake1k_memory_step1_s' in {logs[1] / 'config.yaml'}, "
               f"config.trial_name='m_fake1k_memory_step0_s' in {runs[0] / 'profile_summary.json'}; nothing was "
               "written: pass the run dir of trial m_fake1k_memory_step1_s with this log dir, or the log dir of trial "
               "m_fake1k_memory_step0_s with this run dir (RUN_ROOT/trials.tsv lists each trial's log dir and run dir)")
    res = _cli("--log-dir", logs[1], "--run-dir", runs[0])
    assert (res.returncode, res.stderr.splitlines()[-1]) == (2, message)
    assert _files(runs[0]) == before
    with pytest.raises(ValueError, match="not one trial's"):  # the library's entry point makes the same check
        postprocess_trial(str(logs[1]), str(runs[0]))
    assert _files(runs[0]) == before


@pytest.mark.parametrize("config", [b"trial_name: [m_fake1k_memory_step1_s\n", b"\xff\xfe", b"- a list\n",
                                    b"memory_profiler: {}\n", None], ids=["bad-yaml", "not-utf8", "a-list",
                                                                         "no-trial-name", "absent"])
def test_a_log_dir_without_a_readable_trial_name_is_known_by_its_folder_name(tmp_path, config):
    """A log dir whose config.yaml is damaged, names no trial_name or is absent is the trial its folder is named after
    (the trainer's LOG_DIR/<trial_name>): checked against the run dir's train_args.txt, else its summary; refused with
    exit 2 naming the folder, why its config.yaml was not read and the run dir's file, nothing in the run dir
    changed."""
    logs, runs = _planned_trials(tmp_path)
    res = _cli("--log-dir", logs[0], "--run-dir", runs[0])  # a summary of trial step 0 in its run dir
    assert res.returncode == 0, res.stderr
    if config is None:
        (logs[1] / "config.yaml").unlink()
    else:
        (logs[1] / "config.yaml").write_bytes(config)
    folder = f"the folder name 'm_fake1k_memory_step1_s' of {logs[1]} ("
    for said in (f"trial_name='m_fake1k_memory_step0_s' in {runs[0] / 'train_args.txt'}",
                 f"config.trial_name='m_fake1k_memory_step0_s' in {runs[0] / 'profile_summary.json'}"):
        before = _files(runs[0])
        res = _cli("--log-dir", logs[1], "--run-dir", runs[0])
        assert res.returncode == 2, res.stderr
        last = res.stderr.splitlines()[-1]
        assert last.startswith(f"postprocess_profile.py: error: --log-dir {logs[1]} and --run-dir {runs[0]} are not "
                               f"one trial's: {folder}"), last
        assert "config.yaml" in last.split(folder)[1] and f"), {said}; nothing was written" in last, last
        assert _files(runs[0]) == before
        (runs[0] / "train_args.txt").unlink(missing_ok=True)  # next: the summary alone says which trial


def test_a_renamed_log_dir_without_config_is_not_checked(tmp_path):
    """A log dir without a readable trial_name whose folder does not have the shape of the driver's trial names (a
    user renamed or copied it) says nothing of its trial: postprocessed into a planned run dir as before. The
    driver's names have that shape."""
    logs, runs = _planned_trials(tmp_path)
    (logs[1] / "config.yaml").unlink()
    renamed = logs[1].rename(tmp_path / "copied_logs")
    assert other_trial(str(renamed), str(runs[0])) is None
    assert other_trial(str(logs[0]), str(runs[1])) is not None  # a readable config.yaml is still checked
    assert TRIAL_NAME_RE.match(folders.trial_name("qwen3_30b_a3b", 131072, "kernel", 2, "20261208_0102"))
    assert not TRIAL_NAME_RE.match("copied_logs")
    missing = logs[0].parent / "m_fake1k_memory_step7_s"  # a mistyped --log-dir of a trial's shape: not a trial
    assert other_trial(str(missing), str(runs[0])) is None
    (runs[1] / "train_args.txt").unlink()
    (runs[1] / "profile_summary.json").write_text("[" * 100_000)  # deeper than json recurses: names no trial
    said = other_trial(str(logs[0]), str(runs[1]))  # ... so the run dir's folder name does
    assert said is not None and f"the folder name 'm_fake1k_memory_step1_s' of {runs[1]};" in said, said


def test_the_same_trial_without_train_args_is_accepted(tmp_path):
    """A run dir without train_args.txt whose summary is of the same trial is postprocessed again (the earlier
    summary, if it differs, kept as profile_summary.prev1.*), its log dir's config.yaml read or not."""
    logs, runs = _planned_trials(tmp_path)
    res = _cli("--log-dir", logs[1], "--run-dir", runs[1])
    assert res.returncode == 0, res.stderr
    (runs[1] / "train_args.txt").unlink()
    assert other_trial(str(logs[1]), str(runs[1])) is None
    res = _cli("--log-dir", logs[1], "--run-dir", runs[1])
    assert res.returncode == 0, res.stderr
    (logs[1] / "config.yaml").write_text("trial_name: [\n")  # damaged: its folder name is the same trial's
    assert other_trial(str(logs[1]), str(runs[1])) is None
    res = _cli("--log-dir", logs[1], "--run-dir", runs[1])
    assert res.returncode == 1, res.stderr  # config.yaml's error, in the summary: postprocessed all the same
    assert json.loads((runs[1] / "profile_summary.json").read_text())["errors"][0]["file"] == "config.yaml"


def test_a_trial_the_driver_refused_for_a_changed_config_is_not_postprocessed(tmp_path):
    """``--run-dir RUN_ROOT`` skips a trial whose summary.tsv status is ``config changed`` (refused before torchrun;
    its launcher.log holds the reason), as the driver reported it, rather than summarising it as failed."""
    from sftprof.launch.trials import SUMMARY_HEADER

    root = tmp_path / "run"
    (root / "t0").mkdir(parents=True)
    (root / "t0" / "launcher.log").write_text("sftprof: the plan's config changed since the plan\n")
    (root / "trials.tsv").write_text(f"t0\tkernel\t0\t{root / 't0'}\t{tmp_path / 'log'}\t{root / 't0' / 'a.txt'}\n")
    row = dict.fromkeys(SUMMARY_HEADER, "-") | {"trial": "t0", "status": "config changed"}
    (root / "summary.tsv").write_text("\t".join(SUMMARY_HEADER) + "\n" + "\t".join(row.values()) + "\n")
    res = _cli("--run-dir", root)
    assert res.returncode == 0 and res.stderr.splitlines() == [
        "[postprocess] [1/1] t0: not run (config changed: see its launcher.log), nothing to postprocess"]
    assert not (root / "t0" / "profile_summary.json").exists()


def test_a_copied_run_root_is_postprocessed_from_its_own_files(tmp_path):
    """``--run-dir RUN_ROOT`` on a copy of a run root (trials.tsv holds the driver's absolute paths): each trial's run
    dir is the copy's, and a log dir that was under the original run root (the default RUN_ROOT/fileroot) is read
    under the copy; a log dir elsewhere (a FILEROOT that was set) is read where it was recorded."""
    copy = tmp_path / "copy"
    rows = []
    for name, log in (("trial_a", "/orig/run/fileroot/logs/u/e/trial_a"),
                      ("trial_b", str(tmp_path / "fr" / "trial_b"))):
        (copy / name).mkdir(parents=True)
        (copy / name / "launcher.log").write_text("sftprof: trial started\n")
        rows.append(f"{name}\tkernel\t1\t/orig/run/{name}\t{log}\t/orig/run/{name}/train_args.txt\n")
    (copy / "trials.tsv").write_text("".join(rows))
    for log in (copy / "fileroot/logs/u/e/trial_a", tmp_path / "fr" / "trial_b"):  # empty: no stats.jsonl, no trace
        log.mkdir(parents=True)
    res = subprocess.run([sys.executable, str(REPO / "postprocess_profile.py"), "--run-dir", str(copy)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr  # no stats.jsonl or trace in either log dir: status unknown, an error
    logs = [json.loads((copy / n / "profile_summary.json").read_text())["paths"]["log_dir"]
            for n in ("trial_a", "trial_b")]
    assert logs == [str(copy / "fileroot/logs/u/e/trial_a"), str(tmp_path / "fr" / "trial_b")]
    assert not Path("/orig").exists()


@pytest.mark.parametrize("events, error", [
    ([], "the trace holds no events (its traceEvents array is empty)"),
    ([{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "python"}},
      {"name": "thread_name", "ph": "M", "pid": 1, "tid": 7, "args": {"name": "main"}}],
     "the trace holds no events, only 2 metadata events (ph M)")])
def test_rerun_on_a_trace_with_no_events_keeps_the_earlier_views(tmp_path, cpu_traces, events, error):
    """A rank's trace replaced by one without events (an empty traceEvents, or metadata alone) is that trace's
    error, as an empty file is: the rank's earlier views stay, the summary names it, exit 1."""
    log = _kernel_log_dir(tmp_path, cpu_traces)
    run = tmp_path / "run"
    assert _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1).returncode == 0
    views = {f: (run / "kernel_traces" / f / "rank0.pt.trace.json").read_bytes() for f in ("chrome", "gpu_only")}
    raw = log / "perf_tracer" / "rank0.pt.trace.json"
    raw.write_text(json.dumps({"traceEvents": events}))
    res = _cli("--log-dir", log, "--run-dir", run, "--profile-kind", "kernel", "--profile-step", 1)
    assert res.returncode == 1 and f"[postprocess] ERROR perf_tracer/rank0.pt.trace.json: {raw}: {error}" in res.stderr
    assert {f: (run / "kernel_traces" / f / "rank0.pt.trace.json").read_bytes() for f in views} == views
    s = json.load(open(run / "profile_summary.json"))
    assert s["errors"] == [{"file": "perf_tracer/rank0.pt.trace.json", "error": f"{raw}: {error}"}]
    assert s["counts"]["traces"] == 2 and s["counts"]["traces_ok"] == 1
    assert s["kernel_traces"][0]["kept_views"] == sorted(
        f"kernel_traces/{v}/rank0.pt.trace.json" for v in ("chrome", "cpu_only", "cuda_api_only", "gpu_only",
                                                           "split_clean"))


def test_a_full_tmpdir_is_the_traces_error_naming_the_folder(tmp_path, cpu_traces, monkeypatch):
    """A TMPDIR with no room for the summary's CPU-op file (ENOSPC on its first write) is each trace's error naming
    the folder, its free space and the space needed, not the trace's fault; the earlier views stay."""
    from sftprof.analysis.summary import postprocess_trial
    from sftprof.analysis.trace import op_store

    log = _kernel_log_dir(tmp_path, cpu_traces)
    run = tmp_path / "run"
    assert postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)[1] == 0
    views = {f: (run / "kernel_traces" / f / "rank0.pt.trace.json").read_bytes() for f in ("chrome", "gpu_only")}
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(op_store, "free_space", lambda folder: f"12.0 KiB free in {folder}")
    full_disk_on_append(monkeypatch, op_store)
    summary, code = postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)
    assert code == 1 and not [n for n in os.listdir(tmp) if n.startswith("sftprof_cpu_ops_")]
    srcs = [log / "perf_tracer" / "rank0.pt.trace.json", log / "perf_tracer" / "traces-r1.chrome.json"]
    need = [f"{os.path.getsize(s) / 2**30 * 0.26 * 1000:.1f} MB" for s in srcs]
    assert [e["error"] for e in summary["errors"]] == [
        f"{s}: temporary CPU-op file in {tmp} (TMPDIR): No space left on device (12.0 KiB free in {tmp}); it needs "
        f"about {n} for this trace (set TMPDIR to a folder with room)" for s, n in zip(srcs, need)]
    assert {f: (run / "kernel_traces" / f / "rank0.pt.trace.json").read_bytes() for f in views} == views
    assert len(summary["kernel_traces"][0]["kept_views"]) == 5


def test_a_file_in_the_place_of_an_output_folder_is_each_files_error(tmp_path, snapshot=H200_SNAPSHOT):
    """``RUN_DIR/kernel_traces`` and ``RUN_DIR/memory_snapshots/step_1`` files (``echo hi > ...``): each trace and
    snapshot is its own error naming the blocked folder (exit 1, no traceback, a summary written), the files left as
    they were and nothing staged left behind."""
    log = tmp_path / "L"
    (log / "perf_tracer").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "fixtures" / "h200_sftprof_kernel.trace.json.gz",
                log / "perf_tracer" / "rank0.pt.trace.json.gz")
    run = tmp_path / "kernel_run"
    run.mkdir()
    (run / "kernel_traces").write_text("hi\n")
    res = _cli("--log-dir", log, "--profile-kind", "kernel", "--profile-step", 1, "--run-dir", run)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    s = json.load(open(run / "profile_summary.json"))
    [error] = s["errors"]
    folder = run / "kernel_traces" / "chrome"
    src = log / "perf_tracer" / "rank0.pt.trace.json.gz"
    text = _write_failed_text(folder, "Not a directory", 20)[len("WriteError: "):]
    assert error["error"] == f"{src}: {text} (views not written)", error["error"]
    assert s["counts"]["traces_ok"] == 0 and s["counts"]["views"] == 0
    assert (run / "kernel_traces").read_text() == "hi\n"
    assert sorted(os.listdir(run)) == ["kernel_traces", "profile_summary.json", "profile_summary.md"]

    mlog, _ = _memory_log_dir(tmp_path / "m", snapshot)
    mrun = tmp_path / "memory_run"
    (mrun / "memory_snapshots").mkdir(parents=True)
    (mrun / "memory_snapshots" / "step_1").write_text("hi\n")
    res = _cli("--log-dir", mlog, "--run-dir", mrun)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    s = json.load(open(mrun / "profile_summary.json"))
    assert len(s["errors"]) == 2 and all("(not archived)" in e["error"] and "Not a directory" in e["error"]
                                         for e in s["errors"])
    assert [m["archived"] for m in s["memory_snapshots"]] == [False, False]
    assert (mrun / "memory_snapshots" / "step_1").read_text() == "hi\n"
    assert sorted(os.listdir(mrun)) == ["memory_snapshots", "profile_summary.json", "profile_summary.md"]


@pytest.mark.parametrize("raised, said", [(OSError(28, "No space left on device"), "written"),
                                          (ValueError("Unknown backend"), "drawn")])
def test_a_memory_plot_that_fails_says_whether_it_was_drawn(tmp_path, monkeypatch, raised, said):
    """A full disk while saving the memory plot is "not written", whatever else matplotlib raises "not drawn" (as the
    model-part plot's error says); the half-written file is removed from the stage."""
    from sftprof.analysis.trial import snapshots

    def fail(raw, title, path):
        Path(path).write_bytes(b"half")
        raise raised

    monkeypatch.setattr(snapshots, "plot_memory", fail)
    stage = tmp_path / "stage"
    stage.mkdir()
    error = snapshots._plot({}, "t", str(stage), "s.png", str(tmp_path / "dst"))
    assert error == f"{tmp_path / 'dst' / 's.png'}: {type(raised).__name__}: {raised} (memory plot not {said})"
    assert os.listdir(stage) == []


@pytest.mark.parametrize("text", ["", "trial\tkind\tstep\trun_dir\tlog_dir\targs_file\n", b"\xdb\x00binary"])
def test_a_run_root_whose_trials_tsv_lists_no_trial_or_is_no_text_is_an_error_naming_it(tmp_path, text):
    """A trials.tsv that is empty, only the header, or not UTF-8 is exit 2 naming the file (reviewer: the empty one
    exited 0 without a word, the binary one said only the codec's error); nothing is written."""
    root = tmp_path / "run"
    root.mkdir()
    tsv = root / "trials.tsv"
    tsv.write_bytes(text if isinstance(text, bytes) else text.encode())
    res = _cli("--run-dir", root)
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py: error: {tsv}: not UTF-8 text (byte 0), so not the driver's plan"
        if isinstance(text, bytes) else
        f"postprocess_profile.py: error: {tsv} lists no trial (the driver writes one row per planned trial before the "
        "first starts): nothing to postprocess")
    assert sorted(p.name for p in root.iterdir()) == ["trials.tsv"]
