"""The validated safetensors reader: every corpus defect refused by cause, valid files read exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import load_corpus_module
from safetensors.torch import load as st_load
from safetensors.torch import save

from replayjob import tensorfile
from replayjob.errors import IntegrityError

corpus = load_corpus_module()
MUTATIONS = corpus.safetensors_mutations()
DATA_ONLY = {"st_bool_out_of_range"}  # header is sound; the defect is in the tensor bytes


def _write(tmp_path: Path, data: bytes, name: str = "t.safetensors") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_every_corpus_tensor_file_is_refused_by_cause(tmp_path: Path, name: str) -> None:
    data, expect = MUTATIONS[name]
    p = _write(tmp_path, data)
    readers = [lambda: tensorfile.load(p), lambda: list(tensorfile.iter_tensors(p)),
               lambda: tensorfile.load_bytes(data, where=p), lambda: tensorfile.scan(p).validated(),
               lambda: tensorfile.scan(p, keep=False).validated()]
    if name not in DATA_ONLY:
        readers += [lambda: tensorfile.read_header(p), lambda: tensorfile.TensorReader(p)]
    for read in readers:
        with pytest.raises(IntegrityError) as exc:
            read()
        assert expect in exc.value.diagnostics().lower(), exc.value.diagnostics()
        assert str(p) in exc.value.diagnostics()


def test_pickle_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("an unpickler was called")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    for data in (corpus.torch_save_bytes(), pickle.dumps({"w": 1}, protocol=2)):
        p = _write(tmp_path, data, "renamed.safetensors")
        with pytest.raises(IntegrityError, match="pickle is never loaded"):
            tensorfile.load(p)


ALL_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
              "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
              "F64": torch.float64}


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for i, (name, dt) in enumerate(sorted(ALL_DTYPES.items())):
        shape = (2, i + 1)
        if dt == torch.bool:
            out[name] = torch.rand(shape, generator=g) > 0.5
        elif dt.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dt)
        else:
            out[name] = torch.randint(0, 100, shape, generator=g).to(dt)
    out["empty"] = torch.zeros((0, 3))
    out["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    return out


def test_valid_file_reads_identically_every_way(tmp_path: Path) -> None:
    tensors = _every_dtype()
    data = bytes(save(tensors, metadata={"format": "pt"}))
    p = _write(tmp_path, data)
    ref = st_load(data)
    header = tensorfile.read_header(p)
    assert header.metadata == {"format": "pt"} and set(header.tensors) == set(tensors)
    pin = tensorfile.hashlib.sha256(data).hexdigest()
    loaded = tensorfile.load(p, expected_sha256=pin.upper())  # user pins are case-insensitive
    streamed = dict(tensorfile.iter_tensors(p, expected_sha256=pin))
    with tensorfile.TensorReader(p, expected_sha256=pin) as r:
        assert r.keys() == sorted(tensors)
        random_access = {k: r.get_tensor(k) for k in sorted(tensors)}
    scanned = tensorfile.scan(p)
    assert (scanned.sha256, scanned.size) == (pin, len(data)) == (tensorfile.scan(p, keep=False).sha256, len(data))
    for got in (loaded, streamed, random_access, scanned.tensors()):
        assert set(got) == set(ref)
        for k, t in ref.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_stream_yields_in_file_order_one_tensor_at_a_time(tmp_path: Path) -> None:
    p = _write(tmp_path, bytes(save(_every_dtype())))
    order = [s.name for s in tensorfile.read_header(p).in_file_order()]
    assert [name for name, _ in tensorfile.iter_tensors(p)] == order


def test_wrong_pin_is_refused_before_parsing_and_after_streaming(tmp_path: Path) -> None:
    data = corpus.valid_safetensors()
    p = _write(tmp_path, data)
    wrong = "0" * 64
    with pytest.raises(IntegrityError, match="the pin is"):
        tensorfile.load(p, expected_sha256=wrong)
    with pytest.raises(IntegrityError, match="the pin is"):
        tensorfile.TensorReader(p, expected_sha256=wrong)
    seen = []
    with pytest.raises(IntegrityError, match="the pin is"):
        for name, _ in tensorfile.iter_tensors(p, expected_sha256=wrong):
            seen.append(name)
    assert len(seen) == 3  # the stream ends in the refusal, never in a normal return
    # A corrupt file with a wrong pin is refused for the pin, before its header is looked at.
    bad = _write(tmp_path, MUTATIONS["st_duplicate_names"][0], "bad.safetensors")
    with pytest.raises(IntegrityError, match="the pin is"):
        tensorfile.load(bad, expected_sha256=wrong)


@pytest.mark.parametrize(("pin", "cause"), [(v, c) for v, c in corpus.DIGEST_CASES.values()])
def test_malformed_pins_are_refused(tmp_path: Path, pin: str, cause: str) -> None:
    p = _write(tmp_path, corpus.valid_safetensors())
    with pytest.raises(IntegrityError, match=cause):
        tensorfile.load(p, expected_sha256=pin)


def test_dtype_allow_list_can_be_narrowed(tmp_path: Path) -> None:
    p = _write(tmp_path, corpus.valid_safetensors())
    with pytest.raises(IntegrityError, match="allowed here: F64"):
        tensorfile.read_header(p, dtypes={"F64"})
    assert set(tensorfile.load(p, dtypes={"F32", "I64", "BOOL"})) == {"a", "b", "c"}


SCHEMA = tensorfile.Schema("test file", {"w": ("F32", 2), "n": ("I64", 1)},
                          optional=((r"extra\.[0-9]+", "U8", 1),), metadata={"format": "t/v1"})


@pytest.mark.parametrize(("tensors", "metadata", "cause"), [
    ({"w": torch.zeros(2, 3), "n": torch.zeros(4, dtype=torch.int64)}, {"format": "t/v0"}, "metadata"),
    ({"w": torch.zeros(2, 3)}, {"format": "t/v1"}, "missing tensors ['n']"),
    ({"w": torch.zeros(2, 3), "n": torch.zeros(4, dtype=torch.int64), "x": torch.zeros(1, dtype=torch.uint8)},
     {"format": "t/v1"}, "unexpected tensor 'x'"),
    ({"w": torch.zeros(2, 3), "n": torch.zeros(4, dtype=torch.int64),
      "extra.\u0661": torch.zeros(1, dtype=torch.uint8)}, {"format": "t/v1"}, "unexpected tensor"),  # Arabic-Indic 1
    ({"w": torch.zeros(6), "n": torch.zeros(4, dtype=torch.int64)}, {"format": "t/v1"},
     "rank 1, expected F32 of rank 2"),
    ({"w": torch.zeros(2, 3, dtype=torch.float64), "n": torch.zeros(4, dtype=torch.int64)}, {"format": "t/v1"},
     "allowed here: F32, I64, U8"),
    ({"w": torch.zeros(2, 3), "n": torch.zeros(4, dtype=torch.int32)}, {"format": "t/v1"},
     "allowed here: F32, I64, U8"),
])
def test_a_format_schema_is_enforced_by_every_reader(tmp_path: Path, tensors: dict[str, torch.Tensor],
                                                     metadata: dict[str, str], cause: str) -> None:
    data = save(tensors, metadata=metadata)
    p = _write(tmp_path, data)
    for read in (lambda: tensorfile.read_header(p, schema=SCHEMA), lambda: tensorfile.load(p, schema=SCHEMA),
                 lambda: tensorfile.scan(p, schema=SCHEMA).validated(),
                 lambda: tensorfile.scan(data, schema=SCHEMA, digest="spans").validated(),
                 lambda: tensorfile.TensorReader(p, schema=SCHEMA)):
        with pytest.raises(IntegrityError) as exc:
            read()
        assert cause in exc.value.message


def test_a_file_that_follows_its_schema_is_read_exactly_with_either_digest(tmp_path: Path) -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.arange(4),
               "extra.0": torch.ones(3, dtype=torch.uint8)}
    data = save(tensors, metadata={"format": "t/v1"})
    p = _write(tmp_path, data)
    file_scan = tensorfile.scan(p, schema=SCHEMA)
    spans = tensorfile.scan(p, schema=SCHEMA, digest="spans", keep=False, workers=3)
    assert file_scan.sha256 == tensorfile.hashlib.sha256(data).hexdigest() and spans.sha256 is None
    header = spans.validated()
    assert spans.header_sha256 == tensorfile.hashlib.sha256(data[:header.data_start]).digest()
    for name, spec in header.tensors.items():
        span = data[header.data_start + spec.begin:header.data_start + spec.end]
        assert spans.tensor_sha256[name] == tensorfile.hashlib.sha256(span).digest()
    got = file_scan.tensors()
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())


def test_non_regular_files_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)  # opening a FIFO for reading would block forever without O_NONBLOCK
    link = tmp_path / "link.safetensors"
    link.symlink_to(_write(tmp_path, corpus.valid_safetensors()))
    for path in (fifo, tmp_path, Path("/dev/zero")):
        with pytest.raises(IntegrityError, match="not a regular file"):
            tensorfile.load(path)
    with pytest.raises(IntegrityError, match="symbolic link"):
        tensorfile.load(link)  # refused by default (a file inside an artifact)
    assert set(tensorfile.load(link, follow_symlinks=True)) == {"a", "b", "c"}  # a file the user names
    with pytest.raises(IntegrityError, match="cannot open"):
        tensorfile.load(tmp_path / "missing.safetensors")


def test_in_memory_limit_points_at_the_streaming_reader(tmp_path: Path) -> None:
    p = _write(tmp_path, corpus.valid_safetensors())
    with pytest.raises(IntegrityError, match="in-memory limit") as exc:
        tensorfile.load(p, max_bytes=16)
    assert "TensorReader" in exc.value.diagnostics()


def test_header_limit_is_enforced_on_a_real_oversized_header(tmp_path: Path) -> None:
    data = bytes(save({"a": torch.zeros(1)}, metadata={"pad": "x" * 4096}))
    p = _write(tmp_path, data)
    with pytest.raises(IntegrityError, match="2048-byte header limit"):
        tensorfile.parse_header(data, len(data), where=p, max_header_bytes=2048)
    assert "a" in tensorfile.read_header(p).tensors


@pytest.mark.parametrize("header_len", [640, 896, 1152, 1408, 640 + 65536])
def test_a_header_length_that_starts_like_a_pickle_stream_is_still_safetensors(header_len: int) -> None:
    # 640 is b"\x80\x02" little-endian, a pickle stream's first two bytes; "{" at byte 8 settles it.
    import json
    import pickle
    import struct

    original = save({"w": torch.arange(6, dtype=torch.float32)})
    (n,) = struct.unpack("<Q", original[:8])
    header = json.loads(original[8:8 + n])
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", header_len) + raw + b" " * (header_len - len(raw)) + original[8 + n:]
    assert data[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
    assert torch.equal(tensorfile.load_bytes(data)[1]["w"], torch.arange(6, dtype=torch.float32))
    with pytest.raises(IntegrityError, match="pickle stream"):
        tensorfile.load_bytes(pickle.dumps({"w": [1, 2]}, protocol=2) + b"\0" * 16)


ALL_DTYPES = {"b": torch.tensor([True, False, True]), "u8": torch.arange(5, dtype=torch.uint8),
              "i8": torch.tensor([-3, 4], dtype=torch.int8), "i16": torch.tensor([[-300]], dtype=torch.int16),
              "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3), "i64": torch.tensor(7),
              "f16": torch.tensor([0.5, -1.0], dtype=torch.float16),
              "bf16": torch.tensor([1.5, 2.0], dtype=torch.bfloat16), "f32": torch.randn(3, 2).t(),
              "f64": torch.randn(2, 2, dtype=torch.float64), "empty": torch.zeros(0, 4)}


def test_encoded_files_are_read_back_exactly_by_safetensors_and_by_every_reader(tmp_path: Path) -> None:
    enc = tensorfile.encode(ALL_DTYPES, metadata={"format": "t/v1"})
    back = st_load(enc.data)  # the safetensors library itself reads what the encoder writes
    assert back.keys() == ALL_DTYPES.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in ALL_DTYPES.items())
    spans = tensorfile.scan(enc.data, digest="spans", keep=False)
    assert spans.validated() == enc.header and spans.header_sha256 == enc.header_sha256
    assert spans.tensor_sha256 == enc.tensor_sha256 and enc.header.metadata == {"format": "t/v1"}
    for spec in enc.header.tensors.values():  # every tensor starts at a multiple of its element size
        assert (enc.header.data_start + spec.begin) % tensorfile.ITEMSIZE[spec.dtype] == 0
    p = _write(tmp_path, enc.data)
    got = tensorfile.load(p)
    assert all(torch.equal(got[k], v) for k, v in ALL_DTYPES.items())
    assert enc.data == save({k: v.contiguous() for k, v in ALL_DTYPES.items()}, metadata={"format": "t/v1"})


@pytest.mark.parametrize(("tensors", "cause"), [
    ({"w": torch.zeros(2, 3), "n": torch.zeros(4, dtype=torch.int32)}, "allowed here: F32, I64, U8"),
    ({"w": torch.zeros(6), "n": torch.zeros(4, dtype=torch.int64)}, "rank 1, expected F32 of rank 2"),
    ({"w": torch.zeros(2, dtype=torch.complex64)}, "only CPU tensors of"),
    ({"": torch.zeros(2)}, "tensor name '' cannot be written"),
    ({"__metadata__": torch.zeros(2)}, "tensor name '__metadata__' cannot be written"),
    ({"w": torch.zeros([1] * 17)}, "has rank 17; readers accept at most 16"),
    ({"w": torch.zeros(2, 3), "n": torch.zeros(4, dtype=torch.int64),
      "extra.0": torch.tensor([1, 2], dtype=torch.uint8).view(torch.bool)}, "BOOL but holds bytes"),
])
def test_the_encoder_refuses_what_a_reader_would_refuse(tensors: dict[str, torch.Tensor], cause: str) -> None:
    with pytest.raises(IntegrityError) as exc:
        tensorfile.encode(tensors, metadata={"format": "t/v1"}, schema=SCHEMA)
    assert cause in exc.value.message


def test_a_scan_that_keeps_nothing_hashes_the_whole_file_across_span_boundaries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing kept or visited and no BOOL tensor, the data section is read in whole chunks: the digest
    is still the file's, chunk boundaries falling inside tensors; a BOOL tensor keeps its byte check."""
    import hashlib

    monkeypatch.setattr(tensorfile, "CHUNK", 24)  # many chunks, none aligned with a tensor
    tensors = {f"layer.{i}.lora_{ab}": torch.arange(i + 3, dtype=dt) for i in range(5) for ab, dt in
               (("A", torch.float32), ("B", torch.bfloat16))}
    p = _write(tmp_path, save(tensors))
    scanned = tensorfile.scan(p, keep=False)
    assert scanned.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    assert sorted(scanned.validated().tensors) == sorted(tensors)
    bad = bytearray(save({"w": torch.zeros(3), "m": torch.tensor([True, False, True])}))
    bad[-2] = 7  # a BOOL byte other than 0 and 1
    q = _write(tmp_path, bytes(bad), "bool.safetensors")
    scanned = tensorfile.scan(q, keep=False)
    assert scanned.sha256 == hashlib.sha256(bytes(bad)).hexdigest()
    with pytest.raises(IntegrityError, match="BOOL"):
        scanned.validated()


def test_a_header_validated_once_is_reused_only_for_the_same_bytes_and_size() -> None:
    """reduce reads one header layout per ablation many times: a validated header is kept by its bytes and
    the file size; every hit names its own file and owns its dicts, and a different size is validated anew."""
    data = save({"a": torch.zeros(4), "b": torch.ones(2, 3)})
    first = tensorfile.parse_header(data, len(data), where="one")
    first.tensors.clear()  # a caller's change to its own copy reaches no later hit
    again = tensorfile.parse_header(data, len(data), where="two")
    assert again.where == "two" and sorted(again.tensors) == ["a", "b"]
    assert again.tensors["b"].shape == (2, 3) and again.data_start == first.data_start
    with pytest.raises(IntegrityError, match="data section") as exc:
        tensorfile.parse_header(data + b"\0", len(data) + 1, where="three")  # same header bytes, a byte more
    assert "three" in exc.value.diagnostics()
