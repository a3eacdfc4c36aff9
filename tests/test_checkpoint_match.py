"""A checkpoint is matched whole before launch: its index against its shards' headers, the tensors the model reads
(by the family's weight rules) against the checkpoint's, on both backends.

A checkpoint that lacked tensors its index promised (the LM head, the MoE routers) trained with randomly initialised
weights and reported ok. The checkpoints here are written by transformers' ``save_pretrained`` (Qwen3-MoE sharded,
Qwen3.5-MoE single file) and then damaged one tensor at a time.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fixtures.qwen3_5 import save_tiny_checkpoint
from hf_checkpoints import write_qwen3_moe
from safetensors.torch import load_file, save_file

from sftprof.models import qwen3_5_moe_weights, qwen3_moe_weights
from sftprof.models.checkpoint import INDEX_NAME, SINGLE_NAME, CheckpointError, DictSource, SafetensorsCheckpoint
from sftprof.models.hf import check_weights_present, load_hf_config
from sftprof.models.weights import check_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHAPES = json.loads((ROOT / "tests" / "fixtures" / "te_parameter_shapes.json").read_text())
ACCEPTED = ("; accepted: a checkpoint holding every tensor of the model (actor.num_layers cuts its layers) and "
            "nothing else, or actor.init_from_scratch=true (random weights)")
SHARD_ACCEPTED = "; accepted: an index whose weight_map names exactly the tensors of each shard (as save_pretrained writes it)"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_qwen3_moe(tmp_path_factory.mktemp("qwen3") / "ckpt")


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5") / "ckpt"
    save_tiny_checkpoint(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _weight_map(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX_NAME).read_text())["weight_map"]


def _write_index(ckpt: Path, weight_map: dict) -> None:
    index = json.loads((ckpt / INDEX_NAME).read_text())
    (ckpt / INDEX_NAME).write_text(json.dumps({**index, "weight_map": weight_map}))


def _edit_shard(ckpt: Path, shard: str, drop=(), add=None) -> None:
    tensors = {k: v for k, v in load_file(ckpt / shard).items() if k not in drop}
    save_file({**tensors, **(add or {})}, str(ckpt / shard), metadata={"format": "pt"})


def _check(path: Path, num_layers: int = 0) -> None:
    check_weights_present(SimpleNamespace(path=str(path), init_from_scratch=False, num_layers=num_layers))


@pytest.mark.parametrize("name", ["lm_head.weight", "model.layers.1.mlp.gate.weight",
                                  "model.layers.1.mlp.experts.2.down_proj.weight"])
@pytest.mark.parametrize("where", ["index", "shard", "both"])
def test_a_tensor_deleted_from_the_index_or_its_shard_is_named(qwen3, tmp_path, name, where):
    ckpt = _copy(qwen3, tmp_path / "ckpt")
    weight_map = _weight_map(ckpt)
    shard = weight_map[name]
    if where in ("index", "both"):
        _write_index(ckpt, {k: v for k, v in weight_map.items() if k != name})
    if where in ("shard", "both"):
        _edit_shard(ckpt, shard, drop={name})
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    assert str(err.value) == {
        "index": f"{ckpt / shard} holds 1 tensor(s) that {INDEX_NAME} does not place in it: {name}" + SHARD_ACCEPTED,
        "shard": f"{ckpt / shard} lacks 1 tensor(s) that {INDEX_NAME} places in it: {name}" + SHARD_ACCEPTED,
        "both": f"{ckpt / INDEX_NAME}: 1 tensor(s) that the qwen3_moe model of 2 layer(s) reads are not in the "
                f"checkpoint: {name}" + ACCEPTED,
    }[where]


def test_an_extra_tensor_in_a_shard_is_named(qwen3, tmp_path):
    ckpt = _copy(qwen3, tmp_path / "ckpt")
    weight_map = _weight_map(ckpt)
    shard = weight_map["model.norm.weight"]
    _edit_shard(ckpt, shard, add={"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    assert str(err.value) == (f"{ckpt / shard} holds 1 tensor(s) that {INDEX_NAME} does not place in it: "
                              "model.layers.0.mlp.extra.weight" + SHARD_ACCEPTED)
    _write_index(ckpt, {**weight_map, "model.layers.0.mlp.extra.weight": shard})  # now the index names it too
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    assert str(err.value) == (f"{ckpt / INDEX_NAME}: 1 checkpoint tensor(s) are not read by the qwen3_moe model of 2 "
                              "layer(s): model.layers.0.mlp.extra.weight" + ACCEPTED)


def test_missing_and_unread_tensors_are_named_together_and_layers_beyond_num_layers_are_not_needed(qwen3, tmp_path):
    ckpt = _copy(qwen3, tmp_path / "ckpt")
    weight_map = _weight_map(ckpt)
    gone = [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)] + ["model.layers.1.mlp.gate.weight"]
    for name in gone:
        _edit_shard(ckpt, weight_map[name], drop={name})
    shard = weight_map["model.norm.weight"]
    _edit_shard(ckpt, shard, add={"model.norm.bias": torch.zeros(2)})
    _write_index(ckpt, {**{k: v for k, v in weight_map.items() if k not in gone}, "model.norm.bias": shard})
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    assert str(err.value) == (
        f"{ckpt / INDEX_NAME}: 5 tensor(s) that the qwen3_moe model of 2 layer(s) reads are not in the checkpoint: "
        "model.layers.1.mlp.experts.0.down_proj.weight, model.layers.1.mlp.experts.1.down_proj.weight, "
        "model.layers.1.mlp.experts.2.down_proj.weight, model.layers.1.mlp.experts.3.down_proj.weight, "
        "model.layers.1.mlp.gate.weight; 1 checkpoint tensor(s) are not read by the qwen3_moe model of 2 layer(s): "
        "model.norm.bias" + ACCEPTED)
    _write_index(ckpt, {k: v for k, v in weight_map.items() if k not in gone})
    _edit_shard(ckpt, shard, drop={"model.norm.bias"})
    _check(ckpt, num_layers=1)  # layer 1 is cut away: what it lacks is not needed, what it holds is not read


def test_fused_expert_checkpoint_that_is_complete_is_accepted(qwen3, tmp_path):
    """transformers 5 keeps experts fused in memory (gate_up_proj [E, 2F, H], down_proj [E, H, F]); a checkpoint
    in that layout is complete, one without a layer's down_proj is not."""
    from transformers import Qwen3MoeForCausalLM

    fused = {n: p.detach().contiguous() for n, p in
             Qwen3MoeForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32).named_parameters()}
    assert "model.layers.1.mlp.experts.down_proj" in fused
    ckpt = tmp_path / "fused"
    ckpt.mkdir()
    shutil.copy(qwen3 / "config.json", ckpt / "config.json")
    save_file(fused, str(ckpt / SINGLE_NAME), metadata={"format": "pt"})
    _check(ckpt)
    _edit_shard(ckpt, SINGLE_NAME, drop={"model.layers.1.mlp.experts.down_proj"})
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    assert str(err.value) == (f"{ckpt / SINGLE_NAME}: 1 tensor(s) that the qwen3_moe model of 2 layer(s) reads are "
                              "not in the checkpoint: model.layers.1.mlp.experts.down_proj" + ACCEPTED)


def test_tied_lm_head_is_not_needed(tmp_path):
    ckpt = write_qwen3_moe(tmp_path / "tied", num_hidden_layers=1, tie_word_embeddings=True)
    assert "lm_head.weight" not in SafetensorsCheckpoint(ckpt).names
    _check(ckpt)


def test_tied_model_takes_a_redundant_lm_head_equal_to_its_embedding(tmp_path):
    """Issue 48: a tied checkpoint that also carries lm_head.weight (Qwen1.5-0.5B ships so): an identical copy is
    accepted and left unread (not counted as read); a copy that differs, or of another shape, is refused naming both
    tensors."""
    ckpt = write_qwen3_moe(tmp_path / "tied", num_hidden_layers=1, tie_word_embeddings=True)
    shard = _weight_map(ckpt)["model.embed_tokens.weight"]
    embed = load_file(ckpt / shard)["model.embed_tokens.weight"]
    _edit_shard(ckpt, shard, add={"lm_head.weight": embed.clone()})
    _write_index(ckpt, {**_weight_map(ckpt), "lm_head.weight": shard})
    _check(ckpt)
    source = SafetensorsCheckpoint(ckpt)
    hf = load_hf_config(str(ckpt), 0)
    assert check_checkpoint(source, hf) == {"lm_head.weight"}
    assert (source.consumed, source.bytes_read) == (set(), 0)
    changed = embed.clone()
    changed[5, 3] += 1.0
    _edit_shard(ckpt, shard, add={"lm_head.weight": changed})
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    assert str(err.value) == (f"{ckpt / INDEX_NAME}: lm_head.weight differs from model.embed_tokens.weight (first in "
                              "row 5), though the config ties them (tie_word_embeddings=true); accepted: no "
                              "lm_head.weight, or one equal to the embedding")
    _edit_shard(ckpt, shard, add={"lm_head.weight": embed[:-1].clone()})
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    v, h = embed.shape
    assert str(err.value) == (f"{ckpt / INDEX_NAME}: lm_head.weight ({v - 1}, {h}) beside model.embed_tokens.weight "
                              f"({v}, {h}), though the config ties them (tie_word_embeddings=true); accepted: no "
                              "lm_head.weight, or one equal to the embedding")


def _multimodal(name: str) -> str:
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def test_qwen3_5_multimodal_prefix(qwen3_5, tmp_path):
    """A Qwen3_5MoeForConditionalGeneration checkpoint keeps the text model under model.language_model.*, beside a
    vision tower and an MTP block that the profiled text model does not read: accepted; a missing router or shared
    expert gate is named as that checkpoint spells it."""
    ckpt = _copy(qwen3_5, tmp_path / "mm")
    tensors = {_multimodal(k): v for k, v in load_file(ckpt / SINGLE_NAME).items()}
    tensors.update({"model.visual.patch_embed.proj.weight": torch.zeros(2), "mtp.fc.weight": torch.zeros(2)})
    save_file(tensors, str(ckpt / SINGLE_NAME), metadata={"format": "pt"})
    _check(ckpt)
    gone = {"model.language_model.layers.3.mlp.gate.weight", "model.language_model.layers.0.mlp.shared_expert_gate.weight"}
    _edit_shard(ckpt, SINGLE_NAME, drop=gone)
    with pytest.raises(CheckpointError) as err:
        _check(ckpt)
    assert str(err.value) == (f"{ckpt / SINGLE_NAME}: 2 tensor(s) that the qwen3_5_moe_text model of 4 layer(s) reads "
                              f"are not in the checkpoint: {', '.join(sorted(gone))}" + ACCEPTED)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_required_tensors_are_what_the_rules_read(family, qwen3, qwen3_5):
    """The required set is the rules' own: the tensors the rules read for every parameter of megatron-core's
    GPTModel (Transformer Engine spec, names recorded on an H200: tests/fixtures/te_parameter_shapes.json) are
    exactly ``required_tensors``, for the checkpoint's per-expert layout and for transformers' fused layout."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM

    path, mapping, cls = ((qwen3, qwen3_moe_weights, Qwen3MoeForCausalLM) if family == "qwen3_moe" else
                          (qwen3_5, qwen3_5_moe_weights, Qwen3_5MoeForCausalLM))
    hf = load_hf_config(str(path))
    ctx = qwen3_moe_weights.ShardContext(
        tp_rank=0, tp_size=1, etp_rank=0, etp_size=1, ep_rank=0, ep_size=1, num_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, head_dim=hf.head_dim, num_experts=hf.num_experts,
        vocab_size=hf.vocab_size, tied=False, layer_numbers=tuple(range(hf.num_hidden_layers)),
        **{k: getattr(hf, k, 0) or 0 for k in ("linear_num_key_heads", "linear_num_value_heads",
                                               "linear_key_head_dim", "linear_value_head_dim")})
    files = SafetensorsCheckpoint(path)
    fused = DictSource({n: p.detach() for n, p in cls.from_pretrained(str(path), dtype=torch.float32).named_parameters()})
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    for src, names in ((files, files.names), (fused, set(fused.tensors))):
        for param, _ in SHAPES[family]:
            mapping.local_tensor(param, src, ctx)
        assert src.consumed == set(mapping.required_tensors(hf, names)) == names


def _trainer(tmp_path: Path, backend: str, model: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, str(ROOT / "train_sft_profile.py"), "--config", "tiny_cpu", f"cluster.fileroot={tmp_path}",
           f"actor.backend={backend}", "actor.init_from_scratch=false", f"actor.path={model}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("backend", ["fsdp:d1", "megatron:d1"])
def test_trainer_refuses_a_checkpoint_without_its_router_before_launch(qwen3, tmp_path, backend):
    """Through the trainer's command line, before any process group: exit 2, the message naming the file and
    the tensor, no log dir."""
    ckpt = _copy(qwen3, tmp_path / "ckpt")
    name = "model.layers.0.mlp.gate.weight"
    weight_map = _weight_map(ckpt)
    _edit_shard(ckpt, weight_map[name], drop={name})
    _write_index(ckpt, {k: v for k, v in weight_map.items() if k != name})
    proc = _trainer(tmp_path, backend, ckpt)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.endswith(
        f"sftprof: configuration error: {ckpt / INDEX_NAME}: 1 tensor(s) that the qwen3_moe model of 2 layer(s) reads "
        f"are not in the checkpoint: {name}{ACCEPTED}\n"), proc.stderr[-2000:]
    assert proc.stdout == "" and not (tmp_path / "logs").exists()


def test_fsdp_load_refuses_what_transformers_would_initialise_at_random(qwen3, tmp_path):
    """A weight file the pre-launch check does not read (pytorch_model.bin) without its LM head and with a tensor the
    model has no parameter for: the fsdp engine refuses transformers' load (which reports the head as newly
    initialised and the extra tensor as unexpected); a model cut by actor.num_layers loads with the checkpoint's other
    layers left out."""
    from sftprof.config import load_config
    from sftprof.engine.fsdp import build_hf_causal_lm

    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    shutil.copy(qwen3 / "config.json", ckpt / "config.json")
    state = {k: v for shard in sorted(set(_weight_map(qwen3).values())) for k, v in load_file(qwen3 / shard).items()}
    torch.save({**{k: v for k, v in state.items() if k != "lm_head.weight"}, "model.extra.weight": torch.zeros(2)},
               ckpt / "pytorch_model.bin")
    cfg = load_config("tiny_cpu", ["actor.backend=fsdp:d1", f"actor.path={ckpt}", "actor.init_from_scratch=false",
                                   "actor.dtype=float32"])
    with pytest.raises(CheckpointError) as err:
        build_hf_causal_lm(cfg, load_hf_config(str(ckpt)))
    assert str(err.value) == (f"{ckpt}: Qwen3MoeForCausalLM.from_pretrained: 1 parameter(s) missing from the checkpoint "
                              "(left at random initialisation): lm_head.weight; 1 checkpoint tensor(s) the model has "
                              "no parameter for: model.extra.weight; accepted: a checkpoint holding every tensor of the "
                              "model, or actor.init_from_scratch=true (random weights)")
    cut = load_config("tiny_cpu", ["actor.backend=fsdp:d1", f"actor.path={qwen3}", "actor.init_from_scratch=false",
                                   "actor.dtype=float32", "actor.num_layers=1"])
    model = build_hf_causal_lm(cut, load_hf_config(str(qwen3), 1))
    assert len(model.model.layers) == 1
    assert torch.equal(model.model.layers[0].mlp.gate.weight, state["model.layers.0.mlp.gate.weight"])


def test_driver_plan_refuses_a_checkpoint_without_its_lm_head(qwen3, tmp_path):
    """The driver's plan (exit 2 through DriverError) names the file and the tensor and writes nothing."""
    from sftprof import launch

    ckpt = _copy(qwen3, tmp_path / "ckpt")
    weight_map = _weight_map(ckpt)
    _edit_shard(ckpt, weight_map["lm_head.weight"], drop={"lm_head.weight"})
    _write_index(ckpt, {k: v for k, v in weight_map.items() if k != "lm_head.weight"})
    env = {"CONFIG": "tiny_cpu", "FILEROOT": str(tmp_path / "fr"), "RUN_ROOT": str(tmp_path / "run"),
           "PROFILE_STAMP": "p", "MODEL_PATH": str(ckpt)}
    with pytest.raises(launch.DriverError) as err:
        launch.plan(env, ["actor.init_from_scratch=false"], gpus=0)
    assert str(err.value) == (f"{ckpt / INDEX_NAME}: 1 tensor(s) that the qwen3_moe model of 2 layer(s) reads are not "
                              f"in the checkpoint: lm_head.weight{ACCEPTED} (MODEL_PATH / actor.path)")
    assert not (tmp_path / "run").exists() and not (tmp_path / "fr").exists()
