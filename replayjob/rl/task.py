"""Built-in verifiable toy tasks: prompts generated from the seed, a deterministic reward.

``arithmetic`` asks ``Q:12+34=`` and expects ``46``; ``reverse`` asks ``R:abc=`` and expects
``cba``.  Prompts depend only on (seed, step, index), never on the global RNG, so a resumed run
sees the prompts the uninterrupted run saw.  ``nondeterministic_observation`` prefixes a
wall-clock timestamp, the kind of model-visible observation that makes same-seed runs differ.

Example:
    >>> t = Task("arithmetic", 99)
    >>> t.score("46", "46"), round(t.score("4x", "46"), 3)
    (1.0, 0.3)
"""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str


class Task:
    def __init__(self, name: str, max_operand: int, nondeterministic_observation: bool = False):
        self.name = name
        self.max_operand = max_operand
        self.nondeterministic = nondeterministic_observation

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        rng = random.Random(f"replayjob-task:{self.name}:{seed}:{step}")
        out = []
        for _ in range(n):
            if self.name == "arithmetic":
                a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
                p = Prompt(f"Q:{a}+{b}=", str(a + b))
            else:
                k = rng.randint(1, min(self.max_operand, 12))
                s = "".join(rng.choice(string.ascii_lowercase) for _ in range(k))
                p = Prompt(f"R:{s}=", s[::-1])
            if self.nondeterministic:
                p = Prompt(f"[t={time.time_ns()}]{p.text}", p.answer)
            out.append(p)
        return out

    def alphabet(self) -> str:
        return string.digits if self.name == "arithmetic" else string.ascii_lowercase

    def score(self, completion: str, answer: str) -> float:
        """1 for the exact answer; otherwise partial credit for right characters in place and
        for staying in the answer's alphabet, so early policies still see reward variance."""
        if completion == answer:
            return 1.0
        n = max(len(answer), len(completion), 1)
        in_place = sum(1 for a, b in zip(completion, answer, strict=False) if a == b) / n
        alpha = self.alphabet()
        in_alpha = sum(1 for c in completion if c in alpha) / max(len(completion), 1)
        return 0.5 * in_place + 0.1 * in_alpha
