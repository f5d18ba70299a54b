"""Exactly one optimizer update on an :class:`OptimizerBatch`: shared by the source trainer and
by replay, so both perform the same math on the same rows.

Micro-batches are processed in logical order; the batch loss is the sum of micro-batch losses
(the loss weights already carry the normalisation); gradients are clipped to
``optimizer.max_grad_norm`` and AdamW steps once.

Over several ranks (``parallel``, :class:`replayjob.runtime.distributed.Parallel`) each rank runs this on its
shard of the logical rows: gradients are accumulated locally and summed over ranks with the last
micro-batch's backward, the global norm is clipped, and the reported loss is the ranks' losses
summed in rank order (float64).  Without ``parallel`` nothing else changes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replayjob.config import Config
from replayjob.errors import ConfigError
from replayjob.model.backend import Policy
from replayjob.rl import stages
from replayjob.rl.batch import MicroBatch, OptimizerBatch, micro_batches
from replayjob.rl.logprobs import logprob_temperature, logprobs_of, response_logits_and_aux, token_logprobs
from replayjob.runtime.distributed import Parallel

if TYPE_CHECKING:
    import torch



@dataclass
class UpdateResult:
    loss: float
    grad_norm: float
    forward_wall_s: float = 0.0
    backward_wall_s: float = 0.0
    optimizer_wall_s: float = 0.0
    micro_batches: int = 0
    micro_batch_rows: list[int] = field(default_factory=list)  # rows of each micro-batch, in order
    real_tokens: int = 0
    padded_tokens: int = 0
    ratio_mean: float = 1.0
    extra: dict[str, float] = field(default_factory=dict)
    logprobs: torch.Tensor | None = None  # flat response-token logprobs the loss saw (keep_logprobs)
    local_loss: float | None = None  # over several ranks: this rank's shard's loss (``loss`` is the sum)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


def make_optimizer(policy: Policy, cfg: Config) -> torch.optim.Optimizer:
    import torch
    o = cfg.optimizer
    return torch.optim.AdamW([p for _, p in policy.trainable()], lr=o.lr, betas=(o.betas[0], o.betas[1]),
                             eps=o.eps, weight_decay=o.weight_decay, foreach=False)


def _sync(device: torch.device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Update:
    """One update taken apart: :meth:`micro_batches`, :meth:`begin`, one :meth:`micro_batch` per
    micro-batch in order, then :meth:`finish` (clip and step).  :func:`optimizer_update` runs them in
    that order for the trainer; a replay driver runs the same pieces, restoring the captured RNG state
    right before the first micro-batch's loss, so both perform the same math on the same rows."""

    def __init__(self, policy: Policy, optimizer: torch.optim.Optimizer, cfg: Config, *,
                 keep_logprobs: bool = False, parallel: Parallel | None = None):
        self.policy, self.optimizer, self.cfg = policy, optimizer, cfg
        self.keep_logprobs, self.parallel = keep_logprobs, parallel
        self.model = policy.model if parallel is None else parallel.module
        self.temperature = logprob_temperature(cfg)  # the sampling temperature, as the old logprobs applied it
        self.planned = 0
        # an MoE model's routing (replayjob.model.moe), observed or forced per logical row: in one process only
        self.routing = getattr(policy, "routing", None) if parallel is None else None
        if parallel is not None and cfg.model.routing == "forced":
            raise ConfigError("forced routing runs in one process; over several ranks it is refused",
                              where="model.routing", hint="replay with distributed.strategy = 'none'")
        self._reset()

    def _reset(self) -> None:
        import torch
        self.res = UpdateResult(loss=0.0, grad_norm=0.0)
        self.total = torch.zeros((), dtype=torch.float64)
        self.ratio_sum = torch.zeros((), dtype=torch.float64)
        self.ratio_n = 0
        self.kept: dict[int, torch.Tensor] = {}

    def micro_batches(self, batch: OptimizerBatch) -> list[MicroBatch]:
        """``batch`` split into the micro-batches this update runs (``training.micro_batch_size``)."""
        return micro_batches(batch, self.cfg.training.micro_batch_size, self.policy.tokenizer.pad_id)

    def begin(self, n_micro_batches: int) -> None:
        """Zero the gradients and the step's sums before its first micro-batch."""
        self.optimizer.zero_grad(set_to_none=True)
        self._reset()
        self.planned = n_micro_batches
        if self.routing is not None:
            self.routing.begin_update()
        if self.parallel is not None:
            self.parallel.check_micro_batches(n_micro_batches)

    def micro_batch(self, i: int, mb: MicroBatch, before_loss: Callable[[], None] | None = None) -> None:
        """Forward, loss and backward of micro-batch ``i`` (``before_loss`` runs right before the forward)."""
        import torch
        a, dev, res = self.cfg.algorithm, self.policy.device, self.res
        _sync(dev)
        t0 = time.perf_counter()
        last = i == self.planned - 1
        routed = contextlib.nullcontext() if self.routing is None else self.routing.micro_batch(mb.rows,
                                                                                                  mb.attention_mask)
        with contextlib.nullcontext() if self.parallel is None else self.parallel.micro_batch(last=last), routed:
            if before_loss is not None:
                before_loss()
            aux_coef = self.cfg.model.router_aux_loss_coef
            if aux_coef:  # an MoE model's load-balancing loss, per micro-batch as transformers adds it
                logits, aux = response_logits_and_aux(self.model, mb.input_ids.to(dev), mb.attention_mask.to(dev))
                logp = logprobs_of(logits, mb.input_ids[:, 1:].to(dev), self.temperature)
            else:
                logp = token_logprobs(self.model, mb.input_ids.to(dev), mb.attention_mask.to(dev), self.temperature)
            m = mb.resp_mask.to(dev)
            loss = stages.policy_loss(logp, mb.old_logprobs.to(dev), mb.advantages.to(dev),
                                      mb.loss_weights.to(dev), clip_low=a.clip_eps_low, clip_high=a.clip_eps_high,
                                      ref_logp=mb.ref_logprobs.to(dev), kl_coef=a.kl_loss_coef)
            if aux_coef:
                loss = loss + aux_coef * aux.to(loss.dtype)
            _sync(dev)
            t1 = time.perf_counter()
            loss.backward()
        _sync(dev)
        t2 = time.perf_counter()
        with torch.no_grad():
            ratio = torch.exp(logp.double() - mb.old_logprobs.to(dev)) * m
            self.ratio_sum += ratio.sum().cpu()
            self.ratio_n += int(m.sum())
        self.total += loss.detach().cpu()
        if self.keep_logprobs:
            lp = logp.detach().cpu()
            self.kept.update({r: lp[j][mb.resp_mask[j] > 0] for j, r in enumerate(mb.rows)})
        res.forward_wall_s += t1 - t0
        res.backward_wall_s += t2 - t1
        res.micro_batches += 1
        res.micro_batch_rows.append(len(mb.rows))
        res.real_tokens += mb.real_tokens
        res.padded_tokens += mb.padded_tokens

    def finish(self, rows: int, plant_nonfinite_grad: bool = False) -> UpdateResult:
        """Clip the global gradient norm, step the optimizer once and return the update's result
        (``rows``: the logical rows of this rank's batch, for the kept logprobs)."""
        import torch
        res, dev = self.res, self.policy.device
        _sync(dev)
        t3 = time.perf_counter()
        params = [p for _, p in self.policy.trainable()]
        if plant_nonfinite_grad and params and params[0].grad is not None:
            params[0].grad.view(-1)[0] = float("nan")
        max_norm = self.cfg.optimizer.max_grad_norm
        if self.parallel is None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"),
                                                        foreach=False))
        else:
            norm = self.parallel.clip(params, max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        _sync(dev)
        res.optimizer_wall_s = time.perf_counter() - t3
        if self.routing is not None:
            self.routing.end_update()
        if self.parallel is None:
            res.loss = float(self.total)
            res.ratio_mean = float(self.ratio_sum / max(self.ratio_n, 1))
        else:
            res.local_loss = float(self.total)
            res.loss, res.ratio_mean = self.parallel.loss_and_ratio(float(self.total), float(self.ratio_sum),
                                                                    self.ratio_n)
        res.grad_norm = norm
        if self.keep_logprobs:
            res.logprobs = torch.cat([self.kept[i] for i in range(rows)])
        return res


def optimizer_update(policy: Policy, optimizer: torch.optim.Optimizer, batch: OptimizerBatch,
                     cfg: Config, keep_logprobs: bool = False, plant_nonfinite_grad: bool = False,
                     parallel: Parallel | None = None) -> UpdateResult:
    """One update; ``keep_logprobs`` also returns the logprobs the loss saw (read-only copies);
    ``parallel``: this rank's part of an update shared by ranks (``batch`` is this rank's shard).

    ``plant_nonfinite_grad`` (tests only, :func:`replayjob.crashpoints.nonfinite_grad_at`) sets one
    gradient element to NaN after the backward pass, before clipping."""
    update = Update(policy, optimizer, cfg, keep_logprobs=keep_logprobs, parallel=parallel)
    mbs = update.micro_batches(batch)
    update.begin(len(mbs))
    for i, mb in enumerate(mbs):
        update.micro_batch(i, mb)
    return update.finish(batch.rows, plant_nonfinite_grad)
