"""``replayjob k8s submit|resume``: start one run of an ablation in the cluster; no client in the chain.

A run is chained **in the cluster** by its driver, a Job running ``replayjob k8s drive``
(:mod:`replayjob.launch.k8s_driver`), not by this process: ``submit`` creates the driver Job and the run's
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

import math
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replayjob.artifacts import cluster_status as outcome
from replayjob.artifacts.spec import AblationSpec, spec_from_text
from replayjob.artifacts.verdict import read_verdict_text
from replayjob.errors import (
    EXIT_OK,
    ArtifactExistsError,
    ConfigError,
    ContractError,
    OperationalError,
    RefusedError,
    ReplayjobError,
    error_for_exit_status,
)
from replayjob.jsonio import loads_strict
from replayjob.launch import jobset, k8s

Log = Callable[[str], None]
RETRY_STATUS = (429, 500, 502, 503, 504)
HINT_403 = "the account may not do this in the namespace: apply the namespace's setup (k8s/setup), or ask its admin"


def contains(actual: Any, expected: Any) -> bool:
    """Whether ``actual`` holds everything ``expected`` says (the API server adds defaults: extra keys are
    fine, a different or missing value is not)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(actual, list) and len(actual) == len(expected) and all(
            contains(a, e) for a, e in zip(actual, expected, strict=True))
    return bool(actual == expected)


JOBSET_KIND = jobset.KIND


def is_rendered(found: dict[str, Any], body: dict[str, Any]) -> bool:
    """Whether an object found under ``body``'s name is ``body`` as this run rendered it: its labels, and for a
    Job its pod template (what its pods would run).  ``found`` is read through its declaration
    (:class:`~replayjob.artifacts.cluster_status.Found`): a malformed one is :class:`OperationalError` (3)."""
    obj = outcome.read_object(found, outcome.Found, f"{str(body['kind']).lower()} {body['metadata']['name']}")
    same = contains(obj.metadata.labels or {}, body["metadata"].get("labels") or {})
    if body.get("kind") == "Job":
        same = same and contains((obj.spec or {}).get("template"), body["spec"]["template"])
    if body.get("kind") == "JobSet":  # a run across nodes: its replicated Job, pod template included
        same = same and contains((obj.spec or {}).get("replicatedJobs"), body["spec"]["replicatedJobs"])
    return same


def meta(doc: Any, what: str) -> outcome.ObjectMeta:
    """The metadata of an object the API answered, read through its declaration
    (:class:`~replayjob.artifacts.cluster_status.Object`)."""
    return outcome.read_object(doc, outcome.Object, what).metadata


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
        self.retried = False

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        delay = self.backoff_s
        self.retried = False
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
            self.retried = True  # a reply may have been lost: a create that now answers 409 may be this one's
            self.log(f"submit: {what}: {cause}; retrying in {delay:.0f} s ({attempt}/{self.tries})")
            self.sleep(delay)
            delay = min(delay * 2, 60.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def _method(self, kind: str, verb: str) -> Callable[..., Any]:
        if kind == JOBSET_KIND:
            return self._jobset(verb)
        api, plural = {"ConfigMap": (self.core, "config_map"),
                       "PersistentVolumeClaim": (self.core, "persistent_volume_claim"),
                       "ServiceAccount": (self.core, "service_account"), "Pod": (self.core, "pod"),
                       "Job": (self.batch, "job")}[kind]
        fn: Callable[..., Any] = getattr(api, f"{verb}_namespaced_{plural}")
        return fn

    def _jobset(self, verb: str) -> Callable[..., Any]:
        """A JobSet's calls (a custom resource), taking the arguments the built-in kinds' calls take."""
        group, version, plural, c = jobset.GROUP, jobset.VERSION, jobset.PLURAL, self.custom
        calls: dict[str, Callable[..., Any]] = {
            "create": lambda namespace, body, **kw: c.create_namespaced_custom_object(
                group, version, namespace, plural, body, **kw),
            "read": lambda name, namespace, **kw: c.get_namespaced_custom_object(
                group, version, namespace, plural, name, **kw),
            "list": lambda namespace, **kw: c.list_namespaced_custom_object(group, version, namespace, plural, **kw),
            "patch": lambda name, namespace, body, **kw: c.patch_namespaced_custom_object(
                group, version, namespace, plural, name, body, _content_type="application/json-patch+json", **kw)}
        return calls[verb]

    def as_dict(self, obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = self.client.sanitize_for_serialization(obj)
        return out

    def create(self, namespace: str, body: dict[str, Any], *, exist_ok: bool = False) -> dict[str, Any] | None:
        """Create ``body``; return the object as created (its ``metadata.uid``), or None when it existed
        and ``exist_ok``.  A create answered 409 after a retry (its first reply lost) returns the object that
        exists when it is this one (:func:`is_rendered`: the labels and the pod template sent); any other
        failure of the cluster is :class:`OperationalError` (3)."""
        from kubernetes.client.exceptions import ApiException

        name = f"{body['kind']} {body['metadata']['name']}"
        try:
            created = self.as_dict(self.call(f"creating {name}", self._method(body["kind"], "create"),
                                             namespace=namespace, body=body))
            outcome.read_object(created, outcome.Created, f"created {name}", where=f"namespace {namespace}")
            return created
        except ApiException as exc:
            if exc.status == 409 and exist_ok:
                return None
            if exc.status == 409 and self.retried:
                found = self.read(namespace, body["kind"], body["metadata"]["name"])
                if found is not None and is_rendered(found, body):
                    outcome.read_object(found, outcome.Created, f"found {name}", where=f"namespace {namespace}")
                    self.log(f"submit: {name} was created by a request whose reply was lost; it is this one")
                    return found
            if exc.status == 409:
                raise ArtifactExistsError(f"{name} already exists", where=f"namespace {namespace}",
                                          hint="every submission gets a new run id; delete the old objects") from None
            raise OperationalError(f"creating {name} failed: HTTP {exc.status} {exc.reason}",
                                   where=f"namespace {namespace}", hint=HINT_403 if exc.status == 403 else None) \
                from None

    def read(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        """The object as the API's JSON, or None when there is none (404); any other failure is
        :class:`OperationalError` (3)."""
        doc = self.raw(f"reading {kind} {name}", namespace, self._method(kind, "read"), name, namespace,
                       missing_ok=True)
        if doc is not None:
            outcome.read_object(doc, outcome.Object, f"{kind.lower()} {name}", where=f"namespace {namespace}")
        return doc

    def exists(self, namespace: str, kind: str, name: str) -> bool:
        return self.read(namespace, kind, name) is not None

    def list_of(self, namespace: str, kind: str, selector: str) -> list[dict[str, Any]]:
        """The objects of ``kind`` whose labels match ``selector`` (``k=v,k2=v2``), as the API's JSON."""
        doc = self.raw(f"listing {kind} {selector}", namespace, self._method(kind, "list"), namespace,
                       label_selector=selector)
        outcome.read_object(doc, outcome.ObjectList, f"{kind.lower()} list {selector}", where=f"namespace {namespace}")
        items: list[dict[str, Any]] = doc["items"]
        return items

    def patch(self, namespace: str, kind: str, name: str, ops: list[dict[str, Any]]) -> None:
        """Apply a JSON patch (RFC 6902) to the object; a failure (a 409, a 403) is :class:`OperationalError`."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.call(f"patching {kind} {name}", self._method(kind, "patch"), name, namespace, ops)
        except ApiException as exc:
            raise OperationalError(f"patching {kind} {name} failed: HTTP {exc.status} {exc.reason}",
                                   where=f"namespace {namespace}", hint=HINT_403 if exc.status == 403 else None) \
                from None

    def add_owner(self, namespace: str, kind: str, doc: dict[str, Any], owner: dict[str, Any]) -> bool:
        """Make ``owner`` one more owner of ``doc`` (a ``kind``; deleted once all its owners are); False
        when it was one."""
        found = meta(doc, kind.lower())
        refs = found.ownerReferences or []
        if any(r.uid == owner["uid"] for r in refs):
            return False
        op = ({"op": "add", "path": "/metadata/ownerReferences/-", "value": owner} if refs
              else {"op": "add", "path": "/metadata/ownerReferences", "value": [owner]})
        self.patch(namespace, kind, found.name, [op])
        return True

    def raw(self, what: str, namespace: str, fn: Callable[..., Any], *args: Any, missing_ok: bool = False,
            **kwargs: Any) -> Any:
        """The API's JSON answer to ``fn`` (no client model in between: the answer is read through
        :mod:`replayjob.artifacts.cluster_status`'s declarations).  A refusal (403), an object gone (404) or a body
        that is no JSON is :class:`OperationalError` (3): the cluster failed, not the input."""
        from kubernetes.client.exceptions import ApiException

        try:
            reply = self.call(what, fn, *args, _preload_content=False, **kwargs)
        except ApiException as exc:
            if exc.status == 404 and missing_ok:
                return None
            gone = " (deleted while the run waited for it)" if exc.status == 404 else ""
            raise OperationalError(f"{what} failed: HTTP {exc.status} {exc.reason}{gone}",
                                   where=f"namespace {namespace}",
                                   hint="nothing was decided; 403: the credentials lack this permission") from None
        try:
            return loads_strict(reply.data, where=what)
        except ReplayjobError as exc:
            raise OperationalError(f"{what}: the API answered no JSON object ({exc.message})",
                                   where=f"namespace {namespace}") from None

    def job_state(self, namespace: str, name: str, kind: str = "Job") -> tuple[str | None, str, bool]:
        """(``Complete`` or ``Failed``, its reason, whether it is suspended) of Job ``name``; (None, "", ...)
        while it runs.  A JobSet's ``Completed`` and ``Failed`` conditions are read as a Job's."""
        if kind == JOBSET_KIND:
            doc = self.raw(f"reading jobset {name}", namespace, self._jobset("read"), name, namespace)
            return outcome.job_end(doc, name, kind="jobset")
        doc = self.raw(f"reading job {name}", namespace, self.batch.read_namespaced_job_status, name, namespace)
        return outcome.job_end(doc, name)

    def _pods(self, namespace: str, name: str, kind: str) -> Any:
        label = jobset.NAME_LABEL if kind == JOBSET_KIND else k8s.JOB_NAME_LABEL
        return self.raw(f"listing pods of {kind.lower()} {name}", namespace, self.core.list_namespaced_pod, namespace,
                        label_selector=f"{label}={name}")

    def stage_stuck(self, namespace: str, name: str, kind: str = "Job") -> outcome.Stuck | None:
        """What keeps Job ``name``'s pods from starting, from its pods and its events (read-only ``events``);
        for a JobSet, its pods and the events of the Job it creates."""
        job = jobset.child_job(name) if kind == JOBSET_KIND else name
        events = self.raw(f"listing events of job {job}", namespace, self.core.list_namespaced_event, namespace,
                          field_selector=f"involvedObject.name={job}")
        return outcome.stuck(job, self._pods(namespace, name, kind), events)

    def exit_code(self, namespace: str, name: str, state: str | None, kind: str = "Job") -> int | None:
        """The exit code of the ended Job (or JobSet) ``name`` whose condition is ``state``, as its condition and
        its terminated containers say it together (:func:`replayjob.artifacts.cluster_status.job_outcome`), else
        None: a final 1 or 2 in any attempt outranks a retryable 3 in another, whatever order the API lists the
        pods in, and ``Complete`` is 0 only beside an attempt that exited 0."""
        return self.ended(namespace, name, state, kind)[0]

    def ended(self, namespace: str, name: str, state: str | None, kind: str = "Job") -> tuple[int | None, str]:
        """:meth:`exit_code`, and how the pods said it (:func:`replayjob.artifacts.cluster_status.job_outcome`)."""
        return outcome.job_outcome(state, outcome.pod_codes(self._pods(namespace, name, kind), name))


WAIT_GRACE_S = 600  # how long past a Job's own deadline its wait goes on (the Job controller's lag)
START_GRACE_ENV = "REPLAYJOB_START_GRACE_S"  # how long a stage may stay unable to start [default: 300]
START_GRACE_S = 300.0
MAX_ENV_SECONDS = 30 * 24 * 3600.0  # a month: the longest wait a run's settings may ask for


def env_seconds(environ: Any, name: str, default: float, *, minimum: float = 0.0) -> float:
    """The number of seconds the environment variable ``name`` sets (``default`` when unset or empty): a finite
    decimal number from ``minimum`` to :data:`MAX_ENV_SECONDS`, else :class:`ConfigError` (2) naming it (``nan``
    would turn a grace period off, a negative one end every wait at once, and a poll of ``nan`` or ``-1`` s
    stop the driver with a traceback)."""
    text = environ.get(name) or ""
    if not text:
        return default
    plain = re.fullmatch(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", text)  # no '1_0', ' 5', other digits
    value = float(text) if plain else math.nan
    if not minimum <= value <= MAX_ENV_SECONDS:  # also false for nan
        raise ConfigError(f"{name}={text!r} is not a number of seconds from {minimum:g} to {MAX_ENV_SECONDS:g}",
                          where="environment", hint=f"set {name} to a number of seconds, e.g. {default:g}")
    return value


STOPPED_KEY = "stopped.json"  # the run's ConfigMap key under which a driver records why it stopped a run


class StageStuck(OperationalError):
    """A stage that cannot start (Unschedulable, an image that cannot be pulled, FailedCreate) stayed so
    for the grace period: exit 3, naming the pod and the Kubernetes reason and message."""

    def __init__(self, job: str, cause: outcome.Stuck, waited: float, namespace: str):
        super().__init__(f"job {job} could not start for {waited:.0f} s: {cause.line()}",
                         where=f"namespace {namespace}",
                         hint=f"kubectl -n {namespace} describe job {job}; fix the cause (a node pool, the image, "
                              "a quota) and resume the run")
        self.job, self.cause = job, cause


def wait_job(api: Api, namespace: str, name: str, poll_s: float, log: Log, deadline_s: float | None = None,
             start_grace_s: float | None = None, kind: str = "Job") -> tuple[str, str]:
    """Poll a Job until it has ended: every ``poll_s`` seconds, sooner at first (0.5 s, doubling), so a
    short stage is seen ending soon after it did.  With ``deadline_s`` the wait has a deadline of its own:
    a Job not ended after that long unsuspended (time a queue holds it suspended is not counted) is
    :class:`OperationalError` (3), whatever its conditions say or fail to say.  With ``start_grace_s``,
    what keeps the Job's pods from starting (:func:`replayjob.artifacts.cluster_status.stuck`) is reported as it
    changes and ends the wait (:class:`StageStuck`, 3) once it has lasted that long.  ``kind`` ``JobSet``:
    a run across nodes, followed the same way."""
    delay = min(poll_s, 0.5)
    waited = stuck_for = 0.0
    cause: outcome.Stuck | None = None
    while True:
        state, reason, suspended = api.job_state(namespace, name, kind)
        if state is not None:
            log(f"job {name}: {state}{' (' + reason + ')' if reason else ''}")
            return state, reason
        if deadline_s is not None and waited >= deadline_s:
            raise OperationalError(f"job {name} has not ended after {waited:.0f} s of waiting (its deadline and "
                                   f"{WAIT_GRACE_S} s more); nothing decided", where=f"namespace {namespace}",
                                   hint=f"kubectl -n {namespace} describe job {name}")
        if start_grace_s is not None and not suspended:
            now = api.stage_stuck(namespace, name, kind)
            if now != cause:
                if now is not None:
                    log(f"job {name}: waiting: {now.line()} (ends the run after {start_grace_s:g} s)")
                elif cause is not None:
                    log(f"job {name}: {cause.reason} is gone; running")
                cause, stuck_for = now, 0.0
            if cause is not None and stuck_for >= start_grace_s:
                raise StageStuck(name, cause, stuck_for, namespace)
        api.sleep(delay)
        waited += 0.0 if suspended else delay
        stuck_for += delay if cause is not None else 0.0
        delay = min(poll_s, delay * 2)


def job_deadline_s(job: dict[str, Any]) -> float | None:
    """How long to wait for ``job`` (rendered): its ``activeDeadlineSeconds`` and :data:`WAIT_GRACE_S`; for a
    JobSet, its Job's deadline for every attempt (``failurePolicy.maxRestarts`` + 1) and the same grace."""
    spec = job.get("spec") or {}
    if job.get("kind") == JOBSET_KIND:
        (rjob,) = spec["replicatedJobs"]
        seconds = rjob["template"]["spec"]["activeDeadlineSeconds"] * (spec["failurePolicy"]["maxRestarts"] + 1)
    else:
        seconds = spec.get("activeDeadlineSeconds")
    return _with_grace(seconds)


def driver_deadline_s(job: outcome.DriverJob) -> float | None:
    """How long to wait for a driver Job as the API answered it: :func:`job_deadline_s`, from its declaration."""
    return _with_grace(job.spec.activeDeadlineSeconds)


def _with_grace(seconds: Any) -> float | None:
    """A Job's deadline in seconds and :data:`WAIT_GRACE_S` past it; None without one (no integer)."""
    return float(seconds + WAIT_GRACE_S) if type(seconds) is int else None


def run_drivers(api: Api, ns: str, spec: AblationSpec, run_id: str) -> list[tuple[dict[str, Any], outcome.ObjectMeta]]:
    """The driver Jobs of run ``run_id``, each with its metadata read through its declaration: labelled with it as
    drivers and named as its drivers are (``NAME-RUNID-driver``, the kustomize base's ``NAME-driver``,
    ``...-driver-N`` for resumed ones), oldest first."""
    name = re.compile(f"({re.escape(k8s.prefix(spec, run_id))}|{re.escape(spec.name)})-{k8s.DRIVER}(-[0-9]+)?")
    found = api.list_of(ns, "Job", f"{k8s.RUN_ID_LABEL}={run_id},app.kubernetes.io/component={k8s.DRIVER}")
    mine = [(d, m) for d, m in ((d, meta(d, "job")) for d in found) if name.fullmatch(m.name)]
    return sorted(mine, key=lambda dm: dm[1].creationTimestamp or "")


def check_setup(api: Api, namespace: str, spec: AblationSpec) -> None:
    """Refuse a run in a namespace without the once-applied setup (the claim, the driver's account): a
    run never creates what outlives it, so deleting a run never deletes data."""
    for kind, name in (("PersistentVolumeClaim", spec.claim_name), ("ServiceAccount", k8s.driver_account(spec))):
        if not api.exists(namespace, kind, name):
            raise RefusedError(f"no {kind} {name}: the namespace's setup is not applied",
                               where=f"namespace {namespace}",
                               hint=f"once per namespace: replayjob k8s render SPEC --setup k8s/setup && "
                                    f"kubectl -n {namespace} apply -k k8s/setup")


def job_ended(job: Any) -> bool:
    """Whether a Job (as the API lists it) has ended, read through the one Job status reader: a malformed
    status is :class:`OperationalError` (3) naming the Job and the field, never a traceback."""
    return outcome.job_end(job, meta(job, "job").name)[0] is not None


DETAIL = {1: "a negative verdict", 2: "refused input or an inconclusive budget (see verdict.json)",
          3: "nothing was decided"}


def wait_driver(api: Api, namespace: str, name: str, config_map: str, poll_s: float, log: Log,
                deadline_s: float | None = None) -> int:
    """Follow a driver Job to its end, then judge the run (:func:`replayjob.artifacts.cluster_status.judge`) from the
    verdict the driver published in the run's ConfigMap, read through the strict verdict reader, and the
    driver's own exit code (its pods'); never from the Job's condition alone.  A code other than 0 is
    raised with the line that explains it."""
    log(f"following job/{name} (kubectl -n {namespace} logs -f job/{name})")
    state, reason = wait_job(api, namespace, name, poll_s, log, deadline_s)
    code, how = api.ended(namespace, name, state)  # Complete, but no attempt exited 0: the pods' code
    doc = api.raw(f"reading configmap {config_map}", namespace, api.core.read_namespaced_config_map, config_map,
                  namespace)
    data = outcome.read_object(doc, outcome.ConfigMap, f"configmap {config_map}", where=f"namespace {namespace}").data
    data = data or {}
    text = data.get(k8s.VERDICT_KEY)
    verdict, unreadable = None, None
    if text is not None:
        try:
            verdict = read_verdict_text(text, where=f"configmap/{config_map}: {k8s.VERDICT_KEY}")
        except ReplayjobError as exc:
            unreadable = exc.message
    stopped = data.get(STOPPED_KEY)
    if verdict is None and unreadable is None and stopped is not None:
        how += f"; the driver stopped the run: {outcome.read_stopped(stopped, config_map)}"
    judged, line = outcome.judge(verdict, unreadable, code,
                                 f"job {name} {state}{' (' + reason + ')' if reason else ''}, {how}", need_code=True)
    log(f"submit: {line}; exit {judged}")
    if judged == EXIT_OK:
        return EXIT_OK
    raise error_for_exit_status(judged)(f"{line} (exit {judged}: {DETAIL[judged]})", where=f"namespace {namespace}",
                                        hint=f"kubectl logs -n {namespace} job/{name}")


def submit(spec: AblationSpec, text: str, namespace: str | None, *, wait: bool, api_client: Any | None = None,
           poll_s: float = 10.0, log: Log = print, run_id: str | None = None, api: Api | None = None) -> int:
    """Start one run: its driver Job and its spec ConfigMap (owned by the driver); with ``wait``,
    follow the driver and return its code (see the module docstring)."""
    run_id = k8s.check_run_id(run_id or new_run_id())
    files = k8s.render(spec, text, run_id)  # refused (a tag image, ...) before the API is touched
    api = api or Api(api_client, log=log)
    ns = k8s.check_name(namespace or api.default_namespace, "namespace")
    check_setup(api, ns, spec)
    created = api.create(ns, files["driver.yaml"])
    assert created is not None
    driver = outcome.read_object(created, outcome.DriverJob, f"created job {files['driver.yaml']['metadata']['name']}",
                                 where=f"namespace {ns}")
    config_map = files["spec.yaml"]
    config_map["metadata"]["ownerReferences"] = [k8s.owner_reference(created)]  # it goes with the run
    api.create(ns, config_map)
    name = driver.metadata.name
    log(f"submit: run {run_id} in namespace {ns}: job/{name} chains capture, replays and reduce in the cluster; "
        f"run directory {k8s.MOUNT}/runs/{spec.name}/{run_id} on PVC {spec.claim_name}")
    if not wait:
        log(f"follow it: replayjob k8s resume {run_id} --namespace {ns} --wait")
        return EXIT_OK
    code = wait_driver(api, ns, name, config_map["metadata"]["name"], poll_s, log, driver_deadline_s(driver))
    log(f"verdict: {k8s.MOUNT}/runs/{spec.name}/{run_id}/verdict.json on PVC {spec.claim_name}")
    return code


def resume(run_id: str, namespace: str | None, *, wait: bool, api_client: Any | None = None, poll_s: float = 10.0,
           log: Log = print, api: Api | None = None) -> int:
    """Continue run ``run_id``: follow its driver if one still runs, else start a new one (see the
    module docstring).  Every field read of the objects found (the spec ConfigMap, the drivers) goes through
    their declarations in :mod:`replayjob.artifacts.cluster_status`: a malformed one is 3, naming it."""
    k8s.check_run_id(run_id)  # before any request: it becomes a label selector and object names
    api = api or Api(api_client, log=log)
    ns = k8s.check_name(namespace or api.default_namespace, "namespace")
    selector = f"{k8s.RUN_ID_LABEL}={run_id},app.kubernetes.io/component="
    maps = api.list_of(ns, "ConfigMap", selector + "spec")
    if not maps:
        raise RefusedError(f"no run {run_id}: its spec ConfigMap is gone (the run was deleted, or its jobs' TTL "
                           "passed)", where=f"namespace {ns}", hint="submit a new run")
    if len(maps) > 1:
        raise ContractError(f"run {run_id}: {len(maps)} ConfigMaps carry its labels "
                            f"({', '.join(sorted(meta(m, 'configmap').name for m in maps))})",
                            where=f"namespace {ns}", hint="a run has one spec ConfigMap; delete the others")
    config_map = outcome.read_object(maps[0], outcome.ConfigMap, f"configmap of run {run_id}", where=f"namespace {ns}")
    cm_name = config_map.metadata.name
    where = f"configmap {cm_name}"
    text = (config_map.data or {}).get("ablation.toml", "")
    spec = spec_from_text(text, where)
    if cm_name != f"{k8s.prefix(spec, run_id)}-spec":
        raise ContractError(f"{where} carries run {run_id}'s labels but is not its spec ConfigMap "
                            f"({k8s.prefix(spec, run_id)}-spec)", where=f"namespace {ns}")
    found = run_drivers(api, ns, spec, run_id)
    drivers, metas = [d for d, _ in found], [m for _, m in found]
    refs = {r.uid for r in config_map.metadata.ownerReferences or []}
    if not drivers or not refs & {m.uid for m in metas}:
        raise ContractError(f"{where} is owned by no driver of run {run_id}", where=f"namespace {ns}",
                            hint="resume only runs `k8s submit` (or the kustomize base) started")
    pinned = (metas[0].annotations or {}).get(k8s.SPEC_ANNOTATION)
    if pinned is not None and pinned != k8s.spec_sha256(text):
        raise ContractError(f"{where} holds another spec than the one run {run_id} was submitted with "
                            f"(SHA-256 {k8s.spec_sha256(text)}, its driver says {pinned})", where=f"namespace {ns}",
                            hint="a run keeps its spec; submit a new run for another")
    running = [(d, m) for d, m in found if not job_ended(d)]
    if running:
        followed = outcome.read_object(running[-1][0], outcome.DriverJob, f"job {running[-1][1].name}",
                                       where=f"namespace {ns}")
        name = followed.metadata.name
        log(f"resume: run {run_id}: job/{name} is still driving it")
    else:
        body = k8s.driver_job(spec, run_id, cm_name, suffix=f"-{len(drivers) + 1}", text=text)
        # the image and GPU product the run's last driver ran with (an overlay may have set them)
        last = outcome.read_object(drivers[-1], outcome.DriverJob, f"job {metas[-1].name}", where=f"namespace {ns}")
        previous = last.spec.template.spec.containers[0]
        mine = body["spec"]["template"]["spec"]["containers"][0]
        mine["image"] = previous.image
        given = {e.name: {"name": e.name, "value": e.value} for e in previous.env or [] if e.value is not None}
        mine["env"] = [given.get(e["name"], e) if e["name"] in ("REPLAYJOB_IMAGE_REF", "REPLAYJOB_GPU_PRODUCT")
                       else e for e in mine["env"]]
        created = api.create(ns, body)
        assert created is not None
        followed = outcome.read_object(created, outcome.DriverJob, f"created job {body['metadata']['name']}",
                                       where=f"namespace {ns}")
        name = followed.metadata.name
        api.add_owner(ns, "ConfigMap", maps[0], k8s.owner_reference(created))
        log(f"resume: run {run_id}: started job/{name}, which adopts the run's jobs and creates the rest")
    if not wait:
        return EXIT_OK
    return wait_driver(api, ns, name, cm_name, poll_s, log, driver_deadline_s(followed))
