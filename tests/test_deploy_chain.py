"""The manifests' own container commands, extracted from k8s/ and argo/, run here on CPU.

No cluster exists here, so this test plays the parts a cluster plays, and only those: the shared
volume is a temporary directory substituted for the ``/artifacts`` mount in ``REPLAYJOB_RUN_DIR``;
each pod's emptyDirs (/tmp, /cache) are fresh directories; the Job controller's
``JOB_COMPLETION_INDEX`` is set per index; Argo's ``{{...}}`` substitution, ``withParam`` fan-out
and output parameters are emulated by the small interpreter below (an unknown reference fails the
test); and ``backend.devices="cuda"`` becomes ``"cpu"`` because there is no GPU.  The scripts, the
``replayjob`` commands they run and every artifact are real.  The tiny default is 2 arms x 2
repeats (the spec's 3 repeats are lowered with the reducer's ``--min-repeats 2``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
Doc = dict[str, Any]
pytestmark = pytest.mark.slow


def containers(path: Path) -> list[Doc]:
    pod = yaml.safe_load(path.read_text(encoding="utf-8"))["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def run_container(c: Doc, mount: Path, pod: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run one container's command with its own env, the volume and emptyDirs emulated."""
    env = {e["name"]: e["value"] for e in c["env"]}
    tmp, cache = mount.parent / "pods" / pod / "tmp", mount.parent / "pods" / pod / "cache"
    tmp.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    for key, value in list(env.items()):
        for mount_path, local in (("/artifacts", mount), ("/tmp", tmp), ("/cache", cache)):
            if value == mount_path or value.startswith(mount_path + "/"):
                env[key] = str(local) + value[len(mount_path):]
    assert env["REPLAYJOB_RUN_DIR"].startswith(str(mount))
    env["REPLAYJOB_CONFIG_SETS"] = env["REPLAYJOB_CONFIG_SETS"].replace('"cuda"', '"cpu"')
    env.update(extra, PATH=f"{BIN}:/usr/bin:/bin", REPLAYJOB_WAIT_S="0")
    assert c["command"][:2] == ["/bin/sh", "-c"]
    return subprocess.run(c["command"], env=env, capture_output=True, text=True, timeout=600)


def k8s_chain(mount: Path, repeats: int, jobs: dict[str, list[Doc]] | None = None
              ) -> tuple[str, subprocess.CompletedProcess[str]]:
    """capture Job (prepare + capture), each arm's Indexed replay Job, reduce Job; stops at a failure."""
    base = REPO / "k8s" / "base"
    jobs = jobs or {p.stem: containers(p) for p in base.glob("*.yaml") if p.stem not in ("pvc", "kustomization")}
    order = [("capture", None)]
    order += [(name, i) for name in sorted(jobs) if name.startswith("replay-") for i in range(repeats)]
    order.append(("reduce", None))
    proc = None
    for name, index in order:
        extra = {"JOB_COMPLETION_INDEX": str(index)} if index is not None else {}
        if name == "reduce":
            extra.update(REPLAYJOB_REPEATS=str(repeats), REPLAYJOB_MIN_REPEATS=str(repeats))
        for c in jobs[name]:
            step = f"{name}[{index}]" if index is not None else f"{name}/{c['name']}"
            proc = run_container(c, mount, step.replace("/", "-"), **extra)
            if proc.returncode != 0:
                return step, proc
    assert proc is not None
    return "done", proc


@pytest.fixture(scope="module")
def k8s_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, subprocess.CompletedProcess[str]]:
    mount = tmp_path_factory.mktemp("k8s") / "artifacts"
    mount.mkdir()
    step, proc = k8s_chain(mount, repeats=2)
    return mount / "runs" / "replayjob-ablation", step, proc


def test_k8s_job_commands_chain_to_a_passing_verdict(k8s_run: tuple[Path, str, Any]) -> None:
    run, step, proc = k8s_run
    assert (step, proc.returncode) == ("done", 0), proc.stdout + proc.stderr
    verdict = json.loads((run / "verdict.json").read_text(encoding="utf-8"))
    assert (verdict["claim"], verdict["status"], verdict["exit_code"]) == ("exact-input", "pass", 0)
    metrics = sorted(run.glob("replays/*/*/replay_metrics.json"))
    assert [m.relative_to(run / "replays").parts[:2] for m in metrics] == [
        ("ckpt-off", "0"), ("ckpt-off", "1"), ("ckpt-on", "0"), ("ckpt-on", "1")]
    for m in metrics:
        data = json.loads(m.read_text(encoding="utf-8"))
        arm, repeat = m.parent.parent.name, int(m.parent.name)
        assert (data["arm"], data["repeat_index"]) == (arm, repeat)
        assert data["runtime"]["gradient_checkpointing"] is (arm == "ckpt-on")
        assert data["allowed_config_differences"] == (
            ["backend.options.gradient_checkpointing"] if arm == "ckpt-on" else [])


def test_rerun_of_a_completed_step_reuses_it(k8s_run: tuple[Path, str, Any]) -> None:
    """A retried pod (infrastructure failure after the work was done) does not redo or refuse it."""
    run, _, _ = k8s_run
    mount = run.parents[1]
    before = (run / "source" / "metrics.json").stat().st_mtime_ns
    for c in containers(REPO / "k8s" / "base" / "capture.yaml"):
        proc = run_container(c, mount, "retry-capture")
        assert proc.returncode == 0 and "reusing" in proc.stdout, proc.stderr
    proc = run_container(containers(REPO / "k8s" / "base" / "replay-ckpt-on.yaml")[0], mount, "retry-replay",
                         JOB_COMPLETION_INDEX="1")
    assert proc.returncode == 0 and "reusing" in proc.stdout
    assert (run / "source" / "metrics.json").stat().st_mtime_ns == before


def copy_prepared(run: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    shutil.copytree(run / "workspace", dest / "workspace")
    shutil.copytree(run / "source", dest / "source")


def test_undeclared_difference_in_one_arm_stops_the_chain_at_its_replay(
        k8s_run: tuple[Path, str, Any], tmp_path: Path) -> None:
    """Planted: the ckpt-off Job also turns gradient checkpointing on, without declaring it."""
    run, _, _ = k8s_run
    mount = tmp_path / "artifacts"
    copy_prepared(run, mount / "runs" / "replayjob-ablation")
    base = REPO / "k8s" / "base"
    jobs = {p.stem: containers(p) for p in base.glob("*.yaml") if p.stem not in ("pvc", "kustomization")}
    env = jobs["replay-ckpt-off"][0]["env"]
    sets = next(e for e in env if e["name"] == "REPLAYJOB_CONFIG_SETS")
    sets["value"] += " backend.options.gradient_checkpointing=true"
    step, proc = k8s_chain(mount, repeats=1, jobs=jobs)
    assert (step, proc.returncode) == ("replay-ckpt-off[0]", 2), proc.stdout + proc.stderr
    assert "gradient_checkpointing" in proc.stderr
    assert not (mount / "runs" / "replayjob-ablation" / "verdict.json").exists()


# --- Argo --------------------------------------------------------------------------------------

def workflow_doc() -> Doc:
    docs = yaml.safe_load_all((REPO / "argo" / "ablation.yaml").read_text(encoding="utf-8"))
    return next(d for d in docs if d["kind"] == "Workflow")


class ArgoEmulator:
    """Just enough of the workflow controller to run argo/ablation.yaml's steps in order."""

    def __init__(self, wf: Doc, mount: Path, params: dict[str, str]):
        self.wf, self.mount = wf, mount
        self.templates = {t["name"]: t for t in wf["spec"]["templates"]}
        self.params = {p["name"]: p["value"] for p in wf["spec"]["arguments"]["parameters"]} | params
        self.steps: dict[str, dict[str, str]] = {}
        self.globals: dict[str, str] = {}
        self.status = "Running"

    def resolve(self, text: str, inputs: dict[str, str], item: dict[str, str] | None = None) -> str:
        def sub(m: re.Match[str]) -> str:
            ref = m.group(1).strip()
            p = ref.split(".")
            table: dict[str, str] = {
                "workflow.name": self.wf["metadata"]["name"], "workflow.uid": "0000-uid",
                "workflow.status": self.status}
            if ref in table:
                return table[ref]
            if p[:2] == ["workflow", "parameters"]:
                return self.params[p[2]]
            if p[:2] == ["inputs", "parameters"]:
                return inputs[p[2]]
            if p[0] == "item" and item is not None:
                return item[p[1]]
            if p[0] == "steps":
                return self.steps[p[1]][p[4]]
            raise AssertionError(f"unresolvable reference {ref}")
        return re.sub(r"\{\{([^}]+)\}\}", sub, text)

    def run_template(self, name: str, inputs: dict[str, str], pod: str
                     ) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
        tpl = self.templates[name]
        c = dict(tpl["container"])
        c["name"] = pod
        c["env"] = [{"name": e["name"], "value": self.resolve(e["value"], inputs)} for e in c["env"]]
        proc = run_container(c, self.mount, pod)
        outs = {}
        if proc.returncode == 0 or name == "reduce":
            for p in tpl.get("outputs", {}).get("parameters", []):
                path = self.mount.parent / "pods" / pod / "tmp" / p["valueFrom"]["path"][len("/tmp/"):]
                outs[p["name"]] = path.read_text(encoding="utf-8") if path.exists() else ""
                if "globalName" in p:
                    self.globals[p["globalName"]] = outs[p["name"]]
        return proc, outs

    def run(self) -> tuple[str, subprocess.CompletedProcess[str]]:
        main = self.templates[self.wf["spec"]["entrypoint"]]
        result = None
        for group in main["steps"]:
            for step in group:
                items = json.loads(self.resolve(step["withParam"], {})) if "withParam" in step else [None]
                for n, item in enumerate(items):
                    args = {a["name"]: self.resolve(a["value"], {}, item)
                            for a in step.get("arguments", {}).get("parameters", [])}
                    proc, outs = self.run_template(step["template"], args, f"{step['name']}-{n}")
                    self.steps[step["name"]] = outs
                    if proc.returncode != 0:
                        self.status = "Failed"
                        return f"{step['name']}-{n}", proc
                    result = proc
        self.status = "Succeeded"
        assert result is not None
        return "done", result


def test_argo_workflow_commands_chain_to_a_passing_verdict(k8s_run: tuple[Path, str, Any],
                                                           tmp_path: Path) -> None:
    """prepare and capture find the volume prepared (their retry path) and still publish the plan
    and the pins; the replays receive the pins as parameters; the reducer's verdict is an output."""
    run, _, _ = k8s_run
    wf = workflow_doc()
    mount = tmp_path / "artifacts"
    copy_prepared(run, mount / "runs" / wf["metadata"]["name"] / "0000-uid")
    emu = ArgoEmulator(wf, mount, {"repeats": "1", "min-repeats": "1"})
    step, proc = emu.run()
    assert (step, proc.returncode) == ("done", 0), proc.stdout + proc.stderr
    plan = json.loads(emu.steps["prepare"]["plan"])
    assert plan == [{"arm": "ckpt-off", "sets": "", "repeat": "0"},
                    {"arm": "ckpt-on", "sets": "backend.options.gradient_checkpointing=true", "repeat": "0"}]
    source = json.loads((run / "source" / "metrics.json").read_text(encoding="utf-8"))
    assert emu.steps["capture"] == {"logical-sha256": source["optimizer/logical_batch_sha256"],
                                    "manifest-sha256": source["optimizer_batch/manifest_sha256"]}
    assert json.loads(emu.globals["verdict"])["status"] == "pass"
    report, _ = emu.run_template(wf["spec"]["onExit"], {}, "exit-handler")
    assert report.returncode == 0 and "Succeeded" in report.stdout and '"status": "pass"' in report.stdout


def test_argo_prepare_refuses_a_malformed_arms_parameter(tmp_path: Path) -> None:
    wf = workflow_doc()
    mount = tmp_path / "artifacts"
    (mount / "runs" / wf["metadata"]["name"] / "0000-uid" / "workspace").mkdir(parents=True)
    emu = ArgoEmulator(wf, mount, {"arms": '[{"name": "Bad Arm", "sets": ""}]'})
    proc, _ = emu.run_template("prepare", {}, "prepare-0")
    assert proc.returncode == 2 and "arms must be a JSON list" in proc.stderr


# --- the workstation script ------------------------------------------------------------------

def smoke(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    return subprocess.run(["bash", str(REPO / "scripts" / "local-mid-smoke.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_local_mid_smoke_on_cpu_passes_and_writes_the_verdict(tmp_path: Path) -> None:
    """The wrapper runs the funnel (docs/funnel.md; every stage is tested in test_funnel.py)."""
    proc = smoke("--repeats", "1", "--only-ablation", "--out", str(tmp_path / "smoke"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device cpu" in proc.stdout and "wall time" in proc.stdout
    verdict = json.loads((tmp_path / "smoke" / "verdict.json").read_text(encoding="utf-8"))
    assert verdict["status"] == "pass" and verdict["parameters"]["arms"] == ["ckpt-off", "ckpt-on"]
    assert sorted(p.parent.parent.name for p in (tmp_path / "smoke").glob("replays/*/*/replay_metrics.json")) \
        == ["ckpt-off", "ckpt-on"]
    assert json.loads((tmp_path / "smoke" / "funnel.json").read_text())["exit_code"] == 0


def test_local_mid_smoke_help_and_bad_options() -> None:
    proc = smoke("--help")
    assert proc.returncode == 0
    for option in ("--repeats", "--arms", "--out", "--budgets"):
        assert option in proc.stdout
    proc = smoke("--frobnicate")
    assert proc.returncode == 2 and "--frobnicate" in proc.stderr
