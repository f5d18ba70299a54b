"""A stand-in for TRL's vLLM generation, for testing a vLLM-shaped capture on a CPU without vLLM.

``GRPOTrainer(use_vllm=True)`` builds ``trl.generation.vllm_generation.VLLMGeneration`` and asks it for completions
and the sampler's per-token logprobs, from which TRL computes its importance-sampling correction.  vLLM needs a GPU;
this class takes its place in a test: built with the same keyword arguments TRL passes, it samples each completion
from the trainer's own model (the weights vLLM would have synced) with TRL's ``temperature``, ``top_k`` and ``top_p``
and a chosen precision, and returns what ``VLLMGeneration.generate`` returns: per prompt its ids, the completion
ids, the sampled token's logprob under the processed distribution (temperature, then truncation, renormalised:
vLLM's ``processed_logprobs``) as ``[[lp], ...]``, and the token ids as ``[[t], ...]``.  It draws from its own
seeded generator, never the trainer's Torch RNG, as a separate vLLM engine would.

Use it by patching the class TRL builds, before the trainer is built:

    >>> from trl.trainer import grpo_trainer  # doctest: +SKIP
    >>> from replayjob.producers.trl.vllm_standin import stand_in  # doctest: +SKIP
    >>> monkeypatch.setattr(grpo_trainer, "VLLMGeneration", stand_in(dtype="bfloat16", seed=0))  # doctest: +SKIP
    >>> trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, top_k=8, temperature=0.9, ...))  # doctest: +SKIP

``dtype``: ``"model"`` (the parameters' dtype) or an autocast dtype (``"bfloat16"``, ``"float16"``) for the
sampler's forward, the precision gap a real vLLM engine in bf16 would open.  ``built`` lists the keyword arguments
of every instance (what TRL asked vLLM for).  What only a real vLLM engine shows is out of its reach: its kernels,
its own batching and sampler, weight syncing across processes and sleep mode.
"""

from __future__ import annotations

from typing import Any, ClassVar

from replayjob.rl.logprobs import truncate
from replayjob.rl.sampling import precision


class StandInVLLM:
    """``VLLMGeneration``'s constructor and ``generate``/``sync_weights`` (see the module docstring)."""

    dtype: ClassVar[str] = "model"
    seed: ClassVar[int] = 0
    built: ClassVar[list[dict[str, Any]]]

    def __init__(self, **kwargs: Any) -> None:
        import torch

        type(self).built.append(kwargs)
        self.model = kwargs["model"]
        self.eos = getattr(kwargs.get("processing_class"), "eos_token_id", None)
        self.temperature = float(kwargs.get("temperature") or 1.0)
        self.top_k = int(kwargs.get("top_k") or 0)
        top_p = kwargs.get("top_p")
        self.top_p = 1.0 if top_p is None else float(top_p)
        self.max_completion_length = int(kwargs["max_completion_length"])
        self.generator = torch.Generator().manual_seed(type(self).seed)

    def sync_weights(self) -> None:
        """Nothing to sync: the stand-in samples from the trainer's own model."""

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int,
                 profiler: Any = None) -> tuple[list[list[int]], list[list[int]], list[list[list[float]]],
                                                list[list[list[int]]]]:
        import torch

        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        completions: list[list[int]] = []
        logprobs: list[list[list[float]]] = []
        try:
            with torch.no_grad():
                for prompt in prompts:
                    ids = torch.tensor([list(prompt)], dtype=torch.int64, device=device)
                    tokens: list[int] = []
                    lps: list[list[float]] = []
                    for _ in range(self.max_completion_length):
                        with precision(type(self).dtype, device):
                            logits = model(input_ids=ids, use_cache=False).logits
                        scaled = truncate(logits[:, -1, :].float() / self.temperature, self.top_k, self.top_p)
                        nxt = torch.multinomial(torch.softmax(scaled, dim=-1).cpu(), 1, generator=self.generator)
                        t = int(nxt[0, 0])
                        tokens.append(t)
                        lps.append([float(torch.log_softmax(scaled, dim=-1)[0, t])])
                        if t == self.eos:
                            break
                        ids = torch.cat([ids, nxt.to(device)], dim=1)
                    completions.append(tokens)
                    logprobs.append(lps)
        finally:
            model.train(was_training)
        return [list(p) for p in prompts], completions, logprobs, [[[t] for t in c] for c in completions]


def stand_in(*, dtype: str = "model", seed: int = 0) -> type[StandInVLLM]:
    """A :class:`StandInVLLM` subclass sampling in ``dtype`` from generator seed ``seed`` (its own ``built`` list)."""
    return type("StandInVLLM", (StandInVLLM,), {"dtype": dtype, "seed": seed, "built": []})
