"""The one reader of a capture manifest, and which producer wrote a capture (never guessed from a config's shape).

Every producer's capture manifest has one schema (:data:`replayjob.artifacts.capture_manifest.SCHEMA`) whose
``framework`` names its producer; :func:`read` hashes the bytes against their pin before parsing them, then
hands the document to the producer's own checks: the built-in trainer's (:mod:`replayjob.artifacts.capture_root`:
one device, or a root over ranks) or the capture API's (:mod:`replayjob.producers.api.parts`: one process,
or a root with every part verified).  Callers pass the record down, so a replay reads its manifest once.
"""

from __future__ import annotations

from pathlib import Path

from replayjob.artifacts import api_manifest as external_manifest
from replayjob.artifacts import capture_root as ranks
from replayjob.artifacts.capture_manifest import Manifest, PinnedManifest, check_schema, read_pinned
from replayjob.config.load import apply_overrides, read_toml
from replayjob.errors import IntegrityError
from replayjob.frameworks import BUILTIN, PRODUCERS

#: a verified capture manifest of any producer (the built-in trainer's, or the capture API's)
CaptureManifest = Manifest | external_manifest.Manifest
REPLAY_PIN = "optimizer_batch.expected_manifest_sha256"


def read(path: str | Path, expected_sha256: str, *, pin_name: str = REPLAY_PIN,
         hint: str = "point optimizer_batch.replay_path at the capture's *.manifest.json and pin the digest the "
                     "capture printed") -> CaptureManifest:
    """The capture manifest at ``path``, its bytes checked against ``expected_sha256`` before they are parsed,
    validated by its producer's rules: a :class:`~replayjob.artifacts.capture_manifest.Manifest` or
    :class:`~replayjob.artifacts.capture_root.RootManifest` (built-in), an
    :class:`~replayjob.artifacts.api_manifest.Manifest` or :class:`~replayjob.producers.api.parts.RootManifest`
    (capture API).  A manifest of an earlier release, or naming no known producer, is refused."""
    p, sha, doc = read_pinned(path, expected_sha256, pin_name=pin_name, hint=hint)
    framework = check_schema(doc, p)["framework"]
    if framework == BUILTIN:
        return ranks.of(p, sha, doc)
    if framework in PRODUCERS:
        return external_manifest.of(p, sha, doc)
    raise IntegrityError(f"the capture names producer {str(framework)[:40]!r}, which this release does not know",
                         where=p, hint="producers: " + ", ".join(sorted(PRODUCERS)))


def replay_manifest(config: str | Path, overrides: list[str]) -> CaptureManifest | None:
    """The verified manifest a replay config names (``optimizer_batch.replay_path`` pinned by
    ``optimizer_batch.expected_manifest_sha256``, after ``--set``), or ``None`` when it names no manifest or no
    pin (the built-in admission then refuses it with every reason)."""
    p = Path(config)
    data = apply_overrides(read_toml(p), overrides)
    ob = data.get("optimizer_batch")
    raw = ob.get("replay_path") if isinstance(ob, dict) else None
    pin = ob.get("expected_manifest_sha256") if isinstance(ob, dict) else None
    if not isinstance(raw, str) or not raw or not isinstance(pin, str) or not pin.strip():
        return None
    path = Path(raw).expanduser()
    return read(path if path.is_absolute() else p.resolve().parent / path, pin)


def producer_of(config: str | Path, overrides: list[str]) -> tuple[str, CaptureManifest | None]:
    """The producer of the capture a replay config replays, read from that capture's verified manifest, and
    the manifest itself (``None`` for a config naming no pinned manifest: the built-in trainer's, whose
    admission refuses it with every reason).  A pinned manifest that is missing, changed, of an earlier
    release or of no known producer is refused here."""
    m = replay_manifest(config, overrides)
    return (BUILTIN if m is None else m.framework), m


def reuse(given: PinnedManifest | None, path: str | Path, expected_sha256: str) -> CaptureManifest:
    """``given`` when it is the manifest at ``path`` with that pin (a caller verified it already: its bytes
    are not read again), else the manifest :func:`read` verifies now."""
    same = given is not None and given.sha256 == str(expected_sha256).strip().lower() \
        and given.path.resolve() == Path(path).resolve()
    if same and isinstance(given, Manifest | external_manifest.Manifest):
        return given
    return read(path, expected_sha256)
