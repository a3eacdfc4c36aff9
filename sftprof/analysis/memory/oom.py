"""Triage of a trial that ran out of CUDA memory: why, and the smallest change that fits.

Reads what :mod:`sftprof.capture.oom` left in ``LOG_DIR/memory_snapshots/oom/``: per failing rank the allocator's
snapshot at the failure and ``oom_rank<r>.json``. The figures, per rank (the first failing rank's first):

- the failed request (the record's, else the snapshot's last ``oom`` trace entry), the GPU's capacity (the
  record's ``torch.cuda.mem_get_info`` total; unknown without a record), allocated (the record's, else the blocks
  alive in the snapshot), reserved and not allocated (the snapshot's segments less allocated), and outside PyTorch
  (capacity less free less reserved: CUDA context, NCCL, cuDNN and Triton workspaces);
- what was alive by category (:mod:`sftprof.analysis.memory.categories`, from the blocks' stacks: a kernel trial
  records no allocator history, so its blocks carry none and show as allocated before the window) against the
  prediction of the failing phase (:func:`sftprof.analysis.memory.estimate.predict_peak`);
- the phase (the innermost open ``sftprof/*`` region) and the site of the failing allocation (its Python stack's
  innermost frame outside torch, :func:`sftprof.analysis.memory.categories.allocation_site`);
- the changes that fit (:func:`sftprof.analysis.memory.fit.fitting_changes`), the first being the smallest, with
  their predicted peak; it becomes the ``fit_oom`` what-if that ``TRY_WHAT_IFS`` can try.

A damaged record or snapshot is that file's error in the triage (``errors``), never the summary's failure.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from sftprof import artifacts
from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.memory.categories import MEMORY_CATEGORIES, allocation_site, site_category
from sftprof.analysis.memory.estimate import predict_peak
from sftprof.analysis.memory.fit import ALLOC_CONF, ENV, fitting_changes
from sftprof.analysis.memory.safe_pickle import safe_load_file
from sftprof.analysis.trial.inputs import TrialModel
from sftprof.analysis.what_if.changes import LABELS
from sftprof.analysis.memory.schema import OomTriage
from sftprof.analysis.report.schema import Finding
from sftprof.analysis.what_if.schema import WhatIf, WhatIfSetting

__all__ = ["oom_triage", "oom_finding", "oom_what_if", "settings_text", "KEY"]

KEY = "fit_oom"  # the what-if's lever (sftprof.analysis.what_if.changes.LABELS)
_GIB = float(2**30)
_ALIVE = ("active_allocated", "active_pending_free")


def _frames_of(stack: list[str]) -> list[dict[str, Any]]:
    """The record's ``file:line function`` lines (innermost last) as snapshot frames (innermost first)."""
    out = []
    for line in reversed(stack):
        where, _, name = line.rpartition(" ")
        filename, _, lineno = where.rpartition(":")
        out.append({"filename": filename, "line": int(lineno) if lineno.isdigit() else 0, "name": name})
    return out


def _read(oom_dir: str, rank: int, name: str) -> OomTriage:
    """One rank's figures from its record and snapshot (module docstring); ``errors`` names a damaged file. No
    prediction yet (:func:`oom_triage` adds it) and no other ranks."""
    errors: list[str] = []
    record: dict[str, Any] = {}  # sftprof.artifacts' out-of-memory record, as JSON
    path = os.path.join(oom_dir, artifacts.oom_record_name(rank))
    if os.path.exists(path):
        try:
            record = json.loads(open(path, encoding="utf-8").read())
        except (OSError, ValueError) as err:
            errors.append(f"{artifacts.oom_record_name(rank)}: {err}")
    try:
        snap = safe_load_file(os.path.join(oom_dir, name))
        segments = snap["segments"]
        blocks = [b for s in segments for b in s["blocks"] if b["state"] in _ALIVE]
        traces = [e for t in snap.get("device_traces") or [] for e in t]
    except Exception as err:  # a damaged snapshot is this file's error
        errors.append(f"{name}: {type(err).__name__}: {err}")
        segments, blocks, traces = [], [], []
    oom = next((e for e in reversed(traces) if e.get("action") == "oom"), None)
    live: dict[str, int] = {k: 0 for k in MEMORY_CATEGORIES}
    for b in blocks:
        live[site_category(allocation_site(b.get("frames") or []) if b.get("frames")
                           else "<allocated before the recorded window>")] += b["size"]
    allocated = record.get("allocated_bytes", sum(b["size"] for b in blocks))
    reserved = sum(s["total_size"] for s in segments) if segments else record.get("reserved_bytes")
    free = record.get("free_bytes", oom.get("device_free") if oom else None)
    capacity = record.get("capacity_bytes")
    frames = _frames_of(record["stack"]) if record.get("stack") else (oom or {}).get("frames") or []
    regions = record.get("regions") or []
    return {"rank": rank, "snapshot": name, "errors": errors,
            "requested_bytes": record.get("requested_bytes", oom.get("size") if oom else None),
            "capacity_bytes": capacity, "free_bytes": free, "allocated_bytes": allocated,
            "reserved_unallocated_bytes": None if reserved is None else reserved - allocated,
            "outside_pytorch_bytes": (None if capacity is None or free is None or reserved is None
                                      else capacity - free - reserved),
            "phase": regions[-1] if regions else None, "site": allocation_site(frames) if frames else None,
            "history": bool(record.get("history", bool(traces))),
            "live": [{"category": k, "bytes": v} for k, v in live.items() if v],
            "other_ranks": [], "predicted": None, "fits": [], "prediction_error": None}


def _phase_kind(phase: Optional[str], site: Optional[str]) -> Optional[str]:
    """The :func:`predict_peak` phase the failure lies in, from its region and site (None: not one of them)."""
    if phase and phase.startswith(artifacts.OPTIMIZER_STEP):
        return "optimizer step"
    head = ("output_layer", "lm_head", "sftprof/loss", "tensor_parallel/layers.py:488")  # the logits' sites
    if any(word in (site or "") for word in head):
        return "LM head backward"
    return "layer backward" if phase and "backward" in phase else None


def oom_triage(log_dir: str, cfg: Optional[dict[str, Any]], model: TrialModel, failed_rank: Optional[int],
               alloc_conf: Optional[str], versions: Optional[Mapping[str, Any]] = None,
               conf_var: str = ALLOC_CONF) -> Optional[OomTriage]:
    """The triage of the trial's out-of-memory failure (module docstring); None when no rank left a snapshot.

    ``cfg``: the trial's resolved config (None: no prediction, no change proposed), ``model`` its model;
    ``failed_rank``: the first
    failing rank of the summary's failure (its record is the triage's when it has one); ``alloc_conf``, ``conf_var``:
    the trial's allocator settings and the variable they came from (its recorded environment,
    :func:`sftprof.analysis.memory.fit.alloc_conf_of`); ``versions``: its recorded versions (None: not recorded;
    :func:`sftprof.analysis.memory.fit.outside_pytorch_gib`).
    """
    oom_dir = str(artifacts.oom_dir(log_dir))
    if not os.path.isdir(oom_dir):
        return None
    ranks = sorted((parsed[0], n) for n in os.listdir(oom_dir) if (parsed := artifacts.parse_snapshot_name(n)))
    if not ranks:
        return None
    rank, name = next(((r, n) for r, n in ranks if r == failed_rank), ranks[0])
    t = _read(oom_dir, rank, name)
    t["other_ranks"] = [r for r, _ in ranks if r != rank]
    if cfg and (cfg.get("actor") or {}).get("backend", "").startswith("megatron"):
        try:
            layout = parse_allocation_mode(cfg["actor"]["backend"])
            hf = model.config()
            seq = int(cfg["profile"]["fake_seq_len"])
            pred = predict_peak(cfg, hf, layout, layout.rank_coords(rank), seq)
            kind = _phase_kind(t["phase"], t["site"])
            t["predicted"] = {"phase": pred["phase"], "peak_bytes": pred["peak_bytes"],
                              "rows": [{"category": r["category"], "bytes": r["bytes"]} for r in pred["rows"]],
                              "failing_phase": kind, "failing_phase_bytes": pred["phases"].get(kind)}
            if t["capacity_bytes"]:
                t["fits"] = [{"settings": c["settings"], "peak_bytes": c["check"]["peak_bytes"],
                              "need_bytes": c["check"]["need_bytes"]}
                             for c in fitting_changes(cfg, model.cut, layout, seq,
                                                      t["capacity_bytes"], alloc_conf, versions, conf_var)]
        except Exception as err:  # noqa: BLE001 - a config this prediction cannot model leaves the figures as read
            t["prediction_error"] = f"{type(err).__name__}: {err}"
    return t


def _gib(b: Optional[int]) -> str:
    return "unknown" if b is None else f"{b / _GIB:.2f} GiB"


def settings_text(settings: dict[str, Any]) -> str:
    """A change that fits in words: ``NAME=value`` for an environment variable, ``key=value`` for a config key."""
    return " ".join(f"{k[len(ENV):]}={v}" if k.startswith(ENV) else f"{k}={v}" for k, v in settings.items())


def oom_finding(t: OomTriage) -> Finding:
    """The summary's first finding for the triage ``t`` (:func:`oom_triage`), in words."""
    where = " in " + t["phase"] if t["phase"] else ""
    where += f" at {t['site']}" if t["site"] else ""
    held = (f"{_gib(t['allocated_bytes'])} allocated, {_gib(t['reserved_unallocated_bytes'])} reserved and not "
            f"allocated, {_gib(t['outside_pytorch_bytes'])} outside PyTorch")
    live = ", ".join(f"{r['category']} {r['bytes'] / _GIB:.2f}" for r in t["live"])
    text = (f"rank {t['rank']} ran out of CUDA memory{where}: {_gib(t['requested_bytes'])} requested of a "
            f"{_gib(t['capacity_bytes'])} GPU holding {held}; alive by category (GiB): {live or 'none recorded'}"
            + ("" if t["history"] else " (no allocator history in this trial: blocks without stacks)"))
    p = t.get("predicted")
    if p:
        text += (f"; predicted peak {_gib(p['peak_bytes'])} in the {p['phase']} ("
                 + ", ".join(f"{r['category']} {r['bytes'] / _GIB:.2f}" for r in p["rows"]) + ")")
    if t["fits"]:
        c = t["fits"][0]
        text += (f"; smallest change that fits: {settings_text(c['settings'])}, "
                 f"predicted peak {_gib(c['peak_bytes'])} allocated, {_gib(c['need_bytes'])} needed")
    elif p and t["capacity_bytes"]:
        text += "; no change of one GPU's settings fits: more GPUs (TP, CP, EP, PP)"
    return {"text": text, "section": "#out-of-memory", "weight": 1.0, "key": "out of memory", "rank": t["rank"]}


def oom_what_if(t: OomTriage) -> list[WhatIf]:
    """The ``fit_oom`` what-if of the triage (its smallest change that fits), [] without one. Its effect is the peak
    allocated against what the failed step asked for (allocated + the request, its ``baseline``); the outcome sets
    the what-if trial's peak against that baseline (:func:`sftprof.analysis.what_if.outcome.outcome`)."""
    capacity = t["capacity_bytes"]
    if not t.get("fits") or t["requested_bytes"] is None or capacity is None:  # fits are found with a capacity only
        return []
    c = t["fits"][0]
    asked = t["allocated_bytes"] + t["requested_bytes"]
    settings: list[WhatIfSetting] = [
        {"kind": "env", "key": k[len(ENV):], "value": v, "current": None} if k.startswith(ENV) else
        {"kind": "config", "key": k, "value": v, "current": None} for k, v in c["settings"].items()]
    value = (c["peak_bytes"] - asked) / _GIB
    return [{"key": KEY, "label": LABELS[KEY], "rank": t["rank"], "settings": settings,
             "effect": {"metric": "peak_allocated", "unit": "GiB", "value": round(value, 4),
                        "baseline": round(asked / _GIB, 4)},
             "assumption": f"the step's peak follows sftprof/analysis/memory/estimate.py's prediction "
                           f"({c['peak_bytes'] / _GIB:.2f} GiB) and fits the GPU with "
                           f"{(capacity - c['need_bytes']) / _GIB:.2f} GiB to spare",
             "text": f"{LABELS[KEY]} ({settings_text(c['settings'])}): peak allocated "
                     f"{value:+.2f} GiB on rank {t['rank']} against the {asked / _GIB:.2f} GiB the failed step "
                     "asked for",
             "weight": 1.0}]
