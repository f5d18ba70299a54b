"""The capture manifest: what pins a captured optimizer batch, written last and verified first.

One schema, ``replayjob.capture_manifest/v3`` (:data:`SCHEMA`), for every producer: ``framework`` names the
producer that wrote it (``replayjob``: the built-in trainer; ``trl``, ``torch``: the capture API,
:mod:`replayjob.artifacts.api_manifest`), and a root over several processes lists them in ``ranks``
(:mod:`replayjob.artifacts.capture_root`, :mod:`replayjob.producers.api.parts`).  Every producer's manifest holds
``schema``, ``framework``, ``step``, ``producer`` (provenance), ``rows``, ``logical_batch_sha256`` and
``local_effective_rows_sha256`` (:func:`replayjob.digest.batch_sha256`), ``config`` and ``contract`` (each
with its SHA-256) and the sealed ``outcome``; the rest is the producer's, checked by its module.
:func:`replayjob.artifacts.capture_reader.read` is the one reader: it hashes the bytes against the pin, then
dispatches on ``framework`` and ``ranks``.  Manifests of an earlier release's schemas (:data:`OLD_SCHEMAS`)
are refused naming both versions.

The built-in trainer's manifest (``framework = "replayjob"``, canonical JSON, one object)::

    schema, framework, step
    producer          replayjob and torch versions, python, device, determinism provenance
    payload           file (the step's ``optimizer_batch_step_<K:06d>.safetensors``, next to the manifest),
                      size, spans_sha256 (the payload's span digest,
                      :mod:`replayjob.artifacts.capture_payload`; RNG included), rng_keys
    rows              rows, tokens, response_tokens, loss_bearing_tokens, loss_weight_sum
    logical_batch_sha256, local_effective_rows_sha256
    config            resolved (redacted) and its sha256
    contract          the optimizer contract (redacted) and its sha256
    initial_adapter   path, size, sha256 of the weight file the source started from
    state             (chosen-step and ring-buffer captures only) the resume state the step starts
                      from: dir (the step's ``optimizer_batch_step_<K:06d>.state``, next to the
                      manifest), step (= step - 1),
                      optimizer_sha256 (its optimizer.safetensors), lr (of its one parameter group),
                      nonfinite_inputs (the rows hold NaN/Inf: replayed only under
                      ``optimizer_batch.allow_nonfinite_inputs``)
    outcome           the source's own update of this step as it returned: loss, grad_norm (each
                      null when not finite) and final_adapter_sha256 (the adapter after the update, in
                      the bytes every adapter writer uses); absent only in captures written before it

A manifest without ``state`` is a step-zero capture from a step -1 state (``step`` must be 0).
``outcome`` seals the numbers ``reduce`` compares replays with: the source's ``metrics.json`` (or its
step record) reports them too, but nothing pins that file, while every replay pins this manifest's
SHA-256, so ``reduce`` refuses source metrics whose loss, gradient norm or final adapter digest
differ from the sealed ones (``inputs.capture_pins``).
A reader passes the manifest's expected SHA-256: the bytes are hashed before they are parsed, then
every field is type-checked and the embedded digests recomputed; unknown keys are refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from replayjob.declaration import Count, Digest, Document, Finite, decode
from replayjob.digest import normalize_digest, sha256_bytes, sha256_json
from replayjob.errors import IntegrityError
from replayjob.frameworks import BUILTIN
from replayjob.fsio import atomic_write_bytes, read_regular_bytes
from replayjob.jsonio import canonical_bytes, loads_strict
from replayjob.redact import redact_path

SCHEMA = "replayjob.capture_manifest/v3"
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024 * 1024
# earlier releases wrote one schema per producer and layout (the built-in trainer's v1 pinned its payload by
# the file's SHA-256, v2 by its span digest; the built-in root over ranks; the capture API's, one process or
# several); v3 is one schema whose ``framework`` names the producer
OLD_SCHEMAS = ("replayjob.optimizer_batch_manifest/v1", "replayjob.optimizer_batch_manifest/v2",
               "replayjob.optimizer_batch_ranks/v1", "replayjob.integration_capture/v1",
               "replayjob.integration_ranks/v1")
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
OUTCOME = "outcome"


@dataclass(frozen=True)
class Domain:
    """The values one per-token or per-row array of a captured step may hold, declared once beside the field
    (:data:`replayjob.artifacts.capture_payload.FIELD_DOMAINS`, :data:`replayjob.artifacts.api_manifest.INPUT_DOMAINS`)
    and enforced by the payload's reader for every producer: a finite value outside it is no value a real step
    holds (a log-probability above 0 is a probability above 1; a negative weight turns a token's loss around).
    Non-finite values are the non-finite rule's (flagged, opted into); here only finite ones are judged.

    Example:
        >>> import numpy as np
        >>> LOGPROB.first_outside(np.array([-1.0, 0.0, -0.0, 0.25]))
        (3, 0.25)
        >>> MASK.first_outside(np.array([0, 1, 1])) is None
        True
    """

    rule: str              # how a refusal words the domain
    ge: float | None = None  # every value >= ge
    le: float | None = None  # every value <= le
    binary: bool = False   # every value 0 or 1 (a mask)

    def first_outside(self, a: Any) -> tuple[int, float] | None:
        """The index and value of ``a``'s first finite element outside the domain (a flat numpy array), or None."""
        import numpy as np
        if a.dtype == np.bool_ or not a.size or (self.ge is None and self.le is None and not self.binary):
            return None
        with np.errstate(invalid="ignore"):
            # the common case in one pass each: every value within (a NaN or an infinity makes the bound's
            # comparison false, and the element-wise pass below decides)
            if not self.binary and (self.ge is None or a.min() >= self.ge) and (self.le is None or a.max() <= self.le):
                return None
            bad = np.zeros(a.shape, dtype=np.bool_)
            if self.ge is not None:
                bad |= a < self.ge
            if self.le is not None:
                bad |= a > self.le
            if self.binary:
                bad |= (a != 0) & (a != 1)
            if a.dtype.kind == "f":
                bad &= np.isfinite(a)
        if not bad.any():
            return None
        i = int(np.argmax(bad))
        return i, a[i].item()

    def reason(self, field: str, value: float, at: str) -> str:
        """The refusal of ``field``'s ``value`` at ``at`` (a row and token), naming the rule."""
        return f"{field} holds {value!r} at {at}, outside its domain: {self.rule}"


FINITE = Domain("a finite number")
LOGPROB = Domain("a log-probability is <= 0 (a probability of at most 1)", le=0.0)
WEIGHT = Domain("a weight is >= 0 (a negative weight turns its token's loss around)", ge=0.0)
MASK = Domain("a mask holds 0 or 1", binary=True)


def file_stem(step: int) -> str:
    return f"optimizer_batch_step_{step:06d}"


def payload_name(step: int) -> str:
    return file_stem(step) + ".safetensors"


def manifest_name(step: int) -> str:
    return file_stem(step) + ".manifest.json"


REPLAY_CONFIG = "replay.toml"  # the ready replay config a capture of one step writes beside its files


def state_dir_name(step: int) -> str:
    """The directory next to the manifest holding the start state of a chosen-step or ring-buffer capture."""
    return file_stem(step) + ".state"


def replay_config_name(step: int) -> str:
    """The ready replay config a capture of several chosen steps writes for ``step``."""
    return f"replay_step_{step:06d}.toml"


@dataclass(frozen=True)
class PinnedManifest:
    """A verified capture manifest: the fields every producer's manifest shares."""

    path: Path
    sha256: str
    doc: dict[str, Any]

    @property
    def framework(self) -> str:
        """The producer that wrote the capture (``replayjob``: the built-in trainer)."""
        return str(self.doc["framework"])

    @property
    def logical_sha256(self) -> str:
        return str(self.doc["logical_batch_sha256"])

    @property
    def effective_sha256(self) -> str:
        return str(self.doc["local_effective_rows_sha256"])

    @property
    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = self.doc["config"]["resolved"]
        return out

    @property
    def outcome(self) -> dict[str, Any] | None:
        """The source update's sealed loss, grad_norm and final_adapter_sha256 (:func:`outcome`); ``None`` in
        a capture written before the seal."""
        out: dict[str, Any] | None = self.doc.get(OUTCOME)
        return out

    @property
    def contract(self) -> dict[str, Any]:
        out: dict[str, Any] = self.doc["contract"]["value"]
        return out


@dataclass(frozen=True)
class Manifest(PinnedManifest):
    """The built-in trainer's capture manifest."""

    @property
    def payload_path(self) -> Path:
        return self.path.parent / str(self.doc["payload"]["file"])

    @property
    def payload_digest(self) -> str:
        """The payload's span digest (not the file's plain SHA-256; see :mod:`replayjob.artifacts.capture_payload`)."""
        return str(self.doc["payload"]["spans_sha256"])

    @property
    def payload_size(self) -> int:
        return int(self.doc["payload"]["size"])

    @property
    def initial_adapter_sha256(self) -> str:
        return str(self.doc["initial_adapter"]["sha256"])

    @property
    def initial_adapter_size(self) -> int:
        """The byte size of the weight file ``initial_adapter_sha256`` pins."""
        return int(self.doc["initial_adapter"]["size"])

    @property
    def step(self) -> int:
        return int(self.doc["step"])

    @property
    def state(self) -> dict[str, Any] | None:
        """The pinned start state of a chosen-step or ring-buffer capture (None: step zero from step -1)."""
        out: dict[str, Any] | None = self.doc.get("state")
        return out


def outcome(loss: float | None, grad_norm: float | None, final_adapter_sha256: str | None) -> dict[str, Any]:
    """A manifest's ``outcome``: the source update's loss and gradient norm (``None`` when not finite, as
    ``metrics.json`` records them) and the SHA-256 of the adapter after it."""
    def finite(v: float | None) -> float | None:
        return float(v) if v is not None and math.isfinite(v) else None

    return {"loss": finite(loss), "grad_norm": finite(grad_norm), "final_adapter_sha256": final_adapter_sha256}

# ------------------------------------------------------------------------------------------ the declaration
_BARE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file or directory name next to the manifest, nothing else
NonNegativeFinite = Annotated[float, msgspec.Meta(ge=0.0, le=1.7976931348623157e308)]


class Outcome(Document, frozen=True):
    """``outcome``: the source's own update of the captured step, sealed by the manifest's pin."""

    loss: Finite | None  # null when not finite
    grad_norm: NonNegativeFinite | None  # a norm: >= 0; null when not finite
    final_adapter_sha256: Digest | None


def _digest_of(value: dict[str, Any], field: str) -> str:
    """The canonical-JSON SHA-256 of an embedded block (a value canonical JSON cannot hold is refused)."""
    try:
        return sha256_json(value)
    except IntegrityError as exc:
        raise ValueError(f"`{field}` cannot be hashed: {exc.message}") from None


class Hashed(Document, frozen=True):
    """``config``: the resolved config and the SHA-256 of its canonical JSON (recomputed)."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "resolved": "the source's resolved config, recorded whole and pinned by its SHA-256; admission compares it "
                    "key by key with the replay's own through the config schema",
    }

    sha256: Digest
    resolved: dict[str, Any]

    def __post_init__(self) -> None:
        if _digest_of(self.resolved, "config.resolved") != self.sha256:
            raise ValueError("'config.sha256' does not match its content")


class ContractBlock(Document, frozen=True):
    """``contract``: the optimizer contract and the SHA-256 of its canonical JSON (recomputed)."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "value": "the optimizer contract, compared whole with the replay's recomputed contract at admission",
    }

    sha256: Digest
    value: dict[str, Any]

    def __post_init__(self) -> None:
        if _digest_of(self.value, "contract.value") != self.sha256:
            raise ValueError("'contract.sha256' does not match its content")


class ManifestPins(Document, frozen=True):
    """What every producer's manifest pins (its own fields are checked beside these by its reader)."""

    logical_batch_sha256: Digest
    local_effective_rows_sha256: Digest
    config: Hashed
    contract: ContractBlock


class PayloadPin(Document, frozen=True):
    file: str  # a bare name next to the manifest
    size: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAYLOAD_BYTES)]
    spans_sha256: Digest
    rng_keys: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]

    def __post_init__(self) -> None:
        if not (_BARE.fullmatch(self.file) and self.file.endswith(".safetensors")):
            raise ValueError(f"'payload.file' must be a bare .safetensors file name, found {self.file[:80]!r}")
        if "cpu" not in self.rng_keys:
            raise ValueError("'payload.rng_keys' must list 'cpu'")


class Rows(Document, frozen=True):
    """``rows``: a summary of the payload (recomputed from it when the payload is read)."""

    rows: Count
    tokens: Count
    response_tokens: Count
    loss_bearing_tokens: Count
    loss_weight_sum: Finite | None = None  # recomputed from the payload, as every other count here


class InitialAdapter(Document, frozen=True):
    path: str  # redacted (SECURITY.md); the file is found through the replay config's resume state
    size: Count
    sha256: Digest


class StartState(Document, frozen=True):
    """``state``: the resume state a chosen-step or ring-buffer capture starts from."""

    dir: str  # a bare name next to the manifest
    step: Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
    optimizer_sha256: Digest
    lr: Annotated[list[Finite], msgspec.Meta(min_length=1, max_length=1)]  # the trainer's AdamW: one param group
    nonfinite_inputs: bool

    def __post_init__(self) -> None:
        if not _BARE.fullmatch(self.dir):
            raise ValueError(f"'state.dir' must be a bare directory name, found {self.dir[:80]!r}")


class BuiltinHead(Document, frozen=True):
    """What every manifest of the built-in trainer holds, a step's (:class:`BuiltinManifest`) and a root's over ranks
    (:class:`replayjob.artifacts.capture_root.BuiltinRoot`) alike."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "producer": "provenance (versions, python, device, determinism), recorded for people; the pins decide",
    }

    schema: Literal["replayjob.capture_manifest/v3"]
    framework: Literal["replayjob"]
    step: Count
    producer: dict[str, Any]
    rows: Rows
    logical_batch_sha256: Digest
    local_effective_rows_sha256: Digest
    config: Hashed
    contract: ContractBlock
    initial_adapter: InitialAdapter


class BuiltinManifest(BuiltinHead, frozen=True):
    """The built-in trainer's capture manifest (the module docstring lists its fields)."""

    payload: PayloadPin
    state: StartState | None = None  # absent in a step-zero capture
    outcome: Outcome | None = None  # absent only in captures written before the seal

    def __post_init__(self) -> None:
        if self.state is None and self.step != 0:
            raise ValueError("'step' must be 0 (a capture without 'state' covers step zero only)")
        # the step names every file of the capture: a payload or state of another step is a contradiction
        if self.payload.file != payload_name(self.step):
            raise ValueError(f"'payload.file' is {self.payload.file[:80]!r}, but step {self.step}'s payload is "
                             f"{payload_name(self.step)!r}")
        if self.state is not None and self.state.step != self.step - 1:
            raise ValueError(f"'state.step' must be {self.step - 1} (the step before the captured one)")
        if self.state is not None and self.state.dir != state_dir_name(self.step):
            raise ValueError(f"'state.dir' is {self.state.dir[:80]!r}, but step {self.step}'s start state is "
                             f"{state_dir_name(self.step)!r}")


def decode_manifest(doc: Any, kind: type[Document], where: Path) -> None:
    """``doc`` read through its declaration ``kind``; a refusal is a malformed manifest field (a step's manifest, a
    root's over ranks or a part of either)."""
    try:
        decode(doc, kind, where=where)
    except IntegrityError as exc:
        raise IntegrityError(f"manifest {exc.message}" if exc.message.startswith("field ") else
                             f"manifest field {exc.message}", where=where,
                             hint="the manifest is malformed; capture the step again") from None


def _no_nulls(doc: dict[str, Any], keys: tuple[str, ...], where: Path) -> None:
    """Optional sections are absent, never null (a null would read as absent)."""
    for k in keys:
        need(k not in doc or doc[k] is not None, f"'{k}' is absent or an object, never null", where)


def validate_outcome(doc: dict[str, Any], where: Path) -> None:
    """A manifest's optional ``outcome`` (every producer's manifest reader uses it): :class:`Outcome`."""
    if OUTCOME in doc:
        need(doc[OUTCOME] is not None, f"'{OUTCOME}' is absent or an object, never null", where)
        decode_manifest(doc[OUTCOME], Outcome, where)


def build(*, step: int, producer: dict[str, Any], payload_file: str, payload_size: int, payload_digest: str,
          rng_keys: list[str],
          rows: dict[str, Any], logical: str, effective: str, resolved_config: dict[str, Any],
          contract: dict[str, Any], adapter_path: Path, adapter_size: int, adapter_sha256: str,
          state: dict[str, Any] | None = None, sealed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest document (nothing is written); ``state`` as the module docstring says, ``sealed`` its
    ``outcome`` (:func:`outcome`); the adapter path is recorded by
    :func:`~replayjob.redact.redact_path` (SECURITY.md)."""
    doc = {
        "schema": SCHEMA,
        "framework": BUILTIN,
        "step": step,
        "producer": producer,
        "payload": {"file": payload_file, "size": payload_size, "spans_sha256": payload_digest,
                    "rng_keys": sorted(rng_keys)},
        "rows": rows,
        "logical_batch_sha256": logical,
        "local_effective_rows_sha256": effective,
        "config": {"sha256": sha256_json(resolved_config), "resolved": resolved_config},
        "contract": {"sha256": sha256_json(contract), "value": contract},
        "initial_adapter": {"path": redact_path(adapter_path), "size": adapter_size, "sha256": adapter_sha256},
    }
    if state is not None:
        doc["state"] = state
    if sealed is not None:
        doc[OUTCOME] = sealed
    return doc


def write(path: Path, doc: dict[str, Any]) -> str:
    """Write the manifest atomically and exclusively (never over an existing one); return its SHA-256."""
    data = canonical_bytes(doc) + b"\n"
    atomic_write_bytes(path, data, exclusive=True)
    return sha256_bytes(data)


def need(cond: bool, what: str, where: Path) -> None:
    """Refuse a malformed manifest field (every producer's manifest reader uses it)."""
    if not cond:
        raise IntegrityError(f"manifest field {what}", where=where,
                             hint="the manifest is malformed; capture the step again")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def need_hex(v: Any, what: str, where: Path) -> None:
    try:
        need(normalize_digest(v, what=what) == v, f"{what} is not a lowercase hex SHA-256", where)
    except IntegrityError as exc:
        raise IntegrityError(f"manifest field {exc.message}", where=where) from None


def validate_pins(doc: dict[str, Any], where: Path) -> None:
    """The digests every manifest carries: logical and effective rows, config and contract (recomputed):
    :class:`ManifestPins`."""
    decode_manifest({k: doc.get(k) for k in ("logical_batch_sha256", "local_effective_rows_sha256", "config",
                                             "contract")}, ManifestPins, where)


def check_schema(doc: Any, where: Path) -> dict[str, Any]:
    """The one schema check every producer's reader makes first: an object of :data:`SCHEMA` naming its
    producer in ``framework``; a manifest of an earlier release's schema is refused naming both versions."""
    need(isinstance(doc, dict), "document must be a JSON object", where)
    schema = doc.get("schema")
    if isinstance(schema, str) and schema in OLD_SCHEMAS:
        raise IntegrityError(f"capture manifest schema {schema!r} was written by an earlier replayjob release; this "
                             f"release reads {SCHEMA!r}", where=where,
                             hint="capture the step again with this release (the earlier release still replays "
                                  "its own captures)")
    need(schema == SCHEMA, f"'schema' must be {SCHEMA!r}, found {str(schema)[:80]!r}", where)
    need(isinstance(doc.get("framework"), str) and doc["framework"] != "", "'framework' must name the producer",
         where)
    return doc


def validate(doc: Any, where: Path) -> dict[str, Any]:
    """The built-in trainer's manifest read through its declaration (:class:`BuiltinManifest`): every field's
    presence, type and range, no unknown key, and the embedded digests recomputed."""
    check_schema(doc, where)
    need(doc["framework"] == BUILTIN, f"'framework' must be {BUILTIN!r} in the built-in trainer's manifest", where)
    _no_nulls(doc, ("state", OUTCOME), where)
    decode_manifest(doc, BuiltinManifest, where)
    return doc


def read_pinned(path: str | Path, expected_sha256: str, *, hint: str,
                pin_name: str = "expected_manifest_sha256") -> tuple[Path, str, Any]:
    """Hash a manifest's bytes, compare with the pin, and only then parse them (strict JSON).

    Returns (path, sha256, document); the caller validates the document against its schema.
    ``hint`` says where the manifest should come from when it is missing; ``pin_name`` names the pin
    in messages.
    """
    p = Path(path)
    pin = normalize_digest(expected_sha256, what=pin_name)
    try:
        if p.is_symlink() or not p.is_file():
            raise IntegrityError("capture manifest not found (or not a regular file)", where=p, hint=hint)
        if p.stat().st_size > MAX_MANIFEST_BYTES:
            raise IntegrityError(f"manifest is above the {MAX_MANIFEST_BYTES}-byte limit", where=p)
        data = read_regular_bytes(p, max_bytes=MAX_MANIFEST_BYTES, what="capture manifest")  # never a link
    except OSError as exc:
        raise IntegrityError(f"cannot read the manifest: {exc.strerror}", where=p) from None
    actual = sha256_bytes(data)
    if actual != pin:
        raise IntegrityError(f"manifest SHA-256 is {actual}, the pin {pin_name} is {pin}",
                             where=p, hint="the manifest changed after capture, or the pin is from "
                                           "another run; use the digest the source run printed")
    return p, actual, loads_strict(data, where=p)


def read_verified(path: str | Path, expected_sha256: str) -> Manifest:
    """Hash the manifest bytes, compare with the pin, and only then parse and validate them."""
    p, actual, doc = read_pinned(path, expected_sha256,
                                 hint="point optimizer_batch.replay_path at the source run's "
                                      "optimizer_batch_step_000000.manifest.json")
    return Manifest(p, actual, validate(doc, p))
