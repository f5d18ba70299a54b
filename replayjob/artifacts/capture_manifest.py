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
    payload           file (a bare name next to the manifest), size, spans_sha256 (the payload's span
                      digest, :mod:`replayjob.artifacts.capture_payload`; RNG included), rng_keys
    rows              rows, tokens, response_tokens, loss_bearing_tokens, loss_weight_sum
    logical_batch_sha256, local_effective_rows_sha256
    config            resolved (redacted) and its sha256
    contract          the optimizer contract (redacted) and its sha256
    initial_adapter   path, size, sha256 of the weight file the source started from
    state             (chosen-step and ring-buffer captures only) the resume state the step starts
                      from: dir (a bare name next to the manifest), step (= step - 1),
                      optimizer_sha256 (its optimizer.safetensors), lr (per parameter group),
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
_KEYS = {"schema", "framework", "step", "producer", "payload", "rows", "logical_batch_sha256",
         "local_effective_rows_sha256", "config", "contract", "initial_adapter"}
_STATE_KEYS = {"dir", "step", "optimizer_sha256", "lr", "nonfinite_inputs"}
OUTCOME = "outcome"
_OUTCOME_KEYS = {"loss", "grad_norm", "final_adapter_sha256"}


def file_stem(step: int) -> str:
    return f"optimizer_batch_step_{step:06d}"


def payload_name(step: int) -> str:
    return file_stem(step) + ".safetensors"


def manifest_name(step: int) -> str:
    return file_stem(step) + ".manifest.json"


REPLAY_CONFIG = "replay.toml"  # the ready replay config a capture of one step writes beside its files


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


def validate_outcome(doc: dict[str, Any], where: Path) -> None:
    """A manifest's optional ``outcome`` (every producer's manifest reader uses it)."""
    if OUTCOME not in doc:
        return
    o = doc[OUTCOME]
    need(isinstance(o, dict) and set(o) == _OUTCOME_KEYS, f"'{OUTCOME}' needs exactly {sorted(_OUTCOME_KEYS)}",
         where)
    for k in ("loss", "grad_norm"):
        v = o[k]
        need(v is None or (isinstance(v, float) and math.isfinite(v)), f"'{OUTCOME}.{k}' must be a finite "
             "number or null", where)
    need(o["grad_norm"] is None or o["grad_norm"] >= 0.0, f"'{OUTCOME}.grad_norm' is a norm: >= 0 or null", where)
    if o["final_adapter_sha256"] is not None:
        need_hex(o["final_adapter_sha256"], f"{OUTCOME}.final_adapter_sha256", where)


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
    """The digests every manifest carries: logical and effective rows, config and contract (recomputed)."""
    need_hex(doc["logical_batch_sha256"], "logical_batch_sha256", where)
    need_hex(doc["local_effective_rows_sha256"], "local_effective_rows_sha256", where)
    for sec, inner in (("config", "resolved"), ("contract", "value")):
        s = doc[sec]
        need(isinstance(s, dict) and set(s) == {"sha256", inner} and isinstance(s[inner], dict),
             f"'{sec}' needs sha256 and an object '{inner}'", where)
        need_hex(s["sha256"], f"{sec}.sha256", where)
        need(sha256_json(s[inner]) == s["sha256"], f"'{sec}.sha256' does not match its content", where)


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
    """Check every field's presence and type, and recompute the embedded digests."""
    check_schema(doc, where)
    need(doc["framework"] == BUILTIN, f"'framework' must be {BUILTIN!r} in the built-in trainer's manifest", where)
    keys = _KEYS | {k for k in ("state", OUTCOME) if k in doc}
    need(set(doc) == keys, f"keys must be exactly {sorted(keys)}; unknown "
         f"{sorted(set(doc) - keys)}, missing {sorted(keys - set(doc))}", where)
    validate_outcome(doc, where)
    if "state" in doc:
        _validate_state(doc, where)
    else:
        need(is_int(doc["step"]) and doc["step"] == 0, "'step' must be 0 (a capture without 'state' covers "
             "step zero only)", where)
    for sec in ("producer", "payload", "rows", "config", "contract", "initial_adapter"):
        need(isinstance(doc[sec], dict), f"'{sec}' must be an object", where)
    p = doc["payload"]
    need(set(p) == {"file", "size", "spans_sha256", "rng_keys"},
          "'payload' needs file, size, spans_sha256, rng_keys", where)
    name = p["file"]
    need(isinstance(name, str) and name.endswith(".safetensors") and "/" not in name and "\\" not in name
          and not name.startswith(".") and name == Path(name).name,
          f"'payload.file' must be a bare .safetensors file name, found {name!r}", where)
    need(is_int(p["size"]) and p["size"] > 0, "'payload.size' must be a positive integer", where)
    need_hex(p["spans_sha256"], "payload.spans_sha256", where)
    need(isinstance(p["rng_keys"], list) and "cpu" in p["rng_keys"]
          and all(isinstance(k, str) for k in p["rng_keys"]), "'payload.rng_keys' must list 'cpu'", where)
    validate_pins(doc, where)
    a = doc["initial_adapter"]
    need(set(a) == {"path", "size", "sha256"} and isinstance(a["path"], str) and is_int(a["size"]),
          "'initial_adapter' needs path (string), size (integer), sha256", where)
    need_hex(a["sha256"], "initial_adapter.sha256", where)
    rows = doc["rows"]
    need(all(is_int(rows.get(k)) for k in ("rows", "tokens", "response_tokens", "loss_bearing_tokens")),
          "'rows' needs integer rows, tokens, response_tokens, loss_bearing_tokens", where)
    return doc


def _validate_state(doc: dict[str, Any], where: Path) -> None:
    step, st = doc["step"], doc["state"]
    need(is_int(step) and step >= 0, "'step' must be an integer >= 0", where)
    need(isinstance(st, dict) and set(st) == _STATE_KEYS, f"'state' needs exactly {sorted(_STATE_KEYS)}", where)
    name = st["dir"]
    need(isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
         and not name.startswith("."), f"'state.dir' must be a bare directory name, found {name!r}", where)
    need(is_int(st["step"]) and st["step"] == step - 1, f"'state.step' must be {step - 1} (the step "
         "before the captured one)", where)
    need_hex(st["optimizer_sha256"], "state.optimizer_sha256", where)
    lr = st["lr"]
    need(isinstance(lr, list) and len(lr) > 0 and all(isinstance(x, float) and math.isfinite(x) for x in lr),
         "'state.lr' must list a finite learning rate per parameter group", where)
    need(isinstance(st["nonfinite_inputs"], bool), "'state.nonfinite_inputs' must be true or false", where)


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
