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

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.errors import IntegrityError
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import pretty_bytes, read_json_object

SCHEMA = "replayjob.run/v1"
FILE = "run.json"


@dataclass(frozen=True)
class RunRecord:
    fingerprint: str
    image: str
    image_digest: str | None
    environment: dict[str, str | None]
    spec: dict[str, Any]


def write(path: Path, record: RunRecord) -> None:
    """Write the record exclusively (an existing one is never replaced: :class:`~replayjob.errors.RefusedError`)."""
    atomic_write_bytes(path, pretty_bytes({"schema": SCHEMA, **dataclasses.asdict(record)}), exclusive=True)


def read(path: Path) -> RunRecord:
    """The run record at ``path``, its schema and fields checked (what a step compares is its fingerprint)."""
    doc = read_json_object(path)
    keys = {"schema", *(f.name for f in dataclasses.fields(RunRecord))}
    if doc.get("schema") != SCHEMA or set(doc) != keys or not isinstance(doc.get("fingerprint"), str) \
            or not isinstance(doc.get("image"), str) or not isinstance(doc.get("environment"), dict) \
            or not isinstance(doc.get("spec"), dict):
        raise IntegrityError(f"not a run record ({SCHEMA}: {', '.join(sorted(keys - {'schema'}))})", where=path)
    return RunRecord(doc["fingerprint"], doc["image"], doc["image_digest"], doc["environment"], doc["spec"])
