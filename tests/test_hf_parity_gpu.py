"""GPU: the megatron backend, loaded from a Hugging Face checkpoint, computes what transformers computes.

A tiny random Qwen3-MoE checkpoint (fp32, written by ``save_pretrained``; no auxiliary loss, so that the
reference loss is the SFT loss alone) runs one step per layout in ``tests/hf_parity_worker.py``:

- per-token log-probs within 1e-4 (absolute, nats) of ``Qwen3MoeForCausalLM``'s on the same GPU (layouts
  where a rank holds full logits rows);
- the step's loss within 1e-5 (relative);
- every parameter's gradient on every rank within 1e-4 (relative norm error) of the reference gradient
  mapped onto that rank's shard.

Layouts: ``megatron:d1`` (also with the chunked LM head), and on two GPUs ``(attn:t2|ffn:e2)``,
``(attn:c2|ffn:e2)``, ``d2`` and ``p2``. The Qwen3-30B-A3B-shaped check through the driver is
``bench/checkpoint_loss.py``.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_checkpoints import write_qwen3_moe

REPO = Path(__file__).resolve().parents[1]
LOGPROB_ATOL, LOSS_RTOL, GRAD_RTOL = 1e-4, 1e-5, 1e-4


def _run_worker(ckpt: Path, layout: str, nproc: int, out: Path, lm_head_chunk: int = 0) -> list:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=29731",
           str(REPO / "tests" / "hf_parity_worker.py"), "--ckpt", str(ckpt), "--layout", layout, "--out-dir", str(out),
           "--lm-head-chunk", str(lm_head_chunk)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _check(results: list) -> None:
    for r in results:
        worst = max(r["grad_rel_err"].items(), key=lambda kv: kv[1])
        print(f"{r['layout']} rank {r['rank']}: logprob max abs err {r['logprob_max_abs_err']}, loss {r['loss']:.8f} "
              f"ref {r['ref_loss']:.8f}, worst grad rel err {worst[1]:.2e} ({worst[0]}), {len(r['grad_rel_err'])} params")
        if r["logprob_max_abs_err"] is not None:
            assert r["logprob_max_abs_err"] < LOGPROB_ATOL
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"])
        assert worst[1] < GRAD_RTOL, worst


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return write_qwen3_moe(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.mark.gpu
@pytest.mark.parametrize("lm_head_chunk", [0, 48])
def test_parity_one_gpu(tiny_ckpt, tmp_path, lm_head_chunk):
    _check(_run_worker(tiny_ckpt, "megatron:d1", 1, tmp_path, lm_head_chunk))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["megatron:(attn:t2|ffn:e2)", "megatron:(attn:c2|ffn:e2)", "megatron:d2",
                                    "megatron:p2"])
def test_parity_two_gpus(tiny_ckpt, tmp_path, layout):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check(_run_worker(tiny_ckpt, layout, 2, tmp_path))
