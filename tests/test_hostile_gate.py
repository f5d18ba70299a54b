"""Hostile inputs to the gate's outputs and outcome readers: what `reduce` writes where, and what the
launchers take from a verdict (each test fails without the rule it names)."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-1", "1e400", " 5", "\u0663", "1_0", "5s", "3e9"])
def test_a_wait_s_seconds_setting_outside_its_range_is_refused(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`REPLAYJOB_START_GRACE_S` (argo wait, the driver) and `REPLAYJOB_POLL_S` (the driver) are finite numbers of
    seconds in range, else refused (2) naming the variable: `nan` turned the grace period off, a negative one
    ended every wait at once, and a poll of `nan` or `-1` s stopped the driver with a traceback (exit 3)."""
    from replayjob.errors import ConfigError
    from replayjob.launch import k8s_driver
    from replayjob.launch.submit import START_GRACE_ENV, env_seconds
    from replayjob.launch.workflow import wait_for_workflow

    with pytest.raises(ConfigError) as err:
        env_seconds({START_GRACE_ENV: text}, START_GRACE_ENV, 300.0)
    assert START_GRACE_ENV in err.value.message and err.value.exit_code == 2
    assert env_seconds({START_GRACE_ENV: ""}, START_GRACE_ENV, 300.0) == 300.0
    assert env_seconds({START_GRACE_ENV: "0"}, START_GRACE_ENV, 300.0) == 0.0
    assert env_seconds({k8s_driver.POLL_ENV: "0.25"}, k8s_driver.POLL_ENV, 10.0, minimum=0.001) == 0.25
    with pytest.raises(ConfigError):
        env_seconds({k8s_driver.POLL_ENV: "0"}, k8s_driver.POLL_ENV, 10.0, minimum=0.001)

    class NoApi:  # the setting is refused before the API is read
        default_namespace = "ns"

        def call(self, *a: object, **k: object) -> None:
            raise AssertionError("read the API")

    monkeypatch.setenv(START_GRACE_ENV, text)
    with pytest.raises(ConfigError):
        wait_for_workflow("wf", "ns", api=NoApi(), log=lambda s: None)


def test_the_reduce_step_publishes_the_verdict_it_wrote_not_a_second_read(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`step reduce --outputs` (Argo's verdict output) publishes the bytes the reducer wrote, whatever the run
    directory's `verdict.json` holds by then (it was read back from the shared volume, so a file replaced in
    between, by another pod on the claim, was published instead)."""
    import json

    from replayjob.artifacts.spec import load_spec
    from replayjob.gate import reducer
    from replayjob.jsonio import pretty_bytes
    from replayjob.launch import step

    repo = Path(__file__).resolve().parents[1]
    planted = json.loads((repo / "tests" / "workflows" / "succeeded.json").read_text(encoding="utf-8"))
    passing = next(p["value"] for p in planted["status"]["outputs"]["parameters"] if p["name"] == "verdict")
    real = reducer.reduce_evidence

    def then_replaced(req: reducer.Request) -> object:
        written = real(req)
        req.out.write_text(passing, encoding="utf-8")  # another writer, after the reducer's own write
        return written

    monkeypatch.setattr(reducer, "reduce_evidence", then_replaced)
    spec = step.select(load_spec(str(repo / "examples" / "ablation.toml")), None, None, None, None)
    layout = step.layout_for(spec, str(tmp_path / "run"), None, None)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    verdict = step.reduce_step(spec, layout, outputs=outputs, log=lambda s: None)
    assert verdict.status == "incomplete"  # a run stopped before its capture
    assert (outputs / "verdict.json").read_bytes() == pretty_bytes(verdict.doc)


@pytest.mark.parametrize(("status", "said"), [
    ({"status": {"conditions": [{"type": [], "status": "True"}]}}, "status.conditions[0].type: expected `str`"),
    ({"status": {"conditions": [{"type": "Completed"}]}}, "object missing required field `status`"),
    ({"spec": {"suspend": "yes"}, "status": {}}, "spec.suspend: expected `bool | null`, got `str`"),
    ({"spec": [], "status": {}}, "spec: expected `object | null`, got `array`"),
    ({"status": {"conditions": [{"type": "Completed", "status": "True"}, {"type": "Failed", "status": "True"}]}},
     "both Completed and Failed are true"),
])
def test_a_jobset_s_status_is_read_through_the_job_status_declaration(status: Any, said: str) -> None:
    """A JobSet (a run across nodes) is followed through the same declared status reader as a Job: a condition
    whose type is no string, one without a status, a `suspend` that is no boolean or a `spec` that is no object
    is exit 3 naming the JobSet and the field (an unhashable type was a traceback, `suspend = "yes"` read as
    suspended and a malformed spec as none)."""
    from replayjob.artifacts.cluster_status import job_end
    from replayjob.errors import OperationalError

    with pytest.raises(OperationalError) as err:
        job_end(status, "run-r1-replay-a", kind="jobset")
    assert err.value.exit_code == 3 and "jobset run-r1-replay-a: malformed status" in err.value.message
    assert said in err.value.message, err.value.message
    ok = {"spec": {"suspend": False}, "status": {"conditions": [
        {"type": "StartupPolicyCompleted", "status": "True"}, {"type": "Completed", "status": "True",
                                                               "reason": "AllJobsCompleted"}]}}
    assert job_end(ok, "j", kind="jobset") == ("Complete", "AllJobsCompleted", False)


@pytest.mark.parametrize("blocks", [None, 2])
@pytest.mark.parametrize("planted", ["fifo", "directory", "malformed", "malformed after a good replay",
                                     "fifo after a good replay", "directory after a good replay"])
def test_a_malformed_replay_beside_missing_ones_is_refused_not_incomplete(
        tmp_path: Path, planted: str, blocks: int | None, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`step reduce` over a run whose replays are partly missing and partly malformed (a FIFO, a directory or
    invalid JSON where replay_metrics.json should be) refuses (2): the refusal of evidence that is there stands.
    It was `incomplete` (3, retryable), the malformed replay counted among the missing ones or the refusal
    taken for missing evidence because it stopped the reduce before any replay was read.  A look over blocks
    (`--blocks`, the funnel's) reads the same: a FIFO or a directory there is not left out as missing."""
    import json
    import shutil

    from replayjob.artifacts.spec import DETERMINISM_ENV
    from replayjob.launch import step

    for key, value in DETERMINISM_ENV.items():  # the step pins them in this process: restored after the test
        monkeypatch.setenv(key, value)
    for key in (step.IMAGE_ENV, step.DIGEST_ENV, "REPLAYJOB_RENDERED"):
        monkeypatch.delenv(key, raising=False)
    spec = tmp_path / "ablation.toml"
    spec.write_text('name = "unit"\nimage = "replayjob:dev"\ngpu_product = "none"\ndevice = "cpu"\nrepeats = 2\n\n'
                    '[arms.ckpt-off]\n\n[arms.ckpt-on]\n"backend.options.gradient_checkpointing" = true\n',
                    encoding="utf-8")
    ev = synthetic.build(tmp_path / "ev", {"ckpt-off": {}, "ckpt-on": {GC_KEY: True}}, 2)
    run = tmp_path / "run"
    shutil.copytree(ev.source, run / "source")
    shutil.copytree(ev.root / "init_resume", run / "init_resume")
    bad = run / "replays" / "ckpt-off" / "0"
    if planted.endswith("after a good replay"):
        shutil.copytree(ev.root / "replays" / "ckpt-off" / "repeat-000", bad)
        bad = run / "replays" / "ckpt-on" / "0"
    bad.mkdir(parents=True)
    metrics = bad / "replay_metrics.json"
    if planted.startswith("fifo"):
        os.mkfifo(metrics)
    elif planted.startswith("directory"):
        metrics.mkdir()
    else:
        metrics.write_text("{not json", encoding="utf-8")
    look = [] if blocks is None else ["--blocks", str(blocks)]
    assert main(["step", "reduce", "--spec", str(spec), "--run-dir", str(run), *look]) == 2
    err = capsys.readouterr().err
    assert "nothing decided" not in err and "Traceback" not in err, err
    verdict = json.loads((run / "verdict.json").read_text(encoding="utf-8"))
    assert (verdict["status"], verdict["exit_code"]) == ("refused", 2) and "missing" not in verdict
    assert verdict["refusal"] is not None
