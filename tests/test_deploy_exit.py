"""Always a verdict, and what ended the run: the Argo workflow's exit handler.

A workflow that ends otherwise than ``Succeeded`` (a reducer pod failed for good, ``argo stop``, the
workflow's deadline) runs its exit handler, whose one step is ``replayjob step reduce ... --ended
{{workflow.status}} --failures {{workflow.failures}}``: it records what ended the run in
``RUN/ended.json`` (published as the global output ``ended``) and reduces what the run left, so the
verdict (the global output ``verdict``) is there for ``replayjob argo wait``.  The record's
classification is checked on the failure lists Argo writes; the step runs for real (a subprocess)
over a run stopped before its capture; the template is checked in the rendered workflow (its schema
validation is tests/test_deploy_manifests.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replayjob.artifacts import run_end
from replayjob.artifacts.spec import load_spec_text
from replayjob.errors import IntegrityError
from replayjob.launch import argo

REPO = Path(__file__).resolve().parents[1]


def node(template: str, message: str, name: str = "", phase: str = "Failed") -> dict[str, str]:
    return {"displayName": name or f"{template}(0)", "templateName": template, "phase": phase, "message": message,
            "podName": "p", "finishedAt": "2026-12-07T00:00:00Z"}


@pytest.mark.parametrize(("status", "failures", "cause", "line"), [
    ("Failed", [node("reduce", "Error (exit code 3)")], "failed",
     "the workflow ended Failed: stage reduce (reduce(0)) failed: Error (exit code 3)"),
    ("Failed", [node("replay", "Stopped with strategy 'Stop'", "replay(3:3)"), node("capture", "Error (exit code 1)")],
     "stopped", "the workflow ended Failed: it was stopped (Stopped with strategy 'Stop')"),
    ("Failed", [node("replay", "workflow shutdown with strategy:  Stop")], "stopped",
     "the workflow ended Failed: it was stopped (workflow shutdown with strategy:  Stop)"),
    ("Failed", [node("replay", "Step exceeded its deadline", "replay(0:0)")], "deadline",
     "the workflow ended Failed: a deadline ended replay(0:0) (Step exceeded its deadline)"),
    ("Failed", [node("capture", "Pod was active on the node longer than the specified deadline", "capture")],
     "deadline", "the workflow ended Failed: a deadline ended capture (Pod was active on the node longer than the "
                 "specified deadline)"),
    ("Failed", [node("replay", "OOMKilled (exit code 137)"), node("reduce", "Error (exit code 3)")], "failed",
     "the workflow ended Failed: stage replay (replay(0)) failed: OOMKilled (exit code 137) (and 1 more failed node)"),
    ("Error", [], "error", "the workflow ended Error and names no failed node (a controller error)"),
])
def test_the_record_names_what_ended_the_run(status: str, failures: list[dict[str, str]], cause: str,
                                             line: str, tmp_path: Path) -> None:
    doc = run_end.run_end(status, json.dumps(failures))
    assert (doc["cause"], doc["line"], doc["exit_code"]) == (cause, line, 3)
    assert [n["template"] for n in doc["failed"]] == [n["templateName"] for n in failures]
    record = run_end.write_run_end(tmp_path / "ended.json", doc)
    assert run_end.read_run_end(tmp_path / "ended.json") == record


def test_failures_that_are_not_argo_s_list_are_kept_as_text(tmp_path: Path) -> None:
    doc = run_end.run_end("Failed", "{{workflow.failures}}")  # a controller that substituted nothing
    assert doc["cause"] == "error" and "its failures are not a list of nodes: '{{workflow.failures}}'" in doc["line"]
    (tmp_path / "ended.json").write_text(json.dumps({**doc, "exit_code": 0}))
    with pytest.raises(IntegrityError, match="exit_code"):
        run_end.read_run_end(tmp_path / "ended.json")


@pytest.mark.parametrize("text", ["Error\nstage reduce passed", "exit\u202e3 edoc", "\x1b[2Kcleared", "\ud800"])
def test_what_argo_hands_over_is_recorded_as_one_printable_line(text: str, tmp_path: Path) -> None:
    """A node's message (often a pod's own termination message), name or the workflow's status holding a line break,
    a bidi or terminal control or a lone surrogate: kept escaped, so the printed line is one line of what was said
    (a newline printed a line of its own; a lone surrogate left the record unwritable); a record whose line is not
    printable is refused by the reader."""
    for doc in (run_end.run_end("Failed", json.dumps([node("reduce", text, name=text)])),
                run_end.run_end(text, "not json " + text)):
        record = run_end.write_run_end(tmp_path / "ended.json", doc)
        assert record.line.isprintable() and record.workflow_status.isprintable(), record.line
        assert run_end.read_run_end(tmp_path / "ended.json") == record
    (tmp_path / "ended.json").write_text(json.dumps({**doc, "line": "the workflow ended\nFailed"}))
    with pytest.raises(IntegrityError, match="line"):
        run_end.read_run_end(tmp_path / "ended.json")


def test_the_exit_handler_records_what_ended_the_run_and_publishes_it() -> None:
    spec, text = load_spec_text(REPO / "examples" / "ablation.toml")
    template = argo.workflow_template(spec, text)["spec"]
    assert template["onExit"] == argo.ON_EXIT
    by_name = {t["name"]: t for t in template["templates"]}
    assert by_name[argo.ON_EXIT]["steps"] == [[{"name": argo.FINAL, "template": argo.FINAL,
                                               "when": "{{workflow.status}} != Succeeded"}]]
    command = by_name[argo.FINAL]["container"]["command"]
    assert command[:3] == ["replayjob", "step", "reduce"]
    assert command[-4:] == ["--ended", "{{workflow.status}}", "--failures", "{{workflow.failures}}"]
    outputs = {p["name"]: p for p in by_name[argo.FINAL]["outputs"]["parameters"]}
    assert outputs["ended"]["globalName"] == "ended" and outputs["verdict"]["globalName"] == "verdict"
    assert outputs["ended"]["valueFrom"]["path"].endswith("/" + run_end.RUN_END_FILE)
    assert "--ended" not in by_name["reduce"]["container"]["command"]  # the DAG's reducer: a run that ran


def test_a_run_stopped_before_its_capture_still_ends_with_a_verdict_and_its_cause(tmp_path: Path) -> None:
    run, outputs = tmp_path / "run", tmp_path / "outputs"
    outputs.mkdir()
    failures = json.dumps([node("capture", "Stopped with strategy 'Stop'", "capture")])
    proc = subprocess.run([sys.executable, "-m", "replayjob", "step", "reduce", "--spec",
                           str(REPO / "examples" / "ablation.toml"), "--run-dir", str(run), "--outputs", str(outputs),
                           "--ended", "Failed", "--failures", failures], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # incomplete: nothing was decided
    assert "the workflow ended Failed: it was stopped (Stopped with strategy 'Stop')" in proc.stdout
    record = run_end.read_run_end(run / run_end.RUN_END_FILE)
    assert (record.cause, record.workflow_status, [n.template for n in record.failed]) == ("stopped", "Failed",
                                                                                           ["capture"])
    assert (outputs / run_end.RUN_END_FILE).read_bytes() == (run / run_end.RUN_END_FILE).read_bytes()
    verdict = json.loads((outputs / "verdict.json").read_text())
    assert verdict["exit_code"] == 3 and verdict == json.loads((run / "verdict.json").read_text())
