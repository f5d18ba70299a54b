"""Plain PyTorch loops: the one standard optimizer step, and replay through the user's own loss.

A loop captured with framework ``"torch"`` (see ``docs/capture-api.md`` and
``examples/plain_torch_loop.py``) names a *replay target* in ``[integration] entry`` as
``FILE.py:function``; the file's SHA-256 is recorded at capture and re-checked at admission
(the target is the user's code, so a changed file is refused).  ``function(base_model_dir,
device)`` returns a :class:`Target`: the model rebuilt from the base model directory (with its
adapter in the captured order), a fresh optimizer and LR scheduler built like the source's, the
loss function the loop calls, and ``max_grad_norm``.  Replay runs ``loss.backward()`` on each
captured micro-batch (the RNG restored right before the loss) and then :func:`optimizer_step`,
the same function the source loop must call, so the clip / step / schedule / zero-grad
sequence is one piece of code on both sides.  This module imports no framework.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.errors import ConfigError, ContractError
from replayjob.producers.api import files as _files
from replayjob.producers.api import microbatch as _microbatch
from replayjob.producers.api.admission import Admission
from replayjob.producers.api.replay import ReplaySession
from replayjob.producers.contract import integration_contract

if TYPE_CHECKING:
    import torch


FRAMEWORK = "torch"


@dataclass
class Target:
    """What a replay target returns: the loop's pieces, rebuilt without data."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss: Callable[..., torch.Tensor]  # loss(model, inputs, **call) -> scalar tensor (already accumulation-scaled)
    max_grad_norm: float | None = None


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                   max_grad_norm: float | None) -> float:
    """The standard step after the micro-batches' backward passes; returns the pre-clip gradient norm.

    Clip the trainable parameters' gradients to ``max_grad_norm`` (norm only when None),
    ``optimizer.step()``, ``scheduler.step()`` when there is one, ``optimizer.zero_grad(set_to_none=True)``.
    """
    import torch
    params = list(_files.trainable_parameters(model).values())
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def contract(resolved: dict[str, Any]) -> dict[str, Any]:
    """The whole user config of the loop defines the update (pure: nothing imported)."""
    return integration_contract(FRAMEWORK, resolved.get(FRAMEWORK, {}), "loss.backward per captured "
                                "micro-batch; integrations.torch_loop.optimizer_step")


def check_entry(entry: str, recorded: Any) -> str | None:
    """Why the config's replay target is not the one recorded at capture, or None."""
    try:
        have = _files.entry_identity(entry)
    except ConfigError as exc:
        return exc.diagnostics()
    if not isinstance(recorded, dict) or have["sha256"] != recorded.get("sha256") \
            or have["function"] != recorded.get("function"):
        return (f"the replay target {entry} is not the one recorded at capture ({recorded}); its code "
                "changed or another function is named")
    return None


class TorchSession(ReplaySession):
    """The user's loop pieces, rebuilt by the replay target."""

    def __init__(self, adm: Admission, out: Path):
        import torch
        assert adm.cfg is not None and adm.resolved is not None
        ident = _files.entry_identity(adm.cfg.entry)
        spec = importlib.util.spec_from_file_location("replayjob_replay_target", ident["file"])
        if spec is None or spec.loader is None:
            raise ConfigError("cannot import the replay target", where=ident["file"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert adm.manifest is not None
        captured = torch.device(str(adm.manifest.doc["producer"]["device"]))  # where the loop ran
        device = captured if captured.type == "cpu" or torch.cuda.is_available() else torch.device("cpu")
        t = getattr(module, ident["function"])(Path(adm.resolved["model"]["path"]), device)
        if not isinstance(t, Target):
            raise ContractError(f"{adm.cfg.entry} returned {type(t).__name__}, not replayjob's Target",
                                where=ident["file"])
        self.target, self.model, self.optimizer, self.scheduler = t, t.model, t.optimizer, t.scheduler
        self.device = device

    def run(self, mb: _microbatch.MicroBatch, inputs: dict[str, Any], call: dict[str, Any],
            before_loss: Callable[[], None]) -> float:
        before_loss()
        loss = self.target.loss(self.model, inputs, **call)
        loss.backward()
        return float(loss.detach())

    def optimizer_step(self) -> float:
        return optimizer_step(self.model, self.optimizer, self.scheduler, self.target.max_grad_norm)


def build_replay(adm: Admission, out: Path) -> TorchSession:
    """The integration registry's entry point."""
    return TorchSession(adm, out)
