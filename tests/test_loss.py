"""sftprof.loss: the three loss paths agree with an fp64 reference in loss and gradients (CPU)."""
import pytest
import torch

from sftprof.loss import SFTLoss, reference_logprobs

N, H, V = 48, 16, 300


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (N,), generator=g)
    mask = (torch.rand(N, generator=g) > 0.3).float()
    return hidden, weight, labels, mask


def _fp64_reference():
    hidden, weight, labels, mask = (t.double() if t.is_floating_point() else t for t in _inputs())
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    loss = -(logp * mask).sum()
    loss.backward()
    return loss.item(), hidden.grad, weight.grad


@pytest.mark.parametrize("spec", [SFTLoss("lm_head", 0, 20), SFTLoss("logprobs", 7, 0),
                                  SFTLoss("logprobs", 0, 0), SFTLoss("reference", 0, 0)])
def test_paths_match_fp64_reference(spec):
    ref_loss, ref_dh, ref_dw = _fp64_reference()
    hidden, weight, labels, mask = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    # The lm_head path consumes its hidden input (grad_in_hidden), as the engines' final-norm output is.
    h = hidden * 1.0
    loss = spec.from_hidden(h, weight, labels, mask)
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss) < 1e-5 * abs(ref_loss)
    assert ((hidden.grad.double() - ref_dh).norm() / ref_dh.norm()).item() < 1e-5
    assert ((weight.grad.double() - ref_dw).norm() / ref_dw.norm()).item() < 1e-5


def test_path_from_config_and_misuse():
    from sftprof.config import load_config

    cfg = load_config("tiny_cpu", ["actor.loss.lm_head_loss_chunk_size=256"])
    assert SFTLoss.from_config(cfg) == SFTLoss("lm_head", 128, 256)
    # the log line names the settings it reports (issue 50: "chunk 128 tokens" was read as the LM head's chunk)
    assert SFTLoss.from_config(load_config("tiny_cpu")).describe() == ("logprobs (full logits, LM_HEAD_LOSS_CHUNK_SIZE=0; "
                                                                       "vocab_parallel_logprobs, chunks of "
                                                                       "LOGPROBS_CHUNK_SIZE=128 tokens)")
    assert SFTLoss.from_config(cfg).describe() == "lm_head (linear_sft_loss, chunks of LM_HEAD_LOSS_CHUNK_SIZE=256 tokens)"
    # on CUDA the chunk size does not apply (one launch over all tokens): the megatron engine's log said "chunk 128"
    assert SFTLoss.from_config(load_config("tiny_cpu")).describe(cuda=True) == \
        ("logprobs (full logits, LM_HEAD_LOSS_CHUNK_SIZE=0; vocab_parallel_logprobs, all tokens at once on CUDA "
         "(LOGPROBS_CHUNK_SIZE=128 applies on CPU))")
    assert SFTLoss("logprobs", 0, 0).describe(cuda=True) == \
        "logprobs (full logits, LM_HEAD_LOSS_CHUNK_SIZE=0; vocab_parallel_logprobs, unchunked (LOGPROBS_CHUNK_SIZE=0))"
    with pytest.raises(ValueError, match="the chunked LM-head loss takes hidden states"):
        SFTLoss("lm_head", 0, 8).from_logits(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), torch.ones(2))
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    assert torch.allclose(reference_logprobs(logits, torch.tensor([2])), torch.log_softmax(logits, -1)[:, 2])
