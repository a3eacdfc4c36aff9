"""The activation ledger and the recompute planner (issue 46, item 3): what each layer saves for backward, and the
recompute setting that fits a GPU at the least recompute time.

- :func:`ledger`: per layer and megatron-core recompute module, the bytes a rank saves for backward at the profiled
  tokens (:func:`sftprof.analysis.memory.estimate.layer_sets`: predicted, not measured; the measured peaks it was
  calibrated on are in bench/NOTES.md, "The fit check").
- :func:`plan_recompute`: every setting of megatron-core's recompute (``none``; ``selective`` with each non-empty set
  of :data:`sftprof.analysis.what_if.changes.RECOMPUTE_MODULE_PARTS`' modules; ``full`` ``uniform`` 1; ``full`` ``block`` 1
  to L - 1 layers), each with its predicted peak and need (:func:`sftprof.analysis.memory.fit.check_fit`) and its
  recompute time: the forward GPU time of what it re-runs, from a kernel trial's time by model part and layer
  (``forward_ms``). The choice is the setting that fits with the least recompute time (ties: the lower peak).
- :func:`recompute_what_if`: the choice as a ``recompute_plan`` what-if of a kernel trial (GPU time per step: the
  choice's recompute time less the measured one), when it is not the trial's setting and changes the step by 1 % or
  more. The GPU's capacity is nvidia-smi's total less :data:`DRIVER_RESERVED_GIB`.
"""
from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional, cast

from sftprof.allocation import Layout, parse_allocation_mode
from sftprof.analysis.memory.estimate import layer_sets
from sftprof.analysis.memory.fit import DRIVER_RESERVED_GIB, check_fit, smi_capacity_bytes, with_settings
from sftprof.analysis.schema import processed_traces
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.analysis.trial.schema import TrialRecord
from sftprof.analysis.what_if.changes import LABELS, RECOMPUTE_MODULE_PARTS, recompute_ms
from sftprof.analysis.what_if.schema import WhatIf

__all__ = ["ledger", "plan_recompute", "recompute_what_if", "KEY", "DRIVER_RESERVED_GIB"]

KEY = "recompute_plan"
MIN_SHARE = 0.01
_GIB = float(2**30)


def ledger(cfg: dict[str, Any], hf: Any, layout: Layout, coords: Mapping[str, int],
           seq_len: int) -> list[dict[str, Any]]:
    """``[{"layer", "module", "bytes"}]``: what each layer of the rank's stage saves for backward without recompute,
    per megatron-core recompute module (``other``: what no module re-runs), at ``seq_len`` tokens per micro-batch."""
    b = 4 if str(cfg["actor"].get("dtype")) == "float32" else 2
    layers = hf.num_hidden_layers // layout.pp
    first = coords.get("pp", 0) * layers
    types = list(getattr(hf, "layer_types", None) or []) or ["full_attention"] * hf.num_hidden_layers
    s = seq_len // layout.cp
    return [{"layer": i, "module": k, "bytes": v}
            for i in range(first, first + layers)
            for k, v in layer_sets(hf, types[i], s, layout.tp, layout.etp, b).items() if k != "moe_backward" and v]


def _options(hf: Any, layers: int) -> list[dict[str, Any]]:
    """Every recompute setting (module docstring) as config settings."""
    g = "actor.megatron.recompute_granularity"
    out: list[dict[str, Any]] = [{g: "none"}]
    shared: int = getattr(hf, "shared_expert_intermediate_size", 0) or 0
    modules = [m for m in RECOMPUTE_MODULE_PARTS if m != "shared_experts" or shared]
    for n in range(1, len(modules) + 1):
        for subset in itertools.combinations(modules, n):
            out.append({"actor.gradient_checkpointing": True, g: "selective",
                        "actor.megatron.recompute_modules": list(subset)})
    out.append({"actor.gradient_checkpointing": True, g: "full", "actor.megatron.recompute_method": "uniform",
                "actor.megatron.recompute_num_layers": 1})
    for n in range(1, layers):
        out.append({"actor.gradient_checkpointing": True, g: "full", "actor.megatron.recompute_method": "block",
                    "actor.megatron.recompute_num_layers": n})
    return out


def _recompute_ms(settings: Mapping[str, Any], forward_ms: dict[tuple[int, str], float], first: int,
                  layers: int) -> float:
    """The forward GPU time a setting re-runs (``forward_ms``: (layer, part) -> ms of one forward)."""
    gran = settings["actor.megatron.recompute_granularity"]
    if gran == "none":
        return 0.0
    if gran == "selective":
        parts = {p for m in settings["actor.megatron.recompute_modules"] for p in RECOMPUTE_MODULE_PARTS[m]}
        return sum(ms for (layer, part), ms in forward_ms.items() if part in parts)
    uniform = settings["actor.megatron.recompute_method"] == "uniform"
    n = layers if uniform else settings["actor.megatron.recompute_num_layers"]
    return sum(ms for (layer, _), ms in forward_ms.items() if first <= layer < first + n)


def plan_recompute(cfg: dict[str, Any], hf: Any, layout: Layout, seq_len: int, capacity_bytes: int,
                   alloc_conf: Optional[str],
                   forward_ms: dict[tuple[int, str], float]) -> dict[str, Any]:
    """The recompute options of the trial and the choice (module docstring).

    Returns:
        ``{"options": [{"settings", "peak_bytes", "need_bytes", "fits", "recompute_ms"}], "choice": an option or
        None (none fits)}``, options in :func:`_options`' order.
    """
    layers = hf.num_hidden_layers // layout.pp
    first = min((layer for layer, _ in forward_ms), default=0)
    options = []
    for settings in _options(hf, layers):
        fit = check_fit(with_settings(cfg, settings), hf, layout, seq_len, capacity_bytes, alloc_conf)
        options.append({"settings": settings, "peak_bytes": fit["peak_bytes"], "need_bytes": fit["need_bytes"],
                        "fits": fit["fits"],
                        "recompute_ms": round(_recompute_ms(settings, forward_ms, first, layers), 4)})
    fitting = [o for o in options if o["fits"]]
    choice = min(fitting, key=lambda o: (o["recompute_ms"], o["peak_bytes"])) if fitting else None
    return {"options": options, "choice": choice}


def _current(cfg: dict[str, Any]) -> dict[str, Any]:
    a, m = cfg["actor"], cfg["actor"].get("megatron") or {}
    gran = m.get("recompute_granularity", "full") if a.get("gradient_checkpointing", True) else "none"
    out = {"actor.megatron.recompute_granularity": gran}
    if gran == "selective":
        out["actor.megatron.recompute_modules"] = list(m.get("recompute_modules") or [])
    if gran == "full":
        out.update({"actor.megatron.recompute_method": m.get("recompute_method", "uniform"),
                    "actor.megatron.recompute_num_layers": int(m.get("recompute_num_layers", 1))})
    return out


def recompute_what_if(summary: Mapping[str, Any], cfg: Optional[dict[str, Any]], model: TrialModel,
                      alloc_conf: Optional[str]) -> list[WhatIf]:
    """The planner's choice as a what-if of a megatron kernel trial (module docstring); [] when there is none.
    ``cfg``: the trial's resolved config, ``model`` its model."""
    capacity = smi_capacity_bytes((summary.get("nvidia_smi") or {}).get("gpus") or [])
    if not cfg or capacity is None or not str(cfg["actor"].get("backend", "")).startswith("megatron"):
        return []
    layout = parse_allocation_mode(cfg["actor"]["backend"])
    try:
        hf = model.config()
    except Exception:  # the model's config is not on this machine (TrialModel.config): no prediction
        return []
    seq = int(cfg["profile"]["fake_seq_len"])
    out: list[WhatIf] = []
    for t in processed_traces(cast(TrialRecord, summary)):
        parts = t["summary"].get("parts") or {}
        forward = {(layer["layer"], r["part"]): r["forward_ms"] for layer in parts.get("layers") or []
                   for r in layer["rows"]}
        if not forward or not parts.get("total_ms"):
            continue
        plan = plan_recompute(cfg, hf, layout, seq, capacity, alloc_conf, forward)
        choice, now = plan["choice"], _current(cfg)
        if choice is None or all(now.get(k) == v for k, v in choice["settings"].items() if k in now):
            continue
        measured = recompute_ms(parts)
        delta = choice["recompute_ms"] - measured
        if abs(delta) < MIN_SHARE * parts["total_ms"]:
            continue
        words = " ".join(f"{k}={v}" for k, v in choice["settings"].items())
        out.append({"key": KEY, "label": LABELS[KEY], "rank": t["rank"],
                    "settings": [{"kind": "config", "key": k, "value": v, "current": None}
                                 for k, v in choice["settings"].items()],
                    "effect": {"metric": "gpu_time", "unit": "ms", "value": round(delta, 4),
                               "baseline": parts["total_ms"]},
                    "assumption": f"recompute re-runs each module's forward at its measured GPU time; the predicted "
                                  f"peak {choice['peak_bytes'] / _GIB:.2f} GiB needs {choice['need_bytes'] / _GIB:.2f} "
                                  f"of {capacity / _GIB:.2f} GiB (sftprof/analysis/memory/fit.py)",
                    "text": f"{LABELS[KEY]} ({words}): GPU time per step {delta:+.1f} ms on rank {t['rank']} "
                            f"(measured recompute {measured:.1f} ms, the choice's {choice['recompute_ms']:.1f} ms)",
                    "weight": abs(delta) / parts["total_ms"]})
    return out[:1]
