"""The SFT loss's memory-bound work on one chunk of logits, side by side (see bench/NOTES.md).

For each chunk size, on real bf16 logits of the LM head's scale (restored, untimed, before each launch):
- ``3-pass``: the general path (``row_stats``: one read; ``softmax_grad_``: one read + one write), which
  the TP-split SFT loss uses;
- ``2-pass``: the deferred-normalisation path of ``sft_shifted_exp_`` (target gather; elementwise pass: one
  read + one write; finisher: O(blocks) per row, which also scales the ``[n, H]`` hidden rows) plus the
  ``[n, H]`` row scaling of d/dhidden it needs, once per launch config of its elementwise pass;
- ``cuBLAS mm``: the chunk's logits GEMM alone (what the rows above come after), for scale.
Prints the median ms of 10 launches and the bandwidth for the passes each one makes, a device copy of the
chunk (2 passes, the achievable rate) and the floor at 4.8 TB/s (H200 HBM3e peak).

Usage: python bench/sft_rows.py [--chunks 1760 2048 4096] [--vocab 151936] [--reps 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sftprof.ops import triton_kernels as tk  # noqa: E402
from sftprof.ops.vocab_softmax import SHIFT_MARGIN, shift_offset  # noqa: E402


def median_ms(fn, x, x_src, reps):
    times = []
    for i in range(reps + 1):
        x.copy_(x_src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i:  # the first launch compiles
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1760, 2048, 4096])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{'chunk':>6} {'path':>7} {'tile':>9} {'warps':>5} {'ms':>8} {'TB/s':>6}", flush=True)
    for n in args.chunks:
        hidden = torch.randn(n, 2048, device=dev, dtype=torch.bfloat16)
        weight = torch.randn(args.vocab, 2048, device=dev, dtype=torch.bfloat16) * 0.02
        x_src = hidden @ weight.t()  # logits of the LM head's scale
        x = torch.empty_like(x_src)
        labels = torch.randint(0, args.vocab, (n,), device=dev)
        weights = torch.ones(n, device=dev)
        nbytes = x.numel() * x.element_size()
        lse = torch.empty(n, device=dev)
        coef = torch.zeros(3, n, device=dev)

        def general():
            m, s, _, _ = tk.row_stats(x, labels, 1.0)
            torch.add(m, s.log(), out=lse)
            tk.softmax_grad_(x, labels, lse, coef, 1.0)

        ms = median_ms(lambda: x.copy_(x_src), x, x_src, args.reps)
        print(f"{n:>6} {'copy':>7} {'torch':>9} {'':>5} {ms:>8.3f} {2 * nbytes / ms / 1e9:>6.2f}", flush=True)
        general()  # autotune outside the timing
        ms = median_ms(general, x, x_src, args.reps)
        print(f"{n:>6} {'3-pass':>7} {'tuned':>9} {'':>5} {ms:>8.3f} {3 * nbytes / ms / 1e9:>6.2f}", flush=True)

        scaled, grad_hidden = torch.empty_like(hidden), torch.empty_like(hidden)
        for cfg in tk._EXP_CONFIGS:
            rows_per, block = cfg.kwargs["ROWS"], cfg.kwargs["BLOCK"]

            def deferred():
                _, scale = tk.sft_shifted_exp_(x, labels, weights, 1.0, SHIFT_MARGIN, shift_offset(args.vocab),
                                               (hidden, scaled), cfg)
                tk.scale_rows_(grad_hidden, scale)

            ms = median_ms(deferred, x, x_src, args.reps)
            # Bytes: the chunk read and written once, and two [n, H] row scalings (read + write each).
            moved = 2 * nbytes + 4 * hidden.numel() * hidden.element_size()
            print(f"{n:>6} {'2-pass':>7} {f'{rows_per}x{block}':>9} {cfg.num_warps:>5} {ms:>8.3f} "
                  f"{moved / ms / 1e9:>6.2f}", flush=True)
        ms_mm = median_ms(lambda: torch.mm(hidden, weight.t(), out=x), x, x_src, args.reps)
        print(f"{n:>6} {'cuBLAS':>7} {'mm':>9} {'':>5} {ms_mm:>8.3f} {'':>6}  logits GEMM alone", flush=True)
        print(f"chunk {n}: floor at 4.8 TB/s: 3 passes {3 * nbytes / 4.8e9:.3f} ms, "
              f"2 passes {2 * nbytes / 4.8e9:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
