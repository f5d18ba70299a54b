"""The rendered manifests' own container commands, extracted from the YAML files, run here on CPU.

No cluster exists here, so this test plays the parts a cluster plays, and only those: the Kubernetes
API is the emulator of tests/k8s_emulator.py (the rendered setup and run files are applied to it, as
`kubectl apply -k` would); the Job controller and the kubelet are :class:`Kubelet`, which starts each
created Job's pods as local processes running the container's own command; the shared volume is a
temporary directory substituted for the ``/artifacts`` mount; the spec ConfigMap (Jobs) or raw input
artifact (Argo) is a file at ``/etc/replayjob/ablation.toml``'s place; each pod's emptyDirs are fresh
directories; the downward API (labels the Job controller adds, the run-id label, node and pod name,
namespace, completion-index annotation, CPU limit) and ``$(VAR)`` expansion, and Argo's ``{{...}}``
substitution, ``withParam`` fan-out, ``depends`` and output parameters are emulated by the small
interpreters below (an unknown reference fails the test).  The driver pod is given the emulator's
kubeconfig (``KUBECONFIG``; in a cluster it uses its service account's token) and a short poll
interval (``REPLAYJOB_POLL_S``).  The manifests are rendered by ``replayjob k8s render`` from a tiny
spec (CPU, 2 arms x 1 repeat), and a test checks that the committed ones differ from them only in
the spec's values.  The driver, the ``replayjob step`` commands and every artifact are real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_emulator import NS, Cluster, kubeconfig, serve
from kubernetes import client

from replayjob.artifacts.spec import load_spec_text
from replayjob.cli import main
from replayjob.launch import k8s
from replayjob.launch.submit import Api

REPO = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
Doc = dict[str, Any]
pytestmark = pytest.mark.slow
TINY = """\
name = "chain"
image = "registry.example/replayjob@sha256:""" + "ab" * 32 + """"
gpu_product = "none"
storage_class = "local-rwx"
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
    assert main(["k8s", "render", str(d / "ablation.toml"), "--out", str(d / "k8s"), "--setup", str(d / "setup"),
                 "--argo", str(d / "argo.yaml")]) == 0
    return d


class Pod:
    """One pod's filesystem and downward API: the volume, its emptyDirs, the spec file."""

    def __init__(self, mount: Path, name: str, spec_text: str, labels: dict[str, str],
                 annotations: dict[str, str] | None = None, extra_env: dict[str, str] | None = None):
        self.mount, self.name, self.extra_env = mount, name, extra_env or {}
        self.root = mount.parent / "pods" / name
        for sub in ("tmp", "cache", "spec"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "spec" / "ablation.toml").write_text(spec_text, encoding="utf-8")
        self.fields = {"spec.nodeName": "node-a", "metadata.name": name, "metadata.namespace": NS,
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
                env[e["name"]] = self.fields.get(e["valueFrom"]["fieldRef"]["fieldPath"], "")  # a missing label: ""
            else:
                assert e["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
                env[e["name"]] = "1"
        cmd = [self.local(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], w)) for w in c["command"]]
        assert cmd[0] == "replayjob"  # one command, no shell
        env["PATH"] = f"{BIN}:/usr/bin:/bin"
        env.update(self.extra_env)
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def run_job(job: Doc, mount: Path, spec_text: str, index: int | None = None, name: str | None = None,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One pod of ``job`` (its index), labelled as the Job controller labels its pods."""
    tpl = job["spec"]["template"]
    ann = {k8s.INDEX_ANNOTATION: str(index)} if index is not None else None
    labels = {**tpl["metadata"]["labels"], k8s.JOB_NAME_LABEL: job["metadata"]["name"],
              k8s.CONTROLLER_UID_LABEL: job["metadata"].get("uid", "")}
    name = name or f"{job['metadata']['name']}-{index if index is not None else 0}"
    return Pod(mount, name, spec_text, labels, ann, extra_env).run(tpl["spec"]["containers"][0])


def volume_config_map(job: Doc) -> str:
    return next(v["configMap"]["name"] for v in job["spec"]["template"]["spec"]["volumes"] if "configMap" in v)


@dataclass
class Kubelet:
    """The Job controller and the kubelet: each created Job's pods, in index order, as local processes
    (a driver pod registered with the emulator first, as the driver reads its own pod)."""

    cluster: Cluster
    mount: Path
    kubeconfig: Path
    procs: dict[str, list[subprocess.CompletedProcess[str]]] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def __call__(self, job: Doc) -> None:
        thread = threading.Thread(target=self.run, args=(job,), daemon=True)
        thread.start()
        self.threads.append(thread)

    def run(self, job: Doc) -> None:
        name = job["metadata"]["name"]
        text = self.cluster.objects[("ConfigMap", volume_config_map(job))]["data"]["ablation.toml"]
        if job["metadata"]["labels"]["app.kubernetes.io/component"] == k8s.DRIVER:
            pod = f"{name}-x7k2p"
            self.cluster.add({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                              "spec": job["spec"]["template"]["spec"]})
            procs = [run_job(job, self.mount, text, name=pod, extra_env={
                "KUBECONFIG": str(self.kubeconfig), "REPLAYJOB_POLL_S": "0.2"})]
        elif job["spec"].get("completionMode") == "Indexed":
            procs = [run_job(job, self.mount, text, i) for i in range(job["spec"]["completions"])]
        else:
            procs = [run_job(job, self.mount, text)]
        codes = {p.returncode for p in procs}
        self.procs[name] = procs
        with self.cluster.lock:
            self.cluster.finished[name] = next((c for c in (1, 2, 3) if c in codes), max(codes))


@dataclass
class KubeRun:
    """One run applied from the rendered files, driven to its end."""

    cluster: Cluster
    kubelet: Kubelet
    run_id: str
    run: Path  # its run directory
    text: str  # its spec, as the run's ConfigMap holds it

    def stage(self, component: str) -> Doc:
        return next(d for (k, _), d in self.cluster.objects.items() if k == "Job"
                    and d["metadata"]["labels"]["app.kubernetes.io/component"] == component)


@pytest.fixture(scope="module")
def k8s_run(rendered: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeRun]:
    """`kubectl apply -k setup`, then `kubectl apply -k k8s` (the base: spec ConfigMap and driver): the
    driver creates the stages one after another, each run by the Kubelet, until the reducer's verdict."""
    tmp = tmp_path_factory.mktemp("k8s")
    mount = tmp / "artifacts"
    mount.mkdir()
    cluster = Cluster()
    cluster.running_reads, cluster.scripted = 0, False  # a Job ends when its pods have
    with serve(cluster) as host:
        (tmp / "kubeconfig").write_text(kubeconfig(host), encoding="utf-8")
        kubelet = Kubelet(cluster, mount, tmp / "kubeconfig")
        cluster.on_create = kubelet
        api = Api(client.ApiClient(client.Configuration(host=host)), log=lambda s: None)
        for name in load(rendered / "setup" / "kustomization.yaml")[0]["resources"]:
            cluster.add(load(rendered / "setup" / name)[0])  # applied once, before
        for name in load(rendered / "k8s" / "kustomization.yaml")[0]["resources"]:
            api.create(NS, load(rendered / "k8s" / name)[0])  # the run: its ConfigMap, then the driver
        deadline = time.monotonic() + 600
        while "chain-driver" not in cluster.finished:
            assert time.monotonic() < deadline, "the driver never ended"
            time.sleep(0.1)
        for thread in kubelet.threads:
            thread.join(timeout=60)
        (drv,) = kubelet.procs["chain-driver"]
        match = re.search(r"driver: run ([0-9a-f]{16}) in namespace", drv.stdout)
        assert match, drv.stdout + drv.stderr
        run_id = match.group(1)
        text = cluster.objects[("ConfigMap", f"chain-{run_id}-spec")]["data"]["ablation.toml"]
        yield KubeRun(cluster, kubelet, run_id, mount / "runs" / "chain" / run_id, text)


def test_committed_manifests_run_the_same_commands_as_the_tiny_render(rendered: Path, k8s_run: KubeRun) -> None:
    """The committed base's driver, and the stages it creates for the example spec, run the commands
    the tiny spec's driver and stages ran here."""
    (ours,), (committed,) = load(rendered / "k8s" / "driver.yaml"), load(REPO / "k8s" / "base" / "driver.yaml")
    c, c2 = ours["spec"]["template"]["spec"]["containers"][0], committed["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == c2["command"] == ["replayjob", "k8s", "drive", "--spec", k8s.SPEC_FILE]
    assert [e["name"] for e in c["env"]] == [e["name"] for e in c2["env"]]
    example = k8s.stage_jobs(load_spec_text(REPO / "examples" / "ablation.toml")[0], k8s_run.run_id)
    for stage, job in example.items():
        ran = k8s_run.stage(job["metadata"]["labels"]["app.kubernetes.io/component"])
        c, c2 = ran["spec"]["template"]["spec"]["containers"][0], job["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == [w.replace("replayjob-ablation", "chain") for w in c2["command"]], stage
        assert [e["name"] for e in c["env"]] == [e["name"] for e in c2["env"]], stage


def test_k8s_job_commands_chain_to_a_passing_verdict(k8s_run: KubeRun) -> None:
    """The driver chained capture, replays and reduce (each created after the one before ended) to the
    reducer's code; the run directory is the driver Job's uid's, never the base's."""
    run, procs = k8s_run.run, k8s_run.kubelet.procs
    prefix = f"chain-{k8s_run.run_id}"
    order = [c.split()[-1] for c in k8s_run.cluster.calls if c.startswith("POST jobs")]
    assert order == ["chain-driver", f"{prefix}-capture", f"{prefix}-replay", f"{prefix}-reduce"]
    flat = [p for name in order[1:] for p in procs[name]]
    assert [p.returncode for p in flat] == [0, 0, 0, 0], "\n".join(p.stdout + p.stderr for p in flat)
    (drv,) = procs["chain-driver"]
    assert drv.returncode == 0 and f"the reducer (job/{prefix}-reduce) exited 0, verdict pass (exit 0)" in drv.stdout, \
        drv.stdout + drv.stderr
    published = k8s_run.cluster.objects[("ConfigMap", f"{prefix}-spec")]["data"][k8s.VERDICT_KEY]
    assert published == (run / "verdict.json").read_text(encoding="utf-8")  # read back through the strict reader
    me = k8s_run.cluster.objects[("Job", "chain-driver")]
    assert k8s_run.run_id == me["metadata"]["uid"].replace("-", "")[:16]
    assert me["metadata"]["labels"][k8s.RUN_ID_LABEL] == k8s_run.run_id
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
        assert data["host"]["pod"].startswith(f"{prefix}-replay-")
        assert data["provenance"]["pythonhashseed"] == "0"
        assert data["provenance"]["nccl_algo"] == "Ring"
    record = json.loads((run / "run.json").read_text(encoding="utf-8"))
    assert record["image"].endswith("ab" * 32) and len(record["fingerprint"]) == 64
    assert record["image_digest"] == "sha256:" + "ab" * 32


def test_retried_pods_reuse_completed_stages(k8s_run: KubeRun) -> None:
    """A retried pod (an infrastructure failure after the work was done) neither redoes nor refuses it."""
    run, mount = k8s_run.run, k8s_run.run.parents[2]
    before = (run / "source" / "metrics.json").stat().st_mtime_ns
    for proc in (run_job(k8s_run.stage("capture"), mount, k8s_run.text),
                 run_job(k8s_run.stage("replay"), mount, k8s_run.text, 1)):
        assert proc.returncode == 0 and "reusing" in proc.stdout, proc.stdout + proc.stderr
    assert (run / "source" / "metrics.json").stat().st_mtime_ns == before


def test_a_run_directory_of_another_spec_is_refused(k8s_run: KubeRun) -> None:
    """An edited spec is refused: by the run record (a seed) or, for a field the manifests were
    computed from (the number of replays), by the render-time check before that."""
    mount = k8s_run.run.parents[2]
    text = k8s_run.text.replace("repeats = 1", "repeats = 1\nseed = 7")
    proc = run_job(k8s_run.stage("replay"), mount, text, 1)
    assert proc.returncode == 2 and "holds another run's artifacts" in proc.stderr
    assert "Traceback" not in proc.stderr
    text = k8s_run.text.replace("repeats = 1", "repeats = 2")
    proc = run_job(k8s_run.stage("replay"), mount, text, 1)
    assert proc.returncode == 2 and 'replays = {"1": 2} rendered, {"1": 4} here' in proc.stderr, proc.stderr


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

    def workflow_status(self) -> Doc:
        """The Workflow object the controller would hold now: one pod node per step run, with its
        template, phase and exit code, and the global verdict output (what `argo wait` reads)."""
        nodes, phase = {}, "Succeeded"
        for task, procs in self.procs.items():
            template = next(t["template"] for t in self.templates["ablation"]["dag"]["tasks"] if t["name"] == task)
            for n, proc in enumerate(procs):
                nid = f"{self.name}-{task}-{n}"
                nodes[nid] = {"id": nid, "name": f"{self.name}.{task}({n})", "displayName": f"{task}({n})",
                              "type": "Pod", "templateName": template,
                              "phase": "Succeeded" if proc.returncode == 0 else "Failed",
                              "outputs": {"exitCode": str(proc.returncode)}}
                phase = phase if proc.returncode == 0 else "Failed"
        verdict = self.outputs.get("reduce", {}).get("verdict", "")
        return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                "metadata": {"name": self.name, "uid": self.uid}, "spec": {"workflowTemplateRef": {"name": self.name}},
                "status": {"phase": phase, "nodes": nodes,
                           "outputs": {"parameters": [{"name": "verdict", "value": verdict}]}}}


def test_argo_reduce_runs_after_a_planted_replay_failure_and_refuses(
        k8s_run: KubeRun, rendered: Path, tmp_path: Path) -> None:
    """The capture step reuses a prepared volume (its retry path) and still publishes the plan and the
    pins; replay 0 passes (reusing the replay the Jobs ran for arm ckpt-off); replay 1 receives pins
    that are not the capture's (the planted failure) and refuses; the reducer runs anyway and writes a
    verdict naming the arm: incomplete (exit 3), since the missing replay decided nothing."""
    run = k8s_run.run
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
    assert reduce.returncode == 3, reduce.stdout + reduce.stderr  # nothing decided: a stage left no replay
    verdict = json.loads(emu.outputs["reduce"]["verdict"])
    assert (verdict["status"], verdict["exit_code"], verdict["missing"]) == ("incomplete", 3, ["replays/ckpt-on/0"])
    expected = next(c for c in verdict["checks"] if c["name"] == "inputs.expected_arms")
    assert (expected["status"], expected["offenders"]) == ("refused", ["ckpt-on"])
    assert (dest / "verdict.json").is_file()


def test_argo_reduce_waits_for_the_fan_out_however_it_ends(rendered: Path, tmp_path: Path) -> None:
    emu = ArgoEmulator(rendered / "argo.yaml", tmp_path, "u")
    reduce = next(t for t in emu.templates["ablation"]["dag"]["tasks"] if t["name"] == "reduce")
    for state, expected in (("Succeeded", True), ("Failed", True), ("Errored", True), ("Omitted", False)):
        emu.status = {"capture": "Succeeded", "replay": state}
        assert emu.depends_met(reduce["depends"]) is expected, state
    for state in ("Failed", "Errored"):  # no replay runs then; the reducer still does
        emu.status = {"capture": state, "replay": "Omitted"}
        assert emu.depends_met(reduce["depends"]) is True, state


def test_argo_a_failed_capture_still_ends_in_a_verdict_that_argo_wait_returns(
        rendered: Path, tmp_path: Path) -> None:
    """The capture fails (here: its template provisions another rank count than the spec's, refused
    before any work); no replay runs, the reducer does and writes an incomplete verdict (nothing was
    decided); the Workflow's status then gives `replayjob argo wait` the reduce step's code, 3."""
    from replayjob.launch.workflow import workflow_code

    emu = ArgoEmulator(rendered / "argo.yaml", tmp_path / "artifacts", "1111-uid")
    cmd = emu.templates["capture"]["container"]["command"]
    cmd[cmd.index("--ranks") + 1] = "2"
    emu.run()
    assert emu.status == {"capture": "Failed", "replay": "Omitted", "reduce": "Failed"}, emu.procs
    (reduce,) = emu.procs["reduce"]
    assert reduce.returncode == 3 and "step: no capture" in reduce.stdout, reduce.stdout + reduce.stderr
    verdict = json.loads(emu.outputs["reduce"]["verdict"])
    assert (verdict["status"], verdict["exit_code"]) == ("incomplete", 3) and "source" in verdict["missing"]
    code, line = workflow_code(emu.workflow_status())
    assert code == 3 and "reduce step reduce(0) exited 3" in line and "verdict incomplete" in line


# --- the workstation script ------------------------------------------------------------------

def smoke(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    return subprocess.run(["bash", str(REPO / "scripts" / "local-mid-smoke.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.alone  # the funnel times warm updates: run alone on the host
def test_local_mid_smoke_on_cpu_passes_and_writes_the_verdict(tmp_path: Path) -> None:
    """The wrapper runs the funnel (docs/funnel.md; every stage is tested in test_funnel.py)."""
    proc = smoke("--repeats", "1", "--fixed-blocks", "--only-ablation", "--out", str(tmp_path / "smoke"))
    if proc.returncode == 3 and json.loads((tmp_path / "smoke" / "funnel.json").read_text())["status"] == "contended":
        pytest.skip("other work on this host contended with the timed updates (reported as such, exit 3)")
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


@pytest.mark.alone  # replays of two ranks rendezvous (torchrun, gloo)
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
    spec, text = load_spec_text(tmp_path / "ablation.toml")
    by_name = {d["metadata"]["name"]: d for d in k8s.stage_jobs(spec, "r1").values()}  # what its driver creates
    assert sorted(by_name) == ["ranks-r1-capture", "ranks-r1-reduce", "ranks-r1-replay-r1", "ranks-r1-replay-r2"]
    procs = [run_job(by_name["ranks-r1-capture"], mount, text)]
    for name in ("ranks-r1-replay-r1", "ranks-r1-replay-r2"):
        procs += [run_job(by_name[name], mount, text, i) for i in range(by_name[name]["spec"]["completions"])]
    procs.append(run_job(by_name["ranks-r1-reduce"], mount, text))
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(p.stdout + p.stderr for p in procs)
    run = mount / "runs" / "ranks" / "r1"
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


def test_a_trl_capture_chains_through_the_rendered_jobs_and_workflow(trl_capture_steps: Path, tmp_path: Path) -> None:
    """A spec whose [capture] names an existing TRL capture (reachable from every pod: here its local
    path) runs unedited through the rendered Jobs' and the Argo workflow's own commands: the capture
    pod verifies it (no workspace, no training, RUN/capture.json), the replay pod replays its own
    replay.toml, the reducer judges it against the capture; a wrong pin is refused
    at render."""
    from tests.conftest import capture_spec

    image = {"image": "registry.example/replayjob@sha256:" + "ab" * 32, "image_policy": "digest"}
    arm = "[arms.baseline]\n"  # one replay (the arms' TRL knobs are the funnel test's)
    (tmp_path / "ablation.toml").write_text(capture_spec(trl_capture_steps, name="trlchain", arms=arm, **image))
    assert main(["k8s", "render", str(tmp_path / "ablation.toml"), "--out", str(tmp_path / "k8s"),
                 "--argo", str(tmp_path / "argo.yaml")]) == 0
    mount = tmp_path / "artifacts"
    mount.mkdir()
    spec, text = load_spec_text(tmp_path / "ablation.toml")
    by_name = {d["metadata"]["name"]: d for d in k8s.stage_jobs(spec, "r1").values()}
    replay = by_name["trlchain-r1-replay"]
    procs = [run_job(by_name["trlchain-r1-capture"], mount, text),
             *(run_job(replay, mount, text, i) for i in range(replay["spec"]["completions"])),
             run_job(by_name["trlchain-r1-reduce"], mount, text)]
    assert [p.returncode for p in procs] == [0] * 3, "\n".join(p.stdout + p.stderr for p in procs)
    run = mount / "runs" / "trlchain" / "r1"
    assert "verified the trl capture" in procs[0].stdout and "no training" in procs[0].stdout
    assert not (run / "workspace").exists() and not (run / "source").exists()
    assert json.loads((run / "capture.json").read_text())["admission"]["admitted"] is True
    m = json.loads((run / "replays" / "baseline" / "0" / "replay_metrics.json").read_text(encoding="utf-8"))
    assert (m["framework"], m["arm"], m["host"]["pod"].startswith("trlchain-r1-replay-")) == ("trl", "baseline", True)
    verdict = json.loads((run / "verdict.json").read_text(encoding="utf-8"))
    assert (verdict["status"], verdict["exit_code"]) == ("pass", 0), verdict

    emu = ArgoEmulator(tmp_path / "argo.yaml", mount, "0000-uid")
    dest = mount / "runs" / emu.name / emu.uid
    dest.mkdir(parents=True)
    shutil.copytree(run / "replays", dest / "replays")  # the Jobs above ran every replay for real
    shutil.copy(run / "run.json", dest / "run.json")
    emu.run()
    assert emu.status == {"capture": "Succeeded", "replay": "Succeeded", "reduce": "Succeeded"}, emu.procs
    assert "verified the trl capture" in emu.procs["capture"][0].stdout
    source = json.loads((trl_capture_steps / "metrics.json").read_text(encoding="utf-8"))
    assert emu.outputs["capture"]["pins"] == (f"{source['optimizer/logical_batch_sha256']},"
                                              f"{source['optimizer_batch/manifest_sha256']}")
    assert json.loads(emu.outputs["reduce"]["verdict"])["status"] == "pass"

    # wrong pins, a knob of replayjob's own trainer but not of TRL's, or a math mode the capture did not run in
    bad = tmp_path / "bad.toml"
    for text in (capture_spec(trl_capture_steps, name="trlchain", pins=("0" * 64, "1" * 64), **image),
                 capture_spec(trl_capture_steps, name="trlchain", math_mode="pedantic", **image),
                 capture_spec(trl_capture_steps, name="trlchain", **image,
                              arms='[arms.on]\n"backend.options.attn_implementation" = "sdpa"\n')):
        bad.write_text(text)
        assert main(["k8s", "render", str(bad), "--out", str(tmp_path / "never")]) == 2
        assert not (tmp_path / "never").exists()
