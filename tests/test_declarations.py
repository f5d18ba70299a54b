"""Every declared document (``replayjob.artifacts``) is fuzzed from its declaration.

Two properties, for every :class:`~replayjob.declaration.Document` in the package:

* **Nothing is left open.** Every number is bounded (integers within 64 bits, floats finite), nothing is
  typed ``Any``: a field added without its range fails here, before an attack finds it.
* **Every field refuses what it must.** From one valid document per declaration, each field in turn is
  replaced by values its declared type must refuse (a bool or a float where an integer is declared, a
  string for a number, NaN and the infinities, one past each bound, ``null`` where it is not allowed, a
  wrong schema), removed when it is required, and an unknown key is added: each is refused by
  :func:`~replayjob.declaration.decode` with an :class:`IntegrityError` naming the file and the field.
  Hypothesis then mutates nested values (lists, mappings, sub-documents) at random the same way.

The mutations are chosen from the field's declared type, never filtered by trying them: the first property
fails on a declaration weakened to an unbounded type, the second on a reader that does not enforce what is
declared.  The documents' summaries (a flag or rate recomputed from its figures) are refused through the same
path; their own cases are in the tests of each document (test_contention.py, test_optbatch.py).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import math
import pkgutil
import sys
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import replayjob.artifacts
from replayjob.artifacts.cluster_status import Stuck, stopped_record
from replayjob.artifacts.run_end import run_end
from replayjob.declaration import Document, decode
from replayjob.errors import IntegrityError
from replayjob.runtime.contention_probe import Probe

FLOAT_MAX = sys.float_info.max


def declared() -> list[type[Document]]:
    out = []
    for info in pkgutil.iter_modules(replayjob.artifacts.__path__):
        mod = importlib.import_module(f"replayjob.artifacts.{info.name}")
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass)
                if issubclass(c, Document) and c is not Document and c.__module__ == mod.__name__]
    return out


def contention_record() -> dict[str, Any]:
    with Probe("cpu") as probe:
        sum(range(10_000))
    return probe.record()


def replay_metrics() -> dict[str, Any]:
    """A replay's document as the driver writes it, with every optional section present."""
    from replayjob.gate import synthetic
    doc = synthetic.replay_doc(arm="baseline", index=0, knobs={}, manifest_sha256=synthetic.digest_of("m"),
                               initial_sha256=synthetic.digest_of("i"), final_sha256=synthetic.digest_of("f"),
                               loss=0.5)
    doc.update(step=3, schedule={"design": "abba", "seed": 1, "block": 0, "position": 1},
               in_process={"warmup_updates": 1, "measured_updates": 2, "local_train_wall_s": [0.1, 0.2],
                           "peak_bytes": [10, 12], "loss_equal": True},
               contention=contention_record(),
               trace={"index_path": "trace/index.json", "index_sha256": synthetic.digest_of("t")},
               routing={"path": "routing.safetensors", "sha256": synthetic.digest_of("r")},
               distributed={"world_size": 2, "strategy": "ddp", "sharding": "contiguous",
                            "ranks": [{"rank": r, "file": f"replay_metrics.rank-{r}.json",
                                       "sha256": synthetic.digest_of(str(r)), "rows": [8 * r, 8 * r + 8]}
                                      for r in range(2)]})
    return doc


def verdict() -> dict[str, Any]:
    """A verdict as the reducer writes it (the committed golden one)."""
    from pathlib import Path
    return json.loads((Path(__file__).resolve().parent / "golden" / "verdict_exact_input.json").read_text())


def bundle_document(name: str) -> dict[str, Any]:
    """A trajectory bundle's document as its writer writes it (rank 0 of a two-rank update bundle)."""
    from replayjob.bundle.synthetic import example_documents
    return example_documents()[name]


def builtin_manifest() -> dict[str, Any]:
    """A chosen-step capture's manifest as the built-in trainer writes it, its outcome sealed."""
    from pathlib import Path

    from replayjob.artifacts import capture_manifest as mf
    return mf.build(step=3, producer={"replayjob_version": "0.1.0", "torch": "2.13.0"},
                    payload_file=mf.payload_name(3), payload_size=4096, payload_digest="a" * 64, rng_keys=["cpu"],
                    rows={"rows": 16, "tokens": 544, "response_tokens": 128, "loss_bearing_tokens": 128,
                          "loss_weight_sum": 1.0},
                    logical="b" * 64, effective="c" * 64, resolved_config={"training": {"seed": 1}},
                    contract={"schema": "x", "optimizer": {"lr": 1e-4}}, adapter_path=Path("state/adapter.safetensors"),
                    adapter_size=2048, adapter_sha256="d" * 64,
                    state={"dir": "optimizer_batch_step_000003.state", "step": 2, "optimizer_sha256": "e" * 64,
                           "lr": [1e-4], "nonfinite_inputs": False},
                    sealed=mf.outcome(0.5, 0.25, "f" * 64))


def funnel_record() -> dict[str, Any]:
    """A funnel.json as the funnel writes it: every stage passed, a summary with a contended replay, a decided
    bound and one not evaluated."""
    stage = {"status": "pass", "exit_code": 0, "detail": "", "wall_s": 1.5, "artifacts": {"report": "signals.json"}}
    arm = {"median_step_wall_s": 0.5, "median_warm_wall_s": 0.25, "decision": "decided", "step_ratio": [2.0, 1.5, 2.5],
           "peak_memory_ratio": 1.0, "memory_kind": ["max_rss"], "loss_equal_source": True,
           "adapter_equal_source": True}
    bound = {"arm": "mb-1", "metric": "local_train_wall_s", "kind": "max_ratio", "limit": 3.0}
    return {"schema": "replayjob.funnel/v1", "status": "pass", "exit_code": 0, "device": "cpu", "model": "tiny",
            "claim": "exact-input", "spec": "examples/ablation.toml", "arms": ["mb-default", "mb-1"],
            "design": "abba", "seed": 123, "omp_num_threads": "1",
            "stages": [{"name": n, **stage} for n in ("determinism", "signals", "ablation")],
            "summary": {"verdict": "pass", "baseline": "mb-default", "admission": "admitted",
                        "timing_metric": "in_process_train_wall_s", "confidence": 0.99375, "paired": True,
                        "max_looks": 8, "contended": [{"arm": "mb-1", "repeat_index": 0, "path": "replays/mb-1/0",
                                                       "block": 0, "reasons": ["run-queue wait 50%"]}],
                        "arms": {"mb-default": {**arm, "decision": None, "step_ratio": None}, "mb-1": arm},
                        "budgets": [{**bound, "decision": "pass", "note": "", "pairs": 3, "ratio": 2.0, "low": 1.5,
                                     "high": 2.5, "more_blocks": None},
                                    {**bound, "metric": "peak_memory_bytes", "decision": "not_measurable",
                                     "note": "CPU"}],
                        "blocks": 3, "max_blocks": 8},
            "wall_s": 12.0}


def source_metrics() -> dict[str, Any]:
    """A source run's metrics.json with every section its writers write: the built-in trainer's, a one-step
    capture's pins, chosen steps, the ring buffer, routing files (and the capture API's keys)."""
    from replayjob.artifacts import metrics as m
    doc = m.source_document(trainer="grpo", torch_version="2.13.0", device="cpu", steps_run=1, last_step=3, loss=0.5,
                            grad_norm=0.25, initial_adapter_sha256="1" * 64, final_adapter_sha256="2" * 64,
                            final_adapter_path="final_adapter/adapter_model.safetensors", config_sha256="c" * 64,
                            config={"training": {"seed": 1}}, provenance={"math_mode": "pedantic"}, wall_s=2.0)
    record = m.step_record(step=2, manifest_path="optimizer_batch_step_000002.manifest.json",
                           manifest_sha256="d" * 64, logical="e" * 64, effective="f" * 64,
                           initial_adapter_sha256="1" * 64, final_adapter_sha256=None,
                           replay_config="replay_step_000002.toml", nonfinite_inputs=False, loss=0.5, grad_norm=None)
    doc.update({m.LOGICAL: "e" * 64, m.EFFECTIVE: "f" * 64, m.MANIFEST: "d" * 64, m.INITIAL_ADAPTER: "1" * 64,
                m.FINAL_ADAPTER: "2" * 64, m.MANIFEST_PATH: "optimizer_batch.manifest.json", m.STEPS: [record],
                m.STEPS_NOT_CAPTURED: [5], m.FRAMEWORK: "torch", m.STEP: 3,
                m.RING: {"size": 2, "steps_observed": 4, "peak_bytes": 4096, "training_thread_s": 0.01,
                         "trigger": {"step": 3, "reason": "user says so"}, "written": [{**record, "step": 3}]},
                m.SOURCE_ROUTING: [{"step": 2, "path": "routing_step_000002.safetensors", "sha256": "3" * 64}]})
    return doc


# One valid document per top-level declaration (a sub-document is exercised inside its parent).
VALID: dict[str, Any] = {
    "ContentionRecord": contention_record,
    "RankMetrics": lambda: {"schema": "replayjob.replay_rank_metrics/v1", "rank": 1, "world_size": 2, "arm": "a",
                            "repeat_index": 0, "rows": [4, 8], "shard_logical_sha256": "a" * 64,
                            "shard_effective_rows_sha256": "b" * 64, "loss": 0.25, "micro_batch_rows": [2, 2],
                            "timing": {"local_train_wall_s": 0.4, "forward_wall_s": 0.1, "backward_wall_s": 0.1,
                                       "optimizer_wall_s": 0.1},
                            "memory": {"peak_bytes": 1024, "kind": "max_rss"},
                            "padding": {"real_tokens": 30, "padded_tokens": 40, "padding_fraction": 0.25,
                                        "micro_batches": 2},
                            "host": {"device_type": "cpu"}},
    "TolerancesFile": lambda: {"update_cosine_min": 0.99, "relative_delta_l2_max": 0.1},
    "SourceMetrics": source_metrics,
    "FunnelRecord": funnel_record,
    "BudgetsFile": lambda: {"baseline": "mb-default", "allow_cross_node": False,
                            "arms": {"mb-1": {"local_train_wall_s": {"max_ratio": 1.5, "min_ratio": 0.5},
                                              "peak_memory_bytes": {"max_ratio": 2.0}}}},
    "BoundFile": lambda: {"max_abs_log_ratio": 1e-4, "max_kl": 1e-8, "band": 0.001, "max_outside_share": 0.0},
    "ReplayMetrics": replay_metrics,
    "VerdictDocument": verdict,
    "BuiltinManifest": builtin_manifest,
    "ManifestPins": lambda: {k: builtin_manifest()[k] for k in ("logical_batch_sha256", "local_effective_rows_sha256",
                                                                "config", "contract")},
    "TraceIndex": lambda: {
        "schema": "replayjob.trace/v1",
        "identity": {"manifest_sha256": "a" * 64, "logical_batch_sha256": "b" * 64, "initial_adapter_sha256": "c" * 64,
                     "arm": "baseline", "repeat_index": 0, "micro_batch_size": 4, "gradient_checkpointing": False,
                     "device": "cpu", "torch_version": "2.13.0", "fault": None},
        "payload": {"file": "trace.safetensors", "sha256": "d" * 64, "bytes": 4096},
        "rows": 2, "tokens": 10, "stats": ["l2", "max_abs", "mean"],
        "param_stats": ["grad_l2", "grad_max_abs", "update_l2", "update_max_abs"],
        "forward": [{"name": "model.layers.0.mlp", "kind": "module", "dtype": "F32", "width": 8}],
        "backward": [{"name": "model.layers.0.mlp", "kind": "module", "dtype": "F32", "width": 8}],
        "params": [{"name": "lora_A", "dtype": "F32", "shape": [4, 8]}], "untraced": []},
    "RunRecord": lambda: {"schema": "replayjob.run/v1", "fingerprint": "a" * 64, "image": "registry/replayjob@sha256:"
                          + "b" * 64, "image_digest": "sha256:" + "b" * 64,
                          "environment": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": None},
                          "spec": {"name": "ablation", "arms": [{"name": "baseline"}]}},
    "Stopped": lambda: stopped_record("replay", "rj-run-replay", Stuck(pod="rj-run-replay-0-x", reason="Unschedulable",
                                                                      message="0/3 nodes are available")),
    "RunEnd": lambda: run_end("Failed", json.dumps([{"displayName": "reduce(0)", "templateName": "reduce",
                                                     "phase": "Failed", "message": "Error (exit code 3)"}])),
    **{name: lambda name=name: bundle_document(name)
       for name in ("BundleManifest", "BundleComplete", "RankComplete", "RootComplete")},
    # the capture API's manifest of one process (step 2, one micro-batch), as StepCapture.finish writes it
    "ApiManifest": lambda: (lambda m, mf, dg: m.build(
        framework="torch", step=2, producer={"replayjob": "0.1.0", "python": "3.11.7", "versions": {"torch": "2.13"},
                                             "device": "cpu"},
        files={r: {"file": n, "size": 64, "sha256": "a" * 64} for r, n in m.file_names(2).items() if r != "manifest"},
        micro_batches=[{"inputs": {"tensors": {"input_ids": {"dtype": "int64", "shape": [2, 8]}},
                                   "values": {"temperature": 1.0}},
                        "call": {"tensors": {"mask": {"dtype": "bool", "shape": [2, 8]}},
                                 "values": {"num_items_in_batch": 16}},
                        "rng": ["cpu"], "sync_gradients": True, "accumulation_steps": 1}],
        optimizer={"param_groups": [{"lr": 1e-4, "betas": [0.9, 0.999], "params": [0]}], "state": {"0": {"step": 2}},
                   "tensors": {"0": ["exp_avg", "exp_avg_sq"]}, "scheduler": {"last_epoch": 2, "base_lrs": [1e-4]}},
        trainable=["lora_A"], framework_state={"global_step": 2},
        rows={"rows": 2, "micro_batches": 1, "tensors": 2, "elements": 32, "bytes": 144, "nonfinite_inputs": False},
        logical="b" * 64, effective="c" * 64, config={"torch": {}, "model": {"name": "tiny"}},
        contract={"optimizer": {"lr": 1e-4}},
        base_model={"path": "~/model", "files": {"config.json": "d" * 64}, "sha256": dg.sha256_json(
            {"config.json": "d" * 64})}, sealed=mf.outcome(0.5, 0.25, "f" * 64)))(
        importlib.import_module("replayjob.artifacts.api_manifest"),
        importlib.import_module("replayjob.artifacts.capture_manifest"), importlib.import_module("replayjob.digest")),
    # its root over two processes (what every part shares is process 0's)
    "ApiRoot": lambda: (lambda one: {
        "schema": one["schema"], "framework": "torch", "step": 2, "world_size": 2,
        "ranks": [{"rank": r, "dir": f"rank-{r}", "manifest_sha256": "e" * 64, "logical_batch_sha256": "b" * 64,
                   "micro_batches": 1} for r in range(2)],
        "payload_sha256": "9" * 64, "rows": {**{k: 2 * v for k, v in one["rows"].items() if k != "nonfinite_inputs"},
                                             "nonfinite_inputs": False},
        **{k: one[k] for k in ("logical_batch_sha256", "local_effective_rows_sha256", "config", "contract",
                               "base_model", "framework_state", "trainable", "optimizer", "outcome")}})(
        VALID["ApiManifest"]()),
    # the built-in trainer's root over two ranks (rank 0's manifest: the chosen-step example's fields)
    "BuiltinRoot": lambda: (lambda cr, mf: cr.root_document(
        step=0, producer={"replayjob_version": "0.1.0"}, world=2, strategy="ddp", bucket_cap_mb=25.0, backend="gloo",
        ranks=[(0, "a" * 64, "b" * 64, (0, 8)), (1, "c" * 64, "d" * 64, (8, 16))], payload_size=8192,
        rows={"rows": 16, "tokens": 544, "response_tokens": 128, "loss_bearing_tokens": 128, "loss_weight_sum": 1.0},
        logical="b" * 64, effective="c" * 64, first_rank=builtin_manifest(), sealed=mf.outcome(0.5, 0.25, "f" * 64)))(
        importlib.import_module("replayjob.artifacts.capture_root"),
        importlib.import_module("replayjob.artifacts.capture_manifest")),
}
NESTED = {"CudaProcess", "CudaFigures",  # reached through ContentionRecord.cuda (a CUDA record below)
          "Pins", "Timing", "Memory", "Padding", "Slot", "InProcess", "TracePin", "RoutingPin", "RankEntry",
          "Distributed",  # ReplayMetrics' sections
          "VerdictCheck", "Refusal",  # VerdictDocument's
          "FailedNode",  # RunEnd's
          "StepRecord", "RoutingStep", "Ring", "RingTrigger",  # SourceMetrics'
          "FunnelStage", "FunnelSummary", "FunnelArm", "FunnelContended", "FunnelBound",  # FunnelRecord's
          "ArmBounds", "RatioBounds",  # BudgetsFile's
          "TraceIdentity", "TracePayloadPin", "TraceSiteEntry", "TraceParamEntry",  # TraceIndex's
          "StageContract", "PayloadSpec", "PayloadFile", "Tolerance", "Redaction", "MultiRank", "BundleIndex",
          "Identity", "Physical", "RecomputeConfig", "TaskConfig", "Sample", "PayloadRef",  # BundleManifest's
          "Outcome", "Hashed", "ContractBlock", "PayloadPin", "Rows", "InitialAdapter", "StartState",  # a manifest's
          "ApiFile", "ApiFiles", "TensorSpec", "InputGroup", "MicroBatchEntry", "OptimizerState", "ApiRows",
          "BaseModelPin",  # ApiManifest's
          "ApiRankEntry", "RootRows",  # ApiRoot's
          "RootDistributed", "RootRankEntry", "RootPayload"}  # BuiltinRoot's


# Declarations that are only the shared fields of others (never decoded themselves): each is exercised through its
# subclasses, which must have valid examples.
BASES = {"BuiltinHead": {"BuiltinManifest", "BuiltinRoot"}}


def test_every_declaration_has_a_valid_example_or_a_parent() -> None:
    names = {c.__name__ for c in declared()}
    assert names == set(VALID) | NESTED | set(BASES), names ^ (set(VALID) | NESTED | set(BASES))
    for base, subclasses in BASES.items():
        assert {c.__name__ for c in declared() if base in {b.__name__ for b in c.__mro__[1:]}} == subclasses
        assert subclasses <= set(VALID)


def _open_ends(t: mi.Type, at: str) -> list[str]:
    """Where the declared type ``t`` leaves a number unbounded, a value untyped or a pattern open at its end."""
    if isinstance(t, mi.AnyType):
        return [f"{at}: Any"]
    if isinstance(t, mi.StrType) and t.pattern is not None and not t.pattern.endswith("\\Z"):
        return [f"{at}: pattern {t.pattern!r} not anchored with \\Z (made by whole(): $ also matches before a newline)"]
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
        ok = lo is not None and hi is not None and lo >= -(2**63) and hi <= 2**63 - 1
        return [] if ok else [f"{at}: integer without 64-bit bounds"]
    if isinstance(t, mi.FloatType):
        lo = t.ge if t.ge is not None else t.gt
        hi = t.le if t.le is not None else t.lt
        ok = lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)
        return [] if ok else [f"{at}: float without finite bounds (NaN or an infinity would pass)"]
    if isinstance(t, mi.UnionType):
        return [x for m in t.types for x in _open_ends(m, at)]
    if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        return _open_ends(t.item_type, f"{at}[]")
    if isinstance(t, mi.DictType):
        return _open_ends(t.key_type, f"{at}{{key}}") + _open_ends(t.value_type, f"{at}{{}}")
    if isinstance(t, mi.StructType):  # a block its declaration names OPAQUE (with the reason) is read whole
        opaque = getattr(t.cls, "OPAQUE", {})
        return [x for f in t.fields if f.name not in opaque for x in _open_ends(f.type, f"{at}.{f.name}")]
    return []


@pytest.mark.parametrize("kind", declared(), ids=lambda c: c.__name__)
def test_no_declared_field_is_left_open(kind: type[Document]) -> None:
    ti = mi.type_info(kind)
    assert isinstance(ti, mi.StructType) and ti.forbid_unknown_fields
    # a block a declaration names OPAQUE (with the reason) is recorded or compared whole, never read field by field
    exempt = {f"{kind.__name__}.{k}{tail}" for k in getattr(kind, "OPAQUE", {}) for tail in ("", "{}")}
    assert all(isinstance(why, str) and len(why) > 20 for why in getattr(kind, "OPAQUE", {}).values())
    assert [e for e in _open_ends(ti, kind.__name__) if e.split(":")[0] not in exempt] == []


def refused_values(t: mi.Type) -> list[Any]:
    """Values the declared type ``t`` must refuse, from the type alone."""
    if isinstance(t, mi.UnionType):
        nullable = any(isinstance(m, mi.NoneType) for m in t.types)
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        out = [v for m in members for v in refused_values(m) if v is not None]
        return out if nullable else [*out, None]
    out: list[Any] = [None]
    if isinstance(t, mi.IntType):
        out += [True, 1.5, 2.0, "1"]
        if t.ge is not None:
            out.append(t.ge - 1)
        if t.le is not None:
            out.append(t.le + 1)
    elif isinstance(t, mi.FloatType):
        out += [True, "1.0", math.nan, math.inf, -math.inf]
        if t.ge is not None and t.ge > -FLOAT_MAX:
            out.append(t.ge - max(1.0, abs(t.ge)))
        if t.gt is not None:
            out.append(t.gt)
        if t.le is not None and t.le < FLOAT_MAX:
            out.append(t.le + max(1.0, abs(t.le)))
    elif isinstance(t, mi.StrType):
        out += [1, True]
        if t.min_length:
            out.append("")
    elif isinstance(t, mi.BoolType):
        out += [1, 0, "true"]
    elif isinstance(t, mi.LiteralType):
        out += ["replayjob.unknown/v0", 7]
    elif isinstance(t, mi.ListType):
        out += ["x", {}]
        if t.min_length:
            out.append([])
    elif isinstance(t, mi.DictType):
        out += [[], "x"]
    elif isinstance(t, mi.StructType):
        out += [[], "x", {"unknown": 1}]
    return out


def cases() -> list[tuple[str, str, int | str]]:
    out: list[tuple[str, str, int | str]] = []
    for kind in declared():
        if kind.__name__ not in VALID:
            continue
        for f in mi.type_info(kind).fields:  # type: ignore[attr-defined]
            out += [(kind.__name__, f.encode_name, i) for i in range(len(refused_values(f.type)))]
            if f.required:
                out.append((kind.__name__, f.encode_name, "absent"))
            members = f.type.types if isinstance(f.type, mi.UnionType) else (f.type,)
            if any(isinstance(m, mi.StrType) and m.pattern for m in members) and \
                    isinstance(VALID[kind.__name__]().get(f.encode_name), str):
                out.append((kind.__name__, f.encode_name, "newline"))  # a valid value and a final newline
    return out


KINDS = {c.__name__: c for c in declared()}
EXAMPLES = {name: make() for name, make in VALID.items()}


@pytest.mark.parametrize(("name", "field", "which"), cases(), ids=lambda x: str(x))
def test_each_field_refuses_what_its_declaration_refuses(name: str, field: str, which: Any) -> None:
    kind, doc = KINDS[name], copy.deepcopy(EXAMPLES[name])
    decode(copy.deepcopy(doc), kind, where="doc.json")  # the example itself is valid
    if which == "absent":
        del doc[field]
    elif which == "newline":
        doc[field] += "\n"
    else:
        ftype = next(f.type for f in mi.type_info(kind).fields  # type: ignore[attr-defined]
                     if f.encode_name == field)
        doc[field] = refused_values(ftype)[which]
    with pytest.raises(IntegrityError) as info:
        decode(doc, kind, where="doc.json")
    text = info.value.diagnostics()
    assert text.startswith("doc.json: ") and "Traceback" not in text
    # the field is named: by its path, or by a rule about it (a summary recomputed from it)
    assert field in text or "summarises" in text, text


@pytest.mark.parametrize("name", sorted(VALID))
def test_an_unknown_field_is_refused(name: str) -> None:
    doc = {**copy.deepcopy(EXAMPLES[name]), "trust_me": True}
    with pytest.raises(IntegrityError, match="unknown field `trust_me`"):
        decode(doc, KINDS[name], where="doc.json")


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every nested position of ``value`` (its own position included)."""
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


CUDA = {"device": "cuda:0", "read_by": "nvidia-smi", "note": "",
        "processes_before": [{"pid": 7, "used_bytes": 2**20}], "processes_after": [{"pid": 7, "used_bytes": None}],
        "other_processes": 0}


def cuda_record() -> dict[str, Any]:
    from replayjob.runtime.contention_probe import decide
    rec = {**copy.deepcopy(EXAMPLES["ContentionRecord"]), "device": "cuda:0", "cuda": copy.deepcopy(CUDA)}
    rec["unavailable"] = {k: v for k, v in rec["unavailable"].items() if k != "cuda_processes"}  # read: 0 others
    rec["reasons"] = decide(rec)
    rec["contended"] = bool(rec["reasons"])
    return rec


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_nested_mutations_are_refused(data: st.DataObject) -> None:
    """A random nested position of a valid document (a CUDA contention record reaches the sub-documents) is
    replaced by a value of another JSON kind, or removed: refused, or read as exactly what was written."""
    name = data.draw(st.sampled_from([*sorted(VALID), "cuda"]))
    doc = cuda_record() if name == "cuda" else copy.deepcopy(EXAMPLES[name])
    kind = KINDS["ContentionRecord" if name == "cuda" else name]
    decode(copy.deepcopy(doc), kind, where="doc.json")
    path = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    swap: Any = data.draw(st.sampled_from(["absent", None, True, -1, 2**64, 1.5, math.nan, "", "x", [], {}]))
    if swap == "absent":
        if isinstance(parent, list):
            parent.pop(path[-1])
        else:
            del parent[path[-1]]
    else:
        parent[path[-1]] = swap
    try:
        got = decode(doc, kind, where="doc.json")
    except IntegrityError as exc:
        assert exc.where == "doc.json" and exc.message
        return
    # accepted: only where the declaration allows the value, and then it reads back exactly as written (an
    # optional section left out reads back as its declared default, null)
    back = _without_defaults(msgspec.to_builtins(got), doc)
    assert back == doc or _nan_equal(back, doc)


def _without_defaults(back: Any, doc: Any) -> Any:
    """``back`` without the optional keys, at any depth, that ``doc`` left out and read back as their default null."""
    if isinstance(back, dict) and isinstance(doc, dict):
        return {k: _without_defaults(v, doc.get(k)) for k, v in back.items() if k in doc or v is not None}
    if isinstance(back, list) and isinstance(doc, list) and len(back) == len(doc):
        return [_without_defaults(v, d) for v, d in zip(back, doc, strict=True)]
    return back


def _nan_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_nan_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# Each declared document's page names every one of its fields (a field cannot be checked and undocumented, nor
# documented under a name the reader does not take): the declaration -> its page.
PAGES = {**{name: "replay-metrics.md" for name in ("SourceMetrics", "StepRecord", "RoutingStep", "Ring",
                                                    "RingTrigger")},
         **{name: "funnel.md" for name in ("FunnelRecord", "FunnelStage", "FunnelSummary", "FunnelArm",
                                            "FunnelContended", "FunnelBound")},
         "ReplayMetrics": "replay-metrics.md", "ContentionRecord": "replay-metrics.md",
         "RankMetrics": "replay-metrics.md",
         "TolerancesFile": "verdict-format.md", "BudgetsFile": "verdict-format.md", "ArmBounds": "verdict-format.md",
         "RatioBounds": "verdict-format.md", "BoundFile": "mismatch.md", "VerdictDocument": "verdict-format.md",
         "VerdictCheck": "verdict-format.md", "Refusal": "verdict-format.md", "Stopped": "cluster.md",
         "RunEnd": "cluster.md", "RunRecord": "cluster.md", "TraceIndex": "trace-format.md",
         "BuiltinManifest": "optimizer-batch.md",
         "BuiltinRoot": "optimizer-batch.md", "ApiManifest": "capture-api.md", "ApiRoot": "capture-api.md",
         **{name: "bundle-format.md" for name in ("BundleManifest", "BundleIndex", "RecomputeConfig", "Sample",
                                                  "StageContract", "PayloadSpec", "PayloadFile", "MultiRank",
                                                  "Identity", "Physical", "BundleComplete", "RankComplete",
                                                  "RootComplete")}}


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_declared_field_is_on_its_documents_page(name: str) -> None:
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / PAGES[name]).read_text()
    missing = [f.encode_name for f in mi.type_info(KINDS[name]).fields  # type: ignore[attr-defined]
               if f"`{f.encode_name}`" not in text]
    assert missing == [], f"docs/{PAGES[name]} does not name {missing}"


def test_claims_are_declared_once() -> None:
    """The verdict's declaration, the spec, the CLI's usage text and docs/verdict-format.md take the claims from
    the one table (replayjob.artifacts.claims)."""
    import typing
    from pathlib import Path

    from replayjob import cli
    from replayjob.artifacts import claims
    from replayjob.artifacts import spec as ablation
    from replayjob.artifacts.verdict import VerdictDocument
    ftype = next(f.type for f in mi.type_info(VerdictDocument).fields  # type: ignore[attr-defined]
                 if f.name == "claim")
    assert isinstance(ftype, mi.LiteralType) and sorted(ftype.values) == sorted(claims.NAMES)
    assert typing.get_args(typing.get_type_hints(VerdictDocument)["claim"]) == claims.NAMES
    assert ablation.CLAIMS == claims.SPEC_NAMES and set(claims.SPEC_NAMES) < set(claims.NAMES)
    doc = cli.__doc__ or ""
    assert "--claim CLAIM" in doc and all(c in doc for c in claims.NAMES)
    page = (Path(__file__).resolve().parents[1] / "docs" / "verdict-format.md").read_text()
    assert claims.reference_table() in page
    with pytest.raises(Exception, match="unknown claim 'nope'; use one of exact-input, bitwise, approximate"):
        claims.claim("nope")
