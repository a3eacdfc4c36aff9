"""The projected step of a rank: a simulated rank's measured compute plus the communication its layout needs.

Arithmetic on recorded numbers (no torch): the simulated trial (``actor.simulate.rank``) measured the rank's
compute time (its step with collectives not run) and its peak memory; :func:`sftprof.analysis.time.rank_plan.rank_plan`
gives every collective the real rank would run (process group, bytes, calls). Here:

- a collective's time per call is ``bytes (n - 1) / n / bandwidth + latency`` (the bytes that leave each rank,
  ``bench/collectives.py``'s rule; ``bytes`` for send/recv), with the bandwidth of its interconnect at the nearest
  measured size (:data:`INTERCONNECTS`: NVLink measured in bench/NOTES.md, InfiniBand stated, not measured) and
  the InfiniBand figure for every group whose ranks span nodes (``cluster.n_gpus_per_node`` ranks a node);
- its exposed time is all of it, except for collectives the settings overlap, which hide behind their window
  (``backward``: ``ddp.overlap_grad_reduce``; ``forward``: ``ddp.overlap_param_gather``; ``cp_attention``: the
  K/V gather of ``cp_comm_overlap``) up to that window's measured compute, 0 when it was not measured;
- projected step = compute + exposed; the serial bound = compute + all communication;
- memory: the measured peak plus NCCL's buffers, which torch's allocator does not see, estimated per communicator
  (:func:`nccl_buffer_bytes`); and the real rank's need (:func:`real_rank_memory`): the measured peak reserved, plus
  what a process with real process groups holds outside PyTorch's allocator
  (:func:`sftprof.analysis.memory.fit.outside_pytorch_gib`: the one-GPU figure by the megatron-core the trial
  recorded in ``versions.json``, against the simulated process's
  :data:`sftprof.analysis.memory.fit.OUTSIDE_PYTORCH_GIB_SIMULATED`), plus those NCCL buffers, with whether it fits
  one GPU's capacity (nvidia-smi's total less :data:`sftprof.analysis.memory.fit.DRIVER_RESERVED_GIB`).

Not modelled (named in ``assumptions``): waiting for slower ranks (routing imbalance, a PP bubble), contention
between concurrent collectives, link rates of message sizes outside the measured range (the nearest is used).
The summary of a simulated trial holds it (:func:`simulation_summary`); ``python -m sftprof.analysis.time.projection
TRIAL_LOG_DIR`` prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.memory.fit import (DRIVER_RESERVED_GIB, OUTSIDE_PYTORCH_GIB_SIMULATED, megatron_core_release,
                                         outside_pytorch_gib)
from sftprof.analysis.trial import inputs
from sftprof.analysis.time.rank_plan import rank_plan
from sftprof.artifacts import STATS
from sftprof.stats_log import read_stats
from sftprof.simulation import assumed

__all__ = ["INTERCONNECTS", "collective_ms", "nccl_buffer_bytes", "real_rank_memory", "project", "project_trial",
           "overlap_windows", "simulation_summary", "render", "real_rank_text", "new_file_problem", "print_and_write",
           "main"]

_MIB = float(1 << 20)
_GIB = float(1 << 30)

# GB/s (1e9 B/s) per collective at MiB per rank, and a latency per call (ms).
INTERCONNECTS: dict[str, dict[str, Any]] = {
    "nvlink": {
        "source": "bench/NOTES.md, tenth session: bench/collectives.py on 2x H200 (NV18), NCCL 2.28.9, default settings",
        "latency_ms": 0.02,
        "gbps": {"all_to_all": {64: 186, 256: 261, 512: 283}, "all_gather": {512: 247},
                 "reduce_scatter": {512: 235}, "all_reduce": {512: 235 / 2}, "send_recv": {512: 271}}},
    "infiniband": {
        "source": "stated, not measured: 400 Gb/s NDR per GPU at 80 % (40 GB/s per direction)",
        "latency_ms": 0.05,
        "gbps": {kind: {512: 40.0 / (2 if kind == "all_reduce" else 1)}
                 for kind in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "send_recv")}},
}
NCCL_BUFFSIZE = 4 << 20  # NCCL_BUFFSIZE's default
NCCL_CHANNELS = 16  # assumed channels per communicator


def collective_ms(kind: str, nbytes: float, group_size: int, link: dict[str, Any]) -> tuple[float, float]:
    """``(ms per call, GB/s used)`` of one collective of ``nbytes`` per rank over ``group_size`` ranks on ``link``
    (an :data:`INTERCONNECTS` entry): the measured size nearest to ``nbytes`` in MiB gives the rate.

    Raises:
        KeyError: a collective kind the table does not list.
    """
    rates = link["gbps"][kind]
    nearest = min(rates, key=lambda mib: abs(mib - nbytes / _MIB))
    gbps = rates[nearest]
    leaving = nbytes if kind == "send_recv" else nbytes * (group_size - 1) / group_size
    return leaving / (gbps * 1e9) * 1e3 + link["latency_ms"], gbps


def nccl_buffer_bytes(collectives: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """NCCL's device buffers of the rank's communicators (one per distinct process group of ``collectives``):
    ``2 x NCCL_CHANNELS x NCCL_BUFFSIZE`` each, plus ``2 x NCCL_BUFFSIZE`` per peer of a group that runs
    all-to-all or send/recv (point-to-point buffers). An estimate, never measured here; returns bytes and the
    formula of each communicator."""
    groups: dict[str, dict[str, Any]] = {}
    for c in collectives:
        g = groups.setdefault(c["group"], {"size": c["group_size"], "p2p": False})
        g["p2p"] |= c["collective"] in ("all_to_all", "send_recv")
    total, lines = 0, []
    for name, g in sorted(groups.items()):
        n = 2 * NCCL_CHANNELS * NCCL_BUFFSIZE + (2 * (g["size"] - 1) * NCCL_BUFFSIZE if g["p2p"] else 0)
        total += n
        lines.append(f"{name} ({g['size']} ranks): 2 x {NCCL_CHANNELS} channels x 4 MiB"
                     + (f" + 2 x {g['size'] - 1} peers x 4 MiB" if g["p2p"] else "") + f" = {n / _MIB:.0f} MiB")
    return total, lines


def real_rank_memory(peak_reserved_gib: Optional[float], nccl_gib: float, capacity_bytes: Optional[int],
                     versions: Optional[Mapping[str, Any]]) -> tuple[dict[str, Any], str]:
    """What the real rank would need (GiB): the simulated rank's measured ``peak_reserved_gib`` + what a process with
    real process groups holds outside PyTorch's allocator (:func:`sftprof.analysis.memory.fit.outside_pytorch_gib` of
    the trial's recorded ``versions``; None: not recorded) + ``nccl_gib`` (its NCCL buffers), and whether that fits
    ``capacity_bytes`` (one GPU's; None: unknown).

    Returns:
        ``({"measured_peak_reserved_gib", "outside_pytorch_gib", "real_rank_need_gib", "capacity_gib", "fits"},
        the assumption in words)``; the need and ``fits`` are None without a measured peak reserved (CPU), ``fits``
        too without a capacity.
    """
    outside_gib = outside_pytorch_gib(versions)
    need = None if peak_reserved_gib is None else peak_reserved_gib + outside_gib + nccl_gib
    capacity = None if capacity_bytes is None else capacity_bytes / _GIB
    words = (f"the real rank needs the measured peak reserved + {outside_gib:.2f} GiB outside PyTorch's allocator (a "
             f"process with real process groups, one GPU, by {megatron_core_release(versions)[1]}: "
             f"sftprof/analysis/memory/fit.py; the simulated process holds {OUTSIDE_PYTORCH_GIB_SIMULATED} GiB) + the "
             "NCCL buffers above, against " + ("no known capacity (no nvidia-smi GPU)" if capacity is None else
                                                f"{capacity:.2f} GiB (nvidia-smi's total less {DRIVER_RESERVED_GIB} "
                                                "GiB)"))
    return {"measured_peak_reserved_gib": peak_reserved_gib, "outside_pytorch_gib": outside_gib,
            "real_rank_need_gib": need, "capacity_gib": capacity,
            "fits": None if need is None or capacity is None else need <= capacity}, words


def project(plan: dict[str, Any], compute_ms: float, peak_gib: Optional[float], gpus_per_node: int,
            windows_ms: Optional[dict[str, float]] = None, measured_mfu: Optional[float] = None, *,
            peak_reserved_gib: Optional[float] = None, capacity_bytes: Optional[int] = None,
            versions: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The projected step of the rank of ``plan`` (module docstring).

    Args:
        plan: :func:`sftprof.analysis.time.rank_plan.rank_plan`'s result.
        compute_ms: the simulated rank's measured step time (collectives not run), ms.
        peak_gib: its measured peak allocated memory (GiB), None when not measured (CPU).
        gpus_per_node: ranks per node (a group over more than one node runs at the InfiniBand rate).
        windows_ms: measured compute of the overlap windows (``forward``, ``backward``, ``cp_attention``), ms.
        measured_mfu: the simulated step's MFU (its model FLOPs per GPU over ``compute_ms``); the projected MFU is
            it scaled by ``compute_ms / projected``.
        peak_reserved_gib, capacity_bytes, versions: the real rank's need (:func:`real_rank_memory`): the
            measured peak reserved (GiB, None when not measured), one GPU's capacity (bytes, None: unknown), the
            trial's recorded versions (None: not recorded, the installed megatron-core's figure).
    Returns:
        ``{"rows": [...], "compute_ms", "communication_ms", "exposed_ms", "projected_step_ms", "serial_step_ms",
        "mfu", "memory": {...}, "assumptions": [...]}``; each row ``{"group", "collective", "interconnect",
        "calls", "mib_per_call", "gbps", "ms", "exposed_ms", "overlap"}``; ``memory``: the measured peak allocated,
        the NCCL buffers, their sum, and :func:`real_rank_memory`'s members.
    Raises:
        ValueError: ``compute_ms`` is not positive or ``gpus_per_node`` < 1.
    """
    if not compute_ms > 0 or gpus_per_node < 1:
        raise ValueError(f"compute_ms={compute_ms}, gpus_per_node={gpus_per_node}: both must be > 0")
    windows = dict(windows_ms or {})
    left = {w: windows.get(w, 0.0) for w in ("forward", "backward", "cp_attention")}
    rows = []
    for c in plan["collectives"]:
        link = "nvlink" if len({r // gpus_per_node for r in c["ranks"]}) == 1 else "infiniband"
        per_call, gbps = collective_ms(c["collective"], c["bytes_per_call"], c["group_size"], INTERCONNECTS[link])
        ms = per_call * c["calls"]
        hidden = 0.0
        if c["overlap"] != "none":
            hidden = min(ms, left[c["overlap"]])
            left[c["overlap"]] -= hidden
        rows.append({"group": c["group"], "collective": c["collective"], "interconnect": link, "calls": c["calls"],
                     "mib_per_call": c["bytes_per_call"] / _MIB, "gbps": gbps, "ms": ms, "exposed_ms": ms - hidden,
                     "overlap": c["overlap"]})
    comm = sum(r["ms"] for r in rows)
    exposed = sum(r["exposed_ms"] for r in rows)
    projected = compute_ms + exposed
    world = plan["world_size"]
    mfu = measured_mfu * compute_ms / projected if measured_mfu is not None else None
    nccl, nccl_lines = nccl_buffer_bytes(plan["collectives"])
    real, real_words = real_rank_memory(peak_reserved_gib, nccl / _GIB, capacity_bytes, versions)
    assumptions = list(plan["assumptions"]) + [
        f"{name}: {link['source']}" for name, link in INTERCONNECTS.items()
        if any(r["interconnect"] == name for r in rows)] + [
        "not modelled: waiting for slower ranks (routing imbalance, pipeline bubble), concurrent collectives sharing "
        "links; message sizes outside the measured ones take the nearest size's rate",
        "overlapped collectives hide behind their window's measured compute: "
        + ", ".join(f"{w} {windows[w]:.1f} ms" if w in windows else f"{w} not measured (0 ms hidden)"
                    for w in ("forward", "backward", "cp_attention")),
        f"NCCL buffers estimated, not measured: {'; '.join(nccl_lines) or 'no communicator'}", real_words]
    return {"rank": plan["rank"], "world_size": world, "rows": rows, "compute_ms": compute_ms,
            "communication_ms": comm, "exposed_ms": exposed, "projected_step_ms": projected,
            "serial_step_ms": compute_ms + comm, "mfu": mfu,
            "memory": {"measured_peak_gib": peak_gib, "nccl_buffers_gib": nccl / _GIB,
                       "projected_peak_gib": None if peak_gib is None else peak_gib + nccl / _GIB, **real},
            "assumptions": assumptions}


NOT_RUN = ("collectives: torch's fake process group returned each at once, its output allocated at its real size and "
           "filled as if every peer held this rank's data (sftprof.simulated_comm); all-reduces and reduce-scatters "
           "did not reduce")


def project_trial(log_dir: str | Path, cfg: dict[str, Any], model: inputs.TrialModel, step: Optional[int] = None,
                  have_te: Optional[bool] = None, windows_ms: Optional[dict[str, float]] = None,
                  capacity_bytes: Optional[int] = None) -> dict[str, Any]:
    """:func:`project` of a simulated trial (``cfg``: its ``config.yaml``, ``model`` its model) from its
    ``stats.jsonl``: compute = the step time of ``step`` (the last step recorded when None), peak = its
    ``mem_peak_allocated_gb`` (and ``mem_peak_reserved_gb``, the real rank's need), the MFU scaled from its measured
    one; ``have_te``: Transformer Engine in the trial (:func:`sftprof.analysis.time.rank_plan.rank_plan`);
    ``windows_ms``: the overlap windows measured, ``capacity_bytes``: one GPU's (None: unknown) (:func:`project`,
    with the versions of its ``versions.json``).

    Raises:
        ValueError: the trial is not a simulated one (``actor.simulate.rank`` < 0) or recorded no such step.
        OSError: ``stats.jsonl`` is missing.
        Exception: what loading the model raised (:meth:`sftprof.analysis.trial.inputs.TrialModel.config`).
    """
    a = cfg["actor"]
    rank = int((a.get("simulate") or {}).get("rank", -1))
    if rank < 0:
        raise ValueError(f"{log_dir}: actor.simulate.rank={rank}: not a simulated trial (accepted: a rank >= 0)")
    steps = [s for s in read_stats(Path(log_dir) / STATS).steps if step is None or s.step == step]
    if not steps:
        raise ValueError(f"{log_dir}: {STATS} holds no record of step {'(any)' if step is None else step}")
    rec = steps[-1]
    layout = parse_allocation_mode(a["backend"])
    plan = rank_plan(cfg, model.config(), layout, rank, have_te)
    return project(plan, 1e3 * rec.step_time_s, rec.mem_peak_allocated_gb, int(a["simulate"]["gpus_per_node"]),
                   windows_ms, measured_mfu=rec.mfu, peak_reserved_gib=rec.mem_peak_reserved_gb,
                   capacity_bytes=capacity_bytes, versions=inputs.trial_versions(str(log_dir))[0])


def overlap_windows(regions: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``{"forward", "backward"}`` ms of a kernel trace's ``sftprof/forward/mb*`` and ``sftprof/backward/mb*`` regions
    (``kernel_traces[].summary.regions``): their GPU time, or their wall time in a trace without GPU activity."""
    out: dict[str, float] = {}
    for r in regions:
        phase = r["name"].split("/")[1] if r["name"].count("/") == 2 else None
        if phase in ("forward", "backward"):
            out[phase] = out.get(phase, 0.0) + (r["gpu_ms"] if r["gpu_ms"] is not None else r["cpu_ms"])
    return out


def simulation_summary(log_dir: str | Path, cfg: dict[str, Any], model: inputs.TrialModel, step: int,
                       have_te: Optional[bool], regions: Optional[Sequence[Mapping[str, Any]]] = None,
                       capacity_bytes: Optional[int] = None) -> dict[str, Any]:
    """The summary's ``simulation`` member (``sftprof.analysis.time.schema.Simulation``) of a simulated trial: what was
    not run, what was assumed, and the projection of ``step`` (None with the reason when it cannot be made), its
    overlap windows from the simulated rank's kernel-trace ``regions`` when there are any, the real rank's need
    against ``capacity_bytes`` (one GPU's, None: unknown)."""
    sim = cfg["actor"]["simulate"]
    try:
        projection, error = project_trial(log_dir, cfg, model, step, have_te, overlap_windows(regions or []),
                                          capacity_bytes), None
    except Exception as exc:  # a projection that cannot be made is a note, never the trial's error
        projection, error = None, f"{type(exc).__name__}: {exc}"
    return {"rank": int(sim["rank"]), "world_size": parse_allocation_mode(cfg["actor"]["backend"]).world_size,
            "not_run": NOT_RUN, "assumed": assumed(parse_allocation_mode(cfg["actor"]["backend"]).backend),
            "projection": projection, "projection_error": error}


def render(p: dict[str, Any]) -> str:
    """The projection as text: one line per collective, then the totals, the memory and the assumptions."""
    lines = [f"projection of rank {p['rank']} of {p['world_size']} (simulated: compute measured, communication "
             "computed)", f"{'group':8} {'collective':15} {'link':10} {'calls':>6} {'MiB/call':>9} {'GB/s':>6} "
             f"{'ms':>9} {'exposed':>9}  overlap"]
    for r in p["rows"]:
        lines.append(f"{r['group']:8} {r['collective']:15} {r['interconnect']:10} {r['calls']:6d} "
                     f"{r['mib_per_call']:9.1f} {r['gbps']:6.0f} {r['ms']:9.1f} {r['exposed_ms']:9.1f}  {r['overlap']}")
    mem = p["memory"]
    lines += [f"compute {p['compute_ms']:.1f} ms + exposed communication {p['exposed_ms']:.1f} ms = projected step "
              f"{p['projected_step_ms']:.1f} ms (serial bound {p['serial_step_ms']:.1f} ms)"
              + (f", MFU {100 * p['mfu']:.1f} %" if p["mfu"] is not None else ""),
              "memory: " + (f"measured peak {mem['measured_peak_gib']:.2f} GiB + " if mem["measured_peak_gib"]
                            is not None else "peak not measured here + ")
              + f"NCCL buffers {mem['nccl_buffers_gib']:.2f} GiB (estimated)", real_rank_text(mem), "assumptions:"]
    return "\n".join(lines + [f"- {a}" for a in p["assumptions"]])


def real_rank_text(mem: Mapping[str, Any]) -> str:
    """The real rank's need in words (:func:`real_rank_memory`'s members of a projection's ``memory``): ``"real rank:
    peak reserved 78.41 + outside PyTorch 8.85 + NCCL buffers 0.43 = 87.69 GiB of 79.19: does not fit"``; a summary of
    schema 3.5 or older, without them, says so."""
    if "real_rank_need_gib" not in mem:
        return "real rank: not predicted (a summary of schema 3.5 or older)"
    if mem["real_rank_need_gib"] is None:
        return "real rank: peak reserved not measured here, no need predicted"
    verdict = (", capacity unknown" if mem["fits"] is None else
               f" of {mem['capacity_gib']:.2f}: {'fits' if mem['fits'] else 'does not fit'}")
    return (f"real rank: peak reserved {mem['measured_peak_reserved_gib']:.2f} + outside PyTorch "
            f"{mem['outside_pytorch_gib']:.2f} + NCCL buffers {mem['nccl_buffers_gib']:.2f} = "
            f"{mem['real_rank_need_gib']:.2f} GiB{verdict}")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m sftprof.analysis.time.projection TRIAL_LOG_DIR [--step N] [--json FILE]``; exit 2 on bad input."""
    ap = argparse.ArgumentParser(description="Project the step of a simulated rank (actor.simulate.rank).")
    ap.add_argument("log_dir", help="the simulated trial's log dir (config.yaml, stats.jsonl)")
    ap.add_argument("--step", type=int, help="the step whose time is the compute (default: the last recorded)")
    ap.add_argument("--json", help="also write the projection to this new file (never overwritten)")
    args = ap.parse_args(argv)
    if problem := new_file_problem(args.json):
        print(f"projection: {problem}", file=sys.stderr)
        return 2
    cfg, err = inputs.trial_config(args.log_dir)
    try:
        if cfg is None:
            raise ValueError(err or f"{args.log_dir}: no config.yaml")
        p = project_trial(args.log_dir, cfg, inputs.TrialModel(cfg), args.step)
    except (ValueError, OSError) as exc:
        print(f"projection: {exc}", file=sys.stderr)
        return 2
    return print_and_write(render(p), p, args.json, "projection")


def new_file_problem(json_path: Optional[str]) -> Optional[str]:
    """Why a CLI's ``--json`` path cannot be written as a new file (empty, a path that exists, a folder that does not
    or is not writable), or None; asked before any work, so that bad input stops the CLI before it prints a result."""
    if json_path is None:
        return None
    if not json_path:
        return "--json: an empty path (give the new file's path)"
    if os.path.lexists(json_path):
        return f"--json {json_path}: the file exists (a projection is written to a new file, never over one)"
    folder = os.path.dirname(json_path) or "."
    if not os.path.isdir(folder):
        return f"--json {json_path}: no folder {folder}"
    return None if os.access(folder, os.W_OK) else f"--json {json_path}: the folder {folder} is not writable"


def print_and_write(text: str, data: dict[str, Any], json_path: Optional[str], cli: str) -> int:
    """A CLI's result: ``text`` printed and, with ``json_path``, ``data`` written there as JSON (a new file, never
    overwritten). Returns the exit status: 0, or 2 when the file cannot be written (``cli: why`` on stderr)."""
    print(text)
    if json_path is not None:
        try:
            with open(json_path, "x", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
        except OSError as exc:
            print(f"{cli}: --json {json_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
