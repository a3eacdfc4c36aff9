"""Typed configuration for an sftprof trial: YAML + ``${...}`` interpolation + dotted overrides.

The schema is a tree of dataclasses used as OmegaConf structured configs, so unknown keys and
wrong types are rejected by OmegaConf itself; value ranges and choices are checked afterwards by
:func:`validate`. Every failure is raised as :class:`ConfigError`, whose message names the dotted
key, the offending value and what is accepted. Entry points turn it into exit code 2 before any
process group starts (:func:`load_config_or_exit`).

Key names follow ``shared/DESIGN.md`` (and the AReaL-style seed config): for example
``actor.megatron.lm_head_loss_chunk_size`` or ``profile.fake_seq_len``.
"""
from __future__ import annotations

import getpass
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

PACKAGE_DIR = Path(__file__).resolve().parent
PRESET_DIR = PACKAGE_DIR / "presets"

DTYPES = ("bfloat16", "float16", "float32")
# Megatron OptimizerConfig accepts these for the precision-aware optimizer fields (TE FusedAdam).
MAIN_GRADS_DTYPES = ("float32", "bfloat16")
MAIN_PARAMS_DTYPES = ("float32", "float16")
EXP_AVG_DTYPES = ("float32", "float16", "bfloat16", "uint8")
RECOMPUTE_GRANULARITIES = ("full", "selective", "none")
RECOMPUTE_METHODS = ("uniform", "block")
# megatron-core 0.16.1 TransformerConfig.recompute_modules choices that this project's layer specs support
# ("moe_act" needs TE's grouped GEMM, "mla_up_proj" multi-latent attention: neither is built here).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")
MOE_ROUTER_DTYPES = ("fp32", "fp64", "none")
MOE_DISPATCHERS = ("alltoall", "allgather")
LR_SCHEDULERS = ("constant", "linear", "cosine")


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range.

    The message always names the dotted key (or environment variable), the value and what is
    accepted, e.g. ``actor.logprobs_chunk_size=-1: must be an integer >= 0``.
    """


@dataclass
class ClusterConfig:
    """Where logs go (``fileroot``) and the torchrun layout (nodes x processes per node)."""

    fileroot: str = "/tmp/sftprof"
    n_nodes: int = 1
    n_gpus_per_node: int = 8


@dataclass
class MicroBatchSpec:
    """Micro-batching per data-parallel rank: at least ``n_mbs`` micro-batches (a multiple of
    ``n_mbs_divisor``), each holding at most ``max_tokens_per_mb`` tokens (0 = no limit)."""

    n_mbs: int = 1
    n_mbs_divisor: int = 1
    max_tokens_per_mb: int = 0


@dataclass
class OptimizerSettings:
    """AdamW settings: learning rate, decoupled weight decay, betas, eps, grad-norm clip (0 = off)."""

    lr: float = 1e-5
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gradient_clipping: float = 1.0
    lr_scheduler_type: str = "constant"


@dataclass
class DDPSettings:
    """Megatron DDP: gradient reduction dtype and overlap, distributed optimizer."""

    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = True


@dataclass
class MegatronSettings:
    """Megatron engine and memory-saving settings (precision-aware optimizer dtypes, recompute,
    MoE routing, chunked LM-head loss)."""

    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "float32"
    main_params_dtype: str = "float32"
    exp_avg_dtype: str = "float32"
    exp_avg_sq_dtype: str = "float32"
    ddp: DDPSettings = field(default_factory=DDPSettings)
    use_deterministic_algorithms: bool = False
    # false: ignore actor.logprobs_chunk_size and compute log-probs over all tokens at once (baseline).
    enable_chunked_logits: bool = True
    # Kept from the seed config; the SFT loss has no entropy term, so it changes nothing here.
    entropy_requires_grad: bool = False
    lm_head_loss_chunk_size: int = 0
    recompute_granularity: str = "full"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # Modules re-run in backward with recompute_granularity=selective (megatron-core's names).
    recompute_modules: List[str] = field(default_factory=lambda: ["core_attn"])
    moe_router_dtype: str = "fp32"
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_bias_update_rate: float = 0.0


@dataclass
class ActorConfig:
    """The trained model: allocation mode (``backend``), model path, dtype, micro-batches, optimizer."""

    # Allocation mode: backend plus parallel layout, e.g. "megatron:(attn:d2c4|ffn:d1e8)" or "fsdp:d2".
    backend: str = "fsdp:d1"
    # A Hugging Face model directory (config.json, optional weights/tokenizer) or the name of a
    # bundled config: see sftprof.models.BUNDLED_CONFIGS.
    path: str = "qwen3_30b_a3b"
    # Cut the model to this many decoder layers (0 = as in the model config), for single-GPU slices.
    num_layers: int = 0
    init_from_scratch: bool = True
    dtype: str = "bfloat16"
    gradient_checkpointing: bool = True
    logprobs_chunk_size: int = 0
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    megatron: MegatronSettings = field(default_factory=MegatronSettings)


@dataclass
class FakeDataConfig:
    """Deterministic fake long samples: tokens per sample, dataset size, where the loss mask starts."""

    fake_seq_len: int = 4096
    fake_dataset_size: int = 8
    fake_loss_start_ratio: float = 0.5


@dataclass
class TrainDatasetConfig:
    """Global batch in sequences per step (``batch_size``) and the length cap (0 = none)."""

    batch_size: int = 1
    max_length: int = 0


@dataclass
class PerfTracerConfig:
    """Kernel trials: torch.profiler on ``profile_steps`` for the ranks of ``ranks`` (a rank spec)."""

    enabled: bool = False
    profile_steps: List[int] = field(default_factory=list)
    # Rank spec: "pp_rank0" (rank 0 of every pipeline stage), "" (all ranks) or "0,2-4".
    ranks: str = "pp_rank0"


@dataclass
class MemoryProfilerConfig:
    """Memory trials: allocator snapshots at the end of ``profile_steps`` for the ranks of ``ranks``."""

    profile_steps: List[int] = field(default_factory=list)
    max_entries: int = 100000
    ranks: str = "pp_rank0"


@dataclass
class SFTProfileConfig:
    """Root of the trial configuration (see module docstring for loading and validation)."""

    experiment_name: str = "sftprof"
    trial_name: str = "trial"
    seed: int = 1
    total_train_steps: int = 1
    tokenizer_path: str = ""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    profile: FakeDataConfig = field(default_factory=FakeDataConfig)
    train_dataset: TrainDatasetConfig = field(default_factory=TrainDatasetConfig)
    perf_tracer: PerfTracerConfig = field(default_factory=PerfTracerConfig)
    memory_profiler: MemoryProfilerConfig = field(default_factory=MemoryProfilerConfig)


def resolve_config_path(path: str | Path) -> Path:
    """Return the YAML file for ``path``: an existing file, or the name of a bundled preset.

    Bundled presets live in ``sftprof/presets/<name>.yaml`` (e.g. ``tiny_cpu``).

    Raises:
        ConfigError: neither a file nor a preset of that name exists.
    """
    p = Path(path)
    if p.is_file():
        return p
    preset = PRESET_DIR / f"{path}.yaml"
    if preset.is_file():
        return preset
    presets = sorted(q.stem for q in PRESET_DIR.glob("*.yaml"))
    raise ConfigError(f"config={path!r}: no such file; accepted: a YAML path or a bundled preset {presets}")


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    return f"{key}: {msg}"


def load_config(path: str | Path, overrides: List[str] | None = None) -> SFTProfileConfig:
    """Load a YAML file (or preset name), apply ``key=value`` dotted overrides and validate.

    Args:
        path: YAML file path or bundled preset name (:func:`resolve_config_path`).
        overrides: dotted overrides such as ``["actor.logprobs_chunk_size=128"]``; list values use
            YAML syntax (``perf_tracer.profile_steps=[0,1]``).

    Returns:
        The typed config with every ``${...}`` interpolation resolved.

    Raises:
        ConfigError: unreadable YAML, unknown key, wrong type, bad interpolation, or a value
            outside its accepted range (message names the dotted key, value and accepted values).
    """
    yaml_path = resolve_config_path(path)
    schema = OmegaConf.structured(SFTProfileConfig)
    try:
        file_cfg = OmegaConf.load(yaml_path)
    except Exception as err:  # yaml.YAMLError and OSError alike
        raise ConfigError(f"config={yaml_path}: cannot read YAML: {err}") from err
    dotlist = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value with a dotted key, e.g. actor.logprobs_chunk_size=128")
        dotlist.append(item)
    try:
        merged = OmegaConf.merge(schema, file_cfg)
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(dotlist))
        OmegaConf.resolve(merged)
        cfg: SFTProfileConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{_omegaconf_message(err)} (config {yaml_path})") from err
    validate(cfg)
    return cfg


def _check(ok: bool, key: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: must be {accepted}")


def _choice(key: str, value: str, choices: tuple) -> None:
    _check(value in choices, key, value, f"one of {list(choices)}")


def validate(cfg: SFTProfileConfig) -> None:
    """Check value ranges and choices that the type system cannot express.

    Raises:
        ConfigError: the first violation found, naming the dotted key, value and accepted values.
    """
    from sftprof.allocation import AllocationError, parse_allocation_mode
    from sftprof.ranks import RankSpecError, check_rank_spec_syntax

    _check(cfg.seed >= 0, "seed", cfg.seed, "an integer >= 0")
    _check(cfg.total_train_steps >= 1, "total_train_steps", cfg.total_train_steps, "an integer >= 1")
    _check(cfg.cluster.n_nodes >= 1, "cluster.n_nodes", cfg.cluster.n_nodes, "an integer >= 1")
    _check(cfg.cluster.n_gpus_per_node >= 1, "cluster.n_gpus_per_node", cfg.cluster.n_gpus_per_node, "an integer >= 1")
    try:
        parse_allocation_mode(cfg.actor.backend)
    except AllocationError as err:
        raise ConfigError(f"actor.backend={cfg.actor.backend!r}: {err}") from err
    a = cfg.actor
    _check(a.num_layers >= 0, "actor.num_layers", a.num_layers, "an integer >= 0 (0 = as in the model config)")
    _choice("actor.dtype", a.dtype, DTYPES)
    _check(a.logprobs_chunk_size >= 0, "actor.logprobs_chunk_size", a.logprobs_chunk_size, "an integer >= 0 (0 = all tokens at once)")
    _check(a.mb_spec.n_mbs >= 1, "actor.mb_spec.n_mbs", a.mb_spec.n_mbs, "an integer >= 1")
    _check(a.mb_spec.n_mbs_divisor >= 1, "actor.mb_spec.n_mbs_divisor", a.mb_spec.n_mbs_divisor, "an integer >= 1")
    _check(a.mb_spec.max_tokens_per_mb >= 0, "actor.mb_spec.max_tokens_per_mb", a.mb_spec.max_tokens_per_mb, "an integer >= 0 (0 = no limit)")
    o = a.optimizer
    _check(o.lr > 0, "actor.optimizer.lr", o.lr, "a number > 0")
    _check(o.weight_decay >= 0, "actor.optimizer.weight_decay", o.weight_decay, "a number >= 0")
    _check(0 <= o.beta1 < 1, "actor.optimizer.beta1", o.beta1, "a number in [0, 1)")
    _check(0 <= o.beta2 < 1, "actor.optimizer.beta2", o.beta2, "a number in [0, 1)")
    _check(o.eps > 0, "actor.optimizer.eps", o.eps, "a number > 0")
    _check(o.gradient_clipping >= 0, "actor.optimizer.gradient_clipping", o.gradient_clipping, "a number >= 0 (0 = no clipping)")
    _choice("actor.optimizer.lr_scheduler_type", o.lr_scheduler_type, LR_SCHEDULERS)
    m = a.megatron
    _choice("actor.megatron.main_grads_dtype", m.main_grads_dtype, MAIN_GRADS_DTYPES)
    _choice("actor.megatron.main_params_dtype", m.main_params_dtype, MAIN_PARAMS_DTYPES)
    _choice("actor.megatron.exp_avg_dtype", m.exp_avg_dtype, EXP_AVG_DTYPES)
    _choice("actor.megatron.exp_avg_sq_dtype", m.exp_avg_sq_dtype, EXP_AVG_DTYPES)
    if not m.use_precision_aware_optimizer:
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(m, name)
            _check(value == "float32", f"actor.megatron.{name}", value,
                   "float32 unless actor.megatron.use_precision_aware_optimizer=true (USE_PRECISION_AWARE_OPTIMIZER)")
    elif not m.ddp.use_distributed_optimizer:
        raise ConfigError("actor.megatron.use_precision_aware_optimizer=True: needs "
                          "actor.megatron.ddp.use_distributed_optimizer=true")
    _check(m.lm_head_loss_chunk_size >= 0, "actor.megatron.lm_head_loss_chunk_size", m.lm_head_loss_chunk_size,
           "an integer >= 0 (0 = logits path)")
    _choice("actor.megatron.recompute_granularity", m.recompute_granularity, RECOMPUTE_GRANULARITIES)
    _choice("actor.megatron.recompute_method", m.recompute_method, RECOMPUTE_METHODS)
    _check(m.recompute_num_layers >= 1, "actor.megatron.recompute_num_layers", m.recompute_num_layers, "an integer >= 1")
    mods = list(m.recompute_modules)
    _check(bool(mods) and set(mods) <= set(RECOMPUTE_MODULES) and len(set(mods)) == len(mods),
           "actor.megatron.recompute_modules", mods, f"a non-empty list without repeats of {list(RECOMPUTE_MODULES)}")
    _choice("actor.megatron.moe_router_dtype", m.moe_router_dtype, MOE_ROUTER_DTYPES)
    _choice("actor.megatron.moe_token_dispatcher_type", m.moe_token_dispatcher_type, MOE_DISPATCHERS)
    _check(m.moe_router_bias_update_rate >= 0, "actor.megatron.moe_router_bias_update_rate", m.moe_router_bias_update_rate, "a number >= 0")
    p = cfg.profile
    _check(p.fake_seq_len >= 2, "profile.fake_seq_len", p.fake_seq_len, "an integer >= 2")
    _check(p.fake_dataset_size >= 1, "profile.fake_dataset_size", p.fake_dataset_size, "an integer >= 1")
    _check(0 <= p.fake_loss_start_ratio < 1, "profile.fake_loss_start_ratio", p.fake_loss_start_ratio, "a number in [0, 1)")
    mbt = a.mb_spec.max_tokens_per_mb
    _check(mbt == 0 or mbt >= p.fake_seq_len, "actor.mb_spec.max_tokens_per_mb", mbt,
           f"0 (no limit) or >= one sequence (profile.fake_seq_len={p.fake_seq_len})")
    _check(cfg.train_dataset.batch_size >= 1, "train_dataset.batch_size", cfg.train_dataset.batch_size, "an integer >= 1")
    _check(cfg.train_dataset.max_length >= 0, "train_dataset.max_length", cfg.train_dataset.max_length, "an integer >= 0 (0 = no limit)")
    dp = parse_allocation_mode(a.backend).dp
    bs = cfg.train_dataset.batch_size
    _check(bs % dp == 0, "train_dataset.batch_size", bs, f"a multiple of the data-parallel size {dp} of actor.backend={a.backend!r}")
    _check(a.mb_spec.n_mbs <= bs // dp, "actor.mb_spec.n_mbs", a.mb_spec.n_mbs,
           f"<= sequences per data-parallel rank (train_dataset.batch_size / dp = {bs // dp})")
    for section in ("perf_tracer", "memory_profiler"):
        sec = getattr(cfg, section)
        for s in sec.profile_steps:
            _check(s >= 0, f"{section}.profile_steps", list(sec.profile_steps), "a list of integers >= 0")
        try:
            check_rank_spec_syntax(sec.ranks)
        except RankSpecError as err:
            raise ConfigError(f"{section}.ranks={sec.ranks!r}: {err}") from err
    if cfg.memory_profiler.profile_steps and cfg.perf_tracer.enabled and cfg.perf_tracer.profile_steps:
        raise ConfigError(f"perf_tracer.profile_steps={list(cfg.perf_tracer.profile_steps)} and memory_profiler.profile_steps="
                          f"{list(cfg.memory_profiler.profile_steps)}: set one profile kind per trial (allocator history "
                          "distorts kernel timings)")
    _check(cfg.memory_profiler.max_entries >= 1, "memory_profiler.max_entries", cfg.memory_profiler.max_entries, "an integer >= 1")


def effective_logprobs_chunk_size(cfg: SFTProfileConfig) -> int:
    """Tokens per chunk of the logits path: ``actor.logprobs_chunk_size``, or 0 (all tokens at once)
    when ``actor.megatron.enable_chunked_logits`` is false."""
    return cfg.actor.logprobs_chunk_size if cfg.actor.megatron.enable_chunked_logits else 0


def trial_log_dir(cfg: SFTProfileConfig) -> Path:
    """LOG_DIR of a trial: ``<cluster.fileroot>/logs/<user>/<experiment_name>/<trial_name>/``."""
    return Path(cfg.cluster.fileroot) / "logs" / getpass.getuser() / cfg.experiment_name / cfg.trial_name


def load_config_or_exit(path: str | Path, overrides: List[str] | None = None) -> SFTProfileConfig:
    """:func:`load_config` for entry points: print the error to stderr and exit with status 2."""
    try:
        return load_config(path, overrides)
    except ConfigError as err:
        print(f"sftprof: configuration error: {err}", file=sys.stderr)
        sys.exit(2)


def to_yaml(cfg: SFTProfileConfig) -> str:
    """Return the resolved config as YAML text (for logs and ``profile_settings.log``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
