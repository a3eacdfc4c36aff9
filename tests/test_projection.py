"""The projection of a simulated rank (sftprof.analysis.time.projection): per-collective time, overlap windows, the
InfiniBand rate for groups across nodes, NCCL's buffers and the MFU, worked by hand on the shipped layout's plan."""
from __future__ import annotations

import pytest

from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.memory.fit import (DRIVER_RESERVED_GIB, OUTSIDE_PYTORCH_GIB_MCORE_0_19, outside_pytorch_gib,
                                         smi_capacity_bytes)
from sftprof.analysis.report.render import SECTIONS
from sftprof.analysis.time.projection import (INTERCONNECTS, collective_ms, nccl_buffer_bytes, overlap_windows, project,
                                              real_rank_text, render)
from sftprof.analysis.time.rank_plan import rank_plan
from test_rank_plan import QWEN3_30B, _shipped_cfg

MIB = 1 << 20
GIB = 1 << 30


def test_collective_ms_by_hand():
    nv = INTERCONNECTS["nvlink"]
    ms, gbps = collective_ms("all_to_all", 256 * MIB, 8, nv)
    assert gbps == 261 and ms == pytest.approx(256 * MIB * 7 / 8 / 261e9 * 1e3 + 0.02)
    ms, gbps = collective_ms("all_to_all", 100 * MIB, 2, nv)  # nearest measured size: 64 MiB
    assert gbps == 186 and ms == pytest.approx(50 * MIB / 186e9 * 1e3 + 0.02)
    ms, _ = collective_ms("send_recv", 512 * MIB, 2, nv)  # the whole tensor leaves the rank
    assert ms == pytest.approx(512 * MIB / 271e9 * 1e3 + 0.02)
    with pytest.raises(KeyError):
        collective_ms("broadcast", MIB, 2, nv)


def test_nccl_buffers():
    plan = [{"group": "ep", "collective": "all_to_all", "group_size": 8},
            {"group": "cp", "collective": "all_gather", "group_size": 4},
            {"group": "cp", "collective": "reduce_scatter", "group_size": 4}]
    total, lines = nccl_buffer_bytes(plan)
    assert total == (2 * 16 * 4 + 2 * 7 * 4) * MIB + 2 * 16 * 4 * MIB
    assert lines == ["cp (4 ranks): 2 x 16 channels x 4 MiB = 128 MiB",
                     "ep (8 ranks): 2 x 16 channels x 4 MiB + 2 x 7 peers x 4 MiB = 184 MiB"]


def test_shipped_projection_by_hand():
    cfg = _shipped_cfg()
    plan = rank_plan(cfg, QWEN3_30B, parse_allocation_mode(cfg["actor"]["backend"]), 0)
    windows = {"backward": 1000.0, "forward": 100.0}
    p = project(plan, 20000.0, 60.0, 8, windows, measured_mfu=0.4)
    rows = {(r["group"], r["collective"]): r for r in p["rows"]}
    assert {r["interconnect"] for r in p["rows"]} == {"nvlink"}
    cp_ag = rows["cp", "all_gather"]  # 256 MiB a call, 192 calls, not hidden: the attention window is not measured
    assert cp_ag["ms"] == pytest.approx(192 * (256 * MIB * 3 / 4 / 247e9 * 1e3 + 0.02))
    assert cp_ag["exposed_ms"] == cp_ag["ms"]
    dense = plan["shards"]["params_dense"]
    rs = rows["dp_cp", "reduce_scatter"]  # one call of the bf16 dense gradients, hidden behind the backward
    assert rs["ms"] == pytest.approx(dense * 2 * 7 / 8 / 235e9 * 1e3 + 0.02) and rs["exposed_ms"] == 0
    ag = rows["dp_cp", "all_gather"]
    assert ag["exposed_ms"] == pytest.approx(max(0.0, ag["ms"] - 100.0))
    exposed = sum(r["exposed_ms"] for r in p["rows"])
    assert p["projected_step_ms"] == pytest.approx(20000.0 + exposed)
    assert p["serial_step_ms"] == pytest.approx(20000.0 + sum(r["ms"] for r in p["rows"]))
    assert p["mfu"] == pytest.approx(0.4 * 20000.0 / p["projected_step_ms"])
    nccl = ((2 * 16 * 4) * 3 + 2 * 7 * 4) * MIB  # cp, dp_cp, ep (+ its peers)
    assert p["memory"] == {"measured_peak_gib": 60.0, "nccl_buffers_gib": nccl / (1 << 30),
                           "projected_peak_gib": 60.0 + nccl / (1 << 30), "measured_peak_reserved_gib": None,
                           "outside_pytorch_gib": outside_pytorch_gib(), "real_rank_need_gib": None,
                           "capacity_gib": None, "fits": None}
    assert any(a.startswith("overlapped collectives hide behind their window's measured compute: forward 100.0 ms, "
                            "backward 1000.0 ms, cp_attention not measured") for a in p["assumptions"])
    assert render(p).splitlines()[0] == "projection of rank 0 of 8 (simulated: compute measured, communication computed)"


def test_real_rank_of_the_shipped_layout_does_not_fit_an_h100():
    """The shipped layout's rank 0 with all 48 layers, simulated on an H100 80 GB (bench/NOTES.md, "Twenty-fourth
    session"; megatron-core 0.19.2): 76.72 GiB allocated, 78.41 reserved. The real rank adds what a process with real
    process groups holds outside PyTorch (0.19.2's one-GPU figure) and the NCCL buffers of cp, dp_cp and ep: about
    87.7 GiB, more than the H100's capacity (nvidia-smi's 81559 MiB less the driver's share)."""
    cfg = _shipped_cfg()
    plan = rank_plan(cfg, QWEN3_30B, parse_allocation_mode(cfg["actor"]["backend"]), 0)
    capacity = smi_capacity_bytes([{"index": 0, "memory_total_mib": 81559.0}])
    assert capacity == int(81559 * MIB - DRIVER_RESERVED_GIB * GIB)
    p = project(plan, 31375.9, 76.72, 8, peak_reserved_gib=78.41, capacity_bytes=capacity,
                outside_gib=OUTSIDE_PYTORCH_GIB_MCORE_0_19)
    nccl = ((2 * 16 * 4) * 3 + 2 * 7 * 4) * MIB / GIB
    need = 78.41 + OUTSIDE_PYTORCH_GIB_MCORE_0_19 + nccl
    mem = p["memory"]
    assert mem["nccl_buffers_gib"] == nccl and mem["real_rank_need_gib"] == pytest.approx(need, abs=1e-12)
    assert round(need, 1) == 87.7 and mem["capacity_gib"] == capacity / GIB and mem["fits"] is False
    text = (f"real rank: peak reserved 78.41 + outside PyTorch {OUTSIDE_PYTORCH_GIB_MCORE_0_19:.2f} + NCCL buffers "
            f"{nccl:.2f} = {need:.2f} GiB of {capacity / GIB:.2f}: does not fit")
    assert real_rank_text(mem) == text and text in render(p).splitlines()
    assert p["assumptions"][-1] == (
        f"the real rank needs the measured peak reserved + {OUTSIDE_PYTORCH_GIB_MCORE_0_19:.2f} GiB outside PyTorch's "
        "allocator (a process with real process groups, one GPU, by the installed megatron-core: "
        "sftprof/analysis/memory/fit.py; the simulated process holds 0.76 GiB) + the NCCL buffers above, against "
        f"{capacity / GIB:.2f} GiB (nvidia-smi's total less {DRIVER_RESERVED_GIB} GiB)")
    projection_section = next(f for f in SECTIONS if f.__name__ == "_projection")  # the summary's Markdown section
    md = projection_section({"simulation": {"projection": p}})
    assert md[1].endswith(f"; {text}\n") and f"- {p['assumptions'][-1]}" in md
    # on a GPU of more memory it fits; without a capacity there is no verdict
    big = project(plan, 31375.9, 76.72, 8, peak_reserved_gib=78.41, capacity_bytes=smi_capacity_bytes(
        [{"index": 0, "memory_total_mib": 143771.0}]), outside_gib=OUTSIDE_PYTORCH_GIB_MCORE_0_19)
    assert big["memory"]["fits"] is True and real_rank_text(big["memory"]).endswith(": fits")
    unknown = project(plan, 31375.9, 76.72, 8, peak_reserved_gib=78.41, outside_gib=OUTSIDE_PYTORCH_GIB_MCORE_0_19)
    assert unknown["memory"]["fits"] is None and real_rank_text(unknown["memory"]).endswith("GiB, capacity unknown")


def test_groups_across_nodes_take_infiniband():
    cfg = _shipped_cfg()
    cfg["actor"]["backend"] = "megatron:(attn:d8c8|ffn:d1e64)"  # 64 ranks: EP spans 8 nodes, CP one
    cfg["train_dataset"]["batch_size"] = 16
    plan = rank_plan(cfg, QWEN3_30B, parse_allocation_mode(cfg["actor"]["backend"]), 9)
    p = project(plan, 1000.0, None, 8)
    links = {(r["group"], r["collective"]): r["interconnect"] for r in p["rows"]}
    assert links[("ep", "all_to_all")] == "infiniband" and links[("cp", "all_gather")] == "nvlink"
    assert links[("dp_cp", "reduce_scatter")] == "infiniband"
    assert p["memory"]["projected_peak_gib"] is None and p["mfu"] is None
    with pytest.raises(ValueError, match="compute_ms=0"):
        project(plan, 0, None, 8)


def test_overlap_windows_from_trace_regions():
    regions = [{"name": "sftprof/step", "cpu_ms": 900.0, "gpu_ms": 800.0},
               {"name": "sftprof/forward/mb0", "cpu_ms": 100.0, "gpu_ms": 90.0},
               {"name": "sftprof/forward/mb1", "cpu_ms": 110.0, "gpu_ms": 95.5},
               {"name": "sftprof/backward/mb0", "cpu_ms": 300.0, "gpu_ms": 280.0},
               {"name": "sftprof/optimizer_step", "cpu_ms": 20.0, "gpu_ms": 10.0}]
    assert overlap_windows(regions) == {"forward": 185.5, "backward": 280.0}
    cpu = [dict(r, gpu_ms=None) for r in regions]  # a CPU trace: wall time
    assert overlap_windows(cpu) == {"forward": 210.0, "backward": 300.0}
    assert overlap_windows([]) == {}
