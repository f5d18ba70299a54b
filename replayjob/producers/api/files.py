"""Internals of the capture API: the files a capture writes and the identities it records (installed versions,
the base model's files, the replay target's source, the trainable parameters and the final adapter).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import api_manifest as imanifest
from replayjob.artifacts import metrics as metrics_io
from replayjob.artifacts.capture_manifest import REPLAY_CONFIG, replay_config_name
from replayjob.config import redact
from replayjob.digest import sha256_bytes, sha256_file, sha256_json
from replayjob.errors import ArtifactExistsError, CaptureError, ConfigError, UsageError
from replayjob.fsio import atomic_write_bytes
from replayjob.redact import redact_path
from replayjob.rl.state import FINAL_ADAPTER_FILE, adapter_bytes

if TYPE_CHECKING:
    import torch

METRICS_FILE = metrics_io.SOURCE_FILE
BASE_MODEL_FILES = ("config.json",)  # hashed with every *.safetensors and *.safetensors.index.json
_PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
STACK = ("torch", "transformers", "peft", "accelerate", "trl")


def versions(packages: Iterable[str]) -> dict[str, str | None]:
    """Installed versions (package metadata, nothing imported); None for a package not installed."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def base_model_identity(path: str | Path) -> dict[str, Any]:
    """The base model as a directory of files: config and safetensors weights, each by SHA-256.

    Refused: a path that is not a local directory, one without ``config.json`` or safetensors
    weights, and one whose weights are only pickle-based (``.bin``/``.pt``), which replay never loads.
    """
    d = Path(path)
    if not d.is_dir():
        raise CaptureError("the base model was not loaded from a local directory (its weights must be hashable "
                           "and loadable at replay)", where=str(path),
                           hint="download the model to a directory and load it from there "
                                "(from_pretrained('/path/to/dir'))")
    names = sorted(p.name for p in d.iterdir() if p.is_file() and not p.is_symlink()
                   and (p.name in BASE_MODEL_FILES or p.name.endswith((".safetensors", ".safetensors.index.json"))))
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        pickled = sorted(p.name for p in d.iterdir() if p.name.endswith(_PICKLE_WEIGHTS))
        raise CaptureError("the base model directory needs config.json and safetensors weights"
                           + (f" (found only pickle-based {pickled}, which replayjob never loads)" if pickled else ""),
                           where=d, hint="save the model with save_pretrained(dir, safe_serialization=True)")
    files = {n: sha256_file(d / n) for n in names}
    return {"path": redact_path(d.resolve()), "files": files, "sha256": sha256_json(files)}


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters the optimizer updates (``requires_grad``), by name, in the model's order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_adapter(path: Path, model: torch.nn.Module) -> str:
    """Write the trainable parameters as safetensors (atomically); return the file's SHA-256.

    Capture (after the real update) and replay write the final adapter through this one function,
    so equal parameters give equal files.
    """
    data = adapter_file_bytes(model)
    atomic_write_bytes(path, data, exclusive=True)
    return sha256_bytes(data)


def adapter_file_bytes(model: torch.nn.Module) -> bytes:
    """The trainable parameters as the bytes :func:`save_adapter` writes (what a final adapter SHA-256 covers):
    :func:`replayjob.rl.state.adapter_bytes`, the serialisation every producer's adapter files use."""
    return adapter_bytes(trainable_parameters(model))


def entry_identity(entry: str) -> dict[str, str]:
    """``FILE.py:function`` as recorded: the resolved file path, the function name and the file's SHA-256."""
    path, sep, func = entry.rpartition(":")
    if not sep or not path.endswith(".py") or not func.isidentifier():
        raise ConfigError(f"entry {entry!r} is not FILE.py:function", where="integration.entry",
                          hint="name the replay target, e.g. examples/plain_torch_loop.py:replay_target")
    p = Path(path).resolve()
    if not p.is_file():
        raise ConfigError("replay target file not found", where=str(p))
    return {"file": str(p), "function": func, "sha256": sha256_file(p)}


def capture_config(config: dict[str, Any], stack: Iterable[str]) -> dict[str, Any]:
    """The config a capture records: the caller's, with the installed ``stack`` versions, redacted."""
    out: dict[str, Any] = redact({**config, "stack": versions(stack)})
    return out


def capture_file_names(step: int, *, several: bool) -> list[str]:
    """Every name a capture of ``step`` creates: one step alone (``several`` false) also writes
    ``final_adapter/``, ``metrics.json`` and ``replay.toml``; one of several chosen steps writes its
    ``replay_step_<K:06d>.toml`` (metrics.json, shared by the steps, is checked once by the caller)."""
    names = list(imanifest.file_names(step).values())
    return names + ([replay_config_name(step)] if several else [METRICS_FILE, REPLAY_CONFIG, FINAL_ADAPTER_FILE])


def refuse_existing(out_dir: Path, names: Iterable[str]) -> None:
    """Refuse (before any work) when one of ``names`` already exists in ``out_dir``: never overwritten."""
    for name in names:
        if (out_dir / name).exists():
            raise ArtifactExistsError("a capture already exists here", where=out_dir / name,
                                      hint="choose a new output directory")


def chosen_steps(steps: Any) -> tuple[int, ...]:
    """Validate a list of chosen steps: integers >= 0, no duplicates, at least one; returned in order."""
    if isinstance(steps, str | bytes) or not isinstance(steps, Iterable):
        raise UsageError(f"steps must be a list of step numbers, found {steps!r}", where="steps")
    ks = list(steps)
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, int) or k < 0]
    if bad or not ks:
        raise UsageError(f"steps must be integers >= 0 (0-based optimizer steps), found {ks!r}", where="steps",
                         hint="e.g. steps=[1, 3]")
    dup = sorted({k for k in ks if ks.count(k) > 1})
    if dup:
        raise UsageError(f"steps {dup} are listed more than once", where="steps", hint="list each step once")
    return tuple(sorted(ks))
