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
from replayjob.errors import ArtifactExistsError, ConfigError, RefusedError, ReplayjobError


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
    """Step 0: its rollout only (the steps are limited to 1:0); step 1: rollout and actor step in one
    update bundle, which both selectors find and whose every stage recomputes."""
    cap = captured / "cap"
    assert sorted(p.name for p in cap.iterdir()) == ["rollout-000000", "update-000001-000000"]
    for name in ("rollout-000000", "update-000001-000000"):
        assert main(["bundle", "validate", str(cap / name)]) == 0
    capsys.readouterr()
    assert main(["bundle", "replay", str(cap), "--rollout", "0", "--json"]) == 0
    rollout = json.loads(capsys.readouterr().out)
    assert {s["stage"]: s["status"] for s in rollout["stages"]} == {
        "sample": "skipped", "reward.raw": "pass", "reward.post_process": "pass", "advantage.kl": "pass",
        "advantage.estimate": "pass"}
    for selector in (["--rollout", "1"], ["--step", "1:0"]):
        assert main(["bundle", "replay", str(cap), *selector, "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["bundle_id"] == "update-000001-000000"
        assert {s["stage"]: s["status"] for s in rep["stages"]} == {
            "sample": "skipped", "reward.raw": "pass", "reward.post_process": "pass", "advantage.kl": "pass",
            "advantage.estimate": "pass", "loss.policy": "pass"}


def test_update_bundle_records_what_the_update_saw(captured: Path) -> None:
    metrics = json.loads((captured / "on" / "metrics.json").read_text())
    b = load_bundle(captured / "cap" / "update-000001-000000")
    assert b.expected["loss.policy"]["loss"] == metrics["loss"]
    assert b.index["identity"] == {"rollout_id": 1, "step_id": 0,
                                   "physical": {"rank": 0, "world_size": 1, "weight_version": 1}}
    assert b.payloads["logprobs"].dtype == torch.float32
    assert {s["group"] for s in b.samples} == {"g-0000", "g-0001"} and len(b.samples) == 8
    assert b.capability("reward.raw") == "recompute" and b.config["estimator"] == "grpo"
    # one payload for the advantages: advantage.estimate's recorded output, the policy loss's input
    assert b.manifest["payloads"]["advantages"]["role"] == "expected"
    assert b.expected["advantage.estimate"]["advantages"] == {"payload": "advantages"}


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


def _feed(hook: BundleCapture, step: int = 0, logprobs: torch.Tensor | None = None, update: bool = True,
          loss_delta: float = 0.0) -> None:
    """One step through the hook, with tensors from the synthetic step (same stage functions);
    ``logprobs`` replaces the update's flat logprobs and ``loss_delta`` shifts its loss (to plant a
    fault); ``update=False``: the update never returns."""
    from replayjob.rl.hooks import StepRollout
    from replayjob.rl.update import UpdateResult

    s = make(groups=2, group_size=4)
    n = len(s.group)
    resp = [s.t["response_ids"][i, : s.lengths[i]].tolist() for i in range(n)]
    rollout = StepRollout(step, ["Q:1+2="] * n, s.labels, s.completions, [[1, 2, 3]] * n, resp,
                          torch.tensor(s.group), s.t["raw"], s.t["scores"], s.t["mask"], s.t["old_logprobs"],
                          s.t["ref_logprobs"], s.t["kl"], s.t["advantages"], s.t["mask"], s.t["loss_weights"])
    hook.on_rollout(rollout)
    if not update:
        return
    flat = torch.cat([s.t["logprobs"][i, : s.lengths[i]] for i in range(n)]) if logprobs is None else logprobs
    hook.after_update(step, UpdateResult(loss=float(s.t["loss"]) + loss_delta, grad_norm=0.0, logprobs=flat))


def _hook(workspace: Path, directory: Path, build_on_training_thread: bool | None = None) -> BundleCapture:
    cfg = load_config(str(workspace / "train.toml"), ["algorithm.group_size=4", "algorithm.prompts_per_step=2"])
    return BundleCapture(cfg, directory, None, None, build_on_training_thread)


def _threads(monkeypatch: pytest.MonkeyPatch, gate: threading.Event | None = None) -> dict[str, list[str]]:
    """Record which thread prepares (builds) and which writes each bundle; writes wait on ``gate``."""
    from replayjob.bundle import writer as writer_mod

    threads: dict[str, list[str]] = {"prepare": [], "write": []}
    real_prepare, real_write = writer_mod.BundleWriter.prepare, writer_mod.BundleWriter.write

    def prepare(self: writer_mod.BundleWriter) -> writer_mod.PreparedBundle:
        threads["prepare"].append(threading.current_thread().name)
        return real_prepare(self)

    def write(self: writer_mod.BundleWriter, prepared: writer_mod.PreparedBundle) -> Path:
        threads["write"].append(threading.current_thread().name)
        if gate is not None:
            gate.wait(30)
        return real_write(self, prepared)

    monkeypatch.setattr(writer_mod.BundleWriter, "prepare", prepare)
    monkeypatch.setattr(writer_mod.BundleWriter, "write", write)
    return threads


def test_a_cpu_step_is_built_at_the_next_rollout_and_the_training_thread_never_waits_on_disk(
        workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step computes on the CPU: nothing is built inside the captured step; the next step's
    rollout builds its bundles on the training thread; the writer thread writes them, and while the
    writes are held on an event every hook call still returns at once."""
    gate = threading.Event()
    threads = _threads(monkeypatch, gate)
    hook = _hook(workspace, tmp_path / "cap")
    _feed(hook, 0)
    assert threads == {"prepare": [], "write": []}  # the captured step paid for copies only
    _feed(hook, 1)
    main_thread = threading.main_thread().name
    assert threads["prepare"] == [main_thread]  # step 0's update bundle, at step 1's rollout
    assert not list((tmp_path / "cap").rglob("COMPLETE"))  # nothing written yet: the calls did not wait
    gate.set()
    written = hook.close()  # builds step 1's on this thread, then drains the writer
    assert threads == {"prepare": [main_thread] * 2, "write": ["bundle-writer"] * 2}
    assert sorted(p.name for p in written) == ["update-000000-000000", "update-000001-000000"]
    assert main(["bundle", "replay", str(tmp_path / "cap" / "update-000001-000000")]) == 0


def test_a_device_step_s_bundles_are_built_and_written_by_the_writer_thread(
        workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU step gets (forced here: no GPU): the training thread hands over the snapshots only,
    once the update has returned, and the writer thread builds and writes."""
    threads = _threads(monkeypatch)
    hook = _hook(workspace, tmp_path / "cap", build_on_training_thread=False)
    _feed(hook)
    written = hook.close()
    assert threads == {"prepare": ["bundle-writer"], "write": ["bundle-writer"]}
    assert [p.name for p in written] == ["update-000000-000000"]
    assert main(["bundle", "replay", str(tmp_path / "cap" / "update-000000-000000")]) == 0


def test_where_the_parameters_live_decides_who_builds(workspace: Path, tmp_path: Path) -> None:
    """The rollout's tensors are on the CPU whatever the device; the trained parameters are not."""
    from replayjob.rl.hooks import TrainerView

    def view(device: str) -> TrainerView:
        param = torch.nn.Parameter(torch.zeros(2, device=device))
        return TrainerView(lambda: {}, torch.optim.SGD([param], lr=0.1), {}, 0)

    cpu, device = _hook(workspace, tmp_path / "a"), _hook(workspace, tmp_path / "b")
    cpu.on_train_begin(view("cpu"))
    device.on_train_begin(view("meta"))  # a device that is not the CPU (no GPU here)
    assert cpu.build_on_training_thread is True and device.build_on_training_thread is False
    forced = _hook(workspace, tmp_path / "c", build_on_training_thread=False)
    forced.on_train_begin(view("cpu"))
    assert forced.build_on_training_thread is False  # an explicit choice stands
    for hook in (cpu, device, forced):
        hook.close()


def test_a_step_that_cannot_be_bundled_does_not_stop_training(workspace: Path, tmp_path: Path) -> None:
    """Too few logprobs for step 0: its actor step is refused (at close), its rollout still lands
    alone, and step 1 is bundled as usual."""
    hook = _hook(workspace, tmp_path / "cap")
    _feed(hook, 0, logprobs=torch.zeros(3))  # too few
    _feed(hook, 1)
    with pytest.raises(RefusedError, match="exposed 3 logprobs"):
        hook.close()
    assert sorted(p.parent.name for p in (tmp_path / "cap").rglob("COMPLETE")) == [
        "rollout-000000", "update-000001-000000"]


def test_a_build_error_at_the_next_rollout_does_not_stop_training(workspace: Path, tmp_path: Path) -> None:
    """Step 0's bundle cannot be built (its config is refused) when step 1's rollout builds it: the
    error is kept, steps 1 and 2 are bundled, and the error surfaces at close."""
    hook = _hook(workspace, tmp_path / "cap")
    good = hook.config
    _feed(hook, 0)
    hook.config = {**good, "estimator": "ppo"}
    _feed(hook, 1)  # builds step 0's bundle: refused, kept
    hook.config = good
    _feed(hook, 2)  # builds step 1's
    with pytest.raises(ReplayjobError, match="unsupported topology"):
        hook.close()  # builds step 2's, then raises step 0's error
    assert sorted(p.parent.name for p in (tmp_path / "cap").rglob("COMPLETE")) == [
        "update-000001-000000", "update-000002-000000"]


def test_an_update_bundle_names_the_loss_as_its_first_divergence(workspace: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Every stage before the loss recomputes; a loss the update reported wrong is the first divergence."""
    hook = _hook(workspace, tmp_path / "cap")
    _feed(hook, 0, loss_delta=0.25)
    hook.close()
    capsys.readouterr()
    assert main(["bundle", "replay", str(tmp_path / "cap"), "--step", "0:0", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["first_divergence"]["stage"] == "loss.policy" and rep["first_divergence"]["field"] == "loss"
    assert [s["status"] for s in rep["stages"]] == ["skipped", "pass", "pass", "pass", "pass", "fail"]


def test_a_reused_capture_directory_makes_rollout_selection_ambiguous(workspace: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A run that failed inside step 0 left rollout-000000; a rerun into the same directory adds
    update-000000-000000.  --rollout 0 names both and asks for one; --step 0:0 is exact."""
    failed, rerun = _hook(workspace, tmp_path / "cap"), _hook(workspace, tmp_path / "cap")
    _feed(failed, 0, update=False)
    failed.abandon()
    _feed(rerun, 0)
    rerun.close()
    capsys.readouterr()
    assert main(["bundle", "replay", str(tmp_path / "cap"), "--rollout", "0"]) == 2
    err = capsys.readouterr().err
    assert "2 matching bundles" in err and "rollout-000000" in err and "update-000000-000000" in err, err
    assert main(["bundle", "replay", str(tmp_path / "cap"), "--step", "0:0"]) == 0


def test_the_selected_rollouts_and_steps_decide_each_bundle_s_kind(workspace: Path, tmp_path: Path) -> None:
    cfg = load_config(str(workspace / "train.toml"), ["algorithm.group_size=4", "algorithm.prompts_per_step=2"])
    hook = BundleCapture(cfg, tmp_path / "cap", {(1, 0), (2, 0)}, {0, 1})
    for step in range(4):
        _feed(hook, step)
    written = hook.close()
    assert sorted(p.name for p in written) == ["rollout-000000", "step-000002-000000", "update-000001-000000"]
    for p in written:
        assert main(["bundle", "replay", str(p)]) == 0


def test_an_abandoned_run_still_builds_and_writes_what_it_captured(workspace: Path, tmp_path: Path) -> None:
    hook = _hook(workspace, tmp_path / "cap")
    _feed(hook, 0)
    hook.abandon()  # training failed after step 0's update: its bundle was not built yet
    hook2 = _hook(workspace, tmp_path / "cap2")
    _feed(hook2, 0, update=False)
    hook2.abandon()  # training failed inside step 0's update: its rollout is still written, alone
    assert [p.parent.name for p in (tmp_path / "cap").rglob("COMPLETE")] == ["update-000000-000000"]
    assert [p.parent.name for p in (tmp_path / "cap2").rglob("COMPLETE")] == ["rollout-000000"]


def test_no_capture_writer_works_during_the_update(workspace: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No capture work runs during the update: encoding the optimizer batch's payload (its writer
    thread) and building a bundle (on this CPU trainer the training thread, at the next rollout or
    when training ends) both come after it.

    A probe hook runs before the capture hooks, so its ``after_update`` marks the moment the update
    is over and the capture hooks have not yet handed anything over.
    """
    from replayjob.bundle import hook as hook_mod
    from replayjob.launch.source_run import train_source
    from replayjob.producers.builtin import capture as capture_mod
    from replayjob.rl.hooks import StepHook

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
    assert events[0] == "update returned" and sorted(events[1:]) == ["bundle", "payload"], events
    assert metrics["optimizer_batch/manifest_sha256"]
    assert [p.parent.name for p in (tmp_path / "bundles").rglob("COMPLETE")] == ["update-000000-000000"]


@pytest.mark.parametrize("in_line", [None, False])  # a CPU step (built in line) and a device step (writer thread)
def test_a_capture_error_surfaces_when_training_ends(workspace: Path, tmp_path: Path, in_line: bool | None) -> None:
    hook = _hook(workspace, tmp_path / "cap", build_on_training_thread=in_line)
    _feed(hook, 0, logprobs=torch.zeros(3))  # too few: no raise here
    with pytest.raises(RefusedError, match="exposed 3 logprobs"):
        hook.close()
    assert (tmp_path / "cap" / "rollout-000000" / "COMPLETE").is_file()  # the rollout bundle still landed
    assert [p.name for p in (tmp_path / "cap").iterdir()] == ["rollout-000000"]


def test_write_errors_surface_when_training_ends(workspace: Path, tmp_path: Path) -> None:
    (tmp_path / "cap" / "update-000000-000000").mkdir(parents=True)  # a bundle of that name already exists
    hook = _hook(workspace, tmp_path / "cap")
    _feed(hook, 0)
    _feed(hook, 1)
    with pytest.raises(ArtifactExistsError, match="bundle directory already exists"):
        hook.close()
    assert (tmp_path / "cap" / "update-000001-000000" / "COMPLETE").is_file()  # the next bundle still landed


def test_inspect_and_validate_import_no_model_code(captured: Path) -> None:
    """``bundle inspect`` imports no torch at all; ``bundle validate`` reads tensors but no model code."""
    code = ("import sys; from replayjob.cli import main; "
            f"rc = main(['bundle', 'inspect', {str(captured / 'cap')!r}]); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'peft')]; "
            f"rc += main(['bundle', 'validate', {str(captured / 'cap' / 'rollout-000000')!r}]); "
            "bad += [m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft')]; "
            "print('BAD', bad); sys.exit(rc or bool(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BAD []" in proc.stdout
