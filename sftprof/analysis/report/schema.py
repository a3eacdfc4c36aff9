"""Part of ``profile_summary.json``'s schema (:mod:`sftprof.analysis.schema`): a finding (``findings[i]``: the top of
``profile_summary.md``).

Declarations only, evaluated at run time (no postponed annotations: :func:`sftprof.analysis.schema.check` reads
``NotRequired`` from them); standard library only.
"""
from typing import NotRequired, Optional, TypedDict


class Finding(TypedDict):
    """A lever (:mod:`sftprof.analysis.report.findings`): ``weight`` is its share of the step's time or peak memory;
    ``caveats``: what is wrong with the record its figures come from (faults of the rank's trace, a snapshot whose
    step peak is unknown), and what was done about it."""
    text: str
    section: str  # the Markdown anchor it points to
    weight: float
    key: str
    rank: NotRequired[Optional[int]]
    caveats: NotRequired[list[str]]
    next_step: NotRequired[str]  # "try <setting>: ..." or "none: <why>" (sftprof.analysis.what_if.next_steps)
