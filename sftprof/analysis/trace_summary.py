"""Kernel summary of one rank's torch.profiler Chrome trace, computed in a single streaming pass.

Feed every usable event to :meth:`KernelTraceAnalyzer.add` and every invalid one (no time,
negative or non-finite ``dur``, ...) to :meth:`KernelTraceAnalyzer.add_invalid`
(``sftprof.analysis.views.split_trace`` does both while it writes the views), then call
:meth:`KernelTraceAnalyzer.summary`. Memory is O(number of GPU activities + CUDA launches + CPU ops), a few dozen bytes each, never O(trace bytes).

Definitions (all times in ms, from the trace's microsecond ``ts``/``dur``):

* GPU activity: events of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset``.
* Step window: the ``sftprof/step`` user annotation (else the longest ``ProfilerStep#N``,
  else the span of all GPU activity), extended to the end of the last GPU activity launched
  inside it (kernels run asynchronously after the CPU leaves the region).
* GPU busy share: length of the union of GPU activity intervals (all streams) inside the step
  window, divided by the window length; idle share = 1 - busy share.
* Category time: sum of activity durations per category; shares are relative to the total GPU
  activity time, so they sum to 100 %. Kernels launched inside ``sftprof/optimizer_step`` count
  as ``optimizer`` (except collectives); other kernels are classified by name.
* Communication hidden / exposed: with C the union of NCCL kernel intervals and K the union of
  all other GPU activity intervals on the same device, hidden = |C ∩ K| and exposed = |C| - hidden
  (the usual overlap definition, e.g. Holistic Trace Analysis' comm/comp overlap). Host-side
  collective ops (``gloo:*``/``nccl:*`` annotations or cpu_ops; the only communication of CPU runs) are reported
  separately as ``communication.host_ops`` (wall time = union of their intervals).
* Region time: per ``sftprof/...`` user annotation, its CPU wall time and the GPU time of the
  activities whose launching CUDA API call (matched by ``correlation`` id) lies inside it.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np

from sftprof import artifacts
from sftprof.analysis import step_breakdown

__all__ = ["KernelTraceAnalyzer", "kernel_category", "collective_group_label", "short_kernel_name", "TOP_KERNELS",
           "invalid_events_error", "invalid_events_message", "INVALID_SHARE_LIMIT"]

TOP_KERNELS = 20
INVALID_SHARE_LIMIT = 0.5  # a trace whose invalid events exceed this share of its events is an error
_INVALID_EXAMPLES = 3
TOP_CPU_OPS = 15
GPU_ACTIVITY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
REGION_PREFIX = artifacts.REGION_PREFIX
OPTIMIZER_REGION = artifacts.OPTIMIZER_STEP
STEP_REGION = artifacts.STEP

# Ordered (category, pattern) rules on the lower-cased kernel name; first match wins.
_RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn|softmax_warp_forward_causal|mha_")),
    ("MoE routing/permutation", re.compile(
        r"moe|permut|topk|top_k|sort|radix|scatter|gather|index|histogram|histc|bincount|cumsum|"
        r"router|token_dispatch|masked_select|masked_scatter|nonzero|cub::|write_indices")),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach|optimizer|lamb_|sgd_|l2norm")),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|_mm_|wgmma|splitk|hgemm|sgemm|dot_kernel")),
    ("elementwise/reduction", re.compile(
        r"elementwise|reduce|copy|fill|cat|norm|softmax|triton|unary|binary|functor|pow|mul|add|"
        r"silu|gelu|exp|log|where|clamp|sum|mean|max|min|cross_entropy|rms")),
)
_HOST_COLLECTIVE_PREFIXES = ("gloo:", "nccl:")
_NCCL = re.compile(r"nccl(?:dev)?kernel_([a-z]+)", re.IGNORECASE)

# megatron-core / torch process-group descriptions -> parallelism label.
_PG_LABELS = {
    "TENSOR_MODEL_PARALLEL_GROUP": "TP",
    "CONTEXT_PARALLEL_GROUP": "CP",
    "PIPELINE_MODEL_PARALLEL_GROUP": "PP",
    "DATA_PARALLEL_GROUP": "DP",
    "DATA_PARALLEL_GROUP_WITH_CP": "DP-CP",
    "EXPERT_MODEL_PARALLEL_GROUP": "EP",
    "EXPERT_TENSOR_PARALLEL_GROUP": "ETP",
    "EXPERT_DATA_PARALLEL_GROUP": "EDP",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "TP-DP",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "TP-DP-CP",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "TP-CP",
    "TENSOR_AND_EXPERT_PARALLEL_GROUP": "TP-EP",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "ETP-EP",
    "EMBEDDING_GROUP": "EMB",
    "POSITION_EMBEDDING_GROUP": "POS-EMB",
    "MODEL_PARALLEL_GROUP": "MP",
    "default_pg": "WORLD",
}


def kernel_category(name: str, cat: str = "kernel") -> str:
    """Category of one GPU activity from its trace category and kernel name.

    Args:
        name: kernel name as recorded by CUPTI (e.g. ``nvjet_sm90_tst_256x128_...``).
        cat: trace category, one of ``kernel``, ``gpu_memcpy``, ``gpu_memset``.

    Returns:
        ``memcpy/memset``, ``NCCL <Collective>`` for NCCL kernels (group added by the analyzer),
        or one of ``attention``, ``MoE routing/permutation``, ``optimizer``, ``GEMM``,
        ``elementwise/reduction``, ``other`` (name rules in ``_RULES``, first match wins).
    """
    if cat != "kernel":
        return "memcpy/memset"
    m = _NCCL.search(name)
    if m:
        return f"NCCL {m.group(1)}"
    low = name.lower()
    for label, pattern in _RULES:
        if pattern.search(low):
            return label
    return "other"


_NAMESPACES = re.compile(r"\(anonymous namespace\)::|\b(?:at::native|at::cuda|at|c10|std|cuda::std)::")


def short_kernel_name(name: str, limit: int = 140) -> str:
    """Readable kernel name for tables: no ``void``, common namespaces or parameter list.

    ``void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...Functor<float, 1, 1, 0>,
    std::multiplies<float>, float>(...)`` becomes ``multi_tensor_apply_kernel<..., multiplies<float>,
    float>``; the template arguments are kept because they tell kernels apart. Cut to ``limit`` chars.
    """
    text = _NAMESPACES.sub("", name[5:] if name.startswith("void ") else name)
    depth = 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            text = text[:i]
            break
    return text if len(text) <= limit else text[: limit - 1] + "…"


def collective_group_label(pg_desc: str | None, pg_name: str | None) -> str | None:
    """Short parallelism label (TP, CP, EP, DP, ...) of a process group, or its description/name."""
    if pg_desc:
        return _PG_LABELS.get(pg_desc, pg_desc)
    return f"pg{pg_name}" if pg_name not in (None, "") else None


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals [starts[i], ends[i]) into sorted disjoint intervals."""
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.append(run_end[idx[1:] - 1], run_end[-1])


def _length(starts: np.ndarray, ends: np.ndarray) -> float:
    return float(np.sum(ends - starts)) if starts.size else 0.0


def _intersection_length(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Total length of the intersection of two disjoint, sorted interval sets."""
    (a_s, a_e), (b_s, b_e) = a, b
    if a_s.size == 0 or b_s.size == 0:
        return 0.0
    # Prefix lengths of b; the covered length of b in [x, y) is cov(y) - cov(x).
    prefix = np.concatenate(([0.0], np.cumsum(b_e - b_s)))

    def covered_upto(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(b_s, x, side="right")  # intervals starting at or before x
        full = prefix[np.maximum(i - 1, 0)]
        partial = np.where(i > 0, np.clip(x - b_s[np.maximum(i - 1, 0)], 0, None), 0.0)
        partial = np.minimum(partial, np.where(i > 0, b_e[np.maximum(i - 1, 0)] - b_s[np.maximum(i - 1, 0)], 0.0))
        return full + partial

    return float(np.sum(covered_upto(a_e) - covered_upto(a_s)))


def _clip(iv: tuple[np.ndarray, np.ndarray], lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    s, e = np.clip(iv[0], lo, hi), np.clip(iv[1], lo, hi)
    keep = e > s
    return s[keep], e[keep]


def _int_id(v) -> int:
    """A correlation / External id as an int; -1 when absent or not an integer."""
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def invalid_events_error(invalid: dict) -> str | None:
    """The error of a trace whose invalid events dominate it (more than :data:`INVALID_SHARE_LIMIT`), else None."""
    total, events = invalid["total"], invalid["total"] + invalid["valid_events"]
    if total and total > INVALID_SHARE_LIMIT * events:
        return (f"{total} of {events} events are invalid ({invalid_events_message(invalid)}); "
                "the trace is not usable")
    return None


def invalid_events_message(invalid: dict) -> str:
    """``"3 invalid events left out of every figure and view: negative dur 2, missing ts 1"``."""
    kinds = ", ".join(f"{k} {n}" for k, n in invalid["by_kind"].items())
    return f"{invalid['total']} invalid events left out of every figure and view: {kinds}"


def _ms(us: float) -> float:
    return round(us / 1000.0, 4)


class KernelTraceAnalyzer:
    """Accumulates what the kernel summary needs from a stream of Chrome-trace events.

    Args:
        header: the trace's top-level members (``distributedInfo.pg_config`` maps process-group
            names to descriptions such as ``TENSOR_MODEL_PARALLEL_GROUP``); may also be given later
            via :meth:`set_header`, any time before :meth:`summary`.
    """

    def __init__(self, header: dict | None = None):
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        # per GPU activity (parallel lists)
        self._a_name: list[int] = []
        self._a_kind: list[int] = []  # index into GPU_ACTIVITY_CATS
        self._a_ts: list[float] = []
        self._a_dur: list[float] = []
        self._a_dev: list[int] = []
        self._a_corr: list[int] = []
        self._a_ext: list[int] = []
        self._a_pg: list = []  # process-group (desc, name) from the kernel's own args
        self._comm_ops: dict[int, tuple] = {}  # External id -> process group (desc, name) of a collective op
        self._host_comm: list[tuple[str, float, float]] = []  # gloo:/nccl: collective ops on the host
        self._regions: list[tuple[str, float, float]] = []  # sftprof/* user annotations
        self._profiler_steps: list[tuple[str, float, float]] = []
        self._t_min = float("inf")
        self._t_max = float("-inf")
        self.n_events = 0
        self._pg_desc: dict[str, str] = {}
        self._cpu_us: dict[str, float] = defaultdict(float)  # cpu_op name -> inclusive time (us)
        self._cpu_calls: dict[str, int] = defaultdict(int)
        self._invalid: dict[str, int] = defaultdict(int)
        self._invalid_examples: list[str] = []
        self._notes: dict[str, int] = {}
        self._a_bytes: list[int] = []  # bytes of memcpy/memset activities (0 when not given)
        self._ops = step_breakdown.OpCollector()
        self._device_name: str | None = None
        self._base_ns: int | None = None  # trace ts (us) + base_ns / 1000 = unix us
        if header:
            self.set_header(header)

    def set_header(self, header: dict) -> None:
        """Read process-group descriptions from ``header['distributedInfo']['pg_config']``.

        A ``distributedInfo`` or ``pg_config`` of another type (a damaged header) is ignored: collectives
        are then labelled by the process-group names their own events carry.
        """
        base = header.get("baseTimeNanoseconds") if isinstance(header, dict) else None
        if isinstance(base, int) and not isinstance(base, bool):
            self._base_ns = base
        props = header.get("deviceProperties") if isinstance(header, dict) else None
        if isinstance(props, list) and props and isinstance(props[0], dict) and isinstance(props[0].get("name"), str):
            self._device_name = props[0]["name"]
        info = header.get("distributedInfo") if isinstance(header, dict) else None
        pgs = info.get("pg_config") if isinstance(info, dict) else None
        for pg in pgs if isinstance(pgs, list) else ():
            if isinstance(pg, dict) and "pg_name" in pg:
                desc = pg.get("pg_desc")
                self._pg_desc[str(pg["pg_name"])] = desc if isinstance(desc, str) else None

    def add_invalid(self, kind: str, raw: str) -> None:
        """Count one event left out of every figure (``kind`` from ``trace_check.event_problem``)."""
        self._invalid[kind] += 1
        if len(self._invalid_examples) < _INVALID_EXAMPLES:
            self._invalid_examples.append(f"{kind}: {' '.join(raw.split())[:200]}")

    def add_note(self, what: str, count: int) -> None:
        """Record a repair of the views that changes no figure (e.g. non-finite numbers written as null)."""
        self._notes[what] = count

    @staticmethod
    def _pg_ref(args: dict) -> tuple[str | None, str | None] | None:
        """(description, name) of the process group named in an event's args, if any."""
        name, desc = args.get("Process Group Name"), args.get("Process Group Description")
        if name is None and desc is None:
            return None
        return desc if isinstance(desc, str) else None, None if name is None else str(name)

    def _pg_label(self, ref: tuple[str | None, str | None] | None) -> str | None:
        if ref is None:
            return None
        desc, name = ref
        return collective_group_label(desc or self._pg_desc.get(name), name)

    def add(self, ev: dict) -> None:
        """Consume one usable trace event (any phase/category; irrelevant ones are ignored cheaply).

        Events that ``sftprof.analysis.trace_check.event_problem`` rejects go to :meth:`add_invalid`
        instead (``split_trace`` does this), so that no figure includes them.
        """
        self.n_events += 1
        ph = ev.get("ph")
        if ph != "X":
            if ph in ("s", "f") and ev.get("cat") == "fwdbwd" and isinstance(ev.get("ts"), (int, float)):
                self._ops.add(ev, ev["ts"], 0.0)
            return
        ts = ev.get("ts")
        dur = ev.get("dur")
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            return
        self._ops.add(ev, ts, dur)
        if ts < self._t_min:
            self._t_min = ts
        if ts + dur > self._t_max:
            self._t_max = ts + dur
        cat = ev.get("cat")
        if cat in GPU_ACTIVITY_CATS:
            name = ev.get("name") or ""
            idx = self._names.get(name)
            if idx is None:
                idx = self._names[name] = len(self._name_list)
                self._name_list.append(name)
            args = ev.get("args") or {}
            self._a_name.append(idx)
            self._a_kind.append(GPU_ACTIVITY_CATS.index(cat))
            self._a_ts.append(ts)
            self._a_dur.append(dur)
            dev = ev.get("pid")
            self._a_dev.append(dev if isinstance(dev, int) else -1)
            self._a_corr.append(_int_id(args.get("correlation")))
            self._a_ext.append(_int_id(args.get("External id")))
            self._a_pg.append(self._pg_ref(args))
            nb = args.get("bytes")
            self._a_bytes.append(nb if isinstance(nb, int) and not isinstance(nb, bool) and nb > 0 else 0)
        elif cat == "user_annotation":
            name = ev.get("name") or ""
            if name.startswith(REGION_PREFIX):
                self._regions.append((name, ts, ts + dur))
            elif name.startswith("ProfilerStep#"):
                self._profiler_steps.append((name, ts, ts + dur))
            elif name.startswith(_HOST_COLLECTIVE_PREFIXES):
                self._host_comm.append((name, ts, ts + dur))
        elif cat == "cpu_op":
            name = ev.get("name") or ""
            self._cpu_us[name] += dur
            self._cpu_calls[name] += 1
            if name.startswith(_HOST_COLLECTIVE_PREFIXES):
                self._host_comm.append((name, ts, ts + dur))
            args = ev.get("args")
            if args and ("Process Group Name" in args or "Process Group Description" in args):
                ext = _int_id(args.get("External id"))
                if ext != -1:
                    self._comm_ops[ext] = self._pg_ref(args)

    # -- summary ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Kernel summary as a JSON-serialisable dict (times in ms, shares in percent).

        Keys: ``n_events``, ``step_window`` (source, start_us/end_us on the trace clock, wall_ms, and
        unix_start_s/unix_end_s from the header's ``baseTimeNanoseconds``, None without it),
        ``gpu`` (activities, total_ms, busy_ms, busy_share_pct, idle_share_pct),
        ``top_kernels`` (name, calls, total_ms, share_pct), ``top_cpu_ops`` (name, calls,
        inclusive_ms: an op's own time plus the ops nested in it, over the whole trace), ``categories`` (category, calls,
        total_ms, share_pct; sums to 100 %), ``communication`` (total_ms, hidden_ms, exposed_ms,
        by_type, by_group), ``regions`` (name, start_ms relative to the window, cpu_ms, gpu_ms).
        """
        n = len(self._a_ts)
        ts = np.asarray(self._a_ts, dtype=np.float64)
        dur = np.asarray(self._a_dur, dtype=np.float64)
        end = ts + dur
        kinds = np.asarray(self._a_kind, dtype=np.int64)
        devs = np.asarray(self._a_dev, dtype=np.int64)
        launch = self._ops.launch_points(self._a_corr)[1]  # CUDA API call start (us) per activity, NaN if absent

        regions = sorted(self._regions, key=lambda r: (r[1], r[0]))
        # Category per activity: by name (cached per unique name/kind), then optimizer-region override.
        cat_cache: dict[tuple[int, int], str] = {}
        cats: list[str] = []
        for i in range(n):
            key = (self._a_name[i], self._a_kind[i])
            c = cat_cache.get(key)
            if c is None:
                c = cat_cache[key] = kernel_category(self._name_list[key[0]], GPU_ACTIVITY_CATS[key[1]])
            cats.append(c)
        is_comm = np.array([c.startswith("NCCL ") for c in cats], dtype=bool)
        opt = [r for r in regions if r[0] == OPTIMIZER_REGION]
        if opt and n:
            in_opt = np.zeros(n, dtype=bool)
            for _, lo, hi in opt:
                in_opt |= (launch >= lo) & (launch <= hi)
            for i in np.flatnonzero(in_opt & ~is_comm & (kinds == 0)):
                cats[i] = "optimizer"
        groups: list[str | None] = []
        for i in range(n):
            ref = self._a_pg[i]
            if ref is None and is_comm[i]:
                ref = self._comm_ops.get(self._a_ext[i])
            groups.append(self._pg_label(ref))
        labels = [f"{c} [{g}]" if is_comm[i] and g else c for i, (c, g) in enumerate(zip(cats, groups))]

        # Step window.
        window_src = "none"
        lo = hi = None
        steps = [r for r in regions if r[0] == STEP_REGION]
        if steps:
            _, lo, hi = max(steps, key=lambda r: r[2] - r[1])
            window_src = STEP_REGION
        elif self._profiler_steps:
            _, lo, hi = max(self._profiler_steps, key=lambda r: r[2] - r[1])
            window_src = "ProfilerStep"
        elif n:
            lo, hi = float(ts.min()), float(end.max())
            window_src = "gpu_activity_span"
        elif self._t_min < self._t_max:
            lo, hi = self._t_min, self._t_max
            window_src = "trace_span"
        if lo is not None and window_src in (STEP_REGION, "ProfilerStep") and n:
            launched = (launch >= lo) & (launch <= hi)
            if launched.any():
                hi = max(hi, float(end[launched].max()))

        total_us = float(dur.sum())
        gpu: dict[str, Any] = {"activities": n, "total_ms": _ms(total_us)}
        if n and lo is not None and hi > lo:
            busy = _length(*_clip(_union(ts, end), lo, hi))
            gpu.update(busy_ms=_ms(busy), busy_share_pct=round(100 * busy / (hi - lo), 3),
                       idle_share_pct=round(100 - 100 * busy / (hi - lo), 3))
        else:
            gpu.update(busy_ms=0.0, busy_share_pct=None, idle_share_pct=None)

        # Top kernels (category 'kernel' only), shares of total GPU activity time.
        k_tot: dict[int, float] = defaultdict(float)
        k_calls: dict[int, int] = defaultdict(int)
        for i in np.flatnonzero(kinds == 0):
            k_tot[self._a_name[i]] += self._a_dur[i]
            k_calls[self._a_name[i]] += 1
        top = sorted(k_tot.items(), key=lambda kv: (-kv[1], self._name_list[kv[0]]))[:TOP_KERNELS]
        top_kernels = [{"name": self._name_list[k], "calls": k_calls[k], "total_ms": _ms(t),
                        "share_pct": round(100 * t / total_us, 3) if total_us else 0.0} for k, t in top]

        c_tot: dict[str, float] = defaultdict(float)
        c_calls: dict[str, int] = defaultdict(int)
        for lab, d in zip(labels, self._a_dur):
            c_tot[lab] += d
            c_calls[lab] += 1
        categories = [{"category": c, "calls": c_calls[c], "total_ms": _ms(t),
                       "share_pct": round(100 * t / total_us, 3) if total_us else 0.0}
                      for c, t in sorted(c_tot.items(), key=lambda kv: (-kv[1], kv[0]))]

        communication = self._communication(ts, end, devs, is_comm, cats, groups)
        host_s = np.array([h[1] for h in self._host_comm], dtype=np.float64)
        host_e = np.array([h[2] for h in self._host_comm], dtype=np.float64)
        by_op: dict[str, float] = defaultdict(float)
        for name, h_lo, h_hi in self._host_comm:
            by_op[name] += h_hi - h_lo
        communication["host_ops"] = {"ops": len(self._host_comm), "wall_ms": _ms(_length(*_union(host_s, host_e))),
                                     "by_op_ms": {k: _ms(v) for k, v in sorted(by_op.items())}}
        details = step_breakdown.analyze(
            self._ops, ts=ts, dur=dur, devs=devs, corr=self._a_corr, ext=self._a_ext, cats=cats, is_comm=is_comm,
            groups=groups, names=[self._name_list[k] for k in self._a_name], kinds=kinds,
            nbytes=np.asarray(self._a_bytes, dtype=np.float64), window=(lo, hi),
            optimizer_windows=[(a, b) for _, a, b in opt], device_name=self._device_name,
            intersection=_intersection_length, union=_union)
        region_rows = []
        for name, r_lo, r_hi in regions:
            inside = (launch >= r_lo) & (launch <= r_hi)
            region_rows.append({
                "name": name,
                "start_ms": _ms(r_lo - lo) if lo is not None else None,
                "cpu_ms": _ms(r_hi - r_lo),
                "gpu_ms": _ms(float(dur[inside].sum())) if n else None,
                "gpu_activities": int(inside.sum()),
            })
        return {
            "n_events": self.n_events,
            "invalid_events": {"total": sum(self._invalid.values()), "valid_events": self.n_events,
                               "by_kind": dict(sorted(self._invalid.items(), key=lambda kv: (-kv[1], kv[0]))),
                               "examples": list(self._invalid_examples)},
            "view_repairs": dict(sorted(self._notes.items())),
            "step_window": {"source": window_src, "start_us": lo, "end_us": hi,
                            "wall_ms": _ms(hi - lo) if lo is not None else None,
                            "unix_start_s": (lo + self._base_ns / 1e3) / 1e6 if lo is not None and self._base_ns else None,
                            "unix_end_s": (hi + self._base_ns / 1e3) / 1e6 if lo is not None and self._base_ns else None},
            "gpu": gpu,
            "top_kernels": top_kernels,
            "top_cpu_ops": [{"name": k, "calls": self._cpu_calls[k], "inclusive_ms": _ms(t)} for k, t in
                            sorted(self._cpu_us.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_CPU_OPS]],
            "categories": categories,
            "communication": communication,
            "regions": region_rows,
            **details,
        }

    @staticmethod
    def _communication(ts, end, devs, is_comm, cats, groups) -> dict[str, Any]:
        total = hidden = 0.0
        for dev in np.unique(devs):
            on = devs == dev
            comm = _union(ts[on & is_comm], end[on & is_comm])
            comp = _union(ts[on & ~is_comm], end[on & ~is_comm])
            total += _length(*comm)
            hidden += _intersection_length(comm, comp)
        by_type: dict[str, float] = defaultdict(float)
        by_group: dict[str, float] = defaultdict(float)
        for i in np.flatnonzero(is_comm):
            d = float(end[i] - ts[i])
            by_type[cats[i][len("NCCL "):]] += d
            by_group[groups[i] or "unknown"] += d
        return {
            "kernels": int(is_comm.sum()),
            "total_ms": _ms(total),
            "hidden_ms": _ms(hidden),
            "exposed_ms": _ms(total - hidden),
            "by_type_ms": {k: _ms(v) for k, v in sorted(by_type.items())},
            "by_group_ms": {k: _ms(v) for k, v in sorted(by_group.items())},
        }
