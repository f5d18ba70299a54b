"""The trajectory bundle's documents, each declared once (docs/bundle-format.md).

A bundle (``replayjob.bundle``, format 2.x) is read through these declarations and nothing else:

* :class:`BundleManifest`: ``manifest.json``, with its ``index`` (:class:`BundleIndex`: identity,
  recompute config, one :class:`Sample` per row) and ``expected`` sections, the stage contracts, the
  payload specs and the pin of ``payloads.safetensors``;
* :class:`BundleComplete`: ``COMPLETE`` of a bundle directory (the seal: the manifest's SHA-256);
* :class:`RankComplete`: ``COMPLETE.<r>`` of a multi-rank root (rank ``r`` has landed);
* :class:`RootComplete`: ``COMPLETE`` of a multi-rank root (every rank has landed).

Each field is typed and ranged; what ties fields together (the stages a kind declares, the samples'
text under the redaction policy, the expected outputs' shapes, the identity against ``multi_rank``)
is a rule of the declaration, refused naming the field.  What summarises a payload (the payload
file's size and header digest, each tensor's digest, dtype and shape, the manifest digest a
``COMPLETE`` records, the row counts) is recomputed from the payload by the reader
(:mod:`replayjob.bundle.reader`) and a difference refused.  The version gate
(:func:`check_version`) runs first: a bundle of another format version is refused by its version,
never as a document of this one.
"""

from __future__ import annotations

import re
from operator import attrgetter
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from replayjob.artifacts.capture_manifest import LOGPROB, Domain
from replayjob.declaration import Count, Digest, Document, Finite, Int, NonNegative, OneLine, Positive, whole
from replayjob.errors import ContractError, IntegrityError

FORMAT = "replayjob.bundle"
# The version each kind appeared in: a writer writes the oldest minor version that holds its bundle.
KIND_VERSIONS = {"rollout": "2.0.0", "step": "2.0.0", "update": "2.1.0"}
# 2.2.0 added the run id of a multi-rank bundle (manifest ``multi_rank.run_id``, ``COMPLETE.<r>`` and the
# root ``COMPLETE``): a rank directory is written as 2.2.0 whatever its kind; a single bundle keeps its kind's.
MULTI_RANK_VERSION = "2.2.0"
FORMAT_VERSION = max([*KIND_VERSIONS.values(), MULTI_RANK_VERSION],
                     key=lambda v: tuple(int(x) for x in v.split(".")))  # reads 2.x
STAGE_VERSION = "v1"

MANIFEST = "manifest.json"
PAYLOAD_FILE = "payloads.safetensors"
COMPLETE = "COMPLETE"

KINDS = ("rollout", "step", "update")
STAGE_ORDER = ("sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate",
               "loss.policy")
KIND_STAGES = {
    "rollout": ("sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"),
    "step": ("sample", "loss.policy"),
    "update": STAGE_ORDER,  # a rollout and the one actor step that consumed it, in one bundle
}
STEP_KINDS = tuple(k for k, s in KIND_STAGES.items() if "loss.policy" in s)  # identity: (rollout_id, step_id)
CAPABILITIES = ("recompute", "recorded-only", "inspect-only", "unsupported")
# stage -> (output field -> "sample" | "token" | "scalar"); token fields live in payloads.
OUTPUTS: dict[str, dict[str, str]] = {
    "sample": {},
    "reward.raw": {"raw": "sample"},
    "reward.post_process": {"scores": "sample"},
    "advantage.kl": {"kl": "token"},
    "advantage.estimate": {"advantages": "token"},
    "loss.policy": {"loss": "scalar", "loss_weights": "token"},
}
# The payload dtypes a bundle may hold, by their safetensors names.
DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "U8", "BOOL")
# Payloads a stage computes with, by the dtypes it needs: token ids are integers (a float id cannot be
# decoded), log-probabilities, KL, advantages and loss weights are floating point.
INTEGER_DTYPES = ("I64", "I32", "U8")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
PAYLOAD_DTYPES: dict[str, tuple[str, ...]] = {
    **{name: INTEGER_DTYPES for name in ("response_ids", "label_ids")},
    **{name: FLOAT_DTYPES for name in ("logprobs", "old_logprobs", "ref_logprobs", "kl", "advantages",
                                       "loss_weights")}}
# The values a per-token payload may hold inside a sample's response (its first ``response_length`` tokens), declared
# once beside the capture payload's (:class:`replayjob.artifacts.capture_manifest.Domain`): a finite value outside is
# no value a trainer consumed (a log-probability above 0 is a probability above 1) and is refused naming the payload,
# sample and token.  Non-finite values inside the response are evidence (left to the comparison); padding is only
# required finite.  Expected outputs (``kl``, ``advantages``, ``loss_weights``) are compared, not judged.
PAYLOAD_DOMAINS: dict[str, Domain] = {"logprobs": LOGPROB, "old_logprobs": LOGPROB, "ref_logprobs": LOGPROB}
TEXT_FIELDS = ("prompt", "completion", "label")
ID_FIELDS = ("response_ids", "label_ids")
FIXED_DROPS = ("paths", "endpoints", "environment", "secrets")
# Config values the trainer refuses below 0 (``replayjob.config.schema.AlgorithmConfig``): a bundle whose
# producer recorded one is refused too, never recomputed with it.
NON_NEGATIVE = ("std_eps", "kl_reward_coef", "adv_clip", "clip_low", "clip_high", "kl_loss_coef", "token_cap")
_TRAINER_KEYS = {"clip_low": "clip_eps_low", "clip_high": "clip_eps_high"}  # where the trainer's config differs
TASKS = ("arithmetic", "reverse")
PAYLOAD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
IDENTIFIER = "[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"

Id = Annotated[str, whole(IDENTIFIER)]
"""A short identifier: bundle, sample, group, cohort, partition, batch and run ids."""
RankKey = Annotated[str, whole("0|[1-9][0-9]{0,17}")]
"""A rank written as a JSON object key (a decimal integer >= 0)."""
TextPolicy = Annotated[str, whole("hash|drop|truncate:[1-9][0-9]{0,3}")]
"""How a text field is redacted: hashed, truncated to N characters (1 to 9999) or dropped."""
Version = Annotated[str, whole(r"2\.(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})")]
"""A 2.x format version (the gate, :func:`check_version`, has refused any other major version)."""
Prefix = Annotated[str, msgspec.Meta(max_length=9999)]


# ------------------------------------------------------------------------------------------- versions
def version_error(version: object) -> ContractError:
    """The refusal of a bundle whose format version this reader does not read (exit 2)."""
    return ContractError(f"bundle format_version {version!r} is not read by this replayjob, which reads bundle "
                         f"format {FORMAT_VERSION} (one {PAYLOAD_FILE}, samples and expected outputs inside "
                         f"{MANIFEST})", where=MANIFEST,
                         hint="capture the bundle again with this replayjob, or read it with the replayjob "
                              "release that wrote it")


def reads_version(version: object) -> bool:
    """Whether this reader reads a bundle of ``format_version`` (the same major version)."""
    return isinstance(version, str) and version.split(".")[0] == FORMAT_VERSION.split(".")[0]


def _minor(version: str) -> int:
    parts = version.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1


def kind_version_problem(version: object, kind: object, multi_rank: bool = False) -> str | None:
    """Why a ``kind`` bundle (a rank directory when ``multi_rank``) cannot be of ``version`` (a 2.x version
    older than what it holds), or None."""
    since = KIND_VERSIONS.get(kind) if isinstance(kind, str) else None
    if since is not None and _minor(since) > 0 and _minor(str(version)) < _minor(since):  # "2", "2.x": no minor
        return f"{kind} bundles need format_version {since} or later; this manifest says {version!r}"
    if multi_rank and _minor(str(version)) < _minor(MULTI_RANK_VERSION):
        return (f"multi-rank bundles (multi_rank set) need format_version {MULTI_RANK_VERSION} or later (every "
                f"rank records the run id that ties the ranks to one run); this manifest says {version!r}")
    return None


def check_version(version: object, kind: object = None, multi_rank: bool = False) -> None:
    """The version gate: refuse another major version, and a ``kind`` (or a rank of a multi-rank bundle) newer
    than the minor version that claims it."""
    if not reads_version(version):
        raise version_error(version)
    problem = kind_version_problem(version, kind, multi_rank)
    if problem is not None:
        raise IntegrityError(problem, where=MANIFEST,
                             hint="capture the bundle again with this replayjob" if multi_rank else None)


def bundle_version(kind: str, multi_rank: bool) -> str:
    """The oldest format version that holds a ``kind`` bundle (a rank directory when ``multi_rank``)."""
    return max(KIND_VERSIONS[kind], MULTI_RANK_VERSION if multi_rank else "0.0.0", key=lambda v: _minor(v))


# ------------------------------------------------------------------------------------------ manifest
class StageContract(Document, frozen=True):
    """``stages.<stage>``: what a replay does with the stage."""

    version: Literal["v1"]  # STAGE_VERSION
    capability: Literal["recompute", "recorded-only", "inspect-only", "unsupported"]  # CAPABILITIES
    implementation: OneLine  # printed by bundle inspect and replay: one line, no control character
    reason: OneLine


class PayloadSpec(Document, frozen=True):
    """``payloads.<name>``: one tensor of ``payloads.safetensors`` (dtype, shape and digest: summaries of it)."""

    dtype: Literal["F64", "F32", "F16", "BF16", "I64", "I32", "U8", "BOOL"]  # DTYPES
    shape: list[Count]
    sha256: Digest  # of the tensor's bytes
    role: Literal["input", "expected"]


class PayloadFile(Document, frozen=True):
    """``payload_file``: the one payload file, its size and the SHA-256 of its header block."""

    file: str
    bytes: Count
    header_sha256: Digest

    def __post_init__(self) -> None:
        if self.file != PAYLOAD_FILE:
            raise ValueError(f"payload file {self.file!r} must be {PAYLOAD_FILE!r}: a bundle holds its tensors in one "
                             "safetensors file; nothing else is read")


class Tolerance(Document, frozen=True):
    """``comparison.<stage>``: a value matches when ``|actual - expected| <= atol + rtol * |expected|``."""

    atol: NonNegative
    rtol: NonNegative


class Redaction(Document, frozen=True):
    """``redaction``: text is hashed, truncated or dropped; token ids kept or dropped; the rest dropped."""

    prompt: TextPolicy
    completion: TextPolicy
    label: TextPolicy
    response_ids: Literal["keep", "drop"]
    label_ids: Literal["keep", "drop"]
    paths: Literal["drop"]
    endpoints: Literal["drop"]
    environment: Literal["drop"]
    secrets: Literal["drop"]


class MultiRank(Document, frozen=True):
    """``multi_rank``: this bundle is rank ``rank`` of a root every rank of ``expected_ranks`` lands in."""

    rank: Count
    expected_ranks: Annotated[list[Count], msgspec.Meta(min_length=1)]
    run_id: Id

    def __post_init__(self) -> None:
        if self.rank not in self.expected_ranks or len(set(self.expected_ranks)) != len(self.expected_ranks):
            raise ValueError("multi_rank must be null or {rank, expected_ranks, run_id} with rank listed "
                             "(`expected_ranks` distinct)")


class Physical(Document, frozen=True):
    rank: Count
    world_size: Positive
    weight_version: Count


class Identity(Document, frozen=True):
    """``index.identity``: the logical actor step (``step_id`` null in a rollout bundle) and where it ran."""

    rollout_id: Count
    step_id: Count | None
    physical: Physical


class TaskConfig(Document, frozen=True):
    name: Literal["arithmetic", "reverse"]  # TASKS
    max_operand: Int

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"config.task.max_operand must be an integer >= 1, found {self.max_operand} (the "
                             "trainer refuses environment.max_operand < 1; record the trainer's value)")


class RecomputeConfig(Document, frozen=True):
    """``index.config``: what the stages are recomputed with, in the trainer's ranges.  Which values this
    replayjob can recompute with (estimator, KL kind, loss aggregation, context parallelism, tokenizer) is the
    bundle reader's contract (:func:`replayjob.bundle.format.check_supported`), not the document's."""

    estimator: str
    samples_per_prompt: Int
    std_eps: Finite
    kl_kind: str
    kl_reward_coef: Finite
    batch_adv_norm: bool
    adv_clip: Finite
    token_cap: Int
    loss_agg: str
    clip_low: Finite
    clip_high: Finite
    kl_loss_coef: Finite
    context_parallel: Int
    task: TaskConfig | None
    tokenizer: str | None

    def __post_init__(self) -> None:
        spp = self.samples_per_prompt
        if spp < 1:
            raise ValueError(f"config.samples_per_prompt must be an integer >= 1, found {spp} (record the trainer's "
                             "group size)")
        if self.estimator == "rloo" and spp < 2:
            raise ValueError("config.samples_per_prompt must be >= 2 for estimator 'rloo' (its baseline is the "
                             f"mean of the other samples), found {spp}")
        for key in NON_NEGATIVE:  # clip_low, clip_high >= 0 keep the ratio bounds in order: 1 - low <= 1 <= 1 + high
            value = getattr(self, key)
            if value < 0:
                low, high = 1 - self.clip_low, 1 + self.clip_high
                order = (f" (the ratio clip bounds [1 - clip_low, 1 + clip_high] = [{low!r}, {high!r}] are out of "
                         "order)" if key in ("clip_low", "clip_high") and low > high else "")
                raise ValueError(f"config.{key} must be >= 0, found {value!r}{order}; the trainer refuses a negative "
                                 f"algorithm.{_TRAINER_KEYS.get(key, key)}")


class Sample(Document, frozen=True):
    """``index.samples[i]``: one row's identity, lengths and provenance, its text only as the redaction policy
    allows (``<field>_sha256`` when hashed, ``<field>_prefix`` when truncated, neither when dropped)."""

    sample_id: Id
    group: Id | None  # the semantic group; null: membership unknown
    cohort: Id
    prompt_length: Count
    response_length: Count
    label_length: Count | None
    partition: Id
    consumer_batch: Id
    micro_batch: Id
    rank: Count
    weight_version: Count
    prompt_sha256: Digest | msgspec.UnsetType = msgspec.UNSET
    prompt_prefix: Prefix | msgspec.UnsetType = msgspec.UNSET
    completion_sha256: Digest | msgspec.UnsetType = msgspec.UNSET
    completion_prefix: Prefix | msgspec.UnsetType = msgspec.UNSET
    label_sha256: Digest | msgspec.UnsetType = msgspec.UNSET
    label_prefix: Prefix | msgspec.UnsetType = msgspec.UNSET


class BundleIndex(Document, frozen=True):
    """``manifest.json`` ``index``: identity, recompute config and the samples (ids distinct)."""

    format: Literal["replayjob.bundle"]
    bundle_id: Id
    kind: Literal["rollout", "step", "update"]
    identity: Identity
    config: RecomputeConfig
    samples: Annotated[list[Sample], msgspec.Meta(min_length=1)]

    def __post_init__(self) -> None:
        ids = {s.sample_id for s in self.samples}
        if len(ids) != len(self.samples):
            raise ValueError("sample ids must be unique (`samples[].sample_id`)")


class PayloadRef(Document, frozen=True):
    """A per-token expected output: the expected payload that holds it."""

    payload: str


ExpectedValue = list[Finite] | Finite | PayloadRef


class BundleManifest(Document, frozen=True):
    """``manifest.json`` (docs/bundle-format.md): a bundle's versions, producer, stage contracts, payloads and
    their pins, comparison, redaction, ``index`` and ``expected`` sections and ``multi_rank``."""

    format: Literal["replayjob.bundle"]
    format_version: Version
    bundle_id: Id
    kind: Literal["rollout", "step", "update"]
    producer: dict[str, str | Int | Finite | None]
    stages: dict[str, StageContract]
    payloads: dict[str, PayloadSpec]
    payload_file: PayloadFile | None
    comparison: dict[str, Tolerance]
    redaction: Redaction
    index: BundleIndex
    expected: dict[str, dict[str, ExpectedValue]]
    multi_rank: MultiRank | None

    def __post_init__(self) -> None:
        problem = kind_version_problem(self.format_version, self.kind, self.multi_rank is not None)
        if problem is not None:
            raise ValueError(problem)
        want = KIND_STAGES[self.kind]
        if set(self.stages) != set(want):
            raise ValueError(f"`stages`: a {self.kind} bundle declares exactly the stages {list(want)}")
        if self.stages["sample"].capability == "recompute":
            raise ValueError("`stages.sample`: the sample stage cannot be recomputed offline (it needs the model)")
        for name, spec in self.payloads.items():
            _payload_name(name)
            allowed = PAYLOAD_DTYPES.get(name)
            if allowed is not None and spec.dtype not in allowed:
                what = "token ids are integers" if allowed is INTEGER_DTYPES else "it holds real numbers"
                raise ValueError(f"`payloads.{name}.dtype`: payload {name!r} is {spec.dtype}: {what}, so its dtype "
                                 f"must be one of {list(allowed)}")
        if self.payload_file is None and self.payloads:
            raise ValueError(f"`payload_file`: payloads {sorted(self.payloads)} are declared but payload_file is null")
        if self.payload_file is not None and not self.payloads:
            raise ValueError("`payload_file` must be null when no payload is declared")
        if set(self.comparison) != {s for s in want if s != "sample"}:
            raise ValueError("`comparison` must give atol and rtol for every compared stage")
        self._check_index()
        self._check_expected()

    def _check_index(self) -> None:
        ix, mr = self.index, self.multi_rank
        if ix.bundle_id != self.bundle_id or ix.kind != self.kind:
            raise ValueError("`index`: index format, bundle_id or kind disagrees with the manifest")
        step = ix.identity.step_id
        if self.kind in STEP_KINDS and step is None:
            raise ValueError(f"`index.identity.step_id`: a {self.kind} bundle's identity needs step_id (an integer "
                             ">= 0)")
        if self.kind not in STEP_KINDS and step is not None:
            raise ValueError("`index.identity.step_id`: a rollout bundle's identity has step_id null")
        phys = ix.identity.physical
        if mr is not None and (phys.rank != mr.rank or phys.world_size != len(mr.expected_ranks)):
            raise ValueError("`index.identity.physical` disagrees with manifest multi_rank")
        if mr is None and phys.world_size != 1:
            raise ValueError("`index.identity.physical.world_size` > 1 needs a multi-rank bundle layout")
        if phys.rank >= phys.world_size:
            raise ValueError(f"`index.identity.physical.rank` {phys.rank} is not below its world_size "
                             f"{phys.world_size}")
        strays = [i for i, sample in enumerate(ix.samples) if sample.rank != phys.rank]
        if strays:  # a bundle holds what its own rank consumed
            raise ValueError(f"`index.samples[{strays[0]}].rank` is {ix.samples[strays[0]].rank}, but this bundle is "
                             f"rank {phys.rank}'s (`index.identity.physical.rank`)"
                             + (f"; {len(strays) - 1} more samples name another rank" if len(strays) > 1 else ""))
        for field in TEXT_FIELDS:  # one pass per text field: the samples' keys against the policy
            policy: str = getattr(self.redaction, field)
            hashed, limit = policy == "hash", int(policy.split(":")[1]) if policy.startswith("truncate:") else None
            digests, prefixes = map(attrgetter(f"{field}_sha256"), ix.samples), map(attrgetter(f"{field}_prefix"),
                                                                                       ix.samples)
            for i, (digest, prefix) in enumerate(zip(digests, prefixes, strict=True)):
                if (digest is not msgspec.UNSET) != hashed or (prefix is not msgspec.UNSET) != (limit is not None):
                    raise ValueError(f"`index.samples[{i}]`: {field} text does not follow the redaction policy "
                                     f"{policy!r}")
                if limit is not None and len(prefix) > limit:
                    raise ValueError(f"`index.samples[{i}].{field}_prefix` is longer than the policy's {limit} "
                                     "characters")

    def _check_expected(self) -> None:
        n = len(self.index.samples)
        allowed = set(KIND_STAGES[self.kind]) - {"sample"}
        if not set(self.expected) <= allowed:
            raise ValueError(f"`expected`: expected outputs may name only {sorted(allowed)}")
        for stage, fields in self.expected.items():
            if not set(fields) <= set(OUTPUTS[stage]):
                raise ValueError(f"`expected.{stage}`: {stage} outputs are {sorted(OUTPUTS[stage])}")
            for field, value in fields.items():
                shape = OUTPUTS[stage][field]
                at = f"`expected.{stage}.{field}`"
                if shape == "sample" and not (isinstance(value, list) and len(value) == n):
                    raise ValueError(f"{at} must be a list of {n} numbers (one per sample)")
                if shape == "scalar" and not isinstance(value, float):
                    raise ValueError(f"{at} must be a number")
                if shape == "token":
                    spec = self.payloads.get(field)
                    if not (isinstance(value, PayloadRef) and value.payload == field) or spec is None or (
                            spec.role != "expected"):
                        raise ValueError(f"{at} must be {{\"payload\": \"{field}\"}} naming an expected payload")


def _payload_name(name: str) -> None:
    if not PAYLOAD_NAME.fullmatch(name):
        raise ValueError(f"payload name {name!r} is not allowed: use [a-z][a-z0-9_]* (at most 64 characters)")


# ------------------------------------------------------------------------------------ landing records
class BundleComplete(Document, frozen=True):
    """``COMPLETE`` of a bundle directory, written last: the manifest's SHA-256 seals the bundle."""

    format: Literal["replayjob.bundle"]
    bundle_id: Id
    manifest_sha256: Digest  # of manifest.json's bytes: recomputed by the reader


class RankComplete(Document, frozen=True):
    """``COMPLETE.<r>`` of a multi-rank root: rank ``rank`` of the run ``run_id`` has landed."""

    format: Literal["replayjob.bundle"]
    bundle_id: Id
    rank: Count
    expected_ranks: Annotated[list[Count], msgspec.Meta(min_length=1)]
    run_id: Id
    manifest_sha256: Digest  # of rank-<r>/manifest.json: recomputed by the reader through that rank's COMPLETE

    def __post_init__(self) -> None:
        if self.rank not in self.expected_ranks or len(set(self.expected_ranks)) != len(self.expected_ranks):
            raise ValueError("`expected_ranks` must list distinct ranks, `rank` among them")


class RootComplete(Document, frozen=True):
    """``COMPLETE`` of a multi-rank root, written by the last rank to land: every rank and its manifest."""

    format: Literal["replayjob.bundle"]
    bundle_id: Id
    run_id: Id
    ranks: Annotated[list[Count], msgspec.Meta(min_length=1)]
    rank_manifests: dict[RankKey, Digest]

    def __post_init__(self) -> None:
        if self.ranks != sorted(set(self.ranks)):
            raise ValueError(f"`ranks`: root COMPLETE must list the ranks as distinct integers >= 0 in order, found "
                             f"{self.ranks!r}")
        if sorted(self.rank_manifests) != sorted(str(r) for r in self.ranks):
            raise ValueError(f"`rank_manifests`: root COMPLETE records manifests for ranks "
                             f"{sorted(self.rank_manifests)}, its rank list is {self.ranks}")


# The keys of a root COMPLETE written before format 2.2.0 (no run id): refused by version, not as a document.
LEGACY_ROOT_KEYS = frozenset({"format", "bundle_id", "ranks", "rank_manifests"})


def gate(doc: Any, where: str | Path = MANIFEST) -> None:
    """What precedes the manifest's declaration: a JSON object of this format, of a version this reader reads (a
    bundle of another version is refused by its version, never as a malformed document of this one)."""
    if not isinstance(doc, dict):
        raise IntegrityError("manifest must be a JSON object", where=where)
    if doc.get("format") != FORMAT:
        raise IntegrityError(f"not a trajectory bundle (format {doc.get('format')!r})", where=where)
    check_version(doc.get("format_version"), doc.get("kind"), multi_rank=isinstance(doc.get("multi_rank"), dict))
