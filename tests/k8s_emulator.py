"""An HTTP emulator of the few Kubernetes API calls replayjob makes, for the real kubernetes client.

No cluster exists here.  :class:`Cluster` holds the state (objects by kind and name, the order of
calls, scripted outcomes) and :func:`serve` answers on loopback with Kubernetes-shaped JSON: create
(with ``metadata.uid``, 409 on a name taken), read, list by label selector, JSON-patch, a Job's
status and its pods, an Argo Workflow, a JobSet (a custom resource; its status and pods).  It plays the
Job and JobSet controllers by finishing each Job or JobSet with the exit code the test scripts for its
stage (default 0), and, when the test says so, hands a created
Job to a callback (the in-cluster driver, run in a thread).  The requests, their paths and bodies,
and the client's (de)serialisation are real.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from replayjob.errors import FINAL_EXIT_STATUSES

Doc = dict[str, Any]
NS = "ablation-ns"
PLURALS = {"configmaps": "ConfigMap", "persistentvolumeclaims": "PersistentVolumeClaim",
           "serviceaccounts": "ServiceAccount", "pods": "Pod", "jobs": "Job", "workflows": "Workflow",
           "roles": "Role", "rolebindings": "RoleBinding", "events": "Event", "jobsets": "JobSet"}
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


class Cluster:
    """State of the emulated API server: created objects, the order of calls, scripted outcomes."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Doc] = {}
        self.calls: list[str] = []
        self.exit_codes: dict[str, int] = {}  # job stage (capture, replay, replay-r1, reduce) -> exit code
        self.reads: dict[str, int] = {}
        self.running_reads = 1  # status reads of a Job that still answer "running"
        self.unavailable = 0  # status reads answered 503 first (the API server restarting)
        self.finished: dict[str, int] = {}  # job name -> exit code, set by whoever ran it (a driver thread)
        self.workflows: dict[str, list[Doc]] = {}  # name -> status documents served in turn (the last stays;
        # an empty one: the Workflow was deleted, 404)
        self.forbidden: set[str] = set()  # names whose reads are refused (403: the credentials lack the verb)
        self.deleted: set[str] = set()  # Jobs whose status reads answer 404 (deleted while followed)
        self.statuses: dict[str, Any] = {}  # Job name -> the status its reads answer, whatever it is (malformed)
        self.pods: dict[str, list[Doc]] = {}  # Job name -> the pods its pod lists answer (instead of one)
        self.refuse: dict[tuple[str, str], int] = {}  # (POST or PATCH, name) -> the HTTP status answered instead
        self.lost_replies: set[str] = set()  # names whose first create is done but answered 500 (a lost reply)
        self.events: list[Doc] = []  # Events, listed by involvedObject.name (the Job controller's FailedCreate)
        self.on_create: Callable[[Doc], None] | None = None  # called (outside the lock) for each created Job
        self.host = ""  # the API server's URL while served
        self.scripted = True  # stage Jobs end with exit_codes; False: only when someone ran them (finished)
        self.lock = threading.Lock()

    @staticmethod
    def stage(name: str) -> str:
        """The stage of a Job name, its last word: ``capture``, ``replay``, ``r2`` (``...-replay-r2``),
        ``reduce``, ``driver``."""
        return name.rsplit("-", 1)[1]

    def add(self, doc: Doc) -> Doc:
        """Store ``doc`` as created (a uid and a resource version), as the API server would."""
        body = copy.deepcopy(doc)
        meta = body.setdefault("metadata", {})
        meta.setdefault("namespace", NS)
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = "1"
        self.objects[(body["kind"], meta["name"])] = body
        return body

    def job_code(self, name: str) -> int | None:
        if name in self.finished:
            return self.finished[name]
        job = self.objects.get(("Job", name), {})
        component = job.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component")
        if not self.scripted or component == "driver":
            return None  # a driver (or, unscripted, any Job) ends when whoever runs it says so
        return self.exit_codes.get(self.stage(name), 0)

    def job_status(self, name: str, *, count: bool = True) -> Any:
        if name in self.statuses:
            return self.statuses[name]
        if count:  # status reads (a Job's /status) count towards running_reads; plain reads and lists peek
            self.reads[name] = self.reads.get(name, 0) + 1
        elif self.reads.get(name, 0) < self.running_reads and name not in self.finished:
            return {"active": 1}
        code = self.job_code(name)
        if code is None or (self.reads.get(name, 0) <= self.running_reads and count and name not in self.finished):
            return {"active": 1}
        if code == 0:
            return {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        reason = "PodFailurePolicy" if code in FINAL_EXIT_STATUSES else "BackoffLimitExceeded"
        return {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": reason}]}

    def jobset_status(self, name: str) -> Doc:
        """A JobSet's status as the JobSet controller writes it, from the Job it plays (its one child Job)."""
        job = self.job_status(name)
        if not isinstance(job, dict) or not job.get("conditions"):
            return job if not isinstance(job, dict) or "active" not in job else {"restarts": 0}
        (cond,) = job["conditions"]
        if cond["type"] == "Complete":
            return {"terminalState": "Completed", "conditions": [
                {"type": "Completed", "status": "True", "reason": "AllJobsCompleted"}]}
        return {"terminalState": "Failed", "conditions": [
            {"type": "Failed", "status": "True", "reason": "FailedJobs" if cond["reason"] == "PodFailurePolicy"
             else "ReachedMaxRestarts"}]}

    def pods_of(self, job: str) -> list[Doc]:
        if job in self.pods:
            return self.pods[job]
        code = self.job_code(job)
        state = {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed"}} if code is not None \
            else {"running": {}}
        status = {"name": "replayjob", "image": "replayjob:0.1.0", "imageID": "", "ready": False,
                  "restartCount": 0, "state": state}
        return [{"metadata": {"name": f"{job}-0", "labels": {"batch.kubernetes.io/job-name": job}},
                 "status": {"containerStatuses": [status]}}]


WORKFLOWS = Path(__file__).resolve().parent / "workflows"


def verdict_text(code: int) -> str | None:
    """A real verdict whose exit code is ``code`` (the reducer's output over synthetic evidence, as the Argo
    status documents in tests/workflows/ carry it), or None for 3: a reducer that errored wrote none."""
    name = {0: "succeeded.json", 1: "failed-gate.json", 2: "refused.json"}.get(code)
    if name is None:
        return None
    doc = json.loads((WORKFLOWS / name).read_text(encoding="utf-8"))
    return str(next(p["value"] for p in doc["status"]["outputs"]["parameters"] if p["name"] == "verdict"))


SERVER_FIELDS = ("uid", "resourceVersion", "namespace")


def as_sent(doc: Doc) -> Doc:
    """A stored object without what the API server added to it."""
    out = copy.deepcopy(doc)
    for key in SERVER_FIELDS:
        out["metadata"].pop(key, None)
    return out


def _matches(doc: Doc, selector: str) -> bool:
    labels = doc.get("metadata", {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _json_patch(doc: Doc, ops: list[Doc]) -> Doc:
    """RFC 6902 add/replace/test on object paths (``-`` appends to a list), all or nothing."""
    out = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].strip("/").split("/")]
        parent: Any = out
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        elif op["op"] == "add" and isinstance(parent, list):
            parent.append(op["value"]) if last == "-" else parent.insert(int(last), op["value"])
        elif op["op"] in ("add", "replace"):
            parent[last] = op["value"]
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return out


def handler_for(cluster: Cluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def reply(self, code: int, body: Doc) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def status(self, code: int, reason: str) -> None:
            self.reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                              "code": code})

        def route(self) -> tuple[list[str], str | None, str | None, Doc]:
            """(path parts, kind, name, query) of a namespaced request."""
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            ns = parts.index("namespaces")
            assert parts[ns + 1] == NS, self.path
            rest = parts[ns + 2:]
            return rest, PLURALS.get(rest[0]), rest[1] if len(rest) > 1 else None, parse_qs(url.query)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            rest, _, _, _ = self.route()
            key = (body["kind"], body["metadata"]["name"])
            with cluster.lock:
                cluster.calls.append(f"POST {rest[0]} {key[1]}")
                if ("POST", key[1]) in cluster.refuse:
                    self.status(cluster.refuse[("POST", key[1])], "Refused")
                    return
                if key in cluster.objects:
                    cluster.calls.append(f"CONFLICT {rest[0]} {key[1]}")
                    self.status(409, "AlreadyExists")
                    return
                created = cluster.add(body)
            if body["kind"] == "Job" and cluster.on_create is not None:
                cluster.on_create(created)  # before the reply: its caller then knows it has started
            if key[1] in cluster.lost_replies:
                cluster.lost_replies.discard(key[1])
                self.status(500, "InternalError")  # created, but the reply never reached the client
                return
            self.reply(201, created)

        def do_PATCH(self) -> None:
            ops = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            rest, kind, name, _ = self.route()
            assert self.headers["Content-Type"] == "application/json-patch+json", self.headers["Content-Type"]
            with cluster.lock:
                cluster.calls.append(f"PATCH {rest[0]} {name}")
                if ("PATCH", str(name)) in cluster.refuse:
                    self.status(cluster.refuse[("PATCH", str(name))], "Conflict")
                    return
                doc = cluster.objects.get((str(kind), str(name)))
                if doc is None:
                    self.status(404, "NotFound")
                    return
                try:
                    patched = _json_patch(doc, ops)
                except (ValueError, KeyError, IndexError):
                    self.status(422, "Invalid")
                    return
                patched["metadata"]["resourceVersion"] = str(int(doc["metadata"]["resourceVersion"]) + 1)
                cluster.objects[(str(kind), str(name))] = patched
            self.reply(200, patched)

        def do_GET(self) -> None:
            rest, kind, name, query = self.route()
            with cluster.lock:
                if name is not None and name in cluster.forbidden:
                    cluster.calls.append(f"FORBIDDEN {rest[0]} {name}")
                    self.status(403, "Forbidden")
                    return
                if kind == "Job" and rest[-1] == "status":
                    cluster.calls.append(f"GET status {name}")
                    if cluster.unavailable > 0:
                        cluster.unavailable -= 1
                        self.status(503, "ServiceUnavailable")
                        return
                    if name in cluster.deleted or ("Job", str(name)) not in cluster.objects:
                        self.status(404, "NotFound")
                        return
                    job = dict(cluster.objects[("Job", str(name))])
                    self.reply(200, {**job, "status": cluster.job_status(str(name))})
                    return
                selector = query.get("labelSelector", [""])[0]
                if kind == "JobSet" and name is not None:  # the controller's status comes with every read
                    cluster.calls.append(f"GET jobsets {name}")
                    if ("JobSet", name) not in cluster.objects:
                        self.status(404, "NotFound")
                        return
                    self.reply(200, {**cluster.objects[("JobSet", name)], "status": cluster.jobset_status(name)})
                    return
                if kind == "Pod" and name is None and selector.startswith(JOBSET_NAME_LABEL + "="):
                    jobset = selector.split("=", 1)[1]
                    cluster.calls.append(f"GET pods {jobset}")
                    self.reply(200, {"kind": "PodList", "apiVersion": "v1", "items": cluster.pods_of(jobset)})
                    return
                if kind == "Pod" and name is None and selector.startswith("batch.kubernetes.io/job-name="):
                    job_name = selector.split("=", 1)[1]
                    cluster.calls.append(f"GET pods {job_name}")
                    self.reply(200, {"kind": "PodList", "apiVersion": "v1", "items": cluster.pods_of(job_name)})
                    return
                if kind == "Workflow" and name is not None:
                    cluster.calls.append(f"GET workflows {name}")
                    docs = cluster.workflows.get(name)
                    doc = (docs.pop(0) if len(docs) > 1 else docs[0]) if docs else {}
                    if not doc:
                        self.status(404, "NotFound")
                        return
                    self.reply(200, doc)
                    return
                if kind == "Event" and name is None:
                    field = query.get("fieldSelector", [""])[0]
                    involved = field.removeprefix("involvedObject.name=")
                    cluster.calls.append(f"LIST events {involved}")
                    items = [e for e in cluster.events if e.get("involvedObject", {}).get("name") == involved]
                    self.reply(200, {"kind": "EventList", "apiVersion": "v1", "metadata": {}, "items": items})
                    return
                if name is None:  # a list by label selector
                    cluster.calls.append(f"LIST {rest[0]} {selector}")
                    items = [{k: v for k, v in self.current(d).items() if k not in ("kind", "apiVersion")}
                             for (k, _), d in cluster.objects.items() if k == kind and _matches(d, selector)]
                    # as the API server lists them: without each item's kind and apiVersion
                    self.reply(200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {}, "items": items})
                    return
                cluster.calls.append(f"GET {rest[0]} {name}")
                obj = cluster.objects.get((str(kind), name))
                if obj is None:
                    self.status(404, "NotFound")
                    return
                self.reply(200, self.current(obj))

        def current(self, doc: Doc) -> Doc:
            """A Job as read now: with its status (not counted as a status read)."""
            if doc.get("kind") != "Job":
                return doc
            return {**doc, "status": cluster.job_status(doc["metadata"]["name"], count=False)}

    return Handler


@contextmanager
def serve(cluster: Cluster) -> Iterator[str]:
    """Serve ``cluster`` on loopback for the duration; yields the API server's URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(cluster))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    cluster.host = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield cluster.host
    finally:
        server.shutdown()
        server.server_close()


def kubeconfig(host: str, namespace: str = NS) -> str:
    """A kubeconfig (JSON) whose current context is the emulator, in ``namespace``."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": host}}],
        "users": [{"name": "emu", "user": {"token": "emulator"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": namespace}}]})
