"""How a document is declared, and the one way a declared document is read (every layer declares through this).

A document replayjob reads is a :class:`Document`: a ``msgspec.Struct`` whose fields declare each value's
type, range and finiteness (the aliases below), whether it may be absent (a default) and, through
``__post_init__``, the rules that tie fields together, above all **summaries**: a field that is a
function of other fields or of a payload (a flag of its figures, a rate of a count and a time, a row
count) is recomputed from them and a difference refused.  :func:`decode` turns already-parsed JSON or
TOML into the declared type, or refuses naming the file, the field and the rule it broke; nothing is
coerced (``false`` or ``0.0`` where an integer is declared is refused, and so is an integer beyond 64
bits, a NaN or an infinity, an unknown key or schema).  Duplicate keys, non-finite literals and numbers
that overflow are refused one step earlier, by the strict parsers (:func:`replayjob.jsonio.loads_strict`,
:mod:`replayjob.config.load`).

Example:
    >>> class Point(Document, frozen=True):
    ...     x: Count
    ...     share: Share = 0.0
    >>> decode({"x": 3}, Point, where="p.json")
    Point(x=3, share=0.0)
    >>> decode({"x": True}, Point, where="p.json")
    Traceback (most recent call last):
    ...
    replayjob.errors.IntegrityError: p.json: field `x`: expected `int`, got `bool`
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from replayjob.errors import IntegrityError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
FLOAT_MAX = sys.float_info.max  # the largest finite float: a bound that NaN and the infinities fail

Int = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
"""A signed 64-bit integer (never a bool, never a float with an integral value)."""
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
"""An integer >= 0 that fits 64 bits."""
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
"""An integer >= 1 that fits 64 bits."""
Finite = Annotated[float, msgspec.Meta(ge=-FLOAT_MAX, le=FLOAT_MAX)]
"""A finite number (an integer is read as a float; NaN and the infinities fail both bounds)."""
NonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=FLOAT_MAX)]
"""A finite number >= 0."""
Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
"""A fraction in [0, 1]."""


def whole(regex: str) -> msgspec.Meta:
    """The constraint of a string that ``regex`` matches as a whole.  msgspec searches a pattern, and ``$`` matches
    before a final newline too, so a pattern anchored ``^...$`` takes ``"value\\n"``: every declared pattern is made
    here, anchored with ``\\Z`` (``tests/test_declarations.py`` finds any other)."""
    return msgspec.Meta(pattern=f"^(?:{regex})\\Z")


_DIGEST = whole("[0-9a-f]{64}")
_WHOLE = re.compile(r"matching regex '\^\(\?:(.*)\)\\\\Z'")  # how msgspec names (repr) a pattern whole() made
Digest = Annotated[str, _DIGEST]
"""A SHA-256 digest: 64 lower-case hexadecimal digits."""
Text = Annotated[str, msgspec.Meta(min_length=1)]
"""A non-empty string."""
UNPRINTABLE = "\\x00-\\x1f\\x7f-\\x9f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069"
"""A regex character class: the controls, line breaks and bidi controls no printed name may hold."""
Printable = Annotated[str, whole(f"[^{UNPRINTABLE}]+")]
"""A non-empty string a report prints as is: no newline, escape or bidi control (it would print text of its own)."""
OneLine = Annotated[str, whole(f"[^{UNPRINTABLE}]*")]
"""A :data:`Printable` string that may be empty."""


class Document(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The base of every declared document: no unknown field, every field typed; immutable once read.

    A subclass repeats ``frozen=True`` (type checkers read each class's own options).  Its ``__post_init__``
    states its cross-field rules and summaries; it raises
    :class:`ValueError` with a sentence naming the field, which :func:`decode` reports with the file.
    """


D = TypeVar("D", bound=Document)


def describe(exc: msgspec.ValidationError) -> str:
    """msgspec's ``Expected `int`, got `bool` - at `$.a.b``` as ``field `a.b`: expected `int`, got `bool```."""
    text = str(exc).replace(f"Expected `str` matching regex {_DIGEST.pattern!r}",
                            "Expected a SHA-256: 64 lowercase hex digits")
    for pattern, words in ((f"[^{UNPRINTABLE}]+", "of printable characters"),
                           (f"[^{UNPRINTABLE}]*", "of printable characters or empty")):
        text = text.replace(f"`str` matching regex {whole(pattern).pattern!r}",
                            f"`str` {words} (no newline, tab, escape or bidi control)")
    text = _WHOLE.sub(lambda m: f"matching `{m.group(1)}` as a whole", text)  # whole()'s anchors, said in words
    rule, sep, at = text.rpartition(" - at `")
    if not sep:
        return text[:1].lower() + text[1:]
    path = at.rstrip("`").removeprefix("$").lstrip(".")
    return f"field `{path}`: {rule[:1].lower()}{rule[1:]}" if path else rule[:1].lower() + rule[1:]


def decode(obj: Any, kind: type[D], *, where: str | Path, hint: str | None = None) -> D:
    """``obj`` (parsed JSON or TOML) as the declared ``kind``, or :class:`IntegrityError` naming ``where``, the
    field and the rule it broke."""
    try:
        return msgspec.convert(obj, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise IntegrityError(_with_key(describe(exc), obj, kind), where=where, hint=hint) from None


_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[\.\.\.\]")


def _with_key(text: str, obj: Any, kind: type[Document]) -> str:
    """msgspec names a mapping's bad value ``[...]``: name its key instead (the first whose removal ends this
    refusal), so ``host[...]`` reads ``host.driver_version``."""
    m = re.match(r"field `([^`]*)`", text)
    if m is None or "[...]" not in m.group(1):
        return text
    path = m.group(1)
    head = path[:path.index("[...]")]
    container: Any = obj
    for name, index in ((g[0], g[1]) for g in _SEGMENT.findall("." + head)):
        try:
            container = container[int(index)] if index else container[name]
        except (KeyError, IndexError, TypeError, ValueError):
            return text
    if not isinstance(container, dict):
        return text
    items = list(container.items())
    for key, _ in items:
        del container[key]
        try:
            msgspec.convert(obj, kind, strict=True)
            fixed = True
        except msgspec.ValidationError as exc:
            fixed = describe(exc) != text
        finally:  # restored in place, in its order: the caller's object is left as it was
            container.clear()
            container.update(items)
        if fixed:
            return text.replace(f"`{path}`", f"`{head}.{key}{path[len(head) + 5:]}`", 1)
    return text


def to_builtins(doc: Document) -> dict[str, Any]:
    """The plain JSON-able form of a declared document (what its writer serialises)."""
    out = msgspec.to_builtins(doc)
    assert isinstance(out, dict)
    return out


def check_summaries(recorded: Any, recomputed: dict[str, Any], *, where: str | Path, what: str) -> None:
    """Refuse (:class:`IntegrityError`) a document's summary block ``what`` unless it holds exactly the values
    recomputed from the payload it summarises (every differing field named, recorded and recomputed)."""
    if not isinstance(recorded, dict):
        raise IntegrityError(f"field `{what}` must be an object summarising the payload", where=where)
    keys = sorted(set(recorded) | set(recomputed))
    bad = [f"{what}.{k} is {recorded.get(k)!r}, the payload gives {recomputed.get(k)!r}" for k in keys
           if k not in recorded or k not in recomputed or type(recorded[k]) is not type(recomputed[k])
           or recorded[k] != recomputed[k]]
    if bad:
        raise IntegrityError("the manifest's summary of its payload is not the payload's: " + "; ".join(bad),
                             where=where, hint="a summary is recomputed from what it summarises; capture the step "
                                               "again rather than editing its manifest")


def agree(field: str, recorded: Any, recomputed: Any) -> None:
    """Refuse a summary ``field`` whose recorded value is not the one recomputed from what it summarises."""
    if recorded != recomputed:
        raise ValueError(f"`{field}` is {recorded!r}, but what it summarises gives {recomputed!r}")
