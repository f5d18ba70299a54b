"""A capture over several ranks: each rank's payload and manifest, then one root written once all landed.

Under ``torchrun`` with ``W`` ranks (:mod:`replayjob.runtime.distributed`), every rank trains on its
contiguous shard of the logical rows and captures exactly those rows, with the usual discipline
(:mod:`replayjob.producers.builtin.capture`): payload, then its manifest (the rank's own rows
and digests), both atomic and exclusive, in ``rank-<r>/``; then the rank *lands*: ``COMPLETE.<r>``
(rank, world size, the rank manifest's SHA-256) next to the rank directories.  After a barrier,
rank 0 reads every landed rank back and verifies it, and writes the root manifest last (the one
capture manifest schema, listing ``ranks``), then ``metrics.json``::

    optimizer_batch_step_000000.manifest.json   the root: written last, pinned by metrics.json
    COMPLETE.0 ... COMPLETE.<W-1>               one landing record per rank
    rank-0/optimizer_batch_step_000000.{safetensors,manifest.json}
    rank-1/...

The root holds what a single-device manifest holds -- producer, row counts, the logical-batch and
effective-rows digests (over every rank's rows in logical order, so independent of how rows were
split), config, optimizer contract, initial adapter, the source update's sealed ``outcome`` (loss, gradient
norm, final adapter, as ``metrics.json`` reports them) -- plus ``distributed`` (world size, strategy,
bucket size, backend, sharding) and ``ranks``: per rank its directory, manifest SHA-256, payload
span digest and ``[begin, end)`` logical rows.  Its ``payload.spans_sha256`` is the digest of the
ranks' payload span digests in rank order (:func:`ranks_digest`), which replays record as their
payload pin.  The adapter the capture starts from is the resume state's, saved once, unsharded.

This module holds the root's record and reader; reading the ranks' rows back
(:func:`replayjob.producers.builtin.ranks.verify`, torch) checks, before any device memory is touched: the root's
own fields (its declaration, :class:`BuiltinRoot`: every field typed and bounded, no key unknown or missing, the
ranks in order with contiguous rows, ``payload.spans_sha256`` and ``rows.rows`` recomputed from them), its
``distributed`` block against its ranks and recorded config (:func:`check_layout`; a single-device manifest's
config must say one rank, :func:`check_one_rank`), that
exactly the listed ranks landed (no ``rank-*`` or ``COMPLETE.*`` missing or extra, and no
``rank-*`` directory a symbolic link), every landing record, every rank manifest against its pinned SHA-256
and every payload against its manifest, that every rank captured under the root's config and contract from the
root's initial adapter, with the root's RNG keys and total payload size, and that the rows concatenated in
rank order hash to the root's logical and effective digests. A replay at any world size rebuilds the logical
batch this way and re-shards it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from replayjob.artifacts import capture_manifest as manifest
from replayjob.artifacts.capture_manifest import Manifest, Outcome
from replayjob.config.schema import BackendConfig
from replayjob.declaration import Count, Digest, Document, NonNegative, Text, agree
from replayjob.errors import ArtifactExistsError, IntegrityError
from replayjob.fsio import atomic_write_bytes, read_regular_bytes
from replayjob.jsonio import canonical_bytes, loads_strict
from replayjob.runtime import distributed

RANKS_TAG = b"replayjob.rank-payloads.v1\n"
MAX_LANDED_BYTES = 64 * 1024  # a landing record is three fields
_LANDED_KEYS = {"rank", "world_size", "manifest_sha256"}


def rank_dir(rank: int) -> str:
    return f"rank-{rank}"


def landed_name(rank: int) -> str:
    return f"COMPLETE.{rank}"


def ranks_digest(payload_digests: list[str]) -> str:
    """The root's payload pin: SHA-256 of a tag, the rank count and each rank's payload span digest."""
    h = hashlib.sha256(RANKS_TAG)
    h.update(struct.pack("<Q", len(payload_digests)))
    for d in payload_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def root_document(*, step: int, producer: dict[str, Any], world: int, strategy: str, bucket_cap_mb: float,
                  backend: str, ranks: list[tuple[int, str, str, tuple[int, int]]], payload_size: int,
                  rows: dict[str, Any], logical: str, effective: str,
                  first_rank: dict[str, Any], sealed: dict[str, Any] | None) -> dict[str, Any]:
    """The root manifest's document: ``ranks`` lists (rank, manifest SHA-256, payload span digest,
    ``[begin, end)`` logical rows) in rank order; config, contract, initial adapter and RNG keys are rank 0's
    (``first_rank``: its manifest document, which every other rank's was verified to match); ``sealed``
    the source update's outcome (:func:`replayjob.artifacts.capture_manifest.outcome`)."""
    doc: dict[str, Any] = {
        "schema": manifest.SCHEMA, "framework": manifest.BUILTIN, "step": step, "producer": producer,
        "distributed": {"world_size": world, "strategy": strategy, "bucket_cap_mb": bucket_cap_mb,
                        "backend": backend, "sharding": distributed.SHARDING},
        "ranks": [{"rank": r, "dir": rank_dir(r), "manifest_sha256": sha, "payload_spans_sha256": spans,
                   "rows": list(bounds)} for r, sha, spans, bounds in ranks],
        "payload": {"spans_sha256": ranks_digest([spans for _, _, spans, _ in ranks]), "size": payload_size,
                    "rng_keys": list(first_rank["payload"]["rng_keys"])},
        "rows": rows, "logical_batch_sha256": logical, "local_effective_rows_sha256": effective,
        "config": first_rank["config"], "contract": first_rank["contract"],
        "initial_adapter": first_rank["initial_adapter"],
    }
    if sealed is not None:
        doc[manifest.OUTCOME] = sealed
    return doc


@dataclass(frozen=True)
class RootManifest(Manifest):
    """The root manifest of a capture over several ranks (the fields a replay pins, as a single-device one)."""

    @property
    def ranks(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.doc["ranks"]
        return out

    @property
    def world_size(self) -> int:
        return int(self.doc["distributed"]["world_size"])

    @property
    def payload_path(self) -> Path:
        """Rank 0's payload (named in messages; every rank's is verified)."""
        return self.path.parent / rank_dir(0) / manifest.payload_name(self.step)


def refuse_existing(out: Path, rank: int, step: int) -> None:
    """Refuse (before any work) a rank directory, landing record or root that already exists."""
    for p in (out / rank_dir(rank), out / landed_name(rank), out / manifest.manifest_name(step)):
        if p.exists():
            raise ArtifactExistsError("a capture over ranks already exists here and is never overwritten", where=p,
                                      hint="choose a new --out directory")


def land(out: Path, rank: int, world: int, manifest_sha256: str) -> None:
    """This rank's payload and manifest are written: record it (``COMPLETE.<r>``, exclusive)."""
    doc = {"rank": rank, "world_size": world, "manifest_sha256": manifest_sha256}
    atomic_write_bytes(out / landed_name(rank), canonical_bytes(doc) + b"\n", exclusive=True)


# ------------------------------------------------------------------------------------- reading
def read_landed(d: Path, rank: int) -> dict[str, Any]:
    p = d / landed_name(rank)
    if p.is_symlink() or not p.is_file():
        raise IntegrityError(f"rank {rank} has not landed ({landed_name(rank)} is missing): the capture is "
                             "incomplete", where=d,
                             hint="capture again; a capture over ranks is complete only when every rank landed")
    doc = loads_strict(read_regular_bytes(p, max_bytes=MAX_LANDED_BYTES, follow_symlinks=False,
                                          what="landing record"), where=p)
    if not isinstance(doc, dict) or set(doc) != _LANDED_KEYS or doc["rank"] != rank:
        raise IntegrityError(f"malformed landing record (needs exactly {sorted(_LANDED_KEYS)} for rank {rank})",
                             where=p)
    return doc


def check_listing(d: Path, world: int) -> None:
    """Exactly ranks 0..W-1 have a directory and a landing record: none missing, none extra."""
    want = {rank_dir(r) for r in range(world)} | {landed_name(r) for r in range(world)}
    have = {p.name for p in d.iterdir() if p.name.startswith(("rank-", "COMPLETE."))}
    extra, missing = sorted(have - want), sorted(want - have)
    if missing:
        raise IntegrityError(f"incomplete capture over {world} ranks: {', '.join(missing)} missing", where=d,
                             hint="capture again; every rank must land before the root is used")
    if extra:
        raise IntegrityError(f"the root lists {world} ranks, the directory also holds {', '.join(extra)}", where=d,
                             hint="a capture directory holds one capture; capture again into a new --out")


def read_capture(path: str | Path, expected_sha256: str) -> Manifest:
    """The capture manifest at ``path`` pinned by ``expected_sha256``: a single-device manifest, or the root of
    a capture over ranks (:class:`RootManifest`, its own fields validated;
    :func:`~replayjob.producers.builtin.ranks.verify` checks the ranks)."""
    p, sha, doc = manifest.read_pinned(path, expected_sha256,
                                       hint="point optimizer_batch.replay_path at the source run's "
                                            "optimizer_batch_step_000000.manifest.json")
    return of(p, sha, doc)


def of(p: Path, sha: str, doc: Any) -> Manifest:
    """A built-in manifest whose bytes matched their pin: the root of a capture over ranks (it lists
    ``ranks``) or a single-device one, validated, each with the world size its layout implies
    (:func:`check_one_rank`, :func:`check_layout`)."""
    if isinstance(doc, dict) and "ranks" in doc:
        return RootManifest(p, sha, validate(doc, p))
    return Manifest(p, sha, check_one_rank(manifest.validate(doc, p), p))


_LAYOUT_HINT = ("the manifest contradicts its own layout (it was edited after capture); capture the step again, "
                "and replay a capture on another world size by declaring distributed.world_size")


def _recorded(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The ``[distributed]`` section of the config a manifest records (``None``: absent, a capture from before
    the section existed, which ran on one process)."""
    section = doc["config"]["resolved"].get("distributed")
    return section if isinstance(section, dict) else None


def check_one_rank(doc: dict[str, Any], where: Path) -> dict[str, Any]:
    """A single-device manifest (one payload, no ``ranks``) is a capture on one rank: the config it records
    (what admission compares the replay's with) must say ``distributed.world_size = 1``, else a replay on
    several ranks would pass for the source's world size."""
    rec = _recorded(doc)
    if rec is None and "distributed" not in doc["config"]["resolved"]:
        return doc  # before [distributed]: one process (admission reads it so)
    world = None if rec is None else rec.get("world_size")
    if type(world) is not int or world != 1:
        raise IntegrityError(f"manifest field `config.resolved.distributed.world_size` is {str(world)[:40]}, but "
                             "the capture holds one payload and lists no ranks: it ran on 1 rank", where=where,
                             hint=_LAYOUT_HINT)
    return doc


def check_layout(doc: dict[str, Any], where: Path) -> None:
    """A root's ``distributed`` block against its rank list and the config it records: at least 2 ranks (one rank
    writes a single manifest), a strategy that shares an update, the world size, strategy and DDP bucket size of
    the config's ``[distributed]`` section (a config recording none, from a writer that did not, is read as the
    block says: :func:`replayjob.producers.builtin.admission.source_config`), and the process-group backend its
    device implies (:func:`replayjob.runtime.distributed.backend_for`)."""
    d, n = doc["distributed"], len(doc["ranks"])
    if n < 2:
        raise IntegrityError(f"manifest field `distributed.world_size` is {d['world_size']}, but a root lists at "
                             "least 2 ranks (a capture on one rank writes one manifest, no root)", where=where,
                             hint=_LAYOUT_HINT)
    if d["strategy"] == "none":
        raise IntegrityError(f"manifest field `distributed.strategy` is 'none', but {n} ranks shared the update "
                             "('ddp' or 'fsdp2')", where=where, hint=_LAYOUT_HINT)
    resolved = doc["config"]["resolved"]
    if "distributed" in resolved:
        rec = _recorded(doc) or {}
        for key, kind in (("world_size", int), ("strategy", str), ("bucket_cap_mb", (int, float))):
            got = rec.get(key)
            if isinstance(got, bool) or not isinstance(got, kind) or got != d[key]:
                raise IntegrityError(f"manifest field `distributed.{key}` is {d[key]!r}, but the config the capture "
                                     f"ran says `config.resolved.distributed.{key}` = {str(got)[:40]}", where=where,
                                     hint=_LAYOUT_HINT)
    backend = resolved.get("backend", {})
    devices = backend.get("devices", BackendConfig.devices) if isinstance(backend, dict) else None
    want = distributed.backend_for("cpu" if devices == "cpu" else str(devices).replace("gpu", "cuda"))
    if not isinstance(devices, str) or d["backend"] != want:
        raise IntegrityError(f"manifest field `distributed.backend` is {d['backend'][:40]!r}, but the config the "
                             f"capture ran puts it on `config.resolved.backend.devices` = {str(devices)[:40]}, "
                             f"whose process-group backend is {want!r}", where=where, hint=_LAYOUT_HINT)


# ------------------------------------------------------------------------------------- the root
class RootDistributed(Document, frozen=True):
    """``distributed``: how the captured update ran over its ranks."""

    world_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    strategy: Text
    bucket_cap_mb: NonNegative
    backend: Text
    sharding: Text

    def __post_init__(self) -> None:
        if self.strategy not in distributed.STRATEGIES:
            raise ValueError(f"`strategy` must be one of {list(distributed.STRATEGIES)}, found {self.strategy[:40]!r}")
        if self.sharding != distributed.SHARDING:
            raise ValueError(f"`sharding` must be {distributed.SHARDING!r}, found {self.sharding[:40]!r}")


class RootRankEntry(Document, frozen=True):
    """One rank as the root lists it: its directory, manifest pin, payload span digest and ``[begin, end)``
    logical rows."""

    rank: Count
    dir: Text
    manifest_sha256: Digest
    payload_spans_sha256: Digest
    rows: Annotated[list[Count], msgspec.Meta(min_length=2, max_length=2)]


class RootPayload(Document, frozen=True):
    """``payload``: the ranks' payloads together (``spans_sha256`` recomputed from the ranks' digests)."""

    spans_sha256: Digest
    size: Count
    rng_keys: Annotated[list[Text], msgspec.Meta(min_length=1)]


class BuiltinRoot(manifest.BuiltinHead, frozen=True):
    """The built-in trainer's root over ranks (the module docstring lists its fields)."""

    distributed: RootDistributed
    ranks: list[RootRankEntry]
    payload: RootPayload
    outcome: Outcome | msgspec.UnsetType = msgspec.UNSET  # absent only in captures written before the seal

    def __post_init__(self) -> None:
        if self.step != 0:
            raise ValueError(f"`step` is {self.step}, but captures over ranks cover step zero only (it must be 0)")
        world = self.distributed.world_size
        if len(self.ranks) != world:
            raise ValueError(f"`ranks` must list the {world} ranks (distributed.world_size), found {len(self.ranks)}")
        end = 0
        for r, e in enumerate(self.ranks):
            if e.rank != r or e.dir != rank_dir(r):
                raise ValueError(f"`ranks[{r}]` must be rank {r} in {rank_dir(r)!r}, found rank {e.rank} in "
                                 f"{e.dir[:40]!r}")
            if e.rows[0] != end or e.rows[1] <= e.rows[0]:
                raise ValueError(f"`ranks[{r}].rows` must be [begin, end) following the previous rank's (begin "
                                 f"{end}, end > begin), found {e.rows}")
            end = e.rows[1]
        agree("payload.spans_sha256", self.payload.spans_sha256,
              ranks_digest([e.payload_spans_sha256 for e in self.ranks]))
        agree("rows.rows", self.rows.rows, end)


def validate(doc: Any, where: Path) -> dict[str, Any]:
    """The root's own fields, read through its declaration (:class:`BuiltinRoot`), then its ``distributed`` block
    against its ranks and recorded config (:func:`check_layout`); the ranks themselves are checked by
    :func:`~replayjob.producers.builtin.ranks.verify`."""
    manifest.check_schema(doc, where)
    manifest.decode_manifest(doc, BuiltinRoot, where)
    check_layout(doc, where)
    return dict(doc)
