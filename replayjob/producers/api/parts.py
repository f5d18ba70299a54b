"""An external trainer's step captured over several processes (DDP under ``torchrun`` or ``accelerate launch``).

Every process records the micro-batches its own loss consumed, with its Torch RNG state right before each
loss call (the processes run with the same seed, so each one's states are recorded and restored apart),
through the capture API as one *part* (:class:`~replayjob.producers.api.capture.StepCapture` with
``part=True``) in ``rank-<r>/``, then lands (``COMPLETE.<r>``: rank, process count, the part manifest's
SHA-256).  After a barrier, process 0 reads every landed part back, verifies it, and writes the root
manifest (:data:`SCHEMA`) exclusively and last among the manifests, then ``final_adapter/``,
``metrics.json`` and ``replay.toml`` exactly as a one-process capture does::

    optimizer_batch_step_<K>.manifest.json   the root (pinned by metrics.json and replay.toml)
    COMPLETE.0 ... COMPLETE.<P-1>            one landing record per process
    rank-0/optimizer_batch_step_<K>.{safetensors,adapter.safetensors,optimizer.safetensors,manifest.json}
    rank-1/...
    final_adapter/, metrics.json, replay.toml

The root ties the parts to one run: ``world_size`` (the process count), per process its directory,
part manifest SHA-256, logical digest and micro-batch count; ``payload_sha256`` (the digest of the parts'
payload SHA-256s in rank order, the payload pin replays record); the logical-batch digest over every
process's micro-batches in rank order (:func:`replayjob.producers.api.capture.logical_digest` of them
concatenated, what one process running them in that order would record) and the effective digest likewise;
the config (with ``distributed.num_processes``), contract, base model, the update's sealed ``outcome``, and
process 0's ``framework_state``, ``trainable`` names and optimizer description.  Every part must hold the
same config, contract, base model, initial adapter and optimizer state (data parallel: the ranks start
equal) and end with the same adapter.

:func:`replayjob.artifacts.api_manifest.of` reads a pinned manifest: a one-process capture's as before, or a
root with every part verified (listing, landing records, each part manifest against its pin, the parts' agreement).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replayjob.artifacts import api_manifest as imanifest
from replayjob.artifacts import metrics as metrics_io
from replayjob.artifacts.capture_manifest import OUTCOME
from replayjob.artifacts.capture_root import land, landed_name, rank_dir
from replayjob.digest import batch_sha256, sha256_bytes
from replayjob.errors import ArtifactExistsError
from replayjob.fsio import atomic_write_bytes, atomic_write_text
from replayjob.jsonio import canonical_bytes
from replayjob.producers.api import capture as cap
from replayjob.producers.api import files as _files
from replayjob.producers.api import microbatch as _microbatch
from replayjob.runtime import distributed


def refuse_existing(out: Path, rank: int, step: int) -> None:
    """Refuse (before training) this process's directory and landing record, and the root's files."""
    names = [rank_dir(rank), landed_name(rank), *_files.capture_file_names(step, several=False)]
    for name in names:
        if (out / name).exists():
            raise ArtifactExistsError("a capture already exists here and is never overwritten", where=out / name,
                                      hint="choose a new output directory")


# ------------------------------------------------------------------------------------- capture
def finish(out: Path, c: cap.StepCapture, rank: int, world: int) -> cap.CaptureResult:
    """Every process, after its part's :meth:`StepCapture.finish`: land, wait for every process, and (process 0)
    write the root, final adapter, metrics.json and replay.toml; return the root's result on every process."""

    part = c.result
    assert part is not None
    land(out, rank, world, part.manifest_sha256)
    mbs = c.micro_batches
    mine = {"manifest_sha256": part.manifest_sha256, "logical": _microbatch.logical_entries(mbs),
            "effective": _microbatch.effective_entries(mbs), "rows": _microbatch.rows_summary(mbs),
            "nonfinite": _microbatch.has_nonfinite(mbs)}
    every = distributed.gather_objects(mine)
    distributed.barrier()  # every part is on disk
    done, failed = None, None
    if rank == distributed.ROOT_RANK:
        try:
            done = _write_root(out, c, every)
        except Exception as exc:  # every process waits below for the root: tell them, then raise it here
            failed = exc
    root = distributed.gather_objects(done)[distributed.ROOT_RANK]
    if failed is not None:
        raise failed
    if root is None:
        raise cap.CaptureError("process 0 could not write the root manifest (its own error says why)",
                               where=str(out), hint="nothing of this capture is usable; capture again")
    return cap.CaptureResult(out, Path(root["manifest"]), root["sha256"], root["logical"], out / _files.REPLAY_CONFIG,
                             root["metrics"])


def _write_root(out: Path, c: cap.StepCapture, every: list[dict[str, Any]]) -> dict[str, Any]:
    names = imanifest.file_names(c.step)
    parts = [imanifest.read_verified(out / rank_dir(r) / names["manifest"], e["manifest_sha256"])
             for r, e in enumerate(every)]
    imanifest.check_parts(parts)
    first = parts[0]
    logical = batch_sha256("logical", [x for e in every for x in e["logical"]])
    effective = batch_sha256("effective", [x for e in every for x in e["effective"]])
    rows: dict[str, Any] = {k: sum(int(e["rows"][k]) for e in every) for k in every[0]["rows"]}
    rows["nonfinite_inputs"] = any(e["nonfinite"] for e in every)
    doc = imanifest.build_root(parts, [len(e["logical"]) for e in every], rows=rows, logical=logical,
                               effective=effective)
    path = out / names["manifest"]
    imanifest.validate_root(doc, path)
    data = canonical_bytes(doc) + b"\n"
    atomic_write_bytes(path, data, exclusive=True)  # the root: the last manifest written
    sha = sha256_bytes(data)
    sealed = first.doc[OUTCOME]
    if _files.save_adapter(out / _files.FINAL_ADAPTER_FILE, c.model) != sealed["final_adapter_sha256"]:
        raise cap.CaptureError("the final adapter file's SHA-256 is not the one sealed in the manifests",
                               where=out / _files.FINAL_ADAPTER_FILE)
    metrics = metrics_io.capture_document(
        framework=first.framework, step=first.step, logical=logical, effective=effective, manifest_sha256=sha,
        manifest_path=names["manifest"], initial_adapter_sha256=first.initial_adapter_sha256,
        final_adapter_sha256=sealed["final_adapter_sha256"], final_adapter_path=_files.FINAL_ADAPTER_FILE,
        loss=sealed["loss"], grad_norm=sealed["grad_norm"], config=first.config)
    metrics_io.write(out / _files.METRICS_FILE, metrics, exclusive=True)
    atomic_write_text(out / _files.REPLAY_CONFIG, c._replay_toml(path.resolve(), sha, logical), exclusive=True)
    return {"manifest": str(path), "sha256": sha, "logical": logical, "metrics": metrics}


