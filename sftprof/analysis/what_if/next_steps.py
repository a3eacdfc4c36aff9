"""The next step of each finding (:mod:`sftprof.analysis.report.findings`): the setting to try, or why there is none.

Each finding gets ``next_step``, one line that starts with ``try `` and names the setting (a driver variable, a
``key=value`` argument of the driver or an environment variable of the trial), or starts with ``none: `` and says
why. In order:

1. a what-if of the trial (:mod:`sftprof.analysis.what_if.changes`) that acts on the finding's lever
   (:data:`WHAT_IFS_FOR`, heaviest first): its settings and predicted effect;
2. else such a what-if that was not proposed: why (its ``what_if_skipped`` reason); a CPU run's chunked LM head,
   never a what-if there, keeps the lever's rule (below) with that reason;
3. else the lever's own rule (:func:`_rule`), from the trial's config: e.g. a CPU run's LM head + loss gets
   ``LM_HEAD_LOSS_CHUNK_SIZE`` (the chunked LM-head loss the README's "Proving a change" measures).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, cast

from sftprof.analysis.schema import processed_traces
from sftprof.analysis.trial.schema import TrialRecord

from sftprof.analysis.report.schema import Finding

from sftprof.analysis.what_if.schema import WhatIf, WhatIfSetting, WhatIfSkipped
from sftprof.analysis.what_if.changes import _get  # the dotted-key reader of the what-ifs' rules
from sftprof.analysis.what_if.changes import CPU_LM_HEAD_CHUNK, LM_HEAD_CHUNK, effect_text, setting_text

__all__ = ["with_next_steps", "WHAT_IFS_FOR", "DRIVER_VARIABLES", "CPU_LM_HEAD_CHUNK", "NO_RULE"]

# a finding's key -> the what-ifs that act on its lever
WHAT_IFS_FOR = {
    "out of memory": ("fit_oom",),
    "gpu idle": ("cutlass_grouped_gemm", "fewer_micro_batches"),
    "part experts": ("cutlass_grouped_gemm", "balanced_routing"),
    "part router": ("balanced_routing",),
    "part dispatch_combine": ("balanced_routing",),
    "exposed imbalance": ("balanced_routing",),
    "exposed communication": ("fewer_micro_batches",),
    "recompute": ("selective_recompute",),
    "part lm_head_loss": ("chunked_lm_head",),
    "memory activations": ("chunked_lm_head", "more_micro_batches"),
    "transient": ("chunked_lm_head",),
    "memory optimizer": ("precision_aware_optimizer", "distributed_optimizer"),
    "memory gradients": ("precision_aware_optimizer",),
    "memory allocator_slack": ("expandable_segments",),
}
# config keys of what-if settings -> the driver variable that sets each (sftprof.launch.variables; a test checks them)
DRIVER_VARIABLES = {
    "actor.loss.lm_head_loss_chunk_size": "LM_HEAD_LOSS_CHUNK_SIZE",
    "actor.mb_spec.n_mbs": "PROFILE_N_MBS",
    "actor.megatron.use_precision_aware_optimizer": "USE_PRECISION_AWARE_OPTIMIZER",
    "actor.megatron.main_grads_dtype": "MAIN_GRADS_DTYPE",
}
NO_RULE = "none: sftprof has no rule for this lever yet; its section has the figures"
_LAYOUT = "a layout over more GPUs (actor.backend: TP, CP or EP) divides it"


def with_next_steps(findings: list[Finding], what_if: list[WhatIf], skipped: list[WhatIfSkipped],
                    summary: Mapping[str, Any], cfg: Optional[dict[str, Any]]) -> list[Finding]:
    """``findings``, each with its ``next_step`` (module docstring); ``cfg``: the trial's resolved config (None when
    unreadable: the rules that read it assume the shipped defaults)."""
    return [{**f, "next_step": _next_step(f, what_if, skipped, summary, cfg or {})} for f in findings]


def _next_step(f: Finding, what_if: list[WhatIf], skipped: list[WhatIfSkipped], summary: Mapping[str, Any],
               cfg: dict[str, Any]) -> str:
    key = f["key"]
    if key == "heaviest op":  # a CPU run's heaviest op: the lever of the model part it ran in
        key = f"part {_heaviest_part(summary, f.get('rank'))}"
    levers = WHAT_IFS_FOR.get(key, ())
    proposed = sorted((w for w in what_if if w["key"] in levers), key=lambda w: -w["weight"])
    if proposed:
        w = proposed[0]
        return (f"try {' '.join(_setting(s) for s in w['settings'])}: {effect_text(w['effect'], w['rank'])} "
                f"predicted (What if: {w['label']})")
    not_proposed = [s for s in skipped if s["key"] in levers]
    if not_proposed:
        s = not_proposed[0]
        rule = _rule(key, summary, cfg) if s["key"] == "chunked_lm_head" and _cpu(summary) else None
        if rule and rule.startswith("try "):  # the setting stands; its what-if line says why it is not tried
            return f"{rule}; not a what-if: {s['reason']}"
        return f"none: {s['label']} is not proposed: {s['reason']}"
    return _rule(key, summary, cfg) or NO_RULE


def _setting(s: WhatIfSetting) -> str:
    """A what-if's setting as the driver takes it: its variable's ``NAME=value`` where one sets the key, else
    :func:`sftprof.analysis.what_if.changes.setting_text` (a ``key=value`` argument, or an environment variable)."""
    var = DRIVER_VARIABLES.get(s["key"]) if s["kind"] == "config" else None
    return f"{var}={_value(s['value'])}" if var else setting_text(s)


def _value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _heaviest_part(summary: Mapping[str, Any], rank: Optional[int]) -> Optional[str]:
    for t in processed_traces(cast(TrialRecord, summary)):
        if t["rank"] == rank:
            heaviest = t["summary"].get("heaviest_op")
            return heaviest.get("part") if heaviest else None
    return None


def _cpu(summary: Mapping[str, Any]) -> bool:
    """The trial ran on CPU (its completion record's device)."""
    return bool((summary.get("completion") or {}).get("device") == "cpu")


def _rule(key: str, summary: Mapping[str, Any], cfg: dict[str, Any]) -> Optional[str]:
    """The lever's own next step when no what-if speaks for it; None for a lever without a rule."""
    megatron = str(_get(cfg, "actor.backend") or "").startswith("megatron")
    cpu = _cpu(summary)
    if key == "compile":
        return (f"try PROFILE_STEPS={summary['profile_step'] + 1} (a later step, after the compilation; "
                f"TOTAL_STEPS above it)")
    if key == "part lm_head_loss":
        chunk = _get(cfg, "actor.loss.lm_head_loss_chunk_size") or 0
        if chunk:
            return (f"none: the chunked LM-head loss is on (LM_HEAD_LOSS_CHUNK_SIZE={chunk}); what is left is the LM "
                    "head's matrix products over the vocabulary, the model's own work"
                    + ("" if cpu else " (Kernel efficiency gives their rate)"))
        if cpu:
            return (f"try LM_HEAD_LOSS_CHUNK_SIZE={CPU_LM_HEAD_CHUNK}: the LM head and the loss in chunks of "
                    f"{CPU_LM_HEAD_CHUNK} tokens, without the full logits and their log-softmax")
        return (f"try LM_HEAD_LOSS_CHUNK_SIZE={LM_HEAD_CHUNK}: the LM head and the loss in chunks, without the full "
                "logits; it saves their memory more than time (the GEMMs stay: see Kernel efficiency)")
    if key == "part experts":
        return ("none on this layout: the routed experts' GEMMs are the model's work; more expert parallelism "
                "(actor.backend's ffn:eN) divides them over more GPUs")
    if key == "part optimizer":
        return ("none per token: the optimizer runs once a step over the parameters, so its share falls with more "
                "tokens a step (TRAIN_BATCH_SIZE, PROFILE_FAKE_SEQ_LEN)")
    if key in ("part outside_parts", "part comm_outside") or key.startswith("part kernel:"):
        return "none: this time is outside the model parts; the Host section and the trace views show what it is"
    if key.startswith("part "):
        return f"none on this layout: this part is the model's own work at this size; {_LAYOUT}"
    if key == "recompute":
        if megatron:
            granularity = _get(cfg, "actor.megatron.recompute_granularity") or "full"
            return ("try actor.megatron.recompute_granularity=selective actor.megatron.recompute_modules=[core_attn]: "
                    "only the attention core re-run" if granularity == "full" else
                    f"none: recompute is {granularity} already (actor.megatron.recompute_granularity)")
        return ("try actor.gradient_checkpointing=false: no recompute, every layer's activations held (a memory "
                "trial shows whether they fit)")
    if key == "exposed communication":
        ddp = _get(cfg, "actor.megatron.ddp") or {}
        if megatron and not (ddp.get("overlap_grad_reduce") and ddp.get("overlap_param_gather")):
            return ("try actor.megatron.ddp.overlap_grad_reduce=true actor.megatron.ddp.overlap_param_gather=true: "
                    "the gradient reduction and parameter gathers overlapped with compute")
        return ("none: the data-parallel overlap is on; of the exposed time, the finding's wait for the last rank "
                "is imbalance (see the ranks table) and the rest transfer")
    if key == "gpu idle":
        return "none: the host was held elsewhere than launching expert GEMMs; the Host section names the places"
    if key == "exposed imbalance":
        return "none: the ranks do different work; the ranks table's work spread names where"
    if key == "memory parameters":
        return f"none on this layout: the weights of the rank; {_LAYOUT}"
    if key in ("memory workspaces", "memory before_window"):
        if key == "memory workspaces":
            return "none: the libraries' workspaces (cuBLAS, Transformer Engine) are theirs to size"
        return (f"try MEMORY_MAX_ENTRIES above {_get(cfg, 'memory_profiler.max_entries')}: these blocks were "
                "allocated before the recorded window, so what they are is unknown")
    if key in ("memory activations", "memory optimizer", "memory gradients", "memory allocator_slack", "transient"):
        return "none: no what-if applies to this trial; the What if section says which were not proposed and why"
    if key == "memory window peak":
        return ("none: the higher peak is outside the profiled step, whose figures these are; profile the step it "
                "falls in (PROFILE_STEPS)")
    return None
