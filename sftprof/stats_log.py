"""``stats.jsonl``, rank 0's record of a trial's steps (``LOG_DIR/stats.jsonl``, :data:`sftprof.artifacts.STATS`).

One JSON object a line, each with its ``type``: a :class:`StepRecord` per training step (every field with its unit),
then a :class:`CompletionRecord` (after the steps), a :class:`TeardownRecord` (the process group torn down) and an
:class:`ExitRecord` (the last line: the process's atexit handlers run). Written by :class:`StatsWriter` (the trainer,
rank 0), read back by :func:`read_stats` (:class:`StatsLog`). Torch-free and importing nothing of sftprof, as
:mod:`sftprof.artifacts`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Optional


class _Record:
    """A line of ``stats.jsonl``: :meth:`to_json` gives ``{"type": TYPE, <field>: value, ...}`` in field order."""

    TYPE = ""

    def to_json(self) -> dict:
        """The line's object: ``{"type": TYPE, <field>: value, ...}`` in field order (the line the trainer writes)."""
        return {"type": self.TYPE, **{f.name: getattr(self, f.name) for f in fields(self)}}  # type: ignore[arg-type]


def _unit(unit: str, default: Any = None) -> Any:
    return field(default=default, metadata={"unit": unit})


@dataclass(frozen=True)
class StepRecord(_Record):
    """One training step, written by rank 0 after the step (``{"type": "step", ...}``).

    Every field's unit is in its ``metadata["unit"]`` (:func:`field_units`). Memory figures are GiB
    (2^30 bytes) from rank 0's CUDA caching allocator (None on CPU: no allocator, not a measured 0); the
    step time is the slowest rank's; throughput figures are None on CPU or when the engine counts no FLOPs.
    Records written by earlier releases may lack fields: they read as None.
    """

    step: int = _unit("step index, from 0")
    loss: float = _unit("nats: global token-mean of -logprob over the step's loss tokens")
    grad_norm: Optional[float] = _unit("L2 norm of all gradients before clipping (None when not finite)")
    step_time_s: float = _unit("s: wall time of the step, slowest rank, device synchronised")
    tokens: int = _unit("tokens of the global batch (train_dataset.batch_size * profile.fake_seq_len)")
    tokens_per_s: float = _unit("tokens/s: tokens / step_time_s")
    mem_allocated_gb: Optional[float] = _unit("GiB allocated after the step, rank 0")
    mem_reserved_gb: Optional[float] = _unit("GiB reserved after the step, rank 0")
    mem_peak_allocated_gb: Optional[float] = _unit("GiB peak allocated during the step, rank 0")
    mem_peak_reserved_gb: Optional[float] = _unit("GiB peak reserved during the step, rank 0")
    ranks: Optional[list] = _unit("per rank: {rank, step_time_s (s), mem_peak_allocated_gb, mem_peak_reserved_gb (GiB), "
                                  "gpu_others: {pids, mib} of processes not of this trial on the rank's GPU after "
                                  "the step (MiB; None: unknown, sftprof.capture.gpu_sharing)}")
    tflops_per_gpu: Optional[float] = _unit("TFLOP/s per GPU: model FLOPs / step_time_s / world size / 1e12")
    mfu: Optional[float] = _unit("fraction: tflops_per_gpu / the GPU's peak dense BF16 TFLOP/s (sftprof.flops)")
    recompute_tflops_per_gpu: Optional[float] = _unit("TFLOP/s per GPU re-run by activation recompute (not in mfu)")
    moe_load: Optional[dict] = _unit("routing load summed over ranks (sftprof.models.layers.routing.RoutingLoadMeter)")
    profiled: bool = _unit("whether the step was a kernel- or memory-profile step", False)
    started_unix_s: Optional[float] = _unit("s since the Unix epoch: rank 0's clock when the step's loop iteration "
                                            "began (its micro-batches made, then the profilers, the step, the "
                                            "all_gather of the ranks' figures); the next step's start ends it")
    profiler_s: Optional[float] = _unit("s: rank 0's wall time in the profilers around the timed step (starting or "
                                        "stepping torch's profiler, exporting its trace, dumping the allocator "
                                        "snapshot); not in step_time_s")

    TYPE = "step"


@dataclass(frozen=True)
class CompletionRecord(_Record):
    """The line of ``stats.jsonl`` after the steps (``{"type": "complete", ...}``), written even when the trial fails;
    only the :class:`TeardownRecord` follows it.

    Attributes:
        status: ``ok`` or ``failed``.
        error: ``"<ExceptionType>: <message>"`` of the failure, None when ok.
        steps_done: steps finished (count).
        world_size: ranks of the trial.
        backend: ``fsdp`` or ``megatron``.
        device: ``cuda`` or ``cpu``.
        profile_kind: ``kernel``, ``memory`` or None (nothing profiled).
        profile_step: the (first) profiled step, or None.
        trainer_started_unix_s: rank 0's process start (``train_sft_profile.py``'s first line, before its imports),
            seconds since the Unix epoch; None when the trainer was started otherwise (``main`` called directly).
        imports_done_unix_s: ``main`` entered (the imports done).
        engine_build_started_unix_s: the engine's build began (config, model checks and process group done); None
            when the trial failed before.
        ended_unix_s: this record written (the step loop over; the process group's teardown follows).

    The ``*_unix_s`` fields are rank 0's clock (the simulated rank's in a simulated trial); None in records of earlier
    releases.
    """

    status: str = "failed"
    error: Optional[str] = None
    steps_done: int = 0
    world_size: Optional[int] = None
    backend: Optional[str] = None
    device: Optional[str] = None
    profile_kind: Optional[str] = None
    profile_step: Optional[int] = None
    trainer_started_unix_s: Optional[float] = None
    imports_done_unix_s: Optional[float] = None
    engine_build_started_unix_s: Optional[float] = None
    ended_unix_s: Optional[float] = None

    TYPE = "complete"


@dataclass(frozen=True)
class TeardownRecord(_Record):
    """The line of ``stats.jsonl`` after the completion record (``{"type": "teardown", ...}``): rank 0's clock (the
    simulated rank's) as the trainer's ``main`` leaves; the process's and torchrun's exit follow (only the
    :class:`ExitRecord` after it). Appended after the process group is torn down, so a trial killed before (or a log
    of an earlier release) has none.

    Attributes:
        barrier_done_unix_s: the ranks' barrier after the steps passed, seconds since the Unix epoch; None when no
            barrier ran (the trial failed).
        process_group_destroyed_unix_s: ``dist.destroy_process_group()`` returned (every process group, Megatron's
            included, and its communicators torn down).
    """

    barrier_done_unix_s: Optional[float] = None
    process_group_destroyed_unix_s: Optional[float] = None

    TYPE = "teardown"


@dataclass(frozen=True)
class ExitRecord(_Record):
    """The last line of ``stats.jsonl`` (``{"type": "exit", ...}``): rank 0's clock (the simulated rank's) in the
    trainer's first registered ``atexit`` handler, so the last to run: after ``main`` returned, the process's
    non-daemon threads joined and every later registered atexit handler (torch's compile workers shut down among
    them); Python's finalisation (modules torn down, the CUDA context destroyed), the process's end and torchrun's
    exit follow. Written only after a :class:`TeardownRecord`; a trial killed before (or a log of an earlier release)
    has none.

    Attributes:
        atexit_done_unix_s: the handler ran, seconds since the Unix epoch.
    """

    atexit_done_unix_s: Optional[float] = None

    TYPE = "exit"


def field_units(record_type: type = StepRecord) -> dict[str, str]:
    """``{field: unit and meaning}`` of a record type, from its field metadata."""
    return {f.name: f.metadata.get("unit", "") for f in fields(record_type)}


def _from_json(record_type: type, rec: dict):
    return record_type(**{f.name: rec.get(f.name, f.default) for f in fields(record_type)})


class StatsWriter:
    """Writes ``stats.jsonl``: one JSON line per record, flushed at once (a crash loses no written step).

    Args:
        path: the file (``LOG_DIR/stats.jsonl``); created or truncated.
        append: append to the file instead (the :class:`TeardownRecord` and :class:`ExitRecord`, after the writer
            of the steps closed it).
    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self._f: IO[str] | None = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: StepRecord | CompletionRecord | TeardownRecord | ExitRecord) -> None:
        """Append ``record.to_json()`` as one line and flush."""
        self._f.write(json.dumps(record.to_json()) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._f is not None:
            self._f.close()
            self._f = None


def is_step_index(value: Any) -> bool:
    """Whether ``value`` is a step index as :class:`StepRecord` holds it: a non-negative ``int`` (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class StatsLog:
    """``stats.jsonl`` as read back: the step records in file order, the last completion record (None when
    the trial never wrote one: it was killed), the last teardown and exit records (None: killed before them, or a
    log of an earlier release) and the count of lines that are not a JSON object of a known
    type, or are a step record whose ``step`` is not a non-negative integer (``bad_lines``: counted and left
    out, never fatal)."""

    steps: list[StepRecord] = field(default_factory=list)
    completion: Optional[CompletionRecord] = None
    teardown: Optional[TeardownRecord] = None
    exit: Optional[ExitRecord] = None
    bad_lines: int = 0


def read_stats(path: str | Path) -> StatsLog:
    """Read ``stats.jsonl`` (:class:`StatsLog`).

    Raises:
        OSError: the file is missing or unreadable (callers decide what a missing file means).
    """
    out = StatsLog()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                out.bad_lines += 1
                continue
            kind = rec.get("type") if isinstance(rec, dict) else None
            if kind == StepRecord.TYPE and is_step_index(rec.get("step")):
                out.steps.append(_from_json(StepRecord, rec))
            elif kind == CompletionRecord.TYPE:
                out.completion = _from_json(CompletionRecord, rec)
            elif kind == TeardownRecord.TYPE:
                out.teardown = _from_json(TeardownRecord, rec)
            elif kind == ExitRecord.TYPE:
                out.exit = _from_json(ExitRecord, rec)
            else:
                out.bad_lines += 1
    return out
