"""The capture switch for a verl run under Ray: import this module in the actor's worker process.

verl imports the modules named by ``actor_rollout_ref.model.external_lib`` in every worker process when it builds
the model config, the first thing ``ActorRolloutRefWorker.init_model`` does.  Imported there, this module wraps
``TrainingWorker.set_loss_fn`` (verl's class, once per process), so that when the actor's worker sets its loss
(after its engine is built) and ``REPLAYJOB_VERL_CAPTURE_DIR`` is set in the worker's environment,
:func:`replayjob.producers.verl.producer.capture_actor_steps` instruments it::

    python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.model.external_lib=replayjob.producers.verl.plugin \\
        +ray_kwargs.ray_init.runtime_env.env_vars.REPLAYJOB_VERL_CAPTURE_DIR=/abs/runs/cap \\
        +ray_kwargs.ray_init.runtime_env.env_vars.REPLAYJOB_VERL_CAPTURE_STEPS='3'

``REPLAYJOB_VERL_CAPTURE_STEPS``: one optimizer step (``3``: replay.toml) or several (``1,3``: one
``replay_step_<K:06d>.toml`` each and ``metrics.json`` once all are captured); 0-based optimizer steps of the
actor's engine counted from the start of the process (``REPLAYJOB_VERL_FIRST_STEP`` for a resumed run).  Workers
whose loss is not the actor's ``ppo_loss`` (a critic's value loss, a reference model) are left alone.  A
malformed setting raises in the worker, before its first update (the run stops rather than run uncaptured).
Importing this module imports verl (and torch): that is its purpose; nothing in replayjob imports it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from replayjob.errors import UsageError
from replayjob.producers.verl.producer import LOSSES, capture_actor_steps

DIR_ENV = "REPLAYJOB_VERL_CAPTURE_DIR"
STEPS_ENV = "REPLAYJOB_VERL_CAPTURE_STEPS"
FIRST_ENV = "REPLAYJOB_VERL_FIRST_STEP"
ATTRIBUTE = "replayjob_capture"  # the worker attribute holding its VerlCapture


def settings(environ: dict[str, str] | None = None) -> tuple[str, int | None, list[int] | None, int] | None:
    """``(dir, step, steps, first_step)`` from the environment, or None when no capture is asked for."""
    env = os.environ if environ is None else environ
    out = env.get(DIR_ENV, "")
    if not out:
        return None
    raw = env.get(STEPS_ENV, "0")
    try:
        ks = [int(x) for x in raw.split(",") if x.strip()]
        first = int(env.get(FIRST_ENV, "0"))
    except ValueError:
        raise UsageError(f"{STEPS_ENV}={raw!r} / {FIRST_ENV} must be step numbers", where=STEPS_ENV,
                         hint="e.g. REPLAYJOB_VERL_CAPTURE_STEPS=3 or 1,3") from None
    if not ks:
        raise UsageError(f"{STEPS_ENV} names no step", where=STEPS_ENV, hint="e.g. REPLAYJOB_VERL_CAPTURE_STEPS=3")
    if "," in raw:
        return out, None, ks, first
    return out, ks[0], None, first


def _is_actor_loss(loss_fn: Any) -> bool:
    func = getattr(loss_fn, "func", None)
    return getattr(func, "__module__", "") == "verl.workers.utils.losses" and getattr(func, "__name__", "") in LOSSES


def install() -> None:
    """Wrap ``TrainingWorker.set_loss_fn`` once in this process (see the module docstring)."""
    from verl.workers.engine_workers import TrainingWorker

    original = TrainingWorker.set_loss_fn
    if getattr(original, "replayjob_wrapped", False):
        return

    def set_loss_fn(self: Any, loss_fn: Any) -> Any:
        result = original(self, loss_fn)
        asked = settings()
        if asked is not None and _is_actor_loss(loss_fn) and getattr(self, ATTRIBUTE, None) is None:
            out, step, steps, first = asked
            setattr(self, ATTRIBUTE, capture_actor_steps(self, out, step, steps=steps, first_step=first))
        return result

    # verl's dispatch decorator marks the method with attributes (its dispatch mode): the wrapper keeps them
    functools.update_wrapper(set_loss_fn, original)
    set_loss_fn.replayjob_wrapped = True  # type: ignore[attr-defined]
    TrainingWorker.set_loss_fn = set_loss_fn


install()
