"""sftprof.artifacts: names round-trip through their parsers."""
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


def test_trials_tsv_is_read_with_its_header_or_without_one(tmp_path):
    """The driver writes TRIALS_HEADER first; a trials.tsv of an earlier release has no header and reads alike."""
    row = f"t0\tkernel\t1\t{tmp_path / 't0'}\t{tmp_path / 'log'}\t{tmp_path / 't0' / 'train_args.txt'}\n"
    expect = [("t0", "kernel", 1, str(tmp_path / "t0"), str(tmp_path / "log"))]
    (tmp_path / a.TRIALS_TSV).write_text("trial\tkind\tstep\trun_dir\tlog_dir\targs_file\n" + row)
    assert a.read_trials_tsv(str(tmp_path)) == expect
    (tmp_path / a.TRIALS_TSV).write_text(row)
    assert a.read_trials_tsv(str(tmp_path)) == expect
    (tmp_path / a.TRIALS_TSV).write_text(row + "trial\tkind\tstep\trun_dir\tlog_dir\targs_file\n")
    with pytest.raises(ValueError) as err:  # the header is the first line or no trial's row
        a.read_trials_tsv(str(tmp_path))
    assert str(err.value) == (f"{tmp_path / a.TRIALS_TSV} line 2: not a row of the driver's plan (name, kind, step, "
                              "run dir, log dir, arguments file; tab-separated)")


def test_trials_tsv_refuses_an_unknown_kind_and_a_step_of_other_digits_and_ends_at_blank_lines(tmp_path):
    """A kind postprocessing does not know (was: an argparse usage dump for that trial), a step of non-ASCII digits
    (was: ``invalid literal for int()``) are the row's error; blank lines at the end (``echo >> trials.tsv``) are no
    row (was: the run root refused), a blank line before a row still is one."""
    tsv = tmp_path / a.TRIALS_TSV

    def row(name, kind="kernel", step="1"):
        return f"{name}\t{kind}\t{step}\t{tmp_path / name}\t{tmp_path / 'log'}\t{tmp_path / name / 'args'}\n"

    def error(text):
        tsv.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError) as err:
            a.read_trials_tsv(str(tmp_path))
        return str(err.value)

    assert a.PROFILE_KINDS == ("kernel", "memory")
    assert error(row("t0") + row("t1", kind="banana")) == (
        f"{tsv} line 2: kind 'banana' is not a profile kind of the driver's plan (one of kernel, memory)")
    not_a_row = "not a row of the driver's plan (name, kind, step, run dir, log dir, arguments file; tab-separated)"
    assert error(row("t0", step="\u00b2")) == f"{tsv} line 1: {not_a_row}"
    assert error(row("t0", step="\u0663")) == f"{tsv} line 1: {not_a_row}"  # ARABIC-INDIC DIGIT THREE
    assert error(row("t0") + "\n" + row("t1", kind="memory")) == f"{tsv} line 2: {not_a_row}"
    expect = [("t0", "kernel", 1, str(tmp_path / "t0"), str(tmp_path / "log")),
              ("t1", "memory", 12, str(tmp_path / "t1"), str(tmp_path / "log"))]
    tsv.write_text("\t".join(a.TRIALS_HEADER) + "\n" + row("t0") + row("t1", kind="memory", step="12") + "\n \t\n\n")
    assert a.read_trials_tsv(str(tmp_path)) == expect
    tsv.write_text("\n")
    assert a.read_trials_tsv(str(tmp_path)) == []
