"""Checks of one config source (the YAML file, or the ``key=value`` overrides) against the schema, before the
sources are merged, and OmegaConf's errors in words that say what a key accepts.

OmegaConf reads any non-zero integer as a true boolean and names a value of the wrong shape only by its type
(``Cannot convert 'DictConfig' to string``); :func:`check_source` refuses both, naming the key, the value and what
it takes. Each function raises :class:`sftprof.config.errors.ConfigError`.
"""
from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

from sftprof.config.errors import ConfigError
from sftprof.config.schema import RECOMPUTE_MODULES

BOOL_ACCEPTED = "accepted: true or false (also yes/no, on/off, 1/0)"
INT_ACCEPTED = "accepted: an integer (the key's range is checked once it is one)"
FLOAT_ACCEPTED = "accepted: a number (the key's range is checked once it is one)"
# What an empty value (``key=``, read as None) of a schema field of each type is refused with.
EMPTY_ACCEPTED = {"int": INT_ACCEPTED, "float": FLOAT_ACCEPTED, "bool": BOOL_ACCEPTED,
                  "str": "accepted: a text value (an empty one is written key='')"}


def omegaconf_message(err: OmegaConfBaseException) -> str:
    """``<dotted key>: <OmegaConf's first line>``, with what the key's type accepts where OmegaConf does not say."""
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


def check_source(tree: Any, schema: DictConfig, raw: dict[str, str] | None = None) -> None:
    """Both checks of this module on one config source ``tree`` (a plain container) against the ``schema``;
    ``raw``: the override texts by dotted key, shown in messages instead of what YAML made of them.

    Raises:
        ConfigError: see :func:`_check_bool_ints` and :func:`_check_value_shapes`.
    """
    _check_bool_ints(tree, schema)
    _check_value_shapes(tree, schema, raw or {})
