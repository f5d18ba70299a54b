"""The figures of one source against the trainer's recompute (docs/mismatch.md explains each).

Per response token the **log-ratio** is ``log pi_trainer(y) - log pi_source(y)``: the log of the
importance ratio ``rho = pi_trainer / pi_source`` the trainer would weigh that token with.  Tokens
are drawn by the sampler, so over them

* ``k1 = mean(-log rho)`` estimates KL(source || trainer) without bias but with a large variance
  (it can come out negative);
* ``k3 = mean(rho - 1 - log rho)`` estimates the same KL without bias, is never negative and has a
  small variance (Schulman's k3);

and the **band share** is the fraction of tokens whose ``rho`` lies outside ``[1 - d, 1 + d]``.
Tokens without a recorded value (NaN) are left out and counted.

Example:
    >>> import torch
    >>> s = summary(torch.tensor([0.0, 0.1, -0.1], dtype=torch.float64), bands=(0.05,))
    >>> round(s["k1"], 6), round(s["abs_max"], 6), round(s["outside"]["0.05"], 4)
    (0.0, 0.1, 0.6667)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


BANDS = (0.001, 0.01, 0.1)
WORST = 5
PROFILE_BUCKETS = 32


def _q(ordered: Tensor, q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly (as ``torch.quantile``, without its size limit)."""
    n = int(ordered.numel())
    if n == 0:
        return 0.0
    x = q * (n - 1)
    lo = math.floor(x)
    hi = min(lo + 1, n - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo))


def summary(lr: Tensor, bands: tuple[float, ...] = BANDS) -> dict[str, Any]:
    """Distribution, KL estimates and band shares of per-token log-ratios ``lr`` (finite values)."""
    import torch
    n = int(lr.numel())
    if n == 0:
        return {"tokens": 0, "mean": 0.0, "std": 0.0, "abs_mean": 0.0, "abs_p50": 0.0, "abs_p90": 0.0,
                "abs_p99": 0.0, "abs_max": 0.0, "bitwise_equal_share": 1.0, "k1": 0.0, "k3": 0.0,
                "outside": {_band_key(d): 0.0 for d in bands}}
    a = lr.abs()
    ordered = a.sort().values
    rho = torch.exp(lr)
    return {
        "tokens": n,
        "mean": float(lr.mean()),
        "std": float(lr.std()) if n > 1 else 0.0,
        "abs_mean": float(a.mean()),
        "abs_p50": _q(ordered, 0.5),
        "abs_p90": _q(ordered, 0.9),
        "abs_p99": _q(ordered, 0.99),
        "abs_max": float(ordered[-1]),
        "bitwise_equal_share": float((lr == 0).double().mean()),
        "k1": float((-lr).mean()),
        "k3": float((rho - 1 - lr).mean()),
        "outside": {_band_key(d): float(((rho - 1).abs() > d).double().mean()) for d in bands},
    }


def _band_key(d: float) -> str:
    return f"{d:g}"


def outside_share(lr: Tensor, d: float) -> float:
    import torch
    return float(((torch.exp(lr) - 1).abs() > d).double().mean()) if lr.numel() else 0.0


def per_row(lr: Tensor, row: Tensor) -> dict[str, Tensor]:
    """Per row present (ascending): its id, tokens, largest |log-ratio| and the index of its first token at that
    value, the mean |log-ratio| and the sum of log-ratios (one pass of scatter operations, no loop over rows)."""
    import torch
    rows, inv = torch.unique(row, return_inverse=True)
    r, n = int(rows.numel()), int(lr.numel())
    a = lr.abs()
    count = torch.bincount(inv, minlength=r)
    amax = torch.zeros(r, dtype=a.dtype).scatter_reduce(0, inv, a, "amax", include_self=False)
    cand = torch.where(a == amax[inv], torch.arange(n), n)
    first = torch.full((r,), n, dtype=torch.int64).scatter_reduce(0, inv, cand, "amin", include_self=False)
    return {"row": rows, "tokens": count, "abs_max": amax, "at": first,
            "abs_mean": torch.zeros(r, dtype=a.dtype).index_add(0, inv, a) / count,
            "sum": torch.zeros(r, dtype=lr.dtype).index_add(0, inv, lr)}


def worst_sequences(lr: Tensor, row: Tensor, position: Tensor, n: int = WORST) -> list[dict[str, Any]]:
    """The ``n`` rows with the largest per-token |log-ratio|: where it is, and the row's sums."""
    import torch
    if lr.numel() == 0:
        return []
    p = per_row(lr, row)
    order = torch.sort(-p["abs_max"], stable=True).indices[:n]  # rows ascending among equals
    return [{"row": int(p["row"][i]), "tokens": int(p["tokens"][i]), "abs_max": float(p["abs_max"][i]),
             "at_position": int(position[p["at"][i]]), "abs_mean": float(p["abs_mean"][i]),
             "sequence_log_ratio": float(p["sum"][i])} for i in order.tolist()]


def worst_tokens(lr: Tensor, row: Tensor, position: Tensor, token: Tensor, recorded: Tensor, trainer: Tensor,
                 n: int = 2 * WORST) -> list[dict[str, Any]]:
    """The ``n`` tokens with the largest |log-ratio|."""
    import torch
    k = min(n, int(lr.numel()))
    if k == 0:
        return []
    idx = torch.topk(lr.abs(), k).indices.tolist()
    return [{"row": int(row[i]), "position": int(position[i]), "token": int(token[i]),
             "recorded": float(recorded[i]), "trainer": float(trainer[i]), "log_ratio": float(lr[i])} for i in idx]


def profile(lr: Tensor, position: Tensor, buckets: int = PROFILE_BUCKETS) -> list[dict[str, Any]]:
    """Along the response position: per position (or per equal-width bucket of positions when there are
    more than ``buckets``), the tokens, mean log-ratio, mean and largest |log-ratio|."""
    if lr.numel() == 0:
        return []
    longest = int(position.max()) + 1
    width = max(1, math.ceil(longest / buckets))
    out = []
    for b in range(0, longest, width):
        sel = (position >= b) & (position < b + width)
        if not bool(sel.any()):
            continue
        a = lr[sel].abs()
        out.append({"positions": [b, min(b + width, longest) - 1], "tokens": int(sel.sum()),
                    "mean": float(lr[sel].mean()), "abs_mean": float(a.mean()), "abs_max": float(a.max())})
    return out


def by_pad_offset(lr: Tensor, row: Tensor, pad: Tensor) -> dict[str, Any]:
    """Per left-padding offset of the sampler's rows: rows, tokens and mean |log-ratio|; and the
    correlation between a row's offset and its mean |log-ratio| (None with fewer than two offsets or no
    spread)."""
    import torch
    if lr.numel() == 0:
        return {"groups": [], "correlation": None}
    p = per_row(lr, row)
    offs = pad[p["at"]].double()  # every token of a row has the row's offset
    groups = []
    for off in torch.unique(pad).tolist():
        sel = pad == off
        groups.append({"offset": int(off), "rows": int((offs == off).sum()), "tokens": int(sel.sum()),
                       "abs_mean": float(lr[sel].abs().mean())})
    means = p["abs_mean"]
    corr = None
    if offs.numel() > 1 and float(offs.std()) > 0 and float(means.std()) > 0:
        corr = float(torch.corrcoef(torch.stack([offs, means]))[0, 1])
    return {"groups": groups, "correlation": corr}
