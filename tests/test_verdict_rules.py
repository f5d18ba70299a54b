"""The verdict's summaries, recomputed when it is read: a verdict is readable only as the document the reducer
would have written from its own checks (``admission``, ``comparisons.admission``, a pass's checks and the
groups its claim grades, a refusal beside ``incomplete``, the ``summary`` line, the checks its claim makes --
each once, under its group, every one of them unless a refusal stopped the reducer -- and ``budgets.decisions``
from the budget checks), and every launcher's wait (``judge`` behind ``read_verdict``) decides 3, never 0, from
one that is not."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from replayjob.artifacts import claims
from replayjob.artifacts.cluster_status import judge
from replayjob.artifacts.schedule import plan
from replayjob.artifacts.verdict import admission, incomplete, outcome, read_verdict, summary_line
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_file
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
    """Verdicts the reducer writes: a fail (one replay's logical batch edited; exact-input and bitwise), a refusal
    of no replay at all, and a refusal for a replay a stage did not produce."""
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
    code, out["bitwise fail"] = _reduce(ev, ev.root / "replays", root / "bitwise-fail.json", "bitwise")
    assert code == 1 and out["bitwise fail"]["failed_checks"] == ["exact.logical_batch"]
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


# --- the checks are the claim's: each once, under its group, all of them once the evidence was read ------------

def consistent(doc: Doc) -> Doc:
    """``doc`` with every summary recomputed from its checks, as a forger who reads the source would: the status,
    exit code and failed checks, the admission (and its repeat) and the summary line."""
    out = copy.deepcopy(doc)
    status, code, failed = outcome(out["checks"], out["refusal"])
    label = admission(out["checks"], out["refusal"] is not None, out.get("contention"))
    out.update(status=status, exit_code=code, failed_checks=failed, admission=label)
    out["comparisons"]["admission"] = label
    return resummed(out)


def without(doc: Doc, *names: str) -> Doc:
    return consistent({**doc, "checks": [c for c in doc["checks"] if c["name"] not in names]})


def reads(doc: Doc) -> None:
    assert read_verdict(json.dumps(doc).encode(), where="v").doc == doc


def test_a_fail_with_its_failing_check_deleted_is_refused(written: dict[str, Doc]) -> None:
    """The doctored fail: the failing ``exact.logical_batch`` check deleted and every summary recomputed, so it
    reads as a pass; the claim makes that check whenever its evidence was read."""
    for what in ("fail", "bitwise fail"):
        doc = without(written[what], "exact.logical_batch")
        assert (doc["status"], doc["exit_code"], doc["admission"]) == ("pass", 0, "admitted")
        refused(doc, "`checks`", "makes 'exact.logical_batch' whenever its evidence was read")
        assert judged(doc)[0] == 3


def test_a_pass_holds_every_check_its_claim_makes() -> None:
    for claim in ("exact-input", "bitwise"):
        doc = golden(claim)
        kept = {next(c["name"] for c in doc["checks"] if c["group"] == g and c["status"] == "pass")
                for g in claims.BY_NAME[claim].groups}  # one passed check per group: the weaker rule holds
        short = {**doc, "checks": [c for c in doc["checks"] if c["name"] in kept]}
        assert len(short["checks"]) == len(claims.BY_NAME[claim].groups)
        refused(short, "`checks`", "whenever its evidence was read")
        for name in claims.BY_NAME[claim].checks:  # each one of them, alone
            refused(without(doc, name), "`checks`", f"makes {name!r}")
    fail = golden("approximate")  # a fail holds them too: every check ran
    for name in ("approximate.routing_agreement", "inputs.tolerances_pinned", "exact.systems_only"):
        dropped = without(fail, name) if name in claims.BY_NAME["approximate"].checks else fail
        if dropped is not fail:
            refused(dropped, "`checks`", f"makes {name!r}")


def test_every_check_is_held_once() -> None:
    for claim in ("exact-input", "bitwise", "approximate"):
        doc = golden(claim)
        twice = consistent({**doc, "checks": doc["checks"] + doc["checks"]})
        assert (twice["status"], twice["admission"]) == (doc["status"], doc["admission"])
        refused(twice, "`checks`", "held more than once")
        one = doc["checks"][-1]
        refused(consistent({**doc, "checks": [*doc["checks"], one]}), "`checks`",
                f"{one['name']!r} held more than once")


def test_every_check_is_the_claim_s_under_its_group() -> None:
    doc = golden("exact-input")
    made_up = {"name": "exact.made_up", "group": "exact-input", "status": "pass", "expected": None, "observed": None,
               "detail": "", "offenders": []}
    refused({**doc, "checks": [*doc["checks"], made_up]}, "`checks`", "'exact.made_up' is no check the claim")
    bitwise = next(c for c in golden("bitwise")["checks"] if c["name"] == "bitwise.final_vs_source")
    refused({**doc, "checks": [*doc["checks"], bitwise]}, "`checks`", "'bitwise.final_vs_source' is no check the "
            "claim 'exact-input' makes")
    approximate = golden("approximate")  # no exact.systems_only in an approximate verdict
    systems = next(c for c in doc["checks"] if c["name"] == "exact.systems_only")
    refused({**approximate, "checks": [*approximate["checks"], systems]}, "`checks`", "'exact.systems_only' is no")
    moved = [{**c, "group": "bitwise"} if c["name"] == "exact.logical_batch" else c for c in doc["checks"]]
    refused({**doc, "checks": moved}, "`checks`", "'exact.logical_batch' is a check of group 'exact-input', not "
            "'bitwise'")


def test_the_claim_s_checks_come_in_the_reducer_s_order(written: dict[str, Doc]) -> None:
    doc = golden("bitwise")
    checks = doc["checks"]
    swapped = [checks[1], checks[0], *checks[2:]]
    refused({**doc, "checks": swapped}, "`checks`", "so 'inputs.expected_arms' comes where 'inputs.min_repeats'")
    # a refusal stops the reducer part-way: the first checks only, never a gap
    stopped = {**written["short"], "refusal": {"message": "m", "where": None, "hint": None}}
    partial = consistent({**stopped, "checks": stopped["checks"][:8]})
    reads(partial)
    refused(consistent({**stopped, "checks": stopped["checks"][:3] + stopped["checks"][4:8]}), "`checks`",
            "so 'inputs.unique_repeats' comes where 'inputs.final_adapter_on_disk'")


def test_a_refused_verdict_without_a_refusal_holds_every_check_but_the_unevaluated(written: dict[str, Doc]) -> None:
    """A refused check does not stop the reducer (only the approximate claim's gradient and routing checks are
    not made then): a verdict refused by its checks holds the rest, and only a refusal leaves checks out."""
    short = written["short"]
    refused(without(short, "bitwise.final_across_arms"), "`checks`", "makes 'bitwise.final_across_arms'")
    approximate = copy.deepcopy(golden("approximate"))
    for c in approximate["checks"]:
        if c["name"] == "inputs.tolerances_pinned":
            c["status"] = "refused"
    approximate = consistent(approximate)
    assert approximate["status"] == "refused" and approximate["refusal"] is None
    reads(without(approximate, *claims.BY_NAME["approximate"].unevaluated))
    refused(without(approximate, "approximate.update_cosine"), "`checks`", "makes 'approximate.update_cosine'")
    refused(without(golden("approximate"), "approximate.gradient_cosine"), "`checks`",
            "makes 'approximate.gradient_cosine'")  # nothing was refused: every check was made


def test_timing_uncontended_goes_with_the_contention_section() -> None:
    doc = golden("exact-input")
    probed = {**doc, "contention": {"thresholds": {}, "recorded": 6, "not_recorded": [], "contended": []}}
    refused(probed, "`checks`", "`timing.uncontended` is held exactly when the verdict has a `contention` section "
            "and no refusal, and this one has")
    check = {"name": "timing.uncontended", "group": "timing", "status": "pass", "expected": "", "observed": [],
             "detail": "no replay was contended", "offenders": []}
    reads({**probed, "checks": [*doc["checks"], check]})
    refused({**doc, "checks": [*doc["checks"], check]}, "`checks`", "and this one has not")
    refused({**probed, "checks": [*doc["checks"], {**check, "group": "exact-input"}]}, "`checks`",
            "'timing.uncontended' is a check of group 'timing'")


def test_the_first_divergent_module_explains_a_failed_bitwise_check() -> None:
    doc = golden("bitwise")
    module = {"name": "bitwise.first_divergent_module", "group": "bitwise", "status": "fail",
              "expected": "bitwise-equal traces", "observed": {}, "detail": "", "offenders": ["x#1"]}
    forged = consistent({**doc, "checks": [*doc["checks"], module]})
    assert forged["status"] == "fail"
    refused(forged, "`checks`", "no other bitwise check failed")
    failed = copy.deepcopy(doc)
    for c in failed["checks"]:
        if c["name"] == "bitwise.final_vs_source":
            c["status"] = "fail"
    reads(consistent({**failed, "checks": [*failed["checks"], module]}))
    refused(consistent({**golden("exact-input"), "checks": [*golden("exact-input")["checks"], module]}), "`checks`",
            "'bitwise.first_divergent_module' is no check the claim 'exact-input' makes")


# --- the budgets section follows from the budget checks ---------------------------------------------------

BASE, SLOW = "mb-default", "mb-1"
MB = "training.micro_batch_size"


def budgeted(tmp_path: Path, text: str, walls: dict[str, list[float]], claim: str = "exact-input") -> tuple[int, Doc]:
    f = tmp_path / "budgets.toml"
    f.write_text(text)
    ev = synthetic.paired(tmp_path / "ev", {BASE: {}, SLOW: {MB: 1}}, walls, budgets=f)
    out = tmp_path / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", claim, "--source", str(ev.source), "--out",
                 str(out), "--baseline", BASE, "--budgets", str(f), "--min-repeats", "2"])
    doc: Doc = json.loads(out.read_text())
    assert doc["exit_code"] == code
    return code, doc


SLOWDOWN = {BASE: [1.0, 1.1, 0.9], SLOW: [3.0, 3.4, 2.6]}
BOUNDS = f"[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\npeak_memory_bytes = {{ max_ratio = 0.8 }}\n"


@pytest.fixture(scope="module")
def budget_pass(tmp_path_factory: pytest.TempPathFactory) -> Doc:
    """A pass whose budgets decided one time bound (pass) and left a memory bound not measurable (CPU)."""
    code, doc = budgeted(tmp_path_factory.mktemp("budgets"), BOUNDS, SLOWDOWN)
    assert code == 0 and doc["budgets"]["decisions"] == {
        "not_measurable": [f"budgets.{SLOW}.peak_memory_bytes.max_ratio"],
        "pass": [f"budgets.{SLOW}.local_train_wall_s.max_ratio"]}
    return doc


def test_budget_decisions_follow_from_the_budget_checks(budget_pass: Doc) -> None:
    """The doctored pass: its decisions say a bound failed while no budget check failed (or no budget check
    exists); the summary line rewritten to match ('budgets fail 1')."""
    time_bound = f"budgets.{SLOW}.local_train_wall_s.max_ratio"
    forged = resummed({**budget_pass, "budgets": {**budget_pass["budgets"], "decisions": {"fail": [time_bound]}}})
    assert "budgets fail 1" in forged["summary"] and forged["status"] == "pass"
    refused(forged, "`budgets.decisions`", "but the budget checks give")
    reordered = dict(reversed(list(budget_pass["budgets"]["decisions"].items())))
    refused(resummed({**budget_pass, "budgets": {**budget_pass["budgets"], "decisions": reordered}}),
            "`budgets.decisions`")
    bare = golden("exact-input")  # a pass with no budget check at all
    section = {**budget_pass["budgets"], "decisions": {"fail": [time_bound]}}
    refused(resummed({**bare, "budgets": section}), "`checks`", "a verdict with a `budgets` section holds "
            "inputs.budgets_pinned and budgets.pairing")
    rows = [{**r, "decision": "fail"} if r["metric"] == "local_train_wall_s" else r
            for r in budget_pass["budgets"]["bounds"]]
    refused({**budget_pass, "budgets": {**budget_pass["budgets"], "bounds": rows}}, "`budgets.bounds`",
            "but the budget checks give")
    refused({**budget_pass, "budgets": {**budget_pass["budgets"], "bounds": rows[:1]}}, "`budgets.bounds`")


def test_a_budget_check_states_its_decision(budget_pass: Doc) -> None:
    checks = [{**c, "detail": "fail"} if c["name"].endswith("local_train_wall_s.max_ratio") else c
              for c in budget_pass["checks"]]
    refused({**budget_pass, "checks": checks}, "`checks`", "a bound's check states its decision")
    checks = [{**c, "detail": "pass: measured"} if c["name"].endswith("peak_memory_bytes.max_ratio") else c
              for c in budget_pass["checks"]]
    refused({**budget_pass, "checks": checks}, "`checks`", "is 'not_applicable' with detail 'pass: measured'")


def test_budget_checks_go_with_the_budgets_section(budget_pass: Doc, written: dict[str, Doc]) -> None:
    bare = resummed({k: v for k, v in budget_pass.items() if k != "budgets"})
    refused(bare, "`checks`", "budget checks are made with the `budgets` section")
    pin = next(c for c in budget_pass["checks"] if c["name"] == "inputs.budgets_pinned")
    doc = golden("exact-input")
    made = len(claims.BY_NAME["exact-input"].checks)  # the checks the claim always makes, before the optional ones
    refused({**doc, "checks": [*doc["checks"][:made], pin]}, "`checks`", "`inputs.budgets_pinned` without a "
            "`budgets` section is a refusal")
    unread = consistent({**doc, "checks": [*doc["checks"][:made], {**pin, "status": "refused"}]})
    reads(unread)  # replays that pinned a budget file reduced without it
    for name in ("inputs.budgets_pinned", "budgets.pairing"):
        refused(without(budget_pass, name), "`checks`", f"section holds {name}")
    section = {**budget_pass["budgets"], "decisions": {}, "bounds": []}
    stopped = resummed({**written["none"], "budgets": section})
    refused(stopped, "`budgets`", "has a refusal")


# --- every verdict the reducer writes reads back, with every check its claim makes -------------------------

def torch_adapters(tmp_path: Path, arms: dict[str, dict[str, Any]], repeats: int, tol: bytes,
                   pinned: bytes | None = None) -> tuple[synthetic.Evidence, Path]:
    """Evidence of real safetensors adapters (the approximate claim reads the update geometry)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save

    def tensors(seed: int, scale: float = 1.0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        return {"layer.0.lora_A.weight": torch.randn(4, 16, generator=g) * scale,
                "layer.0.lora_B.weight": torch.randn(16, 4, generator=g) * scale}

    initial, update = tensors(0), tensors(1, 1e-2)

    def final(arm: str, i: int) -> bytes:
        n = tensors(100 + 7 * i + 50 * list(arms).index(arm) if arm in arms else 9, 1e-5)
        return save({k: initial[k] + update[k] + n[k] for k in initial})

    tol_file = tmp_path / "tolerances.toml"
    tol_file.write_bytes(tol)
    ev = synthetic.build(tmp_path / "ev", arms, repeats, initial=save(initial), final=final, source_final=final("", 0),
                         tolerances_sha256=sha256_bytes(pinned if pinned is not None else tol))
    return ev, tol_file


def scheduled(ev: synthetic.Evidence, budgets: Path, walls: dict[str, list[float]]) -> None:
    """``ev``'s replays run as a seeded ABBA schedule with ``walls`` as step times, pinned to ``budgets``."""
    names = list(walls)
    order = {(arm, s.block): s for arm, s in plan(names, len(walls[names[0]]), "abba", seed=5)}
    for f in ev.replay_files:
        doc = json.loads(f.read_text())
        arm, i = doc["arm"], doc["repeat_index"]
        doc["timing"]["local_train_wall_s"] = walls[arm][i]
        doc["schedule"] = order[(arm, i)].to_json()
        doc["host"]["node"] = "node-a"
        doc["budgets_sha256"] = sha256_file(budgets)
        f.write_bytes(pretty_bytes(doc))


TOL = b"update_cosine_min = 0.99\nrelative_delta_l2_max = 0.05\n"
TIGHT = b"update_cosine_min = 0.999999999\nrelative_delta_l2_max = 1e-9\n"
OTHER_FINAL = synthetic.adapter_file(b"another final adapter")
CASES: dict[str, tuple[str, int]] = {  # what -> (claim, exit code)
    "exact-input pass": ("exact-input", 0), "exact-input fail": ("exact-input", 1),
    "bitwise pass": ("bitwise", 0), "bitwise fail": ("bitwise", 1),
    "approximate pass": ("approximate", 0), "approximate fail": ("approximate", 1),
    "approximate refused by a check": ("approximate", 2),
    "exact-input budgets pass": ("exact-input", 0), "exact-input budgets fail": ("exact-input", 1),
    "exact-input budgets inconclusive": ("exact-input", 2), "bitwise budgets pass": ("bitwise", 0),
    "bitwise budgets fail": ("bitwise", 1), "approximate budgets pass": ("approximate", 0),
    "approximate budgets fail": ("approximate", 1),
}


def run_case(tmp_path: Path, what: str) -> tuple[int, Doc]:
    claim, _ = CASES[what]
    if "budgets" in what and claim != "approximate":
        limit = {"pass": 10, "fail": 1.5, "inconclusive": 3.0}[what.rsplit(" ", 1)[1]]
        walls = {BASE: [1.0, 1.0], SLOW: [2.8, 3.3]} if what.endswith("inconclusive") else SLOWDOWN
        return budgeted(tmp_path, f"[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = {limit} }}\n", walls, claim)
    extra: list[str] = []
    if claim == "approximate":
        tol = TIGHT if what.endswith("fail") else TOL
        ev, tol_file = torch_adapters(tmp_path, ARMS, 3 if "budgets" not in what else 2, tol,
                                      pinned=b"other" if "refused" in what else None)
        extra += ["--tolerances", str(tol_file)]
        if "budgets" in what:
            budgets = tmp_path / "budgets.toml"
            budgets.write_text(f'["{ON}"]\nlocal_train_wall_s = {{ max_ratio = 10 }}\n')
            scheduled(ev, budgets, {OFF: [1.0, 1.1], ON: [1.2, 1.3]})
            extra += ["--budgets", str(budgets), "--min-repeats", "2"]
    else:
        fail = what.endswith("fail")
        ev = synthetic.build(tmp_path / "ev", ARMS, 3,
                             final=(lambda arm, i: OTHER_FINAL if fail and arm == ON else synthetic.FINAL))
        if fail and claim == "exact-input":
            edited = json.loads(ev.replay_files[4].read_text())
            edited["optimizer/logical_batch_sha256"] = "ab" * 32
            ev.replay_files[4].write_bytes(pretty_bytes(edited))
    out = tmp_path / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", claim, "--out", str(out), "--source", str(ev.source),
                 "--baseline", OFF if claim == "approximate" or "budgets" not in what else BASE, *extra])
    doc: Doc = json.loads(out.read_text())
    assert doc["exit_code"] == code
    return code, doc


@pytest.mark.parametrize("what", list(CASES))
def test_every_verdict_the_reducer_writes_holds_its_claim_s_checks(tmp_path: Path, what: str) -> None:
    """The reducer's own verdicts read back (a rule too strict would make the reducer refuse to write one: exit
    3), holding every check its claim makes, and a budgets section whose decisions are its checks'."""
    claim, expected = CASES[what]
    code, doc = run_case(tmp_path, what)
    assert code == expected, (doc["summary"], doc["refusal"])
    reads(doc)
    assert judged(doc, code)[0] == code
    names = [c["name"] for c in doc["checks"]]
    cl = claims.BY_NAME[claim]
    due = [n for n in cl.checks if not (doc["status"] == "refused" and n in cl.unevaluated)]
    assert [n for n in names if n in cl.checks] == due
    assert all(cl.group_of(c["name"]) == c["group"] for c in doc["checks"])
    assert ("budgets" in what) == (doc.get("budgets") is not None) == ("budgets.pairing" in names)
    if "budgets" in what:
        bounds = [c for c in doc["checks"] if c["group"] == "budgets" and c["name"] != "budgets.pairing"]
        assert sum(map(len, doc["budgets"]["decisions"].values())) == len(bounds) >= 1
        if what.endswith("fail"):
            assert doc["budgets"]["decisions"] == {"fail": [bounds[0]["name"]]} or claim == "approximate"
