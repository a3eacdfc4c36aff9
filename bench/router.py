"""MoE router top-k on one GPU: megatron-core's unfused functions against sftprof's fused kernel (see bench/NOTES.md).

The two calls ``TopKRouter.routing`` makes per layer and pass with the auxiliary loss on (megatron-core 0.16.1,
softmax score function): ``topk_routing_with_score_function`` (probs and routing map) and
``compute_routing_scores_for_aux_loss`` (routing map and full softmax), on fp32 logits ``[T, E]`` (Qwen3-30B-A3B:
E = 128, top-8, ``moe_router_pre_softmax=False``). Rows: each path (``unfused``: megatron's
``moe_utils`` functions; ``fused``: :mod:`sftprof.models.layers.router`) for each ``pre_softmax`` setting; columns: median
ms (``torch.utils.benchmark``, CUDA synchronised) of the routing call's forward, the aux call's forward, and both
forwards plus the backward to the logits (upstream gradients on the probs and the scores).

Usage: python bench/router.py [--tokens 131072] [--experts 128] [--topk 8] [--min-run-time 1.0]
Arguments outside the fused kernel's range (``1 <= topk <= experts <= sftprof.models.layers.router.MAX_EXPERTS``), where the
fused functions would run megatron's code, are refused with exit status 2; without CUDA it prints that it needs a GPU
and exits with status 1, measuring nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sftprof.models.layers import router  # noqa: E402


def _paths():
    from megatron.core.transformer.moe import moe_utils

    return {"unfused": (moe_utils.topk_routing_with_score_function, moe_utils.compute_routing_scores_for_aux_loss),
            "fused": (router.topk_routing_with_score_function, router.compute_routing_scores_for_aux_loss)}


def _median_ms(fn, min_run_time: float) -> float:
    fn()  # compile / warm up
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--min-run-time", type=float, default=1.0, help="seconds of timed calls per cell")
    args = ap.parse_args()
    # outside these the fused functions fall back to megatron's, and the "fused" rows would time the unfused code
    if args.tokens < 1 or not 1 <= args.topk <= args.experts <= router.MAX_EXPERTS or args.min_run_time <= 0:
        ap.error(f"--tokens {args.tokens}, --experts {args.experts}, --topk {args.topk}, --min-run-time "
                 f"{args.min_run_time}: need tokens >= 1, 1 <= topk <= experts <= {router.MAX_EXPERTS} (the fused "
                 "kernel's range) and a min run time > 0")
    if not torch.cuda.is_available():
        print("bench/router.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured",
              file=sys.stderr)
        return 1
    t, e, k = args.tokens, args.experts, args.topk
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(t, e, generator=g, device="cuda") * 2).requires_grad_(True)
    d_probs, d_scores = torch.randn(t, e, generator=g, device="cuda"), torch.randn(t, e, generator=g, device="cuda")
    print(f"router top-k, fp32 logits [{t}, {e}], top-{k}, {torch.cuda.get_device_name()}; median ms")
    print("| path | pre_softmax | routing fwd | aux scores fwd | both fwd + bwd |")
    print("|---|---|---|---|---|")
    for pre_softmax in (False, True):
        for name, (routing, aux) in _paths().items():
            def fwd_routing():
                with torch.no_grad():
                    routing(logits, k, use_pre_softmax=pre_softmax)

            def fwd_aux():
                with torch.no_grad():
                    aux(logits, k, "softmax")

            def fwd_bwd():
                probs, _ = routing(logits, k, use_pre_softmax=pre_softmax)
                _, scores = aux(logits, k, "softmax")
                torch.autograd.grad([probs, scores], [logits], [d_probs, d_scores])

            cells = [_median_ms(fn, args.min_run_time) for fn in (fwd_routing, fwd_aux, fwd_bwd)]
            print(f"| {name} | {pre_softmax} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    mib = t * e * 4 / 2 ** 20
    print(f"\nHBM traffic of one fused forward: reads {mib:.1f} MiB of logits, writes {mib:.1f} MiB (probs or scores) "
          f"+ {mib / 4:.1f} MiB (bool routing map)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
