"""``python -m sftprof.launch``: the launcher's commands.

- ``run [key=value ...]``: the driver (``run_qwen3_30b_a3b_sft_profile.sh`` starts it): plan, write the plan into
  RUN_ROOT, run the trials, print the end table; ``-h``/``--help`` prints the variables instead.
- ``plan [key=value ...]``: plan and write the plan, launch nothing; prints the run's settings as ``KEY=value`` lines
  (shell-quoted).
- ``usage [--markdown]``: the ``--help`` text, or the table of variables as Markdown (``docs/driver_variables.md``).
- ``report RUN_ROOT``: the end table of a run again.

Exit status: 0; 2 on bad input (nothing written or launched); 128 + the signal when SIGINT, SIGTERM, SIGHUP or
SIGPIPE stopped it; ``FIT_CHECK=only`` (``run`` and ``plan``: the plan's fit check printed, nothing written or
launched): 0 fits, 3 does not fit;
``run``: else that of the last failing trial.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Callable, Mapping

from sftprof import artifacts
from sftprof.config import ConfigError
from sftprof.launch.folders import remove_plan, write_plan
from sftprof.launch.plan_types import RunPlan, Trial
from sftprof.launch.planning import plan
from sftprof.launch.report import report
from sftprof.launch.signals import PlanInterrupted, ignore_signals, plan_handlers, say, signals_held
from sftprof.launch.signals import name as signal_name
from sftprof.launch.trials import TrialRunner
from sftprof.launch.variables import (DRIVER_SCRIPT, FIT_ONLY_NO_FIT, REPO_ROOT, DriverError, markdown_table,
                                      suspect_variables, unknown_allowed, usage)

# The settings ``plan`` prints (KEY=value lines): fields of RunPlan.
PLAN_KEYS = ("run_root", "trials", "stop_on_failure", "node_timeout", "nproc_per_node", "nnodes", "node_rank",
             "master_addr", "master_port")


def plan_run(env: Mapping[str, str], overrides: list[str],
             on_planned: Callable[[], None]) -> tuple[list[Trial], RunPlan] | int:
    """Plan (:func:`sftprof.launch.planning.plan`) and write the plan into RUN_ROOT
    (:func:`sftprof.launch.folders.write_plan`) under the plan's signal handlers; returns ``(trials, run_plan)``, or
    the exit status when the plan stopped: ``FIT_CHECK=only``'s (:func:`_fit_only`, nothing written), 2 on bad input
    (the message printed), 128 + the signal on one of :data:`sftprof.launch.signals.SIGNALS` (what the plan wrote
    removed, and said in one line). Once the plan is written, its notices are printed and ``on_planned`` (the
    caller's signal handlers) runs with the signals held: a signal from then on is the caller's.
    """
    created: list[Path] = []
    run_root = None
    try:
        try:
            trials, settings, run_plan = plan(env, overrides)
            if run_plan.fit_only is not None:
                return _fit_only(run_plan)
            run_root = run_plan.run_root
            write_plan(trials, settings, run_plan, created)
        except (DriverError, ConfigError) as err:
            try:
                allowed = unknown_allowed(env)
            except DriverError:  # that is the error
                allowed = False
            for _, near, message in suspect_variables(env):  # one may be why the plan failed (N_GPU_PER_NODE ignored)
                if allowed or not near:  # the others are the error itself
                    say(f"warning: {message}")
            say(str(err))
            return 2
        with signals_held():
            for line in run_plan.notices:
                say(line)
            on_planned()
        return trials, run_plan
    except PlanInterrupted as stop:
        say(f"{signal_name(stop.signum)} received during the plan: nothing was launched; "
            f"{remove_plan(run_root, created)}")
        return 128 + stop.signum


def _fit_only(run_plan: RunPlan) -> int:
    """``FIT_CHECK=only``: print the plan's notices (the fit check among them) and a last line, write and launch
    nothing; 0 when the worst rank fits, :data:`~sftprof.launch.variables.FIT_ONLY_NO_FIT` when it does not."""
    for line in run_plan.notices:
        say(line)
    say(f"FIT_CHECK=only: the worst rank {'fits' if run_plan.fit_only else 'does not fit'} one GPU; nothing was "
        "written or launched")
    return 0 if run_plan.fit_only else FIT_ONLY_NO_FIT


def _run(argv: list[str], env: Mapping[str, str]) -> int:
    for arg in argv:
        if arg in ("-h", "--help"):
            print(usage(env.get("CONFIG") or None), end="")
            return 0
    for arg in argv:
        if arg.startswith("-"):
            say(f"unknown option {arg}; accepted: -h/--help, otherwise key=value config overrides (and driver "
                f"variables in the environment): bash {REPO_ROOT / DRIVER_SCRIPT} --help")
            return 2
    runner = TrialRunner(env.get("PYTHON") or sys.executable, dict(env))
    planned = plan_run(env, argv, runner.stop.install)
    return planned if isinstance(planned, int) else runner.run(*planned)


def _plan(argv: list[str], env: Mapping[str, str]) -> int:
    planned = plan_run(env, argv, ignore_signals)  # the plan is complete: nothing to remove any more
    if isinstance(planned, int):
        return planned
    for key in PLAN_KEYS:
        print(f"{key.upper()}={shlex.quote(str(getattr(planned[1], key)))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The launcher's command line (module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    env = os.environ
    if argv and argv[0] in ("run", "plan"):
        plan_handlers()
        return (_run if argv[0] == "run" else _plan)(argv[1:], env)
    ap = argparse.ArgumentParser(prog="python -m sftprof.launch", description="sftprof launcher (see run_qwen3_30b_a3b_"
                                 "sft_profile.sh --help); run [key=value ...] and plan [key=value ...] take overrides")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run", help="the driver: plan, run the trials, print the end table")
    sub.add_parser("plan", help="validate the driver variables and write RUN_ROOT's plan; launch nothing")
    p_usage = sub.add_parser("usage", help="print the driver's --help text")
    p_usage.add_argument("--markdown", action="store_true", help="the table of variables as Markdown")
    p_report = sub.add_parser("report", help="print the end-of-run table, the summaries and the compare command")
    p_report.add_argument("run_root")
    p_report.add_argument("--node-rank", type=int, default=0)
    p_report.add_argument("--python", help="the interpreter the compare command names (default: this one)")
    args = ap.parse_args(argv)
    if args.cmd == "usage":
        config = env.get("CONFIG") or None
        print(markdown_table(config) if args.markdown else usage(config), end="")
        return 0
    try:
        print(report(Path(args.run_root), args.node_rank, args.python), end="")
    except OSError as err:
        say(f"report {args.run_root}: cannot read {err.filename} ({err.strerror}); accepted: a RUN_ROOT the driver "
            f"planned ({artifacts.TRIALS_TSV}) and started ({artifacts.SUMMARY_TSV})")
        return 2
    except DriverError as err:  # a damaged summary.tsv
        say(f"report {args.run_root}: {err}")
        return 2
    return 0

