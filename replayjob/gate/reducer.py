"""Reduce: read every replay's metrics, run the claim's checks and spread statistics, write the verdict.

The claim decides which checks run (:mod:`.checks`): ``exact-input`` is the admission gate for
timing and memory comparisons; ``bitwise`` adds identical final adapters (and needs ``--source``);
``approximate`` adds predeclared update tolerances (and needs ``--source`` and ``--tolerances``).
Spread statistics are always computed; ratios against ``--baseline`` are labelled "not admitted"
when the exact-input gate does not pass.  A refusal still writes a verdict with status
``refused`` whenever the output path is writable.  The report and plot are written before the
verdict, which is written last.

With ``--budgets`` (any claim), :mod:`.budgets` decides each declared bound once timing is
admitted and adds a ``budgets`` section and one check per bound; an undecided bound makes the
verdict ``inconclusive``.

Timing from a replay whose contention probe (:mod:`replayjob.runtime.contention_probe`, ``contention`` in its
metrics) says ``contended`` is never admitted: the ``contention`` section names those replays, the
timing ratios lose their intervals, time bounds are ``not_evaluated`` and, where a time bound would
have been decided on them, the check ``timing.uncontended`` makes the verdict ``contended`` (exit 3).

The exact-input and bitwise claims import neither torch nor transformers nor peft.
"""

from __future__ import annotations

import gc
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.artifacts import api_manifest as imanifest
from replayjob.artifacts import capture_reader as manifests
from replayjob.artifacts import claims, verdict
from replayjob.artifacts.capture_manifest import Manifest
from replayjob.artifacts.spec import AblationSpec
from replayjob.digest import sha256_file
from replayjob.errors import RefusedError, UsageError
from replayjob.gate import budgets as B
from replayjob.gate import checks as C
from replayjob.gate import gradients, routing, stats, updates
from replayjob.gate.adapter_scans import AdapterScans
from replayjob.gate.evidence import (
    MEASURES,
    Replay,
    Source,
    Tolerances,
    discover_listed,
    read_replay,
    read_source,
    read_tolerances,
)
from replayjob.gate.report import report_files, write_report, written_here
from replayjob.runtime.contention_probe import THRESHOLDS

IN_PROCESS_METRIC = "in_process_train_wall_s"  # the median of a replay's measured in-process updates


@dataclass(frozen=True)
class Request:
    paths: list[str]
    claim: str
    out: Path
    source: Path | None = None
    tolerances: Path | None = None
    min_repeats: int = 3
    baseline: str | None = None
    report: Path | None = None
    arms: tuple[str, ...] | None = None  # every arm the verdict must contain (--arms)
    mixed_hardware: bool = False  # declared: replays may differ in hardware or image (--mixed-hardware)
    spec: AblationSpec | None = None  # the ablation spec (--spec): arms and their overrides come from the plan
    budgets: Path | None = None
    max_looks: int = 1
    source_step: int | None = None  # compare with this captured step of the source run (--source-step)
    usage_error: RefusedError | None = None  # an option the command line refused: the verdict records it
    missing: tuple[str, ...] = ()  # outputs of stages that failed or never ran: the verdict is incomplete (3)
    there: tuple[str, ...] = ()  # the replay outputs that are there, read or not: a refusal beside them stands


class _State:
    """What is known so far; a refusal part-way keeps what was established."""

    def __init__(self) -> None:
        self.replays: list[Replay] = []
        self.source: Source | None = None
        self.tolerances: Tolerances | None = None
        self.initial: dict[str, Any] | None = None
        self.capture: Manifest | imanifest.Manifest | None = None  # verified against the source metrics
        self.plan: dict[str, dict[str, Any]] | None = None
        self.arms: dict[str, C.Arm] = {}
        self.checks: list[C.Check] = []
        self.updates: dict[str, Any] | None = None
        self.budgets: B.Budgets | None = None
        self.scans = AdapterScans()  # final adapters hashed while the rest is read


def _rel(path: Path, base: Path) -> str:
    p, b = os.path.abspath(path), str(base)
    below = b if b.endswith(os.sep) else b + os.sep
    if p.startswith(below):  # both absolute and normalised: what relpath returns is the rest
        return p[len(below):]
    try:
        return os.path.relpath(p, base)
    except ValueError:  # another drive: no relative form
        return p


def _evaluate(req: Request, st: _State) -> None:
    if req.usage_error is not None:
        raise req.usage_error
    cl = claims.claim(req.claim)  # its rules come from the one table (replayjob.artifacts.claims)
    if req.min_repeats < 1:
        raise UsageError("--min-repeats must be >= 1")
    if req.max_looks < 1:  # whatever other options are given: the paired comparisons divide by it
        raise UsageError("--max-looks must be >= 1")
    if req.arms is not None and (not req.arms or not all(req.arms) or len(set(req.arms)) != len(req.arms)):
        raise UsageError(f"--arms must name distinct, non-empty arms, got {','.join(req.arms)!r}",
                         hint="e.g. --arms ckpt-off,ckpt-on")
    expected_arms = req.arms
    if req.spec is not None:
        plan = {a.name: dict(a.overrides) for a in req.spec.arms}
        unplanned = [a for a in req.arms or () if a not in plan]
        if unplanned:
            raise UsageError(f"--arms names {', '.join(unplanned)}, not among the spec's arms {', '.join(plan)}",
                             hint="with --spec, --arms selects a subset of the spec's arms (or drop it: all of them)")
        expected_arms = req.arms if req.arms is not None else tuple(plan)
        st.plan = {a: plan[a] for a in expected_arms}
    for p, names in discover_listed(req.paths):
        st.replays.append(read_replay(p, listing=names))
        st.scans.start(st.replays[-1].final_adapter_file)
    st.arms = C.group_arms(st.replays, st.plan)
    if req.tolerances is not None and not cl.needs_tolerances:
        raise UsageError(f"--tolerances applies only to --claim "
                         f"{' or '.join(c.name for c in claims.CLAIMS if c.needs_tolerances)}")
    if req.source is None:  # the initial adapter and the loss are compared with the source's
        raise UsageError(f"the {req.claim} claim compares against the source run; pass --source DIR",
                         hint="--source takes the capture run's output directory")
    if cl.needs_tolerances and req.tolerances is None:
        raise UsageError(f"the {cl.name} claim needs a predeclared tolerance file: --tolerances FILE",
                         hint="pin its SHA-256 in [optimizer_batch] tolerances_sha256 before the runs")
    if req.baseline is not None and req.baseline not in st.arms and req.baseline not in (req.arms or ()):
        raise UsageError(f"baseline arm {req.baseline!r} is not among the arms: {', '.join(st.arms)}")
    if req.source_step is not None and not cl.source_step:
        raise UsageError(f"the {cl.name} claim reads the source's final adapter file, and a captured step keeps "
                         "only its SHA-256", where="--source-step",
                         hint=f"use {' or '.join(c.name for c in claims.CLAIMS if c.source_step)} for a captured "
                              "step, or capture it as a one-step run")
    st.source = read_source(req.source, req.source_step) if req.source is not None else None
    st.tolerances = read_tolerances(req.tolerances) if req.tolerances is not None else None
    _read_budgets(req, st)
    st.checks = C.input_checks(st.replays, st.arms, st.source, req.min_repeats, expected_arms, st.scans,
                               defer_on_disk=True)  # made last (reduce_evidence): the hashing overlaps the rest
    st.checks.append(C.hardware_check(st.replays, req.mixed_hardware))
    if st.source is not None:
        m = st.capture = _capture_manifest(st.source)
        st.checks.append(C.capture_pins_check(st.replays, st.source, {
            "manifest": m.sha256, "payload": m.payload_digest, "logical": m.logical_sha256,
            "effective": m.effective_sha256, "initial_adapter": m.initial_adapter_sha256,
            "framework": m.framework, "outcome": m.outcome, "rows": m.doc["rows"]["rows"], "step": m.step,
            "config": m.doc["config"]["resolved"]}))
    st.checks += C.exact_input_checks(st.replays, st.arms, st.source)
    if cl.systems_only:
        st.checks.append(C.systems_only_check(st.arms))
    if st.budgets is not None:
        st.checks.append(B.pin_check(st.replays, st.budgets))
    elif any(r.budgets_sha256 for r in st.replays):  # pinned before the runs: its bounds decide, never skipped
        st.checks.append(B.unread_pin_check(st.replays))
    if "bitwise" in cl.groups:
        assert st.source is not None
        st.checks += C.bitwise_checks(st.replays, st.arms, st.source)
        if any(c.status == C.FAIL for c in st.checks if c.group == "bitwise"):
            st.checks += gradients.localise(st.replays, st.source.final_adapter)  # when traced
    if "approximate" in cl.groups:
        st.checks = C.with_on_disk(st.checks, st.replays, st.source, st.scans)  # it decides what is evaluated
        _approximate(st)


def _read_budgets(req: Request, st: _State) -> None:
    if req.budgets is None:
        return
    st.budgets = B.read_budgets(req.budgets)
    if req.baseline is None or (st.budgets.baseline not in (None, req.baseline)):
        raise UsageError(f"budgets are ratios to a baseline arm: pass --baseline (the budget file names "
                         f"{st.budgets.baseline!r})", where=req.budgets)


def _budget_section(req: Request, st: _State, admitted: bool, base: Path,
                    contended: list[str]) -> dict[str, Any] | None:
    if st.budgets is None:
        return None
    section, checks = B.evaluate(st.budgets, st.arms, req.baseline, req.max_looks, admitted, contended)
    section["file"] = {"path": _rel(st.budgets.path, base), "sha256": st.budgets.sha256}
    st.checks += checks
    return section


def _capture_manifest(source: Source) -> Manifest | imanifest.Manifest:
    """The capture manifest the source metrics name, verified against the SHA-256 they report (its
    bytes are read and hashed once): the built-in trainer's (:mod:`replayjob.artifacts.capture_manifest`, or the
    root of a capture over ranks, :mod:`replayjob.artifacts.capture_root`) or an external trainer's
    (:mod:`replayjob.artifacts.api_manifest`), told apart by its schema after the bytes matched the pin."""

    return manifests.read(source.manifest_file, source.manifest, pin_name=f"{source.path}'s {source.manifest_pin}",
                          hint="keep the capture run's manifest next to its metrics.json, unchanged")


def _initial_adapter(source: Source, man: Manifest | imanifest.Manifest) -> Path:
    """The initial adapter pinned by the capture manifest ``man``, found with its pinned SHA-256 (an external
    trainer's adapter file sits next to its manifest)."""

    if isinstance(man, imanifest.Manifest):
        f = man.file("adapter")
        if f.is_file() and sha256_file(f) == man.initial_adapter_sha256 == source.initial_adapter:
            return f
        raise RefusedError("the initial adapter pinned by the capture manifest is missing or changed", where=f,
                           hint="keep the capture's files together")
    pinned = man.doc["initial_adapter"]
    raw = Path(str(pinned["path"])).expanduser()  # recorded by redact_path: the home directory as ~
    candidates = [raw] if raw.is_absolute() else [Path.cwd() / raw, man.path.parent / raw]
    for c in candidates:
        if c.is_file() and sha256_file(c) == pinned["sha256"] == source.initial_adapter:
            return c
    raise RefusedError(f"the initial adapter {raw} pinned by the capture manifest is not reachable with "
                       "its pinned SHA-256", where=man.path,
                       hint="run reduce where the capture's resume.from path resolves (or use absolute paths)")


def _approximate(st: _State) -> None:
    assert st.source is not None
    g = "approximate"
    st.checks.append(C.tolerance_pin_check(st.replays, st.tolerances))
    names = ("approximate.update_cosine", "approximate.relative_delta_l2")
    if any(c.status == C.REFUSED for c in st.checks):
        for name in names:
            st.checks.append(C.Check(name, g, C.FAIL, None, None, "not evaluated: the evidence above is refused"))
        return
    assert st.tolerances is not None
    assert st.capture is not None  # read with the source
    initial = _initial_adapter(st.source, st.capture)
    st.initial = {"path": initial, "sha256": st.source.initial_adapter}
    assert st.source.final_adapter_file is not None  # a captured step's source is refused above
    members = [updates.Member("source", "source", st.source.final_adapter_file)]
    members += [updates.Member(r.label, r.arm, r.final_adapter_file) for r in st.replays]
    pairs = updates.pairwise(initial, members)
    st.updates = updates.summarize(pairs)
    lo, hi = st.tolerances.update_cosine_min, st.tolerances.relative_delta_l2_max
    bad_cos, bad_rel = updates.offenders(pairs, lo, hi)
    st.checks.append(C.Check(names[0], g, C.FAIL if bad_cos else C.PASS, {"min": lo},
                             st.updates["all"]["cosine"], "pairwise update cosine within and across arms",
                             bad_cos))
    st.checks.append(C.Check(names[1], g, C.FAIL if bad_rel else C.PASS, {"max": hi},
                             st.updates["all"]["relative_delta_l2"],
                             "||u_i - u_j|| / ||u_i|| within and across arms", bad_rel))
    st.checks += gradients.approximate_checks(st.replays, st.arms)
    st.checks.append(routing.routing_check(st.replays, st.arms, st.source))


def _arm_stats(st: _State, source: Source | None) -> dict[str, Any]:
    out = {}
    for a in st.arms.values():
        out[a.name] = {
            "replays": len(a.replays), "knobs": a.knobs, "same_condition": a.same_condition(source),
            "plan": a.plan, "intended_knobs": a.intended(source),
            "stats": {m: stats.summary([r.measures[m] for r in a.replays]) for m in MEASURES},
        }
    return out


def _timing_metric(st: _State) -> str:
    """The timing a decision reads by default: the warm in-process updates where every replay ran them
    (their median per replay), else the fresh-process update."""
    replays = [r for a in st.arms.values() for r in a.replays]
    return IN_PROCESS_METRIC if replays and all(r.in_process_wall_s for r in replays) else "local_train_wall_s"


def _measures(a: C.Arm, metric: str) -> list[float]:
    return [B.metric_value(r, metric) for r in a.replays]


def _ratios(st: _State, baseline: str | None) -> dict[str, Any]:
    """Each arm's bootstrap ratios of medians to the baseline arm, per measure (the admission only words what
    :func:`_comparisons` reports of them, so they are computed while the adapters are still being hashed)."""
    ratios: dict[str, Any] = {}
    metric = _timing_metric(st)
    measures = (*MEASURES, *((IN_PROCESS_METRIC,) if metric == IN_PROCESS_METRIC else ()))
    if baseline is not None and baseline in st.arms:
        base = st.arms[baseline]
        for a in st.arms.values():
            if a.name != baseline:
                ratios[a.name] = stats.bootstrap_ratios({m: _measures(a, m) for m in measures},
                                                        {m: _measures(base, m) for m in measures})
    return ratios


def _comparisons(st: _State, baseline: str | None, admission: str, contended: list[str],
                 max_looks: int, ratios: dict[str, Any]) -> dict[str, Any]:
    metric = _timing_metric(st)
    if baseline is not None and baseline in st.arms:
        base = st.arms[baseline]
        for a in st.arms.values():
            if a.name == baseline:
                continue
            for m in B.TIME_METRICS if contended else ():
                if m in ratios[a.name]:
                    ratios[a.name][m].update(low=None, high=None, excludes_1=None,
                                             note="timing not admitted: contended replay(s) "
                                                  + verdict.few(contended))
            memory = ratios[a.name].get(B.MEMORY_METRIC)
            if memory is not None and not B.cuda_memory([*a.replays, *base.replays]):
                # A process's max RSS only grows and counts the interpreter and libraries: provenance, not
                # evidence about the arm. Its ratio is shown, never an interval that could "exclude 1".
                memory.update(low=None, high=None, excludes_1=None,
                              note="max RSS of the replay process (CPU): provenance only, no interval; "
                                   "memory is compared on CUDA's allocator peak")
    out = {"baseline": baseline, "admission": admission, "statistic": "ratio of medians (arm / baseline)",
           "ratios": ratios}
    paired = B.paired_comparisons(st.arms, baseline, metric, max_looks, admission == "admitted")
    if paired is not None:  # a paired schedule: is each comparison decided at this look's level?
        out["paired"] = paired
    return out


def _contention(st: _State, base: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The ``contention`` section (None when no replay recorded a probe) and the contended replays' labels."""
    replays = [r for a in st.arms.values() for r in a.replays]
    if not any(r.contention is not None for r in replays):
        return None, []

    bad = sorted((r for r in replays if r.contention is not None and r.contention["contended"]),
                 key=lambda r: (r.arm, r.repeat_index))
    return {"thresholds": dict(THRESHOLDS), "recorded": sum(r.contention is not None for r in replays),
            "not_recorded": [r.label for r in replays if r.contention is None],
            "contended": [{"arm": r.arm, "repeat_index": r.repeat_index, "path": _rel(r.path, base),
                           "block": None if r.slot is None else r.slot.block,
                           "reasons": list((r.contention or {})["reasons"])} for r in bad]}, [r.label for r in bad]


def _contention_check(st: _State, contended: list[str], gate_ok: bool) -> C.Check:
    """``timing.uncontended``: ``contended`` when a time bound would be decided on a contended replay."""
    time_bounds = st.budgets is not None and any(b.metric in B.TIME_METRICS for b in st.budgets.bounds)
    expected = "no replay's contention probe says contended (docs/replay-metrics.md, contention)"
    if not contended:
        return C.Check("timing.uncontended", "timing", C.PASS, expected, [], "no replay was contended")
    detail = "timing not admitted: " + ("time budgets rest on contended replays; replay those blocks again"
                                        if gate_ok and time_bounds else "no decision rests on it")
    status = B.CONTENDED if gate_ok and time_bounds else C.NOT_APPLICABLE
    return C.Check("timing.uncontended", "timing", status, expected, contended, detail, tuple(contended))


def _document(req: Request, st: _State, refusal: dict[str, Any] | None, ratios: dict[str, Any]) -> dict[str, Any]:
    base = Path(os.path.abspath(req.out)).parent
    gate_ok = refusal is None and bool(st.checks) and all(
        c.status in (C.PASS, C.NOT_APPLICABLE) for c in st.checks if c.group in ("inputs", "exact-input"))
    contention, contended = _contention(st, base)
    admission = "not admitted" if not gate_ok else "not admitted (contended)" if contended else "admitted"
    if contention is not None and refusal is None:
        st.checks.append(_contention_check(st, contended, gate_ok))
    budgets = _budget_section(req, st, gate_ok, base, contended) if refusal is None else None
    tol = st.tolerances
    parameters = {
        "min_repeats": req.min_repeats, "baseline": req.baseline,
        "arms": list(req.arms) if req.arms is not None else None,
        "spec": None if st.plan is None else {"name": req.spec.name if req.spec else None, "arms": st.plan},
        "bootstrap": {"seed": stats.BOOTSTRAP_SEED, "resamples": stats.BOOTSTRAP_RESAMPLES,
                      "confidence": stats.CONFIDENCE, "interval": "percentile"},
        "tolerances": None if tol is None else {"update_cosine_min": tol.update_cosine_min,
                                                "relative_delta_l2_max": tol.relative_delta_l2_max},
    }
    inputs = {
        "replays": [{"path": _rel(r.path, base), "sha256": r.sha256, "arm": r.arm,
                     "repeat_index": r.repeat_index, "measures": r.measures}
                    for a in st.arms.values() for r in a.replays],
        "source": None if st.source is None else {"path": _rel(st.source.path, base), "sha256": st.source.sha256},
        "tolerances": None if tol is None else {"path": _rel(tol.path, base), "sha256": tol.sha256},
        "initial_adapter": None if st.initial is None else {
            "path": _rel(st.initial["path"], base), "sha256": st.initial["sha256"]},
    }
    ip = {a.name: [w for r in a.replays for w in (r.in_process_wall_s or ())] for a in st.arms.values()}
    in_process = None
    if any(ip.values()):  # in-process repeats, reported apart from the fresh-process ones
        in_process = {arm: {"local_train_wall_s": stats.summary(w) if w else None,
                            "loss_equal": all(r.in_process_loss_equal is not False for r in st.arms[arm].replays)}
                      for arm, w in ip.items()}
    doc = verdict.document(
        claim=req.claim, checks=[c.to_json() for c in st.checks], refusal=refusal, admission=admission,
        parameters=parameters, inputs=inputs, arms=_arm_stats(st, st.source),
        comparisons=_comparisons(st, req.baseline, admission, contended, req.max_looks, ratios), updates=st.updates,
        optional={**({"budgets": budgets} if st.budgets is not None else {}),  # only when budgets were requested
                  **({"contention": contention} if contention is not None else {}),  # some replay was probed
                  **({"in_process": in_process} if in_process is not None else {})})
    return doc


def _outputs_replace_only_outputs(req: Request) -> None:
    """Refuse an ``--out`` or ``--report`` (or a plot beside it) that names a file already there which reduce does
    not write: ``--out`` replaces only a verdict, ``--report`` only a report and its plots.  Anything else there
    may be evidence (a replay's metrics, rank files, final adapter, trace or routing record, the capture's manifest
    or payload, the initial adapter, a spec, a tolerance or budget file, ...); which files a reduce reads depends on
    the claim and the producer, so they are not listed: whatever is not an output of its own is left alone.  The
    two options naming one file (or two links to one) are refused too."""
    one_file = UsageError("--out and --report name the same file", where=req.out,
                          hint="give the verdict and the report files of their own")
    if req.report is not None and os.path.abspath(req.report) == os.path.abspath(req.out):
        raise one_file
    if req.report is not None and req.report.suffix.lower() == ".png":
        raise UsageError("--report names a .png file, the path its own plot would be written to", where=req.report,
                         hint="give the report a markdown name (report.md); its plot goes beside it (report.png)")
    outputs: list[tuple[str, Path, str, Any]] = [("--out", req.out, "verdict", verdict.is_verdict_file)]
    if req.report is not None:
        outputs += [("--report", p, "report" if p == req.report else "report plot",
                     lambda q, head=head: written_here(q, head)) for p, head in report_files(req.report)]
    seen: set[tuple[int, int]] = set()  # (device, inode) of each output already there
    for option, path, what, ours in outputs:  # all checked before the first is written: never a report alone
        try:
            o = os.lstat(path)
        except FileNotFoundError:  # not there yet: nothing is replaced
            continue
        except OSError as exc:  # a parent that is a file, or one that cannot be searched: no output can go there
            raise UsageError(f"{option} cannot be written at {path}: {exc.strerror}", where=path,
                             hint=f"give {option} a path in a directory you can write") from None
        if not stat.S_ISREG(o.st_mode):  # a rename would replace it (or write through it): nothing is written
            kind = ("a symbolic link" if stat.S_ISLNK(o.st_mode) else "a directory" if stat.S_ISDIR(o.st_mode)
                    else "a device, FIFO or socket")
            raise UsageError(f"{option} names {kind} at {path}, not a regular file a {what} could replace",
                             where=path, hint=f"give {option} the name of a new file (or of an earlier {what})")
        if (o.st_dev, o.st_ino) in seen:  # two names of one file (a hard link)
            raise one_file
        seen.add((o.st_dev, o.st_ino))
        if not ours(path):
            raise UsageError(f"{option} would replace {path}, which is not a {what} reduce wrote: it may be evidence",
                             where=path, hint=f"write the {option[2:]} to a new file outside the evidence (an "
                                              "earlier verdict, report or plot is replaced; nothing else is)")


def reduce_evidence(req: Request) -> verdict.Verdict:
    """Evaluate ``req.claim`` over the replays, write the report (if asked) and the verdict last.

    The cyclic garbage collector is paused meanwhile: reading thousands of replays makes millions of small
    objects that hold no reference cycle, and each full collection on the way walked every one read so far
    (about 0.3 s of 3 at 10,000 replays); what the reduce leaves behind is collected when it is resumed."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _reduce(req)
    finally:
        if enabled:
            gc.enable()


def _reduce(req: Request) -> verdict.Verdict:
    st = _State()
    refusal = None
    try:
        try:
            _evaluate(req, st)
        except RefusedError as exc:  # IntegrityError, UsageError, ... are RefusedErrors
            refusal = verdict.refusal_of(exc)
        ratios = _ratios(st, req.baseline)  # while the worker still hashes
        st.checks = C.with_on_disk(st.checks, st.replays, st.source, st.scans)
    finally:
        st.scans.close()
    _outputs_replace_only_outputs(req)
    doc = _document(req, st, refusal, ratios)
    if req.missing:  # refused for want of evidence a stage did not produce: nothing was decided (3)
        doc = verdict.incomplete(doc, req.missing, req.there)
    if req.report is not None:
        write_report(req.report, doc)
    return verdict.write(req.out, doc)
