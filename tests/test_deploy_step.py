"""`replayjob step`: strict validation before any work, the run record, pins, partial outputs, and the
reducer's hardware check.  In-process and model-free: every refusal here happens before a model is
built (the whole chain runs in tests/test_deploy_chain.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from replayjob.artifacts.spec import DETERMINISM_ENV, AblationSpec, Arm, load_spec, spec_from_dict
from replayjob.cli import main
from replayjob.errors import ConfigError, ContractError, IntegrityError, RefusedError, UsageError
from replayjob.gate import synthetic
from replayjob.gate.reducer import Request, reduce_evidence
from replayjob.jsonio import pretty_bytes
from replayjob.launch import step

SPEC = """\
name = "unit"
image = "replayjob:dev"
gpu_product = "none"
device = "cpu"
repeats = 2

[arms.ckpt-off]

[arms.ckpt-on]
"backend.options.gradient_checkpointing" = true
"""
LOGICAL, MANIFEST = "a" * 64, "b" * 64


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "ablation.toml"
    path.write_text(SPEC, encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def pinned_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in DETERMINISM_ENV.items():
        monkeypatch.setenv(key, value)
    for key in (step.IMAGE_ENV, step.DIGEST_ENV, "REPLAYJOB_RENDERED"):
        monkeypatch.delenv(key, raising=False)


def fake_capture(run: Path, **overrides: object) -> Path:
    """A capture's metrics.json with the two pins (nothing else is read before the replay starts)."""
    source = run / "source"
    source.mkdir(parents=True)
    doc = {"optimizer/logical_batch_sha256": LOGICAL, "optimizer_batch/manifest_sha256": MANIFEST,
           "optimizer_batch/manifest_path": "optimizer_batch_step_000000.manifest.json", **overrides}
    (source / "metrics.json").write_bytes(pretty_bytes(doc))
    return source


def test_the_run_record_refuses_another_runs_directory(spec_file: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    layout = step.Layout.of(tmp_path / "run")
    spec = load_spec(spec_file)
    step.check_run_record(layout, spec)
    step.check_run_record(layout, spec)  # the same run: accepted again
    with pytest.raises(ContractError, match="another run's artifacts"):
        step.check_run_record(layout, step.select(spec, repeats=1))
    monkeypatch.setenv(step.IMAGE_ENV, "registry.example/replayjob@sha256:" + "c" * 64)
    with pytest.raises(ContractError, match="the image differ"):
        step.check_run_record(layout, spec)


def test_the_run_record_names_the_image_by_its_digest(spec_file: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The image's digest, from its reference or (an Apptainer .sif file) from REPLAYJOB_IMAGE_DIGEST,
    is recorded and fingerprinted; a tag alone is refused before any work unless the spec is local."""
    spec = load_spec(spec_file)
    digest = "sha256:" + "d" * 64
    monkeypatch.setenv(step.IMAGE_ENV, "registry.example/replayjob:0.1.0")
    with pytest.raises(ConfigError, match="not named by its digest"):
        step.image_identity(spec)
    run = tmp_path / "refused"
    assert main(["step", "capture", "--spec", str(spec_file), "--run-dir", str(run)]) == 2
    assert "image_policy" in capsys.readouterr().err and not run.exists()
    local = dataclasses.replace(spec, image_policy="local")
    assert step.image_identity(local) == ("registry.example/replayjob:0.1.0", None)
    monkeypatch.setenv(step.IMAGE_ENV, "/shared/images/replayjob.sif")
    monkeypatch.setenv(step.DIGEST_ENV, digest)
    assert step.image_identity(spec) == ("/shared/images/replayjob.sif", digest)
    layout = step.Layout.of(tmp_path / "run")
    step.check_run_record(layout, spec)
    record = json.loads((layout.run / step.RUN_RECORD).read_text(encoding="utf-8"))
    assert (record["image"], record["image_digest"]) == ("/shared/images/replayjob.sif", digest)
    assert record["fingerprint"] == step.fingerprint(spec, digest)
    monkeypatch.setenv(step.DIGEST_ENV, "sha256:" + "e" * 64)  # the same path, another file
    with pytest.raises(ContractError, match="another run's artifacts"):
        step.check_run_record(layout, spec)
    for bad in ("d" * 64, "sha256:" + "D" * 64):
        monkeypatch.setenv(step.DIGEST_ENV, bad)
        with pytest.raises(ConfigError, match="64 lowercase hex"):
            step.image_identity(spec)
    monkeypatch.setenv(step.IMAGE_ENV, "registry.example/replayjob@sha256:" + "f" * 64)
    monkeypatch.setenv(step.DIGEST_ENV, digest)
    with pytest.raises(ContractError, match="contradicts the digest"):
        step.image_identity(spec)


def test_the_run_record_keeps_the_environment_and_names_an_unwritable_runs_directory(
        spec_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_spec(spec_file)
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "2")
    layout = step.Layout.of(tmp_path / "runs" / "unit" / "r1")
    step.check_run_record(layout, spec)
    env = json.loads((layout.run / step.RUN_RECORD).read_text(encoding="utf-8"))["environment"]
    assert {k: env[k] for k in DETERMINISM_ENV} == dict(DETERMINISM_ENV)
    assert (env["NCCL_ALGO"], env["NCCL_MAX_NCHANNELS"], env["NCCL_NVLS_ENABLE"]) == ("Ring", "2", None)

    def denied(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(RefusedError, match="cannot create the run directory") as info:
        step.check_run_record(step.Layout.of(tmp_path / "runs" / "unit" / "r2"), spec)
    assert "uid 10001" in (info.value.hint or "") and str(tmp_path / "runs") in (info.value.hint or "")


def test_prune_deletes_only_runs_idle_for_longer_than_asked(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    old, fresh, busy = runs / "a" / "old", runs / "a" / "fresh", runs / "b" / "busy"
    for run in (old, fresh, busy):
        (run / "replays" / "x" / "0").mkdir(parents=True)
        (run / step.RUN_RECORD).write_text("{}")
    (runs / "not-a-run").mkdir()
    day = 86400.0
    for path in [*old.rglob("*"), old, *busy.rglob("*"), busy]:
        os.utime(path, (time.time() - 40 * day, time.time() - 40 * day))
    os.utime(busy / "replays" / "x" / "0", None)  # a replay still writing, deep inside an old run
    assert main(["step", "prune", "--run-root", str(runs), "--older-than", "30", "--dry-run"]) == 0
    assert "would delete" in capsys.readouterr().out and old.exists()
    assert main(["step", "prune", "--run-root", str(runs), "--older-than", "30"]) == 0
    assert "1 of 3 run(s) deleted" in capsys.readouterr().out
    assert not old.exists() and fresh.exists() and busy.exists() and (runs / "not-a-run").exists()
    assert main(["step", "prune", "--run-root", str(runs), "--older-than", "0"]) == 2
    assert main(["step", "prune", "--run-root", str(tmp_path / "none"), "--older-than", "1"]) == 2


def test_a_spec_differing_in_render_time_fields_is_refused(spec_file: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An Argo spec parameter or an edited ConfigMap may change arms' knobs and config, not what the
    manifests were computed from: each such field is named, before any work."""
    spec = load_spec(spec_file)
    step.check_rendered(spec)  # not launched from manifests: nothing to compare
    monkeypatch.setenv("REPLAYJOB_RENDERED", json.dumps(spec.render_fields()))
    step.check_rendered(spec)
    step.check_rendered(dataclasses.replace(spec, seed=9, arms=(Arm("x"), Arm("y", {"training.micro_batch_size": 1}))))
    other = dataclasses.replace(spec, parallelism=8, cpu="2", claim_name="other", repeats=3, node_gpus=2)
    with pytest.raises(ContractError) as info:
        step.check_rendered(other)
    for needle in ('claim_name = "replayjob-artifacts" rendered, "other" here', 'cpu = "8" rendered, "2" here',
                   "node_gpus = 0 rendered, 2 here", "parallelism = 4 rendered, 8 here",
                   'replays = {"1": 4} rendered, {"1": 6} here'):
        assert needle in info.value.message
    run = tmp_path / "run"
    assert main(["step", "capture", "--spec", str(spec_file), "--run-dir", str(run), "--repeats", "3"]) == 2
    assert "fields fixed at render time" in capsys.readouterr().err and not run.exists()
    monkeypatch.setenv("REPLAYJOB_RENDERED", "[1]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        step.check_rendered(spec)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"optimizer/logical_batch_sha256": "A" * 64}, "optimizer/logical_batch_sha256"),
    ({"optimizer_batch/manifest_sha256": None}, "optimizer_batch/manifest_sha256"),
    ({"optimizer_batch/manifest_path": "../elsewhere.json"}, "not a bare file name"),
])
def test_pins_are_read_strictly(tmp_path: Path, overrides: dict[str, object], message: str) -> None:
    source = fake_capture(tmp_path, **overrides)
    with pytest.raises(IntegrityError, match=message):
        step.read_pins(source)


def test_duplicate_keys_in_the_capture_metrics_are_refused(tmp_path: Path) -> None:
    source = fake_capture(tmp_path)
    text = (source / "metrics.json").read_text(encoding="utf-8")
    (source / "metrics.json").write_text(text.replace("{", '{"optimizer/logical_batch_sha256": "x",', 1),
                                         encoding="utf-8")
    with pytest.raises(RefusedError, match="duplicate"):
        step.read_pins(source)


def test_replay_refuses_before_any_work(spec_file: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    base = ["step", "replay", "--spec", str(spec_file), "--run-dir", str(run)]
    assert main([*base, "--index", "0"]) == 2  # no capture yet
    assert "the capture is not complete" in capsys.readouterr().err
    fake_capture(run)
    assert main([*base, "--index", "4"]) == 2
    assert "index 4 is outside 0..3" in capsys.readouterr().err
    assert main([*base, "--index", "0", "--pins", f"{'c' * 64},{MANIFEST}"]) == 2
    assert "differ from the capture's metrics.json" in capsys.readouterr().err
    assert main([*base, "--index", "0", "--pins", "nonsense"]) == 2
    assert "--pins expects LOGICAL,MANIFEST" in capsys.readouterr().err
    assert main([*base, "--index", "0", "--plant", "nope:a.b=1"]) == 2
    assert "no arm named 'nope'" in capsys.readouterr().err
    assert main([*base, "--index", "0", "--plant", "ckpt-on"]) == 2
    assert "--plant expects ARM:SETTING=VALUE" in capsys.readouterr().err
    assert not (run / "replays").exists()


def test_replay_arguments_declare_the_arm_and_carry_the_pins(spec_file: Path, tmp_path: Path) -> None:
    spec = load_spec(spec_file)
    layout = step.Layout.of(tmp_path)
    args = step.replay_args(spec, layout, spec.run_for_index(3), LOGICAL, MANIFEST, tmp_path / "m.json",
                            ["training.seed=7"])
    assert args[:3] == ['backend.devices="cpu"', "backend.options.gradient_checkpointing=true", "training.seed=7"]
    assert f'optimizer_batch.expected_logical_sha256="{LOGICAL}"' in args
    assert 'optimizer_batch.arm="ckpt-on"' in args
    assert args[-1] == 'optimizer_batch.allow_config_differences=["backend.options.gradient_checkpointing"]'
    assert layout.replay("ckpt-on", 1) == tmp_path.absolute() / "replays" / "ckpt-on" / "1"


def test_a_partial_output_is_moved_aside_never_deleted(tmp_path: Path) -> None:
    layout = step.Layout.of(tmp_path)
    partial = layout.replay("ckpt-off", 0)
    partial.mkdir(parents=True)
    (partial / "half-written").write_text("x", encoding="utf-8")
    lines: list[str] = []
    step._set_aside(partial, layout, lines.append)
    assert not partial.exists()
    (aside,) = (tmp_path / "attempts").iterdir()
    assert aside.name.startswith("replays-ckpt-off-0.") and (aside / "half-written").read_text() == "x"
    assert "moved a previous attempt's partial output" in lines[0]


def test_a_contradicting_determinism_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with pytest.raises(ConfigError, match="contradicts the pinned determinism environment"):
        step.ensure_determinism_env([], reexec=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
    step.ensure_determinism_env([], reexec=False)  # in process: set before torch is imported
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == DETERMINISM_ENV["CUBLAS_WORKSPACE_CONFIG"]
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"


def test_reduce_always_writes_a_verdict_naming_the_missing_evidence(
        spec_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    """Evidence a stage did not produce (it failed, was evicted, never ran) decides nothing: the verdict
    is incomplete (exit 3, retryable), naming what is missing, never a refusal of the user's input (2)."""
    assert main(["step", "reduce", "--spec", str(spec_file), "--run-dir", str(run)]) == 3
    out = capsys.readouterr()
    assert "4 replay(s) left no replay_metrics.json" in out.out and "nothing decided: 5 stage output(s)" in out.err
    verdict = json.loads((run / "verdict.json").read_text(encoding="utf-8"))
    assert (verdict["status"], verdict["exit_code"]) == ("incomplete", 3)
    assert verdict["missing"] == ["replays/ckpt-off/0", "replays/ckpt-off/1", "replays/ckpt-on/0",
                                  "replays/ckpt-on/1", "source"]
    assert verdict["parameters"]["arms"] == ["ckpt-off", "ckpt-on"]
    assert sorted(verdict["parameters"]["spec"]["arms"]) == ["ckpt-off", "ckpt-on"]  # the spec reached reduce


@pytest.mark.parametrize("blocks", ["0", "3", "x"])
def test_reduce_refuses_blocks_outside_the_selection(spec_file: Path, tmp_path: Path, blocks: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["step", "reduce", "--spec", str(spec_file), "--run-dir", str(run), "--blocks", blocks]) == 2
    assert "--blocks" in capsys.readouterr().err and not (run / "verdict.json").exists()


def test_selection_errors_are_usage_errors(spec_file: Path) -> None:
    with pytest.raises(UsageError, match="names no arm"):
        step.select(load_spec(spec_file), arms=",")


# --- the reducer's hardware check --------------------------------------------------------------

def _evidence(root: Path, gpu_of: dict[int, str]) -> synthetic.Evidence:
    ev = synthetic.build(root, {"off": {}}, 3)
    for i, path in enumerate(ev.replay_files):
        doc = json.loads(path.read_text(encoding="utf-8"))
        doc["host"].update(device_type="cuda", gpu_product=gpu_of.get(i, "NVIDIA H100 80GB HBM3"),
                           driver_version="580.65.06", cuda_version="13.0")
        doc.update(device="cuda:0")  # the device told as the host tells it (the reader refuses a contradiction)
        doc["memory"]["kind"] = "cuda_max_allocated"
        assert doc.get("contention") is None
        path.write_bytes(pretty_bytes(doc))
    return ev


@pytest.mark.parametrize("declared", [False, True])
def test_mixed_hardware_is_refused_unless_declared(tmp_path: Path, declared: bool) -> None:
    ev = _evidence(tmp_path, {2: "NVIDIA H200"})
    verdict = reduce_evidence(Request(paths=[str(tmp_path / "replays")], claim="exact-input",
                                      out=tmp_path / "verdict.json", source=ev.source, mixed_hardware=declared))
    check = next(c for c in verdict.doc["checks"] if c["name"] == "inputs.same_hardware")
    assert check["offenders"] == ["off#2"]
    assert check["status"] == ("not_applicable" if declared else "refused")
    assert (verdict.doc["status"] == "refused") is not declared


def test_same_hardware_passes_and_a_malformed_host_is_refused(tmp_path: Path) -> None:
    ev = _evidence(tmp_path, {})
    req = Request(paths=[str(tmp_path / "replays")], claim="exact-input", out=tmp_path / "v.json", source=ev.source)
    check = next(c for c in reduce_evidence(req).doc["checks"] if c["name"] == "inputs.same_hardware")
    assert check["status"] == "pass" and check["expected"]["gpu_product"] == "NVIDIA H100 80GB HBM3"
    doc = json.loads(ev.replay_files[0].read_text(encoding="utf-8"))
    doc["host"]["driver_version"] = 580
    ev.replay_files[0].write_bytes(pretty_bytes(doc))
    verdict = reduce_evidence(req)
    assert verdict.doc["status"] == "refused" and "host.driver_version" in json.dumps(verdict.doc["refusal"])


# ---- a paired schedule and budgets in the spec ---------------------------------------------------

def test_a_paired_schedule_maps_indices_to_blocks_and_slots(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.artifacts.schedule import plan

    budgets = tmp_path / "budgets.toml"
    budgets.write_text('[ckpt-on]\nlocal_train_wall_s = { max_ratio = 2.0 }\n', encoding="utf-8")
    path = tmp_path / "paired.toml"
    path.write_text(SPEC.replace('repeats = 2\n', f'repeats = 2\nseed = 9\nschedule = "abba"\nbudgets = "{budgets}"\n'),
                    encoding="utf-8")
    spec = load_spec(path)
    runs = spec.runs()
    # the schedule's run order, block by block; the repeat is the block and each run carries its slot
    assert [(r.arm, r.slot) for r in runs] == plan(["ckpt-off", "ckpt-on"], 2, "abba", seed=9)
    assert [r.repeat for r in runs] == [0, 0, 1, 1]
    assert sorted((r.arm, r.repeat) for r in runs) == [("ckpt-off", 0), ("ckpt-off", 1), ("ckpt-on", 0), ("ckpt-on", 1)]
    assert main(["step", "plan", "--spec", str(path)]) == 0
    assert "schedule=abba" in capsys.readouterr().out.splitlines()
    sets = step.replay_args(spec, step.Layout.of(tmp_path / "run"), runs[0], LOGICAL, MANIFEST, tmp_path / "m.json")
    from replayjob.digest import sha256_file

    assert f'optimizer_batch.budgets_sha256="{sha256_file(budgets)}"' in sets


@pytest.mark.parametrize("extra, needle", [
    ('schedule = "zigzag"\n', "not a schedule design"),
    ('budgets = "b.toml"\n', "set schedule too"),
])
def test_schedule_and_budget_keys_are_checked(tmp_path: Path, extra: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(SPEC.replace('repeats = 2\n', 'repeats = 2\n' + extra), encoding="utf-8")
    with pytest.raises(ConfigError, match=needle):
        load_spec(path)


# --- ranks: what the launcher provisioned, checked against the spec ---------------------------------

def ranked_spec() -> AblationSpec:
    """Capture on 2 ranks; arms of 2 (the capture's), 1 and 4 ranks (built directly: an arm's
    ``distributed.world_size`` is checked by the dataclass)."""
    spec = load_spec_text_of(SPEC)
    return dataclasses.replace(spec, ranks=2, config={"distributed.strategy": "ddp"}, arms=(
        Arm("two"), Arm("one", {"distributed.world_size": 1}), Arm("four", {"distributed.world_size": 4})))


def load_spec_text_of(text: str) -> AblationSpec:
    import tomllib

    return spec_from_dict(tomllib.loads(text))


def test_the_index_of_a_position_among_its_rank_count() -> None:
    spec = ranked_spec()  # indexes: two 0-1, one 2-3, four 4-5
    assert [step.resolve_index(spec, None, k, 1) for k in (0, 1)] == [2, 3]
    assert [step.resolve_index(spec, None, k, 4) for k in (0, 1)] == [4, 5]
    assert step.resolve_index(spec, 4, None, 4) == step.resolve_index(spec, 4, None, None) == 4
    with pytest.raises(ContractError, match=r"index 4 \(arm four\) runs 4 rank\(s\) by the spec, but the "
                                            r"launcher provisioned 2"):
        step.resolve_index(spec, 4, None, 2)
    with pytest.raises(ContractError, match=r"no replay of this spec runs 3 rank\(s\); its replays run 1, 2, 4"):
        step.resolve_index(spec, None, 0, 3)
    with pytest.raises(UsageError, match=r"--position 2 is outside 0\.\.1"):
        step.resolve_index(spec, None, 2, 1)
    with pytest.raises(UsageError, match="give --ranks"):
        step.resolve_index(spec, None, 0, None)
    with pytest.raises(ConfigError, match="outside"):
        step.resolve_index(spec, 6, None, None)


def test_plan_names_the_capture_s_ranks_and_each_rank_count_s_indexes() -> None:
    assert step.plan_lines(ranked_spec())[-4:] == ["ranks=2", "replays=1:2-3", "replays=2:0-1", "replays=4:4-5"]
    paired = dataclasses.replace(ranked_spec(), schedule="abba", repeats=3)
    groups = {int(k): v for k, v in (ln.removeprefix("replays=").split(":") for ln in step.plan_lines(paired)
                                     if ln.startswith("replays="))}
    assert {n: step.index_ranges(ix) for n, ix in paired.rank_groups().items()} == groups
    assert [step.index_ranges(x) for x in ([0], [0, 1, 2, 5], [1, 3, 4, 5, 7])] == ["0", "0-2,5", "1,3-5,7"]


def test_a_launcher_provisioning_other_ranks_is_refused_before_any_work(
        spec_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    base = ["--spec", str(spec_file), "--run-dir", str(run)]
    assert main(["step", "capture", *base, "--ranks", "2"]) == 2
    assert "the capture runs 1 rank(s) by the spec, but the launcher provisioned 2" in capsys.readouterr().err
    assert main(["step", "capture", *base, "--launcher", "mpirun"]) == 2
    assert "--launcher 'mpirun' is not a launcher; use one of: torchrun, srun" in capsys.readouterr().err
    assert not run.exists()  # refused before the run record, the workspace or the capture
    fake_capture(run)
    assert main(["step", "replay", *base, "--index", "1", "--ranks", "4"]) == 2
    assert "index 1 (arm ckpt-off) runs 1 rank(s) by the spec, but the launcher provisioned 4" in \
        capsys.readouterr().err
    assert main(["step", "replay", *base, "--position", "0", "--ranks", "2"]) == 2
    assert "no replay of this spec runs 2 rank(s); its replays run 1" in capsys.readouterr().err
    assert main(["step", "replay", *base, "--position", "0"]) == 2  # docopt: --position needs --ranks
    assert main(["step", "replay", *base, "--index", "0", "--launcher", "x"]) == 2
    assert "not a launcher" in capsys.readouterr().err
    assert not (run / "replays").exists()


def test_capture_outputs_name_each_rank_count_s_plan(tmp_path: Path) -> None:
    spec = ranked_spec()
    layout = step.Layout.of(tmp_path / "run", source=fake_capture(tmp_path / "run"))
    (layout.workspace).mkdir(parents=True)
    (layout.workspace / "replay.toml").write_text("")
    out = tmp_path / "outputs"
    out.mkdir()
    step.capture_step(spec, layout, out, log=lambda s: None, ranks=2)
    assert json.loads((out / step.plan_file()).read_text()) == list(range(spec.size))
    assert {p.name: json.loads(p.read_text()) for p in sorted(out.glob("plan-r*.json"))} == {
        "plan-r1.json": [2, 3], "plan-r2.json": [0, 1], "plan-r4.json": [4, 5]}


def test_a_step_stopped_by_sigterm_exits_3_without_a_traceback(tmp_path: Path) -> None:
    """Preemption, eviction or scancel while a real `step reduce` waits for its replays: exit 3 (retryable)."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    proc = subprocess.Popen([sys.executable, "-m", "replayjob", "step", "reduce", "--spec",
                             str(REPO / "examples" / "ablation.toml"), "--run-dir", str(tmp_path / "run"),
                             "--wait-s", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once it is waiting
        assert "waiting up to 120 s" in line, line
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 3, out + err
    assert "terminated by signal 15" in err and "Traceback" not in err


SWALLOWING_STEP = """
import os, signal, sys, time
from replayjob import cli
from replayjob.commands import launch as deploy

def step_inside_a_library_that_catches_everything(args):
    try:  # an import probe or a retry loop in a library: SIGTERM arrives in here
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except Exception:
        pass
    return 0

deploy._step = step_inside_a_library_that_catches_everything
sys.exit(cli.main(["step", "plan", "--spec", sys.argv[1]]))
"""


def test_sigterm_inside_a_library_s_except_exception_still_stops_the_step() -> None:
    """A requeued Slurm task whose first attempt ran on (the signal swallowed by an ``except Exception``)
    wrote the same replay as its second attempt; the signal must stop the step wherever it lands."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", SWALLOWING_STEP, str(REPO / "examples" / "ablation.toml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "terminated by signal 15" in proc.stderr and "Traceback" not in proc.stderr


def test_step_in_process_leaves_the_caller_s_sigterm_handler_as_it_was() -> None:
    import signal

    def mine(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        spec = Path(__file__).resolve().parents[1] / "examples" / "ablation.toml"
        assert main(["step", "plan", "--spec", str(spec)]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
