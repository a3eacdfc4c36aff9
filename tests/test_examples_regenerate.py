"""CPU: ``docs/examples/regenerate.sh`` checks its parts before running any (names, and the shipped run that three
parts are compared with), and ``keep`` copies summaries and plots
without losing an example whose run left no summary. Runs on a copy of the script (``keep`` writes beside it)."""
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _copy(tmp_path: Path) -> Path:
    out = tmp_path / "repo" / "docs" / "examples"
    out.mkdir(parents=True)
    shutil.copy(REPO / "docs" / "examples" / "regenerate.sh", out)
    (out / "qwen3_30b_a3b_local" / "kernel").mkdir(parents=True)
    (out / "qwen3_30b_a3b_local" / "kernel" / "profile_summary.md").write_text("earlier example\n")
    return out


def _run(out: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(out / "regenerate.sh"), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_an_unknown_part_stops_before_any_part_runs(tmp_path):
    out = _copy(tmp_path)
    work = tmp_path / "work"
    trial = work / "qwen3_5_35b_a3b" / "qwen3_5_35b_a3b_fake32k_kernel_step2_x"
    trial.mkdir(parents=True)
    (trial / "profile_summary.md").write_text("new\n")
    proc = _run(out, work, "keep", "bogus")
    assert proc.returncode == 2
    assert proc.stderr == ("regenerate.sh: unknown part bogus; accepted: qwen3_30b_a3b lm_head_2048 fp32_optimizer local qwen3_5 "
                           "qwen3_5_local keep\n")
    assert not (out / "qwen3_5_35b_a3b").exists()  # keep did not run


def test_a_part_compared_with_the_shipped_run_needs_that_run_first(tmp_path):
    out = _copy(tmp_path)
    work = tmp_path / "work dir"
    (work / "qwen3_30b_a3b" / "failed_trial").mkdir(parents=True)  # a run without a trial summary is no base
    for part in ("lm_head_2048", "fp32_optimizer", "local"):
        proc = _run(out, work, "qwen3_5", part)  # qwen3_5 would run first: nothing may start
        assert proc.returncode == 2
        assert proc.stderr == (f"regenerate.sh: part {part} is compared with the shipped run {work}/qwen3_30b_a3b, which "
                               f"holds no trial summary; run part qwen3_30b_a3b first (regenerate.sh '{work}' "
                               f"qwen3_30b_a3b {part})\n")
    assert sorted(p.name for p in work.iterdir()) == ["qwen3_30b_a3b"]


def test_the_shipped_run_first_or_already_there_lets_the_compared_parts_run(tmp_path):
    """With stand-ins for the driver and postprocess_profile.py that log their arguments."""
    out = _copy(tmp_path)
    repo = out.parents[1]
    log = tmp_path / "calls.log"
    (repo / "run_qwen3_30b_a3b_sft_profile.sh").write_text(
        f'mkdir -p "$RUN_ROOT/trial" && touch "$RUN_ROOT/trial/profile_summary.md"\necho "driver $RUN_ROOT" >> "{log}"\n')
    (repo / "postprocess_profile.py").write_text(
        f"import sys\nopen({str(log)!r}, 'a').write('compare ' + ' '.join(sys.argv[2:4]) + '\\n')\n")
    work = tmp_path / "work"
    proc = _run(out, work, "qwen3_30b_a3b", "local")
    assert proc.returncode == 0, proc.stderr
    proc = _run(out, work, "fp32_optimizer")  # the shipped run is there now
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        f"driver {work}/qwen3_30b_a3b", f"driver {work}/qwen3_30b_a3b_local",
        f"compare {work}/qwen3_30b_a3b_local {work}/qwen3_30b_a3b",
        f"driver {work}/qwen3_30b_a3b_fp32_optimizer",
        f"compare {work}/qwen3_30b_a3b {work}/qwen3_30b_a3b_fp32_optimizer"]


def test_keep_copies_summaries_and_plots_and_keeps_an_example_whose_run_left_none(tmp_path):
    out = _copy(tmp_path)
    work = tmp_path / "work"
    for kind in ("kernel", "memory"):
        trial = work / "qwen3_5_35b_a3b" / f"qwen3_5_35b_a3b_fake32k_{kind}_step2_20261201_200522"
        (trial / "plots").mkdir(parents=True)
        (trial / "profile_summary.md").write_text(f"{kind} summary\n")
        (trial / "plots" / f"{kind}.png").write_bytes(b"\x89PNG" + kind.encode())
    failed = work / "qwen3_30b_a3b_local" / "qwen3_30b_a3b_fake128k_kernel_step2_x"
    failed.mkdir(parents=True)
    (failed / "launcher.log").write_text("exit 1\n")
    (work / "compare_lm_head.md").write_text("compare\n")
    (work / "compare_optimizer.md").write_text("optimizer\n")
    proc = _run(out, work, "keep")
    assert proc.returncode == 0, proc.stderr
    files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.suffix != ".sh"}
    assert files == {
        "qwen3_5_35b_a3b/kernel/profile_summary.md": b"kernel summary\n",
        "qwen3_5_35b_a3b/kernel/kernel.png": b"\x89PNGkernel",
        "qwen3_5_35b_a3b/memory/profile_summary.md": b"memory summary\n",
        "qwen3_5_35b_a3b/memory/memory.png": b"\x89PNGmemory",
        "qwen3_30b_a3b_local/kernel/profile_summary.md": b"earlier example\n",
        "compare_lm_head.md": b"compare\n",
        "compare_optimizer.md": b"optimizer\n",
    }
