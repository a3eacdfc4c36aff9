"""Compare two profiled runs: Markdown tables of deltas (B - A) per matching trial.

A run argument is either one trial run dir (it holds ``profile_summary.json``) or a RUN_ROOT
whose immediate sub-directories are trial run dirs. Trials are matched by
``(profile_kind, profile_step)``; unmatched trials are listed. For each pair the report shows
step time, peak memory per rank, top kernels, time by category, each rank's exposed communication split into
waiting for the last rank and transfer (:mod:`sftprof.analysis.comm_wait`) and, for memory trials, memory
alive at the peak by allocation site. When both runs' run-to-run noise is known (:func:`_noise_note`), every
table of times has an "above noise" column, one rule for all (:func:`_noise_rows`). Typical use: prove that
``LM_HEAD_LOSS_CHUNK_SIZE=4096`` lowers the peak against ``0``.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from sftprof.allocation import parse_allocation_mode
from sftprof.artifacts import SUMMARY_JSON
from sftprof.analysis import inputs
from sftprof.analysis.failure import failure_cause
from sftprof.analysis.kernel_names import short_kernel_name
from sftprof.analysis.memory_summary import PEAK_SCOPES, peak_where
from sftprof.analysis.markdown import fmt, short, table
from sftprof.analysis.schema import ProfileSummary, SummaryReadError, read_summary
from sftprof.analysis.collectives import exposed_groups

__all__ = ["CompareInputError", "find_trials", "compare_runs", "dir_name", "NO_MATCH"]

_ROWS = 15  # rows per top-kernel / site table
REPORT_TITLE = "# Profile comparison"  # first line of every report
NO_MATCH = "No trials match by (kind, step)."  # last line of a report that compares nothing
_REQUIRED = ("profile_kind", "profile_step", "stats", "ranks")


class CompareInputError(ValueError):
    """A compare input is missing or is not a usable profile summary; the message names the file."""


def _load_summary(path: str) -> ProfileSummary:
    """One ``profile_summary.json`` (:func:`sftprof.analysis.schema.read_summary`), checked for the members compare
    reads."""
    try:
        s = read_summary(path)
    except SummaryReadError as exc:
        raise CompareInputError(str(exc)) from None
    missing = [k for k in _REQUIRED if k not in s]
    if missing:
        raise CompareInputError(f"{path}: not a profile summary of this version: missing {', '.join(missing)}; "
                                "rerun postprocess_profile.py for that trial")
    if s["profile_kind"] not in ("kernel", "memory") or not isinstance(s["profile_step"], int):
        raise CompareInputError(f"{path}: profile_kind={s['profile_kind']!r} / profile_step={s['profile_step']!r}: "
                                "expected 'kernel' or 'memory' and an int")
    return s


def dir_name(path: str) -> str:
    """The name of the directory ``path`` names, also when it is relative (``.``, ``..``) or ends in a slash: the
    last component of its absolute path (``compare . ../B`` run inside ``runs/A`` names A ``A``, not ``.``)."""
    return os.path.basename(os.path.abspath(path))


def find_trials(run: str) -> dict[tuple[str, int], tuple[str, dict]]:
    """``{(kind, step): (trial_dir, summary)}`` of a trial dir or a RUN_ROOT.

    Raises:
        CompareInputError: ``run`` is not a directory or holds no ``profile_summary.json`` (the message names
            the run roots it holds one level down, when it is a folder of run roots), a summary is
            unreadable, not JSON or lacks ``profile_kind`` / ``profile_step`` / ``stats`` / ``ranks``, or two
            trials of one RUN_ROOT share kind and step (each message names the file or directory).
    """
    if not os.path.isdir(run):
        raise CompareInputError(f"{run}: not a directory (expected a trial run dir or a RUN_ROOT)")
    dirs = [run] if os.path.isfile(os.path.join(run, SUMMARY_JSON)) else \
        [os.path.join(run, d) for d in sorted(os.listdir(run)) if os.path.isfile(os.path.join(run, d, SUMMARY_JSON))]
    if not dirs:
        roots = [d for d in sorted(os.listdir(run)) if os.path.isdir(os.path.join(run, d)) and any(
            os.path.isfile(os.path.join(run, d, t, SUMMARY_JSON)) for t in os.listdir(os.path.join(run, d)))]
        if roots:  # a folder of run roots: which one is meant is the user's choice, never guessed
            several = len(roots) > 1
            raise CompareInputError(
                f"{run}: not a trial run dir or a RUN_ROOT: it holds {'run roots' if several else 'a run root'} "
                f"({', '.join(roots)}) whose trials have {SUMMARY_JSON}; pass {'one of them' if several else 'it'} "
                f"(e.g. {os.path.join(run, roots[0])}): compare takes one trial run dir or RUN_ROOT per side")
        raise CompareInputError(f"{run}: no {SUMMARY_JSON} in it or in its sub-directories; run postprocess first")
    out: dict[tuple[str, int], tuple[str, dict]] = {}
    for d in dirs:
        s = _load_summary(os.path.join(d, SUMMARY_JSON))
        key = (s["profile_kind"], s["profile_step"])
        if key in out:
            raise CompareInputError(f"{run}: trials {out[key][0]} and {d} are both {key[0]} step {key[1]}")
        out[key] = (d, s)
    return out


def _without_summary(run: str) -> list[str]:
    """Sub-directories of a RUN_ROOT without ``profile_summary.json`` (trials not run, e.g. after STOP_ON_FAILURE,
    or not postprocessed); none for a trial dir."""
    if os.path.isfile(os.path.join(run, SUMMARY_JSON)):
        return []
    return [d for d in sorted(os.listdir(run))
            if os.path.isdir(os.path.join(run, d)) and not os.path.isfile(os.path.join(run, d, SUMMARY_JSON))]


def _delta(a, b) -> tuple[str, str]:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return "–", "–"
    d = b - a
    pct = f"{100 * d / a:+.1f}%" if a else "–"
    return f"{d:+.3f}", pct


def _table(title: str, unit: str, rows: list[tuple], rel: float | None = None, is_time=lambda name: True) -> list[str]:
    """A delta table (name, A, B, Δ, Δ %[, above noise]) as one element of the report's line list; nothing when
    neither run has a row (e.g. model parts or communication of CPU runs).

    Args:
        rows: ``(name, A value, B value)``.
        rel: the relative run-to-run noise (:func:`_noise_note`); given, the table has an "above noise" column:
            :func:`_noise_rows`' verdict for the rows whose name ``is_time`` accepts, ``n/a`` for the others (the
            step time's spread says nothing about memory). None (noise unknown): no such column.
    """
    if not rows:
        return []
    noise = rel is not None
    headers = [title, f"A {unit}".strip(), f"B {unit}".strip(), "Δ (B−A)", "Δ %"] + (["above noise"] if noise else [])
    verdicts = [v[3] if is_time(v[0]) else "n/a" for v in _noise_rows(rows, rel)] if noise else [None] * len(rows)
    cells = []
    for (name, a, b), verdict in zip(rows, verdicts):
        cells.append([str(name).replace("|", "/"), fmt(a), fmt(b), *_delta(a, b)] + ([verdict] if noise else []))
    return [table(headers, cells, cell=str)]


def _is_time(name: str) -> bool:
    """Whether a row of the step tables (:func:`_step_tables`) is a time (step time, ``*_ms``), not memory."""
    return "step time" in name or name.endswith("_ms")


def _noise(stats: dict) -> tuple[float | None, int]:
    """(max - min step time in s, count) over the unprofiled steps after step 0; (None, count) below 2 steps."""
    t = [x["step_time_s"] for x in stats.get("steps") or [] if not x.get("profiled") and x.get("step") != 0
         and isinstance(x.get("step_time_s"), (int, float))]
    return (max(t) - min(t), len(t)) if len(t) >= 2 else (None, len(t))


def _noise_rows(rows: list[tuple], rel: float | None) -> list[tuple]:
    """Rows with an "above noise" cell: |Δ| > rel x the larger value (rel = noise spread / step time)."""
    out = []
    for name, a, b in rows:
        if rel is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            out.append((name, a, b, "–"))
        else:
            out.append((name, a, b, "yes" if abs(b - a) > rel * max(abs(a), abs(b)) else "no"))
    return out


def _union_rows(a: dict[str, float], b: dict[str, float], limit: int) -> list[tuple[str, Any, Any]]:
    names = sorted(set(a) | set(b), key=lambda n: (-max(a.get(n, 0.0), b.get(n, 0.0)), n))[:limit]
    return [(n, a.get(n), b.get(n)) for n in names]


def _regions(kernel_summary: dict, col: str) -> dict[str, float]:
    """``{region name: ms}`` of the annotated regions of one rank trace (regions without a value left out)."""
    return {r["name"]: r[col] for r in kernel_summary.get("regions") or [] if r.get(col) is not None}


_SAME_BY_DESIGN = ("trial_name",)  # differs between any two trials
_SIZE_KEYS = ("profile.fake_seq_len", "train_dataset.batch_size", "actor.backend", "actor.num_layers", "actor.path")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _settings(summary: dict) -> tuple[dict[str, Any] | None, str]:
    """The trial's resolved config, flattened: the copy in the summary (``config``), else ``LOG_DIR/config.yaml``
    written by the trainer (summaries of earlier releases, or a config.yaml that postprocess could not read), and
    why it is unknown (``(None, reason)`` when neither is there or the file is unreadable; ``""`` when known)."""
    if isinstance(summary.get("config"), dict):
        return _flat(summary["config"]), ""
    cfg, error = inputs.trial_config((summary.get("paths") or {}).get("log_dir") or "")
    if error:
        return None, error
    return (None, "not available") if cfg is None else (_flat(cfg), "")


_CP_ATTENTION = "actor.megatron.cp_attention"


def _uses_cp_attention(flat_cfg: dict[str, Any]) -> bool:
    """Whether ``actor.megatron.cp_attention`` can act in a trial: the megatron backend with CP > 1 (True when the
    backend does not parse: not known to be without effect)."""
    try:
        layout = parse_allocation_mode(str(flat_cfg.get("actor.backend")))
    except ValueError:
        return True
    return layout.backend == "megatron" and layout.cp > 1


# settings whose empty value has a meaning of its own (sftprof/config/schema.py: PerfTracerConfig, MemoryProfilerConfig)
_EMPTY_MEANS = {"perf_tracer.ranks": "all ranks", "memory_profiler.ranks": "all ranks"}


def _setting_cell(key: str, flat_cfg: dict[str, Any]) -> str:
    """One trial's value of a setting in the settings table: ``–`` when the trial's config has no such key, ``""``
    for an empty text (with its meaning where it has one: ``"" (all ranks)`` for ``perf_tracer.ranks``), else the
    value; a layout's ``|`` is escaped, so that the row keeps its three cells."""
    if key not in flat_cfg:
        return "–"
    value = flat_cfg[key]
    if value == "":
        return f'"" ({_EMPTY_MEANS[key]})' if key in _EMPTY_MEANS else '""'
    return str(value).replace("|", "\\|")


def _settings_diff(a: dict, b: dict) -> list[str]:
    """What was changed between the two trials (the experiment), and a warning when sizes differ."""
    (ca, why_a), (cb, why_b) = _settings(a), _settings(b)
    if ca is None or cb is None:
        why = "; ".join(f"{side}: {why}" for side, c, why in (("A", ca, why_a), ("B", cb, why_b)) if c is None)
        return [f"Settings unknown (the trial's config.yaml, {why}); cannot tell what differs.", ""]
    keys = sorted(k for k in set(ca) | set(cb) if k not in _SAME_BY_DESIGN and ca.get(k) != cb.get(k))
    if not keys:
        return ["Settings: identical (a repeat run: deltas show run-to-run noise).", ""]
    out = ["Settings that differ:", "", "| setting | A | B |", "|---|---|---|"]
    out += [f"| `{k}` | " + " | ".join(_setting_cell(k, c) for c in (ca, cb)) + " |" for k in keys]
    if _CP_ATTENTION in keys and not any(_uses_cp_attention(c) for c in (ca, cb)):
        out += ["", f"`{_CP_ATTENTION}` has no effect in either trial (it applies to the megatron backend with CP > 1): "
                    "its difference is not what the deltas measure."]
    sized = [k for k in keys if k in _SIZE_KEYS]
    if sized:
        out += ["", f"**Warning:** the runs differ in {', '.join(sized)}: time and memory deltas mix the "
                "change under test with a different problem size."]
    return out + [""]


def _pair(key, dir_a: str, a: dict, dir_b: str, b: dict) -> list[str]:
    """The report section of one matched pair of trials: settings, step figures, per rank, kernels, memory."""
    kind, step = key
    out = [f"## {kind} step {step}: `{dir_name(dir_a)}` (A) vs `{dir_name(dir_b)}` (B)", ""]
    for side, s in (("A", a), ("B", b)):
        if s.get("status") != "ok":  # a failed trial's figures are missing, not equal: say so before any table
            cause = failure_cause(s)  # the first failure (its Failure section), else the completion record's error
            why = f" ({cause[1]})" if cause and cause[0] == "error" else f" ({cause[0]}: {cause[1]})" if cause else ""
            out += [f"**Trial {side} status: {s.get('status')}**" + why
                    + ": its figures are missing below, not zero.", ""]
    out += _settings_diff(a, b)
    noise_lines, rel = _noise_note(a["stats"], b["stats"])
    out += noise_lines + _step_tables(a, b, rel)
    ka = {t["rank"]: t["summary"] for t in a.get("kernel_traces") or [] if "summary" in t}
    kb = {t["rank"]: t["summary"] for t in b.get("kernel_traces") or [] if "summary" in t}
    ma = {m["rank"]: m["summary"] for m in a.get("memory_snapshots") or [] if "summary" in m}
    mb = {m["rank"]: m["summary"] for m in b.get("memory_snapshots") or [] if "summary" in m}
    out += _one_sided(ka, kb, "trace", a, b, "kernel_traces") + _one_sided(ma, mb, "memory snapshot", a, b,
                                                                          "memory_snapshots")
    for rank in sorted(set(ka) & set(kb)):
        out += _kernel_tables(rank, ka[rank], kb[rank], rel)
    for rank in sorted(set(ma) & set(mb)):
        out += _memory_tables(rank, ma[rank], mb[rank])
    return out


def _one_sided(in_a: dict, in_b: dict, what: str, a: dict, b: dict, member: str) -> list[str]:
    """A line per run and reason naming the ranks whose ``what`` (trace, memory snapshot) only that run has: their
    figures have nothing to be compared with and are left out of the per-rank tables below. The reason is read from
    the other run's summary (``a``, ``b``): its entry of that rank in ``member`` (``kernel_traces``,
    ``memory_snapshots``) failed to process; its trial failed (``status``); its ``missing_traces`` name the rank (its
    ``perf_tracer.ranks`` profiles it but its trace is not in the log dir: deleted, never written); its status is
    unknown (no completion record); else the runs profiled different ranks (e.g. ``PROFILE_RANKS`` differed)."""
    out = []
    for side, mine, other, other_side, summary in (("A", in_a, in_b, "B", b), ("B", in_b, in_a, "A", a)):
        errored = {e.get("rank") for e in summary.get(member) or [] if "error" in e}
        status = summary.get("status")
        missing = set(summary.get("missing_traces") or []) if what == "trace" else set()
        reasons: dict[str, list[int]] = defaultdict(list)
        for rank in sorted(set(mine) - set(other)):
            if rank in errored:
                why = f"run {other_side}'s {what} of that rank could not be processed (its error is in that summary)"
            elif status == "failed":
                why = f"run {other_side}'s trial failed (status failed) and left no {what} of that rank"
            elif rank in missing:
                why = (f"run {other_side} profiled that rank but has no {what} of it in its log dir: deleted or never "
                       "written (a warning in that summary)")
            elif status == "unknown":
                why = (f"run {other_side}'s trial status is unknown (no completion record): it stopped before writing "
                       f"that {what}, or profiled other ranks")
            else:
                why = "the runs profiled different ranks"
            reasons[why].append(rank)
        for why, ranks in reasons.items():
            out += [f"Rank(s) {', '.join(map(str, ranks))}: a {what} only in run {side}; not compared below ({why}).", ""]
    return out


def _noise_note(sa: dict, sb: dict) -> tuple[list[str], float | None]:
    """The run-to-run noise lines and the relative noise ``rel`` (:func:`_noise_rows`; None when unknown)."""
    na, nb = _noise(sa), _noise(sb)
    lines = [f"Run-to-run noise of the step time (spread max - min of the unprofiled steps after step 0 in "
             f"stats.jsonl): A {fmt(na[0])} s over {na[1]} steps, B {fmt(nb[0])} s over {nb[1]} steps."
             + (" A delta counts as above noise when it exceeds the sum of both spreads, scaled to each figure by "
                "its share of the step time (time rows; memory rows: n/a)." if na[0] is not None and nb[0] is not None else
                " Fewer than 2 such steps in a run: noise unknown (run more steps, TOTAL_STEPS)."), ""]
    rel = ((na[0] + nb[0]) / sa["step_time_s"]) if (na[0] is not None and nb[0] is not None
                                                   and sa.get("step_time_s")) else None
    return lines, rel


def _step_tables(a: dict, b: dict, rel: float | None) -> list[str]:
    """Step time and peaks of the profiled step (stats.jsonl), per rank, and per profiled rank (traces, snapshots);
    the time rows with the "above noise" verdict of the relative noise ``rel`` (:func:`_table`)."""
    sa, sb = a["stats"], b["stats"]

    def peak(st: dict, key: str) -> str:
        rank = st.get(f"{key}_rank")
        return "–" if rank is None else f"r{rank}" + (" only" if (st.get("n_ranks") or 1) == 1 else "")

    rows = [("step time s (stats.jsonl, profiled step, slowest rank)", sa.get("step_time_s"), sb.get("step_time_s"))]
    for key, what in (("mem_peak_allocated", "peak allocated"), ("mem_peak_reserved", "peak reserved")):
        rows.append((f"{what} GB (stats.jsonl, profiled step, max over ranks: A {peak(sa, key)}, B {peak(sb, key)})",
                     sa.get(f"{key}_gb"), sb.get(f"{key}_gb")))
    rows.append(("max peak allocated GB over steps and ranks", sa.get("max_mem_peak_allocated_gb"),
                 sb.get("max_mem_peak_allocated_gb")))
    out = _table("metric", "", rows, rel, _is_time)
    # Every rank of stats.jsonl, profiled or not, then the profiled ranks' trace/snapshot figures.
    pa, pb = sa.get("per_rank") or {}, sb.get("per_rank") or {}
    per_rank = []
    for rank in sorted(set(pa) | set(pb), key=int):
        for col, label in (("step_time_s", "step time s"), ("mem_peak_allocated_gb", "peak allocated GB"),
                           ("mem_peak_reserved_gb", "peak reserved GB")):
            per_rank.append((f"rank {rank} {label}", (pa.get(rank) or {}).get(col), (pb.get(rank) or {}).get(col)))
    if per_rank:
        out += ["### Per rank (stats.jsonl, every rank)", ""] + _table("rank metric", "", per_rank, rel, _is_time)
    ra = {r["rank"]: r for r in a["ranks"]["rows"]}
    rb = {r["rank"]: r for r in b["ranks"]["rows"]}
    profiled = []
    for rank in sorted(set(ra) & set(rb)):
        for col in ("step_ms", "snapshot_peak_allocated_gib", "snapshot_peak_reserved_gib",
                    "comm_ms", "exposed_comm_ms", "host_comm_ms"):
            if col in ra[rank] or col in rb[rank]:
                profiled.append((f"rank {rank} {col}", ra[rank].get(col), rb[rank].get(col)))
    if profiled:
        out += ["### Per profiled rank (traces / snapshots)", ""] + _table("rank metric", "", profiled, rel, _is_time)
    (wa, ga), (wb, gb) = _wait_rows(a), _wait_rows(b)
    differ = sorted(r for r in set(ga) & set(gb) if ga[r] != gb[r])
    for r in differ:  # the all-groups totals of different sets of groups are not comparable
        for n in (f"rank {r} exposed wait, all split groups", f"rank {r} exposed transfer, all split groups"):
            wa.pop(n, None), wb.pop(n, None)
    names = sorted(set(wa) | set(wb), key=lambda n: (int(n.split()[1]), "split groups" not in n, n))
    out += _table("exposed communication, waiting for the last rank vs transfer (– = not split in that run)", "ms",
                  [(n, wa.get(n), wb.get(n)) for n in names], rel)
    out += [f"Rank {r}: the runs split different process groups (A: {', '.join(ga[r])}; B: {', '.join(gb[r])}), so "
            "its all-split-groups totals are not compared; the per-group rows are.\n" for r in differ]
    return out


def _wait_rows(s: dict) -> tuple[dict[str, float], dict[int, list[str]]]:
    """``({"rank 1 exposed wait, all split groups": ms, ..., "rank 1 EP exposed wait": ms, ...}, {rank: sorted labels
    of its split groups})``: a summary's split of each rank's exposed communication
    (:func:`sftprof.analysis.comm_wait.split`; both empty when it has none). A rank in no split group has no rows
    (summaries of earlier versions listed it with 0 ms)."""
    cw = s.get("comm_wait") or {}
    out: dict[str, float] = defaultdict(float)  # groups with the same label add up
    labels: dict[int, set] = defaultdict(set)
    for g in cw.get("groups") or []:
        for r in g["ranks"]:
            labels[r["rank"]].add(str(g["label"]))  # None: a group of unknown parallelism
            out[f"rank {r['rank']} {g['label']} exposed wait"] += r["exposed_wait_ms"]
            out[f"rank {r['rank']} {g['label']} exposed transfer"] += r["exposed_transfer_ms"]
    for r in cw.get("ranks") or []:
        if r["rank"] in labels:
            out[f"rank {r['rank']} exposed wait, all split groups"] = r["exposed_wait_ms"]
            out[f"rank {r['rank']} exposed transfer, all split groups"] = r["exposed_transfer_ms"]
    return {k: round(v, 4) for k, v in out.items()}, {r: sorted(v) for r, v in labels.items()}


def _kernel_tables(rank: int, x: dict, y: dict, rel: float | None) -> list[str]:
    """Kernel-trace deltas of one rank: step, regions, model parts, exposed communication, categories, top lists;
    every row a time, with the "above noise" verdict of the relative noise ``rel`` (:func:`_table`)."""
    out = [f"### Kernels, rank {rank}", ""]
    out += _table("metric", "ms", [
        ("step wall", x["step_window"]["wall_ms"], y["step_window"]["wall_ms"]),
        ("GPU busy", x["gpu"]["busy_ms"], y["gpu"]["busy_ms"]),
        ("communication", x["communication"]["total_ms"], y["communication"]["total_ms"]),
        ("exposed communication", x["communication"]["exposed_ms"], y["communication"]["exposed_ms"])], rel)
    out += _table("region, CPU", "ms", _union_rows(_regions(x, "cpu_ms"), _regions(y, "cpu_ms"), 100), rel)
    if _regions(x, "gpu_ms") or _regions(y, "gpu_ms"):
        out += _table("region, GPU", "ms", _union_rows(_regions(x, "gpu_ms"), _regions(y, "gpu_ms"), 100), rel)
    if "parts" in x and "parts" in y:
        out += _table("model part, summed over layers", "ms", _union_rows(
            {r["label"]: r["total_ms"] for r in x["parts"]["summed"]},
            {r["label"]: r["total_ms"] for r in y["parts"]["summed"]}, 100), rel)
        out += _table("exposed communication by process group", "ms", _union_rows(
            exposed_groups(x["collectives"]), exposed_groups(y["collectives"]), 100), rel)
    out += _table("category", "ms", _union_rows({c["category"]: c["total_ms"] for c in x["categories"]},
                                                {c["category"]: c["total_ms"] for c in y["categories"]}, 100), rel)
    out += _table("kernel (– = not in that run's top 20)", "ms",
                  [(short_kernel_name(n), p, q) for n, p, q in _union_rows(
                      {k["name"]: k["total_ms"] for k in x["top_kernels"]},
                      {k["name"]: k["total_ms"] for k in y["top_kernels"]}, _ROWS)], rel)
    out += _table("CPU op, inclusive (– = not in that run's top 15)", "ms", _union_rows(
        {o["name"]: o["inclusive_ms"] for o in x.get("top_cpu_ops") or []},
        {o["name"]: o["inclusive_ms"] for o in y.get("top_cpu_ops") or []}, _ROWS), rel)
    return out


def _scope(x: dict) -> str:
    """Whose peak a snapshot summary's headline peak is (:data:`PEAK_SCOPES`; an older summary's is the window's)."""
    return PEAK_SCOPES[x.get("peak_scope") or "recorded_window"]


def _window_peak_gib(x: dict):
    """The whole recorded window's peak allocated GiB (an older summary's ``peak_allocated_gib`` is that)."""
    return x.get("window_peak_allocated_gib", x["peak_allocated_gib"] if "peak_scope" not in x else None)


def _memory_tables(rank: int, x: dict, y: dict) -> list[str]:
    """Snapshot deltas of one rank: peaks, where they lie, memory by category and by site at the peak.

    The peak is each summary's headline peak (the profiled step's when its phases sidecar had phases, else the
    recorded window's: :func:`sftprof.analysis.memory_summary.analyze_snapshot`); the whole window's peak has a
    row of its own (a summary of an older sftprof, without ``peak_scope``, holds only the window's peak). A line
    says so when the two runs' peaks are of different scopes.
    """
    out = [f"### Memory, rank {rank}", ""]
    out += _table("metric", "GiB", [
        ("peak allocated", x["peak_allocated_gib"], y["peak_allocated_gib"]),
        ("peak reserved", x["peak_reserved_gib"], y["peak_reserved_gib"]),
        ("reserved − allocated at peak", x["reserved_minus_allocated_at_peak_gib"],
         y["reserved_minus_allocated_at_peak_gib"]),
        ("peak allocated, whole recorded window", _window_peak_gib(x), _window_peak_gib(y))])
    out.append(f"Peak: A {_scope(x)}, {peak_where(x)}; B {_scope(y)}, {peak_where(y)}\n")
    if _scope(x) != _scope(y):
        out.append("The two peaks are not of the same scope (a run without phases, or summarised by an older "
                   "sftprof, has only the recorded window's): the whole-window row compares like with like.\n")
    for side, z in (("A", x), ("B", y)):
        if z.get("window_peak_position") in ("before_step", "after_step"):
            out.append(f"Run {side}'s recorded window peaks higher, {fmt(z['window_peak_allocated_gib'])} GiB "
                       f"{peak_where(z, 'window')}.\n")
    if "categories_at_peak" in x and "categories_at_peak" in y:
        out += _table("memory at the peak by category", "GiB", _union_rows(
            {c["label"]: c["gib"] for c in x["categories_at_peak"]},
            {c["label"]: c["gib"] for c in y["categories_at_peak"]}, 100))
    out += _table("alive at peak by site (– = not in that run's top 20)", "GiB",
                  [(short(n, 140), p, q) for n, p, q in _union_rows(
                      {s["site"]: s["gib"] for s in x["top_sites"]},
                      {s["site"]: s["gib"] for s in y["top_sites"]}, _ROWS)])
    return out


def compare_runs(run_a: str, run_b: str) -> str:
    """Markdown report comparing two runs (see the module docstring); it ends with :data:`NO_MATCH` when no
    trial matches. Sub-directories of a RUN_ROOT without ``profile_summary.json`` are listed as not compared.

    Raises:
        CompareInputError: as :func:`find_trials`, or a matched summary whose members have an unexpected
            shape (the message names both files).
    """
    ta, tb = find_trials(run_a), find_trials(run_b)
    out = [REPORT_TITLE, "", f"- A: `{os.path.abspath(run_a)}`", f"- B: `{os.path.abspath(run_b)}`", ""]
    common = sorted(set(ta) & set(tb))
    for key in sorted(set(ta) ^ set(tb)):
        side = "A" if key in ta else "B"
        out.append(f"- unmatched: {key[0]} step {key[1]} only in {side} "
                   f"(`{dir_name((ta if key in ta else tb)[key][0])}`)")
    for side, run in (("A", run_a), ("B", run_b)):
        out += [f"- not compared: `{d}` in {side} has no {SUMMARY_JSON} (a trial not run, e.g. after STOP_ON_FAILURE, "
                "or not postprocessed)" for d in _without_summary(run)]
    if not common:
        out.append(f"\n{NO_MATCH}")
    for key in common:
        try:
            out += [""] + _pair(key, *ta[key], *tb[key])
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            files = " and ".join(os.path.join(ta[key][0] if side == 0 else tb[key][0], SUMMARY_JSON) for side in (0, 1))
            raise CompareInputError(f"cannot compare {files}: a member has an unexpected shape "
                                    f"({type(exc).__name__}: {exc}); rerun postprocess_profile.py for them") from None
    return "\n".join(out).rstrip() + "\n"
