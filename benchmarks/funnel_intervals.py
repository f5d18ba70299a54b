"""The funnel's timing interval before and after its decision defaults, on the same spec and machine.

Two ``replayjob funnel --only-ablation`` runs of ``examples/ablation-microbatch.toml`` (micro-batch 1
against the default: a real slowdown) on the CPU:

* **before**: the former defaults, ``--fixed-blocks --repeats 3 --warmup-updates 0 --measured-updates 0``:
  the fresh-process update of each replay, the unpaired ratio of medians with its 95% interval;
* **after**: the defaults (warm in-process updates, blocks added until the paired comparison is decided,
  at most :data:`replayjob.launch.funnel.MAX_BLOCKS`): the paired interval at the look's level.

The ratio is the after interval's log-width over the before one's, ``ln(high / low)`` (lower is
tighter; the after interval is at the stricter per-look level, so a ratio below 1 is won despite it).
Reported beside: each interval, whether it excludes 1, the blocks the after run took and each run's
wall time, and the load average around them (figures under load are noise: see benchmarks/README.md).

``python -m benchmarks.funnel_intervals [--smoke] [--workdir DIR]``
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "funnel_intervals"
SPEC = common.REPO / "examples" / "ablation-microbatch.toml"
TARGET = 1.0


def _run(out: Path, args: list[str], paired_interval: bool) -> dict[str, Any]:
    from replayjob.launch.funnel import Options, run_funnel

    opts: dict[str, Any] = {"out": out, "spec": SPEC, "device": "cpu", "only_ablation": True, "report": False}
    i = 0
    while i < len(args):
        key, value = args[i], args[i + 1] if i + 1 < len(args) else None
        if key == "--fixed-blocks":
            opts["until_decided"] = False
            i += 1
            continue
        opts[key.lstrip("-").replace("-", "_")] = int(value) if value is not None else None
        i += 2
    t0 = time.perf_counter()
    code = run_funnel(Options(**opts), progress=lambda line: None)
    wall = time.perf_counter() - t0
    verdict = json.loads((out / "verdict.json").read_text())
    paired = (verdict["comparisons"].get("paired") or {}).get("arms", {}).get("mb-1")
    unpaired = verdict["comparisons"]["ratios"]["mb-1"]["local_train_wall_s"]
    row = paired if paired_interval and paired is not None and paired.get("low") is not None else unpaired
    blocks = len(verdict["inputs"]["replays"]) // 2
    metric = (verdict["comparisons"].get("paired") or {}).get("metric") if row is paired else "local_train_wall_s"
    return {"exit_code": code, "wall_s": wall, "blocks": blocks, "metric": metric,
            "ratio": row["ratio"], "low": row["low"], "high": row["high"], "excludes_1": row["excludes_1"],
            "log_width": math.log(row["high"] / row["low"]) if row["low"] else None,
            "admission": verdict["admission"], "funnel_status": json.loads((out / "funnel.json").read_text())["status"]}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__ or NAME)
    p.add_argument("--workdir", type=Path, default=None, help="keep the two funnel runs here")
    args = p.parse_args(argv)
    before_args = ["--fixed-blocks", "--repeats", "1" if args.smoke else "3", "--warmup-updates", "0",
                   "--measured-updates", "0"]
    # a smoke run shows only that both runs and their reading work: one block each, few warm updates
    after_args = (["--repeats", "1", "--max-repeats", "1", "--warmup-updates", "1", "--measured-updates", "2"]
                  if args.smoke else [])
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="replayjob-funnel-intervals-") as tmp:
        root = args.workdir or Path(tmp)
        before = _run(root / "before", before_args, paired_interval=False)
        load.append(os.getloadavg()[0])
        after = _run(root / "after", after_args, paired_interval=True)
        load.append(os.getloadavg()[0])
    if not before["log_width"] or after["log_width"] is None:  # no interval: not admitted (contended) or one block
        if not args.smoke:  # a smoke run only shows that the benchmark runs
            raise SystemExit(f"{NAME}: no interval to compare (before: {before['funnel_status']}, after: "
                             f"{after['funnel_status']}): run it again on a quieter host")
        ratio = 1.0
    else:
        ratio = common.ratio(after["log_width"], before["log_width"])

    def show(r: dict[str, Any]) -> str:
        if r["low"] is None:  # contended (timing not admitted) or no interval
            return f"no interval ({r['funnel_status']}, timing {r['admission']}, {r['wall_s']:.0f} s)"
        return (f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] ({r['metric']}, {r['blocks']} blocks, "
                f"{r['wall_s']:.0f} s, excludes 1: {r['excludes_1']})")

    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=ratio,
        ratio_definition="ln(high/low) of the funnel's mb-1 / mb-default timing interval with the defaults "
                         "over the same with the former defaults",
        baseline="funnel --fixed-blocks --repeats 3 --warmup-updates 0 --measured-updates 0 (fresh-process "
                 "update, unpaired 95% interval of the ratio of medians)",
        target=common.Target("<=", TARGET, ratio),
        detail=f"before {show(before)}; after {show(after)}; load average {min(load):.2f}-{max(load):.2f}",
        measurements={"before": before, "after": after, "loadavg_1m": load},
        parameters={"spec": str(SPEC.relative_to(common.REPO)), "before_args": before_args, "after_args": after_args,
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
