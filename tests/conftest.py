"""Shared fixtures: one tiny workspace per test session (the expensive part is built once)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from replayjob.cli import main

REPO = Path(__file__).resolve().parents[1]


def load_corpus_module() -> ModuleType:
    """tests/corpus/make_corpus.py as a module (it is also a standalone script)."""
    spec = importlib.util.spec_from_file_location("make_corpus", REPO / "tests" / "corpus" / "make_corpus.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_corpus", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`replayjob init` run once: DIR/init_resume plus the example configs."""
    d = tmp_path_factory.mktemp("ws")
    assert main(["init", str(d), "--seed", "123"]) == 0
    return d


@pytest.fixture(scope="session")
def capture_dir(workspace: Path) -> Path:
    """`replayjob capture WS/source.toml --out WS/source` run once (where WS/replay.toml points).

    Shared by every test: copy it (shutil.copytree) before modifying anything in it.
    """
    out = workspace / "source"
    assert main(["capture", str(workspace / "source.toml"), "--out", str(out)]) == 0
    return out


def replay_pins(capture: Path) -> list[str]:
    """The two ``--set`` pins a replay of ``capture`` needs, read from its metrics.json."""
    import json

    m = json.loads((capture / "metrics.json").read_text())
    return ["--set", f"optimizer_batch.expected_logical_sha256=\"{m['optimizer/logical_batch_sha256']}\"",
            "--set", f"optimizer_batch.expected_manifest_sha256=\"{m['optimizer_batch/manifest_sha256']}\""]


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a fresh process (for end-to-end tests only)."""
    return subprocess.run([sys.executable, "-m", "replayjob", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)
