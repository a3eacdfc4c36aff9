"""Markdown table helpers of the summaries (:mod:`sftprof.analysis.report.render`) and the comparison
(:mod:`sftprof.analysis.compare.runs`): numbers are printed as the summary holds them (floats with 3 decimals)."""
from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["fmt", "table", "short", "with_rank"]


# -- shared table helpers ------------------------------------------------------------------------------------
def fmt(v: Any, nd: int = 3) -> str:
    """A table cell: ``–`` for None, floats with ``nd`` decimals, anything else as ``str``."""
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _cell(x: Any) -> str:
    return fmt(x).replace("|", "\\|")


def table(headers: list[str], rows: Iterable[list[Any]], cell: Callable[[Any], str] = _cell) -> str:
    """A Markdown table (ending in a newline); each value goes through ``cell`` (default: :func:`fmt`, ``|`` escaped)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def short(name: str, n: int) -> str:
    """``name`` cut to ``n`` characters (the last one ``…``) when longer."""
    return name if len(name) <= n else name[: n - 1] + "…"


def with_rank(value: Any, rank: Any, prefix: str = "r") -> str:
    """``"45.485 (r0)"``: a value and where it was found (``prefix`` ``"L"``: a layer); ``–`` for None."""
    return "–" if value is None else f"{fmt(value)} ({prefix}{rank})"
