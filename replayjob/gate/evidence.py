"""Evidence: which replay metric files a verdict is built from, and the tolerance file.

The metric files themselves are read by :mod:`replayjob.artifacts.metrics` (one reader per artifact, beside
its writer), and the tolerance file by its declaration (:mod:`replayjob.artifacts.tolerances`), re-exported
here for the gate: :func:`read_replay`, :func:`read_source`, :func:`read_tolerances`, :class:`Replay`,
:class:`Source`, :class:`Tolerances`.  Nothing here imports torch, transformers or peft.

Example:
    >>> files = discover(["runs/replays"])            # doctest: +SKIP
    >>> replays = [read_replay(p) for p in files]     # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from replayjob.artifacts.document import read_pinned_toml
from replayjob.artifacts.metrics import (
    MEASURES,
    REPLAY_FILE,
    SKIPPED,
    SOURCE_FILE,
    Replay,
    Source,
    read_replay,
    read_source,
)
from replayjob.artifacts.tolerances import Tolerances, read_tolerances
from replayjob.errors import RefusedError

__all__ = ["MEASURES", "REPLAY_FILE", "SKIPPED", "SOURCE_FILE", "Replay", "Source", "Tolerances", "discover",
           "read_pinned_toml", "read_replay", "read_source", "read_tolerances"]


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


