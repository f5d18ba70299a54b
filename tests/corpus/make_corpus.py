"""Generate the bad-input corpus: every way an artifact replayjob reads can be corrupt, crafted or unsafe.

Nothing binary is committed; this script writes the corpus deterministically (same bytes every run)
into a directory, with ``index.json`` listing each entry::

    {"name": ..., "target": ..., "path": ..., "expect": ...}

``target`` names the reader (and so the command) the entry is fed to; ``expect`` is a lower-case
substring the refusal message must contain (the cause).  Entries that need a valid artifact to mutate
(a resume state, a capture, a bundle, replay metrics, a diag file) are made from the sources passed in;
the rest are self-contained.

Run it: ``python tests/corpus/make_corpus.py OUT --workspace WS`` (WS made by ``replayjob init``; the
valid sources are built with the real commands into ``OUT-sources``), or pass ready sources with
``--state DIR --capture DIR --bundle DIR --metrics DIR --diag FILE``.  The hostile tests call
:func:`build_sources` and :func:`generate` into a temporary directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from safetensors.torch import save

Mutation = tuple[bytes, str]  # (file bytes, expected cause substring)


@dataclass(frozen=True)
class Entry:
    name: str
    target: str
    path: str
    expect: str
    pins: dict[str, str] = field(default_factory=dict)  # digests the command is given (capture)


# --------------------------------------------------------------------------------------- safetensors
def _st(header: dict[str, Any] | str | bytes, data: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else (
        header.encode() if isinstance(header, str) else json.dumps(header).encode())
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _base_tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.arange(4, dtype=torch.int64), "c": torch.tensor([True, False, True])}


def valid_safetensors() -> bytes:
    return bytes(save(_base_tensors(), metadata={"format": "pt"}))


def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def torch_save_bytes() -> bytes:
    """A real ``torch.save`` zip archive (written, never loaded)."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    return buf.getvalue()


def safetensors_mutations(blob: bytes | None = None) -> dict[str, Mutation]:
    """Every structural defect the validated reader must refuse, each with its cause.

    ``blob`` is any valid safetensors file with at least one non-empty tensor (default: a small
    F32/I64/BOOL file); the defects are made relative to its own header, so the same corpus applies
    to capture payloads, bundle payloads and adapters.  Overlap needs two tensors.
    """
    blob = valid_safetensors() if blob is None else blob
    head, data = _split(blob)
    order = sorted((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"])
    first, last = order[0], order[-1]
    f_begin, f_end = head[first]["data_offsets"]
    l_begin = head[last]["data_offsets"][0]

    def edit(fn: Callable[[dict[str, Any]], None]) -> bytes:
        h = json.loads(json.dumps(head))
        fn(h)
        return _st(h, data)

    raw_header = json.dumps(head)
    dup_header = "{" + json.dumps(first) + ": " + json.dumps(head[first]) + ", " + raw_header[1:]
    shape = head[first]["shape"]
    out: dict[str, Mutation] = {
        "st_empty": (b"", "truncated"),
        "st_truncated_length": (blob[:5], "truncated"),
        "st_truncated_data": (blob[:-4], "out of range"),
        "st_header_length_past_eof": (_st(raw_header, data, length=len(raw_header) + len(data) + 1),
                                      "larger than the file"),
        "st_oversized_header": (struct.pack("<Q", 1 << 40) + b"{}", "header limit"),
        "st_zero_header": (struct.pack("<Q", 0), "empty header"),
        "st_header_not_json": (_st("{not json}", data), "strict json"),
        "st_header_invalid_utf8": (_st(b'{"a\xff":1}', data), "utf-8"),
        "st_header_not_object": (_st("[]", b""), "header does not start"),
        "st_header_deep": (_st('{"x":' + "[" * 200 + "]" * 200 + "}", b""), "nested"),
        "st_header_nan_shape": (_st(raw_header.replace(f'"shape": {json.dumps(shape)}',
                                                       f'"shape": [NaN{", 1" * (len(shape) - 1)}]', 1), data),
                                "non-finite"),
        "st_duplicate_names": (_st(dup_header, data), "duplicate tensor name"),
        "st_offsets_out_of_range": (edit(lambda h: h[last].update(
            data_offsets=[l_begin + 8, len(data) + 8])), "out of range"),
        "st_offsets_reversed": (edit(lambda h: h[first].update(data_offsets=[f_end, f_begin])), "out of range"),
        "st_offsets_gap": (_st({k: v for k, v in head.items() if k != first}, data),
                           "unaccounted bytes" if len(order) > 1 else "the tensors cover"),
        "st_trailing_bytes": (blob + b"\0" * 16, "the tensors cover"),
        "st_wrong_dtype": (edit(lambda h: h[first].update(dtype="F8_E4M3")), "dtype"),
        "st_object_dtype": (edit(lambda h: h[first].update(dtype="O")), "dtype"),
        "st_shape_size_mismatch": (edit(lambda h: h[first].update(shape=[*shape[:-1], shape[-1] + 1])),
                                   "its span holds"),
        "st_shape_overflow": (edit(lambda h: h[first].update(shape=[1 << 62, 1 << 62])), "its span holds"),
        "st_negative_shape": (edit(lambda h: h[first].update(shape=[-1, *shape])), "non-negative"),
        "st_extra_entry_key": (edit(lambda h: h[first].update(extra=1)), "exactly dtype"),
        "st_metadata_not_strings": (edit(lambda h: h.update(__metadata__={"format": 1})), "__metadata__"),
        "st_torch_save_renamed": (torch_save_bytes(), "pickle is never loaded"),
        "st_pickle_renamed": (pickle.dumps({"w": [0.0, 1.0]}, protocol=4), "pickle is never loaded"),
    }
    if len(order) >= 2:
        second = order[1]
        s_len = head[second]["data_offsets"][1] - head[second]["data_offsets"][0]
        out["st_overlapping_offsets"] = (edit(lambda h: h[second].update(
            data_offsets=[f_end - 1, f_end - 1 + s_len])), "overlap")
    if head[last]["dtype"] == "BOOL":
        out["st_bool_out_of_range"] = (blob[:-1] + b"\x02", "bool")
    return out


# -------------------------------------------------------------------------------------------- JSON
_BAD = "@@corpus-bad-value@@"


def json_mutations(doc: dict[str, Any], *, int_field: str, str_field: str, required: str,
                   schema_field: str = "schema") -> dict[str, Mutation]:
    """Generic defects of a valid JSON object: encoding, duplicates, depth, numbers, types, fields.

    ``int_field`` is a top-level integer field, ``str_field`` a top-level string field and
    ``required`` a field the reader cannot do without.
    """
    def dumps(d: dict[str, Any]) -> bytes:
        return json.dumps(d, indent=1, sort_keys=True).encode()

    def with_raw(field: str, raw: bytes) -> bytes:
        d = dict(doc)
        d[field] = _BAD
        return dumps(d).replace(json.dumps(_BAD).encode(), raw, 1)

    text = dumps(doc)
    first = sorted(doc)[0]
    dup = b'{\n "' + first.encode() + b'": ' + json.dumps(doc[first]).encode() + b",\n" + text[2:]
    missing = {k: v for k, v in doc.items() if k != required}
    return {
        "json_empty": (b"", "malformed json"),
        "json_truncated": (text[: len(text) // 2], "malformed json"),
        "json_invalid_utf8": (with_raw(str_field, b'"\xff\xfe"'), "utf-8"),
        "json_duplicate_key": (dup, "duplicate key"),
        "json_deep_nesting": (with_raw(int_field, b"[" * 5000 + b"]" * 5000), "nested"),
        "json_huge_int": (with_raw(int_field, b"1" + b"0" * 400), "digits"),
        "json_nan": (with_raw(int_field, b"NaN"), "nan"),
        "json_infinity": (with_raw(int_field, b"Infinity"), "infinity"),
        "json_neg_infinity": (with_raw(int_field, b"-Infinity"), "infinity"),
        "json_wrong_type": (with_raw(int_field, b'"0"'), int_field),
        "json_missing_field": (dumps(missing), required),
        "json_unknown_schema": (dumps({**doc, schema_field: "replayjob.unknown/v999"}), schema_field),
        "json_not_object": (b"[1, 2]", "object"),
    }


# -------------------------------------------------------------------------------------------- TOML
def toml_mutations() -> dict[str, Mutation]:
    """Config files `train` must refuse before any work, each naming the key or the cause."""
    return {
        "toml_unknown_key": (b"[training]\nsead = 1\n", "sead"),
        "toml_unknown_section": (b"[trainin]\nseed = 1\n", "trainin"),
        "toml_wrong_type": (b'[training]\nseed = "seven"\n', "training.seed"),
        "toml_bool_for_int": (b"[training]\nmax_steps = true\n", "training.max_steps"),
        "toml_infinite_float": (b"[optimizer]\nlr = inf\n", "finite"),
        "toml_nan_float": (b"[optimizer]\nlr = nan\n", "finite"),
        "toml_out_of_range": (b"[optimizer]\nlr = -1.0\n", "optimizer.lr"),
        "toml_bad_literal": (b'[training]\ntrainer = "ppo"\n', "allowed values"),
        "toml_huge_int": (b"[training]\nseed = 123456789012345678901234567890\n", "64-bit"),
        "toml_invalid": (b"[training\nseed = 1\n", "invalid toml"),
        "toml_invalid_utf8": (b"# \xff\xfe\n[training]\n", "utf-8"),
        "toml_deep_inline": (b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n", "invalid toml"),
        "toml_deep_table": (b"[" + b".".join([b"a"] * 990) + b"]\nx = 1\n", "a"),
        "toml_strict_without_seed": (b"[backend.options]\nstrict_deterministic = true\n", "training.seed"),
        "toml_two_devices": (b'[backend]\ndevices = "cuda:0,1"\n', "backend.devices"),
        "toml_secret_wrong_type": (b"[logging.metadata]\nhf_token = 1234567\n", "logging.metadata.hf_token"),
    }


def tolerance_mutations() -> dict[str, Mutation]:
    """Tolerance files (`reduce --claim approximate --tolerances FILE`), each refused by cause."""
    ok = b"update_cosine_min = 0.99\nrelative_delta_l2_max = 0.1\n"
    return {
        "tol_deep_nesting": (ok + b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n", "tolerance"),
        "tol_invalid_toml": (b"update_cosine_min = \n", "tolerance"),
        "tol_invalid_utf8": (ok + b"# \xff\n", "tolerance"),
        "tol_unknown_key": (ok + b"cosine = 1\n", "unknown"),
        "tol_missing_key": (b"update_cosine_min = 0.99\n", "missing"),
        "tol_nan": (b"update_cosine_min = nan\nrelative_delta_l2_max = 0.1\n", "update_cosine_min"),
        "tol_infinite": (b"update_cosine_min = 0.99\nrelative_delta_l2_max = inf\n", "relative_delta_l2_max"),
        "tol_wrong_type": (b'update_cosine_min = "high"\nrelative_delta_l2_max = 0.1\n', "update_cosine_min"),
        "tol_out_of_range": (b"update_cosine_min = 2.0\nrelative_delta_l2_max = 0.1\n", "update_cosine_min"),
    }


# ----------------------------------------------------------------------------------------- digests
DIGEST_CASES: dict[str, tuple[str, str]] = {
    "digest_short": ("ab" * 31, "64 hex characters"),
    "digest_long": ("ab" * 33, "64 hex characters"),
    "digest_non_hex": ("g" * 64, "not hexadecimal"),
    "digest_prefixed": ("sha256:" + "ab" * 32, "64 hex characters"),
    "digest_empty": ("", "64 hex characters"),
}


# ----------------------------------------------------------------------------------- resume state
def _state_files(state: Path) -> dict[str, Any]:
    return json.loads((state / "trainer_state.json").read_bytes())


def _write_state(d: Path, doc: dict[str, Any]) -> None:
    (d / "trainer_state.json").write_bytes(json.dumps(doc, indent=2, sort_keys=True).encode())


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def state_entries(src: Path, out: Path) -> list[Entry]:
    """Resume-state directories (read by `train` via resume.from), each with one defect."""
    entries: list[Entry] = []
    doc = _state_files(src)

    def copy(name: str) -> Path:
        d = out / name
        shutil.copytree(src, d, symlinks=True)
        return d

    for name, (data, expect) in json_mutations(doc, int_field="step", str_field="schema",
                                               required="files").items():
        d = copy(f"state_{name}")
        (d / "trainer_state.json").write_bytes(data)
        entries.append(Entry(f"state_{name}", "state", d.name, expect))
    # Tensor-file defects behind a consistent pin: the attacker edits both the file and its digest.
    for name, (data, expect) in safetensors_mutations().items():
        d = copy(f"state_{name}")
        (d / "adapter_model.safetensors").write_bytes(data)
        _write_state(d, {**doc, "files": {**doc["files"], "adapter_model.safetensors": _sha(data)}})
        entries.append(Entry(f"state_{name}", "state", d.name, expect))
    cases: dict[str, tuple[Callable[[Path], None], str]] = {
        "state_adapter_digest_mismatch": (
            lambda d: (d / "adapter_model.safetensors").write_bytes(valid_safetensors()), "sha-256"),
        "state_pin_short": (lambda d: _write_state(d, {**doc, "files": {
            **doc["files"], "adapter_model.safetensors": "ab" * 31}}), "64 hex"),
        "state_pin_non_hex": (lambda d: _write_state(d, {**doc, "files": {
            **doc["files"], "adapter_model.safetensors": "z" * 64}}), "not hexadecimal"),
        "state_pin_uppercase": (lambda d: _write_state(d, {**doc, "files": {
            **doc["files"], "adapter_model.safetensors": doc["files"]["adapter_model.safetensors"].upper()}}),
            "lowercase"),
        "state_file_dotdot": (lambda d: _write_state(d, {**doc, "files": {
            **doc["files"], "../escape.safetensors": "ab" * 32}}), "bad file entry"),
        "state_file_absolute": (lambda d: _write_state(d, {**doc, "files": {
            **doc["files"], "/etc/passwd": "ab" * 32}}), "bad file entry"),
        "state_adapter_symlink_outside": (_symlink_adapter, "not a regular file"),
        "state_adapter_device": (_device_adapter, "not a regular file"),
        "state_adapter_fifo": (_fifo_adapter, "not a regular file"),
        "state_adapter_pt": (lambda d: _pickle_adapter(d, doc), "pickle"),
    }
    for name, (fn, expect) in cases.items():
        d = copy(name)
        fn(d)
        entries.append(Entry(name, "state", d.name, expect))
    f = out / "state_is_a_file"
    f.write_bytes(b"not a directory\n")
    entries.append(Entry(f.name, "state", f.name, "not a directory"))
    return entries


def _symlink_adapter(d: Path) -> None:
    outside = d.parent / "outside_adapter.safetensors"
    if not outside.exists():
        outside.write_bytes(valid_safetensors())
    (d / "adapter_model.safetensors").unlink()
    os.symlink(os.path.relpath(outside, d), d / "adapter_model.safetensors")


def _device_adapter(d: Path) -> None:
    (d / "adapter_model.safetensors").unlink()
    os.symlink("/dev/zero", d / "adapter_model.safetensors")


def _fifo_adapter(d: Path) -> None:
    (d / "adapter_model.safetensors").unlink()
    os.mkfifo(d / "adapter_model.safetensors")


def _pickle_adapter(d: Path, doc: dict[str, Any]) -> None:
    data = torch_save_bytes()
    (d / "adapter_model.pt").write_bytes(data)
    _write_state(d, {**doc, "files": {**doc["files"], "adapter_model.pt": _sha(data)}})


# ---------------------------------------------------------------------------------- path defects
def _outside_copy(d: Path, src: Path) -> Path:
    """A valid copy of ``src`` next to (outside) the artifact directory ``d``."""
    outside = d.parent / f"outside-{d.name}-{src.name}"
    shutil.copyfile(src, outside)
    return outside


def _flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _replace_with_link(p: Path, target: str | Path) -> None:
    p.unlink()
    os.symlink(target, p)


def _replace_with_fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


# ------------------------------------------------------------------------------------------ capture
def _canon(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


# The capture payload goes through replayjob.tensorfile like every tensor file, so each entry is refused
# for the same cause; only an empty payload is refused earlier, by the manifest's size field.
PAYLOAD_CAUSES = {"st_empty": "payload.size"}


def _payload_pin(data: bytes) -> str:
    """The span digest a forger would pin, made with replayjob's own function; a header too broken to
    have one gets the plain SHA-256 (it is refused for its header before any pin is compared)."""
    from replayjob.artifacts.capture_payload import digest_bytes
    from replayjob.errors import ReplayjobError

    try:
        return digest_bytes(data)
    except ReplayjobError:
        return _sha(data)


def capture_entries(src: Path, out: Path) -> list[Entry]:
    """Capture directories (manifest + payload), fed to `explain` with the pins each entry carries.

    The pins are recomputed for the mutated manifest (a user who copied the pin from a tampered run),
    so every layer behind the pin is exercised; one entry keeps the original pin.
    """
    mname = next(p.name for p in src.glob("*.manifest.json"))
    mbytes = (src / mname).read_bytes()
    man = json.loads(mbytes)
    pname = man["payload"]["file"]
    pbytes = (src / pname).read_bytes()
    logical = man["logical_batch_sha256"]
    entries: list[Entry] = []

    def emit(name: str, expect: str, *, manifest: bytes | None = None, payload: bytes | None = None,
             doc: dict[str, Any] | None = None, fix: Callable[[Path], None] | None = None,
             pin: str | None = None, logical_pin: str = logical) -> None:
        d = out / name
        shutil.copytree(src, d, symlinks=True)
        if payload is not None:
            (d / pname).write_bytes(payload)
            doc = {**(doc or man), "payload": {**man["payload"], "size": len(payload),
                                                "spans_sha256": _payload_pin(payload)}}
        data = manifest if manifest is not None else (_canon(doc) if doc is not None else mbytes)
        (d / mname).write_bytes(data)
        if fix is not None:
            fix(d)
        pins = {"manifest": pin if pin is not None else _sha(data), "logical": logical_pin}
        entries.append(Entry(name, "capture", f"{d.name}/{mname}", expect, pins))

    for name, (data, expect) in json_mutations(man, int_field="step", str_field="schema",
                                               required="payload").items():
        emit(f"capture_{name}", expect, manifest=data)
    emit("capture_manifest_pin_mismatch", "sha-256", manifest=mbytes.rstrip() + b" \n", pin=_sha(mbytes))
    emit("capture_manifest_unknown_key", "unknown", doc={**man, "surprise": 1})
    for name, (data, expect) in safetensors_mutations(pbytes).items():
        emit(f"capture_payload_{name}", PAYLOAD_CAUSES.get(name, expect), payload=data)
    emit("capture_payload_digest_mismatch", "sha-256", fix=lambda d: (d / pname).write_bytes(_flip_last(pbytes)))
    bad_names = {"dotdot": "../" + pname, "absolute": "/etc/passwd", "subdir": "sub/" + pname,
                 "hidden": "." + pname, "pickle_suffix": pname.replace(".safetensors", ".pt"),
                 "backslash": "..\\" + pname}
    for label, bad in bad_names.items():
        emit(f"capture_payload_name_{label}", "payload.file",
             doc={**man, "payload": {**man["payload"], "file": bad}})
    emit("capture_payload_symlink_outside", "regular file",
         fix=lambda d: _replace_with_link(d / pname, _outside_copy(d, src / pname)))
    emit("capture_payload_device", "regular file", fix=lambda d: _replace_with_link(d / pname, "/dev/zero"))
    emit("capture_payload_fifo", "regular file", fix=lambda d: _replace_with_fifo(d / pname))
    emit("capture_payload_missing", "payload", fix=lambda d: (d / pname).unlink())
    emit("capture_manifest_symlink", "regular file",
         fix=lambda d: _replace_with_link(d / mname, _outside_copy(d, src / mname)), pin=_sha(mbytes))
    emit("capture_payload_sha_uppercase", "lowercase",
         doc={**man, "payload": {**man["payload"], "spans_sha256": man["payload"]["spans_sha256"].upper()}})
    for label, (value, expect) in DIGEST_CASES.items():
        if value:
            emit(f"capture_pin_{label}", expect, pin=value)
            emit(f"capture_logical_pin_{label}", expect, logical_pin=value)
    emit("capture_logical_pin_other", "logical", logical_pin="ab" * 32)
    return entries


# ------------------------------------------------------------------------------------------- bundle
def _bundle_finish(d: Path, manifest: dict[str, Any] | None = None, *, raw: bytes | None = None) -> None:
    """Write the (mutated) manifest and a COMPLETE that records its digest, as a forger would."""
    data = raw if raw is not None else json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    (d / "manifest.json").write_bytes(data)
    complete = json.loads((d / "COMPLETE").read_bytes())
    (d / "COMPLETE").write_bytes(json.dumps({**complete, "manifest_sha256": _sha(data)}, indent=2).encode())


def _header_block(data: bytes) -> bytes:
    """What a reader hashes as a safetensors header block: ``8 + length`` bytes when they fit, else 8."""
    from replayjob.tensorfile import MAX_HEADER_BYTES

    if len(data) < 8:
        return data
    (n,) = struct.unpack("<Q", data[:8])
    return data[:8 + n] if 8 + n <= min(len(data), 8 + MAX_HEADER_BYTES) else data[:8]


def forge_payload_file(d: Path, manifest: dict[str, Any], data: bytes) -> None:
    """Replace a bundle's ``payloads.safetensors`` and re-seal every digest that pins it, as a forger would:
    the file's size and header digest, and each declared tensor's digest where the header names its span."""
    (d / "payloads.safetensors").write_bytes(data)
    block = _header_block(data)
    specs = {k: dict(v) for k, v in manifest["payloads"].items()}
    try:
        head = json.loads(block[8:])
        for name, spec in specs.items():
            begin, end = head[name]["data_offsets"]
            spec["sha256"] = _sha(data[len(block) + begin:len(block) + end])
    except (ValueError, KeyError, TypeError):
        pass  # no readable span: the reader refuses the header before it looks at tensor digests
    _bundle_finish(d, {**manifest, "payloads": specs, "payload_file": {
        **manifest["payload_file"], "bytes": len(data), "header_sha256": _sha(block)}})


def bundle_entries(src: Path, out: Path) -> list[Entry]:
    """Bundle directories fed to `bundle validate`; digests are re-forged so each defect is reached."""
    man = json.loads((src / "manifest.json").read_bytes())
    pfile = src / "payloads.safetensors"
    pname = sorted(man["payloads"])[0]
    entries: list[Entry] = []

    def emit(name: str, expect: str, fn: Callable[[Path], None]) -> None:
        d = out / name
        shutil.copytree(src, d, symlinks=True)
        fn(d)
        entries.append(Entry(name, "bundle", d.name, expect))

    for name, (data, expect) in json_mutations(man, int_field="multi_rank", str_field="format",
                                               required="payloads", schema_field="format").items():
        emit(f"bundle_manifest_{name}", expect, lambda d, data=data: _bundle_finish(d, raw=data))
    rest = json.dumps({k: v for k, v in man.items() if k != "index"}, indent=1, sort_keys=True).encode()
    for name, (data, expect) in json_mutations(man["index"], int_field="config", str_field="bundle_id",
                                               required="samples", schema_field="format").items():
        raw = b'{"index": ' + data + b",\n" + rest[2:]  # the defect spliced in as the manifest's index section
        emit(f"bundle_index_{name}", expect, lambda d, raw=raw: _bundle_finish(d, raw=raw))
    emit("bundle_complete_mismatch", "checksum mismatch",
         lambda d: (d / "manifest.json").write_bytes((src / "manifest.json").read_bytes() + b" "))
    for name, (data, expect) in safetensors_mutations(pfile.read_bytes()).items():
        emit(f"bundle_payload_{name}", expect, lambda d, data=data: forge_payload_file(d, man, data))
    emit("bundle_payload_digest_mismatch", "checksum mismatch",
         lambda d: (d / "payloads.safetensors").write_bytes(_flip_last(pfile.read_bytes())))
    for label, bad in {"dotdot": "payloads/../manifest.json", "absolute": "/etc/passwd",
                       "escape": "../payloads.safetensors", "pickle": "payloads.pt"}.items():
        emit(f"bundle_payload_path_{label}", "payload file", lambda d, bad=bad: _bundle_finish(
            d, {**man, "payload_file": {**man["payload_file"], "file": bad}}))
    emit("bundle_payload_name_escape", "payload name", lambda d: _bundle_finish(
        d, {**man, "payloads": {**man["payloads"], "../x": man["payloads"][pname]}}))
    emit("bundle_payload_symlink_outside", "symlink",
         lambda d: _replace_with_link(d / "payloads.safetensors", _outside_copy(d, pfile)))
    emit("bundle_payload_device", "symlink", lambda d: _replace_with_link(d / "payloads.safetensors", "/dev/zero"))
    emit("bundle_payload_fifo", "regular file", lambda d: _replace_with_fifo(d / "payloads.safetensors"))
    emit("bundle_pickle_file", "pickle", lambda d: (d / "extra.pt").write_bytes(torch_save_bytes()))
    emit("bundle_pickle_top", "pickle", lambda d: (d / "state.pkl").write_bytes(pickle.dumps([1])))
    emit("bundle_undeclared_payload", "unknown entries", lambda d: shutil.copyfile(pfile, d / "x.safetensors"))
    emit("bundle_payload_directory", "unknown entries", lambda d: (d / "payloads").mkdir())  # a 1.x entry
    emit("bundle_incomplete", "incomplete", lambda d: (d / "COMPLETE").unlink())
    emit("bundle_payload_sha_uppercase", "sha256", lambda d: _bundle_finish(
        d, {**man, "payloads": {**man["payloads"], pname: {**man["payloads"][pname],
                                                            "sha256": man["payloads"][pname]["sha256"].upper()}}}))
    emit("bundle_format_v1", "format_version '1.0.0' is not read", lambda d: _bundle_finish(
        d, {**man, "format_version": "1.0.0"}))
    f = out / "bundle_is_a_file"
    f.write_bytes((src / "manifest.json").read_bytes())
    entries.append(Entry(f.name, "bundle", f.name, "directory"))
    link = out / "bundle_is_a_symlink"
    os.symlink(src.resolve(), link)
    entries.append(Entry(link.name, "bundle", link.name, "symlink"))
    return entries


# ------------------------------------------------------------------------------------------ metrics
def metrics_entries(src: Path, out: Path) -> list[Entry]:
    """Replay directories (replay_metrics.json + final adapter) fed to `reduce`."""
    name_ = "replay_metrics.json"
    doc = json.loads((src / name_).read_bytes())
    entries: list[Entry] = []

    def emit(name: str, expect: str, fn: Callable[[Path], None]) -> None:
        d = out / name / "r0"
        shutil.copytree(src, d, symlinks=True)
        fn(d)
        entries.append(Entry(name, "metrics", name, expect))

    for name, (data, expect) in json_mutations(doc, int_field="repeat_index", str_field="arm",
                                               required="pins").items():
        emit(f"metrics_{name}", expect, lambda d, data=data: (d / name_).write_bytes(data))
    for label, bad in {"dotdot": "../../../etc/passwd", "absolute": "/etc/passwd"}.items():
        emit(f"metrics_adapter_path_{label}", "final_adapter_path",
             lambda d, bad=bad: (d / name_).write_bytes(json.dumps({**doc, "final_adapter_path": bad}).encode()))
    for label, (value, _cause) in DIGEST_CASES.items():
        emit(f"metrics_digest_{label}", "optimizer/logical_batch_sha256", lambda d, value=value: (
            d / name_).write_bytes(json.dumps({**doc, "optimizer/logical_batch_sha256": value}).encode()))
    emit("metrics_device", "regular file", lambda d: _replace_with_link(d / name_, "/dev/zero"))
    emit("metrics_fifo", "regular file", lambda d: _replace_with_fifo(d / name_))

    def oversized(d: Path) -> None:
        with open(d / name_, "r+b") as fh:
            fh.truncate(17 * 1024 * 1024)  # sparse: cheap to make, above the 16 MiB limit
    emit("metrics_oversized", "limit", oversized)
    return entries


# --------------------------------------------------------------------------------------------- diag
def diag_entries(src: Path, out: Path) -> list[Entry]:
    """diag.jsonl files fed to `diag-diff` (against the valid one)."""
    good = src.read_bytes()
    first = good.splitlines()[0]
    row = json.loads(first)
    entries: list[Entry] = []
    cases: dict[str, tuple[bytes, str]] = {
        "diag_invalid_utf8": (good + b'{"step": "\xff"}\n', "utf-8"),
        "diag_truncated_line": (good + first[: len(first) // 2], "malformed"),
        "diag_duplicate_key": (b'{"step": 0, ' + first[1:] + b"\n", "duplicate"),
        "diag_deep_nesting": (good + b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}\n", "malformed json"),
        "diag_huge_int": (good + b'{"step": 1' + b"0" * 5000 + b"}\n", "digits"),
        "diag_not_object": (good + b"[1, 2]\n", "object"),
        "diag_binary": (b"\x00\x01\x02" * 10, "malformed"),
    }
    for name, (data, expect) in cases.items():
        p = out / f"{name}.jsonl"
        p.write_bytes(data)
        entries.append(Entry(name, "diag", p.name, expect))
    assert "step" in row
    os.symlink("/dev/zero", out / "diag_device.jsonl")
    entries.append(Entry("diag_device", "diag", "diag_device.jsonl", "regular file"))
    os.mkfifo(out / "diag_fifo.jsonl")
    entries.append(Entry("diag_fifo", "diag", "diag_fifo.jsonl", "regular file"))
    (out / "diag_dir.jsonl").mkdir()
    entries.append(Entry("diag_dir", "diag", "diag_dir.jsonl", "directory"))
    return entries


# ----------------------------------------- readers added later: budgets, traces, ranked bundles, runs
def budget_mutations() -> dict[str, Mutation]:
    """Budget files (`reduce --budgets FILE`), each refused by cause before any bound is graded."""
    ok = b"[ckpt-on]\nlocal_train_wall_s = { max_ratio = 1.35 }\n"
    return {
        "budget_min_above_max": (b"[ckpt-on]\nlocal_train_wall_s = { max_ratio = 1.1, min_ratio = 1.5 }\n",
                                 "min_ratio"),
        "budget_negative": (b"[ckpt-on]\nlocal_train_wall_s = { max_ratio = -1.0 }\n", "max_ratio"),
        "budget_nan": (b"[ckpt-on]\nlocal_train_wall_s = { max_ratio = nan }\n", "max_ratio"),
        "budget_infinite": (b"[ckpt-on]\nlocal_train_wall_s = { min_ratio = inf }\n", "min_ratio"),
        "budget_bool": (b"[ckpt-on]\nlocal_train_wall_s = { max_ratio = true }\n", "max_ratio"),
        "budget_unknown_metric": (b"[ckpt-on]\nwall = { max_ratio = 1.2 }\n", "unknown metric"),
        "budget_unknown_kind": (b"[ckpt-on]\nlocal_train_wall_s = { ratio = 1.2 }\n", "inline table"),
        "budget_no_bound": (b'baseline = "ckpt-off"\n', "no bound"),
        "budget_invalid_toml": (b"[ckpt-on\n", "budget"),
        "budget_invalid_utf8": (ok + b"# \xff\n", "budget"),
        "budget_deep_nesting": (ok + b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n", "budget"),
    }


def _reseal(replay: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Re-pin a traced replay after an edit of its trace, as a forger would: the payload in the index,
    then the index in ``replay_metrics.json``."""
    from replayjob.artifacts.trace_store import INDEX_FILE, PAYLOAD_FILE, TRACE_DIR

    t = replay / TRACE_DIR
    index = json.loads((t / INDEX_FILE).read_bytes())
    data = (t / PAYLOAD_FILE).read_bytes()
    index["payload"].update(sha256=_sha(data), bytes=len(data))
    if edit is not None:
        edit(index)
    blob = json.dumps(index, indent=1).encode()
    (t / INDEX_FILE).write_bytes(blob)
    metrics = json.loads((replay / "replay_metrics.json").read_bytes())
    metrics["trace"]["index_sha256"] = _sha(blob)
    (replay / "replay_metrics.json").write_bytes(json.dumps(metrics, indent=1).encode())


def trace_entries(src: Path, out: Path) -> list[Entry]:
    """Traced replays (`trace-diff ENTRY VALID`, VALID the traced replay they were copied from), each
    re-sealed after its edit so that only recomputing from the bytes can refuse it."""
    from safetensors.torch import load as st_load

    from replayjob.artifacts.trace_store import INDEX_FILE, PAYLOAD_FILE, TRACE_DIR

    entries: list[Entry] = []

    def emit(name: str, expect: str, fn: Callable[[Path], None]) -> None:
        d = out / name
        shutil.copytree(src, d)
        fn(d)
        entries.append(Entry(name, "trace", str(d.relative_to(out)), expect, {"valid": str(src)}))

    def edit_payload(fn: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
        def apply(d: Path) -> None:
            p = d / TRACE_DIR / PAYLOAD_FILE
            tensors = st_load(p.read_bytes())
            fn(tensors)
            p.write_bytes(save(tensors, metadata={"format": "replayjob.trace/v1"}))
            _reseal(d)
        return apply

    def swap_sites(t: dict[str, torch.Tensor]) -> None:  # two same-shaped sites' values swapped
        names = sorted(k for k in t if k.startswith("forward.") and k.endswith(".values"))
        pair = next((a, b) for a in names for b in names if a < b and t[a].shape == t[b].shape
                    and not torch.equal(t[a], t[b]))
        t[pair[0]], t[pair[1]] = t[pair[1]].clone(), t[pair[0]].clone()

    def swap_grad(t: dict[str, torch.Tensor]) -> None:  # a gradient and its update swapped (where they differ)
        k = next(name[:-len(".grad")] for name in sorted(t) if name.startswith("param.") and name.endswith(".grad")
                 and not torch.equal(t[name], t[name[:-len(".grad")] + ".update"]))
        t[f"{k}.grad"], t[f"{k}.update"] = t[f"{k}.update"].clone(), t[f"{k}.grad"].clone()

    def duplicate(index: dict[str, Any]) -> None:
        index["forward"][1]["name"] = index["forward"][0]["name"]

    def rename_all(index: dict[str, Any]) -> None:
        for kind in ("forward", "backward"):
            for k, e in enumerate(index[kind]):
                e["name"] = f"elsewhere.{kind}.{k}"

    def link_dir(d: Path) -> None:
        shutil.move(str(d / TRACE_DIR), str(d / "elsewhere"))
        os.symlink("elsewhere", d / TRACE_DIR)

    emit("trace_swapped_sites", "does not match the values' bytes", edit_payload(swap_sites))
    emit("trace_swapped_grad", "does not match the tensors' bytes", edit_payload(swap_grad))
    emit("trace_duplicate_site", "more than once", lambda d: _reseal(d, duplicate))
    emit("trace_other_sites", "do not hold the same sites", lambda d: _reseal(d, rename_all))
    emit("trace_no_index", "index", lambda d: (d / TRACE_DIR / INDEX_FILE).unlink())
    emit("trace_stale_pin", "pins 'trace/index.json' at sha-256", lambda d: (d / TRACE_DIR / INDEX_FILE).write_bytes(
        (d / TRACE_DIR / INDEX_FILE).read_bytes() + b"\n"))
    emit("trace_linked_dir", "link", link_dir)
    return entries


def ranked_bundle_entries(out: Path) -> list[Entry]:
    """Two-rank bundles (`bundle validate`): ranks of two runs, a rank missing, a linked rank."""
    from replayjob.bundle import format as fmt
    from replayjob.bundle.synthetic import write_rollout
    from replayjob.errors import ReplayjobError

    entries: list[Entry] = []

    def emit(name: str, expect: str, fn: Callable[[Path], None]) -> None:
        root = out / "ranked" / name
        fn(root)
        entries.append(Entry(name, "bundle", str(root.relative_to(out)), expect))

    def two_runs(root: Path) -> None:  # run A's rank 0 and run B's rank 1 under a root written by hand
        write_rollout(root, rank=0, ranks=[0, 1], groups=4, run_id="run-a")
        with contextlib.suppress(ReplayjobError):  # the landing refuses the root; a forger writes it
            write_rollout(root, rank=1, ranks=[0, 1], groups=4, run_id="run-b")
        recs = {r: json.loads((root / f"{fmt.COMPLETE}.{r}").read_bytes()) for r in (0, 1)}
        (root / fmt.COMPLETE).write_bytes(_canon({
            "format": fmt.FORMAT, "bundle_id": recs[0]["bundle_id"], "run_id": "run-a", "ranks": [0, 1],
            "rank_manifests": {str(r): recs[r]["manifest_sha256"] for r in (0, 1)}}))

    def one_rank(root: Path) -> None:
        write_rollout(root, rank=0, ranks=[0, 1], groups=4, run_id="corpus-run")

    def linked_rank(root: Path) -> None:
        for r in (0, 1):
            write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id="corpus-run")
        rank1 = next(p for p in sorted(root.iterdir()) if p.is_dir() and p.name.endswith("1"))
        shutil.move(str(rank1), str(root.parent / f"{root.name}-rank1"))
        os.symlink(root.parent / f"{root.name}-rank1", rank1)

    emit("ranked_two_runs", "run id", two_runs)
    emit("ranked_rank_missing", "complete", one_rank)
    emit("ranked_linked_rank", "link", linked_rank)
    return entries


def run_record_entries(out: Path) -> list[Entry]:
    """Run directories whose `run.json` is not this run's (`step replay --index 0 --run-dir ENTRY`)."""
    entries: list[Entry] = []
    record = {"schema": "replayjob.run/v1", "fingerprint": "0" * 64, "image": "", "image_digest": None,
              "environment": {}, "spec": {}}
    cases: dict[str, tuple[bytes | None, str]] = {
        "run_other_fingerprint": (_canon(record), "another run"),
        "run_not_json": (b"{not json", "json"),
        "run_wrong_schema": (_canon({**record, "schema": "replayjob.run/v0"}), "run record"),
        "run_missing_field": (_canon({k: v for k, v in record.items() if k != "environment"}), "run record"),
        "run_duplicate_key": (b'{"schema": "replayjob.run/v1", "schema": "x", "fingerprint": "0"}', "duplicate"),
        "run_record_directory": (None, "regular file"),
    }
    for name, (data, expect) in cases.items():
        d = out / "runs" / name
        d.mkdir(parents=True)
        if data is None:
            (d / "run.json").mkdir()
        else:
            (d / "run.json").write_bytes(data)
        entries.append(Entry(name, "run", str(d.relative_to(out)), expect))
    d = out / "runs" / "run_linked_record"
    d.mkdir()
    (out / "runs" / "elsewhere.json").write_bytes(_canon(record))
    os.symlink("../elsewhere.json", d / "run.json")
    entries.append(Entry("run_linked_record", "run", str(d.relative_to(out)), "link"))
    return entries


def integration_entries(src: Path, out: Path) -> list[Entry]:
    """An external trainer's capture (the TRL producer's manifest and files), fed to `explain` with its
    own replay config and the pins each entry carries (re-sealed for a mutated manifest, so the
    validator behind the pin is exercised)."""
    mname = next(p.name for p in src.glob("*.manifest.json"))
    mbytes = (src / mname).read_bytes()
    man = json.loads(mbytes)
    entries: list[Entry] = []

    def emit(name: str, expect: str, *, manifest: bytes | None = None, doc: dict[str, Any] | None = None,
             fix: Callable[[Path], None] | None = None, pin: str | None = None) -> None:
        d = out / name
        shutil.copytree(src, d, symlinks=True)
        data = manifest if manifest is not None else (_canon(doc) if doc is not None else mbytes)
        (d / mname).write_bytes(data)
        if fix is not None:
            fix(d)
        pins = {"manifest": pin if pin is not None else _sha(data), "logical": man["logical_batch_sha256"],
                "config": str(src / "replay.toml")}
        entries.append(Entry(name, "integration", f"{d.name}/{mname}", expect, pins))

    for name, (data, expect) in json_mutations(man, int_field="step", str_field="framework",
                                               required="files").items():
        emit(f"integration_{name}", expect, manifest=data)
    emit("integration_manifest_pin_mismatch", "sha-256", manifest=mbytes.rstrip() + b" \n", pin=_sha(mbytes))
    emit("integration_unknown_key", "unknown", doc={**man, "surprise": 1})
    emit("integration_unknown_framework", "framework", doc={**man, "framework": "nonesuch"})
    for role in ("adapter", "optimizer", "payload"):
        f = man["files"][role]["file"]
        emit(f"integration_{role}_name_dotdot", "file", doc={**man, "files": {
            **man["files"], role: {**man["files"][role], "file": "../" + f}}})
        emit(f"integration_{role}_digest_mismatch", "sha-256",
             fix=lambda d, f=f: (d / f).write_bytes(_flip_last((src / f).read_bytes())))
        emit(f"integration_{role}_symlink", "link",
             fix=lambda d, f=f: _replace_with_link(d / f, _outside_copy(d, src / f)))
        emit(f"integration_{role}_missing", "file", fix=lambda d, f=f: (d / f).unlink())
    emit("integration_outcome_missing", "outcome", doc={k: v for k, v in man.items() if k != "outcome"})
    return entries


# ------------------------------------------------------------------------------------------ driver
def standalone_entries(out: Path) -> list[Entry]:
    """Self-contained entries: tensor files, pickle files, tolerance and budget files, configs, signal rules,
    ablation specs, traces, two-rank bundles and run records."""
    entries: list[Entry] = []
    pickles = {"pickle_pt": (torch_save_bytes(), "pickle is never loaded"),
               "pickle_pkl": (pickle.dumps([1, 2], protocol=2), "pickle is never loaded")}
    for folder, ext, target, files in (
            ("tensors", "safetensors", "tensorfile", {**safetensors_mutations(), **pickles}),
            ("tolerances", "toml", "tolerances", tolerance_mutations()),
            ("budgets", "toml", "budgets", budget_mutations()),
            ("configs", "toml", "config", toml_mutations())):
        (out / folder).mkdir(parents=True, exist_ok=True)
        for name, (data, expect) in files.items():
            p = out / folder / f"{name}.{ext}"
            p.write_bytes(data)
            entries.append(Entry(name, target, str(p.relative_to(out)), expect))
    os.mkfifo(out / "tolerances" / "tol_fifo.toml")
    entries.append(Entry("tol_fifo", "tolerances", "tolerances/tol_fifo.toml", "regular file"))
    os.mkfifo(out / "configs" / "toml_fifo.toml")
    os.symlink("/dev/zero", out / "configs" / "toml_device.toml")
    (out / "configs" / "toml_directory.toml").mkdir()
    for name in ("toml_fifo", "toml_device", "toml_directory"):
        entries.append(Entry(name, "config", f"configs/{name}.toml", "regular file"))
    for target, unknown in (("rules", b'[rules.x]\nnonsense = 1\n'), ("spec", b"surprise = 1\n")):
        d = out / target
        d.mkdir()
        cases = {"deep_nesting": (b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n", "toml"),
                 "invalid_utf8": (b"# \xff\xfe\n", "utf-8"), "invalid": (b"[x\n", "toml"),
                 "unknown_key": (unknown, "unknown")}
        for name, (data, expect) in cases.items():
            (d / f"{name}.toml").write_bytes(data)
            entries.append(Entry(f"{target}_{name}", target, f"{target}/{name}.toml", expect))
        os.mkfifo(d / "fifo.toml")
        entries.append(Entry(f"{target}_fifo", target, f"{target}/fifo.toml", "regular file"))
    entries += ranked_bundle_entries(out) + run_record_entries(out)
    return entries


REPLAYS = 8  # >= reduce's default --min-repeats (3); eight give reduce 20+ crash boundaries without a plot


def build_sources(workspace: Path, out: Path) -> dict[str, Path]:
    """Valid artifacts of every kind, made by the real commands from a `replayjob init` workspace.

    A capture (``source``), :data:`REPLAYS` replays of it (``replays/r0``...), a traced replay
    (``traced/r0``), a training run with trajectory
    bundles (``bundled/bundles``); ``SOURCES_DONE`` is written last, so a second call reuses them.
    """
    from replayjob.cli import main

    paths = {"capture": out / "source", "metrics": out / "replays" / "r0", "diag": out / "source" / "diag.jsonl",
             "source": out / "source", "replays": out / "replays", "state": workspace / "init_resume",
             "trace": out / "traced" / "r0"}
    if not (out / "SOURCES_DONE").exists():
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        assert main(["capture", str(workspace / "source.toml"), "--out", str(out / "source")]) == 0
        metrics = json.loads((out / "source" / "metrics.json").read_text())
        pins = [f"optimizer_batch.replay_path={out / 'source' / metrics['optimizer_batch/manifest_path']}",
                f"optimizer_batch.expected_logical_sha256={metrics['optimizer/logical_batch_sha256']}",
                f"optimizer_batch.expected_manifest_sha256={metrics['optimizer_batch/manifest_sha256']}"]
        for i in range(REPLAYS):
            argv = ["replay", str(workspace / "replay.toml"), "--out", str(out / "replays" / f"r{i}"),
                    "--repeat-index", str(i)]
            assert main([*argv, *(x for p in pins for x in ("--set", p))]) == 0
        argv = ["replay", str(workspace / "replay.toml"), "--out", str(out / "traced" / "r0"), "--trace"]
        assert main([*argv, *(x for p in pins for x in ("--set", p))]) == 0
        (out / "replay-pins.txt").write_text("\n".join(pins) + "\n")
        env = {"REPLAYJOB_BUNDLE_CAPTURE": "1", "REPLAYJOB_BUNDLE_DIR": str(out / "bundled" / "bundles")}
        with mock.patch.dict(os.environ, env):  # restored afterwards, whatever they held
            assert main(["train", str(workspace / "train.toml"), "--out", str(out / "bundled")]) == 0
        (out / "SOURCES_DONE").write_text("complete\n")
    paths["bundle"] = sorted((out / "bundled" / "bundles").glob("update-*"))[0]
    return paths


SOURCES: dict[str, Callable[[Path, Path], list[Entry]]] = {
    "state": state_entries, "capture": capture_entries, "bundle": bundle_entries,
    "metrics": metrics_entries, "diag": diag_entries, "trace": trace_entries}


def generate(out: Path, sources: dict[str, Path] | None = None) -> list[Entry]:
    """Write the corpus into ``out`` (created; must be empty) and return its entries."""
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"{out} is not empty")
    entries = standalone_entries(out)
    for target, src in sorted((sources or {}).items()):
        sub = out / target
        sub.mkdir()
        entries += [Entry(e.name, e.target, f"{target}/{e.path}", e.expect, e.pins)
                    for e in SOURCES[target](src, sub)]
    names = [e.name for e in entries]
    assert len(names) == len(set(names)), "corpus entry names must be unique"
    (out / "index.json").write_text(json.dumps([asdict(e) for e in entries], indent=1) + "\n")
    return entries


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--workspace", type=Path, help="a `replayjob init` directory: build every source from it")
    for target in SOURCES:
        ap.add_argument(f"--{target}", type=Path, help=f"a valid {target} artifact to mutate")
    ns = ap.parse_args(argv)
    sources = {t: getattr(ns, t) for t in SOURCES if getattr(ns, t) is not None}
    if ns.workspace is not None:
        built = build_sources(ns.workspace, ns.out.parent / f"{ns.out.name}-sources")
        sources = {t: built[t] for t in SOURCES} | sources
    entries = generate(ns.out, sources)
    print(f"wrote {len(entries)} corpus entries to {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
