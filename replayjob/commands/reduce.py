"""`reduce`: replays into a verdict (the gate; imports no torch for the exact-input and bitwise claims)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replayjob.commands._args import integer, integer_or, path_or_none
from replayjob.deploy.ablation import load_spec
from replayjob.gate import reducer


def cmd_reduce(args: dict[str, Any]) -> int:
    out = Path(args["--out"])
    verdict = reducer.reduce_evidence(reducer.Request(
        paths=args["<path>"], claim=args["--claim"], out=out, source=path_or_none(args, "--source"),
        tolerances=path_or_none(args, "--tolerances"),
        min_repeats=integer_or(args, "--min-repeats", 3),
        baseline=args["--baseline"], report=path_or_none(args, "--report"), budgets=path_or_none(args, "--budgets"),
        max_looks=integer(args, "--max-looks"),
        arms=tuple(a.strip() for a in args["--arms"].split(",")) if args["--arms"] is not None else None,
        spec=load_spec(args["--spec"]) if args["--spec"] is not None else None,
        mixed_hardware=bool(args["--mixed-hardware"]),
        source_step=integer_or(args, "--source-step", None)))
    print(verdict.summary())
    print(f"wrote {out}" + (f", {args['--report']}" if args["--report"] else ""))
    verdict.raise_for_status()
    return 0
