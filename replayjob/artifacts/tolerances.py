"""The tolerance file of the approximate claim (docs/verdict-format.md), declared.

A TOML file pinned by SHA-256 in every replay (``[optimizer_batch] tolerances_sha256``) before the runs::

    update_cosine_min = 0.99        # the cosine of the replayed update with the source's, in [-1, 1]
    relative_delta_l2_max = 0.1     # ||update - source update|| / ||source update||, >= 0
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from replayjob.artifacts.document import read_declared_toml
from replayjob.declaration import Document, NonNegative

HINT = "write update_cosine_min = 0.99 and relative_delta_l2_max = 0.1"


class TolerancesFile(Document, frozen=True):
    update_cosine_min: Annotated[float, msgspec.Meta(ge=-1.0, le=1.0)]
    relative_delta_l2_max: NonNegative


@dataclass(frozen=True)
class Tolerances:
    """A predeclared tolerance file for the approximate claim, with the file it was read from."""

    path: Path
    sha256: str
    update_cosine_min: float
    relative_delta_l2_max: float


def read_tolerances(path: str | Path) -> Tolerances:
    """Read a tolerance file through its declaration (exactly the two keys, finite, in range)."""
    p = Path(path)
    doc, sha = read_declared_toml(p, TolerancesFile, "tolerance", HINT)
    return Tolerances(p, sha, doc.update_cosine_min, doc.relative_delta_l2_max)
