"""The declared mismatch bound: a small TOML file, pinned by SHA-256 before the capture is examined.

On CPU a same-condition recompute is bitwise, so there is no noise floor to infer a bound from: it
is declared.  The file holds exactly::

    max_abs_log_ratio = 1e-4    # the largest per-token |log pi_trainer - log pi_source|
    max_kl = 1e-8               # the largest k3 KL estimate (mean of rho - 1 - log rho)
    band = 0.001                # d: a token's ratio rho is outside the band when |rho - 1| > d
    max_outside_share = 0.0     # the largest share of tokens outside the band

and its SHA-256 is pinned in the capture's replay config as ``[optimizer_batch]
mismatch_bound_sha256``, as a tolerance file is pinned (``tolerances_sha256``): a bound that is not
pinned, or whose bytes do not match the pin, is refused (exit 2) before anything is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.artifacts.document import read_declared_toml
from replayjob.declaration import Document, NonNegative, Share
from replayjob.digest import normalize_digest
from replayjob.errors import IntegrityError

KEYS = ("max_abs_log_ratio", "max_kl", "band", "max_outside_share")
EXAMPLE = "max_abs_log_ratio = 1e-4, max_kl = 1e-8, band = 0.001, max_outside_share = 0.0"


class BoundFile(Document, frozen=True):
    max_abs_log_ratio: NonNegative
    max_kl: NonNegative
    band: NonNegative
    max_outside_share: Share


@dataclass(frozen=True)
class Bound:
    path: Path
    sha256: str
    max_abs_log_ratio: float
    max_kl: float
    band: float
    max_outside_share: float

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "sha256": self.sha256, **{k: getattr(self, k) for k in KEYS}}


def read_bound(path: str | Path, pin: str) -> Bound:
    """Read the bound file through its declaration and check it against ``pin``
    (``optimizer_batch.mismatch_bound_sha256``)."""
    p = Path(path)
    doc, sha = read_declared_toml(p, BoundFile, "mismatch bound", f"write exactly {EXAMPLE}")
    if not pin:
        raise IntegrityError("the mismatch bound is not pinned: a bound chosen after seeing the result decides "
                             "nothing", where="optimizer_batch.mismatch_bound_sha256",
                             hint=f"set optimizer_batch.mismatch_bound_sha256 = \"{sha}\" in the capture's replay "
                                  "config (or --set it) when the bound is declared")
    want = normalize_digest(pin, what="optimizer_batch.mismatch_bound_sha256")
    if want != sha:
        raise IntegrityError(f"the mismatch bound file hashes to {sha}, the replay config pins {want}", where=p,
                             hint="use the bound file that was declared, or declare this one by pinning its SHA-256")
    return Bound(p, sha, **{k: float(getattr(doc, k)) for k in KEYS})
