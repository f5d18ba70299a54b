"""Shared fixtures: one tiny workspace per test session (the expensive part is built once), the golden
file convention, and the restoration of torch's global determinism controls after every test.

Markers (pyproject.toml): ``slow`` for a test that takes more than about 10 s by itself on 2 cores
(shared fixtures aside; ``pytest --durations=50`` shows them), usually because it runs a trainer,
capture, replay, chain or benchmark in fresh processes (subprocesses, torchrun, Slurm); ``gpu`` for
tests that need CUDA (skipped without it).  ``pytest -m "not slow"`` is the quick run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from replayjob.cli import main
from replayjob.producers.api import files as _files
from replayjob.runtime import determinism

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
REGEN_ENV = "REPLAYJOB_REGEN_GOLDEN"

# No test relies on the environment to see output as it is printed (the container image sets this;
# a venv on a workstation or a Slurm node does not): every subprocess a test starts runs without it.
os.environ.pop("PYTHONUNBUFFERED", None)


def assert_golden(path: Path, data: bytes) -> None:
    """``data`` must equal the committed file ``path`` byte for byte.

    The one regenerate convention: ``REPLAYJOB_REGEN_GOLDEN=1 pytest tests/...`` rewrites the file
    (on purpose, after reviewing why the bytes changed; never in CI), then compares as usual.
    """
    if os.environ.get(REGEN_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert path.is_file(), f"{path} is missing; create it on purpose with {REGEN_ENV}=1"
    assert data == path.read_bytes(), (f"{path.relative_to(REPO)} changed; review the difference, then "
                                       f"regenerate on purpose with {REGEN_ENV}=1")


_ENV_CONTROLS = ("CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE", "PYTHONHASHSEED", determinism.ENV_MATH_MODE)


def determinism_state() -> dict[str, Any]:
    """Every process-global determinism control :mod:`replayjob.runtime.determinism` may change."""
    m = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": m.allow_tf32,
        "matmul_fp16_reduced": m.allow_fp16_reduced_precision_reduction,
        "matmul_bf16_reduced": m.allow_bf16_reduced_precision_reduction,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "process_mode": determinism._process_mode,
        "env": {k: os.environ.get(k) for k in _ENV_CONTROLS},
    }


def restore_determinism(state: dict[str, Any]) -> None:
    """Put back what :func:`determinism_state` recorded."""
    torch.use_deterministic_algorithms(state["deterministic_algorithms"], warn_only=state["deterministic_warn_only"])
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    torch.backends.cudnn.allow_tf32 = state["cudnn_allow_tf32"]
    m = torch.backends.cuda.matmul
    m.allow_tf32 = state["matmul_allow_tf32"]
    m.allow_fp16_reduced_precision_reduction = state["matmul_fp16_reduced"]
    m.allow_bf16_reduced_precision_reduction = state["matmul_bf16_reduced"]
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    determinism._process_mode = state["process_mode"]
    for k, v in state["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# The controls as the session found them, before any fixture or test ran.
BASELINE = determinism_state()


@pytest.fixture(autouse=True)
def _restore_torch_determinism() -> Iterator[None]:
    """In-process captures and replays switch torch's global determinism controls on.  After every
    test they go back to the session's :data:`BASELINE` (not to the state the test started in: a
    session or module fixture set up for the test has already changed them by then), so no test
    inherits another's, or a fixture's, controls."""
    yield
    restore_determinism(BASELINE)


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


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """The Kubernetes API emulator (tests/k8s_emulator.py) on loopback, set up as `k8s submit` finds a namespace
    (examples/ablation.toml's setup applied once; stage Jobs finish at once), and a client of it; KUBECONFIG
    points at it."""
    from k8s_emulator import Cluster, kubeconfig, serve
    from kubernetes import client

    from replayjob.artifacts.spec import load_spec_text
    from replayjob.launch import k8s

    state = Cluster()
    state.running_reads = 0  # the emulated stage Jobs finish at once
    for doc in k8s.render_setup(load_spec_text(REPO / "examples" / "ablation.toml")[0]).values():
        if k8s.is_manifest(doc):
            state.add(doc)
    with serve(state) as host:
        path = tmp_path / "kubeconfig"
        path.write_text(kubeconfig(host), encoding="utf-8")
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        api = client.ApiClient(client.Configuration(host=host))
        yield state, api
        api.close()


MOE = ["--set", 'model.architecture="qwen3_moe"']  # the built-in tiny mixture-of-experts model


@pytest.fixture(scope="session")
def moe_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace of the built-in MoE model (seed 123) and its captured step in ``source/`` (its routing recorded
    in ``metrics.json``'s ``routing/steps``); shared, read-only: a test replays into directories of its own."""
    d = tmp_path_factory.mktemp("moe")
    assert main(["init", str(d), "--seed", "123", *MOE]) == 0
    assert main(["capture", str(d / "source.toml"), "--out", str(d / "source"), *MOE]) == 0
    return d


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


@pytest.fixture
def fresh_determinism_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process replays of external trainers build models without strict determinism, which marks the
    process relaxed (a later strict run is refused, as it should be in one process); each test using this
    fixture leaves the mark as it found it, as a fresh process would."""
    from replayjob.runtime import determinism

    monkeypatch.setattr(determinism, "_process_mode", determinism._process_mode)


# -- the TRL scenario (tests/test_trl.py, tests/test_imports.py); imports TRL only when used ---------

TRL_STEP = 1


def build_base(d: Path) -> Path:
    """A tiny Qwen2 from a config and a character-level tokenizer, both saved to ``d`` (nothing fetched): the
    benchmarks' builder, at the tests' hidden size."""
    from benchmarks.trl_precision_floor import build_base as build

    return build(d, hidden=32)


def reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Varies within a group (so advantages are non-zero)."""
    from benchmarks.trl_precision_floor import reward as varying

    return varying(completions, **kwargs)


def grpo(base: Path, out: Path, *, capture_step: int | None = None, max_steps: int = 3,
         train: bool = True, capture_steps: list[int] | None = None,
         callbacks: list[Any] | None = None, lora_dropout: float = 0.1, **config: Any) -> tuple[Any, Any]:
    """Build the GRPOTrainer of the scenario, optionally instrument it (``capture_step=K`` or
    ``capture_steps=[...]``) and train; return (trainer, capture).  ``config``: other GRPOConfig values."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from replayjob.producers.trl.producer import capture_optimizer_batch

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    args = GRPOConfig(output_dir=str(out / "trainer"), per_device_train_batch_size=4, num_generations=4,
                      gradient_accumulation_steps=2, num_iterations=2, beta=0.04, max_completion_length=6,
                      max_steps=max_steps, logging_steps=1, report_to=[], use_cpu=True, gradient_checkpointing=False,
                      seed=7, save_strategy="no", learning_rate=1e-2, bf16=False, disable_tqdm=True, **config)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]}),
                          processing_class=tok, callbacks=callbacks,
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
    handle = (capture_optimizer_batch(trainer, out, step=capture_step) if capture_step is not None
              else capture_optimizer_batch(trainer, out, steps=capture_steps) if capture_steps is not None else None)
    if train:
        trainer.train()
    return trainer, handle


@pytest.fixture(scope="session")
def trl_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is fetched (inherited by replay subprocesses)
    return build_base(tmp_path_factory.mktemp("trl_base"))


@pytest.fixture(scope="session")
def trl_capture(trl_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenario trained for 3 steps with step 1 captured (shared: copy before modifying)."""
    out = tmp_path_factory.mktemp("trl_capture")
    trainer, handle = grpo(trl_base, out, capture_step=TRL_STEP)
    return {"dir": out, "result": handle.result, "log": trainer.state.log_history,
            "adapter": {n: p.detach().clone() for n, p in _files.trainable_parameters(trainer.model).items()}}


@pytest.fixture(scope="session")
def trl_capture_nodrop(trl_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenario without dropout (LoRA dropout 0), loss_type "grpo", step 2 captured (the first whose rewards
    vary within a group, so its gradient is not zero): the source of the arms compared with the baseline's
    update (shared: copy before modifying)."""
    out = tmp_path_factory.mktemp("trl_capture_nodrop")
    trainer, handle = grpo(trl_base, out, capture_step=2, lora_dropout=0.0, loss_type="grpo")
    return {"dir": out, "result": handle.result, "log": trainer.state.log_history}


@pytest.fixture(scope="session")
def trl_capture_steps(trl_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`trl_capture_nodrop`'s scenario (step 2: a non-zero update) captured as a user's normal training
    process runs, without any determinism variable (its math mode, recorded in the update's contract, is
    therefore "default"): the existing capture the cluster paths replay as it is (its spec's ``[capture]``
    table, whose math mode defaults to that; shared: never modified)."""
    out = tmp_path_factory.mktemp("trl_capture_steps")
    saved = os.environ.pop(determinism.ENV_MATH_MODE, None)
    try:
        grpo(trl_base, out, capture_step=2, lora_dropout=0.0, loss_type="grpo")
    finally:
        if saved is not None:
            os.environ[determinism.ENV_MATH_MODE] = saved
    return out


def capture_spec(capture: Path, *, name: str = "trl", arms: str = '[arms.baseline]\n\n[arms.ckpt]\n'
                 '"trl.gradient_checkpointing" = true\n', pins: tuple[str, str] | None = None,
                 math_mode: str | None = None, **top: Any) -> str:
    """An ablation spec whose ``[capture]`` names ``capture`` (pinned by its metrics.json unless ``pins``; its
    ``math_mode`` when given, else none: "default"), CPU, one repeat, a local image; ``top``: other top-level keys."""
    doc = json.loads((capture / "metrics.json").read_text(encoding="utf-8"))
    logical, manifest = pins or (doc["optimizer/logical_batch_sha256"], doc["optimizer_batch/manifest_sha256"])
    head = {"name": name, "image": "replayjob:dev", "image_policy": "local", "gpu_product": "none",
            "storage_class": "local-rwx", "device": "cpu", "repeats": 1, **top}
    lines = [f"{k} = {json.dumps(v)}" for k, v in head.items()]
    lines += ["", "[capture]", f'dir = "{capture}"', f'logical_sha256 = "{logical}"',
              f'manifest_sha256 = "{manifest}"', *([f'math_mode = "{math_mode}"'] if math_mode else []), "", arms]
    return "\n".join(lines)
