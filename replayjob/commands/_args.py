"""What every command shares: integer options, ``--json`` and report printing, the diff options."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from replayjob.check.leafdiff import Tolerance
from replayjob.errors import UsageError
from replayjob.jsonio import pretty_bytes
from replayjob.metrics import CAPTURE_PREFIXES

T = TypeVar("T")


def integer(args: dict[str, Any], key: str) -> int:
    """Option ``key`` as an integer (refused, exit 2, when it is not one)."""
    raw = args[key]
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise UsageError(f"{key} expects an integer, got {raw!r}") from None


def integer_or(args: dict[str, Any], key: str, default: T) -> int | T:
    """Option ``key`` as an integer, or ``default`` when it is not given."""
    return default if args[key] is None else integer(args, key)


def path_or_none(args: dict[str, Any], key: str) -> Path | None:
    """Option ``key`` as a path, or None when it is not given."""
    return None if args[key] is None else Path(args[key])


def diff_options(args: dict[str, Any]) -> dict[str, Any]:
    try:
        tol = Tolerance(rtol=float(args["--rtol"]), atol=float(args["--atol"]))
    except ValueError:
        raise UsageError(f"--rtol/--atol expect numbers, got {args['--rtol']!r}, {args['--atol']!r}") from None
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
