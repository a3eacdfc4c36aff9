"""Does a trial fit its GPUs? The predicted peak of every rank against a GPU's capacity, and the changes that fit.

A rank needs, at its step's peak (:func:`sftprof.analysis.memory.estimate.predict_peak`, steady state):

- the predicted peak allocated bytes;
- the allocator's slack, reserved and not allocated: with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
  none (0.29 GiB measured on the H100 80 GB slice); without, the largest block the step allocates (the logits,
  else the MoE's dispatched tokens ``T h b``): a block freed and cached that a later request of another size cannot
  reuse. Measured slack at the peak against that block, 1x H200 (bench/NOTES.md, "The fit check"): 0.47-1.49x;
- what the process holds outside PyTorch's allocator (CUDA context, NCCL, cuDNN, Triton), by the megatron-core the
  trial recorded (``versions.json``), else the installed one (:func:`outside_pytorch_gib`; the one place that
  chooses: :func:`megatron_core_release`); a larger layout's NCCL buffers are not in it. A simulated rank
  (``actor.simulate.rank``), whose collectives run on torch's fake process group, holds far less:
  :data:`OUTSIDE_PYTORCH_GIB_SIMULATED`;
- the prediction's error: :data:`PREDICTION_UNDER_SHARE` of the predicted peak (rounded up to a byte), the most the
  prediction fell short of a measured run's peak.

:func:`check_fit` gives the worst rank (ranks of one pipeline stage predict alike; a simulated rank's, that rank)
against ``capacity_bytes``;
:func:`fitting_changes` the changes that fit, in the order of the smallest change first: expandable segments, the
chunked LM head, both, full recompute, then fewer tokens (halved) or fewer layers alone, else with those changes;
a change that holds an earlier fitting one (both, where expandable segments alone fits) is left out.
Settings are config keys (the trial's ``key=value`` arguments) or, prefixed with :data:`ENV`, environment variables
of the trial's processes.
"""
from __future__ import annotations

import copy
import math
import re
from typing import Any, Callable, Mapping, Optional, Sequence

from sftprof import compat
from sftprof.allocation import Layout
from sftprof.analysis.memory.estimate import chunked_lm_head, predict_peak
from sftprof.config import ConfigError

__all__ = ["outside_pytorch_gib", "megatron_core_release", "OUTSIDE_PYTORCH_GIB_SIMULATED", "DRIVER_RESERVED_GIB",
           "smi_capacity_bytes", "PREDICTION_UNDER_SHARE", "TIGHT_SHARE", "LM_HEAD_CHUNK", "ALLOC_CONF", "ENV",
           "expandable_segments", "with_expandable", "check_fit", "fit_text", "fitting_changes", "with_settings"]

# GiB held outside PyTorch's allocator by a one-GPU trial: nvidia-smi's peak use less the peak reserved, H100 80 GB,
# TE 2.20.2 (bench/NOTES.md). megatron-core 0.16.1: 7.76 in each of the five one-GPU trials of docs/examples and in
# the H100's out-of-memory message (7.69 in the 131072-token OOM); 0.19.2: 8.85 in that 131072-token run ("Twenty-
# second session"). 0.17 and 0.18 were not measured: they take 0.19.2's figure, the larger.
OUTSIDE_PYTORCH_GIB_MCORE_0_16 = 7.76
OUTSIDE_PYTORCH_GIB_MCORE_0_19 = 8.85
OUTSIDE_PYTORCH_LARGER_FROM = (0, 17, 0)
# A simulated rank of megatron:(attn:d2c4|ffn:d1e8), H100 80 GB, megatron-core 0.19.2, TE 2.20.2: nvidia-smi's peak use
# less the peak reserved, 0.76 GiB at 4 layers and 0.68 at 48 (bench/NOTES.md, "Twenty-fourth session"); the larger
OUTSIDE_PYTORCH_GIB_SIMULATED = 0.76
# The prediction's error on the 15 measured runs of bench/fit_check_table.py (one GPU; simulated ranks of the 8-GPU
# layout): it falls short of the measured peak by 0.1 % to 1.25 % of the predicted peak, never over (bench/NOTES.md,
# "Twenty-seventh session: one H100 80 GB, the gate and the fit check against the runs"); the largest, 1.248 % (the
# simulated 4-layer rank: 16.10 GiB measured, 15.90 predicted), rounded up past the measured figures' 0.01 GiB.
PREDICTION_UNDER_SHARE = 0.013
# Headroom beyond the prediction error margin smaller than this share of the peak is called tight: a setting no run
# measured may err more (before the twenty-fourth session's fixes the simulated ranks' peaks were 8.4-8.9 % under).
TIGHT_SHARE = 0.03
LM_HEAD_CHUNK = 2048  # tokens per chunk of the chunked LM head proposed (the measured runs', bench/NOTES.md)
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# torch's variables of its caching allocator's settings, in the order torch 2.13 reads them: the first one set (even
# empty) gives the settings, expandable segments among them (PYTORCH_ALLOC_CONF is the newer, device-neutral name;
# torch's getter _accelerator_getAllocatorSettings returns the CUDA one's value where both are set: bench/NOTES.md)
ALLOC_CONF_VARS = (ALLOC_CONF, "PYTORCH_ALLOC_CONF")
ENV = "env."  # a setting's key prefix for an environment variable of the trial's processes
MIN_TOKENS = 1024  # fewer tokens per sample than this is no long-context profile
# nvidia-smi's total less torch's capacity: 81559 MiB against 79.19 GiB (81090 MiB) on an H100 80 GB
DRIVER_RESERVED_GIB = 0.46
_GIB = float(2**30)

HfLoader = Callable[[int], Any]  # number of layers (0: all) -> the model's Hugging Face config cut to them


def alloc_conf_of(env: object) -> tuple[str, Optional[str]]:
    """``(name, value)`` of the variable torch reads its allocator's settings from in ``env`` (``os.environ``, or a
    trial's recorded environment; not a mapping: none set): the first of :data:`ALLOC_CONF_VARS` set, else
    ``(PYTORCH_CUDA_ALLOC_CONF, None)``, the name the fit check proposes when neither is."""
    if isinstance(env, Mapping):
        for name in ALLOC_CONF_VARS:
            value = env.get(name)
            if isinstance(value, str):
                return name, value
    return ALLOC_CONF, None


def expandable_segments(alloc_conf: Optional[str]) -> bool:
    """True when ``PYTORCH_CUDA_ALLOC_CONF`` turns expandable segments on: its last ``expandable_segments`` entry
    reads ``True``, the one spelling torch takes for on (it refuses ``true``; the driver refuses what torch refuses)."""
    on = False
    for item in (alloc_conf or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"
    return on


# a release as pip spells it: 0.19.2, 0.16.0rc0, 0.15.0+git1a2b3c
_RELEASE = re.compile(r"(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?(?:(?:[A-Za-z+_-]|\.[A-Za-z])[0-9A-Za-z.+_-]{0,40})?")


def with_expandable(alloc_conf: Optional[str]) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` with its other options kept and ``expandable_segments:True``."""
    options = [o for o in (alloc_conf or "").split(",")
               if o.strip() and o.partition(":")[0].strip() != "expandable_segments"]
    return ",".join(options + ["expandable_segments:True"])


def megatron_core_release(versions: object) -> tuple[Optional[tuple[int, int, int]], str]:
    """The megatron-core release a trial ran with, as the fit check takes it, and whence in words: the trial's
    recorded ``versions`` (:class:`sftprof.analysis.trial.schema.Versions`: its ``megatron_core``, None when not
    installed) when given and readable as ``MAJOR.MINOR[.PATCH][suffix]`` (``0.16.0rc0``); else (None: the trial
    recorded none; a damaged record: not an object, ``megatron_core`` missing or not such a text) the installed one,
    where this runs. The release is None without megatron-core."""
    record = versions if isinstance(versions, Mapping) else {}
    if "megatron_core" in record and record["megatron_core"] is None:
        return None, "no megatron-core in the trial"
    text = record.get("megatron_core")
    m = _RELEASE.fullmatch(text) if isinstance(text, str) else None
    if m:
        release = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        return release, f"the trial's megatron-core {text}"
    try:
        installed: Optional[tuple[int, int, int]] = compat.megatron_core_version()
    except ConfigError:
        installed = None
    where = "installed where postprocessed, the trial having recorded no readable megatron-core version"
    return installed, (f"megatron-core {'.'.join(map(str, installed))} {where}" if installed else
                       f"no megatron-core {where}")


def outside_pytorch_gib(versions: object = None) -> float:
    """GiB a trial's process holds outside PyTorch's allocator (module constants) by its megatron-core
    (:func:`megatron_core_release` of the trial's recorded ``versions``; None: not recorded, the installed one);
    0.16.1's figure without megatron-core (an fsdp trial's environment)."""
    release, _ = megatron_core_release(versions)
    return (OUTSIDE_PYTORCH_GIB_MCORE_0_19 if release is not None and release >= OUTSIDE_PYTORCH_LARGER_FROM
            else OUTSIDE_PYTORCH_GIB_MCORE_0_16)


def smi_capacity_bytes(gpus: Sequence[Mapping[str, Any]]) -> Optional[int]:
    """torch's capacity (bytes) of the smallest GPU of a summary's ``nvidia_smi.gpus``: nvidia-smi's
    ``memory_total_mib`` less :data:`DRIVER_RESERVED_GIB`; None without a GPU whose total nvidia-smi gave."""
    totals = [float(g["memory_total_mib"]) for g in gpus if g.get("memory_total_mib") is not None]
    if not totals:
        return None
    return int(min(totals) * 2**20 - DRIVER_RESERVED_GIB * _GIB)


def _largest_block(cfg: dict[str, Any], hf: Any, layout: Layout, seq_len: int) -> int:
    """Bytes of the largest block of the step: the logits (unchunked loss) or the MoE's dispatched tokens."""
    b = 4 if str(cfg["actor"].get("dtype")) == "float32" else 2
    s = seq_len // layout.cp
    if not chunked_lm_head(cfg):
        return s * (int(hf.vocab_size) // layout.tp) * b
    return s * int(hf.num_experts_per_tok) * layout.etp // layout.tp * int(hf.hidden_size) * b


def check_fit(cfg: dict[str, Any], hf: Any, layout: Layout, seq_len: int, capacity_bytes: int,
              alloc_conf: Optional[str], versions: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The worst rank's need against ``capacity_bytes`` (one GPU's; module docstring); ``versions``: the trial's
    recorded ones (:func:`outside_pytorch_gib`; None: the installed megatron-core, a trial yet to run).

    Returns:
        ``{"fits", "tight", "rank", "need_bytes", "peak_bytes", "slack_bytes", "outside_bytes", "margin_bytes",
        "capacity_bytes", "headroom_bytes", "prediction"}`` (``prediction``: that rank's :func:`predict_peak`;
        ``margin_bytes``: the prediction error margin, ``ceil(peak_bytes * PREDICTION_UNDER_SHARE)``; ``tight``:
        fits, the margin in, by less than :data:`TIGHT_SHARE` of the peak).
    """
    simulated = int((cfg["actor"].get("simulate") or {}).get("rank", -1))
    if simulated >= 0:
        ranks = [simulated]
    else:
        ranks = [next(r for r in range(layout.world_size) if layout.rank_coords(r).get("pp", 0) == stage)
                 for stage in range(layout.pp)]
    preds = [(r, predict_peak(cfg, hf, layout, layout.rank_coords(r), seq_len)) for r in ranks]
    rank, pred = max(preds, key=lambda rp: rp[1]["peak_bytes"])
    slack = 0 if expandable_segments(alloc_conf) else _largest_block(cfg, hf, layout, seq_len)
    outside = int((OUTSIDE_PYTORCH_GIB_SIMULATED if simulated >= 0 else outside_pytorch_gib(versions)) * _GIB)
    margin = math.ceil(pred["peak_bytes"] * PREDICTION_UNDER_SHARE)
    need = pred["peak_bytes"] + slack + outside + margin
    return {"fits": need <= capacity_bytes, "tight": 0 <= capacity_bytes - need < TIGHT_SHARE * pred["peak_bytes"],
            "rank": rank, "need_bytes": need, "peak_bytes": pred["peak_bytes"], "slack_bytes": slack,
            "outside_bytes": outside, "margin_bytes": margin, "capacity_bytes": int(capacity_bytes),
            "headroom_bytes": int(capacity_bytes) - need, "prediction": pred}


def fit_text(fit: dict[str, Any], brief: bool = False, source: str | None = None) -> str:
    """One check of :func:`check_fit` in words (the driver's fit check, a what-if's fit gate): the rank's need
    against the capacity, the capacity's ``source`` in brackets after it when given (``brief``: the predicted peak
    and the need alone)."""
    g = 2**30
    pred = fit["prediction"]
    notes = [source] if source else []
    if not fit["fits"] and f"{fit['need_bytes'] / g:.2f}" == f"{fit['capacity_bytes'] / g:.2f}":
        notes.append(f"{-fit['headroom_bytes'] / 2**20:.0f} MiB over")  # the rounding would hide the excess
    need = f"{fit['need_bytes'] / g:.2f} of {fit['capacity_bytes'] / g:.2f} GiB" + (
        f" ({'; '.join(notes)})" if notes else "")
    if brief:
        return (f"predicted peak {fit['peak_bytes'] / g:.2f} GiB allocated in the {pred['phase']}, needs {need}"
                + (", tight" if fit["tight"] else ""))
    parts = ", ".join(f"{r['category']} {r['bytes'] / g:.2f}" for r in pred["rows"])
    return (f"rank {fit['rank']} needs {need}: predicted "
            f"peak {fit['peak_bytes'] / g:.2f} GiB allocated in the {pred['phase']} ({parts}) + allocator slack "
            f"{fit['slack_bytes'] / g:.2f} + outside PyTorch {fit['outside_bytes'] / g:.2f} + prediction error margin "
            f"{fit['margin_bytes'] / g:.2f}"
            + (f"; tight: less headroom beyond the margin than {TIGHT_SHARE:.0%} of the peak" if fit["tight"] else ""))


def with_settings(cfg: dict[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with the config keys of ``settings`` set (environment settings left out)."""
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        if key.startswith(ENV):
            continue
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def fitting_changes(cfg: dict[str, Any], hf_for: HfLoader, layout: Layout, seq_len: int, capacity_bytes: int,
                    alloc_conf: Optional[str], versions: Optional[Mapping[str, Any]] = None,
                    conf_var: str = ALLOC_CONF) -> list[dict[str, Any]]:
    """The changes that make the worst rank fit, smallest first (module docstring): each ``{"settings": {key:
    value}, "check": check_fit(...)}`` (``versions`` as there); empty when none of them fits. ``conf_var``: the
    variable ``alloc_conf`` came from (:func:`alloc_conf_of`), the one expandable segments are proposed in.

    ``hf_for(n)``: the model config cut to ``n`` layers (the trial's is ``cfg``'s ``actor.num_layers``).
    """
    layers = int(cfg["actor"].get("num_layers") or 0) or hf_for(0).num_hidden_layers
    hf = hf_for(layers)
    loss = cfg["actor"].get("loss") or {}
    m = cfg["actor"].get("megatron") or {}
    steps: list[dict[str, Any]] = []
    if not expandable_segments(alloc_conf):
        steps.append({ENV + conf_var: with_expandable(alloc_conf)})
    if not chunked_lm_head(cfg):
        chunk: dict[str, Any] = {"actor.loss.lm_head_loss_chunk_size": LM_HEAD_CHUNK}
        if loss.get("path", "auto") != "auto":
            chunk["actor.loss.path"] = "lm_head"
        steps.append(chunk)
    if len(steps) == 2:
        steps.append({**steps[0], **steps[1]})
    base = steps[-1] if steps else {}
    now = {"actor.gradient_checkpointing": cfg["actor"].get("gradient_checkpointing", True),
           **{f"actor.megatron.{k}": m.get(k, v) for k, v in
              (("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 1))}}
    full = dict(zip(now, (True, "full", "uniform", 1)))
    if now != full:
        steps.append({**base, **{k: v for k, v in full.items() if now[k] != v}})
        base = steps[-1]

    def verdict(settings: dict[str, Any], n_layers: int = layers, tokens: int = seq_len) -> dict[str, Any]:
        conf = settings.get(ENV + conf_var, alloc_conf)
        return check_fit(with_settings(cfg, settings), hf if n_layers == layers else hf_for(n_layers), layout, tokens,
                         capacity_bytes, conf, versions)

    out = [{"settings": st, "check": c} for st in steps if (c := verdict(st))["fits"]]
    for extra in ({}, base) if base else ({},):  # fewer tokens, fewer layers: alone, else with the changes above
        found: list[dict[str, Any]] = []
        tokens = seq_len // 2
        while tokens >= MIN_TOKENS and tokens % layout.cp == 0:
            settings = {**extra, "profile.fake_seq_len": tokens}
            if (check := verdict(settings, tokens=tokens))["fits"]:
                found.append({"settings": settings, "check": check})
                break
            tokens //= 2
        step = layout.pp * (getattr(hf, "full_attention_interval", None) or 1)
        for n in range(layers - step, 0, -step):
            settings = {**extra, "actor.num_layers": n}
            if (check := verdict(settings, n_layers=n))["fits"]:
                found.append({"settings": settings, "check": check})
                break
        if found:
            out += found
            break
    kept: list[dict[str, Any]] = []  # a change holding an earlier fitting change's settings is no smaller step
    for c in out:
        if not any(k["settings"].items() <= c["settings"].items() for k in kept):
            kept.append(c)
    return kept
