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
    from replayjob.optbatch import manifest

    src = next(sources["capture"].glob("*.manifest.json"))
    original = src.read_bytes()
    d = tmp_path_factory.mktemp("man")
    p = d / src.name
    doc = json.loads(original)
    blob = mutate(data, original) if data.draw(st.booleans()) else json.dumps(mutate_doc(data, doc)).encode()
    p.write_bytes(blob)
    if blob != original:  # the pin the user holds refuses every change, before parsing
        with pytest.raises(ReplayjobError):
            manifest.read_verified(p, sha256_bytes(original))
    try:  # a pin copied from the tampered file: the validator behind the pin refuses or accepts cleanly
        got = manifest.read_verified(p, sha256_bytes(blob))
    except ReplayjobError:
        return
    assert got.doc == json.loads(blob)


@FUZZ
@given(data=st.data())
def test_capture_payload_mutations_are_refused_or_decode_as_safetensors_reads_them(
        data: st.DataObject, sources: dict[str, Path]) -> None:
    from replayjob.optbatch import payload

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
    d = tmp_path_factory.mktemp("bundle") / sources["bundle"].name
    shutil.copytree(sources["bundle"], d)
    files = sorted(p for p in d.rglob("*") if p.is_file())
    target = data.draw(st.sampled_from(files))
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
