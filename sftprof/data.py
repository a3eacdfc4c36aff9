"""The fake long SFT sample, micro-batch split and context-parallel slicing.

Every trial trains on the same token ids: one structured code-repair conversation (ChatML,
written for this project) is encoded once, its ids are repeated and cut to exactly
``profile.fake_seq_len`` tokens, and every sample of the fake dataset is that sequence. So
the tokens are identical across samples, steps, runs and parallel layouts, and kernel or memory
profiles of two layouts see the same work.

Label / loss-mask convention (tested in ``tests/test_data.py``): for a sequence of ``L`` ids,

- token ``t`` is a *target* (trained on) iff ``t >= b`` with
  ``b = clamp(int(L * profile.fake_loss_start_ratio), 1, L - 1)``: the first ``b`` tokens are the
  prompt, the rest the response;
- position ``i`` predicts token ``i + 1``: ``labels[i] = input_ids[i + 1]`` for ``i < L - 1``
  and ``labels[L - 1] = PAD_LABEL`` (0);
- ``loss_mask[i] = 1`` iff token ``i + 1`` is a target, i.e. ``b - 1 <= i <= L - 2``. The last
  position never carries loss, and there are always exactly ``L - b >= 1`` loss tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

import torch

from sftprof.config.schema import n_micro_batches
from sftprof.tokenizer import TextTokenizer

PAD_LABEL = 0


def _chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


# A code-repair agent turn: system prompt, a user report with code, a tool call reading a
# file, the tool's JSON result, a plan, and the natural-language answer that is trained on.
FAKE_CONVERSATION = "".join((
    _chatml("system",
            "You are a careful software engineer. You can read files with the `read_file` tool "
            "and must explain every change you make."),
    _chatml("user",
            "Our rate limiter lets bursts through after a restart. Here is the code:\n"
            "```python\n"
            "import time\n\n"
            "class TokenBucket:\n"
            "    def __init__(self, rate: float, capacity: int):\n"
            "        self.rate = rate\n"
            "        self.capacity = capacity\n"
            "        self.tokens = capacity\n"
            "        self.updated = 0.0\n\n"
            "    def allow(self) -> bool:\n"
            "        now = time.monotonic()\n"
            "        self.tokens += (now - self.updated) * self.rate\n"
            "        self.updated = now\n"
            "        if self.tokens >= 1:\n"
            "            self.tokens -= 1\n"
            "            return True\n"
            "        return False\n"
            "```\n"
            "Why does it allow 10x the configured rate right after start-up?"),
    _chatml("assistant",
            "<tool_call>\n"
            '{"name": "read_file", "arguments": {"path": "config/limits.yaml"}}\n'
            "</tool_call>"),
    _chatml("user",
            "<tool_response>\n"
            '{"path": "config/limits.yaml", "content": "rate: 5.0\\ncapacity: 50\\n", "size_bytes": 25}\n'
            "</tool_response>"),
    _chatml("assistant",
            "Plan:\n1. Find where the refill overshoots.\n2. Cap the bucket at its capacity.\n"
            "3. Start the clock at construction time.\n\n"
            "Two bugs combine here. `updated` starts at 0.0, but `time.monotonic()` counts from an "
            "arbitrary point such as boot, so the first call adds hours of refill; and the bucket is "
            "never capped, so those tokens all stay available. Set `self.updated = time.monotonic()` "
            "in `__init__` and clamp the refill with `self.tokens = min(self.capacity, self.tokens + "
            "(now - self.updated) * self.rate)`. With rate 5 and capacity 50 a restart then allows "
            "at most one burst of 50 requests, followed by 5 per second."),
))


@dataclass(frozen=True)
class FakeSample:
    """One training sequence (all tensors ``[L]`` on CPU).

    Attributes:
        input_ids: int64 token ids.
        labels: int64 next-token ids (``labels[i] = input_ids[i+1]``, last = ``PAD_LABEL``).
        loss_mask: bool, True where position ``i``'s prediction is trained (module docstring).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


def loss_start(seq_len: int, ratio: float) -> int:
    """First target token index ``b = clamp(int(seq_len * ratio), 1, seq_len - 1)``."""
    return min(max(int(seq_len * ratio), 1), seq_len - 1)


def make_fake_sample(tokenizer: TextTokenizer, seq_len: int, loss_start_ratio: float,
                     vocab_size: int) -> FakeSample:
    """Encode :data:`FAKE_CONVERSATION` once, repeat the ids and cut them to ``seq_len``.

    Args:
        tokenizer: from :func:`sftprof.tokenizer.load_tokenizer`.
        seq_len: ``profile.fake_seq_len`` (>= 2), tokens per sequence.
        loss_start_ratio: ``profile.fake_loss_start_ratio`` in [0, 1).
        vocab_size: model vocabulary size; every id must be below it.

    Raises:
        ValueError: ``seq_len < 2``, or the tokenizer produced an id >= ``vocab_size``.
    """
    if seq_len < 2:
        raise ValueError(f"profile.fake_seq_len={seq_len}: must be an integer >= 2")
    ids = tokenizer.encode(FAKE_CONVERSATION)
    if max(ids) >= vocab_size:
        raise ValueError(f"tokenizer ({tokenizer.source}) produced id {max(ids)} >= the model's vocab_size "
                         f"{vocab_size}; set tokenizer_path to the model's tokenizer")
    reps = math.ceil(seq_len / len(ids))
    input_ids = torch.tensor(ids, dtype=torch.int64).repeat(reps)[:seq_len].clone()  # no Python list of L ints
    labels = torch.full_like(input_ids, PAD_LABEL)
    labels[:-1] = input_ids[1:]
    b = loss_start(seq_len, loss_start_ratio)
    loss_mask = torch.zeros(seq_len, dtype=torch.bool)
    loss_mask[b - 1:seq_len - 1] = True
    return FakeSample(input_ids, labels, loss_mask)


@dataclass(frozen=True)
class MicroBatch:
    """Sequences of one micro-batch on one DP rank (tensors ``[n_seqs, L]`` on CPU).

    ``sample_ids`` are the fake-dataset indices of the rows (identical content; kept for logs
    and tests). ``loss_mask`` is bool, see the module docstring.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    sample_ids: tuple

    @property
    def n_tokens(self) -> int:
        """Tokens in this micro-batch (``n_seqs * L``)."""
        return self.input_ids.numel()


def dp_rank_sample_ids(step: int, batch_size: int, dp: int, dp_rank: int, dataset_size: int) -> List[int]:
    """Fake-dataset indices of the sequences DP rank ``dp_rank`` trains on at ``step``.

    The global batch of step ``s`` is samples ``s*batch_size ... s*batch_size + batch_size - 1``
    (modulo ``dataset_size``); DP rank ``r`` takes the contiguous ``batch_size // dp`` of them
    starting at ``r * batch_size // dp``.

    Raises:
        ValueError: ``batch_size`` is not a multiple of ``dp`` or ``dp_rank`` is out of range.
    """
    if batch_size % dp:
        raise ValueError(f"train_dataset.batch_size={batch_size}: must be a multiple of the data-parallel size {dp}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp})")
    per_rank = batch_size // dp
    first = step * batch_size + dp_rank * per_rank
    return [(first + j) % dataset_size for j in range(per_rank)]


def split_micro_batches(sample: FakeSample, sample_ids: List[int], n_mbs: int) -> List[MicroBatch]:
    """Stack ``sample`` once per id and split the rows into ``n_mbs`` micro-batches.

    Split as ``torch.tensor_split``: the first ``len(sample_ids) % n_mbs`` micro-batches hold one
    sequence more than the others.
    """
    groups = [g.tolist() for g in torch.tensor_split(torch.tensor(sample_ids, dtype=torch.int64), n_mbs)]
    mbs = []
    for ids in groups:
        n = len(ids)
        mbs.append(MicroBatch(
            input_ids=sample.input_ids.expand(n, -1).clone(),
            labels=sample.labels.expand(n, -1).clone(),
            loss_mask=sample.loss_mask.expand(n, -1).clone(),
            sample_ids=tuple(ids),
        ))
    return mbs


def step_micro_batches(cfg, sample: FakeSample, step: int, dp: int, dp_rank: int) -> List[MicroBatch]:
    """The micro-batches DP rank ``dp_rank`` trains on at ``step`` (all settings from ``cfg``).

    Uses ``train_dataset.batch_size``, ``profile.fake_dataset_size`` and ``actor.mb_spec``
    (:func:`dp_rank_sample_ids`, :func:`n_micro_batches`, :func:`split_micro_batches`).
    """
    ids = dp_rank_sample_ids(step, cfg.train_dataset.batch_size, dp, dp_rank, cfg.profile.fake_dataset_size)
    spec = cfg.actor.mb_spec
    n = n_micro_batches(len(ids), sample.input_ids.numel(), spec.n_mbs, spec.n_mbs_divisor, spec.max_tokens_per_mb)
    return split_micro_batches(sample, ids, n)


def global_loss_tokens(sample: FakeSample, batch_size: int) -> int:
    """Loss tokens of one global batch (every DP rank together): ``batch_size * (L - b)``."""
    return int(sample.loss_mask.sum()) * batch_size


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """Global chunk indices ``(r, 2 * cp_size - 1 - r)`` held by CP rank ``r`` out of the sequence's
    ``2 * cp_size`` equal chunks: the one definition of the load-balanced context-parallel layout (used by
    :func:`cp_shard` and by :mod:`sftprof.models.layers.attention`).

    Raises:
        ValueError: ``cp_rank`` outside ``[0, cp_size)``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_shard(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """Load-balanced context-parallel slice of ``t`` along ``dim``.

    The sequence is cut into ``2 * cp_size`` equal chunks; CP rank ``i`` keeps chunks ``i`` and
    ``2 * cp_size - 1 - i`` concatenated, so every rank gets the same amount of causal-attention
    work (an early and a late chunk). This is the layout Megatron-LM's context parallelism
    expects.

    Args:
        t: tensor whose ``dim`` has length ``S`` divisible by ``2 * cp_size``.
        cp_size, cp_rank: CP group size and this rank's index in it.
        dim: the sequence dimension (default 1 for ``[batch, seq, ...]``).

    Returns:
        Tensor with ``S / cp_size`` along ``dim`` (a copy when ``cp_size > 1``, else ``t``).

    Raises:
        ValueError: ``S`` not divisible by ``2 * cp_size`` or ``cp_rank`` out of range.
    """
    if cp_size == 1:
        return t
    first, second = cp_chunk_ids(cp_size, cp_rank)
    s = t.shape[dim]
    if s % (2 * cp_size):
        raise ValueError(f"sequence length {s} is not divisible by 2 * context-parallel size = {2 * cp_size}; "
                         "choose profile.fake_seq_len as a multiple of it")
    chunks = t.chunk(2 * cp_size, dim=dim)
    return torch.cat((chunks[first], chunks[second]), dim=dim)
