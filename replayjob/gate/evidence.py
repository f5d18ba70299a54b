"""Evidence: the replay metric files (and the source run's metrics) a verdict is built from.

Every file is read strictly (:func:`replayjob.jsonio.loads_strict`) and every field the claims use
is type-checked here, once, so the claims never meet a missing key or a wrong type: a malformed
file is refused (exit 2) with its path and the field named.  Keys beyond those documented in
``docs/replay-metrics.md`` are ignored.  Nothing here imports torch, transformers or peft.

Example:
    >>> files = discover(["runs/replays"])            # doctest: +SKIP
    >>> replays = [read_replay(p) for p in files]     # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from replayjob.config.diff import flatten
from replayjob.deploy.schedule import DESIGNS, Slot
from replayjob.digest import normalize_digest, sha256_bytes
from replayjob.errors import IntegrityError, RefusedError
from replayjob.fsio import read_regular_bytes
from replayjob.hostinfo import placement
from replayjob.jsonio import loads_strict
from replayjob.optbatch.knobs import PRODUCERS, knobs_for

REPLAY_SCHEMA = "replayjob.replay_metrics/v2"
REPLAY_FILE = "replay_metrics.json"
SOURCE_FILE = "metrics.json"
MAX_METRICS_BYTES = 16 * 1024 * 1024
REQUIRED_SKIPS = ("dataset", "environment", "rollout", "sampling")
# Spread metrics: name -> (section, key) in replay_metrics.json.
MEASURES: dict[str, tuple[str, str]] = {
    "local_train_wall_s": ("timing", "local_train_wall_s"),
    "forward_wall_s": ("timing", "forward_wall_s"),
    "backward_wall_s": ("timing", "backward_wall_s"),
    "optimizer_wall_s": ("timing", "optimizer_wall_s"),
    "peak_memory_bytes": ("memory", "peak_bytes"),
    "padding_fraction": ("padding", "padding_fraction"),
}


@dataclass(frozen=True)
class Replay:
    """One validated replay_metrics.json."""

    path: Path
    sha256: str
    arm: str
    repeat_index: int
    framework: str  # the producer whose update was replayed (replayjob.optbatch.knobs.PRODUCERS)
    pin_logical: str
    pin_manifest: str
    pin_payload: str
    logical: str
    effective: str
    manifest: str
    initial_adapter: str
    final_adapter: str
    final_adapter_file: Path
    allowed: tuple[str, ...]
    observed: tuple[str, ...]
    knobs: dict[str, Any]
    skipped: tuple[str, ...]
    runtime: dict[str, Any]  # registered knob -> the value observed in effect at run time
    rows: int
    loss: float
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

    @property
    def placement(self) -> str:
        """Node and device this replay ran on (:func:`replayjob.hostinfo.placement`), or ``""``."""
        return placement(self.host, self.device)

    @property
    def label(self) -> str:
        return f"{self.arm}#{self.repeat_index}"


@dataclass(frozen=True)
class Source:
    """The capture run's metrics.json (``--source DIR``)."""

    path: Path
    sha256: str
    logical: str
    effective: str
    manifest: str
    initial_adapter: str
    final_adapter: str
    final_adapter_file: Path
    loss: float
    config: dict[str, Any]

    def config_value(self, dotted: str) -> Any:
        """The resolved source config value at ``dotted`` (``None`` when absent)."""
        return flatten(self.config).get(dotted)


@dataclass(frozen=True)
class Tolerances:
    """A predeclared tolerance file for the approximate claim."""

    path: Path
    sha256: str
    update_cosine_min: float
    relative_delta_l2_max: float


def discover(paths: Sequence[str | Path]) -> list[Path]:
    """Replay metric files named by ``paths``: files as given, directories searched at any depth
    (symbolic links to directories are not followed).  Sorted, each file once."""
    if not paths:
        raise RefusedError("no replay metrics given", hint="pass replay_metrics.json files or directories")
    found: dict[Path, None] = {}
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            found.setdefault(Path(os.path.abspath(p)), None)
        elif p.is_dir():
            hits = [Path(d) / REPLAY_FILE for d, _, names in os.walk(os.path.abspath(p)) if REPLAY_FILE in names]
            if not hits:
                raise RefusedError(f"no {REPLAY_FILE} below this directory", where=p,
                                   hint="point reduce at the replays' output directories")
            for h in hits:
                found.setdefault(h, None)
        else:
            raise RefusedError("replay metrics path not found", where=p, hint="check the path")
    return sorted(found)


def _read(path: Path) -> tuple[dict[str, Any], str]:
    data = read_regular_bytes(path, max_bytes=MAX_METRICS_BYTES, what="metrics file")
    doc = loads_strict(data, where=path)
    if not isinstance(doc, dict):
        raise IntegrityError(f"expected a JSON object, found {type(doc).__name__}", where=path)
    return doc, sha256_bytes(data)


class _Fields:
    """Typed access to one document's fields; every failure names the file and the key."""

    def __init__(self, doc: dict[str, Any], where: Path):
        self.doc, self.where = doc, where

    def fail(self, key: str, what: str) -> IntegrityError:
        return IntegrityError(f"field {key!r} {what}", where=self.where,
                              hint="the file does not follow docs/replay-metrics.md; rerun the replay")

    def get(self, key: str, obj: dict[str, Any] | None = None) -> Any:
        d = self.doc if obj is None else obj
        if key not in d:
            raise self.fail(key, "is missing")
        return d[key]

    def obj(self, key: str) -> dict[str, Any]:
        v = self.get(key)
        if not isinstance(v, dict):
            raise self.fail(key, "must be an object")
        return v

    def text(self, key: str, obj: dict[str, Any] | None = None, *, nonempty: bool = True) -> str:
        v = self.get(key, obj)
        if not isinstance(v, str) or (nonempty and not v):
            raise self.fail(key, "must be a non-empty string" if nonempty else "must be a string")
        return v

    def digest(self, key: str, obj: dict[str, Any] | None = None) -> str:
        v = self.get(key, obj)
        try:
            return normalize_digest(v, what=key)
        except IntegrityError as exc:
            raise self.fail(key, f"is not a SHA-256 digest ({exc.message})") from None

    def number(self, key: str, obj: dict[str, Any] | None = None, *, lo: float = 0.0,
               hi: float | None = None) -> float:
        v = self.get(key, obj)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(key, "must be a number")
        if v < lo or (hi is not None and v > hi):
            raise self.fail(key, f"is {v!r}, outside [{lo}, {hi if hi is not None else 'inf'}]")
        return float(v)

    def names(self, key: str) -> tuple[str, ...]:
        v = self.get(key)
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise self.fail(key, "must be a list of non-empty strings")
        return tuple(v)

    def adapter_file(self, key: str) -> Path:
        rel = self.text(key)
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
            raise self.fail(key, f"must be a relative path inside the run directory, found {rel!r}")
        return self.where.parent / pure


def _run_fields(f: _Fields) -> dict[str, Any]:
    """What a replay's metrics and the source's metrics.json both report (docs/replay-metrics.md)."""
    return {
        "logical": f.digest("optimizer/logical_batch_sha256"),
        "effective": f.digest("optimizer/local_effective_rows_sha256"),
        "manifest": f.digest("optimizer_batch/manifest_sha256"),
        "initial_adapter": f.digest("optimizer_batch/initial_adapter_sha256"),
        "final_adapter": f.digest("optimizer_batch/final_adapter_sha256"),
        "final_adapter_file": f.adapter_file("final_adapter_path"),
        "loss": f.number("loss", lo=-math.inf),
    }


def _placement(f: _Fields) -> dict[str, Any]:
    """The optional keys a budget decision reads: pin, schedule slot, device, in-process repeats."""
    d = f.doc
    out: dict[str, Any] = {}
    if d.get("budgets_sha256"):
        out["budgets_sha256"] = f.digest("budgets_sha256")
    if "device" in d:
        out["device"] = f.text("device", nonempty=False)
    memory = d.get("memory")
    if isinstance(memory, dict) and "kind" in memory:
        out["memory_kind"] = f.text("kind", memory)
    slot = d.get("schedule")
    if slot is not None:
        if not isinstance(slot, dict) or set(slot) != {"design", "seed", "block", "position"}:
            raise f.fail("schedule", "must be null or an object with design, seed, block and position")
        if slot["design"] not in DESIGNS:
            raise f.fail("schedule.design", f"must be one of {', '.join(DESIGNS)}")
        ints = [slot[k] for k in ("seed", "block", "position")]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints):
            raise f.fail("schedule", "seed, block and position must be integers >= 0")
        out["slot"] = Slot(slot["design"], *ints)
    ip = d.get("in_process")
    if ip is not None:
        walls = ip.get("local_train_wall_s") if isinstance(ip, dict) else None
        if (not isinstance(walls, list) or not walls or not isinstance(ip.get("loss_equal"), bool)
                or any(isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf
                       for w in walls)):
            raise f.fail("in_process", "must be null or hold a non-empty list local_train_wall_s of "
                                       "seconds and loss_equal")
        out["in_process_wall_s"] = tuple(float(w) for w in walls)
        out["in_process_loss_equal"] = ip["loss_equal"]
    return out


def read_replay(path: str | Path) -> Replay:
    """Read and validate one replay_metrics.json, or refuse naming the file and the field."""
    p = Path(path)
    doc, sha = _read(p)
    f = _Fields(doc, p)
    schema = f.get("schema")
    if schema != REPLAY_SCHEMA:
        raise IntegrityError(f"schema is {schema!r}, expected {REPLAY_SCHEMA!r}", where=p,
                             hint="reduce reads replay metrics written by `replayjob replay`")
    index = f.get("repeat_index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise f.fail("repeat_index", "must be an integer >= 0")
    pins = f.obj("pins")
    knobs = f.obj("knobs")
    framework = f.text("framework")
    if framework not in PRODUCERS:
        raise f.fail("framework", f"must be one of {list(PRODUCERS)}, found {framework!r}")
    runtime = f.obj("runtime")
    registered = sorted(knobs_for(framework))
    if sorted(runtime) != registered:
        raise f.fail("runtime", f"must hold the observed value of every registered knob of {framework!r} "
                                f"{registered}, found {sorted(runtime)}")
    rows = f.get("rows", f.obj("rows"))
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise f.fail("rows.rows", "must be an integer >= 1")
    arm = f.text("arm")
    if arm == "source":
        raise f.fail("arm", "may not be 'source', the name reduce gives the capture run")
    tol = f.text("tolerances_sha256", nonempty=False)
    host = f.obj("host")
    bad = sorted(k for k, v in host.items() if v is not None and not isinstance(v, str))
    if bad:
        raise f.fail(f"host.{bad[0]}", "must be a string or null")
    measures = {}
    for name, (section, key) in MEASURES.items():
        hi = 1.0 if name == "padding_fraction" else None
        measures[name] = f.number(key, f.obj(section), hi=hi)
    return Replay(
        path=p, sha256=sha, arm=arm, repeat_index=index, framework=framework,
        pin_logical=f.digest("expected_logical_sha256", pins),
        pin_manifest=f.digest("expected_manifest_sha256", pins),
        pin_payload=f.digest("payload_spans_sha256", pins), **_run_fields(f),
        allowed=f.names("allowed_config_differences"),
        observed=f.names("observed_config_differences"),
        knobs=knobs, skipped=f.names("skipped"), runtime=runtime, rows=rows,
        tolerances_sha256=f.digest("tolerances_sha256") if tol else "", measures=measures, host=host,
        trace_index_sha256=_trace_pin(f),
        **_placement(f),
    )


def _trace_pin(f: _Fields) -> str | None:
    """``trace.index_sha256`` of a traced replay (its index lies at ``trace.index_path``), else ``None``."""
    if "trace" not in f.doc:
        return None
    t = f.obj("trace")
    if f.text("index_path", t) != "trace/index.json":
        raise f.fail("trace.index_path", "must be 'trace/index.json'")
    return f.digest("index_sha256", t)


def read_source(directory: str | Path) -> Source:
    """Read and validate the capture run's metrics.json in ``directory``."""
    d = Path(directory)
    p = d / SOURCE_FILE
    if not p.is_file():
        raise RefusedError(f"no {SOURCE_FILE} in the source directory", where=d,
                           hint="--source takes the capture run's output directory")
    doc, sha = _read(p)
    f = _Fields(doc, p)
    config = f.obj("config")
    return Source(path=p, sha256=sha, **_run_fields(f), config=config)


def read_tolerances(path: str | Path) -> Tolerances:
    """Read a tolerance file: TOML with exactly ``update_cosine_min`` and ``relative_delta_l2_max``."""
    p = Path(path)
    data = read_regular_bytes(p, max_bytes=1024 * 1024, what="tolerance file")
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise IntegrityError(f"not a valid TOML tolerance file: {exc}", where=p) from None
    keys = {"update_cosine_min", "relative_delta_l2_max"}
    unknown = sorted(set(doc) - keys)
    missing = sorted(keys - set(doc))
    if unknown or missing:
        raise IntegrityError(f"tolerance keys: unknown {unknown}, missing {missing}", where=p,
                             hint="write update_cosine_min = 0.99 and relative_delta_l2_max = 0.1")
    values = {}
    for k in sorted(keys):
        v = doc[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise IntegrityError(f"{k} must be a finite number", where=p)
        values[k] = float(v)
    if not -1.0 <= values["update_cosine_min"] <= 1.0 or values["relative_delta_l2_max"] < 0.0:
        raise IntegrityError("update_cosine_min must be in [-1, 1], relative_delta_l2_max >= 0", where=p)
    return Tolerances(p, sha256_bytes(data), values["update_cosine_min"], values["relative_delta_l2_max"])
