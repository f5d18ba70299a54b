"""Secrets placed in every supported config location never reach an artifact or a message.

Supported locations: secret-shaped keys under ``[logging.metadata]`` (plain, upper-case, dotted,
compound); inside free-form strings (``logging.run_name``, metadata values, ``optimizer_batch.arm``):
URL credentials, query parameters and fragments, ``Authorization``/``Bearer`` values and key-named
secrets nested in JSON strings; and the same through ``--set``.  Every file each writer leaves
behind is scanned byte for byte, as are stdout and stderr.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replayjob.cli import main

MARK = "SEKRIT"
SECRET_TOML = f"""
[logging]
run_name = "nightly https://bot:{MARK}-run-url@git.example/org/repo?token={MARK}-q&v=1#{MARK}-frag"

[logging.metadata]
hf_token = "{MARK}-hf-token"
HF_TOKEN = "{MARK}-upper"
"wandb.api_key" = "{MARK}-dotted"
client_secret = "{MARK}-compound"
password = "{MARK}-password"
mirror = "s3://AKIAXX:{MARK}-url-cred@bucket/prefix"
note = "kept: an ordinary label"
signed = "https://b.s3/o?X-Amz-Credential={MARK}-cred&X-Amz-Signature={MARK}-sig"
callback = "https://app.example/cb#access_token={MARK}-fragment"
header = "Authorization: Bearer {MARK}-bearer"
headers_json = '{{"headers": {{"Authorization": "Basic {MARK}-json-auth"}}, "api_key": "{MARK}-json-key"}}'
nested_json = '{{"creds": {{"password": "{MARK}-nested"}}, "retries": 3}}'
"""
SECRET_SETS = [f'logging.metadata.auth_token="{MARK}-set-token"',
               f'logging.metadata.registry="https://u:{MARK}-set-url@registry.example/v2"',
               f'logging.metadata.hub="https://hub.example/m?api_key={MARK}-set-query"']


def secret_config(workspace: Path, tmp_path: Path) -> Path:
    """The workspace's train.toml plus every secret location (resume.from made absolute)."""
    text = (workspace / "train.toml").read_text().replace('from = "init_resume"',
                                                          f'from = "{workspace / "init_resume"}"')
    cfg = tmp_path / "secret.toml"
    cfg.write_text(text + SECRET_TOML)
    return cfg


def scan(root: Path) -> list[str]:
    """Files under ``root`` whose bytes contain the secret marker."""
    hits = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if MARK.encode() in p.read_bytes():
                hits.append(str(p))
    return hits


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert MARK not in out.out + out.err


@pytest.mark.slow
def test_train_artifacts_hold_no_secret(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = secret_config(workspace, tmp_path)
    out = tmp_path / "run"
    argv = ["train", str(cfg), "--out", str(out), "--set", "training.max_steps=2", "--set", "training.save_every=1"]
    for item in SECRET_SETS:
        argv += ["--set", item]
    run(argv, capsys)
    assert {p.name for p in out.iterdir()} >= {"diag.jsonl", "metrics.json", "checkpoints", "final_adapter"}
    assert scan(out) == []
    metrics = (out / "metrics.json").read_text()
    assert metrics.count("<redacted>") >= 18 and "kept: an ordinary label" in metrics
    assert '"retries\\": 3' in metrics  # only the secret parts of a JSON string go


def with_secrets(template: Path, workspace: Path, tmp_path: Path, name: str) -> Path:
    text = template.read_text().replace('from = "init_resume"', f'from = "{workspace / "init_resume"}"')
    cfg = tmp_path / name
    cfg.write_text(text + SECRET_TOML)
    return cfg


@pytest.mark.slow
def test_capture_replay_bundles_and_verdict_hold_no_secret(workspace: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import json

    sets = [x for item in SECRET_SETS for x in ("--set", item)]
    source = tmp_path / "source"
    with pytest.MonkeyPatch.context() as mp:  # restores whatever the variables held before
        mp.setenv("REPLAYJOB_BUNDLE_CAPTURE", "1")
        mp.setenv("REPLAYJOB_BUNDLE_DIR", str(tmp_path / "bundles"))
        run(["capture", str(with_secrets(workspace / "source.toml", workspace, tmp_path, "s.toml")),
             "--out", str(source), *sets], capsys)
    metrics = json.loads((source / "metrics.json").read_text())
    pins = ["--set", f"optimizer_batch.replay_path={source / metrics['optimizer_batch/manifest_path']}",
            "--set", f"optimizer_batch.expected_logical_sha256={metrics['optimizer/logical_batch_sha256']}",
            "--set", f"optimizer_batch.expected_manifest_sha256={metrics['optimizer_batch/manifest_sha256']}"]
    replay_cfg = with_secrets(workspace / "replay.toml", workspace, tmp_path, "r.toml")
    arm = ["--set", f'optimizer_batch.arm="nightly Bearer {MARK}-arm"']  # reaches metrics, verdict, report
    for i in range(3):
        run(["replay", str(replay_cfg), "--out", str(tmp_path / "replays" / f"r{i}"), "--repeat-index", str(i),
             *pins, *sets, *arm], capsys)
    run(["reduce", str(tmp_path / "replays"), "--claim", "bitwise", "--source", str(source),
         "--out", str(tmp_path / "verdict.json"), "--report", str(tmp_path / "report.md")], capsys)
    written = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert {"replay_metrics.json", "verdict.json", "report.md", "COMPLETE",
            "optimizer_batch_step_000000.manifest.json"} <= written
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == ["update-000000-000000"]
    hits = [h for h in scan(tmp_path) if not h.endswith((".toml",))]  # the inputs themselves hold them
    assert hits == []
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert verdict["status"] == "pass", verdict
    assert "nightly Bearer <redacted>" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(("command", "expected"), [
    ("HF_TOKEN=abc python train.py", "HF_TOKEN=<redacted> python train.py"),
    ("replayjob train c.toml --set logging.metadata.api_key=k1 --set training.seed=7",
     "replayjob train c.toml --set logging.metadata.api_key=<redacted> --set training.seed=7"),
    ("run --password hunter2 --max-new-tokens 8", "run --password <redacted> --max-new-tokens 8"),
    ("git clone https://u:pw@host/r {out}", "git clone https://<redacted>@host/r {out}"),
    ("python t.py --token-cap 4 --out {out}", "python t.py --token-cap 4 --out {out}"),
])
def test_recorded_commands_are_redacted(command: str, expected: str) -> None:
    from replayjob.redact import redact_command

    assert redact_command(command) == expected


def test_determinism_check_records_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    diag = tmp_path / "given.jsonl"
    diag.write_text('{"step": 0, "loss": 1.0}\n')
    command = (f"HF_TOKEN={MARK}-env cp {diag} {{out}}/diag.jsonl # see https://u:{MARK}-url@host/x"
               f" https://h/y?token={MARK}-query#{MARK}-frag -H 'Authorization: Bearer {MARK}-bearer'")
    run(["determinism-check", "--command", command, "--runs", "2", "--out", str(tmp_path / "dc")], capsys)
    assert (tmp_path / "dc" / "determinism_check.json").is_file()
    assert scan(tmp_path / "dc") == []
