"""The Argo workflow of an ablation: prepare -> capture -> replays (arms x repeats) -> reduce.

``argo/ablation.yaml`` is ``render(load_spec("examples/ablation.toml"))`` committed; a test keeps
them identical.  The file holds everything ``kubectl apply -f`` needs: the executor's service
account and its one permission, the artifacts PVC and the Workflow (a fixed ``metadata.name``).
The spec's values become the defaults of the workflow parameters (image, gpu-product, arms,
repeats, min-repeats, claim, model, config-sets, seed), so a run can change them without
re-rendering.

The containers run the same scripts as the plain Kubernetes Jobs (:mod:`replayjob.deploy.commands`);
the capture step publishes the pins as output parameters and every replay receives them as
inputs.  Retries: infrastructure failures only (``!(lastRetry.exitCode in ["1", "2"])``), on
another node; the reducer never retries, and its exit code fails the workflow when the verdict is
not a pass.  The verdict is a global output parameter and ``verdict.json`` on the PVC; the exit
handler prints ``{{workflow.status}}`` and the verdict.
"""

from __future__ import annotations

import json
from typing import Any

from replayjob.deploy import k8s
from replayjob.deploy.ablation import AblationSpec, toml_value
from replayjob.deploy.commands import command

Doc = dict[str, Any]
OUTPUTS = "/tmp/outputs"
RUN_DIR = k8s.MOUNT + "/runs/{{workflow.name}}/{{workflow.uid}}"
RETRY_EXPRESSION = '!(lastRetry.exitCode in ["1", "2"])'


def _p(name: str) -> str:
    return "{{workflow.parameters." + name + "}}"


def _i(name: str) -> str:
    return "{{inputs.parameters." + name + "}}"


def parameters(spec: AblationSpec) -> list[Doc]:
    arms = [{"name": a.name, "sets": a.words()} for a in spec.arms]
    values = {
        "image": spec.image, "gpu-product": spec.gpu_product,
        "arms": json.dumps(arms, separators=(",", ":")), "repeats": str(spec.repeats),
        "min-repeats": str(spec.effective_min_repeats), "claim": spec.claim,
        "model": spec.model_path, "config-sets": " ".join(spec.extra_sets()), "seed": str(spec.seed),
    }
    return [{"name": k, "value": v} for k, v in values.items()]


def retry() -> Doc:
    return {"limit": "2", "retryPolicy": "Always", "expression": RETRY_EXPRESSION,
            "backoff": {"duration": "30s", "factor": "2", "maxDuration": "10m"},
            "affinity": {"nodeAntiAffinity": {}}}


def _container(spec: AblationSpec, step: str, env: dict[str, str], gpu: bool) -> Doc:
    sets = f"backend.devices={toml_value(spec.device)} model.path=\"{_p('model')}\" {_p('config-sets')}"
    base = {"REPLAYJOB_RUN_DIR": RUN_DIR, "REPLAYJOB_CONFIG_SETS": sets,
            **k8s.DETERMINISM_ENV, **k8s.RUNTIME_ENV}
    return {"image": _p("image"), "imagePullPolicy": "IfNotPresent", "command": command(step),
            "env": k8s.env_list({**base, **env}), "resources": k8s.resources(spec, gpu),
            "securityContext": k8s.container_security(),
            "volumeMounts": [dict(m) for m in k8s.VOLUME_MOUNTS]}


def _template(spec: AblationSpec, name: str, step: str, env: dict[str, str], gpu: bool,
              **fields: Any) -> Doc:
    tpl: Doc = {"name": name, **fields}
    lab = k8s.labels(spec, name)
    if gpu:
        lab[k8s.EXCLUSIVE_LABEL] = "true"
        placement = k8s.gpu_placement(spec)
        placement["nodeSelector"] = {k8s.GPU_PRODUCT_LABEL: _p("gpu-product")}
        tpl.update(placement)
    tpl["metadata"] = {"labels": lab}
    tpl["container"] = _container(spec, step, env, gpu)
    return tpl


def _out(name: str, file: str, **extra: str) -> Doc:
    return {"name": name, "valueFrom": {"path": f"{OUTPUTS}/{file}"}, **extra}


def templates(spec: AblationSpec) -> list[Doc]:
    pins_in = [{"name": "logical-sha256"}, {"name": "manifest-sha256"}]
    main = {"name": "ablation", "parallelism": spec.parallelism, "steps": [
        [{"name": "prepare", "template": "prepare"}],
        [{"name": "capture", "template": "capture"}],
        [{"name": "replay", "template": "replay",
          "withParam": "{{steps.prepare.outputs.parameters.plan}}",
          "arguments": {"parameters": [
              {"name": "arm", "value": "{{item.arm}}"}, {"name": "sets", "value": "{{item.sets}}"},
              {"name": "repeat", "value": "{{item.repeat}}"},
              {"name": "logical-sha256", "value": "{{steps.capture.outputs.parameters.logical-sha256}}"},
              {"name": "manifest-sha256",
               "value": "{{steps.capture.outputs.parameters.manifest-sha256}}"}]}}],
        [{"name": "reduce", "template": "reduce"}],
    ]}
    prepare = _template(
        spec, "prepare", "prepare",
        {"REPLAYJOB_SEED": _p("seed"), "REPLAYJOB_ARMS_JSON": _p("arms"), "REPLAYJOB_REPEATS": _p("repeats"),
         "REPLAYJOB_OUTPUTS": OUTPUTS}, False,
        outputs={"parameters": [_out("plan", "plan.json")]}, retryStrategy=retry())
    capture = _template(
        spec, "capture", "capture", {"REPLAYJOB_OUTPUTS": OUTPUTS}, spec.gpu,
        outputs={"parameters": [_out("logical-sha256", "logical_sha256"),
                                _out("manifest-sha256", "manifest_sha256")]},
        retryStrategy=retry())
    replay = _template(
        spec, "replay", "replay",
        {"REPLAYJOB_ARM": _i("arm"), "REPLAYJOB_ARM_SETS": _i("sets"), "REPLAYJOB_REPEAT": _i("repeat"),
         "REPLAYJOB_EXPECTED_LOGICAL_SHA256": _i("logical-sha256"),
         "REPLAYJOB_EXPECTED_MANIFEST_SHA256": _i("manifest-sha256")}, spec.gpu,
        inputs={"parameters": [{"name": "arm"}, {"name": "sets"}, {"name": "repeat"}, *pins_in]},
        retryStrategy=retry())
    reduce = _template(
        spec, "reduce", "reduce",
        {"REPLAYJOB_CLAIM": _p("claim"), "REPLAYJOB_MIN_REPEATS": _p("min-repeats"),
         "REPLAYJOB_OUTPUTS": OUTPUTS}, False,
        outputs={"parameters": [_out("verdict", "verdict.json", globalName="verdict")]})
    report = _template(spec, "report", "report",
                       {"REPLAYJOB_WORKFLOW": "{{workflow.name}}", "REPLAYJOB_STATUS": "{{workflow.status}}"},
                       False)
    return [main, prepare, capture, replay, reduce, report]


def executor_rbac(spec: AblationSpec) -> list[Doc]:
    """The executor's service account: it may only record step results (workflowtaskresults)."""
    name = f"{spec.name}-executor"
    meta = {"name": name, "labels": k8s.labels(spec, "executor")}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": [{"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"],
                    "verbs": ["create", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name}]},
    ]


def workflow(spec: AblationSpec) -> Doc:
    return {
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
        "metadata": {"name": spec.name, "labels": k8s.labels(spec, "workflow")},
        "spec": {
            "entrypoint": "ablation", "onExit": "report",
            "arguments": {"parameters": parameters(spec)},
            "automountServiceAccountToken": False,
            "executor": {"serviceAccountName": f"{spec.name}-executor"},
            "securityContext": k8s.pod_security(),
            "activeDeadlineSeconds": 2 * spec.deadline_s,
            "ttlStrategy": {"secondsAfterCompletion": k8s.TTL_S},
            "volumes": k8s.volumes(spec),
            "templates": templates(spec),
        },
    }


HEADER = ("# Rendered by `replayjob k8s render {source} --argo argo/ablation.yaml`; edit the spec, not\n"
          "# this file.  Apply: kubectl apply -f argo/ablation.yaml (see docs/cluster.md).\n")


def render(spec: AblationSpec) -> list[Doc]:
    """Every document of ``argo/ablation.yaml``, in apply order."""
    return [*executor_rbac(spec), k8s.pvc(spec), workflow(spec)]


def dump(spec: AblationSpec, source: str = "ablation.toml") -> str:
    return k8s.dump(render(spec), HEADER.format(source=source))
