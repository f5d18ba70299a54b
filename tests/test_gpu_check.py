"""``scripts/gpu/check.sh`` (the one-command GPU readiness check) and its Python half ``benchmarks/gpu_check``.

The script's plan (``--dry-run``), its option errors, shellcheck, the carried-wheel list against
pyproject.toml's dependencies, the missing-package probe, the no-pip wheel extraction and the results
file written from a work folder (a passing CPU run, a GPU run cut short) run here quickly.  The whole
script in ``--cpu`` mode (the same parts with the tiny model, CUDA hidden) runs end to end in fresh
processes, so it is marked ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "scripts" / "gpu" / "check.sh"
FETCH = REPO / "scripts" / "gpu" / "fetch-wheels.sh"
WHEELS = REPO / "scripts" / "gpu" / "wheels"
# pyproject.toml dependencies a GPU machine is expected to have (the heavy builds), or that no GPU
# check imports (kubernetes: cluster submission only); every other one must be carried.
NOT_CARRIED = {"torch", "transformers", "peft", "kubernetes"}


def bash(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *argv], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


def test_dry_run_prints_every_part_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = bash(str(CHECK), "--dry-run", env={"OUT": str(out)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for part in ("install", "env", "pytest-gpu", "ablation"):
        assert any(line.startswith(f"## {part} (limit ") for line in lines), part
    assert "-m pytest -m gpu tests/test_gpu.py" in proc.stdout
    assert "benchmarks/gpu_ablation.sh --repeats 5 " in proc.stdout and "--tiny" not in proc.stdout
    assert "--no-index" in proc.stdout and "--no-deps" in proc.stdout
    assert not out.exists()
    cpu = bash(str(CHECK), "--dry-run", env={"OUT": str(out), "REPLAYJOB_GPU_CHECK_CPU": "1"})
    assert cpu.returncode == 0 and "--repeats 1 --tiny" in cpu.stdout and "check (cpu)" in cpu.stdout


def test_bad_options_exit_2() -> None:
    for argv in (["--bogus"], ["--budget", "0"], ["--repeats", "x"], ["--budget"]):
        proc = bash(str(CHECK), *argv, "--dry-run")
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_are_shellcheck_clean() -> None:
    proc = subprocess.run(["shellcheck", str(CHECK), str(FETCH)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout


def test_every_dependency_a_gpu_machine_may_lack_is_carried() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() for d in deps}
    carried = {d.lower() for d, _, _, _ in gpu_check.REQUIREMENTS}
    assert names - NOT_CARRIED <= carried, names - NOT_CARRIED - carried
    assert "pytest" in carried and not carried & {"torch", "transformers", "peft", "numpy"}
    pins = [r[1] for r in gpu_check.REQUIREMENTS]
    assert all(re.fullmatch(r"\d+(\.\d+)+", p) for p in pins)
    # every pin satisfies its own minimum
    assert all(gpu_check._version_tuple(p) >= gpu_check._version_tuple(m)
               for _, p, _, m in (*gpu_check.REQUIREMENTS, *gpu_check.BUILD_REQUIREMENTS))


def test_missing_lists_absent_old_and_forced_packages() -> None:
    assert gpu_check.missing([]) == []  # the test environment has every carried package
    assert gpu_check.missing(["PyYAML"]) == ["PyYAML==6.0.4"]
    rows = (("no-such-dist", "1.0", "no_such_module_for_gpu_check", "1.0"),
            ("pytest", "99.0", "pytest", "99.0"),
            ("docopt-ng", "0.9.0", "docopt", "0.1"))
    assert gpu_check.missing([], rows) == ["no-such-dist==1.0", "pytest==99.0"]


def _wheel(directory: Path, name: str, version: str, members: dict[str, str]) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in members.items():
            zf.writestr(member, text)
    return path


def test_unpack_installs_by_extraction_and_refuses_escapes(tmp_path: Path) -> None:
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_probe", "1.2", {"gpu_check_probe/__init__.py": "X = 7\n",
                                              "gpu_check_probe-1.2.dist-info/METADATA": "Name: gpu-check-probe\n"})
    assert gpu_check.unpack(["gpu-check-probe==1.2"], wheels, target) == ["gpu_check_probe-1.2-py3-none-any.whl"]
    proc = subprocess.run([sys.executable, "-c", "import gpu_check_probe; print(gpu_check_probe.X)"],
                          env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True, check=False)
    assert proc.stdout.strip() == "7"
    with pytest.raises(SystemExit, match="no wheel for"):
        gpu_check.unpack(["gpu-check-probe==1.3"], wheels, target)
    _wheel(wheels, "evil", "1.0", {"../escape.py": ""})
    with pytest.raises(SystemExit, match="refusing"):
        gpu_check.unpack(["evil==1.0"], wheels, target)
    assert not (tmp_path / "escape.py").exists()


def _junit(path: Path, outcome: str) -> None:
    inner = {"passed": "", "skipped": '<skipped message="needs a CUDA device"/>',
             "failed": '<failure message="CUDA updates differ bitwise"/>'}[outcome]
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                    '<testcase classname="tests.test_gpu" name="test_capture_and_two_replays_are_bitwise_on_cuda" '
                    f'time="41.5">{inner}</testcase></testsuite></testsuites>')


def _work(tmp_path: Path, parts: list[tuple[str, int, float]]) -> Path:
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "parts.tsv").write_text("".join(f"{n}\t{rc}\t{s}\t100\t\n" for n, rc, s in parts))
    for n, _, _ in parts:
        (work / "logs" / f"{n}.log").write_text(f"{n} output\n")
    (work / "missing.txt").write_text("docopt-ng==0.9.0\n")
    (work / "installed.txt").write_text("docopt-ng==0.9.0\nreplayjob\n")
    (work / "env.json").write_text(json.dumps({"python": "3.12.3", "torch": {"version": "2.11.0", "cuda": "12.8",
                                                                              "devices": ["NVIDIA H200"]}}))
    return work


def test_collect_a_passing_cpu_run(tmp_path: Path) -> None:
    work = _work(tmp_path, [("install", 0, 9.0), ("env", 0, 3.0), ("pytest-gpu", 0, 5.0), ("ablation", 0, 33.0)])
    _junit(work / "pytest-gpu.xml", "skipped")
    (work / "bench").mkdir()
    arm = {"n": 1, "local_train_wall_s": {"median": 0.04, "min": 0.04, "max": 0.04, "iqr": 0.0},
           "peak_memory_bytes": {"median": 3.9e8}, "process_wall_s": {"median": 7.5}, "memory_kind": "max_rss"}
    (work / "bench" / "gpu_ablation.smoke.json").write_text(json.dumps(
        {"mode": "smoke", "ratio": 1.02, "ratio_definition": "d", "target": {"op": "<=", "value": 480.0},
         "target_met": None, "measurements": {"raw_step_s": 0.037, "total_s": 32.0, "devices": ["cpu"],
                                              "verdict_exit_codes": {"exact-input": 0, "bitwise": 0},
                                              "arms": {"ckpt-off": arm, "ckpt-on": arm}}}))
    (work / "ablation").mkdir()
    (work / "ablation" / "verdict-exact-input.json").write_text(json.dumps({"status": "pass", "exit_code": 0}))
    results = tmp_path / "out" / gpu_check.RESULTS_NAME
    doc = gpu_check.collect(work, results, mode="cpu", budget_s=240, total_s=50)
    assert doc["status"] == "pass" and doc["failed"] == []
    assert json.loads(results.read_text()) == doc
    assert doc["pytest_gpu"]["skipped"] == 1 and doc["parts"]["ablation"]["log_tail"] == "ablation output\n"
    assert doc["ablation"]["verdicts"]["exact-input"]["verdict"]["status"] == "pass"
    text = "\n".join(gpu_check.summary(doc))
    assert "pass in 50 s of 240 s" in text and "ratio 1.02" in text and "update median 0.0400 s" in text
    # the same work folder judged as a GPU run fails: the CUDA test skipped and the replays ran on the CPU
    gpu = gpu_check.collect(work, results, mode="gpu", budget_s=450, total_s=50)
    assert gpu["status"] == "fail" and len(gpu["failed"]) == 2


def test_collect_a_gpu_run_cut_short_keeps_what_it_got(tmp_path: Path) -> None:
    work = _work(tmp_path, [("install", 0, 9.0), ("env", 0, 3.0), ("pytest-gpu", 0, 45.0), ("ablation", 124, 300.0)])
    _junit(work / "pytest-gpu.xml", "passed")
    for i, (arm, update) in enumerate([("ckpt-off", 0.5), ("ckpt-on", 0.7), ("ckpt-off", 0.6)]):
        d = work / "ablation" / "replays" / arm / f"repeat-{i // 2:03d}"
        d.mkdir(parents=True)
        (d / "replay_metrics.json").write_text(json.dumps({"timing": {"local_train_wall_s": update},
                                                           "memory": {"peak_bytes": 2**31}}))
    (work / "ablation" / "process_wall.tsv").write_text("capture\t20.5\nreplay ckpt-off\t15.0\n")
    results = tmp_path / "out" / gpu_check.RESULTS_NAME
    assert gpu_check.main(["collect", "--work", str(work), "--results", str(results), "--mode", "gpu",
                           "--budget-s", "450", "--total-s", "400"]) == 1
    doc = json.loads(results.read_text())
    assert doc["status"] == "fail"
    assert doc["failed"] == ["ablation: exit 124 (time limit)", "ablation: no benchmark JSON"]
    assert doc["pytest_gpu"]["passed"] == 1 and doc["parts"]["ablation"]["timed_out"]
    partial = doc["ablation"]["partial"]
    assert partial["arms"]["ckpt-off"]["local_train_wall_s"]["n"] == 2
    assert partial["arms"]["ckpt-off"]["local_train_wall_s"]["median"] == pytest.approx(0.55)
    assert partial["process_wall_s"]["capture"]["median"] == 20.5


@pytest.mark.slow
def test_cpu_mode_runs_every_part_end_to_end(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # the pure-Python carried wheels install on this interpreter too: count them missing to exercise the
    # offline install; without a fetched wheel folder only replayjob itself is installed
    pure = [w for w in sorted(WHEELS.glob("*-py3-none-any.whl"))] if WHEELS.is_dir() else []
    for w in pure:
        shutil.copy2(w, wheels)
    if gpu_check.missing([], gpu_check.BUILD_REQUIREMENTS) and not any(w.name.startswith("setuptools") for w in pure):
        pytest.skip("this interpreter's setuptools is too old to build replayjob and no carried setuptools wheel "
                    "is present (scripts/gpu/fetch-wheels.sh)")
    reinstall = [w.name.split("-")[0] for w in pure if not w.name.startswith("setuptools")]
    out, work = tmp_path / "out", tmp_path / "work"
    proc = bash(str(CHECK), "--cpu", "--wheels", str(wheels), timeout=600,
                env={"OUT": str(out), "REPLAYJOB_GPU_CHECK_WORK": str(work), "PYTHON": sys.executable,
                     "REPLAYJOB_GPU_CHECK_REINSTALL": ",".join(reinstall)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["check.log", gpu_check.RESULTS_NAME]
    doc = json.loads((out / gpu_check.RESULTS_NAME).read_text())
    assert doc["schema"] == gpu_check.SCHEMA and doc["mode"] == "cpu" and doc["status"] == "pass"
    assert sorted(doc["parts"]) == ["ablation", "env", "install", "pytest-gpu"]
    assert all(p["rc"] == 0 for p in doc["parts"].values())
    assert doc["install"]["installed"][-1] == "replayjob" and len(doc["install"]["installed"]) == len(reinstall) + 1
    carried = {k for k, v in doc["environment"]["packages"].items() if v["origin"] == "carried"}
    assert {gpu_check._normal(k) for k in carried} == {gpu_check._normal(r) for r in reinstall}
    assert doc["environment"]["packages"]["torch"]["origin"] == "machine"
    assert doc["pytest_gpu"]["tests"] == 1 and doc["pytest_gpu"]["skipped"] == 1
    bench = doc["ablation"]["benchmark"]  # benchmarks/gpu_ablation.sh --tiny, its whole chain on CPU
    assert bench["mode"] == "smoke" and bench["measurements"]["devices"] == ["cpu"]
    m = bench["measurements"]
    assert m["verdict_exit_codes"] == {"exact-input": 0, "bitwise": 0} and sorted(m["arms"]) == ["ckpt-off", "ckpt-on"]
    assert m["arms"]["ckpt-on"]["gradient_checkpointing"] == [True]
    assert {c: v["verdict"]["status"] for c, v in doc["ablation"]["verdicts"].items()} == {"bitwise": "pass",
                                                                                          "exact-input": "pass"}
    # every figure of the printed summary is in the results file
    for line in gpu_check.summary(doc):
        assert line in proc.stdout
