"""The artifact contract between capture (trainer, launcher) and analysis (postprocessing): names and records.

Torch-free and importing nothing else of the project, so every side can use it. It owns (the records of
``stats.jsonl`` are :mod:`sftprof.stats_log`'s):

- **Region names** (``record_function`` annotations and memory phases): :data:`STEP`,
  :data:`OPTIMIZER_STEP`, :func:`forward`, :func:`backward`, and :func:`parse_region` to read them back.
- **File and folder names** with their builders and parsers: a trial's log dir (``LOG_DIR``, written by the
  trainer), its run dir (``RUN_DIR``, written by the driver and postprocessing) and the run root
  (``RUN_ROOT``, written by the launcher). ``docs/ARCHITECTURE.md`` lists who writes and who reads each.

Layout::

    RUN_ROOT/  profile_settings.log  plan_config.yaml  trials.tsv  summary.tsv
      <trial>/  launcher.log  nvidia_smi.csv  train_args.txt  trial_times.json  profile_summary.{json,md}
        torchelastic/                                        (torchrun's --log-dir: kept only if it wrote a file)
        what_if.json  compare_vs_<source trial>.md                (a what-if trial of TRY_WHAT_IFS)
        kernel_traces/<view>/rank<r>.pt.trace.json[.gz]      (<view>.part<k>/ when split in time)
        memory_snapshots/step_<N>/snapshot_rank<r>_pp<a>_dp<b>_cp<c>_tp<d>_ep<e>.pickle, phases_rank<r>.json
    LOG_DIR = FILEROOT/logs/<user>/<experiment>/<trial>/
        trainer.log  stats.jsonl  config.yaml  environment.json  versions.json  rank_coords.json
        perf_tracer/rank<r>.pt.trace.json   memory_snapshots/step_<N>/...   nodes/node<k>.json
        progress/rank<r>.json   stall.json   (each rank's last progress; the watchdog's record of a stalled rank)

Raw-trace names of earlier releases (``perf_tracer/traces-r<r>.chrome.json[.gz]``) are still parsed
(:data:`RAW_TRACE_RE`), and so is a trace the profiler wrote but could not rename from its temporary name
(``rank<r>.pt.trace.json[...].tmp``: :data:`UNRENAMED_TRACE_RE`).

Above 500 lines for a reason: it is the one contract between the trainer, the launcher and postprocessing (each
name with its builder and parser), kept in one torch-free module that imports nothing of sftprof.
"""
from __future__ import annotations

import glob
import json
import os
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional


# ---------------------------------------------------------------------------------------------------------
# Region names
# ---------------------------------------------------------------------------------------------------------
REGION_PREFIX = "sftprof/"
STEP = "sftprof/step"
OPTIMIZER_STEP = "sftprof/optimizer_step"
# Group 1: the phase (step, optimizer_step, forward, backward); group 2: the micro-batch of forward/backward.
REGION_RE = re.compile(r"^sftprof/(?:(step|optimizer_step)|(forward|backward)/mb(\d+))$")


def forward(mb: int) -> str:
    """Region name of the forward pass of micro-batch ``mb``: ``sftprof/forward/mb<mb>``."""
    return f"{REGION_PREFIX}forward/mb{mb}"


def backward(mb: int) -> str:
    """Region name of the backward pass of micro-batch ``mb``: ``sftprof/backward/mb<mb>``."""
    return f"{REGION_PREFIX}backward/mb{mb}"


def parse_region(name: str) -> tuple[str, Optional[int]] | None:
    """``(phase, micro-batch)`` of a region name (``("forward", 0)``, ``("step", None)``), None for other names."""
    m = REGION_RE.match(name)
    if m is None:
        return None
    return (m.group(1), None) if m.group(1) else (m.group(2), int(m.group(3)))


# Model-part ranges (sftprof.capture.module_regions writes them, sftprof.analysis.trace.op_collector reads them):
# sftprof.module/<part>[/L<layer>][/recompute].
MODULE_REGION_PREFIX = "sftprof.module/"
MODULE_RECOMPUTE_SUFFIX = "/recompute"
# part -> label, in the order tables show them.
MODEL_PART_LABELS = {
    "attn_qkv": "attention QKV projection",
    "attn_core": "attention core",
    "attn_out": "attention output projection",
    "attn_other": "attention other (RoPE, reshapes)",
    "linear_attn": "linear attention (gated delta net)",
    "norm": "norms",
    "router": "MoE router",
    "dispatch_combine": "MoE dispatch/combine (permute, all-to-all)",
    "experts": "expert GEMMs (routed)",
    "shared_experts": "shared experts",
    "layer_other": "layer other (residuals)",
    "embedding": "embedding",
    "lm_head_loss": "LM head + loss",
}
MODEL_PARTS = tuple(MODEL_PART_LABELS)
_MODULE_REGION_RE = re.compile(r"^" + re.escape(MODULE_REGION_PREFIX) + r"([a-z_]+)(?:/L(\d+))?(/recompute)?$")


def module_region_name(part: str, layer: Optional[int], recompute: bool) -> str:
    """``sftprof.module/<part>[/L<layer>][/recompute]``: the range of model part ``part`` (:data:`MODEL_PARTS`) in
    global decoder layer ``layer`` (None outside the layers), ``/recompute`` for a forward re-run in backward."""
    name = MODULE_REGION_PREFIX + part + (f"/L{layer}" if layer is not None else "")
    return name + MODULE_RECOMPUTE_SUFFIX if recompute else name


# Python garbage collections (sftprof.capture.python_gc writes them): sftprof.gc/gen<generation>.
GC_REGION_PREFIX = "sftprof.gc/gen"


def parse_module_region(name: str) -> Optional[tuple[str, Optional[int], bool]]:
    """``(part, layer or None, recompute)`` of a range name made by :func:`module_region_name`, else None."""
    m = _MODULE_REGION_RE.match(name)
    if not m or m.group(1) not in MODEL_PART_LABELS:
        return None
    return m.group(1), None if m.group(2) is None else int(m.group(2)), bool(m.group(3))


# ---------------------------------------------------------------------------------------------------------
# LOG_DIR (the trainer)
# ---------------------------------------------------------------------------------------------------------
TORCHELASTIC = "torchelastic"  # RUN_DIR/torchelastic/: torchrun's --log-dir (its error files), not /tmp/torchelastic_*
TRAINER_LOG = "trainer.log"
STATS = "stats.jsonl"
CONFIG_YAML = "config.yaml"
RANK_COORDS = "rank_coords.json"
ENVIRONMENT = "environment.json"  # rank 0's recorded_environment() at the trial's start
VERSIONS = "versions.json"  # rank 0's sftprof.versions.recorded_versions() at the trial's start
PERF_TRACER = "perf_tracer"
MEMORY_SNAPSHOTS = "memory_snapshots"
NODES = "nodes"
PROGRESS = "progress"  # progress/rank<r>.json: each rank's last progress (write_progress), read by the watchdog
STALL_JSON = "stall.json"  # the launcher's watchdog's record of a rank that stopped making progress

# Environment variables that change what a trial computes or how fast it runs (read by Transformer Engine, NCCL,
# torch, Inductor, dynamo, Triton, cuBLAS, cuDNN, CUDA, OpenMP): these prefixes and names, as the trial starts (before
# the trainer's own defaults: deterministic mode then sets CUBLAS_WORKSPACE_CONFIG and NVTE_ALLOW_NONDETERMINISTIC_ALGO,
# which its config row shows). Left out: paths, hosts and plugins (they differ between machines, not jobs), NCCL's
# per-job rendezvous address, and any name that may hold a secret.
RECORDED_ENV_PREFIXES = ("NVTE_", "NCCL_", "TORCH_NCCL_", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_", "CUBLAS_",
                         "CUBLASLT_", "CUDNN_")
RECORDED_ENV_NAMES = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
                      "NVIDIA_TF32_OVERRIDE", "OMP_NUM_THREADS", "TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE",
                      "TORCH_BLAS_PREFER_CUBLASLT")
_UNRECORDED_ENV_SUFFIXES = ("_DIR", "_DIRS", "_HOME", "_PATH", "_FILE", "_LOGDEST_DBG", "_PLUGIN", "_HOST")
_UNRECORDED_ENV_NAMES = ("NCCL_COMM_ID",)
_SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|KEY")


def recorded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that a trial records (:data:`RECORDED_ENV_PREFIXES`, :data:`RECORDED_ENV_NAMES`,
    less the kinds left out above), sorted by name: what ``compare`` sets side by side with the config. Bytes that
    are not UTF-8 (an environment holds bytes) come back as ``\\xNN`` escapes."""
    def text(t: str) -> str:
        return t.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return {text(k): text(environ[k]) for k in sorted(environ)
            if (k.startswith(RECORDED_ENV_PREFIXES) or k in RECORDED_ENV_NAMES)
            and not k.endswith(_UNRECORDED_ENV_SUFFIXES) and k not in _UNRECORDED_ENV_NAMES
            and not _SECRET_WORDS.search(k)}


# Group 1 or 2: the rank; the legacy name (traces-r<r>.chrome.json) first, then rank<r>.pt.trace.json.
RAW_TRACE_RE = re.compile(r"^(?:traces-r(\d+)\.chrome|rank(\d+)\.pt\.trace)\.json(\.gz)?$")
# Groups: rank, pp, dp, cp, tp, ep.
SNAPSHOT_RE = re.compile(r"^snapshot_rank(\d+)_pp(\d+)_dp(\d+)_cp(\d+)_tp(\d+)_ep(\d+)\.pickle(\.gz)?$")
_SNAPSHOT_COORDS = ("pp", "dp", "cp", "tp", "ep")


def trace_name(rank: int, compress: bool = False) -> str:
    """``rank<rank>.pt.trace.json`` (``.gz`` appended when ``compress``): the ``<worker>.pt.trace.json`` name
    TensorBoard's profiler plugin lists, with worker ``rank<rank>``."""
    return f"rank{rank}.pt.trace.json" + (".gz" if compress else "")


def raw_trace_rank(name: str) -> int | None:
    """The rank in a raw trace file name (new or legacy form), or None when ``name`` is not one."""
    m = RAW_TRACE_RE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


# A raw trace under the temporary name kineto writes it to before renaming it (left when the rename failed).
UNRENAMED_TRACE_RE = re.compile(r"^(?:traces-r(\d+)\.chrome|rank(\d+)\.pt\.trace)\.json(?:\.gz)?(?:\.[^./]+)?\.tmp$")


def unrenamed_trace_rank(name: str) -> int | None:
    """The rank in the name of a raw trace left under the profiler's temporary name (:data:`UNRENAMED_TRACE_RE`),
    or None when ``name`` is not one."""
    m = UNRENAMED_TRACE_RE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def unrenamed_traces(path: Path) -> list[Path]:
    """The files the profiler left under a temporary name of the trace ``path`` (``<path>.tmp``,
    ``<path>.<suffix>.tmp``), sorted."""
    return sorted(p for p in path.parent.glob(glob.escape(path.name) + "*.tmp")
                  if unrenamed_trace_rank(p.name) is not None)


def raw_trace_path(log_dir: str | Path, rank: int) -> Path:
    """``LOG_DIR/perf_tracer/rank<rank>.pt.trace.json``: the kernel trace the trainer exports."""
    return Path(log_dir) / PERF_TRACER / trace_name(rank)


def snapshot_dir(root: str | Path, step: int) -> Path:
    """``<root>/memory_snapshots/step_<step>`` (``root``: a LOG_DIR, or a RUN_DIR after archiving)."""
    return Path(root) / MEMORY_SNAPSHOTS / f"step_{step}"


def snapshot_name(rank: int, coords: dict) -> str:
    """``snapshot_rank<r>_pp<a>_dp<b>_cp<c>_tp<d>_ep<e>.pickle`` for ``coords`` (``Layout.rank_coords``) of ``rank``."""
    return f"snapshot_rank{rank}_" + "_".join(f"{k}{coords[k]}" for k in _SNAPSHOT_COORDS) + ".pickle"


def parse_snapshot_name(name: str) -> tuple[int, dict] | None:
    """``(rank, {"pp", "dp", "cp", "tp", "ep"})`` of a snapshot file name (``.pickle[.gz]``), None otherwise."""
    m = SNAPSHOT_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), dict(zip(_SNAPSHOT_COORDS, map(int, m.group(2, 3, 4, 5, 6))))


OOM = "oom"  # LOG_DIR/memory_snapshots/oom/: what a rank's allocator held when it ran out of memory


def oom_dir(root: str | Path) -> Path:
    """``<root>/memory_snapshots/oom``: the snapshot and record a rank writes at a CUDA out-of-memory error."""
    return Path(root) / MEMORY_SNAPSHOTS / OOM


def oom_record_name(rank: int) -> str:
    """``oom_rank<rank>.json``: the out-of-memory record beside that rank's snapshot (:mod:`sftprof.capture.oom`)."""
    return f"oom_rank{rank}.json"


OOM_RECORD_RE = re.compile(r"^oom_rank(\d+)\.json$")
PHASES_RE = re.compile(r"^phases_rank(\d+)\.json$")


def phases_name(rank: int) -> str:
    """``phases_rank<rank>.json``: the region sidecar of a memory snapshot (same folder)."""
    return f"phases_rank{rank}.json"


def node_record_path(log_dir: str | Path, node_rank: int) -> Path:
    """``LOG_DIR/nodes/node<k>.json``: node ``k``'s end record of a multi-node trial (or of a one-node trial whose
    torchrun was killed)."""
    return Path(log_dir) / NODES / f"node{node_rank}.json"


NODE_RECORD_RE = re.compile(r"^node(\d+)\.json$")


def progress_path(log_dir: str | Path, rank: int) -> Path:
    """``LOG_DIR/progress/rank<rank>.json``: rank ``rank``'s last progress (:func:`write_progress`)."""
    return Path(log_dir) / PROGRESS / f"rank{rank}.json"


def write_progress(path: Path, rank: int, step: int | None, phase: str, seq: int) -> None:
    """Replace ``path`` with ``{"rank", "step" (None before the first step), "phase", "seq", "unix_s"}`` in one rename
    (a reader never sees half a record). ``phase``: the region begun, ``after <region>`` once it ended, or a trainer
    stage (``setup``, ``finished``); ``seq``: how many records the rank wrote before this one (the ranks of a trial
    pass the same phases, so a smaller ``seq`` is less progress)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"rank": rank, "step": step, "phase": phase, "seq": seq, "unix_s": time.time()}))
    os.replace(tmp, path)


def read_progress(path: str | Path) -> dict[str, Any] | None:
    """A rank's progress record (:func:`write_progress`), or None when it is absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("phase"), str) else None


def read_node_record(path: str | Path) -> dict[str, Any]:
    """One node's end record (written by the launcher: :func:`sftprof.launch.nodes.write_node_record`).

    Returns:
        ``{"node_rank": int, "host": str or None, "torchrun_rc": int, "elapsed_s": int or None (seconds),
        "n_nodes": int or None, "nproc_per_node": int or None, "torchrun_signal": str or None, "ranks_stopped":
        list of int or None}``; ``n_nodes`` and ``nproc_per_node`` are None in records of earlier releases, which
        did not write them; ``torchrun_signal`` names the signal that killed torchrun itself (``SIGKILL``) and
        ``ranks_stopped`` the ranks whose workers it left running, which the launcher then stopped.

    Raises:
        OSError: the file cannot be read. ValueError: it is not a JSON object with an integer ``torchrun_rc``
        (and, where present, integer ``node_rank`` / ``n_nodes`` / ``nproc_per_node``).
    """
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    if not isinstance(rec, dict):
        raise ValueError(f"not a JSON object: {type(rec).__name__}")
    stopped = rec.get("ranks_stopped")
    out = {"host": rec.get("host") if isinstance(rec.get("host"), str) else None, "elapsed_s": rec.get("elapsed_s"),
           "torchrun_signal": rec.get("torchrun_signal") if isinstance(rec.get("torchrun_signal"), str) else None,
           "ranks_stopped": stopped if isinstance(stopped, list) and all(
               isinstance(r, int) and not isinstance(r, bool) for r in stopped) else None}
    for key in ("node_rank", "torchrun_rc", "n_nodes", "nproc_per_node"):
        value = rec.get(key)
        if (value is None and key != "torchrun_rc") or (isinstance(value, int) and not isinstance(value, bool)):
            out[key] = value
        else:
            raise ValueError(f"{key}: expected an integer, got {value!r}")
    return out


def node_ranks(node_rank: int, nproc_per_node: int) -> list[int]:
    """The global ranks torchrun gives node ``node_rank`` when every node runs ``nproc_per_node`` processes
    (static rendezvous: group rank = node rank, global rank = group rank x nproc_per_node + local rank)."""
    return list(range(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node))


# ---------------------------------------------------------------------------------------------------------
# RUN_ROOT and RUN_DIR (the launcher, postprocessing)
# ---------------------------------------------------------------------------------------------------------
PROFILE_SETTINGS = "profile_settings.log"
RUN_ROOT_FILEROOT = "fileroot"  # FILEROOT unset: the driver's is RUN_ROOT/fileroot (its trial log dirs, not trials)
PLAN_CONFIG = "plan_config.yaml"  # the CONFIG file as the plan read it: every trial of the run loads this copy
# the sha256 of that copy as planned, in each planned trial's environment: the trainer refuses a copy edited since
PLAN_CONFIG_SHA256_ENV = "SFTPROF_PLAN_CONFIG_SHA256"
TRIALS_TSV = "trials.tsv"
# its first line (a trials.tsv of an earlier release has none): the columns of each trial's row
TRIALS_HEADER = ("trial", "kind", "step", "run_dir", "log_dir", "args_file")
PROFILE_KINDS = ("kernel", "memory")  # a trial's profile kind (its row's kind; postprocess_profile.py --profile-kind)
# the shape of the driver's trial names (sftprof/launch/folders.py: <model>_fake<len>_<kind>_step<N>_<stamp>), which
# name each trial's run dir and log dir
TRIAL_NAME_RE = re.compile(r"^.+_fake\w+_(?:" + "|".join(PROFILE_KINDS) + r")_step\d+_.+$")
SUMMARY_TSV = "summary.tsv"
TRAIN_ARGS = "train_args.txt"
LAUNCHER_LOG = "launcher.log"
NVIDIA_SMI_CSV = "nvidia_smi.csv"
TRIAL_MARKER = "SFTPROF_TRIAL_ID"  # in the environment of torchrun and every process it starts
SUMMARY_JSON = "profile_summary.json"
SUMMARY_MD = "profile_summary.md"
KERNEL_TRACES = "kernel_traces"
WHAT_IF_JSON = "what_if.json"  # a what-if trial's record of the what-if it tries (the driver, TRY_WHAT_IFS)
TRIAL_TIMES = "trial_times.json"  # the launcher's clock of a trial (TrialTimes)


# the line the driver appends to a trial's launcher.log when a signal (Ctrl-C, SIGTERM) stopped its torchrun; a
# postprocess of the trial, the driver's or a standalone one, then summarises it as interrupted, not failed
INTERRUPTED_PREFIX = "sftprof: trial interrupted: "
INTERRUPTED_LINE = INTERRUPTED_PREFIX + "the driver got {signal} and stopped its torchrun"


def read_trials_tsv(run_root: str) -> list[tuple[str, str, int, str, str]]:
    """``[(name, kind, step, run dir, log dir)]`` of ``RUN_ROOT/trials.tsv`` (the driver's plan, what-if trials
    appended), in its order; its first line, :data:`TRIALS_HEADER`, is no trial (an earlier release wrote none), and
    nor are blank lines at its end (``echo >> trials.tsv``).

    Raises:
        OSError: the file cannot be read; ValueError: it is not UTF-8 text, or a row is not the driver's (six
            tab-separated fields, a step of ASCII digits, a kind of :data:`PROFILE_KINDS`), a blank line before
            the last row included.
    """
    out = []
    path = os.path.join(run_root, TRIALS_TSV)
    with open(path, encoding="utf-8") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}), so not the driver's plan") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    for n, line in enumerate(lines, start=1):
        fields = line.split("\t")
        if n == 1 and tuple(fields) == TRIALS_HEADER:
            continue
        if len(fields) != 6 or not (fields[2].isascii() and fields[2].isdigit()):
            raise ValueError(f"{path} line {n}: not a row of the driver's plan "
                             "(name, kind, step, run dir, log dir, arguments file; tab-separated)")
        if fields[1] not in PROFILE_KINDS:
            raise ValueError(f"{path} line {n}: kind {fields[1]!r} is not a profile kind of the driver's plan (one of "
                             f"{', '.join(PROFILE_KINDS)})")
        out.append((fields[0], fields[1], int(fields[2]), fields[3], fields[4]))
    return out


@dataclass(frozen=True)
class TrialTimes:
    """The launcher's clock of one trial (``RUN_DIR/trial_times.json``), seconds since the Unix epoch on node 0;
    None: not reached (yet, or the run stopped first).

    Attributes:
        launched_unix_s: the trial was launched, just before its postprocessing and its torchrun were started.
        torchrun_ended_unix_s: torchrun exited (the trainers' teardown included).
        postprocess_launched_unix_s: ``postprocess_profile.py --after-trial FD`` was started (with torchrun; it
            imports, then waits for the trial to end).
        postprocess_started_unix_s, postprocess_ended_unix_s: the launcher let postprocessing go on (the trial
            had ended), and it ended.
        postprocess_background: postprocessed while the next trial (a memory trial) trained.
    """

    launched_unix_s: float
    torchrun_ended_unix_s: Optional[float] = None
    postprocess_launched_unix_s: Optional[float] = None
    postprocess_started_unix_s: Optional[float] = None
    postprocess_ended_unix_s: Optional[float] = None
    postprocess_background: bool = False


def write_trial_times(run_dir: str | Path, times: TrialTimes) -> None:
    """Replace ``RUN_DIR/trial_times.json`` with ``times`` in one rename (a reader never sees half a record).

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(run_dir) / TRIAL_TIMES
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({f.name: getattr(times, f.name) for f in fields(times)}, indent=1) + "\n")
    os.replace(tmp, path)


def read_trial_times(run_dir: str | Path) -> TrialTimes | None:
    """``RUN_DIR/trial_times.json`` (:class:`TrialTimes`); None when it is absent (a trial not run by the driver, or
    not yet launched).

    Raises:
        OSError: it exists but cannot be read. ValueError: it is not a JSON object with a numeric
            ``launched_unix_s`` and numeric or null times.
    """
    try:
        with open(Path(run_dir) / TRIAL_TIMES, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    if not isinstance(rec, dict):
        raise ValueError(f"{TRIAL_TIMES}: not a JSON object")
    out: dict[str, Any] = {}
    for f in fields(TrialTimes):
        value = rec.get(f.name, f.default)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if f.name == "postprocess_background":
            ok = isinstance(value, bool)
        else:
            ok = numeric or (value is None and f.name != "launched_unix_s")
        if not ok:
            raise ValueError(f"{TRIAL_TIMES}: {f.name} {value!r} is not a time (seconds since the Unix epoch)")
        out[f.name] = value
    return TrialTimes(**out)


def compare_report_name(run_a: str) -> str:
    """``compare_vs_<A>.md``: the report ``postprocess_profile.py compare A B`` writes into B by default (``<A>``:
    the last component of A's absolute path)."""
    return f"compare_vs_{os.path.basename(os.path.abspath(run_a))}.md"


def previous_index(paths: list[str]) -> int:
    """The ``N`` :func:`keep_previous` gives ``paths`` now: the first from 1 for which no ``<stem>.prev<N><ext>``
    of them exists."""
    split = [os.path.splitext(p) for p in paths]
    n = 1
    while any(os.path.lexists(f"{stem}.prev{n}{ext}") for stem, ext in split):
        n += 1
    return n


def keep_previous(paths: list[str], one_copy: bool = False) -> int:
    """Rename each existing file ``<stem><ext>`` of ``paths`` (``ext`` its last suffix, e.g. ``.md``) to
    ``<stem>.prev<N><ext>``, one ``N`` for all: the first from 1 for which none of those names exists
    (:func:`previous_index`), so that nothing already written is overwritten; with ``one_copy``, ``N`` is 1 and
    replaces an earlier ``.prev1`` (one previous copy kept, the latest). Returns ``N``.

    Raises:
        OSError: a rename fails (the file's own error).
    """
    split = [os.path.splitext(p) for p in paths]
    n = 1 if one_copy else previous_index(paths)
    for path, (stem, ext) in zip(paths, split):
        if os.path.lexists(path):
            os.replace(path, f"{stem}.prev{n}{ext}")
    return n


def view_dir(out_dir: str, view: str) -> str:
    """``<out_dir>/<view>`` with the ``.chrome`` suffix of the view id dropped (``split_clean.chrome`` -> ``split_clean``)."""
    return os.path.join(out_dir, view.removesuffix(".chrome"))


def view_path(out_dir: str, rank: int, view: str, compress: bool = False) -> str:
    """Path of one view file: ``<out_dir>/<view>/rank<rank>.pt.trace.json[.gz]``."""
    return os.path.join(view_dir(out_dir, view), trace_name(rank, compress))


MERGED_VIEW = "all_ranks"  # the view that merges every rank's trace (sftprof.analysis.views.merged)


def merged_view_path(out_dir: str, compress: bool = False) -> str:
    """Path of the all-ranks view: ``<out_dir>/all_ranks/all_ranks.trace.json[.gz]``; not a ``*.pt.trace.json`` name,
    which TensorBoard's profiler plugin lists as one worker's trace (earlier releases wrote
    ``all_ranks.pt.trace.json``)."""
    return os.path.join(out_dir, MERGED_VIEW, f"{MERGED_VIEW}.trace.json" + (".gz" if compress else ""))


def window_path(path: str, k: int) -> str:
    """Time window ``k`` of the view file ``path``: ``<view folder>.part<k>/<same file name>``."""
    folder, name = os.path.split(path)
    return os.path.join(f"{folder}.part{k}", name)
