"""Which producer wrote a capture, read from the capture's manifest (never guessed from a config's shape)."""

from __future__ import annotations

from pathlib import Path

from replayjob.config.load import apply_overrides, read_toml
from replayjob.errors import IntegrityError
from replayjob.integrations import manifest as external_manifest
from replayjob.jsonio import read_json_object
from replayjob.optbatch import manifest, ranks
from replayjob.producers import BUILTIN, PRODUCERS

# the manifest schemas each kind of capture writes (the built-in's one-rank and multi-rank roots; the
# capture API's, which names its producer in ``framework``)
BUILTIN_SCHEMAS = (manifest.SCHEMA, ranks.SCHEMA)
EXTERNAL_SCHEMA = external_manifest.SCHEMA


def producer_of(config: str | Path, overrides: list[str]) -> str:
    """The producer of the capture a replay config replays, read from that capture's manifest
    (``optimizer_batch.replay_path`` after ``--set``), never guessed from the config's shape.

    A config naming no manifest is the built-in trainer's (its admission then refuses it with every
    other reason); a named manifest that cannot be read, or of no known schema, is refused here."""
    p = Path(config)
    data = apply_overrides(read_toml(p), overrides)
    ob = data.get("optimizer_batch")
    raw = ob.get("replay_path") if isinstance(ob, dict) else None
    if not isinstance(raw, str) or not raw:
        return BUILTIN
    path = Path(raw).expanduser()
    path = path if path.is_absolute() else p.resolve().parent / path
    doc = read_json_object(path, follow_symlinks=True)  # the path a config names; admission pins its bytes
    schema = doc.get("schema")
    if schema in BUILTIN_SCHEMAS:
        return BUILTIN
    framework = doc.get("framework")
    external = (EXTERNAL_SCHEMA, external_manifest.RANKS_SCHEMA)  # one process's capture, or several processes'
    if schema in external and isinstance(framework, str) and framework in PRODUCERS and framework != BUILTIN:
        return framework
    raise IntegrityError(f"not a capture manifest of a known producer (schema {str(schema)[:80]!r}, framework "
                         f"{str(framework)[:40]!r})", where=path,
                         hint="optimizer_batch.replay_path names the capture's *.manifest.json; producers: "
                              + ", ".join(sorted(PRODUCERS)))
