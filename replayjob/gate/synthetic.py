"""Synthetic evidence for the reducer's tests and benchmark: a source run and replays, on disk.

Files follow ``docs/replay-metrics.md`` key for key; the source directory holds a capture manifest
built and validated by :mod:`replayjob.artifacts.capture_manifest` (its ``outcome`` sealing the source's loss,
gradient norm and final adapter digest), a ``metrics.json`` and a final adapter.
Everything is a pure function of the arguments (no clock, no absolute path inside a file), so two
builds in different directories give the same bytes.  Adapter contents are the caller's bytes:
valid safetensors files, since reduce checks every final adapter's header (:func:`adapter_file` builds
one from any bytes without torch; real tensors when update geometry matters).

Example:
    >>> import tempfile
    >>> ev = build(Path(tempfile.mkdtemp()), {"off": {}, "on": {GC_KEY: True}}, 3)
    >>> len(ev.replay_files), ev.replay_files[0].name
    (6, 'replay_metrics.json')
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayjob.artifacts import capture_manifest as mf
from replayjob.artifacts.metrics import (
    EFFECTIVE,
    FINAL_ADAPTER,
    FINAL_ADAPTER_PATH,
    INITIAL_ADAPTER,
    LOGICAL,
    MANIFEST,
    MANIFEST_PATH,
    REPLAY_FILE,
    SOURCE_FILE,
    replay_document,
    source_document,
)
from replayjob.artifacts.schedule import plan
from replayjob.digest import sha256_bytes, sha256_file
from replayjob.jsonio import pretty_bytes
from replayjob.rl.state import ADAPTER_WEIGHTS, FINAL_ADAPTER_FILE
from replayjob.runtime.knobs import BUILTIN, knobs_for, lookup
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY
from replayjob.tensorfile import ITEMSIZE

ADAPTER = FINAL_ADAPTER_FILE
SOURCE_GRAD_NORM = 0.25  # the source update's gradient norm (sealed in the manifest with its loss and final adapter)
SOURCE_CONFIG: dict[str, Any] = {
    "backend": {"options": {"attn_implementation": "eager", "gradient_checkpointing": False}},
    "training": {"micro_batch_size": 4, "trainer": "grpo"},
}


def adapter_file(data: bytes, *, tensors: int = 1, dtype: str = "U8") -> bytes:
    """A valid safetensors file (built without torch) whose data section is ``data``, split evenly into
    ``tensors`` one-dimensional tensors of ``dtype``: an adapter that passes reduce's header check, its
    digest decided by ``data``."""
    item = ITEMSIZE[dtype]
    if tensors < 1 or len(data) % (tensors * item):
        raise ValueError(f"{len(data)} bytes do not split into {tensors} tensors of {dtype}")
    per = len(data) // tensors
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i in range(tensors):
        header[f"base_model.model.layers.{i // 2}.lora_{'AB'[i % 2]}.weight"] = {
            "dtype": dtype, "shape": [per // item], "data_offsets": [i * per, (i + 1) * per]}
    text = json.dumps(header, separators=(",", ":")).encode("ascii")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


INITIAL = adapter_file(b"initial adapter weights")
FINAL = adapter_file(b"final adapter weights")


def digest_of(text: str) -> str:
    """A stable stand-in digest for a named artifact."""
    return sha256_bytes(text.encode("utf-8"))


@dataclass
class Evidence:
    root: Path
    source: Path
    manifest_sha256: str
    initial_adapter: Path
    replay_files: list[Path] = field(default_factory=list)


AdapterBytes = Callable[[str, int], bytes]


def _put(path: Path, data: bytes) -> None:
    """Plain write (test fixtures need no crash safety, and a thousand fsyncs are slow)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _measures(seed: int, arm: str, index: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """Timing, peak memory and padding of one replay: stable noise from (seed, arm, index); gradient
    checkpointing trades backward time for memory."""
    rng = random.Random(f"{seed}:{arm}:{index}")
    ckpt = bool(knobs.get(GC_KEY, False))
    noise = [1.0 + (rng.random() - 0.5) * 0.1 for _ in range(5)]
    fwd, bwd, opt = 0.30 * noise[0], 0.50 * (1.5 if ckpt else 1.0) * noise[1], 0.10 * noise[2]
    real, padded = 480, 544
    return {
        "timing": {"local_train_wall_s": fwd + bwd + opt + 0.05 * noise[3], "forward_wall_s": fwd,
                   "backward_wall_s": bwd, "optimizer_wall_s": opt},
        "peak": int(1_000_000_000 * (0.7 if ckpt else 1.0) * noise[4]),
        "padding": {"real_tokens": real, "padded_tokens": padded, "padding_fraction": 1 - real / padded,
                    "micro_batches": 4},
    }


def runtime_of(knobs: dict[str, Any], rows: int = 16) -> dict[str, Any]:
    """What a replay of an arm with ``knobs`` observes at run time: every registered knob of the built-in
    trainer in effect."""
    registered = knobs_for(BUILTIN)
    intent = {k: knobs[k] if k in knobs else lookup(SOURCE_CONFIG, k) for k in sorted(registered)}
    return {k: registered[k].expected(v, rows, intent) for k, v in intent.items()}


def replay_doc(*, arm: str, index: int, knobs: dict[str, Any], manifest_sha256: str, initial_sha256: str,
               final_sha256: str, loss: float, seed: int = 0, tolerances_sha256: str = "") -> dict[str, Any]:
    """One replay_metrics.json document: :func:`replayjob.artifacts.metrics.replay_document` and what the replay
    driver adds to it (final adapter, provenance, wall time)."""
    doc = replay_document(
        framework=BUILTIN, arm=arm, repeat_index=index,
        pins={"expected_logical_sha256": digest_of("logical"), "expected_manifest_sha256": manifest_sha256,
              "payload_spans_sha256": digest_of("payload")},
        manifest_sha256=manifest_sha256, logical=digest_of("logical"), effective=digest_of("effective"),
        initial_adapter_sha256=initial_sha256, allowed=sorted(knobs), observed=sorted(knobs),
        knob_values=dict(knobs), runtime=runtime_of(knobs), loss=loss, grad_norm=SOURCE_GRAD_NORM,
        **_measures(seed, arm, index, knobs), device="cpu", torch_version="2.4.0",
        host={"node": f"node-{index}", "pod": None, "slurm_job": None, "image_ref": None, "image_digest": None,
              "device_type": "cpu", "gpu_product": None, "gpu_uuid": None, "driver_version": None,
              "cuda_version": None, "torch_version": "2.13.0", "cuda_visible_devices": None,
              "cpu_model": "synthetic"},
        rows={"rows": 16, "tokens": 544, "response_tokens": 128, "loss_bearing_tokens": 128, "loss_weight_sum": 1.0},
        rng_restored=["cpu"], tolerances_sha256=tolerances_sha256, budgets_sha256="",
        config_sha256=digest_of(f"config:{sorted(knobs.items())}"), step=0)
    doc.update({FINAL_ADAPTER: final_sha256, FINAL_ADAPTER_PATH: ADAPTER, "wall_s": 2.0,
                "provenance": {"strict_deterministic": True, "math_mode": "pedantic", "device": "cpu"}})
    return doc


def _write_source(root: Path, initial: bytes, final: bytes, loss: float) -> tuple[Path, str, Path]:
    init_file = root / "init_resume" / ADAPTER_WEIGHTS
    _put(init_file, initial)
    src = root / "source"
    payload = b"synthetic optimizer batch payload"
    _put(src / mf.payload_name(0), payload)
    doc = mf.build(step=0, producer={"replayjob_version": "0.1.0"}, payload_file=mf.payload_name(0),
                   payload_size=len(payload), payload_digest=digest_of("payload"), rng_keys=["cpu"],
                   rows={"rows": 16, "tokens": 544, "response_tokens": 128, "loss_bearing_tokens": 128,
                         "loss_weight_sum": 1.0},
                   logical=digest_of("logical"), effective=digest_of("effective"),
                   resolved_config=SOURCE_CONFIG, contract={"schema": "synthetic"},
                   adapter_path=Path("..") / "init_resume" / ADAPTER_WEIGHTS,
                   adapter_size=len(initial), adapter_sha256=sha256_bytes(initial),
                   sealed=mf.outcome(loss, SOURCE_GRAD_NORM, sha256_bytes(final)))
    manifest_sha = mf.write(src / mf.manifest_name(0), doc)
    _put(src / ADAPTER, final)
    metrics = source_document(  # the built-in trainer's metrics.json, then what its capture hook adds
        trainer="grpo", torch_version="2.4.0", device="cpu", steps_run=1, last_step=0, loss=loss,
        grad_norm=SOURCE_GRAD_NORM, initial_adapter_sha256=sha256_bytes(initial),
        final_adapter_sha256=sha256_bytes(final), final_adapter_path=ADAPTER,
        config_sha256=digest_of("source config"), config=SOURCE_CONFIG,
        provenance={"strict_deterministic": True, "math_mode": "pedantic", "device": "cpu"}, wall_s=2.0)
    metrics.update({LOGICAL: digest_of("logical"), EFFECTIVE: digest_of("effective"), MANIFEST: manifest_sha,
                    INITIAL_ADAPTER: sha256_bytes(initial), FINAL_ADAPTER: sha256_bytes(final),
                    MANIFEST_PATH: mf.manifest_name(0)})
    _put(src / SOURCE_FILE, pretty_bytes(metrics))
    return src, manifest_sha, init_file


def build(root: Path, arms: dict[str, dict[str, Any]], repeats: int | dict[str, int], *,
          initial: bytes = INITIAL, final: bytes | AdapterBytes = FINAL,
          source_final: bytes | None = None, loss: float = 0.5, seed: int = 0,
          tolerances_sha256: str = "") -> Evidence:
    """Write a source run and ``repeats`` replays per arm (``arms`` maps arm name -> declared knobs)."""
    def final_of(arm: str, i: int) -> bytes:
        return final(arm, i) if callable(final) else final

    src_final = source_final if source_final is not None else final_of("", -1)
    src, manifest_sha, init_file = _write_source(root, initial, src_final, loss)
    ev = Evidence(root, src, manifest_sha, init_file)
    for arm, knobs in arms.items():
        n = repeats[arm] if isinstance(repeats, dict) else repeats
        for i in range(n):
            d = root / "replays" / arm.replace("=", "-") / f"repeat-{i:03d}"
            data = final_of(arm, i)
            _put(d / ADAPTER, data)
            doc = replay_doc(arm=arm, index=i, knobs=knobs, manifest_sha256=manifest_sha,
                             initial_sha256=sha256_bytes(initial), final_sha256=sha256_bytes(data),
                             loss=loss, seed=seed, tolerances_sha256=tolerances_sha256)
            _put(d / REPLAY_FILE, pretty_bytes(doc))
            ev.replay_files.append(d / REPLAY_FILE)
    return ev


def paired(root: Path, arms: dict[str, dict[str, Any]], walls: dict[str, list[float]], *,
           budgets: Path | None = None, hosts: dict[str, list[str]] | None = None, slots: bool = True,
           edit: Callable[[dict[str, Any], str, int], None] | None = None) -> Evidence:
    """Evidence of ``arms`` (:func:`build`) run as a seeded ABBA schedule with ``walls[arm][block]`` as each
    replay's step time, every replay on ``hosts[arm][block]`` (one node by default), pinned to ``budgets``;
    ``edit(doc, arm, block)`` changes each replay's document further before it is written."""
    names = list(arms)
    n = len(walls[names[0]])
    ev = build(root, arms, n)
    order = {(arm, s.block): s for arm, s in plan(names, n, "abba", seed=5)}
    for f in ev.replay_files:
        doc = json.loads(f.read_text())
        arm, i = doc["arm"], doc["repeat_index"]
        timing = doc["timing"]  # the parts scaled with the whole, which they are parts of; the run around it
        timing.update({k: v * walls[arm][i] / timing["local_train_wall_s"] for k, v in timing.items()})
        timing["local_train_wall_s"] = walls[arm][i]
        doc["schedule"] = order[(arm, i)].to_json() if slots else None
        doc["host"]["node"] = (hosts or {}).get(arm, ["node-a"] * n)[i]
        doc["budgets_sha256"] = sha256_file(budgets) if budgets is not None else ""
        if edit is not None:
            edit(doc, arm, i)
        doc["wall_s"] = max(doc["wall_s"], doc["timing"]["local_train_wall_s"] + 1.0)  # the run around the update
        f.write_bytes(pretty_bytes(doc))
    return ev

