"""Part of ``profile_summary.json``'s schema (:mod:`sftprof.analysis.schema`): one trace's kernel summary
(``kernel_traces[i].summary``), the communication wait across ranks (``comm_wait``), the ranks table (``ranks``) and
a simulated rank's projected step (``simulation``).

Declarations only, evaluated at run time (no postponed annotations: :func:`sftprof.analysis.schema.check` reads
``NotRequired`` from them); standard library only.
"""
from typing import Any, NotRequired, Optional, TypedDict

from sftprof.analysis.trace.schema import Identity, InvalidEvents, TraceSanity


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
    """The projected rank's memory, GiB (:func:`sftprof.analysis.time.projection.project`); 3.6: the real rank's need
    (peak reserved + outside PyTorch + NCCL buffers) against one GPU's capacity
    (:func:`sftprof.analysis.time.projection.real_rank_memory`)."""
    measured_peak_gib: Optional[float]  # None on CPU
    nccl_buffers_gib: float  # estimated, never measured
    projected_peak_gib: Optional[float]
    measured_peak_reserved_gib: NotRequired[Optional[float]]  # 3.6; None on CPU
    outside_pytorch_gib: NotRequired[float]  # 3.6; a process with real process groups (one GPU's figure)
    real_rank_need_gib: NotRequired[Optional[float]]  # 3.6; None without a measured peak reserved
    capacity_gib: NotRequired[Optional[float]]  # 3.6; nvidia-smi's total less the driver's share; None: unknown
    fits: NotRequired[Optional[bool]]  # 3.6; None: need or capacity unknown


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


class SimulationPart(TypedDict):
    """The summary's ``simulation`` member: a simulated rank's trial has it; None otherwise."""
    simulation: NotRequired[Optional[Simulation]]


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


class GroupCalls(TypedDict):
    """One process group's calls on one rank (:func:`sftprof.analysis.time.comm_wait.call_records`)."""
    label: Optional[str]
    members: Optional[list[int]]  # global ranks; None: not recorded in the trace
    # (collective, kernel intervals, exposed pieces), each interval [start_us, end_us]; by first kernel start
    calls: list[tuple[str, list[list[float]], list[list[float]]]]


class CallRecords(TypedDict):
    """One rank's collectives per process-group name (:func:`sftprof.analysis.time.comm_wait.call_records`)."""
    groups: dict[str, GroupCalls]
    unnamed_kernels: int  # NCCL kernels without a process-group name (left out)


class Collectives(TypedDict):
    """Per process group: calls, bytes, bandwidth, exposed time (:mod:`sftprof.analysis.time.collectives`)."""
    rows: list[CollectiveRow]
    exposed_by_group_ms: dict[str, float]
    exposed_outside_window_ms: float
    note: str
    # the analyzer's result only: matched across ranks (:mod:`sftprof.analysis.trial.traces`), never written
    calls: NotRequired[CallRecords]


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
    ms: dict[int, float]  # rank -> exposed ms (a rank as text in the JSON, as every key)


class ExposedByGroup(TypedDict):
    """Which process groups explain the gap in exposed communication between the ranks with most and least."""
    ranks: list[int]
    groups: list[GroupMs]
    max_rank: int
    min_rank: int
    totals: dict[int, float]  # rank -> exposed ms
    extra_ms: float
    extra_by_group: list[Any]  # (group, ms) tuples, largest first ([group, ms] lists in the JSON)


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
    compared_ms: dict[int, float]  # rank -> compute ms in the cells compared
    min_spread_ms: float
    rows: list[WorkSpreadRow]


class RankTable(TypedDict):
    rows: list[RankRow]
    imbalance: dict[str, Imbalance]  # rank-table column -> its max/min
    exposed_by_group: Optional[ExposedByGroup]
    work_spread: Optional[WorkSpread]
