"""Which exit statuses are retried is declared once (``replayjob.errors.FINAL_EXIT_STATUSES``,
``is_retryable``) and every place that acts on it is read here and compared with the declaration: the
Jobs' ``podFailurePolicy`` (committed and created by the driver), Argo's retry expression, ``k8s submit``'s
decisive code, ``determinism-check``, replay's child processes, and the Slurm scripts' requeue."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest
from conftest import REPO
from test_deploy_manifests import all_docs

from replayjob.artifacts.cluster_status import decisive_code
from replayjob.errors import (
    FINAL_EXIT_STATUSES,
    NegativeVerdict,
    OperationalError,
    RefusedError,
    error_for_exit_status,
    is_retryable,
)
from replayjob.launch import argo

STATUSES = range(0, 256)
LIB = REPO / "scripts" / "slurm" / "lib.sh"


def test_the_declaration() -> None:
    assert {1, 2} == FINAL_EXIT_STATUSES
    assert [s for s in STATUSES if not is_retryable(s)] == [0, 1, 2]
    assert is_retryable(3) and is_retryable(137) and is_retryable(-9)  # an OOM kill, a death by signal
    assert (error_for_exit_status(1), error_for_exit_status(2)) == (NegativeVerdict, RefusedError)
    assert {error_for_exit_status(s) for s in (3, 137, 143, -9, 5)} == {OperationalError}


def pod_failure_policies() -> list[tuple[str, list[dict[str, object]]]]:
    return [(f"{p.name}:{d['metadata']['name']}", d["spec"]["podFailurePolicy"]["rules"])
            for p, d in all_docs() if d.get("kind") == "Job"]


def test_every_job_fails_on_the_final_statuses_and_counts_every_other() -> None:
    policies = pod_failure_policies()
    assert len(policies) >= 4  # the driver (base) and the stage Jobs it creates
    for where, rules in policies:
        actions = {}
        for status in STATUSES[1:]:  # the first rule matching the status decides (Kubernetes' order)
            rule = next((r for r in rules if "onExitCodes" in r and (
                (status in r["onExitCodes"]["values"]) == (r["onExitCodes"]["operator"] == "In"))), None)
            actions[status] = rule["action"] if rule else "Count"  # an unmatched failure counts
        assert {s for s, a in actions.items() if a == "FailJob"} == FINAL_EXIT_STATUSES, where
        assert all(a == "Count" for s, a in actions.items() if is_retryable(s)), where
        assert any(r["action"] == "Ignore" and "onPodConditions" in r for r in rules), where


def argo_retries(expression: str, status: str, exit_code: str) -> bool:
    """Argo's retry expression for one attempt, evaluated for the few forms the render may use."""
    final = re.fullmatch(r'lastRetry\.status == "Error" \|\| !\(lastRetry\.exitCode in \[(.*)\]\)', expression)
    assert final is not None, f"an expression this test cannot read: {expression}"
    values = ast.literal_eval("[" + final.group(1) + "]")
    return status == "Error" or exit_code not in values


def test_argo_retries_exactly_what_the_jobs_retry() -> None:
    templates = [t for _, d in all_docs() if d.get("kind") == "WorkflowTemplate" for t in d["spec"]["templates"]
                 if "container" in t]
    assert len(templates) >= 3
    for t in templates:
        expression = t["retryStrategy"]["expression"]
        assert expression == argo.RETRY_EXPRESSION, t["name"]
        for status in STATUSES[1:]:
            assert argo_retries(expression, "Failed", str(status)) is is_retryable(status), (t["name"], status)
        assert argo_retries(expression, "Failed", "")  # a pod past its deadline: no exit code, retried
        assert argo_retries(expression, "Error", "2")


def test_the_driver_s_decisive_code() -> None:
    assert decisive_code({3, 2}) == 2 and decisive_code({1, 2, 3}) == 1  # a final code outranks a retry
    assert decisive_code({137}) == 3 and decisive_code({3, 137}) == 3  # nothing decided
    assert decisive_code({0}) is None and decisive_code(set()) is None


@pytest.mark.parametrize("path", ["replayjob/check/determinism_check.py", "replayjob/producers/builtin/replay.py",
                                  "replayjob/launch/submit.py", "replayjob/artifacts/cluster_status.py"])
def test_python_callers_import_the_declaration_and_spell_no_code(path: str) -> None:
    source = (REPO / path).read_text(encoding="utf-8")
    assert re.search(r"\b(is_retryable|error_for_exit_status|FINAL_EXIT_STATUSES)\b", source), path
    spelled = []  # a status compared with a literal other than 0 (success), or tested against a literal set
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and re.search(r"returncode|exit_?code|\bcode\b", ast.unparse(node.left)):
            for right in node.comparators:
                literals = [c.value for c in ast.walk(right) if isinstance(c, ast.Constant)]
                if any(isinstance(v, int) and not isinstance(v, bool) and v != 0 for v in literals):
                    spelled.append(ast.unparse(node))
    assert spelled == [], (path, spelled)


def test_the_slurm_scripts_requeue_what_is_retryable() -> None:
    text = LIB.read_text(encoding="utf-8")
    declared = re.search(r"^REPLAYJOB_FINAL_STATUSES=\(([0-9 ]*)\)$", text, re.M)
    assert declared is not None and {int(w) for w in declared.group(1).split()} == FINAL_EXIT_STATUSES
    probe = "; ".join(f"is_retryable {s} && echo {s}" for s in STATUSES)
    out = subprocess.run(["bash", "-c", f". {LIB}; {probe}; true"], capture_output=True, text=True, check=True)
    assert [int(w) for w in out.stdout.split()] == [s for s in STATUSES if is_retryable(s)]
    for script in ("capture.sbatch", "replay.sbatch", "reduce.sbatch"):  # each ends through finish_step
        assert 'finish_step "$code"' in (LIB.parent / script).read_text(encoding="utf-8"), script


def test_argo_retries_are_bounded_by_count_and_the_pod_deadline_not_wall_time() -> None:
    """backoff.maxDuration counts from the first attempt, Pending time in a GPU queue included, and
    overrides a retried pod's deadline: it must not bound the retries; the count and each attempt's own
    activeDeadlineSeconds do."""
    from replayjob.launch import k8s

    templates = [(d, t) for _, d in all_docs() if d.get("kind") == "WorkflowTemplate" for t in d["spec"]["templates"]
                 if "container" in t]
    assert templates
    for doc, t in templates:
        retry = t["retryStrategy"]
        assert retry["limit"] == str(k8s.RETRIES), t["name"]
        assert "maxDuration" not in retry.get("backoff", {}), t["name"]
        assert int(t["activeDeadlineSeconds"]) > 0, t["name"]
        # the workflow's own deadline leaves room for every attempt of every stage
        assert doc["spec"]["activeDeadlineSeconds"] >= int(t["activeDeadlineSeconds"]) * k8s.ATTEMPTS * 3
