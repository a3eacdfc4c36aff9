"""Compare two profiled runs: Markdown tables of deltas (B - A) with a verdict per row.

A run argument is either one trial run dir (it holds ``profile_summary.json``) or a RUN_ROOT whose immediate
sub-directories are trial run dirs; one run argument is one configuration. Trials are grouped (:func:`_group_key`):
the kernel trials after step 0 pool into one group (repeated samples of a steady-state step), kernel step 0 (the
warm-up) and each memory step are groups of their own; groups that only one run has are listed. The report opens with
how to read the verdicts (:func:`_verdict_note`) and the step time pooled over every trial of each run
(:func:`_step_time_section`: the steps that time training alone, :func:`_clean_step_times`); then, per group, the
settings that differ (:mod:`sftprof.analysis.compare.settings_diff`), step figures, peak memory per rank, top kernels, time by
category, each rank's exposed communication split into waiting for the last rank and transfer
(:mod:`sftprof.analysis.time.comm_wait`) and, for memory trials, memory alive at the peak by allocation site. Every row of
every table gets its verdict from :mod:`sftprof.analysis.compare.stats` (:func:`_row_cells`): time rows the rank test's 95 %
interval over the row's samples, memory rows (deterministic for a given step) an exact difference. Typical use: prove
that ``LM_HEAD_LOSS_CHUNK_SIZE=4096`` lowers the peak against ``0``.

What-if trials (the driver's ``TRY_WHAT_IFS``: a trial's what-if applied, same kind and step) are another
configuration: a RUN_ROOT's are left out of its groups; each what-if trial of B whose source trial is in A gets the
prediction against the outcome first (:func:`_what_if_section`, :mod:`sftprof.analysis.what_if.outcome`).

Longer than 500 lines: one report, whose sections share the row helpers (samples, cells, tables); the statistics
themselves are in :mod:`sftprof.analysis.compare.stats`.
"""
from __future__ import annotations

import os
from collections import defaultdict
from functools import partial
from statistics import median
from typing import Any, Callable, Iterable, Optional, cast

from sftprof.artifacts import RUN_ROOT_FILEROOT, SUMMARY_JSON
from sftprof.analysis.compare import verdicts as compare_verdicts, stats
from sftprof.analysis.what_if import changes as what_if, outcome as what_if_outcome
from sftprof.analysis.trial.failure import failure_cause
from sftprof.analysis.trial.schema import TrialRecord
from sftprof.analysis.trace.kernel_names import short_kernel_name
from sftprof.analysis.memory.snapshot import PEAK_SCOPES, peak_where
from sftprof.analysis.report.markdown import fmt, short, table
from sftprof.analysis.schema import SummaryReadError, read_summary
from sftprof.analysis.compare.settings_diff import settings_diff
from sftprof.analysis.time.collectives import exposed_groups
from sftprof.analysis.trace.check import is_finite_number

__all__ = ["CompareInputError", "find_trials", "what_if_result", "compare_runs", "dir_name",
           "NO_MATCH"]

_ROWS = 15  # rows per top-kernel / site table
REPORT_TITLE = "# Profile comparison"  # first line of every report
NO_MATCH = ("No trials match (kernel trials after step 0 pool together; kernel step 0 and memory trials match "
            "by step).")  # last line of a report that compares nothing
_REQUIRED = ("profile_kind", "profile_step", "stats", "ranks")


# A summary as compare reads it: the JSON of any version read_summary reads (older ones lack members of today's
# ProfileSummary, so every member compare reads is looked up as optional), and its traces' and snapshots' summaries
Summary = dict[str, Any]
Trial = tuple[str, Summary]  # (trial dir, its summary)


class CompareInputError(ValueError):
    """A compare input is missing or is not a usable profile summary; the message names the file."""


def _load_summary(path: str) -> Summary:
    """One ``profile_summary.json`` (:func:`sftprof.analysis.schema.read_summary`), checked for the members compare
    reads."""
    try:
        s = dict(read_summary(path))
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


def find_trials(run: str) -> tuple[dict[tuple[str, int], Trial], list[Trial]]:
    """``{(kind, step): (trial_dir, summary)}`` of a trial dir or a RUN_ROOT, and ``[(trial_dir, summary)]`` of its
    what-if trials (summaries with ``tried_what_if``; run order of the folder names). A RUN_ROOT's what-if trials
    (another configuration, of the same kind and step as their source) are left out of the first.

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
    out: dict[tuple[str, int], Trial] = {}
    what_ifs = []
    for d in dirs:
        s = _load_summary(os.path.join(d, SUMMARY_JSON))
        if isinstance(s.get("tried_what_if"), dict):
            what_ifs.append((d, s))
        if len(dirs) > 1 and s.get("tried_what_if"):  # another configuration: compared with its source trial
            continue
        key = (s["profile_kind"], s["profile_step"])
        if key in out:
            raise CompareInputError(f"{run}: trials {out[key][0]} and {d} are both {key[0]} step {key[1]}")
        out[key] = (d, s)
    return out, what_ifs


def _without_summary(run: str) -> list[str]:
    """Sub-directories of a RUN_ROOT without ``profile_summary.json`` (trials not run, e.g. after STOP_ON_FAILURE,
    or not postprocessed); none for a trial dir."""
    if os.path.isfile(os.path.join(run, SUMMARY_JSON)):
        return []
    return [d for d in sorted(os.listdir(run)) if d != RUN_ROOT_FILEROOT
            and os.path.isdir(os.path.join(run, d)) and not os.path.isfile(os.path.join(run, d, SUMMARY_JSON))]


def _values(v: Any) -> list[float]:
    """The samples of one side of a row: ``v`` is a value or a list of values (one per trial); what is not a finite
    number (None: the trial has no such figure) is left out."""
    return [x for x in (v if isinstance(v, list) else [v]) if is_finite_number(x)]


def _median(v: Any) -> float | None:
    """The median of :func:`_values` (the value itself for one sample, None for none)."""
    x = _values(v)
    return None if not x else x[0] if len(x) == 1 else float(median(x))


def _is_time(name: str) -> bool:
    """Whether a row of a table in seconds or milliseconds or without a unit is a time (step time, ``*_ms``), not
    memory (``GB``, ``*_gib``)."""
    return "step time" in name or name.endswith("_ms")


def _row_cells(a: Any, b: Any, time: bool) -> list[str]:
    """The cells A, B, Δ (B−A), Δ %, 95 % CI of Δ, samples A/B and verdict of one row (:func:`_verdict_note`).

    Args:
        a, b: each side's value, or list of values (one per trial or step); non-numbers are left out.
        time: a time row (the rank test of :func:`sftprof.analysis.compare.stats.shift`, words ``slower``/``faster``); else a
            memory row: an exact difference when each side's samples agree (deterministic allocations), else the rank
            test with words ``higher``/``lower``.
    """
    xa, xb = _values(a), _values(b)
    n = f"{len(xa)}/{len(xb)}"
    if not xa or not xb:
        return [fmt(_median(xa)), fmt(_median(xb)), "–", "–", "–", n, "–"]
    exact = None if time else stats.constant_difference(xa, xb)
    if exact is not None:
        pct = f"{100 * exact / xa[0]:+.1f}%" if xa[0] else "–"
        word = "higher" if exact > 0 else "lower" if exact < 0 else "equal"
        return [fmt(xa[0]), fmt(xb[0]), f"{exact:+.3f}", pct, "exact", n, f"{word} (exact)"]
    s = stats.shift(xa, xb)
    pct = f"{100 * s.estimate / s.median_a:+.1f}%" if s.median_a else "–"
    ci = "–" if s.low is None else f"[{s.low:+.3f}, {s.high:+.3f}]"
    verdict = s.verdict("slower", "faster") if time else s.verdict("higher", "lower")
    return [fmt(_median(xa)), fmt(_median(xb)), f"{s.estimate:+.3f}", pct, ci, n, verdict]


def _table(title: str, unit: str, rows: list[tuple[str, Any, Any]]) -> list[str]:
    """A delta table (name, A, B, Δ, Δ %, 95 % CI of Δ, samples A/B, verdict: :func:`_row_cells`) as one element of
    the report's line list; nothing when neither run has a row (e.g. model parts or communication of CPU runs).

    Args:
        unit: ``s`` or ``ms`` (time rows), ``GB`` or ``GiB`` (memory rows), or empty: then each row is a time or
            memory by its name (:func:`_is_time`).
        rows: ``(name, A, B)``, each side a value or a list of values (one per trial).
    """
    if not rows:
        return []
    headers = [title, f"A {unit}".strip(), f"B {unit}".strip(), "Δ (B−A)", "Δ %", "95 % CI of Δ", "samples A/B",
               "verdict"]
    shown, left_out = [], []
    for name, a, b in rows:
        row = [str(name).replace("|", "/"), *_row_cells(a, b, unit in ("s", "ms") or (not unit and _is_time(name)))]
        why = compare_verdicts.record(title, str(name), row[1:])
        if why:
            left_out.append((row[0], why))
        else:
            shown.append(row)
    return ([table(headers, shown, cell=str)] if shown else []) + compare_verdicts.left_out_line(left_out)


def _samples(dicts: Iterable[dict[str, Any]]) -> dict[str, list[Any]]:
    """``{row name: [value of each dict that has the name]}``: one table's rows of several trials, pooled."""
    out: dict[str, list[Any]] = defaultdict(list)
    for d in dicts:
        for name, v in d.items():
            out[name].append(v)
    return dict(out)


def _union_rows(a: dict[str, Any], b: dict[str, Any], limit: int) -> list[tuple[str, Any, Any]]:
    """The rows of both runs' names, the largest (median over the trials, in either run) first, ``limit`` at most;
    ``a``/``b`` map a name to a value or a list of values (:func:`_samples`)."""
    def size(v: Any) -> float:
        return _median(v) or 0.0

    names = sorted(set(a) | set(b), key=lambda n: (-max(size(a.get(n)), size(b.get(n))), n))[:limit]
    return [(n, a.get(n), b.get(n)) for n in names]


def _regions(kernel_summary: Summary, col: str) -> dict[str, float]:
    """``{region name: ms}`` of the annotated regions of one rank trace (regions without a value left out)."""
    return {r["name"]: r[col] for r in kernel_summary.get("regions") or [] if r.get(col) is not None}


def _group_key(kind: str, step: int) -> tuple[str, int]:
    """The group a trial's figures pool into: ``("kernel", 1)`` for every kernel trial after step 0 (repeated samples
    of the same steady-state step, whichever step), else ``(kind, step)``: kernel step 0 is the warm-up (one-time
    costs such as autotuning), and a memory trial's figures are deterministic for its step."""
    return (kind, 1) if kind == "kernel" and step >= 1 else (kind, step)


def _groups(trials: dict[tuple[str, int], Trial]) -> dict[tuple[str, int], list[Trial]]:
    """``{group key: [(trial dir, summary), ...] in step order}`` of :func:`find_trials`' trials (:func:`_group_key`)."""
    out: dict[tuple[str, int], list[Trial]] = defaultdict(list)
    for key in sorted(trials):
        out[_group_key(*key)].append(trials[key])
    return dict(out)


def _trial_list(trials: list[Trial]) -> str:
    """`` `dir` (step 1), `dir` (step 2)``: the trials of one side of a group."""
    return ", ".join(f"`{dir_name(d)}` (step {s['profile_step']})" for d, s in trials)


def _group_title(kind: str, ta: list[Trial], tb: list[Trial]) -> list[str]:
    """The heading of a group's section: ``## kind step N: `dir A` (A) vs `dir B` (B)`` for one trial a side at one
    step; else (the kernel trials after step 0, pooled) each side's trials and a line saying that the cells are
    medians over them."""
    if len(ta) == len(tb) == 1 and ta[0][1]["profile_step"] == tb[0][1]["profile_step"]:
        return [f"## {kind} step {ta[0][1]['profile_step']}: `{dir_name(ta[0][0])}` (A) vs `{dir_name(tb[0][0])}` (B)",
                ""]
    return [f"## {kind} trials after step 0, pooled: A {_trial_list(ta)} vs B {_trial_list(tb)}", "",
            "Each A and B cell is the median over that run's trials (samples A/B: how many trials have the row).", ""]


def _group_section(kind: str, ta: list[Trial], tb: list[Trial], settings: list[str]) -> list[str]:
    """The report section of one group of trials (:func:`_group_key`): its settings where they differ from the
    report's opening ones (``settings``), step figures, per rank, kernels, memory; each row's samples are the group's
    trials of each run."""
    out = _group_title(kind, ta, tb)
    for side, trials in (("A", ta), ("B", tb)):
        for d, s in trials:
            if s.get("status") != "ok":  # a failed trial's figures are missing, not equal: say so before any table
                # the first failure (its Failure section), else the completion record's error; s is read_summary's
                cause = failure_cause(cast(TrialRecord, s))
                why = f" ({cause[1]})" if cause and cause[0] == "error" else f" ({cause[0]}: {cause[1]})" if cause else ""
                name = "" if len(trials) == 1 else f" `{dir_name(d)}`"
                out += [f"**Trial {side}{name} status: {s.get('status')}**" + why
                        + ": its figures are missing below, not zero.", ""]
    a, b = [s for _, s in ta], [s for _, s in tb]
    mine = settings_diff(a[0], b[0])
    out += [] if mine == settings else ["Settings of these trials (they differ from the report's first ones):", ""] + mine
    out += _step_tables(a, b)
    ka, kb = _by_rank(a, "kernel_traces"), _by_rank(b, "kernel_traces")
    ma, mb = _by_rank(a, "memory_snapshots"), _by_rank(b, "memory_snapshots")
    out += _one_sided(ka, kb, "trace", a, b, "kernel_traces") + _one_sided(ma, mb, "memory snapshot", a, b,
                                                                          "memory_snapshots")
    for rank in sorted(set(ka) & set(kb)):
        out += _kernel_tables(rank, ka[rank], kb[rank])
    for rank in sorted(set(ma) & set(mb)):  # a memory group holds one trial a side (its step)
        out += _memory_tables(rank, ma[rank][0], mb[rank][0])
    return out


def _by_rank(summaries: list[Summary], member: str) -> dict[int, list[Summary]]:
    """``{rank: [the summary of that rank's trace or snapshot in each trial that has one]}`` (``member``:
    ``kernel_traces`` or ``memory_snapshots``; entries that failed to process have no summary)."""
    out: dict[int, list[Summary]] = defaultdict(list)
    for s in summaries:
        for t in s.get(member) or []:
            if "summary" in t:
                out[t["rank"]].append(t["summary"])
    return dict(out)


def _one_sided(in_a: dict[int, list[Summary]], in_b: dict[int, list[Summary]], what: str, a: list[Summary],
               b: list[Summary], member: str) -> list[str]:
    """A line per run and reason naming the ranks whose ``what`` (trace, memory snapshot) only that run has: their
    figures have nothing to be compared with and are left out of the per-rank tables below. The reason is read from
    the other run's summaries of the group (``a``, ``b``): an entry of that rank in ``member`` (``kernel_traces``,
    ``memory_snapshots``) failed to process; a trial failed (``status``); a summary's ``missing_traces`` name the rank
    (its ``perf_tracer.ranks`` profiles it but its trace is not in the log dir: deleted, never written); a status is
    unknown (no completion record); else the runs profiled different ranks (e.g. ``PROFILE_RANKS`` differed)."""
    out = []
    for side, mine, other, other_side, summaries in (("A", in_a, in_b, "B", b), ("B", in_b, in_a, "A", a)):
        errored = {e.get("rank") for s in summaries for e in s.get(member) or [] if "error" in e}
        status = {s.get("status") for s in summaries}
        trial = f"run {other_side}'s trial" if len(summaries) == 1 else f"a trial of run {other_side}"
        missing = {r for s in summaries for r in s.get("missing_traces") or []} if what == "trace" else set()
        reasons: dict[str, list[int]] = defaultdict(list)
        for rank in sorted(set(mine) - set(other)):
            if rank in errored:
                why = f"run {other_side}'s {what} of that rank could not be processed (its error is in that summary)"
            elif "failed" in status:
                why = f"{trial} failed (status failed) and left no {what} of that rank"
            elif rank in missing:
                why = (f"run {other_side} profiled that rank but has no {what} of it in its log dir: deleted or never "
                       "written (a warning in that summary)")
            elif "unknown" in status:
                why = (f"{trial} status is unknown (no completion record): it stopped before writing "
                       f"that {what}, or profiled other ranks")
            else:
                why = "the runs profiled different ranks"
            reasons[why].append(rank)
        for why, ranks in reasons.items():
            out += [f"Rank(s) {', '.join(map(str, ranks))}: a {what} only in run {side}; not compared below ({why}).", ""]
    return out


def _clean_step_times(summary: Summary) -> list[tuple[int, float]]:
    """``[(step, step time in s)]`` of the steps of one trial that time training alone (``stats.steps``, the slowest
    rank's time): after step 0 (the warm-up: one-time costs), not profiled, not the step before a kernel trial's
    profiled step (the profiler already collects through it, its warm-up) and, in a memory trial, after the profiled
    step (the allocator records its history from step 0 through the profiled step). Steps without a finite time are
    left out."""
    kind, profiled = summary["profile_kind"], summary["profile_step"]
    out = []
    for row in (summary.get("stats") or {}).get("steps") or []:
        step, t = row.get("step"), row.get("step_time_s")
        if (type(step) is not int or step == 0 or row.get("profiled") or not is_finite_number(t)
                or (kind == "kernel" and step == profiled - 1) or (kind == "memory" and step < profiled)):
            continue
        out.append((step, t))
    return out


def _trial_spread(side: str, per_trial: list[tuple[str, list[float]]]) -> list[str]:
    """Lines naming the trials of one run whose step times differ from the run's other trials by the same test
    (each trial against the rest; with two trials, the first against the second): steps of one trial share its
    process, so trials of one configuration can differ (memory layout, thread placement, the load of the moment),
    and a step-time verdict between runs then mixes the setting with that variation."""
    out = []
    for i, (d, mine) in enumerate(per_trial[:1] if len(per_trial) == 2 else per_trial):
        rest = [t for j, (_, times) in enumerate(per_trial) if j != i for t in times]
        if len(mine) < 2 or len(rest) < 2:
            continue
        s = stats.shift(rest, mine)
        if s.direction in ("higher", "lower"):
            out.append(f"- run {side}'s trial `{dir_name(d)}` is {s.verdict()} than its other trials "
                       f"({s.estimate:+.3f} s, 95 % CI [{s.low:+.3f}, {s.high:+.3f}]): the verdict below mixes the "
                       "setting with the variation between trials of one configuration; more trials (PROFILE_STEPS) "
                       "tell them apart.")
    return out


def _step_time_section(ta: list[Trial], tb: list[Trial]) -> list[str]:
    """The step time of both runs, pooled over every trial of each (:func:`_clean_step_times`), with the trials and
    steps each sample comes from, and the trials that differ from their run's others (:func:`_trial_spread`)."""
    out = ["## Step time", "",
           "Slowest rank's step time (stats.jsonl) of the steps that time training alone: after step 0, not "
           "profiled, not the profiler's warm-up step before a kernel trial's profiled step, after a memory trial's "
           "profiled step; pooled over each run's trials, each step a sample.", ""]
    samples, spread = {}, []
    for side, trials in (("A", ta), ("B", tb)):
        per_trial = [(d, _clean_step_times(s)) for d, s in trials]
        samples[side] = [t for _, steps in per_trial for _, t in steps]
        used = "; ".join(f"`{dir_name(d)}` steps {', '.join(str(step) for step, _ in steps)}"
                         for d, steps in per_trial if steps)
        out += [f"- {side}: {len(samples[side])} steps" + (f" ({used})" if used else "")
                + ("" if samples[side] else ": none (raise TOTAL_STEPS: the steps after each trial's profiled step "
                                            "are samples)")]
        spread += _trial_spread(side, [(d, [t for _, t in steps]) for d, steps in per_trial if steps])
    return out + spread + [""] + _table("metric", "s", [(compare_verdicts.STEP_TIME_ROW, samples["A"], samples["B"])])


def _verdict_note() -> list[str]:
    """How to read the verdict columns: the test, its words, where the samples come from, memory rows."""
    return ["How to read the verdict column of every table:", "",
            f"- Δ (B−A): the {stats.METHOD}; with one sample a side, B − A. 95 % CI of Δ: that interval.",
            f"- `slower` / `faster`: the interval lies above / below 0; `{stats.NO_DIFFERENCE}`: it holds 0; "
            f"`{stats.ONE_SAMPLE}`: a side has one sample; `{stats.TOO_FEW}`: a rank test cannot reach 95 % with so "
            "few (4 a side, 3 against 5 or 2 against 8 are enough).",
            "- A, B: each run's median; samples A/B: how many each has. The step time's samples are steps (next "
            "section, which names a trial that differs from its run's others); a trace's figures are one sample per kernel trial, pooled over each run's kernel trials after "
            "step 0 (several `PROFILE_STEPS` give repeats; step 0, the warm-up, is compared on its own).",
            "- Memory rows come from deterministic allocations (a step allocates the same each time it runs): compared "
            "exactly, `higher (exact)` / `lower (exact)` / `equal (exact)`, no interval; where a run's samples of a "
            "memory row differ, the rank test decides (`higher` / `lower`).",
            "- A row of one sample a side (no verdict), or without the figure in either run, is left out of its table, "
            "and a line under the table counts and names those rows (`compare --all-rows` shows them); `–`: a side "
            "without the figure.", ""]


def _step_tables(a: list[Summary], b: list[Summary]) -> list[str]:
    """Step time and peaks of the profiled step (stats.jsonl), per rank, and per profiled rank (traces, snapshots) of
    one group's summaries ``a`` and ``b`` (one sample per trial)."""
    sa, sb = [x["stats"] for x in a], [y["stats"] for y in b]

    def peak(sts: list[Summary], key: str) -> str:
        seen: set[Any] = {st.get(f"{key}_rank") for st in sts}  # the ranks (ints) and None
        ranks = sorted(seen - {None})
        only = all((st.get("n_ranks") or 1) == 1 for st in sts)
        return "–" if not ranks else "/".join(f"r{r}" for r in ranks) + (" only" if only else "")

    def col(sts: list[Summary], key: str) -> list[Any]:
        return [st.get(key) for st in sts]

    rows = [("step time s (stats.jsonl, profiled step, slowest rank)", col(sa, "step_time_s"), col(sb, "step_time_s"))]
    for key, what in (("mem_peak_allocated", "peak allocated"), ("mem_peak_reserved", "peak reserved")):
        rows.append((f"{what} GiB (stats.jsonl, profiled step, max over ranks: A {peak(sa, key)}, B {peak(sb, key)})",
                     col(sa, f"{key}_gb"), col(sb, f"{key}_gb")))
    rows.append(("max peak allocated GiB over steps and ranks", col(sa, "max_mem_peak_allocated_gb"),
                 col(sb, "max_mem_peak_allocated_gb")))
    out = _table("metric", "", rows)
    # Every rank of stats.jsonl, profiled or not, then the profiled ranks' trace/snapshot figures.
    pa, pb = [st.get("per_rank") or {} for st in sa], [st.get("per_rank") or {} for st in sb]
    per_rank = []
    for rank in sorted({r for p in pa + pb for r in p}, key=int):
        for key, label in (("step_time_s", "step time s"), ("mem_peak_allocated_gb", "peak allocated GiB"),
                           ("mem_peak_reserved_gb", "peak reserved GiB")):
            per_rank.append((f"rank {rank} {label}", [(p.get(rank) or {}).get(key) for p in pa],
                             [(p.get(rank) or {}).get(key) for p in pb]))
    if per_rank:
        out += ["### Per rank (stats.jsonl, every rank)", ""] + _table("rank metric", "", per_rank)
    ra = [{r["rank"]: r for r in x["ranks"]["rows"]} for x in a]
    rb = [{r["rank"]: r for r in y["ranks"]["rows"]} for y in b]
    profiled = []
    for rank in sorted({r for t in ra for r in t} & {r for t in rb for r in t}):
        xs, ys = [t[rank] for t in ra if rank in t], [t[rank] for t in rb if rank in t]
        for key in ("step_ms", "snapshot_peak_allocated_gib", "snapshot_peak_reserved_gib",
                    "comm_ms", "exposed_comm_ms", "host_comm_ms"):
            if any(key in r for r in xs + ys):
                profiled.append((f"rank {rank} {key}", [r.get(key) for r in xs], [r.get(key) for r in ys]))
    if profiled:
        out += ["### Per profiled rank (traces / snapshots)", ""] + _table("rank metric", "", profiled)
    wa, wb = [_wait_rows(x) for x in a], [_wait_rows(y) for y in b]

    # each distinct set of split groups of rank r in a run's trials
    def split(w: list[tuple[dict[str, float], dict[int, list[str]]]], r: int) -> list[str]:
        return sorted({", ".join(g[r]) for _, g in w if r in g})

    ranks = {r for _, g in wa for r in g} & {r for _, g in wb for r in g}
    differ = sorted(r for r in ranks if len(set(split(wa, r)) | set(split(wb, r))) > 1)
    for r in differ:  # the all-groups totals of different sets of groups are not comparable
        for n in (f"rank {r} exposed wait, all split groups", f"rank {r} exposed transfer, all split groups"):
            for rows_of_trial, _ in wa + wb:
                rows_of_trial.pop(n, None)
    sa_w, sb_w = _samples(w for w, _ in wa), _samples(w for w, _ in wb)
    names = sorted(set(sa_w) | set(sb_w), key=lambda n: (int(n.split()[1]), "split groups" not in n, n))
    out += _table("exposed communication, waiting for the last rank vs transfer (– = not split in that run)", "ms",
                  [(n, sa_w.get(n), sb_w.get(n)) for n in names])
    out += [f"Rank {r}: the runs split different process groups (A: {' / '.join(split(wa, r))}; B: "
            f"{' / '.join(split(wb, r))}), so its all-split-groups totals are not compared; the per-group rows are.\n"
            for r in differ]
    return out


def _wait_rows(s: Summary) -> tuple[dict[str, float], dict[int, list[str]]]:
    """``({"rank 1 exposed wait, all split groups": ms, ..., "rank 1 EP exposed wait": ms, ...}, {rank: sorted labels
    of its split groups})``: a summary's split of each rank's exposed communication
    (:func:`sftprof.analysis.time.comm_wait.split`; both empty when it has none). A rank in no split group has no rows
    (summaries of earlier versions listed it with 0 ms)."""
    cw = s.get("comm_wait") or {}
    out: dict[str, float] = defaultdict(float)  # groups with the same label add up
    labels: dict[int, set[str]] = defaultdict(set)
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


def _pooled(f: Callable[[Summary], dict[str, Any]], xs: list[Summary], ys: list[Summary],
            limit: int = 100) -> list[tuple[str, Any, Any]]:
    """:func:`_union_rows` of ``f`` (one summary -> ``{row name: value}``) over each run's summaries ``xs``, ``ys``."""
    return _union_rows(_samples(map(f, xs)), _samples(map(f, ys)), limit)


def _kernel_tables(rank: int, xs: list[Summary], ys: list[Summary]) -> list[str]:
    """Kernel-trace deltas of one rank, one sample per trial of ``xs`` (A) and ``ys`` (B): step, regions, model parts,
    exposed communication, categories, top lists; every row a time."""
    def metric(x: Summary) -> dict[str, float]:
        return {"step wall": x["step_window"]["wall_ms"], "GPU busy": x["gpu"]["busy_ms"],
                "communication": x["communication"]["total_ms"],
                "exposed communication": x["communication"]["exposed_ms"]}

    out = [f"### Kernels, rank {rank}", ""]
    ma, mb = _samples(map(metric, xs)), _samples(map(metric, ys))
    out += _table("metric", "ms", [(n, ma[n], mb[n]) for n in metric(xs[0])])
    out += _table("region, CPU", "ms", _pooled(lambda x: _regions(x, "cpu_ms"), xs, ys))
    if any(_regions(x, "gpu_ms") for x in xs + ys):
        out += _table("region, GPU", "ms", _pooled(lambda x: _regions(x, "gpu_ms"), xs, ys))
    px, py = [x for x in xs if "parts" in x], [y for y in ys if "parts" in y]
    if px and py:
        out += _table("model part, summed over layers", "ms", _pooled(
            lambda x: {r["label"]: r["total_ms"] for r in x["parts"]["summed"]}, px, py))
        out += _table("exposed communication by process group", "ms", _pooled(
            lambda x: exposed_groups(x["collectives"]), px, py))
    out += _table("category", "ms", _pooled(lambda x: {c["category"]: c["total_ms"] for c in x["categories"]}, xs, ys))
    out += _table("kernel (– = not in that run's top 20)", "ms", [(short_kernel_name(n), p, q) for n, p, q in _pooled(
        lambda x: {k["name"]: k["total_ms"] for k in x["top_kernels"]}, xs, ys, _ROWS)])
    out += _table("CPU op, inclusive (– = not in that run's top 15)", "ms", _pooled(
        lambda x: {o["name"]: o["inclusive_ms"] for o in x.get("top_cpu_ops") or []}, xs, ys, _ROWS))
    return out


def _scope(x: Summary) -> str:
    """Whose peak a snapshot summary's headline peak is (:data:`PEAK_SCOPES`; an older summary's is the window's)."""
    return PEAK_SCOPES[x.get("peak_scope") or "recorded_window"]


def _window_peak_gib(x: Summary) -> Optional[float]:
    """The whole recorded window's peak allocated GiB (an older summary's ``peak_allocated_gib`` is that)."""
    return x.get("window_peak_allocated_gib", x["peak_allocated_gib"] if "peak_scope" not in x else None)


def _memory_tables(rank: int, x: Summary, y: Summary) -> list[str]:
    """Snapshot deltas of one rank: peaks, where they lie, memory by category and by site at the peak.

    The peak is each summary's headline peak (the profiled step's when its phases sidecar had phases, else the
    recorded window's: :func:`sftprof.analysis.memory.snapshot.analyze_snapshot`); the whole window's peak has a
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


def _what_if_pairs(ta: dict[tuple[str, int], Trial],
                   what_ifs_b: list[Trial]) -> list[tuple[str, Summary, str, Summary]]:
    """``[(source dir, source summary, what-if dir, what-if summary)]``: each what-if trial of B (``what_ifs_b``) whose
    source trial (``tried_what_if.source_trial``) is a trial of A (``ta``: :func:`find_trials` of A; a what-if trial
    of A is not a source)."""
    by_name = {dir_name(d): (d, s) for d, s in ta.values()}
    by_name.update({s["trial"]: (d, s) for d, s in ta.values() if s.get("trial")})
    out = []
    for d, s in what_ifs_b:
        source = by_name.get(s["tried_what_if"]["source_trial"])
        if source and os.path.abspath(source[0]) != os.path.abspath(d):
            out.append((source[0], source[1], d, s))
    return out


def what_if_result(a: Summary, b: Summary) -> what_if_outcome.Outcome:
    """The outcome of the what-if that summary ``b`` (a what-if trial) tries on summary ``a`` (its source trial):
    :func:`sftprof.analysis.what_if.outcome.outcome` with the step times of :func:`_clean_step_times` (ms)."""
    times = ([1000 * t for _, t in _clean_step_times(a)], [1000 * t for _, t in _clean_step_times(b)])
    return what_if_outcome.outcome(b["tried_what_if"]["what_if"], a, b, times)


def _what_if_section(pairs: list[tuple[str, Summary, str, Summary]]) -> list[str]:
    """Each what-if tried: its setting, prediction and outcome, and whether its assumption held
    (:mod:`sftprof.analysis.what_if.outcome`)."""
    out = ["## What-ifs tried: prediction against outcome", "",
           f"A is the trial a what-if varies, B the what-if trial (same kind and step, the setting applied). Rule: "
           f"{what_if_outcome.RULE}.", ""]
    for da, a, db, b in pairs:
        w = b["tried_what_if"]["what_if"]
        o = what_if_result(a, b)
        settings = ", ".join(f"`{what_if.setting_text(x)}`" for x in w["settings"])
        metric = what_if.METRICS[w["effect"]["metric"]][1]
        rank = f" (predicted from rank {w['rank']})" if w.get("rank") is not None else ""
        out += [f"- **{w['label']}** ({settings}), `{dir_name(da)}` (A) -> `{dir_name(db)}` (B): {metric}{rank}: "
                f"{what_if_outcome.outcome_text(o, w['effect']['unit'])}; samples A/B {o.samples}, from {o.basis}.",
                f"  Assumption: **{o.verdict}**: {o.why}. It assumed: {w['assumption']}.", ""]
    return out


def compare_runs(run_a: str, run_b: str, all_rows: bool = False) -> str:
    """The Markdown report of :func:`compare`."""
    return compare(run_a, run_b, all_rows)[0]


def compare(run_a: str, run_b: str, all_rows: bool = False) -> tuple[str, list[compare_verdicts.Row]]:
    """Markdown report comparing two runs (see the module docstring) and its table rows (the verdicts
    ``compare --fail-on`` reads: :func:`sftprof.analysis.compare.verdicts.regressions`). The report opens with the
    settings that differ and the rows with a verdict; rows of one sample a side are left out of their tables (a line
    counts them) unless ``all_rows``. It ends with :data:`NO_MATCH` when no trial matches. Sub-directories of a
    RUN_ROOT without ``profile_summary.json`` are listed as not compared.

    Raises:
        CompareInputError: ``run_a`` and ``run_b`` are the same folder (under any name: a report of zeros that
            would call itself a repeat run), as :func:`find_trials`, or a matched summary whose members have an
            unexpected shape (the message names both files).
    """
    if os.path.isdir(run_a) and os.path.isdir(run_b) and os.path.samefile(run_a, run_b):
        raise CompareInputError(f"RUN_A {run_a} and RUN_B {run_b} are the same folder: compare sets two runs side by "
                                "side (run the driver again for a repeat, whose deltas show run-to-run noise)")
    (ta, wa), (tb, wb) = find_trials(run_a), find_trials(run_b)
    ga, gb = _groups(ta), _groups(tb)
    out = [REPORT_TITLE, "", f"- A: `{os.path.abspath(run_a)}`", f"- B: `{os.path.abspath(run_b)}`"]
    common = sorted(set(ga) & set(gb))
    for key in sorted(set(ga) ^ set(gb)):
        side, trials = ("A", ga[key]) if key in ga else ("B", gb[key])
        steps = ", ".join(str(s["profile_step"]) for _, s in trials)
        out.append(f"- unmatched: {key[0]} step{'s' if len(trials) > 1 else ''} {steps} only in {side} "
                   f"({', '.join(f'`{dir_name(d)}`' for d, _ in trials)})")
    for side, run in (("A", run_a), ("B", run_b)):
        out += [f"- not compared: `{d}` in {side} has no {SUMMARY_JSON} (a trial not run, e.g. after STOP_ON_FAILURE, "
                "or not postprocessed)" for d in _without_summary(run)]
    pairs = _what_if_pairs(ta, wb)
    for side, run, what_ifs in (("A", run_a, wa), ("B", run_b, wb)):
        left_out = [] if os.path.isfile(os.path.join(run, SUMMARY_JSON)) else what_ifs
        if left_out:
            out.append(f"- what-if trials in {side}, left out of the tables (another configuration; each is set "
                       "against its source trial below where A holds that trial): "
                       + ", ".join(f"`{dir_name(d)}`" for d, _ in left_out))
    out.append("")
    if not common and not pairs:
        out.append(NO_MATCH)
        return "\n".join(out) + "\n", []
    settings = settings_diff(ga[common[0]][0][1], gb[common[0]][0][1]) if common else []
    # (title, the group compared, or None for the what-ifs and the step time; its lines)
    sections: list[tuple[str, Optional[tuple[str, int]], Callable[[], list[str]]]] = (
        [("What-ifs tried", None, lambda: _what_if_section(pairs))] if pairs else [])
    if common:
        sections += [("Step time", None, lambda: _step_time_section(list(ta.values()), list(tb.values())))]
        sections += [(_group_name(key[0], ga[key], gb[key]), key,
                      partial(_group_section, key[0], ga[key], gb[key], settings)) for key in common]
    body: list[str] = []
    with compare_verdicts.collecting(all_rows) as rows:
        for name, group, section in sections:
            rows.group = name
            try:
                body += section()
            except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
                dirs = [d for d, _ in (list(ta.values()) + list(tb.values()) if group is None
                                       else ga[group] + gb[group])]
                files = " and ".join(os.path.join(d, SUMMARY_JSON) for d in dirs)
                raise CompareInputError(f"cannot compare {files}: a member has an unexpected shape "
                                        f"({type(exc).__name__}: {exc}); rerun postprocess_profile.py for them") from None
    if common:
        out += ["## Settings", ""] + settings + compare_verdicts.verdict_section(rows.rows) + _verdict_note()
    return "\n".join(out + body).rstrip() + "\n", rows.rows


def _group_name(kind: str, ta: list[Trial], tb: list[Trial]) -> str:
    """A group in a few words, as its section's title (:func:`_group_title`): ``kernel step 2`` (one trial a side at
    one step), ``kernel trials after step 0`` (pooled)."""
    if len(ta) == len(tb) == 1 and ta[0][1]["profile_step"] == tb[0][1]["profile_step"]:
        return f"{kind} step {ta[0][1]['profile_step']}"
    return f"{kind} trials after step 0"
