"""Config loading: YAML + interpolation + dotted overrides, and validation messages."""
from pathlib import Path

import pytest

from sftprof.config import PRESET_DIR, ConfigError, load_config, resolve_config_path, to_yaml
from sftprof.config.loading import SHIPPED_DIR

ROOT = Path(__file__).resolve().parents[1]
FLAGSHIP = ROOT / "qwen3_30b_a3b_sft_profile.yaml"


def test_flagship_seed_settings():
    cfg = load_config(FLAGSHIP)
    assert cfg.actor.backend == "megatron:(attn:d2c4|ffn:d1e8)"
    assert cfg.profile.fake_seq_len == 131072
    assert (cfg.train_dataset.batch_size, cfg.actor.mb_spec.n_mbs) == (4, 2)
    assert cfg.actor.megatron.recompute_granularity == "full"
    assert cfg.actor.megatron.use_precision_aware_optimizer is True
    assert cfg.actor.megatron.main_grads_dtype == "bfloat16"
    assert cfg.actor.megatron.ddp.grad_reduce_in_fp32 is False
    assert cfg.actor.loss.logprobs_chunk_size == 128 and cfg.actor.loss.resolved_path() == "logprobs"


def test_qwen35_and_tiny_preset():
    cfg = load_config(ROOT / "qwen3_5_35b_a3b_sft_profile.yaml")
    assert (cfg.actor.backend, cfg.profile.fake_seq_len) == ("megatron:(attn:d4t2|ffn:d1e8)", 32768)
    tiny = load_config("tiny_cpu")
    assert tiny.actor.backend == "fsdp:d2" and tiny.actor.path == "tiny_qwen3_moe"
    assert tiny.profile.fake_seq_len == 1024  # long enough for 8 logprob chunks of 128 tokens, cheap on 2 cores


def test_transformer_impl_words_survive_yaml():
    """YAML 1.1 reads on/off as booleans: the setting's words are Megatron-LM's --transformer-impl ones."""
    for impl in ("auto", "transformer_engine", "local"):
        assert load_config(FLAGSHIP, [f"actor.megatron.transformer_impl={impl}"]).actor.megatron.transformer_impl == impl


def test_interpolation_follows_overrides():
    cfg = load_config(FLAGSHIP, ["profile.fake_seq_len=32768", "perf_tracer.profile_steps=[0,1]"])
    assert cfg.actor.mb_spec.max_tokens_per_mb == 32768 == cfg.train_dataset.max_length
    assert cfg.perf_tracer.profile_steps == [0, 1]
    assert "fake_seq_len: 32768" in to_yaml(cfg)


@pytest.mark.parametrize("override,message", [
    ("actor.loss.logprobs_chunk_size=-1", "actor.loss.logprobs_chunk_size=-1: must be an integer >= 0"),
    ("actor.logprob_chunk_size=128", "actor.logprob_chunk_size: Key 'logprob_chunk_size' not in 'ActorConfig'"),
    ("profile.fake_seq_len=abc", "profile.fake_seq_len: Value 'abc' of type 'str' could not be converted to Integer"),
    ("profile.fake_seq_len=1", "profile.fake_seq_len=1: must be an integer from 2 to 134217728 (2**27: token "
                               "positions within int32, and the fake sample every rank builds fits in memory)"),
    ("profile.fake_dataset_size=0", "profile.fake_dataset_size=0: must be an integer >= 1"),
    ("profile.fake_loss_start_ratio=1.0", "profile.fake_loss_start_ratio=1.0: must be a number in [0, 1)"),
    ("actor.dtype=fp8", "actor.dtype='fp8': must be one of ['bfloat16', 'float16', 'float32']"),
    ("actor.megatron.recompute_granularity=most", "actor.megatron.recompute_granularity='most': must be one of ['full', 'selective', 'none']"),
    ("actor.megatron.main_grads_dtype=float16", "actor.megatron.main_grads_dtype='float16': must be one of ['float32', 'bfloat16']"),
    ("actor.megatron.use_precision_aware_optimizer=false", "actor.megatron.main_grads_dtype='bfloat16': must be float32 unless actor.megatron.use_precision_aware_optimizer=true"),
    ("actor.backend=megatron:(attn:d2c4|ffn:d1e4)", "actor.backend='megatron:(attn:d2c4|ffn:d1e4)'"),
    ("perf_tracer.ranks=5-2", "perf_tracer.ranks='5-2': range '5-2' is reversed"),
    ("train_dataset.batch_size=3", "train_dataset.batch_size=3: must be a multiple of the data-parallel size 2"),
    ("actor.mb_spec.n_mbs=3", "actor.mb_spec.n_mbs=3: must be <= sequences per data-parallel rank"),
    ("memory_profiler.max_entries=0", "memory_profiler.max_entries=0: must be an integer from 1 to "
                                      "9223372036854775807 (2**63 - 1, what torch's allocator history takes)"),
    ("actor.megatron.transformer_impl=te", "actor.megatron.transformer_impl='te': must be one of ['auto', "
                                           "'transformer_engine', 'local']"),
    ("actor.megatron.transformer_impl=off", "actor.megatron.transformer_impl='False': must be one of ['auto', "
                                            "'transformer_engine', 'local'] (YAML reads on/off, yes/no and true/false "
                                            "as a boolean: the value given was one of these)"),
    ("nonsense", "override 'nonsense': expected key=value"),
    ("memory_profiler.profile_steps=[0]", "set one profile kind per trial"),
    ("actor.mb_spec.max_tokens_per_mb=8", "actor.mb_spec.max_tokens_per_mb=8: must be 0 (no limit) or >= one sequence (profile.fake_seq_len=131072)"),
    ("experiment_name=../../etc", "experiment_name='../../etc': must be letters, digits, '_' and '-' only"),
    ("experiment_name=/abs", "experiment_name='/abs': must be letters, digits, '_' and '-' only"),
])
def test_bad_values_name_key_value_and_accepted(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config(FLAGSHIP, ["perf_tracer.enabled=true", "perf_tracer.profile_steps=[0]", override])
    assert message in str(exc.value)


def test_a_shipped_yaml_is_found_by_its_name_from_any_folder(tmp_path, monkeypatch):
    """CONFIG=qwen3_5_35b_a3b_sft_profile.yaml (the README's Qwen3.5 line) loads outside the repository, as the
    default does (reviewer: it was 'no such file' there); a file of that name in the current folder comes first, and a
    path with a folder is never looked up in the repository."""
    monkeypatch.chdir(tmp_path)
    name = "qwen3_5_35b_a3b_sft_profile.yaml"
    assert resolve_config_path(name) == SHIPPED_DIR / name
    assert load_config(name).actor.path == load_config(SHIPPED_DIR / name).actor.path
    (tmp_path / name).write_text((SHIPPED_DIR / name).read_text())
    assert resolve_config_path(name) == Path(name)
    with pytest.raises(ConfigError) as exc:
        resolve_config_path(f"sub/{name}")
    assert str(exc.value) == (f"config='sub/{name}': no such file; accepted: a YAML path, a shipped YAML "
                              f"['qwen3_30b_a3b_sft_profile.yaml', '{name}'] or a bundled preset "
                              "['tiny_cpu', 'tiny_qwen3_5_cpu']")


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: {backend: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such file; accepted: a YAML path, a shipped YAML"):
        load_config(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    for text in ("", "# only a comment\n"):
        empty.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_config(empty)
        assert str(exc.value) == (f"config file {empty} is empty; accepted: a YAML mapping of config keys, e.g. the "
                                  f"bundled preset {PRESET_DIR / 'tiny_cpu.yaml'}")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as exc:
        load_config(listed)
    assert str(exc.value) == f"config file {listed}: must be a mapping of config keys (key: value lines), not a list"
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path)
    assert str(exc.value) == (f"config={tmp_path!r}: is a directory; accepted: a YAML path, a shipped YAML "
                              "['qwen3_30b_a3b_sft_profile.yaml', 'qwen3_5_35b_a3b_sft_profile.yaml'] or a bundled "
                              "preset ['tiny_cpu', 'tiny_qwen3_5_cpu']")
    typo = tmp_path / "typo.yaml"
    typo.write_text(FLAGSHIP.read_text().replace("fake_seq_len:", "fake_seq_length:"))
    with pytest.raises(ConfigError, match="profile.fake_seq_length"):
        load_config(typo)


@pytest.mark.parametrize("key", ["actor.logprobs_chunk_size", "actor.megatron.lm_head_loss_chunk_size",
                                 "actor.megatron.enable_chunked_logits"])
def test_old_loss_key_names_are_unknown_keys(key, tmp_path):
    """The loss settings have one name each (actor.loss.*): the names of earlier releases are refused like any
    unknown key, in an override and in a YAML file, naming the key."""
    with pytest.raises(ConfigError) as exc:
        load_config(FLAGSHIP, [f"{key}=0"])
    section, name = key.rsplit(".", 1)
    assert str(exc.value).startswith(f"{key}: Key '{name}' not in ")
    old_style = tmp_path / "old.yaml"
    tiny = (ROOT / "sftprof" / "presets" / "tiny_cpu.yaml").read_text()
    old_style.write_text(tiny.replace("  mb_spec:\n", f"  {name}: 0\n  mb_spec:\n") if section == "actor" else
                         tiny.replace("profile:\n", f"  megatron:\n    {name}: 0\nprofile:\n"))
    with pytest.raises(ConfigError) as exc:
        load_config(old_style)
    assert str(exc.value).startswith(f"{key}: Key '{name}' not in ") and str(old_style) in str(exc.value)


def test_loss_defaults_are_the_schemas():
    """Every shipped YAML leaves actor.loss to the schema: one default for each loss setting."""
    for yaml in (FLAGSHIP, ROOT / "qwen3_5_35b_a3b_sft_profile.yaml", PRESET_DIR / "tiny_cpu.yaml",
                 PRESET_DIR / "tiny_qwen3_5_cpu.yaml"):
        assert "chunk_size:" not in yaml.read_text(), yaml
        loss = load_config(yaml).actor.loss
        assert (loss.path, loss.logprobs_chunk_size, loss.lm_head_loss_chunk_size) == ("auto", 128, 0), yaml


@pytest.mark.parametrize("overrides,message", [
    (["actor.loss.path=lm_head"], "actor.loss.lm_head_loss_chunk_size=0: must be > 0 with actor.loss.path=lm_head"),
    (["actor.loss.path=logprobs", "actor.loss.lm_head_loss_chunk_size=8"],
     "actor.loss.lm_head_loss_chunk_size=8: must be 0 with actor.loss.path=logprobs"),
    (["actor.loss.path=fused"], "actor.loss.path='fused': must be one of ['auto', 'lm_head', 'logprobs', 'reference']"),
    (["actor.loss.path=reference", "actor.backend=megatron:t2"], "actor.loss.path='reference': needs TP=1"),
])
def test_bad_loss_settings(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(FLAGSHIP, overrides)
    assert message in str(exc.value)


def test_type_error_names_the_layer_it_comes_from():
    """A value of the wrong type is attributed to the override that set it, not to the YAML file."""
    with pytest.raises(ConfigError, match=r"^actor\.mb_spec\.n_mbs: Value 'abc' of type 'str' could not be converted "
                                          r"to Integer; accepted: an integer \(the key's range is checked once it is "
                                          r"one\) \(overrides actor\.mb_spec\.n_mbs=abc\)$"):
        load_config("tiny_cpu", ["actor.mb_spec.n_mbs=abc"])


@pytest.mark.parametrize("key, accepted", [("attention_forward_chunks", "an integer >= 1"),
                                           ("moe_alltoall_chunks", "an integer from 1 to 64")])
@pytest.mark.parametrize("value, message", [
    ("0", "actor.megatron.{key}=0: must be {accepted}"),
    ("-1", "actor.megatron.{key}=-1: must be {accepted}"),
    ("1.5", "actor.megatron.{key}: Value '1.5' of type 'float' could not be converted to Integer; "
            "accepted: an integer (the key's range is checked once it is one) (overrides "
            "actor.megatron.{key}=1.5)"),
    ("x", "actor.megatron.{key}: Value 'x' of type 'str' could not be converted to Integer; "
          "accepted: an integer (the key's range is checked once it is one) (overrides "
          "actor.megatron.{key}=x)"),
    ("true", "actor.megatron.{key}: Value 'True' of type 'bool' could not be converted to Integer; "
             "accepted: an integer (the key's range is checked once it is one) (overrides "
             "actor.megatron.{key}=true)"),
    ("", "actor.megatron.{key}: empty value; accepted: an integer (the key's range is checked once it is one) "
         "(overrides actor.megatron.{key}=)"),
])
def test_chunk_counts_refused_with_what_is_accepted(key, accepted, value, message):
    """``attention_forward_chunks`` takes integers >= 1 only, ``moe_alltoall_chunks`` 1 to 64; refused with the key."""
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", [f"actor.megatron.{key}={value}"])
    assert str(exc.value) == message.format(key=key, accepted=accepted)


@pytest.mark.parametrize("key,accepted", [
    ("profile.fake_loss_start_ratio", "a number (the key's range is checked once it is one)"),
    ("actor.megatron.moe_sorted_permute", "true or false (also yes/no, on/off, 1/0)"),
    ("actor.dtype", "a text value (an empty one is written key='')"),
])
def test_empty_override_names_key_and_accepted(key, accepted):
    """``key=`` (read as None) is refused naming the key and what its type accepts."""
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", [f"{key}="])
    assert str(exc.value) == f"{key}: empty value; accepted: {accepted} (overrides {key}=)"


@pytest.mark.parametrize("value", ["65", "99999999999"])
def test_moe_alltoall_chunks_bounded(value):
    """More than 64 chunks (a typo, or a token count) is refused before any trial; 64 and 1 are taken."""
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", [f"actor.megatron.moe_alltoall_chunks={value}"])
    assert str(exc.value) == f"actor.megatron.moe_alltoall_chunks={value}: must be an integer from 1 to 64"
    assert [load_config("tiny_cpu", [f"actor.megatron.moe_alltoall_chunks={n}"]).actor.megatron.moe_alltoall_chunks
            for n in (1, 64)] == [1, 64]


@pytest.mark.parametrize("key", ["moe_sorted_permute", "moe_dedup_alltoall", "moe_fused_router", "cp_comm_overlap"])
def test_moe_dispatch_switches_default_on_and_bool_only(key):
    """``actor.megatron.moe_sorted_permute`` / ``moe_dedup_alltoall`` / ``moe_fused_router`` / ``cp_comm_overlap``:
    on in the defaults and the shipped YAML,
    off by override, and a non-boolean is refused naming the key, the accepted values and the override."""
    assert getattr(load_config("tiny_cpu").actor.megatron, key) is True
    assert getattr(load_config(FLAGSHIP).actor.megatron, key) is True
    assert getattr(load_config(FLAGSHIP, [f"actor.megatron.{key}=false"]).actor.megatron, key) is False
    accepted = r"; accepted: true or false \(also yes/no, on/off, 1/0\)"
    with pytest.raises(ConfigError, match=rf"^actor\.megatron\.{key}: Value 'maybe' is not a valid bool "
                                          r"\(type str\)" + accepted +
                                          rf" \(overrides actor\.megatron\.{key}=maybe\)$"):
        load_config(FLAGSHIP, [f"actor.megatron.{key}=maybe"])
    # 1 and 0 are booleans; OmegaConf would read any other integer (2, -1) as true
    assert getattr(load_config(FLAGSHIP, [f"actor.megatron.{key}=0"]).actor.megatron, key) is False
    assert getattr(load_config(FLAGSHIP, [f"actor.megatron.{key}=1"]).actor.megatron, key) is True
    for value in ("-1", "2"):
        with pytest.raises(ConfigError, match=rf"^actor\.megatron\.{key}={value}: not a boolean"
                                              + accepted + r" \(the overrides\)$"):
            load_config(FLAGSHIP, [f"actor.megatron.{key}={value}"])


def test_integer_for_a_boolean_in_the_yaml_is_refused(tmp_path):
    """The same check on the YAML file's layer, for any boolean key (here ``actor.gradient_checkpointing``)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(FLAGSHIP.read_text().replace("gradient_checkpointing: true", "gradient_checkpointing: 5"))
    with pytest.raises(ConfigError, match=r"^actor\.gradient_checkpointing=5: not a boolean; accepted: true or false "
                                          rf"\(also yes/no, on/off, 1/0\) \(config {cfg}\)$"):
        load_config(cfg)



def test_force_load_balancing_is_off_by_default_and_megatron_only():
    """``actor.megatron.moe_router_force_load_balancing``: off in the defaults and the shipped YAML (not the HF
    model's routing), passed to megatron-core's field of the same name, refused for the fsdp backend."""
    from sftprof.models import megatron_config as mc

    assert load_config("tiny_cpu").actor.megatron.moe_router_force_load_balancing is False
    flagship = load_config(FLAGSHIP)
    assert flagship.actor.megatron.moe_router_force_load_balancing is False
    assert mc.training_config_kwargs(flagship, have_te=True)["moe_router_force_load_balancing"] is False
    on = load_config(FLAGSHIP, ["actor.megatron.moe_router_force_load_balancing=true"])
    assert mc.training_config_kwargs(on, have_te=True)["moe_router_force_load_balancing"] is True
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", ["actor.megatron.moe_router_force_load_balancing=true"])
    assert str(exc.value) == ("actor.megatron.moe_router_force_load_balancing=true: megatron-core's router option, for "
                              "the megatron backend only; actor.backend='fsdp:d2'; accepted here: false")


def test_entry_points_refuse_a_key_given_twice_with_different_values(tmp_path):
    """``python train_sft_profile.py`` (and ``profile_rank_utils.py``) refuse a key set twice to different values, as
    the driver does, before any process group (OmegaConf alone would keep the last value); the same value is taken."""
    import subprocess
    import sys

    from sftprof.config import last_value_per_key, load_config_or_exit, reject_repeated_keys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "train_sft_profile.py"), "--config", "tiny_cpu",
                           "actor.num_layers=1", "actor.num_layers=2"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        "sftprof: configuration error: arguments actor.num_layers=1 and actor.num_layers=2: one config key given twice "
        "with different values; give actor.num_layers once\n")
    assert list(tmp_path.iterdir()) == []  # nothing written
    with pytest.raises(SystemExit) as exc:
        load_config_or_exit("tiny_cpu", ["seed=1", " seed =2"])
    assert exc.value.code == 2
    assert load_config_or_exit("tiny_cpu", ["actor.num_layers=1", "actor.num_layers=1"]).actor.num_layers == 1
    reject_repeated_keys(["a.b=1", "a.c=1", "a.b=1"])
    assert last_value_per_key(["a=1", "b=2", "a=3", "c", "b=2"]) == ["a=3", "c", "b=2"]


SEQ_ACCEPTED = ("must be an integer from 2 to 134217728 (2**27: token positions within int32, and the fake sample "
                "every rank builds fits in memory)")


@pytest.mark.parametrize("overrides,message", [
    # the reviewer's case: PROFILE_FAKE_SEQ_LEN=99999999999999999999 launched, and every rank died of MemoryError
    (["profile.fake_seq_len=99999999999999999999"], f"profile.fake_seq_len=99999999999999999999: {SEQ_ACCEPTED}"),
    (["profile.fake_seq_len=134217729"], f"profile.fake_seq_len=134217729: {SEQ_ACCEPTED}"),
    # tiny_cpu: fsdp:d2, 1024 tokens: at most 2**27 / 1024 = 131072 sequences per DP rank, 262144 in all
    (["train_dataset.batch_size=262146"], "train_dataset.batch_size=262146: must be <= 262144: a data-parallel rank's "
     "micro-batches hold batch_size / dp x profile.fake_seq_len tokens a step (dp=2, fake_seq_len=1024), at most "
     "134217728 (2**27)"),
    (["seed=4294967296"], "seed=4294967296: must be an integer from 0 to 4294967295 (2**32 - 1, NumPy's range)"),
    (["memory_profiler.max_entries=9223372036854775808"], "memory_profiler.max_entries=9223372036854775808: must be "
     "an integer from 1 to 9223372036854775807 (2**63 - 1, what torch's allocator history takes)"),
    (["trial_name=../../x"], "trial_name='../../x': must be letters, digits, '_' and '-' only"),
    (["trial_name=a/b"], "trial_name='a/b': must be letters, digits, '_' and '-' only"),
    (["perf_tracer.enabled=true", "perf_tracer.profile_steps=[5]", "total_train_steps=1"],
     "perf_tracer.profile_steps=[5]: step(s) [5] never run with total_train_steps=1 (it runs step 0); accepted: "
     "steps < total_train_steps (or raise total_train_steps to 6 or more)"),
    # the reviewer's case: both steps' traces went to rank0.pt.trace.json, step 0's overwritten by step 1's
    (["perf_tracer.enabled=true", "perf_tracer.profile_steps=[0,1]", "total_train_steps=2"],
     "perf_tracer.profile_steps=[0, 1]: one kernel-profiled step per trial (each rank's trace is "
     "LOG_DIR/perf_tracer/rank<rank>.pt.trace.json, which a second step would overwrite); accepted: one step, e.g. "
     "[0], or [] for none; to profile several steps, run one trial per step: the driver does, PROFILE_STEPS=0,1"),
    (["memory_profiler.profile_steps=[0,2,3]", "total_train_steps=2"],
     "memory_profiler.profile_steps=[0, 2, 3]: step(s) [2, 3] never run with total_train_steps=2 (it runs steps 0 to "
     "1); accepted: steps < total_train_steps (or raise total_train_steps to 4 or more)"),
])
def test_out_of_range_values_are_refused_with_the_accepted_range(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", overrides)
    assert str(exc.value) == message


def test_upper_bounds_and_profile_steps_accept_their_limits():
    cfg = load_config("tiny_cpu", ["profile.fake_seq_len=134217728", "train_dataset.batch_size=2", "seed=4294967295",
                                   "memory_profiler.profile_steps=[1]", "total_train_steps=2", "trial_name=a-b_1"])
    assert (cfg.profile.fake_seq_len, cfg.seed, cfg.trial_name) == (2**27, 2**32 - 1, "a-b_1")
    # a disabled tracer's steps are not run: not checked against total_train_steps, nor counted
    assert load_config("tiny_cpu", ["perf_tracer.profile_steps=[5]", "total_train_steps=1"]).perf_tracer.enabled is False
    assert load_config("tiny_cpu", ["perf_tracer.profile_steps=[0,1]", "total_train_steps=2"]).perf_tracer.enabled is False
    # one kernel step per trial; memory snapshots of several steps go to their own step_<N>/ folders
    assert load_config("tiny_cpu", ["perf_tracer.enabled=true", "perf_tracer.profile_steps=[1]",
                                    "total_train_steps=2"]).perf_tracer.profile_steps == [1]
    assert load_config("tiny_cpu", ["memory_profiler.profile_steps=[0,1]",
                                    "total_train_steps=2"]).memory_profiler.profile_steps == [0, 1]


BACKEND_ACCEPTED = "an allocation mode BACKEND:LAYOUT, e.g. fsdp:d2, megatron:d2t2p2 or megatron:(attn:d2c4|ffn:d1e8)"
STEPS_ACCEPTED = "a list of step numbers in brackets, e.g. [0] or [0,1] ([] for none)"
KERNEL_STEPS_ACCEPTED = ("a list of step numbers in brackets, e.g. [0] (one step per trial when perf_tracer.enabled=true; "
                         "[] for none)")


@pytest.mark.parametrize("override,message", [
    # the reviewer's cases: OmegaConf said "Cannot convert 'DictConfig' to string" / "AnyNode is not a ListConfig"
    ("actor.backend=megatron:", f"actor.backend='megatron:': read as a mapping ({{'megatron': None}}), not text; "
     f"accepted: {BACKEND_ACCEPTED} (text that YAML reads as a mapping or list is quoted: actor.backend='...') "
     "(the overrides)"),
    ("perf_tracer.profile_steps=abc", f"perf_tracer.profile_steps='abc': read as text, not a list; accepted: "
     f"{KERNEL_STEPS_ACCEPTED} (the overrides)"),
    ("perf_tracer.profile_steps=1", f"perf_tracer.profile_steps='1': read as a number, not a list; accepted: "
     f"{KERNEL_STEPS_ACCEPTED} (the overrides)"),
    ("memory_profiler.profile_steps=", f"memory_profiler.profile_steps: empty value; accepted: {STEPS_ACCEPTED} "
     "(the overrides)"),
    # was an uncaught TypeError: Cannot merge incompatible container types
    ("actor.megatron.recompute_modules={a: 1}", "actor.megatron.recompute_modules='{a: 1}': read as a mapping "
     "({'a': 1}), not a list; accepted: a list in brackets of ['core_attn', 'layernorm', 'mlp', 'moe', "
     "'shared_experts'], e.g. [core_attn] (the overrides)"),
    ("actor.num_layers=[1]", "actor.num_layers='[1]': read as a list ([1]), not a number; accepted: an integer "
     "(the overrides)"),
    ("actor=3", "actor='3': read as a number, not a section; accepted: keys below it, e.g. actor.backend=... "
     "(the overrides)"),
])
def test_values_of_the_wrong_shape_name_key_value_and_accepted(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", [override])
    assert str(exc.value) == message


def test_wrong_shape_in_the_config_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text((PRESET_DIR / "tiny_cpu.yaml").read_text().replace('backend: "fsdp:d2"', "backend: {megatron: d2}"))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value) == (f"actor.backend={{'megatron': 'd2'}}: read as a mapping, not text; accepted: "
                              f"{BACKEND_ACCEPTED} (text that YAML reads as a mapping or list is quoted: "
                              f"actor.backend='...') (config {path})")


def test_configuration_error_is_one_write(monkeypatch):
    """Every rank prints its configuration error into one pipe at once: one write per message (print wrote the text
    and the newline separately, and one run's launcher.log held two ranks' messages glued on one line)."""
    from sftprof.config import exit_config_error

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Recorder())
    with pytest.raises(SystemExit) as exc:
        exit_config_error("profile.fake_seq_len=1: must be ...")
    assert exc.value.code == 2
    assert writes == ["sftprof: configuration error: profile.fake_seq_len=1: must be ...\n"]
