"""Sampling completions from the policy with the global Torch RNG (CPU or the device's).

Replay never imports this module: exact-input replay performs no sampling.
"""

from __future__ import annotations

import torch

from replayjob.model.backend import Policy


@torch.no_grad()
def sample(policy: Policy, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
    """Return the sampled response tokens of each prompt (EOS included when produced).

    Prompts are left-padded so every row's next token sits in the last column; rows that
    produced EOS are finished and stop growing.
    """
    tok = policy.tokenizer
    model = policy.model
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
        done = [False] * B
        for _ in range(max_new_tokens):
            pos = (att.cumsum(-1) - 1).clamp_min(0)
            logits = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits
            probs = torch.softmax(logits[:, -1, :].float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1)
            for i in range(B):
                if not done[i]:
                    t = int(nxt[i, 0])
                    out[i].append(t)
                    done[i] = t == tok.eos_id
            if all(done):
                break
            fill = torch.tensor([[tok.pad_id if d else 0] for d in done], device=ids.device)
            step_tok = torch.where(torch.tensor(done, device=ids.device)[:, None], fill, nxt)
            ids = torch.cat([ids, step_tok], dim=1)
            att = torch.cat([att, (~torch.tensor(done, device=ids.device))[:, None].to(att.dtype)], dim=1)
        return out
    finally:
        model.train(was_training)
