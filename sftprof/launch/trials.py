"""Running the planned trials: per trial its torchrun and postprocessing (node 0; the processes:
:mod:`sftprof.launch.processes`), its status and its row of ``RUN_ROOT/summary.tsv``; then a ``not run`` row for
each trial that did not run, and the end table.

A signal stops the run (:mod:`sftprof.launch.signals`): torchrun gets SIGTERM and stops its workers, the trial is
recorded as ``interrupted``, the trials after it as ``not run``, the exit status is 128 + the signal; from the signal
on, the children's output goes to ``launcher.log`` only (no tracebacks on the console). A torchrun signalled by
someone else stops the run the same way (its ``SignalException`` in its output); one killed outright (SIGKILL) fails
its trial with torchrun's status 128 + the signal, named in the node end record that the summary reads
(:mod:`sftprof.launch.nodes`). A trial whose config is not the plan's (:func:`config_changed`) is not run.

A trial whose next trial is a memory trial is postprocessed in the background while that one trains
(:class:`TrialRunner`); its record waits until that training ends, and a signal then, or a failure with
``STOP_ON_FAILURE=1``, is taken as after its postprocessing in the foreground. Each trial's clock (torchrun launched
and ended, postprocessing launched, started and ended) goes to ``RUN_DIR/trial_times.json``
(:class:`sftprof.artifacts.TrialTimes`), which postprocessing reads for the summary's wall-time phases.

Each trial's postprocessing is started (node 0) when the trial is launched and does its imports while it trains
(:meth:`~sftprof.launch.processes.TrialProcesses.start_postprocess`); it goes on when the trial has ended, or ends
having done nothing when the trial is not postprocessed.

The trial's kind and step go to postprocessing from the same :class:`~sftprof.launch.plan_types.Trial` that gave the
trainer its config (no file read back). With ``TRY_WHAT_IFS`` set the what-if trials (:mod:`sftprof.launch.what_ifs`)
follow the planned ones, each compared with the trial it varies.
"""
from __future__ import annotations

import csv
import hashlib
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sftprof import artifacts
from sftprof.analysis.trial.inputs import read_tried_what_if
from sftprof.artifacts import TrialTimes, write_trial_times
from sftprof.stats_log import read_stats
from sftprof.launch.nodes import wait_for_nodes
from sftprof.launch.plan_types import PlanConfig, RunPlan, Trial
from sftprof.launch.processes import STOPPED_STATUSES, Console, Postprocessing, TrialProcesses, exit_status
from sftprof.launch.report import CONFIG_CHANGED, INTERRUPTED, NO_WHAT_IF, NOT_RUN, report
from sftprof.launch.signals import RunStop, ignore_signals, name, say
from sftprof.launch.variables import DriverError
from sftprof.launch.what_ifs import choose, settings_of, what_if_trial, write_what_if_plan

SUMMARY_HEADER = ("trial", "kind", "step", "status", "train_status", "postprocess_status", "elapsed_s", "run_dir",
                  "log_dir", "what_if")



def trial_status(log_dir: Path) -> int:
    """0 if ``log_dir/stats.jsonl`` ends with ``{"type": "complete", "status": "ok"}``, else 1."""
    try:
        completion = read_stats(Path(log_dir) / artifacts.STATS).completion
    except OSError:  # no stats.jsonl: the trainer never started
        return 1
    return 0 if completion is not None and completion.status == "ok" else 1


def record_trials_not_run(run_root: Path) -> list[str]:
    """Append to ``RUN_ROOT/summary.tsv`` a row of status ``not run`` for each trial of ``trials.tsv`` that has no
    row there (those after a failure with ``STOP_ON_FAILURE=1``, or after an interrupt), so summary.tsv has one row
    per planned trial.

    The row keeps the trial's name, kind, step, run dir, log dir and, for a what-if trial, its settings (from its
    ``what_if.json``); its other statuses and ``elapsed_s`` are ``-``. Returns the names of the trials added (in plan
    order; none when every trial ran).

    Raises:
        OSError: ``trials.tsv`` or ``summary.tsv`` cannot be read or written.
    """
    run_root = Path(run_root)
    with open(run_root / artifacts.SUMMARY_TSV, encoding="utf-8") as f:
        done = {row["trial"] for row in csv.DictReader(f, delimiter="\t")}
    added, rows = [], []
    for name_, kind, step, run_dir, log_dir in artifacts.read_trials_tsv(str(run_root)):
        if name_ not in done:
            added.append(name_)
            tried, _ = read_tried_what_if(run_dir)  # a damaged record leaves the row without settings
            what_if = settings_of(tried["what_if"]) if tried else NO_WHAT_IF
            rows.append("\t".join([name_, kind, str(step), NOT_RUN, "-", "-", "-", run_dir, log_dir, what_if]) + "\n")
    if rows:
        with open(run_root / artifacts.SUMMARY_TSV, "a", encoding="utf-8") as f:
            f.writelines(rows)
    return added



def append_row(run_root: Path, t: Trial, status: int | str, train_rc: int | str, pp_rc: int | str,
               elapsed: int) -> None:
    """Append trial ``t``'s row to ``RUN_ROOT/summary.tsv`` (:data:`SUMMARY_HEADER`; ``-`` for a status not known)."""
    with open(run_root / artifacts.SUMMARY_TSV, "a", encoding="utf-8") as f:
        f.write("\t".join(str(x) for x in (t.name, t.kind, t.step, status, train_rc, pp_rc, elapsed, t.run_dir,
                                            t.log_dir, t.what_if or NO_WHAT_IF)) + "\n")


def config_changed(t: Trial, config: PlanConfig) -> str | None:
    """Why trial ``t`` would not run the plan's config: its ``--config`` file is not the plan's copy, or the copy's
    text changed since the plan (:class:`sftprof.launch.plan_types.PlanConfig`); else None."""
    path = t.args[1] if t.args[:1] == ["--config"] and len(t.args) > 1 else None
    if path != config.copy:
        return f"its --config {path} is not the plan's copy {config.copy}"
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        return f"the plan's config {path} cannot be read ({exc.strerror})"
    if digest != config.sha256:
        return (f"the plan's config {path} changed since the plan (sha256 {digest}, planned {config.sha256}): the "
                "trial would not run the plan")
    return None


def source_edited(config: PlanConfig) -> bool:
    """True when the CONFIG file the plan copied differs from the copy's text now, or is gone."""
    try:
        with open(config.source, "rb") as f:
            return f.read() != config.text
    except OSError:
        return True


@dataclass
class Background:
    """A trial postprocessed in the background while the next trial (a memory trial) trains: trial ``n`` (1-based),
    its train status, torchrun's elapsed seconds, its start (``time.monotonic``), its clock record and the running
    postprocessing."""

    n: int
    trial: Trial
    train_rc: int
    elapsed: int
    start: float
    times: TrialTimes
    job: Postprocessing


class TrialRunner:
    """Runs the trials of a written plan and returns the run's exit status: 0, the last failing trial's status, or
    128 + the signal that stopped the run. Made before the plan, so that its signal handlers (:attr:`stop`) can take
    over the moment the plan is written.

    A trial whose next trial is a memory trial is postprocessed in the background while that one trains (a memory
    trial measures no time, so the CPU load perturbs nothing it reports; a kernel trial's training never overlaps
    anything); its row, status and ``done`` line come once that training has ended (:meth:`_join`), before the memory
    trial's, and the run waits for it before the next trial, the what-ifs and the end table."""

    plan: RunPlan  # set by run

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.trials: list[Trial] = []
        self.python = python
        env = {**env, "PYTHONUNBUFFERED": "1"}  # progress lines as they happen, not at exit
        env.setdefault("OMP_NUM_THREADS", "1")   # torchrun's own default, stated so that it does not warn
        # Triton autotuning results kept on disk (TRITON_CACHE_DIR, default ~/.triton/cache): each trial after the
        # first reuses them instead of re-timing every config at step 0 (fla's kernels, sftprof/ops' row kernels).
        env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        self.console = Console()
        self.stop = RunStop(on_first=self._first_signal, on_again=self._signal_again)
        self.processes = TrialProcesses(python, env, self.console, self.stop, self._child_stopped)
        self._source_edited = False  # the CONFIG file differs from the plan's copy (said once)
        self.background: Background | None = None  # the trial postprocessed while the next one trains
        self.final_rc = 0
        self.stopping = False  # STOP_ON_FAILURE=1 and a trial failed: no further trial starts
        self.tries: dict[str, Trial] = {}  # what-if trial name -> the trial it varies

    @property
    def run_root(self) -> Path:
        return self.plan.run_root

    # -- signals (run in the main thread, between two bytecodes of whatever it does) --
    def _first_signal(self, signum: int) -> None:
        self.console.muted = True
        say(f"{name(signum)} received: stopping the run")
        self.processes.terminate()

    def _signal_again(self, signum: int) -> None:
        say(f"{name(signum)} received again: killing torchrun and its workers (SIGKILL)")
        self.processes.kill()

    def _child_stopped(self, child: str, signum: int) -> None:
        """A child got SIGINT or SIGTERM that the launcher did not (a ``kill`` of it): the run stops as after the
        launcher's own signal."""
        self.stop.stopped(signum, by_driver=False)
        self.console.muted = True
        say(f"{child} got signal {signum} (not the driver): stopping the run")

    def _watch_background(self, job: Postprocessing) -> None:
        """(A thread.) A background postprocessing that ends with 130 or 143 while the launcher got no signal was
        killed alone: the run stops as after the launcher's signal, the training trial's torchrun too. A terminal's
        Ctrl-C reaches both: the launcher's handler, in the main thread, has up to a second to record it first."""
        rc = exit_status(job.proc.wait())
        job.ended = (time.time(), time.monotonic())
        deadline = time.monotonic() + 1.0
        while rc in STOPPED_STATUSES and self.stop.signum is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if rc in STOPPED_STATUSES and self.stop.signum is None:
            self._child_stopped("postprocessing", rc - 128)
            self.processes.terminate()

    def run(self, trials: list[Trial], plan: RunPlan) -> int:
        """Run every trial of the plan (:func:`sftprof.launch.planning.plan`), or until a
        signal or, with ``STOP_ON_FAILURE=1``, a failure; with ``TRY_WHAT_IFS``, then the what-if trials of the
        planned trials' summaries, each compared with its source trial (:meth:`_plan_what_ifs`, :meth:`_compare`);
        then the not-run rows and the end table; returns the exit status (a failed what-if trial counts as a failed
        trial)."""
        self.trials, self.plan = trials, plan
        with open(self.run_root / artifacts.SUMMARY_TSV, "x", encoding="utf-8") as f:
            f.write("\t".join(SUMMARY_HEADER) + "\n")
        self.console.line(f"sftprof: run root {self.run_root} (settings in {artifacts.PROFILE_SETTINGS})")
        run_start = time.monotonic()
        planned = list(self.trials)
        n = 0
        while n < len(self.trials):
            if self.stop.signum is not None or self.stopping:  # a signal (or failure) between two trials: no next one
                break
            trial = self.trials[n]
            n += 1
            if self._trial(n, trial, run_start) is None:  # stopped by a signal
                break
            if n == len(planned) and plan.what_ifs and not self.stopping:  # the planned trials ran: their what-ifs
                self.tries = self._plan_what_ifs(planned)
        self._join(run_start, n)
        ignore_signals()
        record_trials_not_run(self.run_root)
        self.console.line("")
        self.console.line(report(self.run_root, plan.node_rank, self.python, plan.warnings).rstrip("\n"))
        return self.stop.status if self.stop.signum is not None else self.final_rc

    def _plan_what_ifs(self, planned: list[Trial]) -> dict[str, Trial]:
        """Choose the what-ifs to try (``TRY_WHAT_IFS``, :mod:`sftprof.launch.what_ifs`), write their folders and
        append them to the trials to run; returns ``{what-if trial name: its source trial}``."""
        chosen, lines = choose(planned, self.plan.what_ifs)
        for line in lines:
            self.console.line(f"sftprof: {line}")
        tries = {}
        for source, what_if in chosen:
            try:
                trial = what_if_trial(source, what_if)
            except DriverError as err:
                say(f"what-if not tried: {err}")
                continue
            write_what_if_plan(self.run_root, trial, source, what_if)
            self.trials.append(trial)
            tries[trial.name] = source
        return tries

    def _compare(self, n: int, source: Trial, trial: Trial) -> None:
        """``postprocess_profile.py compare`` of a what-if trial against its source trial: the report (prediction
        against outcome first) goes to the what-if trial's run dir, its output to its ``launcher.log`` only."""
        out = trial.run_dir / artifacts.compare_report_name(str(source.run_dir))
        rc = self.processes.compare(source, trial)
        self.console.line(f"sftprof: [{n}/{len(self.trials)}] compared with {source.name}: {out}" if rc == 0 else
                          f"sftprof: [{n}/{len(self.trials)}] compare with {source.name} failed (status "
                          f"{exit_status(rc)}; see {trial.run_dir / artifacts.LAUNCHER_LOG})")

    def _trial(self, n: int, t: Trial, run_start: float) -> int | None:
        """Run trial ``n`` (1-based): its status (0 when it is postprocessed in the background: its status comes
        with :meth:`_join`), or None when a signal stopped the run during it. A trial postprocessed in the background
        before it is recorded first (:meth:`_join`), once this one's training is over."""
        total, plan = len(self.trials), self.plan
        self.console.line(f"sftprof: [{n}/{total}] trial {t.name} (kind={t.kind} step={t.step}"
                          + (f", what-if {t.what_if}" if t.what_if else "") + f") started {time.strftime('%H:%M:%S')}")
        start, times = time.monotonic(), TrialTimes(launched_unix_s=time.time())
        changed = self._config_changed(t)
        if changed:
            self._join(run_start, n - 1)  # trial n does not run
            with open(t.run_dir / artifacts.LAUNCHER_LOG, "a", encoding="utf-8") as log:
                log.write(f"sftprof: {changed}\n")
            append_row(self.run_root, t, CONFIG_CHANGED, "-", "-", 0)
            say(f"[{n}/{total}] trial {t.name} not run: {changed}")
            return self._done(n, t, 2)
        if plan.node_rank == 0:  # its postprocessing does its imports while it trains
            self.processes.start_postprocess(t)
            times = replace(times, postprocess_launched_unix_s=time.time())
        write_trial_times(t.run_dir, times)
        torchrun_rc = self.processes.torchrun(t, plan)
        elapsed, times = int(time.monotonic() - start), replace(times, torchrun_ended_unix_s=time.time())
        write_trial_times(t.run_dir, times)
        self._join(run_start, n)
        if self.stop.signum is not None:
            self.processes.drop_postprocess()
            with open(t.run_dir / artifacts.LAUNCHER_LOG, "a", encoding="utf-8") as log:  # postprocessing reads it
                log.write(artifacts.INTERRUPTED_LINE.format(signal=signal.Signals(self.stop.signum).name) + "\n")
            append_row(self.run_root, t, INTERRUPTED, torchrun_rc, "-", elapsed)
            say(f"[{n}/{total}] trial {t.name} interrupted after {elapsed} s (torchrun status {torchrun_rc}); "
                f"{total - n} trial(s) will not run")
            return None
        train_rc = self._train_status(t, torchrun_rc)
        nxt = self.trials[n] if n < total else None
        if (self.stop.signum is None and not self.stopping and plan.node_rank == 0 and nxt is not None
                and nxt.kind == "memory" and not (train_rc and plan.stop_on_failure)):
            self.console.line(f"sftprof: [{n}/{total}] postprocessing {t.name} in the background while the next "
                              "trial (memory) trains")
            times = replace(times, postprocess_started_unix_s=time.time(), postprocess_background=True)
            write_trial_times(t.run_dir, times)
            job = self.processes.postprocess(t, background=True)
            threading.Thread(target=self._watch_background, args=(job,), daemon=True).start()
            self.background = Background(n, t, train_rc, elapsed, start, times, job)
            return 0
        pp_rc = self._postprocess(n, t, times)
        return self._finish(n, t, train_rc, pp_rc, elapsed, start, run_start, n)

    def _join(self, run_start: float, current: int) -> None:
        """Wait for the trial postprocessed in the background, if any, and record it (:meth:`_finish`);
        ``current``: the trial that trained meanwhile (or the last started)."""
        bg, self.background = self.background, None
        if bg is None:
            return
        pp_rc = bg.job.wait()
        wall, mono = bg.job.ended or (time.time(), time.monotonic())
        write_trial_times(bg.trial.run_dir, replace(bg.times, postprocess_ended_unix_s=wall))
        if self.stop.signum is None and pp_rc in STOPPED_STATUSES:  # a signal the launcher did not get
            self._child_stopped("postprocessing", pp_rc - 128)
        self._finish(bg.n, bg.trial, bg.train_rc, pp_rc, bg.elapsed, bg.start, run_start, current, mono)

    def _finish(self, n: int, t: Trial, train_rc: int, pp_rc: int | str, elapsed: int, start: float,
                run_start: float, current: int, ended: float | None = None) -> int | None:
        """Record trial ``n`` once trained and postprocessed: its row, its ``done`` line, a failure; its status, or
        None when a signal stopped the run. ``current``: the last trial started (``n``, or the one that trained
        while ``n`` was postprocessed in the background); those after it will not run when the run stops.
        ``start``, ``ended``: the trial's start and end (``time.monotonic``; ``ended`` None: now)."""
        total, left = len(self.trials), len(self.trials) - current
        # the signal came after training: while postprocessing or reading the status ("-": not postprocessed)
        if self.stop.signum is not None or not isinstance(pp_rc, int):
            # postprocessing that ended with 0 was not interrupted (the signal reached the launcher alone)
            status = train_rc if pp_rc == 0 else INTERRUPTED
            append_row(self.run_root, t, status, train_rc, pp_rc, elapsed)
            say(f"[{n}/{total}] trial {t.name} " + (
                f"interrupted after training (train status {train_rc}, postprocess status {pp_rc})"
                if status == INTERRUPTED else f"postprocessed (status {status}) before the signal stopped the run")
                + f"; {left} trial(s) will not run")
            return None
        status = train_rc or pp_rc
        append_row(self.run_root, t, status, train_rc, pp_rc, elapsed)
        stopping = self.stopping or (status != 0 and bool(self.plan.stop_on_failure))
        done_s = int(time.monotonic() - run_start)
        took = f"sftprof: [{n}/{total}] done in {int((ended or time.monotonic()) - start)} s (status {status}); "
        if current != n:
            self.console.line(took + f"postprocessed while trial {current} trained"
                              + (f"; {left} trial(s) will not run" if stopping else ""))
        else:
            self.console.line(took + (f"all trials took {done_s} s" if left == 0 else
                                      f"{left} trial(s) will not run" if stopping else
                                      f"about {done_s * left // n} s more for {left} trial(s)"))
        if status != 0:
            say(f"trial {t.name} FAILED (status {status}; logs in {t.run_dir / artifacts.LAUNCHER_LOG} and "
                f"{t.log_dir})")
            if stopping:
                say("STOP_ON_FAILURE=1: stopping after the first failure" + (
                    "" if current == n else f" (trial {self.trials[current - 1].name}, which trained while it was "
                                            "postprocessed, is finished first)"))
        return self._done(n, t, status)

    def _done(self, n: int, t: Trial, status: int) -> int:
        """Trial ``n``'s status taken: the run's exit status, a stop with ``STOP_ON_FAILURE=1``, the comparison of a
        what-if trial with its source trial."""
        if status != 0:
            self.final_rc = status
            self.stopping = self.stopping or bool(self.plan.stop_on_failure)
        elif t.name in self.tries:
            self._compare(n, self.tries[t.name], t)
        return status

    def _train_status(self, t: Trial, torchrun_rc: int) -> int:
        """Trial ``t``'s train status once its torchrun ended with ``torchrun_rc``. Node 0: the trainer's completion
        record (written by global rank 0), torchrun's status and every other node's end record; other nodes:
        torchrun's status (node 0 postprocesses every rank from the shared FILEROOT)."""
        plan = self.plan
        if plan.node_rank != 0:
            return torchrun_rc
        train_rc = torchrun_rc or trial_status(t.log_dir)
        if plan.nnodes > 1:  # every other node's end record, each failure named
            problems = wait_for_nodes(t.log_dir, plan.nnodes, plan.node_timeout)
            with open(t.run_dir / artifacts.LAUNCHER_LOG, "a", encoding="utf-8") as log:
                for line in problems:
                    log.write(f"sftprof: {line}\n")
                    self.console.line(f"sftprof: {line}")
            train_rc = train_rc or (1 if problems else 0)
        return train_rc

    def _postprocess(self, n: int, t: Trial, times: TrialTimes) -> int | str:
        """Postprocess trial ``n`` in the foreground (node 0; other nodes: 0, nothing to do; ``-`` when a signal came
        first), its clock recorded in ``trial_times.json``; its status."""
        if self.plan.node_rank != 0:
            return 0
        if self.stop.signum is not None:  # a signal while the trial's status was read: not postprocessed
            self.processes.drop_postprocess()
            return "-"
        self.console.line(f"sftprof: [{n}/{len(self.trials)}] postprocessing {t.name}")
        times = replace(times, postprocess_started_unix_s=time.time())
        write_trial_times(t.run_dir, times)
        pp_rc = self.processes.postprocess(t).wait()
        write_trial_times(t.run_dir, replace(times, postprocess_ended_unix_s=time.time()))
        if self.stop.signum is None and pp_rc in STOPPED_STATUSES:  # a signal the launcher did not get
            self._child_stopped("postprocessing", pp_rc - 128)
        return pp_rc

    def _config_changed(self, t: Trial) -> str | None:
        """Why trial ``t`` would not run the plan's config (:func:`config_changed`), else None. The first time the
        CONFIG file the plan copied differs from the copy, a line says that the trials run the copy."""
        changed = config_changed(t, self.plan.config)
        if changed is None and not self._source_edited:
            self._source_edited = source_edited(self.plan.config)
            if self._source_edited:
                say(f"CONFIG file {self.plan.config.source} changed (or went) since the plan: the trials run the "
                    f"plan's copy, {self.plan.config.copy}")
        return changed
