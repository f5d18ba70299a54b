"""TOML text of a resolved config, which :func:`replayjob.config.load_config` reads back unchanged.

Used to write ready-to-run configs (a captured step's ``replay_step_<K>.toml``).  Only what the
config tree holds is supported: tables, strings, booleans, integers, finite floats, lists of
scalars; ``None`` (an unset optional) is left out, which the loader reads as the default ``None``.
Strings are written as TOML basic strings with JSON escapes (a subset of TOML's).

Example:
    >>> print(dumps({"training": {"trainer": "grpo", "seed": None}, "lora": {"target_modules": ["q_proj"]}}))
    [training]
    trainer = "grpo"
    <BLANKLINE>
    [lora]
    target_modules = ["q_proj"]
    <BLANKLINE>
"""

from __future__ import annotations

import json
import math
from typing import Any


def value(v: Any, where: str) -> str:
    """One TOML value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{where}: a config float must be finite, found {v!r}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(value(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
    raise ValueError(f"{where}: {type(v).__name__} cannot be written as a config value")


def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) and k.isascii() else json.dumps(k)


def dumps(doc: dict[str, Any]) -> str:
    """``doc`` (sections of scalars and nested tables) as TOML; tables follow their scalars."""
    out: list[str] = []

    def table(node: dict[str, Any], path: list[str]) -> None:
        scalars = [(k, v) for k, v in node.items() if not isinstance(v, dict) and v is not None]
        tables = [(k, v) for k, v in node.items() if isinstance(v, dict)]
        if path and (scalars or not tables):
            out.append("[" + ".".join(_key(p) for p in path) + "]")
        for k, v in scalars:
            out.append(f"{_key(k)} = {value(v, '.'.join([*path, k]))}")
        if path and (scalars or not tables):
            out.append("")
        for k, v in tables:
            table(v, [*path, k])

    table(doc, [])
    return "\n".join(out)
