"""Streaming reader of JSONL diagnostics: one JSON object per line, one line at a time.

Diagnostics are large (thousands of rows of hundreds of leaves), so a file is never held in
memory.  Each line reads as the standard library's parser reads it, which accepts the ``NaN`` and
``Infinity`` literals Python writers emit for non-finite metrics (a diverged loss is exactly what
these checks must see) and refuses duplicate keys here.  A line is first parsed by msgspec's faster
C parser (:func:`replayjob.jsonio.fast_loads`: kept only when it provably reads the same, duplicate
keys included); a line it refuses or cannot vouch for (a ``NaN``, a duplicate key, deep nesting,
invalid UTF-8) is parsed by the standard library, which decides.  Blank lines are skipped; anything
else that is not a JSON object is refused with its line number, so a truncated or corrupted file
never passes as a shorter one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError
from replayjob.fsio import open_regular
from replayjob.jsonio import fast_loads, lone_surrogate


def open_jsonl(path: str | Path, *, follow_symlinks: bool = True) -> Any:
    """Open ``path`` for binary line reading, or refuse naming the file.

    A JSONL file the user names may be a symbolic link; one found inside an artifact directory (a run
    directory's diag.jsonl) is opened with ``follow_symlinks=False``, which refuses a link.
    """
    p = Path(path)
    if p.is_dir():
        raise IntegrityError("is a directory, not a JSONL file", where=p, hint="pass the diag.jsonl inside it")
    if not p.exists() and not p.is_symlink():
        raise IntegrityError("file not found", where=p, hint="check the path")
    # devices and FIFOs refused without blocking
    fd, _size = open_regular(p, follow_symlinks=follow_symlinks, what="JSONL file")
    return os.fdopen(fd, "rb")  # the caller closes it (iter_rows streams it across a generator)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object with a repeated key is refused, not read last-one-wins."""
    row = dict(pairs)
    if len(row) != len(pairs):
        keys = [k for k, _ in pairs]
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return row


def parse_line(line: bytes, lineno: int, where: str | Path) -> dict[str, Any]:
    """Parse one JSONL line into an object, or refuse naming ``where`` and the line number."""
    row = fast_loads(line, strict=False)
    if type(row) is dict:
        return row
    return parse_line_stdlib(line, lineno, where)


def parse_line_stdlib(line: bytes, lineno: int, where: str | Path) -> dict[str, Any]:
    """:func:`parse_line` by the standard library alone: what decides whenever the fast parse cannot vouch
    for a line (and the reference the fast parse is tested against)."""
    try:
        row = json.loads(line, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"line {lineno}: not valid UTF-8 at byte {exc.start}", where=where) from None
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"line {lineno}: malformed JSON: {exc.msg} (column {exc.colno})",
                             where=where, hint="the file may be truncated or corrupted") from None
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"line {lineno}: malformed JSON: {exc}", where=where) from None
    if not isinstance(row, dict):
        raise IntegrityError(f"line {lineno}: expected a JSON object, found {type(row).__name__}",
                             where=where)
    bad = lone_surrogate(line.decode("utf-8", "replace"), row)  # the line was valid UTF-8: json.loads read it
    if bad is not None:
        raise IntegrityError(f"line {lineno}: malformed JSON: {bad}", where=where,
                             hint="write keys and strings as Unicode text (a UTF-16 pair is escaped whole)")
    return row


def iter_rows(path: str | Path, *, follow_symlinks: bool = True) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, row)`` for every non-blank line of ``path`` (1-based numbers); see
    :func:`open_jsonl` for ``follow_symlinks``."""
    with open_jsonl(path, follow_symlinks=follow_symlinks) as f:
        try:
            for lineno, line in enumerate(f, 1):
                if line.isspace():
                    continue
                yield lineno, parse_line(line, lineno, path)
        except OSError as exc:
            raise IntegrityError(f"cannot read: {exc.strerror}", where=path) from None
