"""Planning: the driver variables and arguments -> validated trials, one per profile step and kind.

:func:`plan` runs before anything is launched, in three steps: :func:`read_driver_env` (the variables of
:mod:`sftprof.launch.variables`, parsed and checked; a set config variable becomes the argument ``key=value`` before
the user's), :func:`probe_config` (the config they produce, its model, the layout against this node's GPUs) and
:func:`expand_trials` (one trial per step and kind, each trial's config loaded and so validated), then torchrun's
settings. Any bad value raises :class:`~sftprof.launch.variables.DriverError` naming the variable or argument, the
value and what is accepted (the launcher exits 2, nothing written or launched).

Variables of a config key override the YAML only when they are set, so the shipped YAML carries the seed's
settings (131072 tokens, batch 4, 2 micro-batches, precision-aware optimizer with bf16 main grads) and a preset
such as ``CONFIG=tiny_cpu`` keeps its own sizes. ``PROFILE_RANKS`` unset keeps each profiler's ``ranks`` of the
YAML (or of an argument).

Also refused (exit 2): a ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` torch's parser refuses, a driver
variable given as an argument (or in lower case), an argument that gives a key the driver sets for each trial
(:data:`TRIAL_KEYS`) another value, a set variable that looks like a misspelled driver variable (unless
``SFTPROF_ALLOW_UNKNOWN_VARS=1``), folder names over 255 bytes, a user name that is not one folder name, the megatron
backend on a node without CUDA, fewer visible GPUs than processes per node, a megatron trial whose predicted peak does
not fit one GPU (:func:`check_memory_fit`, unless ``FIT_CHECK`` is ``warn`` or ``off``), ``FIT_CHECK=only`` with the
fsdp backend or without a GPU capacity, and a busy ``MASTER_PORT`` on node 0 (unset on one node: a free port is
picked). Memory trials are skipped without CUDA unless ``PROFILE_KINDS`` asks for them.

``FIT_CHECK=only`` plans for the layout's GPUs without looking at this node's (a question asked from a laptop): the
plan's :class:`RunPlan` carries whether the worst rank fits, and the launcher prints the check and stops.

Above 500 lines for a reason: the checks above run in one order against one plan; the variables' table
is :mod:`sftprof.launch.variables`, the folders :mod:`sftprof.launch.folders`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, TypedDict, cast

from sftprof import artifacts
from sftprof.allocation import Layout, parse_allocation_mode
from sftprof.analysis.memory.fit import (ALLOC_CONF_VARS, ENV, alloc_conf_of, check_fit, fit_text,
                                         fitting_changes)
from sftprof.config import (RUN_ROOT_FILEROOT, ConfigError, SFTProfileConfig, last_value_per_key, load_config,
                            reject_repeated_keys, resolve_config_path, to_yaml, trial_log_dir, variable_conflict)
from sftprof.launch import folders
from sftprof.launch.plan_types import DriverEnv, PlanConfig, PlanLog, Probe, RunPlan, Trial
from sftprof.launch.arguments import (TRIAL_KEYS, arguments_setting, check_trial_arguments, config_value,
                                      reject_driver_variables_as_arguments, yaml_value)
from sftprof.launch.variables import (ALLOW_UNKNOWN, BY_NAME, CONFIG_VARIABLES, DEFAULT_CONFIG, DEFAULT_NODE_TIMEOUT_S,
                                      DEFAULT_STALL_TIMEOUT_S, GIB_EXAMPLES, KINDS, MULTI_NODE_PORT, RANKS_VARIABLE,
                                      REPO_ROOT, DriverError, Variable, check_text, parse_bool, suspect_variables,
                                      unknown_allowed, what_ifs_text)
from sftprof.models.checks import ModelCheckError, check_model
from sftprof.models.hf import load_hf_config
from sftprof.ranks import RankSpecError, format_ranks, resolve_ranks
from sftprof.simulation import assumed

RANK_KEYS = dict(zip(KINDS, RANKS_VARIABLE.keys))  # kind -> its profiler's ranks key


def visible_gpus() -> int:
    """CUDA devices torch sees on this node (0 without CUDA)."""
    import torch  # the launcher's only use of torch: kept off its start (signals are handled from the first moment)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# torch's parser of its allocator settings run on argv[1]; a refusal printed as "<torch version>\t<reason>", exit 3
_ALLOC_CONF_PARSE = """import sys, torch
parse = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
try:
    if parse is not None:
        parse(sys.argv[1])
except Exception as exc:
    print(torch.__version__, (str(exc).strip().splitlines() or [type(exc).__name__])[0], sep="\\t")
    sys.exit(3)
"""
# what torch 2.13's parser says of an option without ":" and a value (an assertion of its tokenizer)
_TOKENIZER_ASSERT = "Index out of bounds in ConfigTokenizer"


def _check_alloc_conf(env: Mapping[str, str]) -> None:
    """Each of ``PYTORCH_ALLOC_CONF`` and ``PYTORCH_CUDA_ALLOC_CONF`` that is set (the trials' processes inherit them,
    and torch reads both: :data:`~sftprof.analysis.memory.fit.ALLOC_CONF_VARS`) read by torch's own parser, so that a
    value torch refuses (``expandable_segments:true``, an option without ``:``) stops the plan instead of every trial
    at its first CUDA allocation. The parser also applies the value to its process, so it runs in a child of its own
    (about 2 s, one for each variable set). Not checked: unset or empty; a torch without that parser (before the
    accelerator-wide one) or a child that fails otherwise (the trials meet that failure themselves); option names a
    CPU build of torch does not know (it skips them; a CUDA build refuses them).

    Raises:
        DriverError: torch refuses a value (its message, first line).
    """
    child_env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
    for name in ALLOC_CONF_VARS:
        text = env.get(name)
        if not text:
            continue
        res = subprocess.run([sys.executable, "-c", _ALLOC_CONF_PARSE, text], env=child_env, capture_output=True,
                             text=True, check=False)
        if res.returncode == 3:
            version, _, reason = res.stdout.strip().partition("\t")
            if _TOKENIZER_ASSERT in reason:
                reason = "an option without ':' and a value"
            raise DriverError(f"{name}={text!r}: torch {version} refuses it ({reason}); accepted: comma-separated "
                              "option:value pairs of torch's caching allocator, e.g. expandable_segments:True "
                              "(True/False spelled so)")


def port_in_use(port: int) -> bool:
    """True when a socket on this node already listens on TCP ``port`` (any address).

    ``SO_REUSEADDR`` is set as torchrun's TCPStore sets it, so connections of an earlier run in
    TIME_WAIT do not count as busy; a listener does (the bind fails with EADDRINUSE).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A TCP port that no socket on this node uses now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _check_suspects(env: Mapping[str, str], log: PlanLog) -> None:
    """A set variable that looks like a misspelled driver variable (:func:`sftprof.launch.variables.suspect_variables`)
    stops the plan when a driver variable is close to its name, unless ``SFTPROF_ALLOW_UNKNOWN_VARS=1``: it would be
    ignored and every trial run with the default. Allowed, or without a close name, it is a warning."""
    suspects = suspect_variables(env)
    allowed = unknown_allowed(env)
    typos = [f"{name}={env[name]!r} (did you mean {near}?" + (" Driver variables are upper case)" if near == name.upper()
                                                               else ")") for name, near, _ in suspects if near]
    if typos and not allowed:
        one = len(typos) == 1
        raise DriverError(f"{' and '.join(typos)} {'is not a driver variable' if one else 'are not driver variables'}: "
                          f"the run would ignore {'it' if one else 'them'}, so nothing was launched; rename "
                          f"{'it' if one else 'them'}, or set {ALLOW_UNKNOWN}=1 to run without {'it' if one else 'them'}")
    for _, _, message in suspects:
        log.warn(message)


def read_driver_env(env: Mapping[str, str], extra_overrides: list[str], log: PlanLog) -> DriverEnv:
    """Step 1: parse every driver variable (no config is read yet); a set config variable becomes the argument
    ``key=value`` before the user's, and the rule for a key given twice (:func:`sftprof.config.reject_repeated_keys`)
    refuses an argument that gives its key another value (one that agrees is noted on the variable's line).

    Raises:
        DriverError: a variable or argument is invalid (see :func:`plan`).
    """
    get = env.get
    check_text(env)
    _check_suspects(env, log)
    _check_alloc_conf(env)
    reject_driver_variables_as_arguments(extra_overrides)
    config = get("CONFIG") or str(REPO_ROOT / DEFAULT_CONFIG)
    log.note("CONFIG", config, "env" if get("CONFIG") else "default")
    # A Variable's parse gives an object (BY_NAME holds variables of every type): each cast below is the type that
    # the variable's parser in sftprof.launch.variables returns.
    steps = cast(list[int], BY_NAME["PROFILE_STEPS"].parse(
        "PROFILE_STEPS", get("PROFILE_STEPS", BY_NAME["PROFILE_STEPS"].default)))
    kinds = cast(list[str], BY_NAME["PROFILE_KINDS"].parse("PROFILE_KINDS", get("PROFILE_KINDS", ",".join(KINDS))))
    total_steps = cast(int | None, BY_NAME["TOTAL_STEPS"].value(env))
    if total_steps is not None and total_steps <= max(steps):
        raise DriverError(f"TOTAL_STEPS={total_steps}: must be > the largest profile step {max(steps)} "
                          "(or unset: profile step + 1)")
    stop = parse_bool("STOP_ON_FAILURE", get("STOP_ON_FAILURE", BY_NAME["STOP_ON_FAILURE"].default))
    what_ifs = cast(int | list[str] | None, BY_NAME["TRY_WHAT_IFS"].value(env)) or 0
    log.note("PROFILE_STEPS", ",".join(map(str, steps)), "env" if get("PROFILE_STEPS") is not None else "default")
    log.note("PROFILE_KINDS", ",".join(kinds), "env" if get("PROFILE_KINDS") is not None else "default")
    log.note("TOTAL_STEPS", total_steps if total_steps else "profile_step+1", "env" if total_steps else "default")
    log.note("STOP_ON_FAILURE", int(stop), "env" if get("STOP_ON_FAILURE") is not None else "default")
    log.note("TRY_WHAT_IFS", what_ifs_text(what_ifs), "env" if get("TRY_WHAT_IFS") else "default")

    variables: dict[str, str] = {}  # key=value -> NAME=text
    set_keys: set[str] = set()
    for var in CONFIG_VARIABLES:
        value = var.value(env)
        if value is not None:  # unset or empty: the config's value stands
            # Text values go in as JSON strings, so YAML never reads "0123", "yes" or "a #b" as something else.
            variables[f"{var.keys[0]}={json.dumps(value) if isinstance(value, str) else yaml_value(value)}"] = \
                f"{var.name}={get(var.name)}"
            set_keys.add(var.name)
    try:
        agreeing = reject_repeated_keys(list(variables) + list(extra_overrides), variables)
    except ConfigError as err:
        raise DriverError(str(err)) from None
    for var in CONFIG_VARIABLES:
        if var.name in set_keys:
            log.agree(var.name, arguments_setting(var.keys[0], agreeing))
    overrides = list(variables)
    master_port = cast(int | None, BY_NAME["MASTER_PORT"].value(env))
    node_timeout = cast(int | None, BY_NAME["NODE_TIMEOUT"].value(env))
    stall_timeout = cast(int | None, BY_NAME["STALL_TIMEOUT"].value(env))
    return DriverEnv(
        get=get, config=config, steps=steps, kinds=kinds, total_steps=total_steps, stop=stop, what_ifs=what_ifs,
        overrides=overrides, extra_overrides=list(extra_overrides), set_keys=set_keys,
        node_rank=cast(int, BY_NAME["NODE_RANK"].parse("NODE_RANK", get("NODE_RANK") or BY_NAME["NODE_RANK"].default)),
        master_addr=cast(str, BY_NAME["MASTER_ADDR"].parse("MASTER_ADDR",
                                                           get("MASTER_ADDR") or BY_NAME["MASTER_ADDR"].default)),
        master_port=master_port, node_timeout=node_timeout if node_timeout is not None else DEFAULT_NODE_TIMEOUT_S,
        fit_check=cast(str | None, BY_NAME["FIT_CHECK"].value(env)) or BY_NAME["FIT_CHECK"].default,
        gpu_memory_gib=cast(float | None, BY_NAME["GPU_MEMORY_GIB"].value(env)),
        stall_timeout=stall_timeout if stall_timeout is not None else DEFAULT_STALL_TIMEOUT_S)


def _sources(d: DriverEnv, model: bool = False) -> str:
    """Where a config error's value can come from, for its message (the arguments only when given)."""
    names = [f"CONFIG={d.config}"] + (["MODEL_PATH"] if model else []) + ["the driver variables"]
    if d.extra_overrides:
        names.append("the arguments " + " ".join(d.extra_overrides))
    return f"(from {', '.join(names[:-1])} and {names[-1]})"


def _load_probe_config(d: DriverEnv) -> SFTProfileConfig:
    """The config of ``d`` (without trial settings), its model config and the Hugging Face tokenizer a trial would
    load (none: the bundled BPE) checked."""
    try:  # the keys each trial sets itself are checked per trial (expand_trials)
        probe = load_config(d.config, d.overrides + [a for a in d.extra_overrides
                                                     if a.partition("=")[0].strip() not in TRIAL_KEYS])
    except ConfigError as err:
        raise DriverError(f"{err} {_sources(d)}") from err
    try:  # a damaged model or tokenizer stops the plan, not every trial (the bundled tokenizer is the package's)
        check_model(probe, parse_allocation_mode(probe.actor.backend), bundled_tokenizer=False)
    except ModelCheckError as err:
        where = {"model": "(MODEL_PATH / actor.path)", "settings": _sources(d, model=True),
                 "tokenizer": "(tokenizer_path / MODEL_PATH)"}[err.part]
        raise DriverError(f"{err} {where}") from err
    return probe


def _source(var: Variable, d: DriverEnv) -> str:
    """Where config variable ``var``'s value came from: the variable, an argument, or the config (the YAML)."""
    arguments = arguments_setting(var.keys[0], d.extra_overrides)
    if var.name in d.set_keys:
        return f"env -> {var.keys[0]}"   # with the arguments that agree (PlanLog.agree)
    return f"argument {arguments[-1]}" if arguments else f"config {var.keys[0]}"


def probe_config(d: DriverEnv, gpus: int | None, log: PlanLog) -> Probe:
    """Step 2: load the config the variables produce and check the torchrun layout against this node.

    Adds ``cluster.*`` and the profiled ranks to ``d.overrides``. Without CUDA, memory trials are dropped
    unless ``PROFILE_KINDS`` asked for them.

    Raises:
        DriverError: see :func:`plan`.
    """
    get, config = d.get, d.config
    probe = _load_probe_config(d)
    layout = parse_allocation_mode(probe.actor.backend)
    n_nodes = probe.cluster.n_nodes
    if d.node_rank >= n_nodes:
        raise DriverError(f"NODE_RANK={d.node_rank}: must be in [0, N_NODES={n_nodes})")
    if d.what_ifs and n_nodes > 1:  # node 0 chooses them from its summaries: the other nodes cannot follow
        raise DriverError(f"TRY_WHAT_IFS={what_ifs_text(d.what_ifs)} with N_NODES={n_nodes}: what-if trials are "
                          "chosen from node 0's summaries after the planned trials; accepted: TRY_WHAT_IFS=0 "
                          "(or unset) with several nodes")
    nproc_var = BY_NAME["N_GPUS_PER_NODE"]
    nproc_given = nproc_var.name in d.set_keys or arguments_setting(nproc_var.keys[0], d.extra_overrides)
    nproc = probe.cluster.n_gpus_per_node if nproc_given else layout.world_size // n_nodes
    simulated = probe.actor.simulate.rank
    if simulated >= 0:  # one process: the layout's rank `simulated` (sftprof.trainer)
        if n_nodes != 1 or nproc not in (1, layout.world_size):
            raise DriverError(f"SIMULATE_RANK={simulated}: a simulated rank is one process on one node, but N_NODES="
                              f"{n_nodes} x N_GPUS_PER_NODE={nproc}; accepted: N_NODES unset or 1, N_GPUS_PER_NODE "
                              f"unset, 1 or the layout's world size {layout.world_size} (the simulated cluster's ranks "
                              "per node: actor.simulate.gpus_per_node)")
        nproc = 1
        log.notices.append(f"simulated rank {simulated} of {probe.actor.backend} ({layout.describe()}) on one "
                           f"device: collectives not run; assumed: {assumed(layout.backend)} (docs/simulated_rank.md)")
    elif nproc * n_nodes != layout.world_size:
        raise DriverError(
            f"N_GPUS_PER_NODE={nproc} x N_NODES={n_nodes} = {nproc * n_nodes} processes, but actor.backend="
            f"{probe.actor.backend!r} needs world size {layout.world_size}")
    d.overrides += [f"cluster.n_nodes={n_nodes}", f"cluster.n_gpus_per_node={nproc}"]
    if d.fit_check == "only":  # a plan for the GPU node it names (one GPU per process), this node's GPUs not asked
        gpus = nproc
    elif gpus is None:
        gpus = visible_gpus()
    if layout.backend == "megatron" and gpus == 0:
        raise DriverError(f"actor.backend={probe.actor.backend!r}: the megatron backend needs CUDA GPUs and this node has "
                          f"none (CONFIG={config}); " + _cpu_hint(d, layout))
    if 0 < gpus < nproc:
        raise DriverError(f"N_GPUS_PER_NODE={nproc} processes on this node, one GPU each, but it has {gpus} visible "
                          f"GPU(s) (CUDA_VISIBLE_DEVICES={get('CUDA_VISIBLE_DEVICES', 'unset')}); actor.backend="
                          f"{probe.actor.backend!r} needs world size {layout.world_size}")
    kinds = d.kinds
    if gpus == 0 and "memory" in kinds:
        if get("PROFILE_KINDS") is None:
            kinds = [k for k in kinds if k != "memory"]
            log.note("PROFILE_KINDS", ",".join(kinds), "default without CUDA (kernel,memory with CUDA)")
            log.notices.append("no CUDA on this node: memory trials skipped (allocator snapshots need CUDA); "
                               "PROFILE_KINDS=kernel,memory runs them anyway")
        else:
            log.notices.append("no CUDA on this node: memory trials run but record no snapshot (CPU)")
    ranks_specs = _profiled_ranks(d, probe, layout, kinds, log)
    d.overrides += [f"{RANK_KEYS[kind]}='{spec}'" for kind, spec in ranks_specs.items()]
    for var in CONFIG_VARIABLES:
        if not var.default:  # its default is the YAML's (N_GPUS_PER_NODE's is derived: noted below)
            log.note(var.name, yaml_value(config_value(probe, var.keys[0])), _source(var, d))
    if probe.cluster.fileroot:  # else RUN_ROOT/fileroot (expand_trials), checked with RUN_ROOT
        _check_fileroot(Path(probe.cluster.fileroot), log)
        log.note("FILEROOT", probe.cluster.fileroot, _source(BY_NAME["FILEROOT"], d))
    elif n_nodes > 1:
        raise DriverError(f"FILEROOT is unset with N_NODES={n_nodes}: node 0 reads every node's logs there, so set "
                          "FILEROOT to the same folder on a filesystem all nodes share")
    log.note("N_GPUS_PER_NODE", nproc, _source(nproc_var, d) if nproc_given else "one simulated rank"
             if simulated >= 0 else f"world size {layout.world_size} / N_NODES")
    if d.extra_overrides:
        log.settings.append(f"# extra overrides: {' '.join(d.extra_overrides)}")
    log.settings.append(f"# layout {probe.actor.backend}: {layout.describe()}")
    return Probe(cfg=probe, layout=layout, n_nodes=n_nodes, nproc=nproc, gpus=gpus, kinds=kinds, ranks_specs=ranks_specs)


def _check_fileroot(fileroot: Path, log: PlanLog) -> None:
    """A FILEROOT that is set: folders can be made there; a folder named like the package is used, with a warning (a
    Python started in its parent would import it instead of the package)."""
    package = Path(__file__).resolve().parents[1].name  # sftprof
    folders.check_writable_folder("FILEROOT", fileroot)
    if fileroot.name == package:  # e.g. /tmp/sftprof, a default before: used as given
        log.warn(f"FILEROOT {fileroot} is a folder named {package}: a Python started in {fileroot.parent} imports it "
                 f"(an empty namespace package) instead of the {package} package; name it otherwise, e.g. "
                 f"FILEROOT={fileroot.parent / (package + '_' + RUN_ROOT_FILEROOT)}, or leave FILEROOT unset "
                 f"(RUN_ROOT/{RUN_ROOT_FILEROOT})")


def _cpu_hint(d: DriverEnv, layout: Layout) -> str:
    """What to run instead of the megatron backend on a node without CUDA: the fsdp backend of the same world size
    when an argument made the backend megatron (whatever CONFIG is: ``CONFIG=tiny_cpu`` may be set already), else the
    CPU preset."""
    given = arguments_setting("actor.backend", d.extra_overrides)
    if given:
        return (f"the argument {given[-1]} makes it megatron: on a machine without CUDA use the fsdp backend, "
                f"actor.backend=fsdp:d{layout.world_size} (CPU, gloo)")
    return "on a machine without CUDA use CONFIG=tiny_cpu (fsdp on CPU, gloo)"


def _profiled_ranks(d: DriverEnv, probe: SFTProfileConfig, layout: Layout, kinds: list[str],
                    log: PlanLog) -> dict[str, str]:
    """The rank spec of each kind's trials (kind -> spec, for :data:`RANK_KEYS`), noted in ``profile_settings.log``.

    ``PROFILE_RANKS`` set gives both keys, and an argument ``perf_tracer.ranks=...`` or ``memory_profiler.ranks=...``
    must then give the same ranks (it is noted as agreeing); unset, each kind keeps its profiler's ``ranks`` of the
    config (the YAML's, or an argument's). The line names the ranks of the planned kinds and where each came from
    (per kind when they differ).

    Raises:
        DriverError: a spec is invalid for the layout, or ``PROFILE_RANKS`` and an argument give different ranks.
    """
    ranks_env = d.get("PROFILE_RANKS")
    env_spec, env_ranks = "", None
    if ranks_env is not None:  # empty: every rank
        backend = f" (actor.backend={probe.actor.backend})"
        try:
            env_spec = str(RANKS_VARIABLE.parse("PROFILE_RANKS", ranks_env))  # the keys' check (schema.PROFILE_RANKS)
            env_ranks = resolve_ranks(env_spec, layout)
        except DriverError as err:
            raise DriverError(f"{err}{backend}") from None
        except RankSpecError as err:
            raise DriverError(f"PROFILE_RANKS={ranks_env!r}: {err}{backend}") from err
    specs, shown, sources = {}, {}, {}
    for kind, key in RANK_KEYS.items():
        arguments = arguments_setting(key, d.extra_overrides)
        spec = str(config_value(probe, key)).strip()  # the YAML's, or the arguments' (as the trainer reads it)
        where = f"argument {arguments[-1]}" if arguments else "config"
        try:
            ranks = resolve_ranks(spec, layout)
        except RankSpecError as err:
            raise DriverError(f"{where if arguments else 'config ' + key}: {err} (actor.backend="
                              f"{probe.actor.backend})") from err
        if env_ranks is not None:
            if arguments and ranks != env_ranks:
                raise DriverError(variable_conflict(f"PROFILE_RANKS={ranks_env}", " and ".join(RANK_KEYS.values()),
                                                    arguments[0]))
            log.agree("PROFILE_RANKS", arguments)
            spec, ranks, where = env_spec, env_ranks, "env"
        specs[kind], shown[kind], sources[kind] = spec, format_ranks(ranks) if spec else "all", where
    planned = [k for k in RANK_KEYS if k in kinds]
    same = len({shown[k] for k in planned}) == 1
    if all(sources[k] == "config" for k in planned):
        source = "config " + " and ".join(RANK_KEYS[k] for k in planned)
    elif len({sources[k] for k in planned}) == 1:
        source = sources[planned[0]]
    else:
        source = "; ".join(f"{k} trials: " + ("config " + RANK_KEYS[k] if sources[k] == "config" else sources[k])
                           for k in planned)
    log.note("PROFILE_RANKS", shown[planned[0]] if same else ", ".join(f"{k} {shown[k]}" for k in planned), source)
    return specs


def expand_trials(d: DriverEnv, p: Probe, log: PlanLog) -> tuple[list[Trial], Path, SFTProfileConfig]:
    """Step 3: one :class:`Trial` per (profile step, kind), step-major, kernel before memory; RUN_ROOT; and
    the first trial's resolved config.

    Each trial's config is loaded (and so validated) with its own overrides: trial name, total steps and
    the profile settings of its kind and step. The trial's kind and step reach the trainer through these
    overrides and postprocessing through the same :class:`Trial` (one route, no file read back).

    Raises:
        DriverError: see :func:`plan`.
    """
    run_root, stamp = folders.choose_run_root(d, p, log)
    if not p.cfg.cluster.fileroot:  # one per user and run: the trainer logs beside the run's outputs
        d.overrides.append(f"cluster.fileroot={run_root / RUN_ROOT_FILEROOT}")
        log.note("FILEROOT", run_root / RUN_ROOT_FILEROOT, "default: RUN_ROOT/" + RUN_ROOT_FILEROOT)
    config_file = resolve_config_path(d.config)
    plan_text = config_file.read_bytes()  # every trial runs this text: its copy in RUN_ROOT (folders.write_plan)
    plan_config = run_root / artifacts.PLAN_CONFIG
    tag = folders.model_tag(p.cfg.actor.path)
    owned = {key: args for key in TRIAL_KEYS if (args := arguments_setting(key, d.extra_overrides))}
    trials: list[Trial] = []
    first_cfg: SFTProfileConfig | None = None
    for step in d.steps:
        for kind in p.kinds:
            name = folders.trial_name(tag, p.cfg.profile.fake_seq_len, kind, step, stamp)
            settings = {
                "trial_name": f"trial_name={name}",
                "total_train_steps": f"total_train_steps={d.total_steps or step + 1}",
                "perf_tracer.enabled": f"perf_tracer.enabled={'true' if kind == 'kernel' else 'false'}",
                "perf_tracer.profile_steps": f"perf_tracer.profile_steps=[{step if kind == 'kernel' else ''}]",
                "memory_profiler.profile_steps": f"memory_profiler.profile_steps=[{step if kind == 'memory' else ''}]",
            }
            trial_overrides = d.overrides + d.extra_overrides + list(settings.values())
            cfg = load_config(d.config, trial_overrides)
            if owned:
                check_trial_arguments(d, owned, settings, cfg, f"the {kind} trial of step {step}", log)
            first_cfg = first_cfg or cfg
            log_dir = trial_log_dir(cfg)
            folders.check_path_fits("FILEROOT, EXPERIMENT_NAME or PROFILE_STAMP", log_dir,
                                    "the trial log dir FILEROOT/logs/<user>/<experiment>/<trial>")
            # Node 0 checks: other nodes may plan after node 0's first trial has started writing there.
            if d.node_rank == 0 and log_dir.exists() and any(q.name != artifacts.NODES for q in log_dir.iterdir()):
                raise DriverError(f"trial log dir {log_dir} exists and is not empty (same EXPERIMENT_NAME and "
                                  "PROFILE_STAMP as an earlier run); choose another PROFILE_STAMP")
            # the trainer refuses a key given twice with different values: hand it the values that won here
            trials.append(Trial(name, kind, step, run_root / name, log_dir,
                                ["--config", str(plan_config), *last_value_per_key(trial_overrides)]))
    if config_file.read_bytes() != plan_text:
        raise DriverError(f"CONFIG={d.config}: {config_file} changed while the run was planned; plan again once it "
                          "is no longer being edited")
    log.config = PlanConfig(str(config_file.resolve()), str(plan_config), plan_text)
    for t in trials:  # the trainer checks the copy it loads against the plan (trainer.check_plan_config)
        t.env[artifacts.PLAN_CONFIG_SHA256_ENV] = log.config.sha256
    log.settings.append(f"# config: {plan_config}, the copy of {config_file.resolve()} every trial loads "
                        f"(sha256 {log.config.sha256})")
    assert first_cfg is not None  # a trial per step and kind: PROFILE_STEPS and the kinds are never empty
    return trials, run_root, first_cfg


def gpu_free_gib(nproc: int, env: Mapping[str, str]) -> float | None:
    """The least free memory (GiB) of the GPUs this node's ``nproc`` ranks take (``CUDA_VISIBLE_DEVICES`` by index,
    else the first ones), from nvidia-smi, which creates no CUDA context; None without nvidia-smi or its answer."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        free = {int(i): float(m) for i, m in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    order = [int(i) for i in visible.split(",")] if visible and visible.replace(",", "").isdigit() else sorted(free)
    used = [free[i] for i in order[:nproc] if i in free]
    return min(used) / 1024 if len(used) == nproc else None


def _setting_text(key: str, value: object) -> str:
    """A setting as the user gives it: its driver variable where one sets that key alone, else an argument."""
    if key.startswith(ENV):
        return f"{key[len(ENV):]}={value}"
    var = next((v for v in CONFIG_VARIABLES if v.keys == (key,)), None)
    return f"{var.name}={yaml_value(value)}" if var else f"{key}={yaml_value(value)}"


def check_memory_fit(d: DriverEnv, p: Probe, log: PlanLog) -> bool | None:
    """Step 2b: the worst rank's predicted peak against one GPU (:mod:`sftprof.analysis.memory.fit`), before anything is
    written: a line in ``profile_settings.log``; over capacity, the settings that fit with their predicted peak, and
    ``FIT_CHECK`` decides (``refuse``: DriverError, ``warn``: a warning, ``off``: not checked, ``only``: the line and
    the settings that fit as notices). Megatron only. Returns whether it fits (None: not checked).

    Raises:
        DriverError: the peak does not fit and ``FIT_CHECK=refuse`` (the default); ``FIT_CHECK=only`` with the fsdp
            backend, or with neither ``GPU_MEMORY_GIB`` nor nvidia-smi's answer.
    """
    mode, given = d.fit_check, d.gpu_memory_gib
    if mode == "only" and p.layout.backend != "megatron":
        raise DriverError(f"FIT_CHECK=only with actor.backend={p.cfg.actor.backend!r}: the fit check covers the "
                          "megatron backend only; accepted: a megatron actor.backend, or FIT_CHECK unset to run the "
                          "trials")
    if mode == "off" or p.layout.backend != "megatron":
        return None
    capacity = given if given is not None else gpu_free_gib(p.nproc, {"CUDA_VISIBLE_DEVICES": d.get(
        "CUDA_VISIBLE_DEVICES") or ""})
    if capacity is None and mode == "only":
        raise DriverError(f"FIT_CHECK=only: no GPU memory to check against (GPU_MEMORY_GIB is unset and nvidia-smi "
                          f"gave no answer); set GPU_MEMORY_GIB to one GPU's GiB, {GIB_EXAMPLES}")
    if capacity is None:
        log.notices.append("fit check skipped: no GPU_MEMORY_GIB and no answer from nvidia-smi")
        return None
    source = "GPU_MEMORY_GIB" if given is not None else "the least free memory of this node's GPUs, nvidia-smi"
    cfg = dataclasses.asdict(p.cfg)
    path, seq = p.cfg.actor.path, p.cfg.profile.fake_seq_len
    conf_var, alloc_conf = alloc_conf_of({name: d.get(name) for name in ALLOC_CONF_VARS})
    cap = int(capacity * 2**30)
    fit = check_fit(cfg, load_hf_config(path, p.cfg.actor.num_layers), p.layout, seq, cap, alloc_conf)
    line = f"fit check: {fit_text(fit, source=source)}"
    log.settings.append("# " + line)
    if fit["fits"]:
        if fit["tight"]:
            log.warn(line)
        else:
            log.notices.append(line)
        return True
    changes = fitting_changes(cfg, lambda n: load_hf_config(path, n), p.layout, seq, cap, alloc_conf,
                              conf_var=conf_var)
    advice = "; ".join(" ".join(_setting_text(k, v) for k, v in c["settings"].items())
                       + f" ({fit_text(c['check'], brief=True)})" for c in changes) or (
        "none of expandable segments, the chunked LM head, full recompute, fewer tokens or fewer layers fits (fewer "
        "tokens and fewer layers together not tried: GPU_MEMORY_GIB and FIT_CHECK=refuse check such a plan): use "
        "more GPUs (TP, CP, EP, PP)")
    fitting = f"Settings that fit, smallest change first: {advice}"
    if mode == "only":
        log.notices += [line, f"the predicted peak does not fit one GPU. {fitting}"]
        return False
    text = f"the predicted peak does not fit one GPU: {line[len('fit check: '):]}. {fitting}"
    if mode == "refuse":
        raise DriverError(f"{text}. Nothing was launched; set one, or FIT_CHECK=warn to launch anyway")
    log.warn(text)
    return False


class _Torchrun(TypedDict):
    """torchrun's settings (:func:`_torchrun_settings`), named as :class:`RunPlan`'s fields."""
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


def _torchrun_settings(d: DriverEnv, p: Probe, log: PlanLog) -> _Torchrun:
    """torchrun's ``nproc_per_node, nnodes, node_rank, master_addr, master_port`` (a free port on one node)."""
    master_port = d.master_port
    if master_port is None and p.n_nodes == 1:
        master_port = free_port()
        log.note("MASTER_PORT", master_port, "default: a free port of this node")
    elif master_port is None:
        master_port = MULTI_NODE_PORT
        log.note("MASTER_PORT", master_port, "default with N_NODES > 1")
    else:
        log.note("MASTER_PORT", master_port, "env")
    if d.node_rank == 0 and port_in_use(master_port):
        raise DriverError(f"MASTER_PORT={master_port}: already in use on this node (torchrun's rendezvous would fail "
                          "with EADDRINUSE); choose a free port" + (" or leave MASTER_PORT unset to pick one"
                                                                    if p.n_nodes == 1 else " on node 0"))
    log.note("NODE_TIMEOUT", d.node_timeout, "env" if d.get("NODE_TIMEOUT") else "default")
    log.note("STALL_TIMEOUT", d.stall_timeout, "env" if d.get("STALL_TIMEOUT") else "default")
    torchrun: _Torchrun = {"nproc_per_node": p.nproc, "nnodes": p.n_nodes, "node_rank": d.node_rank,
                           "master_addr": d.master_addr, "master_port": master_port}
    log.settings.append("# torchrun " + " ".join(f"--{k}={v}" for k, v in torchrun.items()))
    return torchrun


def plan(env: Mapping[str, str], extra_overrides: list[str], gpus: int | None = None,
         ) -> tuple[list[Trial], list[str], RunPlan]:
    """Validate the driver environment and return ``(trials, settings_lines, run_plan)``.

    Three steps: :func:`read_driver_env` (parse the variables), :func:`probe_config` (the config they
    produce, checked against this node) and :func:`expand_trials` (one trial per step and kind), then the
    torchrun settings.

    Args:
        env: the driver's environment variables.
        extra_overrides: the driver's arguments (config overrides for every trial).
        gpus: CUDA devices on this node (None: ask torch, :func:`visible_gpus`).

    ``run_plan`` (:class:`RunPlan`): RUN_ROOT, torchrun's settings, the limits, the config every trial loads and
    the lines for the user.

    Raises:
        DriverError: a variable or argument is invalid, the config they produce is invalid, the
            torchrun world size does not match the allocation mode, this node lacks the GPUs the
            layout needs, MASTER_PORT is busy on node 0, a driver variable and an argument set one config key to
            different values, or RUN_ROOT exists and is not empty or cannot be created.
    """
    log = PlanLog()
    d = read_driver_env(env, extra_overrides, log)
    p = probe_config(d, gpus, log)
    fits = check_memory_fit(d, p, log)
    trials, run_root, first_cfg = expand_trials(d, p, log)
    config = log.config
    assert config is not None  # set by expand_trials
    torchrun = _torchrun_settings(d, p, log)
    log.settings += [f"# warning: {w}" for w in log.warnings]
    log.settings.append("# resolved config of the first trial:")
    log.settings += ["#   " + line for line in to_yaml(first_cfg).splitlines()]
    if d.fit_check == "only":
        device = "GPUs assumed, this node's not used: FIT_CHECK=only"
    else:
        device = f"{p.gpus} GPU(s) on this node" if p.gpus else "CPU (no CUDA)"
    sim = p.cfg.actor.simulate.rank
    where = (f"rank {sim} of {p.layout.world_size} simulated in one process ({p.cfg.actor.backend}, {device})"
             if sim >= 0 else
             f"{p.layout.world_size} rank(s) ({p.n_nodes} node(s) x {p.nproc}, {p.cfg.actor.backend}, {device})")
    log.notices.append(f"plan: {len(trials)} trial(s) on {where}: "
                       + ", ".join(f"{t.kind} step {t.step}" for t in trials))
    return trials, log.settings, RunPlan(
        run_root=run_root, run_root_set=bool(d.get("RUN_ROOT")), trials=len(trials), stop_on_failure=int(d.stop),
        what_ifs=d.what_ifs, node_timeout=d.node_timeout, stall_timeout=d.stall_timeout, **torchrun, config=config,
        notices=log.notices, warnings=log.warnings, fit_only=fits if d.fit_check == "only" else None)
