"""Exactly one optimizer update on an :class:`OptimizerBatch`: shared by the source trainer and
by replay, so both perform the same math on the same rows.

Micro-batches are processed in logical order; the batch loss is the sum of micro-batch losses
(the loss weights already carry the normalisation); gradients are clipped to
``optimizer.max_grad_norm`` and AdamW steps once.

Over several ranks (``parallel``, :class:`replayjob.distributed.Parallel`) each rank runs this on its
shard of the logical rows: gradients are accumulated locally and summed over ranks with the last
micro-batch's backward, the global norm is clipped, and the reported loss is the ranks' losses
summed in rank order (float64).  Without ``parallel`` nothing else changes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from replayjob.config import Config
from replayjob.model.backend import Policy
from replayjob.rl import stages
from replayjob.rl.batch import OptimizerBatch, micro_batches
from replayjob.rl.logprobs import logprob_temperature, token_logprobs

if TYPE_CHECKING:
    from replayjob.distributed import Parallel


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
    o = cfg.optimizer
    return torch.optim.AdamW([p for _, p in policy.trainable()], lr=o.lr, betas=(o.betas[0], o.betas[1]),
                             eps=o.eps, weight_decay=o.weight_decay, foreach=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_update(policy: Policy, optimizer: torch.optim.Optimizer, batch: OptimizerBatch,
                     cfg: Config, keep_logprobs: bool = False, plant_nonfinite_grad: bool = False,
                     parallel: Parallel | None = None) -> UpdateResult:
    """One update; ``keep_logprobs`` also returns the logprobs the loss saw (read-only copies);
    ``parallel``: this rank's part of an update shared by ranks (``batch`` is this rank's shard).

    ``plant_nonfinite_grad`` (tests only, :func:`replayjob.faults.nonfinite_grad_at`) sets one
    gradient element to NaN after the backward pass, before clipping."""
    a = cfg.algorithm
    dev = policy.device
    optimizer.zero_grad(set_to_none=True)
    res = UpdateResult(loss=0.0, grad_norm=0.0)
    total = torch.zeros((), dtype=torch.float64)
    ratio_sum = torch.zeros((), dtype=torch.float64)
    ratio_n = 0
    kept: dict[int, torch.Tensor] = {}
    model = policy.model if parallel is None else parallel.module
    temperature = logprob_temperature(cfg)  # the sampling temperature, as the old logprobs applied it
    mbs = micro_batches(batch, cfg.training.micro_batch_size, policy.tokenizer.pad_id)
    if parallel is not None:
        parallel.check_micro_batches(len(mbs))
    for i, mb in enumerate(mbs):
        _sync(dev)
        t0 = time.perf_counter()
        with contextlib.nullcontext() if parallel is None else parallel.micro_batch(last=i == len(mbs) - 1):
            logp = token_logprobs(model, mb.input_ids.to(dev), mb.attention_mask.to(dev), temperature)
            m = mb.resp_mask.to(dev)
            loss = stages.policy_loss(logp, mb.old_logprobs.to(dev), mb.advantages.to(dev),
                                      mb.loss_weights.to(dev), clip_low=a.clip_eps_low, clip_high=a.clip_eps_high,
                                      ref_logp=mb.ref_logprobs.to(dev), kl_coef=a.kl_loss_coef)
            _sync(dev)
            t1 = time.perf_counter()
            loss.backward()
        _sync(dev)
        t2 = time.perf_counter()
        with torch.no_grad():
            ratio = torch.exp(logp.double() - mb.old_logprobs.to(dev)) * m
            ratio_sum += ratio.sum().cpu()
            ratio_n += int(m.sum())
        total += loss.detach().cpu()
        if keep_logprobs:
            lp = logp.detach().cpu()
            kept.update({i: lp[j][mb.resp_mask[j] > 0] for j, i in enumerate(mb.rows)})
        res.forward_wall_s += t1 - t0
        res.backward_wall_s += t2 - t1
        res.micro_batches += 1
        res.micro_batch_rows.append(len(mb.rows))
        res.real_tokens += mb.real_tokens
        res.padded_tokens += mb.padded_tokens
    _sync(dev)
    t3 = time.perf_counter()
    params = [p for _, p in policy.trainable()]
    if plant_nonfinite_grad and params and params[0].grad is not None:
        params[0].grad.view(-1)[0] = float("nan")
    max_norm = cfg.optimizer.max_grad_norm
    if parallel is None:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"),
                                                    foreach=False))
    else:
        norm = parallel.clip(params, max_norm if max_norm > 0 else float("inf"))
    optimizer.step()
    _sync(dev)
    res.optimizer_wall_s = time.perf_counter() - t3
    if parallel is None:
        res.loss = float(total)
        res.ratio_mean = float(ratio_sum / max(ratio_n, 1))
    else:
        res.local_loss = float(total)
        res.loss, res.ratio_mean = parallel.loss_and_ratio(float(total), float(ratio_sum), ratio_n)
    res.grad_norm = norm
    if keep_logprobs:
        res.logprobs = torch.cat([kept[i] for i in range(batch.rows)])
    return res
