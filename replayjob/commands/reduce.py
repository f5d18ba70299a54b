"""`reduce`: replays into a verdict (the gate; imports no torch for the exact-input and bitwise claims)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replayjob.artifacts import claims
from replayjob.artifacts.spec import load_spec
from replayjob.commands._args import integer, integer_or, path_or_none
from replayjob.errors import RefusedError
from replayjob.gate import reducer


def cmd_reduce(args: dict[str, Any]) -> int:
    claims.claim(args["--claim"])  # an unknown claim is refused before anything is read or written
    out = Path(args["--out"])
    refused: RefusedError | None = None  # an option outside its range or an unreadable spec: refused in a verdict
    min_repeats, max_looks, source_step, spec = 3, 1, None, None
    try:
        min_repeats, max_looks = integer_or(args, "--min-repeats", 3), integer(args, "--max-looks")
        source_step = integer_or(args, "--source-step", None)
        spec = load_spec(args["--spec"]) if args["--spec"] is not None else None
    except RefusedError as exc:
        refused = exc
    verdict = reducer.reduce_evidence(reducer.Request(
        paths=args["<path>"], claim=args["--claim"], out=out, source=path_or_none(args, "--source"),
        tolerances=path_or_none(args, "--tolerances"),
        baseline=args["--baseline"], report=path_or_none(args, "--report"), budgets=path_or_none(args, "--budgets"),
        arms=tuple(a.strip() for a in args["--arms"].split(",")) if args["--arms"] is not None else None,
        spec=spec,
        mixed_hardware=bool(args["--mixed-hardware"]), usage_error=refused, min_repeats=min_repeats,
        max_looks=max_looks, source_step=source_step))
    print(verdict.summary())
    print(f"wrote {out}" + (f", {args['--report']}" if args["--report"] else ""))
    verdict.raise_for_status()
    return 0
