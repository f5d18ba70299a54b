"""verl as a producer: a real verl engine update on CPU, captured from a trainer-shaped driver and replayed.

Everything here runs verl 0.9.1's own FSDP2 engine (``TrainingWorker``, ``FSDPEngineWithLMHead``,
``ppo_loss``) on a tiny random-init Qwen2 built from a config (nothing downloaded), on the CPU through
:mod:`replayjob.producers.verl.platform` (verl's ``set_platform`` hook, gloo, world size 1).  The driver
(``TinyTrainer`` in benchmarks/verl_tiny.py, shared with the capture-overhead benchmark) is shaped like
``RayPPOTrainer._update_actor(batch)``: it turns a padded ``DataProto`` into verl's no-padding ``TensorDict``
with verl's own functions and calls the actor worker's ``train_mini_batch`` (what
``ActorRolloutRefWorker.update_actor`` calls), in-process instead of through Ray.
Skipped, with the reason, where verl is not importable (the main suite; ``scripts/test-verl.sh`` runs it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (scripts/test-verl.sh builds .venv-verl with it)", allow_module_level=True)

import torch

from benchmarks.verl_tiny import TinyTrainer, build_worker, rollout_batch, tiny_model
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_file
from replayjob.jsonio import canonical_bytes
from replayjob.producers.verl import producer as rv

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")
REPO = Path(__file__).resolve().parents[1]


def run(out: Path, base: Path, *, steps: list[int] | None = None, updates: int = 2, **worker_kw: Any) -> Any:
    worker = build_worker(base, **worker_kw)
    trainer = TinyTrainer(worker, mini=worker_kw.get("mini", 4), epochs=worker_kw.get("epochs", 1))
    capture = rv.capture_actor_steps(worker, out, steps=steps) if steps is not None else None
    metrics = [trainer._update_actor(rollout_batch(100 + u)) for u in range(updates)]
    return capture, metrics


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("verl") / "base")


def test_a_real_verl_update_runs_on_cpu(base: Path, tmp_path: Path) -> None:
    worker = build_worker(base)
    metrics = TinyTrainer(worker)._update_actor(rollout_batch(1))
    assert len(metrics["grad_norm"]) == 2  # 8 rows, mini-batches of 4: two optimizer steps
    assert all(g > 0 for g in metrics["grad_norm"])
    assert str(next(worker.engine.module.parameters()).device) == "cpu"


@pytest.fixture(scope="module")
def vanilla(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two updates of 8 rows in mini-batches of 4 (optimizer steps 0-3), steps 1 and 2 captured: the last
    mini-batch of the first update (the LR scheduler steps after it) and the first of the second; float32 (the
    other scenarios run verl's default bfloat16 mixed precision)."""
    out = tmp_path_factory.mktemp("vanilla") / "cap"
    capture, _ = run(out, base, steps=[1, 2], fp32=True)
    assert capture.close().captured.keys() == {1, 2}
    return out


def _step(capture_dir: Path, k: int) -> dict[str, Any]:
    doc = json.loads((capture_dir / "metrics.json").read_text())
    (entry,) = [s for s in doc["optimizer_batch/steps"] if s["step"] == k]
    return dict(entry)


def test_capture_records_the_engine_step_in_replayjob_formats(vanilla: Path) -> None:
    manifest = json.loads((vanilla / "optimizer_batch_step_000002.manifest.json").read_text())
    assert manifest["framework"] == "verl"
    state = manifest["framework_state"]
    assert state["position"] == {"update": 1, "epoch": 0, "mini_batch": 0, "mini_batches_per_epoch": 2, "epochs": 1}
    (mb,) = manifest["micro_batches"]
    assert set(mb["inputs"]["tensors"]) >= {"input_ids", "input_ids__offsets", "old_log_probs", "advantages"}
    batch = mb["inputs"]["values"]["batch"]
    assert batch["nested"] == ["input_ids", "position_ids"] and batch["batch_size"] == [4]
    assert batch["non_tensor"]["update_lr_scheduler"] is False
    assert "use_remove_padding" not in batch["non_tensor"]  # an engine setting: recorded in verl.engine
    verl = manifest["config"]["resolved"]["verl"]
    assert verl["engine"]["use_remove_padding"] is True and verl["engine"]["micro_batch_size_per_gpu"] == 2
    assert verl["actor"]["loss_agg_mode"] == "token-mean" and verl["loss"] == "ppo_loss"
    assert mb["rng"] == ["cpu"]
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in vanilla.rglob("*"))


@pytest.mark.parametrize("k", [1, 2])
def test_a_captured_step_replays_bitwise(vanilla: Path, tmp_path: Path, k: int) -> None:
    toml = vanilla / f"replay_step_{k:06d}.toml"
    assert main(["explain", str(toml)]) == 0
    assert main(["replay", str(toml), "--out", str(tmp_path / "r")]) == 0
    metrics = json.loads((tmp_path / "r" / "replay_metrics.json").read_text())
    src = _step(vanilla, k)
    assert src["final_adapter_sha256"] != src["initial_adapter_sha256"]  # the step changed the parameters
    assert metrics["optimizer_batch/final_adapter_sha256"] == src["final_adapter_sha256"]
    assert metrics["loss"] == src["loss"] and metrics["grad_norm"] == src["grad_norm"]


# another policy loss and aggregation mode, with the entropy bonus and the KL loss, on a LoRA adapter; and a third
# loss and mode with full fine-tuning.  One step each (step=K: replay.toml, metrics.json, final_adapter/).
SCENARIOS = {
    "lora-gspo-seq-mean-token-mean": {"loss_mode": "gspo", "agg": "seq-mean-token-mean", "lora": 4, "entropy": 0.01,
                                      "kl": True},
    "full-cispo-seq-mean-token-sum-norm": {"loss_mode": "cispo", "agg": "seq-mean-token-sum-norm"},
}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest, base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "cap"
    worker = build_worker(base, **SCENARIOS[request.param])
    capture = rv.capture_actor_steps(worker, out, step=2)
    trainer = TinyTrainer(worker)
    for u in range(2):
        trainer._update_actor(rollout_batch(200 + u))
    assert capture.result.replay_toml == out / "replay.toml"
    return request.param, out


def test_losses_aggregations_and_lora_replay_bitwise(scenario: tuple[str, Path], tmp_path: Path) -> None:
    name, out = scenario
    src = json.loads((out / "metrics.json").read_text())
    manifest = json.loads(next(out.glob("*.manifest.json")).read_text())
    trainable = manifest["trainable"]
    if SCENARIOS[name].get("lora"):
        assert trainable and all("lora_" in n for n in trainable)  # the adapter only
    else:
        assert any(n.endswith("embed_tokens.weight") for n in trainable)  # every parameter
    assert src["optimizer_batch/final_adapter_sha256"] != src["optimizer_batch/initial_adapter_sha256"]
    assert main(["replay", str(out / "replay.toml"), "--out", str(tmp_path / "r")]) == 0
    rep = json.loads((tmp_path / "r" / "replay_metrics.json").read_text())
    assert rep["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    assert (tmp_path / "r" / "final_adapter" / "adapter_model.safetensors").read_bytes() == \
        (out / "final_adapter" / "adapter_model.safetensors").read_bytes()
    assert rep["loss"] == src["loss"]


def verl_spec(capture: Path, step: int, **top: Any) -> str:
    """examples/ablation-verl.toml naming step ``step`` of ``capture`` (its replay config and pins from the capture's
    metrics.json), on the CPU with a local image, and ``top`` (``arms``, ``config``, ``claim``, ...) replacing the
    example's entries."""
    import tomllib

    from replayjob.config.dump import dumps

    doc = tomllib.loads((REPO / "examples" / "ablation-verl.toml").read_text(encoding="utf-8"))
    rec = _step(capture, step)
    doc["capture"].update(dir=str(capture), replay_config=rec["replay_config"],
                          logical_sha256=rec["logical_batch_sha256"], manifest_sha256=rec["manifest_sha256"])
    doc.update(device="cpu", gpu_product="none", storage_class="local-rwx", image="replayjob:dev", repeats=1, **top)
    return dumps(doc)


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m replayjob ARGV`` in a fresh process, as a cluster job runs it."""
    return subprocess.run([sys.executable, "-m", "replayjob", *argv], capture_output=True, text=True, timeout=300,
                          check=False, cwd=REPO)


def test_a_verl_capture_runs_through_the_cluster_steps_in_fresh_processes(vanilla: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The steps every launcher runs (the Jobs, the Argo workflow and the Slurm scripts call these commands), in
    their own processes (the second replay in this one), for examples/ablation-verl.toml naming a verl capture's
    chosen step: plan, capture (verified, no model built), one replay per arm (the capture's own
    replay_step_000002.toml, with in-process warm repeats), and reduce's bitwise claim (gradient checkpointing keeps
    the bits) against that step's record; then refusals: an arm setting a contract field of verl's loss or another
    producer's knob at plan, and a pin that is not the capture's at capture (exit 2)."""
    assert main(["explain", str(vanilla / "replay_step_000002.toml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["admitted"] and report["framework"] == "verl" and report["manifest"]["step"] == 2
    spec, run = tmp_path / "spec.toml", tmp_path / "run"
    spec.write_text(verl_spec(vanilla, 2, claim="bitwise", arms={
        "baseline": {}, "ckpt": {"verl.model.enable_gradient_checkpointing": True}},
        config={"optimizer_batch.warmup_updates": 1, "optimizer_batch.measured_updates": 2}))
    for argv in (["step", "plan", "--spec", str(spec)],
                 ["step", "capture", "--spec", str(spec), "--run-dir", str(run)],
                 ["step", "replay", "--spec", str(spec), "--run-dir", str(run), "--index", "0"],
                 ["step", "replay", "--spec", str(spec), "--run-dir", str(run), "--index", "1"],
                 ["step", "reduce", "--spec", str(spec), "--run-dir", str(run)]):
        if argv[-1] == "1":  # the second replay in this process (as the funnel's tests run steps): verl's import
            assert main(argv) == 0  # is the cost of a fresh process, paid once by the first
            continue
        proc = cli(*argv)
        assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-3000:])
        if argv[1] == "capture":
            assert "verified the verl capture" in proc.stdout and "no training" in proc.stdout
    assert json.loads((run / "capture.json").read_text())["producer"] == "verl"
    src = _step(vanilla, 2)
    for arm in ("baseline", "ckpt"):
        rep = json.loads((run / "replays" / arm / "0" / "replay_metrics.json").read_text())
        assert rep["framework"] == "verl" and rep["step"] == 2 and rep["loss"] == src["loss"]
        assert rep["optimizer_batch/final_adapter_sha256"] == src["final_adapter_sha256"]
        assert rep["runtime"]["verl.model.enable_gradient_checkpointing"] is (arm == "ckpt")
        assert rep["in_process"]["measured_updates"] == 2 and rep["in_process"]["loss_equal"] is True
    verdict = json.loads((run / "verdict.json").read_text())
    assert (verdict["status"], verdict["exit_code"], verdict["claim"]) == ("pass", 0, "bitwise"), verdict["checks"]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["inputs.capture_pins"]["expected"]["framework"] == "verl"
    assert checks["exact.knobs_in_effect"]["status"] == "pass"
    exact = tmp_path / "exact-input.json"  # the weaker claim over the same replays
    assert main(["reduce", str(run / "replays"), "--claim", "exact-input", "--source", str(vanilla), "--source-step",
                 "2", "--min-repeats", "1", "--out", str(exact)]) == 0, exact.read_text()[-2000:]
    hostile = tmp_path / "hostile.toml"  # a contract field of the loss is no knob: refused before anything runs
    hostile.write_text(verl_spec(vanilla, 2, arms={"baseline": {}, "clip": {"verl.actor.clip_ratio_high": 0.3}}))
    proc = cli("step", "plan", "--spec", str(hostile))
    assert proc.returncode == 2 and "'verl.actor.clip_ratio_high' is not a systems-only knob" in proc.stderr
    hostile.write_text(verl_spec(vanilla, 2, arms={"baseline": {}, "ckpt": {"trl.gradient_checkpointing": True}}))
    proc = cli("step", "plan", "--spec", str(hostile))  # another producer's knob: refused, naming verl's
    assert proc.returncode == 2 and "'trl.gradient_checkpointing' is not a systems-only knob of verl" in proc.stderr
    assert "verl.engine.micro_batch_size_per_gpu" in proc.stderr
    # the Jobs and the Argo workflow are rendered from the same spec, checked against the capture's producer alike
    rendered = ["--out", str(tmp_path / "k8s"), "--argo", str(tmp_path / "argo.yaml")]
    assert main(["k8s", "render", str(spec), *rendered]) == 0
    assert "replay_step_000002.toml" in (tmp_path / "k8s" / "spec.yaml").read_text()
    assert main(["k8s", "render", str(hostile), "--out", str(tmp_path / "k8s-hostile")]) == 2
    other = _step(vanilla, 1)["manifest_sha256"]  # step 1's pin for step 2's replay config
    hostile.write_text(verl_spec(vanilla, 2).replace(src["manifest_sha256"], other))
    assert main(["step", "capture", "--spec", str(hostile), "--run-dir", str(tmp_path / "run2")]) == 2
    assert not (tmp_path / "run2" / "capture.json").exists()


@pytest.fixture
def in_process_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The funnel's step commands run by ``main`` in this process (their fresh processes are the test above's)."""
    import contextlib

    from replayjob.launch import funnel as funnel_module

    def cli_step(args: Any, log: Path) -> int:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
            code = main([str(a) for a in args])
        return code if code in funnel_module.STATUS else 3

    monkeypatch.setattr(funnel_module, "cli_step", cli_step)


@pytest.mark.alone  # the funnel times warm updates
@pytest.mark.usefixtures("in_process_steps")
def test_the_funnel_with_budgets_runs_a_verl_capture(vanilla: Path, tmp_path: Path) -> None:
    """``funnel --capture DIR --replay-config NAME`` with examples/ablation-verl.toml's three arms and
    examples/budgets-verl.toml: stage 3 only, on the verl capture; the exact-input gate passes with every knob in
    effect, the checkpointing arm and the baseline end on the source step's parameters bit for bit and the
    micro-batch arm does not (another summation order), and every budget bound gets a decision.  The timing verdict
    is the host's: decided, inconclusive after one block, or contended (a shared host)."""
    spec = tmp_path / "spec.toml"
    spec.write_text(verl_spec(vanilla, 2))
    out = tmp_path / "funnel"
    code = main(["funnel", "--out", str(out), "--spec", str(spec), "--capture", str(vanilla), "--replay-config",
                 "replay_step_000002.toml", "--budgets", str(REPO / "examples" / "budgets-verl.toml"), "--no-report",
                 "--fixed-blocks", "--repeats", "1", "--warmup-updates", "1", "--measured-updates", "1"])
    doc = json.loads((out / "funnel.json").read_text())
    assert [s["status"] for s in doc["stages"][:2]] == ["skipped", "skipped"]
    verdict = json.loads((out / "verdict.json").read_text())
    exact = {c["name"]: c["status"] for c in verdict["checks"] if c["group"] == "exact-input"}
    assert exact and set(exact.values()) == {"pass"}, exact
    arms = doc["summary"]["arms"]
    assert arms["baseline"]["adapter_equal_source"] and arms["ckpt"]["adapter_equal_source"]
    assert arms["baseline"]["loss_equal_source"] and not arms["mbs1"]["adapter_equal_source"]
    bounds = {(b["arm"], b["metric"]): b["decision"] for b in doc["summary"]["budgets"]}
    assert set(bounds) == {("ckpt", "local_train_wall_s"), ("ckpt", "peak_memory_bytes"),
                           ("mbs1", "local_train_wall_s")}, bounds
    assert bounds[("ckpt", "peak_memory_bytes")] == "not_measurable"  # CPU: decided on CUDA only
    assert (code, doc["stages"][2]["status"]) in {(0, "pass"), (1, "fail"), (2, "inconclusive"),
                                                  (3, "contended")}, doc["stages"][2]


def test_admission_refuses_a_changed_update_and_a_tampered_payload(vanilla: Path, tmp_path: Path) -> None:
    toml = vanilla / "replay_step_000001.toml"
    # a contract field of the loss: refused, not replayed
    assert main(["explain", str(toml), "--set", "verl.actor.clip_ratio_high=0.3"]) == 2
    assert main(["replay", str(toml), "--out", str(tmp_path / "r"), "--set", "verl.actor.loss_agg_mode=token-sum",
                 "--set", 'optimizer_batch.allow_config_differences=["verl.actor.loss_agg_mode"]']) == 2
    assert not (tmp_path / "r").exists()
    # a key the capture did not record (an irrelevant field) cannot be set
    assert main(["explain", str(toml), "--set", "verl.actor.ppo_epochs=2"]) == 2
    copy = tmp_path / "cap"
    shutil.copytree(vanilla, copy)
    payload = copy / "optimizer_batch_step_000001.safetensors"
    data = bytearray(payload.read_bytes())
    data[-1] ^= 1
    payload.write_bytes(bytes(data))
    text = (copy / "replay_step_000001.toml").read_text().replace(str(vanilla), str(copy))
    (copy / "replay_step_000001.toml").write_text(text)
    assert main(["explain", str(copy / "replay_step_000001.toml")]) == 2



def _re_sealed(vanilla: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> tuple[Path, str]:
    """A copy of the capture whose step-1 manifest ``edit`` changed, written canonically, with its replay config
    pointed at the copy; and the new manifest's pin (what a forger who re-pins the manifest passes)."""
    copy = tmp_path / "cap"
    shutil.copytree(vanilla, copy)
    path = copy / "optimizer_batch_step_000001.manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    data = canonical_bytes(doc) + b"\n"
    path.write_bytes(data)
    toml = copy / "replay_step_000001.toml"
    toml.write_text(toml.read_text().replace(str(vanilla), str(copy)))
    return toml, sha256_bytes(data)


@pytest.mark.parametrize(("edit", "named"), [
    (lambda s: s.update(last_epoch="1"), "framework_state.lr_scheduler.last_epoch is 1, not an integer >= -1"),
    (lambda s: s.update(optimizer={}), "framework_state.lr_scheduler.optimizer names the scheduler's optimizer"),
    (lambda s: s.update(lr_lambdas=[1]), "framework_state.lr_scheduler.lr_lambdas must hold one null or object"),
])
def test_an_lr_scheduler_state_no_scheduler_holds_is_refused_by_explain(
        edit: Any, named: str, vanilla: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """verl's LR scheduler state travels in framework_state and is loaded whole into the rebuilt engine's scheduler
    (its load_state_dict sets every key as an attribute): a re-pinned manifest with a string counter, a key naming
    the scheduler's optimizer or an lr_lambda of a number was admitted, and the replay failed in the scheduler's step
    (exit 3)."""
    def scheduler(doc: dict[str, Any]) -> None:
        assert isinstance(doc["framework_state"]["lr_scheduler"], dict)
        edit(doc["framework_state"]["lr_scheduler"])

    toml, pin = _re_sealed(vanilla, tmp_path, scheduler)
    capsys.readouterr()
    assert main(["explain", str(toml), "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    text = capsys.readouterr().out
    assert named in text and "Traceback" not in text, text


@pytest.mark.parametrize(("edit", "named"), [
    (lambda s: s.update(optimizer_step=7), "framework_state.optimizer_step is 7, not the captured step 1"),
    (lambda s: s.update(optimizer_step="1"), "framework_state.optimizer_step is '1', not the captured step 1"),
    (lambda s: s.update(world_size=0), "framework_state.world_size is 0, but the captured step ran on 1 process"),
    (lambda s: s.update(world_size=4), "framework_state.world_size is 4, but the captured step ran on 1 process"),
    (lambda s: s.update(world_size=True), "framework_state.world_size is True, but the captured step ran on 1 proc"),
    (lambda s: s.update(zzz=1), "framework_state.zzz is no key a verl capture writes"),
    (lambda s: s.pop("position"), "framework_state.position is missing"),
    (lambda s: s.update(position="x"), "framework_state.position is 'x', not a table of epoch"),
    (lambda s: s["position"].update(epoch=-1), "framework_state.position.epoch is -1, not an integer >= 0"),
    (lambda s: s["position"].update(mini_batch=True), "framework_state.position.mini_batch is True, not an integer"),
    (lambda s: s["position"].update(mini_batch=5), "framework_state.position.mini_batch 5 is not below its"),
])
def test_a_framework_state_no_verl_capture_writes_is_refused_by_explain(
        edit: Any, named: str, vanilla: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only the LR scheduler state of framework_state was read: a re-pinned manifest whose optimizer_step is not its
    step, whose position (update, epoch, mini-batch) holds strings or negative counts, or that holds keys no capture
    writes, was admitted."""
    toml, pin = _re_sealed(vanilla, tmp_path, lambda doc: edit(doc["framework_state"]))
    capsys.readouterr()
    assert main(["explain", str(toml), "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    text = capsys.readouterr().out
    assert named in text and "Traceback" not in text, text


def test_param_groups_the_rebuilt_engine_does_not_have_are_refused_by_the_replay(vanilla: Path, tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]
                                                                                 ) -> None:
    """The one param group split in two (its scheduler state dropped) and re-pinned: only the rebuilt engine's
    optimizer tells it has one group; its load_state_dict refused them with a ValueError, which the replay reported
    as its own failure (exit 3)."""
    def split(doc: dict[str, Any]) -> None:
        (group,) = doc["optimizer"]["param_groups"]
        half = len(group["params"]) // 2
        doc["optimizer"]["param_groups"] = [{**group, "params": group["params"][:half]},
                                            {**group, "params": group["params"][half:]}]
        sched = doc["framework_state"]["lr_scheduler"]  # one base lr and lr_lambda per group, or explain refuses it
        for key in ("base_lrs", "_last_lr", "lr_lambdas"):
            if isinstance(sched.get(key), list):
                sched[key] = sched[key] * 2

    toml, pin = _re_sealed(vanilla, tmp_path, split)
    capsys.readouterr()
    assert main(["replay", str(toml), "--out", str(tmp_path / "r"),
                 "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    text = capsys.readouterr().err
    assert "does not fit the rebuilt engine's optimizer" in text and "Traceback" not in text, text
    assert not (tmp_path / "r" / "replay_metrics.json").exists()

def _config_re_sealed(vanilla: Path, tmp_path: Path, section: str, name: str, value: Any) -> tuple[Path, str]:
    """A copy of the capture whose recorded ``verl.<section>.<name>`` is ``value`` (deleted for ``...``), with the
    config's digest and the contract recomputed from it: every digest inside the manifest agrees, as a forger who
    re-pins the manifest writes it."""
    def edit(verl: dict[str, Any]) -> None:
        table = verl if section == "verl" else verl[section]
        if value is ...:
            del table[name]
        else:
            table[name] = value

    return _verl_re_sealed(vanilla, tmp_path, edit)


def _verl_re_sealed(vanilla: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None],
                    state: Callable[[dict[str, Any]], None] | None = None) -> tuple[Path, str]:
    """A copy of the capture whose recorded ``verl`` section ``change`` edited in place (and its framework_state
    ``state``), with the config's digest and the contract recomputed from it, as a forger who re-pins the manifest
    writes it."""
    from replayjob.digest import sha256_json
    from replayjob.producers.contract import contract_sha256
    from replayjob.redact import redact

    def edit(doc: dict[str, Any]) -> None:
        resolved = doc["config"]["resolved"]
        change(resolved["verl"])
        if state is not None:
            state(doc["framework_state"])
        doc["config"]["sha256"] = sha256_json(resolved)
        try:
            contract = redact(rv.contract(resolved))
        except Exception:  # a shape contract() cannot read: the manifest keeps its contract
            return
        doc["contract"] = {"sha256": contract_sha256(contract), "value": contract}

    return _re_sealed(vanilla, tmp_path, edit)


@pytest.mark.parametrize(("section", "name", "value", "named"), [
    # refused values: each builds an engine replayjob does not replay (remote code, kernels, no update, ...)
    ("model", "trust_remote_code", True, "verl.model.trust_remote_code = True is not replayed"),
    ("model", "use_liger", True, "verl.model.use_liger = True is not replayed"),
    ("engine", "forward_only", True, "verl.engine.forward_only = True is not replayed"),
    ("actor", "ulysses_sequence_parallel_size", 2, "verl.actor.ulysses_sequence_parallel_size = 2 is not replayed"),
    ("model", "lora_adapter_path", "/tmp", "verl.model.lora_adapter_path = '/tmp' is not replayed"),
    # a field a capture never records: a module verl imports, or one the dataclass has not
    ("model", "external_lib", "os", "verl.model.external_lib is irrelevant to the update and never recorded"),
    ("actor", "ppo_epochs", 3, "verl.actor.ppo_epochs is irrelevant to the update and never recorded"),
    ("actor", "zzz", 1, "verl.actor.zzz is no field of verl's FSDPActorConfig"),
    ("verl", "critic", {}, "verl.critic is no section a capture records"),
    ("actor", "clip_ratio", ..., "verl.actor.clip_ratio is missing"),
    # knobs of values they do not take, and a section that is no table (a traceback, exit 3)
    ("engine", "micro_batch_size_per_gpu", 0, "verl.engine.micro_batch_size_per_gpu is 0; it takes a positive"),
    ("engine", "micro_batch_size_per_gpu", "2", "verl.engine.micro_batch_size_per_gpu is '2'; it takes"),
    ("engine", "use_remove_padding", "yes", "verl.engine.use_remove_padding is 'yes'; it takes true or false"),
    ("engine", "mixed_precision", {"param_dtype": "fp16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
     "verl.engine.mixed_precision.param_dtype = fp16 is not replayed"),
    ("engine", "mixed_precision", {"param_dtype": "fp32", "reduce_dtype": "fp32"}, "verl.engine.mixed_precision is {"),
    ("verl", "actor", [1], "verl.actor is [1], not a table of verl's FSDPActorConfig fields"),
])
def test_a_recorded_verl_config_a_capture_never_writes_is_refused_by_explain(
        section: str, name: str, value: Any, named: str, vanilla: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The recorded verl sections were compared with the replay's only as a contract: a re-pinned manifest (config
    digest and contract recomputed) with trust_remote_code on, a refused kernel, an irrelevant field verl acts on
    (model.external_lib, a module imported when the model config is built), an unknown or missing field, or a knob
    of another type was admitted, and a section that is no table failed with a traceback (exit 3)."""
    toml, pin = _config_re_sealed(vanilla, tmp_path, section, name, value)
    capsys.readouterr()
    assert main(["explain", str(toml), "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    out = capsys.readouterr()
    assert named in out.out and "Traceback" not in out.out + out.err, out


def _entry(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of the recorded verl section setting the entry at the dotted ``path`` (``section.field[.key...]``)
    to ``value`` (deleted for ``...``)."""
    def edit(verl: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = verl
        for part in parents:
            node = node[part]
        if value is ...:
            del node[leaf]
        else:
            node[leaf] = value

    return edit


@pytest.mark.parametrize(("path", "value", "named"), [
    # the wrong JSON type: a string, a bool, a number where a string is taken
    ("actor.clip_ratio", "0.2", "verl.actor.clip_ratio is '0.2'; it takes a number in [0, 1]"),
    ("actor.clip_ratio", True, "verl.actor.clip_ratio is True; it takes a number in [0, 1]"),
    ("actor.use_kl_loss", 1, "verl.actor.use_kl_loss is 1; it takes true or false"),
    ("actor.loss_agg_mode", 1, "verl.actor.loss_agg_mode is 1; it takes one of 'token-mean'"),
    ("model.lora_rank", 1.5, "verl.model.lora_rank is 1.5; it takes an integer >= 0"),
    ("optim.betas", "0.9,0.999", "verl.optim.betas is '0.9,0.999'; it takes two numbers in [0, 1)"),
    ("engine.wrap_policy", [], "verl.engine.wrap_policy is []; it takes a table"),
    # huge: finite in JSON, infinite in the float32 the update computes in; out of range
    ("actor.clip_ratio", 1e308, "verl.actor.clip_ratio is 1e+308; it takes a number in [0, 1]"),
    ("optim.lr", 1e308, "verl.optim.lr is 1e+308; it takes a number >= 0"),
    ("actor.entropy_coeff", -1e300, "verl.actor.entropy_coeff is -1e+300; it takes a number"),
    ("actor.clip_ratio_c", 0.5, "verl.actor.clip_ratio_c is 0.5; it takes a number > 1"),
    ("actor.kl_loss_coef", -0.1, "verl.actor.kl_loss_coef is -0.1; it takes a number >= 0"),
    ("optim.betas", [0.9, 1.0], "verl.optim.betas is [0.9, 1.0]; it takes two numbers in [0, 1)"),
    ("engine.fsdp_size", 0, "verl.engine.fsdp_size is 0; it takes -1 or an integer >= 1"),
    ("actor.loss_scale_factor", 0, "verl.actor.loss_scale_factor is 0; it takes an integer >= 1 or null"),
    # a name verl does not act on, or a module it would import at build
    ("actor.loss_agg_mode", "token-median", "verl.actor.loss_agg_mode is 'token-median'; it takes one of"),
    ("actor.kl_loss_type", "full", "verl.actor.kl_loss_type is 'full'; it takes one of"),
    ("optim.lr_scheduler_type", "linear", "verl.optim.lr_scheduler_type is 'linear'; it takes one of"),
    ("optim.optimizer_impl", "os", "verl.optim.optimizer_impl is 'os'; it takes one of 'torch.optim'"),
    # the entries of a table-valued contract field: wrong type, unknown, missing
    ("actor.policy_loss.loss_mode", "mine", "verl.actor.policy_loss.loss_mode is 'mine'; it takes one of"),
    ("actor.policy_loss.clip_cov_lb", "1", "verl.actor.policy_loss.clip_cov_lb is '1'; it takes a number"),
    ("actor.policy_loss.rollout_correction.bypass_mode", "no",
     "verl.actor.policy_loss.rollout_correction.bypass_mode is 'no'; it takes true or false"),
    ("actor.policy_loss.zzz", 1, "verl.actor.policy_loss.zzz is no entry of verl's PolicyLossConfig"),
    ("actor.policy_loss.clip_cov_lb", ..., "verl.actor.policy_loss.clip_cov_lb is missing"),
    ("model.tiled_mlp.num_shards", "4", "verl.model.tiled_mlp.num_shards is '4'; it takes an integer >= 1"),
    ("model.tiled_mlp.zzz", 1, "verl.model.tiled_mlp.zzz is no entry of"),
])
def test_a_contract_field_of_another_type_or_range_is_refused_by_explain(
        path: str, value: Any, named: str, vanilla: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Contract fields were recorded and compared as they were, of any JSON type: a re-pinned manifest (config digest
    and contract recomputed) whose actor.clip_ratio is the string "0.2", true or 1e308, whose loss aggregation is no
    mode verl has, whose optimizer module is another, or whose policy loss table holds an unknown entry or lacks one,
    was admitted. Each contract field's type and range is declared in fields.FIELDS, the rule a capture records it
    by and admission reads it back by."""
    toml, pin = _verl_re_sealed(vanilla, tmp_path, _entry(path, value))
    capsys.readouterr()
    assert main(["explain", str(toml), "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    out = capsys.readouterr()
    assert named in out.out and "Traceback" not in out.out + out.err, out


def test_every_wrong_contract_field_is_listed_and_the_replay_refuses_it_too(
        vanilla: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Several wrong contract fields at once: explain lists each (not the first alone), and replay refuses the same
    manifest before it builds anything; the unedited capture is still admitted."""
    toml = vanilla / "replay_step_000001.toml"
    assert main(["explain", str(toml)]) == 0

    def several(verl: dict[str, Any]) -> None:
        for path, value in (("actor.clip_ratio", "0.2"), ("optim.weight_decay", True), ("optim.clip_grad", 1e308),
                            ("actor.policy_loss.ppo_kl_coef", ...), ("model.lora", None)):
            _entry(path, value)(verl)

    toml, pin = _verl_re_sealed(vanilla, tmp_path, several)
    pinned = f'optimizer_batch.expected_manifest_sha256="{pin}"'
    named = ["verl.actor.clip_ratio is '0.2'", "verl.optim.weight_decay is True", "verl.optim.clip_grad is 1e+308",
             "verl.actor.policy_loss.ppo_kl_coef is missing", "verl.model.lora is None"]
    capsys.readouterr()
    assert main(["explain", str(toml), "--set", pinned]) == 2
    out = capsys.readouterr()
    assert all(n in out.out for n in named) and "Traceback" not in out.out + out.err, out
    assert main(["replay", str(toml), "--out", str(tmp_path / "r"), "--set", pinned]) == 2
    out = capsys.readouterr()
    assert all(n in out.out + out.err for n in named) and "Traceback" not in out.out + out.err, out
    assert not (tmp_path / "r" / "replay_metrics.json").exists()


def test_a_null_lr_scheduler_state_is_refused_by_explain(vanilla: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """verl's FSDP engine builds an LR scheduler with its optimizer (constant or cosine; forward_only, which builds
    neither, is refused), so the recorded config says the captured engine had one: a re-pinned manifest whose
    scheduler state is null was admitted by explain and refused only once the replay had built the engine."""
    toml, pin = _verl_re_sealed(vanilla, tmp_path, lambda verl: None, lambda state: state.update(lr_scheduler=None))
    capsys.readouterr()
    assert main(["explain", str(toml), "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    out = capsys.readouterr()
    assert "framework_state.lr_scheduler is null, but the recorded engine builds an LR scheduler" in out.out, out
    assert "Traceback" not in out.out + out.err, out


def test_every_verl_config_field_is_classified() -> None:
    """The declaration covers exactly the installed verl's fields: a new field fails here (and a capture of a config
    that has it is refused), a field verl dropped is reported as stale."""
    import dataclasses
    import importlib

    from replayjob.producers.verl.fields import FIELDS, KINDS, SECTIONS

    for section, (module, name) in SECTIONS.items():
        cls = getattr(importlib.import_module(module), name)
        have = {f.name for f in dataclasses.fields(cls)}
        assert sorted(have - set(FIELDS[section])) == [], f"unclassified verl.{section} fields"
        assert sorted(set(FIELDS[section]) - have) == [], f"stale verl.{section} entries"
        for field_name, f in FIELDS[section].items():
            assert f.kind in KINDS, (section, field_name)
            assert f.kind in ("contract",) or f.why, (section, field_name)  # every other class says why


def test_every_contract_field_declares_a_type_that_verls_own_default_takes() -> None:
    """Each contract field's declaration (fields.FIELDS, its ``spec``) admits the default of the installed verl's
    dataclass, as a capture records it: a declaration stricter than verl fails here, not in a user's capture."""
    import dataclasses
    import importlib

    from replayjob.producers.verl.fields import CONTRACT, FIELDS, SECTIONS, value_reasons

    for section, (module, name) in SECTIONS.items():
        cls = getattr(importlib.import_module(module), name)
        for f in dataclasses.fields(cls):
            declared = FIELDS[section][f.name]
            if declared.kind != CONTRACT:
                continue
            assert declared.spec is not None, f"verl.{section}.{f.name} declares no type"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            assert value_reasons(section, f.name, rv.jsonable(default)) == [], (section, f.name, default)


def test_a_capture_refuses_an_unclassified_field_and_a_refused_value(base: Path) -> None:
    import dataclasses

    from verl.workers.config import FSDPOptimizerConfig

    from replayjob.errors import CaptureError

    planted = dataclasses.make_dataclass("PlantedOptimizerConfig", [("new_knob", int, dataclasses.field(default=1))],
                                         bases=(FSDPOptimizerConfig,))
    with pytest.raises(CaptureError, match=r"verl\.optim\.new_knob is not classified"):
        rv.section_values("optim", planted())
    from verl.workers.config import HFModelConfig

    model = HFModelConfig(path=str(base), load_tokenizer=False, trust_remote_code=True)
    with pytest.raises(CaptureError, match=r"verl\.model\.trust_remote_code = True is not replayed"):
        rv.section_values("model", model)
    from verl.workers.config import FSDPEngineConfig

    # mixed precision as verl's engine resolves it (unset: bf16 compute), fp16 (a gradient scaler) refused
    assert rv.section_values("engine", FSDPEngineConfig())["mixed_precision"] == {
        "param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    with pytest.raises(CaptureError, match="fp16 is not replayed"):
        rv.section_values("engine", FSDPEngineConfig(mixed_precision={"param_dtype": "fp16"}))
    from verl.workers.config import FSDPOptimizerConfig

    # a contract field of another type or range: refused by the rule admission reads it back by
    with pytest.raises(CaptureError, match=r"verl\.optim\.lr is inf; it takes a number >= 0"):
        rv.section_values("optim", FSDPOptimizerConfig(lr=float("inf")))
    with pytest.raises(CaptureError, match=r"verl\.optim\.optimizer_impl is 'bitsandbytes\.optim'; it takes one of"):
        rv.section_values("optim", FSDPOptimizerConfig(lr=1e-3, optimizer_impl="bitsandbytes.optim"))


def test_the_config_switch_captures_the_actor_worker_it_is_imported_in(base: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """verl_hook, imported as verl imports an ``external_lib`` in a worker, instruments the worker whose loss is the
    actor's ppo_loss when the environment asks for a capture, and nothing when it does not."""
    import importlib

    hook = importlib.import_module("replayjob.producers.verl.plugin")
    hook.install()  # idempotent: the import installed it already
    worker = build_worker(base)  # the environment asks for nothing
    assert getattr(worker, hook.ATTRIBUTE, None) is None
    monkeypatch.setenv(hook.DIR_ENV, str(tmp_path / "cap"))
    monkeypatch.setenv(hook.STEPS_ENV, "1")
    worker = build_worker(base)
    TinyTrainer(worker)._update_actor(rollout_batch(7))
    capture = getattr(worker, hook.ATTRIBUTE)
    assert capture.result.replay_toml == tmp_path / "cap" / "replay.toml"
    assert main(["explain", str(capture.result.replay_toml)]) == 0
    monkeypatch.setenv(hook.STEPS_ENV, "one")
    with pytest.raises(Exception, match="must be step numbers"):
        build_worker(base)


def _update_of(replay_dir: Path, capture_dir: Path, k: int) -> torch.Tensor:
    from safetensors.torch import load_file

    after = load_file(str(replay_dir / "final_adapter" / "adapter_model.safetensors"))
    before = load_file(str(capture_dir / f"optimizer_batch_step_{k:06d}.adapter.safetensors"))
    return torch.cat([(after[n].double() - before[n].double()).flatten() for n in sorted(after)])


KNOB_ARMS = {
    "micro-batch-1": ["verl.engine.micro_batch_size_per_gpu=1"],
    "micro-batch-4": ["verl.engine.micro_batch_size_per_gpu=4"],
    "checkpointing": ["verl.model.enable_gradient_checkpointing=true"],
    "dynamic": ["verl.engine.use_dynamic_bsz=true", "verl.engine.max_token_len_per_gpu=24"],
    "padded": ["verl.engine.use_remove_padding=false", "verl.model.use_remove_padding=false"],
}


def test_registered_knobs_keep_the_update_and_are_observed(vanilla: Path, tmp_path: Path) -> None:
    """Each arm of a registered verl knob: admitted, observed in effect on the replay's engine, judged by reduce's
    exact-input claim, and its update equal to the baseline replay's within floating-point tolerance (an arm that
    changed the math, e.g. a loss normalised per micro-batch, would fail the comparison)."""
    toml = vanilla / "replay_step_000002.toml"
    assert main(["replay", str(toml), "--out", str(tmp_path / "baseline")]) == 0
    base = _update_of(tmp_path / "baseline", vanilla, 2)
    for arm, sets in KNOB_ARMS.items():
        wants = {kv.split("=")[0]: json.loads(kv.split("=")[1]) for kv in sets}
        argv = [a for s in sets for a in ("--set", s)]
        argv += ["--set", "optimizer_batch.allow_config_differences=" + json.dumps(sorted(wants))]
        out = tmp_path / "arms" / arm
        assert main(["replay", str(toml), "--out", str(out), *argv]) == 0, arm
        rep = json.loads((out / "replay_metrics.json").read_text())
        assert all(rep["runtime"][k] == v for k, v in wants.items()), (arm, rep["runtime"])
        delta = _update_of(out, vanilla, 2)
        cos = float(torch.dot(delta, base) / (delta.norm() * base.norm()))
        assert cos >= 1 - 1e-6 and float((delta - base).norm() / base.norm()) <= 1e-4, (arm, cos)
    verdict = tmp_path / "exact-input.json"  # every arm with the same-condition baseline
    assert main(["reduce", str(tmp_path / "baseline"), str(tmp_path / "arms"), "--claim", "exact-input", "--source",
                 str(vanilla), "--source-step", "2", "--min-repeats", "1", "--out", str(verdict)]) == 0, \
        verdict.read_text()[-3000:]
    checks = {c["name"]: c["status"] for c in json.loads(verdict.read_text())["checks"]}
    assert checks["exact.knobs_in_effect"] == checks["exact.systems_only"] == "pass"
    # an undeclared difference, and a knob whose rule does not hold (micro-batch size under dynamic batching)
    assert main(["explain", str(toml), "--set", "verl.engine.micro_batch_size_per_gpu=1"]) == 2
    assert main(["explain", str(toml), "--set", "verl.engine.micro_batch_size_per_gpu=1", "--set",
                 "verl.engine.use_dynamic_bsz=true", "--set", 'optimizer_batch.allow_config_differences=['
                 '"verl.engine.micro_batch_size_per_gpu", "verl.engine.use_dynamic_bsz"]']) == 2
    # remove-padding is one setting in two sections: declaring one half is refused
    assert main(["explain", str(toml), "--set", "verl.engine.use_remove_padding=false", "--set",
                 'optimizer_batch.allow_config_differences=["verl.engine.use_remove_padding"]']) == 2


PRECISION_ARMS = {"param-bf16": {"verl.engine.mixed_precision.param_dtype": '"bf16"'},
                  "reduce-bf16": {"verl.engine.mixed_precision.reduce_dtype": '"bfloat16"'}}


def test_mixed_precision_arms_are_observed_and_judged_by_the_approximate_claim_only(
        vanilla: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The mixed-precision dtypes of a float32 capture (verl.engine.mixed_precision, recorded with every entry):
    each bfloat16 arm is admitted, built as declared (the FSDP2 policy and autocast observed), and passes the
    exact-input claim (the same inputs, knobs in effect); its update moved beyond summation order (so the bitwise
    claim fails, naming the final parameters) but stays the baseline's direction.  fp16 (a gradient scaler the
    capture does not hold) and an entry that is no knob (buffer_dtype) are refused."""
    toml = str(vanilla / "replay_step_000002.toml")
    manifest = json.loads((vanilla / "optimizer_batch_step_000002.manifest.json").read_text())
    assert manifest["config"]["resolved"]["verl"]["engine"]["mixed_precision"] == {
        "param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    assert main(["replay", toml, "--out", str(tmp_path / "baseline")]) == 0
    base = _update_of(tmp_path / "baseline", vanilla, 2)
    for arm, sets in PRECISION_ARMS.items():
        argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        argv += ["--set", "optimizer_batch.allow_config_differences=" + json.dumps(sorted(sets))]
        assert main(["replay", toml, "--out", str(tmp_path / "arms" / arm), *argv]) == 0, arm
        rep = json.loads((tmp_path / "arms" / arm / "replay_metrics.json").read_text())
        key = next(iter(sets))
        assert rep["runtime"][key] == "bf16" and list(rep["runtime"].values()).count("fp32") == 1, rep["runtime"]
        delta = _update_of(tmp_path / "arms" / arm, vanilla, 2)
        cos = float(torch.dot(delta, base) / (delta.norm() * base.norm()))
        assert delta.ne(base).any() and cos >= 0.99, (arm, cos)
    verdict = tmp_path / "v.json"
    args = [str(tmp_path / "baseline"), str(tmp_path / "arms"), "--source", str(vanilla), "--source-step", "2",
            "--min-repeats", "1", "--out", str(verdict)]
    assert main(["reduce", *args, "--claim", "exact-input"]) == 0, verdict.read_text()[-3000:]
    checks = {c["name"]: c["status"] for c in json.loads(verdict.read_text())["checks"]}
    assert checks["exact.knobs_in_effect"] == checks["exact.systems_only"] == "pass"
    assert main(["reduce", *args, "--claim", "bitwise"]) == 1
    failed = [c for c in json.loads(verdict.read_text())["checks"] if c["status"] == "fail"]
    assert failed and any("param_dtype=bf16#0" in str(c["offenders"]) for c in failed), failed
    capsys.readouterr()
    declare = 'optimizer_batch.allow_config_differences=["verl.engine.mixed_precision.param_dtype"]'
    assert main(["explain", toml, "--set", 'verl.engine.mixed_precision.param_dtype="fp16"', "--set", declare]) == 2
    assert "fp16 is not replayed" in capsys.readouterr().err
    assert main(["explain", toml, "--set", 'verl.engine.mixed_precision.buffer_dtype="bf16"', "--set",
                 'optimizer_batch.allow_config_differences=["verl.engine.mixed_precision.buffer_dtype"]']) == 2
    assert "is not a registered systems-only knob" in capsys.readouterr().err


def test_a_precision_arm_of_a_bf16_capture_is_judged_by_the_approximate_claim(scenario: tuple[str, Path],
                                                                              tmp_path: Path) -> None:
    """verl's default bfloat16 capture (one step) against an arm computing in float32: with a pinned tolerance file
    the approximate claim compares each update with the source's; a tolerance at the measured floor's scale passes,
    one at summation-order scale (1e-4 relative) fails (exit 1), so the claim sees the precision change."""
    _, out = scenario
    assert json.loads(next(out.glob("*.manifest.json")).read_text())["config"]["resolved"]["verl"]["engine"][
        "mixed_precision"]["param_dtype"] == "bf16"
    verdicts = {}
    for name, (cosine, rel) in {"loose": (0.99, 0.2), "tight": (0.999999, 1e-4)}.items():
        tol = tmp_path / f"{name}.toml"
        tol.write_text(f"update_cosine_min = {cosine}\nrelative_delta_l2_max = {rel}\n")
        pin = ["--set", "optimizer_batch.tolerances_sha256=" + json.dumps(sha256_file(tol))]
        arm = ["--set", 'verl.engine.mixed_precision.param_dtype="fp32"', "--set",
               'optimizer_batch.allow_config_differences=["verl.engine.mixed_precision.param_dtype"]']
        assert main(["replay", str(out / "replay.toml"), "--out", str(tmp_path / name / "base"), *pin]) == 0
        assert main(["replay", str(out / "replay.toml"), "--out", str(tmp_path / name / "fp32"), *pin, *arm]) == 0
        verdict = tmp_path / f"{name}.json"
        verdicts[name] = main(["reduce", str(tmp_path / name), "--claim", "approximate", "--tolerances", str(tol),
                               "--source", str(out), "--min-repeats", "1", "--out", str(verdict)])
        doc = json.loads(verdict.read_text())
        groups = doc["updates"]["groups"]
        assert groups["baseline ~ source"]["relative_delta_l2"]["max"] == 0  # the same condition: bitwise
        moved = groups["param_dtype=fp32 ~ source"]["relative_delta_l2"]["max"]
        assert 1e-4 < moved < 0.2, moved
    assert verdicts == {"loose": 0, "tight": 1}, verdicts


def test_padded_and_packed_replays_are_traced_row_by_row_and_trace_diff_names_the_first_divergence(
        vanilla: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``replay --trace`` of a verl capture, keyed by logical row through the engine's own micro-batches (every
    module's output and gradient, every parameter's gradient and update as full tensors): with padded rows, and
    with packed rows (the engine runs each micro-batch as one sequence, cut back into rows at its offsets), so the
    two arms line up row by row.  Tracing leaves the update as it is; two traces of the same arm are identical,
    and against micro-batch size 1 ``trace-diff`` names the first divergent module in forward and backward
    order."""
    toml = str(vanilla / "replay_step_000002.toml")
    padded = {"verl.engine.use_remove_padding": "false", "verl.model.use_remove_padding": "false"}

    def replay(out: str, *flags: str, **extra: str) -> int:
        sets = {**padded, **extra}
        argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        argv += ["--set", "optimizer_batch.allow_config_differences=" + json.dumps(sorted(sets))]
        return main(["replay", toml, "--out", str(tmp_path / out), *flags, *argv])

    assert main(["replay", toml, "--out", str(tmp_path / "packed"), "--trace"]) == 0
    assert main(["replay", toml, "--out", str(tmp_path / "packed-plain")]) == 0
    assert replay("a", "--trace") == replay("b", "--trace") == replay("plain") == 0
    assert replay("mb1", "--trace", **{"verl.engine.micro_batch_size_per_gpu": "1"}) == 0
    final = {d: json.loads((tmp_path / d / "replay_metrics.json").read_text())["optimizer_batch/final_adapter_sha256"]
             for d in ("a", "b", "plain", "mb1", "packed", "packed-plain")}
    assert final["a"] == final["b"] == final["plain"] != final["mb1"], final
    assert final["packed"] == final["packed-plain"], final  # tracing packed rows leaves the update as it is
    capsys.readouterr()
    assert main(["trace-diff", str(tmp_path / "packed"), str(tmp_path / "a"), "--json"]) in (0, 1)
    lined = json.loads(capsys.readouterr().out)
    assert not lined["unmatched"]["only_a"] and not lined["unmatched"]["only_b"], lined["unmatched"]
    assert lined["compared"]["forward"] > 20 and lined["compared"]["backward"] > 20  # row by row, both directions
    capsys.readouterr()
    assert main(["trace-diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["identical"] is True and same["a"]["micro_batch_size"] == 2
    assert same["compared"]["params"] == len(json.loads(
        (vanilla / "optimizer_batch_step_000002.manifest.json").read_text())["trainable"])  # every parameter
    assert same["compared"]["forward"] > 20 and same["compared"]["backward"] > 20  # every module, both directions
    assert main(["trace-diff", str(tmp_path / "a"), str(tmp_path / "mb1"), "--json"]) == 1
    other = json.loads(capsys.readouterr().out)
    assert other["identical"] is False and other["b"]["micro_batch_size"] == 1 and not other["unmatched"]["only_b"]
    first = other["first_divergence"]
    assert first["forward"]["name"].startswith("model.layers.0.") and first["backward"] is not None, first


@pytest.fixture(scope="module")
def sampled(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with the rollout's logprobs (calculate_log_probs): the driver computes old_log_probs through the
    worker's infer_batch as verl's _compute_old_log_prob does, and rollout_log_probs are those plus seeded noise of
    standard deviation 0.01 on the response tokens (a sampler whose numerics differ); steps 1 and 2 captured."""
    out = tmp_path_factory.mktemp("sampled") / "cap"
    worker = build_worker(base, fp32=True)
    capture = rv.capture_actor_steps(worker, out, steps=[1, 2])
    trainer = TinyTrainer(worker, sampler_noise=0.01)
    for u in range(2):
        trainer._update_actor(rollout_batch(300 + u))
    capture.close()
    return out


def _mismatch(toml: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["mismatch", str(toml), "--json"]) == 2  # no bound declared: the figures decide nothing
    return dict(json.loads(capsys.readouterr().out))


def test_mismatch_reports_the_sampler_and_old_logprobs_in_verls_metric_names(
        sampled: Path, vanilla: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``replayjob mismatch`` on a verl capture: the trainer's logprobs recomputed by verl's own log-prob path from
    the pinned state of the step; old_log_probs equal it bit for bit at policy lag 0 (the first mini-batch of an
    update) and not one step later; the sampler's log-ratio is the planted noise; verl's own metrics
    (training/rollout_probs_diff_*) for the sampler against old_log_probs and against the recompute.  A capture
    without rollout logprobs reports old_log_probs alone."""
    first = _mismatch(sampled / "replay_step_000002.toml", capsys)
    assert first["capture"]["framework"] == "verl" and first["capture"]["step"] == 2
    src = {s["name"]: s for s in first["sources"]}
    assert sorted(src) == ["sampler", "trainer_old"]
    old = src["trainer_old"]
    assert old["policy_lag"]["steps"] == 0 and old["log_ratio"]["bitwise_equal_share"] == 1
    noise = src["sampler"]["log_ratio"]
    assert 0.005 < noise["std"] < 0.02 and noise["bitwise_equal_share"] == 0, noise
    metrics = first["capture"]["verl_metrics"]
    names = {"training/rollout_probs_diff_valid", "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
             "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr"}
    assert set(metrics) == {"rollout_log_probs vs old_log_probs", "rollout_log_probs vs the recompute"}
    assert all(set(m) == names for m in metrics.values())
    assert metrics["rollout_log_probs vs old_log_probs"] == metrics["rollout_log_probs vs the recompute"]  # lag 0
    later = {s["name"]: s for s in _mismatch(sampled / "replay_step_000001.toml", capsys)["sources"]}
    assert later["trainer_old"]["policy_lag"]["steps"] == 1
    assert later["trainer_old"]["log_ratio"]["bitwise_equal_share"] < 1
    plain = _mismatch(vanilla / "replay_step_000002.toml", capsys)
    assert [s["name"] for s in plain["sources"]] == ["trainer_old"] and plain["capture"]["verl_metrics"] == {}


def test_the_capture_overhead_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/verl_capture_overhead.py's smoke mode writes a valid result (no time is asserted here)."""
    from benchmarks import common, verl_capture_overhead

    assert verl_capture_overhead.main(["--smoke", "--results", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "verl_capture_overhead.smoke.json").read_text())
    assert doc["schema"] == common.SCHEMA and doc["mode"] == "smoke" and doc["target"]["value"] == 1.02
    assert doc["measurements"]["update_seconds_on"]["n"] == doc["parameters"]["updates"]


@pytest.mark.alone
@pytest.mark.slow
def test_two_data_parallel_processes_capture_and_replay_bitwise(base: Path, tmp_path: Path) -> None:
    """World size 2 (torchrun, gloo, FSDP2 sharding the parameters over both): each process captures its own share
    of the mini-batch as a part, process 0 writes the root; a replay on two processes reproduces the update
    bitwise.  Another process count is the knob ``distributed.num_processes``: refused undeclared; declared, one
    process runs the two shares joined (here the same loss and update bits: at float32 the two processes' average
    of gradients scaled by 2 is one process's sum; the gradient norm, a reduction ordered by the sharding, to the
    last bit or within it), and ``reduce --claim bitwise`` judges it as a systems-only arm."""
    out = tmp_path / "cap"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "benchmarks.verl_tiny", str(out), str(base), "2"], capture_output=True, text=True,
                          timeout=600, check=False, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["COMPLETE.0", "COMPLETE.1", "final_adapter", "metrics.json",
                                                      "optimizer_batch_step_000002.manifest.json", "rank-0", "rank-1",
                                                      "replay.toml"]
    root = json.loads((out / "optimizer_batch_step_000002.manifest.json").read_text())
    assert root["world_size"] == 2
    assert main(["replay", str(out / "replay.toml"), "--out", str(tmp_path / "one")]) == 2  # undeclared
    declared = ["--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes"]']
    assert main(["replay", str(out / "replay.toml"), "--out", str(tmp_path / "r" / "one" / "repeat-000"),
                 *declared]) == 0
    assert main(["replay", str(out / "replay.toml"), "--out", str(tmp_path / "r" / "repeat-000"), "--nproc", "2"]) == 0
    rep = json.loads((tmp_path / "r" / "repeat-000" / "replay_metrics.json").read_text())
    src = json.loads((out / "metrics.json").read_text())
    assert rep["distributed"]["world_size"] == 2
    assert rep["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    assert rep["loss"] == src["loss"] and rep["grad_norm"] == src["grad_norm"]
    one = json.loads((tmp_path / "r" / "one" / "repeat-000" / "replay_metrics.json").read_text())
    assert "distributed" not in one and one["runtime"]["distributed.num_processes"] == 1
    assert rep["runtime"]["distributed.num_processes"] == 2
    assert one["loss"] == src["loss"]
    assert one["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    # the gradient norm is a reduction of its own, ordered by the sharding (each process's squares summed, then the
    # processes'): on one process it may differ in the last bit (a float32 ulp on an AMD EPYC host's CPU build)
    assert math.isclose(one["grad_norm"], src["grad_norm"], rel_tol=1e-6)
    shutil.move(str(tmp_path / "r" / "repeat-000"), str(tmp_path / "r" / "two" / "repeat-000"))
    verdict = tmp_path / "bitwise.json"
    assert main(["reduce", str(tmp_path / "r"), "--claim", "bitwise", "--source", str(out), "--min-repeats", "1",
                 "--out", str(verdict)]) == 0, verdict.read_text()[-2000:]
    assert sorted(json.loads(verdict.read_text())["arms"]) == ["baseline", "num_processes=1"]


def test_a_one_process_capture_replays_on_two_processes_and_an_uneven_split_is_refused(
        vanilla: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The knob the other way: a one-process capture replayed on two (torchrun), each process taking a contiguous
    half of the mini-batch's rows (the same bits here, as above); three processes cannot split its rows evenly and
    are refused before any process starts."""
    toml = str(vanilla / "replay_step_000002.toml")
    declared = ["--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes"]']
    assert main(["replay", toml, "--out", str(tmp_path / "two"), "--nproc", "2", *declared]) == 0
    two = json.loads((tmp_path / "two" / "replay_metrics.json").read_text())
    sealed = json.loads((vanilla / "optimizer_batch_step_000002.manifest.json").read_text())["outcome"]
    assert two["distributed"]["world_size"] == 2 and two["runtime"]["distributed.num_processes"] == 2
    assert two["optimizer_batch/final_adapter_sha256"] == sealed["final_adapter_sha256"]
    capsys.readouterr()
    assert main(["replay", toml, "--out", str(tmp_path / "three"), "--nproc", "3", *declared]) == 2
    assert "do not split evenly over 3 processes" in capsys.readouterr().err
    assert not (tmp_path / "three").exists()
