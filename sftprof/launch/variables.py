"""The driver's environment variables: one table (:data:`VARIABLES`) that the launcher, ``--help``, the docs and
the checks all read.

Each row is a variable: its name, the config keys it sets, its parser (text -> value, raising
:class:`DriverError` with the variable, the value and what is accepted) and a one-line doc. Three scopes:

- ``config``: the variable sets a config key of every trial, only when set (non-empty); unset, the YAML's value (or
  an argument's) stands, so that value is its default and ``--help`` reads it from the YAML. These rows are made from
  the schema, where each is declared beside its key with the key's one check (:mod:`sftprof.config.settings`); the
  driver turns a set one into the argument ``key=value`` before the user's. ``PROFILE_RANKS`` is declared there too,
  beside both keys it sets, but its ranks are resolved against the layout (:data:`RANKS_VARIABLE`);
- ``trial``: the driver sets these keys per trial (one trial per profile step and kind); its default is written
  here;
- ``launcher``: a setting of the launcher itself (where the run goes, torchrun's rendezvous, the interpreter),
  no key of the trial's config (whose ``config.yaml`` stays the same for two runs of one experiment); its default
  is written here.

A variable and a ``key=value`` argument that set one key to different values are refused by the rule for a key given
twice (:func:`sftprof.config.reject_repeated_keys`). Numbers are read strictly: ASCII digits, no spaces
(:func:`sftprof.config.settings.read_number`); lists are comma-separated without spaces, ``0,1``
(:func:`sftprof.config.settings.comma_items`). Every variable's text is refused when it holds a control
character (:func:`check_text`), with one message for all. A set variable that is no driver variable but looks
like a misspelled one stops the driver (:func:`suspect_variables`) unless ``SFTPROF_ALLOW_UNKNOWN_VARS=1``.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Mapping, Sequence

from sftprof.analysis.what_if.changes import LABELS
from sftprof.artifacts import PROFILE_KINDS
from sftprof.config import (NAME_ACCEPTED, SETTING, ConfigError, SFTProfileConfig, Setting, is_folder_name,
                            load_config, parse_text)
from sftprof.config.settings import BOOL_TEXT, comma_items, read_number, shown

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER_SCRIPT = "run_qwen3_30b_a3b_sft_profile.sh"
DEFAULT_CONFIG = "qwen3_30b_a3b_sft_profile.yaml"
KINDS = PROFILE_KINDS
# Largest step count + 1 the driver takes (PROFILE_STEPS, TOTAL_STEPS): a longer run is a typo, not a profile.
MAX_STEPS = 10**9
DEFAULT_NODE_TIMEOUT_S = 600  # torch's own default for the static rendezvous (torch.distributed.elastic)
MULTI_NODE_PORT = 29500  # MASTER_PORT unset with several nodes: every node must agree, so no per-node pick
DEFAULT_STALL_TIMEOUT_S = 1800  # a rank without progress this long is stalled: above a checkpoint load or a step
NODE_TIMEOUT_MAX_S = 2**31 - 1  # NODE_TIMEOUT=99999999999999999999999 crashed torchrun (OverflowError, C int)
MAX_WHAT_IFS = 8  # TRY_WHAT_IFS (a count, or the keys listed): one full trial each; more is a typo, not a plan
# FIT_CHECK: a peak over the GPU stops the plan, is a warning, or is not checked; ``only``: the check alone, no launch
FIT_CHECKS = ("refuse", "warn", "off", "only")
FIT_ONLY_NO_FIT = 3  # FIT_CHECK=only's exit status when the worst rank does not fit (0: it fits)
GIB_EXAMPLES = "e.g. 79.19 (an H100 80 GB), 139.8 (an H200)"  # GPU_MEMORY_GIB's values, as torch.cuda.mem_get_info
ALLOW_UNKNOWN = "SFTPROF_ALLOW_UNKNOWN_VARS"


class DriverError(ValueError):
    """A driver variable or argument is invalid (the message names it, its value and what is accepted)."""


def _int(name: str, text: str, minimum: int, maximum: int | None = None, why: str = "") -> int:
    value = read_number(int, text)
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise DriverError(f"{name}={shown(text)!r}: must be an integer "
                          + (f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}{why}"))
    return int(value)


def parse_bool(name: str, text: str) -> bool:
    """``true``/``false``/``1``/``0`` (any case, no spaces) -> bool; else DriverError naming ``name``."""
    if text.lower() not in BOOL_TEXT:
        raise DriverError(f"{name}={text!r}: must be true or false (or 1/0)")
    return BOOL_TEXT[text.lower()]


def _no_repeats(name: str, text: str, items: Sequence[str | int]) -> None:
    repeated = sorted({str(t) for t in items if items.count(t) > 1})
    if repeated:
        raise DriverError(f"{name}={shown(text)!r}: lists {','.join(repeated)} more than once; each trial runs once")


def _items(name: str, text: str, accepted: str) -> list[str]:
    """:func:`sftprof.config.settings.comma_items`, its refusal a DriverError."""
    try:
        return comma_items(name, text, accepted)
    except ValueError as err:
        raise DriverError(str(err)) from None


def _steps(name: str, text: str) -> list[int]:
    items = _items(name, text, "a list of non-negative integers")
    if not text or any(read_number(int, t) is None or t.startswith("-") for t in items):
        raise DriverError(f"{name}={shown(text)!r}: must be a comma-separated list of non-negative integers, e.g. 0,1")
    if any(int(t) >= MAX_STEPS for t in items):
        raise DriverError(f"{name}={shown(text)!r}: must list integers below {MAX_STEPS} (10**9)")
    _no_repeats(name, text, [int(t) for t in items])
    return sorted(int(t) for t in items)


def _kinds(name: str, text: str) -> list[str]:
    items = _items(name, text, f"a non-empty subset of {','.join(KINDS)}")
    bad = [t for t in items if t not in KINDS]
    if not text or bad:
        raise DriverError(f"{name}={shown(text)!r}: must be a non-empty comma-separated subset of {','.join(KINDS)}"
                          + (f" (unknown: {','.join(bad)})" if text and bad else ""))
    _no_repeats(name, text, items)
    return [k for k in KINDS if k in items]


def _what_ifs(name: str, text: str) -> int | list[str]:
    """``TRY_WHAT_IFS``: how many what-ifs to try (0 to :data:`MAX_WHAT_IFS`, the heaviest), or which: a list of at
    most :data:`MAX_WHAT_IFS` what-if keys (:data:`sftprof.analysis.what_if.changes.LABELS`), each once. Text
    without a letter, a comma or a space is a count, refused as one; any other is a list (an empty key, ``a,,b``,
    refused as one)."""
    if not any(c.isalpha() or c == "," or c.isspace() for c in text):
        return _int(name, text, 0, MAX_WHAT_IFS)
    accepted = f"an integer from 0 to {MAX_WHAT_IFS} or a list of what-if keys"
    items = _items(name, text, accepted)
    unknown = [t for t in items if t and t not in LABELS]
    if unknown or "" in items:
        why = ([f"unknown: {shown(','.join(unknown))}"] if unknown else []) + (["an empty key"] if "" in items else [])
        raise DriverError(f"{name}={shown(text)!r}: must be an integer from 0 to {MAX_WHAT_IFS} or a comma-separated "
                          f"list of what-if keys from {','.join(LABELS)} ({'; '.join(why)})")
    if len(items) > MAX_WHAT_IFS:
        raise DriverError(f"{name}={shown(text)!r}: must list at most {MAX_WHAT_IFS} what-if keys (one trial each)")
    _no_repeats(name, text, items)
    return items


def what_ifs_text(what_ifs: int | list[str]) -> str:
    """``TRY_WHAT_IFS``'s value (:func:`_what_ifs`) as the user writes it: ``2``, ``recompute_plan,fit_oom``."""
    return str(what_ifs) if isinstance(what_ifs, int) else ",".join(what_ifs)


def folder_name(name: str, text: str) -> str:
    """``text`` when it is one folder name (:data:`sftprof.config.NAME_ACCEPTED`); else DriverError naming ``name``."""
    if not is_folder_name(text):
        raise DriverError(f"{name}={text!r}: use {NAME_ACCEPTED}")
    return text


def _host(name: str, text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._:\[\]-]+", text):
        raise DriverError(f"{name}={text!r}: must be a host name or IP address (letters, digits, '.', '-', ':', '[]')")
    return text


def _total_steps(name: str, text: str) -> int:
    steps = _int(name, text, 1)
    if steps > MAX_STEPS:
        raise DriverError(f"{name}={steps}: must be an integer from 1 to {MAX_STEPS} (10**9)")
    return steps


def _port(name: str, text: str) -> int:
    port = _int(name, text, 1)
    if port > 65535:
        raise DriverError(f"{name}={port}: must be in [1, 65535]")
    return port


def _text(name: str, text: str) -> str:
    return text


def _gib(name: str, text: str) -> float:
    value = read_number(float, text)
    if value is None or not 1 <= value < 2**20:
        raise DriverError(f"{name}={text!r}: must be a number of GiB in [1, 1048576), {GIB_EXAMPLES}")
    return value


def _fit_check(name: str, text: str) -> str:
    if text not in FIT_CHECKS:
        raise DriverError(f"{name}={text!r}: must be one of {', '.join(FIT_CHECKS)}")
    return text


@dataclass(frozen=True)
class Variable:
    """One driver variable (a row of :data:`VARIABLES`).

    Attributes:
        name: the environment variable.
        scope: ``config``, ``trial`` or ``launcher`` (module docstring).
        doc: one line for ``--help`` and the docs.
        keys: the config keys it sets (none for a launcher setting).
        parse: ``(name, text) -> value``; raises :class:`DriverError`.
        default: the default in words, where it is not the YAML's value of ``keys`` (every ``trial`` and
            ``launcher`` variable, and a ``config`` one whose default the driver derives); empty: the YAML's.
    """

    name: str
    scope: str
    doc: str
    keys: tuple[str, ...] = ()
    parse: Callable[[str, str], object] = _text
    default: str = ""

    def value(self, env: Mapping[str, str]) -> object | None:
        """The parsed value of this variable in ``env``; None when it is unset or empty (its default applies)."""
        text = env.get(self.name)
        return self.parse(self.name, text) if text else None


def _setting_value(s: Setting, kind: type, name: str, text: str) -> object:
    """A config variable's value (:func:`sftprof.config.parse_text`); DriverError naming it when refused."""
    try:
        return parse_text(s, kind, text)
    except ValueError as err:
        raise DriverError(str(err)) from None


def _schema_variables(section: type = SFTProfileConfig, prefix: str = "") -> tuple[Variable, ...]:
    """The ``config`` variables the schema declares beside their keys (:mod:`sftprof.config.settings`), in its
    order, each read and checked by its keys' :class:`~sftprof.config.Setting`; one declared beside several keys
    (``PROFILE_RANKS``) is one variable that sets them all."""
    out: dict[str, Variable] = {}
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        kind, s = hints[f.name], f.metadata.get(SETTING)
        if s is not None:
            keys = (out[s.env].keys if s.env in out else ()) + (prefix + f.name,)
            out[s.env] = Variable(s.env, "config", s.doc, keys, partial(_setting_value, s, kind), s.default)
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            for v in _schema_variables(kind, f"{prefix}{f.name}."):
                out[v.name] = dataclasses.replace(v, keys=(out[v.name].keys if v.name in out else ()) + v.keys)
    return tuple(out.values())


_SCHEMA_VARIABLES = _schema_variables()
# PROFILE_RANKS sets perf_tracer.ranks and memory_profiler.ranks, and its ranks are resolved against the layout, where
# two specs that name the same ranks agree (pp_rank0 and 0 on one stage): the driver reconciles it with the arguments
# itself (sftprof.launch.planning._profiled_ranks), not by the rule for a key given twice.
RANKS_VARIABLE = next(v for v in _SCHEMA_VARIABLES if v.name == "PROFILE_RANKS")
# The variables that set one config key each, with its default the YAML's (N_GPUS_PER_NODE's and FILEROOT's derived).
CONFIG_VARIABLES = tuple(v for v in _SCHEMA_VARIABLES if v is not RANKS_VARIABLE)
VARIABLES = (
    Variable("CONFIG", "launcher", "YAML path, a shipped YAML by name (from any folder) or a bundled preset "
             "(tiny_cpu, tiny_qwen3_5_cpu)", default=DEFAULT_CONFIG),
    *CONFIG_VARIABLES,
    Variable("PROFILE_STEPS", "trial", "steps to profile (each < 10**9), one trial per step and kind",
             ("perf_tracer.profile_steps", "memory_profiler.profile_steps"), _steps, "0,1"),
    Variable("TOTAL_STEPS", "trial", "steps each trial runs (must exceed the profile step; <= 10**9)",
             ("total_train_steps",), _total_steps, "profile step + 1"),
    RANKS_VARIABLE,
    Variable("PROFILE_KINDS", "trial", "subset of kernel,memory", ("perf_tracer.enabled",), _kinds,
             "kernel,memory (kernel without CUDA)"),
    Variable("NODE_RANK", "launcher", "this node (node 0 postprocesses every rank)", parse=lambda n, t: _int(n, t, 0),
             default="0"),
    Variable("MASTER_ADDR", "launcher", "address of node 0", parse=_host, default="127.0.0.1"),
    Variable("MASTER_PORT", "launcher", "torchrun rendezvous port on node 0", parse=_port,
             default=f"a free port (1 node), {MULTI_NODE_PORT} (several)"),
    Variable("NODE_TIMEOUT", "launcher", "seconds a node waits for the others to join, and node 0 for their end "
             "records (1 to 2**31 - 1)", parse=lambda n, t: _int(n, t, 1, NODE_TIMEOUT_MAX_S, " (2**31 - 1 seconds: "
                                                                    "torchrun's rendezvous timeout is a C int)"),
             default=str(DEFAULT_NODE_TIMEOUT_S)),
    Variable("STALL_TIMEOUT", "launcher", "seconds a rank may go without progress (no phase begun or ended) before "
             "the watchdog ends the trial naming it (0: no watchdog)",
             parse=lambda n, t: _int(n, t, 0, NODE_TIMEOUT_MAX_S),
             default=str(DEFAULT_STALL_TIMEOUT_S)),
    Variable("TRY_WHAT_IFS", "launcher", "after the planned trials, one more trial for each of the N heaviest "
             "what-ifs their summaries propose, or for the heaviest of each what-if key listed (e.g. "
             "recompute_plan,fit_oom: the summaries' what_if keys), the setting applied, same kind and step, compared "
             f"with its trial: prediction against outcome (0 to {MAX_WHAT_IFS}, or at most {MAX_WHAT_IFS} keys; one "
             "node)", parse=_what_ifs, default="0"),
    Variable("GPU_MEMORY_GIB", "launcher", "one GPU's memory for the fit check, GiB (as torch.cuda.mem_get_info "
             "gives it: 79.19 on an H100 80 GB)", parse=_gib, default="the least free memory of this node's GPUs "
             "(nvidia-smi)"),
    Variable("FIT_CHECK", "launcher", "a megatron trial whose predicted peak exceeds GPU_MEMORY_GIB: refuse (exit 2, "
             "naming the settings that fit), warn (and launch), off; only: print the check, launch and write nothing, "
             f"no GPU needed with GPU_MEMORY_GIB (exit 0 fits, {FIT_ONLY_NO_FIT} not)", parse=_fit_check,
             default="refuse"),
    Variable("STOP_ON_FAILURE", "launcher", "stop after the first failed trial (the rest are listed as `not run`)",
             parse=parse_bool, default="1"),
    Variable("RUN_ROOT", "launcher", "where trial outputs and summary.tsv go; never overwritten",
             default="./sftprof_runs/<experiment>_<stamp>[_node<k>]"),
    Variable("PROFILE_STAMP", "launcher", "suffix of trial names (letters, digits, '_' and '-')", parse=folder_name,
             default="now (%Y%m%d_%H%M%S)"),
    Variable("PYTHON", "launcher", "the Python that runs everything (read by the entry script)", default="python3"),
    Variable(ALLOW_UNKNOWN, "launcher", "1: run even when a set variable looks like a misspelled driver variable "
             "(it is ignored, with a warning)", parse=parse_bool, default="0"),
)
BY_NAME = {v.name: v for v in VARIABLES}


def check_text(env: Mapping[str, str]) -> None:
    """Refuse a driver variable whose text holds a control character (CR of a file with CRLF line endings, a tab, a
    newline): every variable, path-like or value-like, with one message.

    Raises:
        DriverError: ``NAME='...\\r': holds the control character '\\r' ...``.
    """
    for v in VARIABLES:
        text = env.get(v.name)
        bad = [c for c in text or "" if ord(c) < 32 or ord(c) == 127]
        if bad:
            raise DriverError(f"{v.name}={text!r}: holds the control character {bad[0]!r} (a variable read from a file "
                              "with CRLF line endings?); accepted: a value without control characters (CR, LF, tab)")


# Unknown variables that start like a driver variable are probably misspelled ones.
_DRIVER_PREFIXES = ("PROFILE_", "MEMORY_", "LOGPROBS_", "LM_HEAD_", "TRAIN_", "TOTAL_", "N_GPU", "N_NODE",
                    "USE_PRECISION", "USE_DETERMINISTIC", "MAIN_GRAD", "STOP_ON", "EXPERIMENT_", "TRY_")


def closest_variable(name: str, cutoff: float = 0.8) -> str | None:
    """The driver variable whose name is closest to ``name`` (difflib ratio >= ``cutoff``), else None."""
    match = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=cutoff)
    return match[0] if match else None


def suspect_variables(env: Mapping[str, str]) -> list[tuple[str, str | None, str]]:
    """The environment variables that look like misspelled driver variables: ``(name, closest driver variable or
    None, message)`` each, sorted by name.

    A variable is suspect when it is not a driver variable and, in upper case, is one (``profile_steps``: the
    driver reads upper-case names only), starts with a driver prefix (``PROFILE_``, ``MEMORY_``, ...) or is close
    to a driver variable's name (difflib ratio >= 0.85); the closest driver variable is named when there is one
    (ratio >= 0.8). One with a closest name is a likely typo (the launcher refuses it unless
    ``SFTPROF_ALLOW_UNKNOWN_VARS=1``); one without is a warning.
    """
    out: list[tuple[str, str | None, str]] = []
    for name in sorted(env):
        upper = name.upper()
        if name in BY_NAME:
            continue
        if upper in BY_NAME:
            out.append((name, upper, f"{name} is not a driver variable and is ignored (driver variables are upper "
                                     f"case); did you mean {upper}?"))
        elif upper.startswith(_DRIVER_PREFIXES) or closest_variable(upper, 0.85):
            near = closest_variable(upper)
            out.append((name, near, f"{name} is not a driver variable and is ignored" +
                        (f"; did you mean {near}?" if near else f" (`bash {DRIVER_SCRIPT} --help` lists them)")))
    return out


def unknown_allowed(env: Mapping[str, str]) -> bool:
    """``SFTPROF_ALLOW_UNKNOWN_VARS`` of ``env`` (default 0). Raises DriverError when it is not a boolean."""
    return parse_bool(ALLOW_UNKNOWN, env.get(ALLOW_UNKNOWN) or BY_NAME[ALLOW_UNKNOWN].default)


def unknown_variable_warnings(env: Mapping[str, str]) -> list[str]:
    """The message of each :func:`suspect_variables` entry."""
    return [message for _, _, message in suspect_variables(env)]


def _default(v: Variable, cfg: SFTProfileConfig | None, with_key: bool) -> str:
    """``v``'s default in words: the table's, or the YAML's value of its first key (what stands when ``v`` is unset),
    followed by that key when ``with_key``."""
    if v.default or cfg is None:
        return v.default or "from the YAML"
    node = cfg
    for part in v.keys[0].split("."):
        node = getattr(node, part)
    text = (str(node).lower() if isinstance(node, bool) else str(node)) or "''"
    return f"{text} ({v.keys[0]})" if with_key else text


def defaults(config: str | None, with_key: bool = True) -> tuple[dict[str, str], str]:
    """Each variable's default in words (``{name: text}``), config keys' from ``config`` (a YAML path or preset; None:
    the shipped YAML), and a note when that YAML cannot be loaded (then those defaults read ``from the YAML``)."""
    path = config or str(REPO_ROOT / DEFAULT_CONFIG)
    try:
        cfg, note = load_config(path), ""
    except ConfigError as err:
        cfg, note = None, f"(CONFIG={path} does not load, so the YAML's defaults are not shown: {err})"
    return {v.name: _default(v, cfg, with_key) for v in VARIABLES}, note


def usage(config: str | None = None) -> str:
    """The driver's ``--help`` text: synopsis, every variable with its default (config keys': ``config``'s, or the
    shipped YAML's), examples and exit statuses."""
    shown, note = defaults(config)
    width = max(len(v.name) for v in VARIABLES)
    yaml_name = Path(config).name if config else DEFAULT_CONFIG
    lines = [f"usage: [VAR=value ...] bash {DRIVER_SCRIPT} [key=value ...]",
             "",
             "Profile SFT training steps: one torchrun trial per (profile step, kind); kernel trials record",
             "PyTorch-profiler traces, memory trials CUDA allocator snapshots; each trial is postprocessed into",
             "trace views and profile_summary.{json,md}. Arguments after the script are config overrides for every",
             "trial (dotted keys, e.g. actor.num_layers=4); driver variables go before `bash`.",
             "",
             f"Driver variables (a config key's variable overrides the YAML only when set; defaults of {yaml_name}):"]
    lines += [f"  {note}"] if note else []  # before the table, whose config defaults it explains
    for v in VARIABLES:
        lines.append(f"  {v.name:<{width}}  {v.doc} [default: {shown[v.name]}]")
    lines += ["",
              "Examples:",
              f"  CONFIG=tiny_cpu bash {DRIVER_SCRIPT}                       # whole workflow on CPU",
              f"  PROFILE_STEPS=1 PROFILE_KINDS=kernel bash {DRIVER_SCRIPT}   # one kernel trial, 8 GPUs",
              f"  USE_PRECISION_AWARE_OPTIMIZER=false MAIN_GRADS_DTYPE=float32 TRAIN_BATCH_SIZE=1 PROFILE_N_MBS=1 bash "
              f"{DRIVER_SCRIPT} actor.backend=megatron:d1 actor.num_layers=3",
              f"  N_NODES=2 NODE_RANK=0 PROFILE_STAMP=s1 MASTER_ADDR=node0 FILEROOT=/shared/sftprof_fileroot bash "
              f"{DRIVER_SCRIPT}",
              "",
              "Exit status: 0 all trials ok, 2 bad input (nothing launched), 130 Ctrl-C (143 SIGTERM: either stops",
              "the whole run), else that of the last failing trial; FIT_CHECK=only: 0 fits, "
              f"{FIT_ONLY_NO_FIT} does not fit.",
              "See README.md for the artifacts and how to read them."]
    return "\n".join(lines) + "\n"


def markdown_table(config: str | None = None) -> str:
    """The table as Markdown (``docs/driver_variables.md``): variable, config keys, default, meaning."""
    shown, note = defaults(config, with_key=False)
    rows = ["| variable | config keys | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        keys = ", ".join(f"`{k}`" for k in v.keys) + (" (per trial)" if v.scope == "trial" else "") or "–"
        rows.append(f"| `{v.name}` | {keys} | {shown[v.name]} | {v.doc} |")
    return "\n".join(rows + ([f"\n{note}"] if note else [])) + "\n"
