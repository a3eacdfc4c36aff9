"""Driver planning: environment variables -> validated trials (one per profile step and kind).

``run_qwen3_30b_a3b_sft_profile.sh`` calls ``python -m sftprof.launch plan`` once before launching
anything. It validates every environment variable and the config they produce, resolves the
profiled ranks, refuses an existing non-empty ``RUN_ROOT`` or one where no folder can be made, and writes:

- ``RUN_ROOT/profile_settings.log``: every driver variable with its effective value and source,
  the torchrun layout, and the resolved config of the first trial;
- ``RUN_ROOT/trials.tsv``: one row per trial (step-major, kernel before memory):
  ``trial_name, kind, step, run_dir, log_dir, args_file``;
- ``RUN_ROOT/<trial>/train_args.txt``: the trainer's arguments, one per line.

Variables that map to a config key override the YAML only when they are set, so the shipped YAML
carries the seed defaults (``qwen3_30b_a3b_sft_profile.yaml``: 131072 tokens, batch 4, 2
micro-batches, logprobs chunk 128, precision-aware optimizer with bf16 main grads) and a preset
such as ``CONFIG=tiny_cpu`` keeps its own sizes. Any bad value exits 2 with a message naming the
variable, the value and what is accepted.

Before writing anything, ``plan`` also refuses (exit 2) a driver variable given as an argument (or in lower case), a
driver variable and an argument that set one config key to different values (``PROFILE_RANKS``: either profiler's
``ranks``), an argument that gives a key the driver sets for each trial (:data:`TRIAL_KEYS`) another value, a folder
name over 255 bytes (:func:`_check_folder_names`), a user name that is not one folder name (:func:`log_user`), the
megatron backend on a node without CUDA, fewer visible GPUs than processes per node, and a busy
``MASTER_PORT`` on node 0 (unset on one node: a free port is picked); it warns about environment
variables that look like misspelled driver variables and about a ``FILEROOT`` folder named ``sftprof`` (which a
Python started in its parent imports instead of the package), skips memory trials without CUDA unless
``PROFILE_KINDS`` asks for them, and prints the plan of all trials (to stderr; stdout carries the
shell variables the driver evaluates). SIGINT or SIGTERM while it plans removes what it wrote (only that: a
RUN_ROOT it made, else the files it made in an empty one; :func:`remove_plan`), prints
``PLAN_INTERRUPTED='<what was removed or left>'`` on stdout and exits 128 + the signal.

Other subcommands the driver calls: ``usage`` (its ``--help``), ``status LOG_DIR`` (``0`` when the
trial's ``stats.jsonl`` ends with a completion record of status ``ok``, else ``1``),
``node-record`` / ``wait-nodes`` (multi-node end records, ``LOG_DIR/nodes/node<k>.json``), ``not-run RUN_ROOT``
(a ``not run`` row in ``summary.tsv`` for each planned trial that did not run: :func:`record_trials_not_run`) and
``report RUN_ROOT`` (the end-of-run table).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import difflib
import getpass
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Mapping

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sftprof import artifacts
from sftprof.allocation import Layout, parse_allocation_mode
from sftprof.analysis.failure import headline
from sftprof.analysis.schema import SummaryReadError, read_summary
from sftprof.artifacts import read_stats
from sftprof.cli import run_main
from sftprof.config import (DEFAULT_FILEROOT, LEGACY_LOSS_KEYS, NAME_ACCEPTED, PRECISION_FIELDS, ConfigError, SFTProfileConfig,
                            is_folder_name, last_value_per_key, load_config, reject_repeated_keys, to_yaml,
                            trial_log_dir)
from sftprof.config import FAKE_SEQ_LEN_WHY, TOKENS_PER_RANK_MAX  # PROFILE_FAKE_SEQ_LEN's bound
from sftprof.models.hf import ModelPathError, check_weights_present, load_hf_config
from sftprof.ranks import RankSpecError, format_ranks, resolve_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "qwen3_30b_a3b_sft_profile.yaml"
KINDS = ("kernel", "memory")
BOOL_TEXT = {"true": True, "false": False, "1": True, "0": False}
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


DRIVER_SCRIPT = "run_qwen3_30b_a3b_sft_profile.sh"
# Largest step count + 1 the driver takes (PROFILE_STEPS, TOTAL_STEPS): a longer run is a typo, not a profile.
MAX_STEPS = 10**9
DEFAULT_NODE_TIMEOUT_S = 600  # torch's own default for the static rendezvous (torch.distributed.elastic)
NODE_TIMEOUT_MAX_S = 2**31 - 1  # NODE_TIMEOUT=99999999999999999999999 crashed torchrun (OverflowError, C int)


class DriverError(ValueError):
    """A driver environment variable is invalid (message names it, its value and what is accepted)."""


@dataclass(frozen=True)
class DriverVar:
    """A driver environment variable as ``--help`` and README.md list it."""

    name: str
    default: str
    meaning: str


DRIVER_VARS = (
    DriverVar("CONFIG", DEFAULT_CONFIG, "YAML path or bundled preset (tiny_cpu, tiny_qwen3_5_cpu)"),
    DriverVar("MODEL_PATH", "qwen3_30b_a3b (bundled config, random init)", "HF model dir (actor.path)"),
    DriverVar("FILEROOT", f"{DEFAULT_FILEROOT} (config cluster.fileroot)", "trainer logs go to FILEROOT/logs/<user>/<experiment>/<trial>/"),
    DriverVar("EXPERIMENT_NAME", "from the YAML", "experiment_name (letters, digits, '_' and '-')"),
    DriverVar("PROFILE_STEPS", "0,1", "steps to profile (each < 10**9), one trial per step and kind"),
    DriverVar("TOTAL_STEPS", "profile step + 1", "steps each trial runs (must exceed the profile step; <= 10**9)"),
    DriverVar("PROFILE_RANKS", "rank 0 of every PP stage", "empty: all ranks; 0,2-4: those ranks"),
    DriverVar("PROFILE_KINDS", "kernel,memory (kernel without CUDA)", "subset of kernel,memory"),
    DriverVar("N_GPUS_PER_NODE", "world size / N_NODES", "torchrun --nproc_per_node"),
    DriverVar("N_NODES", "1", "nodes; run the driver on each with the same PROFILE_STAMP and a shared FILEROOT"),
    DriverVar("NODE_RANK", "0", "this node (node 0 postprocesses every rank)"),
    DriverVar("MASTER_ADDR", "127.0.0.1", "address of node 0"),
    DriverVar("MASTER_PORT", "a free port (1 node), 29500 (several)", "torchrun rendezvous port on node 0"),
    DriverVar("NODE_TIMEOUT", str(DEFAULT_NODE_TIMEOUT_S), "seconds a node waits for the others to join, and "
              "node 0 for their end records (1 to 2**31 - 1)"),
    DriverVar("PROFILE_FAKE_SEQ_LEN", "131072", "tokens per sample (profile.fake_seq_len, 2 to 2**27)"),
    DriverVar("PROFILE_FAKE_DATASET_SIZE", "8", "samples in the fake dataset"),
    DriverVar("PROFILE_FAKE_LOSS_START_RATIO", "0.5", "loss mask starts at this fraction of the sample"),
    DriverVar("TRAIN_BATCH_SIZE", "4", "global batch (sequences per step)"),
    DriverVar("PROFILE_N_MBS", "2", "micro-batches per data-parallel rank"),
    DriverVar("MEMORY_MAX_ENTRIES", "100000", "allocator history entries kept for snapshots"),
    DriverVar("LOGPROBS_CHUNK_SIZE", "128", "tokens per chunk of the fused vocab-parallel logprob on CPU (0 = all at once; CUDA: one launch)"),
    DriverVar("LM_HEAD_LOSS_CHUNK_SIZE", "0", "> 0: chunked LM-head loss with that many tokens per chunk"),
    DriverVar("USE_PRECISION_AWARE_OPTIMIZER", "true", "Megatron precision-aware optimizer (needs Transformer Engine)"),
    DriverVar("MAIN_GRADS_DTYPE", "bfloat16", "float32 or bfloat16 main grads"),
    DriverVar("USE_DETERMINISTIC_ALGORITHMS", "false", "deterministic kernels"),
    DriverVar("STOP_ON_FAILURE", "1", "stop after the first failed trial (the rest are listed as `not run`)"),
    DriverVar("RUN_ROOT", "./sftprof_runs/<experiment>_<stamp>[_node<k>]", "where trial outputs and summary.tsv go; "
              "never overwritten"),
    DriverVar("PROFILE_STAMP", "now (%Y%m%d_%H%M%S)", "suffix of trial names (letters, digits, '_' and '-')"),
    DriverVar("PYTHON", "python3", "the Python that runs everything"),
)
# Unknown variables that start like a driver variable are probably misspelled ones.
_DRIVER_PREFIXES = ("PROFILE_", "MEMORY_", "LOGPROBS_", "LM_HEAD_", "TRAIN_", "TOTAL_", "N_GPU", "N_NODE",
                    "USE_PRECISION", "USE_DETERMINISTIC", "MAIN_GRAD", "STOP_ON", "EXPERIMENT_")


def _closest(name: str, cutoff: float) -> str | None:
    match = difflib.get_close_matches(name, [v.name for v in DRIVER_VARS], n=1, cutoff=cutoff)
    return match[0] if match else None


def unknown_variable_warnings(env: Mapping[str, str]) -> list[str]:
    """One warning per environment variable that looks like a misspelled driver variable.

    A variable is suspect when it is not a driver variable and, in upper case, is one (``profile_steps``: the
    driver reads upper-case names only), starts with a driver prefix (``PROFILE_``, ``MEMORY_``, ...) or is close
    to a driver variable's name (difflib ratio >= 0.85); the warning names the closest driver variable
    (ratio >= 0.8) when there is one.
    """
    known = {v.name for v in DRIVER_VARS}
    out = []
    for name in sorted(env):
        upper = name.upper()
        if name in known:
            continue
        if upper in known:
            out.append(f"{name} is not a driver variable and is ignored (driver variables are upper case); "
                       f"did you mean {upper}?")
        elif upper.startswith(_DRIVER_PREFIXES) or _closest(upper, 0.85):
            near = _closest(upper, 0.8)
            out.append(f"{name} is not a driver variable and is ignored" +
                       (f"; did you mean {near}?" if near else f" (`bash {DRIVER_SCRIPT} --help` lists them)"))
    return out


def usage() -> str:
    """The driver's ``--help`` text: synopsis, every variable with its default, examples."""
    width = max(len(v.name) for v in DRIVER_VARS)
    lines = [f"usage: [VAR=value ...] bash {DRIVER_SCRIPT} [key=value ...]",
             "",
             "Profile SFT training steps: one torchrun trial per (profile step, kind); kernel trials record",
             "PyTorch-profiler traces, memory trials CUDA allocator snapshots; each trial is postprocessed into",
             "trace views and profile_summary.{json,md}. Arguments after the script are config overrides for every",
             "trial (dotted keys, e.g. actor.num_layers=4); driver variables go before `bash`.",
             "",
             "Driver variables (config-mapped ones override the YAML only when set):"]
    for v in DRIVER_VARS:
        lines.append(f"  {v.name:<{width}}  {v.meaning} [default: {v.default}]")
    lines += ["",
              "Examples:",
              f"  CONFIG=tiny_cpu bash {DRIVER_SCRIPT}                       # whole workflow on CPU",
              f"  PROFILE_STEPS=1 PROFILE_KINDS=kernel bash {DRIVER_SCRIPT}   # one kernel trial, 8 GPUs",
              f"  USE_PRECISION_AWARE_OPTIMIZER=false TRAIN_BATCH_SIZE=1 PROFILE_N_MBS=1 bash {DRIVER_SCRIPT} "
              "actor.backend=megatron:d1 actor.num_layers=3",
              f"  N_NODES=2 NODE_RANK=0 PROFILE_STAMP=s1 MASTER_ADDR=node0 FILEROOT=/shared/sftprof_fileroot bash {DRIVER_SCRIPT}",
              "",
              "Exit status: 0 all trials ok, 2 bad input (nothing launched), 130 Ctrl-C (143 SIGTERM: either stops",
              "the whole run), else that of the last failing trial.",
              "See README.md for the artifacts and how to read them."]
    return "\n".join(lines) + "\n"


def _int(name: str, text: str, minimum: int, maximum: int | None = None, why: str = "") -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum or text.strip().startswith("+") or (maximum is not None and value > maximum):
        raise DriverError(f"{name}={text!r}: must be an integer " + (f">= {minimum}" if maximum is None else
                                                                     f"from {minimum} to {maximum}{why}"))
    return value


def _float_ratio(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 1:
        raise DriverError(f"{name}={text!r}: must be a number in [0, 1)")
    return value


def _bool(name: str, text: str) -> bool:
    if text.strip().lower() not in BOOL_TEXT:
        raise DriverError(f"{name}={text!r}: must be true or false (or 1/0)")
    return BOOL_TEXT[text.strip().lower()]


def _dtype(name: str, text: str) -> str:
    if text.strip().lower() not in DTYPE_ALIASES:
        raise DriverError(f"{name}={text!r}: must be one of float32, bfloat16 (aliases fp32, bf16)")
    return DTYPE_ALIASES[text.strip().lower()]


def _no_repeats(name: str, text: str, items: list) -> None:
    repeated = sorted({str(t) for t in items if items.count(t) > 1})
    if repeated:
        raise DriverError(f"{name}={text!r}: lists {','.join(repeated)} more than once; each trial runs once")


def _int_list(name: str, text: str) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t.isdigit() for t in items):
        raise DriverError(f"{name}={text!r}: must be a comma-separated list of non-negative integers, e.g. 0,1")
    if any(int(t) >= MAX_STEPS for t in items):
        raise DriverError(f"{name}={text!r}: must list integers below {MAX_STEPS} (10**9)")
    _no_repeats(name, text, [int(t) for t in items])
    return sorted(int(t) for t in items)


def _kinds(name: str, text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    bad = [t for t in items if t not in KINDS]
    if not text.strip() or bad:
        raise DriverError(f"{name}={text!r}: must be a non-empty comma-separated subset of {','.join(KINDS)}"
                          + (f" (unknown: {','.join(bad)})" if text.strip() and bad else ""))
    _no_repeats(name, text, items)
    return [k for k in KINDS if k in items]


def _folder_name(name: str, text: str) -> str:
    if not is_folder_name(text):
        raise DriverError(f"{name}={text!r}: use {NAME_ACCEPTED}")
    return text


def _host(name: str, text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._:\[\]-]+", text):
        raise DriverError(f"{name}={text!r}: must be a host name or IP address (letters, digits, '.', '-', ':', '[]')")
    return text


@dataclass(frozen=True)
class ConfigVar:
    """A driver variable that overrides one config key (only when set)."""

    name: str
    key: str
    parse: Callable[[str, str], object]


CONFIG_VARS = (
    ConfigVar("MODEL_PATH", "actor.path", lambda n, t: t),
    ConfigVar("FILEROOT", "cluster.fileroot", lambda n, t: str(Path(t).expanduser().resolve())),
    ConfigVar("EXPERIMENT_NAME", "experiment_name", _folder_name),
    ConfigVar("PROFILE_FAKE_SEQ_LEN", "profile.fake_seq_len",
              lambda n, t: _int(n, t, 2, TOKENS_PER_RANK_MAX, FAKE_SEQ_LEN_WHY)),
    ConfigVar("PROFILE_FAKE_DATASET_SIZE", "profile.fake_dataset_size", lambda n, t: _int(n, t, 1)),
    ConfigVar("PROFILE_FAKE_LOSS_START_RATIO", "profile.fake_loss_start_ratio", _float_ratio),
    ConfigVar("TRAIN_BATCH_SIZE", "train_dataset.batch_size", lambda n, t: _int(n, t, 1)),
    ConfigVar("PROFILE_N_MBS", "actor.mb_spec.n_mbs", lambda n, t: _int(n, t, 1)),
    ConfigVar("MEMORY_MAX_ENTRIES", "memory_profiler.max_entries", lambda n, t: _int(n, t, 1)),
    ConfigVar("LOGPROBS_CHUNK_SIZE", "actor.loss.logprobs_chunk_size", lambda n, t: _int(n, t, 0)),
    ConfigVar("LM_HEAD_LOSS_CHUNK_SIZE", "actor.loss.lm_head_loss_chunk_size", lambda n, t: _int(n, t, 0)),
    ConfigVar("USE_PRECISION_AWARE_OPTIMIZER", "actor.megatron.use_precision_aware_optimizer", _bool),
    ConfigVar("MAIN_GRADS_DTYPE", "actor.megatron.main_grads_dtype", _dtype),
    ConfigVar("USE_DETERMINISTIC_ALGORITHMS", "actor.megatron.use_deterministic_algorithms", _bool),
)


def _yaml_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class Trial:
    """One torchrun launch: profile ``kind`` at ``step`` (paths absolute)."""

    name: str
    kind: str
    step: int
    run_dir: Path
    log_dir: Path
    args: list[str]


def seq_tag(n_tokens: int) -> str:
    """``131072`` -> ``"128k"``; lengths that are not a multiple of 1024 stay numeric."""
    return f"{n_tokens // 1024}k" if n_tokens % 1024 == 0 else str(n_tokens)


def visible_gpus() -> int:
    """CUDA devices torch sees on this node (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
        return sock.getsockname()[1]


def _reject_driver_variables_as_arguments(extra_overrides: list[str]) -> None:
    """Raise DriverError for an argument written like a driver variable (``NAME=value``, upper case, or a driver
    variable's name in lower case that is no top-level config key: ``profile_steps=1``, not ``experiment_name=x``)."""
    overrides = "arguments after the script are config overrides, dotted lower-case keys such as actor.num_layers=4"
    config_keys = {f.name for f in fields(SFTProfileConfig)}
    for arg in extra_overrides:
        lower = re.fullmatch(r"([a-z][a-z0-9_]*)=(.*)", arg, flags=re.S)
        if lower and lower.group(1).upper() in {v.name for v in DRIVER_VARS} and lower.group(1) not in config_keys:
            name = lower.group(1).upper()
            raise DriverError(f"argument {arg!r} is not a config key but the driver variable {name} in lower case: "
                              "driver variables are upper case and go in the environment, before `bash` ("
                              f"{shlex.quote(f'{name}={lower.group(2)}')} bash {DRIVER_SCRIPT}); {overrides}")
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(.*)", arg, flags=re.S)
        if m is None:
            continue
        name, value = m.groups()
        if name in {v.name for v in DRIVER_VARS}:
            raise DriverError(f"argument {arg!r} is a driver variable: put it before `bash` "
                              f"({shlex.quote(arg)} bash {DRIVER_SCRIPT}); {overrides}")
        near = _closest(name, 0.8)
        if near:
            raise DriverError(f"argument {arg!r} is not a config override ({overrides}); did you mean the driver "
                              f"variable {near}, set before `bash` ({shlex.quote(f'{near}={value}')} bash {DRIVER_SCRIPT})?")
        raise DriverError(f"argument {arg!r} is neither a config override ({overrides}) nor a driver variable "
                          f"(`bash {DRIVER_SCRIPT} --help` lists them)")


NOT_RUN = "not run"  # summary.tsv status of a planned trial the driver did not run (STOP_ON_FAILURE=1, an interrupt)
INTERRUPTED = "interrupted"  # summary.tsv status of the trial a Ctrl-C / SIGTERM stopped (the driver's trap)
# Artifact names the driver script uses and the summary.tsv status it writes for an interrupted trial, handed to it
# with the plan (shell variables of the same names, upper case).
DRIVER_ARTIFACTS = {"trials_tsv": artifacts.TRIALS_TSV, "summary_tsv": artifacts.SUMMARY_TSV,
                    "launcher_log": artifacts.LAUNCHER_LOG, "nvidia_smi_csv": artifacts.NVIDIA_SMI_CSV,
                    "trainer_log": artifacts.TRAINER_LOG, "interrupted_status": INTERRUPTED}


@dataclass
class PlanLog:
    """What planning tells the user: ``settings`` (lines of ``profile_settings.log``) and ``notices``
    (lines printed to stderr: warnings, skipped trials, a picked port)."""

    settings: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    # variable -> the arguments that set one of its config keys to the value it gives (see agree)
    agreeing: dict[str, list[str]] = field(default_factory=dict)
    _noted: dict[str, tuple[object, str]] = field(default_factory=dict)

    def note(self, name: str, value: object, source: str) -> None:
        """Record a driver variable's effective value and where it came from; a later note of the same
        variable (a value this node changed, e.g. the kinds without CUDA) replaces the earlier line in place.
        The arguments that agree with it (:meth:`agree`) are named after the source."""
        self._noted[name] = (value, source)
        args = self.agreeing.get(name, [])
        line = f"{name}={value}\t# {source}" + (
            f" (the argument{'s' if len(args) > 1 else ''} {' and '.join(args)} agree{'' if len(args) > 1 else 's'})"
            if args else "")
        same = [i for i, s in enumerate(self.settings) if s.startswith(f"{name}=")]
        if same:
            self.settings[same[0]] = line
        else:
            self.settings.append(line)

    def agree(self, name: str, arguments: list[str]) -> None:
        """Record that ``arguments`` set a config key of variable ``name`` to the value the driver gives it (taken,
        and named on the variable's line, now or when it is noted)."""
        for arg in arguments:
            if arg not in self.agreeing.setdefault(name, []):
                self.agreeing[name].append(arg)
        if name in self._noted:
            self.note(name, *self._noted[name])


@dataclass
class DriverEnv:
    """The driver variables, parsed and range-checked (step 1 of :func:`plan`); None = unset."""

    get: Callable[..., str | None]
    config: str
    steps: list[int]
    kinds: list[str]
    total_steps: int | None
    stop: bool
    overrides: list[str]
    extra_overrides: list[str]
    set_keys: set[str]
    n_nodes: int | None
    node_rank: int
    master_addr: str
    master_port: int | None
    node_timeout: int
    nproc: int | None


@dataclass
class Probe:
    """The config the driver variables produce and the torchrun layout it needs (step 2 of :func:`plan`)."""

    cfg: SFTProfileConfig
    layout: Layout
    n_nodes: int
    nproc: int
    gpus: int
    kinds: list[str]
    ranks_specs: dict[str, str]  # kind -> the rank spec its trials get (perf_tracer.ranks, memory_profiler.ranks)


def read_driver_env(env: Mapping[str, str], extra_overrides: list[str], log: PlanLog) -> DriverEnv:
    """Step 1: parse every driver variable (no config is read yet).

    Raises:
        DriverError: a variable or argument is invalid (see :func:`plan`).
    """
    get = env.get
    log.notices += [f"warning: {w}" for w in unknown_variable_warnings(env)]
    _reject_driver_variables_as_arguments(extra_overrides)
    try:
        reject_repeated_keys(extra_overrides)
    except ConfigError as err:
        raise DriverError(str(err)) from None
    config = get("CONFIG") or str(REPO_ROOT / DEFAULT_CONFIG)
    log.note("CONFIG", config, "env" if get("CONFIG") else "default")
    steps = _int_list("PROFILE_STEPS", get("PROFILE_STEPS") if get("PROFILE_STEPS") is not None else "0,1")
    kinds = _kinds("PROFILE_KINDS", get("PROFILE_KINDS") if get("PROFILE_KINDS") is not None else "kernel,memory")
    total_steps = _int("TOTAL_STEPS", get("TOTAL_STEPS"), 1) if get("TOTAL_STEPS") else None
    if total_steps is not None and total_steps > MAX_STEPS:
        raise DriverError(f"TOTAL_STEPS={total_steps}: must be an integer from 1 to {MAX_STEPS} (10**9)")
    if total_steps is not None and total_steps <= max(steps):
        raise DriverError(f"TOTAL_STEPS={total_steps}: must be > the largest profile step {max(steps)} "
                          "(or unset: profile step + 1)")
    stop = _bool("STOP_ON_FAILURE", get("STOP_ON_FAILURE") if get("STOP_ON_FAILURE") is not None else "1")
    log.note("PROFILE_STEPS", ",".join(map(str, steps)), "env" if get("PROFILE_STEPS") is not None else "default")
    log.note("PROFILE_KINDS", ",".join(kinds), "env" if get("PROFILE_KINDS") is not None else "default")
    log.note("TOTAL_STEPS", total_steps if total_steps else "profile_step+1", "env" if total_steps else "default")
    log.note("STOP_ON_FAILURE", int(stop), "env" if get("STOP_ON_FAILURE") is not None else "default")

    overrides: list[str] = []
    set_keys: set[str] = set()
    for var in CONFIG_VARS:
        text = get(var.name)
        if not text:  # unset or empty: the config's value stands
            continue
        value = var.parse(var.name, text)
        # Text values go in as JSON strings, so YAML never reads "0123", "yes" or "a #b" as something else.
        overrides.append(f"{var.key}={json.dumps(value) if isinstance(value, str) else _yaml_value(value)}")
        set_keys.add(var.name)
        _arguments_agree(var.name, _arguments_setting(var.key, extra_overrides),
                         lambda arg: _argument_value(var, arg) == value,
                         lambda arg: _variable_conflict(f"{var.name}={text}", var.key, arg), log)
    master_port = _int("MASTER_PORT", get("MASTER_PORT"), 1) if get("MASTER_PORT") else None
    if master_port is not None and master_port > 65535:
        raise DriverError(f"MASTER_PORT={master_port}: must be in [1, 65535]")
    if "USE_PRECISION_AWARE_OPTIMIZER" in set_keys and not _bool("", get("USE_PRECISION_AWARE_OPTIMIZER")) \
            and "MAIN_GRADS_DTYPE" not in set_keys:
        # USE_PRECISION_AWARE_OPTIMIZER=false alone: the optimizer dtypes follow it back to float32.
        overrides += [f"actor.megatron.{f}=float32" for f in PRECISION_FIELDS]
        log.settings.append("# USE_PRECISION_AWARE_OPTIMIZER=false: main grads, main params and Adam moments set to float32")
    return DriverEnv(
        get=get, config=config, steps=steps, kinds=kinds, total_steps=total_steps, stop=stop, overrides=overrides,
        extra_overrides=list(extra_overrides), set_keys=set_keys,
        n_nodes=_int("N_NODES", get("N_NODES"), 1) if get("N_NODES") else None,
        node_rank=_int("NODE_RANK", get("NODE_RANK") or "0", 0),
        master_addr=_host("MASTER_ADDR", get("MASTER_ADDR") or "127.0.0.1"), master_port=master_port,
        node_timeout=_int("NODE_TIMEOUT", get("NODE_TIMEOUT"), 1, NODE_TIMEOUT_MAX_S, " (2**31 - 1 seconds: torchrun's "
                          "rendezvous timeout is a C int)") if get("NODE_TIMEOUT") else DEFAULT_NODE_TIMEOUT_S,
        nproc=_int("N_GPUS_PER_NODE", get("N_GPUS_PER_NODE"), 1) if get("N_GPUS_PER_NODE") else None)


def _arguments_agree(name: str, arguments: list[str], agrees: Callable[[str], bool], conflict: Callable[[str], str],
                     log: PlanLog) -> None:
    """The check of every argument that sets a config key the driver sets itself (a config-mapped variable's key, the
    profiled ranks, a trial's own settings): DriverError(``conflict(arg)``) for the first argument that gives the key
    another value than the driver (``agrees(arg)`` false); else the arguments are taken and ``profile_settings.log``
    names them on variable ``name``'s line as agreeing (:meth:`PlanLog.agree`)."""
    for arg in arguments:
        if not agrees(arg):
            raise DriverError(conflict(arg))
    log.agree(name, arguments)


def _variable_conflict(variable: str, keys: str, arg: str) -> str:
    """The message of a driver variable (``NAME=value``) and an argument that set its config key(s) differently."""
    return (f"{variable} (a driver variable, sets {keys}) and the argument {arg}: one config key set to different "
            "values; set it once, as the variable or as the argument")


def _arguments_setting(key: str, extra_overrides: list[str]) -> list[str]:
    """The ``key=value`` arguments that set config ``key``, under its name or an old name of it
    (:data:`sftprof.config.LEGACY_LOSS_KEYS`)."""
    names = {key} | {old for old, new in LEGACY_LOSS_KEYS.items() if key == f"actor.loss.{new}"}
    return [arg for arg in extra_overrides if arg.partition("=")[0].strip() in names]


def _argument_value(var: ConfigVar, arg: str) -> object:
    """The value argument ``arg`` gives ``var``'s key, read as OmegaConf reads it and then as the driver reads
    ``var`` (so ``cluster.fileroot=rel`` compares as the resolved path); None when the driver would refuse it."""
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={arg.partition('=')[2]}"]), resolve=False)["v"]
        return var.parse(var.name, _yaml_value(value))
    except (DriverError, OmegaConfBaseException):
        return None


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
    try:
        hf_config = load_hf_config(probe.actor.path, probe.actor.num_layers)
        check_weights_present(probe.actor)
    except (ModelPathError, ValueError) as err:
        raise DriverError(f"{err} (MODEL_PATH / actor.path)") from err
    if parse_allocation_mode(probe.actor.backend).backend == "megatron":
        from sftprof.models.megatron_config import check_model_settings
        try:
            check_model_settings(probe, hf_config, parse_allocation_mode(probe.actor.backend))
        except ConfigError as err:
            raise DriverError(f"{err} {_sources(d, model=True)}") from err
    from sftprof.tokenizer import hf_tokenizer_dir, load_tokenizer
    try:  # a damaged Hugging Face tokenizer stops the plan, not every trial (the bundled one is the package's)
        if hf_tokenizer_dir(probe.tokenizer_path, probe.actor.path) is not None:
            load_tokenizer(probe.tokenizer_path, probe.actor.path, hf_config.model_type)
    except ValueError as err:
        raise DriverError(f"{err} (tokenizer_path / MODEL_PATH)") from err
    return probe


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
    n_nodes = d.n_nodes or probe.cluster.n_nodes
    if d.node_rank >= n_nodes:
        raise DriverError(f"NODE_RANK={d.node_rank}: must be in [0, N_NODES={n_nodes})")
    nproc = d.nproc if d.nproc is not None else layout.world_size // n_nodes
    if nproc * n_nodes != layout.world_size:
        raise DriverError(
            f"N_GPUS_PER_NODE={nproc} x N_NODES={n_nodes} = {nproc * n_nodes} processes, but actor.backend="
            f"{probe.actor.backend!r} needs world size {layout.world_size}")
    d.overrides += [f"cluster.n_nodes={n_nodes}", f"cluster.n_gpus_per_node={nproc}"]
    gpus = visible_gpus() if gpus is None else gpus
    if layout.backend == "megatron" and gpus == 0:
        raise DriverError(f"actor.backend={probe.actor.backend!r}: the megatron backend needs CUDA GPUs and this node has "
                          f"none (CONFIG={config}); on a machine without CUDA use CONFIG=tiny_cpu (fsdp on CPU, gloo)")
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
    for var in CONFIG_VARS:
        node = probe
        for part in var.key.split("."):
            node = getattr(node, part)
        arguments = _arguments_setting(var.key, d.extra_overrides)
        if var.name in d.set_keys:
            source = f"env -> {var.key}"   # with the arguments that agree (PlanLog.agree)
        else:
            source = f"argument {arguments[-1]}" if arguments else f"config {var.key}"
        log.note(var.name, _yaml_value(node), source)
    # the package's own folder name: __name__ is "__main__" under `python -m sftprof.launch`
    fileroot, package = Path(probe.cluster.fileroot), Path(__file__).resolve().parent.name
    check_writable_folder("FILEROOT", fileroot)
    if fileroot.name == package:  # e.g. /tmp/sftprof, the default before DEFAULT_FILEROOT: used as given
        log.notices.append(f"warning: FILEROOT {fileroot} is a folder named {package}: a Python started in "
                           f"{fileroot.parent} imports it (an empty namespace package) instead of the {package} "
                           f"package; name it otherwise, e.g. FILEROOT={DEFAULT_FILEROOT}")
    log.note("N_GPUS_PER_NODE", nproc, "env" if get("N_GPUS_PER_NODE") else f"world size {layout.world_size} / N_NODES")
    log.note("N_NODES", n_nodes, "env" if get("N_NODES") else "config cluster.n_nodes")
    if d.extra_overrides:
        log.settings.append(f"# extra overrides: {' '.join(d.extra_overrides)}")
    log.settings.append(f"# layout {probe.actor.backend}: {layout.describe()}")
    return Probe(cfg=probe, layout=layout, n_nodes=n_nodes, nproc=nproc, gpus=gpus, kinds=kinds, ranks_specs=ranks_specs)


RANK_KEYS = {"kernel": "perf_tracer.ranks", "memory": "memory_profiler.ranks"}  # the profiled ranks of each kind


def _profiled_ranks(d: DriverEnv, probe: SFTProfileConfig, layout: Layout, kinds: list[str],
                    log: PlanLog) -> dict[str, str]:
    """The rank spec of each kind's trials (kind -> spec, for :data:`RANK_KEYS`), noted in ``profile_settings.log``.

    ``PROFILE_RANKS`` (default ``pp_rank0``) sets both keys; an argument ``perf_tracer.ranks=...`` or
    ``memory_profiler.ranks=...`` sets its kind's ranks when ``PROFILE_RANKS`` is unset, and must give the same ranks
    as ``PROFILE_RANKS`` when it is set (then it is noted as agreeing). The line names the ranks of the planned kinds
    and where each came from (per kind when they differ).

    Raises:
        DriverError: a spec is invalid for the layout, or ``PROFILE_RANKS`` and an argument give different ranks.
    """
    ranks_env = d.get("PROFILE_RANKS")
    env_ranks = None
    if ranks_env is not None:
        try:
            env_ranks = resolve_ranks(ranks_env.strip(), layout)
        except RankSpecError as err:
            raise DriverError(f"PROFILE_RANKS={ranks_env!r}: {err} (actor.backend={probe.actor.backend})") from err
    specs, shown, sources = {}, {}, {}
    for kind, key in RANK_KEYS.items():
        arguments = _arguments_setting(key, d.extra_overrides)
        spec, ranks, source = "pp_rank0", layout.pp_stage_first_ranks(), "default pp_rank0"
        if arguments:  # the probe config holds the arguments' value of the key, as the trainer reads it
            spec = (probe.perf_tracer if kind == "kernel" else probe.memory_profiler).ranks.strip()
            try:
                ranks = resolve_ranks(spec, layout)
            except RankSpecError as err:
                raise DriverError(f"argument {arguments[-1]}: {err} (actor.backend={probe.actor.backend})") from err
            source = f"argument {arguments[-1]}"
        if env_ranks is not None:
            _arguments_agree("PROFILE_RANKS", arguments, lambda arg: ranks == env_ranks,
                             lambda arg: _variable_conflict(f"PROFILE_RANKS={ranks_env}", " and ".join(RANK_KEYS.values()),
                                                            arg), log)
            spec, ranks, source = ranks_env.strip(), env_ranks, "env"
        specs[kind], shown[kind], sources[kind] = spec, format_ranks(ranks) if spec else "all", source
    planned = [k for k in RANK_KEYS if k in kinds]
    same = len({shown[k] for k in planned}) == 1
    log.note("PROFILE_RANKS", shown[planned[0]] if same else ", ".join(f"{k} {shown[k]}" for k in planned),
             sources[planned[0]] if len({sources[k] for k in planned}) == 1
             else "; ".join(f"{k} trials: {sources[k]}" for k in planned))
    return specs


PLAN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class PlanInterrupted(BaseException):
    """SIGINT or SIGTERM arrived while ``python -m sftprof.launch plan`` ran (``signum``: the signal's number).
    A BaseException, as KeyboardInterrupt, so that no ``except Exception`` of the plan takes it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_held():
    """Hold SIGINT and SIGTERM (:data:`PLAN_SIGNALS`) for the ``with`` block: one that arrives inside is delivered
    when the block ends, so the block runs whole (what it creates is all made and recorded, or not begun)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PLAN_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _on_plan_signal(signum: int, frame) -> None:
    for sig in PLAN_SIGNALS:  # once: removing what the plan wrote is not interrupted by a second signal
        signal.signal(sig, signal.SIG_IGN)
    raise PlanInterrupted(signum)


def remove_plan(run_root: Path | None, created: list[Path]) -> str:
    """Remove what :func:`write_plan` created (``created``, in the order made) after the plan was interrupted, and
    say in words what happened: ``nothing was written``; ``RUN_ROOT <path>, which the plan had created, was removed``
    (with the folders above it that it made); ``what the plan had written in RUN_ROOT <path> was removed (the folder
    was there before, empty: kept)``; or, when a removal fails, the error and each path left. Only paths in
    ``created`` are touched: a RUN_ROOT the plan made holds only what it wrote there (it refuses a non-empty one), and
    a folder above it is removed only when empty."""
    if not created:
        return "nothing was written"
    try:
        for path in reversed(created):
            if path.is_dir() and not path.is_symlink():
                if path == run_root or run_root in path.parents:
                    shutil.rmtree(path)
                else:
                    path.rmdir()  # a folder above RUN_ROOT the plan made: removed only when empty
            else:
                path.unlink()
    except OSError as err:
        left = [str(p) for p in created if os.path.lexists(p)]
        return (f"removing what the plan had written failed ({err.strerror}: {err.filename}); left: " + ", ".join(left)
                + " (remove them before using this RUN_ROOT again)")
    if run_root in created:
        above = [str(p) for p in created if p != run_root]
        return (f"RUN_ROOT {run_root}, which the plan had created, was removed"
                + (f", and the folder(s) it had made above it ({', '.join(above)})" if above else ""))
    return f"what the plan had written in RUN_ROOT {run_root} was removed (the folder was there before, empty: kept)"


def check_writable_folder(name: str, path: Path) -> None:
    """Raises DriverError naming ``name`` unless folders can be made under ``path``: its nearest existing ancestor
    (``path`` itself when it exists) is a folder in which a probe folder can be created; the probe is removed
    at once, so nothing is left behind (``path`` itself is not created here); its folder names and length must fit
    (:func:`_check_path_fits`)."""
    _check_path_fits(name, path)
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    try:
        if not base.is_dir():
            raise NotADirectoryError(f"{base} is not a folder")
        with signals_held():  # a signal between the two is handled after the rmdir: no probe is left behind
            os.rmdir(tempfile.mkdtemp(prefix=".sftprof_probe_", dir=base))
    except OSError as err:
        raise DriverError(f"{name}={path}: cannot create folders there ({err}); accepted: a folder path that this "
                          "user can write (it is created if missing)") from err


NAME_MAX = 255   # bytes in one folder name (Linux filesystems)
PATH_MAX = 4095  # bytes in a path (Linux: 4096 with the terminating NUL)
USER_VARIABLES = ("LOGNAME", "USER", "LNAME", "USERNAME")  # getpass.getuser()'s sources, in its order


def model_tag(model_path: str) -> str:
    """The ``<model>`` part of trial names: the folder name of ``model_path`` (``actor.path``) in lower case, each
    run of characters other than ASCII letters and digits replaced by one ``_`` (``Qwen3-30B-A3B`` ->
    ``qwen3_30b_a3b``, ``go od*`` -> ``go_od``), no ``_`` at either end; ``model`` when nothing is left."""
    return re.sub(r"[^a-z0-9]+", "_", Path(model_path.rstrip("/")).name.lower()).strip("_") or "model"


def trial_name(tag: str, fake_seq_len: int, kind: str, step: int, stamp: str) -> str:
    """A trial's name (its run dir and log dir): ``<model>_fake<len>_<kind>_step<N>_<stamp>``."""
    return f"{tag}_fake{seq_tag(fake_seq_len)}_{kind}_step{step}_{stamp}"


def _nbytes(text: str) -> int:
    return len(os.fsencode(text))


def _check_path_fits(name: str, path: Path, what: str | None = None) -> None:
    """Raise DriverError naming variable ``name`` (or ``what`` the path is, when given) when a folder name in
    ``path`` is over :data:`NAME_MAX` bytes or the whole path over :data:`PATH_MAX` bytes (the filesystem would
    refuse it with ENAMETOOLONG)."""
    long = [part for part in path.parts if _nbytes(part) > NAME_MAX]
    shown = str(path) if len(str(path)) <= 120 else f"{str(path)[:100]}..."
    shown = f"{name}={shown}" if what is None else f"{what} {shown}"
    if long:
        raise DriverError(f"{shown}: its folder name {long[0][:40]}... is {_nbytes(long[0])} bytes long; "
                          f"accepted: folder names of at most {NAME_MAX} bytes")
    if _nbytes(str(path)) > PATH_MAX:
        raise DriverError(f"{shown}: is {_nbytes(str(path))} bytes long; accepted: a path of at most {PATH_MAX} bytes "
                          + ("" if what is None else f"(shorten {name})"))


def log_user() -> str:
    """The ``<user>`` folder of trial log dirs (``FILEROOT/logs/<user>/``, :func:`sftprof.config.trial_log_dir`):
    ``getpass.getuser()``, which is ``LOGNAME``, else ``USER``, ``LNAME``, ``USERNAME``, else the password database.

    Raises:
        DriverError: it is not one folder name that stays inside ``FILEROOT/logs`` (empty, ``.``, ``..``, holds a
            ``/``) or is over :data:`NAME_MAX` bytes; the message names the variable it came from.
    """
    user = getpass.getuser()
    source = next((v for v in USER_VARIABLES if os.environ.get(v)), "the password database")
    if user in ("", ".", "..") or "/" in user or _nbytes(user) > NAME_MAX:
        raise DriverError(f"user name {user[:60]!r} (from {source}): it names the folder FILEROOT/logs/<user> of the "
                          f"trainer logs and is not one folder name there; accepted: a name without '/', other than "
                          f"'.' and '..', of at most {NAME_MAX} bytes" +
                          (f" (set {source} to your user name)" if source in USER_VARIABLES else ""))
    return user


def _check_folder_names(d: DriverEnv, p: Probe, stamp: str, node_tag: str) -> None:
    """Raise DriverError, naming the variable and the limit, when a folder the driver or the trainer would make is
    named over :data:`NAME_MAX` bytes: ``<experiment>`` (the log dirs' parent), the trial names (from
    ``PROFILE_STAMP``, else the model folder name) and RUN_ROOT's default ``<experiment>_<stamp>[_node<k>]``; or the
    user name is unusable (:func:`log_user`)."""
    log_user()
    exp = p.cfg.experiment_name
    exp_name = "EXPERIMENT_NAME" if d.get("EXPERIMENT_NAME") else "experiment_name"
    if _nbytes(exp) > NAME_MAX:
        raise DriverError(f"{exp_name} is {_nbytes(exp)} bytes long: it names the folder "
                          f"FILEROOT/logs/<user>/<experiment> and a folder name can have at most {NAME_MAX} bytes; "
                          f"use at most {NAME_MAX} bytes")
    tag = model_tag(p.cfg.actor.path)
    longest = max((trial_name(tag, p.cfg.profile.fake_seq_len, kind, step, stamp) for step in d.steps
                   for kind in p.kinds), key=_nbytes)
    if _nbytes(longest) > NAME_MAX:
        rest = _nbytes(longest) - _nbytes(stamp)
        if d.get("PROFILE_STAMP") and rest < NAME_MAX:
            raise DriverError(f"PROFILE_STAMP is {_nbytes(stamp)} bytes long: it ends the trial folder names "
                              f"({longest[:-len(stamp)]}<stamp> here) and a folder name can have at most {NAME_MAX} "
                              f"bytes; use at most {NAME_MAX - rest} bytes")
        rest = _nbytes(longest) - _nbytes(tag)
        raise DriverError(f"the model folder name of MODEL_PATH / actor.path ({tag[:40]}... after cleaning) is "
                          f"{_nbytes(tag)} bytes long: it starts the trial folder names (<model>_fake<len>_<kind>_step"
                          f"<N>_<stamp>) and a folder name can have at most {NAME_MAX} bytes; use a model folder name "
                          f"of at most {NAME_MAX - rest} bytes")
    default_run_root = f"{exp}_{stamp}{node_tag}"
    if not d.get("RUN_ROOT") and _nbytes(default_run_root) > NAME_MAX:
        raise DriverError(f"RUN_ROOT's default folder name <experiment>_<stamp>{node_tag} would be "
                          f"{_nbytes(default_run_root)} bytes long, and a folder name can have at most {NAME_MAX} "
                          f"bytes: shorten {exp_name} ({_nbytes(exp)} bytes) or PROFILE_STAMP ({_nbytes(stamp)} "
                          "bytes), or set RUN_ROOT")


def _run_root(d: DriverEnv, p: Probe, log: PlanLog) -> tuple[Path, str]:
    """``(RUN_ROOT, PROFILE_STAMP)``; RUN_ROOT must not exist or be empty, and folders must be creatable there
    (:func:`check_writable_folder`); the folder names of the plan must fit (:func:`_check_folder_names`)."""
    get = d.get
    if p.n_nodes > 1 and not get("PROFILE_STAMP"):
        raise DriverError(f"PROFILE_STAMP is unset with N_NODES={p.n_nodes}: set the same PROFILE_STAMP on every node "
                          "(trial names must match), and put FILEROOT on a filesystem all nodes share")
    stamp = get("PROFILE_STAMP") or _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    _folder_name("PROFILE_STAMP", stamp)
    node_tag = f"_node{d.node_rank}" if d.node_rank else ""  # nodes may share the working directory
    _check_folder_names(d, p, stamp, node_tag)
    run_root = Path(get("RUN_ROOT") or (Path.cwd() / "sftprof_runs" / f"{p.cfg.experiment_name}_{stamp}{node_tag}")
                    ).expanduser().resolve()
    _check_path_fits("RUN_ROOT", run_root)
    if run_root.exists() and not run_root.is_dir():
        raise DriverError(f"RUN_ROOT={run_root}: exists and is not a directory; nothing was overwritten. "
                          "Choose another RUN_ROOT or PROFILE_STAMP")
    if run_root.exists() and any(run_root.iterdir()):
        raise DriverError(f"RUN_ROOT={run_root}: exists and is not empty; nothing was overwritten. "
                          "Choose another RUN_ROOT or PROFILE_STAMP")
    check_writable_folder("RUN_ROOT", run_root)
    log.note("RUN_ROOT", run_root, "env" if get("RUN_ROOT") else "default ./sftprof_runs/<experiment>_<stamp>[_node<k>]")
    log.note("PROFILE_STAMP", stamp, "env" if get("PROFILE_STAMP") else "default: now")
    return run_root, stamp


# Config keys the driver sets for each trial (expand_trials) -> the driver variables that decide them (trial_name: none,
# the driver's own). An argument may give one only the value the driver gives it.
TRIAL_KEYS = {"trial_name": (), "total_train_steps": ("TOTAL_STEPS",), "perf_tracer.enabled": ("PROFILE_KINDS",),
              "perf_tracer.profile_steps": ("PROFILE_STEPS", "PROFILE_KINDS"),
              "memory_profiler.profile_steps": ("PROFILE_STEPS", "PROFILE_KINDS")}


def _config_value(cfg: SFTProfileConfig, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_trial_arguments(d: DriverEnv, owned: dict[str, list[str]], settings: dict[str, str],
                           cfg: SFTProfileConfig, trial: str, log: PlanLog) -> None:
    """Refuse (DriverError) an argument that sets a key of :data:`TRIAL_KEYS` to another value than the driver's
    for this trial (``settings``: key -> ``key=value``; ``cfg``: the trial's config), naming the argument and the
    driver variable that sets the key; an argument that agrees is noted on that variable's line
    (:func:`_arguments_agree`). The argument's value is read as the trainer would: the config with it last."""
    try:
        theirs = load_config(d.config, d.overrides + list(settings.values()) + d.extra_overrides)
    except ConfigError:  # an invalid value is not the driver's (which loaded above)
        theirs = None
    for key, arguments in owned.items():
        variables = " and ".join(TRIAL_KEYS[key])
        if variables:
            remedy = (f"set {variables} before `bash` instead" + (
                f" ({shlex.quote('TOTAL_STEPS=' + arguments[-1].partition('=')[2])} bash {DRIVER_SCRIPT})"
                if key == "total_train_steps" else ""))
            conflict = (lambda arg, key=key, variables=variables, remedy=remedy:
                        f"argument {arg}: the driver sets {key} for each trial from {variables} ({settings[key]} for "
                        f"{trial}); {remedy}")
        else:
            conflict = (lambda arg: f"argument {arg}: trial_name is the driver's own: it names each trial "
                        f"<model>_fake<len>_<kind>_step<N>_<stamp> ({settings['trial_name']} for {trial}); leave the "
                        "argument out (EXPERIMENT_NAME and PROFILE_STAMP name the run)")
        same = theirs is not None and _config_value(theirs, key) == _config_value(cfg, key)
        _arguments_agree(TRIAL_KEYS[key][0] if variables else "trial_name", arguments, lambda arg: same, conflict, log)
        if not variables:
            log.note("trial_name", cfg.trial_name, "the driver's own: <model>_fake<len>_<kind>_step<N>_<stamp>")


def expand_trials(d: DriverEnv, p: Probe, log: PlanLog) -> tuple[list[Trial], Path, SFTProfileConfig]:
    """Step 3: one :class:`Trial` per (profile step, kind), step-major, kernel before memory; RUN_ROOT; and
    the first trial's resolved config.

    Each trial's config is loaded (and so validated) with its own overrides: trial name, total steps and
    the profile settings of its kind and step.

    Raises:
        DriverError: see :func:`plan`.
    """
    run_root, stamp = _run_root(d, p, log)
    tag = model_tag(p.cfg.actor.path)
    owned = {key: args for key in TRIAL_KEYS if (args := _arguments_setting(key, d.extra_overrides))}
    trials, first_cfg = [], None
    for step in d.steps:
        for kind in p.kinds:
            name = trial_name(tag, p.cfg.profile.fake_seq_len, kind, step, stamp)
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
                _check_trial_arguments(d, owned, settings, cfg, f"the {kind} trial of step {step}", log)
            first_cfg = first_cfg or cfg
            log_dir = trial_log_dir(cfg)
            _check_path_fits("FILEROOT, EXPERIMENT_NAME or PROFILE_STAMP", log_dir,
                             "the trial log dir FILEROOT/logs/<user>/<experiment>/<trial>")
            # Node 0 checks: other nodes may plan after node 0's first trial has started writing there.
            if d.node_rank == 0 and log_dir.exists() and any(q.name != artifacts.NODES for q in log_dir.iterdir()):
                raise DriverError(f"trial log dir {log_dir} exists and is not empty (same EXPERIMENT_NAME and "
                                  "PROFILE_STAMP as an earlier run); choose another PROFILE_STAMP")
            # the trainer refuses a key given twice with different values: hand it the values that won here
            trials.append(Trial(name, kind, step, run_root / name, log_dir,
                                ["--config", str(Path(d.config).resolve()) if Path(d.config).is_file() else d.config,
                                 *last_value_per_key(trial_overrides)]))
    return trials, run_root, first_cfg


def _torchrun_settings(d: DriverEnv, p: Probe, log: PlanLog) -> dict:
    """torchrun's ``nproc_per_node, nnodes, node_rank, master_addr, master_port`` (a free port on one node)."""
    master_port = d.master_port
    if master_port is None and p.n_nodes == 1:
        master_port = free_port()
        log.note("MASTER_PORT", master_port, "default: a free port of this node")
    elif master_port is None:
        master_port = 29500  # every node must agree on it: no per-node pick
        log.note("MASTER_PORT", master_port, "default with N_NODES > 1")
    else:
        log.note("MASTER_PORT", master_port, "env")
    if d.node_rank == 0 and port_in_use(master_port):
        raise DriverError(f"MASTER_PORT={master_port}: already in use on this node (torchrun's rendezvous would fail "
                          "with EADDRINUSE); choose a free port" + (" or leave MASTER_PORT unset to pick one"
                                                                    if p.n_nodes == 1 else " on node 0"))
    log.note("NODE_TIMEOUT", d.node_timeout, "env" if d.get("NODE_TIMEOUT") else "default")
    torchrun = {"nproc_per_node": p.nproc, "nnodes": p.n_nodes, "node_rank": d.node_rank,
                "master_addr": d.master_addr, "master_port": master_port}
    log.settings.append("# torchrun " + " ".join(f"--{k}={v}" for k, v in torchrun.items()))
    return torchrun


def plan(env: Mapping[str, str], extra_overrides: list[str], gpus: int | None = None,
         ) -> tuple[list[Trial], list[str], dict]:
    """Validate the driver environment and return ``(trials, settings_lines, info)``.

    Three steps: :func:`read_driver_env` (parse the variables), :func:`probe_config` (the config they
    produce, checked against this node) and :func:`expand_trials` (one trial per step and kind), then the
    torchrun settings.

    Args:
        env: the driver's environment variables.
        extra_overrides: the driver's arguments (config overrides for every trial).
        gpus: CUDA devices on this node (None: ask torch, :func:`visible_gpus`).

    ``info`` holds ``stop_on_failure, run_root, trials, node_timeout`` and the torchrun settings
    ``nproc_per_node, nnodes, node_rank, master_addr, master_port``, the artifact names the driver script
    writes or reads (:data:`DRIVER_ARTIFACTS`), all of which the driver reads as shell variables, and
    ``notices``: lines for the user (skipped trials, a picked port, suspect variables).

    Raises:
        DriverError: a variable or argument is invalid, the config they produce is invalid, the
            torchrun world size does not match the allocation mode, this node lacks the GPUs the
            layout needs, MASTER_PORT is busy on node 0, a driver variable and an argument set one config key to
            different values, or RUN_ROOT exists and is not empty or cannot be created.
    """
    log = PlanLog()
    d = read_driver_env(env, extra_overrides, log)
    p = probe_config(d, gpus, log)
    trials, run_root, first_cfg = expand_trials(d, p, log)
    torchrun = _torchrun_settings(d, p, log)
    log.settings.append("# resolved config of the first trial:")
    log.settings += ["#   " + line for line in to_yaml(first_cfg).splitlines()]
    device = f"{p.gpus} GPU(s) on this node" if p.gpus else "CPU (no CUDA)"
    log.notices.append(f"plan: {len(trials)} trial(s) on {p.layout.world_size} rank(s) ({p.n_nodes} node(s) x "
                       f"{p.nproc}, {p.cfg.actor.backend}, {device}): "
                       + ", ".join(f"{t.kind} step {t.step}" for t in trials))
    return trials, log.settings, {"stop_on_failure": int(d.stop), "run_root": str(run_root), "trials": len(trials),
                                  "node_timeout": d.node_timeout, **torchrun, **DRIVER_ARTIFACTS, "notices": log.notices}


def write_plan(trials: list[Trial], settings: list[str], info: dict, created: list[Path] | None = None) -> None:
    """Create RUN_ROOT with ``profile_settings.log``, ``trials.tsv`` and per-trial argument files.

    SIGINT and SIGTERM are held while it runs (:func:`signals_held`): it writes the whole plan, and ``created``
    (when given) lists what it made, in order: each missing folder above and including RUN_ROOT, and when RUN_ROOT
    was there before (empty), each file and trial folder made in it; :func:`remove_plan` removes them.
    """
    created = [] if created is None else created
    run_root = Path(info["run_root"])
    with signals_held():
        missing = []
        folder = run_root
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:  # made by someone else meanwhile: not the plan's
                continue
            created.append(folder)
        own_root = run_root in created

        def made(path: Path) -> Path:
            if not own_root:
                created.append(path)
            return path

        made(run_root / artifacts.PROFILE_SETTINGS).write_text("\n".join(settings) + "\n")
        rows = []
        for t in trials:
            t.run_dir.mkdir(parents=True, exist_ok=False)
            made(t.run_dir)
            args_file = t.run_dir / artifacts.TRAIN_ARGS
            args_file.write_text("\n".join(t.args) + "\n")
            rows.append("\t".join([t.name, t.kind, str(t.step), str(t.run_dir), str(t.log_dir), str(args_file)]))
        made(run_root / artifacts.TRIALS_TSV).write_text("\n".join(rows) + "\n")


def record_trials_not_run(run_root: Path) -> list[str]:
    """Append to ``RUN_ROOT/summary.tsv`` a row of status ``not run`` for each trial of ``trials.tsv`` that has no
    row there (those after a failure with ``STOP_ON_FAILURE=1``), so summary.tsv has one row per planned trial.

    The row keeps the trial's name, kind, step, run dir and log dir; its other statuses and ``elapsed_s`` are ``-``.
    Returns the names of the trials added (in plan order; none when every trial ran).

    Raises:
        OSError: ``trials.tsv`` or ``summary.tsv`` cannot be read or written (the ``not-run`` subcommand prints it
            in one line and exits 2).
    """
    run_root = Path(run_root)
    with open(run_root / artifacts.SUMMARY_TSV, encoding="utf-8") as f:
        done = {row["trial"] for row in csv.DictReader(f, delimiter="\t")}
    added, rows = [], []
    for line in (run_root / artifacts.TRIALS_TSV).read_text(encoding="utf-8").splitlines():
        name, kind, step, run_dir, log_dir, _ = line.split("\t")
        if name not in done:
            added.append(name)
            rows.append("\t".join([name, kind, step, NOT_RUN, "-", "-", "-", run_dir, log_dir]) + "\n")
    if rows:
        with open(run_root / artifacts.SUMMARY_TSV, "a", encoding="utf-8") as f:
            f.writelines(rows)
    return added


def trial_status(log_dir: Path) -> int:
    """0 if ``log_dir/stats.jsonl`` ends with ``{"type": "complete", "status": "ok"}``, else 1."""
    try:
        completion = read_stats(Path(log_dir) / artifacts.STATS).completion
    except OSError:  # no stats.jsonl: the trainer never started
        return 1
    return 0 if completion is not None and completion.status == "ok" else 1


def write_node_record(log_dir: Path, node_rank: int, torchrun_rc: int, elapsed_s: int, n_nodes: int,
                      nproc_per_node: int) -> Path:
    """Write ``LOG_DIR/nodes/node<k>.json``: ``{"node_rank", "host", "torchrun_rc", "elapsed_s" (seconds), "n_nodes",
    "nproc_per_node"}`` (read back by :func:`sftprof.artifacts.read_node_record`; the layout lets postprocessing name
    the ranks of a node that wrote no record)."""
    path = artifacts.node_record_path(log_dir, node_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"node_rank": node_rank, "host": socket.gethostname(), "torchrun_rc": torchrun_rc,
                               "elapsed_s": elapsed_s, "n_nodes": n_nodes, "nproc_per_node": nproc_per_node}) + "\n")
    tmp.replace(path)  # readers never see half a record
    return path


def wait_for_nodes(log_dir: Path, n_nodes: int, timeout_s: float, poll_s: float = 1.0) -> list[str]:
    """Wait up to ``timeout_s`` seconds for the end records of nodes 1..n_nodes-1; one line per node that failed.

    A node is reported by its rank (and host, when its record names it): a non-zero torchrun exit
    status, or no record within the timeout (it never started, or died before writing it). An
    unreadable record is reported as such. Returns an empty list when every node ended with 0.
    """
    deadline = time.monotonic() + timeout_s
    pending = set(range(1, n_nodes))
    problems: dict[int, str] = {}
    while True:
        for k in sorted(pending):
            path = artifacts.node_record_path(log_dir, k)
            if not path.is_file():
                continue
            pending.discard(k)
            try:
                rec = artifacts.read_node_record(path)
            except (OSError, ValueError) as err:
                problems[k] = f"node {k}: unreadable end record {path}: {err}"
                continue
            if rec["torchrun_rc"] != 0:
                problems[k] = (f"node {k} ({rec['host'] or '?'}): torchrun exited with status {rec['torchrun_rc']} "
                               "(see its launcher.log)")
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    for k in sorted(pending):
        problems[k] = (f"node {k}: no end record after {timeout_s:g} s (NODE_TIMEOUT): it never started this trial "
                       f"or died before finishing it ({Path(log_dir) / artifacts.NODES} holds the records that came)")
    return [problems[k] for k in sorted(problems)]


def _gib(value, device: str | None) -> str:
    if isinstance(value, (int, float)):
        return f"{value:.2f} GiB"
    return "n/a (CPU)" if device == "cpu" else "-"


def top_finding(summary: dict) -> str:
    """One line on where a trial's time or memory went, from its ``profile_summary.json`` (first rank listed).

    Kernel trials with GPU work: the largest kernel category's share of GPU time and the GPU idle share;
    without GPU work (CPU runs): the model part with the most CPU op time (``cpu_parts``), else the region with the
    most CPU time. Memory trials: the peak (the profiled
    step's, ``step peak``, when the phases sidecar had phases; else the recorded window's), where it lies in
    words (:func:`sftprof.analysis.memory_summary.peak_where`) and the allocation site holding most memory at it;
    then, when the recorded window peaks higher outside the step, that peak and where it lies. The rank is named:
    it is one rank's figure.
    A failed trial without those: its first failure (:func:`sftprof.analysis.failure.headline`).
    """
    for t in summary.get("kernel_traces") or []:
        if "summary" not in t:
            continue
        k, r = t["summary"], t["rank"]
        if k["gpu"]["activities"] and k["categories"]:
            c = k["categories"][0]
            return (f"{c['category']} {c['share_pct']:.0f}% of GPU time, GPU idle {k['gpu']['idle_share_pct']:.0f}% "
                    f"(rank {r})")
        parts = (k.get("cpu_parts") or {}).get("summed")
        if parts:
            p = max(parts, key=lambda x: x["total_ms"])
            return f"{p['label']} {p['share_pct']:.0f}% of CPU op time (rank {r})"
        regions = [x for x in k.get("regions") or [] if x["name"] != artifacts.STEP and x.get("cpu_ms") is not None]
        if regions:
            x = max(regions, key=lambda x: x["cpu_ms"])
            return f"slowest region {x['name']} {x['cpu_ms'] / 1e3:.1f} s CPU (rank {r})"
    for m in summary.get("memory_snapshots") or []:
        if "summary" not in m:
            continue
        from sftprof.analysis.memory_summary import peak_where  # numpy: only when a memory summary is read

        x, r = m["summary"], m["rank"]
        site = (x.get("top_sites") or [{}])[0]
        noun = "step peak" if x.get("peak_scope") == "profiled_step" else "peak"
        higher = ""
        if x.get("window_peak_position") in ("before_step", "after_step"):
            higher = f"; higher peak {x['window_peak_allocated_gib']:.2f} GiB {peak_where(x, 'window')}"
        return (f"{noun} {x['peak_allocated_gib']:.2f} GiB {peak_where(x)}" +
                (f"; top site {site['site'][:40]} {site['gib']:.2f} GiB" if site else "") + higher + f" (rank {r})")
    if summary.get("failure"):
        return f"first failure: {headline(summary['failure'])} (see {artifacts.SUMMARY_MD})"
    if summary.get("errors"):
        return f"{len(summary['errors'])} unreadable artifact(s): see {artifacts.SUMMARY_MD}"
    if summary.get("status") not in (None, "ok"):
        return f"trial failed: see {artifacts.SUMMARY_MD} and {artifacts.LAUNCHER_LOG}"
    if summary.get("profile_kind") == "memory" and (summary.get("completion") or {}).get("device") == "cpu":
        return "allocator snapshots need CUDA"
    return "-"


def _interpreter(python: str | None) -> str:
    """``python`` as a command that runs from any folder: a path made absolute (symlinks kept: a pyenv shim stays
    one), a bare name found on PATH (as given when it is not); None: ``sys.executable``."""
    if not python:
        return sys.executable
    if os.sep in python:
        return os.path.abspath(python)
    return shutil.which(python) or python


def report(run_root: Path, node_rank: int = 0, python: str | None = None) -> str:
    """The end-of-run text: a narrow table of trials, the summaries to open and the compare command.

    The compare command works from any folder: ``python`` (the driver's ``PYTHON``; a name without ``/`` is looked
    up on PATH, a relative path made absolute; None: this interpreter) and this repository's
    ``postprocess_profile.py`` by absolute path.

    Columns: trial (kind and step), status (``ok``, ``no snapshot (CPU)``, ``FAILED (<status>)``, ``not run``,
    ``interrupted``),
    step time (s, slowest rank of the profiled step), peak memory (GiB allocated, rank 0) and the top
    finding (:func:`top_finding`). Reads ``RUN_ROOT/summary.tsv`` and each trial's ``profile_summary.json``;
    a missing or unreadable summary leaves ``-`` in its row.

    Raises:
        OSError: ``summary.tsv`` cannot be read (the ``report`` subcommand prints it in one line and exits 2).
    """
    with open(Path(run_root) / artifacts.SUMMARY_TSV, encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    table = [("trial", "status", "step time", "peak mem", "top finding")]
    summaries = []
    for row in rows:
        path = Path(row["run_dir"]) / artifacts.SUMMARY_MD
        try:
            summary = read_summary(Path(row["run_dir"]) / artifacts.SUMMARY_JSON)
        except SummaryReadError:  # missing, unreadable, or of a newer sftprof
            summary = {}
        stats = summary.get("stats") or {}
        device = (summary.get("completion") or {}).get("device")
        cpu_memory = row["kind"] == "memory" and device == "cpu"
        status = (row["status"] if row["status"] in (NOT_RUN, INTERRUPTED)
                  else "FAILED (" + row["status"] + ")" if row["status"] != "0"
                  else "no snapshot (CPU)" if cpu_memory else "ok")
        step = stats.get("step_time_s")
        table.append((f"{row['kind']} step {row['step']}", status, f"{step:.2f} s" if step is not None else "-",
                      _gib(stats.get("mem_peak_allocated_gb"), device),
                      top_finding(summary) if summary else ("see node 0" if node_rank else "-")))
        if path.is_file():
            summaries.append(str(path))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(r[:4], widths)) + "  " + r[4] for r in table]
    if summaries:
        lines += ["", "summaries (Markdown; the .json next to each holds every figure):"] + [f"  {p}" for p in summaries]
        lines += ["", "compare with another run (run roots or trial dirs):",
                  f"  {shlex.quote(_interpreter(python))} {shlex.quote(str(REPO_ROOT / 'postprocess_profile.py'))} "
                  f"compare {shlex.quote(str(run_root))} OTHER_RUN_ROOT"]
    elif node_rank:
        lines += ["", f"node {node_rank}: node 0 postprocesses every rank; its RUN_ROOT holds the summaries"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """CLI: ``plan`` (exit 2 on bad input) or ``status LOG_DIR``; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m sftprof.launch", description="sftprof driver helper")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_plan = sub.add_parser("plan", help="validate driver env vars and write RUN_ROOT's plan; prints shell variables")
    p_plan.add_argument("overrides", nargs="*", help="extra key=value config overrides for every trial")
    p_status = sub.add_parser("status", help="print 0 if the trial completed ok, else 1")
    p_status.add_argument("log_dir")
    sub.add_parser("usage", help="print the driver's --help text")
    p_report = sub.add_parser("report", help="print the end-of-run table, the summaries and the compare command")
    p_report.add_argument("run_root")
    p_report.add_argument("--node-rank", type=int, default=0)
    p_report.add_argument("--python", help="the interpreter the compare command names (default: this one)")
    p_node = sub.add_parser("node-record", help="write LOG_DIR/nodes/node<k>.json after a trial")
    p_node.add_argument("log_dir")
    p_node.add_argument("node_rank", type=int)
    p_node.add_argument("torchrun_rc", type=int)
    p_node.add_argument("elapsed_s", type=int)
    p_node.add_argument("n_nodes", type=int)
    p_node.add_argument("nproc_per_node", type=int)
    p_not_run = sub.add_parser("not-run", help="add a 'not run' row to summary.tsv for each planned trial without one")
    p_not_run.add_argument("run_root")
    p_wait = sub.add_parser("wait-nodes", help="node 0: wait for the other nodes' end records; exit 1 if one failed")
    p_wait.add_argument("log_dir")
    p_wait.add_argument("n_nodes", type=int)
    p_wait.add_argument("timeout_s", type=float)
    args = ap.parse_args(argv)
    if args.cmd == "status":
        print(trial_status(Path(args.log_dir)))
        return 0
    if args.cmd == "usage":
        print(usage(), end="")
        return 0
    if args.cmd in ("report", "not-run"):
        try:
            if args.cmd == "report":
                print(report(Path(args.run_root), args.node_rank, args.python), end="")
            else:
                record_trials_not_run(Path(args.run_root))
        except OSError as err:
            print(f"sftprof: {args.cmd} {args.run_root}: cannot read or write {err.filename} ({err.strerror}); "
                  f"accepted: a RUN_ROOT the driver planned ({artifacts.TRIALS_TSV}) and started "
                  f"({artifacts.SUMMARY_TSV})", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "node-record":
        write_node_record(Path(args.log_dir), args.node_rank, args.torchrun_rc, args.elapsed_s, args.n_nodes,
                          args.nproc_per_node)
        return 0
    if args.cmd == "wait-nodes":
        problems = wait_for_nodes(Path(args.log_dir), args.n_nodes, args.timeout_s)
        for line in problems:
            print(f"sftprof: {line}", file=sys.stderr)
        return 1 if problems else 0
    # SIGINT or SIGTERM during the plan: what it wrote is removed and the last line printed is
    # PLAN_INTERRUPTED='<what was removed or left, in words>' (the driver's message says it); exit 128 + the signal.
    # A SIGINT ignored on entry (a job started with & by a script, as the driver starts the plan) stays ignored.
    for sig in PLAN_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _on_plan_signal)
    created: list[Path] = []
    run_root = None
    try:
        try:
            trials, settings, info = plan(os.environ, args.overrides)
        except (DriverError, ConfigError) as err:
            # a misspelled variable may be why the plan failed (N_GPU_PER_NODE ignored, then too few GPUs)
            for line in unknown_variable_warnings(os.environ):
                print(f"sftprof: warning: {line}", file=sys.stderr)
            print(f"sftprof: {err}", file=sys.stderr)
            return 2
        run_root = Path(info["run_root"])
        write_plan(trials, settings, info, created)
        with signals_held():  # the plan is complete once printed: a signal after that is the driver's to handle
            for line in info.pop("notices"):
                print(f"sftprof: {line}", file=sys.stderr)
            for key, value in info.items():
                print(f"{key.upper()}={shlex.quote(str(value))}")  # the driver evals these lines
            sys.stdout.flush()
            for sig in PLAN_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        return 0
    except PlanInterrupted as stop:
        print(f"PLAN_INTERRUPTED={shlex.quote(remove_plan(run_root, created))}", flush=True)
        return 128 + stop.signum


if __name__ == "__main__":
    run_main(main)
