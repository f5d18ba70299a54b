"""Kubernetes manifests for an ablation: the spec ConfigMap, the PVC and three Jobs (capture, one
Indexed replay Job for every arm and repeat, reduce).

``render(spec, text)`` returns plain dicts in the Kubernetes API's own field names; ``k8s/base/`` is
``write(render(*load_spec_text("examples/ablation.toml")), "k8s/base")`` committed, and a test keeps
the two identical.  ``replayjob.deploy.submit`` creates the same objects, per run, with the
kubernetes client.  Every container runs one command, ``replayjob step STAGE --spec
/etc/replayjob/ablation.toml --run-dir /artifacts/runs/NAME/$(REPLAYJOB_RUN_ID) ...`` (no shell:
replayjob receives SIGTERM itself); the spec reaches the pods as a ConfigMap and is parsed there
again, strictly.

Decisions written once here:

* **runs**: every object carries the label ``replayjob.dev/run-id``; the pods read it through the
  downward API into their run directory, and ``replayjob step`` checks the run's fingerprint, so two
  submissions never share artifacts.  ``submit`` names every object ``NAME-RUNID-...``; the static
  base uses the run id ``base`` (an overlay changes it);
* **stages without deadlock**: the replay and reduce Jobs are rendered suspended; ``submit`` creates
  each stage only after the previous one ended (replays only after the capture succeeded), and
  ``kubectl apply -k`` users resume them in that order (docs/cluster.md), so replays never hold GPUs
  while the capture waits for one;
* **parallelism across arms**: one Indexed Job holds every replay (index -> arm, repeat by
  ``replayjob step``), so the spec's ``parallelism`` bounds all arms together;
* **ranks**: a run of N ranks (the spec's ``ranks`` for the capture, an arm's
  ``distributed.world_size`` for its replays) is one pod that requests N GPUs and starts the ranks
  with torchrun in its own process tree; every capture and replay command names its rank count
  (``--ranks N``), which ``replayjob step`` compares with the spec it reads (exit 2 on a mismatch).
  When arms run different rank counts, each count gets its own Indexed replay Job
  (``replay-rN.yaml``, ``NAME-replay-rN``, :meth:`~replayjob.deploy.ablation.AblationSpec.rank_groups`)
  whose completion index is the position among that count's replays (``--position``); ``submit``
  runs those Jobs one after another, so ``parallelism`` still bounds every replay at once.  The
  ranks share the pod's memory-backed ``/dev/shm`` (``shm``, which NCCL uses between the ranks and
  counts against the memory limit);
* **exit codes decide retries**: ``podFailurePolicy`` fails the Job at once on exit 1 (a verdict) or
  2 (refused input), counts 3 (an error: nothing decided) and other failures (OOM kill, lost node)
  against ``backoffLimit``/``backoffLimitPerIndex``, and ignores disruptions (preemption, eviction,
  drain).  ``maxFailedIndexes: 0``: a replay that fails for good stops its siblings;
* **GPU nodes**: the product label (and optionally the driver label) select nodes; the
  ``nvidia.com/gpu`` taint is tolerated; requests equal limits (Guaranteed QoS); a required pod
  anti-affinity on the hostname **across every namespace** keeps two pods labelled
  ``replayjob.dev/gpu-exclusive`` off one node; a pod requests one GPU per rank, or, with
  ``node_gpus = N``, every GPU of an N-GPU node so no other pod of any tenant can share it (its
  ranks, at most N by the spec's validation, use the first of them); ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` are the
  CPU limit; an optional priority class;
* **provenance**: node name, pod name and image reference reach ``replay_metrics.json`` through the
  downward API and the environment (:mod:`replayjob.hostinfo`);
* every pod meets the "restricted" Pod Security Standard, mounts no service-account token, and has a
  read-only root filesystem with emptyDirs for /tmp, caches and /dev/shm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from replayjob.deploy.ablation import DETERMINISM_ENV, AblationSpec
from replayjob.fsio import atomic_write_text

KUBERNETES_VERSION = "1.33"  # the API the manifests are validated against
MOUNT = "/artifacts"
SPEC_DIR = "/etc/replayjob"
SPEC_FILE = f"{SPEC_DIR}/ablation.toml"
CONTAINER = "replayjob"
UID = 10001
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
EXCLUSIVE_LABEL = "replayjob.dev/gpu-exclusive"
RUN_ID_LABEL = "replayjob.dev/run-id"
RANKS_LABEL = "replayjob.dev/ranks"
BASE_RUN_ID = "base"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
TTL_S = 7 * 24 * 3600
Doc = dict[str, Any]

# Fail the Job on a verdict (1) or a refusal (2); retry an error (3) within the backoff limits;
# never count a disruption as a failure.
POD_FAILURE_RULES: list[Doc] = [
    {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [1, 2]}},
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "Count", "onExitCodes": {"operator": "In", "values": [3]}},
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


def prefix(spec: AblationSpec, run_id: str | None) -> str:
    """Object name prefix: the spec's name, plus the run id for a submission."""
    return spec.name if run_id is None else f"{spec.name}-{run_id}"


def labels(spec: AblationSpec, component: str, run_id: str | None = None, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "replayjob", "app.kubernetes.io/part-of": spec.name,
            "app.kubernetes.io/component": component, RUN_ID_LABEL: run_id or BASE_RUN_ID, **extra}


def env_list(values: dict[str, str]) -> list[Doc]:
    return [{"name": k, "value": v} for k, v in values.items()]


def field_env(name: str, path: str) -> Doc:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def threads_env() -> list[Doc]:
    """OMP/MKL threads = the container's CPU limit (rounded up), so BLAS does not oversubscribe."""
    return [{"name": name, "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1"}}}
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")]


def static_env(image: str) -> dict[str, str]:
    """Determinism, runtime and provenance environment every replayjob container gets."""
    return {**DETERMINISM_ENV, **RUNTIME_ENV, "REPLAYJOB_IMAGE_REF": image}


def step_command(stage: str, run_dir: str, *extra: str) -> list[str]:
    """The container command of ``stage``: one ``replayjob step`` invocation, no shell."""
    return ["replayjob", "step", stage, "--spec", SPEC_FILE, "--run-dir", run_dir, *extra]


def gpu_count(spec: AblationSpec, ranks: int) -> int:
    """GPUs a pod of ``ranks`` ranks requests: one per rank, or the whole node with ``node_gpus``
    (which the spec's validation keeps >= every run's ranks)."""
    return spec.node_gpus or ranks


def resources(spec: AblationSpec, gpu: bool, ranks: int = 1) -> Doc:
    amounts = ({"cpu": spec.cpu, "memory": spec.memory, GPU_RESOURCE: str(gpu_count(spec, ranks))} if gpu
               else {"cpu": "1", "memory": "4Gi"})
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


def container(spec: AblationSpec, command: list[str], gpu: bool, extra_env: Sequence[Doc] = (),
              ranks: int = 1) -> Doc:
    env = [*env_list(static_env(spec.image)), field_env("REPLAYJOB_RUN_ID", f"metadata.labels['{RUN_ID_LABEL}']"),
           field_env("REPLAYJOB_NODE_NAME", "spec.nodeName"), field_env("REPLAYJOB_POD_NAME", "metadata.name"),
           *threads_env(), *extra_env]
    return {"name": CONTAINER, "image": spec.image, "imagePullPolicy": "IfNotPresent", "command": command,
            "env": env, "resources": resources(spec, gpu, ranks), "securityContext": container_security(),
            "volumeMounts": [*(dict(m) for m in VOLUME_MOUNTS),
                             {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}]}


def gpu_placement(spec: AblationSpec) -> Doc:
    """Node selection for GPU pods: product (and driver) label, taint toleration, one such pod per
    node across all namespaces, an optional priority class."""
    selector = {GPU_PRODUCT_LABEL: spec.gpu_product}
    if spec.driver_version:
        selector[spec.driver_label] = spec.driver_version
    out: Doc = {
        "nodeSelector": selector,
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {EXCLUSIVE_LABEL: "true"}}, "namespaceSelector": {},
             "topologyKey": "kubernetes.io/hostname"}]}},
    }
    if spec.priority_class:
        out["priorityClassName"] = spec.priority_class
    return out


def pod_template(spec: AblationSpec, component: str, cont: Doc, gpu: bool, run_id: str | None,
                 ranks: int | None = None) -> Doc:
    lab = labels(spec, component, run_id)
    if gpu:
        lab[EXCLUSIVE_LABEL] = "true"
    if ranks is not None:
        lab[RANKS_LABEL] = str(ranks)
    pod: Doc = {"restartPolicy": "Never", "automountServiceAccountToken": False,
                "enableServiceLinks": False, "securityContext": pod_security(), "containers": [cont],
                "volumes": [*volumes(spec), {"name": "spec", "configMap": {"name": f"{prefix(spec, run_id)}-spec"}}]}
    if gpu:
        pod.update(gpu_placement(spec))
    return {"metadata": {"labels": lab}, "spec": pod}


def job(spec: AblationSpec, component: str, body: Doc, template: Doc, run_id: str | None, suffix: str = "") -> Doc:
    lab = labels(spec, component, run_id)
    for key in (EXCLUSIVE_LABEL, RANKS_LABEL):  # lets an overlay patch every GPU Job (labelSelector)
        if key in template["metadata"]["labels"]:
            lab[key] = template["metadata"]["labels"][key]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{prefix(spec, run_id)}-{component}{suffix}", "labels": lab},
            "spec": {**body, "activeDeadlineSeconds": spec.deadline_s, "ttlSecondsAfterFinished": TTL_S,
                     "podFailurePolicy": {"rules": [dict(r) for r in POD_FAILURE_RULES]},
                     "template": template}}


def run_dir(spec: AblationSpec) -> str:
    """The run directory as a container sees it ($(REPLAYJOB_RUN_ID) is expanded by the kubelet)."""
    return f"{MOUNT}/runs/{spec.name}/$(REPLAYJOB_RUN_ID)"


def spec_config_map(spec: AblationSpec, text: str, run_id: str | None = None) -> Doc:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{prefix(spec, run_id)}-spec", "labels": labels(spec, "spec", run_id)},
            "data": {"ablation.toml": text}}


def pvc(spec: AblationSpec) -> Doc:
    body: Doc = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.storage}}}
    if spec.storage_class:
        body["storageClassName"] = spec.storage_class
    lab = {k: v for k, v in labels(spec, "artifacts").items() if k != RUN_ID_LABEL}  # shared by runs
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": spec.claim_name, "labels": lab}, "spec": body}


def capture_job(spec: AblationSpec, run_id: str | None = None) -> Doc:
    cont = container(spec, step_command("capture", run_dir(spec), "--ranks", str(spec.ranks)), spec.gpu,
                     ranks=spec.ranks)
    return job(spec, "capture", {"backoffLimit": 2},
               pod_template(spec, "capture", cont, spec.gpu, run_id, spec.ranks), run_id)


def replay_files(spec: AblationSpec) -> list[str]:
    """The replay Jobs' file names, in the order they run: ``replay.yaml`` when every replay runs
    the same number of ranks, else ``replay-rN.yaml`` per rank count (ascending)."""
    groups = spec.rank_groups()
    return ["replay.yaml"] if len(groups) == 1 else [f"replay-r{n}.yaml" for n in groups]


def replay_jobs(spec: AblationSpec, run_id: str | None = None) -> list[Doc]:
    """One Indexed Job per rank count (:func:`replay_files`): index -> replay by ``replayjob step``."""
    groups = spec.rank_groups()
    out = []
    for ranks, indexes in groups.items():
        where = ["--index"] if len(groups) == 1 else ["--position"]  # the same number with a single group
        cont = container(spec, step_command("replay", run_dir(spec), *where, "$(REPLAYJOB_INDEX)",
                                            "--ranks", str(ranks)), spec.gpu,
                         [field_env("REPLAYJOB_INDEX", f"metadata.annotations['{INDEX_ANNOTATION}']")], ranks)
        body = {"suspend": True, "completionMode": "Indexed", "completions": len(indexes),
                "parallelism": min(len(indexes), spec.parallelism), "backoffLimitPerIndex": 2,
                "maxFailedIndexes": 0}
        out.append(job(spec, "replay", body, pod_template(spec, "replay", cont, spec.gpu, run_id, ranks), run_id,
                       "" if len(groups) == 1 else f"-r{ranks}"))
    return out


def reduce_job(spec: AblationSpec, run_id: str | None = None) -> Doc:
    cont = container(spec, step_command("reduce", run_dir(spec)), False)
    return job(spec, "reduce", {"suspend": True, "backoffLimit": 2},
               pod_template(spec, "reduce", cont, False, run_id), run_id)


def render(spec: AblationSpec, text: str, run_id: str | None = None) -> dict[str, Doc]:
    """File name -> manifest, in apply order, plus ``kustomization.yaml`` listing them."""
    files: dict[str, Doc] = {"spec.yaml": spec_config_map(spec, text, run_id), "pvc.yaml": pvc(spec),
                             "capture.yaml": capture_job(spec, run_id),
                             **dict(zip(replay_files(spec), replay_jobs(spec, run_id), strict=True)),
                             "reduce.yaml": reduce_job(spec, run_id)}
    files["kustomization.yaml"] = {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                   "kind": "Kustomization", "resources": list(files)}
    return files


class _Dumper(yaml.SafeDumper):
    """Block style, multi-line strings as literal blocks, keys in insertion order, no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


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
