"""Spread statistics: median, quartiles, IQR, and a seeded bootstrap interval for a ratio of medians.

Quantiles use linear interpolation between order statistics (Hyndman-Fan type 7, numpy's
default), computed here in plain Python so a summary is the same on every platform.  The
bootstrap resamples each arm independently with replacement from numpy's legacy ``RandomState``
(MT19937), whose stream numpy keeps frozen across releases, so a seed gives the same interval
everywhere; the percentile interval of the resampled ratios is reported.

A resample's median is an order statistic of the values it drew, so it is found without gathering or
partitioning the drawn values: how often each replay was drawn in each resample is counted once per arm
(:func:`_draw_counts`, shared by every metric), and per metric those counts, taken in the metric's sorted
order and accumulated (in blocks, then within the one block that matters), say which sorted value sits at
the middle position of each resample (:func:`_counted_medians`).  The value found is exactly the one a
partition of the drawn values puts there, so the interval is unchanged; ``tests/test_gate_stats.py`` checks
both against each other on random inputs.

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
    """Type-7 quantile of already sorted values, interpolated as numpy interpolates it (from the lower value below
    the midpoint of the gap, from the upper one from there on), so it is ``numpy.quantile``'s number bit for bit."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("quantile of no values")
    h = (n - 1) * q
    lo = min(math.floor(h), n - 1)
    hi = min(lo + 1, n - 1)
    gamma = h - lo
    a, b = float(sorted_values[lo]), float(sorted_values[hi])
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


def numpy_quantiles(sorted_values: Sequence[float], qs: Sequence[float]) -> tuple[float, ...]:
    """``numpy.quantile(values, qs)`` (its default, type 7), bit for bit, from the values sorted ascending (NaN
    last, as ``numpy.sort`` puts it): :func:`quantile` at each ``q``, and NaN wherever a value is NaN; a zero
    is always ``+0.0`` (numpy's may carry the sign of whichever of equal zeros its partition put there).  The
    interval's ends are read this way because ``numpy.quantile`` imports ``numpy.ma`` on first use, a quarter of
    numpy's own import time in every ``reduce`` process.  ``tests/test_gate_stats.py`` compares the two on random
    inputs."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    if math.isnan(sorted_values[-1]):
        return tuple(math.nan for _ in qs)
    # a zero end is +0.0: which of equal zeros numpy's partition lands on is arbitrary
    return tuple(quantile(sorted_values, q) + 0.0 for q in qs)


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
    the narrowest unsigned type that holds ``n``.  Counted a few resamples at a time (about a million draws), so
    the intermediate arrays stay small and are reused instead of faulted in afresh."""
    resamples, n = idx.shape
    dtype = np.uint16 if n <= 0xFFFF else np.uint32 if n <= 0xFFFFFFFF else np.uint64
    counts = np.empty((n, resamples), dtype=dtype)
    step = max(1, min(resamples, (1 << 20) // max(n, 1)))
    offsets = (np.arange(step, dtype=idx.dtype) * n)[:, None]
    for r0 in range(0, resamples, step):
        part = idx[r0:r0 + step]
        k = part.shape[0]
        flat = np.add(part, offsets[:k]).ravel()
        counts[:, r0:r0 + k] = np.bincount(flat, minlength=k * n).reshape(k, n).T
    return counts


BLOCK = 32  # rows of sorted positions summed together when the middle of each resample is looked for


def _counted_medians(np: Any, values: Any, counts: Any, work: Any = None) -> Any:
    """Median of each resample from its draw counts (:func:`_draw_counts`): with the counts taken in ``values``'
    sorted order and accumulated, the value at 0-based position ``k`` of a resample is the sorted value at the
    number of positions whose running count is still ``<= k``.

    The running counts are never built whole: the ranked counts are summed in blocks of :data:`BLOCK` rows (one
    pass), the blocks accumulated (a small array), and for each resample only the block where the running
    count passes ``k`` is accumulated row by row: every block before it lies wholly at or below ``k`` and every
    row after it above, so the position counted is the same.  ``work``: an array from :func:`_work`, reused by
    every metric of an arm, so no metric allocates (and faults in) the ranked counts of its own."""
    n = values.shape[0]
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    padded = work if work is not None else _work(np, counts)
    np.take(counts, order, axis=0, out=padded[:n])
    nb = -(-n // BLOCK)  # the last block padded with zero counts: running counts there stay n, above any k
    blocks = padded[:nb * BLOCK].reshape(nb, BLOCK, -1).sum(axis=1, dtype=counts.dtype)  # each sum <= n
    np.cumsum(blocks, axis=0, out=blocks)
    resamples = counts.shape[1]
    columns = np.arange(resamples)[:, None]
    within = np.arange(BLOCK)

    def position(k: int) -> Any:
        block = np.count_nonzero(blocks <= k, axis=0)  # whole blocks at or below k, per resample
        before = np.where(block > 0, blocks[np.maximum(block - 1, 0), np.arange(resamples)], 0)
        rows = padded[(block * BLOCK)[:, None] + within, columns].astype(np.int64)  # (resamples, BLOCK)
        np.cumsum(rows, axis=1, out=rows)
        return block * BLOCK + np.count_nonzero(rows + before[:, None] <= k, axis=1)  # at most n: the last

    mid = n // 2
    upper = ranked[position(mid)]
    if n % 2:
        return upper
    return (ranked[position(mid - 1)] + upper) / 2.0


def _work(np: Any, counts: Any) -> Any:
    """The ranked counts' array: ``counts``' rows and :data:`BLOCK` more of zero counts, so every block, the
    last included, can be read whole."""
    n = counts.shape[0]
    padded = np.empty((n + BLOCK, counts.shape[1]), dtype=counts.dtype)
    padded[n:] = 0
    return padded


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
        low, high = numpy_quantiles(np.sort(num_med / den_med).tolist(), (alpha, 1.0 - alpha))
        if not (math.isfinite(low) and math.isfinite(high)):
            res["note"] = "the interval is not finite (overflow); undefined"
            continue
        res.update(low=low, high=high, excludes_1=bool(low > 1.0 or high < 1.0))
    return out
