"""The ablation spec: arms x repeats, image, GPU product, claim, model and config, in one TOML file.

This module is the single source of truth for every way an ablation is fanned out (Kubernetes Jobs,
the Argo workflow, Slurm arrays, the workstation script): what the arms are, how an array index maps
to ``(arm, repeat)``, which ``--set`` overrides each replay gets, and the determinism environment
pinned in every GPU process.

An arm is a name plus systems-only config overrides; every override key is also declared in
``optimizer_batch.allow_config_differences`` so the replay gate accepts exactly that difference.

The API, kept small for every launcher:

* ``load_spec(path) -> AblationSpec`` (strict TOML; ``spec_from_dict`` for parsed data);
* ``AblationSpec``: the fields of ``examples/ablation.toml``; ``size`` (arms x repeats),
  ``run_for_index(i) -> Run(arm, repeat, index)`` and ``runs()``, ``arm(name) -> Arm``,
  ``config_sets()`` (``KEY=VALUE`` overrides for the capture and every replay),
  ``effective_min_repeats``;
* ``Arm``: ``set_args()`` (its ``KEY=VALUE`` overrides), ``allow_list()`` (the TOML list for
  ``optimizer_batch.allow_config_differences``), ``words()`` (the overrides as one string);
* ranks: ``ranks`` (the capture's world size), ``arm_ranks(name)``, ``ranks_for_index(i)`` (how many
  ranks one replay runs: the arm's declared ``distributed.world_size``, else ``ranks``) and
  ``rank_groups()`` (rank count -> the array indexes that need it), and ``nodes_for(world)`` (nodes and
  ranks per node: more than one node when a run needs more GPUs than ``node_gpus``), so every launcher
  provisions the same number of devices for the same replay;
* ``DETERMINISM_ENV``: the determinism environment of the built-in capture stage (math mode
  ``pedantic``), set in the image; ``AblationSpec.determinism_env()`` is what every launcher pins for
  one spec: the same, with the math mode of its existing capture (``[capture] math_mode``);
* ``capture`` (the ``[capture]`` table, :class:`CaptureRef`): an existing capture of any producer
  replayed instead of running the built-in capture stage (:mod:`replayjob.launch.capture_ref`); its arm
  keys are then checked against that producer's knobs, ``resume`` is refused and ``[config]`` holds
  replay settings (``optimizer_batch.*``) only.

Example:
    >>> spec = AblationSpec(name="demo", image="replayjob:0.1.0", gpu_product="NVIDIA-H100-80GB-HBM3",
    ...                     arms=(Arm("ckpt-off"), Arm("ckpt-on", {"backend.options.gradient_checkpointing": True})))
    >>> spec.run_for_index(4)
    Run(arm='ckpt-on', repeat=1, index=4, slot=None)
    >>> spec.arm("ckpt-on").set_args(), spec.arm("ckpt-on").allow_list()
    (['backend.options.gradient_checkpointing=true'], '["backend.options.gradient_checkpointing"]')
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from replayjob.artifacts.capture_manifest import REPLAY_CONFIG
from replayjob.artifacts.claims import SPEC_NAMES
from replayjob.artifacts.pods import DNS_SUBDOMAIN, LABEL_VALUE, QUALIFIED_NAME, Pods, read_pods
from replayjob.artifacts.pods import to_dict as pods_to_dict
from replayjob.artifacts.schedule import DESIGNS, Slot, plan
from replayjob.config.dump import set_args, toml_value
from replayjob.config.load import MAX_TOML_BYTES, read_toml_bytes, read_toml_file_bytes, read_toml_text
from replayjob.declaration import INT64_MAX
from replayjob.digest import is_sha256_hex
from replayjob.errors import ConfigError
from replayjob.runtime.determinism import ENV_MATH_MODE, MATH_MODES
from replayjob.runtime.knobs import (  # an arm's world size: its replays run that many ranks
    BUILTIN,
    KNOBS,
    STRATEGY,
    WORLD_SIZE,
    knobs_for,
)

# Set in the image; every launcher pins AblationSpec.determinism_env() (these values, with the math mode of
# the spec's existing capture): the Kubernetes Jobs, the Argo workflow, scripts/slurm (from `step plan`), and
# every `replayjob step` itself.  :mod:`replayjob.runtime.determinism` records what was actually in force.
DETERMINISM_ENV: Mapping[str, str] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVIDIA_TF32_OVERRIDE": "0",
    "PYTHONHASHSEED": "0",
    "REPLAYJOB_MATH_MODE": "pedantic",
    # Between ranks, NCCL's tuner picks the collective's algorithm and protocol by message size and
    # topology, and each sums in its own order: pinned, so a capture and its replays (on any node)
    # reduce gradients alike.  The settings recorded with them: replayjob.runtime.determinism.NCCL_NUMERICS.
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
}

# The math mode of the built-in capture stage (strict determinism); an existing capture's is its own.
BUILTIN_MATH_MODE = "pedantic"
# An existing capture's math mode when [capture] names none: that of a process that sets nothing.
DEFAULT_CAPTURE_MATH_MODE = "default"

CLAIMS = SPEC_NAMES  # the claims a spec may run (replayjob.artifacts.claims: the approximate claim needs tolerances)
DEVICES = ("cuda", "cpu")
# "digest": the image is named by its digest (REGISTRY/replayjob@sha256:...), required to render
# manifests for a cluster; "local": a tag is accepted, for local development (a workstation, kind).
IMAGE_POLICIES = ("digest", "local")
_DIGEST_REF = re.compile(r"[^@\s]+@sha256:[0-9a-f]{64}")
MAX_RANKS = 64
# Kubernetes refuses an Indexed Job of more completions (one replay each): every replay of a spec is one index.
MAX_REPLAYS = 100_000
# A pod's deadline no run needs more than (a Job's and the workflow's own are multiples of it, which must stay
# 64-bit integers for the API server to read them).
MAX_DEADLINE_S = 366 * 24 * 3600
# Kubernetes object names are built as "<name>-replay-<arm>": DNS-1123 labels, short enough.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# Override values travel through shell words and Argo parameters: no whitespace or quotes.
_SAFE_STR = re.compile(r"[A-Za-z0-9_./:@+-]*")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?")

Value = bool | int | float | str


def scale_quantity(quantity: str, factor: int) -> str:
    """A Kubernetes quantity (as ``_QUANTITY`` accepts) times ``factor``: ``64Gi`` x 2 = ``128Gi``."""
    m = _QUANTITY.fullmatch(quantity)
    if m is None:
        raise ConfigError(f"{quantity!r} is not a Kubernetes quantity")
    number = quantity[:len(quantity) - len(m.group(2) or "")]
    value = Decimal(number) * factor
    text = format(value.normalize(), "f") if value != value.to_integral() else str(int(value))
    return text + (m.group(2) or "")


_UNITS: dict[str, Decimal | int] = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9,
                                    "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_value(quantity: str) -> Decimal:
    """The amount a Kubernetes quantity (as ``_QUANTITY`` accepts) stands for: ``64Gi`` is 68719476736, ``500m``
    0.5."""
    m = _QUANTITY.fullmatch(quantity)
    if m is None:
        raise ConfigError(f"{quantity!r} is not a Kubernetes quantity")
    unit = m.group(2) or ""
    return Decimal(quantity[:len(quantity) - len(unit)]) * _UNITS[unit]


def is_digest_ref(ref: str) -> bool:
    """Whether ``ref`` names an image by its digest (``NAME@sha256:`` and 64 hex digits)."""
    return bool(_DIGEST_REF.fullmatch(ref))


def _check_overrides(raw: Any, where: str) -> dict[str, Value]:
    if not isinstance(raw, dict):
        raise ConfigError("must be a table of dotted config keys", where=where)
    out: dict[str, Value] = {}
    for key, value in raw.items():
        if not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+", key):
            raise ConfigError(f"{key!r} is not a dotted config key", where=where,
                              hint='quote it: "backend.options.gradient_checkpointing" = true')
        if not isinstance(value, bool | int | float | str) or (
                isinstance(value, str) and not _SAFE_STR.fullmatch(value)) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"{key} = {value!r}: only booleans, finite numbers and strings without "
                              "spaces or quotes are allowed", where=where)
        out[key] = value
    return out


@dataclass(frozen=True)
class Arm:
    """One condition: a name and the systems-only overrides its replays apply."""

    name: str
    overrides: dict[str, Value] = field(default_factory=dict)

    def set_args(self) -> list[str]:
        """``KEY=VALUE`` overrides for ``replayjob replay --set`` (without the declarations)."""
        return set_args(dict(sorted(self.overrides.items())))

    def allow_list(self) -> str:
        """The TOML list for ``optimizer_batch.allow_config_differences``."""
        return toml_value(sorted(self.overrides))

    def words(self) -> str:
        """The overrides as one whitespace-separated string (the scripts' ``REPLAYJOB_ARM_SETS``)."""
        return " ".join(self.set_args())


# [config] keys an existing capture's replays may take: replay-side settings, none of them the step's own
_STEP_KEYS = ("optimizer_batch.replay_path", "optimizer_batch.expected_logical_sha256",
              "optimizer_batch.expected_manifest_sha256", "optimizer_batch.arm",
              "optimizer_batch.allow_config_differences", "optimizer_batch.budgets_sha256",
              "optimizer_batch.capture", "optimizer_batch.capture_steps", "optimizer_batch.ring_size")
_REPLAY_CONFIG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.toml")


@dataclass(frozen=True)
class CaptureRef:
    """The spec's ``[capture]`` table: an existing capture (any producer: replayjob's trainer, TRL, a plain
    PyTorch loop) replayed instead of running the built-in capture stage.  ``dir`` is the directory the
    capture wrote (absolute: every step resolves it on its own machine, the shared volume),
    ``replay_config`` the replay config it wrote there (``replay.toml``, or ``replay_step_<K:06d>.toml``
    for one of several chosen steps), the two pins it printed, both required (fail closed), and
    ``math_mode``, the math mode the capture's process ran in (``REPLAYJOB_MATH_MODE``; ``default``, that
    of a process that sets nothing, unless given), which every step of the spec pins and which must equal
    the one the capture's contract records.  :mod:`replayjob.launch.capture_ref` verifies it."""

    dir: str = field(metadata={"doc": "The directory the capture wrote: an absolute path on the shared volume, without "
                                      "whitespace or quotes (every step resolves it on its own machine)."})
    logical_sha256: str = field(metadata={"doc": "The logical batch digest the capture printed "
                                                 "(optimizer/logical_batch_sha256 of its metrics.json, or the step's "
                                                 "record under optimizer_batch/steps): lowercase 64-digit hex."})
    manifest_sha256: str = field(metadata={"doc": "The manifest digest the capture printed "
                                                  "(optimizer_batch/manifest_sha256 of its metrics.json, or the step's "
                                                  "record): lowercase 64-digit hex."})
    replay_config: str = field(default=REPLAY_CONFIG, metadata={
        "doc": "The replay config the capture wrote in dir, as a bare .toml file name: replay.toml, or "
               "replay_step_<K:06d>.toml for one of several chosen steps."})
    math_mode: str = field(default=DEFAULT_CAPTURE_MATH_MODE, metadata={
        "doc": "The math mode the capture's process ran in (its REPLAYJOB_MATH_MODE; 'default' when it set none), "
               "one of: " + ", ".join(f"'{m}'" for m in MATH_MODES) + ". Every step of the spec pins it, and it "
               "must equal the one the capture's contract records."})


_CAPTURE_KEYS = ("dir", "replay_config", "logical_sha256", "manifest_sha256", "math_mode")
_CAPTURE_OPTIONAL = ("replay_config", "math_mode")


def _capture_ref(raw: dict[str, Any], where: str) -> CaptureRef:
    """A ``[capture]`` table, checked: keys, an absolute directory, a bare replay-config name, two pins."""

    unknown = sorted(set(raw) - set(_CAPTURE_KEYS))
    if unknown:
        raise ConfigError("unknown key(s): " + ", ".join(unknown), where=f"{where}: capture",
                          hint="[capture] takes " + ", ".join(_CAPTURE_KEYS))
    missing = [k for k in _CAPTURE_KEYS if k not in _CAPTURE_OPTIONAL and k not in raw]
    if missing:
        raise ConfigError("missing " + ", ".join(missing) + ": an existing capture is named by its directory "
                          "and pinned by both digests it printed", where=f"{where}: capture",
                          hint="optimizer/logical_batch_sha256 and optimizer_batch/manifest_sha256 of its "
                               "metrics.json (or the step's record under optimizer_batch/steps)")
    for key in _CAPTURE_KEYS:
        if key in raw and type(raw[key]) is not str:
            raise ConfigError(f"must be a string, not {type(raw[key]).__name__}", where=f"{where}: capture.{key}")
    ref = CaptureRef(**raw)
    if not ref.dir.startswith("/") or not _SAFE_STR.fullmatch(ref.dir):
        raise ConfigError(f"{ref.dir!r} must be an absolute path without whitespace or quotes",
                          where=f"{where}: capture.dir",
                          hint="every step reads it on its own machine: a path on the shared volume")
    if not _REPLAY_CONFIG.fullmatch(ref.replay_config):
        raise ConfigError(f"{ref.replay_config!r} must be the bare name of a .toml file in the capture directory",
                          where=f"{where}: capture.replay_config", hint="replay.toml, or replay_step_000003.toml")
    for key in ("logical_sha256", "manifest_sha256"):
        if not is_sha256_hex(getattr(ref, key)):
            raise ConfigError("must be a lowercase 64-digit hex SHA-256", where=f"{where}: capture.{key}")
    if ref.math_mode not in MATH_MODES:
        raise ConfigError(f"{ref.math_mode!r} is not a math mode", where=f"{where}: capture.math_mode",
                          hint="the capture process's REPLAYJOB_MATH_MODE, one of: " + ", ".join(MATH_MODES)
                               + f" ({DEFAULT_CAPTURE_MATH_MODE!r} when it set none)")
    return ref


@dataclass(frozen=True)
class Run:
    """One replay of the fan-out: array index ``index`` is repeat ``repeat`` of arm ``arm``; with a
    paired ``schedule`` the repeat is the block and ``slot`` its place in the schedule."""

    arm: str
    repeat: int
    index: int
    slot: Slot | None = None


@dataclass(frozen=True)
class AblationSpec:
    """A whole ablation: every field's ``doc`` is its meaning (``docs/spec.md``; an example:
    ``examples/ablation.toml``)."""

    name: str = field(metadata={"doc": "Kubernetes name prefix and run directory: a lowercase DNS label of at most "
                                       "30 characters, starting with a letter."})
    image: str = field(metadata={"doc": "The image built from docker/Dockerfile; on a cluster, "
                                        "REGISTRY/replayjob@sha256:... (see image_policy)."})
    gpu_product: str = field(metadata={"doc": "Node label nvidia.com/gpu.product of the GPU nodes to use."})
    arms: tuple[Arm, ...] = field(metadata={
        "doc": "The [arms.NAME] tables, one per arm (at least one), in file order; NAME is a lowercase DNS label "
               "of at most 20 characters. Each maps a quoted dotted config key to a TOML value (a boolean, a "
               "finite number, or a string without whitespace or quotes): the systems-only knobs its replays change. "
               "Every key must be a registered knob and is declared in optimizer_batch.allow_config_differences, "
               "so it is the only difference allowed; distributed.world_size sets how many ranks the arm's "
               "replays run. An empty table is an arm that changes nothing."})
    repeats: int = field(default=3, metadata={"doc": f"Fresh replays per arm (>= 1; arms x repeats at most "
                                                     f"{MAX_REPLAYS})."})
    min_repeats: int = field(default=0, metadata={
        "doc": "The reducer refuses fewer repeats per arm: 0..repeats, where 0 means repeats."})
    claim: str = field(default="exact-input", metadata={
        "doc": "What `replayjob reduce` checks: " + " or ".join(f"'{c}'" for c in CLAIMS) + "."})
    seed: int = field(default=123, metadata={
        "doc": "Seed of `replayjob init` (initial adapter, example configs) and of a paired schedule (>= 0)."})
    device: str = field(default="cuda", metadata={
        "doc": "'cuda' (one GPU per rank) or 'cpu' (the same Jobs without GPUs)."})
    model_path: str = field(default="", metadata={
        "doc": "A model directory on the shared volume ('' = the built-in tiny model); needs resume. With "
               "[capture], the base model directory the replays load (its files are hashed against the "
               "capture's)."})
    resume: str = field(default="", metadata={
        "doc": "A resume state (step -1) on the shared volume ('' = the one `replayjob init` writes); refused "
               "with [capture]."})
    config: dict[str, Value] = field(default_factory=dict, metadata={
        "doc": "The [config] table: overrides applied to the capture and to every replay, each a quoted dotted "
               "config key = TOML value (as in an arm). Never distributed.world_size (that is ranks). With "
               "[capture], replay settings (optimizer_batch.*) only, and none of those the step sets itself."})
    claim_name: str = field(default="replayjob-artifacts", metadata={
        "doc": "The ReadWriteMany PVC holding every artifact."})
    storage: str = field(default="50Gi", metadata={
        "doc": "Size of that claim (a Kubernetes quantity of whole bytes above 0)."})
    storage_class: str = field(default="", metadata={
        "doc": "A storage class offering ReadWriteMany (kubectl get storageclass; standard-rwx on GKE, efs-sc on "
               "EKS, azurefile-csi on AKS, NFS, CephFS); required to render for a cluster."})
    cpu: str = field(default="8", metadata={
        "doc": "CPU per rank (a Kubernetes quantity above 0, in whole millicores): a pod of N ranks requests N "
               "times cpu, requests equal limits, and each rank's OMP_NUM_THREADS is its share."})
    memory: str = field(default="64Gi", metadata={
        "doc": "Memory per rank (a Kubernetes quantity of whole bytes above 0): a pod of N ranks requests N times "
               "memory, requests equal limits."})
    shm: str = field(default="8Gi", metadata={
        "doc": "Size of the memory-backed /dev/shm (a Kubernetes quantity of whole bytes above 0)."})
    deadline_s: int = field(default=21600, metadata={
        "doc": "activeDeadlineSeconds of each pod, Jobs and Argo steps (60 to a year); the Jobs' and the workflow's "
               "own are sized from it, the waves and the retries."})
    parallelism: int = field(default=4, metadata={
        "doc": "Replays running at once, all arms together (>= 1; at most one per GPU node)."})
    node_gpus: int = field(default=0, metadata={
        "doc": "0: one GPU per rank, and no other replayjob GPU pod on the node (any namespace); N (1..64): the "
               "GPUs a node has: every GPU pod requests all N, so no pod of anyone can share the node, and a run of "
               "more than N ranks runs on ceil(ranks / N) nodes, the same number of ranks on each (a Kubernetes "
               "JobSet, srun across nodes; docs/cluster.md, Multi-node replays)."})
    driver_version: str = field(default="", metadata={
        "doc": "'' = any driver; else only nodes whose driver_label has this value."})
    driver_label: str = field(default="nvidia.com/cuda.driver.major", metadata={
        "doc": "The node label (GPU feature discovery) driver_version is matched against."})
    priority_class: str = field(default="", metadata={
        "doc": "PriorityClass of every pod of a run ('' = the cluster default)."})
    semaphore: str = field(default="", metadata={
        "doc": "Argo: a CONFIGMAP/KEY semaphore limiting the GPU pods of all workflows ('' = none)."})
    mixed_hardware: bool = field(default=False, metadata={
        "doc": "true declares that arms may run on different GPUs, drivers or images."})
    schedule: str = field(default="", metadata={
        "doc": "'' = index -> (arm, repeat), arms in file order; " + " or ".join(f"'{d}'" for d in DESIGNS)
               + ": a paired schedule seeded by seed (index i is in block i // arms), each replay recording its "
               "slot (docs/verdict-format.md, Budgets)."})
    budgets: str = field(default="", metadata={
        "doc": "A budget TOML (docs/budgets.md) decided by the reduce (reduce --budgets); needs schedule, is "
               "pinned into every replay, and the first arm is the baseline ('' = none)."})
    ranks: int = field(default=1, metadata={
        "doc": f"The capture's world size (torch.distributed ranks, one GPU each; 1..{MAX_RANKS}), and every "
               "replay's unless its arm sets distributed.world_size; > 1 needs distributed.strategy = 'ddp' in "
               "[config]."})
    image_policy: str = field(default="digest", metadata={
        "doc": "'digest': rendering for a cluster refuses an image not named by its digest "
               "(REGISTRY/replayjob@sha256:...); 'local': a tag is accepted (a workstation, kind)."})
    queue: str = field(default="", metadata={
        "doc": "A Kueue LocalQueue: label kueue.x-k8s.io/queue-name on every Job and workflow pod ('' = none)."})
    pods: Pods | None = field(default=None, metadata={
        "doc": "The [pods] table: tolerations, node selector, affinity, pull secrets, annotations, labels, runtime "
               "class, scheduler, service account, extra env and volumes for every stage pod ([pods.all]), the GPU "
               "stages ([pods.gpu]) or the CPU stages ([pods.cpu]); the determinism environment and the security "
               "context cannot be changed (docs/cluster.md, Your cluster)."})
    capture: CaptureRef | None = field(default=None, metadata={
        "doc": "The [capture] table: an existing capture (any producer) replayed instead of running the built-in "
               "capture stage; its arm keys are checked against that producer's knobs, resume is refused and "
               "[config] holds replay settings only."})

    def __post_init__(self) -> None:
        # a letter first (a DNS-1035 label): the name begins a JobSet's headless Service's, which Kubernetes requires
        if not _NAME.fullmatch(self.name) or len(self.name) > 30 or not self.name[0].isalpha():
            raise ConfigError(f"{self.name!r} must be a lowercase DNS label of at most 30 characters, starting with "
                              "a letter", where="name")
        if not self.arms:
            raise ConfigError("at least one arm is required", where="arms")
        for arm in self.arms:
            if not _NAME.fullmatch(arm.name) or len(arm.name) > 20:
                raise ConfigError(f"{arm.name!r} must be a lowercase DNS label of at most 20 "
                                  "characters", where=f"arms.{arm.name}")
        if self.repeats < 1:
            raise ConfigError("must be >= 1", where="repeats")
        if self.size > MAX_REPLAYS:
            raise ConfigError(f"{len(self.arms)} arms x {self.repeats} repeats are {self.size} replays: Kubernetes "
                              f"runs at most {MAX_REPLAYS} replays as one Indexed Job", where="repeats")
        if not 0 <= self.min_repeats <= self.repeats:
            raise ConfigError("must be between 0 (= repeats) and repeats", where="min_repeats")
        if self.claim not in CLAIMS:
            raise ConfigError(f"{self.claim!r} is not a claim; use one of: " + ", ".join(CLAIMS),
                              where="claim")
        if self.device not in DEVICES:
            raise ConfigError(f"{self.device!r}: use 'cuda' (one GPU per rank) or 'cpu'", where="device")
        if self.seed < 0 or self.deadline_s < 60 or self.parallelism < 1 or not 0 <= self.node_gpus <= 64:
            raise ConfigError("seed >= 0, deadline_s >= 60, parallelism >= 1 and node_gpus 0..64 are required")
        if self.deadline_s > MAX_DEADLINE_S:
            raise ConfigError(f"{self.deadline_s} s is more than a year ({MAX_DEADLINE_S} s): the Jobs' and the "
                              "workflow's own deadlines, multiples of it, would be more than the API server reads",
                              where="deadline_s")
        if self.capture is not None:
            self._check_capture()
        elif self.model_path and not self.resume:
            raise ConfigError("a model directory needs its own resume state: `replayjob init` writes an "
                              "adapter for the built-in tiny model only", where="resume",
                              hint="set resume to a step -1 resume state made for that model")
        for key in ("storage", "cpu", "memory", "shm"):
            if not _QUANTITY.fullmatch(getattr(self, key)):
                raise ConfigError(f"{getattr(self, key)!r} is not a Kubernetes quantity", where=key)
            amount = quantity_value(getattr(self, key))
            if amount <= 0:
                raise ConfigError(f"{getattr(self, key)!r} is nothing: no pod runs in it", where=key)
            if key != "cpu" and amount != amount.to_integral_value():
                milli = " ('m' is milli, not mega)" if getattr(self, key).endswith("m") else ""
                raise ConfigError(f"{getattr(self, key)!r} is {amount} bytes, not a whole number{milli}: no "
                                  "memory or volume holds a fraction of a byte", where=key,
                                  hint="write bytes with Ki, Mi, Gi or Ti (64Gi), or k, M, G, T")
            if key == "cpu" and amount * 1000 != (amount * 1000).to_integral_value():
                raise ConfigError(f"{self.cpu!r} is finer than a thousandth of a CPU: Kubernetes counts CPU in "
                                  "whole millicores (1m)", where=key, hint="write CPU as cores (8, 0.5) or millicores "
                                  "(500m)")
            unit = "millicores" if key == "cpu" else "bytes"
            if amount * (1000 if key == "cpu" else 1) * MAX_RANKS > INT64_MAX:  # a pod of N ranks asks N times
                raise ConfigError(f"{getattr(self, key)!r} is more than Kubernetes counts: a request is a 64-bit "
                                  f"count of {unit}, and a pod of up to {MAX_RANKS} ranks requests {MAX_RANKS} times "
                                  "it", where=key, hint="request what one rank needs")
        for key in ("image", "gpu_product", "model_path", "resume", "claim_name", "storage_class",
                    "driver_version", "driver_label", "priority_class", "budgets"):
            if not _SAFE_STR.fullmatch(getattr(self, key)):
                raise ConfigError("no whitespace or quotes allowed", where=key)
        self._check_kubernetes_names()
        if self.queue and (not _NAME.fullmatch(self.queue) or len(self.queue) > 63):
            raise ConfigError(f"{self.queue!r} must be a LocalQueue name (a lowercase DNS label)", where="queue")
        if self.image_policy not in IMAGE_POLICIES:
            raise ConfigError(f"{self.image_policy!r} is not an image policy; use one of: " + ", ".join(IMAGE_POLICIES),
                              where="image_policy")
        if self.schedule and self.schedule not in DESIGNS:
            raise ConfigError(f"{self.schedule!r} is not a schedule design; use one of: " + ", ".join(DESIGNS),
                              where="schedule")
        if self.budgets and not self.schedule:
            raise ConfigError("budgets are decided over paired replays: set schedule too", where="budgets",
                              hint='schedule = "abba"')
        self._check_ranks()
        if self.semaphore and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-._a-zA-Z0-9]+", self.semaphore):
            raise ConfigError(f"{self.semaphore!r} must be CONFIGMAP/KEY", where="semaphore")

    def _check_kubernetes_names(self) -> None:
        """The fields rendered into a node selector or naming an object, as the API server validates them, so
        no manifest is rendered that the cluster refuses (or whose selector no node can match)."""
        rules = {"gpu_product": (LABEL_VALUE, "a label value (63 characters at most: letters, digits, '-', '_', "
                                              "'.', alphanumeric at both ends)"),
                 "driver_version": (LABEL_VALUE, "a label value"),
                 "driver_label": (QUALIFIED_NAME, "a label key (an optional DNS prefix and '/', then a name of 63 "
                                                  "characters at most)"),
                 "claim_name": (DNS_SUBDOMAIN, "a PersistentVolumeClaim name (a lowercase DNS subdomain)"),
                 "storage_class": (DNS_SUBDOMAIN, "a StorageClass name (a lowercase DNS subdomain)"),
                 "priority_class": (DNS_SUBDOMAIN, "a PriorityClass name (a lowercase DNS subdomain)")}
        for key, (rule, what) in rules.items():
            value = getattr(self, key)
            if (value or key in ("claim_name", "driver_label")) and not re.fullmatch(rule, value):
                raise ConfigError(f"{value!r} must be {what}", where=key)
        if self.gpu and not self.gpu_product:
            raise ConfigError("a GPU spec selects its nodes by nvidia.com/gpu.product: an empty value matches no GPU "
                              "node", where="gpu_product", hint="kubectl get nodes -L nvidia.com/gpu.product")

    def _check_capture(self) -> None:
        """What a spec naming an existing capture may say: no capture stage runs, so nothing that
        configures one (``resume``, the captured config in ``[config]``) applies; ``[config]`` may hold
        only replay-side ``optimizer_batch.*`` settings (applied to every replay), and ``model_path``
        names the base model directory the replays load (its files are hashed against the capture's)."""
        if self.resume:
            raise ConfigError("resume configures the built-in capture stage, which does not run for an existing "
                              "capture", where="resume", hint="drop resume (the capture pins its own start state)")
        for key in self.config:
            if not key.startswith("optimizer_batch.") or key in _STEP_KEYS:
                raise ConfigError(f"{key} cannot apply to an existing capture: its captured config is fixed (a "
                                  "systems-only difference belongs in an arm), and the step sets the capture's "
                                  "path, pins, arm and declarations itself", where=f"config.{key}",
                                  hint="[config] may hold replay settings only (optimizer_batch.tolerances_sha256, "
                                       "optimizer_batch.allow_nonfinite_inputs, ...)")

    def _check_ranks(self) -> None:
        """Ranks: 1..64, split evenly over the nodes they need when ``node_gpus`` is set, one fact per place (the
        capture's in ``ranks``, an arm's in its ``distributed.world_size``), and a strategy that
        shares an update over several ranks wherever a run has more than one."""
        if not 1 <= self.ranks <= MAX_RANKS:
            raise ConfigError(f"must be between 1 and {MAX_RANKS}, found {self.ranks}", where="ranks")
        if WORLD_SIZE in self.config:
            raise ConfigError(f"{WORLD_SIZE} is the capture's world size: set it once, as ranks",
                              where=f"config.{WORLD_SIZE}", hint=f"ranks = {self.config[WORLD_SIZE]}")
        where = {"capture": (self.ranks, self.config.get(STRATEGY, "none"), "ranks")}
        for arm in self.arms:
            world = arm.overrides.get(WORLD_SIZE, self.ranks)
            if type(world) is not int or not 1 <= world <= MAX_RANKS:
                raise ConfigError(f"{WORLD_SIZE} must be an integer between 1 and {MAX_RANKS}, found {world!r}",
                                  where=f"arms.{arm.name}")
            if WORLD_SIZE in arm.overrides and world == self.ranks:
                raise ConfigError(f"{WORLD_SIZE} = {world} is the capture's ranks: no difference to declare (the "
                                  "replay gate refuses a declared difference that is not one)",
                                  where=f"arms.{arm.name}", hint=f"drop it: an arm's replays run ranks = {self.ranks} "
                                                                 "unless it declares another count")
            strategy = arm.overrides.get(STRATEGY, self.config.get(STRATEGY, "none"))
            where[f"arm {arm.name}"] = (world, strategy, f"arms.{arm.name}")
        for what, (world, strategy, key) in where.items():
            nodes = self._nodes(world)
            if world % nodes:
                per = -(-world // nodes)
                raise ConfigError(f"the {what} runs {world} ranks, one GPU each, over {nodes} nodes of node_gpus = "
                                  f"{self.node_gpus}: the ranks do not split evenly over the nodes (torchrun and "
                                  "srun start as many on every node)", where=key,
                                  hint=f"{nodes * (world // nodes)} or {nodes * per} ranks ({nodes} nodes of "
                                       f"{world // nodes} or {per}), or at most {self.node_gpus} (one node)")
            if world > 1 and strategy == "none":
                raise ConfigError(f"the {what} runs {world} ranks but {STRATEGY} is 'none' (one process)", where=key,
                                  hint=f'set "{STRATEGY}" = "ddp" in [config]')

    def check_cluster(self) -> None:
        """What rendering manifests for a cluster needs beyond a valid spec: an image named by its
        digest (unless ``image_policy = "local"``), so the fingerprint of every run names the bytes
        that ran and no pod waits on a GPU node for a tag that exists in no registry; and a storage
        class (the claim must be ReadWriteMany)."""
        if self.image_policy != "local" and not is_digest_ref(self.image):
            raise ConfigError(f"{self.image!r} is not named by its digest", where="image",
                              hint="push the image and use REGISTRY/replayjob@sha256:... (docker inspect --format "
                                   "'{{index .RepoDigests 0}}' IMAGE), or set image_policy = \"local\" for a local "
                                   "development cluster")
        if not self.storage_class:
            raise ConfigError("a storage class is required: a ReadWriteMany claim on a default class that only "
                              "offers ReadWriteOnce never binds, and every pod stays Pending without an error",
                              where="storage_class",
                              hint="kubectl get storageclass; name one that offers ReadWriteMany (NFS, CephFS, a "
                                   "cloud file store: standard-rwx on GKE, efs-sc on EKS, azurefile-csi on AKS)")

    @property
    def math_mode(self) -> str:
        """The math mode every step of this spec runs in: its existing capture's (``[capture] math_mode``),
        else the built-in capture stage's (:data:`BUILTIN_MATH_MODE`)."""
        return self.capture.math_mode if self.capture is not None else BUILTIN_MATH_MODE

    def determinism_env(self) -> dict[str, str]:
        """The determinism environment every launcher pins for this spec (the Jobs' and the workflow's
        containers, the Slurm jobs, ``replayjob step`` itself): :data:`DETERMINISM_ENV` with the spec's
        :attr:`math_mode`."""
        return {**DETERMINISM_ENV, ENV_MATH_MODE: self.math_mode}

    def render_fields(self) -> dict[str, Any]:
        """The fields manifests are computed from at render time (resources, placement, deadlines,
        parallelism, the claim, the number of replays per rank count), which a spec handed to the
        pods later (an edited ConfigMap, Argo's ``spec`` parameter) cannot change: every container
        carries them (``REPLAYJOB_RENDERED``) and ``replayjob step`` refuses a spec that differs.  The
        image and the GPU product are not among them: they are the launchers' own parameters."""
        out: dict[str, Any] = {key: getattr(self, key) for key in RENDER_FIELDS}
        if self.pods is not None:  # only when declared: specs without one keep their rendered fields
            out["pods"] = pods_to_dict(self.pods)
        out["replays"] = {str(n): len(ix) for n, ix in self.rank_groups().items()}
        return out

    def _nodes(self, world: int) -> int:
        return -(-world // self.node_gpus) if self.gpu and self.node_gpus else 1

    def nodes_for(self, world: int) -> tuple[int, int]:
        """``(nodes, ranks per node)`` of a run of ``world`` ranks: one node, unless the run needs more GPUs
        than a node has (``node_gpus``, GPU runs only); then the fewest nodes that hold them,
        ``ceil(world / node_gpus)``, each running the same number of ranks (the spec's validation keeps
        ``world`` a multiple of the node count).  Every launcher provisions from it: a Kubernetes JobSet
        of that many pods (:mod:`replayjob.launch.jobset`), a Slurm job of ``--nodes`` x
        ``--ntasks-per-node``."""
        nodes = self._nodes(world)
        return nodes, world // nodes

    def across_nodes(self) -> dict[str, int]:
        """What runs on more than one node (:meth:`nodes_for`): ``"capture"`` and each replay's array
        index (as a string) -> its node count; empty when every run fits one node."""
        out = {}
        if self.nodes_for(self.ranks)[0] > 1:
            out["capture"] = self.nodes_for(self.ranks)[0]
        for index in range(self.size):
            nodes = self.nodes_for(self.ranks_for_index(index))[0]
            if nodes > 1:
                out[str(index)] = nodes
        return out

    def arm_ranks(self, name: str) -> int:
        """How many ranks arm ``name``'s replays run: its declared ``distributed.world_size``, else
        the capture's ``ranks``."""
        world = self.arm(name).overrides.get(WORLD_SIZE, self.ranks)
        assert isinstance(world, int)  # checked in __post_init__
        return world

    def ranks_for_index(self, index: int) -> int:
        """How many ranks (one device each) the replay at array index ``index`` runs."""
        return self.arm_ranks(self.run_for_index(index).arm)

    def rank_groups(self) -> dict[int, list[int]]:
        """Rank count -> the array indexes whose replays run that many ranks (ascending counts); a
        launcher provisions one group of identical pods or tasks per entry."""
        groups: dict[int, list[int]] = {}
        for i in range(self.size):
            groups.setdefault(self.ranks_for_index(i), []).append(i)
        return dict(sorted(groups.items()))

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def effective_min_repeats(self) -> int:
        return self.min_repeats or self.repeats

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise ConfigError(f"no arm named {name!r}", hint="arms: " + ", ".join(a.name for a in self.arms))

    @property
    def size(self) -> int:
        """Number of replays: arms x repeats (the array's length)."""
        return len(self.arms) * self.repeats

    def run_for_index(self, index: int) -> Run:
        """Array index -> ``(arm, repeat)``: arms in file order, repeats innermost.

        With a ``schedule``, the index follows the paired schedule's run order instead
        (:func:`replayjob.artifacts.schedule.plan`, seeded by ``seed``): index ``i`` is position
        ``i % arms`` of block ``i // arms``, the repeat is the block, and the run carries its slot.
        """
        if not 0 <= index < self.size:
            raise ConfigError(f"index {index} is outside 0..{self.size - 1}", where="array index")
        if self.schedule:
            n = len(self.arms)
            block = index // n
            arm, slot = plan([a.name for a in self.arms], 1, self.schedule, self.seed, first_block=block)[index % n]
            return Run(arm, block, index, slot)
        return Run(self.arms[index // self.repeats].name, index % self.repeats, index)

    def runs(self) -> list[Run]:
        return [self.run_for_index(i) for i in range(self.size)]

    def config_sets(self) -> list[str]:
        """``--set`` overrides applied to the capture and to every replay."""
        model = {"model.path": self.model_path} if self.model_path else {}
        return set_args({"backend.devices": self.device, **model}) + self.extra_sets()

    def extra_sets(self) -> list[str]:
        """:meth:`config_sets` without the device and the model (which the Argo workflow parameterises)."""
        resume = {"resume.from": self.resume} if self.resume else {}
        return set_args(resume) + set_args(dict(sorted(self.config.items())))


RENDERED_ENV = "REPLAYJOB_RENDERED"  # every rendered container: the render_fields() it was computed from
RENDER_FIELDS = ("claim_name", "storage", "storage_class", "cpu", "memory", "shm", "deadline_s", "parallelism",
                 "node_gpus", "driver_version", "driver_label", "priority_class", "semaphore", "device", "ranks",
                 "image_policy", "queue")
_FIELDS = {f for f in AblationSpec.__dataclass_fields__ if f != "arms"}
_TYPES: dict[str, type] = {name: {"int": int, "str": str, "bool": bool}[str(f.type)]
                           for name, f in AblationSpec.__dataclass_fields__.items()
                           if f.type in ("int", "str", "bool")}


def spec_from_dict(data: dict[str, Any], where: str = "ablation") -> AblationSpec:
    """Build a spec from parsed TOML; unknown keys are refused with their names."""
    unknown = sorted(set(data) - _FIELDS - {"arms"})
    if unknown:
        raise ConfigError("unknown key(s): " + ", ".join(unknown), where=where,
                          hint="allowed: " + ", ".join(sorted(_FIELDS | {"arms"})))
    arms_raw = data.get("arms")
    if not isinstance(arms_raw, dict) or not arms_raw:
        raise ConfigError("needs an [arms] table with at least one arm", where=f"{where}: arms")
    arms = tuple(Arm(name, _check_overrides(over, f"{where}: arms.{name}"))
                 for name, over in arms_raw.items())
    kwargs = {k: v for k, v in data.items() if k != "arms"}
    kwargs["config"] = _check_overrides(kwargs.get("config", {}), f"{where}: config")
    for key, value in kwargs.items():
        expected = _TYPES.get(key, dict)
        if type(value) is not expected:
            raise ConfigError(f"must be {expected.__name__}, not {type(value).__name__}",
                              where=f"{where}: {key}")
    if "capture" in kwargs:
        kwargs["capture"] = _capture_ref(kwargs["capture"], where)
    if "pods" in kwargs:
        kwargs["pods"] = read_pods(kwargs["pods"], f"{where}: pods")
    try:
        spec = AblationSpec(arms=arms, **kwargs)
    except ConfigError as exc:
        raise ConfigError(exc.message, where=f"{where}: {exc.where or ''}", hint=exc.hint) from None
    _check_knobs(spec, where)
    return spec


def _check_knobs(spec: AblationSpec, where: str) -> None:
    """Arm overrides must be registered systems-only knobs; anything else would change the math."""

    # the spec drives replayjob's own trainer; an existing capture's producer is read from its manifest
    # (replayjob.launch.capture_ref.check): here, only what is no producer's knob
    registered = knobs_for(BUILTIN) if spec.capture is None else KNOBS
    for arm in spec.arms:
        for key in arm.overrides:
            if key not in registered:
                raise ConfigError(f"{key!r} is not a systems-only knob", where=f"{where}: arms.{arm.name}",
                                  hint="knobs: " + ", ".join(sorted(registered)))


def load_spec(path: str | Path) -> AblationSpec:
    """Read an ablation spec TOML file (strictly: unknown keys and bad values are refused)."""
    return load_spec_text(path)[0]


def load_spec_text(path: str | Path) -> tuple[AblationSpec, str]:
    """:func:`load_spec` and the file's text (what the manifests ship to the pods, parsed there again)."""
    p = Path(path)
    data = read_toml_file_bytes(p, what="ablation spec")  # regular files only: a FIFO would block the reader
    return spec_from_dict(read_toml_bytes(data, p, what="ablation spec"), str(p)), data.decode("utf-8")


def spec_from_text(text: str, where: str = "ablation") -> AblationSpec:
    """A spec from its TOML text (a ConfigMap's, say), as strictly as :func:`load_spec`."""
    if len(text.encode("utf-8")) > MAX_TOML_BYTES:
        raise ConfigError(f"larger than {MAX_TOML_BYTES} bytes", where=where)
    return spec_from_dict(read_toml_text(text, where, what="ablation spec"), where)
