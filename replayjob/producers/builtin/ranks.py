"""A capture over ranks, read back row by row: every rank's payload verified against its manifest and the
logical batch rebuilt in rank order (:func:`verify`, what explain and replay run), and the root written by
rank 0 once every rank landed (:func:`write_root`).  The root's record and its reader are
:mod:`replayjob.artifacts.capture_root`; this module is the part that reads the rows (torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import capture_manifest as manifest
from replayjob.artifacts.capture_manifest import Manifest, read_verified
from replayjob.artifacts.capture_payload import read_payload, summary
from replayjob.artifacts.capture_root import (
    RootManifest,
    check_listing,
    landed_name,
    rank_dir,
    read_landed,
    root_document,
)
from replayjob.declaration import check_summaries
from replayjob.errors import IntegrityError, RefusedError
from replayjob.fsio import check_no_symlinks
from replayjob.rl.batch import OptimizerBatch
from replayjob.runtime import distributed

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Verified:
    """Every rank of a capture read back and verified, and the logical batch they make together."""

    batch: OptimizerBatch
    rngs: list[dict[str, Tensor]]  # per captured rank, in rank order
    manifests: list[Manifest]
    bounds: list[tuple[int, int]]
    digests: tuple[str, str]  # (logical, effective) of the concatenated rows


def _read_ranks(d: Path, step: int, entries: list[tuple[int, str]], allow_nonfinite: bool = False) -> Verified:
    """Read and verify each ``(rank, manifest SHA-256)`` in ``d`` and concatenate their rows in rank order."""
    parts, rngs, manifests, bounds, begin = [], [], [], [], 0
    for r, sha in entries:
        try:  # no linked rank-<r>/ (nor file in it): fsio.check_no_symlinks below the capture directory
            path = check_no_symlinks(d, d / rank_dir(r) / manifest.manifest_name(step), what=f"rank {r}'s manifest")
            m = read_verified(path, sha)
            scan = read_payload(m, keep=True, allow_nonfinite=allow_nonfinite)
        except RefusedError as exc:
            raise IntegrityError(f"rank {r}: {exc.diagnostics()}".replace("\n  fix:", "; fix:")) from None
        assert scan.batch is not None
        if scan.row_digests() != (m.logical_sha256, m.effective_sha256):
            raise IntegrityError(f"rank {r}: its payload rows do not hash to its manifest's digests", where=m.path)
        parts.append(scan.batch)
        rngs.append(scan.rng)
        manifests.append(m)
        bounds.append((begin, begin + scan.batch.rows))
        begin += scan.batch.rows
    first = manifests[0]
    for r, m in zip((e[0] for e in entries), manifests, strict=True):
        for what in ("config", "contract"):
            if m.doc[what]["sha256"] != first.doc[what]["sha256"]:
                raise IntegrityError(f"rank {r} captured under another {what} than rank 0", where=m.path)
        if m.initial_adapter_sha256 != first.initial_adapter_sha256:
            raise IntegrityError(f"rank {r} started from another adapter than rank 0", where=m.path)
    batch = OptimizerBatch.concat(parts)
    if bounds != distributed.shard_bounds(batch.rows, len(entries)):
        raise IntegrityError(f"the ranks' rows {bounds} are not the {distributed.SHARDING} split of {batch.rows} rows",
                             where=d)
    return Verified(batch, rngs, manifests, bounds, batch.digests())


def verify(root: RootManifest, allow_nonfinite: bool = False) -> Verified:
    """Every rank of ``root`` (see the module docstring); raises :class:`IntegrityError` naming the first fault."""
    d = root.path.parent
    check_listing(d, root.world_size)
    for e in root.ranks:
        landed = read_landed(d, e["rank"])
        if landed != {"rank": e["rank"], "world_size": root.world_size, "manifest_sha256": e["manifest_sha256"]}:
            raise IntegrityError(f"rank {e['rank']}'s landing record does not match the root",
                                 where=d / landed_name(e["rank"]))
    v = _read_ranks(d, root.step, [(e["rank"], e["manifest_sha256"]) for e in root.ranks], allow_nonfinite)
    first = v.manifests[0]  # _read_ranks found every rank's config, contract and adapter equal to rank 0's
    for what in ("config", "contract"):
        if first.doc[what]["sha256"] != root.doc[what]["sha256"]:
            raise IntegrityError(f"rank {root.ranks[0]['rank']} captured under another {what} than the root records",
                                 where=first.path)
    if first.initial_adapter_sha256 != root.initial_adapter_sha256:
        raise IntegrityError(f"rank {root.ranks[0]['rank']} started from another adapter than the root records",
                             where=first.path)
    rng_keys = sorted(root.doc["payload"]["rng_keys"])
    for e, m, b, rng in zip(root.ranks, v.manifests, v.bounds, v.rngs, strict=True):
        if m.payload_digest != e["payload_spans_sha256"] or list(b) != e["rows"]:
            raise IntegrityError(f"rank {e['rank']}'s payload or rows differ from the root's record", where=m.path)
        if not sorted(rng) == sorted(m.doc["payload"]["rng_keys"]) == rng_keys:
            raise IntegrityError(f"rank {e['rank']}'s RNG states {sorted(rng)} differ from its manifest's or the "
                                 f"root's {rng_keys}", where=m.path)
    if root.payload_size != sum(m.payload_size for m in v.manifests):
        raise IntegrityError(f"the root's payload size {root.payload_size} is not the ranks' total", where=root.path)
    check_summaries(root.doc["rows"], summary(v.batch), where=root.path, what="rows")  # the ranks' rows, recomputed
    if v.digests != (root.logical_sha256, root.effective_sha256):
        raise IntegrityError(f"the ranks' rows in logical order hash to {v.digests[0]}, the root says "
                             f"{root.logical_sha256}", where=root.path)
    return v


def write_root(out: Path, *, step: int, world: int, strategy: str, bucket_cap_mb: float, backend: str,
               producer: dict[str, Any], sealed: dict[str, Any] | None = None) -> tuple[str, str, str]:
    """Rank 0, once every rank landed: verify them all, then write the root manifest (exclusive, last), with
    ``sealed`` as its ``outcome`` (:func:`replayjob.artifacts.capture_manifest.outcome`).

    Returns (logical, effective, root SHA-256)."""
    entries = [(r, str(read_landed(out, r)["manifest_sha256"])) for r in range(world)]
    check_listing(out, world)
    v = _read_ranks(out, step, entries)
    logical, effective = v.digests
    doc = root_document(
        step=step, producer=producer, world=world, strategy=strategy, bucket_cap_mb=bucket_cap_mb, backend=backend,
        ranks=[(r, sha, m.payload_digest, b) for (r, sha), m, b in zip(entries, v.manifests, v.bounds, strict=True)],
        payload_size=sum(m.payload_size for m in v.manifests), rows=summary(v.batch), logical=logical,
        effective=effective, first_rank=v.manifests[0].doc, sealed=sealed)
    sha = manifest.write(out / manifest.manifest_name(step), doc)
    return logical, effective, sha
