"""A simulated rank end to end on the tiny CPU preset: rank 5 of ``fsdp:d8`` alone in one process (torch's fake
process group), through the real driver, its kernel trial postprocessed; the summary says it is simulated on its
first line and holds the projection of its step."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from sftprof import launch
from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.trial.failure import first_failure
from sftprof.analysis.time.projection import main as projection_main
from sftprof.analysis.time.rank_plan import rank_plan
from sftprof.models.hf import load_hf_config

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("sim")
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "CONFIG")}
    env.update(CONFIG="tiny_cpu", FILEROOT=str(base / "fileroot"), RUN_ROOT=str(base / "run"), PROFILE_STEPS="1",
               PROFILE_KINDS="kernel", PROFILE_STAMP="sim", PROFILE_FAKE_SEQ_LEN="256", OMP_NUM_THREADS="1",
               SIMULATE_RANK="5")
    out = subprocess.run(["bash", str(ROOT / "run_qwen3_30b_a3b_sft_profile.sh"), "actor.backend=fsdp:d8",
                          "train_dataset.batch_size=8"], env=env, capture_output=True, text=True, timeout=900)
    return out, base / "run"


def test_simulated_rank_runs_alone_and_says_so(run):
    out, run_root = run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("sftprof: plan: 1 trial(s) on rank 5 of 8 simulated in one process (fsdp:d8, CPU (no CUDA)): "
            "kernel step 1") in out.stderr
    (run_dir,) = [p for p in run_root.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "profile_summary.json").read_text())
    log_dir = Path(summary["paths"]["log_dir"])
    assert sorted(p.name for p in (log_dir / "perf_tracer").iterdir()) == ["rank5.pt.trace.json"]
    coords = json.loads((log_dir / "rank_coords.json").read_text())
    assert coords["simulated_rank"] == 5 and coords["world_size"] == 8
    cfg = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert cfg["perf_tracer"]["ranks"] == "5" and cfg["actor"]["simulate"] == {"rank": 5, "gpus_per_node": 8}
    steps = [json.loads(line) for line in (log_dir / "stats.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in steps[1]["ranks"]] == [5]
    # The loss: this rank's sum over the global loss tokens; its one sequence of the 8 is 1/8 of a loss near ln(V).
    assert 0.9 < steps[1]["loss"] * 8 / 11.93 < 1.1
    assert steps[1]["grad_norm"] is not None and steps[1]["grad_norm"] > 0  # None: not finite
    sim = summary["simulation"]
    assert (sim["rank"], sim["world_size"], sim["projection_error"]) == (5, 8, None)
    md = (run_dir / "profile_summary.md").read_text().splitlines()
    assert md[0].startswith(f"# Profile summary: {run_dir.name} — SIMULATED rank 5 of 8, alone on one device; "
                            "not run: collectives: torch's fake process group")
    assert "## Projected step (simulated rank)" in md
    # fsdp has no balanced routing: the first line says so, and the steps show how far the routing collapsed
    assert sim["assumed"].startswith("NOT balanced routing: FSDP2's all-gather hands back this rank's parameter shard")
    assert "assumed: NOT balanced routing" in md[0]
    p = sim["projection"]
    assert p["compute_ms"] == pytest.approx(1e3 * steps[1]["step_time_s"])
    plan = rank_plan(cfg, load_hf_config("tiny_qwen3_moe", 0), parse_allocation_mode("fsdp:d8"), 5)
    assert [(r["group"], r["collective"], r["calls"]) for r in p["rows"]] == [
        (c["group"], c["collective"], c["calls"]) for c in plan["collectives"]] == [
        ("dp", "all_gather", 2), ("dp", "reduce_scatter", 1)]
    assert p["projected_step_ms"] == pytest.approx(p["compute_ms"] + sum(r["exposed_ms"] for r in p["rows"]))
    regions = {r["name"]: r["cpu_ms"] for r in summary["kernel_traces"][0]["summary"]["regions"]}
    windows = [a for a in p["assumptions"] if a.startswith("overlapped collectives hide")]
    assert windows == [f"overlapped collectives hide behind their window's measured compute: forward "
                       f"{regions['sftprof/forward/mb0']:.1f} ms, backward {regions['sftprof/backward/mb0']:.1f} ms, "
                       "cp_attention not measured (0 ms hidden)"]


def test_projection_cli(run, tmp_path, capsys):
    _, run_root = run
    (run_dir,) = [p for p in run_root.iterdir() if p.is_dir()]
    log_dir = json.loads((run_dir / "profile_summary.json").read_text())["paths"]["log_dir"]
    assert projection_main([log_dir, "--step", "1", "--json", str(tmp_path / "p.json")]) == 0
    assert capsys.readouterr().out.startswith("projection of rank 5 of 8 (simulated: compute measured")
    assert json.loads((tmp_path / "p.json").read_text())["rank"] == 5
    assert projection_main([log_dir, "--step", "7"]) == 2
    assert "holds no record of step 7" in capsys.readouterr().err


def _plan_env(tmp_path, **extra) -> dict:
    return {"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fr"), "RUN_ROOT": str(tmp_path / "run"),
            "PROFILE_STAMP": "p", "PROFILE_STEPS": "1", **extra}


def test_plan_launches_one_process(tmp_path):
    _, settings, info = launch.plan(_plan_env(tmp_path, SIMULATE_RANK="5"), ["actor.backend=fsdp:d8",
                                                                             "train_dataset.batch_size=8"], gpus=0)
    assert (info.nproc_per_node, info.nnodes) == (1, 1)
    assert any(n.startswith("simulated rank 5 of fsdp:d8 (dp=8") for n in info.notices)
    assert "N_GPUS_PER_NODE=1\t# one simulated rank" in settings
    # bench/step.py gives N_GPUS_PER_NODE = the layout's world size: accepted, still one process
    _, _, info = launch.plan(_plan_env(tmp_path, SIMULATE_RANK="5", N_GPUS_PER_NODE="8", RUN_ROOT=str(tmp_path / "r2")),
                             ["actor.backend=fsdp:d8", "train_dataset.batch_size=8"], gpus=1)
    assert info.nproc_per_node == 1


def test_plan_refuses_bad_simulated_ranks(tmp_path):
    args = ["actor.backend=fsdp:d8", "train_dataset.batch_size=8"]
    with pytest.raises(launch.DriverError, match=r"SIMULATE_RANK=5: a simulated rank is one process on one node, but "
                                                 r"N_NODES=2 x N_GPUS_PER_NODE=4"):
        launch.plan(_plan_env(tmp_path, SIMULATE_RANK="5", N_NODES="2", NODE_RANK="0"), args, gpus=0)
    with pytest.raises(launch.DriverError, match=r"actor.simulate.rank=8: must be -1 \(off\) or a rank in \[0, 8\)"):
        launch.plan(_plan_env(tmp_path, SIMULATE_RANK="8"), args, gpus=0)
    with pytest.raises(launch.DriverError, match=r"SIMULATE_RANK='-2': must be an integer >= -1"):
        launch.plan(_plan_env(tmp_path, SIMULATE_RANK="-2"), args, gpus=0)


def test_failure_names_the_simulated_rank(tmp_path):
    """torchrun calls a simulated trial's one process rank 0; the Failure names the rank it simulated, with its log
    lines and the error it logged."""
    report = (FIXTURES / "torchrun_sigkill_launcher.log").read_text().splitlines()
    start = report.index("Failures:")
    text = "\n".join([
        "2026-12-06 05:00:00,000 [rank 5] INFO simulated rank 5 of 8 (fsdp:d8): collectives not run",
        "2026-12-06 05:00:01,000 [rank 5] ERROR trial failed after 0 completed step(s): RuntimeError: boom",
        *report[start - 4:start], "Failures:", "  <NO_OTHER_FAILURES>",
        "------------------------------------------------------", "Root Cause (first observed failure):", "[0]:",
        "  time      : 2026-12-06_05:00:02", "  host      : localhost", "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 42)", "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "======================================================"]) + "\n"
    (tmp_path / "launcher.log").write_text(text)
    fail = first_failure(str(tmp_path / "launcher.log"), simulated_rank=5)
    assert (fail["rank"], fail["how"], fail["traceback"]) == (5, "exit code 1", "RuntimeError: boom")
    assert fail["log_tail"][-1].endswith("[rank 5] ERROR trial failed after 0 completed step(s): RuntimeError: boom")
    assert first_failure(str(tmp_path / "launcher.log"))["rank"] == 0  # read as a trial of every rank
