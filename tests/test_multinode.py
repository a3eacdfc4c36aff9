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
from sftprof.analysis.trace.check import validate_trace

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
    merged = summary["merged_view"]  # the two ranks' traces on one timeline, each rank its own process
    assert [(r["rank"], r["aligned_by"]) for r in merged["ranks"]] == [(0, "reference"), (1, "trace clock")]
    events = json.loads((tmp_path / "run_node0" / trial / merged["files"][0]).read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert validate_trace(str(tmp_path / "run_node0" / trial / merged["files"][0])) == []
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
    # the end table and the summary name the node that never joined, with its ranks, as the first failure
    assert ("kernel step 0  FAILED (1)  -          -         first failure: node 1 (rank 1) never joined the trial "
            "(see profile_summary.md)\n") in out
    run_dir = tmp_path / "run_node0" / "tiny_qwen3_moe_fake128_kernel_step0_alone"
    summary = json.loads((run_dir / "profile_summary.json").read_text())
    host = json.loads((Path(summary["paths"]["log_dir"]) / "nodes" / "node0.json").read_text())["host"]
    assert summary["status"] == "failed" and summary["errors"] == []
    assert summary["failure"] == {
        "node": 1, "ranks": [1], "rank": None, "exitcode": None, "signal": None, "how": "never joined the trial",
        "host": None, "error_file": None, "log_tail": [], "others": [],
        "traceback": "torchrun's rendezvous on node 0 timed out with 1/2 nodes joined (NODE_TIMEOUT), and node 1 "
                     "wrote no end record (nodes/node1.json)",
        "nodes": [{"node": 0, "ranks": [0], "host": host, "how": "torchrun exited with status 1",
                   "detail": "see launcher.log in this run dir"}]}
    md = (run_dir / "profile_summary.md").read_text()
    assert ("## Failure\n\n- first failure: **node 1 (rank 1) never joined the trial** (host –): torchrun's rendezvous "
            "on node 0 timed out with 1/2 nodes joined (NODE_TIMEOUT), and node 1 wrote no end record "
            f"(nodes/node1.json)\n- also: node 0 (rank 0) torchrun exited with status 1 (host {host}): see launcher.log "
            "in this run dir\n") in md


def test_wait_for_nodes_reports_each_failed_node(tmp_path):
    launch.write_node_record(tmp_path, 1, 0, 12, 5, 8)
    launch.write_node_record(tmp_path, 2, 137, 30, 5, 8)
    (tmp_path / "nodes" / "node3.json").write_text("{not json")
    host = json.loads((tmp_path / "nodes" / "node2.json").read_text())["host"]
    assert launch.wait_for_nodes(tmp_path, 5, timeout_s=0) == [
        f"node 2 ({host}): torchrun exited with status 137 (see its launcher.log)",
        f"node 3: unreadable end record {tmp_path}/nodes/node3.json: Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)",
        f"node 4: no end record after 0 s (NODE_TIMEOUT): it never started this trial or died before finishing it "
        f"({tmp_path}/nodes holds the records that came)"]
    assert launch.wait_for_nodes(tmp_path, 2, timeout_s=0) == []


def test_node_failures_name_each_node_and_its_ranks(tmp_path):
    """The summary's view of the same records: 5 nodes x 8 ranks; node 4 wrote no record and node 0's torchrun
    printed no rendezvous timeout, so node 4 may have joined and died: it is the first failure all the same, and
    torchrun's own rank failures on node 0 follow it."""
    from sftprof.analysis.trial.failure import first_failure, node_failures
    launch.write_node_record(tmp_path, 0, 1, 40, 5, 8)
    launch.write_node_record(tmp_path, 1, 0, 12, 5, 8)
    launch.write_node_record(tmp_path, 2, 137, 30, 5, 8)
    (tmp_path / "nodes" / "node3.json").write_text('{"torchrun_rc": "0"}')
    host = json.loads((tmp_path / "nodes" / "node2.json").read_text())["host"]
    assert node_failures(str(tmp_path), []) == [
        {"node": 4, "ranks": list(range(32, 40)), "host": None, "how": "wrote no end record",
         "detail": "no nodes/node4.json in the log dir: node 4 never started the trial or died before its driver "
                   "wrote the record (see that node's launcher.log)"},
        {"node": 0, "ranks": list(range(0, 8)), "host": host, "how": "torchrun exited with status 1",
         "detail": "see launcher.log in this run dir"},
        {"node": 2, "ranks": list(range(16, 24)), "host": host, "how": "torchrun exited with status 137",
         "detail": "see node 2's launcher.log (in its RUN_ROOT)"},
        {"node": 3, "ranks": list(range(24, 32)), "host": None, "how": "unreadable end record",
         "detail": "nodes/node3.json: ValueError: torchrun_rc: expected an integer, got '0'"}]
    launcher = tmp_path / "launcher.log"
    launcher.write_text((Path(__file__).parent / "fixtures" / "torchrun_sigkill_launcher.log").read_text())
    fail = first_failure(str(launcher), str(tmp_path))
    assert (fail["node"], fail["ranks"][:2], fail["how"], [n["node"] for n in fail["nodes"]]) == (
        4, [32, 33], "wrote no end record", [0, 2, 3])
    assert fail["others"] == [{"rank": 1, "exitcode": -9, "signal": "SIGKILL", "how": "killed by SIGKILL (exit code -9)"},
                              {"rank": 0, "exitcode": -15, "signal": "SIGTERM", "how": "killed by SIGTERM (exit code -15)"}]
    # every node wrote its record: torchrun's first failing rank leads, the failed nodes follow it
    launch.write_node_record(tmp_path, 4, 0, 30, 5, 8)
    (tmp_path / "nodes" / "node3.json").unlink()
    launch.write_node_record(tmp_path, 3, 0, 30, 5, 8)
    fail = first_failure(str(launcher), str(tmp_path))
    assert (fail["node"], fail["rank"], fail["how"], [n["node"] for n in fail["nodes"]]) == (
        None, 1, "killed by SIGKILL (exit code -9)", [0, 2])
    # records of earlier releases carry no layout: the config's (n_nodes, nproc_per_node) names the ranks
    (tmp_path / "nodes" / "node4.json").unlink()
    for k in range(4):
        (tmp_path / "nodes" / f"node{k}.json").write_text('{"node_rank": %d, "torchrun_rc": 0}' % k)
    assert [(n["node"], n["ranks"]) for n in node_failures(str(tmp_path), [], (5, 2))] == [(4, [8, 9])]
    assert node_failures(str(tmp_path), []) == []  # no layout anywhere: a missing node cannot be known


def test_a_killed_torchrun_is_the_first_failure_with_the_ranks_it_left(tmp_path):
    """A node whose torchrun was killed outright (its record names the signal and the ranks whose workers the launcher
    stopped) is the root cause, its other ranks named as already ended (they died with torchrun, or before)."""
    from sftprof.analysis.trial.failure import first_failure, headline
    launch.write_node_record(tmp_path, 0, 137, 5, 1, 3, "SIGKILL", [0, 2])
    fail = first_failure(str(tmp_path / "launcher.log"), str(tmp_path))
    assert headline(fail) == "node 0 (ranks 0-2) torchrun killed by SIGKILL (status 137)"
    assert fail["traceback"] == "the launcher stopped the workers it left running (ranks 0, 2); rank 1 had already ended"
    launch.write_node_record(tmp_path, 0, 137, 5, 1, 3, "SIGKILL", None)
    assert first_failure(str(tmp_path / "launcher.log"), str(tmp_path))["traceback"] == "no worker was left running"
