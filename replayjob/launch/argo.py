"""The Argo workflow of an ablation: capture -> replays (arms x repeats) -> reduce, as a DAG.

``argo/ablation.yaml`` is ``dump(*load_spec_text("examples/ablation.toml"))`` committed, and
``argo/setup.yaml`` is :func:`dump_setup`'s; a test keeps them identical.  What outlives runs is apart,
applied once (``argo/setup.yaml``: the executor's service account and its one permission, the claim
that holds every run's data), so deleting a run never deletes data; ``argo/ablation.yaml`` holds a
**WorkflowTemplate** (the gating entry point for repeated runs: ``argo submit --from
workflowtemplate/NAME -p key=value --wait``) and a Workflow that runs that template once, named from the
content it runs (``NAME-`` and the first 10 hex digits of :func:`content_sha256`: spec, image, GPU
product, capture pins), so ``kubectl apply -f argo/ablation.yaml`` runs one ablation, applying it again
changes nothing, and a changed spec is a new Workflow, a new run.

Parameters: ``spec`` (the ablation spec's TOML text, parsed again strictly in every pod, which
receives it as a raw input artifact), ``image`` and ``gpu-product``.  Resources, GPU requests and
node placement are fixed at render time.

Every container runs one ``replayjob step`` command (no shell: the executor signals replayjob
itself).  The capture step publishes the pins and the fan-out plan (the array indexes) as output
parameters; each replay receives its index and the pins, and refuses when they differ from the
volume's.  A run of N ranks is one pod with N GPUs (torchrun inside it; ``--ranks N`` checked by the
step against the spec).  When arms run different rank counts there is one replay template per count
(``replay-rN``, its own GPU request), fanned out over that count's indexes (``plan-rN``, published
by the capture); the DAG's ``parallelism`` still bounds them all.  The reducer **always runs once
the fan-out has ended** (``depends`` on the replays having succeeded, failed or errored, or on the
capture having failed; ``failFast: false``) and writes a verdict, refused when replays are missing
(or the capture), so a failed replay is judged, never silently dropped; its exit code fails the
workflow when the verdict is not a pass, and ``replayjob argo wait``
(:mod:`replayjob.launch.workflow`) returns it.  Retries: infrastructure errors and every failure whose
exit code is not final (3: nothing decided; a signal), on another node; 1 and 2 are final
(:data:`replayjob.errors.FINAL_EXIT_STATUSES`, as in the Jobs' ``podFailurePolicy``).  Retries are
bounded by their count (:data:`~replayjob.launch.k8s.RETRIES`) and each attempt by the pod's own
``activeDeadlineSeconds``, never by wall time since the first attempt: Argo's
``backoff.maxDuration`` counts the time a pod waited Pending for a GPU, so a replay that queued that
long would get no retry, and it overrides a retried pod's deadline.  ``podGC`` deletes the pods of
successful steps; every template has ``activeDeadlineSeconds``; the replays and the capture may take
a semaphore for the GPU pool (``semaphore = "CONFIGMAP/KEY"`` in the spec); every step takes the
spec's priority class, and with ``queue`` every workflow pod carries ``kueue.x-k8s.io/queue-name``
(``podMetadata``).  The workflow's own deadline is sized from the waves
(:func:`replayjob.launch.k8s.run_deadline_s`).  What the templates were rendered with (resources,
parallelism, the claim, the number of replays: ``REPLAYJOB_RENDERED``) is compared by every step
with the ``spec`` parameter it receives: a submitted spec that differs there is refused, not
silently run with the rendered values.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from replayjob.artifacts import pods
from replayjob.artifacts.run_end import RUN_END_FILE
from replayjob.artifacts.spec import AblationSpec
from replayjob.errors import FINAL_EXIT_STATUSES
from replayjob.launch import k8s

Doc = dict[str, Any]
OUTPUTS = "/tmp/outputs"
ON_EXIT, FINAL = "on-exit", "final-verdict"  # the exit handler and its reduce step
RUN_DIR = k8s.MOUNT + "/runs/{{workflow.name}}/{{workflow.uid}}"


def retry_expression() -> str:
    """Argo's retry condition: an error of the pod or the controller, or a failure whose exit code is not
    final (:data:`replayjob.errors.FINAL_EXIT_STATUSES`), as the Jobs' ``podFailurePolicy`` counts it:
    3, a signal (137), a pod past its deadline (no exit code)."""
    final = ", ".join(f'"{c}"' for c in sorted(FINAL_EXIT_STATUSES))
    return f'lastRetry.status == "Error" || !(lastRetry.exitCode in [{final}])'


RETRY_EXPRESSION = retry_expression()


def reduce_depends(tasks: list[str]) -> str:
    """The reducer runs once every replay task has ended, however it ended, or once the capture failed
    (no replay runs then, and the verdict is refused: no capture): every run ends with a verdict."""
    ended = [f"{t}.Succeeded || {t}.Failed || {t}.Errored" for t in tasks]
    replays = ended[0] if len(ended) == 1 else " && ".join(f"({e})" for e in ended)
    return f"capture.Failed || capture.Errored || ({replays})"


def _p(name: str) -> str:
    return "{{workflow.parameters." + name + "}}"


def _i(name: str) -> str:
    return "{{inputs.parameters." + name + "}}"


def parameters(spec: AblationSpec, text: str) -> list[Doc]:
    values = {"spec": text, "image": spec.image, "gpu-product": spec.gpu_product}
    return [{"name": k, "value": v} for k, v in values.items()]


def retry() -> Doc:
    return {"limit": str(k8s.RETRIES), "retryPolicy": "Always", "expression": RETRY_EXPRESSION,
            "backoff": {"duration": "30s", "factor": "2"},  # no maxDuration: see the module docstring
            "affinity": {"nodeAntiAffinity": {}}}


def _container(spec: AblationSpec, command: list[str], gpu: bool, ranks: int = 1) -> Doc:
    env = [*k8s.env_list({**k8s.static_env(_p("image"), spec)}),
           k8s.field_env("REPLAYJOB_NODE_NAME", "spec.nodeName"), k8s.field_env("REPLAYJOB_POD_NAME", "metadata.name"),
           *k8s.threads_env()]
    return {"image": _p("image"), "imagePullPolicy": "IfNotPresent", "command": command, "env": env,
            "resources": k8s.resources(spec, gpu, ranks), "securityContext": k8s.container_security(),
            "volumeMounts": [dict(m) for m in k8s.VOLUME_MOUNTS]}


def _template(spec: AblationSpec, name: str, command: list[str], gpu: bool, ranks: int | None = None,
              component: str | None = None, **fields: Any) -> Doc:
    tpl: Doc = {"name": name, **fields}
    tpl.setdefault("inputs", {})["artifacts"] = [
        {"name": "spec", "path": k8s.SPEC_FILE, "raw": {"data": _p("spec")}}]
    lab = _labels(spec, component or name)
    if ranks is not None:
        lab[k8s.RANKS_LABEL] = str(ranks)
    if gpu:
        lab[k8s.EXCLUSIVE_LABEL] = "true"
        placement = k8s.gpu_placement(spec)
        placement["nodeSelector"][k8s.GPU_PRODUCT_LABEL] = _p("gpu-product")
        tpl.update(placement)
        if spec.semaphore:
            cm, key = spec.semaphore.split("/", 1)
            tpl["synchronization"] = {"semaphores": [{"configMapKeyRef": {"name": cm, "key": key}}]}
    if spec.priority_class:  # every step, GPU or not
        tpl["priorityClassName"] = spec.priority_class
    tpl["metadata"] = {"labels": lab}
    tpl["activeDeadlineSeconds"] = str(spec.deadline_s)  # IntOrString in the Argo schemas
    tpl["retryStrategy"] = retry()
    tpl["container"] = _container(spec, command, gpu, ranks or 1)
    _customise(tpl, pods.for_stage(spec.pods, gpu=gpu))
    return tpl


def _customise(tpl: Doc, settings: pods.PodSettings) -> None:
    """The spec's ``[pods]`` settings on a template, as the Jobs' pods get them (:func:`pods.apply`): the
    fields a template has are set on it, the rest (pull secrets, runtime class) through ``podSpecPatch``."""
    pod: Doc = {key: tpl[key] for key in ("tolerations", "nodeSelector", "affinity") if key in tpl}
    pod["volumes"] = []
    pods.apply(pod, tpl["metadata"], tpl["container"], settings)
    for key in ("tolerations", "nodeSelector", "affinity", "serviceAccountName", "schedulerName"):
        if key in pod:
            tpl[key] = pod[key]
    if pod["volumes"]:
        tpl["volumes"] = pod["volumes"]
    patch = {key: pod[key] for key in ("imagePullSecrets", "runtimeClassName") if key in pod}
    if patch:
        tpl["podSpecPatch"] = json.dumps(patch, sort_keys=True)


def _labels(spec: AblationSpec, component: str) -> dict[str, str]:
    """Argo labels every pod with its workflow; the run-id label is the Jobs' own."""
    return {k: v for k, v in k8s.labels(spec, component).items() if k != k8s.RUN_ID_LABEL}


def _out(name: str, file: str, **extra: str) -> Doc:
    return {"name": name, "valueFrom": {"path": f"{OUTPUTS}/{file}"}, **extra}


def replay_names(spec: AblationSpec) -> dict[int, str]:
    """Rank count -> its replay template, task and plan output: ``replay`` and ``plan`` when every
    replay runs the same number of ranks, else ``replay-rN`` and ``plan-rN`` per count."""
    groups = spec.rank_groups()
    return {n: "replay" if len(groups) == 1 else f"replay-r{n}" for n in groups}


def plan_name(task: str) -> str:
    return task.replace("replay", "plan")


def templates(spec: AblationSpec) -> list[Doc]:
    cap = "{{tasks.capture.outputs.parameters."
    names = replay_names(spec)
    replay_tasks = [
        {"name": task, "template": task, "depends": "capture.Succeeded", "withParam": cap + plan_name(task) + "}}",
         "arguments": {"parameters": [{"name": "index", "value": "{{item}}"},
                                      {"name": "pins", "value": cap + "pins}}"}]}} for task in names.values()]
    main = {"name": "ablation", "parallelism": spec.parallelism, "dag": {"failFast": False, "tasks": [
        {"name": "capture", "template": "capture"}, *replay_tasks,
        {"name": "reduce", "template": "reduce", "depends": reduce_depends(list(names.values()))},
    ]}}
    capture = _template(
        spec, "capture", k8s.step_command("capture", RUN_DIR, "--ranks", str(spec.ranks), "--outputs", OUTPUTS),
        spec.gpu, spec.ranks,
        outputs={"parameters": [_out("logical-sha256", "logical_sha256"), _out("manifest-sha256", "manifest_sha256"),
                                _out("pins", "pins"),
                                *(_out(plan_name(t), plan_name(t) + ".json") for t in names.values())]})
    replays = [_template(
        spec, task, k8s.step_command("replay", RUN_DIR, "--index", _i("index"), "--ranks", str(ranks),
                                     "--pins", _i("pins"), "--wait-s", str(k8s.REPLAY_WAIT_S)), spec.gpu, ranks,
        "replay",
        inputs={"parameters": [{"name": "index"}, {"name": "pins"}]}) for ranks, task in names.items()]
    verdict_out = {"parameters": [{"name": "verdict", "valueFrom": {"path": f"{OUTPUTS}/verdict.json", "default": ""},
                                   "globalName": "verdict"}]}
    reduce = _template(spec, "reduce", k8s.step_command("reduce", RUN_DIR, "--outputs", OUTPUTS), False,
                       outputs=verdict_out)
    # the exit handler: a workflow that ended otherwise than Succeeded (a failed reducer pod, a stop, the
    # deadline) still ends with a verdict: the reduce step again over what the run left (same inputs, same
    # bytes; missing evidence makes it incomplete, exit 3), published as the same global output; first it
    # records what ended the run (RUN/ended.json from the workflow's status and failed nodes: stopped, a
    # deadline, a failed stage), published as the global output `ended`
    ended_out = {"name": "ended", "valueFrom": {"path": f"{OUTPUTS}/{RUN_END_FILE}", "default": ""},
                 "globalName": "ended"}
    final = _template(spec, FINAL, k8s.step_command("reduce", RUN_DIR, "--outputs", OUTPUTS,
                                                    "--ended", "{{workflow.status}}",
                                                    "--failures", "{{workflow.failures}}"), False,
                      component="reduce", outputs={"parameters": [*verdict_out["parameters"], ended_out]})
    on_exit = {"name": ON_EXIT, "steps": [[{"name": FINAL, "template": FINAL,
                                            "when": "{{workflow.status}} != Succeeded"}]]}
    return [main, capture, *replays, reduce, on_exit, final]


def executor_rbac(spec: AblationSpec) -> list[Doc]:
    """The executor's service account: it may only record step results (workflowtaskresults)."""
    name = f"{spec.name}-executor"
    meta = {"name": name, "labels": _labels(spec, "executor")}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": [{"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"],
                    "verbs": ["create", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name}]},
    ]


def workflow_template(spec: AblationSpec, text: str) -> Doc:
    return {
        "apiVersion": "argoproj.io/v1alpha1", "kind": "WorkflowTemplate",
        "metadata": {"name": spec.name, "labels": _labels(spec, "workflow")},
        "spec": {
            "entrypoint": "ablation",
            "onExit": ON_EXIT,  # every ended workflow has a verdict
            "arguments": {"parameters": parameters(spec, text)},
            "automountServiceAccountToken": False,
            "executor": {"serviceAccountName": f"{spec.name}-executor"},
            "securityContext": k8s.pod_security(),
            **({"podMetadata": {"labels": {k8s.QUEUE_LABEL: spec.queue}}} if spec.queue else {}),
            "activeDeadlineSeconds": k8s.run_deadline_s(spec, concurrent_counts=True),  # from the waves
            "podGC": {"strategy": "OnPodSuccess"},
            "ttlStrategy": {"secondsAfterCompletion": k8s.TTL_S},
            "volumes": k8s.volumes(spec),
            "templates": templates(spec),
        },
    }


CONTENT_ANNOTATION = "replayjob.dev/content-sha256"


def content_sha256(spec: AblationSpec, text: str) -> str:
    """The SHA-256 of what one run of the template runs: the spec's text, the image, the GPU product and the
    pins of an existing capture."""
    capture = [spec.capture.logical_sha256, spec.capture.manifest_sha256] if spec.capture is not None else None
    doc = {"spec": text, "image": spec.image, "gpu_product": spec.gpu_product, "capture": capture}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def workflow(spec: AblationSpec, text: str) -> Doc:
    """One run of the template with its default parameters (``kubectl apply -f`` starts it), named from the
    content it runs (:func:`content_sha256`): applying the same file again changes nothing, a changed spec
    (or image, or capture) is a new Workflow, so a new run."""
    digest = content_sha256(spec, text)
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
            "metadata": {"name": f"{spec.name}-{digest[:10]}", "labels": _labels(spec, "workflow"),
                         "annotations": {CONTENT_ANNOTATION: digest}},
            "spec": {"workflowTemplateRef": {"name": spec.name}}}


HEADER = ("# Rendered by `replayjob k8s render {source} --argo argo/ablation.yaml`; edit the spec, not\n"
          "# this file.  First, once per namespace: kubectl apply -f argo/setup.yaml.  Then each\n"
          "# kubectl apply -f argo/ablation.yaml runs one ablation; gate on a run with the reducer's code:\n"
          "#   argo submit --from workflowtemplate/{name} -p image=REF -o name, then\n"
          "#   replayjob argo wait NAME   (0 pass, 1 fail, 2 refused, 3 error; see docs/cluster.md)\n")
SETUP_HEADER = ("# Rendered by `replayjob k8s render {source} --argo-setup argo/setup.yaml`; edit the spec, not\n"
                "# this file.  Applied once per namespace, before any run: the executor's service account\n"
                "# and the claim that holds every run.  Deleting it deletes every run's data.\n")


def render_setup(spec: AblationSpec) -> list[Doc]:
    """What outlives every run (``argo/setup.yaml``, applied once): the executor's service account and
    its one permission, and the claim that holds every run's data."""
    spec.check_cluster()
    return [*executor_rbac(spec), k8s.pvc(spec)]


def render(spec: AblationSpec, text: str) -> list[Doc]:
    """Every document of ``argo/ablation.yaml``, in apply order: the WorkflowTemplate and one Workflow
    (refused unless the spec can run on a cluster:
    :meth:`~replayjob.artifacts.spec.AblationSpec.check_cluster`), and refused for a spec with a run across
    nodes (:func:`replayjob.launch.k8s.check_one_node`: each step is one pod)."""
    spec.check_cluster()
    k8s.check_one_node(spec, "the Argo workflow")
    return [workflow_template(spec, text), workflow(spec, text)]


def dump(spec: AblationSpec, text: str, source: str = "ablation.toml") -> str:
    return k8s.dump(render(spec, text), k8s.header_text(HEADER, source=source, name=spec.name))


def dump_setup(spec: AblationSpec, source: str = "ablation.toml") -> str:
    return k8s.dump(render_setup(spec), k8s.header_text(SETUP_HEADER, source=source))
