"""The verdicts of a comparison (:mod:`sftprof.analysis.compare.runs`): every row of its delta tables as it is made, the
section that opens the report with the rows that have a verdict, and the gate of ``compare --fail-on``.

While :func:`collecting` runs, :func:`record` keeps each table row (its group, table, name and cells) and says
whether the table shows it: a row of one sample a side has no verdict, one with no sample in either run no figure,
and unless ``all_rows`` they are left out of their table, which counts and names them in one line each
(:func:`left_out_line`). :func:`verdict_section` lists the
rows with a verdict (a 95 % rank test that excludes 0, or an exact memory difference); :func:`regressions` says which
rows of the gate's metrics (:data:`GATE_METRICS`) got a worse verdict.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Optional

from sftprof.analysis.compare import stats
from sftprof.analysis.report.markdown import table

__all__ = ["Row", "Collector", "collecting", "record", "left_out_line", "verdict_section", "regressions",
           "GATE_METRICS", "STEP_TIME_ROW", "parse_metrics"]

STEP_TIME_ROW = "step time s (slowest rank)"  # the pooled step time (compare's Step time section)
# gate metric -> (the names of its rows, a row name that starts with one followed by " (" counts too; its worse verdicts)
GATE_METRICS = {
    "step_time": ((STEP_TIME_ROW,), ("slower",)),
    "peak_allocated": (("peak allocated", "peak allocated GiB"), ("higher", "higher (exact)")),
    "peak_reserved": (("peak reserved", "peak reserved GiB"), ("higher", "higher (exact)")),
}
_BETTER_OR_WORSE = ("slower", "faster", "higher", "lower", "higher (exact)", "lower (exact)")
_SHOWN_NAMES = 4  # rows named in the line of the rows left out of one table


@dataclass(frozen=True)
class Row:
    """One row of a delta table: ``cells`` are A, B, Δ (B−A), Δ %, 95 % CI of Δ, samples A/B and the verdict."""
    group: str
    table: str
    name: str
    cells: tuple[str, ...]

    @property
    def verdict(self) -> str:
        return self.cells[-1]


@dataclass
class Collector:
    """The rows of one comparison; ``group``: the report section the rows being made belong to."""
    all_rows: bool = False
    group: str = ""
    rows: list[Row] = field(default_factory=list)


_CURRENT: ContextVar[Optional[Collector]] = ContextVar("sftprof_compare_rows", default=None)


@contextmanager
def collecting(all_rows: bool = False) -> Iterator[Collector]:
    """Collect the rows :func:`record` is given while the block runs."""
    collector = Collector(all_rows)
    token = _CURRENT.set(collector)
    try:
        yield collector
    finally:
        _CURRENT.reset(token)


ONE_SAMPLE_LEFT_OUT = "of one sample a side (no verdict)"
NO_FIGURE_LEFT_OUT = "without the figure in either run"


def record(table_title: str, name: str, cells: list[str]) -> str | None:
    """Keep a row (when collecting) and say why its table leaves it out (:data:`ONE_SAMPLE_LEFT_OUT`,
    :data:`NO_FIGURE_LEFT_OUT`: samples 0/0, e.g. memory on CPU), None when the table shows it (always with
    ``all_rows``, or when nothing is collecting)."""
    c = _CURRENT.get()
    if c is None:
        return None
    c.rows.append(Row(c.group, table_title, name, tuple(cells)))
    if c.all_rows:
        return None
    return ONE_SAMPLE_LEFT_OUT if cells[-1] == stats.ONE_SAMPLE else NO_FIGURE_LEFT_OUT if cells[-2] == "0/0" else None


def left_out_line(left_out: list[tuple[str, str]]) -> list[str]:
    """The lines that stand for a table's rows left out (``(name, why)`` of :func:`record`); none when none are."""
    out = []
    for why in (ONE_SAMPLE_LEFT_OUT, NO_FIGURE_LEFT_OUT):
        names = [n for n, w in left_out if w == why]
        if names:
            shown = ", ".join(names[:_SHOWN_NAMES]) + (", ..." if len(names) > _SHOWN_NAMES else "")
            out += [f"{len(names)} row(s) {why} not shown ({shown}): `compare --all-rows` shows them"
                    + ("; more `PROFILE_STEPS` give repeats." if why == ONE_SAMPLE_LEFT_OUT else "."), ""]
    return out


def verdict_section(rows: list[Row]) -> list[str]:
    """The report's answer: a table of the rows with a verdict (the interval excludes 0, or an exact memory
    difference), in report order, and a line counting the others by verdict."""
    decided = [r for r in rows if r.verdict in _BETTER_OR_WORSE]
    out = ["## Verdicts", ""]
    if decided:
        out += [f"{len(decided)} row(s) with a verdict (B against A; the tables below hold the figures):", "",
                table(["where", "row", "A", "B", "Δ (B−A)", "Δ %", "95 % CI of Δ", "samples A/B", "verdict"],
                      [[r.group + (f", {r.table}" if r.table not in ("metric", "rank metric") else ""),
                        r.name.replace("|", "/"),
                        *r.cells] for r in decided], cell=str)]
    else:
        out += ["No row shows a difference (a better or worse verdict).", ""]
    others: dict[str, int] = {}
    for r in rows:
        if r.verdict not in _BETTER_OR_WORSE:
            others[r.verdict] = others.get(r.verdict, 0) + 1
    if others:
        out += ["Other rows: " + ", ".join(f"{n} `{v}`" + (" (a side without the figure)" if v == "–" else "")
                                           for v, n in others.items()) + ".", ""]
    return out


def parse_metrics(text: str) -> list[str]:
    """``step_time,peak_allocated`` -> the gate's metrics.

    Raises:
        ValueError: an empty list or a name not in :data:`GATE_METRICS` (the message names the accepted ones).
    """
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in GATE_METRICS]
    if not names or bad:
        raise ValueError(f"--fail-on {text!r}: accepted: a comma-separated list of {', '.join(GATE_METRICS)}")
    return names


def _is_metric_row(metric: str, name: str) -> bool:
    return any(name == n or name.startswith(n + " (") for n in GATE_METRICS[metric][0])


def regressions(rows: list[Row], metrics: list[str]) -> tuple[list[str], list[str]]:
    """``(regressions, not judged)``: a line per row of a chosen metric whose verdict is worse (B slower, or its
    peak higher), and a line per chosen metric that no row judged (no row, or none with a verdict: no or too few
    samples), which ``compare --fail-on`` does not let pass."""
    worse, unjudged = [], []
    for metric in metrics:
        mine = [r for r in rows if _is_metric_row(metric, r.name)]
        for r in mine:
            if r.verdict in GATE_METRICS[metric][1]:
                worse.append(f"{metric}: {r.group}, {r.name}: {r.verdict}, Δ {r.cells[2]} ({r.cells[3]}), 95 % CI "
                             f"{r.cells[4]}, samples {r.cells[5]}")
        if not any(r.verdict in _BETTER_OR_WORSE + (stats.NO_DIFFERENCE, "equal (exact)") for r in mine):
            why = "; ".join(f"{r.name}: {r.verdict if r.verdict != '–' else 'no figure'}, samples {r.cells[5]}"
                            for r in mine) or "no row of it in the report"
            unjudged.append(f"{metric}: not judged ({why})")
    return worse, unjudged
