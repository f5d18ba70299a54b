"""Commands that need no model never import transformers or peft (they start fast on any node), and
the commands that read JSON only (``--help``, ``diag-diff``, ``bundle inspect``, ``reduce`` for the
exact-input and bitwise claims) import no torch at all.

Each command runs in a fresh interpreter on a small valid input (a real capture, a real replay, a
synthetic bundle written by ``BundleWriter``) through ``replayjob.cli.main``; the process then
reports which of the two packages ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import replay_pins

from replayjob.cli import main

PROBE = ("import json, sys\n"
         "from replayjob.cli import main\n"
         "rc = main(sys.argv[2:])\n"
         "heavy = sorted(m for m in ('transformers', 'peft', 'trl') if m in sys.modules)\n"
         "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:5]\n"
         "open(sys.argv[1], 'w').write(json.dumps({'rc': rc, 'heavy': heavy, 'torch': torch}))\n")


@pytest.fixture(scope="module")
def inputs(workspace: Path, capture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from replayjob.bundle import synthetic

    d = tmp_path_factory.mktemp("imports")
    replays = d / "replays"
    assert main(["replay", str(workspace / "replay.toml"), "--out", str(replays / "r0"), *replay_pins(capture_dir),
                 "--trace"]) == 0
    bundle = synthetic.write_rollout(d / "bundle")
    return {"workspace": workspace, "capture": capture_dir, "replays": replays, "bundle": bundle, "scratch": d}


def _copy(src: Path, dst: Path) -> Path:
    """A second file of the same rows (diag-diff refuses a file compared with itself)."""
    dst.write_bytes(src.read_bytes())
    return dst


def _copy_tree(src: Path, dst: Path) -> Path:
    """A second replay of the same bytes (trace-diff refuses a trace compared with itself)."""
    if not dst.exists():
        shutil.copytree(src, dst)
    return dst


def _argv(label: str, i: dict[str, Path]) -> list[str]:
    cap, reps, out = i["capture"], i["replays"], i["scratch"]
    reduce = ["reduce", str(reps), "--source", str(cap), "--min-repeats", "1"]
    return {
        "--help": ["--help"],
        "diag-diff": ["diag-diff", str(cap / "diag.jsonl"), str(_copy(cap / "diag.jsonl", out / "diag-copy.jsonl"))],
        "reduce exact-input": [*reduce, "--claim", "exact-input", "--out", str(out / "exact.json")],
        "reduce bitwise": [*reduce, "--claim", "bitwise", "--out", str(out / "bitwise.json")],
        "bundle inspect": ["bundle", "inspect", str(i["bundle"])],
        "trace-diff": ["trace-diff", str(reps / "r0"), str(_copy_tree(reps / "r0", out / "r0-copy")), "--json"],
        "bundle validate": ["bundle", "validate", str(i["bundle"])],
        "explain": ["explain", str(i["workspace"] / "replay.toml"), *replay_pins(cap)],
    }[label]


def probe(argv: list[str], out: Path) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), *argv], capture_output=True, text=True,
                          timeout=300, check=False)
    assert out.is_file(), f"the probe of {argv} wrote nothing: {proc.stderr[-2000:]}"
    result: dict[str, object] = json.loads(out.read_text())
    return result


# Commands that import no torch at all: the gate that runs on every submission hashes adapters as files and
# reads metrics (torch is about 1.5 s of imports on a 2-core machine), and the others read JSON only.
TORCH_FREE = ("--help", "diag-diff", "reduce exact-input", "reduce bitwise", "bundle inspect")


@pytest.mark.parametrize("label", ["--help", "diag-diff", "reduce exact-input", "reduce bitwise", "bundle inspect",
                                   "bundle validate", "explain", "trace-diff"])
def test_command_imports_neither_transformers_nor_peft(label: str, inputs: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """Each command on a valid input (a real capture and a real replay): no model code, and no torch for the
    commands of :data:`TORCH_FREE`."""
    result = probe(_argv(label, inputs), tmp_path / "probe.json")
    assert result["rc"] == 0, f"{label} did not accept its valid input (exit {result['rc']})"
    assert result["heavy"] == [], f"replayjob {label} imported {result['heavy']}"
    if label in TORCH_FREE:
        assert result["torch"] == [], f"replayjob {label} imported {result['torch']}"


def test_explain_of_a_trl_capture_imports_no_framework(trl_capture: dict[str, object], tmp_path: Path) -> None:
    """explain of an external trainer's capture uses the framework module's contract, not the framework."""
    result = probe(["explain", str(trl_capture["dir"] / "replay.toml")], tmp_path / "probe.json")  # type: ignore[operator]
    assert result["rc"] == 0 and result["heavy"] == []


def test_refused_input_imports_neither(inputs: dict[str, Path], tmp_path: Path) -> None:
    """A refusal path (explain without its pins) stays light too."""
    result = probe(["explain", str(inputs["workspace"] / "replay.toml")], tmp_path / "probe.json")
    assert result["rc"] == 2
    assert result["heavy"] == []


BOUNDARY = ("import json, sys, importlib\n"
            "out = {}\n"
            "for name in sys.argv[1:]:\n"
            "    before = set(sys.modules)\n"
            "    importlib.import_module(name)\n"
            "    out[name] = sorted(m for m in set(sys.modules) - before if m.startswith('replayjob.'))\n"
            "print(json.dumps(out))\n")


def _imports_of(*modules: str) -> dict[str, list[str]]:
    """For each module, in a fresh interpreter, the replayjob modules importing it loads (first import)."""
    result: dict[str, list[str]] = {}
    for name in modules:  # one interpreter per module: what one loads must not hide what another loads
        proc = subprocess.run([sys.executable, "-c", BOUNDARY, name], capture_output=True, text=True, timeout=120,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result.update(json.loads(proc.stdout))
    return result


def test_the_trainer_imports_no_capture_package_and_captures_import_the_protocol_not_the_trainer() -> None:
    """The hook protocol (replayjob.rl.hooks) is the one meeting point of trainer and captures."""
    seen = _imports_of("replayjob.producers.builtin.trainer", "replayjob.producers.builtin.capture",
                      "replayjob.bundle.hook")
    trainer = seen["replayjob.producers.builtin.trainer"]
    assert "replayjob.rl.hooks" in trainer
    # the trainer's own folder holds the captures: none of them (nor the capture API, nor the bundle hook) loads
    captures = [m for m in trainer if m.startswith(("replayjob.producers.", "replayjob.bundle"))
                and m not in ("replayjob.producers.builtin", "replayjob.producers.builtin.trainer")]
    assert captures == [], trainer
    source = (Path(__file__).resolve().parents[1] / "replayjob" / "producers" / "builtin" / "trainer.py").read_text()
    assert "replayjob.producers" not in source and "replayjob.bundle" not in source  # no lazy import either
    for capture in ("replayjob.producers.builtin.capture", "replayjob.bundle.hook"):
        assert "replayjob.rl.hooks" in seen[capture], (capture, seen[capture])
        assert "replayjob.producers.builtin.trainer" not in seen[capture], (capture, seen[capture])


def test_the_public_api_is_at_the_package_top_and_imports_nothing_heavy() -> None:
    code = ("import sys, replayjob\n"
            "assert not [m for m in ('torch', 'transformers', 'trl') if m in sys.modules], sys.modules.keys()\n"
            "assert replayjob.StepCapture.__module__ == 'replayjob.producers.api.capture'\n"
            "assert 'trl' not in sys.modules  # the capture API alone imports no framework\n"
            "from replayjob import ChosenSteps, MicroStep, Outcome, PRODUCERS, Session, Target, main, optimizer_step\n"
            "assert set(PRODUCERS) == {'replayjob', 'trl', 'torch', 'verl'}\n"
            "assert callable(main) and callable(optimizer_step)\n"
            "assert sorted(dir(replayjob)) == sorted(replayjob.__all__)\n"
            "try:\n    replayjob.nothing_here\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(("old", "name"), [("capture", "StepCapture"), ("torch_loop", "optimizer_step"),
                                           ("trl", "capture_optimizer_batch"), ("verl", "capture_actor_steps")])
def test_a_moved_public_module_keeps_its_old_path_with_a_deprecation_warning(old: str, name: str) -> None:
    """The documented import paths of the release before the producers moved still give the same objects, and
    say where they went (a DeprecationWarning naming the new module); importing them imports no framework."""
    code = ("import sys, warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            f"    from replayjob.integrations.{old} import {name} as moved\n"
            f"from replayjob import {name} as public\n"
            "assert moved is public, (moved, public)\n"
            "assert any(w.category is DeprecationWarning and 'replayjob.producers' in str(w.message) for w in seen)\n"
            "assert not [m for m in ('trl', 'verl', 'transformers') if m in sys.modules]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
