"""Per-token log-probabilities of a right-padded batch: the one forward used everywhere.

The trainer's logprobs (old, reference and the loss's) divide the logits by the sampling temperature
when ``algorithm.logprob_temperature = "sampling"`` (the default), so they are the log-probabilities
of the distribution the sampler drew from before truncation; at temperature 1 nothing is divided and
the values are bitwise those of releases before the setting existed.  :func:`truncate` is the top-k /
top-p rule the sampler applies, shared with ``replayjob mismatch`` so both mean the same set.

Example:
    >>> import torch
    >>> z = torch.tensor([[2.0, 1.0, 0.0, -1.0]])   # probabilities 0.64, 0.24, 0.09, 0.03
    >>> truncate(z, top_k=0, top_p=0.6).isinf().tolist()
    [[False, True, True, True]]
    >>> truncate(z, top_k=0, top_p=0.7).isinf().tolist()
    [[False, False, True, True]]
    >>> truncate(z, top_k=2, top_p=1.0).isinf().tolist()
    [[False, False, True, True]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replayjob.config import Config
from replayjob.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import Tensor


def response_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``out[b, t]`` = the float32 logits predicting ``input_ids[b, t+1]``, shape ``[B, L-1, V]``."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    return logits[:, :-1, :].float()


def response_logits_and_aux(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor,
                                                                                                       Tensor]:
    """:func:`response_logits` and the MoE model's load-balancing router loss of the same forward (transformers'
    ``aux_loss`` under ``output_router_logits``, over the real tokens of ``attention_mask``)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                output_router_logits=True)
    if out.aux_loss is None:
        raise ConfigError("the model reports no router loss (not a mixture-of-experts model)",
                          where="model.router_aux_loss_coef", hint="set it to 0 for a dense model")
    return out.logits[:, :-1, :].float(), out.aux_loss


def logprobs_of(logits: Tensor, target: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)`` at ``target`` (last dimension); at temperature 1 the logits
    are not divided at all."""
    import torch
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                   temperature: float = 1.0) -> Tensor:
    """``out[b, t] = log p_T(input_ids[b, t+1] | input_ids[b, :t+1])``, shape ``[B, L-1]``, where ``p_T`` is
    the model's distribution at ``temperature`` (:func:`logprob_temperature` says which one the trainer uses)."""
    return logprobs_of(response_logits(model, input_ids, attention_mask), input_ids[:, 1:], temperature)


def logprob_temperature(cfg: Config) -> float:
    """The temperature the trainer's logprobs apply: ``inference.temperature`` unless
    ``algorithm.logprob_temperature = "none"``."""
    return cfg.inference.temperature if cfg.algorithm.logprob_temperature == "sampling" else 1.0


def truncate(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """``logits`` with every token outside the top-k / top-p set set to ``-inf`` (last dimension).

    Top-k keeps the ``top_k`` largest logits (0: all).  Top-p then keeps the most likely tokens, in
    order, until their probability (renormalised over what top-k kept) first reaches ``top_p``; the
    most likely token is always kept.  A softmax of the result is the renormalised truncated
    distribution.  With ``top_k = 0`` and ``top_p = 1`` the logits are returned unchanged.
    """
    import torch
    if top_k <= 0 and top_p >= 1.0:
        return logits
    out = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # probability of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def padded(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    import torch
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.int64)
    att = torch.zeros((len(seqs), L), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        att[i, : len(s)] = 1
    return ids.to(device), att.to(device)
