"""Loading a trial's configuration: a YAML file (or bundled preset) with ``key=value`` dotted overrides, checked
source by source (:mod:`sftprof.config.sources`), merged onto the schema (:mod:`sftprof.config.schema`), resolved
(``${...}`` interpolation) and validated (:mod:`sftprof.config.validation`).

The overrides of one command line set each key once: two values for one key are refused
(:func:`reject_repeated_keys`), since OmegaConf alone would keep the last without a word. Entry points turn every
:class:`~sftprof.config.errors.ConfigError` into exit status 2 before any process group starts
(:func:`load_config_or_exit`).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Mapping

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sftprof.config.errors import ConfigError, exit_config_error
from sftprof.config.schema import SFTProfileConfig
from sftprof.config.sources import check_source, omegaconf_message
from sftprof.config.validation import validate

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
SHIPPED_DIR = Path(__file__).resolve().parents[2]  # the repository: its job YAMLs sit beside the driver script
SHIPPED_PATTERN = "*_sft_profile.yaml"
# What a config file's top level is instead of a mapping, in its error message.
_YAML_KINDS = {str: "string", int: "number", float: "number", bool: "boolean", list: "list"}


def resolve_config_path(path: str | Path) -> Path:
    """Return the YAML file for ``path``: an existing file, the name of a shipped job YAML (in :data:`SHIPPED_DIR`,
    found from any folder: ``qwen3_5_35b_a3b_sft_profile.yaml``) or the name of a bundled preset
    (``sftprof/presets/<name>.yaml``, e.g. ``tiny_cpu``). A file of that name in the current folder comes first.

    Raises:
        ConfigError: none of these exists (a directory is named as one).
    """
    p = Path(path)
    if p.is_file():
        return p
    if p.name == str(path) and p.match(SHIPPED_PATTERN) and (SHIPPED_DIR / p.name).is_file():
        return SHIPPED_DIR / p.name
    preset = PRESET_DIR / f"{path}.yaml"
    if preset.is_file():
        return preset
    accepted = (f"accepted: a YAML path, a shipped YAML {sorted(q.name for q in SHIPPED_DIR.glob(SHIPPED_PATTERN))} "
                f"or a bundled preset {sorted(q.stem for q in PRESET_DIR.glob('*.yaml'))}")
    if p.is_dir():
        raise ConfigError(f"config={path!r}: is a directory; {accepted}")
    raise ConfigError(f"config={path!r}: no such file; {accepted}")


def load_config(path: str | Path, overrides: List[str] | None = None) -> SFTProfileConfig:
    """Load a YAML file (or preset name), apply ``key=value`` dotted overrides and validate.

    Args:
        path: YAML file path or bundled preset name (:func:`resolve_config_path`).
        overrides: dotted overrides such as ``["actor.loss.logprobs_chunk_size=128"]``; list values use
            YAML syntax (``memory_profiler.profile_steps=[0,1]``).

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
                try:
                    check_source(layer, schema, raw if source == "the overrides" else None)
                except ConfigError as err:
                    raise ConfigError(f"{err} ({source})") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"{omegaconf_message(err)} (config {yaml_path})") from err
    source = f"config {yaml_path}"  # which layer a merge error comes from: the file, else the overrides
    try:
        merged = OmegaConf.merge(schema, layers[0])
        source = "overrides " + " ".join(dotlist) if dotlist else source
        merged = OmegaConf.merge(merged, layers[1])
        source = f"config {yaml_path}" + (" with overrides " + " ".join(dotlist) if dotlist else "")
        OmegaConf.resolve(merged)
        cfg: SFTProfileConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{omegaconf_message(err)} ({source})") from err
    validate(cfg)
    return cfg


def _yaml_value(text: str) -> object:
    """The value of an override's text as OmegaConf reads it (the text itself when it reads none)."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]), resolve=False)["v"]
    except OmegaConfBaseException:
        return text


def variable_conflict(variable: str, keys: str, arg: str) -> str:
    """The message of a driver variable (``NAME=value``) and an argument that set its config key(s) differently."""
    return (f"{variable} (a driver variable, sets {keys}) and the argument {arg}: one config key set to different "
            "values; set it once, as the variable or as the argument")


def reject_repeated_keys(overrides: List[str], variables: Mapping[str, str] | None = None) -> List[str]:
    """Refuse a config key that two ``key=value`` overrides set to different values (OmegaConf's dot list would keep
    the last one without a word); the same value twice is taken. ``variables``: the overrides that the driver made of
    its variables, ``{override: 'NAME=text'}``, placed before the arguments; an argument agrees with one when it
    gives the key the same value as YAML reads it (``"x"`` and ``x``).

    Returns:
        The arguments that agree with one of ``variables``.

    Raises:
        ConfigError: ``arguments K=A and K=B: one config key given twice with different values; give K once``; for a
            variable, ``NAME=text (a driver variable, sets K) and the argument K=B: one config key set to different
            values; set it once, as the variable or as the argument``.
    """
    variables = variables or {}
    seen: dict[str, str] = {}
    agreeing = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        key = key.strip()
        if not sep or key not in seen:
            seen[key] = arg
            continue
        first = seen[key]
        earlier = first.partition("=")[2]
        if first in variables:
            if _yaml_value(earlier) != _yaml_value(value):
                raise ConfigError(variable_conflict(variables[first], key, arg))
            agreeing.append(arg)
        elif earlier != value:
            raise ConfigError(f"arguments {key}={earlier} and {key}={value}: one config key given twice with "
                              f"different values; give {key} once")
    return agreeing


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


def to_yaml(cfg: SFTProfileConfig) -> str:
    """Return the resolved config as YAML text (for logs and ``profile_settings.log``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
