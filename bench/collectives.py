"""NCCL collective bandwidth on this machine's GPUs, under NCCL settings side by side (bench/NOTES.md).

Why: at ``megatron:(attn:c2|ffn:e2)`` on 2x H200 the EP all-to-all of the MoE dispatch ran at ~211 GB/s of
algorithm bandwidth while the CP all-gather reached ~452 GB/s (tenth session's notes). This script measures
the collectives the step uses, at its message sizes, once per NCCL setting, so the choice of setting (or of
collective) rests on a measurement.

Rows (one per collective and size; ``n`` = ranks, ``B`` = ``--mib`` MiB of bf16 per rank):

- ``all_to_all_single``: each rank sends ``B / n`` to every rank (itself included), as the EP dispatch does;
- ``all_gather_into_tensor``: each rank contributes ``B / n`` and receives ``B`` (the CP K/V gather, and the
  all-gather form of a dispatch);
- ``reduce_scatter_tensor``: each rank gives ``B`` and keeps the sum of its ``B / n`` slice;
- ``send/recv pairs``: ``batch_isend_irecv`` of ``B / n`` to and from every other rank (the all-to-all
  without the local copy).

Columns, per setting: ``ms`` = median over ``--reps`` timed calls on rank 0 (CUDA events, after ``--warmup`` calls;
every call starts after a barrier, so the ranks start together and rank 0's time stands for the collective's);
``GB/s`` = bytes that cross links per rank / time: ``B (n - 1) / n`` for every row (what each rank sends to
the others; 1 GB = 1e9 bytes). The ``x first`` column of each later setting is its ms / the first setting's.

Settings (``--setting NAME=VAR=VAL[,VAR=VAL...]``, repeatable; default ``default=`` only): each runs in its own
``torchrun`` (NCCL reads its variables at communicator creation), rank 0 writes JSON, the parent prints one
table. ``--nproc`` ranks per run (default: all visible GPUs).

Usage: python bench/collectives.py [--mib 256 512] [--setting default=] [--setting p2p32=NCCL_MIN_P2P_NCHANNELS=32]
A bad argument (a malformed or repeated ``--setting``, ``--mib`` < 1, ``--reps`` < 1, an existing ``--json``) is
refused with exit status 2 before anything runs. Without two CUDA devices it prints that it needs them and exits
with status 1, measuring nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

OPS = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "send/recv pairs")


def remote_bytes(total_bytes: int, ranks: int) -> int:
    """Bytes one rank sends to the other ranks when it holds ``total_bytes`` split evenly over ``ranks``.

    Raises ValueError for ``ranks < 2`` or a size not divisible by ``ranks``."""
    if ranks < 2 or total_bytes % ranks:
        raise ValueError(f"need >= 2 ranks dividing the size, got {ranks} ranks and {total_bytes} bytes")
    return total_bytes // ranks * (ranks - 1)


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """``NAME=VAR=VAL,VAR=VAL`` -> ``(NAME, {VAR: VAL})``; ``NAME=`` is no variables.

    Raises ValueError naming ``--setting`` for an empty name or a pair without ``=``."""
    name, sep, rest = text.partition("=")
    if not name or not sep:
        raise ValueError(f"--setting {text!r}: expected NAME=VAR=VAL[,VAR=VAL...] or NAME=")
    env = {}
    for pair in filter(None, rest.split(",")):
        var, eq, val = pair.partition("=")
        if not var or not eq:
            raise ValueError(f"--setting {text!r}: {pair!r} is not VAR=VAL")
        env[var] = val
    return name, env


def check_args(args, settings: list[tuple[str, dict[str, str]]]) -> list[str]:
    """What is wrong with the command line before anything runs (empty when nothing): ``--mib`` sizes >= 1,
    ``--reps`` >= 1, ``--warmup`` >= 0, ``--nproc`` >= 0, setting names unique and made of letters, digits, ``.``,
    ``_``, ``-`` (each names a JSON file and a table column), and no existing ``--json`` file (never overwritten)."""
    out = [f"--mib {m}: must be an integer >= 1 (MiB of bf16 per rank)" for m in args.mib if m < 1]
    out += [f"--{k} {v}: must be an integer >= {lo}" for k, v, lo in
            (("reps", args.reps, 1), ("warmup", args.warmup, 0), ("nproc", args.nproc, 0)) if v < lo]
    names = [n for n, _ in settings]
    out += [f"--setting {n!r}: the name must be letters, digits, '.', '_' or '-'" for n in names
            if not all(c.isascii() and (c.isalnum() or c in "._-") for c in n)]
    out += [f"--setting {n!r}: the name is given {names.count(n)} times; names must be unique"
            for n in dict.fromkeys(names) if names.count(n) > 1]
    if args.json and os.path.exists(args.json):
        out.append(f"--json {args.json}: exists; give a new file (results are never overwritten)")
    return out


def _worker(args) -> int:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    results = {}
    for mib in args.mib:
        n_el = mib * 2 ** 20 // 2 // world * world
        src = torch.randn(n_el, device="cuda", dtype=torch.bfloat16)
        full = torch.empty_like(src)
        part = torch.empty(n_el // world, device="cuda", dtype=torch.bfloat16)
        chunks = list(src.chunk(world))
        outs = list(full.chunk(world))

        def pairs():
            ops = []
            for peer in range(world):
                if peer != rank:
                    ops.append(dist.P2POp(dist.isend, chunks[peer], peer))
                    ops.append(dist.P2POp(dist.irecv, outs[peer], peer))
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        calls = {
            "all_to_all_single": lambda: dist.all_to_all_single(full, src),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, part),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, src),
            "send/recv pairs": pairs,
        }
        for op, fn in calls.items():
            for _ in range(args.warmup):
                fn()
            times = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            results[f"{op}|{mib}"] = {"ms": ms, "gbps": remote_bytes(n_el * 2, world) / ms / 1e6}
    if rank == 0:
        Path(args.worker_json).write_text(json.dumps({"world": world, "results": results}))
    dist.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 256, 512], help="MiB of bf16 per rank")
    parser.add_argument("--setting", action="append", default=None, help="NAME=VAR=VAL[,VAR=VAL...]")
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: visible GPUs)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_json:
        return _worker(args)
    try:
        settings = [parse_setting(s) for s in (args.setting or ["default="])]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    problems = check_args(args, settings)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    nproc = args.nproc or torch.cuda.device_count()
    if nproc < 2 or torch.cuda.device_count() < nproc:
        print(f"bench/collectives.py needs >= 2 CUDA devices (visible: {torch.cuda.device_count()}); nothing measured")
        return 1
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in settings:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   f"--master-port={os.environ.get('MASTER_PORT', '29650')}", __file__, "--worker-json", str(out),
                   "--reps", str(args.reps), "--warmup", str(args.warmup), "--mib", *map(str, args.mib)]
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
            if proc.returncode or not out.exists():
                print(f"setting {name}: torchrun exited {proc.returncode}; last lines:\n{proc.stderr[-2000:]}")
                continue
            runs[name] = json.loads(out.read_text())["results"]
    if not runs:
        return 1
    names = list(runs)
    head = "| collective | MiB/rank | " + " | ".join(
        f"{n} ms | {n} GB/s" + (f" | {n} x {names[0]}" if i else "") for i, n in enumerate(names)) + " |"
    print(f"ranks: {nproc} (times: rank 0's median); settings: " + "; ".join(f"{n}: {dict(e) or 'NCCL defaults'}" for n, e in settings))
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for op in OPS:
        for mib in args.mib:
            cells = []
            for i, n in enumerate(names):
                r = runs[n].get(f"{op}|{mib}")
                base = runs[names[0]].get(f"{op}|{mib}")
                cells.append(f"{r['ms']:.3f} | {r['gbps']:.0f}" if r else "- | -")
                if i:
                    cells.append(f"{r['ms'] / base['ms']:.2f}" if r and base else "-")
            print(f"| {op} | {mib} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": nproc, "settings": dict(settings), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
