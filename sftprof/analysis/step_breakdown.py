"""What a kernel-trace step spent its GPU time on: model parts per layer, kernel efficiency, collectives.

Fed by :class:`sftprof.analysis.trace_summary.KernelTraceAnalyzer` (one streaming pass): every CPU op,
``sftprof.module/*`` range (:mod:`sftprof.capture.module_regions`), forward->backward flow
(``fwdbwd``) and CUDA runtime call goes to :meth:`OpCollector.add`; :meth:`OpCollector.analyze` then
receives the GPU activities.

Attribution of one GPU activity (kernel, memcpy, memset) launched inside the step window (an activity whose
launching CUDA call is not in the trace, as in a trace cut to an excerpt or one whose host records were dropped,
counts as launched inside it when it starts inside it: it ran in the step, and its part is then unknown):

1. Its launch point is the CUDA runtime call with the same ``correlation`` id (thread, start time).
2. The innermost interval on that thread that contains the launch point, among the model-part ranges
   and the autograd backward nodes (``autograd::engine::evaluate_function: ...`` ops), decides:
   a model-part range gives its part and layer, phase ``forward`` or ``recompute`` (its name says which);
   a backward node gives phase ``backward`` and the part and layer of the range that contained the
   forward op that created the node (the profiler's ``fwdbwd`` flow links that op to the node's
   ``XBackward`` op inside the ``evaluate_function`` op).
3. Otherwise: ``optimizer`` inside ``sftprof/optimizer_step``; NCCL kernels outside every part are
   ``communication outside model parts`` (gradient reduce-scatter, parameter all-gather); the rest is
   ``outside model parts``.

Traces without model-part ranges (recorded before they existed) are split by kernel name
(:func:`sftprof.analysis.kernel_names.kernel_category`) and say so (``source: kernel_name``).

Every activity launched in the window lands in exactly one (part, layer, phase) cell, so the cells sum
to the step's GPU time (sum of activity durations, all streams; overlapping streams count twice, as in
the category table).

FLOP rates (:func:`op_flops`): an activity's op is the innermost op with a known FLOP count that
contains its launch point; an op's GPU time is the sum of its activities' durations. Counting rules:
a GEMM ``[m, k] x [k, n]`` costs ``2 m k n`` (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``,
``_grouped_mm``); scaled-dot-product attention forward costs ``4 b h d P`` with ``P`` the query-key
pairs computed (:func:`attention_pairs`; causal top-left as torch's ``is_causal``, lower-right for the
flash kernels and ``custom_mask_type=2``, which context-parallel chunks use), as in ``sftprof/flops.py``; its backward is counted as 2x the forward (the model-FLOPs convention of
``sftprof/flops.py``; the fused kernels also recompute ``Q K^T``, 2.5x in hardware work). Masked
attention (an explicit ``attn_mask``) has no FLOP count here.

GPU idle waiting for the host (:func:`_idle_split`, :func:`_host_wait_places`): each host-wait gap goes to the
place of the activity that ends it, its (part, layer summed, phase) from the attribution above and the innermost
named op around its launch (an autograd Function's forward or a backward node, :meth:`OpCollector.launch_sites`),
and counts as after a blocking call when a blocking CUDA call ended inside it before that launch.

Bus bandwidth of a collective follows NCCL's performance notes (nccl-tests ``PERFORMANCE.md``):
``algbw = S / t`` with ``S`` the larger of the input and output message sizes, ``busbw = algbw * f``
with ``f = 2 (n - 1) / n`` for all-reduce, ``(n - 1) / n`` for all-gather, reduce-scatter and
all-to-all, 1 otherwise, ``n`` the process-group size.
"""
from __future__ import annotations

import re
from array import array
from collections import defaultdict
from typing import Any, Optional

import numpy as np

from sftprof.analysis import comm_wait, intervals
from sftprof.flops import gpu_peak_bf16_flops
from sftprof.artifacts import MODEL_PART_LABELS, MODEL_PARTS, MODULE_REGION_PREFIX, parse_module_region

__all__ = ["OpCollector", "BWD_NODE", "parts_tables", "analyze", "op_flops", "attention_pairs", "bus_factor", "plot_parts", "part_label",
           "exposed_groups", "OUTSIDE_WINDOW", "device_peaks", "PEAK_HBM_BYTES_PER_S", "PHASES", "LAUNCH_GAP_US",
           "TOP_IDLE_PLACES"]

BWD_NODE = "autograd::engine::evaluate_function: "
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cudaMemcpy2D")  # blocking calls: the host waits for the device
# HBM bandwidth in bytes/s from NVIDIA's H100 SXM / H200 datasheets (first match in order).
PEAK_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12}
_DTYPE_BYTES = {"BFloat16": 2, "Half": 2, "Float": 4, "Double": 8, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
                "Int": 4, "Long": 8, "Char": 1, "Byte": 1, "Bool": 1}
_GEMMS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
          "aten::_grouped_mm": (0, 1)}
# attention op -> (index of q, index of k, index in Concrete Inputs of the causal flag, index of an explicit
# mask/bias or None, backward?, layout of q/k, what the causal flag means). Layouts: "bhsd" = [b, h, s, d],
# "bshd" = [b, s, h, d]. Causal kinds: "top_left" (torch's is_causal), "lower_right" (the flash kernels'
# causal, which CausalBias(LOWER_RIGHT) uses for context-parallel chunks), "mask_type" (xformers-style
# custom_mask_type: 0 none, 1 top-left, 2 lower-right).
_ATTENTION = {
    "aten::scaled_dot_product_attention": (0, 1, 5, 3, False, "bhsd", "top_left"),
    "aten::_scaled_dot_product_flash_attention": (0, 1, 4, None, False, "bhsd", "lower_right"),
    "aten::_scaled_dot_product_efficient_attention": (0, 1, 6, 3, False, "bhsd", "top_left"),
    "aten::_scaled_dot_product_cudnn_attention": (0, 1, 6, 3, False, "bhsd", "top_left"),
    "aten::_efficient_attention_forward": (0, 1, 9, 3, False, "bshd", "mask_type"),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 2, 11, None, True, "bhsd", "lower_right"),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 2, 11, 4, True, "bhsd", "top_left"),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 2, 14, 8, True, "bhsd", "top_left"),
    "aten::_efficient_attention_backward": (1, 2, 14, 4, True, "bshd", "mask_type"),
}


# Transformer Engine's autograd Functions (TE 2.x): their forward ops carry the input dims; their backward nodes
# (``<name>Backward``) only the output gradient's, so a backward node's FLOPs are 2x those of the forward op the
# profiler's fwdbwd flow links it to. ``FusedAttnFunc`` is TE's fused attention without context parallelism, q/k in
# megatron-core's ``sbhd`` layout ([s, b, h, d]), causal (megatron-core's GPT attention mask).
_TE_FORWARD = ("FusedAttnFunc", "_Linear", "_LayerNormLinear", "_GroupedLinear", "RouterGatingLinearFunction")
_TE_BACKWARD = {f"{n}Backward": n for n in _TE_FORWARD}


def attention_pairs(sq: int, sk: int, causal: bool, lower_right: bool = False) -> int:
    """Query-key pairs one head computes: ``sq * sk``; causal top-left (query ``i`` sees keys ``j <= i``):
    ``sum_i min(i + 1, sk)``; causal lower-right (``j <= i + sk - sq``): ``sum_i clamp(i + 1 + sk - sq, 0, sk)``."""
    if not causal:
        return sq * sk
    shift = sk - sq if lower_right else 0
    # sum over i in [0, sq) of clamp(i + 1 + shift, 0, sk), in closed form per linear piece
    lo = max(0, -shift)  # first query that sees any key: i + 1 + shift >= 1
    hi = min(sq, max(sk - shift, 0))  # queries with i + 1 + shift <= sk see a prefix
    total = 0
    if hi > lo:
        a, b = lo + 1 + shift, hi + shift  # arithmetic series a..b
        total += (a + b) * (hi - lo) // 2
    total += max(sq - max(hi, lo), 0) * sk
    return total


def _te_linear_flops(name: str, dims: list) -> Optional[float]:
    """FLOPs of a Transformer Engine linear's forward op (:data:`_TE_FORWARD`) from its recorded input dims:
    ``2 M K N`` with the input ``[..., K]`` (``M`` its other dims) and each weight ``[N, K]`` (a grouped linear's
    ``N`` is the same for every expert and its ``M`` the tokens of all experts)."""
    inp, weights = (dims[1], dims[:1]) if name == "_Linear" else (dims[0], dims[1:])
    if not isinstance(inp, list) or len(inp) < 2:
        return None
    k, m = inp[-1], float(np.prod(inp[:-1]))
    shapes = {tuple(w) for w in weights if isinstance(w, list) and len(w) == 2 and w[1] == k}
    if len(shapes) != 1:
        return None
    return 2.0 * m * k * next(iter(shapes))[0]


def op_flops(name: str, args: dict) -> Optional[tuple[str, float, str]]:
    """``(kind, FLOPs, dtype)`` of one recorded op (``record_shapes``), or None when unknown.

    ``kind`` is ``GEMM``, ``attention`` or ``attention backward``; rules in the module docstring.
    """
    dims, types = args.get("Input Dims"), args.get("Input type") or []
    if not isinstance(dims, list):
        return None
    dtype = next((t for t in types if isinstance(t, str) and t and t not in ("Scalar", "ScalarList", "")), "?")
    dtype = dtype.replace("c10::", "")
    try:
        if name in _TE_FORWARD:
            if name == "FusedAttnFunc":
                q, k = dims[0], dims[1]
                if len(q) != 4 or len(k) != 4:
                    return None  # thd (packed sequences): the pairs need cu_seqlens
                sq, b, h, d = q
                return "attention", 4.0 * b * h * d * attention_pairs(sq, k[0], causal=True), dtype
            f = _te_linear_flops(name, dims)
            return ("GEMM", f, dtype) if f else None
        if name in _GEMMS:
            ia, ib = _GEMMS[name]
            a, b = dims[ia], dims[ib]
            if name == "aten::_grouped_mm":
                if len(a) == 2 and len(b) == 3:  # [M, K] x [G, K, N]
                    return "GEMM", 2.0 * a[0] * a[1] * b[2], dtype
                if len(a) == 2 and len(b) == 2:  # [K, M] x [M, N] grouped over M (weight gradients)
                    return "GEMM", 2.0 * a[0] * a[1] * b[1], dtype
                if len(a) == 3 and len(b) == 3:  # batched [G, M, K] x [G, K, N]
                    return "GEMM", 2.0 * a[0] * a[1] * a[2] * b[2], dtype
                return None
            if len(a) == 2 and len(b) == 2:
                return "GEMM", 2.0 * a[0] * a[1] * b[1], dtype
            if len(a) == 3 and len(b) == 3:
                return "GEMM", 2.0 * a[0] * a[1] * a[2] * b[2], dtype
            return None
        if name in _ATTENTION:
            iq, ik, ic, im, bwd, layout, kind = _ATTENTION[name]
            q, k = dims[iq], dims[ik]
            concrete = args.get("Concrete Inputs") or []
            if im is not None and im < len(dims) and dims[im]:
                return None  # explicit mask or bias: pairs unknown
            if len(q) != 4 or len(k) != 4 or ic >= len(concrete):
                return None
            flag = concrete[ic]
            if kind == "mask_type":
                if flag not in ("0", "1", "2"):
                    return None
                causal, lower_right = flag != "0", flag == "2"
            elif flag in ("True", "False"):
                causal, lower_right = flag == "True", kind == "lower_right"
            else:
                return None
            if layout == "bhsd":
                b, h, sq, d = q
                sk = k[2]
            else:
                b, sq, h, d = q
                sk = k[1]
            fwd = 4.0 * b * h * d * attention_pairs(sq, sk, causal, lower_right)
            return ("attention backward", 2 * fwd, dtype) if bwd else ("attention", fwd, dtype)
    except (TypeError, IndexError, ValueError):
        return None
    return None


def bus_factor(collective: str, n: int) -> float:
    """NCCL bus-bandwidth factor of a collective over ``n`` ranks (module docstring)."""
    c = collective.lower()
    if n <= 1:
        return 0.0
    if "all_reduce" in c or "allreduce" in c:
        return 2.0 * (n - 1) / n
    if any(x in c for x in ("all_gather", "allgather", "reduce_scatter", "reducescatter", "all_to_all", "alltoall")):
        return (n - 1) / n
    return 1.0


def _collective_name(name: str) -> str:
    return re.sub(r"(_into_tensor|_tensor)?(_coalesced|_base)?$", "", name.replace("nccl:", "").replace("gloo:", ""))


class _Intervals:
    """Per-thread intervals (start, end, payload) with an innermost-containment query."""

    def __init__(self) -> None:
        self.tid = array("q")
        self.start = array("d")
        self.end = array("d")
        self.payload = array("q")

    def add(self, tid: int, start: float, end: float, payload: int) -> None:
        self.tid.append(tid)
        self.start.append(start)
        self.end.append(end)
        self.payload.append(payload)

    def innermost(self, tids: np.ndarray, points: np.ndarray) -> np.ndarray:
        """Index (into this collection) of the innermost interval containing each point, -1 if none.

        Intervals on one thread nest (ranges and ops of one thread do); ties at equal starts put the
        longer interval outside.
        """
        out = np.full(points.size, -1, dtype=np.int64)
        if not len(self.start) or not points.size:
            return out
        itid = np.frombuffer(self.tid, dtype=np.int64)
        ist, ien = np.frombuffer(self.start, dtype=np.float64), np.frombuffer(self.end, dtype=np.float64)
        for t in np.unique(tids):
            sel = np.flatnonzero(itid == t)
            if not sel.size:
                continue
            order = sel[np.lexsort((-ien[sel], ist[sel]))]
            pts = np.flatnonzero(tids == t)
            pts = pts[np.argsort(points[pts], kind="stable")]
            stack: list[int] = []
            j = 0
            for p in pts:
                x = points[p]
                while j < order.size and ist[order[j]] <= x:
                    while stack and ien[stack[-1]] < ist[order[j]]:
                        stack.pop()
                    stack.append(int(order[j]))
                    j += 1
                while stack and ien[stack[-1]] < x:
                    stack.pop()
                if stack:
                    out[p] = stack[-1]
        return out


class OpCollector:
    """Collects the CPU side of a trace for :meth:`analyze` (module docstring)."""

    def __init__(self) -> None:
        self.regions = _Intervals()  # model-part ranges; payload: index into _region_keys
        self._region_keys: list[tuple[str, Optional[int], bool]] = []
        self._region_index: dict[str, int] = {}
        self.bwd_nodes = _Intervals()  # payload: 1 for megatron-core's CheckpointFunctionBackward
        self.flop_ops = _Intervals()  # payload: index into _flop_info
        self._flop_info: list[tuple[str, str, float, str]] = []  # (op name, kind, flops, dtype)
        self._launch: dict[int, tuple[int, float]] = {}  # correlation -> (tid, ts)
        self._flow_start: dict[int, tuple[int, float]] = {}  # fwdbwd id -> forward op (tid, ts)
        self._flow_end: dict[tuple[int, float], int] = {}  # autograd node op (tid, ts) -> fwdbwd id
        self.comm_ops: dict[int, dict] = {}  # External id -> collective, group ref, size, bytes
        self.sync_calls: list[tuple[str, float, float, int]] = []  # blocking CUDA runtime calls: (name, start, end, tid)
        self.cpu_ops = _Intervals()  # every cpu_op for self time; payload: name index
        self.compile_spans: list[tuple[int, float, float]] = []  # torch.compile's own ops: (tid, start, end)
        self.compile_ids: list[tuple[float, str]] = []  # (ts, dynamo compile id "frame/attempt") from annotations
        self._op_names: dict[str, int] = {}
        self.op_name_list: list[str] = []
        self._te_forward: dict[tuple[int, float], int] = {}  # TE forward op (tid, ts) -> index into _flop_info
        self._te_backward: list[tuple[str, int, float, float]] = []  # TE backward node ops: (name, tid, ts, dur)

    def add(self, ev: dict, ts: float, dur: float) -> None:
        """Consume one complete (``ph: X``) or flow event with a valid ``ts`` (and ``dur`` for X)."""
        cat = ev.get("cat")
        tid = ev.get("tid")
        tid = tid if isinstance(tid, int) and not isinstance(tid, bool) else -1
        if cat == "cpu_op":
            name = ev.get("name") or ""
            idx = self._op_names.get(name)
            if idx is None:
                idx = self._op_names[name] = len(self.op_name_list)
                self.op_name_list.append(name)
            self.cpu_ops.add(tid, ts, ts + dur, idx)
            if name == "dynamo" or name.endswith(" (dynamo_timed)"):
                self.compile_spans.append((tid, ts, ts + dur))
            if name.startswith(BWD_NODE):
                self.bwd_nodes.add(tid, ts, ts + dur, int(name.endswith("CheckpointFunctionBackward")))
                return
            args = ev.get("args") or {}
            if name in _GEMMS or name in _ATTENTION or name in _TE_FORWARD:
                f = op_flops(name, args)
                if f is not None:
                    if name in _TE_FORWARD:
                        self._te_forward[(tid, ts)] = len(self._flop_info)
                    self.flop_ops.add(tid, ts, ts + dur, len(self._flop_info))
                    self._flop_info.append((name, *f))
            elif name in _TE_BACKWARD:
                self._te_backward.append((name, tid, ts, dur))
            if "Collective name" in args:
                ext = args.get("External id")
                if isinstance(ext, int):
                    nel = [v for v in (args.get("In msg nelems"), args.get("Out msg nelems")) if isinstance(v, int)]
                    size = args.get("Group size")
                    self.comm_ops[ext] = {"collective": _collective_name(str(args["Collective name"])),
                                          "pg": (args.get("Process Group Description"), args.get("Process Group Name")),
                                          "group_size": size if isinstance(size, int) else None,
                                          "bytes": max(nel) * _DTYPE_BYTES[args["dtype"]]
                                          if nel and args.get("dtype") in _DTYPE_BYTES else None}
        elif cat == "user_annotation":
            name = ev.get("name") or ""
            if name.startswith("dynamo_data: compile_id="):
                self.compile_ids.append((ts, name.split("=", 1)[1]))
            if name.startswith(MODULE_REGION_PREFIX):
                idx = self._region_index.get(name)
                if idx is None:
                    key = parse_module_region(name)
                    if key is None:
                        return
                    idx = self._region_index[name] = len(self._region_keys)
                    self._region_keys.append(key)
                self.regions.add(tid, ts, ts + dur, idx)
        elif cat in ("cuda_runtime", "cuda_driver"):
            args = ev.get("args") or {}
            corr = args.get("correlation")
            if isinstance(corr, int) and not isinstance(corr, bool):
                self._launch[corr] = (tid, ts)
            if ev.get("name") in _SYNC_CALLS:
                self.sync_calls.append((ev["name"], ts, ts + dur, tid))
        elif cat == "fwdbwd":
            fid = ev.get("id")
            if isinstance(fid, (int, str)):
                if ev.get("ph") == "s":
                    self._flow_start[hash(fid)] = (tid, ts)
                elif ev.get("ph") == "f":
                    self._flow_end[(tid, ts)] = hash(fid)

    def op_index(self, name: str) -> Optional[int]:
        """Index of a CPU op name in :attr:`op_name_list` (the payload of :attr:`cpu_ops`), None when not seen."""
        return self._op_names.get(name)

    @property
    def has_regions(self) -> bool:
        return bool(self._region_keys)

    # -- analysis ---------------------------------------------------------------------------------
    def launch_points(self, corr: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tid, ts) of each activity's launch call; tid -1 / ts NaN when the call is not in the trace."""
        tids = np.full(len(corr), -1, dtype=np.int64)
        pts = np.full(len(corr), np.nan)
        for i, c in enumerate(corr):
            hit = self._launch.get(c)
            if hit is not None:
                tids[i], pts[i] = hit
        return tids, pts

    def attribute(self, tids: np.ndarray, pts: np.ndarray, cats: list[str], in_optimizer: np.ndarray,
                  is_comm: np.ndarray) -> tuple[list[str], list[Optional[int]], list[str], str]:
        """(part, layer, phase) per activity and the source (``module_regions`` or ``kernel_name``)."""
        n = pts.size
        parts: list[str] = ["outside_parts"] * n
        layers: list[Optional[int]] = [None] * n
        phases: list[str] = ["other"] * n
        valid = ~np.isnan(pts)
        safe = np.where(valid, pts, -np.inf)
        node = self.bwd_nodes.innermost(tids, safe)
        if not self.has_regions:
            # Phase without ranges: inside a backward node is backward, except directly inside megatron-core's
            # CheckpointFunctionBackward, which re-runs the forward (full recompute).
            ckpt = np.frombuffer(self.bwd_nodes.payload, dtype=np.int64)
            for i in range(n):
                b = int(node[i])
                parts[i] = "optimizer" if in_optimizer[i] else f"kernel:{cats[i]}"
                phases[i] = ("optimizer" if in_optimizer[i] else "forward" if b < 0 and valid[i] else
                             "recompute" if b >= 0 and ckpt[b] else "backward" if b >= 0 else "other")
            return parts, layers, phases, "kernel_name"
        reg = self.regions.innermost(tids, safe)
        rst = np.frombuffer(self.regions.start, dtype=np.float64)
        rpay = np.frombuffer(self.regions.payload, dtype=np.int64)
        nst = np.frombuffer(self.bwd_nodes.start, dtype=np.float64)
        # Forward op of each backward node: the flow ending inside the node (at its XBackward op) starts at
        # the forward op; the model-part range containing that op gives the part.
        fwd_key: dict[int, int] = {}
        ends = [(t, x, fid) for (t, x), fid in self._flow_end.items() if fid in self._flow_start]
        f_tids, f_pts, f_nodes = [], [], []
        if ends:
            owner = self.bwd_nodes.innermost(np.array([e[0] for e in ends], dtype=np.int64),
                                             np.array([e[1] for e in ends], dtype=np.float64))
            seen: set[int] = set()
            for (_, _, fid), j in zip(ends, owner):
                if j >= 0 and int(j) not in seen:
                    seen.add(int(j))
                    f_tids.append(self._flow_start[fid][0])
                    f_pts.append(self._flow_start[fid][1])
                    f_nodes.append(int(j))
        if f_nodes:
            at = self.regions.innermost(np.asarray(f_tids, dtype=np.int64), np.asarray(f_pts, dtype=np.float64))
            fwd_key = {j: int(rpay[r]) for j, r in zip(f_nodes, at) if r >= 0}
        for i in range(n):
            r, b = int(reg[i]), int(node[i])
            if r >= 0 and (b < 0 or rst[r] >= nst[b]):  # a range inside the node (recompute in backward) wins
                part, layer, rec = self._region_keys[int(rpay[r])]
                phases[i] = "recompute" if rec else "forward"
            elif b >= 0:
                phases[i] = "backward"
                k = fwd_key.get(b)
                if k is None:
                    parts[i] = "optimizer" if in_optimizer[i] else "comm_outside" if is_comm[i] else "outside_parts"
                    continue
                part, layer, _ = self._region_keys[k]
            else:
                parts[i] = "optimizer" if in_optimizer[i] else "comm_outside" if is_comm[i] else "outside_parts"
                if in_optimizer[i]:
                    phases[i] = "optimizer"
                continue
            if part == "attn_other" and cats[i] == "attention":
                part = "attn_core"  # Hugging Face attention: the core is a function inside the attention module
            parts[i], layers[i] = part, layer
        return parts, layers, phases, "module_regions"

    def launch_sites(self, tids: np.ndarray, pts: np.ndarray) -> list[Optional[str]]:
        """Name of the innermost named op around each launch point (None when there is none).

        A named op is a CPU op whose name is not a library op (no ``::``, so ``aten::*`` is left out): a
        custom autograd Function's forward (``_VocabParallelLogprobs``, ``CheckpointFunction``), an autograd
        node in backward (``_VocabParallelLogprobsBackward``, ``MulBackward0``; a node's
        ``autograd::engine::evaluate_function: X`` op counts as ``X``), ``record_param_comms`` ...

        Args:
            tids, pts: launch thread (int64) and launch time (us, NaN when unknown) per activity, as
                :meth:`launch_points` gives them.
        """
        named = _Intervals()
        c = self.cpu_ops
        labels = [n[len(BWD_NODE):] if n.startswith(BWD_NODE) else n if "::" not in n else None
                  for n in self.op_name_list]
        for k in range(len(c.start)):
            if labels[c.payload[k]] is not None:
                named.add(c.tid[k], c.start[k], c.end[k], c.payload[k])
        at = named.innermost(tids, np.where(np.isnan(pts), -np.inf, pts))
        pay = np.frombuffer(named.payload, dtype=np.int64) if len(named.payload) else np.zeros(0, dtype=np.int64)
        return [labels[int(pay[j])] if j >= 0 else None for j in at]

    def blocking_calls(self) -> tuple[np.ndarray, list[str]]:
        """End times (us, sorted) of the blocking CUDA calls and, for each, the innermost CPU op on its
        thread around it (``aten::nonzero``, ``aten::_local_scalar_dense``; the call's own name when it
        was made outside every op)."""
        if not self.sync_calls:
            return np.zeros(0), []
        calls = sorted(self.sync_calls, key=lambda s: s[2])
        at = self.cpu_ops.innermost(np.array([s[3] for s in calls], dtype=np.int64),
                                    np.array([s[1] for s in calls], dtype=np.float64))
        pay = np.frombuffer(self.cpu_ops.payload, dtype=np.int64)
        return (np.array([s[2] for s in calls], dtype=np.float64),
                [self.op_name_list[int(pay[j])] if j >= 0 else s[0] for s, j in zip(calls, at)])

    def _link_te_backward(self) -> None:
        """Give each TE backward node op 2x the FLOPs of the forward op its fwdbwd flow starts at (once, after the
        pass: flows and ops arrive in any order); nodes without a linked forward op stay without FLOPs."""
        for name, tid, ts, dur in self._te_backward:
            start = self._flow_start.get(self._flow_end.get((tid, ts)))
            k = self._te_forward.get(start) if start is not None else None
            if k is None:
                continue
            _, kind, flops, dtype = self._flop_info[k]
            self.flop_ops.add(tid, ts, ts + dur, len(self._flop_info))
            self._flop_info.append((name, "attention backward" if kind == "attention" else kind, 2 * flops, dtype))
        self._te_backward = []

    def flop_op_of(self, tids: np.ndarray, pts: np.ndarray) -> np.ndarray:
        """Index into the FLOP-known ops (innermost containing the launch point), -1 when none."""
        self._link_te_backward()
        return self.flop_ops.innermost(tids, np.where(np.isnan(pts), -np.inf, pts))

    def flop_info(self, k: int) -> tuple[str, str, float, str]:
        return self._flop_info[int(np.frombuffer(self.flop_ops.payload, dtype=np.int64)[k])]

    def self_times(self, lo: float, hi: float, top: int) -> list[dict]:
        """CPU ops in [lo, hi] by self time (own time minus the ops nested directly in it), top ``top``.

        Also gives the inclusive time, and flags ops that contain a blocking CUDA call
        (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``):
        their ``sync_wait_ms`` is the time of those calls inside them.
        """
        c = self.cpu_ops
        if not len(c.start):
            return []
        st, en = np.frombuffer(c.start, dtype=np.float64), np.frombuffer(c.end, dtype=np.float64)
        name = np.frombuffer(c.payload, dtype=np.int64)
        keep, own = self.op_self_us(lo, hi)
        sync = np.zeros(st.size)
        if self.sync_calls:
            s_st = np.array([s[1] for s in self.sync_calls])
            s_en = np.array([s[2] for s in self.sync_calls])
            for a, b in zip(s_st, s_en):
                inside = keep[(st[keep] <= a) & (en[keep] >= b)]
                if inside.size:
                    sync[inside[np.argmin(en[inside] - st[inside])]] += b - a  # the innermost op waited
        self_t: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
        for i in keep:
            row = self_t[int(name[i])]
            row[0] += own[i]
            row[1] += en[i] - st[i]
            row[2] += 1
            row[3] += sync[i]
        rows = sorted(self_t.items(), key=lambda kv: (-kv[1][0], self.op_name_list[kv[0]]))[:top]
        return [{"name": self.op_name_list[k], "calls": int(v[2]), "self_ms": round(v[0] / 1e3, 4),
                 "inclusive_ms": round(v[1] / 1e3, 4), "sync_wait_ms": round(v[3] / 1e3, 4)} for k, v in rows]

    def op_self_us(self, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        """``(keep, self_us)``: the indexes (into :attr:`cpu_ops`) of the CPU ops that start in ``[lo, hi]`` and, per
        CPU op (zero for the others), its self time in us: its duration minus that of the ops nested directly in it
        on its thread (those starting in the window)."""
        c = self.cpu_ops
        tid = np.frombuffer(c.tid, dtype=np.int64)
        st, en = np.frombuffer(c.start, dtype=np.float64), np.frombuffer(c.end, dtype=np.float64)
        keep = np.flatnonzero((st >= lo) & (st <= hi))
        child = np.zeros(st.size)
        order = keep[np.lexsort((-en[keep], st[keep], tid[keep]))]
        stack: list[int] = []
        cur_tid = None
        for i in order:
            if tid[i] != cur_tid:
                stack, cur_tid = [], tid[i]
            while stack and en[stack[-1]] <= st[i]:
                stack.pop()
            if stack:
                child[stack[-1]] += en[i] - st[i]
            stack.append(int(i))
        own = np.zeros(st.size)
        own[keep] = np.maximum(en[keep] - st[keep] - child[keep], 0.0)
        return keep, own

    def compile_ms(self, lo: float, hi: float) -> dict[str, Any]:
        """torch.compile work that started in [lo, hi]: host time (ms, the union of dynamo's ``dynamo`` and
        ``... (dynamo_timed)`` ops per thread, so nested ones count once) and the compile ids dynamo
        annotated (``"frame/attempt"``; ``"4/0"`` is frame 4's first compile)."""
        total = 0.0
        by_tid: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for tid, a, b in self.compile_spans:
            if lo <= a <= hi:
                by_tid[tid].append((a, b))
        for spans in by_tid.values():
            end = -np.inf
            for a, b in sorted(spans):
                if b > end:
                    total += b - max(a, end)
                    end = b
        ids = sorted({c for ts, c in self.compile_ids if lo <= ts <= hi})
        return {"ms": round(total / 1e3, 4), "compile_ids": ids}

    def host_sync_ms(self, lo: float, hi: float) -> dict[str, Any]:
        """Blocking CUDA calls in [lo, hi]: count and total time per call name (ms)."""
        by: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for name, a, b, _ in self.sync_calls:
            if lo <= a <= hi:
                by[name][0] += 1
                by[name][1] += b - a
        return {"total_ms": round(sum(v[1] for v in by.values()) / 1e3, 4),
                "by_call": {k: {"calls": v[0], "ms": round(v[1] / 1e3, 4)} for k, v in sorted(by.items())}}


def device_peaks(device_name: Optional[str]) -> dict[str, Any]:
    """Stated peaks of a GPU by name: dense bf16 FLOP/s (``sftprof/flops.py``) and HBM bytes/s."""
    if not device_name:
        return {"device": None, "bf16_flops": None, "hbm_bytes_per_s": None}
    hbm = next((v for k, v in PEAK_HBM_BYTES_PER_S.items() if k in device_name), None)
    return {"device": device_name, "bf16_flops": gpu_peak_bf16_flops(device_name), "hbm_bytes_per_s": hbm}


TOP_HOST_OPS = 15
PHASES = ("forward", "recompute", "backward", "optimizer", "other")
_OUTSIDE_LABELS = {"optimizer": "optimizer", "comm_outside": "communication outside model parts",
                   "outside_parts": "outside model parts (loss, glue, unlinked backward)"}


def part_label(part: str) -> str:
    """Table label of a part key (model part, ``optimizer``, ``kernel:<category>`` ...)."""
    if part.startswith("kernel:"):
        return f"{part[7:]} (by kernel name)"
    return MODEL_PART_LABELS.get(part) or _OUTSIDE_LABELS.get(part, part)


def _ms(us: float) -> float:
    return round(float(us) / 1000.0, 4)


def analyze(ops: OpCollector, *, ts: np.ndarray, dur: np.ndarray, devs: np.ndarray, corr: list[int],
            ext: list[int], cats: list[str], is_comm: np.ndarray, groups: list[Optional[str]],
            pg_names: list[Optional[str]], pg_members: dict[str, list[int]],
            names: list[str], kinds: np.ndarray, nbytes: np.ndarray, window: tuple[Optional[float], Optional[float]],
            optimizer_windows: list[tuple[float, float]], device_name: Optional[str]) -> dict[str, Any]:
    """Model-part breakdown, kernel efficiency and per-group collectives of one rank (module docstring).

    Args are the analyzer's per-activity arrays (``ts``/``dur`` in us on the trace clock; ``groups`` the
    parallelism label and ``pg_names`` the process-group name of each collective), the process groups' member
    ranks by name, and the step window ``(lo, hi)``.

    Returns:
        ``{"parts": {...}, "efficiency": {...}, "collectives": {...}, "host": {...}}`` (times in ms);
        ``parts["compute_cells"]``: ``[part, layer, phase, ms]`` per cell without its NCCL kernels (layer None:
        outside the decoder layers);
        ``collectives["calls"]`` is this rank's call timeline per process group
        (:func:`sftprof.analysis.comm_wait.call_records`), which the trial summary matches across ranks and
        leaves out of ``profile_summary.json``.
    """
    lo, hi = window
    tids, pts = ops.launch_points(corr)
    n = pts.size
    if lo is None:
        inside = np.zeros(n, dtype=bool)
    else:  # launched in the window; without a launch record (cut off): started in it (module docstring)
        inside = np.where(np.isnan(pts), (ts >= lo) & (ts <= hi), (pts >= lo) & (pts <= hi))
    in_opt = np.zeros(n, dtype=bool)
    for a, b in optimizer_windows:
        in_opt |= (pts >= a) & (pts <= b)
    parts, layers, phases, source = ops.attribute(tids, pts, cats, in_opt, is_comm)
    cells: dict[tuple[str, Optional[int], str], float] = defaultdict(float)
    compute: dict[tuple[str, Optional[int], str], float] = defaultdict(float)
    for i in np.flatnonzero(inside):
        cells[(parts[i], layers[i], phases[i])] += dur[i]
        if not is_comm[i]:
            compute[(parts[i], layers[i], phases[i])] += dur[i]
    total = float(dur[inside].sum())
    parts_out = parts_tables(cells, total, source)
    # the same cells without NCCL kernels (whose time includes waiting for other ranks): the rank's own work, which
    # the trial summary compares across ranks (sftprof.analysis.summary.work_spread)
    parts_out["compute_cells"] = [[part, layer, phase, _ms(us)] for (part, layer, phase), us in
                                  sorted(compute.items(), key=lambda kv: (kv[0][1] is None, kv[0][1] or 0, kv[0][0],
                                                                          kv[0][2]))]
    parts_out["outside_window"] = int((~inside).sum())
    parts_out["total_ms"] = _ms(total)
    host = {"top_self": ops.self_times(lo, hi, TOP_HOST_OPS) if lo is not None else [],
            "sync": ops.host_sync_ms(lo, hi) if lo is not None else {"total_ms": 0.0, "by_call": {}},
            "compile": ops.compile_ms(lo, hi) if lo is not None else {"ms": 0.0, "compile_ids": []},
            "gpu_idle": None}
    if lo is not None:
        idle, host_gaps = _idle_split(ts, dur, pts, lo, hi)
        idle["host_wait_by_place"] = _host_wait_places(
            ops, host_gaps, launch=pts, sites=ops.launch_sites(tids, pts), parts=parts, phases=phases, dur=dur,
            inside=inside)
        host["gpu_idle"] = idle
    return {"parts": parts_out, "host": host,
            "efficiency": _efficiency(ops, tids, pts, dur, inside, parts, phases, kinds, names, nbytes, device_name),
            "collectives": _collectives(ops, ts, dur, devs, inside, is_comm, groups, ext, pg_names, pg_members)}


def _idle_split(ts: np.ndarray, dur: np.ndarray, launch: np.ndarray, lo: float, hi: float
                ) -> tuple[dict[str, Any], list[tuple[int, float, float]]]:
    """GPU idle time in ``[lo, hi]`` split by why the GPU waited (in the spirit of HTA's idle time breakdown).

    Idle gaps are the gaps of the union of all activity intervals. A gap before an activity whose launch
    call started after the gap began is ``host_wait`` (the host had not launched the next work yet);
    otherwise ``kernel_wait`` (the work was queued but waited on a dependency: another stream, an event,
    a collective's peer; also when the launch is not in the trace). Idle time before the first activity is
    ``host_wait``. Every activity running in the window counts, so idle + GPU busy = the window.

    Returns:
        ``({idle_ms, host_wait_ms, kernel_wait_ms, after_last_activity_ms}, host_gaps)``; ``host_gaps`` lists
        each host-wait gap as ``(index of the activity that ends it, gap start us, gap end us)``, the indexes
        into ``ts``; the gaps' lengths sum to ``host_wait_ms``.
    """
    keep = (ts + dur > lo) & (ts < hi)  # every activity that runs in the window, as the busy share counts them
    order = np.argsort(ts[keep], kind="stable")
    idx = np.flatnonzero(keep)[order]
    t, e = np.clip(ts[keep][order], lo, hi), np.clip((ts + dur)[keep][order], lo, hi)
    ln = launch[keep][order]
    if not t.size:
        return {"idle_ms": round((hi - lo) / 1e3, 4), "host_wait_ms": round((hi - lo) / 1e3, 4), "kernel_wait_ms": 0.0,
                "after_last_activity_ms": 0.0}, []
    run_end = np.maximum.accumulate(e)
    host = max(t[0] - lo, 0.0)
    host_gaps = [(int(idx[0]), float(lo), float(t[0]))] if host > 0 else []
    kernel = 0.0
    gaps = np.flatnonzero(t[1:] > run_end[:-1]) + 1
    for g in gaps:
        gap = t[g] - run_end[g - 1]
        if ln[g] > run_end[g - 1]:
            host += gap
            host_gaps.append((int(idx[g]), float(run_end[g - 1]), float(t[g])))
        else:
            kernel += gap
    tail = max(hi - run_end[-1], 0.0)
    return ({"idle_ms": round((host + kernel + tail) / 1e3, 4), "host_wait_ms": round(host / 1e3, 4),
             "kernel_wait_ms": round(kernel / 1e3, 4), "after_last_activity_ms": round(tail / 1e3, 4)}, host_gaps)


TOP_IDLE_PLACES = 10
# A place whose host-wait gaps (those not after a blocking call) and GPU activities both average under this (us) is
# launch-bound: short kernels, each costing the host (CUDA runtime, PyTorch dispatcher, Python) more than it runs.
# Short gaps after long activities, or long gaps, mean the host did other work between launches. On the
# 131072-token 1x H200 trace the chunked loss loop's gaps averaged 25 us, its kernels 4 us.
LAUNCH_GAP_US = 100.0


def _host_wait_places(ops: OpCollector, host_gaps: list[tuple[int, float, float]], *, launch: np.ndarray,
                      sites: list[Optional[str]], parts: list[str], phases: list[str], dur: np.ndarray,
                      inside: np.ndarray) -> dict[str, Any]:
    """Where and why the GPU waited for the host: the host-wait gaps of :func:`_idle_split` by place.

    A gap's place is that of the activity that ends it: its (part, phase) from :meth:`OpCollector.attribute`
    and the named op it was launched under (:meth:`OpCollector.launch_sites`). A gap is *after a blocking
    call* when a blocking CUDA call (``cudaStreamSynchronize`` ...; :meth:`OpCollector.blocking_calls`) ended
    between the gap's start and the launch of the activity that ends it: the host waited for the GPU's queue
    to drain, then took the gap's time to launch more work. In the other gaps the host launched the next work
    only after the GPU had finished the previous: a place is *launch-bound* when those gaps and the place's GPU
    activities both average under :data:`LAUNCH_GAP_US` (short kernels whose per-launch host cost exceeds their
    run time), else *host busy* (the host did other work between launches: long gaps, or gaps after long
    activities, which a launch alone cannot explain).

    Returns:
        ``{"rows": [...], "rest": {...} or None, "after_blocking_ms", "after_blocking_by_op": {op: ms}}``;
        rows (at most :data:`TOP_IDLE_PLACES`, most idle first) have ``part``, ``label``, ``phase``,
        ``launched_under`` (None when no named op), ``idle_ms``, ``gaps``, ``activities`` (the GPU activities of
        that place launched in the step window: kernels, copies, fills; the gaps end at all three kinds),
        ``mean_activity_us`` (their mean duration), ``mean_gap_us``, ``after_blocking_ms``,
        ``after_blocking_pct`` (of the row's idle) and ``kind`` (``after blocking calls`` when at least half the
        row's idle follows one, else ``launch-bound`` or ``host busy`` as above; ``mean_gap_us`` is over all the
        row's gaps); ``rest`` sums the rows left out (``places``,
        ``idle_ms``, ``gaps``). The rows' and rest's ``idle_ms`` sum to ``host_wait_ms``.
    """
    sync_end, sync_op = ops.blocking_calls()
    rows: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0])  # idle us, gaps, after-blocking us, gaps
    by_op: dict[str, float] = defaultdict(float)
    for i, g0, g1 in host_gaps:
        key = (parts[i], phases[i], sites[i])
        r = rows[key]
        r[0] += g1 - g0
        r[1] += 1
        upto = g1 if np.isnan(launch[i]) else min(launch[i], g1)
        j = int(np.searchsorted(sync_end, g0, side="left"))
        if j < sync_end.size and sync_end[j] <= upto:
            r[2] += g1 - g0
            r[3] += 1
            by_op[sync_op[j]] += g1 - g0
    count: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    for i in np.flatnonzero(inside):
        key = (parts[i], phases[i], sites[i])
        if key in rows:
            count[key][0] += 1
            count[key][1] += dur[i]
    ordered = sorted(rows.items(), key=lambda kv: (-kv[1][0], kv[0][0], kv[0][1], kv[0][2] or ""))
    out = []
    for (part, phase, site), (us, n, blocked, n_blocked) in ordered[:TOP_IDLE_PLACES]:
        k, kus = count.get((part, phase, site), (0, 0.0))
        if 2 * blocked >= us:  # also every gap after a blocking call (none left for a mean gap)
            kind = "after blocking calls"
        elif (us - blocked) / (n - n_blocked) < LAUNCH_GAP_US and k and kus / k < LAUNCH_GAP_US:
            kind = "launch-bound"
        else:
            kind = "host busy"
        out.append({"part": part, "label": part_label(part), "phase": phase, "launched_under": site,
                    "idle_ms": _ms(us), "gaps": int(n), "activities": int(k),
                    "mean_activity_us": round(float(kus) / k, 3) if k else None, "mean_gap_us": round(us / n, 3),
                    "after_blocking_ms": _ms(blocked), "after_blocking_pct": round(100 * blocked / us, 3) if us else 0.0,
                    "kind": kind})
    left = ordered[TOP_IDLE_PLACES:]
    return {"rows": out,
            "rest": {"places": len(left), "idle_ms": _ms(sum(v[0] for _, v in left)),
                     "gaps": int(sum(v[1] for _, v in left))} if left else None,
            "after_blocking_ms": _ms(sum(by_op.values())),
            "after_blocking_by_op": {k: _ms(v) for k, v in sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0]))}}


def parts_tables(cells: dict, total: float, source: str) -> dict[str, Any]:
    by_layer: dict[Optional[int], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for (part, layer, phase), us in cells.items():
        by_layer[layer][part][phase] += us

    def rows(table: dict[str, dict[str, float]]) -> list[dict]:
        order = {p: i for i, p in enumerate(MODEL_PARTS + ("optimizer", "comm_outside", "outside_parts"))}
        out = []
        for part in sorted(table, key=lambda p: (order.get(p, len(order)), p)):
            ph = table[part]
            t = sum(ph.values())
            out.append({"part": part, "label": part_label(part), **{f"{k}_ms": _ms(ph.get(k, 0.0)) for k in PHASES},
                        "total_ms": _ms(t), "share_pct": round(100 * t / total, 3) if total else 0.0})
        return out

    summed: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for layer, table in by_layer.items():
        for part, ph in table.items():
            for k, v in ph.items():
                summed[part][k] += v
    return {"source": source,
            "layers": [{"layer": layer, "rows": rows(by_layer[layer])} for layer in sorted(l for l in by_layer if l is not None)],
            "outside_layers": rows(by_layer[None]) if None in by_layer else [],
            "summed": rows(summed)}


def _efficiency(ops, tids, pts, dur, inside, parts, phases, kinds, names, nbytes, device_name) -> dict:
    peaks = device_peaks(device_name)
    op_idx = ops.flop_op_of(tids, pts)
    per_op: dict[int, float] = defaultdict(float)
    op_part: dict[int, tuple[str, str]] = {}
    for i in np.flatnonzero(inside & (op_idx >= 0) & (kinds == 0)):
        per_op[int(op_idx[i])] += dur[i]
        op_part.setdefault(int(op_idx[i]), (parts[i], phases[i]))
    rows: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for k, us in per_op.items():
        name, kind, flops, dtype = ops.flop_info(k)
        part, phase = op_part[k]
        if kind == "attention backward":
            kind, phase = "attention", "backward"
        label = part_label(part)
        if kind == "attention" and part not in MODEL_PART_LABELS:
            label = MODEL_PART_LABELS["attn_core"]
        elif part.startswith("kernel:"):
            label = "GEMM (by kernel name)"
        r = rows[(kind, label, phase, dtype)]
        r[0] += flops
        r[1] += us
        r[2] += 1
    peak = peaks["bf16_flops"]
    out_rows = []
    for (kind, part, phase, dtype), (flops, us, calls) in sorted(rows.items(), key=lambda kv: (-kv[1][1], kv[0])):
        rate = flops / (us * 1e-6) if us > 0 else None
        low_precision = dtype in ("BFloat16", "Half")
        out_rows.append({"kind": kind, "part": part, "phase": phase, "dtype": dtype, "calls": calls,
                         "tflop": round(flops / 1e12, 6), "gpu_ms": _ms(us),
                         "tflops_per_s": round(rate / 1e12, 3) if rate else None,
                         "pct_of_peak": round(100 * rate / peak, 2) if rate and peak and low_precision else None})
    # Memory-bound: copies and fills, whose events carry their byte count.
    mem: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for i in np.flatnonzero(inside & (kinds != 0) & (nbytes > 0)):
        m = mem[names[i]]
        m[0] += nbytes[i]
        m[1] += dur[i]
        m[2] += 1
    bw = peaks["hbm_bytes_per_s"]
    mem_rows = [{"name": k, "calls": int(c), "gib": round(b / 2**30, 4), "gpu_ms": _ms(us),
                 "gb_per_s": round(b / (us * 1e-6) / 1e9, 2) if us > 0 else None,
                 "pct_of_hbm": round(100 * b / (us * 1e-6) / bw, 2) if us > 0 and bw else None}
                for k, (b, us, c) in sorted(mem.items(), key=lambda kv: (-kv[1][1], kv[0]))]
    return {"peak": peaks, "rows": out_rows, "memory_bound": mem_rows,
            "note": "attention backward FLOPs = 2x forward (model FLOPs; fused kernels do 2.5x); "
                    "% of peak only for bf16/fp16 ops, against the dense bf16 peak; memory-bound rows: bytes "
                    "moved by copies/fills over their time, against the HBM bandwidth (a device-to-device copy "
                    "reads and writes each byte, so its HBM traffic is twice the bytes shown)"}


def _collectives(ops, ts, dur, devs, inside, is_comm, groups, ext, pg_names, pg_members) -> dict:
    """Per (process group, collective): calls, bytes, GPU time, bus bandwidth; exposed time per group and of the
    NCCL kernels outside the step window; the calls' timeline per process group
    (:func:`sftprof.analysis.comm_wait.call_records`).

    Exposed time is counted as ``communication.exposed_ms`` counts it (:func:`sftprof.analysis.trace_summary.
    communication`): NCCL kernel time not overlapped by any non-communication GPU activity of the trace on the same
    device. So ``exposed_outside_window_ms`` (that total minus the exposed time of the union of the NCCL kernels in
    the window) and the groups' rows together cover every NCCL kernel of the trace.
    """
    end = ts + dur
    rows: dict[tuple[str, str], dict] = {}
    seen_ops: set[int] = set()
    for i in np.flatnonzero(inside & is_comm):
        info = ops.comm_ops.get(ext[i]) or {}
        key = (groups[i] or "unknown", info.get("collective") or "?")
        r = rows.setdefault(key, {"group": key[0], "collective": key[1], "calls": 0, "bytes": 0, "bytes_known": True,
                                  "us": 0.0, "group_size": info.get("group_size")})
        r["us"] += dur[i]
        if ext[i] not in seen_ops:  # one call per launching op (a coalesced call may launch several kernels)
            seen_ops.add(ext[i])
            r["calls"] += 1
            if info.get("bytes") is None:
                r["bytes_known"] = False
            else:
                r["bytes"] += info["bytes"]
    out_rows = []
    for r in sorted(rows.values(), key=lambda r: (-r["us"], r["group"], r["collective"])):
        t = r["us"] * 1e-6
        alg = r["bytes"] / t / 1e9 if r["bytes_known"] and t > 0 and r["bytes"] else None
        n = r["group_size"]
        out_rows.append({"group": r["group"], "collective": r["collective"], "calls": r["calls"],
                         "gib": round(r["bytes"] / 2**30, 4) if r["bytes_known"] else None, "gpu_ms": _ms(r["us"]),
                         "group_size": n, "algbw_gb_per_s": round(alg, 2) if alg else None,
                         "busbw_gb_per_s": round(alg * bus_factor(r["collective"], n), 2) if alg and n else None})
    exposed: dict[str, float] = defaultdict(float)
    outside = 0.0  # exposed time of all NCCL kernels minus that of the window's (union per device)
    comp_by_dev = {}
    labels = np.array([g or "unknown" for g in groups], dtype=object)
    for dev in np.unique(devs):
        on = devs == dev
        comp = comp_by_dev[int(dev)] = intervals.union(ts[on & ~is_comm], end[on & ~is_comm])
        for g in sorted(set(labels[on & is_comm & inside].tolist())):
            sel = on & is_comm & inside & (labels == g)
            c = intervals.union(ts[sel], end[sel])
            exposed[g] += intervals.length(*c) - intervals.intersection_length(c, comp)
        c_all = intervals.union(ts[on & is_comm], end[on & is_comm])
        c_in = intervals.union(ts[on & is_comm & inside], end[on & is_comm & inside])
        outside += (intervals.length(*c_all) - intervals.intersection_length(c_all, comp)
                    - intervals.length(*c_in) + intervals.intersection_length(c_in, comp))
    coll = [(ops.comm_ops.get(x) or {}).get("collective") or "?" for x in ext]
    calls = comm_wait.call_records(ts=ts, end=end, devs=devs, sel=np.flatnonzero(inside & is_comm), ext=ext,
                                   pg_names=pg_names, labels=groups, collectives=coll, members=pg_members,
                                   comp_by_dev=comp_by_dev)
    return {"rows": out_rows, "exposed_by_group_ms": {g: _ms(v) for g, v in sorted(exposed.items())},
            "exposed_outside_window_ms": _ms(max(outside, 0.0)), "calls": calls,
            "note": "exposed = the group's NCCL kernel time not overlapped by non-communication GPU work on "
                    "the same device; groups that overlap each other each count their own exposed time; a row "
                    f"'{OUTSIDE_WINDOW}' (when there is any) holds the exposed time of the NCCL kernels outside the "
                    "step window, so the rows cover every kernel of the rank's exposed communication"}


OUTSIDE_WINDOW = "outside the step window"  # the row of exposed_groups for NCCL kernels not in the step window


def exposed_groups(collectives: dict) -> dict[str, float]:
    """One rank's exposed NCCL kernel time (ms) per process-group label (``unknown``: kernels without a group),
    plus a row :data:`OUTSIDE_WINDOW` for the NCCL kernels outside the step window when they have exposed time
    (``collectives["exposed_outside_window_ms"]``; summaries written before it have no such row).

    Together the rows cover every NCCL kernel that ``communication.exposed_ms`` counts; groups that overlap each
    other each count their own exposed time, so the rows need not add up to it.

    Args:
        collectives: the ``collectives`` member of a kernel summary (:func:`analyze`).
    """
    out = dict(collectives.get("exposed_by_group_ms") or {})
    rest = collectives.get("exposed_outside_window_ms") or 0.0
    if rest > 0:
        out[OUTSIDE_WINDOW] = rest
    return out


def plot_parts(parts: dict, title: str, out_png: str, clock: str = "GPU time") -> None:
    """Stacked-bar PNG of time (ms) per decoder layer (one bar per layer, then one for the parts
    outside the layers), a colour per part; each segment is the part's forward + recompute + backward
    (+ optimizer, other) time, the split by phase is in the tables.

    Args:
        parts: the ``parts`` member of a kernel summary (:func:`analyze`), or its ``cpu_parts``.
        title: plot title; out_png: destination path; clock: what the time is (the y axis' label).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"L{x['layer']}", x["rows"]) for x in parts["layers"]]
    if parts["outside_layers"]:
        bars.append(("outside\nlayers", parts["outside_layers"]))
    labels = []
    for _, rows in bars:
        for r in rows:
            if r["label"] not in labels:
                labels.append(r["label"])
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(bars) + 4), 5), dpi=100)
    bottom = np.zeros(len(bars))
    cmap = plt.get_cmap("tab20")
    for k, label in enumerate(labels):
        vals = np.array([next((r["total_ms"] for r in rows if r["label"] == label), 0.0) for _, rows in bars])
        ax.bar(range(len(bars)), vals, bottom=bottom, color=cmap(k % 20), label=label, width=0.7)
        bottom += vals
    ax.set_xticks(range(len(bars)), [b for b, _ in bars], fontsize=8)
    ax.set_ylabel(f"{clock} [ms] (all phases)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, format="png", metadata={"Software": None})
    plt.close(fig)
