"""The run record, ``RUN/run.json``: what makes the artifacts of a run directory one run.

Schema ``replayjob.run/v1`` (pretty JSON, one object)::

    schema, fingerprint   SHA-256 of the selected spec and the image (digest where there is one)
    image, image_digest   the image reference and its digest (null without one)
    environment           the determinism and NCCL variables the first step saw
    spec                  the selected spec

The first step of a run writes it, exclusively (exactly one concurrent writer wins); every later step
reads it back (:func:`read`) and refuses a run directory whose fingerprint is not its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec

from replayjob.declaration import Digest, Document, decode, whole
from replayjob.errors import IntegrityError
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import pretty_bytes, read_json_object

SCHEMA: Final = "replayjob.run/v1"
FILE = "run.json"
ImageDigest = Annotated[str, whole("sha256:[0-9a-f]{64}")]


class RunRecord(Document, frozen=True):
    """``run.json`` (docs/cluster.md, "Run directories")."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "spec": "the selected spec as the first step saw it: compared whole, through the fingerprint it is hashed "
                "into, never read field by field",
    }

    schema: Literal["replayjob.run/v1"]
    fingerprint: Digest  # SHA-256 of the selected spec and the image (its digest where there is one)
    image: str  # the image reference the steps ran from (empty outside a container)
    image_digest: ImageDigest | None
    environment: dict[str, str | None]  # the determinism and NCCL variables the first step saw
    spec: dict[str, Any]


def write(path: Path, record: RunRecord) -> None:
    """Write the record exclusively (an existing one is never replaced: :class:`~replayjob.errors.RefusedError`)."""
    atomic_write_bytes(path, pretty_bytes(msgspec.to_builtins(record)), exclusive=True)


def read(path: Path) -> RunRecord:
    """The run record at ``path``, read through its declaration (what a step compares is its fingerprint)."""
    try:
        return decode(read_json_object(path), RunRecord, where=path)
    except IntegrityError as exc:
        raise IntegrityError(f"not a run record ({SCHEMA}): {exc.message}", where=path,
                             hint="give every submission its own run directory; run.json is written by its first "
                                  "step only") from None
