"""`init`, `train` and `capture`: a workspace, and the source trainer's run (replayjob's own producer)."""

from __future__ import annotations

from typing import Any

from replayjob.artifacts import metrics as M
from replayjob.commands._args import integer, print_capture_pins
from replayjob.launch import source_run
from replayjob.launch.workspace import init_workspace


def cmd_init(args: dict[str, Any]) -> int:
    for path in init_workspace(args["<dir>"], integer(args, "--seed"), args["--set"]):
        print(f"wrote {path}")
    return 0


def cmd_train(args: dict[str, Any]) -> int:
    out, metrics = source_run.train_command(args["<config>"], args["--set"], args["--out"])
    if not metrics:  # a rank other than 0 of several: rank 0 reports the run
        return 0
    print(f"trained {metrics['steps_run']} step(s); loss {metrics['loss']!r}")
    print(f"final adapter sha256 {metrics[M.SOURCE_FINAL_ADAPTER]}")
    print_capture_pins(metrics)
    print(f"wrote {out}/diag.jsonl, {out}/{M.SOURCE_FILE}")
    return 0


def cmd_capture(args: dict[str, Any]) -> int:
    out, metrics = source_run.capture(args["<config>"], args["--set"], args["--out"])
    if not metrics:  # a rank other than 0 of several: it landed its rows; rank 0 wrote the root
        return 0
    print(f"captured step 0 into {out}; loss {metrics['loss']!r}")
    print_capture_pins(metrics)
    print(f"wrote {out}/{metrics[M.MANIFEST_PATH]} (last), {out}/{M.SOURCE_FILE}")
    return 0
