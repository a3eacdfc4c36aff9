"""The entry points as a shell runs them: compare's default report name for a relative RUN_A, and a quiet exit when
the reader of their output goes away (``... | head -3``), for every entry point and the trainer's log lines."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import two_gpu_sync_log_dir, two_gpu_sync_traces
from sftprof.analysis.trace.check import main as trace_check_main
from sftprof.cli import BROKEN_PIPE_STATUS, INTERRUPT_STATUS, run_main

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout's sftprof, whatever the editable install points at


def _run(args, cwd=REPO):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=ENV, capture_output=True, text=True)


def _reader_gone(args, cwd=REPO) -> tuple[int, str]:
    """Run ``args`` with standard output a pipe whose reader closed it before the first write (what ``| head``
    does once it has its lines, made deterministic): ``(exit status, standard error)``."""
    p = subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    p.stderr.close()
    return p.wait(), err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two run dirs, RUN_A and RUN_B, of the 2-GPU H200 excerpt, postprocessed by the CLI."""
    root = tmp_path_factory.mktemp("runs")
    log = two_gpu_sync_log_dir(root)
    for name in ("RUN_A", "RUN_B"):
        res = _run([REPO / "postprocess_profile.py", "--log-dir", log, "--run-dir", root / name])
        assert res.returncode == 0, res.stderr
    return root / "RUN_A", root / "RUN_B"


def test_compare_names_the_report_after_run_a_also_when_it_is_given_as_dot(runs):
    run_a, run_b = runs
    res = _run([REPO / "postprocess_profile.py", "compare", ".", "../RUN_B"], cwd=run_a)
    assert res.returncode == 0, res.stderr
    assert res.stderr == "[postprocess] wrote ../RUN_B/compare_vs_RUN_A.md\n"  # was ../RUN_B/compare_vs_..md
    assert sorted(p.name for p in run_b.glob("compare_vs_*")) == ["compare_vs_RUN_A.md"]
    assert (run_b / "compare_vs_RUN_A.md").read_text() + "\n" == res.stdout  # print() adds a newline
    assert res.stdout.startswith(f"# Profile comparison\n\n- A: `{run_a}`\n")
    assert "## kernel step 2: `RUN_A` (A) vs `RUN_B` (B)" in res.stdout.splitlines()  # was `.` (A)
    # the same run named with a trailing slash, from inside RUN_B: the same report, left as it is
    res = _run([REPO / "postprocess_profile.py", "compare", "../RUN_A/", "."], cwd=run_b)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ("[postprocess] ./compare_vs_RUN_A.md unchanged (it already holds this report: same inputs), "
                          "left as it is\n")


@pytest.mark.parametrize("cmd, usual", [
    (["postprocess_profile.py", "compare", "RUN_A", "RUN_B", "--out", "c.md"], 0),
    (["profile_rank_utils.py", "--config", "tiny_cpu", "--profile-ranks", ""], 0),
    (["-m", "sftprof.launch", "usage"], 0),
    (["-m", "sftprof.analysis.trace.check", two_gpu_sync_traces()[0]], 1),  # the excerpt's cut flows: problems
], ids=["compare", "profile_rank_utils", "launch_usage", "trace_check"])
def test_a_reader_that_goes_away_ends_the_command_quietly(runs, tmp_path, cmd, usual):
    root = runs[0].parent
    args = [REPO / cmd[0] if cmd[0].endswith(".py") else cmd[0]] + [
        str(root / a) if a in ("RUN_A", "RUN_B") else tmp_path / a if a == "c.md" else a for a in cmd[1:]]
    rc, err = _reader_gone(args)
    # was: exit 1 and "Traceback ... BrokenPipeError: [Errno 32] Broken pipe"
    assert (rc, err) == (BROKEN_PIPE_STATUS, f"[postprocess] wrote {tmp_path / 'c.md'}\n" if "c.md" in cmd else "")
    full = _run([a if a != tmp_path / "c.md" else tmp_path / "full.md" for a in args])
    assert full.returncode == usual and full.stdout  # with a reader: the usual status and output
    if "c.md" in cmd:  # the report was written in full before the pipe broke
        assert (tmp_path / "c.md").read_text() + "\n" == full.stdout


def test_ctrl_c_of_a_command_with_stop_signals_is_one_line_not_a_traceback(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["postprocess_profile.py"])
    with pytest.raises(SystemExit) as ended:
        run_main(interrupted, stop_signals=True)
    assert ended.value.code == INTERRUPT_STATUS == 130
    assert capsys.readouterr().err == (
        "postprocess_profile.py: interrupted (Ctrl-C); the files written before it are kept\n")
    with pytest.raises(KeyboardInterrupt):  # without stop_signals: as before
        run_main(interrupted)


def test_run_main_exits_with_mains_status():
    for ret, code in ((0, 0), (1, 1), (2, 2), (None, None)):
        with pytest.raises(SystemExit) as exc:
            run_main(lambda: ret)
        assert exc.value.code == code


def test_trainer_log_lines_to_a_closed_pipe_are_dropped_quietly(tmp_path):
    """The trainer logs to standard output (and rank 0 to trainer.log): once the pipe's reader is gone its records
    are dropped without a "--- Logging error ---" traceback each, and the process goes on; trainer.log has them all."""
    script = ("import logging, sys\n"
              "from pathlib import Path\n"
              "from sftprof.trainer import _setup_logging\n"
              f"_setup_logging(0, Path({str(tmp_path)!r}))\n"
              "for i in range(2000):\n"
              "    logging.getLogger('sftprof').info('step %d', i)\n"
              "print('went on', file=sys.stderr)\n")
    rc, err = _reader_gone(["-c", script])
    assert (rc, err) == (0, "went on\n")  # was: 2000 "--- Logging error ---" tracebacks
    lines = (tmp_path / "trainer.log").read_text().splitlines()
    assert len(lines) == 2000 and lines[-1].endswith("[rank 0] INFO step 1999")


def test_trace_check_needs_a_file_and_says_its_exit_statuses(tmp_path, capsys):
    """``python -m sftprof.analysis.trace.check`` with no file (an empty glob in CI) is a usage error, not a pass, and
    ``--help`` is help, not a file name; with files, its status is 1 when any has a problem or cannot be read."""
    usage = "usage: python -m sftprof.analysis.trace.check [-h] TRACE [TRACE ...]\n"
    res = _run(["-m", "sftprof.analysis.trace.check"])  # was: exit 0, nothing printed
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == usage + ("python -m sftprof.analysis.trace.check: error: the following arguments are "
                                  "required: TRACE\n")
    res = _run(["-m", "sftprof.analysis.trace.check", "--help"])  # was: "--help: cannot be read", exit 1
    assert (res.returncode, res.stderr) == (0, "") and res.stdout.startswith(usage)
    assert " ".join(res.stdout.split()).endswith("exit status: 0 every file is valid, 1 a file has a problem or cannot "
                                                 "be read, 2 bad arguments")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text('{"traceEvents": []}')
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": -1, "pid": 1, "tid": 1}]}')
    assert trace_check_main([str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok\n"
    assert trace_check_main([str(good), str(bad), str(tmp_path / "none.json")]) == 1
    assert capsys.readouterr().out == (
        f"{good}: ok\n{bad}: 1 problems\n  event 0: negative dur: {{'ph': 'X', 'name': 'a', 'ts': 1, 'dur': -1, "
        f"'pid': 1, 'tid': 1}}\n{tmp_path / 'none.json'}: 1 problems\n"
        f"  {tmp_path / 'none.json'}: cannot be read: No such file or directory\n")
