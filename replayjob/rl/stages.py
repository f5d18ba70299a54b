"""The RL math as pure functions: the single source of truth for the trainer and for offline
recompute.  Stage order: ``reward.raw -> reward.post_process -> advantage.kl ->
advantage.estimate -> loss.policy``.

Conventions: per-sample tensors are ``[N]``; per-token tensors are padded ``[N, T]`` with a
0/1 ``mask``; scores, advantages and logprobs the loss consumes are float64.

Example (GRPO on one group of four):
    >>> import torch
    >>> r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    >>> post_process(r, torch.tensor([0, 0, 0, 0]), "grpo", 0.0).tolist()
    [0.8660254037844387, -0.8660254037844387, -0.8660254037844387, 0.8660254037844387]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


ESTIMATORS = ("grpo", "dr_grpo", "rloo")
STAGES = ("reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate", "loss.policy")


def reward_raw(completions: Sequence[str], answers: Sequence[str],
               score: Callable[[str, str], float]) -> Tensor:
    """reward.raw: the verifier's score per sample."""
    import torch
    return torch.tensor([score(c, a) for c, a in zip(completions, answers, strict=True)],
                        dtype=torch.float64)


def post_process(raw: Tensor, group: Tensor, estimator: str, std_eps: float) -> Tensor:
    """reward.post_process: group baseline (and for GRPO, std normalisation) per sample.

    ``group`` holds each sample's semantic group id; groups are never inferred from positions.
    grpo: (r - mean_g) / (std_g + eps); dr_grpo: r - mean_g; rloo: r - mean of the others.
    """
    import torch
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}")
    raw = raw.to(torch.float64)
    out = torch.empty_like(raw)
    for g in torch.unique(group, sorted=True):
        idx = (group == g).nonzero(as_tuple=True)[0]
        r = raw[idx]
        n = r.numel()
        mean = r.mean()
        if estimator == "grpo":
            std = r.std(unbiased=True) if n > 1 else torch.zeros((), dtype=torch.float64)
            out[idx] = (r - mean) / (std + std_eps)
        elif estimator == "dr_grpo":
            out[idx] = r - mean
        else:
            if n < 2:
                raise ValueError("rloo needs at least two samples per group")
            out[idx] = (r - mean) * (n / (n - 1))
    return out


def token_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str = "k1") -> Tensor:
    """advantage.kl: per-token KL estimate of policy vs reference (k1 = log ratio; k3 unbiased, >= 0)."""
    import torch
    d = (logp - ref_logp).to(torch.float64)
    kl = d if kind == "k1" else torch.exp(-d) + d - 1.0
    return kl * mask


def advantage_estimate(scores: Tensor, kl: Tensor, mask: Tensor, kl_reward_coef: float) -> Tensor:
    """advantage.estimate: the sample score on every response token, less the KL penalty."""
    import torch
    adv = scores.to(torch.float64)[:, None] - kl_reward_coef * kl
    return adv * mask


def batch_normalize(adv: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Whitening over every response token of the batch."""
    import torch
    m = mask.to(torch.float64)
    n = m.sum().clamp_min(1.0)
    mean = (adv * m).sum() / n
    var = (((adv - mean) * m) ** 2).sum() / n
    return (adv - mean) / torch.sqrt(var + eps) * m


def clip_advantages(adv: Tensor, c: float) -> Tensor:
    return adv.clamp(-c, c) if c > 0 else adv


def token_cap(mask: Tensor, cap: int) -> Tensor:
    """Keep at most ``cap`` loss-bearing response tokens, in row-major order; 0 disables."""
    import torch
    if cap <= 0:
        return mask
    flat = mask.reshape(-1).to(torch.float64)
    keep = (torch.cumsum(flat, 0) <= cap).to(flat.dtype) * flat
    return keep.reshape(mask.shape).to(mask.dtype)


def loss_weights(mask: Tensor, agg: str) -> Tensor:
    """Per-token weights with ``loss = sum(weights * token_loss)`` over the whole batch.

    Because the normalisation is folded in once, the loss of a batch is the sum of its
    micro-batches' losses in exact arithmetic, whatever the micro-batch size.
    """
    import torch
    m = mask.to(torch.float64)
    if agg == "token-mean":
        return m / m.sum().clamp_min(1.0)
    if agg == "seq-mean-token-mean":
        per_row = m.sum(dim=1, keepdim=True)
        rows = (per_row > 0).sum().clamp_min(1).to(torch.float64)
        return torch.where(per_row > 0, m / per_row.clamp_min(1.0), torch.zeros_like(m)) / rows
    raise ValueError(f"unknown loss aggregation {agg!r}")


def policy_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, weights: Tensor, *, clip_low: float,
                clip_high: float, ref_logp: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """loss.policy: clipped PPO surrogate plus an optional k3 KL-to-reference term.

    Returns ``sum(weights * token_loss)`` as a float64 scalar.
    """
    import torch
    logp = logp.to(torch.float64)
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)
    token_loss = -surrogate
    if kl_coef and ref_logp is not None:
        d = ref_logp - logp
        token_loss = token_loss + kl_coef * (torch.exp(d) - d - 1.0)
    return (weights * token_loss).sum()
