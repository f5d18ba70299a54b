"""`diag-diff`, `determinism-check` and `signals`: same-seed runs diffed leaf by leaf, and the KILL/WARN/OK rules."""

from __future__ import annotations

import sys
from typing import Any

from replayjob.check import diagdiff
from replayjob.check.determinism_check import check
from replayjob.check.rules import load_rules
from replayjob.check.signals import evaluate
from replayjob.commands._args import diff_options, integer, integer_or, print_report


def cmd_diag_diff(args: dict[str, Any]) -> int:
    report = diagdiff.diff_files(args["<a.jsonl>"], args["<b.jsonl>"], **diff_options(args))
    print_report(report, args["--json"])
    return report.exit_code


def cmd_determinism_check(args: dict[str, Any]) -> int:
    report = check(args["<config>"], runs=integer(args, "--runs"),
                   steps=integer_or(args, "--steps", None),
                   out=args["--out"], sets=args["--set"], command=args["--command"], **diff_options(args),
                   progress=lambda line: print(line, file=sys.stderr))
    print_report(report, args["--json"])
    return report.exit_code


def cmd_signals(args: dict[str, Any]) -> int:
    report = evaluate(args["<run>"], load_rules(args["--rules"]))
    if args["--quiet"]:
        print(report.quiet())
    else:
        print_report(report, args["--json"])
    return report.exit_code
