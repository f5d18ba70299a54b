"""Routing cost on the built-in tiny MoE model: observing it, and forcing it, against an unobserved update.

One ``replayjob init`` workspace and one capture of the built-in tiny Qwen3-MoE model
(``model.architecture = "qwen3_moe"``: two MoE layers, four experts, top-2, 16 rows), then three replay
sessions of it built side by side in one process, exactly as ``replayjob replay`` builds them (admission,
the backend, the pinned adapter, a fresh optimizer; :class:`replayjob.producers.builtin.replay.BuiltinSession`):

* **unobserved** -- the model built without its :class:`replayjob.model.moe.Routing` (the benchmark
  substitutes ``moe.attach`` with one that attaches nothing): no router hook, no per-micro-batch
  context, nothing recorded;
* **observed** -- as every replay runs (``model.routing = "free"``): each router's experts, weights and
  margin recorded per token, one table built per update;
* **forced** -- ``model.routing = "forced"`` from the capture's own routing file: each router's forward
  replaced (softmax, the forced indices put in, weights gathered), plus the same recording.

Each round restores every session's captured start state and runs one update of each (the replay
driver's own :func:`replayjob.producers.driver.update`), the arms in rotating order, after warm-up
rounds, on one intra-op thread.  Per update: wall seconds and process CPU seconds.

Ratio (judged): median over rounds of the paired ratio observed / unobserved of process CPU seconds per
update.  Target: <= 1.05.  CPU seconds, because on a shared host the wall clock mostly measures the
neighbours; the wall-clock ratio is reported beside it, and so is forced / unobserved (not judged).

Run: ``python -m benchmarks.moe_routing [--smoke] [--rounds N]``
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "moe_routing"
TARGET = 1.05
MOE = ['model.architecture="qwen3_moe"']
ARMS = ("unobserved", "observed", "forced")


def _session(ws: Path, sets: list[str], arm: str) -> tuple[Any, list[Any]]:
    from unittest import mock

    from replayjob.config import load_config
    from replayjob.model import moe
    from replayjob.producers.builtin.admission import admit
    from replayjob.producers.builtin.replay import BuiltinSession
    from replayjob.runtime import determinism, distributed

    cfg = distributed.observe(load_config(ws / "replay.toml", sets))  # as replay() resolves it: one process
    determinism.establish(strict=cfg.backend.options.strict_deterministic, seed=cfg.training.seed)
    adm = admit(cfg)
    adm.raise_if_refused()
    if arm == "unobserved":
        with mock.patch.object(moe, "attach", lambda model, cfg: None):
            session = BuiltinSession(cfg, adm)
        assert session.policy.routing is None
    else:
        session = BuiltinSession(cfg, adm)
        assert session.policy.routing is not None and session.policy.routing.mode == (
            "forced" if arm == "forced" else "free")
    session.restore()
    return session, session.plan()


def _update(session: Any, plan: list[Any]) -> tuple[float, float, float]:
    from replayjob.producers.driver import update

    session.restore()
    t0, c0 = time.perf_counter(), time.process_time()
    outcome, _ = update(session, plan)
    return time.perf_counter() - t0, time.process_time() - c0, outcome.loss


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__ or NAME)
    p.add_argument("--rounds", type=int, default=40, help="measured rounds (one update of each arm per round)")
    args = p.parse_args(argv)
    rounds, warmup = (2, 1) if args.smoke else (args.rounds, 3)
    import torch

    torch.set_num_threads(1)  # one intra-op thread, as the funnel runs CPU steps: no spinning pool in the figures
    from replayjob.launch.source_run import capture
    from replayjob.launch.workspace import init_workspace

    wall: dict[str, list[float]] = {a: [] for a in ARMS}
    cpu: dict[str, list[float]] = {a: [] for a in ARMS}
    losses: dict[str, set[float]] = {a: set() for a in ARMS}
    with tempfile.TemporaryDirectory(prefix="replayjob-moe-bench-") as tmp:
        ws = Path(tmp) / "ws"
        init_workspace(ws, 123, MOE)
        metrics = capture(ws / "source.toml", MOE, ws / "source")[1]
        entry = metrics["routing/steps"][0]
        pins = [f"optimizer_batch.expected_logical_sha256={json.dumps(metrics['optimizer/logical_batch_sha256'])}",
                f"optimizer_batch.expected_manifest_sha256={json.dumps(metrics['optimizer_batch/manifest_sha256'])}"]
        forced = ['model.routing="forced"', 'optimizer_batch.allow_config_differences=["model.routing"]',
                  f"optimizer_batch.routing_path={json.dumps(str(ws / 'source' / entry['path']))}",
                  f"optimizer_batch.routing_sha256={json.dumps(entry['sha256'])}"]
        sessions = {a: _session(ws, [*MOE, *pins, *(forced if a == "forced" else [])], a) for a in ARMS}
        for r in range(warmup + rounds):
            for a in ARMS[r % 3:] + ARMS[:r % 3]:
                w, c, loss = _update(*sessions[a])
                losses[a].add(loss)
                if r >= warmup:
                    wall[a].append(w)
                    cpu[a].append(c)
    # every arm reproduced the capture's loss in every update: the same update was timed
    assert all(v == {metrics["loss"]} for v in losses.values()), losses

    def paired(series: dict[str, list[float]], arm: str) -> list[float]:
        return [common.ratio(x, y) for x, y in zip(series[arm], series["unobserved"], strict=True)]

    judged = statistics.median(paired(cpu, "observed"))
    forced_cpu = statistics.median(paired(cpu, "forced"))
    wall_observed, wall_forced = statistics.median(paired(wall, "observed")), statistics.median(paired(wall, "forced"))
    med = {a: statistics.median(v) for a, v in cpu.items()}
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=judged,
        ratio_definition="median over rounds of (process CPU seconds of an update recording its routing, model.routing "
                         "= free) / (the same round's update with no routing observer attached)",
        baseline="the same capture's update in a session built without the routing observer (moe.attach "
                 "substituted), one update of each arm per round, rotating order",
        target=common.Target("<=", TARGET, judged),
        detail=(f"CPU per update observed {med['observed'] * 1e3:.1f} vs unobserved {med['unobserved'] * 1e3:.1f} ms; "
                f"forced {forced_cpu:.3f}x ({med['forced'] * 1e3:.1f} ms); wall paired observed {wall_observed:.3f}x, "
                f"forced {wall_forced:.3f}x"),
        measurements={**{f"cpu_{a}": common.stats(v) for a, v in cpu.items()},
                      **{f"wall_{a}": common.stats(v) for a, v in wall.items()},
                      "cpu_paired_observed": common.stats(paired(cpu, "observed")),
                      "cpu_paired_forced": common.stats(paired(cpu, "forced")),
                      "wall_paired_observed": common.stats(paired(wall, "observed")),
                      "wall_paired_forced": common.stats(paired(wall, "forced"))},
        parameters={"rounds": rounds, "warmup_rounds": warmup,
                    "model": "built-in tiny Qwen3-MoE (init defaults: 2 layers, 4 experts, top-2, 16 rows, "
                             "micro-batches of 4)"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
