"""Trace overhead: a replay with ``--trace`` against the same replay without it.

One ``replayjob init`` workspace and one capture, then replays of that capture alternating traced
and untraced (traced, untraced, traced, ...) in this one process (imports and model code warm), each
into a fresh output directory.  "Traced" is ``optimizer_batch.trace = true``: module hooks on every
module, per-row digests and statistics, parameter gradients and updates, and the trace written
(payload, then index) before ``replay_metrics.json``.

Ratio: median seconds of the whole ``replay()`` call (admission, model build, the update, the
final adapter, the trace and the metrics) traced / untraced.  Target: <= 1.5.  Also reported, not
judged: the same ratio for the update alone (``timing.local_train_wall_s``, where the hooks run),
the ratio of the process CPU seconds (all threads; other load on the machine inflates it less than
wall time), and the trace's size on disk.

Run: ``python -m benchmarks.trace_overhead [--smoke] [--pairs N]``
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "trace_overhead"
TARGET = 1.5


def _pins(capture: Path) -> list[str]:
    m = json.loads((capture / "metrics.json").read_text())
    return [f"optimizer_batch.expected_logical_sha256={json.dumps(m['optimizer/logical_batch_sha256'])}",
            f"optimizer_batch.expected_manifest_sha256={json.dumps(m['optimizer_batch/manifest_sha256'])}"]


def _replay(cfg_path: Path, sets: list[str], out: Path, traced: bool) -> dict[str, Any]:
    from replayjob.config import load_config
    from replayjob.optbatch.replay import replay

    cfg = load_config(cfg_path, [*sets, f"optimizer_batch.trace={'true' if traced else 'false'}"])
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = replay(cfg, out)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    size = sum(p.stat().st_size for p in (out / "trace").iterdir()) if traced else 0
    return {"wall_s": wall, "cpu_s": cpu, "update_s": metrics["timing"]["local_train_wall_s"], "trace_bytes": size}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__ or NAME)
    p.add_argument("--pairs", type=int, default=8, help="alternating traced/untraced pairs")
    args = p.parse_args(argv)
    pairs = 1 if args.smoke else args.pairs
    from replayjob.optbatch.capture import capture
    from replayjob.workspace import init_workspace

    with tempfile.TemporaryDirectory(prefix="replayjob-trace-bench-") as tmp:
        ws = Path(tmp) / "ws"
        init_workspace(ws, 123)
        capture(ws / "source.toml", [], ws / "source")
        sets = _pins(ws / "source")
        _replay(ws / "replay.toml", sets, Path(tmp) / "warm", traced=True)  # warm-up, not timed
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for i in range(pairs):
            for traced in (True, False):
                runs[traced].append(_replay(ws / "replay.toml", sets, Path(tmp) / f"{traced}-{i}", traced))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s", "update_s")} for k, v in runs.items()}
    ratio = common.ratio(med[True]["wall_s"], med[False]["wall_s"])
    update_ratio = common.ratio(med[True]["update_s"], med[False]["update_s"])
    cpu_ratio = common.ratio(med[True]["cpu_s"], med[False]["cpu_s"])
    trace_bytes = runs[True][0]["trace_bytes"]
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=ratio,
        ratio_definition="median replay() seconds with optimizer_batch.trace = true / without",
        baseline="the same replay of the same capture without tracing, alternating in one process",
        target=common.Target("<=", TARGET, ratio),
        detail=(f"replay {med[True]['wall_s']:.3f} vs {med[False]['wall_s']:.3f} s; update alone "
                f"{update_ratio:.2f}x; process CPU {cpu_ratio:.2f}x; trace {trace_bytes / 1e6:.1f} MB"),
        measurements={"traced": common.stats([r["wall_s"] for r in runs[True]]),
                      "untraced": common.stats([r["wall_s"] for r in runs[False]]),
                      "update_traced": common.stats([r["update_s"] for r in runs[True]]),
                      "update_untraced": common.stats([r["update_s"] for r in runs[False]]),
                      "cpu_traced": common.stats([r["cpu_s"] for r in runs[True]]),
                      "cpu_untraced": common.stats([r["cpu_s"] for r in runs[False]]),
                      "update_ratio": update_ratio, "cpu_ratio": cpu_ratio, "trace_bytes": trace_bytes},
        parameters={"pairs": pairs, "model": "built-in tiny Llama (init defaults)"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
