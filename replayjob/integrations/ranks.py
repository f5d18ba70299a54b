"""An external trainer's step captured over several processes (DDP under ``torchrun`` or ``accelerate launch``).

Every process records the micro-batches its own loss consumed, with its Torch RNG state right before each
loss call (the processes run with the same seed, so each one's states are recorded and restored apart),
through the capture API as one *part* (:class:`~replayjob.integrations.capture.StepCapture` with
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
process's micro-batches in rank order (:func:`replayjob.integrations.capture.logical_digest` of them
concatenated, what one process running them in that order would record) and the effective digest likewise;
the config (with ``distributed.num_processes``), contract, base model, the update's sealed ``outcome``, and
process 0's ``framework_state``, ``trainable`` names and optimizer description.  Every part must hold the
same config, contract, base model, initial adapter and optimizer state (data parallel: the ranks start
equal) and end with the same adapter.

:func:`read_capture` reads a pinned manifest: a one-process capture's as before, or a root with every part
verified (listing, landing records, each part manifest against its pin, the parts' agreement).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob import distributed
from replayjob import metrics as metrics_io
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.errors import ArtifactExistsError, IntegrityError
from replayjob.fsio import atomic_write_bytes, atomic_write_text, check_no_symlinks, read_regular_bytes
from replayjob.integrations import capture as cap
from replayjob.integrations import manifest as imanifest
from replayjob.jsonio import canonical_bytes, loads_strict
from replayjob.optbatch.manifest import OUTCOME, is_int, need, need_hex, read_pinned, validate_outcome, validate_pins
from replayjob.optbatch.ranks import land, landed_name, rank_dir, ranks_digest

SCHEMA = imanifest.RANKS_SCHEMA
_KEYS = {"schema", "framework", "step", "world_size", "ranks", "payload_sha256", "rows", "logical_batch_sha256",
         "local_effective_rows_sha256", "config", "contract", "base_model", "framework_state", "trainable",
         "optimizer", OUTCOME}
_RANK_KEYS = {"rank", "dir", "manifest_sha256", "logical_batch_sha256", "micro_batches"}
_SAME = ("adapter", "optimizer")  # files every part holds with the same bytes (the ranks start equal)


@dataclass(frozen=True)
class RootManifest(imanifest.Manifest):
    """The root of a capture over several processes, with every part verified (``parts``, in rank order).

    It reads as one capture: its files are process 0's (the initial adapter and optimizer state every part
    shares), its micro-batches every part's in rank order, its payload pin :data:`payload_sha256`."""

    parts: tuple[imanifest.Manifest, ...] = ()

    @property
    def world_size(self) -> int:
        return int(self.doc["world_size"])

    def file(self, role: str) -> Path:
        return self.parts[0].file(role)

    def file_sha256(self, role: str) -> str:
        return self.parts[0].file_sha256(role)

    @property
    def payload_digest(self) -> str:
        return str(self.doc["payload_sha256"])

    @property
    def micro_batches(self) -> list[dict[str, Any]]:
        return [e for p in self.parts for e in p.micro_batches]


def processes(m: imanifest.Manifest | None) -> int:
    """How many processes ran the captured step (1 for a one-process capture)."""
    return m.world_size if isinstance(m, RootManifest) else 1


def refuse_existing(out: Path, rank: int, step: int) -> None:
    """Refuse (before training) this process's directory and landing record, and the root's files."""
    names = [rank_dir(rank), landed_name(rank), *cap.capture_file_names(step, several=False)]
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
    mine = {"manifest_sha256": part.manifest_sha256, "logical": cap.logical_entries(c.micro_batches),
            "effective": cap.effective_entries(c.micro_batches), "rows": cap.rows_summary(c.micro_batches),
            "nonfinite": cap.has_nonfinite(c.micro_batches)}
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
    return cap.CaptureResult(out, Path(root["manifest"]), root["sha256"], root["logical"], out / cap.REPLAY_TOML,
                             root["metrics"])


def _write_root(out: Path, c: cap.StepCapture, every: list[dict[str, Any]]) -> dict[str, Any]:
    names = imanifest.file_names(c.step)
    parts = [imanifest.read_verified(out / rank_dir(r) / names["manifest"], e["manifest_sha256"])
             for r, e in enumerate(every)]
    _check_parts(parts)
    first = parts[0]
    logical = sha256_json([x for e in every for x in e["logical"]])
    effective = sha256_json({"logical": logical, "micro_batches": [x for e in every for x in e["effective"]]})
    rows: dict[str, Any] = {k: sum(int(e["rows"][k]) for e in every) for k in every[0]["rows"]}
    rows["nonfinite_inputs"] = any(e["nonfinite"] for e in every)
    doc = {
        "schema": SCHEMA, "framework": first.framework, "step": first.step, "world_size": len(parts),
        "ranks": [{"rank": r, "dir": rank_dir(r), "manifest_sha256": e["manifest_sha256"],
                   "logical_batch_sha256": p.logical_sha256, "micro_batches": len(e["logical"])}
                  for r, (e, p) in enumerate(zip(every, parts, strict=True))],
        "payload_sha256": ranks_digest([p.payload_digest for p in parts]),
        "rows": rows, "logical_batch_sha256": logical, "local_effective_rows_sha256": effective,
        **{k: first.doc[k] for k in ("config", "contract", "base_model", "framework_state", "trainable",
                                     "optimizer", OUTCOME)},
    }
    path = out / names["manifest"]
    validate(doc, path)
    data = canonical_bytes(doc) + b"\n"
    atomic_write_bytes(path, data, exclusive=True)  # the root: the last manifest written
    sha = sha256_bytes(data)
    sealed = first.doc[OUTCOME]
    if cap.save_adapter(out / cap.FINAL_ADAPTER_FILE, c.model) != sealed["final_adapter_sha256"]:
        raise cap.CaptureError("the final adapter file's SHA-256 is not the one sealed in the manifests",
                               where=out / cap.FINAL_ADAPTER_FILE)
    metrics = {
        "schema": metrics_io.SOURCE_SCHEMA, metrics_io.FRAMEWORK: first.framework,
        metrics_io.STEP: first.step, metrics_io.LOGICAL: logical, metrics_io.EFFECTIVE: effective,
        metrics_io.MANIFEST: sha, metrics_io.INITIAL_ADAPTER: first.initial_adapter_sha256,
        metrics_io.FINAL_ADAPTER: sealed["final_adapter_sha256"], metrics_io.FINAL_ADAPTER_PATH: cap.FINAL_ADAPTER_FILE,
        metrics_io.MANIFEST_PATH: names["manifest"], "loss": sealed["loss"], "grad_norm": sealed["grad_norm"],
        "config": first.config}
    metrics_io.write(out / cap.METRICS_FILE, metrics, exclusive=True)
    atomic_write_text(out / cap.REPLAY_TOML, c._replay_toml(path.resolve(), sha, logical), exclusive=True)
    return {"manifest": str(path), "sha256": sha, "logical": logical, "metrics": metrics}


def _check_parts(parts: list[imanifest.Manifest]) -> None:
    """The parts are one data-parallel step: same step, config, contract, base model, initial adapter,
    optimizer state and final adapter."""
    first = parts[0]
    for r, p in enumerate(parts[1:], start=1):
        same = {"step": p.step == first.step, "framework": p.framework == first.framework,
                "config": p.doc["config"]["sha256"] == first.doc["config"]["sha256"],
                "contract": p.doc["contract"]["sha256"] == first.doc["contract"]["sha256"],
                "base model": p.doc["base_model"]["sha256"] == first.doc["base_model"]["sha256"],
                "trainable parameters": p.doc["trainable"] == first.doc["trainable"],
                **{f"{role} state": p.file_sha256(role) == first.file_sha256(role) for role in _SAME},
                "final adapter": (p.doc[OUTCOME]["final_adapter_sha256"]
                                  == first.doc[OUTCOME]["final_adapter_sha256"])}
        off = [k for k, ok in same.items() if not ok]
        if off:
            raise IntegrityError(f"process {r}'s part differs from process 0's in {', '.join(off)}: the processes "
                                 "did not run one data-parallel step", where=p.path,
                                 hint="capture a data-parallel (DDP) run: every process starts from and ends "
                                      "with the same adapter")


# ------------------------------------------------------------------------------------- reading
def _check_listing(d: Path, world: int) -> None:
    want = {rank_dir(r) for r in range(world)} | {landed_name(r) for r in range(world)}
    have = {p.name for p in d.iterdir() if p.name.startswith(("rank-", "COMPLETE."))}
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise IntegrityError(f"the root lists {world} processes, the directory "
                             + (f"lacks {', '.join(missing)}" if missing else f"also holds {', '.join(extra)}"),
                             where=d, hint="capture again into a new directory; every process must land")


def _check_landed(d: Path, rank: int, world: int, sha: str) -> None:
    p = d / landed_name(rank)
    doc = loads_strict(read_regular_bytes(p, max_bytes=64 * 1024, follow_symlinks=False, what="landing record"),
                       where=p)
    if doc != {"rank": rank, "world_size": world, "manifest_sha256": sha}:
        raise IntegrityError(f"process {rank}'s landing record does not match the root", where=p)


def read_capture(path: str | Path, expected_sha256: str) -> imanifest.Manifest:
    """The manifest at ``path`` pinned by ``expected_sha256``: a one-process capture's (as
    :func:`replayjob.integrations.manifest.read_verified`), or a root with every part verified."""
    p, sha, doc = read_pinned(path, expected_sha256,
                              hint="point optimizer_batch.replay_path at the capture's "
                                   "optimizer_batch_step_<K>.manifest.json (its replay.toml has it)")
    if not (isinstance(doc, dict) and doc.get("schema") == SCHEMA):
        return imanifest.Manifest(p, sha, imanifest.validate(doc, p))
    validate(doc, p)
    d, world = p.parent, int(doc["world_size"])
    _check_listing(d, world)
    parts = []
    for e in doc["ranks"]:
        _check_landed(d, e["rank"], world, e["manifest_sha256"])
        where = check_no_symlinks(d, d / e["dir"] / p.name, what=f"process {e['rank']}'s manifest")
        part = imanifest.read_verified(where, e["manifest_sha256"])
        if part.logical_sha256 != e["logical_batch_sha256"] or len(part.micro_batches) != e["micro_batches"]:
            raise IntegrityError(f"process {e['rank']}'s part does not match the root's record", where=where)
        parts.append(part)
    _check_parts(parts)
    first = parts[0]
    for k in ("config", "contract", "base_model", "framework_state", "trainable", "optimizer", OUTCOME):
        if doc[k] != first.doc[k]:
            raise IntegrityError(f"the root's {k} is not process 0's", where=p)
    if doc["framework"] != first.framework or doc["step"] != first.step:
        raise IntegrityError("the root's framework or step is not process 0's", where=p)
    if doc["payload_sha256"] != ranks_digest([m.payload_digest for m in parts]):
        raise IntegrityError("the root's payload_sha256 is not the digest of its parts' payloads", where=p)
    return RootManifest(p, sha, doc, tuple(parts))


def validate(doc: Any, where: Path) -> dict[str, Any]:
    """The root's own fields (:func:`read_capture` checks the parts)."""
    need(isinstance(doc, dict) and doc.get("schema") == SCHEMA, f"'schema' must be {SCHEMA!r}", where)
    need(set(doc) == _KEYS, f"keys must be exactly {sorted(_KEYS)}; unknown {sorted(set(doc) - _KEYS)}, missing "
         f"{sorted(_KEYS - set(doc))}", where)
    validate_outcome(doc, where)
    validate_pins(doc, where)
    need(isinstance(doc["framework"], str) and doc["framework"] != "", "'framework' must be a name", where)
    need(is_int(doc["step"]) and doc["step"] >= 0, "'step' must be an integer >= 0", where)
    world = doc["world_size"]
    need(is_int(world) and world >= 2, "'world_size' must be an integer >= 2", where)
    ranks = doc["ranks"]
    need(isinstance(ranks, list) and len(ranks) == world, "'ranks' must list one entry per process", where)
    for r, e in enumerate(ranks):
        need(isinstance(e, dict) and set(e) == _RANK_KEYS and e["rank"] == r and e["dir"] == rank_dir(r)
             and is_int(e["micro_batches"]) and e["micro_batches"] >= 1,
             f"ranks[{r}] needs rank {r}, dir {rank_dir(r)!r}, manifest_sha256, logical_batch_sha256, "
             "micro_batches >= 1", where)
        need_hex(e["manifest_sha256"], f"ranks[{r}].manifest_sha256", where)
        need_hex(e["logical_batch_sha256"], f"ranks[{r}].logical_batch_sha256", where)
    need_hex(doc["payload_sha256"], "payload_sha256", where)
    for sec in ("rows", "base_model", "framework_state", "optimizer"):
        need(isinstance(doc[sec], dict), f"'{sec}' must be an object", where)
    need(isinstance(doc["rows"].get("nonfinite_inputs"), bool), "'rows.nonfinite_inputs' must be true or false",
         where)
    return doc
