"""``replayjob k8s submit|resume``: start one run of an ablation in the cluster; no client in the chain.

A run is chained **in the cluster** by its driver, a Job running ``replayjob k8s drive``
(:mod:`replayjob.deploy.driver`), not by this process: ``submit`` creates the driver Job and the run's
spec ConfigMap (owned by the driver, so it goes with the run) and returns, or with ``wait`` follows
the driver and returns its code, the reducer's.  A CI runner that dies after ``submit`` leaves the
run going to its verdict; ``wait`` on a run submitted earlier is ``resume RUN_ID --wait``.

Every submission is its own run: a run id (UTC time plus random hex) names its objects
(``NAME-RUNID-driver``, ``-capture`` ...), labels them and, through the downward API, becomes its run
directory ``/artifacts/runs/NAME/RUNID``; ``replayjob step`` checks the run's fingerprint there, so
nothing of another run is ever reused.  The namespace is ``--namespace``, else the kubeconfig
context's, else the pod's own (in cluster), else ``default``.  What outlives runs (the claim, the
driver's service account and Role) is applied once per namespace (``k8s/setup``); a submission into
a namespace without it is refused.

``resume RUN_ID`` starts a new driver for a run whose driver ended without finishing it (its retries
used up, an API outage) and adds it as an owner of the run's ConfigMap; the new driver adopts the
stage Jobs that exist and creates the rest.  With a driver still running it only follows it.

Exit codes: the driver's, which is the reducer's (0 pass, 1 a negative verdict, 2 refused; 3 an error
on every attempt, or a run that ended without a verdict).  API calls are retried with exponential
backoff on connection errors, 429 and 5xx; an API that stays unreachable is an error (3).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replayjob.deploy import k8s
from replayjob.deploy.ablation import AblationSpec, spec_from_text
from replayjob.errors import (
    EXIT_ERROR,
    EXIT_OK,
    FINAL_EXIT_STATUSES,
    ArtifactExistsError,
    OperationalError,
    RefusedError,
    error_for_exit_status,
    is_retryable,
)

Log = Callable[[str], None]
RETRY_STATUS = (429, 500, 502, 503, 504)
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def new_run_id() -> str:
    """A run id: UTC time to the second and 16 random bits, a DNS-label fragment (16 characters)."""
    return time.strftime("%y%m%d%H%M%S", time.gmtime()) + secrets.token_hex(2)


def _load_config() -> str:
    """Load credentials; return the namespace they imply (kubeconfig context's, or the pod's own)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
        try:
            return IN_CLUSTER_NAMESPACE.read_text(encoding="utf-8").strip() or "default"
        except OSError:
            return "default"
    except config.ConfigException:
        pass
    path = os.environ.get("KUBECONFIG") or None  # read now (the client reads it once, at import)
    try:
        config.load_kube_config(config_file=path)
        _, active = config.list_kube_config_contexts(config_file=path)
    except (config.ConfigException, OSError) as exc:  # the cluster cannot be reached: nothing decided (3)
        raise OperationalError(f"no Kubernetes credentials: {exc}",
                               hint="set KUBECONFIG or run inside the cluster") from None
    return str((active or {}).get("context", {}).get("namespace") or "default")


class Api:
    """The few calls submit makes, each retried with exponential backoff on transient failures."""

    def __init__(self, api_client: Any | None, *, tries: int = 6, backoff_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep, log: Log = print):
        from kubernetes import client

        self.default_namespace = _load_config() if api_client is None else "default"
        api_client = api_client or client.ApiClient()
        self.client = api_client
        self.core, self.batch = client.CoreV1Api(api_client), client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)  # Argo's Workflows
        self.tries, self.backoff_s, self.sleep, self.log = tries, backoff_s, sleep, log

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        delay = self.backoff_s
        for attempt in range(1, self.tries + 1):
            try:
                return fn(*args, **kwargs)
            except ApiException as exc:
                if exc.status not in RETRY_STATUS or attempt == self.tries:
                    if exc.status in RETRY_STATUS:
                        raise OperationalError(f"{what}: the API answered HTTP {exc.status} {exc.reason} "
                                               f"{self.tries} times") from None
                    raise
                cause = f"HTTP {exc.status}"
            except (HTTPError, OSError) as exc:
                if attempt == self.tries:
                    raise OperationalError(f"{what}: the API server stayed unreachable ({self.tries} tries): "
                                           f"{type(exc).__name__}") from None
                cause = type(exc).__name__
            self.log(f"submit: {what}: {cause}; retrying in {delay:.0f} s ({attempt}/{self.tries})")
            self.sleep(delay)
            delay = min(delay * 2, 60.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def _method(self, kind: str, verb: str) -> Callable[..., Any]:
        api, plural = {"ConfigMap": (self.core, "config_map"),
                       "PersistentVolumeClaim": (self.core, "persistent_volume_claim"),
                       "ServiceAccount": (self.core, "service_account"), "Pod": (self.core, "pod"),
                       "Job": (self.batch, "job")}[kind]
        fn: Callable[..., Any] = getattr(api, f"{verb}_namespaced_{plural}")
        return fn

    def as_dict(self, obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = self.client.sanitize_for_serialization(obj)
        return out

    def create(self, namespace: str, body: dict[str, Any], *, exist_ok: bool = False) -> dict[str, Any] | None:
        """Create ``body``; return the object as created (its ``metadata.uid``), or None when it existed
        and ``exist_ok``."""
        from kubernetes.client.exceptions import ApiException

        name = f"{body['kind']} {body['metadata']['name']}"
        try:
            return self.as_dict(self.call(f"creating {name}", self._method(body["kind"], "create"),
                                          namespace=namespace, body=body))
        except ApiException as exc:
            if exc.status == 409 and exist_ok:
                return None
            if exc.status == 409:
                raise ArtifactExistsError(f"{name} already exists", where=f"namespace {namespace}",
                                          hint="every submission gets a new run id; delete the old objects") from None
            raise RefusedError(f"creating {name} failed: HTTP {exc.status} {exc.reason}",
                               where=f"namespace {namespace}") from None

    def read(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none (404); any other refusal is one."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.as_dict(self.call(f"reading {kind} {name}", self._method(kind, "read"), name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise RefusedError(f"reading {kind} {name} failed: HTTP {exc.status} {exc.reason}",
                               where=f"namespace {namespace}") from None

    def exists(self, namespace: str, kind: str, name: str) -> bool:
        return self.read(namespace, kind, name) is not None

    def list_of(self, namespace: str, kind: str, selector: str) -> list[dict[str, Any]]:
        """The objects of ``kind`` whose labels match ``selector`` (``k=v,k2=v2``)."""
        from kubernetes.client.exceptions import ApiException

        try:
            found = self.call(f"listing {kind} {selector}", self._method(kind, "list"), namespace,
                              label_selector=selector)
        except ApiException as exc:
            raise RefusedError(f"listing {kind} failed: HTTP {exc.status} {exc.reason}",
                               where=f"namespace {namespace}") from None
        return [self.as_dict(item) for item in found.items]

    def patch(self, namespace: str, kind: str, name: str, ops: list[dict[str, Any]]) -> None:
        """Apply a JSON patch (RFC 6902) to the object."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.call(f"patching {kind} {name}", self._method(kind, "patch"), name, namespace, ops)
        except ApiException as exc:
            raise RefusedError(f"patching {kind} {name} failed: HTTP {exc.status} {exc.reason}",
                               where=f"namespace {namespace}") from None

    def add_owner(self, namespace: str, kind: str, doc: dict[str, Any], owner: dict[str, Any]) -> bool:
        """Make ``owner`` one more owner of ``doc`` (a ``kind``; deleted once all its owners are); False
        when it was one."""
        meta = doc["metadata"]
        refs = meta.get("ownerReferences") or []
        if any(r.get("uid") == owner["uid"] for r in refs):
            return False
        op = ({"op": "add", "path": "/metadata/ownerReferences/-", "value": owner} if refs
              else {"op": "add", "path": "/metadata/ownerReferences", "value": [owner]})
        self.patch(namespace, kind, meta["name"], [op])
        return True

    def job_state(self, namespace: str, name: str) -> tuple[str | None, str]:
        job = self.call(f"reading job {name}", self.batch.read_namespaced_job_status, name, namespace)
        for cond in (job.status.conditions or []) if job.status else []:
            if cond.status == "True" and cond.type in ("Complete", "Failed"):
                return str(cond.type), str(cond.reason or "")
        return None, ""

    def exit_code(self, namespace: str, name: str) -> int | None:
        """The decisive exit code among the Job's terminated containers, else None: a final 1 or 2 in any
        attempt outranks a retryable 3 in another, whatever order the API lists the pods in."""
        pods = self.call(f"listing pods of job {name}", self.core.list_namespaced_pod, namespace,
                         label_selector=f"batch.kubernetes.io/job-name={name}")
        codes = {int(st.state.terminated.exit_code) for pod in pods.items
                 for st in pod.status.container_statuses or [] if st.state and st.state.terminated}
        return decisive_code(codes)


def decisive_code(codes: set[int]) -> int | None:
    """The code that decides among the exit codes of a Job's attempts: a final one
    (:data:`~replayjob.errors.FINAL_EXIT_STATUSES`, the lowest) outranks a retryable one, which is 3
    (nothing decided) whatever the status (137, a signal); None when every attempt exited 0."""
    final = sorted(codes & FINAL_EXIT_STATUSES)
    if final:
        return final[0]
    return EXIT_ERROR if any(is_retryable(c) for c in codes) else None


def wait_job(api: Api, namespace: str, name: str, poll_s: float, log: Log) -> tuple[str, str]:
    """Poll a Job until it has ended: every ``poll_s`` seconds, sooner at first (0.5 s, doubling), so a
    short stage is seen ending soon after it did."""
    delay = min(poll_s, 0.5)
    while True:
        state, reason = api.job_state(namespace, name)
        if state is not None:
            log(f"job {name}: {state}{' (' + reason + ')' if reason else ''}")
            return state, reason
        api.sleep(delay)
        delay = min(poll_s, delay * 2)


def _failure(api: Api, namespace: str, name: str, reason: str) -> Exception:
    code = api.exit_code(namespace, name)
    detail = {1: ", exit 1: a negative verdict",
              2: ", exit 2: refused input or an inconclusive budget (see verdict.json)",
              3: ", exit 3: an error on every attempt"}.get(code or 0, "")
    cls = error_for_exit_status(code) if code is not None else OperationalError
    return cls(f"job {name} failed ({reason or 'no reason given'}{detail})", where=f"namespace {namespace}",
               hint=f"kubectl logs -n {namespace} job/{name}")


def check_setup(api: Api, namespace: str, spec: AblationSpec) -> None:
    """Refuse a run in a namespace without the once-applied setup (the claim, the driver's account): a
    run never creates what outlives it, so deleting a run never deletes data."""
    for kind, name in (("PersistentVolumeClaim", spec.claim_name), ("ServiceAccount", k8s.driver_account(spec))):
        if not api.exists(namespace, kind, name):
            raise RefusedError(f"no {kind} {name}: the namespace's setup is not applied",
                               where=f"namespace {namespace}",
                               hint=f"once per namespace: replayjob k8s render SPEC --setup k8s/setup && "
                                    f"kubectl -n {namespace} apply -k k8s/setup")


def job_ended(job: dict[str, Any]) -> bool:
    return any(c.get("status") == "True" and c.get("type") in ("Complete", "Failed")
               for c in (job.get("status") or {}).get("conditions") or [])


def wait_driver(api: Api, namespace: str, name: str, poll_s: float, log: Log) -> int:
    """Follow a driver Job to its end; its code is the reducer's (a failure is raised with it)."""
    log(f"following job/{name} (kubectl -n {namespace} logs -f job/{name})")
    state, reason = wait_job(api, namespace, name, poll_s, log)
    if state == "Complete":
        return EXIT_OK
    raise _failure(api, namespace, name, reason)


def submit(spec: AblationSpec, text: str, namespace: str | None, *, wait: bool, api_client: Any | None = None,
           poll_s: float = 10.0, log: Log = print, run_id: str | None = None, api: Api | None = None) -> int:
    """Start one run: its driver Job and its spec ConfigMap (owned by the driver); with ``wait``,
    follow the driver and return its code (see the module docstring)."""
    run_id = run_id or new_run_id()
    files = k8s.render(spec, text, run_id)  # refused (a tag image, ...) before the API is touched
    api = api or Api(api_client, log=log)
    ns = namespace or api.default_namespace
    check_setup(api, ns, spec)
    driver = api.create(ns, files["driver.yaml"])
    assert driver is not None
    config_map = files["spec.yaml"]
    config_map["metadata"]["ownerReferences"] = [k8s.owner_reference(driver)]  # it goes with the run
    api.create(ns, config_map)
    name = driver["metadata"]["name"]
    log(f"submit: run {run_id} in namespace {ns}: job/{name} chains capture, replays and reduce in the cluster; "
        f"run directory {k8s.MOUNT}/runs/{spec.name}/{run_id} on PVC {spec.claim_name}")
    if not wait:
        log(f"follow it: replayjob k8s resume {run_id} --namespace {ns} --wait")
        return EXIT_OK
    code = wait_driver(api, ns, name, poll_s, log)
    log(f"verdict: {k8s.MOUNT}/runs/{spec.name}/{run_id}/verdict.json on PVC {spec.claim_name}")
    return code


def resume(run_id: str, namespace: str | None, *, wait: bool, api_client: Any | None = None, poll_s: float = 10.0,
           log: Log = print, api: Api | None = None) -> int:
    """Continue run ``run_id``: follow its driver if one still runs, else start a new one (see the
    module docstring)."""
    api = api or Api(api_client, log=log)
    ns = namespace or api.default_namespace
    selector = f"{k8s.RUN_ID_LABEL}={run_id},app.kubernetes.io/component="
    maps = api.list_of(ns, "ConfigMap", selector + "spec")
    if not maps:
        raise RefusedError(f"no run {run_id}: its spec ConfigMap is gone (the run was deleted, or its jobs' TTL "
                           "passed)", where=f"namespace {ns}", hint="submit a new run")
    config_map = maps[0]
    where = f"configmap {config_map['metadata']['name']}"
    spec = spec_from_text((config_map.get("data") or {}).get("ablation.toml", ""), where)
    drivers = sorted(api.list_of(ns, "Job", selector + k8s.DRIVER),
                     key=lambda d: str(d["metadata"].get("creationTimestamp") or ""))
    running = [d for d in drivers if not job_ended(d)]
    if running:
        name = running[-1]["metadata"]["name"]
        log(f"resume: run {run_id}: job/{name} is still driving it")
    else:
        body = k8s.driver_job(spec, run_id, config_map["metadata"]["name"], suffix=f"-{len(drivers) + 1}")
        if drivers:  # the image and GPU product the run's first driver ran with (an overlay may have set them)
            previous = drivers[-1]["spec"]["template"]["spec"]["containers"][0]
            mine = body["spec"]["template"]["spec"]["containers"][0]
            mine["image"] = previous["image"]
            given = {e["name"]: e for e in previous.get("env") or [] if "value" in e}
            mine["env"] = [given.get(e["name"], e) if e["name"] in ("REPLAYJOB_IMAGE_REF", "REPLAYJOB_GPU_PRODUCT")
                           else e for e in mine["env"]]
        driver = api.create(ns, body)
        assert driver is not None
        name = driver["metadata"]["name"]
        api.add_owner(ns, "ConfigMap", config_map, k8s.owner_reference(driver))
        log(f"resume: run {run_id}: started job/{name}, which adopts the run's jobs and creates the rest")
    if not wait:
        return EXIT_OK
    return wait_driver(api, ns, name, poll_s, log)
