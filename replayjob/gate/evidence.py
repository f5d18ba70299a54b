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
    (symbolic links to directories are not followed).  Sorted, each file once.

    One ``scandir`` per directory of the tree (:func:`_hits`): what each entry is comes with the listing, so
    no directory is examined again; paths stay strings until the sorted result is built."""
    if not paths:
        raise RefusedError("no replay metrics given", hint="pass replay_metrics.json files or directories")
    found: dict[str, None] = {}
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            found.setdefault(os.path.abspath(p), None)
        elif p.is_dir():
            hits: list[str] = []
            _hits(os.path.abspath(p), hits)
            if not hits:
                raise RefusedError(f"no {REPLAY_FILE} below this directory", where=p,
                                   hint="point reduce at the replays' output directories")
            for h in hits:
                found.setdefault(h, None)
        else:
            raise RefusedError("replay metrics path not found", where=p, hint="check the path")
    if any(s.startswith("//") for s in found):  # POSIX's implementation-defined root: pathlib orders it
        return sorted(Path(s) for s in found)
    return [Path(s) for s in sorted(found, key=_parts)]  # the order of the paths' parts, as pathlib sorts them


def _parts(path: str) -> list[str]:
    return path.split("/")


def _hits(top: str, out: list[str]) -> None:
    """Append every :data:`REPLAY_FILE` at or below the directory ``top`` to ``out``, as :func:`os.walk` finds
    them: an unreadable directory is passed over, a directory reached through a symbolic link is not entered,
    and an entry of that name counts unless it is a directory (a link to one included)."""
    try:
        listing = os.scandir(top)
    except OSError:
        return
    below: list[str] = []
    with listing:
        for entry in listing:
            try:
                if entry.name == REPLAY_FILE:
                    if not entry.is_dir():
                        out.append(entry.path)
                    elif not entry.is_symlink():
                        below.append(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    below.append(entry.path)
            except OSError:  # os.walk counts an entry it cannot examine as a file, and enters no such entry
                if entry.name == REPLAY_FILE:
                    out.append(entry.path)
    for d in below:
        _hits(d, out)
