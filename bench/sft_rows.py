"""The fused SFT row kernel alone, every launch config side by side (see bench/NOTES.md).

``_sft_rows_kernel`` reads a ``[chunk, V]`` bf16 logits block twice (statistics, then gradient) and writes
it once. For each autotuning config (BLOCK, warps) this prints the median time of one launch on a chunk of
real logits (restored, untimed, before each launch) and the bandwidth that time implies for 3 HBM passes
(both reads from HBM) and for 2 (the second read served by L2). The floor at ~4.8 TB/s is printed per chunk
size.

Usage: python bench/sft_rows.py [--chunks 1664 2048 4096] [--vocab 151936] [--reps 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sftprof.ops import triton_kernels as tk  # noqa: E402


def time_config(x, x_src, labels, weights, cfg, reps):
    n, v = x.shape
    lp = torch.empty(n, dtype=torch.float32, device=x.device)
    kw = dict(cfg.kwargs, num_warps=cfg.num_warps)
    times = []
    for i in range(reps + 1):
        x.copy_(x_src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tk._sft_rows_kernel.fn[(n,)](x, x.stride(0), v, labels, weights, lp, 1.0, **kw)
        end.record()
        end.synchronize()
        if i:  # first launch compiles
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1664, 2048, 4096])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{'chunk':>6} {'BLOCK':>6} {'warps':>5} {'ms':>8} {'TB/s 3 pass':>11} {'TB/s 2 pass':>11}", flush=True)
    for n in args.chunks:
        hidden = torch.randn(n, 2048, device=dev, dtype=torch.bfloat16)
        weight = torch.randn(args.vocab, 2048, device=dev, dtype=torch.bfloat16) * 0.02
        x_src = hidden @ weight.t()  # logits of the LM head's scale
        del hidden, weight
        x = torch.empty_like(x_src)
        labels = torch.randint(0, args.vocab, (n,), device=dev)
        weights = torch.ones(n, device=dev)
        nbytes = x.numel() * x.element_size()
        rows = []
        for cfg in tk._SFT_CONFIGS:
            ms = time_config(x, x_src, labels, weights, cfg, args.reps)
            rows.append((ms, cfg))
            print(f"{n:>6} {cfg.kwargs['BLOCK']:>6} {cfg.num_warps:>5} {ms:>8.3f} {3 * nbytes / ms / 1e9:>11.2f} "
                  f"{2 * nbytes / ms / 1e9:>11.2f}", flush=True)
        best_ms, best = min(rows, key=lambda r: r[0])
        print(f"chunk {n}: best {best.kwargs} warps {best.num_warps} {best_ms:.3f} ms; 3-pass floor at 4.8 TB/s "
              f"{3 * nbytes / 4.8e9:.3f} ms, 2-pass {2 * nbytes / 4.8e9:.3f} ms", flush=True)
        del x, x_src
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
