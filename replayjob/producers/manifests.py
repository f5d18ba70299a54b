"""Which producer wrote a capture, read from the capture's manifest (never guessed from a config's shape)."""

from __future__ import annotations

from pathlib import Path

from replayjob.config.load import apply_overrides, read_toml
from replayjob.errors import IntegrityError
from replayjob.integrations import manifest as external_manifest
from replayjob.optbatch import manifest, ranks
from replayjob.optbatch.manifest import read_pinned
from replayjob.producers import BUILTIN, PRODUCERS

# the manifest schemas each kind of capture writes (the built-in's one-rank and multi-rank roots; the
# capture API's, which names its producer in ``framework``)
BUILTIN_SCHEMAS = (manifest.SCHEMA, ranks.SCHEMA)
EXTERNAL_SCHEMA = external_manifest.SCHEMA


def producer_of(config: str | Path, overrides: list[str]) -> str:
    """The producer of the capture a replay config replays, read from that capture's manifest
    (``optimizer_batch.replay_path`` after ``--set``), never guessed from the config's shape.

    The manifest's bytes are checked against ``expected_manifest_sha256`` before they are parsed. A
    config naming no manifest or no pin is the built-in trainer's (its admission then refuses it with
    every reason); a pinned manifest that is missing, changed, or of no known schema is refused here."""
    p = Path(config)
    data = apply_overrides(read_toml(p), overrides)
    ob = data.get("optimizer_batch")
    raw = ob.get("replay_path") if isinstance(ob, dict) else None
    if not isinstance(raw, str) or not raw:
        return BUILTIN
    path = Path(raw).expanduser()
    path = path if path.is_absolute() else p.resolve().parent / path
    pin = ob.get("expected_manifest_sha256") if isinstance(ob, dict) else None
    if isinstance(pin, str) and pin.strip():  # the pin is checked over the bytes before they are parsed
        _, _, doc = read_pinned(path, pin, pin_name="optimizer_batch.expected_manifest_sha256",
                                hint="point optimizer_batch.replay_path at the capture's manifest and pin the "
                                     "digest the capture printed")
    else:  # no pin: the built-in admission refuses it, with every other reason
        return BUILTIN
    schema = doc.get("schema") if isinstance(doc, dict) else None
    framework = doc.get("framework") if isinstance(doc, dict) else None
    if schema in BUILTIN_SCHEMAS:
        return BUILTIN
    external = (EXTERNAL_SCHEMA, external_manifest.RANKS_SCHEMA)  # one process's capture, or several processes'
    if schema in external and isinstance(framework, str) and framework in PRODUCERS and framework != BUILTIN:
        return framework
    raise IntegrityError(f"not a capture manifest of a known producer (schema {str(schema)[:80]!r}, framework "
                         f"{str(framework)[:40]!r})", where=path,
                         hint="optimizer_batch.replay_path names the capture's *.manifest.json; producers: "
                              + ", ".join(sorted(PRODUCERS)))
