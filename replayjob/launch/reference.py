"""Render the ablation spec reference (docs/spec.md) and the budget file reference (docs/budgets.md).

``python -m replayjob.launch.reference spec|budgets`` prints either document.  Both are generated from
the code that reads the files: the field docs of :class:`~replayjob.artifacts.spec.AblationSpec` and
:class:`~replayjob.artifacts.spec.CaptureRef`, and the constants of :mod:`replayjob.gate.budgets`.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any

import msgspec

from replayjob.artifacts.pods import FIELD_DOCS
from replayjob.artifacts.spec import AblationSpec, CaptureRef
from replayjob.config.reference import default_text, type_text
from replayjob.errors import EXIT_OK, EXIT_REFUSED
from replayjob.gate.budgets import KEY_DOCS, KIND_DOCS, KINDS, MEMORY_METRIC, METRIC_DOCS, TIME_METRICS

USAGE = "usage: python -m replayjob.launch.reference spec|budgets"


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _key(name: str, hint: Any) -> tuple[str, str]:
    """The key as a file spells it, and its TOML type."""
    if typing.get_origin(hint) is tuple:
        return f"[{name}.NAME]", "tables"
    if typing.get_origin(hint) is dict or any(dataclasses.is_dataclass(a) or (
            isinstance(a, type) and issubclass(a, msgspec.Struct)) for a in typing.get_args(hint)):
        return f"[{name}]", "table"
    return name, type_text(hint).replace("|", "or")


def _table(cls: Any) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        key, kind = _key(f.name, hints[f.name])
        rows.append(f"| `{key}` | `{kind}` | `{default_text(f)}` | {f.metadata['doc']} |")
    return rows


def _required_keys(cls: Any) -> str:
    hints = typing.get_type_hints(cls)
    return ", ".join(f"`{_key(f.name, hints[f.name])[0]}`" for f in dataclasses.fields(cls) if _required(f))


def spec_markdown() -> str:
    """docs/spec.md: every key of an ablation spec and of its ``[capture]`` table."""
    lines = ["# Ablation spec reference", "",
             "Generated from `replayjob/artifacts/spec.py` "
             "(`python -m replayjob.launch.reference spec > docs/spec.md`); an example: `examples/ablation.toml`.",
             f"Unknown keys are refused. Required: {_required_keys(AblationSpec)}; every other key has the default "
             "below.", "",
             "## Top-level keys", "", *_table(AblationSpec), "",
             "## [capture]", "",
             f"Optional. Unknown keys are refused. Required: {_required_keys(CaptureRef)}.", "",
             *_table(CaptureRef), "",
             "## [pods]", "",
             "Optional: `[pods.all]` (every stage pod), `[pods.gpu]` (the GPU stages), `[pods.cpu]` (the CPU stages); "
             "each takes the keys below, with Kubernetes' own meaning. Unknown keys are refused, and so are the "
             "determinism and runtime environment, the security context and replayjob's own labels, node selector "
             "keys, volumes and mount paths (docs/cluster.md, Your cluster).", "",
             "| key | type | meaning |", "|---|---|---|",
             *(f"| `{key}` | {kind} | {doc} |" for key, (kind, doc) in FIELD_DOCS.items()), ""]
    return "\n".join(lines)


def budgets_markdown() -> str:
    """docs/budgets.md: the top-level keys, metrics and bound kinds of a budget file, and an example."""
    metrics = (*TIME_METRICS, MEMORY_METRIC)
    lines = ["# Budget file reference", "",
             "Generated from `replayjob/gate/budgets.py` "
             "(`python -m replayjob.launch.reference budgets > docs/budgets.md`).",
             "A budget file is TOML, pinned before the runs: its SHA-256 goes into `optimizer_batch.budgets_sha256` "
             "of every replay",
             "(a spec's `budgets` key does this). It declares, per arm, bounds on the ratio of a metric to the "
             "baseline arm's,",
             "decided from paired replays (docs/verdict-format.md, \"Budgets\"). Anything else is refused, naming "
             "the key.", "",
             "## Top-level keys", "", "| key | meaning |", "|---|---|",
             *(f"| `{k}` | {doc} |" for k, doc in KEY_DOCS.items()), "",
             "## [ARM]", "",
             "One table per arm bounded against the baseline (at least one bound in the file), each entry "
             f"`METRIC = {{ {KINDS[0]} = X, {KINDS[1]} = Y }}`",
             "with one or both kinds; every bound is a positive finite number, and a metric's "
             f"`{KINDS[1]}` may not exceed its `{KINDS[0]}`. A time bound is decided on every device once the "
             "timing is admitted (else it is not_evaluated).", "",
             "| metric | meaning |", "|---|---|",
             *(f"| `{m}` | {METRIC_DOCS[m]} |" for m in metrics), "",
             "| kind | meaning |", "|---|---|",
             *(f"| `{k}` | {KIND_DOCS[k]} |" for k in KINDS), "",
             "## Example", "",
             "```toml",
             'baseline = "ckpt-off"',
             "allow_cross_node = false",
             "[ckpt-on]",
             f"{metrics[0]} = {{ {KINDS[0]} = 1.35 }}",
             f"{MEMORY_METRIC} = {{ {KINDS[0]} = 0.8, {KINDS[1]} = 0.5 }}",
             "```", ""]
    return "\n".join(lines)


DOCUMENTS = {"spec": spec_markdown, "budgets": budgets_markdown}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in DOCUMENTS:
        print(USAGE, file=sys.stderr)
        return EXIT_REFUSED
    print(DOCUMENTS[args[0]](), end="")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
