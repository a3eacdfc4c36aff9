"""Trace Event Format rules that Perfetto's JSON importer and strict JSON parsers rely on.

Two uses:

- :func:`event_problem` says why one input event cannot be used (missing or impossible times, a
  field of the wrong type); postprocessing counts such events, keeps them out of every figure and
  every view, and names them in the summary (``sftprof/analysis/time/trace_summary.py``).
- :func:`validate_trace` checks a written view against the rules below; the tests run it on
  every view (``python -m sftprof.analysis.trace.check FILE...`` runs it from the shell).

Rules (Trace Event Format, https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU,
as Perfetto's JSON importer applies them):

1. strict JSON (RFC 8259): no ``NaN``/``Infinity``; an object with a ``traceEvents`` array;
2. required fields per phase: ``X`` name/ts/dur >= 0/pid/tid; ``i`` name/ts/pid; ``s``/``f`` id/ts/pid/tid
   (``bp`` only ``"e"``); ``M`` a known metadata name, pid (and tid for ``thread_*``), its ``args`` value;
   times are finite numbers;
3. ``pid`` and ``tid`` are integers in ``0 .. 2**31 - 1`` (Perfetto reads them as 32-bit);
4. flows: every ``(cat, id)`` has exactly one ``s`` and one ``f``, each bound inside an ``X`` slice of its
   own track (an ``s`` or a ``bp: "e"`` ``f`` binds to the slice enclosing its ``ts``);
5. ``X`` slices of one track (``pid``, ``tid``) nest properly: none starts inside another and ends after it
   (compared in integer nanoseconds, as the importer stores them);
6. at most one ``process_name`` per pid and one ``thread_name`` per track.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
from collections import defaultdict
from typing import Any, NoReturn


__all__ = ["MAX_TID", "UNTIMED", "CATEGORY_ALIASES", "CATEGORY_ALIAS_NOTE", "event_problem", "finite_json",
           "is_finite_number", "validate_trace"]

MAX_TID = 2**31 - 1
UNTIMED = "GPU activity without timing (ts 0 or dur 0)"  # CUPTI's "no timing collected"; a kind of event_problem
_GPU_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# Categories as other kineto versions spell them (pytorch/kineto#659) -> today's; read so wherever a category is read
CATEGORY_ALIASES = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset", "Runtime": "cuda_runtime",
                    "Operator": "cpu_op"}
CATEGORY_ALIAS_NOTE = "categories of another kineto version read as today's (" + ", ".join(
    f"{a} as {b}" for a, b in CATEGORY_ALIASES.items()) + ")"
_METADATA = {"process_name": ("name", str), "thread_name": ("name", str), "process_labels": ("labels", str),
             "process_sort_index": ("sort_index", int), "thread_sort_index": ("sort_index", int)}
_TIMED = frozenset("XBEiIstfCbenPOND")
_NUMBERS = (int, float)
_Slice = tuple[int, int, Any]  # an X slice of validate_trace: start ns, end ns, name


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_finite_number(v: Any) -> bool:
    """Whether ``v`` is an int or float (not a bool) with a finite value."""
    return _number(v) and math.isfinite(v)


def _id(v: object) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, str)


def event_problem(ev: dict[str, Any]) -> str | None:
    """Why ``ev`` (one parsed trace event) cannot be used, or None when it can.

    Kinds (stable strings, counted in the summary): ``"no phase"``, ``"non-string name"``,
    ``"non-string cat"``, ``"args not an object"``, ``"missing ts"``, ``"non-numeric ts"``,
    ``"non-finite ts"``, and for complete (``X``) events ``"missing dur"``, ``"non-numeric dur"``,
    ``"non-finite dur"``, ``"negative dur"``, and :data:`UNTIMED` for a GPU activity (kernel, memcpy, memset)
    whose ``ts`` or ``dur`` is 0: CUPTI writes 0 when it collected no timing for the activity, which ran all the
    same. Metadata events (``M``) need no time.
    """
    ph, name, cat, args = ev.get("ph"), ev.get("name"), ev.get("cat"), ev.get("args")
    # Fast path (nearly every event): plain types, finite times (x - x == 0 is False for NaN and ±inf).
    if (name is None or type(name) is str) and (cat is None or type(cat) is str) and \
            (args is None or type(args) is dict):
        if ph == "M":
            return None
        ts: Any = ev.get("ts")  # JSON: checked here
        if type(ts) in _NUMBERS and ts - ts == 0 and type(ph) is str:
            if ph != "X":
                return None
            dur: Any = ev.get("dur")
            if type(dur) in _NUMBERS and dur - dur == 0 and dur >= 0 and (dur and ts or cat not in _GPU_ACTIVITIES):
                return None
    if not isinstance(ph, str):
        return "no phase"
    if name is not None and not isinstance(name, str):
        return "non-string name"
    if cat is not None and not isinstance(cat, str):
        return "non-string cat"
    if args is not None and not isinstance(args, dict):
        return "args not an object"
    if ph == "M":
        return None
    for key in ("ts", "dur") if ph == "X" else ("ts",):
        v = ev.get(key)
        if v is None:
            return f"missing {key}"
        if not _number(v):
            return f"non-numeric {key}"
        if not math.isfinite(v):
            return f"non-finite {key}"
    if ph == "X" and ev["dur"] < 0:
        return "negative dur"
    if ph == "X" and cat in _GPU_ACTIVITIES and not (ev["dur"] and ev["ts"]):
        return UNTIMED
    return None


def finite_json(value: Any) -> tuple[Any, int]:
    """``value`` with every non-finite float (``NaN``, ``±Infinity``) replaced by None, and how many were.

    Returns the value itself (not a copy) when nothing is replaced.
    """
    if isinstance(value, float):
        return (value, 0) if math.isfinite(value) else (None, 1)
    if isinstance(value, dict):
        out, n = {}, 0
        for k, v in value.items():
            out[k], m = finite_json(v)
            n += m
        return (out, n) if n else (value, 0)
    if isinstance(value, list):
        items = [finite_json(v) for v in value]
        n = sum(m for _, m in items)
        return ([v for v, _ in items], n) if n else (value, 0)
    return value, 0


def _track_id_ok(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TID


def _check_fields(ev: dict[str, Any]) -> str | None:
    ph = ev.get("ph")
    if not isinstance(ph, str):
        return "no 'ph'"
    if ph == "M":
        spec = _METADATA.get(ev.get("name", ""))
        if spec is None:
            return f"unknown metadata name {ev.get('name')!r}"
        if not _track_id_ok(ev.get("pid")) or (ev["name"].startswith("thread_") and not _track_id_ok(ev.get("tid"))):
            return f"metadata {ev['name']} without a 32-bit integer pid/tid"
        key, typ = spec
        args = ev.get("args")
        if not isinstance(args, dict) or not isinstance(args.get(key), typ) or isinstance(args.get(key), bool):
            return f"metadata {ev['name']} without args.{key} of type {typ.__name__}"
        return None
    if ph not in _TIMED:
        return f"unknown phase {ph!r}"
    problem = event_problem(ev)
    if problem:
        return problem
    if not _track_id_ok(ev.get("pid")):
        return f"pid {ev.get('pid')!r} is not an integer in 0..2**31-1"
    if ph in "XBEstf" and not _track_id_ok(ev.get("tid")):
        return f"tid {ev.get('tid')!r} is not an integer in 0..2**31-1"
    if ph in "XiI" and not isinstance(ev.get("name"), str):
        return f"'{ph}' event without a name"
    if ph in "stf":
        if not _id(ev.get("id")):
            return "flow event without an id"
        if "bp" in ev and ev["bp"] != "e":
            return f"flow binding point {ev['bp']!r} (only 'e' is defined)"
    return None


def _encloses(track: tuple[list[int], list[int], list[int]], t: int) -> bool:
    """Whether a properly nested track (starts sorted, ends, parent index or -1) has a slice containing ``t``."""
    starts, ends, parent = track
    j = bisect.bisect_right(starts, t) - 1
    while j >= 0 and ends[j] < t:
        j = parent[j]
    return j >= 0


def _refuse_constant(token: str) -> NoReturn:
    raise ValueError(f"non-finite number {token} (not RFC 8259 JSON)")


def validate_trace(path: str, max_problems: int = 20) -> list[str]:
    """Problems of one Chrome-trace file against the rules in the module docstring ([] when valid).

    Loads the whole file (meant for views of test and debugging size, not multi-GB traces).

    Args:
        path: ``.json`` or ``.json.gz`` trace.
        max_problems: examples kept per rule; the last line of each rule's list gives its total count.

    Returns:
        Human-readable problems, e.g. ``"event 12: negative dur"`` or
        ``"track (3285, 3658): 'sftprof/backward/mb0' [1.0, 69.0] ms overlaps 'X' [0.5, 1.2] ms partially"``.
    """
    problems: dict[str, list[str]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)

    def report(rule: str, msg: str) -> None:
        counts[rule] += 1
        if len(problems[rule]) < max_problems:
            problems[rule].append(msg)

    tracks: dict[tuple[int, int], list[_Slice]] = defaultdict(list)  # (pid, tid) -> its X slices
    # (cat, id) -> its ends (phase, pid, tid, ts ns, bp)
    flows: dict[tuple[Any, Any], list[tuple[str, int, int, int, Any]]] = defaultdict(list)
    names: dict[tuple[str, int, Any], int] = defaultdict(int)
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            data = json.loads(f.read(), parse_constant=_refuse_constant)
    except OSError as exc:
        return [f"{path}: cannot be read: {exc.strerror or exc}"]
    except (ValueError, EOFError) as exc:
        return [f"{path}: not strict JSON: {exc}"]
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        return [f"{path}: no traceEvents array"]
    for k, ev in enumerate(events):
        bad = _check_fields(ev) if isinstance(ev, dict) else "not an object"
        if bad:
            report("fields", f"event {k}: {bad}: {ev!r:.200}")
            continue
        ph = ev["ph"]
        if ph == "M":
            if ev["name"] in ("process_name", "thread_name"):
                key = (ev["name"], ev["pid"], ev.get("tid") if ev["name"] == "thread_name" else None)
                names[key] += 1
            continue
        if ph == "X":
            start = round(ev["ts"] * 1000)
            tracks[(ev["pid"], ev["tid"])].append((start, start + round(ev["dur"] * 1000), ev.get("name")))
        elif ph in "sf":
            flows[(ev.get("cat"), ev["id"])].append((ph, ev["pid"], ev["tid"], round(ev["ts"] * 1000), ev.get("bp")))
    for (kind, pid, tid), n in names.items():
        if n > 1:
            report("names", f"{n} {kind} records for pid {pid}" + (f" tid {tid}" if tid is not None else ""))
    index: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}
    for track, slices in tracks.items():
        slices.sort(key=lambda s: (s[0], -s[1]))
        kept: list[_Slice] = []
        starts: list[int] = []
        ends: list[int] = []
        parent: list[int] = []
        stack: list[int] = []  # indexes (into kept) of the open slices, innermost last
        for s in slices:
            while stack and ends[stack[-1]] <= s[0]:
                stack.pop()
            if stack and s[1] > ends[stack[-1]]:
                p = kept[stack[-1]]
                report("nesting", f"track {track}: {s[2]!r} [{s[0] / 1e6:.3f}, {s[1] / 1e6:.3f}] ms overlaps "
                                  f"{p[2]!r} [{p[0] / 1e6:.3f}, {p[1] / 1e6:.3f}] ms partially")
                continue
            parent.append(stack[-1] if stack else -1)
            stack.append(len(kept))
            kept.append(s)
            starts.append(s[0])
            ends.append(s[1])
        index[track] = (starts, ends, parent)
    for flow, flow_ends in flows.items():
        phases = sorted(e[0] for e in flow_ends)
        if phases != ["f", "s"]:
            report("flows", f"flow {flow}: phases {phases} (expected one 's' and one 'f')")
            continue
        for ph, pid, tid, t, bp in flow_ends:
            if ph == "f" and bp != "e":
                continue  # binds to the next slice; not used by this project's views
            if not _encloses(index.get((pid, tid), ([], [], [])), t):
                report("binding", f"flow {flow}: '{ph}' at {t / 1e6:.3f} ms on track ({pid}, {tid}) is inside no slice")
    out = []
    for rule in ("fields", "names", "nesting", "flows", "binding"):
        out += problems[rule]
        if counts[rule] > len(problems[rule]):
            out.append(f"... {counts[rule]} '{rule}' problems in all")
    return out


def main(argv: list[str] | None = None) -> int:
    """Validate trace files; prints each file's problems; exit status 1 when any file has one (or cannot be read),
    2 on bad arguments (none given)."""
    p = argparse.ArgumentParser(prog="python -m sftprof.analysis.trace.check",
                                description="Check Chrome-trace files (.json, .json.gz) against the Trace Event "
                                            "Format rules Perfetto's JSON importer relies on.",
                                epilog="exit status: 0 every file is valid, 1 a file has a problem or cannot be read, "
                                       "2 bad arguments")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="a trace file to check")
    bad = 0
    for path in p.parse_args(argv).traces:
        problems = validate_trace(path)
        print(f"{path}: {'ok' if not problems else f'{len(problems)} problems'}")
        for problem in problems:
            print(f"  {problem}")
        bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    from sftprof.cli import run_main

    run_main(main)
