"""The driver's step-0 loss on a Hugging Face checkpoint against transformers' loss on the same tokens.

    python bench/checkpoint_loss.py write --layers 4 --out /tmp/q3_4l          # random bf16 Qwen3-30B-A3B, 4 layers
    MODEL_PATH=/tmp/q3_4l ... bash run_qwen3_30b_a3b_sft_profile.sh actor.init_from_scratch=false ...
    python bench/checkpoint_loss.py check --checkpoint /tmp/q3_4l --seq 32768 --stats LOG_DIR/stats.jsonl

``check`` rebuilds the trial's step-0 global batch exactly as the trainer does (same tokenizer, fake sample
and loss mask), runs ``AutoModelForCausalLM`` in the checkpoint's dtype (bf16) on the GPU, computes the
token-mean SFT loss (fp32 log-softmax, LM head in chunks of 4096 tokens), and prints it next to the
``stats.jsonl`` step-0 loss with the relative difference. Exit 1 when that exceeds ``--rtol`` (default 1e-2,
bf16 tolerance: both sides round activations to bf16 in different orders).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _write(args) -> int:
    from sftprof.models.hf import load_hf_config, save_random_checkpoint

    hf = load_hf_config(args.config, args.layers)
    save_random_checkpoint(hf, args.out, torch.bfloat16, seed=args.seed, device="cuda")
    print(f"wrote {args.out}: {args.config} cut to {args.layers} layers, bf16, seed {args.seed}")
    return 0


def _check(args) -> int:
    from transformers import AutoModelForCausalLM

    from sftprof.data import make_fake_sample
    from sftprof.tokenizer import load_tokenizer
    from sftprof.models.hf import load_hf_config

    records = [json.loads(line) for line in Path(args.stats).read_text().splitlines() if line.strip()]
    step0 = next(r for r in records if r.get("type") == "step" and r["step"] == 0)
    hf = load_hf_config(str(args.checkpoint))
    sample = make_fake_sample(load_tokenizer("", str(args.checkpoint), hf.model_type), args.seq, args.loss_start_ratio,
                              hf.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(str(args.checkpoint), attn_implementation="sdpa").cuda().eval()
    ids = sample.input_ids[None].cuda()
    labels, mask = sample.labels.clamp_min(0).cuda(), sample.loss_mask.cuda()  # the last label is padding (masked)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        total = torch.zeros((), dtype=torch.float64, device="cuda")
        for lo in range(0, args.seq, 4096):
            logits = model.lm_head(hidden[lo:lo + 4096]).float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[lo:lo + 4096, None]).squeeze(-1)
            total -= (logp.double() * mask[lo:lo + 4096]).sum()
    ref = (total / mask.sum()).item()
    rel = abs(step0["loss"] - ref) / abs(ref)
    print(f"step-0 loss: driver {step0['loss']:.6f}, transformers {ref:.6f}, relative difference {rel:.2e} "
          f"(tolerance {args.rtol:g})")
    return 0 if rel <= args.rtol else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a random bf16 checkpoint of a bundled config")
    w.add_argument("--config", default="qwen3_30b_a3b")
    w.add_argument("--layers", type=int, default=4)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="compare a trial's step-0 loss with transformers")
    c.add_argument("--checkpoint", type=Path, required=True)
    c.add_argument("--stats", type=Path, required=True, help="the trial's stats.jsonl (TRAIN_BATCH_SIZE=1)")
    c.add_argument("--seq", type=int, required=True, help="PROFILE_FAKE_SEQ_LEN of the trial")
    c.add_argument("--loss-start-ratio", type=float, default=0.5)
    c.add_argument("--rtol", type=float, default=1e-2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    return _write(args) if args.cmd == "write" else _check(args)


if __name__ == "__main__":
    sys.exit(main())
