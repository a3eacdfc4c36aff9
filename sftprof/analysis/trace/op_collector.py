"""The CPU side of one trace, collected in the kernel summary's streaming pass, and the queries over it.

Fed by :class:`sftprof.analysis.time.trace_summary.KernelTraceAnalyzer`: every CPU op, ``sftprof.module/*`` range
(:mod:`sftprof.capture.module_regions`), forward->backward flow (``fwdbwd``) and CUDA runtime call goes to
:meth:`OpCollector.add`; the questions of the step (:mod:`sftprof.analysis.time.model_parts`,
:mod:`sftprof.analysis.time.host_time`, :mod:`sftprof.analysis.time.efficiency`, :mod:`sftprof.analysis.time.collectives`) then
ask it where each GPU activity (or CPU op) was launched from.

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
(:func:`sftprof.analysis.trace.kernel_names.kernel_category`) and say so (``source: kernel_name``).
"""
from __future__ import annotations

from array import array
from collections import defaultdict
from typing import Any, NamedTuple, Optional

import numpy as np

from sftprof.analysis.trace.intervals import ThreadIntervals, covered_lengths, previous_open, union
from sftprof.analysis.trace.kernel_names import collective_name
from sftprof.analysis.time.op_flops import CORE_PART, FLOP_OPS, FLOW_BACKWARD, FLOW_FORWARD, op_flops
from sftprof.analysis.schema import ms
from sftprof.artifacts import GC_REGION_PREFIX, MODULE_REGION_PREFIX, parse_module_region

__all__ = ["OpCollector", "Placement", "BWD_NODE", "KERNEL_LAUNCHES"]

BWD_NODE = "autograd::engine::evaluate_function: "

_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cudaMemcpy2D")  # blocking calls: the host waits for the device

# CUDA API calls that launch one kernel (a graph launch, cudaGraphLaunch, runs many kernels under one correlation)
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cuLaunchCooperativeKernel")

_COMPILE, _BWD_NODE, _FLOP, _FLOW_BACKWARD = 1, 2, 4, 8  # what an op's name makes it (OpCollector._op_kind)

_DTYPE_BYTES = {"BFloat16": 2, "Half": 2, "Float": 4, "Double": 8, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
                "Int": 4, "Long": 8, "Char": 1, "Byte": 1, "Bool": 1}


class Placement(NamedTuple):
    """Where each activity (or CPU op) of a step ran (:meth:`OpCollector.attribute`): per item its model part
    (``attn_core``, ... ``optimizer``, ``comm_outside``, ``outside_parts``, or ``kernel:<category>`` without
    ranges), decoder layer (None outside the layers) and phase (:data:`sftprof.analysis.time.model_parts.PHASES`), and
    ``source``: ``module_regions`` or ``kernel_name``."""
    parts: list[str]
    layers: list[Optional[int]]
    phases: list[str]
    source: str


class OpCollector:
    """Collects the CPU side of a trace (module docstring)."""

    def __init__(self) -> None:
        self.regions = ThreadIntervals()  # model-part ranges; payload: index into _region_keys
        self._region_keys: list[tuple[str, Optional[int], bool]] = []
        self._region_index: dict[str, int] = {}
        self.bwd_nodes = ThreadIntervals()  # payload: 1 for megatron-core's CheckpointFunctionBackward
        self.flop_ops = ThreadIntervals()  # payload: index into _flop_info
        self._flop_info: list[tuple[str, str, float, str]] = []  # (op name, kind, flops, dtype)
        self._launch: dict[int, tuple[int, float]] = {}  # correlation -> (tid, ts)
        self.kernel_launches = (array("q"), array("d"))  # correlation and start (us) of each kernel launch call
        self.repeated_api_calls = 0  # CUDA API calls recorded twice (same correlation, thread and start): skipped
        self._flow_start: dict[int, tuple[int, float]] = {}  # fwdbwd id -> forward op (tid, ts)
        self._flow_end: dict[tuple[int, float], int] = {}  # autograd node op (tid, ts) -> fwdbwd id
        self.comm_ops: dict[int, dict] = {}  # External id -> collective, group ref, size, bytes
        self.sync_calls: list[tuple[str, float, float, int]] = []  # blocking CUDA runtime calls: (name, start, end, tid)
        self.cpu_ops = ThreadIntervals()  # every cpu_op for self time; payload: name index
        self.cpu_dur = array("d")  # each cpu_op's dur as recorded (end - start loses bits at trace-clock magnitudes)
        self.compile_spans: list[tuple[int, float, float]] = []  # torch.compile's own ops: (tid, start, end)
        self.compile_ids: list[tuple[float, str]] = []  # (ts, dynamo compile id "frame/attempt") from annotations
        self.gc_spans: list[tuple[float, float, int]] = []  # Python garbage collections: (start, end, generation)
        self._op_names: dict[str, int] = {}
        self.op_name_list: list[str] = []
        self._op_kinds: list[int] = []  # per op name: what it is (_COMPILE | _BWD_NODE | _FLOP | _FLOW_BACKWARD)
        self._flow_fwd_op: dict[tuple[int, float], int] = {}  # FLOW_FORWARD op (tid, ts) -> index into _flop_info
        self._flow_bwd_ops: list[tuple[str, int, float, float]] = []  # FLOW_BACKWARD ops: (name, tid, ts, dur)

    def add(self, ev: dict, cat, ts: float, dur: float) -> None:
        """Consume one complete (``ph: X``) or flow event of category ``cat`` with a valid ``ts`` (and ``dur`` for
        X)."""
        tid = ev.get("tid")
        if type(tid) is not int:
            tid = -1
        if cat == "cpu_op":
            self.add_cpu_op(tid, ev.get("name") or "", ev.get("args"), ts, dur)
        else:
            self._add_other(ev, cat, tid, ts, dur)

    def add_cpu_op(self, tid: int, name: str, args: Optional[dict], ts: float, dur: float) -> None:
        """Consume one CPU op (thread ``tid``, -1 when unknown), the hot path of the trace pass: what an op's name says
        is worked out once per name (:meth:`_op_kind`)."""
        idx = self._op_names.get(name)
        if idx is None:
            idx = self._op_names[name] = len(self.op_name_list)
            self.op_name_list.append(name)
            self._op_kinds.append(self._op_kind(name))
        c = self.cpu_ops
        c.tid.append(tid)
        c.start.append(ts)
        c.end.append(ts + dur)
        c.payload.append(idx)
        self.cpu_dur.append(dur)
        kind = self._op_kinds[idx]
        if kind:
            if kind & _COMPILE:
                self.compile_spans.append((tid, ts, ts + dur))
            if kind & _BWD_NODE:
                self.bwd_nodes.add(tid, ts, ts + dur, int(name.endswith("CheckpointFunctionBackward")))
                return
            if kind & _FLOP:
                f = op_flops(name, args or {})
                if f is not None:
                    if name in FLOW_FORWARD:
                        self._flow_fwd_op[(tid, ts)] = len(self._flop_info)
                    self.flop_ops.add(tid, ts, ts + dur, len(self._flop_info))
                    self._flop_info.append((name, *f))
            elif kind & _FLOW_BACKWARD:
                self._flow_bwd_ops.append((name, tid, ts, dur))
        if args and "Collective name" in args:
            ext = args.get("External id")
            if isinstance(ext, int):
                nel = [v for v in (args.get("In msg nelems"), args.get("Out msg nelems")) if isinstance(v, int)]
                size = args.get("Group size")
                self.comm_ops[ext] = {"collective": collective_name(str(args["Collective name"])),
                                      "pg": (args.get("Process Group Description"), args.get("Process Group Name")),
                                      "group_size": size if isinstance(size, int) else None,
                                      "bytes": max(nel) * _DTYPE_BYTES[args["dtype"]]
                                      if nel and args.get("dtype") in _DTYPE_BYTES else None}

    def _add_other(self, ev: dict, cat, tid: int, ts: float, dur: float) -> None:
        """Consume one event of another category than ``cpu_op`` (:meth:`add`)."""
        if cat == "user_annotation":
            name = ev.get("name") or ""
            if name.startswith("dynamo_data: compile_id="):
                self.compile_ids.append((ts, name.split("=", 1)[1]))
            elif name.startswith(GC_REGION_PREFIX) and (gen := name[len(GC_REGION_PREFIX):]) in ("0", "1", "2"):
                self.gc_spans.append((ts, ts + dur, int(gen)))
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
            name = ev.get("name") or ""
            if isinstance(corr, int) and not isinstance(corr, bool):
                if self._launch.get(corr) == (tid, ts):  # the same call recorded twice
                    self.repeated_api_calls += 1
                    return
                self._launch[corr] = (tid, ts)
                if name.startswith(KERNEL_LAUNCHES):
                    self.kernel_launches[0].append(corr)
                    self.kernel_launches[1].append(ts)
            if name in _SYNC_CALLS:
                self.sync_calls.append((name, ts, ts + dur, tid))
        elif cat == "fwdbwd":
            fid = ev.get("id")
            if isinstance(fid, (int, str)):
                if ev.get("ph") == "s":
                    self._flow_start[hash(fid)] = (tid, ts)
                elif ev.get("ph") == "f":
                    self._flow_end[(tid, ts)] = hash(fid)

    def keep_cpu_ops(self, mask: np.ndarray) -> None:
        """Drop the CPU ops where ``mask`` (bool, one per op of :attr:`cpu_ops`) is False."""
        self.cpu_ops.keep(mask)
        self.cpu_dur = array("d", np.frombuffer(self.cpu_dur, dtype=np.float64)[mask].tobytes())

    @staticmethod
    def _op_kind(name: str) -> int:
        """The bits of :data:`_COMPILE`, :data:`_BWD_NODE`, :data:`_FLOP`, :data:`_FLOW_BACKWARD` an op name has."""
        return ((_COMPILE if name == "dynamo" or name.endswith(" (dynamo_timed)") else 0)
                | (_BWD_NODE if name.startswith(BWD_NODE) else 0) | (_FLOP if name in FLOP_OPS else 0)
                | (_FLOW_BACKWARD if name in FLOW_BACKWARD else 0))

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
                  is_comm: np.ndarray) -> Placement:
        """Part, layer and phase of each activity (module docstring) launched on thread ``tids`` at ``pts`` (us,
        NaN: launch unknown), of category ``cats`` (:func:`sftprof.analysis.trace.kernel_names.kernel_category`, or
        :func:`~sftprof.analysis.trace.kernel_names.cpu_op_category` for CPU ops), launched inside the optimizer step
        (``in_optimizer``), an NCCL kernel or host collective (``is_comm``)."""
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
            return Placement(parts, layers, phases, "kernel_name")
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
        return Placement(parts, layers, phases, "module_regions")

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
        labels = [n[len(BWD_NODE):] if n.startswith(BWD_NODE) else n if "::" not in n else None
                  for n in self.op_name_list]
        tid, st, en, name = self.cpu_ops.arrays()
        sel = np.array([x is not None for x in labels], dtype=bool)[name] if labels else np.zeros(0, dtype=bool)
        named = ThreadIntervals.from_arrays(tid[sel], st[sel], en[sel], name[sel])
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

    def _link_flow_backward(self) -> None:
        """Give each backward op of :data:`~sftprof.analysis.time.op_flops.FLOW_BACKWARD` 2x the FLOPs of the forward op
        its fwdbwd flow starts at (once, after the pass: flows and ops arrive in any order); one without a linked
        forward op stays without."""
        for name, tid, ts, dur in self._flow_bwd_ops:
            start = self._flow_start.get(self._flow_end.get((tid, ts)))
            k = self._flow_fwd_op.get(start) if start is not None else None
            if k is None:
                continue
            _, kind, flops, dtype = self._flop_info[k]
            self.flop_ops.add(tid, ts, ts + dur, len(self._flop_info))
            self._flop_info.append((name, f"{kind} backward" if kind in CORE_PART else kind, 2 * flops, dtype))
        self._flow_bwd_ops = []

    def flop_op_of(self, tids: np.ndarray, pts: np.ndarray) -> np.ndarray:
        """Index into the FLOP-known ops (innermost containing the launch point), -1 when none."""
        self._link_flow_backward()
        return self.flop_ops.innermost(tids, np.where(np.isnan(pts), -np.inf, pts))

    def flop_info(self, k: int) -> tuple[str, str, float, str]:
        return self._flop_info[int(np.frombuffer(self.flop_ops.payload, dtype=np.int64)[k])]

    def self_times(self, lo: float, hi: float, top: int) -> list[dict]:
        """CPU ops in [lo, hi] by self time (own time minus the ops nested directly in it), top ``top``.

        Also gives the inclusive time, and flags ops that contain a blocking CUDA call
        (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``):
        their ``sync_wait_ms`` is the time of those calls inside them (each call's time goes to the innermost op
        around it on its thread).
        """
        if not len(self.cpu_ops):
            return []
        _, st, en, name = self.cpu_ops.arrays()
        keep, own = self.op_self_us(lo, hi)
        sync = np.zeros(st.size)
        if self.sync_calls:
            a = np.array([s[1] for s in self.sync_calls])
            b = np.array([s[2] for s in self.sync_calls])
            at = self.cpu_ops.innermost(np.array([s[3] for s in self.sync_calls], dtype=np.int64), a)
            ok = at >= 0
            ok[ok] = (en[at[ok]] >= b[ok]) & (st[at[ok]] >= lo) & (st[at[ok]] <= hi)  # around the call, in the window
            np.add.at(sync, at[ok], (b - a)[ok])
        n = len(self.op_name_list)
        k = name[keep]
        per_name = [np.bincount(k, weights=w, minlength=n) for w in (own[keep], (en - st)[keep], sync[keep])]
        calls = np.bincount(k, minlength=n)
        self_us, incl, wait = (x.tolist() for x in per_name)
        rows = sorted(np.flatnonzero(calls).tolist(), key=lambda j: (-self_us[j], self.op_name_list[j]))[:top]
        return [{"name": self.op_name_list[j], "calls": int(calls[j]), "self_ms": ms(self_us[j]),
                 "inclusive_ms": ms(incl[j]), "sync_wait_ms": ms(wait[j])} for j in rows]

    def op_self_us(self, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        """``(keep, self_us)``: the indexes (into :attr:`cpu_ops`) of the CPU ops that start in ``[lo, hi]`` and, per
        CPU op (zero for the others), its self time in us: its duration minus that of the ops nested directly in it
        on its thread (those starting in the window; :func:`sftprof.analysis.trace.intervals.previous_open` finds each
        op's parent)."""
        tid, st, en, _ = self.cpu_ops.arrays()
        keep = np.flatnonzero((st >= lo) & (st <= hi))
        order = keep[np.lexsort((-en[keep], st[keep], tid[keep]))]
        parent = previous_open(tid[order], st[order], en[order])
        nested = parent >= 0
        child = np.zeros(st.size)
        child[order] = np.bincount(parent[nested], weights=(en - st)[order][nested], minlength=order.size)
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
        return {"ms": ms(total), "compile_ids": ids}

    def gc_time(self, lo: float, hi: float) -> Optional[dict[str, Any]]:
        """Python garbage collections (:mod:`sftprof.capture.python_gc` ranges) that overlap [lo, hi]: count, their
        time inside the window (ms; overlapping ranges counted once) and count by generation; None when the trace
        holds no such range."""
        if not self.gc_spans:
            return None
        gens = [g for a, b, g in self.gc_spans if a < hi and b > lo]
        by: dict[str, int] = defaultdict(int)
        for g in gens:
            by[str(g)] += 1
        inside = float(self.gc_overlap_us(np.array([lo], dtype=np.float64), np.array([hi], dtype=np.float64))[0])
        return {"collections": len(gens), "ms": ms(inside), "by_generation": dict(sorted(by.items()))}

    def gc_overlap_us(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Per interval ``[starts[i], ends[i]]`` (us), the time a garbage collection ran inside it (us; ranges that
        overlap, as in a damaged trace, count once)."""
        if not self.gc_spans:
            return np.zeros(len(starts))
        spans = np.array([(a, b) for a, b, _ in self.gc_spans], dtype=np.float64)
        return covered_lengths(union(spans[:, 0], spans[:, 1]), starts, ends)

    def host_sync_ms(self, lo: float, hi: float) -> dict[str, Any]:
        """Blocking CUDA calls in [lo, hi]: count and total time per call name (ms)."""
        by: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for name, a, b, _ in self.sync_calls:
            if lo <= a <= hi:
                by[name][0] += 1
                by[name][1] += b - a
        return {"total_ms": ms(sum(v[1] for v in by.values())),
                "by_call": {k: {"calls": v[0], "ms": ms(v[1])} for k, v in sorted(by.items())}}
