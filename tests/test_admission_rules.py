"""Admission refuses what a replay would otherwise refuse or crash on later: an RNG state the generator would
not take, a resume state made for another model or carrying a key it does not define, and a manifest whose
initial adapter size contradicts the file its SHA-256 pins.  ``explain`` and ``replay`` agree on each (exit 2,
the file or field named, no traceback); every case is checked before any model is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from replayjob.artifacts import capture_payload as payload
from replayjob.cli import main
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError
from replayjob.jsonio import canonical_bytes
from replayjob.rl.state import STATE_FILE, read_state, restore_rng, rng_state_reason

MANIFEST = "optimizer_batch_step_000000.manifest.json"
PAYLOAD = "optimizer_batch_step_000000.safetensors"


def _pins(capture_dir: Path, *, manifest: str | None = None, replay_path: Path | None = None,
          resume: Path | None = None) -> list[str]:
    m = json.loads((capture_dir / "metrics.json").read_text())
    sets = [f"optimizer_batch.expected_logical_sha256={m['optimizer/logical_batch_sha256']}",
            f"optimizer_batch.expected_manifest_sha256={manifest or m['optimizer_batch/manifest_sha256']}"]
    if replay_path is not None:
        sets.append(f'optimizer_batch.replay_path="{replay_path}"')
    if resume is not None:
        sets.append(f'resume.from="{resume}"')
    return [a for s in sets for a in ("--set", s)]


def _refused_by_both(capsys: pytest.CaptureFixture[str], config: Path, sets: list[str], out: Path,
                     *needles: str) -> None:
    """``explain`` and ``replay`` both refuse (exit 2) naming every needle; the replay writes nothing."""
    for argv in (["explain", str(config), *sets], ["replay", str(config), *sets, "--out", str(out)]):
        assert main(argv) == 2, argv[0]
        err = capsys.readouterr().err
        assert "Traceback" not in err
        for needle in needles:
            assert needle in err, f"{argv[0]}: {needle!r} not in {err!r}"
    assert not out.exists()


def _rewrite_manifest(d: Path, change: Any) -> str:
    """Apply ``change`` to the manifest document, write it canonically; return its new SHA-256 (the re-pin)."""
    doc = json.loads((d / MANIFEST).read_text())
    change(doc)
    raw = canonical_bytes(doc) + b"\n"
    (d / MANIFEST).write_bytes(raw)
    return sha256_bytes(raw)


def _copy(capture_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(capture_dir, d)
    return d


# -- RNG states -------------------------------------------------------------------------------------

def test_a_cpu_rng_state_the_generator_refuses_is_refused_at_admission(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """rng.cpu of the right length but not an mt19937 state (rows untouched, the manifest re-pinned): refused by
    explain and replay alike, not left to fail when the replay restores it."""
    d = _copy(capture_dir, tmp_path)
    data = bytearray((d / PAYLOAD).read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + n])["rng.cpu"]["data_offsets"]
    data[8 + n + start:8 + n + end] = b"\xff" * (end - start)
    (d / PAYLOAD).write_bytes(bytes(data))
    new_pin = _rewrite_manifest(d, lambda doc: doc["payload"].update(spans_sha256=payload.digest_bytes(data)))
    _refused_by_both(capsys, workspace / "replay.toml", _pins(capture_dir, manifest=new_pin, replay_path=d / MANIFEST),
                     tmp_path / "o", "rng.cpu is not a state Torch's CPU generator accepts")


def _batch_and_rng(capture_dir: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    return payload.decode((capture_dir / PAYLOAD).read_bytes())


@pytest.mark.parametrize("state, needle", [
    (torch.zeros(15, dtype=torch.uint8), "rng.cuda.0 has 15 bytes, a CUDA generator state has 16"),
    (torch.tensor([0] * 8 + [2] + [0] * 7, dtype=torch.uint8), "Philox offset 2"),
])
def test_a_cuda_rng_state_the_generator_would_refuse_is_refused_without_a_device(
        capture_dir: Path, state: torch.Tensor, needle: str) -> None:
    batch, rng = _batch_and_rng(capture_dir)
    with pytest.raises(IntegrityError, match=r"rng\.cuda\.0") as exc:
        payload.decode(payload.encode(batch, {**rng, "cuda.0": state}))
    assert needle in exc.value.message
    ok = torch.tensor([7] * 8 + [8] + [0] * 7, dtype=torch.uint8)  # any seed, an offset a multiple of 4
    assert rng_state_reason("cuda.0", ok) is None
    assert sorted(payload.decode(payload.encode(batch, {**rng, "cuda.0": ok}))[1]) == ["cpu", "cuda.0"]


def test_restoring_an_rng_state_the_generator_refuses_is_a_refusal_naming_it(capture_dir: Path) -> None:
    """What reaches the restore anyway (a checkpoint's rng.safetensors, a state built in memory) is refused as
    the input's fault (exit 2), and the process's generator is left as it was."""
    before = torch.get_rng_state()
    with pytest.raises(IntegrityError, match=r"rng\.cpu is not a state Torch's CPU generator accepts") as exc:
        restore_rng({"cpu": torch.full_like(before, 0xFF)})
    assert exc.value.exit_code == 2
    with pytest.raises(IntegrityError, match=r"rng\.cuda\.3 has 4 bytes"):
        restore_rng({"cpu": before, "cuda.3": torch.zeros(4, dtype=torch.uint8)})
    assert torch.equal(torch.get_rng_state(), before)
    _, rng = _batch_and_rng(capture_dir)
    restore_rng(rng)
    assert torch.equal(torch.get_rng_state(), rng["cpu"])
    torch.set_rng_state(before)


# -- the resume state --------------------------------------------------------------------------------

def _edited_state(workspace: Path, tmp_path: Path, change: Any) -> Path:
    d = tmp_path / "state"
    shutil.copytree(workspace / "init_resume", d)
    doc = json.loads((d / STATE_FILE).read_text())
    change(doc)
    (d / STATE_FILE).write_text(json.dumps(doc))
    return d


def test_explain_refuses_a_resume_state_made_for_another_model(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The model reference the replay compares once its model is built is compared by explain too, from the
    config alone: what explain admits, the replay does not then refuse."""
    state = _edited_state(workspace, tmp_path, lambda doc: doc["model"].update(init_seed=999))
    _refused_by_both(capsys, workspace / "replay.toml", _pins(capture_dir, resume=state), tmp_path / "o",
                     "resume state was made for model", "'init_seed': 999", str(state / STATE_FILE))


def test_a_resume_state_with_an_unknown_key_is_refused(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _edited_state(workspace, tmp_path, lambda doc: doc.update(evil=1))
    with pytest.raises(IntegrityError, match=r"unknown key\(s\) \['evil'\]"):
        read_state(state)
    _refused_by_both(capsys, workspace / "replay.toml", _pins(capture_dir, resume=state), tmp_path / "o",
                     "unknown key(s) ['evil']", str(state / STATE_FILE))


# -- the manifest's initial adapter ------------------------------------------------------------------

def test_an_initial_adapter_size_that_contradicts_its_pinned_file_is_refused(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(capture_dir, tmp_path)
    new_pin = _rewrite_manifest(d, lambda doc: doc["initial_adapter"].update(size=1))
    size = (workspace / "init_resume" / "adapter_model.safetensors").stat().st_size
    _refused_by_both(capsys, workspace / "replay.toml", _pins(capture_dir, manifest=new_pin, replay_path=d / MANIFEST),
                     tmp_path / "o", "initial_adapter.size is 1", f"is {size} bytes")
