"""The manifest of an external trainer's capture: what pins one optimizer step, written last.

The one capture manifest schema (:data:`replayjob.artifacts.capture_manifest.SCHEMA`) as the capture API writes it
(``framework`` one of replayjob.producers.EXTERNAL; canonical JSON, one object)::

    schema, framework, step      producer framework (one of replayjob.producers.EXTERNAL), 0-based step
    producer                     replayjob, python, device, versions of the stack, determinism snapshot
    files                        payload, adapter, optimizer: each {file (bare name), size, sha256}
    micro_batches                per micro-batch, in the order the loss saw them: inputs and call,
                                 each {tensors: {name: {dtype, shape}}, values: {name: JSON}}; rng
                                 (the Torch RNG states taken right before the loss call);
                                 sync_gradients; accumulation_steps
    optimizer                    param_groups, per-parameter non-tensor state, the tensor keys in
                                 the optimizer file, and the LR scheduler's state (or null)
    trainable                    names of the trainable (adapter) parameters, in optimizer order
    framework_state              what the framework needs to stand its trainer at this step
    rows                         micro_batches, tensors, elements, bytes of the captured inputs, and
                                 nonfinite_inputs (a float input holds NaN/Inf: replayed only under
                                 optimizer_batch.allow_nonfinite_inputs)
    logical_batch_sha256         digest of every input of every micro-batch (capture.logical_digest)
    local_effective_rows_sha256  the same plus each micro-batch's RNG and accumulation settings
    config                       resolved (redacted) and its sha256: {<framework>, model, peft, stack}
    contract                     what defines the update's math (redacted) and its sha256
    base_model                   path, files {name: sha256} (config and safetensors weights), sha256
    outcome                      the real update as it returned: loss, grad_norm (null when not finite or
                                 not given) and final_adapter_sha256 (the adapter after it, in the bytes
                                 save_adapter writes); what reduce compares metrics.json's numbers with
                                 (absent only in captures written before it)

The payload holds ``mb0000.inputs.<key>``, ``mb0000.call.<key>`` and ``mb0000.rng.<cpu|cuda.N>``;
the adapter file the trainable parameters by name just before the step; the optimizer file
``state.<index>.<key>``.  A reader hashes the manifest's bytes against the pin before parsing
(:func:`replayjob.artifacts.capture_manifest.read_pinned`), then checks every field; unknown keys are refused.
A step captured over several processes has one such manifest per process (in ``rank-<r>/``) and a root of
the same schema that lists them in ``ranks`` (:mod:`replayjob.producers.api.parts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.artifacts.capture_manifest import (
    OUTCOME,
    SCHEMA,
    PinnedManifest,
    check_schema,
    file_stem,
    is_int,
    need,
    need_hex,
    read_pinned,
    validate_outcome,
    validate_pins,
)
from replayjob.artifacts.capture_root import landed_name, rank_dir, ranks_digest
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.errors import IntegrityError
from replayjob.frameworks import EXTERNAL
from replayjob.fsio import atomic_write_bytes, check_no_symlinks, read_regular_bytes
from replayjob.jsonio import canonical_bytes, loads_strict

FILES = ("payload", "adapter", "optimizer")
_KEYS = {"schema", "framework", "step", "producer", "files", "micro_batches", "optimizer", "trainable",
         "framework_state", "rows", "logical_batch_sha256", "local_effective_rows_sha256", "config",
         "contract", "base_model"}


def file_names(step: int) -> dict[str, str]:
    """The capture's file names for ``step``: payload, adapter, optimizer and the manifest."""
    stem = file_stem(step)
    return {"payload": f"{stem}.safetensors", "adapter": f"{stem}.adapter.safetensors",
            "optimizer": f"{stem}.optimizer.safetensors", "manifest": f"{stem}.manifest.json"}


@dataclass(frozen=True)
class Manifest(PinnedManifest):
    """A verified integration capture manifest."""

    @property
    def step(self) -> int:
        return int(self.doc["step"])

    def file(self, role: str) -> Path:
        return self.path.parent / str(self.doc["files"][role]["file"])

    def file_sha256(self, role: str) -> str:
        return str(self.doc["files"][role]["sha256"])

    @property
    def initial_adapter_sha256(self) -> str:
        return self.file_sha256("adapter")

    @property
    def payload_digest(self) -> str:
        """The payload pin replays record (``pins.payload_spans_sha256``): the payload file's SHA-256."""
        return self.file_sha256("payload")

    @property
    def micro_batches(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.doc["micro_batches"]
        return out


def build(*, framework: str, step: int, producer: dict[str, Any], files: dict[str, dict[str, Any]],
          micro_batches: list[dict[str, Any]], optimizer: dict[str, Any], trainable: list[str],
          framework_state: dict[str, Any], rows: dict[str, Any], logical: str, effective: str,
          config: dict[str, Any], contract: dict[str, Any], base_model: dict[str, Any],
          sealed: dict[str, Any]) -> dict[str, Any]:
    """One process's capture manifest document (nothing is written; :func:`write` validates and writes it);
    ``sealed`` its ``outcome`` (:func:`replayjob.artifacts.capture_manifest.outcome`)."""
    return {"schema": SCHEMA, "framework": framework, "step": step, "producer": producer, "files": files,
            "micro_batches": micro_batches, "optimizer": optimizer, "trainable": trainable,
            "framework_state": framework_state, "rows": rows, "logical_batch_sha256": logical,
            "local_effective_rows_sha256": effective, "config": {"sha256": sha256_json(config), "resolved": config},
            "contract": {"sha256": sha256_json(contract), "value": contract}, "base_model": base_model,
            OUTCOME: sealed}


def write(path: Path, doc: dict[str, Any]) -> str:
    """Validate, then write the manifest atomically and exclusively; return its SHA-256."""
    validate(doc, path)
    data = canonical_bytes(doc) + b"\n"
    atomic_write_bytes(path, data, exclusive=True)
    return sha256_bytes(data)


def _bare(name: Any, what: str, where: Path) -> None:
    need(isinstance(name, str) and name == Path(name).name and not name.startswith(".")
          and "\\" not in name and name not in ("", ".."), f"{what} must be a bare file name, found {name!r}",
          where)


def _group(g: Any, what: str, where: Path) -> None:
    need(isinstance(g, dict) and set(g) == {"tensors", "values"} and isinstance(g["tensors"], dict)
          and isinstance(g["values"], dict), f"{what} needs objects 'tensors' and 'values'", where)
    for name, spec in g["tensors"].items():
        need(isinstance(spec, dict) and set(spec) == {"dtype", "shape"} and isinstance(spec["dtype"], str)
              and isinstance(spec["shape"], list) and all(is_int(n) and n >= 0 for n in spec["shape"]),
              f"{what}.tensors.{name} needs dtype and a shape of non-negative integers", where)
    need(not set(g["tensors"]) & set(g["values"]), f"{what}: a key is both a tensor and a value", where)


def validate(doc: Any, where: Path) -> dict[str, Any]:
    """Check every field's presence and type, and recompute the embedded digests."""
    check_schema(doc, where)
    need(doc["framework"] in EXTERNAL, f"'framework' must be one of {list(EXTERNAL)} in a capture API manifest, "
         f"found {str(doc['framework'])[:40]!r}", where)
    keys = _KEYS | {OUTCOME}  # every capture of this schema seals its outcome (reduce compares with it)
    need(OUTCOME in doc, f"'{OUTCOME}' is missing: the capture was written by an earlier release and seals "
         "none of the numbers reduce compares with; capture the step again", where)
    need(set(doc) == keys, f"keys must be exactly {sorted(keys)}; unknown {sorted(set(doc) - keys)}, "
          f"missing {sorted(keys - set(doc))}", where)
    validate_outcome(doc, where)
    need(is_int(doc["step"]) and doc["step"] >= 0, "'step' must be an integer >= 0", where)
    for sec in ("producer", "files", "optimizer", "framework_state", "rows", "config", "contract", "base_model"):
        need(isinstance(doc[sec], dict), f"'{sec}' must be an object", where)
    flag = doc["rows"].get("nonfinite_inputs", False)  # absent in captures written before the flag: false
    need(isinstance(flag, bool), "'rows.nonfinite_inputs' must be true or false", where)
    files = doc["files"]
    need(set(files) == set(FILES), f"'files' needs exactly {list(FILES)}", where)
    # the step names every file of the capture, its manifest included: a relabelled step is a contradiction
    named = file_names(doc["step"])
    need(where.name == named["manifest"], f"'step' is {doc['step']}, but the manifest is {where.name!r} (step "
         f"{doc['step']}'s is {named['manifest']!r})", where)
    for role in FILES:
        need(isinstance(files[role], dict) and files[role].get("file") == named[role], f"files.{role}.file must be "
             f"{named[role]!r}, the name of step {doc['step']}'s {role}", where)
    seen = doc["framework_state"].get("global_step", doc["step"])  # a trainer that records its own step counter
    need(seen == doc["step"], f"'step' is {doc['step']}, but framework_state.global_step is {seen!r}", where)
    # an LR scheduler stepped with the optimizer (optimizer_step, Trainer) has stepped at most once per step before
    # this one (fewer where a loss scaler skipped a step); a producer stepping it otherwise keeps it elsewhere
    sched = doc["optimizer"].get("scheduler")
    epoch = sched.get("last_epoch", 0) if isinstance(sched, dict) else 0
    need(not is_int(epoch) or epoch <= doc["step"], f"'step' is {doc['step']}, but the captured LR scheduler has "
         f"already stepped {epoch!r} time(s) (optimizer.scheduler.last_epoch)", where)
    for role in FILES:
        f = files[role]
        need(isinstance(f, dict) and set(f) == {"file", "size", "sha256"}, f"'files.{role}' needs file, size, "
              "sha256", where)
        _bare(f["file"], f"files.{role}.file", where)
        need(str(f["file"]).endswith(".safetensors"), f"files.{role}.file must be a .safetensors file", where)
        need(is_int(f["size"]) and f["size"] > 0, f"files.{role}.size must be a positive integer", where)
        need_hex(f["sha256"], f"files.{role}.sha256", where)
    mbs = doc["micro_batches"]
    need(isinstance(mbs, list) and len(mbs) > 0, "'micro_batches' must be a non-empty list", where)
    for i, mb in enumerate(mbs):
        w = f"micro_batches[{i}]"
        need(isinstance(mb, dict) and set(mb) == {"inputs", "call", "rng", "sync_gradients", "accumulation_steps"},
              f"{w} needs inputs, call, rng, sync_gradients, accumulation_steps", where)
        _group(mb["inputs"], f"{w}.inputs", where)
        _group(mb["call"], f"{w}.call", where)
        need(isinstance(mb["rng"], list) and "cpu" in mb["rng"] and all(isinstance(k, str) for k in mb["rng"]),
              f"{w}.rng must list 'cpu'", where)
        need(isinstance(mb["sync_gradients"], bool), f"{w}.sync_gradients must be true or false", where)
        need(is_int(mb["accumulation_steps"]) and mb["accumulation_steps"] >= 1,
              f"{w}.accumulation_steps must be an integer >= 1", where)
    opt = doc["optimizer"]
    need(set(opt) == {"param_groups", "state", "tensors", "scheduler"} and isinstance(opt["param_groups"], list)
          and isinstance(opt["state"], dict) and isinstance(opt["tensors"], dict)
          and (opt["scheduler"] is None or isinstance(opt["scheduler"], dict)),
          "'optimizer' needs param_groups (list), state, tensors (objects), scheduler (object or null)", where)
    tr = doc["trainable"]
    need(isinstance(tr, list) and len(tr) > 0 and all(isinstance(n, str) and n for n in tr)
          and len(set(tr)) == len(tr), "'trainable' must list distinct parameter names", where)
    validate_pins(doc, where)
    bm = doc["base_model"]
    need(set(bm) == {"path", "files", "sha256"} and isinstance(bm["path"], str) and isinstance(bm["files"], dict)
          and len(bm["files"]) > 0, "'base_model' needs path, files (non-empty object), sha256", where)
    for name, digest in bm["files"].items():
        _bare(name, "base_model.files key", where)
        need_hex(digest, f"base_model.files.{name}", where)
    need_hex(bm["sha256"], "base_model.sha256", where)
    need(sha256_json(bm["files"]) == bm["sha256"], "'base_model.sha256' does not match its files", where)
    return doc


def read_verified(path: str | Path, expected_sha256: str) -> Manifest:
    """Hash the manifest bytes, compare with the pin, and only then parse and validate them."""
    p, actual, doc = read_pinned(path, expected_sha256,
                                 hint="point optimizer_batch.replay_path at the capture's "
                                      "optimizer_batch_step_<K>.manifest.json (its replay.toml has it)")
    return Manifest(p, actual, validate(doc, p))


# ------------------------------------------------------------------------------------- a root over processes
_ROOT_KEYS = {"schema", "framework", "step", "world_size", "ranks", "payload_sha256", "rows", "logical_batch_sha256",
         "local_effective_rows_sha256", "config", "contract", "base_model", "framework_state", "trainable",
         "optimizer", OUTCOME}
_ROOT_RANK_KEYS = {"rank", "dir", "manifest_sha256", "logical_batch_sha256", "micro_batches"}
_SAME = ("adapter", "optimizer")  # files every part holds with the same bytes (the ranks start equal)




@dataclass(frozen=True)
class RootManifest(Manifest):
    """The root of a capture over several processes, with every part verified (``parts``, in rank order).

    It reads as one capture: its files are process 0's (the initial adapter and optimizer state every part
    shares), its micro-batches every part's in rank order, its payload pin :data:`payload_sha256`."""

    parts: tuple[Manifest, ...] = ()

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


def processes(m: Manifest | None) -> int:
    """How many processes ran the captured step (1 for a one-process capture)."""
    return m.world_size if isinstance(m, RootManifest) else 1


def check_parts(parts: list[Manifest]) -> None:
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


def read_capture(path: str | Path, expected_sha256: str) -> Manifest:
    """The manifest at ``path`` pinned by ``expected_sha256``: a one-process capture's (as
    :func:`replayjob.artifacts.api_manifest.read_verified`), or a root with every part verified."""
    p, sha, doc = read_pinned(path, expected_sha256,
                              hint="point optimizer_batch.replay_path at the capture's "
                                   "optimizer_batch_step_<K>.manifest.json (its replay.toml has it)")
    return of(p, sha, doc)


def of(p: Path, sha: str, doc: Any) -> Manifest:
    """A capture API manifest whose bytes matched their pin: one process's (validated), or a root (it lists
    ``ranks``) with every part verified."""
    if not (isinstance(doc, dict) and "ranks" in doc):
        return Manifest(p, sha, validate(doc, p))
    validate_root(doc, p)
    d, world = p.parent, int(doc["world_size"])
    _check_listing(d, world)
    parts = []
    for e in doc["ranks"]:
        _check_landed(d, e["rank"], world, e["manifest_sha256"])
        where = check_no_symlinks(d, d / e["dir"] / p.name, what=f"process {e['rank']}'s manifest")
        part = read_verified(where, e["manifest_sha256"])
        if part.logical_sha256 != e["logical_batch_sha256"] or len(part.micro_batches) != e["micro_batches"]:
            raise IntegrityError(f"process {e['rank']}'s part does not match the root's record", where=where)
        _check_part_files(d, part, e["rank"])
        parts.append(part)
    check_parts(parts)
    first = parts[0]
    for k in ("config", "contract", "base_model", "framework_state", "trainable", "optimizer", OUTCOME):
        if doc[k] != first.doc[k]:
            raise IntegrityError(f"the root's {k} is not process 0's", where=p)
    if doc["framework"] != first.framework or doc["step"] != first.step:
        raise IntegrityError("the root's framework or step is not process 0's", where=p)
    if doc["payload_sha256"] != ranks_digest([m.payload_digest for m in parts]):
        raise IntegrityError("the root's payload_sha256 is not the digest of its parts' payloads", where=p)
    return RootManifest(p, sha, doc, tuple(parts))


def _check_part_files(d: Path, part: Manifest, rank: int) -> None:
    """Every file a part pins, whether or not a replay reads it (the initial adapter and optimizer state are read
    from process 0's part only): inside the capture, reached through no symbolic link, a regular file of its
    pinned size."""
    for role, spec in sorted(part.doc["files"].items()):
        f = check_no_symlinks(d, part.file(role), what=f"process {rank}'s {role} file")
        try:
            size = f.stat().st_size if f.is_file() else None
        except OSError:
            size = None
        if size is None:
            raise IntegrityError(f"process {rank}'s {role} file is missing (or not a regular file)", where=f,
                                 hint="keep every part of the capture together, as it was written")
        if size != spec["size"]:
            raise IntegrityError(f"process {rank}'s {role} file is {size} bytes, its manifest pins {spec['size']}",
                                 where=f, hint="the file changed after capture; capture the step again")


def build_root(parts: list[Manifest], micro_batches: list[int], *, rows: dict[str, Any], logical: str,
               effective: str) -> dict[str, Any]:
    """The root document over verified ``parts`` (process 0 first; ``micro_batches`` per part), with the
    digests over every part's micro-batches in rank order; what every part shares is process 0's."""
    first = parts[0]
    return {
        "schema": SCHEMA, "framework": first.framework, "step": first.step, "world_size": len(parts),
        "ranks": [{"rank": r, "dir": rank_dir(r), "manifest_sha256": p.sha256,
                   "logical_batch_sha256": p.logical_sha256, "micro_batches": n}
                  for r, (p, n) in enumerate(zip(parts, micro_batches, strict=True))],
        "payload_sha256": ranks_digest([p.payload_digest for p in parts]),
        "rows": rows, "logical_batch_sha256": logical, "local_effective_rows_sha256": effective,
        **{k: first.doc[k] for k in ("config", "contract", "base_model", "framework_state", "trainable",
                                     "optimizer", OUTCOME)},
    }


def validate_root(doc: Any, where: Path) -> dict[str, Any]:
    """The root's own fields (:func:`of` checks the parts)."""
    check_schema(doc, where)
    need(set(doc) == _ROOT_KEYS, f"keys must be exactly {sorted(_ROOT_KEYS)}; unknown {sorted(set(doc) - _ROOT_KEYS)}, "
         f"missing {sorted(_ROOT_KEYS - set(doc))}", where)
    validate_outcome(doc, where)
    validate_pins(doc, where)
    need(doc["framework"] in EXTERNAL, f"'framework' must be one of {list(EXTERNAL)} in a capture API root", where)
    need(is_int(doc["step"]) and doc["step"] >= 0, "'step' must be an integer >= 0", where)
    world = doc["world_size"]
    need(is_int(world) and world >= 2, "'world_size' must be an integer >= 2", where)
    ranks = doc["ranks"]
    need(isinstance(ranks, list) and len(ranks) == world, "'ranks' must list one entry per process", where)
    for r, e in enumerate(ranks):
        need(isinstance(e, dict) and set(e) == _ROOT_RANK_KEYS and e["rank"] == r and e["dir"] == rank_dir(r)
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
