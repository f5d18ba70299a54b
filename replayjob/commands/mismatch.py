"""`mismatch`: where a capture's sampler logprobs disagree with the trainer's, and why."""

from __future__ import annotations

from typing import Any

from replayjob.commands._args import print_json
from replayjob.mismatch import check_capture


def cmd_mismatch(args: dict[str, Any]) -> int:
    report = check_capture(args["<capture>"], args["--set"], args["--bound"], allow_lag=bool(args["--allow-lag"]))
    if args["--json"]:
        print_json(report.to_json())
    else:
        print(report.render())
    report.raise_for_decision()
    return 0
