"""`replayjob argo wait WORKFLOW`: the reduce step's exit code (0/1/2/3) from a Workflow's status.

The Workflow status documents in tests/workflows/ are validated against the vendored Argo schemas,
then read by :func:`replayjob.launch.workflow.workflow_code` directly and served by the Kubernetes
API emulator (tests/k8s_emulator.py) to the real kubernetes client behind the CLI.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from k8s_emulator import NS, Cluster, kubeconfig, serve
from kubernetes import client
from test_deploy_manifests import ARGO_VERSIONS, argo_errors

from replayjob.artifacts.cluster_status import job_outcome, pod_codes
from replayjob.cli import main
from replayjob.errors import OperationalError
from replayjob.launch.submit import Api
from replayjob.launch.workflow import wait, wait_for_workflow, workflow_code

DOCS = Path(__file__).resolve().parent / "workflows"
NAME = "replayjob-ablation-7xk2p"
EXPECTED = {"succeeded.json": 0, "failed-gate.json": 1, "refused.json": 2, "capture-failed.json": 3,
            "reduce-retried.json": 0, "reduce-error.json": 3, "deadline.json": 3}


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DOCS / name).read_text(encoding="utf-8"))
    return doc


def test_the_status_documents_are_argo_workflows() -> None:
    names = sorted(p.name for p in DOCS.glob("*.json"))
    assert names == sorted([*EXPECTED, "running.json"])
    for name in names:
        for version in ARGO_VERSIONS:
            assert argo_errors(load(name), version) == [], (name, version)
    assert argo_errors({**load("succeeded.json"), "statuz": {}}, "v4.1.2")  # the check is strict


@pytest.mark.parametrize(("name", "code"), sorted(EXPECTED.items()))
def test_the_verdict_and_the_reduce_step_s_code_decide(name: str, code: int) -> None:
    got, line = workflow_code(load(name))
    assert got == code, line
    if name == "reduce-retried.json":
        assert "reduce(1) exited 0, attempt 2" in line  # the last attempt, not the first listed
    if name == "capture-failed.json":
        assert "exited 3" in line and "verdict incomplete (exit 3)" in line
    if name == "deadline.json":
        assert "without a verdict: Max duration limit exceeded" in line


def test_a_verdict_without_a_reduce_node_and_offloaded_nodes() -> None:
    doc = load("failed-gate.json")
    doc["status"]["nodes"] = {}
    assert workflow_code(doc) == (1, "workflow Failed: verdict fail (exit 1)")
    doc["status"].pop("outputs")
    doc["status"]["offloadNodeStatusVersion"] = "fnv:123"
    code, line = workflow_code(doc)
    assert code == 3 and "offloaded" in line


def verdict_of(doc: dict[str, Any]) -> dict[str, Any]:
    value = next(p["value"] for p in doc["status"]["outputs"]["parameters"] if p["name"] == "verdict")
    out: dict[str, Any] = json.loads(value)
    return out


def with_verdict(doc: dict[str, Any], value: str) -> dict[str, Any]:
    for p in doc["status"]["outputs"]["parameters"]:
        if p["name"] == "verdict":
            p["value"] = value
    return doc


def reduce_pods(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [n for n in doc["status"]["nodes"].values() if n.get("templateName") == "reduce" and n["type"] == "Pod"]


def forged(base: str, edit: Any) -> tuple[int, str]:
    doc = load(base)
    verdict = verdict_of(doc)
    text = edit(verdict)
    return workflow_code(with_verdict(doc, text if isinstance(text, str) else json.dumps(verdict)))


@pytest.mark.parametrize(("what", "base", "edit"), [
    ("exit_code false", "refused.json", lambda v: v.update(exit_code=False)),
    ("exit_code 0.0", "refused.json", lambda v: v.update(exit_code=0.0)),
    ("refused with exit_code 0", "refused.json", lambda v: v.update(exit_code=0)),
    ("a duplicated exit_code whose last value is 0", "refused.json",
     lambda v: json.dumps(v)[:-1] + ', "exit_code": 0}'),
    ("an unknown key", "succeeded.json", lambda v: v.update(trusted=True)),
    ("another schema", "succeeded.json", lambda v: v.update(schema="replayjob.verdict/v9")),
    ("a status its checks contradict", "failed-gate.json", lambda v: v.update(status="pass", exit_code=0)),
    ("not JSON", "succeeded.json", lambda v: "{not json"),
    ("a list", "succeeded.json", lambda v: "[0]"),
])
def test_a_forged_or_unreadable_verdict_is_never_a_pass(what: str, base: str, edit: Any) -> None:
    """An unreadable verdict is exit 3 naming the verdict and the pod's code, never the pod's 0 alone."""
    code, line = forged(base, edit)
    assert code == 3, (what, line)
    assert "the verdict cannot be read" in line and "exited" in line, line


def test_the_pod_s_code_and_the_verdict_must_agree() -> None:
    doc = load("succeeded.json")
    for pod in reduce_pods(doc):
        pod["outputs"]["exitCode"] = "1"
    code, line = workflow_code(doc)
    assert code == 3 and "exited 1" in line and "verdict pass (exit 0)" in line and "disagree" in line
    doc = load("refused.json")
    with_verdict(doc, json.dumps(verdict_of(load("succeeded.json"))))
    code, line = workflow_code(doc)  # a pass verdict beside a reducer that exited 2: not a pass
    assert code == 3 and "exited 2" in line and "disagree" in line
    doc = load("succeeded.json")  # the pod's 0 without a verdict decides nothing
    with_verdict(doc, "")
    code, line = workflow_code(doc)
    assert code == 3 and "without a verdict" in line and "exited 0" in line


def pod_node(template: str, n: int, phase: str, code: str | None) -> dict[str, Any]:
    return {"id": f"{template}-{n}", "name": f"{NAME}.{template}({n})", "displayName": f"{template}({n})",
            "type": "Pod", "templateName": template, "phase": phase,
            "outputs": {} if code is None else {"exitCode": code}}


@pytest.mark.parametrize(("phase", "code"), [("Failed", "0"), ("Error", "0"), ("Failed", None), ("Error", None),
                                             ("Running", None), ("Succeeded", "2")])
def test_a_reduce_pod_whose_phase_and_code_disagree_confirms_nothing(phase: str, code: str | None) -> None:
    """A reduce pod Argo calls Failed (or Error, or still Running) confirms no pass, whether it recorded a 0 or
    no code; one it calls Succeeded that exited 2 confirms no refusal either: 3, naming both (a pass verdict
    beside a failed reduce pod with no code was read alone, and beside a Failed pod with exit 0 as a pass)."""
    for base in ("succeeded.json", "refused.json"):
        doc = load(base)
        for pod in reduce_pods(doc):
            pod["phase"] = phase
            pod["outputs"].pop("exitCode")
            if code is not None:
                pod["outputs"]["exitCode"] = code
        got, line = workflow_code(doc)
        assert got == 3 and "disagree" in line and f"phase is {phase}" in line, (base, line)


def test_nodes_without_a_reduce_pod_leave_the_verdict_unconfirmed() -> None:
    """Listed node statuses without a pod that wrote the verdict: it comes from no step of this run, 3; only
    offloaded node statuses (none listed) leave the verdict alone to decide."""
    doc = load("succeeded.json")
    doc["status"]["nodes"] = {k: v for k, v in doc["status"]["nodes"].items() if v.get("templateName") != "reduce"}
    got, line = workflow_code(doc)
    assert got == 3 and "no reduce pod: no exit code to confirm the verdict pass" in line


@pytest.mark.parametrize(("reduce", "final", "base", "expected"), [
    (("Failed", "137"), ("Succeeded", "0"), "succeeded.json", 0),  # the exit handler's reduce decided it
    (("Failed", None), ("Failed", "2"), "refused.json", 2),
    (("Failed", "1"), ("Succeeded", "0"), "succeeded.json", 3),  # two reduces of one run decided differently
    (("Succeeded", "0"), ("Failed", "1"), "failed-gate.json", 3),
    (("Failed", "2"), ("Failed", "3"), "refused.json", 3),  # the exit handler's reduce wrote the verdict and errored
])
def test_the_exit_handler_s_reduce_is_the_witness_of_the_verdict_it_published(
        reduce: tuple[str, str | None], final: tuple[str, str | None], base: str, expected: int) -> None:
    """The exit handler's reduce (`final-verdict`) publishes the verdict after the reduce step: its pod is the
    witness, and a reduce step that decided (1 or 2) otherwise makes the run undecided."""
    doc = load(base)
    nodes = {k: v for k, v in doc["status"]["nodes"].items() if v.get("templateName") != "reduce"}
    nodes["reduce-0"] = pod_node("reduce", 0, *reduce)
    nodes["final-verdict-0"] = pod_node("final-verdict", 0, *final)
    doc["status"]["nodes"] = nodes
    got, line = workflow_code(doc)
    assert got == expected, line
    assert "final-verdict(0)" in line


@pytest.mark.parametrize(("what", "edit", "named"), [
    ("status a list", lambda d: d.update(status=[]), "status: expected `object | null`, got `array`"),
    ("nodes a list", lambda d: d["status"].update(nodes=[]), "status.nodes: expected `object | null`, got `array`"),
    ("a node a string", lambda d: d["status"]["nodes"].update(x="Pod"), "status.nodes.x: expected `object`, got `str`"),
    ("exitCode an int", lambda d: reduce_pods(d)[0]["outputs"].update(exitCode=0), "exitCode"),
    # only ASCII decimal digits: int() would read other scripts' digits and raise on these
    *[(f"exitCode {t!r}", lambda d, t=t: reduce_pods(d)[0]["outputs"].update(exitCode=t), "outputs.exitCode")
      for t in ("--1", "\u00b2", "\u0663", "\uff10", " 0", "0\n", "", "00", "-0", "01")],
    # which of two is the run's cannot be told (the first one that was not empty was read)
    ("the verdict listed twice",
     lambda d: d["status"]["outputs"]["parameters"].append({"name": "verdict", "value": ""}),
     "status.outputs.parameters: 'verdict' is listed 2 times"),
    ("phase an int", lambda d: d["status"].update(phase=3), "status.phase: expected `str | null`, got `int`"),
    ("parameters an object", lambda d: d["status"]["outputs"].update(parameters={}), "status.outputs.parameters"),
    ("a node a list", lambda d: d.clear() or d.update(status={"nodes": {"a": []}}),
     "status.nodes.a: expected `object`, got `array`"),
])
def test_a_malformed_status_is_exit_3_with_one_line_naming_it(what: str, edit: Any, named: str) -> None:
    doc = load("succeeded.json")
    edit(doc)
    with pytest.raises(OperationalError) as err:
        workflow_code(doc, NAME)
    assert named in err.value.message and f"workflow {NAME}: malformed status" in err.value.message, what
    assert "\n" not in err.value.message


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Cluster, str]]:
    state = Cluster()
    with serve(state) as host:
        path = tmp_path / "kubeconfig"
        path.write_text(kubeconfig(host), encoding="utf-8")
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield state, host


@pytest.mark.parametrize("name", ["failed-gate.json", "refused.json", "capture-failed.json", "reduce-error.json"])
def test_argo_wait_exits_with_the_reduce_step_s_code(emulator: tuple[Cluster, str], name: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    state, _ = emulator
    state.workflows[NAME] = [load(name)]
    assert main(["argo", "wait", NAME]) == EXPECTED[name]  # namespace: the kubeconfig context's
    assert f"exit {EXPECTED[name]}" in capsys.readouterr().out
    assert state.calls == [f"GET workflows {NAME}"]


def test_a_lone_surrogate_in_the_status_is_never_a_traceback(emulator: tuple[Cluster, str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A JSON `\\ud800` escape in the Workflow's answer is a lone surrogate in Python: in the verdict output it
    makes the verdict unreadable (3, named), in what ended the run it is named unreadable, and in a message that
    is printed it is shown escaped; it was a UnicodeEncodeError with a traceback."""
    doc = load("succeeded.json")
    with_verdict(doc, json.dumps(verdict_of(doc))[:-1] + ', "x": "\ud800"}')
    code, line = workflow_code(doc)
    assert code == 3 and "the verdict cannot be read" in line and "lone surrogate" in line, line
    doc = load("succeeded.json")
    doc["status"]["outputs"]["parameters"].append({"name": "ended", "value": "\ud800"})
    code, line = workflow_code(doc)
    assert code == 0 and "what ended the run cannot be read" in line, line
    state, _ = emulator
    doc = load("succeeded.json")
    with_verdict(doc, "")
    doc["status"]["message"] = "boom \ud800"
    state.workflows[NAME] = [doc]
    assert main(["argo", "wait", NAME]) == 3
    out = capsys.readouterr()
    assert "boom \\ud800" in out.out and "Traceback" not in out.err + out.out, out


def test_argo_wait_polls_until_the_workflow_ends(emulator: tuple[Cluster, str]) -> None:
    state, host = emulator
    state.workflows[NAME] = [load("running.json"), load("running.json"), load("reduce-retried.json")]
    lines: list[str] = []
    api = Api(client.ApiClient(client.Configuration(host=host)), backoff_s=0.001, sleep=lambda s: None,
              log=lines.append)
    assert wait_for_workflow(NAME, NS, api=api, poll_s=0, log=lines.append) == 0
    assert state.calls == [f"GET workflows {NAME}"] * 3
    assert lines[0] == f"argo wait: workflow {NAME}: Running (3/8)" and lines[1].startswith(
        f"argo wait: workflow {NAME}: Succeeded")
    assert lines[-1].endswith("exit 0")


def test_argo_wait_refuses_a_missing_workflow(emulator: tuple[Cluster, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["argo", "wait", "nope", "--namespace", NS]) == 2
    assert "no workflow nope" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "said"), [
    (["../../api/v1/secrets"], "workflow '../../api/v1/secrets' is not a name Kubernetes takes"),
    (["Not-A-Name"], "workflow 'Not-A-Name' is not a name"),
    ([NAME, "--namespace", "Bad NS"], "namespace 'Bad NS' is not a name"),
    ([NAME, "--namespace", ".."], "namespace '..' is not a name"),
])
def test_argo_wait_refuses_a_name_no_object_has_before_any_request(
        emulator: tuple[Cluster, str], capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    state, _ = emulator
    assert main(["argo", "wait", *argv]) == 2
    assert said in capsys.readouterr().err
    assert state.calls == []


def test_argo_wait_on_a_malformed_status_prints_one_line_and_no_traceback(
        emulator: tuple[Cluster, str], capsys: pytest.CaptureFixture[str]) -> None:
    state, _ = emulator
    doc = load("succeeded.json")
    doc["status"]["nodes"] = ["not", "a", "mapping"]
    state.workflows[NAME] = [doc]
    assert main(["argo", "wait", NAME]) == 3
    err = capsys.readouterr().err
    assert f"workflow {NAME}: malformed status: status.nodes" in err and "Traceback" not in err


def test_argo_wait_without_credentials_is_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["argo", "wait", NAME]) == 3
    assert "no Kubernetes credentials" in capsys.readouterr().err


def test_a_workflow_deleted_while_followed_and_a_403_are_3(emulator: tuple[Cluster, str]) -> None:
    state, host = emulator
    lines: list[str] = []
    api = Api(client.ApiClient(client.Configuration(host=host)), backoff_s=0.001, sleep=lambda s: None,
              log=lines.append)
    state.workflows[NAME] = [load("running.json"), {}]  # served once, then gone (404)
    with pytest.raises(OperationalError, match="deleted while it was followed"):
        wait_for_workflow(NAME, NS, api=api, poll_s=0, log=lines.append)
    state.forbidden.add(NAME)
    with pytest.raises(OperationalError, match="HTTP 403"):
        wait_for_workflow(NAME, NS, api=api, poll_s=0, log=lines.append)


def test_argo_wait_has_a_deadline_of_its_own(emulator: tuple[Cluster, str]) -> None:
    state, host = emulator
    state.workflows[NAME] = [load("running.json")]
    api = Api(client.ApiClient(client.Configuration(host=host)), backoff_s=0.001, sleep=lambda s: None,
              log=lambda s: None)
    with pytest.raises(OperationalError, match=r"still Running after 0\.5 s"):
        wait_for_workflow(NAME, NS, api=api, poll_s=0, log=lambda s: None, deadline_s=0.5)


def with_pending_pod(message: str) -> dict[str, Any]:
    doc = load("running.json")
    doc["status"]["nodes"]["replayjob-ablation-7xk2p-201"] = {
        "id": "replayjob-ablation-7xk2p-201", "name": "replayjob-ablation-7xk2p.replay(0:0)",
        "displayName": "replay(0:0)", "type": "Pod", "templateName": "replay", "phase": "Pending",
        "message": message, "boundaryID": "replayjob-ablation-7xk2p"}
    return doc


@pytest.mark.parametrize("message", ["Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                                     'ImagePullBackOff: Back-off pulling image "registry.example.org/rj@sha256:1"'])
def test_argo_wait_ends_a_wait_on_a_pod_that_cannot_start(emulator: tuple[Cluster, str], message: str) -> None:
    """A replay pod Pending for a reason that does not pass (no node, no image) for the grace period: exit 3
    naming the step, the reason and the message; it is reported as soon as it appears."""
    state, host = emulator
    doc = with_pending_pod(message)
    for version in ARGO_VERSIONS:
        assert argo_errors(doc, version) == [], version  # the shape Argo writes
    state.workflows[NAME] = [doc]
    lines: list[str] = []
    api = Api(client.ApiClient(client.Configuration(host=host)), backoff_s=0.001, sleep=lambda s: None,
              log=lines.append)
    reason, _, detail = message.partition(": ")
    with pytest.raises(OperationalError) as err:
        wait(lambda: api.call("get", api.custom.get_namespaced_custom_object, "argoproj.io", "v1alpha1", NS,
                              "workflows", NAME), poll_s=10, sleep=lambda s: None, log=lines.append, name=NAME,
             start_grace_s=60)
    assert f"step replay(0:0) (pod node replayjob-ablation-7xk2p-201): {reason}: {detail} for 60 s" in \
        err.value.message
    assert any(f"waiting: step replay(0:0) (pod node replayjob-ablation-7xk2p-201): {reason}" in ln for ln in lines)
    assert state.calls.count(f"GET workflows {NAME}") == 7  # first seen, then six polls of 10 s


def test_argo_wait_waits_for_a_pod_pending_only_briefly(emulator: tuple[Cluster, str]) -> None:
    state, host = emulator
    state.workflows[NAME] = [with_pending_pod("Unschedulable: 0/3 nodes are available"), load("running.json"),
                             load("reduce-retried.json")]
    api = Api(client.ApiClient(client.Configuration(host=host)), backoff_s=0.001, sleep=lambda s: None,
              log=lambda s: None)
    assert wait_for_workflow(NAME, NS, api=api, poll_s=0, log=lambda s: None) == 0


def test_the_line_names_what_ended_the_run_as_the_exit_handler_recorded_it() -> None:
    """A stopped workflow's exit handler recorded what ended the run (the global output ``ended``,
    replayjob.artifacts.run_end) beside the verdict it wrote: `argo wait` names both; a record that cannot
    be read is named too, and never changes the code, which the verdict and the reducer decide."""
    from replayjob.artifacts.run_end import run_end

    record = run_end("Failed", json.dumps([{"displayName": "replay(0:0)", "templateName": "replay",
                                            "phase": "Failed", "message": "Stopped with strategy 'Stop'"}]))
    doc = load("failed-gate.json")
    doc["status"]["outputs"]["parameters"].append({"name": "ended", "value": json.dumps(record)})
    code, line = workflow_code(doc)
    assert code == 1 and line.endswith("verdict fail (exit 1); the workflow ended Failed: it was stopped "
                                       "(Stopped with strategy 'Stop')"), line
    doc["status"]["outputs"]["parameters"][-1]["value"] = json.dumps({**record, "cause": "bored"})
    code, line = workflow_code(doc)
    assert code == 1 and "what ended the run cannot be read" in line and "cause" in line
    late = load("deadline.json")  # no verdict at all: 3, and the record still says why
    late["status"]["outputs"] = {"parameters": [{"name": "ended", "value": json.dumps(record)}]}
    code, line = workflow_code(late)
    assert code == 3 and "without a verdict" in line and line.endswith("it was stopped (Stopped with strategy 'Stop')")


# ------------------------------------------------------------------- step verdict (Slurm's submit.sh --wait)
def verdict_text(name: str) -> str:
    doc = load(name)
    value: str = next(p["value"] for p in doc["status"]["outputs"]["parameters"] if p["name"] == "verdict")
    return value


@pytest.mark.parametrize(("name", "code", "expected"), [
    ("succeeded.json", 0, 0), ("failed-gate.json", 1, 1), ("refused.json", 2, 2),
    ("succeeded.json", 1, 3), ("failed-gate.json", 0, 3), ("refused.json", 0, 3), ("succeeded.json", 3, 3),
])
def test_step_verdict_is_the_reducer_s_code_confirmed_by_its_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, code: int, expected: int) -> None:
    """The launcher's outcome of a run whose reducer it saw end with ``code``: the code when RUN/verdict.json
    says the same, 3 when the two disagree (never the reducer's 0 beside a verdict that is not a pass)."""
    (tmp_path / "verdict.json").write_text(verdict_text(name), encoding="utf-8")
    assert main(["step", "verdict", "--run-dir", str(tmp_path), "--code", str(code)]) == expected
    out = capsys.readouterr()
    assert "Traceback" not in out.err and ("disagree" in out.err) == (expected == 3)


@pytest.mark.parametrize("what", ["missing", "a link", "forged into a pass", "a duplicated exit_code", "not JSON"])
def test_step_verdict_without_a_readable_verdict_decides_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str) -> None:
    path = tmp_path / "verdict.json"
    refused = json.loads(verdict_text("refused.json"))
    if what == "a link":
        (tmp_path / "elsewhere.json").write_text(verdict_text("succeeded.json"), encoding="utf-8")
        path.symlink_to(tmp_path / "elsewhere.json")
    elif what == "forged into a pass":
        path.write_text(json.dumps({**refused, "status": "pass", "exit_code": 0}), encoding="utf-8")
    elif what == "a duplicated exit_code":
        path.write_text(json.dumps(refused)[:-1] + ', "exit_code": 0}', encoding="utf-8")
    elif what == "not JSON":
        path.write_text("{not json", encoding="utf-8")
    assert main(["step", "verdict", "--run-dir", str(tmp_path), "--code", "0"]) == 3
    err = capsys.readouterr().err
    assert "nothing decided" in err and "Traceback" not in err, err
    assert ("no verdict" in err) == (what == "missing")


def test_step_verdict_code_is_a_process_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("256", "-1", "0x0", "one"):
        assert main(["step", "verdict", "--run-dir", str(tmp_path), "--code", bad]) == 2
        assert "--code" in capsys.readouterr().err


def _confirm(run: Path, code: int, replayjob: list[str]) -> subprocess.CompletedProcess[str]:
    """scripts/slurm/lib.sh's confirm_verdict, as submit.sh --wait calls it, with ``replayjob`` as the command."""
    lib = REPO / "scripts" / "slurm" / "lib.sh"
    script = (f'set -euo pipefail; . {shlex.quote(str(lib))}; REPLAYJOB=({" ".join(map(shlex.quote, replayjob))}); '
              f'outcome=0; confirm_verdict {shlex.quote(str(run))} {code} || outcome=$?; echo "outcome=$outcome"')
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("name", "code", "expected"), [
    ("succeeded.json", 0, 0), ("failed-gate.json", 1, 1), ("refused.json", 2, 2), ("succeeded.json", 1, 3)])
def test_submit_takes_the_outcome_step_verdict_confirms(tmp_path: Path, name: str, code: int, expected: int) -> None:
    (tmp_path / "verdict.json").write_text(verdict_text(name), encoding="utf-8")
    res = _confirm(tmp_path, code, [sys.executable, "-m", "replayjob"])
    assert res.stdout.splitlines()[-1] == f"outcome={expected}", res.stdout + res.stderr
    assert "replayjob step verdict: outcome" not in res.stdout  # the confirmation is read, not shown


@pytest.mark.parametrize("stand_in", [
    # an image whose replayjob predates `step verdict`: docopt's usage error, exit 2 ("refused" if taken as is)
    'echo "Usage: replayjob reduce ..." >&2; exit 2',
    'echo "replayjob step verdict: outcome 0"; exit 1',  # says one outcome, exits another
    'echo "replayjob step verdict: outcome 0"; kill -9 $$',  # a signal after the line
    "exit 0",  # a runtime that ran nothing
])
def test_submit_decides_nothing_when_step_verdict_does_not_confirm(tmp_path: Path, stand_in: str) -> None:
    (tmp_path / "verdict.json").write_text(verdict_text("succeeded.json"), encoding="utf-8")
    fake = tmp_path / "replayjob"
    fake.write_text(f"#!/usr/bin/env bash\n{stand_in}\n")
    fake.chmod(0o755)
    res = _confirm(tmp_path, 0, [str(fake)])
    assert res.stdout.splitlines()[-1] == "outcome=3", res.stdout + res.stderr
    assert "without confirming its outcome" in res.stderr and "nothing was decided" in res.stderr


def _pods(*codes: int) -> dict[str, Any]:
    return {"items": [{"metadata": {"name": f"reduce-{i}"}, "status": {"containerStatuses": [
        {"name": "replayjob", "state": {"terminated": {"exitCode": c}}}]}} for i, c in enumerate(codes)]}


@pytest.mark.parametrize(("state", "codes", "expected"), [
    ("Complete", (0,), 0), ("Complete", (3, 0), 0), ("Complete", (137, 0), 0),  # a retried attempt, then a pass
    ("Complete", (1, 0), 3), ("Complete", (0, 2), 3),  # the policy fails the Job on 1 or 2: it cannot be complete
    ("Complete", (1,), 3), ("Complete", (2,), 3),
    ("Failed", (1,), 1), ("Failed", (3, 2), 2), ("Failed", (3,), 3), ("Failed", (0,), None),
])
def test_a_complete_job_beside_an_attempt_that_decided_otherwise_decides_nothing(
        state: str, codes: tuple[int, ...], expected: int | None) -> None:
    """A Job the API calls Complete whose pods include an attempt that exited 1 or 2 contradicts the rendered
    podFailurePolicy (FailJob on a final status): 3, as argo wait reads two reduces that decided differently.  A
    pass was read from it whenever some attempt exited 0."""
    assert job_outcome(state, pod_codes(_pods(*codes), "reduce"))[0] == expected
