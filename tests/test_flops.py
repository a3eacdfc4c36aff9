"""CPU tests of the model FLOP count (sftprof.flops) against hand counts of every GEMM, and Qwen3.5's against
torch's FlopCounterMode over Hugging Face's modules (meta device: shapes only)."""
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fixtures.qwen3_5 import hf_torch_linear_attention
from sftprof.flops import ModelShape, delta_rule_flops, forward_flops, gpu_peak_bf16_flops, mfu, train_step_flops
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
    hf = load_hf_config("tiny_qwen3_5_moe")
    hf.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="layer types \\['sliding_attention'\\]"):
        ModelShape.from_hf(hf)
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


def hand_qwen3_5_layers(s):
    """Forward FLOPs of one gated delta-net layer and one full-attention layer of tiny_qwen3_5_moe over s tokens, as
    (gdn projections, conv1d, delta rule, attention projections, attention core, MoE), by hand."""
    # tiny_qwen3_5_moe: h=64; GDN: 2 key heads / 4 value heads of 16, conv width 4; attention: 4 q / 2 kv heads of
    # 32 with the output gate in q_proj; 4 experts top-2 of ffn 32, shared expert 32 with its gate
    h, nk, nv, dk, dv, w, nq, nkv, d = 64, 2, 4, 16, 16, 4, 4, 2, 32
    proj = gemm(s, h, 2 * nk * dk + 2 * nv * dv + 2 * nv) + gemm(s, nv * dv, h)  # in_proj (q k v z b a), out_proj
    conv = 2 * w * s * (2 * nk * dk + nv * dv)  # depthwise: w multiply-adds per q/k/v channel and token
    c = 64  # fla's chunk; the last chunk is padded to 64 tokens
    chunk = (gemm(c, dk, c)  # beta K K^T
             + c ** 3 / 3  # (I + A)^-1, unit lower-triangular
             + gemm(c, c, dk) + gemm(c, c, dv)  # W = T (beta e^g K), U = T (beta V)
             + gemm(c, dk, dv) + gemm(dk, c, dv)  # V' = U - W S, S += K^T V'
             + gemm(c, dk, dv) + gemm(c, dk, c) + gemm(c, c, dv))  # Q S, Q K^T, P V'
    core = nv * -(-s // c) * chunk
    attn = gemm(s, h, 2 * nq * d) + 2 * gemm(s, h, nkv * d) + gemm(s, nq * d, h)
    attn_core = sum(2 * (2 * d * (i + 1)) * nq for i in range(s))
    moe = gemm(s, h, 4) + 2 * (gemm(s, h, 64) + gemm(s, 32, h)) + gemm(s, h, 64) + gemm(s, 32, h) + gemm(s, h, 1)
    return proj, conv, core, attn, attn_core, moe


def test_qwen3_5_forward_matches_hand_count():
    shape = ModelShape.from_hf(load_hf_config("tiny_qwen3_5_moe"))  # 3 gated delta-net layers, then full attention
    assert shape.layer_types == ("linear_attention",) * 3 + ("full_attention",) and shape.attn_output_gate
    got = forward_flops(shape, [100, 128])
    a, b = hand_qwen3_5_layers(100), hand_qwen3_5_layers(128)
    proj, conv, core, attn, attn_core, moe = (x + y for x, y in zip(a, b))
    assert (got.gdn_proj, got.gdn_conv, got.gdn_core) == (3 * proj, 3 * conv, 3 * core)
    assert (got.attn_linear, got.attn_core) == (attn, attn_core)
    assert got.router + got.routed_experts + got.shared_experts == 4 * moe
    assert got.lm_head == gemm(228, 64, 248320)
    # per chunk and value head: 6 C dk dv + 6 C^2 dk + 4 C^2 dv + C^3 / 3 = 98304 + 393216 + 262144 + 87381.33
    assert delta_rule_flops(128, 16, 16) == 2 * (98304 + 393216 + 262144 + 64 ** 3 / 3)
    assert delta_rule_flops(100, 16, 16) == delta_rule_flops(128, 16, 16) == 2 * delta_rule_flops(64, 16, 16)
    # the literal count for one 128-token sequence
    assert forward_flops(shape, [128]).total == pytest.approx(4_133_847_040, abs=1e-3)


def test_qwen3_5_recompute_counts_the_layers_it_reruns():
    shape = ModelShape.from_hf(load_hf_config("tiny_qwen3_5_moe"))
    fwd = forward_flops(shape, [128])
    proj, conv, core, attn, attn_core, moe = hand_qwen3_5_layers(128)
    assert train_step_flops(shape, [128]).model == 3 * fwd.total
    assert train_step_flops(shape, [128], "full").recompute == fwd.decoder
    # block: the first layer of each pipeline stage; pp=2 gives layers 0 and 2, both gated delta-net layers
    gdn_layer = proj + conv + core + moe
    assert train_step_flops(shape, [128], "full", "block", 1, pp=1).recompute == pytest.approx(gdn_layer, rel=1e-12)
    assert train_step_flops(shape, [128], "full", "block", 1, pp=2).recompute == pytest.approx(2 * gdn_layer, rel=1e-12)
    assert train_step_flops(shape, [128], "full", "block", 2, pp=2).recompute == fwd.decoder
    assert train_step_flops(shape, [128], "selective").recompute == fwd.attn_core == attn_core


def _counted_by_torch(name, seq_len, monkeypatch):
    """FlopCounterMode's FLOPs per module of Hugging Face's Qwen3_5MoeForCausalLM built from the bundled config
    ``name`` on the meta device (no weights, no arithmetic: only shapes), one forward of ``seq_len`` tokens.

    Its pure-torch delta rule (``torch_chunk_gated_delta_rule``) on the branch that forms ``(I + A)^-1`` and multiplies
    by it (the branch it takes while exporting; by default it calls ``torch.linalg.solve_triangular``, which
    FlopCounterMode does not count), eager attention without a mask, experts as batched matmuls (the eager experts
    pick tokens by value, which the meta device cannot)."""
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    hf = load_hf_config(name)
    monkeypatch.setattr(modeling, "is_torchdynamo_exporting", lambda: True)
    with hf_torch_linear_attention():
        with torch.device("meta"):
            model = Qwen3_5MoeForCausalLM._from_config(hf, attn_implementation="eager")
        model.config._experts_implementation = "batched_mm"
        ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(input_ids=ids, attention_mask={"full_attention": None, "linear_attention": None}, use_cache=False)
    per_module = counter.get_flop_counts()  # a module's counts include its children's

    def own(pattern, op=None):
        """FLOPs of the modules matching ``pattern`` less their children's (of op ``op`` only, when given)."""
        def count(mod):
            return sum(n for o, n in per_module[mod].items() if op is None or str(o) == op)
        mods = [m for m in per_module if re.fullmatch(pattern, m)]
        return sum(count(m) for m in mods) - sum(count(c) for c in per_module for m in mods
                                                 if c.startswith(m + ".") and "." not in c[len(m) + 1:])

    return hf, counter.get_total_flops(), own


def test_qwen3_5_35b_a3b_count_matches_torchs_flop_counter(monkeypatch):
    s = 1024
    hf, counted, own = _counted_by_torch("qwen3_5_35b_a3b", s, monkeypatch)
    ours = forward_flops(ModelShape.from_hf(hf), [s])
    layer = r"Qwen3_5MoeForCausalLM\.model\.layers\.\d+"
    assert ours.attn_linear == own(layer + r"\.self_attn\.[qkvo]_proj")
    assert ours.gdn_proj == own(layer + r"\.linear_attn\.(in_proj_\w+|out_proj)")
    assert ours.router == own(layer + r"\.mlp\.gate")
    assert ours.routed_experts == own(layer + r"\.mlp\.experts")
    assert ours.shared_experts == own(layer + r"\.mlp\.shared_expert\.\w+") + own(layer + r"\.mlp\.shared_expert_gate")
    assert ours.lm_head == own(r"Qwen3_5MoeForCausalLM\.lm_head")
    # What the counter sees differently, by construction: eager attention computes all s x s scores (we count the
    # causal half); torch's conv1d pads by w - 1 on both sides and the model keeps the first s of its s + w - 1
    # outputs; the forward substitution that forms (I + A)^-1 is elementwise (not counted by FlopCounterMode).
    attn_core = own(layer + r"\.self_attn")
    assert attn_core == 10 * 4 * 16 * 256 * s * s and ours.attn_core == attn_core * (s + 1) / (2 * s)
    conv = own(layer + r"\.linear_attn", "aten.convolution")
    assert conv == 30 * 2 * 4 * (2 * 16 * 128 + 32 * 128) * (s + 3) and ours.gdn_conv == conv * s / (s + 3)
    delta_rule = own(layer + r"\.linear_attn") - conv
    inverse = 30 * 32 * (s // 64) * 64 ** 3 / 3
    assert ours.gdn_core - inverse == pytest.approx(delta_rule, rel=1e-12)
    # nothing else is counted on either side
    assert ours.total - ours.attn_core - ours.gdn_conv - ours.gdn_core == counted - attn_core - conv - delta_rule
