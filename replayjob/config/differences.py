"""Differences between two resolved configs, as sorted dotted keys.

Example:
    >>> differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}})
    ['a.c']
"""

from __future__ import annotations

from typing import Any


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def differences(a: dict[str, Any], b: dict[str, Any], *, ignore: frozenset[str] = frozenset()) -> list[str]:
    fa, fb = flatten(a), flatten(b)
    keys = set(fa) | set(fb)
    return sorted(k for k in keys
                  if k not in ignore and not any(k.startswith(i + ".") for i in ignore)
                  and (k not in fa or k not in fb or fa[k] != fb[k] or type(fa[k]) is not type(fb[k])))
