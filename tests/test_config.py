"""Config loading: YAML + interpolation + dotted overrides, and validation messages."""
from pathlib import Path

import pytest

from sftprof.config import ConfigError, load_config, to_yaml

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
    assert cfg.actor.logprobs_chunk_size == 128


def test_qwen35_and_tiny_preset():
    cfg = load_config(ROOT / "qwen3_5_35b_a3b_sft_profile.yaml")
    assert (cfg.actor.backend, cfg.profile.fake_seq_len) == ("megatron:(attn:d4t2|ffn:d1e8)", 32768)
    tiny = load_config("tiny_cpu")
    assert tiny.actor.backend == "fsdp:d2" and tiny.actor.path == "tiny_qwen3_moe"
    assert tiny.profile.fake_seq_len == 1024  # long enough for 8 logprob chunks of 128 tokens, cheap on 2 cores


def test_interpolation_follows_overrides():
    cfg = load_config(FLAGSHIP, ["profile.fake_seq_len=32768", "perf_tracer.profile_steps=[0,1]"])
    assert cfg.actor.mb_spec.max_tokens_per_mb == 32768 == cfg.train_dataset.max_length
    assert cfg.perf_tracer.profile_steps == [0, 1]
    assert "fake_seq_len: 32768" in to_yaml(cfg)


@pytest.mark.parametrize("override,message", [
    ("actor.logprobs_chunk_size=-1", "actor.logprobs_chunk_size=-1: must be an integer >= 0"),
    ("actor.logprob_chunk_size=128", "actor.logprob_chunk_size: Key 'logprob_chunk_size' not in 'ActorConfig'"),
    ("profile.fake_seq_len=abc", "profile.fake_seq_len: Value 'abc' of type 'str' could not be converted to Integer"),
    ("profile.fake_seq_len=1", "profile.fake_seq_len=1: must be an integer >= 2"),
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
    ("memory_profiler.max_entries=0", "memory_profiler.max_entries=0: must be an integer >= 1"),
    ("nonsense", "override 'nonsense': expected key=value"),
    ("memory_profiler.profile_steps=[0]", "set one profile kind per trial"),
    ("actor.mb_spec.max_tokens_per_mb=8", "actor.mb_spec.max_tokens_per_mb=8: must be 0 (no limit) or >= one sequence (profile.fake_seq_len=131072)"),
])
def test_bad_values_name_key_value_and_accepted(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config(FLAGSHIP, ["perf_tracer.enabled=true", "perf_tracer.profile_steps=[0]", override])
    assert message in str(exc.value)


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: {backend: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such file; accepted: a YAML path or a bundled preset"):
        load_config(tmp_path / "missing.yaml")
    typo = tmp_path / "typo.yaml"
    typo.write_text(FLAGSHIP.read_text().replace("fake_seq_len:", "fake_seq_length:"))
    with pytest.raises(ConfigError, match="profile.fake_seq_length"):
        load_config(typo)


def test_enable_chunked_logits_false_means_unchunked():
    from sftprof.config import effective_logprobs_chunk_size

    assert effective_logprobs_chunk_size(load_config(FLAGSHIP)) == 128
    cfg = load_config(FLAGSHIP, ["actor.megatron.enable_chunked_logits=false"])
    assert effective_logprobs_chunk_size(cfg) == 0
