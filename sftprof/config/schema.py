"""The configuration's schema: one dataclass per section, each field with its default, and each section's ``check``
of its own values next to it.

The dataclasses are OmegaConf structured configs (:mod:`sftprof.config.loading`), so unknown keys and wrong types
are refused by OmegaConf itself; value ranges and choices by the ``check`` methods, which
:func:`sftprof.config.validation.validate` runs before the checks that span sections. Key names follow the
AReaL-style seed config, e.g. ``actor.mb_spec.n_mbs`` or ``profile.fake_seq_len``. A key that a driver variable sets
declares it beside its default, with the key's one check (:func:`sftprof.config.settings.setting`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List

from sftprof.allocation import AllocationError, parse_allocation_mode
from sftprof.config.errors import ConfigError, require, require_at_least, require_choice
from sftprof.config.settings import NAME_ACCEPTED, check_settings, is_folder_name, setting
from sftprof.ranks import RankSpecError, check_rank_spec_syntax

DTYPES = ("bfloat16", "float16", "float32")
# Megatron OptimizerConfig accepts these for the precision-aware optimizer fields (TE FusedAdam).
MAIN_GRADS_DTYPES = ("float32", "bfloat16")
MAIN_PARAMS_DTYPES = ("float32", "float16")
EXP_AVG_DTYPES = ("float32", "float16", "bfloat16", "uint8")
# The actor.megatron fields the precision-aware optimizer sets (float32 without it).
PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
RECOMPUTE_GRANULARITIES = ("full", "selective", "none")
HISTORY_STACKS = ("all", "python")  # memory_profiler.stacks: torch's _record_memory_history(stacks=)
RECOMPUTE_METHODS = ("uniform", "block")
# megatron-core 0.16.1 TransformerConfig.recompute_modules choices that this project's layer specs support
# ("moe_act" needs TE's grouped GEMM, "mla_up_proj" multi-latent attention: neither is built here).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")
MOE_ROUTER_DTYPES = ("fp32", "fp64", "none")
MOE_DISPATCHERS = ("alltoall", "allgather")
# actor.megatron.cp_attention: how a CP rank's attention is computed (sftprof.models.layers.attention, item 2 of its
# docstring); used by the local layer spec (no Transformer Engine) with CP > 1.
CP_ATTENTION_METHODS = ("masked", "blocks")
TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")
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


@dataclass
class ClusterConfig:
    """Where logs go (``fileroot``; empty, the default: the driver's ``RUN_ROOT/fileroot``, a trainer run alone
    ``/tmp/sftprof_fileroot_<user>``: :mod:`sftprof.config.paths`) and the torchrun layout (nodes x processes per
    node)."""

    fileroot: str = field(default="", metadata=setting(
        "FILEROOT", "trainer logs go to FILEROOT/logs/<user>/<experiment>/<trial>/", path=True,
        default="RUN_ROOT/fileroot, unless the YAML sets cluster.fileroot"))
    n_nodes: int = field(default=1, metadata=setting(
        "N_NODES", "nodes; run the driver on each with the same PROFILE_STAMP and a shared FILEROOT", "an integer >= 1", lambda v: v >= 1))
    n_gpus_per_node: int = field(default=8, metadata=setting(
        "N_GPUS_PER_NODE", "torchrun --nproc_per_node", "an integer >= 1", lambda v: v >= 1, default="world size / N_NODES"))

    def check(self) -> None:
        """Raises ConfigError: ``cluster.n_nodes`` or ``cluster.n_gpus_per_node`` < 1."""
        check_settings(self, "cluster")


@dataclass
class MicroBatchSpec:
    """Micro-batching per data-parallel rank: at least ``n_mbs`` micro-batches (a multiple of
    ``n_mbs_divisor``), each holding at most ``max_tokens_per_mb`` tokens (0 = no limit)."""

    n_mbs: int = field(default=1, metadata=setting("PROFILE_N_MBS", "micro-batches per data-parallel rank", "an integer >= 1", lambda v: v >= 1))
    n_mbs_divisor: int = 1
    max_tokens_per_mb: int = 0

    def check(self) -> None:
        """Raises ConfigError: a count below its minimum (``actor.mb_spec.*``)."""
        check_settings(self, "actor.mb_spec")
        require_at_least(self, "actor.mb_spec", {"n_mbs_divisor": (1, "an integer >= 1"),
                                                 "max_tokens_per_mb": (0, "an integer >= 0 (0 = no limit)")})


def n_micro_batches(n_seqs: int, seq_len: int, n_mbs: int, n_mbs_divisor: int, max_tokens_per_mb: int) -> int:
    """Number of micro-batches for ``n_seqs`` sequences of ``seq_len`` tokens on one DP rank (the trainer's
    :func:`sftprof.data.step_micro_batches`; the what-ifs of :mod:`sftprof.analysis.what_if.changes`).

    At least ``actor.mb_spec.n_mbs``; more when ``max_tokens_per_mb > 0`` needs them; rounded up
    to a multiple of ``n_mbs_divisor``; never more than ``n_seqs`` (a sequence is not split).

    Raises:
        ValueError: one sequence is longer than ``max_tokens_per_mb``, ``n_mbs > n_seqs``, or the
            divisor rounds the count past ``n_seqs``.
    """
    if n_mbs > n_seqs:
        raise ValueError(f"actor.mb_spec.n_mbs={n_mbs}: must be <= sequences per data-parallel rank ({n_seqs})")
    n = n_mbs
    if max_tokens_per_mb:
        if seq_len > max_tokens_per_mb:
            raise ValueError(f"actor.mb_spec.max_tokens_per_mb={max_tokens_per_mb}: smaller than one sequence "
                             f"(profile.fake_seq_len={seq_len}); accepted: 0 (no limit) or >= {seq_len}")
        n = max(n, math.ceil(n_seqs / (max_tokens_per_mb // seq_len)))
    n = math.ceil(n / n_mbs_divisor) * n_mbs_divisor
    if n > n_seqs:
        raise ValueError(f"actor.mb_spec.n_mbs_divisor={n_mbs_divisor}: {n} micro-batches needed, but a data-parallel "
                         f"rank has only {n_seqs} sequences (a sequence is not split); accepted: a divisor that "
                         f"makes n_mbs <= {n_seqs}")
    return n


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
        require(self.lr > 0, f"{k}.lr", self.lr, "a number > 0")
        require(self.weight_decay >= 0, f"{k}.weight_decay", self.weight_decay, "a number >= 0")
        require(0 <= self.beta1 < 1, f"{k}.beta1", self.beta1, "a number in [0, 1)")
        require(0 <= self.beta2 < 1, f"{k}.beta2", self.beta2, "a number in [0, 1)")
        require(self.eps > 0, f"{k}.eps", self.eps, "a number > 0")
        require(self.gradient_clipping >= 0, f"{k}.gradient_clipping", self.gradient_clipping,
                "a number >= 0 (0 = no clipping)")
        require_choice(f"{k}.lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)


@dataclass
class LossSettings:
    """How the token loss is computed from the final hidden states (:mod:`sftprof.loss`).

    ``path``: ``lm_head`` (chunked LM head fused with the loss, no full logits; ``lm_head_loss_chunk_size``
    tokens per chunk, > 0), ``logprobs`` (full logits, then the vocab-parallel log-probs
    ``logprobs_chunk_size`` tokens at a time on CPU, 0 = all at once; on CUDA all at once), ``reference`` (full logits, fp32
    ``log_softmax`` and gather: the textbook baseline of tests and benchmarks, TP = 1 only: checked by
    :func:`sftprof.config.validation.validate`, which knows the layout) or ``auto`` (``lm_head`` when
    ``lm_head_loss_chunk_size > 0``, else ``logprobs``). Driver variables: ``LOGPROBS_CHUNK_SIZE``,
    ``LM_HEAD_LOSS_CHUNK_SIZE``.
    """

    path: str = "auto"
    # On CPU each chunk makes [chunk, V] fp32 temporaries (V = 151936: 74 MiB each at 128 tokens) instead of [N, V]
    # ones for all N tokens at once; on CUDA the kernels keep no such temporaries and take every token in one launch.
    logprobs_chunk_size: int = field(default=128, metadata=setting(
        "LOGPROBS_CHUNK_SIZE", "tokens per chunk of the vocab-parallel logprobs on CPU (0 = all at once; CUDA: one "
        "launch)", "an integer >= 0 (0 = all tokens at once)", lambda v: v >= 0))
    lm_head_loss_chunk_size: int = field(default=0, metadata=setting(
        "LM_HEAD_LOSS_CHUNK_SIZE", "> 0: chunked LM-head loss with that many tokens per chunk",
        "an integer >= 0 (0 = logits path)", lambda v: v >= 0))

    def resolved_path(self) -> str:
        """``lm_head``, ``logprobs`` or ``reference``: ``path`` with ``auto`` decided."""
        if self.path != "auto":
            return self.path
        return "lm_head" if self.lm_head_loss_chunk_size > 0 else "logprobs"

    def check(self) -> None:
        """Raises ConfigError: a negative chunk size, an unknown path, or a chunk size the path does not use
        (``lm_head`` needs ``lm_head_loss_chunk_size > 0``; ``logprobs``/``reference`` need it 0)."""
        k = "actor.loss"
        require_choice(f"{k}.path", self.path, LOSS_PATHS)
        check_settings(self, k)
        chunk = self.lm_head_loss_chunk_size
        if self.path == "lm_head":
            require(chunk > 0, f"{k}.lm_head_loss_chunk_size", chunk, "> 0 with actor.loss.path=lm_head (tokens per chunk)")
        elif self.path in ("logprobs", "reference"):
            require(chunk == 0, f"{k}.lm_head_loss_chunk_size", chunk,
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
    """Megatron engine and memory-saving settings (precision-aware optimizer dtypes, recompute, MoE routing); the
    loss is :class:`LossSettings`."""

    use_precision_aware_optimizer: bool = field(default=False, metadata=setting(
        "USE_PRECISION_AWARE_OPTIMIZER", "Megatron precision-aware optimizer (needs Transformer Engine); false needs "
        "the optimizer dtypes float32 (MAIN_GRADS_DTYPE=float32 with the shipped YAML)"))
    main_grads_dtype: str = field(default="float32", metadata=setting(
        "MAIN_GRADS_DTYPE", "float32 or bfloat16 main grads", choices=MAIN_GRADS_DTYPES))
    main_params_dtype: str = "float32"
    exp_avg_dtype: str = "float32"
    exp_avg_sq_dtype: str = "float32"
    ddp: DDPSettings = field(default_factory=DDPSettings)
    use_deterministic_algorithms: bool = field(default=False, metadata=setting(
        "USE_DETERMINISTIC_ALGORITHMS", "deterministic kernels"))
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
    # specs), transformer_engine (refuse the trial when TE does not import), local (TE hidden from the trial: local
    # specs and torch Adam, to compare with and without TE on one machine). Megatron-LM's --transformer-impl words.
    transformer_impl: str = "auto"

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
                require(value == "float32", f"actor.megatron.{name}", value,
                        "float32 unless actor.megatron.use_precision_aware_optimizer=true (USE_PRECISION_AWARE_OPTIMIZER)")
        elif not self.ddp.use_distributed_optimizer:
            raise ConfigError("actor.megatron.use_precision_aware_optimizer=True: needs "
                              "actor.megatron.ddp.use_distributed_optimizer=true")

    def check(self) -> None:
        """Raises ConfigError: an unknown choice, a value out of range, or see :meth:`check_optimizer_precision`."""
        k = "actor.megatron"
        check_settings(self, k)
        for name, choices in (("main_params_dtype", MAIN_PARAMS_DTYPES), ("exp_avg_dtype", EXP_AVG_DTYPES),
                              ("exp_avg_sq_dtype", EXP_AVG_DTYPES)):
            require_choice(f"{k}.{name}", getattr(self, name), choices)
        self.check_optimizer_precision()
        require_choice(f"{k}.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        require_choice(f"{k}.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        require(self.recompute_num_layers >= 1, f"{k}.recompute_num_layers", self.recompute_num_layers, "an integer >= 1")
        mods = list(self.recompute_modules)
        require(bool(mods) and set(mods) <= set(RECOMPUTE_MODULES) and len(set(mods)) == len(mods),
                f"{k}.recompute_modules", mods, f"a non-empty list without repeats of {list(RECOMPUTE_MODULES)}")
        require_choice(f"{k}.moe_router_dtype", self.moe_router_dtype, MOE_ROUTER_DTYPES)
        require_choice(f"{k}.moe_token_dispatcher_type", self.moe_token_dispatcher_type, MOE_DISPATCHERS)
        require(self.moe_router_bias_update_rate >= 0, f"{k}.moe_router_bias_update_rate",
                self.moe_router_bias_update_rate, "a number >= 0")
        require_choice(f"{k}.cp_attention", self.cp_attention, CP_ATTENTION_METHODS)
        require_choice(f"{k}.transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        require(isinstance(self.attention_forward_chunks, int) and not isinstance(self.attention_forward_chunks, bool)
                and self.attention_forward_chunks >= 1, f"{k}.attention_forward_chunks", self.attention_forward_chunks,
                "an integer >= 1")
        require(isinstance(self.moe_alltoall_chunks, int) and not isinstance(self.moe_alltoall_chunks, bool)
                and 1 <= self.moe_alltoall_chunks <= MOE_ALLTOALL_CHUNKS_MAX, f"{k}.moe_alltoall_chunks",
                self.moe_alltoall_chunks, f"an integer from 1 to {MOE_ALLTOALL_CHUNKS_MAX}")


@dataclass
class SimulateSettings:
    """A simulated rank: one rank of the layout alone on one device, collectives not run (:mod:`sftprof.trainer`)."""

    # The rank of actor.backend's layout to run alone (-1: off, every rank runs). Its collectives go to torch's fake
    # process group: their outputs are allocated at their real sizes, never exchanged (docs/simulated_rank.md).
    rank: int = field(default=-1, metadata=setting(
        "SIMULATE_RANK", "run this one rank of the layout alone on one device, collectives not run (-1: off; "
        "docs/simulated_rank.md)", "an integer >= -1 (-1: off, else a rank of actor.backend's layout)",
        lambda v: v >= -1))
    # Ranks per node of the simulated cluster: groups across nodes take the inter-node rate in the projection.
    gpus_per_node: int = 8

    def check(self) -> None:
        """Raises ConfigError: a rank below -1 or ranks per node below 1 (the rank against the layout: ActorConfig)."""
        check_settings(self, "actor.simulate")
        require(self.gpus_per_node >= 1, "actor.simulate.gpus_per_node", self.gpus_per_node, "an integer >= 1")


@dataclass
class ActorConfig:
    """The trained model: allocation mode (``backend``), model path, dtype, micro-batches, optimizer, loss."""

    # Allocation mode: backend plus parallel layout, e.g. "megatron:(attn:d2c4|ffn:d1e8)" or "fsdp:d2".
    backend: str = "fsdp:d1"
    # A Hugging Face model directory (config.json, optional weights/tokenizer) or the name of a
    # bundled config: see sftprof.models.BUNDLED_CONFIGS.
    path: str = field(default="qwen3_30b_a3b", metadata=setting(
        "MODEL_PATH", "HF model dir, or a bundled config name (random init)"))
    # Cut the model to this many decoder layers (0 = as in the model config), for single-GPU slices.
    num_layers: int = 0
    init_from_scratch: bool = True
    dtype: str = "bfloat16"
    gradient_checkpointing: bool = True
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    megatron: MegatronSettings = field(default_factory=MegatronSettings)
    simulate: SimulateSettings = field(default_factory=SimulateSettings)

    def check(self) -> None:
        """Raises ConfigError: a bad allocation mode, layer count or dtype, a simulated rank outside the layout, or
        a subsection's error."""
        try:
            layout = parse_allocation_mode(self.backend)
        except AllocationError as err:
            raise ConfigError(f"actor.backend={self.backend!r}: {err}") from err
        require(self.simulate.rank < layout.world_size, "actor.simulate.rank", self.simulate.rank,
                f"-1 (off) or a rank in [0, {layout.world_size}) of actor.backend={self.backend!r}")
        require(self.num_layers >= 0, "actor.num_layers", self.num_layers, "an integer >= 0 (0 = as in the model config)")
        require_choice("actor.dtype", self.dtype, DTYPES)
        for section in (self.mb_spec, self.optimizer, self.loss, self.megatron, self.simulate):
            section.check()


@dataclass
class FakeDataConfig:
    """Deterministic fake long samples: tokens per sample, dataset size, where the loss mask starts."""

    fake_seq_len: int = field(default=4096, metadata=setting(
        "PROFILE_FAKE_SEQ_LEN", "tokens per sample (2 to 2**27)", FAKE_SEQ_LEN_ACCEPTED,
        lambda v: 2 <= v <= TOKENS_PER_RANK_MAX))
    fake_dataset_size: int = field(default=8, metadata=setting(
        "PROFILE_FAKE_DATASET_SIZE", "samples in the fake dataset", "an integer >= 1", lambda v: v >= 1))
    fake_loss_start_ratio: float = field(default=0.5, metadata=setting(
        "PROFILE_FAKE_LOSS_START_RATIO", "loss mask starts at this fraction of the sample", "a number in [0, 1)",
        lambda v: 0 <= v < 1))

    def check(self) -> None:
        """Raises ConfigError: a value out of range (``profile.*``)."""
        check_settings(self, "profile")


@dataclass
class TrainDatasetConfig:
    """Global batch in sequences per step (``batch_size``) and the length cap (0 = none)."""

    batch_size: int = field(default=1, metadata=setting(
        "TRAIN_BATCH_SIZE", "global batch (sequences per step)", "an integer >= 1", lambda v: v >= 1))
    max_length: int = 0

    def check(self) -> None:
        """Raises ConfigError: a value out of range (``train_dataset.*``)."""
        check_settings(self, "train_dataset")
        require_at_least(self, "train_dataset", {"max_length": (0, "an integer >= 0 (0 = no limit)")})


def _check_profile_steps(section: str, steps: List[int]) -> None:
    """``<section>.profile_steps`` non-negative."""
    for s in steps:
        require(s >= 0, f"{section}.profile_steps", list(steps), "a list of integers >= 0")


def _rank_spec_problem(spec: str) -> str | None:
    """What is wrong with rank spec ``spec`` (:func:`sftprof.ranks.check_rank_spec_syntax`), None when it is one."""
    try:
        check_rank_spec_syntax(spec)
    except RankSpecError as err:
        return str(err)
    return None


# Both profilers' ranks, set together by PROFILE_RANKS: its value is resolved against the layout by the driver
# (sftprof.launch.planning._profiled_ranks), where two specs that name the same ranks agree (pp_rank0 and 0 on one
# stage), so it does not become a key=value argument as the one-key variables do.
PROFILE_RANKS = setting("PROFILE_RANKS", "profiled ranks: pp_rank0 (rank 0 of every PP stage), empty (all), 0,2-4",
                        "pp_rank0, empty (all ranks) or ranks and ranges such as 0,2-4", why=_rank_spec_problem,
                        listing=True)


@dataclass
class PerfTracerConfig:
    """Kernel trials: torch.profiler on ``profile_steps`` for the ranks of ``ranks`` (a rank spec)."""

    enabled: bool = False
    profile_steps: List[int] = field(default_factory=list)
    # Rank spec: "pp_rank0" (rank 0 of every pipeline stage), "" (all ranks) or "0,2-4".
    ranks: str = field(default="pp_rank0", metadata=PROFILE_RANKS)

    def check(self) -> None:
        """Raises ConfigError: a negative step or a malformed rank spec."""
        _check_profile_steps("perf_tracer", self.profile_steps)
        check_settings(self, "perf_tracer")


@dataclass
class MemoryProfilerConfig:
    """Memory trials: allocator snapshots at the end of ``profile_steps`` for the ranks of ``ranks``."""

    profile_steps: List[int] = field(default_factory=list)
    max_entries: int = field(default=100000, metadata=setting(
        "MEMORY_MAX_ENTRIES", "allocator history entries kept for snapshots",
        f"an integer from 1 to {MEMORY_MAX_ENTRIES_MAX} (2**63 - 1, what torch's allocator history takes)",
        lambda v: 1 <= v <= MEMORY_MAX_ENTRIES_MAX))
    ranks: str = field(default="pp_rank0", metadata=PROFILE_RANKS)
    # The stacks each history entry keeps: "all" (Python, TorchScript and C++ frames, torch's default) or "python"
    # (cheaper to record and to dump: bench/snapshot_cost.py); the categories read Python frames alone.
    stacks: str = "all"

    def check(self) -> None:
        """Raises ConfigError: a negative step, a malformed rank spec, ``max_entries`` < 1 or ``stacks`` not one of
        :data:`HISTORY_STACKS`."""
        _check_profile_steps("memory_profiler", self.profile_steps)
        require_choice("memory_profiler.stacks", self.stacks, HISTORY_STACKS)
        check_settings(self, "memory_profiler")


@dataclass
class SFTProfileConfig:
    """Root of the trial configuration (loaded by :func:`sftprof.config.loading.load_config`)."""

    experiment_name: str = field(default="sftprof", metadata=setting(
        "EXPERIMENT_NAME", "experiment_name (letters, digits, '_' and '-')", NAME_ACCEPTED, is_folder_name))
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

