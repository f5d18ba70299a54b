"""The backend registry and the :class:`Policy` interface the trainer and replay use.

A backend turns a :class:`~replayjob.config.Config` into a :class:`Policy`: a trainable model
(base weights frozen, adapter trainable), its tokenizer and adapter I/O.  The built-in ``hf``
backend (transformers + peft) is registered in the package metadata like any other; users add their
own through the ``replayjob.backends`` entry-point group, naming a class with ``build(cfg) -> Policy``.
"""

from __future__ import annotations

import contextlib
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from replayjob.config import Config
from replayjob.errors import ConfigError
from replayjob.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


ENTRY_POINT_GROUP = "replayjob.backends"


class Policy(Protocol):
    """What a backend hands to the trainer."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    device: torch.device
    gradient_checkpointing: bool

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Adapter parameters in a stable order."""
        ...

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model computes the reference (adapter disabled)."""
        ...

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors under the weight file's names, sorted (CPU; may share the live storage)."""
        ...

    def save_adapter(self, directory: Path) -> Path:
        """Write the adapter (bytes: :func:`replayjob.rl.state.adapter_bytes`); return the weight file path."""
        ...

    def load_adapter(self, weight_file: Path, expected_sha256: str | None = None) -> None:
        """Load adapter weights from a safetensors file whose SHA-256 must equal ``expected_sha256``
        (when given), refusing any mismatch."""
        ...

    def model_reference(self) -> dict[str, Any]:
        """A JSON description of the base model that a resume state is checked against."""
        ...


class Backend(Protocol):
    """A model backend.  Besides :meth:`build`, a backend may define ``model_reference(cfg)``: the reference
    (:meth:`Policy.model_reference`) of the model ``build(cfg)`` would build, told from the config alone, so that
    admission compares a resume state with it before any model is built; without it only the replay compares.
    Likewise ``adapter_reasons(cfg, layout)``: why an adapter file of ``layout`` (each tensor's dtype and shape,
    :attr:`replayjob.rl.state.ResumeState.adapter_layout`) cannot be the adapter ``build(cfg)`` attaches, told from
    the config alone (empty: nothing the config tells against it); and ``vocab_size(cfg)``: the input embedding's
    rows, or None where only the built model tells them."""

    name: str

    def build(self, cfg: Config) -> Policy: ...


def load_backend(name: str) -> Backend:
    """The backend registered as ``name`` in the ``replayjob.backends`` entry points (the built-in ``hf``
    one is registered there by replayjob's own package metadata)."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            backend: Backend = ep.load()()
            return backend
    known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    raise ConfigError(f"unknown backend {name!r}", where="backend.name",
                      hint="installed backends: " + ", ".join(known))
