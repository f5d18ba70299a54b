"""Spread statistics: type-7 quantiles, summaries, and the seeded bootstrap ratio interval."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayjob.gate.stats import bootstrap_ratio, median, quantile, summary

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=30), st.floats(min_value=0.0, max_value=1.0))
def test_quantile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert quantile(sorted(values), q) == pytest.approx(float(np.quantile(values, q)), rel=1e-9, abs=1e-6)


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
