"""Sampling completions from the policy with the global Torch RNG (CPU or the device's).

The sampler records its own view of every token it draws: the log-probability of the sampled token
under the distribution it sampled from (the logits of its forward, divided by ``temperature``,
truncated to the top-k / top-p set and renormalised; :func:`replayjob.rl.logprobs.truncate`), in
float32 as it computed them.  ``sampling_dtype`` other than ``"model"`` runs its forward under
``torch.autocast``.  With the defaults (no truncation, the model's dtype) the distribution and the
random numbers drawn are exactly those of releases that recorded nothing.

Replay never imports this module: exact-input replay performs no sampling.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replayjob.config.schema import InferenceConfig
from replayjob.model.backend import Policy
from replayjob.rl.logprobs import truncate

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sampled:
    """Per prompt: the sampled response tokens (EOS included when produced) and, per token, the
    sampler's log-probability of it."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


def precision(sampling_dtype: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The context the sampler's forward runs in: nothing for ``"model"``, else ``torch.autocast``."""
    import torch
    if sampling_dtype == "model":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, sampling_dtype))


def sample(policy: Policy, prompts: list[list[int]], settings: InferenceConfig) -> Sampled:
    """Sample a response for every prompt under ``settings`` (``[inference]``).

    Prompts are left-padded so every row's next token sits in the last column; rows that
    produced EOS are finished and stop growing.
    """
    import torch
    with torch.no_grad():
        tok = policy.tokenizer
        model = policy.model
        temperature, top_k, top_p = settings.temperature, settings.top_k, settings.top_p
        was_training = model.training
        model.eval()
        try:
            B = len(prompts)
            L = max(len(p) for p in prompts)
            ids = torch.full((B, L), tok.pad_id, dtype=torch.int64)
            att = torch.zeros((B, L), dtype=torch.int64)
            for i, p in enumerate(prompts):
                ids[i, L - len(p):] = torch.tensor(p, dtype=torch.int64)
                att[i, L - len(p):] = 1
            ids, att = ids.to(policy.device), att.to(policy.device)
            out: list[list[int]] = [[] for _ in range(B)]
            lps: list[list[float]] = [[] for _ in range(B)]
            done = [False] * B
            for _ in range(settings.max_new_tokens):
                pos = (att.cumsum(-1) - 1).clamp_min(0)
                with precision(settings.sampling_dtype, ids.device):
                    logits = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits
                scaled = truncate(logits[:, -1, :].float() / temperature, top_k, top_p)
                probs = torch.softmax(scaled, dim=-1)
                nxt = torch.multinomial(probs, 1)
                lp = torch.log_softmax(scaled, dim=-1).gather(-1, nxt).double().cpu()
                for i in range(B):
                    if not done[i]:
                        t = int(nxt[i, 0])
                        out[i].append(t)
                        lps[i].append(float(lp[i, 0]))
                        done[i] = t == tok.eos_id
                if all(done):
                    break
                fill = torch.tensor([[tok.pad_id if d else 0] for d in done], device=ids.device)
                step_tok = torch.where(torch.tensor(done, device=ids.device)[:, None], fill, nxt)
                ids = torch.cat([ids, step_tok], dim=1)
                att = torch.cat([att, (~torch.tensor(done, device=ids.device))[:, None].to(att.dtype)], dim=1)
            return Sampled(out, lps)
        finally:
            model.train(was_training)
