"""What the CUDA allocator history costs (issue 46, item 5), stacks="python" against "all" (GPU).

Step time with the history off, ``stacks="python"`` and ``stacks="all"``, and each snapshot's dump time and file size.

Two workloads:

- ``--driver`` (the real one): the README's 4-layer Qwen3-30B-A3B slice through the driver, one memory trial per
  ``memory_profiler.stacks`` value (``--seq`` tokens, ``LM_HEAD_LOSS_CHUNK_SIZE=2048``, expandable segments: the
  README's 80 GB settings, which fit an H100 80 GB),
  and from each trial the snapshot's size and the trainer's step times (dump time: the profiled step's
  ``profiler_s`` in ``stats.jsonl``, the wall time in the memory profiler's stop, which writes the snapshot);
- default (a stand-in, seconds): ``--layers`` bf16 ``torch.nn.TransformerEncoderLayer`` s of width ``--hidden`` over
  ``--tokens`` tokens with AdamW, ``--steps`` steps per setting in this process, the history of ``--max-entries``
  entries; the dump is timed around ``torch.cuda.memory._dump_snapshot``.

    python bench/snapshot_cost.py                       # stand-in, ~1 min on an H100
    python bench/snapshot_cost.py --driver --out /tmp/snapcost   # the slice, ~2.5 min on an H100 (two memory trials)

Prints one table: setting, median step ms (stand-in), dump s, file MiB. Expect: stacks="python" records and dumps
faster than "all" (C++ unwinding and symbolising the frames is the cost torchtitan#3628 measured at scale) with
smaller files; the history's step overhead grows with allocations per step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sftprof.artifacts import STATS  # noqa: E402
from sftprof.stats_log import read_stats  # noqa: E402


def stand_in(args) -> None:
    import torch

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(args.hidden, args.hidden // 128, 4 * args.hidden,
                                                                    batch_first=True, dtype=torch.bfloat16,
                                                                    device="cuda") for _ in range(args.layers)])
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-5)
    x = torch.randn(1, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)

    def step() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        layers(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - t0)

    for _ in range(2):
        step()  # warm-up: cuBLAS, optimizer state
    print("| setting | median step ms | dump s | file MiB |\n|---|---|---|---|")
    for stacks in (None, "python", "all"):
        if stacks:
            torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks=stacks)
        times = [step() for _ in range(args.steps)]
        dump_s = size = None
        if stacks:
            path = Path(args.out) / f"snapshot_{stacks}.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            torch.cuda.memory._dump_snapshot(str(path))
            dump_s, size = time.perf_counter() - t0, path.stat().st_size / 2**20
            torch.cuda.memory._record_memory_history(enabled=None)
        print(f"| {stacks or 'history off'} | {statistics.median(times):.1f} | "
              f"{'–' if dump_s is None else f'{dump_s:.2f}'} | {'–' if size is None else f'{size:.1f}'} |")


def driver(args) -> None:
    """The README slice's two memory trials (``--seq`` tokens), one per ``memory_profiler.stacks`` value, under a new
    folder ``--out``/<time stamp>/ (nothing earlier is overwritten); one table after both, a failed trial a row that
    says so."""
    base = Path(args.out) / time.strftime("%Y%m%d_%H%M%S")
    rows = []
    for stacks in ("python", "all"):
        env = {**os.environ, "N_GPUS_PER_NODE": "1", "TRAIN_BATCH_SIZE": "1", "PROFILE_N_MBS": "1", "PROFILE_STEPS": "2",
               "TOTAL_STEPS": "3", "PROFILE_KINDS": "memory", "PROFILE_FAKE_SEQ_LEN": str(args.seq),
               "LM_HEAD_LOSS_CHUNK_SIZE": "2048", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
               "RUN_ROOT": str(base / stacks), "FILEROOT": str(base / "fileroot"), "PROFILE_STAMP": stacks}
        rc = subprocess.run(["bash", str(ROOT / "run_qwen3_30b_a3b_sft_profile.sh"), "actor.backend=megatron:d1",
                             "actor.num_layers=4", f"memory_profiler.stacks={stacks}"], env=env).returncode
        rows.append(f"| {stacks} | {driver_cells(base / 'fileroot', stacks, rc)} |")
    print("| stacks | step times s (stats.jsonl) | dump s (profiled step's profiler_s) | snapshot MiB |\n"
          "|---|---|---|---|")
    print("\n".join(rows))


def driver_cells(fileroot: Path, stacks: str, rc: int) -> str:
    """The last three cells of one memory trial's row (step 2 profiled, its log dir under ``fileroot``): every step's
    time, the profiled step's ``profiler_s`` (the snapshot's dump), the snapshot's size in MiB; or what is missing,
    with the driver's exit status ``rc``."""
    log_dir = next(fileroot.rglob(f"*memory_step2_{stacks}"), None)
    if log_dir is None:
        return f"no trial log dir (driver exit {rc}) | – | –"
    try:
        steps = read_stats(log_dir / STATS).steps
    except OSError as err:
        return f"no {STATS} ({err.strerror}; driver exit {rc}) | – | –"
    times = ", ".join(f"{s.step_time_s:.3f}" for s in steps if s.step_time_s is not None) or "no step"
    dump = next((f"{s.profiler_s:.2f}" for s in steps if s.profiled and s.profiler_s is not None), "–")
    snaps = list((log_dir / "memory_snapshots" / "step_2").glob("snapshot_*.pickle"))
    size = f"{sum(p.stat().st_size for p in snaps) / 2**20:.1f}" if snaps else "no snapshot"
    return f"{times} | {dump} | {size}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--driver", action="store_true", help="the 4-layer slice through the driver (else the stand-in)")
    p.add_argument("--out", default="/tmp/sftprof_snapshot_cost", help="where snapshots and runs go")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=65536,
                   help="--driver: tokens of the slice (65536: the README's 80 GB setting, which the fit check passes)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-entries", type=int, default=100000)
    args = p.parse_args()
    (driver if args.driver else stand_in)(args)


if __name__ == "__main__":
    sys.exit(main())
