"""A trace without GPU activity (a CPU run): CPU op self time by model part, and the heaviest op, on a trace whose
every number is known (the real CPU traces of the tiny preset are checked in tests/test_e2e_cpu.py)."""
import json

import pytest

from sftprof.analysis.report import findings as fnd
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.analysis.what_if.changes import trial_what_if
from sftprof.analysis.what_if.next_steps import with_next_steps
from sftprof.launch.plan_types import Trial
from sftprof.launch.what_ifs import choose


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _flow(ph, ts, tid, fid=7):
    return {"ph": ph, "cat": "fwdbwd", "name": "fwdbwd", "id": fid, "ts": ts, "pid": 1, "tid": tid,
            **({"bp": "e"} if ph == "f" else {})}


def _cpu_step() -> list[dict]:
    """One step of 1000 us: a QKV projection (linear 20 us own + mm 60 us), the LM head and loss (an autograd
    Function: 100 us own + exp 280 us), its backward on the autograd thread (2 + 108 + mul 90 us), the optimizer
    (add_ 30 us) and an op outside every part (zeros 10 us)."""
    return [
        _op("sftprof/step", 0, 1000, cat="user_annotation"),
        _op("sftprof.module/attn_qkv/L0", 10, 100, cat="user_annotation"),
        _op("aten::linear", 20, 80), _op("aten::mm", 30, 60),
        _op("aten::zeros", 150, 10),
        _op("sftprof.module/lm_head_loss", 200, 400, cat="user_annotation"),
        _op("_VocabParallelLogprobs", 210, 380), _flow("s", 210, 1), _op("aten::exp", 220, 280),
        _op("autograd::engine::evaluate_function: _VocabParallelLogprobsBackward", 700, 200, tid=2),
        _op("_VocabParallelLogprobsBackward", 701, 198, tid=2), _flow("f", 701, 2), _op("aten::mul", 710, 90, tid=2),
        _op("sftprof/optimizer_step", 920, 70, cat="user_annotation"), _op("aten::add_", 930, 30),
    ]


def _summary(events):
    a = KernelTraceAnalyzer()
    for ev in events:
        a.add(ev)
    return a.summary()


def test_cpu_op_self_time_by_model_part_and_the_heaviest_op():
    s = _summary(_cpu_step())
    parts = s["cpu_parts"]
    assert (parts["source"], parts["total_ms"], parts["outside_window"]) == ("module_regions", 0.7, 0)
    rows = {r["part"]: (r["forward_ms"], r["backward_ms"], r["optimizer_ms"], r["other_ms"], r["total_ms"],
                        r["share_pct"]) for r in parts["summed"]}
    assert rows == {"attn_qkv": (0.08, 0.0, 0.0, 0.0, 0.08, 11.429),
                    "lm_head_loss": (0.38, 0.2, 0.0, 0.0, 0.58, 82.857),
                    "optimizer": (0.0, 0.0, 0.03, 0.0, 0.03, 4.286),
                    "outside_parts": (0.0, 0.0, 0.0, 0.01, 0.01, 1.429)}
    assert [x["layer"] for x in parts["layers"]] == [0]
    assert s["heaviest_op"] == {"name": "_VocabParallelLogprobs", "calls": 1, "inclusive_ms": 0.38,
                                "backward": "_VocabParallelLogprobsBackward", "backward_ms": 0.198,
                                "part": "lm_head_loss", "label": "LM head + loss"}
    assert s["parts"]["total_ms"] == 0.0  # no GPU activity: the GPU table stays empty
    found = fnd.kernel_findings(0, s)
    assert [f["text"] for f in found] == [
        "rank 0: heaviest op _VocabParallelLogprobs in LM head + loss: 380.0 µs of the 1.0 ms step (1 call, with the "
        "ops it calls); its backward _VocabParallelLogprobsBackward 198.0 µs more",
        "rank 0: LM head + loss 82.9 % of CPU op time (0.6 ms)",
        "rank 0: attention QKV projection 11.4 % of CPU op time (0.1 ms)",
        "rank 0: optimizer 4.3 % of CPU op time (0.0 ms)"]
    assert {f["section"] for f in found} == {"#time-by-model-part-rank-0"}
    assert found[0]["weight"] == pytest.approx(0.38)


def test_a_cpu_runs_lm_head_finding_and_its_what_if_say_the_same(tmp_path):
    """The CPU quick start's LM head + loss: no what-if (CPU op time predicts no effect for the chunked LM head), and
    the finding's next step, the summary's What if section and TRY_WHAT_IFS's line each say so, with the setting."""
    s = _summary(_cpu_step())
    summary = {"kernel_traces": [{"rank": 0, "summary": s}], "completion": {"device": "cpu"}, "profile_step": 1}
    cfg = {"actor": {"backend": "fsdp:d2", "loss": {"lm_head_loss_chunk_size": 0}}}
    why = ("a CPU run: its CPU op time gives no predicted effect for the chunked LM head (its what-if predicts a GPU "
           "memory trial's peak without the logits), so TRY_WHAT_IFS does not try it: compare a run with "
           "LM_HEAD_LOSS_CHUNK_SIZE=256 against this one (README, Proving a change)")
    assert trial_what_if(summary, cfg, TrialModel(None)) == (
        [], [{"key": "chunked_lm_head", "label": "chunked LM head", "rank": 0, "reason": why}])
    found, skipped = trial_what_if(summary, cfg, TrialModel(None))
    steps = with_next_steps(fnd.kernel_findings(0, s), found, skipped, summary, cfg)
    assert {f["key"]: f["next_step"] for f in steps}["part lm_head_loss"] == (
        "try LM_HEAD_LOSS_CHUNK_SIZE=256: the LM head and the loss in chunks of 256 tokens, without the full logits "
        "and their log-softmax; not a what-if: " + why)
    (tmp_path / "profile_summary.json").write_text(json.dumps(
        {"status": "ok", "what_if": found, "what_if_skipped": skipped}))
    trial = Trial("k1", "kernel", 1, tmp_path, tmp_path, ["--config", "x.yaml"])
    assert choose([trial], ["chunked_lm_head"])[1][1:] == [f"not proposed: chunked_lm_head ({why})"]
    # on it already, or a GPU run (GPU time: the memory trial's rule): no such line
    on = {"actor": {"backend": "fsdp:d2", "loss": {"lm_head_loss_chunk_size": 256}}}
    assert trial_what_if(summary, on, TrialModel(None)) == ([], [])
    gpu = {**s, "gpu": {**s["gpu"], "activities": 3}}
    assert trial_what_if({"kernel_traces": [{"rank": 0, "summary": gpu}]}, cfg, TrialModel(None)) == ([], [])


def test_no_model_part_ranges_no_cpu_table_and_a_container_is_not_the_heaviest_op():
    # without ranges there is nothing to place ops by; an op around a model part (a checkpoint wrapper) is a
    # container of parts, not the heaviest op
    plain = [e for e in _cpu_step() if not e["name"].startswith("sftprof.module/")]
    s = _summary(plain)
    assert s["cpu_parts"] is None and s["heaviest_op"]["name"] == "_VocabParallelLogprobs"
    assert s["heaviest_op"]["part"] is None
    wrapped = _cpu_step() + [_op("CheckpointFunction", 5, 600)]
    assert _summary(wrapped)["heaviest_op"]["name"] == "_VocabParallelLogprobs"
