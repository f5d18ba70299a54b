"""Deprecated import paths, kept for one release: the producers now live in :mod:`replayjob.producers`.

============================================  ===============================================
``replayjob.integrations.capture``            :mod:`replayjob.producers.api.capture`
``replayjob.integrations.torch_loop``         :mod:`replayjob.producers.torch_loop`
``replayjob.integrations.trl``                :mod:`replayjob.producers.trl.producer`
``replayjob.integrations.verl``               :mod:`replayjob.producers.verl.producer`
``replayjob.integrations.verl_hook``          :mod:`replayjob.producers.verl.plugin`
============================================  ===============================================

Each old module re-exports the new one's names and warns once (:class:`DeprecationWarning`) when imported;
the public names at the package top (``replayjob.StepCapture``, ``replayjob.capture_optimizer_batch``) never
moved.  Nothing in replayjob imports these modules.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType


def forward(old: str, new: str) -> ModuleType:
    """Warn that ``old`` moved to ``new`` and return the new module (its names are re-exported by the caller)."""
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)
