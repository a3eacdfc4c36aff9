"""Context-parallel causal attention decomposed into blocks merged by log-sum-exp ("blocks" method).

A CP rank holds two load-balanced query chunks of ``L`` tokens (global chunk indices from
:func:`sftprof.data.cp_chunk_ids`). Chunk ``c`` attends to keys ``[0, (c + 1) L)`` under the causal mask,
which splits into

- the diagonal block: keys ``[c L, (c + 1) L)``, a square causal block (``is_causal`` with ``s_q == s_k``),
- the off-diagonal block: keys ``[0, c L)``, no mask (absent for ``c = 0``).

Each block returns its output ``O_i`` (softmax over its own keys) and the row log-sum-exp ``lse_i`` of its
scaled scores; the chunk's result is the standard online-softmax merge (flash-attention's rescaling):
``lse = logsumexp_i(lse_i)``, ``O = sum_i exp(lse_i - lse) * O_i``. The backward gives every block the
MERGED ``O`` and ``lse`` (then ``exp(S_i - lse)`` is the block's slice of the chunk's true softmax, and
``rowsum(dO * O)`` the chunk's true correction term), so each block's ``dQ/dK/dV`` is its exact share:
``dQ`` sums over the blocks, ``dK/dV`` accumulate (fp32) into the full-sequence K/V gradient.

Block kernels (:data:`BLOCK_KERNELS`), each ``forward(q, k, v, causal, scale) -> (out, lse, aux)`` and
``backward(dout, q, k, v, out, lse, aux, causal, scale) -> (dq, dk, dv)`` on ``[b, h, n, d]`` tensors with
as many K/V heads as query heads (GQA K/V are expanded with ``repeat_interleave`` before the call and
their gradients summed back over each group; ``cudnn_gqa`` / ``flash_gqa`` are the same ops given the
GQA K/V as they are), ``lse`` ``[b, h, n]``:

- ``cudnn``: ``torch.ops.aten._scaled_dot_product_cudnn_attention`` (``compute_log_sumexp=True``) and
  ``_scaled_dot_product_cudnn_attention_backward``, the kernels of SDPA's cuDNN backend;
- ``flash``: ``torch.ops.aten._scaled_dot_product_flash_attention`` and ``..._backward`` (FA2);
- ``math``: explicit scores in at least fp32 with the exact backward
  ``dS = P * (dP - rowsum(dO * O))``, ``dQ = dS K * scale``, ``dK = dS^T Q * scale``, ``dV = P^T dO``
  (the reference, and the CPU path).

The schemas of the private ops are the same in torch 2.11 (the GPU machine) and 2.13 (checked with
``torch.ops.aten.<op>.default._schema``; torch 2.13's ring attention in
``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` calls them the same way).
Dropout is not supported (the blocks would need one shared random stream).

Layouts (what the ``cudnn``/``flash`` wrappers copy, and why the rest is safe). megatron-core's tensors are
``[s, b, heads, d]``; :class:`sftprof.models.layers.attention.SDPACoreAttention` hands over their permuted
``[b, heads, s, d]`` views, and value is often a strided slice of the fused QKV projection.

- Q, K, V (and their row slices) are passed as they are when their last dimension is contiguous and their
  data pointer and other strides are multiples of 16 bytes (:func:`kernel_input`; the kernels load 16-byte
  vectors); anything else is copied with ``.contiguous()``. Both ops describe each input to the kernel by its own
  strides (the cuDNN op builds its cuDNN graph from them, the flash op passes batch, row and head strides), and
  torch's SDPA dispatch hands these ops exactly such views in the plain ``is_causal`` call: the layout
  requirement it checks for these backends is a unit last stride.
- The output of each forward op is allocated by the op "like Q": Q's strides when Q is non-overlapping and
  dense (a permuted view of a contiguous tensor, or a row slice of one whose sequence dimension is outermost),
  else contiguous. :func:`chunked_causal_attention` allocates its merged output the same way, so megatron's
  ``out.permute(2, 0, 1, 3).reshape(s, b, -1)`` is a view, not a copy.
- The cuDNN backward is given O and dO in exactly that layout (:func:`with_output_layout`: passed as they are
  when all their strides, those of size-1 dimensions included, already match and they are 16-byte aligned,
  copied otherwise) and the log-sum-exp contiguous and 16-byte aligned. The reason, from torch's
  cuDNN SDPA source (its MHA.cpp, as read for this change): it caches one cuDNN backward graph per Q/K/V
  shape-and-stride combination, but the graph also fixes the strides of O, dO and the log-sum-exp, which are
  not part of that cache key, so a later call with the same Q/K/V layout and O or dO in another layout would
  run the cached graph on wrongly strided memory, silently. With O and dO always in the layout that follows
  from Q's (the layout SDPA's own backward sees when dO arrives in O's strides, as megatron's
  ``[s, b, heads * d]`` output gradient does), every call for one Q/K/V layout builds the same graph. cuDNN
  releases before 9.26 also do not handle softmax statistics outside ``[b, h, s]`` order (cuDNN frontend now
  rejects them there), hence the contiguous log-sum-exp. These two are the likely causes of the wrong results
  torch's own ring attention reports when its K/V or log-sum-exp are not contiguous (for K/V its comment says
  the cause was not found). dQ/dK/dV are allocated by the op like Q/K/V, so megatron gets its gradients in its
  own layout.
- The flash backward makes O and dO contiguous itself (in its ``[b, s, heads, d]`` view: no copy for megatron's
  layout at batch 1), so its wrapper passes them as they are.
- One process, one kind of cuDNN caller per Q/K/V shape: SDPA's public op and these private ops share that cache,
  and the public op's backward does not see O/dO as these wrappers hand them over. Measured on an H200 (torch
  2.11): a square causal call of the public op (the ``masked`` path's first chunk) and a diagonal block of
  ``blocks`` on the same shapes in one process gave whichever ran second wrong gradients (dq off by ~2x its scale),
  and at 32K+ tokens an illegal memory access (bench/NOTES.md, fifteenth session). Training runs one method per
  process (``actor.megatron.cp_attention``; at CP=1 the chunked forward or the one public call for every layer of
  a shape); ``bench/cp_attention.py`` runs the two kinds of row in separate processes.

Memory beyond the masked path, per call: the expanded K/V of the largest block and, in the backward,
their expanded gradients (``2 * b * h * n_keys * d`` elements each; neither with the ``_gqa`` kernels), the
fp32 K/V gradient accumulators (``2 * b * g * S * d * 4`` bytes) and the fp32 merge of one chunk
(``b * h * L * d * 4`` bytes).

Above 500 lines for a reason: three autograd Functions (single GPU, chunked forward, overlapped CP) share the
block plan, the kernels and the log-sum-exp merge; apart, each would import the others' internals.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from sftprof.data import cp_chunk_ids


class Block(NamedTuple):
    """Keys ``[lo, hi)`` of one query chunk's block; ``causal``: square causal mask (diagonal block)."""

    lo: int
    hi: int
    causal: bool


def chunk_blocks(chunk: int, length: int) -> list[Block]:
    """The blocks of query chunk ``chunk`` (``length`` tokens): the diagonal block, then the off-diagonal one.

    Chunk 0 has no off-diagonal block. Raises ValueError for a negative chunk or a length < 1.
    """
    if chunk < 0 or length < 1:
        raise ValueError(f"chunk_blocks: chunk {chunk} must be >= 0 and length {length} >= 1")
    blocks = [Block(chunk * length, (chunk + 1) * length, True)]
    if chunk > 0:
        blocks.append(Block(0, chunk * length, False))
    return blocks


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-block attention results over disjoint key sets by log-sum-exp.

    Args:
        parts: ``(out_i [b, h, n, d], lse_i [b, h, n])``; ``lse_i`` in fp32 or fp64, ``-inf`` for a block with
            no keys (its ``out_i`` must be finite, e.g. zeros: it then contributes nothing).
        out: optional ``[b, h, n, d]`` tensor (any strides, e.g. a row slice of a preallocated output) that
            receives the merged output, converted to its dtype.
    Returns:
        ``(out [b, h, n, d]`` in the dtype of ``out_0`` (``out`` itself when given), ``lse [b, h, n]`` in the
        dtype of ``lse_0``): ``lse = logsumexp_i(lse_i)``, ``out = sum_i exp(lse_i - lse) * out_i`` (computed in
        ``lse``'s dtype). One part is returned as it is (copied into ``out`` when given).
    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("merge_partials: no blocks to merge")
    if len(parts) == 1:
        return parts[0] if out is None else (out.copy_(parts[0][0]), parts[0][1])
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    acc = None
    for o, part_lse in parts:  # one [b, h, n, d] buffer in lse's dtype; the parts are left as they are
        weight = torch.exp(part_lse - lse).unsqueeze(-1)
        acc = torch.mul(o, weight) if acc is None else acc.addcmul_(o, weight)
    return (acc.to(parts[0][0].dtype) if out is None else out.copy_(acc)), lse


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _math_scores(q, k, causal, scale):
    acc = _acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    s = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.to(s.dtype)).to(q.dtype), lse, None


def _math_backward(dout, q, k, v, out, lse, aux, causal, scale):
    s = _math_scores(q, k, causal, scale)
    acc = s.dtype
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    do = dout.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(acc).transpose(-1, -2))
    ds = p * (dp - (do * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _native_lse(lse: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    # [b, h, n] -> the op's own lse shape ([b, h, n] or [b, h, n, 1]), contiguous and 16-byte aligned
    lse = lse.reshape(shape).contiguous()
    return lse if lse.data_ptr() % 16 == 0 else lse.clone()


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when the ``cudnn``/``flash`` block kernels read it in place, else ``x.contiguous()``.

    In place: the last dimension has stride 1, and the data pointer and the strides of the other dimensions
    (those of size > 1) are nonzero multiples of 16 bytes, e.g. megatron's permuted ``[s, b, heads, d]`` views, a
    slice of the fused QKV projection, or a row slice of either (see the module docstring for why that is safe).
    A broadcast (stride 0) or misaligned tensor is copied.
    """
    size = x.element_size()
    aligned = x.data_ptr() % 16 == 0 and all(st != 0 and st * size % 16 == 0
                                             for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)
    return x if x.stride(-1) == 1 and aligned else x.contiguous()


def with_output_layout(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x`` (shaped like ``q``) in the layout of a tensor allocated like ``q``: ``q``'s strides when ``q`` is
    non-overlapping and dense, else contiguous (``torch.empty_like``'s rule, the one SDPA's forward ops apply to
    their output). ``x`` itself when ALL its strides match, those of size-1 dimensions included, and its data
    pointer is a multiple of 16 bytes; else a copy (16-byte aligned, as every new allocation).

    Why all strides: the cuDNN backward graph takes O's and dO's strides as given, size-1 dimensions included, and
    a cached graph is reused for any later call with the same Q/K/V (module docstring, "Layouts"); so every call
    must hand over the very same O/dO strides. Why the alignment: the kernels load 16-byte vectors, and a dO with
    O's strides but an odd storage offset is a misaligned-address fault (pytorch/pytorch#191576 and cuDNN
    frontend's own torch op copy dO for either reason; cited as read, not as files of this repository).
    """
    want = torch.empty_like(q, device="meta").stride()
    if tuple(x.stride()) == tuple(want) and x.data_ptr() % 16 == 0:
        return x
    return torch.empty_like(q, dtype=x.dtype).copy_(x)


def _cudnn_forward(q, k, v, causal, scale):
    q, k, v = kernel_input(q), kernel_input(k), kernel_input(v)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3]), (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, aux, causal, scale):
    lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
    q, k, v = kernel_input(q), kernel_input(k), kernel_input(v)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        with_output_layout(dout, q), q, k, v, with_output_layout(out, q), _native_lse(lse, lse_shape), seed, offset,
        None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


def _flash_forward(q, k, v, causal, scale):
    q, k, v = kernel_input(q), kernel_input(k), kernel_input(v)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3]), (lse.shape, cum_q, cum_k, max_q, max_k, rng_state, unused)


def _flash_backward(dout, q, k, v, out, lse, aux, causal, scale):
    # the op makes dout and out contiguous in its [b, s, h, d] view itself
    lse_shape, cum_q, cum_k, max_q, max_k, rng_state, unused = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, kernel_input(q), kernel_input(k), kernel_input(v), out, _native_lse(lse, lse_shape), cum_q, cum_k,
        max_q, max_k, 0.0, causal, rng_state, unused, scale=scale)


class BlockKernel(NamedTuple):
    """A block attention kernel: ``forward`` returns ``(out, lse [b, h, n], aux)``; ``backward`` the input grads.

    ``native_gqa``: the kernel takes K/V with fewer heads than Q (``h`` a multiple of ``g``) and returns their
    gradients with ``g`` heads; otherwise the caller expands K/V to ``h`` heads and sums the gradients back.
    """

    forward: Callable
    backward: Callable
    native_gqa: bool = False


BLOCK_KERNELS = {
    "cudnn": BlockKernel(_cudnn_forward, _cudnn_backward),
    "flash": BlockKernel(_flash_forward, _flash_backward),
    # the same ops given GQA K/V as they are: SDPA's own dispatch hands GQA K/V to both without expansion
    # (cuDNN since torch 2.7, pytorch/pytorch#150337); not the default until measured on the GPU
    "cudnn_gqa": BlockKernel(_cudnn_forward, _cudnn_backward, native_gqa=True),
    "flash_gqa": BlockKernel(_flash_forward, _flash_backward, native_gqa=True),
    "math": BlockKernel(_math_forward, _math_backward),
}


def default_block_kernel(q: torch.Tensor) -> str:
    """The block kernel for ``q``: ``math`` unless ``q`` is an fp16/bf16 CUDA tensor; then ``cudnn`` when SDPA's
    cuDNN backend is enabled and cuDNN is available, else ``flash``, each as its ``_gqa`` form (GQA K/V passed
    as they are) from torch 2.7 on.

    Why ``_gqa`` and cuDNN: ``bench/cp_attention.py`` on one H200 (torch 2.11, bench/NOTES.md), CP = 2 rank 0 of
    a 131072-token Qwen3-30B-A3B attention, fwd+bwd: ``cudnn_gqa`` 458 ms and 4.95 GiB extra, ``cudnn`` 472 ms
    and 6.52 GiB (the K/V expansion), ``flash_gqa`` 769 ms, ``flash`` 776 ms; all within bf16 rounding of the
    masked path. Before torch 2.7 the cuDNN op did not take unequal head counts (pytorch/pytorch#150337).
    """
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return "math"
    kernel = "cudnn" if torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled() else "flash"
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return f"{kernel}_gqa" if (major, minor) >= (2, 7) else kernel


def _expansion(q: torch.Tensor, k: torch.Tensor, kernel: str) -> int:
    # how many times each K/V head is repeated before the kernel call (1: none)
    return 1 if BLOCK_KERNELS[kernel].native_gqa else q.shape[1] // k.shape[1]


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _reduce_group(grad: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    if group == 1:
        return grad.to(dtype)
    return grad.unflatten(1, (grad.shape[1] // group, group)).sum(2, dtype=dtype)


def _blocks_forward(q, k, v, chunks, length, scale, kernel, out=None):
    """Forward of query chunks ``chunks`` (``length`` rows each, in ``q``'s row order) as merged blocks:
    ``(out [b, h, n, d], lse [b, h, n] fp32, auxes)`` with one ``aux`` per block in :func:`chunk_blocks` order.
    ``out``: optional preallocated ``[b, h, n, d]`` output (any strides); each chunk's merge is written into its
    rows and ``out`` is returned (default: a new contiguous tensor)."""
    fwd = BLOCK_KERNELS[kernel].forward
    group = _expansion(q, k, kernel)
    outs, lses, auxes = [], [], []
    for j, chunk in enumerate(chunks):
        rows = slice(j * length, (j + 1) * length)
        qj = q[:, :, rows]
        parts = []
        for blk in chunk_blocks(chunk, length):
            o, lse, aux = fwd(qj, _expand(k[:, :, blk.lo:blk.hi], group), _expand(v[:, :, blk.lo:blk.hi], group),
                              blk.causal, scale)
            parts.append((o, lse))
            auxes.append(aux)
        o, lse = merge_partials(parts, out=None if out is None else out[:, :, rows])
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=2) if out is None else out, torch.cat(lses, dim=2), auxes


class _BlockwiseCausalAttention(torch.autograd.Function):
    """Forward/backward of :func:`blockwise_cp_attention` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, chunks, length, scale, kernel):
        out, lse, auxes = _blocks_forward(q, k, v, chunks, length, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.length, ctx.scale, ctx.kernel, ctx.auxes = chunks, length, scale, kernel, auxes
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        bwd = BLOCK_KERNELS[ctx.kernel].backward
        length, group = ctx.length, _expansion(q, k, ctx.kernel)
        acc = _acc_dtype(k.dtype)
        dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
        dqs, auxes = [], iter(ctx.auxes)
        for j, chunk in enumerate(ctx.chunks):
            rows = slice(j * length, (j + 1) * length)
            qj, oj, doj, lsej = q[:, :, rows], out[:, :, rows], dout[:, :, rows], lse[:, :, rows]
            dq = None
            for blk in chunk_blocks(chunk, length):
                dq_b, dk_b, dv_b = bwd(doj, qj, _expand(k[:, :, blk.lo:blk.hi], group),
                                       _expand(v[:, :, blk.lo:blk.hi], group), oj, lsej, next(auxes), blk.causal,
                                       ctx.scale)
                dq = dq_b.to(acc) if dq is None else dq.add_(dq_b)
                dk[:, :, blk.lo:blk.hi] += _reduce_group(dk_b, group, acc)
                dv[:, :, blk.lo:blk.hi] += _reduce_group(dv_b, group, acc)
            dqs.append(dq)
        return torch.cat(dqs, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _full_call_aux(aux, b: int, h: int, s: int):
    # the aux of one causal call over the whole sequence, from the aux of a diagonal block (same kernel): the
    # op's lse shape with s rows and max_q = max_k = s; cumulative lengths and random state as the block's
    # (dense inputs, no dropout). The math kernel has no aux.
    if aux is None:
        return None
    lse_shape = torch.Size((b, h, s) + tuple(aux[0][3:]))
    return (lse_shape, aux[1], aux[2], s, s) + tuple(aux[5:])


class _ChunkedForwardCausalAttention(torch.autograd.Function):
    """Forward/backward of :func:`chunked_causal_attention` (see there)."""

    @staticmethod
    def forward(ctx, q, k, v, n_chunks, scale, kernel):
        # the output is allocated like q, as the kernels allocate theirs (module docstring: layouts)
        out, lse, auxes = _blocks_forward(q, k, v, list(range(n_chunks)), q.shape[2] // n_chunks, scale, kernel,
                                          out=torch.empty_like(q))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.aux = _full_call_aux(auxes[0], q.shape[0], q.shape[1], q.shape[2])
        ctx.scale, ctx.kernel = scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = _expansion(q, k, ctx.kernel)
        dq, dk, dv = BLOCK_KERNELS[ctx.kernel].backward(dout, q, _expand(k, group), _expand(v, group), out, lse,
                                                        ctx.aux, True, ctx.scale)
        return dq, _reduce_group(dk, group, k.dtype), _reduce_group(dv, group, v.dtype), None, None, None


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunks: int,
                             scale: Optional[float] = None, kernel: Optional[str] = None) -> torch.Tensor:
    """Single-device causal attention: the forward as blocks, the backward as one causal call (autograd-aware).

    The sequence is cut into ``chunks`` query chunks of ``L = S / chunks`` rows; chunk ``c``'s forward is its causal
    diagonal block plus one unmasked block over keys ``[0, c L)``, merged by log-sum-exp (:func:`merge_partials`),
    so ``(chunks - 1) / chunks`` of the causal work runs in unmasked blocks. The backward is ONE causal call of the
    kernel's backward over the whole sequence, given the merged output and log-sum-exp: the backward only needs
    ``(dO, Q, K, V, O, lse)``, and those are the single call's up to rounding, so the gradients are the exact
    gradients of causal attention (the reasoning of the module docstring, with one block). Why: on an H200 the
    cuDNN forward runs unmasked blocks faster than the causal call (bench/NOTES.md, tenth session), while its
    causal backward is as fast as the blocks'.

    Args:
        q: ``[b, h, S, d]``; k, v: ``[b, g, S, d]`` (``h`` a multiple of ``g``: GQA), natural order; any strides
            (megatron's permuted ``[S, b, heads, d]`` views are read in place, see the module docstring).
        chunks: number of query chunks (>= 1; ``S`` a multiple of it). 1 is one causal call each way.
        scale: softmax scale (default ``1/sqrt(d)``).
        kernel: a key of :data:`BLOCK_KERNELS` (default :func:`default_block_kernel`).
    Returns:
        ``[b, h, S, d]`` in ``q``'s dtype, allocated like ``q`` (``torch.empty_like``: ``q``'s strides when ``q`` is
        non-overlapping and dense), so for ``q`` a permuted view of a contiguous ``[S, b, h, d]`` tensor
        ``out.permute(2, 0, 1, 3).reshape(S, b, h * d)`` is a view. Its gradient may come in any layout.
    Memory beyond one causal call: the forward's block outputs and the fp32 merge of one chunk
    (``b * h * L * d * 4`` bytes), released before it returns.
    Raises:
        ValueError: an unknown kernel, ``chunks`` < 1 or not dividing ``S``, query/key lengths that differ, or
            query heads not a multiple of the K/V heads.
    """
    kernel = default_block_kernel(q) if kernel is None else kernel
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"chunked_causal_attention: kernel={kernel!r}: must be one of {list(BLOCK_KERNELS)}")
    if not isinstance(chunks, int) or chunks < 1 or q.shape[2] % chunks:
        raise ValueError(f"actor.megatron.attention_forward_chunks={chunks!r}: must be an integer >= 1 dividing the "
                         f"sequence length {q.shape[2]}")
    if q.shape[2] != k.shape[2] or k.shape != v.shape or q.shape[1] % k.shape[1]:
        raise ValueError(f"chunked_causal_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "need equal lengths, k and v alike, query heads a multiple of the K/V heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _ChunkedForwardCausalAttention.apply(q, k, v, chunks, scale, kernel)


def _chunk_owners(cp_size: int) -> dict[int, tuple[int, int]]:
    # global chunk index -> (the CP rank that holds it, its position 0 or 1 among that rank's two chunks)
    return {c: (r, j) for r in range(cp_size) for j, c in enumerate(cp_chunk_ids(cp_size, r))}


def _natural_kv(recv: torch.Tensor, cp_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    # recv [cp, 2, 2 L, b, g, d] (rank r's K rows then V rows, its two chunks each) -> K, V [S, b, g, d] natural order
    where = _chunk_owners(cp_size)
    order = [where[c] for c in range(2 * cp_size)]
    return tuple(torch.cat([recv[r, t, j * length:(j + 1) * length] for r, j in order]) for t in (0, 1))


class _OverlappedCPBlocks(torch.autograd.Function):
    """Forward/backward of :func:`overlapped_cp_attention` (see there)."""

    @staticmethod
    def forward(ctx, q, k_loc, v_loc, group, scale, kernel):
        cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        chunks, length = cp_chunk_ids(cp, rank), q.shape[2] // 2
        fwd, gqa = BLOCK_KERNELS[kernel].forward, _expansion(q, k_loc, kernel)
        # one all-gather of [K rows; V rows] ([2 s_local, b, g, d]), in flight during the diagonal blocks
        send = torch.cat((k_loc.permute(2, 0, 1, 3), v_loc.permute(2, 0, 1, 3)))
        recv = send.new_empty((cp,) + send.shape)
        work = torch.distributed.all_gather_into_tensor(recv.view((-1,) + send.shape[1:]), send, group=group,
                                                        async_op=True)
        rows = [slice(j * length, (j + 1) * length) for j in range(2)]
        diag = [fwd(q[:, :, r], _expand(k_loc[:, :, r], gqa), _expand(v_loc[:, :, r], gqa), True, scale)
                for r in rows]
        work.wait()
        k_full, v_full = (t.permute(1, 2, 0, 3) for t in _natural_kv(recv.view(cp, 2, -1, *send.shape[1:]), cp,
                                                                      length))
        del recv
        out = torch.empty_like(q)  # q's layout (megatron's [s, b, h, d] order): the caller's flatten is a view
        lses, off_aux = [], []
        for j, c in enumerate(chunks):
            parts = [diag[j][:2]]
            if c > 0:
                o, lse, aux = fwd(q[:, :, rows[j]], _expand(k_full[:, :, :c * length], gqa),
                                  _expand(v_full[:, :, :c * length], gqa), False, scale)
                parts.append((o, lse))
                off_aux.append(aux)
            lses.append(merge_partials(parts, out=out[:, :, rows[j]])[1])
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k_loc, v_loc, k_full, v_full, out, lse)
        ctx.group, ctx.chunks, ctx.length, ctx.scale, ctx.kernel = group, chunks, length, scale, kernel
        ctx.diag_aux, ctx.off_aux = [d[2] for d in diag], off_aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_loc, v_loc, k_full, v_full, out, lse = ctx.saved_tensors
        bwd, gqa, length = BLOCK_KERNELS[ctx.kernel].backward, _expansion(q, k_loc, ctx.kernel), ctx.length
        cp, acc = torch.distributed.get_world_size(ctx.group), _acc_dtype(k_loc.dtype)
        rows = [slice(j * length, (j + 1) * length) for j in range(2)]
        # off-diagonal blocks first: their K/V gradients (keys of every rank) go into one fp32 reduce-scatter,
        # in flight during the diagonal blocks, whose K/V gradients are this rank's own rows
        send = torch.zeros((cp, 2, 2 * length) + tuple(k_loc.permute(2, 0, 1, 3).shape[1:]), dtype=acc,
                           device=k_loc.device)
        where = _chunk_owners(cp)
        dqs, off_aux = [None, None], iter(ctx.off_aux)
        for j, c in enumerate(ctx.chunks):
            if c == 0:
                continue
            dq, dk, dv = bwd(dout[:, :, rows[j]], q[:, :, rows[j]], _expand(k_full[:, :, :c * length], gqa),
                             _expand(v_full[:, :, :c * length], gqa), out[:, :, rows[j]], lse[:, :, rows[j]],
                             next(off_aux), False, ctx.scale)
            dqs[j] = dq.to(acc)
            for t, grad in ((0, dk), (1, dv)):
                grad = _reduce_group(grad, gqa, acc)  # [b, g, c L, d]
                for key_chunk in range(c):
                    r, i = where[key_chunk]
                    send[r, t, i * length:(i + 1) * length] += grad[:, :, key_chunk * length:(key_chunk + 1)
                                                                    * length].permute(2, 0, 1, 3)
        recv = send.new_empty(send.shape[1:])
        work = torch.distributed.reduce_scatter_tensor(recv.view((-1,) + send.shape[3:]),
                                                       send.view((-1,) + send.shape[3:]), group=ctx.group,
                                                       async_op=True)
        diag_grads = []
        for j in range(2):
            dq, dk, dv = bwd(dout[:, :, rows[j]], q[:, :, rows[j]], _expand(k_loc[:, :, rows[j]], gqa),
                             _expand(v_loc[:, :, rows[j]], gqa), out[:, :, rows[j]], lse[:, :, rows[j]],
                             ctx.diag_aux[j], True, ctx.scale)
            dqs[j] = dq.to(acc) if dqs[j] is None else dqs[j].add_(dq)
            diag_grads.append((_reduce_group(dk, gqa, acc), _reduce_group(dv, gqa, acc)))
        work.wait()
        dk_loc, dv_loc = (recv[t].permute(1, 2, 0, 3) + torch.cat([g[t] for g in diag_grads], dim=2)
                          for t in (0, 1))
        return torch.cat(dqs, dim=2).to(q.dtype), dk_loc.to(k_loc.dtype), dv_loc.to(v_loc.dtype), None, None, None


def overlapped_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                            scale: Optional[float] = None, kernel: Optional[str] = None) -> torch.Tensor:
    """This CP rank's causal attention from its LOCAL K/V, the CP communication overlapped with the diagonal blocks.

    The same blocks and merge as :func:`blockwise_cp_attention`, but it does the K/V all-gather itself so that
    the work that needs only this rank's own tokens runs while the collective is in flight:

    - forward: one asynchronous all-gather of this rank's ``[K; V]`` rows is issued, then the two diagonal
      (causal) blocks run on the local K/V; after the wait, the off-diagonal blocks run on the gathered K/V;
    - backward: the off-diagonal blocks run first and their K/V gradients (keys of every rank) go into one
      asynchronous fp32 reduce-scatter; the diagonal blocks run while it is in flight, and their K/V gradients
      (this rank's own keys) are added to its result.

    On NCCL an asynchronous collective runs on the process group's own stream, so the block kernels issued
    after it run concurrently with it; a rank that arrives at the collective before its peers computes instead of
    waiting. Exact: the K/V gradient of a key is the fp32 sum of every block's share (module docstring).

    Args:
        q: ``[b, h, S/cp, d]``: this rank's query chunks ``cp_chunk_ids(cp, rank)`` in that order.
        k, v: ``[b, g, S/cp, d]``: this rank's key/value rows, same chunks and order (``h`` a multiple of ``g``).
        group: the CP process group (its size and this rank's rank in it give the layout).
        scale: softmax scale (default ``1/sqrt(d)``).
        kernel: a key of :data:`BLOCK_KERNELS` (default :func:`default_block_kernel`).
    Returns:
        ``[b, h, S/cp, d]`` in ``q``'s dtype and layout (``torch.empty_like(q)``): those rows of full causal
        attention over the whole sequence.
    Memory beyond :func:`blockwise_cp_attention`'s: the ``[K; V]`` send buffer (``2 * S/cp * b * g * d``
    elements) during the forward, and fp32 reduce-scatter buffers (``2 * S * b * g * d * 4`` bytes in,
    ``1/cp`` of that out) in the backward.
    Raises:
        ValueError: an unknown kernel; an odd local length, or K/V rows different from the query rows; query
            heads not a multiple of the K/V heads.
    """
    kernel = default_block_kernel(q) if kernel is None else kernel
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"overlapped_cp_attention: kernel={kernel!r}: must be one of {list(BLOCK_KERNELS)}")
    if q.shape[2] % 2 or k.shape[2] != q.shape[2] or k.shape != v.shape or q.shape[1] % k.shape[1]:
        raise ValueError(f"overlapped_cp_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "need an even local length, K/V rows equal to the query rows, k and v alike, query heads "
                         "a multiple of the K/V heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _OverlappedCPBlocks.apply(q, k, v, group, scale, kernel)


def check_cp_lengths(s_local: int, s_full: int, cp_size: int) -> int:
    """Return ``s_local`` after checking that this CP rank's ``s_local`` queries are two equal load-balanced chunks
    of a sequence of ``s_full`` keys; raises ValueError naming the three numbers otherwise."""
    if s_local * cp_size != s_full or s_local % 2:
        raise ValueError(f"context parallel: local queries {s_local} x cp_size {cp_size} must equal keys {s_full}, "
                         "and the local length must be even (two chunks)")
    return s_local


def blockwise_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_size: int, cp_rank: int,
                           scale: Optional[float] = None, kernel: Optional[str] = None) -> torch.Tensor:
    """This CP rank's causal attention as diagonal + off-diagonal blocks merged by log-sum-exp (autograd-aware).

    Args:
        q: ``[b, h, S/cp_size, d]``: this rank's query chunks ``cp_chunk_ids(cp_size, cp_rank)`` in that order.
        k, v: ``[b, g, S, d]`` in natural sequence order, ``h`` a multiple of ``g`` (GQA).
        cp_size, cp_rank: CP group size (>= 1) and rank.
        scale: softmax scale (default ``1/sqrt(d)``).
        kernel: a key of :data:`BLOCK_KERNELS` (default :func:`default_block_kernel`).
    Returns:
        ``[b, h, S/cp_size, d]`` in ``q``'s dtype, rows in the order of ``q``; equal to those rows of full
        causal attention (the math kernel computes in at least fp32).
    Raises:
        ValueError: an unknown kernel, or shapes inconsistent with the layout (local length x cp_size !=
            keys, odd local length, query heads not a multiple of K/V heads).
    """
    kernel = default_block_kernel(q) if kernel is None else kernel
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"blockwise_cp_attention: kernel={kernel!r}: must be one of {list(BLOCK_KERNELS)}")
    s_local = check_cp_lengths(q.shape[2], k.shape[2], cp_size)
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"blockwise_cp_attention: {q.shape[1]} query heads must be a multiple of the K/V heads "
                         f"({k.shape[1]} K, {v.shape[1]} V, equal)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockwiseCausalAttention.apply(q, k, v, cp_chunk_ids(cp_size, cp_rank), s_local // 2, scale, kernel)
