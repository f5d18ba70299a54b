"""Typed config: schema, TOML + ``--set`` loading, canonical form, redaction, differences."""

from __future__ import annotations

from typing import Any

from replayjob.config.load import from_dict, load_config, to_dict
from replayjob.config.schema import Config
from replayjob.digest import sha256_json
from replayjob.redact import redact


def resolved(cfg: Config) -> dict[str, Any]:
    """The redacted resolved config: what is hashed and written."""
    out: dict[str, Any] = redact(to_dict(cfg))
    return out


def config_sha256(cfg: Config) -> str:
    """SHA-256 of the canonical JSON of the redacted resolved config."""
    return sha256_json(resolved(cfg))


__all__ = ["Config", "config_sha256", "from_dict", "load_config", "redact", "resolved", "to_dict"]
