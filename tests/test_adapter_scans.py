"""Adapters hashed in the background (claims.AdapterScans) give the same scan as hashing each file when asked."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from replayjob.gate import checks as C
from replayjob.gate import synthetic


def test_background_scans_are_the_files_own_in_any_order(tmp_path: Path) -> None:
    paths = []
    for i in range(7):
        p = tmp_path / f"a{i}.safetensors"
        p.write_bytes(synthetic.adapter_file(bytes([i]) * 64) if i != 3 else b"not a tensor file")
        paths.append(p)
    scans = C.AdapterScans()
    scans.BATCH = 3  # two full batches start while "reading", the seventh waits for take
    replays: list[Any] = [SimpleNamespace(final_adapter_file=p) for p in paths]
    assert [scans.start(r) for r in replays] == replays
    want = [C._disk_scan(p) for p in paths]
    for i in (6, 0, 3, 5, 1, 2, 4):
        assert scans.take(paths[i]) == want[i]
    assert want[3][0] is not None and want[3][1] is not None  # hashed, and refused as a safetensors file
    assert scans.take(paths[0]) == want[0]  # taken twice: scanned again, not remembered
    paths[1].write_bytes(b"changed")
    assert scans.take(paths[1]) == C._disk_scan(paths[1]) != want[1]
    scans.close()


def test_close_cancels_what_was_not_started(tmp_path: Path) -> None:
    scans = C.AdapterScans()
    p = tmp_path / "a.safetensors"
    p.write_bytes(synthetic.adapter_file(b"x" * 64))
    scans.start(SimpleNamespace(final_adapter_file=p))  # type: ignore[arg-type]
    scans.close()
    assert scans.take(p) == C._disk_scan(p)  # nothing kept: scanned now
