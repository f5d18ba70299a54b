"""Pod customisation: what a cluster needs of every stage pod, declared in the spec's ``[pods]`` table.

Dedicated GPU pools carry their own taints and labels, a private registry needs pull secrets, cost
allocation and autoscalers read annotations, some clusters need a runtime class or a scheduler.  The
spec declares these once, for every stage pod (``[pods.all]``), the GPU stages (``[pods.gpu]``: the
capture and the replays on GPUs) or the CPU stages (``[pods.cpu]``: the reducer, and the capture and
replays of a ``device = "cpu"`` spec), and the Jobs (:mod:`replayjob.launch.k8s`), the Argo templates
(:mod:`replayjob.launch.argo`) and the in-cluster driver's stage Jobs apply them alike
(:func:`for_stage` then :func:`apply`).  A typed subset, read strictly (:class:`PodSettings`); unknown
keys are refused, and so is whatever would change what a replay measures or how it is isolated:

* the **determinism environment** and replayjob's own variables (``env`` may not name them: the
  spec's ``determinism_env()``, the runtime variables, ``REPLAYJOB_*``, ``OMP_NUM_THREADS``...);
* the **families of variables that change what a replay runs or measures** (:data:`ENV_FAMILIES`, each
  with its reason: the dynamic loader's ``LD_*``, Python's ``PYTHON*``, ``PYTORCH_*``, ``CUDNN_*``,
  ``TRITON_*``, the CPU math libraries' ``MKL_*``, ``OMP_*``, ``KMP_*``, ``GOMP_*``, ``OPENBLAS_*``,
  ``XLA_*``, and ROCm's ``HIP_*``, ``ROCBLAS_*``, ``HIPBLASLT_*``, ``MIOPEN_*``, ``HSA_*``, ``ROCR_*``), and a
  value holding a NUL byte (no process environment can carry it);
* the **security context** (``securityContext``, ``privileged``, host namespaces, capabilities: every
  pod meets the restricted Pod Security Standard, and only the driver mounts a token);
* replayjob's **own labels, node selector keys, volumes and mount paths** (the run id, the GPU
  product, ``/artifacts``, ``/dev/shm`` ...).

Example:
    >>> s = read_pods({"gpu": {"tolerations": [{"key": "dedicated", "value": "rl", "effect": "NoSchedule"}]}})
    >>> for_stage(s, gpu=True).tolerations[0].key
    'dedicated'
    >>> read_pods({"all": {"env": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}}})
    Traceback (most recent call last):
    ...
    replayjob.errors.ConfigError: pods.all.env: CUBLAS_WORKSPACE_CONFIG is replayjob's own variable: ...
    >>> read_pods({"gpu": {"env": {"LD_PRELOAD": "/opt/shim.so"}}})
    Traceback (most recent call last):
    ...
    replayjob.errors.ConfigError: pods.gpu.env: LD_PRELOAD is one of the dynamic loader's variables (LD_*): ...
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from replayjob.declaration import whole
from replayjob.errors import ConfigError
from replayjob.runtime.determinism import NCCL_NUMERICS

Doc = dict[str, Any]
# Kubernetes' own name rules: a DNS-1123 label, a DNS-1123 subdomain (dot-separated labels, 253 at most), a
# qualified name (an optional subdomain prefix and "/", then 63 characters at most) and a label value.
DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
DNS_SUBDOMAIN = r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
QUALIFIED_NAME = rf"({DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?"
LABEL_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
Name = Annotated[str, whole(DNS_LABEL)]
Subdomain = Annotated[str, whole(DNS_SUBDOMAIN)]
LabelKey = Annotated[str, whole(QUALIFIED_NAME)]
LabelValue = Annotated[str, whole(LABEL_VALUE)]
EnvName = Annotated[str, whole(r"[A-Za-z_][A-Za-z0-9_]*")]
Path_ = Annotated[str, whole(r"/[^:\x00-\x1f\x7f]*")]  # no ':' (a volume spec's separator), no control character
Weight = Annotated[int, msgspec.Meta(ge=1, le=100)]

# The security context and isolation are not customisable; say why when a spec tries.
FORBIDDEN = {
    "securityContext": "the security context is fixed: every pod meets the restricted Pod Security Standard",
    "privileged": "the security context is fixed: every pod meets the restricted Pod Security Standard",
    "capabilities": "the security context is fixed: every pod meets the restricted Pod Security Standard",
    "hostNetwork": "host namespaces would let a replay see (and disturb) the node's other work",
    "hostPID": "host namespaces would let a replay see (and disturb) the node's other work",
    "hostIPC": "host namespaces would let a replay see (and disturb) the node's other work",
    "automountServiceAccountToken": "only the driver's pod mounts a service-account token",
    "containers": "every stage runs one `replayjob step` command, rendered from the spec",
    "resources": "resources come from the spec's cpu, memory and GPU fields (requests equal limits)",
}
OWN_LABEL_PREFIXES = ("app.kubernetes.io/", "replayjob.dev/", "batch.kubernetes.io/", "kueue.x-k8s.io/",
                      "workflows.argoproj.io/", "jobset.sigs.k8s.io/")
# the Job controller's own labels without a prefix (its selector matches them)
OWN_LABELS = ("job-name", "controller-uid")
OWN_NODE_LABELS = ("nvidia.com/gpu.product",)
OWN_VOLUMES = ("artifacts", "tmp", "cache", "dshm", "spec")
OWN_PATHS = ("/artifacts", "/tmp", "/cache", "/dev/shm", "/etc/replayjob")
# Where the image's code lives (the interpreter, its libraries, /opt/venv, /opt/replayjob): a volume there would run
# other code than the image the run record names by its digest.
CODE_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/opt")
OWN_ENV = re.compile(r"(REPLAYJOB_.*|OMP_NUM_THREADS|MKL_NUM_THREADS|HOME|TMPDIR|XDG_CACHE_HOME|HF_HOME|"
                     r"HF_HUB_OFFLINE|TRITON_CACHE_DIR|PYTHONDONTWRITEBYTECODE|PYTHONHASHSEED|CUDA_.*|NCCL_.*|"
                     r"TORCH_.*|CUBLAS_.*|NVIDIA_.*)")

# Variables a spec's env may not set either, by family (a name that starts with the prefix): each changes what a
# replay runs or what it measures, unseen by the run record (the image's own environment is named by its digest).
ENV_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("LD_", "the dynamic loader's variables",
     "they load other libraries into the replay (LD_PRELOAD a shim, LD_LIBRARY_PATH another cuBLAS, cuDNN or "
     "NCCL than the image's): it would run other kernels than the ones its run record names"),
    ("PYTHON", "Python's variables",
     "they change what the interpreter imports and runs (PYTHONPATH and PYTHONSTARTUP other code, PYTHONOPTIMIZE "
     "drops assertions, PYTHONWARNINGS turns warnings into errors): the replay would not run the image's code"),
    ("PYTORCH_", "PyTorch's runtime variables",
     "they change the CUDA caching allocator and other runtime paths (PYTORCH_CUDA_ALLOC_CONF, "
     "PYTORCH_NO_CUDA_MEMORY_CACHING): the peak memory and the time a replay measures would be another's"),
    ("CUDNN_", "cuDNN's variables",
     "they change which cuDNN kernels run and how (algorithm choice, logging): other numbers and other timings"),
    ("TRITON_", "Triton's variables",
     "they change how Triton compiles, autotunes and caches its kernels: other kernels, other numbers and timings"),
    ("MKL_", "MKL's variables",
     "they change MKL's code path and threads (MKL_CBWR, MKL_ENABLE_INSTRUCTIONS, MKL_DYNAMIC): a CPU replay's "
     "reductions, so its numbers, and its time"),
    ("OMP_", "OpenMP's variables",
     "they change the OpenMP threads, their binding and scheduling: a CPU replay's reduction order and its time"),
    ("KMP_", "Intel OpenMP's variables",
     "they change the Intel OpenMP runtime's threads, affinity and spin time (KMP_AFFINITY, KMP_BLOCKTIME): a CPU "
     "replay's time, and with its threads its reductions"),
    ("GOMP_", "GNU OpenMP's variables",
     "they change the GNU OpenMP runtime's threads, affinity and spinning (GOMP_CPU_AFFINITY, GOMP_SPINCOUNT): a "
     "CPU replay's time, and with its threads its reductions"),
    ("OPENBLAS_", "OpenBLAS's variables",
     "they change OpenBLAS's threads and the kernels it picks for the CPU (OPENBLAS_NUM_THREADS, "
     "OPENBLAS_CORETYPE): a CPU replay's numbers and time"),
    ("XLA_", "XLA's variables",
     "they change how XLA compiles and runs its graphs (XLA_FLAGS: fusion, autotuning, the devices it sees): "
     "other kernels, other numbers and timings"),
    ("HIP_", "HIP's variables",
     "they change which AMD GPUs a replay sees and how HIP launches its kernels (HIP_VISIBLE_DEVICES, "
     "HIP_LAUNCH_BLOCKING): another device, other timings"),
    ("ROCBLAS_", "rocBLAS's variables",
     "they change the kernels rocBLAS picks and its tuning on AMD GPUs (ROCBLAS_TENSILE_LIBPATH, "
     "ROCBLAS_LAYER): other numbers and timings"),
    ("HIPBLASLT_", "hipBLASLt's variables",
     "they change the matmul kernels hipBLASLt picks on AMD GPUs: other numbers and timings"),
    ("MIOPEN_", "MIOpen's variables",
     "they change which MIOpen kernels run and how they are found and cached (MIOPEN_FIND_MODE): other numbers "
     "and timings"),
    ("HSA_", "the ROCm runtime's variables",
     "they change how the ROCm runtime drives the AMD GPU (HSA_OVERRIDE_GFX_VERSION runs kernels built for "
     "another chip): other kernels, other numbers and timings"),
    ("ROCR_", "the ROCm runtime's variables",
     "they change which AMD GPUs the ROCm runtime exposes (ROCR_VISIBLE_DEVICES): another device, other timings"),
)


def env_family(name: str) -> tuple[str, str, str] | None:
    """The :data:`ENV_FAMILIES` entry (prefix, family, reason) of variable ``name``, or None."""
    return next((f for f in ENV_FAMILIES if name.startswith(f[0])), None)


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Toleration(_Strict, frozen=True):
    """A toleration, with the API server's rules: a key is a qualified name, a value a label value; no key
    tolerates every taint and needs ``Exists``, which takes no value; ``tolerationSeconds`` only with
    ``NoExecute``."""

    key: LabelKey | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = None

    def __post_init__(self) -> None:
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key tolerates every taint: its operator must be Exists")
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration whose operator is Exists takes no value")
        if self.tolerationSeconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to the NoExecute effect only")


# The affinity terms, declared as the Kubernetes API (1.29) declares them, unknown keys refused.
class NodeSelectorRequirement(_Strict, frozen=True):
    key: Annotated[str, msgspec.Meta(min_length=1)]
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] = []


class NodeSelectorTerm(_Strict, frozen=True):
    matchExpressions: list[NodeSelectorRequirement] = []
    matchFields: list[NodeSelectorRequirement] = []


class NodeSelector(_Strict, frozen=True):
    nodeSelectorTerms: Annotated[list[NodeSelectorTerm], msgspec.Meta(min_length=1)]


class PreferredSchedulingTerm(_Strict, frozen=True):
    weight: Weight
    preference: NodeSelectorTerm


class NodeAffinity(_Strict, frozen=True):
    requiredDuringSchedulingIgnoredDuringExecution: NodeSelector | None = None
    preferredDuringSchedulingIgnoredDuringExecution: list[PreferredSchedulingTerm] = []


class LabelSelectorRequirement(_Strict, frozen=True):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []


class LabelSelector(_Strict, frozen=True):
    matchLabels: dict[LabelKey, LabelValue] = {}
    matchExpressions: list[LabelSelectorRequirement] = []


class PodAffinityTerm(_Strict, frozen=True):
    topologyKey: LabelKey
    labelSelector: LabelSelector | None = None
    namespaceSelector: LabelSelector | None = None
    namespaces: list[Name] = []


class WeightedPodAffinityTerm(_Strict, frozen=True):
    weight: Weight
    podAffinityTerm: PodAffinityTerm


class PodAffinity(_Strict, frozen=True):
    requiredDuringSchedulingIgnoredDuringExecution: list[PodAffinityTerm] = []
    preferredDuringSchedulingIgnoredDuringExecution: list[WeightedPodAffinityTerm] = []


class Affinity(_Strict, frozen=True):
    nodeAffinity: NodeAffinity | None = None
    podAffinity: PodAffinity | None = None
    podAntiAffinity: PodAffinity | None = None


class Volume(_Strict, frozen=True):
    """An extra volume and where the stage container mounts it (one source)."""

    name: Name
    mountPath: Path_
    readOnly: bool = True
    configMap: Subdomain | None = None
    secret: Subdomain | None = None  # the Secret's name
    persistentVolumeClaim: Subdomain | None = None


class PodSettings(_Strict, frozen=True):
    """One of ``[pods.all]``, ``[pods.gpu]``, ``[pods.cpu]``: Kubernetes' own field names and meanings."""

    tolerations: list[Toleration] = []
    nodeSelector: dict[LabelKey, LabelValue] = {}
    affinity: dict[Literal["nodeAffinity", "podAffinity", "podAntiAffinity"], dict[str, Any]] = {}
    imagePullSecrets: list[Name] = []
    annotations: dict[LabelKey, str] = {}
    labels: dict[LabelKey, LabelValue] = {}
    runtimeClassName: Name | None = None
    schedulerName: Subdomain | None = None
    serviceAccountName: Name | None = None
    env: dict[EnvName, str] = {}
    volumes: list[Volume] = []

    def __post_init__(self) -> None:
        # affinity is kept as plain data (merged term by term with replayjob's own), read through its declaration
        try:
            msgspec.convert(self.affinity, Affinity, strict=True)
        except msgspec.ValidationError as exc:
            rule, sep, at = str(exc).rpartition(" - at `")
            raise ValueError(f"affinity{at.rstrip('`').removeprefix('$')}: {rule}" if sep else str(exc)) from None


class Pods(_Strict, frozen=True):
    all: PodSettings = PodSettings()
    gpu: PodSettings = PodSettings()
    cpu: PodSettings = PodSettings()


# What each key of [pods.all|gpu|cpu] takes and does (docs/spec.md is generated from it; a test keeps it
# equal to PodSettings' fields).
FIELD_DOCS = {
    "tolerations": ("list of {key, operator, value, effect, tolerationSeconds}",
                    "added to replayjob's own (the nvidia.com/gpu taint on GPU pods)"),
    "nodeSelector": ("table of label = value", "merged with replayjob's own (GPU product, driver label), which it "
                                                "cannot change"),
    "affinity": ("table: nodeAffinity, podAffinity, podAntiAffinity",
                 "each term added to replayjob's own (one replayjob GPU pod per node)"),
    "imagePullSecrets": ("list of Secret names", "pull secrets of a private registry"),
    "annotations": ("table", "pod annotations (karpenter.sh/do-not-disrupt, cluster-autoscaler.kubernetes.io/"
                             "safe-to-evict, cost allocation)"),
    "labels": ("table", "pod labels (a node pool's, cost allocation); not under replayjob's own prefixes"),
    "runtimeClassName": ("string", "the pods' RuntimeClass"),
    "schedulerName": ("string", "the scheduler that places the pods"),
    "serviceAccountName": ("string", "the pods' service account (no token is mounted: identity through the node "
                                     "or a registry)"),
    "env": ("table of NAME = value", "extra environment of the stage container; never replayjob's own or the "
                                     "determinism variables, nor a variable of a family that changes what a replay "
                                     "runs or measures (" + ", ".join(f"`{f[0]}*`" for f in ENV_FAMILIES) + "), "
                                     "nor a value with a NUL byte"),
    "volumes": ("list of {name, mountPath, readOnly, configMap | secret | persistentVolumeClaim}",
                "extra volumes mounted in the stage container (read-only unless readOnly = false); each name and "
                "mount path once per stage pod, never over replayjob's own paths or the image's code (" +
                ", ".join(f"`{p}`" for p in CODE_PATHS) + ")"),
}


def _refuse(settings: PodSettings, where: str) -> None:
    for name, value in settings.env.items():
        if OWN_ENV.fullmatch(name) or name in NCCL_NUMERICS:
            raise ConfigError(f"{name} is replayjob's own variable: the determinism and runtime environment "
                              "cannot be overridden (it is what makes two replays comparable)", where=f"{where}.env",
                              hint="set determinism through the spec ([capture] math_mode) or the image")
        family = env_family(name)
        if family is not None:
            prefix, what, why = family
            raise ConfigError(f"{name} is one of {what} ({prefix}*): {why}", where=f"{where}.env",
                              hint="set it in the image, whose digest the run records, so every arm and repeat "
                                   "runs with it")
        if "\x00" in value:
            raise ConfigError(f"the value of {name} holds a NUL byte: no process environment can carry it (the "
                              "container would start with another value than the spec's)", where=f"{where}.env",
                              hint="remove the NUL byte")
    for key in (*settings.labels, *settings.annotations):
        if key.startswith(OWN_LABEL_PREFIXES) or key in OWN_LABELS:
            raise ConfigError(f"{key} is replayjob's own label or annotation (runs, stages, queues)",
                              where=f"{where}", hint="choose a key under your own prefix")
    for key in settings.nodeSelector:
        if key in OWN_NODE_LABELS:
            raise ConfigError(f"{key} is set from the spec's gpu_product", where=f"{where}.nodeSelector",
                              hint="set gpu_product (or the driver_version/driver_label fields) instead")
    for v in settings.volumes:
        parts = v.mountPath.split("/")[1:]
        if not all(parts) or any(part in (".", "..") for part in parts):  # compared as written below
            raise ConfigError(f"volume {v.name}: mountPath {v.mountPath!r} is not a plain absolute path (an empty, "
                              "'.' or '..' component, or a trailing '/'): the container would mount it where the "
                              "path leads, which is not the path checked against replayjob's own",
                              where=f"{where}.volumes", hint="write the path as /dir/sub, e.g. /data")
        sources = [s for s in (v.configMap, v.secret, v.persistentVolumeClaim) if s]
        if len(sources) != 1:
            raise ConfigError(f"volume {v.name} needs exactly one of configMap, secret, persistentVolumeClaim",
                              where=f"{where}.volumes")
        if v.name in OWN_VOLUMES or any(_overlaps(v.mountPath, p) for p in OWN_PATHS):
            raise ConfigError(f"volume {v.name} at {v.mountPath} would replace or hide replayjob's own "
                              f"({', '.join(OWN_VOLUMES)} at {', '.join(OWN_PATHS)})", where=f"{where}.volumes")
        if any(_overlaps(v.mountPath, p) for p in CODE_PATHS):
            raise ConfigError(f"volume {v.name} at {v.mountPath} would replace or hide the image's code "
                              f"({', '.join(CODE_PATHS)}): a replay would not run the image the run records",
                              where=f"{where}.volumes", hint="mount it elsewhere, e.g. /data")


def _overlaps(path: str, other: str) -> bool:
    """Whether a mount at ``path`` replaces or hides what is at ``other`` (the same path, under it, or above it)."""
    return path == other or path.startswith(other + "/") or other.startswith(path.rstrip("/") + "/")


def read_pods(raw: Any, where: str = "pods") -> Pods:
    """The ``[pods]`` table, declared and refused as the module docstring says (:class:`ConfigError`, exit 2)."""
    if not isinstance(raw, dict):
        raise ConfigError("must be a table ([pods.all], [pods.gpu], [pods.cpu])", where=where)
    for part, table in raw.items():
        for key in table if isinstance(table, dict) else ():
            if key in FORBIDDEN:
                raise ConfigError(f"{key} cannot be customised: {FORBIDDEN[key]}", where=f"{where}.{part}.{key}")
    try:
        pods = msgspec.convert(raw, Pods, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        rule, sep, at = text.rpartition(" - at `")
        key, in_key, at = at.rstrip("`").rpartition("` in `")  # a mapping's key: "key` in `$.gpu.labels"
        path = at.removeprefix("$").lstrip(".") + (" (a key)" if in_key else "") if sep else ""
        raise ConfigError((rule if sep else text), where=f"{where}.{path}" if path else where,
                          hint="docs/cluster.md, Your cluster: the keys [pods.all|gpu|cpu] take") from None
    for part in ("all", "gpu", "cpu"):
        _refuse(getattr(pods, part), f"{where}.{part}")
    for gpu in (True, False):  # a stage pod's volumes: [pods.all]'s and its own, together
        seen: dict[str, set[str]] = {"name": set(), "mountPath": set()}
        for v in for_stage(pods, gpu=gpu).volumes:
            for key, names in seen.items():
                if getattr(v, key) in names:
                    raise ConfigError(f"two volumes of the {'GPU' if gpu else 'CPU'} stage pods have the {key} "
                                      f"{getattr(v, key)}: Kubernetes refuses such a pod",
                                      where=f"{where}.volumes", hint="[pods.all] volumes are added to [pods.gpu] "
                                                                     "and [pods.cpu] ones: name each once")
                names.add(getattr(v, key))
    return pods


def to_dict(pods: Pods) -> Doc:
    """The table as plain data (what the render-time fields record)."""
    out = msgspec.to_builtins(pods)
    assert isinstance(out, dict)
    return out


def for_stage(pods: Pods | None, *, gpu: bool) -> PodSettings:
    """The settings of a GPU or a CPU stage pod: ``all``, then ``gpu`` or ``cpu`` (lists concatenated, maps
    merged, single values from the more specific table)."""
    if pods is None:
        return PodSettings()
    one, two = pods.all, pods.gpu if gpu else pods.cpu
    return PodSettings(
        tolerations=[*one.tolerations, *two.tolerations], nodeSelector={**one.nodeSelector, **two.nodeSelector},
        affinity=_merge_affinity(one.affinity, two.affinity),
        imagePullSecrets=[*one.imagePullSecrets, *(s for s in two.imagePullSecrets if s not in one.imagePullSecrets)],
        annotations={**one.annotations, **two.annotations}, labels={**one.labels, **two.labels},
        runtimeClassName=two.runtimeClassName or one.runtimeClassName,
        schedulerName=two.schedulerName or one.schedulerName,
        serviceAccountName=two.serviceAccountName or one.serviceAccountName,
        env={**one.env, **two.env}, volumes=[*one.volumes, *two.volumes])


def _merge_affinity(one: dict[Any, dict[str, Any]], two: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    out: dict[Any, dict[str, Any]] = {k: dict(v) for k, v in one.items()}
    for kind, rules in two.items():
        mine = out.setdefault(kind, {})
        for field_name, value in rules.items():
            mine[field_name] = [*mine.get(field_name, []), *value] if isinstance(value, list) else value
    return out


def volume_docs(settings: PodSettings) -> tuple[list[Doc], list[Doc]]:
    """(pod volumes, container volume mounts) of the extra volumes."""
    vols, mounts = [], []
    for v in settings.volumes:
        source = ({"configMap": {"name": v.configMap}} if v.configMap else {"secret": {"secretName": v.secret}}
                  if v.secret else {"persistentVolumeClaim": {"claimName": v.persistentVolumeClaim,
                                                              "readOnly": v.readOnly}})
        vols.append({"name": v.name, **source})
        mounts.append({"name": v.name, "mountPath": v.mountPath, "readOnly": v.readOnly})
    return vols, mounts


def apply(pod: Doc, meta: Doc, container: Doc, settings: PodSettings) -> None:
    """Apply ``settings`` to a pod spec (``pod``), its metadata (``meta``) and its stage container, in place:
    what replayjob set stays (tolerations and affinity terms are added to its own, the node selector
    keeps its GPU keys)."""
    if settings.tolerations:
        pod["tolerations"] = [*pod.get("tolerations", []),
                              *({k: v for k, v in msgspec.to_builtins(t).items() if v is not None}
                                for t in settings.tolerations)]
    if settings.nodeSelector:
        pod["nodeSelector"] = {**settings.nodeSelector, **pod.get("nodeSelector", {})}
    if settings.affinity:
        mine = pod.get("affinity", {})
        merged = _merge_affinity(settings.affinity, mine)
        pod["affinity"] = {k: merged[k] for k in sorted(merged)}
    if settings.imagePullSecrets:
        pod["imagePullSecrets"] = [{"name": n} for n in settings.imagePullSecrets]
    for key in ("runtimeClassName", "schedulerName", "serviceAccountName"):
        if getattr(settings, key):
            pod[key] = getattr(settings, key)
    if settings.labels:
        meta["labels"] = {**settings.labels, **meta.get("labels", {})}
    if settings.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **settings.annotations}
    if settings.env:
        container["env"] = [*container["env"], *({"name": k, "value": v} for k, v in settings.env.items())]
    vols, mounts = volume_docs(settings)
    if vols:
        pod["volumes"] = [*pod.get("volumes", []), *vols]
        container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
