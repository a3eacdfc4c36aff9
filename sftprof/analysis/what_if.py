"""What-if lines of a summary: first-order estimates of a change, from the measured figures and the trial's
configuration, each with its assumption (``{"text", "assumption"}``).

- selective recompute (``core_attn``) instead of full: saves the measured recompute GPU time minus
  the attention core's recompute time; adds the activations full recompute drops (not estimated here);
- ``expandable_segments:True``: at most the measured allocator slack at the peak is returned
  (assumes the slack is fragmentation, which expandable segments avoid);
- distributed optimizer: when off, the optimizer state divided by the DP size of each parameter (DP x CP
  dense, expert DP for the experts); when on, what it already divides by;
- chunked LM head where the logits are held whole: frees the logits (``s V / t`` in the model
  dtype, :mod:`sftprof.analysis.memory_estimate`).
"""
from __future__ import annotations

from typing import Optional

from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.schema import WhatIf, processed_snapshots, processed_traces

__all__ = ["trial_what_if", "kernel_what_if", "memory_what_if"]


def trial_what_if(summary: dict, cfg: Optional[dict]) -> list[WhatIf]:
    """The what-if lines of every profiled rank's trace and snapshot, in rank order (``cfg``: the trial's config)."""
    out: list[WhatIf] = []
    for t in processed_traces(summary):
        out += kernel_what_if(t["rank"], t["summary"], cfg)
    for m in processed_snapshots(summary):
        if m["rank"] is not None:
            out += memory_what_if(m["rank"], m["summary"], m.get("estimate"), cfg)
    return out


def kernel_what_if(rank: int, s: dict, cfg: Optional[dict]) -> list[WhatIf]:
    """The what-if lines of one rank's kernel summary ``s``: selective recompute where full recompute ran (GPU time
    by model part only; a CPU run's is not the GPU's)."""
    parts = s.get("parts") or {}
    rec = sum(r["recompute_ms"] for r in parts.get("summed") or [])
    what = []
    m = ((cfg or {}).get("actor") or {}).get("megatron") or {}
    if rec and m.get("recompute_granularity") == "full":
        core = next((r["recompute_ms"] for r in parts.get("summed") or [] if r["part"] == "attn_core"), 0.0)
        what.append({"text": f"selective recompute (core_attn) instead of full: about {rec - core:.1f} ms less GPU "
                             f"time per step on rank {rank} (measured recompute {rec:.1f} ms minus the attention "
                             f"core's {core:.1f} ms)", "assumption": "the recomputed work is removed one for one; the "
                             "activation memory that full recompute avoids comes back (see the memory trial)"})
    return what


def memory_what_if(rank: int, s: dict, estimate: Optional[dict], cfg: Optional[dict]) -> list[WhatIf]:
    """The what-if lines of one rank's snapshot summary ``s`` with its theoretical ``estimate``
    (:func:`sftprof.analysis.memory_estimate.estimate_memory`; None without one)."""
    if not s.get("peak_allocated_bytes"):
        return []
    gib = 2.0**30
    what = []
    slack = s.get("reserved_minus_allocated_at_peak_bytes") or 0
    if slack > 0:
        what.append({"text": f"expandable_segments:True: up to {slack / gib:.2f} GiB of reserved memory on rank {rank} "
                             "returned (the slack at the peak)",
                     "assumption": "the slack is fragmentation of the caching allocator, which expandable "
                                   "segments avoid; reserved-but-cached blocks of other sizes are not separated"})
    a = (cfg or {}).get("actor") or {}
    m = a.get("megatron") or {}
    rows = {r["category"]: r for r in (estimate or {}).get("rows") or []}
    if estimate and "optimizer" in rows and str(a.get("backend", "")).startswith("megatron"):
        lay = parse_allocation_mode(a["backend"])
        dense, expert = estimate["params_dense"], estimate["params_expert"]
        if (m.get("ddp") or {}).get("use_distributed_optimizer", True):
            text = (f"distributed optimizer (on): the optimizer state ({rows['optimizer']['gib']:.1f} GiB estimated) is "
                    f"already divided by DP x CP = {lay.dp * lay.cp} (dense) and expert DP = {lay.edp}"
                    + ("; at DP 1 it shards nothing, more data-parallel ranks would divide it further"
                       if lay.dp * lay.cp == 1 and lay.edp == 1 else ""))
        else:
            full = rows["optimizer"]["bytes"]
            sharded = full * (dense / (lay.dp * lay.cp) + expert / lay.edp) / max(dense + expert, 1)
            text = (f"distributed optimizer at DP x CP = {lay.dp * lay.cp}, expert DP = {lay.edp}: optimizer state "
                    f"{full / gib:.1f} -> {sharded / gib:.1f} GiB on rank {rank}")
        what.append({"text": text, "assumption": "megatron-core's distributed optimizer shards main params, moments "
                                                 "(and the fp32 gradient copy) over the data-parallel ranks of each "
                                                 "parameter; gradient buffers stay whole"})
    if estimate and "activations" in rows:
        logits = rows["activations"].get("logits_bytes")  # 0 on the chunked LM-head loss path: nothing to propose
        if logits:
            what.append({"text": f"chunked LM head (LM_HEAD_LOSS_CHUNK_SIZE > 0): about {logits / gib:.2f} GiB of "
                                 f"logits on rank {rank} not held", "assumption": "logits s x V/tp in the model "
                                 "dtype, as in sftprof/analysis/memory_estimate.py; one chunk stays"})
    return what
