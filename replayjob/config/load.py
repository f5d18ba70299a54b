"""Load a config: TOML file, then ``--set`` overrides, then strict typing into :class:`Config`.

Example:
    >>> cfg = load_config(None, ["training.seed=7", "lora.target_modules=['q_proj']"])
    >>> cfg.training.seed, cfg.lora.target_modules
    (7, ['q_proj'])
"""

from __future__ import annotations

import dataclasses
import tomllib  # the one TOML parser: every module reads TOML through the functions below
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from replayjob.config.schema import TOML_NAMES, Config
from replayjob.errors import ConfigError, ReplayjobError
from replayjob.fsio import read_regular_bytes
from replayjob.redact import REDACTED, is_secret_key, redact_text

MAX_TOML_BYTES = 16 * 1024 * 1024
MAX_TOML_DEPTH = 64  # tables and arrays within each other (no replayjob input is more than a few deep; JSON's limit)


def read_toml_file_bytes(path: str | Path, *, what: str = "config file", max_bytes: int = MAX_TOML_BYTES,
                         error: type[ReplayjobError] = ConfigError) -> bytes:
    """The bytes of a TOML file, unparsed: a regular file of at most ``max_bytes`` (devices and FIFOs
    refused without blocking; a symbolic link followed, the file being user-named).

    A pinned file (budgets, tolerances, a mismatch bound) is hashed over exactly these bytes, and the
    pin checked, before :func:`read_toml_bytes` parses them.
    """

    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise error(f"{what} not found", where=p, hint="check the path")
    try:
        return read_regular_bytes(p, max_bytes=max_bytes, follow_symlinks=True, what=what)
    except ReplayjobError as exc:
        raise error(exc.message, where=p, hint=exc.hint) from None
    except OSError as exc:
        raise error(f"cannot read {what}: {exc.strerror}", where=p) from None


def read_toml_text(text: str, where: str | Path, *, what: str = "config file",
                   error: type[ReplayjobError] = ConfigError) -> dict[str, Any]:
    """Parse TOML text or refuse naming ``where`` and the line: a key or table defined twice, a
    syntax error, nesting past the parser's limit."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        twice = "overwrite" in str(exc) or "twice" in str(exc)
        raise error(f"invalid TOML in {what}: {exc}", where=where,
                    hint="a key or table is defined twice; keep one" if twice else None) from None
    except RecursionError:  # the parser's nesting limit
        raise error(f"invalid TOML in {what}: nested too deeply to parse", where=where) from None
    deep = _deeper_than(doc, MAX_TOML_DEPTH)
    if deep is not None:  # dotted keys nest without the parser's limit; every later walk of the tables recursed
        shown = deep if len(deep) <= 80 else deep[:77] + "..."
        raise error(f"invalid TOML in {what}: the value at {shown} is nested more than {MAX_TOML_DEPTH} tables or "
                    "arrays deep", where=where)
    wide = _wide_integer(doc, "")
    if wide is not None:  # TOML integers are signed 64-bit; Python's parser reads any size
        raise error(f"invalid TOML in {what}: the integer at {wide} is outside the signed 64-bit range",
                    where=where)
    return doc


def _deeper_than(value: Any, limit: int) -> str | None:
    """The dotted path of the first table or array in ``value`` nested more than ``limit`` deep, or None (a walk
    with its own stack)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, at, depth = stack.pop()
        if isinstance(v, dict | list) and depth > limit:
            return at
        if isinstance(v, dict):
            stack.extend((x, f"{at}.{k}" if at else str(k), depth + 1) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]", depth + 1) for i, x in enumerate(v))
    return None


def _wide_integer(value: Any, path: str) -> str | None:
    """The dotted path of the first integer in ``value`` outside the signed 64-bit range, or None (a walk with
    its own stack: a table nested as deeply as the parser allows is no recursion limit here)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, f"{at}.{k}" if at else str(k)) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in reversed(list(enumerate(v))))
        elif type(v) is int and not -(2**63) <= v < 2**63:
            return at or "<top>"
    return None


def read_toml_bytes(data: bytes, where: str | Path, *, what: str = "config file", max_bytes: int = MAX_TOML_BYTES,
                    error: type[ReplayjobError] = ConfigError) -> dict[str, Any]:
    """Parse TOML bytes already read (and, for a pinned file, already checked against its pin)."""
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data)} bytes, above the {max_bytes}-byte limit", where=where)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{what} is not valid UTF-8 (at line {line})", where=where) from None
    return read_toml_text(text, where, what=what, error=error)


def read_toml(path: str | Path, *, what: str = "config file", max_bytes: int = MAX_TOML_BYTES,
              error: type[ReplayjobError] = ConfigError) -> dict[str, Any]:
    """Read any TOML input (configs, ablation specs, rules) or refuse naming the file and the cause:
    :func:`read_toml_file_bytes`, then :func:`read_toml_bytes`."""
    data = read_toml_file_bytes(path, what=what, max_bytes=max_bytes, error=error)
    return read_toml_bytes(data, Path(path), what=what, max_bytes=max_bytes, error=error)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], typed value); the value is read as TOML, else as a string.

    The one parser of ``--set KEY=VALUE`` (what :func:`replayjob.config.dump.toml_value` writes).
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {key!r} is not KEY=VALUE", where="--set",
                          hint="for example --set training.seed=7")
    try:
        doc = tomllib.loads(f"v = {raw}")
        value = doc["v"] if set(doc) == {"v"} else raw  # a value, not a value followed by more TOML
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError as exc:
        raise ConfigError(f"override value is nested too deeply ({exc})", where=key) from None
    return key.split("."), value


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``--set`` items as ``{"a.b": typed value}``, in order (a later item wins)."""
    return {".".join(parts): value for parts, value in map(parse_override, items)}


# Keys holding filesystem paths: relative values are resolved against the config file's
# directory (or the working directory for --set), so a config works from any cwd.
PATH_KEYS = (("resume", "from"), ("model", "path"), ("optimizer_batch", "replay_path"))


def absolutize_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Resolve the relative paths under :data:`PATH_KEYS` of a config read from a file against ``base``
    (the file's directory), in place; returns ``data``."""
    for section, key in PATH_KEYS:
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key]:
            p = Path(node[key]).expanduser()
            node[key] = str(p if p.is_absolute() else (base / p).resolve())
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = _deepcopy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError("is a value, not a table", where=".".join(parts[: i + 1]))
            node = nxt
        if tuple(parts) in PATH_KEYS and isinstance(value, str) and value:
            value = str(Path(value).expanduser().resolve())
        node[parts[-1]] = value
    return out


def _deepcopy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, dict):
        return str(tp).replace("typing.", "")
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _shown(value: Any, where: str) -> str:
    """A value as error messages may quote it: never under a secret-shaped key, never long."""
    if any(is_secret_key(part) for part in where.split(".")):
        return REDACTED
    text = redact_text(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{_shown(value, where)} is not allowed; allowed values: "
                              + ", ".join(repr(a) for a in get_args(tp)), where=where)
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        concrete = [a for a in args if a is not type(None)]
        if len(concrete) == 1:
            return _coerce(value, concrete[0], where)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"expected {_type_name(tp)}, found {type(value).__name__} {_shown(value, where)}",
                          where=where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, found {type(value).__name__}", where=where)
        return build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"expected a list, found {type(value).__name__} {_shown(value, where)}", where=where)
        (item_tp,) = get_args(tp)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, found {type(value).__name__}", where=where)
        _, val_tp = get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, found {_shown(value, where)}", where=where)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, found {type(value).__name__} {_shown(value, where)}", where=where)
        if not -(2**63) <= value < 2**63:  # TOML integers are 64-bit; the parser does not enforce it
            raise ConfigError("integer is outside the signed 64-bit range", where=where)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"expected a number, found {type(value).__name__} {_shown(value, where)}", where=where)
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError("must be finite", where=where)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, found {type(value).__name__} {_shown(value, where)}", where=where)
        return value
    raise ConfigError(f"unsupported field type {tp!r}", where=where)  # pragma: no cover


def build(cls: Any, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, refusing unknown keys with their dotted path."""
    hints = typing.get_type_hints(cls)
    fields = {TOML_NAMES.get(f.name, f.name): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        path = f"{where}.{unknown[0]}" if where else unknown[0]
        allowed = ", ".join(sorted(fields))
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} "
                          + ", ".join(repr(u) for u in unknown),
                          where=path, hint=f"allowed keys here: {allowed}")
    kwargs = {}
    for toml_name, f in fields.items():
        if toml_name in data:
            sub = f"{where}.{toml_name}" if where else toml_name
            kwargs[f.name] = _coerce(data[toml_name], hints[f.name], sub)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if where and exc.where and not exc.where.startswith(where.split(".")[0]):
            exc.where = f"{where}.{exc.where}"
        raise


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """TOML file (or defaults when ``path`` is None) + overrides -> validated :class:`Config`.

    Relative paths in the file resolve against the file's directory; in ``--set``, against the
    working directory.
    """
    data = absolutize_paths(read_toml(path), Path(path).resolve().parent) if path is not None else {}
    try:
        data = apply_overrides(data, list(overrides or []))
        cfg: Config = build(Config, data)
    except RecursionError:
        raise ConfigError("config tables are nested too deeply", where=path or "--set",
                          hint="no replayjob setting is more than three tables deep") from None
    return cfg


def to_dict(obj: Any) -> dict[str, Any]:
    """The resolved config as plain data, TOML key names, every default filled in."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = TOML_NAMES.get(f.name, f.name)
        if dataclasses.is_dataclass(value):
            out[name] = to_dict(value)
        elif isinstance(value, list):
            out[name] = list(value)
        elif isinstance(value, dict):
            out[name] = dict(value)
        else:
            out[name] = value
    return out


def from_dict(data: dict[str, Any]) -> Config:
    """Inverse of :func:`to_dict` (used to read a config recorded in a manifest)."""
    cfg: Config = build(Config, data)
    return cfg
