"""The plan's records, shared by the launcher's modules (``planning`` makes them; ``arguments``, ``folders``, ``trials``,
``what_ifs`` and ``cli`` read them): a :class:`Trial`, what planning tells the user (:class:`PlanLog`), the config
file as read (:class:`PlanConfig`), the parsed driver variables (:class:`DriverEnv`), the probed layout
(:class:`Probe`) and how the planned trials run (:class:`RunPlan`). Data only: this module imports nothing of the launcher."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sftprof.allocation import Layout
from sftprof.config import SFTProfileConfig

__all__ = ["Trial", "PlanLog", "PlanConfig", "DriverEnv", "Probe", "RunPlan"]


@dataclass
class Trial:
    """One torchrun launch: profile ``kind`` at ``step`` (paths absolute); ``args``: the trainer's arguments; ``env``:
    environment variables of its processes on top of the driver's; ``what_if``: the settings a what-if trial tries
    (:mod:`sftprof.launch.what_ifs`; empty for a planned trial)."""

    name: str
    kind: str
    step: int
    run_dir: Path
    log_dir: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    what_if: str = ""


@dataclass
class PlanLog:
    """What planning tells the user: ``settings`` (lines of ``profile_settings.log``), ``notices`` (lines printed
    before launch: skipped trials, the plan) and ``warnings`` (printed before launch, written into
    ``profile_settings.log`` and repeated under the end table)."""

    settings: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # variable -> the arguments that set one of its config keys to the value it gives (see agree)
    agreeing: dict[str, list[str]] = field(default_factory=dict)
    _noted: dict[str, tuple[object, str]] = field(default_factory=dict)
    config: PlanConfig | None = None  # set by expand_trials

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

    def warn(self, text: str) -> None:
        """A warning before launch: printed, kept in ``profile_settings.log``, repeated under the end table."""
        self.warnings.append(text)
        self.notices.append(f"warning: {text}")


@dataclass
class PlanConfig:
    """The CONFIG file as the plan read it: ``source`` (its path), ``copy`` (``RUN_ROOT/plan_config.yaml``, which
    every trial loads) and ``text`` (its bytes); ``sha256`` of the text."""

    source: str
    copy: str
    text: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text).hexdigest()


@dataclass
class DriverEnv:
    """The driver variables, parsed and range-checked (step 1 of :func:`plan`); None = unset."""

    get: Callable[..., str | None]
    config: str
    steps: list[int]
    kinds: list[str]
    total_steps: int | None
    stop: bool
    what_ifs: int | list[str]  # TRY_WHAT_IFS: how many, or which keys (sftprof.launch.variables._what_ifs)
    overrides: list[str]
    extra_overrides: list[str]
    set_keys: set[str]
    node_rank: int
    master_addr: str
    master_port: int | None
    node_timeout: int
    fit_check: str
    gpu_memory_gib: float | None
    stall_timeout: int


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


@dataclass
class RunPlan:
    """How the planned trials run (:func:`sftprof.launch.planning.plan`'s third result): where, torchrun's settings
    (one node's), the limits and what to tell the user; ``python -m sftprof.launch plan`` prints the fields of
    :data:`sftprof.launch.cli.PLAN_KEYS`."""

    run_root: Path
    run_root_set: bool  # RUN_ROOT was given (else the default folder was made up)
    trials: int  # how many trials were planned
    stop_on_failure: int  # 1: stop after the first failed trial (STOP_ON_FAILURE), 0: run them all
    what_ifs: int | list[str]  # TRY_WHAT_IFS: how many, or which keys
    node_timeout: int  # seconds (NODE_TIMEOUT)
    stall_timeout: int  # seconds without progress before the watchdog ends a trial (STALL_TIMEOUT; 0: none)
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    config: PlanConfig  # the CONFIG file every trial loads (its copy in RUN_ROOT)
    notices: list[str]  # lines for the user before launch: skipped trials, the plan, the warnings
    warnings: list[str]  # repeated under the end table
    fit_only: bool | None = None  # FIT_CHECK=only: whether the worst rank fits (nothing is written or launched)
