"""Behavioural signal rules: a declarative TOML file, loaded strictly (docs/signals.md).

Each ``[[signal]]`` reduces one numeric leaf of the per-step diagnostics to a number and grades it
against KILL and WARN thresholds; each ``[[consistency]]`` compares a leaf's last value with a
field of a summary JSON written next to the diagnostics.  Unknown keys, unknown reducers, missing
thresholds and duplicate names are refused with the rule's position, so a typo never silently
disables a check.

Example:
    >>> rules = load_rules(None)  # the rules shipped for the source trainer
    >>> sorted(r.reducer for r in rules.signals)[:2]
    ['cv', 'last']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from replayjob.check.leaves import parse_path
from replayjob.config.load import read_toml, read_toml_text
from replayjob.declaration import OneLine
from replayjob.errors import ConfigError, UsageError

SCHEMA = "replayjob.signals/1"

REDUCERS: dict[str, int] = {"last": 1, "mean": 1, "min": 1, "max": 1, "cv": 2, "slope": 3, "pearson": 3}
"""Reducer name -> the fewest values it needs (pairs for ``pearson``)."""
RANGES: dict[str, tuple[float, float]] = {"cv": (0.0, math.inf), "pearson": (-1.0, 1.0)}
"""Reducer name -> the closed range of its finite values, where it has one: a threshold outside it either never
fires or always does."""
STATUSES = ("KILL", "WARN")
DEFAULT_RULES = "default_signals.toml"

_SIGNAL_KEYS = {"name", "leaf", "reducer", "window", "delta_of", "kill_below", "kill_above", "warn_below",
                "warn_above", "min_rows", "on_nonfinite", "meaning"}
_CONSISTENCY_KEYS = {"name", "leaf", "summary", "field", "warn_above", "kill_above", "floor", "optional",
                     "meaning"}


@dataclass(frozen=True)
class Thresholds:
    kill_below: float | None = None
    kill_above: float | None = None
    warn_below: float | None = None
    warn_above: float | None = None

    def grade(self, value: float) -> tuple[str, str]:
        """``(status, reason)`` for a finite value: the first breached bound, KILL before WARN."""
        for status in STATUSES:
            lo = getattr(self, f"{status.lower()}_below")
            hi = getattr(self, f"{status.lower()}_above")
            if lo is not None and value < lo:
                return status, f"< {status.lower()}_below {lo:g}"
            if hi is not None and value > hi:
                return status, f"> {status.lower()}_above {hi:g}"
        return "OK", "within bounds"


@dataclass(frozen=True)
class SignalRule:
    name: str
    leaf: str
    reducer: str
    thresholds: Thresholds
    meaning: str
    window: int = 0
    delta_of: str | None = None
    min_rows: int = 1
    on_nonfinite: str = "KILL"


@dataclass(frozen=True)
class ConsistencyRule:
    name: str
    leaf: str
    summary: str
    field: str
    thresholds: Thresholds
    meaning: str
    floor: float = 1e-12
    optional: bool = False


@dataclass(frozen=True)
class Rules:
    source: str
    signals: tuple[SignalRule, ...]
    consistency: tuple[ConsistencyRule, ...]


def _num(rule: dict[str, Any], key: str, where: str) -> float | None:
    v = rule.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{key} must be a number, got {v!r}", where=where)
    if not math.isfinite(v):  # nothing compares with NaN, and an infinite bound or floor bounds nothing
        raise ConfigError(f"{key} must be a finite number, got {v!r}", where=where,
                          hint="TOML's nan and inf are no thresholds; leave the key out for no bound")
    return float(v)


def _one_line(v: str) -> bool:
    """``v`` is one line of printable characters, as the declarations read it (:data:`OneLine`): no control, line
    break or bidi control."""
    try:
        msgspec.convert(v, OneLine)
    except msgspec.ValidationError:
        return False
    return True


def _str(rule: dict[str, Any], key: str, where: str, required: bool = True) -> str:
    v = rule.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or (required and not v.strip()):
        raise ConfigError(f"{key} must be a non-empty string", where=where)
    if not _one_line(v):  # a newline would print a line of its own, a bidi control reorder the table's text
        raise ConfigError(f"{key} {v!r} holds a control character (a newline, tab, escape or bidi control)",
                          where=where,
                          hint="write it on one line of printable characters: the verdict table prints it as is")
    return v


def _summary(rule: dict[str, Any], where: str) -> str:
    """The summary file, a path relative to the run directory that stays inside it."""
    v = _str(rule, "summary", where)
    parts = v.split("/")
    if v.startswith("/") or "\\" in v or any(part in ("", ".", "..") for part in parts):
        raise ConfigError(f"summary {v!r} must be a file's path relative to the run directory (no leading '/', "
                          "'.', '..', empty component or backslash)", where=where,
                          hint="name the summary the run wrote beside its diagnostics, e.g. summary = "
                               "\"metrics.json\"")
    return v


def _path(rule: dict[str, Any], key: str, where: str) -> str:
    v = _str(rule, key, where)
    try:
        parse_path(v)
    except UsageError as exc:
        raise ConfigError(exc.message, where=f"{where}.{key}", hint=exc.hint) from None
    return v


def _thresholds(rule: dict[str, Any], where: str, keys: tuple[str, ...], reducer: str | None = None,
                value_range: tuple[float, float] | None = None) -> Thresholds:
    """The rule's thresholds, refused where they contradict one another: a lower bound above an upper one (no value
    is within them, so every run is graded KILL or WARN), a WARN bound beyond its KILL bound (a value past it is
    graded KILL first, so the WARN bound never applies), or a bound outside ``value_range``, the values the rule's
    reducer (or gap) can take (it never fires, or always does)."""
    vals = {k: _num(rule, k, where) for k in keys}
    if all(v is None for v in vals.values()):
        raise ConfigError("a rule needs at least one threshold: " + ", ".join(keys), where=where)
    for status in ("kill", "warn"):
        lo, hi = vals.get(f"{status}_below"), vals.get(f"{status}_above")
        if lo is not None and hi is not None and lo > hi:  # every value is below lo or above hi
            raise ConfigError(f"{status}_below {lo!r} is above {status}_above {hi!r}: no value is within the "
                              f"{status.upper()} bounds, so the rule grades every run {status.upper()}", where=where,
                              hint=f"{status}_below is the lower bound and {status}_above the upper one; swap them")
    for lo_key, hi_key in (("kill_below", "warn_above"), ("warn_below", "kill_above")):
        lo, hi = vals.get(lo_key), vals.get(hi_key)
        if lo is not None and hi is not None and lo > hi:  # every value is below one bound or above the other
            raise ConfigError(f"{lo_key} {lo!r} is above {hi_key} {hi!r}: no value is within both bounds, so the "
                              "rule never grades a run OK", where=where,
                              hint="the *_below keys are lower bounds and the *_above keys upper ones")
    for side, beyond in (("above", float.__gt__), ("below", float.__lt__)):
        warn, kill = vals.get(f"warn_{side}"), vals.get(f"kill_{side}")
        if warn is not None and kill is not None and beyond(warn, kill):
            raise ConfigError(f"warn_{side} {warn!r} is {side} kill_{side} {kill!r}: a value past it is graded KILL "
                              f"first, so the WARN bound never applies", where=where,
                              hint=f"a warning comes before the kill: put warn_{side} between the OK values and "
                                   f"kill_{side}")
    if value_range is not None:
        least, most = value_range
        for key, v in vals.items():
            if v is not None and not least <= v <= most:
                what = f"reducer {reducer}" if reducer else "the relative gap"
                raise ConfigError(f"{key} {v!r} is outside [{least:g}, {most:g}], the values {what} takes: the "
                                  "bound never fires, or always does", where=where,
                                  hint=f"give a threshold within [{least:g}, {most:g}]")
    return Thresholds(**vals)


def _check_keys(rule: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(rule, dict):
        raise ConfigError("expected a table", where=where)
    unknown = sorted(set(rule) - allowed)
    if unknown:
        raise ConfigError(f"unknown key(s): {', '.join(unknown)}", where=where,
                          hint="allowed: " + ", ".join(sorted(allowed)))
    return rule


def _signal(raw: Any, where: str) -> SignalRule:
    rule = _check_keys(raw, _SIGNAL_KEYS, where)
    reducer = _str(rule, "reducer", where)
    if reducer not in REDUCERS:
        raise ConfigError(f"unknown reducer {reducer!r}", where=where, hint="use one of: " + ", ".join(REDUCERS))
    window = rule.get("window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ConfigError(f"window must be a non-negative integer (0 = all rows), got {window!r}", where=where)
    least = REDUCERS[reducer]
    min_rows = rule.get("min_rows", least)
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < least:
        raise ConfigError(f"min_rows must be an integer >= {least} for reducer {reducer}, got {min_rows!r}",
                          where=where)
    if window and window < min_rows:
        raise ConfigError(f"window {window} is smaller than min_rows {min_rows}: the rule could never be graded",
                          where=where)
    delta_of = _path(rule, "delta_of", where) if "delta_of" in rule else None
    if (reducer == "pearson") != (delta_of is not None):
        raise ConfigError("delta_of is required by reducer pearson and only by it", where=where)
    on_nonfinite = rule.get("on_nonfinite", "KILL")
    if on_nonfinite not in STATUSES:
        raise ConfigError(f"on_nonfinite must be KILL or WARN, got {on_nonfinite!r}", where=where)
    return SignalRule(name=_str(rule, "name", where), leaf=_path(rule, "leaf", where), reducer=reducer,
                      thresholds=_thresholds(rule, where, ("kill_below", "kill_above", "warn_below", "warn_above"),
                                             reducer, RANGES.get(reducer)),
                      meaning=_str(rule, "meaning", where, required=False), window=window,
                      delta_of=delta_of, min_rows=min_rows, on_nonfinite=on_nonfinite)


def _consistency(raw: Any, where: str) -> ConsistencyRule:
    rule = _check_keys(raw, _CONSISTENCY_KEYS, where)
    floor = _num(rule, "floor", where)
    if floor is not None and floor < 0:
        raise ConfigError("floor must be >= 0", where=where)
    optional = rule.get("optional", False)
    if not isinstance(optional, bool):
        raise ConfigError("optional must be true or false", where=where)
    for key in ("warn_above", "kill_above"):
        v = _num(rule, key, where)
        if v is not None and v < 0:
            raise ConfigError(f"{key} is a relative gap and must be >= 0", where=where)
    return ConsistencyRule(name=_str(rule, "name", where), leaf=_path(rule, "leaf", where),
                           summary=_summary(rule, where), field=_path(rule, "field", where),
                           thresholds=_thresholds(rule, where, ("warn_above", "kill_above")),
                           meaning=_str(rule, "meaning", where, required=False),
                           floor=1e-12 if floor is None else floor, optional=optional)


def parse_rules(text: str, source: str) -> Rules:
    """Parse and validate rules TOML text; ``source`` names it in errors."""
    return rules_from_doc(read_toml_text(text, source, what="rules file"), source)


def rules_from_doc(doc: dict[str, Any], source: str) -> Rules:
    """Validate parsed rules; ``source`` names them in errors."""
    _check_keys(doc, {"schema", "signal", "consistency"}, source)
    if doc.get("schema", SCHEMA) != SCHEMA:
        raise ConfigError(f"schema {doc.get('schema')!r} is not {SCHEMA!r}", where=source)
    sig_raw, con_raw = doc.get("signal", []), doc.get("consistency", [])
    if not isinstance(sig_raw, list) or not isinstance(con_raw, list):
        raise ConfigError("signal and consistency must be arrays of tables ([[signal]])", where=source)
    signals = tuple(_signal(r, f"{source}: signal #{i + 1}") for i, r in enumerate(sig_raw))
    consistency = tuple(_consistency(r, f"{source}: consistency #{i + 1}") for i, r in enumerate(con_raw))
    names = [r.name for r in signals] + [r.name for r in consistency]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"duplicate rule name(s): {', '.join(dupes)}", where=source)
    if not names:
        raise ConfigError("the rules file defines no [[signal]] or [[consistency]] rule", where=source)
    return Rules(source=source, signals=signals, consistency=consistency)


def load_rules(path: str | Path | None) -> Rules:
    """Load a rules file, or the rules shipped for the source trainer when ``path`` is None."""
    if path is None:
        text = resources.files("replayjob").joinpath("data", DEFAULT_RULES).read_text(encoding="utf-8")
        return parse_rules(text, f"(default) {DEFAULT_RULES}")
    return rules_from_doc(read_toml(path, what="rules file"), str(path))  # regular files only
