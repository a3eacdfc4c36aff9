"""The slice projection (sftprof.analysis.time.slice_projection) on recorded H200 summaries: the factors worked by hand
(the TE trace fixture, 2 layers x 8192 tokens, to the 4-layer 131072-token slice; the Qwen3.5 summary's mixed layer
pattern), a simulated rank's communication at the projected size, bad input; and on recorded H100 summaries of one
simulated rank at 4, 8 and 16 layers, the projection against the measured deeper ranks."""
import copy
import gzip
import json

import pytest

from fixtures import FIXTURE_DIR, postprocessed_trial
from sftprof.analysis.time import slice_projection
from sftprof.analysis.time.projection import main as projection_main
from sftprof.analysis.time.projection import print_and_write
from sftprof.analysis.time.slice_projection import project_slice

QWEN3_5 = FIXTURE_DIR / "h200_te_qwen3_5_cutlass" / "te.profile_summary.json"
SIMULATED = FIXTURE_DIR / "h100_simulated_rank0"
MIB = 1 << 20
# Qwen3-30B-A3B on one rank: a layer holds attention 18,876,672 (q 2048x4096, k and v 2048x512, o 4096x2048, q/k norms
# 2x128, input norm 2048) + MLP norm 2048 + router 2048x128 + experts 128x3x2048x768; embedding and LM head
# 151936x2048 each, final norm 2048. 2 layers: 1,868,573,184 (the trainer's count, bench/NOTES.md sixteenth session).
LAYER_PARAMS = 18_876_672 + 2048 + 262_144 + 603_979_776
OTHER_PARAMS = 2 * 151_936 * 2048 + 2048


@pytest.fixture(scope="module")
def te_slice(tmp_path_factory):
    """The TE kernel trial of tests/fixtures/README.md (2 layers, 8192 tokens, one sequence, step 2)."""
    return postprocessed_trial(tmp_path_factory.mktemp("te_kernel"), "kernel", 2,
                               FIXTURE_DIR / "h200_te_kernel.trace.json.gz",
                               ["profile.fake_seq_len=8192", "train_dataset.batch_size=1", "actor.mb_spec.n_mbs=1"],
                               te=True)


def _rows(p):
    return {(r["part"], r["layer_type"]): r for r in p["rows"]}


def test_factors_by_hand_two_layers_8k_to_four_layers_128k(te_slice):
    assert 2 * LAYER_PARAMS + OTHER_PARAMS == 1_868_573_184
    p = project_slice(te_slice, 4, 131072)
    rows = _rows(p)
    full = "full_attention"
    pairs = 131072 * 131073 / (8192 * 8193)  # causal query-key pairs
    assert rows["attn_core", full]["factor"] == pytest.approx(2 * pairs)
    assert rows["attn_core", full]["layers"] == "2->4"
    for part in ("attn_qkv", "attn_out", "router", "experts", "norm", "dispatch_combine"):
        assert rows[part, full]["factor"] == pytest.approx(2 * 16), part
    assert rows["lm_head_loss", None]["factor"] == pytest.approx(16)
    assert rows["embedding", None]["factor"] == pytest.approx(16)
    assert rows["optimizer", None]["factor"] == pytest.approx((4 * LAYER_PARAMS + OTHER_PARAMS) / 1_868_573_184)
    assert rows["outside_parts", None]["factor"] == 1.0
    for r in p["rows"]:
        assert r["projected_ms"] == pytest.approx(r["measured_ms"] * r["factor"])
    s = te_slice["kernel_traces"][0]["summary"]
    parts = s["parts"]["total_ms"]
    assert p["measured_parts_ms"] == parts and p["source"]["step_ms"] == pytest.approx(324.6407)
    busy = s["gpu"]["busy_ms"] * p["projected_parts_ms"] / parts
    idle = s["step_window"]["wall_ms"] - s["gpu"]["busy_ms"]
    layer_idle = sum(r["idle_ms"] for r in s["host"]["gpu_idle"]["host_wait_by_place"]["rows"]
                     if r["part"] not in ("optimizer", "lm_head_loss", "embedding", "outside_parts"))
    assert p["source"]["layer_idle_ms"] == pytest.approx(layer_idle)
    assert p["projected_step_ms"] == pytest.approx(busy + 2 * layer_idle + idle - layer_idle)
    assert p["gpu_bound_step_ms"] == pytest.approx(busy)
    # the recorded runs of this 4-layer 131072-token slice on the H200 (bench/NOTES.md): 6.10 s (same session) and
    # 5.919 s; projected 6.11 s
    assert abs(p["projected_step_ms"] - 6097.0) / 6097.0 < 0.01
    # the fit check's prediction at 4 x 131072 (measured 82.95 GiB, bench/NOTES.md "The fit check")
    assert p["memory"]["peak_gib"] == pytest.approx(82.75, abs=0.01) and p["memory"]["fits"] is None


def test_layer_pattern_of_qwen3_5():
    """3 gated delta-net layers and 1 full-attention layer to 8 layers (6 + 2) and twice the tokens."""
    summary = json.loads(QWEN3_5.read_text())
    p = project_slice(summary, 8, 65536)
    rows = _rows(p)
    assert rows["linear_attn", "linear_attention"]["layers"] == "3->6"
    assert rows["attn_core", "full_attention"]["layers"] == "1->2"
    # the chunked delta rule: ceil(T / 64) chunks, 1024 against 512; the conv1d per token
    assert rows["linear_attn", "linear_attention"]["factor"] == pytest.approx(4.0)
    assert rows["attn_core", "full_attention"]["factor"] == pytest.approx(2 * 65536 * 65537 / (32768 * 32769))
    assert rows["experts", "linear_attention"]["factor"] == pytest.approx(4.0)
    assert rows["lm_head_loss", None]["factor"] == pytest.approx(2.0)
    # the measured layer 3 (full attention) holds 78.0326 ms of attention core
    assert rows["attn_core", "full_attention"]["measured_ms"] == pytest.approx(78.0326)
    same = project_slice(summary)
    assert same["projected_step_ms"] == pytest.approx(same["source"]["step_ms"])
    assert all(r["factor"] == pytest.approx(1.0) for r in same["rows"])


def test_simulated_rank_takes_the_communication_of_the_projected_size():
    summary = json.loads(QWEN3_5.read_text())
    a = summary["config"]["actor"]
    a["backend"] = "megatron:(attn:c2|ffn:e2)"
    a["simulate"] = {"rank": 0, "gpus_per_node": 8}
    p = project_slice(summary, 8, 65536)
    comm = p["communication"]
    assert p["simulated"] and comm["compute_ms"] == pytest.approx(p["projected_step_ms"])
    assert comm["projected_step_ms"] == pytest.approx(p["projected_step_ms"] + sum(r["exposed_ms"]
                                                                                 for r in comm["rows"]))
    rows = {(r["group"], r["collective"]): r for r in comm["rows"]}
    # K and V of the rank's 32768 tokens, 2 KV heads of 256, bf16, gathered over CP = 2
    assert rows["cp", "all_gather"]["mib_per_call"] == pytest.approx(2 * 32768 * 2 * 256 * 2 * 2 / MIB)
    assert "simulated" in slice_projection.render(p).splitlines()[0]


@pytest.mark.parametrize("layers, tokens, backend, message", [
    (0, None, None, "--layers=0: must be >= 1"),
    (41, None, None, "--layers=41: "),
    (None, 0, None, "--tokens=0: must be >= 1"),
    (None, 32770, "megatron:(attn:c2|ffn:e2)", r"--tokens=32770: .*2\*CP=4"),
])
def test_bad_input(layers, tokens, backend, message):
    summary = json.loads(QWEN3_5.read_text())
    if backend:
        summary["config"]["actor"]["backend"] = backend
    with pytest.raises(ValueError, match=message):
        project_slice(summary, layers, tokens)


def test_cli(capsys, tmp_path):
    assert slice_projection.main([str(QWEN3_5), "--layers", "0"]) == 2
    assert "slice projection: --layers=0: must be >= 1" in capsys.readouterr().err
    no_parts = copy.deepcopy(json.loads(QWEN3_5.read_text()))
    no_parts["kernel_traces"][0]["summary"]["parts"]["source"] = "kernel_name"
    (tmp_path / "profile_summary.json").write_text(json.dumps(no_parts))
    assert slice_projection.main([str(tmp_path)]) == 2
    assert "no GPU time by model part from module regions" in capsys.readouterr().err
    no_gpu = copy.deepcopy(json.loads(QWEN3_5.read_text()))
    no_gpu["kernel_traces"][0]["summary"]["parts"]["total_ms"] = 0.0
    (tmp_path / "cpu_trial").mkdir()
    (tmp_path / "cpu_trial" / "profile_summary.json").write_text(json.dumps(no_gpu))
    assert slice_projection.main([str(tmp_path / "cpu_trial")]) == 2
    assert capsys.readouterr().err == ("slice projection: rank 0's trace has no GPU time (a CPU trial, or no GPU "
                                       "activity in the step): the projection needs a GPU kernel trial\n")
    (tmp_path / "profile_summary.json").unlink()
    assert slice_projection.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"slice projection: {tmp_path} is a RUN_ROOT, not a trial's run dir: pass one of "
                                       "its trials (cpu_trial)\n")
    out = tmp_path / "p.json"
    assert slice_projection.main([str(QWEN3_5), "--layers", "40", "--tokens", "131072", "--json", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("slice projection of rank 0: 4 layers x 32768 tokens -> 40 layers x 131072 tokens (GPU time by "
                     "model part)")
    assert json.loads(out.read_text())["target"] == {"layers": 40, "tokens": 131072}


def _simulated(layers):
    """The kernel trial (step 2) of the shipped layout's rank 0 simulated with ``layers`` layers
    (tests/fixtures/README.md)."""
    with gzip.open(SIMULATED / f"L{layers}.profile_summary.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("layers", [8, 16])
def test_simulated_rank_of_four_layers_projects_the_measured_deeper_rank(layers):
    measured = _simulated(layers)
    p = project_slice(_simulated(4), layers)
    # One step of one rank each: the trials' steps 1 and 2 differ by up to 1 %, the bound here.
    assert p["projected_step_ms"] == pytest.approx(measured["simulation"]["projection"]["compute_ms"], rel=0.01)
    assert p["communication"]["projected_step_ms"] == pytest.approx(
        measured["simulation"]["projection"]["projected_step_ms"], rel=0.01)
    assert p["memory"]["peak_gib"] == pytest.approx(measured["stats"]["max_mem_peak_allocated_gb"], rel=0.01)
    assert "by the trial's megatron-core 0.19.2" in " ".join(p["communication"]["assumptions"])


@pytest.mark.parametrize("edit, member", [
    (lambda s: s.clear(), "config"),
    (lambda s: s["config"]["actor"].pop("backend"), "config.actor.backend"),
    (lambda s: s["kernel_traces"][0]["summary"].update(gpu=None), "summary.gpu.busy_ms"),
    (lambda s: s["kernel_traces"][0]["summary"]["step_window"].pop("wall_ms"), "summary.step_window.wall_ms"),
])
def test_cli_names_the_member_a_damaged_summary_lacks(capsys, tmp_path, edit, member):
    summary = json.loads(QWEN3_5.read_text())
    edit(summary)
    (tmp_path / "profile_summary.json").write_text(json.dumps(summary))
    assert slice_projection.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"slice projection: no member {member}: not a kernel trial's "
                                       "profile_summary.json, or a damaged one\n")


def test_cli_json_and_rank_refused_before_any_output(capsys, tmp_path):
    kept = tmp_path / "p.json"
    kept.write_text("kept")
    for main, cli in ((slice_projection.main, "slice projection"), (projection_main, "projection")):
        assert main([str(QWEN3_5), "--json", str(kept)]) == 2
        assert capsys.readouterr() == ("", f"{cli}: --json {kept}: the file exists (a projection is written to a new "
                                           "file, never over one)\n")
        assert main([str(QWEN3_5), "--json", str(tmp_path / "no" / "p.json")]) == 2
        missing = tmp_path / "no" / "p.json"
        assert capsys.readouterr() == ("", f"{cli}: --json {missing}: no folder {missing.parent}\n")
    assert kept.read_text() == "kept"
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "profile_summary.json").write_text(json.dumps(_simulated(4)))
    assert slice_projection.main([str(tmp_path / "sim"), "--rank", "1"]) == 2
    assert capsys.readouterr().err == ("slice projection: --rank 1: this trial simulated rank 0 alone, the only "
                                       "rank it traced\n")
    assert slice_projection.main([str(QWEN3_5), "--json", ""]) == 2
    assert capsys.readouterr() == ("", "slice projection: --json: an empty path (give the new file's path)\n")
    assert print_and_write("result", {}, str(tmp_path), "cli") == 2  # refused late: the result is printed first
    assert capsys.readouterr() == ("result\n", f"cli: --json {tmp_path}: File exists\n")


def test_cli_a_simulated_summary_damaged_elsewhere_is_its_error(capsys, tmp_path):
    summary = _simulated(4)
    summary["versions"]["megatron_core"] = 19  # not a version string: no readable record
    (tmp_path / "profile_summary.json").write_text(json.dumps(summary))
    assert slice_projection.main([str(tmp_path), "--layers", "8"]) == 0
    assert "the trial having recorded no readable megatron-core version" in capsys.readouterr().out
    del summary["kernel_traces"][0]["summary"]["regions"]
    (tmp_path / "profile_summary.json").write_text(json.dumps(summary))
    assert slice_projection.main([str(tmp_path), "--layers", "8"]) == 2
    assert capsys.readouterr() == ("", f"slice projection: {tmp_path / 'profile_summary.json'}: a damaged "
                                       "profile_summary.json (KeyError: 'regions')\n")
