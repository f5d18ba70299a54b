"""How a cluster run's outcome is read: the Job and pod status fields the driver and ``k8s ... --wait``
read, declared, the fields of the objects ``k8s resume`` and the driver find, adopt and create, declared,
and the one rule that turns a verdict and a reducer's exit code into an exit code.

The Kubernetes API's JSON is read through the declarations below (the fields replayjob reads, typed;
every other field is the API's and ignored), never through the client's models: a status that is not
what the API writes (a status that is a list, a condition without a type, an exit code that is a
string) is :class:`~replayjob.errors.OperationalError` (exit 3) with one line naming the object and
the field, never a traceback, and nothing is decided from it (:func:`read_status`).  So is an object
that is not (:func:`read_object`): metadata that is no mapping, a name that is no string, labels,
annotations or a ConfigMap's data that do not map strings to strings, an owner without a uid, a driver
Job without a container, an env entry without a name.

:func:`judge` is the rule every launcher's wait applies (``argo wait``, the in-cluster driver,
``k8s submit|resume --wait``): the verdict, read through
:func:`replayjob.artifacts.verdict.read_verdict`, and the reducer's exit code must agree; a verdict alone
decides; a verdict that cannot be read, one that disagrees with the code, or none at all is 3
(nothing was decided), naming both.

Example:
    >>> judge(None, None, 0, "reduce exited 0")
    (3, 'no verdict; reduce exited 0: nothing decided')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from replayjob.artifacts.verdict import Verdict
from replayjob.declaration import Document, decode
from replayjob.errors import EXIT_ERROR, EXIT_OK, FINAL_EXIT_STATUSES, OperationalError, ReplayjobError, is_retryable
from replayjob.jsonio import loads_strict

T = TypeVar("T")


class ApiObject(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a cluster API object replayjob reads (Kubernetes, Argo), typed; every other field is the
    API's and ignored."""


class Condition(ApiObject, frozen=True):
    type: str
    status: str
    reason: str | None = None
    message: str | None = None


class JobStatus(ApiObject, frozen=True):
    conditions: list[Condition] | None = None
    active: int | None = None
    failed: int | None = None
    succeeded: int | None = None


class JobSpec(ApiObject, frozen=True):
    suspend: bool | None = None


class Job(ApiObject, frozen=True):
    spec: JobSpec | None = None
    status: JobStatus | None = None


class Terminated(ApiObject, frozen=True):
    exitCode: int
    reason: str | None = None


class ContainerState(ApiObject, frozen=True):
    terminated: Terminated | None = None
    waiting: Waiting | None = None


class ContainerStatus(ApiObject, frozen=True):
    name: str
    state: ContainerState | None = None


class PodStatus(ApiObject, frozen=True):
    phase: str | None = None
    conditions: list[PodCondition] | None = None
    containerStatuses: list[ContainerStatus] | None = None


class Waiting(ApiObject, frozen=True):
    reason: str | None = None
    message: str | None = None


class PodCondition(ApiObject, frozen=True):
    type: str
    status: str
    reason: str | None = None
    message: str | None = None


class PodMeta(ApiObject, frozen=True):
    name: str


class Pod(ApiObject, frozen=True):
    metadata: PodMeta
    status: PodStatus | None = None


class PodList(ApiObject, frozen=True):
    items: list[Pod]


class InvolvedObject(ApiObject, frozen=True):
    kind: str | None = None
    name: str | None = None


class Event(ApiObject, frozen=True):
    reason: str | None = None
    message: str | None = None
    type: str | None = None
    involvedObject: InvolvedObject | None = None


class EventList(ApiObject, frozen=True):
    items: list[Event]


class OwnerReference(ApiObject, frozen=True):
    """An ``ownerReferences`` entry: the owner's uid is what a run compares (its drivers')."""

    uid: str


class ObjectMeta(ApiObject, frozen=True):
    """What replayjob reads of an object's ``metadata``."""

    name: str
    uid: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    ownerReferences: list[OwnerReference] | None = None
    creationTimestamp: str | None = None


class Object(ApiObject, frozen=True):
    """Any object read, listed or adopted: its metadata (a name that is a string, labels and annotations that
    map strings to strings, owners with uids)."""

    metadata: ObjectMeta


class ObjectList(ApiObject, frozen=True):
    items: list[Object]


class CreatedMeta(ObjectMeta, frozen=True):
    uid: str


class Created(ApiObject, frozen=True):
    """An object as the API answers its create: its name, and the uid that makes it an owner."""

    metadata: CreatedMeta


class Found(Object, frozen=True):
    """An object found under a name this run renders (:func:`replayjob.launch.submit.is_rendered`): its spec, a
    mapping compared with the rendered one."""

    spec: dict[str, Any] | None = None


class ConfigMap(Object, frozen=True):
    """A run's spec ConfigMap: its data maps keys to strings (the spec, the verdict, why a run stopped)."""

    data: dict[str, str] | None = None


class EnvVar(ApiObject, frozen=True):
    name: str
    value: str | None = None  # None: set from elsewhere (valueFrom)


class Container(ApiObject, frozen=True):
    name: str
    image: str
    env: list[EnvVar] | None = None


class PodSpec(ApiObject, frozen=True):
    containers: Annotated[list[Container], msgspec.Meta(min_length=1)]


class PodTemplate(ApiObject, frozen=True):
    spec: PodSpec


class DriverJobSpec(ApiObject, frozen=True):
    template: PodTemplate
    activeDeadlineSeconds: int | None = None


class DriverJob(Object, frozen=True):
    """A run's driver Job as ``k8s resume`` reads it: the container a new driver copies its image and GPU
    product from, and its deadline."""

    spec: DriverJobSpec


class RunningPod(Object, frozen=True):
    """The driver's own pod: the image its container runs."""

    spec: PodSpec


# What keeps a stage from ever starting: the scheduler finds no node, the image cannot be pulled, the Job
# controller cannot create the pod (quota, an admission webhook, pod security: an Event only).
PULL_FAILURES = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName")


@dataclass(frozen=True)
class Stuck:
    """Why a stage's pod has not started: the pod (or the Job, for FailedCreate), the reason, its message."""

    pod: str
    reason: str
    message: str

    def line(self) -> str:
        return f"{self.pod}: {self.reason}: {self.message}"


def stuck(job: str, pods_doc: Any, events_doc: Any) -> Stuck | None:
    """The first reason Job ``job``'s stage cannot start, from its pods (Unschedulable, an image that
    cannot be pulled) and the Job's events (FailedCreate); None while nothing stands in its way."""
    for pod in read_status(pods_doc, PodList, f"pods of job {job}").items:
        status = pod.status or PodStatus()
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                return Stuck(f"pod {pod.metadata.name}", "Unschedulable", cond.message or "")
        for st in status.containerStatuses or []:
            waiting = st.state.waiting if st.state is not None else None
            if waiting is not None and waiting.reason in PULL_FAILURES:
                return Stuck(f"pod {pod.metadata.name}", waiting.reason, waiting.message or "")
    for event in read_status(events_doc, EventList, f"events of job {job}").items:
        obj = event.involvedObject
        if event.reason == "FailedCreate" and obj is not None and obj.kind == "Job" and obj.name == job:
            return Stuck(f"job {job}", "FailedCreate", event.message or "")
    return None


def read_status(doc: Any, kind: type[T], what: str, *, prefix: str = "",
                hint: str = "nothing was decided from it; kubectl get -o yaml shows the object") -> T:
    """``doc`` (the API's JSON; at ``prefix`` within its object) as the declared ``kind``, or
    :class:`OperationalError` naming ``what`` and the field that was malformed.  Every cluster object replayjob
    reads (Jobs, pods, Events, Argo Workflows and their nodes) goes through it."""
    return _convert(doc, kind, what, "status", prefix, hint)


def read_object(doc: Any, kind: type[T], what: str, *, where: str | None = None,
                hint: str = "nothing was decided from it; kubectl get -o yaml shows the object") -> T:
    """``doc`` (the API's JSON of an object, or of a list of them) as the declared ``kind``: what ``k8s resume``
    and the in-cluster driver read of the objects they find, adopt or create (names, uids, owners, labels,
    annotations, a ConfigMap's data, a driver's container).  One that is not what the API writes is
    :class:`OperationalError` (3) naming ``what`` and the field, never a traceback."""
    return _convert(doc, kind, what, "object", "", hint, where)


def _convert(doc: Any, kind: type[T], what: str, noun: str, prefix: str, hint: str, where: str | None = None) -> T:
    try:
        return msgspec.convert(doc, kind, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        rule, sep, at = text.rpartition(" - at `")
        rule = rule if sep else text
        field = (prefix + at.rstrip("`").removeprefix("$") if sep else prefix).lstrip(".")
        raise OperationalError(f"{what}: malformed {noun}: {field or 'the object'}: {rule[:1].lower()}{rule[1:]}",
                               where=where, hint=hint) from None


JOB_ENDS = {"Complete": "Complete", "Failed": "Failed"}  # a Job's conditions that end it, as job_end names them
JOBSET_ENDS = {"Completed": "Complete", "Failed": "Failed"}  # a JobSet's, in a Job's terms


def job_end(doc: Any, name: str, *, kind: str = "job") -> tuple[str | None, str, bool]:
    """(``Complete`` or ``Failed``, its reason, whether it is suspended) of an ended Job, (None, "", ...) of a
    running one; ``kind`` ``jobset``: a JobSet's ``Completed`` and ``Failed`` conditions read the same way, through
    the same declaration (a condition without a string type, a ``suspend`` that is no boolean is malformed).  One
    that says both is malformed (3)."""
    what = f"{kind} {name}"
    job = read_status(doc, Job, what)
    status = job.status or JobStatus()
    suspended = bool(job.spec is not None and job.spec.suspend)
    ends = JOBSET_ENDS if kind == "jobset" else JOB_ENDS
    ended = [(ends[c.type], c) for c in status.conditions or [] if c.status == "True" and c.type in ends]
    if len({t for t, _ in ended}) > 1:
        raise OperationalError(f"{what}: malformed status: both {' and '.join(ends)} are true",
                               hint="nothing was decided from it; kubectl get -o yaml shows the object")
    return (ended[0][0], ended[0][1].reason or "", suspended) if ended else (None, "", suspended)


def pod_codes(doc: Any, job: str) -> set[int]:
    """The exit codes of the terminated containers of a Job's pods (every attempt)."""
    pods = read_status(doc, PodList, f"pods of job {job}")
    statuses = [st for pod in pods.items if pod.status is not None for st in pod.status.containerStatuses or []]
    return {st.state.terminated.exitCode for st in statuses if st.state is not None and st.state.terminated is not None}


def decisive_code(codes: set[int]) -> int | None:
    """The code that decides among the exit codes of a Job's attempts: a final one
    (:data:`~replayjob.errors.FINAL_EXIT_STATUSES`, the lowest) outranks a retryable one, which is 3
    (nothing decided) whatever the status (137, a signal); None when every attempt exited 0."""
    final = sorted(codes & FINAL_EXIT_STATUSES)
    if final:
        return final[0]
    return EXIT_ERROR if any(is_retryable(c) for c in codes) else None


def job_outcome(state: str | None, codes: set[int]) -> tuple[int | None, str]:
    """The exit code of an ended Job (or JobSet) as its condition ``state`` (``Complete`` or ``Failed``) and its
    pods' exit ``codes`` (every attempt) say it together, the one rule of the driver and ``k8s ... --wait``, and how
    they said it, for the line of a wait.

    ``Complete`` is 0 only beside an attempt that exited 0, and the pods' :func:`decisive_code` otherwise (a Job
    the API calls complete whose pods say 3 is 3); ``Failed`` is the pods' decisive code.  None (``no pod``) when the
    two do not confirm a code (no pod left; a failed Job whose every attempt exited 0): nothing decided from it.  A
    ``Complete`` Job beside an attempt that exited a final status (1 or 2) is 3: the rendered ``podFailurePolicy``
    fails the Job at once on one, so the condition and the pods contradict each other (two attempts decided
    differently, or pods not the Job's own), as ``argo wait`` reads two reduces that decided differently."""
    if state == "Complete" and codes & FINAL_EXIT_STATUSES:
        return EXIT_ERROR, (f"its pod exited {' and '.join(str(c) for c in sorted(codes))} while the Job is Complete, "
                            f"which its podFailurePolicy rules out beside a 1 or 2: read as {EXIT_ERROR}")
    code = EXIT_OK if state == "Complete" and EXIT_OK in codes else decisive_code(codes)
    return code, "no pod" if code is None else f"its pod exited {code}"


def judge(verdict: Verdict | None, unreadable: str | None, code: int | None, step: str, *,
          need_code: bool = False) -> tuple[int, str]:
    """The exit code of a run from its verdict and the reducer's (or the driver's) exit ``code``, and one line
    saying why.  ``unreadable`` is why a verdict that exists cannot be read; ``step`` says where ``code``
    comes from (``reduce step reduce(0) exited 0``).  With ``need_code`` a verdict alone decides nothing
    (the pod that would confirm it is gone)."""
    if unreadable is not None:
        return EXIT_ERROR, f"the verdict cannot be read ({unreadable}); {step}: nothing decided"
    if verdict is None:
        return EXIT_ERROR, f"no verdict; {step}: nothing decided"
    if code is None and need_code:
        return EXIT_ERROR, f"{step}: no exit code to confirm the verdict {verdict.status}, nothing decided"
    said = f"verdict {verdict.status} (exit {verdict.exit_code})"
    if code is not None and code != verdict.exit_code:
        return EXIT_ERROR, f"{step} but the {said}: they disagree, nothing decided"
    return verdict.exit_code, f"{step}, {said}" if code is not None else said


STOPPED_SCHEMA = "replayjob.stopped/v1"


class Stopped(Document, frozen=True):
    """Why a driver stopped its run before a verdict (a stage that could not start), as it records it in
    the run's ConfigMap (``stopped.json``)."""

    schema: Literal["replayjob.stopped/v1"]
    stage: str
    job: str
    pod: str
    reason: str
    message: str
    exit_code: Literal[3]


def stopped_record(stage: str, job: str, cause: Stuck) -> dict[str, Any]:
    """The record a driver writes when it stops its run because stage ``stage`` (Job ``job``) cannot start."""
    return {"schema": STOPPED_SCHEMA, "stage": stage, "job": job, "pod": cause.pod, "reason": cause.reason,
            "message": cause.message, "exit_code": EXIT_ERROR}


def read_stopped(text: str, where: str) -> str:
    """One line of a driver's ``stopped.json`` record (stage, pod, reason, message), or why it is unreadable."""
    try:
        rec = decode(loads_strict(text, where=where), Stopped, where=where)
    except ReplayjobError as exc:
        return f"its record cannot be read ({exc})"
    return f"stage {rec.stage} ({rec.job}): {rec.pod}: {rec.reason}: {rec.message}"
