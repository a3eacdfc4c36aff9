"""Out-of-memory triage (issue 46) on a snapshot derived from the real h200_mcore one (tests/fixtures/README.md):
the failed request, what the GPU held, what was alive by category, the phase and site of the failing allocation,
the smallest change that fits as the summary's first finding and a what-if."""
from __future__ import annotations

import gzip
import json
import math
import shutil

import pytest

from sftprof import compat
from sftprof.analysis.memory.fit import PREDICTION_UNDER_SHARE
from sftprof.analysis.memory.oom import oom_triage
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.analysis.what_if.changes import LABELS
from sftprof.analysis.memory.safe_pickle import safe_load
from sftprof.analysis.summary import postprocess_trial
from tests.fixtures import FIXTURE_DIR, OOM_CAPACITY, OOM_FREE, oom_log_dir

GIB = 2**30


def _real_state():
    snap = safe_load(gzip.open(FIXTURE_DIR / "h200_mcore_qwen3moe_4l_8k.snapshot.pickle.gz").read())
    alive = sum(b["size"] for s in snap["segments"] for b in s["blocks"]
                if b["state"] in ("active_allocated", "active_pending_free"))
    return alive, sum(s["total_size"] for s in snap["segments"])


def test_triage_from_the_snapshot_alone(tmp_path):
    """Without the record (a kernel trial's state, or a lost record): request and free from the ``oom`` entry,
    allocated and reserved from the segments; capacity unknown, so no outside figure and no change proposed."""
    log = oom_log_dir(tmp_path, record=False)
    t = oom_triage(str(log), None, TrialModel(None), None, None)
    allocated, reserved = _real_state()
    assert (t["requested_bytes"], t["free_bytes"], t["allocated_bytes"]) == (4978638848, OOM_FREE, allocated)
    assert t["reserved_unallocated_bytes"] == reserved - allocated
    assert (t["capacity_bytes"], t["outside_pytorch_bytes"], t["fits"]) == (None, None, [])
    assert t["site"] == "probe/probe_mcore.py:85 <module>" and t["phase"] is None and t["history"]
    assert sum(r["bytes"] for r in t["live"]) == allocated


def test_failed_trial_summary_leads_with_the_oom_and_its_fitting_change(tmp_path):
    log = oom_log_dir(tmp_path)
    summary, _ = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 0)
    t = summary["oom"]
    allocated, reserved = _real_state()
    assert t["outside_pytorch_bytes"] == OOM_CAPACITY - OOM_FREE - reserved
    assert t["phase"] == "sftprof/forward/mb0"
    live = {r["category"]: r["bytes"] for r in t["live"]}
    # the probe ran one forward and backward with its weights allocated before the history began
    assert sum(live.values()) == allocated and sorted(live) == ["activations", "before_window"]
    # the shipped YAML's 4 layers hold 40.6 GiB of weights, gradients and optimizer state: more than the GPU, so only
    # fewer layers fit: one layer alone, before any change of the allocator or the loss
    assert t["predicted"]["peak_bytes"] > OOM_CAPACITY
    first = t["fits"][0]
    assert [c["settings"] for c in t["fits"]] == [{"actor.num_layers": 1}]
    assert first["need_bytes"] <= OOM_CAPACITY
    finding = summary["findings"][0]
    assert finding["key"] == "out of memory" and finding["text"].startswith(
        "rank 0 ran out of CUDA memory in sftprof/forward/mb0 at probe/probe_mcore.py:85 <module>: 4.64 GiB requested "
        "of a 32.00 GiB GPU holding ")
    assert "; smallest change that fits: actor.num_layers=1, predicted peak" in finding["text"]
    w = summary["what_if"][0]
    assert (w["key"], w["label"], w["effect"]["metric"]) == ("fit_oom", LABELS["fit_oom"], "peak_allocated")
    assert w["effect"]["baseline"] == round((allocated + 4978638848) / GIB, 4)
    assert w["settings"] == [{"kind": "config", "key": "actor.num_layers", "value": 1, "current": None}]
    from sftprof.launch.summaries import top_finding

    assert top_finding(summary) == ("out of memory: 4.64 GiB requested in sftprof/forward/mb0 (rank 0); fits with "
                                    "actor.num_layers=1")
    md = (tmp_path / "run" / "profile_summary.md").read_text()
    assert "## Out of memory\n" in md and "| settings that fit (smallest first) |" in md


def test_fit_oom_is_chosen_from_the_failed_trial_and_judged_on_the_peak_it_reached(tmp_path):
    """``TRY_WHAT_IFS`` takes a failed trial's ``fit_oom`` (and no other what-if of it); the outcome sets the what-if
    trial's peak against what the failed step asked for."""
    from sftprof.analysis.what_if.outcome import HELD, outcome
    from sftprof.launch.plan_types import Trial
    from sftprof.launch.what_ifs import choose

    log = oom_log_dir(tmp_path)
    summary, _ = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 0)
    source = Trial("t", "memory", 0, tmp_path / "run", log, ["--config", "x.yaml"])
    chosen, lines = choose([source], 2)
    assert [w["key"] for _, w in chosen] == ["fit_oom"]
    assert lines == ["TRY_WHAT_IFS=2: 1 what-if(s) proposed; trying 1: fit the GPU after an out-of-memory error "
                     "(actor.num_layers=1) of the memory trial of step 0"]
    w = chosen[0][1]
    predicted_peak = w["effect"]["baseline"] + w["effect"]["value"]
    b = {"stats": {"max_mem_peak_allocated_gb": predicted_peak + 0.1}}
    o = outcome(w, summary, b, ([], []))
    assert o.measured == pytest.approx(w["effect"]["value"] + 0.1) and (o.samples, o.verdict) == ("exact", HELD)
    assert outcome(w, summary, {"stats": {}}, ([], [])).measured is None  # the what-if trial failed too


def _h100_oom_log(tmp_path):
    """A copy of the ``h100_oom_kernel`` log dir with its snapshot unpacked, as the trial left it."""
    log = tmp_path / "log"
    shutil.copytree(FIXTURE_DIR / "h100_oom_kernel", log)
    packed = next((log / "memory_snapshots" / "oom").glob("*.pickle.gz"))
    packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
    packed.unlink()
    return log


def test_recorded_oom_of_a_kernel_trial_on_an_h100(tmp_path):
    """The real out-of-memory failure ``bench/record_oom_snapshot.py`` recorded on one H100 80 GB (tests/fixtures/
    README.md, ``h100_oom_kernel``): the README's slice with the full logits, a kernel trial (no allocator history),
    the logits' 37.09 GiB request in the LM head forward of step 1. The triage reads the record and the snapshot as
    the trial left them."""
    summary, _ = postprocess_trial(str(_h100_oom_log(tmp_path)), str(tmp_path / "run"), "kernel", 1)
    t = summary["oom"]
    assert (t["requested_bytes"], t["capacity_bytes"], t["free_bytes"]) == (39829110784, 85017493504, 17777688576)
    assert (t["allocated_bytes"], t["reserved_unallocated_bytes"]) == (48067594752, 9595696640)
    assert t["outside_pytorch_bytes"] == 85017493504 - 17777688576 - 48067594752 - 9595696640
    assert (t["phase"], t["site"]) == ("sftprof/forward/mb0", "megatron/core/tensor_parallel/layers.py:576 forward")
    assert t["live"] == [{"category": "before_window", "bytes": 48067594752}]
    assert t["fits"][0]["settings"] == {"env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                        "actor.loss.lm_head_loss_chunk_size": 2048}
    assert summary["findings"][0]["text"].startswith(
        "rank 0 ran out of CUDA memory in sftprof/forward/mb0 at megatron/core/tensor_parallel/layers.py:576 forward: "
        "37.09 GiB requested of a 79.18 GiB GPU holding 44.77 GiB allocated, 8.94 GiB reserved and not allocated, "
        "8.92 GiB outside PyTorch; alive by category (GiB): before_window 44.77 (no allocator history in this trial")
    assert summary["what_if"][0]["key"] == "fit_oom"
    # a trial that set PYTORCH_ALLOC_CONF alone: the change goes there, the variable its allocator read
    log = _h100_oom_log(tmp_path / "alloc")
    env = json.loads((log / "environment.json").read_text())
    (log / "environment.json").write_text(json.dumps({**env, "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}))
    summary, _ = postprocess_trial(str(log), str(tmp_path / "alloc_run"), "kernel", 1)
    assert summary["oom"]["fits"][0]["settings"] == {
        "env.PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True",
        "actor.loss.lm_head_loss_chunk_size": 2048}


def test_the_trials_model_is_loaded_once(tmp_path, monkeypatch):
    """The OOM triage, the snapshot's estimate and the what-ifs share one load of the trial's model config (its 4
    layers; on main at 3bf771f each loaded its own: [4, 4, 3, 2, 1, 4] for this trial); the fit of other layer counts
    loads those (4, 3, 2, 1: sftprof.analysis.memory.fit.fitting_changes)."""
    import shutil

    from sftprof import artifacts
    from sftprof.analysis.trial import inputs

    log = oom_log_dir(tmp_path)
    snapshots = artifacts.snapshot_dir(log, 0)
    snapshots.mkdir(parents=True)
    shutil.copyfile(FIXTURE_DIR / "h200_mcore_qwen3moe_4l_8k.snapshot.pickle.gz",
                    snapshots / "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle.gz")
    loads = []
    real = inputs.load_hf_config
    monkeypatch.setattr(inputs, "load_hf_config", lambda path, n: loads.append(n) or real(path, n))
    summary, _ = postprocess_trial(str(log), str(tmp_path / "run"), "memory", 0)
    assert [c["settings"] for c in summary["oom"]["fits"]] == [{"actor.num_layers": 1}]
    assert summary["memory_snapshots"][0]["estimate"] is not None
    assert loads == [4, 4, 3, 2, 1]  # the trial's (once), then the fit's


def test_the_changes_that_fit_count_the_outside_memory_of_the_trials_megatron_core(tmp_path, monkeypatch):
    """The H100 trial ran megatron-core 0.19.2 (tests/fixtures/README.md). Postprocessed where 0.16.1 is installed,
    its changes that fit count 0.19.2's 8.85 GiB outside PyTorch when its versions.json says so (the chunked LM head
    no longer fits: only fewer tokens does), the installed version's 7.76 when the trial recorded none."""
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 16, 1))
    fits = {}
    for recorded in ("0.19.2", None):
        log = _h100_oom_log(tmp_path / str(recorded))
        if recorded:
            (log / "versions.json").write_text(json.dumps(  # release 3.7's record: no sftprof, no nccl
                {"python": "3.12.3", "torch": None, "torch_cuda": None, "megatron_core": recorded,
                 "transformer_engine": None, "transformers": None, "triton": None, "flash_linear_attention": None}))
        summary, _ = postprocess_trial(str(log), str(tmp_path / str(recorded) / "run"), "kernel", 1)
        fits[recorded] = summary["oom"]["fits"]
        assert summary["versions"] == (None if recorded is None else {
            "sftprof": None, "python": "3.12.3", "torch": None, "torch_cuda": None, "nccl": None,
            "megatron_core": recorded, "transformer_engine": None, "transformers": None, "triton": None,
            "flash_linear_attention": None})  # the keys release 3.7 did not record are None
    chunked = {"env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "actor.loss.lm_head_loss_chunk_size": 2048}
    assert [f["settings"] for f in fits[None]] == [chunked, {"profile.fake_seq_len": 32768}]
    peak = fits[None][0]["peak_bytes"]  # expandable: no slack
    assert fits[None][0]["need_bytes"] - peak == int(7.76 * GIB) + math.ceil(peak * PREDICTION_UNDER_SHARE)
    assert [f["settings"] for f in fits["0.19.2"]] == [{"profile.fake_seq_len": 32768}]
    assert fits["0.19.2"][0]["need_bytes"] - fits[None][1]["need_bytes"] == int(8.85 * GIB) - int(7.76 * GIB)
