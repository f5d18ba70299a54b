"""Replay (``training.trainer = "optimizer_replay"``): one optimizer update on captured rows.

Order, mirroring the source trainer's construction: admission (every pin, the contract and the
declared differences, see :mod:`~replayjob.optbatch.explain`), determinism controls, the backend,
the pinned adapter (its hash re-checked after loading), a fresh optimizer, then the captured Torch
RNG state, restored after construction, then exactly one :func:`~replayjob.rl.update.optimizer_update`
(the one the trainer uses) and the final adapter.  No dataset, environment, rollout or sampling
module is imported.

``replay_metrics.json`` (see ``docs/replay-metrics.md``) stands alone.  ``--repeat N`` runs N
replays, each in a fresh ``python -m replayjob replay`` process so timings are independent, in
``DIR/repeat-000`` ...; each child gets its index through the internal ``--repeat-index`` option.
A launcher running a paired schedule (:mod:`replayjob.deploy.schedule`) passes ``--slot``, which is
recorded next to the ``host`` record so the reducer can pair replays by block and check where they ran.

With ``optimizer_batch.measured_updates`` M (and ``warmup_updates`` W), after the fresh-process
update (the one whose adapter is saved) the same update runs W + M more times in this process, each
from the same restored state (adapter weights, a fresh optimizer, the captured RNG state); the W
warm-up ones are discarded and the M measured ones are recorded under ``in_process``, apart from
the fresh-process timing, with whether each reproduced the fresh update's loss bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import replayjob
from replayjob import determinism, distributed
from replayjob import metrics as metrics_io
from replayjob.config import Config, config_sha256, load_config
from replayjob.deploy.schedule import Slot
from replayjob.digest import sha256_file
from replayjob.errors import ArtifactExistsError, ConfigError, ContractError, UsageError, error_for_exit_status
from replayjob.hostinfo import host_provenance
from replayjob.model.backend import Policy, load_backend
from replayjob.optbatch import knobs, stepcapture
from replayjob.optbatch.explain import Admission, admit
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.diag import peak_memory_value
from replayjob.rl.state import check_model, restore_rng
from replayjob.rl.update import make_optimizer, optimizer_update
from replayjob.trace.recorder import traced_update

METRICS_SCHEMA = metrics_io.REPLAY_SCHEMA
METRICS_FILE = metrics_io.REPLAY_FILE
FINAL_ADAPTER_DIR = "final_adapter"


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the input embedding (a captured token id must index it)."""
    get = getattr(model, "get_input_embeddings", None)
    n = getattr(get(), "num_embeddings", None) if callable(get) else None
    return n if isinstance(n, int) else None


def _in_process(policy: Policy, cfg: Config, adm: Admission, start: dict[str, torch.Tensor],
                loss: float, batch: OptimizerBatch, parallel: distributed.Parallel | None) -> dict[str, Any] | None:
    """The warm-up and measured in-process updates, each from the restored start state."""
    ob = cfg.optimizer_batch
    if not ob.measured_updates:
        return None
    assert adm.manifest is not None and adm.state is not None
    assert adm.batch is not None and adm.rng is not None
    walls: list[float] = []
    peaks: list[int] = []
    same = True
    for i in range(ob.warmup_updates + ob.measured_updates):
        with torch.no_grad():
            for name, p in policy.trainable():
                p.copy_(start[name])
        optimizer = make_optimizer(policy, cfg)
        stepcapture.restore_optimizer(optimizer, adm.manifest, adm.state)
        restore_rng(adm.rng)
        if policy.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(policy.device)
        t0 = time.perf_counter()
        res = optimizer_update(policy, optimizer, batch, cfg, parallel=parallel)
        wall = time.perf_counter() - t0
        same = same and res.loss == loss
        if i >= ob.warmup_updates:
            walls.append(wall)
            peaks.append(peak_memory_value(policy.device))
    return {"warmup_updates": ob.warmup_updates, "measured_updates": ob.measured_updates,
            metrics_io.IN_PROCESS_WALLS: walls, "peak_bytes": peaks, metrics_io.IN_PROCESS_LOSS_EQUAL: same}


def replay(cfg: Config, out: Path, repeat_index: int = 0, slot: Slot | None = None) -> dict[str, Any]:
    """Admit, then run one replay into ``out``; return (and write) replay_metrics.json.

    Under torchrun each rank runs this (:mod:`replayjob.distributed`): the world size observed into the
    config, every rank admits (verifying every captured rank) and takes its shard of the logical rows;
    rank 0 returns the replay's metrics, the other ranks ``{}``."""
    if repeat_index < 0:
        raise UsageError(f"--repeat-index must be >= 0, found {repeat_index}")
    cfg = distributed.observe(cfg)
    with distributed.process_group(cfg):
        return _replay(cfg, out, repeat_index, slot)


def _replay(cfg: Config, out: Path, repeat_index: int, slot: Slot | None) -> dict[str, Any]:
    adm = admit(cfg)
    adm.raise_if_refused()
    world, rank = distributed.world_size(), distributed.rank()
    names = [METRICS_FILE, FINAL_ADAPTER_DIR] + ([metrics_io.rank_file(rank)] if world > 1 else [])
    for name in names:
        if (out / name).exists():
            raise ArtifactExistsError("output directory already holds a replay", where=out / name,
                                      hint="choose a new --out directory")
    if ((world > 1 or cfg.distributed.strategy == "fsdp2")
            and (cfg.optimizer_batch.trace or cfg.optimizer_batch.measured_updates)):
        raise ConfigError("a traced replay and in-process repeats run in one process on whole parameters; over "
                          "several ranks or sharded (fsdp2) they are refused", where="optimizer_batch",
                          hint="drop --trace / measured_updates, or replay on one rank without fsdp2")
    assert adm.manifest and adm.batch is not None and adm.rng is not None and adm.state  # admitted
    t_start = time.perf_counter()
    strict = cfg.backend.options.strict_deterministic
    prov = determinism.establish(strict=strict, seed=cfg.training.seed)
    policy = load_backend(cfg.backend.name).build(cfg)
    determinism.mark_model_built(strict)
    prov["attn_implementation"] = cfg.backend.options.attn_implementation
    prov["device"] = str(policy.device)
    check_model(adm.state, policy.model_reference())
    for key in adm.allowed:  # admitted, so each is a registered knob; now checked on the built model too
        why = knobs.KNOBS[key].model_refusal(policy.model)
        if why:
            raise ContractError(f"difference {key!r} is not systems-only here: {why}",
                                where=cfg.optimizer_batch.replay_path or "optimizer_batch.replay_path",
                                hint=f"remove {key!r} from this arm or switch the dropout off in both runs")
    # the manifest's pin is checked over the very bytes the adapter tensors are built from
    policy.load_adapter(adm.state.adapter_file, adm.manifest.initial_adapter_sha256)
    vocab = _vocab_size(policy.model) or policy.tokenizer.vocab_size
    top = int(adm.batch.tokens.max())
    if top >= vocab:
        raise ContractError(f"captured token id {top} is outside this model's vocabulary ({vocab})",
                            where=adm.manifest.payload_path)
    parallel = distributed.wrap(policy.model, cfg, policy)  # None for strategy "none"
    batch, bounds = adm.batch, (0, adm.batch.rows)
    if parallel is not None:  # this rank's contiguous shard of the logical rows, re-split for this world size
        bounds = distributed.shard_bounds(batch.rows, world)[rank]
        batch = batch.shard(*bounds)
    optimizer = make_optimizer(policy, cfg)
    stepcapture.restore_optimizer(optimizer, adm.manifest, adm.state)  # a chosen step's pinned start state
    start = ({n: p.detach().clone() for n, p in policy.trainable()}
             if cfg.optimizer_batch.measured_updates else {})
    restore_rng(adm.rng_for(rank))
    if policy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(policy.device)
    t0 = time.perf_counter()
    with traced_update(cfg, policy, optimizer, adm.batch) as tracer:  # None (nothing attached) unless --trace
        res = optimizer_update(policy, optimizer, batch, cfg, parallel=parallel)
    local_train_wall_s = time.perf_counter() - t0
    peak = peak_memory_value(policy.device)
    final_file = distributed.save_adapter(policy, out / FINAL_ADAPTER_DIR, parallel)  # rank 0 writes it
    in_process = _in_process(policy, cfg, adm, start, res.loss, batch, parallel)
    mb_rows = [n for rows in distributed.gather_objects(res.micro_batch_rows) for n in rows]
    observed = knobs.observe_all(knobs.Runtime(policy.model, tuple(mb_rows), parallel=parallel, world_size=world))
    metrics = _metrics(adm, cfg, repeat_index, res, local_train_wall_s, peak, policy.device, observed)
    if world > 1:
        metrics = _land_rank(out, metrics, res, batch, rank, world, bounds, parallel)
        if not metrics:
            return {}
    assert final_file is not None  # rank 0
    metrics.update({
        metrics_io.FINAL_ADAPTER: sha256_file(final_file),
        metrics_io.FINAL_ADAPTER_PATH: str(final_file.relative_to(out)),
        "provenance": prov,
        metrics_io.SCHEDULE: None if slot is None else slot.to_json(),
        metrics_io.IN_PROCESS: in_process,
        "wall_s": time.perf_counter() - t_start,
    })
    if tracer is not None:  # before replay_metrics.json, which pins the trace index
        metrics[metrics_io.TRACE] = tracer.write(out, metrics)
    write_metrics(out, metrics)
    return metrics


def _land_rank(out: Path, metrics: dict[str, Any], res: Any, batch: OptimizerBatch, rank: int, world: int,
               rows: tuple[int, int], parallel: distributed.Parallel | None) -> dict[str, Any]:
    """Over several ranks: write this rank's figures (``replay_metrics.rank-<r>.json``), wait for every rank,
    and on rank 0 return the replay's metrics with the merged figures and the rank files listed (``{}``
    on the other ranks); see :func:`replayjob.metrics.merge_ranks`."""
    logical, effective = batch.digests()
    mine = {"schema": metrics_io.RANK_SCHEMA, "rank": rank, "world_size": world, "arm": metrics["arm"],
            "repeat_index": metrics["repeat_index"], "rows": list(rows), "shard_logical_sha256": logical,
            "shard_effective_rows_sha256": effective, "loss": res.local_loss,
            "micro_batch_rows": list(res.micro_batch_rows), "timing": metrics["timing"],
            "memory": metrics["memory"], "padding": metrics["padding"], metrics_io.HOST: metrics[metrics_io.HOST]}
    out.mkdir(parents=True, exist_ok=True)
    shas = distributed.gather_objects(metrics_io.write(out / metrics_io.rank_file(rank), mine, exclusive=True))
    distributed.barrier()  # every rank's file is on disk
    if rank != distributed.ROOT_RANK:
        return {}
    docs = [metrics_io.read_rank(out / metrics_io.rank_file(r), shas[r]) for r in range(world)]
    metrics.update(metrics_io.merge_ranks(docs))
    metrics[metrics_io.DISTRIBUTED] = {
        "world_size": world, "strategy": distributed.strategy_of(parallel), "sharding": distributed.SHARDING,
        "ranks": [{"rank": r, "file": metrics_io.rank_file(r), "sha256": shas[r], "rows": docs[r]["rows"]}
                  for r in range(world)]}
    return metrics


def metrics_document(*, framework: str, arm: str, repeat_index: int, pins: dict[str, str], manifest_sha256: str,
                     logical: str, effective: str, initial_adapter_sha256: str, allowed: list[str],
                     observed: list[str], knob_values: dict[str, Any], runtime: dict[str, Any], loss: float,
                     grad_norm: float, timing: dict[str, float], peak: int, device: torch.device,
                     padding: dict[str, Any], rows: dict[str, Any], rng_restored: list[str],
                     tolerances_sha256: str, budgets_sha256: str, config_sha256: str) -> dict[str, Any]:
    """The ``replay_metrics.json`` document (docs/replay-metrics.md) before the final adapter, provenance
    and whole-run wall time are added; every producer's replay builds it here and writes it with
    :func:`write_metrics`.  ``runtime`` holds the observation of every registered knob of ``framework``
    (:func:`replayjob.optbatch.knobs.observe_all`); ``host`` is read here, where the replay ran."""
    return {
        "schema": METRICS_SCHEMA,
        metrics_io.FRAMEWORK: framework,
        "replayjob_version": replayjob.__version__,
        "torch_version": torch.__version__,
        "device": str(device),
        "arm": arm,
        "repeat_index": repeat_index,
        "pins": pins,
        metrics_io.LOGICAL: logical,
        metrics_io.EFFECTIVE: effective,
        metrics_io.MANIFEST: manifest_sha256,
        metrics_io.INITIAL_ADAPTER: initial_adapter_sha256,
        "allowed_config_differences": list(allowed),
        "observed_config_differences": list(observed),
        "knobs": knob_values,
        "skipped": list(metrics_io.SKIPPED),
        "runtime": runtime,  # every registered knob of the framework as observed at run time
        "loss": loss,
        "grad_norm": grad_norm,
        "timing": timing,
        "memory": {"peak_bytes": peak,
                   "kind": "cuda_max_allocated" if device.type == "cuda" else "max_rss"},
        "padding": padding,
        "rows": rows,
        "rng_restored": rng_restored,
        "tolerances_sha256": tolerances_sha256.strip().lower(),  # checked at admission
        metrics_io.BUDGETS_SHA256: budgets_sha256.strip().lower(),
        "config_sha256": config_sha256,
        metrics_io.HOST: host_provenance(device),  # node, GPU, driver, CUDA, image (replayjob.hostinfo)
    }


def write_metrics(out: Path, metrics: dict[str, Any]) -> None:
    """Write ``OUT/replay_metrics.json`` exclusively through :func:`replayjob.metrics.write` (every producer's
    replay calls this)."""
    metrics_io.write(out / METRICS_FILE, metrics, exclusive=True)


def _metrics(adm: Admission, cfg: Config, repeat_index: int, res: Any, local_train_wall_s: float,
             peak: int, device: torch.device, runtime: dict[str, Any]) -> dict[str, Any]:
    assert adm.manifest is not None and adm.batch is not None and adm.rng is not None and adm.rows is not None
    m = adm.manifest
    logical, effective = adm.batch.digests()  # the rows as replayed, hashed again after the update
    return metrics_document(
        framework=knobs.BUILTIN, arm=adm.arm, repeat_index=repeat_index,
        pins={"expected_logical_sha256": adm.pins["expected_logical_sha256"],
              "expected_manifest_sha256": adm.pins["expected_manifest_sha256"],
              "payload_spans_sha256": m.payload_digest},
        manifest_sha256=m.sha256, logical=logical, effective=effective,
        initial_adapter_sha256=m.initial_adapter_sha256, allowed=adm.allowed, observed=adm.observed,
        knob_values=adm.knob_values(), runtime=runtime, loss=res.loss, grad_norm=res.grad_norm,
        timing={"local_train_wall_s": local_train_wall_s, "forward_wall_s": res.forward_wall_s,
                "backward_wall_s": res.backward_wall_s, "optimizer_wall_s": res.optimizer_wall_s},
        peak=peak, device=device,
        padding={"real_tokens": res.real_tokens, "padded_tokens": res.padded_tokens,
                 "padding_fraction": res.padding_fraction, "micro_batches": res.micro_batches},
        rows=adm.rows,  # counted and summed as the payload was verified
        rng_restored=sorted(adm.rng), tolerances_sha256=cfg.optimizer_batch.tolerances_sha256,
        budgets_sha256=cfg.optimizer_batch.budgets_sha256, config_sha256=config_sha256(cfg))


def replay_command(config: str | Path, overrides: list[str], out: str | Path | None,
                   repeat: int | None, repeat_index: int,
                   slot: Slot | None = None, nproc: int = 1,
                   launcher: str = "torchrun") -> list[tuple[Path, dict[str, Any]]]:
    """``replayjob replay``: one replay in this process, or ``repeat`` fresh-process replays.

    A config with an ``[integration]`` table replays a capture from an external trainer
    (:mod:`replayjob.integrations`); the fan-out is the same for both.  ``nproc`` > 1 runs each replay
    on that many ranks of this node, launched by :func:`replayjob.distributed.run_launched` (also for a
    single replay without ``repeat``; ``launcher``: torchrun, or srun inside a Slurm allocation, see
    :func:`replayjob.distributed.launch_command`).  On a rank other than 0 (this process launched by
    torchrun) the metrics returned are ``{}``.
    """
    from replayjob import integrations

    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, found {nproc}")
    if integrations.is_integration_config(config):
        from replayjob.integrations import admission
        from replayjob.integrations import replay as integration_replay

        if nproc > 1:
            raise UsageError("an integration replay runs in one process; --nproc applies to replayjob's own trainer")
        icfg = admission.load(config, overrides)
        if out is None:
            raise UsageError("an integration replay needs --out DIR")
        out_dir = Path(out)

        def one(d: Path, index: int) -> dict[str, Any]:
            return integration_replay.replay(icfg, d, index, slot)

        def refuse_early() -> None:
            admission.admit(icfg).raise_if_refused()
    else:
        cfg = load_config(config, overrides)
        out_dir = Path(out or cfg.logging.dir)

        def one(d: Path, index: int) -> dict[str, Any]:
            return replay(cfg, d, index, slot)

        def refuse_early() -> None:
            admit(distributed.observe(cfg, running=False, planned=nproc), keep_rows=False).raise_if_refused()
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
            f"repeat {index} exited with status {code}: {tail[-2000:]}", where=d)
    return metrics_io.read_replay(d / METRICS_FILE).doc
