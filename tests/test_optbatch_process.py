"""Fresh-process behaviour: a capture killed at any point, what replay and explain import, --repeat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from replayjob.cli import main
from replayjob.config import load_config
from replayjob.crashpoints import POINT_ENV
from replayjob.digest import sha256_file
from replayjob.producers.builtin.admission import admit
from replayjob.runtime.distributed import observe

MANIFEST = "optimizer_batch_step_000000.manifest.json"
PAYLOAD = "optimizer_batch_step_000000.safetensors"
pytestmark = pytest.mark.slow


def pin_sets(capture_dir: Path) -> list[str]:
    m = json.loads((capture_dir / "metrics.json").read_text())
    return [f"optimizer_batch.expected_logical_sha256={m['optimizer/logical_batch_sha256']}",
            f"optimizer_batch.expected_manifest_sha256={m['optimizer_batch/manifest_sha256']}"]


# (fault point, whether a manifest must remain); each process SIGKILLs itself at its point
KILLS = [
    (f"write.half/{PAYLOAD}:1", False),       # payload temp file half written
    (f"write.half/{MANIFEST}:1", False),      # payload in place, manifest temp file half written
    (f"write.linked/{MANIFEST}:1", True),     # manifest in place, its temp name not yet removed
    ("capture.metrics:1", True),              # update done, metrics.json not yet written
]


def test_a_killed_capture_leaves_no_manifest_or_a_verified_one(workspace: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    procs = {}
    for i, (spec, _) in enumerate(KILLS):  # all at once, one thread each
        env = {**os.environ, POINT_ENV: spec, "OMP_NUM_THREADS": "1"}
        procs[i] = subprocess.Popen(
            [sys.executable, "-m", "replayjob", "capture", str(workspace / "source.toml"), "--out",
             str(tmp_path / f"k{i}")], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for i, proc in procs.items():
        spec, expect_manifest = KILLS[i]
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == -signal.SIGKILL, (spec, err.decode()[-2000:])
        out = tmp_path / f"k{i}"
        assert not (out / "metrics.json").exists(), spec
        assert (out / MANIFEST).exists() == expect_manifest, spec
        if expect_manifest:
            # the manifest is complete and admits a replay pinned to its own digests
            doc = json.loads((out / MANIFEST).read_text())
            cfg = load_config(workspace / "replay.toml", [
                f'optimizer_batch.replay_path="{out / MANIFEST}"',
                f"optimizer_batch.expected_logical_sha256={doc['logical_batch_sha256']}",
                f"optimizer_batch.expected_manifest_sha256={sha256_file(out / MANIFEST)}"])
            adm = admit(observe(cfg, running=False))  # resolved as an entry point resolves it
            assert adm.admitted, (spec, adm.reasons)
        # a rerun into the same directory refuses, naming what is already there
        assert main(["capture", str(workspace / "source.toml"), "--out", str(out)]) == 2
        err_text = capsys.readouterr().err
        assert ("already" in err_text or "interrupted capture" in err_text) and str(out) in err_text, err_text


SCRIPT = """
import json, sys
from replayjob.cli import main
cfg, out, *sets = sys.argv[1:]
flags = [x for s in sets for x in ("--set", s)]
rc_explain = main(["explain", cfg, *flags])
after_explain = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "peft"))
rc_replay = main(["replay", cfg, "--out", out, *flags])
watched = ("replayjob.rl.sampling", "replayjob.rl.task", "replayjob.producers.builtin.trainer", "datasets",
           "transformers")
print(json.dumps({"rc": [rc_explain, rc_replay], "after_explain": after_explain,
                  "after_replay": sorted(m for m in sys.modules if m in watched)}))
"""


def test_explain_imports_no_model_code_and_replay_no_data_code(workspace: Path, capture_dir: Path,
                                                               tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(workspace / "replay.toml"), str(tmp_path / "r"),
                           *pin_sets(capture_dir)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == [0, 0]
    assert result["after_explain"] == []
    # transformers shows the check sees what replay imports; sampling, the task and the trainer never load
    assert result["after_replay"] == ["transformers"]


def test_repeat_runs_fresh_processes_with_their_index(workspace: Path, capture_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(workspace / "replay.toml"), "--out", str(tmp_path), "--repeat", "2",
                 *[x for s in pin_sets(capture_dir) for x in ("--set", s)]]) == 0
    printed = capsys.readouterr().out
    src = json.loads((capture_dir / "metrics.json").read_text())
    for i in range(2):
        rm = json.loads((tmp_path / f"repeat-{i:03d}" / "replay_metrics.json").read_text())
        assert rm["repeat_index"] == i and rm["arm"] == "baseline"
        assert rm["loss"] == src["loss"]
        assert rm["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
        assert rm["memory"]["peak_bytes"] > 0
        assert f"repeat {i}:" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repeat-000", "repeat-001"]
    # a second --repeat into the same directory refuses before starting any process
    assert main(["replay", str(workspace / "replay.toml"), "--out", str(tmp_path), "--repeat", "2",
                 *[x for s in pin_sets(capture_dir) for x in ("--set", s)]]) == 2
    assert "already exists" in capsys.readouterr().err
