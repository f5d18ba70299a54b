"""The spec's [pods] table: a declared, validated pod customisation applied alike by the Jobs, the Argo
templates and the stage Jobs the in-cluster driver creates; rendered output validated strictly against
the Kubernetes and Argo schemas; the determinism environment and the security context cannot be changed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_deploy_manifests import SPEC, schema_errors, semantic_problems

from replayjob.artifacts import pods
from replayjob.artifacts.spec import DETERMINISM_ENV, load_spec_text, spec_from_text
from replayjob.errors import ConfigError
from replayjob.launch import argo, k8s

Doc = dict[str, Any]
PODS = """
[pods.all]
imagePullSecrets = ["registry-creds"]
annotations = {"cost-center" = "rl-research"}
labels = {"team" = "rl"}
env = {"HTTPS_PROXY" = "http://proxy.internal:3128"}
schedulerName = "volcano"

[pods.gpu]
tolerations = [{key = "dedicated", value = "rl-replay", effect = "NoSchedule"}]
nodeSelector = {"cloud.example.com/node-pool" = "h100-dedicated"}
annotations = {"karpenter.sh/do-not-disrupt" = "true"}
runtimeClassName = "nvidia"
serviceAccountName = "replay-reader"
affinity = {nodeAffinity = {requiredDuringSchedulingIgnoredDuringExecution = {nodeSelectorTerms = [
  {matchExpressions = [{key = "topology.kubernetes.io/zone", operator = "In", values = ["zone-a"]}]}]}}}
volumes = [{name = "hf-token", mountPath = "/secrets/hf", secret = "hf-token"}]

[pods.cpu]
annotations = {"cluster-autoscaler.kubernetes.io/safe-to-evict" = "false"}
nodeSelector = {"cloud.example.com/node-pool" = "cpu"}
"""


@pytest.fixture(scope="module")
def customised() -> tuple[Any, str]:
    text = SPEC.read_text(encoding="utf-8") + PODS
    return spec_from_text(text, "spec"), text


OWNER = k8s.owner_reference({"metadata": {"name": "replayjob-ablation-r1-driver",
                                          "uid": "0f1e2d3c-4b5a-4697-8869-7a6b5c4d3e2f"}})


def job_pods(spec: Any, text: str) -> dict[str, tuple[Doc, Doc]]:
    """stage -> (pod metadata, pod spec) of the Jobs the driver creates."""
    return {name.removesuffix(".yaml"): (job["spec"]["template"]["metadata"], job["spec"]["template"]["spec"])
            for name, job in k8s.stage_jobs(spec, "r1", OWNER).items()}


def argo_pods(spec: Any, text: str) -> dict[str, Doc]:
    wft = argo.render(spec, text)[0]
    return {t["name"]: t for t in wft["spec"]["templates"] if "container" in t}


def test_every_stage_pod_gets_its_settings_and_validates_strictly(customised: tuple[Any, str]) -> None:
    spec, text = customised
    stages = job_pods(spec, text)
    for stage, (meta, pod) in stages.items():
        gpu = stage != "reduce"
        (cont,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in cont["env"]}
        assert env["HTTPS_PROXY"] == "http://proxy.internal:3128"
        assert {k: v for k, v in env.items() if k in DETERMINISM_ENV} == spec.determinism_env()  # unchanged
        assert pod["imagePullSecrets"] == [{"name": "registry-creds"}] and pod["schedulerName"] == "volcano"
        assert meta["labels"]["team"] == "rl" and meta["annotations"]["cost-center"] == "rl-research"
        assert pod["automountServiceAccountToken"] is False and pod["securityContext"] == k8s.pod_security()
        if gpu:
            assert [t["key"] for t in pod["tolerations"]] == [k8s.GPU_RESOURCE, "dedicated"]  # added to ours
            assert pod["nodeSelector"] == {"cloud.example.com/node-pool": "h100-dedicated",
                                           k8s.GPU_PRODUCT_LABEL: spec.gpu_product}
            assert set(pod["affinity"]) == {"nodeAffinity", "podAntiAffinity"}  # ours stays
            assert (pod["runtimeClassName"], pod["serviceAccountName"]) == ("nvidia", "replay-reader")
            assert meta["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
            assert {"name": "hf-token", "mountPath": "/secrets/hf", "readOnly": True} in cont["volumeMounts"]
        else:  # the CPU stage: [pods.all] and [pods.cpu] only
            assert "tolerations" not in pod and "runtimeClassName" not in pod and "serviceAccountName" not in pod
            assert pod["nodeSelector"] == {"cloud.example.com/node-pool": "cpu"}
            assert meta["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    docs = [*(d for d in k8s.stage_jobs(spec, "r1", OWNER).values()), *argo.render(spec, text)]
    assert {e for d in docs for e in schema_errors(Path("x"), d)} == set()  # Kubernetes 1.29/1.37, Argo 3.7/4.1
    assert [p for d in docs if d["kind"] != "Workflow" for p in semantic_problems(d)] == []


def test_jobs_and_argo_apply_the_same_settings(customised: tuple[Any, str]) -> None:
    spec, text = customised
    jobs, templates = job_pods(spec, text), argo_pods(spec, text)
    for stage, tpl in (("capture", templates["capture"]), ("replay", templates["replay"]),
                       ("reduce", templates["reduce"])):
        meta, pod = jobs[stage]
        patch = json.loads(tpl.get("podSpecPatch", "{}"))
        for key in ("tolerations", "affinity", "serviceAccountName", "schedulerName"):
            assert tpl.get(key) == pod.get(key), (stage, key)
        product = {k8s.GPU_PRODUCT_LABEL: "{{workflow.parameters.gpu-product}}"} if stage != "reduce" else {}
        assert tpl.get("nodeSelector") == {**pod.get("nodeSelector", {}), **product}  # Argo's is a parameter
        for key in ("imagePullSecrets", "runtimeClassName"):
            assert patch.get(key) == pod.get(key), (stage, key)
        for key in ("labels", "annotations"):
            mine = {k: v for k, v in (tpl["metadata"].get(key) or {}).items() if not k.startswith(k8s.RUN_ID_LABEL)}
            theirs = {k: v for k, v in (meta.get(key) or {}).items() if k != k8s.RUN_ID_LABEL}
            assert mine == theirs, (stage, key)
        extra = [v for v in pod["volumes"] if v["name"] not in pods.OWN_VOLUMES]
        assert tpl.get("volumes", []) == extra, stage
        env = [e for e in pod["containers"][0]["env"] if e["name"] == "HTTPS_PROXY"]
        assert env and env == [e for e in tpl["container"]["env"] if e["name"] == "HTTPS_PROXY"]


def test_a_customisation_is_a_render_time_field(customised: tuple[Any, str]) -> None:
    """Manifests rendered with [pods] carry it: a spec handed to the pods later that differs is refused."""
    spec, _ = customised
    plain, _ = load_spec_text(SPEC)
    assert spec.render_fields()["pods"]["gpu"]["runtimeClassName"] == "nvidia"
    assert "pods" not in plain.render_fields()  # specs without one render as before


@pytest.mark.parametrize(("table", "said"), [
    *((f'[pods.gpu]\nenv = {{"{name}" = "x"}}', f"{name} is replayjob's own variable") for name in DETERMINISM_ENV),
    ('[pods.all]\nenv = {"OMP_NUM_THREADS" = "64"}', "the determinism and runtime environment cannot be overridden"),
    ("[pods.gpu]\nsecurityContext = {privileged = true}", "securityContext cannot be customised: the security "
                                                          "context is fixed"),
    ("[pods.all]\nhostNetwork = true", "host namespaces"),
    ("[pods.all]\nautomountServiceAccountToken = true", "only the driver's pod mounts a service-account token"),
    ('[pods.cpu]\nlabels = {"replayjob.dev/run-id" = "x"}', "replayjob's own label"),
    # the labels the Job and JobSet controllers set and select their pods by
    ('[pods.gpu]\nlabels = {"jobset.sigs.k8s.io/jobset-name" = "x"}', "replayjob's own label"),
    ('[pods.all]\nlabels = {"job-name" = "x"}', "replayjob's own label"),
    ('[pods.all]\nlabels = {"controller-uid" = "x"}', "replayjob's own label"),
    ('[pods.gpu]\nnodeSelector = {"nvidia.com/gpu.product" = "x"}', "is set from the spec's gpu_product"),
    ('[pods.gpu]\nvolumes = [{name = "x", mountPath = "/dev/shm", secret = "s"}]', "would replace or hide"),
    ('[pods.gpu]\nvolumes = [{name = "artifacts", mountPath = "/data", secret = "s"}]', "would replace or hide"),
    ('[pods.gpu]\nvolumes = [{name = "x", mountPath = "/data"}]', "needs exactly one of"),
    # a path the container resolves to replayjob's own mount, written so that it does not compare equal to it
    *((f'[pods.gpu]\nvolumes = [{{name = "x", mountPath = "{path}", persistentVolumeClaim = "mine"}}]',
       "is not a plain absolute path") for path in ("//artifacts", "/./artifacts", "/x/../artifacts", "/dev//shm",
                                                   "/data/")),
    ("[pods.gpu]\ntolerations = [{key = 1}]", "Expected `str | null`, got `int`"),
    ('[pods.gpu]\ntolerations = [{key = "a", effect = "Sometimes"}]', "Invalid enum value 'Sometimes'"),
    ("[pods.other]\nlabels = {}", "unknown field `other`"),
    ("[pods.all]\ncontainers = []", "one `replayjob step` command"),
    ('[pods.all]\nimagePullSecrets = ["Not A Name"]', "imagePullSecrets[0]"),
    # what the API server refuses, refused before a pod is rendered: a term of the wrong shape (no traceback) ...
    ('[pods.gpu]\naffinity = {podAntiAffinity = {requiredDuringSchedulingIgnoredDuringExecution = "abc"}}',
     "affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution: Expected `array`, got `str`"),
    ('[pods.gpu]\naffinity = {podAntiAffinity = {requiredDuringSchedulingIgnoredDuringExecution = {a = 1}}}',
     "Expected `array`, got `object`"),
    ("[pods.gpu]\naffinity = {nodeAffinity = {foo = 1}}", "affinity.nodeAffinity: Object contains unknown field"),
    ('[pods.gpu]\naffinity = {podAffinity = {preferredDuringSchedulingIgnoredDuringExecution = [{weight = 0, '
     'podAffinityTerm = {topologyKey = "kubernetes.io/hostname"}}]}}', "Expected `int` >= 1"),
    # ... tolerations as the API validates them ...
    ('[pods.gpu]\ntolerations = [{key = "a", operator = "Exists", value = "x"}]', "Exists takes no value"),
    ('[pods.gpu]\ntolerations = [{key = "a", value = "x", effect = "NoSchedule", tolerationSeconds = 30}]',
     "tolerationSeconds applies to the NoExecute effect only"),
    ('[pods.gpu]\ntolerations = [{value = "x"}]', "its operator must be Exists"),
    ('[pods.gpu]\ntolerations = [{key = "bad key!", value = "x"}]', "tolerations[0].key"),
    ('[pods.gpu]\ntolerations = [{key = "k", value = "bad value!"}]', "tolerations[0].value"),
    # ... names and label keys ...
    ('[pods.gpu]\nschedulerName = "My Scheduler"', "pods.gpu.schedulerName"),
    ('[pods.gpu]\nvolumes = [{name = "x", mountPath = "/data", secret = "Not A Name"}]', "volumes[0].secret"),
    ('[pods.gpu]\nlabels = {"a..b/c" = "x"}', "pods.gpu.labels (a key)"),
    ('[pods.gpu]\nvolumes = [{name = "x", mountPath = "/da\\nta", secret = "s"}]', "volumes[0].mountPath"),
    # ... two volumes of one pod under one name or at one path, [pods.all]'s and [pods.gpu]'s together ...
    ('[pods.all]\nvolumes = [{name = "x", mountPath = "/data", secret = "s"}]\n'
     '[pods.gpu]\nvolumes = [{name = "x", mountPath = "/data2", secret = "s"}]', "have the name x"),
    ('[pods.cpu]\nvolumes = [{name = "x", mountPath = "/data", secret = "s"}, '
     '{name = "y", mountPath = "/data", secret = "t"}]', "CPU stage pods have the mountPath /data"),
    # ... and a volume over the image's code
    *((f'[pods.gpu]\nvolumes = [{{name = "x", mountPath = "{path}", secret = "s"}}]', "would replace or hide the "
       "image's code") for path in ("/usr", "/opt/venv", "/usr/lib/python3", "/lib64")),
])
def test_what_would_change_a_replay_or_its_isolation_is_refused_with_the_reason(table: str, said: str) -> None:
    text = SPEC.read_text(encoding="utf-8") + "\n" + table + "\n"
    with pytest.raises(ConfigError) as err:
        spec_from_text(text, "spec")
    assert said in str(err.value), str(err.value)


def test_the_documented_keys_are_the_declared_ones() -> None:
    assert list(pods.FIELD_DOCS) == [f.name for f in msgspec.structs.fields(pods.PodSettings)]


def test_the_committed_workflow_is_named_from_the_content_it_runs() -> None:
    """Applying argo/ablation.yaml again is a no-op (same name); a changed spec, image or capture is a new
    Workflow (a new run), never an update of a finished one."""
    spec, text = load_spec_text(SPEC)
    wf = argo.render(spec, text)[1]
    digest = argo.content_sha256(spec, text)
    assert wf["metadata"]["name"] == f"{spec.name}-{digest[:10]}" and len(wf["metadata"]["name"]) <= 63
    assert wf["metadata"]["annotations"][argo.CONTENT_ANNOTATION] == digest
    assert argo.render(*load_spec_text(SPEC))[1] == wf  # the same file: the same object
    edited = text.replace("repeats = 3", "repeats = 2")
    assert edited != text
    other = argo.render(spec_from_text(edited), edited)[1]
    assert other["metadata"]["name"] != wf["metadata"]["name"]
    assert other["spec"]["workflowTemplateRef"] == wf["spec"]["workflowTemplateRef"]  # one template, updated
    image = argo.render(dataclasses.replace(spec, image="replayjob:0.2.0"), text)[1]
    assert image["metadata"]["name"] != wf["metadata"]["name"]


def test_a_run_of_a_customised_spec_is_recorded_and_fingerprinted(customised: tuple[Any, str], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The run record holds [pods] as data, and two specs that differ only there are two runs."""
    from replayjob.launch import step

    spec, _ = customised
    plain, _ = load_spec_text(SPEC)
    assert step.fingerprint(spec, "img") != step.fingerprint(dataclasses.replace(spec, pods=plain.pods), "img")
    doc = step.spec_document(spec)
    assert doc["pods"]["gpu"]["runtimeClassName"] == "nvidia" and json.loads(json.dumps(doc))["pods"] == doc["pods"]
