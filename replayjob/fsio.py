"""Atomic, crash-safe writes: temp file in the same directory, fsync, rename, fsync directory.

A reader therefore sees either nothing or a complete file.  ``exclusive=True`` refuses to replace
an existing destination (checked again at rename time with a hard link, so two concurrent
writers cannot both win).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from replayjob.errors import ArtifactExistsError, RefusedError


def fsync_dir(path: str | Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` atomically; with ``exclusive`` never replace an existing file."""
    dest = Path(path)
    if exclusive and dest.exists():
        raise ArtifactExistsError("refusing to overwrite an existing artifact", where=dest,
                                  hint="write to a new output directory or remove the old one")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as exc:
        raise RefusedError(f"cannot create a file here: {exc.strerror}", where=dest.parent) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            try:
                os.link(tmp, dest)  # fails if dest appeared meanwhile: exactly one writer wins
            except FileExistsError:
                raise ArtifactExistsError("another writer created this artifact first", where=dest,
                                          hint="write to a new output directory") from None
            os.unlink(tmp)
        else:
            os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str, *, exclusive: bool = False) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), exclusive=exclusive)
