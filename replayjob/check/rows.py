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

A line is UTF-8 text: it is decoded strictly before it is parsed (the standard library's parser of
bytes would take a byte-order mark at the start of any line, and an encoded surrogate half, which no
UTF-8 writer writes, as text).  A number literal beyond the float range (``1e400``) is refused: it is
no float a writer wrote (an infinite value is written ``Infinity``), and it would read as one.  An
integer literal of more than :data:`MAX_INT_DIGITS` digits is refused naming its length.

A row's ``step`` is read by one rule (:class:`Steps`) wherever rows are read by step: diag-diff and signals
alike.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError
from replayjob.fsio import open_regular
from replayjob.jsonio import fast_loads, lone_surrogate

MAX_INT_DIGITS = 4300  # the longest integer literal read (Python's own limit on converting one)


def as_float(v: int | float, what: str, where: str | Path) -> float:
    """``v`` as a float; an integer beyond the float range is refused, never rounded to an infinity."""
    try:
        return float(v)
    except OverflowError:
        raise IntegrityError(f"{what} is an integer of {len(str(abs(v)))} digits, too large for a float",
                             where=where, hint="write numbers within the 64-bit float range "
                                               "(about 1.8e308)") from None


class Steps:
    """The rows' ``step``, one rule for every reader of diagnostics by step (diag-diff and signals): every row has
    a numeric one or none does, and each finite step is greater than the finite step before it.  A file where the
    steps start over is a restarted run appended to its first run's rows (or rows out of order): a trend, a last
    value, a window or a row-by-row comparison over it would mix two runs."""

    def __init__(self, where: str | Path):
        self.where = where
        self.numbered: bool | None = None
        self.last: float | None = None

    def check(self, row: dict[str, Any], lineno: int) -> int | float | None:
        """``row``'s step (None when rows have none), or a refusal naming the line."""
        step = row.get("step", _NO_STEP)
        if step is not _NO_STEP and (isinstance(step, bool) or not isinstance(step, int | float)):
            raise IntegrityError(f"line {lineno}: step is {type(step).__name__} {step!r:.40}, not a number",
                                 where=self.where, hint="write the step as a number, or leave it out of every row")
        numbered = step is not _NO_STEP
        if self.numbered is None:
            self.numbered = numbered
        elif numbered != self.numbered:
            first = "has one" if self.numbered else "has none"
            raise IntegrityError(f"line {lineno}: {'a' if numbered else 'no'} 'step', but the first row {first}",
                                 where=self.where, hint="every row needs a step, or none does")
        if not numbered:
            return None
        assert isinstance(step, int | float)
        value = as_float(step, f"line {lineno}: step", self.where)
        if math.isfinite(value):
            if self.last is not None and value <= self.last:
                raise IntegrityError(f"line {lineno}: step {step!r} does not increase (previous {self.last:g})",
                                     where=self.where, hint="a restarted run may have appended to the file: "
                                                            "compare or grade each run's own diag.jsonl")
            self.last = value
        return step


_NO_STEP: Any = object()


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


def _finite_number(text: str) -> float:
    """A float literal, refused when it overflows to an infinity (``1e400``: the literal ``Infinity`` is read)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is beyond the float range (write an infinite value as Infinity)")
    return value


def _integer(text: str) -> int:
    """An integer literal of at most :data:`MAX_INT_DIGITS` digits (a longer one is refused naming its length,
    whatever limit the interpreter sets)."""
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are read)")
    return int(text)


def parse_line(line: bytes, lineno: int, where: str | Path) -> dict[str, Any]:
    """Parse one JSONL line into an object, or refuse naming ``where`` and the line number."""
    row = fast_loads(line, strict=False)
    if type(row) is dict:
        return row
    return parse_line_stdlib(line, lineno, where)


def parse_line_stdlib(line: bytes, lineno: int, where: str | Path) -> dict[str, Any]:
    """:func:`parse_line` by the standard library alone: what decides whenever the fast parse cannot vouch
    for a line (and the reference the fast parse is tested against)."""
    try:  # strictly: json.loads of bytes would take a byte-order mark and an encoded surrogate half
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"line {lineno}: not valid UTF-8 at byte {exc.start}", where=where) from None
    if text.startswith("\ufeff"):
        raise IntegrityError(f"line {lineno}: malformed JSON: a byte-order mark (U+FEFF) begins the line",
                             where=where, hint="write the file as UTF-8 without a byte-order mark")
    try:
        row = json.loads(text, object_pairs_hook=_unique_keys, parse_float=_finite_number, parse_int=_integer)
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"line {lineno}: malformed JSON: {exc.msg} (column {exc.colno})",
                             where=where, hint="the file may be truncated or corrupted") from None
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"line {lineno}: malformed JSON: {exc}", where=where) from None
    if not isinstance(row, dict):
        raise IntegrityError(f"line {lineno}: expected a JSON object, found {type(row).__name__}",
                             where=where)
    bad = lone_surrogate(text, row)
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
