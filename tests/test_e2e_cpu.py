"""End to end on the tiny CPU preset: the real driver, 2 ranks (gloo, FSDP2), steps 0 and 1, both kinds."""
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sftprof.analysis.trial.wall_time import PHASES

ROOT = Path(__file__).resolve().parents[1]
VIEWS = ("chrome", "split_clean.chrome", "gpu_only.chrome", "cpu_only.chrome", "cuda_api_only.chrome")
KERNEL_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "CONFIG")}
    env.update(CONFIG="tiny_cpu", FILEROOT=str(base / "fileroot"), RUN_ROOT=str(base / "run"),
               PROFILE_STEPS="0,1", PROFILE_KINDS="kernel,memory", PROFILE_STAMP="e2e",
               PROFILE_FAKE_SEQ_LEN="512", OMP_NUM_THREADS="1",
               PROFILE_FOO="x")  # not a driver variable, no close name: a warning before launch, repeated at the end
    out = subprocess.run(["bash", str(ROOT / "run_qwen3_30b_a3b_sft_profile.sh")], env=env,
                         capture_output=True, text=True, timeout=900)
    return out, base / "run"


def summary_rows(run_root: Path):
    with open(run_root / "summary.tsv") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_four_trials_succeed(run):
    out, run_root = run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = summary_rows(run_root)
    assert [(r["kind"], r["step"], r["status"]) for r in rows] == [
        ("kernel", "0", "0"), ("memory", "0", "0"), ("kernel", "1", "0"), ("memory", "1", "0")]
    assert (run_root / "profile_settings.log").read_text().startswith("CONFIG=tiny_cpu")
    assert "sftprof: no CUDA on this node: memory trials run but record no snapshot (CPU)" in out.stderr
    assert "sftprof: plan: 4 trial(s) on 2 rank(s) (1 node(s) x 2, fsdp:d2, CPU (no CUDA)): kernel step 0, " \
           "memory step 0, kernel step 1, memory step 1" in out.stderr
    # The narrow end table, the summaries under it and the compare command.
    table = out.stdout[out.stdout.index("trial          status"):].splitlines()
    assert table[0].split() == ["trial", "status", "step", "time", "peak", "mem", "top", "finding"]
    assert [" ".join(line.split()[:4]) for line in table[1:5]] == [
        "kernel step 0 ok", "memory step 0 no", "kernel step 1 ok", "memory step 1 no"]
    assert all("no snapshot (CPU)" in line for line in (table[2], table[4]))
    assert max(map(len, table[:5])) <= 120
    assert table[6:8] == ["wall time per trial, s (train: torchrun's launch to its exit; postproc *: while the next "
                          "trial trained):",
                          "trial          start  imports  setup  build  step 0  steps  profiled  profiler  teardown  "
                          "exit  train  postproc"]
    assert [" ".join(line.split()[:3]) for line in table[8:12]] == [
        "kernel step 0", "memory step 0", "kernel step 1", "memory step 1"]
    assert [line.split()[-1].endswith("*") for line in table[8:12]] == [True, False, True, False]
    assert table[12].startswith("cold start (step 0's time less a warm step's, inside step 0 or profiled): "
                                "kernel step 1 ") and "memory step 1 " in table[12]
    assert max(map(len, table[6:12])) <= 120
    assert table[14:19] == ["summaries (Markdown; the .json next to each holds every figure):"] + [
        f"  {row['run_dir']}/profile_summary.md" for row in summary_rows(run_root)]
    python = shutil.which(os.environ.get("PYTHON", "python3"))   # the driver's PYTHON, runnable from any folder
    assert table[20:22] == ["compare with another run (run roots or trial dirs):",
                            f"  {python} {ROOT / 'postprocess_profile.py'} compare {run_root} OTHER_RUN_ROOT"]
    warning = "PROFILE_FOO is not a driver variable and is ignored (`bash run_qwen3_30b_a3b_sft_profile.sh --help` lists them)"
    assert f"sftprof: warning: {warning}\n" in out.stderr
    assert f"\n# warning: {warning}\n" in (run_root / "profile_settings.log").read_text()
    assert table[22:] == ["", "warnings before launch (also in profile_settings.log):", f"  {warning}"]


def test_wall_time_phases_sum_to_the_trials_elapsed_time_from_its_logs(run):
    """Each summary's wall time: the phases by name, in order, none negative, summing to summary.tsv's elapsed_s
    (torchrun launched to ended, whole seconds cut) and to trial_times.json's span; the boundaries are those of the
    logs: rank 0's step records (a step's phase holds its timed step_time_s), the trainer's ``engine built in`` line
    (its build phase runs on to step 0's start) and the launcher's record; the end table shows the same figures."""
    out, run_root = run
    table = out.stdout[out.stdout.index("wall time per trial"):].splitlines()
    for row, line in zip(summary_rows(run_root), table[2:6]):
        run_dir, log_dir = Path(row["run_dir"]), Path(row["log_dir"])
        wall = json.loads((run_dir / "profile_summary.json").read_text())["wall_time"]
        assert [p["phase"] for p in wall["phases"]] == list(PHASES) == [
            "start_up", "imports", "setup", "engine_build", "step_0", "warm_steps", "profiled_steps", "profiler",
            "teardown", "atexit", "exit"]
        seconds = {p["phase"]: p["seconds"] for p in wall["phases"]}
        assert all(v >= 0 for v in seconds.values()), seconds
        times = json.loads((run_dir / "trial_times.json").read_text())
        assert wall["elapsed_s"] == round(times["torchrun_ended_unix_s"] - times["launched_unix_s"], 3)
        elapsed = int(row["elapsed_s"])  # the launcher's monotonic clock, whole seconds cut
        assert elapsed - 0.01 <= sum(seconds.values()) < elapsed + 1.01
        assert elapsed - 0.01 <= wall["elapsed_s"] < elapsed + 1.01
        steps = [json.loads(x) for x in (log_dir / "stats.jsonl").read_text().splitlines()]
        done, teardown, exited = steps[-3:]
        records = {r["step"]: r for r in steps[:-3]}
        assert seconds["start_up"] == round(done["trainer_started_unix_s"] - times["launched_unix_s"], 3)
        destroyed = teardown["process_group_destroyed_unix_s"]
        assert seconds["teardown"] == round(destroyed - done["ended_unix_s"], 3)
        assert wall["barrier_s"] == round(teardown["barrier_done_unix_s"] - done["ended_unix_s"], 3)
        # rank 0's atexit handlers ran after the teardown record and before torchrun's end
        atexit_done, ended = exited["atexit_done_unix_s"], times["torchrun_ended_unix_s"]
        assert exited["type"] == "exit" and destroyed <= atexit_done <= ended
        assert seconds["atexit"] == round(atexit_done - destroyed, 3)
        assert seconds["exit"] == round(ended - atexit_done, 3)
        built = float(re.search(r"engine built in ([\d.]+) s", (log_dir / "trainer.log").read_text()).group(1))
        assert seconds["engine_build"] >= built - 0.05
        rank0 = {k: next(r["step_time_s"] for r in rec["ranks"] if r["rank"] == 0) for k, rec in records.items()}
        step = int(row["step"])
        assert seconds["profiled_steps"] >= rank0[step] and records[step]["profiled"]
        assert (seconds["step_0"] >= rank0[0]) if step == 1 else seconds["step_0"] == 0.0
        assert seconds["warm_steps"] == 0.0  # TOTAL_STEPS = profile step + 1: no other step
        assert seconds["profiler"] == round(sum(r["profiler_s"] for r in records.values()), 3)
        cells = line.split()
        # the end table's exit column holds the summary's atexit and exit phases
        shown = [f"{seconds[k]:.1f}" for k in PHASES if k not in ("atexit", "exit")]
        assert cells[3:13] == shown + [f"{seconds['atexit'] + seconds['exit']:.1f}"]
        assert cells[13] == f"{wall['elapsed_s']:.1f}"
        cold = wall["cold_start"]
        if cold:  # step 0 faster than the profiled step 1 (its profiler's cost): not measurable, and why
            assert ("not_measurable" in cold) == (cold["cold_start_s"] < 0)
            cold = {k: v for k, v in cold.items() if k != "not_measurable"}
        assert cold == ({"step0_s": round(records[0]["step_time_s"], 3),
                         "warm_step_s": round(records[1]["step_time_s"], 3), "warm_steps": [1], "reference_profiled": True,
                         "cold_start_s": round(records[0]["step_time_s"] - records[1]["step_time_s"], 3)}
                        if step == 1 else None)


def test_kernel_trials_are_postprocessed_while_the_next_memory_trial_trains(run):
    """From the launcher's recorded clocks: a kernel trial's postprocessing starts when its torchrun has ended and
    ends after the memory trial after it was launched (they overlap); a kernel trial is launched only once every
    earlier trial is postprocessed (nothing overlaps its training); memory trials are postprocessed in the foreground
    (the next trial is a kernel trial, or none); each row's status is its own."""
    _, run_root = run
    rows = summary_rows(run_root)
    times = [json.loads((Path(r["run_dir"]) / "trial_times.json").read_text()) for r in rows]
    assert [t["postprocess_background"] for t in times] == [True, False, True, False]
    for k in (0, 2):  # kernel step 0 then memory step 0; kernel step 1 then memory step 1
        kernel, memory = times[k], times[k + 1]
        assert kernel["torchrun_ended_unix_s"] <= kernel["postprocess_started_unix_s"] <= memory["launched_unix_s"]
        assert memory["launched_unix_s"] < kernel["postprocess_ended_unix_s"]
    assert times[2]["launched_unix_s"] > max(times[0]["postprocess_ended_unix_s"], times[1]["postprocess_ended_unix_s"])
    assert all(t["launched_unix_s"] < t["torchrun_ended_unix_s"] <= t["postprocess_started_unix_s"]
               < t["postprocess_ended_unix_s"] for t in times)
    # each trial's postprocessing process was started with its torchrun (its imports while it trained), and let go
    # on once the torchrun had ended
    assert all(t["launched_unix_s"] <= t["postprocess_launched_unix_s"] < t["torchrun_ended_unix_s"]
               <= t["postprocess_started_unix_s"] for t in times)
    assert [(r["status"], r["train_status"], r["postprocess_status"]) for r in rows] == [("0", "0", "0")] * 4


def test_third_party_messages_are_kept_off_the_console(run):
    """transformers' FutureWarning and Kineto's "USDT: ... profiler_start" lines are not on the console (nor in
    launcher.log, which tees it); rank 0's trainer.log keeps them, and their count."""
    out, run_root = run
    for row in summary_rows(run_root):
        console = (Path(row["run_dir"]) / "launcher.log").read_text()
        assert "FutureWarning" not in console and "USDT:" not in console and "[rank 0] INFO step 0 | loss" in console
        log = (Path(row["log_dir"]) / "trainer.log").read_text()
        kept = [line for line in log.splitlines() if "FutureWarning: `gradient_checkpointing_enable`" in line
                or "] profiler_st" in line]
        assert kept
        assert log.splitlines()[-1].endswith(f"INFO {len(kept)} third-party message(s) (warnings of other packages, "
                                             "Kineto's USDT lines) were kept off the console; they are above in this log")
        assert ("] profiler_start" in log) == (row["kind"] == "kernel")
    assert "FutureWarning" not in out.stdout + out.stderr and "USDT:" not in out.stdout + out.stderr


def test_views_are_valid_and_separated(run):
    _, run_root = run
    for row in summary_rows(run_root):
        if row["kind"] != "kernel":
            continue
        traces = Path(row["run_dir"]) / "kernel_traces"
        for view in VIEWS:
            data = json.loads((traces / view.removesuffix(".chrome") / "rank0.pt.trace.json").read_text())
            events = data["traceEvents"] if isinstance(data, dict) else data
            cats = {e.get("cat") for e in events}
            if view in ("gpu_only.chrome", "cuda_api_only.chrome"):
                # A CPU run has no GPU work and no CUDA API calls: the view holds the profiler's step slice (for
                # TensorBoard's profiler plugin), its process's and track's names, and the record saying so.
                step = events[0]
                assert (step["name"], step["cat"], step["ph"]) == (f"ProfilerStep#{row['step']}", "user_annotation", "X")
                assert {(e["ph"], e["pid"]) for e in events[1:-1]} == {("M", step["pid"])}
                chrome = json.loads((traces / "chrome" / "rank0.pt.trace.json").read_text())["traceEvents"]
                (label,) = [e["args"]["name"] for e in chrome if e["name"] == "thread_name" and
                            (e["pid"], e["tid"]) == (step["pid"], step["tid"])]
                assert label.startswith(f"Annotations: thread {step['pid']} (python")  # python or python3
                assert [e["args"]["name"] for e in events[1:-1] if e["name"] == "thread_name"] == [label]
                assert events[-1] == {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0, "dur": 0,
                                      "cat": "__metadata", "args": {"name": f"{view.removesuffix('.chrome')}: "
                                                                            "no events in this trace but the profiler step"}}
            else:
                assert "cpu_op" in cats, view
            if view == "gpu_only.chrome":  # of the host's annotations, only the profiler's step slice
                assert "cpu_op" not in cats
                assert [e["name"] for e in events if e.get("cat") == "user_annotation"] == [f"ProfilerStep#{row['step']}"]
            if view == "cpu_only.chrome":
                assert not cats & KERNEL_CATS
                names = {e.get("name") for e in events}
                assert "sftprof/forward/mb0" in names and "sftprof/optimizer_step" in names


def test_summaries_positive_and_reproducible(run):
    _, run_root = run
    for row in summary_rows(run_root):
        run_dir = Path(row["run_dir"])
        summary = json.loads((run_dir / "profile_summary.json").read_text())
        assert summary["status"] == "ok"
        stats = summary["stats"]
        assert stats["step_time_s"] > 0 and stats["tokens_per_s"] > 0
        assert (run_dir / "profile_summary.md").read_text().strip()
        before = (run_dir / "profile_summary.json").read_bytes()
        again = subprocess.run(
            [sys.executable, str(ROOT / "postprocess_profile.py"), "--log-dir", row["log_dir"], "--run-dir", str(run_dir),
             "--profile-kind", row["kind"], "--profile-step", row["step"], "--trainer-log", str(Path(row["log_dir"]) / "trainer.log")],
            capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        assert (run_dir / "profile_summary.json").read_bytes() == before


def test_cpu_summary_shows_findings_parts_and_the_heaviest_op(run):
    """The quick start shows the product (issue 32): a CPU kernel trial's summary has findings, the time-by-model-part
    table and plot from the CPU ops and the model-part ranges, calls out the heaviest op, and says which sections only
    a GPU run fills; its cpu_only view, byte for byte its chrome view, is a link to it, stored once."""
    from sftprof.analysis.report.trace import GPU_ONLY

    out, run_root = run
    for row in summary_rows(run_root):
        if row["kind"] != "kernel":
            continue
        run_dir = Path(row["run_dir"])
        s = json.loads((run_dir / "profile_summary.json").read_text())
        (t,) = s["kernel_traces"]
        k = t["summary"]
        parts = k["cpu_parts"]
        assert k["gpu"]["activities"] == 0 and k["parts"]["total_ms"] == 0.0 and parts["source"] == "module_regions"
        summed = {r["part"]: r for r in parts["summed"]}
        assert sum(r["total_ms"] for r in parts["summed"]) == pytest.approx(parts["total_ms"], abs=1e-3)
        assert sum(r["total_ms"] for layer in parts["layers"] for r in layer["rows"]) + sum(
            r["total_ms"] for r in parts["outside_layers"]) == pytest.approx(parts["total_ms"], abs=1e-3)
        assert [x["layer"] for x in parts["layers"]] == [0, 1]  # the tiny preset's two decoder layers
        # the ops cover most of the step (Python time between ops is in none of them), never more than the step
        assert 0.5 * k["step_window"]["wall_ms"] < parts["total_ms"] <= k["step_window"]["wall_ms"]
        heavy = k["heaviest_op"]  # the chunked log-probs Function, around the LM head's 151936-column logits
        assert (heavy["name"], heavy["calls"], heavy["backward"], heavy["part"]) == (
            "_VocabParallelLogprobs", 1, "_VocabParallelLogprobsBackward", "lm_head_loss")
        top = {o["name"]: o["inclusive_ms"] for o in k["top_cpu_ops"]}  # the one step the trace holds
        assert (heavy["inclusive_ms"], heavy["backward_ms"]) == (top["_VocabParallelLogprobs"],
                                                                 top["_VocabParallelLogprobsBackward"])
        assert heavy["inclusive_ms"] + heavy["backward_ms"] > max(top.values())
        assert max(summed.values(), key=lambda r: r["total_ms"])["part"] == "lm_head_loss"
        assert summed["lm_head_loss"]["forward_ms"] > 0 and summed["lm_head_loss"]["backward_ms"] > 0
        assert (run_dir / t["parts_plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and s["counts"]["plots"] == 1
        texts = [f["text"] for f in s["findings"]]
        assert any(x.startswith("rank 0: LM head + loss ") and " % of CPU op time (" in x for x in texts), texts
        assert any(x.startswith("rank 0: heaviest op _VocabParallelLogprobs in LM head + loss: ") for x in texts)
        # each finding names its next step; the LM head + loss (part and heaviest op) the README's chunked LM head
        # (no what-if on CPU: the finding says why, as the What if section does)
        skip = next(w for w in s["what_if_skipped"] if w["key"] == "chunked_lm_head")
        assert skip["reason"].startswith("a CPU run: its CPU op time gives no predicted effect for the chunked LM head")
        lm_head = ("try LM_HEAD_LOSS_CHUNK_SIZE=256: the LM head and the loss in chunks of 256 tokens, without the "
                   "full logits and their log-softmax; not a what-if: " + skip["reason"])
        steps = {f["key"]: f["next_step"] for f in s["findings"]}
        assert steps["part lm_head_loss"] == steps["heaviest op"] == lm_head, steps
        assert all(x.startswith(("try ", "none")) for x in steps.values()), steps
        md = (run_dir / "profile_summary.md").read_text()
        assert f"\n   - next step: {lm_head}\n" in md
        assert "## Findings" in md and "### Time by model part, rank 0" in md and GPU_ONLY in md
        assert "Heaviest op: **_VocabParallelLogprobs**" in md
        # chrome and cpu_only are the same bytes: cpu_only is a relative link, and the summary says so
        link = run_dir / "kernel_traces" / "cpu_only" / "rank0.pt.trace.json"
        assert os.readlink(link) == "../chrome/rank0.pt.trace.json" and t["view_links"] == {"cpu_only.chrome": "chrome"}
        assert "`kernel_traces/cpu_only/rank0.pt.trace.json` is a link to `kernel_traces/chrome/rank0.pt.trace.json`" in md
        # the end table's top finding is the heaviest model part's share, not a region's time
        table = out.stdout[out.stdout.index("trial          status"):out.stdout.index("wall time per trial")]
        (line,) = [x for x in table.splitlines() if x.startswith(f"kernel step {row['step']} ")]
        assert line.endswith(f"LM head + loss {summed['lm_head_loss']['share_pct']:.0f}% of CPU op time (rank 0)")


def test_cpu_ops_recorded_twice_or_a_second_step_leave_the_trials_figures_as_they_are(run, tmp_path):
    """Issue 35 on the tiny preset's real trace (kernel step 1): every CPU op recorded twice (a torch profiler fault:
    host times and call counts doubled), or a copy of the step appended as a longer ProfilerStep#2 (the longest step
    was the window): summarised as step 1, every figure is the trial's own; the fault is counted and named."""
    from fixtures.faults import before_step, duplicate, with_second_step
    from sftprof.analysis.summary import postprocess_trial

    _, run_root = run
    row = next(r for r in summary_rows(run_root) if (r["kind"], r["step"]) == ("kernel", "1"))
    own = json.loads((Path(row["run_dir"]) / "profile_summary.json").read_text())["kernel_traces"][0]
    src = Path(row["log_dir"])
    trace = json.loads((src / own["source"]).read_text())
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    doubled = json.loads(json.dumps(trace))
    duplicate(doubled, [e for e in doubled["traceEvents"] if e.get("cat") == "cpu_op"])
    for name, bad, count, warning in (
            ("doubled", doubled, (len(ops), own["summary"]["n_events"] + len(ops)),
             f"{len(ops)} events recorded twice (cpu_op {len(ops)}): the copies are left out of every figure (the "
             "views keep them)"),
            ("two_steps", with_second_step(trace, 2, longer_us=5e6), (len(ops) - before_step(trace), 2 * len(ops)),
             f"the trace holds more profiler steps than the one postprocessed (ProfilerStep#2 besides it): "
             f"{len(ops) - before_step(trace)} of {2 * len(ops)} GPU activities and CPU ops of those steps are left "
             "out of every figure, and the step window is the postprocessed step's own")):
        log = tmp_path / name / "log"
        (log / own["source"]).parent.mkdir(parents=True)
        for f in ("stats.jsonl", "config.yaml", "rank_coords.json"):
            shutil.copy(src / f, log / f)
        (log / own["source"]).write_text(json.dumps(bad))
        summary, code = postprocess_trial(str(log), str(tmp_path / name / "run"), "kernel", 1, jobs=1)
        got = json.loads(json.dumps(summary["kernel_traces"][0]["summary"]))
        kind = "duplicates" if name == "doubled" else "other_steps"
        assert code == 0 and (got["sanity"][kind]["count"], got["sanity"][kind]["of"]) == count, name
        skip = ("n_events", "invalid_events", "sanity", "view_repairs", "identity")
        assert {k: v for k, v in got.items() if k not in skip} == {
            k: v for k, v in own["summary"].items() if k not in skip}, name
        assert summary["warnings"] == [{"file": own["source"], "warning": warning}]
        assert all(f["caveats"] == [warning] for f in summary["findings"])


def test_memory_trial_on_cpu_says_snapshots_need_cuda(run):
    _, run_root = run
    for row in summary_rows(run_root):
        if row["kind"] == "memory":
            log = (Path(row["log_dir"]) / "trainer.log").read_text()
            assert "need CUDA" in log or "needs CUDA" in log
            summary = json.loads((Path(row["run_dir"]) / "profile_summary.json").read_text())
            assert summary["counts"]["snapshots"] == 0


def test_cpu_trials_propose_no_what_if(run):
    """One sequence and micro-batch a rank (batch 2 over 2 ranks): no fewer-micro-batches what-if; the other levers
    need GPU time, a snapshot or the megatron backend (balanced routing, where the routing collapsed, says so; the
    chunked LM head of a kernel trial's LM head + loss says CPU op time predicts nothing for it)."""
    _, run_root = run
    for row in summary_rows(run_root):
        s = json.loads((Path(row["run_dir"]) / "profile_summary.json").read_text())
        assert s["what_if"] == [] and s["transformer_engine"] is False and "tried_what_if" not in s
        assert all(w["reason"].endswith("the fsdp backend has none") if w["key"] == "balanced_routing" else
                   w["key"] == "chunked_lm_head" and row["kind"] == "kernel" for w in s["what_if_skipped"])


def _bench_step():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_step_row_of_a_real_trial(run, tmp_path):
    """``bench/step.py`` reads a kernel trial's row from its summary: step times as in ``stats.jsonl`` (max over
    ranks), no GPU figures on CPU; ratios and the table against a one-GPU row."""
    _, run_root = run
    bench = _bench_step()
    trial = next(r for r in summary_rows(run_root) if (r["kind"], r["step"]) == ("kernel", "1"))
    stats_file = next(run_root.parent.glob(f"fileroot/logs/*/*/{trial['trial']}/stats.jsonl"))
    steps = {r["step"]: r for r in map(json.loads, stats_file.read_text().splitlines()) if r["type"] == "step"}
    row = bench.run_root_row(run_root)  # the last-step kernel trial of the run root, layout from its config.yaml
    assert (row["layout"], row["world_size"], row["run_dir"]) == ("fsdp:d2", 2, str(run_root / trial["trial"]))
    assert row["step_s"] == max(r["step_time_s"] for r in steps[1]["ranks"])
    assert steps[0]["ranks"] and row["unprofiled_step_s"] is None  # the step before step 1 is the warm-up step 0
    assert (row["status"], row["ranks_traced"], row["trial"]) == ("ok", 1, trial["trial"])  # default: rank 0 traced
    assert [row[k] for k in ("attn_ms", "attn_fwd_tflops", "exposed_comm_ms", "exposed_wait_ms", "gpu_busy_pct", "peak_gib",
                             "mfu")] \
        == [None] * 7  # CPU: no kernels, no CUDA memory
    one = {"layout": "megatron:d1", "world_size": 1, "status": "ok", "step_s": 6.0, "attn_ms": 4000.0}
    two = {"layout": "megatron:(attn:c2|ffn:e2)", "world_size": 2, "status": "ok", "step_s": 4.5, "attn_ms": 2200.0,
           "exposed_comm_pct": 7.3}
    lines = bench.ratios([one, two], one)
    assert lines == [{"layout": two["layout"], "vs": "megatron:d1", "attn_ms": {"ratio": 0.55, "goal": 0.55},
                      "step_s": {"ratio": 0.75, "goal": 0.55}, "exposed_comm_pct": {"value": 7.3, "goal": 3.0}}]
    # with the exposed wait known, the share is split into transfer and waiting for another rank
    waited = dict(two, exposed_comm_ms=328.5, exposed_wait_ms=246.375)
    assert bench.ratios([one, waited], one)[0]["exposed_comm_pct"] == pytest.approx(
        {"value": 7.3, "goal": 3.0, "wait_pct": 7.3 * 0.75})
    assert bench.format_table([one, waited], bench.ratios([one, waited], one)).splitlines()[-1].endswith(
        "exposed comm 7.3 % of the step (goal <= 3.0 %): 1.8 % transfer, 5.5 % waiting for another rank")
    # this run's row against a one-GPU row of another model and length: no ratio, and the line says why
    other = dict(one, trial="qwen3_30b_a3b_fake128k_kernel_step2_20261130_133304")
    assert bench.format_table([other, row], bench.ratios([other, row], other)).splitlines()[-1] == (
        "fsdp:d2 vs megatron:d1: no ratios: another model or sequence length (tiny_qwen3_moe_fake512 vs "
        "qwen3_30b_a3b_fake128k)")
    text = bench.format_table([one, two], lines).splitlines()
    assert text[0].split()[:4] == ["layout", "gpus", "step", "s"]
    # a run root copied to another machine without its FILEROOT: run dirs found under it; this run's layout comes from
    # its preset, not from an actor.backend= argument in train_args.txt, so the row says so and takes the world size
    # from the completion record
    moved = tmp_path / "copied" / run_root.name
    shutil.copytree(run_root, moved)
    tsv = moved / "summary.tsv"  # as on the new machine: the recorded FILEROOT paths do not exist there
    tsv.write_text(tsv.read_text().replace(str(run_root.parent), "/nonexistent"))
    row2 = bench.run_root_row(moved)  # the trial's profile_summary.json still names a readable LOG_DIR
    assert (row2["layout"], row2["world_size"], row2["run_dir"]) == ("fsdp:d2", 2, str(moved / trial["trial"]))
    moved_summary = moved / trial["trial"] / "profile_summary.json"
    moved_summary.write_text(moved_summary.read_text().replace(str(run_root.parent), "/nonexistent"))
    row2 = bench.run_root_row(moved)
    assert (row2["layout"], row2["world_size"], row2["run_dir"]) == (
        f"unknown layout ({moved.name})", 2, str(moved / trial["trial"]))
    assert {k: row2[k] for k in ("step_s", "unprofiled_step_s", "status")} == {k: row[k] for k in ("step_s", "unprofiled_step_s", "status")}
    assert text[-1] == ("megatron:(attn:c2|ffn:e2) vs megatron:d1: attention per rank 0.550x (goal <= 0.55x); "
                        "step 0.750x (goal <= 0.55x); exposed comm 7.3 % of the step (goal <= 3.0 %)")


def test_bench_step_refuses_kinds_for_runs_and_an_existing_json(tmp_path):
    """``bench/step.py`` stops before reading anything: ``--kinds`` with only ``--runs`` (it would be ignored), and a
    ``--json`` file that exists (an earlier table or the ``--baseline``: never overwritten)."""
    baseline = tmp_path / "step_1gpu.json"
    baseline.write_text('{"rows": []}')
    cmd = [sys.executable, str(ROOT / "bench" / "step.py"), "--runs", str(tmp_path)]
    p = subprocess.run(cmd + ["--kinds", "kernel,memory"], capture_output=True, text=True)
    assert (p.returncode, p.stderr.splitlines()[-1]) == (2, "step.py: error: --kinds kernel,memory: applies to "
                                                            "--layouts run here; the rows of --runs come from their "
                                                            "kernel trials as they are")
    assert "[--kinds {kernel | kernel,memory}]" in p.stderr
    p = subprocess.run(cmd + ["--json", str(baseline), "--baseline", str(baseline)], capture_output=True, text=True)
    assert (p.returncode, p.stderr.splitlines()[-1]) == (2, f"step.py: error: --json {baseline}: exists (rows of an "
                                                            "earlier run, or a --baseline); never overwritten: name a "
                                                            "new file")
    assert baseline.read_text() == '{"rows": []}'


def test_bench_step_layout_spec_with_row_overrides(tmp_path):
    """``LAYOUT@key=value...`` gives one row's own overrides; a bad layout, an override that is not key=value, a
    repeated spec, or any row's driver run that the driver would refuse (a bad override value) stops
    ``bench/step.py`` (exit 2, naming the spec) before anything runs."""
    bench = _bench_step()
    assert bench.split_layout_spec("megatron:(attn:c2|ffn:e2)@actor.megatron.cp_comm_overlap=false@a.b=1") == (
        "megatron:(attn:c2|ffn:e2)", ["actor.megatron.cp_comm_overlap=false", "a.b=1"])
    assert bench.split_layout_spec("megatron:d1") == ("megatron:d1", [])
    # a row's own value of a key replaces the common one (--layers, arguments after --): the driver refuses a key
    # given twice with different values
    import argparse
    args = argparse.Namespace(kinds="kernel", config="c.yaml", seq=4096, steps=3, layers=4)
    _, call, _ = bench.driver_call("megatron:d1@actor.num_layers=2@a.b=3", args, ["a.b=1", "c.d=2"], tmp_path, "s")
    assert call[2:] == ["actor.backend=megatron:d1", "c.d=2", "actor.num_layers=2", "a.b=3"]
    _, call, _ = bench.driver_call("megatron:d1", args, ["a.b=1"], tmp_path, "s")
    assert call[2:] == ["actor.backend=megatron:d1", "actor.num_layers=4", "a.b=1"]
    cmd = [sys.executable, str(ROOT / "bench" / "step.py"), "--out-dir", str(tmp_path / "runs"), "--layouts"]
    p = subprocess.run(cmd + ["megatron:d1@cp_comm_overlap"], capture_output=True, text=True)
    assert (p.returncode, p.stderr.splitlines()[-1]) == (
        2, "step.py: error: --layouts 'megatron:d1@cp_comm_overlap': overrides after '@' must be key=value, got "
           "['cp_comm_overlap']")
    p = subprocess.run(cmd + ["megatron:d1", "megatron:d1"], capture_output=True, text=True)
    assert (p.returncode, p.stderr.splitlines()[-1]) == (
        2, "step.py: error: --layouts ['megatron:d1', 'megatron:d1']: a spec is repeated (rows are told apart by "
           "their spec)")
    p = subprocess.run(cmd + ["megatron:x9@a=1"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.splitlines()[-1].startswith("step.py: error: --layouts 'megatron:x9@a=1': ")
    # a bad override VALUE of the second row stops the bench before the first row runs (the driver's own check)
    p = subprocess.run(cmd + ["megatron:d1", "megatron:d1@actor.megatron.cp_comm_overlap=maybe"], capture_output=True,
                       text=True)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.splitlines()[-1].startswith(
        "step.py: error: --layouts 'megatron:d1@actor.megatron.cp_comm_overlap=maybe': actor.megatron.cp_comm_overlap: "
        "Value 'maybe' is not a valid bool (type str); accepted: true or false (also yes/no, on/off, 1/0)")
    assert not (tmp_path / "runs").exists()


def _postprocess(args: list[str], stdin: str | None) -> subprocess.CompletedProcess:
    """``postprocess_profile.py`` with ``args``; ``stdin``: the text on its standard input (None: closed at once)."""
    return subprocess.run([sys.executable, str(ROOT / "postprocess_profile.py"), *args], cwd=ROOT,
                          input=stdin if stdin is not None else "", capture_output=True, text=True, timeout=300)


def test_postprocessing_after_the_trial_imports_before_the_go(tmp_path):
    """What ``--after-trial`` imports while its trial trains is already imported when it reads the go (here the end
    of input, after which it imports nothing): matplotlib's pyplot on the Agg backend and every bundled model
    family's config class."""
    code = ("import sys, matplotlib, postprocess_profile as p; "
            f"rc = p.main(['--run-dir', {str(tmp_path / 'trial')!r}, '--after-trial', '0']); "
            "print(rc, 'matplotlib.pyplot' in sys.modules, matplotlib.get_backend().lower(), "
            "sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('transformers.models.') "
            "and '.configuration_' in m))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input="", capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == (
        "0 True agg ['configuration_auto', 'configuration_qwen3_5_moe', 'configuration_qwen3_moe']")
    assert not (tmp_path / "trial").exists()


def test_postprocessing_after_the_trial_survives_a_failed_preload(tmp_path):
    """A preload that fails (here matplotlib refuses ``MPLBACKEND=bogus``) is no error of its own: the process
    still waits for the go, and with the end of input exits 0 having printed and written nothing; a plain run meets
    the error only where it plots."""
    res = subprocess.run([sys.executable, str(ROOT / "postprocess_profile.py"), "--run-dir", str(tmp_path / "trial"),
                          "--after-trial", "0"], cwd=ROOT, input="", capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MPLBACKEND": "bogus"})
    assert (res.returncode, res.stdout, res.stderr, (tmp_path / "trial").exists()) == (0, "", "", False)


def test_postprocessing_after_the_trial_is_the_same_postprocessing(run, tmp_path):
    """``--after-trial`` on a trial of the run: with ``[]`` on standard input its summary is the one written without
    the option (nothing in it differs); with the input closed at once it exits 0 having printed and written nothing
    (not even the run dir); a line that is not a JSON list of strings is exit 2 naming the option."""
    _, run_root = run
    row = summary_rows(run_root)[2]  # kernel step 1 (rank 0 profiled: one trace)
    trial = ["--log-dir", row["log_dir"], "--profile-kind", row["kind"], "--profile-step", row["step"]]
    plain, waited = tmp_path / "plain" / "trial", tmp_path / "waited" / "trial"
    res = _postprocess(trial + ["--run-dir", str(plain)], None)
    assert res.returncode == 0, res.stderr
    res = _postprocess(trial + ["--run-dir", str(waited), "--after-trial", "0"], "[]\n")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[-1].startswith(f"[postprocess] wrote {waited / 'profile_summary.json'} (trial "
                                                  "status ok, ")
    summaries = [json.loads((d / "profile_summary.json").read_text()) for d in (plain, waited)]
    assert summaries[0]["paths"].pop("run_dir") == str(plain) and summaries[1]["paths"].pop("run_dir") == str(waited)
    assert summaries[0] == summaries[1] and summaries[0]["counts"]["traces_ok"] == 1
    dropped = tmp_path / "dropped" / "trial"
    res = _postprocess(trial + ["--run-dir", str(dropped), "--after-trial", "0"], None)
    assert (res.returncode, res.stdout, res.stderr, (tmp_path / "dropped").exists()) == (0, "", "", False)
    for line in ("nope\n", '["--profile-step", 1]\n', '{"a": 1}\n'):
        res = _postprocess(trial + ["--run-dir", str(dropped), "--after-trial", "0"], line)
        assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
            f"postprocess_profile.py: error: --after-trial 0: the line read, {line.strip()!r}, is not a JSON list of "
            "strings (further arguments)")
        assert not (tmp_path / "dropped").exists()
    res = _postprocess(trial + ["--run-dir", str(dropped), "--after-trial", "97"], None)  # not an open descriptor
    assert res.returncode == 2 and res.stderr.splitlines()[-1].startswith(
        "postprocess_profile.py: error: --after-trial 97: cannot read a line from that file descriptor ([Errno 9] ")
    res = _postprocess(["--run-dir", str(run_root), "--after-trial", "0"], "[]\n")
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == (
        f"postprocess_profile.py: error: --run-dir {run_root} is a RUN_ROOT (it holds trials.tsv), which takes no "
        "--after-trial: the driver waits with one trial's postprocessing only")
    assert not (tmp_path / "dropped").exists()
