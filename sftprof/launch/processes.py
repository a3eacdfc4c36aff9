"""The child processes of the trial that runs now, and the console they share with the launcher: torchrun (teed
into ``RUN_DIR/launcher.log``, watched by the watchdog, the workers it leaves stopped, the node end record written),
postprocessing (of this trial, or of the one before it in the background: :class:`Postprocessing`) and the
comparison of a what-if trial.

A trial's ``postprocess_profile.py --after-trial FD`` starts when the trial is launched
(:meth:`TrialProcesses.start_postprocess`) and does its imports while the trial trains (torch, transformers: the
model config's first load took 12.1-12.6 s in a fresh process on one H100 host); it then waits for one line on FD, a
socket of the launcher's passed on to it (not its standard input, which a ``PYTHON`` wrapper may close), written
when the trial has ended (:meth:`TrialProcesses.postprocess`), or for the end of input, which it takes as "not
postprocessed" (the launcher's exit). A socket, not a pipe: a line for a process that has ended is an error, not a
SIGPIPE, which would stop the run (:mod:`sftprof.launch.signals`). A waiting process that has ended before the go
(a wrapper that closed FD, an import that failed) is replaced by a plain ``postprocess_profile.py``, as the driver
ran it before, unless a signal ended it (then the run stops, as for a signal to any child of the run).

torchrun starts in its own session, so a terminal's Ctrl-C reaches the launcher alone, which hands it on
(:meth:`TrialProcesses.terminate`, :meth:`TrialProcesses.kill`); a torchrun killed outright (SIGKILL) leaves its
workers running (torchrun starts each in its own session): they are found by a marker in their environment and
stopped (SIGTERM, then SIGKILL).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from sftprof import artifacts
from sftprof.artifacts import TRIAL_MARKER
from sftprof.cli import to_devnull
from sftprof.launch.nodes import write_node_record
from sftprof.launch.plan_types import RunPlan, Trial
from sftprof.launch.signals import RunStop, kill_group, name, say
from sftprof.launch.variables import REPO_ROOT
from sftprof.launch.watchdog import POLL_S, Watchdog, stall_message, write_stall

WORKER_STOP_S = 30.0  # seconds the workers torchrun left get after SIGTERM before SIGKILL (torchrun's own wait)
_TORCHRUN_SIGNAL = re.compile(r"SignalException: Process \d+ got signal: (\d+)")


STOPPED_STATUSES = (130, 143)  # 128 + SIGINT, SIGTERM: a child stopped by a signal (one the launcher may not have got)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + the signal for a child killed by one (Popen's ``-N``)."""
    return 128 - returncode if returncode < 0 else returncode



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


def remove_empty_folders(root: Path) -> None:
    """Remove ``root`` and the folders under it that hold no file (deepest first): torchrun's ``--log-dir`` of a
    trial, whose per-rank folders stay empty unless a worker wrote its error file; a file, and the folders above
    it, are kept."""
    for folder, _, _ in os.walk(root, topdown=False):
        try:
            os.rmdir(folder)
        except OSError:  # not empty (a file, or a folder kept), or gone
            pass


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
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except OSError:  # the reader went away or the terminal hung up: SIGPIPE/SIGHUP stop the run (signals.py)
                self.muted = True
                to_devnull(sys.stdout)


def _tee(proc: subprocess.Popen[bytes], log: Path, mode: str, sink: Callable[[bytes], None]) -> threading.Thread:
    """A thread copying ``proc``'s output, line by line, into ``log`` (opened with ``mode``) and to ``sink`` (the
    console's ``write``, or a list's ``append``)."""
    out = proc.stdout
    assert out is not None  # Popen(stdout=PIPE)

    def pump() -> None:
        with open(log, mode) as f:
            for line in iter(out.readline, b""):
                f.write(line)
                f.flush()
                sink(line)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


class Postprocessing:
    """One trial's running ``postprocess_profile.py`` (:meth:`TrialProcesses.postprocess`). In the background its
    output goes to the trial's ``launcher.log`` as it comes and to the console, whole, when :meth:`wait` returns (so
    it does not interleave with the next trial's)."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, console: Console, background: bool) -> None:
        self.proc, self.console = proc, console
        self.held: list[bytes] | None = [] if background else None
        self.ended: tuple[float, float] | None = None  # (time.time, time.monotonic) when it ended, if watched
        self._pump = _tee(proc, log, "ab", console.write if self.held is None else self.held.append)

    def wait(self) -> int:
        """Wait for it to end (its output all copied); its status as a shell reports it (:func:`exit_status`)."""
        returncode = self.proc.wait()
        self._pump.join()
        if self.held:
            self.console.write(b"".join(self.held))
            self.held = []
        return exit_status(returncode)



class TrialProcesses:
    """The child processes of one trial at a time (module docstring).

    ``stop``: the run's :class:`~sftprof.launch.signals.RunStop` (a signal arrived: its ``signum``);
    ``child_stopped(child, signum)``: called when torchrun got SIGINT or SIGTERM that the launcher did not.
    """

    def __init__(self, python: str, env: dict[str, str], console: Console, stop: RunStop,
                 child_stopped: Callable[[str, int], None]) -> None:
        self.python = python
        self.env = env
        self.console = console
        self.stop = stop
        self.child_stopped = child_stopped
        self.proc: subprocess.Popen[bytes] | None = None  # the running torchrun
        self.marker: str | None = None  # in the environment of its workers
        # the trial's postprocess_profile.py --after-trial FD and our end of its socket, waiting for the trial to end
        self.waiting: tuple[subprocess.Popen[bytes], socket.socket] | None = None

    def terminate(self) -> None:
        """SIGTERM to the running torchrun's process group: it stops its workers and exits. (Also called from the
        thread that watches a background postprocessing.)"""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            kill_group(proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the running torchrun's process group, to the workers of the last trial and to the
        postprocessing waiting for the trial to end."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            kill_group(proc.pid, signal.SIGKILL)
        waiting = self.waiting
        if waiting is not None:
            waiting[0].kill()  # nothing when it has been reaped (Popen knows)
        if self.marker:
            for pid in marked_processes(self.marker):
                _signal(pid, signal.SIGKILL)

    def torchrun(self, t: Trial, plan: RunPlan) -> int:
        """Run the trial's torchrun, teed into ``launcher.log``; stop the workers it left; write the node end record
        (several nodes, or a torchrun killed by a signal). Returns torchrun's status (128 + N: killed by signal N)."""
        smi = None
        if shutil.which("nvidia-smi"):
            with open(t.run_dir / artifacts.NVIDIA_SMI_CSV, "w") as csv_file:
                smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,index,utilization.gpu,memory.used,"
                                        "memory.total", "--format=csv,nounits", "-lms", "500"], stdout=csv_file,
                                       stderr=subprocess.DEVNULL)
        self.marker = uuid.uuid4().hex
        elastic = t.run_dir / artifacts.TORCHELASTIC
        # --rdzv-conf timeout: how long a node waits for the others to join (static rendezvous). --log-dir: torchrun's
        # folders (its workers' error files) in the trial's run dir, not a /tmp/torchelastic_* folder left behind.
        cmd = [self.python, "-m", "torch.distributed.run", f"--nproc_per_node={plan.nproc_per_node}",
               f"--nnodes={plan.nnodes}", f"--node_rank={plan.node_rank}", f"--master_addr={plan.master_addr}",
               f"--master_port={plan.master_port}", "--rdzv-conf", f"timeout={plan.node_timeout}",
               f"--log-dir={elastic}", str(REPO_ROOT / "train_sft_profile.py"), *t.args]
        start = time.monotonic()
        self.proc = subprocess.Popen(cmd, env={**self.env, **t.env, TRIAL_MARKER: self.marker},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        if self.stop.signum is not None:  # a signal before self.proc was set: its handler could not pass it on
            kill_group(self.proc.pid, signal.SIGTERM)
        pump = _tee(self.proc, t.run_dir / artifacts.LAUNCHER_LOG, "wb", self.console.write)
        stall = self._watch(t, plan)
        returncode = self.proc.wait()
        ranks = stop_marked(self.marker)  # before the tee ends: workers left running hold torchrun's output pipe open
        pump.join()
        remove_empty_folders(elastic)
        rc = exit_status(returncode)
        launcher_log = t.run_dir / artifacts.LAUNCHER_LOG
        if stall is not None:
            with open(launcher_log, "a", encoding="utf-8") as log:
                log.write(f"sftprof: {stall}\n")
        elif self.stop.signum is None and rc != 0:  # torchrun signalled, not the launcher (a kill of torchrun)
            got = _TORCHRUN_SIGNAL.findall(launcher_log.read_text(errors="replace"))
            if got:
                self.child_stopped("torchrun", int(got[-1]))
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
        if plan.nnodes > 1 or killed:
            write_node_record(t.log_dir, plan.node_rank, rc, int(time.monotonic() - start), plan.nnodes,
                              plan.nproc_per_node, killed, ranks or None)
        self.proc = None
        return rc

    def _watch(self, t: Trial, plan: RunPlan) -> str | None:
        """Wait for torchrun with the watchdog (``STALL_TIMEOUT``, :mod:`sftprof.launch.watchdog`) on this node's
        ranks: when one stalls, write ``stall.json``, say which rank in what phase and step, and end the trial
        (SIGTERM to torchrun's process group); returns that line, or None when torchrun ended by itself."""
        limit = plan.stall_timeout
        if not limit:
            return None
        dog = Watchdog(t.log_dir, artifacts.node_ranks(plan.node_rank, plan.nproc_per_node), limit)
        proc = self.proc
        assert proc is not None  # _watch runs while torchrun does
        while True:
            try:
                proc.wait(timeout=POLL_S)
                return None
            except subprocess.TimeoutExpired:
                stall = dog.check() if self.stop.signum is None else None
            if stall is not None:
                write_stall(t.log_dir, stall)
                line = stall_message(stall)
                say(line)
                kill_group(proc.pid, signal.SIGTERM)
                return line

    def _postprocess_command(self, t: Trial) -> list[str]:
        return [self.python, str(REPO_ROOT / "postprocess_profile.py"), "--log-dir", str(t.log_dir), "--run-dir",
                str(t.run_dir), "--profile-kind", t.kind, "--profile-step", str(t.step), "--trainer-log",
                str(t.log_dir / artifacts.TRAINER_LOG)]

    def start_postprocess(self, t: Trial) -> None:
        """Start ``postprocess_profile.py --after-trial FD`` on the trial as it is launched (module docstring): it
        imports while the trial trains, then waits for :meth:`postprocess` or :meth:`drop_postprocess`. It runs in
        the launcher's process group: a terminal's Ctrl-C reaches it too."""
        ours, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen(self._postprocess_command(t) + ["--after-trial", str(theirs.fileno())],
                                    env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        self.waiting = (proc, ours)

    def postprocess(self, t: Trial, background: bool = False) -> Postprocessing:
        """Let the trial's waiting postprocessing (:meth:`start_postprocess`) go on, with the nvidia-smi log when
        it holds anything (its output appended to ``launcher.log`` and teed to the console, or held for it until it
        ends when ``background``: :class:`Postprocessing`; what it printed while it waited comes first). One that
        ended before the go is replaced by a plain one (module docstring)."""
        assert self.waiting is not None  # started with the trial
        (proc, ours), self.waiting = self.waiting, None
        smi = t.run_dir / artifacts.NVIDIA_SMI_CSV
        more = ["--nvidia-smi-csv", str(smi)] if smi.is_file() and smi.stat().st_size else []
        with ours:
            if proc.poll() is None:
                try:
                    ours.sendall((json.dumps(more) + "\n").encode(), socket.MSG_NOSIGNAL)
                except OSError:  # it has ended meanwhile: its status says how
                    pass
            elif exit_status(proc.returncode) not in STOPPED_STATUSES:
                proc.communicate()  # its output (an import's error: the plain one meets it again) is dropped
                proc = subprocess.Popen(self._postprocess_command(t) + more, env=self.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return Postprocessing(proc, t.run_dir / artifacts.LAUNCHER_LOG, self.console, background)

    def drop_postprocess(self) -> None:
        """Stop the trial's waiting postprocessing, if any (its trial will not be postprocessed): it has written
        nothing; its output (none, or what its imports printed) is dropped."""
        if self.waiting is None:
            return
        proc, ours = self.waiting
        proc.kill()
        proc.communicate()
        ours.close()
        self.waiting = None

    def compare(self, source: Trial, trial: Trial) -> int:
        """``postprocess_profile.py compare`` of a what-if trial against its source trial: the report goes to the
        what-if trial's run dir, its output to its ``launcher.log`` only; its status."""
        cmd = [self.python, str(REPO_ROOT / "postprocess_profile.py"), "compare", str(source.run_dir),
               str(trial.run_dir)]
        with open(trial.run_dir / artifacts.LAUNCHER_LOG, "ab") as log:
            return subprocess.run(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL).returncode
