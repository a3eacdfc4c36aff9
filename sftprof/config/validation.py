"""Validation of a merged configuration: each section's own ``check`` (next to its dataclass in
:mod:`sftprof.config.schema`), then the rules that span sections (steps against ``total_train_steps``, the batch
against the layout, one profile kind per trial, the ``reference`` loss path only without TP)."""
from __future__ import annotations

from sftprof.allocation import parse_allocation_mode
from sftprof.config.errors import ConfigError, require
from sftprof.config.schema import SEED_MAX, TOKENS_PER_RANK_MAX, SFTProfileConfig
from sftprof.config.settings import NAME_ACCEPTED, check_settings, is_folder_name


def validate(cfg: SFTProfileConfig) -> None:
    """Check value ranges and choices that the type system cannot express.

    ``experiment_name`` and ``trial_name`` must each be one folder name (:data:`NAME_ACCEPTED`: they become
    folders of the trial's LOG_DIR, :func:`sftprof.config.paths.trial_log_dir`); ``seed`` at most
    :data:`~sftprof.config.schema.SEED_MAX`. Each section checks itself (its ``check`` method); what spans sections is checked here: the profile steps below
    ``total_train_steps`` (``perf_tracer``'s when it is enabled, ``memory_profiler``'s always), at most one
    ``perf_tracer.profile_steps`` entry when it is enabled (a rank's kernel trace file holds one step; memory
    snapshots go to one ``step_<N>/`` folder per step, so ``memory_profiler`` may list several),
    ``train_dataset.batch_size`` against the data-parallel size and against
    :data:`~sftprof.config.schema.TOKENS_PER_RANK_MAX` tokens per
    data-parallel rank and step, ``actor.mb_spec`` against the sequence length and the batch, one profile kind per
    trial, the ``reference`` loss path only without TP.

    Raises:
        ConfigError: the first violation found, naming the dotted key, value and accepted values.
    """
    check_settings(cfg, "")  # experiment_name
    require(is_folder_name(cfg.trial_name), "trial_name", cfg.trial_name, NAME_ACCEPTED)
    require(0 <= cfg.seed <= SEED_MAX, "seed", cfg.seed, f"an integer from 0 to {SEED_MAX} (2**32 - 1, NumPy's range)")
    require(cfg.total_train_steps >= 1, "total_train_steps", cfg.total_train_steps, "an integer >= 1")
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
    require(mbt == 0 or mbt >= p.fake_seq_len, "actor.mb_spec.max_tokens_per_mb", mbt,
            f"0 (no limit) or >= one sequence (profile.fake_seq_len={p.fake_seq_len})")
    layout = parse_allocation_mode(a.backend)
    bs = cfg.train_dataset.batch_size
    require(bs % layout.dp == 0, "train_dataset.batch_size", bs,
            f"a multiple of the data-parallel size {layout.dp} of actor.backend={a.backend!r}")
    rank_seqs_max = TOKENS_PER_RANK_MAX // p.fake_seq_len * layout.dp
    require(bs <= rank_seqs_max, "train_dataset.batch_size", bs,
            f"<= {rank_seqs_max}: a data-parallel rank's micro-batches hold batch_size / dp x profile.fake_seq_len "
            f"tokens a step (dp={layout.dp}, fake_seq_len={p.fake_seq_len}), at most {TOKENS_PER_RANK_MAX} (2**27)")
    require(a.mb_spec.n_mbs <= bs // layout.dp, "actor.mb_spec.n_mbs", a.mb_spec.n_mbs,
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
