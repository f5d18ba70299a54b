"""``replayjob k8s submit``: create one run of an ablation with the kubernetes client, stage by stage.

Every submission is its own run: a run id (UTC time plus random hex) names its objects
(``NAME-RUNID-capture`` ...), labels them and, through the downward API, becomes its run directory
``/artifacts/runs/NAME/RUNID``; ``replayjob step`` checks the run's fingerprint there, so nothing of
another run is ever reused.  The namespace is ``--namespace``, else the kubeconfig context's, else
the pod's own (in cluster), else ``default``.

Stages: the spec ConfigMap and the PVC (kept if it exists), the capture Job; only after the capture
succeeded, the replay Job (every arm and repeat, the spec's ``parallelism`` across all of them; one
Job per rank count, one after another, when arms run different numbers of ranks), so replays never
hold GPUs the capture needs; once the replays ended, however they ended, the reduce
Job, which always writes a verdict (refused when replays are missing).  Within the replay Job a
replay that fails for good stops its siblings (``maxFailedIndexes: 0``).  Without ``wait`` the
command returns once the reduce Job exists; with ``wait`` it waits for it and returns its code.

Exit codes: a stage that failed for good passes its container's code on: 1 (a negative verdict) and 2
(refused) are final; 3 (an error on every attempt) and infrastructure failures that used up their
retries are errors (3, retryable).  API calls are retried with exponential backoff on connection
errors, 429 and 5xx; an API that stays unreachable is an error (3).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replayjob.deploy import k8s
from replayjob.deploy.ablation import AblationSpec
from replayjob.errors import EXIT_OK, ArtifactExistsError, OperationalError, RefusedError, error_for_exit_status

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
    except (config.ConfigException, OSError) as exc:
        raise RefusedError(f"no Kubernetes credentials: {exc}",
                           hint="set KUBECONFIG or run inside the cluster") from None
    return str((active or {}).get("context", {}).get("namespace") or "default")


class Api:
    """The few calls submit makes, each retried with exponential backoff on transient failures."""

    def __init__(self, api_client: Any | None, *, tries: int = 6, backoff_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep, log: Log = print):
        from kubernetes import client

        self.default_namespace = _load_config() if api_client is None else "default"
        api_client = api_client or client.ApiClient()
        self.core, self.batch = client.CoreV1Api(api_client), client.BatchV1Api(api_client)
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

    def create(self, namespace: str, body: dict[str, Any], *, exist_ok: bool = False) -> bool:
        from kubernetes.client.exceptions import ApiException

        api, method = {"ConfigMap": (self.core, "create_namespaced_config_map"),
                       "PersistentVolumeClaim": (self.core, "create_namespaced_persistent_volume_claim"),
                       "Job": (self.batch, "create_namespaced_job")}[body["kind"]]
        fn: Callable[..., Any] = getattr(api, method)
        name = f"{body['kind']} {body['metadata']['name']}"
        try:
            self.call(f"creating {name}", fn, namespace=namespace, body=body)
            return True
        except ApiException as exc:
            if exc.status == 409 and exist_ok:
                return False
            if exc.status == 409:
                raise ArtifactExistsError(f"{name} already exists", where=f"namespace {namespace}",
                                          hint="every submission gets a new run id; delete the old objects") from None
            raise RefusedError(f"creating {name} failed: HTTP {exc.status} {exc.reason}",
                               where=f"namespace {namespace}") from None

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
        return next((c for c in (1, 2, 3) if c in codes), None)


def _wait(api: Api, namespace: str, name: str, poll_s: float, log: Log) -> tuple[str, str]:
    while True:
        state, reason = api.job_state(namespace, name)
        if state is not None:
            log(f"job {name}: {state}{' (' + reason + ')' if reason else ''}")
            return state, reason
        api.sleep(poll_s)


def _failure(api: Api, namespace: str, name: str, reason: str) -> Exception:
    code = api.exit_code(namespace, name)
    detail = {1: ", exit 1: a negative verdict",
              2: ", exit 2: refused input or an inconclusive budget (see verdict.json)",
              3: ", exit 3: an error on every attempt"}.get(code or 0, "")
    cls = error_for_exit_status(code) if code is not None else OperationalError
    return cls(f"job {name} failed ({reason or 'no reason given'}{detail})", where=f"namespace {namespace}",
               hint=f"kubectl logs -n {namespace} job/{name}")


def submit(spec: AblationSpec, text: str, namespace: str | None, *, wait: bool, api_client: Any | None = None,
           poll_s: float = 10.0, log: Log = print, run_id: str | None = None, api: Api | None = None) -> int:
    """Create one run stage by stage (see the module docstring); with ``wait``, the reducer's code."""
    api = api or Api(api_client, log=log)
    ns = namespace or api.default_namespace
    run_id = run_id or new_run_id()
    files = k8s.render(spec, text, run_id)
    log(f"submit: run {run_id} in namespace {ns}; run directory {k8s.MOUNT}/runs/{spec.name}/{run_id} "
        f"on PVC {spec.claim_name}")
    api.create(ns, files["spec.yaml"])
    if api.create(ns, files["pvc.yaml"], exist_ok=True):
        log(f"created persistentvolumeclaim/{spec.claim_name}")
    replays = [files[n] for n in k8s.replay_files(spec)]  # one per rank count, one after another
    stages = [files["capture.yaml"], *replays, files["reduce.yaml"]]
    for body in stages:
        body["spec"]["suspend"] = False  # this stage's turn has come
        name = body["metadata"]["name"]
        api.create(ns, body)
        log(f"created job/{name}")
        if body is stages[-1] and not wait:
            break
        state, reason = _wait(api, ns, name, poll_s, log)
        if state == "Failed" and body is stages[0]:
            raise _failure(api, ns, name, reason)  # no capture, no replays
        if state == "Failed" and any(body is r for r in replays):
            log(f"submit: job {name} failed ({reason}); the reducer judges the missing replays")
        if state == "Failed" and body is stages[-1]:
            raise _failure(api, ns, name, reason)
    log(f"verdict: {k8s.MOUNT}/runs/{spec.name}/{run_id}/verdict.json on PVC {spec.claim_name}")
    return EXIT_OK
