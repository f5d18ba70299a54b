"""The claims a verdict can state, declared once (``verdict.json`` ``claim``; ``reduce --claim``; a spec's
``claim``).

Each :class:`Claim` says what a pass means, the check groups it grades, what it needs and where it may be
used; the reducer (:mod:`replayjob.gate.reducer`) takes its rules from here, the spec
(:mod:`replayjob.artifacts.spec`) the claims a spec may run, the verdict's declaration its names, and
docs/verdict-format.md's table of claims is rendered from :func:`reference_table` (a test compares them).
"""

from __future__ import annotations

from dataclasses import dataclass

from replayjob.errors import UsageError


@dataclass(frozen=True)
class Claim:
    name: str
    states: str  # what a pass means, one sentence
    groups: tuple[str, ...]  # the check groups it grades (a verdict check's ``group``)
    needs_tolerances: bool  # a predeclared tolerance file (--tolerances), pinned before the runs
    source_step: bool  # may compare with one captured step of a several-step capture (--source-step)
    systems_only: bool  # the arms may differ only in registered systems-only knobs (exact.systems_only)
    in_spec: bool  # an ablation spec may name it (the funnel and the cluster steps reduce with it)


CLAIMS: tuple[Claim, ...] = (
    Claim("exact-input", "every replay consumed exactly the captured optimizer batch under its arm's declared "
          "systems-only knobs, so timing and memory may be compared", ("inputs", "exact-input"),
          needs_tolerances=False, source_step=True, systems_only=True, in_spec=True),
    Claim("bitwise", "exact-input, and every replay's final adapter is byte for byte the source's",
          ("inputs", "exact-input", "bitwise"), needs_tolerances=False, source_step=True, systems_only=True,
          in_spec=True),
    Claim("approximate", "every replay consumed the captured batch, and each update lies within the pinned "
          "tolerances of the source's (a version or precision change)", ("inputs", "exact-input", "approximate"),
          needs_tolerances=True, source_step=False, systems_only=False, in_spec=False),
)
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
