"""``RUN/ended.json``: what ended a run that did not end by itself, declared, written and read here.

The Argo workflow's exit handler runs when the workflow ended otherwise than ``Succeeded`` (a reducer
pod that failed for good, ``argo stop``, the workflow's deadline) and hands the step the workflow's
status and its failed nodes (Argo's ``{{workflow.status}}`` and ``{{workflow.failures}}``: a JSON list
of ``displayName``, ``templateName``, ``phase``, ``message`` per failed node).  :func:`run_end` turns
them into one record naming what ended the run, ``cause``:

* ``stopped``: a node's message says the workflow was stopped or terminated (``Stopped with strategy
  'Stop'``, ``workflow shutdown with strategy: Stop``);
* ``deadline``: a node's message names a deadline (the workflow's ``activeDeadlineSeconds``: "Step
  exceeded its deadline"; a pod's: "Pod was active on the node longer than the specified deadline");
* ``failed``: a stage failed for good (its template and message named), or ``error`` when Argo says
  ``Error`` and names no failed node;

with ``line``, the one sentence a reader or ``replayjob argo wait`` prints, and ``exit_code`` 3 (nothing
was decided by the run itself; the verdict the handler's reduce writes over what the run left says what
evidence there is).  Failures that are not the JSON Argo writes are kept as their text, truncated.

Example:
    >>> run_end("Failed", '[{"displayName": "reduce(0)", "templateName": "reduce", "phase": "Failed",'
    ...         ' "message": "Error (exit code 3)"}]')["line"]
    'the workflow ended Failed: stage reduce (reduce(0)) failed: Error (exit code 3)'
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from replayjob.declaration import UNPRINTABLE, Document, Printable, decode
from replayjob.errors import EXIT_ERROR, IntegrityError
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import canonical_bytes, loads_strict, read_json

RUN_END_FILE = "ended.json"
SCHEMA = "replayjob.run_end/v1"
CAUSES = ("stopped", "deadline", "failed", "error")
_STOPPED = ("stopped with strategy", "shutdown with strategy")
_KEEP = 300  # characters of a message kept in the record
# what Argo hands over may hold any character (a node's message is often a pod's own termination message): a
# control, line break, bidi control or lone surrogate is kept escaped, so the record's line is one printable line
_ESCAPED = re.compile(f"[{UNPRINTABLE}\ud800-\udfff]")


def _visible(text: str) -> str:
    """``text`` with every unprintable character escaped (``\\n``, ``\\u202e``)."""
    return _ESCAPED.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class FailedNode(Document, frozen=True):
    """One failed node of the workflow, as Argo lists it."""

    name: str
    template: str
    phase: str
    message: str


class RunEnd(Document, frozen=True):
    """What ended a run (:func:`run_end`)."""

    schema: Literal["replayjob.run_end/v1"]
    workflow_status: Printable
    cause: Literal["stopped", "deadline", "failed", "error"]
    line: Printable
    failed: list[FailedNode]
    exit_code: Literal[3]


def _nodes(failures: str) -> list[dict[str, str]] | None:
    try:
        raw = json.loads(failures) if failures.strip() else []
    except ValueError:
        return None
    if not isinstance(raw, list) or not all(isinstance(n, dict) for n in raw):
        return None
    return [{"name": _visible(str(n.get("displayName") or n.get("name") or "")),
             "template": _visible(str(n.get("templateName") or "")), "phase": _visible(str(n.get("phase") or "")),
             "message": _visible(str(n.get("message") or "")[:_KEEP])} for n in raw]


def run_end(status: str, failures: str) -> dict[str, Any]:
    """The record of a run that ended with Argo's ``status`` and ``failures`` (see the module docstring)."""
    nodes = _nodes(failures)
    status = _visible(status)
    said = f"the workflow ended {status or 'without a status'}"
    if nodes is None:  # not the JSON Argo writes: its text, so that nothing is lost
        return {"schema": SCHEMA, "workflow_status": status or "unknown", "cause": "error",
                "line": f"{said}; its failures are not a list of nodes: {_visible(repr(failures.strip()[:_KEEP]))}",
                "failed": [], "exit_code": EXIT_ERROR}
    messages = [n["message"].lower() for n in nodes]
    stopped = next((n for n, m in zip(nodes, messages, strict=True) if any(s in m for s in _STOPPED)), None)
    deadline = next((n for n, m in zip(nodes, messages, strict=True) if "deadline" in m), None)
    if stopped is not None:
        cause, line = "stopped", f"{said}: it was stopped ({stopped['message']})"
    elif deadline is not None:
        cause, line = "deadline", f"{said}: a deadline ended {deadline['name'] or 'it'} ({deadline['message']})"
    elif nodes:
        first = nodes[0]
        cause, why = "failed", first["message"] or first["phase"]
        line = f"{said}: stage {first['template'] or '?'} ({first['name']}) failed: {why}"
        if len(nodes) > 1:
            line += f" (and {len(nodes) - 1} more failed node{'s' if len(nodes) > 2 else ''})"
    else:
        cause, line = "error", f"{said} and names no failed node (a controller error)"
    return {"schema": SCHEMA, "workflow_status": status or "unknown", "cause": cause, "line": line,
            "failed": nodes, "exit_code": EXIT_ERROR}


def write_run_end(path: str | Path, doc: dict[str, Any]) -> RunEnd:
    """Check ``doc`` against the declaration and write it atomically to ``path``."""
    record = decode(doc, RunEnd, where=path)
    atomic_write_bytes(path, canonical_bytes(doc) + b"\n")
    return record


def read_run_end(path: str | Path) -> RunEnd:
    """``RUN/ended.json`` as declared (strict JSON, no unknown field), or refused naming the field."""
    return decode(read_json(path), RunEnd, where=path)


def read_run_end_text(text: str, where: str) -> RunEnd:
    """The record as Argo's global output ``ended`` carries it (its text), read as strictly as the file."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise IntegrityError("not a text replayjob wrote: it holds a lone surrogate, which no UTF-8 file holds",
                             where=where) from None
    return decode(loads_strict(data, where=where), RunEnd, where=where)
