"""Driver variables declared beside their config keys (sftprof.config.settings): read strictly, checked by their key's
one check, turned into ``key=value`` arguments before the user's, each meaning its key alone."""
from pathlib import Path

import pytest

from sftprof import launch
from sftprof.config import ConfigError, load_config
from sftprof.launch import variables
from sftprof.launch.arguments import config_value, yaml_value

ROOT = Path(__file__).resolve().parents[1]


def _refusal(name: str, text: str) -> str:
    """The message with which step 1 of the plan refuses ``name=text``."""
    with pytest.raises(launch.DriverError) as err:
        launch.read_driver_env({"CONFIG": "tiny_cpu", name: text}, [], launch.PlanLog())
    return str(err.value)


@pytest.mark.parametrize("name,text,message", [
    ("LM_HEAD_LOSS_CHUNK_SIZE", "\u0661\u0662", "must be an integer >= 0 (0 = logits path)"),
    ("LM_HEAD_LOSS_CHUNK_SIZE", " 8", "must be an integer >= 0 (0 = logits path)"),
    ("TRAIN_BATCH_SIZE", "+2", "must be an integer >= 1"),
    ("SIMULATE_RANK", "\u0661", "must be an integer >= -1 (-1: off, else a rank of actor.backend's layout)"),
    ("PROFILE_FAKE_LOSS_START_RATIO", "\u0660.5", "must be a number in [0, 1)"),
    ("USE_DETERMINISTIC_ALGORITHMS", "true ", "must be true or false (or 1/0)"),
    ("MAIN_GRADS_DTYPE", "bf16", "must be one of float32, bfloat16"),
    ("STALL_TIMEOUT", "\u0661\u0662", "must be an integer from 0 to 2147483647"),
    ("NODE_TIMEOUT", "60 ", "must be an integer from 1 to 2147483647 (2**31 - 1 seconds: torchrun's rendezvous "
                            "timeout is a C int)"),
    ("GPU_MEMORY_GIB", "\u0668\u0660", "must be a number of GiB in [1, 1048576), e.g. 79.19 (an H100 80 GB), "
                                     "139.8 (an H200)"),
    ("FIT_CHECK", "warn ", "must be one of refuse, warn, off, only"),
    ("STOP_ON_FAILURE", " 1", "must be true or false (or 1/0)"),
    ("PROFILE_STEPS", "\u0661", "must be a comma-separated list of non-negative integers, e.g. 0,1"),
    ("EXPERIMENT_NAME", "run\u00e9", "must be letters, digits, '_' and '-' only"),
])
def test_non_ascii_digits_and_stray_spaces_are_refused_naming_the_variable(name, text, message):
    assert _refusal(name, text) == f"{name}={text!r}: {message}"


def test_profile_ranks_take_ascii_digits_only(tmp_path):
    """A rank spec's digits are ASCII (a regex's \\d takes Arabic-Indic digits as well)."""
    with pytest.raises(launch.DriverError) as err:
        launch.plan({"CONFIG": "tiny_cpu", "RUN_ROOT": str(tmp_path / "run"), "FILEROOT": str(tmp_path / "fr"),
                     "PROFILE_RANKS": "\u0661"}, [], gpus=0)
    assert str(err.value) == ("PROFILE_RANKS='\u0661': '\u0661' is not a rank or range; accepted: "
                              "pp_rank0|pp-rank0|pprank0|default, empty (all ranks), or a comma list of ranks and ranges "
                              "such as 0,2-4 (actor.backend=fsdp:d2)")


@pytest.mark.parametrize("name,key,value", [
    ("LM_HEAD_LOSS_CHUNK_SIZE", "actor.loss.lm_head_loss_chunk_size", "-1"),
    ("LOGPROBS_CHUNK_SIZE", "actor.loss.logprobs_chunk_size", "-3"),
    ("PROFILE_FAKE_SEQ_LEN", "profile.fake_seq_len", "1"),
    ("MEMORY_MAX_ENTRIES", "memory_profiler.max_entries", "0"),
])
def test_a_variable_and_its_key_are_refused_by_one_check(name, key, value):
    """The variable's message and the config's name the same accepted values: one check, declared beside the key."""
    accepted = _refusal(name, value).partition(": ")[2]
    with pytest.raises(ConfigError) as by_key:
        load_config("tiny_cpu", [f"{key}={value}"])
    assert str(by_key.value) == f"{key}={value}: {accepted}"
    assert variables.BY_NAME[name].keys == (key,)


def test_a_set_variable_is_the_argument_of_its_key_before_the_users():
    log = launch.PlanLog()
    d = launch.read_driver_env({"CONFIG": "tiny_cpu", "LM_HEAD_LOSS_CHUNK_SIZE": "2048", "MODEL_PATH": "tiny_qwen3_moe"},
                               ["actor.loss.lm_head_loss_chunk_size=2048", "actor.num_layers=1"], log)
    assert d.overrides == ['actor.path="tiny_qwen3_moe"', "actor.loss.lm_head_loss_chunk_size=2048"]
    assert d.extra_overrides == ["actor.loss.lm_head_loss_chunk_size=2048", "actor.num_layers=1"]
    assert log.agreeing == {"LM_HEAD_LOSS_CHUNK_SIZE": ["actor.loss.lm_head_loss_chunk_size=2048"]}


def test_use_precision_aware_optimizer_false_sets_its_key_alone(tmp_path):
    """It used to set the four optimizer dtypes too: with the shipped YAML (bf16 main grads) the config now says
    what else to set, before anything is written."""
    d = launch.read_driver_env({"USE_PRECISION_AWARE_OPTIMIZER": "false"}, [], launch.PlanLog())
    assert d.overrides == ["actor.megatron.use_precision_aware_optimizer=false"]
    env = {"CONFIG": str(ROOT / "qwen3_30b_a3b_sft_profile.yaml"), "RUN_ROOT": str(tmp_path / "run"),
           "FILEROOT": str(tmp_path / "fr"), "USE_PRECISION_AWARE_OPTIMIZER": "false"}
    with pytest.raises(launch.DriverError, match=r"^actor\.megatron\.main_grads_dtype='bfloat16': must be float32 "
                                                 r"unless actor\.megatron\.use_precision_aware_optimizer=true"):
        launch.plan(env, [], gpus=0)
    assert not (tmp_path / "run").exists()


def test_every_config_variable_is_declared_beside_its_key():
    """The config rows of the table are the schema's, in its order: one key each, whose values they read."""
    cfg = load_config("tiny_cpu")
    names = [v.name for v in variables.CONFIG_VARIABLES]
    assert names == ["EXPERIMENT_NAME", "FILEROOT", "N_NODES", "N_GPUS_PER_NODE", "MODEL_PATH", "PROFILE_N_MBS",
                     "LOGPROBS_CHUNK_SIZE", "LM_HEAD_LOSS_CHUNK_SIZE", "USE_PRECISION_AWARE_OPTIMIZER",
                     "MAIN_GRADS_DTYPE", "USE_DETERMINISTIC_ALGORITHMS", "SIMULATE_RANK", "PROFILE_FAKE_SEQ_LEN",
                     "PROFILE_FAKE_DATASET_SIZE", "PROFILE_FAKE_LOSS_START_RATIO", "TRAIN_BATCH_SIZE",
                     "MEMORY_MAX_ENTRIES"]
    for v in variables.CONFIG_VARIABLES:  # the preset's value, written as the variable, reads back as itself
        value = config_value(cfg, v.keys[0])
        if value != "" and v.name != "FILEROOT":  # FILEROOT's text is resolved as a path
            assert v.parse(v.name, yaml_value(value)) == value, v.name


def test_profile_ranks_is_declared_beside_both_its_keys_with_their_one_check(tmp_path):
    """PROFILE_RANKS is the schema's Setting of perf_tracer.ranks and memory_profiler.ranks: the variable and either
    key are refused with the same reason, and the variable stays out of the one-key arguments (its ranks are
    resolved against the layout, where pp_rank0 and 0 agree on one stage)."""
    assert variables.RANKS_VARIABLE.keys == ("perf_tracer.ranks", "memory_profiler.ranks")
    assert variables.BY_NAME["PROFILE_RANKS"] is variables.RANKS_VARIABLE
    assert variables.RANKS_VARIABLE not in variables.CONFIG_VARIABLES
    env = {"CONFIG": "tiny_cpu", "RUN_ROOT": str(tmp_path / "run"), "FILEROOT": str(tmp_path / "fr")}
    with pytest.raises(launch.DriverError) as by_variable:
        launch.plan({**env, "PROFILE_RANKS": "5-2"}, [], gpus=0)
    assert str(by_variable.value) == "PROFILE_RANKS='5-2': range '5-2' is reversed; write 2-5 (actor.backend=fsdp:d2)"
    for key in variables.RANKS_VARIABLE.keys:
        with pytest.raises(ConfigError) as by_key:
            load_config("tiny_cpu", [f"{key}=5-2"])
        assert str(by_key.value) == f"{key}='5-2': range '5-2' is reversed; write 2-5"


@pytest.mark.parametrize("name,text,message", [
    ("PROFILE_STEPS", "0, 1", "must be a list of non-negative integers, comma-separated without spaces (0,1)"),
    ("PROFILE_STEPS", " 1", "must be a list of non-negative integers, comma-separated without spaces (1)"),
    ("PROFILE_KINDS", "kernel, memory",
     "must be a non-empty subset of kernel,memory, comma-separated without spaces (kernel,memory)"),
])
def test_lists_are_comma_separated_without_spaces(name, text, message):
    """docs/driver_variables.md writes every list as 0,1: a list with spaces is refused, naming the variable and the
    format (it was read both ways)."""
    assert _refusal(name, text) == f"{name}={text!r}: {message}"
    assert variables.BY_NAME[name].parse(name, "".join(text.split())) is not None


_KEYS = ("selective_recompute,fewer_micro_batches,balanced_routing,cutlass_grouped_gemm,expandable_segments,"
         "chunked_lm_head,precision_aware_optimizer,more_micro_batches,distributed_optimizer,fit_oom,recompute_plan")


@pytest.mark.parametrize("text,message", [
    (",", f"must be an integer from 0 to 8 or a comma-separated list of what-if keys from {_KEYS} (an empty key)"),
    ("fit_oom,", f"must be an integer from 0 to 8 or a comma-separated list of what-if keys from {_KEYS} "
                 "(an empty key)"),
    ("a,,b", f"must be an integer from 0 to 8 or a comma-separated list of what-if keys from {_KEYS} "
             "(unknown: a,b; an empty key)"),
    ("2,3", f"must be an integer from 0 to 8 or a comma-separated list of what-if keys from {_KEYS} "
            "(unknown: 2,3)"),
    (" 2", "must be an integer from 0 to 8 or a list of what-if keys, comma-separated without spaces (2)"),
    ("9", "must be an integer from 0 to 8"),
])
def test_try_what_ifs_refusals_name_keys_spaces_and_empty_keys(text, message):
    """``TRY_WHAT_IFS`` text with a comma or a space is a list of keys, refused as one: an empty key is named so."""
    assert _refusal("TRY_WHAT_IFS", text) == f"TRY_WHAT_IFS={text!r}: {message}"


def test_a_long_list_is_echoed_cut_to_80_characters():
    """A 5000-item value is echoed as its first 80 characters and ``…``, not 20 KB (the unknown keys too)."""
    keys = ",".join(["fit_oom"] * 5000)
    assert _refusal("TRY_WHAT_IFS", keys) == (f"TRY_WHAT_IFS={keys[:80] + '…'!r}: must list at most 8 what-if keys "
                                              "(one trial each)")
    wrong = ",".join(["abcd"] * 5000)
    assert _refusal("TRY_WHAT_IFS", wrong) == (
        f"TRY_WHAT_IFS={wrong[:80] + '…'!r}: must be an integer from 0 to 8 or a comma-separated list of what-if keys "
        f"from {_KEYS} (unknown: {wrong[:80]}…)")
    spaced = ", ".join(["0"] * 5000)
    assert _refusal("PROFILE_STEPS", spaced) == (
        f"PROFILE_STEPS={spaced[:80] + '…'!r}: must be a list of non-negative integers, comma-separated without spaces "
        f"({','.join(['0'] * 41)[:80]}…)")


def test_profile_ranks_with_spaces_is_refused_naming_the_format(tmp_path):
    env = {"CONFIG": "tiny_cpu", "RUN_ROOT": str(tmp_path / "run"), "FILEROOT": str(tmp_path / "fr")}
    with pytest.raises(launch.DriverError) as err:
        launch.plan({**env, "PROFILE_RANKS": "0, 1"}, [], gpus=0)
    assert str(err.value) == ("PROFILE_RANKS='0, 1': must be pp_rank0, empty (all ranks) or ranks and ranges such as "
                              "0,2-4, comma-separated without spaces (0,1) (actor.backend=fsdp:d2)")
    _, settings, _ = launch.plan({**env, "PROFILE_RANKS": "0,1"}, [], gpus=0)
    assert "PROFILE_RANKS=0-1\t# env" in settings
    assert not (tmp_path / "run").exists()
