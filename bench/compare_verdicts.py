"""The verdicts of ``postprocess_profile.py compare`` checked like an instrument, on recorded CPU step times.

    python bench/compare_verdicts.py                        # the fixture tests/fixtures/cpu_quickstart/{A,B}
    python bench/compare_verdicts.py --runs LOGS_A LOGS_B    # two runs of your own

A run is a folder of trial log dirs, each with its ``stats.jsonl`` (what the driver writes under
``FILEROOT/logs/<user>/<experiment>/``; the fixture keeps that layout). The step times are each run's steps that
time training alone, pooled over its trials, as compare takes them
(:func:`sftprof.analysis.compare.runs._clean_step_times`). The noise model is their relative deviation from their run's
median, pooled over both runs, drawn with replacement and smoothed by a Gaussian of Silverman's bandwidth (so that
resampled values do not tie). Printed, for each sample size ``n`` a side:

- A/A: the share of comparisons of two samples drawn from one model that give ``slower`` or ``faster`` (the false
  positives; at most 5 % for a valid 95 % test), by the test compare uses (:func:`sftprof.analysis.compare.stats.shift`),
  beside the level that test attains exactly at that size (:func:`level`) and, for reference, by a percentile
  bootstrap interval of the difference of medians (``--boot`` resamples, seeded; a quarter of ``--sims``);
- power: the share that find a 5 % slowdown (``--effect``), B's draws times 1.05;
- the two runs' own verdict, with its interval.

No clock is read: every figure comes from the recorded step times and a seeded generator (``--seed``).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sftprof.analysis.trial import inputs  # noqa: E402
from sftprof.analysis.compare import stats
from sftprof.analysis.compare.runs import _clean_step_times  # noqa: E402
from sftprof.artifacts import STATS  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "cpu_quickstart"


def run_step_times(run: Path) -> list[float]:
    """The step times (s) compare pools for a run: :func:`_clean_step_times` of each trial log dir in ``run`` (its
    kind and profiled step from the completion record of its ``stats.jsonl``), in trial-name order."""
    out = []
    for log in sorted(d for d in Path(run).iterdir() if (d / STATS).is_file()):
        st = inputs.read_stats(str(log / STATS), None)
        done = st["complete"] or {}
        trial = {"profile_kind": done.get("profile_kind"), "profile_step": done.get("profile_step"), "stats": st}
        out += [t for _, t in _clean_step_times(trial)]
    return out


def relative_noise(*runs: list[float]) -> np.ndarray:
    """Each step time's relative deviation from its run's median, pooled over ``runs`` (float64, unitless)."""
    return np.concatenate([np.asarray(t, dtype=np.float64) / np.median(t) - 1.0 for t in runs])


def silverman(noise: np.ndarray) -> float:
    """Silverman's rule-of-thumb bandwidth ``0.9 min(sd, IQR / 1.34) n^(-1/5)`` of a 1-D sample."""
    iqr = np.subtract(*np.percentile(noise, [75, 25]))
    return 0.9 * min(np.std(noise, ddof=1), iqr / 1.34) * noise.size ** -0.2


def draw(rng: np.random.Generator, noise: np.ndarray, shape: tuple[int, int], scale: float = 1.0) -> np.ndarray:
    """Step times of runs whose median is ``scale``, ``shape`` = (runs, steps): ``scale * (1 + r + h * e)``, ``r``
    drawn from ``noise`` with replacement, ``e`` standard normal, ``h`` :func:`silverman`."""
    return scale * (1.0 + rng.choice(noise, shape) + silverman(noise) * rng.standard_normal(shape))


def level(n: int) -> float | None:
    """The false-positive rate the rank test attains exactly with ``n`` a side, ``2 P(U <= k - 1)``; None beyond
    the exact counts (the normal approximation, about 5 %)."""
    try:
        cum = np.cumsum(stats.u_null_counts(n, n))
    except ValueError:
        return None
    return 2 * cum[stats.interval_rank(n, n) - 1] / cum[-1]


def detection_rate(rng: np.random.Generator, noise: np.ndarray, n: int, effect: float, sims: int) -> float:
    """The share of ``sims`` comparisons (``n`` a side; B scaled by ``1 + effect``) whose verdict is not ``no
    detectable difference``: the false-positive rate for ``effect = 0``, else the power."""
    a, b = draw(rng, noise, (sims, n)), draw(rng, noise, (sims, n), 1.0 + effect)
    return sum(stats.shift(x, y).direction in ("higher", "lower") for x, y in zip(a, b)) / sims


def bootstrap_false_positives(rng: np.random.Generator, noise: np.ndarray, n: int, sims: int, boot: int) -> float:
    """The A/A rate of a 95 % percentile bootstrap interval of the difference of medians excluding 0 (reference)."""
    hits = 0
    for a, b in zip(draw(rng, noise, (sims, n)), draw(rng, noise, (sims, n))):
        d = (np.median(b[rng.integers(0, n, (boot, n))], axis=1) - np.median(a[rng.integers(0, n, (boot, n))], axis=1))
        low, high = np.percentile(d, [2.5, 97.5])
        hits += low > 0 or high < 0
    return hits / sims


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs=2, metavar=("LOGS_A", "LOGS_B"), type=Path,
                   help=f"two folders of trial log dirs (default: {FIXTURE.relative_to(ROOT)}/A and B)")
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 5, 7, 10], help="samples a side (>= 2)")
    p.add_argument("--sims", type=int, default=4000, help="comparisons per figure (>= 100)")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples of the reference interval (>= 100)")
    p.add_argument("--effect", type=float, default=0.05, help="injected relative slowdown (0 < effect < 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if min(args.sizes) < 2 or args.sims < 100 or args.boot < 100 or not 0 < args.effect < 1:
        p.error("--sizes must be >= 2, --sims and --boot >= 100, --effect in (0, 1)")
    times = [run_step_times(r) for r in args.runs or [FIXTURE / "A", FIXTURE / "B"]]
    if min(map(len, times)) < 2:
        p.error(f"a run has fewer than 2 steps that time training alone ({len(times[0])} and {len(times[1])})")
    noise = relative_noise(*times)
    print(f"step times (s): A {np.round(times[0], 3).tolist()}, B {np.round(times[1], 3).tolist()}")
    print(f"relative noise: sd {np.std(noise, ddof=1):.4f}, range {noise.min():+.4f} .. {noise.max():+.4f} "
          f"({noise.size} steps), smoothing bandwidth {silverman(noise):.4f}")
    own = stats.shift(*times)
    print(f"the two runs: {own.verdict()}, shift {own.estimate:+.3f} s, 95 % CI "
          f"{'-' if own.low is None else f'[{own.low:+.3f}, {own.high:+.3f}]'} ({own.n_a} v {own.n_b} steps)")
    se = 100 * math.sqrt(0.05 * 0.95 / args.sims)
    print(f"| n a side | A/A false positives (rank test; ± {se:.1f} % simulation error) | its exact level | "
          f"A/A (bootstrap of medians) | power, {100 * args.effect:.0f} % slowdown |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(args.seed)
    for n in args.sizes:
        fp = detection_rate(rng, noise, n, 0.0, args.sims)
        boot = bootstrap_false_positives(rng, noise, n, args.sims // 4, args.boot)
        power = detection_rate(rng, noise, n, args.effect, args.sims)
        exact = level(n)
        print(f"| {n} | {100 * fp:.1f} % | {'normal approx.' if exact is None else f'{100 * exact:.1f} %'} | "
              f"{100 * boot:.1f} % | {100 * power:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
