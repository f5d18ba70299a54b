"""The layer order of replayjob's own modules, checked for every import, including those inside functions.

Each module belongs to one layer; a module may import its own layer and the layers below it, never one
above (imports under ``if TYPE_CHECKING:`` are annotations, not imports, and are not checked).  The
README's file tree shows the same floors:

  core -> config -> runtime -> artifacts -> producers -> analysis -> launch -> cli

Two more rules keep the floors honest: no two modules import each other (directly or in a ring, imports
inside functions counted), and no replayjob module is imported inside a function except the few listed in
:data:`KNOWN_LATE`, each deferring torch from a command that starts without it; the list may only shrink.
"""

from __future__ import annotations

import ast
import functools
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


@functools.cache
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


def _imports(module: str, source: str, known: set[str] | frozenset[str], is_package: bool
             ) -> list[tuple[str, int, bool]]:
    """:func:`_imports_of`, each file parsed once per test session (the rules below read every module)."""
    return list(_imports_of(module, source, frozenset(known), is_package))


@functools.cache
def _imports_of(module: str, source: str, known: frozenset[str], is_package: bool
                ) -> tuple[tuple[str, int, bool], ...]:
    """Every module ``source`` imports (anywhere in the file, but under TYPE_CHECKING): its name (a replayjob
    module, or a third-party package's top-level name), the line, and whether the import is deferred (inside
    a function: it runs when the function is called, not when the module is imported)."""
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    deferred = {id(n) for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) for n in ast.walk(node)}
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
                name = ".".join(parts)
            else:
                name = name.split(".")[0]
            out.append((name, node.lineno, id(node) in deferred))
    return tuple(out)


def own_imports(module: str, source: str, known: set[str], is_package: bool = False) -> list[tuple[str, int]]:
    """Every replayjob module ``source`` imports (anywhere in the file, but under TYPE_CHECKING), with its line."""
    return [(name, line) for name, line, _ in _imports(module, source, known, is_package)
            if name == "replayjob" or name.startswith("replayjob.")]


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


# The third-party packages whose import is deferred to the commands that need them: the model stack (seconds
# to import, and absent from a render or a reduce that needs none of it) and the plotting library.
HEAVY = frozenset({"torch", "transformers", "peft", "trl", "accelerate", "datasets", "matplotlib"})


def heavy_modules(mods: dict[str, str], packages: set[str]) -> dict[str, str]:
    """Each replayjob module that imports a heavy package when it is imported (directly or through the modules
    and packages it imports at its top), with the heavy package it reaches first."""
    known = set(mods)
    top: dict[str, set[str]] = {}
    for m, src in mods.items():
        names = {n for n, _, deferred in _imports(m, src, known, m in packages) if not deferred}
        parents = {".".join(m.split(".")[:i]) for i in range(1, len(m.split(".")))} & known
        top[m] = (names | parents) - {m}
    found: dict[str, str] = {}

    def reach(m: str, seen: set[str]) -> str | None:
        if m in found:
            return found[m]
        for n in sorted(top.get(m, ())):
            if n in HEAVY:
                return n
        for n in sorted(top.get(m, ())):
            if n in top and n not in seen:
                hit = reach(n, seen | {n})
                if hit:
                    return hit
        return None

    for m in mods:
        hit = reach(m, {m})
        if hit:
            found[m] = hit
    return found


# The imports of replayjob's own modules that still sit inside functions, each deferring torch (and what it
# pulls in) from a command that starts without it: the CLI's dispatch (`--help`, `k8s render`, `reduce`,
# `diag-diff` import no torch), the launch steps (a render or a plan imports no torch), and the reducer's
# gradient evidence (traces are read only when a replay recorded one).  ARCHITECTURE.md allows late imports
# of heavy third-party packages only: the way to empty this list is for these targets to import torch
# inside their own functions, or to split a torch-free half from them.  A new entry fails the test, and so
# does an entry that no longer exists (the list only shrinks).
KNOWN_LATE = {
    "replayjob.cli": {"replayjob.bundle.reader", "replayjob.bundle.replay", "replayjob.bundle.report",
                      "replayjob.bundle.summary", "replayjob.mismatch", "replayjob.optbatch.replay",
                      "replayjob.producers.explain", "replayjob.source_run", "replayjob.trace.diff",
                      "replayjob.workspace"},
    "replayjob.deploy.external": {"replayjob.producers.explain"},
    "replayjob.deploy.step": {"replayjob.optbatch.replay", "replayjob.source_run", "replayjob.workspace"},
    "replayjob.gate.gradients": {"replayjob.trace.diff", "replayjob.trace.envelope", "replayjob.trace.store"},
}


def late_imports(mods: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """Each module's imports of other replayjob modules inside a function (TYPE_CHECKING ones aside)."""
    known = set(mods)
    out: dict[str, set[str]] = {}
    for m, src in mods.items():
        for name, _, deferred in _imports(m, src, known, m in packages):
            if deferred and name.startswith("replayjob") and name != m:
                out.setdefault(m, set()).add(name)
    return out


def deferral_violations(mods: dict[str, str], packages: set[str],
                        known: dict[str, set[str]] | None = None) -> list[str]:
    """Every late import of a replayjob module that is not in :data:`KNOWN_LATE`, every entry of it that no
    longer exists, and every listed one whose target pulls in no heavy package (nothing to defer)."""
    known = KNOWN_LATE if known is None else known
    heavy = heavy_modules(mods, packages)
    late = late_imports(mods, packages)
    out = []
    for m in sorted(set(late) | set(known)):
        for name in sorted(late.get(m, set()) - known.get(m, set())):
            out.append(f"{m} imports {name} inside a function: import it at the top (only heavy third-party "
                       "packages are imported late)")
        for name in sorted(known.get(m, set()) - late.get(m, set())):
            out.append(f"KNOWN_LATE lists {m} -> {name}, which is no longer a late import: drop the entry")
        for name in sorted(late.get(m, set()) & known.get(m, set())):
            if name not in heavy or m in heavy:
                out.append(f"{m} imports {name} inside a function, which defers no heavy package: import it at "
                           "the top and drop the entry")
    return out


def test_only_heavy_packages_are_imported_late() -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    assert deferral_violations(mods, packages) == []


def test_a_new_late_import_or_a_stale_entry_is_reported() -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    # a light module, and a heavy one, imported inside a function of a module not listed
    mods["replayjob.gate.verdict"] += ("\n\ndef _late():\n    from replayjob.digest import sha256_bytes\n"
                                       "    from replayjob.rl.batch import OptimizerBatch\n"
                                       "    return sha256_bytes, OptimizerBatch\n")
    found = deferral_violations(mods, packages)
    assert "replayjob.gate.verdict imports replayjob.digest inside a function" in "\n".join(found)
    assert "replayjob.gate.verdict imports replayjob.rl.batch inside a function" in "\n".join(found)
    # an entry whose late import is gone must go; a listed import of a light module defers nothing
    stale = {**KNOWN_LATE, "replayjob.funnel": {"replayjob.rl.batch"},
             "replayjob.gate.verdict": {"replayjob.digest", "replayjob.rl.batch"}}
    found = deferral_violations(mods, packages, stale)
    assert any(v.startswith("KNOWN_LATE lists replayjob.funnel -> replayjob.rl.batch, which is no longer")
               for v in found)
    assert any(v.startswith("replayjob.gate.verdict imports replayjob.digest inside a function, which defers no")
               for v in found)
    assert not any("replayjob.gate.verdict imports replayjob.rl.batch" in v for v in found)
    assert "replayjob.rl.batch" in heavy_modules(mods, packages)  # torch at its top
    assert "replayjob.digest" not in heavy_modules(mods, packages)


def import_cycles(mods: dict[str, str], packages: set[str]) -> list[list[str]]:
    """Groups of replayjob modules that import each other, directly or in a ring (every import counted,
    those inside functions included)."""
    known = set(mods)
    graph = {m: {n for n, _ in own_imports(m, src, known, m in packages) if n != m and n in known}
             for m, src in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_modules_import_each_other() -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    assert import_cycles(mods, packages) == []
    mods["replayjob.optbatch.explain"] += "\n\ndef _late():\n    from replayjob.integrations import admission\n"
    assert ["replayjob.integrations.admission", "replayjob.optbatch.explain"] in import_cycles(mods, packages)
