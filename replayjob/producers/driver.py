"""The one replay driver: every producer's replay runs this sequence, in this order.

1. determinism controls established (strict or not) before anything is built;
2. the producer's session built (:class:`~replayjob.producers.session.Session`), then every declared
   knob's condition checked on the built model;
3. the captured start state restored (:meth:`Session.restore`) and the micro-batches planned;
4. one update: for each micro-batch the captured Torch RNG state restored immediately before its
   loss call, the producer's forward, loss and backward; then its clip / optimizer step / scheduler
   step / zero-grad once (:meth:`Session.finish`); with ``--trace`` a
   :class:`~replayjob.producers.trace_recorder.Recorder` attached around it;
5. the final adapter saved; then W warm-up and M measured in-process updates, each from the same
   restored state (``optimizer_batch.warmup_updates`` / ``measured_updates``), recorded apart from
   the fresh-process update under ``in_process`` with whether each reproduced its loss bit for bit;
   what contended with the host while these timed updates ran is recorded under ``contention``
   (:class:`replayjob.runtime.contention_probe.Probe`);
6. the producer's knobs observed at run time, and ``replay_metrics.json`` built and written by its
   artifact module (:func:`~replayjob.artifacts.metrics.replay_document`,
   :func:`~replayjob.artifacts.metrics.write_replay`).

Every captured tensor reaches a producer's loss in freshly allocated memory (:func:`fresh`): a view
into a payload's bytes may sit at an offset CPU kernels vectorise differently, which changes the
last bits of a reduction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import metrics as metrics_io
from replayjob.artifacts.schedule import Slot
from replayjob.digest import sha256_file
from replayjob.errors import ConfigError, ContractError, UsageError
from replayjob.fsio import refuse_unusable_out
from replayjob.hostinfo import host_provenance
from replayjob.model import moe
from replayjob.producers import trace_fault as faults
from replayjob.producers.session import MicroStep, Outcome, Session
from replayjob.producers.trace_recorder import Recorder
from replayjob.rl.diag import peak_memory_value
from replayjob.rl.state import restore_rng
from replayjob.runtime import determinism, knobs
from replayjob.runtime.contention_probe import Probe

if TYPE_CHECKING:
    import torch

METRICS_FILE = metrics_io.REPLAY_FILE


def fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device`` in newly allocated, contiguous memory (never a view of a payload)."""
    import torch
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t)
    return out


def _sync(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _restorer(rng: dict[str, torch.Tensor] | None) -> Callable[[], None]:
    """What runs right before a micro-batch's loss call: its captured RNG state restored (or nothing)."""
    def restore() -> None:
        if rng is not None:
            restore_rng(rng)
    return restore


def update(session: Session, plan: list[MicroStep]) -> tuple[Outcome, dict[str, float]]:
    """One update through ``session``: the RNG restored right before each micro-batch's loss call
    where the capture holds a state for it, then the producer's step; its outcome and timing."""
    dev = session.device
    session.begin(len(plan))
    _sync(dev)
    t0 = time.perf_counter()
    for i, step in enumerate(plan):
        session.micro_batch(i, step, _restorer(step.rng))
    _sync(dev)
    t1 = time.perf_counter()
    outcome = session.finish()
    _sync(dev)
    t2 = time.perf_counter()
    forward = outcome.forward_wall_s
    return outcome, {"local_train_wall_s": t2 - t0,
                     "forward_wall_s": max(t1 - t0 - outcome.backward_wall_s, 0.0) if forward is None else forward,
                     "backward_wall_s": outcome.backward_wall_s,
                     "optimizer_wall_s": t2 - t1 if outcome.optimizer_wall_s is None else outcome.optimizer_wall_s}


def in_process(session: Session, plan: list[MicroStep], loss: float, warmup: int,
               measured: int) -> dict[str, Any] | None:
    """``warmup`` + ``measured`` more updates in this process, each from the restored captured state."""
    if not measured:
        return None
    walls: list[float] = []
    peaks: list[int] = []
    same = True
    for i in range(warmup + measured):
        session.restore()
        _reset_peak(session.device)
        outcome, timing = update(session, plan)
        same = same and (outcome.loss == loss or (math.isnan(outcome.loss) and math.isnan(loss)))
        if i >= warmup:
            walls.append(timing["local_train_wall_s"])
            peaks.append(peak_memory_value(session.device))
    return {"warmup_updates": warmup, "measured_updates": measured,
            metrics_io.IN_PROCESS_WALLS: walls, "peak_bytes": peaks, metrics_io.IN_PROCESS_LOSS_EQUAL: same}


@contextmanager
def traced(session: Session, plan: list[MicroStep], enabled: bool) -> Iterator[Any]:
    """A :class:`~replayjob.producers.trace_recorder.Recorder` attached around the update when ``enabled``
    (``--trace``), else ``None`` with nothing attached.  The test-only fault is refused unless tracing
    is on; a producer that cannot be traced is refused by name."""
    import torch
    armed = faults.armed()
    if not enabled:
        if armed is not None:
            raise UsageError(f"{faults.FAULT_ENV} is set but tracing is off", hint="add --trace, or unset it")
        yield None
        return
    if session.trace_refusal:
        raise ConfigError(f"a traced replay of a {session.framework} capture is refused: {session.trace_refusal}",
                          where="optimizer_batch.trace", hint="drop --trace")
    optimizer = session.optimizer
    inner = getattr(optimizer, "optimizer", None)  # a wrapper (accelerate's) steps the optimizer it holds
    rec = Recorder(session.model, plan, session.trainable(),
                   inner if isinstance(inner, torch.optim.Optimizer) else optimizer, armed)
    with rec.attached():
        yield rec


def replay(build: Callable[[], Session], out: Path, *, arm: str, repeat_index: int, slot: Slot | None,
           allowed: list[str], strict: bool, seed: int | None, trace: bool, warmup_updates: int,
           measured_updates: int, where: str) -> dict[str, Any]:
    """Run one admitted replay into ``out`` (see the module docstring); return replay_metrics.json
    (``{}`` on a rank other than the root).  ``build`` returns the producer's session; ``allowed``: the
    declared knobs (each checked on the built model); ``where``: the config key a refusal names."""
    import torch
    refuse_unusable_out(out)
    t_start = time.perf_counter()
    prov = determinism.establish(strict=strict, seed=seed)
    session = build()
    determinism.mark_model_built(strict)
    if measured_updates and session.repeat_refusal:
        raise ConfigError(f"in-process repeats of a {session.framework} replay are refused: "
                          f"{session.repeat_refusal}", where="optimizer_batch.measured_updates",
                          hint="drop warmup_updates/measured_updates (use --repeat N)")
    for key in allowed:  # admitted; a knob's condition on the built model is checked too (stack keys have none)
        knob = knobs.KNOBS.get(key)
        why = knob.model_refusal(session.model) if knob is not None else None
        if why:
            raise ContractError(f"difference {key!r} is not systems-only here: {why}", where=where,
                                hint=f"remove {key!r} from this arm or switch the dropout off in both runs")
    session.restore()
    prov.update(session.provenance())
    plan = session.plan()
    _reset_peak(session.device)
    with Probe(session.device) as probe:  # what contended with the timed updates
        with traced(session, plan, trace) as tracer:
            outcome, timing = update(session, plan)
        peak = peak_memory_value(session.device)
        final_file = session.save_adapter(out)
        repeats = in_process(session, plan, outcome.loss, warmup_updates, measured_updates)
    runtime = knobs.observe_all(session.runtime(plan), session.framework)
    metrics = metrics_io.replay_document(
        **session.document(outcome, plan), arm=arm, repeat_index=repeat_index, runtime=runtime, loss=outcome.loss,
        grad_norm=outcome.grad_norm, timing=timing, peak=peak, device=str(session.device),
        torch_version=torch.__version__, host=host_provenance(session.device))
    metrics = session.land(out, metrics)
    if not metrics:
        return {}
    assert final_file is not None  # the root rank
    metrics.update({metrics_io.FINAL_ADAPTER: sha256_file(final_file),
                    metrics_io.FINAL_ADAPTER_PATH: final_file.relative_to(out).as_posix(),
                    "provenance": prov,
                    metrics_io.SCHEDULE: None if slot is None else slot.to_json(),
                    metrics_io.IN_PROCESS: repeats,
                    metrics_io.CONTENTION: probe.record(),
                    "wall_s": time.perf_counter() - t_start})
    if tracer is not None:  # before replay_metrics.json, which pins the trace index
        metrics[metrics_io.TRACE] = tracer.write(out, metrics, session.trace_identity(runtime))
    routing = moe.replay_evidence(session.model, out, {"logical_batch_sha256": metrics[metrics_io.LOGICAL],
                                                       "manifest_sha256": metrics[metrics_io.MANIFEST]})
    if routing is not None:  # an MoE model's routing of the fresh update, pinned like the trace
        metrics[metrics_io.ROUTING] = routing
    metrics_io.write_replay(out, metrics)
    return metrics
