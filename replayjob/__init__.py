"""replayjob: trustworthy systems experiments on RL post-training of LoRA adapters.

The public API, importable from here (each name is imported on first use, so ``import replayjob``
imports neither torch nor any framework):

* capturing a step of any PyTorch loop: :class:`StepCapture`, :class:`ChosenSteps`,
  :class:`CaptureResult`, :class:`StepsResult`, and for its replay target :class:`Target` and
  :func:`optimizer_step` (docs/capture-api.md);
* a TRL trainer: :func:`capture_optimizer_batch` (README, "Using replayjob with TRL");
* a verl run: :func:`capture_actor_steps` (docs/verl.md);
* the producer protocol a new framework implements: :class:`Session`, :class:`MicroStep`,
  :class:`Outcome`, the registry :data:`PRODUCERS` (:mod:`replayjob.producers`);
* the command line: :func:`main` (``replayjob ...``; exit 0 pass, 1 fail, 2 refused, 3 error).

Everything else is internal: its modules may change between releases (a module that moved keeps its old
import path for one release, with a :class:`DeprecationWarning`: :mod:`replayjob.integrations`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "StepCapture": "replayjob.producers.api.capture",
    "ChosenSteps": "replayjob.producers.api.capture",
    "CaptureResult": "replayjob.producers.api.capture",
    "StepsResult": "replayjob.producers.api.capture",
    "CaptureError": "replayjob.errors",
    "Target": "replayjob.producers.torch_loop",
    "optimizer_step": "replayjob.producers.torch_loop",
    "capture_optimizer_batch": "replayjob.producers.trl.producer",
    "capture_actor_steps": "replayjob.producers.verl.producer",
    "Session": "replayjob.producers.session",
    "MicroStep": "replayjob.producers.session",
    "Outcome": "replayjob.producers.session",
    "PRODUCERS": "replayjob.producers",
    "main": "replayjob.cli",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'replayjob' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
