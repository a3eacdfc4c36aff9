"""CPU tests of the model FLOP count (sftprof.flops) against hand counts of every GEMM."""
import pytest

from sftprof.flops import ModelShape, forward_flops, gpu_peak_bf16_flops, mfu, train_step_flops
from sftprof.models.hf import load_hf_config


def gemm(m, k, n):
    return 2 * m * k * n


def hand_forward(s):
    # tiny_qwen3_moe: 2 layers, h=128, 4 q heads / 2 kv heads of 32, 8 experts top-2 of ffn 64, V=151936
    h, d, nq, nkv, k, f, E, V, L = 128, 32, 4, 2, 2, 64, 8, 151936, 2
    qkv = gemm(s, h, nq * d) + 2 * gemm(s, h, nkv * d)
    out = gemm(s, nq * d, h)
    # causal core: for query i, QK^T and PV each cost 2*d per visible key and head, keys 0..i
    core = sum(2 * (2 * d * (i + 1)) * nq for i in range(s))
    router = gemm(s, h, E)
    experts = k * (gemm(s, h, 2 * f) + gemm(s, f, h))
    lm_head = gemm(s, h, V)
    return L * (qkv + out), L * core, L * router, L * experts, lm_head


def test_forward_matches_hand_count():
    shape = ModelShape.from_hf(load_hf_config("tiny_qwen3_moe"))
    got = forward_flops(shape, [16, 40])
    a16, a40 = hand_forward(16), hand_forward(40)
    want = [x + y for x, y in zip(a16, a40)]
    assert [got.attn_linear, got.attn_core, got.router, got.routed_experts, got.lm_head] == want
    assert got.shared_experts == 0
    assert got.total == sum(want)
    # the literal count for one 16-token sequence
    assert forward_flops(shape, [16]).total == 628_826_112


def test_train_step_and_recompute():
    shape = ModelShape.from_hf(load_hf_config("tiny_qwen3_moe"))
    fwd = forward_flops(shape, [16])
    assert train_step_flops(shape, [16]).model == 3 * fwd.total == 1_886_478_336
    assert train_step_flops(shape, [16]).recompute == 0
    full = train_step_flops(shape, [16], "full", "uniform", 1)
    assert full.model == 3 * fwd.total and full.recompute == fwd.decoder == 6_496_256
    assert train_step_flops(shape, [16], "full", "block", 1, pp=1).recompute == fwd.decoder / 2
    assert train_step_flops(shape, [16], "selective").recompute == fwd.attn_core == 2 * 69_632
    with pytest.raises(ValueError, match="recompute_granularity='bogus'"):
        train_step_flops(shape, [16], "bogus")


def test_shared_experts_and_qwen3_30b_scale():
    shape = ModelShape(num_layers=1, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, num_experts=4, topk=2,
                       moe_ffn=8, vocab=32, shared_ffn=24, shared_gate=True)
    assert forward_flops(shape, [4]).shared_experts == 4 * (gemm(1, 16, 48) + gemm(1, 24, 16) + gemm(1, 16, 1))
    q3 = ModelShape.from_hf(load_hf_config("qwen3_30b_a3b"))
    # active parameters per token of the decoder GEMMs: 48 * (attention 2048*(4096+1024) + 4096*2048
    # + router 2048*128 + 8 experts * 3 * 2048*768) ~= 3.35e9 (Qwen3-30B-A3B is "3B active" without embeddings)
    per_token_linear = (forward_flops(q3, [1]).decoder - forward_flops(q3, [1]).attn_core) / 2
    assert per_token_linear == 48 * (2048 * 5120 + 4096 * 2048 + 2048 * 128 + 8 * 3 * 2048 * 768)
    with pytest.raises(NotImplementedError, match="linear-attention"):
        ModelShape.from_hf(load_hf_config("qwen3_5_35b_a3b"))
    hf = load_hf_config("tiny_qwen3_moe")
    hf.mlp_only_layers = [1]
    with pytest.raises(NotImplementedError, match="mlp_only_layers"):
        ModelShape.from_hf(hf)


def test_mfu_and_peak():
    assert gpu_peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert gpu_peak_bf16_flops("Some GPU") is None
    assert mfu(989.4e12, 1.0, 2, 989.4e12) == 0.5
    assert mfu(1.0, 0.0, 1, 989.4e12) is None and mfu(1.0, 1.0, 1, None) is None


def test_peak_lookup_distinguishes_h100_parts():
    assert gpu_peak_bf16_flops("NVIDIA H100 PCIe") == 756.5e12
    assert gpu_peak_bf16_flops("NVIDIA H100 NVL") == 835.5e12
    assert gpu_peak_bf16_flops("NVIDIA H100 80GB HBM3") == gpu_peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert gpu_peak_bf16_flops("NVIDIA L4") is None
