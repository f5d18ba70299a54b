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
           "discover_listed", "read_pinned_toml", "read_replay", "read_source", "read_tolerances"]


def discover(paths: Sequence[str | Path]) -> list[Path]:
    """Replay metric files named by ``paths``: files as given, directories searched at any depth
    (symbolic links to directories are not followed).  Sorted, each file once."""
    return [p for p, _ in discover_listed(paths)]


def discover_listed(paths: Sequence[str | Path]) -> list[tuple[Path, tuple[str, ...] | None]]:
    """:func:`discover`'s files, each with the names in its directory as the search listed them (``None`` for a
    file named directly), for :func:`read_replay`'s ``listing``: the rank files beside a replay are read from
    that listing, not listed again.

    One ``scandir`` per directory of the tree (:func:`_hits`): what each entry is comes with the listing, so
    no directory is examined again; paths stay strings until the sorted result is built."""
    if not paths:
        raise RefusedError("no replay metrics given", hint="pass replay_metrics.json files or directories")
    found: dict[str, tuple[str, ...] | None] = {}
    for raw in paths:
        p = Path(raw)
        if p.is_file() or (p.name == REPLAY_FILE and os.path.lexists(p)):  # a replay's file named directly: its
            found.setdefault(os.path.abspath(p), None)                      # reader refuses what is no regular file
        elif p.is_dir():
            hits: list[tuple[str, tuple[str, ...]]] = []
            _hits(os.path.abspath(p), hits)
            if not hits:
                raise RefusedError(f"no {REPLAY_FILE} below this directory", where=p,
                                   hint="point reduce at the replays' output directories")
            for h, names in hits:
                found.setdefault(h, names)
        else:
            raise RefusedError("replay metrics path not found", where=p, hint="check the path")
    if any(s.startswith("//") for s in found):  # POSIX's implementation-defined root: pathlib orders it
        return sorted(((Path(s), names) for s, names in found.items()), key=lambda e: e[0])
    return [(Path(s), found[s]) for s in sorted(found, key=_parts)]  # by the paths' parts, as pathlib sorts


def _parts(path: str) -> list[str]:
    return path.split("/")


def _hits(top: str, out: list[tuple[str, tuple[str, ...]]]) -> None:
    """Append every :data:`REPLAY_FILE` at or below the directory ``top`` to ``out``, with the names in its
    directory, as :func:`os.walk` finds them, but refusing what a walk passes over in silence: a directory that
    cannot be listed, and a symbolic link to a directory (a replay hidden behind either would drop out of the
    evidence unseen).  An entry of that name counts whatever it is, and its reader refuses a link, a directory or
    a FIFO (a replay whose file is not a file is malformed evidence, never missing evidence)."""
    try:
        listing = os.scandir(top)
    except OSError as exc:
        raise RefusedError(f"cannot list this directory of the evidence: {exc.strerror}", where=top,
                           hint="make every directory below the replays readable, or name only the readable ones"
                           ) from None
    below: list[str] = []
    names: list[str] = []
    hit: str | None = None
    with listing:
        for entry in listing:
            names.append(entry.name)
            try:
                linked_dir = entry.is_symlink() and entry.is_dir()
                if linked_dir:
                    raise RefusedError("a symbolic link to a directory inside the evidence is refused: the replays "
                                       "below it would be left out unseen", where=entry.path,
                                       hint="copy the directory in instead of linking to it")
                if entry.name == REPLAY_FILE:  # whatever it is: its reader refuses what is no regular file
                    hit = entry.path
                elif entry.is_dir(follow_symlinks=False):
                    below.append(entry.path)
            except OSError:  # os.walk counts an entry it cannot examine as a file, and enters no such entry
                if entry.name == REPLAY_FILE:
                    hit = entry.path
    if hit is not None:
        out.append((hit, tuple(names)))
    for d in below:
        _hits(d, out)
