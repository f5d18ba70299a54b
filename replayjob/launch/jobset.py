"""Runs across nodes on Kubernetes: one JobSet (``jobset.x-k8s.io/v1alpha2``) per capture or replay that
needs more GPUs than one node has.

A run of ``W`` ranks spans ``K`` nodes when the spec says a node has ``node_gpus = G < W`` GPUs
(:meth:`~replayjob.artifacts.spec.AblationSpec.nodes_for`: ``K = ceil(W / G)``, ``W / K`` ranks on each).
Such a run is one JobSet (the Kubernetes SIG's engine for groups of Jobs, installed in the cluster
once): one replicated Job ``n`` of ``K`` pods (``completionMode: Indexed``), every pod requesting every
GPU of its node and running the same command as a one-node run, ``replayjob step capture|replay ...
--ranks W``, with the rendezvous in its environment (:mod:`replayjob.runtime.distributed`):

* ``REPLAYJOB_NODES = K``; each pod's step starts its ``W / K`` ranks with ``torchrun --nnodes K
  --nproc-per-node W/K --rdzv-backend c10d``;
* ``REPLAYJOB_RDZV_ENDPOINT``: the first pod's stable name, ``JOBSET-n-0-0.JOBSET:29400``, which JobSet's
  headless Service (``network.enableDNSHostnames``, ``publishNotReadyAddresses``) resolves as soon as
  the pod exists;
* ``REPLAYJOB_RDZV_ID``: the JobSet's name (the run id and the replay's index are in it);
* ``REPLAYJOB_NODE_RANK``: the pod's completion index (downward API): pod 0 hosts the rendezvous store
  (``--rdzv-conf is_host=true``), the others connect to it (``is_host=false``), so no agent has to guess
  from DNS whether the endpoint's name is its own.

Every pod runs the step: the same checks, the same run record; the first to find an interrupted
attempt's partial output moves it aside (before the rendezvous, so before any rank writes), and each
returns once every rank of every node has ended (torchrun's exit barrier), so each pod's exit code is
the run's.  Failures: the pod's ``podFailurePolicy`` is the Jobs' (1 or 2 fail the Job at once, reason
``PodFailurePolicy``); the Job has ``backoffLimit: 0`` (a rank lost on one node fails every node's
launch: the gang restarts together), and the JobSet's ``failurePolicy`` fails the whole JobSet on a
``PodFailurePolicy`` failure (final) and otherwise recreates it, at most :data:`replayjob.launch.k8s.RETRIES`
times.  Placement, security, the spec's ``[pods]``, the determinism environment and the queue label are
those of every stage pod (:func:`replayjob.launch.k8s.pod_template`), so the embedded pod template passes
the same schema checks as the Jobs'.  The in-cluster driver (:mod:`replayjob.launch.k8s_driver`) creates
them and follows them as it follows a Job; the Argo workflow refuses such a spec
(:func:`replayjob.launch.k8s.check_one_node`).
"""

from __future__ import annotations

from typing import Any

from replayjob.artifacts.spec import AblationSpec
from replayjob.errors import ConfigError
from replayjob.launch import k8s
from replayjob.runtime import distributed

API_VERSION = "jobset.x-k8s.io/v1alpha2"
KIND = "JobSet"
GROUP, VERSION = API_VERSION.split("/")
PLURAL = "jobsets"
NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # set by the JobSet controller on every pod of a JobSet
NODE_JOB = "n"  # the replicated Job: pod hostnames are JOBSET-n-0-<node>, within the 63-character DNS label
RDZV_PORT = 29400  # torchrun's default c10d port
FINAL_REASON = "PodFailurePolicy"  # a Job failed by its podFailurePolicy's FailJob rule: exit 1 or 2
Doc = dict[str, Any]


def name_of(spec: AblationSpec, run_id: str, index: int | None) -> str:
    """The JobSet's name: ``NAME-RUNID-capture`` or ``NAME-RUNID-replay-I``."""
    return f"{k8s.prefix(spec, run_id)}-" + ("capture" if index is None else f"replay-{index}")


def child_job(name: str) -> str:
    """The name of the one Job the JobSet controller creates from a JobSet of this module's."""
    return f"{name}-{NODE_JOB}-0"


def leader(name: str) -> str:
    """The first pod's stable name, as JobSet's headless Service publishes it: the rendezvous host."""
    return f"{name}-{NODE_JOB}-0-0.{name}"


def jobset(spec: AblationSpec, run_id: str, index: int | None = None, owner: k8s.OwnerRef | None = None) -> Doc:
    """The JobSet of the capture (``index`` None) or of replay ``index``, which must need several nodes."""
    world = spec.ranks if index is None else spec.ranks_for_index(index)
    nodes, per_node = spec.nodes_for(world)
    if nodes < 2:
        raise ConfigError(f"the {'capture' if index is None else f'replay {index}'} runs {world} ranks on one node: "
                          "a Job of one pod, not a JobSet", where="node_gpus")
    name = name_of(spec, run_id, index)
    host = f"{name}-{NODE_JOB}-0-{nodes - 1}"
    if len(host) > 63 or len(name) > 63:
        raise ConfigError(f"the pod name {host!r} is longer than a DNS label (63 characters)", where="name",
                          hint="a shorter spec name")
    component = "capture" if index is None else "replay"
    where = [] if index is None else ["--index", str(index), "--wait-s", str(k8s.REPLAY_WAIT_S)]
    rdzv = {distributed.NODES_ENV: str(nodes), distributed.RDZV_ENDPOINT_ENV: f"{leader(name)}:{RDZV_PORT}",
            distributed.RDZV_ID_ENV: name}
    node_rank = k8s.field_env(distributed.NODE_RANK_ENV, f"metadata.annotations['{k8s.INDEX_ANNOTATION}']")
    cont = k8s.container(spec, k8s.step_command(component, k8s.run_dir(spec), *where, "--ranks", str(world)),
                         spec.gpu, [*k8s.env_list(rdzv), node_rank], per_node)
    template = k8s.pod_template(spec, component, cont, spec.gpu, run_id, world)
    labels = k8s.labels(spec, component, run_id)
    labels[k8s.RANKS_LABEL] = str(world)
    if spec.queue:  # Kueue admits the JobSet as one workload: every node's pod or none
        labels[k8s.QUEUE_LABEL] = spec.queue
    body: Doc = {
        "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All"},
        "failurePolicy": {"maxRestarts": k8s.RETRIES, "rules": [
            {"name": "finalExitCode", "action": "FailJobSet", "onJobFailureReasons": [FINAL_REASON]}]},
        "replicatedJobs": [{"name": NODE_JOB, "replicas": 1, "template": {
            "metadata": {"labels": dict(template["metadata"]["labels"])},
            "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 0,
                     "activeDeadlineSeconds": spec.deadline_s,
                     "podFailurePolicy": {"rules": [dict(r) for r in k8s.POD_FAILURE_RULES]},
                     "template": template}}}],
        "ttlSecondsAfterFinished": k8s.TTL_S,
    }
    if spec.queue:
        body = {"suspend": True, **body}
    return k8s.owned({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "labels": labels},
                      "spec": body}, owner)


def stage_jobsets(spec: AblationSpec, run_id: str, owner: k8s.OwnerRef | None = None) -> dict[str, Doc]:
    """Every JobSet of a run: ``capture.yaml`` when the capture spans nodes, ``replay-I.yaml`` for each
    replay that does (in index order)."""
    return {("capture.yaml" if what == "capture" else f"replay-{what}.yaml"):
            jobset(spec, run_id, None if what == "capture" else int(what), owner) for what in spec.across_nodes()}
