"""On CUDA: one capture and two fresh-process replays under strict determinism are bitwise identical.

Marked ``gpu`` (and ``slow``: every step is a fresh ``python -m replayjob`` process with the
determinism environment of the image); skipped where torch sees no CUDA device.  Run on a GPU node
with ``pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from replayjob.artifacts.spec import DETERMINISM_ENV
from replayjob.digest import sha256_file

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible")]

CUDA = 'backend.devices="cuda:0"'


def test_capture_and_two_replays_are_bitwise_on_cuda(tmp_path: Path) -> None:
    env = {**os.environ, **DETERMINISM_ENV}
    ws = tmp_path / "ws"

    def ok(*args: str) -> None:
        proc = run_cli(*args, env=env)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-4000:])

    ok("init", str(ws), "--seed", "123")
    ok("capture", str(ws / "source.toml"), "--out", str(ws / "source"), "--set", CUDA)
    src = json.loads((ws / "source" / "metrics.json").read_text())
    pins = ["--set", f"optimizer_batch.expected_logical_sha256=\"{src['optimizer/logical_batch_sha256']}\"",
            "--set", f"optimizer_batch.expected_manifest_sha256=\"{src['optimizer_batch/manifest_sha256']}\""]
    ok("replay", str(ws / "replay.toml"), "--out", str(ws / "replays" / "baseline"), "--repeat", "2",
       "--set", CUDA, *pins)
    replays = [json.loads((ws / "replays" / "baseline" / f"repeat-{i:03d}" / "replay_metrics.json").read_text())
               for i in range(2)]
    assert [r["device"] for r in replays] == ["cuda:0", "cuda:0"]
    assert all(r["memory"]["kind"] == "cuda_max_allocated" for r in replays)
    finals = {r["optimizer_batch/final_adapter_sha256"] for r in replays}
    assert finals == {src["optimizer_batch/final_adapter_sha256"]}, "CUDA updates differ bitwise"
    for i in range(2):
        d = ws / "replays" / "baseline" / f"repeat-{i:03d}"
        assert sha256_file(d / replays[i]["final_adapter_path"]) in finals
    assert replays[0]["loss"] == replays[1]["loss"] == src["loss"]
    out = tmp_path / "verdict.json"
    ok("reduce", str(ws / "replays"), "--claim", "bitwise", "--source", str(ws / "source"), "--min-repeats", "2",
       "--out", str(out))
    assert json.loads(out.read_text())["status"] == "pass"
