"""The run-metrics artifacts, written and read here only: the source run's ``metrics.json`` and each
replay's ``replay_metrics.json`` (``docs/replay-metrics.md``).

Both carry the same pin keys (:data:`PIN_KEYS`); the source trainer, the capture hook and replay
write them with :func:`write` and take their names, schema versions and keys from here, and the
reducer reads them with :func:`read_replay` / :func:`read_source`.  A replay's document is read through
its declaration (:mod:`replayjob.artifacts.replay_metrics`: every key typed and ranged, an unknown or
missing key refused), then against its producer's knobs and the files beside it; the source's metrics.json
through its own (:mod:`replayjob.artifacts.source_metrics`), then the form the reduce compares with (one step,
or a step record) and the paths it names.  A malformed file is refused (exit 2) naming the
file and the field.  Nothing here imports torch, transformers or peft.

Example:
    >>> REPLAY_FILE, SOURCE_FILE
    ('replay_metrics.json', 'metrics.json')
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

from msgspec import UNSET, UnsetType

from replayjob import __version__
from replayjob.artifacts.replay_metrics import Distributed, RankMetrics, ReplayMetrics, TracePin
from replayjob.artifacts.schedule import DESIGNS, Slot
from replayjob.artifacts.source_metrics import SourceMetrics
from replayjob.config.differences import flatten
from replayjob.declaration import decode
from replayjob.digest import is_sha256_hex, sha256_bytes, sha256_file
from replayjob.errors import IntegrityError, RefusedError
from replayjob.frameworks import BUILTIN, PRODUCERS
from replayjob.fsio import atomic_write_bytes, check_no_symlinks, read_regular_bytes
from replayjob.hostinfo import hardware_identity, placement
from replayjob.jsonio import loads_strict, pretty_bytes, read_json_object
from replayjob.runtime.distributed import rank_sum
from replayjob.runtime.knobs import STRATEGY, WORLD_SIZE, knobs_for

SOURCE_FILE = "metrics.json"
SOURCE_SCHEMA = "replayjob.metrics/v1"
REPLAY_FILE = "replay_metrics.json"
REPLAY_SCHEMA = "replayjob.replay_metrics/v2"
MAX_METRICS_BYTES = 16 * 1024 * 1024
_BARE = re.compile(r"[A-Za-z0-9_.-]+")

# Keys both files carry: the digests a replay pins and the gate compares.
LOGICAL = "optimizer/logical_batch_sha256"
EFFECTIVE = "optimizer/local_effective_rows_sha256"
MANIFEST = "optimizer_batch/manifest_sha256"
INITIAL_ADAPTER = "optimizer_batch/initial_adapter_sha256"
FINAL_ADAPTER = "optimizer_batch/final_adapter_sha256"
PIN_KEYS = (LOGICAL, EFFECTIVE, MANIFEST, INITIAL_ADAPTER, FINAL_ADAPTER)
CAPTURE_PREFIXES = ("optimizer/", "optimizer_batch/")  # every key a capture adds to metrics.json
FINAL_ADAPTER_PATH = "final_adapter_path"  # relative to the metrics file's directory
SOURCE_FINAL_ADAPTER = "final_adapter_sha256"  # source only: the trainer's own record of its final adapter
MANIFEST_PATH = "optimizer_batch/manifest_path"  # source only: the capture manifest's file name
SKIPPED = ("dataset", "environment", "rollout", "sampling")  # what a replay never touches
# Source only, written by the capture hooks (replayjob.launch.source_run): chosen steps and the ring buffer.
STEPS = "optimizer_batch/steps"  # one STEP_* entry per chosen step, in step order
RING = "optimizer_batch/ring"  # the ring's figures (RING_*) and its written steps (STEP_* entries)
# One captured step's entry (under STEPS, or RING's RING_WRITTEN): its pins, paths relative to the run.
STEP = "step"
STEP_MANIFEST_PATH = "manifest_path"
STEP_MANIFEST = "manifest_sha256"
STEP_LOGICAL = "logical_batch_sha256"
STEP_EFFECTIVE = "local_effective_rows_sha256"
STEP_INITIAL_ADAPTER = "initial_adapter_sha256"
STEP_FINAL_ADAPTER = "final_adapter_sha256"  # null when the step's update never returned
STEP_REPLAY_CONFIG = "replay_config"
STEP_NONFINITE = "nonfinite_inputs"
STEP_LOSS = "loss"  # optional: the step's loss as the trainer reported it (the capture API records it)
STEP_GRAD_NORM = "grad_norm"  # optional: its pre-clip gradient norm
STEPS_NOT_CAPTURED = "optimizer_batch/steps_not_captured"  # capture API: chosen steps training never completed
RING_SIZE = "size"
RING_STEPS_OBSERVED = "steps_observed"
RING_PEAK_BYTES = "peak_bytes"
RING_TRAINING_THREAD_S = "training_thread_s"
RING_TRIGGER = "trigger"
RING_WRITTEN = "written"
# Replay only: where it ran (replayjob.hostinfo) and, for a traced replay, the trace index it pins.
HOST = "host"
FRAMEWORK = "framework"  # replay_metrics.json: the producer (replayjob.producers.PRODUCERS) whose knobs runtime holds
TRACE = "trace"  # {TRACE_INDEX_PATH: TRACE_INDEX, TRACE_INDEX_SHA256: digest}; absent when not traced
TRACE_INDEX_PATH = "index_path"
TRACE_INDEX_SHA256 = "index_sha256"
TRACE_INDEX = "trace/index.json"  # relative to the replay's directory (replayjob.artifacts.trace_store)
# An MoE model's routing (replayjob.model.moe, docs/moe.md): a replay pins its routing.safetensors under
# ROUTING ({"path", "sha256"}; absent for a dense model); a source run lists each captured step's file under
# SOURCE_ROUTING ([{"step", "path", "sha256"}]).
ROUTING = "routing"
SOURCE_ROUTING = "routing/steps"
# Replay only, optional for the readers: the budget file's pin, the replay's slot in a paired schedule
# (replayjob.artifacts.schedule.Slot.to_json, or null) and its in-process repeats (or null).
BUDGETS_SHA256 = "budgets_sha256"
SCHEDULE = "schedule"
IN_PROCESS = "in_process"
IN_PROCESS_WALLS = "local_train_wall_s"  # the measured in-process updates' seconds
NONFINITE_OUTCOME = "nonfinite_outcome"  # which of the update's loss and gradient norm were NaN or infinite
IN_PROCESS_LOSS_EQUAL = "loss_equal"  # every in-process update's loss equals the fresh update's
# Replay only, optional for the readers: what contended with the timed updates (the contention
# probe's record, replayjob.runtime.contention_probe.Probe); absent in metrics written before the probe: "not recorded".
CONTENTION = "contention"
# Replay over several ranks only (replayjob.runtime.distributed): each rank's own figures in RANK_FILE(r) beside
# replay_metrics.json, which rank 0 writes last with the merged figures and a DISTRIBUTED section listing
# the rank files by SHA-256; the reader re-merges them (merge_ranks) and refuses figures that differ.
RANK_SCHEMA = "replayjob.replay_rank_metrics/v1"
DISTRIBUTED = "distributed"
# Spread metrics: name -> (section, key) in replay_metrics.json.
MEASURES: dict[str, tuple[str, str]] = {
    "local_train_wall_s": ("timing", "local_train_wall_s"),
    "forward_wall_s": ("timing", "forward_wall_s"),
    "backward_wall_s": ("timing", "backward_wall_s"),
    "optimizer_wall_s": ("timing", "optimizer_wall_s"),
    "peak_memory_bytes": ("memory", "peak_bytes"),
    "padding_fraction": ("padding", "padding_fraction"),
}


def finite_or_none(v: float | None) -> float | None:
    """A step record's loss or gradient norm: strict JSON has no NaN, so a non-finite one is null."""
    return v if v is not None and math.isfinite(v) else None


def outcome_fields(loss: float, grad_norm: float) -> dict[str, Any]:
    """A replayed update's loss and gradient norm as its record holds them: strict JSON has no NaN, so a
    non-finite one is null and named in :data:`NONFINITE_OUTCOME` (every producer reports both).  A knob that
    drives the update to a non-finite loss is a finding the gate fails (``exact.finite_outcome``), not input to
    refuse."""
    named = [k for k, v in (("grad_norm", grad_norm), ("loss", loss)) if not math.isfinite(v)]
    return {"loss": finite_or_none(loss), "grad_norm": finite_or_none(grad_norm), NONFINITE_OUTCOME: named}


def loss_text(doc: dict[str, Any]) -> str:
    """A replay record's loss as its one-line summary says it."""
    if "loss" in doc.get(NONFINITE_OUTCOME, ()):
        return "not finite (NaN or an infinity, recorded null: the gate fails it, exact.finite_outcome)"
    return repr(doc["loss"])


def rank_file(rank: int) -> str:
    """One rank's figures of a replay over several ranks (never read as a replay of its own)."""
    return f"replay_metrics.rank-{rank}.json"


_RANK_FILE = re.compile(r"^replay_metrics\.rank-(0|[1-9][0-9]*)\.json\Z")  # rank_file(r), r >= 0


def rank_files_present(directory: Path, listing: Iterable[str] | None = None) -> list[str]:
    """The names of the rank files (:func:`rank_file`) lying in ``directory``, by rank; ``listing``: the names
    in ``directory`` when the caller has just listed it (reduce's discovery), so it is not listed again."""
    try:
        names = [n for n in (os.listdir(directory) if listing is None else listing) if _RANK_FILE.match(n)]
    except OSError as exc:
        raise IntegrityError(f"cannot list the replay's directory: {exc.strerror}", where=directory) from None
    return sorted(names, key=lambda n: int(n.split("-")[-1].split(".")[0]))


def merge_ranks(docs: list[dict[str, Any]], nonfinite: Iterable[str] = ()) -> dict[str, Any]:
    """One replay's figures from its ranks' documents, in rank order: the loss summed in rank order
    (float64, :func:`replayjob.runtime.distributed.rank_sum`; null when a rank's is null or the sum is not
    finite, and then named in :data:`NONFINITE_OUTCOME` beside what ``nonfinite``, the replay's list, says of
    the gradient norm), each time the slowest rank's (the update is done when every rank is), peak memory the
    largest rank's, tokens and micro-batches summed."""

    real = sum(int(d["padding"]["real_tokens"]) for d in docs)
    padded = sum(int(d["padding"]["padded_tokens"]) for d in docs)
    parts = [d["loss"] for d in docs]
    loss = None if any(v is None for v in parts) else finite_or_none(rank_sum(parts))
    return {
        "loss": loss,
        NONFINITE_OUTCOME: sorted({*(k for k in nonfinite if k != "loss"), *(("loss",) if loss is None else ())}),
        "timing": {k: max(float(d["timing"][k]) for d in docs) for k in sorted(docs[0]["timing"])},
        "memory": {"peak_bytes": max(int(d["memory"]["peak_bytes"]) for d in docs), "kind": docs[0]["memory"]["kind"]},
        "padding": {"real_tokens": real, "padded_tokens": padded,
                    "padding_fraction": 1.0 - real / padded if padded else 0.0,
                    "micro_batches": sum(int(d["padding"]["micro_batches"]) for d in docs)},
    }


def read_rank(path: Path, expected_sha256: str) -> dict[str, Any]:
    """One rank file of a replay over several ranks, whose bytes must have ``expected_sha256``."""
    doc, sha = _read(path)
    if sha != expected_sha256 or doc.get("schema") != RANK_SCHEMA:
        raise IntegrityError(f"rank file SHA-256 {sha} or schema {doc.get('schema')!r} is not the one written",
                             where=path, hint="rerun the replay into a new --out directory")
    return doc


def _check_ranks(f: _Fields, doc: dict[str, Any], where: Path, dist: Distributed) -> None:
    """A replay over several ranks: every rank file listed, its SHA-256, and the merged figures (exact).  The
    record's shape (world size >= 2, one entry per rank in order) is its declaration's."""
    world = dist.world_size
    docs = []
    for e in dist.ranks:
        if e.file != rank_file(e.rank):
            raise f.fail(f"{DISTRIBUTED}.ranks", f"rank {e.rank}'s file must be {rank_file(e.rank)!r}")
        rp = where.parent / e.file
        rdoc, sha = _read(rp)
        if sha != e.sha256:
            raise IntegrityError(f"rank file SHA-256 is {sha}, the replay lists {e.sha256}", where=rp,
                                 hint="a rank's figures changed after the replay; rerun it")
        if rdoc.get("schema") != RANK_SCHEMA:
            raise IntegrityError(f"schema is {rdoc.get('schema')!r}, expected {RANK_SCHEMA!r}", where=rp)
        decode(rdoc, RankMetrics, where=rp, hint="a rank file does not follow docs/replay-metrics.md; rerun the replay")
        same = {"schema": RANK_SCHEMA, "rank": e.rank, "world_size": world, "arm": doc.get("arm"),
                "repeat_index": doc.get("repeat_index"), "rows": e.rows}
        off = sorted(k for k, v in same.items() if rdoc.get(k) != v)
        if rdoc["memory"]["kind"] != doc["memory"]["kind"]:  # one measure merged: every rank's of the same kind
            off.append("memory.kind")
        if off:
            raise IntegrityError(f"rank file fields {off} do not belong to this replay", where=rp)
        mine, replay_hw = hardware_identity(rdoc["host"]), hardware_identity(doc["host"])
        if mine != replay_hw:  # inputs.same_hardware reads the replay's host: it must stand for every rank's
            differ = ", ".join(f"{k} {mine[k]!r} (the replay's: {replay_hw.get(k)!r})" for k in mine
                               if mine[k] != replay_hw.get(k))
            raise IntegrityError(f"rank {e.rank} ran on other hardware than its replay records: {differ}", where=rp,
                                 hint="a replay's ranks run on one kind of device, driver, CUDA, torch and image; "
                                      "rerun it there")
        docs.append(rdoc)
    try:
        merged = merge_ranks(docs, doc.get(NONFINITE_OUTCOME, ()))
    except (KeyError, TypeError, ValueError):
        raise IntegrityError("a rank file lacks loss, timing, memory or padding figures", where=where.parent) from None
    off = sorted(k for k, v in merged.items() if doc.get(k, [] if k == NONFINITE_OUTCOME else None) != v)
    if off:
        raise IntegrityError(f"the replay's {', '.join(off)} are not the merge of its ranks' figures", where=where,
                             hint="replay_metrics.json changed after the replay; rerun it")


def _check_world(f: _Fields, where: Path, runtime: dict[str, Any], dist: Distributed | None,
                 listing: Iterable[str] | None = None) -> None:
    """The replay's world size, told three ways, is one number: its :data:`DISTRIBUTED` record (absent: one
    process), the rank files lying beside it (exactly the record's, none without one) and the world size and
    strategy it observed at run time (``runtime``, for a producer that registers them).  Evidence that
    contradicts itself is refused: a deleted record would leave its rank files unread and its figures
    unchecked."""

    world = dist.world_size if dist is not None else 1
    present = rank_files_present(where.parent, listing)
    listed = [rank_file(r) for r in range(world)] if dist is not None else []
    if present != listed:
        raise f.fail(DISTRIBUTED, (f"records {world} ranks ({', '.join(listed)})" if listed else
                                   "is absent (one process)") + f", but the rank files beside the replay are "
                                  f"{', '.join(present) or 'none'}: the evidence contradicts itself")
    if WORLD_SIZE in runtime and (isinstance(runtime[WORLD_SIZE], bool) or runtime[WORLD_SIZE] != world):
        raise f.fail(f"runtime.{WORLD_SIZE}", f"is {runtime[WORLD_SIZE]!r}, but the replay's {DISTRIBUTED!r} "
                                             f"record says {world} rank(s): the evidence contradicts itself")
    strategy = dist.strategy if dist is not None else None
    if strategy is not None and STRATEGY in runtime and runtime[STRATEGY] != strategy:
        raise f.fail(f"runtime.{STRATEGY}", f"is {runtime[STRATEGY]!r}, but the replay's {DISTRIBUTED!r} record "
                                           f"says {strategy!r}: the evidence contradicts itself")


def write(path: Path, doc: dict[str, Any], *, exclusive: bool = False) -> str:
    """Write a metrics document atomically (pretty, sorted keys); ``exclusive`` never replaces one.
    Returns the SHA-256 of the bytes written."""
    data = pretty_bytes(doc)
    atomic_write_bytes(path, data, exclusive=exclusive)
    return sha256_bytes(data)


def replay_document(*, framework: str, arm: str, repeat_index: int, pins: dict[str, str], manifest_sha256: str,
                    logical: str, effective: str, initial_adapter_sha256: str, allowed: list[str],
                    observed: list[str], knob_values: dict[str, Any], runtime: dict[str, Any], loss: float,
                    grad_norm: float, timing: dict[str, float], peak: int, device: str, torch_version: str,
                    host: dict[str, Any], padding: dict[str, Any], rows: dict[str, Any], rng_restored: list[str],
                    tolerances_sha256: str, budgets_sha256: str, config_sha256: str,
                    step: int) -> dict[str, Any]:
    """The ``replay_metrics.json`` document (docs/replay-metrics.md) before the final adapter, provenance,
    schedule, in-process repeats, contention and whole-run wall time are added (the replay driver,
    :mod:`replayjob.producers.driver`, adds them and writes it with :func:`write_replay`).  ``runtime``
    holds the observation of every registered knob of ``framework``; ``host``: where it ran
    (:func:`replayjob.hostinfo.host_provenance`)."""
    doc: dict[str, Any] = {
        "schema": REPLAY_SCHEMA,
        FRAMEWORK: framework,
        "replayjob_version": __version__,
        "torch_version": torch_version,
        "device": device,
        "arm": arm,
        "repeat_index": repeat_index,
        "pins": pins,
        LOGICAL: logical,
        EFFECTIVE: effective,
        MANIFEST: manifest_sha256,
        INITIAL_ADAPTER: initial_adapter_sha256,
        "allowed_config_differences": list(allowed),
        "observed_config_differences": list(observed),
        "knobs": knob_values,
        "skipped": list(SKIPPED),
        "runtime": runtime,
        **outcome_fields(loss, grad_norm),
        "timing": timing,
        "memory": {"peak_bytes": peak,
                   "kind": "cuda_max_allocated" if device.startswith("cuda") else "max_rss"},
        "padding": padding,
        "rows": rows,
        "rng_restored": rng_restored,
        "tolerances_sha256": tolerances_sha256.strip().lower(),  # checked at admission
        BUDGETS_SHA256: budgets_sha256.strip().lower(),
        "config_sha256": config_sha256,
        HOST: host,
        STEP: step,
    }
    return doc


def source_document(*, trainer: str, torch_version: str, device: str, steps_run: int, last_step: int,
                    loss: float, grad_norm: float, initial_adapter_sha256: str | None, final_adapter_sha256: str,
                    final_adapter_path: str, config_sha256: str, config: dict[str, Any], provenance: dict[str, Any],
                    wall_s: float) -> dict[str, Any]:
    """The reference trainer's ``metrics.json`` before its capture hooks add their records (strict JSON:
    a diverged last step's loss or norm is null here, NaN in diag.jsonl)."""
    return {
        "schema": SOURCE_SCHEMA,
        "trainer": trainer,
        "replayjob_version": __version__,
        "torch_version": torch_version,
        "device": device,
        "steps_run": steps_run,
        "last_step": last_step,
        "loss": finite_or_none(loss),
        "grad_norm": finite_or_none(grad_norm),
        "initial_adapter_sha256": initial_adapter_sha256,
        SOURCE_FINAL_ADAPTER: final_adapter_sha256,
        FINAL_ADAPTER_PATH: final_adapter_path,
        "config_sha256": config_sha256,
        "config": config,
        "provenance": provenance,
        "wall_s": wall_s,
    }


def step_record(*, step: int, manifest_path: str, manifest_sha256: str, logical: str, effective: str,
                initial_adapter_sha256: str, final_adapter_sha256: str | None, replay_config: str,
                nonfinite_inputs: bool, loss: float | None, grad_norm: float | None) -> dict[str, Any]:
    """One captured step's record (an entry of :data:`STEPS` or of the ring's :data:`RING_WRITTEN`): its
    manifest and pins, its adapters, its replay config, and the loss and gradient norm the trainer reported
    (null when not finite)."""
    return {STEP: step, STEP_MANIFEST_PATH: manifest_path, STEP_MANIFEST: manifest_sha256, STEP_LOGICAL: logical,
            STEP_EFFECTIVE: effective, STEP_INITIAL_ADAPTER: initial_adapter_sha256,
            STEP_FINAL_ADAPTER: final_adapter_sha256, STEP_REPLAY_CONFIG: replay_config,
            STEP_NONFINITE: nonfinite_inputs, STEP_LOSS: finite_or_none(loss),
            STEP_GRAD_NORM: finite_or_none(grad_norm)}


def capture_document(*, framework: str, step: int, logical: str, effective: str, manifest_sha256: str,
                     manifest_path: str, initial_adapter_sha256: str, final_adapter_sha256: str,
                     final_adapter_path: str, loss: float | None, grad_norm: float | None,
                     config: dict[str, Any]) -> dict[str, Any]:
    """The capture API's ``metrics.json`` for one captured step (one process, or a root over several)."""
    return {"schema": SOURCE_SCHEMA, FRAMEWORK: framework, STEP: step, LOGICAL: logical, EFFECTIVE: effective,
            MANIFEST: manifest_sha256, INITIAL_ADAPTER: initial_adapter_sha256, FINAL_ADAPTER: final_adapter_sha256,
            FINAL_ADAPTER_PATH: final_adapter_path, MANIFEST_PATH: manifest_path, "loss": finite_or_none(loss),
            "grad_norm": finite_or_none(grad_norm), "config": config}


def steps_document(*, framework: str, steps: list[dict[str, Any]], not_captured: list[int],
                   config: dict[str, Any]) -> dict[str, Any]:
    """The capture API's ``metrics.json`` for several chosen steps: each captured step's :func:`step_record`
    and the chosen steps training never completed."""
    return {"schema": SOURCE_SCHEMA, FRAMEWORK: framework, STEPS: steps, STEPS_NOT_CAPTURED: not_captured,
            "config": config}


def rank_document(*, rank: int, world_size: int, replay: dict[str, Any], rows: list[int], shard_logical: str,
                  shard_effective: str, loss: float, micro_batch_rows: list[int],
                  padding: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank's ``replay_metrics.rank-<r>.json`` (:data:`RANK_SCHEMA`): its shard of the replay whose
    document is ``replay`` (arm, repeat, timing, memory, padding unless given, host), as :func:`merge_ranks`
    reads it."""
    return {"schema": RANK_SCHEMA, "rank": rank, "world_size": world_size, "arm": replay["arm"],
            "repeat_index": replay["repeat_index"], "rows": rows, "shard_logical_sha256": shard_logical,
            "shard_effective_rows_sha256": shard_effective, "loss": finite_or_none(loss),
            "micro_batch_rows": micro_batch_rows,
            "timing": replay["timing"], "memory": replay["memory"],
            "padding": replay["padding"] if padding is None else padding, HOST: replay[HOST]}


def write_replay(out: Path, doc: dict[str, Any]) -> str:
    """Write ``OUT/replay_metrics.json`` exclusively (never replacing a replay); its SHA-256."""
    return write(out / REPLAY_FILE, doc, exclusive=True)


@dataclass(frozen=True)
class Run:
    """What a replay's metrics and the source's metrics.json both report, validated."""

    path: Path
    sha256: str  # of the metrics file's bytes
    logical: str
    effective: str
    manifest: str
    initial_adapter: str
    final_adapter: str
    final_adapter_file: Path | None  # None: a captured step's source (its SHA-256 is pinned, no file kept)
    loss: float | None  # None: a replay whose update's loss was not finite (a source's loss is always a number)
    grad_norm: float | None  # the update's pre-clip gradient norm (None: not recorded, or not finite)
    step: int | None  # the captured step (None: a built-in one-step source, whose metrics name no step)


@dataclass(frozen=True)
class Replay(Run):
    """One validated replay_metrics.json."""

    arm: str
    repeat_index: int
    # a replay always keeps its final adapter file (only a captured step's source has none)
    final_adapter_file: Path
    framework: str  # the producer whose update was replayed (replayjob.producers.PRODUCERS)
    pin_logical: str
    pin_manifest: str
    pin_payload: str
    allowed: tuple[str, ...]
    observed: tuple[str, ...]
    knobs: dict[str, Any]
    skipped: tuple[str, ...]
    runtime: dict[str, Any]  # registered knob -> the value observed in effect at run time
    rows: int
    tolerances_sha256: str
    measures: dict[str, float] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)  # replayjob.hostinfo: where it ran
    trace_index_sha256: str | None = None  # the trace/index.json a traced replay pins (docs/trace-format.md)
    # Optional keys (docs/replay-metrics.md): the device string and the replay's place in a paired schedule.
    budgets_sha256: str = ""
    slot: Slot | None = None
    device: str = ""
    memory_kind: str = ""
    in_process_wall_s: tuple[float, ...] | None = None  # measured in-process updates, if any
    in_process_loss_equal: bool | None = None
    nonfinite: tuple[str, ...] = ()  # which of the update's loss and gradient norm were not finite
    contention: dict[str, Any] | None = None  # replayjob.runtime.contention_probe record; None: not recorded
    doc: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # as read

    @property
    def placement(self) -> str:
        """Node and device this replay ran on (:func:`replayjob.hostinfo.placement`), or ``""``."""
        return placement(self.host, self.device)

    @cached_property
    def label(self) -> str:  # read by every check that names a replay: spelled once
        return f"{self.arm}#{self.repeat_index}"


@dataclass(frozen=True)
class Source(Run):
    """The capture run's metrics.json (``--source DIR``)."""

    config: dict[str, Any]
    manifest_file: Path  # the capture manifest named by MANIFEST_PATH, next to the metrics file
    manifest_pin: str = MANIFEST  # the metrics key that pins it, as messages name it
    not_captured: tuple[int, ...] = ()  # the chosen steps the file says training never completed
    record: str = ""  # where the compared numbers lie in the metrics file: "" (top level) or a step record's key

    def config_value(self, dotted: str) -> Any:
        """The resolved source config value at ``dotted`` (``None`` when absent)."""
        return flatten(self.config).get(dotted)


def _read(path: Path) -> tuple[dict[str, Any], str]:
    data = read_regular_bytes(path, max_bytes=MAX_METRICS_BYTES, what="metrics file")
    doc = loads_strict(data, where=path)
    if not isinstance(doc, dict):
        raise IntegrityError(f"expected a JSON object, found {type(doc).__name__}", where=path)
    return doc, sha256_bytes(data)


class _Fields:
    """Typed access to one document's fields; every failure names the file and the key."""

    def __init__(self, doc: dict[str, Any], where: Path, prefix: str = "",
                 hint: str = "the file does not follow docs/replay-metrics.md; rerun the replay"):
        self.doc, self.where, self.prefix, self.hint = doc, where, prefix, hint  # prefix: a nested object's path

    def fail(self, key: str, what: str) -> IntegrityError:
        return IntegrityError(f"field {self.prefix + key!r} {what}", where=self.where, hint=self.hint)

    def get(self, key: str, obj: dict[str, Any] | None = None) -> Any:
        d = self.doc if obj is None else obj
        if key not in d:
            raise self.fail(key, "is missing")
        return d[key]

    def text(self, key: str, obj: dict[str, Any] | None = None, *, nonempty: bool = True) -> str:
        v = self.get(key, obj)
        if not isinstance(v, str) or (nonempty and not v):
            raise self.fail(key, "must be a non-empty string" if nonempty else "must be a string")
        return v

    def file(self, key: str, obj: dict[str, Any] | None = None) -> Path:
        """A path relative to the metrics file's directory (never outside it, no component below that
        directory a symbolic link: :func:`replayjob.fsio.check_no_symlinks`)."""
        rel = self.text(key, obj)
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
            raise self.fail(key, f"must be a relative path inside the run directory, found {rel!r}")
        return check_no_symlinks(self.where.parent, self.where.parent / pure, what=f"{self.prefix + key} {rel!r}")


def read_replay(path: str | Path, *, listing: Iterable[str] | None = None) -> Replay:
    """Read one replay_metrics.json through its declaration (:class:`~replayjob.artifacts.replay_metrics.
    ReplayMetrics`: every key typed and ranged, none unknown), then the rules that tie it to its producer's
    knobs and to the files beside it; refuse naming the file and the field.  ``listing``: the names in the
    file's directory when the caller has just listed it (:func:`replayjob.gate.evidence.discover_listed`),
    read for the rank files beside it instead of a listing of its own."""
    # here: the trainer imports this module, and no capture package

    p = path if isinstance(path, Path) else Path(path)
    doc, sha = _read(p)
    f = _Fields(doc, p)
    if doc.get("schema") != REPLAY_SCHEMA:  # the version first, in words of its own
        raise IntegrityError(f"schema is {doc.get('schema')!r}, expected {REPLAY_SCHEMA!r}", where=p,
                             hint="reduce reads replay metrics written by `replayjob replay`")
    d = decode(doc, ReplayMetrics, where=p, hint=f.hint)
    if d.framework not in PRODUCERS:
        raise f.fail(FRAMEWORK, f"must be one of {list(PRODUCERS)}, found {d.framework!r}")
    registered = sorted(knobs_for(d.framework))
    if sorted(d.runtime) != registered:
        raise f.fail("runtime", f"must hold the observed value of every registered knob of {d.framework!r} "
                                f"{registered}, found {sorted(d.runtime)}")
    rows = doc["rows"].get("rows")
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows < 2**63:
        raise f.fail("rows.rows", "must be an integer >= 1")
    if d.arm == "source":
        raise f.fail("arm", "may not be 'source', the name reduce gives the capture run")
    if d.schedule is not None and d.schedule.design not in DESIGNS:
        raise f.fail(f"{SCHEDULE}.design", f"must be one of {', '.join(DESIGNS)}")
    if d.distributed is not None:  # one replay over several ranks: its rank files merge into it (never repeats)
        end = d.distributed.ranks[-1].rows[1]  # the ranks' shares tile [0, end) (the record's declaration)
        # the built-in trainer's `rows.rows` counts the payload's rows, the ones its ranks split; a capture-API
        # producer's counts its inputs' leading dimensions, which its ranks need not split (verl splits sequences)
        if d.framework == BUILTIN and end != rows:
            raise f.fail(f"{DISTRIBUTED}.ranks", f"holds rows [0, {end}) over its ranks, but the replay's `rows.rows` "
                                                 f"is {rows}: the ranks' shares cover the replayed rows exactly")
        _check_ranks(f, doc, p, d.distributed)
    _check_world(f, p, d.runtime, d.distributed, listing)
    for key, pin in ((TRACE, d.trace), (ROUTING, d.routing)):  # evidence the replay says it wrote is there, as pinned
        if pin is not None:
            rel, want = (pin.index_path, pin.index_sha256) if isinstance(pin, TracePin) else (pin.path, pin.sha256)
            got = sha256_file(check_no_symlinks(p.parent, p.parent / rel, what=f"{key} {rel!r}"))
            if got != want:
                raise IntegrityError(f"field {key!r} pins {rel!r} at SHA-256 {want}, but the file beside it hashes to "
                                     f"{got}", where=p, hint=f"{rel} changed after the replay: replay again")
    measures = {name: float(getattr(getattr(d, section), key)) for name, (section, key) in MEASURES.items()}
    slot = d.schedule
    return Replay(
        path=p, sha256=sha, arm=d.arm, repeat_index=d.repeat_index, framework=d.framework,
        pin_logical=d.pins.expected_logical_sha256, pin_manifest=d.pins.expected_manifest_sha256,
        pin_payload=d.pins.payload_spans_sha256, logical=d.logical, effective=d.effective, manifest=d.manifest,
        initial_adapter=d.initial_adapter, final_adapter=d.final_adapter,
        final_adapter_file=f.file(FINAL_ADAPTER_PATH), loss=d.loss, grad_norm=d.grad_norm, step=d.step,
        allowed=tuple(d.allowed_config_differences), observed=tuple(d.observed_config_differences),
        knobs=doc["knobs"], skipped=tuple(d.skipped), runtime=doc["runtime"], rows=rows,
        tolerances_sha256=d.tolerances_sha256, measures=measures, host=doc[HOST],
        trace_index_sha256=d.trace.index_sha256 if d.trace is not None else None, doc=doc,
        budgets_sha256=d.budgets_sha256, device=d.device, memory_kind=d.memory.kind,
        slot=None if slot is None else Slot(slot.design, slot.seed, slot.block, slot.position),
        in_process_wall_s=None if d.in_process is None else tuple(d.in_process.local_train_wall_s),
        in_process_loss_equal=None if d.in_process is None else d.in_process.loss_equal,
        nonfinite=tuple(d.nonfinite_outcome), contention=doc.get(CONTENTION))


def read_source(directory: str | Path, step: int | None = None) -> Source:
    """Read the capture run's metrics.json in ``directory`` through its declaration
    (:class:`~replayjob.artifacts.source_metrics.SourceMetrics`: every key typed and ranged, none unknown): a
    one-step capture's pins, or with ``step`` that captured step's record (chosen steps or the ring's written
    steps), whose final adapter is pinned by SHA-256 only (no file is kept: ``final_adapter_file`` is ``None``)."""
    p, doc, sha = _read_capture(directory)
    d = _source(doc, p)
    config = dict(d.config)
    if step is None and d.logical is UNSET and d.manifest is UNSET:
        captured = sorted({e.step for _, e in d.records()})
        if captured:  # chosen steps or a ring buffer: no one-step capture to compare with, so say which step
            listed = ", ".join(str(s) for s in captured)
            raise RefusedError(f"this run captured several steps ({listed}) and no one-step capture: reduce "
                               "compares with one captured step, named with --source-step K", where=p,
                               hint=f"pass --source-step K with K the step the replays replayed (captured: {listed})")
    if step is None:
        missing = d.one_step_missing()
        if missing:
            also = f" (also: {', '.join(missing[1:])})" if missing[1:] else ""
            raise IntegrityError(f"field `{missing[0]}` is missing or null: a one-step capture records it{also}",
                                 where=p, hint=_SOURCE_HINT)
        assert isinstance(d.loss, float) and isinstance(d.final_adapter_path, str)
        assert isinstance(d.manifest_path, str)
        return Source(path=p, sha256=sha, logical=str(d.logical), effective=str(d.effective),
                      manifest=str(d.manifest), initial_adapter=str(d.initial_adapter),
                      final_adapter=str(d.final_adapter),
                      final_adapter_file=_inside(p, FINAL_ADAPTER_PATH, d.final_adapter_path), loss=d.loss,
                      config=config, manifest_file=p.parent / d.manifest_path,
                      grad_norm=None if isinstance(d.grad_norm, UnsetType) else d.grad_norm,
                      step=None if isinstance(d.step, UnsetType) else d.step, not_captured=_not_captured(d))
    e = _captured_step(_pins(d, p), p, step)
    if e.final_adapter is None or e.loss is None:
        raise RefusedError(f"step {step}'s record has no {'final adapter' if e.final_adapter is None else 'loss'}: "
                           "its update never returned, its loss was not finite, or the capture predates the "
                           "record's loss", where=p, hint="compare replays of this step with each other, or "
                                                          "capture the step again")
    return Source(path=p, sha256=sha, logical=e.logical, effective=e.effective, manifest=e.manifest,
                  initial_adapter=e.initial_adapter, final_adapter=e.final_adapter, final_adapter_file=None,
                  loss=e.loss, config=config, manifest_file=e.manifest_path,
                  manifest_pin=f"step {step} record's {STEP_MANIFEST}", grad_norm=e.grad_norm, step=e.step,
                  record=e.key, not_captured=_not_captured(d))


def _not_captured(d: SourceMetrics) -> tuple[int, ...]:
    return () if isinstance(d.steps_not_captured, UnsetType) else tuple(d.steps_not_captured)


_SOURCE_HINT = "keep the capture run's metrics.json as the capture wrote it (docs/replay-metrics.md)"


def _source(doc: dict[str, Any], p: Path) -> SourceMetrics:
    """A source run's metrics.json as its declaration reads it."""
    return decode(doc, SourceMetrics, where=p, hint=_SOURCE_HINT)


def _inside(where: Path, key: str, rel: str) -> Path:
    """``rel`` (the value of ``key``), a path relative to the metrics file's directory: never outside it, no
    component below that directory a symbolic link (:func:`replayjob.fsio.check_no_symlinks`)."""
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
        raise IntegrityError(f"field `{key}` must be a relative path inside the run directory, found {rel!r}",
                             where=where, hint=_SOURCE_HINT)
    return check_no_symlinks(where.parent, where.parent / pure, what=f"{key} {rel!r}")


def _manifest_name(doc: dict[str, Any], where: Path) -> str:
    """The capture manifest's file name (:data:`MANIFEST_PATH`): a bare name in the metrics' directory."""
    name = doc.get(MANIFEST_PATH)
    if not isinstance(name, str) or not _BARE.fullmatch(name) or name in (".", ".."):
        raise IntegrityError(f"{MANIFEST_PATH} is not a bare file name", where=where,
                             hint="keep the capture run's metrics.json as the capture wrote it")
    return name


@dataclass(frozen=True)
class StepPins:
    """One captured step's entry under :data:`STEPS` (built-in trainer and capture API alike)."""

    step: int
    manifest_path: Path
    manifest: str
    logical: str
    effective: str
    initial_adapter: str
    final_adapter: str | None  # the adapter after the real update; None when that update never returned
    replay_config: Path
    nonfinite_inputs: bool
    loss: float | None = None
    grad_norm: float | None = None
    key: str = field(default="", compare=False)  # where the record lies in metrics.json: "optimizer_batch/steps[0]"


def _pins(d: SourceMetrics, p: Path) -> tuple[StepPins, ...]:
    """Every captured step's record (the chosen steps, then the ring's written steps), its paths checked."""
    return tuple(StepPins(
        step=e.step, manifest_path=_inside(p, f"{key}.{STEP_MANIFEST_PATH}", e.manifest_path),
        manifest=e.manifest_sha256, logical=e.logical_batch_sha256, effective=e.local_effective_rows_sha256,
        initial_adapter=e.initial_adapter_sha256, final_adapter=e.final_adapter_sha256,
        replay_config=_inside(p, f"{key}.{STEP_REPLAY_CONFIG}", e.replay_config), nonfinite_inputs=e.nonfinite_inputs,
        loss=e.loss, grad_norm=e.grad_norm, key=key) for key, e in d.records())


def _read_capture(directory: str | Path) -> tuple[Path, dict[str, Any], str]:
    d = Path(directory)
    p = d / SOURCE_FILE
    if not p.is_file():
        raise RefusedError(f"no {SOURCE_FILE} in the capture directory", where=d,
                           hint="pass the directory the capture wrote (its metrics.json)")
    doc, sha = _read(p)
    return p, doc, sha


def read_steps(directory: str | Path) -> tuple[StepPins, ...]:
    """The chosen steps a run's metrics.json in ``directory`` records (:data:`STEPS`), in step order, read
    through its declaration (digests, distinct ascending steps) with their paths inside the directory."""
    p, doc, _ = _read_capture(directory)
    d = _source(doc, p)
    if isinstance(d.steps, UnsetType):
        raise IntegrityError(f"field `{STEPS}` is missing: the run recorded no chosen steps", where=p,
                             hint=_SOURCE_HINT)
    return tuple(s for s in _pins(d, p) if s.key.startswith(f"{STEPS}["))


def _captured_step(records: tuple[StepPins, ...], p: Path, step: int) -> StepPins:
    """Step ``step`` among the chosen steps (:data:`STEPS`) or the ring's written steps (:data:`RING`)."""
    found = [s for s in records if s.step == step]
    if len(found) != 1:
        listed = ", ".join(str(s) for s in sorted({s.step for s in records})) or "none"
        raise RefusedError(f"step {step} is {'recorded twice' if found else 'not a captured step'} in {SOURCE_FILE}",
                           where=p, hint=f"pass --source-step K with a step listed under {STEPS} or "
                                         f"{RING}.{RING_WRITTEN} (captured: {listed})")
    return found[0]


def read_pins(directory: str | Path) -> tuple[str, str, Path]:
    """The capture's two pins (:data:`LOGICAL`, :data:`MANIFEST`) and its manifest file, read strictly
    from ``directory``'s metrics.json: lowercase 64-digit hex digests and a bare manifest file name
    (:data:`MANIFEST_PATH`), duplicate keys refused.  Unlike :func:`read_source` nothing else is
    required, so a launcher can hand the pins to replays before any of them ran."""

    d = Path(directory)
    path = d / SOURCE_FILE
    m = read_json_object(path)
    pins = (m.get(LOGICAL), m.get(MANIFEST))
    for key, value in zip((LOGICAL, MANIFEST), pins, strict=True):
        if not is_sha256_hex(value):
            raise IntegrityError(f"{key} is not a lowercase 64-digit hex SHA-256", where=path)
    return str(pins[0]), str(pins[1]), d / _manifest_name(m, path)
