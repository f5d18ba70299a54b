"""The Python half of ``benchmarks/gpu_ablation.sh``: a mid-size initialisation state, and the summary.

``init-state DIR CONFIG --set ...`` writes an initialisation resume state (``trainer_state.json``
step -1 and the seeded LoRA adapter) for the model the overrides describe, the same way
``replayjob init`` does for the built-in default.  Capture and replay check the model reference in
that state, so the state must be built with exactly the model settings they use.

``summarize OUT`` reads only artifacts: the capture's ``diag.jsonl`` (the source step's own
forward, backward and optimizer seconds), every ``replay_metrics.json`` under ``OUT/replays``, the
per-process wall times the script recorded in ``OUT/process_wall.tsv`` and the reducer's verdict,
and writes the benchmark JSON.  Per arm: median, min, max and interquartile range of the replay's
update seconds (``local_train_wall_s``), of the whole replay process, and of peak memory.

Ratio: median ``local_train_wall_s`` of the baseline arm / the source step's forward + backward +
optimizer seconds (the replay harness around the very same update; a replay's update is the first
GPU work in its process, the source's follows sampling).  Target: the whole script within 480 s
on one H200 (8 minutes, one command).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "gpu_ablation"
BUDGET_S = 480.0


def init_state(directory: Path, config: Path, sets: list[str]) -> Path:
    """Write ``directory`` as an initialisation state (step -1) for the model ``config`` + ``sets`` build."""
    from replayjob.config import load_config
    from replayjob.errors import ArtifactExistsError
    from replayjob.model.backend import load_backend
    from replayjob.rl.state import write_state
    from replayjob.runtime import determinism

    if (directory / "trainer_state.json").exists():
        raise ArtifactExistsError("an initial resume state already exists", where=directory)
    cfg = load_config(config, [*sets, "resume.from=\"\""])
    strict = cfg.backend.options.strict_deterministic
    determinism.establish(strict=strict, seed=cfg.training.seed)
    policy = load_backend(cfg.backend.name).build(cfg)
    determinism.mark_model_built(strict)
    policy.save_adapter(directory)
    write_state(directory, -1, policy.model_reference(), {})
    params = sum(p.numel() for p in policy.model.parameters())
    trainable = sum(p.numel() for _, p in policy.trainable())
    print(f"initial state {directory}: {params:,} parameters, {trainable:,} trainable (LoRA)")
    return directory


def _read(path: Path) -> dict[str, Any]:
    from replayjob.jsonio import read_json_object

    return read_json_object(path)


def _process_walls(out: Path) -> dict[str, list[float]]:
    walls: dict[str, list[float]] = {}
    tsv = out / "process_wall.tsv"
    if tsv.is_file():
        for line in tsv.read_text().splitlines():
            phase, seconds = line.split("\t")
            walls.setdefault(phase, []).append(float(seconds))
    return walls


def summarize(out: Path, *, baseline: str, smoke: bool, results: Path, total_s: float,
              verdict_codes: dict[str, int]) -> Path:
    """Write the benchmark JSON for the run in ``out`` and print its one summary line."""
    from replayjob.artifacts import metrics as M
    from replayjob.jsonio import loads_strict

    diag = (out / "source" / "diag.jsonl").read_bytes().splitlines()
    t = loads_strict(diag[0])["timing"]
    raw_s = float(t["forward_wall_s"]) + float(t["backward_wall_s"]) + float(t["optimizer_wall_s"])
    replays = [_read(p) for p in sorted((out / "replays").rglob(M.REPLAY_FILE))]
    if not replays:
        raise SystemExit(f"no {M.REPLAY_FILE} under {out / 'replays'}")
    walls = _process_walls(out)
    devices = sorted({str(r["device"]) for r in replays})
    if any(d.startswith("cuda") for d in devices):
        import torch  # noqa: F401  (so that the machine description names the GPU)
    arms: dict[str, Any] = {}
    for arm in sorted({r["arm"] for r in replays}):
        rs = [r for r in replays if r["arm"] == arm]
        fbo = [r["timing"]["forward_wall_s"] + r["timing"]["backward_wall_s"] + r["timing"]["optimizer_wall_s"]
               for r in rs]
        arms[arm] = {
            "n": len(rs),
            "local_train_wall_s": common.stats([r["timing"]["local_train_wall_s"] for r in rs]),
            "forward_backward_optimizer_s": common.stats(fbo),
            "replay_wall_s": common.stats([r["wall_s"] for r in rs]),
            "process_wall_s": common.stats(walls[f"replay {arm}"]) if f"replay {arm}" in walls else None,
            "peak_memory_bytes": common.stats([float(r["memory"]["peak_bytes"]) for r in rs]),
            "memory_kind": rs[0]["memory"]["kind"],
            "gradient_checkpointing": sorted({r["runtime"]["backend.options.gradient_checkpointing"] for r in rs}),
            "losses": sorted({r["loss"] for r in rs}),
            "final_adapters": sorted({r[M.FINAL_ADAPTER] for r in rs}),
        }
    if baseline not in arms:
        raise SystemExit(f"baseline arm {baseline!r} not among the replays' arms {sorted(arms)}")
    value = common.ratio(arms[baseline]["local_train_wall_s"]["median"], raw_s)
    notes = [] if smoke else ["whole-run budget assumes one H200; other GPUs are recorded in machine"]
    detail = "; ".join(
        f"{a} update {v['local_train_wall_s']['median']:.3f} s (IQR {v['local_train_wall_s']['iqr']:.3f}), "
        f"peak {v['peak_memory_bytes']['median'] / 2**30:.2f} GiB" for a, v in arms.items())
    return common.report(
        NAME, smoke=smoke, results=results, ratio_value=value,
        ratio_definition=f"median replay local_train_wall_s of arm {baseline!r} / the source step's "
                         "forward + backward + optimizer seconds (diag.jsonl)",
        baseline="the same step's forward + backward + optimizer seconds inside the source trainer",
        target=common.Target("<=", BUDGET_S, total_s, metric="whole run (s)"),
        detail=f"raw step {raw_s:.3f} s; {detail}; verdicts {verdict_codes}; total {total_s:.0f} s",
        measurements={"raw_step_s": raw_s, "source_timing": t, "arms": arms, "devices": devices,
                      "process_wall_s": {k: common.stats(v) for k, v in walls.items()},
                      "verdict_exit_codes": verdict_codes, "total_s": total_s},
        parameters={"out": str(out), "baseline_arm": baseline, "budget_s": BUDGET_S}, notes=notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else NAME)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init-state", help="write an initialisation state for the configured model")
    i.add_argument("directory", type=Path)
    i.add_argument("config", type=Path)
    i.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    s = sub.add_parser("summarize", help="summarise a finished run directory")
    s.add_argument("out", type=Path)
    s.add_argument("--baseline", default="ckpt-off")
    s.add_argument("--smoke", action="store_true")
    s.add_argument("--results", type=Path, default=common.RESULTS_DIR)
    s.add_argument("--total-s", type=float, required=True)
    s.add_argument("--verdict", action="append", default=[], metavar="CLAIM=CODE")
    args = p.parse_args(argv)
    if args.cmd == "init-state":
        init_state(args.directory, args.config, args.sets)
        return 0
    codes = {k: int(v) for k, v in (item.split("=", 1) for item in args.verdict)}
    summarize(args.out, baseline=args.baseline, smoke=args.smoke, results=args.results, total_s=args.total_s,
              verdict_codes=codes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
