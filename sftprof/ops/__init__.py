"""Token log-probs / entropy over a vocab-parallel LM head, chunked over tokens (pure torch + Triton).

No Megatron import: everything runs on CPU (gloo process groups for TP) and on CUDA, where the row-wise
softmax work goes to Triton kernels (:mod:`sftprof.ops.triton_kernels`, imported only for CUDA tensors).

Public API
----------
- :func:`vocab_parallel_logprobs` ``(logits [N, V/tp], labels [N], *, tp_group, chunk_size, temperature,
  return_entropy)``: log-probs (and entropy) from already computed logits; the backward overwrites the
  logits with their gradient (no new ``[N, V/tp]`` buffer).
- :func:`linear_logprobs` ``(hidden [N, H], weight [V/tp, H], labels [N], *, tp_group, chunk_size,
  temperature, return_entropy, sequence_parallel, grad_in_hidden)``: LM head fused with log-probs/entropy;
  logits are recomputed chunk by chunk in the backward (4 GEMMs).
- :func:`linear_sft_loss` ``(hidden, weight, labels, loss_weight [N], *, tp_group, chunk_size, temperature,
  sequence_parallel, grad_in_hidden)``: fp32 scalar ``sum(-logprob * loss_weight)`` with the gradients
  formed in the forward (3 GEMMs, no recompute); the backward only scales them.
- ``grad_in_hidden=True`` writes ``d/dhidden`` over ``hidden``'s storage (saves ``N x H`` elements; the
  hidden states are consumed, autograd's version counter catches any other saved use).
- :class:`StaleBufferError`: raised when a tensor kept for the backward was modified or replaced.
- All three take ``vocab_size=`` (optional, the full padded vocabulary) and check, with one all-gather of
  the shard width per call, that the TP group's shards have equal widths summing to it
  (:func:`sftprof.ops.guards.check_vocab_shards`; ``ValueError`` naming the widths otherwise).

How the trainer uses these
--------------------------
The trial's ``actor.loss`` section picks one path for both engines (``sftprof/loss.py``): ``lm_head`` calls
``linear_sft_loss(hidden, output_weight, labels, loss_weight, tp_group=<TP group>,
chunk_size=lm_head_loss_chunk_size, sequence_parallel=<SP on>, grad_in_hidden=True)`` on the final norm's
output (used by nothing else; ``loss_weight`` carries the loss mask and all normalisation; with Megatron's
``weight.main_grad`` the backward must receive gradient 1); ``logprobs`` runs the output layer and calls
``vocab_parallel_logprobs(logits.view(-1, V/tp), labels, tp_group=<TP group>, chunk_size=logprobs_chunk_size)``.
``linear_logprobs`` serves callers that need per-token log-probs or entropy without full logits; entropy
from these functions is differentiable (detach it when no gradient should flow through it).
"""
from sftprof.ops.guards import StaleBufferError
from sftprof.ops.lm_head import linear_logprobs, linear_sft_loss
from sftprof.ops.logprobs import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs", "linear_logprobs", "linear_sft_loss", "StaleBufferError"]
