"""Spread statistics: type-7 quantiles, summaries, and the seeded bootstrap ratio interval."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayjob.gate.stats import bootstrap_ratio, median, numpy_quantiles, quantile, summary

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=30), st.floats(min_value=0.0, max_value=1.0))
def test_quantile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert quantile(sorted(values), q) == pytest.approx(float(np.quantile(values, q)), rel=1e-9, abs=1e-6)


anything = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.0, 1.0 + 2**-52]))


@settings(max_examples=300, deadline=None)
@given(st.lists(anything, min_size=1, max_size=2100),
       st.lists(st.one_of(st.floats(min_value=0.0, max_value=1.0), st.sampled_from([0.0, 0.025, 0.5, 0.975, 1.0])),
                min_size=1, max_size=4))
def test_the_interval_quantiles_are_numpy_s_bit_for_bit(values: list[float], qs: list[float]) -> None:
    """The bootstrap interval's ends are numpy.quantile's own numbers (the verdict goldens were written with it),
    NaN and infinities included, without importing numpy.ma."""
    with np.errstate(invalid="ignore"):  # numpy's own interpolation of infinities says so: NaN, as ours
        want = [float(x) for x in np.quantile(np.asarray(values, dtype=np.float64), qs)]
    got = numpy_quantiles(np.sort(np.asarray(values, dtype=np.float64)).tolist(), qs)
    assert [x.hex() for x in got] == [(x + 0.0).hex() for x in want]  # a zero's sign: see numpy_quantiles


def test_summary_known_values() -> None:
    s = summary([4.0, 1.0, 3.0, 2.0, 10.0])
    assert s == {"n": 5, "median": 3.0, "min": 1.0, "max": 10.0, "q1": 2.0, "q3": 4.0, "iqr": 2.0}
    assert median([1.0, 2.0]) == 1.5
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_bootstrap_is_seeded_and_brackets_the_ratio() -> None:
    num = [2.0, 2.1, 1.9, 2.05, 1.95]
    den = [1.0, 1.02, 0.98, 1.01, 0.99]
    a, b = bootstrap_ratio(num, den), bootstrap_ratio(num, den)
    assert a == b
    assert a["low"] <= a["ratio"] <= a["high"] and a["excludes_1"] is True
    assert bootstrap_ratio(num, den, seed=1) != a  # the seed matters
    same = bootstrap_ratio([1.0, 1.1, 0.9], [1.05, 0.95, 1.0])
    assert same["low"] < 1.0 < same["high"] and same["excludes_1"] is False


def test_bootstrap_zero_baseline_is_undefined_not_infinite() -> None:
    out = bootstrap_ratio([1.0, 2.0], [0.0, 0.0, 0.0])
    assert out["ratio"] is None and out["excludes_1"] is None and "zero" in out["note"]
    out = bootstrap_ratio([1.0, 2.0, 3.0], [0.0, 0.0, 1.0])  # median 0 in the data itself
    assert out["ratio"] is None
    out = bootstrap_ratio([1.0, 2.0, 3.0], [0.0, 1.0, 1.0])  # some resamples have median 0
    assert out["ratio"] == 2.0 and out["low"] is None and "resample" in out["note"]


def _reference_ratios(num: list[float], den: list[float], seed: int, resamples: int) -> dict[str, object]:
    """The interval as first written: every resample's drawn values gathered and partitioned."""
    from replayjob.gate.stats import _resampled_medians

    rng = np.random.RandomState(seed)
    num_idx = rng.randint(0, len(num), size=(resamples, len(num)))
    den_idx = rng.randint(0, len(den), size=(resamples, len(den)))
    den_med = _resampled_medians(np, np.asarray(den, dtype=np.float64), den_idx)
    if bool(np.any(den_med == 0.0)):
        return {"low": None, "high": None}
    num_med = _resampled_medians(np, np.asarray(num, dtype=np.float64), num_idx)
    alpha = (1.0 - 0.95) / 2.0
    low, high = (float(x) for x in np.quantile(num_med / den_med, [alpha, 1.0 - alpha]))
    return {"low": low, "high": high}


values = st.lists(st.one_of(st.floats(min_value=1e-3, max_value=1e3), st.sampled_from([0.0, 0.5, 1.0, 2.0])),
                  min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(values, values, st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=1, max_value=300))
def test_counted_bootstrap_is_the_partitioned_one_bit_for_bit(num: list[float], den: list[float], seed: int,
                                                              resamples: int) -> None:
    """The medians found from draw counts are the partition's exactly (ties, repeats, odd and even sizes,
    zeros), so a seed gives the same interval as before the counting."""
    from replayjob.gate.stats import _counted_medians, _draw_counts, _resampled_medians, bootstrap_ratios

    idx = np.random.RandomState(seed).randint(0, len(num), size=(resamples, len(num)))
    arr = np.asarray(num, dtype=np.float64)
    counted = _counted_medians(np, arr, _draw_counts(np, idx))
    assert counted.tobytes() == _resampled_medians(np, arr, idx).tobytes()
    got = bootstrap_ratios({"a": num, "b": num}, {"a": den, "b": den}, seed=seed, resamples=resamples)
    want = _reference_ratios(num, den, seed, resamples)
    for key in ("a", "b"):
        if got[key]["ratio"] is not None and want["low"] is not None:
            assert (got[key]["low"], got[key]["high"]) == (want["low"], want["high"])


def test_counted_bootstrap_at_reduce_scale_and_with_negative_zero() -> None:
    """500 replays an arm, the default resamples: the same interval as the partition; a negative zero takes the
    partition's own path, so a median's sign never changes."""
    from replayjob.gate.stats import bootstrap_ratios

    rng = np.random.RandomState(7)
    num, den = (rng.lognormal(0.0, 0.3, 500).tolist() for _ in range(2))
    got = bootstrap_ratios({"t": num}, {"t": den})["t"]
    want = _reference_ratios(num, den, 20240601, 2000)
    assert (got["low"], got["high"]) == (want["low"], want["high"])
    signed = [-0.0, 0.0, 0.0, 1.0, -0.0]
    got = bootstrap_ratios({"t": signed}, {"t": [1.0, 2.0, 3.0]}, resamples=200)["t"]
    want = _reference_ratios(signed, [1.0, 2.0, 3.0], 20240601, 200)
    assert (repr(got["low"]), repr(got["high"])) == (repr(want["low"]), repr(want["high"]))


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 65, 1000, 5001])
def test_counted_medians_at_block_and_chunk_edges(n: int) -> None:
    """Sizes at and around a block of ranked rows (32), and large enough that the draws are counted in several
    chunks of resamples: every resample's median is the partition's exactly."""
    from replayjob.gate.stats import BLOCK, _counted_medians, _draw_counts, _resampled_medians

    assert BLOCK == 32
    rng = np.random.RandomState(n)
    arr = rng.choice([0.5, 1.0, 2.0, 3.0], size=n) if n % 2 else rng.lognormal(0.0, 0.3, n)
    idx = rng.randint(0, n, size=(300 if n > 1000 else 2000, n))
    assert _counted_medians(np, arr, _draw_counts(np, idx)).tobytes() == _resampled_medians(np, arr, idx).tobytes()


def test_the_bootstrap_does_not_import_numpy_ma() -> None:
    """numpy.quantile imported numpy.ma, 25 ms of every reduce process (benchmarks/README.md, reduce_many)."""
    import subprocess
    import sys
    code = ("import sys; from replayjob.gate.stats import bootstrap_ratio; "
            "r = bootstrap_ratio([2.0, 2.1, 1.9], [1.0, 1.1, 0.9]); assert r['low'] is not None; "
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
