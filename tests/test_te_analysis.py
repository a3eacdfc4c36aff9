"""The analysis of a Transformer Engine run, on the real TE fixtures (tests/fixtures/README.md): the driver's kernel
and memory trials of the shipped YAML cut to 2 layers, 8192 tokens, ``megatron:d1``, TE 2.20.2 on one H200,
precision-aware optimizer with bf16 main grads (TE's FusedAdam), full recompute, step 2.

FLOPs are checked against hand counts from the model's shape (Qwen3-30B-A3B: hidden 2048, 32 query heads of
128, 128 experts top-8 of FFN 768), not against the code's own formulas.
"""
import gzip
import json

import pytest

from fixtures import FIXTURE_DIR
from sftprof.analysis.report.findings import kernel_findings
from sftprof.analysis.memory.snapshot import analyze_snapshot
from sftprof.analysis.memory.safe_pickle import safe_load_file
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer

S, H, HEADS, D, LAYERS, TOPK, FFN = 8192, 2048, 32, 128, 2, 8, 768


@pytest.fixture(scope="module")
def summary():
    with gzip.open(FIXTURE_DIR / "h200_te_kernel.trace.json.gz", "rt") as f:
        data = json.load(f)
    a = KernelTraceAnalyzer({k: v for k, v in data.items() if k != "traceEvents"})
    for ev in data["traceEvents"]:
        a.add(ev)
    return a.summary()


def _rows(summary, part):
    return {r["phase"]: r for r in summary["efficiency"]["rows"] if r["part"] == part and r["dtype"] == "BFloat16"}


def test_te_fused_attention_flops_match_the_hand_count(summary):
    rows = _rows(summary, "attention core")
    assert sorted(rows) == ["backward", "forward", "recompute"]
    causal_fwd = LAYERS * 4 * HEADS * D * S * (S + 1) / 2  # QK^T and PV over the causal pairs, per layer
    assert rows["forward"]["tflop"] == pytest.approx(causal_fwd / 1e12, rel=1e-5)
    assert rows["recompute"]["tflop"] == pytest.approx(causal_fwd / 1e12, rel=1e-5)
    assert rows["backward"]["tflop"] == pytest.approx(2 * causal_fwd / 1e12, rel=1e-5)  # the model-FLOPs convention
    assert [rows[p]["calls"] for p in ("forward", "recompute", "backward")] == [2, 2, 2]
    assert 300 < rows["forward"]["tflops_per_s"] < 989.4  # a rate, below the H200's dense bf16 peak


def test_te_grouped_gemm_flops_match_the_hand_count(summary):
    rows = _rows(summary, "expert GEMMs (routed)")
    # The first forward runs under full recompute without autograd: TE calls its Function's forward directly, so
    # there is no op record to count; the recompute and the backward are counted.
    assert sorted(rows) == ["backward", "recompute"]
    routed = S * TOPK
    per_layer = 2 * routed * H * 2 * FFN + 2 * routed * FFN * H  # fc1 [H -> 2F] (SwiGLU) and fc2 [F -> H]
    assert rows["recompute"]["tflop"] == pytest.approx(LAYERS * per_layer / 1e12, rel=1e-5)
    assert rows["backward"]["tflop"] == pytest.approx(2 * LAYERS * per_layer / 1e12, rel=1e-5)
    qkv = _rows(summary, "attention QKV projection")
    assert qkv["recompute"]["tflop"] == pytest.approx(LAYERS * 2 * S * H * (HEADS + 2 * 4) * D / 1e12, rel=1e-5)


def test_te_findings_carry_rates(summary):
    found = kernel_findings(0, summary)
    text = {f["key"]: f["text"] for f in found}
    experts = text["part experts"]
    assert " TFLOP/s recompute / " in experts and experts.endswith(" TFLOP/s backward")


def test_te_memory_categories_and_fused_adam_state():
    s = analyze_snapshot(safe_load_file(FIXTURE_DIR / "h200_te_memory.snapshot.pickle.gz"))
    cats = {r["category"]: r["bytes"] for r in s["categories_at_peak"]}
    # 1,868,573,184 parameters on the rank (2 layers); TE FusedAdam with megatron-core's store_param_remainders:
    # fp32 exp_avg and exp_avg_sq (8 B) plus the 16-bit remainder of each fp32 main param (2 B).
    params = 1_868_573_184
    assert cats["optimizer"] == pytest.approx(10 * params, rel=1e-3)
    assert cats["parameters"] == pytest.approx(2 * params, rel=1e-3)
    assert cats["gradients"] == pytest.approx(2 * params, rel=1e-3)  # bf16 main grads
    sites = {r["site"] for r in s["top_sites"]}
    assert any("transformer_engine/pytorch/optimizers/fused_adam.py" in x for x in sites)
    assert cats["workspaces"] > 0  # TE's cuBLAS workspaces (get_cublas_workspace)
