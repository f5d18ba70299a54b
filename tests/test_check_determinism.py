"""determinism-check: any command via --command (fast, real subprocesses of a small trainer stand-in),
the workstation script, and two end-to-end runs of the source trainer (0 as is, 1 with the
nondeterministic observation)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from replayjob.check.determinism_check import REPORT_FILE
from replayjob.cli import main

REPO = Path(__file__).resolve().parents[1]

# A stand-in trainer: writes OUT/diag.jsonl; "drift" makes step 1 depend on how many runs came before.
FAKE_TRAINER = """\
import json, pathlib, sys, time
out, mode, counter = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
if mode == "fail":
    print("loading data\\nboom: the data directory is empty", file=sys.stderr)
    sys.exit(3)
if mode == "nodiag":
    sys.exit(0)
rows = [{"step": i, "loss": 1.0 / (i + 1), "timing": {"elapsed_s": time.perf_counter()},
         "provenance": {"math_mode": "pedantic", "strict_deterministic": True}} for i in range(4)]
if mode == "drift":
    rows[1]["loss"] += n
    rows[2]["loss"] += 2 * n
(out / "diag.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
"""


def command(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    counter = tmp_path / f"counter-{mode}"
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{out}} {mode} {shlex.quote(str(counter))}"


def test_command_deterministic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check"
    assert main(["determinism-check", "--command", command(tmp_path, "same"), "--runs", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("determinism-check DETERMINISTIC: 3 runs; math mode pedantic, strict_deterministic=true")
    assert "run_2 vs run_0: equal (4 rows compared)" in text
    doc = json.loads((out / REPORT_FILE).read_text())
    assert doc["deterministic"] is True and len(doc["runs"]) == 3 and len(doc["diffs"]) == 2
    assert (out / "run_1" / "diag.jsonl").is_file() and (out / "run_1.stderr.log").is_file()


def test_command_drift_names_first_divergent_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check"
    assert main(["determinism-check", "--command", command(tmp_path, "drift"), "--out", str(out), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["deterministic"] is False
    first = doc["diffs"][0]["first_divergence"]
    assert first["step"] == 1 and first["top"][0]["path"] == "loss"
    assert [r["step"] for r in doc["diffs"][0]["first_diverging_rows"]] == [1, 2]


def test_failed_run_reports_status_and_stderr_tail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check"
    # the run exits 3 (an error, nothing decided): so does the check, which stays retryable
    assert main(["determinism-check", "--command", command(tmp_path, "fail"), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "run 1 of 2 exited with status 3" in err and "boom: the data directory is empty" in err
    assert not (out / REPORT_FILE).exists()


def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["determinism-check", "--command", command(tmp_path, "nodiag"), "--out", str(tmp_path / "a")]) == 2
    assert "wrote no diag.jsonl" in capsys.readouterr().err
    assert main(["determinism-check", "--command", "true", "--out", str(tmp_path / "b")]) == 2
    assert "must contain {out}" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    assert main(["determinism-check", "--command", command(tmp_path, "same"), "--out", str(busy)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["determinism-check", "--command", command(tmp_path, "same"), "--runs", "1"]) == 2
    # a bad config is refused before any run starts
    out = tmp_path / "c"
    config = tmp_path / "train.toml"
    config.write_text('[training]\ntrainer = "grpo"\nseed = 1\n')
    assert main(["determinism-check", str(config), "--out", str(out),
                 "--set", "training.trainer=optimizer_replay"]) == 2
    assert "runs the source trainer" in capsys.readouterr().err and not out.exists()
    assert main(["determinism-check", str(config), "--out", str(out), "--ignore", " "]) == 2
    assert not out.exists()


def test_bad_math_mode_refused_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "train.toml"
    config.write_text('[training]\ntrainer = "grpo"\nseed = 1\n[backend.options]\nstrict_deterministic = true\n')
    monkeypatch.setenv("REPLAYJOB_MATH_MODE", "prod")  # TF32 is refused under strict determinism
    out = tmp_path / "c"
    assert main(["determinism-check", str(config), "--out", str(out)]) == 2
    assert "REPLAYJOB_MATH_MODE=prod allows TF32" in capsys.readouterr().err and not out.exists()


def test_workstation_script(tmp_path: Path) -> None:
    script = REPO / "scripts" / "determinism-check.sh"
    for mode, code in (("same", 0), ("drift", 1)):
        proc = subprocess.run(["bash", str(script), "--command", command(tmp_path, mode),
                               "--out", str(tmp_path / mode)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == code, proc.stderr
    assert "first divergent row: step 1" in proc.stdout


@pytest.fixture(scope="module")
def deterministic_check(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """The source trainer twice on the tiny default, REPLAYJOB_MATH_MODE=default (inherited by both runs)."""
    out = tmp_path_factory.mktemp("detcheck") / "check"
    old = os.environ.get("REPLAYJOB_MATH_MODE")
    os.environ["REPLAYJOB_MATH_MODE"] = "default"
    try:
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(["determinism-check", str(workspace / "train.toml"), "--steps", "2", "--out", str(out)])
    finally:
        if old is None:
            os.environ.pop("REPLAYJOB_MATH_MODE", None)
        else:
            os.environ["REPLAYJOB_MATH_MODE"] = old
    return code, buf.getvalue(), out


@pytest.mark.slow
def test_source_trainer_is_deterministic(deterministic_check: tuple[int, str, Path]) -> None:
    code, text, out = deterministic_check
    assert code == 0, text
    assert "DETERMINISTIC: 2 runs; math mode default, strict_deterministic=true" in text
    doc = json.loads((out / REPORT_FILE).read_text())
    assert doc["provenance"]["math_mode"] == "default"
    assert doc["diffs"][0]["rows_compared"] == 2
    rows = [json.loads(line) for line in (out / "run_1" / "diag.jsonl").read_text().splitlines()]
    assert all(r["provenance"]["math_mode"] == "default" for r in rows)  # recorded in every row


@pytest.mark.slow
def test_signals_on_a_real_two_step_run(deterministic_check: tuple[int, str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = deterministic_check[2] / "run_0"
    assert main(["signals", str(run)]) == 2  # the default slope rule needs 3 rows
    assert "'reward_mean_rising' needs at least 3 rows with reward.mean, found 2" in capsys.readouterr().err
    rules = tmp_path / "short.toml"
    rules.write_text('[[signal]]\nname = "loss_finite"\nleaf = "loss.policy"\nreducer = "max"\nkill_above = 1e6\n'
                     '[[consistency]]\nname = "loss_matches"\nleaf = "loss.policy"\nsummary = "metrics.json"\n'
                     'field = "loss"\nwarn_above = 1e-9\n')
    assert main(["signals", str(run), "--rules", str(rules), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == "signals OK"


@pytest.mark.slow
def test_nondeterministic_observation_is_drift(workspace: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["determinism-check", str(workspace / "train.toml"), "--steps", "1", "--out", str(tmp_path / "c"),
                 "--set", "environment.nondeterministic_observation=true"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "run_1 vs run_0: drift from step 0" in text
    assert "first divergent row: step 0 (line 1 / 1)" in text


def _shared_diag(tmp_path: Path) -> Path:
    shared = tmp_path / "shared.jsonl"
    shared.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n')
    return shared


@pytest.mark.parametrize("link, message", [
    ("ln -s", "left diag.jsonl as a symbolic link to"),  # both runs read the one shared file: DETERMINISTIC
    ("ln", "are one file (hard links)"),
])
def test_linked_diag_files_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], link: str,
                                   message: str) -> None:
    shared = _shared_diag(tmp_path)
    out = tmp_path / "check"
    assert main(["determinism-check", "--command", f"{link} {shlex.quote(str(shared))} {{out}}/diag.jsonl",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "diag.jsonl" in err and "Traceback" not in err and "fix:" in err
    assert not (out / REPORT_FILE).exists()


def test_linked_run_directory_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = _shared_diag(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.link(shared, elsewhere / "diag.jsonl")
    out = tmp_path / "check"
    assert main(["determinism-check", "--command", f"rmdir {{out}} && ln -s {shlex.quote(str(elsewhere))} {{out}}",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'run_0' is a symbolic link" in err and not (out / REPORT_FILE).exists()


def test_earlier_run_file_replaced_by_a_link_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the second run links the first run's file to its own: checked again once every run is done
    shared = _shared_diag(tmp_path)
    out = tmp_path / "check"
    cmd = (f"cp {shlex.quote(str(shared))} {{out}}/diag.jsonl && if [ $(basename {{out}}) = run_1 ]; "
           f"then ln -sf {{out}}/diag.jsonl {{out}}/../run_0/diag.jsonl; fi")
    assert main(["determinism-check", "--command", cmd, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "run 1 of 2 left diag.jsonl as a symbolic link" in err and not (out / REPORT_FILE).exists()


def test_diag_file_in_a_run_directory_is_not_followed(tmp_path: Path) -> None:
    """signals reads a run directory's diag.jsonl without following a link; one named directly may be."""
    from replayjob.check.rows import iter_rows
    from replayjob.errors import IntegrityError
    shared = _shared_diag(tmp_path)
    link = tmp_path / "link.jsonl"
    os.symlink(shared, link)
    assert len(list(iter_rows(link))) == 2
    with pytest.raises(IntegrityError, match="symbolic link"):
        list(iter_rows(link, follow_symlinks=False))


def test_an_out_directory_that_cannot_be_created_is_refused_without_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--out below a regular file: mkdir's NotADirectoryError was a traceback (exit 3, "retrying may help")."""
    f = tmp_path / "notes.txt"
    f.write_text("x")
    rc = main(["determinism-check", "--command", command(tmp_path, "same"), "--out", str(f / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "cannot create the --out directory" in err and str(f) in err
    assert f.read_text() == "x"


@pytest.mark.parametrize(("provenance", "shown"), [
    ('{"math_mode": "pedantic", "strict_deterministic": NaN}', "math mode pedantic, strict_deterministic=NaN"),
    ('{"math_mode": "pedantic", "nested": [Infinity]}', "math mode pedantic"),
    ('{"math_mode": "pedantic\\ndeterminism-check DRIFT: 9 runs"}',
     'math mode "pedantic\\ndeterminism-check DRIFT: 9 runs"'),
])
def test_a_run_s_provenance_is_reported_as_strict_json_on_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], provenance: str, shown: str) -> None:
    """The first row's provenance is copied into the report: a NaN in it made the report unwritable (exit 2,
    "cannot write JSON", no report), a newline in its math mode printed a verdict line of its own."""
    script = tmp_path / "writer.py"
    script.write_text("import os, sys\nos.makedirs(sys.argv[1], exist_ok=True)\n"
                      "open(os.path.join(sys.argv[1], 'diag.jsonl'), 'w').write(sys.argv[2] + '\\n')\n")
    row = '{"step": 0, "x": 1, "provenance": ' + provenance + "}"
    out = tmp_path / "check"
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{out}} {shlex.quote(row)}"
    assert main(["determinism-check", "--command", cmd, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == f"determinism-check DETERMINISTIC: 2 runs; {shown}"

    def refuse(name: str) -> None:
        raise AssertionError(f"non-strict JSON literal {name}")

    doc = json.loads((out / REPORT_FILE).read_text(), parse_constant=refuse)
    assert doc["deterministic"] is True
