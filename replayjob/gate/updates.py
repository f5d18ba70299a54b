"""Update geometry for the approximate claim: pairwise cosine and relative delta-L2 of adapter updates.

Each member's update is ``u_i = final_i - initial``.  For every ordered pair ``(i, j)``:
``cosine = <u_i, u_j> / (||u_i|| ||u_j||)`` and ``relative_delta_l2 = ||u_i - u_j|| / ||u_i||``.
The files are opened with :class:`replayjob.tensorfile.TensorReader` (header validated first, regular
files only) and read one tensor name at a time (that tensor from every file, in float64), so peak
memory is one tensor per member, not one adapter;
``||u_i - u_j||^2`` is accumulated from the differences themselves, not from the Gram matrix, so
near-identical updates are not lost to cancellation.  An update holding a NaN or an infinity gives
its pairs the non-finite marker (NaN) for both measures, which the approximate claim fails and the
summary counts as ``non_finite`` (never in min/median/max).  Every file must hold the same tensor names,
shapes and dtypes, or the comparison is refused.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError
from replayjob.gate.stats import quantile
from replayjob.tensorfile import TensorReader


@dataclass(frozen=True)
class Member:
    label: str
    arm: str
    path: Path


@dataclass(frozen=True)
class Pair:
    a: Member
    b: Member
    cosine: float | None
    relative_delta_l2: float | None

    @property
    def group(self) -> str:
        first, second = sorted((self.a.arm, self.b.arm))
        return f"{first} ~ {second}"


def _open_all(stack: ExitStack, paths: list[Path]) -> list[Any]:

    # validated header (limits, dtypes, spans, pickle refused) before any tensor; regular files only
    return [stack.enter_context(TensorReader(p, follow_symlinks=False)) for p in paths]


def pairwise(initial: Path, members: list[Member]) -> list[Pair]:
    """Ordered pairs (i != j) of ``members`` with their update cosine and relative delta-L2."""
    import torch

    n = len(members)
    gram = [[0.0] * n for _ in range(n)]
    dist2 = [[0.0] * n for _ in range(n)]
    with ExitStack() as stack:
        handles = _open_all(stack, [initial, *(m.path for m in members)])
        names = sorted(handles[0].keys())
        for h, p in zip(handles[1:], (m.path for m in members), strict=True):
            if sorted(h.keys()) != names:
                raise IntegrityError("adapter tensor names differ from the initial adapter's", where=p,
                                     hint="all adapters must come from the same model and LoRA config")
        for name in names:
            base = handles[0].get_tensor(name)
            ups = []
            for h, p in zip(handles[1:], (m.path for m in members), strict=True):
                t = h.get_tensor(name)
                if t.shape != base.shape or t.dtype != base.dtype:
                    raise IntegrityError(f"tensor {name!r} is {t.dtype}{tuple(t.shape)}, the initial "
                                         f"adapter's is {base.dtype}{tuple(base.shape)}", where=p)
                ups.append((t.to(torch.float64) - base.to(torch.float64)).flatten())
            u = torch.stack(ups) if ups else torch.zeros((0, 0), dtype=torch.float64)
            g = (u @ u.T).tolist()
            for i in range(n):
                d = ((u - u[i]) ** 2).sum(dim=1).tolist()
                for j in range(n):
                    gram[i][j] += g[i][j]
                    dist2[i][j] += d[j]
    pairs = []
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if not all(math.isfinite(x) for x in (gram[i][i], gram[j][j], gram[i][j], dist2[i][j])):
                pairs.append(Pair(members[i], members[j], math.nan, math.nan))  # the non-finite marker
                continue
            ni, nj = math.sqrt(gram[i][i]), math.sqrt(gram[j][j])
            cos = gram[i][j] / (ni * nj) if ni > 0 and nj > 0 else None
            rel = math.sqrt(dist2[i][j]) / ni if ni > 0 else None
            pairs.append(Pair(members[i], members[j], cos, rel))
    return pairs


def offenders(pairs: list[Pair], cosine_min: float, relative_delta_l2_max: float) -> tuple[tuple[str, ...],
                                                                                          tuple[str, ...]]:
    """The pairs whose cosine is below ``cosine_min`` and those whose relative delta-L2 exceeds
    ``relative_delta_l2_max``; an undefined (``None``) or non-finite value is never within a tolerance."""
    bad_cos = tuple(f"{p.a.label} ~ {p.b.label}" for p in pairs
                    if p.cosine is None or not math.isfinite(p.cosine) or p.cosine < cosine_min)
    bad_rel = tuple(f"{p.a.label} -> {p.b.label}" for p in pairs if p.relative_delta_l2 is None
                    or not math.isfinite(p.relative_delta_l2) or p.relative_delta_l2 > relative_delta_l2_max)
    return bad_cos, bad_rel


def _spread(values: list[float | None]) -> dict[str, Any]:
    known = sorted(v for v in values if v is not None and math.isfinite(v))
    non_finite = sum(v is not None and not math.isfinite(v) for v in values)
    undefined = sum(v is None for v in values)
    if not known:
        return {"min": None, "median": None, "max": None, "undefined": undefined, "non_finite": non_finite}
    return {"min": known[0], "median": quantile(known, 0.5), "max": known[-1], "undefined": undefined,
            "non_finite": non_finite}


def summarize(pairs: list[Pair]) -> dict[str, Any]:
    """min/median/max of cosine and relative delta-L2, overall and per arm pair (within and across)."""
    groups: dict[str, list[Pair]] = {}
    for p in pairs:
        groups.setdefault(p.group, []).append(p)
    out: dict[str, Any] = {"all": _group(pairs)}
    out["groups"] = {k: _group(v) for k, v in sorted(groups.items())}
    return out


def _group(pairs: list[Pair]) -> dict[str, Any]:
    return {"ordered_pairs": len(pairs), "cosine": _spread([p.cosine for p in pairs]),
            "relative_delta_l2": _spread([p.relative_delta_l2 for p in pairs])}
