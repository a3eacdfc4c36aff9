"""The schema of ``profile_summary.json``: every member, its type and its unit, and the one reader and writer.

A summary is plain JSON; its shape is the :class:`ProfileSummary` TypedDict below and the TypedDicts it nests
(the JSON object is the type: what the analysis builds is what is written and what a reader gets). Units are in
the member names (``_ms`` milliseconds, ``_us`` microseconds on the trace clock, ``_s`` seconds, ``_gib`` GiB =
2**30 bytes, ``_gb`` GiB as the trainer writes them, ``_mib`` MiB, ``_bytes``, ``_pct`` percent 0-100,
``_share`` 0-1) or in the docstring of the TypedDict that holds them. Times in ms are rounded to 4 decimals
(:func:`ms`).

Versions: ``schema_version`` is ``"<major>.<minor>"`` (:data:`SCHEMA_VERSION`). A minor version adds members and
never changes one; a major version may. :func:`read_summary` reads every version up to this major (a summary of
release 1, ``"schema": "sftprof.profile_summary/1"`` without ``schema_version``, and one of 2.x are brought to this
shape: :func:`_upgrade`) and refuses a newer major with a message saying so. :func:`summary_json` is the one writer
of the JSON text (strict JSON: non-finite numbers become null, keys sorted). 3.0 (against 2.0): a snapshot's times
(``window_ms``, ``peak_time_ms``, ``window_peak_time_ms``) may be null (an allocator history without times, or none),
``peak_scope`` may be ``dump_time``, ``step_peak_unknown`` says why a snapshot gives no step peak, each trace has its
``sanity`` and a finding its ``caveats``. 3.1: a snapshot's ``without_largest_block``, a host-wait place's
``longest_gap_us``. 3.2: Python garbage collections (``host.gc``, ``gpu_idle.host_wait_gc_ms``, a host-wait place's
``gc_ms``), present when the trace has their ranges. 3.3: the trial's recorded ``environment``. 3.4: a simulated
rank's ``simulation`` (what was not run, what was assumed, the projected step); a failed trial's ``oom`` triage; a
snapshot's ``devices``, ``device_from`` and ``step_peak_lower_bound``; a finding's ``next_step``; an interrupted
trial's ``interrupted``. 3.5: ``wall_time`` (where the trial's wall time went, step 0's cold start), a step row's
``started_unix_s`` and ``profiler_s``. 3.6: a simulated rank's projection gives the real rank's memory need and
whether it fits the GPU (``simulation.projection.memory``: ``measured_peak_reserved_gib``, ``outside_pytorch_gib``,
``real_rank_need_gib``, ``capacity_gib``, ``fits``). 3.7: the trial's recorded software ``versions`` (Python, torch
and its CUDA, megatron-core, TE, transformers, Triton, flash-linear-attention; null: not recorded). 3.8: ``versions``
holds sftprof's version and commit (``sftprof``) and torch's NCCL (``nccl``). 3.9: a negative cold start says why it
is not measurable (``wall_time.cold_start.not_measurable``). 3.10: the ``teardown`` phase (the ranks' barrier and the
process groups torn down, from ``stats.teardown``, stats.jsonl's teardown record) split off ``exit``, and its barrier
part ``wall_time.barrier_s``. 3.11: the ``atexit`` phase (threads joined and atexit handlers run, to ``stats.exit``,
stats.jsonl's exit record) split off ``exit``. 3.12: a plot that could not be drawn is its own error, the trace or
snapshot still summarised (``kernel_traces[].parts_plot_error``, ``memory_snapshots[].plot_error``).

:func:`check` lists where a summary departs from the schema. With the environment variable
``SFTPROF_STRICT_SCHEMA=1`` (the test suite sets it) :func:`summary_json` raises :class:`SchemaError` on any
departure, so every summary the tests write is checked; without it nothing is checked at write time (a
postprocess never fails on its own summary's shape).

The members are declared by part, beside the code that makes them: ``<room>/schema.py`` of each sub-package of
:mod:`sftprof.analysis` (``trial``, ``trace``, ``time``, ``memory``, ``views``, ``what_if``, ``report``); this module
puts them together in :class:`ProfileSummary` and holds the one version.

This module imports no numpy and of sftprof only :mod:`sftprof.analysis.trace.check` and the parts' schema modules
(standard library only): the driver's end table reads summaries through it. The TypedDicts are evaluated at run
time (no postponed annotations), so that ``NotRequired`` marks the optional members for :func:`check`.
"""

import json
import os
import types
import typing
from typing import Any, Literal, NotRequired, Union

from sftprof.analysis.report.schema import Finding
from sftprof.analysis.time.schema import RankTable, SimulationPart
from sftprof.analysis.trace.check import finite_json
from sftprof.analysis.trial.schema import Problems, SnapshotEntry, TraceEntry, TrialRecord
from sftprof.analysis.what_if.schema import WhatIf, WhatIfSkipped

__all__ = ["SCHEMA_NAME", "SCHEMA_VERSION", "ProfileSummary", "SummaryReadError", "SchemaError", "read_summary",
           "from_json", "summary_json", "json_text", "check", "ms", "processed_traces", "processed_snapshots", "STRICT_ENV"]

SCHEMA_NAME = "sftprof.profile_summary"
SCHEMA_VERSION = "3.12"
STRICT_ENV = "SFTPROF_STRICT_SCHEMA"
_LEGACY_SCHEMA = "sftprof.profile_summary/1"  # release 1: the name carried the version


def ms(us: float) -> float:
    """Microseconds (trace clock) as the milliseconds a summary holds: rounded to 4 decimals."""
    return round(float(us) / 1000.0, 4)


class ProfileSummary(TrialRecord, Problems, SimulationPart):
    """``profile_summary.json`` of one trial (:func:`sftprof.analysis.summary.postprocess_trial`): what the trial's
    files say (:class:`sftprof.analysis.trial.schema.TrialRecord`: header, inputs, failure, traces or snapshots), its
    problems, and what is judged from them."""
    ranks: RankTable
    findings: list[Finding]
    what_if: list[WhatIf]
    what_if_skipped: NotRequired[list[WhatIfSkipped]]


# -- reading ----------------------------------------------------------------------------------------------------
class SummaryReadError(ValueError):
    """A file that is not a profile summary this sftprof can read; the message names the file and why."""


class SchemaError(ValueError):
    """A summary that departs from the schema (strict mode, :data:`STRICT_ENV`); the message names the members."""


def _version(data: dict[str, Any]) -> tuple[int, int]:
    """``(major, minor)`` of a summary; release 1's (``schema`` ending in ``/1``, no ``schema_version``) is 1.0."""
    v = data.get("schema_version")
    if v is None:
        return (1, 0)
    major, _, minor = str(v).partition(".")
    return int(major), int(minor or 0)


def _upgrade(data: dict[str, Any], major: int) -> dict[str, Any]:
    """A summary of release 1 or schema 2.x in this version's shape: the members added since, from what it holds
    (a 2.x trace has no ``sanity``: what was not checked is not made up)."""
    for m in data.get("memory_snapshots") or []:
        if isinstance(m, dict) and isinstance(m.get("summary"), dict):
            m["summary"].setdefault("step_peak_unknown", None)
    if major >= 2:
        return data
    data["schema"], data["schema_version"] = SCHEMA_NAME, "1.0"
    if data.get("profile_kind") == "kernel" and "missing_traces" not in data:
        # release 1 named these ranks only in a warning: "rank <r>: no trace in the log dir, though perf_tracer..."
        data["missing_traces"] = sorted(
            int(w["warning"].split(":")[0].split()[1]) for w in data.get("warnings") or []
            if isinstance(w, dict) and "no trace in the log dir, though perf_tracer.ranks=" in str(w.get("warning")))
    for t in data.get("kernel_traces") or []:
        if isinstance(t, dict) and isinstance(t.get("summary"), dict):
            t["summary"].setdefault("cpu_parts", None)
            t["summary"].setdefault("heaviest_op", None)
    return data


def from_json(data: Any, where: str) -> ProfileSummary:
    """A decoded summary, checked for its version and brought to this version's shape.

    Raises:
        SummaryReadError: not a JSON object, not a profile summary, or a newer major version (``where`` names it).
    """
    if not isinstance(data, dict):
        raise SummaryReadError(f"{where}: not a profile summary (a JSON {type(data).__name__}, expected an object)")
    if data.get("schema") not in (SCHEMA_NAME, _LEGACY_SCHEMA) and "schema" in data:
        raise SummaryReadError(f"{where}: schema {data['schema']!r} is not {SCHEMA_NAME!r}: not a profile summary")
    try:
        major, minor = _version(data)
    except ValueError:
        raise SummaryReadError(f"{where}: schema_version {data.get('schema_version')!r} is not <major>.<minor>") from None
    mine = int(SCHEMA_VERSION.split(".")[0])
    if major > mine:
        raise SummaryReadError(f"{where}: written by a newer sftprof (summary schema {major}.{minor}; this one reads "
                               f"{mine}.x and older): update sftprof, or rerun postprocess_profile.py with this one")
    return _upgrade(data, major) if major < mine else data  # type: ignore[return-value]


def read_summary(path: str | os.PathLike[str]) -> ProfileSummary:
    """``profile_summary.json`` at ``path`` (:func:`from_json`).

    Raises:
        SummaryReadError: unreadable, not JSON, or as :func:`from_json`; the message names ``path``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise SummaryReadError(f"{path}: cannot be read ({exc})") from None
    except ValueError as exc:
        raise SummaryReadError(f"{path}: not valid JSON ({exc}); rerun postprocess_profile.py for that trial") from None
    return from_json(data, str(path))


def processed_traces(summary: TrialRecord) -> list[TraceEntry]:
    """The traces summarised without error (each has ``summary``)."""
    return [t for t in summary.get("kernel_traces") or [] if "summary" in t and "error" not in t]


def processed_snapshots(summary: TrialRecord) -> list[SnapshotEntry]:
    """The snapshots analysed without error (each has ``summary``)."""
    return [m for m in summary.get("memory_snapshots") or [] if "summary" in m and "error" not in m]


# -- writing ----------------------------------------------------------------------------------------------------
def json_text(data: Any) -> str:
    """The layout of ``profile_summary.json``: keys sorted, one member a line (indent 1), a final newline.

    Raises:
        ValueError: a non-finite number in ``data``.
    """
    return json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n"


def summary_json(summary: ProfileSummary) -> str:
    """The JSON text of ``profile_summary.json``: strict JSON (non-finite numbers as null), keys sorted, one
    member a line (indent 1), a final newline.

    Raises:
        SchemaError: under :data:`STRICT_ENV` only, the summary departs from :class:`ProfileSummary`.
    """
    text = json_text(finite_json(summary)[0])
    if os.environ.get(STRICT_ENV) == "1":
        problems = check(json.loads(text))
        if problems:
            raise SchemaError("profile summary departs from sftprof/analysis/schema.py: " + "; ".join(problems[:20]))
    return text


# -- checking ---------------------------------------------------------------------------------------------------
def check(value: Any, tp: Any = ProfileSummary, where: str = "summary") -> list[str]:
    """Where ``value`` (decoded JSON) departs from the type ``tp``: missing or unknown members of a TypedDict,
    values of another type (an int is a float; a bool is not a number); empty when it conforms."""
    if tp is Any:
        return []
    origin = typing.get_origin(tp)
    if origin is NotRequired:
        return check(value, typing.get_args(tp)[0], where)
    if origin in (Union, types.UnionType):
        found = [check(value, t, where) for t in typing.get_args(tp)]
        return [] if any(not f for f in found) else min(found, key=len)
    if origin is Literal:
        return [] if value in typing.get_args(tp) else [f"{where}: {value!r} is not one of {typing.get_args(tp)}"]
    if tp is type(None):
        return [] if value is None else [f"{where}: expected null, got {type(value).__name__}"]
    if isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__"):
        if not isinstance(value, dict):
            return [f"{where}: expected an object ({tp.__name__}), got {type(value).__name__}"]
        hints = typing.get_type_hints(tp, include_extras=True)
        out = [f"{where}.{k}: missing" for k in sorted(tp.__required_keys__) if k not in value]
        out += [f"{where}.{k}: not in {tp.__name__}" for k in sorted(value) if k not in hints]
        for k, v in value.items():
            if k in hints:
                out += check(v, hints[k], f"{where}.{k}")
        return out
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        (item,) = typing.get_args(tp) or (Any,)
        return [p for i, v in enumerate(value) for p in check(v, item, f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        _, item = typing.get_args(tp) or (str, Any)
        return [p for k, v in value.items() for p in check(v, item, f"{where}.{k}")]
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    return [] if ok else [f"{where}: expected {tp.__name__}, got {type(value).__name__}"]
