"""Leaf paths of nested diagnostics rows, and the ignore patterns that select some of them.

A leaf is every value that is not a non-empty object or array.  Its path joins object keys with
``.`` and array positions with ``[i]``: ``{"units": {"trail": [0.5, 0.7]}}`` has the leaves
``units.trail[0]`` and ``units.trail[1]``.  Empty objects and arrays are leaves themselves, so a
container that empties out is still seen.  A key that is empty or contains ``.``, ``[`` or ``]``
(or a character that is not printable: a newline, an escape) is written quoted in brackets, as JSON
writes the string: ``{"loss.policy": 1, "loss": {"policy":
2}}`` has the leaves ``["loss.policy"]`` and ``loss.policy``.  So two different leaves never have
the same path, and a value can never hide another.  Such keys cannot be addressed by a
:func:`parse_path` path (a signals rule's leaf) and are best avoided in diagnostics.

Ignore patterns are globs where only ``*`` (any run of characters, dots included) and ``?`` (one
character) are wildcards; ``[`` and ``]`` are literal, so ``units.trail[3]`` names one leaf.  A
pattern matches a leaf when it matches the full path, the last key, or the last key without its
array positions: ``elapsed_s`` matches ``timing.elapsed_s`` and ``*_wall_s`` matches
``timing.sample_wall_s`` and ``phase_wall_s[2]``.  Patterns are matched against the path with
every key written bare (``timing.elapsed_s`` for the key ``"timing.elapsed_s"`` too), so a
pattern selects a quoted key as it would the same name nested.

Example:
    >>> flatten({"a": {"b": [1, 2.5]}, "c": {}, "d.e": 3})
    {'a.b[0]': 1, 'a.b[1]': 2.5, 'c': {}, '["d.e"]': 3}
    >>> parse_path("units.trail[3]")
    ('units', 'trail', 3)
    >>> IgnoreSet(DEFAULT_IGNORES).matches("timing.sample_wall_s")
    True
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from replayjob.errors import UsageError

# Leaves that differ between identical runs: wall-clock times, rates and memory peaks.
DEFAULT_IGNORES: tuple[str, ...] = (
    "elapsed_s", "*_elapsed_s", "wall_s", "*_wall_s", "*wall_time*", "sps", "*_sps",
    "*per_sec*", "*per_second*", "*timestamp*", "*_time_ns", "*datetime*",
    "*peak_rss*", "*max_rss*", "*max_allocated*", "*max_reserved*",
)

MISSING: Any = object()
"""Returned by :func:`get_leaf` when a row has no such leaf."""

_INDEX_TAIL = re.compile(r"(\[[0-9]+\])+\Z")  # ASCII digits: "a[٣]" is no alias of "a[3]"
_PART = re.compile(r"([^.\[\]]*)((?:\[[0-9]+\])*)")


Location = tuple[tuple[str | int, ...], str | int]
"""Where an ignored leaf sits: the steps to its parent, then its own key or index."""


def flatten(row: Any, ignore: IgnoreSet | None = None, ignored: set[Location] | None = None) -> dict[str, Any]:
    """All leaves of ``row`` as ``{path: value}``, in document order; distinct leaves have distinct
    paths (keys that could be read as path syntax are quoted), so no value overwrites another.

    With ``ignore``, a leaf it matches is left out and its location is added to ``ignored``.
    """
    out: dict[str, Any] = {}
    _walk(row, "", None, (), ignore, out, set() if ignored is None else ignored)
    return out


def _plain(key: str) -> bool:
    """Whether ``key`` can stand bare in a path: not empty, no ``.``, ``[`` or ``]``, every character printable
    (a newline or an escape in a key printed as is would forge a line of the report)."""
    return bool(key) and "." not in key and "[" not in key and "]" not in key and key.isprintable()


def key_path(path: str, key: str) -> str:
    """``path`` extended by the object key ``key``: ``path.key``, or ``path["key"]`` for a key that is
    empty or holds ``.``, ``[``, ``]`` or a character that is not printable (JSON string syntax, so the quoted
    form is unambiguous; a key holding an unprintable character is written in ASCII, every such character
    escaped)."""
    if _plain(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key, ensure_ascii=not key.isprintable())}]"


def _walk(node: Any, path: str, name: str | None, steps: tuple[str | int, ...], ignore: IgnoreSet | None,
          out: dict[str, Any], ignored: set[Location]) -> None:
    # path: the unambiguous leaf path (the key of ``out``); name: the same with every key written bare,
    # which the ignore patterns match, or None while it equals path (no key on the way was quoted)
    if isinstance(node, dict) and node:
        for key, value in node.items():
            if name is None and key and "." not in key and "[" not in key and "]" not in key and key.isprintable():
                # _plain, inline
                _walk(value, f"{path}.{key}" if path else key, None, (*steps, key), ignore, out, ignored)
            else:
                bare = path if name is None else name
                _walk(value, key_path(path, key), f"{bare}.{key}" if bare else key, (*steps, key), ignore,
                      out, ignored)
    elif isinstance(node, list) and node:
        for i, value in enumerate(node):
            _walk(value, f"{path}[{i}]", None if name is None else f"{name}[{i}]", (*steps, i), ignore, out,
                  ignored)
    elif ignore is not None and steps and ignore.matches(path if name is None else name):
        ignored.add((steps[:-1], steps[-1]))
    else:
        if path in out:  # unreachable: the paths are unambiguous; never let a value hide another
            raise AssertionError(f"two leaves share the path {path!r}")
        out[path] = node


def parse_path(path: str) -> tuple[str | int, ...]:
    """``a.b[3].c`` -> ``("a", "b", 3, "c")``; a malformed path is a usage error."""
    steps: list[str | int] = []
    if not path:
        raise UsageError("empty leaf path")
    for part in path.split("."):
        m = _PART.fullmatch(part)
        if m is None or not m.group(1):
            raise UsageError(f"leaf path {path!r} is malformed at {part!r}",
                             hint="write keys joined by '.' and array positions as [i], e.g. a.b[3]")
        steps.append(m.group(1))
        steps.extend(int(i) for i in re.findall(r"\[([0-9]+)\]", m.group(2)))
    return tuple(steps)


def get_leaf(row: Any, steps: tuple[str | int, ...]) -> Any:
    """The value at ``steps`` in ``row``, or :data:`MISSING`."""
    node = row
    for step in steps:
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                return MISSING
        elif not isinstance(node, dict) or step not in node:
            return MISSING
        node = node[step]
    return node


def _glob_regex(pattern: str) -> str:
    return "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)


class IgnoreSet:
    """A set of ignore patterns compiled into one regular expression."""

    def __init__(self, patterns: Iterable[str]):
        self.patterns: tuple[str, ...] = tuple(patterns)
        for p in self.patterns:
            if not p.strip():
                raise UsageError("an --ignore pattern is empty", hint="give a glob such as '*_wall_s'")
        body = "|".join(f"(?:{_glob_regex(p)})" for p in self.patterns)
        self._regex = re.compile(body) if body else None
        self._cache: dict[str, bool] = {}

    def matches(self, path: str) -> bool:
        """Whether the leaf at ``path`` is ignored (memoised: diagnostics repeat their paths)."""
        hit = self._cache.get(path)
        if hit is None:
            hit = self._match(path)
            if len(self._cache) < 1_000_000:
                self._cache[path] = hit
        return hit

    def _match(self, path: str) -> bool:
        if self._regex is None:
            return False
        last = path.rsplit(".", 1)[-1]
        candidates = (path, last, _INDEX_TAIL.sub("", last))
        return any(self._regex.fullmatch(c) for c in candidates)
