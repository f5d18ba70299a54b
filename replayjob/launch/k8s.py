"""Kubernetes manifests for an ablation: what outlives runs, applied once per namespace
(:func:`render_setup`, ``k8s/setup/``: the claim, the driver's service account and Role), apart from
one run's objects (:func:`render`, ``k8s/base/``: the spec ConfigMap and the driver Job), and the
stage Jobs the driver creates in the cluster (:func:`stage_jobs`: capture, one Indexed replay Job
for every arm and repeat, reduce).

``render(spec, text)`` returns plain dicts in the Kubernetes API's own field names; ``k8s/base/`` is
``write(render(*load_spec_text("examples/ablation.toml")), "k8s/base")`` committed (``k8s/setup/``
likewise), and a test keeps them identical.  ``replayjob.launch.submit`` creates a run's driver and
ConfigMap with the kubernetes client, and the driver (:mod:`replayjob.launch.k8s_driver`) its stages.
Every stage container runs one command, ``replayjob step STAGE --spec /etc/replayjob/ablation.toml
--run-dir /artifacts/runs/NAME/$(REPLAYJOB_RUN_ID) ...`` (no shell: replayjob receives SIGTERM
itself); the spec reaches the pods as a ConfigMap and is parsed there again, strictly.

Decisions written once here:

* **runs**: every object of a run carries the label ``replayjob.dev/run-id``; the pods read it
  through the downward API into their run directory, and ``replayjob step`` checks the run's
  fingerprint, so two runs never share artifacts.  A run's objects are named ``NAME-RUNID-...``; the
  kustomize base names no run: its driver takes the run id from its own Job's ``metadata.uid``, so
  two applies never share a run directory;
* **stages without deadlock, no client in the chain**: the driver creates each stage Job only after
  the previous one ended (replays only after the capture succeeded; the reducer after the replays,
  or after a capture that failed for good), so replays never hold GPUs while the capture waits for
  one; a replay admitted early anyway (a queue) waits for the capture (``--wait-s``,
  :data:`REPLAY_WAIT_S`);
* **owned objects**: the run's ConfigMap and stage Jobs are owned by the driver Job
  (``ownerReferences``, not as controller): they go with it (its TTL, ``kubectl delete``); only the
  driver's pod mounts a service-account token;
* **parallelism across arms**: one Indexed Job holds every replay (index -> arm, repeat by
  ``replayjob step``), so the spec's ``parallelism`` bounds all arms together;
* **ranks**: a run of N ranks (the spec's ``ranks`` for the capture, an arm's
  ``distributed.world_size`` for its replays) is one pod that requests N GPUs and starts the ranks
  with torchrun in its own process tree; every capture and replay command names its rank count
  (``--ranks N``), which ``replayjob step`` compares with the spec it reads (exit 2 on a mismatch).
  When arms run different rank counts, each count gets its own Indexed replay Job
  (``NAME-RUNID-replay-rN``, :meth:`~replayjob.artifacts.spec.AblationSpec.rank_groups`)
  whose completion index is the position among that count's replays (``--position``); the driver
  runs those Jobs one after another, so ``parallelism`` still bounds every replay at once.  The
  ranks share the pod's memory-backed ``/dev/shm`` (``shm``, which NCCL uses between the ranks and
  counts against the memory limit);
* **exit codes decide retries**: ``podFailurePolicy`` fails the Job at once on a final status
  (:data:`replayjob.errors.FINAL_EXIT_STATUSES`: 1, a verdict, or 2, refused input), counts every
  other failure (3, an error: nothing decided; a signal such as an OOM kill's 137; a lost node)
  against ``backoffLimit``/``backoffLimitPerIndex``, and ignores disruptions (preemption, eviction,
  drain).  ``maxFailedIndexes: 0``: a replay that fails for good stops its siblings;
* **deadlines**: ``deadline_s`` bounds every pod (the pod's own ``activeDeadlineSeconds``, as Argo's
  per-step one); a Job's deadline is sized from its waves (:func:`stage_deadline_s`: ``parallelism``
  pods at a time, every attempt), so 50 replays at parallelism 4 get 13 waves, not one pod's time;
* **render-time fields**: what the manifests were computed from
  (:meth:`~replayjob.artifacts.spec.AblationSpec.render_fields`) travels in every container
  (``REPLAYJOB_RENDERED``); ``replayjob step`` refuses a spec that differs (an edited ConfigMap);
* **GPU nodes**: the product label (and optionally the driver label) select nodes; the
  ``nvidia.com/gpu`` taint is tolerated; requests equal limits (Guaranteed QoS); a required pod
  anti-affinity on the hostname **across every namespace** keeps two pods labelled
  ``replayjob.dev/gpu-exclusive`` off one node; a pod requests one GPU per rank, or, with
  ``node_gpus = N``, every GPU of an N-GPU node so no other pod of any tenant can share it (its
  ranks, at most N, use the first of them; a run of more ranks spans nodes: one JobSet,
  :mod:`replayjob.launch.jobset`); ``cpu`` and ``memory`` are per
  rank (a pod of N ranks requests N times them); ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` are the
  CPU limit, divided among the ranks by the step;
* **queues and priorities**: ``queue`` labels every stage Job ``kueue.x-k8s.io/queue-name`` (Kueue
  admits it), not the driver (it would hold a quota reservation for the whole run while it waits);
  ``priority_class`` is every pod's (capture, replays, reduce), not only the GPU pods';
* **Kubernetes >= 1.29** (:data:`MIN_KUBERNETES_VERSION`): exit-code-only ``podFailurePolicy`` rules
  and ``backoffLimitPerIndex``; validated strictly at that version and at the latest;
* **provenance**: node name, pod name and image reference reach ``replay_metrics.json`` through the
  downward API and the environment (:mod:`replayjob.hostinfo`);
* **images by digest**: :func:`render` refuses a spec whose image has no ``@sha256:`` unless it
  declares ``image_policy = "local"``; the base's ``kustomizeconfig.yaml`` makes kustomize's
  ``images:`` (in the base or any overlay) rewrite ``REPLAYJOB_IMAGE_REF`` with the container image,
  so the run's fingerprint always sees the image that runs;
* every pod meets the "restricted" Pod Security Standard and has a read-only root filesystem with
  emptyDirs for /tmp (and, for a stage, caches and /dev/shm); no pod but the driver's mounts a
  service-account token.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from replayjob.artifacts import pods
from replayjob.artifacts.spec import RENDERED_ENV, AblationSpec, scale_quantity
from replayjob.errors import FINAL_EXIT_STATUSES, UsageError
from replayjob.fsio import atomic_write_text

# The oldest Kubernetes the manifests run on: Jobs' podFailurePolicy rules on exit codes alone (1.27 and
# 1.28 require onPodConditions in every rule) and backoffLimitPerIndex (beta, on by default, in 1.29);
# they are validated strictly at the oldest and at the latest API.
MIN_KUBERNETES_VERSION = "1.29"
LATEST_KUBERNETES_VERSION = "1.37"
KUBERNETES_VERSIONS = (MIN_KUBERNETES_VERSION, LATEST_KUBERNETES_VERSION)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RETRIES = 2  # of a pod that exits 3 or fails for an infrastructure reason (Jobs' backoff limits, Argo)
ATTEMPTS = RETRIES + 1
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
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"  # set on a Job's pods by the Job controller
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
REPLAY_WAIT_S = 600  # a replay admitted early (a queue) or on a node that sees the capture late waits this long
DRIVER = "driver"
ARTIFACTS_ENV = "REPLAYJOB_ARTIFACTS"  # where the driver's pod mounts the claim (read-only: it reads the verdict)
VERDICT_KEY = "verdict.json"  # the key of the run's ConfigMap the driver publishes the verdict under
SPEC_ANNOTATION = "replayjob.dev/spec-sha256"  # on a driver Job: the SHA-256 of the spec text it was rendered from
RUN_ID_PATTERN = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
TTL_S = 7 * 24 * 3600
Doc = dict[str, Any]

# Fail the Job on a decided outcome (replayjob.errors.FINAL_EXIT_STATUSES: a verdict, 1, or a
# refusal, 2); count every other failure (3, a signal such as 137, a pod past its deadline) against
# the backoff limits, so it is retried; never count a disruption (preemption, eviction, drain).
POD_FAILURE_RULES: list[Doc] = [
    {"action": "FailJob", "onExitCodes": {"operator": "In", "values": sorted(FINAL_EXIT_STATUSES)}},
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {"action": "Count", "onExitCodes": {"operator": "NotIn", "values": sorted(FINAL_EXIT_STATUSES)}},
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
    """The labels of every object; the run id's only when the run id is known at render time (a
    submission, a resumed run, the stages the driver creates; not the kustomize base)."""
    out = {"app.kubernetes.io/name": "replayjob", "app.kubernetes.io/part-of": spec.name,
           "app.kubernetes.io/component": component, **extra}
    if run_id is not None:
        out[RUN_ID_LABEL] = run_id
    return out


def env_list(values: dict[str, str]) -> list[Doc]:
    return [{"name": k, "value": v} for k, v in values.items()]


def field_env(name: str, path: str) -> Doc:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def threads_env() -> list[Doc]:
    """OMP/MKL threads = the container's CPU limit (rounded up), so BLAS does not oversubscribe."""
    return [{"name": name, "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1"}}}
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")]


def static_env(image: str, spec: AblationSpec) -> dict[str, str]:
    """Determinism, runtime and provenance environment every replayjob container gets, and the fields
    the manifests were rendered with (which ``replayjob step`` compares with the spec it reads).  The
    determinism environment is the spec's (:meth:`~replayjob.artifacts.spec.AblationSpec.determinism_env`:
    the math mode of its existing capture), set explicitly: it overrides the image's own ``ENV``."""
    return {**spec.determinism_env(), **RUNTIME_ENV, "REPLAYJOB_IMAGE_REF": image,
            RENDERED_ENV: rendered_value(spec)}


def rendered_value(spec: AblationSpec) -> str:
    """:meth:`~replayjob.artifacts.spec.AblationSpec.render_fields` as compact canonical JSON."""
    import json

    return json.dumps(spec.render_fields(), sort_keys=True, separators=(",", ":"))


def waves(n: int, parallelism: int) -> int:
    """How many rounds ``n`` pods take, ``parallelism`` at a time."""
    return -(-n // max(1, parallelism))


def stage_deadline_s(spec: AblationSpec, pods: int = 1) -> int:
    """A Job's whole deadline: its pods in waves of ``parallelism``, every wave retried up to
    :data:`RETRIES` times, each attempt bounded by the pods' own ``deadline_s``."""
    return spec.deadline_s * ATTEMPTS * waves(pods, spec.parallelism)


def run_deadline_s(spec: AblationSpec, *, concurrent_counts: bool) -> int:
    """A whole run's deadline: capture, the replays' waves and reduce, every attempt of each.  With
    ``concurrent_counts`` (Argo: one DAG ``parallelism`` over every rank count's replays) the replays
    are one fan-out; otherwise (Jobs) one Job per rank count, one after another."""
    counts = spec.rank_groups().values()
    replays = waves(spec.size, spec.parallelism) if concurrent_counts else sum(
        waves(len(ix), spec.parallelism) for ix in counts)
    return spec.deadline_s * ATTEMPTS * (2 + replays)


def step_command(stage: str, run_dir: str, *extra: str) -> list[str]:
    """The container command of ``stage``: one ``replayjob step`` invocation, no shell."""
    return ["replayjob", "step", stage, "--spec", SPEC_FILE, "--run-dir", run_dir, *extra]


def gpu_count(spec: AblationSpec, ranks: int) -> int:
    """GPUs a pod of ``ranks`` ranks requests: one per rank, or the whole node with ``node_gpus`` (a pod
    runs at most that many: a run of more spans nodes, ``ranks`` being then this node's share)."""
    return spec.node_gpus or ranks


def resources(spec: AblationSpec, gpu: bool, ranks: int = 1) -> Doc:
    """Requests equal to limits.  ``cpu`` and ``memory`` are per rank: a pod of N ranks requests N
    times them (N times one CPU and 4Gi without a GPU), so each rank's share
    (``OMP_NUM_THREADS`` / N, :func:`replayjob.runtime.slurm_ranks.rank_thread_env`) stays the spec's."""
    cpu, memory = (spec.cpu, spec.memory) if gpu else ("1", "4Gi")
    amounts = {"cpu": scale_quantity(cpu, ranks), "memory": scale_quantity(memory, ranks)}
    if gpu:
        amounts[GPU_RESOURCE] = str(gpu_count(spec, ranks))
    return {"requests": dict(amounts), "limits": dict(amounts)}


def container_security() -> Doc:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_security() -> Doc:
    # OnRootMismatch: the kubelet changes the claim's ownership only when its root is not already
    # fsGroup's, instead of walking every run's files at each pod start
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


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
    env = [*env_list(static_env(spec.image, spec)),
           field_env("REPLAYJOB_RUN_ID", f"metadata.labels['{RUN_ID_LABEL}']"),
           field_env("REPLAYJOB_NODE_NAME", "spec.nodeName"), field_env("REPLAYJOB_POD_NAME", "metadata.name"),
           *threads_env(), *extra_env]
    return {"name": CONTAINER, "image": spec.image, "imagePullPolicy": "IfNotPresent", "command": command,
            "env": env, "resources": resources(spec, gpu, ranks), "securityContext": container_security(),
            "volumeMounts": [*(dict(m) for m in VOLUME_MOUNTS),
                             {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}]}


def gpu_placement(spec: AblationSpec) -> Doc:
    """Node selection for GPU pods: product (and driver) label, taint toleration, one such pod per
    node across all namespaces."""
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
    return out


def pod_template(spec: AblationSpec, component: str, cont: Doc, gpu: bool, run_id: str | None,
                 ranks: int | None = None) -> Doc:
    lab = labels(spec, component, run_id)
    if gpu:
        lab[EXCLUSIVE_LABEL] = "true"
    if ranks is not None:
        lab[RANKS_LABEL] = str(ranks)
    pod: Doc = {"restartPolicy": "Never", "activeDeadlineSeconds": spec.deadline_s,  # per pod, as on Argo
                "automountServiceAccountToken": False,
                "enableServiceLinks": False, "securityContext": pod_security(), "containers": [cont],
                "volumes": [*volumes(spec), {"name": "spec", "configMap": {"name": f"{prefix(spec, run_id)}-spec"}}]}
    if gpu:
        pod.update(gpu_placement(spec))
    if spec.priority_class:  # every pod of the run, GPU or not: a stage never waits behind another's priority
        pod["priorityClassName"] = spec.priority_class
    meta: Doc = {"labels": lab}
    pods.apply(pod, meta, cont, pods.for_stage(spec.pods, gpu=gpu))  # the spec's [pods], as on Argo
    return {"metadata": meta, "spec": pod}


def job(spec: AblationSpec, component: str, body: Doc, template: Doc, run_id: str | None, suffix: str = "",
        pods: int = 1) -> Doc:
    lab = labels(spec, component, run_id)
    for key in (EXCLUSIVE_LABEL, RANKS_LABEL):  # lets an overlay patch every GPU Job (labelSelector)
        if key in template["metadata"]["labels"]:
            lab[key] = template["metadata"]["labels"][key]
    if spec.queue:  # Kueue admits the Job (it suspends it until its LocalQueue has quota)
        lab[QUEUE_LABEL] = spec.queue
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{prefix(spec, run_id)}-{component}{suffix}", "labels": lab},
            "spec": {**body, "activeDeadlineSeconds": stage_deadline_s(spec, pods), "ttlSecondsAfterFinished": TTL_S,
                     "podFailurePolicy": {"rules": [dict(r) for r in POD_FAILURE_RULES]},
                     "template": template}}


def run_dir(spec: AblationSpec) -> str:
    """The run directory as a container sees it ($(REPLAYJOB_RUN_ID) is expanded by the kubelet)."""
    return f"{MOUNT}/runs/{spec.name}/$(REPLAYJOB_RUN_ID)"


def spec_config_map(spec: AblationSpec, text: str, run_id: str | None = None) -> Doc:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{prefix(spec, run_id)}-spec", "labels": labels(spec, "spec", run_id)},
            "data": {"ablation.toml": text}}


# The claim holds every run's data: GitOps tools that prune what left the repository keep it.
KEEP_ANNOTATIONS = {"argocd.argoproj.io/sync-options": "Delete=false", "kustomize.toolkit.fluxcd.io/prune": "disabled"}


def pvc(spec: AblationSpec) -> Doc:
    body: Doc = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.storage}}}
    if spec.storage_class:
        body["storageClassName"] = spec.storage_class
    lab = labels(spec, "artifacts")  # shared by runs: no run id
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": spec.claim_name, "labels": lab, "annotations": dict(KEEP_ANNOTATIONS)},
            "spec": body}


OwnerRef = Doc  # an ownerReferences entry: a stage, a spec ConfigMap goes with the driver that owns it


def owner_reference(job: Doc) -> OwnerRef:
    """The ownerReferences entry naming a created Job (its uid): deleting it (its TTL) deletes what
    it owns.  ``controller: false``: Kueue queues an owned Job on its own, and the Job controller
    manages pods only."""
    meta = job["metadata"]
    return {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"],
            "controller": False, "blockOwnerDeletion": False}


def owned(doc: Doc, owner: OwnerRef | None) -> Doc:
    if owner is not None:
        doc["metadata"]["ownerReferences"] = [dict(owner)]
    return doc


def _queued(spec: AblationSpec, body: Doc) -> Doc:
    """With a queue, a Job is created suspended: Kueue starts it when its LocalQueue admits it."""
    return {"suspend": True, **body} if spec.queue else body


def capture_job(spec: AblationSpec, run_id: str, owner: OwnerRef | None = None) -> Doc:
    cont = container(spec, step_command("capture", run_dir(spec), "--ranks", str(spec.ranks)), spec.gpu,
                     ranks=spec.ranks)
    return owned(job(spec, "capture", _queued(spec, {"backoffLimit": RETRIES}),
                      pod_template(spec, "capture", cont, spec.gpu, run_id, spec.ranks), run_id), owner)


def replay_files(spec: AblationSpec) -> list[str]:
    """The replay Jobs' names, in the order they run: ``replay.yaml`` when every replay runs the same
    number of ranks, else ``replay-rN.yaml`` per rank count (ascending); none for a rank count whose
    replays span nodes (one JobSet each: :mod:`replayjob.launch.jobset`)."""
    groups = spec.rank_groups()
    return [f for f, n in zip(["replay.yaml"] if len(groups) == 1 else [f"replay-r{n}.yaml" for n in groups],
                              groups, strict=True) if spec.nodes_for(n)[0] == 1]


def replay_jobs(spec: AblationSpec, run_id: str, owner: OwnerRef | None = None) -> list[Doc]:
    """One Indexed Job per rank count (:func:`replay_files`): index -> replay by ``replayjob step``,
    which waits (bounded: :data:`REPLAY_WAIT_S`) for the capture rather than refusing when a queue
    admits it early."""
    groups = spec.rank_groups()
    out = []
    for ranks, indexes in groups.items():
        if spec.nodes_for(ranks)[0] > 1:  # replays across nodes: one JobSet each (replayjob.launch.jobset)
            continue
        where = ["--index"] if len(groups) == 1 else ["--position"]  # the same number with a single group
        cont = container(spec, step_command("replay", run_dir(spec), *where, "$(REPLAYJOB_INDEX)",
                                            "--ranks", str(ranks), "--wait-s", str(REPLAY_WAIT_S)), spec.gpu,
                         [field_env("REPLAYJOB_INDEX", f"metadata.annotations['{INDEX_ANNOTATION}']")], ranks)
        body = {"completionMode": "Indexed", "completions": len(indexes),
                "parallelism": min(len(indexes), spec.parallelism), "backoffLimitPerIndex": RETRIES,
                "maxFailedIndexes": 0}
        out.append(owned(job(spec, "replay", _queued(spec, body),
                              pod_template(spec, "replay", cont, spec.gpu, run_id, ranks), run_id,
                              "" if len(groups) == 1 else f"-r{ranks}", pods=len(indexes)), owner))
    return out


def reduce_job(spec: AblationSpec, run_id: str, owner: OwnerRef | None = None) -> Doc:
    cont = container(spec, step_command("reduce", run_dir(spec)), False)
    return owned(job(spec, "reduce", _queued(spec, {"backoffLimit": RETRIES}),
                      pod_template(spec, "reduce", cont, False, run_id), run_id), owner)


def stage_jobs(spec: AblationSpec, run_id: str, owner: OwnerRef | None = None) -> dict[str, Doc]:
    """The Jobs of one run, in the order the driver creates them (each when its turn has come):
    capture, one replay Job per rank count, reduce; owned by ``owner`` (the driver).  A capture or a rank
    count whose runs span nodes has no Job here: it runs as JobSets (:mod:`replayjob.launch.jobset`)."""
    capture = {} if "capture" in spec.across_nodes() else {"capture.yaml": capture_job(spec, run_id, owner)}
    return {**capture,
            **dict(zip(replay_files(spec), replay_jobs(spec, run_id, owner), strict=True)),
            "reduce.yaml": reduce_job(spec, run_id, owner)}


# --- the driver: a Job that chains the stages in the cluster ----------------------------------------

def driver_account(spec: AblationSpec) -> str:
    return f"{spec.name}-{DRIVER}"


def driver_rbac(spec: AblationSpec) -> dict[str, Doc]:
    """The driver's service account and its namespaced Role: create and follow the run's Jobs, read
    their pods (exit codes; its own image), keep the run's spec ConfigMap.  No other pod mounts a token."""
    name = driver_account(spec)
    meta = {"name": name, "labels": labels(spec, DRIVER)}
    rules = [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "create", "patch"]},
             {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["get"]},
             {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
             {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},  # FailedCreate is only an Event
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"]}]
    if spec.across_nodes():  # runs across nodes are JobSets (replayjob.launch.jobset), created and followed alike
        rules.append({"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"],
                      "verbs": ["get", "list", "create", "patch"]})
    return {
        "serviceaccount.yaml": {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta),
                                "automountServiceAccountToken": False},  # the driver's pod asks for it
        "role.yaml": {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
                      "rules": rules},
        "rolebinding.yaml": {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                             "metadata": dict(meta),
                             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                             "subjects": [{"kind": "ServiceAccount", "name": name}]},
    }


DRIVER_RESOURCES = {"cpu": "500m", "memory": "512Mi"}


def check_run_id(run_id: str, where: str = "run id") -> str:
    """``run_id`` when it is a DNS-label fragment (it names objects and is a label value and a selector
    term), checked before any request; else :class:`~replayjob.errors.UsageError` (a comma, a ``=``, ...)."""
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise UsageError(f"run id {run_id!r} is not a run id: lower-case letters, digits and '-', at most 40, "
                         "starting and ending with a letter or digit", where=where,
                         hint="use the run id `k8s submit` printed")
    return run_id


def check_name(name: str, what: str, rule: str = pods.DNS_LABEL) -> str:
    """``name`` when Kubernetes would take it as a ``what`` (a namespace: a DNS-1123 label; an object: ``rule``),
    checked before any request names it in a path; else :class:`~replayjob.errors.UsageError`."""
    if not re.fullmatch(rule, name):
        raise UsageError(f"{what} {name!r} is not a name Kubernetes takes: lower-case letters, digits and '-'"
                         + (" ('.' between parts)" if rule != pods.DNS_LABEL else ", at most 63") +
                         ", starting and ending with a letter or digit", where=what)
    return name


def spec_sha256(text: str) -> str:
    """The SHA-256 of a run's spec text, which its driver Jobs carry (:data:`SPEC_ANNOTATION`)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def driver_job(spec: AblationSpec, run_id: str | None, config_map: str, suffix: str = "",
               text: str | None = None) -> Doc:
    """The in-cluster driver: ``replayjob k8s drive``, which creates the run's spec ConfigMap and its
    stage Jobs one after another (owned by this Job), waits for each and exits with the reducer's
    code.  Its run id is ``run_id`` (a submission, a resumed run) or, in the kustomize base, derived
    from this Job's own ``metadata.uid``, so two applies never share a run directory."""
    env = [*env_list(static_env(spec.image, spec)), {"name": "REPLAYJOB_GPU_PRODUCT", "value": spec.gpu_product},
           field_env("REPLAYJOB_RUN_ID", f"metadata.labels['{RUN_ID_LABEL}']"),
           field_env("REPLAYJOB_DRIVER_UID", f"metadata.labels['{CONTROLLER_UID_LABEL}']"),
           field_env("REPLAYJOB_DRIVER_JOB", f"metadata.labels['{JOB_NAME_LABEL}']"),
           field_env("REPLAYJOB_POD_NAME", "metadata.name"), field_env("REPLAYJOB_NAMESPACE", "metadata.namespace"),
           {"name": ARTIFACTS_ENV, "value": MOUNT}]
    cont = {"name": CONTAINER, "image": spec.image, "imagePullPolicy": "IfNotPresent",
            "command": ["replayjob", "k8s", "drive", "--spec", SPEC_FILE], "env": env,
            "resources": {"requests": dict(DRIVER_RESOURCES), "limits": dict(DRIVER_RESOURCES)},
            "securityContext": container_security(),
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                             {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
                             {"name": "artifacts", "mountPath": MOUNT, "readOnly": True}]}
    deadline = run_deadline_s(spec, concurrent_counts=False)
    pod: Doc = {"restartPolicy": "Never", "activeDeadlineSeconds": deadline, "serviceAccountName": driver_account(spec),
                "automountServiceAccountToken": True,  # the only pod of a run that talks to the API
                "enableServiceLinks": False, "securityContext": pod_security(), "containers": [cont],
                "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                            {"name": "spec", "configMap": {"name": config_map}},
                            {"name": "artifacts", "persistentVolumeClaim": {"claimName": spec.claim_name,
                                                                            "readOnly": True}}]}
    if spec.priority_class:
        pod["priorityClassName"] = spec.priority_class
    # no queue label: Kueue would hold a quota reservation for the driver for the whole run (up to the run's
    # deadline) while it only waits; its stages are queued, each when its turn comes
    lab = labels(spec, DRIVER, run_id)
    meta: Doc = {"name": f"{prefix(spec, run_id)}-{DRIVER}{suffix}", "labels": lab}
    if text is not None:  # `k8s resume` refuses a run whose ConfigMap now holds another spec
        meta["annotations"] = {SPEC_ANNOTATION: spec_sha256(text)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": RETRIES, "activeDeadlineSeconds": deadline,
                     "ttlSecondsAfterFinished": TTL_S,
                     "podFailurePolicy": {"rules": [dict(r) for r in POD_FAILURE_RULES]},
                     "template": {"metadata": {"labels": labels(spec, DRIVER, run_id)}, "spec": pod}}}


# kustomize's image transformer rewrites these fields too: an ``images:`` entry in this base or in any
# overlay over it changes REPLAYJOB_IMAGE_REF with the container's image, so the run's fingerprint
# always names the image that runs (an env value that is not a ``replayjob`` image is left alone).
KUSTOMIZE_CONFIG: Doc = {"images": [{"kind": "Job", "path": "spec/template/spec/containers/env/value"}]}
KUSTOMIZE_CONFIG_FILE = "kustomizeconfig.yaml"


def kustomization(resources: list[str], configurations: bool = False) -> Doc:
    doc: Doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources}
    if configurations:
        doc["configurations"] = [KUSTOMIZE_CONFIG_FILE]
    return doc


def is_manifest(doc: Doc) -> bool:
    """An API object (not kustomize's own files)."""
    return doc.get("kind") not in (None, "Kustomization")


def render_setup(spec: AblationSpec) -> dict[str, Doc]:
    """What outlives every run, applied once per namespace (``k8s/setup``): the claim that holds every
    run's data, and the driver's service account and Role.  Deleting it deletes that data; deleting a
    run (``k8s/base``) never does."""
    spec.check_cluster()
    files: dict[str, Doc] = {"pvc.yaml": pvc(spec), **driver_rbac(spec)}
    files["kustomization.yaml"] = kustomization(list(files))
    return files


def check_one_node(spec: AblationSpec, launcher: str) -> None:
    """Refuse (2) a spec with a run across nodes (:meth:`~replayjob.artifacts.spec.AblationSpec.across_nodes`)
    for a launcher that runs every capture and replay in one pod: that pod would request more GPUs than a
    node has, and never be scheduled."""
    runs = spec.across_nodes()
    if runs:
        what = ", ".join("the capture" if k == "capture" else f"replay {k}" for k in list(runs)[:4])
        raise UsageError(f"{what}{' ...' if len(runs) > 4 else ''} run{'s' if len(runs) == 1 else ''} on more than "
                         f"one node (node_gpus = {spec.node_gpus}), and {launcher} runs each capture and replay "
                         "in one pod", where="node_gpus",
                         hint="runs across nodes are JobSets, which the in-cluster driver creates (replayjob k8s "
                              "submit; docs/cluster.md, Multi-node replays), or Slurm jobs of several nodes "
                              "(scripts/slurm/submit.sh)")


def render(spec: AblationSpec, text: str, run_id: str | None = None) -> dict[str, Doc]:
    """One run's files (``k8s/base``): the spec ConfigMap and the driver Job, ``kustomization.yaml``
    listing them and kustomize's image configuration (:data:`KUSTOMIZE_CONFIG`); what outlives runs
    is :func:`render_setup`'s, the stages are :func:`stage_jobs` (the driver creates them).  Refused
    unless the spec can run on a cluster (:meth:`~replayjob.artifacts.spec.AblationSpec.check_cluster`)."""
    spec.check_cluster()
    cm = spec_config_map(spec, text, run_id)
    files: dict[str, Doc] = {"spec.yaml": cm, "driver.yaml": driver_job(spec, run_id, cm["metadata"]["name"],
                                                                         text=text)}
    files["kustomization.yaml"] = kustomization(list(files), configurations=True)
    files[KUSTOMIZE_CONFIG_FILE] = dict(KUSTOMIZE_CONFIG)
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


# What YAML reads as the end of a line (PyYAML: \x85, \u2028, \u2029 too) or no YAML text may hold.
_BREAKS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def header_text(template: str, **fields: str | Path) -> str:
    """A header comment with the paths the command named: a character that would end the comment's line (a
    newline in a file name) is written escaped, so no path puts a line of YAML into the manifests."""
    return template.format(**{k: _BREAKS.sub(lambda m: ascii(m.group())[1:-1], str(v)) for k, v in fields.items()})


HEADER = ("# Rendered by `replayjob k8s render {source} --out {out}`; edit the spec, not this file.\n")
SETUP_HEADER = ("# Rendered by `replayjob k8s render {source} --setup {out}`; edit the spec, not this file.\n"
                "# Applied once per namespace, before any run; deleting it deletes every run's data.\n")


def write(files: dict[str, Doc], out: str | Path, source: str = "ablation.toml", header: str = HEADER) -> list[Path]:
    """Write each manifest to ``out/NAME`` atomically; returns the paths."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, doc in files.items():
        path = d / name
        atomic_write_text(path, dump([doc], header_text(header, source=source, out=out)))
        written.append(path)
    return written
