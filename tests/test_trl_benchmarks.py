"""The TRL benchmarks' smoke runs (benchmarks/trl_capture_overhead.py, benchmarks/trl_precision_floor.py): each
runs, prints its one line and writes its result document, so neither rots.  Smoke figures are never judged."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the TRL benchmarks need the 'trl' extra: pip install -e '.[trl]'")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trl_capture_overhead", "trl_precision_floor"])
def test_smoke_run_writes_one_line_and_its_result(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  fresh_determinism_mode: None) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--smoke", "--results", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: ratio ") and "target not assessed" in lines[0], lines
    doc = json.loads((tmp_path / f"{name}.smoke.json").read_text())
    assert doc["mode"] == "smoke" and doc["target_met"] is None
    assert isinstance(doc["ratio"], float) and math.isfinite(doc["ratio"]) and doc["ratio"] > 0
    if name == "trl_precision_floor":  # both precisions measured, each with the dtype its capture recorded
        per = doc["measurements"]["grpo"]
        assert (per["fp32"]["compute_dtype"], per["bf16"]["compute_dtype"]) == ("float32", "bfloat16")
    else:
        assert doc["measurements"]["captured_step_ratio"]["values"]
