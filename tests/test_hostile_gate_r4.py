"""Hostile inputs to the gate's outputs and outcome readers: what `reduce` writes where, and what the
launchers take from a verdict (each test fails without the rule it names)."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from replayjob.cli import main
from replayjob.gate import synthetic
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY

OFF, ON = "baseline", "gradient_checkpointing=true"


@pytest.fixture
def ev(tmp_path: Path) -> synthetic.Evidence:
    return synthetic.build(tmp_path / "ev", {OFF: {}, ON: {GC_KEY: True}}, 3)


def reduce(ev: synthetic.Evidence, out: Path, *extra: str) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        code = main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--out", str(out),
                     "--source", str(ev.source), "--baseline", OFF, *extra])
    return code, err.getvalue()


def _plant(path: Path, kind: str, target: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link":
        path.symlink_to(target)
    else:  # a link to nothing
        path.symlink_to(target.parent / "nothing-here.json")


@pytest.mark.parametrize("kind", ["fifo", "directory", "link", "dangling link"])
@pytest.mark.parametrize("which", ["--out", "--report", "plot", "layers plot"])
def test_an_output_path_that_is_no_regular_file_is_refused_before_anything_is_written(
        ev: synthetic.Evidence, tmp_path: Path, kind: str, which: str) -> None:
    """`--out` or `--report` (or a plot beside it) naming a FIFO, a directory or a link (to a file, or to
    nothing) is refused (2) before the first output is written: a FIFO, directory or dangling link at `--out`
    was checked only when the verdict was written, after the report and its plot, which were left behind
    without a verdict."""
    d = tmp_path / "o"
    d.mkdir()
    out, report = d / "verdict.json", d / "report.md"
    planted = {"--out": out, "--report": report, "plot": d / "report.png", "layers plot": d / "report.layers.png"}
    target = d.parent / "elsewhere.json"
    target.write_text("{}", encoding="utf-8")
    _plant(planted[which], kind, target)
    before = sorted(p.name for p in d.iterdir())
    code, err = reduce(ev, out, "--report", str(report))
    assert code == 2, err
    assert "not a regular file" in err and "Traceback" not in err, err
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written, nothing replaced
    assert target.read_text(encoding="utf-8") == "{}"


def test_an_output_under_a_regular_file_is_refused_before_the_report_is_written(
        ev: synthetic.Evidence, tmp_path: Path) -> None:
    """`--out` below a regular file cannot be written: refused (2) before the report is, not after it."""
    d = tmp_path / "o"
    d.mkdir()
    (d / "file").write_text("x", encoding="utf-8")
    code, err = reduce(ev, d / "file" / "verdict.json", "--report", str(d / "report.md"))
    assert code == 2 and "cannot be written" in err and "Traceback" not in err, err
    assert sorted(p.name for p in d.iterdir()) == ["file"]
