"""Command lines of the benchmarks added for the collectives, the chunked attention, the fused norm, the fused
router and the LM head loss: a bad argument is refused (exit status 2, the flag and what it accepts named) before the
CUDA check and before anything is measured; parsing helpers give exact values. Runs in-process: no GPU, no torchrun."""
import importlib.util
import sys
from pathlib import Path

import pytest

from sftprof.stats_log import StatsWriter, StepRecord

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(monkeypatch, capsys, name: str, *argv: str) -> tuple[int, str]:
    """``(exit status, stderr)`` of ``bench/<name>.py argv`` run in this process (argparse's exit included)."""
    module = _load(name)
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *argv])
    try:
        rc = module.main()
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def test_collectives_settings_and_sizes():
    bench = _load("collectives")
    assert bench.parse_setting("p2p32=NCCL_MIN_P2P_NCHANNELS=32,NCCL_ALGO=Ring") == (
        "p2p32", {"NCCL_MIN_P2P_NCHANNELS": "32", "NCCL_ALGO": "Ring"})
    assert bench.parse_setting("default=") == ("default", {})
    assert bench.remote_bytes(512 * 2 ** 20, 2) == 256 * 2 ** 20
    with pytest.raises(ValueError, match=r"--setting 'a=X': 'X' is not VAR=VAL"):
        bench.parse_setting("a=X")
    with pytest.raises(ValueError, match=r"need >= 2 ranks dividing the size, got 3 ranks and 8 bytes"):
        bench.remote_bytes(8, 3)


@pytest.mark.parametrize("argv, message", [
    (["--setting", "a=NCCL_ALGO=Ring", "--setting", "a=NCCL_ALGO=Tree"],
     "--setting 'a': the name is given 2 times; names must be unique"),
    (["--setting", "a/b=NCCL_ALGO=Ring"], "--setting 'a/b': the name must be letters, digits, '.', '_' or '-'"),
    (["--mib", "64", "0"], "--mib 0: must be an integer >= 1 (MiB of bf16 per rank)"),
    (["--reps", "0"], "--reps 0: must be an integer >= 1"),
    (["--setting", "=NCCL_ALGO=Ring"], "--setting '=NCCL_ALGO=Ring': expected NAME=VAR=VAL[,VAR=VAL...] or NAME="),
])
def test_collectives_refuses_bad_arguments_before_the_gpu_check(monkeypatch, capsys, argv, message):
    assert _run(monkeypatch, capsys, "collectives", *argv) == (2, message + "\n")


def test_collectives_never_overwrites_its_json(monkeypatch, capsys, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("earlier results")
    assert _run(monkeypatch, capsys, "collectives", "--json", str(out)) == (
        2, f"--json {out}: exists; give a new file (results are never overwritten)\n")
    assert out.read_text() == "earlier results"


def test_cp_attention_never_overwrites_its_json(monkeypatch, capsys, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("earlier results")
    rc, err = _run(monkeypatch, capsys, "cp_attention", "--json", str(out))
    assert rc == 2 and err.endswith(
        f"\ncp_attention.py: error: --json {out}: exists; give a new file (results are never overwritten)\n")
    assert out.read_text() == "earlier results"


@pytest.mark.parametrize("name, argv, message", [
    ("cp_attention", ["--chunks", "0"], "--chunks 0: must be >= 1 and divide --seq 131072"),
    ("cp_attention", ["--chunks", "3"], "--chunks 3: must be >= 1 and divide --seq 131072"),
    ("cp_attention", ["--seq", "12", "--cp", "4"], "--seq 12 must be a multiple of 2 x CP = 8"),
    ("cp_attention", ["--layouts", "sbhd", "sbhd"], "--layouts sbhd sbhd: a value is repeated (each gives its own rows)"),
    ("cp_attention", ["--chunks", "2", "4", "2"], "--chunks 2 4 2: a value is repeated (each gives its own rows)"),
    ("cp_attention", ["--json", "/nonexistent_dir/r.json"], "--json /nonexistent_dir/r.json: folder /nonexistent_dir "
     "does not exist"),
    ("norm", ["--fwd-tile", "1000"],
     "--fwd-tile 1000: must be a power of 2 (elements per tile; Triton blocks are powers of 2)"),
    ("norm", ["--reps", "0"], "--tokens 131072 and --reps 0: each must be an integer >= 1"),
    ("router", ["--experts", "1024"], "--tokens 131072, --experts 1024, --topk 8, --min-run-time 1.0: need tokens "
     ">= 1, 1 <= topk <= experts <= 512 (the fused kernel's range) and a min run time > 0"),
    ("router", ["--experts", "4", "--topk", "8"], "--tokens 131072, --experts 4, --topk 8, --min-run-time 1.0: "
     "need tokens >= 1, 1 <= topk <= experts <= 512 (the fused kernel's range) and a min run time > 0"),
    ("lm_head", ["--vocab", "0"], "--tokens 8192 32768 131072 and --vocab 0: each must be an integer >= 1"),
    ("lm_head", ["--vocab", "-5"], "--tokens 8192 32768 131072 and --vocab -5: each must be an integer >= 1"),
    ("lm_head", ["--tokens", "8192", "0"], "--tokens 8192 0 and --vocab 151936: each must be an integer >= 1"),
    ("lm_head", ["--reps", "-1"], "--reps -1: must be an integer >= 1 (or 0: 5 at N >= 65536 tokens, 7 below)"),
    ("lm_head", ["--rows", "nosuch", "nor"], "--rows nosuch nor: no method's name contains one of these texts"),
    ("lm_head_epilogue", ["--tokens", "8192"], "unrecognized arguments: --tokens 8192"),
])
def test_benches_refuse_bad_arguments_before_the_gpu_check(monkeypatch, capsys, name, argv, message):
    rc, err = _run(monkeypatch, capsys, name, *argv)
    assert rc == 2 and err.endswith(f"\n{name}.py: error: {message}\n")


@pytest.mark.parametrize("name", ["norm", "router", "lm_head", "lm_head_epilogue"])
def test_benches_without_cuda_measure_nothing(monkeypatch, capsys, name):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    assert _run(monkeypatch, capsys, name) == (
        1, f"bench/{name}.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured\n")
    assert capsys.readouterr().out == ""


def test_step_row_names_the_worse_ranks_exposed_waiting(tmp_path):
    """``bench/step.py``'s row of a two-GPU kernel trial: exposed communication of the rank with the most (rank 1
    here), its share of the step, and the part of it that rank spent waiting for the other (``comm_wait``), read from
    ``profile_summary.json`` (the figures of this session's c2e2 run with 2 chunks); ``-`` when not split."""
    step = _load("step")

    def trace(rank, exposed, attn):
        return {"rank": rank, "summary": {"gpu": {"activities": 1900, "busy_share_pct": 99.0},
                                          "communication": {"exposed_ms": exposed},
                                          "parts": {"summed": [{"part": "attn_core", "total_ms": attn}]},
                                          "efficiency": {"rows": []}}}

    summary = {"trial": "qwen3_30b_a3b_fake128k_kernel_step2_x", "status": "ok", "profile_step": 2,
               "stats": {"steps": [{"step": 1, "step_time_s": 2.863}, {"step": 2, "step_time_s": 2.868,
                                                                        "mem_peak_allocated_gb": 45.48, "mfu": 0.372,
                                                                        "moe": {"max_over_mean": 15.9990234375,
                                                                                "ep_max_over_mean": 1.2580242156}}]},
               "kernel_traces": [trace(0, 52.829, 2330.0), trace(1, 85.6263, 2300.0)],
               "comm_wait": {"ranks": [{"rank": 0, "exposed_ms": 52.829, "exposed_wait_ms": 31.4368},
                                       {"rank": 1, "exposed_ms": 85.6263, "exposed_wait_ms": 61.4192}]}}
    run = tmp_path / "trial"
    run.mkdir()
    (run / "profile_summary.json").write_text(__import__("json").dumps(summary))
    row = step.trial_row(run)
    assert (row["exposed_comm_ms"], row["exposed_wait_ms"], row["attn_ms"], row["attn_rank"]) == (
        85.6263, 61.4192, 2330.0, 0)
    assert row["exposed_comm_pct"] == pytest.approx(100 * 85.6263 / 2868)
    table = step.format_table([dict(row, layout="megatron:(attn:c2|ffn:e2)", world_size=2)], []).splitlines()
    assert "of which wait ms" in table[0] and table[1].split()[8:11] == ["85.6", "3.0", "61.4"]
    assert table[0].endswith("MFU  expert max/mean  EP max/mean") and table[1].split()[-3:] == ["0.372", "16.00", "1.26"]
    assert table[1].split()[-5:-3] == ["-", "-"]  # a real run: no projected step
    del summary["comm_wait"]
    (run / "profile_summary.json").write_text(__import__("json").dumps(summary))
    assert step.trial_row(run)["exposed_wait_ms"] is None
    summary["simulation"] = {"rank": 1, "projection": {"projected_step_ms": 3058.1, "exposed_ms": 187.5}}
    (run / "profile_summary.json").write_text(__import__("json").dumps(summary))
    row = step.trial_row(run)
    assert (row["projected_step_s"], row["projected_exposed_ms"]) == (3.0581, 187.5)
    table = step.format_table([dict(row, layout="megatron:(attn:c2|ffn:e2)@actor.simulate.rank=1", world_size=2)],
                              []).splitlines()
    assert "proj. step s  proj. exp. comm ms    MFU" in table[0] and table[1].split()[-5:-3] == ["3.058", "187.5"]


def test_snapshot_cost_reads_each_memory_trial_or_says_what_is_missing(tmp_path):
    """bench/snapshot_cost.py --driver's row of one memory trial: the step times and the profiled step's
    ``profiler_s`` from a real StatsWriter file and the snapshot's size; a missing log dir, stats.jsonl or snapshot
    is named in the row with the driver's exit status, no traceback."""
    bench = _load("snapshot_cost")
    fileroot = tmp_path / "fileroot"
    assert bench.driver_cells(fileroot, "all", 2) == "no trial log dir (driver exit 2) | – | –"
    log_dir = fileroot / "logs" / "root" / "exp" / "qwen3_30b_a3b_fake64k_memory_step2_all"
    log_dir.mkdir(parents=True)
    assert bench.driver_cells(fileroot, "all", 1) == (
        "no stats.jsonl (No such file or directory; driver exit 1) | – | –")
    writer = StatsWriter(log_dir / "stats.jsonl")
    for step, (t, prof_s) in enumerate([(4.961, 3.3e-05), (2.013, 3.2e-05), (1.8704, 2.2595)]):
        writer.write(StepRecord(step=step, loss=1.0, grad_norm=1.0, step_time_s=t, tokens=65536, tokens_per_s=1.0,
                                profiled=step == 2, profiler_s=prof_s))
    writer.close()
    assert bench.driver_cells(fileroot, "all", 0) == "4.961, 2.013, 1.870 | 2.26 | no snapshot"
    snap_dir = log_dir / "memory_snapshots" / "step_2"
    snap_dir.mkdir(parents=True)
    (snap_dir / "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle").write_bytes(b"\0" * (3 * 2**20 + 2**19))
    assert bench.driver_cells(fileroot, "all", 0) == "4.961, 2.013, 1.870 | 2.26 | 3.5"
