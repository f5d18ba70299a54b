"""What every command shares: integer options, ``--json`` and report printing, the diff options."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

from replayjob.artifacts.metrics import CAPTURE_PREFIXES
from replayjob.check.leafdiff import Tolerance
from replayjob.errors import UsageError
from replayjob.jsonio import pretty_bytes

T = TypeVar("T")

INT64_MAX = 2**63 - 1
_DECIMAL = re.compile(r"-?[0-9]{1,20}")
# A plain decimal number: float() would also take "1_0" (ten), " 1", "nan", "inf" and "٣".
_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?")
# Every integer option of every command, with the closed range it accepts: checked when the option is
# read, whatever other options are given (a test fails on an integer option missing here).
OPTION_RANGES: dict[str, tuple[int, int]] = {
    "--seed": (0, INT64_MAX),
    "--repeat": (1, 10_000),
    "--repeat-index": (0, 9_999),
    "--nproc": (1, 4_096),
    "--min-repeats": (1, 10_000),
    "--max-looks": (1, 1_000),  # each look spends alpha / max_looks: past a thousand no interval decides
    "--source-step": (0, INT64_MAX),
    "--top": (0, 1_000_000),
    "--older-than": (1, 36_500),
    "--code": (0, 255),  # a process exit status
    "--repeats": (1, 10_000),
    "--wait-s": (0, 7 * 24 * 3600),
    "--ranks": (1, 65_536),
    "--index": (0, 10_000_000),
    "--position": (0, 10_000_000),
    "--blocks": (1, 10_000),
    "--warmup-updates": (0, 10_000),
    "--measured-updates": (0, 10_000),  # 0: no in-process updates (with --warmup-updates: refused by the funnel)
    "--steps": (1, 10_000_000),
    "--max-repeats": (1, 10_000),
    "--rollout": (0, INT64_MAX),
    "--examples": (0, 1_000_000),
    "--runs": (2, 1_000),
}


# Every number option (not an integer), with the closed range it accepts; read by :func:`number`.
NUMBER_RANGES: dict[str, tuple[float, float]] = {
    "--rtol": (0.0, 1e6),  # an infinite tolerance would make any two numbers equal
    "--atol": (0.0, 1e300),
}


def integer(args: dict[str, Any], key: str) -> int:
    """Option ``key`` as an integer in its declared range (:data:`OPTION_RANGES`; refused, exit 2, when it is
    not an integer or out of range)."""
    raw = args[key]
    if not isinstance(raw, str) or not _DECIMAL.fullmatch(raw):  # int() would also take "1_000", " 7", "٣"
        raise UsageError(f"{key} expects an integer (ASCII digits, an optional leading -), got {raw!r}")
    value = int(raw)
    lo, hi = OPTION_RANGES.get(key, (-INT64_MAX - 1, INT64_MAX))
    if not lo <= value <= hi:
        raise UsageError(f"{key} must be between {lo} and {hi}, got {value}")
    return value


def number(args: dict[str, Any], key: str) -> float:
    """Option ``key`` as a finite number in its declared range (:data:`NUMBER_RANGES`; refused, exit 2, when it is
    not a plain decimal number or out of range)."""
    raw = args[key]
    if not isinstance(raw, str) or not _NUMBER.fullmatch(raw):
        raise UsageError(f"{key} expects a plain decimal number (digits, an optional point, sign and exponent: "
                         f"1e-5, 0.001), got {raw!r}")
    value = float(raw)
    lo, hi = NUMBER_RANGES[key]
    if not lo <= value <= hi:  # an exponent past the float range reads as inf: out of range too
        raise UsageError(f"{key} must be between {lo:g} and {hi:g}, got {raw}")
    return value


def integer_or(args: dict[str, Any], key: str, default: T) -> int | T:
    """Option ``key`` as an integer, or ``default`` when it is not given."""
    return default if args[key] is None else integer(args, key)


def path_or_none(args: dict[str, Any], key: str) -> Path | None:
    """Option ``key`` as a path, or None when it is not given."""
    return None if args[key] is None else Path(args[key])


def diff_options(args: dict[str, Any]) -> dict[str, Any]:
    tol = Tolerance(rtol=number(args, "--rtol"), atol=number(args, "--atol"))
    return {"tol": tol, "ignore": args["--ignore"], "top": integer(args, "--top")}


def print_json(obj: Any) -> None:
    """``--json`` output: strict JSON (a NaN or an infinity is refused, never printed)."""
    print(pretty_bytes(obj).decode("utf-8"), end="")


def print_report(report: Any, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
    else:
        print(report.render())


def print_capture_pins(metrics: dict[str, Any]) -> None:
    for key in sorted(metrics):
        if key.startswith(CAPTURE_PREFIXES):
            print(f"{key} {metrics[key]}")
