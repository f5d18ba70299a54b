"""The capture a mismatch check of another producer reads: admitted as a replay of it would be, its bound read."""

from __future__ import annotations

from pathlib import Path

from replayjob.artifacts.capture_manifest import PinnedManifest
from replayjob.artifacts.mismatch_bound import Bound, read_bound
from replayjob.errors import UsageError
from replayjob.producers.api import admission


def admit(config: Path, overrides: list[str], bound: str | Path | None, manifest: PinnedManifest | None,
          framework: str, refusal: str, hint: str | None = None) -> tuple[admission.Admission, Bound | None]:
    """The replay config's capture through the one admission (refused unless admitted), of ``framework`` (else
    refused with ``refusal`` and ``hint``), and the declared bound pinned in its config (None without one)."""
    icfg = admission.load(config, overrides)
    declared = read_bound(bound, icfg.optimizer_batch.mismatch_bound_sha256) if bound is not None else None
    adm = admission.admit(icfg, manifest=manifest)
    adm.raise_if_refused()
    m = adm.manifest
    assert m is not None and adm.micro_batches is not None and adm.resolved is not None
    if m.framework != framework:
        raise UsageError(refusal.format(framework=m.framework), where=str(config), hint=hint)
    return adm, declared
