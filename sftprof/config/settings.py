"""A config key's driver variable and its one check, declared beside the key in :mod:`sftprof.config.schema`.

``field(default=..., metadata=setting("NAME", "doc", "an integer >= 0", lambda v: v >= 0))`` gives a key its
driver variable (``NAME``, documented in ``--help`` and ``docs/driver_variables.md``) and the check of its value:
the section's ``check`` runs it on the loaded config (:func:`check_settings`: ``key=value: must be <accepted>``,
ConfigError), and the driver runs it on the variable's text before it becomes the argument ``key=value``
(:func:`parse_text`: ``NAME='text': must be <accepted>``, ValueError). The text is read strictly: ASCII digits only,
no surrounding whitespace, no ``+``; booleans ``true``/``false``/``1``/``0`` (any case); a list comma-separated
without spaces (``0,1``: :func:`comma_items`, as docs/driver_variables.md writes every list).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from sftprof.config.errors import ConfigError, require, require_choice

# Names that become one folder of a path (experiment_name, trial_name, the driver's EXPERIMENT_NAME and
# PROFILE_STAMP): no '/', '.' or '..' can lead outside the folder they are put in.
NAME_ACCEPTED = "letters, digits, '_' and '-' only"
SETTING = "sftprof_setting"  # the metadata key of a dataclass field that holds its Setting
BOOL_TEXT = {"true": True, "false": False, "1": True, "0": False}
_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE]-?[0-9]+)?")


def is_folder_name(text: str) -> bool:
    """True when ``text`` is a non-empty name of :data:`NAME_ACCEPTED` characters, ASCII (safe as one path component
    on any file system; ``str.isalnum`` alone takes '\u0661' and 'é')."""
    return text.isascii() and text.replace("_", "").replace("-", "").isalnum()


@dataclass(frozen=True)
class Setting:
    """A config key's driver variable and check.

    Attributes:
        env: the driver variable that sets the key.
        doc: one line for ``--help`` and the docs.
        accepted: what the key accepts, in words (``must be <accepted>``).
        ok: the check of a typed value; None: ``choices`` (or any value of the key's type).
        choices: the accepted values of a text key.
        path: the variable's text is a path, resolved (``~`` expanded) before it becomes the argument.
        default: the default in words where the driver derives it (else the YAML's value is shown).
        why: the check of a value whose reason varies (a rank spec: malformed, reversed range): the complaint in
            words, None when the value is accepted; replaces ``ok``.
        listing: the variable's text is a comma-separated list, written without spaces (:func:`comma_items`).
    """

    env: str
    doc: str
    accepted: str = ""
    ok: Callable[[Any], bool] | None = None
    choices: tuple[str, ...] = ()
    path: bool = False
    default: str = ""
    why: Callable[[Any], str | None] | None = None
    listing: bool = False

    def complaint(self, value: Any) -> str | None:
        """``must be <accepted>`` (or what ``why`` says) when ``value`` fails the check, else None."""
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.why is not None:
            return self.why(value)
        if self.ok is not None and not self.ok(value):
            return f"must be {self.accepted}"
        return None


def read_number(kind: type, text: str) -> int | float | None:
    """``text`` as an int or float (``kind``) when it is one written in ASCII, without spaces or ``+``; else None
    (Python's ``int``/``float`` would take ``'\u0661\u0662'`` and ``' 12 '``)."""
    return kind(text) if (_INT if kind is int else _FLOAT).fullmatch(text) else None


def setting(env: str, doc: str, accepted: str = "", ok: Callable[[Any], bool] | None = None, **kw: Any) -> dict:
    """The ``metadata`` of a dataclass field set by driver variable ``env`` (:class:`Setting`'s arguments)."""
    return {SETTING: Setting(env, doc, accepted, ok, **kw)}


SHOWN_CHARS = 80  # a refusal echoes at most this much of a variable's value (a 5000-item list is not read back)


def shown(text: str) -> str:
    """A variable's value as a refusal echoes it: cut to its first :data:`SHOWN_CHARS` characters and ``…`` when
    longer (``0,1,2,…``)."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


def comma_items(env: str, text: str, accepted: str) -> list[str]:
    """The items of variable ``env``'s comma-separated ``text`` (``"0,1"`` -> ``["0", "1"]``).

    Raises:
        ValueError: ``NAME='0, 1': must be <accepted>, comma-separated without spaces (0,1)`` when ``text`` holds
            whitespace: the documented format has none, and a list read both ways would be two formats (both
            echoes :func:`shown`).
    """
    if any(c.isspace() for c in text):
        raise ValueError(f"{env}={shown(text)!r}: must be {accepted}, comma-separated without spaces "
                         f"({shown(''.join(text.split()))})")
    return text.split(",")


def check_settings(section: Any, prefix: str) -> None:
    """Run the :class:`Setting` check of each field of ``section`` (a schema dataclass at dotted ``prefix``).

    Raises:
        ConfigError: ``<prefix>.<field>=<value!r>: must be <accepted>`` (choices as a list).
    """
    for f in fields(section):
        s = f.metadata.get(SETTING)
        if s is None:
            continue
        key, value = f"{prefix}.{f.name}" if prefix else f.name, getattr(section, f.name)
        if s.choices:
            require_choice(key, value, s.choices)
        elif s.why is not None:
            problem = s.why(value)
            if problem:
                raise ConfigError(f"{key}={value!r}: {problem}")
        else:
            require(s.ok is None or s.ok(value), key, value, s.accepted)


def parse_text(s: Setting, kind: type, text: str) -> Any:
    """The value of variable text ``text`` for a key of type ``kind`` (int, float, bool or str), checked.

    Raises:
        ValueError: ``NAME='text': must be <accepted>`` (the text is not a value of ``kind``, or fails the check).
    """
    if kind is bool:
        value = BOOL_TEXT.get(text.lower())
        if value is None:
            raise ValueError(f"{s.env}={text!r}: must be true or false (or 1/0)")
        return value
    if kind in (int, float):
        value = read_number(kind, text)
        if value is None:
            raise ValueError(f"{s.env}={text!r}: must be {s.accepted}")
    else:
        if s.listing:
            comma_items(s.env, text, s.accepted)
        value = str(Path(text).expanduser().resolve()) if s.path else text
    complaint = s.complaint(value)
    if complaint:
        raise ValueError(f"{s.env}={text!r}: {complaint}")
    return value
