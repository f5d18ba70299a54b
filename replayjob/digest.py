"""SHA-256 helpers: streaming file digests, canonical-JSON digests, digest validation.

Threat model: digests pin artifacts that travel between machines.  A file is hashed in fixed
chunks (memory stays flat for multi-GB payloads) and a digest a user passes must be exactly 64
lowercase hex characters; uppercase input is normalised, anything else is refused.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError
from replayjob.fsio import open_regular
from replayjob.jsonio import canonical_bytes

CHUNK = 8 * 1024 * 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    """SHA-256 of the canonical JSON form: independent of key order and formatting."""
    return sha256_bytes(canonical_bytes(obj))


def sha256_file(path: str | Path, *, follow_symlinks: bool = False) -> str:
    """Stream a regular file through SHA-256 in fixed-size chunks, reusing one buffer.

    Devices and FIFOs are refused (hashing ``/dev/zero`` would never end), and so is a symbolic link
    unless ``follow_symlinks`` (a file the user names, not one inside an artifact), see
    :func:`replayjob.fsio.open_regular`.
    """

    h = hashlib.sha256()
    fd, size = open_regular(path, follow_symlinks=follow_symlinks, what="file to hash")
    buf = bytearray(min(CHUNK, max(size, 4096)))  # small files get small buffers
    view = memoryview(buf)
    try:
        with open(fd, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
    except OSError as exc:
        raise IntegrityError(f"cannot read for hashing: {exc.strerror}", where=path) from None
    return h.hexdigest()


BATCH_DIGEST = "replayjob.batch_digest/v3"


def batch_sha256(kind: str, parts: list[dict[str, Any]]) -> str:
    """The one batch digest every producer's ``logical_batch_sha256`` and ``local_effective_rows_sha256`` are.

    SHA-256 of the canonical JSON (:func:`replayjob.jsonio.canonical_bytes`) of::

        {"digest": "replayjob.batch_digest/v3", "kind": KIND, "parts": [PART, ...]}

    ``kind`` is ``"logical"`` or ``"effective"``; the parts are in the order the update consumed them (the
    built-in trainer's rows are one part of flat ragged arrays; a captured loop's are one part per micro-batch,
    several processes' concatenated in rank order), each ``{"tensors": {NAME: [DTYPE, SHAPE, SHA256]},
    "values": {NAME: JSON}}`` with SHA256 over the tensor's little-endian row-major bytes.  Equal parts give
    equal digests whoever produced them; the parts a producer hands in are documented where it builds them
    (``docs/optimizer-batch.md``).
    """
    return sha256_json({"digest": BATCH_DIGEST, "kind": kind, "parts": parts})


def batch_part(tensors: dict[str, tuple[str, list[int], str]], values: dict[str, Any] | None = None) -> dict[str, Any]:
    """One part of :func:`batch_sha256`: tensors by ``(dtype, shape, SHA-256)`` and JSON values, keys sorted."""
    return {"tensors": {k: [d, list(shape), sha] for k, (d, shape, sha) in sorted(tensors.items())},
            "values": dict(sorted((values or {}).items()))}


def is_sha256_hex(value: object) -> bool:
    """Whether ``value`` is already a canonical SHA-256 digest: exactly 64 lowercase hex characters
    (the one digest syntax check; callers that accept uppercase or padding use :func:`normalize_digest`)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def normalize_digest(value: object, *, what: str) -> str:
    """Return ``value`` as a lowercase 64-hex SHA-256 digest or raise naming ``what``."""
    if not isinstance(value, str):
        raise IntegrityError(f"{what} must be a 64-character hex SHA-256 string, "
                             f"found {type(value).__name__}")
    low = value.strip().lower()
    if len(low) != 64:
        raise IntegrityError(f"{what} must be 64 hex characters, found {len(low)}",
                             hint="copy the full digest the source run printed")
    if not is_sha256_hex(low):
        raise IntegrityError(f"{what} is not hexadecimal: {value!r}")
    return low
