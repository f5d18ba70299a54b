"""Property-based fuzzing of the readers: a mutated artifact is refused with a domain error or accepted
as exactly what it says -- never another exception.

CI runs a bounded, derandomized number of examples per property.  For a longer local run::

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_hostile_fuzz.py

(``long``: 5,000 random examples per property; set ``HYPOTHESIS_EXAMPLES=N`` to choose another count.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save

from replayjob import tensorfile
from replayjob.digest import sha256_bytes, sha256_file
from replayjob.errors import ReplayjobError
from replayjob.jsonio import loads_strict
from replayjob.rl.state import read_state

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "5000" if LONG else "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# -------------------------------------------------------------------------------------- mutations
def mutate(data: st.DataObject, blob: bytes, *, max_ops: int = 3) -> bytes:
    """Flip, delete, insert, duplicate or truncate bytes; one to ``max_ops`` operations."""
    b = bytearray(blob)
    for op in data.draw(st.lists(st.sampled_from(["flip", "delete", "insert", "dup", "truncate"]),
                                 min_size=1, max_size=max_ops)):
        n = len(b)
        if op == "flip" and n:
            b[data.draw(st.integers(0, n - 1))] = data.draw(st.integers(0, 255))
        elif op == "delete" and n:
            i = data.draw(st.integers(0, n - 1))
            del b[i:i + data.draw(st.integers(1, 16))]
        elif op == "insert":
            i = data.draw(st.integers(0, n))
            b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "dup" and n:
            i = data.draw(st.integers(0, n - 1))
            b[data.draw(st.integers(0, n)):0] = b[i:i + data.draw(st.integers(1, 32))]
        elif op == "truncate":
            del b[data.draw(st.integers(0, n)):]
    return bytes(b)


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
JSON_VALUE = st.recursive(JSON_LEAF, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                            st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                          max_leaves=8)


def mutate_doc(data: st.DataObject, doc: Any) -> Any:
    """Replace, delete or add one value somewhere in a JSON document (structure-aware)."""
    if not isinstance(doc, dict | list) or not doc or data.draw(st.integers(0, 3)) == 0:
        return data.draw(JSON_VALUE)
    if isinstance(doc, list):
        i = data.draw(st.integers(0, len(doc) - 1))
        return [*doc[:i], mutate_doc(data, doc[i]), *doc[i + 1:]]
    key = data.draw(st.sampled_from(sorted(doc)))
    action = data.draw(st.sampled_from(["descend", "delete", "add"]))
    out = dict(doc)
    if action == "delete":
        del out[key]
    elif action == "add":
        out[data.draw(st.text(min_size=1, max_size=6))] = data.draw(JSON_VALUE)
    else:
        out[key] = mutate_doc(data, doc[key])
    return out


# ------------------------------------------------------------------------------------- safetensors
VALID = bytes(save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(4),
                    "c": torch.tensor([True, False, True])}, metadata={"format": "pt"}))
PIN = sha256_bytes(VALID)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                    and torch.equal(a[k], b[k]) for k in a)


@FUZZ
@given(data=st.data())
def test_tensor_file_mutations_are_refused_or_read_as_safetensors_reads_them(
        data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    blob = mutate(data, VALID)
    p = tmp_path_factory.mktemp("st") / "t.safetensors"
    p.write_bytes(blob)
    try:
        tensorfile.scan(p).validated()  # the one-read path must agree with the in-memory one
        scanned = True
    except ReplayjobError:
        scanned = False
    try:
        _, got = tensorfile.load_bytes(blob)
    except ReplayjobError:
        assert not scanned
        return
    assert scanned and _same(tensorfile.scan(p).tensors(), got)
    assert _same(got, st_load(blob))  # accepted: the reference parser agrees byte for byte
    if blob != VALID:  # and under the original's pin, any change at all is refused
        with pytest.raises(ReplayjobError, match="the pin is"):
            tensorfile.load_bytes(blob, expected_sha256=PIN)


def _header_and_data() -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(VALID[:8], "little")
    return json.loads(VALID[8:8 + n]), VALID[8 + n:]


@FUZZ
@given(data=st.data())
def test_crafted_headers_are_refused_or_agree_with_the_reference_parser(data: st.DataObject) -> None:
    head, body = _header_and_data()
    crafted = mutate_doc(data, head)
    raw = json.dumps(crafted).encode() if not isinstance(crafted, bytes) else crafted
    blob = len(raw).to_bytes(8, "little") + raw + body
    try:
        _, got = tensorfile.load_bytes(blob)
    except ReplayjobError:
        return
    assert _same(got, st_load(blob))


# ------------------------------------------------------------------------------------------- JSON
@FUZZ
@given(data=st.data())
def test_strict_json_is_refused_or_agrees_with_the_standard_library(data: st.DataObject) -> None:
    base = json.dumps({"schema": "x/v1", "step": 3, "rows": [1.5, -2, "s"], "nested": {"k": [None, True]}},
                      indent=1).encode()
    blob = mutate(data, base)
    try:
        doc = loads_strict(blob)
    except ReplayjobError:
        return
    assert doc == json.loads(blob)  # what strict parsing accepts, the standard library reads the same


# ----------------------------------------------------------------------------------- resume state
@pytest.fixture(scope="module")
def state_dir(workspace: Path) -> Path:
    return workspace / "init_resume"


@FUZZ
@given(data=st.data())
def test_resume_state_mutations_are_refused_or_read_exactly(data: st.DataObject, state_dir: Path,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("state")
    shutil.copytree(state_dir, d / "s")
    d = d / "s"
    original = read_state(state_dir)
    target = data.draw(st.sampled_from(["trainer_state.json", "adapter_model.safetensors", "doc"]))
    if target == "doc":
        doc = json.loads((d / "trainer_state.json").read_bytes())
        (d / "trainer_state.json").write_bytes(json.dumps(mutate_doc(data, doc)).encode())
    else:
        (d / target).write_bytes(mutate(data, (state_dir / target).read_bytes()))
    try:
        got = read_state(d)
    except ReplayjobError:
        return
    # Accepted: the adapter is byte for byte the one the state pins, and that pin is the original's.
    assert sha256_file(got.adapter_file) == got.adapter_sha256 == original.adapter_sha256


# ------------------------------------------------------------------ capture, bundle, metrics, diag
@pytest.fixture(scope="module")
def sources(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from conftest import load_corpus_module

    corpus = load_corpus_module()

    paths: dict[str, Path] = corpus.build_sources(workspace, tmp_path_factory.getbasetemp() / "hostile-sources")
    return paths


@FUZZ
@given(data=st.data())
def test_capture_manifest_mutations_never_pass_the_pin(data: st.DataObject, sources: dict[str, Path],
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    from replayjob.artifacts import capture_manifest as manifest

    _manifest_mutation_never_passes_the_pin(data, next(sources["capture"].glob("*.manifest.json")),
                                            manifest.read_verified, tmp_path_factory.mktemp("man"))


def _manifest_mutation_never_passes_the_pin(data: st.DataObject, src: Path, read_verified: Any, tmp: Path) -> None:
    """Mutate a copy of the manifest ``src`` (bytes or structure): the user's pin refuses every change, and a
    pin copied from the tampered file leaves the validator behind it to refuse or accept exactly what is
    written."""
    original = src.read_bytes()
    p = tmp / src.name
    blob = mutate(data, original) if data.draw(st.booleans()) else json.dumps(
        mutate_doc(data, json.loads(original))).encode()
    p.write_bytes(blob)
    if blob != original:  # the pin the user holds refuses every change, before parsing
        with pytest.raises(ReplayjobError):
            read_verified(p, sha256_bytes(original))
    try:
        got = read_verified(p, sha256_bytes(blob))
    except ReplayjobError:
        return
    assert got.doc == json.loads(blob)


@FUZZ
@given(data=st.data())
def test_capture_payload_mutations_are_refused_or_decode_as_safetensors_reads_them(
        data: st.DataObject, sources: dict[str, Path]) -> None:
    from replayjob.artifacts import capture_payload as payload

    original = next(sources["capture"].glob("*.safetensors")).read_bytes()
    blob = mutate(data, original)
    try:
        batch, rng = payload.decode(blob)
    except ReplayjobError:
        return
    ref = st_load(blob)
    assert _same({**batch.tensors(), **{f"rng.{k}": v for k, v in rng.items()}}, ref)


@FUZZ
@given(data=st.data())
def test_bundle_mutations_are_refused_or_load_as_exactly_the_original(
        data: st.DataObject, sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    from replayjob.bundle.reader import load_bundle

    original = load_bundle(sources["bundle"])
    _bundle_mutation_is_refused_or_a_no_op(data, sources["bundle"], original, tmp_path_factory.mktemp("bundle"))


def _bundle_mutation_is_refused_or_a_no_op(data: st.DataObject, src: Path, original: Any, tmp: Path) -> None:
    """Mutate one file of a copy of bundle ``src``: refused, or it loads as exactly ``original``."""
    from replayjob.bundle.reader import load_bundle

    d = tmp / src.name
    shutil.copytree(src, d)
    target = data.draw(st.sampled_from(sorted(p for p in d.rglob("*") if p.is_file())))
    target.write_bytes(mutate(data, target.read_bytes()))
    try:
        got = load_bundle(d)
    except ReplayjobError:
        return
    # Every byte is pinned (COMPLETE -> manifest -> index, expected, payloads): only no-op edits pass.
    assert (got.manifest, got.index, got.expected) == (original.manifest, original.index, original.expected)
    assert _same(got.payloads, original.payloads)


@FUZZ
@given(data=st.data())
def test_replay_metrics_mutations_are_refused_or_read_cleanly(data: st.DataObject, sources: dict[str, Path],
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    from replayjob.gate.evidence import read_replay

    src = sources["metrics"] / "replay_metrics.json"
    original = src.read_bytes()
    p = tmp_path_factory.mktemp("metrics") / "replay_metrics.json"
    blob = mutate(data, original) if data.draw(st.booleans()) else json.dumps(
        mutate_doc(data, json.loads(original))).encode()
    p.write_bytes(blob)
    try:
        got = read_replay(p)
    except ReplayjobError:
        return
    doc = json.loads(blob)
    assert (got.arm, got.repeat_index, got.loss) == (doc["arm"], doc["repeat_index"], doc["loss"])


@FUZZ
@given(data=st.data())
def test_diag_mutations_are_refused_or_read_as_written(data: st.DataObject, sources: dict[str, Path],
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    from replayjob.check.rows import iter_rows

    original = sources["diag"].read_bytes()
    p = tmp_path_factory.mktemp("diag") / "diag.jsonl"
    p.write_bytes(mutate(data, original))
    try:
        rows = list(iter_rows(p))
    except ReplayjobError:
        return
    lines = [ln for ln in p.read_bytes().splitlines() if ln.strip()]
    assert [r for _, r in rows] == [json.loads(ln, object_pairs_hook=_unique) for ln in lines]


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The reference reading: an object with a repeated key has no meaning (no last-one-wins)."""
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"accepted a row with a duplicate key: {keys}"
    return dict(pairs)


# ------------------------------- readers added later: traces, budgets, run records, multi-rank bundles,
# ------------------------------- integration capture manifests
@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_trace_evidence import _trace

    from replayjob.artifacts.trace_store import write_trace

    d = tmp_path_factory.mktemp("trace") / "run"
    write_trace(d, _trace())
    return d


@FUZZ
@given(data=st.data())
def test_trace_mutations_are_refused_or_read_as_the_original_values(
        data: st.DataObject, trace_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every byte of a trace is pinned (index -> payload -> per-row digests recomputed from the values):
    a mutation, even with every pin re-sealed, is refused or changes nothing that is compared."""
    from replayjob.artifacts.trace_store import INDEX_FILE, PAYLOAD_FILE, TRACE_DIR, read_trace

    original = read_trace(trace_dir)
    d = tmp_path_factory.mktemp("trace") / "run"
    shutil.copytree(trace_dir, d)
    t = d / TRACE_DIR
    index = json.loads((t / INDEX_FILE).read_bytes())
    if data.draw(st.booleans()):  # the payload, its pin in the index re-sealed
        blob = mutate(data, (t / PAYLOAD_FILE).read_bytes())
        (t / PAYLOAD_FILE).write_bytes(blob)
        index["payload"].update(sha256=sha256_bytes(blob), bytes=len(blob))
        (t / INDEX_FILE).write_bytes(json.dumps(index).encode())
    else:  # the index, structure-aware, read without an outside pin
        (t / INDEX_FILE).write_bytes(json.dumps(mutate_doc(data, index)).encode())
    try:
        got = read_trace(d)
    except ReplayjobError:
        return
    assert torch.equal(got.row_tokens, original.row_tokens)
    assert torch.equal(got.row_micro_batch, original.row_micro_batch)
    for a, b in ((got.forward, original.forward), (got.backward, original.backward)):
        assert [(s.name, s.sha256) for s in a] == [(s.name, s.sha256) for s in b]
        assert all(torch.equal(x.values, y.values) for x, y in zip(a, b, strict=True))
    assert [(p.name, p.grad_sha256, p.update_sha256) for p in got.params] == \
        [(p.name, p.grad_sha256, p.update_sha256) for p in original.params]
    assert all(torch.equal(p.grad, q.grad) and torch.equal(p.update, q.update)
               for p, q in zip(got.params, original.params, strict=True))


BUDGETS = b"""baseline = "ckpt-off"
allow_cross_node = false
[ckpt-on]
local_train_wall_s = { max_ratio = 1.35, min_ratio = 0.5 }
optimizer_wall_s = { max_ratio = 2.0 }
"""


@FUZZ
@given(data=st.data())
def test_budget_mutations_are_refused_or_read_as_sound_bounds(data: st.DataObject,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    import math

    from replayjob.gate.budgets import read_budgets

    p = tmp_path_factory.mktemp("budgets") / "budgets.toml"
    blob = mutate(data, BUDGETS)
    p.write_bytes(blob)
    try:
        got = read_budgets(p)
    except ReplayjobError:
        return
    assert got.sha256 == sha256_bytes(blob) and got.bounds
    limits: dict[tuple[str, str], dict[str, float]] = {}
    for b in got.bounds:
        assert math.isfinite(b.limit) and b.limit > 0, b
        limits.setdefault((b.arm, b.metric), {})[b.kind] = b.limit
    for kinds in limits.values():  # a lower bound above the upper one can never be met: refused
        assert kinds.get("min_ratio", 0.0) <= kinds.get("max_ratio", math.inf), kinds


@FUZZ
@given(data=st.data())
def test_run_record_mutations_are_refused_or_name_this_run(data: st.DataObject,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    from conftest import REPO

    from replayjob.artifacts.spec import load_spec
    from replayjob.launch import step

    spec = load_spec(REPO / "examples" / "ablation.toml")
    layout = step.Layout.of(tmp_path_factory.mktemp("run") / "r")
    layout.run.mkdir()
    step.check_run_record(layout, spec)
    record = layout.run / step.RUN_RECORD
    original = record.read_bytes()
    blob = mutate(data, original) if data.draw(st.booleans()) else json.dumps(
        mutate_doc(data, json.loads(original))).encode()
    record.write_bytes(blob)
    try:
        step.check_run_record(layout, spec)
    except ReplayjobError:
        return
    assert json.loads(blob)["fingerprint"] == json.loads(original)["fingerprint"]


@pytest.fixture(scope="module")
def two_rank_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replayjob.bundle.synthetic import write_rollout

    root = tmp_path_factory.mktemp("ranked") / "b"
    for r in (0, 1):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id="fuzz-run")
    return root


@FUZZ
@given(data=st.data())
def test_multi_rank_bundle_mutations_are_refused_or_load_as_exactly_the_original(
        data: st.DataObject, two_rank_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from replayjob.bundle.reader import load_bundle

    _bundle_mutation_is_refused_or_a_no_op(data, two_rank_bundle, load_bundle(two_rank_bundle),
                                           tmp_path_factory.mktemp("ranked"))


@FUZZ
@given(data=st.data())
def test_integration_manifest_mutations_never_pass_the_pin(data: st.DataObject, trl_capture: dict[str, Any],
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    from replayjob.artifacts import api_manifest as manifest

    _manifest_mutation_never_passes_the_pin(data, next(trl_capture["dir"].glob("*.manifest.json")),
                                            manifest.read_verified, tmp_path_factory.mktemp("iman"))


@pytest.fixture(scope="module")
def two_rank_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_symlinks import capture_over_two_ranks

    out = tmp_path_factory.mktemp("ranked_capture") / "source"
    capture_over_two_ranks(out)
    return out


@FUZZ
@given(data=st.data())
def test_multi_rank_capture_mutations_are_refused_or_read_as_the_original_batch(
        data: st.DataObject, two_rank_capture: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every file of a capture over ranks (root manifest, each rank's manifest, payload and landing
    record) is pinned from the root, whose SHA-256 the user holds: a mutation is refused or is a no-op."""
    from replayjob.artifacts import capture_manifest as mf
    from replayjob.artifacts import capture_root as ranks
    from replayjob.producers.builtin import ranks as rankrows

    root_file = two_rank_capture / mf.manifest_name(0)
    pin = sha256_bytes(root_file.read_bytes())
    original = rankrows.verify(ranks.read_capture(root_file, pin))
    d = tmp_path_factory.mktemp("ranked_capture") / "source"
    shutil.copytree(two_rank_capture, d)
    target = data.draw(st.sampled_from(sorted(p for p in d.rglob("*") if p.is_file())))
    target.write_bytes(mutate(data, target.read_bytes()))
    try:
        root = ranks.read_capture(d / mf.manifest_name(0), pin)
        assert isinstance(root, ranks.RootManifest)
        got = rankrows.verify(root)
    except ReplayjobError:
        return
    assert got.digests == original.digests and got.bounds == original.bounds
    assert _same(got.batch.tensors(), original.batch.tensors())
    assert all(_same(a, b) for a, b in zip(got.rngs, original.rngs, strict=True))
