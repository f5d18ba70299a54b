"""The verdict's summaries, recomputed when it is read: a verdict is readable only as the document the reducer
would have written from its own checks (``admission``, ``comparisons.admission``, a pass's checks and the
groups its claim grades, a refusal beside ``incomplete``, the ``summary`` line), and every launcher's wait
(``judge`` behind ``read_verdict``) decides 3, never 0, from one that is not."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from replayjob.artifacts.cluster_status import judge
from replayjob.artifacts.verdict import incomplete, read_verdict, summary_line
from replayjob.cli import main
from replayjob.errors import IntegrityError, ReplayjobError
from replayjob.gate import synthetic
from replayjob.jsonio import pretty_bytes
from replayjob.launch.workflow import workflow_code
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY

TESTS = Path(__file__).resolve().parent
GOLDEN = TESTS / "golden"
OFF, ON = "baseline", "gradient_checkpointing=true"
ARMS: dict[str, dict[str, Any]] = {OFF: {}, ON: {GC_KEY: True}}
Doc = dict[str, Any]


def golden(claim: str) -> Doc:
    doc: Doc = json.loads((GOLDEN / f"verdict_{claim.replace('-', '_')}.json").read_text())
    return doc


def _reduce(ev: synthetic.Evidence, replays: Path, out: Path, claim: str = "exact-input") -> tuple[int, Doc]:
    code = main(["reduce", str(replays), "--claim", claim, "--out", str(out), "--source", str(ev.source),
                 "--baseline", OFF])
    doc: Doc = json.loads(out.read_text())
    assert doc["exit_code"] == code
    return code, doc


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Doc]:
    """Verdicts the reducer writes: a fail (one replay's logical batch edited), a refusal of no replay at all,
    and a refusal for a replay a stage did not produce."""
    root = tmp_path_factory.mktemp("verdicts")
    ev = synthetic.build(root / "ev", ARMS, 3)
    out: dict[str, Doc] = {}
    path = ev.replay_files[4]
    original = path.read_bytes()
    edited = json.loads(original)
    edited["optimizer/logical_batch_sha256"] = "ab" * 32
    path.write_bytes(pretty_bytes(edited))
    code, out["fail"] = _reduce(ev, ev.root / "replays", root / "fail.json")
    assert code == 1 and out["fail"]["failed_checks"] == ["exact.logical_batch"]
    path.write_bytes(original)
    (root / "empty").mkdir()
    code, out["none"] = _reduce(ev, root / "empty", root / "none.json", "bitwise")
    assert code == 2 and out["none"]["checks"] == [] and out["none"]["refusal"] is not None
    ev.replay_files[0].unlink()
    code, out["short"] = _reduce(ev, ev.root / "replays", root / "short.json", "bitwise")
    assert code == 2 and out["short"]["failed_checks"] == ["inputs.min_repeats"] and out["short"]["refusal"] is None
    return out


def refused(doc: Doc, field: str, rule: str = "") -> None:
    """``doc`` is refused by the reader naming ``field`` (and ``rule``), and judged 3 by every launcher."""
    with pytest.raises(IntegrityError, match=field) as info:
        read_verdict(json.dumps(doc).encode(), where="wf/verdict")
    assert rule in info.value.message, info.value.message
    assert judged(doc)[0] == 3


def judged(doc: Doc, code: int = 0) -> tuple[int, str]:
    """What a launcher's wait decides from ``doc`` beside a reducer that exited ``code`` (read, then judged)."""
    try:
        verdict, unreadable = read_verdict(json.dumps(doc).encode(), where="wf/verdict"), None
    except ReplayjobError as exc:
        verdict, unreadable = None, exc.message
    return judge(verdict, unreadable, code, f"reduce exited {code}")


def resummed(doc: Doc) -> Doc:
    """``doc`` with the summary line rewritten as the reducer writes it (a forger who reads the source)."""
    return {**doc, "summary": summary_line(doc)}


def labelled(doc: Doc, label: Any) -> Doc:
    """``doc`` with ``admission`` (and ``comparisons.admission``, which repeats it) set to ``label``."""
    return {**doc, "admission": label, "comparisons": {**doc["comparisons"], "admission": label}}


def as_pass(doc: Doc) -> Doc:
    """The attack: a verdict rewritten as a pass, every check that did not pass marked passed."""
    out = copy.deepcopy(doc)
    out.update(status="pass", exit_code=0, failed_checks=[], refusal=None)
    for c in out["checks"]:
        if c["status"] in ("fail", "refused"):
            c["status"] = "pass"
    return out


def test_every_verdict_the_reducer_writes_is_read(written: dict[str, Doc]) -> None:
    docs = [golden(c) for c in ("exact-input", "bitwise", "approximate")] + list(written.values())
    docs.append(incomplete(written["short"], ["replays/baseline/0"]))
    docs.append(incomplete({**written["none"]}, ["replays/baseline/0"]))  # a refusal with no replay read
    for doc in docs:
        assert read_verdict(json.dumps(doc).encode(), where="v").doc == doc
        assert judged(doc, doc["exit_code"])[0] == doc["exit_code"]


# --- the four forgeries: read_verdict refuses them, a launcher decides 3 -------------------------------

FORGERIES: dict[str, tuple[Callable[[dict[str, Doc]], Doc], str, str]] = {
    "a fail rewritten as a pass": (lambda w: as_pass(w["fail"]), "`admission`", "a pass passed every"),
    "a refusal of no replay rewritten as a pass": (lambda w: as_pass(w["none"]), "`checks`", "a pass rests on"),
    "a pass with no checks": (lambda w: {**golden("exact-input"), "checks": []}, "`checks`", "a pass rests on"),
    "a bitwise pass without a bitwise check": (
        lambda w: {**golden("bitwise"), "checks": [c for c in golden("bitwise")["checks"] if c["group"] != "bitwise"]},
        "`checks`", "group(s) bitwise"),
}


@pytest.mark.parametrize("what", sorted(FORGERIES))
def test_a_forged_pass_is_refused_and_never_judged_0(written: dict[str, Doc], what: str) -> None:
    forge, field, rule = FORGERIES[what]
    doc = forge(written)
    assert doc["status"] == "pass" and doc["exit_code"] == 0
    refused(doc, field, rule)
    code, line = judged(doc)
    assert code == 3 and "the verdict cannot be read" in line and "reduce exited 0" in line, line


@pytest.mark.parametrize("what", sorted(FORGERIES))
def test_argo_wait_decides_3_from_a_forged_pass(written: dict[str, Doc], what: str) -> None:
    """The succeeded workflow (its reduce pod exited 0) carrying the forged pass as its output verdict."""
    workflow = json.loads((TESTS / "workflows" / "succeeded.json").read_text(encoding="utf-8"))
    for p in workflow["status"]["outputs"]["parameters"]:
        if p["name"] == "verdict":
            p["value"] = json.dumps(FORGERIES[what][0](written))
    code, line = workflow_code(workflow)
    assert code == 3 and "the verdict cannot be read" in line and "exited 0" in line, line


# --- each rule alone -----------------------------------------------------------------------------------

def test_admission_is_the_gate_s(written: dict[str, Doc]) -> None:
    """``admission`` follows from the inputs and exact-input checks, the refusal and the contended replays."""
    doc = golden("exact-input")
    for label in ("not admitted (contended)", "admitted (contended)", ""):
        refused(resummed(labelled(doc, label)), "`admission`", "give 'admitted'")
    contended = {**doc, "contention": {"thresholds": {}, "recorded": 6, "not_recorded": [], "contended": [
        {"arm": OFF, "repeat_index": 0, "path": "x", "block": None, "reasons": ["load"]}]}}
    refused(contended, "`admission`", "give 'not admitted (contended)'")
    for refused_or_failed in (written["fail"], written["short"]):  # the gate did not pass: timing is not admitted
        refused(resummed(labelled(refused_or_failed, "admitted")), "`admission`", "give 'not admitted'")


def test_a_pass_is_never_not_admitted() -> None:
    doc = golden("bitwise")
    refused(resummed(labelled(doc, "not admitted")), "`admission`", "a pass passed every")


def test_comparisons_repeat_the_admission() -> None:
    doc = golden("exact-input")
    for label in ("not admitted", None):
        refused({**doc, "comparisons": {**doc["comparisons"], "admission": label}}, "`comparisons.admission`")
    refused({**doc, "comparisons": {k: v for k, v in doc["comparisons"].items() if k != "admission"}},
            "`comparisons.admission`")


def test_a_pass_passed_a_check_of_every_group_its_claim_grades() -> None:
    for claim in ("exact-input", "bitwise"):
        doc = golden(claim)
        refused({**doc, "checks": []}, "`checks`", "a pass rests on")
        for group in {"exact-input": ("inputs", "exact-input"), "bitwise": ("inputs", "exact-input", "bitwise")}[claim]:
            for kept in ("dropped", "not_applicable"):  # absent, or every one marked not applicable
                checks = [c if c["group"] != group else {**c, "status": "not_applicable"} for c in doc["checks"]
                          if kept != "dropped" or c["group"] != group]
                refused({**doc, "checks": checks}, "`checks`", f"group(s) {group}")
    approximate = golden("approximate")  # a fail: its claim's groups are a pass's rule only
    assert read_verdict(json.dumps(approximate).encode()).status == "fail"
    forged = as_pass(approximate)
    forged = resummed({**forged, "checks": [c for c in forged["checks"] if c["group"] != "approximate"]})
    refused(forged, "`checks`", "group(s) approximate")


def test_a_refusal_beside_incomplete_rests_on_missing_evidence(written: dict[str, Doc]) -> None:
    """``incomplete`` with a refusal only when ``missing`` names the source or no replay was read: a refusal of
    replays that are there stands as refused (exit 2), whatever ``missing`` says."""
    refusal = {"message": "replay_metrics.json: field `arm`: expected `str`", "where": "replays/x", "hint": None}
    doc = incomplete(written["short"], ["replays/baseline/0"])
    refused({**doc, "refusal": refusal}, "`refusal`", "stands as 'refused'")
    for ok in (incomplete({**written["short"], "refusal": refusal}, ["source"]),
               incomplete({**written["none"]}, ["replays/baseline/0"])):
        assert ok["status"] == "incomplete" and ok["refusal"] is not None
        assert read_verdict(json.dumps(ok).encode()).exit_code == 3
    stands = {**written["short"], "refusal": refusal}
    assert incomplete(stands, ["replays/baseline/0"]) is stands
    assert read_verdict(json.dumps(stands).encode()).exit_code == 2


def test_the_summary_line_is_the_document_s(written: dict[str, Doc]) -> None:
    doc = golden("bitwise")
    for line in ("bitwise: pass (7 replays, 2 arms, timing admitted)", doc["summary"] + " ", ""):
        refused({**doc, "summary": line}, "`summary`")
    fail = written["fail"]  # a forger who fixed every label but the line still says fail
    forged = labelled(as_pass(fail), "admitted")
    refused(forged, "`summary`", "not passed: exact.logical_batch")
    budgets = {**doc, "budgets": {"decisions": {"pass": ["budgets.x"]}}}
    refused(budgets, "`summary`", "budgets pass 1")
    refused({**doc, "budgets": {"decisions": ["pass"]}}, "`budgets.decisions`")
    refused({**doc, "inputs": {**doc["inputs"], "replays": {}}}, "`inputs.replays`")
