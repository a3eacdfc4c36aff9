"""Running the planned trials: per trial one torchrun (its output teed into ``RUN_DIR/launcher.log``), its status,
the workers it left running, its postprocessing (node 0) and its row of ``RUN_ROOT/summary.tsv``; then a ``not run``
row for each trial that did not run, and the end table.

torchrun starts in its own process group, so a terminal's Ctrl-C reaches the launcher alone, which stops the run
(:mod:`sftprof.launch.signals`): torchrun gets SIGTERM and stops its workers, the trial is recorded as
``interrupted``, the trials after it as ``not run``, the exit status is 128 + the signal; from the signal on, the
children's output goes to ``launcher.log`` only (no tracebacks on the console). A torchrun signalled by someone
else stops the run the same way (its ``SignalException`` in its output); a torchrun killed outright (SIGKILL) leaves
its workers running (torchrun starts each in its own session): the launcher finds them by a marker in their
environment, stops them (SIGTERM, then SIGKILL), and the trial fails with torchrun's status 128 + the signal, named
in the node end record that the summary reads (:mod:`sftprof.launch.nodes`).

The trial's kind and step go to postprocessing from the same :class:`~sftprof.launch.plan_types.Trial` that gave the
trainer its config (no file read back). With ``TRY_WHAT_IFS=N`` the what-if trials (:mod:`sftprof.launch.what_ifs`)
follow the planned ones, each compared with the trial it varies.
"""
from __future__ import annotations

import csv
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from sftprof import artifacts
from sftprof.analysis.trial.inputs import read_tried_what_if
from sftprof.artifacts import TRIAL_MARKER, read_stats
from sftprof.launch.nodes import wait_for_nodes, write_node_record
from sftprof.launch.plan_types import Trial
from sftprof.launch.report import CONFIG_CHANGED, INTERRUPTED, NO_WHAT_IF, NOT_RUN, report
from sftprof.launch.signals import RunStop, ignore_signals, kill_group, name, say
from sftprof.launch.variables import REPO_ROOT, DriverError
from sftprof.launch.watchdog import POLL_S, Watchdog, stall_message, write_stall
from sftprof.launch.what_ifs import choose, settings_of, what_if_trial, write_what_if_plan

WORKER_STOP_S = 30.0  # seconds the workers torchrun left get after SIGTERM before SIGKILL (torchrun's own wait)
_TORCHRUN_SIGNAL = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
SUMMARY_HEADER = ("trial", "kind", "step", "status", "train_status", "postprocess_status", "elapsed_s", "run_dir",
                  "log_dir", "what_if")


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + the signal for a child killed by one (Popen's ``-N``)."""
    return 128 - returncode if returncode < 0 else returncode


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


def marked_processes(marker: str) -> dict[int, int | None]:
    """The live processes of this user whose environment holds ``SFTPROF_TRIAL_ID=<marker>``: ``{pid: RANK}`` (RANK
    None where the process has none). Linux ``/proc``; elsewhere none are found."""
    entry = f"{TRIAL_MARKER}={marker}".encode()
    found: dict[int, int | None] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or another user's
            continue
        if entry in env and state != "Z" and pid != os.getpid():
            rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
            found[pid] = int(rank) if rank and rank.isdigit() else None
    return found


def stop_marked(marker: str, timeout_s: float = WORKER_STOP_S) -> list[int]:
    """Stop the processes :func:`marked_processes` finds (SIGTERM; SIGKILL after ``timeout_s`` seconds); returns the
    ranks they ran (sorted, each once; none when nothing was left)."""
    left = marked_processes(marker)
    for pid in left:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in marked_processes(marker):
        _signal(pid, signal.SIGKILL)
    return sorted({r for r in left.values() if r is not None})


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Console:
    """The launcher's standard output, shared by its own lines and the children's output (one lock, whole lines),
    and muted for the children once a signal stops the run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.muted = False

    def line(self, text: str) -> None:
        """One line of the launcher's own."""
        self.write((text + "\n").encode(), child=False)

    def write(self, data: bytes, child: bool = True) -> None:
        if child and self.muted:
            return
        with self.lock:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()


def _tee(proc: subprocess.Popen, log: Path, mode: str, console: Console) -> threading.Thread:
    """A thread copying ``proc``'s output, line by line, into ``log`` (opened with ``mode``) and to ``console``."""
    def pump() -> None:
        with open(log, mode) as f:
            for line in iter(proc.stdout.readline, b""):
                f.write(line)
                f.flush()
                console.write(line)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


class TrialRunner:
    """Runs the trials of a written plan and returns the run's exit status: 0, the last failing trial's status, or
    128 + the signal that stopped the run. Made before the plan, so that its signal handlers (:attr:`stop`) can take
    over the moment the plan is written."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.trials: list[Trial] = []
        self.info: dict = {}
        self.run_root = Path()
        self.python = python
        self.env = {**env, "PYTHONUNBUFFERED": "1"}  # progress lines as they happen, not at exit
        self.env.setdefault("OMP_NUM_THREADS", "1")   # torchrun's own default, stated so that it does not warn
        # Triton autotuning results kept on disk (TRITON_CACHE_DIR, default ~/.triton/cache): each trial after the
        # first reuses them instead of re-timing every config at step 0 (fla's kernels, sftprof/ops' row kernels).
        self.env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        self.console = Console()
        self.stop = RunStop(on_first=self._first_signal, on_again=self._signal_again)
        self.torchrun: subprocess.Popen | None = None
        self.marker: str | None = None
        self._source_edited = False  # the CONFIG file differs from the plan's copy (said once)

    # -- signals (run in the main thread, between two bytecodes of whatever it does) --
    def _first_signal(self, signum: int) -> None:
        self.console.muted = True
        say(f"{name(signum)} received: stopping the run")
        if self.torchrun is not None and self.torchrun.poll() is None:
            kill_group(self.torchrun.pid, signal.SIGTERM)

    def _signal_again(self, signum: int) -> None:
        say(f"{name(signum)} received again: killing torchrun and its workers (SIGKILL)")
        if self.torchrun is not None and self.torchrun.poll() is None:
            kill_group(self.torchrun.pid, signal.SIGKILL)
        if self.marker:
            for pid in marked_processes(self.marker):
                _signal(pid, signal.SIGKILL)

    def _child_stopped(self, child: str, signum: int) -> None:
        """A child got SIGINT or SIGTERM that the launcher did not (a ``kill`` of it): the run stops as after the
        launcher's own signal."""
        self.stop.stopped(signum, by_driver=False)
        self.console.muted = True
        say(f"{child} got signal {signum} (not the driver): stopping the run")

    def run(self, trials: list[Trial], info: dict) -> int:
        """Run every trial of the plan (``info``: its settings, :func:`sftprof.launch.planning.plan`), or until a
        signal or, with ``STOP_ON_FAILURE=1``, a failure; with ``TRY_WHAT_IFS``, then the what-if trials of the
        planned trials' summaries, each compared with its source trial (:meth:`_plan_what_ifs`, :meth:`_compare`);
        then the not-run rows and the end table; returns the exit status (a failed what-if trial counts as a failed
        trial)."""
        self.trials, self.info, self.run_root = trials, info, Path(info["run_root"])
        with open(self.run_root / artifacts.SUMMARY_TSV, "x", encoding="utf-8") as f:
            f.write("\t".join(SUMMARY_HEADER) + "\n")
        self.console.line(f"sftprof: run root {self.run_root} (settings in {artifacts.PROFILE_SETTINGS})")
        final_rc, run_start = 0, time.monotonic()
        planned, tries = list(self.trials), {}
        n = 0
        while n < len(self.trials):
            if self.stop.signum is not None:  # a signal between two trials: the next one does not start
                break
            trial = self.trials[n]
            n += 1
            status = self._trial(n, trial, run_start)
            if status is None:  # stopped by a signal
                break
            if status != 0:
                final_rc = status
                if self.info["stop_on_failure"]:
                    break
            elif trial.name in tries:
                self._compare(n, tries[trial.name], trial)
            if n == len(planned) and self.info.get("what_ifs"):  # the planned trials ran: their what-ifs follow
                tries = self._plan_what_ifs(planned)
        ignore_signals()
        record_trials_not_run(self.run_root)
        self.console.line("")
        self.console.line(report(self.run_root, self.info["node_rank"], self.python,
                                 self.info.get("warnings")).rstrip("\n"))
        return self.stop.status if self.stop.signum is not None else final_rc

    def _plan_what_ifs(self, planned: list[Trial]) -> dict[str, Trial]:
        """Choose the what-ifs to try (``TRY_WHAT_IFS``, :mod:`sftprof.launch.what_ifs`), write their folders and
        append them to the trials to run; returns ``{what-if trial name: its source trial}``."""
        chosen, lines = choose(planned, self.info["what_ifs"])
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
        cmd = [self.python, str(REPO_ROOT / "postprocess_profile.py"), "compare", str(source.run_dir),
               str(trial.run_dir)]
        with open(trial.run_dir / artifacts.LAUNCHER_LOG, "ab") as log:
            rc = subprocess.run(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL).returncode
        self.console.line(f"sftprof: [{n}/{len(self.trials)}] compared with {source.name}: {out}" if rc == 0 else
                          f"sftprof: [{n}/{len(self.trials)}] compare with {source.name} failed (status "
                          f"{exit_status(rc)}; see {trial.run_dir / artifacts.LAUNCHER_LOG})")

    def _row(self, t: Trial, status, train_rc, pp_rc, elapsed: int) -> None:
        with open(self.run_root / artifacts.SUMMARY_TSV, "a", encoding="utf-8") as f:
            f.write("\t".join(str(x) for x in (t.name, t.kind, t.step, status, train_rc, pp_rc, elapsed, t.run_dir,
                                                t.log_dir, t.what_if or NO_WHAT_IF)) + "\n")

    def _trial(self, n: int, t: Trial, run_start: float) -> int | None:
        """Run trial ``n`` (1-based): its status, or None when a signal stopped the run during it."""
        total, info = len(self.trials), self.info
        self.console.line(f"sftprof: [{n}/{total}] trial {t.name} (kind={t.kind} step={t.step}"
                          + (f", what-if {t.what_if}" if t.what_if else "") + f") started {time.strftime('%H:%M:%S')}")
        start = time.monotonic()
        changed = self._config_changed(t)
        if changed:
            with open(t.run_dir / artifacts.LAUNCHER_LOG, "a", encoding="utf-8") as log:
                log.write(f"sftprof: {changed}\n")
            self._row(t, CONFIG_CHANGED, "-", "-", 0)
            say(f"[{n}/{total}] trial {t.name} not run: {changed}")
            return 2
        torchrun_rc = self._torchrun(t)
        elapsed = int(time.monotonic() - start)
        if self.stop.signum is not None:
            with open(t.run_dir / artifacts.LAUNCHER_LOG, "a", encoding="utf-8") as log:  # postprocessing reads it
                log.write(artifacts.INTERRUPTED_LINE.format(signal=signal.Signals(self.stop.signum).name) + "\n")
            self._row(t, INTERRUPTED, torchrun_rc, "-", elapsed)
            say(f"[{n}/{total}] trial {t.name} interrupted after {elapsed} s (torchrun status {torchrun_rc}); "
                f"{total - n} trial(s) will not run")
            return None
        if info["node_rank"] == 0:
            # success is the trainer's completion record (written by global rank 0) and torchrun's status
            train_rc = torchrun_rc or trial_status(t.log_dir)
            if info["nnodes"] > 1:  # every other node's end record, each failure named
                problems = wait_for_nodes(t.log_dir, info["nnodes"], info["node_timeout"])
                with open(t.run_dir / artifacts.LAUNCHER_LOG, "a", encoding="utf-8") as log:
                    for line in problems:
                        log.write(f"sftprof: {line}\n")
                        self.console.line(f"sftprof: {line}")
                train_rc = train_rc or (1 if problems else 0)
            pp_rc: int | str = "-"
            if self.stop.signum is None:  # a signal while the trial's status was read: not postprocessed
                self.console.line(f"sftprof: [{n}/{total}] postprocessing {t.name}")
                pp_rc = self._postprocess(t)
                if self.stop.signum is None and pp_rc in (130, 143):  # a signal the launcher did not get
                    self._child_stopped("postprocessing", pp_rc - 128)
        else:  # other nodes: torchrun's status; node 0 postprocesses every rank from the shared FILEROOT
            train_rc, pp_rc = torchrun_rc, 0
        if self.stop.signum is not None:  # the signal came after training: while postprocessing or reading the status
            # postprocessing that ended with 0 was not interrupted (the signal reached the launcher alone)
            status = train_rc if pp_rc == 0 else INTERRUPTED
            self._row(t, status, train_rc, pp_rc, elapsed)
            say(f"[{n}/{total}] trial {t.name} " + (
                f"interrupted after training (train status {train_rc}, postprocess status {pp_rc})"
                if status == INTERRUPTED else f"postprocessed (status {status}) before the signal stopped the run")
                + f"; {total - n} trial(s) will not run")
            return None
        status = train_rc or pp_rc
        self._row(t, status, train_rc, pp_rc, elapsed)
        done_s, left = int(time.monotonic() - run_start), total - n
        stopping = status != 0 and info["stop_on_failure"]
        took = f"sftprof: [{n}/{total}] done in {int(time.monotonic() - start)} s (status {status}); "
        self.console.line(took + (f"all trials took {done_s} s" if left == 0 else
                                  f"{left} trial(s) will not run" if stopping else
                                  f"about {done_s * left // n} s more for {left} trial(s)"))
        if status != 0:
            say(f"trial {t.name} FAILED (status {status}; logs in {t.run_dir / artifacts.LAUNCHER_LOG} and "
                f"{t.log_dir})")
            if stopping:
                say("STOP_ON_FAILURE=1: stopping after the first failure")
        return status

    def _config_changed(self, t: Trial) -> str | None:
        """Why trial ``t`` would not run the plan's config (its ``--config`` file is not the plan's copy, or the copy's
        text changed since the plan: :class:`sftprof.launch.plan_types.PlanConfig`), else None. The first time the
        CONFIG file the plan copied differs from the copy, a line says that the trials run the copy."""
        plan = self.info.get("config")
        if plan is None:
            return None
        path = t.args[1] if t.args[:1] == ["--config"] and len(t.args) > 1 else None
        if path != plan.copy:
            return f"its --config {path} is not the plan's copy {plan.copy}"
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError as exc:
            return f"the plan's config {path} cannot be read ({exc.strerror})"
        if digest != plan.sha256:
            return (f"the plan's config {path} changed since the plan (sha256 {digest}, planned {plan.sha256}): the "
                    "trial would not run the plan")
        if not self._source_edited:
            try:
                with open(plan.source, "rb") as f:
                    self._source_edited = f.read() != plan.text
            except OSError:
                self._source_edited = True
            if self._source_edited:
                say(f"CONFIG file {plan.source} changed (or went) since the plan: the trials run the plan's copy, "
                    f"{plan.copy}")
        return None

    def _torchrun(self, t: Trial) -> int:
        """Run the trial's torchrun, teed into ``launcher.log``; stop the workers it left; write the node end record
        (several nodes, or a torchrun killed by a signal). Returns torchrun's status (128 + N: killed by signal N)."""
        info = self.info
        smi = None
        if shutil.which("nvidia-smi"):
            with open(t.run_dir / artifacts.NVIDIA_SMI_CSV, "w") as csv_file:
                smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,index,utilization.gpu,memory.used,"
                                        "memory.total", "--format=csv,nounits", "-lms", "500"], stdout=csv_file,
                                       stderr=subprocess.DEVNULL)
        self.marker = uuid.uuid4().hex
        # --rdzv-conf timeout: how long a node waits for the others to join (static rendezvous).
        cmd = [self.python, "-m", "torch.distributed.run", f"--nproc_per_node={info['nproc_per_node']}",
               f"--nnodes={info['nnodes']}", f"--node_rank={info['node_rank']}", f"--master_addr={info['master_addr']}",
               f"--master_port={info['master_port']}", "--rdzv-conf", f"timeout={info['node_timeout']}",
               str(REPO_ROOT / "train_sft_profile.py"), *t.args]
        start = time.monotonic()
        self.torchrun = subprocess.Popen(cmd, env={**self.env, **t.env, TRIAL_MARKER: self.marker},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        if self.stop.signum is not None:  # a signal before self.torchrun was set: its handler could not pass it on
            kill_group(self.torchrun.pid, signal.SIGTERM)
        pump = _tee(self.torchrun, t.run_dir / artifacts.LAUNCHER_LOG, "wb", self.console)
        stall = self._watch(t)
        returncode = self.torchrun.wait()
        ranks = stop_marked(self.marker)  # before the tee ends: workers left running hold torchrun's output pipe open
        pump.join()
        rc = exit_status(returncode)
        launcher_log = t.run_dir / artifacts.LAUNCHER_LOG
        if stall is not None:
            with open(launcher_log, "a", encoding="utf-8") as log:
                log.write(f"sftprof: {stall}\n")
        elif self.stop.signum is None and rc != 0:  # torchrun signalled, not the launcher (a kill of torchrun)
            got = _TORCHRUN_SIGNAL.findall(launcher_log.read_text(errors="replace"))
            if got:
                self._child_stopped("torchrun", int(got[-1]))
        killed = name(-returncode) if returncode < 0 else None
        if killed or ranks:
            line = ("sftprof: torchrun " + (f"was killed by {killed} (status {rc})" if killed else f"exited ({rc})")
                    + (f" and left the workers of rank(s) {','.join(map(str, ranks))} running: the launcher stopped "
                       "them" if ranks else ""))
            with open(launcher_log, "a", encoding="utf-8") as log:
                log.write(line + "\n")
            if not self.console.muted:
                self.console.line(line)
        if smi is not None:
            smi.terminate()
            smi.wait()
        if info["nnodes"] > 1 or killed:
            write_node_record(t.log_dir, info["node_rank"], rc, int(time.monotonic() - start), info["nnodes"],
                              info["nproc_per_node"], killed, ranks or None)
        self.torchrun = None
        return rc

    def _watch(self, t: Trial) -> str | None:
        """Wait for torchrun with the watchdog (``STALL_TIMEOUT``, :mod:`sftprof.launch.watchdog`) on this node's
        ranks: when one stalls, write ``stall.json``, say which rank in what phase and step, and end the trial
        (SIGTERM to torchrun's process group); returns that line, or None when torchrun ended by itself."""
        limit = self.info.get("stall_timeout") or 0
        if not limit:
            return None
        dog = Watchdog(t.log_dir, artifacts.node_ranks(self.info["node_rank"], self.info["nproc_per_node"]), limit)
        while True:
            try:
                self.torchrun.wait(timeout=POLL_S)
                return None
            except subprocess.TimeoutExpired:
                stall = dog.check() if self.stop.signum is None else None
            if stall is not None:
                write_stall(t.log_dir, stall)
                line = stall_message(stall)
                say(line)
                kill_group(self.torchrun.pid, signal.SIGTERM)
                return line

    def _postprocess(self, t: Trial) -> int:
        """``postprocess_profile.py`` on the trial (its output teed, appended to ``launcher.log``); its status."""
        cmd = [self.python, str(REPO_ROOT / "postprocess_profile.py"), "--log-dir", str(t.log_dir), "--run-dir",
               str(t.run_dir), "--profile-kind", t.kind, "--profile-step", str(t.step), "--trainer-log",
               str(t.log_dir / artifacts.TRAINER_LOG)]
        smi = t.run_dir / artifacts.NVIDIA_SMI_CSV
        if smi.is_file() and smi.stat().st_size:
            cmd += ["--nvidia-smi-csv", str(smi)]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        pump = _tee(proc, t.run_dir / artifacts.LAUNCHER_LOG, "ab", self.console)
        returncode = proc.wait()
        pump.join()
        return exit_status(returncode)
