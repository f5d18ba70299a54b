"""``replayjob argo wait WORKFLOW``: gate CI on an Argo run with the reducer's verdict.

``argo submit --wait`` and ``argo wait`` exit 0 or 1 only, so a failed gate, a refusal and an error
(the one retryable outcome) look alike.  This command reads the Workflow through the Kubernetes API
(``argoproj.io/v1alpha1``, ``workflows``) until it has ended, then decides from two witnesses
(:func:`workflow_code`):

* the **verdict** the reducer wrote (the global output parameter ``verdict``), read through the one
  strict verdict reader (:func:`replayjob.artifacts.verdict.read_verdict`: no duplicate keys, an integer exit
  code, status and code agreeing with the checks);
* the **reduce step's exit code**: its last pod's (``status.nodes``: the pod nodes of template
  ``reduce``; with retries, the last attempt), or, when the exit handler reduced again (template
  ``final-verdict``, which publishes the same output after it), that step's last pod's; a pod node whose
  phase and exit code disagree (``Failed`` with 0 or with none, ``Succeeded`` with 2) reads as 3, and so
  do two reduces of the run that decided differently (the reduce step's 1 or 2, the exit handler's other).

Both there and agreeing: that code.  A verdict alone (the node statuses offloaded: none listed): its code;
nodes listed without a pod that wrote the verdict: 3.  A
verdict that cannot be read, or one that disagrees with the pod's code: 3, naming both.  No verdict: 3,
nothing was decided (deadline exceeded, stopped, deleted pods, a controller error).  A status that is
not what Argo writes (a status, the nodes or a node that is no mapping, a field of the wrong type) is 3
too, with one line naming the workflow and what was wrong: the outcome is never read from it.  A
Workflow deleted while it was followed, a refused request (403) and an API that stays unreachable, no
credentials included, are 3; only a Workflow that never existed (404 at the first read: the name is
wrong) is refused (2), and so is, before any request, a workflow name or a namespace that Kubernetes would not take.

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

from replayjob.artifacts import pods
from replayjob.artifacts.cluster_status import PULL_FAILURES, ApiObject, Stuck, judge, read_status
from replayjob.artifacts.run_end import read_run_end_text
from replayjob.artifacts.verdict import Verdict, read_verdict_text
from replayjob.declaration import whole
from replayjob.errors import (
    EXIT_ERROR,
    EXIT_OK,
    OperationalError,
    RefusedError,
    ReplayjobError,
    is_retryable,
)
from replayjob.launch import k8s
from replayjob.launch.argo import FINAL
from replayjob.launch.submit import START_GRACE_ENV, START_GRACE_S, Api, env_seconds

GROUP, VERSION, PLURAL = "argoproj.io", "v1alpha1", "workflows"
ENDED = ("Succeeded", "Failed", "Error")
REDUCE = "reduce"
Doc = dict[str, Any]


class Parameter(ApiObject, frozen=True):
    name: str
    value: str | None = None


# a container's exit code as Argo writes it: ASCII decimal digits, no leading zero or "-0" (int() alone would also
# read "٣", "+3", " 3" or "007")
ExitCodeText = Annotated[str, whole(r"0|-?[1-9][0-9]{0,9}")]


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


def _attempts(nodes: dict[str, Node], template: str) -> list[Node]:
    """The pod nodes of ``template``, in attempt order (a retry node's children, else by start time)."""
    pods = {nid: n for nid, n in nodes.items() if n.type == "Pod" and n.templateName == template}
    for node in nodes.values():
        if node.type == "Retry" and node.templateName == template:
            ordered = [pods[c] for c in node.children or [] if c in pods]
            if ordered:
                return ordered
    return sorted(pods.values(), key=lambda n: (n.startedAt or "", n.finishedAt or ""))


def _writers(nodes: dict[str, Node]) -> tuple[list[Node], list[Node]]:
    """The pod nodes that wrote the verdict, each step's in attempt order: the reduce step's, and the exit
    handler's reduce (``final-verdict``), which runs after it and publishes the same global output."""
    return _attempts(nodes, REDUCE), _attempts(nodes, FINAL)


def _pod_code(pod: Node) -> int | None:
    """A pod's exit code as replayjob reads it: 0, 1, 2, or 3 for any retryable status (137, a signal); 3 when its
    phase and its code disagree (a pod that did not succeed confirms no 0, and one Argo calls Succeeded no
    failure); None only for a succeeded pod whose code was not recorded."""
    text = pod.outputs.exitCode if pod.outputs is not None else None
    code = None if text is None else int(text)  # declared: ASCII digits (ExitCodeText)
    if pod.phase == "Succeeded":
        return code if code in (None, EXIT_OK) else EXIT_ERROR
    if code is None or code == EXIT_OK:  # failed, errored or never ended: no code, or a 0 it contradicts
        return EXIT_ERROR
    return EXIT_ERROR if is_retryable(code) else code


def _pod_said(pod: Node, code: int | None) -> str:
    """What a pod node says of its end, for the outcome's line: ``exited N`` (N as :func:`_pod_code` reads it),
    with the code and phase Argo recorded when the two disagree."""
    raw = pod.outputs.exitCode if pod.outputs is not None else None
    if raw is None:
        return "exited with no exit code" + ("" if pod.phase == "Succeeded" else f" while its phase is {pod.phase}")
    if (pod.phase == "Succeeded") != (raw == "0"):
        return f"exited {raw} while its phase is {pod.phase}: read as {code}"
    return f"exited {code}"


def _output(status: WorkflowStatus, key: str, name: str) -> str | None:
    """The value of the workflow's global output parameter ``key`` (None when absent or empty); one listed twice
    is a malformed status (3): which of the two is the run's cannot be told."""
    found = [p for p in (status.outputs.parameters or []) if p.name == key] if status.outputs is not None else []
    if len(found) > 1:
        raise OperationalError(f"workflow {name}: malformed status: status.outputs.parameters: {key!r} is listed "
                               f"{len(found)} times", hint="argo get shows the object; nothing was decided from it")
    return found[0].value or None if found else None


def _verdict(status: WorkflowStatus, name: str) -> tuple[Verdict | None, str | None]:
    """(the verdict, None), (None, why it cannot be read), or (None, None) when there is none."""
    value = _output(status, "verdict", name)
    if value is None:
        return None, None
    try:
        return read_verdict_text(value, where=f"workflow {name}: output verdict"), None
    except ReplayjobError as exc:
        return None, exc.message


def _ended(status: WorkflowStatus, name: str) -> str:
    """``; `` and what ended the run, as the exit handler recorded it (the global output ``ended``,
    :mod:`replayjob.artifacts.run_end`), or ``""`` when it recorded nothing."""
    value = _output(status, "ended", name)
    if value is None:
        return ""
    try:
        return "; " + read_run_end_text(value, where=f"workflow {name}: output ended").line
    except ReplayjobError as exc:
        return f"; what ended the run cannot be read ({exc.message})"


def workflow_code(workflow: Any, name: str = "") -> tuple[int, str]:
    """The outcome of an ended workflow and one line saying where it comes from (see the module docstring)."""
    name = name or str(((workflow or {}).get("metadata") or {}).get("name") if isinstance(workflow, dict) else "")
    status, nodes = read_workflow(workflow, name)
    phase = status.phase or "Unknown"
    reduce_pods, final_pods = _writers(nodes)
    pods = final_pods or reduce_pods  # the last step that wrote the verdict is its witness
    verdict, unreadable = _verdict(status, name)
    pod_code = _pod_code(pods[-1]) if pods else None
    step = ""
    if pods:
        tries = f", attempt {len(pods)}" if len(pods) > 1 else ""
        step = f"reduce step {pods[-1].displayName or REDUCE} {_pod_said(pods[-1], pod_code)}{tries}"
        earlier = _pod_code(reduce_pods[-1]) if final_pods and reduce_pods else None
        if earlier is not None and not is_retryable(earlier) and earlier != pod_code:
            step += (f" after reduce step {reduce_pods[-1].displayName or REDUCE} exited {earlier}: the two "
                     "reduces of one run decided differently")  # judged below as a disagreement
            pod_code = EXIT_ERROR
    if unreadable is not None or verdict is not None:
        # nodes listed without a pod that wrote the verdict: it comes from no step of this run (only offloaded
        # or absent node statuses leave the verdict alone to decide)
        code, line = judge(verdict, unreadable, pod_code, step or "no reduce pod", need_code=bool(nodes))
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

    k8s.check_name(name, "workflow", pods.DNS_SUBDOMAIN)  # before any request names it
    api = api or Api(None, log=log)
    ns = k8s.check_name(namespace or api.default_namespace, "namespace")
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

    start_grace_s = env_seconds(os.environ, START_GRACE_ENV, START_GRACE_S)
    return wait(get, poll_s=poll_s, sleep=api.sleep, log=log, name=name, deadline_s=deadline_s,
                start_grace_s=start_grace_s)
