"""Qwen3.5 on the fsdp backend (CPU, fp32): bundled config facts, padded-BSHD repacking against the packed
path, parity of a save_pretrained checkpoint with Hugging Face's Qwen3_5MoeForCausalLM, and the driver."""
import csv
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from fixtures.qwen3_5 import save_tiny_checkpoint
from sftprof.config import load_config
from sftprof.engine.fsdp import CausalLMForSFT, build_hf_causal_lm
from sftprof.loss import SFTLoss
from sftprof.models.layers.bshd import pad_sequences, repack
from sftprof.models.hf import load_hf_config

ROOT = Path(__file__).resolve().parents[1]


def test_bundled_qwen3_5_35b_a3b_matches_model_facts():
    c = load_hf_config("qwen3_5_35b_a3b")
    assert c.model_type == "qwen3_5_moe_text"
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 10
    facts = dict(hidden_size=2048, num_hidden_layers=40, full_attention_interval=4, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                 attn_output_gate=True, attention_bias=False, num_experts=256, num_experts_per_tok=8,
                 moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320,
                 max_position_embeddings=262144, rms_norm_eps=1e-6, mtp_num_hidden_layers=1,
                 router_aux_loss_coef=0.001, eos_token_id=248044, tie_word_embeddings=False)
    assert {k: getattr(c, k) for k in facts} == facts
    rope = c.rope_parameters
    assert (rope["rope_theta"], rope["partial_rotary_factor"], rope["mrope_interleaved"], rope["mrope_section"]) == \
        (10000000, 0.25, True, [11, 11, 10])


def _tiny_config(vocab=4096):
    c = load_hf_config("tiny_qwen3_5_moe")
    c.vocab_size = vocab
    return c


def _sft_model(cfg_overrides, hf_config):
    cfg = load_config("tiny_qwen3_5_cpu", cfg_overrides)
    causal_lm = build_hf_causal_lm(cfg, hf_config)
    return causal_lm, CausalLMForSFT(causal_lm, SFTLoss.from_config(cfg, hf_config.vocab_size))


@pytest.mark.parametrize("head_chunk", [0, 5])
def test_padded_bshd_repacks_to_the_packed_path(head_chunk):
    hf_config = _tiny_config()
    torch.manual_seed(3)
    _, model = _sft_model(["actor.loss.logprobs_chunk_size=7", f"actor.loss.lm_head_loss_chunk_size={head_chunk}"],
                          hf_config)
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 3, 14]
    ids = [torch.randint(0, hf_config.vocab_size, (n,), generator=gen) for n in lengths]
    labels = [torch.randint(0, hf_config.vocab_size, (n,), generator=gen) for n in lengths]
    weights = [(torch.rand(n, generator=gen) > 0.3).float() for n in lengths]
    with torch.no_grad():
        # Packed path: each sequence alone (what a packed varlen forward computes), tokens concatenated.
        packed = torch.cat([model.token_logprobs(i[None], l[None]) for i, l in zip(ids, labels)])
        packed_loss = sum(model(i[None], l[None], w[None]) for i, l, w in zip(ids, labels, weights))
        p_ids, mask = pad_sequences(ids, pad_value=0)
        p_labels, _ = pad_sequences(labels, pad_value=-100)  # padding labels must never be read
        p_weights, _ = pad_sequences(weights)
        padded = model.token_logprobs(p_ids, p_labels.clamp(min=0), attention_mask=mask)
        padded_loss = model(p_ids, p_labels.clamp(min=0), p_weights, attention_mask=mask)
    assert mask.sum(1).tolist() == lengths and padded.shape == (sum(lengths),)
    assert torch.allclose(padded, packed, atol=1e-5, rtol=0), (padded - packed).abs().max()
    assert torch.allclose(padded_loss, packed_loss, atol=1e-4, rtol=1e-6)
    assert repack(p_labels, mask).tolist() == torch.cat(labels).tolist()


def test_repack_refuses_left_padding():
    with pytest.raises(ValueError, match="prefix of True"):
        repack(torch.zeros(2, 3), torch.tensor([[False, True, True], [True, True, True]]))


def test_save_pretrained_checkpoint_logprobs_match_hugging_face(tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    hf_config = save_tiny_checkpoint(tmp_path)
    ref = Qwen3_5MoeForCausalLM.from_pretrained(str(tmp_path), attn_implementation="sdpa", dtype=torch.float32)
    loaded = load_hf_config(str(tmp_path))
    causal_lm, model = _sft_model([f"actor.path={tmp_path}", "actor.init_from_scratch=false"], loaded)
    assert type(causal_lm).__name__ == "Qwen3_5MoeForCausalLM"
    assert all(torch.equal(p, ref.state_dict()[n]) for n, p in causal_lm.state_dict().items())
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 80), generator=gen)
    labels = torch.roll(input_ids, -1, dims=1)
    with torch.no_grad():
        ours = model.token_logprobs(input_ids, labels)
        logits = ref(input_ids=input_ids, use_cache=False).logits.double()
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).flatten()
    err = (ours.double() - expected).abs().max().item()
    assert err <= 1e-5, err
    assert expected.std() > 0.01  # random weights that matter: log-probs differ per token


def test_tiny_qwen3_5_preset_through_the_driver(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "CONFIG")}
    env.update(CONFIG="tiny_qwen3_5_cpu", FILEROOT=str(tmp_path / "fileroot"), RUN_ROOT=str(tmp_path / "run"),
               PROFILE_STEPS="0", PROFILE_KINDS="kernel", PROFILE_STAMP="e2e", PROFILE_FAKE_SEQ_LEN="128", OMP_NUM_THREADS="1")
    out = subprocess.run(["bash", str(ROOT / "run_qwen3_30b_a3b_sft_profile.sh")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "run" / "summary.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [(r["trial"], r["kind"], r["step"], r["status"]) for r in rows] == [
        ("tiny_qwen3_5_moe_fake128_kernel_step0_e2e", "kernel", "0", "0")]
    log = (Path(rows[0]["log_dir"]) / "trainer.log").read_text()
    assert "Qwen3_5MoeForCausalLM" in log and "bundled Qwen3.5 BPE" in log
    assert "multi-token-prediction block (1 layer(s)) is not built or trained" in log
    assert "MFU are not reported" not in log  # sftprof.flops counts the gated delta-net layers
    records = [json.loads(line) for line in (Path(rows[0]["log_dir"]) / "stats.jsonl").read_text().splitlines()]
    step = next(r for r in records if r.get("step") == 0)
    assert step["loss"] > 0 and step["tflops_per_gpu"] is None
    summary = json.loads((Path(rows[0]["run_dir"]) / "profile_summary.json").read_text())
    assert summary["status"] == "ok"


def test_gated_delta_rule_reference_matches_transformers_torch_code():
    """The fp32 reference that the GPU test holds fla's gradients to is transformers' recurrence."""
    from fixtures.qwen3_5 import gated_delta_rule_reference, hf_torch_linear_attention, torch_function

    gen = torch.Generator().manual_seed(5)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 96, 3, 16, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(2, 96, 3, 8, generator=gen)
    g, beta = -torch.rand(2, 96, 3, generator=gen), torch.rand(2, 96, 3, generator=gen)
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    kernels = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
               "causal_conv1d_update")
    wrappers = {name: getattr(modeling, name) for name in kernels + ("create_causal_mask",)}
    with hf_torch_linear_attention():
        # every kernel wrapper is its torch function inside (the mask builder is left alone), restored after
        assert {n: getattr(modeling, n) for n in kernels} == {n: torch_function(wrappers[n]) for n in kernels}
        assert modeling.create_causal_mask is wrappers["create_causal_mask"]
        expected, _ = modeling.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                                            output_final_state=False, use_qk_l2norm_in_kernel=False)
    assert torch.allclose(gated_delta_rule_reference(q, k, v, g, beta), expected.float(), atol=2e-5, rtol=1e-4)
    assert {n: getattr(modeling, n) for n in wrappers} == wrappers
