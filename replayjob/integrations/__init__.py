"""Capture and replay for trainers other than replayjob's own: one module per framework.

The framework-neutral part lives in :mod:`~replayjob.integrations.capture` (the public capture API
any PyTorch loop can call), :mod:`~replayjob.integrations.manifest` (the capture's schema),
:mod:`~replayjob.integrations.admission` (explain: the shared admission rules, no model) and
:mod:`~replayjob.integrations.replay` (one update from a verified capture).  A framework module
(``trl.py``) adds only what is specific to it: how to instrument its trainer and how to rebuild it
and run one captured micro-batch through its own training step.

The registry maps the framework name a manifest records to the module that replays it; a second
framework (verl, OpenRLHF) is one more entry and one more module.  Importing this package imports
no framework.
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path
from typing import Any

from replayjob.errors import ConfigError

# framework name (as recorded in a capture manifest) -> module with ``build_replay(adm)``
FRAMEWORKS: dict[str, str] = {
    "trl": "replayjob.integrations.trl",
    "torch": "replayjob.integrations.torch_loop",
}


def framework_module(name: str) -> Any:
    """The module that replays captures of framework ``name`` (imported on demand)."""
    if name not in FRAMEWORKS:
        raise ConfigError(f"unknown integration framework {name!r}", where="integration.framework",
                          hint="one of: " + ", ".join(sorted(FRAMEWORKS)))
    return importlib.import_module(FRAMEWORKS[name])


def is_integration_config(path: str | Path) -> bool:
    """Whether a replay config names an external trainer's capture (a top-level ``[integration]`` table).

    Unreadable files answer False; the built-in loader then refuses them with its own message.
    """
    from replayjob.config.load import MAX_TOML_BYTES
    from replayjob.errors import ReplayjobError
    from replayjob.fsio import read_regular_bytes

    try:  # regular files only (a FIFO or device is never opened for reading here)
        doc = tomllib.loads(read_regular_bytes(path, max_bytes=MAX_TOML_BYTES, follow_symlinks=True,
                                               what="config file").decode("utf-8"))
    except (ReplayjobError, OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(doc.get("integration"), dict)
