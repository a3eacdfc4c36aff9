#!/usr/bin/env python3
"""Postprocess a profiled trial, or compare two runs.

  postprocess_profile.py --log-dir LOG_DIR --run-dir RUN_DIR [--profile-kind {kernel,memory}] \\
      [--profile-step N] [--trainer-log PATH] [--nvidia-smi-csv PATH] [--compress] [--after-trial FD]
  postprocess_profile.py --run-dir RUN_ROOT [--compress]     (every trial of RUN_ROOT/trials.tsv, as the driver does)
  (--trainer-log defaults to LOG_DIR/trainer.log when that file exists: what the driver passes)
  postprocess_profile.py compare RUN_A RUN_B [--out FILE.md] [--all-rows] [--fail-on METRICS]

With --run-dir RUN_ROOT alone, every trial its trials.tsv lists is postprocessed as the driver does (a trial the
driver did not start is skipped); the exit status is the highest of the trials'.

With --after-trial FD the process parses its arguments, imports what postprocessing needs (it reads every bundled
model config, which imports torch and each model family's config class, and imports matplotlib's pyplot: a head
start only, whose failure is met again, if at all, where the postprocessing meets it), then reads one line of
further arguments from file descriptor FD (0: standard input), a JSON list of strings (["--nvidia-smi-csv", "PATH"]
or []), and postprocesses as without the option. The driver starts it this way when it launches the trial (FD: a
socket of its own, so a PYTHON wrapper that closes standard input keeps it) and writes that line once the trial has
ended: in a fresh process on one H100 host the model config's first load took 12.1 s, most of it these imports, and
a memory trial's whole postprocessing 11.1 s (4.2 of 4.6 s on this project's 2-core CPU machine), and the last
trial's is on the run's critical path. End of input with no line (the trial was interrupted, or the run stopped) is
exit 0 with nothing written or printed; a line that is not a JSON list of strings, or an FD that is not open, is
exit 2.

The kind and step default to what the trial's own completion record (stats.jsonl) names; given, they are a
check: another kind than the recorded one, or a step the trial did not profile, is an error (exit 2, nothing
written; the record names the first profiled step; a trial that profiled several is postprocessed once per step).

Exit status: 0 on success (an --nvidia-smi-csv or --trainer-log that is missing or holds nothing usable is a
warning), 1 when a trace, snapshot, rank_coords.json or config.yaml could not be processed, or a trace or
snapshot is not the trial's (another step's or rank's trace, a rank in its name at or above the trial's world
size: not summarised; the summary still names the file and its error) or when compare finds no trials that match
(kernel trials after step 0 pooled, kernel step 0 and memory trials by step; the report is still written), or
when an output cannot be written for want of space (a full disk, a quota; the message names the file and the free
space): every summary, report, plot and view is written under a temporary name in its folder and renamed when
complete (sftprof/atomic.py), so what an earlier postprocess wrote stays in place, 2 on bad arguments: a
--profile-kind the trial did not record; a
--run-dir that cannot be written; a --log-dir that does not exist (with --profile-kind and --profile-step given,
the trial's summary is still written, as failed, unless the run dir already holds one; otherwise nothing is
written, not even the run dir); a RUN_ROOT given with --log-dir (or as --log-dir), a trial run dir without
--log-dir, an experiment folder of several trials' log dirs as --log-dir, a --log-dir and --run-dir of two
trials (the trial_name of LOG_DIR/config.yaml and of RUN_DIR/train_args.txt differ: nothing written or moved);
compare inputs that are missing or not profile summaries, or one folder given as both RUN_A and RUN_B; an --out
whose directory does not exist or that names an existing file (never overwritten; without --out an earlier report
at the default path is kept as compare_vs_<A>.prev<N>.md, unless it is the same report, which is then left as it
is). The message names the file or setting. 141 (128 + SIGPIPE)
when standard output is a pipe its reader closed early (| head): what was to be written is written, the rest of
the output is dropped without a traceback. 143 or 129 (128 + SIGTERM or SIGHUP) when stopped by that signal, 130 on
Ctrl-C (one line, no traceback), each after the temporary files are removed. compare --fail-on step_time,peak_allocated,peak_reserved (any of them):
3 when B is worse than A on one (step time slower by the rank test's 95 % interval, a peak higher), 4 when none is
worse but one has no verdict (no or too few samples: named), after the report is written; --fail-on with another
name is exit 2.

<A> is the last component of RUN_A's absolute path (compare . ../B, run inside run A, names A).
"""
from __future__ import annotations

import argparse
import csv
import gc
import glob
import json
import os
import sys
import tempfile

from sftprof.analysis.compare.command import compare_command
from sftprof.analysis.summary import SUMMARY_JSON, summarise_trial
from sftprof.analysis.trial.inputs import other_trial
from sftprof.analysis.trial.profile_check import PROFILE_KINDS, NotRecorded, resolve_profile
from sftprof.analysis.report.summary_file import summary_left_unchanged
from sftprof.artifacts import (LAUNCHER_LOG, NVIDIA_SMI_CSV, STATS, SUMMARY_TSV, TRAINER_LOG, TRIALS_TSV,
                               read_trials_tsv)
from sftprof.atomic import WriteError
from sftprof.cli import run_main
from sftprof.launch.report import CONFIG_CHANGED
from sftprof.analysis.report.pyplot import pyplot
from sftprof.models.hf import import_config_reader


def _trial_log_dirs(log_dir: str) -> list[str]:
    """The trial log dirs (they hold stats.jsonl) under ``log_dir``, relative to it, when ``log_dir`` itself is not
    one: the nearest level that has any, for FILEROOT, FILEROOT/logs, FILEROOT/logs/<user> or the experiment folder
    FILEROOT/logs/<user>/<experiment> given for a trial's log dir."""
    if not os.path.isdir(log_dir) or os.path.exists(os.path.join(log_dir, STATS)):
        return []
    for depth in range(1, 5):  # FILEROOT/logs/<user>/<experiment>/<trial>: four levels below FILEROOT
        found = glob.glob(os.path.join(glob.escape(log_dir), *["*"] * depth, STATS))
        if found:
            return sorted(os.path.relpath(os.path.dirname(f), log_dir) for f in found)
    return []


def _run_root(run_root: str, compress: bool) -> int:
    """Postprocess every trial of ``RUN_ROOT/trials.tsv`` that the driver started (its run dir has a launcher.log) as
    the driver does (its kind, step, log dir, trainer log and nvidia-smi log). The trial's run dir is its folder in
    ``run_root``, and a log dir recorded under the run root the driver made (the default ``RUN_ROOT/fileroot``) is
    read under ``run_root``: a run root copied or moved (to another machine, say) is postprocessed from its own files,
    never from the original's. Returns the highest status of the trials (each trial's errors are its own; the others
    are still postprocessed)."""
    try:
        trials = read_trials_tsv(run_root)
    except (OSError, ValueError) as exc:
        print(f"postprocess_profile.py: error: {exc}", file=sys.stderr)
        return 2
    if not trials:
        print(f"postprocess_profile.py: error: {os.path.join(run_root, TRIALS_TSV)} lists no trial (the driver writes "
              "one row per planned trial before the first starts): nothing to postprocess", file=sys.stderr)
        return 2
    try:  # the driver's status of each trial it reached (a run stopped early has fewer rows)
        with open(os.path.join(run_root, SUMMARY_TSV), encoding="utf-8") as f:
            statuses = {row["trial"]: row["status"] for row in csv.DictReader(f, delimiter="\t")}
    except (OSError, KeyError, csv.Error):
        statuses = {}
    status = 0
    for n, (name, kind, step, recorded_run_dir, log_dir) in enumerate(trials, start=1):
        run_dir, recorded_root = os.path.join(run_root, name), os.path.dirname(recorded_run_dir)
        if os.path.realpath(recorded_root) != os.path.realpath(run_root) and \
                os.path.commonpath([recorded_root, log_dir]) == recorded_root:
            log_dir = os.path.join(run_root, os.path.relpath(log_dir, recorded_root))
        if not os.path.isfile(os.path.join(run_dir, LAUNCHER_LOG)):  # a trial the driver did not start
            print(f"[postprocess] [{n}/{len(trials)}] {name}: not run (no {LAUNCHER_LOG}), nothing to postprocess",
                  file=sys.stderr)
            continue
        if statuses.get(name) == CONFIG_CHANGED:  # refused before torchrun: its launcher.log holds the reason
            print(f"[postprocess] [{n}/{len(trials)}] {name}: not run ({CONFIG_CHANGED}: see its {LAUNCHER_LOG}), "
                  "nothing to postprocess", file=sys.stderr)
            continue
        print(f"[postprocess] [{n}/{len(trials)}] {name} (kind={kind} step={step})", file=sys.stderr)
        argv = ["--log-dir", log_dir, "--run-dir", run_dir, "--profile-kind", kind, "--profile-step", str(step)]
        smi = os.path.join(run_dir, NVIDIA_SMI_CSV)
        argv += ["--nvidia-smi-csv", smi] if os.path.isfile(smi) and os.path.getsize(smi) else []
        try:
            code = main(argv + (["--compress"] if compress else []))
        except SystemExit as exc:  # that trial's bad input (argparse): said, and the next trial goes on
            code = exc.code if isinstance(exc.code, int) else 2
        status = max(status, code)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "compare":
        return compare_command(argv[1:])
    p = argparse.ArgumentParser(description="Split kernel traces into views / archive memory snapshots and "
                                            f"write {SUMMARY_JSON} and profile_summary.md for one trial.",
                                epilog="Compare two runs: postprocess_profile.py compare RUN_A RUN_B [--out FILE.md]")
    p.add_argument("--log-dir", help="trial log dir written by the trainer (required with a trial run dir)")
    p.add_argument("--run-dir", required=True,
                   help=f"trial run dir (outputs); or a RUN_ROOT (it holds {TRIALS_TSV}) alone: every trial of it")
    p.add_argument("--profile-kind", choices=PROFILE_KINDS,
                   help="default: the kind the trial's completion record names; given, a check (another kind is an "
                        "error)")
    p.add_argument("--profile-step", type=int, help="default: the step the trial's completion record names; given, a "
                                                    "check (a step the trial did not profile is an error)")
    p.add_argument("--trainer-log", help="trainer log; its tail is kept in the summary of a failed trial (default: "
                                         f"LOG_DIR/{TRAINER_LOG} when that file exists, as the driver passes it)")
    p.add_argument("--nvidia-smi-csv", help="nvidia-smi --query-gpu=timestamp,index,utilization.gpu,"
                                           "memory.used,memory.total --format=csv,nounits log")
    p.add_argument("--compress", action="store_true", help="write trace views as .json.gz")
    p.add_argument("--after-trial", type=int, metavar="FD",
                   help="import what postprocessing needs, then read one line of further arguments (a JSON list of "
                        "strings) from file descriptor FD (0: standard input) once the trial has ended; end of input "
                        "with no line: exit 0, nothing written. The driver starts postprocessing this way while the "
                        "trial trains")
    args = p.parse_args(argv)
    if os.path.isfile(os.path.join(args.run_dir, TRIALS_TSV)) and args.after_trial is not None:
        p.error(f"--run-dir {args.run_dir} is a RUN_ROOT (it holds {TRIALS_TSV}), which takes no --after-trial: the "
                "driver waits with one trial's postprocessing only")
    if args.after_trial is not None:
        try:
            import_config_reader()
            pyplot()  # the plots' import, 0.55 of the 1.2 s after the go for a memory trial on the CPU machine
        except Exception:  # noqa: BLE001 (a head start only: what failed fails again where a plain run meets it)
            pass
        # what the imports made is never garbage: the collector skips it from now on (without this, a CPU kernel
        # trial's postprocessing took 1.6-2.2 s after the go against 1.3-1.5 s for a whole plain run on this
        # project's 2-core CPU machine, its traces' objects collected among those of torch and transformers)
        gc.freeze()
        try:
            with open(args.after_trial, "rb", closefd=args.after_trial != 0) as go:
                line = go.readline().decode()
        except (OSError, UnicodeDecodeError) as exc:
            p.error(f"--after-trial {args.after_trial}: cannot read a line from that file descriptor ({exc})")
        if not line:  # the trial will not be postprocessed
            return 0
        try:
            more = json.loads(line)
        except ValueError:
            more = None
        if not isinstance(more, list) or not all(isinstance(a, str) for a in more):
            p.error(f"--after-trial {args.after_trial}: the line read, {line.strip()[:200]!r}, is not a JSON list of "
                    "strings (further arguments)")
        args = p.parse_args(argv + more)
    if os.path.isfile(os.path.join(args.run_dir, TRIALS_TSV)):
        given = [f for f, v in (("--log-dir", args.log_dir), ("--profile-kind", args.profile_kind),
                                ("--profile-step", args.profile_step), ("--trainer-log", args.trainer_log),
                                ("--nvidia-smi-csv", args.nvidia_smi_csv)) if v is not None]
        if given:
            p.error(f"--run-dir {args.run_dir} is a RUN_ROOT (it holds {TRIALS_TSV}), which takes no "
                    f"{', '.join(given)}: pass it alone to postprocess every trial it lists, or pass one trial's "
                    f"--log-dir and --run-dir ({TRIALS_TSV} lists both)")
        return _run_root(args.run_dir, args.compress)
    if args.log_dir is None and not os.path.isdir(args.run_dir):
        p.error(f"--run-dir {args.run_dir} {'is not a folder' if os.path.exists(args.run_dir) else 'does not exist'}: "
                f"pass a RUN_ROOT (it holds {TRIALS_TSV}) alone, or a trial's run dir with its --log-dir")
    if args.log_dir is None:
        p.error(f"--log-dir is required with a trial run dir ({args.run_dir} holds no {TRIALS_TSV}, so it is not a "
                "RUN_ROOT); the driver printed each trial's log dir, and RUN_ROOT/trials.tsv lists them")
    if os.path.isfile(os.path.join(args.log_dir, TRIALS_TSV)):
        p.error(f"--log-dir {args.log_dir} is a RUN_ROOT (it holds {TRIALS_TSV}), not a trial's log dir: pass it alone "
                f"as --run-dir to postprocess every trial it lists")
    several = _trial_log_dirs(args.log_dir)
    if several:
        p.error(f"--log-dir {args.log_dir} holds the log dirs of {len(several)} trials ({', '.join(several[:3])}"
                f"{', ...' if len(several) > 3 else ''}), not one: pass one of them with its trial's --run-dir, or "
                "pass the RUN_ROOT alone as --run-dir to postprocess every trial")
    mismatch = other_trial(args.log_dir, args.run_dir)  # another trial's run dir: its summary would be pushed aside
    if mismatch:
        p.error(mismatch)
    if args.trainer_log is None and os.path.isfile(os.path.join(args.log_dir, TRAINER_LOG)):
        # what the driver passes: a standalone rerun reads the same inputs (and a failed trial gets its log's tail)
        args.trainer_log = os.path.join(args.log_dir, TRAINER_LOG)
    unrecorded = None  # a kind or step neither given nor recorded: said after a run dir that cannot be written
    try:  # refused before anything is created: a kind or step the trial did not profile; a missing log dir
        kind, step = resolve_profile(args.log_dir, args.profile_kind, args.profile_step)
    except NotRecorded as exc:
        unrecorded = str(exc)
    except ValueError as exc:
        p.error(str(exc))
    earlier = os.path.join(args.run_dir, SUMMARY_JSON)
    if not os.path.isdir(args.log_dir) and os.path.exists(earlier):  # a mistyped --log-dir: keep what is there
        p.error(f"--log-dir {args.log_dir} does not exist and {earlier} is already written; nothing was overwritten "
                "(a failed trial's summary is written only into a run dir without one)")
    try:  # a run dir that cannot be written is the user's error, found before any trace is read
        os.makedirs(args.run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=args.run_dir):
            pass
    except OSError as exc:
        p.error(f"--run-dir {args.run_dir}: cannot be written ({exc.strerror})")
    if unrecorded:
        p.error(unrecorded)
    try:
        summary, code = summarise_trial(args.log_dir, args.run_dir, kind, step, trainer_log=args.trainer_log,
                                        nvidia_smi_csv=args.nvidia_smi_csv, compress=args.compress)
    except WriteError as exc:  # a full disk: that file's error; what an earlier postprocess wrote stays in place
        print(f"[postprocess] ERROR {exc.strerror}; no summary written", file=sys.stderr)
        return 1
    for err in summary["errors"]:
        print(f"[postprocess] ERROR {err['file']}: {err['error']}", file=sys.stderr)
    for warn in summary["warnings"]:
        print(f"[postprocess] WARNING {warn['file']}: {warn['warning']}", file=sys.stderr)
    for skip in summary["skipped"]:
        print(f"[postprocess] skipped {skip['file']}: {skip['reason']}", file=sys.stderr)
    path = os.path.join(args.run_dir, SUMMARY_JSON)
    done = f"{path} unchanged (same inputs), left as it is" if summary_left_unchanged(summary) else f"wrote {path}"
    print(f"[postprocess] {done} (trial status {summary['status']}, {summary['counts']})", file=sys.stderr)
    return code


if __name__ == "__main__":
    run_main(main, stop_signals=True)
