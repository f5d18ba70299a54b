"""One replayed update of an external trainer's capture, shared by every framework.

Order: admission (:mod:`~replayjob.integrations.admission`; nothing is built unless it admits),
the framework's session (its own trainer on the base model, no dataset, reward or generation),
the captured adapter copied into the trainable parameters (re-hashed after loading), the captured
optimizer and LR-scheduler state, then for each captured micro-batch the framework's own training
step with the Torch RNG state restored right before its loss call, then the framework's clip /
optimizer step / scheduler step / zero-grad sequence, exactly once.  ``replay_metrics.json`` is
built by :func:`replayjob.optbatch.replay.metrics_document` and written by
:func:`~replayjob.optbatch.replay.write_metrics` (through :mod:`replayjob.metrics`), with the
observation of every registered knob of the framework (:func:`replayjob.optbatch.knobs.observe_all`)
and the host it ran on, so ``reduce`` reads and gates it like a built-in replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from replayjob import determinism
from replayjob import metrics as metrics_io
from replayjob.deploy.schedule import Slot
from replayjob.digest import sha256_bytes
from replayjob.errors import ArtifactExistsError, ContractError, UsageError
from replayjob.integrations import capture as cap
from replayjob.integrations import framework_module
from replayjob.integrations.admission import Admission, ReplayConfig, admit
from replayjob.optbatch import knobs
from replayjob.optbatch.replay import METRICS_FILE, metrics_document, write_metrics
from replayjob.rl.diag import peak_memory_value
from replayjob.rl.state import restore_rng


class ReplaySession:
    """What a framework module's ``build_replay(adm, out)`` returns: its trainer, stood at the step.

    ``micro_batch`` runs one captured micro-batch through the framework's own training step and
    calls ``before_loss`` immediately before the loss; ``step`` performs the framework's clip,
    optimizer step, scheduler step and zero-grad once and returns the pre-clip gradient norm.
    ``backward_wall_s`` accumulates the time spent in backward when the framework can tell it.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    device: torch.device = torch.device("cpu")
    backward_wall_s: float = 0.0

    def micro_batch(self, mb: cap.MicroBatch, inputs: dict[str, Any], call: dict[str, Any],
                    before_loss: Callable[[], None]) -> float:
        raise NotImplementedError

    def step(self) -> float:
        raise NotImplementedError

    def plan(self, mbs: list[cap.MicroBatch]) -> list[cap.MicroBatch]:
        """The micro-batches the update runs: the captured ones (a framework whose knobs regroup rows returns
        them regrouped; the logical digest stays the captured inputs')."""
        return mbs

    def reported_loss(self, summed: float) -> float:
        """The step's loss as the framework reports it, from the sum of the micro-batch losses (that sum by
        default; TRL: accumulated in float32 and averaged over ranks, as its trainer logs it)."""
        return summed

    def runtime(self, rows: tuple[int, ...]) -> knobs.Runtime:
        """What the framework's knobs are observed from after the update (the built model by default)."""
        return knobs.Runtime(self.model, rows)


def _on(device: torch.device, group: dict[str, torch.Tensor], values: dict[str, Any]) -> dict[str, Any]:
    return {**{k: t.to(device) for k, t in group.items()}, **values}


def padding(mbs: list[cap.MicroBatch]) -> dict[str, Any]:
    """Real and padded positions, counted over every captured input named ``*mask``."""
    masks = [t for m in mbs for k, t in m.inputs.items() if k.endswith("mask")]
    total = sum(t.numel() for t in masks)
    real = sum(int(torch.count_nonzero(t)) for t in masks)
    return {"real_tokens": real, "padded_tokens": total - real,
            "padding_fraction": (total - real) / total if total else 0.0, "micro_batches": len(mbs)}


def load_state(adm: Admission, session: ReplaySession) -> None:
    """Copy the captured adapter into the trainable parameters and load the optimizer and scheduler state."""
    m = adm.manifest
    assert m is not None and adm.adapter is not None and adm.optimizer is not None
    params = cap.trainable_parameters(session.model)
    if list(params) != list(m.doc["trainable"]):
        missing = sorted(set(m.doc["trainable"]) - set(params))
        extra = sorted(set(params) - set(m.doc["trainable"]))
        raise ContractError(f"the rebuilt model's trainable parameters differ from the capture's (missing "
                            f"{missing[:3]}, extra {extra[:3]}, or another order)", where=m.file("adapter"))
    with torch.no_grad():
        for name, p in params.items():
            t = adm.adapter[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise ContractError(f"adapter tensor {name} is {t.dtype}{list(t.shape)}, the model's parameter "
                                    f"{p.dtype}{list(p.shape)}", where=m.file("adapter"))
            p.copy_(t)
    loaded = sha256_bytes(cap.safetensors_bytes(params, "adapter"))
    if loaded != m.initial_adapter_sha256:  # the bytes the model now holds are the pinned ones
        raise ContractError(f"the loaded adapter hashes to {loaded}, the manifest pins {m.initial_adapter_sha256}",
                            where=m.file("adapter"))
    ordered = [p for g in session.optimizer.param_groups for p in g["params"]]
    doc = m.doc["optimizer"]
    session.optimizer.load_state_dict(cap.join_optimizer_state(adm.optimizer, doc, ordered, m.file("optimizer")))
    if doc["scheduler"] is not None:
        if session.scheduler is None:
            raise ContractError("the capture holds an LR-scheduler state but the rebuilt trainer has no scheduler",
                                where=m.path)
        session.scheduler.load_state_dict(doc["scheduler"])


def replay(cfg: ReplayConfig, out: Path, repeat_index: int = 0, slot: Slot | None = None) -> dict[str, Any]:
    """Admit, then run one replay into ``out``; return (and write) replay_metrics.json (``slot``: its place in
    a paired schedule, recorded as for a built-in replay)."""
    if repeat_index < 0:
        raise UsageError(f"--repeat-index must be >= 0, found {repeat_index}")
    adm = admit(cfg)
    adm.raise_if_refused()
    for name in (METRICS_FILE, cap.FINAL_ADAPTER_FILE):
        if (out / name).exists():
            raise ArtifactExistsError("output directory already holds a replay", where=out / name,
                                      hint="choose a new --out directory")
    m, mbs = adm.manifest, adm.micro_batches
    assert m is not None and mbs is not None and adm.resolved is not None
    t_start = time.perf_counter()
    prov = determinism.establish(strict=False, seed=None)
    session: ReplaySession = framework_module(m.framework).build_replay(adm, out)
    determinism.mark_model_built(False)
    for key in adm.allowed:  # admitted; a knob's condition on the built model is checked too (stack keys have none)
        knob = knobs.KNOBS.get(key)
        why = knob.model_refusal(session.model) if knob is not None else None
        if why:
            raise ContractError(f"difference {key!r} is not systems-only here: {why}",
                                where=cfg.optimizer_batch.replay_path or "optimizer_batch.replay_path",
                                hint=f"remove {key!r} from this arm")
    load_state(adm, session)
    prov["attn_implementation"] = adm.resolved.get("model", {}).get("attn_implementation")
    prov["device"] = str(session.device)
    if session.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(session.device)
    loss = 0.0
    planned = session.plan(mbs)
    t0 = time.perf_counter()
    for mb in planned:
        loss += session.micro_batch(mb, _on(session.device, mb.inputs, mb.input_values),
                                    _on(session.device, mb.call, mb.call_values),
                                    lambda mb=mb: restore_rng(mb.rng))  # type: ignore[misc]
    loss = session.reported_loss(loss)
    t1 = time.perf_counter()
    grad_norm = session.step()
    t2 = time.perf_counter()
    peak = peak_memory_value(session.device)
    final_sha = cap.save_adapter(out / cap.FINAL_ADAPTER_FILE, session.model)
    rows = tuple(cap.batch_rows([mb]) for mb in planned)  # the micro-batch sizes the update ran
    runtime = knobs.observe_all(session.runtime(rows), m.framework)  # the framework's knobs, read from its trainer
    logical = cap.logical_digest(mbs)  # the inputs as replayed, hashed again
    metrics = metrics_document(
        framework=m.framework, arm=adm.arm, repeat_index=repeat_index,
        pins={"expected_logical_sha256": adm.pins["expected_logical_sha256"],
              "expected_manifest_sha256": adm.pins["expected_manifest_sha256"],
              "payload_spans_sha256": m.payload_digest},
        manifest_sha256=m.sha256, logical=logical, effective=cap.effective_digest(mbs, logical),
        initial_adapter_sha256=m.initial_adapter_sha256,
        allowed=adm.allowed, observed=adm.observed, knob_values=adm.knob_values(),
        runtime=runtime, loss=loss, grad_norm=grad_norm,
        timing={"local_train_wall_s": t2 - t0, "forward_wall_s": max(t1 - t0 - session.backward_wall_s, 0.0),
                "backward_wall_s": session.backward_wall_s, "optimizer_wall_s": t2 - t1},
        peak=peak, device=session.device, padding=padding(mbs), rows=cap.rows_summary(mbs),
        rng_restored=sorted({k for mb in mbs for k in mb.rng}),
        tolerances_sha256=cfg.optimizer_batch.tolerances_sha256, budgets_sha256=cfg.optimizer_batch.budgets_sha256,
        config_sha256=cfg.sha256)
    metrics.update({metrics_io.STEP: m.step,
                    metrics_io.FINAL_ADAPTER: final_sha,
                    metrics_io.FINAL_ADAPTER_PATH: cap.FINAL_ADAPTER_FILE, "provenance": prov,
                    metrics_io.SCHEDULE: None if slot is None else slot.to_json(),
                    metrics_io.IN_PROCESS: None,  # in-process repeats: replayjob's own trainer only (refused)
                    "wall_s": time.perf_counter() - t_start})
    write_metrics(out, metrics)
    return metrics
