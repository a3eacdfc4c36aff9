"""Can the SFT path's memory-bound pass hide under its GEMMs? One chunk of the LM head, on one GPU (bench/NOTES.md).

Issue 49 item 2 asks ``linear_sft_loss`` for <= 0.95x Liger's time at Cut Cross-Entropy's memory, which leaves
~6 ms above the three GEMMs at 131072 tokens: the elementwise pass over each chunk's logits (``sft_chunk_``: one
read and one write) must nearly vanish. This script times the two ways of hiding it, on one chunk of 1760 tokens
(H = 2048, V = 151936, bf16; ms per call, the median of 15 CUDA-event timings, 7 for the 8-chunk rows; TFLOP/s of
the logits GEMM's 2 N H V, of the three GEMMs for the 8-chunk rows):

1. Overlap: the whole SFT chunk (logits GEMM, the pass, the ``d/dweight`` addmm into a bf16 ``[V, H]`` gradient,
   the ``d/dhidden`` GEMM) 8 times, in one stream, and with the pass on a second stream so that it overlaps the next
   chunk's logits GEMM, through two logits buffers (of 880 rows: the memory of one 1760-row buffer; and of 1760
   rows: twice it); against the three GEMMs alone.
2. Fusion: a persistent Triton GEMM (TMA descriptors, 128 x 256 x 64 tiles, 3 stages, 8 warps; with and without
   warp specialisation and loop flattening) whose epilogue does the pass's work: ``exp(x - s0)`` stored in bf16 with
   its fp32 sums per (row, 256-column block), with or without looking for the target logit (``epi``: 0 plain,
   1 exp + target, 2 the recompute path's forward statistics only (max, sum exp, sum x exp; nothing stored),
   3 exp, 4 exp in two column halves; 2 on the unflattened configurations only); and, before these rows, the whole
   fused chain (target logits by a row dot before the GEMM, epilogue 3, today's per-row finisher after it) against
   cuBLAS + ``sft_chunk_``, three rounds. Epilogue 3 never keeps a block raw (today's pass does when its sum
   exceeds ``e^SHIFT_MARGIN``, which these random logits never reach), so the chain's time is a lower bound for a
   fused path that is correct on every input.

Each Triton row is checked against an fp32 reference first (relative error of the exponentials, of the row sums,
the target's absolute error); a configuration that does not compile is printed as failed. Usage:
``python bench/lm_head_epilogue.py`` (no options; needs CUDA and Triton).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.norm import median_ms  # noqa: E402
from sftprof.ops.vocab_softmax import shift_offset, sft_chunk_  # noqa: E402

ROWS, HIDDEN, VOCAB = 1760, 2048, 151936
EPILOGUES = ["gemm", "gemm+exp+target", "stats only", "gemm+exp", "gemm+exp halves"]
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, warp-specialised, flattened)
CONFIGS = [(128, 256, 64, 3, 8, False, False), (128, 256, 64, 3, 8, True, False),
           (128, 256, 64, 3, 8, False, True), (128, 256, 64, 3, 8, True, True)]


def build_kernel(triton, tl):
    """The persistent logits GEMM ``[M, K] @ [N, K].T`` with the epilogue ``EPI`` (see the module docstring)."""
    @triton.jit
    def gemm_exp(a_desc, b_desc, c_desc, s0_ptr, lab_ptr, psum_ptr, tgt_ptr, M, N, K, inv_t,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NSM: tl.constexpr,
                 EPI: tl.constexpr, WS: tl.constexpr, FLAT: tl.constexpr):
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        k_tiles = tl.cdiv(K, BK)
        num_tiles = num_pid_m * num_pid_n
        in_group = GROUP_M * num_pid_n
        for tile in tl.range(start, num_tiles, NSM, flatten=FLAT, warp_specialize=WS):
            group = tile // in_group
            first_m = group * GROUP_M
            gsize = min(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + (tile % gsize)
            pid_n = (tile % in_group) // gsize
            om = pid_m * BM
            on = pid_n * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                a = a_desc.load([om, ki * BK])
                b = b_desc.load([on, ki * BK])
                acc = tl.dot(a, b.T, acc)
            if EPI == 2:  # the recompute path's forward: per-tile max, sum exp, sum x exp; nothing stored
                rows = om + tl.arange(0, BM)
                cols = on + tl.arange(0, BN)
                rmask = rows < M
                x = tl.where(cols[None, :] < N, acc * inv_t, float("-inf"))
                mx = tl.max(x, 1)
                e = tl.exp(x - mx[:, None])
                tl.store(psum_ptr + rows * num_pid_n + pid_n, tl.sum(e, 1), mask=rmask)
                tl.store(psum_ptr + M * num_pid_n + rows * num_pid_n + pid_n, mx, mask=rmask)
                tl.store(psum_ptr + 2 * M * num_pid_n + rows * num_pid_n + pid_n,
                         tl.sum(tl.where(cols[None, :] < N, e * x, 0.0), 1), mask=rmask)
            elif EPI >= 3:  # exp(x - s0) and its row sums; the target logit is not looked for here
                rows = om + tl.arange(0, BM)
                rmask = rows < M
                s0 = tl.load(s0_ptr + rows, mask=rmask, other=0.0)
                if EPI == 3:
                    e = tl.exp(acc * inv_t - s0[:, None])
                    if on + BN > N:
                        e = tl.where((on + tl.arange(0, BN))[None, :] < N, e, 0.0)
                    tl.store(psum_ptr + rows * num_pid_n + pid_n, tl.sum(e, 1), mask=rmask)
                    c_desc.store([om, on], e.to(tl.bfloat16))
                else:
                    acc = tl.reshape(acc, (BM, 2, BN // 2))
                    acc = tl.permute(acc, (0, 2, 1))
                    a0, a1 = tl.split(acc)
                    e0 = tl.exp(a0 * inv_t - s0[:, None])
                    e1 = tl.exp(a1 * inv_t - s0[:, None])
                    if on + BN > N:
                        e0 = tl.where((on + tl.arange(0, BN // 2))[None, :] < N, e0, 0.0)
                        e1 = tl.where((on + BN // 2 + tl.arange(0, BN // 2))[None, :] < N, e1, 0.0)
                    c_desc.store([om, on], e0.to(tl.bfloat16))
                    c_desc.store([om, on + BN // 2], e1.to(tl.bfloat16))
                    tl.store(psum_ptr + rows * num_pid_n + pid_n, tl.sum(e0, 1) + tl.sum(e1, 1), mask=rmask)
            elif EPI:
                rows = om + tl.arange(0, BM)
                cols = on + tl.arange(0, BN)
                rmask = rows < M
                s0 = tl.load(s0_ptr + rows, mask=rmask, other=0.0)
                lab = tl.load(lab_ptr + rows, mask=rmask, other=-1)
                x = acc * inv_t
                e = tl.exp(x - s0[:, None])
                e = tl.where(cols[None, :] < N, e, 0.0)
                tl.store(psum_ptr + rows * num_pid_n + pid_n, tl.sum(e, 1), mask=rmask)
                t = tl.sum(tl.where(cols[None, :] == lab[:, None], x, 0.0), 1)
                tl.store(tgt_ptr + rows, t, mask=rmask & (lab >= on) & (lab < on + BN))
                c_desc.store([om, on], e.to(tl.bfloat16))
            else:
                c_desc.store([om, on], acc.to(tl.bfloat16))
    return gemm_exp


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n", 1)[0]).parse_args()
    if not torch.cuda.is_available():
        print("bench/lm_head_epilogue.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured",
              file=sys.stderr)
        return 1
    try:
        import triton
        import triton.language as tl
        from triton.tools.tensor_descriptor import TensorDescriptor

        from sftprof.ops.triton_kernels import _sft_finish_kernel
    except ImportError as exc:
        print(f"bench/lm_head_epilogue.py needs Triton with tensor descriptors (>= 3.3): {exc}; nothing was measured",
              file=sys.stderr)
        return 1
    kernel = build_kernel(triton, tl)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launch(h, w, out, s0, lab, psum, tgt, cfg, epi):
        bm, bn, bk, stages, warps, ws, flat = cfg
        m, k = h.shape
        n = w.shape[0]
        a_d = TensorDescriptor.from_tensor(h, [bm, bk])
        b_d = TensorDescriptor.from_tensor(w, [bn, bk])
        c_d = TensorDescriptor.from_tensor(out, [bm, bn // 2 if epi == 4 else bn])
        nsm = min(num_sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))
        kernel[(nsm,)](a_d, b_d, c_d, s0, lab, psum, tgt, m, n, k, 1.0, BM=bm, BN=bn, BK=bk, GROUP_M=8, NSM=nsm,
                       EPI=epi, WS=ws, FLAT=flat, num_stages=stages, num_warps=warps)

    torch.manual_seed(0)
    n_rows, hdim, vocab = ROWS, HIDDEN, VOCAB
    h = (torch.randn(n_rows, hdim, device="cuda") * 0.5).bfloat16()
    w = (torch.randn(vocab, hdim, device="cuda") * 0.02).bfloat16()
    lab = torch.randint(0, vocab, (n_rows,), device="cuda")
    wts = torch.ones(n_rows, device="cuda")
    buf = torch.empty(n_rows, vocab, device="cuda", dtype=torch.bfloat16)
    ref = h.float() @ w.float().t()
    s0 = ref.max(1).values.contiguous()
    psum = torch.zeros(3 * n_rows * triton.cdiv(vocab, 64), device="cuda")
    tgt = torch.zeros(n_rows, device="cuda")
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "SMs", num_sms, flush=True)
    flop = 2 * n_rows * hdim * vocab

    def row(name, ms, note=""):
        print(f"| {name} | {ms:.3f} ms | {flop / ms / 1e9:.0f} TFLOP/s |{note}", flush=True)

    print("| method | ms | TFLOP/s of the logits GEMM |")
    print("|---|---|---|")
    row("cublas mm", median_ms(lambda: torch.mm(h, w.t(), out=buf), 15))
    row("cublas mm + sft_chunk_ (today)", median_ms(lambda: (torch.mm(h, w.t(), out=buf),
                                                             sft_chunk_(buf, lab, wts, 1.0, None, None)), 15))
    _overlap_rows(h, w, lab, wts, flop)
    _chain_rows(h, w, lab, wts, buf, launch, _sft_finish_kernel, triton)  # before a configuration can break CUDA
    for cfg in CONFIGS:
        for epi in ((0, 1, 3, 4) if cfg[6] else (0, 1, 2, 3, 4)):  # stats only: not measured flattened
            name = f"triton {EPILOGUES[epi]} {cfg}"
            try:
                fn = lambda: launch(h, w, buf, s0, lab, psum, tgt, cfg, epi)  # noqa: E731
                tgt.zero_()
                fn()
                torch.cuda.synchronize()
                note = _check(epi, cfg, buf, ref, s0, psum, tgt, lab)
                row(name, median_ms(fn, 15), note)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a row of its own
                print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:300]} |", flush=True)
                traceback.print_exc(limit=2)
    return 0


def _check(epi, cfg, buf, ref, s0, psum, tgt, lab) -> str:
    """The row's errors against the fp32 reference ``ref`` ``[M, N]``."""
    n_rows, vocab = ref.shape
    nb = -(-vocab // cfg[1])
    if epi == 2:
        ps = psum[:3 * n_rows * nb].view(3, n_rows, nb)
        gm = ps[1].max(1).values
        lse = gm + (ps[0] * torch.exp(ps[1] - gm[:, None])).sum(1).log()
        return f" lse abs err {(lse - ref.logsumexp(1)).abs().max().item():.2e}"
    if epi:
        want = torch.exp(ref - s0[:, None])
        big = want > 1e-30
        err = ((buf.float() - want).abs()[big] / want[big]).max().item()
        sums = psum[:n_rows * nb].view(n_rows, nb).sum(1)
        serr = ((sums - want.sum(1)).abs() / want.sum(1)).max().item()
        terr = (tgt - ref[torch.arange(n_rows, device=ref.device), lab]).abs().max().item()
        return f" exp rel err {err:.2e}, row sums {serr:.2e}, target abs err {terr:.2e} (not looked for: epi 3, 4)"
    return f" max err / max |x| {((buf.float() - ref).abs().max() / ref.abs().max()).item():.2e}"


def _overlap_rows(h, w, lab, wts, flop) -> None:
    """Item 1 of the module docstring: 8 SFT chunks of R rows, one stream against the pass on a second stream."""
    n_rows, hdim = h.shape
    acc_w = torch.zeros(w.shape[0], hdim, device="cuda", dtype=torch.bfloat16)
    for r in (880, 1760):
        bufs = [torch.empty(r, w.shape[0], device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        gh = torch.empty(r, hdim, device="cuda", dtype=torch.bfloat16)
        hr, lr, wr = h[:r], lab[:r], wts[:r]
        side = torch.cuda.Stream()

        def serial(with_pass=True):
            for i in range(8):
                b = bufs[i % 2]
                torch.mm(hr, w.t(), out=b)
                if with_pass:
                    sft_chunk_(b, lr, wr, 1.0, None, None)
                acc_w.addmm_(b.t(), hr)
                torch.mm(b, w, out=gh)

        def overlapped():
            main = torch.cuda.current_stream()
            done = []

            def logits_and_pass(i):
                torch.mm(hr, w.t(), out=bufs[i % 2])
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    sft_chunk_(bufs[i % 2], lr, wr, 1.0, None, None)
                    ev = torch.cuda.Event()
                    ev.record(side)
                done.append(ev)

            logits_and_pass(0)
            for i in range(8):
                if i + 1 < 8:
                    logits_and_pass(i + 1)
                main.wait_event(done[i])
                acc_w.addmm_(bufs[i % 2].t(), hr)
                torch.mm(bufs[i % 2], w, out=gh)

        f8 = 3 * flop * r / n_rows * 8
        for name, fn in ((f"3 GEMMs x 8, {r} rows (floor)", lambda: serial(False)),
                         (f"SFT chunk x 8, {r} rows, one stream", serial),
                         (f"SFT chunk x 8, {r} rows, pass on a second stream", overlapped)):
            ms = median_ms(fn, 7)
            print(f"| {name} | {ms:.3f} ms | {f8 / ms / 1e9:.0f} TFLOP/s (3 GEMMs) | per 1760 rows "
                  f"{ms / 8 * 1760 / r:.3f} ms |", flush=True)
        del bufs


def _chain_rows(h, w, lab, wts, buf, launch, finish_kernel, triton) -> None:
    """Item 2's whole chain (row dot for the targets, the fused GEMM with epilogue 3, today's finisher) against
    cuBLAS + ``sft_chunk_``, three rounds of each; their log-probs and row scales compared first."""
    n, v = buf.shape
    cfg = CONFIGS[2]
    nb = triton.cdiv(v, cfg[1])
    psum = torch.zeros(n * nb, device="cuda")
    off = shift_offset(v)
    out = torch.empty(2, n, device="cuda")
    tgt = torch.empty(n, device="cuda")

    def fused():
        t = (h.float() * w[lab].float()).sum(1)
        launch(h, w, buf, t + off, lab, psum, tgt, cfg, 3)
        finish_kernel[(n,)](buf, buf.stride(0), v, lab, t, wts, psum, nb, nb, out[0], out[1], 1.0, off,
                            out, 1, 1, out, 1, 1, 0, BLOCK=cfg[1], PB=triton.next_power_of_2(nb),
                            SCALE_ROWS=False, HBLOCK=1024, num_warps=4)

    def today():
        torch.mm(h, w.t(), out=buf)
        return sft_chunk_(buf, lab, wts, 1.0, None, None)

    lp_ref, sc_ref = today()
    e_ref = buf.float()
    fused()
    print(f"chain check {cfg}: logprob max abs diff {(out[0] - lp_ref).abs().max().item():.2e}, row scale rel diff "
          f"{((out[1] - sc_ref).abs() / sc_ref).max().item():.2e}, gradient max abs diff "
          f"{(buf.float() - e_ref).abs().max().item():.2e}", flush=True)
    del e_ref
    res: dict[str, list[float]] = {}
    for _ in range(3):
        for name, fn in (("cublas mm + sft_chunk_ (today)", today), ("fused gemm+exp + target dot + finisher", fused),
                         ("cublas mm", lambda: torch.mm(h, w.t(), out=buf)),
                         ("target dot", lambda: (h.float() * w[lab].float()).sum(1))):
            res.setdefault(name, []).append(median_ms(fn, 15))
    print("| chain, 3 rounds | median ms | each round |")
    print("|---|---|---|")
    for name, ts in res.items():
        print(f"| {name} | {statistics.median(ts):.3f} ms | {' '.join(f'{t:.3f}' for t in ts)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
