"""The end-of-run text: a narrow table of the trials, where each trial's wall time went, the summaries to open, the
compare command, and the warnings given before launch (repeated so that they are not lost above the trials' output)."""
from __future__ import annotations

import csv
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from sftprof import artifacts
from sftprof.launch.summaries import (read_summary, summary_errors, table_figures, top_finding, wall_phases,
                                      what_if_lines)
from sftprof.config import is_folder_name
from sftprof.config.settings import shown
from sftprof.launch.variables import REPO_ROOT, DriverError
from sftprof.progress import duration_text

NO_WHAT_IF = "-"  # summary.tsv's what_if column of a planned trial (sftprof.launch.what_ifs)
NOT_RUN = "not run"  # summary.tsv status of a planned trial the driver did not run (STOP_ON_FAILURE=1, an interrupt)
INTERRUPTED = "interrupted"  # summary.tsv status of the trial a Ctrl-C / SIGTERM stopped
CONFIG_CHANGED = "config changed"  # summary.tsv status of a trial not run: the plan's config copy was edited
# the columns of summary.tsv the report reads (sftprof.launch.trials.SUMMARY_HEADER; what_if and train_status may lack)
REPORT_COLUMNS = ("trial", "kind", "step", "status", "run_dir")


def _gib(value: object, device: str | None) -> str:
    if isinstance(value, (int, float)):
        return f"{value:.2f} GiB"
    return "n/a (CPU)" if device == "cpu" else "-"


def _interpreter(python: str | None) -> str:
    """``python`` as a command that runs from any folder: a path made absolute (symlinks kept: a pyenv shim stays
    one), a bare name found on PATH (as given when it is not); None: ``sys.executable``."""
    if not python:
        return sys.executable
    if os.sep in python:
        return os.path.abspath(python)
    return shutil.which(python) or python


# the wall-time table's columns: (header, the summary's wall_time phase; None: elapsed, then postprocessing); the
# summary's atexit phase has no column: it is in exit's (_phase_seconds), the table's width kept
WALL_COLUMNS = (("start", "start_up"), ("imports", "imports"), ("setup", "setup"), ("build", "engine_build"),
                ("step 0", "step_0"), ("steps", "warm_steps"), ("profiled", "profiled_steps"),
                ("profiler", "profiler"), ("teardown", "teardown"), ("exit", "exit"))


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _phase_seconds(phases: dict[str, float | None], key: str) -> float | None:
    """Seconds of the column of phase ``key``: ``exit``'s holds the summary's ``atexit`` (summary 3.11) too, so it
    runs from the teardown record to torchrun's exit with or without the exit record."""
    value, atexit = phases.get(key), phases.get("atexit")
    if key == "exit" and value is not None and atexit is not None:
        return atexit + value
    return value


def _postprocess_cell(run_dir: Path) -> str:
    """Trial's postprocessing seconds from its ``trial_times.json`` (``*``: in the background), ``-`` unknown."""
    try:
        times = artifacts.read_trial_times(run_dir)
    except (OSError, ValueError):
        return "-"
    if times is None or times.postprocess_started_unix_s is None or times.postprocess_ended_unix_s is None:
        return "-"
    return (_seconds(times.postprocess_ended_unix_s - times.postprocess_started_unix_s)
            + ("*" if times.postprocess_background else ""))


def wall_table(labelled: list[tuple[str, Path, dict[str, Any]]]) -> list[str]:
    """Lines of the wall-time table: per trial (``(label, run dir, summary)``) its summary's phases in seconds, the
    elapsed time they sum to (``train``: torchrun launched to ended), its postprocessing, and a line naming each
    step 0's cold-start cost; none when no summary has phases."""
    rows, cold = [], []
    for label, run_dir, summary in labelled:
        phases, elapsed, cold_text = wall_phases(summary)
        if not phases:
            continue
        rows.append([label] + [_seconds(_phase_seconds(phases, key)) for _, key in WALL_COLUMNS]
                    + [_seconds(elapsed), _postprocess_cell(run_dir)])
        if cold_text is not None:
            cold.append(f"{label} {cold_text}")
    if not rows:
        return []
    header = ["trial"] + [h for h, _ in WALL_COLUMNS] + ["train", "postproc"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["", "wall time per trial, s (train: torchrun's launch to its exit; postproc *: while the next trial "
                 "trained):"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
              for r in [header] + rows]
    if cold:
        lines.append("cold start (step 0's time less a warm step's, inside step 0 or profiled): " + "; ".join(cold))
    return lines


def read_summary_tsv(run_root: Path) -> list[dict[str, str]]:
    """The rows of ``run_root/summary.tsv`` (the driver's, tab-separated, a header line first), each with every column
    of :data:`REPORT_COLUMNS`.

    Raises:
        OSError: the file cannot be read.
        DriverError: it is damaged, ``<path>: <what is wrong>; accepted: ...``: not UTF-8 text, no header line, a
            column of :data:`REPORT_COLUMNS` missing, a row shorter than the header (a truncated file), not CSV.
    """
    path = Path(run_root) / artifacts.SUMMARY_TSV
    accepted = (f"accepted: {artifacts.SUMMARY_TSV} as the driver writes it (tab-separated, a header line with the "
                f"columns {', '.join(REPORT_COLUMNS)}, then one row per trial)")
    try:
        with open(path, encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t")
            rows, header = list(reader), reader.fieldnames
    except UnicodeDecodeError as err:
        raise DriverError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                          f"{accepted}") from None
    except csv.Error as err:
        raise DriverError(f"{path}: not tab-separated text ({err}); {accepted}") from None
    if not header:
        raise DriverError(f"{path}: empty, no header line; {accepted}")
    missing = [c for c in REPORT_COLUMNS if c not in header]
    if missing:
        raise DriverError(f"{path}: no column {', '.join(missing)} (its header: "
                          f"{shown(chr(9).join(header))!r}); {accepted}")
    for n, row in enumerate(rows, start=1):
        if None in row.values():
            raise DriverError(f"{path}: row {n} has {sum(v is not None for v in row.values())} of the "
                              f"{len(header)} columns (a truncated file?); {accepted}")
    return rows


def trial_dir(run_root: Path, row: dict[str, str]) -> Path:
    """The run dir of a ``summary.tsv`` row: ``run_root/<trial>`` when that folder exists (a run root copied or moved
    from the machine that ran it is read from where it is now), else the row's ``run_dir``."""
    here = Path(run_root) / row["trial"]
    return here if is_folder_name(row["trial"]) and here.is_dir() else Path(row["run_dir"])


def report(run_root: Path, node_rank: int = 0, python: str | None = None, warnings: list[str] | None = None) -> str:
    """The end-of-run text: a narrow table of trials, the wall time per trial (:func:`wall_table`), the summaries to
    open, the compare command and ``warnings`` (those given before launch, one line each).

    The compare command works from any folder: ``python`` (the driver's ``PYTHON``; a name without ``/`` is looked
    up on PATH, a relative path made absolute; None: this interpreter) and this repository's
    ``postprocess_profile.py`` by absolute path.

    Columns: trial (kind and step), status (``ok``, ``no snapshot (CPU)``, ``FAILED (<status>)``, ``not run``,
    ``interrupted``; that of a trial that trained, status or ``train_status`` 0, whose summary has errors adds how
    many files it could not read and plots it could not draw: :func:`sftprof.launch.summaries.summary_errors`), step
    time (slowest rank of the profiled step, 3 significant digits), peak memory (GiB allocated, rank 0) and the top
    finding (:func:`sftprof.launch.summaries.top_finding`). Reads ``RUN_ROOT/summary.tsv`` and each trial's
    ``profile_summary.json`` (:func:`read_summary_tsv`, :func:`trial_dir`); a missing or unreadable summary leaves
    ``-`` in its row.

    Raises:
        OSError, DriverError: ``summary.tsv`` cannot be read, or is damaged (:func:`read_summary_tsv`; the ``report``
            subcommand prints it in one line and exits 2).
    """
    rows = read_summary_tsv(run_root)
    table = [("trial", "status", "step time", "peak mem", "top finding")]
    summaries: list[str] = []
    tried: list[tuple[int, str, dict[str, str], Path, dict[str, Any]]] = []
    labelled: list[tuple[str, Path, dict[str, Any]]] = []
    for row in rows:
        run_dir = trial_dir(run_root, row)
        path = run_dir / artifacts.SUMMARY_MD
        summary = read_summary(run_dir)
        step, peak, device = table_figures(summary)
        cpu_memory = row["kind"] == "memory" and device == "cpu"
        status = (row["status"] if row["status"] in (NOT_RUN, INTERRUPTED, CONFIG_CHANGED)
                  else "FAILED (" + row["status"] + ")" if row["status"] != "0"
                  else "no snapshot (CPU)" if cpu_memory else "ok")
        if "0" in (row["status"], row.get("train_status")):  # it trained: its summary's errors are said
            status += summary_errors(summary)
        trial = f"{row['kind']} step {row['step']}"
        if row.get("what_if", NO_WHAT_IF) != NO_WHAT_IF:  # a what-if trial (TRY_WHAT_IFS): named below the table
            tried.append((len(tried) + 1, trial, row, run_dir, summary))
            trial += f" what-if {len(tried)}"
        labelled.append((trial, run_dir, summary))
        table.append((trial, status, duration_text(step) if step is not None else "-",
                      _gib(peak, device), top_finding(summary) if summary else ("see node 0" if node_rank else "-")))
        if path.is_file():
            summaries.append(str(path))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(r[:4], widths)) + "  " + r[4] for r in table]
    lines += wall_table(labelled)
    if tried:
        lines += ["", "what-ifs tried (prediction against outcome; the compare report in the what-if trial's run dir):"]
        for k, trial, row, run_dir, summary in tried:
            found = what_if_lines(run_dir, summary) if summary else [
                f"{row['what_if']} ({row['status']}: no summary)"]
            lines += [f"  what-if {k}: {trial}, {found[0]}"] + [f"    {x}" for x in found[1:]]
    if summaries:
        lines += ["", "summaries (Markdown; the .json next to each holds every figure):"] + [f"  {p}" for p in summaries]
        lines += ["", "compare with another run (run roots or trial dirs):",
                  f"  {shlex.quote(_interpreter(python))} {shlex.quote(str(REPO_ROOT / 'postprocess_profile.py'))} "
                  f"compare {shlex.quote(str(run_root))} OTHER_RUN_ROOT"]
    elif node_rank:
        lines += ["", f"node {node_rank}: node 0 postprocesses every rank; its RUN_ROOT holds the summaries"]
    if warnings:
        lines += ["", "warnings before launch (also in profile_settings.log):"] + [f"  {w}" for w in warnings]
    return "\n".join(lines) + "\n"
