"""Redaction applied before any config or contract is hashed or written.

Three things are replaced by :data:`REDACTED`: values under secret-shaped keys at any depth,
opaque commands and environment arguments, and the credentials inside URLs (the host stays).
Ordinary training keys such as ``max_new_tokens`` or ``token_cap`` are kept: a key is secret when
one of its ``_``/``-``/``.``-separated words (or a known compound) is secret-shaped, not when a
secret word merely appears inside a longer word.

Example:
    >>> redact({"token_cap": 4, "hf_token": "abc", "url": "https://u:p@host/x"})
    {'token_cap': 4, 'hf_token': '<redacted>', 'url': 'https://<redacted>@host/x'}
"""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any

REDACTED = "<redacted>"

_SECRET_WORDS = {
    "token", "secret", "secrets", "password", "passwd", "pwd", "passphrase",
    "credential", "credentials", "auth", "authorization", "apikey", "cookie", "session",
    "bearer", "signature", "privatekey", "accesskey", "secretkey",
}
_SECRET_COMPOUNDS = {
    ("api", "key"), ("private", "key"), ("access", "key"), ("secret", "key"), ("client", "secret"),
    ("access", "token"), ("auth", "token"), ("refresh", "token"), ("session", "key"),
}
# Keys whose value is an opaque command or environment arguments: never recorded verbatim.
_OPAQUE_KEYS = {"command", "cmd", "commands", "env", "environ", "environment_args", "env_args",
                "args", "argv", "extra_args", "launcher"}
# Word-level exceptions: counts and sizes of tokens are training settings, not secrets.
_TOKEN_COUNT_WORDS = {"max", "min", "new", "cap", "count", "num", "per", "limit", "budget", "len",
                      "length", "id", "ids", "type", "level", "weight", "weights", "mean", "sum"}
_URL_CRED = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<cred>[^/@\s]+)@")


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)
    return [w for w in re.split(r"[_\-.\s]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    words = _words(key)
    if not words:
        return False
    joined = "".join(words)
    if joined in _SECRET_WORDS:
        return True
    for a, b in pairwise(words):
        if (a, b) in _SECRET_COMPOUNDS:
            return True
    for w in words:
        if w in ("token", "tokens"):
            if any(o in _TOKEN_COUNT_WORDS for o in words if o not in ("token", "tokens")):
                continue
            if w == "tokens":
                continue
            return True
        if w in _SECRET_WORDS and w not in ("token", "tokens", "session"):
            return True
    return False


def is_opaque_key(key: str) -> bool:
    return key.lower() in _OPAQUE_KEYS


def redact_url(text: str) -> str:
    return _URL_CRED.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def redact(obj: Any) -> Any:
    """Return a redacted deep copy of ``obj`` (dicts, lists, scalars)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            ks = str(k)
            if is_secret_key(ks) or is_opaque_key(ks):
                out[ks] = _redact_value(v)
            else:
                out[ks] = redact(v)
        return out
    if isinstance(obj, list | tuple):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return redact_url(obj)
    return obj


def redact_command(text: str) -> str:
    """A shell command as it may be recorded: secret-shaped ``KEY=VALUE`` words (``--set`` overrides
    and environment assignments), the values of secret-shaped ``--flags`` and URL credentials are
    replaced by :data:`REDACTED`; everything else is kept so the command stays reproducible.

    Example:
        >>> redact_command("HF_TOKEN=abc train --set logging.metadata.api_key=x --password p --seed 1")
        'HF_TOKEN=<redacted> train --set logging.metadata.api_key=<redacted> --password <redacted> --seed 1'
    """
    words = re.split(r"(\s+)", text)
    out: list[str] = []
    hide_next = False
    for w in words:
        if not w or w.isspace():
            out.append(w)
            continue
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        key, sep, _ = w.partition("=")
        bare = key.lstrip("-").strip("'\"")
        if sep and bare and is_secret_key(bare.rsplit(".", 1)[-1]):
            out.append(f"{key}={REDACTED}")
        elif w.startswith("--") and not sep and is_secret_key(bare):
            out.append(w)
            hide_next = True
        else:
            out.append(redact_url(w))
    return "".join(out)


def _redact_value(v: Any) -> Any:
    if v in (None, "", [], {}):
        return v  # an empty value reveals nothing; keep its shape
    return REDACTED
