"""Spread statistics: median, quartiles, IQR, and a seeded bootstrap interval for a ratio of medians.

Quantiles use linear interpolation between order statistics (Hyndman-Fan type 7, numpy's
default), computed here in plain Python so a summary is the same on every platform.  The
bootstrap resamples each arm independently with replacement from numpy's legacy ``RandomState``
(MT19937), whose stream numpy keeps frozen across releases, so a seed gives the same interval
everywhere; the percentile interval of the resampled ratios is reported.

A resample's median is an order statistic of the values it drew, so it is found without gathering or
partitioning the drawn values: how often each replay was drawn in each resample is counted once per arm
(:func:`_draw_counts`, shared by every metric), and per metric those counts, taken in the metric's sorted
order and accumulated, say which sorted value sits at the middle position of each resample
(:func:`_counted_medians`).  The value found is exactly the one a partition of the drawn values puts
there, so the interval is unchanged; ``tests/test_gate_stats.py`` checks both against each other on
random inputs.

Example:
    >>> summary([3.0, 1.0, 2.0, 4.0])["median"], summary([3.0, 1.0, 2.0, 4.0])["iqr"]
    (2.5, 1.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

BOOTSTRAP_SEED = 20240601
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Type-7 quantile of already sorted values."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("quantile of no values")
    h = (n - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo]))


def median(values: Sequence[float]) -> float:
    return quantile(sorted(values), 0.5)


def summary(values: Sequence[float]) -> dict[str, Any]:
    """n, median, min, max, first and third quartiles and the interquartile range."""
    s = sorted(float(v) for v in values)
    q1, q3 = quantile(s, 0.25), quantile(s, 0.75)
    return {"n": len(s), "median": quantile(s, 0.5), "min": s[0], "max": s[-1], "q1": q1, "q3": q3,
            "iqr": q3 - q1}


def _resampled_medians(np: Any, values: Any, idx: Any) -> Any:
    """Median of each row of ``values[idx]``, partitioning the gathered rows in place (the reference
    :func:`_counted_medians` is checked against, and the path taken when a zero's sign could tell them apart)."""
    rows = values[idx]
    n = rows.shape[1]
    mid = n // 2
    if n % 2:
        rows.partition(mid, axis=1)
        return rows[:, mid]
    rows.partition((mid - 1, mid), axis=1)
    return (rows[:, mid - 1] + rows[:, mid]) / 2.0


def _draw_counts(np: Any, idx: Any) -> Any:
    """``counts[j, r]``: how many times resample ``r`` (a row of ``idx``) drew replay ``j``; shape ``(n, resamples)``,
    the narrowest unsigned type that holds ``n``."""
    resamples, n = idx.shape
    dtype = np.uint16 if n <= 0xFFFF else np.uint32 if n <= 0xFFFFFFFF else np.uint64
    flat = (idx + (np.arange(resamples, dtype=idx.dtype) * n)[:, None]).ravel()
    counts = np.bincount(flat, minlength=resamples * n).astype(dtype).reshape(resamples, n)
    return np.ascontiguousarray(counts.T)


def _counted_medians(np: Any, values: Any, counts: Any, work: tuple[Any, Any] | None = None) -> Any:
    """Median of each resample from its draw counts (:func:`_draw_counts`): with the counts accumulated in
    ``values``' sorted order, the value at 0-based position ``k`` of a resample is the sorted value at the
    number of positions whose running count is still ``<= k``.  ``work``: two arrays of ``counts``' shape (its
    type and bool) reused by every metric of an arm, so no metric allocates (and faults in) arrays of its own."""
    n = values.shape[0]
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    running, below = work if work is not None else (np.empty_like(counts), np.empty(counts.shape, dtype=bool))
    np.take(counts, order, axis=0, out=running)  # rows in sorted order, accumulated in place below
    for j in range(1, n):  # row by row: each step one vector add across every resample
        np.add(running[j - 1], running[j], out=running[j])
    mid = n // 2
    upper = ranked[np.count_nonzero(np.less_equal(running, mid, out=below), axis=0)]
    if n % 2:
        return upper
    lower = ranked[np.count_nonzero(np.less_equal(running, mid - 1, out=below), axis=0)]
    return (lower + upper) / 2.0


def _work(np: Any, counts: Any) -> tuple[Any, Any]:
    return np.empty_like(counts), np.empty(counts.shape, dtype=bool)


class _Arm:
    """One arm's resampled replay indices, and its draw counts and work arrays, made on first use and shared by
    every metric of the arm."""

    def __init__(self, idx: Any) -> None:
        self.idx = idx
        self.counts: Any = None
        self.work: Any = None

    def medians(self, np: Any, values: Any) -> Any:
        """Each resample's median of ``values`` (one per replay of the arm)."""
        if _signed_zero(np, values):
            return _resampled_medians(np, values, self.idx)
        if self.counts is None:
            self.counts = _draw_counts(np, self.idx)
            self.work = _work(np, self.counts)
        return _counted_medians(np, values, self.counts, self.work)


def _signed_zero(np: Any, values: Any) -> bool:
    """Whether ``values`` holds a negative zero: a partition and a sort may then place ``-0.0`` and ``0.0``
    differently, and the median's sign could differ."""
    return bool(np.any((values == 0.0) & np.signbit(values)))


def bootstrap_ratio(numerator: Sequence[float], denominator: Sequence[float], *,
                    seed: int = BOOTSTRAP_SEED, resamples: int = BOOTSTRAP_RESAMPLES,
                    confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Ratio of medians (numerator / denominator) with a percentile bootstrap interval.

    Returns ``ratio``, ``low``, ``high``, ``excludes_1`` and ``note``; the interval (or all four)
    is ``None``, with a ``note``, when a median of the denominator, or of a resample of it, is zero, or
    when a value, the ratio or the interval is not finite (a NaN never decides ``excludes_1``).
    """
    return bootstrap_ratios({"x": numerator}, {"x": denominator}, seed=seed, resamples=resamples,
                            confidence=confidence)["x"]


def bootstrap_ratios(numerator: dict[str, Sequence[float]], denominator: dict[str, Sequence[float]], *,
                     seed: int = BOOTSTRAP_SEED, resamples: int = BOOTSTRAP_RESAMPLES,
                     confidence: float = CONFIDENCE) -> dict[str, dict[str, Any]]:
    """:func:`bootstrap_ratio` for several metrics of the same replays.

    Replays are resampled, not values: one draw of replay indices per arm serves every metric
    (numerator indices first, then denominator indices, from one ``RandomState(seed)``).
    """
    import numpy as np

    n_num = len(next(iter(numerator.values())))
    n_den = len(next(iter(denominator.values())))
    rng = np.random.RandomState(seed)
    num_arm = _Arm(rng.randint(0, n_num, size=(resamples, n_num)))
    den_arm = _Arm(rng.randint(0, n_den, size=(resamples, n_den)))
    alpha = (1.0 - confidence) / 2.0
    out: dict[str, dict[str, Any]] = {}
    for key in numerator:
        num = np.asarray(numerator[key], dtype=np.float64)
        den = np.asarray(denominator[key], dtype=np.float64)
        res: dict[str, Any] = {"ratio": None, "low": None, "high": None, "excludes_1": None, "note": ""}
        out[key] = res
        if not (np.isfinite(num).all() and np.isfinite(den).all()):
            res["note"] = "a value is not finite; ratio undefined"
            continue
        den_median = median(den.tolist())
        if den_median == 0.0:
            res["note"] = "baseline median is zero; ratio undefined"
            continue
        ratio = median(num.tolist()) / den_median
        if not math.isfinite(ratio):
            res["note"] = "the ratio is not finite (overflow); undefined"
            continue
        res["ratio"] = ratio
        den_med = den_arm.medians(np, den)
        if bool(np.any(den_med == 0.0)):
            res["note"] = "a bootstrap resample of the baseline has median zero; interval undefined"
            continue
        num_med = num_arm.medians(np, num)
        low, high = (float(x) for x in np.quantile(num_med / den_med, [alpha, 1.0 - alpha]))  # type 7
        if not (math.isfinite(low) and math.isfinite(high)):
            res["note"] = "the interval is not finite (overflow); undefined"
            continue
        res.update(low=low, high=high, excludes_1=bool(low > 1.0 or high < 1.0))
    return out
