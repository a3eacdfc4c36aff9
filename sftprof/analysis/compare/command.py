"""The ``compare`` command of ``postprocess_profile.py``: its arguments, the report's file and the ``--fail-on``
gate (the report itself: :func:`sftprof.analysis.compare.runs.compare`; the gate's rows:
:mod:`sftprof.analysis.compare.verdicts`).
"""
import argparse
import errno
import os
import sys

from sftprof.analysis.compare.runs import NO_MATCH, CompareInputError, compare
from sftprof.analysis.compare.verdicts import GATE_METRICS, parse_metrics, regressions
from sftprof.artifacts import compare_report_name, keep_previous
from sftprof.atomic import WriteError, atomic_path, put_text

_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, quota or file-size limit: exit 1
REGRESSION_STATUS = 3  # compare --fail-on: B is worse than A on a chosen metric
NOT_JUDGED_STATUS = 4  # compare --fail-on: no regression, but a chosen metric had no verdict (no or too few samples)


def _same_text(path: str, text: str) -> bool:
    """Whether ``path`` is a regular file holding exactly ``text`` (UTF-8); False when it cannot be read."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read() == text
    except (OSError, UnicodeDecodeError):
        return False


def compare_command(argv: list[str]) -> int:
    """``postprocess_profile.py compare RUN_A RUN_B [--out FILE.md] [--all-rows] [--fail-on METRICS]``: the report
    written (atomically; an earlier one at the default path kept as ``.prev<N>.md``, the same one left as it is) and
    printed; the exit status (the entry point's docstring): 0, 1 when no trials match or the report cannot be written
    for want of space, 2 on bad arguments (argparse), :data:`REGRESSION_STATUS` when ``--fail-on`` finds B worse,
    :data:`NOT_JUDGED_STATUS` when it finds none worse but could not judge a chosen metric."""
    p = argparse.ArgumentParser(prog="postprocess_profile.py compare",
                                description="Markdown tables of deltas (B - A) between two runs, each row with "
                                            "its 95 % interval and verdict; a run's kernel trials after step 0 "
                                            "pooled, kernel step 0 and memory trials matched by step.")
    p.add_argument("run_a", metavar="RUN_A", help="trial run dir or RUN_ROOT (baseline)")
    p.add_argument("run_b", metavar="RUN_B", help="trial run dir or RUN_ROOT (candidate)")
    p.add_argument("--out", metavar="FILE.md",
                   help="a new file to write the report to (an existing one is refused; default: "
                        "RUN_B/compare_vs_<basename of RUN_A>.md, an earlier report there kept as .prev<N>.md)")
    p.add_argument("--all-rows", action="store_true",
                   help="show the rows of one sample a side (no verdict) in the tables; by default one line per table "
                        "counts them")
    p.add_argument("--fail-on", metavar="METRICS",
                   help=f"a gate for CI: exit status {REGRESSION_STATUS} when B is worse than A on one of these "
                        f"metrics (comma-separated: {', '.join(GATE_METRICS)}): step time slower by the rank test's "
                        "95 %% interval, a peak higher (exact for memory); exit status "
                        f"{NOT_JUDGED_STATUS} when none is worse but one has no verdict (no or too few samples)")
    args = p.parse_args(argv)
    try:
        metrics = parse_metrics(args.fail_on) if args.fail_on is not None else []
    except ValueError as exc:
        p.error(str(exc))
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out {args.out}: directory {os.path.dirname(os.path.abspath(args.out))} does not exist")
    if args.out and os.path.lexists(args.out):
        p.error(f"--out {args.out}: exists; never overwritten: name a new file")
    try:
        report, rows = compare(args.run_a, args.run_b, args.all_rows)
    except CompareInputError as exc:
        p.error(str(exc))
    out = args.out or os.path.join(args.run_b, compare_report_name(args.run_a))  # "." named as its dir
    try:
        if not args.out and _same_text(out, report):  # a rerun on the same summaries: nothing new to keep
            print(f"[postprocess] {out} unchanged (it already holds this report: same inputs), left as it is",
                  file=sys.stderr)
        else:
            with atomic_path(out, replace=False) as tmp:  # written in full before it takes the name
                put_text(tmp, report)
                if not args.out and os.path.lexists(out):
                    kept = f"{out[: -len('.md')]}.prev{keep_previous([out])}.md"
                    print(f"[postprocess] kept the earlier report {out} as {kept}", file=sys.stderr)
            print(f"[postprocess] wrote {out}", file=sys.stderr)
    except FileExistsError:  # created by someone else since the check above
        p.error(f"--out {out}: exists; never overwritten: name a new file")
    except WriteError as exc:  # an earlier report stays where it was
        if exc.errno not in _OUT_OF_SPACE:
            p.error(f"--out {out}: {exc.strerror}")
        print(f"[postprocess] ERROR {exc.strerror}", file=sys.stderr)
        return 1
    print(report)
    if report.rstrip().endswith(NO_MATCH):
        print(f"[postprocess] ERROR: {NO_MATCH} Nothing was compared.", file=sys.stderr)
        return 1
    if not metrics:
        return 0
    worse, unjudged = regressions(rows, metrics)
    for line in unjudged:
        print(f"[postprocess] --fail-on {line}", file=sys.stderr)
    for line in worse:
        print(f"[postprocess] REGRESSION {line}", file=sys.stderr)
    if worse:
        return REGRESSION_STATUS
    if unjudged:
        print(f"[postprocess] ERROR: --fail-on {','.join(metrics)}: no regression found, but the gate could not judge "
              f"{len(unjudged)} of its metrics: give them samples (TOTAL_STEPS, PROFILE_STEPS, memory trials) or "
              "leave them out of --fail-on", file=sys.stderr)
        return NOT_JUDGED_STATUS
    print(f"[postprocess] --fail-on {','.join(metrics)}: no regression", file=sys.stderr)
    return 0
