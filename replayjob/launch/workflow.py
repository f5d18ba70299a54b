"""``replayjob argo wait WORKFLOW``: gate CI on an Argo run with the reducer's verdict.

``argo submit --wait`` and ``argo wait`` exit 0 or 1 only, so a failed gate, a refusal and an error
(the one retryable outcome) look alike.  This command reads the Workflow through the Kubernetes API
(``argoproj.io/v1alpha1``, ``workflows``) until it has ended, then decides from two witnesses
(:func:`workflow_code`):

* the **verdict** the reducer wrote (the global output parameter ``verdict``), read through the one
  strict verdict reader (:func:`replayjob.artifacts.verdict.read_verdict`: no duplicate keys, an integer exit
  code, status and code agreeing with the checks);
* the **reduce step's exit code**: its last pod's (``status.nodes``: the pod nodes of template
  ``reduce``; with retries, the last attempt).

Both there and agreeing: that code.  A verdict alone (the pod nodes offloaded or gone): its code.  A
verdict that cannot be read, or one that disagrees with the pod's code: 3, naming both.  No verdict: 3,
nothing was decided (deadline exceeded, stopped, deleted pods, a controller error).  A status that is
not what Argo writes (a status, the nodes or a node that is no mapping, a field of the wrong type) is 3
too, with one line naming the workflow and what was wrong: the outcome is never read from it.  A
Workflow deleted while it was followed, a refused request (403) and an API that stays unreachable, no
credentials included, are 3; only a Workflow that never existed (404 at the first read: the name is
wrong) is refused (2).

Every submitted run ends with a verdict: the reducer runs once the replays have ended, however they
ended, and also when the capture failed (no replays run; the verdict is incomplete: no capture).

Example:
    $ argo -n NS submit --from workflowtemplate/replayjob-ablation -p image=REF -o name
    workflow.argoproj.io/replayjob-ablation-x7k2p
    $ replayjob argo wait replayjob-ablation-x7k2p --namespace NS; echo "verdict exit $?"
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Annotated, Any

from replayjob.artifacts.cluster_status import PULL_FAILURES, ApiObject, Stuck, judge, read_status
from replayjob.artifacts.document import whole
from replayjob.artifacts.run_end import read_run_end_text
from replayjob.artifacts.verdict import Verdict, read_verdict
from replayjob.errors import EXIT_ERROR, ConfigError, OperationalError, RefusedError, ReplayjobError, is_retryable
from replayjob.launch.submit import START_GRACE_ENV, START_GRACE_S, Api

GROUP, VERSION, PLURAL = "argoproj.io", "v1alpha1", "workflows"
ENDED = ("Succeeded", "Failed", "Error")
REDUCE = "reduce"
Doc = dict[str, Any]


class Parameter(ApiObject, frozen=True):
    name: str
    value: str | None = None


# a container's exit code as Argo writes it: ASCII decimal digits (int() alone would also read "٣", "+3" or " 3")
ExitCodeText = Annotated[str, whole(r"-?[0-9]{1,10}")]


class Outputs(ApiObject, frozen=True):
    exitCode: ExitCodeText | None = None
    parameters: list[Parameter] | None = None


class Node(ApiObject, frozen=True):
    type: str | None = None
    templateName: str | None = None
    displayName: str | None = None
    phase: str | None = None
    message: str | None = None
    children: list[str] | None = None
    startedAt: str | None = None
    finishedAt: str | None = None
    outputs: Outputs | None = None


class WorkflowStatus(ApiObject, frozen=True):
    phase: str | None = None
    message: str | None = None
    progress: str | None = None
    nodes: dict[str, Any] | None = None  # each a Node, read on its own so that a malformed one is named
    outputs: Outputs | None = None
    offloadNodeStatusVersion: str | None = None


class Workflow(ApiObject, frozen=True):
    status: WorkflowStatus | None = None


def _convert(obj: Any, kind: type[Any], name: str, prefix: str = "") -> Any:
    return read_status(obj, kind, f"workflow {name}", prefix=prefix,
                       hint="argo get shows the object; nothing was decided from it")


def read_workflow(doc: Any, name: str) -> tuple[WorkflowStatus, dict[str, Node]]:
    """The status of Workflow ``name`` and its nodes as declared, or :class:`OperationalError` (3) naming the
    field that was malformed."""
    status: WorkflowStatus = _convert(doc, Workflow, name).status or WorkflowStatus()
    nodes = {key: _convert(node, Node, name, f"status.nodes.{key}") for key, node in (status.nodes or {}).items()}
    return status, nodes


def _reduce_pods(nodes: dict[str, Node]) -> list[Node]:
    """The reduce step's pod nodes, in attempt order (a retry node's children, else by start time)."""
    pods = {nid: n for nid, n in nodes.items() if n.type == "Pod" and n.templateName == REDUCE}
    for node in nodes.values():
        if node.type == "Retry" and node.templateName == REDUCE:
            ordered = [pods[c] for c in node.children or [] if c in pods]
            if ordered:
                return ordered
    return sorted(pods.values(), key=lambda n: (n.startedAt or "", n.finishedAt or ""))


def _pod_code(pod: Node) -> int | None:
    """A pod's exit code as replayjob reads it: 0, 1, 2, or 3 for any retryable status (137, a signal)."""
    text = pod.outputs.exitCode if pod.outputs is not None else None
    if text is None:
        return None
    code = int(text)  # declared: ASCII digits (ExitCodeText)
    return EXIT_ERROR if is_retryable(code) else code


def _verdict(status: WorkflowStatus, name: str) -> tuple[Verdict | None, str | None]:
    """(the verdict, None), (None, why it cannot be read), or (None, None) when there is none."""
    for p in (status.outputs.parameters or []) if status.outputs is not None else []:
        if p.name == "verdict" and p.value:
            try:
                return read_verdict(p.value.encode("utf-8"), where=f"workflow {name}: output verdict"), None
            except ReplayjobError as exc:
                return None, exc.message
    return None, None


def _ended(status: WorkflowStatus, name: str) -> str:
    """``; `` and what ended the run, as the exit handler recorded it (the global output ``ended``,
    :mod:`replayjob.artifacts.run_end`), or ``""`` when it recorded nothing."""
    for p in (status.outputs.parameters or []) if status.outputs is not None else []:
        if p.name == "ended" and p.value:
            try:
                return "; " + read_run_end_text(p.value, where=f"workflow {name}: output ended").line
            except ReplayjobError as exc:
                return f"; what ended the run cannot be read ({exc.message})"
    return ""


def workflow_code(workflow: Any, name: str = "") -> tuple[int, str]:
    """The outcome of an ended workflow and one line saying where it comes from (see the module docstring)."""
    name = name or str(((workflow or {}).get("metadata") or {}).get("name") if isinstance(workflow, dict) else "")
    status, nodes = read_workflow(workflow, name)
    phase = status.phase or "Unknown"
    pods = _reduce_pods(nodes)
    verdict, unreadable = _verdict(status, name)
    pod_code = _pod_code(pods[-1]) if pods else None
    step = ""
    if pods:
        tries = f", attempt {len(pods)}" if len(pods) > 1 else ""
        step = f"reduce step {pods[-1].displayName or REDUCE} exited {pod_code}{tries}"
    if unreadable is not None or verdict is not None:
        code, line = judge(verdict, unreadable, pod_code, step or "no reduce pod")
        return code, f"workflow {phase}: {line}{_ended(status, name)}"
    message = status.message or "no reduce step ran to its end"
    if status.offloadNodeStatusVersion and not status.nodes:
        message += "; node statuses are offloaded (argo get shows them)"
    return EXIT_ERROR, (f"workflow {phase} without a verdict: " + (f"{step}; " if step else "") + message
                        + _ended(status, name))


STUCK_REASONS = ("Unschedulable", *PULL_FAILURES)  # a pod node's message, "REASON: ...", while Pending


def stuck_pods(nodes: dict[str, Node]) -> dict[str, Stuck]:
    """The workflow's pod nodes that cannot start (Pending with an Unschedulable or image-pull message),
    by node id."""
    out = {}
    for nid, node in nodes.items():
        reason, _, message = (node.message or "").partition(":")
        if node.type == "Pod" and node.phase == "Pending" and reason.strip() in STUCK_REASONS:
            out[nid] = Stuck(f"step {node.displayName or nid} (pod node {nid})", reason.strip(), message.strip())
    return out


def wait(get: Callable[[], Doc], *, poll_s: float = 10.0, sleep: Callable[[float], None], log: Callable[[str], None],
         name: str, deadline_s: float | None = None, clock: Callable[[], float] | None = None,
         start_grace_s: float | None = None) -> int:
    """Poll ``get()`` (the Workflow) until its phase has ended; return :func:`workflow_code`.  With
    ``deadline_s``, a workflow still running after that long is exit 3 (the run goes on).  Progress is
    logged as it changes, and each pod that cannot start (:func:`stuck_pods`) as it appears; with
    ``start_grace_s``, one that stays so that long (counted in polls) ends the wait with exit 3 naming the
    step, the reason and the message."""
    now = clock or time.monotonic
    end = None if deadline_s is None else now() + deadline_s
    seen = None
    stuck_for: dict[str, float] = {}
    while True:
        doc = get()
        status, nodes = read_workflow(doc, name)
        phase = status.phase or "Pending"
        said = f"{phase}" + (f" ({status.progress})" if status.progress else "")
        if said != seen:
            log(f"argo wait: workflow {name}: {said}")
            seen = said
        if phase in ENDED:
            code, line = workflow_code(doc, name)
            log(f"argo wait: {line}; exit {code}")
            return code
        stuck = stuck_pods(nodes)
        for nid, cause in stuck.items():
            if nid not in stuck_for:
                log(f"argo wait: workflow {name}: waiting: {cause.line()}")
        stuck_for = {nid: stuck_for.get(nid, -poll_s) + poll_s for nid in stuck}
        late = [(nid, t) for nid, t in stuck_for.items() if start_grace_s is not None and t >= start_grace_s]
        if late:
            cause = stuck[late[0][0]]
            raise OperationalError(f"workflow {name}: {cause.line()} for {late[0][1]:g} s; nothing decided",
                                   hint=f"fix the cause (a node pool, a pull secret) and retry the workflow, or "
                                        f"argo stop {name}: its exit handler then writes the verdict")
        if end is not None and now() >= end:
            raise OperationalError(f"workflow {name} is still {phase} after {deadline_s:g} s of waiting",
                                   hint=f"the run goes on: replayjob argo wait {name} again")
        sleep(poll_s)


def wait_for_workflow(name: str, namespace: str | None, *, api: Any | None = None, poll_s: float = 10.0,
                      log: Callable[[str], None] = print, deadline_s: float | None = None) -> int:
    """``replayjob argo wait``: the outcome of workflow ``name`` once it has ended."""
    from kubernetes.client.exceptions import ApiException

    api = api or Api(None, log=log)
    ns = namespace or api.default_namespace
    seen = False

    def get() -> Doc:
        nonlocal seen
        try:
            doc: Doc = api.call(f"reading workflow {name}", api.custom.get_namespaced_custom_object,
                                GROUP, VERSION, ns, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404 and not seen:
                raise RefusedError(f"no workflow {name}", where=f"namespace {ns}",
                                   hint="argo list; a workflow deleted by its TTL keeps its verdict on the claim "
                                        "(runs/NAME/UID/verdict.json)") from None
            if exc.status == 404:
                raise OperationalError(f"workflow {name} was deleted while it was followed; nothing decided",
                                       where=f"namespace {ns}",
                                       hint="its verdict, if the reducer wrote one, is on the claim "
                                            "(runs/NAME/UID/verdict.json)") from None
            raise OperationalError(f"reading workflow {name} failed: HTTP {exc.status} {exc.reason}",
                                   where=f"namespace {ns}",
                                   hint="403: the credentials may not read workflows in this namespace") from None
        seen = True
        return doc

    grace = os.environ.get(START_GRACE_ENV)
    try:
        start_grace_s = float(grace) if grace else START_GRACE_S
    except ValueError:
        raise ConfigError(f"{START_GRACE_ENV}={grace!r} is not a number of seconds", where="environment") from None
    return wait(get, poll_s=poll_s, sleep=api.sleep, log=log, name=name, deadline_s=deadline_s,
                start_grace_s=start_grace_s)
