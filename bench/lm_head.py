"""LM head + token log-prob loss, fwd+bwd, side by side on one GPU (see bench/NOTES.md).

Rows: naive (bf16 logits, fp32 log-softmax), torch chunks of 4096 with checkpointing, Liger-Kernel fused
linear cross entropy, Cut Cross-Entropy, and sftprof.ops (``linear_sft_loss``: gradients in forward;
``linear_logprobs`` with entropy: recompute in backward) at several chunk sizes. Loss = sum over tokens
of -logprob (plus, for the entropy row, 0.01 * sum entropy). For each row: median ms over the timed
repetitions (CUDA events), effective TFLOP/s = 6 N H V / time, extra peak GiB = peak allocated during
one fwd+bwd minus (memory before + bytes of the inputs' gradients), and "+grads" = peak minus memory before
(gradients included; the way shared/device/README.md's baseline table counts, e.g. CCE 1.08 GiB).

Each row is first run once untimed (warm-up, autotuning) and once for its peak memory; the timed calls then
go round-robin over all rows (repetition r of every row before repetition r + 1 of any), so that clock and
temperature drift over the run affect all rows alike.

``grad_in_hidden`` rows write d/dhidden over the hidden input (see ``linear_sft_loss`` / ``linear_logprobs``);
the inputs are restored (untimed) before each of their calls.

Usage: python bench/lm_head.py [--tokens 8192 32768 131072] [--vocab 151936] [--rows TEXT ...] [--reps R]
       [--json out.json]   (--vocab 248320: Qwen3.5's vocabulary)
A row whose library does not import is printed with a note instead of numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sftprof.ops import linear_logprobs, linear_sft_loss  # noqa: E402

H, V = 2048, 151936


def naive(h, w, y):
    logits = h @ w.t()
    (-logits.float().log_softmax(-1).gather(1, y[:, None]).sum()).backward()


def torch_chunked(h, w, y, chunk=4096):
    from torch.utils.checkpoint import checkpoint

    def part(hc, yc):
        return -(hc @ w.t()).float().log_softmax(-1).gather(1, yc[:, None]).sum()

    loss = sum(checkpoint(part, h[s:s + chunk], y[s:s + chunk], use_reentrant=False)
               for s in range(0, h.shape[0], chunk))
    loss.backward()


def make_liger():
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    mod = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run(h, w, y):
        out = mod(w, h, y)
        (out[0] if isinstance(out, tuple) else out).backward()
    return run


def make_cce():
    from cut_cross_entropy import linear_cross_entropy

    def run(h, w, y):
        linear_cross_entropy(h, w, y, reduction="sum").backward()
    return run


def ours_sft(chunk, grad_in_hidden=False):
    def run(h, w, y):
        linear_sft_loss(h, w, y, torch.ones(h.shape[0], device=h.device), chunk_size=chunk,
                        grad_in_hidden=grad_in_hidden).backward()
    run.consumes_hidden = grad_in_hidden
    return run


def ours_recompute(chunk, grad_in_hidden=False):
    def run(h, w, y):
        lp, ent = linear_logprobs(h, w, y, chunk_size=chunk, return_entropy=True, grad_in_hidden=grad_in_hidden)
        (-lp.sum() + 0.01 * ent.sum()).backward()
    run.consumes_hidden = grad_in_hidden
    return run


def gemms_only(chunk):
    """The three GEMMs of the chunk loop alone (logits, d/dhidden, d/dweight accumulation), no softmax:
    the time floor of the 3-GEMM design at this chunk size."""
    def run(h, w, y):
        with torch.no_grad():
            gh, buf = torch.empty_like(h), h.new_empty(chunk, w.shape[0])
            gw = None
            for s in range(0, h.shape[0], chunk):
                lg = buf[: min(chunk, h.shape[0] - s)]
                torch.mm(h[s:s + chunk], w.t(), out=lg)
                torch.mm(lg, w, out=gh[s:s + chunk])
                gw = torch.mm(lg.t(), h[s:s + chunk]) if gw is None else gw.addmm_(lg.t(), h[s:s + chunk])
    return run


def peak_gib(fn, h, w, y, reset):
    """(extra peak GiB beyond the inputs' gradients, peak GiB above the memory before the call) of one fwd+bwd;
    grads are reset and ``reset()`` runs before the call."""
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    h.grad = w.grad = None
    reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(h, w, y)
    torch.cuda.synchronize()
    above = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return above - grad_bytes / 2 ** 30, above


def time_ms(fn, h, w, y):
    """ms of one fwd+bwd (CUDA events), with the grads reset first."""
    h.grad = w.grad = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(h, w, y)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _fmt(value, spec: str) -> str:
    return spec.format(value) if value is not None else "-"


def all_rows():
    """``(name, factory)`` of every method, in the table's order; a factory returns the fwd+bwd call ``fn(h, w, y)``
    (and imports its library: an ImportError is the row's note)."""
    rows = [("naive", lambda: naive), ("torch chunk4096+ckpt", lambda: torch_chunked),
            ("liger FLCE 0.8.5", make_liger), ("CCE 25.1.1", make_cce)]
    rows += [(f"3 GEMMs only chunk{c} (floor)", lambda c=c: gemms_only(c)) for c in (1536, 1728, 1760, 2048, 4096)]
    rows += [(f"ours sft chunk{c}", lambda c=c: ours_sft(c)) for c in (1024, 2048, 4096)]
    rows += [(f"ours sft chunk{c} grad_in_hidden", lambda c=c: ours_sft(c, True))
             for c in (1024, 1088, 1536, 1728, 1760, 2048, 3072)]
    rows += [(f"ours logprob+entropy recompute chunk{c}", lambda c=c: ours_recompute(c)) for c in (2048, 4096)]
    rows += [(f"ours logprob+entropy recompute chunk{c} grad_in_hidden", lambda c=c: ours_recompute(c, True))
             for c in (2048, 4096)]
    return rows


def main() -> int:
    """The table (module docstring); exit status 0, 1 without a CUDA GPU (nothing measured), 2 on a bad argument
    (refused before the CUDA check)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--json", type=Path, default=None, help="write all rows here")
    ap.add_argument("--vocab", type=int, default=V, help=f"vocabulary size V (default {V}: Qwen3-30B-A3B's; "
                    "248320: Qwen3.5-35B-A3B's)")
    ap.add_argument("--reps", type=int, default=0,
                    help="timed calls per row (default: 5 at N >= 65536 tokens, 7 below)")
    ap.add_argument("--rows", nargs="+", default=[""],
                    help="run only the methods whose name contains one of these texts")
    args = ap.parse_args()
    if min(args.tokens) < 1 or args.vocab < 1:
        ap.error(f"--tokens {' '.join(map(str, args.tokens))} and --vocab {args.vocab}: each must be an integer >= 1")
    if args.reps < 0:
        ap.error(f"--reps {args.reps}: must be an integer >= 1 (or 0: 5 at N >= 65536 tokens, 7 below)")
    rows = [r for r in all_rows() if any(text in r[0] for text in args.rows)]
    if not rows:
        ap.error(f"--rows {' '.join(args.rows)}: no method's name contains one of these texts")
    if not torch.cuda.is_available():
        print("bench/lm_head.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured",
              file=sys.stderr)
        return 1
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results = []
    for n in args.tokens:
        h = torch.randn(n, H, device=dev, dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(args.vocab, H, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
        y = torch.randint(0, args.vocab, (n,), device=dev)
        h_src = h.detach().clone()

        def restore():  # rows with grad_in_hidden leave d/dhidden in h: put the inputs back
            with torch.no_grad():
                h.copy_(h_src)

        live, recs = [], []
        for name, factory in rows:  # warm-up and peak memory, one row after the other
            rec = dict(tokens=n, vocab=args.vocab, method=name, ms=None, tflops=None, extra_gib=None, peak_above_before_gib=None, note="")
            recs.append(rec)
            try:
                fn = factory()
                reset = restore if getattr(fn, "consumes_hidden", False) else (lambda: None)
                fn(h, w, y)  # warm-up / compile / autotune
                rec["extra_gib"], rec["peak_above_before_gib"] = (round(v, 3) for v in peak_gib(fn, h, w, y, reset))
                if reset is restore:  # did autograd keep d/dhidden in h's storage or copy it into h.grad?
                    rec["note"] = "h.grad in h's storage" if h.grad.data_ptr() == h.data_ptr() else "h.grad copied"
                live.append((rec, fn, reset, []))
            except torch.OutOfMemoryError:
                rec["note"] = "OOM"
            except ImportError as exc:
                rec["note"] = f"import failed: {exc}"
            h.grad = w.grad = None
            restore()
            torch.cuda.empty_cache()
        for _ in range(args.reps or (5 if n >= 65536 else 7)):  # timed calls, round-robin over the rows
            for rec, fn, reset, times in live:
                if rec["note"].startswith("OOM"):
                    continue
                try:
                    times.append(time_ms(fn, h, w, y))
                except torch.OutOfMemoryError:
                    rec["note"] = "OOM in a timed call"
                h.grad = w.grad = None
                reset()  # untimed: a grad_in_hidden row puts the inputs back for the next row
        for rec, _, _, times in live:
            if times and not rec["note"].startswith("OOM"):
                ms = statistics.median(times)
                rec.update(ms=round(ms, 2), tflops=round(6 * n * H * args.vocab / ms / 1e9, 1))
        print(f"H = {H}, V = {args.vocab}, bf16", flush=True)
        print(f"{'N':>7} {'method':<56} {'ms':>9} {'TFLOP/s':>8} {'extra GiB':>9} {'+grads':>7}  note", flush=True)
        for rec in recs:
            print(f"{n:>7} {rec['method']:<56} {_fmt(rec['ms'], '{:.1f}'):>9} {_fmt(rec['tflops'], '{:.0f}'):>8} "
                  f"{_fmt(rec['extra_gib'], '{:.2f}'):>9} {_fmt(rec['peak_above_before_gib'], '{:.3f}'):>7}  "
                  f"{rec['note']}", flush=True)
        results += recs
    from sftprof.ops import triton_kernels
    for kern in ("_shifted_exp_kernel", "_row_stats_kernel", "_softmax_grad_kernel"):
        print(f"autotuned {kern}: {getattr(getattr(triton_kernels, kern), 'best_config', None)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
