"""The SFT profiling loop: one process per rank under ``torchrun``.

``main(argv)`` (used by ``train_sft_profile.py --config FILE key=value ...``):

1. Load and validate the config, the model's HF config and the tokenizer *before* any process
   group starts: bad input exits with status 2 within seconds. The world size of the launch
   (``WORLD_SIZE``, 1 without torchrun) must equal the allocation mode's world size, and (rank 0) the
   trial's LOG_DIR must not hold an earlier trial's files (:func:`check_new_log_dir`).
2. Start the default process group (NCCL on CUDA, gloo on CPU), create LOG_DIR =
   ``<cluster.fileroot>/logs/<user>/<experiment_name>/<trial_name>/`` and (rank 0) write
   ``config.yaml`` (resolved config), ``environment.json`` (the recorded environment variables,
   :func:`sftprof.artifacts.recorded_environment`), ``versions.json`` (sftprof and its commit, Python, torch, its CUDA
   and NCCL, megatron-core, TE and the other packages the trial runs with: :func:`sftprof.versions.recorded_versions`),
   ``rank_coords.json``, ``trainer.log``, ``stats.jsonl``.
3. Seed Python, NumPy and torch with ``seed`` (same on every rank: identical initial weights
   for every layout), build the engine (:func:`sftprof.engine.build_engine`) and run
   ``total_train_steps`` steps on the fake sample (:mod:`sftprof.data`), profiling the chosen
   steps (:mod:`sftprof.capture.kernel`, :mod:`sftprof.capture.memory`). Every rank keeps its last progress in
   ``progress/rank<r>.json`` (:class:`sftprof.progress.RankProgress`) for the launcher's watchdog.
4. Always write the completion record to ``stats.jsonl``; on failure it says ``failed`` with the
   error and the process exits with status 1. After the ranks' barrier (a trial that did not fail) and the process
   group's teardown, rank 0 appends the teardown record; its atexit handler, registered first in ``main`` so run
   last, appends the exit record after it, the file's last line.

A simulated rank (``actor.simulate.rank`` >= 0, docs/simulated_rank.md) is one process (``WORLD_SIZE`` 1) that joins
torch's fake process group as that rank of the layout's world, profiles itself and writes the trial's files.

``stats.jsonl`` is written through :class:`sftprof.stats_log.StatsWriter`: one
:class:`sftprof.stats_log.StepRecord` per step (its fields and their units are listed there), a
:class:`sftprof.stats_log.CompletionRecord` after them, a :class:`sftprof.stats_log.TeardownRecord` and an
:class:`sftprof.stats_log.ExitRecord` at the end.
The file names in LOG_DIR come from :mod:`sftprof.artifacts` as well.
"""
from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import hashlib
import os
import random
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from sftprof import artifacts, simulated_comm, versions
from sftprof.allocation import parse_allocation_mode
from sftprof.stats_log import CompletionRecord, ExitRecord, StatsWriter, StepRecord, TeardownRecord
from sftprof.capture.gpu_sharing import other_processes
from sftprof.capture.kernel import KernelProfiler
from sftprof.capture.memory import MemoryProfiler
from sftprof.capture.oom import watch as watch_oom
from sftprof.cli import PipeSafeStreamHandler
from sftprof.compat import setup_transformer_engine
from sftprof.console import THIRD_PARTY, ConsoleFilter, capture_warnings, summary_line
from sftprof.config import ConfigError, exit_config_error, load_config_or_exit, to_yaml, trial_log_dir
from sftprof.data import global_loss_tokens, make_fake_sample, step_micro_batches
from sftprof.engine import build_engine
from sftprof.flops import gpu_peak_bf16_flops, mfu
from sftprof.capture.regions import STEP, region
from sftprof.models.checks import check_model
from sftprof.progress import RankProgress, StepProgress, duration_text
from sftprof.simulation import assumed

log = logging.getLogger("sftprof")

GIB = float(1 << 30)
HEARTBEAT_S = 20.0  # seconds between "still running" lines of a long step (rank 0)
SIMULATED_NOTE = ("simulated rank %d of %d (%s): collectives not run (torch's fake process group; outputs at their "
                  "real sizes); assumed: %s")


class _Terminated(RuntimeError):
    """SIGTERM arrived (torchrun stops the other ranks when one rank fails)."""


def _parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Profile SFT training steps (run one process per rank with torchrun).")
    p.add_argument("--config", required=True, help="YAML config path or bundled preset name (e.g. tiny_cpu)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. profile.fake_seq_len=8192")
    return p.parse_args(argv)


def _exit_config_error(msg: str) -> None:
    exit_config_error(msg)  # message and newline in one write: ranks print at once into one pipe


# What a trial writes into its LOG_DIR (besides nodes/, the drivers' end records): a log dir holding any of them was
# used by a trial before, and a new trial would replace them (trainer.log, config.yaml, stats.jsonl).
TRIAL_FILES = (artifacts.CONFIG_YAML, artifacts.STATS, artifacts.TRAINER_LOG, artifacts.RANK_COORDS,
               artifacts.ENVIRONMENT, artifacts.VERSIONS, artifacts.PERF_TRACER, artifacts.MEMORY_SNAPSHOTS,
               artifacts.PROGRESS)


def check_new_log_dir(cfg) -> None:
    """Refuse a trial whose LOG_DIR (:func:`sftprof.config.trial_log_dir`) already holds a trial's files
    (:data:`TRIAL_FILES`): a second trial of the same ``cluster.fileroot``, ``experiment_name`` and ``trial_name``
    would overwrite them. A missing or empty log dir (or one with only ``nodes/`` or other files) is accepted.

    Raises:
        ConfigError: naming the log dir, the files found and the settings that choose another one.
    """
    log_dir = trial_log_dir(cfg)
    found = [name for name in TRIAL_FILES if (log_dir / name).exists()] if log_dir.is_dir() else []
    if found:
        raise ConfigError(f"trial log dir {log_dir} already holds a trial's files ({', '.join(found)}): "
                          f"trial_name={cfg.trial_name!r} of experiment_name={cfg.experiment_name!r} ran before; "
                          "nothing was overwritten. Accepted: another trial_name (or experiment_name / cluster.fileroot), "
                          "whose log dir is new")


def _setup_logging(rank: int, log_dir: Path, lead: bool | None = None) -> None:
    """Console logging of ``rank``; ``trainer.log`` from the process that writes the trial's files (``lead``: rank 0
    when None; a simulated rank writes them itself)."""
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    out = PipeSafeStreamHandler(sys.stdout)  # a reader that stops early (| head) is no error of the run
    out.setFormatter(fmt)
    out.addFilter(ConsoleFilter())  # third-party messages: trainer.log only (sftprof.console)
    root.addHandler(out)
    capture_warnings()
    if (rank == 0) if lead is None else lead:
        fh = logging.FileHandler(log_dir / artifacts.TRAINER_LOG, mode="w")
        fh.setFormatter(fmt)
        root.addHandler(fh)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def nccl_version() -> Optional[str]:
    """torch's NCCL version (``torch.cuda.nccl.version()`` as text: ``"2.28.9"``, its suffix appended when it has one),
    None for a build of torch without NCCL (a CPU build) or when it cannot be read."""
    try:
        ver = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a CPU build has no torch._C._nccl_version
        return None
    return ".".join(map(str, ver[:3])) + "".join(map(str, ver[3:]))


def _memory_gib(device: torch.device) -> dict:
    if device.type != "cuda":  # no caching allocator to read: null in stats.jsonl, not a measured 0
        return {"allocated": None, "reserved": None, "peak_allocated": None, "peak_reserved": None}
    return {"allocated": torch.cuda.memory_allocated(device) / GIB,
            "reserved": torch.cuda.memory_reserved(device) / GIB,
            "peak_allocated": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved": torch.cuda.max_memory_reserved(device) / GIB}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_record(step: int, result, ranks: list, mem: dict, tokens: int, world_size: int, peak: float | None,
                 on_gpu: bool, profiled: bool, started_unix_s: float, profiler_s: float) -> StepRecord:
    """The step's :class:`sftprof.stats_log.StepRecord` (units there) from the engine's result, the ranks'
    gathered times and peaks, rank 0's allocator figures (``mem``, GiB), the GPU's peak FLOP/s, and rank 0's
    clock: the iteration's start and its time in the profilers (s)."""
    step_time = max(r["step_time_s"] for r in ranks)
    tflops = (result.model_flops / step_time / world_size / 1e12
              if result.model_flops is not None and on_gpu else None)
    recompute_tflops = (result.recompute_flops / step_time / world_size / 1e12
                        if result.recompute_flops is not None and on_gpu else None)
    return StepRecord(
        step=step, loss=result.loss, grad_norm=result.grad_norm if math.isfinite(result.grad_norm) else None,
        step_time_s=step_time, tokens=tokens, tokens_per_s=tokens / step_time,
        mem_allocated_gb=mem["allocated"], mem_reserved_gb=mem["reserved"],
        mem_peak_allocated_gb=mem["peak_allocated"], mem_peak_reserved_gb=mem["peak_reserved"], ranks=ranks,
        tflops_per_gpu=tflops,
        mfu=mfu(result.model_flops, step_time, world_size, peak) if tflops is not None else None,
        recompute_tflops_per_gpu=recompute_tflops, moe_load=result.moe_load, profiled=profiled,
        started_unix_s=started_unix_s, profiler_s=profiler_s)


def _step_line(r: StepRecord, result) -> str:
    """The human log line of a step (rank 0)."""
    mem_text = (f"mem GiB allocated {r.mem_allocated_gb:.2f} reserved {r.mem_reserved_gb:.2f} peak allocated "
                f"{r.mem_peak_allocated_gb:.2f} peak reserved {r.mem_peak_reserved_gb:.2f}"
                if r.mem_allocated_gb is not None else "mem n/a (CPU)")
    load = r.moe_load or {}
    load_text = (f" | MoE load max/mean {load['max_over_mean_max']:.2f} (layer {load['worst_layer']}), "
                 f"EP rank max/mean {load['ep_max_over_mean_max']:.2f}" if load.get("worst_layer") is not None else "")
    return (f"step {r.step} | loss {result.loss:.4f} | grad norm {result.grad_norm:.4f} | step time "
            f"{duration_text(r.step_time_s)} "
            f"| {r.tokens_per_s:.1f} tokens/s | {mem_text}"
            + (f" | {r.tflops_per_gpu:.1f} TFLOP/s/GPU" if r.tflops_per_gpu is not None else "") + load_text
            + (" | profiled" if r.profiled else ""))


def init_distributed(simulate: tuple[int, int] | None = None) -> tuple[int, torch.device]:
    """Start the default process group: NCCL on this rank's GPU when CUDA is available, else gloo.

    Under torchrun the ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` environment is used; without it a
    one-rank rendezvous on a free localhost port (single process: benchmarks, GPU tests). With ``simulate =
    (rank, world_size)`` this one process is that rank of that world on torch's fake process group (the backend
    of Megatron-LM's ``--fake-process-group``): every collective returns at once, its output allocated at its real
    size and filled as if every peer held this rank's data (:mod:`sftprof.simulated_comm`: receives, all-gathers,
    all-to-alls) or not reduced (all-reduce, reduce-scatter).

    Returns:
        ``(rank, device)``.
    """
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if simulate is not None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("fake", store=FakeStore(), rank=simulate[0], world_size=simulate[1])
        simulated_comm.install()
        return simulate[0], device
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, device


def destroy_process_groups(together: bool) -> None:
    """Destroy every process group (``dist.destroy_process_group()``). ``together``: every rank has passed the closing
    barrier, so each group is first shut down in a thread of its own, all at once. torch shuts NCCL groups down one
    after another, about 0.48 s each whether or not it ever ran a collective: megatron-core's 21 NCCL groups of a
    one-GPU trial took 8.9-9.1 s, in parallel 0.50 s (one H100, torch 2.11; bench/NOTES.md, thirtieth session).
    ``destroy_process_group`` then finds them shut down and only forgets them. A group whose shutdown raises is left
    to ``destroy_process_group``; a failed trial (not ``together``: a peer may still be inside a collective) goes
    straight to it, as before."""
    if together:
        groups = list(dist.distributed_c10d._world.pg_names)
        with ThreadPoolExecutor(max_workers=max(len(groups), 1), thread_name_prefix="pg_shutdown") as pool:
            shutdowns = [(pool.submit(pg.shutdown), pg) for pg in groups]
        for future, pg in shutdowns:
            if future.exception() is not None:
                log.warning("process group %s: shutdown failed (%s); destroy_process_group shuts it down",
                            dist.distributed_c10d._world.pg_names.get(pg, "?"), future.exception())
    dist.destroy_process_group()


def check_plan_config(path: str) -> None:
    """A trial the driver planned loads ``RUN_ROOT/plan_config.yaml``, whose sha256 at plan time is in
    ``SFTPROF_PLAN_CONFIG_SHA256``: a copy edited since (read-only does not stop root) exits 2 before anything runs,
    so no trial runs other settings than its plan's and folder names say. Without the variable nothing is checked."""
    want = os.environ.get(artifacts.PLAN_CONFIG_SHA256_ENV)
    if not want:
        return
    try:
        got = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as err:
        _exit_config_error(f"--config {path}: {err}")
    if got != want:
        _exit_config_error(f"--config {path}: changed since the driver planned this run (sha256 {got[:12]}, planned "
                           f"{want[:12]}); nothing was run: run the driver again for other settings")


def main(argv: Optional[List[str]] = None, started_unix_s: Optional[float] = None) -> int:
    """Run one trial (see module docstring). ``started_unix_s``: the process's start, before its imports (seconds
    since the Unix epoch; ``train_sft_profile.py`` passes it), recorded in the completion record. Returns 0; exits 2
    on bad input, 1 on failure."""
    times = {"trainer_started_unix_s": started_unix_s, "imports_done_unix_s": time.time()}
    exit_clock = _ExitClock()
    if int(os.environ.get("RANK", "0")) == 0:  # the lead (a simulated rank runs alone): registered first, runs last
        atexit.register(exit_clock)
    args = _parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    check_plan_config(args.config)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes the log dir; the others may start after it began
        try:
            check_new_log_dir(cfg)
        except ConfigError as err:
            _exit_config_error(str(err))
    # Inputs checked before any process group: every failure here is bad input (exit 2).
    layout = parse_allocation_mode(cfg.actor.backend)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    simulated = cfg.actor.simulate.rank >= 0
    if simulated:
        if world != 1:
            _exit_config_error(f"actor.simulate.rank={cfg.actor.simulate.rank}: a simulated rank runs alone, but "
                               f"WORLD_SIZE={world}: launch one process (torchrun --nproc-per-node 1)")
        # the simulated rank is the one profiled, whatever rank spec the config held
        cfg.perf_tracer.ranks = cfg.memory_profiler.ranks = str(cfg.actor.simulate.rank)
    elif world != layout.world_size:
        _exit_config_error(f"actor.backend={cfg.actor.backend!r} needs {layout.world_size} ranks ({layout.describe()}), "
                           f"but WORLD_SIZE={world}: launch with torchrun --nproc-per-node (x nodes) = {layout.world_size}")
    te_notes: List[str] = []
    try:
        if layout.backend == "megatron":  # before anything imports megatron-core (which imports TE)
            _, te_notes = setup_transformer_engine(cfg.actor.megatron.transformer_impl)
        hf_config, tokenizer = check_model(cfg, layout, bundled_tokenizer=True)
        sample = make_fake_sample(tokenizer, cfg.profile.fake_seq_len, cfg.profile.fake_loss_start_ratio,
                                  hf_config.vocab_size)
    except (ConfigError, ValueError, OSError) as err:
        _exit_config_error(str(err))

    rank, device = init_distributed((cfg.actor.simulate.rank, layout.world_size) if simulated else None)
    log_dir = trial_log_dir(cfg)
    log_dir.mkdir(parents=True, exist_ok=True)
    lead = simulated or rank == 0  # the process that writes the trial's files
    _setup_logging(rank, log_dir, lead=lead)
    for note in te_notes if lead else ():
        log.info(note)
    if simulated:
        log.info(SIMULATED_NOTE, rank, layout.world_size, cfg.actor.backend, assumed(layout.backend))
    status, barrier_done = 1, None
    try:
        status = _run(cfg, layout, hf_config, tokenizer.source, sample, rank, device, log_dir, times)
        if status == 0:
            # Leave together: a rank that tears its process group down while another still works (rank 0
            # exporting its trace) can abort inside gloo ("terminate called without an active exception").
            dist.barrier()
            barrier_done = time.time()
    finally:
        destroy_process_groups(together=barrier_done is not None)
        if lead and _append_record(log_dir / artifacts.STATS, TeardownRecord(
                barrier_done_unix_s=barrier_done, process_group_destroyed_unix_s=time.time())):
            exit_clock.path = log_dir / artifacts.STATS
    return status


def _append_record(path: Path, record: TeardownRecord | ExitRecord) -> bool:
    """Append ``record`` (the teardown or exit record) to ``stats.jsonl`` at ``path``. Returns whether it was written;
    a file that cannot be written is a warning in the log naming the record, nothing is raised: the trial's exit status
    stays its own."""
    try:
        writer = StatsWriter(path, append=True)
        writer.write(record)
        writer.close()
    except OSError as err:
        log.warning("%s record not written to %s: %s", record.TYPE, artifacts.STATS, err)
        return False
    return True


class _ExitClock:
    """The ``atexit`` handler that appends the :class:`sftprof.stats_log.ExitRecord` to ``path`` (``stats.jsonl``),
    set once the teardown record is written (None: nothing is written, the file keeps its end). Registered first in
    ``main``, it runs after the later registered handlers (torch's compile workers shut down) and before logging's
    (registered at its import); :func:`_append_record` writes it."""

    def __init__(self) -> None:
        self.path: Optional[Path] = None

    def __call__(self) -> None:
        if self.path is not None:
            _append_record(self.path, ExitRecord(atexit_done_unix_s=time.time()))


def _run(cfg, layout, hf_config, tokenizer_source, sample, rank, device, log_dir, times: dict) -> int:
    """The trial's steps on this rank (module docstring); ``times``: the completion record's ``*_unix_s`` so far
    (:class:`sftprof.stats_log.CompletionRecord`), completed here. Returns 0, or 1 when the trial failed."""
    simulated = cfg.actor.simulate.rank >= 0
    lead = simulated or rank == 0  # the process that writes the trial's files
    stats = StatsWriter(log_dir / artifacts.STATS) if lead else None
    kernel_steps = list(cfg.perf_tracer.profile_steps) if cfg.perf_tracer.enabled else []
    mem_steps = list(cfg.memory_profiler.profile_steps)
    profile_kind = "kernel" if kernel_steps else "memory" if mem_steps else None
    profile_step = min(kernel_steps or mem_steps) if profile_kind else None
    steps_done, error = 0, None

    def on_sigterm(signum, frame):
        raise _Terminated("terminated by SIGTERM (another rank failed or the launcher stopped the trial)")

    signal.signal(signal.SIGTERM, on_sigterm)
    progress = StepProgress(heartbeat_s=HEARTBEAT_S)  # started on rank 0 once the engine is built
    rank_progress = RankProgress(artifacts.progress_path(log_dir, rank), rank)  # every rank: the watchdog reads it
    rank_progress.start("setup")
    try:
        coords = layout.rank_coords(rank)
        if lead:
            (log_dir / artifacts.CONFIG_YAML).write_text(to_yaml(cfg))
            (log_dir / artifacts.ENVIRONMENT).write_text(json.dumps(artifacts.recorded_environment(os.environ),
                                                                    indent=1) + "\n")
            (log_dir / artifacts.VERSIONS).write_text(json.dumps(versions.recorded_versions(
                torch.version.cuda, nccl_version()), indent=1) + "\n")
            (log_dir / artifacts.RANK_COORDS).write_text(json.dumps({
                "world_size": layout.world_size, "allocation_mode": cfg.actor.backend, "backend": layout.backend,
                "ranks": {str(r): layout.rank_coords(r) for r in range(layout.world_size)},
                **({"simulated_rank": rank} if simulated else {})}, indent=1))
            log.info("trial %s/%s: %s, %s, model %s (%d layers), tokenizer: %s, LOG_DIR %s", cfg.experiment_name,
                     cfg.trial_name, cfg.actor.backend, layout.describe(), cfg.actor.path,
                     hf_config.num_hidden_layers, tokenizer_source, log_dir)
        _seed(cfg.seed)
        kernel = KernelProfiler(cfg, layout, rank, log_dir)
        memory = MemoryProfiler(cfg, layout, rank, coords, log_dir, device)
        watch_oom(rank, coords, log_dir, device)  # a CUDA out-of-memory error leaves a snapshot in any trial
        t_build = time.perf_counter()
        times["engine_build_started_unix_s"] = time.time()
        engine = build_engine(cfg, layout, hf_config, device)
        if lead:
            log.info("engine built in %.1f s; %d step(s) to run", time.perf_counter() - t_build, cfg.total_train_steps)
            progress.start()
        loss_tokens = global_loss_tokens(sample, cfg.train_dataset.batch_size)
        tokens = cfg.train_dataset.batch_size * cfg.profile.fake_seq_len
        peak = gpu_peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        for step in range(cfg.total_train_steps):
            started = time.time()
            mbs = step_micro_batches(cfg, sample, step, layout.dp, coords["dp"])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            progress.begin_step(step)
            rank_progress.mark("step start", step)
            t_profilers = time.perf_counter()
            with kernel.step(step), memory.step(step):
                # Timed inside the profilers: their start/stop, trace export and snapshot dump stay out.
                t0 = time.perf_counter()
                with region(STEP):
                    result = engine.train_step(mbs, loss_tokens)
                    _sync(device)
                dt = time.perf_counter() - t0
            profiler_s = time.perf_counter() - t_profilers - dt
            progress.end_step()
            rank_progress.mark("step records (profiler export, snapshot, all_gather of the step's figures)")
            mem = _memory_gib(device)
            mine = {"rank": rank, "step_time_s": dt, "mem_peak_allocated_gb": mem["peak_allocated"],
                    "mem_peak_reserved_gb": mem["peak_reserved"],
                    "gpu_others": other_processes(device) if device.type == "cuda" else None}
            ranks = [mine] if simulated else [None] * dist.get_world_size()
            if not simulated:
                dist.all_gather_object(ranks, mine)
            steps_done = step + 1
            if not lead:
                continue
            record = _step_record(step, result, ranks, mem, tokens, layout.world_size, peak, device.type == "cuda",
                                  kernel.is_profiled(step) or memory.is_profiled(step), started, profiler_s)
            stats.write(record)
            log.info(_step_line(record, result))
        if mem_steps:
            log.info("memory profiler: %d snapshot(s) written on rank %d", memory.snapshots_written, rank)
    except BaseException as err:  # includes _Terminated (SIGTERM) and KeyboardInterrupt
        error = f"{type(err).__name__}: {err}"
        log.exception("trial failed after %d completed step(s): %s", steps_done, error)
        if not isinstance(err, Exception):
            raise  # after the finally below has written the failed completion record
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        progress.stop()
        rank_progress.stop("failed" if error else "finished")
        if lead and summary_line():
            THIRD_PARTY.info(summary_line())
        if stats is not None:
            stats.write(CompletionRecord(status="failed" if error else "ok", error=error, steps_done=steps_done,
                                         world_size=layout.world_size, backend=layout.backend, device=device.type,
                                         profile_kind=profile_kind, profile_step=profile_step, **times,
                                         ended_unix_s=time.time()))
            stats.close()
    return 1 if error else 0
