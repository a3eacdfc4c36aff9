"""GPU: flash-linear-attention's gated delta rule (Qwen3.5's linear attention) has the right gradients here.

fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (fla issue #640: wrong ``dk``/``dg`` at a
key block width of 64); ``sftprof.compat.narrow_fla_hopper_guard`` lifts that guard for key head dims whose
block is not 64. This test is the evidence: at the key head dims the project runs (16: the tiny preset,
128: Qwen3.5-35B-A3B) fla's forward and every input gradient (``q, k, v, g, beta``), bf16 as in training,
match a token-by-token fp32 reference (``fixtures.qwen3_5.gated_delta_rule_reference``, checked against
transformers' torch code on CPU in ``tests/test_qwen3_5_fsdp.py``) on the same bf16 values: relative error
norm below 2e-2 (bf16 kernels; the #640 fault gives errors of order 1).
"""
import pytest
import torch
from fixtures.qwen3_5 import gated_delta_rule_reference

from sftprof.compat import narrow_fla_hopper_guard

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("head_dim", [16, 128])
def test_fla_gated_delta_rule_gradients_match_fp32_reference(head_dim):
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install -e '.[qwen3_5]')")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    print("guard:", narrow_fla_hopper_guard(head_dim))
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    b, t, h = 1, 512, 4

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = torch.nn.functional.normalize(rand(b, t, h, head_dim), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rand(b, t, h, head_dim), dim=-1).bfloat16()
    v = rand(b, t, h, head_dim).bfloat16()
    g = (-torch.rand(b, t, h, device="cuda", generator=gen) * 0.5).float()  # log decay in (-0.5, 0]
    beta = torch.rand(b, t, h, device="cuda", generator=gen).bfloat16()
    grad_out = rand(b, t, h, head_dim).bfloat16()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    out, _ = chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=False)
    out.backward(grad_out)
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v, g, beta)]
    ref = gated_delta_rule_reference(*ref_leaves)
    ref.backward(grad_out.float())
    errors = {"out": _rel(out, ref)}
    errors.update({name: _rel(x.grad, r.grad) for name, x, r in zip("q k v g beta".split(), leaves, ref_leaves)})
    print(f"head_dim {head_dim}: relative error norms vs fp32 reference", {n: f"{e:.2e}" for n, e in errors.items()})
    assert all(e < 2e-2 for e in errors.values()), errors
