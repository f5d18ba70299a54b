"""Reduce at scale: 1,000 synthetic replay metric files (two arms) to a verdict; target under 2 s.

Inputs (made here first by ``replayjob.gate.synthetic``, following docs/replay-metrics.md): a source
run with its capture manifest and N replay_metrics.json files, each with a 64 KiB final adapter.
Timed in the same run:

* baseline, the floor any reducer pays: read every metrics file and ``json.loads`` it (stdlib);
* ``reduce --claim exact-input --baseline`` in-process: strict reading and validation, every check,
  spread statistics, seeded bootstrap ratios (2,000 resamples per metric) and the verdict write;
* the same with ``--claim bitwise``, which also hashes every final adapter file on disk;
* one fresh ``python -m replayjob reduce --claim exact-input`` process, interpreter start and
  imports included: what a workflow step pays;
* the CPU seconds (``time.process_time``) of the in-process reduces, which other load on the machine
  inflates far less than wall time (the JSON records the load averages too).

Ratio: median in-process exact-input seconds / median floor seconds.  Target: the slowest of the
three reduce timings (exact-input, bitwise, fresh process) under 2 s.

Run: ``python -m benchmarks.reduce_many [--smoke] [--files N] [--repeats N]``
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from replayjob.gate import synthetic
from replayjob.gate.evidence import REPLAY_FILE
from replayjob.gate.reducer import Request, reduce_evidence
from replayjob.optbatch.knobs import GRADIENT_CHECKPOINTING as GC_KEY

NAME = "reduce_many"
TARGET_S = 2.0
ADAPTER_BYTES = 64 * 1024
ARMS: dict[str, dict[str, Any]] = {"baseline": {}, "gradient_checkpointing=true": {GC_KEY: True}}


def run(files: int, repeats: int, work: Path) -> dict[str, Any]:
    ev = synthetic.build(work / "ev", ARMS, files // len(ARMS), final=b"\x00" * ADAPTER_BYTES)
    replays = ev.root / "replays"
    paths = sorted(replays.rglob(REPLAY_FILE))

    def floor() -> None:
        for p in paths:
            json.loads(p.read_bytes())

    def reduce(claim: str) -> None:
        v = reduce_evidence(Request([str(replays)], claim, work / f"{claim}.json", source=ev.source,
                                    baseline="baseline"))
        if v.status != "pass":
            raise RuntimeError(f"benchmark evidence did not pass {claim}: {v.doc['failed_checks']}")

    def cpu(claim: str) -> float:
        t0 = time.process_time()
        reduce(claim)
        return time.process_time() - t0

    raw = common.measure(floor, repeats=repeats)
    exact = common.measure(lambda: reduce("exact-input"), repeats=repeats)
    bitwise = common.measure(lambda: reduce("bitwise"), repeats=repeats)
    cpu_s = {claim: common.stats([cpu(claim) for _ in range(repeats)]) for claim in ("exact-input", "bitwise")}
    argv = [sys.executable, "-m", "replayjob", "reduce", str(replays), "--claim", "exact-input", "--out",
            str(work / "cli.json"), "--source", str(ev.source), "--baseline", "baseline"]
    cli = []
    for _ in range(max(1, repeats // 2)):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        cli.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise RuntimeError(f"reduce process exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return {"files": len(paths), "floor_s": common.stats(raw), "exact_input_s": common.stats(exact),
            "bitwise_s": common.stats(bitwise), "cli_process_exact_input_s": common.stats(cli),
            "cpu_s": cpu_s}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--files", type=int, default=None, help="replay metric files (default 1000; smoke 20)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per claim (default 5; smoke 1)")
    args = p.parse_args(argv)
    files = args.files or (20 if args.smoke else 1000)
    repeats = args.repeats or (1 if args.smoke else 5)
    with tempfile.TemporaryDirectory(prefix="replayjob-bench-") as tmp:
        m = run(files, repeats, Path(tmp))
    exact, bitwise, cli = (m[k]["median"] for k in ("exact_input_s", "bitwise_s", "cli_process_exact_input_s"))
    slowest = max(exact, bitwise, cli)
    common.report(
        NAME, smoke=args.smoke, results=args.results,
        ratio_value=common.ratio(exact, m["floor_s"]["median"]),
        ratio_definition="median in-process `reduce --claim exact-input` seconds / median seconds to read "
                         "and json.loads every metrics file",
        baseline="stdlib read + json.loads of the same files, same run",
        target=common.Target("<=", TARGET_S, slowest, metric="slowest reduce (s)"),
        detail=(f"{m['files']} files: exact-input {exact:.3f} s, bitwise {bitwise:.3f} s in-process, "
                f"fresh process {cli:.3f} s; floor {m['floor_s']['median']:.3f} s; CPU exact-input "
                f"{m['cpu_s']['exact-input']['median']:.3f} s, bitwise {m['cpu_s']['bitwise']['median']:.3f} s"),
        measurements=m, parameters={"files": files, "repeats": repeats, "arms": list(ARMS),
                                    "adapter_bytes": ADAPTER_BYTES})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
