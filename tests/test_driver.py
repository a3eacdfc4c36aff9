"""The shell driver: bad input exits 2 and launches nothing; the plan it writes."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sftprof import launch

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
    ({"EXPERIMENT_NAME": "../../etc"}, "sftprof: EXPERIMENT_NAME='../../etc': use letters, digits, '_' and '-' only\n"),
    ({"EXPERIMENT_NAME": "/abs"}, "sftprof: EXPERIMENT_NAME='/abs': use letters, digits, '_' and '-' only\n"),
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
    cfg.write_text(text.replace("logprobs_chunk_size:", "logprob_chunk_size:"))
    out = run_driver({"CONFIG": str(cfg)}, tmp_path)
    assert out.returncode == 2
    assert "actor.loss.logprob_chunk_size" in out.stderr and "Did you mean" in out.stderr
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
    assert out.returncode == 2 and "exists and is not empty; nothing was overwritten" in out.stderr
    assert [p.name for p in run.iterdir()] == ["precious.txt"] and keep.read_text() == "keep me"


def test_plan_is_step_major_kernel_first(tmp_path):
    env = dict(os.environ, CONFIG="tiny_cpu", FILEROOT=str(tmp_path / "fr"), RUN_ROOT=str(tmp_path / "run"),
               PROFILE_STEPS="2,0", PROFILE_STAMP="t1", LOGPROBS_CHUNK_SIZE="64", PROFILE_KINDS="memory,kernel")
    env.pop("PROFILE_RANKS", None)
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in (tmp_path / "run" / "trials.tsv").read_text().splitlines()]
    assert [(r[1], r[2]) for r in rows] == [("kernel", "0"), ("memory", "0"), ("kernel", "2"), ("memory", "2")]
    assert rows[2][0] == "tiny_qwen3_moe_fake1k_kernel_step2_t1"
    args = Path(rows[2][5]).read_text().splitlines()
    assert "total_train_steps=3" in args and "perf_tracer.profile_steps=[2]" in args
    assert "actor.loss.logprobs_chunk_size=64" in args and "memory_profiler.profile_steps=[]" in args
    settings = (tmp_path / "run" / "profile_settings.log").read_text()
    assert "LOGPROBS_CHUNK_SIZE=64\t# env -> actor.loss.logprobs_chunk_size" in settings
    assert "PROFILE_RANKS=0\t# default pp_rank0" in settings
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
    shown = subprocess.run(["bash", "-c", f'eval "$1"; printf %s "$RUN_ROOT"', "_", plan.stdout],
                           capture_output=True, text=True)
    assert shown.stdout == str(run_root) and not marker.exists()


def test_text_values_stay_text_and_multi_node_needs_a_stamp(tmp_path):
    env = dict(os.environ, CONFIG="tiny_cpu", FILEROOT=str(tmp_path / "fr"), RUN_ROOT=str(tmp_path / "run"),
               PROFILE_STAMP="t2", EXPERIMENT_NAME="0123")
    env.pop("PROFILE_RANKS", None)
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in (tmp_path / "run" / "trials.tsv").read_text().splitlines()]
    assert Path(rows[0][4]).parent.name == "0123"  # not the octal 83
    out = run_driver({"N_NODES": "2", "N_GPUS_PER_NODE": "1"}, tmp_path / "multi")
    assert out.returncode == 2 and "PROFILE_STAMP is unset with N_NODES=2" in out.stderr


def _plan_env(tmp_path, **extra) -> dict:
    env = {"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fr"), "RUN_ROOT": str(tmp_path / "run"), "PROFILE_STAMP": "p"}
    env.update(extra)
    return env


def test_help_prints_usage_and_exits_0(tmp_path):
    for flag in ("--help", "-h"):
        out = run_driver({}, tmp_path, "actor.num_layers=1", flag)
        assert out.returncode == 0 and out.stderr == ""
        assert out.stdout == launch.usage()
    assert out.stdout.startswith("usage: [VAR=value ...] bash run_qwen3_30b_a3b_sft_profile.sh [key=value ...]\n")
    for var in launch.DRIVER_VARS:
        assert f"\n  {var.name} " in out.stdout and f"[default: {var.default}]" in out.stdout
    assert not (tmp_path / "run").exists()


def test_readme_lists_the_driver_variables():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| variable | default | meaning |"):]
    table = table[:table.index("\n\n")]
    named = re.findall(r"`([A-Z][A-Z0-9_]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:]))
    assert named == [v.name for v in launch.DRIVER_VARS]


def test_memory_trials_skipped_without_cuda_unless_asked(tmp_path):
    trials, settings, info = launch.plan(_plan_env(tmp_path), [], gpus=0)
    assert [(t.kind, t.step) for t in trials] == [("kernel", 0), ("kernel", 1)] and info["trials"] == 2
    assert [s for s in settings if s.startswith("PROFILE_KINDS")] == [
        "PROFILE_KINDS=kernel\t# default without CUDA (kernel,memory with CUDA)"]
    assert info["notices"][0] == ("no CUDA on this node: memory trials skipped (allocator snapshots need CUDA); "
                                  "PROFILE_KINDS=kernel,memory runs them anyway")
    assert info["notices"][-1] == ("plan: 2 trial(s) on 2 rank(s) (1 node(s) x 2, fsdp:d2, CPU (no CUDA)): "
                                   "kernel step 0, kernel step 1")
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_KINDS="kernel,memory", PROFILE_STEPS="1"), [], gpus=0)
    assert [t.kind for t in trials] == ["kernel", "memory"]
    assert [s for s in settings if s.startswith("PROFILE_KINDS")] == ["PROFILE_KINDS=kernel,memory\t# env"]
    assert info["notices"][0] == "no CUDA on this node: memory trials run but record no snapshot (CPU)"
    trials, settings, info = launch.plan(_plan_env(tmp_path, PROFILE_STEPS="1"), [], gpus=2)
    assert [t.kind for t in trials] == ["kernel", "memory"] and len(info["notices"]) == 1
    assert [s for s in settings if s.startswith("PROFILE_KINDS")] == ["PROFILE_KINDS=kernel,memory\t# default"]


def test_fileroot_default_cannot_shadow_the_package_and_a_shadowing_one_warns(tmp_path):
    """The default FILEROOT (config cluster.fileroot, every bundled YAML) is not a folder named like the package,
    which a Python started in its parent would import instead of it; an explicit one so named is used, with a
    warning."""
    from sftprof.config import DEFAULT_FILEROOT, PRESET_DIR, load_config

    assert DEFAULT_FILEROOT == "/tmp/sftprof_fileroot"
    for yaml in (ROOT / "qwen3_30b_a3b_sft_profile.yaml", ROOT / "qwen3_5_35b_a3b_sft_profile.yaml",
                 PRESET_DIR / "tiny_cpu.yaml", PRESET_DIR / "tiny_qwen3_5_cpu.yaml"):
        assert load_config(yaml, []).cluster.fileroot == DEFAULT_FILEROOT, yaml
    env = _plan_env(tmp_path, PROFILE_STEPS="1")
    del env["FILEROOT"]
    trials, settings, info = launch.plan(env, [], gpus=0)
    assert f"FILEROOT={DEFAULT_FILEROOT}\t# config cluster.fileroot" in settings
    assert trials[0].log_dir.parents[2] == Path(DEFAULT_FILEROOT) / "logs"
    assert not any("is a folder named" in n for n in info["notices"])
    old = tmp_path / "sftprof"
    trials, _, info = launch.plan(_plan_env(tmp_path, FILEROOT=str(old), PROFILE_STEPS="1", RUN_ROOT=str(tmp_path / "r2")),
                                  [], gpus=0)
    assert trials[0].log_dir.parents[2] == old / "logs"
    assert [n for n in info["notices"] if n.startswith("warning: FILEROOT")] == [
        f"warning: FILEROOT {old} is a folder named sftprof: a Python started in {tmp_path} imports it (an empty "
        f"namespace package) instead of the sftprof package; name it otherwise, e.g. FILEROOT=/tmp/sftprof_fileroot"]


def test_devices_checked_before_launch(tmp_path):
    with pytest.raises(launch.DriverError) as err:
        launch.plan(_plan_env(tmp_path, CONFIG=str(ROOT / "qwen3_30b_a3b_sft_profile.yaml")), [], gpus=0)
    assert str(err.value) == (
        "actor.backend='megatron:(attn:d2c4|ffn:d1e8)': the megatron backend needs CUDA GPUs and this node has none "
        f"(CONFIG={ROOT / 'qwen3_30b_a3b_sft_profile.yaml'}); on a machine without CUDA use CONFIG=tiny_cpu (fsdp on CPU, gloo)")
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
    assert f"MASTER_PORT={info['master_port']}\t# default: a free port of this node" in settings
    assert not launch.port_in_use(info["master_port"])
    _, settings, info = launch.plan(_plan_env(tmp_path, N_NODES="2", N_GPUS_PER_NODE="1", NODE_RANK="1"), [], gpus=0)
    assert info["master_port"] == 29500 and "MASTER_PORT=29500\t# default with N_NODES > 1" in settings
    assert info["run_root"] == str(tmp_path / "run")


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
    trials, _, info = launch.plan(_plan_env(tmp_path, profile_steps="1"), [], gpus=0)
    assert info["notices"][0] == ("warning: profile_steps is not a driver variable and is ignored (driver variables "
                                  "are upper case); did you mean PROFILE_STEPS?")
    assert [t.step for t in trials] == [0, 1]   # the default steps: profile_steps was not read


def test_misspelled_variables_warned_with_the_closest_name(tmp_path):
    env = _plan_env(tmp_path, PROFILE_STEP="1", N_GPU_PER_NODE="2", MASTERPORT="1", PROFILE_FOO="x",
                    NODE_OPTIONS="--x", HOME="/root", RUN_ID="7")
    assert launch.unknown_variable_warnings(env) == [
        "MASTERPORT is not a driver variable and is ignored; did you mean MASTER_PORT?",
        "N_GPU_PER_NODE is not a driver variable and is ignored; did you mean N_GPUS_PER_NODE?",
        "PROFILE_FOO is not a driver variable and is ignored (`bash run_qwen3_30b_a3b_sft_profile.sh --help` lists them)",
        "PROFILE_STEP is not a driver variable and is ignored; did you mean PROFILE_STEPS?"]
    plan_env = {k: v for k, v in os.environ.items() if k != "PROFILE_RANKS"}
    plan_env.update(_plan_env(tmp_path, PROFILE_STEP="1"))
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=plan_env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "sftprof: warning: PROFILE_STEP is not a driver variable and is ignored; did you mean PROFILE_STEPS?\n" \
        in out.stderr
    # also when planning fails: the misspelling may be the cause, and nothing else would name it
    plan_env.update(TOTAL_STEPS="1")
    out = subprocess.run(["python", "-m", "sftprof.launch", "plan"], env=plan_env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("sftprof: warning: PROFILE_STEP is not a driver variable and is ignored; did you mean "
                          "PROFILE_STEPS?\nsftprof: TOTAL_STEPS=1: must be > the largest profile step 1 (or unset: "
                          "profile step + 1)\n")


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
    ({"LOGPROBS_CHUNK_SIZE": "16"}, "actor.logprobs_chunk_size=64",   # the key's old name
     "LOGPROBS_CHUNK_SIZE=16 (a driver variable, sets actor.loss.logprobs_chunk_size) and the argument "
     "actor.logprobs_chunk_size=64"),
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
                                         ["perf_tracer.ranks=1", "total_train_steps=9"], gpus=0)
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
    (None, "config='{path}': is a directory; accepted: a YAML file or a bundled preset ['tiny_cpu', 'tiny_qwen3_5_cpu']"),
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
])
def test_impossible_model_configs_are_refused_naming_file_and_key(family, changes, problem, tmp_path):
    import json

    from sftprof.models.hf import CONFIG_DIR, ModelPathError, load_hf_config
    raw = json.loads((CONFIG_DIR / family / "config.json").read_text())
    (raw["text_config"] if "text_config" in raw else raw).update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelPathError) as exc:
        load_hf_config(str(tmp_path))
    file = tmp_path / "config.json"
    assert str(exc.value) == f"actor.path='{tmp_path}': " + (
        problem.format(file=file) if "{file}" in problem else f"{file} {problem}")


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


def test_stop_on_failure_lists_the_trials_not_run(tmp_path):
    """A trial that fails (a checkpoint whose embedding has the wrong shape: its header reads, so the plan passes,
    and transformers refuses it when the trial loads it) with STOP_ON_FAILURE=1: no time estimate for trials that
    will not run; summary.tsv and the end table have a `not run` row for each."""
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "sftprof/models/configs/tiny_qwen3_moe/config.json").read_text())
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(model / "model.safetensors"))
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
                       "log_dir"]
    log_dirs = [Path(line.split("\t")[4]) for line in (run / "trials.tsv").read_text().splitlines()]
    assert [r[:6] + r[7:] for r in rows[1:]] == [
        [names[0], "kernel", "0", "1", "1", "0", str(run / names[0]), str(log_dirs[0])],
        [names[1], "kernel", "1", "not run", "-", "-", str(run / names[1]), str(log_dirs[1])]]
    assert rows[2][6] == "-" and log_dirs[1].parent.parent.parent == logs
    table = out.stdout[out.stdout.index("trial          status"):].splitlines()
    assert table[2] == "kernel step 1  not run     -          -          -"
    assert table[1] == ("kernel step 0  FAILED (1)  -          n/a (CPU)  first failure: rank 0 exit code 1 (see "
                        "profile_summary.md)")
    assert launch.record_trials_not_run(run) == []   # every trial has its row now: nothing added twice
    assert len((run / "summary.tsv").read_text().splitlines()) == 3


@pytest.mark.parametrize("cmd", ["report", "not-run"])
def test_report_and_not_run_on_a_folder_without_the_plan_exit_2_in_one_line(cmd, tmp_path):
    """The driver's end-of-run helpers on a RUN_ROOT without summary.tsv or trials.tsv: one line, exit 2, nothing
    written (they used to end in a traceback; not-run even with status 0)."""
    def helper(*args):
        return subprocess.run([sys.executable, "-m", "sftprof.launch", cmd, str(tmp_path), *args], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = helper()
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"sftprof: {cmd} {tmp_path}: cannot read or write {tmp_path / 'summary.tsv'} (No such file "
                          "or directory); accepted: a RUN_ROOT the driver planned (trials.tsv) and started "
                          "(summary.tsv)\n")
    (tmp_path / "summary.tsv").write_text("trial\tkind\tstep\tstatus\ttrain_status\tpostprocess_status\telapsed_s\t"
                                          "run_dir\tlog_dir\n")
    out = helper()
    if cmd == "not-run":   # summary.tsv without trials.tsv
        assert out.returncode == 2 and out.stderr == (
            f"sftprof: not-run {tmp_path}: cannot read or write {tmp_path / 'trials.tsv'} (No such file or "
            "directory); accepted: a RUN_ROOT the driver planned (trials.tsv) and started (summary.tsv)\n")
    else:                  # an empty table: nothing ran yet
        assert out.returncode == 0 and out.stdout == "trial  status  step time  peak mem  top finding\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.tsv"]


def _interrupt_run(tmp_path: Path, env_extra: dict, args: list[str], names: list[str], started: str,
                   to_group: bool, timeout: float, driver_ignores: bool = False) -> None:
    """Start the driver in its own session, wait for ``started`` (a glob under the first trial's log dir) to exist,
    send SIGINT to the driver alone or, as a terminal's Ctrl-C does, to its whole process group, and check that the
    run stopped: the trial interrupted, the next one not run (never started), the end table printed, exit 130, and
    no process of the run left (any left is named and killed). ``driver_ignores``: the driver starts with SIGINT
    ignored (as a job started with ``&`` from a script), so only torchrun and the trainer see it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "RUN_ROOT", "CONFIG")}
    env.update({"FILEROOT": str(tmp_path / "fileroot"), "RUN_ROOT": str(tmp_path / "run"), "STOP_ON_FAILURE": "0",
                "PROFILE_KINDS": "kernel", "PROFILE_STEPS": "0,1", "PROFILE_STAMP": "s",
                "TOTAL_STEPS": "1000000"}, **env_extra)   # the first trial runs until stopped
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
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    finally:  # a driver that did not stop: nothing of the run may outlive the test (torchrun, trainer: same group)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    assert ("sftprof: torchrun got signal 2 (not the driver): stopping the run\n" if driver_ignores
            else "sftprof: SIGINT received: stopping the run\n") in err
    assert re.search(rf"^sftprof: \[1/2\] trial {re.escape(names[0])} interrupted after \d+ s \(torchrun status "
                     r"[1-9]\d*\); 1 trial\(s\) will not run$", err, re.M), err[-3000:]
    run = tmp_path / "run"
    rows = [line.split("\t") for line in (run / "summary.tsv").read_text().splitlines()[1:]]
    assert [r[:3] + r[3:4] + r[5:6] for r in rows] == [[names[0], "kernel", "0", "interrupted", "-"],
                                                       [names[1], "kernel", "1", "not run", "-"]]
    assert rows[0][4] != "0" and rows[1][4] == rows[1][6] == "-"
    table = out[out.index("trial          status"):].splitlines()
    assert table[1].startswith("kernel step 0  interrupted  ") and table[2].startswith("kernel step 1  not run      ")
    assert not list((tmp_path / "fileroot").glob(f"logs/*/*/{names[1]}"))   # the second trial never started
    assert "sftprof: [2/2]" not in out + err
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(tmp_path / "fileroot").encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:   # a process that ended while listed
            pass
    for pid in left:  # what the driver left running is named below, and does not outlive the test
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    assert left == []


@pytest.mark.parametrize("to_group,driver_ignores", [(False, False), (True, False), (True, True)],
                         ids=["driver", "process_group", "process_group_driver_ignores_sigint"])
def test_interrupt_stops_the_whole_run(tmp_path, to_group, driver_ignores):
    """SIGINT (Ctrl-C) with STOP_ON_FAILURE=0, to the driver alone or to its process group as a terminal sends it,
    stops the running torchrun and the run (:func:`_interrupt_run`); so does a group SIGINT that the driver ignores
    (started in the background from a script), through torchrun's record of the signal in launcher.log."""
    _interrupt_run(tmp_path, {"CONFIG": "tiny_cpu", "PROFILE_FAKE_SEQ_LEN": "128"}, ["actor.backend=fsdp:d1"],
                   ["tiny_qwen3_moe_fake128_kernel_step0_s", "tiny_qwen3_moe_fake128_kernel_step1_s"],
                   "trainer.log", to_group, timeout=120, driver_ignores=driver_ignores)


@pytest.mark.gpu
def test_interrupt_stops_a_megatron_run_on_a_gpu(tmp_path):
    """Ctrl-C (SIGINT to the process group) during the shipped YAML's training on ``megatron:d1`` (NCCL process
    groups, CUDA work in flight), after its first step: the run stops as on CPU and leaves no process."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _interrupt_run(tmp_path, {"PROFILE_FAKE_SEQ_LEN": "8192", "USE_PRECISION_AWARE_OPTIMIZER": "false",
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
