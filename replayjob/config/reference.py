"""Render the config reference (docs/config.md) from the schema's field docs."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from replayjob.config.schema import TOML_NAMES, Config


def default_text(f: dataclasses.Field[Any]) -> str:
    """A field's default as a reference table shows it (TOML spelling)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:  # pragma: no cover - every field has a default
        return "(required)"
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value).replace("'", '"')


def type_text(tp: Any) -> str:
    """A field's type as a reference table shows it."""
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None").replace("'", '"')


def reference_markdown() -> str:
    lines = ["# Config reference", "",
             "Generated from `replayjob/config/schema.py` (`python -m replayjob.config.reference`).",
             "Precedence: `--set KEY=VALUE` > the TOML file > these defaults. Unknown keys are refused.",
             "Relative paths (`resume.from`, `model.path`, `optimizer_batch.replay_path`) resolve against the",
             "config file's directory.", ""]

    def section(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        rows, subs = [], []
        for f in dataclasses.fields(cls):
            name = TOML_NAMES.get(f.name, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                subs.append((hints[f.name], f"{prefix}.{name}" if prefix else name))
                continue
            kind = type_text(hints[f.name]).replace("|", "or")
            rows.append(f"| `{name}` | `{kind}` | `{default_text(f)}` | {f.metadata['doc']} |")
        if rows:
            lines.extend([f"## [{prefix}]", "", "| key | type | default | meaning |", "|---|---|---|---|",
                          *rows, ""])
        for sub_cls, sub_prefix in subs:
            section(sub_cls, sub_prefix)

    section(Config, "")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown(), end="")
