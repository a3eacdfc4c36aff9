"""``profile_summary.{json,md}`` in a run dir: written atomically, an earlier one that differs kept as
``profile_summary.prev1.{json,md}`` (one previous copy: a later rerun replaces it, so copies do not pile up), one that
is the same left as it is (:func:`write_summary`).

The JSON text is :func:`sftprof.analysis.schema.summary_json`'s, the Markdown
:func:`sftprof.analysis.report.render.render_markdown`'s.
"""
from __future__ import annotations

import json
import os

from sftprof.analysis import schema
from sftprof.analysis.report.render import render_markdown
from sftprof.analysis.trial.schema import FileWarning
from sftprof.artifacts import SUMMARY_JSON, SUMMARY_MD, keep_previous
from sftprof.atomic import atomic_path, put_text

__all__ = ["write_summary", "summary_left_unchanged"]

_KEPT_NOTE = "this run dir had a summary from an earlier postprocess: kept as "


def _split_kept_note(text: str | None) -> tuple[str | None, list[FileWarning]]:
    """An earlier summary's JSON text (None: unreadable) re-rendered without the warning :func:`write_summary` added about
    the summary before it (None if the text is not a JSON object), and that warning (so a later rerun on the same
    inputs is recognised as the same and keeps it)."""
    if text is None:
        return None, []
    try:
        earlier = json.loads(text)
        warnings = earlier.get("warnings") or []
        notes = [w for w in warnings if str(w.get("warning", "")).startswith(_KEPT_NOTE)]
        earlier["warnings"] = [w for w in warnings if w not in notes]
        return schema.json_text(earlier), notes
    except (ValueError, AttributeError, TypeError):
        return None, []


_UNCHANGED_NOTE = "the summary is unchanged since the last postprocess (same inputs), left as it is"


def _unchanged_note(notes: list[FileWarning]) -> FileWarning:
    """The warning of a rerun that left a summary as it was (same inputs); where that summary noted that an
    earlier postprocess kept the one before it (``notes``), it names that file: nothing is kept now, so it does not
    say 'kept'."""
    kept = "".join(f"; {n['warning'][len(_KEPT_NOTE):]} holds the one before it" for n in notes)
    return {"file": SUMMARY_JSON, "warning": _UNCHANGED_NOTE + kept}


def summary_left_unchanged(summary: schema.ProfileSummary) -> bool:
    """Whether :func:`sftprof.analysis.summary.postprocess_trial` left the run dir's summary as it was (a rerun on
    the same inputs: the summary's warnings say so) rather than writing it."""
    return any(w.get("file") == SUMMARY_JSON and str(w.get("warning", "")).startswith(_UNCHANGED_NOTE)
               for w in summary.get("warnings") or [])


def _read_text(path: str) -> str | None:
    """The text of ``path`` (UTF-8, undecodable bytes replaced), None when it is not a readable file."""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            return f.read()
    except OSError:
        return None


def write_summary(summary: schema.ProfileSummary, run_dir: str) -> None:
    """Write ``profile_summary.json`` (:func:`sftprof.analysis.schema.summary_json`) and ``profile_summary.md`` to
    ``run_dir``, each atomically (:mod:`sftprof.atomic`: both are written in full under temporary names before either
    replaces anything).

    A summary already there from an earlier postprocess is left as it is, file for file, when the new one is the
    same (a rerun on the same inputs: both files would read the same, apart from that summary's note that an
    earlier summary was kept as ``.prev<N>``); the returned summary's warnings then say that it is unchanged (and
    where the one before it is: :func:`summary_left_unchanged`). Else the earlier one is kept as
    ``profile_summary.prev1.{json,md}``, replacing an older copy there (one previous copy: the latest summary written
    is never lost, older ones are not kept), and the new summary says so in its warnings.

    Raises:
        WriteError: a file cannot be written (a full disk: the message names it and the free space); the earlier
            summary is then left as it was, under its own name.
    """
    def render(s: schema.ProfileSummary) -> tuple[str, str]:
        return schema.summary_json(s), render_markdown(s)

    text, md = render(summary)
    old, old_md = os.path.join(run_dir, SUMMARY_JSON), os.path.join(run_dir, SUMMARY_MD)
    earlier = os.path.isfile(old)
    if earlier:
        text_before = _read_text(old)  # None when unreadable: kept as .prev<N>, as a summary that differs
        stripped, notes = _split_kept_note(text_before) if text_before != text else (text, [])
        if stripped == text and _read_text(old_md) == render({**summary,
                                                               "warnings": summary["warnings"] + notes})[1]:
            summary["warnings"].append(_unchanged_note(notes))  # the same inputs as the postprocess that wrote it
            return
        summary["warnings"].append({"file": SUMMARY_JSON,
                                    "warning": f"{_KEPT_NOTE}{SUMMARY_JSON[: -len('.json')]}.prev1.json"})
        text, md = render(summary)
    with atomic_path(old) as tmp_json, atomic_path(old_md) as tmp_md:
        put_text(tmp_json, text)
        put_text(tmp_md, md)
        if earlier:
            keep_previous([old, old_md], one_copy=True)
