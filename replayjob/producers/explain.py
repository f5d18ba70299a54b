"""``replayjob explain`` for a capture of any producer: its manifest names the producer, whose admission runs.

Every capture goes through the one admission (:mod:`replayjob.producers.admission`); its manifest says which
kind of capture it is, and so which replay config it takes: the built-in trainer's (:mod:`.builtin.admission`) or
the capture API's (:mod:`.api.admission`).  Both report in one format (:func:`render`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replayjob.artifacts.capture_reader import CaptureManifest, producer_of
from replayjob.config import load_config
from replayjob.producers import BUILTIN
from replayjob.producers.admission import Refusals, render
from replayjob.producers.api import admission
from replayjob.producers.builtin import admission as builtin
from replayjob.runtime.distributed import observe

__all__ = ["explain", "render"]


def explain(config: str | Path, overrides: list[str], manifest: CaptureManifest | None = None,
            nproc: int | None = None) -> tuple[Refusals, dict[str, Any]]:
    """Load the config, admit it by its capture's producer's rules (the manifest read once: ``manifest`` when
    the caller verified it already), and build the report; never raises for a failed check (the caller raises
    :meth:`Refusals.raise_for`).  ``nproc``: check a replay on that many processes (``replay --nproc N``'s
    admission before it launches them); ``None``: as the launcher of this process says (one without one)."""
    if manifest is None:
        producer, manifest = producer_of(config, overrides)
    else:
        producer = manifest.framework
    if producer != BUILTIN:
        return admission.explain(config, overrides, manifest, processes=nproc)
    adm = builtin.admit(observe(load_config(config, overrides), running=False, planned=nproc), keep_rows=False,
                        manifest=manifest)
    return adm, builtin.report(adm)
