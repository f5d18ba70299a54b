"""`replayjob k8s submit`: the real kubernetes client against an HTTP emulator on loopback.

No cluster exists here.  The emulator below answers the handful of API calls submit makes (create a
PVC, create a Job, read a Job's status, list a Job's pods) with Kubernetes-shaped JSON, and plays
the Job controller by finishing each Job with an exit code the test scripts.  The requests, their
paths and bodies, and the client's (de)serialisation are real.
"""

from __future__ import annotations

import dataclasses
import itertools
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
from replayjob.deploy.ablation import Arm, load_spec_text
from replayjob.deploy.submit import Api, submit
from replayjob.errors import ArtifactExistsError, OperationalError

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "ablation.toml"
NS = "ablation-ns"


class Cluster:
    """State of the emulated API server: created objects, the order of calls, scripted outcomes."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[str] = []
        self.exit_codes: dict[str, int] = {}  # job stage (capture, replay, reduce) -> exit code (default 0)
        self.reads: dict[str, int] = {}
        self.running_reads = 1  # status reads that still answer "running"
        self.unavailable = 0  # status reads answered 503 first (the API server restarting)
        self.lock = threading.Lock()

    @staticmethod
    def stage(name: str) -> str:
        return name.rsplit("-", 1)[1]

    def job_status(self, name: str) -> dict[str, Any]:
        self.reads[name] = self.reads.get(name, 0) + 1
        if self.reads[name] <= self.running_reads:
            return {"active": 1}
        code = self.exit_codes.get(self.stage(name), 0)
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
                    if cluster.unavailable > 0:
                        cluster.unavailable -= 1
                        self.reply(503, {"kind": "Status", "code": 503, "reason": "ServiceUnavailable"})
                        return
                    job = dict(cluster.objects[("Job", name)])
                    self.reply(200, {**job, "status": cluster.job_status(name)})
                    return
                if parts[-1] == "pods":
                    selector = parse_qs(url.query)["labelSelector"][0]
                    name = selector.split("=", 1)[1]
                    assert selector.startswith("batch.kubernetes.io/job-name=")
                    cluster.calls.append(f"GET pods {name}")
                    terminated = {"exitCode": cluster.exit_codes.get(cluster.stage(name), 0), "reason": "Error"}
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
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": NS}}]}),
        encoding="utf-8")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api = client.ApiClient(client.Configuration(host=host))
    yield state, api
    api.close()
    server.shutdown()
    server.server_close()


def fast_api(api: client.ApiClient) -> Api:
    return Api(api, backoff_s=0.001, log=lambda s: None)


def test_wait_creates_stage_by_stage_and_bodies_are_the_rendered_manifests(
        cluster: tuple[Cluster, client.ApiClient]) -> None:
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    assert submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r1") == 0
    creates = [c for c in state.calls if c.startswith("POST")]
    assert creates == ["POST configmaps replayjob-ablation-r1-spec", "POST persistentvolumeclaims replayjob-artifacts",
                       "POST jobs replayjob-ablation-r1-capture", "POST jobs replayjob-ablation-r1-replay",
                       "POST jobs replayjob-ablation-r1-reduce"]
    calls = state.calls
    done = {name: max(i for i, c in enumerate(calls) if c == f"GET status {name}") for name in state.reads}
    assert calls.index("POST jobs replayjob-ablation-r1-replay") > done["replayjob-ablation-r1-capture"]
    assert calls.index("POST jobs replayjob-ablation-r1-reduce") > done["replayjob-ablation-r1-replay"]
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in k8s.render(spec, text, "r1").values()
                if "metadata" in d}
    for key, body in state.objects.items():
        expected = json.loads(json.dumps(rendered[key]))
        if key[0] == "Job":
            assert body["spec"].pop("suspend") is False  # created when its stage's turn has come
            expected["spec"].pop("suspend", None)
            labels = body["spec"]["template"]["metadata"]["labels"]
            assert labels[k8s.RUN_ID_LABEL] == "r1"  # the pods' run directory comes from this label
        assert body == expected, key


@pytest.mark.parametrize(("failing", "code", "expected_exit", "message", "created"), [
    ("reduce", 1, 1, "exit 1: a negative verdict", ["capture", "replay", "reduce"]),
    ("capture", 2, 2, "exit 2: refused input", ["capture"]),
    ("capture", 3, 3, "exit 3: an error on every attempt", ["capture"]),
    ("reduce", 137, 3, "BackoffLimitExceeded", ["capture", "replay", "reduce"]),
    ("replay", 2, 0, "the reducer judges the missing replays", ["capture", "replay", "reduce"]),
])
def test_cli_exit_code_follows_the_failed_job(cluster: tuple[Cluster, client.ApiClient], failing: str,
                                              code: int, expected_exit: int, message: str, created: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    state, _ = cluster
    state.running_reads = 0  # the CLI polls every 10 s; the emulated Jobs finish at once
    state.exit_codes[failing] = code
    assert main(["k8s", "submit", str(SPEC), "--wait"]) == expected_exit  # namespace: the context's
    captured = capsys.readouterr()
    assert message in captured.err + captured.out
    assert [Cluster.stage(c.split()[-1]) for c in state.calls if c.startswith("POST jobs")] == created


def test_each_submission_is_its_own_run(cluster: tuple[Cluster, client.ApiClient],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    state, api = cluster
    state.running_reads = 0
    assert main(["k8s", "submit", str(SPEC)]) == 0
    assert main(["k8s", "submit", str(SPEC)]) == 0
    jobs = [c.split()[-1] for c in state.calls if c.startswith("POST jobs")]
    assert len(jobs) == 6 and len({j.rsplit("-", 1)[0] for j in jobs}) == 2  # two run ids
    assert not any(c.startswith("GET status") and c.endswith("-reduce") for c in state.calls)  # no --wait
    spec, text = load_spec_text(SPEC)
    with pytest.raises(ArtifactExistsError, match="already exists"):  # a run id is never reused
        submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None,
               run_id=jobs[0].split("-")[-2])


def test_api_errors_are_retried_with_backoff_then_give_exit_3(cluster: tuple[Cluster, client.ApiClient]) -> None:
    state, api = cluster
    state.running_reads = 0
    state.unavailable = 3
    spec, text = load_spec_text(SPEC)
    log: list[str] = []
    sleeps: list[float] = []
    retrying = Api(api, backoff_s=0.5, sleep=sleeps.append, log=log.append)
    assert submit(spec, text, NS, wait=True, api=retrying, poll_s=0.001, log=log.append, run_id="r2") == 0
    assert sleeps[:3] == [0.5, 1.0, 2.0] and sum("HTTP 503; retrying" in line for line in log) == 3
    state.unavailable = 100
    with pytest.raises(OperationalError, match="HTTP 503") as exc:
        submit(spec, text, NS, wait=True, api=Api(api, tries=3, backoff_s=0.001, log=lambda s: None),
               poll_s=0.001, log=lambda s: None, run_id="r3")
    assert exc.value.exit_code == 3


def test_submit_without_credentials_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["k8s", "submit", str(SPEC)]) == 2
    assert "no Kubernetes credentials" in capsys.readouterr().err


def test_replay_jobs_of_each_rank_count_run_one_after_another(cluster: tuple[Cluster, client.ApiClient]) -> None:
    """Arms of different rank counts: one replay Job per count, each created after the one before ended
    (however it ended), so the spec's parallelism bounds every replay at once; then the reducer."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    spec = dataclasses.replace(spec, ranks=2, config={"distributed.strategy": "ddp"}, arms=(
        Arm("two"), Arm("one", {"distributed.world_size": 1}), Arm("four", {"distributed.world_size": 4})))
    state.exit_codes["r1"] = 2  # the 1-rank replays fail for good: the others still run, the reducer judges
    logs: list[str] = []
    assert submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=logs.append, run_id="r9") == 0
    jobs = [c.split()[-1].removeprefix("replayjob-ablation-r9-") for c in state.calls if c.startswith("POST jobs")]
    assert jobs == ["capture", "replay-r1", "replay-r2", "replay-r4", "reduce"]
    calls = state.calls
    for before, after in itertools.pairwise(jobs):
        last_read = max(i for i, c in enumerate(calls) if c == f"GET status replayjob-ablation-r9-{before}")
        assert calls.index(f"POST jobs replayjob-ablation-r9-{after}") > last_read
    assert any("replay-r1 failed" in line and "the reducer judges the missing replays" in line for line in logs)
    gpus = {n: state.objects[("Job", f"replayjob-ablation-r9-{n}")]["spec"]["template"]["spec"]["containers"][0]
            ["resources"]["limits"][k8s.GPU_RESOURCE] for n in jobs if n != "reduce"}
    assert gpus == {"capture": "2", "replay-r1": "1", "replay-r2": "2", "replay-r4": "4"}
