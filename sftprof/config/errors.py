"""The configuration's error and its wording: :class:`ConfigError`, the checks that raise it, and how an entry point
exits with it.

Every message names the dotted key (or driver variable), the value and what is accepted, e.g.
``actor.loss.logprobs_chunk_size=-1: must be an integer >= 0 (0 = all tokens at once)``.
"""
from __future__ import annotations

import sys
from typing import Any, NoReturn

CONFIG_ERROR_PREFIX = "sftprof: configuration error: "


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range (the message says which, and what is accepted)."""


def require(ok: bool, key: str, value: Any, accepted: str) -> None:
    """Raise ``ConfigError("<key>=<value!r>: must be <accepted>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: must be {accepted}")


def require_choice(key: str, value: str, choices: tuple) -> None:
    """:func:`require` that ``value`` is one of ``choices``; a string field given ``off``/``on`` (``no``, ``yes``,
    ``false``, ``true``) holds ``'False'``/``'True'``, which YAML made of it: the message says so."""
    bool_note = (" (YAML reads on/off, yes/no and true/false as a boolean: the value given was one of these)"
                 if value in ("True", "False") else "")
    require(value in choices, key, value, f"one of {list(choices)}{bool_note}")


def require_at_least(section: Any, prefix: str, minimums: dict) -> None:
    """:func:`require` ``getattr(section, name) >= lo`` for each ``name: (lo, accepted)`` of ``minimums``."""
    for name, (lo, accepted) in minimums.items():
        value = getattr(section, name)
        require(value >= lo, f"{prefix}.{name}", value, accepted)


def exit_config_error(message: str) -> NoReturn:
    """Print ``sftprof: configuration error: <message>`` to stderr in one write and exit with status 2.

    One write (not ``print``, which writes the text and the newline separately): every rank of a trial refuses the
    same configuration at the same moment into one pipe (torchrun's output, ``launcher.log``), and with
    ``PYTHONUNBUFFERED=1`` two writes per rank let another rank's message land between one's text and its newline.
    """
    sys.stderr.write(f"{CONFIG_ERROR_PREFIX}{message}\n")
    sys.stderr.flush()
    sys.exit(2)
