"""Communication split into waiting for the last rank and transfer, across two ranks' synthetic traces with known
kernel times (sftprof/analysis/time/comm_wait.py)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sftprof.analysis.time import comm_wait
from sftprof.analysis.compare.runs import compare_runs
from sftprof.analysis.trace.intervals import difference, union
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer

from fixtures import two_gpu_sync_log_dir

REPO = Path(__file__).resolve().parents[1]

S = 100.0  # us per time unit of the layouts below: [100, 300] is 10-30 ms
EP = {"Process Group Name": "22", "Process Group Description": "EXPERT_MODEL_PARALLEL_GROUP"}  # members: header
CP = {"Process Group Name": "7", "Process Group Description": "CONTEXT_PARALLEL_GROUP", "Process Group Ranks": "[0, 1]"}
DP = {"Process Group Name": "30", "Process Group Description": "DATA_PARALLEL_GROUP", "Process Group Ranks": "[0, 2]"}
# rank -> NCCL calls (group args, collective, start, end) and GEMMs (start, end) on another stream
LAYOUT = {
    0: ([(EP, "all_to_allv", 100, 300), (EP, "all_to_allv", 500, 560), (CP, "_allgather_base", 600, 620),
         (CP, "_allgather_base", 640, 650), (DP, "allreduce", 700, 710)], [(50, 200)]),
    1: ([(EP, "all_to_allv", 250, 300), (EP, "all_to_allv", 420, 560), (CP, "_allgather_base", 600, 625)],
        [(400, 450)]),
}


def _trace(rank: int, shift: float = 0.0, calls=None) -> dict:
    """One rank's Chrome trace of step 1: the step annotations, and per kernel its launch, its collective op and
    itself."""
    nccl, gemms = LAYOUT[rank]
    calls = nccl if calls is None else calls
    ev = [{"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": 0.0 + shift, "dur": 1000 * S}
          for name in ("ProfilerStep#1", "sftprof/step")]  # step 1, as the trainer's traces record it
    for k, (pg, coll, t0, t1) in enumerate([(None, None, a, b) for a, b in gemms] + calls):
        corr, ext = 1000 + k, 500 + k
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                   "ts": t0 * S - 10 + shift, "dur": 5.0, "args": {"correlation": corr, "External id": ext}})
        if pg is None:
            ev.append({"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "pid": rank, "tid": 7,
                       "ts": t0 * S + shift, "dur": (t1 - t0) * S, "args": {"correlation": corr, "External id": ext}})
            continue
        ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1,
                   "ts": t0 * S - 11 + shift, "dur": 7.0, "args": {"External id": ext, "Collective name": coll, **pg}})
        ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                   "pid": rank, "tid": 20, "ts": t0 * S + shift, "dur": (t1 - t0) * S,
                   "args": {"correlation": corr, "External id": ext, "Collective name": coll, **pg}})
    return {"traceEvents": ev, "baseTimeNanoseconds": 1790857026000000000,
            "distributedInfo": {"rank": rank, "world_size": 3, "pg_config": [
                {"pg_name": "22", "pg_desc": "EXPERT_MODEL_PARALLEL_GROUP", "pg_size": 2, "ranks": [0, 1]}]}}


def _records(trace: dict) -> dict:
    a = KernelTraceAnalyzer(trace)
    for e in trace["traceEvents"]:
        a.add(e)
    return a.summary()["collectives"]["calls"]


def test_difference_of_interval_sets_matches_a_grid():
    rng = np.random.default_rng(3)
    a_s = rng.uniform(0, 100, 20)
    b_s = rng.uniform(0, 100, 30)
    a, b = union(a_s, a_s + rng.uniform(0, 8, 20)), union(b_s, b_s + rng.uniform(0, 5, 30))
    d_s, d_e = difference(a, b)
    grid = np.arange(0, 115, 0.001) + 0.0005
    inside = lambda iv: np.any((grid[:, None] >= iv[0]) & (grid[:, None] < iv[1]), axis=1)  # noqa: E731
    assert np.all(d_e > d_s) and np.all(d_s[1:] >= d_e[:-1])
    assert float(np.sum(d_e - d_s)) == pytest.approx((inside(a) & ~inside(b)).sum() * 0.001, abs=0.02)


def test_two_ranks_split_into_wait_and_transfer_end_to_end(tmp_path):
    log = tmp_path / "log"
    (log / "perf_tracer").mkdir(parents=True)
    for r in (0, 1):
        (log / "perf_tracer" / f"rank{r}.pt.trace.json").write_text(json.dumps(_trace(r)))
    run = tmp_path / "run"
    s, rc = postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)
    assert rc == 0
    on_disk = json.loads((run / "profile_summary.json").read_text())
    assert all("calls" not in t["summary"]["collectives"] for t in on_disk["kernel_traces"])  # matched, not written
    cw = on_disk["comm_wait"]
    assert cw["clock_offsets"] == [{"ranks": [0, 1], "median_end_difference_us": 0.0, "end_difference_mad_us": 0.0,
                                     "calls": 2}]
    # call 0: rank 1 arrives last at 250, rank 0 waits 150 of its 200 (50 of them exposed: [200, 250] after
    # its GEMM); call 1: rank 0 arrives last at 500, rank 1 waits 80 of 140, 50 exposed ([450, 500])
    assert cw["groups"] == [{
        "group": "22", "label": "EP", "members": [0, 1], "calls": 2,
        "ranks": [{"rank": 0, "calls": 2, "comm_ms": 26.0, "wait_ms": 15.0, "transfer_ms": 11.0, "exposed_ms": 16.0,
                   "exposed_wait_ms": 5.0, "exposed_transfer_ms": 11.0, "last_arrivals": 1,
                   "waited_for": [{"rank": 1, "wait_ms": 15.0, "exposed_wait_ms": 5.0}]},
                  {"rank": 1, "calls": 2, "comm_ms": 19.0, "wait_ms": 8.0, "transfer_ms": 11.0, "exposed_ms": 16.0,
                   "exposed_wait_ms": 5.0, "exposed_transfer_ms": 11.0, "last_arrivals": 1,
                   "waited_for": [{"rank": 0, "wait_ms": 8.0, "exposed_wait_ms": 5.0}]}],
        "straggler": {"rank": 1, "last_arrivals": 1, "others_wait_ms": 15.0, "others_exposed_wait_ms": 5.0}}]
    assert cw["not_split"] == [
        {"group": "7", "label": "CP", "reason": "the member ranks ran different numbers of its calls in the step "
                                                "window (rank 0: 2, rank 1: 1), so they cannot be paired"},
        {"group": "30", "label": "DP", "reason": "no trace of rank 2 in this run (perf_tracer.ranks "
                                                 "profiles only some ranks, or the trace failed)"}]
    assert cw["ranks"] == [
        {"rank": 0, "exposed_ms": 16.0, "exposed_wait_ms": 5.0, "exposed_transfer_ms": 11.0,
         "waited_for": [{"rank": 1, "exposed_wait_ms": 5.0}]},
        {"rank": 1, "exposed_ms": 16.0, "exposed_wait_ms": 5.0, "exposed_transfer_ms": 11.0,
         "waited_for": [{"rank": 0, "exposed_wait_ms": 5.0}]}]
    # rank 1's exposed communication: EP 16 + CP 2.5 ms (a larger share of its GPU time than rank 0's 20 ms, so
    # the finding is stated for rank 1); the finding states the split and what is not split
    found = [f["text"] for f in s["findings"] if "exposed communication" in f["text"] and f["section"] != "#ranks"]
    assert found == ["rank 1: exposed communication 18.5 ms, of which 5.0 ms waiting for rank 0 to arrive (load "
                     "imbalance before the collective) and 11.0 ms transfer, 2.5 ms not split (process groups not "
                     "split by rank, or kernels outside the step window); largest exposed group EP 16.0 ms "
                     "(also on rank 0)"]
    md = (run / "profile_summary.md").read_text()
    assert "| EP | 0 | 2 | 26.000 | 15.000 | 11.000 | 16.000 | 5.000 | 11.000 | 1 | r1 15.0 |" in md
    assert ("- EP: the other ranks waited longest for rank 1: 15.0 ms (5.0 ms exposed); it arrived last in 1 of 2 "
            "calls") in md
    assert ("- rank 1: exposed communication in the split groups 16.0 ms: 5.0 ms waiting (for r0 5.0) and 11.0 ms "
            "transfer (groups that overlap each other count once)") in md
    assert "Not split (2 process groups):" in md
    # the ranks' own work (NCCL kernels left out): rank 0's GEMM ran 15 ms, rank 1's 5 ms
    assert on_disk["ranks"]["work_spread"] == {
        "ranks": [0, 1], "min_spread_ms": 0.5, "compared_ms": {"0": 15.0, "1": 5.0},
        "rows": [{"part": "kernel:GEMM", "label": "GEMM (by kernel name)", "layer": None, "phase": "forward",
                  "min_ms": 5.0, "min_rank": 1, "max_ms": 15.0, "max_rank": 0, "spread_ms": 10.0}]}
    assert "| GEMM (by kernel name) | – | forward | 5.000 (r1) | 15.000 (r0) | 10.000 |" in md
    assert "- DP (process group 30): no trace of rank 2 in this run" in md
    # compare: rank 1 reaches EP call 0 at 200 instead of 250, so rank 0 waits 100 us, none of it exposed
    earlier = [(EP, "all_to_allv", 200, 300)] + LAYOUT[1][0][1:]
    (log / "perf_tracer" / "rank1.pt.trace.json").write_text(json.dumps(_trace(1, calls=earlier)))
    assert postprocess_trial(str(log), str(tmp_path / "run_b"), "kernel", 1, jobs=1)[1] == 0
    report = compare_runs(str(run), str(tmp_path / "run_b"), all_rows=True)
    assert "| rank 0 exposed wait, all split groups | 5.000 | 0.000 | -5.000 | -100.0% |" in report
    assert "| rank 0 EP exposed transfer | 11.000 | 16.000 | +5.000 | +45.5% |" in report


def test_compare_leaves_out_totals_of_runs_that_split_other_groups(tmp_path):
    def run(name: str, shift: float = 0.0, calls1=None) -> str:
        log = tmp_path / name / "log"
        (log / "perf_tracer").mkdir(parents=True)
        (log / "perf_tracer" / "rank0.pt.trace.json").write_text(json.dumps(_trace(0)))
        (log / "perf_tracer" / "rank1.pt.trace.json").write_text(json.dumps(_trace(1, shift=shift, calls=calls1)))
        assert postprocess_trial(str(log), str(tmp_path / name / "run"), "kernel", 1, jobs=1)[1] == 0
        return str(tmp_path / name / "run")

    ep_only = run("a")
    # rank 1's clock 200 us ahead: nothing is split, so there is no wait to compare (not 0 ms)
    report = compare_runs(ep_only, run("clock", shift=200.0), all_rows=True)
    assert "| rank 0 exposed wait, all split groups | 5.000 | – | – | – |" in report
    assert "| rank 1 exposed transfer, all split groups | 11.000 | – | – | – |" in report
    # rank 1 also runs CP's second call: B splits CP and EP, A only EP; the per-group rows stay
    report = compare_runs(ep_only, run("cp", calls1=LAYOUT[1][0] + [(CP, "_allgather_base", 640, 650)]), all_rows=True)
    assert "all split groups" not in report
    assert ("Rank 0: the runs split different process groups (A: EP; B: CP, EP), so its all-split-groups totals "
            "are not compared; the per-group rows are.") in report
    assert "| rank 0 EP exposed wait | 5.000 | 5.000 | +0.000 | +0.0% |" in report
    assert "| rank 0 CP exposed wait | – | 0.000 | – | – |" in report
    # a split group of unknown parallelism (label None) is named as such in the note
    summary = json.loads((tmp_path / "cp" / "run" / "profile_summary.json").read_text())
    for g in summary["comm_wait"]["groups"]:
        g["label"] = None if g["label"] == "CP" else g["label"]
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "profile_summary.json").write_text(json.dumps(summary))
    assert "(A: EP; B: EP, None)" in compare_runs(ep_only, str(tmp_path / "unknown"), all_rows=True)
    # a run that traced rank 0 only: rank 1's trace figures in A are named as not compared, not silently dropped
    log = tmp_path / "r0" / "log"
    (log / "perf_tracer").mkdir(parents=True)
    (log / "perf_tracer" / "rank0.pt.trace.json").write_text(json.dumps(_trace(0)))
    assert postprocess_trial(str(log), str(tmp_path / "r0" / "run"), "kernel", 1, jobs=1)[1] == 0
    report = compare_runs(ep_only, str(tmp_path / "r0" / "run"), all_rows=True)  # B has no stats.jsonl: status unknown
    assert report.count("only in run") == 1 and ("Rank(s) 1: a trace only in run A; not compared below (run B's "
                                                 "trial status is unknown (no completion record): it stopped before "
                                                 "writing that trace, or profiled other ranks).") in report
    # the reason comes from run B's summary: an ok trial profiled other ranks; a failed one left no trace of the
    # rank; a trace of the rank that failed to process is named as such
    summary = json.loads((tmp_path / "r0" / "run" / "profile_summary.json").read_text())
    errored = dict(summary, status="ok", kernel_traces=summary["kernel_traces"] + [{"rank": 1, "error": "truncated"}])
    for name, changed, why in (
            ("ok", dict(summary, status="ok"), "the runs profiled different ranks"),
            ("failed", dict(summary, status="failed"), "run B's trial failed (status failed) and left no trace of "
                                                       "that rank"),
            ("errored", errored, "run B's trace of that rank could not be processed (its error is in that summary)")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "profile_summary.json").write_text(json.dumps(changed))
        report = compare_runs(ep_only, str(tmp_path / name), all_rows=True)
        assert report.count("only in run") == 1 and (
            f"Rank(s) 1: a trace only in run A; not compared below ({why}).") in report.splitlines(), name
    # run B's config profiles rank 1 (perf_tracer.ranks='' on 2 ranks) but its log dir has no trace of it: its
    # summary's warning says so, and so does the report (the reviewer's case), not 'profiled different ranks'
    (log / "config.yaml").write_text(json.dumps({"actor": {"backend": "megatron:d2"}, "perf_tracer": {"ranks": ""}}))
    s, _ = postprocess_trial(str(log), str(tmp_path / "r0" / "cfg"), "kernel", 1, jobs=1)
    assert {"file": "perf_tracer/rank1.pt.trace.json", "warning": "rank 1: no trace in the log dir, though "
            "perf_tracer.ranks='' profiles it; this summary leaves that rank out"} in s["warnings"]
    report = compare_runs(ep_only, str(tmp_path / "r0" / "cfg"), all_rows=True)
    assert report.count("only in run") == 1 and (
        "Rank(s) 1: a trace only in run A; not compared below (run B profiled that rank but has no trace of it in its "
        "log dir: deleted or never written (a warning in that summary)).") in report.splitlines()


@pytest.mark.parametrize("spec, warned", [("", [1]), ("pp_rank0", []), ("0-1", [1]), ("0", [])])
def test_a_missing_trace_of_a_profiled_rank_is_named(tmp_path, spec, warned):
    log = tmp_path / "log"
    (log / "perf_tracer").mkdir(parents=True)
    (log / "perf_tracer" / "rank0.pt.trace.json").write_text(json.dumps(_trace(0)))
    (log / "config.yaml").write_text(json.dumps({"actor": {"backend": "megatron:d2"}, "perf_tracer": {"ranks": spec}}))
    s, rc = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert rc == 0 and s["counts"]["traces_ok"] == 1
    assert [w for w in s["warnings"] if w["file"].startswith("perf_tracer/")] == [
        {"file": f"perf_tracer/rank{r}.pt.trace.json", "warning": f"rank {r}: no trace in the log dir, though "
         f"perf_tracer.ranks={spec!r} profiles it; this summary leaves that rank out"} for r in warned]


def test_a_rerun_without_a_ranks_trace_names_its_earlier_views(tmp_path):
    """Postprocessed with both ranks' traces, then again into the same run dir with rank 1's trace gone: rank 1's
    views and model-part plot stay (nothing written is deleted) and a warning names the rank and each file."""
    log, run = tmp_path / "log", tmp_path / "run"
    (log / "perf_tracer").mkdir(parents=True)
    for r in (0, 1):
        (log / "perf_tracer" / f"rank{r}.pt.trace.json").write_text(json.dumps(_trace(r)))
    assert postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)[1] == 0
    before = {p: p.read_bytes() for p in run.glob("kernel_traces/*/rank1.pt.trace.json")}
    assert len(before) == 5
    (log / "perf_tracer" / "rank1.pt.trace.json").unlink()
    s, rc = postprocess_trial(str(log), str(run), "kernel", 1, jobs=1)
    assert rc == 0 and [t["rank"] for t in s["kernel_traces"]] == [0]
    assert {p: p.read_bytes() for p in run.glob("kernel_traces/*/rank1.pt.trace.json")} == before
    files = sorted(str(p.relative_to(run)) for p in before) + ["model_parts/rank1.png"]
    assert (run / files[-1]).exists()
    assert {"file": ", ".join(files), "warning": "rank 1: 6 file(s) of an earlier postprocess kept (views, "
            "model-part plot): no trace of this rank in the log dir this time, so they are not this summary's "
            "figures and may not match them"} in s["warnings"]
    assert not [w for w in s["warnings"] if w["warning"].startswith("rank 0:")]


def test_clocks_that_disagree_refuse_the_split():
    # rank 1 on a clock 200 us ahead: every matched call ends 200 us later there
    cw = comm_wait.split({0: _records(_trace(0)), 1: _records(_trace(1, shift=200.0))})
    assert cw["clock_offsets"] == [{"ranks": [0, 1], "median_end_difference_us": 200.0, "end_difference_mad_us": 0.0,
                                     "calls": 2}]
    assert cw["groups"] == []
    assert cw["not_split"][1] == {"group": "22", "label": "EP", "reason": (
        "the clocks of ranks 0 and 1 disagree: their matched calls end +200.0 µs apart (median over 2 calls; "
        "tolerance 50 µs), as on different hosts; a wait measured across them would be off by as much")}
    assert cw["ranks"] == []  # no split group: no rank row (not a 0 ms wait)
    # within the tolerance the split stands, shifted by the offset: rank 0 waits 40 us longer in call 0
    near = comm_wait.split({0: _records(_trace(0)), 1: _records(_trace(1, shift=40.0))})
    assert near["groups"][0]["ranks"][0]["wait_ms"] == 15.04


def test_the_straggler_is_the_rank_waited_for_longest_not_the_one_last_most_often():
    # rank 0 arrives last in calls 0 and 1 by 10 units each (rank 1 waits 2 ms), rank 1 in call 2 by 90 (9 ms)
    ep = {0: [(EP, "all_to_allv", 110, 200), (EP, "all_to_allv", 310, 400), (EP, "all_to_allv", 600, 700)],
          1: [(EP, "all_to_allv", 100, 200), (EP, "all_to_allv", 300, 400), (EP, "all_to_allv", 690, 700)]}
    cw = comm_wait.split({r: _records(_trace(r, calls=ep[r])) for r in (0, 1)})
    (g,) = cw["groups"]
    assert [(r["rank"], r["last_arrivals"], r["wait_ms"]) for r in g["ranks"]] == [(0, 2, 9.0), (1, 1, 2.0)]
    assert g["straggler"] == {"rank": 1, "last_arrivals": 1, "others_wait_ms": 9.0, "others_exposed_wait_ms": 9.0}


def test_calls_of_different_collectives_are_not_paired():
    other = [(EP, "all_to_allv", 250, 300), (EP, "allreduce", 420, 560)]
    cw = comm_wait.split({0: _records(_trace(0)), 1: _records(_trace(1, calls=other))})
    assert cw["not_split"] == [
        {"group": "7", "label": "CP", "reason": "the member ranks ran different numbers of its calls in the step "
                                                "window (rank 0: 2, rank 1: 0), so they cannot be paired"},
        {"group": "22", "label": "EP", "reason": (
            "call 1 is all_to_allv on rank 0 but allreduce on rank 1, so the calls cannot be paired")},
        {"group": "30", "label": "DP", "reason": "no trace of rank 2 in this run (perf_tracer.ranks "
                                                 "profiles only some ranks, or the trace failed)"}]
    assert comm_wait.split({0: {"groups": {}, "unnamed_kernels": 0}}) is None


def test_work_spread_compares_only_ranks_that_ran_a_cell():
    """Per (part, layer, phase) the fastest and slowest rank among those that ran it (pipeline stages hold other
    layers: a cell of one rank only is not compared), spreads under 0.5 ms left out, the largest first, 8 at most."""
    from sftprof.analysis.time.rank_table import work_spread

    cells = {0: [["experts", 0, "forward", 10.0], ["experts", 0, "backward", 20.0], ["attn_core", 0,
                                                                                              "forward", 100.0]],
             1: [["experts", 0, "forward", 13.5], ["experts", 0, "backward", 20.4], ["attn_core", 0,
                                                                                              "forward", 99.0]],
             2: [["experts", 0, "forward", 12.0], ["attn_core", 5, "forward", 300.0]],
             3: None}
    assert work_spread(cells) == {
        "ranks": [0, 1, 2], "min_spread_ms": 0.5, "compared_ms": {0: 130.0, 1: 132.9, 2: 12.0},
        "rows": [{"part": "experts", "label": "expert GEMMs (routed)", "layer": 0, "phase": "forward",
                  "min_ms": 10.0, "min_rank": 0, "max_ms": 13.5, "max_rank": 1, "spread_ms": 3.5},
                 {"part": "attn_core", "label": "attention core", "layer": 0, "phase": "forward",
                  "min_ms": 99.0, "min_rank": 1, "max_ms": 100.0, "max_rank": 0, "spread_ms": 1.0}]}
    assert work_spread({0: cells[0], 3: None}) is None


def test_excerpt_kernels_whose_launch_is_cut_off_count_in_their_group(tmp_path):
    """The 2-GPU H200 excerpt through the CLI: the TP-CP all-reduce on rank 1 and the ETP-EP all-gather on both ranks
    started inside ``ProfilerStep#2``, but their launching CUDA calls (and collective records) lie before the excerpt.
    They were left out of the by-group table as "outside the step window" while the totals counted them, so the
    0.235 ms gap was put down to EP (+0.017 ms) and the Ranks text listed no group at all."""
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, str(REPO / "postprocess_profile.py"), "--log-dir",
                          str(two_gpu_sync_log_dir(tmp_path)), "--run-dir", str(run)],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    s = json.loads((run / "profile_summary.json").read_text())
    for t in s["kernel_traces"]:  # every group of the totals has its row (all of it exposed here)
        k = t["summary"]
        assert k["collectives"]["exposed_by_group_ms"] == k["communication"]["by_group_ms"], t["rank"]
        assert k["collectives"]["exposed_outside_window_ms"] == 0.0
        assert k["parts"]["outside_window"] == 0
    assert [(r["group"], r["collective"], r["calls"], r["gpu_ms"]) for r in s["kernel_traces"][1]["summary"][
        "collectives"]["rows"]] == [("EP", "all_to_allv", 2, 3.9078), ("TP-CP", "?", 1, 0.2201),
                                    ("ETP-EP", "?", 1, 0.0668)]
    assert s["ranks"]["exposed_by_group"] == {
        "ranks": [0, 1], "max_rank": 1, "min_rank": 0, "totals": {"0": 3.9599, "1": 4.1948}, "extra_ms": 0.235,
        "groups": [{"group": "EP", "ms": {"0": 3.8912, "1": 3.9078}}, {"group": "ETP-EP", "ms": {"0": 0.0687,
                                                                                                "1": 0.0668}},
                   {"group": "TP-CP", "ms": {"0": 0.0, "1": 0.2201}}],
        "extra_by_group": [["TP-CP", 0.22], ["EP", 0.017], ["ETP-EP", -0.002]]}
    assert [f["text"] for f in s["findings"] if f["section"] == "#ranks"] == [
        "rank 1 has 0.2 ms more exposed communication than rank 0 (4.2 vs 4.0 ms); the largest per-group difference "
        "is TP-CP, +0.2 ms"]
    # the ETP-EP call is now on both ranks' timelines and is split; rank 0's TP-CP call lies before the excerpt
    assert [g["label"] for g in s["comm_wait"]["groups"]] == ["EP", "ETP-EP"]
    assert s["comm_wait"]["not_split"] == [{"group": "21", "label": "TP-CP", "reason": (
        "the member ranks ran different numbers of its calls in the step window (rank 0: 0, rank 1: 1), so they "
        "cannot be paired")}]
    md = (run / "profile_summary.md").read_text()
    lines = md.splitlines()
    start = lines.index("| group | rank 0 | rank 1 |")
    assert lines[start:start + 5] == ["| group | rank 0 | rank 1 |", "|---|---|---|", "| EP | 3.891 | 3.908 |",
                                      "| ETP-EP | 0.069 | 0.067 |", "| TP-CP | 0.000 | 0.220 |"]
    assert ("Rank 1 has 0.2 ms more exposed communication than rank 0; by group (ms; groups that overlap each other "
            "each count, so they need not add up to it): TP-CP +0.2. A collective's") in md
    assert "): ." not in md
    start = lines.index("### Communication by process group, rank 1")
    table = lines[start:].index("| group | exposed ms |") + start
    assert lines[table:table + 6] == ["| group | exposed ms |", "|---|---|", "| EP | 3.908 |", "| ETP-EP | 0.067 |",
                                      "| TP-CP | 0.220 |", ""]


def test_nccl_kernels_outside_the_step_window_have_a_row_of_their_own(tmp_path):
    """Rank 0 runs a 3 ms all-reduce after its step window (counted in its exposed total, in no group of the window):
    it is the row 'outside the step window' and, as the largest difference, the finding says so instead of naming a
    group. Rank 1's CP kernel has no launch record (cut off): it starts in the window, so it counts in CP."""
    log = tmp_path / "log"
    (log / "perf_tracer").mkdir(parents=True)
    rank0 = _trace(0, calls=LAYOUT[0][0] + [(EP, "allreduce", 1100, 1130)])
    rank1 = _trace(1)
    cp_corr = next(e["args"]["correlation"] for e in rank1["traceEvents"]
                   if e["cat"] == "kernel" and e["ts"] == 600 * S)
    rank1["traceEvents"] = [e for e in rank1["traceEvents"] if not (
        e["cat"] == "cuda_runtime" and e["args"]["correlation"] == cp_corr)]
    for r, trace in ((0, rank0), (1, rank1)):
        (log / "perf_tracer" / f"rank{r}.pt.trace.json").write_text(json.dumps(trace))
    s, rc = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert rc == 0
    coll = [t["summary"]["collectives"] for t in s["kernel_traces"]]
    assert [(c["exposed_by_group_ms"], c["exposed_outside_window_ms"]) for c in coll] == [
        ({"CP": 3.0, "DP": 1.0, "EP": 16.0}, 3.0), ({"CP": 2.5, "EP": 16.0}, 0.0)]
    assert [t["summary"]["communication"]["exposed_ms"] for t in s["kernel_traces"]] == [23.0, 18.5]
    ex = s["ranks"]["exposed_by_group"]
    assert ex["groups"] == [{"group": "CP", "ms": {0: 3.0, 1: 2.5}}, {"group": "DP", "ms": {0: 1.0, 1: 0.0}},
                            {"group": "EP", "ms": {0: 16.0, 1: 16.0}},
                            {"group": "outside the step window", "ms": {0: 3.0, 1: 0.0}}]
    assert ex["extra_by_group"] == [("outside the step window", 3.0), ("DP", 1.0), ("CP", 0.5), ("EP", 0.0)]
    assert [f["text"] for f in s["findings"] if f["section"] == "#ranks"] == [
        "rank 0 has 4.5 ms more exposed communication than rank 1 (23.0 vs 18.5 ms); the largest difference, +3.0 ms, "
        "is in NCCL kernels outside the step window, not attributed to a group"]
    md = (tmp_path / "run" / "profile_summary.md").read_text()
    assert "| outside the step window | 3.000 | 0.000 |" in md.splitlines()
    assert ("by group (ms; groups that overlap each other each count, so they need not add up to it): outside the "
            "step window +3.0, DP +1.0, CP +0.5. A collective's") in md
    # rank 0's own table has the row; rank 1's, without such kernels, has none
    assert md.count("| outside the step window | 3.000 |\n") == 1
    # the call outside the window is in no timeline: the pairing is that of the test above
    assert s["comm_wait"]["not_split"][0]["reason"] == (
        "the member ranks ran different numbers of its calls in the step window (rank 0: 2, rank 1: 1), so they "
        "cannot be paired")
