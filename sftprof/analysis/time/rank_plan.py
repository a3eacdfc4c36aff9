"""The plan of one rank of a layout: what a simulated rank holds and computes, and what the real rank would send.

A simulated rank (``actor.simulate.rank``: one rank of an N-rank layout alone on one device, collectives not run,
:mod:`sftprof.trainer`) is the real rank's work only if its shapes are the real rank's. :func:`rank_plan` states
them from the layout, the model and the trial's settings, without torch:

- ``shards``: parameters on the rank (``sftprof.analysis.memory.estimate.params_per_rank``) and the ranks its
  optimizer state is sharded over (DP x CP for dense parameters, expert DP for the experts, with the distributed
  optimizer; DP for FSDP2);
- ``tokens``: tokens per micro-batch on the rank (``S b / CP``, ``/ TP`` under sequence parallelism), its two CP
  chunks (:func:`sftprof.data.cp_chunk_ids`' rule: chunks ``i`` and ``2 CP - 1 - i`` of ``2 CP``) and the keys each
  attends to (causal: every chunk up to its own), and the token-expert pairs its local experts receive under
  balanced routing (every expert gets ``1 / E`` of the ``k`` choices of every token): ``T k ETP`` per rank,
  ``T k ETP EP / E`` per local expert (``T`` tokens entering the MoE layer on each rank);
- ``collectives``: per process group and kind, the bytes of one call's buffer per rank (the all-gather's output,
  the reduce-scatter's input, the all-to-all's input, the send's tensor: the sizes the simulated rank allocates)
  and the calls per step, for the megatron engine (TP with sequence parallelism, CP K/V gather, EP all-to-all,
  ETP gather, PP send/recv, DP gradient reduce-scatter and parameter all-gather) and FSDP2 (per-layer parameter
  all-gather, gradient reduce-scatter).

Units: bytes, tokens, calls. Every approximation is a line of ``assumptions``. ``sftprof.analysis.time.projection`` turns
the collectives into time.
"""
from __future__ import annotations

from math import comb
from typing import Any

from sftprof.allocation import Layout
from sftprof.analysis.memory.estimate import params_per_rank
from sftprof.config.schema import n_micro_batches

__all__ = ["rank_plan", "group_ranks", "dedup_fraction"]

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Megatron's rank = tp + TP*(cp + CP*(dp + DP*pp)) (attention) and etp + ETP*(ep + EP*(edp + EDP*pp)) (experts):
# the strides of each dimension, and which coordinates a group varies.
_GROUP_DIMS = {"tp": ("tp",), "cp": ("cp",), "dp_cp": ("cp", "dp"), "tp_cp": ("tp", "cp"), "pp": ("pp",),
               "ep": ("ep",), "etp": ("etp",), "edp": ("edp",), "dp": ("dp",)}


def group_ranks(layout: Layout, rank: int, group: str) -> list[int]:
    """The global ranks of ``rank``'s process group ``group`` (a key of ``_GROUP_DIMS``), in Megatron's order.

    Raises:
        ValueError: an unknown group name.
    """
    if group not in _GROUP_DIMS:
        raise ValueError(f"process group {group!r}: accepted {list(_GROUP_DIMS)}")
    if group in ("ep", "etp", "edp"):
        sizes = {"etp": layout.etp, "ep": layout.ep, "edp": layout.edp, "pp": layout.pp}
        order = ("etp", "ep", "edp", "pp")
    else:
        sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}
        order = ("tp", "cp", "dp", "pp")
    stride, strides = 1, {}
    for d in order:
        strides[d] = stride
        stride *= sizes[d]
    coords = {d: (rank // strides[d]) % sizes[d] for d in order}
    members = [sum(coords[d] * strides[d] for d in order if d not in _GROUP_DIMS[group])]
    for d in _GROUP_DIMS[group]:
        members = [m + i * strides[d] for m in members for i in range(sizes[d])]
    return sorted(members)


def dedup_fraction(experts: int, top_k: int, ep: int) -> float:
    """Share of a token's ``top_k`` copies sent when it goes once to each EP rank holding one of its experts:
    ``P(a rank holds >= 1 of its k experts) * EP / k``, under uniform routing of ``k`` distinct experts out of
    ``experts`` (``experts / ep`` on each rank)."""
    local = experts // ep
    p_hit = 1.0 - comb(experts - local, top_k) / comb(experts, top_k)
    return p_hit * ep / top_k


def _call(group: str, kind: str, nbytes: float, calls: int, members: list[int], overlap: str,
          what: str) -> dict[str, Any]:
    return {"group": group, "collective": kind, "bytes_per_call": int(nbytes), "calls": calls,
            "group_size": len(members), "ranks": members, "overlap": overlap, "what": what}


def rank_plan(cfg: dict[str, Any], hf: Any, layout: Layout, rank: int, have_te: bool | None = None) -> dict[str, Any]:
    """The plan of ``rank`` of ``layout`` (module docstring) for one training step of the trial ``cfg``.

    Args:
        cfg: the trial's resolved config as a nested dict (``config.yaml``).
        hf: the model's Hugging Face (text) config (``hidden_size``, heads, ``head_dim``, ``num_experts``,
            ``num_experts_per_tok``, ``vocab_size``, ``num_hidden_layers`` already cut by ``actor.num_layers``).
        layout: the trial's layout; ``rank`` one of its ranks.
        have_te: Transformer Engine in the trial (its layers take megatron's plain all-to-all dispatcher, never the
            deduplicating one); None when unknown: the plain dispatcher's bytes, an upper bound.
    Returns:
        ``{"rank", "coords", "world_size", "shards", "tokens", "collectives", "assumptions"}`` (module docstring).
    Raises:
        sftprof.allocation.AllocationError: ``rank`` outside the layout.
        ValueError: the sequence length does not split as CP and TP need.
    """
    coords = layout.rank_coords(rank)
    a, prof = cfg["actor"], cfg["profile"]
    m: dict[str, Any] = a.get("megatron") or {}
    ddp = m.get("ddp") or {}
    wb = _BYTES[a.get("dtype", "bfloat16")]
    seq = int(prof["fake_seq_len"])
    batch = int(cfg["train_dataset"]["batch_size"])
    spec = a["mb_spec"]
    n_mbs = n_micro_batches(batch // layout.dp, seq, int(spec["n_mbs"]), int(spec.get("n_mbs_divisor", 1)),
                            int(spec.get("max_tokens_per_mb", 0)))
    b = batch // layout.dp / n_mbs  # sequences per micro-batch (a mean when they do not split evenly)
    megatron = layout.backend == "megatron"
    cp, tp = (layout.cp, layout.tp) if megatron else (1, 1)
    if seq % (2 * cp if cp > 1 else 1) or (seq // cp) % tp:
        raise ValueError(f"profile.fake_seq_len={seq}: must be divisible by 2*CP={2 * cp} and the per-CP-rank length "
                         f"by TP={tp}")
    h, E, k = hf.hidden_size, hf.num_experts, hf.num_experts_per_tok
    d = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    layers = hf.num_hidden_layers // layout.pp
    dense, expert = params_per_rank(hf, layout, coords)
    s_cp = seq // cp
    t_moe = b * s_cp / tp  # tokens entering the MoE layer on this rank (sequence parallel when TP > 1)
    routed = t_moe * k * layout.etp if megatron else b * seq * k
    chunk = seq // (2 * cp)
    chunks = ([{"chunk": i, "tokens": chunk, "keys": (i + 1) * chunk}
               for i in (coords["cp"], 2 * cp - 1 - coords["cp"])] if cp > 1 else [{"chunk": 0, "tokens": seq,
                                                                                     "keys": seq}])
    dist_opt = bool(ddp.get("use_distributed_optimizer", True)) if megatron else True
    shards = {"params_dense": dense, "params_expert": expert,
              "optimizer_shards_dense": (layout.dp * cp if dist_opt else 1) if megatron else layout.dp,
              "optimizer_shards_expert": (layout.edp if dist_opt else 1) if megatron else layout.dp,
              "layers": layers, "pp_stage": coords["pp"]}
    tokens = {"micro_batches": n_mbs, "sequences_per_micro_batch": b, "per_micro_batch": b * s_cp,
              "per_micro_batch_per_tp_rank": t_moe, "cp_chunks": chunks,
              "expert_pairs_per_micro_batch": routed,
              "pairs_per_local_expert": routed * layout.ep / E if megatron else routed / E,
              "local_experts": E // layout.ep if megatron else E}
    assumptions = (["balanced routing: every expert receives 1/E of the top-k choices (the fake process group hands "
                    "every EP peer this rank's own token counts; random router logits make them ~balanced)"]
                   if megatron else [])
    recompute = bool(a.get("gradient_checkpointing", True)) and (not megatron or
                                                                 m.get("recompute_granularity", "full") == "full")
    passes = 3 if recompute else 2  # forward, backward (+ the recomputed forward of full recompute)
    if megatron and not recompute and a.get("gradient_checkpointing", True):
        assumptions.append("selective recompute: its re-run modules' collectives are not counted again")
    collectives: list[dict[str, Any]] = []

    def add(group: str, kind: str, nbytes: float, calls: int, overlap: str, what: str) -> None:
        members = group_ranks(layout, rank, group) if megatron else list(range(layout.dp))
        if len(members) > 1 and calls > 0:
            collectives.append(_call(group, kind, nbytes, calls, members, overlap, what))

    if not megatron:
        p_all = dense + expert
        add("dp", "all_gather", p_all * wb, 2 * n_mbs, "none",
            "FSDP2 parameters, each layer's all-gather in forward and backward (the recompute reuses backward's)")
        add("dp", "reduce_scatter", p_all * 4, n_mbs, "none", "FSDP2 gradients in fp32 (reduce_dtype)")
        assumptions.append("FSDP2 all-gathers counted per micro-batch, unsharded layer by layer, none overlapped")
        return {"rank": rank, "coords": coords, "world_size": layout.world_size, "shards": shards, "tokens": tokens,
                "collectives": collectives, "assumptions": assumptions}
    act = b * s_cp * h * wb  # one [s/cp, b, h] activation
    per_layer = n_mbs * layers
    add("tp", "all_gather", act, passes * per_layer, "none",
        "sequence parallel: the attention's input gathered over TP (forward, recompute; its gradient in backward)")
    add("tp", "reduce_scatter", act, passes * per_layer, "none", "sequence parallel: the attention's output")
    kv_heads = max(1, hf.num_key_value_heads // tp)
    kv = 2 * b * s_cp * kv_heads * d * wb
    cp_overlap = "cp_attention" if m.get("cp_comm_overlap", True) and m.get("cp_attention", "blocks") == "blocks" \
        else "none"
    add("cp", "all_gather", kv * cp, (passes - 1) * per_layer, cp_overlap, "K/V of the local chunks gathered over CP")
    add("cp", "reduce_scatter", kv * cp * 4 // wb, per_layer, cp_overlap, "K/V gradients reduce-scattered in fp32")
    if cp > 1:
        assumptions.append("CP communication as the local spec runs it (K/V all-gather, fp32 reduce-scatter of their "
                           "gradients); Transformer Engine's ring moves the same K/V bytes in CP - 1 send/recv steps")
    dedup_on = bool(m.get("moe_dedup_alltoall", True)) and layout.etp == 1 and layout.ep > 1
    dedup = dedup_fraction(E, k, layout.ep) if dedup_on and have_te is False else 1.0
    if dedup < 1.0:
        assumptions.append(f"deduplicating dispatcher (actor.megatron.moe_dedup_alltoall): a token goes once to each EP "
                           f"rank holding one of its experts: {dedup:.3f} of the k copies under uniform routing")
    elif dedup_on and have_te is None:
        assumptions.append("Transformer Engine in the trial unknown: the plain all-to-all's bytes (every copy of a "
                           "token sent), an upper bound if the deduplicating dispatcher ran")
    pairs_sent = t_moe * k * dedup
    add("ep", "all_to_all", pairs_sent * h * wb, 2 * passes * per_layer, "none",
        "MoE dispatch and combine of the routed tokens (forward, recompute, backward)")
    add("etp", "all_gather", t_moe * k * h * wb * layout.etp, passes * per_layer, "none",
        "routed tokens gathered over expert TP")
    add("etp", "reduce_scatter", t_moe * k * h * wb * layout.etp, passes * per_layer, "none",
        "expert outputs reduce-scattered over expert TP")
    if layout.pp > 1:
        add("pp", "send_recv", act / tp, 2 * n_mbs, "none",
            "stage activations and their gradients (one send and one receive per micro-batch and direction)")
        assumptions.append("pipeline bubble not modelled: the projection is one stage's work")
    # the gradient buffer's dtype, as sftprof.analysis.memory.estimate counts it
    grad_b = (_BYTES.get(m.get("main_grads_dtype", ""), 4) if m.get("use_precision_aware_optimizer")
              else 4 if ddp.get("grad_reduce_in_fp32") else wb)
    grad_overlap, gather_overlap = ("backward" if ddp.get("overlap_grad_reduce") else "none",
                                    "forward" if ddp.get("overlap_param_gather") and dist_opt else "none")
    dense_kind = "reduce_scatter" if dist_opt else "all_reduce"
    add("dp_cp", dense_kind, dense * grad_b, 1, grad_overlap, "dense gradients over DP x CP")
    add("edp", dense_kind, expert * grad_b, 1, grad_overlap, "expert gradients over expert DP")
    if dist_opt:
        add("dp_cp", "all_gather", dense * wb, 1, gather_overlap, "updated dense parameters (distributed optimizer)")
        add("edp", "all_gather", expert * wb, 1, gather_overlap, "updated expert parameters")
    assumptions.append("not counted: the vocab-parallel loss's all-reduces (a few floats per token), the router's "
                       "load and the step's scalar all-reduces")
    return {"rank": rank, "coords": coords, "world_size": layout.world_size, "shards": shards, "tokens": tokens,
            "collectives": collectives, "assumptions": assumptions}
