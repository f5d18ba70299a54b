"""Leaf-by-leaf comparison of two diagnostics rows under a numeric tolerance.

Rules, in order:

* JSON kinds are number, string, bool, null, object, array.  Leaves of different kinds differ
  (``kind = "type"``); ``true`` is not the number 1.  Integers and floats are both numbers.
* Two integers compare exactly.  Otherwise numbers are equal when
  ``|a - b| <= atol + rtol * |b|``; NaN equals NaN; an infinity equals only the same infinity; an
  integer too large for a float differs from every float (``Infinity`` included).
* Strings, bools, null and empty containers compare exactly.
* A leaf on one side only is a difference (``only_in_a`` / ``only_in_b``).

``abs_diff`` is ``|a - b|`` for numbers (infinite when one side is NaN or infinite) and ``None``
for differences that have no magnitude.  Drifts sort structural first (type changes, missing
leaves), then numbers by absolute difference, largest first, then changed strings and bools.

Example:
    >>> tol = Tolerance(rtol=1e-5, atol=1e-7)
    >>> [d.path for d in compare_leaves({"x": 1.0, "t": 3}, {"x": 1.5, "t": 3}, tol)]
    ['x']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-7


@dataclass(frozen=True)
class Tolerance:
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL


@dataclass(frozen=True)
class Drift:
    """One differing leaf.  ``a`` / ``b`` are ``None`` on the side where the leaf is missing."""

    path: str
    kind: str  # "value" | "type" | "only_in_a" | "only_in_b"
    a: Any
    b: Any
    abs_diff: float | None

    def sort_key(self) -> tuple[int, float]:
        """Structural differences first, then numbers by magnitude, then other changed values."""
        if self.kind != "value":
            return (0, 0.0)
        return (1, -self.abs_diff) if self.abs_diff is not None else (2, 0.0)


def kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    return "array"


def _as_float(x: int | float) -> float:
    try:
        return float(x)
    except OverflowError:
        return math.copysign(math.inf, x)


def number_diff(a: int | float, b: int | float, tol: Tolerance) -> float | None:
    """``None`` when equal under ``tol``; else ``|a - b|`` (``inf`` for NaN/infinity mismatches, and
    for an integer beyond the float range against a float: never read as an infinity)."""
    if isinstance(a, int) and isinstance(b, int):
        if a == b:
            return None
        return _as_float(abs(a - b))
    try:
        fa, fb = float(a), float(b)
    except OverflowError:
        return math.inf
    if math.isnan(fa) or math.isnan(fb):
        return None if math.isnan(fa) and math.isnan(fb) else math.inf
    if math.isinf(fa) or math.isinf(fb):
        return None if fa == fb else math.inf
    if isinstance(a, int) or isinstance(b, int):  # an integer and a float: exactly, never after rounding the integer
        exact = abs(Fraction(a) - Fraction(b))  # (2**53 + 1 read as a float is 2**53: no difference at zero tolerance)
        if exact <= Fraction(tol.atol) + Fraction(tol.rtol) * abs(Fraction(b)):
            return None
        try:
            return float(exact)
        except OverflowError:  # the exact difference of two numbers in the float range can be beyond it
            return math.inf
    d = abs(fa - fb)
    return None if d <= tol.atol + tol.rtol * abs(fb) else d


def compare_leaf(path: str, a: Any, b: Any, tol: Tolerance) -> Drift | None:
    """The difference between two leaves at ``path``, or ``None`` when they are equal."""
    ka, kb = kind_of(a), kind_of(b)
    if ka != kb:
        return Drift(path, "type", a, b, None)
    if ka == "number":
        d = number_diff(a, b, tol)
        return None if d is None else Drift(path, "value", a, b, d)
    return None if a == b else Drift(path, "value", a, b, None)


def compare_leaves(la: dict[str, Any], lb: dict[str, Any], tol: Tolerance) -> list[Drift]:
    """Every differing leaf of two flattened rows, sorted by absolute difference (largest first)."""
    drifts: list[Drift] = []
    for path, a in la.items():
        if path in lb:
            d = compare_leaf(path, a, lb[path], tol)
            if d is not None:
                drifts.append(d)
        else:
            drifts.append(Drift(path, "only_in_a", a, None, None))
    for path, b in lb.items():
        if path not in la:
            drifts.append(Drift(path, "only_in_b", None, b, None))
    drifts.sort(key=Drift.sort_key)
    return drifts
