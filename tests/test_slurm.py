"""The Slurm path: scripts/slurm/ and ``replayjob step``, against a real scheduler.

Fast tests check the fan-out plan, the submit script's sbatch commands (``--dry-run``), its usage
errors, the container command it builds, and shellcheck.  The rest submit through a real
single-node Slurm cluster (``scripts/slurm/testing-cluster.sh``: munged, slurmctld and slurmd on
localhost).  Where no cluster can be started they are skipped with the reason, except in CI
(``CI=true``), where that is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from replayjob.artifacts.spec import DETERMINISM_ENV, load_spec
from replayjob.cli import main
from replayjob.errors import ReplayjobError
from replayjob.launch.step import select

SLURM = REPO / "scripts" / "slurm"
SUBMIT = SLURM / "submit.sh"
IN_CI = os.environ.get("CI", "").lower() == "true"
SPEC = """\
name = "slurm-test"
image = "replayjob:dev"
gpu_product = "none"
device = "cpu"
repeats = 3

[arms.ckpt-off]

[arms.ckpt-on]
"backend.options.gradient_checkpointing" = true
"""


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "ablation.toml"
    path.write_text(SPEC)
    return path


def _submit(*args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SUBMIT), *args], env=env, text=True, capture_output=True,
                          timeout=timeout)


# ---- the fan-out plan (replayjob step plan) ------------------------------------------------------

def test_plan_gives_the_submit_time_facts(spec_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.artifacts.spec import DETERMINISM_ENV

    assert main(["step", "plan", "--spec", str(spec_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x for x in lines if not x.startswith("env=")] == [
        "size=6", "parallelism=4", "cpus=1", "mem_mib=4096", "time_min=360", "node_gpus=0",
        "arms=ckpt-off,ckpt-on", "claim=exact-input", "min_repeats=3", "device=cpu",
        "schedule=none", "ranks=1", "replays=1:0-5"]
    # the environment every job of this spec pins (a built-in capture: the pinned math mode)
    assert [x for x in lines if x.startswith("env=")] == [f"env={k}={v}" for k, v in DETERMINISM_ENV.items()]
    assert main(["step", "plan", "--spec", str(spec_file), "--plant", "ckpt-off:training.micro_batch_size=2"]) == 0
    assert capsys.readouterr().out.startswith("size=6\n")  # a valid --plant is accepted, the plan unchanged
    spec = load_spec(spec_file)
    assert [(r.arm, r.repeat) for r in spec.runs()] == [
        ("ckpt-off", 0), ("ckpt-off", 1), ("ckpt-off", 2), ("ckpt-on", 0), ("ckpt-on", 1), ("ckpt-on", 2)]


def test_selection_keeps_file_order_and_lowers_min_repeats(spec_file: Path) -> None:
    spec = select(load_spec(spec_file), arms="ckpt-on,ckpt-off", repeats=2, device="cuda", claim="bitwise")
    assert [a.name for a in spec.arms] == ["ckpt-off", "ckpt-on"]
    assert (spec.size, spec.effective_min_repeats, spec.device, spec.claim) == (4, 2, "cuda", "bitwise")
    assert (spec.run_for_index(1).arm, spec.run_for_index(1).repeat) == ("ckpt-off", 1)
    assert select(spec, arms="ckpt-on").run_for_index(1).arm == "ckpt-on"


@pytest.mark.parametrize(("argv", "message"), [
    (["replay", "--spec", "{spec}", "--run-dir", "{run}", "--index", "6"], "outside 0..5"),
    (["plan", "--spec", "{spec}", "--arms", "nope"], "no arm named 'nope'"),
    (["plan", "--spec", "{spec}", "--arms", "ckpt-on,ckpt-on"], "names an arm twice"),
    (["plan", "--spec", "{spec}", "--repeats", "0"], "--repeats must be between 1 and"),
    (["plan", "--spec", "{spec}", "--device", "tpu"], "'tpu'"),
    (["plan", "--spec", "{spec}", "--claim", "vibes"], "'vibes' is not a claim"),
    (["plan", "--spec", "{spec}", "--plant", "ckpt-on"], "--plant expects ARM:SETTING=VALUE"),
    (["plan", "--spec", "{spec}", "--plant", "ckpt-on:Bad=1"], "--plant expects ARM:SETTING=VALUE"),
    (["plan", "--spec", "{spec}", "--plant", "nope:a.b=1"], "no arm named 'nope'"),
    (["plan", "--spec", "{spec}", "--arms", "ckpt-off", "--plant", "ckpt-on:a.b=1"], "no arm named 'ckpt-on'"),
])
def test_plan_refuses_bad_selections(spec_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     argv: list[str], message: str) -> None:
    assert main(["step", *[a.format(spec=spec_file, run=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_select_refuses_empty_arms(spec_file: Path) -> None:
    with pytest.raises(ReplayjobError, match="names no arm"):
        select(load_spec(spec_file), arms=" , ")


# ---- submit.sh without a scheduler -----------------------------------------------------------------

def test_help_lists_every_option() -> None:
    res = _submit("--help")
    assert res.returncode == 0, res.stderr
    for opt in ("--arms", "--repeats", "--out", "--claim", "--partition", "--gpus-per-task", "--wait",
                "--image", "--venv", "--spec", "--source", "--dry-run"):
        assert opt in res.stdout


def _dry_run(spec_file: Path, out: Path, *extra: str) -> list[str]:
    res = _submit("--out", str(out), "--spec", str(spec_file), "--dry-run", *extra)
    assert res.returncode == 0, res.stderr
    assert not out.exists(), "--dry-run must write nothing"
    return [ln for ln in res.stdout.splitlines() if ln.startswith("sbatch ")]


def test_dry_run_chains_three_jobs_with_gpu_requests(spec_file: Path, tmp_path: Path) -> None:
    capture, replay, reduce = _dry_run(spec_file, tmp_path / "run", "--partition", "gpu")
    assert all("--partition gpu" in cmd for cmd in (capture, replay, reduce))
    assert "--gres=gpu:1" in capture and "--requeue" in capture
    assert "--array 0-5%4" in replay and "--exclusive" in replay and "--gres=gpu:1" in replay
    assert all("--open-mode=append" in cmd for cmd in (capture, replay, reduce))
    assert "--dependency=afterok:CAPTURE_ID --kill-on-invalid-dep=yes" in replay
    assert "--requeue" in replay
    assert "--dependency=afterany:REPLAY_ID" in reduce and "--requeue" in reduce
    assert "gres" not in reduce and "--exclusive" not in reduce


def test_zero_gpus_drops_every_gpu_request(spec_file: Path, tmp_path: Path) -> None:
    cmds = _dry_run(spec_file, tmp_path / "run", "--gpus-per-task", "0", "--arms", "ckpt-on",
                    "--repeats", "2")
    assert len(cmds) == 3 and not any("--gres" in c or "--nv" in c for c in cmds)
    assert "--array 0-1%4" in cmds[1]
    two = _dry_run(spec_file, tmp_path / "run", "--gpus-per-task", "2")
    assert "--gres=gpu:2" in two[0] and "--gres=gpu:2" in two[1]


@pytest.mark.parametrize(("args", "message"), [
    ([], "--out DIR is required"),
    (["--out", "x", "--gpus-per-task", "-1"], "--gpus-per-task expects an integer"),
    (["--out", "x", "--repeats", "0"], "--repeats expects an integer >= 1"),
    (["--out", "x", "--plant", "nope:a.b=1"], "no arm named 'nope'"),
    (["--out", "x", "--plant", "ckpt-on"], "--plant expects ARM:SETTING=VALUE"),
    (["--out", "x", "--source", "/nonexistent"], "--source needs --workspace"),
    (["--out", "x", "--image", "/nonexistent.sif"], "no such file"),
    (["--out", "x", "--bogus"], "unknown option '--bogus'"),
])
def test_submit_refuses_bad_usage(spec_file: Path, args: list[str], message: str) -> None:
    res = _submit("--spec", str(spec_file), "--dry-run", *args)
    assert res.returncode == 2
    assert message in res.stderr


def test_container_command_keeps_gpu_visibility_under_cleanenv(tmp_path: Path) -> None:
    """The apptainer/singularity command lib.sh builds (no runtime runs; the argv is printed):
    --cleanenv drops the host environment, so the GPUs Slurm allocated, the Slurm ids and the thread
    counts are passed on explicitly; a .sif file is identified by its SHA-256, computed by the job
    (a missing file, as a docker:// reference, gets none: the step refuses it unless the spec is local)."""
    sif = tmp_path / "replayjob.sif"
    sif.write_bytes(b"stand-in image\n")
    digest = "sha256:" + hashlib.sha256(sif.read_bytes()).hexdigest()
    script = f"""
set -euo pipefail
. {SLURM / 'lib.sh'}
REPLAYJOB_IMAGE={sif} REPLAYJOB_CONTAINER=apptainer REPLAYJOB_OUT=/shared/run
REPLAYJOB_GPUS=1 REPLAYJOB_BINDS=(/models)
CUDA_VISIBLE_DEVICES=2 SLURM_JOB_ID=77 SLURM_CPUS_PER_TASK=8
replayjob_cmd
echo "${{REPLAYJOB[*]}}"
REPLAYJOB_GPUS=0
unset CUDA_VISIBLE_DEVICES SLURM_CPUS_PER_TASK
replayjob_cmd
echo "${{REPLAYJOB[*]}}"
"""
    lines = subprocess.run(["bash", "-c", script], text=True, capture_output=True,
                           check=True).stdout.splitlines()
    assert lines == [
        "apptainer exec --cleanenv --bind /shared/run --bind /models --nv --env CUDA_VISIBLE_DEVICES=2 "
        f"--env SLURM_JOB_ID=77 --env REPLAYJOB_IMAGE_REF={sif} --env REPLAYJOB_IMAGE_DIGEST={digest} "
        f"--env OMP_NUM_THREADS=8 --env MKL_NUM_THREADS=8 {sif} replayjob",
        "apptainer exec --cleanenv --bind /shared/run --bind /models --env SLURM_JOB_ID=77 "
        f"--env REPLAYJOB_IMAGE_REF={sif} --env REPLAYJOB_IMAGE_DIGEST={digest} {sif} replayjob"]
    sif.write_bytes(b"another image\n")  # the same path, other bytes: another identity
    again = subprocess.run(["bash", "-c", script], text=True, capture_output=True, check=True).stdout
    assert digest not in again and "REPLAYJOB_IMAGE_DIGEST=sha256:" in again


def _stand_in_container(tmp_path: Path, log: Path | None = None) -> tuple[Path, Path]:
    """A stand-in image file and container runtime (no apptainer exists here): the runtime appends its argv to
    ``log`` when given and runs the command after the image from the virtual environment."""
    image, runtime = tmp_path / "replayjob.sif", tmp_path / "apptainer"
    image.write_text("stand-in image\n")
    record = f'echo "$*" >>{log}\n' if log is not None else ""
    runtime.write_text(f"""#!/usr/bin/env bash
set -euo pipefail
{record}while [ "$1" != {image} ]; do shift; done
shift
cmd=$1
shift
exec {REPO / '.venv' / 'bin'}/"$cmd" "$@"
""")
    runtime.chmod(0o755)
    return image, runtime


def test_image_mode_runs_the_plan_through_the_container(spec_file: Path, tmp_path: Path) -> None:
    """--image: submit.sh asks for the plan through the container runtime.  No apptainer exists
    here, so a stand-in runtime records its argv and runs the command after the image from the
    virtual environment."""
    log = tmp_path / "argv.txt"
    image, runtime = _stand_in_container(tmp_path, log)
    out = tmp_path / "run"
    res = _submit("--out", str(out), "--spec", str(spec_file), "--image", str(image), "--container",
                  str(runtime), "--gpus-per-task", "0", "--bind", "/models", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "# plan: 6 replays" in res.stdout
    assert log.read_text().splitlines() == [
        f"exec --cleanenv --bind {out} --bind /models --bind {spec_file.parent} "
        f"--env REPLAYJOB_IMAGE_REF={image} --env REPLAYJOB_IMAGE_DIGEST=sha256:"
        f"{hashlib.sha256(image.read_bytes()).hexdigest()} {image} replayjob step plan --spec {spec_file} --device cpu"]


def test_scripts_are_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        reason = "shellcheck is not installed (apt-get install shellcheck)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    scripts = sorted(str(p.relative_to(REPO)) for p in SLURM.iterdir() if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) == 6  # lib.sh, submit.sh, testing-cluster.sh and three job scripts
    res = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, text=True, capture_output=True)
    assert res.returncode == 0, res.stdout
    for name in scripts:
        assert "set -euo pipefail" in (REPO / name).read_text() or name.endswith("lib.sh")


# ---- a real single-node cluster ----------------------------------------------------------------

def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI needs a Slurm cluster: {reason}")
    pytest.skip(reason)


def _ping(env: dict[str, str]) -> bool:
    try:
        res = subprocess.run(["scontrol", "ping"], env=env, text=True, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0 and "UP" in res.stdout


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment for talking to a running cluster: SLURM_CONF from the caller (.ci/run), or one
    started here and stopped afterwards.  The determinism variables are removed so the jobs must
    pin them themselves."""
    env = {k: v for k, v in os.environ.items() if k not in DETERMINISM_ENV}
    env["REPLAYJOB_SLURM_POLL_S"] = "1"
    if shutil.which("scontrol") is None or shutil.which("sbatch") is None:
        _unavailable("Slurm client tools are not installed (apt-get install slurm-wlm munge)")
    if env.get("SLURM_CONF") and _ping(env):
        yield env
        return
    running = Path(env.get("REPLAYJOB_SLURM_DIR") or Path(env.get("TMPDIR", "/tmp")) / "replayjob-slurm")
    if (running / "slurm.conf").is_file() and _ping({**env, "SLURM_CONF": str(running / "slurm.conf")}):
        yield {**env, "SLURM_CONF": str(running / "slurm.conf")}  # testing-cluster.sh start, by hand
        return
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        _unavailable("slurmctld/munged are not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        _unavailable("the test cluster runs its daemons as root (SlurmUser=root)")
    env["REPLAYJOB_SLURM_DIR"] = str(tmp_path_factory.mktemp("slurm"))
    t0 = time.perf_counter()
    res = subprocess.run(["bash", str(SLURM / "testing-cluster.sh"), "start"], env=env, text=True,
                         capture_output=True, timeout=120)
    if res.returncode != 0:
        _unavailable(f"slurmctld could not be started: {res.stderr.strip()[-800:]}")
    print(f"test cluster up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    env["SLURM_CONF"] = res.stdout.strip().removeprefix("export SLURM_CONF=")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SLURM / "testing-cluster.sh"), "stop"], env=env, text=True,
                       capture_output=True, timeout=120)


def _job_record(job: str, env: dict[str, str]) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job], env=env, text=True,
                          capture_output=True, check=True).stdout


def test_trivial_job_exit_code_through_the_scheduler(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """sbatch --wait returns the job's exit code, and a job exiting 2 is not requeued."""
    res = subprocess.run(["sbatch", "--wait", "--parsable", "--requeue", "--chdir", str(tmp_path),
                          "--output", str(tmp_path / "job-%j.out"), "--wrap", "echo ran on $(hostname); exit 2"],
                         env=slurm_env, text=True, capture_output=True, timeout=120)
    assert res.returncode == 2, res.stderr
    job = res.stdout.strip().split(";")[0]
    record = _job_record(job, slurm_env)
    assert "JobState=FAILED" in record and "ExitCode=2:0" in record and "Restarts=0" in record
    assert (tmp_path / f"job-{job}.out").read_text().startswith("ran on ")


@pytest.mark.slow
def test_failed_capture_cancels_the_array_and_ends_incomplete(slurm_env: dict[str, str], spec_file: Path,
                                                               tmp_path: Path) -> None:
    """afterok + --kill-on-invalid-dep: no replay runs without a capture; reduce still judges: nothing was
    decided (incomplete, exit 3), and the reduce job is not requeued for it."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "source.toml").write_text("[training]\nnot_a_setting = 1\n")
    (ws / "replay.toml").write_text("")
    out = tmp_path / "run"
    res = _submit("--out", str(out), "--spec", str(spec_file), "--gpus-per-task", "0",
                  "--workspace", str(ws), "--wait", env=slurm_env, timeout=300)
    assert res.returncode == 3, res.stdout + res.stderr
    jobs = dict(line.split("=") for line in (out / "slurm" / "jobs").read_text().split())
    assert "JobState=FAILED" in _job_record(jobs["capture"], slurm_env)
    assert "Restarts=0" in _job_record(jobs["reduce"], slurm_env)
    replays = _job_record(jobs["replay"], slurm_env)
    assert "JobState=CANCELLED" in replays and "JobState=RUNNING" not in replays
    assert not list((out / "replays").rglob("replay_metrics.json"))
    assert _json(out / "verdict.json")["status"] == "incomplete"


# ---- the whole chain through the scheduler (tiny default, CPU, no GPU requests) ----------------------

def _json(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def chain(slurm_env: dict[str, str], spec_file: Path,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One full chain, shared by the tests below: capture, 2 arms x 2 repeats (``--repeats 2``: the
    spec's 3 would add two more replays, which run one at a time on the exclusive node), reduce, --wait."""
    out = tmp_path_factory.mktemp("chain") / "run"
    t0 = time.perf_counter()
    res = _submit("--out", str(out), "--spec", str(spec_file), "--gpus-per-task", "0", "--repeats", "2", "--wait",
                  env=slurm_env, timeout=900)
    print(f"chain of 6 jobs through Slurm in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return res, out


@pytest.mark.slow
def test_chain_passes_and_gates_on_the_verdict(chain: tuple[subprocess.CompletedProcess[str], Path],
                                               slurm_env: dict[str, str]) -> None:
    res, out = chain
    assert res.returncode == 0, res.stdout + res.stderr
    verdict = _json(out / "verdict.json")
    assert (verdict["status"], verdict["exit_code"], verdict["claim"]) == ("pass", 0, "exact-input")
    jobs = dict(line.split("=") for line in (out / "slurm" / "jobs").read_text().split())
    assert "ExitCode=0:0" in _job_record(jobs["reduce"], slurm_env)
    arms: dict[str, list[int]] = {}
    for i in range(4):
        m = _json(out / "replays" / ("ckpt-off", "ckpt-on")[i // 2] / str(i % 2) / "replay_metrics.json")
        arms.setdefault(m["arm"], []).append(m["repeat_index"])
        assert m["host"]["slurm_job"] and m["host"]["node"]
        # Pinned by the job itself: the test removed these variables from the submit environment.
        assert m["provenance"]["nvidia_tf32_override"] == "0"
        assert m["provenance"]["pythonhashseed"] == "0"
    assert arms == {"ckpt-off": [0, 1], "ckpt-on": [0, 1]}
    assert "reduce exited 0" in res.stdout


@pytest.mark.slow
def test_planted_undeclared_difference_fails_the_gate(
        chain: tuple[subprocess.CompletedProcess[str], Path], spec_file: Path,
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A negative control: one arm replays with an undeclared knob change; --wait must not pass."""
    _, first = chain
    out = tmp_path / "planted"
    res = _submit("--out", str(out), "--spec", str(spec_file), "--gpus-per-task", "0", "--repeats", "1",
                  "--workspace", str(first / "workspace"), "--source", str(first / "source"),
                  "--plant", "ckpt-off:backend.options.gradient_checkpointing=true", "--wait",
                  env=slurm_env, timeout=600)
    assert res.returncode == 2, res.stdout + res.stderr
    verdict = _json(out / "verdict.json")
    assert (verdict["status"], verdict["exit_code"]) == ("refused", 2)
    # The replay refused the undeclared difference before any update; its evidence is missing, and
    # the verdict names that arm: the reducer was told every arm of the plan.
    expected_arms = next(c for c in verdict["checks"] if c["name"] == "inputs.expected_arms")
    assert (expected_arms["status"], expected_arms["offenders"]) == ("refused", ["ckpt-off"])
    assert "left no replay_metrics.json: replays/ckpt-off/0" in next((out / "logs").glob("reduce-*.out")).read_text()
    log = next((out / "logs").glob("replay-*_0.out")).read_text()
    assert "undeclared difference 'backend.options.gradient_checkpointing'" in log
    assert (out / "replays" / "ckpt-on" / "0" / "replay_metrics.json").is_file()


def _wait_for_text(path: Path, text: str, deadline: float) -> None:
    while not (path.is_file() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path} never showed {text!r}"
        time.sleep(0.2)


def _release(task: str, env: dict[str, str], deadline: float) -> None:
    """A requeued job waits about two minutes before it is eligible again; once it is back in the
    queue (the requeue completes asynchronously), make it eligible sooner.  slurmd refuses a job
    credential issued within the second its predecessor's was revoked, hence the short pause."""
    while not all(f in _job_record(task, env) for f in ("JobState=PENDING", "Restarts=1")):
        assert time.monotonic() < deadline, f"{task} was never requeued"
        time.sleep(0.2)
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], env=env, check=True)


@pytest.mark.slow
def test_cancelled_replay_refuses_and_requeued_replay_reruns(
        chain: tuple[subprocess.CompletedProcess[str], Path], spec_file: Path,
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """One array of two replays, sharing the scheduler time of two checks: task 0 is cancelled
    mid-run (the verdict must be incomplete, exit 3: fewer repeats than asked, never a pass); task 1 is requeued
    mid-run as after a node failure (it must rerun to completion as restart 1)."""
    _, first = chain
    out = tmp_path / "cancelled"
    jobs_file = out / "slurm" / "jobs"
    proc = subprocess.Popen(
        ["bash", str(SUBMIT), "--out", str(out), "--spec", str(spec_file), "--gpus-per-task", "0",
         "--arms", "ckpt-off", "--repeats", "2", "--workspace", str(first / "workspace"),
         "--source", str(first / "source"), "--wait"],
        env=slurm_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while not jobs_file.is_file():
            assert time.monotonic() < deadline and proc.poll() is None, "submission did not happen"
            time.sleep(0.2)
        array = dict(line.split("=") for line in jobs_file.read_text().split())["replay"]
        _wait_for_text(out / "logs" / f"replay-{array}_0.out", "is arm ckpt-off", deadline)
        time.sleep(1)  # the replay process is running now
        assert not (out / "replays" / "ckpt-off" / "0" / "replay_metrics.json").exists()
        subprocess.run(["scancel", f"{array}_0"], env=slurm_env, check=True)
        _wait_for_text(out / "logs" / f"replay-{array}_1.out", "is arm ckpt-off", deadline)
        subprocess.run(["scontrol", "requeue", f"{array}_1"], env=slurm_env, check=True)
        _release(f"{array}_1", slurm_env, deadline)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        if jobs_file.is_file():  # leave nothing queued behind a failed assertion
            ids = [v for v in (line.split("=")[1] for line in jobs_file.read_text().split()) if v]
            subprocess.run(["scancel", *ids], env=slurm_env, capture_output=True)
    assert proc.returncode == 3, output  # a replay's stage never finished: nothing was decided
    assert "JobState=CANCELLED" in _job_record(f"{array}_0", slurm_env)
    rerun = _job_record(f"{array}_1", slurm_env)
    assert "JobState=COMPLETED" in rerun and "Restarts=1" in rerun
    log = (out / "logs" / f"replay-{array}_1.out").read_text()
    assert "restart 0" in log and "restart 1" in log  # --open-mode=append keeps both attempts
    assert (out / "replays" / "ckpt-off" / "1" / "replay_metrics.json").is_file()
    verdict = _json(out / "verdict.json")
    assert (verdict["status"], verdict["missing"]) == ("incomplete", ["replays/ckpt-off/0"])
    assert "Restarts=0" in _job_record(dict(line.split("=") for line in jobs_file.read_text().split())["reduce"],
                                       slurm_env)  # a written verdict is not reduced again
    repeats = next(c for c in verdict["checks"] if c["name"] == "inputs.min_repeats")
    assert (repeats["status"], repeats["expected"], repeats["observed"]) == ("refused", 2, {"ckpt-off": 1})


@pytest.mark.slow
def test_exit_3_requeues_the_job_and_the_last_attempt_keeps_3(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """lib.sh finish_step: exit 3 (an error, nothing decided) requeues the job itself (same job id),
    until REPLAYJOB_MAX_RESTARTS; then the job ends with 3.  1 and 2 are never requeued (see
    test_trivial_job_exit_code_through_the_scheduler)."""
    def job(max_restarts: int) -> str:
        script = tmp_path / f"job-{max_restarts}.sh"
        script.write_text(f"""#!/usr/bin/env bash
set -euo pipefail
. {SLURM / 'lib.sh'}
export REPLAYJOB_MAX_RESTARTS={max_restarts}
echo "attempt ${{SLURM_RESTART_COUNT:-0}}"
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then finish_step 3; fi
finish_step 0
""")
        res = subprocess.run(["sbatch", "--parsable", "--requeue", "--open-mode=append", "--chdir", str(tmp_path),
                              "--output", str(tmp_path / "job-%j.out"), str(script)],
                             env=slurm_env, text=True, capture_output=True, timeout=60, check=True)
        return res.stdout.strip().split(";")[0]

    final, retried = job(0), job(1)
    deadline = time.monotonic() + 300
    _release(retried, slurm_env, deadline)
    for jid, state in ((final, "JobState=FAILED"), (retried, "JobState=COMPLETED")):
        while state not in (record := _job_record(jid, slurm_env)):
            assert time.monotonic() < deadline, record
            time.sleep(0.5)
    assert "ExitCode=3:0" in _job_record(final, slurm_env) and "Restarts=0" in _job_record(final, slurm_env)
    assert "ExitCode=0:0" in _job_record(retried, slurm_env) and "Restarts=1" in _job_record(retried, slurm_env)
    log = (tmp_path / f"job-{retried}.out").read_text()
    assert "attempt 0" in log and "requeueing job" in log and "attempt 1" in log


# ---- several ranks: a capture and replays of 2 tasks, started with srun inside the allocation ------

RANKED = """\
name = "slurm-ranks"
image = "replayjob:dev"
gpu_product = "none"
device = "cpu"
repeats = 1
ranks = 2

[config]
"distributed.strategy" = "ddp"

[arms.two]

[arms.one]
"distributed.world_size" = 1
"""


def test_ranked_plan_submits_one_array_per_rank_count(tmp_path: Path) -> None:
    spec = tmp_path / "ranks.toml"
    spec.write_text(RANKED)
    capture, one, two, reduce = _dry_run(spec, tmp_path / "run", "--gpus-per-task", "2")  # ascending counts
    assert "--nodes=1 --ntasks=2 --gres=gpu:4" in capture
    assert "--array 0%4" in two and "--nodes=1 --ntasks=2 --gres=gpu:4" in two  # index 0: arm two
    assert "--array 1%4" in one and "--nodes=1 --ntasks=1 --gres=gpu:2" in one  # index 1: arm one
    assert all("--dependency=afterok:CAPTURE_ID" in c for c in (two, one))
    # one rank count's array after the other: the spec's parallelism bounds every replay at once
    assert "--dependency=afterok:CAPTURE_ID --kill" in one
    assert "--dependency=afterok:CAPTURE_ID\\,afterany:REPLAY_ID_0" in two  # as printf %q shows it
    assert "--ntasks" not in reduce and "--dependency=afterany:REPLAY_ID" in reduce


def test_every_task_asks_for_the_spec_s_resources(spec_file: Path, tmp_path: Path) -> None:
    """CPUs and memory per rank (1 and 4 GiB without GPUs, as the Kubernetes pods), the spec's deadline as
    --time, and with node_gpus every GPU of the node."""
    text = spec_file.read_text().replace('device = "cpu"', 'device = "cuda"')
    gpu = tmp_path / "gpu.toml"
    gpu.write_text('cpu = "6"\nmemory = "48Gi"\ndeadline_s = 3601\n' + text, encoding="utf-8")
    capture, replay, reduce = _dry_run(gpu, tmp_path / "run")
    for cmd in (capture, replay):
        assert "--cpus-per-task=6" in cmd and "--mem=49152M" in cmd and "--time=61" in cmd, cmd
    assert "--cpus-per-task=1" in reduce and "--mem=4096M" in reduce and "--time=61" in reduce
    cpu = _dry_run(spec_file, tmp_path / "cpu", "--gpus-per-task", "0")
    assert all("--cpus-per-task=1" in c and "--mem=4096M" in c for c in cpu)
    site = _dry_run(gpu, tmp_path / "site", "--sbatch-arg", "--time=30")  # a site's limit comes last: it wins
    assert all(c.index("--time=61") < c.index("--time=30") for c in site)
    whole = tmp_path / "whole.toml"
    whole.write_text("node_gpus = 8\n" + text, encoding="utf-8")
    assert "--gres=gpu:8" in _dry_run(whole, tmp_path / "whole")[1]


def test_a_run_of_more_ranks_than_a_node_has_gpus_asks_for_several_nodes(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """node_gpus = 2 and a capture of 4 ranks, arms of 4 and 2 ranks: the 4-rank jobs ask for 2 nodes of 2
    tasks each (--gres and --mem per node), the 2-rank array for one node, as before.  Only rendered and
    linted here: the test cluster has one node."""
    from replayjob.cli import main

    spec = tmp_path / "nodes.toml"
    spec.write_text(RANKED.replace("ranks = 2", "ranks = 4\nnode_gpus = 2\nmemory = \"8Gi\"")
                    .replace('device = "cpu"', 'device = "cuda"').replace("world_size\" = 1", "world_size\" = 2"))
    assert main(["step", "plan", "--spec", str(spec)]) == 0
    assert capsys.readouterr().out.splitlines()[-3:] == ["replays=2:1", "replays=4:0", "nodes=4:2"]
    capture, two, four, _ = _dry_run(spec, tmp_path / "run")  # rank counts ascending
    for cmd in (capture, four):
        assert "--nodes=2 --ntasks=4 --ntasks-per-node=2 --gres=gpu:2" in cmd and "--mem=16384M" in cmd, cmd
    assert "--nodes=1 --ntasks=2 --gres=gpu:2" in two and "--ntasks-per-node" not in two
    image, runtime = _stand_in_container(tmp_path)
    refused = _submit("--out", str(tmp_path / "image"), "--spec", str(spec), "--dry-run", "--image", str(image),
                      "--container", str(runtime))
    assert refused.returncode == 2 and "runs of 4 ranks span several nodes (node_gpus = 2), which needs srun" \
        in refused.stderr


def test_master_addr_is_the_first_host_scontrol_names(slurm_env: dict[str, str]) -> None:
    """The rendezvous host of srun's tasks (MASTER_ADDR, replayjob.runtime.slurm_ranks.first_host of
    SLURM_JOB_NODELIST) is the first host `scontrol show hostnames` expands the allocation's list to:
    the first node, where srun's block distribution puts rank 0."""
    from replayjob.runtime.slurm_ranks import first_host

    for nodelist in ("node1", "node[01-04]", "a-1,b[2-3]", "gpu[7,9-10]", "rack[1-2]-n[05-06]", "gpu[010-012],a"):
        res = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=slurm_env, text=True,
                             capture_output=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert first_host(nodelist) == res.stdout.split()[0], nodelist


@pytest.mark.slow
@pytest.mark.alone  # two tasks rendezvous (gloo)
def test_two_task_capture_and_replays_under_srun_pass_the_gate(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The capture and arm two's replay are jobs of 2 tasks whose step starts 2 gloo ranks with srun
    (RANK etc. mapped from the tasks' Slurm variables); arm one replays the same capture on 1 rank with
    distributed.world_size declared; the reducer passes exact-input over both arms."""
    spec = tmp_path / "ranks.toml"
    spec.write_text(RANKED)
    out = tmp_path / "run"
    t0 = time.perf_counter()
    res = _submit("--out", str(out), "--spec", str(spec), "--gpus-per-task", "0", "--wait", env=slurm_env,
                  timeout=900)
    print(f"2-rank chain through Slurm in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    logs = "\n".join(p.read_text() for p in sorted((out / "logs").glob("*.out")))
    assert res.returncode == 0, res.stdout + res.stderr + logs
    assert "on 2 rank(s)" in res.stdout
    assert "on 2 ranks (srun)" in logs and "repeat 0 on 2 ranks (srun)" in logs  # the capture and arm two
    jobs = dict(line.split("=") for line in (out / "slurm" / "jobs").read_text().split())
    assert len(jobs["replay"].split(",")) == 2  # one array per rank count
    assert "NumTasks=2" in _job_record(jobs["capture"], slurm_env)
    root = _json(out / "source" / "metrics.json")
    assert sorted(p.name for p in (out / "source").glob("rank-*")) == ["rank-0", "rank-1"]
    two = _json(out / "replays" / "two" / "0" / "replay_metrics.json")
    one = _json(out / "replays" / "one" / "0" / "replay_metrics.json")
    assert two["distributed"]["world_size"] == 2 and two["runtime"]["distributed.world_size"] == 2
    assert one["runtime"]["distributed.world_size"] == 1
    assert two["optimizer/logical_batch_sha256"] == one["optimizer/logical_batch_sha256"] \
        == root["optimizer/logical_batch_sha256"]
    assert two["host"]["slurm_job"] and (out / "replays" / "two" / "0" / "replay_metrics.rank-1.json").is_file()
    verdict = _json(out / "verdict.json")
    assert (verdict["status"], verdict["claim"]) == ("pass", "exact-input")


# ---- an existing capture (TRL): the spec's [capture] table ----------------------------------------

@pytest.mark.parametrize("case", ["knob", "pins", "mode"])
def test_plan_refuses_a_non_knob_arm_or_wrong_pins_of_an_existing_capture(
        trl_capture_steps: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`step plan` (what submit.sh asks first) reads the capture's manifest: an arm key that is a knob of
    replayjob's own trainer but not of TRL, the capture's producer, pins that are not the capture's, or a
    math mode other than the one it ran in (a normal process: "default"), are refused (exit 2) before
    anything is submitted."""
    from conftest import capture_spec

    if case == "knob":
        text = capture_spec(trl_capture_steps, arms='[arms.on]\n"training.micro_batch_size" = 2\n')
        needle = "'training.micro_batch_size' is not a systems-only knob of trl"
    elif case == "pins":
        text = capture_spec(trl_capture_steps, pins=("0" * 64, "1" * 64))
        needle = "capture.logical_sha256 is " + "0" * 64
    else:
        text = capture_spec(trl_capture_steps, math_mode="pedantic")
        needle = "the capture ran in math mode 'default', but the spec's capture.math_mode is 'pedantic'"
    (spec := tmp_path / "spec.toml").write_text(text)
    assert main(["step", "plan", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    res = _submit("--out", str(tmp_path / "run"), "--spec", str(spec), "--gpus-per-task", "0", "--dry-run")
    assert res.returncode == 2 and needle in res.stderr


@pytest.mark.slow
def test_trl_capture_replays_and_reduces_through_the_scheduler(slurm_env: dict[str, str], trl_capture_steps: Path,
                                                               tmp_path: Path) -> None:
    """A spec naming an existing TRL capture through the unedited jobs: the capture job verifies it
    (`step capture`: no workspace, no training), the replay array replays its own replay.toml (`step
    replay`, one arm: the arms' knobs are the funnel test's), the reducer judges it against the capture
    (`step reduce`)."""
    from conftest import capture_spec

    (spec := tmp_path / "spec.toml").write_text(capture_spec(trl_capture_steps, name="slurm-trl"))
    out = tmp_path / "run"
    res = _submit("--out", str(out), "--spec", str(spec), "--gpus-per-task", "0", "--arms", "baseline", "--wait",
                  env={**slurm_env, "HF_HUB_OFFLINE": "1"}, timeout=600)
    logs = "\n".join(p.read_text() for p in sorted((out / "logs").glob("*.out")))
    assert res.returncode == 0, res.stdout + res.stderr + logs
    assert "verified the trl capture" in logs and "no training" in logs
    assert not (out / "workspace").exists() and not (out / "source").exists()
    assert _json(out / "capture.json")["producer"] == "trl"
    assert "REPLAYJOB_MATH_MODE=default" in (out / "slurm" / "job.env").read_text()  # the capture's, from step plan
    m = _json(out / "replays" / "baseline" / "0" / "replay_metrics.json")
    assert (m["framework"], m["arm"], m["runtime"]["trl.gradient_checkpointing"]) == ("trl", "baseline", False)
    assert m["host"]["slurm_job"] and m["provenance"]["pythonhashseed"] == "0"
    verdict = _json(out / "verdict.json")
    assert (verdict["status"], verdict["exit_code"]) == ("pass", 0), verdict
