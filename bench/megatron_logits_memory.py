#!/usr/bin/env python3
"""Peak memory and step time of one megatron SFT step: naive full-logits loss vs the chunked paths.

One process, one GPU. For each sequence length and loss path the megatron engine
(:class:`sftprof.engine.megatron.MegatronEngine`, Qwen3-30B-A3B shape cut to ``--layers`` layers, random
init, full recompute, one sequence per step) runs ``--steps`` training steps; the last one is measured
(``torch.cuda.max_memory_allocated`` reset before it, wall time with device synchronisation). Paths:

- ``naive``: ``actor.loss.path=reference``, ``log_softmax`` in fp32 over the full ``[N, V]`` logits, then
  gather (what a plain PyTorch SFT loss does);
- ``chunked_logprobs``: ``actor.loss.path=logprobs``, :func:`sftprof.ops.vocab_parallel_logprobs` on the
  logits, ``--logprobs-chunk`` tokens at a time, gradient written in place of the logits;
- ``chunked_lm_head``: ``actor.loss.path=lm_head``, :func:`sftprof.ops.linear_sft_loss` on the final hidden
  states (``actor.loss.lm_head_loss_chunk_size``), no full logits.

The three differ only in ``actor.loss`` (:class:`sftprof.loss.SFTLoss`), so they run the same engine.

Each case runs in its own process, so no memory of an earlier case is held. A path that runs out of
memory is reported as ``OOM``. The table is printed last, side by side.

Usage::

    python bench/megatron_logits_memory.py --seq-lens 32768,131072 --layers 2
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Bench case -> actor.loss.path.
PATHS = {"chunked_lm_head": "lm_head", "chunked_logprobs": "logprobs", "naive": "reference"}


def run_case(seq_len: int, path: str, args) -> dict:
    """Build the engine for one (length, path), run the steps, return peak GiB and step ms (or OOM)."""
    from megatron.core import parallel_state

    from sftprof.allocation import parse_allocation_mode
    from sftprof.config import load_config
    from sftprof.data import global_loss_tokens, make_fake_sample, step_micro_batches
    from sftprof.engine.megatron import MegatronEngine
    from sftprof.tokenizer import load_tokenizer
    from sftprof.models.hf import load_hf_config

    overrides = [
        "actor.backend=megatron:d1", f"actor.num_layers={args.layers}", f"profile.fake_seq_len={seq_len}",
        "train_dataset.batch_size=1", "actor.mb_spec.n_mbs=1", "actor.megatron.use_precision_aware_optimizer=false",
        "actor.megatron.main_grads_dtype=float32", "actor.megatron.ddp.overlap_grad_reduce=false",
        "actor.megatron.ddp.overlap_param_gather=false", f"actor.loss.path={PATHS[path]}",
        f"actor.loss.logprobs_chunk_size={args.logprobs_chunk}",
        f"actor.loss.lm_head_loss_chunk_size={args.lm_head_chunk if PATHS[path] == 'lm_head' else 0}"]
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "qwen3_30b_a3b_sft_profile.yaml"), overrides)
    layout = parse_allocation_mode(cfg.actor.backend)
    hf = load_hf_config(cfg.actor.path, cfg.actor.num_layers)
    sample = make_fake_sample(load_tokenizer("", cfg.actor.path, hf.model_type), seq_len, 0.5, hf.vocab_size)
    tokens = global_loss_tokens(sample, 1)
    result = {"seq_len": seq_len, "path": path, "losses": []}
    engine = None
    try:
        engine = MegatronEngine(cfg, layout, hf, torch.device("cuda", 0))
        for step in range(args.steps):
            mbs = step_micro_batches(cfg, sample, step, 1, 0)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = engine.train_step(mbs, tokens)
            torch.cuda.synchronize()
            result["losses"].append(out.loss)
            result.update(step_ms=(time.perf_counter() - t0) * 1e3, loss=out.loss,
                          peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                          peak_over_start_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)
    except torch.cuda.OutOfMemoryError as err:
        result.update(oom=True, error=str(err).splitlines()[0][:160])
    finally:
        del engine
        parallel_state.destroy_model_parallel()
    return result


def _case_main(case: str, args) -> int:
    """Run one ``SEQ:PATH`` case in this process (fresh CUDA context) and print ``RESULT <json>``."""
    from sftprof.trainer import init_distributed

    seq, path = case.split(":")
    init_distributed()
    try:
        print("RESULT " + json.dumps(run_case(int(seq), path, args)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="131072", help="comma list of tokens per sequence")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-30B-A3B shape")
    ap.add_argument("--steps", type=int, default=2, help="steps per case; the last is measured")
    ap.add_argument("--logprobs-chunk", type=int, default=4096, help="actor.loss.logprobs_chunk_size")
    ap.add_argument("--lm-head-chunk", type=int, default=4096, help="actor.loss.lm_head_loss_chunk_size")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {list(PATHS)}")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one SEQ:PATH case per process
    args = ap.parse_args()
    unknown = [p for p in args.paths.split(",") if p not in PATHS]
    if unknown:
        print(f"--paths={args.paths}: unknown {unknown}; accepted a comma list of {list(PATHS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.case:
        return _case_main(args.case, args)
    rows = []
    common = ["--layers", str(args.layers), "--steps", str(args.steps), "--logprobs-chunk", str(args.logprobs_chunk),
              "--lm-head-chunk", str(args.lm_head_chunk)]
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for path in args.paths.split(","):
            # One process per case: nothing of an earlier engine stays allocated.
            proc = subprocess.run([sys.executable, __file__, "--case", f"{seq_len}:{path}", *common],
                                  capture_output=True, text=True)
            found = [ln[len("RESULT "):] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(found[-1]) if found else {
                "seq_len": seq_len, "path": path, "oom": "OutOfMemoryError" in proc.stderr,
                "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}
            print(row, flush=True)
            rows.append(row)
    print(f"\nmegatron SFT step, Qwen3-30B-A3B shape, {args.layers} layers, 1 GPU ({torch.cuda.get_device_name()}), "
          f"full recompute, logprobs chunk {args.logprobs_chunk}, LM-head chunk {args.lm_head_chunk}, "
          "one process per case")
    print(f"{'tokens':>8} | {'path':<17} | {'peak alloc GiB':>14} | {'peak over start GiB':>19} | {'step ms':>9} | loss per step")
    for r in rows:
        if "peak_gib" not in r:
            what = "OOM" if r.get("oom") else "error"
            print(f"{r['seq_len']:>8} | {r['path']:<17} | {what:>14} | {what:>19} | {'-':>9} | {r.get('error', '')}")
        else:
            print(f"{r['seq_len']:>8} | {r['path']:<17} | {r['peak_gib']:>14.2f} | {r['peak_over_start_gib']:>19.2f} | "
                  f"{r['step_ms']:>9.1f} | {' '.join(f'{x:.4f}' for x in r['losses'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
