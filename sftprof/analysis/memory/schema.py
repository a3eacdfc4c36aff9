"""Part of ``profile_summary.json``'s schema (:mod:`sftprof.analysis.schema`): one snapshot's summary
(``memory_snapshots[i].summary``), its estimate, and an out-of-memory trial's triage (``oom``).

Declarations only, evaluated at run time (no postponed annotations: :func:`sftprof.analysis.schema.check` reads
``NotRequired`` from them); standard library only.
"""
from typing import Any, NotRequired, Optional, TypedDict


class SiteRow(TypedDict):
    site: str
    bytes: int
    gib: float
    blocks: int
    share_pct: float


class AllocationRow(TypedDict):
    site: str
    bytes: int
    gib: float


class CategoryAtPeak(TypedDict):
    category: str
    label: str
    bytes: int
    gib: float
    blocks: Optional[int]
    share_pct: Optional[float]


class SpikeRow(TypedDict):
    site: str
    bytes: int
    gib: float
    lifetime_ms: float


class MemoryStepWindow(TypedDict):
    source: str
    start_ms: Optional[float]  # from the recorded window's first event
    end_ms: Optional[float]


class History(TypedDict):
    max_entries: Optional[int]
    entries: int
    truncated: Optional[bool]
    window_start_us: NotRequired[float]  # unix us
    message: NotRequired[str]


class WithoutLargestBlock(TypedDict):
    """The peak had the largest block alive at it never been allocated (the rest as recorded): bytes, GiB, ms."""
    block_bytes: int
    block_gib: float
    block_site: str
    peak_allocated_bytes: int
    peak_allocated_gib: float
    peak_time_ms: Optional[float]
    peak_phase: Optional[str]


class SnapshotDevice(TypedDict):
    """One device of a snapshot, at its dump (:func:`sftprof.analysis.memory.snapshot.analyze_snapshot`)."""
    device: int
    reserved_bytes: int
    allocated_bytes: int
    trace_entries: int


class MemorySummary(TypedDict):
    """One snapshot (:func:`sftprof.analysis.memory.snapshot.analyze_snapshot`); times in ms from the recorded
    window's first event (None: no history, or events without times); the headline peak is the profiled step's
    (``peak_scope``) when phases were recorded and the history can give it, else ``step_peak_unknown`` says why."""
    device: int
    devices: NotRequired[list[SnapshotDevice]]  # 3.4; the summarised device's first
    device_from: NotRequired[Optional[str]]  # 3.4; "phases sidecar" | "local rank (...)" | None (most reserved)
    trace_entries: int
    window_ms: Optional[float]
    window_start_us: Optional[float]
    peak_scope: str  # "profiled_step" | "recorded_window" | "dump_time" (no history: the level at dump time)
    step_peak_unknown: Optional[str]
    step_peak_lower_bound: NotRequired[Optional[str]]  # 3.4
    step_window: Optional[MemoryStepWindow]
    peak_allocated_bytes: int
    peak_allocated_gib: float
    peak_reserved_bytes: int
    peak_reserved_gib: float
    reserved_at_peak_bytes: int
    reserved_minus_allocated_at_peak_bytes: int
    reserved_minus_allocated_at_peak_gib: float
    peak_time_ms: Optional[float]
    peak_phase: Optional[str]
    live_at_peak_bytes: int
    window_peak_allocated_bytes: int
    window_peak_allocated_gib: float
    window_peak_reserved_bytes: int
    window_peak_reserved_gib: float
    window_peak_time_ms: Optional[float]
    window_peak_phase: Optional[str]
    window_peak_position: Optional[str]  # "in_step" | "before_step" | "after_step"
    end_allocated_bytes: int
    end_reserved_bytes: int
    top_sites: list[SiteRow]
    top_allocations: list[AllocationRow]
    without_largest_block: NotRequired[Optional[WithoutLargestBlock]]  # 3.1
    categories_at_peak: list[CategoryAtPeak]
    transient_spikes: list[SpikeRow]
    window_top_sites: list[SiteRow]
    history: History


class EstimateRow(TypedDict):
    category: str
    bytes: int
    gib: float
    formula: str
    step_copy_bytes: NotRequired[int]
    logits_bytes: NotRequired[int]


class Estimate(TypedDict):
    """Theoretical memory of one rank (:func:`sftprof.analysis.memory.estimate.estimate_memory`)."""
    params_dense: int
    params_expert: int
    bytes_per_param: dict[str, Any]
    rows: list[EstimateRow]
    assumptions: list[str]


class EstimateCheckRow(TypedDict):
    """Measured against estimated bytes of one category (:func:`sftprof.analysis.memory.estimate.explain_estimate`)."""
    category: str
    measured_bytes: int
    estimated_bytes: int
    difference_bytes: int  # measured - estimated


class AllocatorSettings(TypedDict):
    """The caching allocator's settings a snapshot records (``allocator_settings``; None: the snapshot has none)."""
    alloc_conf: Optional[str]  # PYTORCH_CUDA_ALLOC_CONF as the trial's processes had it
    expandable_segments: Optional[bool]


class OomCategory(TypedDict):
    category: str  # a key of sftprof.analysis.memory.categories.MEMORY_CATEGORIES
    bytes: int


class OomPrediction(TypedDict):
    """The predicted peak of the failing rank (:func:`sftprof.analysis.memory.estimate.predict_peak`) and of the
    phase the failure lies in (``failing_phase``: None when the region and site name none of its phases)."""
    phase: str
    peak_bytes: int
    rows: list[OomCategory]
    failing_phase: Optional[str]
    failing_phase_bytes: Optional[int]


class OomFit(TypedDict):
    """A change that fits (:func:`sftprof.analysis.memory.fit.fitting_changes`): config keys and ``env.<NAME>``."""
    settings: dict[str, Any]
    peak_bytes: int
    need_bytes: int


class OomTriage(TypedDict):
    """Why a trial ran out of CUDA memory (:func:`sftprof.analysis.memory.oom.oom_triage`); bytes, None where unknown."""
    rank: int
    snapshot: str  # the file in LOG_DIR/memory_snapshots/oom/
    errors: list[str]
    requested_bytes: Optional[int]
    capacity_bytes: Optional[int]
    free_bytes: Optional[int]
    allocated_bytes: int
    reserved_unallocated_bytes: Optional[int]
    outside_pytorch_bytes: Optional[int]
    phase: Optional[str]  # the innermost open sftprof/* region
    site: Optional[str]  # the failing allocation's site
    history: bool  # the allocator history was on (blocks carry stacks)
    live: list[OomCategory]
    other_ranks: list[int]  # further ranks that left an out-of-memory snapshot
    predicted: Optional[OomPrediction]
    fits: list[OomFit]  # smallest first
    prediction_error: Optional[str]
