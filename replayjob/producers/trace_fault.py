"""A test-only fault: perturb one module's output by a tiny relative amount, to prove localisation.

``REPLAYJOB_TRACE_FAULT=MODULE[:SCALE]`` (read once at import, so an unset variable costs one
``None`` check) makes a traced replay multiply the first tensor of ``MODULE``'s output by
``1 + SCALE`` (default ``1e-3``) on every call, forward and any gradient-checkpointing
recomputation alike.  ``MODULE`` is a name from ``model.named_modules()`` as the trace index spells
it (``base_model.model.model.layers.1.mlp.down_proj``, ...).  The fault is armed only while a replay
is traced and is recorded in the trace identity (``fault``), so a perturbed trace never passes for
a clean one.  Nothing outside the tests sets it.

Example:
    $ REPLAYJOB_TRACE_FAULT='base_model.model.model.layers.1.mlp.down_proj:1e-3' \\
        replayjob replay ws/replay.toml --trace --out runs/faulty --set ...
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replayjob.errors import UsageError

if TYPE_CHECKING:
    import torch

FAULT_ENV = "REPLAYJOB_TRACE_FAULT"
DEFAULT_SCALE = 1e-3


@dataclass(frozen=True)
class Fault:
    module: str
    scale: float

    @property
    def spec(self) -> str:
        return f"{self.module}:{self.scale!r}"


def parse(spec: str) -> Fault:
    """``MODULE[:SCALE]`` -> :class:`Fault`; a malformed spec is refused (exit 2)."""
    name, sep, raw = spec.rpartition(":")
    if not sep:
        name, raw = spec, repr(DEFAULT_SCALE)
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not name or not math.isfinite(scale) or scale == 0.0:
        raise UsageError(f"{FAULT_ENV}={spec!r} is not MODULE[:SCALE] with a finite non-zero SCALE",
                         hint=f"for example {FAULT_ENV}='base_model.model.model.layers.0.mlp:1e-3', or unset it")
    return Fault(name, scale)


def armed() -> Fault | None:
    """The fault from the environment (read at import; a malformed spec is refused here), or ``None``."""
    return parse(_SPEC) if _SPEC else None


def install(model: torch.nn.Module, fault: Fault) -> torch.utils.hooks.RemovableHandle:
    """Register the perturbing forward hook on ``fault.module``; call before any recording hook."""
    import torch
    modules = dict(model.named_modules())
    if fault.module not in modules:
        near = sorted(n for n in modules if fault.module.rsplit(".", 1)[-1] in n)[:5]
        raise UsageError(f"{FAULT_ENV} names module {fault.module!r}, which this model does not have",
                         hint="use a name from the trace index; similar: " + (", ".join(near) or "none"))

    def perturb(_m: torch.nn.Module, _args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output * (1.0 + fault.scale)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (output[0] * (1.0 + fault.scale), *output[1:])
        raise UsageError(f"{FAULT_ENV}: module {fault.module!r} returns {type(output).__name__}, not a tensor "
                         "or a tuple starting with one", hint="choose a module that returns a tensor")

    return modules[fault.module].register_forward_hook(perturb)


_SPEC: str | None = None


def configure(spec: str | None = None) -> None:
    """(Re)arm from an explicit spec; ``configure()`` disarms.  Used by in-process tests."""
    global _SPEC
    if spec:
        parse(spec)  # refuse a malformed spec at once
    _SPEC = spec or None


_SPEC = os.environ.get(FAULT_ENV) or None
