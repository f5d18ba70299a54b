"""A built-in capture's recorded world size and ``distributed`` block against its layout.

Admission compares the replay's ``[distributed]`` settings with the config the capture records, so that config
must be the layout's: a single-device manifest (one payload, no ``ranks``) ran on 1 rank, and a root's
``distributed`` block (tied to the ranks it lists) must say what its recorded config says.  Each case edits a
capture and re-pins it, as whoever can edit the files can: the pins pass, the contradiction is refused (exit 2),
naming the file and the field.  The roots are written by the capture's own writers over synthetic rows (no
torchrun), so these run in a second.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import replay_pins
from test_symlinks import write_capture_over_two_ranks

from replayjob.artifacts import capture_manifest as mf
from replayjob.artifacts import capture_reader
from replayjob.artifacts import capture_root as ranks
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.errors import IntegrityError
from replayjob.jsonio import canonical_bytes
from replayjob.producers.builtin import ranks as rankrows
from replayjob.producers.builtin.admission import source_config

CONFIG: dict[str, Any] = {"backend": {"devices": "cpu"},
                          "distributed": {"world_size": 2, "strategy": "ddp", "bucket_cap_mb": 25.0,
                                          "timeout_s": 600.0}}


def write_doc(path: Path, doc: dict[str, Any]) -> str:
    """Write ``doc`` as the capture writes a manifest (canonical JSON) over what is there; its new pin."""
    data = canonical_bytes(doc) + b"\n"
    path.write_bytes(data)
    return sha256_bytes(data)


def rehash_config(doc: dict[str, Any]) -> None:
    doc["config"]["sha256"] = sha256_json(doc["config"]["resolved"])


# ------------------------------------------------------------------------------------- one device
def test_a_single_device_capture_whose_config_says_several_ranks_is_refused(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = tmp_path / "source"
    shutil.copytree(capture_dir, cap)
    path = cap / mf.manifest_name(0)
    doc = json.loads(path.read_text())
    assert doc["config"]["resolved"]["distributed"]["world_size"] == 1  # as captured
    doc["config"]["resolved"]["distributed"].update(world_size=2, strategy="ddp")
    rehash_config(doc)
    sha = write_doc(path, doc)
    code = main(["explain", str(workspace / "replay.toml"), "--nproc", "2", *replay_pins(capture_dir),
                 "--set", f'optimizer_batch.replay_path="{path}"',
                 "--set", f'optimizer_batch.expected_manifest_sha256="{sha}"', "--set", 'distributed.strategy="ddp"'])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(path) in err and "`config.resolved.distributed.world_size` is 2" in err and "1 rank" in err


def test_a_single_device_manifest_recording_no_world_size_is_refused(capture_dir: Path, tmp_path: Path) -> None:
    src = capture_dir / mf.manifest_name(0)
    for value in (None, 0, True):
        doc = json.loads(src.read_text())
        doc["config"]["resolved"]["distributed"]["world_size"] = value
        rehash_config(doc)
        path = tmp_path / mf.manifest_name(0)
        with pytest.raises(IntegrityError, match=r"config\.resolved\.distributed\.world_size") as e:
            capture_reader.read(path, write_doc(path, doc))
        assert e.value.exit_code == 2


# ------------------------------------------------------------------------------------- a root over ranks
def capture_over_two_ranks(out: Path, config: dict[str, Any] | None = None) -> Path:
    """Two ranks' payloads, manifests and landing records, then the root, written by the capture's own writers
    (synthetic rows) with this module's config; the root's path."""
    return write_capture_over_two_ranks(out, CONFIG if config is None else config, "a" * 64)[0]


def reconfigure(root: Path, edit: Callable[[dict[str, Any]], None]) -> str:
    """Edit the config every rank and the root record, re-pin every rank (manifest, landing record, the root's
    entry) and the root, as whoever edits a capture can; the root's new pin."""
    doc = json.loads(root.read_text())
    d = root.parent
    for e in doc["ranks"]:
        path = d / e["dir"] / mf.manifest_name(0)
        rank = json.loads(path.read_text())
        edit(rank["config"]["resolved"])
        rehash_config(rank)
        e["manifest_sha256"] = write_doc(path, rank)
        (d / ranks.landed_name(e["rank"])).write_bytes(
            canonical_bytes({"rank": e["rank"], "world_size": 2, "manifest_sha256": e["manifest_sha256"]}) + b"\n")
        doc["config"] = rank["config"]
    return write_doc(root, doc)


def test_the_synthetic_root_is_read_and_every_rank_verifies(tmp_path: Path) -> None:
    root = capture_over_two_ranks(tmp_path / "source")
    m = capture_reader.read(root, sha256_bytes(root.read_bytes()))
    assert isinstance(m, ranks.RootManifest) and rankrows.verify(m).batch.rows == 4
    assert source_config(m)["distributed"]["world_size"] == 2


def test_a_root_whose_recorded_config_says_one_rank_is_refused(tmp_path: Path) -> None:
    """Every rank and the root re-pinned with ``distributed.world_size = 1``: a replay on one rank would find no
    difference to declare.  The ranks alone verify (their configs agree with the root's)."""
    root = capture_over_two_ranks(tmp_path / "source")
    sha = reconfigure(root, lambda c: c["distributed"].update(world_size=1))
    with pytest.raises(IntegrityError) as e:
        capture_reader.read(root, sha)
    assert e.value.exit_code == 2 and str(e.value.where) == str(root)
    assert "`distributed.world_size` is 2" in e.value.message
    assert "`config.resolved.distributed.world_size` = 1" in e.value.message


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d.update(strategy="fsdp2"), "distributed.strategy"),
    (lambda d: d.update(bucket_cap_mb=99.0), "distributed.bucket_cap_mb"),
    (lambda d: d.update(backend="nccl"), "distributed.backend"),  # the config runs on the CPU: gloo
    (lambda d: d.update(strategy="fsdp2", backend="nccl", bucket_cap_mb=99.0), "distributed.strategy"),
    (lambda d: d.update(strategy="none"), "distributed.strategy"),  # ranks sharing an update share it somehow
])
def test_a_root_whose_distributed_block_contradicts_its_config_is_refused(tmp_path: Path, edit: Any,
                                                                           field: str) -> None:
    root = capture_over_two_ranks(tmp_path / "source")
    doc = json.loads(root.read_text())
    edit(doc["distributed"])
    sha = write_doc(root, doc)
    with pytest.raises(IntegrityError) as e:
        capture_reader.read(root, sha)
    assert e.value.exit_code == 2 and str(e.value.where) == str(root), e.value.message
    assert f"`{field}`" in e.value.message, e.value.message


def test_a_root_on_the_gpu_records_nccl(tmp_path: Path) -> None:
    config = {**CONFIG, "backend": {"devices": "cuda"}}
    root = capture_over_two_ranks(tmp_path / "source", config)  # written as if on CUDA: gloo recorded
    with pytest.raises(IntegrityError, match=r"distributed\.backend"):
        capture_reader.read(root, sha256_bytes(root.read_bytes()))
    doc = json.loads(root.read_text())
    doc["distributed"]["backend"] = "nccl"
    assert isinstance(capture_reader.read(root, write_doc(root, doc)), ranks.RootManifest)


def test_a_root_whose_config_records_no_distributed_section_reads_its_block(tmp_path: Path) -> None:
    """The section removed from every rank and the root (re-pinned): admission compares the replay with the
    root's block (2 ranks, ddp), never with the one-process defaults an old single-device capture reads as."""
    root = capture_over_two_ranks(tmp_path / "source")
    sha = reconfigure(root, lambda c: c.pop("distributed"))
    m = capture_reader.read(root, sha)
    assert isinstance(m, ranks.RootManifest) and rankrows.verify(m).batch.rows == 4
    got = source_config(m)["distributed"]
    assert (got["world_size"], got["strategy"], got["bucket_cap_mb"]) == (2, "ddp", 25.0)
