"""Kernel summary on real traces, checked against simple independent computations in the test."""
import collections
import gzip
import json

import numpy as np
import pytest

from fixtures import gpu_trace_fixtures, make_cpu_trace
from sftprof.analysis.trace.io import TraceReader
from sftprof.analysis.trace.intervals import intersection_length, union
from sftprof.analysis.trace.kernel_names import collective_group_label, kernel_category
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer

GPU_TRACES = gpu_trace_fixtures()


def _summarise(path):
    reader = TraceReader(path)
    a = KernelTraceAnalyzer()
    for _, ev in reader.events():
        a.add(ev)
    a.set_header(reader.header)
    return a.summary()


@pytest.fixture(scope="module", params=GPU_TRACES, ids=lambda p: p.name)
def gpu_case(request):
    with gzip.open(request.param, "rt") if request.param.suffix == ".gz" else open(request.param) as f:
        ref = json.load(f)["traceEvents"]
    return ref, _summarise(request.param)


def test_top_kernel_and_totals_match_a_plain_count(gpu_case):
    ref, s = gpu_case
    total = collections.defaultdict(float)
    calls = collections.Counter()
    for e in ref:
        if e.get("cat") == "kernel":
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    top_name = max(total, key=total.get)
    assert s["top_kernels"][0]["name"] == top_name
    assert s["top_kernels"][0]["calls"] == calls[top_name]
    assert s["top_kernels"][0]["total_ms"] == pytest.approx(total[top_name] / 1e3, abs=1e-3)
    assert len(s["top_kernels"]) == min(20, len(total))
    gpu_us = sum(e["dur"] for e in ref if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    assert s["gpu"]["total_ms"] == pytest.approx(gpu_us / 1e3, abs=1e-3)
    assert sum(c["share_pct"] for c in s["categories"]) == pytest.approx(100.0, abs=0.01)
    assert sum(c["calls"] for c in s["categories"]) == s["gpu"]["activities"]


def test_top_cpu_ops_match_a_plain_count(gpu_case):
    ref, s = gpu_case
    total = collections.defaultdict(float)
    calls = collections.Counter()
    for e in ref:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    expect = sorted(total, key=lambda n: (-total[n], n))[:15]
    assert [x["name"] for x in s["top_cpu_ops"]] == expect
    assert [x["calls"] for x in s["top_cpu_ops"]] == [calls[n] for n in expect]
    assert s["top_cpu_ops"][0]["inclusive_ms"] == pytest.approx(total[expect[0]] / 1e3, abs=1e-3)


def test_busy_share_matches_sweep(gpu_case):
    ref, s = gpu_case
    lo, hi = s["step_window"]["start_us"], s["step_window"]["end_us"]
    iv = sorted((max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in ref
                if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] < hi and e["ts"] + e["dur"] > lo)
    busy, cur_s, cur_e = 0.0, None, None
    for a, b in iv:  # classic sweep over sorted intervals
        if cur_e is None or a > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    assert s["gpu"]["busy_ms"] == pytest.approx(busy / 1e3, abs=1e-3)
    assert s["gpu"]["busy_share_pct"] == pytest.approx(100 * busy / (hi - lo), abs=1e-3)
    assert s["gpu"]["busy_share_pct"] + s["gpu"]["idle_share_pct"] == pytest.approx(100.0)


def test_interval_overlap_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a_s = rng.uniform(0, 100, 30)
        a_e = a_s + rng.uniform(0, 10, 30)
        b_s = rng.uniform(0, 100, 25)
        b_e = b_s + rng.uniform(0, 10, 25)
        grid = np.linspace(0, 115, 115_001)[:-1] + 115 / 115_000 / 2  # midpoints, step 0.001
        in_a = np.zeros_like(grid, dtype=bool)
        in_b = np.zeros_like(grid, dtype=bool)
        for s, e in zip(a_s, a_e):
            in_a |= (grid >= s) & (grid < e)
        for s, e in zip(b_s, b_e):
            in_b |= (grid >= s) & (grid < e)
        got = intersection_length(union(a_s, a_e), union(b_s, b_e))
        assert got == pytest.approx((in_a & in_b).sum() * 0.001, abs=0.05)


def test_collectives_by_group_and_overlap():
    """NCCL kernels are attributed to megatron-core groups through the trace's pg_config."""
    header = {"distributedInfo": {"pg_config": [{"pg_name": "7", "pg_desc": "TENSOR_MODEL_PARALLEL_GROUP"},
                                                {"pg_name": "14", "pg_desc": "EXPERT_MODEL_PARALLEL_GROUP"}]}}
    a = KernelTraceAnalyzer()  # the header may come after the events (members after traceEvents)
    k = dict(ph="X", cat="kernel", pid=0)
    a.add({**k, "name": "nvjet_sm90_tst_256x128", "tid": 7, "ts": 0.0, "dur": 100.0})
    a.add({**k, "name": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "tid": 20,
           "ts": 60.0, "dur": 80.0, "args": {"Process Group Name": "7"}})
    # Group only known from the launching collective op (External id link).
    a.add({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 9, "tid": 9, "ts": 1.0, "dur": 1.0,
           "args": {"External id": 5, "Process Group Name": "14", "Collective name": "all_to_all"}})
    a.add({**k, "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "tid": 21,
           "ts": 200.0, "dur": 10.0, "args": {"External id": 5}})
    a.set_header(header)
    c = a.summary()["communication"]
    assert c["total_ms"] == pytest.approx(0.09)
    assert c["hidden_ms"] == pytest.approx(0.04)  # [60, 100) under the GEMM
    assert c["exposed_ms"] == pytest.approx(0.05)
    assert c["by_group_ms"] == {"TP": pytest.approx(0.08), "EP": pytest.approx(0.01)}
    assert c["by_type_ms"] == {"AllGather": pytest.approx(0.08), "SendRecv": pytest.approx(0.01)}
    assert collective_group_label(None, "3") == "pg3"
    assert kernel_category("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "memcpy/memset"


def test_regions_on_a_real_cpu_trace(tmp_path):
    path = make_cpu_trace(tmp_path / "cpu.json", n_mbs=3, all_reduce=True)
    ref = json.load(open(path))["traceEvents"]
    want = sorted((e["ts"], e["name"], e["dur"]) for e in ref
                  if e.get("cat") == "user_annotation" and e["name"].startswith("sftprof/"))
    s = _summarise(path)
    assert [r["name"] for r in s["regions"]] == [n for _, n, _ in want]
    assert [r["name"] for r in s["regions"]][:3] == ["sftprof/step", "sftprof/forward/mb0", "sftprof/backward/mb0"]
    for r, (_, _, dur) in zip(s["regions"], want):
        assert r["cpu_ms"] == pytest.approx(dur / 1e3, abs=1e-4)
        assert r["gpu_activities"] == 0
    step = next(d for _, n, d in want if n == "sftprof/step")
    assert s["step_window"]["source"] == "sftprof/step"
    assert s["step_window"]["wall_ms"] == pytest.approx(step / 1e3, abs=1e-4)
    assert s["gpu"]["activities"] == 0 and s["categories"] == [] and s["top_kernels"] == []
    gloo = [e for e in ref if e.get("name", "").startswith("gloo:") and e["ph"] == "X"]
    host = s["communication"]["host_ops"]
    assert host["ops"] == len(gloo) == 4  # one all_reduce per parameter tensor of the MLP
    assert host["by_op_ms"] == {"gloo:all_reduce": pytest.approx(sum(e["dur"] for e in gloo) / 1e3, abs=1e-3)}
    assert 0 < host["wall_ms"] <= host["by_op_ms"]["gloo:all_reduce"] + 1e-3


@pytest.mark.parametrize("path", GPU_TRACES, ids=lambda p: p.name)
def test_compute_cells_are_the_part_cells_without_nccl(path):
    """``parts["compute_cells"]``: per (part, layer, phase) the GPU time without NCCL kernels; these one-GPU traces
    have none, so each cell is its part table's phase value (up to the 0.1 us rounding of each)."""
    s = _summarise(path)
    parts = s["parts"]
    table = {(r["part"], layer["layer"], ph): r[f"{ph}_ms"] for layer in parts["layers"] for r in layer["rows"]
             for ph in ("forward", "recompute", "backward", "optimizer", "other")}
    table.update({(r["part"], None, ph): r[f"{ph}_ms"] for r in parts["outside_layers"]
                  for ph in ("forward", "recompute", "backward", "optimizer", "other")})
    cells = parts["compute_cells"]
    assert s["communication"]["total_ms"] == 0 and len(cells) == len({tuple(c[:3]) for c in cells}) > 5
    assert all(ms == pytest.approx(table[(part, layer, phase)], abs=2e-4) for part, layer, phase, ms in cells)
    assert sum(c[3] for c in cells) == pytest.approx(parts["total_ms"], abs=1e-3)
