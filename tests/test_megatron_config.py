"""CPU tests: HF config -> megatron-core TransformerConfig/GPTModel args, layout translation, precision
validation, init-from-scratch messages and Qwen3.5 support checks."""
import json

import pytest
import torch
import torch.nn.functional as F

from sftprof.allocation import parse_allocation_mode
from sftprof.config import ConfigError, load_config
from sftprof.models import megatron_config as mc
from sftprof.models.checks import check_model_settings
from sftprof.models.hf import CONFIG_DIR, load_hf_config

NO_PAO = ["actor.megatron.use_precision_aware_optimizer=false", "actor.megatron.main_grads_dtype=float32"]


@pytest.fixture(scope="module")
def cfg():
    return load_config("qwen3_30b_a3b_sft_profile.yaml", NO_PAO)


def test_qwen3_30b_a3b_transformer_config_fields(cfg):
    hf = load_hf_config("qwen3_30b_a3b")
    tc = mc.build_transformer_config(hf, cfg, parse_allocation_mode("megatron:d1"), have_te=False)
    expected = dict(
        num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
        kv_channels=128, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.001, layernorm_epsilon=1e-6, normalization="RMSNorm", qk_layernorm=True,
        gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=False, attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=0.02, bf16=True, fp16=False, params_dtype=torch.bfloat16, sequence_parallel=False,
        tensor_model_parallel_size=1, expert_model_parallel_size=1, moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        deterministic_mode=False, calculate_per_token_loss=True, gradient_accumulation_fusion=False,
        moe_grouped_gemm=False, apply_rope_fusion=True, layernorm_zero_centered_gamma=False)
    for key, value in expected.items():
        assert getattr(tc, key) == value, key
    from megatron.core.models.common.embeddings import rope_utils

    from sftprof.models.layers.rope import fused_apply_rotary_pos_emb
    assert rope_utils.fused_apply_rotary_pos_emb is fused_apply_rotary_pos_emb  # RoPE fusion without TE: ours
    assert tc.activation_func is F.silu
    assert tc.experimental_attention_variant is None
    gpt = mc.gpt_model_kwargs(hf)
    assert gpt == dict(vocab_size=151936, max_sequence_length=40960, position_embedding_type="rope",
                       rotary_base=1_000_000.0, rotary_percent=1.0, share_embeddings_and_output_weights=False,
                       parallel_output=True)


def test_routing_renormalisation_follows_norm_topk_prob(cfg):
    hf = load_hf_config("tiny_qwen3_moe")
    assert mc.hf_to_transformer_kwargs(hf)["moe_router_pre_softmax"] is False
    hf.norm_topk_prob = False  # softmax over all experts, no renormalisation of the top-k
    assert mc.hf_to_transformer_kwargs(hf)["moe_router_pre_softmax"] is True


def test_megatron_top_k_then_softmax_equals_softmax_then_renormalised_top_k():
    # the routing moe_router_pre_softmax=False computes (megatron moe_utils.topk_routing_with_score_function)
    torch.manual_seed(0)
    logits = torch.randn(16, 128, dtype=torch.float64)
    top, idx = logits.topk(8, dim=-1)
    megatron_probs = top.softmax(-1)
    hf_probs = logits.softmax(-1).gather(-1, idx)
    hf_probs = hf_probs / hf_probs.sum(-1, keepdim=True)  # Qwen3MoeSparseMoeBlock with norm_topk_prob
    torch.testing.assert_close(megatron_probs, hf_probs, rtol=1e-12, atol=1e-12)


def test_transformers5_style_keys(tmp_path):
    raw = json.loads(open(CONFIG_DIR / "tiny_qwen3_moe" / "config.json").read())
    raw["num_local_experts"] = raw.pop("num_experts")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta") * 10}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = load_hf_config(str(tmp_path))
    assert mc.hf_to_transformer_kwargs(hf)["num_moe_experts"] == 8
    assert mc.gpt_model_kwargs(hf)["rotary_base"] == 10_000_000.0


@pytest.mark.parametrize("mode,expected", [
    ("megatron:d2", dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                         expert_model_parallel_size=1, expert_tensor_parallel_size=1)),
    ("megatron:(attn:d2c4|ffn:d1e8)", dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                           context_parallel_size=4, expert_model_parallel_size=8,
                                           expert_tensor_parallel_size=1)),
    ("megatron:(attn:t2|ffn:e2)", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                       context_parallel_size=1, expert_model_parallel_size=2,
                                       expert_tensor_parallel_size=1)),
    ("megatron:d2t2p2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=1,
                             expert_model_parallel_size=1, expert_tensor_parallel_size=2)),
])
def test_parallel_state_kwargs(mode, expected):
    assert mc.parallel_state_kwargs(parse_allocation_mode(mode)) == dict(expected, order="tp-cp-ep-dp-pp")


def test_sequence_parallel_on_with_tp(cfg):
    hf = load_hf_config("qwen3_30b_a3b", 4)
    tc = mc.build_transformer_config(hf, cfg, parse_allocation_mode("megatron:(attn:t2|ffn:e2)"), have_te=False)
    assert tc.sequence_parallel is True and tc.tensor_model_parallel_size == 2 and tc.num_layers == 4


def test_fsdp_layout_rejected():
    with pytest.raises(ConfigError, match="not 'megatron'"):
        mc.parallel_state_kwargs(parse_allocation_mode("fsdp:d2"))


def test_recompute_none_and_router_dtype_none():
    cfg = load_config("qwen3_30b_a3b_sft_profile.yaml", NO_PAO + [
        "actor.megatron.recompute_granularity=none", "actor.megatron.moe_router_dtype=none",
        "actor.megatron.use_deterministic_algorithms=true"])
    kw = mc.training_config_kwargs(cfg, have_te=False)
    assert "recompute_granularity" not in kw and kw["moe_router_dtype"] is None and kw["deterministic_mode"] is True
    cfg = load_config("qwen3_30b_a3b_sft_profile.yaml", NO_PAO + ["actor.megatron.recompute_granularity=selective"])
    kw = mc.training_config_kwargs(cfg, have_te=False)
    assert kw["recompute_granularity"] == "selective" and "recompute_method" not in kw


def test_te_runs_megatron_cores_fused_swiglu():
    """With TE the grouped MLP's SwiGLU and probability multiply are megatron-core's fused kernel (Megatron-LM's default);
    unfused they took ~135 ms of the 4-layer 131072-token step on the H200 (bench/NOTES.md). Without TE the local
    experts fuse them themselves."""
    cfg = load_config("qwen3_30b_a3b_sft_profile.yaml", NO_PAO)
    assert mc.training_config_kwargs(cfg, have_te=True)["bias_activation_fusion"] is True
    assert mc.training_config_kwargs(cfg, have_te=False)["bias_activation_fusion"] is False


def test_precision_aware_optimizer_without_te_names_the_variable():
    cfg = load_config("qwen3_30b_a3b_sft_profile.yaml")  # YAML default: precision-aware, bf16 main grads
    with pytest.raises(ConfigError, match="USE_PRECISION_AWARE_OPTIMIZER") as err:
        mc.optimizer_config_kwargs(cfg, have_te=False)
    assert "MAIN_GRADS_DTYPE=float32" in str(err.value)


def test_precision_aware_optimizer_with_te_translates_dtypes():
    cfg = load_config("qwen3_30b_a3b_sft_profile.yaml", ["actor.megatron.exp_avg_dtype=bfloat16",
                                                          "actor.megatron.exp_avg_sq_dtype=uint8"])
    kw = mc.optimizer_config_kwargs(cfg, have_te=True)
    assert (kw["use_precision_aware_optimizer"], kw["main_grads_dtype"], kw["main_params_dtype"], kw["exp_avg_dtype"],
            kw["exp_avg_sq_dtype"]) == (True, torch.bfloat16, torch.float32, torch.bfloat16, torch.uint8)
    assert (kw["lr"], kw["adam_beta2"], kw["adam_eps"], kw["clip_grad"], kw["weight_decay"]) == (2e-5, 0.95, 1e-5, 1.0, 0.05)


def test_optimizer_config_accepted_by_megatron(cfg):
    from megatron.core.optimizer import OptimizerConfig

    oc = OptimizerConfig(**mc.optimizer_config_kwargs(cfg, have_te=False))
    assert oc.use_precision_aware_optimizer is False and oc.main_grads_dtype == torch.float32
    from megatron.core.distributed import DistributedDataParallelConfig

    dc = DistributedDataParallelConfig(**mc.ddp_config_kwargs(cfg))
    assert (dc.grad_reduce_in_fp32, dc.overlap_grad_reduce, dc.use_distributed_optimizer) == (False, True, True)


def test_non_fp32_dtype_needs_precision_aware_optimizer(cfg):
    from dataclasses import replace

    m = replace(cfg.actor.megatron, main_params_dtype="float16")
    with pytest.raises(ConfigError, match="main_params_dtype='float16'.*USE_PRECISION_AWARE_OPTIMIZER"):
        mc.optimizer_precision(m, have_te=True)


def test_qwen3_5_mapping_and_support_check():
    from sftprof.models.specs import check_model_supported

    hf = load_hf_config("qwen3_5_35b_a3b")
    kw = mc.hf_to_transformer_kwargs(hf)
    assert (kw["experimental_attention_variant"], kw["linear_attention_freq"], kw["kv_channels"],
            kw["moe_shared_expert_intermediate_size"], kw["moe_shared_expert_gate"], kw["attention_output_gate"],
            kw["layernorm_zero_centered_gamma"], kw["linear_num_value_heads"], kw["num_query_groups"]) == \
        ("gated_delta_net", 4, 256, 512, True, True, True, 32, 2)
    gpt = mc.gpt_model_kwargs(hf)
    assert (gpt["rotary_base"], gpt["rotary_percent"], gpt["vocab_size"]) == (10_000_000.0, 0.25, 248320)
    cfg = load_config("qwen3_30b_a3b_sft_profile.yaml", NO_PAO + ["actor.path=qwen3_5_35b_a3b"])
    tc = mc.build_transformer_config(hf, cfg, parse_allocation_mode("megatron:d1"), have_te=False)
    from unittest import mock

    from sftprof.compat import GATED_DELTA_NET_CP, gated_delta_net_kernels, megatron_at_least

    with mock.patch.object(gated_delta_net_kernels(), "HAVE_FLA", False):
        with pytest.raises(NotImplementedError, match="need flash-linear-attention kernels: install "
                                                      "flash-linear-attention==0.6.0 and fla-core==0.6.0"):
            check_model_supported(tc)
    cp2 = parse_allocation_mode("megatron:(attn:c2|ffn:e2)")
    if megatron_at_least(GATED_DELTA_NET_CP):
        assert mc.build_transformer_config(hf, cfg, cp2, have_te=False).context_parallel_size == 2
    else:
        # megatron-core's own config validation refuses CP too (sftprof stops earlier: check_linear_attention_layout)
        with pytest.raises(AssertionError, match="Gated delta net does not support context parallel"):
            mc.build_transformer_config(hf, cfg, cp2, have_te=False)


def test_unsupported_hf_configs():
    hf = load_hf_config("tiny_qwen3_moe")
    hf.mlp_only_layers = [0]
    with pytest.raises(ValueError, match="mlp_only_layers"):
        mc.hf_to_transformer_kwargs(hf)
    hf = load_hf_config("tiny_qwen3_moe")
    hf.model_type = "llama"
    with pytest.raises(ValueError, match="model_type 'llama'"):
        mc.hf_to_transformer_kwargs(hf)


def test_every_accepted_model_type_builds_on_both_backends():
    """load_hf_config accepts the model types of MODEL_TYPES only (the driver and trainer refuse others before
    launch): each one's text model is one the fsdp backend builds (a transformers class) and megatron maps."""
    import transformers

    from sftprof.models.hf import BUNDLED_CONFIGS, CAUSAL_LM_CLASSES, MODEL_TYPES

    raw_types = {json.loads((CONFIG_DIR / name / "config.json").read_text())["model_type"]: name
                 for name in BUNDLED_CONFIGS}
    assert sorted(raw_types) == sorted(MODEL_TYPES) == sorted(mc.SUPPORTED_MODEL_TYPES)   # each one has a config here
    for model_type, name in raw_types.items():
        text_type = load_hf_config(name).model_type
        assert text_type in mc.SUPPORTED_MODEL_TYPES, (model_type, text_type)
        assert isinstance(getattr(transformers, CAUSAL_LM_CLASSES[text_type]), type), (model_type, text_type)


def test_init_from_scratch_false_messages(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((CONFIG_DIR / "tiny_qwen3_moe" / "config.json").read_text())
    hf = load_hf_config(str(model_dir))
    layout = parse_allocation_mode("megatron:d1")
    cfg = load_config("tiny_cpu", [f"actor.path={model_dir}", "actor.init_from_scratch=false"])
    with pytest.raises(ConfigError, match=r"holds no safetensors checkpoint \(model.safetensors.index.json or "
                                          r"model.safetensors\).*actor.init_from_scratch=true"):
        check_model_settings(cfg, hf, layout)
    (model_dir / "model.safetensors").write_bytes(b"")
    check_model_settings(cfg, hf, layout)  # a checkpoint is present (read later, by the engine)
    hf.model_type = "qwen2_moe"
    with pytest.raises(ConfigError, match="loads weights of \\['qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_moe'\\], not model_type 'qwen2_moe'"):
        check_model_settings(cfg, hf, layout)
    check_model_settings(load_config("tiny_cpu", [f"actor.path={model_dir}"]), hf, layout)  # random init


def test_chunked_lm_head_needs_vocab_divisible_by_tp():
    hf = load_hf_config("tiny_qwen3_moe")
    hf.vocab_size = 151937
    cfg = load_config("tiny_cpu", ["actor.loss.lm_head_loss_chunk_size=2048"])
    with pytest.raises(ConfigError, match="lm_head_loss_chunk_size=2048: the chunked LM-head loss needs a vocabulary "
                                          "divisible by TP=2 \\(vocab_size 151937\\)"):
        check_model_settings(cfg, hf, parse_allocation_mode("megatron:t2"))
    check_model_settings(cfg, hf, parse_allocation_mode("megatron:d2"))
    assert mc.gpt_model_kwargs(hf, 2)["vocab_size"] == 151938
    assert mc.gpt_model_kwargs(hf, 1)["vocab_size"] == 151937


@pytest.mark.parametrize("backend,overrides,message", [
    ("megatron:t8", [], "num_key_value_heads=4 is not divisible by TP=8"),
    ("megatron:(attn:d3|ffn:e3)", ["train_dataset.batch_size=3"], "num_experts=128 is not divisible by EP=3"),
    ("megatron:p5", [], "num_hidden_layers=48 is not divisible by PP=5"),
    ("megatron:c4", ["profile.fake_seq_len=1004"], "fake_seq_len=1004: must be divisible by 2\\*CP=8"),
    ("megatron:(attn:c2t4|ffn:e8)", ["profile.fake_seq_len=1020"], "per-CP-rank length by TP=4"),
])
def test_layouts_that_do_not_split_the_model_are_refused(backend, overrides, message):
    hf = load_hf_config("qwen3_30b_a3b")
    layout = parse_allocation_mode(backend)
    cfg = load_config("tiny_cpu", [f"actor.backend={backend}", "train_dataset.batch_size=8"] + overrides)
    with pytest.raises(ConfigError, match=message):
        check_model_settings(cfg, hf, layout)


def test_gated_delta_net_heads_must_split_by_tp_and_cp():
    """Qwen3.5's 16 gated delta-net key heads under TP = 2 x CP = 16: refused before launch, as CP itself is before
    megatron-core 0.18 (whose gated delta-net has no context parallelism)."""
    import importlib.util
    from unittest import mock

    from sftprof.compat import GATED_DELTA_NET_CP, megatron_at_least

    hf = load_hf_config("qwen3_5_35b_a3b")
    backend = "megatron:(attn:t2c16|ffn:e32)"
    cfg = load_config("tiny_cpu", [f"actor.backend={backend}", "train_dataset.batch_size=8"])
    message = (r"linear_num_key_heads=16 is not divisible by TPxCP=32" if megatron_at_least(GATED_DELTA_NET_CP)
               else r"context parallelism \(CP=16\) is not supported for qwen3_5_moe_text with megatron-core")
    find_spec = importlib.util.find_spec
    with mock.patch("importlib.util.find_spec", lambda name, *a: object() if name == "fla" else find_spec(name, *a)), \
            pytest.raises(ConfigError, match=message):
        check_model_settings(cfg, hf, parse_allocation_mode(backend))


def test_use_fused_torch_adam_switches_torch_adam_before_the_first_step_only():
    """megatron-core's torch fallback Adam gets torch's fused kernel; the step matches foreach's to fp32 rounding;
    an optimizer that has stepped, or SGD, is left alone."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    w = [torch.randn(5, 7), torch.randn(7)]
    grads = [torch.randn(5, 7), torch.randn(7)]

    def build(cls=torch.optim.AdamW, **kw):
        params = [torch.nn.Parameter(t.clone()) for t in w]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params, cls(params, lr=1e-2, weight_decay=0.05, **kw)

    ref_params, ref = build(betas=(0.9, 0.95), eps=1e-5, foreach=True)
    params, opt = build(betas=(0.9, 0.95), eps=1e-5)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=opt)])
    assert mc.use_fused_torch_adam(chained) == 1 and opt.param_groups[0]["fused"] is True
    for _ in range(3):
        ref.step()
        opt.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert mc.use_fused_torch_adam(chained) == 0  # state exists now: nothing changes
    _, sgd = build(torch.optim.SGD)
    assert mc.use_fused_torch_adam(SimpleNamespace(optimizer=sgd)) == 0
