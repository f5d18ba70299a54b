"""Create an ablation's objects with the kubernetes client and, with ``wait``, gate on exit codes.

Without ``wait`` every object is created at once and the Jobs order themselves: a replay waits for
the capture's ``metrics.json`` and the reducer for every ``replay_metrics.json`` (bounded by
``deadline_s``).  With ``wait`` the Jobs are created stage by stage (capture, then every arm's
replays, then the reducer), each stage only after the previous one completed, so no GPU idles
waiting; a failed stage stops the ablation and its container's exit code becomes ours: 1 (a
negative verdict) or 2 (refused) are final; 3 (an error that used up the Job's retries) and an
infrastructure failure that used up its retries are reported as errors (3, retryable) with the
Job's reason.  The result is the reducer's exit code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from replayjob.deploy import k8s
from replayjob.deploy.ablation import AblationSpec
from replayjob.errors import EXIT_OK, ArtifactExistsError, OperationalError, RefusedError, error_for_exit_status

Log = Callable[[str], None]


def _api(api_client: Any | None) -> tuple[Any, Any]:
    from kubernetes import client, config

    if api_client is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:  # KUBECONFIG read now (the client reads it once, at import)
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
            except (config.ConfigException, OSError) as exc:
                raise RefusedError(f"no Kubernetes credentials: {exc}",
                                   hint="set KUBECONFIG or run inside the cluster") from None
        api_client = client.ApiClient()
    return client.CoreV1Api(api_client), client.BatchV1Api(api_client)


def _create(fn: Callable[..., Any], namespace: str, body: dict[str, Any], *, exist_ok: bool) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        fn(namespace=namespace, body=body)
        return True
    except ApiException as exc:
        if exc.status == 409 and exist_ok:
            return False
        if exc.status == 409:
            raise ArtifactExistsError(f"{body['kind']} {body['metadata']['name']} already exists",
                                      where=f"namespace {namespace}",
                                      hint="delete it (kubectl delete job NAME) or rename the ablation") from None
        raise RefusedError(f"creating {body['kind']} {body['metadata']['name']} failed: "
                           f"HTTP {exc.status} {exc.reason}", where=f"namespace {namespace}") from None


def _finished(job: Any) -> str | None:
    for cond in (job.status.conditions or []) if job.status else []:
        if cond.status == "True" and cond.type in ("Complete", "Failed"):
            return str(cond.type)
    return None


def _exit_code(core: Any, namespace: str, name: str) -> int | None:
    """The first exit code 1, 2 or 3 among the Job's terminated containers, else None."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/job-name={name}")
    for pod in pods.items:
        statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
        for st in statuses:
            term = st.state.terminated if st.state else None
            if term is not None and term.exit_code in (1, 2, 3):
                return int(term.exit_code)
    return None


def _wait(core: Any, batch: Any, namespace: str, names: list[str], poll_s: float, log: Log) -> None:
    pending = list(names)
    while pending:
        for name in list(pending):
            job = batch.read_namespaced_job_status(name, namespace)
            state = _finished(job)
            if state is None:
                continue
            pending.remove(name)
            log(f"job {name}: {state}")
            if state == "Failed":
                code = _exit_code(core, namespace, name)
                reason = next((c.reason for c in job.status.conditions if c.type == "Failed"), "")
                detail = {1: ", exit 1: a negative verdict", 2: ", exit 2: refused input",
                          3: ", exit 3: an error on every attempt"}.get(code or 0, "")
                cls = error_for_exit_status(code) if code is not None else OperationalError
                raise cls(f"job {name} failed ({reason or 'no reason given'}{detail})",
                          where=f"namespace {namespace}", hint=f"kubectl logs -n {namespace} job/{name}")
        if pending:
            time.sleep(poll_s)


def submit(spec: AblationSpec, namespace: str, *, wait: bool, api_client: Any | None = None,
           poll_s: float = 10.0, log: Log = print) -> int:
    """Create the PVC (kept if it exists) and the Jobs; with ``wait``, return the reducer's code."""
    core, batch = _api(api_client)
    files = k8s.render(spec)
    if _create(core.create_namespaced_persistent_volume_claim, namespace, files["pvc.yaml"], exist_ok=True):
        log(f"created persistentvolumeclaim/{spec.claim_name}")
    stages = [["capture.yaml"], [f"replay-{a.name}.yaml" for a in spec.arms], ["reduce.yaml"]]
    for stage in stages:
        names = []
        for fname in stage:
            body = files[fname]
            _create(batch.create_namespaced_job, namespace, body, exist_ok=False)
            names.append(body["metadata"]["name"])
            log(f"created job/{names[-1]}")
        if wait:
            _wait(core, batch, namespace, names, poll_s, log)
    if wait:
        log(f"verdict: {k8s.run_dir(spec)}/verdict.json on PVC {spec.claim_name}")
    return EXIT_OK
