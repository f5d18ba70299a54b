"""``replayjob init DIR``: an initial resume state and ready-to-run example configs.

Writes ``DIR/init_resume/`` (adapter initialised from the seed, the base-model reference,
``trainer_state.json`` with ``"step": -1``) and ``DIR/train.toml``, a source-trainer config that
runs on CPU with the built-in tiny model.  Other commands add their own example configs here.
"""

from __future__ import annotations

from pathlib import Path

from replayjob.artifacts.capture_manifest import REPLAY_CONFIG
from replayjob.config import load_config
from replayjob.errors import ArtifactExistsError
from replayjob.fsio import atomic_write_text, refuse_unusable_out
from replayjob.model.backend import load_backend
from replayjob.rl.state import write_state
from replayjob.runtime import determinism

INIT_DIR = "init_resume"

# The sections every example shares; a capture and its replays must agree on all of them.
_RUNTIME = """
[backend]
devices = "cpu"

[backend.options]
strict_deterministic = true
gradient_checkpointing = false

[inference]
engine = "pytorch"
"""
_TOKEN_CAP = """
[algorithm]
# Keep at most 100 of the step's 128 response tokens in the loss: exercises the token cap and,
# because whole groups no longer weigh equally, gives the first update a non-zero loss to compare.
token_cap = 100
"""
_RESUME = """
[resume]
from = "init_resume"
"""


def _training(trainer: str, max_steps: int) -> str:
    return (f'[training]\ntrainer = "{trainer}"\nseed = {{seed}}\nmax_steps = {max_steps}\n'
            "save_every = 0\n")


TRAIN_TOML = """\
# Source trainer: real GRPO steps on the built-in tiny model, CPU.
# Run: replayjob train {dir}/train.toml --out runs/train
""" + _training("grpo", 2) + _RUNTIME + _RESUME

SOURCE_TOML = """\
# Capture: one real GRPO step from the initialisation state; its optimizer batch is written
# (payload + manifest, manifest last) next to the run's metrics.
# Run: replayjob capture {dir}/source.toml --out {dir}/source
""" + _training("grpo", 1) + _RUNTIME + _TOKEN_CAP + _RESUME + """
[optimizer_batch]
capture = true
"""

REPLAY_TOML = """\
# Replay of the captured optimizer batch: one update, no dataset, environment or sampling.
# The two pins come from the capture's output (also in {dir}/source/metrics.json); pass them with
#   --set optimizer_batch.expected_logical_sha256=<optimizer/logical_batch_sha256>
#   --set optimizer_batch.expected_manifest_sha256=<optimizer_batch/manifest_sha256>
# or write them below.  A systems arm changes one registered knob and declares it, e.g.
#   --set backend.options.gradient_checkpointing=true
#   --set 'optimizer_batch.allow_config_differences=["backend.options.gradient_checkpointing"]'
# Check: replayjob explain {dir}/replay.toml --set ...
# Run:   replayjob replay {dir}/replay.toml --out {dir}/replays/baseline --repeat 3 --set ...
""" + _training("optimizer_replay", 1) + _RUNTIME + _TOKEN_CAP + _RESUME + """
[optimizer_batch]
replay_path = "source/optimizer_batch_step_000000.manifest.json"
expected_logical_sha256 = ""
expected_manifest_sha256 = ""
allow_config_differences = []
arm = ""
"""


TRAIN_CONFIG = "train.toml"  # a source-trainer config that runs on CPU with the built-in tiny model
SOURCE_CONFIG = "source.toml"  # the same, capturing its step zero

def _in_comment(text: str) -> str:
    """``text`` as a TOML comment may hold it: control characters (a newline would end the comment,
    the others are invalid there) written as their escapes; the directory is only mentioned there."""
    return "".join(c.encode("unicode_escape").decode("ascii") if (c < " " and c != "\t") or c == "\x7f" else c
                   for c in text)


def example_configs() -> dict[str, str]:
    """Example configs written next to the resume state (file name -> TOML text)."""
    return {TRAIN_CONFIG: TRAIN_TOML, SOURCE_CONFIG: SOURCE_TOML, REPLAY_CONFIG: REPLAY_TOML}


def init_workspace(directory: str | Path, seed: int, sets: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """Write the step -1 state and the example configs into ``directory``.

    ``sets`` (``--set KEY=VALUE``) shape the model the state is made for: a local model directory
    (``model.path``), the built-in model's size or dtype, the device.  Pass the same overrides to
    every later command; the state records the model reference they are checked against.
    """
    d = Path(directory)
    refuse_unusable_out(d)  # a file there failed only when the state was written (exit 3)
    state_dir = d / INIT_DIR
    if (state_dir / "trainer_state.json").exists():
        raise ArtifactExistsError("an initial resume state already exists", where=state_dir,
                                  hint="choose another directory or remove this one")
    cfg = load_config(None, [*sets, f"training.seed={seed}", "backend.options.strict_deterministic=true"])
    determinism.establish(strict=True, seed=seed)
    policy = load_backend(cfg.backend.name).build(cfg)
    determinism.mark_model_built(True)
    policy.save_adapter(state_dir)
    write_state(state_dir, -1, policy.model_reference(), {})
    written = [state_dir]
    for name, text in example_configs().items():
        path = d / name
        if path.exists():
            raise ArtifactExistsError("refusing to overwrite an existing config", where=path)
        atomic_write_text(path, text.format(seed=seed, dir=_in_comment(str(d))))
        written.append(path)
    return written
