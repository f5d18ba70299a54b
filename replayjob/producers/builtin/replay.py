"""replayjob's own trainer as a producer (``training.trainer = "optimizer_replay"``), and ``replayjob replay``.

:class:`BuiltinSession` stands the reference trainer at the captured step for the one replay
driver (:mod:`replayjob.producers.driver`, which owns the sequence): admission (every pin, the
contract and the declared differences, see :mod:`~replayjob.producers.builtin.admission`), the backend, the
pinned adapter (its hash re-checked after loading), a fresh optimizer with the captured state, and
the trainer's own update (:class:`~replayjob.rl.update.Update`), the captured Torch RNG state
restored right before the first loss call.  No dataset, environment, rollout or sampling module is
imported.

``replay_metrics.json`` (see ``docs/replay-metrics.md``) stands alone.  ``--repeat N`` runs N
replays, each in a fresh ``python -m replayjob replay`` process so timings are independent, in
``DIR/repeat-000`` ...; each child gets its index through the internal ``--repeat-index`` option.
A launcher running a paired schedule (:mod:`replayjob.artifacts.schedule`) passes ``--slot``, which is
recorded next to the ``host`` record so the reducer can pair replays by block and check where they ran.
In-process repeats (``optimizer_batch.warmup_updates`` / ``measured_updates``) are the driver's.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import metrics as metrics_io
from replayjob.artifacts.capture_reader import CaptureManifest, producer_of
from replayjob.artifacts.schedule import Slot
from replayjob.config import Config, config_sha256, load_config
from replayjob.errors import ArtifactExistsError, ContractError, UsageError, error_for_exit_status
from replayjob.model.backend import load_backend
from replayjob.producers import driver, producer_module
from replayjob.producers.api import admission
from replayjob.producers.api import replay as integration_replay
from replayjob.producers.builtin import steps as stepcapture
from replayjob.producers.builtin.admission import Admission, admit
from replayjob.producers.session import MicroStep, Outcome, Session
from replayjob.rl.state import FINAL_ADAPTER_DIR, check_model
from replayjob.rl.update import Update, UpdateResult, make_optimizer
from replayjob.runtime import distributed, knobs

if TYPE_CHECKING:
    import torch

METRICS_FILE = metrics_io.REPLAY_FILE


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the input embedding (a captured token id must index it)."""
    get = getattr(model, "get_input_embeddings", None)
    n = getattr(get(), "num_embeddings", None) if callable(get) else None
    return n if isinstance(n, int) else None


class BuiltinSession(Session):
    """replayjob's own trainer stood at the captured step: the backend, the pinned adapter, a fresh
    optimizer with the captured state, this rank's shard of the logical rows, and the trainer's own
    update (:class:`replayjob.rl.update.Update`)."""

    framework = knobs.BUILTIN

    def __init__(self, cfg: Config, adm: Admission):
        assert adm.manifest and adm.batch is not None and adm.rng is not None and adm.state  # admitted
        self.cfg, self.adm = cfg, adm
        self.world, self.rank = distributed.world_size(), distributed.rank()
        if self.world > 1 or cfg.distributed.strategy == "fsdp2":
            why = "it runs in one process on whole parameters; over several ranks or sharded (fsdp2) it is refused"
            self.trace_refusal = self.repeat_refusal = why
        self.policy = policy = load_backend(cfg.backend.name).build(cfg)
        self.model, self.device = policy.model, policy.device
        check_model(adm.state, policy.model_reference())
        # the manifest's pin is checked over the very bytes the adapter tensors are built from
        policy.load_adapter(adm.state.adapter_file, adm.manifest.initial_adapter_sha256)
        vocab = _vocab_size(policy.model) or policy.tokenizer.vocab_size
        top = int(adm.batch.tokens.max())
        if top >= vocab:
            raise ContractError(f"captured token id {top} is outside this model's vocabulary ({vocab})",
                                where=adm.manifest.payload_path)
        self.parallel = distributed.wrap(policy.model, cfg, policy)  # None for strategy "none"
        self.batch, self.bounds = adm.batch, (0, adm.batch.rows)
        if self.parallel is not None:  # this rank's contiguous shard of the logical rows, re-split for this world
            self.bounds = distributed.shard_bounds(self.batch.rows, self.world)[self.rank]
            self.batch = self.batch.shard(*self.bounds)
        self.start = {n: p.detach().clone() for n, p in policy.trainable()}
        self.optimizer = make_optimizer(policy, cfg)
        self.update: Update | None = None
        self.result: UpdateResult | None = None

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.policy.trainable())

    def restore(self) -> None:
        """The pinned adapter weights and a fresh optimizer holding the captured state (a chosen step's)."""
        import torch
        assert self.adm.manifest is not None and self.adm.state is not None
        with torch.no_grad():
            for name, p in self.policy.trainable():
                p.copy_(self.start[name])
        self.optimizer = make_optimizer(self.policy, self.cfg)
        stepcapture.restore_optimizer(self.optimizer, self.adm.manifest, self.adm.state)
        self.update = Update(self.policy, self.optimizer, self.cfg, parallel=self.parallel)

    def plan(self) -> list[MicroStep]:
        assert self.update is not None
        mbs = self.update.micro_batches(self.batch)
        first = self.bounds[0]
        # one RNG state, captured before the update's first loss call (this rank's, over several ranks)
        return [MicroStep(tuple(first + r for r in mb.rows), self.adm.rng_for(self.rank) if i == 0 else None, mb,
                          mb.input_ids, mb.attention_mask) for i, mb in enumerate(mbs)]

    def begin(self, n_micro_batches: int) -> None:
        assert self.update is not None
        self.update.begin(n_micro_batches)

    def micro_batch(self, i: int, step: MicroStep, before_loss: Callable[[], None]) -> None:
        assert self.update is not None
        self.update.micro_batch(i, step.data, before_loss)

    def finish(self) -> Outcome:
        assert self.update is not None
        res = self.result = self.update.finish(self.batch.rows)
        return Outcome(res.loss, res.grad_norm, backward_wall_s=res.backward_wall_s,
                       forward_wall_s=res.forward_wall_s, optimizer_wall_s=res.optimizer_wall_s)

    def save_adapter(self, out: Path) -> Path | None:
        return distributed.save_adapter(self.policy, out / FINAL_ADAPTER_DIR, self.parallel)  # rank 0 writes it

    def runtime(self, plan: list[MicroStep]) -> knobs.Runtime:
        mb_rows = [n for rows in distributed.gather_objects([len(s.rows) for s in plan]) for n in rows]
        return knobs.Runtime(self.policy.model, tuple(mb_rows), parallel=self.parallel, world_size=self.world)

    def provenance(self) -> dict[str, Any]:
        return {"attn_implementation": self.cfg.backend.options.attn_implementation, "device": str(self.device)}

    def document(self, outcome: Outcome, plan: list[MicroStep]) -> dict[str, Any]:
        adm, cfg, res = self.adm, self.cfg, self.result
        assert adm.manifest is not None and adm.batch is not None and adm.rows is not None and res is not None
        m = adm.manifest
        logical, effective = adm.batch.digests()  # the rows as replayed, hashed again after the update
        return dict(
            framework=knobs.BUILTIN,
            pins={"expected_logical_sha256": adm.pins["expected_logical_sha256"],
                  "expected_manifest_sha256": adm.pins["expected_manifest_sha256"],
                  "payload_spans_sha256": m.payload_digest},
            manifest_sha256=m.sha256, logical=logical, effective=effective,
            initial_adapter_sha256=m.initial_adapter_sha256, allowed=adm.allowed, observed=adm.observed,
            knob_values=adm.knob_values(),
            padding={"real_tokens": res.real_tokens, "padded_tokens": res.padded_tokens,
                     "padding_fraction": res.padding_fraction, "micro_batches": res.micro_batches},
            rows=adm.rows,  # counted and summed as the payload was verified
            rng_restored=sorted(adm.rng or {}), tolerances_sha256=cfg.optimizer_batch.tolerances_sha256,
            budgets_sha256=cfg.optimizer_batch.budgets_sha256, config_sha256=config_sha256(cfg), step=m.step)

    def trace_identity(self, runtime: dict[str, Any]) -> dict[str, Any]:
        return knobs.trace_condition(knobs.BUILTIN, runtime)

    def land(self, out: Path, metrics: dict[str, Any]) -> dict[str, Any]:
        """Over several ranks: write this rank's figures (``replay_metrics.rank-<r>.json``), wait for every
        rank, and on rank 0 return the replay's metrics with the merged figures and the rank files listed
        (``{}`` on the other ranks); see :func:`replayjob.artifacts.metrics.merge_ranks`."""
        if self.world == 1:
            return metrics
        res, rank, world = self.result, self.rank, self.world
        assert res is not None and res.local_loss is not None  # an update over several ranks sets its shard's loss
        logical, effective = self.batch.digests()
        mine = metrics_io.rank_document(rank=rank, world_size=world, replay=metrics, rows=list(self.bounds),
                                        shard_logical=logical, shard_effective=effective, loss=res.local_loss,
                                        micro_batch_rows=list(res.micro_batch_rows))
        out.mkdir(parents=True, exist_ok=True)
        shas = distributed.gather_objects(metrics_io.write(out / metrics_io.rank_file(rank), mine, exclusive=True))
        distributed.barrier()  # every rank's file is on disk
        if rank != distributed.ROOT_RANK:
            return {}
        docs = [metrics_io.read_rank(out / metrics_io.rank_file(r), shas[r]) for r in range(world)]
        metrics.update(metrics_io.merge_ranks(docs, metrics[metrics_io.NONFINITE_OUTCOME]))
        metrics[metrics_io.DISTRIBUTED] = {
            "world_size": world, "strategy": distributed.strategy_of(self.parallel), "sharding": distributed.SHARDING,
            "ranks": [{"rank": r, "file": metrics_io.rank_file(r), "sha256": shas[r], "rows": docs[r]["rows"]}
                      for r in range(world)]}
        return metrics


def replay(cfg: Config, out: Path, repeat_index: int = 0, slot: Slot | None = None,
           manifest: CaptureManifest | None = None) -> dict[str, Any]:
    """Admit, then run one replay into ``out`` through the one driver; return (and write) replay_metrics.json
    (``manifest``: the capture's manifest as the caller verified it, :func:`admit`).

    Under torchrun each rank runs this (:mod:`replayjob.runtime.distributed`): the world size observed into the
    config, every rank admits (verifying every captured rank) and takes its shard of the logical rows;
    rank 0 returns the replay's metrics, the other ranks ``{}``."""
    if repeat_index < 0:
        raise UsageError(f"--repeat-index must be >= 0, found {repeat_index}")
    cfg = distributed.observe(cfg)
    with distributed.process_group(cfg):
        adm = admit(cfg, manifest=manifest)
        adm.raise_if_refused()
        world, rank = distributed.world_size(), distributed.rank()
        names = [METRICS_FILE, FINAL_ADAPTER_DIR] + ([metrics_io.rank_file(rank)] if world > 1 else [])
        for name in names:
            if (out / name).exists():
                raise ArtifactExistsError("output directory already holds a replay", where=out / name,
                                          hint="choose a new --out directory")
        ob = cfg.optimizer_batch
        return driver.replay(lambda: BuiltinSession(cfg, adm), out, arm=adm.arm, repeat_index=repeat_index,
                             slot=slot, allowed=adm.allowed, strict=cfg.backend.options.strict_deterministic,
                             seed=cfg.training.seed, trace=ob.trace, warmup_updates=ob.warmup_updates,
                             measured_updates=ob.measured_updates,
                             where=ob.replay_path or "optimizer_batch.replay_path")


def replay_command(config: str | Path, overrides: list[str], out: str | Path | None,
                   repeat: int | None, repeat_index: int,
                   slot: Slot | None = None, nproc: int = 1,
                   launcher: str = "torchrun") -> list[tuple[Path, dict[str, Any]]]:
    """``replayjob replay``: one replay in this process, or ``repeat`` fresh-process replays.

    The capture's manifest names its producer (:func:`replayjob.artifacts.capture_reader.producer_of`): an external
    trainer's capture is replayed through :mod:`replayjob.integrations`; the fan-out is the same for
    all (``nproc`` > 1 for a producer whose module sets ``RANKS``, TRL; refused by name for the others).
    ``nproc`` > 1 runs each replay on that many ranks of this node, launched by
    :func:`replayjob.runtime.distributed.run_launched` (also for a single replay without ``repeat``;
    ``launcher``: torchrun, or srun inside a Slurm allocation, see
    :func:`replayjob.runtime.distributed.launch_command`).  On a rank other than 0 (this process launched by
    torchrun) the metrics returned are ``{}``.
    """
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, found {nproc}")
    producer, manifest = producer_of(config, overrides)
    if producer != knobs.BUILTIN:
        icfg = admission.load(config, overrides)
        if nproc > 1 and not getattr(producer_module(icfg.framework), "RANKS", False):
            raise UsageError(f"a {icfg.framework} replay runs in one process; --nproc applies to replayjob's own "
                             "trainer and to producers that replay over several processes (trl)", where="--nproc")
        if out is None:
            raise UsageError("an integration replay needs --out DIR")
        out_dir = Path(out)

        def one(d: Path, index: int) -> dict[str, Any]:
            return integration_replay.replay(icfg, d, index, slot, manifest)

        def refuse_early() -> None:
            admission.admit(icfg, processes=nproc, manifest=manifest).raise_if_refused()
    else:
        cfg = load_config(config, overrides)
        out_dir = Path(out or cfg.logging.dir)

        def one(d: Path, index: int) -> dict[str, Any]:
            return replay(cfg, d, index, slot, manifest)

        def refuse_early() -> None:
            admit(distributed.observe(cfg, running=False, planned=nproc), keep_rows=False,
                  manifest=manifest).raise_if_refused()
    if repeat is None:
        if nproc == 1:
            return [(out_dir, one(out_dir, repeat_index))]
        refuse_early()  # here, before starting N processes
        return [(out_dir, _spawn(config, overrides, out_dir, repeat_index, nproc, slot, launcher))]
    if slot is not None:
        raise UsageError("--slot names one replay's place in a schedule; it does not combine with --repeat")
    if repeat < 1:
        raise UsageError(f"--repeat must be >= 1, found {repeat}")
    refuse_early()  # refuse once, before starting N processes
    dirs = [out_dir / f"repeat-{i:03d}" for i in range(repeat)]
    for d in dirs:
        if (d / METRICS_FILE).exists() or (d / FINAL_ADAPTER_DIR).exists():
            raise ArtifactExistsError("a replay already exists here", where=d, hint="choose a new --out")
    return [(d, _spawn(config, overrides, d, i, nproc, launcher=launcher)) for i, d in enumerate(dirs)]


def _spawn(config: str | Path, overrides: list[str], d: Path, index: int, nproc: int,
           slot: Slot | None = None, launcher: str = "torchrun") -> dict[str, Any]:
    """One replay in fresh processes: ``python -m replayjob replay`` (``nproc`` ranks: launched by torchrun)."""
    argv = ["replay", str(Path(config).resolve()), "--out", str(d), "--repeat-index", str(index)]
    if slot is not None:
        argv += ["--slot", slot.arg()]
    for item in overrides:
        argv += ["--set", item]
    if nproc == 1:
        proc = subprocess.run([sys.executable, "-m", "replayjob", *argv], capture_output=True, text=True, check=False)
        code, tail = proc.returncode, (proc.stderr or proc.stdout).strip()[-2000:]
    else:
        code, tail = distributed.run_launched(nproc, argv, launcher=launcher)
    if code != 0:
        raise error_for_exit_status(code)(  # 3 or a signal stays retryable (exit 3)
            f"repeat {index} exited with status {code}: {tail}", where=d)
    return metrics_io.read_replay(d / METRICS_FILE).doc
