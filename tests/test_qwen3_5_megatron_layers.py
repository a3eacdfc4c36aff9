"""Qwen3.5 megatron mapping on CPU (gloo, fp32): the local layer spec, its two attention layers against
Hugging Face's Qwen3.5 layers (1 rank, and TP = 2 with sequence parallelism on 2 ranks), and the whole
4-layer GPTModel loaded from a ``save_pretrained`` checkpoint against ``Qwen3_5MoeForCausalLM``.

megatron-core's ``GatedDeltaNet`` is CUDA-only at construction (``torch.cuda.current_device()``) and
needs flash-linear-attention's Triton kernels, so on CPU the tests build it with ``torch.cuda.current_device``
answering ``"cpu"`` and run its deterministic-mode PyTorch path (``torch_chunk_gated_delta_rule``) with a
PyTorch L2 norm in place of fla's (in the module :func:`sftprof.compat.gated_delta_net_kernels` names); the MoE
alltoall dispatcher gets a host stand-in for its CUDA side stream. What runs is the rest of the modules as shipped:
``in_proj`` / ``out_proj`` (local column/row-parallel linears), the q/k/v/z/beta/alpha split, the causal conv1d, the
gate, the output RMSNorm (this project's, zero-centred), the gated SDPA attention with partial RoPE, router, experts
and gated shared expert; with megatron-core >= 0.18 also the gated delta-net's context parallelism (CP = 2).
Weights go through the project's mapping (:mod:`sftprof.models.qwen3_5_moe_weights`): per layer for the
layer tests (TP rank slices included), and through the loader for the whole model.
"""
import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fixtures.megatron_cpu import megatron_cpu
from fixtures.qwen3_5 import load_mapped_attention, megatron_logprob_errors, save_tiny_checkpoint
from sftprof.allocation import parse_allocation_mode
from sftprof.compat import GATED_DELTA_NET_CP, gated_delta_net_kernels, megatron_at_least
from sftprof.config import ConfigError, load_config
from sftprof.launch import free_port
from sftprof.models import megatron_config as mc
from sftprof.models.checks import check_linear_attention_layout
from sftprof.models.layers.experts import grouped_mm_supported
from sftprof.models.hf import load_hf_config
from sftprof.models.specs import decoder_block_spec

NO_PAO = ["actor.megatron.use_precision_aware_optimizer=false", "actor.megatron.main_grads_dtype=float32"]


def _torch_l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@pytest.fixture(scope="module")
def mcore_cpu(tmp_path_factory):
    gated_delta_net = gated_delta_net_kernels()

    with megatron_cpu(tmp_path_factory.mktemp("store") / "filestore"), \
            mock.patch.object(gated_delta_net, "HAVE_FLA", True), \
            mock.patch.object(gated_delta_net, "l2norm", _torch_l2norm, create=True):
        yield


def _tconfig(hf, mode="megatron:d1"):
    from megatron.core.transformer import TransformerConfig

    # no recompute: megatron's checkpointing saves the CUDA RNG state
    cfg = load_config("tiny_qwen3_5_cpu", NO_PAO + [f"actor.backend={mode}", "actor.gradient_checkpointing=false"])
    kw = mc.hf_to_transformer_kwargs(hf)
    kw.update(mc.parallel_config_kwargs(parse_allocation_mode(mode)))
    kw.update(mc.training_config_kwargs(cfg, have_te=False))
    # CPU: parameters on the CPU, no CUDA RNG tracker (the weights are copied from the HF layers), PyTorch GDN path
    kw.update(use_cpu_initialization=True, perform_initialization=False, deterministic_mode=True)
    return TransformerConfig(**kw)


def test_layer_pattern_and_module_types(mcore_cpu):
    from megatron.core.transformer.enums import AttnMaskType

    hf = load_hf_config("qwen3_5_35b_a3b", num_layers=8)
    for mode, n in (("megatron:d1", 8), ("megatron:(attn:t2|ffn:e2)", 8)):
        spec_config = _tconfig(hf, mode)
        spec = decoder_block_spec(spec_config, have_te=False, cp_attention="blocks")
        kinds = [s.submodules.self_attention.module.__name__ for s in spec.layer_specs]
        assert kinds == (["GatedDeltaNet"] * 3 + ["SelfAttention"]) * 2 and len(kinds) == n
        gdn = spec.layer_specs[0].submodules.self_attention.submodules
        assert [c.__name__ for c in (gdn.in_proj, gdn.out_norm, gdn.out_proj)] == \
            ["ColumnParallelLinear", "RMSNorm", "RowParallelLinear"]
        mlp = spec.layer_specs[3].submodules.mlp.submodules
        experts = "GroupedGemmExperts" if grouped_mm_supported(spec_config) else "SequentialMLP"  # CUDA-only GEMM
        assert (mlp.experts.module.__name__, mlp.shared_experts.module.__name__) == (experts, "SharedExpertMLP")
        # actor.megatron.cp_attention reaches the core attention megatron-core builds
        core = spec.layer_specs[3].submodules.self_attention.submodules.core_attention(
            config=spec_config, layer_number=4, attn_mask_type=AttnMaskType.causal, attention_type="self",
            cp_comm_type=None, softmax_scale=None, pg_collection=None)
        assert (type(core).__name__, core.cp_attention) == ("SDPACoreAttention", "blocks")
    tc = _tconfig(hf, "megatron:(attn:t2|ffn:e2)")
    assert (tc.sequence_parallel, tc.attention_output_gate, tc.moe_shared_expert_gate, tc.mtp_num_layers,
            tc.layernorm_zero_centered_gamma, tc.linear_attention_freq) == (True, True, True, None, True, 4)
    gpt = mc.gpt_model_kwargs(hf)
    assert (gpt["rotary_percent"], gpt["share_embeddings_and_output_weights"]) == (0.25, False)


def test_cp_layout_and_missing_fla_stop_before_launch():
    cp2 = parse_allocation_mode("megatron:(attn:c2|ffn:e2)")
    if megatron_at_least(GATED_DELTA_NET_CP):  # megatron-core >= 0.18: gated delta-net with context parallelism
        with mock.patch("importlib.util.find_spec", lambda name: object()):  # fla found
            check_linear_attention_layout("qwen3_5_moe_text", cp2)
    else:
        with pytest.raises(ConfigError, match=r"context parallelism \(CP=2\) is not supported for qwen3_5_moe_text "
                                              r"with megatron-core 0\.1[67]\.\d+: .* \(megatron-core >= 0\.18 has\)"):
            check_linear_attention_layout("qwen3_5_moe_text", cp2)
    with mock.patch("importlib.util.find_spec", lambda name: None):
        with pytest.raises(ConfigError, match=r"needs the Python package 'fla' from flash-linear-attention==0.6.0 "
                                              r"and fla-core==0.6.0"):
            check_linear_attention_layout("qwen3_5_moe_text", parse_allocation_mode("megatron:(attn:d4t2|ffn:d1e8)"))
        check_linear_attention_layout("qwen3_5_moe_text", parse_allocation_mode("fsdp:d2"))  # HF's torch fallback
        check_linear_attention_layout("qwen3_moe", parse_allocation_mode("megatron:(attn:c2|ffn:e2)"))


def _build(spec, tc, layer_number):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    return build_module(spec, config=tc, layer_number=layer_number,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _randomise(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


def test_gated_delta_net_layer_matches_hugging_face(mcore_cpu):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    hf = load_hf_config("tiny_qwen3_5_moe")
    tc = _tconfig(hf)
    ref = Qwen3_5MoeGatedDeltaNet(hf, layer_idx=0)
    _randomise(ref, 0)
    ours = _build(decoder_block_spec(tc, have_te=False).layer_specs[0].submodules.self_attention, tc, 1)
    load_mapped_attention(ours, ref, hf, 0)
    x = torch.randn(2, 70, hf.hidden_size)  # 70 tokens: two 64-token chunks of the chunked delta rule
    with torch.no_grad():
        expected = ref(x)
        out, bias = ours(x.transpose(0, 1), attention_mask=None)
    assert bias is None and out.shape == (70, 2, hf.hidden_size)
    err = (out.transpose(0, 1) - expected).abs().max().item()
    assert err < 1e-5 * expected.abs().max().item() + 1e-6, err


def test_gated_full_attention_with_partial_rope_matches_hugging_face(mcore_cpu):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeAttention, Qwen3_5MoeTextRotaryEmbedding

    hf = load_hf_config("tiny_qwen3_5_moe")
    hf._attn_implementation = "sdpa"
    tc = _tconfig(hf)
    ref = Qwen3_5MoeAttention(hf, layer_idx=3)
    _randomise(ref, 1)
    ours = _build(decoder_block_spec(tc, have_te=False).layer_specs[3].submodules.self_attention, tc, 4)
    load_mapped_attention(ours, ref, hf, 3)
    b, s = 2, 40
    x = torch.randn(b, s, hf.hidden_size)
    gpt = mc.gpt_model_kwargs(hf)
    rope = RotaryEmbedding(tc.kv_channels, gpt["rotary_percent"], rotary_base=gpt["rotary_base"],
                           use_cpu_initialization=True)
    positions = torch.arange(s).expand(3, b, s)  # text-only: the three M-RoPE position rows are equal
    with torch.no_grad():
        expected, _ = ref(x, Qwen3_5MoeTextRotaryEmbedding(hf)(x, positions), attention_mask=None)
        out, bias = ours(x.transpose(0, 1), attention_mask=None, rotary_pos_emb=rope(s))
    assert bias is None
    err = (out.transpose(0, 1) - expected).abs().max().item()
    assert err < 1e-5 * expected.abs().max().item() + 1e-6, err


@contextlib.contextmanager
def _two_gloo_ranks(rank: int, port: int, **parallel):
    """Rank ``rank`` of 2 gloo processes with megatron-core's model-parallel groups of ``parallel``, the gated
    delta-net's fla kernels on torch (:func:`_torch_l2norm`) and ``torch.cuda.current_device`` answering ``cpu``; the
    groups and the process group destroyed on exit."""
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(**parallel)
    gated_delta_net = gated_delta_net_kernels()
    try:
        with mock.patch.object(gated_delta_net, "HAVE_FLA", True), \
                mock.patch.object(gated_delta_net, "l2norm", _torch_l2norm, create=True), \
                mock.patch("torch.cuda.current_device", lambda: "cpu"):
            yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _tp2_sequence_parallel_worker(rank: int, port: int) -> None:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeAttention, Qwen3_5MoeGatedDeltaNet,
                                                                        Qwen3_5MoeTextRotaryEmbedding)

    with _two_gloo_ranks(rank, port, tensor_model_parallel_size=2):
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        hf = load_hf_config("tiny_qwen3_5_moe")
        hf._attn_implementation = "sdpa"
        tc = _tconfig(hf, "megatron:(attn:t2|ffn:e2)")
        assert tc.sequence_parallel
        specs = decoder_block_spec(tc, have_te=False).layer_specs
        b, s = 2, 40
        torch.manual_seed(5)
        x = torch.randn(b, s, hf.hidden_size)
        rows = slice(rank * s // 2, (rank + 1) * s // 2)  # this rank's sequence-parallel shard
        gpt = mc.gpt_model_kwargs(hf)
        rope = RotaryEmbedding(tc.kv_channels, gpt["rotary_percent"], rotary_base=gpt["rotary_base"],
                               use_cpu_initialization=True)(s)
        for layer, ref_cls in ((0, Qwen3_5MoeGatedDeltaNet), (3, Qwen3_5MoeAttention)):
            ref = ref_cls(hf, layer)
            _randomise(ref, 7 + layer)
            ours = _build(specs[layer].submodules.self_attention, tc, layer + 1)
            load_mapped_attention(ours, ref, hf, layer, rank, 2)
            x_ref = x.clone().requires_grad_(True)
            x_ours = x.transpose(0, 1)[rows].clone().requires_grad_(True)
            if layer == 0:
                expected = ref(x_ref)
                out, _ = ours(x_ours, attention_mask=None)
            else:
                positions = torch.arange(s).expand(3, b, s)
                expected, _ = ref(x_ref, Qwen3_5MoeTextRotaryEmbedding(hf)(x_ref, positions), attention_mask=None)
                out, _ = ours(x_ours, attention_mask=None, rotary_pos_emb=rope)
            probe = torch.randn(b, s, hf.hidden_size, generator=torch.Generator().manual_seed(9))
            (expected * probe).sum().backward()
            (out * probe.transpose(0, 1)[rows]).sum().backward()
            scale = expected.abs().max().item()
            assert out.shape == (s // 2, b, hf.hidden_size)
            assert (out - expected.transpose(0, 1)[rows]).abs().max().item() < 1e-5 * scale + 1e-6, layer
            grad_err = (x_ours.grad - x_ref.grad.transpose(0, 1)[rows]).abs().max().item()
            assert grad_err < 1e-5 * x_ref.grad.abs().max().item() + 1e-6, (layer, grad_err)


def test_tp2_sequence_parallel_layers_match_hugging_face():
    """Both attention kinds with TP = 2 and sequence parallelism (2 gloo ranks): each rank's output shard
    and input-gradient shard equal Hugging Face's single-device layer."""
    import torch.multiprocessing as mp

    mp.spawn(_tp2_sequence_parallel_worker, args=(free_port(),), nprocs=2, join=True)


def _cp2_gated_delta_net_worker(rank: int, port: int) -> None:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    from sftprof.data import cp_shard

    with _two_gloo_ranks(rank, port, context_parallel_size=2):
        hf = load_hf_config("tiny_qwen3_5_moe")
        tc = _tconfig(hf, "megatron:(attn:c2|ffn:e2)")
        ref = Qwen3_5MoeGatedDeltaNet(hf, 0)
        _randomise(ref, 7)
        ours = _build(decoder_block_spec(tc, have_te=False).layer_specs[0].submodules.self_attention, tc, 1)
        load_mapped_attention(ours, ref, hf, 0)
        b, s = 2, 136  # 4 load-balanced chunks of 34; the delta rule sees all 136 tokens (three 64-token chunks)
        torch.manual_seed(5)
        x = torch.randn(b, s, hf.hidden_size)
        x_ref = x.clone().requires_grad_(True)
        x_ours = cp_shard(x.transpose(0, 1), 2, rank, dim=0).clone().requires_grad_(True)
        expected = ref(x_ref)
        out, _ = ours(x_ours, attention_mask=None)
        probe = torch.randn(b, s, hf.hidden_size, generator=torch.Generator().manual_seed(9))
        (expected * probe).sum().backward()
        (out * cp_shard(probe.transpose(0, 1), 2, rank, dim=0)).sum().backward()
        want = cp_shard(expected.detach().transpose(0, 1), 2, rank, dim=0)
        assert out.shape == want.shape == (s // 2, b, hf.hidden_size)
        assert (out - want).abs().max().item() < 1e-5 * expected.abs().max().item() + 1e-6
        want_grad = cp_shard(x_ref.grad.transpose(0, 1), 2, rank, dim=0)
        assert (x_ours.grad - want_grad).abs().max().item() < 1e-5 * x_ref.grad.abs().max().item() + 1e-6


@pytest.mark.skipif(not megatron_at_least(GATED_DELTA_NET_CP), reason="gated delta-net has context parallelism "
                    "from megatron-core 0.18 (sftprof.compat.GATED_DELTA_NET_CP)")
def test_cp2_gated_delta_net_layer_matches_hugging_face():
    """megatron-core's gated delta-net with CP = 2 (2 gloo ranks, the load-balanced chunks of ``cp_shard``): each
    rank's output and input-gradient chunks equal Hugging Face's single-device layer over the whole sequence."""
    import torch.multiprocessing as mp

    mp.spawn(_cp2_gated_delta_net_worker, args=(free_port(),), nprocs=2, join=True)


def test_save_pretrained_checkpoint_in_megatron_matches_hugging_face(mcore_cpu, tmp_path):
    """The whole local-spec GPTModel (4 layers: 3 gated delta-net + 1 gated attention, MoE with a gated shared
    expert) with a save_pretrained checkpoint's weights gives Hugging Face's per-token log-probs (fp32, CPU).
    Every checkpoint tensor is read exactly once and every megatron parameter is set."""
    save_tiny_checkpoint(tmp_path)
    err = megatron_logprob_errors(_tconfig(load_hf_config(str(tmp_path))), tmp_path, seq_len=80).max().item()
    assert err < 1e-5, err


def test_model_part_registration_shows_linear_and_full_attention_layers_apart(mcore_cpu):
    """The trace ranges name megatron-core's GatedDeltaNet layers ``linear_attn`` and the gated full-attention
    layer's core ``attn_core``, so the summary's time by model part keeps the two kinds apart."""
    from collections import Counter

    from megatron.core.models.gpt import GPTModel

    from sftprof.capture import module_regions

    hf = load_hf_config("tiny_qwen3_5_moe")
    tc = _tconfig(hf)
    gpt = GPTModel(config=tc, transformer_layer_spec=decoder_block_spec(tc, have_te=False), pre_process=True,
                   post_process=True, **mc.gpt_model_kwargs(hf))
    live = Counter(module_regions.module_part(path, mod) for path, mod in gpt.named_modules())
    for layer in (0, 1, 2):  # gated delta net: in_proj -> QKV projection, out_proj -> output projection
        assert [live[(p, layer)] for p in ("linear_attn", "attn_core", "attn_other", "attn_qkv", "attn_out")] == \
            [1, 0, 0, 1, 1], layer
    assert [live[(p, 3)] for p in ("linear_attn", "attn_core", "attn_other", "attn_qkv", "attn_out")] == [0, 1, 1, 1, 1]
