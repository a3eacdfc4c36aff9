"""Every finding names its next step (issue 50): the setting to try, or why there is none. Real H200 summaries (the
TE kernel and memory trials through postprocess_trial, the Qwen3.5 trial's summary as written); the CPU quick
start's LM head + loss finding is checked on a real CPU run in tests/test_e2e_cpu.py."""
import json

import pytest
import yaml

from fixtures import FIXTURE_DIR, postprocessed_trial
from sftprof.analysis.memory.categories import MEMORY_CATEGORIES
from sftprof.analysis.what_if.next_steps import DRIVER_VARIABLES, NO_RULE, with_next_steps
from sftprof.analysis.report.render import render_markdown
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.analysis.what_if.changes import trial_what_if
from sftprof.artifacts import MODEL_PARTS
from sftprof.launch.variables import BY_NAME


@pytest.fixture(scope="module")
def te_trials(tmp_path_factory):
    """The TE kernel and memory trials of tests/fixtures/README.md (8192 tokens, step 2)."""
    root = tmp_path_factory.mktemp("te")
    return (postprocessed_trial(root / "kernel", "kernel", 2, FIXTURE_DIR / "h200_te_kernel.trace.json.gz",
                                ["profile.fake_seq_len=8192"], te=True),
            postprocessed_trial(root / "memory", "memory", 2, FIXTURE_DIR / "h200_te_memory.snapshot.pickle.gz",
                                ["profile.fake_seq_len=8192"], te=True))


def test_every_finding_of_the_te_trials_names_its_next_step(te_trials):
    kernel, memory = te_trials
    assert {f["key"]: f["next_step"] for f in kernel["findings"]} == {
        # the README's example finding: the host launching the experts' GEMMs one at a time
        "gpu idle": "try NVTE_USE_CUTLASS_GROUPED_GEMM=1 (environment): step time -9.0 ms on rank 0 predicted (What "
                    "if: TE's CUTLASS grouped GEMM)",
        "part optimizer": "none per token: the optimizer runs once a step over the parameters, so its share falls "
                          "with more tokens a step (TRAIN_BATCH_SIZE, PROFILE_FAKE_SEQ_LEN)",
        "part lm_head_loss": "try LM_HEAD_LOSS_CHUNK_SIZE=2048: the LM head and the loss in chunks, without the full "
                             "logits; it saves their memory more than time (the GEMMs stay: see Kernel efficiency)",
        "part experts": "try NVTE_USE_CUTLASS_GROUPED_GEMM=1 (environment): step time -9.0 ms on rank 0 predicted "
                        "(What if: TE's CUTLASS grouped GEMM)",
        "recompute": "try actor.megatron.recompute_granularity=selective actor.megatron.recompute_modules=[core_attn]: "
                     "GPU time per step -8.4 ms on rank 0 predicted (What if: selective recompute)"}
    already = ("none: precision-aware optimizer is not proposed: the trial already has "
               "actor.megatron.use_precision_aware_optimizer=true, actor.megatron.main_grads_dtype=bfloat16")
    assert {f["key"]: f["next_step"] for f in memory["findings"]} == {
        "memory optimizer": already, "memory gradients": already,
        "memory parameters": "none on this layout: the weights of the rank; a layout over more GPUs (actor.backend: "
                             "TP, CP or EP) divides it",
        "transient": "try LM_HEAD_LOSS_CHUNK_SIZE=2048: peak allocated -1.74 GiB on rank 0 predicted (What if: "
                     "chunked LM head)"}
    md = render_markdown(kernel)
    assert ("\n   - next step: try NVTE_USE_CUTLASS_GROUPED_GEMM=1 (environment): step time -9.0 ms on rank 0 "
            "predicted (What if: TE's CUTLASS grouped GEMM)\n") in md
    # a next step given word for word by an earlier finding is given once: the later finding points to it
    assert [f["key"] for f in kernel["findings"]] == ["gpu idle", "part optimizer", "part lm_head_loss",
                                                      "part experts", "recompute"]
    assert md.count("next step: try NVTE_USE_CUTLASS_GROUPED_GEMM=1") == 1
    assert ("\n4. rank 0: expert GEMMs (routed) 20.4 % of GPU time (19.2 ms, of which recompute 4.9 ms) at 337 "
            "TFLOP/s recompute / 325 TFLOP/s backward ([details](#time-by-model-part-rank-0))\n"
            "   - next step: as finding 1's\n5. ") in md


def test_the_qwen3_5_trials_launch_bound_experts_point_to_cutlass_then_not():
    """The Qwen3.5 slice (tests/fixtures/README.md): its GPU-idle finding names TE's CUTLASS grouped GEMM with the
    predicted saving; the trial that ran with it is told why it is not proposed again."""
    d = FIXTURE_DIR / "h200_te_qwen3_5_cutlass"
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    steps = {}
    for name in ("te", "te_cutlass"):
        s = json.loads((d / f"{name}.profile_summary.json").read_text())
        found, skipped = trial_what_if(s, cfg, TrialModel(cfg))
        steps[name] = {f["key"]: f["next_step"] for f in with_next_steps(s["findings"], found, skipped, s, cfg)}
    assert steps["te"]["gpu idle"] == ("try NVTE_USE_CUTLASS_GROUPED_GEMM=1 (environment): step time -428.9 ms on rank "
                                       "0 predicted (What if: TE's CUTLASS grouped GEMM)")
    assert steps["te_cutlass"]["gpu idle"] == (
        "none: TE's CUTLASS grouped GEMM is not proposed: the trial already has NVTE_USE_CUTLASS_GROUPED_GEMM=1 "
        "(environment)")
    assert steps["te"]["part linear_attn"] == (
        "none on this layout: this part is the model's own work at this size; a layout over more GPUs (actor.backend: "
        "TP, CP or EP) divides it")


def test_every_lever_has_a_rule():
    """No finding the findings module makes is left with the generic line: each key, on a GPU and a CPU summary."""
    keys = (["compile", "recompute", "exposed communication", "gpu idle", "exposed imbalance", "memory window peak",
             "transient"] + [f"part {p}" for p in MODEL_PARTS + ("optimizer", "outside_parts", "comm_outside",
                                                                  "kernel:gemm")]
            + [f"memory {c}" for c in tuple(MEMORY_CATEGORIES) + ("allocator_slack",)])
    for device, backend in (("cuda", "megatron:d1"), ("cpu", "fsdp:d2")):
        summary = {"profile_step": 1, "completion": {"device": device}}
        cfg = {"actor": {"backend": backend}, "memory_profiler": {"max_entries": 100000}}
        found = with_next_steps([{"key": k, "text": "", "section": "", "weight": 0.1} for k in keys], [], [], summary,
                                cfg)
        assert [f["next_step"] for f in found if f["next_step"] == NO_RULE or
                not f["next_step"].startswith(("try ", "none"))] == [], device
    assert with_next_steps([{"key": "compile", "text": "", "section": "", "weight": 1.0}], [], [],
                           {"profile_step": 1}, None)[0]["next_step"] == \
        "try PROFILE_STEPS=2 (a later step, after the compilation; TOTAL_STEPS above it)"


def test_a_trial_with_the_chunked_lm_head_is_told_it_has_it():
    """The README's B run (LM_HEAD_LOSS_CHUNK_SIZE=256, CPU): its LM head + loss finding is not sent to the setting
    it has; on a GPU the rate of what is left is in Kernel efficiency."""
    finding = [{"key": "part lm_head_loss", "text": "", "section": "", "weight": 0.8}]
    cfg = {"actor": {"backend": "fsdp:d2", "loss": {"lm_head_loss_chunk_size": 256}}}
    (cpu,) = with_next_steps(finding, [], [], {"profile_step": 1, "completion": {"device": "cpu"}}, cfg)
    assert cpu["next_step"] == ("none: the chunked LM-head loss is on (LM_HEAD_LOSS_CHUNK_SIZE=256); what is left is "
                                "the LM head's matrix products over the vocabulary, the model's own work")
    (gpu,) = with_next_steps(finding, [], [], {"profile_step": 1, "completion": {"device": "cuda"}}, cfg)
    assert gpu["next_step"] == cpu["next_step"] + " (Kernel efficiency gives their rate)"


def test_driver_variables_are_the_drivers():
    assert {k: v for k, v in DRIVER_VARIABLES.items() if BY_NAME[v].keys != (k,)} == {}
