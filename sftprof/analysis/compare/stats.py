"""Is B faster or slower than A? The shift B − A of repeated samples, its 95 % confidence interval and a verdict.

Method: the Hodges-Lehmann estimate of the shift (the median of all ``m * n`` differences ``b_j - a_i``) with the
confidence interval of the Mann-Whitney (Wilcoxon rank-sum) test, which is the interval between two order statistics
of those differences (Moses' interval; Hollander, Wolfe & Chicken, *Nonparametric Statistical Methods*, 3rd ed.,
section 4.3). Why this one for step and kernel times:

- Distribution-free and exact for small samples: its coverage is at least 95 % whatever the distribution of the
  times, as long as B is A shifted (the rank test's null distribution is counted exactly, not approximated: up to
  ``C(m + n, m) <= 1e17`` arrangements, beyond that the normal approximation with continuity correction). Step times
  are skewed (a step slowed by another process is far off, none is far faster): a t interval assumes normal means,
  which 3-10 such samples do not give; a percentile bootstrap of the difference of medians is erratic at that size
  (on the recorded CPU step times of ``tests/fixtures/cpu_quickstart``, A/A false positives 7.6 % at 4 a side and
  3.0 % at 5, where this test's are its exact level, 2.9 % and 3.2 %: ``bench/compare_verdicts.py``, bench/NOTES.md).
- Robust: an outlying step changes the ``n`` differences it is part of, and their median moves little (the
  estimate's breakdown point is about 29 %).
- Deterministic: no resampling, so no seed; the same samples give the same interval.

The price of being exact: a rank test cannot reach 95 % with very few samples. The smallest two-sided level it can
attain is ``2 / C(m + n, m)``: 2 against 7 or 3 against 4 stay above 5 % and give no interval (:data:`TOO_FEW`);
4 against 4, 3 against 5 and 2 against 8 are enough. A side with one sample gives no
verdict at all (:data:`ONE_SAMPLE`).

Ties (equal samples, e.g. identical kernel totals) make the interval conservative: a zero difference never counts
for a verdict. Values are plain floats of any unit; the interval is in the same unit.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["CONFIDENCE", "METHOD", "ONE_SAMPLE", "TOO_FEW", "NO_DIFFERENCE", "Shift", "shift", "u_null_counts",
           "interval_rank", "constant_difference"]

CONFIDENCE = 0.95
METHOD = ("Hodges-Lehmann shift B − A (the median of all pairwise differences) with its exact 95 % confidence "
          "interval from the Mann-Whitney rank test (distribution-free; no resampling, no seed)")
ONE_SAMPLE = "one sample: no verdict"
TOO_FEW = "too few samples: no verdict"
NO_DIFFERENCE = "no detectable difference"
_HALF_ALPHA_DEN = 40  # (1 - CONFIDENCE) / 2 = 1 / 40: compared in integers, so that 2/80 is exactly at the edge
_EXACT_MAX_ARRANGEMENTS = 10**17  # C(m + n, m) counted exactly in int64 up to here (x 40 stays below 2**63)


def u_null_counts(m: int, n: int) -> npt.NDArray[np.int64]:
    """How many of the ``C(m + n, m)`` equally likely rank orders of two samples of sizes ``m`` and ``n`` give each value
    ``u = 0 .. m * n`` of the Mann-Whitney count ``U`` (the number of pairs with the A sample below the B sample).

    The generating function of these counts is the Gaussian binomial ``prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i)``;
    each factor is applied as a power series truncated at degree ``m * n`` (exact).

    Returns: int64 array of length ``m * n + 1`` summing to ``C(m + n, m)``.

    Raises:
        ValueError: ``m`` or ``n`` below 1, or ``C(m + n, m)`` above 1e17 (int64 would overflow; use the normal
            approximation).
    """
    if m < 1 or n < 1:
        raise ValueError(f"u_null_counts: sample sizes must be >= 1, got {m} and {n}")
    if math.comb(m + n, m) > _EXACT_MAX_ARRANGEMENTS:
        raise ValueError(f"u_null_counts: C({m + n}, {m}) arrangements exceed {_EXACT_MAX_ARRANGEMENTS:.0e}")
    m, n = min(m, n), max(m, n)
    c: npt.NDArray[np.int64] = np.zeros(m * n + 1, dtype=np.int64)
    c[0] = 1
    for i in range(1, m + 1):
        shift_by = n + i
        if shift_by < len(c):
            c[shift_by:] -= c[:-shift_by].copy()  # times (1 - q^(n+i))
        for r in range(i):  # divided by (1 - q^i): a running sum along each residue class mod i
            c[r::i] = np.cumsum(c[r::i])
    return c


@functools.lru_cache(maxsize=256)
def interval_rank(m: int, n: int) -> int:
    """``k`` of the 95 % interval ``[d_(k), d_(mn+1-k)]`` of the sorted ``m * n`` differences (1-based order statistics):
    the largest ``k`` with ``P(U <= k - 1) <= 2.5 %`` under the null distribution of :func:`u_null_counts` (its normal
    approximation with continuity correction when ``C(m + n, m)`` exceeds 1e17); 0 when even ``k = 1`` exceeds it
    (too few samples for a 95 % interval)."""
    if math.comb(m + n, m) <= _EXACT_MAX_ARRANGEMENTS:
        cum = np.cumsum(u_null_counts(m, n))
        return int(np.count_nonzero(cum * _HALF_ALPHA_DEN <= cum[-1]))  # cum is increasing
    z = NormalDist().inv_cdf(1 - (1 - CONFIDENCE) / 2)
    mean, sd = m * n / 2, math.sqrt(m * n * (m + n + 1) / 12)
    return max(0, math.floor(mean - 0.5 - z * sd) + 1)


@dataclass(frozen=True)
class Shift:
    """The shift B − A of two samples (unit of the samples).

    Attributes:
        n_a, n_b: sample sizes.
        median_a, median_b: each side's median.
        estimate: Hodges-Lehmann estimate (``b - a`` with one sample a side).
        low, high: the 95 % confidence interval; None with a side of one sample or too few samples for 95 %.
        direction: ``"higher"`` (the interval lies above 0: B's values are higher), ``"lower"``, ``"none"`` (the
            interval holds 0), ``"one sample"`` or ``"too few"``.
    """

    n_a: int
    n_b: int
    median_a: float
    median_b: float
    estimate: float
    low: float | None
    high: float | None
    direction: str

    def verdict(self, higher: str = "slower", lower: str = "faster") -> str:
        """The verdict in words: ``higher`` / ``lower`` (for times: B slower / faster), :data:`NO_DIFFERENCE`,
        :data:`ONE_SAMPLE` or :data:`TOO_FEW`."""
        return {"higher": higher, "lower": lower, "none": NO_DIFFERENCE, "one sample": ONE_SAMPLE,
                "too few": TOO_FEW}[self.direction]


def _finite(name: str, values: Sequence[float]) -> npt.NDArray[np.float64]:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"shift: {name} must be a non-empty list of finite numbers, got {list(values)!r}")
    return x


def shift(a: Sequence[float], b: Sequence[float]) -> Shift:
    """The shift B − A of samples ``a`` and ``b`` with its 95 % interval and direction (module docstring).

    Raises:
        ValueError: a side is empty or holds a non-finite value.
    """
    xa, xb = _finite("a", a), _finite("b", b)
    diffs = np.sort(np.subtract.outer(xb, xa).ravel())
    base: dict[str, Any] = dict(n_a=xa.size, n_b=xb.size, median_a=float(np.median(xa)), median_b=float(np.median(xb)),
                estimate=float(np.median(diffs)))
    if min(xa.size, xb.size) == 1:
        return Shift(**base, low=None, high=None, direction="one sample")
    k = interval_rank(xa.size, xb.size)
    if k == 0:
        return Shift(**base, low=None, high=None, direction="too few")
    low, high = float(diffs[k - 1]), float(diffs[diffs.size - k])
    direction = "higher" if low > 0 else "lower" if high < 0 else "none"
    return Shift(**base, low=low, high=high, direction=direction)


def constant_difference(a: Sequence[float], b: Sequence[float]) -> float | None:
    """``b - a`` when every sample of a side has one value (a deterministic figure, such as the memory an allocator
    hands out for the same step: compared exactly, no interval); None when a side's samples differ or one is empty."""
    if not a or not b or len(set(a)) != 1 or len(set(b)) != 1:
        return None
    return b[0] - a[0]
