"""An ablation's fan-out as ``KEY=VALUE`` lines, for launchers written in shell (Slurm arrays).

A shell job cannot import the ablation spec, so it asks the CLI: ``replayjob ablation plan`` once at
submission (the array's size, the claim, the determinism environment, the overrides every process
gets, which arm each index belongs to) and ``replayjob ablation index`` in each array task (its
arm, its repeat, the arm's overrides and their declaration).  Both read
:mod:`replayjob.deploy.ablation`, the one source of truth, after an optional selection (a subset of
the arms in file order, another repeat count, another device), validated like the spec itself.

Every line is ``key=value`` with no quoting to undo: keys repeat for lists (``env=``, ``config=``,
``set=``), and values never hold a newline (the spec refuses whitespace and quotes in overrides).

Example:
    >>> from replayjob.deploy.ablation import Arm, AblationSpec
    >>> spec = AblationSpec(name="demo", image="img", gpu_product="h100", device="cpu",
    ...                     arms=(Arm("ckpt-off"),
    ...                           Arm("ckpt-on", {"backend.options.gradient_checkpointing": True})))
    >>> for line in task_lines(spec, 4): print(line)
    arm=ckpt-on
    repeat=1
    index=4
    set=backend.options.gradient_checkpointing=true
    allow=["backend.options.gradient_checkpointing"]
"""

from __future__ import annotations

import dataclasses

from replayjob.deploy.ablation import DETERMINISM_ENV, AblationSpec
from replayjob.errors import ConfigError, UsageError


def select(spec: AblationSpec, arms: str | None = None, repeats: int | None = None,
           device: str | None = None) -> AblationSpec:
    """The spec restricted to ``arms`` (comma-separated names, kept in file order), with another
    repeat count or device.  A ``min_repeats`` above a smaller repeat count is lowered to it."""
    changes: dict[str, object] = {}
    if arms is not None:
        names = [n.strip() for n in arms.split(",") if n.strip()]
        if not names:
            raise UsageError("--arms names no arm", hint="e.g. --arms ckpt-off,ckpt-on")
        if len(set(names)) != len(names):
            raise UsageError(f"--arms {arms!r} names an arm twice")
        for name in names:
            spec.arm(name)  # refuses an unknown name, listing the spec's arms
        changes["arms"] = tuple(a for a in spec.arms if a.name in names)
    if repeats is not None:
        if repeats < 1:
            raise UsageError(f"--repeats must be >= 1, found {repeats}")
        changes["repeats"] = repeats
        changes["min_repeats"] = min(spec.min_repeats, repeats)
    if device is not None:
        changes["device"] = device
    try:
        return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(exc.message, where=f"selection: {exc.where or ''}", hint=exc.hint) from None


def plan_lines(spec: AblationSpec) -> list[str]:
    """The whole fan-out: size, arms, claim, pinned environment, the common overrides, and one
    ``task=INDEX:ARM:REPEAT`` line per array index."""
    lines = [f"name={spec.name}", f"size={spec.size}", f"repeats={spec.repeats}",
             f"min_repeats={spec.effective_min_repeats}", f"claim={spec.claim}", f"seed={spec.seed}",
             f"device={spec.device}", "arms=" + ",".join(a.name for a in spec.arms)]
    lines += [f"env={k}={v}" for k, v in sorted(DETERMINISM_ENV.items())]
    lines += [f"config={kv}" for kv in spec.config_sets()]
    lines += [f"task={r.index}:{r.arm}:{r.repeat}" for r in spec.runs()]
    return lines


def task_lines(spec: AblationSpec, index: int) -> list[str]:
    """One array task: its arm and repeat, the arm's overrides and their declaration."""
    run = spec.run_for_index(index)
    arm = spec.arm(run.arm)
    lines = [f"arm={run.arm}", f"repeat={run.repeat}", f"index={run.index}"]
    lines += [f"set={kv}" for kv in arm.set_args()]
    lines.append(f"allow={arm.allow_list()}")
    return lines
