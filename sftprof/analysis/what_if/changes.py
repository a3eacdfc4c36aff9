"""What-ifs of a trial: changes worth trying, each a record (:class:`sftprof.analysis.what_if.schema.WhatIf`) with the settings
to apply, the predicted effect on one measured figure of one rank, the assumption behind the prediction and a weight
(the effect's share of its baseline) that orders them; the driver tries the heaviest (``TRY_WHAT_IFS``) and
:mod:`sftprof.analysis.what_if.outcome` sets each prediction against the outcome.

The levers, what calls for each and the first-order prediction (:data:`LABELS`; metrics and units in
:data:`METRICS`):

- ``selective_recompute`` (kernel trial, megatron, GPU time by model part): full recompute ran; recompute only the
  attention core (``recompute_granularity=selective``, ``recompute_modules=[core_attn]``): GPU time per step less the
  measured recompute GPU time minus the attention core's.
- ``fewer_micro_batches`` (kernel trial): the step pays a cost per micro-batch whatever its size: on a GPU the idle
  of launch-bound places (kernels shorter than their launch gaps, :mod:`sftprof.analysis.time.host_time`), on CPU the
  FSDP2 collectives (each micro-batch's forward and backward gathers every layer, its backward reduces the
  gradients; gloo, not overlapped). Fewer micro-batches
  (``actor.mb_spec.n_mbs``, and ``max_tokens_per_mb`` where it would force more) saves that cost per micro-batch
  dropped: step time ``- cost x (1 - n_new / n_old)``.
- ``balanced_routing`` (kernel trial, megatron): the routing collapsed (one expert gets at least
  :data:`sftprof.analysis.trial.inputs.ROUTING_COLLAPSE_SHARE` of a layer's tokens, ``stats.jsonl``'s ``moe_load``);
  ``moe_router_force_load_balancing=true``: the busiest expert's share falls to ``top_k / E``.
- ``cutlass_grouped_gemm`` (kernel trial, megatron, Transformer Engine in the trial): the routed expert GEMMs are
  launch-bound (TE's ``GroupedLinear`` launches one cuBLAS GEMM per local expert); ``NVTE_USE_CUTLASS_GROUPED_GEMM=1``
  runs them as one CUTLASS grouped kernel: step time less the launch-bound GPU idle of the expert GEMMs (on 1x H200,
  Qwen3.5 slice, predicted -428.9 ms, measured -463.0 ms: ``bench/NOTES.md``).
- ``expandable_segments`` (memory trial): allocator slack at the peak; ``PYTORCH_CUDA_ALLOC_CONF`` (or
  ``PYTORCH_ALLOC_CONF``, the one the trial's allocator read: :func:`sftprof.analysis.memory.fit.alloc_conf_of`)
  with ``expandable_segments:True``: peak reserved less that slack.
- ``chunked_lm_head`` (memory trial): a logits-bound peak (the logits of the theoretical estimate,
  :mod:`sftprof.analysis.memory.estimate`, which follows ``actor.loss``, and an activation block at least their
  size alive at the peak); ``actor.loss.lm_head_loss_chunk_size`` = :data:`LM_HEAD_CHUNK`: the peak less the
  logits, one chunk kept, or the step's highest point without the logits block when that is higher (the
  snapshot's ``without_largest_block``; on 1x H200 with TE it foretold the 2048-chunk trials' 75.27 GiB, and
  70.77 GiB with the fused SwiGLU). On a CPU kernel trial whose LM head + loss holds CPU op time (the finding whose
  next step is ``LM_HEAD_LOSS_CHUNK_SIZE``): never proposed, ``skipped`` with why (``_chunked_lm_head_cpu``): CPU op
  time gives no predicted effect for it, so the driver does not try it; a second run and ``compare`` measure it.
- ``precision_aware_optimizer`` (memory trial, megatron, Transformer Engine in the trial): an optimizer-step peak
  (the peak in ``sftprof/optimizer_step``, or the optimizer state the largest category at it);
  ``use_precision_aware_optimizer=true``, ``main_grads_dtype=bfloat16`` (``USE_PRECISION_AWARE_OPTIMIZER=true
  MAIN_GRADS_DTYPE=bfloat16``): the peak less the estimate's difference in gradients and optimizer state.
- ``more_micro_batches`` (memory trial): an activation-bound peak (activations the largest category at it); twice
  the micro-batches (the next count that divides the sequences of a data-parallel rank): the peak less
  ``activations x (1 - n_old / n_new)``.
- ``distributed_optimizer`` (memory trial, megatron, off): the optimizer state divided over the data-parallel
  ranks of each parameter.

Rules for every lever: it is never proposed for a setting the trial already has (every setting at the trial's
value: a ``skipped`` entry says so), nor where the trial cannot take it (the fsdp backend for megatron-core's
options, no Transformer Engine for the precision-aware optimizer or TE's CUTLASS grouped GEMM, a GPU other than
Hopper or an fp32 model for the latter: ``skipped`` says why), nor when the predicted effect is under
:data:`MIN_SHARE` of its baseline (too small for a comparison of a few steps to see) or has no baseline.

The fit gate (issue 47): a what-if of a time metric (:data:`TIME_METRICS`) that changes the config of a megatron trial
is proposed only when its settings are predicted to fit the GPU (:func:`sftprof.analysis.memory.fit.check_fit` of the
trial's config with them, at the trial's allocator settings, :func:`sftprof.analysis.memory.fit.alloc_conf_of`,
against :func:`sftprof.analysis.memory.fit.smi_capacity_bytes` of the summary's nvidia-smi GPUs); one that is not is
``skipped`` with its predicted need and the capacity. Without a capacity (no nvidia-smi GPU: a CPU run) or the model's
config, or on the fsdp backend, nothing is checked; a what-if of environment settings alone leaves the config, and so
the predicted peak, as the trial ran it.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional, Sequence, cast

from sftprof import artifacts
from sftprof.allocation import Layout, parse_allocation_mode
from sftprof.analysis.trial.inputs import ROUTING_COLLAPSE_SHARE, TrialModel
from sftprof.analysis.memory.categories import site_category
from sftprof.analysis.memory.estimate import estimate_memory
from sftprof.analysis.memory.fit import (DRIVER_RESERVED_GIB, LM_HEAD_CHUNK, alloc_conf_of, check_fit, fit_text,
                                         smi_capacity_bytes, with_expandable, with_settings)
from sftprof.analysis.schema import processed_snapshots, processed_traces
from sftprof.analysis.trial.schema import TrialRecord
from sftprof.analysis.what_if.schema import WhatIf, WhatIfEffect, WhatIfSetting, WhatIfSkipped
from sftprof.config import n_micro_batches

__all__ = ["trial_what_if", "METRICS", "TIME_METRICS", "LABELS", "MIN_SHARE", "LM_HEAD_CHUNK", "setting_text",
           "amount", "effect_text", "CPU_LM_HEAD_CHUNK"]

# metric -> (unit, words)
METRICS = {
    "gpu_time": ("ms", "GPU time per step"),
    "step_time": ("ms", "step time"),
    "peak_allocated": ("GiB", "peak allocated"),
    "peak_reserved": ("GiB", "peak reserved"),
    "moe_top_share": ("pct", "busiest expert's share of a MoE layer's tokens"),
}
TIME_METRICS = ("gpu_time", "step_time")  # the metrics of the what-ifs the fit gate checks (module docstring)
LABELS = {
    "selective_recompute": "selective recompute",
    "fewer_micro_batches": "fewer micro-batches",
    "balanced_routing": "balanced routing",
    "cutlass_grouped_gemm": "TE's CUTLASS grouped GEMM",
    "expandable_segments": "expandable segments",
    "chunked_lm_head": "chunked LM head",
    "precision_aware_optimizer": "precision-aware optimizer",
    "more_micro_batches": "more micro-batches",
    "distributed_optimizer": "distributed optimizer",
    "fit_oom": "fit the GPU after an out-of-memory error",  # a failed trial's (sftprof.analysis.memory.oom.oom_what_if)
    "recompute_plan": "recompute planner",  # a kernel trial's (sftprof.analysis.what_if.recompute_plan.recompute_what_if)
}
MIN_SHARE = 0.01  # a predicted effect below 1 % of its baseline is not proposed
# tokens a chunk of the chunked LM-head loss on CPU: the value the README's "Proving a change" measures on the tiny
# CPU preset (a CPU run's next step, no what-if: _chunked_lm_head_cpu)
CPU_LM_HEAD_CHUNK = 256
CUTLASS_GROUPED_GEMM = "NVTE_USE_CUTLASS_GROUPED_GEMM"
HOPPER = ("H100", "H200", "H800", "H20")  # GPU names (the trace's device) of sm90, where that path runs
_GIB = float(2**30)
_MOE_PARTS = ("router", "dispatch_combine", "experts", "shared_experts")


def _get(tree: Any, key: str) -> Any:
    """The value of dotted ``key`` in a nested dict (None when absent)."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    return str(value)


def setting_text(s: WhatIfSetting) -> str:
    """``key=value`` of a setting (lists as ``[a,b]``, booleans in lower case: a config setting's text is the trainer's
    argument); an environment variable's is marked ``(environment)``."""
    return f"{s['key']}={_value_text(s['value'])}" + (" (environment)" if s["kind"] == "env" else "")


def amount(value: Optional[float], unit: str) -> str:
    """``-145.1 ms``, ``-37.10 GiB``, ``-72.0 percentage points``: a change in its unit (``–`` for None)."""
    if value is None:
        return "–"
    return f"{value:+.1f} percentage points" if unit == "pct" else f"{value:+.{1 if unit == 'ms' else 2}f} {unit}"


def effect_text(effect: Mapping[str, Any], rank: Optional[int]) -> str:
    """``"GPU time per step -145.1 ms on rank 0"``: a predicted effect in words."""
    unit, words = METRICS[effect["metric"]]
    return f"{words} {amount(effect['value'], unit)}" + (f" on rank {rank}" if rank is not None else "")


class _Trial:
    """What the rules read of a trial: its config (``cfg``), layout, sequences per data-parallel rank, Transformer
    Engine, the routing of its profiled step; the proposals and skips they make."""

    def __init__(self, summary: Mapping[str, Any], cfg: Optional[dict[str, Any]], model: TrialModel) -> None:
        self.summary, self.model = summary, model
        self.cfg: dict[str, Any] = cfg or {}
        self.actor: dict[str, Any] = self.cfg.get("actor") or {}
        self.m: dict[str, Any] = self.actor.get("megatron") or {}
        self.layout: Optional[Layout]
        try:
            self.layout = parse_allocation_mode(str(self.actor.get("backend")))
        except ValueError:
            self.layout = None
        self.megatron = self.layout is not None and self.layout.backend == "megatron"
        self.found: list[WhatIf] = []
        self.skipped: list[WhatIfSkipped] = []

    def hf(self) -> Any:
        """The model's Hugging Face config (None when it cannot be loaded)."""
        try:
            return self.model.config()
        except Exception:  # a model path not readable here: the rules that need it are left out
            return None

    def te_absence(self) -> Optional[str]:
        """None when Transformer Engine ran in the trial, else why a TE-only lever cannot be proposed, in words."""
        te = self.summary.get("transformer_engine")
        if te:
            return None
        return ("Transformer Engine was not in the trial" if te is False else
                "whether Transformer Engine ran is unknown (actor.megatron.transformer_impl=auto and no "
                "'transformer_engine=' line in trainer.log)")

    def setting(self, key: str, value: Any) -> WhatIfSetting:
        return {"kind": "config", "key": key, "value": value, "current": _get(self.cfg, key)}

    def skip(self, key: str, rank: Optional[int], reason: str) -> None:
        if not any(s["key"] == key for s in self.skipped):  # one line per lever (the first rank's)
            self.skipped.append({"key": key, "label": LABELS[key], "rank": rank, "reason": reason})

    def already_set(self, key: str, rank: Optional[int], settings: list[WhatIfSetting]) -> bool:
        """True (and a skip) when the trial has every setting of the what-if already."""
        if all(s["value"] == s["current"] for s in settings):
            self.skip(key, rank, "the trial already has " + ", ".join(setting_text(s) for s in settings))
            return True
        return False

    def propose(self, key: str, rank: Optional[int], settings: list[WhatIfSetting], metric: str, value: float,
                baseline: Optional[float], detail: str, assumption: str, weight: Optional[float] = None) -> None:
        """Add the what-if, unless its effect is under :data:`MIN_SHARE` of its baseline or it has no baseline (then
        a skip)."""
        effect: WhatIfEffect = {"metric": metric, "unit": METRICS[metric][0], "value": round(value, 4),
                                "baseline": None if baseline is None else round(baseline, 4)}
        if weight is None:
            if not baseline:
                self.skip(key, rank, f"predicted {effect_text(effect, rank)}, but the trial has no measured "
                                     f"{METRICS[metric][1]} to weigh it against")
                return
            weight = abs(value) / baseline
        if weight < MIN_SHARE:
            self.skip(key, rank, f"predicted {effect_text(effect, rank)}, under {100 * MIN_SHARE:.0f} % of its "
                                 f"baseline ({baseline} {effect['unit']}): too small for a comparison to see")
            return
        misfit = self.misfit(settings) if metric in TIME_METRICS else None
        if misfit:
            self.skip(key, rank, f"predicted {effect_text(effect, rank)}, but {misfit}")
            return
        text = (f"{LABELS[key]} ({', '.join(setting_text(s) for s in settings)}): {effect_text(effect, rank)} "
                f"({detail})")
        self.found.append({"key": key, "label": LABELS[key], "text": text, "assumption": assumption, "rank": rank,
                           "settings": settings, "effect": effect, "weight": round(weight, 6)})

    def misfit(self, settings: list[WhatIfSetting]) -> Optional[str]:
        """Why the config ``settings`` are predicted not to fit the GPU, in words (the fit gate, module docstring);
        None when they fit or nothing is checked (no config setting, capacity or model config; not megatron)."""
        changes = {s["key"]: s["value"] for s in settings if s["kind"] == "config"}
        seq_len = _get(self.cfg, "profile.fake_seq_len")
        capacity = smi_capacity_bytes((self.summary.get("nvidia_smi") or {}).get("gpus") or [])
        if not changes or self.layout is None or not self.megatron or capacity is None or not isinstance(seq_len, int):
            return None
        hf = self.hf()
        if hf is None:
            return None
        fit = check_fit(with_settings(self.cfg, changes), hf, self.layout, seq_len, capacity,
                        alloc_conf_of(self.summary.get("environment"))[1], self.summary.get("versions"))
        if fit["fits"]:
            return None
        return "its settings are predicted not to fit the GPU: " + fit_text(
            fit, source=f"nvidia-smi's total less {DRIVER_RESERVED_GIB} GiB")

    def seqs_per_rank(self) -> Optional[int]:
        """Sequences per data-parallel rank and step (``train_dataset.batch_size / dp``)."""
        bs = _get(self.cfg, "train_dataset.batch_size")
        return bs // self.layout.dp if isinstance(bs, int) and self.layout is not None else None

    def micro_batches(self, n_mbs: int, max_tokens: Optional[int] = None) -> Optional[int]:
        """The trainer's micro-batch count with ``n_mbs`` (and ``max_tokens``; None: the trial's), None if refused."""
        spec = self.actor.get("mb_spec") or {}
        n_seqs = self.seqs_per_rank()
        if n_seqs is None:
            return None
        try:
            return n_micro_batches(n_seqs, _get(self.cfg, "profile.fake_seq_len"), n_mbs,
                                   spec.get("n_mbs_divisor", 1),
                                   spec.get("max_tokens_per_mb", 0) if max_tokens is None else max_tokens)
        except (ValueError, TypeError):
            return None


def trial_what_if(summary: Mapping[str, Any], cfg: Optional[dict[str, Any]],
                  model: TrialModel) -> tuple[list[WhatIf], list[WhatIfSkipped]]:
    """The what-ifs of every profiled rank's trace and snapshot (rank order; the routing's once), and the levers not
    proposed with the reason (module docstring). ``cfg``: the trial's resolved config, ``model`` its model; ``summary``
    needs its traces or snapshots, ``stats`` and ``transformer_engine``."""
    t = _Trial(summary, cfg, model)
    traces = processed_traces(cast(TrialRecord, summary))
    for tr in traces:
        _selective_recompute(t, tr["rank"], tr["summary"])
        _fewer_micro_batches(t, tr["rank"], tr["summary"])
        _cutlass_grouped_gemm(t, tr["rank"], tr["summary"])
        _chunked_lm_head_cpu(t, tr["rank"], tr["summary"])
    if traces:
        _balanced_routing(t, traces)
    for m in processed_snapshots(cast(TrialRecord, summary)):
        if m["rank"] is None:
            continue
        s, est = m["summary"], m.get("estimate")
        _expandable_segments(t, m["rank"], s, m.get("allocator"))
        _chunked_lm_head(t, m["rank"], s, est)
        _precision_aware_optimizer(t, m["rank"], s, est)
        _more_micro_batches(t, m["rank"], s)
        _distributed_optimizer(t, m["rank"], s, est)
    return t.found, t.skipped


# -- kernel trials ------------------------------------------------------------------------------------------------
# megatron-core recompute module -> the model parts (sftprof.capture.module_regions) whose forward it re-runs
# ("kernel:attention": the attention kernels of a trace without module ranges)
RECOMPUTE_MODULE_PARTS = {"core_attn": ("attn_core", "kernel:attention"), "layernorm": ("norm",),
                          "moe": ("router", "dispatch_combine", "experts"), "shared_experts": ("shared_experts",)}


def recompute_ms(parts: Mapping[str, Any], modules: Optional[list[str]] = None) -> float:
    """A kernel trace's measured recompute GPU time per step, ms (its ``parts["summed"]`` rows): all of it, or what
    the megatron-core recompute ``modules`` (:data:`RECOMPUTE_MODULE_PARTS`' keys) re-run."""
    names = None if modules is None else {p for m in modules for p in RECOMPUTE_MODULE_PARTS[m]}
    return float(sum(r["recompute_ms"] for r in parts.get("summed") or [] if names is None or r["part"] in names))


def _selective_recompute(t: _Trial, rank: int, s: Mapping[str, Any]) -> None:
    parts = s.get("parts") or {}
    rec = recompute_ms(parts)
    if not rec or not t.megatron:  # fsdp: HF gradient checkpointing has no selective form here
        return
    settings = [t.setting("actor.megatron.recompute_granularity", "selective"),
                t.setting("actor.megatron.recompute_modules", ["core_attn"])]
    if t.already_set("selective_recompute", rank, settings) or t.m.get("recompute_granularity") != "full":
        return
    core = recompute_ms(parts, ["core_attn"])
    t.propose("selective_recompute", rank, settings, "gpu_time", -(rec - core), parts.get("total_ms"),
              f"measured recompute {rec:.1f} ms minus the attention core's {core:.1f} ms",
              "the recomputed work is removed one for one; the activation memory that full recompute avoids comes "
              "back (see the memory trial)")


def _fewer_micro_batches(t: _Trial, rank: int, s: Mapping[str, Any]) -> None:
    n_old = sum(1 for r in s.get("regions") or [] if (artifacts.parse_region(r["name"]) or ("",))[0] == "forward")
    n_seqs = t.seqs_per_rank()
    if n_old < 2 or not n_seqs:
        return
    gpu = (s.get("gpu") or {}).get("activities", 0) > 0
    if gpu:
        rows = (((s.get("host") or {}).get("gpu_idle") or {}).get("host_wait_by_place") or {}).get("rows") or []
        cost = sum(r["idle_ms"] for r in rows if r["kind"] == "launch-bound" and r["phase"] != "optimizer")
        what = f"launch-bound GPU idle {cost:.1f} ms in the micro-batches' forward and backward"
        why = ("the GPU idles between the launches of short kernels (launch-bound) as often per micro-batch whatever "
               "its size, so that idle scales with the number of micro-batches")
    elif str(t.actor.get("backend", "")).startswith("fsdp"):
        ops = ((s.get("communication") or {}).get("host_ops") or {}).get("by_op_ms") or {}
        cost = sum(v for k, v in ops.items() if "all_gather" in k or "all_reduce" in k or "reduce_scatter" in k)
        what = f"host collectives {cost:.1f} ms in {n_old} micro-batches and the optimizer step"
        why = ("FSDP2 gathers every layer's parameters in each micro-batch's forward and backward and reduces its "
               "gradients in each backward, the same bytes whatever the micro-batch's size, and on CPU (gloo) these "
               "collectives are not hidden behind compute (the optimizer step's gradient-norm all-reduce, once a "
               "step, is counted in: an overestimate by that)")
    else:
        return
    n_new = next(n for n in range(n_old - 1, 0, -1) if n_seqs % n == 0)  # 1 divides every count
    spec = t.actor.get("mb_spec") or {}
    settings = [t.setting("actor.mb_spec.n_mbs", n_new)] if spec.get("n_mbs", 1) != n_new else []
    max_tokens, seq_len = spec.get("max_tokens_per_mb") or 0, _get(t.cfg, "profile.fake_seq_len")
    if max_tokens and isinstance(seq_len, int) and max_tokens < n_seqs // n_new * seq_len:
        max_tokens = n_seqs // n_new * seq_len  # the trial's token cap would keep the micro-batches as they are
        settings.append(t.setting("actor.mb_spec.max_tokens_per_mb", max_tokens))
    if t.micro_batches(n_new, max_tokens) != n_new:
        t.skip("fewer_micro_batches", rank, f"{n_old} micro-batches of {n_seqs} sequences per data-parallel rank: "
                                            f"{n_new} is not a count the trainer takes (actor.mb_spec.n_mbs_divisor)")
        return
    t.propose("fewer_micro_batches", rank, settings, "step_time", -cost * (1 - n_new / n_old),
              (s.get("step_window") or {}).get("wall_ms"), f"{n_old} -> {n_new} micro-batches; {what}",
              why + f"; the work per token is the same; the activations of one micro-batch grow {n_old / n_new:g}x "
                    "(see the memory trial)")


def _cutlass_grouped_gemm(t: _Trial, rank: int, s: Mapping[str, Any]) -> None:
    rows = (((s.get("host") or {}).get("gpu_idle") or {}).get("host_wait_by_place") or {}).get("rows") or []
    rows = [r for r in rows if r["part"] == "experts" and r["kind"] == "launch-bound"]
    if not rows or not t.megatron:
        return
    cost = sum(r["idle_ms"] for r in rows)
    device = ((s.get("efficiency") or {}).get("peak") or {}).get("device")  # None: not known, not ruled out
    dtype = t.actor.get("dtype")
    why_not = t.te_absence()
    if why_not:
        why_not += ": the setting is TE's GroupedLinear's"
    elif device and not any(h in device for h in HOPPER):
        why_not = f"the GPU is {device}: TE's CUTLASS grouped GEMM is Hopper's (sm90)"
    elif dtype not in (None, "bfloat16", "float16"):
        why_not = f"actor.dtype={dtype}: TE's CUTLASS grouped GEMM takes bf16 or fp16"
    if why_not:
        t.skip("cutlass_grouped_gemm", rank, f"launch-bound expert GEMMs ({cost:.1f} ms of GPU idle), but {why_not}")
        return
    env = t.summary.get("environment")
    settings: list[WhatIfSetting] = [{"kind": "env", "key": CUTLASS_GROUPED_GEMM, "value": "1",
                                      "current": None if env is None else env.get(CUTLASS_GROUPED_GEMM)}]
    if t.already_set("cutlass_grouped_gemm", rank, settings):
        return
    places = ", ".join(f"{r['phase']} {r['idle_ms']:.1f} ms" for r in rows)
    t.propose("cutlass_grouped_gemm", rank, settings, "step_time", -cost, (s.get("step_window") or {}).get("wall_ms"),
              f"launch-bound GPU idle of the routed expert GEMMs, over the places the summary lists: {places}",
              "one kernel for all local experts' GEMMs takes the launches off the host, so that GPU idle goes and "
              "the GEMMs' GPU time stays; less where TE falls back to a cuBLAS GEMM per expert "
              "(NVTE_CUTLASS_GROUPED_GEMM_WARN_FALLBACK=1 logs each fallback)")


def _chunked_lm_head_cpu(t: _Trial, rank: int, s: Mapping[str, Any]) -> None:
    """A CPU run's LM head + loss (CPU op time by model part, no GPU activity), the full logits on: a skip naming
    why the chunked LM head is no what-if here (module docstring); the finding's next step names the setting."""
    rows = ((s.get("cpu_parts") or {}).get("summed")) or []
    row = next((r for r in rows if r["part"] == "lm_head_loss"), None)
    if ((s.get("gpu") or {}).get("activities", 0) or row is None or row["share_pct"] < 100 * MIN_SHARE
            or _get(t.cfg, "actor.loss.lm_head_loss_chunk_size")):
        return
    t.skip("chunked_lm_head", rank, "a CPU run: its CPU op time gives no predicted effect for the chunked LM head (its "
                                    "what-if predicts a GPU memory trial's peak without the logits), so TRY_WHAT_IFS "
                                    "does not try it: compare a run with "
                                    f"LM_HEAD_LOSS_CHUNK_SIZE={CPU_LM_HEAD_CHUNK} against this one (README, Proving a "
                                    "change)")


def _balanced_routing(t: _Trial, traces: Sequence[Mapping[str, Any]]) -> None:
    stats = t.summary.get("stats") or {}
    rows = [x for x in stats.get("steps") or [] if x.get("moe")]
    row = next((x for x in rows if x["step"] == t.summary.get("profile_step")), rows[-1] if rows else None)
    moe = (row or {}).get("moe") or {}
    if row is None or moe.get("top_share") is None or moe["top_share"] < ROUTING_COLLAPSE_SHARE:
        return
    if not t.megatron:
        t.skip("balanced_routing", None, "the routing collapsed, but balanced routing is megatron-core's option "
                                         "(actor.megatron.moe_router_force_load_balancing); the fsdp backend has none")
        return
    settings = [t.setting("actor.megatron.moe_router_force_load_balancing", True)]
    hf = t.hf()
    if t.already_set("balanced_routing", None, settings) or hf is None:
        return
    k, e = hf.num_experts_per_tok, getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    shares = []
    for tr in traces:  # the MoE parts' share of the rank's time: what balanced routing acts on
        parts = tr["summary"].get("parts") or {}
        if parts.get("total_ms"):
            moe_ms = sum(r["total_ms"] for r in parts.get("summed") or [] if r["part"] in _MOE_PARTS)
            shares.append((moe_ms / parts["total_ms"], tr["rank"]))
    share, rank = max(shares) if shares else (0.0, None)
    t.propose("balanced_routing", None, settings, "moe_top_share", 100 * (k / e - moe["top_share"]),
              100 * moe["top_share"], f"top-{k} of {e} experts, step {row['step']}, layer {moe['top_share_layer']}; "
              f"the MoE parts hold {100 * share:.1f} % of the time on rank {rank}",
              "megatron-core replaces each router's logits by random normal values, so each expert receives about "
              "top_k / E of the tokens; the expert GEMM, dispatch and EP-wait times then are those of balanced "
              "routing (not predicted here: compare shows them)", weight=share)


# -- memory trials ------------------------------------------------------------------------------------------------
def _largest(s: Mapping[str, Any]) -> Optional[str]:
    """The largest category at the peak among those a stack names (not allocated before the window, not slack)."""
    cats = [c for c in s.get("categories_at_peak") or [] if c["category"] not in ("before_window", "allocator_slack")]
    return max(cats, key=lambda c: c["bytes"])["category"] if cats and max(c["bytes"] for c in cats) > 0 else None


def _expandable_segments(t: _Trial, rank: int, s: Mapping[str, Any], allocator: Optional[Mapping[str, Any]]) -> None:
    slack = s.get("reserved_minus_allocated_at_peak_bytes") or 0
    if slack <= 0:
        return
    conf = (allocator or {}).get("alloc_conf")
    value = with_expandable(conf)
    current = value if (allocator or {}).get("expandable_segments") else conf
    # the variable the trial's allocator read (a what-if trial setting the other would be overridden by it)
    key = alloc_conf_of(t.summary.get("environment"))[0]
    settings: list[WhatIfSetting] = [{"kind": "env", "key": key, "value": value, "current": current}]
    if t.already_set("expandable_segments", rank, settings):
        return
    t.propose("expandable_segments", rank, settings, "peak_reserved", -slack / _GIB, s.get("peak_reserved_gib"),
              f"the slack at the peak, {slack / _GIB:.2f} GiB reserved and not allocated",
              "the slack is fragmentation of the caching allocator, which expandable segments avoid; reserved-but-"
              "cached blocks of other sizes are not separated")


def _chunked_lm_head(t: _Trial, rank: int, s: Mapping[str, Any], est: Optional[Mapping[str, Any]]) -> None:
    rows = {r["category"]: r for r in (est or {}).get("rows") or []}
    logits = (rows.get("activations") or {}).get("logits_bytes") or 0  # 0 on the chunked LM-head path
    if not logits or not any(a["bytes"] >= logits and site_category(a["site"]) == "activations"
                             for a in s.get("top_allocations") or []):
        return  # no logits in the trial, or no activation block of their size alive at the peak: not logits-bound
    settings = [t.setting("actor.loss.lm_head_loss_chunk_size", LM_HEAD_CHUNK)]
    if (_get(t.cfg, "actor.loss.path") or "auto") != "auto":
        settings.insert(0, t.setting("actor.loss.path", "lm_head"))
    if t.already_set("chunked_lm_head", rank, settings):
        return
    chunk = logits * min(1.0, LM_HEAD_CHUNK / (_tokens_on_rank(t) or LM_HEAD_CHUNK))  # the logits of one chunk
    peak = s["peak_allocated_bytes"]
    new_peak, why = peak - logits + chunk, f"one chunk of {LM_HEAD_CHUNK} tokens ({chunk / _GIB:.2f} GiB) kept"
    wo = s.get("without_largest_block")
    if wo and wo["block_bytes"] >= logits and wo["peak_allocated_bytes"] > new_peak:
        # the step's next-highest point, without the logits block, becomes the peak
        new_peak = wo["peak_allocated_bytes"]
        why = (f"without that block the step's highest point is {wo['peak_allocated_gib']:.2f} GiB"
               + (f" in {wo['peak_phase']}" if wo.get("peak_phase") else ""))
    t.propose("chunked_lm_head", rank, settings, "peak_allocated", -(peak - new_peak) / _GIB,
              s.get("peak_allocated_gib"),
              f"{logits / _GIB:.2f} GiB of logits alive at the peak, {why}",
              "the peak holds the logits (s x V/tp in the model dtype, as in sftprof/analysis/memory/estimate.py), "
              "the chunked LM head allocates no block of their size, and the rest of the step allocates as "
              "recorded (the allocator history gives its highest point without the logits block)")


def _tokens_on_rank(t: _Trial) -> Optional[int]:
    seq = _get(t.cfg, "profile.fake_seq_len")
    if not isinstance(seq, int) or t.layout is None:
        return None
    return seq // (t.layout.cp if t.megatron else 1)


def _precision_aware_optimizer(t: _Trial, rank: int, s: Mapping[str, Any], est: Optional[Mapping[str, Any]]) -> None:
    if not t.megatron or t.layout is None or not est or not (s.get("peak_phase") == artifacts.OPTIMIZER_STEP
                                         or _largest(s) == "optimizer"):
        return
    settings = [t.setting("actor.megatron.use_precision_aware_optimizer", True),
                t.setting("actor.megatron.main_grads_dtype", "bfloat16")]
    if t.already_set("precision_aware_optimizer", rank, settings):
        return
    absent = t.te_absence()
    if absent:
        t.skip("precision_aware_optimizer", rank, f"an optimizer-step peak, but {absent}: megatron-core's "
               "precision-aware optimizer needs TE's FusedAdam (USE_PRECISION_AWARE_OPTIMIZER=true with TE installed)")
        return
    hf = t.hf()
    if hf is None:
        return
    cfg2 = copy.deepcopy(t.cfg)
    m2 = cfg2["actor"].setdefault("megatron", {})
    m2.update(use_precision_aware_optimizer=True, main_grads_dtype="bfloat16", main_params_dtype="float32",
              exp_avg_dtype="float32", exp_avg_sq_dtype="float32")
    coords = t.layout.rank_coords(rank)
    seq = _get(t.cfg, "profile.fake_seq_len")
    before = {r["category"]: r for r in est["rows"]}
    after = {r["category"]: r for r in estimate_memory(cfg2, hf, t.layout, coords, seq)["rows"]}
    in_step = s.get("peak_phase") == artifacts.OPTIMIZER_STEP
    delta = sum(after[c]["bytes"] - before[c]["bytes"] for c in ("gradients", "optimizer"))
    if not in_step:  # the fp32 gradient copy lives only in the optimizer step
        delta += before["optimizer"].get("step_copy_bytes", 0)
    held = [sum(x[c]["bytes"] for c in ("gradients", "optimizer")) / _GIB for x in (before, after)]
    t.propose("precision_aware_optimizer", rank, settings, "peak_allocated", delta / _GIB, s.get("peak_allocated_gib"),
              f"estimated gradients + optimizer state {held[0]:.2f} -> {held[1]:.2f} GiB"
              + ("" if in_step else ", the fp32 gradient copy of the optimizer step not at this peak"),
              "the gradients and optimizer state alive at the peak follow sftprof/analysis/memory/estimate.py: TE's "
              "FusedAdam keeps the fp32 main params as 16-bit remainders beside fp32 moments and bf16 main grads, "
              "and makes no fp32 gradient copy; the activations at the peak are unchanged")


def _more_micro_batches(t: _Trial, rank: int, s: Mapping[str, Any]) -> None:
    if _largest(s) != "activations":
        return
    spec = t.actor.get("mb_spec") or {}
    n_seqs, n_old = t.seqs_per_rank(), t.micro_batches(spec.get("n_mbs", 1))
    if not n_seqs or not n_old:
        return
    n_new = next((n for n in range(n_old + 1, n_seqs + 1) if n_seqs % n == 0 and t.micro_batches(n) == n), None)
    if n_new is None:
        t.skip("more_micro_batches", rank, f"an activation-bound peak, but each of the {n_old} micro-batches holds "
                                           f"{n_seqs // n_old} sequence(s) of the {n_seqs} per data-parallel rank and "
                                           "a sequence is not split (raise TRAIN_BATCH_SIZE, or CP)")
        return
    settings = [t.setting("actor.mb_spec.n_mbs", n_new)]
    if t.already_set("more_micro_batches", rank, settings):
        return
    act = next(c["bytes"] for c in s["categories_at_peak"] if c["category"] == "activations")
    t.propose("more_micro_batches", rank, settings, "peak_allocated", -act * (1 - n_old / n_new) / _GIB,
              s.get("peak_allocated_gib"), f"{n_old} -> {n_new} micro-batches; activations {act / _GIB:.2f} GiB at "
                                           "the peak",
              "the activations alive at the peak are those of one micro-batch, proportional to its tokens; the step "
              "takes longer by the per-micro-batch costs (launches, FSDP gathers)")


def _distributed_optimizer(t: _Trial, rank: int, s: Mapping[str, Any], est: Optional[Mapping[str, Any]]) -> None:
    rows = {r["category"]: r for r in (est or {}).get("rows") or []}
    ddp = t.m.get("ddp") or {}
    if (not t.megatron or t.layout is None or est is None or "optimizer" not in rows
            or ddp.get("use_distributed_optimizer", True)):
        return
    lay = t.layout
    full = rows["optimizer"]["bytes"]
    dense, expert = est["params_dense"], est["params_expert"]
    sharded = full * (dense / (lay.dp * lay.cp) + expert / lay.edp) / max(dense + expert, 1)
    t.propose("distributed_optimizer", rank, [t.setting("actor.megatron.ddp.use_distributed_optimizer", True)],
              "peak_allocated", -(full - sharded) / _GIB, s.get("peak_allocated_gib"),
              f"optimizer state {full / _GIB:.1f} -> {sharded / _GIB:.1f} GiB at DP x CP = {lay.dp * lay.cp}, expert "
              f"DP = {lay.edp}",
              "megatron-core's distributed optimizer shards main params, moments (and the fp32 gradient copy) over the "
              "data-parallel ranks of each parameter; gradient buffers stay whole; the optimizer state is at the peak")
