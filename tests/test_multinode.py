"""Multi-node as a cluster runs it, on one machine: two drivers as nodes 0 and 1, one rank each (CPU, gloo).

Both drivers get ``N_NODES=2``, their ``NODE_RANK``, the same ``PROFILE_STAMP``, ``MASTER_ADDR`` and
``MASTER_PORT`` and one shared ``FILEROOT``. Node 0 reads the completion record, waits for node 1's end
record and postprocesses both ranks. Without node 1, node 0 names it and ends within its timeouts.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from sftprof import launch

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "run_qwen3_30b_a3b_sft_profile.sh"


def _node_env(base: Path, node_rank: int, stamp: str, port: int, timeout_s: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "CONFIG", "RUN_ROOT")}
    env.update(CONFIG="tiny_cpu", N_NODES="2", NODE_RANK=str(node_rank), N_GPUS_PER_NODE="1", PROFILE_STAMP=stamp,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FILEROOT=str(base / "shared_fileroot"),
               RUN_ROOT=str(base / f"run_node{node_rank}"), PROFILE_RANKS="", PROFILE_KINDS="kernel",
               PROFILE_STEPS="0", PROFILE_FAKE_SEQ_LEN="128", NODE_TIMEOUT=str(timeout_s), PYTHONPATH=str(ROOT))
    return env


def _start(env: dict) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(DRIVER)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_one_rank_each(tmp_path):
    port = launch.free_port()
    nodes = [_start(_node_env(tmp_path, k, "mn", port, 120)) for k in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    trial = "tiny_qwen3_moe_fake128_kernel_step0_mn"
    summary = json.loads((tmp_path / "run_node0" / trial / "profile_summary.json").read_text())
    assert summary["status"] == "ok" and summary["completion"]["world_size"] == 2
    assert [(t["rank"], t["source"]) for t in summary["kernel_traces"]] == [
        (0, "perf_tracer/rank0.pt.trace.json"), (1, "perf_tracer/rank1.pt.trace.json")]
    log_dir = Path(summary["paths"]["log_dir"])
    records = [json.loads((log_dir / "nodes" / f"node{k}.json").read_text()) for k in (0, 1)]
    assert [(r["node_rank"], r["torchrun_rc"]) for r in records] == [(0, 0), (1, 0)]
    assert "kernel step 0  ok" in outs[0] and "compare" in outs[0]
    assert "node 1: node 0 postprocesses every rank; its RUN_ROOT holds the summaries" in outs[1]
    assert not (tmp_path / "run_node1" / trial / "profile_summary.json").exists()


def test_a_node_that_never_starts_is_named(tmp_path):
    timeout_s = 5
    node0 = _start(_node_env(tmp_path, 0, "alone", launch.free_port(), timeout_s))
    out = node0.communicate(timeout=300)[0]  # joining waits NODE_TIMEOUT, the end records NODE_TIMEOUT again
    assert node0.returncode == 1, out[-3000:]
    assert "Timed out after" in out and "1/2 clients joined" in out   # torchrun's static rendezvous gave up
    assert f"sftprof: node 1: no end record after {timeout_s} s (NODE_TIMEOUT): it never started this trial" in out
    assert "kernel step 0  FAILED (1)" in out


def test_wait_for_nodes_reports_each_failed_node(tmp_path):
    launch.write_node_record(tmp_path, 1, 0, 12)
    launch.write_node_record(tmp_path, 2, 137, 30)
    (tmp_path / "nodes" / "node3.json").write_text("{not json")
    host = json.loads((tmp_path / "nodes" / "node2.json").read_text())["host"]
    assert launch.wait_for_nodes(tmp_path, 5, timeout_s=0) == [
        f"node 2 ({host}): torchrun exited with status 137 (see its launcher.log)",
        f"node 3: unreadable end record {tmp_path}/nodes/node3.json: Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)",
        f"node 4: no end record after 0 s (NODE_TIMEOUT): it never started this trial or died before finishing it "
        f"({tmp_path}/nodes holds the records that came)"]
    assert launch.wait_for_nodes(tmp_path, 2, timeout_s=0) == []
