"""GPU: the megatron backend, loaded from a Hugging Face checkpoint, computes what transformers computes.

A tiny random Qwen3-MoE checkpoint (fp32, written by ``save_pretrained``; no auxiliary loss, so that the
reference loss is the SFT loss alone) runs one step per layout in ``tests/hf_parity_worker.py``:

- per-token log-probs within 1e-4 (absolute, nats) of ``Qwen3MoeForCausalLM``'s on the same GPU (layouts
  where a rank holds full logits rows);
- the step's loss within 1e-5 (relative);
- every parameter's gradient on every rank within 1e-4 (relative norm error) of the reference gradient
  mapped onto that rank's shard.

With Transformer Engine the bounds are TF32's: TE's GEMMs compute fp32 inputs in TF32
(``CUBLAS_COMPUTE_32F_FAST_TF32`` in TE's ``cublaslt_gemm.cu``); on 1x H200, TE 2.20.2, ``megatron:d1`` measured a
log-prob error of 1.16e-4 nats and a worst gradient error of 7.97e-4 (the router's weight), the loss equal to 8 digits.
Without TE the fp32 bounds above hold.

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

from sftprof.launch import free_port
from sftprof.models.specs import have_transformer_engine

REPO = Path(__file__).resolve().parents[1]
LOGPROB_ATOL, LOSS_RTOL, GRAD_RTOL = (5e-4, 1e-5, 4e-3) if have_transformer_engine() else (1e-4, 1e-5, 1e-4)


def _run_worker(ckpt: Path, cases: str, nproc: int, out: Path) -> list:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(REPO / "tests" / "hf_parity_worker.py"), "--ckpt", str(ckpt), "--cases", cases, "--out-dir", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [row for r in range(nproc) for row in json.loads((out / f"rank{r}.json").read_text())]


def _check(results: list) -> None:
    for r in results:
        worst = max(r["grad_rel_err"].items(), key=lambda kv: kv[1])
        print(f"{r['layout']} LM-head chunk {r['lm_head_chunk']} rank {r['rank']}: logprob max abs err {r['logprob_max_abs_err']}, loss {r['loss']:.8f} "
              f"ref {r['ref_loss']:.8f}, worst grad rel err {worst[1]:.2e} ({worst[0]}, norms megatron/reference "
              f"{r['grad_norms'][worst[0]]}), {len(r['grad_rel_err'])} params")
        if r["logprob_max_abs_err"] is not None:
            assert r["logprob_max_abs_err"] < LOGPROB_ATOL
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"])
        assert worst[1] < GRAD_RTOL, worst


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return write_qwen3_moe(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.mark.gpu
def test_parity_one_gpu(tiny_ckpt, tmp_path):
    results = _run_worker(tiny_ckpt, "megatron:d1@0,megatron:d1@48", 1, tmp_path)
    assert len(results) == 2
    _check(results)


@pytest.mark.gpu
def test_parity_two_gpus(tiny_ckpt, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    layouts = ["megatron:(attn:t2|ffn:e2)", "megatron:(attn:c2|ffn:e2)", "megatron:d2", "megatron:p2"]
    results = _run_worker(tiny_ckpt, ",".join(f"{x}@0" for x in layouts), 2, tmp_path)
    assert sorted({r["layout"] for r in results}) == sorted(layouts) and len(results) == 8
    _check(results)
