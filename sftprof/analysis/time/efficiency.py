"""Kernel efficiency of a step: achieved FLOP/s of the FLOP-counted ops (:mod:`sftprof.analysis.time.op_flops`) by
kind, model part, phase and dtype against the device's dense bf16 peak, and the bandwidth of copies and fills
against its HBM bandwidth.

An activity's op is the innermost op with a known FLOP count that contains its launch point; an op's GPU time is
the sum of its activities' durations.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import numpy as np

from sftprof.analysis.time.gpu_activity import column_rows
from sftprof.analysis.time.model_parts import part_label
from sftprof.analysis.trace.op_collector import OpCollector, Placement
from sftprof.analysis.time.op_flops import CORE_PART
from sftprof.analysis.schema import ms
from sftprof.analysis.time.schema import DevicePeaks, Efficiency, EfficiencyRow, MemoryBoundRow
from sftprof.artifacts import MODEL_PART_LABELS
from sftprof.flops import gpu_peak_bf16_flops

__all__ = ["kernel_efficiency", "device_peaks", "PEAK_HBM_BYTES_PER_S"]

# HBM bandwidth in bytes/s from NVIDIA's H100 SXM / H200 datasheets (first match in order).
PEAK_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12}


def device_peaks(device_name: Optional[str]) -> DevicePeaks:
    """Stated peaks of a GPU by name: dense bf16 FLOP/s (``sftprof/flops.py``) and HBM bytes/s."""
    if not device_name:
        return {"device": None, "bf16_flops": None, "hbm_bytes_per_s": None}
    hbm = next((v for k, v in PEAK_HBM_BYTES_PER_S.items() if k in device_name), None)
    return {"device": device_name, "bf16_flops": gpu_peak_bf16_flops(device_name), "hbm_bytes_per_s": hbm}


def kernel_efficiency(ops: OpCollector, place: Placement, *, tids: np.ndarray, pts: np.ndarray, dur: np.ndarray,
                      inside: np.ndarray, kinds: np.ndarray, names: list[str], name_idx: np.ndarray, nbytes: np.ndarray,
                      device_name: Optional[str]) -> Efficiency:
    """Rates of the FLOP-counted ops and of the copies and fills launched in the step window (module docstring).

    Args:
        place: each GPU activity's part and phase; tids, pts: its launch thread and time (us, NaN: unknown);
        dur: its duration (us); inside: launched in the step window; kinds: index into
        :data:`sftprof.analysis.time.gpu_activity.GPU_ACTIVITY_CATS` (0: kernel); names, name_idx: the distinct
        names and each activity's index into them (int32); nbytes: bytes of a copy or fill (0 when not given);
        device_name: the trace's GPU (its peaks: :func:`device_peaks`).
    """
    parts, phases = place.parts, place.phases
    peaks = device_peaks(device_name)
    op_idx = ops.flop_op_of(tids, pts)
    per_op: dict[int, float] = defaultdict(float)
    op_part: dict[int, tuple[str, str]] = {}
    timed = np.flatnonzero(inside & (op_idx >= 0) & (kinds == 0))
    for i, op in column_rows(timed, op_idx[timed]):
        per_op[op] += dur[i]
        if op not in op_part:
            op_part[op] = (parts.at(i), phases.at(i))
    rows: dict[tuple[str, str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for k, us in per_op.items():
        name, kind, flops, dtype = ops.flop_info(k)
        part, phase = op_part[k]
        if kind.endswith(" backward"):
            kind, phase = kind.removesuffix(" backward"), "backward"
        label = part_label(part)
        if kind in CORE_PART and part not in MODEL_PART_LABELS:
            label = MODEL_PART_LABELS[CORE_PART[kind]]
        elif part.startswith("kernel:"):
            label = "GEMM (by kernel name)"
        r = rows[(kind, label, phase, dtype)]
        r[0] += flops
        r[1] += us
        r[2] += 1
    peak = peaks["bf16_flops"]
    out_rows: list[EfficiencyRow] = []
    for (kind, part, phase, dtype), (flops, us, calls) in sorted(rows.items(), key=lambda kv: (-kv[1][1], kv[0])):
        rate = flops / (us * 1e-6) if us > 0 else None
        low_precision = dtype in ("BFloat16", "Half")
        out_rows.append({"kind": kind, "part": part, "phase": phase, "dtype": dtype, "calls": int(calls),
                         "tflop": round(flops / 1e12, 6), "gpu_ms": ms(us),
                         "tflops_per_s": round(rate / 1e12, 3) if rate else None,
                         "pct_of_peak": round(100 * rate / peak, 2) if rate and peak and low_precision else None})
    # Memory-bound: copies and fills, whose events carry their byte count.
    mem: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for i in np.flatnonzero(inside & (kinds != 0) & (nbytes > 0)):
        m = mem[names[name_idx[i]]]
        m[0] += nbytes[i]
        m[1] += dur[i]
        m[2] += 1
    bw = peaks["hbm_bytes_per_s"]
    mem_rows: list[MemoryBoundRow] = [{"name": k, "calls": int(c), "gib": round(b / 2**30, 4), "gpu_ms": ms(us),
                 "gb_per_s": round(b / (us * 1e-6) / 1e9, 2) if us > 0 else None,
                 "pct_of_hbm": round(100 * b / (us * 1e-6) / bw, 2) if us > 0 and bw else None}
                for k, (b, us, c) in sorted(mem.items(), key=lambda kv: (-kv[1][1], kv[0]))]
    return {"peak": peaks, "rows": out_rows, "memory_bound": mem_rows,
            "note": "attention backward FLOPs = 2x forward (model FLOPs; fused kernels do 2.5x), as are linear "
                    "attention's (fla's chunked gated delta rule, chunks of 64 tokens; its kernels do about 2.8x); "
                    "% of peak only for bf16/fp16 ops, against the dense bf16 peak; memory-bound rows: bytes "
                    "moved by copies/fills over their time, against the HBM bandwidth (a device-to-device copy "
                    "reads and writes each byte, so its HBM traffic is twice the bytes shown)"}
