"""The layer order of replayjob's own modules, checked for every import, including those inside functions.

Each module belongs to one layer; a module may import its own layer and the layers below it, never one
above.  ``if TYPE_CHECKING:`` holds heavy third-party names for annotations only, never a replayjob
module: one imported there would be an edge these rules do not see (a hidden cycle or upward import).  The
README's file tree shows the same floors:

  core -> config -> runtime -> artifacts -> producers -> analysis -> launch -> cli (-> deprecated paths)

Two more rules keep the floors honest: no two modules import each other (directly or in a ring, imports
inside functions counted), and every import of a replayjob module is at the top of its file: only the heavy
third-party packages (:data:`HEAVY`: torch and the model stack, matplotlib) are imported late, inside the
functions that use them, so importing any replayjob module imports none of them and a command that needs no
model (``--help``, a render, a reduce) never pays for one.  Three tables load a module by name, each a
registry rather than a dependency: the CLI's ``COMMANDS`` (a command imports its own module of
``replayjob.commands`` only), the producer registry (a capture names its producer) and the public names at the
package top (PEP 562); each entry of each is checked to resolve, and to lie in the layers.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "replayjob"

# (layer, its folders under replayjob/). "." is the package's own top: the modules directly in replayjob/ (the
# core: errors, digests, JSON, files, the safetensors codec, the producer registry) but for the entry points,
# which are named as files in the cli layer.  A module's folder is its layer; a new folder belongs to none until
# it is placed here.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", (".",)),
    ("config", ("config",)),
    ("runtime", ("runtime", "model", "rl")),
    ("artifacts", ("artifacts",)),
    ("producers", ("producers",)),
    ("analysis", ("bundle", "trace", "gate", "check", "mismatch")),
    ("launch", ("launch",)),
    ("cli", ("commands", "cli.py", "__main__.py")),
    ("deprecated", ("integrations",)),  # old import paths kept for one release; nothing of replayjob imports them
)
LAYER = {name: i for i, (name, _) in enumerate(LAYERS)}


@functools.cache
def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer: its folder's, or the core's for a module directly in replayjob/ (the
    entry points aside), or None when its folder is in no layer."""
    parts = module.split(".")
    if parts[0] != "replayjob":
        return None
    top = parts[1] if len(parts) > 1 else None
    for i, (_, folders) in enumerate(LAYERS):
        if top is None and "." in folders:
            return i
        if top is not None and (top in folders or (len(parts) == 2 and f"{top}.py" in folders)):
            return i
    if top is not None and len(parts) == 2 and not (PACKAGE / top).is_dir():
        return next(i for i, (_, folders) in enumerate(LAYERS) if "." in folders)
    return None


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
    ("replayjob.artifacts.metrics", "import replayjob.gate.reducer\n", "imports replayjob.gate.reducer"),
    ("replayjob.rl.update", "def f():\n    from replayjob.producers import driver\n",
     "imports replayjob.producers.driver"),
    ("replayjob.newfolder.thing", "x = 1\n", "replayjob.newfolder.thing: in no layer"),
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


# The third-party packages imported only inside the functions that use them: the model stack (seconds to
# import, and absent from a render or a reduce that needs none of it) and the plotting library.
HEAVY = frozenset({"torch", "transformers", "peft", "trl", "accelerate", "datasets", "matplotlib"})


def deferral_violations(mods: dict[str, str], packages: set[str]) -> list[str]:
    """Every import that breaks the deferral rule: a replayjob module imported inside a function (import it at
    the top: no replayjob module imports a heavy package when it is imported, so there is nothing to defer),
    and a heavy package imported at a module's top (import it in the functions that use it; annotations
    import it under ``if TYPE_CHECKING:``)."""
    known = set(mods)
    out = []
    for m, src in sorted(mods.items()):
        for name, line, deferred in _imports(m, src, known, m in packages):
            own = name == "replayjob" or name.startswith("replayjob.")
            if deferred and own and name != m:
                out.append(f"{m}:{line} imports {name} inside a function: import it at the top")
            elif not deferred and name in HEAVY:
                out.append(f"{m}:{line} imports {name} at its top: import it inside the functions that use it")
    return out


def test_only_heavy_packages_are_imported_late() -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    assert deferral_violations(mods, packages) == []


def test_a_late_own_import_or_an_early_heavy_import_is_reported() -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    mods["replayjob.artifacts.verdict"] += ("\n\ndef _late():\n    from replayjob.digest import sha256_bytes\n"
                                       "    import torch\n    return sha256_bytes, torch\n")
    mods["replayjob.rl.batch"] = "import torch\nfrom transformers import AutoModel\n" + mods["replayjob.rl.batch"]
    mods["replayjob.artifacts.metrics"] += "\nif TYPE_CHECKING:\n    import torch\n"
    found = deferral_violations(mods, packages)
    verdict = [v for v in found if v.startswith("replayjob.artifacts.verdict:")]
    assert len(verdict) == 1 and "imports replayjob.digest inside a function" in verdict[0]  # torch late: allowed
    assert "replayjob.rl.batch:1 imports torch at its top" in "\n".join(found)
    assert "replayjob.rl.batch:2 imports transformers at its top" in "\n".join(found)
    assert not [v for v in found if v.startswith("replayjob.artifacts.metrics")]  # annotations only


# Modules another program imports for their side effect, never imported by replayjob: their import is their work.
PLUGINS = {"replayjob.producers.verl.plugin": "verl imports it by name (actor_rollout_ref.model.external_lib); "
                                          "installing the capture around verl's engine is its import",
           "replayjob.integrations.verl_hook": "the same plugin under its deprecated name"}


def test_plugins_are_imported_by_no_replayjob_module() -> None:
    known = set(modules())
    for name, path in modules().items():
        src = path.read_text()
        found = {n for n, _ in own_imports(name, src, known, path.name == "__init__.py")} & set(PLUGINS)
        assert not found, f"{name} imports {found}: a plugin is imported by the program it plugs into only"


def test_importing_every_module_imports_no_heavy_package() -> None:
    """What the source rules promise, checked on the running interpreter: every replayjob module imported in
    one fresh process (the entry points' dynamic lookups included), and no heavy package loaded."""
    names = sorted(m for m in modules() if m != "replayjob.__main__" and m not in PLUGINS)
    probe = ("import importlib, json, sys\n"
             f"for m in {names!r}:\n    importlib.import_module(m)\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:]))))\n")
    proc = subprocess.run([sys.executable, "-c", probe, *sorted(HEAVY)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == []


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
    mods["replayjob.producers.admission"] += "\n\ndef _late():\n    from replayjob.producers.builtin import admission\n"
    assert ["replayjob.producers.admission", "replayjob.producers.builtin.admission"] in import_cycles(mods, packages)


def test_every_entry_of_the_name_keyed_tables_resolves_within_the_layers() -> None:
    import importlib

    import replayjob
    from replayjob.cli import COMMANDS, handler
    from replayjob.producers import PRODUCERS

    for name, target in COMMANDS.items():  # the CLI's commands: modules of the cli layer itself
        assert layer_of(target.partition(":")[0]) == LAYER["cli"] and callable(handler(name)), target
    for name, module in PRODUCERS.items():  # producers' replay modules: in the producers' folder
        assert layer_of(module) == LAYER["producers"], module
        assert importlib.import_module(module).__name__ == module, name
    for name in replayjob.__all__:  # the public API: every name there
        assert getattr(replayjob, name) is not None, name


def private_name_imports(mods: dict[str, str]) -> list[str]:
    """Every ``from M import _name`` of replayjob code where ``_name`` is not a module: a name with a leading
    underscore is its module's own (make it public there, with a docstring, when another module needs it).
    Underscore *modules* (``commands._args``) are a package's internals and may be imported."""
    known = set(mods)
    out = []
    for m, src in sorted(mods.items()):
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("replayjob"):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and f"{node.module}.{a.name}" not in known:
                    out.append(f"{m}:{node.lineno} imports {node.module}.{a.name}")
    return out


def test_no_module_imports_another_modules_private_name() -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    assert private_name_imports(mods) == []
    planted = "\nfrom replayjob.config.load import _deepcopy\nfrom replayjob.commands import _args\n"
    mods["replayjob.artifacts.verdict"] += planted
    line = mods["replayjob.artifacts.verdict"].count("\n") - 1  # the first planted line
    assert private_name_imports(mods) == [f"replayjob.artifacts.verdict:{line} imports replayjob.config.load._deepcopy"]


def typing_only_own_imports(mods: dict[str, str]) -> list[str]:
    """Every replayjob module imported under ``if TYPE_CHECKING:`` (import it at the top: importing a replayjob
    module imports nothing heavy, so only a cycle or an upward import could be hidden there)."""
    out = []
    for m, src in sorted(mods.items()):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for n in ast.walk(node):
                    names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                        [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
                    out += [f"{m}:{n.lineno} imports {name} under TYPE_CHECKING" for name in names
                            if name == "replayjob" or name.startswith("replayjob.")]
    return out


def test_no_replayjob_module_is_imported_for_annotations_only() -> None:
    mods = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    assert typing_only_own_imports(mods) == []
    mods["replayjob.artifacts.metrics"] += ("\nif TYPE_CHECKING:\n    import torch\n"
                                  "    from replayjob.artifacts.verdict import Verdict\n")
    line = mods["replayjob.artifacts.metrics"].count("\n")  # the planted import's line; torch beside it is allowed
    assert typing_only_own_imports(mods) == [
        f"replayjob.artifacts.metrics:{line} imports replayjob.artifacts.verdict under TYPE_CHECKING"]
