"""GPU: the driver profiles a Qwen3-30B-A3B-shaped Hugging Face checkpoint and trains what transformers computes.

A random bf16 checkpoint of the Qwen3-30B-A3B shape cut to 4 layers is written sharded
(``bench/checkpoint_loss.py write``); the driver runs the shipped YAML on it (``actor.init_from_scratch=false``,
fp32 optimizer so that it runs without Transformer Engine too; TE's specs and their weight rules where TE imports)
at ``SFTPROF_CKPT_SEQ`` tokens (default 32768), one kernel
trial of step 1, on ``megatron:d1`` and on ``megatron:(attn:c2|ffn:e2)``; then ``bench/checkpoint_loss.py check``
runs ``AutoModelForCausalLM`` on the same step-0 tokens: the trial's step-0 loss must match within 1e-2
(relative; bf16 on both sides, rounded in different orders).
"""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ = os.environ.get("SFTPROF_CKPT_SEQ", "32768")


def _py(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``SFTPROF_CKPT_DIR`` (when set): a checkpoint written there earlier by the same command is reused."""
    out = Path(os.environ.get("SFTPROF_CKPT_DIR") or tmp_path_factory.mktemp("ckpt") / "q3_4l")
    if (out / "model.safetensors.index.json").is_file():
        layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
        assert layers == 4, f"SFTPROF_CKPT_DIR={out} holds a {layers}-layer checkpoint; this test needs 4"
        return out
    proc = _py(str(ROOT / "bench" / "checkpoint_loss.py"), "write", "--layers", "4", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "model.safetensors.index.json").is_file()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("mode,gpus", [("megatron:d1", 1), ("megatron:(attn:c2|ffn:e2)", 2)])
def test_driver_step0_loss_on_checkpoint_matches_transformers(checkpoint, tmp_path, mode, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    env = {k: v for k, v in os.environ.items() if k not in ("PROFILE_RANKS", "CONFIG")}
    env.update(MODEL_PATH=str(checkpoint), FILEROOT=str(tmp_path / "fileroot"), RUN_ROOT=str(tmp_path / "run"),
               PROFILE_STEPS="1", PROFILE_KINDS="kernel", PROFILE_STAMP="ckpt", PROFILE_FAKE_SEQ_LEN=SEQ,
               USE_PRECISION_AWARE_OPTIMIZER="false", MAIN_GRADS_DTYPE="float32", TRAIN_BATCH_SIZE="1",
               PROFILE_N_MBS="1", N_GPUS_PER_NODE=str(gpus))
    out = subprocess.run(["bash", str(ROOT / "run_qwen3_30b_a3b_sft_profile.sh"), f"actor.backend={mode}",
                          "actor.num_layers=4", "actor.init_from_scratch=false"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    with open(tmp_path / "run" / "summary.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [r["status"] for r in rows] == ["0"], rows
    stats = list((tmp_path / "fileroot").glob("logs/*/*/*/stats.jsonl"))
    assert len(stats) == 1, stats
    check = _py(str(ROOT / "bench" / "checkpoint_loss.py"), "check", "--checkpoint", str(checkpoint), "--seq", SEQ,
                "--stats", str(stats[0]), timeout=600)
    print(mode, check.stdout.strip())
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-4000:]
