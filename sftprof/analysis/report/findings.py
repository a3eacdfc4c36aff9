"""The top of ``profile_summary.md``: the largest levers of a trial, from its figures (its what-if lines:
:mod:`sftprof.analysis.what_if.changes`).

Each finding is ``{"text", "section", "weight", "key", "rank"}`` and, when the record its figures come from is
faulty, ``caveats``: ``weight`` is the share of the step's GPU time (kernel trials; a CPU run's: its step's wall
time or CPU op time) or of the peak allocated memory (memory trials) the lever concerns, and orders them;
``section`` is the Markdown heading the finding points to; ``key`` names the lever (the same on every rank, so
:func:`top` states each lever once); ``caveats`` are the faults of the rank's trace
(:func:`sftprof.analysis.trace.sanity.fault_messages`) or why its snapshot's step peak is unknown. Figures are per
profiled rank and say so. Each finding's ``next_step`` (the setting to try, or why none) is added after the what-ifs
(:mod:`sftprof.analysis.what_if.next_steps`).
"""
from __future__ import annotations

from typing import Optional, TypedDict

from sftprof.analysis.memory.schema import MemorySummary
from sftprof.analysis.memory.snapshot import peak_where
from sftprof.analysis.report.schema import Finding
from sftprof.analysis.schema import processed_snapshots, processed_traces
from sftprof.analysis.time.collectives import OUTSIDE_WINDOW
from sftprof.analysis.time.schema import (EfficiencyRow, ExposedByGroup, HeaviestOp, HostWaitRow, KernelSummary, Parts,
                                          RankTable, WaitRank)
from sftprof.analysis.trace.sanity import fault_messages
from sftprof.analysis.trial.schema import TrialRecord

__all__ = ["JudgedRecord", "trial_findings", "kernel_findings", "memory_findings", "top", "MAX_FINDINGS",
           "parts_heading", "memory_heading", "exposed_gap_cause", "EXPOSED_GAP_MIN_MS", "EXPOSED_GAP_MIN_SHARE"]

MAX_FINDINGS = 5
EXPOSED_GAP_MIN_MS = 0.05  # a per-group difference under this (0.0 at the 0.1 ms shown) is never named as a cause
EXPOSED_GAP_MIN_SHARE = 0.1  # ... nor one under this share of the gap between the two ranks' exposed totals


class JudgedRecord(TrialRecord):
    """What :func:`trial_findings` judges: the trial's record and its ranks table."""
    ranks: RankTable


def parts_heading(rank: int) -> str:
    return f"Time by model part, rank {rank}"


def memory_heading(rank: int) -> str:
    return f"Memory at the peak by category, rank {rank}"


def _anchor(heading: str) -> str:
    """GitHub-style anchor of a Markdown heading."""
    out = "".join(c for c in heading.lower() if c.isalnum() or c in " -_").replace(" ", "-")
    return "#" + out


def exposed_gap_cause(ex: ExposedByGroup) -> tuple[Optional[tuple[str, float]], float]:
    """What the gap in exposed communication between two ranks is put down to.

    Args:
        ex: the ranks table's ``exposed_by_group`` (:func:`sftprof.analysis.time.rank_table.exposed_by_group`): its
            ``extra_ms`` (ms, the gap between the ranks' totals) and ``extra_by_group`` (``(group, ms)`` rows,
            largest first; a row :data:`sftprof.analysis.time.collectives.OUTSIDE_WINDOW` for the NCCL kernels
            outside the step window).

    Returns:
        ``(row, threshold_ms)``: the largest row when its difference is at least ``threshold_ms`` =
        max(:data:`EXPOSED_GAP_MIN_MS`, :data:`EXPOSED_GAP_MIN_SHARE` x ``extra_ms``), else None (no group
        accounts for the gap: it is not attributed to one).
    """
    threshold = max(EXPOSED_GAP_MIN_MS, EXPOSED_GAP_MIN_SHARE * ex["extra_ms"])
    rows = list(ex.get("extra_by_group") or [])
    if rows and rows[0][1] >= threshold:
        return (rows[0][0], rows[0][1]), threshold
    return None, threshold


IDLE_PLACES = 2  # places of the host wait a GPU-idle finding names at most
HOST_STALL_US = 10_000.0  # a gap this long is a host stall (GC, a lock, untraced work): launches cost microseconds
IDLE_PLACE_SHARE = 0.1  # ... each holding at least this share of the host wait


def _idle_place(r: HostWaitRow) -> str:
    """One place of the host wait (a row of ``host_wait_by_place``) in words."""
    text = f"{r['idle_ms']:.1f} ms in {r['label']}, phase {r['phase']}"
    if r.get("launched_under"):
        text += f", under {r['launched_under']}"
    if r["kind"] == "after blocking calls":
        return text + f" ({r['after_blocking_pct']:.0f} % of it after blocking CUDA calls)"
    gaps = f"{r['gaps']} gap{'s' if r['gaps'] != 1 else ''} averaging {_duration(r['mean_gap_us'] / 1e3)}"
    longest = r.get("longest_gap_us") or 0.0
    if r["gaps"] > 1 and longest >= HOST_STALL_US:  # no launch costs that much: the host was held elsewhere
        gaps += f", the longest {_duration(longest / 1e3)} (a host stall, not launch cost)"
    if r.get("gc_ms"):
        gaps += f", {_duration(r['gc_ms'])} of the wait in Python garbage collection"
    mean = r.get("mean_activity_us")  # None: no activities
    if r.get("activities") and mean is not None:  # the activities' length is what tells launch-bound from host busy
        return text + (f" ({r['kind']}: {r['activities']} GPU activities averaging "
                       f"{_duration(mean / 1e3)}, "
                       f"{gaps})")
    return text + f" ({r['kind']}: {gaps})"


def _duration(ms_: float) -> str:
    """``"97.8 µs"`` under 1 ms, ``"412.3 ms"`` under 1 s, else ``"10.2 s"``."""
    if ms_ < 1:
        return f"{ms_ * 1e3:.1f} µs"
    return f"{ms_ / 1e3:.1f} s" if ms_ >= 1e3 else f"{ms_:.1f} ms"


def _wait_split(exposed_ms: float, w: WaitRank) -> str:
    """``", of which 71.2 ms waiting for rank 0 to arrive (...) and 37.0 ms transfer"``: a rank row of
    :func:`sftprof.analysis.time.comm_wait.split` in words, against the rank's exposed communication ``exposed_ms``."""
    late = [x for x in w["waited_for"] if x["exposed_wait_ms"] >= 0.05]
    if len(late) == 1:
        whom = f"rank {late[0]['rank']}"
    else:
        whom = "the last rank" + (" (" + ", ".join(f"rank {x['rank']} {x['exposed_wait_ms']:.1f} ms" for x in late[:2])
                                  + (", ..." if len(late) > 2 else "") + ")" if late else "")
    text = (f", of which {w['exposed_wait_ms']:.1f} ms waiting for {whom} to arrive (load imbalance before the "
            f"collective) and {w['exposed_transfer_ms']:.1f} ms transfer")
    rest = exposed_ms - w["exposed_ms"]
    if rest >= 0.05:
        text += f", {rest:.1f} ms not split (process groups not split by rank, or kernels outside the step window)"
    return text


def _heaviest_op(rank: int, op: HeaviestOp, wall_ms: float, with_parts: bool) -> Finding:
    """The finding of a CPU run's heaviest op (:func:`sftprof.analysis.time.host_time.heaviest_op`): its inclusive time
    against the step's wall time, where it ran, and its autograd backward node's time."""
    where = f" in {op['label']}" if op.get("label") else ""
    back_ms = op.get("backward_ms")  # None: no backward node
    back = (f"; its backward {op['backward']} {_duration(back_ms)} more"
            if op.get("backward") and back_ms is not None else "")
    calls = f"{op['calls']} call{'s' if op['calls'] != 1 else ''}"
    return {"text": f"rank {rank}: heaviest op {op['name']}{where}: {_duration(op['inclusive_ms'])} of the "
                    f"{_duration(wall_ms)} step ({calls}, with the ops it calls){back}",
            "section": _anchor(parts_heading(rank) if with_parts else f"Host, rank {rank}"),
            "weight": op["inclusive_ms"] / wall_ms, "key": "heaviest op"}


# model part -> (efficiency kind of its core kernels, how the finding names their rate)
_CORE_KIND: dict[str, tuple[Optional[str], str]] = {"attn_core": ("attention", " at "),
                                                    "linear_attn": ("linear attention", ", delta rule at ")}


def _part_rates(rows: list[EfficiencyRow], label: str, kind: Optional[str] = None) -> list[str]:
    """``["629 TFLOP/s forward", "428 TFLOP/s backward"]``: achieved model TFLOP/s of a model part's FLOP-counted
    ops (its kernel-efficiency rows, of ``kind`` when given, dtypes summed) in its first-pass forward (or, where that
    has no counted op, its recompute: Transformer Engine's linears run their first forward under full recompute
    without an op record) and its backward."""
    acc: dict[str, list[float]] = {}
    for row in rows:
        if row["part"] == label and kind in (None, row["kind"]) and row.get("tflop") and row.get("gpu_ms"):
            a = acc.setdefault(row["phase"], [0.0, 0.0])
            a[0] += row["tflop"]
            a[1] += row["gpu_ms"]
    first = "forward" if "forward" in acc else "recompute"
    return [f"{acc[ph][0] / acc[ph][1] * 1e3:.0f} TFLOP/s {ph}" for ph in (first, "backward") if ph in acc]


def kernel_findings(rank: int, s: KernelSummary, wait: Optional[WaitRank] = None) -> list[Finding]:
    """The findings of one rank's kernel summary ``s`` (:class:`sftprof.analysis.time.schema.KernelSummary`); ``wait``:
    the rank's row of the trial's :func:`sftprof.analysis.time.comm_wait.split` (``ranks``), whose split of the exposed
    communication into waiting for the last rank and transfer the exposed-communication finding states."""
    out: list[Finding] = []
    host, window, gpu = s.get("host"), s.get("step_window"), s.get("gpu")
    comp = host.get("compile") if host else None
    wall_ms = (window.get("wall_ms") if window else None) or 0.0
    if comp and comp.get("ms") and wall_ms:
        ids = comp.get("compile_ids") or []
        out.append({"text": f"rank {rank}: torch.compile compiled inside the profiled step: {comp['ms']:.1f} ms of "
                            f"its {wall_ms:.1f} ms wall time in dynamo/inductor"
                            + (f" ({len(ids)} compile(s): {', '.join(ids[:6])}{', ...' if len(ids) > 6 else ''})"
                               if ids else "")
                            + ("; the step time and GPU idle include it" if gpu and gpu.get("activities")
                               else "; the step time includes it")  # a CPU run has no GPU idle to speak of
                            + ", so this step is not steady state: profile a later step (PROFILE_STEPS)",
                    "section": _anchor(f"Host, rank {rank}"), "weight": comp["ms"] / wall_ms, "key": "compile"})
    parts: Optional[Parts] = s.get("parts")
    clock, cpu_parts = "GPU time", s.get("cpu_parts")
    if not (parts and parts.get("total_ms")) and cpu_parts:  # a CPU run: the CPU ops' self time by model part
        parts, clock = cpu_parts, "CPU op time"
    heavy = s.get("heaviest_op")
    if heavy and wall_ms:
        out.append(_heaviest_op(rank, heavy, wall_ms, bool(parts and parts.get("total_ms"))))
    total = (parts.get("total_ms") if parts else None) or 0.0
    sanity = s.get("sanity")
    if not parts or not total:
        return _with_rank(out, rank, fault_messages(sanity, examples=False) if sanity else [])
    sec = _anchor(parts_heading(rank))
    efficiency = s.get("efficiency")
    eff_rows = (efficiency.get("rows") if efficiency else None) or []
    for r in sorted(parts.get("summed") or [], key=lambda r: -r["total_ms"])[:3]:
        text = f"rank {rank}: {r['label']} {r['share_pct']:.1f} % of {clock} ({r['total_ms']:.1f} ms"
        if r["recompute_ms"]:
            text += f", of which recompute {r['recompute_ms']:.1f} ms"
        text += ")"
        # the rate of the part's core kernels (attention's; the delta rule's in a gated delta-net layer), else of
        # all its FLOP-counted ops (GEMMs)
        kind, what = _CORE_KIND.get(r.get("part"), (None, " at "))
        rates = _part_rates(eff_rows, r["label"], kind)
        if rates:
            text += what + " / ".join(rates)
        out.append({"text": text, "section": sec, "weight": r["total_ms"] / total, "key": f"part {r['part']}"})
    rec = sum(r["recompute_ms"] for r in parts.get("summed") or [])
    if rec:
        out.append({"text": f"rank {rank}: activation recompute re-runs {rec:.1f} ms of forward work "
                            f"({100 * rec / total:.1f} % of {clock})", "section": sec, "weight": rec / total,
                    "key": "recompute"})
    coll = s.get("collectives")
    exposed = (coll.get("exposed_by_group_ms") if coll else None) or {}
    if exposed:
        g, ms = max(exposed.items(), key=lambda kv: kv[1])
        total_exposed = s["communication"]["exposed_ms"]
        split = _wait_split(total_exposed, wait) if wait and wait["exposed_ms"] else ""
        out.append({"text": f"rank {rank}: exposed communication {total_exposed:.1f} ms{split}; "
                            f"largest exposed group {g} {ms:.1f} ms",
                    "section": _anchor(f"Communication by process group, rank {rank}"),
                    "weight": s["communication"]["exposed_ms"] / total, "key": "exposed communication"})
    cpu_run = (gpu.get("activities") if gpu else None) == 0  # no GPU activity: its "GPU idle" is the whole step
    idle = None if cpu_run or not host else host.get("gpu_idle")
    if wall_ms and idle and idle.get("idle_ms"):
        # the lever is the GPU time lost while the host had nothing launched; the host's time inside blocking
        # calls overlaps a busy GPU and costs nothing by itself, so only the idle that follows one is named
        idle_ms, host_wait = idle["idle_ms"], idle.get("host_wait_ms") or 0.0
        text = (f"rank {rank}: GPU idle {idle_ms:.1f} ms ({100 * idle_ms / wall_ms:.1f} % of the step's wall time), "
                f"{host_wait:.1f} ms of it waiting for the host to launch work")
        places = idle.get("host_wait_by_place")
        where = [r for r in ((places.get("rows") if places else None) or [])[:IDLE_PLACES]
                 if r["idle_ms"] >= IDLE_PLACE_SHARE * host_wait]
        if where:
            text += ": " + "; ".join(_idle_place(r) for r in where)
        if places and places.get("after_blocking_ms"):
            ops = places.get("after_blocking_by_op") or {}
            text += (f"; {places['after_blocking_ms']:.1f} ms of the wait follows blocking CUDA calls ("
                     + ", ".join(f"{k} {v:.1f} ms" for k, v in list(ops.items())[:2]) + ")")
        out.append({"text": text, "section": _anchor(f"Host, rank {rank}"), "weight": host_wait / wall_ms,
                    "key": "gpu idle"})
    return _with_rank(out, rank, fault_messages(sanity, examples=False) if sanity else [])


def _with_rank(found: list[Finding], rank: int, caveats: list[str]) -> list[Finding]:
    """The findings of one rank, each with its rank and, when there are any, the caveats of its record."""
    out: list[Finding] = []
    for f in found:
        g: Finding = {**f, "rank": rank}
        if caveats:
            g["caveats"] = caveats
        out.append(g)
    return out


def memory_findings(rank: int, s: MemorySummary) -> list[Finding]:
    """The findings of one rank's snapshot summary ``s`` (:class:`sftprof.analysis.memory.schema.MemorySummary`).

    The peak is the summary's headline peak (the profiled step's when the phases sidecar has phases) and its place
    is worded by :func:`peak_where`; a higher peak of the recorded window outside the profiled step is a finding
    of its own (weight: its excess over the step's peak as a share of it, key ``memory window peak``).
    """
    peak = s.get("peak_allocated_bytes") or 0
    if not peak:
        return []
    gib = 2.0**30
    sec = _anchor(memory_heading(rank))
    noun = {"profiled_step": "step peak", "dump_time": "level"}.get(s.get("peak_scope") or "", "peak")
    out: list[Finding] = []
    for r in sorted(s.get("categories_at_peak") or [], key=lambda r: -r["bytes"])[:3]:
        if r["bytes"] > 0:
            out.append({"text": f"rank {rank}: {r['label']} {r['gib']:.1f} GiB of the {peak / gib:.1f} GiB {noun} "
                                f"{peak_where(s)}",
                        "section": sec, "weight": r["bytes"] / peak, "key": f"memory {r['category']}"})
    window = s.get("window_peak_allocated_bytes") or 0
    if s.get("window_peak_position") in ("before_step", "after_step") and window > peak:
        out.append({"text": f"rank {rank}: the recorded allocator history peaks higher, {window / gib:.2f} GiB "
                            f"{peak_where(s, 'window')}, than the profiled step ({peak / gib:.2f} GiB "
                            f"{peak_where(s)}); the figures at the peak are the step's",
                    "section": sec, "weight": (window - peak) / peak, "key": "memory window peak"})
    spikes = s.get("transient_spikes") or []
    if spikes:
        sp = spikes[0]
        out.append({"text": f"rank {rank}: largest transient block {sp['gib']:.2f} GiB for {sp['lifetime_ms']:.1f} ms "
                            f"at {sp['site']}", "section": sec, "weight": sp["bytes"] / peak, "key": "transient"})
    return _with_rank(out, rank, [c for c in (s.get("step_peak_unknown"), s.get("step_peak_lower_bound")) if c])


def top(findings: list[Finding]) -> list[Finding]:
    """The :data:`MAX_FINDINGS` heaviest findings, one per lever (``key``): a lever seen on several ranks is
    stated for the rank where it weighs most, and its text names the other ranks that have it."""
    best: dict[str, Finding] = {}
    ranks: dict[str, list[Optional[int]]] = {}
    for f in sorted(findings, key=lambda f: -f["weight"]):
        key = f.get("key") or f["text"]
        ranks.setdefault(key, []).append(f.get("rank"))
        best.setdefault(key, f)
    out: list[Finding] = []
    for key, f in sorted(best.items(), key=lambda kv: -kv[1]["weight"])[:MAX_FINDINGS]:
        others = [r for r in ranks[key][1:] if r is not None]
        out.append({**f, "text": f["text"] + (f" (also on rank {', '.join(map(str, sorted(others)))})" if others
                                              else "")})
    return out


def trial_findings(summary: JudgedRecord) -> list[Finding]:
    """The top findings of a trial over all its profiled ranks (:func:`top`): each trace's and snapshot's, and the
    gap in exposed communication between the ranks (the ranks table's ``exposed_by_group``)."""
    found: list[Finding] = []
    traces = processed_traces(summary)
    cw = summary.get("comm_wait")
    waits = {w["rank"]: w for w in (cw.get("ranks") if cw else None) or []}
    for t in traces:
        found += kernel_findings(t["rank"], t["summary"], waits.get(t["rank"]))
    table = summary.get("ranks")
    ex = table.get("exposed_by_group") if table else None
    if table and ex and ex["extra_ms"] > 0:
        total = max(t["summary"]["parts"]["total_ms"] or 0.0 for t in traces) or 1.0
        hi, lo = ex["max_rank"], ex["min_rank"]
        tot = ex["totals"]
        cause, threshold = exposed_gap_cause(ex)
        if cause is None:  # never a ~0 ms group named as the cause of a larger gap
            said = (f"no process group accounts for it (none differs by {threshold:.2f} ms or more), so it is not "
                    "attributed to a group")
        elif cause[0] == OUTSIDE_WINDOW:
            said = (f"the largest difference, +{cause[1]:.1f} ms, is in NCCL kernels outside the step window, not "
                    "attributed to a group")
        else:
            said = f"the largest per-group difference is {cause[0]}, +{cause[1]:.1f} ms"
        # the rank with the least exposed communication is the one the others wait for: name its longest extra work
        ws = table.get("work_spread")
        spread = [w for w in (ws.get("rows") if ws else None) or [] if w["max_rank"] == lo]
        why = ""
        if spread:
            w = spread[0]
            where = f"layer {w['layer']} " if w["layer"] is not None else ""
            why = (f"; rank {lo}'s own work runs longest against another rank in {w['label']}, {where}{w['phase']}: "
                   f"{w['spread_ms']:.1f} ms more than rank {w['min_rank']}")
        found.append({"text": f"rank {hi} has {ex['extra_ms']:.1f} ms more exposed communication than rank {lo} "
                              f"({tot[hi]:.1f} vs {tot[lo]:.1f} ms); {said}{why}",
                      "section": "#ranks", "weight": ex["extra_ms"] / total, "key": "exposed imbalance"})
    for m in processed_snapshots(summary):
        if m["rank"] is not None:
            found += memory_findings(m["rank"], m["summary"])
    return top(found)

