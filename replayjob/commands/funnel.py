"""`funnel`: the workstation funnel (determinism, signals, interleaved ablation)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from replayjob.commands._args import integer, integer_or, path_or_none
from replayjob.fsio import refuse_unusable_out
from replayjob.launch.funnel import Options, run_funnel


def cmd_funnel(args: dict[str, Any]) -> int:
    out = path_or_none(args, "--out") or Path("runs") / ("funnel-" + time.strftime("%Y%m%d-%H%M%S"))
    refuse_unusable_out(out)  # a file there failed only when the first stage wrote (exit 3)
    updates = {"warmup_updates": integer_or(args, "--warmup-updates", None),
               "measured_updates": integer_or(args, "--measured-updates", None)}
    return run_funnel(Options(
        out=out, spec=path_or_none(args, "--spec") or Path("examples/ablation.toml"), arms=args["--arms"],
        repeats=integer_or(args, "--repeats", None), claim=args["--claim"], seed=integer(args, "--seed"),
        resume=path_or_none(args, "--resume"), model=path_or_none(args, "--model"), device=args["--device"],
        steps=integer_or(args, "--steps", None), only_ablation=args["--only-ablation"],
        budgets=path_or_none(args, "--budgets"), until_decided=not args["--fixed-blocks"],
        max_repeats=integer_or(args, "--max-repeats", None), design=args["--design"],
        **{k: n for k, n in updates.items() if n is not None},
        plant_nondeterminism=args["--plant-nondeterminism"], plant_kill=args["--plant-kill"],
        plant_undeclared=args["--plant-undeclared"], report=not args["--no-report"],
        capture=path_or_none(args, "--capture"), replay_config=args["--replay-config"]))
