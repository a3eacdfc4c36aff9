"""The step of the whole job from a profiled slice: a few layers and tokens measured, more projected.

Users profile a slice of the job (``actor.num_layers`` of the model's layers, ``profile.fake_seq_len`` tokens a
sequence) because the whole job does not fit one GPU. :func:`project_slice` projects the slice's profiled step to
``L'`` layers and ``T'`` tokens a sequence (same layout, batch, micro-batches and settings) from its kernel trace's GPU
time by model part, layer and phase (``kernel_traces[].summary.parts``, module-region attribution), part by part:

- decoder-layer parts scale with the number of the rank's layers of their type (Hugging Face's ``layer_types``: the
  model's layer pattern cut to ``L'``, ``L' / PP`` layers on the rank's stage), from the measured mean per layer of
  that type; their recompute phase with the layers recomputed (full recompute ``block``: the stage's first
  ``recompute_num_layers``);
- and with the tokens by the FLOP ratio of what the part computes (:func:`sftprof.flops.per_layer_flops`, one layer
  of its type over one sequence of ``T'`` against ``T``): attention core (causal pairs, ``T (T + 1)``), QKV and output
  projections, the gated delta-net (conv1d and chunked delta rule; its projections), router, routed and shared
  experts. Layer parts with no FLOP count (norms, RoPE, dispatch/combine, residuals) scale with ``T' / T``;
- outside the layers: LM head + loss by the LM head's FLOPs, embedding and final norm ``T' / T``, the optimizer and
  NCCL kernels outside the parts by the parameters of the rank's optimizer shard, the rest ("outside model parts")
  kept;
- GPU busy time scales with the parts' sum (overlapping streams in proportion). GPU idle: the host's waits in
  decoder-layer parts (``host.gpu_idle.host_wait_by_place``) scale with the layers, the rest is kept. With more
  tokens a part's kernels grow and the host runs ahead, so that idle shrinks: the projected step is then an upper
  bound and the GPU-bound step (busy time alone) the lower.

Beside it, the step at the measured FLOP rate (``constant_rate_step_ms``: the step times the ratio of model +
recompute FLOPs), the only projection a record without the part breakdown allows. The MFU: the measured one times the
model-FLOP ratio over the step ratio. Memory: the fit check's prediction at ``L'`` and ``T'``
(:func:`sftprof.analysis.memory.fit.check_fit`). A simulated rank (``actor.simulate.rank``): the projected step is
its compute, and :func:`sftprof.analysis.time.projection.project` adds the communication of the real rank at ``L'``
and ``T'`` (its overlap windows scaled like the forward and backward parts). Every rule is a line of ``assumptions``.
Torch-free; ``python -m sftprof.analysis.time.slice_projection RUN_DIR --layers 48 --tokens 131072`` prints it.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, cast

from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.memory.fit import alloc_conf_of, check_fit, smi_capacity_bytes, with_settings
from sftprof.analysis.schema import processed_traces, read_summary
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.analysis.trial.schema import TrialRecord
from sftprof.analysis.time.model_parts import part_label
from sftprof.analysis.time.projection import new_file_problem, overlap_windows, print_and_write, project
from sftprof.analysis.time.projection import render as render_communication
from sftprof.analysis.time.rank_plan import rank_plan
from sftprof.artifacts import MODEL_PARTS, SUMMARY_JSON
from sftprof.flops import (FULL_ATTENTION, LINEAR_ATTENTION, ForwardFlops, ModelShape, per_layer_flops,
                           train_step_flops)

__all__ = ["RankSlice", "rank_slice", "project_parts", "project_slice", "render", "main"]

_GIB = float(2**30)
# (layer type, part) -> the ForwardFlops fields of what the part computes; MoE parts in every layer type
_LAYER_FLOPS = {(FULL_ATTENTION, "attn_core"): ("attn_core",), (FULL_ATTENTION, "attn_qkv"): ("attn_linear",),
                (FULL_ATTENTION, "attn_out"): ("attn_linear",),
                (LINEAR_ATTENTION, "linear_attn"): ("gdn_conv", "gdn_core"),
                (LINEAR_ATTENTION, "attn_qkv"): ("gdn_proj",), (LINEAR_ATTENTION, "attn_out"): ("gdn_proj",)}
_MOE_FLOPS = {"router": ("router",), "experts": ("routed_experts",), "shared_experts": ("shared_experts",)}
_PARAMETER_PARTS = ("optimizer", "comm_outside")
_KEPT_PARTS = ("outside_parts",)
_LAYER_PARTS = frozenset(MODEL_PARTS) - {"embedding", "lm_head_loss"}
_WINDOW_PHASES = {"forward": ("forward_ms",), "backward": ("backward_ms", "recompute_ms")}  # overlap windows' phases
ASSUMPTIONS = (
    "same layout, batch, micro-batches (as many sequences each) and settings; only the layers and the tokens a "
    "sequence change",
    "each kernel runs at its measured rate: a part's time scales with its FLOPs (sftprof/flops.py), a part without a "
    "FLOP count with its tokens; kernels of another size can run faster or slower (short sequences: lower attention "
    "rates)",
    "decoder-layer parts: the measured mean per layer of each type (layer_types), times the rank's layers of that "
    "type; recompute times the layers recomputed",
    "context parallelism: the rank's share of the causal pairs scales like the whole sequence's",
    "MoE routing as measured: the tokens per expert scale with the tokens",
    "optimizer and NCCL kernels outside the parts: with the parameters of the rank's optimizer shard; "
    "'outside model parts' (loss glue, unlinked backward) kept",
    "GPU idle: the host's waits in decoder-layer parts scale with the layers, the rest is kept; with more tokens "
    "longer kernels hide launches, so the projected step is an upper bound and the GPU-bound step the lower",
)


@dataclass(frozen=True)
class RankSlice:
    """One rank's share of the job at ``layers`` (the model's decoder layers) and ``tokens`` (a sequence).

    ``stage_types``: the rank's layers (global index -> ``full_attention`` / ``linear_attention``); ``recomputed``:
    those whose forward is re-run; ``layer_flops``: forward FLOPs of one layer of each type over one sequence;
    ``lm_head_flops`` likewise; ``optimizer_params``: parameters of the rank's optimizer shard; ``model_flops`` and
    ``recompute_flops``: of one step over one sequence (ratios are what count); ``plan``: the rank's
    :func:`sftprof.analysis.time.rank_plan.rank_plan`; ``cfg``, ``hf``: the trial's config and model config at this
    slice.
    """

    layers: int
    tokens: int
    stage_types: dict[int, str]
    recomputed: frozenset[int]
    layer_flops: dict[str, ForwardFlops]
    lm_head_flops: float
    optimizer_params: float
    model_flops: float
    recompute_flops: float
    plan: dict[str, Any]
    cfg: dict[str, Any]
    hf: Any

    def count(self, layer_type: str, recomputed: bool = False) -> int:
        """The rank's layers of ``layer_type`` (recomputed ones only when ``recomputed``)."""
        return sum(t == layer_type and (not recomputed or i in self.recomputed) for i, t in self.stage_types.items())


def _recompute(cfg: dict[str, Any]) -> tuple[str, str, int]:
    """``(granularity, method, num_layers)`` of the trial's recompute as sftprof.flops counts it."""
    a = cfg["actor"]
    m = a.get("megatron") or {}
    gran = str(m.get("recompute_granularity", "full")) if a.get("gradient_checkpointing", True) else "none"
    return gran, str(m.get("recompute_method", "uniform")), int(m.get("recompute_num_layers", 1))


def rank_slice(cfg: dict[str, Any], layers: int, tokens: int, rank: int, have_te: Optional[bool] = None) -> RankSlice:
    """``rank``'s share of the trial ``cfg`` (its ``config.yaml`` as a dict[str, Any]) cut to ``layers`` and ``tokens``.

    Raises:
        ValueError: ``layers`` < 1, above the model's or not divisible by PP; ``tokens`` < 1 or not split as the
            layout's CP and TP need; a model whose FLOPs sftprof.flops does not count.
    """
    layout = parse_allocation_mode(cfg["actor"]["backend"])
    if layers < 1 or layers % layout.pp:
        raise ValueError(f"--layers={layers}: must be >= 1 and divisible by PP={layout.pp} (the model's decoder "
                         "layers to project to)")
    if tokens < 1:
        raise ValueError(f"--tokens={tokens}: must be >= 1 (tokens a sequence to project to)")
    try:
        hf = TrialModel(cfg).cut(layers)
    except ValueError as exc:
        raise ValueError(f"--layers={layers}: {exc}") from None
    limit = int(cfg["actor"]["mb_spec"].get("max_tokens_per_mb", 0))  # the same sequences per micro-batch
    c = with_settings(cfg, {"actor.num_layers": layers, "profile.fake_seq_len": tokens,
                            "actor.mb_spec.max_tokens_per_mb": limit // int(cfg["profile"]["fake_seq_len"]) * tokens})
    try:
        plan = rank_plan(c, hf, layout, rank, have_te)
        shape = ModelShape.from_hf(hf)
    except (ValueError, NotImplementedError) as exc:
        raise ValueError(f"--tokens={tokens}: {exc}" if "fake_seq_len" in str(exc) else str(exc)) from None
    stage = layers // layout.pp
    first = plan["coords"]["pp"] * stage
    gran, method, n = _recompute(c)
    recomputed = (frozenset() if gran == "none" else
                  frozenset(range(first, first + (min(n, stage) if gran == "full" and method == "block" else stage))))
    step = train_step_flops(shape, [tokens], gran, method, n, layout.pp)
    sh = plan["shards"]
    return RankSlice(layers=layers, tokens=tokens,
                     stage_types={i: shape.layer_type(i) for i in range(first, first + stage)}, recomputed=recomputed,
                     layer_flops=per_layer_flops(shape, [tokens]),
                     lm_head_flops=2.0 * tokens * shape.hidden * shape.vocab,
                     optimizer_params=sh["params_dense"] / sh["optimizer_shards_dense"]
                     + sh["params_expert"] / sh["optimizer_shards_expert"],
                     model_flops=step.model, recompute_flops=step.recompute, plan=plan, cfg=c, hf=hf)


def _ratio(new: float, old: float) -> float:
    return new / old if old else 1.0


def _layer_factor(layer_type: str, part: str, src: RankSlice, dst: RankSlice) -> tuple[float, str]:
    """The token factor of a decoder-layer part and its rule."""
    fields = _LAYER_FLOPS.get((layer_type, part)) or _MOE_FLOPS.get(part)
    if fields:
        old = sum(getattr(src.layer_flops[layer_type], f) for f in fields)
        if old:
            return sum(getattr(dst.layer_flops[layer_type], f) for f in fields) / old, "FLOPs " + "+".join(fields)
    return dst.tokens / src.tokens, "tokens"


def _outside_factor(part: str, src: RankSlice, dst: RankSlice) -> tuple[float, str]:
    """The factor of a part outside the decoder layers and its rule."""
    if part == "lm_head_loss":
        return _ratio(dst.lm_head_flops, src.lm_head_flops), "FLOPs lm_head"
    if part in _PARAMETER_PARTS:
        return _ratio(dst.optimizer_params, src.optimizer_params), "optimizer-shard parameters"
    if part in _KEPT_PARTS:
        return 1.0, "kept"
    if part in MODEL_PARTS:
        return dst.tokens / src.tokens, "tokens"
    raise ValueError(f"part {part!r} has no projection rule (accepted: the model parts of module regions, "
                     f"{', '.join(_PARAMETER_PARTS + _KEPT_PARTS)})")


def project_parts(parts: dict[str, Any], src: RankSlice, dst: RankSlice) -> list[dict[str, Any]]:
    """Rows ``{"part", "label", "layer_type", "layers", "measured_ms", "factor", "projected_ms", "rule"}`` of the
    slice's GPU time by part (``parts``: a kernel summary's, module-region attribution) projected from ``src`` to
    ``dst`` (module docstring); ``layer_type`` and ``layers`` ("4->48") None outside the decoder layers.

    Raises:
        ValueError: a layer of the parts not on ``src``'s rank, a layer type ``dst`` holds and ``src`` does not (or
            recomputes and ``src`` does not), a part without a rule.
    """
    cells: dict[tuple[str, str], list[float]] = {}  # (type, part) -> [ms outside recompute, recompute ms]
    for layer in parts["layers"]:
        t = src.stage_types.get(layer["layer"])
        if t is None:
            raise ValueError(f"the trace's parts name layer {layer['layer']}, not one of the rank's layers "
                             f"{sorted(src.stage_types)}")
        for r in layer["rows"]:
            cell = cells.setdefault((t, r["part"]), [0.0, 0.0])
            cell[0] += r["total_ms"] - r["recompute_ms"]
            cell[1] += r["recompute_ms"]
    for t in sorted(set(dst.stage_types.values()) - {t for t, _ in cells}):
        raise ValueError(f"the profiled slice holds no {t} layer with GPU time, the projected one does: profile a "
                         f"slice with one (actor.num_layers up to a layer of that type)")
    rows = []
    for (t, part), (once, rec) in sorted(cells.items(), key=lambda kv: (kv[0][0], MODEL_PARTS.index(kv[0][1])
                                                                         if kv[0][1] in MODEL_PARTS else 99)):
        n_src, n_dst = src.count(t), dst.count(t)
        r_src, r_dst = src.count(t, True), dst.count(t, True)
        if rec and r_dst and not r_src:
            raise ValueError(f"no {t} layer is recomputed in the slice, the projected one recomputes {r_dst}")
        tokens, rule = _layer_factor(t, part, src, dst)
        projected = tokens * (once / n_src * n_dst + (rec / r_src * r_dst if r_src else 0.0))
        rows.append({"part": part, "label": part_label(part), "layer_type": t, "layers": f"{n_src}->{n_dst}",
                     "measured_ms": once + rec, "factor": _ratio(projected, once + rec), "projected_ms": projected,
                     "rule": f"layers x {rule}"})
    for r in parts["outside_layers"]:
        factor, rule = _outside_factor(r["part"], src, dst)
        rows.append({"part": r["part"], "label": r["label"], "layer_type": None, "layers": None,
                     "measured_ms": r["total_ms"], "factor": factor, "projected_ms": r["total_ms"] * factor,
                     "rule": rule})
    return rows


def _require(summary: dict[str, Any], *paths: tuple[str, ...]) -> None:
    """Check that ``summary[path[0]][path[1]]...`` exists for each path. Raises ValueError naming the first missing
    member (not a kernel trial's summary, or a damaged one)."""
    for path in paths:
        value: Any = summary
        for i, key in enumerate(path):
            if not isinstance(value, dict) or key not in value:
                raise ValueError(f"no member {'.'.join(path[:i + 1])}: not a kernel trial's {SUMMARY_JSON}, or a "
                                 "damaged one")
            value = value[key]


def _trace(summary: dict[str, Any], rank: Optional[int]) -> dict[str, Any]:
    traces = [cast(dict[str, Any], t) for t in processed_traces(cast(TrialRecord, summary))
              if rank is None or t["rank"] == rank]
    if not traces:
        raise ValueError("no kernel trace " + (f"of rank {rank} " if rank is not None else "")
                         + "was summarised in this trial: the projection needs a kernel trial's GPU time by model part")
    _require(traces[0], ("summary", "parts"), ("summary", "gpu", "busy_ms"), ("summary", "step_window", "wall_ms"))
    parts = traces[0]["summary"].get("parts")
    if not isinstance(parts, dict) or parts.get("source") != "module_regions":
        raise ValueError(f"rank {traces[0]['rank']}'s trace has no GPU time by model part from module regions (a GPU "
                         "kernel trial of this trainer has it): nothing to project part by part")
    if not parts.get("total_ms"):
        raise ValueError(f"rank {traces[0]['rank']}'s trace has no GPU time (a CPU trial, or no GPU activity in the "
                         "step): the projection needs a GPU kernel trial")
    return traces[0]


def _memory(summary: dict[str, Any], dst: RankSlice) -> Optional[dict[str, Any]]:
    """The fit check at ``dst``: the worst rank's predicted peak and need, against the trial's GPU when recorded."""
    layout = parse_allocation_mode(dst.cfg["actor"]["backend"])
    if layout.backend != "megatron":
        return None
    capacity = smi_capacity_bytes((summary.get("nvidia_smi") or {}).get("gpus") or [])
    fit = check_fit(dst.cfg, dst.hf, layout, dst.tokens, capacity or 0,
                    alloc_conf_of(summary.get("environment"))[1], summary.get("versions"))
    return {"rank": fit["rank"], "phase": fit["prediction"]["phase"], "peak_gib": fit["peak_bytes"] / _GIB,
            "need_gib": fit["need_bytes"] / _GIB, "capacity_gib": None if capacity is None else capacity / _GIB,
            "fits": None if capacity is None else fit["fits"]}


def project_slice(summary: dict[str, Any], layers: Optional[int] = None, tokens: Optional[int] = None,
                  rank: Optional[int] = None) -> dict[str, Any]:
    """The trial's (a ``profile_summary.json`` as a dict[str, Any]) profiled step projected to ``layers`` and ``tokens`` (None:
    the slice's own) from the kernel trace of ``rank`` (None: the first; a simulated trial's is its rank).

    Returns:
        ``{"rank", "simulated", "source": {"layers", "tokens", "step_ms", "gpu_busy_ms", "idle_ms", "layer_idle_ms",
        "mfu"}, "target": {"layers", "tokens"}, "rows": project_parts(...), "measured_parts_ms", "projected_parts_ms",
        "gpu_busy_ms", "idle_ms", "projected_step_ms", "gpu_bound_step_ms", "constant_rate_step_ms", "mfu", "memory",
        "communication" (a simulated rank's :func:`sftprof.analysis.time.projection.project`, else None),
        "assumptions"}``; times in ms.
    Raises:
        ValueError: bad ``layers`` / ``tokens`` (:func:`rank_slice`), no kernel trace with GPU time by model part, a
            member the projection reads missing (not a kernel trial's summary, or a damaged one), ``rank`` not the
            rank a simulated trial ran.
    """
    _require(summary, ("config", "actor", "backend"), ("config", "profile", "fake_seq_len"), ("kernel_traces",))
    cfg = summary["config"]
    a = cfg["actor"]
    simulate = int((a.get("simulate") or {}).get("rank", -1))
    if simulate >= 0 and rank is not None and rank != simulate:
        raise ValueError(f"--rank {rank}: this trial simulated rank {simulate} alone, the only rank it traced")
    trace = _trace(summary, simulate if simulate >= 0 else rank)
    s, te = trace["summary"], summary.get("transformer_engine")
    own_layers = int(a.get("num_layers") or 0) or TrialModel(cfg).cut(0).num_hidden_layers
    src = rank_slice(cfg, own_layers, int(cfg["profile"]["fake_seq_len"]), trace["rank"], te)
    dst = rank_slice(cfg, own_layers if layers is None else layers, src.tokens if tokens is None else tokens,
                     trace["rank"], te)
    rows = project_parts(s["parts"], src, dst)
    measured, projected = s["parts"]["total_ms"], sum(r["projected_ms"] for r in rows)
    wall, busy = s["step_window"]["wall_ms"], s["gpu"]["busy_ms"]
    idle = max(0.0, wall - busy)
    places = ((s.get("host") or {}).get("gpu_idle") or {}).get("host_wait_by_place") or {}
    layer_idle = min(idle, sum(r["idle_ms"] for r in places.get("rows") or [] if r["part"] in _LAYER_PARTS))
    busy_p = busy * _ratio(projected, measured)
    idle_p = layer_idle * len(dst.stage_types) / len(src.stage_types) + idle - layer_idle
    step_p = busy_p + idle_p
    mfu = (summary.get("stats") or {}).get("mfu")
    mfu_p = mfu * dst.model_flops / src.model_flops * wall / step_p if mfu is not None else None
    memory = _memory(summary, dst)
    communication = None
    if simulate >= 0:
        windows = {w: ms * _ratio(*reversed(_window_ms(s["parts"], rows, w)))
                   for w, ms in overlap_windows(s["regions"]).items()}
        communication = project(dst.plan, step_p, None, int(a["simulate"]["gpus_per_node"]), windows, mfu_p,
                                versions=summary.get("versions"))
    return {"rank": trace["rank"], "simulated": simulate >= 0,
            "source": {"layers": src.layers, "tokens": src.tokens, "step_ms": wall, "gpu_busy_ms": busy,
                       "idle_ms": idle, "layer_idle_ms": layer_idle, "mfu": mfu},
            "target": {"layers": dst.layers, "tokens": dst.tokens}, "rows": rows, "measured_parts_ms": measured,
            "projected_parts_ms": projected, "gpu_busy_ms": busy_p, "idle_ms": idle_p, "projected_step_ms": step_p,
            "gpu_bound_step_ms": busy_p,
            "constant_rate_step_ms": wall * _ratio(dst.model_flops + dst.recompute_flops,
                                                   src.model_flops + src.recompute_flops),
            "mfu": mfu_p, "memory": memory, "communication": communication,
            "assumptions": list(ASSUMPTIONS) + ([] if memory else ["memory: the fit check predicts megatron layouts "
                                                                   "only; not projected"])}


def _window_ms(parts: dict[str, Any], rows: list[dict[str, Any]], window: str) -> tuple[float, float]:
    """``(measured, projected)`` GPU ms of an overlap window's phases (:data:`_WINDOW_PHASES`) over every part: each
    row's projection split as its part's measured time is."""
    share = {r["part"]: sum(r[ph] for ph in _WINDOW_PHASES[window]) / r["total_ms"] for r in parts["summed"]
             if r["total_ms"]}
    return (sum(r[ph] for r in parts["summed"] for ph in _WINDOW_PHASES[window]),
            sum(r["projected_ms"] * share.get(r["part"], 0.0) for r in rows))


def render(p: dict[str, Any]) -> str:
    """The projection as text: one line per part, the totals, the memory, the communication of a simulated rank
    and the assumptions."""
    src, dst = p["source"], p["target"]
    lines = [f"slice projection of rank {p['rank']}{' (simulated)' if p['simulated'] else ''}: {src['layers']} layers "
             f"x {src['tokens']} tokens -> {dst['layers']} layers x {dst['tokens']} tokens (GPU time by model part)",
             f"{'part':44} {'layer type':16} {'layers':>7} {'measured ms':>12} {'factor':>9} {'projected ms':>13}"
             "  rule"]
    for r in p["rows"]:
        lines.append(f"{r['label'][:44]:44} {r['layer_type'] or '':16} {r['layers'] or '':>7} "
                     f"{r['measured_ms']:12.1f} {r['factor']:9.3f} {r['projected_ms']:13.1f}  {r['rule']}")
    lines += [f"parts {p['measured_parts_ms']:.1f} -> {p['projected_parts_ms']:.1f} ms; GPU busy "
              f"{src['gpu_busy_ms']:.1f} -> {p['gpu_busy_ms']:.1f} ms; GPU idle {src['idle_ms']:.1f} -> "
              f"{p['idle_ms']:.1f} ms (of it in layer parts {src['layer_idle_ms']:.1f} ms)",
              f"step {src['step_ms']:.1f} ms -> projected {p['projected_step_ms']:.1f} ms (GPU-bound "
              f"{p['gpu_bound_step_ms']:.1f} ms; at the measured FLOP rate {p['constant_rate_step_ms']:.1f} ms)"
              + (f", MFU {100 * p['mfu']:.1f} %" if p["mfu"] is not None else "")]
    m = p["memory"]
    if m:
        lines.append(f"memory (fit check, rank {m['rank']}): predicted peak {m['peak_gib']:.2f} GiB in the {m['phase']}"
                     f", needs {m['need_gib']:.2f} GiB" + (f" of {m['capacity_gib']:.2f}: "
                                                         f"{'fits' if m['fits'] else 'does not fit'}"
                                                         if m["capacity_gib"] is not None else ""))
    if p["communication"]:
        lines += ["communication of the real rank at the projected size, the projected step as its compute:",
                  render_communication(p["communication"])]
    return "\n".join(lines + ["assumptions of the slice projection:"] + [f"- {x}" for x in p["assumptions"]])


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m sftprof.analysis.time.slice_projection RUN_DIR [--layers N] [--tokens N] [--rank R] [--json
    FILE]``; exit 2 on bad input."""
    ap = argparse.ArgumentParser(description="Project a profiled slice's step to more layers and tokens.")
    ap.add_argument("trial", help=f"the kernel trial's run dir (its {SUMMARY_JSON}) or that file")
    ap.add_argument("--layers", type=int, help="the model's decoder layers to project to (default: the slice's)")
    ap.add_argument("--tokens", type=int, help="tokens a sequence to project to (default: the slice's)")
    ap.add_argument("--rank", type=int, help="the rank whose trace is projected (default: the first traced)")
    ap.add_argument("--json", help="also write the projection to this new file (never overwritten)")
    args = ap.parse_args(argv)
    if problem := new_file_problem(args.json):
        print(f"slice projection: {problem}", file=sys.stderr)
        return 2
    path = os.path.join(args.trial, SUMMARY_JSON) if os.path.isdir(args.trial) else args.trial
    if os.path.isdir(args.trial) and not os.path.exists(path):
        trials = sorted(d for d in os.listdir(args.trial) if os.path.isfile(os.path.join(args.trial, d, SUMMARY_JSON)))
        if trials:  # a RUN_ROOT: its trials are its folders
            print(f"slice projection: {args.trial} is a RUN_ROOT, not a trial's run dir: pass one of its trials "
                  f"({', '.join(trials)})", file=sys.stderr)
            return 2
    try:
        p = project_slice(dict(read_summary(path)), args.layers, args.tokens, args.rank)
    except (ValueError, OSError) as exc:  # read_summary's SummaryReadError is a ValueError
        print(f"slice projection: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as exc:  # a member of another type or missing: a damaged summary
        print(f"slice projection: {path}: a damaged {SUMMARY_JSON} ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    return print_and_write(render(p), p, args.json, "slice projection")


if __name__ == "__main__":
    sys.exit(main())
