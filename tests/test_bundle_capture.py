"""Bundle capture from the source trainer: one in-process training run with capture on.

The session fixture trains the workspace's tiny CPU model for two steps with
``REPLAYJOB_BUNDLE_CAPTURE=1`` (steps limited to ``1:0``) and once more with capture off, so the
same two runs serve every test here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from replayjob.bundle import load_bundle
from replayjob.bundle.hook import BundleCapture, capture_from_env
from replayjob.bundle.synthetic import make
from replayjob.cli import main
from replayjob.config import load_config
from replayjob.errors import ArtifactExistsError, ConfigError, RefusedError


@pytest.fixture(scope="session")
def captured(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bundle-capture")
    argv = ["train", str(workspace / "train.toml"), "--set", "training.max_steps=2",
            "--set", "algorithm.prompts_per_step=2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPLAYJOB_BUNDLE_CAPTURE", "1")
        mp.setenv("REPLAYJOB_BUNDLE_DIR", str(d / "cap"))
        mp.setenv("REPLAYJOB_BUNDLE_STEPS", "1:0")
        mp.delenv("REPLAYJOB_BUNDLE_ROLLOUTS", raising=False)
        assert main([*argv, "--out", str(d / "on")]) == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("REPLAYJOB_BUNDLE_CAPTURE", raising=False)
        assert main([*argv, "--out", str(d / "off")]) == 0
    return d


def _strip(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("timing", "memory")}


def test_capture_writes_the_selected_bundles_which_validate_and_replay(captured: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    cap = captured / "cap"
    assert sorted(p.name for p in cap.iterdir()) == ["rollout-000000", "rollout-000001", "step-000001-000000"]
    for name in ("rollout-000000", "rollout-000001", "step-000001-000000"):
        assert main(["bundle", "validate", str(cap / name)]) == 0
    capsys.readouterr()
    assert main(["bundle", "replay", str(cap), "--rollout", "1", "--json"]) == 0
    rollout = json.loads(capsys.readouterr().out)
    assert {s["stage"]: s["status"] for s in rollout["stages"]} == {
        "sample": "skipped", "reward.raw": "pass", "reward.post_process": "pass", "advantage.kl": "pass",
        "advantage.estimate": "pass"}
    assert main(["bundle", "replay", str(cap), "--step", "1:0", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {s["stage"]: s["status"] for s in rep["stages"]} == {"sample": "skipped", "loss.policy": "pass"}


def test_step_bundle_records_what_the_update_saw(captured: Path) -> None:
    metrics = json.loads((captured / "on" / "metrics.json").read_text())
    b = load_bundle(captured / "cap" / "step-000001-000000")
    assert b.expected["loss.policy"]["loss"] == metrics["loss"]
    assert b.index["identity"] == {"rollout_id": 1, "step_id": 0,
                                   "physical": {"rank": 0, "world_size": 1, "weight_version": 1}}
    assert b.payloads["logprobs"].dtype == torch.float32
    assert {s["group"] for s in b.samples} == {"g-0000", "g-0001"} and len(b.samples) == 8
    r = load_bundle(captured / "cap" / "rollout-000001")
    assert r.capability("reward.raw") == "recompute" and r.config["estimator"] == "grpo"
    assert torch.equal(r.payloads["mask"], b.payloads["mask"])


def test_capture_does_not_change_training_numerics(captured: Path) -> None:
    on = [_strip(json.loads(x)) for x in (captured / "on" / "diag.jsonl").read_text().splitlines()]
    off = [_strip(json.loads(x)) for x in (captured / "off" / "diag.jsonl").read_text().splitlines()]
    assert len(on) == 2 and on == off
    m_on, m_off = (json.loads((captured / d / "metrics.json").read_text()) for d in ("on", "off"))
    assert m_on["final_adapter_sha256"] == m_off["final_adapter_sha256"]


def test_no_raw_text_in_captured_bundles(captured: Path) -> None:
    blob = b"".join(p.read_bytes() for p in (captured / "cap").rglob("*") if p.is_file())
    assert b"Q:" not in blob  # the arithmetic prompts ("Q:12+34=") appear only as hashes
    rec = load_bundle(captured / "cap" / "rollout-000000").samples[0]
    assert {"prompt_sha256", "completion_sha256", "label_sha256"} <= set(rec)


def test_environment_switch(workspace: Path, tmp_path: Path) -> None:
    cfg = load_config(str(workspace / "train.toml"), [])
    assert capture_from_env(cfg, {}) is None and capture_from_env(cfg, {"REPLAYJOB_BUNDLE_CAPTURE": "0"}) is None
    for env, cause in (({"REPLAYJOB_BUNDLE_CAPTURE": "yes"}, "must be 1 or 0"),
                       ({"REPLAYJOB_BUNDLE_CAPTURE": "1"}, "needs REPLAYJOB_BUNDLE_DIR"),
                       ({"REPLAYJOB_BUNDLE_CAPTURE": "1", "REPLAYJOB_BUNDLE_DIR": str(tmp_path),
                         "REPLAYJOB_BUNDLE_STEPS": "1"}, "R:S")):
        with pytest.raises(ConfigError, match=cause):
            capture_from_env(cfg, env)


def _feed(hook: BundleCapture) -> None:
    """One step through the hook, with tensors from the synthetic step (same stage functions)."""
    from replayjob.rl.hooks import StepRollout
    from replayjob.rl.update import UpdateResult

    s = make(groups=2, group_size=4)
    n = len(s.group)
    resp = [s.t["response_ids"][i, : s.lengths[i]].tolist() for i in range(n)]
    rollout = StepRollout(0, ["Q:1+2="] * n, s.labels, s.completions, [[1, 2, 3]] * n, resp,
                          torch.tensor(s.group), s.t["raw"], s.t["scores"], s.t["mask"], s.t["old_logprobs"],
                          s.t["ref_logprobs"], s.t["kl"], s.t["advantages"], s.t["mask"], s.t["loss_weights"])
    hook.on_rollout(rollout)
    flat = torch.cat([s.t["logprobs"][i, : s.lengths[i]] for i in range(n)])
    hook.after_update(0, UpdateResult(loss=float(s.t["loss"]), grad_norm=0.0, logprobs=flat))


def _hook(workspace: Path, directory: Path) -> BundleCapture:
    cfg = load_config(str(workspace / "train.toml"), ["algorithm.group_size=4", "algorithm.prompts_per_step=2"])
    return BundleCapture(cfg, directory, None, None)


def test_training_thread_never_waits_for_the_writer(workspace: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's finalize is held on an event: the hook calls must still return at once."""
    from replayjob.bundle import writer as writer_mod

    gate = threading.Event()
    real = writer_mod.BundleWriter.finalize

    def held(self: writer_mod.BundleWriter) -> Path:
        assert threading.current_thread().name == "bundle-writer"
        gate.wait(30)
        return real(self)

    monkeypatch.setattr(writer_mod.BundleWriter, "finalize", held)
    hook = _hook(workspace, tmp_path / "cap")
    _feed(hook)
    assert not (tmp_path / "cap").exists()  # nothing written yet: the calls did not wait
    gate.set()
    written = hook.close()
    assert sorted(p.name for p in written) == ["rollout-000000", "step-000000-000000"]
    assert main(["bundle", "replay", str(tmp_path / "cap" / "step-000000-000000")]) == 0


def test_no_capture_writer_works_during_the_update(workspace: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Both writers (started idle) get their work only once the update has returned.

    A probe hook runs before the capture hooks, so its ``after_update`` marks the moment the update
    is over and the capture hooks have not yet handed anything over; every writer's first piece of
    work (encoding the payload, building a bundle) must come after that mark.
    """
    from replayjob.bundle import hook as hook_mod
    from replayjob.optbatch import capture as capture_mod
    from replayjob.rl.hooks import StepHook
    from replayjob.source_run import train_source

    events: list[str] = []

    def traced(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(capture_mod.payload, "encode", traced("payload", capture_mod.payload.encode))
    monkeypatch.setattr(hook_mod.BundleCapture, "_bundle", traced("bundle", hook_mod.BundleCapture._bundle))

    class Probe(StepHook):
        def after_update(self, step: int, result: Any) -> None:
            events.append("update returned")

    monkeypatch.setenv("REPLAYJOB_BUNDLE_CAPTURE", "1")
    monkeypatch.setenv("REPLAYJOB_BUNDLE_DIR", str(tmp_path / "bundles"))
    cfg = load_config(str(workspace / "source.toml"), ["optimizer_batch.capture=true"])
    metrics = train_source(cfg, tmp_path / "run", [Probe()])
    assert events[0] == "update returned" and sorted(events[1:]) == ["bundle", "bundle", "payload"], events
    assert metrics["optimizer_batch/manifest_sha256"]
    assert sorted(p.parent.name for p in (tmp_path / "bundles").rglob("COMPLETE")) == [
        "rollout-000000", "step-000000-000000"]


def test_a_build_error_surfaces_when_training_ends(workspace: Path, tmp_path: Path) -> None:
    from replayjob.rl.hooks import StepRollout
    from replayjob.rl.update import UpdateResult

    s = make(groups=2, group_size=4)
    n = len(s.group)
    resp = [s.t["response_ids"][i, : s.lengths[i]].tolist() for i in range(n)]
    hook = _hook(workspace, tmp_path / "cap")
    hook.on_rollout(StepRollout(0, ["Q:1+2="] * n, s.labels, s.completions, [[1, 2, 3]] * n, resp,
                                torch.tensor(s.group), s.t["raw"], s.t["scores"], s.t["mask"], s.t["old_logprobs"],
                                s.t["ref_logprobs"], s.t["kl"], s.t["advantages"], s.t["mask"], s.t["loss_weights"]))
    hook.after_update(0, UpdateResult(loss=0.0, grad_norm=0.0, logprobs=torch.zeros(3)))  # too few: no raise here
    with pytest.raises(RefusedError, match="exposed 3 logprobs"):
        hook.close()
    assert (tmp_path / "cap" / "rollout-000000" / "COMPLETE").is_file()  # the rollout bundle still landed
    assert not (tmp_path / "cap" / "step-000000-000000").exists()


def test_write_errors_surface_when_training_ends(workspace: Path, tmp_path: Path) -> None:
    (tmp_path / "cap" / "rollout-000000").mkdir(parents=True)  # a bundle of that name already exists
    hook = _hook(workspace, tmp_path / "cap")
    _feed(hook)
    with pytest.raises(ArtifactExistsError, match="bundle directory already exists"):
        hook.close()
    assert (tmp_path / "cap" / "step-000000-000000" / "COMPLETE").is_file()  # the other bundle still landed


def test_inspect_and_validate_import_no_model_code(captured: Path) -> None:
    code = ("import sys; from replayjob.cli import main; "
            f"rc = main(['bundle', 'validate', {str(captured / 'cap' / 'rollout-000000')!r}]) + "
            f"main(['bundle', 'inspect', {str(captured / 'cap')!r}]); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft') "
            "or m == 'replayjob.rl.trainer']; print('BAD', bad); sys.exit(rc or bool(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BAD []" in proc.stdout
