"""Part of ``profile_summary.json``'s schema (:mod:`sftprof.analysis.schema`): the all-ranks view (``merged_view``).

Declarations only, evaluated at run time (no postponed annotations: :func:`sftprof.analysis.schema.check` reads
``NotRequired`` from them); standard library only.
"""
from typing import NotRequired, TypedDict

from sftprof.analysis.time.schema import ClockOffset


class ClockShift(TypedDict):
    """How one rank's clock moves onto the reference rank's (:func:`sftprof.analysis.views.merged.clock_shifts`)."""
    shift_us: float  # added to the rank's timestamps
    aligned_by: str  # "collective ends", "reference" or "trace clock"
    path: NotRequired[list[ClockOffset]]  # the offsets chained from the reference rank (aligned by collectives)


class MergedRank(ClockShift):
    """How one rank's clock was aligned in the all-ranks view."""
    rank: int


class MergedView(TypedDict):
    """The all-ranks timeline (:func:`sftprof.analysis.views.merged.merge_trial`): its files (relative to the run dir)
    and each rank's alignment, or the error that kept it from being written."""
    files: NotRequired[list[str]]
    ranks: NotRequired[list[MergedRank]]
    error: NotRequired[str]
