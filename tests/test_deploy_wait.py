"""`replayjob argo wait WORKFLOW`: the reduce step's exit code (0/1/2/3) from a Workflow's status.

The Workflow status documents in tests/workflows/ are validated against the vendored Argo schemas,
then read by :func:`replayjob.deploy.workflow.workflow_code` directly and served by the Kubernetes
API emulator (tests/k8s_emulator.py) to the real kubernetes client behind the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_emulator import NS, Cluster, kubeconfig, serve
from kubernetes import client
from test_deploy_manifests import ARGO_VERSIONS, argo_errors

from replayjob.cli import main
from replayjob.deploy.submit import Api
from replayjob.deploy.workflow import wait_for_workflow, workflow_code

DOCS = Path(__file__).resolve().parent / "workflows"
NAME = "replayjob-ablation-7xk2p"
EXPECTED = {"succeeded.json": 0, "failed-gate.json": 1, "capture-failed.json": 2, "reduce-retried.json": 0,
            "reduce-error.json": 3, "deadline.json": 3}


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
def test_the_reduce_step_s_code_is_the_exit_code(name: str, code: int) -> None:
    got, line = workflow_code(load(name))
    assert got == code, line
    if name == "reduce-retried.json":
        assert "reduce(1) exited 0, attempt 2" in line  # the last attempt, not the first listed
    if name == "capture-failed.json":
        assert "verdict refused" in line
    if name == "deadline.json":
        assert "without a verdict: Max duration limit exceeded" in line


def test_a_verdict_without_a_reduce_node_and_offloaded_nodes() -> None:
    doc = load("failed-gate.json")
    doc["status"]["nodes"] = {}
    assert workflow_code(doc) == (1, "workflow Failed: verdict fail")
    doc["status"].pop("outputs")
    doc["status"]["offloadNodeStatusVersion"] = "fnv:123"
    code, line = workflow_code(doc)
    assert code == 3 and "offloaded" in line


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Cluster, str]]:
    state = Cluster()
    with serve(state) as host:
        path = tmp_path / "kubeconfig"
        path.write_text(kubeconfig(host), encoding="utf-8")
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield state, host


@pytest.mark.parametrize("name", ["failed-gate.json", "capture-failed.json", "reduce-error.json"])
def test_argo_wait_exits_with_the_reduce_step_s_code(emulator: tuple[Cluster, str], name: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    state, _ = emulator
    state.workflows[NAME] = [load(name)]
    assert main(["argo", "wait", NAME]) == EXPECTED[name]  # namespace: the kubeconfig context's
    assert f"exit {EXPECTED[name]}" in capsys.readouterr().out
    assert state.calls == [f"GET workflows {NAME}"]


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
