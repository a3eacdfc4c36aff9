"""The entry points as a shell runs them: compare's default report name for a relative RUN_A."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import two_gpu_sync_log_dir

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout's sftprof, whatever the editable install points at


def _run(args, cwd=REPO):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=ENV, capture_output=True, text=True)


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
