"""The math mode of an existing capture: the spec's ``[capture] math_mode`` (default "default", the mode of a
process that sets none), checked against the mode the capture's contract records, and pinned by every launcher
(:meth:`~replayjob.artifacts.spec.AblationSpec.determinism_env`) in place of the built-in stage's "pedantic"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replayjob.artifacts import capture_manifest as mf
from replayjob.artifacts import metrics
from replayjob.artifacts.spec import DETERMINISM_ENV, load_spec_text
from replayjob.cli import main
from replayjob.errors import ConfigError
from replayjob.launch import argo, k8s, step
from replayjob.runtime import determinism

REPO = Path(__file__).resolve().parents[1]


def fake_capture(d: Path, mode: str) -> tuple[str, str]:
    """A capture directory holding just what ``step plan`` reads: metrics.json's pins, a valid manifest (of
    replayjob's own trainer; its payload is not read at plan) whose contract records ``mode``, and its replay
    config; returns the pins."""
    d.mkdir()
    logical = "a" * 64
    doc = mf.build(step=0, producer={"device": "cpu"}, payload_file=mf.payload_name(0), payload_size=1,
                   payload_digest="d" * 64, rng_keys=["cpu"],
                   rows={"rows": 1, "tokens": 2, "response_tokens": 1, "loss_bearing_tokens": 1}, logical=logical,
                   effective="b" * 64, resolved_config={}, contract={"math_mode": mode},
                   adapter_path=Path("a.safetensors"), adapter_size=1, adapter_sha256="c" * 64)
    manifest = mf.write(d / "m.manifest.json", doc)
    (d / metrics.SOURCE_FILE).write_text(json.dumps({metrics.LOGICAL: logical, metrics.MANIFEST: manifest,
                                                     metrics.MANIFEST_PATH: "m.manifest.json"}))
    (d / "replay.toml").write_text("")
    return logical, manifest


def spec_text(capture: Path, pins: tuple[str, str], math_mode: str | None) -> str:
    mode = [f'math_mode = "{math_mode}"'] if math_mode is not None else []
    return "\n".join([
        'name = "mm"', 'image = "replayjob:dev"', 'image_policy = "local"', 'gpu_product = "NVIDIA-H100-80GB-HBM3"',
        'storage_class = "nfs-rwx"', "repeats = 1", "", "[capture]", f'dir = "{capture}"',
        f'logical_sha256 = "{pins[0]}"', f'manifest_sha256 = "{pins[1]}"', *mode, "", "[arms.baseline]", ""])


@pytest.mark.parametrize(("recorded", "declared"), [("pedantic", None), ("default", "pedantic"), ("prod", "default")])
def test_plan_refuses_a_math_mode_other_than_the_captures(tmp_path: Path, recorded: str, declared: str | None,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 at `step plan`, naming both modes and the value to write; the capture's own mode is accepted
    and is what the plan tells the launchers to pin."""
    pins = fake_capture(tmp_path / "cap", recorded)
    (spec := tmp_path / "spec.toml").write_text(spec_text(tmp_path / "cap", pins, declared))
    assert main(["step", "plan", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"the capture ran in math mode {recorded!r}" in err
    assert f"capture.math_mode is {declared or 'default'!r}" in err
    assert f'math_mode = "{recorded}"' in err and "Traceback" not in err
    spec.write_text(spec_text(tmp_path / "cap", pins, recorded))
    assert main(["step", "plan", "--spec", str(spec)]) == 0
    assert f"env={determinism.ENV_MATH_MODE}={recorded}" in capsys.readouterr().out.splitlines()


def test_an_unknown_math_mode_is_refused(tmp_path: Path) -> None:
    (spec := tmp_path / "spec.toml").write_text(spec_text(tmp_path, ("a" * 64, "b" * 64), "fast"))
    with pytest.raises(ConfigError, match="'fast' is not a math mode"):
        load_spec_text(spec)


def containers(doc: Any) -> list[dict[str, Any]]:
    """Every container (a mapping with an image and an env list) anywhere in ``doc``."""
    if isinstance(doc, list):
        return [c for d in doc for c in containers(d)]
    if not isinstance(doc, dict):
        return []
    found = [doc] if "image" in doc and isinstance(doc.get("env"), list) else []
    return found + [c for v in doc.values() for c in containers(v)]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.parametrize("mode", [None, "prod"])
def test_rendered_jobs_and_workflow_pin_the_captures_math_mode(tmp_path: Path, mode: str | None) -> None:
    """A spec naming a capture made in a normal process (no math_mode: "default"), or in another mode: the
    driver, every stage Job and every step of the Argo workflow set that mode explicitly (over the image's
    own pedantic ENV), with the rest of the determinism environment; the capture directory need not be
    reachable at render time."""
    (spec_file := tmp_path / "spec.toml").write_text(spec_text(Path("/shared/captures/c1"), ("a" * 64, "b" * 64), mode))
    spec, text = load_spec_text(spec_file)
    want = {**DETERMINISM_ENV, determinism.ENV_MATH_MODE: mode or "default"}
    assert spec.determinism_env() == want and dict(DETERMINISM_ENV)[determinism.ENV_MATH_MODE] == "pedantic"
    rendered = [*k8s.render(spec, text).values(), *k8s.stage_jobs(spec, "r1").values(), *argo.render(spec, text)]
    found = containers(rendered)
    assert len(found) >= 7  # the driver, capture, replay and reduce Jobs; the workflow's three steps
    for c in found:
        env = env_of(c)
        assert {k: env.get(k) for k in want} == want, c.get("command")
    assert main(["k8s", "render", str(spec_file), "--out", str(tmp_path / "k8s"), "--argo",
                 str(tmp_path / "argo.yaml")]) == 0
    assert f"value: {mode or 'default'}" in (tmp_path / "argo.yaml").read_text()


def test_a_step_pins_the_specs_math_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`replayjob step` sets the spec's mode where none is set and refuses a contradicting one (the image's
    pedantic ENV under manifests rendered from another spec: render again)."""
    (spec_file := tmp_path / "spec.toml").write_text(spec_text(Path("/shared/c"), ("a" * 64, "b" * 64), None))
    spec, _ = load_spec_text(spec_file)
    for key, value in DETERMINISM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(determinism.ENV_MATH_MODE)
    step.ensure_determinism_env([], reexec=False, spec=spec)
    import os

    assert os.environ[determinism.ENV_MATH_MODE] == "default"
    monkeypatch.setenv(determinism.ENV_MATH_MODE, "pedantic")
    monkeypatch.setenv("REPLAYJOB_RENDERED", "{}")
    with pytest.raises(ConfigError, match="contradicts the pinned determinism environment") as exc:
        step.ensure_determinism_env([], reexec=False, spec=spec)
    assert "render the manifests again" in (exc.value.hint or "")
