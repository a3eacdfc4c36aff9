"""GPU test: SDPACoreAttention with context parallelism on 2 GPUs equals single-GPU attention.

The test launches this file under ``torchrun --nproc-per-node 2``; each rank builds the same random
bf16 Q/K/V ``[S, b, heads, d]`` (GQA 8 q / 2 kv heads, head_dim 128), runs single-GPU SDPA causal
attention on the full sequence and the CP=2 module on its load-balanced shard, and compares outputs
and the Q/K/V input gradients of its shard (bf16 tolerance).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _worker(out_path: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    from sftprof.data import cp_shard
    from sftprof.models.attention import SDPACoreAttention

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    cp = dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, b, h, g, d = 8192, 1, 8, 2, 128

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v, dout = rand(s, b, h, d), rand(s, b, g, d), rand(s, b, g, d), rand(s, b, h * d)
    config = SimpleNamespace(attention_dropout=0.0, context_parallel_size=cp)
    full_mod = SDPACoreAttention(SimpleNamespace(attention_dropout=0.0, context_parallel_size=1), 1,
                                 AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=None))
    cp_mod = SDPACoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=dist.group.WORLD))
    fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = full_mod(fq, fk, fv, None)
    ref.backward(dout)
    lq, lk, lv = (cp_shard(t, cp, rank, dim=0).requires_grad_() for t in (q, k, v))
    out = cp_mod(lq, lk, lv, None)
    out.backward(cp_shard(dout, cp, rank, dim=0))
    errs = {}
    for name, got, want in [("out", out, ref), ("dq", lq.grad, fq.grad), ("dk", lk.grad, fk.grad),
                            ("dv", lv.grad, fv.grad)]:
        want = cp_shard(want.detach(), cp, rank, dim=0)
        errs[name] = float((got.float() - want.float()).abs().max())
        errs[name + "_scale"] = float(want.float().abs().max())
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    if rank == 0:
        Path(out_path).write_text(json.dumps(errs))
    dist.destroy_process_group()


@pytest.mark.gpu
def test_cp2_sdpa_attention_matches_single_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "errs.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", "29511", __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    errs = json.loads(out.read_text())
    print("CP=2 vs single-GPU max abs errors:", errs)
    for name in ("out", "dq", "dk", "dv"):  # bf16: within ~1 ulp of the largest value
        assert errs[name] <= 2e-2 + 1e-2 * errs[name + "_scale"], (name, errs)


if __name__ == "__main__":
    _worker(sys.argv[1])
