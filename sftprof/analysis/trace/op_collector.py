"""The CPU side of one trace, collected in the kernel summary's streaming pass, and the queries over it.

Fed by :class:`sftprof.analysis.time.trace_summary.KernelTraceAnalyzer`: every CPU op, ``sftprof.module/*`` range
(:mod:`sftprof.capture.module_regions`), forward->backward flow (``fwdbwd``) and CUDA runtime call goes to
:meth:`OpCollector.add`; the questions of the step (:mod:`sftprof.analysis.time.model_parts`,
:mod:`sftprof.analysis.time.host_time`, :mod:`sftprof.analysis.time.efficiency`,
:mod:`sftprof.analysis.time.collectives`) then ask it where each GPU activity (or CPU op) was launched from.

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
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import numpy as np

from sftprof.analysis.time.gpu_activity import Labels
from sftprof.analysis.trace.intervals import ThreadIntervals, covered_lengths, union
from sftprof.analysis.trace.kernel_names import collective_name
from sftprof.analysis.trace.op_store import BUCKET_OPS, CpuOpStore
from sftprof.analysis.time.op_flops import CORE_PART, FLOP_OPS, FLOW_BACKWARD, FLOW_FORWARD, op_flops
from sftprof.analysis.schema import ms
from sftprof.analysis.time.schema import Compile, GcTime, HostOpRow, HostSync
from sftprof.artifacts import GC_REGION_PREFIX, MODULE_REGION_PREFIX, parse_module_region

__all__ = ["OpCollector", "Placement", "BWD_NODE", "KERNEL_LAUNCHES", "PHASES"]

PHASES = ("forward", "recompute", "backward", "optimizer", "other")  # a placement's phases

BWD_NODE = "autograd::engine::evaluate_function: "

_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cudaMemcpy2D")  # blocking calls: the host waits for the device

# CUDA API calls that launch one kernel (a graph launch, cudaGraphLaunch, runs many kernels under one correlation)
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cuLaunchCooperativeKernel")

_COMPILE, _BWD_NODE, _FLOP, _FLOW_BACKWARD = 1, 2, 4, 8  # what an op's name makes it (OpCollector._op_kind)

_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1  # a correlation id outside int64 is read as none

_DTYPE_BYTES = {"BFloat16": 2, "Half": 2, "Float": 4, "Double": 8, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
                "Int": 4, "Long": 8, "Char": 1, "Byte": 1, "Bool": 1}


class Placement(NamedTuple):
    """Where each activity (or CPU op) of a step ran (:meth:`OpCollector.attribute`): per item its model part
    (``attn_core``, ... ``optimizer``, ``comm_outside``, ``outside_parts``, or ``kernel:<category>`` without
    ranges), decoder layer (None outside the layers) and phase (:data:`PHASES`), each a
    :class:`~sftprof.analysis.time.gpu_activity.Labels` (1 byte an item), and ``source``: ``module_regions`` or
    ``kernel_name``."""
    parts: Labels[str]
    layers: Labels[int]
    phases: Labels[str]
    source: str


class OpCollector:
    """Collects the CPU side of a trace (module docstring).

    Args:
        bucket_ops: the CPU ops' time buckets (:class:`sftprof.analysis.trace.op_store.CpuOpStore`).
    """

    def __init__(self, bucket_ops: int = BUCKET_OPS) -> None:
        self.regions = ThreadIntervals()  # model-part ranges; payload: index into _region_keys
        self._region_keys: list[tuple[str, Optional[int], bool]] = []
        self._region_index: dict[str, int] = {}
        self.bwd_nodes = ThreadIntervals()  # payload: 1 for megatron-core's CheckpointFunctionBackward
        self.flop_ops = ThreadIntervals()  # payload: index into the FLOP-known ops (flop_info)
        self._flop_what: dict[tuple[str, str, str], int] = {}  # (op name, kind, dtype) -> index into _flop_what_list
        self._flop_what_list: list[tuple[str, str, str]] = []
        self._flop_op_what = array("q")  # per FLOP-known op: index into _flop_what_list
        self._flop_op_flops = array("d")  # ... and its FLOPs
        # CUDA API calls with an int64 correlation id, in trace order (correlation, thread, start us, a kernel launch):
        # repeats are found and the launch table built after the pass (_api_calls)
        self._api: tuple[array[int], array[int], array[float], array[int]] = (array("q"), array("q"), array("d"),
                                                                              array("b"))
        self._api_done: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self._sync_pending: list[tuple[str, float, float, int, int]] = []  # blocking calls, index into _api or -1
        self._sync_calls: list[tuple[str, float, float, int]] = []
        self._sync_at: Optional[tuple[int, np.ndarray, np.ndarray]] = None  # (kept CPU ops, _sync_ops)
        self._kernel_launches: tuple[array[int], array[float]] = (array("q"), array("d"))
        self._repeated_api_calls = 0
        # fwdbwd flows in trace order: starts (id hash, forward op tid, ts) and ends (autograd node op tid, ts, id hash)
        self._flow_s: tuple[array[int], array[int], array[float]] = (array("q"), array("q"), array("d"))
        self._flow_e: tuple[array[int], array[float], array[int]] = (array("q"), array("d"), array("q"))
        self._flows_done: Optional[tuple[np.ndarray, ...]] = None
        self._ended = False  # end_pass: the calls and flow events above freed, their answers kept
        self._launches_dropped = False  # drop_launches: the launch table and kernel launches freed too
        self.comm_ops: dict[int, dict[str, Any]] = {}  # External id -> collective, group ref, size, bytes
        self.cpu_ops = CpuOpStore(bucket_ops)  # every cpu_op, on disk: start, dur as recorded, thread, name index
        self.compile_spans: list[tuple[int, float, float]] = []  # torch.compile's own ops: (tid, start, end)
        self.compile_ids: list[tuple[float, str]] = []  # (ts, dynamo compile id "frame/attempt") from annotations
        self.gc_spans: list[tuple[float, float, int]] = []  # Python garbage collections: (start, end, generation)
        self._op_names: dict[str, int] = {}
        self.op_name_list: list[str] = []
        self._op_kinds: list[int] = []  # per op name: what it is (_COMPILE | _BWD_NODE | _FLOP | _FLOW_BACKWARD)
        self._flow_fwd_op: dict[tuple[int, float], int] = {}  # FLOW_FORWARD op (tid, ts) -> FLOP-known op index
        self._flow_bwd_ops: list[tuple[str, int, float, float]] = []  # FLOW_BACKWARD ops: (name, tid, ts, dur)

    def add(self, ev: dict[str, Any], cat: Any, ts: float, dur: float) -> None:
        """Consume one complete (``ph: X``) or flow event of category ``cat`` with a valid ``ts`` (and ``dur`` for
        X)."""
        tid = ev.get("tid")
        if type(tid) is not int:
            tid = -1
        if cat == "cpu_op":
            self.add_cpu_op(tid, ev.get("name") or "", ev.get("args"), ts, dur)
        else:
            self._add_other(ev, cat, tid, ts, dur)

    def add_cpu_op(self, tid: int, name: str, args: Optional[dict[str, Any]], ts: float, dur: float) -> None:
        """Consume one CPU op (thread ``tid``, -1 when unknown), the hot path of the trace pass: what an op's name says
        is worked out once per name (:meth:`_op_kind`)."""
        idx = self._op_names.get(name)
        if idx is None:
            idx = self._op_names[name] = len(self.op_name_list)
            self.op_name_list.append(name)
            self._op_kinds.append(self._op_kind(name))
        self.cpu_ops.add(tid, ts, dur, idx)
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
                        self._flow_fwd_op[(tid, ts)] = len(self._flop_op_flops)
                    self._add_flop_op(tid, ts, dur, name, *f)
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

    def _add_other(self, ev: dict[str, Any], cat: Any, tid: int, ts: float, dur: float) -> None:
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
        elif cat in ("cuda_runtime", "cuda_driver", "fwdbwd") and self._ended:
            raise RuntimeError("a CUDA API call or flow after the pass (OpCollector.end_pass)")
        elif cat in ("cuda_runtime", "cuda_driver"):
            args = ev.get("args") or {}
            corr = args.get("correlation")
            name = ev.get("name") or ""
            at = -1
            if isinstance(corr, int) and not isinstance(corr, bool) and _INT64_MIN <= corr <= _INT64_MAX:
                api = self._api
                at = len(api[0])
                api[0].append(corr)
                api[1].append(tid)
                api[2].append(ts)
                api[3].append(name.startswith(KERNEL_LAUNCHES))
                self._api_done = None
            if name in _SYNC_CALLS:
                self._sync_pending.append((name, ts, ts + dur, tid, at))
        elif cat == "fwdbwd":
            fid = ev.get("id")
            if isinstance(fid, (int, str)):
                if ev.get("ph") == "s":
                    s_id, s_tid, s_ts = self._flow_s
                    s_id.append(hash(fid))
                    s_tid.append(tid)
                    s_ts.append(ts)
                elif ev.get("ph") == "f":
                    e_tid, e_ts, e_id = self._flow_e
                    e_tid.append(tid)
                    e_ts.append(ts)
                    e_id.append(hash(fid))
                self._flows_done = None

    def _add_flop_op(self, tid: int, ts: float, dur: float, name: str, kind: str, flops: float, dtype: str) -> None:
        """Record one FLOP-known op (its index is the payload of :attr:`flop_ops`)."""
        what = self._flop_what.get((name, kind, dtype))
        if what is None:
            what = self._flop_what[(name, kind, dtype)] = len(self._flop_what_list)
            self._flop_what_list.append((name, kind, dtype))
        self.flop_ops.add(tid, ts, ts + dur, len(self._flop_op_flops))
        self._flop_op_what.append(what)
        self._flop_op_flops.append(flops)

    def end_pass(self) -> None:
        """The pass is over: work out the CUDA API calls' launch table and repeats (:meth:`_api_calls`) and the
        fwdbwd flows by id (:meth:`_flows`), and free the calls and flow events as collected (25 and 24 bytes each);
        a call or flow event added after it raises RuntimeError."""
        self._api_calls()
        self._flows()
        self._api = (array("q"), array("q"), array("d"), array("b"))
        self._flow_s, self._flow_e = (array("q"), array("q"), array("d")), (array("q"), array("d"), array("q"))
        self._ended = True

    def drop_launches(self) -> None:
        """Free the launch table (:meth:`launch_points`) and the kernel launch calls (:attr:`kernel_launches`), about
        40 bytes a GPU activity, once the activity table and the sanity check have read them (after
        :meth:`end_pass`); asking either afterwards raises RuntimeError. The blocking calls and the count of repeated
        calls stay."""
        if not self._ended:
            raise RuntimeError("the launch table is dropped after the pass (OpCollector.end_pass)")
        empty = np.zeros(0, dtype=np.int64)
        self._api_done = (empty, empty, np.zeros(0))
        self._kernel_launches = (array("q"), array("d"))
        self._launches_dropped = True

    def _launches(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_api_calls`, which :meth:`drop_launches` has not freed (else RuntimeError)."""
        if self._launches_dropped:
            raise RuntimeError("the launch table was dropped (OpCollector.drop_launches)")
        return self._api_calls()

    def _api_calls(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The CUDA API calls' launch table: sorted correlation ids and, of each, the thread and start (us) of its
        last call. Also sets what the repeats decide: a call is a repeat when the previous call of its correlation
        has the same thread and start (the same call recorded twice); repeats are counted and no launch or blocking
        call."""
        if self._api_done is None:
            corr, tid = np.frombuffer(self._api[0], dtype=np.int64), np.frombuffer(self._api[1], dtype=np.int64)
            ts, launch = np.frombuffer(self._api[2], dtype=np.float64), np.frombuffer(self._api[3], dtype=np.int8)
            order = np.argsort(corr, kind="stable")
            c, t, x = corr[order], tid[order], ts[order]
            same = c[1:] == c[:-1]
            repeat = np.zeros(corr.size, dtype=bool)
            repeat[order[1:][same & (t[1:] == t[:-1]) & (x[1:] == x[:-1])]] = True
            self._repeated_api_calls = int(repeat.sum())
            kept = (launch != 0) & ~repeat
            self._kernel_launches = (array("q", corr[kept].tobytes()), array("d", ts[kept].tobytes()))
            self._sync_calls = [(name, a, b, t_) for name, a, b, t_, at in self._sync_pending
                                if at < 0 or not repeat[at]]
            last = np.append(~same, True) if corr.size else np.zeros(0, dtype=bool)
            self._api_done = (c[last], t[last], x[last])
        return self._api_done

    @property
    def kernel_launches(self) -> tuple[array[int], array[float]]:
        """Correlation and start (us) of each kernel launch call (:data:`KERNEL_LAUNCHES`), repeats left out."""
        self._launches()
        return self._kernel_launches

    @property
    def repeated_api_calls(self) -> int:
        """CUDA API calls recorded twice (same correlation, thread and start), left out."""
        self._api_calls()
        return self._repeated_api_calls

    @property
    def sync_calls(self) -> list[tuple[str, float, float, int]]:
        """Blocking CUDA runtime calls (:data:`_SYNC_CALLS`), repeats left out: ``(name, start, end, tid)``."""
        self._api_calls()
        return self._sync_calls

    def _flows(self) -> tuple[np.ndarray, ...]:
        """``(s_id, s_tid, s_ts, e_tid, e_ts, e_id)``: the fwdbwd flows' starts by id (sorted id hashes, the last start
        of each) and their ends by autograd node op (each ``(tid, ts)`` once, with the last end's id, in the order of
        its first end)."""
        if self._flows_done is None:
            fs_id = np.frombuffer(self._flow_s[0], dtype=np.int64)
            fs_tid = np.frombuffer(self._flow_s[1], dtype=np.int64)
            fs_ts = np.frombuffer(self._flow_s[2], dtype=np.float64)
            fe_tid = np.frombuffer(self._flow_e[0], dtype=np.int64)
            fe_ts = np.frombuffer(self._flow_e[1], dtype=np.float64)
            fe_id = np.frombuffer(self._flow_e[2], dtype=np.int64)
            order = np.argsort(fs_id, kind="stable")
            last = np.append(fs_id[order][1:] != fs_id[order][:-1], True) if order.size else np.zeros(0, dtype=bool)
            s_pick = order[last]
            order = np.lexsort((fe_ts, fe_tid))  # stable: a key's ends stay in trace order
            k_tid, k_ts = fe_tid[order], fe_ts[order]
            new = np.ones(order.size, dtype=bool)
            new[1:] = (k_tid[1:] != k_tid[:-1]) | (k_ts[1:] != k_ts[:-1])
            first, lastk = order[new], order[np.append(new[1:], True)] if order.size else order
            by_first = np.argsort(first, kind="stable")
            first, lastk = first[by_first], lastk[by_first]
            self._flows_done = (fs_id[s_pick], fs_tid[s_pick], fs_ts[s_pick], fe_tid[first], fe_ts[first],
                                fe_id[lastk])
        return self._flows_done

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
    def launch_points(self, corr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tid, ts) of each activity's launch call (``corr``: int64 correlation ids); tid -1 / ts NaN when the call
        is not in the trace."""
        c, t, x = self._launches()
        at = np.minimum(np.searchsorted(c, corr), max(c.size - 1, 0))
        hit = c[at] == corr if c.size else np.zeros(corr.size, dtype=bool)
        return np.where(hit, t[at] if c.size else -1, -1), np.where(hit, x[at] if c.size else np.nan, np.nan)

    def attribute(self, tids: np.ndarray, pts: np.ndarray, cats: Sequence[Optional[str]], in_optimizer: np.ndarray,
                  is_comm: np.ndarray) -> Placement:
        """Part, layer and phase of each activity (module docstring) launched on thread ``tids`` at ``pts`` (us,
        NaN: launch unknown), of category ``cats`` (:func:`sftprof.analysis.trace.kernel_names.kernel_category`, or
        :func:`~sftprof.analysis.trace.kernel_names.cpu_op_category` for CPU ops; a list or
        :class:`~sftprof.analysis.time.gpu_activity.Labels`), launched inside the optimizer step (``in_optimizer``),
        an NCCL kernel or host collective (``is_comm``)."""
        cat = cats if isinstance(cats, Labels) else Labels.of(cats)
        in_opt, comm = np.asarray(in_optimizer, dtype=bool), np.asarray(is_comm, dtype=bool)
        valid = ~np.isnan(pts)
        node = self.bwd_nodes.innermost(tids, np.where(valid, pts, -np.inf))
        in_node = node >= 0
        phase = np.full(pts.size, PHASES.index("other"), dtype=np.int8)
        if not self.has_regions:
            # Phase without ranges: inside a backward node is backward, except directly inside megatron-core's
            # CheckpointFunctionBackward, which re-runs the forward (full recompute).
            ckpt = np.zeros(pts.size, dtype=bool)
            ckpt[in_node] = np.frombuffer(self.bwd_nodes.payload, dtype=np.int64)[node[in_node]] != 0
            phase[~in_node & valid] = PHASES.index("forward")
            phase[in_node] = np.where(ckpt[in_node], PHASES.index("recompute"), PHASES.index("backward"))
            phase[in_opt] = PHASES.index("optimizer")
            names = ["optimizer"] + [f"kernel:{c}" for c in cat.names] + ["kernel:None"]  # the last: no category
            part = np.where(in_opt, 0, np.where(cat.codes >= 0, cat.codes.astype(np.int64) + 1, len(names) - 1))
            return Placement(Labels(names, part), Labels([], np.full(pts.size, -1, dtype=np.int8)),
                             Labels(list(PHASES), phase), "kernel_name")
        reg = self.regions.innermost(tids, np.where(valid, pts, -np.inf))
        rst = np.frombuffer(self.regions.start, dtype=np.float64)
        rpay = np.frombuffer(self.regions.payload, dtype=np.int64)
        nst = np.frombuffer(self.bwd_nodes.start, dtype=np.float64)
        # Forward op of each backward node: the flow ending inside the node (at its XBackward op) starts at
        # the forward op; the model-part range containing that op gives the part (node_key: its range's key).
        node_key = np.full(len(self.bwd_nodes), -1, dtype=np.int64)
        s_id, s_tid, s_ts, e_tid, e_ts, e_id = self._flows()
        started = np.isin(e_id, s_id)
        owner = self.bwd_nodes.innermost(e_tid[started], e_ts[started])
        f_nodes, first = np.unique(owner, return_index=True)  # the first end inside each node counts
        first, f_nodes = first[f_nodes >= 0], f_nodes[f_nodes >= 0]
        if f_nodes.size:
            at_start = np.searchsorted(s_id, e_id[started][first])
            at = self.regions.innermost(s_tid[at_start], s_ts[at_start])
            node_key[f_nodes[at >= 0]] = rpay[at[at >= 0]]
        # a range inside the node (recompute in backward) wins
        in_range = reg >= 0
        in_range[in_range & in_node] = rst[reg[in_range & in_node]] >= nst[node[in_range & in_node]]
        key = np.full(pts.size, -1, dtype=np.int64)  # the range key that gives the part and layer
        key[in_range] = rpay[reg[in_range]]
        by_node = ~in_range & in_node
        key[by_node] = node_key[node[by_node]]
        rec = np.array([r for _, _, r in self._region_keys], dtype=bool)
        phase[in_range] = np.where(rec[key[in_range]], PHASES.index("recompute"), PHASES.index("forward"))
        phase[by_node] = PHASES.index("backward")
        phase[~in_range & ~in_node & in_opt] = PHASES.index("optimizer")
        names = list(dict.fromkeys([p for p, _, _ in self._region_keys]
                                   + ["attn_core", "optimizer", "comm_outside", "outside_parts"]))
        part_of = np.array([names.index(p) for p, _, _ in self._region_keys] + [-1], dtype=np.int64)
        part = np.where(in_opt, names.index("optimizer"),
                        np.where(comm, names.index("comm_outside"), names.index("outside_parts")))
        ranged = key >= 0
        part[ranged] = part_of[key[ranged]]
        if "attention" in cat.names and "attn_other" in names:  # Hugging Face attention: the core is a function
            # inside the attention module
            attn = ranged & (part == names.index("attn_other")) & (cat.codes == cat.names.index("attention"))
            part[attn] = names.index("attn_core")
        layer_names = sorted({lay for _, lay, _ in self._region_keys if lay is not None})
        layer_of = np.array([layer_names.index(lay) if lay is not None else -1 for _, lay, _ in self._region_keys]
                            + [-1], dtype=np.int64)
        return Placement(Labels(names, part), Labels(layer_names, layer_of[key]), Labels(list(PHASES), phase),
                         "module_regions")

    def launch_sites(self, tids: np.ndarray, pts: np.ndarray) -> tuple[list[str], np.ndarray]:
        """``(labels, site)``: the name of the innermost named op around each launch point as an index into the
        distinct names ``labels`` (``site``, int32; -1 when there is none).

        A named op is a CPU op whose name is not a library op (no ``::``, so ``aten::*`` is left out): a
        custom autograd Function's forward (``_VocabParallelLogprobs``, ``CheckpointFunction``), an autograd
        node in backward (``_VocabParallelLogprobsBackward``, ``MulBackward0``; a node's
        ``autograd::engine::evaluate_function: X`` op counts as ``X``), ``record_param_comms`` ...

        Args:
            tids, pts: launch thread (int64) and launch time (us, NaN when unknown) per activity, as
                :meth:`launch_points` gives them.
        """
        names = [n[len(BWD_NODE):] if n.startswith(BWD_NODE) else n if "::" not in n else None
                 for n in self.op_name_list]
        labels = list(dict.fromkeys(n for n in names if n is not None))
        index = {label: k for k, label in enumerate(labels)}
        label_of = np.array([-1 if n is None else index[n] for n in names] + [-1], dtype=np.int32)  # [-1]: none
        _, at = self.cpu_ops.innermost(tids, pts, label_of[:-1] >= 0)
        return labels, label_of[at]

    def _sync_ops(self) -> tuple[np.ndarray, np.ndarray]:
        """Per blocking call (:attr:`sync_calls`, in their order): the index and name index of the innermost kept CPU
        op around its start on its thread (-1: none); found once per number of kept ops."""
        kept = len(self.cpu_ops)
        if self._sync_at is None or self._sync_at[0] != kept:
            calls = self.sync_calls
            self._sync_at = (kept, *self.cpu_ops.innermost(np.array([s[3] for s in calls], dtype=np.int64),
                                                           np.array([s[1] for s in calls], dtype=np.float64)))
        return self._sync_at[1], self._sync_at[2]

    def blocking_calls(self) -> tuple[np.ndarray, list[str]]:
        """End times (us, sorted) of the blocking CUDA calls and, for each, the innermost CPU op on its
        thread around it (``aten::nonzero``, ``aten::_local_scalar_dense``; the call's own name when it
        was made outside every op)."""
        if not self.sync_calls:
            return np.zeros(0), []
        _, name = self._sync_ops()
        by_end = sorted(range(len(self.sync_calls)), key=lambda i: self.sync_calls[i][2])
        return (np.array([self.sync_calls[i][2] for i in by_end], dtype=np.float64),
                [self.op_name_list[int(name[i])] if name[i] >= 0 else self.sync_calls[i][0] for i in by_end])

    def _link_flow_backward(self) -> None:
        """Give each backward op of :data:`~sftprof.analysis.time.op_flops.FLOW_BACKWARD` 2x the FLOPs of the forward op
        its fwdbwd flow starts at (once, after the pass: flows and ops arrive in any order); one without a linked
        forward op stays without."""
        if not self._flow_bwd_ops:
            return
        s_id, s_tid, s_ts, e_tid, e_ts, e_id = self._flows()
        near = np.flatnonzero(np.isin(e_ts, np.array([op[2] for op in self._flow_bwd_ops], dtype=np.float64)))
        end_of = {(int(e_tid[i]), float(e_ts[i])): int(e_id[i]) for i in near.tolist()}
        for name, tid, ts, dur in self._flow_bwd_ops:
            fid = end_of.get((tid, ts))
            j = int(np.searchsorted(s_id, fid)) if fid is not None else s_id.size
            k = self._flow_fwd_op.get((int(s_tid[j]), float(s_ts[j]))) if j < s_id.size and s_id[j] == fid else None
            if k is None:
                continue
            _, kind, flops, dtype = self.flop_info_of(k)
            self._add_flop_op(tid, ts, dur, name, f"{kind} backward" if kind in CORE_PART else kind, 2 * flops, dtype)
        self._flow_bwd_ops = []

    def flop_op_of(self, tids: np.ndarray, pts: np.ndarray) -> np.ndarray:
        """Index into the FLOP-known ops (innermost containing the launch point), -1 when none."""
        self._link_flow_backward()
        return self.flop_ops.innermost(tids, np.where(np.isnan(pts), -np.inf, pts))

    def flop_info(self, k: int) -> tuple[str, str, float, str]:
        """``(op name, kind, FLOPs, dtype)`` of the ``k``-th interval of :attr:`flop_ops` (:meth:`flop_op_of`)."""
        return self.flop_info_of(int(np.frombuffer(self.flop_ops.payload, dtype=np.int64)[k]))

    def flop_info_of(self, op: int) -> tuple[str, str, float, str]:
        """``(op name, kind, FLOPs, dtype)`` of FLOP-known op ``op`` (in the order they were recorded)."""
        name, kind, dtype = self._flop_what_list[self._flop_op_what[op]]
        return name, kind, self._flop_op_flops[op], dtype

    def self_times(self, lo: float, hi: float, top: int) -> list[HostOpRow]:
        """CPU ops in [lo, hi] by self time (own time minus the ops nested directly in it), top ``top``.

        Also gives the inclusive time, and flags ops that contain a blocking CUDA call
        (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``):
        their ``sync_wait_ms`` is the time of those calls inside them (each call's time goes to the innermost op
        around it on its thread). Every sum per name runs in the order of the ops.
        """
        if not len(self.cpu_ops):
            return []
        n = len(self.op_name_list)
        wait = np.zeros(n)
        if self.sync_calls:
            a = np.array([s[1] for s in self.sync_calls])
            b = np.array([s[2] for s in self.sync_calls])
            at, at_name = self._sync_ops()
            ok = at >= 0
            st, en = self.cpu_ops.spans(at[ok])
            ok[ok] = (en >= b[ok]) & (st >= lo) & (st <= hi)  # around the call, in the window
            _, first, per_call = np.unique(at[ok], return_index=True, return_inverse=True)  # the ops, in order
            sync = np.zeros(first.size)
            np.add.at(sync, per_call, (b - a)[ok])  # each op's calls in the calls' order
            np.add.at(wait, at_name[ok][first], sync)
        own, incl = np.zeros(n), np.zeros(n)
        calls = np.zeros(n, dtype=np.int64)
        for _, name, own_us, incl_us in self.cpu_ops.self_us(lo, hi):
            np.add.at(own, name, own_us)
            np.add.at(incl, name, incl_us)
            calls += np.bincount(name, minlength=n)
        self_us, inclusive, wait_us = own.tolist(), incl.tolist(), wait.tolist()
        top_rows = sorted(np.flatnonzero(calls).tolist(), key=lambda j: (-self_us[j], self.op_name_list[j]))[:top]
        return [{"name": self.op_name_list[j], "calls": int(calls[j]), "self_ms": ms(self_us[j]),
                 "inclusive_ms": ms(inclusive[j]), "sync_wait_ms": ms(wait_us[j])} for j in top_rows]

    def op_self_us(self, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        """``(keep, self_us)``: the indexes (into :meth:`CpuOpStore.arrays`, the kept CPU ops, in their order) of
        the CPU ops that start in ``[lo, hi]`` and, per kept op (zero for the others), its self time in us
        (:meth:`CpuOpStore.self_us`); in memory, for the CPU runs' questions."""
        position = np.cumsum(self.cpu_ops.kept) - 1  # an op's index among the kept ones
        own = np.zeros(len(self.cpu_ops))
        keep = [np.zeros(0, dtype=np.int64)]
        for idx, _, own_us, _ in self.cpu_ops.self_us(lo, hi):
            at = position[idx]
            own[at] = own_us
            keep.append(at)
        return np.concatenate(keep), own

    def compile_ms(self, lo: float, hi: float) -> Compile:
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

    def gc_time(self, lo: float, hi: float) -> Optional[GcTime]:
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

    def host_sync_ms(self, lo: float, hi: float) -> HostSync:
        """Blocking CUDA calls in [lo, hi]: count and total time per call name (ms)."""
        by: dict[str, list[Any]] = defaultdict(lambda: [0, 0.0])
        for name, a, b, _ in self.sync_calls:
            if lo <= a <= hi:
                by[name][0] += 1
                by[name][1] += b - a
        return {"total_ms": ms(sum(v[1] for v in by.values())),
                "by_call": {k: {"calls": v[0], "ms": ms(v[1])} for k, v in sorted(by.items())}}
