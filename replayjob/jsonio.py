"""Strict JSON in, canonical JSON out.

Everything replayjob reads is untrusted, so :func:`loads_strict` refuses what the standard
library quietly accepts: invalid UTF-8, duplicate keys (no last-one-wins), ``NaN`` and
``Infinity`` literals, integers beyond 64 bits and documents nested deeper than a limit.

Example:
    >>> canonical_bytes({"b": 1, "a": [1.5, "x"]})
    b'{"a":[1.5,"x"],"b":1}'
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError

MAX_DEPTH = 64
MAX_INT_DIGITS = 20  # 2**64 has 20 digits
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite literal {name} is not allowed")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer with {len(text)} digits is out of range")
    return int(text)


def _depth_ok(text: str) -> bool:
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return True  # cannot nest deeper than the number of openers (C-speed fast path)
    depth = 0
    in_str = False
    escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def loads_strict(data: bytes | str, *, where: str | Path = "<json>") -> Any:
    """Parse one JSON document strictly or raise :class:`IntegrityError` naming ``where``."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise IntegrityError(f"not valid UTF-8 at byte {exc.start}", where=where) from None
    else:
        text = data
    if not _depth_ok(text):
        raise IntegrityError(f"JSON nested deeper than {MAX_DEPTH} levels", where=where)
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_int=_bounded_int,
        )
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"malformed JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                             where=where) from None
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"malformed JSON: {exc}", where=where) from None


def read_json(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, follow_symlinks: bool = False) -> Any:
    """Read and strictly parse a JSON file; a missing, oversized or non-regular file is refused.

    Devices and FIFOs are refused without blocking, and a symbolic link unless ``follow_symlinks``
    (:func:`replayjob.fsio.read_regular_bytes`).
    """
    from replayjob.fsio import read_regular_bytes

    p = Path(path)
    data = read_regular_bytes(p, max_bytes=max_bytes, follow_symlinks=follow_symlinks, what="JSON file")
    return loads_strict(data, where=p)


def read_json_object(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                     follow_symlinks: bool = False) -> dict[str, Any]:
    """:func:`read_json` that also requires a top-level object."""
    doc = read_json(path, max_bytes=max_bytes, follow_symlinks=follow_symlinks)
    if not isinstance(doc, dict):
        raise IntegrityError(f"expected a JSON object, found {type(doc).__name__}", where=path)
    return doc


def canonical_bytes(obj: Any, *, allow_nan: bool = False) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8, floats by ``repr``, no NaN.

    ``allow_nan`` writes ``NaN``/``Infinity`` literals: only for ``diag.jsonl`` rows, the one format
    whose readers accept them (a diverged loss must be recorded there)."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=allow_nan).encode("utf-8")
    except (TypeError, ValueError) as exc:  # NaN, or a value JSON has no form for
        raise IntegrityError(f"cannot write canonical JSON: {exc}") from None


def non_finite_as_strings(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"`` (the form diag-diff's JSON uses), so a strict writer can emit it."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: non_finite_as_strings(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [non_finite_as_strings(v) for v in obj]
    return obj


def pretty_bytes(obj: Any) -> bytes:
    """Stable human-readable JSON (sorted keys, two-space indent, trailing newline); strict: a NaN or an
    infinity is refused (:class:`IntegrityError`), never written.  Every CLI ``--json`` output uses it."""
    try:
        text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise IntegrityError(f"cannot write JSON: {exc}") from None
    return (text + "\n").encode("utf-8")
