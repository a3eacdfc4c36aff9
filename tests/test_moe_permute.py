"""The sync-free, atomic-free MoE token permutation (:mod:`sftprof.models.layers.moe_permute`) against the installed
megatron-core's ``moe_utils.permute`` / ``unpermute`` (exact layout; fp64 references for sums and gradients), and its
wiring into a megatron-core MoE layer on CPU (gloo)."""
import pytest
import torch
import torch.nn.functional as F

from sftprof.compat import PERMUTE_PADDING_OUTPUTS, megatron_at_least
from sftprof.models.layers.moe_permute import gather_sum, sorted_permute, sorted_unpermute

BF16_HALF_ULP = 2.0 ** -8  # one round-to-nearest of bf16 (8 significant bits): relative error <= 2^-8


def _routing(n_tokens, n_experts, topk, seed):
    """A random router output: ``(routing_map [T, E] bool with topk per row, probs [T, E] fp32)``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, n_experts, generator=g)
    top = logits.topk(topk, dim=1)
    routing_map = torch.zeros(n_tokens, n_experts, dtype=torch.bool).scatter_(1, top.indices, True)
    probs = torch.zeros(n_tokens, n_experts).scatter_(1, top.indices, torch.softmax(top.values, dim=1))
    return routing_map, probs


def _assert_one_rounding(got, ref64):
    """``got`` (bf16) is the fp64 reference rounded once (within bf16's half ulp)."""
    err = (got.double() - ref64).abs()
    bound = ref64.abs() * BF16_HALF_ULP + 1e-30
    assert bool((err <= bound).all()), (err / bound).max().item()


CASES = [(64, 8, 2, 0), (200, 12, 3, 1), (512, 16, 4, 2), (333, 16, 4, 3)]


@pytest.mark.parametrize("n_tokens,n_experts,topk,seed", CASES)
def test_permute_matches_megatron_layout_exactly(n_tokens, n_experts, topk, seed):
    from megatron.core.transformer.moe import moe_utils

    routing_map, probs = _routing(n_tokens, n_experts, topk, seed)
    x = torch.randn(n_tokens, 32, generator=torch.Generator().manual_seed(seed + 10)).bfloat16()
    ours = sorted_permute(x, routing_map, probs=probs, num_out_tokens=n_tokens * topk)
    theirs = moe_utils.permute(x, routing_map, probs=probs, num_out_tokens=n_tokens * topk)
    for a, b, name in zip(ours, theirs, ("permuted tokens", "permuted probs", "sorted_indices")):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # megatron-core >= 0.17 also returns (pad_offsets, tokens_per_expert): None, None without padding
    assert len(ours) == len(theirs) and ours[3:] == theirs[3:]
    assert ours[0].shape == (n_tokens * topk, 32)


@pytest.mark.parametrize("n_tokens,n_experts,topk,seed", CASES)
def test_permute_unpermute_values_and_grads_against_fp64(n_tokens, n_experts, topk, seed):
    """Forward and backward of both ops in bf16 against megatron's ops run in fp64 through autograd: the gathers
    (permute forward, unpermute backward) and the probs are exact; the sums (unpermute forward, permute
    backward) are the fp64 sums rounded once to bf16."""
    from megatron.core.transformer.moe import moe_utils

    routing_map, probs = _routing(n_tokens, n_experts, topk, seed)
    g = torch.Generator().manual_seed(seed + 20)

    def bf16_values(*shape):  # fp64 tensors that bf16 holds exactly: both runs see the same inputs
        return torch.randn(*shape, generator=g).bfloat16().double()

    x64 = bf16_values(n_tokens, 32)
    upstream = bf16_values(n_tokens * topk, 32)  # grad of the permuted tokens
    y64 = bf16_values(n_tokens * topk, 32)  # expert outputs, permuted order
    out_grad = bf16_values(n_tokens, 32)
    p_grad = bf16_values(n_tokens * topk)

    def run(permute, unpermute, dtype):
        x = x64.to(dtype).requires_grad_(True)
        pr = probs.detach().clone().requires_grad_(True)
        permuted, permuted_probs, idx = permute(x, routing_map, probs=pr, num_out_tokens=n_tokens * topk)[:3]
        y = y64.to(dtype).requires_grad_(True)
        out = unpermute(y, idx, x.shape)
        ((permuted * upstream.to(dtype)).sum() + (out * out_grad.to(dtype)).sum()
         + (permuted_probs * p_grad.float()).sum()).backward()
        return permuted, permuted_probs, out, x.grad, y.grad, pr.grad

    p, pp, out, dx, dy, dprobs = run(sorted_permute, sorted_unpermute, torch.bfloat16)
    p64, pp64, out64, dx64, dy64, dprobs64 = run(moe_utils.permute, moe_utils.unpermute, torch.float64)
    assert torch.equal(p, p64.bfloat16()) and torch.equal(dy, dy64.bfloat16())
    assert torch.equal(pp, pp64) and torch.equal(dprobs, dprobs64)
    assert out.dtype == dx.dtype == torch.bfloat16
    _assert_one_rounding(out, out64)
    _assert_one_rounding(dx, dx64)


def test_gather_sum_adds_k_in_order_in_fp32():
    """``gather_sum`` = fp32 sum over k in order, one rounding: a value that bf16 partial sums would lose stays."""
    a = 3 * 2.0 ** -10  # 0.375 ulp of bf16 at 1.0 (ulp 2^-7)
    x = torch.tensor([[1.0], [a], [a], [0.0]], dtype=torch.bfloat16)
    inverse = torch.tensor([[0, 1, 2], [3, 1, 3]])
    # 1 + 0.75 ulp rounded once; rounding after each bf16 add would give 1 + 0.375 ulp -> 1, twice
    assert gather_sum(x, inverse).tolist() == [[1.0 + 2.0 ** -7], [a]]


def test_errors_name_the_setting():
    routing_map, probs = _routing(8, 4, 2, 0)
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"sorted_permute: fused=True, drop_and_pad=False, padding for quantization="
                                         r"False: only the unfused dropless path without padding"):
        sorted_permute(x, routing_map, num_out_tokens=16, fused=True)
    with pytest.raises(ValueError, match=r"sorted_permute: .*padding for quantization=True"):
        sorted_permute(x, routing_map, num_out_tokens=16, align_size=16)
    with pytest.raises(ValueError, match=r"sorted_permute: num_out_tokens=15 must be T \* topk \(T=8\)"):
        sorted_permute(x, routing_map, num_out_tokens=15)
    with pytest.raises(ValueError, match=r"sorted_permute: num_out_tokens=None must be T \* topk"):
        sorted_permute(x, routing_map)
    dropped = routing_map.clone()
    dropped[3] = False
    dropped[3, 0] = True
    with pytest.raises(RuntimeError, match=r"sorted_permute: a routing-map row does not have exactly topk=2 true"):
        sorted_permute(x, dropped, num_out_tokens=16)
    idx = sorted_permute(x, routing_map, num_out_tokens=16)[2]
    y = torch.randn(16, 4)
    with pytest.raises(ValueError, match=r"sorted_unpermute: probs must be None"):
        sorted_unpermute(y, idx, x.shape, probs=probs, routing_map=routing_map)
    with pytest.raises(ValueError, match=r"sorted_unpermute: .*padding for quantization=True"):
        sorted_unpermute(y, idx, x.shape, pad_offsets=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"sorted_unpermute: 16 sorted indices and permuted tokens \(16, 4\) do not "
                                         r"fit restore_shape \(5, 4\)"):
        sorted_unpermute(y, idx, torch.Size([5, 4]))
    with pytest.raises(ValueError, match=r"gather_sum: needs x \[N, H\] and inverse \[T, topk >= 1\]"):
        gather_sum(y, idx)


def test_wrong_types_shapes_and_indices_raise_never_a_silent_result():
    """Each of these used to return a result (probs of the wrong width gathered the wrong experts' probabilities;
    sorted indices that do not hold each token topk times, or out of range, gave a wrong sum) or an unclear error."""
    routing_map, probs = _routing(8, 4, 2, 0)
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"sorted_permute: routing_map must be a torch.Tensor of torch.bool on cpu, "
                                         r"got torch.int32 on cpu"):
        sorted_permute(x, routing_map.int(), probs, num_out_tokens=16)
    with pytest.raises(ValueError, match=r"sorted_permute: routing_map must be .* on cpu, got torch.bool on meta"):
        sorted_permute(x, routing_map.to("meta"), probs, num_out_tokens=16)
    with pytest.raises(ValueError, match=r"sorted_permute: tokens must be a torch.Tensor of torch.bfloat16 or torch.float16 or torch.float32 or torch.float64, got torch.int64"):
        sorted_permute(x.long(), routing_map, probs, num_out_tokens=16)
    with pytest.raises(ValueError, match=r"sorted_permute: needs tokens \[T, H\], routing_map \[T, E\] and probs None "
                                         r"or \[T, E\], got \(8, 4\), \(8, 4\) and \(8, 3\)"):
        sorted_permute(x, routing_map, probs[:, :3], num_out_tokens=16)
    with pytest.raises(ValueError, match=r"got \(\), \(8, 4\) and None"):
        sorted_permute(torch.tensor(1.0), routing_map, num_out_tokens=16)
    y, _, idx = sorted_permute(x, routing_map, probs, num_out_tokens=16)[:3]
    with pytest.raises(ValueError, match=r"sorted_unpermute: sorted_indices must be a torch.Tensor of torch.int64 on "
                                         r"cpu, got torch.float32 on cpu"):
        sorted_unpermute(y, idx.float(), x.shape)
    with pytest.raises(ValueError, match=r"sorted_unpermute: needs sorted_indices \[T \* topk\] and restore_shape "
                                         r"\(T, H\), got \(8, 2\) and \(8, 4\)"):
        sorted_unpermute(y, idx.view(8, 2), x.shape)
    with pytest.raises(ValueError, match=r"got \(16,\) and \(8, 4, 1\)"):
        sorted_unpermute(y, idx, (8, 4, 1))
    for bad in (torch.tensor([0, 0, 0] + [1] * 13), idx + 100):
        with pytest.raises(RuntimeError, match=r"sorted_unpermute: sorted_indices must hold each token 0..7 exactly "
                                               r"topk=2 times"):
            sorted_unpermute(y, bad, x.shape)
    inverse = torch.tensor([[0, 1], [2, 15]])
    with pytest.raises(ValueError, match=r"gather_sum: x must be a torch.Tensor of torch.bfloat16 or torch.float16 or torch.float32 or torch.float64, got torch.int64 on cpu"):
        gather_sum(y.long(), inverse)
    with pytest.raises(ValueError, match=r"gather_sum: inverse must be a torch.Tensor of torch.int64 on cpu, got "
                                         r"torch.int32 on cpu"):
        gather_sum(y, inverse.int())
    for bad in (inverse + 1, inverse - 2):  # -1 is padding, -2 is not
        with pytest.raises(RuntimeError, match=r"gather_sum: inverse holds an entry outside \[-1, 16\) \(x has 16 "
                                               r"rows; -1 is padding\)"):
            gather_sum(y, bad)


def test_chunk_sort_skips_only_the_identity():
    from megatron.core.transformer.moe import moe_utils

    from sftprof.models.layers.moe_permute import sort_chunks_unless_identity

    x, probs = torch.randn(10, 4), torch.randn(10)
    sizes = torch.tensor([3, 0, 5, 2])
    out, out_probs = sort_chunks_unless_identity(x, sizes, torch.arange(4), probs=probs)
    assert out is x and out_probs is probs
    ours = sort_chunks_unless_identity(x, sizes, torch.tensor([2, 0, 3, 1]), probs=probs)
    theirs = moe_utils.sort_chunks_by_idxs(x, sizes, torch.tensor([2, 0, 3, 1]), probs=probs)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[0], torch.cat([x[3:8], x[:3], x[8:]]))  # chunks x[:3], x[3:3], x[3:8], x[8:]


def test_no_tokens():
    routing_map = torch.zeros(0, 8, dtype=torch.bool)
    x = torch.randn(0, 4, requires_grad=True)
    permuted, permuted_probs, idx = sorted_permute(x, routing_map, probs=torch.zeros(0, 8), num_out_tokens=0)[:3]
    assert permuted.shape == (0, 4) and permuted_probs.shape == (0,) and idx.shape == (0,)
    assert sorted_unpermute(permuted, idx, x.shape).shape == (0, 4)


# ----------------------------------------------------------------------------------------------------------------
# Wiring into a megatron-core MoE layer (CPU, one gloo rank, fp32)


@pytest.fixture(scope="module")
def mcore_cpu(tmp_path_factory):
    from fixtures.megatron_cpu import megatron_cpu

    with megatron_cpu(tmp_path_factory.mktemp("store") / "filestore"):
        yield


def _moe_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16, num_moe_experts=8,
              moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
              moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True, perform_initialization=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _moe_forward_backward(config, sorted_permute_on, x, probe):
    from fixtures.megatron_cpu import mlp_build_kwargs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from sftprof.models.specs import _moe_spec

    torch.manual_seed(3)
    layer = build_module(_moe_spec(config, sorted_permute_on), config=config, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups(), **mlp_build_kwargs())
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * probe).sum().backward()
    return layer, out, x.grad, {n: p.grad for n, p in layer.named_parameters()}


def test_moe_layer_same_output_and_grads_with_sorted_permute_on_and_off(mcore_cpu):
    """The local spec's MoE layer (router, alltoall dispatcher, SequentialMLP experts, shared expert) gives the
    same output and gradients with the sorted permutation as with megatron-core's; the sorted path ran (two
    gather-sums per step: unpermute forward, permute backward) and megatron's permute/unpermute, their
    masked_select (on CUDA an aten::nonzero, a host sync) and its identity chunk sort did not."""
    from unittest import mock

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from sftprof.models.layers import moe_permute

    config = _moe_config()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, 2, 32, generator=g)  # [s, b, h]
    probe = torch.randn(24, 2, 32, generator=g)
    results = {}
    for on in (True, False):
        with mock.patch.object(token_dispatcher, "permute", wraps=moe_utils.permute) as mp, \
                mock.patch.object(token_dispatcher, "unpermute", wraps=moe_utils.unpermute) as mu, \
                mock.patch.object(moe_permute, "_gather_sum", wraps=moe_permute._gather_sum) as gs, \
                mock.patch.object(token_dispatcher, "sort_chunks_by_idxs", wraps=moe_utils.sort_chunks_by_idxs) as sc, \
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            layer, out, dx, grads = _moe_forward_backward(config, on, x, probe)
        ops = {e.key: e.count for e in prof.key_averages()}
        results[on] = (type(layer).__name__, type(layer.token_dispatcher).__name__, mp.call_count, mu.call_count,
                       gs.call_count, ops.get("aten::masked_select", 0), sc.call_count, out, dx, grads)
    # megatron's permute: masked_select of the token indices and of the probs (from 0.17 an argsort); its chunk sort
    # by local expert (8 local experts, EP = TP = 1: the identity) in dispatch_postprocess and combine_preprocess
    masked_selects = 0 if megatron_at_least(PERMUTE_PADDING_OUTPUTS) else 2
    assert results[True][:7] == ("SortedPermuteMoELayer", "SortedPermuteAlltoAllTokenDispatcher", 0, 0, 2, 0, 0)
    assert results[False][:7] == ("MoELayer", "MoEAlltoAllTokenDispatcher", 1, 1, 0, masked_selects, 2)
    (*_, out_on, dx_on, g_on), (*_, out_off, dx_off, g_off) = results[True], results[False]
    scale = out_off.abs().max().item()
    assert (out_on - out_off).abs().max().item() <= 1e-6 * scale
    assert (dx_on - dx_off).abs().max().item() <= 1e-6 * dx_off.abs().max().item()
    assert sorted(g_on) == sorted(g_off) and len(g_on) == 8 * 2 + 2 + 1  # experts fc1/fc2 x 8, shared expert, router
    for name in g_on:
        assert (g_on[name] - g_off[name]).abs().max().item() <= 1e-6 * g_off[name].abs().max().item(), name


def test_spec_keeps_megatron_layer_where_sorted_permute_does_not_apply(mcore_cpu):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from sftprof.models.layers.moe_permute import SortedPermuteMoELayer, sorted_permute_applies
    from sftprof.models.specs import _moe_spec

    assert _moe_spec(_moe_config(), True).module is SortedPermuteMoELayer
    assert _moe_spec(_moe_config(), False).module is MoELayer
    for kw in (dict(moe_token_dispatcher_type="allgather"), dict(moe_expert_capacity_factor=1.0),
               dict(moe_router_padding_for_quantization=True), dict(moe_permute_fusion=True)):
        config = _moe_config()
        for name, value in kw.items():  # set after construction: megatron's checks want fp8 or TE for the last two
            setattr(config, name, value)
        assert not sorted_permute_applies(config) and _moe_spec(config, True).module is MoELayer, kw
    with pytest.raises(ValueError, match=r"SortedPermuteMoELayer: needs moe_token_dispatcher_type='alltoall'"):
        SortedPermuteMoELayer(_moe_config(moe_expert_capacity_factor=1.0))


@pytest.mark.gpu
def test_triton_gather_sum_matches_torch_path_on_cuda():
    """The Triton gather-sum (bf16, T = 8192 tokens, topk 8, H 2048; also with -1 padding) gives the torch path's
    bits, and the whole permute/unpermute round trip on CUDA equals the CPU result."""
    from sftprof.models.layers.moe_permute import _gather_sum_torch
    n_tokens, n_experts, topk, hidden = 8192, 128, 8, 2048
    routing_map, probs = _routing(n_tokens, n_experts, topk, 7)
    x = torch.randn(n_tokens, hidden, generator=torch.Generator().manual_seed(8)).bfloat16()
    y = torch.randn(n_tokens * topk, hidden, generator=torch.Generator().manual_seed(9)).bfloat16()
    x_cuda = x.cuda().requires_grad_(True)
    permuted, permuted_probs, idx = sorted_permute(x_cuda, routing_map.cuda(), probs=probs.cuda(),
                                                   num_out_tokens=n_tokens * topk)[:3]
    inverse = torch.sort(idx, stable=True).indices.view(n_tokens, topk)
    y_cuda = y.cuda()
    assert torch.equal(gather_sum(y_cuda, inverse), _gather_sum_torch(y_cuda, inverse))
    padded = inverse.clone()
    padded[::3, 2] = -1  # padding entries (the dedup dispatcher's inverse maps) add nothing
    padded[5] = -1
    assert torch.equal(gather_sum(y_cuda, padded), _gather_sum_torch(y_cuda, padded))
    assert torch.equal(gather_sum(y_cuda, padded)[5], torch.zeros(hidden, dtype=torch.bfloat16, device="cuda"))
    permuted.backward(y_cuda)  # the permute backward: a gather-sum through the inverse map
    x_cpu = x.clone().requires_grad_(True)
    cpu = sorted_permute(x_cpu, routing_map, probs=probs, num_out_tokens=n_tokens * topk)
    cpu[0].backward(y)
    assert torch.equal(permuted.detach().cpu(), cpu[0].detach()) and torch.equal(permuted_probs.cpu(), cpu[1])
    assert torch.equal(idx.cpu(), cpu[2]) and torch.equal(x_cuda.grad.cpu(), x_cpu.grad)
    assert torch.equal(sorted_unpermute(y_cuda, idx, x.shape).cpu(), sorted_unpermute(y, cpu[2], x.shape))
