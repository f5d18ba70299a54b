"""The optimizer's param groups and the LR scheduler's state a capture records are read through their declarations
(:class:`replayjob.rl.state.ParamGroup`, :class:`replayjob.rl.state.SchedulerState`) by one reader: what torch's
optimizers and schedulers hold passes, and every declared field holding a value of another type or range is named,
each reason listed (one does not hide another)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import torch

from replayjob.rl.state import (
    ParamGroup,
    SchedulerState,
    declared_reasons,
    param_group_reasons,
    scheduler_type_reasons,
    split_optimizer_state,
)


def _stepped(opt_kind: Any, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    p = torch.nn.Parameter(torch.ones(3))
    opt = opt_kind([p], lr=0.1, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    p.grad = torch.ones(3)
    opt.step()
    sched.step()
    _, doc = split_optimizer_state(opt.state_dict())
    return json.loads(json.dumps(doc)), json.loads(json.dumps(sched.state_dict()))


@pytest.mark.parametrize(("kind", "kw"), [(torch.optim.AdamW, {}), (torch.optim.Adam, {"amsgrad": True}),
                                          (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
                                          (torch.optim.RMSprop, {"centered": True})])
def test_what_torch_holds_is_admitted(kind: Any, kw: dict[str, Any]) -> None:
    doc, sched = _stepped(kind, **kw)
    assert param_group_reasons(doc) == []
    assert scheduler_type_reasons(doc["param_groups"], sched) == []


@pytest.mark.parametrize("kind", [ParamGroup, SchedulerState])
def test_every_declared_field_is_read_and_named(kind: type[msgspec.Struct]) -> None:
    names = [f.encode_name for f in msgspec.structs.fields(kind)]
    doc: dict[str, Any] = {"lr": 0.1} if kind is ParamGroup else {}
    assert declared_reasons(doc, kind, "at", groups=1) == []
    bad = {**doc, **dict.fromkeys(names, "x")}  # no declared field of either declaration takes a string
    reasons = declared_reasons(bad, kind, "at", groups=1)
    assert len(reasons) == len(names), reasons  # each field's reason, none hiding another
    for n, reason in zip(names, reasons, strict=True):
        assert reason.startswith(f"at.{n} "), reason
        assert "is x, not" in reason or "found x" in reason, reason


def test_a_missing_lr_and_a_reserved_key_are_named() -> None:
    assert declared_reasons({}, ParamGroup, "g") == ["g has no lr; every torch optimizer's param group holds one"]
    assert declared_reasons({"optimizer": {}, "get_lr": 1}, SchedulerState, "s") == [
        "s.get_lr names the scheduler's method, which no scheduler state holds (loading it would replace it)",
        "s.optimizer names the scheduler's optimizer, which no scheduler state holds (loading it would replace it)"]
    assert declared_reasons({"base_lrs": [0.1, 0.2]}, SchedulerState, "s", groups=1) == [
        "s.base_lrs must list one finite learning rate >= 0 per param group (1), found [0.1, 0.2]"]
