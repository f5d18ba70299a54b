"""`trace-diff`: the first divergent module between two traced replays."""

from __future__ import annotations

from typing import Any

from replayjob.commands._args import print_json
from replayjob.trace import diff as trace_diff


def cmd_trace_diff(args: dict[str, Any]) -> int:
    rep = trace_diff.trace_diff(args["<a>"], args["<b>"], args["--reference"] or None)
    if args["--json"]:
        print_json(rep)
    else:
        print(trace_diff.render(rep))
    return int(rep["exit_code"])
