"""`replayjob k8s submit`: the real kubernetes client against an HTTP emulator on loopback.

No cluster exists here.  The emulator below answers the handful of API calls submit makes (create a
PVC, create a Job, read a Job's status, list a Job's pods) with Kubernetes-shaped JSON, and plays
the Job controller by finishing each Job with an exit code the test scripts.  The requests, their
paths and bodies, and the client's (de)serialisation are real.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from replayjob.cli import main
from replayjob.deploy import k8s
from replayjob.deploy.ablation import load_spec
from replayjob.deploy.submit import submit

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "ablation.toml"
NS = "ablation-ns"


class Cluster:
    """State of the emulated API server: created objects, the order of calls, scripted outcomes."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[str] = []
        self.exit_codes: dict[str, int] = {}  # job name -> its container's exit code (default 0)
        self.reads: dict[str, int] = {}
        self.running_reads = 1  # status reads that still answer "running"
        self.lock = threading.Lock()

    def job_status(self, name: str) -> dict[str, Any]:
        self.reads[name] = self.reads.get(name, 0) + 1
        if self.reads[name] <= self.running_reads:
            return {"active": 1}
        code = self.exit_codes.get(name, 0)
        if code == 0:
            return {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        reason = "PodFailurePolicy" if code in (1, 2) else "BackoffLimitExceeded"
        return {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": reason}]}


def handler_for(cluster: Cluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            parts = urlparse(self.path).path.strip("/").split("/")
            assert parts[-3:-1] == ["namespaces", NS], self.path
            key = (body["kind"], body["metadata"]["name"])
            with cluster.lock:
                cluster.calls.append(f"POST {parts[-1]} {key[1]}")
                if key in cluster.objects:
                    self.reply(409, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                     "reason": "AlreadyExists", "code": 409})
                    return
                cluster.objects[key] = body
            self.reply(201, body)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            with cluster.lock:
                if parts[-1] == "status" and parts[-3] == "jobs":
                    name = parts[-2]
                    cluster.calls.append(f"GET status {name}")
                    job = dict(cluster.objects[("Job", name)])
                    self.reply(200, {**job, "status": cluster.job_status(name)})
                    return
                if parts[-1] == "pods":
                    selector = parse_qs(url.query)["labelSelector"][0]
                    name = selector.split("=", 1)[1]
                    assert selector.startswith("batch.kubernetes.io/job-name=")
                    cluster.calls.append(f"GET pods {name}")
                    terminated = {"exitCode": cluster.exit_codes.get(name, 0), "reason": "Error"}
                    status = {"name": "replayjob", "image": "replayjob:0.1.0", "imageID": "", "ready": False,
                              "restartCount": 0, "state": {"terminated": terminated}}
                    pod = {"metadata": {"name": f"{name}-0"}, "status": {"containerStatuses": [status]}}
                    self.reply(200, {"kind": "PodList", "apiVersion": "v1", "items": [pod]})
                    return
            self.reply(404, {"kind": "Status", "code": 404})

    return Handler


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Cluster, client.ApiClient]]:
    state = Cluster()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host = f"http://127.0.0.1:{server.server_address[1]}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": host}}],
        "users": [{"name": "emu", "user": {"token": "emulator"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}]}), encoding="utf-8")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api = client.ApiClient(client.Configuration(host=host))
    yield state, api
    api.close()
    server.shutdown()
    server.server_close()


def test_wait_creates_stage_by_stage_and_bodies_are_the_rendered_manifests(
        cluster: tuple[Cluster, client.ApiClient]) -> None:
    state, api = cluster
    spec = load_spec(SPEC)
    assert submit(spec, NS, wait=True, api_client=api, poll_s=0.01, log=lambda s: None) == 0
    creates = [c for c in state.calls if c.startswith("POST")]
    assert creates == ["POST persistentvolumeclaims replayjob-artifacts", "POST jobs replayjob-ablation-capture",
                       "POST jobs replayjob-ablation-replay-ckpt-off", "POST jobs replayjob-ablation-replay-ckpt-on",
                       "POST jobs replayjob-ablation-reduce"]
    calls = state.calls
    done = {name: max(i for i, c in enumerate(calls) if c == f"GET status {name}") for name in state.reads}
    assert calls.index("POST jobs replayjob-ablation-replay-ckpt-off") > done["replayjob-ablation-capture"]
    assert calls.index("POST jobs replayjob-ablation-reduce") > max(
        done["replayjob-ablation-replay-ckpt-off"], done["replayjob-ablation-replay-ckpt-on"])
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in k8s.render(spec).values() if "metadata" in d}
    for key, body in state.objects.items():
        assert body == json.loads(json.dumps(rendered[key])), key


@pytest.mark.parametrize(("failing", "code", "expected_exit", "message"), [
    ("replayjob-ablation-reduce", 1, 1, "exit 1: a negative verdict"),
    ("replayjob-ablation-capture", 2, 2, "exit 2: refused input"),
    ("replayjob-ablation-replay-ckpt-off", 3, 3, "exit 3: an error on every attempt"),
    ("replayjob-ablation-replay-ckpt-on", 137, 3, "BackoffLimitExceeded"),
])
def test_cli_exit_code_follows_the_failed_job(cluster: tuple[Cluster, client.ApiClient], failing: str,
                                              code: int, expected_exit: int, message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    state, _ = cluster
    state.running_reads = 0  # the CLI polls every 10 s; the emulated Jobs finish at once
    state.exit_codes[failing] = code
    assert main(["k8s", "submit", str(SPEC), "--namespace", NS, "--wait"]) == expected_exit
    assert message in capsys.readouterr().err
    created = [c.split()[-1] for c in state.calls if c.startswith("POST jobs")]
    if failing.endswith("capture"):
        assert created == ["replayjob-ablation-capture"]
    assert ("replayjob-ablation-reduce" in created) is failing.endswith("reduce")


def test_without_wait_everything_is_created_at_once_and_duplicates_are_refused(
        cluster: tuple[Cluster, client.ApiClient], capsys: pytest.CaptureFixture[str]) -> None:
    state, _ = cluster
    assert main(["k8s", "submit", str(SPEC), "--namespace", NS]) == 0
    assert not any(c.startswith("GET") for c in state.calls)
    assert len([c for c in state.calls if c.startswith("POST jobs")]) == 4
    capsys.readouterr()
    assert main(["k8s", "submit", str(SPEC), "--namespace", NS]) == 2  # the PVC is kept, the Job exists
    assert "Job replayjob-ablation-capture already exists" in capsys.readouterr().err


def test_submit_without_credentials_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["k8s", "submit", str(SPEC)]) == 2
    assert "no Kubernetes credentials" in capsys.readouterr().err
