"""Redaction vectors both ways: secrets go, ordinary training keys stay."""

from __future__ import annotations

import pytest

from replayjob.config.redact import REDACTED, is_secret_key, redact, redact_url

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
