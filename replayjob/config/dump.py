"""TOML text of a resolved config, which :func:`replayjob.config.load_config` reads back unchanged.

The one TOML writer: every config, spec and ``--set KEY=VALUE`` replayjob writes goes through
:func:`toml_value` (one value), :func:`toml_key` (one key) or :func:`dumps` (a document: a captured
step's ``replay_step_<K>.toml``).  Supported: tables, strings, booleans, 64-bit integers, finite
floats, lists and inline tables of those; ``None`` (an unset optional) is left out of a table,
which the loader reads as the default ``None``.  Strings are TOML basic strings: ``"``, ``\\`` and
every control character escaped, other characters written as they are (UTF-8), so any path that is
valid Unicode reads back unchanged.  A non-finite float (TOML's ``nan``/``inf``, which no replayjob
setting accepts) and a string holding a lone surrogate (a file name that is not valid UTF-8) are
refused with :class:`~replayjob.errors.ConfigError` rather than written.

Example:
    >>> print(dumps({"training": {"trainer": "grpo", "seed": None}, "lora": {"target_modules": ["q_proj"]}}))
    [training]
    trainer = "grpo"
    <BLANKLINE>
    [lora]
    target_modules = ["q_proj"]
    <BLANKLINE>
    >>> print(toml_value('say "hi"'), toml_value({"x.y": [1, 2.5, True]}))
    "say \\"hi\\"" {"x.y" = [1, 2.5, true]}
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from replayjob.errors import ConfigError

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_string(s: str, where: str = "value") -> str:
    """``s`` as a TOML basic string (every escape TOML requires)."""
    if any("\ud800" <= c <= "\udfff" for c in s):
        raise ConfigError("a string holding a lone surrogate (bytes that are not UTF-8) cannot be written as TOML",
                          where=where, hint="rename the file or directory to a valid UTF-8 name")
    return '"' + _NEEDS_ESCAPE.sub(lambda m: _ESCAPES.get(m.group(), f"\\u{ord(m.group()):04x}"), s) + '"'


def toml_key(k: str, where: str = "key") -> str:
    """A key: bare when TOML allows it, else quoted (so ``"a.b"`` stays one key, not a dotted path)."""
    return k if _BARE_KEY.fullmatch(k) else toml_string(k, where)


def toml_value(v: Any, where: str = "value") -> str:
    """One TOML value, as a config line or ``--set KEY=VALUE`` (:func:`replayjob.config.load.parse_override`)
    reads it back: str, bool, int, finite float, list, dict (an inline table)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        if not -(2**63) <= v < 2**63:
            raise ConfigError(f"{v} is outside TOML's signed 64-bit integers", where=where)
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"a float written to a config must be finite, found {v!r}", where=where)
        return repr(v)
    if isinstance(v, str):
        return toml_string(v, where)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(str(k), where)} = {toml_value(x, f'{where}.{k}')}"
                               for k, x in v.items()) + "}"
    raise ConfigError(f"{type(v).__name__} cannot be written as a TOML value", where=where)



def dumps(doc: dict[str, Any]) -> str:
    """``doc`` (sections of scalars and nested tables) as TOML; tables follow their scalars."""
    out: list[str] = []

    def table(node: dict[str, Any], path: list[str]) -> None:
        scalars = [(k, v) for k, v in node.items() if not isinstance(v, dict) and v is not None]
        tables = [(k, v) for k, v in node.items() if isinstance(v, dict)]
        if path and (scalars or not tables):
            out.append("[" + ".".join(toml_key(p) for p in path) + "]")
        for k, v in scalars:
            out.append(f"{toml_key(k)} = {toml_value(v, '.'.join([*path, k]))}")
        if path and (scalars or not tables):
            out.append("")
        for k, v in tables:
            table(v, [*path, k])

    table(doc, [])
    return "\n".join(out)


def replay_pins(replay_path: str | Path, logical_sha256: str, manifest_sha256: str) -> dict[str, str]:
    """The one place a replay config's pins are written: ``[optimizer_batch]``'s ``replay_path`` (the capture
    manifest), ``expected_logical_sha256`` and ``expected_manifest_sha256``, keyed by their dotted paths.
    Every writer (a capture's replay config, the ``--set`` overrides of the cluster steps) takes them from here."""
    return {"optimizer_batch.replay_path": str(replay_path),
            "optimizer_batch.expected_logical_sha256": logical_sha256,
            "optimizer_batch.expected_manifest_sha256": manifest_sha256}


def set_args(values: dict[str, Any]) -> list[str]:
    """``--set KEY=VALUE`` arguments for dotted keys and values, each value written by :func:`toml_value`."""
    return [f"{k}={toml_value(v, k)}" for k, v in values.items()]


def section(values: dict[str, Any], name: str) -> dict[str, Any]:
    """The keys of ``values`` under the section ``name`` (``"optimizer_batch.x"`` -> ``"x"``)."""
    prefix = name + "."
    return {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
