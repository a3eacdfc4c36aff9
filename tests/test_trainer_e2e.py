"""train_sft_profile.py end to end on the tiny CPU preset: torchrun + gloo, kernel and memory trials.

The 2-rank kernel trial and the 1-rank memory trial train on the same global batch (2 sequences
of 128 tokens) from the same seed, so their losses and gradient norms must agree: that checks
the data-parallel split and gradient averaging as well as the records.
"""
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sftprof import artifacts
from sftprof.analysis.summary import postprocess_trial
from sftprof.config import load_config
from sftprof.models.hf import CONFIG_DIR
from sftprof.pycheck import megatron_core_version
from sftprof.stats_log import TeardownRecord, read_stats
from sftprof.trainer import _ExitClock, _append_record

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "train_sft_profile.py"
SEQ = 128
COMMON = [f"profile.fake_seq_len={SEQ}", "total_train_steps=2", "experiment_name=e2e"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _log_dir(fileroot: Path, trial: str) -> Path:
    import getpass
    return fileroot / "logs" / getpass.getuser() / "e2e" / trial


def _grad_norm(trainer_log: Path, step: int) -> float:
    m = re.search(rf"step {step} \| loss [0-9.]+ \| grad norm ([0-9.]+) \|", trainer_log.read_text())
    assert m, trainer_log.read_text()[-2000:]
    return float(m.group(1))


def _records(log_dir: Path) -> list:
    return [json.loads(line) for line in (log_dir / "stats.jsonl").read_text().splitlines()]


CLOCKS = ("trainer_started_unix_s", "imports_done_unix_s", "engine_build_started_unix_s", "ended_unix_s")


def _without_clocks(record: dict) -> dict:
    """The completion record less its rank-0 clocks, after asserting they are in the order the trainer passes them."""
    times = [record[k] for k in CLOCKS]
    assert all(isinstance(t, float) for t in times) and times == sorted(times), times
    return {k: v for k, v in record.items() if k not in CLOCKS}


@pytest.fixture(scope="module")
def kernel_trial(tmp_path_factory):
    root = tmp_path_factory.mktemp("fileroot")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--config", "tiny_cpu", *COMMON, f"cluster.fileroot={root}", "trial_name=kernel",
           "perf_tracer.enabled=true", "perf_tracer.profile_steps=[0]"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _log_dir(root, "kernel"), proc


@pytest.fixture(scope="module")
def memory_trial(tmp_path_factory):
    root = tmp_path_factory.mktemp("fileroot")
    cmd = [sys.executable, str(SCRIPT), "--config", "tiny_cpu", *COMMON, f"cluster.fileroot={root}",
           "trial_name=memory", "actor.backend=fsdp:d1", "actor.mb_spec.max_tokens_per_mb=0",
           "memory_profiler.profile_steps=[0]"]
    env = _env()
    for name in artifacts.recorded_environment(env):
        env.pop(name)
    env.update(_TRIAL_ENV)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _log_dir(root, "memory"), proc


# the memory trial's variables: of the kinds a trial records, and some it leaves out (paths, a plugin, NCCL's
# per-job rendezvous address, a name that may hold a secret, a variable of another kind)
_TRIAL_ENV = {"NVTE_USE_CUTLASS_GROUPED_GEMM": "1", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "1",
              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
              "TRITON_CACHE_DIR": "/nonexistent/triton", "CUDNN_HOME": "/nonexistent/cudnn", "NVTE_DEBUG_PATH": "/x",
              "NCCL_NET_PLUGIN": "/x/libnccl-net.so", "NCCL_COMM_ID": "127.0.0.1:1", "NCCL_IB_AUTH_TOKEN": "s3cr3t",
              "NCCL_TEST_BYTES": "a\udcffb",  # byte 0xff in the process's environment: not UTF-8
              "SFTPROF_UNRELATED": "x"}


def test_a_trial_records_the_environment_variables_that_change_the_job(memory_trial):
    log_dir, _ = memory_trial
    assert (log_dir / "environment.json").read_text() == json.dumps({
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_ALGO": "Ring", "NCCL_TEST_BYTES": "a\\xffb",
        "NVTE_USE_CUTLASS_GROUPED_GEMM": "1", "OMP_NUM_THREADS": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, indent=1) + "\n"


def test_a_trial_records_the_versions_it_ran_with_and_its_summary_shows_them(memory_trial, tmp_path):
    """``versions.json``: sftprof with this checkout's commit, Python, torch and its CUDA and NCCL (None: this CPU
    build), the packages by their installed distribution (None: not installed); postprocessing copies it into the
    summary (``versions``) and its header."""
    log_dir, _ = memory_trial
    installed = megatron_core_version()
    recorded = json.loads((log_dir / "versions.json").read_text())
    assert list(recorded) == ["sftprof", "python", "torch", "torch_cuda", "nccl", "megatron_core", "transformer_engine",
                              "transformers", "triton", "flash_linear_attention"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert recorded["sftprof"] == f"{importlib.metadata.version('sftprof')}+g{head}"
    assert recorded["python"] == platform.python_version() and recorded["torch"] == torch.__version__
    assert recorded["torch_cuda"] == torch.version.cuda and recorded["nccl"] is None
    assert recorded["megatron_core"] == (".".join(map(str, installed)) if installed else None)
    for key, name in (("transformer_engine", "transformer_engine"), ("transformers", "transformers"),
                      ("triton", "triton"), ("flash_linear_attention", "fla")):
        assert (recorded[key] is None) == (importlib.util.find_spec(name) is None), key
    summary, code = postprocess_trial(str(log_dir), str(tmp_path / "run"))
    assert code == 0 and summary["versions"] == recorded
    header = (tmp_path / "run" / "profile_summary.md").read_text().splitlines()
    assert "- versions: " + ", ".join(f"{k} {v or 'absent'}" for k, v in recorded.items()) in header


def test_nccl_version_is_torchs_as_text_and_none_without_nccl(monkeypatch):
    """This CPU build of torch has no NCCL: None; a build with NCCL 2.28.9 gives ``"2.28.9"``, its suffix appended."""
    from sftprof.trainer import nccl_version

    assert not hasattr(torch._C, "_nccl_version") and nccl_version() is None
    monkeypatch.setattr(torch._C, "_nccl_version", lambda: (2 << 32) | (28 << 16) | 9, raising=False)
    monkeypatch.setattr(torch._C, "_nccl_version_suffix", lambda: b"", raising=False)
    assert nccl_version() == "2.28.9"
    monkeypatch.setattr(torch._C, "_nccl_version_suffix", lambda: b"a0", raising=False)
    assert nccl_version() == "2.28.9a0"


def test_kernel_trial_records(kernel_trial):
    log_dir, _ = kernel_trial
    recs = _records(log_dir)
    assert [r["type"] for r in recs] == ["step", "step", "complete", "teardown", "exit"]
    assert _without_clocks(recs[2]) == {"type": "complete", "status": "ok", "error": None, "steps_done": 2,
                                        "world_size": 2, "backend": "fsdp", "device": "cpu", "profile_kind": "kernel",
                                        "profile_step": 0}
    s0, s1 = recs[0], recs[1]
    assert set(s0) == {"type", "step", "loss", "step_time_s", "tokens", "tokens_per_s", "mem_allocated_gb",
                       "mem_reserved_gb", "mem_peak_allocated_gb", "mem_peak_reserved_gb", "ranks",
                       "tflops_per_gpu", "mfu", "recompute_tflops_per_gpu", "profiled", "grad_norm", "moe_load",
                       "started_unix_s", "profiler_s"}
    assert [s0["step"], s1["step"]] == [0, 1] and [s0["profiled"], s1["profiled"]] == [True, False]
    end, teardown, exited = recs[2], recs[3], recs[4]
    assert end["engine_build_started_unix_s"] < s0["started_unix_s"] < s1["started_unix_s"] < end["ended_unix_s"]
    # after the completion record: the ranks' barrier passed, then the process group torn down
    assert set(teardown) == {"type", "barrier_done_unix_s", "process_group_destroyed_unix_s"}
    assert end["ended_unix_s"] <= teardown["barrier_done_unix_s"] <= teardown["process_group_destroyed_unix_s"]
    # then main returned and the atexit handlers registered after the trainer's ran
    assert set(exited) == {"type", "atexit_done_unix_s"}
    assert teardown["process_group_destroyed_unix_s"] <= exited["atexit_done_unix_s"]
    assert s0["profiler_s"] >= 0 and s1["profiler_s"] >= 0
    assert math.isfinite(s0["loss"]) and abs(s0["loss"] - math.log(151936)) < 1.0
    assert s1["loss"] < s0["loss"]  # one AdamW step on the same batch lowers its loss
    for s in (s0, s1):
        assert s["tokens"] == 2 * SEQ
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["step_time_s"])
        assert [r["rank"] for r in s["ranks"]] == [0, 1]
        assert s["step_time_s"] == max(r["step_time_s"] for r in s["ranks"]) > 0
        assert s["tflops_per_gpu"] is None and s["mfu"] is None and s["recompute_tflops_per_gpu"] is None  # CPU
        assert s["mem_peak_allocated_gb"] is None                   # no CUDA allocator on CPU
        assert math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
        # Routing load over both ranks: 2 sequences x SEQ tokens x top-2 slots over 8 experts per layer, counted
        # once although gradient checkpointing re-runs every router in backward.
        load = s["moe_load"]
        assert load["tokens_per_expert_mean"] == [2 * SEQ * 2 / 8] * 2
        assert all(m >= 2 * SEQ * 2 / 8 for m in load["tokens_per_expert_max"])
        assert load["max_over_mean"] == [m / (2 * SEQ * 2 / 8) for m in load["tokens_per_expert_max"]]
        assert load["ep_max_over_mean"] == [1.0, 1.0] and load["ep_max_over_mean_max"] == 1.0
        assert load["max_over_mean_max"] == max(load["max_over_mean"])
    assert json.loads((log_dir / "rank_coords.json").read_text()) == {
        "world_size": 2, "allocation_mode": "fsdp:d2", "backend": "fsdp",
        "ranks": {"0": {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0, "etp": 0},
                  "1": {"pp": 0, "dp": 1, "cp": 0, "tp": 0, "ep": 0, "etp": 0}}}
    resolved = load_config(log_dir / "config.yaml")
    assert resolved.profile.fake_seq_len == SEQ and resolved.actor.mb_spec.max_tokens_per_mb == SEQ
    lines = (log_dir / "trainer.log").read_text()
    assert f"step 0 | loss {s0['loss']:.4f}" in lines and f"step 1 | loss {s1['loss']:.4f}" in lines


def test_kernel_trial_trace_only_on_selected_rank(kernel_trial):
    log_dir, _ = kernel_trial
    # perf_tracer.ranks = pp_rank0 -> rank 0 only (pp=1).
    assert sorted(p.name for p in (log_dir / "perf_tracer").iterdir()) == ["rank0.pt.trace.json"]
    events = json.loads((log_dir / "perf_tracer" / "rank0.pt.trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"sftprof/step", "sftprof/forward/mb0", "sftprof/backward/mb0", "sftprof/optimizer_step"} <= names
    # Step 0 is profiled (no warm-up step before it): it is ProfilerStep#0 and holds every sftprof region.
    steps = [e for e in events if e["name"].startswith("ProfilerStep#") and e.get("ph") == "X"]
    assert [e["name"] for e in steps] == ["ProfilerStep#0"]
    lo, hi = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
    ours = [e for e in events if e["name"].startswith("sftprof/") and e.get("cat") == "user_annotation"]
    assert ours and all(lo <= e["ts"] and e["ts"] + e["dur"] <= hi for e in ours)
    assert not (log_dir / "memory_snapshots").exists()


def test_memory_trial_on_cpu_and_dp_parity(memory_trial, kernel_trial):
    log_dir, proc = memory_trial
    assert "allocator snapshots need CUDA" in proc.stdout
    assert "memory profiler: 0 snapshot(s) written on rank 0" in (log_dir / "trainer.log").read_text()
    assert not (log_dir / "memory_snapshots").exists()
    recs = _records(log_dir)
    assert [r["type"] for r in recs] == ["step", "step", "complete", "teardown", "exit"]
    assert _without_clocks(recs[2]) == {"type": "complete", "status": "ok", "error": None, "steps_done": 2,
                                        "world_size": 1, "backend": "fsdp", "device": "cpu", "profile_kind": "memory",
                                        "profile_step": 0}
    assert [r["profiled"] for r in recs[:2]] == [True, False]
    # Same global batch and seed as the 2-rank kernel trial: same losses before and after one step.
    # Same gradient norm (logged with 4 decimals) checks the DP gradient averaging: AdamW alone
    # would hide a gradient scale error from the losses.
    kernel = _records(kernel_trial[0])
    for step in (0, 1):
        assert recs[step]["loss"] == pytest.approx(kernel[step]["loss"], rel=1e-5)
        norms = [_grad_norm(d / "trainer.log", step) for d in (log_dir, kernel_trial[0])]
        assert norms[0] > 0.1 and norms[0] == pytest.approx(norms[1], abs=2e-4)


def test_failure_writes_failed_record(tmp_path):
    # A checkpoint holding every tensor the model reads, each of the wrong shape: its header reads and names what the
    # model needs, so the checks before the process group pass (a damaged header or a missing tensor is refused
    # there, exit 2), and transformers refuses the shapes when the engine loads it.
    import torch
    from safetensors.torch import save_file

    from sftprof.models.hf import load_hf_config
    from sftprof.models.qwen3_moe_weights import required_tensors

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(CONFIG_DIR / "tiny_qwen3_moe" / "config.json", model / "config.json")
    names = required_tensors(load_hf_config(str(model)), set())
    save_file({name: torch.zeros(2, 2) for name in names}, str(model / "model.safetensors"))
    cmd = [sys.executable, str(SCRIPT), "--config", "tiny_cpu", f"cluster.fileroot={tmp_path}", "experiment_name=e2e",
           "trial_name=fail", "actor.backend=fsdp:d1", "actor.init_from_scratch=false", f"actor.path={model}",
           "profile.fake_seq_len=16"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    rec, teardown, exited = _records(_log_dir(tmp_path, "fail"))[-3:]
    assert rec["type"] == "complete" and rec["status"] == "failed" and rec["steps_done"] == 0
    # no barrier in a failed trial; the process group is torn down all the same
    assert teardown["type"] == "teardown" and teardown["barrier_done_unix_s"] is None
    assert teardown["process_group_destroyed_unix_s"] >= rec["ended_unix_s"]
    # the exit record follows it; the exit status stays 1
    assert exited["type"] == "exit" and exited["atexit_done_unix_s"] >= teardown["process_group_destroyed_unix_s"]
    assert rec["error"].startswith("RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an "
                                   "error."), rec["error"]


def test_a_teardown_record_not_written_is_a_warning_not_a_failure(tmp_path, caplog):
    """stats.jsonl that cannot be appended to (its log dir gone): one warning, nothing raised, so the trial's exit
    status stays its own."""
    written = _append_record(tmp_path / "gone" / "stats.jsonl", TeardownRecord())
    assert written is False and [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records] == [
        ("WARNING", "teardown record not written to stats.jsonl")]
    assert not (tmp_path / "gone").exists()


def test_the_exit_record_follows_only_a_teardown_record_and_a_failed_write_is_a_warning(tmp_path, caplog):
    """The atexit handler writes nothing before the teardown record armed it (a trial stopped before its teardown
    keeps its file's end); armed, it appends the exit record; a file that cannot be written is one warning, nothing
    raised."""
    clock = _ExitClock()
    clock()
    assert list(tmp_path.iterdir()) == [] and caplog.records == []
    clock.path = tmp_path / "stats.jsonl"
    clock()
    assert read_stats(clock.path).exit.atexit_done_unix_s > 0 and read_stats(clock.path).bad_lines == 0
    clock.path = tmp_path / "gone" / "stats.jsonl"
    clock()
    assert [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records] == [
        ("WARNING", "exit record not written to stats.jsonl")]
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("args,env,message", [
    (["actor.no_such_key=1"], {}, "actor.no_such_key"),
    (["profile.fake_seq_len=1"], {}, "profile.fake_seq_len=1"),
    ([], {"WORLD_SIZE": "1"}, "actor.backend='fsdp:d2' needs 2 ranks"),
    (["actor.backend=fsdp:d1", "actor.path=/no/such/model"], {}, "actor.path='/no/such/model'"),
    (["actor.backend=fsdp:d1", "actor.init_from_scratch=false"], {}, "tiny_qwen3_moe holds no weights"),
    (["actor.backend=fsdp:d1", "perf_tracer.enabled=true", "perf_tracer.profile_steps=[0]", "memory_profiler.profile_steps=[0]"], {},
     "one profile kind per trial"),
])
def test_config_errors_exit_2_before_process_group(tmp_path, args, env, message):
    cmd = [sys.executable, str(SCRIPT), "--config", "tiny_cpu", f"cluster.fileroot={tmp_path}", *args]
    proc = subprocess.run(cmd, env={**_env(), **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    # No process group started: a rank logs its first line only after init_process_group, and no
    # LOG_DIR was created (how fast this happens is the bench's business, not a test's).
    assert proc.stdout == ""
    assert not (tmp_path / "logs").exists()


def test_trial_log_dir_of_an_earlier_trial_is_refused_before_writing(tmp_path):
    """Running the trainer twice with one trial_name replaced the first trial's config.yaml, stats.jsonl and
    trainer.log: a log dir that holds a trial's files is refused (exit 2, naming it), nothing in it touched."""
    log_dir = _log_dir(tmp_path, "t")
    log_dir.mkdir(parents=True)
    earlier = {"config.yaml": "trial_name: t\n", "stats.jsonl": '{"type": "complete"}\n', "trainer.log": "first\n"}
    for name, text in earlier.items():
        (log_dir / name).write_text(text)
    cmd = [sys.executable, str(SCRIPT), "--config", "tiny_cpu", f"cluster.fileroot={tmp_path}", "experiment_name=e2e",
           "trial_name=t", "actor.backend=fsdp:d1"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (f"sftprof: configuration error: trial log dir {log_dir} already holds a trial's files "
                           "(config.yaml, stats.jsonl, trainer.log): trial_name='t' of experiment_name='e2e' ran before; "
                           "nothing was overwritten. Accepted: another trial_name (or experiment_name / "
                           "cluster.fileroot), whose log dir is new\n")
    assert proc.stdout == "" and sorted(p.name for p in log_dir.iterdir()) == sorted(earlier)
    assert {name: (log_dir / name).read_text() for name in earlier} == earlier
    # an empty log dir, or one with only the drivers' node records, is a new trial's
    from sftprof.trainer import check_new_log_dir
    for name in earlier:
        (log_dir / name).unlink()
    (log_dir / "nodes").mkdir()
    check_new_log_dir(load_config("tiny_cpu", [f"cluster.fileroot={tmp_path}", "experiment_name=e2e", "trial_name=t"]))


def test_hta_splits_the_real_trace_by_profiler_step(kernel_trial, caplog):
    pytest.importorskip("hta", reason="HTA (traceinsight) is an optional test extra")
    from hta.trace_analysis import TraceAnalysis

    log_dir, _ = kernel_trial
    analysis = TraceAnalysis(trace_dir=str(log_dir / "perf_tracer"))   # the raw folder, as the trainer wrote it
    df = analysis.t.get_trace(0)
    assert sorted(df["iteration"].unique().tolist()) == [0]   # every event inside ProfilerStep#0
    assert "ProfilerStep#0" in analysis.t.symbol_table.sym_index
    assert "ProfilerStep not found" not in caplog.text


def test_kernel_trace_holds_model_part_ranges_with_recompute(kernel_trial):
    """The trainer's module hooks put one range per registered module call in the profiled step; HF gradient
    checkpointing re-runs each layer's forward inside backward, which the ranges mark as recompute."""
    from collections import Counter

    from sftprof.capture.module_regions import PREFIX, parse_region

    log_dir, _ = kernel_trial
    events = json.loads((log_dir / "perf_tracer" / "rank0.pt.trace.json").read_text())["traceEvents"]
    names = Counter(e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX))
    parsed = Counter()
    for name, n in names.items():
        part, layer, rec = parse_region(name)
        parsed[(part, layer, rec)] += n
    for layer in (0, 1):  # tiny_cpu: 2 layers, 1 micro-batch per rank
        for part, calls in (("attn_qkv", 3), ("attn_out", 1), ("router", 1), ("experts", 1), ("dispatch_combine", 1),
                            ("attn_other", 1), ("layer_other", 1), ("norm", 4)):
            assert parsed[(part, layer, False)] == calls, (part, layer, parsed)
            # re-run once in backward; the decoder layer's own call is not: HF's checkpoint wraps inside it
            assert parsed[(part, layer, True)] == (0 if part == "layer_other" else calls), (part, layer, parsed)
    assert parsed[("embedding", None, False)] == 1 and parsed[("lm_head_loss", None, True)] == 0


def test_backward_gemms_get_the_part_of_their_forward(kernel_trial):
    """On the trainer's own trace, every GEMM op is attributed to a model part: forward and recompute by the
    range around it, backward through the fwd/bwd flow to the (recomputed) forward op. Each forward GEMM has
    two backward GEMMs (input and weight gradients), so per part backward = 2 x recompute = 2 x forward."""
    from collections import Counter

    import numpy as np

    from sftprof.analysis.trace.op_collector import OpCollector

    log_dir, _ = kernel_trial
    ops, points = OpCollector(), []
    for e in json.loads((log_dir / "perf_tracer" / "rank0.pt.trace.json").read_text())["traceEvents"]:
        if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float)):
            ops.add(e, e.get("cat"), e["ts"], e["dur"])
            if e.get("cat") == "cpu_op" and e["name"] in ("aten::mm", "aten::addmm", "aten::bmm"):
                points.append((e["tid"], e["ts"] + 1e-3))  # a launch point inside the op
        elif e.get("cat") == "fwdbwd":
            ops.add(e, "fwdbwd", e["ts"], 0.0)
    n = len(points)
    parts, layers, phases, source = ops.attribute(np.array([p[0] for p in points]), np.array([p[1] for p in points]),
                                                  ["GEMM"] * n, np.zeros(n, bool), np.zeros(n, bool))
    assert source == "module_regions"
    got = Counter(zip(parts, layers, phases))
    assert not [k for k in got if k[0] in ("outside_parts", "comm_outside")], got
    for layer in (0, 1):
        for part in ("attn_qkv", "attn_out", "router", "experts"):
            fwd = got[(part, layer, "forward")]
            assert fwd > 0 and got[(part, layer, "recompute")] == fwd and got[(part, layer, "backward")] == 2 * fwd, got
    assert got[("lm_head_loss", None, "backward")] == 2 * got[("lm_head_loss", None, "forward")] > 0
