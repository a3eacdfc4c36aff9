"""Hugging Face qwen3_moe checkpoint -> megatron-core parameters, on CPU.

- The loader fills a real megatron-core ``GPTModel`` (local spec, built on CPU) from a checkpoint written by
  ``save_pretrained``, and megatron's own modules then compute what the Hugging Face modules compute
  (QKV split with q/k norms, output projection, router, each expert's SwiGLU, norms, embedding).
- Every checkpoint tensor is read by exactly one megatron parameter.
- Sharding arithmetic: for TP, ETP and EP of 2 and 4, the ranks' shards put back together are the
  unsharded tensors (and the vocabulary padding rows are zero).
- Errors name the file or the tensors.
"""
import json
import shutil
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_checkpoints import write_qwen3_moe
from safetensors.torch import load_file, save_file

from sftprof.models.checkpoint import CheckpointError, DictSource, SafetensorsCheckpoint
from sftprof.models.qwen3_moe_weights import ShardContext, local_tensor, padded_vocab_size


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_qwen3_moe(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def megatron_cpu(ckpt, tmp_path_factory):
    """A megatron-core GPTModel (layout d1, local spec, SequentialMLP experts) built on CPU, and the HF config."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from sftprof.allocation import parse_allocation_mode
    from sftprof.compat import apply_megatron_compat
    from sftprof.config import load_config
    from sftprof.models import megatron_config as mc
    from sftprof.models.hf import load_hf_config
    from sftprof.models.specs import decoder_block_spec

    store = tmp_path_factory.mktemp("store") / "filestore"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    apply_megatron_compat()
    cfg = load_config("tiny_cpu", ["actor.backend=megatron:d1", "actor.dtype=float32", f"actor.path={ckpt}",
                                   "actor.megatron.moe_token_dispatcher_type=allgather"])  # alltoall needs CUDA streams
    layout = parse_allocation_mode(cfg.actor.backend)
    hf = load_hf_config(cfg.actor.path)
    parallel_state.initialize_model_parallel(**mc.parallel_state_kwargs(layout))
    kw = {**mc.hf_to_transformer_kwargs(hf), **mc.parallel_config_kwargs(layout), **mc.training_config_kwargs(cfg, False),
          "use_cpu_initialization": True}
    tcfg = TransformerConfig(**kw)
    gpt = GPTModel(config=tcfg, transformer_layer_spec=decoder_block_spec(tcfg, False), pre_process=True,
                   post_process=True, **mc.gpt_model_kwargs(hf))
    yield gpt, hf
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_loaded_megatron_modules_compute_what_hf_computes(ckpt, megatron_cpu):
    from transformers import Qwen3MoeForCausalLM

    from sftprof.models.megatron_load import load_hf_checkpoint

    gpt, hf = megatron_cpu
    report = load_hf_checkpoint(gpt, ckpt, hf)
    files = SafetensorsCheckpoint(ckpt)
    assert report["tensors_read"] == len(files.names) == 2 + 1 + 2 * (9 + 3 * 4)
    assert report["bytes_read"] == sum(p.numel() * 4 for p in gpt.parameters())  # fp32, read once each
    ref = Qwen3MoeForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    torch.manual_seed(1)
    x = torch.randn(7, 1, hf.hidden_size)
    with torch.no_grad():
        assert torch.equal(gpt.embedding.word_embeddings.weight, ref.model.embed_tokens.weight)
        assert torch.equal(gpt.output_layer.weight, ref.lm_head.weight)
        assert torch.equal(gpt.decoder.final_layernorm(x), ref.model.norm(x))
        for g in range(hf.num_hidden_layers):
            layer, ref_layer = gpt.decoder.layers[g], ref.model.layers[g]
            assert torch.allclose(layer.input_layernorm(x), ref_layer.input_layernorm(x), atol=1e-6)
            assert torch.allclose(layer.pre_mlp_layernorm(x), ref_layer.post_attention_layernorm(x), atol=1e-6)
            att, ref_att = layer.self_attention, ref_layer.self_attn
            q, k, v = att.get_query_key_value_tensors(x)[:3]  # [s, b, heads, d] after q/k norms
            d = hf.head_dim
            assert torch.allclose(q[:, 0], ref_att.q_norm(ref_att.q_proj(x[:, 0]).view(7, -1, d)), atol=1e-6)
            assert torch.allclose(k[:, 0], ref_att.k_norm(ref_att.k_proj(x[:, 0]).view(7, -1, d)), atol=1e-6)
            assert torch.equal(v[:, 0], ref_att.v_proj(x[:, 0]).view(7, -1, d))
            ctx = torch.randn(7, 1, hf.num_attention_heads * d)
            assert torch.allclose(att.linear_proj(ctx)[0], ref_att.o_proj(ctx), atol=1e-6)
            assert torch.equal(layer.mlp.router.weight, ref_layer.mlp.gate.weight)  # its gating GEMM needs CUDA
            experts = ref_layer.mlp.experts  # transformers 5 keeps experts fused in memory
            for e in range(hf.num_experts):
                gate, up = F.linear(x[:, 0], experts.gate_up_proj[e]).chunk(2, dim=-1)
                want = F.linear(F.silu(gate) * up, experts.down_proj[e])
                got, _ = layer.mlp.experts.local_experts[e](x[:, 0])
                assert torch.allclose(got, want, atol=1e-6), (g, e)


def test_every_checkpoint_tensor_is_read_by_exactly_one_parameter(ckpt, megatron_cpu):
    gpt, hf = megatron_cpu
    files = SafetensorsCheckpoint(ckpt)
    ctx = _ctx(hf, layers=tuple(range(hf.num_hidden_layers)))
    readers = Counter()
    for name, _ in gpt.named_parameters():
        src = SafetensorsCheckpoint(ckpt)
        local_tensor(name, src, ctx)
        readers.update(src.consumed)
    assert set(readers) == files.names
    assert [n for n, c in readers.items() if c != 1] == []


def test_megatron_load_matches_the_checkpoint_whole_first(ckpt, megatron_cpu, tmp_path):
    """A checkpoint without a layer's router is refused before any parameter is written, naming the tensor."""
    from sftprof.models.megatron_load import load_hf_checkpoint

    gpt, hf = megatron_cpu
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.gate.weight"
    shard = bad / index["weight_map"].pop(name)
    save_file({k: v for k, v in load_file(shard).items() if k != name}, str(shard), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    before = {n: p.clone() for n, p in gpt.named_parameters()}
    with pytest.raises(CheckpointError, match=rf"^{bad}/model.safetensors.index.json: 1 tensor\(s\) that the qwen3_moe "
                                              rf"model of 2 layer\(s\) reads are not in the checkpoint: {name}; "):
        load_hf_checkpoint(gpt, bad, hf)
    assert all(torch.equal(p, before[n]) for n, p in gpt.named_parameters())


def _ctx(hf, tp=(0, 1), etp=(0, 1), ep=(0, 1), layers=(0, 1)) -> ShardContext:
    return ShardContext(tp_rank=tp[0], tp_size=tp[1], etp_rank=etp[0], etp_size=etp[1], ep_rank=ep[0], ep_size=ep[1],
                        num_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
                        head_dim=hf.head_dim, num_experts=hf.num_experts, vocab_size=hf.vocab_size,
                        tied=False, layer_numbers=layers)


@pytest.mark.parametrize("size", [2, 4])
def test_shards_put_back_together_are_the_unsharded_tensors(ckpt, size):
    from sftprof.models.hf import load_hf_config

    hf = load_hf_config(str(ckpt))
    src = SafetensorsCheckpoint(ckpt)
    one = _ctx(hf)
    L = "decoder.layers.1."
    full = {n: local_tensor(n, src, one) for n in [
        "embedding.word_embeddings.weight", "output_layer.weight", L + "self_attention.linear_qkv.weight",
        L + "self_attention.linear_proj.weight", L + "mlp.experts.weight1", L + "mlp.experts.weight2"]}
    # TP (attention): vocabulary rows (padded), query groups of the fused QKV, output-projection columns.
    if hf.num_key_value_heads % size == 0:
        qkv = [local_tensor(L + "self_attention.linear_qkv.weight", src, _ctx(hf, tp=(r, size))) for r in range(size)]
        assert torch.equal(torch.cat(qkv), full[L + "self_attention.linear_qkv.weight"])
    proj = [local_tensor(L + "self_attention.linear_proj.weight", src, _ctx(hf, tp=(r, size))) for r in range(size)]
    assert torch.equal(torch.cat(proj, dim=1), full[L + "self_attention.linear_proj.weight"])
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = torch.cat([local_tensor(name, src, _ctx(hf, tp=(r, size))) for r in range(size)])
        assert rows.shape[0] == padded_vocab_size(250, size) == {2: 250, 4: 252}[size]
        assert torch.equal(rows[:250], full[name]) and not rows[250:].any()
    # EP: each rank holds E/ep consecutive experts. ETP: fc1 rows [gate_t; up_t], fc2 columns.
    for ep in (1, size):
        for etp in (1, 2):
            w1 = [[local_tensor(L + "mlp.experts.weight1", src, _ctx(hf, ep=(e, ep), etp=(t, etp))) for t in range(etp)]
                  for e in range(ep)]
            w2 = [[local_tensor(L + "mlp.experts.weight2", src, _ctx(hf, ep=(e, ep), etp=(t, etp))) for t in range(etp)]
                  for e in range(ep)]
            gate = torch.cat([torch.cat([w.chunk(2, dim=2)[0] for w in row], dim=2) for row in w1])
            up = torch.cat([torch.cat([w.chunk(2, dim=2)[1] for w in row], dim=2) for row in w1])
            assert torch.equal(torch.cat([gate, up], dim=2), full[L + "mlp.experts.weight1"])
            assert torch.equal(torch.cat([torch.cat(row, dim=1) for row in w2]), full[L + "mlp.experts.weight2"])


def test_fused_expert_layout_reads_like_per_expert_layout(ckpt):
    from transformers import Qwen3MoeForCausalLM

    from sftprof.models.hf import load_hf_config

    hf = load_hf_config(str(ckpt))
    model = Qwen3MoeForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    fused = DictSource({n: p.detach() for n, p in model.named_parameters()})
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    files = SafetensorsCheckpoint(ckpt)
    for etp in (1, 2):
        for name in ("decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"):
            ctx = _ctx(hf, etp=(etp - 1, etp))
            assert torch.equal(local_tensor(name, fused, ctx), local_tensor(name, files, ctx))


def test_checkpoint_errors_name_the_file_or_tensors(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (bad / shard).write_bytes(b"\x00" * 16)
    src = SafetensorsCheckpoint(bad)
    name = next(n for n, f in index["weight_map"].items() if f == shard)
    with pytest.raises(CheckpointError, match=f"{bad / shard}: not a readable safetensors file"):
        src.read(name)
    (bad / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{bad / shard}: shard named by model.safetensors.index.json is missing"):
        SafetensorsCheckpoint(bad)
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="tensor 'model.nope' is missing from the checkpoint"):
        SafetensorsCheckpoint(ckpt).read("model.nope")
    from sftprof.models.checkpoint import check_all_consumed
    with pytest.raises(CheckpointError, match=r"x: 2 checkpoint tensor\(s\) were not loaded into the model: b, c$"):
        check_all_consumed({"a", "b", "c"}, [{"a"}, set()], "x")
    with pytest.raises(CheckpointError, match="'decoder.layers.0.mlp.foo' has no qwen3_moe mapping rule"):
        local_tensor("decoder.layers.0.mlp.foo", DictSource({}), _ctx(SimpleHF()))
    with pytest.raises(ValueError, match=r"etp_rank=1 outside \[0, etp_size=1\)"):
        _ctx(SimpleHF(), etp=(1, 1))


class SimpleHF:
    num_attention_heads, num_key_value_heads, head_dim, num_experts, vocab_size = 4, 2, 16, 4, 250


def test_model_part_registration_of_the_megatron_model(megatron_cpu):
    """Every model part of megatron-core's GPTModel is registered for the trace ranges, with its global layer."""
    from sftprof.capture import module_regions

    gpt, hf = megatron_cpu
    module_regions.register_model(gpt)
    mine = Counter(module_regions.module_part(path) for path, _ in gpt.named_modules())
    for layer in range(hf.num_hidden_layers):
        assert {p: mine[(p, layer)] for p in module_regions.PARTS[:11]} == {
            "attn_qkv": 1, "attn_core": 1, "attn_out": 1, "attn_other": 1, "linear_attn": 0, "norm": 4, "router": 1,
            "dispatch_combine": 1, "experts": 1, "shared_experts": 0, "layer_other": 1}, layer
    assert (mine[("embedding", None)], mine[("norm", None)], mine[("lm_head_loss", None)]) == (1, 1, 1)
    live = Counter(module_regions.registered_modules())
    assert live[("attn_core", hf.num_hidden_layers - 1)] >= 1  # layer_number - 1 of the last layer
