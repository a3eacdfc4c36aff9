"""Typed configuration for an sftprof trial: YAML + ``${...}`` interpolation + dotted overrides.

The schema is a tree of dataclasses used as OmegaConf structured configs, so unknown keys and
wrong types are rejected by OmegaConf itself; value ranges and choices are checked afterwards by
:func:`validate`, which runs each section's ``check`` method (next to its dataclass) and then the
checks that span sections. Every failure is raised as :class:`ConfigError`, whose message names the dotted
key, the offending value and what is accepted. Entry points turn it into exit code 2 before any
process group starts (:func:`load_config_or_exit`).

Key names follow the AReaL-style seed config: for example ``actor.mb_spec.n_mbs`` or
``profile.fake_seq_len``. Old names kept for compatibility (:data:`LEGACY_LOSS_KEYS`):
``actor.logprobs_chunk_size`` and ``actor.megatron.lm_head_loss_chunk_size`` are read as
``actor.loss.logprobs_chunk_size`` and ``actor.loss.lm_head_loss_chunk_size``, and
``actor.megatron.enable_chunked_logits=false`` as ``actor.loss.logprobs_chunk_size=0``. The mapping
is done per source (the YAML file, then the overrides), before they are merged: a later source
overrides an earlier one whichever name it uses, and one source giving a setting under both names
with different values is an error.
"""
from __future__ import annotations

import getpass
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

PACKAGE_DIR = Path(__file__).resolve().parent
PRESET_DIR = PACKAGE_DIR / "presets"

DTYPES = ("bfloat16", "float16", "float32")
# Megatron OptimizerConfig accepts these for the precision-aware optimizer fields (TE FusedAdam).
MAIN_GRADS_DTYPES = ("float32", "bfloat16")
MAIN_PARAMS_DTYPES = ("float32", "float16")
EXP_AVG_DTYPES = ("float32", "float16", "bfloat16", "uint8")
# The actor.megatron fields the precision-aware optimizer sets (float32 without it).
PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
RECOMPUTE_GRANULARITIES = ("full", "selective", "none")
RECOMPUTE_METHODS = ("uniform", "block")
# megatron-core 0.16.1 TransformerConfig.recompute_modules choices that this project's layer specs support
# ("moe_act" needs TE's grouped GEMM, "mla_up_proj" multi-latent attention: neither is built here).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")
MOE_ROUTER_DTYPES = ("fp32", "fp64", "none")
MOE_DISPATCHERS = ("alltoall", "allgather")
# actor.megatron.cp_attention: how a CP rank's attention is computed (sftprof.models.layers.attention, item 2 of its
# docstring); used by the local layer spec (no Transformer Engine) with CP > 1.
CP_ATTENTION_METHODS = ("masked", "blocks")
TRANSFORMER_ENGINE_MODES = ("auto", "on", "off")
# actor.megatron.moe_alltoall_chunks: each chunk adds 4 all-to-alls per MoE layer to the forward and 3 to the backward
# (sftprof.models.layers.moe_dedup), each with a fixed cost; 64 chunks of 65536 tokens (131072 over CP 2) are 1024 tokens
# each, far past the 2 measured in bench/NOTES.md (twelfth session: what stays exposed at 2 chunks is mostly waiting
# for the slower rank, which more chunks cannot hide). The bound refuses a typo (or a token count given here by
# mistake) before any trial instead of a step of millions of collectives.
MOE_ALLTOALL_CHUNKS_MAX = 64
# Largest profile.fake_seq_len, and largest number of tokens a data-parallel rank's micro-batches hold per step
# (train_dataset.batch_size / dp x profile.fake_seq_len): 2**27 = 134217728 tokens, 1024x the shipped 131072 and far
# inside int32 token positions (< 2**31). The data builder holds them on every rank as int64 ids and labels and a bool
# loss mask (17 bytes a token, sftprof.data): 2.1 GiB per rank at the bound. A longer sample is a typo:
# PROFILE_FAKE_SEQ_LEN=99999999999999999999 launched and every rank died of MemoryError in make_fake_sample.
TOKENS_PER_RANK_MAX = 2**27
FAKE_SEQ_LEN_WHY = " (2**27: token positions within int32, and the fake sample every rank builds fits in memory)"
FAKE_SEQ_LEN_ACCEPTED = f"an integer from 2 to {TOKENS_PER_RANK_MAX}{FAKE_SEQ_LEN_WHY}"
# seed seeds NumPy as well (sftprof.trainer), which takes 0 to 2**32 - 1.
SEED_MAX = 2**32 - 1
# memory_profiler.max_entries: torch's _record_memory_history takes up to sys.maxsize (its default) = 2**63 - 1.
MEMORY_MAX_ENTRIES_MAX = 2**63 - 1
LR_SCHEDULERS = ("constant", "linear", "cosine")
# actor.loss.path: "auto" = lm_head when lm_head_loss_chunk_size > 0, else logprobs (sftprof.loss).
LOSS_PATHS = ("auto", "lm_head", "logprobs", "reference")
# Old key -> key under actor.loss (see the module docstring for the mapping rule).
LEGACY_LOSS_KEYS = {"actor.logprobs_chunk_size": "logprobs_chunk_size",
                    "actor.megatron.lm_head_loss_chunk_size": "lm_head_loss_chunk_size"}
LEGACY_CHUNKED_LOGITS_KEY = "actor.megatron.enable_chunked_logits"


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range.

    The message always names the dotted key (or environment variable), the value and what is
    accepted, e.g. ``actor.logprobs_chunk_size=-1: must be an integer >= 0``.
    """


def _check(ok: bool, key: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: must be {accepted}")


# Names that become one folder of a path (experiment_name, the driver's EXPERIMENT_NAME and PROFILE_STAMP):
# no '/', '.' or '..' can lead outside the folder they are put in.
# What a config file's top level is instead of a mapping, in its error message.
_YAML_KINDS = {str: "string", int: "number", float: "number", bool: "boolean", list: "list"}
NAME_ACCEPTED = "letters, digits, '_' and '-' only"


def is_folder_name(text: str) -> bool:
    """True when ``text`` is a non-empty name of :data:`NAME_ACCEPTED` characters (safe as one path component)."""
    return text.replace("_", "").replace("-", "").isalnum()


def _choice(key: str, value: str, choices: tuple) -> None:
    _check(value in choices, key, value, f"one of {list(choices)}")


def _at_least(section: Any, prefix: str, minimums: dict) -> None:
    """``_check(getattr(section, name) >= lo)`` for each ``name: (lo, accepted)`` of ``minimums``."""
    for name, (lo, accepted) in minimums.items():
        value = getattr(section, name)
        _check(value >= lo, f"{prefix}.{name}", value, accepted)


# Not /tmp/sftprof (the default before): a folder named like the package shadows it for a Python started in its
# parent (``cd /tmp && python -c "import sftprof"`` imports the empty folder as a namespace package).
DEFAULT_FILEROOT = "/tmp/sftprof_fileroot"


@dataclass
class ClusterConfig:
    """Where logs go (``fileroot``, default :data:`DEFAULT_FILEROOT`) and the torchrun layout (nodes x processes per
    node)."""

    fileroot: str = DEFAULT_FILEROOT
    n_nodes: int = 1
    n_gpus_per_node: int = 8

    def check(self) -> None:
        """Raises ConfigError: ``cluster.n_nodes`` or ``cluster.n_gpus_per_node`` < 1."""
        _at_least(self, "cluster", {"n_nodes": (1, "an integer >= 1"), "n_gpus_per_node": (1, "an integer >= 1")})


@dataclass
class MicroBatchSpec:
    """Micro-batching per data-parallel rank: at least ``n_mbs`` micro-batches (a multiple of
    ``n_mbs_divisor``), each holding at most ``max_tokens_per_mb`` tokens (0 = no limit)."""

    n_mbs: int = 1
    n_mbs_divisor: int = 1
    max_tokens_per_mb: int = 0

    def check(self) -> None:
        """Raises ConfigError: a count below its minimum (``actor.mb_spec.*``)."""
        _at_least(self, "actor.mb_spec", {"n_mbs": (1, "an integer >= 1"), "n_mbs_divisor": (1, "an integer >= 1"),
                                          "max_tokens_per_mb": (0, "an integer >= 0 (0 = no limit)")})


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

    def check(self) -> None:
        """Raises ConfigError: a value out of range (``actor.optimizer.*``)."""
        k = "actor.optimizer"
        _check(self.lr > 0, f"{k}.lr", self.lr, "a number > 0")
        _check(self.weight_decay >= 0, f"{k}.weight_decay", self.weight_decay, "a number >= 0")
        _check(0 <= self.beta1 < 1, f"{k}.beta1", self.beta1, "a number in [0, 1)")
        _check(0 <= self.beta2 < 1, f"{k}.beta2", self.beta2, "a number in [0, 1)")
        _check(self.eps > 0, f"{k}.eps", self.eps, "a number > 0")
        _check(self.gradient_clipping >= 0, f"{k}.gradient_clipping", self.gradient_clipping,
               "a number >= 0 (0 = no clipping)")
        _choice(f"{k}.lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)


@dataclass
class LossSettings:
    """How the token loss is computed from the final hidden states (:mod:`sftprof.loss`).

    ``path``: ``lm_head`` (chunked LM head fused with the loss, no full logits; ``lm_head_loss_chunk_size``
    tokens per chunk, > 0), ``logprobs`` (full logits, then the vocab-parallel log-probs
    ``logprobs_chunk_size`` tokens at a time on CPU, 0 = all at once; on CUDA all at once), ``reference`` (full logits, fp32
    ``log_softmax`` and gather: the textbook baseline of tests and benchmarks, TP = 1 only) or ``auto``
    (``lm_head`` when ``lm_head_loss_chunk_size > 0``, else ``logprobs``). Driver variables:
    ``LOGPROBS_CHUNK_SIZE``, ``LM_HEAD_LOSS_CHUNK_SIZE``.
    """

    path: str = "auto"
    logprobs_chunk_size: int = 0
    lm_head_loss_chunk_size: int = 0

    def resolved_path(self) -> str:
        """``lm_head``, ``logprobs`` or ``reference``: ``path`` with ``auto`` decided."""
        if self.path != "auto":
            return self.path
        return "lm_head" if self.lm_head_loss_chunk_size > 0 else "logprobs"

    def check(self) -> None:
        """Raises ConfigError: a negative chunk size, an unknown path, or a chunk size the path does not use
        (``lm_head`` needs ``lm_head_loss_chunk_size > 0``; ``logprobs``/``reference`` need it 0)."""
        k = "actor.loss"
        _choice(f"{k}.path", self.path, LOSS_PATHS)
        _at_least(self, k, {"logprobs_chunk_size": (0, "an integer >= 0 (0 = all tokens at once)"),
                            "lm_head_loss_chunk_size": (0, "an integer >= 0 (0 = logits path)")})
        chunk = self.lm_head_loss_chunk_size
        if self.path == "lm_head":
            _check(chunk > 0, f"{k}.lm_head_loss_chunk_size", chunk, "> 0 with actor.loss.path=lm_head (tokens per chunk)")
        elif self.path in ("logprobs", "reference"):
            _check(chunk == 0, f"{k}.lm_head_loss_chunk_size", chunk,
                   f"0 with actor.loss.path={self.path} (only the lm_head path uses it; or set path=auto)")


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
    MoE routing). The loss settings that used to live here are in :class:`LossSettings`."""

    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "float32"
    main_params_dtype: str = "float32"
    exp_avg_dtype: str = "float32"
    exp_avg_sq_dtype: str = "float32"
    ddp: DDPSettings = field(default_factory=DDPSettings)
    use_deterministic_algorithms: bool = False
    # Kept from the seed config; the SFT loss has no entropy term, so it changes nothing here.
    entropy_requires_grad: bool = False
    recompute_granularity: str = "full"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # Modules re-run in backward with recompute_granularity=selective (megatron-core's names).
    recompute_modules: List[str] = field(default_factory=lambda: ["core_attn"])
    moe_router_dtype: str = "fp32"
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_bias_update_rate: float = 0.0
    # CP > 1 without TE: "blocks" (causal diagonal + full off-diagonal block, merged by log-sum-exp; on an H200
    # 0.50x the single-GPU attention time per CP = 2 rank against 0.79-0.85x, bench/NOTES.md) or "masked" (one
    # SDPA call per chunk with a bottom-right causal mask; also takes attention dropout); see CP_ATTENTION_METHODS.
    cp_attention: str = "blocks"
    # CP > 1, cp_attention=blocks, without TE: the K/V all-gather and the K/V-gradient reduce-scatter are
    # asynchronous and run while the causal diagonal blocks (this rank's own keys) compute
    # (sftprof.models.layers.block_attention.overlapped_cp_attention); false = all-gather first, then the blocks.
    cp_comm_overlap: bool = True
    # CP = 1 without TE, cuDNN, head_dim <= 128: the causal attention's forward as this many query chunks (causal
    # diagonal blocks plus unmasked off-diagonal blocks merged by log-sum-exp), its backward one causal call given
    # the merged output (sftprof.models.layers.block_attention.chunked_causal_attention); 1 = one SDPA call each way.
    # 2: the forward of a 131072-token Qwen3-30B-A3B attention 255.0 -> 242.1 ms on an H200, backward unchanged
    # (bench/NOTES.md).
    attention_forward_chunks: int = 2
    # Without TE, alltoall dispatcher, dropless routing: megatron-core's token permutation by sorts and gathers, no
    # host sync, no atomics (sftprof.models.layers.moe_permute); false = megatron-core's masked_select/scatter_add path.
    moe_sorted_permute: bool = True
    # EP > 1, expert TP 1, dropless alltoall, without TE: one all-to-all row per (token, destination EP rank) instead
    # of one per (token, expert) (sftprof.models.layers.moe_dedup); false = megatron-core's alltoall dispatcher.
    moe_dedup_alltoall: bool = True
    # With moe_dedup_alltoall: each MoE layer's all-to-alls in this many token chunks, asynchronous, so that chunk
    # c's experts run while chunk c + 1's rows and chunk c - 1's outputs are in flight (forward and backward);
    # 1 = one all-to-all each way, the experts waiting for it. At most MOE_ALLTOALL_CHUNKS_MAX.
    moe_alltoall_chunks: int = 2
    # Without TE: the MoE router's top-k, softmaxes and dense [T, E] probs / routing map in one Triton kernel per
    # call (softmax routers, fp32 logits; sftprof.models.layers.router); false = megatron-core's unfused torch.topk path.
    moe_fused_router: bool = True
    # megatron-core's moe_router_force_load_balancing: every MoE router's logits replaced by random normal values
    # (straight-through gradient), so each expert receives about top_k / E of the tokens. For profiling without the
    # checkpoint: a randomly initialised router sends almost every token of the repeated fake sample to one expert
    # per layer (bench/NOTES.md), which no trained model does. Not the Hugging Face model's routing: off by default.
    moe_router_force_load_balancing: bool = False
    # Transformer Engine: auto (TE specs, TE's FusedAdam and fusions when transformer_engine imports, else local
    # specs), on (refuse the trial when TE does not import), off (TE hidden from the trial: local specs and torch
    # Adam, to compare with and without TE on one machine). See TRANSFORMER_ENGINE_MODES.
    transformer_engine: str = "auto"

    def check_optimizer_precision(self) -> None:
        """The precision-aware optimizer rules (the one copy; :mod:`sftprof.models.megatron_config` calls it).

        Raises:
            ConfigError: a main-grads/main-params/Adam-moment dtype other than float32 without
                ``use_precision_aware_optimizer`` (``USE_PRECISION_AWARE_OPTIMIZER``), or the precision-aware
                optimizer without ``ddp.use_distributed_optimizer``.
        """
        if not self.use_precision_aware_optimizer:
            for name in PRECISION_FIELDS:
                value = getattr(self, name)
                _check(value == "float32", f"actor.megatron.{name}", value,
                       "float32 unless actor.megatron.use_precision_aware_optimizer=true (USE_PRECISION_AWARE_OPTIMIZER)")
        elif not self.ddp.use_distributed_optimizer:
            raise ConfigError("actor.megatron.use_precision_aware_optimizer=True: needs "
                              "actor.megatron.ddp.use_distributed_optimizer=true")

    def check(self) -> None:
        """Raises ConfigError: an unknown choice, a value out of range, or see :meth:`check_optimizer_precision`."""
        k = "actor.megatron"
        for name, choices in (("main_grads_dtype", MAIN_GRADS_DTYPES), ("main_params_dtype", MAIN_PARAMS_DTYPES),
                              ("exp_avg_dtype", EXP_AVG_DTYPES), ("exp_avg_sq_dtype", EXP_AVG_DTYPES)):
            _choice(f"{k}.{name}", getattr(self, name), choices)
        self.check_optimizer_precision()
        _choice(f"{k}.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        _choice(f"{k}.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        _check(self.recompute_num_layers >= 1, f"{k}.recompute_num_layers", self.recompute_num_layers, "an integer >= 1")
        mods = list(self.recompute_modules)
        _check(bool(mods) and set(mods) <= set(RECOMPUTE_MODULES) and len(set(mods)) == len(mods),
               f"{k}.recompute_modules", mods, f"a non-empty list without repeats of {list(RECOMPUTE_MODULES)}")
        _choice(f"{k}.moe_router_dtype", self.moe_router_dtype, MOE_ROUTER_DTYPES)
        _choice(f"{k}.moe_token_dispatcher_type", self.moe_token_dispatcher_type, MOE_DISPATCHERS)
        _check(self.moe_router_bias_update_rate >= 0, f"{k}.moe_router_bias_update_rate",
               self.moe_router_bias_update_rate, "a number >= 0")
        _choice(f"{k}.cp_attention", self.cp_attention, CP_ATTENTION_METHODS)
        _choice(f"{k}.transformer_engine", self.transformer_engine, TRANSFORMER_ENGINE_MODES)
        _check(isinstance(self.attention_forward_chunks, int) and not isinstance(self.attention_forward_chunks, bool)
               and self.attention_forward_chunks >= 1, f"{k}.attention_forward_chunks", self.attention_forward_chunks,
               "an integer >= 1")
        _check(isinstance(self.moe_alltoall_chunks, int) and not isinstance(self.moe_alltoall_chunks, bool)
               and 1 <= self.moe_alltoall_chunks <= MOE_ALLTOALL_CHUNKS_MAX, f"{k}.moe_alltoall_chunks",
               self.moe_alltoall_chunks, f"an integer from 1 to {MOE_ALLTOALL_CHUNKS_MAX}")


@dataclass
class ActorConfig:
    """The trained model: allocation mode (``backend``), model path, dtype, micro-batches, optimizer, loss."""

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
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    megatron: MegatronSettings = field(default_factory=MegatronSettings)

    def check(self) -> None:
        """Raises ConfigError: a bad allocation mode, layer count or dtype, or a subsection's error."""
        from sftprof.allocation import AllocationError, parse_allocation_mode

        try:
            parse_allocation_mode(self.backend)
        except AllocationError as err:
            raise ConfigError(f"actor.backend={self.backend!r}: {err}") from err
        _check(self.num_layers >= 0, "actor.num_layers", self.num_layers, "an integer >= 0 (0 = as in the model config)")
        _choice("actor.dtype", self.dtype, DTYPES)
        for section in (self.mb_spec, self.optimizer, self.loss, self.megatron):
            section.check()


@dataclass
class FakeDataConfig:
    """Deterministic fake long samples: tokens per sample, dataset size, where the loss mask starts."""

    fake_seq_len: int = 4096
    fake_dataset_size: int = 8
    fake_loss_start_ratio: float = 0.5

    def check(self) -> None:
        """Raises ConfigError: a value out of range (``profile.*``)."""
        _check(2 <= self.fake_seq_len <= TOKENS_PER_RANK_MAX, "profile.fake_seq_len", self.fake_seq_len,
               FAKE_SEQ_LEN_ACCEPTED)
        _at_least(self, "profile", {"fake_dataset_size": (1, "an integer >= 1")})
        _check(0 <= self.fake_loss_start_ratio < 1, "profile.fake_loss_start_ratio", self.fake_loss_start_ratio,
               "a number in [0, 1)")


@dataclass
class TrainDatasetConfig:
    """Global batch in sequences per step (``batch_size``) and the length cap (0 = none)."""

    batch_size: int = 1
    max_length: int = 0

    def check(self) -> None:
        """Raises ConfigError: a value out of range (``train_dataset.*``)."""
        _at_least(self, "train_dataset", {"batch_size": (1, "an integer >= 1"),
                                          "max_length": (0, "an integer >= 0 (0 = no limit)")})


def _check_profile_section(section: str, steps: List[int], ranks: str) -> None:
    """``<section>.profile_steps`` non-negative and ``<section>.ranks`` a valid rank spec."""
    from sftprof.ranks import RankSpecError, check_rank_spec_syntax

    for s in steps:
        _check(s >= 0, f"{section}.profile_steps", list(steps), "a list of integers >= 0")
    try:
        check_rank_spec_syntax(ranks)
    except RankSpecError as err:
        raise ConfigError(f"{section}.ranks={ranks!r}: {err}") from err


@dataclass
class PerfTracerConfig:
    """Kernel trials: torch.profiler on ``profile_steps`` for the ranks of ``ranks`` (a rank spec)."""

    enabled: bool = False
    profile_steps: List[int] = field(default_factory=list)
    # Rank spec: "pp_rank0" (rank 0 of every pipeline stage), "" (all ranks) or "0,2-4".
    ranks: str = "pp_rank0"

    def check(self) -> None:
        """Raises ConfigError: a negative step or a malformed rank spec."""
        _check_profile_section("perf_tracer", self.profile_steps, self.ranks)


@dataclass
class MemoryProfilerConfig:
    """Memory trials: allocator snapshots at the end of ``profile_steps`` for the ranks of ``ranks``."""

    profile_steps: List[int] = field(default_factory=list)
    max_entries: int = 100000
    ranks: str = "pp_rank0"

    def check(self) -> None:
        """Raises ConfigError: a negative step, a malformed rank spec or ``max_entries`` < 1."""
        _check_profile_section("memory_profiler", self.profile_steps, self.ranks)
        _check(1 <= self.max_entries <= MEMORY_MAX_ENTRIES_MAX, "memory_profiler.max_entries", self.max_entries,
               f"an integer from 1 to {MEMORY_MAX_ENTRIES_MAX} (2**63 - 1, what torch's allocator history takes)")


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
        ConfigError: neither a file nor a preset of that name exists (a directory is named as one).
    """
    p = Path(path)
    if p.is_file():
        return p
    preset = PRESET_DIR / f"{path}.yaml"
    if preset.is_file():
        return preset
    presets = sorted(q.stem for q in PRESET_DIR.glob("*.yaml"))
    if p.is_dir():
        raise ConfigError(f"config={path!r}: is a directory; accepted: a YAML file or a bundled preset {presets}")
    raise ConfigError(f"config={path!r}: no such file; accepted: a YAML path or a bundled preset {presets}")


BOOL_ACCEPTED = "accepted: true or false (also yes/no, on/off, 1/0)"


INT_ACCEPTED = "accepted: an integer (the key's range is checked once it is one)"
FLOAT_ACCEPTED = "accepted: a number (the key's range is checked once it is one)"
# What an empty value (``key=``, read as None) of a schema field of each type is refused with.
EMPTY_ACCEPTED = {"int": INT_ACCEPTED, "float": FLOAT_ACCEPTED, "bool": BOOL_ACCEPTED,
                  "str": "accepted: a text value (an empty one is written key='')"}


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    empty = re.fullmatch(r"Incompatible value 'None' for field of type '(\w+)'", msg)
    if empty and empty.group(1) in EMPTY_ACCEPTED:
        msg = f"empty value; {EMPTY_ACCEPTED[empty.group(1)]}"
    elif "not a valid bool" in msg or "field of type 'bool'" in msg:
        msg += f"; {BOOL_ACCEPTED}"
    elif msg.endswith("could not be converted to Integer"):
        msg += f"; {INT_ACCEPTED}"
    elif msg.endswith("could not be converted to Float"):
        msg += f"; {FLOAT_ACCEPTED}"
    return f"{key}: {msg}"


def _known_keys(tree: Any, node: Any):
    """``(key, value, schema node)`` for each key of one level of a config source ``tree`` that the schema level
    ``node`` knows (an unknown key is left to the merge, which names it); nothing when either is not a mapping."""
    if not isinstance(tree, dict) or not isinstance(node, DictConfig):
        return
    for key, value in tree.items():
        try:
            yield key, value, node._get_node(key)
        except OmegaConfBaseException:
            continue


def _check_bool_ints(tree: Any, node: Any, prefix: str = "") -> None:
    """Refuse an integer other than 0 or 1 for a boolean key of the schema ``node`` in one config source ``tree``
    (OmegaConf reads any non-zero integer as true: ``actor.megatron.moe_sorted_permute=-1`` would be on).

    Raises:
        ConfigError: naming the dotted key, the value and the accepted values.
    """
    for key, value, child in _known_keys(tree, node):
        if isinstance(child, BooleanNode) and isinstance(value, int) and not isinstance(value, bool) \
                and value not in (0, 1):
            raise ConfigError(f"{prefix}{key}={value!r}: not a boolean; {BOOL_ACCEPTED}")
        _check_bool_ints(value, child, f"{prefix}{key}.")


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


# What a key takes, where its type alone says too little (a value of the wrong shape is refused with it).
ACCEPTED_BY_KEY = {
    "actor.backend": "an allocation mode BACKEND:LAYOUT, e.g. fsdp:d2, megatron:d2t2p2 or megatron:(attn:d2c4|ffn:d1e8)",
    "actor.megatron.recompute_modules": f"a list in brackets of {list(RECOMPUTE_MODULES)}, e.g. [core_attn]",
    "perf_tracer.profile_steps": "a list of step numbers in brackets, e.g. [0] (one step per trial when "
                                 "perf_tracer.enabled=true; [] for none)",
    "memory_profiler.profile_steps": "a list of step numbers in brackets, e.g. [0] or [0,1] ([] for none)",
}
# What YAML made of a value, in a message
_SHAPES = {dict: "a mapping", list: "a list", str: "text", int: "a number", float: "a number", bool: "a boolean"}
_LEAF_ACCEPTED = {StringNode: "a text value", IntegerNode: "an integer", FloatNode: "a number",
                  BooleanNode: "true or false"}


def _shape_accepted(node: Any, key: str) -> tuple[str, str]:
    """``(shape, accepted)`` of schema ``node`` at dotted ``key``: e.g. ``("a list", "a list of step numbers ...")``."""
    if isinstance(node, DictConfig):
        first = next(iter(node.keys()), "key")
        return "a section", f"keys below it, e.g. {key}.{first}=..."
    if isinstance(node, ListConfig):
        item = {int: "integers", str: "names", float: "numbers"}.get(node._metadata.element_type, "values")
        return "a list", ACCEPTED_BY_KEY.get(key, f"a list of {item} in brackets, e.g. [a,b] ([] for none)")
    wanted = {StringNode: "text", IntegerNode: "a number", FloatNode: "a number", BooleanNode: "a boolean"}.get(
        type(node), "a single value")
    return wanted, ACCEPTED_BY_KEY.get(key, _LEAF_ACCEPTED.get(type(node), "a single value"))


def _check_value_shapes(tree: Any, node: Any, raw: dict[str, str], prefix: str = "") -> None:
    """Refuse a value of the wrong shape for a key of the schema ``node`` in one config source ``tree``: a mapping or
    list for a single-value key (``actor.backend=megatron:``, which YAML reads as ``{'megatron': None}``), anything
    but a list for a list key (``perf_tracer.profile_steps=abc``), anything but a mapping for a section
    (``actor=3``). OmegaConf's own messages for these name the key but not what it takes (``Cannot convert
    'DictConfig' to string``), and a mapping for a list key ended in a bare ``TypeError``. ``raw`` maps the
    dotted keys of command-line overrides to the text given (shown instead of what YAML made of it).

    Raises:
        ConfigError: ``KEY=VALUE: read as <shape> (<value>), not <shape>; accepted: <what KEY takes>``.
    """
    for key, value, child in _known_keys(tree, node):
        dotted = f"{prefix}{key}"
        if child is None or _is_interpolation(value):
            continue
        if isinstance(child, DictConfig) and isinstance(value, dict):
            _check_value_shapes(value, child, raw, f"{dotted}.")
            continue
        wanted, accepted = _shape_accepted(child, dotted)
        if value is None and isinstance(child, (DictConfig, ListConfig)):
            raise ConfigError(f"{dotted}: empty value; accepted: {accepted}")
        got = next((name for t, name in _SHAPES.items() if isinstance(value, t)), type(value).__name__)
        container = wanted in ("a list", "a section")
        if (not container and isinstance(value, (dict, list))) or (wanted == "a list" and not isinstance(value, list)) \
                or wanted == "a section":
            shown = repr(raw[dotted]) if dotted in raw else repr(value)
            seen = f" ({value!r})" if dotted in raw and isinstance(value, (dict, list)) else ""
            hint = (f" (text that YAML reads as a mapping or list is quoted: {dotted}='...')"
                    if isinstance(child, StringNode) else "")
            raise ConfigError(f"{dotted}={shown}: read as {got}{seen}, not {wanted}; accepted: {accepted}{hint}")


def map_legacy_loss_keys(tree: dict, source: str) -> dict:
    """Move the old loss keys of one config source to ``actor.loss`` (in place; returns ``tree``).

    ``tree`` is one source as a plain container (the YAML file, or the overrides). Mapping
    (:data:`LEGACY_LOSS_KEYS`): ``actor.logprobs_chunk_size`` -> ``actor.loss.logprobs_chunk_size``,
    ``actor.megatron.lm_head_loss_chunk_size`` -> ``actor.loss.lm_head_loss_chunk_size``;
    ``actor.megatron.enable_chunked_logits=false`` -> ``actor.loss.logprobs_chunk_size=0`` (as before:
    it overrides a chunk size of the same source), ``true`` -> nothing.

    Raises:
        ConfigError: an old key whose value is not an integer >= 0 (chunk sizes) or a boolean
            (``enable_chunked_logits``), or an old and a new key of the same setting in ``source`` with
            different values (the message names both and ``source``).
    """
    actor = tree.get("actor")
    if not isinstance(actor, dict):
        return tree
    megatron = actor.get("megatron") if isinstance(actor.get("megatron"), dict) else {}
    found = {}
    for old, new in LEGACY_LOSS_KEYS.items():
        parent, key = (megatron, old.rsplit(".", 1)[1]) if ".megatron." in old else (actor, old.rsplit(".", 1)[1])
        if key not in parent:
            continue
        value = parent.pop(key)
        _check(_is_interpolation(value) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0),
               old, value, "an integer >= 0")
        found[new] = (old, value)
    chunked = megatron.pop("enable_chunked_logits", True)
    _check(isinstance(chunked, bool), LEGACY_CHUNKED_LOGITS_KEY, chunked, "true or false")
    if not chunked:
        found["logprobs_chunk_size"] = (f"{LEGACY_CHUNKED_LOGITS_KEY}=false", 0)
    if not found:
        return tree
    loss = actor.setdefault("loss", {})
    if not isinstance(loss, dict):
        return tree  # OmegaConf names the bad actor.loss value
    for new, (old, value) in found.items():
        if new in loss and loss[new] != value:
            raise ConfigError(f"{old}={value!r} and actor.loss.{new}={loss[new]!r} in {source}: one setting under its "
                              f"old and new name with different values; keep actor.loss.{new} (the old name is "
                              "still read)")
        loss[new] = value
    return tree


def load_config(path: str | Path, overrides: List[str] | None = None) -> SFTProfileConfig:
    """Load a YAML file (or preset name), apply ``key=value`` dotted overrides and validate.

    Args:
        path: YAML file path or bundled preset name (:func:`resolve_config_path`).
        overrides: dotted overrides such as ``["actor.loss.logprobs_chunk_size=128"]``; list values use
            YAML syntax (``memory_profiler.profile_steps=[0,1]``). Old key names are mapped
            (:func:`map_legacy_loss_keys`) in the file and in the overrides separately.

    Returns:
        The typed config with every ``${...}`` interpolation resolved.

    Raises:
        ConfigError: unreadable, empty or non-mapping YAML, unknown key, wrong type, bad interpolation, or a value
            outside its accepted range (message names the dotted key, value and accepted values).
    """
    yaml_path = resolve_config_path(path)
    schema = OmegaConf.structured(SFTProfileConfig)
    try:
        with open(yaml_path, encoding="utf-8") as f:
            top = yaml.safe_load(f)   # the top level as written: OmegaConf reads a lone string as a key
        file_cfg = OmegaConf.load(yaml_path) if isinstance(top, dict) else None
    except Exception as err:  # yaml.YAMLError and OSError alike
        raise ConfigError(f"config={yaml_path}: cannot read YAML: {err}") from err
    if top is not None and not isinstance(top, dict):
        # the content is not echoed: a wrong file (CONFIG=/etc/passwd) is one long string
        raise ConfigError(f"config file {yaml_path}: must be a mapping of config keys (key: value lines), "
                          f"not a {_YAML_KINDS.get(type(top), type(top).__name__)}")
    if not file_cfg:  # an empty file, or an empty mapping
        raise ConfigError(f"config file {yaml_path} is empty; accepted: a YAML mapping of config keys, e.g. "
                          f"the bundled preset {PRESET_DIR / 'tiny_cpu.yaml'}")
    dotlist = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value with a dotted key, e.g. actor.num_layers=4")
        dotlist.append(item)
    raw = {k.strip(): v for k, _, v in (item.partition("=") for item in dotlist)}
    try:
        layers = [OmegaConf.to_container(file_cfg, resolve=False),
                  OmegaConf.to_container(OmegaConf.from_dotlist(dotlist), resolve=False)]
        for layer, source in zip(layers, (f"config {yaml_path}", "the overrides")):
            if isinstance(layer, dict):
                map_legacy_loss_keys(layer, source)
                try:
                    _check_bool_ints(layer, schema)
                    _check_value_shapes(layer, schema, raw if source == "the overrides" else {})
                except ConfigError as err:
                    raise ConfigError(f"{err} ({source})") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"{_omegaconf_message(err)} (config {yaml_path})") from err
    source = f"config {yaml_path}"  # which layer a merge error comes from: the file, else the overrides
    try:
        merged = OmegaConf.merge(schema, layers[0])
        source = "overrides " + " ".join(dotlist) if dotlist else source
        merged = OmegaConf.merge(merged, layers[1])
        source = f"config {yaml_path}" + (" with overrides " + " ".join(dotlist) if dotlist else "")
        OmegaConf.resolve(merged)
        cfg: SFTProfileConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{_omegaconf_message(err)} ({source})") from err
    validate(cfg)
    return cfg


def validate(cfg: SFTProfileConfig) -> None:
    """Check value ranges and choices that the type system cannot express.

    ``experiment_name`` and ``trial_name`` must each be one folder name (:data:`NAME_ACCEPTED`: they become
    folders of the trial's LOG_DIR, :func:`trial_log_dir`); ``seed`` at most :data:`SEED_MAX`. Each section checks
    itself (the ``check`` methods above); what spans sections is checked here: the profile steps below
    ``total_train_steps`` (``perf_tracer``'s when it is enabled, ``memory_profiler``'s always), at most one
    ``perf_tracer.profile_steps`` entry when it is enabled (a rank's kernel trace file holds one step; memory
    snapshots go to one ``step_<N>/`` folder per step, so ``memory_profiler`` may list several),
    ``train_dataset.batch_size`` against the data-parallel size and against :data:`TOKENS_PER_RANK_MAX` tokens per
    data-parallel rank and step, ``actor.mb_spec`` against the sequence length and the batch, one profile kind per
    trial, the ``reference`` loss path only without TP.

    Raises:
        ConfigError: the first violation found, naming the dotted key, value and accepted values.
    """
    from sftprof.allocation import parse_allocation_mode

    _check(is_folder_name(cfg.experiment_name), "experiment_name", cfg.experiment_name, NAME_ACCEPTED)
    _check(is_folder_name(cfg.trial_name), "trial_name", cfg.trial_name, NAME_ACCEPTED)
    _check(0 <= cfg.seed <= SEED_MAX, "seed", cfg.seed, f"an integer from 0 to {SEED_MAX} (2**32 - 1, NumPy's range)")
    _check(cfg.total_train_steps >= 1, "total_train_steps", cfg.total_train_steps, "an integer >= 1")
    for section in (cfg.cluster, cfg.actor, cfg.profile, cfg.train_dataset, cfg.perf_tracer, cfg.memory_profiler):
        section.check()
    for section, steps in (("perf_tracer", cfg.perf_tracer.profile_steps if cfg.perf_tracer.enabled else []),
                           ("memory_profiler", cfg.memory_profiler.profile_steps)):
        late = [s for s in steps if s >= cfg.total_train_steps]
        if late:
            runs = "step 0" if cfg.total_train_steps == 1 else f"steps 0 to {cfg.total_train_steps - 1}"
            raise ConfigError(f"{section}.profile_steps={list(steps)}: step(s) {late} never run with total_train_steps="
                              f"{cfg.total_train_steps} (it runs {runs}); accepted: steps < total_train_steps "
                              f"(or raise total_train_steps to {max(late) + 1} or more)")
    kernel_steps = list(cfg.perf_tracer.profile_steps) if cfg.perf_tracer.enabled else []
    if len(kernel_steps) > 1:
        raise ConfigError(f"perf_tracer.profile_steps={kernel_steps}: one kernel-profiled step per trial (each rank's "
                          "trace is LOG_DIR/perf_tracer/rank<rank>.pt.trace.json, which a second step would "
                          f"overwrite); accepted: one step, e.g. [{kernel_steps[0]}], or [] for none; to profile several "
                          "steps, run one trial per step: the driver does, PROFILE_STEPS="
                          f"{','.join(str(s) for s in kernel_steps)}")
    a, p = cfg.actor, cfg.profile
    mbt = a.mb_spec.max_tokens_per_mb
    _check(mbt == 0 or mbt >= p.fake_seq_len, "actor.mb_spec.max_tokens_per_mb", mbt,
           f"0 (no limit) or >= one sequence (profile.fake_seq_len={p.fake_seq_len})")
    layout = parse_allocation_mode(a.backend)
    bs = cfg.train_dataset.batch_size
    _check(bs % layout.dp == 0, "train_dataset.batch_size", bs,
           f"a multiple of the data-parallel size {layout.dp} of actor.backend={a.backend!r}")
    rank_seqs_max = TOKENS_PER_RANK_MAX // p.fake_seq_len * layout.dp
    _check(bs <= rank_seqs_max, "train_dataset.batch_size", bs,
           f"<= {rank_seqs_max}: a data-parallel rank's micro-batches hold batch_size / dp x profile.fake_seq_len "
           f"tokens a step (dp={layout.dp}, fake_seq_len={p.fake_seq_len}), at most {TOKENS_PER_RANK_MAX} (2**27)")
    _check(a.mb_spec.n_mbs <= bs // layout.dp, "actor.mb_spec.n_mbs", a.mb_spec.n_mbs,
           f"<= sequences per data-parallel rank (train_dataset.batch_size / dp = {bs // layout.dp})")
    if cfg.memory_profiler.profile_steps and cfg.perf_tracer.enabled and cfg.perf_tracer.profile_steps:
        raise ConfigError(f"perf_tracer.profile_steps={list(cfg.perf_tracer.profile_steps)} and memory_profiler.profile_steps="
                          f"{list(cfg.memory_profiler.profile_steps)}: set one profile kind per trial (allocator history "
                          "distorts kernel timings)")
    if a.megatron.moe_router_force_load_balancing and layout.backend != "megatron":
        raise ConfigError(f"actor.megatron.moe_router_force_load_balancing=true: megatron-core's router option, for "
                          f"the megatron backend only; actor.backend={a.backend!r}; accepted here: false")
    if a.loss.path == "reference" and layout.tp > 1:
        raise ConfigError(f"actor.loss.path='reference': needs TP=1 (a plain log_softmax over the whole vocabulary), "
                          f"actor.backend={a.backend!r} has TP={layout.tp}; accepted: auto, lm_head, logprobs")


def trial_log_dir(cfg: SFTProfileConfig) -> Path:
    """LOG_DIR of a trial: ``<cluster.fileroot>/logs/<user>/<experiment_name>/<trial_name>/``."""
    return Path(cfg.cluster.fileroot) / "logs" / getpass.getuser() / cfg.experiment_name / cfg.trial_name


def reject_repeated_keys(overrides: List[str]) -> None:
    """Refuse a config key that two ``key=value`` arguments set to different values (OmegaConf's dot list would keep
    the last one without a word); the same value twice is taken. Old and new names of a loss key are checked by
    :func:`map_legacy_loss_keys`.

    Raises:
        ConfigError: ``arguments K=A and K=B: one config key given twice with different values; give K once``.
    """
    seen: dict[str, str] = {}
    for arg in overrides:
        key, sep, value = arg.partition("=")
        key = key.strip()
        if sep and key in seen and seen[key] != value:
            raise ConfigError(f"arguments {key}={seen[key]} and {key}={value}: one config key given twice with "
                              f"different values; give {key} once")
        seen.setdefault(key, value)


def last_value_per_key(overrides: List[str]) -> List[str]:
    """``overrides`` with each key once, at its last place with its last value: the same config OmegaConf makes of
    the whole list (a later value of a key replaces the earlier one), in a form :func:`reject_repeated_keys` takes.
    The driver layers its settings and the user's arguments this way before handing them to the trainer."""
    last = {arg.partition("=")[0].strip(): i for i, arg in enumerate(overrides)}
    return [arg for i, arg in enumerate(overrides) if last[arg.partition("=")[0].strip()] == i]


def load_config_or_exit(path: str | Path, overrides: List[str] | None = None) -> SFTProfileConfig:
    """:func:`load_config` for entry points (the trainer, ``profile_rank_utils.py``), after
    :func:`reject_repeated_keys` on the command line's overrides: print the error to stderr and exit with
    status 2."""
    try:
        reject_repeated_keys(overrides or [])
        return load_config(path, overrides)
    except ConfigError as err:
        exit_config_error(str(err))


CONFIG_ERROR_PREFIX = "sftprof: configuration error: "


def exit_config_error(message: str) -> None:
    """Print ``sftprof: configuration error: <message>`` to stderr in one write and exit with status 2.

    One write (not ``print``, which writes the text and the newline separately): every rank of a trial refuses the
    same configuration at the same moment into one pipe (torchrun's output, ``launcher.log``), and with
    ``PYTHONUNBUFFERED=1`` two writes per rank let another rank's message land between one's text and its newline.
    """
    sys.stderr.write(f"{CONFIG_ERROR_PREFIX}{message}\n")
    sys.stderr.flush()
    sys.exit(2)


def to_yaml(cfg: SFTProfileConfig) -> str:
    """Return the resolved config as YAML text (for logs and ``profile_settings.log``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
