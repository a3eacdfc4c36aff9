"""The wall-time phases of a trial (sftprof.analysis.trial.wall_time) from the trainer's and the launcher's clocks,
and the launcher's record of them (trial_times.json). A real run's phases are checked against its logs in
tests/test_e2e_cpu.py."""
import json

import pytest

from sftprof import artifacts
from sftprof.analysis.report.render import _wall_time as _wall_time_section
from sftprof.analysis.trial.inputs import read_stats
from sftprof.analysis.trial.wall_time import PHASES, wall_time
from sftprof.artifacts import TrialTimes
from sftprof.stats_log import CompletionRecord, ExitRecord, StatsWriter, StepRecord, TeardownRecord
from sftprof.launch.report import wall_table
from sftprof.launch.summaries import wall_phases


def _stats(tmp_path, steps, *ends, **completion):
    """stats.jsonl with step records ``(step, step_time_s, started_unix_s, profiler_s, profiled)``, a completion
    record and the records ``ends`` (a TeardownRecord, an ExitRecord), read as the summary reads it (profiled step
    2)."""
    w = StatsWriter(tmp_path / "stats.jsonl")
    for step, dt, started, inside, profiled in steps:
        w.write(StepRecord(step=step, loss=1.0, grad_norm=1.0, step_time_s=dt, tokens=8, tokens_per_s=8 / dt,
                           mem_allocated_gb=None, mem_reserved_gb=None, mem_peak_allocated_gb=None,
                           mem_peak_reserved_gb=None, ranks=None, tflops_per_gpu=None, mfu=None,
                           recompute_tflops_per_gpu=None, moe_load=None, profiled=profiled, started_unix_s=started,
                           profiler_s=inside))
    w.write(CompletionRecord(status="ok", **completion))
    w.close()
    for record in ends:  # appended after the writer of the steps closed the file, as the trainer does
        w = StatsWriter(tmp_path / "stats.jsonl", append=True)
        w.write(record)
        w.close()
    return read_stats(str(tmp_path / "stats.jsonl"), 2)


CLOCKS = {"trainer_started_unix_s": 1002.0, "imports_done_unix_s": 1006.5, "engine_build_started_unix_s": 1008.0,
          "ended_unix_s": 1060.0}


STEPS = [(0, 19.5, 1010.0, 0.25, False), (1, 4.5, 1030.0, 0.0, False), (2, 5.0, 1040.0, 3.0, True)]


def test_phases_follow_each_other_from_launch_to_exit(tmp_path):
    """Launched at 1000, torchrun ended at 1063: steps 0-2 (2 profiled, 3 s in its profiler) start at 1010, 1030
    and 1040, the completion record at 1060, the ranks' barrier passed at 1060.5, the process group torn down at
    1062.25, the atexit handlers done at 1062.5; each phase is the span between its boundaries, a step's less its
    profiler time; step 0 cost 15 s more than step 1 (the only unprofiled step after it)."""
    stats = _stats(tmp_path, STEPS, TeardownRecord(barrier_done_unix_s=1060.5, process_group_destroyed_unix_s=1062.25),
                   ExitRecord(atexit_done_unix_s=1062.5), **CLOCKS)
    assert stats["teardown"] == {"type": "teardown", "barrier_done_unix_s": 1060.5,
                                 "process_group_destroyed_unix_s": 1062.25} and stats["bad_lines"] == 0
    assert stats["exit"] == {"type": "exit", "atexit_done_unix_s": 1062.5}
    wall = wall_time(stats, TrialTimes(launched_unix_s=1000.0, torchrun_ended_unix_s=1063.0))
    assert wall == {"phases": [{"phase": p, "seconds": s} for p, s in zip(PHASES, [
        2.0, 4.5, 1.5, 2.0, 19.75, 10.0, 17.0, 3.25, 2.25, 0.25, 0.5])], "elapsed_s": 63.0,
        "cold_start": {"step0_s": 19.5, "warm_step_s": 4.5, "warm_steps": [1], "reference_profiled": False,
                       "cold_start_s": 15.0}, "barrier_s": 0.5}
    assert sum(p["seconds"] for p in wall["phases"]) == wall["elapsed_s"]
    md = "\n".join(_wall_time_section({"wall_time": wall}))
    assert "| teardown | 2.250 |" in md and "| atexit | 0.250 |" in md and "| exit | 0.500 |" in md
    assert ("- teardown: 0.500 s to the ranks' barrier passed (rank 0 waiting for the slowest rank), 1.750 s tearing "
            "the process groups down") in md


def test_teardown_of_a_failed_trial_and_a_log_without_the_record(tmp_path):
    """A failed trial (no barrier: barrier_done_unix_s None): ``teardown`` still runs to the process group torn down,
    ``barrier_s`` is None and the Markdown says nothing of a barrier; a log of an earlier release (no teardown
    record): ``teardown`` None and ``exit`` from the completion record to torchrun's end, as before the split."""
    times = TrialTimes(launched_unix_s=1000.0, torchrun_ended_unix_s=1063.0)
    failed = wall_time(_stats(tmp_path, STEPS, TeardownRecord(process_group_destroyed_unix_s=1061.0),
                              ExitRecord(atexit_done_unix_s=1061.5), **CLOCKS), times)
    assert [p["seconds"] for p in failed["phases"]][-3:] == [1.0, 0.5, 1.5] and failed["barrier_s"] is None
    assert "ranks' barrier passed" not in "\n".join(_wall_time_section({"wall_time": failed}))
    old = wall_time(_stats(tmp_path, STEPS, **CLOCKS), times)
    assert [p["seconds"] for p in old["phases"]] == [2.0, 4.5, 1.5, 2.0, 19.75, 10.0, 17.0, 3.25, None, None, 3.0]
    assert old["barrier_s"] is None and sum(p["seconds"] or 0.0 for p in old["phases"]) == old["elapsed_s"]


def test_exit_record_splits_atexit_off_exit_and_the_end_table_keeps_their_sum(tmp_path):
    """The same trial with and without the exit record (a log of an earlier release): with it, ``atexit`` runs from
    the teardown record (1062.25) to the atexit handlers done (1062.5) and ``exit`` on to torchrun's end (1063.6);
    without it, ``atexit`` is None ("–" in the Markdown) and ``exit`` runs from the teardown record, as before. An
    exit record without a teardown record is not used (``exit`` from the completion record). The end table keeps its
    columns: its exit column is the sum either way (1.35 s)."""
    times = TrialTimes(launched_unix_s=1000.0, torchrun_ended_unix_s=1063.6)
    teardown, exit_record = TeardownRecord(barrier_done_unix_s=1060.5, process_group_destroyed_unix_s=1062.25), \
        ExitRecord(atexit_done_unix_s=1062.5)
    split = wall_time(_stats(tmp_path, STEPS, teardown, exit_record, **CLOCKS), times)
    before = wall_time(_stats(tmp_path, STEPS, teardown, **CLOCKS), times)
    alone = wall_time(_stats(tmp_path, STEPS, exit_record, **CLOCKS), times)
    assert [{p["phase"]: p["seconds"] for p in w["phases"] if p["phase"] in ("teardown", "atexit", "exit")}
            for w in (split, before, alone)] == [{"teardown": 2.25, "atexit": 0.25, "exit": 1.1},
                                                 {"teardown": 2.25, "atexit": None, "exit": 1.35},
                                                 {"teardown": None, "atexit": None, "exit": 3.6}]
    assert "| atexit | – |" in "\n".join(_wall_time_section({"wall_time": before}))
    lines = wall_table([("new", tmp_path, {"wall_time": split}), ("old", tmp_path, {"wall_time": before})])
    assert lines[2].split()[-4:] == ["teardown", "exit", "train", "postproc"]
    assert lines[3].split()[-4:] == lines[4].split()[-4:] == ["2.2", "1.4", "63.6", "-"]


def test_boundaries_not_recorded_leave_their_phases_unknown(tmp_path):
    """No launcher record (a postprocess of a trial not run by the driver): start-up and exit unknown, elapsed
    unknown; a trial that failed in its engine build (no step record): the build runs to the completion record, the
    steps are 0; a log of an earlier release (no clocks at all): every phase that needs one is unknown."""
    stats = _stats(tmp_path, [], **CLOCKS)
    wall = wall_time(stats, None)
    assert [p["seconds"] for p in wall["phases"]] == [None, 4.5, 1.5, 52.0, 0.0, 0.0, 0.0, 0.0, None, None, None]
    assert wall["elapsed_s"] is None and wall["cold_start"] is None
    old = _stats(tmp_path, [(0, 2.0, None, None, True)])
    wall = wall_time(old, TrialTimes(launched_unix_s=1000.0, torchrun_ended_unix_s=1010.0))
    assert [p["seconds"] for p in wall["phases"]] == [None, None, None, None, 0.0, 0.0, None, None, None, None,
                                                      None]
    assert wall["elapsed_s"] == 10.0


def test_cold_start_reference_is_a_profiled_step_when_no_other_ran(tmp_path):
    """A kernel trial of step 1 (TOTAL_STEPS=2): step 0 is compared with the profiled step 1, and that is said."""
    stats = _stats(tmp_path, [(0, 9.0, 1010.0, 0.5, False), (1, 3.0, 1020.0, 1.0, True)], **CLOCKS)
    assert wall_time(stats, None)["cold_start"] == {"step0_s": 9.0, "warm_step_s": 3.0, "warm_steps": [1],
                                                    "reference_profiled": True, "cold_start_s": 6.0}


def test_a_negative_cold_start_is_not_measurable_with_why(tmp_path):
    """The CPU quick start's kernel trial of step 1: step 0 (12.0 s) faster than the profiled step 1 (14.9 s), whose
    profiler cost exceeds step 0's one-time cost: the summary and the end table say "not measurable", never -2.9 s;
    against unprofiled warm steps, their spread is named."""
    stats = _stats(tmp_path, [(0, 12.0, 1010.0, 0.0, False), (1, 14.9, 1022.0, 0.1, True)], **CLOCKS)
    cold = wall_time(stats, None)["cold_start"]
    assert cold == {"step0_s": 12.0, "warm_step_s": 14.9, "warm_steps": [1], "reference_profiled": True,
                    "cold_start_s": -2.9, "not_measurable": "step 0 was 2.900 s faster than the reference, a "
                    "profiled step whose profiler cost exceeds step 0's one-time cost (an unprofiled step after 0, "
                    "TOTAL_STEPS past the profiled step, measures it)"}
    summary = {"wall_time": {"phases": [], "elapsed_s": None, "cold_start": cold}}
    md = "\n".join(_wall_time_section(summary))
    assert ("- cold start: not measurable: step 0 took 12.000 s against 14.900 s for a warm step (median of step(s) "
            "1): step 0 was 2.900 s faster than the reference, a profiled step") in md and "-2.9" not in md
    assert wall_phases(summary)[2] == "not measurable (step 0 faster than its profiled reference: see its summary)"
    warm = _stats(tmp_path, [(0, 5.0, 1010.0, 0.0, False), (1, 5.5, 1015.0, 0.0, False), (2, 5.2, 1021.0, 0.0, False),
                             (3, 6.0, 1026.0, 0.1, True)], **CLOCKS)
    cold = wall_time(warm, None)["cold_start"]
    assert (cold["warm_steps"], cold["cold_start_s"], cold["not_measurable"]) == (
        [1, 2], -0.35, "step 0 was 0.350 s faster than the reference, whose steps vary by more than step 0's "
                       "one-time cost")
    assert wall_phases({"wall_time": {"cold_start": cold}})[2] == ("not measurable (step 0 faster than its reference: "
                                                                    "see its summary)")
    positive = {"wall_time": {"cold_start": {"step0_s": 5.7, "warm_step_s": 5.0, "cold_start_s": 0.7}}}
    assert wall_phases(positive)[2] == "0.7 s"
    # a difference inside the reference steps' spread (the reviewer's CPU run: 22.278 s against 21.785-22.529 s)
    noisy = _stats(tmp_path, [(0, 22.278, 1000.0, 0.0, False), (1, 22.529, 1023.0, 0.0, False),
                              (2, 22.281, 1046.0, 0.3, True), (3, 21.785, 1069.0, 0.0, False),
                              (4, 22.264, 1091.0, 0.0, False)], **CLOCKS)
    cold = wall_time(noisy, None)["cold_start"]
    assert (cold["warm_steps"], cold["cold_start_s"], cold["not_measurable"]) == (
        [1, 3, 4], 0.014, "step 0 was 0.014 s slower than the reference, less than its steps' spread (0.744 s)")
    assert wall_phases({"wall_time": {"cold_start": cold}})[2] == ("not measurable (within its reference steps' "
                                                                    "spread: see its summary)")
    md = "\n".join(_wall_time_section({"wall_time": {"phases": [], "elapsed_s": None, "cold_start": cold}}))
    assert "- cold start: not measurable: step 0 took 22.278 s against 22.264 s for a warm step (median of step(s) " \
           "1, 3, 4): step 0 was 0.014 s slower" in md


def test_trial_times_record_round_trips_and_a_damaged_one_is_refused(tmp_path):
    times = TrialTimes(launched_unix_s=1.5, torchrun_ended_unix_s=9.0, postprocess_started_unix_s=9.5,
                       postprocess_ended_unix_s=12.0, postprocess_background=True)
    assert artifacts.read_trial_times(tmp_path) is None
    artifacts.write_trial_times(tmp_path, times)
    assert artifacts.read_trial_times(tmp_path) == times
    assert [p.name for p in tmp_path.iterdir()] == ["trial_times.json"]
    (tmp_path / "trial_times.json").write_text(json.dumps({"launched_unix_s": "soon"}))
    with pytest.raises(ValueError, match=r"trial_times.json: launched_unix_s 'soon' is not a time"):
        artifacts.read_trial_times(tmp_path)
    (tmp_path / "trial_times.json").write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        artifacts.read_trial_times(tmp_path)
