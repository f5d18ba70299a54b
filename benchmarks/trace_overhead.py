"""Trace overhead: a replay with ``--trace`` against the same replay without it.

One ``replayjob init`` workspace and one capture, then replays of that capture alternating traced
and untraced (traced, untraced, traced, ...), each into a fresh output directory.  "Traced" is
``optimizer_batch.trace = true``: module hooks on every module, per-row digests and statistics,
parameter gradients and updates, and the trace written (payload, then index) before
``replay_metrics.json``.

Ratio (judged): median wall seconds of ``python -m replayjob replay`` traced / untraced, each a
fresh process as ``replay --repeat`` and every launcher runs a replay (interpreter start, imports,
admission, model build, the update, the final adapter, the trace, the metrics).  Target: <= 1.5.

Also reported, not judged, because the tiny model's whole in-process replay takes a fraction of a
second so the trace's fixed per-site work weighs far more there than on any real model: the same
ratio for the in-process ``replay()`` call (imports warm), for the update alone
(``timing.local_train_wall_s``, where the hooks run), the in-process process-CPU ratio, and the
trace's size on disk.

Run: ``python -m benchmarks.trace_overhead [--smoke] [--pairs N]``
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "trace_overhead"
TARGET = 1.5


def _pins(capture: Path) -> list[str]:
    from replayjob.artifacts.metrics import read_pins

    logical, manifest, _ = read_pins(capture)
    return [f"optimizer_batch.expected_logical_sha256={json.dumps(logical)}",
            f"optimizer_batch.expected_manifest_sha256={json.dumps(manifest)}"]


def _replay(cfg_path: Path, sets: list[str], out: Path, traced: bool) -> dict[str, Any]:
    from replayjob.artifacts.trace_store import TRACE_DIR
    from replayjob.config import load_config
    from replayjob.producers.builtin.replay import replay

    cfg = load_config(cfg_path, [*sets, f"optimizer_batch.trace={'true' if traced else 'false'}"])
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = replay(cfg, out)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    size = sum(p.stat().st_size for p in (out / TRACE_DIR).iterdir()) if traced else 0
    return {"wall_s": wall, "cpu_s": cpu, "update_s": metrics["timing"]["local_train_wall_s"], "trace_bytes": size}


def _process(ws: Path, sets: list[str], out: Path, traced: bool) -> float:
    argv = [sys.executable, "-m", "replayjob", "replay", str(ws / "replay.toml"), "--out", str(out)]
    for item in [*sets, f"optimizer_batch.trace={'true' if traced else 'false'}"]:
        argv += ["--set", item]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=common.REPO)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__ or NAME)
    p.add_argument("--pairs", type=int, default=8, help="alternating traced/untraced pairs")
    args = p.parse_args(argv)
    pairs = 1 if args.smoke else args.pairs
    from replayjob.launch.source_run import capture
    from replayjob.launch.workspace import init_workspace

    with tempfile.TemporaryDirectory(prefix="replayjob-trace-bench-") as tmp:
        ws = Path(tmp) / "ws"
        init_workspace(ws, 123)
        capture(ws / "source.toml", [], ws / "source")
        sets = _pins(ws / "source")
        _replay(ws / "replay.toml", sets, Path(tmp) / "warm", traced=True)  # warm-up, not timed
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        procs: dict[bool, list[float]] = {True: [], False: []}
        for i in range(pairs):
            for traced in (True, False):
                runs[traced].append(_replay(ws / "replay.toml", sets, Path(tmp) / f"{traced}-{i}", traced))
                procs[traced].append(_process(ws, sets, Path(tmp) / f"p-{traced}-{i}", traced))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s", "update_s")} for k, v in runs.items()}
    ratio = common.ratio(statistics.median(procs[True]), statistics.median(procs[False]))
    inproc_ratio = common.ratio(med[True]["wall_s"], med[False]["wall_s"])
    update_ratio = common.ratio(med[True]["update_s"], med[False]["update_s"])
    cpu_ratio = common.ratio(med[True]["cpu_s"], med[False]["cpu_s"])
    trace_bytes = runs[True][0]["trace_bytes"]
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=ratio,
        ratio_definition="median wall seconds of a fresh `python -m replayjob replay` process with "
                         "optimizer_batch.trace = true / without",
        baseline="the same replay of the same capture without tracing, alternating",
        target=common.Target("<=", TARGET, ratio),
        detail=(f"process {statistics.median(procs[True]):.2f} vs {statistics.median(procs[False]):.2f} s; "
                f"in-process replay() {inproc_ratio:.2f}x ({med[True]['wall_s']:.3f} vs {med[False]['wall_s']:.3f} s); "
                f"update alone "
                f"{update_ratio:.2f}x; process CPU {cpu_ratio:.2f}x; trace {trace_bytes / 1e6:.1f} MB"),
        measurements={"process_traced": common.stats(procs[True]), "process_untraced": common.stats(procs[False]),
                      "traced": common.stats([r["wall_s"] for r in runs[True]]),
                      "untraced": common.stats([r["wall_s"] for r in runs[False]]), "inprocess_ratio": inproc_ratio,
                      "update_traced": common.stats([r["update_s"] for r in runs[True]]),
                      "update_untraced": common.stats([r["update_s"] for r in runs[False]]),
                      "cpu_traced": common.stats([r["cpu_s"] for r in runs[True]]),
                      "cpu_untraced": common.stats([r["cpu_s"] for r in runs[False]]),
                      "update_ratio": update_ratio, "cpu_ratio": cpu_ratio, "trace_bytes": trace_bytes},
        parameters={"pairs": pairs, "model": "built-in tiny Llama (init defaults)"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
