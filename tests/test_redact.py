"""Redaction vectors both ways: secrets go, ordinary training keys stay."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from replayjob.redact import REDACTED, is_secret_key, redact, redact_path, redact_url

SECRET_KEYS = ["token", "hf_token", "HF_TOKEN", "secret", "client_secret", "password", "db_passwd",
               "api_key", "apiKey", "openai-api-key", "apikey", "credential", "credentials", "auth",
               "Authorization", "private_key", "aws_access_key_id", "access_token", "refresh_token",
               "secret_key", "wandb.api_key"]
TRAINING_KEYS = ["max_new_tokens", "token_cap", "max_tokens", "num_tokens", "tokens_per_step", "pad_token_id",
                 "eos_token_id", "token_level", "tokenizer", "author", "authority_weight", "seed", "lr",
                 "secretary_count", "keyboard", "passage_len"]


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_secret_shaped_keys_are_redacted(key: str) -> None:
    assert is_secret_key(key), key
    assert redact({"a": {"b": [{key: "value"}]}}) == {"a": {"b": [{key: REDACTED}]}}


@pytest.mark.parametrize("key", TRAINING_KEYS)
def test_training_keys_are_kept(key: str) -> None:
    assert not is_secret_key(key), key
    assert redact({key: 7}) == {key: 7}


@pytest.mark.parametrize(("url", "expected"), [
    ("https://user:pass@host.example/path", "https://<redacted>@host.example/path"),
    ("s3://AKIA:abc@bucket/key", "s3://<redacted>@bucket/key"),
    ("https://host.example/path?x=1", "https://host.example/path?x=1"),
    ("see https://a:b@h1 and http://c@h2/x", "see https://<redacted>@h1 and http://<redacted>@h2/x"),
    ("user@example.org", "user@example.org"),
])
def test_url_credentials(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_opaque_commands_and_environment_arguments() -> None:
    data = {"command": "python train.py --key sk-1", "env": {"HF_TOKEN": "x", "PATH": "/bin"},
            "args": ["--password", "p"], "cmd": "", "name": "run"}
    assert redact(data) == {"command": REDACTED, "env": REDACTED, "args": REDACTED, "cmd": "", "name": "run"}


def test_redact_does_not_mutate_its_input() -> None:
    data = {"token": "t", "nested": {"password": "p"}}
    redact(data)
    assert data == {"token": "t", "nested": {"password": "p"}}


# Secrets inside free-form strings: each form, what must vanish, and what the text becomes.
STRING_FORMS = [
    ("https://host/x?token=S1&v=1", "https://host/x?token=<redacted>&v=1"),
    ("https://host/x?v=1&api_key=S1", "https://host/x?v=1&api_key=<redacted>"),
    ("https://b.s3/o?X-Amz-Credential=S1&X-Amz-Signature=S2&X-Amz-Security-Token=S3",
     "https://b.s3/o?X-Amz-Credential=<redacted>&X-Amz-Signature=<redacted>&X-Amz-Security-Token=<redacted>"),
    ("https://acct.blob/c?sv=2022&sig=S1", "https://acct.blob/c?sv=2022&sig=<redacted>"),
    ("https://maps/api?key=S1", "https://maps/api?key=<redacted>"),
    ("https://app/cb#access_token=S1&expires=3600", "https://app/cb#<redacted>"),
    ("https://u:S1@host/p?q=1#S2", "https://<redacted>@host/p?q=1#<redacted>"),
    ("Authorization: Bearer S1", "Authorization: Bearer <redacted>"),
    ("authorization=Basic S1", "authorization=Basic <redacted>"),
    ("Proxy-Authorization: S1", "Proxy-Authorization: <redacted>"),
    ("run with bearer S1.S2-x", "run with bearer <redacted>"),
    ('{"api_key": "S1", "n": 3}', '{"api_key": "<redacted>", "n": 3}'),
    ('{"headers": {"Authorization": "Bearer S1"}}', '{"headers": {"Authorization": "<redacted>"}}'),
    ('{"a": [{"password": "S1"}], "credentials": {"user": "u", "key": ["S2"]}}',
     '{"a": [{"password": "<redacted>"}], "credentials": <redacted>}'),
    ('{"pin": {"secret": 12345}}', '{"pin": {"secret": <redacted>}}'),
    ('{\\"hf_token\\": \\"S1\\"}', '{\\"hf_token\\": \\"<redacted>\\"}'),
    ("{'client_secret': 'S1'}", "{'client_secret': '<redacted>'}"),
    ("nightly token=S1 seed=3", "nightly token=<redacted> seed=3"),
    ("wandb.api_key = S1", "wandb.api_key = <redacted>"),
    ("HF_TOKEN=S1", "HF_TOKEN=<redacted>"),
]
KEPT_STRINGS = ["nightly-ablation", "runs/2024-06-01/ckpt#3", "/data/models/llama", "max_new_tokens=8 token_cap=4",
                "https://host/path?x=1&page=2", "basic setup, key: value", "loss-bearing tokens: 12",
                "note: an ordinary label", "q_proj", "user@example.org", '{"seed": 7, "tokens": 12}',
                "https://host/x#", "s3://bucket/prefix"]


@pytest.mark.parametrize(("text", "expected"), STRING_FORMS)
def test_secrets_inside_strings_are_redacted(text: str, expected: str) -> None:
    from replayjob.redact import redact_text

    got = redact_text(text)
    assert got == expected
    assert "S1" not in got and "S2" not in got and "S3" not in got
    assert redact_text(got) == got  # idempotent: a digest recomputed from the written copy agrees
    assert redact({"logging": {"run_name": text, "metadata": {"note": text}}}) == \
        {"logging": {"run_name": expected, "metadata": {"note": expected}}}


@pytest.mark.parametrize("text", KEPT_STRINGS)
def test_ordinary_strings_are_kept(text: str) -> None:
    from replayjob.redact import redact_text

    assert redact_text(text) == text


def test_keys_are_redacted_as_text_and_collisions_hide_both() -> None:
    got = redact({"https://h/x?token=S1": 1, "https://h/x?token=S2": 2, "plain": 3})
    assert got == {"https://h/x?token=<redacted>": REDACTED, "plain": 3}


def test_recorded_commands_redact_inside_words() -> None:
    from replayjob.redact import redact_command

    cmd = "curl -H 'Authorization: Bearer S1' 'https://h/x?token=S2&v=1' --set 'logging.run_name=\"a#b\"'"
    assert redact_command(cmd) == ("curl -H 'Authorization: Bearer <redacted>' 'https://h/x?token=<redacted>&v=1' "
                                   "--set 'logging.run_name=\"a#b\"'")


def test_hostile_strings_stay_linear() -> None:
    """Inputs built to make a backtracking scan quadratic or a recursive one deep finish and stay whole."""
    from replayjob.redact import redact_text

    for text in ["a" * 100_000 + "://", "Authorization: " + "Bearer " * 20_000 + "S1", "token=" + "{" * 50_000,
                 '"token": "' + "\\" * 50_001, "x@" * 50_000]:
        out = redact_text(text)
        assert "S1" not in out and redact_text(out) == out


@given(st.lists(st.sampled_from(["token", "=", ":", " ", '"', "'", "{", "}", "[", "]", "\\", "#", "?", "&",
                                 "https://", "u:p@", "h/x", "Bearer ", "api_key", "<redacted>", "S", ","]),
                max_size=24))
@example(parts=["https://", "token", "=", "https://", "u:p@"])  # a value's <redacted> once closed a credential
@settings(max_examples=300, deadline=None)
def test_redact_text_is_idempotent(parts: list[str]) -> None:
    from replayjob.redact import redact_text

    once = redact_text("".join(parts))
    assert redact_text(once) == once


def test_config_digest_covers_the_redacted_config_only() -> None:
    """A pinned config digest is over the written (redacted) config: recomputable from it, and blind
    to the secret itself, so a rotated token changes neither the digest nor the observed differences."""
    from replayjob.config import config_sha256, load_config, resolved
    from replayjob.config.differences import differences
    from replayjob.digest import sha256_json

    a = load_config(None, ['logging.metadata.hub="https://h/m?token=S1"', 'logging.run_name="r Bearer S2"'])
    b = load_config(None, ['logging.metadata.hub="https://h/m?token=S9"', 'logging.run_name="r Bearer S8"'])
    c = load_config(None, ['logging.metadata.hub="https://h/other?token=S1"', 'logging.run_name="r Bearer S2"'])
    assert config_sha256(a) == config_sha256(b) == sha256_json(resolved(a)) == sha256_json(redact(resolved(a)))
    assert differences(resolved(a), resolved(b)) == []
    assert config_sha256(c) != config_sha256(a)  # what is not a credential still counts
    assert differences(resolved(a), resolved(c)) == ["logging.metadata.hub"]


def test_paths_recorded_from_a_config_are_redacted(tmp_path: Path) -> None:
    """The capture manifest's adapter path (from resume.from) and a resume state's model path."""
    from replayjob.artifacts import capture_manifest as manifest
    from replayjob.config import load_config
    from replayjob.model.hf import builtin_model_reference

    doc = manifest.build(step=0, producer={}, payload_file="p.safetensors", payload_size=8, payload_digest="0" * 64,
                         rng_keys=["cpu"], rows={}, logical="0" * 64, effective="0" * 64, resolved_config={},
                         contract={}, adapter_path=tmp_path / "state?token=S1" / "adapter.safetensors",
                         adapter_size=8, adapter_sha256="0" * 64)
    assert doc["initial_adapter"]["path"] == str(tmp_path / "state?token=<redacted>")  # a value runs to a space
    ref = builtin_model_reference(load_config(None, [f'model.path="{tmp_path}/m?sig=S1"']))
    assert ref["path"] == f"{tmp_path}/m?sig=<redacted>"


def test_printed_messages_are_redacted_part_by_part() -> None:
    from replayjob.errors import ConfigError

    err = ConfigError("cannot open https://h/m?token=S1", where="logging.metadata.hf_token",
                      hint="check Authorization: Bearer S2")
    assert err.diagnostics() == ("logging.metadata.hf_token: cannot open https://h/m?token=<redacted>\n"
                                 "  fix: check Authorization: Bearer <redacted>")


def test_a_recorded_path_names_the_home_directory_as_tilde(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "alice"
    monkeypatch.setenv("HOME", str(home))
    assert redact_path(home / "ws" / "init_resume") == "~/ws/init_resume"
    assert redact_path(home) == "~"
    assert redact_path(f"{home}-other/x") == f"{home}-other/x"  # a prefix of a name is not the directory
    assert redact_path(home / "token=s3cr3t" / "m") == f"~/token={REDACTED}"  # redact_text: the value goes whole
    assert redact_path("/srv/models/base") == "/srv/models/base"
    assert Path(redact_path(home / "ws")).expanduser() == home / "ws"


def test_no_home_path_in_the_builtin_capture_manifest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A real capture under a home directory: the manifest records the initial adapter as ~/...,
    and the reducer still finds it (it reads the path back with expanduser)."""
    import json

    from replayjob.artifacts.metrics import read_source
    from replayjob.cli import main
    from replayjob.gate import reducer

    monkeypatch.setenv("HOME", str(tmp_path))
    ws = tmp_path / "ws"
    assert main(["init", str(ws)]) == 0
    assert main(["capture", str(ws / "source.toml"), "--out", str(ws / "src")]) == 0
    (path,) = ws.joinpath("src").glob("*.manifest.json")
    recorded = json.loads(path.read_text())["initial_adapter"]["path"]
    assert recorded == "~/ws/init_resume/adapter_model.safetensors"
    source = read_source(ws / "src")
    monkeypatch.chdir("/")
    assert reducer._initial_adapter(source, reducer._capture_manifest(source)) == ws / "init_resume" / \
        "adapter_model.safetensors"
