"""Config: strict typing, --set overrides, canonical digest, the seed document's examples."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayjob.cli import main
from replayjob.config import config_sha256, load_config, resolved
from replayjob.errors import ConfigError

SOURCE_EXAMPLE = """
[training]
trainer = "grpo"
seed = 123
max_steps = 1
save_every = 0

[backend]
devices = "cpu"

[backend.options]
strict_deterministic = true

[inference]
engine = "pytorch"

[resume]
from = "run_logs/init_resume"

[optimizer_batch]
capture = true
"""

REPLAY_EXAMPLE = """
[training]
trainer = "optimizer_replay"
max_steps = 1
save_every = 0

[optimizer_batch]
replay_path = "run_logs/source/optimizer_batch_step_000000.manifest.json"
expected_logical_sha256 = "<64-character digest from the source run>"
expected_manifest_sha256 = "<64-character manifest digest from the source run>"
allow_config_differences = ["backend.options.gradient_checkpointing"]

[backend.options]
strict_deterministic = true
gradient_checkpointing = false
"""


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_seed_examples_parse(tmp_path: Path) -> None:
    src = load_config(write(tmp_path, SOURCE_EXAMPLE))
    assert src.training.trainer == "grpo" and src.optimizer_batch.capture
    assert src.backend.options.strict_deterministic and src.training.seed == 123
    # relative paths resolve against the config file's directory
    assert src.resume.from_ == str((tmp_path / "run_logs/init_resume").resolve())
    with pytest.raises(ConfigError, match="explicit non-negative seed"):
        load_config(write(tmp_path, REPLAY_EXAMPLE))  # the seed's replay example omits the seed
    rep = load_config(write(tmp_path, REPLAY_EXAMPLE), ["training.seed=123"])
    assert rep.optimizer_batch.allow_config_differences == ["backend.options.gradient_checkpointing"]


@pytest.mark.parametrize(("override", "where", "says"), [
    ("training.sede=1", "training.sede", "unknown key"),
    ("training.seed='x'", "training.seed", "expected an integer"),
    ("training.max_steps=true", "training.max_steps", "expected an integer"),
    ("algorithm.estimator='ppo'", "algorithm.estimator", "allowed values: 'grpo', 'dr_grpo', 'rloo'"),
    ("lora.target_modules=[1]", "lora.target_modules[0]", "expected a string"),
    ("backend.devices='gpu:0,gpu:1'", "backend.devices", "exactly one device"),
    ("nosuch.key=1", "nosuch", "unknown key"),
    # torch's AdamW refuses these when it is built, after the model: refused here, exit 2, not exit 3
    ("optimizer.eps=-1e-8", "optimizer.eps", "must be >= 0"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay", "must be >= 0"),
    # a digit str.isdigit() takes but torch's device parser does not
    ("backend.devices='cuda:\u0663'", "backend.devices", "exactly one device"),
    ("backend.devices='gpu:\u00b9'", "backend.devices", "exactly one device"),
    # logits divided by it overflow float32: the sampler drew from infinities (exit 3)
    ("inference.temperature=1e-320", "inference.temperature", "must be >= 1e-06"),
    ("inference.temperature=1e-9", "inference.temperature", "must be >= 1e-06"),
])
def test_invalid_values_are_refused_with_their_path(override: str, where: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["training.seed=1", override])
    assert info.value.where == where
    assert says in info.value.message


def test_set_reads_toml_values_lists_included() -> None:
    cfg = load_config(None, ["optimizer.betas=[0.8, 0.9]", "optimizer.lr=5e-4",
                             "logging.run_name=plain-string", "backend.options.gradient_checkpointing=true"])
    assert cfg.optimizer.betas == [0.8, 0.9] and cfg.optimizer.lr == 5e-4
    assert cfg.logging.run_name == "plain-string"
    assert cfg.backend.options.gradient_checkpointing is True


def test_precedence_set_over_file_over_default(tmp_path: Path) -> None:
    p = write(tmp_path, "[training]\nseed = 5\nmax_steps = 3\n")
    cfg = load_config(p, ["training.max_steps=4"])
    assert (cfg.training.seed, cfg.training.max_steps, cfg.training.save_every) == (5, 4, 0)


def test_config_digest_ignores_key_order_and_formatting(tmp_path: Path) -> None:
    a = write(tmp_path, "[training]\nseed = 5\nmax_steps = 2\n[optimizer]\nlr = 0.001\n", "a.toml")
    b = write(tmp_path, "[optimizer]\nlr=1e-3\n\n[training]\nmax_steps=2\nseed=5 # same\n", "b.toml")
    assert config_sha256(load_config(a)) == config_sha256(load_config(b))
    c = write(tmp_path, "[training]\nseed = 6\nmax_steps = 2\n", "c.toml")
    assert config_sha256(load_config(c)) != config_sha256(load_config(a))


def test_resolved_config_is_redacted() -> None:
    cfg = load_config(None, ["logging.metadata={api_key='sk-123', tracker='https://bob:hunter2@example.org/x'}"])
    meta = resolved(cfg)["logging"]["metadata"]
    assert meta == {"api_key": "<redacted>", "tracker": "https://<redacted>@example.org/x"}


@pytest.mark.parametrize(("text", "needle"), [
    ("[training]\nseed = 1\nbogus = 2\n", "training.bogus: unknown key"),
    ("[training]\nseed = 'one'\n", "training.seed: expected an integer"),
    ("[training]\nmax_steps = 1\n[backend.options]\nstrict_deterministic = true\n", "training.seed"),
    ("[training\n", "invalid TOML"),
])
def test_train_refuses_bad_configs_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               text: str, needle: str) -> None:
    assert main(["train", str(write(tmp_path, text)), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
