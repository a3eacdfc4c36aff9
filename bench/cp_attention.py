"""Context-parallel causal attention per rank vs single-GPU causal attention, fwd+bwd on ONE GPU (bench/NOTES.md).

Rows (bf16, batch 1, ``--heads`` query / ``--kv-heads`` key-value heads of ``--head-dim``; defaults 32 / 4 /
128, Qwen3-30B-A3B's attention, at ``--seq`` 131072 tokens):

- ``single GPU causal (S)``: ``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` on
  the whole sequence (what the CP=1 path of ``sftprof.models.layers.attention.cp_causal_attention`` calls);
- ``single GPU, chunked forward (n)``: ``sftprof.models.layers.block_attention.chunked_causal_attention(..., chunks=n)``
  (``--chunks``, default 2 4 8): the forward as n diagonal causal blocks plus unmasked off-diagonal blocks merged
  by log-sum-exp, the backward as one causal call given the merged output and log-sum-exp;
- with ``--layouts ... sbhd``, the two single-GPU row kinds again with the suffix ``, sbhd``: on megatron-core's
  layout, as ``sftprof.models.layers.attention.SDPACoreAttention`` calls them (the same numbers held as contiguous
  ``[s, b, heads, d]`` tensors, passed as permuted ``[b, heads, s, d]`` views, the output flattened to
  ``[s, b, heads * d]`` and the gradient given in that layout), so the cost of layout copies shows against the
  default ``bhsd`` rows (contiguous ``[b, heads, s, d]``);
- ``CP=<n> rank <r>, masked`` / ``CP=<n> rank <r>, blocks (<kernel>)``: exactly one CP rank's attention
  work, ``cp_causal_attention(..., method="masked")`` or ``sftprof.models.layers.block_attention.
  blockwise_cp_attention(..., kernel=...)``, for its ``S/n`` load-balanced queries against random full
  K/V (no process group: the K/V all-gather and the gradient reduce-scatter are not in these rows).

Columns: ``fwd ms`` / ``ms`` = median over ``--reps`` timed calls of the forward alone / the fwd+bwd (CUDA events
before the forward, between forward and backward, after the backward; after one untimed
warm-up call and one memory call per row, the timed calls go round-robin over the rows, repetition i of
every row before repetition i + 1 of any); ``TFLOP/s`` = the causal FLOPs the row needs / time:
forward ``4 * b * h * d * pairs`` over the unmasked query-key pairs (``key <= query``; the counting rule
of ``sftprof/flops.py``: ``Q K^T`` and ``P V`` at ``2 d`` FLOPs per pair each), fwd+bwd = 3.5 x forward
(the backward runs five such GEMMs: ``Q K^T`` again, ``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K``,
``dK = dS^T Q``; 7 / 2 = 3.5), ``fwd TF/s`` the forward's FLOPs / ``fwd ms``; ``extra GiB`` = peak allocated during one fwd+bwd minus (allocated before
the call + bytes of the Q/K/V gradients); ``x single`` = the row's ms / the first single-GPU causal row's ms (issue 18's
goal for CP=2: <= 0.55).

Block kernels (``--kernels``, default all): ``cudnn`` and ``flash`` (the private SDPA ops with K/V expanded
to the query heads), ``cudnn_gqa`` and ``flash_gqa`` (the same ops given the 4 K/V heads as they are); a
kernel that raises is reported in its row's note and left out of the timing.

Two processes, one after the other (the table is printed by the first): the rows that call SDPA's public op
(``single GPU causal``, ``masked``) and the rows that call its private cuDNN/flash ops (``chunked forward``,
``blocks``). torch (2.11) keys its cached cuDNN SDPA graphs by the Q/K/V shapes and strides only, and in one
process a graph cached by one kind of caller gave the other wrong gradients on the same shapes (dq off by 2x its
scale at S = 8192) and, at S >= 32768, an illegal memory access (bench/NOTES.md, fifteenth session); training runs
one kind per process. The timed calls go round-robin within each process, so ``x single`` compares rows timed in
different processes for the private rows.

Exactness check (the GPU run doubles as one): the max abs difference of the output and of the Q/K/V gradients of
every row against a reference on the flash backend (SDPA's public op under ``sdpa_kernel(FLASH_ATTENTION)``, which
caches no cuDNN graph): one causal call for the single-GPU rows, the masked path for the CP rows; printed after
the table.

Usage: python bench/cp_attention.py [--seq 131072] [--cp 2 [4]] [--chunks 2 4 8] [--kernels cudnn ...]
[--layouts bhsd sbhd] [--reps 5] [--json F]
A bad argument (``--chunks`` < 1 or not dividing ``--seq``, ``--cp`` < 2 or not dividing it into 2 x CP chunks, a
value repeated in ``--cp``/``--chunks``/``--kernels``/``--layouts``, a ``--json`` file that exists or whose folder does
not) is refused with exit status 2 first; without CUDA it then prints that it needs a GPU and exits with status 1, measuring
nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sftprof.data import cp_chunk_ids, cp_shard  # noqa: E402

CUDA_KERNELS = ("cudnn", "flash", "cudnn_gqa", "flash_gqa")
PARTS = ("public", "private")  # rows of SDPA's public op / of its private ops, each part in its own process


def causal_pairs(seq: int, cp_size: int = 1, cp_rank: int = 0) -> int:
    """Unmasked query-key pairs (``key <= query``) of a CP rank's two chunks of ``seq / (2 cp_size)`` tokens.

    ``cp_size=1``: the whole sequence, ``seq (seq + 1) / 2``. Chunk ``c`` of length ``L`` has
    ``c L^2 + L (L + 1) / 2`` pairs. Raises ValueError when ``seq`` is not a multiple of ``2 cp_size``.
    """
    if cp_size == 1:
        return seq * (seq + 1) // 2
    if seq % (2 * cp_size):
        raise ValueError(f"--seq {seq} must be a multiple of 2 x CP = {2 * cp_size}")
    length = seq // (2 * cp_size)
    return sum(c * length * length + length * (length + 1) // 2 for c in cp_chunk_ids(cp_size, cp_rank))


def fwd_bwd_flops(pairs: int, heads: int, head_dim: int, batch: int = 1) -> float:
    """Causal attention FLOPs of one fwd+bwd: ``3.5 * 4 * b * h * d * pairs`` (module docstring)."""
    return 3.5 * 4 * batch * heads * head_dim * pairs


def _single(q, k, v):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _chunked(chunks):
    from sftprof.models.layers.block_attention import chunked_causal_attention

    return lambda q, k, v: chunked_causal_attention(q, k, v, chunks=chunks)


def _megatron_layout(fn):
    """``fn`` on ``[s, b, heads, d]`` tensors as SDPACoreAttention calls it: permuted views in, output flattened."""
    def run(q, k, v):
        out = fn(*(t.permute(1, 2, 0, 3) for t in (q, k, v)))
        return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)
    return run


def _cp_row(cp_size, cp_rank, method, kernel=None):
    from sftprof.models.layers.attention import cp_causal_attention
    from sftprof.models.layers.block_attention import blockwise_cp_attention

    def run(q, k, v):
        if method == "masked":
            return cp_causal_attention(q, k, v, cp_size=cp_size, cp_rank=cp_rank, method="masked")
        return blockwise_cp_attention(q, k, v, cp_size=cp_size, cp_rank=cp_rank, kernel=kernel)
    return run


def _on_flash(fn):
    """``fn`` with SDPA's public op held to its flash backend (the exactness references: no cuDNN graph cache)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return fn(q, k, v)
    return run


def _fwd_bwd(fn, q, k, v, dout):
    out = fn(q, k, v)
    out.backward(dout)
    return out


def _reset(tensors):
    for t in tensors[:3]:
        t.grad = None


def peak_extra_gib(fn, tensors) -> float:
    """Peak allocated GiB of one fwd+bwd beyond the memory before it and the Q/K/V gradients."""
    _reset(tensors)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _fwd_bwd(fn, *tensors)
    torch.cuda.synchronize()
    grads = sum(t.numel() * t.element_size() for t in tensors[:3])
    return (torch.cuda.max_memory_allocated() - base - grads) / 2 ** 30


def time_ms(fn, tensors) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of one call, CUDA events around the forward and the backward."""
    _reset(tensors)
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    q, k, v, dout = tensors
    start.record()
    out = fn(q, k, v)
    mid.record()
    out.backward(dout)
    end.record()
    end.synchronize()
    return start.elapsed_time(mid), start.elapsed_time(end)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"


def _exactness(reference, candidates: dict, tensors, group: str) -> dict:
    """Max abs diff of out / dq / dk / dv of each candidate forward vs ``reference`` (same inputs); a candidate's
    RuntimeError is its entry (``{"error": ...}``). Raises RuntimeError naming ``group`` and the candidate when it
    faults the device (``torch.AcceleratorError``: the CUDA context is unusable after it)."""
    _reset(tensors)
    want_out = _fwd_bwd(reference, *tensors).detach()
    want = [want_out] + [t.grad for t in tensors[:3]]
    diffs = {}
    for kernel, fn in candidates.items():
        _reset(tensors)
        try:
            got_out = _fwd_bwd(fn, *tensors).detach()
            if got_out.is_cuda:
                torch.cuda.synchronize()  # an asynchronous fault of this candidate's kernels surfaces here
        except torch.AcceleratorError as exc:  # a device fault leaves the CUDA context unusable: stop here
            raise RuntimeError(f"exactness check of {group}, {kernel}: {_first_line(exc)}") from exc
        except RuntimeError as exc:  # e.g. an op refusing GQA K/V (the _gqa kernels): reported, not fatal
            diffs[kernel] = {"error": _first_line(exc)}
            continue
        got = [got_out] + [t.grad for t in tensors[:3]]
        diffs[kernel] = {name: float((g.float() - w.float()).abs().max())
                         for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
        diffs[kernel]["out_scale"] = float(want_out.float().abs().max())
    _reset(tensors)
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072, help="tokens of the sequence (S)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cp", type=int, nargs="+", default=[2], help="CP sizes to simulate (e.g. 2 4)")
    ap.add_argument("--kernels", nargs="+", default=list(CUDA_KERNELS), choices=CUDA_KERNELS,
                    help="block kernels of the blocks rows (sftprof.models.layers.block_attention.BLOCK_KERNELS)")
    ap.add_argument("--chunks", type=int, nargs="*", default=[2, 4, 8],
                    help="single-GPU rows of chunked_causal_attention with these query-chunk counts")
    ap.add_argument("--layouts", nargs="+", default=["bhsd"], choices=("bhsd", "sbhd"),
                    help="layouts of the single-GPU rows: bhsd = contiguous [b, heads, s, d]; sbhd = megatron-core's "
                         "(permuted views of [s, b, heads, d], output and gradient [s, b, heads * d])")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per row")
    ap.add_argument("--json", type=Path, default=None, help="write the rows and the exactness check here")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one process's rows (_run_parts)
    ap.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.seq < 1 or args.reps < 1:
        ap.error(f"--seq {args.seq} and --reps {args.reps}: each must be an integer >= 1")
    for cp in args.cp:
        if cp < 2:
            ap.error(f"--cp {cp}: must be >= 2 (CP=1 is the single-GPU row)")
        try:
            causal_pairs(args.seq, cp, 0)  # checks divisibility before any GPU work
        except ValueError as exc:
            ap.error(str(exc))
    for n in args.chunks:
        if n < 1 or args.seq % n:
            ap.error(f"--chunks {n}: must be >= 1 and divide --seq {args.seq}")
    for flag in ("cp", "chunks", "kernels", "layouts"):  # a repeat would give two rows of one name
        values = getattr(args, flag)
        if len(set(values)) != len(values):
            ap.error(f"--{flag} {' '.join(map(str, values))}: a value is repeated (each gives its own rows)")
    if args.json and args.json.exists():
        ap.error(f"--json {args.json}: exists; give a new file (results are never overwritten)")
    if args.json and not args.json.resolve().parent.is_dir():
        ap.error(f"--json {args.json}: folder {args.json.resolve().parent} does not exist")
    if not torch.cuda.is_available():
        print("bench/cp_attention.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured",
              file=sys.stderr)
        return 1
    if args.part:
        return _run_part(args)
    parts = _run_parts(args, argv)
    if parts is None:
        return 1
    _print_table(args, *parts)
    return 0


def _run_part(args) -> int:
    """Warm up, measure and time this process's rows (``args.part``), check them against the flash references,
    and write them to ``args.part_out``; 1 when a row faults the device."""
    torch.manual_seed(0)
    dev, s, h, g, d = torch.device("cuda"), args.seq, args.heads, args.kv_heads, args.head_dim

    def rand(*shape, grad=True):
        t = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        return t.requires_grad_() if grad else t

    k, v = rand(1, g, s, d), rand(1, g, s, d)
    q_full, dout_full = rand(1, h, s, d), rand(1, h, s, d, grad=False)
    full = (q_full, k, v, dout_full)
    rows, exact = [], {}

    def add(name, pairs, fn, tensors, part):
        rows.append(dict(index=len(rows), name=name, pairs=pairs, fn=fn, tensors=tensors, part=part))

    def check(group, reference, candidates, tensors):  # this part's candidates only, against a flash reference
        if candidates:
            exact.setdefault(group, {}).update(_exactness(_on_flash(reference), candidates, tensors, group))

    for layout in args.layouts:
        if layout == "bhsd":
            tensors, wrap, suffix = full, (lambda fn: fn), ""
        else:  # the same numbers held as [s, b, heads, d]; output and its gradient [s, b, heads * d]
            tensors = tuple(t.detach().permute(2, 0, 1, 3).contiguous().requires_grad_() for t in (q_full, k, v))
            tensors += (dout_full.permute(2, 0, 1, 3).reshape(s, 1, h * d).contiguous(),)
            wrap, suffix = _megatron_layout, ", sbhd"
        add(f"single GPU causal ({s}){suffix}", causal_pairs(s), wrap(_single), tensors, "public")
        for n in args.chunks:
            add(f"single GPU, chunked forward ({n}){suffix}", causal_pairs(s), wrap(_chunked(n)), tensors, "private")
        candidates = ({"one SDPA call": wrap(_single)} if args.part == "public" else
                      {f"chunked forward ({n})": wrap(_chunked(n)) for n in args.chunks})
        check(f"single GPU{suffix}", wrap(_single), candidates, tensors)
    for cp in args.cp:
        for r in range(cp):
            local = (cp_shard(q_full.detach(), cp, r, dim=2).clone().requires_grad_(), k, v,
                     cp_shard(dout_full, cp, r, dim=2).clone())
            pairs = causal_pairs(s, cp, r)
            add(f"CP={cp} rank {r}, masked", pairs, _cp_row(cp, r, "masked"), local, "public")
            for kern in args.kernels:
                add(f"CP={cp} rank {r}, blocks ({kern})", pairs, _cp_row(cp, r, "blocks", kern), local, "private")
            candidates = ({"masked": _cp_row(cp, r, "masked")} if args.part == "public" else
                          {f"blocks ({kern})": _cp_row(cp, r, "blocks", kern) for kern in args.kernels})
            check(f"CP={cp} rank {r}", _cp_row(cp, r, "masked"), candidates, local)
    rows = [row for row in rows if row["part"] == args.part]
    for row in rows:  # warm-up and peak memory, one row after the other
        row.update(times=[], note="")
        try:
            _fwd_bwd(row["fn"], *row["tensors"])
            row["extra_gib"] = peak_extra_gib(row["fn"], row["tensors"])
        except torch.OutOfMemoryError:
            row["note"] = "OOM"
        except torch.AcceleratorError as exc:  # a device fault leaves the CUDA context unusable: name the row, stop
            print(f"bench/cp_attention.py: row {row['name']!r} faulted in its warm-up call: {_first_line(exc)}; "
                  "nothing was timed", file=sys.stderr)
            return 1
        except RuntimeError as exc:  # the row is left out of the timing and says why
            row["note"] = f"failed: {_first_line(exc)}"
        _reset(row["tensors"])
        torch.cuda.empty_cache()
    for _ in range(args.reps):  # timed calls, round-robin over the rows
        for row in rows:
            if not row["note"]:
                row["times"].append(time_ms(row["fn"], row["tensors"]))
                _reset(row["tensors"])
    args.part_out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, exactness=exact,
        rows=[{k_: row.get(k_) for k_ in ("index", "name", "pairs", "times", "extra_gib", "note")} for row in rows])))
    return 0


def _run_parts(args, argv: list[str]) -> tuple[list[dict], dict, dict] | None:
    """Run the public and the private part each in its own process; ``(rows in table order, exactness, header)``,
    None when a part failed (its stderr already printed)."""
    import subprocess
    import tempfile

    rows, exact, head = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for part in PARTS:
            out = Path(tmp) / f"{part}.json"
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--part", part,
                                   "--part-out", str(out)])
            if proc.returncode != 0:
                print(f"bench/cp_attention.py: the {part} part stopped with status {proc.returncode}", file=sys.stderr)
                return None
            got = json.loads(out.read_text())
            rows += got["rows"]
            for group, by_kernel in got["exactness"].items():
                exact.setdefault(group, {}).update(by_kernel)
            head = dict(device=got["device"], torch=got["torch"])
    return sorted(rows, key=lambda r: r["index"]), exact, head


def _print_table(args, rows: list[dict], exact: dict, head: dict) -> None:
    s, h, g, d = args.seq, args.heads, args.kv_heads, args.head_dim
    single_ms = statistics.median(t[1] for t in rows[0]["times"]) if rows[0]["times"] else None
    print(f"{head['device']}, torch {head['torch']}, S={s}, {h} q / {g} kv heads, head_dim {d}, bf16, batch 1, "
          f"fwd+bwd, median of {args.reps} round-robin reps per process; TFLOP/s = 3.5 x 4 b h d (causal pairs)")
    nan = float("nan")
    print(f"{'row':<40} {'fwd ms':>8} {'fwd TF/s':>8} {'ms':>8} {'TFLOP/s':>8} {'extra GiB':>9} {'x single':>8}  note")
    out_rows = []
    for row in rows:
        fwd_ms = statistics.median(t[0] for t in row["times"]) if row["times"] else None
        ms = statistics.median(t[1] for t in row["times"]) if row["times"] else None
        tflops = fwd_bwd_flops(row["pairs"], h, d) / ms / 1e9 if ms else None
        fwd_tflops = fwd_bwd_flops(row["pairs"], h, d) / 3.5 / fwd_ms / 1e9 if fwd_ms else None
        ratio = ms / single_ms if ms and single_ms else None
        extra = row.get("extra_gib")
        print(f"{row['name']:<40} {fwd_ms or nan:>8.1f} {fwd_tflops or nan:>8.0f} {ms or nan:>8.1f} "
              f"{tflops or nan:>8.0f} {extra if extra is not None else nan:>9.2f} {ratio or nan:>8.3f}  {row['note']}")
        out_rows.append(dict(row=row["name"], fwd_ms=fwd_ms, fwd_tflops=fwd_tflops, ms=ms, tflops=tflops,
                             extra_gib=extra, ratio_to_single=ratio, pairs=row["pairs"], note=row["note"]))
    print("exactness (max abs diff vs a flash-backend reference on the same inputs: the masked path for CP rows, "
          "one SDPA call for the single-GPU rows; bf16):")
    for rank, by_kernel in exact.items():
        for kern, diffs in by_kernel.items():
            print(f"  {rank}, {kern}: " + ", ".join(
                f"{k_}={v_:.3g}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in diffs.items()))
    if args.json:
        args.json.write_text(json.dumps(dict(rows=out_rows, exactness=exact), indent=1))


if __name__ == "__main__":
    sys.exit(main())
