"""GPU tests of the megatron engine: two training steps per 2-GPU layout through the real trainer.

Each layout runs ``torchrun --nproc-per-node 2 train_sft_profile.py`` on the tiny Qwen3-MoE config
(2 layers, 8 experts top-2, real Qwen3 vocabulary 151936), bf16, 2048 tokens per sequence, without
the precision-aware optimizer (no Transformer Engine on the test machines). At step 0 with random init
the loss must be finite and within 1.0 of ln(vocab) (near-uniform predictions); step 1 must finish.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sftprof.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151936
LAYOUTS = ["megatron:d2", "megatron:(attn:c2|ffn:e2)", "megatron:(attn:t2|ffn:e2)", "megatron:p2"]


def _run(tmp_path: Path, mode: str, extra=(), nproc: int = 2) -> list:
    overrides = [
        f"actor.backend={mode}", "actor.dtype=bfloat16", "total_train_steps=2", f"cluster.fileroot={tmp_path}",
        "trial_name=t", "actor.megatron.use_precision_aware_optimizer=false", "actor.megatron.main_grads_dtype=float32",
        "train_dataset.batch_size=2", "actor.mb_spec.n_mbs=" + ("2" if "p2" in mode else "1"), *extra]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                           str(free_port()), str(ROOT / "train_sft_profile.py"), "--config", "tiny_cpu", *overrides],
                          env=env, capture_output=True, text=True, timeout=400)
    stats = list(tmp_path.glob("logs/*/*/t/stats.jsonl"))
    assert proc.returncode == 0 and stats, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads(line) for line in stats[0].read_text().splitlines()]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", LAYOUTS)
def test_two_steps_loss_near_ln_vocab(tmp_path, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    records = _run(tmp_path, mode)
    steps = [r for r in records if r["type"] == "step"]
    done = next(r for r in records if r["type"] == "complete")
    assert done["type"] == "complete" and done["status"] == "ok" and done["steps_done"] == 2, done
    loss0 = steps[0]["loss"]
    print(mode, "losses", [s["loss"] for s in steps], "tflops/gpu", [s["tflops_per_gpu"] for s in steps])
    assert math.isfinite(loss0) and abs(loss0 - math.log(VOCAB)) < 1.0, loss0
    assert math.isfinite(steps[1]["loss"])
    assert steps[0]["tflops_per_gpu"] is not None and steps[0]["tflops_per_gpu"] > 0


@pytest.mark.gpu
def test_chunked_lm_head_loss_matches_logits_path(tmp_path):
    """lm_head_loss_chunk_size > 0 (no full logits) gives the same step-0 loss as the logits path."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    mode = "megatron:(attn:t2|ffn:e2)"
    a = [r for r in _run(tmp_path / "a", mode) if r["type"] == "step"]
    b = [r for r in _run(tmp_path / "b", mode, ["actor.loss.lm_head_loss_chunk_size=512"]) if r["type"] == "step"]
    print("losses: logits path", [r["loss"] for r in a], "chunked LM head", [r["loss"] for r in b])
    assert abs(a[0]["loss"] - b[0]["loss"]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode, gpus", [("megatron:d1", 1), ("megatron:(attn:c2|ffn:e2)", 2)])
def test_force_load_balancing_balances_the_routing(tmp_path, mode, gpus):
    """``actor.megatron.moe_router_force_load_balancing=true`` (megatron-core's random router logits) with full
    recompute: both steps finish with a finite loss, and every layer's routing is near the balanced mean (8192 routing
    slots over 8 experts: a busiest expert within 1.25x the mean, a busiest EP rank within 1.1x)."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    records = _run(tmp_path, mode, ["actor.megatron.moe_router_force_load_balancing=true",
                                    "actor.gradient_checkpointing=true"], nproc=gpus)
    steps = [r for r in records if r["type"] == "step"]
    done = next(r for r in records if r["type"] == "complete")  # the teardown and exit records follow it
    assert done["status"] == "ok" and len(steps) == 2, done
    for s in steps:
        load = s["moe_load"]
        print(mode, "step", s["step"], "loss", s["loss"], "max/mean", load["max_over_mean"], "EP", load["ep_max_over_mean"])
        assert math.isfinite(s["loss"]) and abs(steps[0]["loss"] - math.log(VOCAB)) < 1.0
        assert all(1.0 <= r < 1.25 for r in load["max_over_mean"]), load
        assert all(1.0 <= r < 1.1 for r in load["ep_max_over_mean"]), load
