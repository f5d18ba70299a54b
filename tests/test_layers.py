"""The layer order of replayjob's own modules, checked for every import, including those inside functions.

Each module belongs to one layer; a module may import its own layer and the layers below it, never one
above (imports under ``if TYPE_CHECKING:`` are annotations, not imports, and are not checked).  The
README's file tree shows the same floors:

  core -> config -> runtime -> artifacts -> producers -> analysis -> launch -> cli
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "replayjob"

# (layer, the modules in it: a dotted prefix, or "=name" for exactly that module)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("=replayjob", "replayjob.errors", "replayjob.redact", "replayjob.digest", "replayjob.jsonio",
              "replayjob.fsio", "replayjob.faults", "replayjob.streams", "replayjob.tensorfile", "replayjob.hostinfo",
              "replayjob.contention", "=replayjob.producers")),
    ("config", ("replayjob.config",)),
    ("runtime", ("replayjob.launch", "replayjob.distributed", "replayjob.determinism", "replayjob.model",
                 "replayjob.rl", "replayjob.knobs")),
    ("artifacts", ("replayjob.metrics", "replayjob.optbatch.manifest", "replayjob.optbatch.payload",
                   "replayjob.optbatch.ranks", "replayjob.integrations.manifest", "replayjob.trace.store",
                   "replayjob.deploy.schedule")),
    ("producers", ("replayjob.producers", "replayjob.optbatch", "replayjob.integrations", "replayjob.rl.trainer",
                   "replayjob.trace.recorder", "replayjob.trace.fault")),
    ("analysis", ("replayjob.bundle", "replayjob.trace", "replayjob.gate", "replayjob.check", "replayjob.mismatch")),
    ("launch", ("replayjob.deploy", "replayjob.source_run", "replayjob.workspace", "replayjob.funnel")),
    ("cli", ("replayjob.cli", "replayjob.__main__")),
)


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer (the most specific entry wins), or None when it has none."""
    best: tuple[int, int] | None = None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if e.startswith("="):
                if module == e[1:]:
                    return i
            elif (module == e or module.startswith(e + ".")) and (best is None or len(e) > best[1]):
                best = (i, len(e))
    return best[0] if best else None


def own_imports(module: str, source: str, known: set[str], is_package: bool = False) -> list[tuple[str, int]]:
    """Every replayjob module ``source`` imports (anywhere in the file, but under TYPE_CHECKING), with its line."""
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    pkg = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            if name == "replayjob" or name.startswith("replayjob."):
                parts = name.split(".")
                while len(parts) > 1 and ".".join(parts) not in known:
                    parts.pop()
                out.append((".".join(parts), node.lineno))
    return out


def violations(mods: dict[str, str], packages: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """``module:line imports target`` for every import of a higher layer (and every module with no layer)."""
    out = []
    known = set(mods)
    for module, source in sorted(mods.items()):
        mine = layer_of(module)
        if mine is None:
            out.append(f"{module}: in no layer (add it to LAYERS)")
            continue
        for target, line in own_imports(module, source, known, module in packages):
            theirs = layer_of(target)
            if target != module and theirs is not None and theirs > mine:
                out.append(f"{module}:{line} imports {target} ({LAYERS[theirs][0]} is above {LAYERS[mine][0]})")
    return out


def test_every_import_respects_the_layer_order() -> None:
    mods = modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    assert violations({m: p.read_text(encoding="utf-8") for m, p in mods.items()}, packages) == []


@pytest.mark.parametrize(("module", "source", "needle"), [
    # an upward import hidden inside a function is found as surely as one at the top
    ("replayjob.errors", "def f():\n    from replayjob.cli import main\n    return main\n",
     "replayjob.errors:2 imports replayjob.cli"),
    ("replayjob.metrics", "import replayjob.gate.reducer\n", "imports replayjob.gate.reducer"),
    ("replayjob.rl.update", "def f():\n    from replayjob.producers import driver\n",
     "imports replayjob.producers.driver"),
    ("replayjob.newthing", "x = 1\n", "replayjob.newthing: in no layer"),
])
def test_a_planted_upward_import_is_reported(module: str, source: str, needle: str) -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    mods[module] = source
    found = violations(mods)
    assert any(needle in v for v in found), found


def test_typing_only_imports_and_downward_imports_pass() -> None:
    source = ("from typing import TYPE_CHECKING\nfrom replayjob.errors import ConfigError\n"
              "if TYPE_CHECKING:\n    from replayjob.cli import main\n")
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    mods["replayjob.digest"] = source
    assert not [v for v in violations(mods) if v.startswith("replayjob.digest")]
