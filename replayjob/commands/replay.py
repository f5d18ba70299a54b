"""`explain` and `replay`: a capture's admission, and its replay under an arm's knobs (any producer)."""

from __future__ import annotations

from typing import Any

from replayjob.artifacts import metrics as M
from replayjob.artifacts.schedule import parse_slot
from replayjob.commands._args import integer_or, print_json
from replayjob.config.dump import set_args
from replayjob.producers import explain
from replayjob.producers.builtin.replay import replay_command


def cmd_explain(args: dict[str, Any]) -> int:
    adm, rep = explain.explain(args["<config>"], args["--set"], nproc=integer_or(args, "--nproc", None))
    if args["--json"]:
        print_json(rep)
    else:
        print(explain.render(rep))
    adm.raise_if_refused()
    return 0


def cmd_replay(args: dict[str, Any]) -> int:
    repeat = integer_or(args, "--repeat", None)
    index = integer_or(args, "--repeat-index", 0)
    slot = parse_slot(args["--slot"]) if args["--slot"] is not None else None
    sets = [*args["--set"], *(set_args({"optimizer_batch.trace": True}) if args["--trace"] else [])]
    nproc = integer_or(args, "--nproc", 1)
    for out, m in replay_command(args["<config>"], sets, args["--out"], repeat, index, slot, nproc=nproc):
        if not m:  # a rank other than 0 of several: rank 0 reports the replay
            continue
        print(f"replayed arm {m['arm']} repeat {m['repeat_index']}: loss {M.loss_text(m)}, "
              f"final adapter sha256 {m[M.FINAL_ADAPTER]}, "
              "in effect: " + (", ".join(f"{k}={v}" for k, v in sorted(m["runtime"].items()))
                               or f"no registered knobs ({m['framework']})"))
        print(f"wrote {out}/{M.REPLAY_FILE}")
    return 0
