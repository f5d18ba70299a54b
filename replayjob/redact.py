"""Redaction applied before any config, contract, record or message is hashed or written.

What is replaced by :data:`REDACTED`:

* values under secret-shaped keys at any depth, and opaque commands and environment arguments;
* inside every string (:func:`redact_text`, applied to every string value and key a config
  holds): URL credentials (``https://user:pass@host`` keeps its host), URL fragments
  (``#access_token=...``: never sent to a server, so never part of what a URL names), the value of
  any secret-shaped ``key=value`` or ``key: value`` pair, bare or quoted (URL query parameters such
  as ``?token=`` and ``&X-Amz-Signature=``, ``Authorization: Bearer ...`` headers, and key-named
  secrets nested in JSON or Python-literal strings, whose object or list value goes whole), and
  the credential after ``Bearer`` wherever it stands.

A filesystem path an artifact records as a path (the capture manifests' initial adapter and base
model) goes through :func:`redact_path`: the user's home directory is written ``~`` (the account
name and home layout do not travel with the record; ``Path(recorded).expanduser()`` finds the file
again on the same account), then :func:`redact_text`.

Ordinary training keys such as ``max_new_tokens`` or ``token_cap`` are kept: a key is secret when
one of its ``_``/``-``/``.``-separated words (or a known compound) is secret-shaped, not when a
secret word merely appears inside a longer word.

Redaction is idempotent (``redact(redact(x)) == redact(x)``), so a digest of a redacted config
recomputed from the written copy equals the one computed before writing.

Example:
    >>> redact({"token_cap": 4, "hf_token": "abc", "url": "https://u:p@host/x?api_key=k&v=2#frag"})
    {'token_cap': 4, 'hf_token': '<redacted>', 'url': 'https://<redacted>@host/x?api_key=<redacted>&v=2#<redacted>'}
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
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
# Schemes start where a word starts and are at most 32 characters, so no text makes a scan quadratic.
_SCHEME_RE = r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,31}://"
# Credentials hold no angle bracket (RFC 3986 has them percent-encoded), so a ``<redacted>`` this module
# wrote into a URL is never read back as a credential (redaction is idempotent).
_URL_CRED = re.compile(rf"(?P<scheme>{_SCHEME_RE})(?P<cred>[^/@\s<>]+)@")
# A URL as it stands in free text: it ends at whitespace, a quote or an angle bracket (so the
# ``<redacted>`` this module writes is never read as part of a URL).
_URL = re.compile(rf"{_SCHEME_RE}[^\s\"'<>]*")
# ``key=value`` or ``key: value``: a bare key, or a quoted one as in JSON (quotes may be escaped
# once, as in JSON nested in a JSON string).
_PAIR = re.compile(r"(?:(?P<q>\\?[\"'])(?P<qkey>[^\"'\\\s]{1,128})(?P=q)|(?<![\w.\-])(?P<key>[A-Za-z_][\w.\-]{0,127}))"
                   r"(?P<sep>\s*[=:]\s*)")
# Query-parameter names that carry credentials although they are not secret-shaped config keys
# (Azure SAS ``sig``, Google ``key``); only with ``=``, as a query string writes them.
_QUERY_SECRETS = {"sig", "key", "pass"}
_SCHEME = re.compile(r"(?i:bearer|basic|digest|token|negotiate|apikey)\s+")
_BEARER = re.compile(r"(?i)(?<![\w-])bearer\s+(?=[A-Za-z0-9._~+/=\-])")
_BARE = re.compile(r"[^\s,;&\"'<>()\[\]{}]+")
_CLOSE = {"{": "}", "[": "]"}


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
    """URL credentials only (``scheme://user:pass@host`` keeps scheme and host)."""
    return _URL_CRED.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def _quoted_end(text: str, i: int, quote: str) -> int:
    """Index of the quote closing the string that opens just before ``i`` (``len(text)`` if none)."""
    while i < len(text):
        c = text[i]
        if text.startswith(quote, i):
            return i
        i += 2 if c == "\\" else 1
    return len(text)


def _bracket_end(text: str, i: int) -> int:
    """Index just past the bracket matching ``text[i]`` (quotes respected; ``len(text)`` if unclosed)."""
    stack = [_CLOSE[text[i]]]
    i += 1
    while i < len(text) and stack:
        c = text[i]
        if c in "\"'":
            i = _quoted_end(text, i + 1, c) + 1
            continue
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c == stack[-1]:
            stack.pop()
        i += 1
    return i


def _value_span(text: str, i: int) -> tuple[int, int, bool]:
    """``(begin, end, hide)``: the value that starts at ``i`` and whether it is still to be hidden.

    A quoted value keeps its quotes, a bracketed one goes whole, an authorization scheme word
    (``Bearer``, ``Basic``, ...) is kept and the credential after it goes; an empty or already
    redacted value is not hidden again.  ``end`` is where the examined text ends, hidden or not.
    """
    while (scheme := _SCHEME.match(text, i)) is not None:
        i = scheme.end()
    if i >= len(text) or text.startswith(REDACTED, i):
        return i, i, False
    c = text[i]
    quote = "\\" + text[i + 1] if c == "\\" and text[i + 1:i + 2] in ("\"", "'") else c
    if quote in ("\"", "'", "\\\"", "\\'"):
        start = i + len(quote)
        end = _quoted_end(text, start, quote)
        return start, end, text[start:end] not in ("", REDACTED)
    if c in _CLOSE:
        return i, _bracket_end(text, i), True
    bare = _BARE.match(text, i)
    return (i, bare.end(), True) if bare is not None else (i, i, False)


def _hide_values(text: str, pattern: re.Pattern[str], secret: Callable[[re.Match[str]], bool]) -> str:
    """Replace the value that follows each match of ``pattern`` for which ``secret`` holds.

    Matches inside a value already examined are skipped, so every character is examined once.
    """
    out: list[str] = []
    pos = seen = 0
    for m in pattern.finditer(text):
        if m.start() < seen or not secret(m):
            continue
        begin, end, hide = _value_span(text, m.end())
        seen = max(end, m.end())
        if hide:
            out += [text[pos:begin], REDACTED]
            pos = end
    return "".join(out) + text[pos:] if out else text


def _secret_pair(m: re.Match[str]) -> bool:
    key = m.group("qkey") or m.group("key")
    return is_secret_key(key) or ("=" in m.group("sep") and key.lower() in _QUERY_SECRETS)


def _redact_fragment(m: re.Match[str]) -> str:
    url = m.group(0)
    base, hash_, fragment = url.partition("#")
    return f"{base}#{REDACTED}" if hash_ and fragment else url


def redact_text(text: str) -> str:
    """A free-form string as it may be written or hashed (see the module docstring for what goes).

    Example:
        >>> redact_text('run-7 {"headers": {"Authorization": "Bearer abc"}, "api_key": 12}')
        'run-7 {"headers": {"Authorization": "<redacted>"}, "api_key": <redacted>}'
        >>> redact_text("curl -H 'authorization: Bearer abc' https://h/x?sig=s&n=1#k")
        "curl -H 'authorization: Bearer <redacted>' https://h/x?sig=<redacted>&n=1#<redacted>"
    """
    text = redact_url(_URL.sub(_redact_fragment, text))
    text = _hide_values(text, _PAIR, _secret_pair)
    return _hide_values(text, _BEARER, lambda m: True)


def redact_path(path: str | os.PathLike[str]) -> str:
    """A filesystem path as an artifact records it: under the user's home directory it is written
    relative to ``~``, then the text goes through :func:`redact_text`.  The one rule for every path
    a capture manifest records (the built-in trainer's initial adapter, an external trainer's base
    model); ``Path(recorded).expanduser()`` reads it back.

    Example:
        >>> redact_path(os.path.join(os.path.expanduser("~"), "runs", "token=abc"))
        '~/runs/token=<redacted>'
        >>> redact_path("/srv/models/base")
        '/srv/models/base'
    """
    text = os.fspath(path)
    home = os.path.expanduser("~").rstrip(os.sep)
    if home and home != "~" and (text == home or text.startswith(home + os.sep)):
        text = "~" + text[len(home):]
    return redact_text(text)


def redact(obj: Any) -> Any:
    """Return a redacted deep copy of ``obj`` (dicts, lists, scalars); strings through :func:`redact_text`.

    A key is redacted as text too; should two keys become one, its value is :data:`REDACTED`.
    """
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            ks = str(k)
            value = _redact_value(v) if is_secret_key(ks) or is_opaque_key(ks) else redact(v)
            shown = redact_text(ks)
            out[shown] = REDACTED if shown in out else value
        return out
    if isinstance(obj, list | tuple):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


def redact_command(text: str) -> str:
    """A shell command as it may be recorded: secret-shaped ``KEY=VALUE`` words (``--set`` overrides
    and environment assignments) and the values of secret-shaped ``--flags`` are replaced by
    :data:`REDACTED`, then the whole text goes through :func:`redact_text` (URL credentials, query
    parameters and fragments, ``Authorization``/``Bearer`` values, quoted key-named secrets);
    everything else is kept so the command stays reproducible.

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
            out.append(w)
    return redact_text("".join(out))


def _redact_value(v: Any) -> Any:
    if v in (None, "", [], {}):
        return v  # an empty value reveals nothing; keep its shape
    return REDACTED
