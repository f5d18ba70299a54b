"""The claims a verdict can state, declared once (``verdict.json`` ``claim``; ``reduce --claim``; a spec's
``claim``).

Each :class:`Claim` says what a pass means, the check groups it grades, the checks its verdict always holds
once the evidence was read and those it may hold besides (:data:`OPTIONAL`), what it needs and where it may be
used; the verdict's reader (:class:`replayjob.artifacts.verdict.VerdictDocument`) refuses a verdict whose checks
are not these, the reducer (:mod:`replayjob.gate.reducer`) takes its rules from here, the spec
(:mod:`replayjob.artifacts.spec`) the claims a spec may run, the verdict's declaration its names, and
docs/verdict-format.md's table of claims is rendered from :func:`reference_table` (a test compares them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from replayjob.artifacts.budgets_file import KINDS, METRICS
from replayjob.errors import UsageError

# The checks the reducer (replayjob.gate.reducer._evaluate) always makes once it has read the evidence, in its
# order: a refusal raised part-way (an unreadable source manifest, an unreachable initial adapter) stops it after
# a prefix of them, and the approximate claim over refused evidence stops after the update geometry's two checks
# (Claim.unevaluated: the gradient and routing checks are not made).
INPUT_CHECKS = ("inputs.expected_arms", "inputs.min_repeats", "inputs.single_source", "inputs.unique_repeats",
                "inputs.final_adapter_on_disk", "inputs.arm_plan", "inputs.same_hardware", "inputs.capture_pins")
EXACT_CHECKS = ("exact.logical_batch", "exact.effective_rows", "exact.initial_adapter", "exact.arm_knobs",
                "exact.config_differences", "exact.skipped", "exact.knobs_in_effect", "exact.finite_outcome",
                "exact.loss_same_condition",
                "exact.final_adapter_changed")
SYSTEMS_ONLY_CHECK = "exact.systems_only"  # the claims of systems-only arms (Claim.systems_only)
BITWISE_CHECKS = ("bitwise.final_within_arm", "bitwise.final_vs_source", "bitwise.grad_norm_same_condition",
                  "bitwise.final_across_arms")
APPROXIMATE_CHECKS = ("inputs.tolerances_pinned", "approximate.update_cosine", "approximate.relative_delta_l2",
                      "approximate.gradient_relative_l2", "approximate.gradient_cosine",
                      "approximate.routing_agreement")
BUDGET_BOUND = "budgets.<arm>.<metric>.<kind>"  # one check per declared bound (replayjob.gate.budgets.Bound.name)
_BOUND = re.compile(rf"budgets\.(?P<arm>.+)\.(?P<metric>{'|'.join(map(re.escape, METRICS))})"
                    rf"\.(?P<kind>{'|'.join(map(re.escape, KINDS))})")


@dataclass(frozen=True)
class OptionalCheck:
    """A check a verdict holds only sometimes, and when."""

    name: str  # BUDGET_BOUND stands for every bound's name
    group: str
    when: str  # the rule the reader applies, one sentence


OPTIONAL: dict[str, OptionalCheck] = {c.name: c for c in (
    OptionalCheck("inputs.budgets_pinned", "inputs", "with --budgets, or when a replay pinned a budget file (then "
                  "refused): held by every verdict with a `budgets` section, and by no other that is not refused"),
    OptionalCheck("budgets.pairing", "budgets", "held by every verdict with a `budgets` section (--budgets and no "
                  "refusal), and by no other"),
    OptionalCheck(BUDGET_BOUND, "budgets", "one per bound of the `budgets` section, in its order, and none without "
                  "one; `budgets.decisions` gathers them by decision"),
    OptionalCheck("timing.uncontended", "timing", "held exactly when the verdict has a `contention` section (a "
                  "replay recorded a contention probe) and no refusal"),
    OptionalCheck("bitwise.first_divergent_module", "bitwise", "bitwise claim only, beside another bitwise check "
                  "that failed (made when two traced replays' final adapters differ)"),
)}
COMMON_OPTIONAL = ("inputs.budgets_pinned", "budgets.pairing", BUDGET_BOUND, "timing.uncontended")


@dataclass(frozen=True)
class Claim:
    name: str
    states: str  # what a pass means, one sentence
    groups: tuple[str, ...]  # the check groups it grades (a verdict check's ``group``)
    needs_tolerances: bool  # a predeclared tolerance file (--tolerances), pinned before the runs
    source_step: bool  # may compare with one captured step of a several-step capture (--source-step)
    systems_only: bool  # the arms may differ only in registered systems-only knobs (exact.systems_only)
    in_spec: bool  # an ablation spec may name it (the funnel and the cluster steps reduce with it)
    checks: tuple[str, ...]  # the checks its verdict always holds once the evidence was read (in order)
    optional: tuple[str, ...]  # the checks it may hold besides (OPTIONAL says when)
    unevaluated: tuple[str, ...] = ()  # the last of ``checks``, not made when a check before them was refused

    def group_of(self, name: str) -> str | None:
        """The group of the check ``name`` in this claim's verdicts, or None when the claim makes no such check."""
        if name in self.checks:
            return CHECK_GROUPS[name]
        if name in self.optional:
            return OPTIONAL[name].group
        if BUDGET_BOUND in self.optional and _BOUND.fullmatch(name):
            return OPTIONAL[BUDGET_BOUND].group
        return None


CLAIMS: tuple[Claim, ...] = (
    Claim("exact-input", "every replay consumed exactly the captured optimizer batch under its arm's declared "
          "systems-only knobs, so timing and memory may be compared", ("inputs", "exact-input"),
          needs_tolerances=False, source_step=True, systems_only=True, in_spec=True,
          checks=(*INPUT_CHECKS, *EXACT_CHECKS, SYSTEMS_ONLY_CHECK), optional=COMMON_OPTIONAL),
    Claim("bitwise", "exact-input, and every replay's final adapter is byte for byte the source's",
          ("inputs", "exact-input", "bitwise"), needs_tolerances=False, source_step=True, systems_only=True,
          in_spec=True, checks=(*INPUT_CHECKS, *EXACT_CHECKS, SYSTEMS_ONLY_CHECK, *BITWISE_CHECKS),
          optional=(*COMMON_OPTIONAL, "bitwise.first_divergent_module")),
    Claim("approximate", "every replay consumed the captured batch, and each update lies within the pinned "
          "tolerances of the source's (a version or precision change)", ("inputs", "exact-input", "approximate"),
          needs_tolerances=True, source_step=False, systems_only=False, in_spec=False,
          checks=(*INPUT_CHECKS, *EXACT_CHECKS, *APPROXIMATE_CHECKS), optional=COMMON_OPTIONAL,
          unevaluated=APPROXIMATE_CHECKS[3:]),
)
CHECK_GROUPS: dict[str, str] = {
    **{n: "inputs" for n in INPUT_CHECKS}, **{n: "exact-input" for n in (*EXACT_CHECKS, SYSTEMS_ONLY_CHECK)},
    **{n: "bitwise" for n in BITWISE_CHECKS}, **{n: n.partition(".")[0] for n in APPROXIMATE_CHECKS},
}  # the group of every check some claim always makes
BY_NAME: dict[str, Claim] = {c.name: c for c in CLAIMS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
SPEC_NAMES: tuple[str, ...] = tuple(c.name for c in CLAIMS if c.in_spec)


def claim(name: str) -> Claim:
    """The claim called ``name``, or refused (exit 2) listing the claims."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UsageError(f"unknown claim {name!r}; use one of {', '.join(NAMES)}") from None


def reference_table() -> str:
    """The claims as docs/verdict-format.md shows them (Markdown)."""
    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    rows = ["| claim | a pass means | check groups | `--tolerances` | `--source-step` | systems-only arms | "
            "in a spec |", "|---|---|---|---|---|---|---|"]
    rows += [f"| `{c.name}` | {c.states} | {', '.join(f'`{g}`' for g in c.groups)} | "
             f"{'required' if c.needs_tolerances else 'refused'} | {yes(c.source_step)} | {yes(c.systems_only)} | "
             f"{yes(c.in_spec)} |" for c in CLAIMS]
    return "\n".join(rows) + "\n"
