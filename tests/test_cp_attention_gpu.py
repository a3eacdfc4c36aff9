"""GPU test: SDPACoreAttention with context parallelism on 2 GPUs equals single-GPU attention.

The test launches this file under ``torchrun --nproc-per-node 2``; each rank builds the same random
bf16 Q/K/V ``[S, b, heads, d]`` (GQA 8 q / 2 kv heads, head_dim 128), runs single-GPU SDPA causal
attention on the full sequence and the CP=2 module on its load-balanced shard, and compares outputs
and the Q/K/V input gradients of its shard (bf16 tolerance). Cases: ``actor.megatron.cp_attention``
``masked``, ``blocks`` (the default block kernel, ``cudnn_gqa`` where SDPA's cuDNN backend is enabled), and
``blocks`` with SDPA's cuDNN backend disabled (``flash_gqa``, the fallback), both with the CP communication
overlapped (``actor.megatron.cp_comm_overlap``, the default), and ``blocks`` without the overlap (``-serial``).

A one-GPU test runs the CUDA block kernels (``cudnn``, ``flash``, and the same ops without the GQA
expansion, ``cudnn_gqa``, ``flash_gqa``) of every simulated CP rank (CP=2 and 4, no
process group) against SDPA's single-call causal attention: each rank's output and query gradient, and
the K/V gradients summed over the ranks. Another runs the single-GPU chunked forward
(``chunked_causal_attention``, every CUDA block kernel, 2 and 4 chunks) against the same single call. Two more
feed megatron-core's layout (permuted views of ``[s, b, heads, d]`` tensors, batch 1 and 2, K/V also as the
strided halves of one fused tensor, dout as ``[s, b, heads * d]``) to the chunked forward of every CUDA block
kernel and to ``SDPACoreAttention`` (CP = 1, forward_chunks 2), against SDPA's single causal call on contiguous
copies, and check that the output comes back in ``[s, b, heads, d]`` order (the module's flatten is a view). One
checks that the cuDNN kernel's backward gives the same gradients for O/dO in Q's layout or contiguous.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sftprof.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def _worker(out_path: str, case: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    from sftprof.data import cp_shard
    from sftprof.models.layers.attention import SDPACoreAttention
    from sftprof.models.layers.block_attention import default_block_kernel

    if case == "blocks-flash":
        torch.backends.cuda.enable_cudnn_sdp(False)
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    cp = dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, b, h, g, d = 8192, 1, 8, 2, 128

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v, dout = rand(s, b, h, d), rand(s, b, g, d), rand(s, b, g, d), rand(s, b, h * d)
    config = SimpleNamespace(attention_dropout=0.0, context_parallel_size=cp)
    full_mod = SDPACoreAttention(SimpleNamespace(attention_dropout=0.0, context_parallel_size=1), 1,
                                 AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=None))
    cp_mod = SDPACoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=dist.group.WORLD),
                               cp_attention=case.split("-")[0], cp_comm_overlap=not case.endswith("-serial"))
    fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = full_mod(fq, fk, fv, None)
    ref.backward(dout)
    lq, lk, lv = (cp_shard(t, cp, rank, dim=0).requires_grad_() for t in (q, k, v))
    out = cp_mod(lq, lk, lv, None)
    out.backward(cp_shard(dout, cp, rank, dim=0))
    errs = {"block_kernel": default_block_kernel(q)}
    for name, got, want in [("out", out, ref), ("dq", lq.grad, fq.grad), ("dk", lk.grad, fk.grad),
                            ("dv", lv.grad, fv.grad)]:
        want = cp_shard(want.detach(), cp, rank, dim=0)
        errs[name] = float((got.float() - want.float()).abs().max())
        errs[name + "_scale"] = float(want.float().abs().max())
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    if rank == 0:
        Path(out_path).write_text(json.dumps(errs))
    dist.destroy_process_group()


def _single_call_case(seed: int, device: str = "cuda"):
    """``(q [1, 8, 4096, 128], k, v [1, 2, 4096, 128], dout [1, 8, 4096, 128], ref, (fq, fk, fv))``: seeded bf16
    inputs, and SDPA's single causal GQA call ``ref`` on leaf copies ``fq, fk, fv`` whose grads hold its backward."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)
    b, h, g, s, d = 1, 8, 2, 4096, 128

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    q, k, v, dout = rand(b, h, s, d), rand(b, g, s, d), rand(b, g, s, d), rand(b, h, s, d)
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    return q, k, v, dout, ref, leaves


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "cudnn_gqa", "flash_gqa"])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_block_kernels_match_single_call_one_gpu(kernel, cp_size):
    from sftprof.data import cp_shard
    from sftprof.models.layers.block_attention import blockwise_cp_attention

    q, k, v, dout, ref, (fq, fk, fv) = _single_call_case(cp_size)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for r in range(cp_size):
        lq, lk, lv = cp_shard(q, cp_size, r, dim=2).requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()
        out = blockwise_cp_attention(lq, lk, lv, cp_size=cp_size, cp_rank=r, kernel=kernel)
        out.backward(cp_shard(dout, cp_size, r, dim=2))
        torch.testing.assert_close(out, cp_shard(ref.detach(), cp_size, r, dim=2), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lq.grad, cp_shard(fq.grad, cp_size, r, dim=2), rtol=2e-2, atol=2e-2)
        dk += lk.grad.float()
        dv += lv.grad.float()
    torch.testing.assert_close(dk, fk.grad.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dv, fv.grad.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "cudnn_gqa", "flash_gqa"])
@pytest.mark.parametrize("chunks", [2, 4])
def test_chunked_forward_matches_single_call_one_gpu(kernel, chunks):
    """chunked_causal_attention (blocks forward, one causal backward call given the merged output and lse) against
    SDPA's single causal call: output and Q/K/V gradients within bf16 tolerance, for every CUDA block kernel."""
    from sftprof.models.layers.block_attention import chunked_causal_attention

    q, k, v, dout, ref, (fq, fk, fv) = _single_call_case(chunks)
    cq, ck, cv = (t.clone().requires_grad_() for t in (q, k, v))
    out = chunked_causal_attention(cq, ck, cv, chunks=chunks, kernel=kernel)
    out.backward(dout)
    for got, want in ((out, ref), (cq.grad, fq.grad), (ck.grad, fk.grad), (cv.grad, fv.grad)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _megatron_case(seed: int, batch: int, fused_kv: bool):
    """bf16 tensors as megatron-core hands them to the core attention: ``q [4096, batch, 8, 128]`` and ``k, v
    [4096, batch, 2, 128]`` requiring grad (``fused_kv``: k and v are the two halves of one ``[4096, batch, 2, 256]``
    leaf, strided views as split from a fused projection), ``dout [4096, batch, 8 * 128]`` (the output projection's
    gradient); and the reference: SDPA's single causal GQA call on contiguous ``[b, heads, s, d]`` copies, as
    ``(out [s, b, heads * d], (dq, dk, dv) [s, b, heads, d])``."""
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    s, h, g, d = 4096, 8, 2, 128

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q = rand(s, batch, h, d).requires_grad_()
    if fused_kv:
        kv = rand(s, batch, g, 2 * d).requires_grad_()
        k, v = kv[..., :d], kv[..., d:]
    else:
        k, v = rand(s, batch, g, d).requires_grad_(), rand(s, batch, g, d).requires_grad_()
    dout = rand(s, batch, h * d)
    qc, kc, vc = (t.detach().permute(1, 2, 0, 3).contiguous().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
    ref.backward(dout.view(s, batch, h, d).permute(1, 2, 0, 3).contiguous())
    want = (ref.detach().permute(2, 0, 1, 3).reshape(s, batch, -1),
            tuple(t.grad.permute(2, 0, 1, 3) for t in (qc, kc, vc)))
    return q, k, v, dout, want


def _check_megatron_case(got, grads, want):
    assert got._base is not None  # the [s, b, heads * d] flatten of the attention output is a view, no copy
    for name, g, w in [("out", got, want[0])] + list(zip(("dq", "dk", "dv"), grads, want[1])):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "cudnn_gqa", "flash_gqa"])
@pytest.mark.parametrize("batch,fused_kv", [(1, False), (2, False), (2, True)])
def test_chunked_forward_megatron_layout_one_gpu(kernel, batch, fused_kv):
    """chunked_causal_attention on megatron's layout, as SDPACoreAttention calls it (permuted views in, the output
    flattened to [s, b, heads * d], its gradient given in that layout): output in [s, b, heads, d] order, output and
    Q/K/V gradients within bf16 tolerance of SDPA's single causal call on contiguous copies."""
    from sftprof.models.layers.block_attention import chunked_causal_attention

    q, k, v, dout, want = _megatron_case(3 * batch + fused_kv, batch, fused_kv)
    views = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    out = chunked_causal_attention(*views, chunks=2, kernel=kernel)
    assert out.stride() == views[0].stride(), (out.stride(), views[0].stride())
    got = out.permute(2, 0, 1, 3).reshape(q.shape[0], batch, -1)
    _check_megatron_case(got, torch.autograd.grad(got, (q, k, v), dout), want)


@pytest.mark.gpu
def test_cudnn_backward_any_output_layout_one_gpu():
    """The cuDNN block kernel's backward gives the same gradients, those of SDPA's single call, whether O and dO come
    in Q's layout or contiguous (the wrapper hands them to the op in the layout that follows from Q's: torch caches
    the cuDNN backward graph under a key of Q/K/V shapes and strides only). Prints what the raw op gives for O and
    dO contiguous under the graph cached for them in Q's layout (run with ``-s``): a large difference is that
    cache hazard in this torch build."""
    from sftprof.models.layers.block_attention import BLOCK_KERNELS

    q, k, v, dout, want = _megatron_case(7, 2, False)
    views = [t.detach().permute(1, 2, 0, 3) for t in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    kern = BLOCK_KERNELS["cudnn_gqa"]
    out, lse, aux = kern.forward(*views, True, scale)
    assert out.stride() == views[0].stride()  # the op allocates its output like q
    dout_q = dout.view(q.shape).permute(1, 2, 0, 3)  # megatron's gradient: in the output's strides
    matched = kern.backward(dout_q, *views, out, lse, aux, True, scale)
    other = kern.backward(dout_q.contiguous(), *views, out.contiguous(), lse, aux, True, scale)
    for name, a, b, w in zip(("dq", "dk", "dv"), matched, other, want[1]):
        torch.testing.assert_close(a.permute(2, 0, 1, 3), w, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}, O/dO contiguous: {m}")
    lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
    raw = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout_q.contiguous(), *views, out.contiguous(), lse.reshape(lse_shape).contiguous(), seed, offset, None, cum_q,
        cum_k, max_q, max_k, 0.0, True, scale=scale)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}: raw cuDNN backward with O/dO "
          "contiguous after a graph was cached for them in Q's layout, max abs diff vs the matched call: "
          + ", ".join(f"{n}={float((r.float() - a.float()).abs().max()):.3g}"
                      for n, r, a in zip(("dq", "dk", "dv"), raw, matched)))


@pytest.mark.gpu
def test_cudnn_backward_size_one_stride_and_misaligned_output_gradient_one_gpu():
    """Batch 1, megatron's layout, after the cuDNN backward graph was cached for O/dO in Q's strides: a dO whose
    size-1 (batch) dimension has another stride, and a dO and an O with Q's strides but a storage offset of one
    element (2 bytes: not 16-byte aligned), give the gradients of the matched call (with_output_layout copies
    them into Q's exact layout; before, the size-1 stride and the pointer were passed to the cached graph as
    they were)."""
    from sftprof.models.layers.block_attention import BLOCK_KERNELS

    q, k, v, dout, want = _megatron_case(7, 1, False)
    views = [t.detach().permute(1, 2, 0, 3) for t in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    kern = BLOCK_KERNELS["cudnn_gqa"]
    out, lse, aux = kern.forward(*views, True, scale)
    dout_sbhd = dout.view(q.shape)
    matched = kern.backward(dout_sbhd.permute(1, 2, 0, 3), *views, out, lse, aux, True, scale)

    def shifted(x):  # x's values and strides, one element past a 16-byte boundary
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:]
        return buf.view(x.shape).copy_(x)

    st = dout_sbhd.stride()
    other_b = dout_sbhd.as_strided(q.shape, (st[0], 8, st[2], st[3])).permute(1, 2, 0, 3)
    out_sbhd = out.permute(2, 0, 1, 3)
    cases = {"size-1 stride": (other_b, out),
             "misaligned dO": (shifted(dout_sbhd).permute(1, 2, 0, 3), out),
             "misaligned O": (dout_sbhd.permute(1, 2, 0, 3), shifted(out_sbhd).permute(1, 2, 0, 3))}
    assert other_b.stride()[0] == 8 and cases["misaligned dO"][0].data_ptr() % 16 == 2
    for case, (d_o, o) in cases.items():
        got = kern.backward(d_o, *views, o, lse, aux, True, scale)
        for name, g, a in zip(("dq", "dk", "dv"), got, matched):
            torch.testing.assert_close(g, a, rtol=2e-2, atol=2e-2, msg=lambda m: f"{case}, {name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,fused_kv", [(1, False), (2, True)])
def test_sdpa_core_attention_chunked_megatron_layout_one_gpu(batch, fused_kv):
    """SDPACoreAttention at CP = 1 with forward_chunks 2 (the shipped default: the chunked path with the default
    block kernel) on megatron's layout against SDPA's single causal call on contiguous copies."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from sftprof.models.layers.attention import SDPACoreAttention

    q, k, v, dout, want = _megatron_case(20 + batch, batch, fused_kv)
    mod = SDPACoreAttention(SimpleNamespace(attention_dropout=0.0, context_parallel_size=1), 1, AttnMaskType.causal,
                            "self", pg_collection=SimpleNamespace(cp=None), forward_chunks=2)
    got = mod(q, k, v, None)
    _check_megatron_case(got, torch.autograd.grad(got, (q, k, v), dout), want)


@pytest.mark.gpu
def test_forward_chunks_skip_reason_cuda():
    """The CUDA reasons attention_forward_chunks > 1 does not apply at CP = 1: fp32 (math kernel), SDPA's cuDNN
    backend off (flash kernel); none for a bf16 head_dim-128 query whose length the count divides (cuDNN on)."""
    from sftprof.models.layers.attention import forward_chunks_skip_reason

    q = torch.zeros(1, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert forward_chunks_skip_reason(q.float(), 2, 0.0) == "dtype float32 (the cuDNN SDPA kernels take bf16/fp16)"
    if not torch.backends.cudnn.is_available():
        pytest.skip("cuDNN unavailable")
    cudnn_on = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        assert forward_chunks_skip_reason(q, 2, 0.0) is None
        torch.backends.cuda.enable_cudnn_sdp(False)
        assert forward_chunks_skip_reason(q, 2, 0.0) == "SDPA's cuDNN backend is off or cuDNN is unavailable"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_on)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["masked", "blocks", "blocks-flash", "blocks-serial"])
def test_cp2_sdpa_attention_matches_single_gpu(tmp_path, case):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "errs.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), __file__, str(out), case], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    errs = json.loads(out.read_text())
    print(f"CP=2 ({case}) vs single-GPU max abs errors:", errs)
    if case == "blocks-flash":
        assert errs["block_kernel"] == "flash_gqa", errs
    for name in ("out", "dq", "dk", "dv"):  # bf16: within ~1 ulp of the largest value
        assert errs[name] <= 2e-2 + 1e-2 * errs[name + "_scale"], (name, errs)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
