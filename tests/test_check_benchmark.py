"""The diag-diff benchmark runs end to end in its tiny --smoke mode (figures are not judged here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import diag_diff


def test_diag_diff_benchmark_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert diag_diff.main(["--smoke", "--results", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("diag_diff: ratio ") and "smoke run, target not assessed" in line
    doc = json.loads((tmp_path / "diag_diff.smoke.json").read_text())
    m = doc["measurements"]
    assert doc["mode"] == "smoke" and doc["target"] == {"metric": "ratio", "op": "<=", "value": 1.0,
                                                        "observed": doc["ratio"]}
    assert m["rows"] == 300 and m["leaves_per_row"] == 60 and m["planted_step"] == 298
    assert m["rows_diverging"] == 2 and m["first_divergence_leaves"] == 1
    assert m["msgspec_parse_cpu_s"]["n"] == 1  # the faster parser's own floor, reported beside the judged one


def test_generated_rows_have_the_requested_leaf_count(tmp_path: Path) -> None:
    _, _, _, per_row = diag_diff.write_pair(tmp_path, 3, 700)
    assert per_row == 700
