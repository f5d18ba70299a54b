"""One streaming read per payload: hash, header, BOOL bytes and mask rows checked on the same bytes.

``bundle validate`` keeps no payload data (``load_bundle(..., tensors=False)``); ``replay`` builds
zero-copy tensors over the bytes it hashed.  Both must refuse exactly what the old two-copy reader
refused, with the mask rows checked chunk by chunk (short rows in blocks, long rows in pieces).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from replayjob import tensorfile
from replayjob.bundle import load_bundle
from replayjob.bundle.synthetic import write_rollout
from replayjob.cli import main
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError
from replayjob.jsonio import pretty_bytes


def _forge_payload(bundle: Path, name: str, tensor: torch.Tensor, unpadded: bool = False) -> None:
    """Replace one tensor of payloads.safetensors and re-seal every digest, as a crafted bundle would."""
    tensors = dict(tensorfile.load(bundle / "payloads.safetensors"), **{name: tensor})
    data = _unpadded(tensors) if unpadded else save(tensors)
    (bundle / "payloads.safetensors").write_bytes(data)
    scanned = tensorfile.scan(data, keep=False, digest="spans")
    assert scanned.header_sha256 is not None
    m = json.loads((bundle / "manifest.json").read_text())
    m["payload_file"].update(bytes=len(data), header_sha256=scanned.header_sha256.hex())
    for k, spec in m["payloads"].items():
        spec["sha256"] = scanned.tensor_sha256[k].hex()
    (bundle / "manifest.json").write_bytes(pretty_bytes(m))
    c = json.loads((bundle / "COMPLETE").read_text())
    c["manifest_sha256"] = sha256_bytes((bundle / "manifest.json").read_bytes())
    (bundle / "COMPLETE").write_bytes(pretty_bytes(c))


def _unpadded(tensors: dict[str, torch.Tensor]) -> bytes:
    """A valid safetensors file whose data section starts at an odd offset (no header padding)."""
    data = save(tensors)
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + n].rstrip(b" ") + b" "
    if (8 + len(header)) % 2 == 0:
        header += b" "
    return struct.pack("<Q", len(header)) + header + data[8 + n:]


@pytest.mark.parametrize("max_len", [12, 2048])  # short rows (vectorised blocks), long rows (pieces)
def test_mask_rows_are_checked_in_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             max_len: int) -> None:
    good = write_rollout(tmp_path / "good", max_len=max_len)
    full, light = load_bundle(good), load_bundle(good, tensors=False)
    mask = full.payloads["mask"]
    assert all(t.device.type == "meta" for t in light.payloads.values())
    assert {k: (v.dtype, v.shape) for k, v in light.payloads.items()} == {
        k: (v.dtype, v.shape) for k, v in full.payloads.items()}
    assert torch.equal(mask, tensorfile.load(good / "payloads.safetensors")["mask"])
    lengths = [s["response_length"] for s in full.samples]
    row = next(i for i, n in enumerate(lengths) if 0 < n < mask.shape[1])  # has ones and zeros
    for label, edit in (("one off", lambda m: m.__setitem__((row, lengths[row] - 1), 0.0)),
                        ("nan", lambda m: m.__setitem__((row, 0), float("nan"))),
                        ("late one", lambda m: m.__setitem__((row, m.shape[1] - 1), 1.0)),
                        ("unpadded", None)):
        b = tmp_path / label.replace(" ", "_")
        write_rollout(b, max_len=max_len)
        bad = mask.clone()
        if edit is not None:  # at the aligned offset safetensors writes: checked in place, no copy
            edit(bad)
            _forge_payload(b, "mask", bad)
        else:  # the same bad row at an unaligned offset: copied, then checked
            bad[row, lengths[row] - 1] = 0.0
            _forge_payload(b, "mask", bad, unpadded=True)
        for argv in (["bundle", "validate", str(b)], ["bundle", "replay", str(b)]):
            assert main(argv) == 2, label
            out = capsys.readouterr()
            assert f"mask row of sample {full.samples[row]['sample_id']!r} does not match" in out.out + out.err
    unaligned = tmp_path / "unaligned_ok"  # a valid mask at an unaligned offset: copied, never refused
    write_rollout(unaligned, max_len=max_len)
    _forge_payload(unaligned, "mask", mask, unpadded=True)
    assert torch.equal(load_bundle(unaligned).payloads["mask"], mask)
    assert main(["bundle", "validate", str(unaligned)]) == 0


def test_scan_hashes_every_byte_once_and_defers_faults(tmp_path: Path) -> None:
    p = tmp_path / "t.safetensors"
    tensors = {"a": torch.arange(6, dtype=torch.float64).reshape(2, 3), "b": torch.tensor([True, False])}
    data = save(tensors)
    p.write_bytes(data)
    kept = tensorfile.scan(p)
    assert (kept.size, kept.sha256) == (len(data), sha256_bytes(data))
    got = kept.tensors()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    light = tensorfile.scan(p, keep=False)
    assert light.sha256 == kept.sha256 and light.buffer is None and sorted(light.validated().tensors) == ["a", "b"]
    with pytest.raises(IntegrityError, match="without keeping"):
        light.tensors()
    # A fault in the header or a BOOL byte is reported only when asked, after the digest is known.
    bad = bytearray(data)
    bad[-1] = 2
    p.write_bytes(bytes(bad))
    s = tensorfile.scan(p, keep=False)
    assert s.sha256 == sha256_bytes(bytes(bad))
    with pytest.raises(IntegrityError, match="BOOL but holds bytes other than 0 and 1"):
        s.validated()
    p.write_bytes(b"\x80\x04pickle")
    with pytest.raises(IntegrityError, match="pickle"):
        tensorfile.scan(p).validated()
    p.write_bytes(data)

    def visit(header: tensorfile.Header, piece: memoryview, offset: int) -> None:
        raise IntegrityError("seen")
    with pytest.raises(IntegrityError, match="seen"):
        tensorfile.scan(p, visit=visit).validated()
    # Unaligned data: tensors are copied out instead of viewed, with the same values.
    p.write_bytes(_unpadded(tensors))
    got = tensorfile.scan(p).tensors()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
