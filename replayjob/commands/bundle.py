"""`bundle inspect|validate|replay`: trajectory bundles, recomputed stage by stage to the first divergence."""

from __future__ import annotations

from typing import Any

from replayjob.bundle import report as bundle_report
from replayjob.bundle import summary
from replayjob.bundle.reader import load_bundle
from replayjob.bundle.replay import replay_bundle
from replayjob.commands._args import integer, integer_or, print_json
from replayjob.jsonio import non_finite_as_strings, pretty_bytes


def cmd_bundle(args: dict[str, Any]) -> int:
    path = args["<bundle>"]
    if args["inspect"]:
        info = summary.inspect_path(path)
        if args["--json"]:
            print_json(info)
        else:
            print(summary.render(info))
        return 0
    if args["validate"]:
        b = load_bundle(path, tensors=False)  # every check, no payload data kept
        valid = {"valid": True, "path": str(b.path), "bundle_id": b.manifest["bundle_id"], "kind": b.kind,
                 "samples": len(b.samples), "payloads": sorted(b.payloads), "ranks": b.ranks}
        print(pretty_bytes(valid).decode("utf-8").rstrip("\n") if args["--json"] else
              f"valid: {b.kind} bundle {valid['bundle_id']} ({valid['samples']} samples, "
              f"{len(b.payloads)} payloads{', ranks ' + str(b.ranks) if b.ranks else ''})")
        return 0
    report = replay_bundle(path, stage=args["--stage"], samples=args["--sample"], groups=args["--group"],
                           batches=args["--batch"], step=args["--step"],
                           rollout=integer_or(args, "--rollout", None),
                           max_examples=integer(args, "--examples"))
    if args["--json"]:  # a non-finite value compared is reported as a string ("NaN"), never a bare NaN
        print_json(non_finite_as_strings(report.to_json()))
    else:
        print(bundle_report.render(report))
    return 1 if report.diverged else 0
