"""The session every external producer's replay shares: a framework's trainer stood at the captured step.

A framework module (``trl.py``, ``torch_loop.py``) subclasses :class:`ReplaySession` and says only
how to rebuild its trainer (no dataset, reward or generation), how to run one captured micro-batch
through its own training step (:meth:`ReplaySession.run`) and its own clip / optimizer step /
scheduler step / zero-grad (:meth:`ReplaySession.optimizer_step`).  Everything else is here once,
for the one replay driver (:mod:`replayjob.producers.driver`, which owns the sequence and writes
``replay_metrics.json``): the captured adapter copied into the trainable parameters (re-hashed after
loading), the captured optimizer and LR-scheduler state, the plan of micro-batches with the RNG
state captured before each loss call, every captured tensor handed over in freshly allocated memory
(:func:`replayjob.producers.driver.fresh`), and the producer's part of the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import metrics as metrics_io
from replayjob.artifacts.capture_manifest import PinnedManifest
from replayjob.artifacts.metrics import rank_file
from replayjob.artifacts.schedule import Slot
from replayjob.digest import sha256_bytes
from replayjob.errors import ArtifactExistsError, ContractError, UsageError
from replayjob.model import moe
from replayjob.producers import driver, producer_module
from replayjob.producers.api import files as _files
from replayjob.producers.api import microbatch as _microbatch
from replayjob.producers.api.admission import Admission, ReplayConfig, admit
from replayjob.producers.session import MicroStep, Outcome, Session
from replayjob.rl.state import adapter_bytes, join_optimizer_state
from replayjob.runtime import distributed, knobs
from replayjob.runtime.distributed import launch_env

if TYPE_CHECKING:
    import torch


class ReplaySession(Session):
    """What a framework module's ``build_replay(adm, out)`` returns (see the module docstring).

    ``run`` runs one captured micro-batch through the framework's own training step and calls
    ``before_loss`` immediately before the loss; ``optimizer_step`` performs the framework's clip,
    optimizer step, scheduler step and zero-grad once and returns the pre-clip gradient norm.
    ``backward_wall_s`` accumulates the time spent in backward when the framework can tell it.
    """

    scheduler: Any = None
    backward_wall_s: float = 0.0
    adm: Admission
    _summed: float = 0.0
    _routing: moe.Routing | None = None
    _forced_table: moe.RoutingTable | None = None
    _reported: float = 0.0
    rank: int = 0  # this process among the replay's (a framework that runs over several sets them)
    world: int = 1

    # -- what a framework module provides -----------------------------------------------------------
    def run(self, mb: _microbatch.MicroBatch, inputs: dict[str, Any], call: dict[str, Any],
            before_loss: Callable[[], None]) -> float:
        raise NotImplementedError

    def optimizer_step(self) -> float:
        raise NotImplementedError

    def regroup(self, mbs: list[_microbatch.MicroBatch]) -> list[_microbatch.MicroBatch]:
        """The micro-batches the update runs: the captured ones (a framework whose knobs regroup rows returns
        them regrouped; the logical digest stays the captured inputs')."""
        return mbs

    def rows_of(self, mbs: list[_microbatch.MicroBatch]) -> int:
        """The rows (sequences, samples) ``mbs`` hold, as this framework counts them (the inputs' batch dimension
        by default, :func:`replayjob.producers.api.microbatch.batch_rows`)."""
        return _microbatch.batch_rows(mbs)

    def shard_begin(self, every: list[_microbatch.MicroBatch], mine: list[_microbatch.MicroBatch]) -> int:
        """The first logical row of this process's micro-batches ``mine`` (regrouped from ``every``): the rows of
        the micro-batches before them (the processes run contiguous runs of equal length)."""
        return self.rows_of(every[:self.rank * len(mine)])

    def reported_loss(self, summed: float) -> float:
        """The step's loss as the framework reports it, from the sum of the micro-batch losses (that sum by
        default; TRL: accumulated in float32 and averaged over ranks, as its trainer logs it)."""
        return summed

    def observe(self, rows: tuple[int, ...]) -> knobs.Runtime:
        """What the framework's knobs are observed from after the update (the built model by default)."""
        return knobs.Runtime(self.model, rows)

    def trace_inputs(self, mb: _microbatch.MicroBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The ``input_ids`` the model receives for ``mb`` and its token mask (a captured ``input_ids`` and
        ``attention_mask`` by default; ``None`` where the capture holds none: not traceable)."""
        import torch
        ids = mb.inputs.get("input_ids")
        mask = mb.inputs.get("attention_mask")
        if ids is not None and mask is None:
            mask = torch.ones_like(ids)
        return ids, mask

    def gradient_checkpointing(self, runtime: dict[str, Any]) -> bool:
        """Whether activation checkpointing was on (the model's own flag by default)."""
        return bool(getattr(self.model, "is_gradient_checkpointing", False))

    # -- the driver's protocol ----------------------------------------------------------------------
    def bind(self, adm: Admission) -> ReplaySession:
        self.adm = adm
        self.framework = adm.cfg.framework if adm.cfg is not None else ""
        return self

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(_files.trainable_parameters(self.model).items())

    def restore(self) -> None:
        load_state(self.adm, self)

    def plan(self) -> list[MicroStep]:
        out, first = [], 0
        for mb in self.regroup(self.adm.micro_batches or []):
            n = _microbatch.batch_rows([mb])
            ids, mask = self.trace_inputs(mb)
            if (ids is None or mask is None) and self.trace_refusal is None:  # the driver plans before tracing
                self.trace_refusal = "its captured inputs hold no input_ids (and token mask) the trace can key rows by"
            out.append(MicroStep(tuple(range(first, first + n)), mb.rng or None, mb, ids, mask))
            first += n
        return out

    def begin(self, n_micro_batches: int) -> None:
        self._summed, self.backward_wall_s = 0.0, 0.0
        # a mixture-of-experts model's routing, observed per micro-batch over the tokens the model receives (one
        # process holds every row; docs/moe.md): the driver writes it beside replay_metrics.json
        self._routing = self._routes(n_micro_batches) if self.world == 1 else None
        if self._routing is not None:
            self._routing.begin_update()

    def _routes(self, n_micro_batches: int) -> moe.Routing | None:
        """The model's routing observer: free, or under ``model.routing = "forced"`` the pinned routing file's experts
        forced (read and verified again here; admission checked it before the model was built)."""
        mode = (self.adm.resolved or {}).get("model", {}).get("routing", "free")
        if mode != "forced":
            return moe.observe(self.model)
        if self.world > 1:
            raise ContractError("forced routing runs in one process", where="model.routing",
                                hint="replay on one process, or leave routing free")
        for step in self.plan():
            if step.trace_mask is None:
                raise ContractError("forced routing needs the token mask of the sequence the model receives; the "
                                    "captured inputs hold none", where="model.routing", hint="leave routing free")
        assert self.adm.cfg is not None
        ob = self.adm.cfg.optimizer_batch
        if self._forced_table is None:  # once: in-process repeats force the same table
            self._forced_table = moe.forced_table(ob, self.adm.pins.get("expected_logical_sha256") or None)
        return moe.observe(self.model, forced=self._forced_table)

    def micro_batch(self, i: int, step: MicroStep, before_loss: Callable[[], None]) -> None:
        import contextlib
        mb: _microbatch.MicroBatch = step.data
        dev = self.device
        inputs = {**{k: driver.fresh(t, dev) for k, t in mb.inputs.items()}, **mb.input_values}
        call = {**{k: driver.fresh(t, dev) for k, t in mb.call.items()}, **mb.call_values}
        routed = (contextlib.nullcontext() if self._routing is None or step.trace_mask is None
                  else self._routing.micro_batch(step.rows, step.trace_mask))
        with routed:
            self._summed += self.run(mb, inputs, call, before_loss)

    def finish(self) -> Outcome:
        if self._routing is not None:
            self._routing.end_update()
        backward = self.backward_wall_s
        loss = self._reported = self.reported_loss(self._summed)
        grad_norm = self.optimizer_step()
        return Outcome(loss, grad_norm, backward_wall_s=backward)

    def save_adapter(self, out: Path) -> Path | None:
        if self.rank != 0:  # several processes: process 0 writes the adapter every process holds
            return None
        _files.save_adapter(out / _files.FINAL_ADAPTER_FILE, self.model)
        return out / _files.FINAL_ADAPTER_FILE

    def rank_loss(self) -> float:
        """This process's entry for the step's loss (the replay's loss is the entries' sum in rank order): the
        framework's reported loss, which already spans every process (TRL averages the processes' sums as it
        logs them), on process 0, and 0 on the others."""
        return self._reported if self.rank == 0 else 0.0

    def land(self, out: Path, metrics: dict[str, Any]) -> dict[str, Any]:
        """Over several processes: write this process's figures (``replay_metrics.rank-<r>.json``), wait for every
        process, and on process 0 return the metrics with the merged figures and the rank files listed (``{}``
        on the others); as the built-in trainer's replay (:func:`replayjob.artifacts.metrics.merge_ranks`)."""
        if self.world == 1:
            return metrics

        every = self.adm.micro_batches or []
        mine = self.regroup(every)
        begin = self.shard_begin(every, mine) if self.rank else 0
        logical = _microbatch.logical_digest(mine)
        pad = metrics["padding"]
        doc = metrics_io.rank_document(
            rank=self.rank, world_size=self.world, replay=metrics, rows=[begin, begin + self.rows_of(mine)],
            shard_logical=logical, shard_effective=_microbatch.effective_digest(mine), loss=self.rank_loss(),
            micro_batch_rows=[self.rows_of([mb]) for mb in mine],
            padding=pad)
        out.mkdir(parents=True, exist_ok=True)
        shas = distributed.gather_objects(metrics_io.write(out / metrics_io.rank_file(self.rank), doc,
                                                           exclusive=True))
        distributed.barrier()  # every process's file is on disk
        if self.rank != distributed.ROOT_RANK:
            return {}
        docs = [metrics_io.read_rank(out / metrics_io.rank_file(r), shas[r]) for r in range(self.world)]
        metrics.update(metrics_io.merge_ranks(docs, metrics[metrics_io.NONFINITE_OUTCOME]))
        metrics[metrics_io.DISTRIBUTED] = {
            "world_size": self.world, "strategy": "ddp", "sharding": "contiguous micro-batches",
            "ranks": [{"rank": r, "file": metrics_io.rank_file(r), "sha256": shas[r], "rows": docs[r]["rows"]}
                      for r in range(self.world)]}
        return metrics

    def runtime(self, plan: list[MicroStep]) -> knobs.Runtime:
        return self.observe(tuple(len(s.rows) for s in plan))

    def provenance(self) -> dict[str, Any]:
        """The attention kernel, the device and, where the capture recorded it, the dtype the update's matmuls
        computed in (``compute_dtype``: the replay runs the captured precision policy, whose flags are contract;
        ``trace-diff`` bounds rounding by it)."""
        m = self.adm.manifest
        recorded = m.doc["framework_state"].get("precision") if m is not None else None
        out = {"attn_implementation": (self.adm.resolved or {}).get("model", {}).get("attn_implementation"),
               "device": str(self.device)}
        if isinstance(recorded, dict) and isinstance(recorded.get("compute_dtype"), str):
            out["compute_dtype"] = recorded["compute_dtype"]
        return out

    def document(self, outcome: Outcome, plan: list[MicroStep]) -> dict[str, Any]:
        adm, m, mbs = self.adm, self.adm.manifest, self.adm.micro_batches
        assert m is not None and mbs is not None and adm.cfg is not None
        logical = _microbatch.logical_digest(mbs)  # the inputs as replayed, hashed again
        ob = adm.cfg.optimizer_batch
        return dict(
            framework=m.framework,
            pins={"expected_logical_sha256": adm.pins["expected_logical_sha256"],
                  "expected_manifest_sha256": adm.pins["expected_manifest_sha256"],
                  "payload_spans_sha256": m.payload_digest},
            manifest_sha256=m.sha256, logical=logical, effective=_microbatch.effective_digest(mbs),
            initial_adapter_sha256=m.initial_adapter_sha256, allowed=adm.allowed, observed=adm.observed,
            knob_values=adm.knob_values(), rows=_microbatch.rows_summary(mbs),
            padding=padding([s.data for s in plan] if self.world > 1 else mbs),  # this process's (land merges)
            rng_restored=sorted({k for mb in mbs for k in mb.rng}),
            tolerances_sha256=ob.tolerances_sha256, budgets_sha256=ob.budgets_sha256,
            config_sha256=adm.cfg.sha256, step=m.step)

    def trace_identity(self, runtime: dict[str, Any]) -> dict[str, Any]:
        """What the producer's knobs declare (:func:`replayjob.runtime.knobs.trace_condition`, which a trace's
        reader derives again from the replay's record), else the session's own view: the first micro-batch's rows
        and the model's checkpointing flag."""
        plan = self.regroup(self.adm.micro_batches or [])
        return {"micro_batch_size": _microbatch.batch_rows(plan[:1]) if plan else 0,
                "gradient_checkpointing": self.gradient_checkpointing(runtime),
                **knobs.trace_condition(self.framework, runtime)}


def padding(mbs: list[_microbatch.MicroBatch]) -> dict[str, Any]:
    """Real positions and every position after padding, counted over every captured input named ``*mask``."""
    import torch
    masks = [t for m in mbs for k, t in m.inputs.items() if k.endswith("mask")]
    total = sum(t.numel() for t in masks)
    real = sum(int(torch.count_nonzero(t)) for t in masks)
    return {"real_tokens": real, "padded_tokens": total,  # every position after padding, as every producer counts
            "padding_fraction": 1.0 - real / total if total else 0.0, "micro_batches": len(mbs)}


def load_state(adm: Admission, session: ReplaySession) -> None:
    """Copy the captured adapter into the trainable parameters and load the optimizer and scheduler state."""
    import torch
    m = adm.manifest
    assert m is not None and adm.adapter is not None and adm.optimizer is not None
    params = _files.trainable_parameters(session.model)
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
    loaded = sha256_bytes(adapter_bytes(params))
    if loaded != m.initial_adapter_sha256:  # the bytes the model now holds are the pinned ones
        raise ContractError(f"the loaded adapter hashes to {loaded}, the manifest pins {m.initial_adapter_sha256}",
                            where=m.file("adapter"))
    ordered = [p for g in session.optimizer.param_groups for p in g["params"]]
    doc = m.doc["optimizer"]
    # join copies every tensor: the optimizer updates them in place, and in-process repeats restore the
    # captured state again
    joined = join_optimizer_state(adm.optimizer, doc, ordered, m.file("optimizer"))
    try:  # torch's own checks of the groups against the rebuilt optimizer's: the capture's, not a failure
        session.optimizer.load_state_dict(joined)
    except ValueError as exc:
        raise ContractError(f"the captured optimizer state does not fit the rebuilt trainer's optimizer: "
                            f"{str(exc)[:200]} (optimizer.param_groups)", where=m.path,
                            hint="rebuild the optimizer the source step ran with (its param groups and their "
                                 "parameters), or recapture the step") from None
    if doc["scheduler"] is not None:
        if session.scheduler is None:
            raise ContractError("the capture holds an LR-scheduler state but the rebuilt trainer has no scheduler",
                                where=m.path)
        session.scheduler.load_state_dict(doc["scheduler"])


def replay(cfg: ReplayConfig, out: Path, repeat_index: int = 0, slot: Slot | None = None,
           manifest: PinnedManifest | None = None) -> dict[str, Any]:
    """Admit, then run one replay into ``out`` through the one driver; return (and write) replay_metrics.json
    (``slot``: its place in a paired schedule, recorded as for a built-in replay; ``manifest``: the capture's
    manifest as the caller verified it, :func:`~replayjob.producers.api.admission.admit`)."""
    if repeat_index < 0:
        raise UsageError(f"--repeat-index must be >= 0, found {repeat_index}")
    adm = admit(cfg, manifest=manifest)
    adm.raise_if_refused()

    launch = launch_env()
    for name in (driver.METRICS_FILE, _files.FINAL_ADAPTER_FILE, *([rank_file(launch.rank)] if launch.world_size > 1
                                                               else [])):
        if (out / name).exists():
            raise ArtifactExistsError("output directory already holds a replay", where=out / name,
                                      hint="choose a new --out directory")
    m = adm.manifest
    assert m is not None and adm.micro_batches is not None and adm.resolved is not None

    def build() -> Session:
        session: ReplaySession = producer_module(m.framework).build_replay(adm, out)
        return session.bind(adm)

    ob = cfg.optimizer_batch
    try:
        done = driver.replay(build, out, arm=adm.arm, repeat_index=repeat_index, slot=slot, allowed=adm.allowed,
                             strict=False, seed=None, trace=ob.trace, warmup_updates=ob.warmup_updates,
                             measured_updates=ob.measured_updates,
                             where=ob.replay_path or "optimizer_batch.replay_path")
    except BaseException:  # the framework's launcher opened the process group; leave it before exit
        distributed.leave_process_group(synchronize=False)
        raise
    distributed.leave_process_group(synchronize=True)
    return done
