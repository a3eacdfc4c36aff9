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
trial's ``interrupted``.

:func:`check` lists where a summary departs from the schema. With the environment variable
``SFTPROF_STRICT_SCHEMA=1`` (the test suite sets it) :func:`summary_json` raises :class:`SchemaError` on any
departure, so every summary the tests write is checked; without it nothing is checked at write time (a
postprocess never fails on its own summary's shape).

Above 500 lines for a reason: it is declarations, one TypedDict per JSON object of a summary, and split across
files the shape of one summary would have to be chased through them.

This module imports no numpy and of sftprof only :mod:`sftprof.analysis.trace.check` (standard library only): the
driver's end table reads summaries through it. The TypedDicts are evaluated at run time (no postponed
annotations), so that ``NotRequired`` marks the optional members for :func:`check`.
"""

import json
import os
import types
import typing
from typing import Any, Literal, NotRequired, Optional, TypedDict, Union

from sftprof.analysis.trace.check import finite_json

__all__ = ["SCHEMA_NAME", "SCHEMA_VERSION", "ProfileSummary", "KernelSummary", "MemorySummary", "TraceEntry",
           "SnapshotEntry", "WhatIf", "WhatIfSetting", "WhatIfEffect", "WhatIfSkipped", "TriedWhatIf", "Parts",
           "PartRow", "SummaryReadError", "SchemaError", "read_summary", "from_json", "summary_json", "json_text",
           "check", "ms", "processed_traces", "processed_snapshots", "STRICT_ENV"]

SCHEMA_NAME = "sftprof.profile_summary"
SCHEMA_VERSION = "3.4"
STRICT_ENV = "SFTPROF_STRICT_SCHEMA"
_LEGACY_SCHEMA = "sftprof.profile_summary/1"  # release 1: the name carried the version


def ms(us: float) -> float:
    """Microseconds (trace clock) as the milliseconds a summary holds: rounded to 4 decimals."""
    return round(float(us) / 1000.0, 4)


# -- trial-level members -------------------------------------------------------------------------------------
class Completion(TypedDict):
    """The trial's completion record (``stats.jsonl``), as far as the summary repeats it."""
    error: Optional[str]
    steps_done: Optional[int]
    world_size: Optional[int]
    backend: Optional[str]
    device: Optional[str]  # "cuda" | "cpu"


class Paths(TypedDict):
    """Absolute paths of the inputs and the run dir (None: not given)."""
    log_dir: str
    run_dir: str
    trainer_log: Optional[str]
    nvidia_smi_csv: Optional[str]


class RankStats(TypedDict):
    """One rank's figures of the profiled step's record."""
    step_time_s: Optional[float]
    mem_peak_allocated_gb: Optional[float]
    mem_peak_reserved_gb: Optional[float]


class MoeRouting(TypedDict):
    """A step's routing (:func:`sftprof.analysis.trial.inputs.moe_load`): busiest over mean (1.0 = balanced)."""
    max_over_mean: Optional[float]
    worst_layer: Optional[int]
    ep_max_over_mean: Optional[float]
    ep_worst_layer: Optional[int]
    top_share: Optional[float]  # the busiest expert's share of the step's tokens, 0-1
    top_share_layer: Optional[int]
    invalid: int  # MoE layers left out: a value that cannot be true


class GpuOthers(TypedDict):
    """A rank whose GPU held processes not of the trial after a step (:mod:`sftprof.capture.gpu_sharing`)."""
    rank: int
    pids: list[int]
    mib: Optional[float]  # the GPU memory nvidia-smi gives them; None: unknown ([N/A])


class StepRow(TypedDict):
    """One step of ``stats.jsonl``; memory peaks are the max over ranks (``*_rank`` holds it)."""
    step: int
    step_time_s: Optional[float]
    tokens: Optional[int]
    tokens_per_s: Optional[float]
    tflops_per_gpu: Optional[float]
    mfu: Optional[float]  # 0-1
    recompute_tflops_per_gpu: Optional[float]
    profiled: Optional[bool]
    mem_peak_allocated_gb: Optional[float]
    mem_peak_allocated_rank: Optional[int]
    mem_peak_reserved_gb: Optional[float]
    mem_peak_reserved_rank: Optional[int]
    n_ranks: int  # ranks the peaks are taken over (1: rank 0's alone)
    moe: Optional[MoeRouting]
    gpu_others: list[GpuOthers]


class Stats(TypedDict):
    """``stats.jsonl`` read by :func:`sftprof.analysis.trial.inputs.read_stats`: the steps, and the profiled step's
    figures at top level (None when absent)."""
    available: bool
    bad_lines: int
    steps: list[StepRow]
    profile_step_record: Optional[dict[str, Any]]  # the raw record: sftprof.artifacts.StepRecord
    per_rank: dict[str, RankStats]  # rank (as text) -> figures
    complete: Optional[dict[str, Any]]  # the raw record: sftprof.artifacts.CompletionRecord
    step_time_s: Optional[float]
    tokens: Optional[int]
    tokens_per_s: Optional[float]
    tflops_per_gpu: Optional[float]
    mfu: Optional[float]
    mem_peak_allocated_gb: Optional[float]
    mem_peak_allocated_rank: Optional[int]
    mem_peak_reserved_gb: Optional[float]
    mem_peak_reserved_rank: Optional[int]
    n_ranks: Optional[int]
    max_mem_peak_allocated_gb: Optional[float]
    max_mem_peak_allocated_rank: Optional[int]
    max_mem_peak_reserved_gb: Optional[float]
    max_mem_peak_reserved_rank: Optional[int]


class SmiGpu(TypedDict):
    index: int
    peak_memory_used_mib: Optional[float]
    memory_total_mib: Optional[float]
    peak_utilization_pct: Optional[float]
    mean_utilization_pct: Optional[float]


class SmiWindowGpu(TypedDict):
    index: int
    samples: int
    mean_utilization_pct: Optional[float]
    peak_utilization_pct: Optional[float]
    peak_memory_used_mib: Optional[float]


class SmiWindow(TypedDict):
    """The nvidia-smi samples inside the profiled step's window (unix seconds)."""
    window_unix_s: list[float]
    gpus: list[SmiWindowGpu]


class NvidiaSmi(TypedDict):
    available: bool
    samples: int
    gpus: list[SmiGpu]
    peak_memory_used_mib: Optional[float]
    peak_utilization_pct: Optional[float]
    profiled_step: NotRequired[SmiWindow]


class FileError(TypedDict):
    file: str
    error: str


class FileWarning(TypedDict):
    file: str
    warning: str


class SkippedFile(TypedDict):
    file: str
    reason: str


class Counts(TypedDict):
    """Files this postprocess processed and wrote (``plots``: PNGs it wrote)."""
    traces: int
    traces_ok: int
    views: int
    snapshots: int
    plots: int
    errors: int
    skipped: int


class FailedRank(TypedDict):
    rank: int
    exitcode: Optional[int]
    signal: Optional[str]
    how: str


class Failure(TypedDict):
    """The trial's first failure (:func:`sftprof.analysis.trial.failure.first_failure`)."""
    node: Optional[int]
    ranks: Optional[list[int]]
    rank: Optional[int]
    exitcode: Optional[int]
    signal: Optional[str]
    how: str
    host: Optional[str]
    error_file: Optional[str]
    traceback: str
    log_tail: list[str]
    others: list[FailedRank]
    nodes: list[dict[str, Any]]  # further failed nodes (sftprof.analysis.trial.failure.node_failures)
    torchrun: NotRequired[bool]


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


class WhatIfSetting(TypedDict):
    """One setting a what-if changes: a key of the trial's config (``config``: a ``key=value`` argument of the trial,
    ``value`` as the config holds it) or an environment variable of the trial's processes (``env``, ``value`` text).
    ``current`` is the trial's own value (None: unset, or not known from its files)."""
    kind: Literal["config", "env"]
    key: str
    value: Any
    current: Any


class WhatIfEffect(TypedDict):
    """A predicted change of one measured figure (:data:`sftprof.analysis.what_if.changes.METRICS`): ``value`` is B - A in
    ``unit`` (negative: less), ``baseline`` the trial's measured figure it changes (same unit)."""
    metric: str
    unit: str  # "ms" | "GiB" | "pct"
    value: float
    baseline: Optional[float]


class WhatIf(TypedDict):
    """A change to try (:mod:`sftprof.analysis.what_if.changes`): its settings, the predicted effect on ``rank`` (None: the
    trial as a whole), the assumption behind the prediction, and ``weight`` (the effect's share of its baseline) that
    orders the what-ifs the driver tries (``TRY_WHAT_IFS``). ``text``: the same in words."""
    key: str  # the lever, the same on every rank (sftprof.analysis.what_if.changes.LABELS)
    label: str
    text: str
    assumption: str
    rank: Optional[int]
    settings: list[WhatIfSetting]
    effect: WhatIfEffect
    weight: float


class WhatIfSkipped(TypedDict):
    """A what-if whose figure called for it but that is not proposed, and why (the trial already has the setting,
    Transformer Engine is absent, the backend has no such setting, ...)."""
    key: str
    label: str
    rank: Optional[int]
    reason: str


class TriedWhatIf(TypedDict):
    """What makes a trial a what-if trial (``RUN_DIR/what_if.json``, written by the driver): the trial it varies
    (same kind and step) and the what-if of that trial's summary it tries."""
    source_trial: str
    source_run_dir: str
    what_if: WhatIf


class ProjectionRow(TypedDict):
    """One collective of a projected step (:func:`sftprof.analysis.time.projection.project`): all its calls."""
    group: str  # the process group (tp, cp, dp_cp, ep, etp, edp, pp, dp)
    collective: str
    interconnect: str  # nvlink | infiniband
    calls: int
    mib_per_call: float  # the buffer of one call on the rank
    gbps: float  # the rate used (1e9 B/s)
    ms: float
    exposed_ms: float  # not hidden behind its overlap window
    overlap: str  # none | forward | backward | cp_attention


class ProjectionMemory(TypedDict):
    measured_peak_gib: Optional[float]  # None on CPU
    nccl_buffers_gib: float  # estimated, never measured
    projected_peak_gib: Optional[float]


class Projection(TypedDict):
    """The projected step of a simulated rank: measured compute + computed communication (ms)."""
    rank: int
    world_size: int
    rows: list[ProjectionRow]
    compute_ms: float
    communication_ms: float
    exposed_ms: float
    projected_step_ms: float
    serial_step_ms: float  # every collective exposed: the upper bound
    mfu: Optional[float]  # of the projected step; None without a GPU peak
    memory: ProjectionMemory
    assumptions: list[str]


class Simulation(TypedDict):
    """A simulated rank's trial (``actor.simulate.rank``): the one rank that ran, what was not run, what was assumed."""
    rank: int
    world_size: int
    not_run: str
    assumed: str
    projection: Optional[Projection]
    projection_error: Optional[str]  # why there is no projection


# -- one kernel trace -------------------------------------------------------------------------------------------
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


class StepWindow(TypedDict):
    """The step window (:func:`sftprof.analysis.time.gpu_activity.step_window`): the profiled step's (its
    ``ProfilerStep#N`` slice, and the ``sftprof/step`` region inside it); None times: no window."""
    source: str  # "sftprof/step" | "ProfilerStep" | "gpu_activity_span" | "trace_span" | "none"
    start_us: Optional[float]
    end_us: Optional[float]
    wall_ms: Optional[float]
    unix_start_s: Optional[float]
    unix_end_s: Optional[float]


class GpuTime(TypedDict):
    activities: int  # kernels, copies, fills in the trace (0: a CPU run)
    total_ms: float
    busy_ms: float
    busy_share_pct: Optional[float]
    idle_share_pct: Optional[float]


class KernelRow(TypedDict):
    name: str
    calls: int
    total_ms: float
    share_pct: float


class CpuOpRow(TypedDict):
    name: str
    calls: int
    inclusive_ms: float


class CategoryRow(TypedDict):
    category: str
    calls: int
    total_ms: float
    share_pct: float


class HostOps(TypedDict):
    """Host-side collective ops (``gloo:*``/``nccl:*``): ``wall_ms`` is the union of their intervals."""
    ops: int
    wall_ms: float
    by_op_ms: dict[str, float]


class Communication(TypedDict):
    """NCCL kernel time and its overlap with computation (per device: union C of NCCL kernels, K of the rest)."""
    kernels: int
    total_ms: float
    hidden_ms: float
    exposed_ms: float
    by_type_ms: dict[str, float]
    by_group_ms: dict[str, float]
    host_ops: HostOps


class RegionRow(TypedDict):
    name: str
    start_ms: Optional[float]  # from the step window's start
    cpu_ms: float
    gpu_ms: Optional[float]  # None: no GPU activity in the trace
    gpu_activities: int


class PartRow(TypedDict):
    """One model part's time by phase (``share_pct`` of the table's total)."""
    part: str
    label: str
    forward_ms: float
    recompute_ms: float
    backward_ms: float
    optimizer_ms: float
    other_ms: float
    total_ms: float
    share_pct: float


class LayerParts(TypedDict):
    layer: int
    rows: list[PartRow]


class Parts(TypedDict):
    """Time by model part, layer and phase (:mod:`sftprof.analysis.time.model_parts`). In ``parts`` it is the GPU time
    of the activities launched in the step window; in ``cpu_parts`` the self time of the CPU ops that started in it
    (a trace without GPU activity)."""
    source: str  # "module_regions" | "kernel_name"
    layers: list[LayerParts]
    outside_layers: list[PartRow]
    summed: list[PartRow]
    total_ms: float
    outside_window: int  # activities (ops) left out: launched (started) outside the window
    compute_cells: NotRequired[list[list[Any]]]  # [part, layer | None, phase, ms] without NCCL kernels (GPU only)


class DevicePeaks(TypedDict):
    device: Optional[str]
    bf16_flops: Optional[float]  # FLOP/s
    hbm_bytes_per_s: Optional[float]


class EfficiencyRow(TypedDict):
    kind: str  # "GEMM" | "attention"
    part: str
    phase: str
    dtype: str
    calls: int
    tflop: float
    gpu_ms: float
    tflops_per_s: Optional[float]
    pct_of_peak: Optional[float]


class MemoryBoundRow(TypedDict):
    name: str
    calls: int
    gib: float
    gpu_ms: float
    gb_per_s: Optional[float]
    pct_of_hbm: Optional[float]


class Efficiency(TypedDict):
    peak: DevicePeaks
    rows: list[EfficiencyRow]
    memory_bound: list[MemoryBoundRow]
    note: str


class CollectiveRow(TypedDict):
    group: str
    collective: str
    calls: int
    gib: Optional[float]
    gpu_ms: float
    group_size: Optional[int]
    algbw_gb_per_s: Optional[float]
    busbw_gb_per_s: Optional[float]


class Collectives(TypedDict):
    """Per process group: calls, bytes, bandwidth, exposed time (:mod:`sftprof.analysis.time.collectives`)."""
    rows: list[CollectiveRow]
    exposed_by_group_ms: dict[str, float]
    exposed_outside_window_ms: float
    note: str


class HostOpRow(TypedDict):
    name: str
    calls: int
    self_ms: float
    inclusive_ms: float
    sync_wait_ms: float


class SyncCall(TypedDict):
    calls: int
    ms: float


class HostSync(TypedDict):
    total_ms: float
    by_call: dict[str, SyncCall]


class Compile(TypedDict):
    ms: float
    compile_ids: list[str]


class HostWaitRow(TypedDict):
    part: str
    label: str
    phase: str
    launched_under: Optional[str]
    idle_ms: float
    gaps: int
    activities: int
    mean_activity_us: Optional[float]
    mean_gap_us: float
    longest_gap_us: NotRequired[float]  # 3.1
    after_blocking_ms: float
    after_blocking_pct: float
    kind: str  # "after blocking calls" | "launch-bound" | "host busy"
    gc_ms: NotRequired[float]  # 3.2


class HostWaitRest(TypedDict):
    places: int
    idle_ms: float
    gaps: int


class HostWaitPlaces(TypedDict):
    rows: list[HostWaitRow]
    rest: Optional[HostWaitRest]
    after_blocking_ms: float
    after_blocking_by_op: dict[str, float]


class GpuIdle(TypedDict):
    idle_ms: float
    host_wait_ms: float
    kernel_wait_ms: float
    after_last_activity_ms: float
    host_wait_gc_ms: NotRequired[float]  # 3.2
    host_wait_by_place: NotRequired[HostWaitPlaces]


class GcTime(TypedDict):
    """Python garbage collections that started in the step window (:mod:`sftprof.capture.python_gc`)."""
    collections: int
    ms: float
    by_generation: dict[str, int]  # "0" | "1" | "2" -> collections


class Host(TypedDict):
    """Host time in the step window (:mod:`sftprof.analysis.time.host_time`)."""
    top_self: list[HostOpRow]
    sync: HostSync
    compile: Compile
    gpu_idle: Optional[GpuIdle]
    gc: NotRequired[GcTime]  # 3.2


class HeaviestOp(TypedDict):
    """The CPU op with the most inclusive time in the step window, an autograd Function's forward and backward node
    together (:func:`sftprof.analysis.time.host_time.heaviest_op`); ``inclusive_ms`` is the op's, ``backward_ms`` its
    backward node's (``<name>Backward``; None when it has none)."""
    name: str
    calls: int
    inclusive_ms: float
    backward: Optional[str]
    backward_ms: Optional[float]
    part: Optional[str]  # the model part it ran in (its first call)
    label: Optional[str]


class KernelSummary(TypedDict):
    """One rank's trace (:meth:`sftprof.analysis.time.trace_summary.KernelTraceAnalyzer.summary`)."""
    n_events: int
    invalid_events: InvalidEvents
    sanity: NotRequired[TraceSanity]  # absent in a summary of schema 2.x (not checked then)
    view_repairs: dict[str, int]
    identity: Identity
    step_window: StepWindow
    gpu: GpuTime
    top_kernels: list[KernelRow]
    top_cpu_ops: list[CpuOpRow]
    categories: list[CategoryRow]
    communication: Communication
    regions: list[RegionRow]
    parts: Parts
    cpu_parts: Optional[Parts]  # a trace without GPU activity and with model-part ranges
    heaviest_op: Optional[HeaviestOp]  # a trace without GPU activity
    host: Host
    efficiency: Efficiency
    collectives: Collectives


class TraceEntry(TypedDict):
    """One rank's trace: its views and summary, or its error (``kept_*``: files an earlier postprocess left)."""
    rank: int
    source: str  # relative to the log dir
    error: NotRequired[str]
    warning: NotRequired[str]
    kept_views: NotRequired[list[str]]
    kept_files: NotRequired[list[str]]
    views: NotRequired[dict[str, list[str]]]  # view name (sftprof.analysis.views.split.VIEWS) -> files, run-dir relative
    view_links: NotRequired[dict[str, str]]  # view -> the view whose file it links to (byte-identical)
    summary: NotRequired[KernelSummary]
    parts_plot: NotRequired[str]


# -- one memory snapshot ----------------------------------------------------------------------------------------
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


class SnapshotEntry(TypedDict):
    """One snapshot: its archive, plot and summary, or its error (then ``archived`` False)."""
    rank: Optional[int]
    file: str  # run-dir relative
    coords_from_name: Optional[dict[str, int]]
    error: NotRequired[str]
    archived: NotRequired[bool]
    kept_files: NotRequired[list[str]]
    phases_file: NotRequired[str]
    plot: NotRequired[str]
    summary: NotRequired[MemorySummary]
    estimate: NotRequired[Optional[Estimate]]
    estimate_note: NotRequired[Optional[str]]
    estimate_vs_measured: NotRequired[Optional[list[EstimateCheckRow]]]
    allocator: NotRequired[Optional[AllocatorSettings]]


# -- across ranks -----------------------------------------------------------------------------------------------
class ClockOffset(TypedDict):
    ranks: list[int]
    calls: int
    median_end_difference_us: float
    end_difference_mad_us: float  # median absolute deviation of the calls' end differences


class WaitedFor(TypedDict):
    rank: int
    wait_ms: NotRequired[float]
    exposed_wait_ms: float


class WaitRankRow(TypedDict):
    rank: int
    calls: int
    comm_ms: float
    wait_ms: float
    transfer_ms: float
    exposed_ms: float
    exposed_wait_ms: float
    exposed_transfer_ms: float
    last_arrivals: int
    waited_for: list[WaitedFor]


class Straggler(TypedDict):
    rank: int
    others_wait_ms: float
    others_exposed_wait_ms: float
    last_arrivals: int


class WaitGroup(TypedDict):
    group: str
    label: Optional[str]
    members: list[int]
    calls: int
    ranks: list[WaitRankRow]
    straggler: Straggler


class NotSplit(TypedDict):
    group: str
    label: Optional[str]
    reason: str


class WaitRank(TypedDict):
    """One rank's exposed communication over the split groups (groups that overlap count once)."""
    rank: int
    exposed_ms: float
    exposed_wait_ms: float
    exposed_transfer_ms: float
    waited_for: list[WaitedFor]


class UnnamedKernels(TypedDict):
    rank: int
    kernels: int


class MergedRank(TypedDict):
    """How one rank's clock was aligned in the all-ranks view (:func:`sftprof.analysis.views.merged.clock_shifts`)."""
    rank: int
    shift_us: float  # added to the rank's timestamps
    aligned_by: str  # "collective ends", "reference" or "trace clock"
    path: NotRequired[list[ClockOffset]]  # the offsets chained from the reference rank (aligned by collectives)


class MergedView(TypedDict):
    """The all-ranks timeline (:func:`sftprof.analysis.views.merged.merge_trial`): its files (relative to the run dir)
    and each rank's alignment, or the error that kept it from being written."""
    files: NotRequired[list[str]]
    ranks: NotRequired[list[MergedRank]]
    error: NotRequired[str]


class CommWait(TypedDict):
    """Communication split into waiting for the last rank and transfer (:func:`sftprof.analysis.time.comm_wait.split`)."""
    clock_tolerance_us: float
    clock_offsets: list[ClockOffset]
    groups: list[WaitGroup]
    not_split: list[NotSplit]
    unnamed_kernels: list[UnnamedKernels]
    ranks: list[WaitRank]


class RankRow(TypedDict):
    """One profiled rank (:func:`sftprof.analysis.time.rank_table.rank_table`)."""
    rank: int
    coords: Optional[dict[str, int]]
    step_ms: Optional[float]
    stats_peak_allocated_gb: Optional[float]
    comm_ms: NotRequired[float]
    host_comm_ms: NotRequired[float]
    exposed_comm_ms: NotRequired[float]
    gpu_busy_pct: NotRequired[Optional[float]]
    snapshot_peak_allocated_gib: NotRequired[float]
    snapshot_peak_reserved_gib: NotRequired[float]


class Imbalance(TypedDict):
    max: float
    max_rank: int
    min: float
    min_rank: int
    max_over_min: Optional[float]


class GroupMs(TypedDict):
    group: str
    ms: dict[str, float]  # rank (as text) -> exposed ms


class ExposedByGroup(TypedDict):
    """Which process groups explain the gap in exposed communication between the ranks with most and least."""
    ranks: list[int]
    groups: list[GroupMs]
    max_rank: int
    min_rank: int
    totals: dict[str, float]  # rank (as text) -> exposed ms
    extra_ms: float
    extra_by_group: list[list[Any]]  # [group, ms], largest first


class WorkSpreadRow(TypedDict):
    part: str
    label: str
    layer: Optional[int]
    phase: str
    min_ms: float
    min_rank: int
    max_ms: float
    max_rank: int
    spread_ms: float


class WorkSpread(TypedDict):
    ranks: list[int]
    compared_ms: dict[str, float]  # rank (as text) -> compute ms in the cells compared
    min_spread_ms: float
    rows: list[WorkSpreadRow]


class RankTable(TypedDict):
    rows: list[RankRow]
    imbalance: dict[str, Imbalance]  # rank-table column -> its max/min
    exposed_by_group: Optional[ExposedByGroup]
    work_spread: Optional[WorkSpread]


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


class ProfileSummary(TypedDict):
    """``profile_summary.json`` of one trial (:func:`sftprof.analysis.summary.postprocess_trial`)."""
    schema: str  # SCHEMA_NAME
    schema_version: str  # "<major>.<minor>"
    trial: str
    profile_kind: Literal["kernel", "memory"]
    profile_step: int
    status: str  # "ok" | "failed" | "unknown" | "interrupted" (the driver stopped the trial: ``interrupted``)
    interrupted: NotRequired[str]  # the driver's line in launcher.log (sftprof.artifacts.INTERRUPTED_LINE)
    completion: Completion
    paths: Paths
    stats: Stats
    nvidia_smi: NvidiaSmi
    config: Optional[dict[str, Any]]  # the trial's resolved config.yaml
    # the trial's environment.json (name -> value, sftprof.artifacts.recorded_environment); None: not recorded
    environment: NotRequired[Optional[dict[str, str]]]
    rank_coords: dict[str, dict[str, Any]]  # rank (as text) -> coordinates
    failure: NotRequired[Optional[Failure]]
    trainer_log_tail: NotRequired[Optional[list[str]]]
    log_tail_source: NotRequired[str]
    kernel_traces: NotRequired[list[TraceEntry]]
    memory_snapshots: NotRequired[list[SnapshotEntry]]
    comm_wait: NotRequired[Optional[CommWait]]
    merged_view: NotRequired[Optional[MergedView]]
    missing_traces: NotRequired[list[int]]  # ranks perf_tracer.ranks profiles whose trace is not in the log dir
    skipped: list[SkippedFile]
    errors: list[FileError]
    warnings: list[FileWarning]
    counts: Counts
    ranks: RankTable
    findings: list[Finding]
    what_if: list[WhatIf]
    what_if_skipped: NotRequired[list[WhatIfSkipped]]
    tried_what_if: NotRequired[TriedWhatIf]  # a what-if trial of the driver (TRY_WHAT_IFS)
    transformer_engine: NotRequired[Optional[bool]]  # TE in the trial (config on/off, else trainer.log); None: unknown
    simulation: NotRequired[Optional[Simulation]]  # a simulated rank's trial; None otherwise
    oom: NotRequired[Optional[OomTriage]]  # a failed trial whose rank ran out of CUDA memory (sftprof.analysis.memory.oom)


# -- reading ----------------------------------------------------------------------------------------------------
class SummaryReadError(ValueError):
    """A file that is not a profile summary this sftprof can read; the message names the file and why."""


class SchemaError(ValueError):
    """A summary that departs from the schema (strict mode, :data:`STRICT_ENV`); the message names the members."""


def _version(data: dict) -> tuple[int, int]:
    """``(major, minor)`` of a summary; release 1's (``schema`` ending in ``/1``, no ``schema_version``) is 1.0."""
    v = data.get("schema_version")
    if v is None:
        return (1, 0)
    major, _, minor = str(v).partition(".")
    return int(major), int(minor or 0)


def _upgrade(data: dict, major: int) -> dict:
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


def read_summary(path: str | os.PathLike) -> ProfileSummary:
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


def processed_traces(summary: ProfileSummary) -> list[TraceEntry]:
    """The traces summarised without error (each has ``summary``)."""
    return [t for t in summary.get("kernel_traces") or [] if "summary" in t and "error" not in t]


def processed_snapshots(summary: ProfileSummary) -> list[SnapshotEntry]:
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
