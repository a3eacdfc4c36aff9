"""The ``key=value`` arguments after the script, against the driver variables: an argument written like a driver
variable refused, and the keys the driver sets for each trial (:data:`TRIAL_KEYS`), which an argument may give only
the driver's value. A config variable and an argument for its key meet in the rule for a key given twice
(:func:`sftprof.config.reject_repeated_keys`).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import fields

from sftprof.config import ConfigError, SFTProfileConfig, load_config
from sftprof.launch.variables import BY_NAME, DRIVER_SCRIPT, DriverError, closest_variable
from sftprof.launch.plan_types import DriverEnv, PlanLog


# Config keys the driver sets for each trial (expand_trials) -> the driver variables that decide them (trial_name: none,
# the driver's own). An argument may give one only the value the driver gives it.
TRIAL_KEYS = {"trial_name": (), "total_train_steps": ("TOTAL_STEPS",), "perf_tracer.enabled": ("PROFILE_KINDS",),
              "perf_tracer.profile_steps": ("PROFILE_STEPS", "PROFILE_KINDS"),
              "memory_profiler.profile_steps": ("PROFILE_STEPS", "PROFILE_KINDS")}


def yaml_value(value: object) -> str:
    """``value`` as a YAML override writes it (booleans in lower case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def reject_driver_variables_as_arguments(extra_overrides: list[str]) -> None:
    """Raise DriverError for an argument written like a driver variable (``NAME=value``, upper case, or a driver
    variable's name in lower case that is no top-level config key: ``profile_steps=1``, not ``experiment_name=x``)."""
    overrides = "arguments after the script are config overrides, dotted lower-case keys such as actor.num_layers=4"
    config_keys = {f.name for f in fields(SFTProfileConfig)}
    for arg in extra_overrides:
        lower = re.fullmatch(r"([a-z][a-z0-9_]*)=(.*)", arg, flags=re.S)
        if lower and lower.group(1).upper() in BY_NAME and lower.group(1) not in config_keys:
            name = lower.group(1).upper()
            raise DriverError(f"argument {arg!r} is not a config key but the driver variable {name} in lower case: "
                              "driver variables are upper case and go in the environment, before `bash` ("
                              f"{shlex.quote(f'{name}={lower.group(2)}')} bash {DRIVER_SCRIPT}); {overrides}")
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(.*)", arg, flags=re.S)
        if m is None:
            continue
        name, value = m.groups()
        if name in BY_NAME:
            raise DriverError(f"argument {arg!r} is a driver variable: put it before `bash` "
                              f"({shlex.quote(arg)} bash {DRIVER_SCRIPT}); {overrides}")
        near = closest_variable(name)
        if near:
            raise DriverError(f"argument {arg!r} is not a config override ({overrides}); did you mean the driver "
                              f"variable {near}, set before `bash` ({shlex.quote(f'{near}={value}')} bash {DRIVER_SCRIPT})?")
        raise DriverError(f"argument {arg!r} is neither a config override ({overrides}) nor a driver variable "
                          f"(`bash {DRIVER_SCRIPT} --help` lists them)")


def arguments_setting(key: str, extra_overrides: list[str]) -> list[str]:
    """The ``key=value`` arguments that set config ``key``."""
    return [arg for arg in extra_overrides if arg.partition("=")[0].strip() == key]


def config_value(cfg: SFTProfileConfig, key: str) -> object:
    """The value of dotted ``key`` in ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_trial_arguments(d: DriverEnv, owned: dict[str, list[str]], settings: dict[str, str],
                          cfg: SFTProfileConfig, trial: str, log: PlanLog) -> None:
    """Refuse (DriverError) an argument that sets a key of :data:`TRIAL_KEYS` to another value than the driver's
    for this trial (``settings``: key -> ``key=value``; ``cfg``: the trial's config), naming the first such argument
    and the driver variable that sets the key; arguments that agree are taken and noted on that variable's line
    (:meth:`sftprof.launch.plan_types.PlanLog.agree`). The argument's value is read as the trainer would: the config
    with it last."""
    try:
        theirs = load_config(d.config, d.overrides + list(settings.values()) + d.extra_overrides)
    except ConfigError:  # an invalid value is not the driver's (which loaded above)
        theirs = None
    for key, arguments in owned.items():
        variables = " and ".join(TRIAL_KEYS[key])
        if theirs is None or config_value(theirs, key) != config_value(cfg, key):
            arg = arguments[0]
            if not variables:
                raise DriverError(f"argument {arg}: trial_name is the driver's own: it names each trial "
                                  f"<model>_fake<len>_<kind>_step<N>_<stamp> ({settings['trial_name']} for {trial}); "
                                  "leave the argument out (EXPERIMENT_NAME and PROFILE_STAMP name the run)")
            remedy = (f"set {variables} before `bash` instead" + (
                f" ({shlex.quote('TOTAL_STEPS=' + arguments[-1].partition('=')[2])} bash {DRIVER_SCRIPT})"
                if key == "total_train_steps" else ""))
            raise DriverError(f"argument {arg}: the driver sets {key} for each trial from {variables} ({settings[key]} "
                              f"for {trial}); {remedy}")
        log.agree(TRIAL_KEYS[key][0] if variables else "trial_name", arguments)
        if not variables:
            log.note("trial_name", cfg.trial_name, "the driver's own: <model>_fake<len>_<kind>_step<N>_<stamp>")
