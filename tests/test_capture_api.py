"""The public capture API end to end: examples/plain_torch_loop.py captured, explained and replayed.

The example runs as a real script (in a fresh process, from a copy so its pinned replay target
can be edited), then explain and replay run in-process through the CLI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from replayjob.cli import main
from replayjob.integrations import capture as cap
from replayjob.optbatch import knobs

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plain_torch_loop.py"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("plain_torch_loop_under_test", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("plain_loop")
    script = d / "plain_torch_loop.py"
    shutil.copy(EXAMPLE, script)
    # run under a home directory of its own: the base model lies in it (see test_no_home_path_...)
    proc = subprocess.run([sys.executable, str(script), str(d / "out")], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "HOME": str(d)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return script, d / "out"


def test_no_home_path_in_the_integration_capture_manifest(example_run: tuple[Path, Path]) -> None:
    # the base model's path follows the built-in manifest's rule (replayjob.config.redact.redact_path)
    _, out = example_run
    (path,) = (out / "capture").glob("*.manifest.json")
    assert json.loads(path.read_text())["base_model"]["path"] == "~/out/base"
    # the replay config names the directory itself: a replay loads it from there
    assert f'path = "{(out / "base").resolve()}"' in (out / "capture" / "replay.toml").read_text()


def test_example_capture_explain_replay_bitwise(example_run: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = example_run
    toml = out / "capture" / "replay.toml"
    assert main(["explain", str(toml)]) == 0
    assert main(["replay", str(toml), "--out", str(tmp_path / "r")]) == 0
    src = json.loads((out / "capture" / "metrics.json").read_text())
    rep = json.loads((tmp_path / "r" / "replay_metrics.json").read_text())
    assert rep["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    assert rep["loss"] == src["loss"] and rep["grad_norm"] == src["grad_norm"]
    assert rep["framework"] == "torch" and rep["step"] == 1 and rep["rng_restored"] == ["cpu"]
    assert rep["runtime"] == {}  # framework "torch" registers no knobs: its whole config is the contract
    assert rep["host"]["device_type"] == "cpu" and rep["rows"]["rows"] >= 1
    verdict = tmp_path / "bitwise.json"
    assert main(["reduce", str(tmp_path / "r"), "--claim", "bitwise", "--source", str(out / "capture"),
                 "--min-repeats", "1", "--out", str(verdict)]) == 0
    checks = {c["name"]: c for c in json.loads(verdict.read_text())["checks"]}
    assert checks["inputs.capture_pins"]["status"] == "pass"
    assert checks["inputs.capture_pins"]["expected"]["framework"] == "torch"
    assert checks["inputs.final_adapter_on_disk"]["status"] == checks["exact.knobs_in_effect"]["status"] == "pass"


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d["pins"].update(payload_spans_sha256="0" * 64), "payload pin"),
    (lambda d: d.update(framework="trl", runtime=dict.fromkeys(knobs.knobs_for("trl"))), "framework"),
    (lambda d: d.update(framework="replayjob"), "runtime"),
])
def test_reduce_verifies_a_replay_against_the_integration_capture(
        example_run: tuple[Path, Path], tmp_path: Path, edit: Callable[[dict[str, Any]], None], field: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, out = example_run
    r = tmp_path / "r"
    assert main(["replay", str(out / "capture" / "replay.toml"), "--out", str(r)]) == 0
    doc = json.loads((r / "replay_metrics.json").read_text())
    edit(doc)
    (r / "replay_metrics.json").write_text(json.dumps(doc))
    capsys.readouterr()
    verdict = tmp_path / "v.json"
    assert main(["reduce", str(r), "--claim", "exact-input", "--source", str(out / "capture"),
                 "--min-repeats", "1", "--out", str(verdict)]) == 2
    if field == "runtime":  # the replay's producer decides which knobs it must report
        assert "runtime" in capsys.readouterr().err
    else:
        check = next(c for c in json.loads(verdict.read_text())["checks"] if c["name"] == "inputs.capture_pins")
        assert check["status"] == "refused" and any(field in o for o in check["offenders"]), check


def test_capture_does_not_change_the_loop(example_run: tuple[Path, Path], tmp_path: Path) -> None:
    script, _ = example_run
    mod = _load(script)
    on, off = mod.main(tmp_path / "on"), mod.main(tmp_path / "off", capture_step=None)
    assert on["losses"] == off["losses"]


def test_a_changed_replay_target_is_refused(example_run: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    script, _ = example_run
    d = tmp_path / "copy"
    shutil.copytree(script.parent, d)
    (d / script.name).write_text(script.read_text() + "\n# edited\n")
    manifest = d / "out" / "capture" / "optimizer_batch_step_000001.manifest.json"
    sets = ["--set", f'integration.entry="{d / script.name}:replay_target"',
            "--set", f'optimizer_batch.replay_path="{manifest}"']
    capsys.readouterr()
    assert main(["explain", str(d / "out" / "capture" / "replay.toml"), *sets]) == 2
    assert "is not the one recorded at capture" in capsys.readouterr().err


def test_capture_api_refuses_misuse(example_run: tuple[Path, Path], tmp_path: Path) -> None:
    script, out = example_run
    mod = _load(script)
    model, opt, sched = mod.build(out / "base", torch.device("cpu"))
    with pytest.raises(cap.CaptureError, match="not loaded from a local directory"):
        cap.StepCapture(tmp_path / "a", step=0, framework="torch", model=model, optimizer=opt, scheduler=sched,
                        base_model_dir=tmp_path / "nowhere", config={"torch": {}, "model": {"path": ""}})
    c = cap.StepCapture(tmp_path / "b", step=0, framework="torch", model=model, optimizer=opt, scheduler=sched,
                        base_model_dir=out / "base", config={"torch": {}, "model": {"path": str(out / "base")}})
    with pytest.raises(cap.CaptureError, match="outside begin"):
        c.record({"ids": torch.zeros(2, dtype=torch.long)})
    c.begin()
    with pytest.raises(cap.CaptureError, match="neither a tensor nor a JSON value"):
        c.record({"ids": torch.zeros(2, dtype=torch.long), "fn": object()})
    with pytest.raises(cap.CaptureError, match="no micro-batch was recorded"):
        c.finish()
    assert not (tmp_path / "b").exists()  # nothing half-written
