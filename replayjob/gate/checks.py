"""The checks behind each claim: exact-input, bitwise and approximate (seed "Evidence gates").

Each check is one rule applied to every replay (and the source run when given), reported with
its expected value, what was observed and the replays that broke it.  A check's status is
``pass``, ``fail`` (a valid negative answer, exit 1), ``refused`` (the evidence cannot support any
answer, exit 2) or ``not_applicable`` (the rule has nothing to compare; it does not change the
outcome).  Groups: ``inputs`` (admissibility of the evidence itself), ``exact-input``,
``bitwise``, ``approximate``.  Checks here read only metric files and file metadata, plus the
SHA-256 and safetensors header of adapter files for the on-disk check (hashed as files: no torch);
update geometry lives in :mod:`.updates`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from replayjob.artifacts.metrics import (
    EFFECTIVE,
    FINAL_ADAPTER,
    INITIAL_ADAPTER,
    LOGICAL,
    SOURCE_FILE,
    STEP_FINAL_ADAPTER,
)
from replayjob.gate.adapter_scans import AdapterScans, scan_all
from replayjob.gate.evidence import SKIPPED, Replay, Source, Tolerances
from replayjob.hostinfo import hardware_identity
from replayjob.runtime.knobs import BUILTIN, STACK_PREFIX, Knob, knobs_for

PASS, FAIL, REFUSED, NOT_APPLICABLE = "pass", "fail", "refused", "not_applicable"


@dataclass(frozen=True)
class Check:
    name: str
    group: str
    status: str
    expected: Any
    observed: Any
    detail: str = ""
    offenders: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "group": self.group, "status": self.status, "expected": self.expected,
                "observed": self.observed, "detail": self.detail, "offenders": list(self.offenders)}


@dataclass
class Arm:
    """The replays of one condition and what the condition intends (read after grouping).

    ``plan`` is the arm's overrides in the ablation spec (``reduce --spec``); without a spec the
    intent is what the arm's replays declare.
    """

    name: str
    replays: list[Replay] = field(default_factory=list)
    plan: dict[str, Any] | None = None

    @cached_property
    def knobs(self) -> dict[str, Any]:
        """The knobs most replays of this arm declare (ties broken by their JSON text)."""
        counts = Counter(_text(r.knobs) for r in self.replays)
        best = min(counts, key=lambda k: (-counts[k], k))
        value: dict[str, Any] = json.loads(best)
        return value

    @property
    def intent(self) -> dict[str, Any]:
        """The knob values this arm is meant to run with: the plan's, else its declared ones."""
        return self.plan if self.plan is not None else self.knobs

    def same_condition(self, source: Source | None) -> bool:
        """No intended differences, or every intended knob equals the source's value."""
        intent = self.intent
        if not intent:
            return True
        return source is not None and all(_same(source.config_value(k), v) for k, v in intent.items())

    def systems_only(self) -> bool:
        return all(k in self.registered for k in self.intent)

    @cached_property
    def framework(self) -> str:
        """The producer most replays of this arm replayed (``inputs.capture_pins`` checks each against the
        capture manifest's)."""
        counts = Counter(r.framework for r in self.replays)
        return min(counts, key=lambda k: (-counts[k], k)) if counts else BUILTIN

    @property
    def registered(self) -> dict[str, Knob]:
        """The systems-only knobs of this arm's producer."""
        return knobs_for(self.framework)

    def intended(self, source: Source | None) -> dict[str, Any]:
        """Every registered knob of the arm's producer, intended: the arm's override, else the source config's value."""
        return {k: self.intent[k] if k in self.intent else (source.config_value(k) if source else None)
                for k in sorted(self.registered)}

    def source_values(self, source: Source | None) -> dict[str, Any]:
        """Every registered knob of the arm's producer as the source ran it (what a derived knob's rule reads)."""
        return {k: source.config_value(k) if source else None for k in sorted(self.registered)}


def group_arms(replays: Iterable[Replay], plan: dict[str, dict[str, Any]] | None = None) -> dict[str, Arm]:
    """Replays grouped by arm; ``plan`` (arm -> overrides, from the ablation spec) sets each arm's intent."""
    arms: dict[str, Arm] = {}
    for r in sorted(replays, key=lambda r: (r.arm, r.repeat_index, str(r.path))):
        arms.setdefault(r.arm, Arm(r.arm, plan=None if plan is None else plan.get(r.arm, {}))).replays.append(r)
    return arms


_SCALAR_TEXT = {None: "null", True: "true", False: "false"}


def _text(value: Any) -> str:
    """``value`` as one comparable string: itself for a string, else its JSON (sorted keys); the scalars a knob
    holds, empty containers and lists of plain ASCII names (config differences) are spelled without the encoder
    (the same text, many times cheaper per replay)."""
    t = type(value)
    if t is str:
        return value
    if value is None or t is bool:
        return _SCALAR_TEXT[value]
    if t is int:
        return str(value)
    if (t is list or t is tuple or t is dict) and not value:
        return "{}" if t is dict else "[]"
    if (t is list or t is tuple) and all(type(v) is str and v.isascii() and v.isprintable() and '"' not in v
                                         and "\\" not in v for v in value):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"  # what the encoder writes: nothing to escape
    return json.dumps(value, sort_keys=True)


def _same(a: Any, b: Any) -> bool:
    """Exactly equal: the same type and value, and for a float the same sign (``-0.0`` is not ``0.0`` bit for bit),
    all the way down a mapping or sequence (Python's ``==`` reads ``false``, ``0`` and ``0.0`` as one value)."""
    t = type(a)
    if t is not type(b):
        return False
    if t is float:
        return bool(a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    if t is dict:
        return bool(a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items()))
    if t is list or t is tuple:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def agree(name: str, group: str, values: list[tuple[str, Any]], expected: Any = None, *,
          what: str = "", status_on_fail: str = FAIL) -> Check:
    """All ``values`` equal ``expected`` (or, without one, each other; the commonest is shown)."""
    counts = Counter(_text(v) for _, v in values)
    inferred = expected is None
    if inferred:
        if not counts:
            return Check(name, group, FAIL, None, {}, f"{what}: nothing to compare")
        key = min(counts, key=lambda k: (-counts[k], k))
        expected = next(v for _, v in values if _text(v) == key)
    offenders = tuple(label for label, v in values if not _same(v, expected))
    detail = what + ("; no reference given, so all must agree (the most common value is shown)"
                     if inferred else "")
    return Check(name, group, status_on_fail if offenders else PASS, expected,
                 dict(sorted(counts.items())), detail, offenders)


def same_condition_replays(arms: dict[str, Arm], source: Source | None) -> list[Replay]:
    """The replays of every arm that runs under the source's own conditions (:meth:`Arm.same_condition`)."""
    return [r for a in arms.values() if a.same_condition(source) for r in a.replays]


def _with_source(source: Source | None, attr: str, replays: list[Replay]) -> list[tuple[str, Any]]:
    vals = [("source", getattr(source, attr))] if source is not None else []
    return vals + [(r.label, getattr(r, attr)) for r in replays]


ON_DISK = "inputs.final_adapter_on_disk"
_PENDING = Check(ON_DISK, "inputs", "pending", None, None, "made by with_on_disk")


def input_checks(replays: list[Replay], arms: dict[str, Arm], source: Source | None,
                 min_repeats: int, expected_arms: tuple[str, ...] | None = None,
                 scans: AdapterScans | None = None, *, defer_on_disk: bool = False) -> list[Check]:
    """Refusing checks: the expected arms, enough repeats, one source, unique repeat indices, the adapters on disk.

    Arms are read from the metrics, so an arm whose replays all failed would be invisible; with
    ``expected_arms`` it counts as zero replays and is named.  ``scans``: the adapters already being
    hashed (:class:`AdapterScans`).  ``defer_on_disk``: the on-disk check keeps its place in the list but is
    made later, by :func:`with_on_disk` (so the other checks run while the adapters are still being hashed).
    """
    counts = {a.name: len(a.replays) for a in arms.values()}
    checks: list[Check] = []
    if expected_arms is None:
        checks.append(Check("inputs.expected_arms", "inputs", NOT_APPLICABLE, None, sorted(counts),
                            "no --arms given: the arms are whichever the metrics name", ()))
    else:
        odd = tuple(sorted(set(expected_arms) ^ set(counts)))
        checks.append(Check("inputs.expected_arms", "inputs", REFUSED if odd else PASS, sorted(expected_arms),
                            sorted(counts), "exactly the --arms named: an arm with no replay at all is "
                            "missing evidence, an unnamed arm is not part of this ablation", odd))
        counts.update({a: 0 for a in expected_arms if a not in counts})
    short = tuple(sorted(a for a, n in counts.items() if n < min_repeats))
    checks.append(Check("inputs.min_repeats", "inputs", REFUSED if short else PASS, min_repeats,
                        dict(sorted(counts.items())),
                        "fresh replays per arm; fewer cannot support a spread or a verdict", short))
    manifests = _with_source(source, "manifest", replays)
    manifests += [(f"{r.label} pin", r.pin_manifest) for r in replays]
    checks.append(agree("inputs.single_source", "inputs", manifests,
                        source.manifest if source is not None else None,
                        what="every replay (and its pin) names the same capture manifest",
                        status_on_fail=REFUSED))
    seen = Counter((r.arm, r.repeat_index) for r in replays)
    dup = tuple(sorted(r.label for r in replays if seen[(r.arm, r.repeat_index)] > 1))
    checks.append(Check("inputs.unique_repeats", "inputs", REFUSED if dup else PASS,
                        "one file per (arm, repeat_index)", {"files": len(replays), "pairs": len(seen)},
                        "the same replay counted twice would shrink the spread", dup))
    checks.append(_PENDING if defer_on_disk else on_disk_check(replays, source, scans))
    checks.append(plan_check(arms))
    return checks


def with_on_disk(checks: list[Check], replays: list[Replay], source: Source | None,
                 scans: AdapterScans | None = None) -> list[Check]:
    """``checks`` with the on-disk check :func:`input_checks` deferred made now, in its place."""
    return [on_disk_check(replays, source, scans) if c is _PENDING else c for c in checks]


def systems_only_check(arms: dict[str, Arm]) -> Check:
    """Exact-input and bitwise only: every intended difference is a registered systems-only knob of the arm's
    producer (a declared stack difference, which ``explain`` admits for an external trainer's capture, is for
    the approximate claim)."""
    unregistered = {a.name: sorted(k for k in a.intent if k not in a.registered) for a in arms.values()}
    unregistered = {k: v for k, v in unregistered.items() if v}
    stack = sorted({k for keys in unregistered.values() for k in keys if k.startswith(STACK_PREFIX)})
    if stack:  # the claim cannot apply to a version difference: refused (the approximate claim is the one for it)
        return Check("exact.systems_only", "exact-input", REFUSED, "registered systems-only knobs", unregistered,
                     f"a declared stack (version) difference ({', '.join(stack)}) cannot be judged by the exact-input "
                     "or bitwise claim, which admit systems-only knobs only: reduce these replays with --claim "
                     "approximate (and a pinned --tolerances file)",
                     tuple(r.label for a in arms.values() if a.name in unregistered for r in a.replays))
    return Check("exact.systems_only", "exact-input", FAIL if unregistered else PASS, "registered systems-only knobs",
                 unregistered, "every declared difference is a registered systems-only knob (a declared stack "
                 "difference is for the approximate claim only)",
                 tuple(r.label for a in arms.values() if a.name in unregistered for r in a.replays))


def capture_pins_check(replays: list[Replay], source: Source, capture: dict[str, Any]) -> Check:
    """The source metrics and every replay's recorded pins against the verified capture manifest.

    ``capture`` holds the manifest's own digests (``manifest``, ``payload``, ``logical``,
    ``effective``, ``initial_adapter``), its producer (``framework``: ``replayjob`` for the
    built-in trainer's manifest, else the external trainer it records) and the source update's
    ``outcome`` it seals (loss, grad_norm, final_adapter_sha256; ``None`` in a capture written
    before the seal), its row count (``rows``), its step (``step``) and the source's resolved config it pins
    (``config``): a replay whose recorded payload, manifest or logical pin names another capture, a replay of
    another producer, row count or step, or source metrics (their config and the step they name among them)
    that disagree with their manifest --
    among them the numbers the claims compare replays with, which nothing but the manifest pins --
    are refused.  The source's own manifest digest is not a row: the manifest was found and
    verified by it (a mismatch is refused before this check).
    """
    values = [(f"source {k}", getattr(source, k), capture[k]) for k in ("logical", "effective", "initial_adapter")]
    sealed = capture.get("outcome") or {}
    at = f"{SOURCE_FILE}: " + (f"{source.record}." if source.record else "")
    fields = {"source loss": at + "loss", "source grad_norm": at + "grad_norm",
              "source final_adapter": at + (f"{STEP_FINAL_ADAPTER}" if source.record else FINAL_ADAPTER)}
    values += [("source loss", source.loss, sealed.get("loss")),
               ("source grad_norm", source.grad_norm, sealed.get("grad_norm")),
               ("source final_adapter", source.final_adapter, sealed.get("final_adapter_sha256"))]
    # the source config decides which arms replay under the source's conditions and what each knob is intended
    # to be: the one the manifest pins, recorded whole
    fields["source config"] = f"{SOURCE_FILE}: config"
    values.append(("source config", source.config, capture["config"]))
    if capture["step"] in source.not_captured:  # the file says the step it captured was never captured
        fields["source steps_not_captured"] = f"{SOURCE_FILE}: optimizer_batch/steps_not_captured"
        values.append(("source steps_not_captured", list(source.not_captured),
                       [k for k in source.not_captured if k != capture["step"]]))
    if source.step is not None:  # a built-in one-step source names no step: its manifest's is step 0
        fields["source step"] = at + "step"
        values.append(("source step", source.step, capture["step"]))
    for r in replays:
        values += [(f"{r.label} manifest", r.manifest, capture["manifest"]),
                   (f"{r.label} manifest pin", r.pin_manifest, capture["manifest"]),
                   (f"{r.label} payload pin", r.pin_payload, capture["payload"]),
                   (f"{r.label} logical pin", r.pin_logical, capture["logical"]),
                   (f"{r.label} framework", r.framework, capture["framework"]),
                   (f"{r.label} rows", r.rows, capture["rows"]),
                   (f"{r.label} step", r.step, capture["step"])]
    bad = {label: {"recorded": got, "capture": want, **({"field": fields[label]} if label in fields else {})}
           for label, got, want in values if not _same(got, want)}
    return Check("inputs.capture_pins", "inputs", REFUSED if bad else PASS,
                 {"manifest": capture["manifest"], "payload_spans_sha256": capture["payload"],
                  "framework": capture["framework"], "outcome": capture.get("outcome")},
                 {"mismatched": bad}, "the source metrics (their digests, and the loss, gradient norm and final "
                 "adapter digest the claims compare with, which the manifest's outcome seals: a manifest written "
                 "before the seal pins none of them; the step they name and the config that decides the arms' "
                 "conditions) and each replay's recorded manifest and payload pins, producer, row count and step "
                 "match the capture manifest (verified against its SHA-256)", tuple(bad))


def plan_check(arms: dict[str, Arm]) -> Check:
    """With an ablation spec, every replay declares exactly its arm's planned overrides."""
    if any(a.plan is None for a in arms.values()):
        return Check("inputs.arm_plan", "inputs", NOT_APPLICABLE, None, None,
                     "no --spec given: each arm's intent is what its replays declare")
    off = tuple(r.label for a in arms.values() for r in a.replays if _text(r.knobs) != _text(a.plan))
    return Check("inputs.arm_plan", "inputs", REFUSED if off else PASS,
                 {a.name: a.plan for a in arms.values()},
                 {a.name: sorted({_text(r.knobs) for r in a.replays}) for a in arms.values()},
                 "every replay was launched with exactly its arm's overrides from the ablation spec "
                 "(an arm launched without its override is refused)", off)


def exact_input_checks(replays: list[Replay], arms: dict[str, Arm], source: Source | None) -> list[Check]:
    """The admission gate for runtime and memory comparisons."""
    g = "exact-input"
    checks: list[Check] = []
    logical = [(r.label, r.logical) for r in replays] + [(f"{r.label} pin", r.pin_logical) for r in replays]
    checks.append(agree("exact.logical_batch", g, logical, source.logical if source else None,
                        what=f"{LOGICAL} and each replay's pinned expectation"))
    checks.append(agree("exact.effective_rows", g, _with_source(source, "effective", replays),
                        source.effective if source else None,
                        what=f"{EFFECTIVE} identical everywhere"))
    checks.append(agree("exact.initial_adapter", g, _with_source(source, "initial_adapter", replays),
                        source.initial_adapter if source else None,
                        what=f"{INITIAL_ADAPTER} identical everywhere"))
    knob_vals = [(r.label, r.knobs) for a in arms.values() for r in a.replays]
    expected_knobs = {a.name: a.knobs for a in arms.values()}
    arm_text = {a.name: _text(a.knobs) for a in arms.values()}
    off = tuple(r.label for a in arms.values() for r in a.replays if _text(r.knobs) != arm_text[a.name])
    checks.append(Check("exact.arm_knobs", g, FAIL if off else PASS, expected_knobs,
                        dict(sorted(Counter(_text(v) for _, v in knob_vals).items())),
                        "every replay of an arm declares the same knob values", off))
    bad: list[str] = []
    observed: dict[str, Any] = {}
    for a in arms.values():
        declared = sorted(a.intent)
        seen = {"allowed": sorted({_text(sorted(r.allowed)) for r in a.replays}),
                "observed": sorted({_text(sorted(r.observed)) for r in a.replays})}
        observed[a.name] = seen
        bad += [r.label for r in a.replays
                if sorted(r.allowed) != declared or sorted(r.observed) != declared]
    checks.append(Check("exact.config_differences", g, FAIL if bad else PASS,
                        {a.name: sorted(a.intent) for a in arms.values()}, observed,
                        "allowed == observed config differences == the arm's intended knobs", tuple(bad)))
    missing = {r.label: sorted(set(SKIPPED) - set(r.skipped)) for r in replays}
    missing = {k: v for k, v in missing.items() if v}
    checks.append(Check("exact.skipped", g, FAIL if missing else PASS, list(SKIPPED),
                        {"missing": missing}, "every replay skipped dataset, environment, rollout, sampling",
                        tuple(missing)))
    checks.append(knobs_in_effect_check(arms, source))
    checks.append(finite_outcome_check(replays, source))
    losses = _with_source(source, "loss", same_condition_replays(arms, source))
    if len(losses) < 2:  # the check cannot be made, so the claim cannot be graded: refused, not failed
        checks.append(Check("exact.loss_same_condition", g, REFUSED, "source and same-condition replays",
                            {"members": [lbl for lbl, _ in losses],
                             "arms": {a.name: a.intent for a in arms.values()}},
                            "no same-condition replay to compare the loss with (every arm differs from the "
                            "source's conditions): add an arm that replays under the source's own conditions (no "
                            "declared knobs) and reduce it with these"))
    else:
        checks.append(agree("exact.loss_same_condition", g, losses, source.loss if source else None,
                            what="source and same-condition replays report the same loss, exactly"))
    unchanged = [r.label for r in replays if r.final_adapter == r.initial_adapter]
    checks.append(Check("exact.final_adapter_changed", g, FAIL if unchanged else PASS,
                        "a saved final adapter whose SHA-256 differs from the initial adapter",
                        {"unchanged": unchanged},
                        "differing final hashes across replays do not fail this claim (the files themselves "
                        "are hashed by inputs.final_adapter_on_disk)", tuple(sorted(unchanged))))
    return checks


def finite_outcome_check(replays: list[Replay], source: Source | None) -> Check:
    """Every replayed update ended with a finite loss and gradient norm: a knob that drives the update to NaN or
    an infinity changed the numbers, so no timing or memory comparison of it stands.  A non-finite gradient norm
    is judged only where the source recorded a finite one (a source whose norm is null may have skipped that
    step's update itself)."""
    judged = {"loss"} | ({"grad_norm"} if source is None or source.grad_norm is not None else set())
    off = {r.label: [k for k in r.nonfinite if k in judged] for r in replays}
    off = {k: v for k, v in off.items() if v}
    return Check("exact.finite_outcome", "exact-input", FAIL if off else PASS,
                 f"a finite {' and '.join(sorted(judged))} in every replay", {"nonfinite": off},
                 "an update whose loss or gradient norm is NaN or infinite (recorded null, named in "
                 "nonfinite_outcome) changed the numbers: the knob broke the update", tuple(sorted(off)))


def knobs_in_effect_check(arms: dict[str, Arm], source: Source | None) -> Check:
    """Every registered knob, as the replay observed it at run time, equals the value the arm's intended value
    implies (:meth:`replayjob.runtime.knobs.Knob.expected`, the rule the replay applies: a derived knob such as TRL's
    accumulation steps under a changed micro-batch size is expected as the replay rescaled it)."""
    expected: dict[str, Any] = {}
    per_arm: dict[str, Any] = {}
    mismatched: dict[str, Any] = {}
    for a in arms.values():
        intended, captured = a.intended(source), a.source_values(source)
        registered = a.registered  # built once per arm, not per replay and knob
        expected[a.name] = intended
        seen: dict[str, Counter[str]] = {k: Counter() for k in intended}
        for r in a.replays:
            for k, v in intended.items():
                want, got = registered[k].expected(v, r.rows, intended, captured), r.runtime.get(k)
                seen[k][_text(got)] += 1
                if not _same(got, want):
                    mismatched.setdefault(r.label, {})[k] = {"observed": got, "expected": want}
        per_arm[a.name] = {k: dict(sorted(c.items())) for k, c in seen.items()}
    observed = {"arms": per_arm, "mismatched": mismatched}
    off = tuple(mismatched)
    return Check("exact.knobs_in_effect", "exact-input", FAIL if off else PASS, expected, observed,
                 "each registered knob's value observed at run time (from the built model or the update) equals "
                 "the arm's intended value: its override (from --spec, else as declared), else the source's; "
                 "training.micro_batch_size is expected as min(value, ceil(rows / distributed.world_size))", off)


def on_disk_check(replays: list[Replay], source: Source | None, scans: AdapterScans | None = None) -> Check:
    """Recompute every final adapter's SHA-256 from its file and check its safetensors header (the one
    reader, :mod:`replayjob.tensorfile`; no tensor is built): a file that does not match, or that matches
    but is not a valid safetensors file, is refused.  ``scans``: the replays' adapters already being hashed."""
    members = [(r.label, r.final_adapter_file, r.final_adapter) for r in replays]
    if source is not None and source.final_adapter_file is not None:  # a captured step keeps only the SHA-256
        members.insert(0, ("source", source.final_adapter_file, source.final_adapter))
    paths = [m[1] for m in members]
    scanned = scan_all(paths) if scans is None else scans.take_all(paths)
    mismatched: dict[str, Any] = {}
    invalid: dict[str, str] = {}
    for (label, _path, reported), (actual, error) in zip(members, scanned, strict=True):
        if actual != reported:
            mismatched[label] = {"reported": reported, "on_disk": actual}
        elif error is not None:
            invalid[label] = error
    offenders = (*mismatched, *invalid)
    return Check(ON_DISK, "inputs", REFUSED if offenders else PASS,
                 "on-disk SHA-256 == reported final_adapter_sha256, and a valid safetensors file",
                 {"mismatched": mismatched, "invalid": invalid},
                 "an adapter file altered, truncated or missing after the run, or one that is not a valid "
                 "safetensors file, is not evidence of anything", tuple(offenders))


def bitwise_checks(replays: list[Replay], arms: dict[str, Arm], source: Source) -> list[Check]:
    """Same final adapter per arm, against the source, and across systems-only arms."""
    g = "bitwise"
    checks: list[Check] = []
    off: list[str] = []
    per_arm: dict[str, Any] = {}
    for a in arms.values():
        c = agree("", g, [(r.label, r.final_adapter) for r in a.replays])
        per_arm[a.name] = c.observed
        off += c.offenders
    # a replay's warm in-process repeats are repeats too: one that did not reproduce its loss is not repeatable
    unrepeated = sorted(r.label for r in replays if r.in_process_loss_equal is False)
    if unrepeated:
        per_arm = {**per_arm, "in_process_loss_differs": unrepeated}
    checks.append(Check("bitwise.final_within_arm", g, FAIL if off or unrepeated else PASS,
                        "one final adapter SHA-256 per arm", per_arm,
                        "repeated identical replays (and every replay's in-process repeats reproduced its loss bit for "
                        "bit)", tuple(sorted({*off, *unrepeated}))))
    all_systems = all(a.systems_only() for a in arms.values())
    same = [r for a in arms.values() for r in a.replays] if all_systems else same_condition_replays(arms, source)
    if not same:
        checks.append(Check("bitwise.final_vs_source", g, FAIL, source.final_adapter, {},
                            "no same-condition replay to compare with the source"))
    else:
        checks.append(agree("bitwise.final_vs_source", g, _with_source(source, "final_adapter", same),
                            source.final_adapter,
                            what="source and same-condition replays (every arm when all knobs are "
                                 "systems-only) have the source's final adapter SHA-256"))
    checks.append(grad_norm_check(arms, source))
    if len(arms) < 2 or not all_systems:
        why = ("only one arm" if len(arms) < 2 else "an arm declares a knob that is not systems-only: "
               + ", ".join(sorted({k for a in arms.values() for k in a.intent if k not in a.registered})))
        checks.append(Check("bitwise.final_across_arms", g, NOT_APPLICABLE, "one SHA-256 across arms",
                            {}, why))
    else:
        checks.append(agree("bitwise.final_across_arms", g, [(r.label, r.final_adapter) for r in replays],
                            what="arms differ only in systems-only knobs, so all final adapters agree"))
    return checks


def grad_norm_check(arms: dict[str, Arm], source: Source) -> Check:
    """The source and every same-condition replay report the source's gradient norm, exactly.

    Same-condition replays only: an arm that changes a systems-only knob may reduce the norm in another order
    (a sharded norm, another world size) and still apply the same bits when the norm is below the clipping
    threshold, so its norm is not a bitwise claim.  ``not_applicable`` when the source recorded no finite norm
    or no arm replays under the source's conditions (``bitwise.final_vs_source`` decides the update then)."""
    name, g = "bitwise.grad_norm_same_condition", "bitwise"
    same = same_condition_replays(arms, source)
    if source.grad_norm is None or not same:
        why = ("the source recorded no finite gradient norm" if source.grad_norm is None
               else "no arm replays under the source's own conditions")
        return Check(name, g, NOT_APPLICABLE, source.grad_norm, {}, why)
    return agree(name, g, [("source", source.grad_norm)] + [(r.label, r.grad_norm) for r in same],
                 source.grad_norm, what="source and same-condition replays report the source's pre-clip gradient "
                                        "norm, exactly (the same update reduces the same gradients the same way)")


def tolerance_pin_check(replays: list[Replay], tolerances: Tolerances | None) -> Check:
    """The tolerance file's SHA-256 was pinned in every replay's config before the runs."""
    if tolerances is None:
        return Check("inputs.tolerances_pinned", "inputs", REFUSED, "a --tolerances file", None,
                     "the approximate claim needs a predeclared tolerance file")
    return agree("inputs.tolerances_pinned", "inputs", [(r.label, r.tolerances_sha256) for r in replays],
                 tolerances.sha256, what="optimizer_batch.tolerances_sha256 of every replay",
                 status_on_fail=REFUSED)


def hardware_check(replays: list[Replay], mixed_declared: bool) -> Check:
    """Every replay ran on the same hardware and image (``replayjob.hostinfo.hardware_identity``):
    refused otherwise, unless mixed hardware was declared (then reported, not enforced)."""

    values = [(r.label, hardware_identity(r.host)) for r in replays]
    if not values:
        return Check("inputs.same_hardware", "inputs", NOT_APPLICABLE, None, {}, "no replays", ())
    check = agree("inputs.same_hardware", "inputs", values, what="device, GPU product, driver, CUDA, torch "
                  "and image of every replay", status_on_fail=REFUSED)
    if mixed_declared and check.status == REFUSED:
        return Check(check.name, check.group, NOT_APPLICABLE, check.expected, check.observed,
                     "mixed hardware declared (--mixed-hardware): recorded, not enforced", check.offenders)
    return check
