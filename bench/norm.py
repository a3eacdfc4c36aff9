"""RMSNorm on ONE GPU: torch's ``F.rms_norm`` against the fused Triton path of ``sftprof.models.layers.norm.rms_norm``.

Rows (bf16 input and weight, eps 1e-6; Qwen3-30B-A3B's norms at ``--tokens`` 131072):

- ``q [T, 32, 128]``: the query norm over 32 heads of 128 (contiguous: megatron-core's reshape of the query copies);
- ``k [T, 4, 128] strided``: the key norm as megatron-core hands it over, a view of the QKV projection's output
  ``[T, 4, 1280]`` (8 query heads, the key, the value per group); torch copies it first, the fused path reads it in
  place;
- ``hidden [T, 2048]``: the input and pre-MLP norms.

Columns: ``fwd ms`` / ``fwd+bwd ms`` = median over ``--reps`` CUDA-event timings of one call (after two untimed
warm-up calls; the backward given a fixed random ``dy``, gradients of input and weight); ``GB/s`` = the floor bytes
/ time, the floor being one read of ``x`` and one write of ``y`` forward (``4 T h d`` bytes in bf16), plus one read
each of ``x`` and ``dy`` and one write of ``dx`` backward (weight bytes negligible); ``x torch`` = fused ms / torch ms.
At ~4.8 TB/s (an H200's memory bandwidth) the query row's floor is ~0.45 ms forward and ~1.1 ms fwd+bwd.

After the table, for every row: the max abs difference of the fused ``y``, ``dx`` and ``dweight`` against torch's
(the exactness of record is ``tests/test_norm.py``'s fp64 parity; this is a sanity check on the real shapes).

``--fwd-tile`` / ``--bwd-tile``: extra fused rows with the forward's / backward's elements per ``[BLOCK_ROWS,
BLOCK_D]`` tile (8 per thread) set to each value given (module defaults otherwise), to tune
``sftprof.models.layers.norm_kernels._NORM_FWD_TILE`` / ``_NORM_BWD_TILE`` in one run.

Usage: python bench/norm.py [--tokens 131072] [--reps 10] [--fwd-tile 1024 2048] [--bwd-tile 512 1024]
A bad argument (``--tokens`` or ``--reps`` < 1, a tile that is not a power of 2) is refused with exit status 2 first;
without CUDA it then prints that it needs a GPU and exits with status 1, measuring nothing.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sftprof.models.layers import norm  # noqa: E402

EPS = 1e-6


def _inputs(tokens: int) -> dict:
    """name -> (x, weight, dy): bf16 on the GPU; the key a strided view of a QKV-shaped buffer."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    qkv = rand(tokens, 4, 10 * 128)
    return {"q [T, 32, 128]": (rand(tokens, 32, 128), rand(128), rand(tokens, 32, 128)),
            "k [T, 4, 128] strided": (qkv[..., 1024:1152], rand(128), rand(tokens, 4, 128)),
            "hidden [T, 2048]": (rand(tokens, 2048), rand(2048), rand(tokens, 2048))}


def _torch(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _fused(x, w):
    return norm.rms_norm(x, w, EPS)


def median_ms(fn, reps: int) -> float:
    """Median ms of ``reps`` CUDA-event timings of ``fn`` after two untimed calls (also bench/lm_head_epilogue.py's)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(op, x, w, dy):
    def run():
        a, b = x.detach().requires_grad_(), w.detach().requires_grad_()  # detach keeps x's strides
        op(a, b).backward(dy)
        return a.grad, b.grad
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fwd-tile", type=int, nargs="*", default=[], help="extra fused rows: forward tile sizes")
    ap.add_argument("--bwd-tile", type=int, nargs="*", default=[], help="extra fused rows: backward tile sizes")
    args = ap.parse_args()
    if args.tokens < 1 or args.reps < 1:
        ap.error(f"--tokens {args.tokens} and --reps {args.reps}: each must be an integer >= 1")
    for flag, tiles in (("--fwd-tile", args.fwd_tile), ("--bwd-tile", args.bwd_tile)):
        for t in tiles:
            if t < 1 or t & (t - 1):
                ap.error(f"{flag} {t}: must be a power of 2 (elements per tile; Triton blocks are powers of 2)")
    if not torch.cuda.is_available():
        print("bench/norm.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured",
              file=sys.stderr)
        return 1
    from sftprof.models.layers import norm_kernels

    defaults = (norm_kernels._NORM_FWD_TILE, norm_kernels._NORM_BWD_TILE)
    settings = [None] + [s for s in itertools.product(args.fwd_tile or [defaults[0]], args.bwd_tile or [defaults[1]])
                         if s != defaults]
    print(f"# {torch.cuda.get_device_name()}, {args.tokens} tokens, bf16, median of {args.reps}; "
          f"fused defaults: forward tile {defaults[0]}, backward tile {defaults[1]} elements")
    print("| row | path | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s | x torch (fwd, fwd+bwd) |")
    print("|---|---|---|---|---|---|---|")
    checks = []
    for name, (x, w, dy) in _inputs(args.tokens).items():
        floor_fwd = 2 * x.numel() * x.element_size()
        floor_all = floor_fwd + 3 * x.numel() * x.element_size()
        base = None
        for setting in [("torch", None)] + [("fused", s) for s in settings]:
            path, tune = setting
            if path == "fused":
                norm_kernels._NORM_FWD_TILE, norm_kernels._NORM_BWD_TILE = tune or defaults
            op = _torch if path == "torch" else _fused
            fwd = median_ms(lambda: op(x, w), args.reps)
            both = median_ms(_fwd_bwd(op, x, w, dy), args.reps)
            label = path if tune is None else f"fused tiles {tune[0]} / {tune[1]}"
            ratio = "" if base is None else f"{fwd / base[0]:.2f}, {both / base[1]:.2f}"
            print(f"| {name} | {label} | {fwd:.3f} | {floor_fwd / fwd / 1e6:.0f} | {both:.3f} | "
                  f"{floor_all / both / 1e6:.0f} | {ratio} |")
            base = base or (fwd, both)
        norm_kernels._NORM_FWD_TILE, norm_kernels._NORM_BWD_TILE = defaults
        want = (_torch(x, w),) + _fwd_bwd(_torch, x, w, dy)()
        got = (_fused(x, w),) + _fwd_bwd(_fused, x, w, dy)()
        diffs = [float((a - b).abs().max()) for a, b in zip(got, want)]
        checks.append(f"{name}: max |fused - torch| y {diffs[0]:.3g}, dx {diffs[1]:.3g}, dweight {diffs[2]:.3g} "
                      f"(|dweight| max {float(want[2].abs().max()):.3g})")
    print()
    print("\n".join(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
