"""`replayjob k8s submit|resume` and the in-cluster driver: the real kubernetes client against an HTTP
emulator on loopback.

No cluster exists here.  The emulator (tests/k8s_emulator.py) answers the API calls replayjob makes
(read the setup, create a ConfigMap and Jobs, read and patch them, read a Job's status and pods) with
Kubernetes-shaped JSON, assigns every created object a uid, and plays the Job controller by finishing
each stage Job with an exit code the test scripts.  A created driver Job gets a pod (registered with
the emulator, labelled by the Job controller's labels) whose driver, `replayjob.launch.k8s_driver.drive`,
runs in a thread with the emulator as its API server, as `replayjob k8s drive` runs in the cluster;
its return value finishes the driver Job.  The requests, their paths and bodies, and the client's
(de)serialisation are real.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_emulator import NS, Cluster, as_sent, verdict_text
from kubernetes import client

from replayjob.artifacts.spec import AblationSpec, Arm, load_spec_text, spec_from_text
from replayjob.cli import main
from replayjob.errors import ArtifactExistsError, OperationalError, ReplayjobError
from replayjob.launch import jobset, k8s
from replayjob.launch import k8s_driver as driver
from replayjob.launch.submit import Api, StageStuck, submit, wait_job

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "ablation.toml"
Doc = dict[str, Any]


def fast_api(api: client.ApiClient) -> Api:
    return Api(api, backoff_s=0.001, log=lambda s: None)


class Kubelet:
    """Starts each created driver Job's pod: registers it with the emulator (the labels the Job
    controller adds, the container's image and environment) and runs its driver in a thread."""

    def __init__(self, cluster: Cluster, api: client.ApiClient, claim: Path):
        self.cluster, self.api, self.logs, self.threads = cluster, api, [], []
        self.pods: dict[str, Doc] = {}
        self.claim = claim  # the claim as the driver's pod mounts it: the reducer's verdict is written there
        self.verdicts: dict[str, str | None] = {}  # run id -> the verdict the reducer writes (else by its code)
        self.start_grace_s = 300.0  # how long the drivers let a stage stay unable to start

    def __call__(self, job: Doc) -> None:
        if job["metadata"]["labels"].get("app.kubernetes.io/component") == k8s.DRIVER:
            thread = threading.Thread(target=self.run, args=(job,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def env(self, job: Doc, pod: Doc) -> dict[str, str]:
        (cont,) = pod["spec"]["containers"]
        fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": NS,
                  **{f"metadata.labels['{k}']": v for k, v in pod["metadata"]["labels"].items()}}
        return {e["name"]: e["value"] if "value" in e else fields.get(e["valueFrom"]["fieldRef"]["fieldPath"], "")
                for e in cont["env"]}

    def run(self, job: Doc) -> None:
        meta = job["metadata"]
        template = job["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{meta['name']}-x7k2p", "labels": {
                   **template["metadata"]["labels"], k8s.CONTROLLER_UID_LABEL: meta["uid"],
                   k8s.JOB_NAME_LABEL: meta["name"]}},
               "spec": template["spec"]}
        with self.cluster.lock:
            self.pods[meta["name"]] = self.cluster.add(pod)
        env = self.env(job, pod)
        config_map = next(v["configMap"]["name"] for v in template["spec"]["volumes"] if "configMap" in v)
        deadline = time.monotonic() + 10
        while ("ConfigMap", config_map) not in self.cluster.objects:  # the kubelet retries the mount
            assert time.monotonic() < deadline, f"configmap {config_map} never came"
            time.sleep(0.01)
        text = self.cluster.objects[("ConfigMap", config_map)]["data"]["ablation.toml"]
        env[k8s.ARTIFACTS_ENV] = str(self.claim)
        try:
            ctx = driver.Context.from_env(env)
            spec = spec_from_text(text)
            verdict = self.verdicts.get(ctx.run_id, verdict_text(self.cluster.exit_codes.get("reduce", 0)))
            if verdict is not None:  # what the reducer's pod writes on the claim
                path = self.claim / "runs" / spec.name / ctx.run_id / "verdict.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(verdict, encoding="utf-8")
            code = driver.drive(spec, text, ctx, fast_api(self.api), poll_s=0.001, log=self.logs.append,
                                start_grace_s=self.start_grace_s)
        except ReplayjobError as exc:
            self.logs.append(exc.diagnostics())
            code = exc.exit_code
        with self.cluster.lock:
            self.cluster.finished[meta["name"]] = code

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=30)


@pytest.fixture
def kubelet(cluster: tuple[Cluster, client.ApiClient], tmp_path: Path) -> Iterator[Kubelet]:
    state, api = cluster
    runner = Kubelet(state, api, tmp_path / "claim")
    state.on_create = runner
    yield runner
    runner.join()


def jobs_created(state: Cluster) -> list[str]:
    """The Jobs created, in order (a create answered 409 is not one)."""
    conflicts = {c.split()[-1] for c in state.calls if c.startswith("CONFLICT jobs")}
    return [c.split()[-1] for c in state.calls if c.startswith("POST jobs") and c.split()[-1] not in conflicts]


def test_submit_creates_the_driver_which_chains_the_stages_in_the_cluster(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet) -> None:
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    logs: list[str] = []
    assert submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=logs.append, run_id="r1") == 0
    prefix = "replayjob-ablation-r1"
    assert jobs_created(state) == [f"{prefix}-driver", f"{prefix}-capture", f"{prefix}-replay", f"{prefix}-reduce"]
    creates = [c for c in state.calls if c.startswith("POST")]
    assert creates[:2] == [f"POST jobs {prefix}-driver", f"POST configmaps {prefix}-spec"]  # submit's two calls
    calls = state.calls
    done = {name: max(i for i, c in enumerate(calls) if c == f"GET status {name}") for name in state.reads}
    assert calls.index(f"POST jobs {prefix}-replay") > done[f"{prefix}-capture"]
    assert calls.index(f"POST jobs {prefix}-reduce") > done[f"{prefix}-replay"]
    driver_job = state.objects[("Job", f"{prefix}-driver")]
    owner = k8s.owner_reference(driver_job)
    rendered = {**{d["metadata"]["name"]: d for d in k8s.render(spec, text, "r1").values() if k8s.is_manifest(d)},
                **{d["metadata"]["name"]: d for d in k8s.stage_jobs(spec, "r1", owner).values()}}
    rendered[f"{prefix}-spec"]["metadata"]["ownerReferences"] = [owner]  # the spec goes with its run
    rendered[f"{prefix}-spec"]["data"][k8s.VERDICT_KEY] = verdict_text(0)  # published by the driver
    for (kind, name), stored in state.objects.items():
        if kind in ("PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding", "Pod"):
            continue  # the setup's, and the emulated driver pod
        assert as_sent(stored) == json.loads(json.dumps(rendered[name])), name
        if kind == "Job":
            assert stored["spec"]["template"]["metadata"]["labels"][k8s.RUN_ID_LABEL] == "r1"
            tokens = stored["spec"]["template"]["spec"]["automountServiceAccountToken"]
            assert tokens is (name.endswith("-driver"))  # only the driver talks to the API
    assert any("the reducer (job/replayjob-ablation-r1-reduce) exited 0, verdict pass (exit 0)" in line
               for line in kubelet.logs)


@pytest.mark.parametrize(("codes", "expected_exit", "message", "created"), [
    ({"reduce": 1}, 1, "exit 1: a negative verdict", ["capture", "replay", "reduce"]),
    ({"capture": 2, "reduce": 2}, 2, "exit 2: refused input", ["capture", "reduce"]),
    ({"capture": 3, "reduce": 2}, 2, "exit 2: refused input", ["capture", "reduce"]),
    ({"reduce": 3}, 3, "no verdict; job ", ["capture", "replay", "reduce"]),
    ({"reduce": 137}, 3, "exit 3: nothing was decided", ["capture", "replay", "reduce"]),
    ({"replay": 2, "reduce": 2}, 2, "exit 2", ["capture", "replay", "reduce"]),
])
def test_cli_exit_code_is_the_reducer_s_and_a_failed_capture_still_ends_in_a_verdict(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet, codes: dict[str, int], expected_exit: int,
        message: str, created: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A capture that failed for good (2, or 3 on every attempt) runs no replay, and the reducer
    still runs: its verdict (refused: no capture) is the run's."""
    state, _ = cluster
    state.exit_codes.update(codes)
    assert main(["k8s", "submit", str(SPEC), "--wait"]) == expected_exit  # namespace: the context's
    captured = capsys.readouterr()
    if expected_exit:
        assert message in captured.err, captured.err
    assert [Cluster.stage(j) for j in jobs_created(state)] == ["driver", *created]
    if "capture" in codes:
        assert any("no replay runs; the reducer writes the verdict (refused: no capture)" in line
                   for line in kubelet.logs)


def test_each_submission_is_its_own_run_and_needs_no_client_after_it(
        cluster: tuple[Cluster, client.ApiClient], capsys: pytest.CaptureFixture[str]) -> None:
    state, api = cluster
    assert main(["k8s", "submit", str(SPEC)]) == 0
    assert main(["k8s", "submit", str(SPEC)]) == 0
    jobs = jobs_created(state)
    assert len(jobs) == 2 and all(j.endswith("-driver") for j in jobs) and jobs[0] != jobs[1]  # two run ids
    assert not any(c.startswith("GET status") for c in state.calls)  # no --wait: nothing followed
    assert "replayjob k8s resume" in capsys.readouterr().out
    spec, text = load_spec_text(SPEC)
    with pytest.raises(ArtifactExistsError, match="already exists"):  # a run id is never reused
        submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None,
               run_id=jobs[0].split("-")[-2])


def test_api_errors_are_retried_with_backoff_then_give_exit_3(cluster: tuple[Cluster, client.ApiClient]) -> None:
    state, api = cluster
    state.unavailable = 3
    state.finished["replayjob-ablation-r2-driver"] = 0  # a driver that has ended
    spec, text = load_spec_text(SPEC)
    log: list[str] = []
    sleeps: list[float] = []
    retrying = Api(api, backoff_s=0.5, sleep=sleeps.append, log=log.append)
    with pytest.raises(OperationalError, match="no verdict"):  # the driver ended and published no verdict
        submit(spec, text, NS, wait=True, api=retrying, poll_s=0.001, log=log.append, run_id="r2")
    assert sleeps[:3] == [0.5, 1.0, 2.0] and sum("HTTP 503; retrying" in line for line in log) == 3
    state.unavailable = 100
    with pytest.raises(OperationalError, match="HTTP 503") as exc:
        submit(spec, text, NS, wait=True, api=Api(api, tries=3, backoff_s=0.001, log=lambda s: None),
               poll_s=0.001, log=lambda s: None, run_id="r3")
    assert exc.value.exit_code == 3


def test_a_namespace_without_its_setup_is_refused_before_anything_is_created(
        cluster: tuple[Cluster, client.ApiClient], capsys: pytest.CaptureFixture[str]) -> None:
    """A run never creates what outlives it (the claim, the driver's account)."""
    state, _ = cluster
    del state.objects[("ServiceAccount", "replayjob-ablation-driver")]
    assert main(["k8s", "submit", str(SPEC)]) == 2
    assert "no ServiceAccount replayjob-ablation-driver" in capsys.readouterr().err
    assert not any(c.startswith("POST") for c in state.calls)


def test_submit_without_credentials_is_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The cluster cannot be reached: nothing was decided (3), not a refusal of the input (2)."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["k8s", "submit", str(SPEC)]) == 3
    assert "no Kubernetes credentials" in capsys.readouterr().err


def kustomized(directory: Path) -> list[Doc]:
    """`kubectl kustomize DIR` (offline), or [] where kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return []
    # kubectl reads no cluster for this; a KUBECONFIG naming the emulator only slows its start-up
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def apply(state: Cluster, docs: list[Doc]) -> None:
    """`kubectl apply` of rendered (or kustomize-built) documents into the emulator."""
    api = fast_api(client.ApiClient(client.Configuration(host=state.host)))
    for doc in docs:
        if k8s.is_manifest(doc):
            api.create(NS, doc)


def test_two_applies_of_the_kustomize_base_never_share_a_run(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet) -> None:
    """The base names no run: each driver Job takes its run id from its own metadata.uid, labels
    itself with it, and its run's ConfigMap and stage Jobs carry it (a new run directory per apply,
    even of byte-identical files)."""
    state, _api = cluster
    spec, text = load_spec_text(SPEC)
    base = k8s.render(spec, text)
    for doc in filter(k8s.is_manifest, base.values()):
        assert k8s.RUN_ID_LABEL not in doc["metadata"]["labels"]
    assert k8s.RUN_ID_LABEL not in base["driver.yaml"]["spec"]["template"]["metadata"]["labels"]
    runs = []
    for _ in range(2):
        state.objects.pop(("Job", "replayjob-ablation-driver"), None)  # the first one's TTL has passed
        state.objects.pop(("ConfigMap", "replayjob-ablation-spec"), None)
        state.finished.pop("replayjob-ablation-driver", None)
        apply(state, kustomized(REPO / "k8s" / "base") or list(base.values()))
        kubelet.join()
        uid = kubelet.pods["replayjob-ablation-driver"]["metadata"]["labels"][k8s.CONTROLLER_UID_LABEL]
        run_id = driver.run_id_from_uid(uid)
        runs.append(run_id)
        assert state.finished["replayjob-ablation-driver"] == 0
        me = state.objects[("Job", "replayjob-ablation-driver")]
        assert me["metadata"]["labels"][k8s.RUN_ID_LABEL] == run_id  # so `k8s resume RUN_ID` finds it
        for name in (f"replayjob-ablation-{run_id}-{s}" for s in ("capture", "replay", "reduce")):
            job = state.objects[("Job", name)]
            assert job["metadata"]["ownerReferences"] == [k8s.owner_reference(me)]
            assert job["spec"]["template"]["metadata"]["labels"][k8s.RUN_ID_LABEL] == run_id
        config_map = state.objects[("ConfigMap", f"replayjob-ablation-{run_id}-spec")]
        assert config_map["data"]["ablation.toml"] == text
        assert config_map["metadata"]["ownerReferences"] == [k8s.owner_reference(me)]
    assert runs[0] != runs[1] and all(len(r) == 16 for r in runs)


def test_the_driver_runs_the_image_its_pod_runs_and_refuses_a_tag(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet) -> None:
    """Whatever set the driver's image (a kustomize images:, a patch), its stages run that image and
    record it; a tag is refused (exit 2) before any stage unless the spec is local."""
    state, _api = cluster
    spec, text = load_spec_text(SPEC)
    pinned = "registry.example.org/ml/replayjob@sha256:" + "1" * 64
    base = k8s.render(spec, text)
    base["driver.yaml"]["spec"]["template"]["spec"]["containers"][0]["image"] = pinned  # a patch, not images:
    apply(state, list(base.values()))
    kubelet.join()
    stages = [d for (k, _), d in state.objects.items() if k == "Job" and not d["metadata"]["name"].endswith("driver")]
    assert len(stages) == 3
    for job in stages:
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert c["image"] == pinned and {e["name"]: e.get("value") for e in c["env"]}["REPLAYJOB_IMAGE_REF"] == pinned
    assert any(f"this pod runs {pinned} while REPLAYJOB_IMAGE_REF says replayjob:0.1.0" in ln for ln in kubelet.logs)

    strict = text.replace('image_policy = "local"', 'image_policy = "digest"')
    state.objects.clear()
    for doc in k8s.render_setup(spec).values():
        if k8s.is_manifest(doc):
            state.add(doc)
    pinned_spec = dataclasses.replace(spec, image=pinned, image_policy="digest")
    apply(state, list(k8s.render(pinned_spec, strict).values()))
    kubelet.join()
    assert state.finished["replayjob-ablation-driver"] == 0
    state.objects.clear()
    tagged = k8s.render(pinned_spec, strict)
    tagged["driver.yaml"]["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.example.org/rj:2"
    mark = len(state.calls)
    apply(state, list(tagged.values()))
    kubelet.join()
    assert state.finished["replayjob-ablation-driver"] == 2
    assert [c for c in state.calls[mark:] if c.startswith("POST")] == [  # no stage ran
        "POST configmaps replayjob-ablation-spec", "POST jobs replayjob-ablation-driver"]
    assert any("is not named by its digest" in line for line in kubelet.logs)


def test_resume_starts_a_new_driver_that_adopts_the_finished_stages(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet, capsys: pytest.CaptureFixture[str]) -> None:
    """A driver that ended without finishing the run (its retries used up): `k8s resume RUN_ID` starts
    another with the same run id, image and GPU product; it adopts the capture (not run again) and
    creates the rest; the run's ConfigMap gets the new driver as a second owner."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    state.on_create = None  # the first driver never runs: it dies before chaining anything
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r7")
    first = state.objects[("Job", "replayjob-ablation-r7-driver")]
    gpu = next(e for e in first["spec"]["template"]["spec"]["containers"][0]["env"]
               if e["name"] == "REPLAYJOB_GPU_PRODUCT")
    gpu["value"] = "NVIDIA-H200"  # an overlay's
    capture = k8s.stage_jobs(dataclasses.replace(spec, gpu_product="NVIDIA-H200"), "r7",
                             k8s.owner_reference(first))["capture.yaml"]  # as the first driver rendered it
    state.add(capture)  # it ran and succeeded before the driver died
    assert main(["k8s", "resume", "r7"]) == 0
    assert "is still driving it" in capsys.readouterr().out  # the first driver has not ended
    state.finished["replayjob-ablation-r7-driver"] = 3
    state.on_create = kubelet
    assert main(["k8s", "resume", "r7", "--wait"]) == 0
    kubelet.join()
    assert "started job/replayjob-ablation-r7-driver-2" in capsys.readouterr().out
    assert jobs_created(state)[-3:] == ["replayjob-ablation-r7-driver-2", "replayjob-ablation-r7-replay",
                                        "replayjob-ablation-r7-reduce"]  # the capture was adopted
    assert "CONFLICT jobs replayjob-ablation-r7-capture" in state.calls
    assert any("adopted job/replayjob-ablation-r7-capture" in line for line in kubelet.logs)
    second = state.objects[("Job", "replayjob-ablation-r7-driver-2")]
    owners = [r["name"] for r in state.objects[("ConfigMap", "replayjob-ablation-r7-spec")]["metadata"]
              ["ownerReferences"]]
    assert owners == ["replayjob-ablation-r7-driver", "replayjob-ablation-r7-driver-2"]
    assert [r["name"] for r in state.objects[("Job", "replayjob-ablation-r7-capture")]["metadata"]
            ["ownerReferences"]] == owners
    env = {e["name"]: e.get("value") for e in second["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["REPLAYJOB_GPU_PRODUCT"] == "NVIDIA-H200"
    assert second["spec"]["template"]["metadata"]["labels"][k8s.RUN_ID_LABEL] == "r7"
    replay = state.objects[("Job", "replayjob-ablation-r7-replay")]
    assert replay["spec"]["template"]["spec"]["nodeSelector"][k8s.GPU_PRODUCT_LABEL] == "NVIDIA-H200"
    assert main(["k8s", "resume", "nope"]) == 2
    assert "no run nope" in capsys.readouterr().err


@pytest.mark.parametrize(("status", "said"), [
    ({"conditions": ["Complete"]}, "status.conditions[0]: expected `object`, got `str`"),
    ({"conditions": [{"type": "Complete", "status": "True"}, {"type": "Failed", "status": "True"}]},
     "both Complete and Failed are true"),
])
def test_resume_reads_a_driver_s_status_through_the_job_status_reader(
        cluster: tuple[Cluster, client.ApiClient], capsys: pytest.CaptureFixture[str], status: Any, said: str) -> None:
    """`k8s resume` decides whether a driver still runs from its Job's status as declared: a malformed one is
    exit 3 with one line naming the Job and the field (it was read as raw JSON: a traceback, or a driver whose
    status says both Complete and Failed taken as ended)."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    state.on_create = None
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r10")
    state.statuses["replayjob-ablation-r10-driver"] = status
    assert main(["k8s", "resume", "r10"]) == 3
    err = capsys.readouterr().err
    assert "job replayjob-ablation-r10-driver: malformed status" in err and said in err, err
    assert "Traceback" not in err and "traceback" not in err, err


def drive_run_r9(state: Cluster, api: client.ApiClient, spec: AblationSpec, text: str,
                 tmp_path: Path) -> tuple[list[str], driver.Context]:
    """Run the in-cluster driver of run ``r9`` for ``spec`` on the emulated cluster (its verdict, exit 0, laid
    on the claim where the reducer writes it); the driver must exit 0.  Its log lines and its context."""
    logs: list[str] = []
    claim = tmp_path / "claim"
    (claim / "runs" / spec.name / "r9").mkdir(parents=True)
    (claim / "runs" / spec.name / "r9" / "verdict.json").write_text(str(verdict_text(0)), encoding="utf-8")
    me = state.add({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "replayjob-ablation-r9-driver",
                                                                           "labels": {}}})
    ctx = driver.Context(namespace=NS, job="replayjob-ablation-r9-driver", uid=me["metadata"]["uid"], pod="",
                         run_id="r9", gpu_product="", image=spec.image, artifacts=str(claim))
    assert driver.drive(spec, text, ctx, fast_api(api), poll_s=0.001, log=logs.append) == 0
    return logs, ctx


def test_replay_jobs_of_each_rank_count_run_one_after_another(cluster: tuple[Cluster, client.ApiClient],
                                                              tmp_path: Path) -> None:
    """Arms of different rank counts: one replay Job per count, each created by the driver after the one
    before ended (however it ended), so the spec's parallelism bounds every replay at once; then the
    reducer."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    spec = dataclasses.replace(spec, ranks=2, config={"distributed.strategy": "ddp"}, arms=(
        Arm("two"), Arm("one", {"distributed.world_size": 1}), Arm("four", {"distributed.world_size": 4})))
    state.exit_codes["r1"] = 2  # the 1-rank replays fail for good: the others still run, the reducer judges
    logs, _ = drive_run_r9(state, api, spec, text, tmp_path)
    jobs = [j.removeprefix("replayjob-ablation-r9-") for j in jobs_created(state)]
    assert jobs == ["capture", "replay-r1", "replay-r2", "replay-r4", "reduce"]
    calls = state.calls
    for before, after in itertools.pairwise(jobs):
        last_read = max(i for i, c in enumerate(calls) if c == f"GET status replayjob-ablation-r9-{before}")
        assert calls.index(f"POST jobs replayjob-ablation-r9-{after}") > last_read
    assert any("replay-r1 failed" in line and "the reducer judges the missing replays" in line for line in logs)
    gpus = {n: state.objects[("Job", f"replayjob-ablation-r9-{n}")]["spec"]["template"]["spec"]["containers"][0]
            ["resources"]["limits"][k8s.GPU_RESOURCE] for n in jobs if n != "reduce"}
    assert gpus == {"capture": "2", "replay-r1": "1", "replay-r2": "2", "replay-r4": "4"}


def test_runs_across_nodes_are_jobsets_the_driver_creates_in_waves(cluster: tuple[Cluster, client.ApiClient],
                                                                    tmp_path: Path) -> None:
    """Nodes of 2 GPUs: the 4-rank capture and the 4-rank arm's replays span 2 nodes, each one JobSet
    (replayjob.launch.jobset) the driver creates and follows like a Job, the replays ``parallelism`` (2) at
    a time, each wave after the one before ended; the 2-rank arm is the usual Indexed Job; then the
    reducer.  A replay whose JobSet failed for good is missing evidence the reducer judges."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    spec = dataclasses.replace(spec, ranks=4, node_gpus=2, parallelism=2, config={"distributed.strategy": "ddp"},
                               arms=(Arm("four"), Arm("two", {"distributed.world_size": 2})))
    assert spec.across_nodes() == {"capture": 2, "0": 2, "1": 2, "2": 2}
    state.exit_codes["1"] = 2  # replay 1's JobSet fails for good (a refusal): the others still run
    logs, ctx = drive_run_r9(state, api, spec, text, tmp_path)
    made = [c.split(maxsplit=1)[1].replace("replayjob-ablation-r9-", "") for c in state.calls
            if c.startswith(("POST jobs", "POST jobsets"))]
    assert made == ["jobsets capture", "jobs replay-r2", "jobsets replay-0", "jobsets replay-1", "jobsets replay-2",
                    "jobs reduce"]
    calls = state.calls
    first = calls.index("GET jobsets replayjob-ablation-r9-replay-0")
    assert calls.index("POST jobsets replayjob-ablation-r9-replay-1") < first  # one wave: created together
    last = max(i for i, c in enumerate(calls) if c in ("GET jobsets replayjob-ablation-r9-replay-0",
                                                       "GET jobsets replayjob-ablation-r9-replay-1"))
    assert calls.index("POST jobsets replayjob-ablation-r9-replay-2") > last  # the next wave after it ended
    assert any("jobset/replayjob-ablation-r9-replay-1 failed" in line for line in logs)
    made_js = state.objects[("JobSet", "replayjob-ablation-r9-replay-0")]
    assert made_js["metadata"]["ownerReferences"][0]["uid"] == ctx.uid
    assert made_js == {**jobset.jobset(spec, "r9", 0, ctx.owner), "metadata": made_js["metadata"]}
    # the driver's Role may create and follow JobSets only where a spec has runs across nodes
    rules = k8s.driver_rbac(spec)["role.yaml"]["rules"]
    assert {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["get", "list", "create", "patch"]} \
        in rules
    assert all("jobset.x-k8s.io" not in r["apiGroups"] for r in k8s.driver_rbac(load_spec_text(SPEC)[0])["role.yaml"]
               ["rules"])


def test_the_driver_refuses_outside_its_pod_and_names_the_run_from_the_uid() -> None:
    with pytest.raises(ReplayjobError, match="not a driver Job's pod"):
        driver.Context.from_env({})
    env = {"REPLAYJOB_DRIVER_JOB": "x-driver", "REPLAYJOB_DRIVER_UID": "0f1e2d3c-4b5a-4697-8869-7a6b5c4d3e2f",
           "REPLAYJOB_NAMESPACE": NS, "REPLAYJOB_RUN_ID": ""}
    assert driver.Context.from_env(env).run_id == "0f1e2d3c4b5a4697"
    assert driver.Context.from_env({**env, "REPLAYJOB_RUN_ID": "r1"}).run_id == "r1"
    with pytest.raises(ReplayjobError, match="not a Kubernetes uid"):
        driver.run_id_from_uid("nope")


# --- the outcome: the verdict, read strictly and cross-checked, never a Job's condition alone ---------

def forged_verdict(code: int, **edit: Any) -> str:
    doc = json.loads(str(verdict_text(code)))
    doc.update(edit)
    return json.dumps(doc)


@pytest.mark.parametrize(("verdict", "reduce", "expected", "said"), [
    (forged_verdict(2, exit_code=False), 2, 3, "the verdict cannot be read"),
    (forged_verdict(2, exit_code=0.0), 2, 3, "expected `int`, got `float`"),
    (forged_verdict(2, exit_code=0), 2, 3, "status 'refused' exits 2"),
    (str(verdict_text(2))[:-1] + ', "exit_code": 0}', 2, 3, "duplicate key 'exit_code'"),
    (str(verdict_text(0)), 2, 3, "they disagree"),  # a pass the reducer's own code contradicts
    (None, 0, 3, "no verdict"),  # the reducer's 0 alone decides nothing
    (str(verdict_text(1)), 1, 1, "verdict fail (exit 1)"),
])
def test_the_driver_judges_the_verdict_it_reads_with_the_reducer_s_code(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet, verdict: str | None, reduce: int,
        expected: int, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    state.exit_codes["reduce"] = reduce
    kubelet.verdicts["r5"] = verdict
    code = None
    try:
        code = submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r5")
    except ReplayjobError as exc:
        code = exc.exit_code
        assert said in exc.message or said in " ".join(kubelet.logs), (exc.message, kubelet.logs)
    assert code == expected
    assert any(said in line for line in kubelet.logs), kubelet.logs


def _reduce_pod(name: str, code: int, i: int) -> Doc:
    return {"metadata": {"name": f"{name}-{i}"}, "status": {"containerStatuses": [
        {"name": "replayjob", "state": {"terminated": {"exitCode": code}}}]}}


@pytest.mark.parametrize(("condition", "codes", "expected", "said"), [
    ("Complete", [3], 3, "exited 3 but the verdict pass"),  # the API says complete, the pod says 3
    ("Complete", [], 3, "no exit code to confirm the verdict pass"),  # no pod left to confirm it
    ("Failed", [], 3, "no exit code to confirm the verdict pass"),  # a failed reducer is no pass
    ("Failed", [0], 3, "no exit code to confirm the verdict pass"),  # failed, yet every attempt exited 0
    ("Complete", [3, 0], 0, "exited 0, verdict pass"),  # a retried reducer whose last attempt passed
])
def test_the_driver_reads_the_reducer_s_code_from_its_job_and_its_pods_together(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet, condition: str, codes: list[int],
        expected: int, said: str) -> None:
    """The driver decides the reducer's code as `k8s ... --wait` does (`cluster_status.job_outcome`): a reduce Job
    the API calls Complete is 0 only beside a pod that exited 0, and a pass verdict with no code to confirm it
    decides nothing (the driver took Complete for 0, and a Failed Job without pods let the verdict alone pass)."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    name = "replayjob-ablation-r8-reduce"
    state.statuses[name] = {"conditions": [{"type": condition, "status": "True"}]}
    state.pods[name] = [_reduce_pod(name, c, i) for i, c in enumerate(codes)]
    kubelet.verdicts["r8"] = verdict_text(0)
    try:
        code = submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r8")
    except ReplayjobError as exc:
        code = exc.exit_code
    assert code == expected, kubelet.logs
    assert any(said in line for line in kubelet.logs), kubelet.logs


def test_the_driver_publishes_the_verdict_bytes_it_judged_and_never_reads_through_a_link(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet, tmp_path: Path) -> None:
    """The verdict on the claim is read once, without following a link: a `verdict.json` linked to a pass
    elsewhere is unreadable (3) and is not published in the run's ConfigMap."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    elsewhere = tmp_path / "pass.json"
    elsewhere.write_text(str(verdict_text(0)), encoding="utf-8")
    run_dir = kubelet.claim / "runs" / spec.name / "r9l"
    run_dir.mkdir(parents=True)
    (run_dir / "verdict.json").symlink_to(elsewhere)
    kubelet.verdicts["r9l"] = None
    with pytest.raises(OperationalError):
        submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r9l")
    assert any("the verdict cannot be read" in line and "symbolic link" in line for line in kubelet.logs), \
        kubelet.logs
    assert k8s.VERDICT_KEY not in (state.objects[("ConfigMap", "replayjob-ablation-r9l-spec")].get("data") or {})


@pytest.mark.parametrize(("status", "pods", "said"), [
    ({"conditions": [{"type": "Complete", "status": "True"}]}, [], "no exit code to confirm"),  # no pod
    ({"conditions": [{"type": "Complete", "status": "True"}, {"type": "Failed", "status": "True"}]}, None,
     "both Complete and Failed are true"),
    ({"conditions": [{"status": "True"}]}, None, "malformed status: status.conditions[0]: object missing "
                                                 "required field `type`"),
    ([], None, "malformed status: status: expected `object | null`, got `array`"),
    ({"conditions": [{"type": "Complete", "status": "True"}]}, "exit1", "its pod exited 1"),
])
def test_a_driver_job_s_condition_alone_never_passes(
        cluster: tuple[Cluster, client.ApiClient], status: Any, pods: Any, said: str) -> None:
    """`Complete` with no pod, with a pod that exited 1, with `Failed` too; a condition without a type; a
    status that is a list: exit 3 (or the pod's code, contradicted by the verdict) with one line."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    name = "replayjob-ablation-r6-driver"
    state.statuses[name] = status
    if pods == "exit1":
        pods = [{"metadata": {"name": f"{name}-a"}, "status": {"containerStatuses": [
            {"name": "replayjob", "state": {"terminated": {"exitCode": 1}}}]}}]
    if pods is not None:
        state.pods[name] = pods
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r6")
    cm = state.objects[("ConfigMap", "replayjob-ablation-r6-spec")]
    cm["data"][k8s.VERDICT_KEY] = verdict_text(0)  # a pass published beside the run's spec
    with pytest.raises(OperationalError) as err:
        submit_wait(api, "r6")
    assert said in err.value.message and "\n" not in err.value.message, err.value.message


def submit_wait(api: client.ApiClient, run_id: str) -> int:
    from replayjob.launch.submit import wait_driver

    return wait_driver(fast_api(api), NS, f"replayjob-ablation-{run_id}-driver", f"replayjob-ablation-{run_id}-spec",
                       0.001, lambda s: None)


def test_a_job_deleted_mid_run_and_a_403_are_3_with_one_line(
        cluster: tuple[Cluster, client.ApiClient], capsys: pytest.CaptureFixture[str]) -> None:
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r8")
    state.deleted.add("replayjob-ablation-r8-driver")
    with pytest.raises(OperationalError, match=r"HTTP 404 .*deleted while the run waited for it"):
        submit_wait(api, "r8")
    state.deleted.clear()
    state.forbidden.add("replayjob-ablation-r8-driver")
    assert main(["k8s", "resume", "r8", "--wait"]) == 3
    err = capsys.readouterr().err
    assert "HTTP 403" in err and "Traceback" not in err


# --- a run adopts only what it created; infrastructure failures are 3 --------------------------------

def foreign_job(spec: Any, run_id: str, stage: str, **edit: Any) -> Doc:
    """A stage Job of that name that this run did not create: no owner, another image (edit overrides)."""
    job = k8s.stage_jobs(spec, run_id)[f"{stage}.yaml"]
    job["spec"]["template"]["spec"]["containers"][0]["image"] = edit.get("image", "evil.example/rj:latest")
    if "owner" in edit:
        job["metadata"]["ownerReferences"] = [edit["owner"]]
    return job


@pytest.mark.parametrize(("stage", "owned", "said"), [
    ("reduce", False, "it is owned by no driver of this run"),
    ("capture", False, "it is owned by no driver of this run"),
    ("capture", True, "its labels or pod template are not the ones this run renders"),
])
def test_the_driver_adopts_no_job_it_did_not_create(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet, stage: str, owned: bool, said: str) -> None:
    """A pre-existing stage Job (another image, no owner, or owned but another pod template) is refused
    (2); it is never followed, so its exit code never becomes the run's."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    original = state.on_create
    state.on_create = None
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r4")
    me = state.objects[("Job", "replayjob-ablation-r4-driver")]
    extra = {"owner": k8s.owner_reference(me)} if owned else {}
    state.add(foreign_job(spec, "r4", stage, **extra))
    state.exit_codes[stage] = 0
    state.on_create = original
    kubelet(me)  # the driver's pod starts now
    kubelet.join()
    assert state.finished["replayjob-ablation-r4-driver"] == 2
    assert any(f"job/replayjob-ablation-r4-{stage} exists but is not this run's: {said}" in line
               for line in kubelet.logs), kubelet.logs
    if stage == "reduce":  # the capture and replays ran; the foreign reducer was never followed
        assert not any(c == "GET status replayjob-ablation-r4-reduce" for c in state.calls)


def test_resume_refuses_a_second_or_edited_spec_config_map(
        cluster: tuple[Cluster, client.ApiClient], capsys: pytest.CaptureFixture[str]) -> None:
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r3")
    state.finished["replayjob-ablation-r3-driver"] = 3
    cm = state.objects[("ConfigMap", "replayjob-ablation-r3-spec")]
    twin = json.loads(json.dumps(cm))
    twin["metadata"]["name"] = "replayjob-ablation-r3-other"
    state.add(twin)
    assert main(["k8s", "resume", "r3"]) == 2
    assert "2 ConfigMaps carry its labels" in capsys.readouterr().err
    del state.objects[("ConfigMap", "replayjob-ablation-r3-other")]
    cm["data"]["ablation.toml"] = text.replace("repeats = 3", "repeats = 2")  # another valid spec
    assert spec_from_text(cm["data"]["ablation.toml"]).repeats == 2
    mark = len(state.calls)
    assert main(["k8s", "resume", "r3"]) == 2
    assert "holds another spec than the one run r3 was submitted with" in capsys.readouterr().err
    assert not any(c.startswith("POST") for c in state.calls[mark:])  # no driver started


def test_a_run_id_is_checked_before_any_request(cluster: tuple[Cluster, client.ApiClient],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    state, api = cluster
    assert main(["k8s", "resume", "rt3run0001,app.kubernetes.io/component=spec"]) == 2
    assert "is not a run id" in capsys.readouterr().err
    spec, text = load_spec_text(SPEC)
    with pytest.raises(ReplayjobError, match="is not a run id"):
        submit(spec, text, NS, wait=False, api=fast_api(api), log=lambda s: None, run_id="A,b=c")
    assert state.calls == []


@pytest.mark.parametrize("namespace", ["..", "team/a", "Team-A", "a" * 64])
def test_a_namespace_is_checked_before_any_request(cluster: tuple[Cluster, client.ApiClient],
                                                   capsys: pytest.CaptureFixture[str], namespace: str) -> None:
    state, api = cluster
    assert main(["k8s", "resume", "r3", "--namespace", namespace]) == 2
    assert f"namespace {namespace!r} is not a name Kubernetes takes" in capsys.readouterr().err
    spec, text = load_spec_text(SPEC)
    with pytest.raises(ReplayjobError, match="is not a name Kubernetes takes"):
        submit(spec, text, namespace, wait=False, api=fast_api(api), log=lambda s: None)
    assert state.calls == []


def test_infrastructure_failures_during_a_run_are_3(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet) -> None:
    """A 403 creating a stage Job and a 409 patching the driver's label are the cluster's failures: 3."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    state.refuse[("POST", "replayjob-ablation-r2-capture")] = 403
    with pytest.raises(OperationalError):
        submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r2")
    kubelet.join()
    assert state.finished["replayjob-ablation-r2-driver"] == 3
    assert any("creating Job replayjob-ablation-r2-capture failed: HTTP 403" in line for line in kubelet.logs)
    base = k8s.render(spec, text)  # the base's driver labels itself with its run id: a 409 there
    state.refuse[("PATCH", "replayjob-ablation-driver")] = 409
    apply(state, list(base.values()))
    kubelet.join()
    assert state.finished["replayjob-ablation-driver"] == 3
    assert any("patching Job replayjob-ablation-driver failed: HTTP 409" in line for line in kubelet.logs)


def test_a_driver_create_whose_reply_was_lost_is_adopted(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet) -> None:
    """The create is done but answered 500; the retry answers 409: the Job is this submission's own."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    state.lost_replies.add("replayjob-ablation-r1-driver")
    assert submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r1") == 0
    assert state.calls.count("POST jobs replayjob-ablation-r1-driver") == 2
    assert "CONFLICT jobs replayjob-ablation-r1-driver" in state.calls


def test_waits_have_a_deadline_of_their_own(cluster: tuple[Cluster, client.ApiClient]) -> None:
    """A Job that never gets conditions is not polled forever: exit 3 after its deadline (time suspended
    by a queue not counted)."""
    from replayjob.launch.submit import wait_driver

    state, api = cluster
    spec, text = load_spec_text(SPEC)
    submit(spec, text, NS, wait=False, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r0")
    state.statuses["replayjob-ablation-r0-driver"] = {}  # never any condition
    with pytest.raises(OperationalError, match="has not ended after"):
        wait_driver(fast_api(api), NS, "replayjob-ablation-r0-driver", "replayjob-ablation-r0-spec", 0.05,
                    lambda s: None, deadline_s=1.0)
    job = state.objects[("Job", "replayjob-ablation-r0-driver")]
    job["spec"]["suspend"] = True  # held by a queue: the deadline does not run
    reads = len(state.calls)
    ended: list[str] = []

    def follow() -> None:
        try:
            wait_driver(fast_api(api), NS, "replayjob-ablation-r0-driver", "replayjob-ablation-r0-spec", 0.05,
                        lambda s: None, deadline_s=1.0)
        except OperationalError as exc:
            ended.append(exc.message)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive() and len(state.calls) - reads > 5  # still waiting, still polling
    state.statuses.pop("replayjob-ablation-r0-driver")
    state.finished["replayjob-ablation-r0-driver"] = 3
    thread.join(timeout=10)
    assert not thread.is_alive() and "no verdict" in ended[0]  # it ended when the Job did, not at a deadline


# --- fail fast: a stage that cannot start ends the run within the grace period, named ------------------

def pending_pod(job: str, *, scheduled: Doc | None = None, waiting: Doc | None = None) -> Doc:
    status: Doc = {"phase": "Pending"}
    if scheduled is not None:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", **scheduled}]
    if waiting is not None:
        status["containerStatuses"] = [{"name": "replayjob", "state": {"waiting": waiting}}]
    return {"metadata": {"name": f"{job}-abcde"}, "status": status}


UNSCHEDULABLE = {"reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}
PULL = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "registry.example.org/rj@sha256:11"'}
QUOTA = "pods \"replayjob-ablation-r5-capture-x\" is forbidden: exceeded quota: gpu, requested: nvidia.com/gpu=1"


@pytest.mark.parametrize(("stage", "cause", "reason", "message"), [
    ("capture", "unschedulable", "Unschedulable", UNSCHEDULABLE["message"]),
    ("replay", "pull", "ImagePullBackOff", PULL["message"]),
    ("capture", "quota", "FailedCreate", QUOTA),
])
def test_a_stage_that_cannot_start_ends_the_run_with_3_naming_pod_reason_and_message(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet, stage: str, cause: str, reason: str,
        message: str) -> None:
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    job = f"replayjob-ablation-r5-{stage}"
    state.statuses[job] = {"active": 1}  # it never ends by itself
    if cause == "unschedulable":
        state.pods[job] = [pending_pod(job, scheduled=UNSCHEDULABLE)]
    elif cause == "pull":
        state.pods[job] = [pending_pod(job, waiting=PULL)]
    else:
        state.pods[job] = []
        state.events.append({"reason": "FailedCreate", "type": "Warning", "message": message,
                             "involvedObject": {"kind": "Job", "name": job}})
    kubelet.start_grace_s = 0.2
    logs: list[str] = []
    with pytest.raises(OperationalError) as err:
        submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=logs.append, run_id="r5")
    kubelet.join()
    assert state.finished["replayjob-ablation-r5-driver"] == 3
    pod = f"job {job}" if cause == "quota" else f"pod {job}-abcde"
    assert f"the driver stopped the run: stage {stage} ({job}): {pod}: {reason}: {message}" in err.value.message
    record = json.loads(state.objects[("ConfigMap", "replayjob-ablation-r5-spec")]["data"]["stopped.json"])
    assert (record["stage"], record["pod"], record["reason"], record["exit_code"]) == (stage, pod, reason, 3)
    assert any(f"job {job}: waiting: {pod}: {reason}" in line for line in kubelet.logs)  # progress while waiting
    assert any(line.startswith("driver: stage 1/3: job/") for line in kubelet.logs)  # capture, replay, reduce


def test_a_pod_that_is_pending_only_briefly_is_waited_for(
        cluster: tuple[Cluster, client.ApiClient], kubelet: Kubelet) -> None:
    """Unschedulable for less than the grace period (a node pool scaling up), then running: the run goes on."""
    state, api = cluster
    spec, text = load_spec_text(SPEC)
    job = "replayjob-ablation-r6-capture"
    state.pods[job] = [pending_pod(job, scheduled=UNSCHEDULABLE)]
    state.statuses[job] = {"active": 1}

    def scaled_up() -> None:
        time.sleep(0.3)
        with state.lock:
            del state.pods[job]
            del state.statuses[job]

    kubelet.start_grace_s = 5.0
    threading.Thread(target=scaled_up, daemon=True).start()
    assert submit(spec, text, NS, wait=True, api=fast_api(api), poll_s=0.001, log=lambda s: None, run_id="r6") == 0
    kubelet.join()
    assert any(f"job {job}: waiting: pod {job}-abcde: Unschedulable" in line for line in kubelet.logs)


def test_a_jobset_that_cannot_start_is_named_by_its_pods_and_its_job_s_events(
        cluster: tuple[Cluster, client.ApiClient]) -> None:
    """A run across nodes waits like a Job: an Unschedulable pod of the JobSet (found by the JobSet's pod
    label) or a FailedCreate Event of the Job it creates stops the wait after the grace period (3)."""
    state, api = cluster
    name = "replayjob-ablation-r5-replay-0"
    state.add({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name, "labels": {}},
               "spec": {}})
    state.exit_codes["0"] = 0
    state.statuses[name] = {"active": 1}  # never ends by itself
    state.pods[name] = [pending_pod(f"{name}-n-0-0", scheduled=UNSCHEDULABLE)]
    a = fast_api(api)
    stuck = a.stage_stuck(NS, name, "JobSet")
    assert stuck is not None and (stuck.reason, stuck.message) == ("Unschedulable", UNSCHEDULABLE["message"])
    assert f"GET pods {name}" in state.calls  # by the JobSet's label, not a Job's
    with pytest.raises(StageStuck, match=r"Insufficient nvidia\.com/gpu"):
        wait_job(a, NS, name, 0.001, lambda s: None, start_grace_s=0.01, kind="JobSet")
    state.pods[name] = []
    state.events.append({"metadata": {"name": "e1"}, "reason": "FailedCreate", "message": QUOTA,
                         "involvedObject": {"kind": "Job", "name": f"{name}-n-0"}})
    stuck = a.stage_stuck(NS, name, "JobSet")
    assert stuck is not None and (stuck.reason, stuck.message) == ("FailedCreate", QUOTA)
