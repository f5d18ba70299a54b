"""Every benchmark's ``--smoke`` mode runs and writes a valid result; nothing here asserts a time.

The Python benchmarks run in-process (their models and imports are already warm in the test
session) with ``--results`` in a temporary directory; ``reduce_many``'s smoke run is covered by
the reducer's own tests.  ``gpu_ablation.sh`` is checked with ``--dry-run`` (the full GPU plan),
shellcheck where it is installed; its ``--tiny`` whole chain on CPU (fresh processes) runs inside
``scripts/gpu/check.sh --cpu`` (tests/test_gpu_check.py), which checks its figures.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import common

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_ablation.sh"
# funnel_intervals is not smoke-run here: it is two whole funnels (about a minute even at one block each),
# whose every part tests/test_funnel.py runs; its command is in benchmarks/README.md
SMOKE = ["capture_overhead", "verify_throughput", "cli_startup", "diag_diff", "bundle_recompute", "ring_overhead",
         "trace_overhead", "mismatch_recompute", "inprocess_spread", "moe_routing"]


def check_result(path: Path, name: str, *, smoke: bool) -> dict[str, object]:
    doc = json.loads(path.read_text())
    assert doc["schema"] == common.SCHEMA and doc["benchmark"] == name
    assert doc["mode"] == ("smoke" if smoke else "full")
    assert isinstance(doc["ratio"], float) and math.isfinite(doc["ratio"]) and doc["ratio"] > 0
    assert doc["target"]["op"] in ("<=", ">=") and isinstance(doc["target"]["value"], int | float)
    assert doc["target_met"] is None if smoke else isinstance(doc["target_met"], bool)
    assert doc["ratio_definition"] and doc["baseline"] and isinstance(doc["measurements"], dict)
    assert doc["machine"]["logical_cores"] >= 1 and doc["machine"]["summary"]
    return doc


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOKE)
def test_smoke_mode_runs_and_writes_one_line_and_json(name: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--smoke", "--results", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: ratio "), lines
    assert "smoke run, target not assessed" in lines[0]
    doc = check_result(tmp_path / f"{name}.smoke.json", name, smoke=True)
    if name == "capture_overhead":  # "on" really captured every step, and the loss did not change
        assert doc["measurements"]["bundle_capture_written"] is True  # type: ignore[index]
        assert doc["measurements"]["steady_bundles_per_run"] == [2]  # type: ignore[index]  # 2 steps x 1 update
        for key in ("steady_cpu_paired_ratio_interval", "steady_cpu_ratio_interval", "steady_cpu_total_ratio_interval"):
            interval = doc["measurements"][key]  # type: ignore[index]
            assert 0 < interval["low"] <= interval["high"], key
        assert doc["notes"] == []


def test_pair_bootstrap_cancels_drift_shared_by_a_pair() -> None:
    """Runs drift between two regimes (about 0.19 and 0.28 CPU s a step, as measured here); each pair runs
    in one regime and "on" costs 3% more.  Resampling pairs keeps the effect and drops the drift."""
    import numpy as np

    from benchmarks.capture_overhead import pair_bootstrap, pair_median_ratio, pooled_median_ratio, total_ratio

    rng = np.random.RandomState(1)
    regimes = [0.19 if (i // 5) % 2 else 0.28 for i in range(30)]
    off = [[r * (1 + 0.01 * rng.randn()) for _ in range(4)] for r in regimes]
    on = [[r * 1.03 * (1 + 0.01 * rng.randn()) for _ in range(4)] for r in regimes]
    shuffled = [list(r) for r in np.roll(np.array(off), 7, axis=0)]  # pairs broken: runs of different regimes
    for statistic in (pair_median_ratio, pooled_median_ratio, total_ratio):
        low, high = pair_bootstrap(on, off, statistic=statistic, resamples=500)
        assert 1.0 < low <= high < 1.06 and low - 0.005 < 1.03 < high + 0.005, (statistic.__name__, low, high)
        low2, high2 = pair_bootstrap(on, shuffled, statistic=statistic, resamples=500)
        assert high2 - low2 > 3 * (high - low), statistic.__name__
    with pytest.raises(ValueError, match="as many"):
        pair_bootstrap(on, off[:-1])


def test_cpu_added_by_thread_splits_the_process_figure() -> None:
    """Pairs whose 'on' run adds 2 ms to the training thread, 1 ms to the writer and 2 ms to the
    other threads, on a drift the pair shares: the split reads those back (each part is its own
    median over pairs, so on real, varying runs the parts need not add up to the process figure)."""
    from benchmarks.capture_overhead import cpu_added_by_thread

    def run(base: float, train: float, writer: float, other: float) -> dict[str, list[float]]:
        return {"training_cpu_s": [base + train] * 4, "writer_cpu_s": [writer] * 4,
                "cpu_s": [2 * base + train + writer + other] * 4}

    on = [run(0.1 + k / 100, 0.002, 0.001, 0.002) for k in range(5)]
    off = [run(0.1 + k / 100, 0.0, 0.0, 0.0) for k in range(5)]
    added = cpu_added_by_thread(on, off)
    assert {k: round(v * 1e3, 6) for k, v in added.items()} == {"process": 5.0, "training": 2.0, "writer": 1.0,
                                                                "other": 2.0}


def test_gpu_ablation_dry_run_prints_the_whole_gpu_plan(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    replays = [line for line in lines if " -m replayjob replay " in line]
    assert len(replays) == 10
    assert sum("optimizer_batch.arm=\\\"ckpt-on\\\"" in line for line in replays) == 5
    assert all("model.dtype=\\\"bfloat16\\\"" in line and "cuda:0" in line for line in replays)
    assert sum(" -m replayjob capture " in line for line in lines) == 1
    assert sum(" -m replayjob reduce " in line for line in lines) == 2
    assert not (tmp_path / "run").exists()  # a dry run creates nothing


def test_gpu_ablation_refuses_bad_options() -> None:
    for argv in (["--repeats", "0"], ["--device", "cpu"], ["--bogus"]):
        proc = subprocess.run(["bash", str(SCRIPT), *argv, "--dry-run"], capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 2, argv


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_gpu_ablation_is_shellcheck_clean() -> None:
    proc = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout


