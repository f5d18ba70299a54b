"""Runs across nodes on Kubernetes: the JobSets of ``replayjob.launch.jobset``, validated by the engine's
own schema.

Every JobSet is validated strictly against the JobSet CRD's OpenAPI schema (vendored from
kubernetes-sigs/jobset, tests/schemas/README.md) with ``additionalProperties: false`` added to every
object that lists its properties; its embedded Job template (pod template included) is validated as a
``batch/v1`` Job by kubernetes-validate in strict mode at the oldest and the latest Kubernetes the
manifests support, as the stage Jobs are.  Each checker is shown to reject a planted defect.  That two
nodes meet through torchrun's c10d rendezvous and replay bitwise like one is run for real in
tests/test_multinode.py.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from replayjob.artifacts.spec import AblationSpec, Arm, load_spec_text
from replayjob.errors import ConfigError, UsageError
from replayjob.launch import argo, jobset, k8s
from replayjob.runtime import distributed
from tests.test_deploy_manifests import k8s_errors

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "tests" / "schemas" / "jobset" / "jobset.x-k8s.io_jobsets-v0.12.0.yaml"  # source, licence: README
RUN = "0f1e2d3c4b5a4697"
Doc = dict[str, Any]


def _strict(node: Any) -> None:
    """``additionalProperties: false`` on every object schema that lists its properties (unless it keeps
    unknown fields on purpose), as the API server prunes or refuses unknown fields."""
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


@functools.cache
def validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == jobset.API_VERSION.split("/")[1]]
    assert crd["spec"]["group"] == jobset.API_VERSION.split("/")[0] and crd["spec"]["names"]["kind"] == jobset.KIND
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    _strict(schema)
    return jsonschema.Draft202012Validator(schema)


def crd_errors(doc: Doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator().iter_errors(doc)]


def job_of(doc: Doc) -> Doc:
    """The JobSet's replicated Job as the Job the JobSet controller creates from it."""
    (rjob,) = doc["spec"]["replicatedJobs"]
    tpl = rjob["template"]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{doc['metadata']['name']}-{rjob['name']}-0", **copy.deepcopy(tpl["metadata"])},
            "spec": copy.deepcopy(tpl["spec"])}


def all_errors(doc: Doc) -> list[str]:
    return crd_errors(doc) + [e for v in k8s.KUBERNETES_VERSIONS for e in k8s_errors(job_of(doc), v)]


def multi_spec(**changes: Any) -> AblationSpec:
    """Nodes of 2 GPUs; the capture on 4 ranks (2 nodes), arms of 4 ranks (2 nodes), 2 (one node) and 8
    (4 nodes)."""
    spec, _ = load_spec_text(REPO / "examples" / "ablation.toml")
    spec = dataclasses.replace(spec, node_gpus=2, ranks=4, repeats=1, min_repeats=0,
                               config={"distributed.strategy": "ddp"},
                               arms=(Arm("four"), Arm("two", {"distributed.world_size": 2}),
                                     Arm("eight", {"distributed.world_size": 8})))
    return dataclasses.replace(spec, **changes)


def test_a_run_needing_more_gpus_than_a_node_has_is_one_jobset_of_its_nodes() -> None:
    spec = multi_spec()
    assert [spec.nodes_for(w) for w in (1, 2, 4, 8)] == [(1, 1), (1, 2), (2, 2), (4, 2)]
    owner = k8s.owner_reference({"metadata": {"name": "replayjob-ablation-driver", "uid": "u-1"}})
    files = jobset.stage_jobsets(spec, RUN, owner)
    assert list(files) == ["capture.yaml", "replay-0.yaml", "replay-2.yaml"]  # replay 1 runs 2 ranks: one node
    for name, doc in files.items():
        assert all_errors(doc) == [], name
        index = None if name == "capture.yaml" else int(name.removeprefix("replay-").removesuffix(".yaml"))
        world = spec.ranks if index is None else spec.ranks_for_index(index)
        nodes = world // 2
        js = doc["metadata"]["name"]
        assert js == f"replayjob-ablation-{RUN}-" + ("capture" if index is None else f"replay-{index}")
        assert doc["metadata"]["ownerReferences"] == [owner]
        assert doc["metadata"]["labels"][k8s.RANKS_LABEL] == str(world)
        job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == (
            "Indexed", nodes, nodes, 0)
        pod = job["template"]["spec"]
        (c,) = pod["containers"]
        assert c["resources"]["requests"][k8s.GPU_RESOURCE] == c["resources"]["limits"][k8s.GPU_RESOURCE] == "2"
        assert c["resources"]["limits"]["cpu"] == k8s.scale_quantity(spec.cpu, 2)  # this node's 2 ranks
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[distributed.NODES_ENV] == str(nodes) and env[distributed.RDZV_ID_ENV] == js
        (rank,) = [e for e in c["env"] if e["name"] == distributed.NODE_RANK_ENV]  # the pod's completion index
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{k8s.INDEX_ANNOTATION}']"
        # the rendezvous host is the first pod's name under the JobSet's headless Service
        assert env[distributed.RDZV_ENDPOINT_ENV] == f"{js}-{jobset.NODE_JOB}-0-0.{js}:{jobset.RDZV_PORT}"
        assert doc["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": js, "publishNotReadyAddresses": True}
        assert c["command"][:3] == ["replayjob", "step", "capture" if index is None else "replay"]
        assert c["command"][-2:] == ["--ranks", str(world)]
        if index is not None:
            assert c["command"][c["command"].index("--index") + 1] == str(index)
        # the same pod as every stage's: placement, security, determinism environment, the run's spec
        stage = k8s.pod_template(spec, "replay", k8s.container(spec, ["x"], True), True, RUN)["spec"]
        assert {k: v for k, v in pod.items() if k != "containers"} == {k: v for k, v in stage.items()
                                                                       if k != "containers"}
        assert env["REPLAYJOB_MATH_MODE"] == "pedantic" and c["securityContext"] == k8s.container_security()
        # 1 or 2 fail the Job by its podFailurePolicy, and the JobSet with it; anything else recreates it
        assert job["podFailurePolicy"]["rules"] == k8s.POD_FAILURE_RULES
        assert doc["spec"]["failurePolicy"] == {"maxRestarts": k8s.RETRIES, "rules": [
            {"name": "finalExitCode", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]}
        assert "suspend" not in doc["spec"]


def test_a_queue_admits_the_jobset_as_one_workload() -> None:
    doc = jobset.jobset(multi_spec(queue="gpu-queue"), RUN, 0)
    assert doc["spec"]["suspend"] is True and doc["metadata"]["labels"][k8s.QUEUE_LABEL] == "gpu-queue"
    assert all_errors(doc) == []


def test_the_checkers_reject_planted_defects() -> None:
    good = jobset.jobset(multi_spec(), RUN, 0)
    bad = copy.deepcopy(good)
    bad["spec"]["replicatedJob"] = bad["spec"].pop("replicatedJobs")  # misspelled
    assert any("replicatedJob" in e for e in crd_errors(bad))
    bad = copy.deepcopy(good)
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "FailJob"  # a Job's action, not a JobSet's
    assert any("FailJob" in e for e in crd_errors(bad))
    bad = copy.deepcopy(good)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["gpus"] = 2
    assert crd_errors(bad) and any("gpus" in e for e in all_errors(bad))  # the embedded pod, by both
    bad = copy.deepcopy(good)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["restartPolicy"] = 3
    assert crd_errors(bad) and k8s_errors(job_of(bad), k8s.KUBERNETES_VERSIONS[0])


def test_runs_on_one_node_render_as_today() -> None:
    spec, _ = load_spec_text(REPO / "examples" / "ablation.toml")
    assert spec.across_nodes() == {} and jobset.stage_jobsets(spec, RUN) == {}
    assert spec.nodes_for(spec.ranks) == (1, spec.ranks)
    with pytest.raises(ConfigError, match="on one node: a Job of one pod"):
        jobset.jobset(multi_spec(), RUN, 1)
    nodes8 = dataclasses.replace(multi_spec(), node_gpus=8)  # every run fits a node of 8
    assert nodes8.across_nodes() == {} and nodes8.nodes_for(8) == (1, 8)
    cpu = dataclasses.replace(multi_spec(), device="cpu")  # node_gpus counts GPUs: CPU runs stay on one node
    assert cpu.across_nodes() == {}


def test_ranks_that_do_not_split_evenly_over_nodes_are_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("the arm odd runs 3 ranks, one GPU each, over 2 nodes of "
                                                    "node_gpus = 2: the ranks do not split evenly")) as info:
        dataclasses.replace(multi_spec(), arms=(Arm("odd", {"distributed.world_size": 3}),))
    assert "2 or 4 ranks (2 nodes of 1 or 2)" in (info.value.hint or "")


def test_a_pod_name_beyond_a_dns_label_is_refused() -> None:
    spec = multi_spec(name="a" * 30)
    with pytest.raises(ConfigError, match="longer than a DNS label"):
        jobset.jobset(spec, "b" * 40, 0)


def test_the_argo_workflow_of_one_pod_per_run_refuses_runs_across_nodes() -> None:
    spec = multi_spec()
    text = (REPO / "examples" / "ablation.toml").read_text(encoding="utf-8")
    with pytest.raises(UsageError, match=r"the capture, replay 0, replay 2 run on more than one node"):
        argo.render(spec, text)
    files = k8s.render(spec, text)  # the in-cluster driver creates the JobSets (tests/test_deploy_submit.py)
    assert set(files) == {"spec.yaml", "driver.yaml", "kustomization.yaml", k8s.KUSTOMIZE_CONFIG_FILE}
    jobs = k8s.stage_jobs(spec, RUN)  # no Job for a run across nodes: the 2-rank replay's only
    assert list(jobs) == ["replay-r2.yaml", "reduce.yaml"]


def test_what_a_jobset_pod_is_given_is_what_the_launch_reads() -> None:
    """The rendered pod's rendezvous environment, with the completion index the downward API gives each pod,
    is what replayjob.runtime.distributed reads: K nodes of W/K ranks meeting at the first pod, which alone
    hosts the store."""
    spec = multi_spec()
    for index in (0, 2):
        doc = jobset.jobset(spec, RUN, index)
        (c,) = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        world = spec.ranks_for_index(index)
        nodes, per_node = spec.nodes_for(world)
        for node in range(nodes):
            pod_env = {**env, distributed.NODE_RANK_ENV: str(node)}
            rdzv = distributed.rendezvous(pod_env)
            assert rdzv == distributed.Rendezvous(nodes, f"{jobset.leader(doc['metadata']['name'])}:29400",
                                                  doc["metadata"]["name"], node)
            cmd = distributed.launch_command(world, ["replay"], environ=pod_env)
            assert cmd[cmd.index("--nproc-per-node") + 1] == str(per_node)
            assert cmd[cmd.index("--rdzv-conf") + 1] == f"is_host={'true' if node == 0 else 'false'}"
