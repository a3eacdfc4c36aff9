"""The deduplicating all-to-all MoE token dispatcher (:mod:`sftprof.models.layers.moe_dedup`): a real megatron-core MoE
layer with EP = 2 on two gloo ranks against megatron-core's own dispatcher (same weights, fp32), the -1-padded
gather-sum it relies on, and the settings that pick or refuse it."""
import time
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from sftprof.models.layers.moe_permute import gather_rows, gather_sum, gather_sum_rows


def test_gather_sum_skips_padding_exactly():
    """-1 entries add nothing; the sums are fp32 in k order, rounded once (bf16); a row of padding is zero."""
    a = 3 * 2.0 ** -10  # 0.375 ulp of bf16 at 1.0
    x = torch.tensor([[1.0, 2.0], [a, -1.0], [a, 4.0], [8.0, 0.5]], dtype=torch.bfloat16)
    inverse = torch.tensor([[0, -1, 1, 2], [-1, -1, -1, -1], [3, -1, -1, -1], [-1, 2, -1, 1]])
    assert gather_sum(x, inverse).tolist() == [[1.0 + 2.0 ** -7, 5.0], [0.0, 0.0], [8.0, 0.5], [2 * a, 3.0]]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    inverse = torch.tensor([[6, -1, 0], [-1, -1, -1], [2, 3, -1], [-1, 5, 1], [4, -1, -1]])
    ref = torch.stack([sum((x[i] for i in row if i >= 0), torch.zeros(5, dtype=torch.float64)) for row in inverse.tolist()])
    assert torch.equal(gather_sum(x, inverse), ref)


def test_padded_gather_and_gather_sum_backward():
    """``gather_rows`` / ``gather_sum_rows`` through a -1-padded inverse map: values and gradients equal torch's
    index_select / index_add in fp64 (each token's rows summed; a token with no row gets a zero gradient)."""
    g = torch.Generator().manual_seed(1)
    indices = torch.tensor([0, 2, 3, 0, 3, 4])  # token 1 has no row
    inverse = torch.tensor([[0, 3], [-1, -1], [1, -1], [2, 4], [5, -1]])  # [T=5, K=2]
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 3, generator=g, dtype=torch.float64)
    rows = gather_rows(x, indices, inverse)
    rows.backward(up)
    assert torch.equal(rows, x.detach()[indices])
    assert torch.equal(x.grad, torch.zeros(5, 3, dtype=torch.float64).index_add_(0, indices, up))
    y = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    up2 = torch.randn(5, 3, generator=g, dtype=torch.float64)
    sums = gather_sum_rows(y, indices, inverse)
    sums.backward(up2)
    assert torch.equal(sums, torch.zeros(5, 3, dtype=torch.float64).index_add_(0, indices, y.detach()))
    assert torch.equal(y.grad, up2[indices])


# ----------------------------------------------------------------------------------------------------------------
# A megatron-core MoE layer with EP = 2 on two gloo ranks


def _moe_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16, num_moe_experts=8,
              moe_router_topk=3, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
              moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True, perform_initialization=True,
              expert_model_parallel_size=2)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _ep2_worker(rank: int, store: str) -> None:

    from fixtures.megatron_cpu import megatron_cpu, mlp_build_kwargs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.spec_utils import build_module

    from sftprof.models.layers import moe_dedup
    from sftprof.models.specs import _moe_spec

    with megatron_cpu(store, rank=rank, world_size=2, expert_model_parallel_size=2):
        config = _moe_config()
        g = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
        x = torch.randn(32, 2, 32, generator=g)  # [s, b, h]: 64 tokens
        probe = torch.randn(32, 2, 32, generator=g)
        results = {}
        # 80 > 64 tokens: some chunks empty; 0: megatron-core's dispatcher; "3r": 3 chunks under reentrant activation
        # checkpointing (the forward without grad, then again inside the backward, as megatron's full recompute)
        for case in (1, 3, 80, "3r", 0):
            chunks = 3 if case == "3r" else case
            torch.manual_seed(3)  # the same weights in every case (and the same router on both ranks)
            spec = _moe_spec(config, sorted_permute=False, dedup_alltoall=chunks > 0, alltoall_chunks=max(chunks, 1))
            layer = build_module(spec, config=config, layer_number=1,
                                 pg_collection=ProcessGroupCollection.use_mpu_process_groups(), **mlp_build_kwargs())
            xi = x.clone().requires_grad_(True)
            maps = []
            layer.router.register_forward_hook(lambda m, i, o: maps.append(o[1]))  # routing_map [T, E]
            with mock.patch.object(token_dispatcher, "permute", wraps=moe_utils.permute) as mp, \
                    mock.patch.object(moe_dedup, "all_to_all_single", wraps=moe_dedup.all_to_all_single) as a2a:
                if case == "3r":
                    out = torch.utils.checkpoint.checkpoint(lambda t: layer(t)[0], xi, use_reentrant=True)
                else:
                    out, _ = layer(xi)
                n_forward = a2a.call_count
                (out * probe).sum().backward()
            rows = [c.args[1].shape[0] for c in a2a.call_args_list]
            results[case] = (type(layer).__name__, type(layer.token_dispatcher).__name__, mp.call_count, rows,
                               n_forward, layer.token_dispatcher, maps, out, xi.grad,
                               {n: p.grad for n, p in layer.named_parameters()})
        assert results[0][:3] == ("MoELayer", "MoEAlltoAllTokenDispatcher", 1)
        *_, out_off, dx_off, g_off = results[0]
        for chunks in (1, 3, 80):
            (name, disp_name, permutes, rows, n_forward, disp, maps, out_on, dx_on, g_on) = results[chunks]
            assert (name, disp_name, permutes, disp.chunks) == ("DedupAlltoAllMoELayer", "DedupAlltoAllTokenDispatcher",
                                                                0, chunks)
            # which EP ranks each of this rank's 64 tokens went to: tokens for the local rank only, the other rank
            # only, and both are all present; one row per (token, rank) pair was sent
            assert len(maps) == 1
            sent = maps[0].view(64, 2, 4).any(dim=2)  # [T, EP]: tokens with >= 1 of their experts on each rank
            other = 1 - rank
            kinds = (int((sent[:, rank] & ~sent[:, other]).sum()), int((~sent[:, rank] & sent[:, other]).sum()),
                     int((sent[:, rank] & sent[:, other]).sum()))
            assert min(kinds) > 0 and sum(kinds) == 64, kinds
            bounds = [64 * c // chunks for c in range(chunks + 1)]  # token chunks
            assert disp.send_splits == [sent[lo:hi].sum(dim=0).tolist() for lo, hi in zip(bounds, bounds[1:])]
            n_send = [sum(s) for s in disp.send_splits]
            n_recv = [sum(s) for s in disp.recv_splits]
            assert sum(n_send) == sent.sum().item() < 64 * 3
            # forward: the counts [EP, K, 2], each chunk's rows, probability sub-rows and sub-maps, each chunk's
            # rows back; backward: every chunk's gradient back, then the dispatch gradients (rows, probabilities)
            # chunk by chunk from the last, each started as soon as that chunk's experts' backward is done
            assert n_forward == 1 + 4 * chunks
            assert rows == [2, *[n for c in range(chunks) for n in [n_send[c]] * 3], *n_recv, *n_send,
                            *[n for c in reversed(range(chunks)) for n in [n_recv[c]] * 2]], rows
            # the index maps and exchanges do not outlive the forward
            assert [getattr(disp, n) for n in ("send_map", "send_tokens", "send_inverse", "combine_exchange")] == [None] * 4
            assert (out_on - out_off).abs().max().item() <= 1e-6 * out_off.abs().max().item()
            assert (dx_on - dx_off).abs().max().item() <= 1e-6 * dx_off.abs().max().item()
            assert sorted(g_on) == sorted(g_off) and len(g_on) == 4 * 2 + 2 + 1  # 4 local experts' fc1/fc2, shared, router
            for n in g_on:
                assert (g_on[n] - g_off[n]).abs().max().item() <= 1e-6 * g_off[n].abs().max().item(), n
        *_, out_r, dx_r, g_r = results["3r"]
        assert torch.equal(out_r, results[3][7]) and torch.equal(dx_r, results[3][8])
        assert all(torch.equal(g_r[n], results[3][9][n]) for n in g_r)
        with pytest.raises(ValueError, match=r"^DedupAlltoAllTokenDispatcher: needs a bool routing_map and probs of "
                                             r"\[T, E\] = \(4, 8\), got torch.bool \(4, 4\) and \(4, 8\)$"):
            disp.dispatch_preprocess(torch.zeros(4, 32), torch.zeros(4, 4, dtype=torch.bool), torch.zeros(4, 8))


def test_ep2_moe_layer_same_output_and_grads_as_megatron_dispatcher(tmp_path):
    """EP = 2 on two gloo ranks, fp32, SequentialMLP experts (4 local each), topk 3 of 8, shared expert: the
    deduplicating dispatcher, its all-to-alls in 1, 3 or 80 token chunks (more chunks than tokens), gives
    megatron-core's alltoall dispatcher's output, input gradient and every parameter gradient (router, local experts,
    shared expert) within fp32 rounding, on both ranks; it sent one row per (token, destination rank), made exactly
    the collectives of the pipelined schedule in order, and megatron's permute did not run. Under reentrant activation
    checkpointing the results are bit-identical to the plain call."""
    import torch.multiprocessing as mp

    mp.spawn(_ep2_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def _one_sided_probs_worker(rank: int, store: str) -> None:
    from fixtures.megatron_cpu import megatron_cpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from sftprof.models.layers import moe_dedup
    from sftprof.models.specs import _moe_spec

    with megatron_cpu(store, rank=rank, world_size=2, expert_model_parallel_size=2):
        config = _moe_config()
        g = torch.Generator().manual_seed(20 + rank)
        x = torch.randn(16, 2, 32, generator=g)  # 32 tokens
        probe = torch.randn(16, 2, 32, generator=g)
        results = {}
        # rank 0's experts: the probabilities' value without their gradient. "detach": no gradient reaches the
        # received probabilities (None in the chunks' backward on rank 0 only); "zero": a gradient of zeros (the
        # reference: the same values and the same collectives on both ranks)
        for case in ("zero", "detach"):
            torch.manual_seed(3)
            layer = build_module(_moe_spec(config, sorted_permute=False, dedup_alltoall=True, alltoall_chunks=2),
                                 config=config, layer_number=1,
                                 pg_collection=ProcessGroupCollection.use_mpu_process_groups())
            forward = layer.experts.forward

            def experts(rows, tokens_per_expert, probs, forward=forward, case=case):
                if rank == 0:
                    probs = probs.detach() if case == "detach" else probs * 0 + probs.detach()
                return forward(rows, tokens_per_expert, probs)

            layer.experts.forward = experts
            xi = x.clone().requires_grad_(True)
            with mock.patch.object(moe_dedup, "all_to_all_single", wraps=moe_dedup.all_to_all_single) as a2a:
                out, _ = layer(xi)
                (out * probe).sum().backward()
            rows = [c.args[1].shape[0] for c in a2a.call_args_list]
            everyone = [None, None]
            torch.distributed.all_gather_object(everyone, len(rows))
            results[case] = (everyone, out, xi.grad, {n: p.grad for n, p in layer.named_parameters()})
        for case in results:
            assert results[case][0][0] == results[case][0][1] == 1 + 4 * 2 + 2 + 2 * 2, (case, results[case][0])
        _, out_ref, dx_ref, g_ref = results["zero"]
        _, out, dx, grads = results["detach"]
        assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref)
        assert sorted(grads) == sorted(g_ref) and all(torch.equal(grads[n], g_ref[n]) for n in grads)
        # the router's gradient does get the other rank's contribution through rank 0's zeros (not all zero)
        assert grads["router.weight"].abs().max().item() > 0


def _spawn_with_timeout(worker, args: tuple, nprocs: int, timeout_s: float) -> None:
    """``torch.multiprocessing.spawn`` that fails (terminating the workers) instead of hanging when a collective
    is left unmatched on one rank."""
    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    # join() returns False while a rank is still running (it returns when one ends, or raises for a failed one)
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            pytest.fail(f"{worker.__name__}: ranks still running after {timeout_s} s (an unmatched collective?)")


def test_ep2_gradient_missing_on_one_rank_keeps_the_collectives_matched(tmp_path):
    """EP = 2, 2 chunks, gloo: when one rank's experts leave the received probabilities without a gradient (None in
    that rank's chunk backward only), that rank still sends its (zero) gradients, so both ranks make the same 15
    all-to-alls and the output, input gradient and parameter gradients are bit-identical to a zero gradient's; it
    used to skip that collective on one rank only (a hang under NCCL)."""
    _spawn_with_timeout(_one_sided_probs_worker, (str(tmp_path / "store"),), 2, timeout_s=120)


def test_spec_picks_dedup_only_where_it_applies():
    """EP > 1 with expert TP 1 and dropless alltoall routing: the dedup layer (unless the setting is off); any
    other layout or feature keeps the sorted-permute or megatron-core layer; the layer refuses a config the
    spec would not give it, naming the setting."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from sftprof.models.layers.moe_dedup import DedupAlltoAllMoELayer, dedup_alltoall_applies
    from sftprof.models.layers.moe_permute import SortedPermuteMoELayer
    from sftprof.models.specs import _moe_spec

    assert _moe_spec(_moe_config(), True, True).module is DedupAlltoAllMoELayer
    assert _moe_spec(_moe_config(), True, False).module is SortedPermuteMoELayer
    assert _moe_spec(_moe_config(), False, False).module is MoELayer
    assert _moe_spec(_moe_config(expert_model_parallel_size=1), True, True).module is SortedPermuteMoELayer
    for kw in (dict(expert_tensor_parallel_size=2), dict(moe_shared_expert_overlap=True),
               dict(overlap_moe_expert_parallel_comm=True), dict(cuda_graph_impl="local"),
               dict(moe_token_dispatcher_type="allgather"), dict(moe_expert_capacity_factor=1.0),
               dict(moe_permute_fusion=True), dict(moe_router_padding_for_quantization=True)):
        config = _moe_config()
        for name, value in kw.items():  # set after construction: megatron's checks want TE/fp8/more ranks for some
            setattr(config, name, value)
        assert not dedup_alltoall_applies(config) and _moe_spec(config, True, True).module is not DedupAlltoAllMoELayer, kw
    with pytest.raises(ValueError, match=r"^actor\.megatron\.moe_dedup_alltoall: DedupAlltoAllMoELayer needs EP > 1, "
                                         r"expert TP 1,"):
        DedupAlltoAllMoELayer(_moe_config(expert_model_parallel_size=1))


@pytest.mark.parametrize("layout,layer", [("megatron:(attn:c2|ffn:e2)", "DedupAlltoAllMoELayer"),
                                          ("megatron:(attn:t2|ffn:e2)", "DedupAlltoAllMoELayer"),
                                          ("megatron:d1", "SortedPermuteMoELayer"),
                                          ("megatron:d2t2p2", "SortedPermuteMoELayer")])
def test_shipped_config_picks_dedup_at_ep_layouts(layout, layer):
    """The shipped YAML's Qwen3-30B-A3B config without TE: the dedup layer at EP = 2 with expert TP 1 (the
    bench's ``(attn:c2|ffn:e2)``), the sorted permutation without EP or with expert TP 2."""
    from sftprof.allocation import parse_allocation_mode
    from sftprof.config import load_config
    from sftprof.models import megatron_config as mc
    from sftprof.models.hf import load_hf_config
    from sftprof.models.specs import _moe_spec

    cfg = load_config("qwen3_30b_a3b_sft_profile.yaml", ["actor.megatron.use_precision_aware_optimizer=false",
                                                         "actor.megatron.main_grads_dtype=float32"])
    m = cfg.actor.megatron
    tc = mc.build_transformer_config(load_hf_config("qwen3_30b_a3b", 4), cfg, parse_allocation_mode(layout),
                                     have_te=False)
    assert _moe_spec(tc, m.moe_sorted_permute, m.moe_dedup_alltoall).module.__name__ == layer
