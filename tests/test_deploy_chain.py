"""The rendered manifests' own container commands, extracted from the YAML files, run here on CPU.

No cluster exists here, so this test plays the parts a cluster plays, and only those: the shared
volume is a temporary directory substituted for the ``/artifacts`` mount; the spec ConfigMap (Jobs)
or raw input artifact (Argo) is a file at ``/etc/replayjob/ablation.toml``'s place; each pod's
emptyDirs are fresh directories; the kubelet's downward API (run-id label, node name, pod name,
completion-index annotation, CPU limit) and its ``$(VAR)`` expansion, the Job controller's stage
order, and Argo's ``{{...}}`` substitution, ``withParam`` fan-out, ``depends`` and output parameters
are emulated by the small interpreters below (an unknown reference fails the test).  The manifests
are rendered by ``replayjob k8s render`` from a tiny spec (CPU, 2 arms x 1 repeat), and a test
checks that the committed ones differ from them only in the spec's values.  The ``replayjob step``
commands and every artifact are real.
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

from replayjob.cli import main

REPO = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
Doc = dict[str, Any]
pytestmark = pytest.mark.slow
TINY = """\
name = "chain"
image = "registry.example/replayjob@sha256:""" + "ab" * 32 + """"
gpu_product = "none"
device = "cpu"
repeats = 1

[arms.ckpt-off]

[arms.ckpt-on]
"backend.options.gradient_checkpointing" = true
"""


def load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rendered")
    (d / "ablation.toml").write_text(TINY, encoding="utf-8")
    assert main(["k8s", "render", str(d / "ablation.toml"), "--out", str(d / "k8s"),
                 "--argo", str(d / "argo.yaml")]) == 0
    return d


class Pod:
    """One pod's filesystem and downward API: the volume, its emptyDirs, the spec file."""

    def __init__(self, mount: Path, name: str, spec_text: str, labels: dict[str, str],
                 annotations: dict[str, str] | None = None):
        self.mount, self.name = mount, name
        self.root = mount.parent / "pods" / name
        for sub in ("tmp", "cache", "spec"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "spec" / "ablation.toml").write_text(spec_text, encoding="utf-8")
        self.fields = {"spec.nodeName": "node-a", "metadata.name": name,
                       **{f"metadata.labels['{k}']": v for k, v in labels.items()},
                       **{f"metadata.annotations['{k}']": v for k, v in (annotations or {}).items()}}

    def local(self, value: str) -> str:
        """A container path (or a word holding one) mapped onto this pod's local directories."""
        table = {"/artifacts": self.mount, "/tmp": self.root / "tmp", "/cache": self.root / "cache",
                 "/etc/replayjob": self.root / "spec"}
        return re.sub(r"(?<![\w/])(/artifacts|/tmp|/cache|/etc/replayjob)(?=/|$)",
                      lambda m: str(table[m.group(1)]), value)

    def run(self, c: Doc) -> subprocess.CompletedProcess[str]:
        env: dict[str, str] = {}
        for e in c["env"]:
            if "value" in e:
                env[e["name"]] = self.local(e["value"])
            elif "fieldRef" in e["valueFrom"]:
                env[e["name"]] = self.fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                assert e["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
                env[e["name"]] = "1"
        cmd = [self.local(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], w)) for w in c["command"]]
        assert cmd[0] == "replayjob"  # one command, no shell
        env["PATH"] = f"{BIN}:/usr/bin:/bin"
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def jobs(directory: Path) -> dict[str, Doc]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
            for p in directory.glob("*.yaml") for d in load(p) if d.get("kind") == "Job"}


def run_job(job: Doc, mount: Path, spec_text: str, index: int | None = None) -> subprocess.CompletedProcess[str]:
    tpl = job["spec"]["template"]
    ann = {"batch.kubernetes.io/job-completion-index": str(index)} if index is not None else None
    name = f"{job['metadata']['name']}-{index if index is not None else 0}"
    return Pod(mount, name, spec_text, tpl["metadata"]["labels"], ann).run(tpl["spec"]["containers"][0])


def config_map_text(directory: Path) -> str:
    (cm,) = load(directory / "spec.yaml")
    text: str = cm["data"]["ablation.toml"]
    return text


@pytest.fixture(scope="module")
def k8s_run(rendered: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """The Job controller's part: capture, then every index of the replay Job, then reduce."""
    mount = tmp_path_factory.mktemp("k8s") / "artifacts"
    mount.mkdir()
    js, text = jobs(rendered / "k8s"), config_map_text(rendered / "k8s")
    procs = [run_job(js["capture"], mount, text)]
    procs += [run_job(js["replay"], mount, text, i) for i in range(js["replay"]["spec"]["completions"])]
    procs.append(run_job(js["reduce"], mount, text))
    return mount / "runs" / "chain" / "base", procs


def test_committed_manifests_run_the_same_commands_as_the_tiny_render(rendered: Path) -> None:
    ours, committed = jobs(rendered / "k8s"), jobs(REPO / "k8s" / "base")
    for stage, job in ours.items():
        c = job["spec"]["template"]["spec"]["containers"][0]
        c2 = committed[stage]["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == [w.replace("replayjob-ablation", "chain") for w in c2["command"]]
        assert [e["name"] for e in c["env"]] == [e["name"] for e in c2["env"]]


def test_k8s_job_commands_chain_to_a_passing_verdict(k8s_run: tuple[Path, list[Any]]) -> None:
    run, procs = k8s_run
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(p.stdout + p.stderr for p in procs)
    verdict = json.loads((run / "verdict.json").read_text(encoding="utf-8"))
    assert (verdict["claim"], verdict["status"], verdict["exit_code"]) == ("exact-input", "pass", 0)
    assert verdict["parameters"]["arms"] == ["ckpt-off", "ckpt-on"]
    # the reduce Job passes the spec: each arm's intended knobs come from the plan, not the replays
    assert sorted(verdict["parameters"]["spec"]["arms"]) == ["ckpt-off", "ckpt-on"]
    checks = {c["name"]: c["status"] for c in verdict["checks"]}
    assert (checks["inputs.arm_plan"], checks["exact.knobs_in_effect"]) == ("pass", "pass")
    metrics = sorted(run.glob("replays/*/*/replay_metrics.json"))
    assert [m.relative_to(run / "replays").parts[:2] for m in metrics] == [("ckpt-off", "0"), ("ckpt-on", "0")]
    for m in metrics:
        data = json.loads(m.read_text(encoding="utf-8"))
        arm = m.parent.parent.name
        assert (data["arm"], data["repeat_index"]) == (arm, 0)
        assert data["runtime"]["backend.options.gradient_checkpointing"] is (arm == "ckpt-on")
        # provenance from the downward API and the environment the manifests set
        assert (data["host"]["node"], data["host"]["device_type"]) == ("node-a", "cpu")
        assert data["host"]["image_digest"] == "sha256:" + "ab" * 32
        assert data["host"]["pod"].startswith("chain-replay-")
        assert data["provenance"]["pythonhashseed"] == "0"
    record = json.loads((run / "run.json").read_text(encoding="utf-8"))
    assert record["image"].endswith("ab" * 32) and len(record["fingerprint"]) == 64


def test_retried_pods_reuse_completed_stages(k8s_run: tuple[Path, list[Any]], rendered: Path) -> None:
    """A retried pod (an infrastructure failure after the work was done) neither redoes nor refuses it."""
    run, _ = k8s_run
    js, text = jobs(rendered / "k8s"), config_map_text(rendered / "k8s")
    before = (run / "source" / "metrics.json").stat().st_mtime_ns
    for proc in (run_job(js["capture"], run.parents[2], text), run_job(js["replay"], run.parents[2], text, 1)):
        assert proc.returncode == 0 and "reusing" in proc.stdout, proc.stdout + proc.stderr
    assert (run / "source" / "metrics.json").stat().st_mtime_ns == before


def test_a_run_directory_of_another_spec_is_refused(k8s_run: tuple[Path, list[Any]], rendered: Path) -> None:
    run, _ = k8s_run
    text = config_map_text(rendered / "k8s").replace("repeats = 1", "repeats = 2")
    proc = run_job(jobs(rendered / "k8s")["replay"], run.parents[2], text, 1)
    assert proc.returncode == 2 and "holds another run's artifacts" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- Argo --------------------------------------------------------------------------------------

class ArgoEmulator:
    """Just enough of the workflow controller to run the WorkflowTemplate's DAG in order."""

    def __init__(self, path: Path, mount: Path, uid: str):
        docs = load(path)
        self.wft = next(d for d in docs if d["kind"] == "WorkflowTemplate")
        wf = next(d for d in docs if d["kind"] == "Workflow")
        assert wf["spec"]["workflowTemplateRef"]["name"] == self.wft["metadata"]["name"]
        self.name, self.uid, self.mount = wf["metadata"]["name"], uid, mount
        self.templates = {t["name"]: t for t in self.wft["spec"]["templates"]}
        self.params = {p["name"]: p["value"] for p in self.wft["spec"]["arguments"]["parameters"]}
        self.outputs: dict[str, dict[str, str]] = {}
        self.status: dict[str, str] = {}
        self.procs: dict[str, list[subprocess.CompletedProcess[str]]] = {}

    def resolve(self, text: str, inputs: dict[str, str], item: Any = None) -> str:
        def sub(m: re.Match[str]) -> str:
            ref = m.group(1).strip()
            p = ref.split(".")
            if ref in ("workflow.name", "workflow.uid"):
                return self.name if ref == "workflow.name" else self.uid
            if p[:2] == ["workflow", "parameters"]:
                return self.params[p[2]]
            if p[:2] == ["inputs", "parameters"]:
                return inputs[p[2]]
            if ref == "item" and item is not None:
                return str(item)
            if p[0] == "tasks" and p[2:4] == ["outputs", "parameters"]:
                return self.outputs[p[1]][p[4]]
            raise AssertionError(f"unresolvable reference {ref}")
        return re.sub(r"\{\{([^}]+)\}\}", sub, text)

    def run_template(self, name: str, inputs: dict[str, str], pod_name: str
                     ) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
        tpl = self.templates[name]
        (art,) = tpl["inputs"]["artifacts"]
        assert art["path"] == "/etc/replayjob/ablation.toml"
        pod = Pod(self.mount, pod_name, self.resolve(art["raw"]["data"], inputs), tpl["metadata"]["labels"])
        c = json.loads(self.resolve(json.dumps(tpl["container"]), inputs))
        proc = pod.run(c)
        outs = {}
        for p in tpl.get("outputs", {}).get("parameters", []):
            path = Path(pod.local(p["valueFrom"]["path"]))
            if path.exists():
                outs[p["name"]] = path.read_text(encoding="utf-8")
            else:
                assert "default" in p["valueFrom"] or proc.returncode != 0, p["name"]
                outs[p["name"]] = p["valueFrom"].get("default", "")
        return proc, outs

    def depends_met(self, expr: str) -> bool:
        """``(a.S || b.T) && c.U``: terms ``TASK.STATE``, ``&&`` binding tighter than ``||``, parentheses."""
        tokens = re.findall(r"\(|\)|&&|\|\||[\w-]+(?:\.\w+)?", expr)
        assert "".join(tokens) == re.sub(r"\s+", "", expr), f"unparsed depends {expr!r}"
        pos = 0

        def term() -> bool:
            nonlocal pos
            tok = tokens[pos]
            pos += 1
            if tok == "(":
                value = either()
                assert tokens[pos] == ")"
                pos += 1
                return value
            task, _, state = tok.partition(".")
            return self.status.get(task) == (state or "Succeeded")

        def both() -> bool:
            nonlocal pos
            value = term()
            while pos < len(tokens) and tokens[pos] == "&&":
                pos += 1
                value = term() and value
            return value

        def either() -> bool:
            nonlocal pos
            value = both()
            while pos < len(tokens) and tokens[pos] == "||":
                pos += 1
                value = both() or value
            return value

        result = either()
        assert pos == len(tokens), f"unparsed depends {expr!r}"
        return result

    def run(self, tamper: dict[int, dict[str, str]] | None = None) -> None:
        dag = self.templates[self.wft["spec"]["entrypoint"]]["dag"]
        assert dag["failFast"] is False
        for task in dag["tasks"]:
            if "depends" in task and not self.depends_met(task["depends"]):
                self.status[task["name"]] = "Omitted"
                continue
            items = json.loads(self.resolve(task["withParam"], {})) if "withParam" in task else [None]
            procs, failed = [], False
            for n, item in enumerate(items):
                args = {a["name"]: self.resolve(a["value"], {}, item)
                        for a in task.get("arguments", {}).get("parameters", [])}
                args.update((tamper or {}).get(n, {}) if "withParam" in task else {})
                proc, outs = self.run_template(task["template"], args, f"{task['name']}-{n}")
                procs.append(proc)
                failed |= proc.returncode != 0
                self.outputs[task["name"]] = outs
            self.procs[task["name"]] = procs
            self.status[task["name"]] = "Failed" if failed else "Succeeded"


def test_argo_reduce_runs_after_a_planted_replay_failure_and_refuses(
        k8s_run: tuple[Path, list[Any]], rendered: Path, tmp_path: Path) -> None:
    """The capture step reuses a prepared volume (its retry path) and still publishes the plan and the
    pins; replay 0 passes (reusing the replay the Jobs ran for arm ckpt-off); replay 1 receives pins
    that are not the capture's (the planted failure) and refuses; the reducer runs anyway and writes a
    refused verdict naming the arm."""
    run, _ = k8s_run
    mount = tmp_path / "artifacts"
    emu = ArgoEmulator(rendered / "argo.yaml", mount, "0000-uid")
    dest = mount / "runs" / emu.name / emu.uid
    dest.mkdir(parents=True)
    for name in ("workspace", "source", "replays/ckpt-off"):
        shutil.copytree(run / name, dest / name)
    shutil.copy(run / "run.json", dest / "run.json")  # same spec, same image: the same run's fingerprint
    emu.run(tamper={1: {"pins": "0" * 64 + "," + "1" * 64}})
    assert emu.status == {"capture": "Succeeded", "replay": "Failed", "reduce": "Failed"}, emu.procs
    assert "reusing" in emu.procs["capture"][0].stdout
    assert json.loads(emu.outputs["capture"]["plan"]) == [0, 1]
    source = json.loads((run / "source" / "metrics.json").read_text(encoding="utf-8"))
    assert emu.outputs["capture"]["pins"] == (f"{source['optimizer/logical_batch_sha256']},"
                                              f"{source['optimizer_batch/manifest_sha256']}")
    ok, bad = emu.procs["replay"]
    assert ok.returncode == 0 and "index 0 is arm ckpt-off" in ok.stdout and "reusing" in ok.stdout, \
        ok.stdout + ok.stderr
    assert bad.returncode == 2 and "differ from the capture's metrics.json" in bad.stderr
    (reduce,) = emu.procs["reduce"]
    assert reduce.returncode == 2, reduce.stdout + reduce.stderr
    verdict = json.loads(emu.outputs["reduce"]["verdict"])
    assert (verdict["status"], verdict["exit_code"]) == ("refused", 2)
    expected = next(c for c in verdict["checks"] if c["name"] == "inputs.expected_arms")
    assert (expected["status"], expected["offenders"]) == ("refused", ["ckpt-on"])
    assert (dest / "verdict.json").is_file()


def test_argo_reduce_waits_for_the_fan_out_however_it_ends(rendered: Path, tmp_path: Path) -> None:
    emu = ArgoEmulator(rendered / "argo.yaml", tmp_path, "u")
    reduce = next(t for t in emu.templates["ablation"]["dag"]["tasks"] if t["name"] == "reduce")
    for state, expected in (("Succeeded", True), ("Failed", True), ("Errored", True), ("Omitted", False)):
        emu.status = {"replay": state}
        assert emu.depends_met(reduce["depends"]) is expected, state


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


# --- several ranks: 2-rank capture, replays of 2 ranks and of 1 rank (torchrun in the pod, gloo) --------

RANKED = TINY.replace('repeats = 1\n', 'repeats = 1\nranks = 2\n\n[config]\n"distributed.strategy" = "ddp"\n') \
    .replace('"backend.options.gradient_checkpointing" = true', '"distributed.world_size" = 1') \
    .replace('name = "chain"', 'name = "ranks"')


def test_ranked_jobs_and_workflow_chain_to_a_passing_verdict(tmp_path: Path) -> None:
    """The rendered Jobs of a spec whose capture and arm ckpt-off run 2 ranks and arm ckpt-on 1
    (``distributed.world_size = 1``): the capture pod, each per-count replay Job's indexes
    (``--position K --ranks N``) and the reducer, then the Argo DAG's per-count templates over the
    same capture and replays (reused: each replay template's position and rank count must still map
    to its arm, and the reducer judges them again); both verdicts pass exact-input."""
    (tmp_path / "ablation.toml").write_text(RANKED, encoding="utf-8")
    assert main(["k8s", "render", str(tmp_path / "ablation.toml"), "--out", str(tmp_path / "k8s"),
                 "--argo", str(tmp_path / "argo.yaml")]) == 0
    mount = tmp_path / "artifacts"
    mount.mkdir()
    text = config_map_text(tmp_path / "k8s")
    by_name = {d["metadata"]["name"]: d for p in (tmp_path / "k8s").glob("*.yaml") for d in load(p)
               if d.get("kind") == "Job"}
    assert sorted(by_name) == ["ranks-capture", "ranks-reduce", "ranks-replay-r1", "ranks-replay-r2"]
    procs = [run_job(by_name["ranks-capture"], mount, text)]
    for name in ("ranks-replay-r1", "ranks-replay-r2"):
        procs += [run_job(by_name[name], mount, text, i) for i in range(by_name[name]["spec"]["completions"])]
    procs.append(run_job(by_name["ranks-reduce"], mount, text))
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(p.stdout + p.stderr for p in procs)
    run = mount / "runs" / "ranks" / "base"
    assert "on 2 ranks (torchrun)" in procs[0].stdout and "on 2 ranks (torchrun)" in procs[2].stdout
    assert sorted(p.name for p in (run / "source").glob("rank-*")) == ["rank-0", "rank-1"]
    off = json.loads((run / "replays" / "ckpt-off" / "0" / "replay_metrics.json").read_text(encoding="utf-8"))
    on = json.loads((run / "replays" / "ckpt-on" / "0" / "replay_metrics.json").read_text(encoding="utf-8"))
    assert (off["runtime"]["distributed.world_size"], on["runtime"]["distributed.world_size"]) == (2, 1)
    verdict = json.loads((run / "verdict.json").read_text(encoding="utf-8"))
    assert (verdict["status"], verdict["exit_code"]) == ("pass", 0), verdict

    emu = ArgoEmulator(tmp_path / "argo.yaml", mount, "0000-uid")
    dest = mount / "runs" / emu.name / emu.uid
    dest.mkdir(parents=True)
    for name in ("workspace", "source", "replays"):  # the Jobs above ran every replay for real
        shutil.copytree(run / name, dest / name)
    shutil.copy(run / "run.json", dest / "run.json")
    emu.run()
    assert emu.status == {"capture": "Succeeded", "replay-r1": "Succeeded", "replay-r2": "Succeeded",
                          "reduce": "Succeeded"}, emu.procs
    (r1,), (r2,) = emu.procs["replay-r1"], emu.procs["replay-r2"]
    assert "index 1 is arm ckpt-on repeat 0 ->" in r1.stdout and "reusing" in r1.stdout, r1.stdout
    assert "index 0 is arm ckpt-off repeat 0 on 2 ranks (torchrun)" in r2.stdout and "reusing" in r2.stdout, r2.stdout
    assert (json.loads(emu.outputs["capture"]["plan-r1"]), json.loads(emu.outputs["capture"]["plan-r2"])) \
        == ([1], [0])
    assert json.loads(emu.outputs["reduce"]["verdict"])["status"] == "pass"
