"""The verdict: schema ``replayjob.verdict/v2`` (docs/verdict-format.md), its outcome and its atomic write.

The document holds no clock time and no absolute path that the inputs do not force, so the same
inputs give the same bytes (pretty, sorted-key JSON).  Status and exit code follow from the
checks: any ``refused`` check or refusal -> ``refused`` (2), else any ``fail`` -> ``fail`` (1),
else a ``contended`` check (a budget's timing rests on replays a contention probe flagged) ->
``contended`` (3: nothing decided, replaying those blocks may help), else any ``inconclusive`` budget
-> ``inconclusive`` (2, but not a refusal: add paired blocks), else ``pass`` (0).

Example:
    >>> outcome([{"name": "a", "status": "pass"}, {"name": "b", "status": "fail"}], None)
    ('fail', 1, ['b'])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from replayjob import __version__
from replayjob.artifacts import claims
from replayjob.declaration import Document, Text, decode
from replayjob.errors import (
    EXIT_ERROR,
    EXIT_NEGATIVE,
    EXIT_OK,
    EXIT_REFUSED,
    Inconclusive,
    IntegrityError,
    NegativeVerdict,
    OperationalError,
    RefusedError,
    ReplayjobError,
)
from replayjob.fsio import atomic_write_bytes, read_regular_bytes
from replayjob.jsonio import DEFAULT_MAX_BYTES, loads_strict, pretty_bytes, read_json

VERDICT_SCHEMA = "replayjob.verdict/v2"
# How to fix each refusing check.
HINTS = {
    "inputs.min_repeats": "run more fresh replays per arm (replay --repeat N) or lower --min-repeats",
    "inputs.single_source": "reduce the replays of one capture at a time",
    "inputs.unique_repeats": "give each replay of an arm its own --repeat-index, or drop the duplicate",
    "inputs.tolerances_pinned": "set [optimizer_batch] tolerances_sha256 to the tolerance file's SHA-256 "
                                "before the runs, then replay again",
    "inputs.capture_pins": "reduce the capture's own, unedited metrics.json with replays of that capture (a "
                           "manifest without 'outcome' predates the seal of the source's numbers: capture again)",
    "exact.systems_only": "a declared stack (version) difference is graded by the approximate claim: reduce with "
                          "--claim approximate --tolerances FILE",
    "exact.loss_same_condition": "add an arm replayed under the source's own conditions (no declared knobs) and "
                                 "reduce it together with these arms",
}


def hints(bad: list[dict[str, Any]]) -> list[str]:
    """How to fix each refusing check in ``bad``, in order.  An arm named by ``--arms`` that no replay has is
    said not to exist, with the arms found; it is not counted short of repeats (run more replays) too."""
    out: list[str] = []
    missing: set[str] = set()
    for c in bad:
        if c["name"] == "inputs.expected_arms":
            found, named = set(c["observed"] or ()), set(c["expected"] or ())
            missing = named - found
            parts = []
            if missing:
                parts.append(f"--arms names {', '.join(sorted(missing))}, but no replay has that arm: it does not "
                             f"exist among the arms found ({', '.join(sorted(found)) or 'none'}); fix the --arms "
                             "name (or, if every replay of that arm failed, rerun them)")
            if found - named:
                parts.append(f"the replays also hold arm(s) {', '.join(sorted(found - named))} that --arms does "
                             "not name: name them too, or leave their replays out")
            out += parts
    for c in bad:
        if c["name"] == "inputs.min_repeats":
            if any(a not in missing for a in c["offenders"]):
                out.append(HINTS[c["name"]])
        elif c["name"] in HINTS:
            out.append(HINTS[c["name"]])
    return out


def unsealed(bad: list[dict[str, Any]]) -> str:
    """The source numbers (file and field) that differ from those the capture manifest seals, as a sentence."""
    rows = []
    for c in bad:
        if c["name"] != "inputs.capture_pins":
            continue
        fields = [m for m in (c["observed"] or {}).get("mismatched", {}).values() if "field" in m]
        if fields and (c["expected"] or {}).get("outcome") is None:
            rows.append(f"{', '.join(m['field'] for m in fields)}: pinned by nothing, the capture manifest seals no "
                        "outcome (it was written before replayjob sealed the source's numbers)")
        else:
            rows += [f"{m['field']} is {m['recorded']!r}, the capture manifest seals {m['capture']!r}" for m in fields]
    return "; ".join(rows)


def outcome(checks: list[dict[str, Any]], refusal: dict[str, Any] | None) -> tuple[str, int, list[str]]:
    """(status, exit code, names of the checks that did not pass) for a list of check objects."""
    refused = [c["name"] for c in checks if c["status"] == "refused"]
    failed = [c["name"] for c in checks if c["status"] == "fail"]
    if refusal is not None or refused:
        return "refused", EXIT_REFUSED, refused + failed
    if failed:
        return "fail", EXIT_NEGATIVE, failed
    contended = [c["name"] for c in checks if c["status"] == "contended"]
    if contended:
        return "contended", EXIT_ERROR, contended
    undecided = [c["name"] for c in checks if c["status"] == "inconclusive"]
    if undecided:
        return "inconclusive", EXIT_REFUSED, undecided
    return "pass", EXIT_OK, []


# The checks that refuse a verdict for want of evidence: an arm with no replay, an arm short of replays.
MISSING_EVIDENCE_CHECKS = frozenset({"inputs.expected_arms", "inputs.min_repeats"})


def incomplete(doc: dict[str, Any], missing: tuple[str, ...] | list[str],
               there: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The verdict of a run whose stages left ``missing`` outputs (run-directory paths: ``source``, a
    replay's ``replays/ARM/REPEAT``) because they failed, were evicted or never ran: a refusal that rests
    only on that missing evidence becomes ``incomplete`` (exit 3: nothing was decided, running the stages
    again may decide it), listing them in ``missing``.  Any other outcome stands: a check refused for
    another reason, a fail, a pass on the evidence there is, and a refusal beside a replay that is ``there``
    (its output exists, whatever it holds) or was read: a malformed or tampered replay is refused (2) even
    where the refusal stopped the reduce before any replay was read."""
    if doc["status"] != "refused" or not missing:
        return doc
    if not {c["name"] for c in doc["checks"] if c["status"] == "refused"} <= MISSING_EVIDENCE_CHECKS:
        return doc
    if doc["refusal"] is not None and "source" not in missing and (
            (doc.get("inputs") or {}).get("replays") or set(there) - set(missing)):
        return doc  # a refusal of evidence that is there (a tampered replay) stands
    out = {**doc, "status": "incomplete", "exit_code": EXIT_ERROR, "missing": sorted(missing)}
    out["summary"] = summary_line(out)
    return out


OPTIONAL_SECTIONS = ("budgets", "contention", "in_process")  # in the order a verdict holds them


def document(*, claim: str, checks: list[dict[str, Any]], refusal: dict[str, Any] | None, admission: str,
             parameters: dict[str, Any], inputs: dict[str, Any], arms: dict[str, Any],
             comparisons: dict[str, Any], updates: dict[str, Any] | None,
             optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """The verdict document, assembled here only: its schema and version, the status, exit code and failed
    checks that follow from the checks and the refusal (:func:`outcome`), the evidence blocks in their one
    order, the optional sections (``budgets``, ``contention``, ``in_process``: each present only when the
    reduce produced it, possibly as null) in theirs, and the summary line last."""
    extra = dict(optional or {})
    unknown = sorted(set(extra) - set(OPTIONAL_SECTIONS))
    if unknown:
        raise ValueError(f"verdict sections {unknown} are not declared")
    status, code, failed = outcome(checks, refusal)
    doc: dict[str, Any] = {
        "schema": VERDICT_SCHEMA, "replayjob_version": __version__,
        "claim": claim, "status": status, "exit_code": code, "failed_checks": failed,
        "refusal": refusal, "admission": admission, "parameters": parameters, "inputs": inputs, "arms": arms,
        "comparisons": comparisons, "updates": updates, "checks": checks,
    }
    doc.update((key, extra[key]) for key in OPTIONAL_SECTIONS if key in extra)
    doc["summary"] = summary_line(doc)
    return doc


def refusal_of(exc: ReplayjobError) -> dict[str, Any]:
    return {"message": exc.message, "where": exc.where, "hint": exc.hint}


@dataclass(frozen=True)
class Verdict:
    """A written verdict: its document and where it lies."""

    path: Path
    doc: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.doc["status"])

    @property
    def exit_code(self) -> int:
        return int(self.doc["exit_code"])

    def summary(self) -> str:
        """The one-line summary, then the comparison table and each budget decision (what a reader of
        the console needs without opening the JSON)."""
        return "\n".join([str(self.doc["summary"]), *console_table(self.doc)])

    def raise_for_status(self) -> None:
        """Raise :class:`NegativeVerdict` on ``fail`` and :class:`RefusedError` on ``refused``."""
        if self.status == "pass":
            return
        if self.status == "incomplete":
            raise OperationalError(f"nothing decided: {len(self.doc['missing'])} stage output(s) missing "
                                   f"({few(self.doc['missing'])}): their stage failed, was evicted or never ran",
                                   where=self.path, hint="the stages' logs say why; run them again and reduce again")
        refusal = self.doc.get("refusal")
        if refusal:
            raise RefusedError(refusal["message"], where=refusal["where"], hint=refusal["hint"])
        bad = [c for c in self.doc["checks"] if c["status"] == self.status]
        named = "; ".join(c["name"] + (f" ({few(c['offenders'])})" if c["offenders"] else "") for c in bad)
        if self.status == "inconclusive":
            why = "; ".join(f"{c['name']} (interval [{_g(c['observed']['low'])}, {_g(c['observed']['high'])}] "
                            f"vs {_g(next(iter(c['expected'].values())))}: {c['detail']})" for c in bad)
            raise Inconclusive(f"budget(s) not decided yet: {why}", where=self.path,
                               hint="run more paired blocks (funnel --until-decided) and reduce again")
        if self.status == "contended":
            raise OperationalError(f"timing not admitted: {named}", where=self.path,
                                   hint="replay the contended blocks on a quieter host (or the same blocks again) "
                                        "and reduce again")
        if self.status == "refused":
            why = unsealed(bad)
            raise RefusedError(f"evidence refused by {named}" + (f": {why}" if why else ""), where=self.path,
                               hint="; ".join(hints(bad)) or None)
        raise NegativeVerdict(f"claim {self.doc['claim']} failed: {named}", where=self.path,
                              hint="the checks in the verdict list expected and observed values")


def _g(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}"


def few(names: list[str], n: int = 4) -> str:
    """The first ``n`` names, and how many more."""
    return ", ".join(names[:n]) + (f", ... (+{len(names) - n})" if len(names) > n else "")


def _ratio(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}"


def console_table(doc: dict[str, Any]) -> list[str]:
    """The ratios against the baseline (arm, metric, ratio, 95% interval, whether it excludes 1) and every
    budget decision, as aligned text lines; nothing when there is nothing to show."""
    comparisons = doc.get("comparisons") or {}
    rows = [(arm, metric, _ratio(r.get("ratio")),
             "-" if r.get("low") is None else f"[{_ratio(r['low'])}, {_ratio(r['high'])}]",
             {True: "yes", False: "no"}.get(r.get("excludes_1"), "-"), r.get("note") or "")
            for arm, metrics in sorted((comparisons.get("ratios") or {}).items())
            for metric, r in sorted(metrics.items())]
    lines: list[str] = []
    if rows:
        head = ("arm", "metric", "ratio", "95% interval", "excludes 1", "")
        widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(5)]
        lines.append(f"ratios against {comparisons.get('baseline')} ({comparisons.get('statistic', 'ratio')}; "
                     f"timing {comparisons.get('admission', doc.get('admission'))}):")
        for row in [head, *rows]:
            lines.append("  " + "  ".join(str(row[i]).ljust(widths[i]) for i in range(5)).rstrip()
                         + (f"  ({row[5]})" if row[5] else ""))
    for c in (doc.get("contention") or {}).get("contended") or []:
        lines.append(f"timing not admitted (contended): {c['arm']} repeat {c['repeat_index']}"
                     + ("" if c.get("block") is None else f" (block {c['block']})") + f": {'; '.join(c['reasons'])}")
    paired = comparisons.get("paired") or {}
    for arm, r in sorted(paired.get("arms", {}).items()):
        interval = "" if r.get("low") is None else f" [{_ratio(r['low'])}, {_ratio(r['high'])}]"
        lines.append(f"paired {arm} {paired['metric']} at {paired['look_confidence']:.4g}: {r['decision']} "
                     f"(ratio {_ratio(r.get('ratio'))}{interval}, {r['pairs']} pairs)"
                     + (f"; {r['note']}" if r.get("note") else ""))
    for b in (doc.get("budgets") or {}).get("bounds") or []:
        interval = "" if b.get("low") is None else f" [{_ratio(b['low'])}, {_ratio(b['high'])}]"
        lines.append(f"budget {b['arm']}.{b['metric']} {b['kind']} {b['limit']:g}: {b['decision']} "
                     f"(ratio {_ratio(b.get('ratio'))}{interval})" + (f"; {b['note']}" if b.get("note") else ""))
    return lines


def summary_line(doc: dict[str, Any]) -> str:
    n = len(doc["inputs"]["replays"])
    arms = len(doc["arms"])
    head = f"{doc['claim']}: {doc['status']} ({n} replays, {arms} arms, timing {doc['admission']})"
    if doc.get("budgets"):
        head += "; budgets " + ", ".join(f"{k} {len(v)}" for k, v in doc["budgets"]["decisions"].items())
    if doc.get("missing"):
        head += f"; {len(doc['missing'])} stage output(s) missing"
    return head + (f"; not passed: {', '.join(doc['failed_checks'])}" if doc["failed_checks"] else "")


# --- the declaration, and the one reader every launcher's outcome goes through -----------------------

STATUS_CODES = {"pass": EXIT_OK, "fail": EXIT_NEGATIVE, "refused": EXIT_REFUSED, "inconclusive": EXIT_REFUSED,
                "contended": EXIT_ERROR, "incomplete": EXIT_ERROR}
MAX_VERDICT_BYTES = 64 * 1024 * 1024


class Refusal(Document, frozen=True):
    message: str
    where: str | None
    hint: str | None


class VerdictCheck(Document, frozen=True):
    OPAQUE: ClassVar[dict[str, str]] = {
        "expected": "the check's threshold or intended value, in the check's own shape (a number, a digest, a list "
                    "or a table), shown to people; the status beside it is what is decided",
        "observed": "what the reducer measured for the check, in the same shape as expected, shown to people",
    }

    name: Text
    group: str
    status: Literal["pass", "fail", "refused", "not_applicable", "inconclusive", "contended"]
    expected: Any
    observed: Any
    detail: str
    offenders: list[str]


class VerdictDocument(Document, frozen=True):
    """``verdict.json``'s top level (docs/verdict-format.md).  Summaries recomputed when it is read: the
    status, the exit code and ``failed_checks`` follow from the checks and the refusal (:func:`outcome`;
    ``incomplete`` from a refusal that rests only on the ``missing`` evidence: a refusal beside it only when
    ``missing`` names the source or no replay was read), and the exit code from the status
    (:data:`STATUS_CODES`); ``admission`` from the ``inputs`` and ``exact-input`` checks, the refusal and the
    contended replays (:func:`admission`), ``comparisons.admission`` repeating it; a pass holds checks, and a
    passed check of every group its claim grades (:mod:`replayjob.artifacts.claims`), and is never ``not
    admitted``; ``summary`` is the line :func:`summary_line` writes from the document; the checks are the ones
    the reducer makes for the claim, each once (:meth:`_checks_are_the_claim_s`); ``budgets.decisions`` and
    ``budgets.bounds`` follow from the budget checks (:meth:`_budgets_are_the_checks`).  A verdict is readable
    only as the document the reducer would have written from its own checks."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "parameters": "the reduce options as given, recorded for people (each was range-checked before the reduce)",
        "inputs": "the digests and paths of what the reduce read, recorded for people and audits",
        "arms": "per-arm figures (timing, memory, knobs), the evidence behind the checks, shown to people",
        "comparisons": "per-pair comparisons (ratios, intervals), the evidence behind the checks, shown to people",
        "updates": "update geometry per replay (cosine, relative delta-L2), the evidence behind the checks",
        "budgets": "the budget decisions with their bounds, the evidence behind the budget checks",
        "in_process": "the warm in-process repeats' figures, the evidence behind their checks",
        "contention": "what contended with each replay, the evidence behind the contended status",
    }

    schema: Literal["replayjob.verdict/v2"]
    replayjob_version: Text
    claim: Literal["exact-input", "bitwise", "approximate"]
    status: Literal["pass", "fail", "refused", "inconclusive", "contended", "incomplete"]
    exit_code: Annotated[int, msgspec.Meta(ge=0, le=3)]
    summary: str
    failed_checks: list[str]
    refusal: Refusal | None
    admission: str
    parameters: dict[str, Any]
    inputs: dict[str, Any]
    arms: dict[str, Any]
    comparisons: dict[str, Any]
    updates: dict[str, Any] | None
    checks: list[VerdictCheck]
    budgets: dict[str, Any] | None = None
    in_process: dict[str, Any] | None = None
    contention: dict[str, Any] | None = None
    missing: Annotated[list[Text], msgspec.Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        if self.exit_code != STATUS_CODES[self.status]:
            raise ValueError(f"`exit_code` is {self.exit_code}, but status {self.status!r} exits "
                             f"{STATUS_CODES[self.status]}")
        checks = [{"name": c.name, "status": c.status} for c in self.checks]
        refusal = None if self.refusal is None else {"message": self.refusal.message}
        status, _, failed = outcome(checks, refusal)
        if self.status == "incomplete":
            if self.missing is None or status != "refused" or not {
                    c.name for c in self.checks if c.status == "refused"} <= MISSING_EVIDENCE_CHECKS:
                raise ValueError("status 'incomplete' needs `missing` and a refusal that rests only on it "
                                 f"(the checks give {status!r})")
        elif status != self.status:
            raise ValueError(f"`status` is {self.status!r}, but the checks and the refusal give {status!r}")
        elif self.missing is not None:
            raise ValueError(f"`missing` belongs to an incomplete verdict, not a {self.status!r} one")
        if self.failed_checks != failed:
            raise ValueError(f"`failed_checks` is {self.failed_checks!r}, but the checks give {failed!r}")
        replays = self.inputs.get("replays")
        if not isinstance(replays, list):
            raise ValueError("`inputs.replays` must be the list of the replays read (the summary counts them)")
        if self.status == "incomplete" and self.refusal is not None and self.missing is not None and replays \
                and "source" not in self.missing:
            raise ValueError("`refusal`: an incomplete verdict's refusal rests on missing evidence (`missing` "
                             "names the source, or no replay was read); a refusal of replays that are there stands "
                             "as 'refused'")
        if self.status == "pass":
            self._holds_the_claim()
        admitted = admission([{"group": c.group, "status": c.status} for c in self.checks], self.refusal is not None,
                             self.contention)
        if self.status == "pass" and self.admission == "not admitted":
            raise ValueError("`admission` is 'not admitted', but a pass passed every inputs and exact-input check")
        if self.admission != admitted:
            raise ValueError(f"`admission` is {self.admission!r}, but the checks, the refusal and the contention "
                             f"give {admitted!r}")
        if self.comparisons.get("admission") != self.admission:
            raise ValueError(f"`comparisons.admission` is {self.comparisons.get('admission')!r}, but `admission` "
                             f"is {self.admission!r} (it repeats it)")
        line = summary_line({"claim": self.claim, "status": self.status, "admission": self.admission,
                             "inputs": {"replays": replays}, "arms": self.arms, "budgets": _budgets(self.budgets),
                             "missing": self.missing, "failed_checks": self.failed_checks})
        if self.summary != line:
            raise ValueError(f"`summary` is {self.summary!r}, but the verdict gives {line!r}")
        self._checks_are_the_claim_s()
        self._budgets_are_the_checks()

    def _holds_the_claim(self) -> None:
        """A pass passed at least one check of every group its claim grades (:mod:`replayjob.artifacts.claims`)."""
        if not self.checks:
            raise ValueError("`checks` is empty, but a pass rests on the checks its claim runs")
        passed = {c.group for c in self.checks if c.status == "pass"}
        short = [g for g in claims.BY_NAME[self.claim].groups if g not in passed]
        if short:
            raise ValueError(f"`checks`: the claim {self.claim!r} grades the group(s) {', '.join(short)}, and a pass "
                             "passed no check of them")


    def _checks_are_the_claim_s(self) -> None:
        """The checks are those the reducer makes for the claim (:mod:`replayjob.artifacts.claims`): each once,
        under its name's group; the claim's own checks in its order, every one of them unless a refusal stopped the
        reducer part-way (then the first ones only; a refused check leaves out only the claim's ``unevaluated``
        ones); ``timing.uncontended`` exactly beside a ``contention`` section without a refusal;
        ``bitwise.first_divergent_module`` only beside another bitwise check that failed."""
        cl = claims.BY_NAME[self.claim]
        names = [c.name for c in self.checks]
        twice = sorted(n for n, k in Counter(names).items() if k > 1)
        if twice:
            raise ValueError(f"`checks`: {few([repr(n) for n in twice])} held more than once, but the reducer makes "
                             "each check once")
        for c in self.checks:
            group = cl.group_of(c.name)
            if group is None:
                raise ValueError(f"`checks`: {c.name!r} is no check the claim {self.claim!r} makes "
                                 "(replayjob.artifacts.claims)")
            if c.group != group:
                raise ValueError(f"`checks`: {c.name!r} is a check of group {group!r}, not {c.group!r}")
        held = [n for n in names if n in cl.checks]
        if self.refusal is None:  # the reducer ran to its end
            refused = any(c.status == "refused" for c in self.checks)
            missing = [n for n in cl.checks if n not in held and not (refused and n in cl.unevaluated)]
            if missing:
                raise ValueError(f"`checks`: the claim {self.claim!r} makes {few([repr(n) for n in missing])} "
                                 f"whenever its evidence was read, and a {self.status!r} verdict without a refusal "
                                 "holds every such check")
        for i, name in enumerate(held):
            if name != cl.checks[i]:
                raise ValueError(f"`checks`: the reducer makes the claim {self.claim!r}'s checks in one order and "
                                 f"stops only at a refusal, so {cl.checks[i]!r} comes where {name!r} is held")
        timed = self.contention is not None and self.refusal is None
        if ("timing.uncontended" in names) != timed:
            raise ValueError("`checks`: `timing.uncontended` is held exactly when the verdict has a `contention` "
                             "section and no refusal" + (", and this one has" if timed else ", and this one has not"))
        if "bitwise.first_divergent_module" in names and not any(
                c.group == "bitwise" and c.status == "fail" and c.name != "bitwise.first_divergent_module"
                for c in self.checks):
            raise ValueError("`checks`: `bitwise.first_divergent_module` explains a failed bitwise check, and no "
                             "other bitwise check failed")

    def _budgets_are_the_checks(self) -> None:
        """The budget checks (``budgets.pairing``, one ``budgets.ARM.METRIC.KIND`` per bound) and
        ``inputs.budgets_pinned`` beside a ``budgets`` section only (the pin also in a refused verdict), and the
        section's ``decisions`` (decision -> the bounds' checks, decisions sorted, bounds in order) and its
        ``bounds`` (name and decision of each) as :func:`replayjob.gate.budgets.evaluate` builds them from those
        checks."""
        names = {c.name for c in self.checks}
        bounds = [c for c in self.checks if c.group == "budgets" and c.name != "budgets.pairing"]
        if self.budgets is None:
            if bounds or "budgets.pairing" in names:
                raise ValueError("`checks`: budget checks are made with the `budgets` section, and the verdict has "
                                 "none")
            if "inputs.budgets_pinned" in names and self.status not in ("refused", "incomplete"):
                raise ValueError("`checks`: `inputs.budgets_pinned` without a `budgets` section is a refusal (a "
                                 f"pinned budget file left unread), not a {self.status!r} verdict")
            return
        if self.refusal is not None:
            raise ValueError("`budgets`: the budgets are decided once the evidence was read, and the verdict has a "
                             "refusal")
        missing = [n for n in ("inputs.budgets_pinned", "budgets.pairing") if n not in names]
        if missing:
            raise ValueError(f"`checks`: a verdict with a `budgets` section holds {' and '.join(missing)}")
        decided = [(c.name, _decision(c)) for c in bounds]
        gathered: dict[str, list[str]] = {}
        for name, decision in decided:
            gathered.setdefault(decision, []).append(name)
        want = dict(sorted(gathered.items()))
        got = self.budgets.get("decisions")
        if not isinstance(got, dict) or list(got.items()) != list(want.items()):
            raise ValueError(f"`budgets.decisions` is {got!r}, but the budget checks give {want!r}")
        rows = self.budgets.get("bounds")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("`budgets.bounds` must be the list of the bounds, one object each")
        listed = [(f"budgets.{r.get('arm')}.{r.get('metric')}.{r.get('kind')}", r.get("decision")) for r in rows]
        if listed != decided:
            raise ValueError(f"`budgets.bounds` name and decide {listed!r}, but the budget checks give {decided!r}")


# A bound's decision -> the status of its check (replayjob.gate.budgets.evaluate; its detail starts with the decision).
BUDGET_DECISIONS = {"pass": "pass", "fail": "fail", "inconclusive": "inconclusive", "refused": "refused",
                    "not_evaluated": "not_applicable", "not_measurable": "not_applicable"}


def _decision(check: VerdictCheck) -> str:
    """The decision of a bound's check: its detail's first word, which its status must follow."""
    word = check.detail.partition(":")[0]
    if BUDGET_DECISIONS.get(word) != check.status:
        raise ValueError(f"`checks`: the budget check {check.name!r} is {check.status!r} with detail "
                         f"{check.detail!r}, but a bound's check states its decision ({', '.join(BUDGET_DECISIONS)}) "
                         "and has its status")
    return word


GATE_GROUPS = ("inputs", "exact-input")  # the check groups that admit timing and memory comparisons


def admission(checks: list[dict[str, Any]], refused: bool, contention: dict[str, Any] | None) -> str:
    """The ``admission`` label (as the reducer derives it): ``not admitted`` when the evidence was refused, no
    check ran or an ``inputs`` or ``exact-input`` check did not pass (``not_applicable`` counts as passed);
    else ``not admitted (contended)`` when ``contention`` names a contended replay; else ``admitted``."""
    if refused or not checks or any(c["status"] not in ("pass", "not_applicable") for c in checks
                                    if c["group"] in GATE_GROUPS):
        return "not admitted"
    contended = (contention or {}).get("contended") or []
    if not isinstance(contended, list):
        raise ValueError("`contention.contended` must be the list of the contended replays")
    return "not admitted (contended)" if contended else "admitted"


def _budgets(section: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``budgets`` section as far as the summary line reads it (its ``decisions``: decision -> checks)."""
    if not section:
        return section
    decisions = section.get("decisions")
    if not isinstance(decisions, dict) or not all(isinstance(v, list) for v in decisions.values()):
        raise ValueError("`budgets.decisions` must map each decision to the list of its checks")
    return {"decisions": decisions}


def read_verdict(source: Path | str | bytes, *, where: str | None = None) -> Verdict:
    """The verdict at ``source`` (a file, or its bytes as a launcher handed them over: a workflow's output
    parameter, a run's ConfigMap), read strictly: JSON without duplicate keys or non-finite numbers
    (:func:`replayjob.jsonio.loads_strict`), the declared fields and types only (``false`` or ``0.0`` is no
    exit code), the status, exit code and failed checks agreeing with the checks.  Anything else is an
    :class:`IntegrityError` naming ``where`` (the file), the field and the rule.

    Example:
        >>> read_verdict(b'{"schema": "replayjob.verdict/v2", "exit_code": false}', where="wf/verdict")
        Traceback (most recent call last):
        ...
        replayjob.errors.IntegrityError: wf/verdict: field `exit_code`: expected `int`, got `bool`
    """
    if isinstance(source, bytes):
        label = where or "<verdict>"
        obj = loads_strict(source, where=label)
    else:
        label = where or str(source)
        obj = read_json(source, max_bytes=MAX_VERDICT_BYTES)
    if not isinstance(obj, dict):
        raise IntegrityError(f"a verdict is a JSON object, not {type(obj).__name__}", where=label)
    if obj.get("schema") != VERDICT_SCHEMA:
        raise IntegrityError(f"not a verdict of schema {VERDICT_SCHEMA}: schema {obj.get('schema')!r}", where=label,
                             hint="read it with the replayjob version that wrote it")
    decode(obj, VerdictDocument, where=label)
    return Verdict(Path(label), obj)


def utf8_of(text: str, where: str) -> bytes:
    """``text`` (a cluster object's string: a workflow's output, a ConfigMap's value) as UTF-8, or
    :class:`IntegrityError` naming ``where`` when it holds what UTF-8 cannot (a lone surrogate, which a JSON
    ``\\ud800`` escape in the API's answer gives)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise IntegrityError(f"not a text replayjob wrote: character {exc.start} is a lone surrogate "
                             f"({text[exc.start]!a}), which no UTF-8 file holds", where=where,
                             hint="the object was edited; read the run's verdict.json on its volume") from None


def read_verdict_text(text: str, *, where: str) -> Verdict:
    """:func:`read_verdict` of a verdict a launcher handed over as text (a workflow's output parameter, a run's
    ConfigMap)."""
    return read_verdict(utf8_of(text, where), where=where)


class _Schema(msgspec.Struct):
    """The one field :func:`is_verdict_file` reads (every other key is passed over, never built)."""

    schema: str


def is_verdict_file(path: Path) -> bool:
    """Whether ``path`` holds a JSON object of a verdict schema (any version): a file ``reduce --out`` may replace
    (the verdict need not read under today's rules; it is only known not to be evidence).  Only its ``schema`` is
    decoded: a verdict of 10,000 replays is megabytes that this question has no use for."""
    try:
        data = read_regular_bytes(path, max_bytes=DEFAULT_MAX_BYTES, what="JSON file")
        schema = msgspec.json.decode(data, type=_Schema).schema
    except (ReplayjobError, OSError, msgspec.DecodeError):  # not valid JSON, no object, no string schema
        return False
    return schema.startswith(VERDICT_SCHEMA.rsplit("/", 1)[0] + "/")


def write(path: Path, doc: dict[str, Any]) -> Verdict:
    """Write ``doc`` atomically (temp file, fsync, rename) and return the :class:`Verdict`.  The document is
    checked against its declaration first: a verdict replayjob would refuse to read is never written (a bug,
    not the input's fault: exit 3)."""
    data = pretty_bytes(doc)
    try:
        read_verdict(data, where=str(path))
    except ReplayjobError as exc:
        raise OperationalError(f"the verdict about to be written breaks its own declaration ({exc.message}): a "
                               "bug in replayjob; nothing was written", where=str(path)) from None
    atomic_write_bytes(path, data)
    return Verdict(path, doc)
