"""FSDP engine numerics (1 process, gloo): step-0 loss and grad norm equal a plain-torch reference."""
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import Qwen3MoeForCausalLM

from sftprof.allocation import parse_allocation_mode
from sftprof.config import load_config
from sftprof.data import global_loss_tokens, make_fake_sample, step_micro_batches
from sftprof.tokenizer import load_tokenizer
from sftprof.engine import build_engine
from sftprof.flops import ModelShape, forward_flops, train_step_flops
from sftprof.models.hf import load_hf_config


@pytest.fixture(scope="module")
def gloo_world_1(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "filestore"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _reference(state: dict, hf_config, mbs, n_loss_tokens):
    """fp32 HF model with the engine's weights: token-mean loss (fp64 log-softmax) and grad norm."""
    ref = Qwen3MoeForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    ref.load_state_dict(state, strict=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for mb in mbs:
        logits = ref(input_ids=mb.input_ids, use_cache=False).logits.double()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
        loss_sum = loss_sum - (logp * mb.loss_mask).sum()
    loss = loss_sum / n_loss_tokens
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters() if p.grad is not None))
    return loss.item(), norm.item()


@pytest.mark.parametrize("head_chunk", [0, 24])
def test_fsdp_step0_loss_matches_reference(gloo_world_1, head_chunk):
    cfg = load_config("tiny_cpu", ["actor.backend=fsdp:d1", "train_dataset.batch_size=3", "actor.mb_spec.n_mbs=2",
                                   "profile.fake_seq_len=32", "actor.loss.logprobs_chunk_size=40",
                                   f"actor.loss.lm_head_loss_chunk_size={head_chunk}",
                                   "actor.optimizer.gradient_clipping=0.5", "actor.mb_spec.max_tokens_per_mb=0"])
    layout = parse_allocation_mode(cfg.actor.backend)
    hf_config = load_hf_config(cfg.actor.path)
    tok = load_tokenizer("", cfg.actor.path, hf_config.model_type)
    sample = make_fake_sample(tok, 32, 0.5, hf_config.vocab_size)
    torch.manual_seed(cfg.seed)
    engine = build_engine(cfg, layout, hf_config, torch.device("cpu"))
    assert engine.rank_coords == {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0, "etp": 0}
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in engine.model.state_dict().items()}
    mbs = step_micro_batches(cfg, sample, 0, 1, 0)
    assert [mb.input_ids.shape[0] for mb in mbs] == [2, 1]
    n_tokens = global_loss_tokens(sample, 3)
    ref_loss, ref_norm = _reference(state, hf_config, mbs, n_tokens)
    result = engine.train_step(mbs, n_tokens)
    assert math.isfinite(result.loss)
    assert result.loss == pytest.approx(ref_loss, rel=2e-6)
    assert result.grad_norm == pytest.approx(ref_norm, rel=1e-4)
    assert ref_norm > 0.5  # so clipping at 0.5 was active in the step
    flops = train_step_flops(ModelShape.from_hf(hf_config), [32] * 3, "full")
    assert (result.model_flops, result.recompute_flops) == (flops.model, flops.recompute)


def test_fsdp_loads_hf_checkpoint_and_matches_transformers(gloo_world_1, tmp_path):
    """fsdp backend on a save_pretrained checkpoint: per-token log-probs (our op on its LM head) and the step-0
    loss equal Qwen3MoeForCausalLM's on the same tokens (fp32)."""
    from hf_checkpoints import write_qwen3_moe

    from sftprof.data import MicroBatch
    from sftprof.ops import vocab_parallel_logprobs

    ckpt = write_qwen3_moe(tmp_path / "ckpt")
    cfg = load_config("tiny_cpu", ["actor.backend=fsdp:d1", f"actor.path={ckpt}", "actor.init_from_scratch=false",
                                   "actor.dtype=float32", "profile.fake_seq_len=48", "train_dataset.batch_size=2",
                                   "actor.mb_spec.n_mbs=1", "actor.loss.logprobs_chunk_size=16"])
    hf_config = load_hf_config(cfg.actor.path)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, hf_config.vocab_size, (2, 49), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 20:] = True
    ref = Qwen3MoeForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ref_logp = torch.log_softmax(ref(input_ids=ids, use_cache=False).logits, -1).gather(-1, labels[..., None])[..., 0]
    engine = build_engine(cfg, parse_allocation_mode(cfg.actor.backend), hf_config, torch.device("cpu"))
    captured = []  # the decoder's output inside the FSDP root's forward (its parameters are unsharded only there)
    handle = engine.model.model.register_forward_hook(lambda m, i, o: captured.append(o.last_hidden_state))
    with torch.no_grad():
        engine.model(ids, labels, mask.float())
        handle.remove()
        hidden = captured[0]
        weight = engine.model.lm_head.weight
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        logp = vocab_parallel_logprobs((hidden @ weight.t()).flatten(0, 1), labels.flatten(), chunk_size=16)
    assert (logp.view(2, 48) - ref_logp).abs().max().item() < 1e-5
    result = engine.train_step([MicroBatch(ids, labels, mask, (0, 1))], int(mask.sum()))
    ref_loss = -(ref_logp * mask).sum().item() / int(mask.sum())
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)


def test_fsdp_qwen3_5_step_reports_model_flops(gloo_world_1):
    """Qwen3.5 (gated delta-net and gated full-attention layers) on the fsdp backend: the step's model FLOPs are
    sftprof.flops' count of its global batch, its recompute that of HF gradient checkpointing (every layer)."""
    from sftprof.data import MicroBatch

    cfg = load_config("tiny_qwen3_5_cpu", ["actor.backend=fsdp:d1", "profile.fake_seq_len=64"])
    hf_config = load_hf_config(cfg.actor.path)
    engine = build_engine(cfg, parse_allocation_mode(cfg.actor.backend), hf_config, torch.device("cpu"))
    ids = torch.randint(0, hf_config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    result = engine.train_step([MicroBatch(ids, ids, mask, (0, 1))], int(mask.sum()))
    flops = train_step_flops(ModelShape.from_hf(hf_config), [64, 64], "full")
    assert flops.recompute == pytest.approx(forward_flops(ModelShape.from_hf(hf_config), [64, 64]).decoder, rel=1e-12)
    assert (result.model_flops, result.recompute_flops) == (flops.model, flops.recompute) and flops.model > 0
