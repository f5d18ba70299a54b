"""The checks behind each claim: exact-input, bitwise and approximate (seed "Evidence gates").

Each check is one rule applied to every replay (and the source run when given), reported with
its expected value, what was observed and the replays that broke it.  A check's status is
``pass``, ``fail`` (a valid negative answer, exit 1), ``refused`` (the evidence cannot support any
answer, exit 2) or ``not_applicable`` (the rule has nothing to compare; it does not change the
outcome).  Groups: ``inputs`` (admissibility of the evidence itself), ``exact-input``,
``bitwise``, ``approximate``.  Checks here read only metric files and file metadata, plus the
SHA-256 of adapter files for the on-disk check; update geometry lives in :mod:`.updates`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from replayjob.digest import sha256_file
from replayjob.errors import ReplayjobError
from replayjob.gate.evidence import GC_KEY, REQUIRED_SKIPS, Replay, Source, Tolerances
from replayjob.optbatch.knobs import KNOBS

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
    """The replays of one condition and what the condition intends (read after grouping)."""

    name: str
    replays: list[Replay] = field(default_factory=list)

    @cached_property
    def knobs(self) -> dict[str, Any]:
        """The knobs most replays of this arm declare (ties broken by their JSON text)."""
        counts = Counter(_text(r.knobs) for r in self.replays)
        best = min(counts, key=lambda k: (-counts[k], k))
        value: dict[str, Any] = json.loads(best)
        return value

    def same_condition(self, source: Source | None) -> bool:
        """No declared differences, or every declared knob equals the source's value."""
        knobs = self.knobs
        if not knobs:
            return True
        return source is not None and all(_same(source.config_value(k), v) for k, v in knobs.items())

    def systems_only(self) -> bool:
        return all(k in KNOBS for k in self.knobs)

    def intended_gc(self, source: Source | None) -> bool:
        knobs = self.knobs
        if GC_KEY in knobs:
            return bool(knobs[GC_KEY])
        value = source.config_value(GC_KEY) if source is not None else None
        return bool(value) if isinstance(value, bool) else False


def group_arms(replays: Iterable[Replay]) -> dict[str, Arm]:
    arms: dict[str, Arm] = {}
    for r in sorted(replays, key=lambda r: (r.arm, r.repeat_index, str(r.path))):
        arms.setdefault(r.arm, Arm(r.arm)).replays.append(r)
    return arms


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


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


def _with_source(source: Source | None, attr: str, replays: list[Replay]) -> list[tuple[str, Any]]:
    vals = [("source", getattr(source, attr))] if source is not None else []
    return vals + [(r.label, getattr(r, attr)) for r in replays]


def input_checks(replays: list[Replay], arms: dict[str, Arm], source: Source | None,
                 min_repeats: int, expected_arms: tuple[str, ...] | None = None) -> list[Check]:
    """Refusing checks: the expected arms, enough repeats, one source, unique repeat indices.

    Arms are read from the metrics, so an arm whose replays all failed would be invisible; with
    ``expected_arms`` it counts as zero replays and is named.
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
    return checks


def exact_input_checks(replays: list[Replay], arms: dict[str, Arm], source: Source | None) -> list[Check]:
    """The admission gate for runtime and memory comparisons."""
    g = "exact-input"
    checks: list[Check] = []
    logical = [(r.label, r.logical) for r in replays] + [(f"{r.label} pin", r.pin_logical) for r in replays]
    checks.append(agree("exact.logical_batch", g, logical, source.logical if source else None,
                        what="optimizer/logical_batch_sha256 and each replay's pinned expectation"))
    checks.append(agree("exact.effective_rows", g, _with_source(source, "effective", replays),
                        source.effective if source else None,
                        what="optimizer/local_effective_rows_sha256 identical everywhere"))
    checks.append(agree("exact.initial_adapter", g, _with_source(source, "initial_adapter", replays),
                        source.initial_adapter if source else None,
                        what="optimizer_batch/initial_adapter_sha256 identical everywhere"))
    knob_vals = [(r.label, r.knobs) for a in arms.values() for r in a.replays]
    expected_knobs = {a.name: a.knobs for a in arms.values()}
    off = tuple(r.label for a in arms.values() for r in a.replays if _text(r.knobs) != _text(a.knobs))
    checks.append(Check("exact.arm_knobs", g, FAIL if off else PASS, expected_knobs,
                        dict(sorted(Counter(_text(v) for _, v in knob_vals).items())),
                        "every replay of an arm declares the same knob values", off))
    bad: list[str] = []
    observed: dict[str, Any] = {}
    for a in arms.values():
        declared = sorted(a.knobs)
        seen = {"allowed": sorted({_text(sorted(r.allowed)) for r in a.replays}),
                "observed": sorted({_text(sorted(r.observed)) for r in a.replays})}
        observed[a.name] = seen
        bad += [r.label for r in a.replays
                if sorted(r.allowed) != declared or sorted(r.observed) != declared]
    checks.append(Check("exact.config_differences", g, FAIL if bad else PASS,
                        {a.name: sorted(a.knobs) for a in arms.values()}, observed,
                        "allowed == observed config differences == the arm's declared knobs", tuple(bad)))
    missing = {r.label: sorted(set(REQUIRED_SKIPS) - set(r.skipped)) for r in replays}
    missing = {k: v for k, v in missing.items() if v}
    checks.append(Check("exact.skipped", g, FAIL if missing else PASS, list(REQUIRED_SKIPS),
                        {"missing": missing}, "every replay skipped dataset, environment, rollout, sampling",
                        tuple(missing)))
    intended = {a.name: a.intended_gc(source) for a in arms.values()}
    off = tuple(r.label for a in arms.values() for r in a.replays
                if r.gradient_checkpointing is not intended[a.name])
    gc_obs = {a.name: dict(sorted(Counter(_text(r.gradient_checkpointing) for r in a.replays).items()))
              for a in arms.values()}
    checks.append(Check("exact.gradient_checkpointing", g, FAIL if off else PASS, intended, gc_obs,
                        "runtime flag read from the model equals the arm's intended value", off))
    same = [r for a in arms.values() if a.same_condition(source) for r in a.replays]
    losses = _with_source(source, "loss", same)
    if len(losses) < 2:
        checks.append(Check("exact.loss_same_condition", g, FAIL, "source and same-condition replays",
                            {"members": [lbl for lbl, _ in losses]},
                            "no same-condition replay to compare the loss with: add an arm that replays "
                            "under the source's own conditions (no declared knobs)"))
    else:
        checks.append(agree("exact.loss_same_condition", g, losses, source.loss if source else None,
                            what="source and same-condition replays report the same loss, exactly"))
    unchanged = [r.label for r in replays if r.final_adapter == r.initial_adapter]
    absent = [r.label for r in replays if not r.final_adapter_file.is_file()]
    checks.append(Check("exact.final_adapter_changed", g, FAIL if unchanged or absent else PASS,
                        "a saved final adapter whose SHA-256 differs from the initial adapter",
                        {"unchanged": unchanged, "missing_file": absent},
                        "differing final hashes across replays do not fail this claim",
                        tuple(sorted(set(unchanged + absent)))))
    return checks


def _disk_sha(path: Path) -> str | None:
    """SHA-256 of a regular file (devices and FIFOs refused); ``None`` when unreadable."""
    try:
        return sha256_file(path)
    except ReplayjobError:
        return None


def on_disk_check(group: str, replays: list[Replay], source: Source | None) -> Check:
    """Recompute every final adapter's SHA-256 and compare it with the reported one."""
    members: list[tuple[str, Path, str]] = [(r.label, r.final_adapter_file, r.final_adapter) for r in replays]
    if source is not None:
        members.insert(0, ("source", source.final_adapter_file, source.final_adapter))
    mismatched: dict[str, Any] = {}
    for label, path, reported in members:
        actual = _disk_sha(path)
        if actual != reported:
            mismatched[label] = {"reported": reported, "on_disk": actual}
    return Check(f"{group}.final_adapter_on_disk", group, FAIL if mismatched else PASS,
                 "on-disk SHA-256 == reported final_adapter_sha256", {"mismatched": mismatched},
                 "an adapter file altered, truncated or missing after the run", tuple(mismatched))


def bitwise_checks(replays: list[Replay], arms: dict[str, Arm], source: Source) -> list[Check]:
    """Same final adapter per arm, against the source, and across systems-only arms."""
    g = "bitwise"
    checks = [on_disk_check(g, replays, source)]
    off: list[str] = []
    per_arm: dict[str, Any] = {}
    for a in arms.values():
        c = agree("", g, [(r.label, r.final_adapter) for r in a.replays])
        per_arm[a.name] = c.observed
        off += c.offenders
    checks.append(Check("bitwise.final_within_arm", g, FAIL if off else PASS,
                        "one final adapter SHA-256 per arm", per_arm, "repeated identical replays", tuple(off)))
    all_systems = all(a.systems_only() for a in arms.values())
    same = [r for a in arms.values() if all_systems or a.same_condition(source) for r in a.replays]
    if not same:
        checks.append(Check("bitwise.final_vs_source", g, FAIL, source.final_adapter, {},
                            "no same-condition replay to compare with the source"))
    else:
        checks.append(agree("bitwise.final_vs_source", g, _with_source(source, "final_adapter", same),
                            source.final_adapter,
                            what="source and same-condition replays (every arm when all knobs are "
                                 "systems-only) have the source's final adapter SHA-256"))
    if len(arms) < 2 or not all_systems:
        why = ("only one arm" if len(arms) < 2 else "an arm declares a knob that is not systems-only: "
               + ", ".join(sorted({k for a in arms.values() for k in a.knobs if k not in KNOBS})))
        checks.append(Check("bitwise.final_across_arms", g, NOT_APPLICABLE, "one SHA-256 across arms",
                            {}, why))
    else:
        checks.append(agree("bitwise.final_across_arms", g, [(r.label, r.final_adapter) for r in replays],
                            what="arms differ only in systems-only knobs, so all final adapters agree"))
    return checks


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
    from replayjob.hostinfo import hardware_identity

    values = [(r.label, hardware_identity(r.host)) for r in replays]
    if not values:
        return Check("inputs.same_hardware", "inputs", NOT_APPLICABLE, None, {}, "no replays", ())
    check = agree("inputs.same_hardware", "inputs", values, what="device, GPU product, driver, CUDA, torch "
                  "and image of every replay", status_on_fail=REFUSED)
    if mixed_declared and check.status == REFUSED:
        return Check(check.name, check.group, NOT_APPLICABLE, check.expected, check.observed,
                     "mixed hardware declared (--mixed-hardware): recorded, not enforced", check.offenders)
    return check
