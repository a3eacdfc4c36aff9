"""The summary's findings (one per lever, heaviest first) and the cross-rank split of exposed communication."""
from sftprof.analysis.report import findings as fnd
from sftprof.analysis.time.rank_table import exposed_by_group, work_spread


def _kernel_summary(attn_ms, exposed_ms, idle_ms, host_wait_ms, sync_ms):
    total = 1000.0
    return {
        "parts": {"total_ms": total, "summed": [
            {"part": "attn_core", "label": "attention core", "total_ms": attn_ms, "share_pct": attn_ms / 10,
             "recompute_ms": 100.0},
            {"part": "moe_dispatch", "label": "MoE dispatch/combine", "total_ms": 50.0, "share_pct": 5.0,
             "recompute_ms": 0.0}]},
        "efficiency": {"rows": [{"kind": "attention", "part": "attention core", "phase": "forward", "tflop": 0.6,
                                 "gpu_ms": 1.0, "tflops_per_s": 600.0},
                                {"kind": "attention", "part": "attention core", "phase": "backward", "tflop": 0.88,
                                 "gpu_ms": 2.0, "tflops_per_s": 440.0}]},
        "collectives": {"exposed_by_group_ms": {"EP": exposed_ms, "CP": 1.0}},
        "communication": {"exposed_ms": exposed_ms + 1.0},
        "host": {"gpu_idle": {"idle_ms": idle_ms, "host_wait_ms": host_wait_ms, "host_wait_by_place": {
                     "rows": [{"label": "LM head + loss", "phase": "backward", "idle_ms": host_wait_ms - 20.0,
                               "launched_under": "_VocabParallelLogprobsBackward", "activities": 6145,
                               "mean_activity_us": 4.45, "gaps": 6145, "mean_gap_us": 26.8, "after_blocking_pct": 0.0,
                               "kind": "launch-bound"},
                              {"label": "MoE router", "phase": "forward", "idle_ms": 3.0, "launched_under": None,
                               "activities": 20, "mean_activity_us": 30.0, "gaps": 5, "mean_gap_us": 600.0, "after_blocking_pct": 80.0,
                               "kind": "after blocking calls"}],
                     "after_blocking_ms": 2.4, "after_blocking_by_op": {"aten::nonzero": 2.4}}},
                 "sync": {"total_ms": sync_ms},  # the host's time in blocking calls: no finding by itself
                 "top_self": [{"name": "aten::nonzero", "sync_wait_ms": sync_ms - 10.0},
                              {"name": "aten::add", "sync_wait_ms": 0.0}]},
        "step_window": {"wall_ms": 1100.0},
    }


def test_one_finding_per_lever_over_ranks():
    found = []
    for rank, attn in ((0, 700.0), (1, 720.0)):
        f = fnd.kernel_findings(rank, _kernel_summary(attn, 80.0 + rank, 66.0, 60.0, 900.0))
        found += f
    top = fnd.top(found)
    assert [f["text"] for f in top] == [
        "rank 1: attention core 72.0 % of GPU time (720.0 ms, of which recompute 100.0 ms) at 600 TFLOP/s forward / "
        "440 TFLOP/s backward (also on rank 0)",
        "rank 0: activation recompute re-runs 100.0 ms of forward work (10.0 % of GPU time) (also on rank 1)",
        "rank 1: exposed communication 82.0 ms; largest exposed group EP 81.0 ms (also on rank 0)",
        # the router's 3.0 ms is under a tenth of the host wait: not named, but the idle after its sync is
        "rank 0: GPU idle 66.0 ms (6.0 % of the step's wall time), 60.0 ms of it waiting for the host to launch work: "
        "40.0 ms in LM head + loss, phase backward, under _VocabParallelLogprobsBackward (launch-bound: 6145 GPU "
        "activities averaging 4.5 µs, 6145 gaps averaging 26.8 µs); 2.4 ms of the wait follows blocking CUDA calls (aten::nonzero 2.4 ms) "
        "(also on rank 1)",
        "rank 0: MoE dispatch/combine 5.0 % of GPU time (50.0 ms) (also on rank 1)"]
    assert [f["section"] for f in top][2:4] == ["#communication-by-process-group-rank-1", "#host-rank-0"]


def test_exposed_communication_split_by_group_between_ranks():
    # rank 0 / 1 of the 2x H200 blocks run (bench/NOTES.md), three of its groups; totals as the ranks measured them
    ex = exposed_by_group({0: {"CP": 64.68, "EP": 143.524, "WORLD": 0.133}, 1: {"CP": 13.052, "EP": 125.828,
                                                                                "WORLD": 0.585}}, {0: 246.217, 1: 146.201})
    assert (ex["max_rank"], ex["min_rank"], ex["extra_ms"]) == (0, 1, 100.016)
    assert ex["extra_by_group"] == [("CP", 51.628), ("EP", 17.696), ("WORLD", -0.452)]
    assert ex["groups"][0] == {"group": "CP", "ms": {0: 64.68, 1: 13.052}}
    assert exposed_by_group({0: {"CP": 1.0}}, {0: 1.0}) is None


def test_the_rank_with_more_exposed_communication_is_a_finding_naming_the_group():
    # the 2x H200 masked-CP run (bench/NOTES.md): rank 0 waits at every collective for rank 1
    groups = {0: {"CP": 235.258, "DP-CP": 85.842, "EP": 141.226}, 1: {"CP": 7.422, "DP-CP": 2.658, "EP": 123.619}}
    totals = {0: 465.8, 1: 135.7}
    traces = [{"rank": r, "summary": dict(_kernel_summary(700.0, 0.0, 0.0, 0.0, 0.0), communication={"exposed_ms": totals[r]},
                                          collectives={"exposed_by_group_ms": groups[r]})} for r in (0, 1)]
    summary = {"kernel_traces": traces, "ranks": {"exposed_by_group": exposed_by_group(groups, totals)}}
    found = fnd.trial_findings(summary)
    assert [f["text"] for f in found if f["section"] == "#ranks"] == [
        "rank 0 has 330.1 ms more exposed communication than rank 1 (465.8 vs 135.7 ms); the largest per-group "
        "difference is CP, +227.8 ms"]
    # with the ranks' work spread, the finding names the waited-for rank's (1's) longest extra work: its routed
    # experts of layer 3, not rank 0's larger attention spread (rank 0's longer work does not make rank 0 wait)
    summary["ranks"]["work_spread"] = work_spread({0: [["experts", 3, "backward", 12.765],
                                                       ["attn_core", 3, "backward", 332.009]],
                                                   1: [["experts", 3, "backward", 21.571],
                                                          ["attn_core", 3, "backward", 322.892]]})
    found = fnd.trial_findings(summary)
    assert [f["text"] for f in found if f["section"] == "#ranks"] == [
        "rank 0 has 330.1 ms more exposed communication than rank 1 (465.8 vs 135.7 ms); the largest per-group "
        "difference is CP, +227.8 ms; rank 1's own work runs longest against another rank in expert GEMMs (routed), "
        "layer 3 backward: 8.8 ms more than rank 0"]
    summary["ranks"]["work_spread"] = work_spread({0: [["attn_core", 3, "backward", 332.009]],
                                                      1: [["attn_core", 3, "backward", 322.892]]})
    found = fnd.trial_findings(summary)  # only rank 0 (the waiting rank) ran longer: no work named
    assert [f["text"] for f in found if f["section"] == "#ranks"][0].endswith("the largest per-group difference is "
                                                                              "CP, +227.8 ms")


def test_a_gap_no_group_accounts_for_is_not_attributed_to_one():
    """Groups that overlap each other on rank 0 but not on rank 1: the same exposed time per group, 2.0 ms apart in
    total. No ~0 ms group is named as the cause, and the Ranks text renders no empty list."""
    from sftprof.analysis.report.render import _ranks

    groups = {0: {"CP": 3.0, "EP": 5.0}, 1: {"CP": 3.02, "EP": 5.0}}
    totals = {0: 6.0, 1: 8.0}
    ex = exposed_by_group(groups, totals)
    assert (ex["max_rank"], ex["min_rank"], ex["extra_ms"], ex["extra_by_group"]) == (1, 0, 2.0, [("CP", 0.02),
                                                                                                  ("EP", 0.0)])
    assert fnd.exposed_gap_cause(ex) == (None, 0.2)
    traces = [{"rank": r, "summary": dict(_kernel_summary(700.0, 0.0, 0.0, 0.0, 0.0),
                                          communication={"exposed_ms": totals[r]},
                                          collectives={"exposed_by_group_ms": groups[r]})} for r in (0, 1)]
    found = fnd.trial_findings({"kernel_traces": traces, "ranks": {"exposed_by_group": ex}})
    assert [f["text"] for f in found if f["section"] == "#ranks"] == [
        "rank 1 has 2.0 ms more exposed communication than rank 0 (8.0 vs 6.0 ms); no process group accounts for it "
        "(none differs by 0.20 ms or more), so it is not attributed to a group"]
    md = "".join(_ranks({"ranks": {"rows": [{"rank": 0, "coords": None}, {"rank": 1, "coords": None}],
                                   "imbalance": {}, "exposed_by_group": ex}}))
    assert ("\nRank 1 has 2.0 ms more exposed communication than rank 0; no process group's exposed time differs "
            "between them by 0.05 ms or more, so the difference is not attributed to a group. A collective's") in md
    # a group under a tenth of the gap is not named either, though it differs by more than 0.05 ms
    ex = exposed_by_group({0: {"CP": 3.0}, 1: {"CP": 3.1}}, {0: 6.0, 1: 8.0})
    assert fnd.exposed_gap_cause(ex) == (None, 0.2)
    assert fnd.exposed_gap_cause(exposed_by_group({0: {"CP": 3.0}, 1: {"CP": 3.2}}, {0: 6.0, 1: 8.0})) == (
        ("CP", 0.2), 0.2)


def test_gated_delta_net_part_carries_the_delta_rules_rates():
    s = _kernel_summary(700.0, 0.0, 0.0, 0.0, 0.0)
    s["parts"]["summed"][0] = {"part": "linear_attn", "label": "linear attention (gated delta net)", "total_ms": 300.0,
                               "share_pct": 30.0, "recompute_ms": 0.0}
    label = "linear attention (gated delta net)"
    s["efficiency"]["rows"] += [{"kind": "linear attention", "part": label, "phase": "forward", "tflop": 0.1214,
                                 "gpu_ms": 1.0, "tflops_per_s": 121.4},
                                {"kind": "linear attention", "part": label, "phase": "backward", "tflop": 0.1772,
                                 "gpu_ms": 2.0, "tflops_per_s": 88.6},
                                {"kind": "GEMM", "part": label, "phase": "forward", "tflop": 0.9, "gpu_ms": 1.0,
                                 "tflops_per_s": 900.0}]  # the layer's projections: not the delta rule's rate
    found = fnd.kernel_findings(0, s)
    assert found[0]["text"] == ("rank 0: linear attention (gated delta net) 30.0 % of GPU time (300.0 ms), delta rule "
                                "at 121 TFLOP/s forward / 89 TFLOP/s backward")
