"""The manifest of an external trainer's capture: what pins one optimizer step, written last.

Schema ``replayjob.integration_capture/v1`` (canonical JSON, one object)::

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
(:func:`replayjob.optbatch.manifest.read_pinned`), then checks every field; unknown keys are refused.
A step captured over several processes has one such manifest per process (in ``rank-<r>/``) and a root of
schema :data:`RANKS_SCHEMA` (:mod:`replayjob.integrations.ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.digest import sha256_bytes, sha256_json
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import canonical_bytes
from replayjob.optbatch.manifest import (
    OUTCOME,
    PinnedManifest,
    file_stem,
    is_int,
    need,
    need_hex,
    read_pinned,
    validate_outcome,
    validate_pins,
)

SCHEMA = "replayjob.integration_capture/v1"
RANKS_SCHEMA = "replayjob.integration_ranks/v1"  # the root of a capture over several processes (integrations.ranks)
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
    def framework(self) -> str:
        return str(self.doc["framework"])

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
    need(isinstance(doc, dict), "document must be a JSON object", where)
    need(doc.get("schema") == SCHEMA, f"'schema' must be {SCHEMA!r}, found {doc.get('schema')!r}", where)
    keys = _KEYS | {OUTCOME}  # every capture of this schema seals its outcome (reduce compares with it)
    need(OUTCOME in doc, f"'{OUTCOME}' is missing: the capture was written by an earlier release and seals "
         "none of the numbers reduce compares with; capture the step again", where)
    need(set(doc) == keys, f"keys must be exactly {sorted(keys)}; unknown {sorted(set(doc) - keys)}, "
          f"missing {sorted(keys - set(doc))}", where)
    validate_outcome(doc, where)
    need(isinstance(doc["framework"], str) and doc["framework"] != "", "'framework' must be a name", where)
    need(is_int(doc["step"]) and doc["step"] >= 0, "'step' must be an integer >= 0", where)
    for sec in ("producer", "files", "optimizer", "framework_state", "rows", "config", "contract", "base_model"):
        need(isinstance(doc[sec], dict), f"'{sec}' must be an object", where)
    flag = doc["rows"].get("nonfinite_inputs", False)  # absent in captures written before the flag: false
    need(isinstance(flag, bool), "'rows.nonfinite_inputs' must be true or false", where)
    files = doc["files"]
    need(set(files) == set(FILES), f"'files' needs exactly {list(FILES)}", where)
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
