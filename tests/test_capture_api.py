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
from replayjob.producers.api import capture as cap
from replayjob.runtime import knobs

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
    # the base model's path follows the built-in manifest's rule (replayjob.redact.redact_path)
    _, out = example_run
    (path,) = (out / "capture").glob("*.manifest.json")
    assert json.loads(path.read_text())["base_model"]["path"] == "~/out/base"
    # the replay config names the directory itself: a replay loads it from there
    assert f'path = "{(out / "base").resolve()}"' in (out / "capture" / "replay.toml").read_text()


def test_example_capture_explain_replay_bitwise(example_run: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = example_run
    toml = out / "capture" / "replay.toml"
    assert main(["explain", str(toml)]) == 0
    assert main(["replay", str(toml), "--out", str(tmp_path / "r2"), "--nproc", "2"]) == 2  # one process, by name
    assert not (tmp_path / "r2").exists()
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


def test_a_plain_loop_capture_runs_through_the_cluster_steps(example_run: tuple[Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The steps every launcher runs (the Jobs, the Argo workflow and the Slurm scripts call these commands) for a
    spec whose [capture] names a plain-loop capture: plan, capture (verified, no training), replay (the capture's
    own replay.toml), reduce (judged against the capture); an arm key that is no knob of the "torch" producer is
    refused at plan, naming the producer."""
    from tests.conftest import capture_spec

    capture = example_run[1] / "capture"
    spec, run = tmp_path / "spec.toml", tmp_path / "run"
    spec.write_text(capture_spec(capture, name="plain", arms="[arms.baseline]\n"))
    for argv in (["step", "plan", "--spec", str(spec)],
                 ["step", "capture", "--spec", str(spec), "--run-dir", str(run)],
                 ["step", "replay", "--spec", str(spec), "--run-dir", str(run), "--index", "0"],
                 ["step", "reduce", "--spec", str(spec), "--run-dir", str(run)]):
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "verified the torch capture" in out and "no training" in out
    assert json.loads((run / "capture.json").read_text())["producer"] == "torch"
    rep = json.loads((run / "replays" / "baseline" / "0" / "replay_metrics.json").read_text())
    src = json.loads((capture / "metrics.json").read_text())
    assert (rep["framework"], rep["loss"]) == ("torch", src["loss"])
    assert rep["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    verdict = json.loads((run / "verdict.json").read_text())
    assert (verdict["status"], verdict["exit_code"]) == ("pass", 0), verdict
    spec.write_text(capture_spec(capture, name="plain"))  # the default arms toggle a TRL knob
    assert main(["step", "plan", "--spec", str(spec)]) == 2
    assert "is not a systems-only knob of torch" in capsys.readouterr().err


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


def test_several_chosen_steps_of_a_plain_loop_replay_bitwise(example_run: tuple[Path, Path],
                                                             tmp_path: Path) -> None:
    from replayjob.artifacts.metrics import read_steps

    script, _ = example_run
    mod = _load(script)
    res = mod.main(tmp_path / "src", capture_step=None, capture_steps=[2, 0])
    assert res["losses"] == mod.main(tmp_path / "off", capture_step=None)["losses"]  # capture changes nothing
    d = tmp_path / "src" / "capture"
    pins = read_steps(d)  # one schema for chosen steps: the built-in trainer's and the capture API's
    assert [p.step for p in pins] == [0, 2] and json.loads((d / "metrics.json").read_text())["framework"] == "torch"
    assert not (d / "replay.toml").exists() and not (d / "final_adapter").exists()
    for p in pins:
        assert p.replay_config.name == f"replay_step_{p.step:06d}.toml"
        assert main(["replay", str(p.replay_config), "--out", str(tmp_path / "r" / str(p.step))]) == 0
        rep = json.loads((tmp_path / "r" / str(p.step) / "replay_metrics.json").read_text())
        assert rep["optimizer_batch/final_adapter_sha256"] == p.final_adapter != p.initial_adapter
        assert rep["loss"] == p.loss and rep["grad_norm"] == p.grad_norm and rep["step"] == p.step
    verdict = tmp_path / "bitwise.json"  # reduce against step 2's record (reduce --source-step)
    assert main(["reduce", str(tmp_path / "r" / "2"), "--claim", "bitwise", "--source", str(d),
                 "--source-step", "2", "--min-repeats", "1", "--out", str(verdict)]) == 0
    assert main(["reduce", str(tmp_path / "r" / "2"), "--claim", "bitwise", "--source", str(d),
                 "--source-step", "0", "--min-repeats", "1", "--out", str(verdict)]) == 2  # another step's pins


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


def test_a_plain_loops_hints_name_actions_that_work_for_it(example_run: tuple[Path, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The replay config's header suggests no ``--set torch.<key>`` override (every one is refused: the whole config is
    the contract) but what does work, and a declared difference's refusal offers only the stack versions of what
    the loop's process imported (torch here: not TRL's or PEFT's)."""
    _, out = example_run
    toml = out / "capture" / "replay.toml"
    header = [line for line in toml.read_text().splitlines() if line.startswith("#")]
    assert not any("--set torch." in line for line in header) and "no systems-only knobs" in "\n".join(header)
    assert "replayjob reduce" in "\n".join(header) and "stack.<package>" in "\n".join(header)
    capsys.readouterr()
    assert main(["explain", str(toml), "--set", 'optimizer_batch.allow_config_differences=["torch.lr"]']) == 2
    err = capsys.readouterr().err
    assert "(allowed: stack.torch)" in err and "stack.trl" not in err and "stack.peft" not in err, err
    manifest = json.loads(next((out / "capture").glob("*.manifest.json")).read_text())
    assert sorted(manifest["config"]["resolved"]["stack"]) == ["torch"]
    # what the header offers works: repeats of the same condition reduce bitwise (the example test shows one)


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
    steps = cap.ChosenSteps(tmp_path / "c", steps=[0, 1], framework="torch", base_model_dir=out / "base",
                            config={"torch": {}, "model": {"path": str(out / "base")}})
    assert steps.at(2, model=model, optimizer=opt, scheduler=sched) is None  # not a chosen step
    assert steps.close().not_captured == (0, 1) and steps.result is not None and steps.result.metrics_path is None
    assert not (tmp_path / "c").exists()  # no step finished: nothing written
    with pytest.raises(cap.CaptureError, match=r"step 0 was not captured \(training ended"):
        steps.result.step(0)


def test_nonfinite_inputs_are_flagged_and_replay_only_under_the_opt_in(
        example_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step whose inputs hold an Inf the loss never reads (a broken auxiliary field) is captured with
    rows.nonfinite_inputs; explain refuses it until optimizer_batch.allow_nonfinite_inputs opts in."""
    from replayjob.artifacts.metrics import read_steps

    script, _ = example_run
    mod = _load(script)
    clean = mod.micro_batches
    mod.micro_batches = lambda step: [{**mb, "aux": torch.full((4,), float("inf") if step == 1 else 0.0)}
                                      for mb in clean(step)]
    mod.main(tmp_path / "src", capture_step=None, capture_steps=[1])
    (pins,) = read_steps(tmp_path / "src" / "capture")
    assert pins.nonfinite_inputs is True
    capsys.readouterr()
    assert main(["explain", str(pins.replay_config)]) == 2
    assert "flagged rows.nonfinite_inputs" in capsys.readouterr().err
    assert main(["replay", str(pins.replay_config), "--out", str(tmp_path / "r"),
                 "--set", "optimizer_batch.allow_nonfinite_inputs=true"]) == 0
    rep = json.loads((tmp_path / "r" / "replay_metrics.json").read_text())
    assert rep["optimizer_batch/final_adapter_sha256"] == pins.final_adapter and rep["loss"] == pins.loss


def test_a_nonfinite_loss_is_null_in_a_step_record_and_refused_for_one_step(
        example_run: tuple[Path, Path], tmp_path: Path) -> None:
    """Strict JSON has no NaN: several steps record a non-finite loss as null; a one-step capture, whose
    metrics.json needs a finite loss, refuses before writing anything."""
    from replayjob.artifacts.metrics import read_steps

    script, _ = example_run
    mod = _load(script)
    clean = mod.micro_batches

    def poisoned(step: int) -> list[dict[str, Any]]:
        mbs = clean(step)
        if step == 1:
            mbs[0]["advantages"][0] = float("inf")
        return mbs

    mod.micro_batches = poisoned
    mod.main(tmp_path / "several", capture_step=None, capture_steps=[1])
    (pins,) = read_steps(tmp_path / "several" / "capture")
    assert pins.loss is None and pins.nonfinite_inputs is True
    with pytest.raises(cap.CaptureError, match="not finite"):
        mod.main(tmp_path / "one", capture_step=1)
    assert not list((tmp_path / "one" / "capture").glob("*"))


# A user's loop as the example, with three micro-batches, a cosine schedule, and inputs that put every
# float tensor after them at offsets of the payload that are not 64-byte aligned (odd-sized tensors whose
# names sort first).  Its loss logs where each tensor it receives lives (when the test asks it to).
UNALIGNED_LOOP = '''

CONFIG.update(accumulation=3)
_example_micro_batches, _example_loss = micro_batches, loss_fn


def micro_batches(step):
    out = _example_micro_batches(step)
    for i, mb in enumerate(out):
        mb["aaa_odd"] = torch.arange(7, dtype=torch.float32) + i   # 28 bytes
        mb["aab_flag"] = torch.ones(3, dtype=torch.uint8)          # 3 bytes
    return out


def loss_fn(model, inputs):
    import os
    log = os.environ.get("REPLAYJOB_TEST_TENSOR_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as fh:
            for k, t in inputs.items():
                if isinstance(t, torch.Tensor):
                    fh.write(json.dumps({"name": k, "ptr": t.data_ptr(),
                                         "storage": t.untyped_storage().data_ptr(),
                                         "nbytes": t.untyped_storage().nbytes()}) + "\\n")
    return _example_loss(model, inputs)


def build(base, device):
    model = TinyLM(base, CONFIG["rank"], CONFIG["dropout"]).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=CONFIG["lr"], foreach=False)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=CONFIG["steps"])
'''


@pytest.fixture(scope="module")
def unaligned_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("unaligned_loop")
    script = d / "unaligned_loop.py"
    text = EXAMPLE.read_text()
    main_at = text.index("\nif __name__ ==")
    script.write_text(text[:main_at] + UNALIGNED_LOOP + text[main_at:])
    proc = subprocess.run([sys.executable, str(script), str(d / "out")], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "out" / "capture"


def test_inputs_at_unaligned_payload_offsets_reach_the_loss_in_fresh_memory_and_replay_bitwise(
        unaligned_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from replayjob.producers.api import replay as integration_replay

    log = tmp_path / "tensors.jsonl"
    monkeypatch.setenv("REPLAYJOB_TEST_TENSOR_LOG", str(log))
    admitted: list[Any] = []
    real_admit = integration_replay.admit

    def keeping_admit(cfg: Any, **kwargs: Any) -> Any:
        adm = real_admit(cfg, **kwargs)
        admitted.append(adm)
        return adm

    monkeypatch.setattr(integration_replay, "admit", keeping_admit)
    toml = unaligned_run / "replay.toml"
    assert main(["replay", str(toml), "--out", str(tmp_path / "r")]) == 0
    src = json.loads((unaligned_run / "metrics.json").read_text())
    rep = json.loads((tmp_path / "r" / "replay_metrics.json").read_text())
    assert rep["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    assert rep["loss"] == src["loss"] and rep["padding"]["micro_batches"] == 3
    # the payload's float tensors do sit off 64 bytes (else this test would prove nothing) ...
    payload = [t for mb in admitted[0].micro_batches for t in mb.inputs.values()]
    assert any(t.data_ptr() % 64 for t in payload if t.is_floating_point())
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in payload]
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 3 * 5  # three micro-batches, five tensors each (two inputs are plain values)
    for s in seen:  # ... and what reached the loss is fresh, aligned memory of its own
        assert s["ptr"] % 64 == 0, s
        assert not any(lo < s["storage"] + s["nbytes"] and s["storage"] < hi for lo, hi in spans), s


def test_plain_loop_in_process_repeats_and_trace_refusal(unaligned_run: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    toml = unaligned_run / "replay.toml"
    assert main(["replay", str(toml), "--out", str(tmp_path / "w"), "--set", "optimizer_batch.warmup_updates=1",
                 "--set", "optimizer_batch.measured_updates=2"]) == 0
    rep = json.loads((tmp_path / "w" / "replay_metrics.json").read_text())
    ip = rep["in_process"]
    assert ip["warmup_updates"] == 1 and ip["measured_updates"] == 2 and ip["loss_equal"] is True
    assert len(ip["local_train_wall_s"]) == 2 and all(w > 0 for w in ip["local_train_wall_s"])
    src = json.loads((unaligned_run / "metrics.json").read_text())
    assert rep["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    # this loop's inputs name no input_ids: a traced replay is refused, saying why
    assert main(["replay", str(toml), "--out", str(tmp_path / "t"), "--trace"]) == 2
    assert "no input_ids" in capsys.readouterr().err


def _relabelled(example_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], step: int, *,
                files: bool, manifest: bool) -> tuple[int, str]:
    """A copy of the plain-loop capture of step 1 relabelled to ``step`` (with ``files``: its files renamed to
    match; ``manifest``: the manifest file too), re-pinned, then explained: (exit code, stdout + stderr)."""
    from replayjob.artifacts.api_manifest import FILES, file_names
    from replayjob.digest import sha256_bytes
    from replayjob.jsonio import canonical_bytes
    script, _ = example_run
    d = tmp_path / "copy"
    shutil.copytree(script.parent, d)
    cap = d / "out" / "capture"
    path = cap / file_names(1)["manifest"]
    doc = json.loads(path.read_text())
    doc["step"] = step
    if files:
        for role in FILES:
            doc["files"][role]["file"] = file_names(step)[role]
            (cap / file_names(1)[role]).rename(cap / file_names(step)[role])
    if manifest:
        path.unlink()
        path = cap / file_names(step)["manifest"]
    raw = canonical_bytes(doc) + b"\n"
    path.write_bytes(raw)
    sets = ["--set", f'integration.entry="{d / script.name}:replay_target"',
            "--set", f'optimizer_batch.replay_path="{path}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"']
    capsys.readouterr()
    code = main(["explain", str(cap / "replay.toml"), *sets])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("relabel", ["step only", "step and files"])
def test_a_plain_loop_capture_relabelled_to_another_step_is_refused(relabel: str, example_run: tuple[Path, Path],
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The step names every file of a capture, its manifest's too: a manifest rewritten to say step 3 (and
    re-pinned) contradicts the names it was written under."""
    code, text = _relabelled(example_run, tmp_path, capsys, 3, files=relabel != "step only", manifest=False)
    assert code == 2 and ("'step' is 3" in text or "step 3's" in text), text


def test_a_plain_loop_capture_relabelled_to_an_earlier_step_is_refused_by_its_scheduler_state(
        example_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every name consistent with step 0 and re-pinned: the recorded LR scheduler has already stepped once, more
    often than the steps before step 0.  (Fewer is admitted: a loss scaler skips steps, and a relabel to a later
    step with every file renamed and re-pinned is a new capture the pins must reject: SECURITY.md.)"""
    code, text = _relabelled(example_run, tmp_path, capsys, 0, files=True, manifest=True)
    assert code == 2 and "the captured LR scheduler has already stepped 1 time(s)" in text, text


def _bigger(doc: dict[str, Any], *path: Any) -> None:
    """Set the value at ``path`` to 2**64: an integer of 20 digits, which the strict JSON reader still parses."""
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = 2**64


@pytest.mark.parametrize(("edit", "named"), [
    (lambda d: d.update(step=False), "field `step`: expected `int`, got `bool`"),
    (lambda d: d["files"]["payload"].update(size=0.0), "field `files.payload.size`: expected `int`, got `float`"),
    (lambda d: d["micro_batches"][0].update(accumulation_steps=1.0), "micro_batches[0].accumulation_steps"),
    (lambda d: d.update(trust_me=True), "unknown field `trust_me`"),
    (lambda d: d["micro_batches"][0].update(trust_me=True), "field `micro_batches[0]`: object contains unknown field "
                                                            "`trust_me`"),
    (lambda d: _bigger(d, "step"), "field `step`: expected `int` <= 9223372036854775807"),
    (lambda d: _bigger(d, "framework_state", "huge"), "`framework_state.huge` is 18446744073709551616, an integer "
                                                      "beyond 64 bits"),
    (lambda d: _bigger(d, "optimizer", "param_groups", 0, "lr"), "`param_groups[0].lr` is 18446744073709551616, an "
                                                                 "integer beyond 64 bits"),
    (lambda d: d["rows"].update(tensors=d["rows"]["tensors"] + 1), "rows.tensors is"),
    (lambda d: d["rows"].update(micro_batches=d["rows"]["micro_batches"] + 1), "rows.micro_batches is"),
    (lambda d: d["base_model"].update(sha256="0" * 64), "field `base_model`: `sha256` is '" + "0" * 64),
    (lambda d: d.pop("outcome"), "written by an earlier release"),
    # the device a plain loop's replay rebuilds the step on: admitted, the replay failed with exit 3
    (lambda d: d["producer"].update(device="bogus"), "`producer.device` is 'bogus', not a torch device"),
    (lambda d: d["producer"].update(device=5), "`producer.device` is 5, not a torch device"),
    (lambda d: d["producer"].pop("device"), "`producer.device` is None, not a torch device"),
])
def test_a_malformed_manifest_is_refused_naming_the_field(edit: Callable[[dict[str, Any]], None], named: str,
                                                          example_run: tuple[Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The capture API's manifest edited and re-pinned (so only its declaration stands in the way): refused with
    exit 2 and one message naming the file and the field, never a traceback."""
    from replayjob.artifacts.api_manifest import file_names
    from replayjob.digest import sha256_bytes
    script, _ = example_run
    d = tmp_path / "copy"
    shutil.copytree(script.parent, d)
    path = d / "out" / "capture" / file_names(1)["manifest"]
    doc = json.loads(path.read_text())
    edit(doc)
    raw = (json.dumps(doc, sort_keys=True) + "\n").encode()
    path.write_bytes(raw)
    capsys.readouterr()
    code = main(["explain", str(path.parent / "replay.toml"),
                 "--set", f'integration.entry="{d / script.name}:replay_target"',
                 "--set", f'optimizer_batch.replay_path="{path}"',
                 "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"'])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2 and named in text and path.name in text and "Traceback" not in text, text


def _scaled_step(t: dict[str, torch.Tensor]) -> None:
    for k in [k for k in t if k.endswith(".step")]:
        t[k] = torch.full_like(t[k], 100.0)


def _first_nan(suffix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        k = sorted(k for k in t if k.endswith(suffix))[0]
        t[k] = t[k].clone()
        t[k].view(-1)[0] = float("nan")
    return edit


def _negative_sq(t: dict[str, torch.Tensor]) -> None:
    for k in [k for k in t if k.endswith(".exp_avg_sq")]:
        t[k] = -t[k].abs() - 1.0


@pytest.mark.parametrize(("role", "edit", "named"), [
    ("optimizer", _scaled_step, "tensor state.0.step counts 100.0 optimizer step(s), but it is the state before "
                                "step 1: no parameter has been stepped more than 1 time(s)"),
    ("optimizer", _first_nan(".exp_avg"), "tensor state.0.exp_avg holds 1 NaN or infinite value(s)"),
    ("optimizer", _negative_sq, "tensor state.0.exp_avg_sq holds 64 negative value(s)"),
    ("adapter", _first_nan(""), "holds 1 NaN or infinite value(s); an update starts from finite parameters"),
    ("manifest", lambda d: d["optimizer"]["param_groups"][0].update(lr=0.5),
     "optimizer.param_groups[0].lr is 0.5, but the LR scheduler set it to"),
    ("manifest", lambda d: d["optimizer"]["param_groups"][0].update(params=[0]),
     "optimizer.param_groups hold the parameter indices [0]: each index 0..n-1 must be in exactly one group, "
     "for n at least the 2 trainable parameter(s)"),
    ("manifest", lambda d: d["optimizer"]["tensors"].update({"0": ["exp_avg", "exp_avg_sq"]}),
     "the optimizer file's tensors differ from optimizer.tensors at ['state.0.step']"),
    ("manifest", lambda d: d["optimizer"]["state"].update({"7": {"x": 1}}),
     "optimizer.state has an entry for parameter '7'"),
    ("manifest", lambda d: d["optimizer"]["scheduler"].update(_step_count=99),
     "optimizer.scheduler._step_count is 99"),
    # param groups and scheduler state of values no torch optimizer or scheduler holds: the replay failed in its
    # optimizer or scheduler step with exit 3 (a string beta or lr, no lr, amsgrad without its buffer, a string
    # last_epoch, an lr_lambda of a number), or replayed them (a negative eps, a string foreach, moments cast)
    ("manifest", lambda d: d["optimizer"]["param_groups"][0].update(betas="x"),
     "optimizer.param_groups[0].betas is x, not two numbers in [0, 1)"),
    ("manifest", lambda d: d["optimizer"]["param_groups"][0].update(eps=-1.0),
     "optimizer.param_groups[0].eps is -1.0, not a finite number >= 0"),
    ("manifest", lambda d: (d["optimizer"]["param_groups"][0].update(lr="x"),
                            d["optimizer"]["scheduler"].update(_last_lr=["x"])),
     "optimizer.param_groups[0].lr is x, not a finite number >= 0"),
    ("manifest", lambda d: (d["optimizer"]["param_groups"][0].pop("lr"), d["optimizer"]["scheduler"].pop("_last_lr")),
     "optimizer.param_groups[0] has no lr"),
    ("manifest", lambda d: d["optimizer"]["param_groups"][0].update(amsgrad=True),
     "optimizer.param_groups[0].amsgrad is true, but parameter 0's state holds no max_exp_avg_sq"),
    ("manifest", lambda d: d["optimizer"]["param_groups"][0].update(foreach="x"),
     "optimizer.param_groups[0].foreach is x, not true, false or null"),
    ("manifest", lambda d: d["optimizer"]["scheduler"].update(last_epoch="x"),
     "optimizer.scheduler.last_epoch is x, not an integer >= -1"),
    ("manifest", lambda d: d["optimizer"]["scheduler"].update(lr_lambdas=[1]),
     "optimizer.scheduler.lr_lambdas must hold one null or object per param group (1), found [1]"),
    ("manifest", lambda d: d["optimizer"]["scheduler"].update(base_lrs=[0.5]),
     "optimizer.param_groups[0].initial_lr is 0.01, but the LR scheduler started it from 0.5"),
    ("manifest", lambda d: d["optimizer"]["scheduler"].update(optimizer={}),
     "optimizer.scheduler.optimizer names the scheduler's optimizer"),
    ("optimizer", lambda t: t.update({k: v.double() for k, v in t.items() if "exp_avg" in k}),
     "tensor state.0.exp_avg is torch.float64, its parameter torch.float32"),
    ("optimizer", lambda t: t.update({"state.0.exp_avg": t["state.0.exp_avg"].bool()}),
     "tensor state.0.exp_avg is torch.bool, not a floating-point moment"),
])
def test_a_start_state_that_contradicts_the_step_is_refused_by_explain_and_replay(
        role: str, edit: Callable[[Any], None], named: str, example_run: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Step 1's optimizer or adapter file (or the manifest's optimizer section) edited and everything re-pinned:
    moments no step produced, step counts of another step, a learning rate the scheduler did not set, param
    groups or tensors the replay could not load (it failed with exit 3, or explain admitted what it refused).
    Refused by explain and replay alike (exit 2), naming the file and the tensor or field, before any model."""
    from replayjob import tensorfile
    from replayjob.artifacts.api_manifest import file_names
    from replayjob.digest import sha256_bytes
    from replayjob.rl.state import safetensors_bytes
    script, _ = example_run
    d = tmp_path / "copy"
    shutil.copytree(script.parent, d)
    names = file_names(1)
    path = d / "out" / "capture" / names["manifest"]
    doc = json.loads(path.read_text())
    if role == "manifest":
        edit(doc)
        where = path
    else:
        where = path.parent / names[role]
        tensors = tensorfile.load(where)
        edit(tensors)
        where.write_bytes(safetensors_bytes(tensors, "replayjob-optimizer" if role == "optimizer" else "pt"))
        doc["files"][role].update(sha256=sha256_bytes(where.read_bytes()), size=where.stat().st_size)
    raw = (json.dumps(doc, sort_keys=True) + "\n").encode()
    path.write_bytes(raw)
    sets = ["--set", f'integration.entry="{d / script.name}:replay_target"',
            "--set", f'optimizer_batch.replay_path="{path}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"']
    capsys.readouterr()
    for argv in (["explain", str(path.parent / "replay.toml"), *sets],
                 ["replay", str(path.parent / "replay.toml"), *sets, "--out", str(tmp_path / "r")]):
        code = main(argv)
        out = capsys.readouterr()
        text = out.out + out.err
        assert code == 2 and named in text and str(where) in text and "Traceback" not in text, (argv[0], text)
    assert not (tmp_path / "r").exists()


def test_param_groups_the_rebuilt_optimizer_does_not_have_are_refused_by_the_replay(
        example_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two param groups (each holding one parameter, the scheduler state dropped) and everything re-pinned: only the
    rebuilt optimizer tells it has one group; its load_state_dict refused them with a ValueError, which the replay
    reported as its own failure (exit 3).  Refused (exit 2) naming the manifest, nothing written."""
    from replayjob.artifacts.api_manifest import file_names
    from replayjob.digest import sha256_bytes
    script, _ = example_run
    d = tmp_path / "copy"
    shutil.copytree(script.parent, d)
    path = d / "out" / "capture" / file_names(1)["manifest"]
    doc = json.loads(path.read_text())
    (group,) = doc["optimizer"]["param_groups"]
    doc["optimizer"].update(scheduler=None, param_groups=[{**group, "params": [0]}, {**group, "params": [1]}])
    raw = (json.dumps(doc, sort_keys=True) + "\n").encode()
    path.write_bytes(raw)
    capsys.readouterr()
    code = main(["replay", str(path.parent / "replay.toml"), "--out", str(tmp_path / "r"),
                 "--set", f'integration.entry="{d / script.name}:replay_target"',
                 "--set", f'optimizer_batch.replay_path="{path}"',
                 "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"'])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2 and "does not fit the rebuilt trainer's optimizer" in text and path.name in text, text
    assert "Traceback" not in text and not (tmp_path / "r" / "replay_metrics.json").exists()


@pytest.mark.parametrize(("model", "named"), [
    ("path = 5", "model.path: expected a string (the base model directory), found int"),
    ('path = ""', "model.path: model.path is required"),
])
def test_a_replay_configs_model_path_is_read_as_declared(model: str, named: str, example_run: tuple[Path, Path],
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model.path of another type was refused as a missing one ("model.path is required")."""
    _, out = example_run
    text = (out / "capture" / "replay.toml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("path = "))
    cfg = tmp_path / "replay.toml"
    cfg.write_text(text.replace(line, model))
    capsys.readouterr()
    assert main(["explain", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
