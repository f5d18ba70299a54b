"""The source trainer (``training.trainer = "grpo"``): real one-step-at-a-time GRPO on LoRA.

Per step: prompts from the seeded toy task -> G sampled completions per prompt (the sampler's own
logprob of each token recorded) -> reward.raw -> reward.post_process -> old and reference logprobs (at
the sampling temperature, ``algorithm.logprob_temperature``) -> advantage.kl -> advantage.estimate (then
optional batch normalisation, clipping and the token cap) -> loss weights -> the optimizer batch
-> hooks (capture point) -> one AdamW update -> a diag.jsonl row.  Checkpoints every
``save_every`` steps; resuming from one continues bitwise-identically on CPU.

Run it: ``replayjob init d && replayjob train d/source.toml --out runs/source``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob import crashpoints as faults
from replayjob.artifacts import metrics as metrics_io
from replayjob.config import Config, config_sha256, resolved
from replayjob.digest import sha256_file
from replayjob.errors import ArtifactExistsError, ConfigError
from replayjob.fsio import refuse_unusable_out
from replayjob.jsonio import canonical_bytes
from replayjob.model import moe
from replayjob.model.backend import Policy, load_backend
from replayjob.rl import stages
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.diag import optimizer_checksum, peak_memory_bytes, stats, tensor_checksum
from replayjob.rl.hooks import StepHook, StepRollout, TrainerView, abandon_all
from replayjob.rl.logprobs import logprob_temperature, padded, token_logprobs
from replayjob.rl.sampling import sample
from replayjob.rl.state import (
    FINAL_ADAPTER_DIR,
    OPTIMIZER_FILE,
    RNG_FILE,
    ResumeState,
    check_model,
    load_optimizer,
    load_rng,
    optimizer_bytes,
    read_state,
    rng_bytes,
    write_state,
)
from replayjob.rl.task import Task
from replayjob.rl.update import UpdateResult, make_optimizer, optimizer_update
from replayjob.runtime import determinism, distributed

if TYPE_CHECKING:
    import torch
    from torch import Tensor

DIAG_FILE = "diag.jsonl"
METRICS_FILE = metrics_io.SOURCE_FILE


def build_rollout(policy: Policy, cfg: Config, task: Task, step: int, seed: int) -> tuple[StepRollout,
                                                                                         OptimizerBatch]:
    """Everything up to the capture point: sample, score, estimate, weigh."""
    import torch
    a = cfg.algorithm
    tok = policy.tokenizer
    prompts = task.prompts(seed, step, a.prompts_per_step)
    prompt_ids, answers, group = [], [], []
    for gi, p in enumerate(prompts):
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(p.text)
        for _ in range(a.group_size):
            prompt_ids.append(ids)
            answers.append(p.answer)
            group.append(gi)
    sampled = sample(policy, prompt_ids, cfg.inference)
    responses = sampled.tokens
    completions = [tok.decode([t for t in r if t != tok.eos_id]) for r in responses]
    raw = stages.reward_raw(completions, answers, task.score)
    g = torch.tensor(group, dtype=torch.int64)
    scores = stages.post_process(raw, g, a.estimator, a.std_eps)

    seqs = [p + r for p, r in zip(prompt_ids, responses, strict=True)]
    N, T = len(seqs), max(len(r) for r in responses)
    mask = torch.zeros((N, T), dtype=torch.float64)
    sampler = torch.zeros((N, T), dtype=torch.float64)  # the sampler's own logprobs (docs/mismatch.md)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1.0
        sampler[i, : len(r)] = torch.tensor(sampled.logprobs[i], dtype=torch.float64)
    old = _response_logprobs(policy, seqs, prompt_ids, responses, T, cfg, reference=False)
    ref = _response_logprobs(policy, seqs, prompt_ids, responses, T, cfg, reference=True)
    kl = stages.token_kl(old, ref, mask, "k1")
    adv = stages.advantage_estimate(scores, kl, mask, a.kl_reward_coef)
    if a.batch_adv_norm:
        adv = stages.batch_normalize(adv, mask)
    adv = stages.clip_advantages(adv, a.adv_clip)
    loss_mask = stages.token_cap(mask, a.token_cap)
    weights = stages.loss_weights(loss_mask, a.loss_agg)
    rollout = StepRollout(step, [p.text for p in prompts for _ in range(a.group_size)], answers, completions,
                          prompt_ids, responses, g, raw, scores, mask, old, ref, kl, adv, loss_mask, weights)
    batch = OptimizerBatch.from_padded(
        seqs, [len(p) for p in prompt_ids],
        {"old_logprobs": old, "ref_logprobs": ref, "advantages": adv, "loss_weights": weights,
         "sampler_logprobs": sampler}, mask)
    return rollout, batch


def _response_logprobs(policy: Policy, seqs: list[list[int]], prompt_ids: list[list[int]],
                       responses: list[list[int]], T: int, cfg: Config, *, reference: bool) -> Tensor:
    import torch
    with torch.no_grad():
        model = policy.model
        was_training = model.training
        model.eval()
        out = torch.zeros((len(seqs), T), dtype=torch.float64)
        mbs = cfg.training.micro_batch_size
        temperature = logprob_temperature(cfg)
        try:
            for start in range(0, len(seqs), mbs):
                chunk = list(range(start, min(start + mbs, len(seqs))))
                ids, att = padded([seqs[i] for i in chunk], policy.tokenizer.pad_id, policy.device)
                if reference:
                    with policy.reference():
                        lp = token_logprobs(model, ids, att, temperature)
                else:
                    lp = token_logprobs(model, ids, att, temperature)
                lp = lp.double().cpu()
                for j, i in enumerate(chunk):
                    p, n = len(prompt_ids[i]), len(responses[i])
                    out[i, :n] = lp[j, p - 1 : p - 1 + n]
        finally:
            model.train(was_training)
        return out


def _write_routing(policy: Policy, out: Path, step: int, batch: OptimizerBatch) -> list[dict[str, Any]]:
    """An MoE model's routing of the update of a captured ``step`` (one process), beside metrics.json: the
    table a replay forces (``model.routing = "forced"``) or compares its own with; its ``routing/steps``
    entry (none for a dense model, or over several ranks, where no rank holds every row)."""
    routing = getattr(policy, "routing", None)
    if routing is None or routing.last is None:
        return []
    name = moe.source_step_file(step)
    identity = {"logical_batch_sha256": batch.logical_sha256()}
    sha = moe.write_table(out / name, dataclasses.replace(routing.last, identity=identity))
    return [{"step": step, "path": name, "sha256": sha}]


def prepare_out_dir(out: Path) -> None:
    refuse_unusable_out(out)
    if (out / METRICS_FILE).exists():
        raise ArtifactExistsError("output directory already holds a run", where=out / METRICS_FILE,
                                  hint="choose a new --out directory")
    if (out / DIAG_FILE).exists():  # no metrics.json: the run was interrupted (or is still running)
        raise ArtifactExistsError(f"output directory already holds a run that has no {METRICS_FILE} "
                                  "(interrupted, or still running)", where=out / DIAG_FILE,
                                  hint=f"remove {out} and rerun, or choose a new --out directory")
    out.mkdir(parents=True, exist_ok=True)


def _open_diag(out: Path) -> Any:
    """Create diag.jsonl exclusively: of two runs started on one directory, exactly one proceeds."""
    try:
        return open(out / DIAG_FILE, "xb")
    except FileExistsError:
        raise ArtifactExistsError("another run created diag.jsonl in this output directory first",
                                  where=out / DIAG_FILE, hint="choose a new --out directory") from None


def diag_row(step: int, rollout: StepRollout, res: UpdateResult, policy: Policy,
             optimizer: torch.optim.Optimizer, prov: dict[str, Any], elapsed: float,
             sample_s: float) -> dict[str, Any]:
    trainable = policy.trainable()
    return {
        "step": step,
        "loss": {"policy": res.loss, "ratio_mean": res.ratio_mean},
        "reward": stats(rollout.raw),
        "score": stats(rollout.scores),
        "advantage": stats(rollout.advantages, rollout.mask),
        "kl": stats(rollout.kl, rollout.mask),
        "grad_norm": res.grad_norm,
        "lr": optimizer.param_groups[0]["lr"],
        "tokens": {"prompt": sum(len(p) for p in rollout.prompt_tokens),
                   "response": int(rollout.mask.sum()), "loss_bearing": int(rollout.loss_mask.sum()),
                   "real": res.real_tokens, "padded": res.padded_tokens,
                   "padding_fraction": res.padding_fraction, "micro_batches": res.micro_batches},
        "checksums": {
            "adapter": tensor_checksum(trainable),
            "grad": tensor_checksum([(n, p.grad) for n, p in trainable]),
            "optimizer_state": optimizer_checksum(optimizer),
        },
        "timing": {"elapsed_s": elapsed, "sample_wall_s": sample_s, "forward_wall_s": res.forward_wall_s,
                   "backward_wall_s": res.backward_wall_s, "optimizer_wall_s": res.optimizer_wall_s},
        "memory": peak_memory_bytes(policy.device),
        "provenance": {"math_mode": prov["math_mode"], "strict_deterministic": prov["strict_deterministic"]},
    }


def start_run(cfg: Config) -> tuple[dict[str, Any], Policy, ResumeState | None]:
    """Determinism controls, then the resume state, then the policy (in that order)."""
    prov = determinism.establish(strict=cfg.backend.options.strict_deterministic, seed=cfg.training.seed)
    state = read_state(cfg.resume.from_) if cfg.resume.from_ else None
    policy = load_backend(cfg.backend.name).build(cfg)
    determinism.mark_model_built(cfg.backend.options.strict_deterministic)
    prov["attn_implementation"] = cfg.backend.options.attn_implementation
    prov["device"] = str(policy.device)
    if state is not None:
        check_model(state, policy.model_reference())
        policy.load_adapter(state.adapter_file, state.adapter_sha256)
    return prov, policy, state


def train(cfg: Config, out: Path, hooks: Sequence[StepHook] = ()) -> dict[str, Any]:
    """Run the source trainer with ``hooks``; return (and write) metrics.json.

    The trainer owns ``hooks`` from this call on (:mod:`replayjob.rl.hooks`): each is finished,
    in order, before metrics.json is written, and every one is abandoned if anything fails.
    """
    hooks = list(hooks)
    try:
        if cfg.training.trainer != "grpo":
            raise ConfigError(f"train runs trainer 'grpo', the config says {cfg.training.trainer!r}",
                              where="training.trainer",
                              hint="use `replayjob replay` for optimizer_replay configs")
        return _run(cfg, out, hooks)
    except BaseException:
        abandon_all(hooks)
        raise


def _local_shard(batch: OptimizerBatch) -> OptimizerBatch:
    """This rank's contiguous shard of the logical batch, once the ranks agree on that batch."""
    distributed.check_same(batch.logical_sha256(), "logical batch")
    begin, end = distributed.shard_bounds(batch.rows, distributed.world_size())[distributed.rank()]
    return batch.shard(begin, end)


def _run(cfg: Config, out: Path, hooks: list[StepHook]) -> dict[str, Any]:
    import torch
    root = distributed.is_root()  # over several ranks only rank 0 writes the run's own files
    if root:
        prepare_out_dir(out)
    else:
        out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    prov, policy, state = start_run(cfg)
    parallel = distributed.wrap(policy.model, cfg, policy)  # None for strategy "none"
    seed = cfg.training.seed if cfg.training.seed is not None else 0
    optimizer = make_optimizer(policy, cfg)
    start_step = 0
    initial_sha = state.adapter_sha256 if state else None
    if state is not None:
        start_step = state.step + 1
        if state.has_optimizer:
            load_optimizer(optimizer, state.path / OPTIMIZER_FILE, state.files[OPTIMIZER_FILE])
        if state.has_rng:
            load_rng(state.path / RNG_FILE, state.files[RNG_FILE])
    if start_step >= cfg.training.max_steps:
        raise ConfigError(f"resume state is at step {start_step - 1}; max_steps={cfg.training.max_steps} "
                          "leaves nothing to run", where="training.max_steps")
    keep_logprobs = any(h.wants_update_logprobs for h in hooks)
    view = TrainerView(policy.adapter_state, optimizer, policy.model_reference(), start_step)
    for h in hooks:
        h.on_train_begin(view)
    task = Task(cfg.environment.task, cfg.environment.max_operand, cfg.environment.nondeterministic_observation)
    last: UpdateResult | None = None
    ob = cfg.optimizer_batch
    routing_steps = set(ob.capture_steps) | ({0} if ob.capture else set())  # captured steps: their routing too
    routed: list[dict[str, Any]] = []
    with _open_diag(out) if root else contextlib.nullcontext(io.BytesIO()) as diag:
        for step in range(start_step, cfg.training.max_steps):
            t0 = time.perf_counter()
            rollout, batch = build_rollout(policy, cfg, task, step, seed)
            sample_s = time.perf_counter() - t0
            for h in hooks:
                h.on_rollout(rollout)
            if parallel is not None:  # every rank built the same logical batch; each takes its shard
                batch = _local_shard(batch)
            for h in hooks:
                h.before_update(step, batch)
            last = optimizer_update(policy, optimizer, batch, cfg, keep_logprobs=keep_logprobs,
                                    plant_nonfinite_grad=faults.nonfinite_grad_at(step), parallel=parallel)
            if root and step in routing_steps:
                routed.extend(_write_routing(policy, out, step, batch))
            for h in hooks:
                h.after_update(step, last)
            row = diag_row(step, rollout, last, policy, optimizer, prov, time.perf_counter() - t_start, sample_s)
            diag.write(canonical_bytes(row, allow_nan=True) + b"\n")  # a diverged step is recorded
            diag.flush()
            if root and cfg.training.save_every and (step + 1) % cfg.training.save_every == 0:
                ck = out / "checkpoints" / f"step_{step:06d}"
                policy.save_adapter(ck)
                write_state(ck, step, policy.model_reference(),
                            {OPTIMIZER_FILE: optimizer_bytes(optimizer), RNG_FILE: rng_bytes()})
    final_file = distributed.save_adapter(policy, out / FINAL_ADAPTER_DIR, parallel)
    if final_file is None:  # not rank 0: its hooks land this rank's part; rank 0 writes the root and metrics.json
        for h in hooks:
            h.finish({})
        return {}
    assert last is not None
    metrics = metrics_io.source_document(
        trainer="grpo", torch_version=torch.__version__, device=str(policy.device),
        steps_run=cfg.training.max_steps - start_step, last_step=cfg.training.max_steps - 1,
        loss=last.loss, grad_norm=last.grad_norm, initial_adapter_sha256=initial_sha,
        final_adapter_sha256=sha256_file(final_file), final_adapter_path=str(final_file.relative_to(out)),
        config_sha256=config_sha256(cfg), config=resolved(cfg), provenance=prov,
        wall_s=time.perf_counter() - t_start)
    if routed:
        metrics[metrics_io.SOURCE_ROUTING] = routed
    for h in hooks:  # before metrics.json, which declares the whole run (every capture included) complete
        metrics.update(h.finish(dict(metrics)))
    metrics_io.write(out / METRICS_FILE, metrics)
    return metrics
