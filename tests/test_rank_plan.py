"""The plan of a simulated rank (sftprof.analysis.time.rank_plan): process groups against megatron-core's own rank
generator, shards, CP chunks, routed tokens and collective buffer sizes of the shipped layout, worked by hand."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.time.rank_plan import dedup_fraction, group_ranks, rank_plan

QWEN3_30B = SimpleNamespace(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
                            num_hidden_layers=48, tie_word_embeddings=False)
SHIPPED = "qwen3_30b_a3b_sft_profile.yaml"


def _shipped_cfg() -> dict:
    with open(SHIPPED) as f:
        cfg = yaml.safe_load(f)
    cfg["actor"]["mb_spec"]["max_tokens_per_mb"] = cfg["profile"]["fake_seq_len"]  # the YAML's interpolation
    cfg["train_dataset"]["max_length"] = cfg["profile"]["fake_seq_len"]
    return cfg


@pytest.mark.parametrize("mode", ["megatron:(attn:d2c4|ffn:d1e8)", "megatron:d2t2p2", "megatron:(attn:t2c2p2|ffn:e2t2p2)",
                                  "megatron:(attn:d4c4t4|ffn:d2e8t4)"])
def test_groups_are_megatron_cores(mode):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    lay = parse_allocation_mode(mode)
    attn = parallel_state.RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order="tp-cp-ep-dp-pp")
    expert = parallel_state.RankGenerator(tp=lay.etp, ep=lay.ep, dp=lay.edp, pp=lay.pp, cp=1, order="tp-cp-ep-dp-pp")
    tokens = {"tp": (attn, "tp"), "cp": (attn, "cp"), "dp_cp": (attn, "dp-cp"), "tp_cp": (attn, "tp-cp"),
              "pp": (attn, "pp"), "dp": (attn, "dp"), "ep": (expert, "ep"), "etp": (expert, "tp"),
              "edp": (expert, "dp")}
    for group, (gen, token) in tokens.items():
        expected = {r: g for g in gen.get_ranks(token) for r in g}
        for rank in range(lay.world_size):
            assert group_ranks(lay, rank, group) == sorted(expected[rank]), (group, rank)


def test_dedup_fraction_by_enumeration():
    for experts, k, ep in ((4, 2, 2), (8, 2, 4), (8, 3, 2), (12, 4, 3)):
        local = experts // ep
        sets = list(itertools.combinations(range(experts), k))
        mean_ranks = sum(len({e // local for e in s}) for s in sets) / len(sets)
        assert dedup_fraction(experts, k, ep) == pytest.approx(mean_ranks / k, rel=1e-12)
    assert dedup_fraction(4, 2, 2) == pytest.approx(5 / 6)


def test_shipped_rank_plan():
    cfg = _shipped_cfg()
    lay = parse_allocation_mode(cfg["actor"]["backend"])
    plan = rank_plan(cfg, QWEN3_30B, lay, 1, have_te=False)  # cp rank 1, dp rank 0, ep rank 1; dedup dispatcher
    assert plan["coords"] == {"pp": 0, "dp": 0, "cp": 1, "tp": 0, "ep": 1, "etp": 0}
    per_layer_dense = 2048 * 40 * 128 + 4096 * 2048 + 2 * 2048 + 2 * 128 + 2048 * 128
    dense = 48 * per_layer_dense + 151936 * 2048 * 2 + 2048
    expert = 48 * 16 * 3 * 2048 * 768
    assert plan["shards"] == {"params_dense": dense, "params_expert": expert, "optimizer_shards_dense": 8,
                              "optimizer_shards_expert": 1, "layers": 48, "pp_stage": 0}
    t = plan["tokens"]
    assert (t["micro_batches"], t["sequences_per_micro_batch"], t["per_micro_batch"]) == (2, 1, 32768)
    assert t["cp_chunks"] == [{"chunk": 1, "tokens": 16384, "keys": 32768}, {"chunk": 6, "tokens": 16384,
                                                                           "keys": 114688}]
    assert t["expert_pairs_per_micro_batch"] == 32768 * 8
    assert t["pairs_per_local_expert"] == 32768 * 8 * 8 / 128 and t["local_experts"] == 16
    calls = {(c["group"], c["collective"]): c for c in plan["collectives"]}
    assert set(calls) == {("cp", "all_gather"), ("cp", "reduce_scatter"), ("ep", "all_to_all"),
                          ("dp_cp", "reduce_scatter"), ("dp_cp", "all_gather")}  # TP, ETP, EDP, PP are size 1
    kv = 2 * 32768 * 4 * 128 * 2  # K and V of 32768 local tokens, 4 KV heads of 128, bf16
    assert calls["cp", "all_gather"] == {
        "group": "cp", "collective": "all_gather", "bytes_per_call": 4 * kv, "calls": 2 * 2 * 48, "group_size": 4,
        "ranks": [0, 1, 2, 3], "overlap": "cp_attention", "what": "K/V of the local chunks gathered over CP"}
    assert calls["cp", "reduce_scatter"]["bytes_per_call"] == 4 * kv * 2  # fp32 gradients
    assert calls["cp", "reduce_scatter"]["calls"] == 2 * 48
    a2a = calls["ep", "all_to_all"]
    assert a2a["ranks"] == list(range(8)) and a2a["calls"] == 2 * 3 * 2 * 48
    assert a2a["bytes_per_call"] == int(32768 * 8 * dedup_fraction(128, 8, 8) * 2048 * 2)
    assert calls["dp_cp", "reduce_scatter"]["bytes_per_call"] == dense * 2  # main_grads_dtype bfloat16
    assert calls["dp_cp", "reduce_scatter"]["overlap"] == "backward"
    assert calls["dp_cp", "all_gather"]["overlap"] == "forward"
    for te in (True, None):  # TE's layers take the plain dispatcher; unknown: its bytes, the upper bound
        plain = {(c["group"], c["collective"]): c for c in rank_plan(cfg, QWEN3_30B, lay, 1, te)["collectives"]}
        assert plain["ep", "all_to_all"]["bytes_per_call"] == 32768 * 8 * 2048 * 2


def test_plain_dispatcher_tp_and_pp():
    cfg = _shipped_cfg()
    cfg["actor"]["backend"] = "megatron:(attn:t2p2d2|ffn:e4p2)"
    cfg["actor"]["megatron"]["moe_dedup_alltoall"] = False
    cfg["actor"]["megatron"]["ddp"].update(overlap_grad_reduce=False, use_distributed_optimizer=False)
    cfg["profile"]["fake_seq_len"] = 8192
    lay = parse_allocation_mode(cfg["actor"]["backend"])
    plan = rank_plan(cfg, QWEN3_30B, lay, 5)  # tp 1, dp 0, pp 1; ep 1
    assert plan["coords"] == {"pp": 1, "dp": 0, "cp": 0, "tp": 1, "ep": 1, "etp": 0}
    calls = {(c["group"], c["collective"]): c for c in plan["collectives"]}
    act = 8192 * 2048 * 2
    assert calls["tp", "all_gather"]["bytes_per_call"] == act and calls["tp", "all_gather"]["calls"] == 3 * 2 * 24
    assert calls["ep", "all_to_all"]["bytes_per_call"] == 4096 * 8 * 2048 * 2  # every copy sent: no dedup
    assert calls["pp", "send_recv"] == {"group": "pp", "collective": "send_recv", "bytes_per_call": act // 2,
                                        "calls": 4, "group_size": 2, "ranks": [1, 5], "overlap": "none",
                                        "what": calls["pp", "send_recv"]["what"]}
    assert calls["dp_cp", "all_reduce"]["overlap"] == "none" and ("dp_cp", "all_gather") not in calls
    assert plan["shards"]["optimizer_shards_dense"] == 1 and plan["tokens"]["per_micro_batch_per_tp_rank"] == 4096


def test_fsdp_plan_and_bad_sequence():
    cfg = _shipped_cfg()
    cfg["actor"]["backend"] = "fsdp:d8"
    cfg["train_dataset"]["batch_size"] = 16  # two micro-batches of one sequence
    plan = rank_plan(cfg, QWEN3_30B, parse_allocation_mode("fsdp:d8"), 7)
    p_all = 48 * (2048 * 40 * 128 + 4096 * 2048 + 2 * 2048 + 2 * 128 + 2048 * 128 + 128 * 3 * 2048 * 768) \
        + 151936 * 2048 * 2 + 2048
    calls = {(c["group"], c["collective"]): c for c in plan["collectives"]}
    assert calls["dp", "all_gather"]["bytes_per_call"] == p_all * 2 and calls["dp", "all_gather"]["calls"] == 4
    assert calls["dp", "reduce_scatter"]["bytes_per_call"] == p_all * 4
    cfg["actor"]["backend"] = "megatron:c3"
    cfg["train_dataset"]["batch_size"] = 4
    with pytest.raises(ValueError, match="profile.fake_seq_len=131072: must be divisible by 2\\*CP=6"):
        rank_plan(cfg, QWEN3_30B, parse_allocation_mode("megatron:c3"), 0)


_FAKE_PG_GROUPS = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron.core import parallel_state as ps
from sftprof.allocation import parse_allocation_mode
from sftprof.models.megatron_config import parallel_state_kwargs
layout, rank = parse_allocation_mode(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
ps.initialize_model_parallel(**parallel_state_kwargs(layout), create_gloo_process_groups=False)
groups = {"tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
          "dp_cp": ps.get_data_parallel_group(with_context_parallel=True), "pp": ps.get_pipeline_model_parallel_group(),
          "ep": ps.get_expert_model_parallel_group(), "etp": ps.get_expert_tensor_parallel_group(),
          "edp": ps.get_expert_data_parallel_group()}
print(json.dumps({k: dist.get_process_group_ranks(g) for k, g in groups.items()}))
"""


@pytest.mark.parametrize("mode,rank", [("megatron:(attn:d2c4|ffn:d1e8)", 5), ("megatron:(attn:d4c4t4|ffn:d2e8t4)", 37)])
def test_groups_of_megatron_on_the_fake_process_group(mode, rank):
    """The groups megatron-core builds for a simulated rank on torch's fake process group (the trainer's
    simulation, no gloo groups) are the plan's."""
    pytest.importorskip("megatron.core")
    out = subprocess.run([sys.executable, "-c", _FAKE_PG_GROUPS, mode, str(rank)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    built = json.loads(out.stdout.strip().splitlines()[-1])
    lay = parse_allocation_mode(mode)
    assert built == {g: group_ranks(lay, rank, g) for g in built}
