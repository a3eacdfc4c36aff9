"""One rank of the megatron-vs-Hugging-Face parity check (run under torchrun; used by tests/test_hf_parity_gpu.py).

Every rank loads the same fp32 checkpoint twice: into the megatron engine of ``--layout`` (through the
project's loader) and into ``transformers``' ``Qwen3MoeForCausalLM`` (the reference), on its GPU. For one
step on a global batch of two random sequences (half of each in the loss):

- per-token log-probs of the megatron model's logits against the reference's (layouts without TP/CP/PP,
  where this rank holds every token's full logits row);
- the step's SFT loss (token mean over the global batch) against the reference's;
- the gradient of every megatron parameter on this rank (``main_grad`` after the backward, all-reduced
  over DP: the distributed optimizer is off here so that every rank holds the whole gradient) against the
  reference gradient mapped onto this rank's shard by the same mapping that loads the weights.

``--cases`` lists ``LAYOUT@LM_HEAD_CHUNK`` items of this world size, run one after the other in this process
(the model is tiny). Writes a list of ``{"layout", "lm_head_chunk", "rank", "logprob_max_abs_err", "loss",
"ref_loss", "grad_rel_err": {name: err}, "grad_norms": {name: [megatron, reference]}}`` to
``--out-dir/rank<r>.json``.
"""
import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--cases", required=True, help="comma list of LAYOUT@LM_HEAD_CHUNK")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()

    from sftprof.compat import setup_transformer_engine
    from sftprof.trainer import init_distributed

    setup_transformer_engine("auto")  # before megatron-core imports TE (the trainer's order)
    rank, device = init_distributed()
    results = []
    for case in args.cases.split(","):
        layout, chunk = case.rsplit("@", 1)
        results.append(run_case(args.ckpt, layout, int(chunk), args.seq, rank, device))
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


def run_case(ckpt: str, layout_text: str, lm_head_chunk: int, seq: int, rank: int, device) -> dict:
    """One layout: megatron engine and transformers reference on this rank; errors as described above."""
    from megatron.core import parallel_state

    from transformers import Qwen3MoeForCausalLM

    from sftprof.allocation import parse_allocation_mode
    from sftprof.config import load_config
    from sftprof.data import MicroBatch
    from sftprof.engine.megatron import MegatronEngine
    from sftprof.models.checkpoint import DictSource
    from sftprof.models.hf import load_hf_config
    from sftprof.models.megatron_load import shard_context
    from sftprof.models.qwen3_moe_weights import local_tensor

    cfg = load_config("tiny_cpu", [
        f"actor.backend={layout_text}", "actor.dtype=float32", f"actor.path={ckpt}", "actor.init_from_scratch=false",
        "actor.optimizer.gradient_clipping=0", "actor.logprobs_chunk_size=0", "actor.mb_spec.n_mbs=1",
        f"actor.megatron.lm_head_loss_chunk_size={lm_head_chunk}", "actor.megatron.ddp.use_distributed_optimizer=false",
        f"profile.fake_seq_len={seq}", "train_dataset.batch_size=2"])
    layout = parse_allocation_mode(cfg.actor.backend)
    hf = load_hf_config(cfg.actor.path)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, hf.vocab_size, (2, seq + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, seq // 2:] = True
    per_dp = 2 // layout.dp
    dp_rank = layout.rank_coords(rank)["dp"]
    rows = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
    mb = MicroBatch(ids[rows], labels[rows], mask[rows], tuple(range(rows.start, rows.stop)))

    ref = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").to(device)
    ref_logits = ref(input_ids=ids.to(device), use_cache=False).logits.float()
    ref_logp = torch.log_softmax(ref_logits, dim=-1).gather(-1, labels.to(device).unsqueeze(-1)).squeeze(-1)
    n_loss = int(mask.sum())
    ref_loss = -(ref_logp * mask.to(device)).sum() / n_loss
    ref_loss.backward()
    ref_grads = DictSource({n: q.grad for n, q in ref.named_parameters() if q.grad is not None})

    engine = MegatronEngine(cfg, layout, hf, device)
    out = {"rank": rank, "layout": layout_text, "lm_head_chunk": lm_head_chunk, "logprob_max_abs_err": None}
    if layout.tp == layout.cp == layout.pp == 1 and not lm_head_chunk:  # this rank holds full logits rows
        with torch.no_grad():
            pos = torch.arange(seq, device=device).expand(per_dp, -1)
            logits = engine.mask_vocab_padding(engine.model(ids[rows].to(device), pos, None).float())
            logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[rows].to(device).unsqueeze(-1)).squeeze(-1)
        out["logprob_max_abs_err"] = (logp - ref_logp[rows]).abs().max().item()
    result = engine.train_step([mb], n_loss)
    ctx = shard_context(engine.gpt, hf)
    errs, norms = {}, {}
    for name, param in engine.gpt.named_parameters():
        want = local_tensor(name, ref_grads, ctx).to(device)
        got = param.main_grad
        errs[name] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        norms[name] = [got.norm().item(), want.norm().item()]
    out.update(loss=result.loss, ref_loss=ref_loss.item(), grad_rel_err=errs, grad_norms=norms)
    del engine
    parallel_state.destroy_model_parallel()
    return out


if __name__ == "__main__":
    main()
