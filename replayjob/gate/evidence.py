"""Evidence: which replay metric files a verdict is built from, and the tolerance file.

The metric files themselves are read by :mod:`replayjob.metrics` (one reader per artifact, beside
its writer), re-exported here for the gate: :func:`read_replay`, :func:`read_source`,
:class:`Replay`, :class:`Source`.  Nothing here imports torch, transformers or peft.

Example:
    >>> files = discover(["runs/replays"])            # doctest: +SKIP
    >>> replays = [read_replay(p) for p in files]     # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.config.load import read_toml_bytes, read_toml_file_bytes
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError, RefusedError
from replayjob.metrics import (
    MEASURES,
    REPLAY_FILE,
    SKIPPED,
    SOURCE_FILE,
    Replay,
    Source,
    read_replay,
    read_source,
)

__all__ = ["MEASURES", "REPLAY_FILE", "SKIPPED", "SOURCE_FILE", "Replay", "Source", "Tolerances", "discover",
           "read_pinned_toml", "read_replay", "read_source", "read_tolerances"]


@dataclass(frozen=True)
class Tolerances:
    """A predeclared tolerance file for the approximate claim."""

    path: Path
    sha256: str
    update_cosine_min: float
    relative_delta_l2_max: float


def discover(paths: Sequence[str | Path]) -> list[Path]:
    """Replay metric files named by ``paths``: files as given, directories searched at any depth
    (symbolic links to directories are not followed).  Sorted, each file once."""
    if not paths:
        raise RefusedError("no replay metrics given", hint="pass replay_metrics.json files or directories")
    found: dict[Path, None] = {}
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            found.setdefault(Path(os.path.abspath(p)), None)
        elif p.is_dir():
            hits = [Path(d) / REPLAY_FILE for d, _, names in os.walk(os.path.abspath(p)) if REPLAY_FILE in names]
            if not hits:
                raise RefusedError(f"no {REPLAY_FILE} below this directory", where=p,
                                   hint="point reduce at the replays' output directories")
            for h in hits:
                found.setdefault(h, None)
        else:
            raise RefusedError("replay metrics path not found", where=p, hint="check the path")
    return sorted(found)


def read_pinned_toml(p: Path, what: str, expected_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """A predeclared TOML file (tolerances, budgets) and the SHA-256 of its bytes, which replays pin.

    The bytes are read once and hashed before they are parsed: the digest covers exactly what is
    parsed, and with ``expected_sha256`` a file that is not the pinned one is refused unparsed.
    """
    kw: dict[str, Any] = {"what": f"{what} file", "max_bytes": 1024 * 1024, "error": IntegrityError}
    data = read_toml_file_bytes(p, **kw)  # user-named: a symbolic link is followed, a FIFO refused
    sha = sha256_bytes(data)
    if expected_sha256 is not None and sha != expected_sha256:
        raise IntegrityError(f"the {what} file hashes to {sha}, the pin is {expected_sha256}", where=p,
                             hint=f"use the {what} file that was pinned")
    return read_toml_bytes(data, p, **kw), sha


def read_tolerances(path: str | Path) -> Tolerances:
    """Read a tolerance file: TOML with exactly ``update_cosine_min`` and ``relative_delta_l2_max``."""
    p = Path(path)
    doc, sha = read_pinned_toml(p, "tolerance")
    keys = {"update_cosine_min", "relative_delta_l2_max"}
    unknown = sorted(set(doc) - keys)
    missing = sorted(keys - set(doc))
    if unknown or missing:
        raise IntegrityError(f"tolerance keys: unknown {unknown}, missing {missing}", where=p,
                             hint="write update_cosine_min = 0.99 and relative_delta_l2_max = 0.1")
    values = {}
    for k in sorted(keys):
        v = doc[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise IntegrityError(f"{k} must be a finite number", where=p)
        values[k] = float(v)
    if not -1.0 <= values["update_cosine_min"] <= 1.0 or values["relative_delta_l2_max"] < 0.0:
        raise IntegrityError("update_cosine_min must be in [-1, 1], relative_delta_l2_max >= 0", where=p)
    return Tolerances(p, sha, values["update_cosine_min"], values["relative_delta_l2_max"])
