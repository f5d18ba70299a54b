"""``replayjob argo wait WORKFLOW``: gate CI on an Argo run with the reduce step's own exit code.

``argo submit --wait`` and ``argo wait`` exit 0 or 1 only, so a failed gate, a refusal and an error
(the one retryable outcome) look alike.  This command reads the Workflow's status through the
Kubernetes API (``argoproj.io/v1alpha1``, ``workflows``) until the workflow has ended, then returns
the reduce step's code (:func:`workflow_code`):

1. the exit code of the reduce step's last pod (``status.nodes``: the pod nodes of template
   ``reduce``; with retries, the last attempt), 0, 1, 2 or 3;
2. else the ``exit_code`` of the verdict the reducer wrote (the global output parameter ``verdict``);
3. else 3: the workflow ended without a verdict (deadline exceeded, stopped, deleted pods, a
   controller error): nothing was decided.

Every submitted run ends with a verdict: the reducer runs once the replays have ended, however they
ended, and also when the capture failed (no replays run; the verdict is refused: no capture).

Example:
    $ argo -n NS submit --from workflowtemplate/replayjob-ablation -p image=REF -o name
    workflow.argoproj.io/replayjob-ablation-x7k2p
    $ replayjob argo wait replayjob-ablation-x7k2p --namespace NS; echo "verdict exit $?"
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from replayjob.deploy.submit import Api
from replayjob.errors import EXIT_ERROR, RefusedError

GROUP, VERSION, PLURAL = "argoproj.io", "v1alpha1", "workflows"
ENDED = ("Succeeded", "Failed", "Error")
REDUCE = "reduce"
CODES = ("0", "1", "2", "3")
Doc = dict[str, Any]


def _reduce_pods(nodes: dict[str, Doc]) -> list[Doc]:
    """The reduce step's pod nodes, in attempt order (a retry node's children, else by start time)."""
    pods = {nid: n for nid, n in nodes.items() if n.get("type") == "Pod" and n.get("templateName") == REDUCE}
    for node in nodes.values():
        if node.get("type") == "Retry" and node.get("templateName") == REDUCE:
            ordered = [pods[c] for c in node.get("children") or [] if c in pods]
            if ordered:
                return ordered
    return sorted(pods.values(), key=lambda n: (str(n.get("startedAt") or ""), str(n.get("finishedAt") or "")))


def _verdict_parameter(status: Doc) -> Doc | None:
    for p in (status.get("outputs") or {}).get("parameters") or []:
        if isinstance(p, dict) and p.get("name") == "verdict" and p.get("value"):
            try:
                doc = json.loads(p["value"])
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None


def workflow_code(workflow: Doc) -> tuple[int, str]:
    """The reduce step's exit code of an ended workflow and one line saying where it comes from."""
    status = workflow.get("status") or {}
    phase = status.get("phase") or "Unknown"
    pods = _reduce_pods(status.get("nodes") or {})
    verdict = _verdict_parameter(status)
    said = f" (verdict {verdict.get('status')})" if verdict else ""
    if pods:
        last = pods[-1]
        code = str((last.get("outputs") or {}).get("exitCode", ""))
        if code in CODES:
            tries = f", attempt {len(pods)}" if len(pods) > 1 else ""
            step = last.get("displayName", REDUCE)
            return int(code), f"workflow {phase}: reduce step {step} exited {code}{tries}{said}"
    if verdict is not None and verdict.get("exit_code") in (0, 1, 2):
        return int(verdict["exit_code"]), f"workflow {phase}: verdict {verdict.get('status')}"
    message = status.get("message") or "no reduce step ran to its end"
    if status.get("offloadNodeStatusVersion") and not status.get("nodes"):
        message += "; node statuses are offloaded (argo get shows them)"
    return EXIT_ERROR, f"workflow {phase} without a verdict: {message}"


def wait(get: Callable[[], Doc], *, poll_s: float = 10.0, sleep: Callable[[float], None], log: Callable[[str], None],
         name: str) -> int:
    """Poll ``get()`` (the Workflow) until its phase has ended; return :func:`workflow_code`."""
    seen = None
    while True:
        doc = get()
        status = doc.get("status") or {}
        phase = status.get("phase") or "Pending"
        if phase != seen:
            log(f"argo wait: workflow {name}: {phase}" + (f" ({status['progress']})" if status.get("progress") else ""))
            seen = phase
        if phase in ENDED:
            code, line = workflow_code(doc)
            log(f"argo wait: {line}; exit {code}")
            return code
        sleep(poll_s)


def wait_for_workflow(name: str, namespace: str | None, *, api: Any | None = None, poll_s: float = 10.0,
                      log: Callable[[str], None] = print) -> int:
    """``replayjob argo wait``: the reduce step's code of workflow ``name`` once it has ended."""
    from kubernetes.client.exceptions import ApiException

    api = api or Api(None, log=log)
    ns = namespace or api.default_namespace

    def get() -> Doc:
        try:
            doc: Doc = api.call(f"reading workflow {name}", api.custom.get_namespaced_custom_object,
                                GROUP, VERSION, ns, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                raise RefusedError(f"no workflow {name}", where=f"namespace {ns}",
                                   hint="argo list; a workflow deleted by its TTL keeps its verdict on the claim "
                                        "(runs/NAME/UID/verdict.json)") from None
            raise RefusedError(f"reading workflow {name} failed: HTTP {exc.status} {exc.reason}",
                               where=f"namespace {ns}") from None
        return doc

    return wait(get, poll_s=poll_s, sleep=api.sleep, log=log, name=name)
