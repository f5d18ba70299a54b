"""Declared documents held in TOML files that replays pin (tolerances, budgets, a mismatch bound): read once,
hashed, parsed strictly and decoded through their declaration.

How a document is declared, and how every declared document is decoded, is :mod:`replayjob.declaration` (the core
layer, so a model's or an optimizer's own files are declared the same way); this module adds only the reading of the
pinned TOML files.

Example:
    >>> from replayjob.declaration import Count, Document
    >>> class Margin(Document, frozen=True):
    ...     rows: Count
    >>> read_declared_toml(Path("bound.toml"), Margin, "bound", "rewrite it")  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replayjob.config.load import read_toml_bytes, read_toml_file_bytes
from replayjob.declaration import D, decode
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError

__all__ = ["read_declared_toml", "read_pinned_toml"]


def read_pinned_toml(p: Path, what: str, expected_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """A predeclared TOML file (tolerances, budgets, a mismatch bound) and the SHA-256 of its bytes, which
    replays pin.

    The bytes are read once and hashed before they are parsed: the digest covers exactly what is
    parsed, and with ``expected_sha256`` a file that is not the pinned one is refused unparsed.
    """
    kw: dict[str, Any] = {"what": f"{what} file", "max_bytes": 1024 * 1024, "error": IntegrityError}
    data = read_toml_file_bytes(p, **kw)  # user-named: a symbolic link is followed, a FIFO refused
    sha = sha256_bytes(data)
    if expected_sha256 is not None and sha != expected_sha256:
        raise IntegrityError(f"the {what} file hashes to {sha}, the pin is {expected_sha256}", where=p,
                             hint=f"use the {what} file that was pinned")
    return read_toml_bytes(data, p, **kw), sha


def read_declared_toml(p: Path, kind: type[D], what: str, hint: str) -> tuple[D, str]:
    """:func:`read_pinned_toml`, then :func:`decode` as the declared ``kind``."""
    doc, sha = read_pinned_toml(p, what)
    return decode(doc, kind, where=p, hint=hint), sha
