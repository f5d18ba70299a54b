"""Per-token log-probabilities of a right-padded batch: the one forward used everywhere."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``out[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])``, shape ``[B, L-1]``."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    logits = logits[:, :-1, :].float()
    target = input_ids[:, 1:]
    return torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def padded(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.int64)
    att = torch.zeros((len(seqs), L), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        att[i, : len(s)] = 1
    return ids.to(device), att.to(device)
