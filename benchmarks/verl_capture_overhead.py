"""verl capture overhead: an actor update with a capture installed, against the same update without one.

Two verl actor workers are built alike (benchmarks/verl_tiny.py: verl 0.9.1's FSDP2 engine on the CPU, a tiny
Qwen2); one gets :func:`replayjob.producers.verl.producer.capture_actor_steps` for one chosen optimizer step, the
other nothing (installed after two untimed warm-up updates of each).  Updates alternate between them (off, on,
off, ...), each on the same batches, so drift in the machine hits both alike.  An update is
``TinyTrainer._update_actor`` (``RayPPOTrainer._update_actor``'s shape: the batch conversion and the worker's
``train_mini_batch``, i.e. every optimizer step of one update).

Ratio: the median per-pair ratio of process CPU seconds (each update of the capturing worker against the
same-numbered update of the other; wall time is reported beside it) over the updates outside the captured
step: what an installed capture costs the steps it does not capture.  Target: <= 1.02.  Also reported: the
update holding the captured step against its partner (what capturing one step costs: the snapshot of
parameters and optimizer state, the payload, the manifest and the replay config written on the training
thread).  Torch runs one intra-op thread by default (``--threads``), so that other load on a shared host
does not make its threads spin.

Run: ``python -m benchmarks.verl_capture_overhead [--smoke] [--updates N] [--threads N]`` (needs verl:
scripts/test-verl.sh builds the environment).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.verl_tiny import TinyTrainer, build_worker, rollout_batch, tiny_model

NAME = "verl_capture_overhead"
TARGET = 1.02
WARMUP = 2  # untimed updates of each worker before the capture is installed
CAPTURED_UPDATE = 1  # the first optimizer step of the second update is captured (mini-batches of 4, 8 rows)


def run(updates: int, tmp: Path) -> dict[str, list[float]]:
    from replayjob.producers.verl.producer import capture_actor_steps

    base = tiny_model(tmp / "base")
    off, on = build_worker(base, fp32=True), build_worker(base, fp32=True)
    trainers = {"off": TinyTrainer(off), "on": TinyTrainer(on)}
    for u in range(WARMUP):  # untimed: first calls allocate, import and compile
        for arm in ("off", "on"):
            trainers[arm]._update_actor(rollout_batch(900 + u))
    steps_per_update = 2  # steps count from the installation on
    capture_actor_steps(on, tmp / "cap", step=CAPTURED_UPDATE * steps_per_update)
    seconds: dict[str, list[float]] = {"off": [], "on": [], "cpu_off": [], "cpu_on": []}
    for u in range(updates):
        for arm in ("off", "on") if u % 2 == 0 else ("on", "off"):
            batch = rollout_batch(1000 + u)
            c0, t0 = time.process_time(), time.perf_counter()
            trainers[arm]._update_actor(batch)
            seconds[arm].append(time.perf_counter() - t0)
            seconds[f"cpu_{arm}"].append(time.process_time() - c0)
    return seconds


def pair_ratios(on: list[float], off: list[float]) -> list[float]:
    """Each update of the capturing worker over its partner, leaving out the update holding the captured step."""
    return [a / b for i, (a, b) in enumerate(zip(on, off, strict=True)) if i != CAPTURED_UPDATE]


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__ or NAME)
    p.add_argument("--updates", type=int, default=24, help="updates per worker (the captured one included)")
    p.add_argument("--threads", type=int, default=1, help="Torch intra-op threads (1: no spinning on a busy host)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    updates = 4 if args.smoke else max(args.updates, 4)
    with tempfile.TemporaryDirectory() as d:
        seconds = run(updates, Path(d))
    pairs = pair_ratios(seconds["cpu_on"], seconds["cpu_off"])
    wall_pairs = pair_ratios(seconds["on"], seconds["off"])
    value = statistics.median(pairs)
    captured = seconds["on"][CAPTURED_UPDATE] - seconds["off"][CAPTURED_UPDATE]
    target = common.Target("<=", TARGET, value)
    detail = (f"{len(pairs)} update pairs outside the captured step (process CPU seconds; wall-time pair median "
              f"{statistics.median(wall_pairs):.3f}x); the update holding it took {captured:+.3f} s against its "
              "partner")
    print(common.summary_line(NAME, value, target, detail, smoke=args.smoke))
    common.write_result(
        NAME, smoke=args.smoke, results=args.results, ratio_value=value,
        ratio_definition="median over update pairs outside the captured step of (process CPU seconds of the "
                         "update with a capture installed / those of the same update without); CPU seconds because "
                         "other load on a shared host inflates wall time far more",
        baseline="the same actor update on an identical worker without a capture, alternating with it", target=target,
        measurements={"update_seconds_on": common.stats(seconds["on"]),
                      "update_seconds_off": common.stats(seconds["off"]),
                      "cpu_seconds_on": common.stats(seconds["cpu_on"]),
                      "cpu_seconds_off": common.stats(seconds["cpu_off"]),
                      "pair_ratios": common.stats(pairs), "wall_pair_ratios": common.stats(wall_pairs),
                      "captured_update_added_s": captured},
        parameters={"updates": updates, "warmup_updates": WARMUP, "threads": args.threads,
                    "captured_update": CAPTURED_UPDATE, "optimizer_steps_per_update": 2,
                    "model": "Qwen2, 2 layers, hidden 32, float32 (benchmarks/verl_tiny.py)"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
