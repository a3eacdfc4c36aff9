"""Part of ``profile_summary.json``'s schema (:mod:`sftprof.analysis.schema`): the trial's own members: completion,
paths, ``stats.jsonl``'s records, nvidia-smi, errors, warnings and skipped files, counts, the first failure, and one
entry per trace or snapshot (``kernel_traces[i]``, ``memory_snapshots[i]``).

Declarations only, evaluated at run time (no postponed annotations: :func:`sftprof.analysis.schema.check` reads
``NotRequired`` from them); standard library only.
"""
from typing import Any, Literal, NotRequired, Optional, TypedDict

from sftprof.analysis.memory.schema import AllocatorSettings, Estimate, EstimateCheckRow, MemorySummary, OomTriage
from sftprof.analysis.time.schema import CommWait, KernelSummary
from sftprof.analysis.views.schema import MergedView
from sftprof.analysis.what_if.schema import TriedWhatIf


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
    started_unix_s: NotRequired[Optional[float]]  # rank 0's clock at the step's start (sftprof.stats_log.StepRecord)
    profiler_s: NotRequired[Optional[float]]  # rank 0's wall time in the profilers around the timed step


class Stats(TypedDict):
    """``stats.jsonl`` read by :func:`sftprof.analysis.trial.inputs.read_stats`: the steps, and the profiled step's
    figures at top level (None when absent)."""
    available: bool
    bad_lines: int
    steps: list[StepRow]
    profile_step_record: Optional[dict[str, Any]]  # the raw record: sftprof.stats_log.StepRecord
    per_rank: dict[str, RankStats]  # rank (as text) -> figures
    complete: Optional[dict[str, Any]]  # the raw record: sftprof.stats_log.CompletionRecord
    teardown: NotRequired[Optional[dict[str, Any]]]  # the raw record: sftprof.stats_log.TeardownRecord (3.10)
    exit: NotRequired[Optional[dict[str, Any]]]  # the raw record: sftprof.stats_log.ExitRecord (3.11)
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


class WallPhase(TypedDict):
    """One phase of the trial's wall time (:data:`sftprof.analysis.trial.wall_time.PHASES` names them, in order)."""
    phase: str
    seconds: Optional[float]  # None: a boundary of the phase was not recorded (a trial that failed or was stopped)


class ColdStart(TypedDict):
    """Step 0's one-time cost: its step time minus a warm step's (both ``step_time_s``, the slowest rank's)."""
    step0_s: float
    warm_step_s: float  # the median of the reference steps
    warm_steps: list[int]  # the reference: the steps after 0 not profiled, else the profiled ones (profiler included)
    reference_profiled: bool  # the reference steps are profiled ones (no step after 0 ran unprofiled)
    cold_start_s: float  # step0_s - warm_step_s; negative: no cost to stand behind (not_measurable)
    not_measurable: NotRequired[str]  # why, when cold_start_s < 0: the reference's profiler cost or spread exceeds it


class WallTime(TypedDict):
    """Where the trial's wall time went, in seconds (:func:`sftprof.analysis.trial.wall_time.wall_time`), from the
    trainer's clock in ``stats.jsonl`` and the launcher's in ``trial_times.json``. The phases follow each other from
    torchrun's launch to its exit, so they sum to ``elapsed_s``; postprocessing, which writes this summary, is timed
    in ``trial_times.json`` and the driver's end table only."""
    phases: list[WallPhase]
    elapsed_s: Optional[float]  # torchrun launched -> ended (the launcher's clock); None without trial_times.json
    cold_start: Optional[ColdStart]  # None: no step 0 or no later step to compare it with
    barrier_s: NotRequired[Optional[float]]  # of the teardown phase: the ranks' barrier (None: none ran, or unknown)
    trial_times_error: NotRequired[str]  # trial_times.json exists but cannot be read (a warning too)


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
    rank: Optional[int]  # None: torchrun's report (or stall.json) gave none that reads as one
    exitcode: Optional[int]
    signal: Optional[str]
    how: str


class NodeFailure(TypedDict):
    """A failed node of a multi-node trial (:func:`sftprof.analysis.trial.failure.node_failures`)."""
    node: int
    ranks: Optional[list[int]]  # the node's global ranks; None: the layout is unknown
    host: Optional[str]
    how: str  # one phrase: "never joined the trial", "torchrun exited with status 1", ...
    detail: str  # what that means and where to look


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
    nodes: list[NodeFailure]  # further failed nodes
    torchrun: NotRequired[bool]


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
    parts_plot_error: NotRequired[str]  # the model-part plot could not be drawn: why (3.12)


class SnapshotEntry(TypedDict):
    """One snapshot: its archive, plot and summary, or its error (then ``archived`` False)."""
    rank: Optional[int]
    file: str  # run-dir relative
    coords_from_name: Optional[dict[str, int]]
    error: NotRequired[str]
    archived: NotRequired[bool]
    kept_files: NotRequired[list[str]]
    phases_file: NotRequired[str]  # the sidecar archived; in an error's entry: moved in, then the snapshot failed
    plot: NotRequired[str]
    plot_error: NotRequired[str]  # the plot could not be drawn: why (3.12)
    summary: NotRequired[MemorySummary]
    estimate: NotRequired[Optional[Estimate]]
    estimate_note: NotRequired[Optional[str]]
    estimate_vs_measured: NotRequired[Optional[list[EstimateCheckRow]]]
    allocator: NotRequired[Optional[AllocatorSettings]]


class Versions(TypedDict):
    """The software the trial ran with (``LOG_DIR/versions.json``, :func:`sftprof.versions.recorded_versions`): each
    a version text, None when not installed (``torch_cuda``, ``nccl``: a CPU build of torch). ``sftprof`` (3.8): its
    version and commit (``0.1.0+g85c64d7``, :func:`sftprof.versions.sftprof_version`); ``nccl`` (3.8): torch's NCCL;
    both None for a trial of an earlier release, absent from a summary of schema 3.7."""
    sftprof: NotRequired[Optional[str]]
    python: Optional[str]
    torch: Optional[str]
    torch_cuda: Optional[str]
    nccl: NotRequired[Optional[str]]
    megatron_core: Optional[str]
    transformer_engine: Optional[str]
    transformers: Optional[str]
    triton: Optional[str]
    flash_linear_attention: Optional[str]


# -- the summary's parts, in the order postprocess_trial makes them ----------------------------------------------
class Header(TypedDict):
    """The summary's first members: what was processed, as what, and the trial's status."""
    schema: str  # SCHEMA_NAME
    schema_version: str  # "<major>.<minor>"
    trial: str
    profile_kind: Literal["kernel", "memory"]
    profile_step: int
    status: str  # "ok" | "failed" | "unknown" | "interrupted" (the driver stopped the trial: ``interrupted``)
    interrupted: NotRequired[str]  # the driver's line in launcher.log (sftprof.artifacts.INTERRUPTED_LINE)
    completion: Completion
    paths: Paths


class Inputs(TypedDict):
    """The trial's input files as read (:mod:`sftprof.analysis.trial.inputs`)."""
    stats: Stats
    nvidia_smi: NvidiaSmi
    config: Optional[dict[str, Any]]  # the trial's resolved config.yaml
    # the trial's environment.json (name -> value, sftprof.artifacts.recorded_environment); None: not recorded
    environment: NotRequired[Optional[dict[str, str]]]
    versions: NotRequired[Optional[Versions]]  # 3.7; None: not recorded (a trial of an earlier release)
    rank_coords: dict[str, dict[str, Any]]  # rank (as text) -> coordinates
    transformer_engine: NotRequired[Optional[bool]]  # TE in the trial (config on/off, else trainer.log); None: unknown
    tried_what_if: NotRequired[TriedWhatIf]  # a what-if trial of the driver (TRY_WHAT_IFS)


class FailurePart(TypedDict):
    """A trial that did not finish (not one the driver interrupted): its first failure and log tail."""
    failure: NotRequired[Optional[Failure]]
    trainer_log_tail: NotRequired[Optional[list[str]]]
    log_tail_source: NotRequired[str]
    oom: NotRequired[Optional[OomTriage]]  # a failed trial whose rank ran out of CUDA memory (sftprof.analysis.memory.oom)


class Files(TypedDict):
    """The trial's traces (a kernel trial, with what is made across them) or snapshots (a memory trial)."""
    kernel_traces: NotRequired[list[TraceEntry]]
    memory_snapshots: NotRequired[list[SnapshotEntry]]
    comm_wait: NotRequired[Optional[CommWait]]
    merged_view: NotRequired[Optional[MergedView]]
    skipped: list[SkippedFile]


class WallTimePart(TypedDict):
    """Where the trial's wall time went (every trial)."""
    wall_time: WallTime


class TrialRecord(Header, Inputs, FailurePart, Files, WallTimePart):
    """What the trial's files say: the members the rest of the summary is judged from."""


class Problems(TypedDict):
    """The errors and warnings of the summary (:mod:`sftprof.analysis.trial.problems`) and its counts."""
    missing_traces: NotRequired[list[int]]  # ranks perf_tracer.ranks profiles whose trace is not in the log dir
    errors: list[FileError]
    warnings: list[FileWarning]
    counts: Counts
