"""The payload codec, the manifest reader, the optimizer contract and the knob registry (no model)."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replayjob import tensorfile
from replayjob.artifacts import capture_manifest as manifest
from replayjob.artifacts import capture_payload as payload
from replayjob.artifacts import capture_reader as manifests
from replayjob.config import load_config
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError
from replayjob.jsonio import canonical_bytes
from replayjob.producers.contract import contract_sha256, optimizer_contract
from replayjob.rl import batch as batch_mod
from replayjob.rl.batch import OptimizerBatch
from replayjob.runtime import knobs

FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")


def make_batch(rows: int = 3, seed: int = 0) -> OptimizerBatch:
    g = torch.Generator().manual_seed(seed)
    resp = [2 + i for i in range(rows)]
    seqs = [[5 + i] * 3 + [7] * n for i, n in enumerate(resp)]
    T = max(resp)
    mask = torch.zeros((rows, T), dtype=torch.float64)
    for i, n in enumerate(resp):
        mask[i, :n] = 1
    fields = {k: torch.randn((rows, T), generator=g, dtype=torch.float64) * mask for k in FIELDS}
    for k in ("old_logprobs", "ref_logprobs"):  # each field in its declared domain (payload.FIELD_DOMAINS)
        fields[k] = -fields[k].abs()
    fields["loss_weights"] = fields["loss_weights"].abs()
    return OptimizerBatch.from_padded(seqs, [3] * rows, fields, mask)


def rng() -> dict[str, torch.Tensor]:
    return {"cpu": torch.get_rng_state()}


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def mutate(mut: Any) -> bytes:
    header, body = split(payload.encode(make_batch(), rng()))
    out = mut(header, body)
    return join(header, body) if out is None else bytes(out)


def refused(data: bytes, needle: str) -> None:
    with pytest.raises(IntegrityError) as exc:
        payload.decode(data)
    assert needle in exc.value.message, exc.value.message


def test_round_trip_is_exact_and_bytes_are_stable() -> None:
    b = make_batch()
    data = payload.encode(b, rng())
    assert payload.encode(b, rng()) == data
    b2, r2 = payload.decode(data)
    assert b2.logical_sha256() == b.logical_sha256() and b2.effective_sha256() == b.effective_sha256()
    for k, v in b.tensors().items():
        assert torch.equal(getattr(b2, k), v), k
    assert torch.equal(r2["cpu"], torch.get_rng_state())


def test_cuda_rng_keys_round_trip_without_a_gpu() -> None:
    state = {"cpu": torch.get_rng_state(), "cuda.0": torch.arange(16, dtype=torch.uint8)}
    _, r = payload.decode(payload.encode(make_batch(), state))
    assert sorted(r) == ["cpu", "cuda.0"] and torch.equal(r["cuda.0"], state["cuda.0"])


def _set(path: tuple[str, ...], value: Any) -> Any:
    def f(header: dict[str, Any], body: bytes) -> None:
        node = header
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return f


@pytest.mark.parametrize(("mut", "needle"), [
    (lambda h, b: b"\x01\x02", "truncated: 2 bytes"),
    (lambda h, b: struct.pack("<Q", 10**9) + b"{}", "above the"),
    (lambda h, b: struct.pack("<Q", 500) + b"{}", "header length 500 is larger than the file"),
    (lambda h, b: struct.pack("<Q", 6) + b"[1, 2]", "header does not start with '{'"),
    (_set(("__metadata__", "format"), "pt"), "payload metadata {'format': 'pt'} is not"),
    (lambda h, b: h.pop("advantages") and None, "unaccounted bytes before tensor"),
    (_set(("extra",), {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}), "unexpected tensor 'extra'"),
    (_set(("tokens", "dtype"), "F64"), "'tokens' is F64 of rank 1, expected I64 of rank 1"),
    (_set(("rng.cpu", "dtype"), "I64"), "x 8 bytes (I64)"),
    (_set(("prompt_lens", "shape"), [1, 3]), "'prompt_lens' is I64 of rank 2, expected I64 of rank 1"),
    (_set(("prompt_lens", "data_offsets"), [0, 10**9]), "are out of range of the"),
    (_set(("prompt_lens", "shape"), [4]), "shape [4] x 8 bytes (I64) is 32 bytes, its span holds 24"),
    (lambda h, b: join(h, b + b"\0" * 8), "the tensors cover"),
])
def test_malformed_headers_are_refused(mut: Any, needle: str) -> None:
    refused(mutate(mut), needle)


def test_overlapping_data_offsets_are_refused() -> None:
    def f(h: dict[str, Any], b: bytes) -> bytes:
        a, c = h["prompt_lens"], h["loss_weights"]
        a["data_offsets"] = [c["data_offsets"][0], c["data_offsets"][0] + 24]
        return join(h, b)
    refused(mutate(f), "unaccounted bytes before tensor")


def test_duplicate_tensor_names_are_refused() -> None:
    header, body = split(payload.encode(make_batch(), rng()))
    raw = json.dumps(header).encode()
    dup = raw[:-1] + b', "tokens": ' + json.dumps(header["tokens"]).encode() + b"}"
    with pytest.raises(IntegrityError, match="duplicate tensor name 'tokens'"):
        payload.decode(struct.pack("<Q", len(dup)) + dup + body)


def test_pickle_is_never_loaded(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save(make_batch().tensors(), buf)
    refused(buf.getvalue(), "pickle is never loaded")


class _Touch:
    """Unpickling this creates a file: evidence that a loader executed pickle."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_a_raw_pickle_is_refused_without_being_executed(tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "executed"
    for protocol in (2, 4, 5):
        with pytest.raises(IntegrityError):
            payload.decode(pickle.dumps(_Touch(marker), protocol=protocol))
    assert not marker.exists()


def _int_field(name: str, index: int, value: int) -> Any:
    def f(h: dict[str, Any], b: bytes) -> bytes:
        begin = h[name]["data_offsets"][0] + 8 * index
        body = bytearray(b)
        body[begin:begin + 8] = struct.pack("<q", value)
        return join(h, bytes(body))
    return f


@pytest.mark.parametrize(("name", "index", "value", "needle"), [
    ("token_offsets", 0, 1, "token_offsets[0] is 1"),
    ("token_offsets", 2, 0, "token_offsets decreases at row 1"),
    ("token_offsets", 3, 10**6, "token_offsets end at 1000000"),
    ("resp_offsets", 1, 3, "row 0: 5 tokens, prompt length 3 and 3 response values"),
    ("prompt_lens", 0, 0, "row 0"),
    ("prompt_lens", 1, 99, "row 1"),
    ("tokens", 4, -7, "negative token id"),
])
def test_tampered_offsets_and_lengths_are_refused_before_tensors(name: str, index: int, value: int,
                                                                 needle: str) -> None:
    refused(mutate(_int_field(name, index, value)), needle)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_are_refused_naming_the_row(bad: float) -> None:
    b = make_batch()
    w = b.old_logprobs.clone()
    w[int(b.resp_offsets[2]) + 1] = bad
    data = payload.encode(OptimizerBatch(**{**b.tensors(), "old_logprobs": w}), rng())
    refused(data, "row 2 holds a non-finite old_logprobs value")


def test_rng_state_of_the_wrong_size_is_refused() -> None:
    refused(payload.encode(make_batch(), {"cpu": torch.zeros(7, dtype=torch.uint8)}), "rng.cpu has 7 bytes")


def _reference_digest(kind: str, arrays: list[tuple[str, torch.Tensor, str]]) -> str:
    """The documented batch digest (replayjob.digest.batch_sha256 of the rows' one part), written out
    independently of replayjob.rl.batch and replayjob.digest."""
    tensors = {name: ["int64" if fmt == "<i8" else "float64", [t.numel()],
                      hashlib.sha256(t.numpy().astype(fmt).tobytes()).hexdigest()] for name, t, fmt in arrays}
    doc = {"digest": "replayjob.batch_digest/v3", "kind": kind, "parts": [{"tensors": tensors, "values": {}}]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _reference(b: OptimizerBatch, keep: list[int]) -> tuple[str, str]:
    def arrays(rows: list[int]) -> list[tuple[str, torch.Tensor, str]]:
        toks = [b.row_tokens(i) for i in rows]
        resp = [b.row_field("loss_weights", i).numel() for i in rows]

        def cat(xs: list[torch.Tensor], dt: torch.dtype) -> torch.Tensor:
            return torch.cat(xs) if xs else torch.zeros(0, dtype=dt)
        out = [("token_offsets", torch.tensor([0, *itertools.accumulate(t.numel() for t in toks)]), "<i8"),
               ("prompt_lens", b.prompt_lens[rows], "<i8"),
               ("resp_offsets", torch.tensor([0, *itertools.accumulate(resp)]), "<i8"),
               ("tokens", cat(toks, torch.int64), "<i8")]
        return out + [(k, cat([b.row_field(k, i) for i in rows], torch.float64), "<f8") for k in FIELDS]
    everything = list(range(b.rows))
    return (_reference_digest("logical", arrays(everything)),
            _reference_digest("effective", [("row_index", torch.tensor(keep, dtype=torch.int64), "<i8"),
                                            *arrays(keep)]))


def test_row_digests_follow_the_documented_layout() -> None:
    b = make_batch(4)
    assert b.digests() == _reference(b, [0, 1, 2, 3])
    assert (b.logical_sha256(), b.effective_sha256()) == b.digests()
    w = b.loss_weights.clone()
    w[int(b.resp_offsets[1]):int(b.resp_offsets[2])] = 0  # row 1 carries no loss weight
    zero1 = OptimizerBatch(**{**b.tensors(), "loss_weights": w})
    assert zero1.digests() == _reference(zero1, [0, 2, 3])
    assert zero1.logical_sha256() != b.logical_sha256()
    # a change inside the weightless row changes the logical digest only
    adv = zero1.advantages.clone()
    adv[int(b.resp_offsets[1])] += 1.0
    other = OptimizerBatch(**{**zero1.tensors(), "advantages": adv})
    assert other.effective_sha256() == zero1.effective_sha256()
    assert other.logical_sha256() != zero1.logical_sha256()
    none = OptimizerBatch(**{**b.tensors(), "loss_weights": torch.zeros_like(w)})
    assert none.digests() == _reference(none, [])


def test_large_arrays_hash_on_threads_to_the_same_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    b = make_batch(5)
    w = b.loss_weights.clone()
    w[:int(b.resp_offsets[1])] = 0
    b = OptimizerBatch(**{**b.tensors(), "loss_weights": w})
    inline = b.digests()
    monkeypatch.setattr(batch_mod, "_PARALLEL_MIN_BYTES", 1)
    assert b.digests() == inline == _reference(b, [1, 2, 3, 4])


@pytest.mark.parametrize("values", [
    [0.1] * 1000,
    [1e308, -1e308, 1e-320, 5e-324, -3e-310, 1.0],
    [1e16, 1.0, -1e16, 1e-16, 3.0],
    [2.0 ** 53, 1.0, 1.0, -(2.0 ** 53)],
    [-0.0, -0.0],
    [],
    [float("nan"), 1.0],
    [float("inf"), 1.0],
])
def test_exact_sum_equals_fsum(values: list[float]) -> None:
    t = torch.tensor(values, dtype=torch.float64)
    got, want = payload.exact_sum(t), math.fsum(values)
    assert got == want or (math.isnan(got) and math.isnan(want))
    assert math.copysign(1, got) == math.copysign(1, want)


def test_exact_sum_equals_fsum_across_chunks_and_exponents() -> None:
    g = torch.Generator().manual_seed(3)
    n = 3 * (1 << 16) + 17
    t = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-1000, 1000, (n,), generator=g).to(torch.float64))
    assert payload.exact_sum(t) == math.fsum(t.tolist())
    w = torch.rand(n, generator=g, dtype=torch.float64) / n
    assert payload.exact_sum(w) == math.fsum(w.tolist())


def test_exact_sum_fed_in_pieces_is_the_sum_of_the_whole() -> None:
    g = torch.Generator().manual_seed(5)
    t = torch.randn(10_007, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-60, 60, (10_007,), generator=g).to(torch.float64))
    acc = payload.ExactSum()
    for piece in t.split(333):
        acc.add(piece.numpy())
    assert acc.value() == math.fsum(t.tolist()) == payload.exact_sum(t)


def reference_span_digest(data: bytes) -> str:
    """The payload digest exactly as docs/optimizer-batch.md words it, independently of the reader."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__")
    h = hashlib.sha256(b"replayjob.payload-spans.v1\n" + struct.pack("<Q", len(data)))
    h.update(hashlib.sha256(data[:8 + n]).digest())
    for _, entry in sorted(header.items(), key=lambda kv: (*kv[1]["data_offsets"], kv[0])):
        begin, end = (8 + n + o for o in entry["data_offsets"])
        h.update(struct.pack("<Q", end - begin) + hashlib.sha256(data[begin:end]).digest())
    return h.hexdigest()


def test_span_digest_follows_the_documented_layout_and_covers_every_byte() -> None:
    data = payload.encode(make_batch(), rng())
    digest = payload.digest_bytes(data)
    assert digest == reference_span_digest(data) != sha256_bytes(data)
    (n,) = struct.unpack("<Q", data[:8])
    for pos in (9, 8 + n, 8 + n + 7, len(data) // 2, len(data) - 1):  # header, first/mid/last data bytes
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        s = payload.scan_bytes(bytes(flipped))
        assert s.header_fault is not None or s.digest != digest, pos


@pytest.mark.parametrize("chunk", [8, 64, tensorfile.CHUNK])
def test_streaming_and_kept_reads_agree_on_every_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        chunk: int) -> None:
    # A tiny chunk forces many chunks per span and the parallel span readers on a small file.
    monkeypatch.setattr(tensorfile, "CHUNK", chunk)
    b = make_batch(rows=7, seed=4)
    data = payload.encode(b, rng())
    p = tmp_path / "p.safetensors"
    p.write_bytes(data)
    streamed, kept = payload.read(p, keep=False), payload.read(p, keep=True)
    assert streamed.digest == kept.digest == payload.digest_bytes(data) == reference_span_digest(data)
    assert streamed.batch is None and kept.batch is not None
    assert streamed.rows == kept.rows == payload.summary(b)
    assert streamed.row_digests() == kept.row_digests() == b.digests()
    assert torch.equal(streamed.rng["cpu"], rng()["cpu"])
    for k, v in b.tensors().items():
        assert torch.equal(getattr(kept.batch, k), v), k


def test_rows_without_loss_weight_need_the_kept_rows_for_the_effective_digest(tmp_path: Path) -> None:
    b = make_batch(rows=4, seed=2)
    w = b.loss_weights.clone()
    w[int(b.resp_offsets[1]):int(b.resp_offsets[2])] = 0  # row 1 bears no loss
    b = OptimizerBatch(**{**b.tensors(), "loss_weights": w})
    p = tmp_path / "p.safetensors"
    p.write_bytes(payload.encode(b, rng()))
    assert payload.read(p, keep=False).row_digests() is None  # explain then reads again, keeping rows
    assert payload.read(p, keep=True).row_digests() == b.digests()


def test_non_finite_value_in_a_later_chunk_names_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorfile, "CHUNK", 16)
    b = make_batch(rows=6)
    adv = b.advantages.clone()
    adv[int(b.resp_offsets[4]) + 1] = float("inf")
    data = payload.encode(OptimizerBatch(**{**b.tensors(), "advantages": adv}), rng())
    with pytest.raises(IntegrityError, match="row 4 holds a non-finite advantages value"):
        payload.decode(data)


def test_a_payload_whose_header_length_reads_like_a_pickle_prefix_decodes() -> None:
    header, body = split(payload.encode(make_batch(), rng()))
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", 1152) + raw + b" " * (1152 - len(raw)) + body  # b"\x80\x04": pickle protocol 4
    b2, _ = payload.decode(data)
    assert b2.digests() == make_batch().digests()


def test_non_ascii_digits_in_an_rng_name_are_refused_as_a_domain_error() -> None:
    def rename(h: dict[str, Any], body: bytes) -> None:
        # "²".isdigit() is True; int("²") raises; an empty span at the end passes every generic check
        h["rng.cuda.\u00b2"] = {"dtype": "U8", "shape": [0], "data_offsets": [len(body), len(body)]}
    with pytest.raises(IntegrityError, match=r"unexpected tensor 'rng\.cuda"):
        payload.decode(mutate(rename))


def test_overflowing_sums_and_non_finite_values_raise_no_warning_and_no_traceback() -> None:
    import warnings

    b = make_batch(rows=3)
    w, old = b.loss_weights.clone(), b.old_logprobs.clone()
    w[:2] = 1.7e308  # finite values whose sum overflows float64
    old[0], old[1] = float("inf"), float("-inf")
    data = payload.encode(OptimizerBatch(**{**b.tensors(), "loss_weights": w, "old_logprobs": old}), rng())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = payload.scan_bytes(data)  # what a reader sees before it compares the digest
    assert s.digest == payload.digest_bytes(data) and s.fault is not None
    assert "row 0 holds a non-finite old_logprobs value" in s.fault.message
    big = payload.ExactSum()
    big.add(np.array([1.7e308, 1.7e308]))
    assert big.value() == math.inf
    huge = payload.encode(OptimizerBatch(**{**b.tensors(), "loss_weights": w}), rng())
    with pytest.raises(IntegrityError, match="loss weights sum beyond the float64 range"):
        payload.decode(huge)


@pytest.mark.parametrize("old", manifest.OLD_SCHEMAS)
def test_a_manifest_of_an_earlier_release_is_refused_naming_both_versions(tmp_path: Path, old: str) -> None:
    doc = {**manifest_doc(), "schema": old}
    p, sha = write_manifest(tmp_path, doc)
    with pytest.raises(IntegrityError) as exc:
        manifests.read(p, sha)
    assert exc.value.exit_code == 2
    assert old in exc.value.message and manifest.SCHEMA in exc.value.message and "earlier replayjob release" in \
        exc.value.message and "capture the step again" in exc.value.diagnostics()


def test_decode_views_a_writable_buffer_and_copies_unaligned_spans() -> None:
    b = make_batch()
    data = payload.encode(b, rng())
    buf = bytearray(data)
    b2, _ = payload.decode(buf)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert all(base <= t.data_ptr() < base + len(buf) for t in b2.tensors().values())  # no copy
    header, body = split(data)
    raw = json.dumps(header).encode()
    raw += b" " * ((1 - 8 - len(raw)) % 8)  # the data section starts 1 byte past an 8-byte boundary
    shifted = struct.pack("<Q", len(raw)) + raw + body
    assert (8 + len(raw)) % 8 != 0
    b3, _ = payload.decode(shifted)
    for k, v in b.tensors().items():
        assert torch.equal(getattr(b3, k), v), k
    assert b3.digests() == b.digests()


# -- manifest ---------------------------------------------------------------------------------------

def manifest_doc() -> dict[str, Any]:
    cfg = load_config(None, ["training.seed=1"])
    data = payload.encode(make_batch(), rng())
    return manifest.build(step=0, producer={"device": "cpu"}, payload_file=manifest.payload_name(0),
                          payload_size=len(data), payload_digest=payload.digest_bytes(data), rng_keys=["cpu"],
                          rows={"rows": 3, "tokens": 18, "response_tokens": 9, "loss_bearing_tokens": 9},
                          logical="a" * 64, effective="b" * 64, resolved_config={"x": 1},
                          contract=optimizer_contract(cfg), adapter_path=Path("/x/a.safetensors"),
                          adapter_size=10, adapter_sha256="c" * 64)


def write_manifest(tmp_path: Path, doc: dict[str, Any]) -> tuple[Path, str]:
    p = tmp_path / manifest.manifest_name(0)
    raw = canonical_bytes(doc) + b"\n"
    p.write_bytes(raw)
    return p, sha256_bytes(raw)


def test_manifest_round_trip_and_exclusive_write(tmp_path: Path) -> None:
    doc = manifest_doc()
    p = tmp_path / manifest.manifest_name(0)
    sha = manifest.write(p, doc)
    m = manifest.read_verified(p, sha.upper())
    assert m.doc == doc and m.sha256 == sha and m.payload_path == tmp_path / manifest.payload_name(0)
    with pytest.raises(Exception, match="refusing to overwrite"):
        manifest.write(p, doc)


def test_manifest_digest_is_checked_before_parsing(tmp_path: Path) -> None:
    p = tmp_path / "m.json"
    p.write_bytes(b'{"schema": NaN, "x": 1, "x": 2')
    with pytest.raises(IntegrityError, match="manifest SHA-256 is"):
        manifest.read_verified(p, "0" * 64)
    with pytest.raises(IntegrityError, match="malformed JSON"):
        manifest.read_verified(p, sha256_bytes(p.read_bytes()))


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d.update(extra=1), "unknown field `extra`"),
    (lambda d: d["payload"].update(file="../evil.safetensors"), "bare .safetensors file name"),
    (lambda d: d["payload"].update(file="/abs/p.safetensors"), "bare .safetensors file name"),
    (lambda d: d["payload"].update(spans_sha256="XYZ"), "payload.spans_sha256"),
    (lambda d: d["config"]["resolved"].update(x=2), "'config.sha256' does not match"),
    (lambda d: d["contract"]["value"].update(dtype="float16"), "'contract.sha256' does not match"),
    (lambda d: d.update(step=1), "'step' must be 0"),
    (lambda d: d.update(schema="v0"), "'schema' must be"),
    (lambda d: d["initial_adapter"].update(size="10"), "initial_adapter"),
])
def test_malformed_manifests_are_refused(tmp_path: Path, edit: Any, needle: str) -> None:
    doc = manifest_doc()
    edit(doc)
    p, sha = write_manifest(tmp_path, doc)
    with pytest.raises(IntegrityError) as exc:
        manifest.read_verified(p, sha)
    assert needle in exc.value.message


# -- contract and knobs -----------------------------------------------------------------------------

def test_contract_covers_the_math_and_not_the_systems_knobs() -> None:
    base = optimizer_contract(load_config(None, ["training.seed=1"]))
    for sets in (["training.micro_batch_size=1"], ["backend.options.gradient_checkpointing=true"],
                 ["backend.options.attn_implementation='sdpa'"], ["logging.dir='elsewhere'"]):
        assert optimizer_contract(load_config(None, ["training.seed=1", *sets])) == base, sets
    for sets in (["optimizer.lr=0.5"], ["optimizer.max_grad_norm=0.0"], ["algorithm.kl_loss_coef=0.1"],
                 ["model.dtype='bfloat16'"], ["lora.r=4"], ["backend.options.strict_deterministic=true"]):
        other = optimizer_contract(load_config(None, ["training.seed=1", *sets]))
        assert contract_sha256(other) != contract_sha256(base), sets


def test_math_mode_is_part_of_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["training.seed=1"])
    monkeypatch.setenv("REPLAYJOB_MATH_MODE", "prod")
    prod = optimizer_contract(cfg)
    monkeypatch.setenv("REPLAYJOB_MATH_MODE", "pedantic")
    assert prod["math_mode"] == "prod" and optimizer_contract(cfg) != prod


def test_every_knob_is_justified_and_the_required_ones_are_registered() -> None:
    assert {"backend.options.gradient_checkpointing", "training.micro_batch_size",
            "backend.options.attn_implementation"} <= set(knobs.KNOBS)
    for key, knob in knobs.KNOBS.items():
        assert len(knob.justification) > 40, key
        assert knobs.lookup({"a": {"b": 1}}, "a.b") == 1
        assert not knobs.is_ignored(key), key


def test_knob_conditions() -> None:
    plain = load_config(None, ["training.seed=1"])
    sdpa = load_config(None, ["training.seed=1", "backend.options.attn_implementation='sdpa'"])
    strict = load_config(None, ["training.seed=1", "backend.options.strict_deterministic=true"])
    attn = knobs.KNOBS["backend.options.attn_implementation"]
    assert attn.refusal(plain, sdpa) is None
    assert "strict_deterministic requires" in (attn.refusal(strict, sdpa) or "")
    mbs = knobs.KNOBS["training.micro_batch_size"]
    dropout = load_config(None, ["training.seed=1", "lora.dropout=0.1", "training.micro_batch_size=2"])
    assert mbs.refusal(plain, plain) is None and "dropout" in (mbs.refusal(dropout, dropout) or "")


def test_knobs_belong_to_their_producers_and_each_is_observed() -> None:
    assert set(knobs.knobs_for("replayjob")) == {"backend.options.gradient_checkpointing", "training.micro_batch_size",
                                                 "backend.options.attn_implementation", "distributed.world_size",
                                                 "distributed.strategy", "distributed.bucket_cap_mb",
                                                 "model.routing", "model.experts_implementation"}  # MoE (docs/moe.md)
    assert set(knobs.knobs_for("trl")) == {"trl.gradient_checkpointing", "model.attn_implementation",
                                           "trl.gradient_checkpointing_kwargs.use_reentrant",
                                           "trl.per_device_train_batch_size", "distributed.num_processes",
                                           "trl.gradient_accumulation_steps", "trl.steps_per_generation",
                                           "model.routing"}  # an MoE model's forced routing (docs/moe.md)
    assert knobs.knobs_for("torch") == {}  # a plain loop's whole config is its contract
    from replayjob.producers import BUILTIN, EXTERNAL, PRODUCERS

    assert set(PRODUCERS) == {knobs.BUILTIN, *EXTERNAL} and BUILTIN == knobs.BUILTIN
    assert set(knobs.KNOBS) == {k for p in PRODUCERS for k in knobs.knobs_for(p)}
    assert all(k.observe is not None and set(k.frameworks) <= set(PRODUCERS) for k in knobs.KNOBS.values())


def test_trl_knobs_are_read_from_the_checkpoint_function_in_effect() -> None:
    import functools

    from torch.utils.checkpoint import checkpoint

    class Layer(torch.nn.Linear):
        gradient_checkpointing = False  # what transformers' GradientCheckpointingLayer carries

    model = torch.nn.Sequential(Layer(2, 2), Layer(2, 2))
    model.config = type("Config", (), {"_attn_implementation": "sdpa"})()  # type: ignore[assignment]
    rt = knobs.Runtime(model, (2, 2))
    off = knobs.observe_all(rt, "trl")
    assert off == {"trl.gradient_checkpointing": False, "trl.gradient_checkpointing_kwargs.use_reentrant": None,
                   "model.attn_implementation": "sdpa", "trl.per_device_train_batch_size": 2,
                   "distributed.num_processes": None, "trl.gradient_accumulation_steps": None,
                   "trl.steps_per_generation": None,  # no trainer: not observed
                   "model.routing": "free"}  # no router: nothing is forced
    for layer in model:  # as activation_checkpointing_enable installs it
        layer.gradient_checkpointing = True  # type: ignore[assignment]
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=True)  # type: ignore[assignment]
    on = knobs.observe_all(rt, "trl")
    assert on["trl.gradient_checkpointing"] is True and on["trl.gradient_checkpointing_kwargs.use_reentrant"] is True
    reentrant = knobs.KNOBS["trl.gradient_checkpointing_kwargs.use_reentrant"]
    assert reentrant.expected(None, 4, {"trl.gradient_checkpointing": False}) is None  # no checkpoint function
    assert reentrant.expected(True, 4, {"trl.gradient_checkpointing": False}) is None
    assert reentrant.expected(None, 4, {"trl.gradient_checkpointing": True}) is False  # transformers' default
    assert reentrant.expected(True, 4, {"trl.gradient_checkpointing": True}) is True


def test_arm_names() -> None:
    r = {"backend": {"options": {"gradient_checkpointing": True}}, "training": {"micro_batch_size": 2}}
    assert knobs.arm_name([], r) == "baseline"
    assert knobs.arm_name(["backend.options.gradient_checkpointing"], r) == "gradient_checkpointing=true"
    assert knobs.arm_name(["training.micro_batch_size", "backend.options.gradient_checkpointing"], r) == \
        "gradient_checkpointing=true+micro_batch_size=2"
