"""Writes are atomic (issue 35): a summary, report, plot or view that cannot be written for want of space is that
file's error (exit 1, a message naming the file and the free space; any other failed write names no free space) and
what was there before stays in place.

Two ways to fail a write: a patched ``os.fsync`` raising ENOSPC (where a full disk shows on file systems that
allocate late), and a real one: the kernel's file-size limit (``RLIMIT_FSIZE``) on the postprocess process, whose
writes past it fail with EFBIG, as they fail with ENOSPC on a full disk, without mounting a small file system.
"""
import errno
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import make_cpu_trace
from sftprof import atomic
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.trace.io import TraceWriter

REPO = Path(__file__).resolve().parents[1]
FREE = r"\d+\.\d (?:GiB|MiB|KiB) free in %s"  # the free space of a folder, which other processes change meanwhile


def _log_dir(root: Path, trace: Path) -> Path:
    log = root / "log"
    (log / "perf_tracer").mkdir(parents=True)
    shutil.copy(trace, log / "perf_tracer" / "rank0.pt.trace.json")
    recs = [{"type": "step", "step": s, "step_time_s": 1.0 + s, "profiled": s == 1} for s in range(2)]
    recs.append({"type": "complete", "status": "ok", "error": None, "steps_done": 2, "world_size": 1,
                 "backend": "fsdp", "device": "cpu", "profile_kind": "kernel", "profile_step": 1})
    (log / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return log


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    return make_cpu_trace(tmp_path_factory.mktemp("trace") / "r0.json", profiler_step=True, step=1)


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_full_disk_while_writing_the_summary_keeps_the_earlier_one(tmp_path, cpu_trace, monkeypatch):
    log, run = _log_dir(tmp_path, cpu_trace), tmp_path / "run"
    assert postprocess_trial(str(log), str(run), jobs=1)[1] == 0
    before = _files(run)
    (log / "stats.jsonl").write_text((log / "stats.jsonl").read_text().replace('"step_time_s": 2.0', '"step_time_s": 3.0'))

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(atomic.WriteError) as err:
        postprocess_trial(str(log), str(run), jobs=1)
    assert re.fullmatch(rf"cannot write {run / 'profile_summary.json'}: No space left on device \({FREE % run}\); what "
                        "was there before is left as it was", err.value.strerror)
    assert err.value.errno == errno.ENOSPC
    after = _files(run)  # the earlier summary and Markdown as they were, no .prev<N>, no temporary file left
    assert {k: v for k, v in after.items() if not k.startswith("kernel_traces/")} == \
        {k: v for k, v in before.items() if not k.startswith("kernel_traces/")}
    assert not [n for n in os.listdir(run) if n.endswith(".tmp")]


def _limited(limit: int):
    def set_limit():  # the child's writes past `limit` bytes fail with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


def _cli(limit: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "postprocess_profile.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, preexec_fn=_limited(limit))


def test_a_real_failed_write_of_a_view_and_of_the_summary(tmp_path, cpu_trace):
    log, run = _log_dir(tmp_path, cpu_trace), tmp_path / "run"
    assert postprocess_trial(str(log), str(run), jobs=1)[1] == 0
    before = _files(run)
    views = {k: v for k, v in before.items() if k.startswith("kernel_traces/")}
    summary_bytes = len(before["profile_summary.json"])
    # a limit under the largest view's size but over the summary's: the views fail (that trace's error), the
    # summary is written and names the view and the free space, the earlier views stay
    limit = summary_bytes * 2
    assert max(map(len, views.values())) > limit
    res = _cli(limit, "--log-dir", log, "--run-dir", run)
    assert res.returncode == 1, res.stderr
    s = json.loads((run / "profile_summary.json").read_text())
    (error,) = s["errors"]
    assert error["error"].startswith(f"{log / 'perf_tracer' / 'rank0.pt.trace.json'}: WriteError: [Errno 27] cannot write ")
    assert "File too large (" in error["error"] and " free in " in error["error"]
    assert {k: v for k, v in _files(run).items() if k.startswith("kernel_traces/")} == views
    assert s["warnings"][0]["warning"] == ("rank 0: 5 view file(s) of an earlier postprocess are kept in kernel_traces/ "
                                           "(not from this trace, which failed)")
    # a limit under the summary's size: exit 1, the message names the file and the free space; the summary and
    # Markdown written above stay as they are
    kept = _files(run)
    res = _cli(1024, "--log-dir", log, "--run-dir", run)
    assert res.returncode == 1
    assert re.fullmatch(rf"\[postprocess\] ERROR cannot write {run / 'profile_summary.json'}: File too large "
                        rf"\({FREE % run}\); what was there before is left as it was; no summary written",
                        res.stderr.splitlines()[-1])
    assert _files(run) == kept and not [n for n in os.listdir(run) if n.startswith(".")]


def test_a_report_that_cannot_be_written_keeps_the_earlier_one(tmp_path, cpu_trace):
    log, run = _log_dir(tmp_path, cpu_trace), tmp_path / "run"
    assert postprocess_trial(str(log), str(run), jobs=1)[1] == 0
    run_b = tmp_path / "run_b"  # a second run (a run is not compared with itself)
    shutil.copytree(run, run_b, symlinks=True)
    out = run_b / "compare_vs_run.md"
    out.write_text("an earlier report\n")
    res = subprocess.run([sys.executable, str(REPO / "postprocess_profile.py"), "compare", str(run), str(run_b)],
                         cwd=REPO, capture_output=True, text=True, preexec_fn=_limited(256))
    assert res.returncode == 1
    assert re.fullmatch(rf"\[postprocess\] ERROR cannot write {out}: File too large \({FREE % run_b}\); what was "
                        "there before is left as it was", res.stderr.splitlines()[-1])
    assert out.read_text() == "an earlier report\n" and not list(run_b.glob("compare_vs_run.prev*"))


def test_an_error_in_the_writing_thread_reaches_the_caller_and_nothing_hangs(tmp_path, monkeypatch):
    """TraceWriter writes from a thread of its own: an error there is raised by the caller's next call (an OSError as
    the file's WriteError, anything else as itself), and the thread keeps draining, so no call blocks."""
    from sftprof.analysis.trace import io as trace_io

    class Broken:
        def __init__(self, exc):
            self.exc, self.closed = exc, False

        def write(self, text):
            raise self.exc

        def close(self):
            self.closed = True

    for exc, expected in ((OSError(errno.ENOSPC, "No space left on device"), atomic.WriteError),
                          (ValueError("surrogates not allowed"), ValueError)):
        f = Broken(exc)
        monkeypatch.setattr(trace_io, "open", lambda *a, **k: f, raising=False)
        w = TraceWriter(tmp_path / "t.json", {})
        with pytest.raises(expected):
            for _ in range(10 * TraceWriter.QUEUED):  # more texts than the queue holds: must not block
                w.write("{}")
                w.flush()
        w.abort()
        assert f.closed


def test_the_free_space_is_named_only_when_a_write_wants_space(tmp_path, monkeypatch):
    """A failed write for want of space (full disk, quota, file-size limit) names its folder's free space; any other
    failure only its reason (was: ``Permission denied (0 bytes free in /sys)``)."""
    monkeypatch.setattr(atomic, "free_space", lambda folder: f"12.0 KiB free in {folder}")
    path = str(tmp_path / "x.md")
    after = "; what was there before is left as it was"
    assert atomic.SPACE_ERRNOS == (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        err = atomic.write_failed(path, OSError(code, os.strerror(code)))
        assert (err.errno, err.strerror, err.filename) == (
            code, f"cannot write {path}: {os.strerror(code)} (12.0 KiB free in {tmp_path}){after}", path)
    for code in (errno.EACCES, errno.EROFS, errno.EISDIR):
        err = atomic.write_failed(path, OSError(code, os.strerror(code)))
        assert (err.errno, err.strerror) == (code, f"cannot write {path}: {os.strerror(code)}{after}")
    (tmp_path / "file").write_text("")
    with pytest.raises(atomic.WriteError) as err:  # a real one: a file in the place of the folder
        atomic.write_text(tmp_path / "file" / "x.md", "text")
    target = tmp_path / "file" / "x.md"
    assert str(err.value) == f"[Errno 20] cannot write {target}: Not a directory{after}: '{target}'"
