"""The activation ledger and the recompute planner (issue 46, item 3) on the real Qwen3.5 kernel trial of one H200
(tests/fixtures/h200_te_qwen3_5_cutlass: 4 layers, 32768 tokens, full recompute, TE): its measured forward time by
model part and layer, the predicted peaks of every recompute setting, the choice at two GPU sizes, and the what-if."""
from __future__ import annotations

import pytest
import yaml

from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.memory.estimate import predict_peak
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.analysis.what_if.recompute_plan import DRIVER_RESERVED_GIB, ledger, plan_recompute, recompute_what_if
from sftprof.analysis.schema import read_summary
from sftprof.models.hf import load_hf_config
from tests.fixtures import FIXTURE_DIR

GIB = 2**30
HERE = FIXTURE_DIR / "h200_te_qwen3_5_cutlass"


@pytest.fixture(scope="module")
def trial():
    summary = read_summary(HERE / "te.profile_summary.json")
    cfg = yaml.safe_load((HERE / "config.yaml").read_text())
    parts = summary["kernel_traces"][0]["summary"]["parts"]
    forward = {(layer["layer"], r["part"]): r["forward_ms"] for layer in parts["layers"] for r in layer["rows"]}
    return summary, cfg, forward


def test_ledger_is_what_no_recompute_saves(trial):
    _, cfg, _ = trial
    one, hf = parse_allocation_mode("megatron:d1"), load_hf_config("qwen3_5_35b_a3b", 4)
    rows = ledger(cfg, hf, one, one.rank_coords(0), 32768)
    assert {r["layer"] for r in rows} == {0, 1, 2, 3}
    assert {r["module"] for r in rows} == {"core_attn", "layernorm", "other", "moe", "shared_experts"}
    cfg_none = {**cfg, "actor": {**cfg["actor"], "megatron": {**cfg["actor"]["megatron"],
                                                              "recompute_granularity": "none"}}}
    pred = predict_peak(cfg_none, hf, one, one.rank_coords(0), 32768)
    saved = next(r["bytes"] for r in pred["rows"] if r["category"] == "saved activations")
    assert sum(r["bytes"] for r in rows) == saved


def test_planner_picks_the_least_recompute_that_fits(trial):
    _, cfg, forward = trial
    one, hf = parse_allocation_mode("megatron:d1"), load_hf_config("qwen3_5_35b_a3b", 4)
    plan = plan_recompute(cfg, hf, one, 32768, int(139.94 * GIB), None, forward)
    assert len(plan["options"]) == 1 + 15 + 1 + 3  # none, selective subsets of 4 modules, full uniform, block 1-3
    full = next(o for o in plan["options"] if o["settings"].get("actor.megatron.recompute_method") == "uniform")
    assert full["recompute_ms"] == pytest.approx(sum(forward.values()), abs=1e-3)
    assert plan["choice"]["settings"] == {"actor.megatron.recompute_granularity": "none"}
    assert plan["choice"]["recompute_ms"] == 0.0 and plan["choice"]["fits"]
    small = plan_recompute(cfg, hf, one, 32768, 100 * GIB, None, forward)["choice"]
    assert small["settings"]["actor.megatron.recompute_modules"] == ["core_attn", "layernorm", "moe"]
    parts = ("attn_core", "norm", "router", "dispatch_combine", "experts")
    assert small["recompute_ms"] == pytest.approx(sum(v for (_, p), v in forward.items() if p in parts), abs=1e-3)
    assert small["need_bytes"] <= 100 * GIB < min(o["need_bytes"] for o in plan["options"]
                                                  if o["recompute_ms"] < small["recompute_ms"])
    assert plan_recompute(cfg, hf, one, 32768, 90 * GIB, None, forward)["choice"] is None


def test_recompute_what_if_of_the_kernel_trial(trial):
    summary, cfg, forward = trial
    (w,) = recompute_what_if(summary, cfg, TrialModel(cfg), None)
    measured = sum(r["recompute_ms"] for r in summary["kernel_traces"][0]["summary"]["parts"]["summed"])
    assert w["settings"] == [{"kind": "config", "key": "actor.megatron.recompute_granularity", "value": "none",
                              "current": None}]
    assert w["effect"] == {"metric": "gpu_time", "unit": "ms", "value": round(-measured, 4),
                           "baseline": summary["kernel_traces"][0]["summary"]["parts"]["total_ms"]}
    capacity = 143771 * 2**20 - DRIVER_RESERVED_GIB * GIB
    assert f"of {capacity / GIB:.2f} GiB" in w["assumption"]
