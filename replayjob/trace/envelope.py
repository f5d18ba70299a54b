"""The noise envelope a difference between two traces is judged against, and the error measures.

Relative error of two tensors: ``||a - b|| / max(||a||, ||b||)`` in float64 over every element
(symmetric, in ``[0, 2]``; 0 when both are zero; NaN, the non-finite marker, when either holds a NaN
or an infinity).  A non-finite error or envelope is never within the envelope: :meth:`Bound.judge`
calls it ``beyond`` whichever trace held it.  Per traced site (module output, output gradient,
parameter gradient or update) the envelope comes from, in this order:

1. ``repeats`` -- same-condition repeats (repeat directories of one arm) where they differ at this
   site: twice the largest relative error among them (GPU kernels that are not bitwise repeatable);
2. ``reference`` -- a declared reference pair (two traces the user asserts differ only by noise,
   e.g. two micro-batch sizes already understood) where it differs at this site: twice its error;
3. ``rounding`` -- otherwise (on a CPU, same-condition repeats are bitwise equal): the rounding
   bound ``C * u(dtype) * sqrt(K) * d``, with ``u`` the unit roundoff of the site's dtype, ``K``
   the longest reduction in the trace (the widest traced output, the longest row, or for parameter
   gradients and updates the total tokens they are summed over), ``d`` the site's 1-based position
   in execution (forward sites, then backward sites, then parameters: rounding errors made upstream
   propagate) and ``C = 4`` (the probabilistic inner-product bound ``sqrt(K) u`` of Higham and
   Mary, doubled because both traces carry their own rounding, and doubled again as margin).

Every judged site says which source its envelope came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


ROUNDING_CONSTANT = 4.0
UNIT_ROUNDOFF = {"F64": 2.0 ** -53, "F32": 2.0 ** -24, "F16": 2.0 ** -11, "BF16": 2.0 ** -8}
REPEAT_FACTOR = 2.0


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite (no NaN, no infinity)."""
    import torch
    return all(bool(torch.isfinite(t.detach()).all()) for t in tensors)


def finite_or_none(x: float | None) -> float | None:
    """``x`` when it is a finite number, else ``None`` (strict JSON has no NaN or infinity)."""
    return x if x is not None and math.isfinite(x) else None


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||a||, ||b||)`` in float64; 0 when both are zero; NaN when either is not finite."""
    import torch
    if not all_finite(a, b):
        return math.nan
    x, y = a.detach().to(torch.float64), b.detach().to(torch.float64)
    scale = max(float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y)))
    diff = float(torch.linalg.vector_norm(x - y))
    out = diff / scale if scale > 0 else 0.0
    return out if math.isfinite(out) else math.nan


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Cosine of two tensors as flat float64 vectors; ``None`` when either is zero; NaN when either is not
    finite."""
    import torch
    if not all_finite(a, b):
        return math.nan
    x, y = a.detach().to(torch.float64).flatten(), b.detach().to(torch.float64).flatten()
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    if not (nx > 0 and ny > 0):
        return None
    out = float(x @ y) / (nx * ny)
    return out if math.isfinite(out) else math.nan


def rounding_bound(dtype: str, reduction_length: int, position: int) -> float:
    """``C * u(dtype) * sqrt(K) * d`` (see the module docstring)."""
    return ROUNDING_CONSTANT * UNIT_ROUNDOFF[dtype] * math.sqrt(max(reduction_length, 1)) * max(position, 1)


@dataclass(frozen=True)
class Bound:
    value: float
    source: str  # "repeats" | "reference" | "rounding"

    def judge(self, rel: float, bitwise: bool) -> str:
        """``equal`` (bitwise), ``noise`` (within the envelope) or ``beyond``.

        A non-finite ``rel`` (NaN or an infinity in either trace, even bitwise equal) or envelope is
        ``beyond``: it is never within a bound."""
        if not math.isfinite(rel) or not math.isfinite(self.value):
            return "beyond"
        if bitwise:
            return "equal"
        return "noise" if rel <= self.value else "beyond"


def envelope(repeat_errors: list[float], reference_error: float | None, rounding: float) -> Bound:
    """The envelope of one site from its same-condition repeat errors, reference error and rounding bound.

    A non-finite repeat or reference error gives a non-finite (NaN) envelope, which judges every
    error ``beyond``: a NaN never widens a bound."""
    if any(not math.isfinite(e) for e in repeat_errors):
        return Bound(math.nan, "repeats")
    if reference_error is not None and not math.isfinite(reference_error):
        return Bound(math.nan, "reference")
    if any(e > 0 for e in repeat_errors):
        return Bound(REPEAT_FACTOR * max(repeat_errors), "repeats")
    if reference_error is not None and reference_error > 0:
        return Bound(REPEAT_FACTOR * reference_error, "reference")
    return Bound(rounding, "rounding")
