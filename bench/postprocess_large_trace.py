#!/usr/bin/env python3
"""Benchmark: postprocess (5 views + kernel summary) of a ~1 GiB single-rank trace.

Builds the large trace by scaling the real H200 reference trace (tests/fixtures): every
non-metadata event is repeated K times, copy k shifted by k x (trace span + 1 ms) in time
and by k x offset in correlation / External id / flow ids, so CPU->GPU links stay valid. Then
runs ``postprocess_profile.py`` on it in a subprocess and prints, side by side for the
reference and the scaled trace: input size, wall seconds and the subprocess' peak RSS.

    python bench/postprocess_large_trace.py [--target-gib 1.0] [--workdir /tmp/sftprof_bench] [--compress] [--halves]

``--halves`` also times, one after the other in this process, the two halves the CLI runs side by side on the scaled
trace (its views' pass, and the summary's read then its questions), so that a round's table says where the time went.

Budget (DEVELOPERS.md, issue 49): 1 GiB in <= 30 s with peak RSS <= 1 GiB on a 2-core machine; measurements in
bench/NOTES.md.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sftprof.artifacts import trace_name  # noqa: E402
from sftprof.analysis.time.trace_summary import KernelTraceAnalyzer  # noqa: E402
from sftprof.analysis.trace.io import TraceReader, TraceWriter  # noqa: E402
from sftprof.analysis.views.split import read_for_summary, split_trace  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "h200_mcore_qwen3moe_4l_8k.trace.json.gz"
ID_OFFSET = 10_000_000


def build_scaled_trace(src: Path, dst: Path, target_bytes: int) -> int:
    """Write ``dst`` (plain JSON) with enough shifted copies of ``src``'s events to reach ``target_bytes``."""
    reader = TraceReader(src)
    events = [ev for _, ev in reader.events()]
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    nums = [e["ts"] for e in body if isinstance(e.get("ts"), (int, float))]
    span = max(nums) - min(nums) + 1000.0
    one_copy = sum(len(json.dumps(e)) + 2 for e in body)
    copies = max(1, round(target_bytes / one_copy))
    w = TraceWriter(dst, reader.header)
    for k in range(copies):
        for e in body:
            if k:
                e = dict(e)
                if isinstance(e.get("ts"), (int, float)):
                    e["ts"] = e["ts"] + k * span
                if "id" in e:
                    e["id"] = e["id"] + k * ID_OFFSET
                args = e.get("args")
                if args:
                    args = e["args"] = dict(args)
                    for key in ("correlation", "External id"):
                        if key in args:
                            args[key] = args[key] + k * ID_OFFSET
            w.write(json.dumps(e))
    for e in meta:
        w.write(json.dumps(e))
    w.close()
    return copies


def run_postprocess(trace: Path, work: Path, compress: bool) -> tuple[float, float, float, int]:
    """Run the CLI on a log dir holding ``trace`` as rank 0; returns (wall s, CPU s, peak RSS GiB, exit code). CPU
    seconds are user + system of the CLI and its worker processes (steadier than wall seconds on shared cores); the
    peak RSS is that of the largest process (the CLI, which holds the summary's arrays; its views worker stays near
    0.12 GiB)."""
    log = work / f"log_{trace.stem}"
    shutil.rmtree(log, ignore_errors=True)
    (log / "perf_tracer").mkdir(parents=True)
    os.link(trace, log / "perf_tracer" / trace_name(0, compress=trace.name.endswith(".gz")))
    run = work / f"run_{trace.stem}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "postprocess_profile.py"), "--log-dir", str(log), "--run-dir", str(run),
           "--profile-kind", "kernel", "--profile-step", "0"] + (["--compress"] if compress else [])
    # Peak RSS of this one child: run it through a tiny wrapper so RUSAGE_CHILDREN is not shared.
    wrapper = ("import resource,subprocess,sys,time;t=time.perf_counter();"
               "rc=subprocess.run(sys.argv[1:]).returncode;r=resource.getrusage(resource.RUSAGE_CHILDREN);"
               "print(time.perf_counter()-t, r.ru_utime+r.ru_stime, r.ru_maxrss, rc)")
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    wall, cpu, rss_kib, rc = out.stdout.split()[-4:]
    return float(wall), float(cpu), int(rss_kib) / 2**20, int(rc)


def time_halves(trace: Path, work: Path) -> list[tuple[str, float, float]]:
    """``(half, wall s, CPU s)`` of each half of the postprocess of ``trace`` run alone: the views' pass
    (:func:`split_trace`), the summary's read (:func:`read_for_summary`) and its questions
    (:meth:`KernelTraceAnalyzer.summary`)."""
    out = work / "halves"
    shutil.rmtree(out, ignore_errors=True)
    rows = []
    t, c = time.perf_counter(), time.process_time()
    split_trace(str(trace), str(out), 0, progress=False)
    rows.append(("views' pass", time.perf_counter() - t, time.process_time() - c))
    shutil.rmtree(out)
    analyzer = KernelTraceAnalyzer(step=0)
    t, c = time.perf_counter(), time.process_time()
    read_for_summary(str(trace), analyzer.set_header, analyzer.add, analyzer.add_invalid)
    rows.append(("summary's read", time.perf_counter() - t, time.process_time() - c))
    t, c = time.perf_counter(), time.process_time()
    analyzer.summary()
    rows.append(("summary's questions", time.perf_counter() - t, time.process_time() - c))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--target-gib", type=float, default=1.0)
    p.add_argument("--workdir", default="/tmp/sftprof_bench")
    p.add_argument("--compress", action="store_true", help="also write the views gzip-compressed")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--halves", action="store_true", help="also time each half of the scaled trace's postprocess alone")
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ref = work / "reference.json"
    ref.write_bytes(gzip.decompress(FIXTURE.read_bytes()))
    big = work / "scaled.json"
    t = time.perf_counter()
    copies = build_scaled_trace(FIXTURE, big, int(args.target_gib * 2**30))
    print(f"built {big} ({copies} copies, {big.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s",
          file=sys.stderr)
    rows = []
    for trace in (ref, big):
        wall, cpu, rss, rc = run_postprocess(trace, work, args.compress)
        rows.append((trace.name, trace.stat().st_size / 2**30, wall, cpu, rss, rc))
    print(f"\nnproc={os.cpu_count()}  compress={args.compress}  load average {os.getloadavg()[0]:.1f}")
    print(f"{'trace':<16}{'size GiB':>10}{'wall s':>10}{'CPU s':>10}{'peak RSS GiB':>14}{'exit':>6}")
    for name, size, wall, cpu, rss, rc in rows:
        print(f"{name:<16}{size:>10.3f}{wall:>10.1f}{cpu:>10.1f}{rss:>14.2f}{rc:>6}")
    if args.halves:
        print(f"\n{'scaled.json, each half alone':<30}{'wall s':>10}{'CPU s':>10}")
        for half, wall, cpu in time_halves(big, work):
            print(f"{half:<30}{wall:>10.1f}{cpu:>10.1f}")
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
