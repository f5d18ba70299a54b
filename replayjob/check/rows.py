"""Streaming reader of JSONL diagnostics: one JSON object per line, one line at a time.

Diagnostics are large (thousands of rows of hundreds of leaves), so a file is never held in
memory.  Each line is parsed by the standard library's C parser, which accepts the ``NaN`` and
``Infinity`` literals Python writers emit for non-finite metrics (a diverged loss is exactly what
these checks must see).  Blank lines are skipped; anything else that is not a JSON object is
refused with its line number, so a truncated or corrupted file never passes as a shorter one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError


def open_jsonl(path: str | Path) -> Any:
    """Open ``path`` for binary line reading, or refuse naming the file."""
    p = Path(path)
    if p.is_dir():
        raise IntegrityError("is a directory, not a JSONL file", where=p, hint="pass the diag.jsonl inside it")
    try:
        return open(p, "rb")  # the caller closes it (iter_rows streams it across a generator)
    except FileNotFoundError:
        raise IntegrityError("file not found", where=p, hint="check the path") from None
    except OSError as exc:
        raise IntegrityError(f"cannot read: {exc.strerror}", where=p) from None


def parse_line(line: bytes, lineno: int, where: str | Path) -> dict[str, Any]:
    """Parse one JSONL line into an object, or refuse naming ``where`` and the line number."""
    try:
        row = json.loads(line)
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
    return row


def iter_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, row)`` for every non-blank line of ``path`` (1-based numbers)."""
    with open_jsonl(path) as f:
        try:
            for lineno, line in enumerate(f, 1):
                if line.isspace():
                    continue
                yield lineno, parse_line(line, lineno, path)
        except OSError as exc:
            raise IntegrityError(f"cannot read: {exc.strerror}", where=path) from None
