"""Hugging Face checkpoints -> the Transformer Engine spec's parameters, on CPU (no TE needed).

``tests/fixtures/te_parameter_shapes.json`` holds the parameter names and shapes of megatron-core's TE-spec
``GPTModel`` as built on an H200 with TE 2.20.2 from the two tiny checkpoints below. For both families every
TE parameter gets a tensor of its recorded shape from the checkpoint, every checkpoint tensor is read, and the
names TE adds (the input norm fused into the first linear, one weight per expert of a grouped GEMM) carry the
same values as the local spec's parameters they replace.
"""
import json
from pathlib import Path

import pytest
import torch
from fixtures.qwen3_5 import save_tiny_checkpoint
from hf_checkpoints import write_qwen3_moe

from sftprof.models import qwen3_5_moe_weights, qwen3_moe_weights
from sftprof.models.checkpoint import SafetensorsCheckpoint, check_all_consumed
from sftprof.models.hf import load_hf_config
from sftprof.models.qwen3_moe_weights import ShardContext

SHAPES = json.loads((Path(__file__).parent / "fixtures" / "te_parameter_shapes.json").read_text())


def _ctx(hf) -> ShardContext:
    return ShardContext(tp_rank=0, tp_size=1, etp_rank=0, etp_size=1, ep_rank=0, ep_size=1,
                        num_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
                        head_dim=hf.head_dim, num_experts=hf.num_experts, vocab_size=hf.vocab_size, tied=False,
                        layer_numbers=tuple(range(hf.num_hidden_layers)),
                        **{k: getattr(hf, k, 0) or 0 for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                               "linear_key_head_dim", "linear_value_head_dim")})


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    if request.param == "qwen3_moe":
        write_qwen3_moe(path)
        mapping = qwen3_moe_weights
    else:
        save_tiny_checkpoint(path)
        mapping = qwen3_5_moe_weights
    return request.param, path, mapping, load_hf_config(str(path))


def test_every_te_parameter_maps_to_its_shape_and_every_tensor_is_read(family):
    name, path, mapping, hf = family
    ckpt = SafetensorsCheckpoint(path)
    ctx = _ctx(hf)
    for param, shape in SHAPES[name]:
        assert list(mapping.local_tensor(param, ckpt, ctx).shape) == shape, param
    check_all_consumed(ckpt.names, [ckpt.consumed], str(path))  # raises naming any tensor left unread


def test_te_names_carry_the_local_spec_values(family):
    name, path, mapping, hf = family
    ckpt = SafetensorsCheckpoint(path)
    ctx = _ctx(hf)
    te_names = {p for p, _ in SHAPES[name]}
    mixer = "in_proj" if name == "qwen3_5_moe" else "linear_qkv"
    norm = f"decoder.layers.0.self_attention.{mixer}.layer_norm_weight"
    assert norm in te_names
    torch.testing.assert_close(mapping.local_tensor(norm, ckpt, ctx), ckpt.read("model.layers.0.input_layernorm.weight"),
                               rtol=0, atol=0)
    for fc in (1, 2):
        for j in range(hf.num_experts):
            te = f"decoder.layers.0.mlp.experts.linear_fc{fc}.weight{j}"
            local = f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc{fc}.weight"
            assert te in te_names
            torch.testing.assert_close(mapping.local_tensor(te, ckpt, ctx), mapping.local_tensor(local, ckpt, ctx),
                                       rtol=0, atol=0)
    hf_fc2 = ckpt.read("model.layers.0.mlp.experts.3.down_proj.weight")
    torch.testing.assert_close(mapping.local_tensor("decoder.layers.0.mlp.experts.linear_fc2.weight3", ckpt, ctx), hf_fc2,
                               rtol=0, atol=0)
