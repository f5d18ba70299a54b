"""``replayjob k8s drive``: the in-cluster driver that chains one run's stages; no client in the chain.

The driver is a Job (``k8s/base/driver.yaml``, or one per ``k8s submit``/``k8s resume``) whose pod is
the only pod of a run that mounts a service-account token (its Role, in ``k8s/setup``: create and
follow Jobs, read pods, keep ConfigMaps, in its namespace).  It:

1. learns who it is from the downward API: its Job's name and ``metadata.uid`` (the pod labels
   ``batch.kubernetes.io/job-name`` and ``batch.kubernetes.io/controller-uid``), its pod, namespace,
   and the run id (the ``replayjob.dev/run-id`` label of a submitted or resumed run; in the kustomize
   base, which has none, the first 16 hex digits of its Job's uid, :func:`run_id_from_uid`, so two
   applies of one base never share a run directory), and labels its Job with the run id;
2. runs the image its own pod runs (the pod's ``spec.containers[].image``, whatever set it: the spec,
   a kustomize ``images:``, a patch), refused unless named by digest (``image_policy``), and the GPU
   product ``REPLAYJOB_GPU_PRODUCT`` (an overlay may patch it);
3. refuses a spec whose render-time fields differ from those its own Job was rendered with;
4. keeps the run's spec in ``NAME-RUNID-spec`` (created from the spec it mounts, or verified equal
   when it exists) and owns it; every stage Job it creates is owned by it too, so the run's objects
   go with the driver (its TTL, ``kubectl delete``);
5. creates the stages one after another, each only when the one before has ended: the capture; the
   replay Job(s) (one per rank count) only after the capture succeeded, and a JobSet per replay whose
   ranks span nodes (:mod:`replayjob.launch.jobset`; the capture too when it does), ``parallelism`` at a
   time; then the reduce Job, which
   always runs: after the replays, however they ended, and also after a capture that failed for good
   (no replays; the verdict is refused: no capture), so every run ends with a verdict;
6. adopts the stage Jobs that already exist (a retried driver pod, ``k8s resume``): a finished stage
   is not run again;
7. reads the reducer's verdict from the claim (mounted read-only) through the one strict verdict reader,
   cross-checks it with the reducer's exit code (:func:`replayjob.artifacts.cluster_status.judge`), publishes it in
   the run's ConfigMap (``verdict.json``, where ``k8s submit|resume --wait`` read it) and exits with its
   code: 0 pass, 1 a negative verdict, 2 refused, 3 an error on every attempt, no verdict, a verdict
   that cannot be read or that the reducer's code contradicts.  Its own exit 3 (an API that stayed
   unreachable) is retried by its Job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.artifacts import cluster_status as outcome
from replayjob.artifacts.spec import AblationSpec, load_spec_text
from replayjob.artifacts.verdict import MAX_VERDICT_BYTES, read_verdict
from replayjob.errors import ConfigError, ContractError, ReplayjobError
from replayjob.fsio import read_regular_bytes
from replayjob.launch import jobset, k8s
from replayjob.launch.step import VERDICT_FILE, check_rendered
from replayjob.launch.submit import (
    START_GRACE_ENV,
    START_GRACE_S,
    STOPPED_KEY,
    Api,
    Log,
    StageStuck,
    env_seconds,
    is_rendered,
    job_deadline_s,
    meta,
    run_drivers,
    wait_job,
)

POLL_ENV = "REPLAYJOB_POLL_S"  # seconds between two reads of a stage Job's status [default: 10]


def run_id_from_uid(uid: str) -> str:
    """The run id of a driver Job without one: the first 16 hex digits of its ``metadata.uid`` (a new
    uid, so a new run directory, for every object the API server creates)."""
    digits = uid.replace("-", "").lower()
    if not re.fullmatch(r"[0-9a-f]{32}", digits):
        raise ConfigError(f"{uid!r} is not a Kubernetes uid", where="REPLAYJOB_DRIVER_UID")
    return digits[:16]


@dataclass(frozen=True)
class Context:
    """What the driver's pod knows of itself (the downward API and its environment)."""

    namespace: str
    job: str
    uid: str
    pod: str
    run_id: str
    gpu_product: str
    image: str
    artifacts: str = k8s.MOUNT  # where the claim is mounted (read-only): the reducer's verdict is read there

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Context:
        missing = [k for k in ("REPLAYJOB_DRIVER_JOB", "REPLAYJOB_DRIVER_UID", "REPLAYJOB_NAMESPACE")
                   if not environ.get(k)]
        if missing:
            raise ConfigError("not a driver Job's pod: " + ", ".join(missing) + " missing", where="environment",
                              hint="`replayjob k8s drive` runs as the driver Job rendered by `replayjob k8s render`")
        run_id = environ.get("REPLAYJOB_RUN_ID") or run_id_from_uid(environ["REPLAYJOB_DRIVER_UID"])
        if not k8s.RUN_ID_PATTERN.fullmatch(run_id):
            raise ConfigError(f"run id {run_id!r} is not a DNS label fragment", where="REPLAYJOB_RUN_ID")
        return cls(namespace=environ["REPLAYJOB_NAMESPACE"], job=environ["REPLAYJOB_DRIVER_JOB"],
                   uid=environ["REPLAYJOB_DRIVER_UID"], pod=environ.get("REPLAYJOB_POD_NAME", ""), run_id=run_id,
                   gpu_product=environ.get("REPLAYJOB_GPU_PRODUCT", ""), image=environ.get("REPLAYJOB_IMAGE_REF", ""),
                   artifacts=environ.get(k8s.ARTIFACTS_ENV) or k8s.MOUNT)

    @property
    def owner(self) -> dict[str, Any]:
        return k8s.owner_reference({"metadata": {"name": self.job, "uid": self.uid}})


def running_image(api: Api, ctx: Context, log: Log) -> str:
    """The image this driver's pod runs (its spec, as the kubelet was given it), else
    ``REPLAYJOB_IMAGE_REF``: every stage runs the same image as the driver."""
    doc = api.read(ctx.namespace, "Pod", ctx.pod) if ctx.pod else None
    if doc is None:
        return ctx.image
    pod = outcome.read_object(doc, outcome.RunningPod, f"pod {ctx.pod}", where=f"namespace {ctx.namespace}")
    image = next((c.image for c in pod.spec.containers if c.name == k8s.CONTAINER), ctx.image)
    if ctx.image and image != ctx.image:
        log(f"driver: this pod runs {image} while REPLAYJOB_IMAGE_REF says {ctx.image}: every stage runs {image}")
    return image


def _ensure(api: Api, ns: str, body: dict[str, Any], owner: dict[str, Any], log: Log,
            owners: set[str]) -> dict[str, Any]:
    """Create ``body``, or adopt the object of that name when this run created it (a retried or resumed
    driver): owned by one of the run's drivers (``owners``: their uids), with the labels and, for a Job,
    the pod template this run renders.  Anything else of that name is refused (2): a run never follows
    an object it did not create.  Returns the object as it is."""
    created = api.create(ns, body, exist_ok=True)
    kind, name = body["kind"], body["metadata"]["name"]
    if created is not None:
        log(f"driver: created {kind.lower()}/{name}")
        return created
    found = api.read(ns, kind, name)
    if found is None:  # deleted in between: create it again
        return _ensure(api, ns, body, owner, log, owners)
    uids = {r.uid for r in meta(found, f"{kind.lower()} {name}").ownerReferences or []}
    why = ("it is owned by no driver of this run" if not uids & owners
           else "" if is_rendered(found, body) else "its labels or pod template are not the ones this run renders")
    if why:
        raise ContractError(f"{kind.lower()}/{name} exists but is not this run's: {why}", where=f"namespace {ns}",
                            hint=f"delete {kind.lower()}/{name} (kubectl -n {ns} delete {kind.lower()} {name}) or "
                                 "submit a new run")
    if api.add_owner(ns, kind, found, owner):
        log(f"driver: adopted {kind.lower()}/{name}")
    return found


def drive(spec: AblationSpec, text: str, ctx: Context, api: Api, *, poll_s: float = 10.0, log: Log = print,
          start_grace_s: float = START_GRACE_S) -> int:
    """Chain one run's stages (see the module docstring); return the reducer's code."""
    ns, owner = ctx.namespace, ctx.owner
    spec = dataclasses.replace(spec, image=running_image(api, ctx, log),
                               gpu_product=ctx.gpu_product or spec.gpu_product)
    spec.check_cluster()  # the image that runs, named by its digest (unless the spec is local)
    me = api.read(ns, "Job", ctx.job)
    if me is not None and (meta(me, f"job {ctx.job}").labels or {}).get(k8s.RUN_ID_LABEL) != ctx.run_id:
        api.patch(ns, "Job", ctx.job, [{"op": "add", "path": "/metadata/labels/" + k8s.RUN_ID_LABEL.replace("/", "~1"),
                                        "value": ctx.run_id}])  # so `k8s resume RUN_ID` finds it
    log(f"driver: run {ctx.run_id} in namespace {ns}, image {spec.image}; run directory "
        f"{k8s.MOUNT}/runs/{spec.name}/{ctx.run_id} on PVC {spec.claim_name}")
    drivers = (m for _, m in run_drivers(api, ns, spec, ctx.run_id))
    owners = {ctx.uid, *(m.uid for m in drivers if m.uid is not None)}
    rendered = k8s.owned(k8s.spec_config_map(spec, text, ctx.run_id), owner)
    cm_name = rendered["metadata"]["name"]
    config_map = outcome.read_object(_ensure(api, ns, rendered, owner, log, owners), outcome.ConfigMap,
                                     f"configmap {cm_name}", where=f"namespace {ns}")
    if (config_map.data or {}).get("ablation.toml") != text:
        raise ContractError(f"configmap/{cm_name} holds another spec than this run's",
                            where=f"namespace {ns}", hint="a run keeps its spec; submit a new run for another")
    stages = k8s.stage_jobs(spec, ctx.run_id, owner)
    across = jobset.stage_jobsets(spec, ctx.run_id, owner)  # runs across nodes: one JobSet each
    capture = stages.pop("capture.yaml", None) or across.pop("capture.yaml")
    reduce = stages.pop("reduce.yaml")
    # replays across nodes, `parallelism` JobSets at a time, each wave after the one before has ended
    waves = [list(across.values())[i:i + spec.parallelism] for i in range(0, len(across), spec.parallelism)]

    total = len(stages) + len(across) + 2

    def start(body: dict[str, Any]) -> None:
        _ensure(api, ns, body, owner, log, owners)
        started.append(body["metadata"]["name"])
        log(f"driver: stage {len(started)}/{total}: {body['kind'].lower()}/{body['metadata']['name']}")

    def follow(body: dict[str, Any]) -> str:
        name = body["metadata"]["name"]
        try:
            return wait_job(api, ns, name, poll_s, log, job_deadline_s(body), start_grace_s, body["kind"])[0]
        except StageStuck as exc:  # recorded beside the run's spec, where `k8s ... --wait` reads it
            record = outcome.stopped_record(body["metadata"]["labels"]["app.kubernetes.io/component"], name,
                                            exc.cause)
            api.patch(ns, "ConfigMap", cm_name,
                      [{"op": "add", "path": "/data/" + STOPPED_KEY, "value": json.dumps(record, sort_keys=True)}])
            log(f"driver: run {ctx.run_id} stopped: stage {record['stage']}: {exc.cause.line()}; exit 3")
            raise

    def run(body: dict[str, Any]) -> str:
        start(body)
        return follow(body)

    started: list[str] = []

    if run(capture) == "Complete":
        for wave in [[body] for body in stages.values()] + waves:  # one replay Job per rank count, then the
            for body in wave:                                      # JobSets; one after another
                start(body)
            for body in wave:
                if follow(body) == "Failed":
                    log(f"driver: {body['kind'].lower()}/{body['metadata']['name']} failed; the reducer judges "
                        "the missing replays")
    else:
        log(f"driver: job/{capture['metadata']['name']} failed for good: no replay runs; the reducer writes the "
            "verdict (refused: no capture)")
    name = reduce["metadata"]["name"]
    pod_code = api.exit_code(ns, name, run(reduce))  # the Job's condition and its pods' codes, together
    path = Path(ctx.artifacts) / "runs" / spec.name / ctx.run_id / VERDICT_FILE
    verdict, unreadable, data = None, None, b""
    if path.exists() or path.is_symlink():
        where = f"{k8s.MOUNT}/runs/{spec.name}/{ctx.run_id}/{VERDICT_FILE}"
        try:  # one read: the bytes judged are the bytes published (the claim is written by other pods)
            data = read_regular_bytes(path, max_bytes=MAX_VERDICT_BYTES, what="verdict")
            verdict = read_verdict(data, where=where)
        except ReplayjobError as exc:
            unreadable = exc.message
    step = f"the reducer (job/{name}) exited {'with no exit code' if pod_code is None else pod_code}"
    code, line = outcome.judge(verdict, unreadable, pod_code, step, need_code=True)
    if verdict is not None:  # published beside the run's spec: `k8s submit|resume --wait` read it there
        api.patch(ns, "ConfigMap", cm_name,
                  [{"op": "add", "path": "/data/" + k8s.VERDICT_KEY, "value": data.decode("utf-8")}])
    log(f"driver: run {ctx.run_id}: {line}; exit {code}; verdict: {k8s.MOUNT}/runs/{spec.name}/{ctx.run_id}/"
        f"verdict.json on PVC {spec.claim_name}")
    return code


def main(spec_path: str, environ: Mapping[str, str] | None = None, api: Api | None = None, log: Log = print) -> int:
    """``replayjob k8s drive --spec FILE``, in the driver Job's pod."""
    env = os.environ if environ is None else environ
    spec, text = load_spec_text(spec_path)
    check_rendered(spec)
    ctx = Context.from_env(env)
    poll_s = env_seconds(env, POLL_ENV, 10.0, minimum=0.001)
    start_grace_s = env_seconds(env, START_GRACE_ENV, START_GRACE_S)
    return drive(spec, text, ctx, api or Api(None, log=log), poll_s=poll_s, log=log, start_grace_s=start_grace_s)
