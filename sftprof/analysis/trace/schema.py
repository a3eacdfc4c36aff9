"""Part of ``profile_summary.json``'s schema (:mod:`sftprof.analysis.schema`): the record of one trace: its sanity
(``kernel_traces[i].summary.sanity``), invalid events and identity.

Declarations only, evaluated at run time (no postponed annotations: :func:`sftprof.analysis.schema.check` reads
``NotRequired`` from them); standard library only.
"""
from typing import Optional, TypedDict


class InvalidEvents(TypedDict):
    total: int
    valid_events: int
    by_kind: dict[str, int]
    examples: list[str]


class SanityCount(TypedDict):
    """One kind of fault of a trace's record (:mod:`sftprof.analysis.trace.sanity`): how many, among how many
    (``of``: the population it is counted among), up to three examples."""
    count: int
    of: int
    examples: list[str]


class RecordingEdges(TypedDict):
    """Not faults: activities that ran before their stream's first activity whose launch is in the trace (launched
    before the recording began), and kernel launches after the last launch whose kernel is in it (ran after it
    stopped)."""
    activities_before_first_launch: int
    launches_after_last_activity: int


class TraceSanity(TypedDict):
    """What is wrong with a trace's record, per kind, and what was done about it (module docstring of
    :mod:`sftprof.analysis.trace.sanity`)."""
    duplicates: SanityCount  # events recorded twice: the copies left out of every figure
    duplicates_by_category: dict[str, int]
    overlapping: SanityCount  # GPU activities running past the next one's start on their stream: cut there
    untimed: SanityCount  # GPU activities with ts or dur 0: left out (also in invalid_events)
    launches_without_activity: SanityCount  # kernel launches whose kernel is not in the trace
    activities_without_launch: SanityCount  # GPU activities whose launch call is not in the trace
    other_steps: SanityCount  # activities and CPU ops of other ProfilerStep#M slices: left out; examples name them
    recording_edges: RecordingEdges


class Identity(TypedDict):
    """What the trace says of itself: the steps of its ``ProfilerStep#N`` slices, its header's rank."""
    profiler_steps: list[int]
    recorded_rank: Optional[int]
