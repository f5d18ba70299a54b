"""`funnel`: the workstation funnel (determinism, signals, interleaved ablation)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from replayjob.commands._args import integer
from replayjob.funnel import Options, run_funnel


def cmd_funnel(args: dict[str, Any]) -> int:
    def opt(key: str) -> Path | None:
        return Path(args[key]) if args[key] is not None else None

    def num(key: str) -> int | None:
        return integer(args, key) if args[key] is not None else None

    out = opt("--out") or Path("runs") / ("funnel-" + time.strftime("%Y%m%d-%H%M%S"))
    return run_funnel(Options(
        out=out, spec=opt("--spec") or Path("examples/ablation.toml"), arms=args["--arms"],
        repeats=num("--repeats"), claim=args["--claim"], seed=integer(args, "--seed"), resume=opt("--resume"),
        model=opt("--model"), device=args["--device"], steps=num("--steps"),
        only_ablation=args["--only-ablation"], budgets=opt("--budgets"), until_decided=not args["--fixed-blocks"],
        max_repeats=num("--max-repeats"), design=args["--design"],
        **{k: n for k, n in (("warmup_updates", num("--warmup-updates")),
                             ("measured_updates", num("--measured-updates"))) if n is not None},
        plant_nondeterminism=args["--plant-nondeterminism"], plant_kill=args["--plant-kill"],
        plant_undeclared=args["--plant-undeclared"], report=not args["--no-report"], capture=opt("--capture"),
        replay_config=args["--replay-config"]))
