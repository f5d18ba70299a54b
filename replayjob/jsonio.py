"""Strict JSON in, canonical JSON out.

Everything replayjob reads is untrusted, so :func:`loads_strict` refuses what the standard
library quietly accepts: invalid UTF-8, duplicate keys (no last-one-wins), ``NaN`` and
``Infinity`` literals, numbers that overflow to an infinity (``1e400``), integers beyond 64 bits and
documents nested deeper than a limit.

Speed: a document is first parsed by msgspec's C parser (strict JSON: it refuses the ``NaN`` and
``Infinity`` literals, invalid UTF-8, lone surrogates, numbers out of range), and that result is
kept only when it provably reads as the standard library reads it (:func:`fast_loads`): no
duplicate key (every ``:`` byte of the text is accounted for by a member of an object or, in a text
without a ``\\u`` escape, by a ``:`` inside a string; a duplicate would leave one over), and, for
:func:`loads_strict`, the depth and integer limits hold.  Anything else -- an error, a doubt -- is
parsed again by the standard library with the rules above, which decides and words the refusal, so
what is accepted, what it reads as and every message are exactly the standard library's.

Example:
    >>> canonical_bytes({"b": 1, "a": [1.5, "x"]})
    b'{"a":[1.5,"x"],"b":1}'
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError
from replayjob.fsio import read_regular_bytes

try:
    import msgspec

    _DECODE: Callable[[bytes | str], Any] | None = msgspec.json.Decoder().decode
    _ENCODE: Callable[[Any], bytes] | None = msgspec.json.Encoder(order="sorted").encode
except ImportError:  # pragma: no cover - msgspec is a dependency; without it the standard library reads all
    _DECODE = _ENCODE = None

MAX_DEPTH = 64
MAX_INT_DIGITS = 20  # 2**64 has 20 digits
_INT_BOUND = 10 ** MAX_INT_DIGITS  # an integer of at most MAX_INT_DIGITS digits is below this in magnitude
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MISS = object()  # what fast_loads returns when the standard library must decide
FAST_DEPTH = 200  # without the strict limits, documents nested deeper are parsed by the standard library


class _Doubt(Exception):
    """The fast parse cannot vouch for this document: the standard library decides."""


def _members(obj: Any, depth: int, strict: bool) -> int:
    """Members of every object in ``obj`` (a dict or list), nested ones included.  :class:`_Doubt` past
    :data:`FAST_DEPTH` levels (deeper documents are left to the standard library's own recursion limit);
    with ``strict``, past :data:`MAX_DEPTH` levels or on an integer of more than :data:`MAX_INT_DIGITS`
    digits (what :func:`loads_strict` refuses)."""
    if depth > (MAX_DEPTH if strict else FAST_DEPTH):
        raise _Doubt
    if type(obj) is dict:
        n = len(obj)
        values: Any = obj.values()
    else:
        n, values = 0, obj
    for v in values:
        t = type(v)
        if t is dict or t is list:
            n += _members(v, depth + 1, strict)
        elif strict and t is int and not -_INT_BOUND < v < _INT_BOUND:
            raise _Doubt
    return n


def _string_colons(obj: Any) -> int:
    """``:`` characters inside every key and string value of ``obj``."""
    t = type(obj)
    if t is str:
        return int(obj.count(":"))
    n = 0
    if t is dict:
        for k, v in obj.items():
            n += k.count(":") + _string_colons(v)
    elif t is list:
        for v in obj:
            n += _string_colons(v)
    return n


def fast_loads(data: bytes | str, *, strict: bool = True) -> Any:
    """msgspec's parse of ``data`` when it provably equals the standard library's, else :data:`MISS`.

    msgspec keeps the last of duplicate keys, so the members it built are counted: each came from a
    ``:`` of the text, so when they account for every ``:`` byte (a ``:`` byte is never part of a
    multi-byte UTF-8 character) no member was dropped.  A text with ``:`` inside strings passes when it
    has no ``\\u`` escape and members plus the ``:`` in the strings read account for every one: every other
    escape (``\\"``, ``\\\\``, ``\\n``, ...) reads as a character that is not ``:``, so each ``:`` read in a string
    stands for one ``:`` byte of the text, while ``\\u003a`` would read as a ``:`` with no byte of its own and
    could hide a dropped member.  (A ``\\\\u`` that is an escaped backslash before a ``u`` declines too:
    the standard library decides.)  ``strict``: also :func:`loads_strict`'s depth and integer limits (the
    diag reader has neither; a document nested deeper than :data:`FAST_DEPTH` is left to the standard
    library, whose recursion limit decides as it always did).
    """
    if _DECODE is None:  # pragma: no cover
        return MISS
    try:
        obj = _DECODE(data)
        t = type(obj)
        if t is dict or t is list:
            n = _members(obj, 1, strict)
        elif strict and t is int and not -_INT_BOUND < obj < _INT_BOUND:
            return MISS
        else:
            n = 0
        if isinstance(data, bytes):
            colons, escaped = data.count(b":"), b"\\u" in data
        else:
            colons, escaped = data.count(":"), "\\u" in data
        if n == colons or (not escaped and n + _string_colons(obj) == colons):
            return obj
    except Exception:  # any doubt (a parse error, the depth, an integer's size): the standard library decides
        pass
    return MISS


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


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 overflows to an infinity: as non-finite as the literal
        raise ValueError(f"number {text[:32]}{'...' if len(text) > 32 else ''} overflows to a non-finite float")
    return value


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
    obj = fast_loads(data)
    if obj is not MISS:
        return obj
    return loads_stdlib(data, where=where)


def loads_stdlib(data: bytes | str, *, where: str | Path = "<json>") -> Any:
    """:func:`loads_strict` by the standard library alone: what decides whenever the fast parse cannot vouch
    for a document (and the reference the fast parse is tested against)."""
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
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"malformed JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                             where=where) from None
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"malformed JSON: {exc}", where=where) from None
    bad = lone_surrogate(text, obj)
    if bad is not None:
        raise IntegrityError(f"malformed JSON: {bad}", where=where)
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate(text: str, obj: Any) -> str | None:
    """Why ``obj`` (parsed from ``text``) is not Unicode text, or None: a ``\\ud800``-style escape of half a
    surrogate pair parses to a string no UTF-8 writer can write back (every report of it would fail, exit 3)."""
    if not _SURROGATE_ESCAPE.search(text):  # the common case: no surrogate escape at all
        return None
    stack = [obj]
    while stack:
        node = stack.pop()
        strings = [node] if isinstance(node, str) else list(node) if isinstance(node, dict) else []
        for s in strings:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:
                return (f"a string holds a lone surrogate (\\u{ord(s[exc.start]):04x}), half of a UTF-16 pair: "
                        "not Unicode text")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def read_json(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, follow_symlinks: bool = False) -> Any:
    """Read and strictly parse a JSON file; a missing, oversized or non-regular file is refused.

    Devices and FIFOs are refused without blocking, and a symbolic link unless ``follow_symlinks``
    (:func:`replayjob.fsio.read_regular_bytes`).
    """

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
    infinity is refused (:class:`IntegrityError`), never written.  Every CLI ``--json`` output uses it.

    The bytes are the standard library's ``json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False)``
    (its pure-Python indenting encoder), produced by msgspec's C encoder and formatter whenever that is
    provably the same text (:func:`_fast_pretty`); anything else goes to the standard library, which decides
    and words every refusal."""
    fast = _fast_pretty(obj)
    if fast is not None:
        return fast
    try:
        text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise IntegrityError(f"cannot write JSON: {exc}") from None
    return (text + "\n").encode("utf-8")


_REPR_LOW, _REPR_HIGH = 1e-4, 1e16  # a float's repr is positional exactly for 0 and 1e-4 <= |x| < 1e16
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


def _fast_pretty(obj: Any) -> bytes | None:
    """:func:`pretty_bytes`'s text through msgspec, or ``None`` when the standard library must write it.

    msgspec escapes strings, orders keys and spells integers and positional floats (``repr``'s form for 0 and
    1e-4 <= |x| < 1e16) exactly as the standard library does, and ``msgspec.json.format`` lays out the
    two-space indent the same way; only floats that ``repr`` writes with an exponent differ (``1e-05`` is
    msgspec's ``0.00001``), so those are written as their ``repr`` (:func:`_plain`).  Anything that is not a
    plain JSON value (a subclass, a key that is not a string, a NaN or an infinity, a nesting deeper than
    :data:`FAST_DEPTH`) or any error is left to the standard library."""
    if _ENCODE is None:  # pragma: no cover
        return None
    try:
        return msgspec.json.format(_ENCODE(_plain(obj, 0)), indent=2) + b"\n"
    except Exception:  # a doubt or an error: the standard library writes it, or words the refusal
        return None


def _plain(obj: Any, depth: int) -> Any:
    """``obj`` with every float ``repr`` writes with an exponent as ``msgspec.Raw(repr(x))`` (containers copied
    only where one lies), or :class:`_Doubt` for anything that is not a plain JSON value."""
    t = type(obj)
    if t is str or t is bool or obj is None:
        return obj
    if t is int:
        if not _INT64_MIN <= obj <= _UINT64_MAX:
            raise _Doubt
        return obj
    if t is float:
        if obj == 0.0 or _REPR_LOW <= abs(obj) < _REPR_HIGH:
            return obj
        if obj != obj or obj in (math.inf, -math.inf):
            raise _Doubt
        return msgspec.Raw(repr(obj).encode("ascii"))
    if depth > FAST_DEPTH:
        raise _Doubt
    if t is dict:
        out: dict[str, Any] | None = None
        for k, v in obj.items():
            if type(k) is not str:
                raise _Doubt
            w = _plain(v, depth + 1)
            if w is not v:
                if out is None:
                    out = dict(obj)
                out[k] = w
        return obj if out is None else out
    if t is list or t is tuple:
        items: list[Any] | None = None
        for i, v in enumerate(obj):
            w = _plain(v, depth + 1)
            if w is not v:
                if items is None:
                    items = list(obj)
                items[i] = w
        return obj if items is None else items
    raise _Doubt
