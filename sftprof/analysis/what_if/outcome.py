"""A what-if tried: its prediction (:mod:`sftprof.analysis.what_if.changes`) against the outcome, and whether its assumption
held.

The outcome is the change B - A of the what-if's metric between the trial it varies (A, the source) and the what-if
trial (B, same kind and step, the setting applied), measured where the prediction was made:

- ``step_time``: the step times that time training alone (``stats.jsonl``; the steps compare uses, given by the
  caller), each step a sample: the Hodges-Lehmann shift with its exact 95 % interval
  (:func:`sftprof.analysis.compare.stats.shift`); without such steps on a side, the profiled step's time (one sample);
- ``gpu_time``: the rank's GPU time by model part (its kernel trace): one sample a side;
- ``peak_allocated``, ``peak_reserved``: the rank's memory snapshot: deterministic allocations, an exact
  difference;
- ``moe_top_share``: the busiest expert's share of a layer's tokens in each step after step 0 (``stats.jsonl``),
  each step a sample, as ``step_time``.

The rule (:func:`judge`): with the prediction ``p`` and :data:`TOLERANCE` ``= 0.25``, the band of outcomes that
bear it out is ``p x [0.75, 1.25]``; the measured change is an interval (the 95 % CI), a point (an exact
difference), or, with too few samples for an interval, a point estimate judged on its value alone (said so).

- ``held``: the outcome meets the band and lies on the predicted side of 0 (an interval that also holds 0 is
  ``undecided``);
- ``smaller than predicted`` / ``larger than predicted``: on the predicted side of 0 (an interval excluding 0), but
  wholly short of or beyond the band;
- ``not held: no effect of the predicted size``: an interval that holds 0 and misses the band (or a point at 0);
- ``not held: opposite effect``: wholly on the other side of 0;
- ``undecided``: an interval that holds both 0 and part of the band (more samples: ``TOTAL_STEPS``);
- ``no outcome``: a side lacks the figure (a failed trial, another rank profiled).

A first-order estimate within a quarter of the outcome is one a user can plan with; outside it, what the assumption
left out (the peak moved elsewhere, the saved work was not on the critical path, ...) is the finding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, cast

from sftprof.analysis.compare import stats
from sftprof.analysis.schema import processed_snapshots, processed_traces
from sftprof.analysis.trial.schema import TrialRecord
from sftprof.analysis.what_if.changes import METRICS, amount

__all__ = ["TOLERANCE", "RULE", "Outcome", "outcome", "judge", "outcome_text"]

TOLERANCE = 0.25
RULE = (f"the assumption held when the measured change B − A meets the band of ±{100 * TOLERANCE:.0f} % around the "
        "prediction on the predicted side of 0; smaller / larger than predicted: on that side but wholly short of / "
        "beyond the band; not held: no effect of that size (an interval holding 0 and missing the band) or the "
        "opposite effect; undecided: the 95 % CI holds both 0 and part of the band. Times: the rank test's 95 % "
        "CI over steps; memory: an exact difference; one sample a side: judged on the value alone")
HELD = "held"
NO_OUTCOME = "no outcome"


@dataclass(frozen=True)
class Outcome:
    """The measured change of a what-if's metric (unit of :data:`sftprof.analysis.what_if.changes.METRICS`).

    Attributes:
        predicted: the prediction (B - A).
        measured: the measured change (the Hodges-Lehmann estimate, an exact difference, or the one-sample
            difference); None: no outcome.
        low, high: its 95 % interval (equal to ``measured`` when exact; None without an interval).
        samples: ``"4/4"`` (steps or trials a side), ``"exact"``.
        basis: where the figure comes from, in words.
        verdict: the rule's word (module docstring); ``why``: the reason in numbers.
    """

    predicted: float
    measured: Optional[float]
    low: Optional[float]
    high: Optional[float]
    samples: str
    basis: str
    verdict: str
    why: str


def judge(p: float, m: Optional[float], low: Optional[float], high: Optional[float]) -> tuple[str, str]:
    """The verdict on prediction ``p`` of the outcome ``m`` with its interval ``[low, high]`` (None: none, judged on
    ``m``; ``low == high == m``: exact), and why (module docstring).

    Raises:
        ValueError: ``p`` is 0 (a what-if always predicts a change).
    """
    if p == 0:
        raise ValueError("judge: a prediction of 0 cannot be borne out or refuted")
    if m is None:
        return NO_OUTCOME, "the figure is missing on a side"
    lo, hi = (m, m) if low is None or high is None else (low, high)
    alone = " (judged on the value alone: too few samples for an interval)" if low is None else ""
    s = 1.0 if p > 0 else -1.0  # in units of the predicted direction: the band is [0.75, 1.25] x |p|
    a, b = sorted((s * lo, s * hi))
    band_lo, band_hi = (1 - TOLERANCE) * abs(p), (1 + TOLERANCE) * abs(p)
    band = f"the band {s * band_lo:+.3g} to {s * band_hi:+.3g}"
    if b < 0:
        return "not held: opposite effect", f"the outcome lies on the other side of 0 from the prediction{alone}"
    if a <= 0:  # the interval (or point) holds 0
        if b < band_lo:
            return "not held: no effect of the predicted size", f"the outcome holds 0 and stays short of {band}{alone}"
        return "undecided", f"the 95 % CI holds both 0 and part of {band}: more samples (TOTAL_STEPS) decide"
    if b < band_lo:
        return "smaller than predicted", f"the outcome is short of {band}{alone}"
    if a > band_hi:
        return "larger than predicted", f"the outcome is beyond {band}{alone}"
    return HELD, f"the outcome meets {band}{alone}"


def _trace(summary: Mapping[str, Any], rank: Optional[int]) -> Optional[Mapping[str, Any]]:
    return next((t["summary"] for t in processed_traces(cast(TrialRecord, summary)) if t["rank"] == rank), None)


def _snapshot(summary: Mapping[str, Any], rank: Optional[int]) -> Optional[Mapping[str, Any]]:
    return next((m["summary"] for m in processed_snapshots(cast(TrialRecord, summary)) if m["rank"] == rank), None)


def _top_shares(summary: Mapping[str, Any]) -> list[float]:
    """The busiest expert's share (percent) of each step after step 0 (``stats.steps[].moe.top_share``)."""
    return [100 * x["moe"]["top_share"] for x in (summary.get("stats") or {}).get("steps") or []
            if x.get("step") and (x.get("moe") or {}).get("top_share") is not None]


def _from_samples(p: float, a: Sequence[float], b: Sequence[float], basis: str) -> Outcome:
    """The outcome of repeated samples a side: the rank test's shift and interval (one sample or too few: the
    estimate alone)."""
    if not a or not b:
        return Outcome(p, None, None, None, f"{len(a)}/{len(b)}", basis, NO_OUTCOME, "no sample on a side")
    s = stats.shift(a, b)
    verdict, why = judge(p, s.estimate, s.low, s.high)
    return Outcome(p, s.estimate, s.low, s.high, f"{len(a)}/{len(b)}", basis, verdict, why)


def _one_each(p: float, a: Optional[float], b: Optional[float], basis: str, exact: bool) -> Outcome:
    """The outcome of one figure a side: an exact difference (deterministic memory) or a one-sample difference."""
    if a is None or b is None:
        return Outcome(p, None, None, None, "exact" if exact else "1/1", basis, NO_OUTCOME,
                       "the figure is missing on a side")
    m = b - a
    verdict, why = judge(p, m, m if exact else None, m if exact else None)
    return Outcome(p, m, m if exact else None, m if exact else None, "exact" if exact else "1/1", basis, verdict, why)


def outcome(what_if: Mapping[str, Any], a: Mapping[str, Any], b: Mapping[str, Any],
            step_times: tuple[list[float], list[float]]) -> Outcome:
    """The outcome of ``what_if`` (a record of A's summary) between summaries ``a`` (the source trial) and ``b`` (the
    what-if trial); ``step_times``: each side's step times in ms that time training alone (compare's choice of steps).

    Raises:
        ValueError: an unknown metric (a summary of a newer sftprof).
    """
    effect, rank = what_if["effect"], what_if.get("rank")
    metric, p = effect["metric"], effect["value"]
    if metric not in METRICS:
        raise ValueError(f"what-if metric {metric!r}: not one of {sorted(METRICS)}")
    if what_if.get("key") == "fit_oom":  # A ran out of memory: its figure is what its step asked for
        snap = _snapshot(b, rank)
        peak = snap.get("peak_allocated_gib") if snap else (b.get("stats") or {}).get("max_mem_peak_allocated_gb")
        return _one_each(p, effect["baseline"], peak, "allocated + requested at A's failure against B's peak allocated "
                                                      "(its snapshot, else stats.jsonl's profiled step)", True)
    if metric == "step_time":
        if step_times[0] and step_times[1]:
            return _from_samples(p, *step_times, "step times of the steps that time training alone (stats.jsonl, "
                                                 "slowest rank)")
        ta, tb = [None if t is None else 1000 * t for t in ((x.get("stats") or {}).get("step_time_s") for x in (a, b))]
        return _one_each(p, ta, tb, "the profiled step's time (stats.jsonl, slowest rank; raise TOTAL_STEPS for "
                                    "samples)", False)
    if metric == "moe_top_share":
        return _from_samples(p, _top_shares(a), _top_shares(b), "busiest expert's share of each step after step 0 "
                                                                "(stats.jsonl)")
    if metric == "gpu_time":
        ga, gb = [((x or {}).get("parts") or {}).get("total_ms") for x in (_trace(a, rank), _trace(b, rank))]
        return _one_each(p, ga, gb, f"rank {rank}'s GPU time by model part (its kernel trace: one sample a side)",
                         False)
    key = "peak_allocated_gib" if metric == "peak_allocated" else "peak_reserved_gib"
    ma, mb = [(x or {}).get(key) for x in (_snapshot(a, rank), _snapshot(b, rank))]
    return _one_each(p, ma, mb, f"rank {rank}'s memory snapshot ({key})", True)


def outcome_text(o: Outcome, unit: str) -> str:
    """``predicted -145.1 ms, measured -131.0 ms [95 % CI -140.2 ms, -120.3 ms]`` (``(exact)`` for memory,
    ``(1/1: no interval)`` for one sample a side)."""
    if o.samples == "exact":
        tail = " (exact)"
    elif o.low is not None:
        tail = f" [95 % CI {amount(o.low, unit)}, {amount(o.high, unit)}]"
    else:
        tail = f" ({o.samples}: no interval)"
    measured = amount(o.measured, unit) + (tail if o.measured is not None else "")
    return f"predicted {amount(o.predicted, unit)}, measured {measured}"
