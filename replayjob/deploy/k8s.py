"""Kubernetes manifests for an ablation (PVC, capture Job, one Indexed replay Job per arm, reduce Job).

``render(spec)`` returns plain dicts in the Kubernetes API's own field names; ``k8s/base/`` is
``write(render(load_spec("examples/ablation.toml")), "k8s/base")`` committed, and a test keeps the two
identical.  ``replayjob.deploy.submit`` creates the same objects with the kubernetes client.

Decisions written once here:

* exit codes decide failure: ``podFailurePolicy`` fails the Job at once on exit 1 (a verdict) or 2
  (refused input), ignores disruptions (preemption, eviction, node drain) and lets every other
  failure (OOM kill, lost node, image pull) count against ``backoffLimit``/``backoffLimitPerIndex``;
* GPU pods request one ``nvidia.com/gpu`` with requests equal to limits (Guaranteed QoS), select the
  GPU product by ``nvidia.com/gpu.product``, tolerate the ``nvidia.com/gpu`` taint and refuse to share
  a node with another replayjob GPU pod (required pod anti-affinity on the hostname), so neighbours
  cannot skew timings;
* every pod meets the "restricted" Pod Security Standard, mounts no service-account token, and has a
  read-only root filesystem with emptyDirs for /tmp, caches and /dev/shm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from replayjob.deploy.ablation import DETERMINISM_ENV, AblationSpec
from replayjob.deploy.commands import command
from replayjob.fsio import atomic_write_text

KUBERNETES_VERSION = "1.33"  # the API the manifests are validated against
MOUNT = "/artifacts"
CONTAINER = "replayjob"
UID = 10001
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
EXCLUSIVE_LABEL = "replayjob.dev/gpu-exclusive"
TTL_S = 7 * 24 * 3600
Doc = dict[str, Any]

# Fail the Job on a verdict (1) or a refusal (2); never count a disruption as a failure.
POD_FAILURE_RULES: list[Doc] = [
    {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [1, 2]}},
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
]

RUNTIME_ENV: dict[str, str] = {
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "XDG_CACHE_HOME": "/cache",
    "HF_HOME": "/cache/huggingface",
    "HF_HUB_OFFLINE": "1",
    "TRITON_CACHE_DIR": "/cache/triton",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def run_dir(spec: AblationSpec) -> str:
    return f"{MOUNT}/runs/{spec.name}"


def labels(spec: AblationSpec, component: str, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "replayjob", "app.kubernetes.io/part-of": spec.name,
            "app.kubernetes.io/component": component, **extra}


def env_list(values: dict[str, str]) -> list[Doc]:
    return [{"name": k, "value": v} for k, v in values.items()]


def script_env(spec: AblationSpec) -> dict[str, str]:
    """What every container needs: run directory, config overrides, determinism and runtime env."""
    return {"REPLAYJOB_RUN_DIR": run_dir(spec), "REPLAYJOB_CONFIG_SETS": " ".join(spec.config_sets()),
            **DETERMINISM_ENV, **RUNTIME_ENV}


def resources(spec: AblationSpec, gpu: bool) -> Doc:
    amounts = {"cpu": spec.cpu, "memory": spec.memory, GPU_RESOURCE: "1"} if gpu else {"cpu": "1", "memory": "4Gi"}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def container_security() -> Doc:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_security() -> Doc:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


VOLUME_MOUNTS: list[Doc] = [
    {"name": "artifacts", "mountPath": MOUNT},
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "cache", "mountPath": "/cache"},
    {"name": "dshm", "mountPath": "/dev/shm"},
]


def volumes(spec: AblationSpec) -> list[Doc]:
    return [
        {"name": "artifacts", "persistentVolumeClaim": {"claimName": spec.claim_name}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}},
        {"name": "cache", "emptyDir": {"sizeLimit": "16Gi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm}},
    ]


def container(spec: AblationSpec, name: str, step: str, env: dict[str, str], gpu: bool) -> Doc:
    return {"name": name, "image": spec.image, "imagePullPolicy": "IfNotPresent",
            "command": command(step), "env": env_list({**script_env(spec), **env}),
            "resources": resources(spec, gpu), "securityContext": container_security(),
            "volumeMounts": [dict(m) for m in VOLUME_MOUNTS]}


def gpu_placement(spec: AblationSpec) -> Doc:
    """Node selection for GPU pods: product label, taint toleration, one such pod per node."""
    return {
        "nodeSelector": {GPU_PRODUCT_LABEL: spec.gpu_product},
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {EXCLUSIVE_LABEL: "true"}},
             "topologyKey": "kubernetes.io/hostname"}]}},
    }


def pod_template(spec: AblationSpec, component: str, containers: list[Doc], gpu: bool,
                 init: list[Doc] | None = None, arm: str | None = None) -> Doc:
    lab = labels(spec, component, **({"replayjob.dev/arm": arm} if arm else {}))
    if gpu:
        lab[EXCLUSIVE_LABEL] = "true"
    pod: Doc = {"restartPolicy": "Never", "automountServiceAccountToken": False,
                "enableServiceLinks": False, "securityContext": pod_security()}
    if init:
        pod["initContainers"] = init
    pod["containers"] = containers
    pod["volumes"] = volumes(spec)
    if gpu:
        pod.update(gpu_placement(spec))
    return {"metadata": {"labels": lab}, "spec": pod}


def job(spec: AblationSpec, name: str, component: str, body: Doc, template: Doc) -> Doc:
    lab = labels(spec, component)
    if EXCLUSIVE_LABEL in template["metadata"]["labels"]:
        lab[EXCLUSIVE_LABEL] = "true"  # lets an overlay patch every GPU Job (labelSelector)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": lab},
            "spec": {**body, "activeDeadlineSeconds": spec.deadline_s, "ttlSecondsAfterFinished": TTL_S,
                     "podFailurePolicy": {"rules": [dict(r) for r in POD_FAILURE_RULES]},
                     "template": template}}


def pvc(spec: AblationSpec) -> Doc:
    body: Doc = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.storage}}}
    if spec.storage_class:
        body["storageClassName"] = spec.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": spec.claim_name, "labels": labels(spec, "artifacts")}, "spec": body}


def capture_job(spec: AblationSpec) -> Doc:
    prepare = container(spec, "prepare", "prepare", {"REPLAYJOB_SEED": str(spec.seed)}, gpu=False)
    capture = container(spec, CONTAINER, "capture", {}, gpu=spec.gpu)
    tpl = pod_template(spec, "capture", [capture], spec.gpu, init=[prepare])
    return job(spec, f"{spec.name}-capture", "capture", {"backoffLimit": 2}, tpl)


def replay_job(spec: AblationSpec, arm: str) -> Doc:
    env = {"REPLAYJOB_ARM": arm, "REPLAYJOB_ARM_SETS": spec.arm(arm).words(),
           "REPLAYJOB_WAIT_S": str(spec.deadline_s)}
    tpl = pod_template(spec, "replay", [container(spec, CONTAINER, "replay", env, gpu=spec.gpu)],
                       spec.gpu, arm=arm)
    body = {"completionMode": "Indexed", "completions": spec.repeats,
            "parallelism": min(spec.repeats, spec.parallelism), "backoffLimitPerIndex": 2,
            "maxFailedIndexes": 0}
    return job(spec, f"{spec.name}-replay-{arm}", "replay", body, tpl)


def reduce_job(spec: AblationSpec) -> Doc:
    env = {"REPLAYJOB_ARMS": " ".join(a.name for a in spec.arms), "REPLAYJOB_REPEATS": str(spec.repeats),
           "REPLAYJOB_CLAIM": spec.claim, "REPLAYJOB_MIN_REPEATS": str(spec.effective_min_repeats),
           "REPLAYJOB_WAIT_S": str(spec.deadline_s)}
    tpl = pod_template(spec, "reduce", [container(spec, CONTAINER, "reduce", env, gpu=False)], False)
    return job(spec, f"{spec.name}-reduce", "reduce", {"backoffLimit": 0}, tpl)


def render(spec: AblationSpec) -> dict[str, Doc]:
    """File name -> manifest, in apply order, plus ``kustomization.yaml`` listing them."""
    files: dict[str, Doc] = {"pvc.yaml": pvc(spec), "capture.yaml": capture_job(spec)}
    for arm in spec.arms:
        files[f"replay-{arm.name}.yaml"] = replay_job(spec, arm.name)
    files["reduce.yaml"] = reduce_job(spec)
    files["kustomization.yaml"] = {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                   "kind": "Kustomization", "resources": list(files)}
    return files


class _Dumper(yaml.SafeDumper):
    """Block style, multi-line strings as literal blocks, keys in insertion order."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def dump(docs: list[Doc], header: str = "") -> str:
    """YAML text of one or more documents (``---`` separated), stable byte for byte."""
    body = "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=False)
                        for d in docs)
    return header + body


HEADER = ("# Rendered by `replayjob k8s render {source} --out {out}`; edit the spec, not this file.\n")


def write(files: dict[str, Doc], out: str | Path, source: str = "ablation.toml") -> list[Path]:
    """Write each manifest to ``out/NAME`` atomically; returns the paths."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, doc in files.items():
        path = d / name
        atomic_write_text(path, dump([doc], HEADER.format(source=source, out=out)))
        written.append(path)
    return written
